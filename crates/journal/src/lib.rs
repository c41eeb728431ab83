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

use trace::TraceError;

pub mod branch_clock;
mod entry;
pub mod preempt;
mod record;
mod replay;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;
#[cfg(test)]
mod tests;

pub use entry::{register_digest, EndReason, Entry, Input};
pub use record::Recorder;
pub use replay::{
    check_host, regs_text, CpuidEntry, Divergence, HostMismatch, LogPosition, Replayer,
};

/// Default for how often registers are digested: at every exit whose
/// ordinal is a multiple of this.
pub const DEFAULT_DIGEST_INTERVAL: u64 = 64;

/// MSR index of the guest kernel's paravirtual clock (asm/insight.h).
pub const MSR_INSIGHT_CLOCK: u32 = 0x4953_4e00;
/// IA32_TSC, which the VMM filters so that it never returns host time.
pub const MSR_IA32_TSC: u32 = 0x10;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{0}")]
    Diverged(Box<Divergence>),
    #[error("trace")]
    Trace(#[from] TraceError),
}

/// Whether and how the run is journaled.
pub enum Journal {
    /// Not recorded: timely interrupt delivery, nothing logged.
    Live,
    Record(Box<Recorder>),
    Replay(Box<Replayer>),
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

impl Journal {
    pub fn is_replay(&self) -> bool {
        matches!(self, Journal::Replay(_))
    }

    /// Whether interrupts may be injected only at deterministic exits.
    pub fn exit_clock(&self) -> bool {
        !matches!(self, Journal::Live)
    }

    /// Accounts for deterministic exit `observed` (RIP set; for reads, with
    /// the value the guest got): logged when recording, checked against
    /// the log when replaying. `regs` are the registers at the exit.
    pub fn exit(
        &mut self,
        observed: Entry,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), JournalError> {
        let clock = match observed {
            Entry::RdMsr {
                index: MSR_INSIGHT_CLOCK,
                value,
                fault: false,
                ..
            } => Some(value),
            _ => None,
        };
        match self {
            Journal::Live => Ok(()),
            Journal::Record(r) => {
                r.guest_ns = clock.unwrap_or(r.guest_ns);
                r.exit(observed, regs)
            }
            Journal::Replay(r) => {
                r.guest_ns = clock.unwrap_or(r.guest_ns);
                r.exit(observed, regs)
            }
        }
    }

    /// Hands complete frames to the OS now and then (recording).
    pub fn housekeeping(&mut self) -> Result<(), JournalError> {
        match self {
            Journal::Record(r) => r.housekeeping(),
            _ => Ok(()),
        }
    }

    pub fn progress(&self) -> Progress {
        match self {
            Journal::Live => Progress::default(),
            Journal::Record(r) => r.progress(),
            Journal::Replay(r) => r.progress(),
        }
    }
}
