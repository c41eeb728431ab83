//! A recording: interrupts and inputs are delivered only at deterministic
//! points (exits the guest makes, and asynchronous points in user code),
//! and logged with where they were delivered.

use devices::control::EventRaiser;
use journal::{EndReason, Entry, Progress, Recorder};

use super::inputs;
use super::mode::{Mode, ProgressFn, ProgressReport, HOUSEKEEPING_NS};
use super::outcome::{RunOutcome, StopReason};
use super::threads::run_on_vcpu_thread;
use crate::points::{PointCounts, PointTaker};
use crate::vm::{Claimed, Machine, Resumed, StreamWritten, VmError};

/// A machine whose run is recorded into a trace.
pub struct RecordSession {
    machine: Machine,
    mode: Recording,
}

struct Recording {
    recorder: Recorder,
    points: PointTaker,
    progress: ProgressReport,
}

impl RecordSession {
    /// Records `machine`'s run with `recorder`; `points` takes the
    /// asynchronous points (or delivers at exits only).
    pub(crate) fn new(machine: Machine, recorder: Recorder, points: PointTaker) -> Self {
        RecordSession {
            machine,
            mode: Recording {
                recorder,
                points,
                progress: ProgressReport::new(),
            },
        }
    }

    /// The machine recorded.
    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// Reports progress while the recording goes on.
    pub(crate) fn on_progress(&mut self, progress: ProgressFn) {
        self.mode.progress.set(progress);
    }

    /// Records until the guest stops or fails. The trace is marked
    /// complete whatever the reason: everything up to the end is in it.
    pub fn run(self) -> Result<RunOutcome, VmError> {
        run_on_vcpu_thread(self.machine, self.mode)
    }
}

impl Mode for Recording {
    fn start(&mut self, m: &mut Machine) -> Result<(), VmError> {
        // Every sampling kick, and most exits, read the system registers
        // (where the task stands, the page tables a copy goes through):
        // through `kvm_run`, not an ioctl each (~9 us on nested hosts, of
        // a mark's ~15 us of reading). `Vcpu::mark_run` keeps interrupt
        // bits of earlier exits out of that copy.
        m.vcpu.sync_sregs_at_exits();
        self.points.start(m)
    }

    fn housekeeping(&mut self) -> Result<(), VmError> {
        self.recorder.housekeeping()?;
        let recorder = &self.recorder;
        self.progress.tick(|| recorder.progress());
        Ok(())
    }

    fn before_run(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        inputs::publish_recorded(m, &mut self.recorder)?;
        let delivery = m.take_delivery(true);
        if let Some(vector) = m.inject_pending(delivery.can_inject, true)? {
            self.recorder.interrupt(vector)?;
        }
        Ok(None)
    }

    fn kick_deadline(&self, m: &Machine, now: u64) -> u64 {
        (now + HOUSEKEEPING_NS).min(self.points.deadline(m))
    }

    fn claims(&self, addr: u64) -> bool {
        self.points.claims(addr)
    }

    fn store(&mut self, m: &mut Machine, _addr: u64, _data: &[u8]) -> Result<Claimed, VmError> {
        self.points.store(m, &mut self.recorder)
    }

    fn exit(
        &mut self,
        m: &mut Machine,
        entry: Entry,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), VmError> {
        self.points.after_exit(m, m.vm.clock.now_ns());
        self.recorder.exit(entry, regs, m.vm.clock.now_ns())?;
        if let Some((bytes, digest)) = m.vm.console.take_transmitted() {
            self.recorder.console_out(bytes, digest)?;
        }
        Ok(())
    }

    fn stream_written(&mut self, stream: u8, w: StreamWritten) -> Result<bool, VmError> {
        self.recorder
            .stream_out(stream, w.bytes, w.digest, w.closed)?;
        Ok(w.closed)
    }

    fn kicked(&mut self, m: &mut Machine, resumed: Resumed) -> Result<bool, VmError> {
        // The sampling clock's mark first: replay finds it before a point
        // taken at the same position.
        self.points.try_sample(m, &mut self.recorder, resumed)?;
        // An interrupt that waited a tick for an exit may be delivered
        // where the guest's user code stands.
        self.points.try_point(m, &mut self.recorder)
    }

    fn event_raised(&mut self, m: &mut Machine, _raiser: EventRaiser) -> Result<(), VmError> {
        Ok(self.recorder.event_raised(m.vm.clock.now_ns())?)
    }

    fn halted(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        m.wait_for_interrupt(HOUSEKEEPING_NS, |m| {
            self.housekeeping()?;
            inputs::publish_recorded(m, &mut self.recorder)
        })?;
        Ok(None)
    }

    fn progress(&self) -> Progress {
        self.recorder.progress()
    }

    fn outcome(&self, _m: &Machine, outcome: &mut RunOutcome) {
        outcome.points = PointCounts {
            asynchronous: self.points.stats,
            samples: self.points.sample_stats,
        };
    }

    fn finish(
        mut self,
        m: &mut Machine,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError> {
        self.points.end(m);
        let progress = self.recorder.progress();
        let reason = match &result {
            Ok(o) => match o.stop {
                StopReason::CommandExited => EndReason::CommandExited(o.exit_status.unwrap_or(0)),
                _ => EndReason::PowerOff,
            },
            Err(VmError::StoppedByUser) => EndReason::StoppedByUser,
            Err(e) => EndReason::Failed(e.to_string()),
        };
        let dropped = m.vm.net.as_ref().map_or(0, |net| net.stats().rx_dropped());
        let summary = self.recorder.finish(reason, dropped)?;
        result.map(|mut o| {
            o.trace = Some(summary);
            o.journal = progress;
            o
        })
    }
}
