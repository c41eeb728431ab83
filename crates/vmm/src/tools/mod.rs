//! The tools that look into a replay: the event capture (`events.rs`),
//! samples (`samples.rs`), the tracing of one process's instructions and
//! memory accesses (`tracing.rs`), checkpoints (`checkpoints.rs`) and the
//! window a replay stops at. The replay session owns them
//! ([`ReplayTools`]); the vCPU loop never sees them.

pub(crate) mod checkpoints;
pub mod control;
pub mod debug;
pub(crate) mod events;
pub(crate) mod exec;
pub(crate) mod frames;
pub(crate) mod kernel_steps;
pub mod probes;
pub(crate) mod samples;
pub(crate) mod tracing;

pub use checkpoints::{
    checkpoint_before, checkpoint_unfit, CheckpointEvery, CheckpointRestored, CheckpointTaken,
};
pub use tracing::{ExpansionSpec, ExpansionStats, TraceStart, TraceTarget};

use checkpoints::{CheckpointTaker, RestoredFrom};
use events::EventTool;
use journal::ReplayPoint;
use samples::Sampling;
use tracing::ProcessTracer;

/// What a replay session has attached.
#[derive(Default)]
pub(crate) struct ReplayTools {
    /// Where the guest's events go.
    pub(crate) events: Option<EventTool>,
    /// SAMPLE events of the tracked tasks (with `events`).
    pub(crate) sampling: Option<Sampling>,
    /// A process single-stepped for its instructions and memory accesses
    /// (with `events`).
    pub(crate) tracing: Option<ProcessTracer>,
    /// Checkpoints being taken.
    pub(crate) checkpoints: Option<CheckpointTaker>,
    /// The checkpoint this replay was restored from, where a new set of
    /// checkpoints goes on.
    pub(crate) restored: Option<RestoredFrom>,
    /// Where the window ends.
    pub(crate) stop_at: Option<ReplayPoint>,
    /// Where the guest kernel keeps the top of the current task's kernel
    /// stack, below which a task that entered it from user mode left its
    /// user registers (samples in the kernel, tracing).
    pub(crate) kernel_stack_top: Option<u64>,
    /// A debugger's hold on one process.
    pub(crate) debug: Option<debug::DebugTool>,
    /// Probes given at replay (with `events`).
    pub(crate) probes: Option<probes::ProbeTool>,
}
