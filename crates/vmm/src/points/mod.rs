//! Asynchronous points (`journal::preempt`): taken at kicks while
//! recording ([`PointTaker`]), found again by a trampoline at replay
//! ([`PointSearch`]); both put code into the guest and take it out again
//! (`patch.rs`); where the recorder can put one is judged in `sites.rs`.

mod patch;
mod search;
mod sites;
mod taker;

pub(crate) use patch::Patch;
pub(crate) use search::{Found, PointSearch};
pub(crate) use taker::PointTaker;

/// What the asynchronous points and the sample marks came to in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PointCounts {
    pub asynchronous: PointStats,
    pub samples: SampleStats,
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

/// Counts shown with a run's outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PointStats {
    /// Asynchronous points recorded, or reached at replay.
    pub points: u64,
    /// Kicks at a position replay could not find again: the next kick
    /// tries again.
    pub declined: u64,
    /// Recording: points taken at the task's next pass over the position
    /// where it resumed, because a patch at the kicked one would have
    /// covered it.
    pub advanced: u64,
    /// Replay: trampoline exits whose registers matched.
    pub candidates: u64,
    /// Replay: candidates whose extended state or memory differed.
    pub rejected: u64,
    /// Replay: probe gate exits (events raised, none of them the
    /// recording's exits).
    pub gate_exits: u64,
    /// Host time spent on the points: reading the state and its digests
    /// when recording, searching when replaying.
    pub busy_ns: u64,
}
