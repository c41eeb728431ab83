//! A replay: the guest re-executes from the recording's start (or a
//! checkpoint), every exit checked against the log, interrupts and inputs
//! delivered where the log says, asynchronous points and sample marks
//! found again; the replay-time tools (`crate::tools`) look on, each hook
//! of the vCPU loop handed to them in order.

use std::path::Path;
use std::time::Instant;

use devices::control::EventRaiser;
use events::abi::SampleMode;
use introspect::event_ring::EventRing;
use introspect::instructions::TF;
use introspect::probe_gate;
use journal::preempt::MarkAt;
use journal::{
    EndReason, Entry, JournalError, Progress, ReplayPoint, Replayer, Sought,
    MSR_INSIGHT_CHAOS_DECISION,
};

use super::host_files;
use super::inputs;
use super::mode::{Mode, ProgressFn, ProgressReport, HOUSEKEEPING_NS};
use super::outcome::{RunOutcome, StopReason};
use super::threads::run_on_vcpu_thread;
use crate::boot_snapshot::{self, SnapshotRestored};
use crate::points::{Found, PointCounts, PointSearch, SampleStats};
use crate::tools::checkpoints;
use crate::tools::exec;
use crate::tools::{CheckpointEvery, CheckpointRestored, ReplayTools};
use crate::vm::{Claimed, Machine, Resumed, StreamWritten, Vm, VmError};

/// A machine re-executing a recording.
pub struct ReplaySession {
    pub(super) machine: Machine,
    pub(super) mode: Replaying,
}

pub(super) struct Replaying {
    pub(super) log: Replayer,
    pub(super) points: PointSearch,
    pub(super) tools: ReplayTools,
    /// Where the window ends.
    stop_at: Option<ReplayPoint>,
    /// The heap gate leaves the guest (its events are collected).
    heap_events: bool,
    /// Every event leaves the guest, ring or not.
    event_exits: bool,
    /// Samples taken at the recording's marks, and marks whose search was
    /// given up.
    samples_taken: u64,
    samples_given_up: u64,
    /// Whether the mark being sought is one this replay samples at.
    mark_wanted: bool,
    progress: ProgressReport,
}

impl ReplaySession {
    /// Replays `log` on `machine` (created from the trace's header), with
    /// `tools` attached; `heap_events`: the probe library's heap events
    /// are collected too.
    pub(crate) fn new(
        machine: Machine,
        log: Replayer,
        points: PointSearch,
        tools: ReplayTools,
        heap_events: bool,
    ) -> Self {
        ReplaySession {
            machine,
            mode: Replaying {
                log,
                points,
                tools,
                stop_at: None,
                heap_events,
                event_exits: false,
                samples_taken: 0,
                samples_given_up: 0,
                mark_wanted: false,
                progress: ProgressReport::new(),
            },
        }
    }

    /// Every probe event leaves the guest, as with a guest kernel that
    /// maps no event ring (before the gates are in place).
    pub(crate) fn events_by_exit(&mut self) {
        self.mode.event_exits = true;
    }

    /// The machine replaying.
    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// Reports progress while the replay goes on.
    pub(crate) fn on_progress(&mut self, progress: ProgressFn) {
        self.mode.progress.set(progress);
    }

    /// Stops at the first exit at or after `point` (a window's end)
    /// instead of at the recording's end.
    pub fn stop_at(&mut self, point: ReplayPoint) {
        self.mode.stop_at = Some(point);
    }

    /// Takes a checkpoint of the machine in `trace` every `every`,
    /// replacing the checkpoints it had (after a restore, if there is one:
    /// the new set goes on from the restored checkpoint).
    pub fn take_checkpoints(
        &mut self,
        trace: &Path,
        every: CheckpointEvery,
    ) -> Result<(), VmError> {
        let ram = self.machine.vm.ram_bytes();
        (self.mode.tools).take_checkpoints(trace, every, &self.mode.log.position(), ram)
    }

    /// Restores the boot snapshot the trace was recorded from, if `start`
    /// names one; `None`: the trace booted from power-on.
    pub fn restore_trace_snapshot(
        &mut self,
        start: &guest::Start,
    ) -> Result<Option<SnapshotRestored>, VmError> {
        let Some((path, key, expected)) = boot_snapshot::of_trace(start)? else {
            return Ok(None);
        };
        let m = &mut self.machine;
        let restored = boot_snapshot::restore(m, path, &key, Some(&expected))?;
        // The probe gate as this replay needs it (it raises events).
        super::mode::install_gates(m, &mut self.mode);
        self.mode.tools.snapshot_restored(m);
        Ok(Some(restored))
    }

    /// Restores the trace's checkpoint at `exit` (before `run`). Every
    /// checkpoint of its chain is checked first; nothing of the machine
    /// changes if one is refused.
    pub fn restore_checkpoint(
        &mut self,
        trace: &Path,
        exit: u64,
    ) -> Result<CheckpointRestored, VmError> {
        let started = Instant::now();
        let (chain, digest) = checkpoints::read_chain(trace, exit)?;
        let m = &mut self.machine;
        for c in &chain {
            checkpoints::check_shape(c, m)?;
        }
        self.mode.tools.check_checkpoint(&chain[0])?;
        let shadow = checkpoints::apply(m, &chain)?;
        // The gates as this replay needs them, whichever replay took the
        // checkpoint.
        super::mode::install_gates(m, &mut self.mode);
        let c = &chain[0];
        let mode = &mut self.mode;
        mode.log.seek(&c.log)?;
        mode.points.resume(c.vm.point_stats);
        (mode.tools).checkpoint_restored(m, (c, digest, shadow), &mode.log, &mode.points)?;
        // The exit was checked when the checkpoint was taken: what follows
        // it is delivered now.
        m.vcpu.at_delivery_point = true;
        Ok(CheckpointRestored {
            exit: c.exit,
            guest_ns: c.log.guest_ns,
            chain: chain.len(),
            took_ns: started.elapsed().as_nanos() as u64,
        })
    }

    /// Replays until the guest stops, the log ends, the window ends, or
    /// replay finds the guest doing something the recording did not.
    pub fn run(self) -> Result<RunOutcome, VmError> {
        run_on_vcpu_thread(self.machine, self.mode)
    }
}

impl ReplaySession {
    /// The session is built and its start restored: the tools arm what
    /// they need before the first run.
    pub(crate) fn ready(&mut self) -> Result<(), VmError> {
        self.mode.tools.ready(&mut self.machine)
    }
}

impl Replaying {
    /// Puts a search's trampoline in place with `arm`: the tools' bytes
    /// are out of guest memory meanwhile (the trampoline copies the code
    /// it covers: without `int3`s), and stay out of the patch.
    fn arm_search<T>(
        &mut self,
        m: &mut Machine,
        arm: impl FnOnce(&mut PointSearch, &mut Machine, &mut Replayer) -> Result<T, VmError>,
    ) -> Result<T, VmError> {
        self.tools.patching(m);
        let armed = arm(&mut self.points, m, &mut self.log);
        self.tools.patched(m, self.points.patched_code());
        armed
    }

    /// The code a trampoline patches changed from `before` (a mark's
    /// search ended): the tools' breakpoints go back where it was.
    fn patch_changed(&mut self, m: &Machine, before: Option<(u64, u64, u64)>) {
        let now = self.points.patched_code();
        if now != before {
            self.tools.patched(m, now);
        }
    }

    /// A store to the probe gate's address: when the gate made it, a probe
    /// raised an event whose buffer is at the address stored; it is
    /// captured at the recording's latest time known (`event_ns`), the
    /// tools look, and the guest goes on as if nothing happened.
    fn gate_event(&mut self, m: &mut Machine, data: &[u8]) -> Result<Claimed, VmError> {
        let rip = m.vcpu.synced_regs().rip;
        let Ok(address) = <[u8; 8]>::try_from(data).map(u64::from_le_bytes) else {
            return Ok(Claimed::NotOurs);
        };
        if !probe_gate::is_gate_store(rip, &m.stub_mappings()) {
            return Ok(Claimed::NotOurs);
        }
        self.points.gate_exit();
        (self.tools).gate_event(m, address, &self.log, &self.points)?;
        Ok(Claimed::Passed)
    }

    /// Puts the next search in place, unless one is under way: for the
    /// log's next sample mark (one the recording took in the kernel is
    /// sampled at once, where replay stands) or asynchronous point.
    /// `at_mark`: the vCPU stands where a mark's search left it, in user
    /// code with nothing injected (else at a delivery point).
    fn search_next(&mut self, m: &mut Machine, at_mark: bool) -> Result<(), VmError> {
        while !self.points.patched() {
            match self.log.sought()? {
                None => return Ok(()),
                Some(Sought::Point(point)) => {
                    let point = *point;
                    return self.arm_search(m, |p, m, log| p.arm_point(m, log, point, at_mark));
                }
                Some(Sought::Mark(mark)) => {
                    // Every mark in user code is found, sampled or not: the
                    // recorder chose each position for where the task
                    // stands at the mark before it.
                    let wanted = self.tools.wants_mark(mark.ns);
                    let (mode, rip) = match mark.at {
                        MarkAt::User(at) => {
                            let at = *at;
                            if self.arm_search(m, |p, m, _| p.arm_mark(m, at, at_mark))? {
                                self.mark_wanted = wanted;
                            } else {
                                self.log.sample_mark_done(false);
                            }
                            continue;
                        }
                        MarkAt::Kernel { rip } => (SampleMode::Kernel, rip),
                        MarkAt::Boundary { rip } => (SampleMode::KernelBoundary, rip),
                    };
                    match wanted {
                        true => self.take_mark_sample(m, mode, Some(rip))?,
                        false => self.log.sample_mark_done(true),
                    }
                }
            }
        }
        Ok(())
    }

    /// A SAMPLE where a recording's mark put the task (`mode`: where the
    /// recording found it, at `rip` if not where the vCPU stands); the
    /// mark is done.
    fn take_mark_sample(
        &mut self,
        m: &mut Machine,
        mode: SampleMode,
        rip: Option<u64>,
    ) -> Result<(), VmError> {
        self.log.sample_mark_done(true);
        self.samples_taken += 1;
        (self.tools).mark_sample(m, (mode, rip), &self.log, &self.points)
    }

    /// Adds the vCPU's registers to a divergence report, and what the
    /// search for an asynchronous point saw if one was under way.
    fn describe_divergence(
        &self,
        m: &Machine,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError> {
        match result {
            Err(VmError::Journal(JournalError::Diverged(mut d))) => {
                if let Ok(regs) = m.vcpu.regs() {
                    d.state = journal::regs_text(&regs);
                }
                if let Some(search) = self.points.progress(m) {
                    d.state += &format!("; {search}");
                }
                Err(VmError::Journal(JournalError::Diverged(d)))
            }
            other => other,
        }
    }
}

impl Mode for Replaying {
    fn housekeeping(&mut self) -> Result<(), VmError> {
        let log = &self.log;
        self.progress.tick(|| log.progress());
        Ok(())
    }

    fn before_run(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        let after_exit = std::mem::take(&mut m.vcpu.after_exit);
        if after_exit {
            self.tools.after_exit(m, &self.log, &self.points)?;
            let position = self.log.position();
            if self.stop_at.is_some_and(|p| p.reached(&position)) {
                return Ok(Some(StopReason::WindowEnded));
            }
        }
        if self.tools.pause(after_exit) {
            return Ok(Some(StopReason::Debug));
        }
        if let Some(reason) = self.log.end_reached()? {
            return Ok(Some(StopReason::RecordingEnded(reason)));
        }
        if self.log.log_exhausted()? {
            return Ok(Some(StopReason::TraceEnded));
        }
        inputs::publish_replayed(m, &mut self.log)?;
        let delivery = m.take_delivery(true);
        m.vcpu.request_interrupt_window(false);
        if !delivery.at_point {
            return Ok(None);
        }
        if let Some(vector) = self.log.interrupt()? {
            if !delivery.can_inject {
                return Err(self
                    .log
                    .uninjectable(vector, delivery.exception_pending)
                    .into());
            }
            m.inject(vector)?;
        }
        self.search_next(m, false)?;
        Ok(None)
    }

    fn kick_deadline(&self, _m: &Machine, now: u64) -> u64 {
        (now + HOUSEKEEPING_NS).min(self.tools.deadline())
    }

    fn debug_armed(&self) -> bool {
        self.tools.debug_armed()
    }

    /// A debug exit a tool took (a search under way allows for the steps
    /// of a traced process it was), or one step.
    fn debug_exit(&mut self, m: &mut Machine) -> Result<(), VmError> {
        let steps = (self.tools).debug_exit(m, &self.log, &self.points)?;
        self.points.traced_steps(steps.unwrap_or(1));
        Ok(())
    }

    fn claims(&self, addr: u64) -> bool {
        self.points.claims(addr) || addr == probe_gate::STORE_GPA || self.tools.claims(addr)
    }

    fn wrote_for_guest(&mut self, m: &mut Machine, written: &[u64]) -> Result<(), VmError> {
        (self.tools).wrote_for_guest(m, written, &self.log, &self.points)
    }

    fn store(&mut self, m: &mut Machine, addr: u64, data: &[u8]) -> Result<Claimed, VmError> {
        if addr == probe_gate::STORE_GPA {
            return self.gate_event(m, data);
        }
        if let Some(claimed) = (self.tools).store(m, (addr, data), &self.log, &self.points)? {
            return Ok(claimed);
        }
        // The replay's tools set the trap flag where the recording did
        // not: a traced process runs with it, and the debugger steps a
        // thread with it (through the trampoline, when a step starts at
        // the point's position).
        let ignored = if self.tools.sets_trap_flag() { TF } else { 0 };
        let written = self.tools.written_over();
        match self.points.store(m, &mut self.log, ignored, &written)? {
            Found::NotOurs => Ok(Claimed::NotOurs),
            Found::Passed => Ok(Claimed::Passed),
            Found::Point => {
                self.tools.patched(m, None);
                (self.tools).point_reached(m, &self.log, &self.points)?;
                Ok(Claimed::Reached)
            }
            Found::Mark => {
                self.log.mark_found();
                match self.mark_wanted {
                    true => self.take_mark_sample(m, SampleMode::User, None)?,
                    false => self.log.sample_mark_done(true),
                }
                self.search_next(m, true)?;
                // The mark's patch is out: breakpoints may go back there.
                self.tools.patched(m, self.points.patched_code());
                Ok(Claimed::Passed)
            }
        }
    }

    fn log(&mut self) -> Option<&mut Replayer> {
        Some(&mut self.log)
    }

    fn unemulated(&mut self, m: &mut Machine) -> Result<bool, VmError> {
        (self.tools).unemulated(m, &self.log, &self.points)
    }

    fn exit(
        &mut self,
        m: &mut Machine,
        entry: Entry,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), VmError> {
        // The log passed by the mark sought, if any (a faithful replay
        // reaches its position before this exit).
        let patched = self.points.patched_code();
        self.points.abandon_mark(m);
        self.patch_changed(m, patched);
        let kernel_entry = exec::is_kernel_entry(&entry);
        let decision =
            matches!(entry, Entry::RdMsr { index, .. } if index == MSR_INSIGHT_CHAOS_DECISION);
        self.log.exit(entry, regs)?;
        // The virtio console writes at its transmit notification: the
        // same bytes as the recording's, or the replay stops here.
        self.log.console_out(m.vm.console.take_transmitted())?;
        host_files::serve_replayed(m, &mut self.log)?;
        (self.tools).exit(m, kernel_entry, &self.log, &self.points)?;
        if decision {
            (self.tools).chaos_decision(m, &self.log, &self.points)?;
        }
        Ok(())
    }

    fn stream_written(&mut self, stream: u8, w: StreamWritten) -> Result<bool, VmError> {
        // The same bytes as the recording's, or the replay stops here; the
        // guest is told what the recording's host stream did.
        Ok(self.log.stream_out(stream, w.bytes, w.digest)?)
    }

    fn stream_input(&mut self, _m: &mut Machine, max: usize) -> Result<(Vec<u8>, bool), VmError> {
        // What the recording's host gave, whatever this one's holds.
        Ok(self.log.stream_in(max)?)
    }

    fn kicked(&mut self, m: &mut Machine, resumed: Resumed) -> Result<bool, VmError> {
        let patched = self.points.patched_code();
        if self.points.check_time(m, &mut self.log)? {
            self.log.sample_mark_done(false);
            self.samples_given_up += 1;
            self.search_next(m, true)?;
        }
        self.patch_changed(m, patched);
        (self.tools).kicked(m, resumed, &self.log, &self.points)?;
        Ok(false)
    }

    fn event_raised(&mut self, m: &mut Machine, raiser: EventRaiser) -> Result<(), VmError> {
        let ns = self.log.event_raised()?;
        (self.tools).event_raised(m, raiser, ns, &self.log, &self.points)
    }

    fn switch_ring_announced(&mut self, m: &mut Machine) {
        self.tools.switch_ring_announced(m);
    }

    /// The gates append to the event ring unless a tool needs to stop at
    /// each event (the debugger, probes given at replay and
    /// `--trace-process` act when one is raised) or `--event-exits` asks
    /// for an exit each; then they leave the guest. A replay that collects
    /// no events empties the ring unread.
    fn gate_modes(&self) -> (probe_gate::GateMode, probe_gate::GateMode) {
        let gate = if !self.tools.stops_at_events() && !self.event_exits {
            probe_gate::GateMode::Ring
        } else {
            probe_gate::GateMode::Exit
        };
        let heap = if self.heap_events {
            gate
        } else {
            probe_gate::GateMode::Silent
        };
        (gate, heap)
    }

    fn gate_installed(&mut self, ring: Option<EventRing>) {
        self.tools.gate_installed(ring);
    }

    /// Events the gates put in the ring since the last exit are captured
    /// before anything this exit brings (switches, clock readings, marks)
    /// moves the capture on: at the time and in the order the exit gate
    /// would have captured them.
    fn left_guest(&mut self, vm: &Vm) -> Result<(), VmError> {
        self.tools.left_guest(&vm.mem, self.log.event_ns())
    }

    fn ended(&mut self, reason: &EndReason) -> Result<(), VmError> {
        Ok(self.log.end(reason)?)
    }

    fn exit_handled(&mut self, m: &mut Machine) -> Result<(), VmError> {
        (self.tools).exit_handled(m, &self.log, &self.points)
    }

    fn halted(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        // Idle time is skipped: the interrupt that ended it is due at once.
        if !m.vcpu.halted_interruptible() {
            return Err(VmError::GuestHalted {
                rip: m.vcpu.rip_or_zero(),
            });
        }
        if !self.log.wakeup_due()? {
            // The recording ended while the guest was idle (a hang ended
            // by its time limit, the user's stop): the replay ends there.
            if let Some(reason) = self.log.end_reached()? {
                return Ok(Some(StopReason::RecordingEnded(reason)));
            }
            // An incomplete trace may end right after the HLT.
            if self.log.log_exhausted()? {
                return Ok(Some(StopReason::TraceEnded));
            }
            let rip = m.vcpu.rip_or_zero();
            return Err(self.log.halted_without_interrupt(rip).into());
        }
        Ok(None)
    }

    fn progress(&self) -> Progress {
        self.log.progress()
    }

    fn outcome(&self, _m: &Machine, outcome: &mut RunOutcome) {
        outcome.points = PointCounts {
            asynchronous: self.points.stats,
            samples: SampleStats {
                taken: self.samples_taken,
                missed: (self.log.sample_marks_missed()).saturating_sub(self.samples_given_up),
                given_up: self.samples_given_up,
            },
            ..Default::default()
        };
        let report = self.tools.report();
        outcome.checkpoints = report.checkpoints;
        outcome.expansion = report.expansion;
    }

    fn finish(
        mut self,
        m: &mut Machine,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError> {
        let result = self.describe_divergence(m, result);
        self.points.end(m);
        let ns = self.log.event_ns();
        let (mut outcome, events) = self.tools.finish(&m.vm.mem, ns, result)?;
        if events.is_some() {
            outcome.events = events;
        }
        Ok(outcome)
    }
}
