//! The timeline's content, built from the events in capture order: what
//! each thread did over the recording's time (waited for a lock, held
//! one, waited on a condition variable, at a barrier or on a semaphore),
//! which task the CPU ran, where threads started and ended, and the
//! samples.
//!
//! Slices on one thread's track must nest to be drawn as a stack (the
//! Trace Event Format's rule too). Waits and holds of well-behaved code
//! do; a lock released out of order (A, B taken, A released first) does
//! not, and such slices go to an extra lane of the thread
//! ([`Slice::lane`]), drawn as a row of its own.

use std::collections::{BTreeSet, HashMap};

use events::abi::{Kind, SyncFlags};
use events::db::Row;

use crate::from_db::LockEvents;
use crate::lock_events::LockEventKind;
use crate::plugins::locks::names::LockNames;

/// A thread: (pid, lwpid). An lwpid another process had before is
/// another thread.
pub type Tid = (u32, u32);

/// What a slice on a thread's track shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SliceKind {
    /// From a lock request to the acquisition (none where the recorded
    /// time did not advance between them).
    Wait,
    /// From an acquisition to its release (or the end of the events).
    Hold,
    /// A call that returned without the lock (a trylock that found it
    /// held, a timedlock that timed out): request to return.
    Failed,
    /// A condition variable's wait, its mutex given up: from the call to
    /// its return (`Slice::lock` is the condition variable).
    CondWait,
    /// pthread_barrier_wait, from the call to its return.
    Barrier,
    /// A semaphore's wait (not a trywait), from the call to its return.
    Semaphore,
}

impl SliceKind {
    /// The word a slice's name starts with.
    pub fn verb(self) -> &'static str {
        match self {
            SliceKind::Wait => "wait",
            SliceKind::Hold => "hold",
            SliceKind::Failed => "failed",
            SliceKind::CondWait => "condwait",
            SliceKind::Barrier => "barrier",
            SliceKind::Semaphore => "semwait",
        }
    }
}

/// A slice of a thread's track, in nanoseconds of the recorded run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice {
    pub tid: Tid,
    pub kind: SliceKind,
    pub lock: u64,
    pub start: u64,
    pub end: u64,
    /// The sequence number of the request event (whose stack it shows).
    pub request: u64,
    /// The return address into the request's caller (0 unknown).
    pub site: u64,
    /// Still open when the events ended (`end` is their last time).
    pub unfinished: bool,
    /// A hold whose release woke a waiter: the flow's id.
    pub wakes: Option<u64>,
    /// A wait ended by another thread's release: the flow's id.
    pub woken_by: Option<u64>,
    /// The lane of the thread it is drawn in (0: the thread's own row).
    pub lane: u32,
    /// How deep it nests in its lane (0: outermost).
    pub depth: u32,
}

/// A task on the CPU from `start` to `end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub tid: Tid,
    pub start: u64,
    pub end: u64,
}

/// A point event of a thread: its creation, exit, a join, a fork.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Instant {
    pub tid: Tid,
    pub time: u64,
    pub kind: Kind,
    pub value: Option<i64>,
}

/// A SAMPLE event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub tid: Tid,
    pub time: u64,
    pub seq: u64,
    /// The sampled instruction.
    pub rip: u64,
    /// Taken in user mode (SAMPLE value 0).
    pub user: bool,
}

/// A pending lock request.
#[derive(Clone, Copy)]
struct Request {
    time: u64,
    lock: u64,
    seq: u64,
    site: u64,
    /// Another thread held the lock when it was made.
    blocked: bool,
}

/// What the lock events have left open so far.
#[derive(Default)]
struct LockState {
    /// Each thread's request not yet returned.
    pending: HashMap<Tid, Request>,
    /// Open holds per thread, innermost last: slice indices.
    held: HashMap<Tid, Vec<usize>>,
    /// (Lock, thread) -> how deep the thread holds it.
    depth: HashMap<(u64, Tid), u32>,
    /// Lock -> the thread that holds it exclusively (a mutex, a write
    /// lock); the others are held for reading.
    exclusive: HashMap<u64, Tid>,
    /// Open waits per thread that are not for a lock (a condition
    /// variable's, a barrier's, a semaphore's): slice index.
    waiting: HashMap<Tid, usize>,
    /// Threads in a semaphore's trywait, which waits for nothing.
    trying: BTreeSet<Tid>,
    /// Lock -> the hold slice of its last release.
    last_release: HashMap<u64, usize>,
}

/// The timeline, fed one event at a time in capture order.
#[derive(Default)]
pub struct Builder {
    pub slices: Vec<Slice>,
    pub runs: Vec<Run>,
    pub instants: Vec<Instant>,
    pub samples: Vec<Sample>,
    /// Threads that raised probe events or were sampled: the rows.
    pub threads: BTreeSet<Tid>,
    /// What names each lock: its first user, its first init.
    pub names: LockNames,
    /// Events that contradict the lock model (not drawn).
    pub anomalies: u64,
    /// Per thread with slices, the levels of each of its lanes (after
    /// [`Builder::finish`]).
    pub lanes: HashMap<Tid, Vec<u32>>,
    locks: LockState,
    rows: LockEvents,
    /// The task on the CPU since, from the last context switch.
    on_cpu: Option<(Tid, u64)>,
    /// The first and last event times.
    pub first: Option<u64>,
    pub last: u64,
}

impl Builder {
    pub fn push(&mut self, row: &Row) {
        self.first.get_or_insert(row.time);
        self.names.event(row);
        self.last = self.last.max(row.time);
        let tid = (row.pid, row.lwpid);
        match row.kind {
            Kind::ContextSwitch => self.switch(row),
            Kind::Sample => {
                self.threads.insert(tid);
                if let Some(rip) = row.addr {
                    self.samples.push(Sample {
                        tid,
                        time: row.time,
                        seq: row.seq,
                        rip,
                        user: row.value == Some(0),
                    });
                }
            }
            Kind::LockInit => {}
            Kind::ThreadCreate | Kind::ThreadSpawn | Kind::ThreadJoin | Kind::Exit | Kind::Fork => {
                self.threads.insert(tid);
                self.instants.push(Instant {
                    tid,
                    time: row.time,
                    kind: row.kind,
                    value: row.value,
                });
            }
            Kind::Barrier => self.wait_starts(tid, SliceKind::Barrier, row),
            Kind::SemWait if row.value.is_some_and(|f| f as u32 & SyncFlags::TRY != 0) => {
                self.threads.insert(tid);
                self.locks.trying.insert(tid);
            }
            Kind::SemWait => self.wait_starts(tid, SliceKind::Semaphore, row),
            Kind::SemWaitRet if self.locks.trying.remove(&tid) => {}
            Kind::BarrierRet | Kind::SemWaitRet => self.wait_ends(tid, row.time),
            _ => {
                if let Some(e) = self.rows.event(row) {
                    self.threads.insert(tid);
                    self.names.used(e.lock, row.pid);
                    self.lock(tid, e.lock, e.kind, row);
                }
            }
        }
    }

    fn switch(&mut self, row: &Row) {
        // pid/lwpid switched out; addr = pid, value = lwpid switched in.
        if let Some((tid, since)) = self.on_cpu.take() {
            if row.time > since {
                self.runs.push(Run {
                    tid,
                    start: since,
                    end: row.time,
                });
            }
        }
        let next = match (row.addr.map(u32::try_from), row.value.map(u32::try_from)) {
            (Some(Ok(pid)), Some(Ok(lwpid))) => (pid, lwpid),
            _ => return,
        };
        // The idle task is no work.
        if next.1 != 0 {
            self.on_cpu = Some((next, row.time));
        }
    }

    /// A wait that is not for a lock starts (`row`: its call).
    fn wait_starts(&mut self, tid: Tid, kind: SliceKind, row: &Row) {
        self.threads.insert(tid);
        let Some(object) = row.addr else {
            return;
        };
        self.names.used(object, tid.0);
        let slice = Slice {
            tid,
            kind,
            lock: object,
            start: row.time,
            end: u64::MAX,
            request: row.seq,
            site: row.caller.unwrap_or(0),
            unfinished: false,
            wakes: None,
            woken_by: None,
            lane: 0,
            depth: 0,
        };
        if self.locks.waiting.insert(tid, self.slices.len()).is_some() {
            self.anomalies += 1;
        }
        self.slices.push(slice);
    }

    /// The thread's wait that is not for a lock ended at `time`.
    fn wait_ends(&mut self, tid: Tid, time: u64) {
        match self.locks.waiting.remove(&tid) {
            Some(i) => self.slices[i].end = time,
            None => self.anomalies += 1,
        }
    }

    /// Whether `tid` may take `lock` now (`shared`: for reading).
    fn may_take(&self, tid: Tid, lock: u64, shared: bool) -> bool {
        let locks = &self.locks;
        let excluded = locks.exclusive.get(&lock).is_some_and(|&o| o != tid);
        let read_by_other = || locks.depth.keys().any(|&(l, t)| l == lock && t != tid);
        !excluded && (shared || !read_by_other())
    }

    /// `tid` holds `lock` from `row` on: its hold slice opens.
    fn take(&mut self, tid: Tid, lock: u64, shared: bool, slice: Slice) {
        *self.locks.depth.entry((lock, tid)).or_insert(0) += 1;
        if !shared {
            self.locks.exclusive.insert(lock, tid);
        }
        self.locks
            .held
            .entry(tid)
            .or_default()
            .push(self.slices.len());
        self.slices.push(slice);
    }

    /// `tid` gives `lock` up at `time`: whether it held it.
    fn give_up(&mut self, tid: Tid, lock: u64, time: u64) -> bool {
        let Some(depth) = self.locks.depth.get_mut(&(lock, tid)) else {
            return false;
        };
        *depth -= 1;
        if *depth == 0 {
            self.locks.depth.remove(&(lock, tid));
            if self.locks.exclusive.get(&lock) == Some(&tid) {
                self.locks.exclusive.remove(&lock);
            }
        }
        let held = self.locks.held.entry(tid).or_default();
        let slices = &self.slices;
        let Some(at) = held.iter().rposition(|&i| slices[i].lock == lock) else {
            return false;
        };
        let i = held.remove(at);
        self.slices[i].end = time;
        let free = !self.locks.depth.keys().any(|&(l, _)| l == lock);
        if free {
            self.locks.last_release.insert(lock, i);
        }
        true
    }

    fn lock(&mut self, tid: Tid, lock: u64, kind: LockEventKind, row: &Row) {
        let slice = |kind, start, end, request: u64, site: u64| Slice {
            tid,
            kind,
            lock,
            start,
            end,
            request,
            site,
            unfinished: false,
            wakes: None,
            woken_by: None,
            lane: 0,
            depth: 0,
        };
        match kind {
            LockEventKind::Request(op) => {
                let request = Request {
                    time: row.time,
                    lock,
                    seq: row.seq,
                    site: row.caller.unwrap_or(0),
                    blocked: !self.may_take(tid, lock, op.shared()) && !op.tries(),
                };
                if self.locks.pending.insert(tid, request).is_some() {
                    self.anomalies += 1;
                }
            }
            LockEventKind::Return(op, result) => {
                let Some(request) = self.locks.pending.remove(&tid).filter(|r| r.lock == lock)
                else {
                    self.anomalies += 1;
                    return;
                };
                if result != 0 {
                    let failed = slice(
                        SliceKind::Failed,
                        request.time,
                        row.time,
                        request.seq,
                        request.site,
                    );
                    self.slices.push(failed);
                    return;
                }
                if !self.may_take(tid, lock, op.shared()) {
                    self.anomalies += 1;
                    return;
                }
                let mut wait = slice(
                    SliceKind::Wait,
                    request.time,
                    row.time,
                    request.seq,
                    request.site,
                );
                if request.blocked {
                    // Woken by the release that came last before it.
                    if let Some(&i) = self.locks.last_release.get(&lock) {
                        let releaser = &mut self.slices[i];
                        if releaser.tid != tid && releaser.end >= request.time {
                            let id = releaser.request;
                            releaser.wakes = Some(id);
                            wait.woken_by = Some(id);
                        }
                    }
                }
                // A request granted at once has nothing to draw.
                if wait.end > wait.start || wait.woken_by.is_some() {
                    self.slices.push(wait);
                }
                let hold = slice(
                    SliceKind::Hold,
                    row.time,
                    u64::MAX,
                    request.seq,
                    request.site,
                );
                self.take(tid, lock, op.shared(), hold);
            }
            LockEventKind::Release => {
                if !self.give_up(tid, lock, row.time) {
                    self.anomalies += 1;
                }
            }
            LockEventKind::CondWait { cond } => {
                // The mutex is given up while the thread waits on the
                // condition variable, which the wait's slice shows.
                if !self.give_up(tid, lock, row.time) {
                    self.anomalies += 1;
                }
                let mut wait = slice(
                    SliceKind::CondWait,
                    row.time,
                    u64::MAX,
                    row.seq,
                    row.caller.unwrap_or(0),
                );
                wait.lock = cond;
                self.names.used(cond, tid.0);
                if self.locks.waiting.insert(tid, self.slices.len()).is_some() {
                    self.anomalies += 1;
                }
                self.slices.push(wait);
            }
            LockEventKind::CondWake(_) => {
                self.wait_ends(tid, row.time);
                if !self.may_take(tid, lock, false) {
                    self.anomalies += 1;
                    return;
                }
                let hold = slice(
                    SliceKind::Hold,
                    row.time,
                    u64::MAX,
                    row.seq,
                    row.caller.unwrap_or(0),
                );
                self.take(tid, lock, false, hold);
            }
        }
    }

    /// After the last event: what is still open ends at the last event,
    /// marked unfinished; lanes and depths are assigned.
    pub fn finish(&mut self) {
        let end = self.last;
        for s in &mut self.slices {
            if s.end == u64::MAX {
                s.end = end;
                s.unfinished = true;
            }
        }
        for (tid, r) in std::mem::take(&mut self.locks.pending) {
            self.slices.push(Slice {
                tid,
                kind: SliceKind::Wait,
                lock: r.lock,
                start: r.time,
                end,
                request: r.seq,
                site: r.site,
                unfinished: true,
                wakes: None,
                woken_by: None,
                lane: 0,
                depth: 0,
            });
        }
        if let Some((tid, since)) = self.on_cpu.take() {
            if end > since {
                self.runs.push(Run {
                    tid,
                    start: since,
                    end,
                });
            }
        }
        self.lanes = assign_lanes(&mut self.slices);
    }
}

/// Sorts `slices` by thread and start (longest first at one start) and
/// gives each the first lane of its thread where it nests inside what is
/// open there, and its depth in that lane. Returns, per thread with
/// slices, how many levels each of its lanes has (its deepest depth + 1).
pub fn assign_lanes(slices: &mut [Slice]) -> HashMap<Tid, Vec<u32>> {
    let mut levels: HashMap<Tid, Vec<u32>> = HashMap::new();
    slices.sort_by(|a, b| {
        (a.tid, a.start, b.end, a.kind as u8).cmp(&(b.tid, b.start, a.end, b.kind as u8))
    });
    let mut lanes: Vec<Vec<u64>> = Vec::new();
    let mut thread = None;
    for s in slices.iter_mut() {
        if thread != Some(s.tid) {
            thread = Some(s.tid);
            lanes.clear();
        }
        let mut placed = None;
        for (i, open) in lanes.iter_mut().enumerate() {
            while open.last().is_some_and(|&end| end <= s.start) {
                open.pop();
            }
            if open.last().is_none_or(|&end| end >= s.end) {
                placed = Some(i);
                break;
            }
        }
        let i = placed.unwrap_or_else(|| {
            lanes.push(Vec::new());
            lanes.len() - 1
        });
        s.lane = i as u32;
        s.depth = lanes[i].len() as u32;
        lanes[i].push(s.end);
        let of_thread = levels.entry(s.tid).or_default();
        if of_thread.len() <= i {
            of_thread.resize(i + 1, 0);
        }
        of_thread[i] = of_thread[i].max(s.depth + 1);
    }
    levels
}

/// A part of the recorded time, in nanoseconds: what a timeline shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub from: u64,
    pub to: u64,
}

impl Window {
    pub const ALL: Window = Window {
        from: 0,
        to: u64::MAX,
    };

    /// Whether the interval [start, end] shows in the window.
    pub fn overlaps(&self, start: u64, end: u64) -> bool {
        start <= self.to && end >= self.from
    }

    pub fn contains(&self, time: u64) -> bool {
        (self.from..=self.to).contains(&time)
    }

    /// [start, end] cut to the window.
    pub fn clip(&self, start: u64, end: u64) -> (u64, u64) {
        (start.max(self.from), end.min(self.to))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use events::abi::Source;

    fn row(time: u64, lwpid: u32, kind: Kind, lock: u64, value: Option<i64>) -> Row {
        Row {
            seq: time,
            time,
            kind,
            source: Source::Probe,
            pid: 1,
            lwpid,
            addr: Some(lock),
            caller: Some(0x1000 + time),
            value,
        }
    }

    fn build(rows: &[Row]) -> Builder {
        let mut b = Builder::default();
        for r in rows {
            b.push(r);
        }
        b.finish();
        b
    }

    fn spans(b: &Builder, lwpid: u32) -> Vec<(SliceKind, u64, u64, u32, u32)> {
        b.slices
            .iter()
            .filter(|s| s.tid.1 == lwpid)
            .map(|s| (s.kind, s.start, s.end, s.lane, s.depth))
            .collect()
    }

    #[test]
    fn a_condition_variable_wait_is_a_state_of_its_own_and_no_hold() {
        let b = build(&[
            row(0, 1, Kind::Lock, 0xa, None),
            row(0, 1, Kind::LockRet, 0xa, Some(0)),
            // 1 waits on the condition variable 0xc, giving 0xa up.
            row(5, 1, Kind::CondWait, 0xa, Some(0xc)),
            row(10, 2, Kind::Lock, 0xa, None),
            row(10, 2, Kind::LockRet, 0xa, Some(0)),
            row(12, 2, Kind::CondSignal, 0xc, None),
            row(12, 2, Kind::Unlock, 0xa, None),
            row(14, 1, Kind::CondWaitRet, 0xa, Some(0)),
            row(20, 1, Kind::Unlock, 0xa, None),
            row(21, 2, Kind::Barrier, 0xd, None),
            row(25, 2, Kind::BarrierRet, 0xd, Some(0)),
            row(26, 2, Kind::SemWait, 0xe, Some(0)),
            row(28, 2, Kind::SemWaitRet, 0xe, Some(0)),
            // A trywait waits for nothing: no slice.
            row(29, 2, Kind::SemWait, 0xe, Some(i64::from(SyncFlags::TRY))),
            row(29, 2, Kind::SemWaitRet, 0xe, Some(-1)),
        ]);
        assert_eq!(b.anomalies, 0);
        assert_eq!(
            spans(&b, 1),
            [
                (SliceKind::Hold, 0, 5, 0, 0),
                (SliceKind::CondWait, 5, 14, 0, 0),
                (SliceKind::Hold, 14, 20, 0, 0)
            ]
        );
        let wait = b.slices.iter().find(|s| s.kind == SliceKind::CondWait);
        assert_eq!(wait.map(|s| s.lock), Some(0xc));
        assert_eq!(
            spans(&b, 2),
            [
                (SliceKind::Hold, 10, 12, 0, 0),
                (SliceKind::Barrier, 21, 25, 0, 0),
                (SliceKind::Semaphore, 26, 28, 0, 0)
            ]
        );
    }

    #[test]
    fn a_contended_lock_shows_the_wait_the_hold_and_who_woke_whom() {
        let b = build(&[
            row(0, 1, Kind::Lock, 0xa, None),
            row(1, 1, Kind::LockRet, 0xa, Some(0)),
            row(5, 2, Kind::Lock, 0xa, None),
            row(30, 1, Kind::Unlock, 0xa, None),
            // Granted at once: no wait to draw.
            row(30, 1, Kind::Lock, 0xb, None),
            row(30, 1, Kind::LockRet, 0xb, Some(0)),
            row(30, 1, Kind::Unlock, 0xb, None),
            row(31, 2, Kind::LockRet, 0xa, Some(0)),
            row(40, 2, Kind::Unlock, 0xa, None),
        ]);
        use SliceKind::*;
        assert_eq!(
            spans(&b, 1),
            [
                (Wait, 0, 1, 0, 0),
                (Hold, 1, 30, 0, 0),
                (Hold, 30, 30, 0, 0)
            ]
        );
        assert_eq!(spans(&b, 2), [(Wait, 5, 31, 0, 0), (Hold, 31, 40, 0, 0)]);
        let hold1 = b.slices.iter().find(|s| s.tid.1 == 1 && s.kind == Hold);
        let wait2 = b.slices.iter().find(|s| s.tid.1 == 2 && s.kind == Wait);
        let id = hold1.unwrap().wakes;
        assert!(id.is_some());
        assert_eq!(wait2.unwrap().woken_by, id);
        assert_eq!(b.anomalies, 0);
    }

    #[test]
    fn nested_locks_nest_and_out_of_order_releases_take_another_lane() {
        let b = build(&[
            row(0, 1, Kind::Lock, 0xa, None),
            row(1, 1, Kind::LockRet, 0xa, Some(0)),
            row(2, 1, Kind::Lock, 0xb, None),
            row(3, 1, Kind::LockRet, 0xb, Some(0)),
            row(4, 1, Kind::Unlock, 0xb, None),
            // Now A then B, A released first.
            row(5, 1, Kind::Lock, 0xb, None),
            row(6, 1, Kind::LockRet, 0xb, Some(0)),
            row(9, 1, Kind::Unlock, 0xa, None),
            row(12, 1, Kind::Unlock, 0xb, None),
        ]);
        use SliceKind::*;
        assert_eq!(
            spans(&b, 1),
            [
                (Wait, 0, 1, 0, 0),
                (Hold, 1, 9, 0, 0),
                (Wait, 2, 3, 0, 1),
                (Hold, 3, 4, 0, 1),
                (Wait, 5, 6, 0, 1),
                (Hold, 6, 12, 1, 0),
            ]
        );
        assert_eq!(b.lanes[&(1, 1)], [2, 1]);
    }

    #[test]
    fn failures_recursion_and_what_never_ended() {
        let b = build(&[
            row(0, 1, Kind::Lock, 0xa, None),
            row(1, 1, Kind::LockRet, 0xa, Some(0)),
            row(2, 1, Kind::Lock, 0xa, None),
            row(3, 1, Kind::LockRet, 0xa, Some(0)),
            row(4, 2, Kind::TryLock, 0xa, None),
            row(5, 2, Kind::TryLockRet, 0xa, Some(16)),
            row(6, 1, Kind::Unlock, 0xa, None),
            row(7, 2, Kind::Lock, 0xa, None),
            row(8, 3, Kind::Unlock, 0xa, None),
        ]);
        use SliceKind::*;
        assert_eq!(
            spans(&b, 1),
            [
                (Wait, 0, 1, 0, 0),
                (Hold, 1, 8, 0, 0),
                (Wait, 2, 3, 0, 1),
                (Hold, 3, 6, 0, 1),
            ]
        );
        assert_eq!(spans(&b, 2), [(Failed, 4, 5, 0, 0), (Wait, 7, 8, 0, 0)]);
        assert!(b.slices.iter().filter(|s| s.unfinished).count() == 2);
        // The release by thread 3, which held nothing.
        assert_eq!(b.anomalies, 1);
    }

    #[test]
    fn context_switches_give_runs_without_the_idle_task() {
        let switch = |time, from: u32, to_pid: u64, to: i64| Row {
            seq: time,
            time,
            kind: Kind::ContextSwitch,
            source: Source::Kernel,
            pid: 1,
            lwpid: from,
            addr: Some(to_pid),
            caller: None,
            value: Some(to),
        };
        let b = build(&[
            switch(10, 0, 1, 2),
            switch(20, 2, 0, 0),
            switch(25, 0, 1, 3),
            switch(40, 3, 1, 2),
        ]);
        let runs: Vec<_> = b.runs.iter().map(|r| (r.tid.1, r.start, r.end)).collect();
        assert_eq!(runs, [(2, 10, 20), (3, 25, 40)]);
    }

    #[test]
    fn windows_clip() {
        let w = Window { from: 10, to: 20 };
        assert!(w.overlaps(5, 10) && w.overlaps(20, 30) && !w.overlaps(0, 9));
        assert_eq!(w.clip(5, 30), (10, 20));
        assert!(w.contains(10) && !w.contains(21));
    }
}
