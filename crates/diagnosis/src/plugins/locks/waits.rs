//! Waits that are not for a lock: on condition variables, at barriers and
//! on semaphores, per object, from the CONDWAIT .. SEMPOST events. A wait
//! lasts from the call to its return; a condition variable's wait gives
//! its mutex up meanwhile (the contention analysis counts that).

use std::collections::HashMap;

use events::abi::{Kind, SyncFlags};
use events::db::Row;

use super::contention::Durations;
use crate::lock_events::ETIMEDOUT;

/// What an object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WaitObject {
    CondVar,
    Barrier,
    Semaphore,
}

impl WaitObject {
    pub fn name(self) -> &'static str {
        match self {
            WaitObject::CondVar => "condition variable",
            WaitObject::Barrier => "barrier",
            WaitObject::Semaphore => "semaphore",
        }
    }
}

/// One object's waits and wake-ups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitStats {
    pub object: WaitObject,
    /// Calls that may wait (trywaits included), and how long they took.
    pub waits: Durations,
    /// Trywaits that found nothing, timed waits that gave up.
    pub failed: u64,
    /// Signals, broadcasts or posts.
    pub wakeups: u64,
    pub broadcasts: u64,
}

impl WaitStats {
    fn new(object: WaitObject) -> Self {
        WaitStats {
            object,
            waits: Durations::default(),
            failed: 0,
            wakeups: 0,
            broadcasts: 0,
        }
    }
}

/// The analysis, fed the sync events in capture order.
#[derive(Default)]
pub struct Waits {
    pub objects: HashMap<u64, WaitStats>,
    /// Per thread, its wait under way: object, since, a trywait.
    pending: HashMap<u32, (u64, u64, bool)>,
    /// Returns without a call, calls before the last returned.
    pub anomalies: u64,
}

impl Waits {
    pub fn push(&mut self, r: &Row) {
        let Some(addr) = r.addr else {
            return;
        };
        let stats = |objects: &mut HashMap<u64, WaitStats>, at: u64, object| {
            objects.entry(at).or_insert_with(|| WaitStats::new(object));
        };
        match r.kind {
            Kind::CondWait => {
                // The row's address is the mutex; the value the variable.
                let cond = r.value.unwrap_or(0) as u64;
                stats(&mut self.objects, cond, WaitObject::CondVar);
                self.start(r.lwpid, cond, r.time, false);
            }
            Kind::Barrier => {
                stats(&mut self.objects, addr, WaitObject::Barrier);
                self.start(r.lwpid, addr, r.time, false);
            }
            Kind::SemWait => {
                stats(&mut self.objects, addr, WaitObject::Semaphore);
                let flags = r.value.unwrap_or(0) as u32;
                self.start(r.lwpid, addr, r.time, flags & SyncFlags::TRY != 0);
            }
            Kind::CondWaitRet | Kind::BarrierRet | Kind::SemWaitRet => {
                let Some((object, since, tried)) = self.pending.remove(&r.lwpid) else {
                    self.anomalies += 1;
                    return;
                };
                let Some(s) = self.objects.get_mut(&object) else {
                    return;
                };
                s.waits.add(r.time.saturating_sub(since));
                let result = r.value.unwrap_or(0);
                s.failed += u64::from(
                    match r.kind {
                        Kind::SemWaitRet => result != 0,
                        Kind::CondWaitRet => result == i64::from(ETIMEDOUT),
                        _ => false,
                    } || (tried && result != 0),
                );
            }
            Kind::CondSignal | Kind::CondBroadcast => {
                stats(&mut self.objects, addr, WaitObject::CondVar);
                if let Some(s) = self.objects.get_mut(&addr) {
                    s.wakeups += 1;
                    s.broadcasts += u64::from(r.kind == Kind::CondBroadcast);
                }
            }
            Kind::SemPost => {
                stats(&mut self.objects, addr, WaitObject::Semaphore);
                if let Some(s) = self.objects.get_mut(&addr) {
                    s.wakeups += 1;
                }
            }
            _ => {}
        }
    }

    fn start(&mut self, thread: u32, object: u64, time: u64, tried: bool) {
        if self.pending.insert(thread, (object, time, tried)).is_some() {
            self.anomalies += 1;
        }
    }

    /// The objects by kind, then by time spent waiting (most first).
    pub fn ranked(&self) -> Vec<(u64, &WaitStats)> {
        let mut v: Vec<(u64, &WaitStats)> = self.objects.iter().map(|(&a, s)| (a, s)).collect();
        v.sort_by(|a, b| {
            (a.1.object, b.1.waits.total, a.0).cmp(&(b.1.object, a.1.waits.total, b.0))
        });
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use events::abi::Source;

    fn row(time: u64, lwpid: u32, kind: Kind, addr: u64, value: Option<i64>) -> Row {
        Row {
            seq: time,
            time,
            kind,
            source: Source::Probe,
            pid: 1,
            lwpid,
            addr: Some(addr),
            caller: None,
            value,
        }
    }

    #[test]
    fn waits_and_wakeups_per_object() {
        let mut w = Waits::default();
        for r in [
            row(0, 1, Kind::CondWait, 0xa, Some(0xc)),
            row(4, 2, Kind::CondSignal, 0xc, None),
            row(6, 1, Kind::CondWaitRet, 0xa, Some(0)),
            row(7, 1, Kind::CondWait, 0xa, Some(0xc)),
            row(17, 1, Kind::CondWaitRet, 0xa, Some(i64::from(ETIMEDOUT))),
            row(20, 1, Kind::SemWait, 0xe, Some(i64::from(SyncFlags::TRY))),
            row(20, 1, Kind::SemWaitRet, 0xe, Some(-1)),
            row(21, 2, Kind::SemPost, 0xe, None),
            row(22, 1, Kind::Barrier, 0xb, None),
            row(25, 1, Kind::BarrierRet, 0xb, Some(-1)),
        ] {
            w.push(&r);
        }
        assert_eq!(w.anomalies, 0);
        let c = &w.objects[&0xc];
        assert_eq!(
            (c.waits.count, c.waits.total, c.failed, c.wakeups),
            (2, 16, 1, 1)
        );
        let s = &w.objects[&0xe];
        assert_eq!(
            (s.object, s.waits.count, s.failed, s.wakeups),
            (WaitObject::Semaphore, 1, 1, 1)
        );
        let b = &w.objects[&0xb];
        assert_eq!((b.waits.count, b.waits.total, b.failed), (1, 3, 0));
        let order: Vec<u64> = w.ranked().iter().map(|(a, _)| *a).collect();
        assert_eq!(order, [0xc, 0xb, 0xe]);
    }
}
