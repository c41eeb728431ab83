//! The lock events the probes raise, as the analyses consume them:
//! mutexes, read-write locks, and the mutex a condition variable's wait
//! gives up and takes again.

/// The pthread call behind a lock request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LockOp {
    Lock,
    TryLock,
    TimedLock,
    /// A read-write lock's read lock (rdlock, tryrdlock, timed or clocked).
    Read,
    TryRead,
    TimedRead,
    /// Its write lock.
    Write,
    TryWrite,
    TimedWrite,
}

impl LockOp {
    /// The call never waits: it fails instead (trylock, tryrdlock,
    /// trywrlock).
    pub fn tries(self) -> bool {
        matches!(self, LockOp::TryLock | LockOp::TryRead | LockOp::TryWrite)
    }

    /// The call gives up at a deadline.
    pub fn timed(self) -> bool {
        matches!(
            self,
            LockOp::TimedLock | LockOp::TimedRead | LockOp::TimedWrite
        )
    }

    /// A read lock: other readers may hold the lock at the same time.
    pub fn shared(self) -> bool {
        matches!(self, LockOp::Read | LockOp::TryRead | LockOp::TimedRead)
    }

    /// The read-write lock call with these flags (`events::abi::SyncFlags`).
    pub fn of_rwlock(flags: u32) -> LockOp {
        use events::abi::SyncFlags;
        let write = flags & SyncFlags::WRITE != 0;
        match (
            write,
            flags & SyncFlags::TRY != 0,
            flags & SyncFlags::TIMED != 0,
        ) {
            (false, true, _) => LockOp::TryRead,
            (false, false, true) => LockOp::TimedRead,
            (false, false, false) => LockOp::Read,
            (true, true, _) => LockOp::TryWrite,
            (true, false, true) => LockOp::TimedWrite,
            (true, false, false) => LockOp::Write,
        }
    }
}

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockEventKind {
    /// A thread asked for the lock (LOCK, TRYLOCK, TIMEDLOCK, RWLOCK).
    Request(LockOp),
    /// The call returned with `result` (the *_RET events; 0 = acquired).
    Return(LockOp, i32),
    /// pthread_mutex_unlock or pthread_rwlock_unlock (UNLOCK, RWUNLOCK).
    Release,
    /// A condition variable's wait (CONDWAIT on `cond`) gave the mutex up
    /// while the thread waits: a release.
    CondWait { cond: u64 },
    /// The wait returned with `result` (CONDWAIT_RET; 0, or ETIMEDOUT for
    /// a timed wait): the thread holds the mutex again, whatever the
    /// result.
    CondWake(i32),
}

impl LockEventKind {
    /// The thread holds the lock from here on (a successful acquisition,
    /// or a condition variable's wait that took the mutex again).
    pub fn acquires(self) -> bool {
        matches!(
            self,
            LockEventKind::Return(_, 0) | LockEventKind::CondWake(_)
        )
    }

    /// The thread gives the lock up here.
    pub fn releases(self) -> bool {
        matches!(
            self,
            LockEventKind::Release | LockEventKind::CondWait { .. }
        )
    }
}

/// One lock event: deterministic replay time, thread (lwpid), lock
/// (its address in the guest process), kind, and where it was called
/// from (the return address into the caller; 0 if unknown); `seq`, the
/// event's sequence number in its database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockEvent {
    pub time: u64,
    pub thread: u32,
    pub lock: u64,
    pub kind: LockEventKind,
    pub site: u64,
    pub seq: u64,
}

/// `ETIMEDOUT` on Linux: a timed lock or wait that gave up.
pub const ETIMEDOUT: i32 = 110;
