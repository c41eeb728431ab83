//! The lock events the probes raise, as the analyses consume them.

/// The pthread call behind a lock request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LockOp {
    Lock,
    TryLock,
    TimedLock,
}

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockEventKind {
    /// A thread called lock/trylock/timedlock (LOCK, TRYLOCK, TIMEDLOCK).
    Request(LockOp),
    /// The call returned with `result` (the *_RET events; 0 = acquired).
    Return(LockOp, i32),
    /// pthread_mutex_unlock (UNLOCK).
    Release,
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

/// `ETIMEDOUT` on Linux: a timed lock that gave up.
pub const ETIMEDOUT: i32 = 110;
