//! Where a lock's contended acquisitions were requested: the user stacks
//! of its blocked requests, grouped by stack, most waited-for first.

use std::collections::HashMap;

use guestfiles::Symbolizer;

use super::contention::Contended;
use crate::event_stacks::EventStacks;

/// The stack of the request `seq`; without one, its call site alone (the
/// probe's caller, `site`, where known).
fn frames(stacks: &EventStacks, seq: u64, site: u64) -> Vec<u64> {
    match stacks.get(seq) {
        Some(frames) => frames.to_vec(),
        None if site != 0 => vec![site],
        None => Vec::new(),
    }
}

/// One call stack's share of a lock's contended acquisitions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackShare {
    /// Symbolized frames, innermost (the lock's caller) first.
    pub frames: Vec<String>,
    pub acquisitions: u64,
    /// Total wait of those acquisitions, ns.
    pub wait: u64,
}

/// The at most `n` stacks of `lock`'s contended acquisitions that waited
/// longest in total, from `contended` (every lock's), symbolized in
/// process `pid`.
pub fn top_stacks(
    contended: &[Contended],
    stacks: &EventStacks,
    lock: u64,
    n: usize,
    pid: u32,
    sym: &mut Symbolizer,
) -> Vec<StackShare> {
    let mut by_stack: HashMap<Vec<u64>, (u64, u64)> = HashMap::new();
    for c in contended.iter().filter(|c| c.request.lock == lock) {
        let e = by_stack
            .entry(frames(stacks, c.request.seq, c.request.site))
            .or_default();
        e.0 += 1;
        e.1 = e.1.saturating_add(c.wait);
    }
    let mut ranked: Vec<(Vec<u64>, (u64, u64))> = by_stack.into_iter().collect();
    // Longest total wait first; ties by count, then by the addresses.
    ranked.sort_by(|a, b| (b.1 .1, b.1 .0, &a.0).cmp(&(a.1 .1, a.1 .0, &b.0)));
    ranked.truncate(n);
    ranked
        .into_iter()
        .map(|(frames, (acquisitions, wait))| StackShare {
            frames: sym.describe_stack(pid, &frames),
            acquisitions,
            wait,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock_events::{LockEvent, LockEventKind, LockOp};
    use guestfiles::GuestFiles;

    fn blocked(seq: u64, lock: u64, site: u64, wait: u64) -> Contended {
        Contended {
            request: LockEvent {
                time: seq,
                thread: 1,
                lock,
                kind: LockEventKind::Request(LockOp::Lock),
                site,
                seq,
            },
            wait,
        }
    }

    #[test]
    fn groups_blocked_requests_by_stack_longest_wait_first() {
        let mut stacks = EventStacks::default();
        stacks.add(1, &[0x101, 0x201]);
        stacks.add(2, &[0x102, 0x202]);
        stacks.add(3, &[0x101, 0x201]);
        let contended = [
            blocked(1, 0x40, 0x101, 10),
            blocked(2, 0x40, 0x102, 50),
            blocked(3, 0x40, 0x101, 30),
            // Another lock's, and one without a stack: its site alone.
            blocked(4, 0x80, 0x103, 99),
            blocked(5, 0x40, 0x104, 1),
        ];
        let files = GuestFiles::default();
        let mut sym = Symbolizer::new(&files);
        let top = top_stacks(&contended, &stacks, 0x40, 2, 7, &mut sym);
        assert_eq!(top.len(), 2);
        assert_eq!((top[0].acquisitions, top[0].wait), (1, 50));
        // Return addresses are shown at their call (the byte before).
        assert_eq!(top[0].frames, ["0x101", "0x201"]);
        assert_eq!((top[1].acquisitions, top[1].wait), (2, 40));
        let all = top_stacks(&contended, &stacks, 0x40, 9, 7, &mut sym);
        assert_eq!(all.len(), 3);
        assert_eq!(all[2].frames, ["0x103"]);
        // The same stack is kept once.
        assert_eq!(stacks.distinct(), 2);
    }
}
