//! Potential deadlocks from lock order (after Agarwal and Stoller's lock
//! trees, as InSight applies them).
//!
//! Each thread's nested acquisitions give edges `a -> b` ("held a while
//! acquiring b"), each with the locks held above `a` (its gates) and the
//! thread's segment. A potential deadlock is a cycle of such edges from
//! distinct threads, `a1 -> a2` in T1, `a2 -> a3` in T2, ..., `ak -> a1`
//! in Tk, where:
//! - the threads' segments can run concurrently (a thread's acquisitions
//!   before it creates, or after it joins, another thread cannot race with
//!   that thread);
//! - no step waits on a lock taken by trylock: a thread never blocks in
//!   trylock, so the edge *into* a trylock-acquired lock cannot be waited
//!   on (holding a lock taken by trylock still counts);
//! - failed trylock and timedlock calls leave no trace;
//! - a lock held by every thread of the cycle above its edge is a gate:
//!   the cycle is reported as protected by it, not as a deadlock.
//!
//! Apart from those, a deadlock that happened: threads still waiting when
//! the events end (a request without its return: a recording kept as a
//! hang), each for a lock another of them holds, in a cycle (the wait-for
//! graph at the end). Trylock never waits and a timed request gives up,
//! so neither takes part.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::lock_events::{LockEvent, LockEventKind, LockOp};

/// A thread event that orders segments of two threads.
///
/// A creation is reported by the new thread, possibly after the creator
/// went on: `after` says how many of the creator's own events in the input
/// (its lock events and joins) came before the creation, so that its
/// effect is placed there; `None` places it where it appears.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadEvent {
    Create {
        time: u64,
        parent: u32,
        child: u32,
        after: Option<u64>,
    },
    Join {
        time: u64,
        joiner: u32,
        joined: u32,
    },
}

/// The thread whose own event `e` is (creations belong to the creator
/// and are placed separately).
fn own_thread(e: &Event) -> Option<u32> {
    match e {
        Event::Lock(le) => Some(le.thread),
        Event::Thread(ThreadEvent::Join { joiner, .. }) => Some(*joiner),
        Event::Thread(ThreadEvent::Create { .. }) => None,
    }
}

/// Input events, in time order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Lock(LockEvent),
    Thread(ThreadEvent),
}

/// Vector clock of a thread segment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Clock(HashMap<u32, u64>);

impl Clock {
    fn le(&self, other: &Clock) -> bool {
        self.0
            .iter()
            .all(|(t, v)| other.0.get(t).copied().unwrap_or(0) >= *v)
    }
    fn concurrent(&self, other: &Clock) -> bool {
        !self.le(other) && !other.le(self)
    }
    fn tick(&mut self, thread: u32) {
        *self.0.entry(thread).or_default() += 1;
    }
    fn join(&mut self, other: &Clock) {
        for (t, v) in &other.0 {
            let e = self.0.entry(*t).or_default();
            *e = (*e).max(*v);
        }
    }
}

/// "Held `from` while acquiring `to`" in one thread segment.
#[derive(Clone, Debug)]
struct Edge {
    thread: u32,
    from: u64,
    to: u64,
    to_by_trylock: bool,
    gates: BTreeSet<u64>,
    /// Where `to` was acquired, the first time this edge was seen: the
    /// return address into the caller, and the event time.
    site: u64,
    time: u64,
    /// The requests (their events' sequence numbers) that took `from` and
    /// `to` then.
    from_at: u64,
    to_at: u64,
    clock: Clock,
}

/// What makes an edge distinct: thread, from, to, taken by trylock, gates,
/// and the thread segment's vector clock.
type EdgeKey = (u32, u64, u64, bool, BTreeSet<u64>, Vec<(u32, u64)>);

/// One step of a reported cycle: in `thread`, `held` was held while
/// `acquired` was taken at `site` (the return address into the caller of
/// the lock call; 0 if unknown) at `time`. `held_at` and `acquired_at`
/// are the sequence numbers of the requests that took them (the events
/// whose stacks say where).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CycleStep {
    pub thread: u32,
    pub held: u64,
    pub acquired: u64,
    pub site: u64,
    pub time: u64,
    pub held_at: u64,
    pub acquired_at: u64,
}

/// A lock-order cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cycle {
    pub steps: Vec<CycleStep>,
    /// Locks held by every thread of the cycle above its edge.
    pub gates: BTreeSet<u64>,
}

impl Cycle {
    pub fn is_protected(&self) -> bool {
        !self.gates.is_empty()
    }

    /// The paper's notation with lock and thread names from `name`, e.g.
    /// `L2(T2) -> L1(T2) -> L1(T1) -> L2(T1) -> L2(T2)`.
    pub fn notation(&self, lock_name: impl Fn(u64) -> String) -> String {
        let mut parts = Vec::new();
        for s in &self.steps {
            parts.push(format!("{}(T{})", lock_name(s.held), s.thread));
            parts.push(format!("{}(T{})", lock_name(s.acquired), s.thread));
        }
        if let Some(first) = parts.first().cloned() {
            parts.push(first);
        }
        parts.join(" -> ")
    }
}

/// Cycles found, smallest first; deadlocks and gate-protected ones apart.
#[derive(Clone, Debug, Default)]
pub struct DeadlockReport {
    /// Threads deadlocked when the events end: each step's thread holds
    /// `held` (which the step before waits for) and waits for `acquired`
    /// (requested at `acquired_at`, `site`, `time`, never returned).
    pub blocked: Vec<Cycle>,
    pub deadlocks: Vec<Cycle>,
    pub protected: Vec<Cycle>,
    /// Releases of locks the thread did not hold (ignored).
    pub anomalies: u64,
}

/// Longest cycle searched (number of threads).
pub const MAX_CYCLE: usize = 6;

pub fn analyze<'a>(events: impl IntoIterator<Item = &'a Event> + Clone) -> DeadlockReport {
    let mut report = DeadlockReport::default();
    let mut clocks: HashMap<u32, Clock> = HashMap::new();
    // Creations to apply when their creator has had `after` events:
    // creator -> (after, child), and which children are still pending.
    let mut creations: HashMap<u32, Vec<(u64, u32)>> = HashMap::new();
    for e in events.clone() {
        if let Event::Thread(ThreadEvent::Create {
            parent,
            child,
            after: Some(after),
            ..
        }) = *e
        {
            creations.entry(parent).or_default().push((after, child));
        }
    }
    let mut pending: HashSet<u32> = creations.values().flatten().map(|&(_, c)| c).collect();
    let mut own_events: HashMap<u32, u64> = HashMap::new();
    // Per thread: held locks in acquisition order (lock, by trylock, the
    // request that took it).
    let mut held: HashMap<u32, Vec<(u64, bool, u64)>> = HashMap::new();
    // Per thread: its pending request.
    let mut requests: HashMap<u32, LockEvent> = HashMap::new();
    let mut edges: Vec<Edge> = Vec::new();
    let mut seen: HashSet<EdgeKey> = HashSet::new();

    let clock_of = |clocks: &mut HashMap<u32, Clock>, t: u32| {
        clocks
            .entry(t)
            .or_insert_with(|| {
                let mut c = Clock::default();
                c.tick(t);
                c
            })
            .clone()
    };

    let create = |clocks: &mut HashMap<u32, Clock>, parent: u32, child: u32| {
        let mut c = clock_of(clocks, parent);
        c.tick(child);
        clocks.insert(child, c);
        let mut p = clock_of(clocks, parent);
        p.tick(parent);
        clocks.insert(parent, p);
    };

    for ev in events {
        // Creations that happened before this event of their creator.
        if let Some(t) = own_thread(ev) {
            let done = own_events.entry(t).or_insert(0);
            let now = *done;
            *done += 1;
            if let Some(list) = creations.get(&t) {
                for &(_, child) in list.iter().filter(|(after, _)| *after <= now) {
                    if pending.remove(&child) {
                        create(&mut clocks, t, child);
                    }
                }
            }
        }
        match *ev {
            Event::Thread(ThreadEvent::Create { parent, child, .. }) => {
                // Not placed earlier: the creator has had no event since.
                let placed = creations.contains_key(&parent) && !pending.contains(&child);
                if !placed {
                    pending.remove(&child);
                    create(&mut clocks, parent, child);
                }
            }
            Event::Thread(ThreadEvent::Join { joiner, joined, .. }) => {
                let done = clock_of(&mut clocks, joined);
                let mut c = clock_of(&mut clocks, joiner);
                c.join(&done);
                c.tick(joiner);
                clocks.insert(joiner, c);
            }
            Event::Lock(le) => match le.kind {
                LockEventKind::Request(_) => {
                    requests.insert(le.thread, le);
                }
                LockEventKind::Return(_, _) | LockEventKind::CondWake(_) => {
                    // A condition variable's wait takes its mutex again as
                    // a plain lock would, whatever the wait's result.
                    let (op, result) = match le.kind {
                        LockEventKind::Return(op, result) => (op, result),
                        _ => (LockOp::Lock, 0),
                    };
                    let request = requests.remove(&le.thread).map_or(le.seq, |r| r.seq);
                    if result != 0 {
                        continue; // failed trylock / timedlock: no node
                    }
                    let clock = clock_of(&mut clocks, le.thread);
                    let stack = held.entry(le.thread).or_default();
                    if stack.iter().any(|&(l, _, _)| l == le.lock) {
                        stack.push((le.lock, op.tries(), request));
                        continue; // recursive: no new order
                    }
                    for (i, &(from, _, from_at)) in stack.iter().enumerate() {
                        let gates: BTreeSet<u64> = stack[..i].iter().map(|&(l, _, _)| l).collect();
                        let by_try = op.tries();
                        let mut key_clock: Vec<(u32, u64)> =
                            clock.0.iter().map(|(&t, &v)| (t, v)).collect();
                        key_clock.sort();
                        let key = (le.thread, from, le.lock, by_try, gates.clone(), key_clock);
                        if seen.insert(key) {
                            edges.push(Edge {
                                thread: le.thread,
                                from,
                                to: le.lock,
                                to_by_trylock: by_try,
                                gates,
                                site: le.site,
                                time: le.time,
                                from_at,
                                to_at: request,
                                clock: clock.clone(),
                            });
                        }
                    }
                    stack.push((le.lock, op.tries(), request));
                }
                LockEventKind::Release | LockEventKind::CondWait { .. } => {
                    let stack = held.entry(le.thread).or_default();
                    match stack.iter().rposition(|&(l, _, _)| l == le.lock) {
                        Some(i) => {
                            stack.remove(i);
                        }
                        None => report.anomalies += 1,
                    }
                }
            },
        }
    }

    report.blocked = waits_for_cycles(&requests, &held);

    let mut by_from: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, e) in edges.iter().enumerate() {
        by_from.entry(e.from).or_default().push(i);
    }
    let graph = Graph {
        edges: &edges,
        by_from,
    };
    let mut found: HashMap<Vec<(u32, u64, u64)>, Cycle> = HashMap::new();
    let mut path = Vec::new();
    for start in 0..edges.len() {
        search(&graph, start, &mut path, &mut found);
    }
    let mut cycles: Vec<Cycle> = found.into_values().collect();
    cycles.sort_by(|a, b| {
        let key = |c: &Cycle| {
            (
                c.steps.len(),
                c.steps
                    .iter()
                    .map(|s| (s.thread, s.held))
                    .collect::<Vec<_>>(),
            )
        };
        key(a).cmp(&key(b))
    });
    for c in cycles {
        if c.is_protected() {
            report.protected.push(c);
        } else {
            report.deadlocks.push(c);
        }
    }
    report
}

/// The cycles of the wait-for graph when the events end: `requests`, the
/// requests still waiting per thread, and `held`, the locks each thread
/// holds then (lock, by trylock, the request that took it). Smallest
/// first, each once, starting at its smallest thread.
fn waits_for_cycles(
    requests: &HashMap<u32, LockEvent>,
    held: &HashMap<u32, Vec<(u64, bool, u64)>>,
) -> Vec<Cycle> {
    // Blocking requests only: a trylock never waits, a timed one gives up.
    let waiting: HashMap<u32, &LockEvent> = requests
        .iter()
        .filter(|(_, r)| matches!(r.kind, LockEventKind::Request(op) if !op.tries() && !op.timed()))
        .map(|(&t, r)| (t, r))
        .collect();
    // Who holds a lock, and the request that took it.
    let holders = |lock: u64, waiter: u32| -> Vec<(u32, u64)> {
        let mut h: Vec<(u32, u64)> = held
            .iter()
            .filter(|&(&t, _)| t != waiter)
            .filter_map(|(&t, stack)| {
                let &(_, _, at) = stack.iter().find(|&&(l, _, _)| l == lock)?;
                Some((t, at))
            })
            .collect();
        h.sort_unstable();
        h
    };
    let mut found: BTreeSet<Vec<u32>> = BTreeSet::new();
    let mut threads: Vec<u32> = waiting.keys().copied().collect();
    threads.sort_unstable();
    // Depth-first from each waiting thread along "waits for a lock held
    // by", at most MAX_CYCLE threads.
    let mut stack: Vec<Vec<u32>> = threads.iter().map(|&t| vec![t]).collect();
    while let Some(path) = stack.pop() {
        let last = path[path.len() - 1];
        let Some(request) = waiting.get(&last) else {
            continue;
        };
        for (holder, _) in holders(request.lock, last) {
            if holder == path[0] {
                let min = (0..path.len()).min_by_key(|&i| path[i]).unwrap_or(0);
                found.insert(path[min..].iter().chain(&path[..min]).copied().collect());
            } else if path.len() < MAX_CYCLE && !path.contains(&holder) && holder > path[0] {
                let mut longer = path.clone();
                longer.push(holder);
                stack.push(longer);
            }
        }
    }
    let mut cycles: Vec<Cycle> = found
        .into_iter()
        .map(|threads| {
            let k = threads.len();
            let steps = (0..k)
                .map(|i| {
                    let t = threads[i];
                    let before = waiting[&threads[(i + k - 1) % k]];
                    let waits = waiting[&t];
                    let held_at = holders(before.lock, threads[(i + k - 1) % k])
                        .into_iter()
                        .find(|&(h, _)| h == t)
                        .map_or(0, |(_, at)| at);
                    CycleStep {
                        thread: t,
                        held: before.lock,
                        acquired: waits.lock,
                        site: waits.site,
                        time: waits.time,
                        held_at,
                        acquired_at: waits.seq,
                    }
                })
                .collect();
            Cycle {
                steps,
                gates: BTreeSet::new(),
            }
        })
        .collect();
    cycles.sort_by_key(|c| c.steps.len());
    cycles
}

/// The edges, indexed by the lock they start from.
struct Graph<'a> {
    edges: &'a [Edge],
    by_from: HashMap<u64, Vec<usize>>,
}

/// Depth-first search for cycles that continue `path` with edge `start`.
fn search(
    graph: &Graph,
    start: usize,
    path: &mut Vec<usize>,
    found: &mut HashMap<Vec<(u32, u64, u64)>, Cycle>,
) {
    let edges = graph.edges;
    path.push(start);
    let last = &edges[*path.last().unwrap_or(&start)];
    let first = &edges[path[0]];
    if path.len() >= 2 && last.to == first.from {
        record(edges, path, found);
    } else if path.len() < MAX_CYCLE && !last.to_by_trylock {
        let next = graph
            .by_from
            .get(&last.to)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        for &i in next {
            let e = &edges[i];
            let fresh_thread = path.iter().all(|&p| edges[p].thread != e.thread);
            // Each lock once, except the one that closes the cycle.
            let fresh_lock = e.to == first.from || path.iter().all(|&p| edges[p].from != e.to);
            let concurrent = path.iter().all(|&p| edges[p].clock.concurrent(&e.clock));
            if fresh_thread && fresh_lock && concurrent {
                search(graph, i, path, found);
            }
        }
    }
    path.pop();
}

fn record(edges: &[Edge], path: &[usize], found: &mut HashMap<Vec<(u32, u64, u64)>, Cycle>) {
    let steps: Vec<&Edge> = path.iter().map(|&i| &edges[i]).collect();
    // The closing step waits on the first edge's `from`: not by trylock.
    if steps.last().is_some_and(|e| e.to_by_trylock) {
        return;
    }
    // Canonical rotation: start at the smallest (thread, from, to).
    let keys: Vec<(u32, u64, u64)> = steps.iter().map(|e| (e.thread, e.from, e.to)).collect();
    let min = (0..keys.len()).min_by_key(|&i| keys[i]).unwrap_or(0);
    let canonical: Vec<(u32, u64, u64)> = keys[min..].iter().chain(&keys[..min]).copied().collect();
    if found.contains_key(&canonical) {
        return;
    }
    let mut gates = steps[0].gates.clone();
    for e in &steps[1..] {
        gates = gates.intersection(&e.gates).copied().collect();
    }
    let ordered = steps[min..].iter().chain(&steps[..min]);
    let cycle = Cycle {
        steps: ordered
            .map(|e| CycleStep {
                thread: e.thread,
                held: e.from,
                acquired: e.to,
                site: e.site,
                time: e.time,
                held_at: e.from_at,
                acquired_at: e.to_at,
            })
            .collect(),
        gates,
    };
    found.insert(canonical, cycle);
}

#[cfg(test)]
mod tests {
    use super::*;

    const L1: u64 = 0x11;
    const L2: u64 = 0x22;
    const L3: u64 = 0x33;
    const G: u64 = 0x99;

    #[derive(Default)]
    struct Prog(Vec<Event>, u64);

    impl Prog {
        fn push(&mut self, thread: u32, lock: u64, kind: LockEventKind) -> &mut Self {
            self.1 += 1;
            self.0.push(Event::Lock(LockEvent {
                time: self.1,
                thread,
                lock,
                kind,
                site: 0x1000 + self.1,
                seq: self.1,
            }));
            self
        }
        fn lock(&mut self, t: u32, l: u64) -> &mut Self {
            self.push(t, l, LockEventKind::Request(LockOp::Lock)).push(
                t,
                l,
                LockEventKind::Return(LockOp::Lock, 0),
            )
        }
        fn trylock(&mut self, t: u32, l: u64, result: i32) -> &mut Self {
            self.push(t, l, LockEventKind::Request(LockOp::TryLock))
                .push(t, l, LockEventKind::Return(LockOp::TryLock, result))
        }
        fn unlock(&mut self, t: u32, l: u64) -> &mut Self {
            self.push(t, l, LockEventKind::Release)
        }
        fn create(&mut self, parent: u32, child: u32) -> &mut Self {
            self.1 += 1;
            self.0.push(Event::Thread(ThreadEvent::Create {
                after: None,
                time: self.1,
                parent,
                child,
            }));
            self
        }
        fn join(&mut self, joiner: u32, joined: u32) -> &mut Self {
            self.1 += 1;
            self.0.push(Event::Thread(ThreadEvent::Join {
                time: self.1,
                joiner,
                joined,
            }));
            self
        }
        fn report(&self) -> DeadlockReport {
            analyze(&self.0)
        }
    }

    fn name(l: u64) -> String {
        match l {
            L1 => "L1".into(),
            L2 => "L2".into(),
            L3 => "L3".into(),
            G => "G".into(),
            _ => format!("{l:#x}"),
        }
    }

    /// Whether `notation` is `expected` up to where the cycle starts.
    fn same_cycle(notation: &str, expected: &str) -> bool {
        let nodes = |s: &str| -> Vec<String> {
            let mut v: Vec<String> = s.split(" -> ").map(str::to_string).collect();
            v.pop();
            v
        };
        let (a, b) = (nodes(notation), nodes(expected));
        a.len() == b.len()
            && (0..a.len()).any(|r| a.iter().cycle().skip(r).take(a.len()).eq(b.iter()))
    }

    #[test]
    fn trylock_program_reports_the_cycle_through_the_trylock() {
        // T1 takes L1 by a successful trylock, then L2; T2 takes L2 then L1.
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2);
        p.trylock(1, L1, 0).lock(1, L2).unlock(1, L2).unlock(1, L1);
        p.lock(2, L2).lock(2, L1).unlock(2, L1).unlock(2, L2);
        let r = p.report();
        assert_eq!(r.deadlocks.len(), 1, "{r:?}");
        let n = r.deadlocks[0].notation(name);
        assert!(
            same_cycle(&n, "L2(T2) -> L1(T2) -> L1(T1) -> L2(T1) -> L2(T2)"),
            "{n}"
        );
        assert!(r.protected.is_empty());
    }

    #[test]
    fn a_condition_variable_wait_takes_its_mutex_again_in_lock_order() {
        // T1 holds L1 and waits on a condition variable with L2: the wait
        // gives L2 up (no L2 -> ... order from before it) and takes it
        // again while L1 is held (L1 -> L2). T2 takes L2, then L1.
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2);
        p.lock(1, L2).lock(1, L1);
        p.push(1, L2, LockEventKind::CondWait { cond: 0xc });
        p.push(1, L2, LockEventKind::CondWake(0));
        p.unlock(1, L2).unlock(1, L1);
        p.lock(2, L2).lock(2, L1).unlock(2, L1).unlock(2, L2);
        let r = p.report();
        assert_eq!(r.anomalies, 0, "{r:?}");
        assert_eq!(r.deadlocks.len(), 1, "{r:?}");
        let n = r.deadlocks[0].notation(name);
        assert!(
            same_cycle(&n, "L2(T2) -> L1(T2) -> L1(T1) -> L2(T1) -> L2(T2)"),
            "{n}"
        );
    }

    #[test]
    fn threads_still_waiting_in_a_cycle_when_the_events_end_are_deadlocked() {
        // T1 holds L1 and waits for L2; T2 holds L2 and waits for L1 (no
        // return: the recording ended there). T3 waits for L3, which
        // nobody holds, and T4 holds L1 by trylock while it trylocks L2
        // (it would not wait): neither is in a cycle.
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2).create(0, 3);
        p.lock(1, L1).lock(2, L2);
        p.push(1, L2, LockEventKind::Request(LockOp::Lock));
        p.push(2, L1, LockEventKind::Request(LockOp::Lock));
        p.push(3, L3, LockEventKind::Request(LockOp::Lock));
        let r = p.report();
        assert_eq!(r.blocked.len(), 1, "{:?}", r.blocked);
        let c = &r.blocked[0];
        assert!(
            same_cycle(
                &c.notation(name),
                "L1(T1) -> L2(T1) -> L2(T2) -> L1(T2) -> L1(T1)"
            ),
            "{}",
            c.notation(name)
        );
        // Thread 1's step: it holds L1 (which thread 2 waits for) and waits
        // for L2, requested at event 8.
        let step = c.steps.iter().find(|s| s.thread == 1).unwrap();
        assert_eq!((step.held, step.acquired, step.acquired_at), (L1, L2, 8));
        assert_eq!(step.held_at, 4, "the request that took L1");
        // Never having acquired, the lock-order analysis has no edge.
        assert!(r.deadlocks.is_empty());

        // A timed request gives up: no deadlock.
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2);
        p.lock(1, L1).lock(2, L2);
        p.push(1, L2, LockEventKind::Request(LockOp::TimedLock));
        p.push(2, L1, LockEventKind::Request(LockOp::Lock));
        assert!(p.report().blocked.is_empty());
        // Once one of them returns, nothing is blocked.
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2);
        p.lock(1, L1).lock(2, L2);
        p.push(1, L2, LockEventKind::Request(LockOp::Lock));
        p.push(2, L1, LockEventKind::Request(LockOp::Lock));
        p.push(2, L1, LockEventKind::Return(LockOp::Lock, 0));
        assert!(p.report().blocked.is_empty());
    }

    #[test]
    fn failed_trylock_leaves_no_cycle() {
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2);
        p.trylock(1, L1, 16).lock(1, L2).unlock(1, L2);
        p.lock(2, L2).lock(2, L1).unlock(2, L1).unlock(2, L2);
        let r = p.report();
        assert!(r.deadlocks.is_empty() && r.protected.is_empty(), "{r:?}");
    }

    #[test]
    fn a_thread_never_waits_in_trylock() {
        // T2 holds L2 and trylocks L1: it cannot block on L1.
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2);
        p.lock(1, L1).lock(1, L2).unlock(1, L2).unlock(1, L1);
        p.lock(2, L2).trylock(2, L1, 0).unlock(2, L1).unlock(2, L2);
        assert!(p.report().deadlocks.is_empty());
    }

    #[test]
    fn transitive_cycle_over_three_threads() {
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2).create(0, 3);
        p.lock(1, L1).lock(1, L2).unlock(1, L2).unlock(1, L1);
        p.lock(2, L2).lock(2, L3).unlock(2, L3).unlock(2, L2);
        p.lock(3, L3).lock(3, L1).unlock(3, L1).unlock(3, L3);
        let r = p.report();
        assert_eq!(r.deadlocks.len(), 1, "{r:?}");
        let n = r.deadlocks[0].notation(name);
        assert!(
            same_cycle(
                &n,
                "L1(T1) -> L2(T1) -> L2(T2) -> L3(T2) -> L3(T3) -> L1(T3) -> L1(T1)"
            ),
            "{n}"
        );
    }

    #[test]
    fn gate_lock_protects_the_cycle() {
        let mut p = Prog::default();
        p.create(0, 1).create(0, 2);
        p.lock(1, G)
            .lock(1, L1)
            .lock(1, L2)
            .unlock(1, L2)
            .unlock(1, L1)
            .unlock(1, G);
        p.lock(2, G)
            .lock(2, L2)
            .lock(2, L1)
            .unlock(2, L1)
            .unlock(2, L2)
            .unlock(2, G);
        let r = p.report();
        assert!(r.deadlocks.is_empty(), "{r:?}");
        assert_eq!(r.protected.len(), 1);
        assert_eq!(r.protected[0].gates, BTreeSet::from([G]));
    }

    #[test]
    fn a_creation_reported_late_is_placed_where_it_happened() {
        // Main creates T1 and T2 before anything else; T1 runs and main
        // joins it before T2 even starts (and reports its creation). T2
        // was created before the join: it still races with T1.
        let late = |child| {
            Event::Thread(ThreadEvent::Create {
                time: 0,
                parent: 0,
                child,
                after: Some(0),
            })
        };
        let mut p = Prog::default();
        p.0.push(late(1));
        p.lock(1, L1).lock(1, L2).unlock(1, L2).unlock(1, L1);
        p.join(0, 1);
        p.0.push(late(2));
        p.lock(2, L2).lock(2, L1).unlock(2, L1).unlock(2, L2);
        assert_eq!(p.report().deadlocks.len(), 1);
        // Placed where it appears, the creation would follow the join.
        for e in &mut p.0 {
            if let Event::Thread(ThreadEvent::Create { after, .. }) = e {
                *after = None;
            }
        }
        assert!(p.report().deadlocks.is_empty());
    }

    #[test]
    fn one_threads_own_edges_make_no_cycle() {
        let mut p = Prog::default();
        p.lock(1, L1).lock(1, L2).unlock(1, L2).unlock(1, L1);
        p.lock(1, L2).lock(1, L1).unlock(1, L1).unlock(1, L2);
        let r = p.report();
        assert!(r.deadlocks.is_empty() && r.protected.is_empty());
    }

    #[test]
    fn segments_before_create_and_after_join_do_not_race() {
        // Main takes L1 then L2 before creating T1 and after joining it.
        let mut p = Prog::default();
        p.lock(0, L1).lock(0, L2).unlock(0, L2).unlock(0, L1);
        p.create(0, 1);
        p.lock(1, L2).lock(1, L1).unlock(1, L1).unlock(1, L2);
        p.join(0, 1);
        p.lock(0, L1).lock(0, L2).unlock(0, L2).unlock(0, L1);
        assert!(p.report().deadlocks.is_empty());

        // The same order while T1 runs is a potential deadlock.
        let mut p = Prog::default();
        p.create(0, 1);
        p.lock(0, L1).lock(0, L2).unlock(0, L2).unlock(0, L1);
        p.lock(1, L2).lock(1, L1).unlock(1, L1).unlock(1, L2);
        p.join(0, 1);
        assert_eq!(p.report().deadlocks.len(), 1);
    }

    #[test]
    fn consistent_two_level_order_has_no_cycle() {
        // Syn_cont: every thread takes its level-2 lock, then its level-1 lock.
        let mut p = Prog::default();
        for t in 1..=16 {
            p.create(0, t);
        }
        for _ in 0..3 {
            for t in 1..=16u32 {
                let (l2, l1) = (0x200 + u64::from(t / 8), 0x100 + u64::from(t / 2));
                p.lock(t, l2).lock(t, l1).unlock(t, l1).unlock(t, l2);
            }
        }
        let r = p.report();
        assert!(r.deadlocks.is_empty() && r.protected.is_empty());
        assert_eq!(r.anomalies, 0);
    }
}
