//! Recording and replay at the exit choke point.
//!
//! Under the exit clock, the guest's execution between two deterministic
//! VM exits depends only on its state at the first. So a recording is the
//! sequence of deterministic exits, each with the value the guest read
//! there (port, MMIO, MSR), the interrupts injected after it, and now and
//! then a digest of the registers to check against. Replay runs the same
//! guest from the same initial state and walks the log in lockstep: every
//! exit must match the next logged one (kind, port or address, size, RIP,
//! value written), every read returns the logged value, and interrupts are
//! injected where they were. The first mismatch stops replay.
//!
//! Exits that are not deterministic (kicks out of `KVM_RUN`, interrupt
//! windows) are neither logged nor used to deliver anything.
//!
//! A recording session owns a [`Recorder`], a replay session a
//! [`Replayer`]; a plain run has neither.

use trace::TraceError;

mod entry;
pub mod preempt;
mod recorder;
mod replayer;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;
#[cfg(test)]
mod tests;

pub use entry::{output_digest, register_digest, stream_name, EndReason, Entry, Input};
pub use recorder::Recorder;
pub use replayer::{
    check_host, regs_text, CpuidEntry, Divergence, HostMismatch, LogPosition, ReplayPoint,
    Replayer, Sought,
};

/// Default for how often registers are digested: at every exit whose
/// ordinal is a multiple of this.
pub const DEFAULT_DIGEST_INTERVAL: u64 = 64;

/// MSR index of the guest kernel's paravirtual clock (asm/insight.h).
pub const MSR_INSIGHT_CLOCK: u32 = 0x4953_4e00;
/// MSR the guest kernel reads at every exec (asm/insight.h): the seed of
/// its chaos scheduler's draws, 0 when chaos is off (docs/chaos.md).
pub const MSR_INSIGHT_CHAOS_SEED: u32 = 0x4953_4e01;
/// MSR the guest kernel reads after a seed that is not 0: the chaos
/// settings, packed (docs/chaos.md).
pub const MSR_INSIGHT_CHAOS_SETTINGS: u32 = 0x4953_4e02;
/// MSR the guest kernel's chaos scheduler writes the point of a decision
/// to (kind, task, count; docs/chaos.md).
pub const MSR_INSIGHT_CHAOS_POINT: u32 = 0x4953_4e03;
/// MSR it writes the task's user instruction pointer to, after the point.
pub const MSR_INSIGHT_CHAOS_WHERE: u32 = 0x4953_4e04;
/// MSR it then reads the decision from.
pub const MSR_INSIGHT_CHAOS_DECISION: u32 = 0x4953_4e05;
/// MSR it writes the start of the asking task's program code to, before
/// the point, when that changed since it last did: where a user position
/// lies in the program.
pub const MSR_INSIGHT_CHAOS_CODE: u32 = 0x4953_4e06;
/// IA32_TSC, which the VMM filters so that it never returns host time.
pub const MSR_IA32_TSC: u32 = 0x10;
/// How far the VM's time moves on past the latest time the log gives
/// before an exit logs it (`Entry::Time`): what replay times an event
/// between two exits by is at most this much older than the exit before
/// it, at a few bytes a logged time.
pub const TIME_GRAIN_NS: u64 = 10_000;
/// The clock page (asm/insight.h): no RAM; an 8-byte load at its start
/// reads the paravirtual clock, as the guest's vDSO does in user mode.
pub const CLOCK_PAGE_GPA: u64 = 0xd010_1000;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{0}")]
    Diverged(Box<Divergence>),
    #[error("trace")]
    Trace(#[from] TraceError),
    /// The log of an incomplete trace (a killed recorder's) ended before
    /// the exit the guest made: the replay ends there, as far as it goes.
    #[error("the log of the incomplete trace ended")]
    LogEnded,
    /// Recording could not write on: how far it got.
    #[error("writing the trace failed at exit {exits} ({:.2} s of guest time)", *guest_ns as f64 / 1e9)]
    Write {
        exits: u64,
        guest_ns: u64,
        #[source]
        source: TraceError,
    },
}

/// Counts shown while a recording or replay runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    /// Deterministic exits so far.
    pub exits: u64,
    /// Log entries written or read.
    pub entries: u64,
    /// Asynchronous points recorded or reached.
    pub async_points: u64,
    /// Guest time: the last paravirtual clock value the guest read (ns).
    pub guest_ns: u64,
    /// Compressed bytes of the trace so far (recording only).
    pub trace_bytes: u64,
}

/// The guest clock value a deterministic exit read, if it was a read of
/// the paravirtual clock: guest time as the log knows it.
fn clock_read(observed: &Entry) -> Option<u64> {
    match observed {
        Entry::RdMsr {
            index: MSR_INSIGHT_CLOCK,
            value,
            fault: false,
            ..
        } => Some(*value),
        Entry::MmioRead {
            addr: CLOCK_PAGE_GPA,
            size: 8,
            value,
            ..
        } => Some(*value),
        _ => None,
    }
}
