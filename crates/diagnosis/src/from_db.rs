//! Reading the analyses' inputs from an event database.

use std::collections::HashMap;

use events::abi::Kind;
use events::db::{DbError, EventDb, Row};

use crate::lock_events::{LockEvent, LockEventKind, LockOp};

/// The kinds that lock analyses read, then LOCKINIT (where a lock was set
/// up), which names locks.
pub const LOCK_KINDS_AND_INIT: [Kind; 13] = [
    Kind::Lock,
    Kind::LockRet,
    Kind::TryLock,
    Kind::TryLockRet,
    Kind::TimedLock,
    Kind::TimedLockRet,
    Kind::Unlock,
    Kind::RwLock,
    Kind::RwLockRet,
    Kind::RwUnlock,
    Kind::CondWait,
    Kind::CondWaitRet,
    Kind::LockInit,
];

/// The kinds that lock analyses read.
pub const LOCK_KINDS: &[Kind] = LOCK_KINDS_AND_INIT.split_at(12).0;

/// Rows to lock events, in capture order. A read-write lock's return
/// does not say what was asked for: its thread's request does.
#[derive(Default)]
pub struct LockEvents {
    /// Per thread, the read-write lock call it has under way.
    rw_pending: HashMap<u32, LockOp>,
}

impl LockEvents {
    /// The lock event a row stands for, if it is one the analyses can use
    /// (`_RET` events without a result cannot be judged).
    pub fn event(&mut self, r: &Row) -> Option<LockEvent> {
        let lock = r.addr?;
        let result = r.value.and_then(|v| i32::try_from(v).ok());
        let kind = match (r.kind, result) {
            (Kind::Lock, _) => LockEventKind::Request(LockOp::Lock),
            (Kind::TryLock, _) => LockEventKind::Request(LockOp::TryLock),
            (Kind::TimedLock, _) => LockEventKind::Request(LockOp::TimedLock),
            (Kind::LockRet, Some(v)) => LockEventKind::Return(LockOp::Lock, v),
            (Kind::TryLockRet, Some(v)) => LockEventKind::Return(LockOp::TryLock, v),
            (Kind::TimedLockRet, Some(v)) => LockEventKind::Return(LockOp::TimedLock, v),
            (Kind::Unlock | Kind::RwUnlock, _) => LockEventKind::Release,
            (Kind::RwLock, _) => {
                let flags = r.value.and_then(|v| u32::try_from(v).ok()).unwrap_or(0);
                let op = LockOp::of_rwlock(flags);
                self.rw_pending.insert(r.lwpid, op);
                LockEventKind::Request(op)
            }
            (Kind::RwLockRet, Some(v)) => {
                // A return with no request seen: an anomaly of the
                // analyses, as a mutex's is; a read lock stands in.
                let op = self.rw_pending.remove(&r.lwpid).unwrap_or(LockOp::Read);
                LockEventKind::Return(op, v)
            }
            (Kind::CondWait, _) => LockEventKind::CondWait {
                cond: r.value.unwrap_or(0) as u64,
            },
            (Kind::CondWaitRet, Some(v)) => LockEventKind::CondWake(v),
            _ => return None,
        };
        Some(LockEvent {
            time: r.time,
            thread: r.lwpid,
            lock,
            kind,
            site: r.caller.unwrap_or(0),
            seq: r.seq,
        })
    }
}

/// The lock events of the database in capture order, as the contention
/// analysis takes them. LOCKINIT events are not lock operations and are
/// left out; so is a `_RET` event without a result (it cannot be judged).
pub fn lock_events(db: &EventDb) -> Result<Vec<LockEvent>, DbError> {
    let mut out = Vec::new();
    let mut rows = LockEvents::default();
    db.for_each(LOCK_KINDS, |r| {
        out.extend(rows.event(&r));
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_db::{probe_row, TestDb};

    #[test]
    fn maps_rows_to_lock_events() {
        let row = probe_row;
        let test_db = TestDb::with_rows(
            "fromdb",
            &[
                row(1, Kind::TryLock, None),
                row(2, Kind::TryLockRet, Some(16)),
                row(3, Kind::LockInit, Some(0)),
                row(4, Kind::Unlock, None),
                row(6, Kind::ThreadJoin, Some(3)),
            ],
        );
        let events = lock_events(&test_db.db).unwrap();
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

    #[test]
    fn read_write_locks_and_condition_variable_waits_are_lock_events() {
        use events::abi::SyncFlags;
        let row = probe_row;
        let test_db = TestDb::with_rows(
            "fromdb-sync",
            &[
                row(1, Kind::RwLock, Some(i64::from(SyncFlags::WRITE))),
                row(2, Kind::RwLockRet, Some(0)),
                row(3, Kind::RwUnlock, None),
                row(4, Kind::RwLock, Some(i64::from(SyncFlags::TRY))),
                row(5, Kind::RwLockRet, Some(16)),
                row(6, Kind::CondWait, Some(0x80)),
                row(7, Kind::CondWaitRet, Some(110)),
                row(8, Kind::Barrier, None),
                row(9, Kind::SemPost, None),
            ],
        );
        let events = lock_events(&test_db.db).unwrap();
        let kinds: Vec<_> = events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                LockEventKind::Request(LockOp::Write),
                LockEventKind::Return(LockOp::Write, 0),
                LockEventKind::Release,
                LockEventKind::Request(LockOp::TryRead),
                LockEventKind::Return(LockOp::TryRead, 16),
                LockEventKind::CondWait { cond: 0x80 },
                LockEventKind::CondWake(110),
            ]
        );
        assert!(kinds[1].acquires() && kinds[6].acquires() && !kinds[4].acquires());
        assert!(kinds[2].releases() && kinds[5].releases());
    }
}
