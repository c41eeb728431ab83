//! Lock contention, modelled on mutrace: the lock state is simulated from
//! the request/return/release events of every thread, in time order.
//!
//! Definitions (per lock):
//! - *requests*: calls to lock, trylock or timedlock (a read-write lock's
//!   read or write lock likewise), and the mutex a condition variable's
//!   wait takes again as it returns;
//! - *acquisitions*: those that returned 0, and every return of a
//!   condition variable's wait (it returns holding the mutex);
//! - *blocked*: requests made while another thread held the lock (a
//!   failed trylock is counted as a trylock failure, not as blocked);
//! - *contended*: acquisitions whose request was blocked;
//! - *ownership changes*: acquisitions by a thread other than the previous
//!   owner;
//! - *hold time*: acquisition to release, and how much of it the holder
//!   spent off the CPU (switched out, from the context switches); *wait
//!   time*: request to acquisition, in replay time units;
//! - *condition waits*: a condition variable's waits on the mutex (from
//!   the wait's call, which gives the mutex up, to its return, which holds
//!   it again): time the thread neither held nor waited for the lock.
//!
//! A read-write lock's read locks are held by any number of threads at
//! once: a read request blocks only behind a writer, a write request
//! behind any other holder.
//!
//! Anything inconsistent (a release by a non-owner, a return without a
//! request, time going backwards) is counted as an anomaly, not trusted.

use std::collections::HashMap;

use crate::lock_events::{LockEvent, LockEventKind, LockOp, ETIMEDOUT};
use crate::render::percent;

/// Totals and extremes of a duration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Durations {
    pub total: u64,
    pub max: u64,
    pub count: u64,
}

impl Durations {
    pub(crate) fn add(&mut self, d: u64) {
        self.total = self.total.saturating_add(d);
        self.max = self.max.max(d);
        self.count += 1;
    }

    /// Mean, 0 when empty.
    pub fn avg(&self) -> u64 {
        self.total.checked_div(self.count).unwrap_or(0)
    }
}

/// Statistics of one lock (or of one thread's use of it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LockStats {
    pub requests: u64,
    pub acquisitions: u64,
    pub blocked: u64,
    pub contended: u64,
    pub ownership_changes: u64,
    pub trylock_failures: u64,
    pub timedlock_timeouts: u64,
    pub hold: Durations,
    /// Of the hold time, how much the holders spent off the CPU (where the
    /// context switches are known).
    pub hold_off_cpu: u64,
    pub wait: Durations,
    /// A read-write lock (its calls were pthread_rwlock_*).
    pub rwlock: bool,
    /// Read locks of a read-write lock among the acquisitions.
    pub shared_acquisitions: u64,
    /// A condition variable's waits that gave this mutex up, and how long
    /// they lasted.
    pub cond_waits: Durations,
    /// Those that gave up at their deadline (ETIMEDOUT).
    pub cond_timeouts: u64,
    /// The longest hold, where there was one.
    pub longest_hold: Option<LongestHold>,
}

/// The longest hold of a lock: when, by whom, and how much of it the
/// holder spent off the CPU (what the holder's own clock cannot have
/// seen, if it was preempted before it read it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LongestHold {
    pub thread: u32,
    /// When it was acquired (the VM's time).
    pub start: u64,
    pub time: u64,
    pub off_cpu: u64,
}

impl LockStats {
    /// Blocked requests as a percentage of requests.
    pub fn blocked_percent(&self) -> f64 {
        percent(self.blocked, self.requests)
    }

    /// Ownership changes as a percentage of acquisitions.
    pub fn ownership_change_percent(&self) -> f64 {
        percent(self.ownership_changes, self.acquisitions)
    }
}

/// Events that contradict the lock model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Anomalies {
    /// Release of a lock the thread did not hold.
    pub release_without_hold: u64,
    /// A return with no request pending from that thread, or a request
    /// while the thread had one pending.
    pub return_without_request: u64,
    /// A successful acquisition while another thread held the lock.
    pub acquired_while_held: u64,
    /// An event earlier than the previous one.
    pub out_of_order: u64,
}

/// A moment of a thread: the time, and how long the thread had been off
/// the CPU by then (`Contention::switch`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ThreadMoment {
    time: u64,
    off_cpu: u64,
}

/// A hold that ended: since when, how long, and how much of it the
/// holder spent off the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    start: u64,
    time: u64,
    off_cpu: u64,
}

impl ThreadMoment {
    fn until(self, end: ThreadMoment) -> Held {
        Held {
            start: self.time,
            time: end.time.saturating_sub(self.time),
            off_cpu: end.off_cpu.saturating_sub(self.off_cpu),
        }
    }
}

#[derive(Default)]
struct LockState {
    owner: Option<u32>,
    depth: u32,
    acquired_at: ThreadMoment,
    /// Threads holding a read lock: how many times, since when.
    readers: HashMap<u32, (u32, ThreadMoment)>,
    /// Threads waiting on a condition variable, the mutex given up: since
    /// when.
    cond_waiting: HashMap<u32, u64>,
    last_owner: Option<u32>,
    /// Pending requests: thread -> (time, op, found the lock held, the
    /// request's event).
    pending: HashMap<u32, (u64, LockOp, bool, LockEvent)>,
}

impl LockState {
    /// Whether a thread other than `thread` holds the lock so that a
    /// request (`shared`: for reading) must wait.
    fn held_by_other(&self, thread: u32, shared: bool) -> bool {
        self.owner.is_some_and(|o| o != thread)
            || (!shared && self.readers.keys().any(|&r| r != thread))
    }

    /// `thread` takes the lock at `time` (`shared`: for reading): whether
    /// the model allows it (nobody else holds it in a way that excludes
    /// it).
    fn acquire(&mut self, thread: u32, time: ThreadMoment, shared: bool) -> bool {
        if self.held_by_other(thread, shared) {
            return false;
        }
        if shared {
            self.readers.entry(thread).or_insert((0, time)).0 += 1;
        } else if self.owner == Some(thread) {
            self.depth += 1;
        } else {
            self.owner = Some(thread);
            self.depth = 1;
            self.acquired_at = time;
        }
        true
    }

    /// `thread` gives the lock up once at `time`: `None` if it held it
    /// not, else how long it held it if that was its last hold.
    fn release(&mut self, thread: u32, time: ThreadMoment) -> Option<Option<Held>> {
        if self.owner == Some(thread) {
            self.depth -= 1;
            if self.depth > 0 {
                return Some(None);
            }
            self.owner = None;
            return Some(Some(self.acquired_at.until(time)));
        }
        let (count, since) = self.readers.get_mut(&thread)?;
        *count -= 1;
        if *count > 0 {
            return Some(None);
        }
        let held = since.until(time);
        self.readers.remove(&thread);
        Some(Some(held))
    }
}

/// An acquisition that had to wait for another thread: the request's
/// event (where it was called from) and how long it waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Contended {
    pub request: LockEvent,
    pub wait: u64,
}

/// The result of the analysis.
#[derive(Clone, Debug, Default)]
pub struct ContentionReport {
    pub locks: HashMap<u64, LockStats>,
    pub per_thread: HashMap<(u64, u32), LockStats>,
    pub anomalies: Anomalies,
    /// Every contended acquisition, in the order acquired.
    pub contended: Vec<Contended>,
}

impl ContentionReport {
    /// Locks sorted by blocked requests, then total wait, then address;
    /// at most `limit`.
    pub fn ranked(&self, limit: usize) -> Vec<(u64, &LockStats)> {
        let mut v: Vec<_> = self.locks.iter().map(|(&a, s)| (a, s)).collect();
        v.sort_by(|a, b| {
            (b.1.blocked, b.1.wait.total, a.0).cmp(&(a.1.blocked, a.1.wait.total, b.0))
        });
        v.truncate(limit);
        v
    }
}

/// The analysis, fed one event at a time in time order.
#[derive(Default)]
pub struct Contention {
    report: ContentionReport,
    states: HashMap<u64, LockState>,
    last_time: u64,
    /// Per thread: how long it was off the CPU so far, and since when it
    /// is now (from the context switches, where they are given).
    off_cpu: HashMap<u32, (u64, Option<u64>)>,
}

impl Contention {
    pub fn new() -> Self {
        Self::default()
    }

    /// The CPU switched from thread `from` to `to` at `time`: what a
    /// holder spends off the CPU is counted apart (on the guest's one
    /// vCPU a holder is preempted by threads that would run elsewhere).
    pub fn switch(&mut self, from: u32, to: u32, time: u64) {
        if from != 0 {
            self.off_cpu.entry(from).or_default().1 = Some(time);
        }
        if let Some((total, since)) = self.off_cpu.get_mut(&to) {
            if let Some(since) = since.take() {
                *total += time.saturating_sub(since);
            }
        }
    }

    /// `thread`'s moment `time`.
    fn at(&self, thread: u32, time: u64) -> ThreadMoment {
        let off_cpu = self.off_cpu.get(&thread).map_or(0, |&(total, since)| {
            total + since.map_or(0, |s| time.saturating_sub(s))
        });
        ThreadMoment { time, off_cpu }
    }

    pub fn push(&mut self, ev: &LockEvent) {
        if ev.time < self.last_time {
            self.report.anomalies.out_of_order += 1;
        }
        self.last_time = self.last_time.max(ev.time);
        let at = self.at(ev.thread, ev.time);
        let state = self.states.entry(ev.lock).or_default();
        match ev.kind {
            LockEventKind::Request(op) => {
                let held_by_other = state.held_by_other(ev.thread, op.shared());
                // A trylock never waits: it fails instead of blocking.
                let blocks = held_by_other && !op.tries();
                if state
                    .pending
                    .insert(ev.thread, (ev.time, op, blocks, *ev))
                    .is_some()
                {
                    self.report.anomalies.return_without_request += 1;
                }
                let (l, t) = stats_pair(&mut self.report, ev.lock, ev.thread);
                let rw = !matches!(op, LockOp::Lock | LockOp::TryLock | LockOp::TimedLock);
                for s in [l, t] {
                    s.requests += 1;
                    s.blocked += u64::from(blocks);
                    s.rwlock |= rw;
                }
            }
            LockEventKind::Return(op, result) => {
                let Some((requested_at, _, was_blocked, request)) =
                    state.pending.remove(&ev.thread)
                else {
                    self.report.anomalies.return_without_request += 1;
                    return;
                };
                if result != 0 {
                    let (l, t) = stats_pair(&mut self.report, ev.lock, ev.thread);
                    for s in [l, t] {
                        if op.tries() {
                            s.trylock_failures += 1;
                        } else if op.timed() && result == ETIMEDOUT {
                            s.timedlock_timeouts += 1;
                        }
                    }
                    return;
                }
                if !state.acquire(ev.thread, at, op.shared()) {
                    self.report.anomalies.acquired_while_held += 1;
                    return;
                }
                let changed = state.last_owner.is_some_and(|o| o != ev.thread);
                state.last_owner = Some(ev.thread);
                let wait = ev.time.saturating_sub(requested_at);
                if was_blocked {
                    self.report.contended.push(Contended { request, wait });
                }
                let (l, t) = stats_pair(&mut self.report, ev.lock, ev.thread);
                for s in [l, t] {
                    s.acquisitions += 1;
                    s.shared_acquisitions += u64::from(op.shared());
                    s.wait.add(wait);
                    if was_blocked {
                        s.contended += 1;
                    }
                    if changed {
                        s.ownership_changes += 1;
                    }
                }
            }
            LockEventKind::Release => match state.release(ev.thread, at) {
                Some(Some(held)) => add_hold(&mut self.report, ev, held),
                Some(None) => {}
                None => self.report.anomalies.release_without_hold += 1,
            },
            LockEventKind::CondWait { .. } => {
                // The wait gives the mutex up; it is the thread's own to
                // give (glibc checks that for error-checking mutexes only).
                match state.release(ev.thread, at) {
                    Some(Some(held)) => add_hold(&mut self.report, ev, held),
                    Some(None) => {}
                    None => self.report.anomalies.release_without_hold += 1,
                }
                if state.cond_waiting.insert(ev.thread, ev.time).is_some() {
                    self.report.anomalies.return_without_request += 1;
                }
            }
            LockEventKind::CondWake(result) => {
                let Some(since) = state.cond_waiting.remove(&ev.thread) else {
                    self.report.anomalies.return_without_request += 1;
                    return;
                };
                if !state.acquire(ev.thread, at, false) {
                    self.report.anomalies.acquired_while_held += 1;
                    return;
                }
                let changed = state.last_owner.is_some_and(|o| o != ev.thread);
                state.last_owner = Some(ev.thread);
                let (l, t) = stats_pair(&mut self.report, ev.lock, ev.thread);
                for s in [l, t] {
                    s.requests += 1;
                    s.acquisitions += 1;
                    s.cond_waits.add(ev.time.saturating_sub(since));
                    s.cond_timeouts += u64::from(result == ETIMEDOUT);
                    if changed {
                        s.ownership_changes += 1;
                    }
                }
            }
        }
    }

    pub fn finish(self) -> ContentionReport {
        self.report
    }
}

/// Runs the analysis over events in time order.
pub fn analyze<'a>(events: impl IntoIterator<Item = &'a LockEvent>) -> ContentionReport {
    let mut c = Contention::new();
    for ev in events {
        c.push(ev);
    }
    c.finish()
}

/// A hold of `ev`'s lock by its thread ended.
fn add_hold(report: &mut ContentionReport, ev: &LockEvent, held: Held) {
    let (l, t) = stats_pair(report, ev.lock, ev.thread);
    for s in [l, t] {
        s.hold.add(held.time);
        s.hold_off_cpu = s.hold_off_cpu.saturating_add(held.off_cpu);
        if s.longest_hold.is_none_or(|l| held.time > l.time) {
            s.longest_hold = Some(LongestHold {
                thread: ev.thread,
                start: held.start,
                time: held.time,
                off_cpu: held.off_cpu,
            });
        }
    }
}

fn stats_pair(
    report: &mut ContentionReport,
    lock: u64,
    thread: u32,
) -> (&mut LockStats, &mut LockStats) {
    let l = report.locks.entry(lock).or_default();
    let t = report.per_thread.entry((lock, thread)).or_default();
    (l, t)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Stream(Vec<LockEvent>, u64);

    impl Stream {
        fn new() -> Self {
            Stream(Vec::new(), 0)
        }
        fn at(&mut self, time: u64) -> &mut Self {
            self.1 = time;
            self
        }
        fn ev(&mut self, thread: u32, lock: u64, kind: LockEventKind) -> &mut Self {
            self.0.push(LockEvent {
                time: self.1,
                thread,
                lock,
                kind,
                site: 0,
                seq: 0,
            });
            self
        }
        fn req(&mut self, t: u32, l: u64) -> &mut Self {
            self.ev(t, l, LockEventKind::Request(LockOp::Lock))
        }
        fn got(&mut self, t: u32, l: u64) -> &mut Self {
            self.ev(t, l, LockEventKind::Return(LockOp::Lock, 0))
        }
        fn rel(&mut self, t: u32, l: u64) -> &mut Self {
            self.ev(t, l, LockEventKind::Release)
        }
    }

    #[test]
    fn uncontended_lock() {
        let mut s = Stream::new();
        s.at(0).req(1, 0xa).got(1, 0xa).at(10).rel(1, 0xa);
        s.at(20).req(1, 0xa).got(1, 0xa).at(25).rel(1, 0xa);
        let r = analyze(&s.0);
        let l = &r.locks[&0xa];
        assert_eq!(
            (l.requests, l.acquisitions, l.blocked, l.contended),
            (2, 2, 0, 0)
        );
        assert_eq!(l.ownership_changes, 0);
        assert_eq!((l.hold.total, l.hold.max, l.hold.avg()), (15, 10, 7));
        assert_eq!(r.anomalies, Anomalies::default());
    }

    #[test]
    fn blocked_request_waits_and_changes_owner() {
        let mut s = Stream::new();
        s.at(0).req(1, 0xa).got(1, 0xa);
        s.at(5).req(2, 0xa); // blocks: thread 1 holds it
        s.at(30).rel(1, 0xa).at(31).got(2, 0xa).at(40).rel(2, 0xa);
        let r = analyze(&s.0);
        let l = &r.locks[&0xa];
        assert_eq!(
            (l.requests, l.acquisitions, l.blocked, l.contended),
            (2, 2, 1, 1)
        );
        assert_eq!(l.ownership_changes, 1);
        assert_eq!(l.blocked_percent(), 50.0);
        assert_eq!(l.ownership_change_percent(), 50.0);
        assert_eq!((l.wait.total, l.wait.max), (26, 26));
        let t2 = &r.per_thread[&(0xa, 2)];
        assert_eq!((t2.blocked, t2.contended, t2.wait.total), (1, 1, 26));
    }

    #[test]
    fn trylock_failures_and_timedlock_timeouts_are_not_blocks() {
        let mut s = Stream::new();
        s.at(0).req(1, 0xa).got(1, 0xa);
        s.at(1)
            .ev(2, 0xa, LockEventKind::Request(LockOp::TryLock))
            .ev(2, 0xa, LockEventKind::Return(LockOp::TryLock, 16));
        s.at(2)
            .ev(3, 0xa, LockEventKind::Request(LockOp::TimedLock));
        s.at(9)
            .ev(3, 0xa, LockEventKind::Return(LockOp::TimedLock, ETIMEDOUT));
        s.at(10).rel(1, 0xa);
        let r = analyze(&s.0);
        let l = &r.locks[&0xa];
        assert_eq!((l.requests, l.acquisitions), (3, 1));
        assert_eq!((l.trylock_failures, l.timedlock_timeouts), (1, 1));
        assert_eq!(l.blocked, 1, "the timed lock blocked; the trylock did not");
    }

    #[test]
    fn recursive_locking_holds_until_the_last_release() {
        let mut s = Stream::new();
        s.at(0)
            .req(1, 0xa)
            .got(1, 0xa)
            .at(1)
            .req(1, 0xa)
            .got(1, 0xa);
        s.at(2)
            .rel(1, 0xa)
            .at(3)
            .req(2, 0xa)
            .at(9)
            .rel(1, 0xa)
            .got(2, 0xa)
            .rel(2, 0xa);
        let r = analyze(&s.0);
        let l = &r.locks[&0xa];
        assert_eq!((l.blocked, l.contended), (1, 1));
        assert_eq!(l.hold.max, 9);
    }

    #[test]
    fn inconsistent_streams_are_counted_not_trusted() {
        let mut s = Stream::new();
        s.at(5).rel(1, 0xa); // release without hold
        s.at(6).got(1, 0xa); // return without request
        s.at(7).req(1, 0xa).got(1, 0xa);
        s.at(8).req(2, 0xa).got(2, 0xa); // acquired while held
        s.at(1).rel(1, 0xa); // out of order
        let r = analyze(&s.0);
        assert_eq!(
            r.anomalies,
            Anomalies {
                release_without_hold: 1,
                return_without_request: 1,
                acquired_while_held: 1,
                out_of_order: 1,
            }
        );
    }

    /// The paper's Syn_cont shape: level-1 locks shared by 2 threads,
    /// level-2 by 8, round-robin scheduling with a quantum that preempts
    /// threads inside critical sections.
    #[test]
    fn syn_cont_shape_level2_more_contended_than_level1() {
        const THREADS: u32 = 16;
        const ITER: u32 = 50;
        let l1 = |t: u32| 0x1000 + u64::from(t / 2);
        let l2 = |t: u32| 0x2000 + u64::from(t / 8);
        let mut s = Stream::new();
        let mut time = 0;
        // Each thread: lock l2, lock l1, work, unlock l1, unlock l2. Threads
        // interleave one step at a time, and a thread that cannot take a lock
        // retries at its next turn: a uniprocessor round robin.
        #[derive(Clone, Copy, PartialEq)]
        enum Step {
            ReqL2,
            GotL2,
            ReqL1,
            GotL1,
            RelL1,
            RelL2,
        }
        let mut step = vec![Step::ReqL2; THREADS as usize];
        let mut done = vec![0u32; THREADS as usize];
        let mut owner: HashMap<u64, u32> = HashMap::new();
        while done.iter().any(|&d| d < ITER) {
            for t in 0..THREADS {
                if done[t as usize] == ITER {
                    continue;
                }
                time += 1;
                s.at(time);
                let st = step[t as usize];
                step[t as usize] = match st {
                    Step::ReqL2 => {
                        s.req(t, l2(t));
                        Step::GotL2
                    }
                    Step::GotL2 if owner.contains_key(&l2(t)) => Step::GotL2,
                    Step::GotL2 => {
                        owner.insert(l2(t), t);
                        s.got(t, l2(t));
                        Step::ReqL1
                    }
                    Step::ReqL1 => {
                        s.req(t, l1(t));
                        Step::GotL1
                    }
                    Step::GotL1 if owner.contains_key(&l1(t)) => Step::GotL1,
                    Step::GotL1 => {
                        owner.insert(l1(t), t);
                        s.got(t, l1(t));
                        Step::RelL1
                    }
                    Step::RelL1 => {
                        owner.remove(&l1(t));
                        s.rel(t, l1(t));
                        Step::RelL2
                    }
                    Step::RelL2 => {
                        owner.remove(&l2(t));
                        s.rel(t, l2(t));
                        done[t as usize] += 1;
                        Step::ReqL2
                    }
                };
            }
        }
        let r = analyze(&s.0);
        assert_eq!(r.anomalies, Anomalies::default());
        let sum = |base: u64, n: u64| {
            let mut total = LockStats::default();
            for a in base..base + n {
                let l = &r.locks[&a];
                total.requests += l.requests;
                total.blocked += l.blocked;
                total.ownership_changes += l.ownership_changes;
                total.acquisitions += l.acquisitions;
            }
            total
        };
        let (level1, level2) = (sum(0x1000, 8), sum(0x2000, 2));
        // Requests: each level-1 lock 2 threads x ITER, each level-2 lock 8 x ITER.
        assert_eq!(r.locks[&0x1000].requests, u64::from(2 * ITER));
        assert_eq!(r.locks[&0x2000].requests, u64::from(8 * ITER));
        assert!(level2.blocked_percent() > level1.blocked_percent());
        assert!(level2.ownership_change_percent() > level1.ownership_change_percent());
        assert_eq!(r.ranked(1)[0].0 >> 12, 2, "a level-2 lock ranks first");
    }

    #[test]
    fn a_condition_variable_wait_gives_the_mutex_up_until_it_returns() {
        let mut s = Stream::new();
        // Consumer 1 takes the queue's mutex and waits; producer 2 takes
        // it, signals, unlocks; 1 holds it again when its wait returns.
        s.at(0).req(1, 0xa).got(1, 0xa);
        s.at(5).ev(1, 0xa, LockEventKind::CondWait { cond: 0xc });
        s.at(10).req(2, 0xa).got(2, 0xa).at(12).rel(2, 0xa);
        s.at(14).ev(1, 0xa, LockEventKind::CondWake(0));
        s.at(20).rel(1, 0xa);
        // A timed wait that gave up still returns with the mutex.
        s.at(30).req(1, 0xa).got(1, 0xa);
        s.at(31).ev(1, 0xa, LockEventKind::CondWait { cond: 0xc });
        s.at(41).ev(1, 0xa, LockEventKind::CondWake(ETIMEDOUT));
        s.at(42).rel(1, 0xa);
        let r = analyze(&s.0);
        assert_eq!(r.anomalies, Anomalies::default());
        let l = &r.locks[&0xa];
        // Three calls, two wait returns: five acquisitions, five releases.
        assert_eq!((l.requests, l.acquisitions, l.blocked), (5, 5, 0));
        assert_eq!(l.hold.count, 5);
        // Holds: 0-5, 10-12, 14-20, 30-31, 41-42; the waits are no holds.
        assert_eq!((l.hold.total, l.hold.max), (15, 6));
        assert_eq!((l.cond_waits.count, l.cond_waits.total), (2, 19));
        assert_eq!(l.cond_timeouts, 1);
        // 2 takes it while 1 waits: no block, no acquisition of a held lock.
        assert_eq!(l.contended, 0);
    }

    #[test]
    fn read_locks_are_shared_and_a_writer_waits_for_every_reader() {
        let mut s = Stream::new();
        let rw = |s: &mut Stream, t, op| {
            s.ev(t, 0xb, LockEventKind::Request(op))
                .ev(t, 0xb, LockEventKind::Return(op, 0));
        };
        s.at(0);
        rw(&mut s, 1, LockOp::Read);
        s.at(2);
        rw(&mut s, 2, LockOp::Read);
        // A writer finds readers: it blocks until both are gone.
        s.at(3).ev(3, 0xb, LockEventKind::Request(LockOp::Write));
        s.at(4).rel(1, 0xb).at(6).rel(2, 0xb);
        s.at(6).ev(3, 0xb, LockEventKind::Return(LockOp::Write, 0));
        // A reader finds the writer: it blocks too; a tryrdlock fails.
        s.at(7).ev(1, 0xb, LockEventKind::Request(LockOp::Read));
        s.at(7)
            .ev(2, 0xb, LockEventKind::Request(LockOp::TryRead))
            .ev(2, 0xb, LockEventKind::Return(LockOp::TryRead, 16));
        s.at(9).rel(3, 0xb).at(9);
        s.ev(1, 0xb, LockEventKind::Return(LockOp::Read, 0));
        s.at(10).rel(1, 0xb);
        let r = analyze(&s.0);
        assert_eq!(r.anomalies, Anomalies::default());
        let l = &r.locks[&0xb];
        assert!(l.rwlock);
        assert_eq!(
            (l.requests, l.acquisitions, l.shared_acquisitions),
            (5, 4, 3)
        );
        assert_eq!((l.blocked, l.contended, l.trylock_failures), (2, 2, 1));
        assert_eq!(l.hold.count, 4);
        assert_eq!((l.wait.total, l.wait.max), (3 + 2, 3));
        // A write lock taken while a reader holds it contradicts the model.
        let mut s = Stream::new();
        s.at(0);
        rw(&mut s, 1, LockOp::Read);
        rw(&mut s, 2, LockOp::Write);
        assert_eq!(analyze(&s.0).anomalies.acquired_while_held, 1);
    }

    #[test]
    fn the_time_a_holder_spends_off_the_cpu_is_counted_apart() {
        let mut c = Contention::new();
        let ev = |time, thread, kind| LockEvent {
            time,
            thread,
            lock: 0xa,
            kind,
            site: 0,
            seq: 0,
        };
        c.push(&ev(0, 1, LockEventKind::Request(LockOp::Lock)));
        c.push(&ev(0, 1, LockEventKind::Return(LockOp::Lock, 0)));
        // 1 is preempted by 2 for 6 of its 10 units of hold; 2's time
        // off the CPU before is none of the lock's.
        c.switch(2, 1, 0);
        c.switch(1, 2, 3);
        c.switch(2, 1, 9);
        c.push(&ev(10, 1, LockEventKind::Release));
        // The idle task is no thread.
        c.switch(1, 0, 11);
        c.switch(0, 1, 15);
        c.push(&ev(16, 1, LockEventKind::Request(LockOp::Lock)));
        c.push(&ev(16, 1, LockEventKind::Return(LockOp::Lock, 0)));
        c.push(&ev(18, 1, LockEventKind::Release));
        let r = c.finish();
        let l = &r.locks[&0xa];
        assert_eq!((l.hold.total, l.hold_off_cpu), (12, 6));
        // The longest hold says who held it, since when, and its share.
        let longest = LongestHold {
            thread: 1,
            start: 0,
            time: 10,
            off_cpu: 6,
        };
        assert_eq!(l.longest_hold, Some(longest));
    }
}
