//! Positions in a replay, named without any counter, and the hits a
//! replay to a position records on its way.

use crate::tools::control::UserPoint;

/// A position in the replay: the deterministic exits and asynchronous
/// points replayed, and where a thread of the process stands in its user
/// code (`None`: right after that exit or point).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Position {
    pub ordinal: u64,
    pub user: Option<UserPoint>,
}

/// A breakpoint or watchpoint hit `Resume::To` passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    pub kind: HitKind,
    pub position: Position,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HitKind {
    Breakpoint { addr: u64 },
    Watch { addr: u64 },
}
