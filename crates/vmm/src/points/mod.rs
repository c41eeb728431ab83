//! Asynchronous points (`journal::preempt`): taken at kicks while
//! recording ([`PointTaker`]), found again by a trampoline at replay
//! ([`PointSearch`]); both put code into the guest and take it out again
//! (`patch.rs`); where the recorder can put one is judged in `sites.rs`,
//! and where a kicked task stands (its code or the kernel boundary) in
//! `position.rs`.

mod chaos;
mod forced_ticks;
mod patch;
mod position;
mod schedule;
mod search;
mod sites;
mod taker;

pub use crate::vm::state::PointStats;
pub(crate) use chaos::Chaos;
pub use chaos::{chaos_settings, ChaosStats};
pub(crate) use patch::Patch;
pub(crate) use position::user_position;
pub use schedule::{
    ChaosPoint, Decision, ForcedDecisions, ForcedTick, PointKind, Schedule, ScheduleEdits,
    ScheduleError, TickAt,
};
pub(crate) use search::{Found, PointSearch};
pub(crate) use taker::PointTaker;

/// What the asynchronous points and the sample marks came to in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PointCounts {
    pub asynchronous: PointStats,
    pub samples: SampleStats,
    /// What a recording's chaos handed the guest.
    pub chaos: ChaosStats,
}

/// Sample marks: counts shown with a run's outcome (kept out of
/// `PointStats`, which checkpoints and boot snapshots store).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampleStats {
    /// Recording: sample marks logged; replay: samples taken at them.
    pub taken: u64,
    /// Recording: sampling kicks at a position replay could not find
    /// again (tried again soon after); replay: marks passed by (an exit
    /// came first, or no trampoline could go there).
    pub missed: u64,
    /// Replay: marks whose search was given up, for taking far longer
    /// than the recording took to get there.
    pub given_up: u64,
}
