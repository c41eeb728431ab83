//! The tools that look into a replay: the event capture (`events.rs`),
//! samples (`samples.rs`), the tracing of one process's instructions and
//! memory accesses (`tracing.rs`), checkpoints (`checkpoints.rs`) and the
//! window a replay stops at. The replay session owns them
//! ([`ReplayTools`]); the vCPU loop never sees them.

pub(crate) mod checkpoints;
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
    ReplayPoint,
};
pub use tracing::{ExpansionSpec, ExpansionStats, TraceStart, TraceTarget};

use checkpoints::{CheckpointTaker, RestoredFrom};
use events::EventTool;
use samples::Sampling;
use tracing::ProcessTracer;

/// Return addresses a SAMPLE, or a lock event, keeps.
pub(crate) const MAX_STACK_FRAMES: usize = 32;

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
    /// Probes given at replay (with `debug`, collecting, and `events`).
    pub(crate) probes: Option<probes::ProbeTool>,
}

/// Guest memory for the tools' tests.
#[cfg(test)]
pub(crate) mod test_memory {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    /// User code at 0x40_0000: CR3 0x1000 -> PDPT 0x2000 -> PD 0x3000,
    /// one 2 MiB user page at physical 0x20_0000.
    pub(crate) fn user_code(code: &[u8]) -> GuestMemoryMmap {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        m.write_obj(0x2000u64 | 7, GuestAddress(0x1000)).unwrap();
        m.write_obj(0x3000u64 | 7, GuestAddress(0x2000)).unwrap();
        m.write_obj(0x20_0000u64 | 0x87, GuestAddress(0x3000 + 2 * 8))
            .unwrap();
        m.write_slice(code, GuestAddress(0x20_0000)).unwrap();
        m
    }
}
