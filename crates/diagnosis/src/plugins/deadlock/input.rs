//! The lock-order analysis's input from an event database: lock events,
//! thread creations and joins, per process.

use std::collections::{BTreeMap, HashMap};

use events::abi::{Kind, Source};
use events::db::{DbError, EventDb, Row};

use super::lock_order::{self, ThreadEvent};
use crate::from_db::{LockEvents, LOCK_KINDS};

/// The deadlock detector's input, per process (locks are addresses in a
/// process): lock events, thread creations and joins, in capture order.
///
/// A THREADCREATE says how many events its creator had raised; that is
/// turned into how many of the creator's events in the detector's input
/// came before the creation (`ThreadEvent::Create::after`).
#[derive(Default)]
pub struct DeadlockInput {
    out: BTreeMap<u32, Vec<lock_order::Event>>,
    // Per thread: its input events so far, and that count before each of
    // the events it raised.
    own: HashMap<u32, u64>,
    history: HashMap<u32, Vec<u64>>,
    /// THREADSPAWN events by (creator, its event index): their sequence
    /// numbers.
    spawns: HashMap<(u32, usize), u64>,
    /// (pid, lwpid) of a created thread -> the THREADSPAWN its creator
    /// raised for it.
    spawned_at: HashMap<(u32, u32), u64>,
    locks: LockEvents,
}

impl DeadlockInput {
    /// Takes every event, in capture order (it counts each thread's).
    pub fn push(&mut self, r: &Row) {
        // Heap events are not in THREADCREATE's count: only some replays
        // collect them.
        if r.source != Source::Probe || r.kind.is_heap() {
            return;
        }
        let before = self.own.get(&r.lwpid).copied().unwrap_or(0);
        let history = self.history.entry(r.lwpid).or_default();
        if r.kind == Kind::ThreadSpawn {
            self.spawns.insert((r.lwpid, history.len()), r.seq);
        }
        history.push(before);
        let event = match r.kind {
            Kind::ThreadCreate => r.value.and_then(|p| u32::try_from(p).ok()).map(|parent| {
                let raised = r.caller.and_then(|n| usize::try_from(n).ok());
                // The creator's event right before the count it named.
                let spawn = raised
                    .and_then(|n| n.checked_sub(1))
                    .and_then(|i| self.spawns.get(&(parent, i)));
                if let Some(&seq) = spawn {
                    self.spawned_at.insert((r.pid, r.lwpid), seq);
                }
                let seen = self.history.get(&parent);
                let after = match (raised, seen) {
                    (Some(n), Some(h)) if n < h.len() => Some(h[n]),
                    (Some(n), Some(h)) if n == h.len() => self.own.get(&parent).copied(),
                    (Some(0), None) => Some(0),
                    _ => None,
                };
                lock_order::Event::Thread(ThreadEvent::Create {
                    time: r.time,
                    parent,
                    child: r.lwpid,
                    after,
                })
            }),
            Kind::ThreadJoin => r.value.and_then(|j| u32::try_from(j).ok()).map(|joined| {
                lock_order::Event::Thread(ThreadEvent::Join {
                    time: r.time,
                    joiner: r.lwpid,
                    joined,
                })
            }),
            k if LOCK_KINDS.contains(&k) => self.locks.event(r).map(lock_order::Event::Lock),
            _ => None,
        };
        if let Some(e) = event {
            if !matches!(e, lock_order::Event::Thread(ThreadEvent::Create { .. })) {
                *self.own.entry(r.lwpid).or_insert(0) += 1;
            }
            self.out.entry(r.pid).or_default().push(e);
        }
    }

    /// Per created thread, (pid, lwpid): the sequence number of the
    /// THREADSPAWN event its creator raised for it (whose stack says where
    /// it was created).
    pub fn spawned_at(&self) -> &HashMap<(u32, u32), u64> {
        &self.spawned_at
    }

    /// The input per process.
    pub fn finish(self) -> BTreeMap<u32, Vec<lock_order::Event>> {
        self.out
    }
}

/// [`DeadlockInput`] over a whole database.
pub fn deadlock_events(db: &EventDb) -> Result<BTreeMap<u32, Vec<lock_order::Event>>, DbError> {
    let mut input = DeadlockInput::default();
    db.for_each(&[], |r| {
        input.push(&r);
        Ok(())
    })?;
    Ok(input.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_db::{probe_row, TestDb};

    #[test]
    fn thread_creations_say_how_far_their_creator_had_got() {
        let row = probe_row;
        let mut create = row(5, Kind::ThreadCreate, Some(1));
        (create.lwpid, create.caller) = (9, Some(0));
        let test_db = TestDb::with_rows(
            "deadlock-input",
            &[
                row(1, Kind::TryLock, None),
                row(2, Kind::TryLockRet, Some(16)),
                row(3, Kind::LockInit, Some(0)),
                row(4, Kind::Unlock, None),
                create,
                row(6, Kind::ThreadJoin, Some(3)),
            ],
        );
        let per_process = deadlock_events(&test_db.db).unwrap();
        assert_eq!(per_process.len(), 1);
        assert_eq!(per_process[&1].len(), 5);
        // Thread 1 had raised nothing when it created thread 9.
        assert_eq!(
            per_process[&1][3],
            lock_order::Event::Thread(ThreadEvent::Create {
                time: 5,
                parent: 1,
                child: 9,
                after: Some(0),
            })
        );
    }

    #[test]
    fn heap_events_do_not_count_in_a_creators_stream() {
        let row = probe_row;
        // Thread 2 raised LOCK, LOCK_RET, UNLOCK (3 events as THREADCREATE
        // counts them), with a malloc's heap events between.
        let mut create = row(6, Kind::ThreadCreate, Some(2));
        (create.lwpid, create.caller) = (9, Some(3));
        let test_db = TestDb::with_rows(
            "deadlock-input-heap",
            &[
                row(1, Kind::Lock, None),
                row(2, Kind::LockRet, Some(0)),
                row(3, Kind::HeapCall, Some(1 << 56)),
                row(4, Kind::Alloc, Some((1 << 56) | 64)),
                row(5, Kind::Unlock, None),
                create,
            ],
        );
        let per_process = deadlock_events(&test_db.db).unwrap();
        let creation = per_process[&1]
            .iter()
            .find(|e| matches!(e, lock_order::Event::Thread(_)))
            .unwrap();
        // It came after all three of thread 2's lock events.
        assert_eq!(
            creation,
            &lock_order::Event::Thread(ThreadEvent::Create {
                time: 6,
                parent: 2,
                child: 9,
                after: Some(3),
            })
        );
    }
}
