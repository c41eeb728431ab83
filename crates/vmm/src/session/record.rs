//! A recording: interrupts and inputs are delivered only at deterministic
//! points (exits the guest makes, and asynchronous points in user code),
//! and logged with where they were delivered.

use std::time::{Duration, Instant};

use devices::control::EventRaiser;
use journal::{EndReason, Entry, Progress, Recorder, Replayer};

use super::hang_clock::HangClock;
use super::host_files;
use super::inputs;
use super::mode::{Mode, ProgressFn, ProgressReport, HOUSEKEEPING_NS};
use super::outcome::{RunOutcome, StopReason};
use super::threads::run_on_vcpu_thread;
use crate::points::{Chaos, PointCounts, PointTaker};
use crate::vm::{Claimed, GuestMsrs, Machine, Resumed, StreamWritten, VmError};

/// A machine whose run is recorded into a trace.
pub struct RecordSession {
    machine: Machine,
    mode: Recording,
}

struct Recording {
    recorder: Recorder,
    points: PointTaker,
    progress: ProgressReport,
    /// The run ends as a hang when the guest's user code has made no
    /// progress for the limit (the vCPU's time, `hang_clock.rs`).
    time_limit: Option<HangClock>,
    /// The guest scheduler's draws (`record --chaos`).
    chaos: Option<Chaos>,
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
                time_limit: None,
                chaos: None,
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

    /// Ends the recording as a hang (`EndReason::Hung`, the run's error
    /// `VmError::TimeLimit`) when the guest's user code makes no progress
    /// (enters the kernel by no system call or fault) for `limit` of the
    /// vCPU's time (CPU time while the guest runs, the host's while it
    /// idles): a deadlock, a spin that never ends, an idle guest.
    pub(crate) fn limit_time(&mut self, limit: Duration) {
        self.mode.time_limit = Some(HangClock::new(limit, Instant::now()));
    }

    /// Hands the guest kernel's scheduler the draws of `chaos`: it
    /// decides the schedule by them (docs/chaos.md).
    pub(crate) fn perturb(&mut self, chaos: Chaos) {
        self.mode.chaos = Some(chaos);
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
        // Ctrl-C, when the command asked for it (`catch_interrupts`:
        // `record --until-fail`): the recording ends as the user's stop.
        if crate::sys::interrupted() {
            return Err(VmError::StoppedByUser);
        }
        if let Some(clock) = &mut self.time_limit {
            if clock.hung(Instant::now(), crate::sys::thread_cpu_time) {
                return Err(VmError::TimeLimit {
                    limit: clock.limit(),
                });
            }
        }
        self.recorder.housekeeping()?;
        let recorder = &self.recorder;
        self.progress.tick(|| recorder.progress());
        Ok(())
    }

    fn before_run(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        inputs::publish_recorded(m, &mut self.recorder)?;
        let delivery = m.take_delivery(true);
        // Forcing a recording's tick (`record --schedule`): the timer's
        // interrupt at the exit where the recording delivered it.
        let forced = match &mut self.chaos {
            Some(chaos) => chaos
                .ticks
                .before_run(m, delivery.at_point, delivery.can_inject)?,
            None => None,
        };
        if let Some(vector) = m.inject_pending(forced.unwrap_or(delivery.can_inject), true)? {
            self.recorder.interrupt(vector)?;
        }
        Ok(None)
    }

    fn kick_deadline(&self, m: &Machine, now: u64) -> u64 {
        (now + HOUSEKEEPING_NS).min(self.points.deadline(m))
    }

    fn answers(&mut self) -> (Option<&mut Replayer>, Option<&mut dyn GuestMsrs>) {
        (None, self.chaos.as_mut().map(|c| c as &mut dyn GuestMsrs))
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
        if let Some(chaos) = &mut self.chaos {
            chaos.ticks.exited(&entry, regs.rsp);
        }
        self.points.after_exit(m, m.vm.clock.now_ns());
        self.recorder.exit(entry, regs, m.vm.clock.now_ns())?;
        if let Some((bytes, digest)) = m.vm.console.take_transmitted() {
            self.recorder.console_out(bytes, digest)?;
        }
        host_files::serve_recorded(m, &mut self.recorder)
    }

    fn stream_written(&mut self, stream: u8, w: StreamWritten) -> Result<bool, VmError> {
        self.recorder
            .stream_out(stream, w.bytes, w.digest, w.closed)?;
        Ok(w.closed)
    }

    fn stream_input(&mut self, m: &mut Machine, max: usize) -> Result<(Vec<u8>, bool), VmError> {
        let (bytes, end) = m.host_stdin(max);
        self.recorder.stream_in(bytes.clone(), end)?;
        Ok((bytes, end))
    }

    fn kicked(&mut self, m: &mut Machine, resumed: Resumed) -> Result<bool, VmError> {
        // The sampling clock's mark first: replay finds it before a point
        // taken at the same position.
        self.points.try_sample(m, &mut self.recorder, resumed)?;
        // An interrupt that waited a tick for an exit may be delivered
        // where the guest's user code stands.
        self.points.try_point(m, &mut self.recorder)
    }

    fn kernel_entered(&mut self, _m: &mut Machine) -> Result<(), VmError> {
        if let Some(clock) = &mut self.time_limit {
            clock.progressed();
        }
        Ok(())
    }

    fn event_raised(&mut self, m: &mut Machine, _raiser: EventRaiser) -> Result<(), VmError> {
        Ok(self.recorder.event_raised(m.vm.clock.now_ns())?)
    }

    fn halted(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        if let Some(clock) = &mut self.time_limit {
            clock.idles(Instant::now());
        }
        let waited = m.wait_for_interrupt(HOUSEKEEPING_NS, |m| {
            self.housekeeping()?;
            inputs::publish_recorded(m, &mut self.recorder)
        });
        if let Some(clock) = &mut self.time_limit {
            clock.woke(Instant::now());
        }
        waited?;
        Ok(None)
    }

    fn progress(&self) -> Progress {
        self.recorder.progress()
    }

    fn outcome(&self, _m: &Machine, outcome: &mut RunOutcome) {
        outcome.points = PointCounts {
            asynchronous: self.points.stats,
            samples: self.points.sample_stats,
            chaos: self.chaos.as_ref().map(Chaos::stats).unwrap_or_default(),
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
            Err(VmError::TimeLimit { limit }) => EndReason::Hung {
                limit_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
            },
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
