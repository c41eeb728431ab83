//! Reading the analyses' inputs from an event database.

use events::abi::Kind;
use events::db::{DbError, EventDb, Row};

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
        seq: r.seq,
    })
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
}
