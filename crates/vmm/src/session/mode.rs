//! What differs between a plain run, a recording and a replay: the
//! [`Mode`] hooks the one vCPU loop (`run.rs`) calls, and the progress
//! reports of the modes that log.

use std::time::{Duration, Instant};

use devices::control::EventRaiser;
use introspect::event_ring::EventRing;
use introspect::probe_gate;
use journal::{EndReason, Entry, Progress, Replayer};

use super::outcome::{RunOutcome, StopReason};
use crate::vm::{Claimed, GuestMsrs, Machine, Resumed, StreamWritten, Vm, VmError};

/// Receives progress counts while a recording or replay runs.
pub type ProgressFn = Box<dyn FnMut(&Progress) + Send>;

/// How often the progress callback runs.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);

/// Under the exit clock the kick thread wakes the vCPU at least this
/// often for housekeeping (progress, flushing the trace, the user's stop
/// key).
pub(crate) const HOUSEKEEPING_NS: u64 = 100_000_000;

/// Reports progress about twice a second.
pub(crate) struct ProgressReport {
    report: Option<ProgressFn>,
    last: Instant,
}

impl ProgressReport {
    pub(crate) fn new() -> Self {
        ProgressReport {
            report: None,
            last: Instant::now(),
        }
    }

    pub(crate) fn set(&mut self, report: ProgressFn) {
        self.report = Some(report);
    }

    /// Calls the callback with `progress` if it is time to.
    pub(crate) fn tick(&mut self, progress: impl FnOnce() -> Progress) {
        if let Some(report) = &mut self.report {
            if self.last.elapsed() >= PROGRESS_INTERVAL {
                report(&progress());
                self.last = Instant::now();
            }
        }
    }
}

/// What differs between a plain run, a recording and a replay: the hooks
/// the vCPU loop (`run.rs`) calls, in the order it calls them.
pub(crate) trait Mode {
    /// Before the first KVM_RUN.
    fn start(&mut self, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// Flushes what the mode writes, and reports progress, now and then.
    fn housekeeping(&mut self) -> Result<(), VmError> {
        Ok(())
    }

    /// Before each KVM_RUN, after housekeeping: inputs made visible,
    /// interrupts injected, or the reason the run ends here.
    fn before_run(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError>;

    /// When the vCPU must be out of KVM_RUN (VM time; u64::MAX: never).
    fn kick_deadline(&self, m: &Machine, now: u64) -> u64;

    /// Whether the mode single-steps or breaks: debug exits are then its.
    fn debug_armed(&self) -> bool {
        false
    }

    /// A debug exit (only when `debug_armed`).
    fn debug_exit(&mut self, m: &mut Machine) -> Result<(), VmError> {
        Err(VmError::GuestFault {
            reason: "debug exit nobody asked for".into(),
            rip: m.vcpu.rip_or_zero(),
            detail: String::new(),
        })
    }

    /// Whether a store to `addr` may be the mode's own (a trampoline's, the
    /// probe gate's), to be looked at before it is dispatched.
    fn claims(&self, _addr: u64) -> bool {
        false
    }

    /// A store `claims` accepted: what it was.
    fn store(&mut self, _m: &mut Machine, _addr: u64, _data: &[u8]) -> Result<Claimed, VmError> {
        Ok(Claimed::NotOurs)
    }

    /// KVM could not emulate the instruction the vCPU stands at: whether
    /// the mode took care of it (else the VMM completes it if it can).
    fn unemulated(&mut self, _m: &mut Machine) -> Result<bool, VmError> {
        Ok(false)
    }

    /// The log that answers the guest's reads (replay).
    fn log(&mut self) -> Option<&mut Replayer> {
        None
    }

    /// What answers the guest's reads: the log (replay), and MSRs beyond
    /// the VMM's own (a recording's chaos).
    fn answers(&mut self) -> (Option<&mut Replayer>, Option<&mut dyn GuestMsrs>) {
        (self.log(), None)
    }

    /// A deterministic exit (RIP filled in), with the registers at it.
    fn exit(
        &mut self,
        m: &mut Machine,
        entry: Entry,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), VmError>;

    /// A KVM_RUN ended without a deterministic exit (a kick, a window);
    /// `resumed` says how it started. Returns whether the vCPU now stands
    /// at a delivery point.
    fn kicked(&mut self, _m: &mut Machine, _resumed: Resumed) -> Result<bool, VmError> {
        Ok(false)
    }

    /// The guest raised an event at the last exit.
    fn event_raised(&mut self, _m: &mut Machine, _raiser: EventRaiser) -> Result<(), VmError> {
        Ok(())
    }

    /// The VMM wrote guest memory on the guest kernel's behalf (a copy it
    /// asked for), as the guest's own write: at these guest physical
    /// addresses, each in a page of its own piece.
    fn wrote_for_guest(&mut self, _m: &mut Machine, _written: &[u64]) -> Result<(), VmError> {
        Ok(())
    }

    /// The guest kernel was entered from user mode (its deterministic
    /// point there, at a system call or a user fault), at the exit just
    /// handled.
    fn kernel_entered(&mut self, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// The last exit relayed a piece of the command's standard `stream`
    /// to the host's: whether to tell `/init` that the stream is closed
    /// (as it was here, or in the recording).
    fn stream_written(&mut self, _stream: u8, written: StreamWritten) -> Result<bool, VmError> {
        Ok(written.closed)
    }

    /// `/init` asked for at most `max` bytes of the command's standard
    /// input: what it gets, and whether the input ended after them.
    fn stream_input(&mut self, m: &mut Machine, max: usize) -> Result<(Vec<u8>, bool), VmError> {
        Ok(m.host_stdin(max))
    }

    /// The guest kernel announced its context-switch ring.
    fn switch_ring_announced(&mut self, _m: &mut Machine) {}

    /// How the probe gates are to behave in this run (the gate, the heap
    /// gate): silent unless replaying.
    fn gate_modes(&self) -> (probe_gate::GateMode, probe_gate::GateMode) {
        (probe_gate::GateMode::Silent, probe_gate::GateMode::Silent)
    }

    /// The gates are in place; `ring` is the event ring when one appends
    /// to it.
    fn gate_installed(&mut self, _ring: Option<EventRing>) {}

    /// The vCPU came out of KVM_RUN, for whatever reason, before anything
    /// handles why: what the guest left in memory meanwhile (the event
    /// ring) is read now.
    fn left_guest(&mut self, _vm: &Vm) -> Result<(), VmError> {
        Ok(())
    }

    /// `/init` is ready for the run's archive: the reason to stop here, if
    /// there is one.
    fn ready(&mut self, _m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        Ok(None)
    }

    /// The guest ended its run this way (checked at replay).
    fn ended(&mut self, _reason: &EndReason) -> Result<(), VmError> {
        Ok(())
    }

    /// After a deterministic exit and the messages it carried.
    fn exit_handled(&mut self, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// The guest executed HLT with interrupts enabled: wait for the next
    /// interrupt, or skip the idle time (replay).
    fn halted(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError>;

    /// The progress counts.
    fn progress(&self) -> Progress {
        Progress::default()
    }

    /// Fills in what the outcome says of the mode.
    fn outcome(&self, _m: &Machine, _outcome: &mut RunOutcome) {}

    /// The run ended with `result`: closes what the mode wrote.
    fn finish(
        self,
        _m: &mut Machine,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError>
    where
        Self: Sized,
    {
        result
    }
}

/// Writes the probe gates as `mode` wants them into the announced area's
/// code page, and tells the mode which event ring they append to.
pub(super) fn install_gates<M: Mode>(m: &mut Machine, mode: &mut M) {
    let (gate, heap) = mode.gate_modes();
    let ring = m.install_probe_gate(gate, heap);
    mode.gate_installed(ring);
}
