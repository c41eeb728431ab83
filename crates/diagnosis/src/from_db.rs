//! Reading the analyses' inputs from an event database.

use events::abi::Kind;
use events::db::{DbError, EventDb};

use crate::lock_events::{LockEvent, LockEventKind, LockOp};

/// The lock events of the database in capture order, as the contention
/// analysis takes them. LOCKINIT events are not lock operations and are
/// left out; so is a `_RET` event without a result (it cannot be judged).
pub fn lock_events(db: &EventDb) -> Result<Vec<LockEvent>, DbError> {
    let kinds = [
        Kind::Lock,
        Kind::LockRet,
        Kind::TryLock,
        Kind::TryLockRet,
        Kind::TimedLock,
        Kind::TimedLockRet,
        Kind::Unlock,
    ];
    let mut out = Vec::new();
    db.for_each(&kinds, |r| {
        let Some(lock) = r.addr else {
            return Ok(());
        };
        let result = r.value.and_then(|v| i32::try_from(v).ok());
        let kind = match (r.kind, result) {
            (Kind::Lock, _) => LockEventKind::Request(LockOp::Lock),
            (Kind::TryLock, _) => LockEventKind::Request(LockOp::TryLock),
            (Kind::TimedLock, _) => LockEventKind::Request(LockOp::TimedLock),
            (Kind::LockRet, Some(v)) => LockEventKind::Return(LockOp::Lock, v),
            (Kind::TryLockRet, Some(v)) => LockEventKind::Return(LockOp::TryLock, v),
            (Kind::TimedLockRet, Some(v)) => LockEventKind::Return(LockOp::TimedLock, v),
            (Kind::Unlock, _) => LockEventKind::Release,
            _ => return Ok(()),
        };
        out.push(LockEvent {
            time: r.time,
            thread: r.lwpid,
            lock,
            kind,
        });
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use events::abi::Source;
    use events::db::{EventWriter, Row};

    #[test]
    fn maps_rows_to_lock_events() {
        let dir = std::env::temp_dir().join(format!("insight-fromdb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("e.db");
        let mut w = EventWriter::create(&path, &[]).unwrap();
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
        w.push(&row(1, Kind::TryLock, None)).unwrap();
        w.push(&row(2, Kind::TryLockRet, Some(16))).unwrap();
        w.push(&row(3, Kind::LockInit, Some(0))).unwrap();
        w.push(&row(4, Kind::Unlock, None)).unwrap();
        w.finish().unwrap();
        let events = lock_events(&EventDb::open(&path).unwrap()).unwrap();
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
