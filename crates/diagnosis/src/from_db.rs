//! Reading the analyses' inputs from an event database.

use events::abi::Kind;
use events::db::{DbError, EventDb};

use std::collections::{BTreeMap, HashMap};

use events::abi::Source;
use events::db::Row;

use crate::deadlock::{self, ThreadEvent};
use crate::lock_events::{LockEvent, LockEventKind, LockOp};

/// The kinds that lock analyses read, then LOCKINIT (where a lock was set
/// up), which names locks.
pub const LOCK_KINDS_AND_INIT: [Kind; 8] = [
    Kind::Lock,
    Kind::LockRet,
    Kind::TryLock,
    Kind::TryLockRet,
    Kind::TimedLock,
    Kind::TimedLockRet,
    Kind::Unlock,
    Kind::LockInit,
];

/// The kinds that lock analyses read.
pub const LOCK_KINDS: &[Kind] = LOCK_KINDS_AND_INIT.split_at(7).0;

/// The lock event a row stands for, if it is one the analyses can use.
pub fn lock_event(r: &Row) -> Option<LockEvent> {
    let lock = r.addr?;
    let result = r.value.and_then(|v| i32::try_from(v).ok());
    let kind = match (r.kind, result) {
        (Kind::Lock, _) => LockEventKind::Request(LockOp::Lock),
        (Kind::TryLock, _) => LockEventKind::Request(LockOp::TryLock),
        (Kind::TimedLock, _) => LockEventKind::Request(LockOp::TimedLock),
        (Kind::LockRet, Some(v)) => LockEventKind::Return(LockOp::Lock, v),
        (Kind::TryLockRet, Some(v)) => LockEventKind::Return(LockOp::TryLock, v),
        (Kind::TimedLockRet, Some(v)) => LockEventKind::Return(LockOp::TimedLock, v),
        (Kind::Unlock, _) => LockEventKind::Release,
        _ => return None,
    };
    Some(LockEvent {
        time: r.time,
        thread: r.lwpid,
        lock,
        kind,
        site: r.caller.unwrap_or(0),
    })
}

/// The deadlock detector's input, per process (locks are addresses in a
/// process): lock events, thread creations and joins, in capture order.
///
/// A THREADCREATE says how many events its creator had raised; that is
/// turned into how many of the creator's events in the detector's input
/// came before the creation (`ThreadEvent::Create::after`).
#[derive(Default)]
pub struct DeadlockInput {
    out: BTreeMap<u32, Vec<deadlock::Event>>,
    // Per thread: its input events so far, and that count before each of
    // the events it raised.
    own: HashMap<u32, u64>,
    history: HashMap<u32, Vec<u64>>,
}

impl DeadlockInput {
    /// Takes every event, in capture order (it counts each thread's).
    pub fn push(&mut self, r: &Row) {
        if r.source != Source::Probe {
            return;
        }
        let before = self.own.get(&r.lwpid).copied().unwrap_or(0);
        self.history.entry(r.lwpid).or_default().push(before);
        let event = match r.kind {
            Kind::ThreadCreate => r.value.and_then(|p| u32::try_from(p).ok()).map(|parent| {
                let raised = r.caller.and_then(|n| usize::try_from(n).ok());
                let seen = self.history.get(&parent);
                let after = match (raised, seen) {
                    (Some(n), Some(h)) if n < h.len() => Some(h[n]),
                    (Some(n), Some(h)) if n == h.len() => self.own.get(&parent).copied(),
                    (Some(0), None) => Some(0),
                    _ => None,
                };
                deadlock::Event::Thread(ThreadEvent::Create {
                    time: r.time,
                    parent,
                    child: r.lwpid,
                    after,
                })
            }),
            Kind::ThreadJoin => r.value.and_then(|j| u32::try_from(j).ok()).map(|joined| {
                deadlock::Event::Thread(ThreadEvent::Join {
                    time: r.time,
                    joiner: r.lwpid,
                    joined,
                })
            }),
            k if LOCK_KINDS.contains(&k) => lock_event(r).map(deadlock::Event::Lock),
            _ => None,
        };
        if let Some(e) = event {
            if !matches!(e, deadlock::Event::Thread(ThreadEvent::Create { .. })) {
                *self.own.entry(r.lwpid).or_insert(0) += 1;
            }
            self.out.entry(r.pid).or_default().push(e);
        }
    }

    /// The input per process.
    pub fn finish(self) -> BTreeMap<u32, Vec<deadlock::Event>> {
        self.out
    }
}

/// [`DeadlockInput`] over a whole database.
pub fn deadlock_events(db: &EventDb) -> Result<BTreeMap<u32, Vec<deadlock::Event>>, DbError> {
    let mut input = DeadlockInput::default();
    db.for_each(&[], |r| {
        input.push(&r);
        Ok(())
    })?;
    Ok(input.finish())
}

/// The lock events of the database in capture order, as the contention
/// analysis takes them. LOCKINIT events are not lock operations and are
/// left out; so is a `_RET` event without a result (it cannot be judged).
pub fn lock_events(db: &EventDb) -> Result<Vec<LockEvent>, DbError> {
    let mut out = Vec::new();
    db.for_each(LOCK_KINDS, |r| {
        out.extend(lock_event(&r));
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_db::TestDb;
    use events::abi::Source;
    use events::db::Row;

    #[test]
    fn maps_rows_to_lock_events() {
        let row = |time, kind, value| Row {
            seq: 0,
            time,
            kind,
            source: Source::Probe,
            pid: 1,
            lwpid: 2,
            addr: Some(0x40),
            caller: None,
            value,
        };
        let mut create = row(5, Kind::ThreadCreate, Some(1));
        (create.lwpid, create.caller) = (9, Some(0));
        let test_db = TestDb::with_rows(
            "fromdb",
            &[
                row(1, Kind::TryLock, None),
                row(2, Kind::TryLockRet, Some(16)),
                row(3, Kind::LockInit, Some(0)),
                row(4, Kind::Unlock, None),
                create,
                row(6, Kind::ThreadJoin, Some(3)),
            ],
        );
        let db = &test_db.db;
        let per_process = deadlock_events(db).unwrap();
        assert_eq!(per_process.len(), 1);
        assert_eq!(per_process[&1].len(), 5);
        // Thread 1 had raised nothing when it created thread 9.
        assert_eq!(
            per_process[&1][3],
            deadlock::Event::Thread(ThreadEvent::Create {
                time: 5,
                parent: 1,
                child: 9,
                after: Some(0),
            })
        );
        let events = lock_events(db).unwrap();
        let kinds: Vec<_> = events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                LockEventKind::Request(LockOp::TryLock),
                LockEventKind::Return(LockOp::TryLock, 16),
                LockEventKind::Release
            ]
        );
        assert!(events.iter().all(|e| e.thread == 2 && e.lock == 0x40));
    }
}
