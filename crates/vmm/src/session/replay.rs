//! A replay: the guest re-executes from the recording's start (or a
//! checkpoint), every exit checked against the log, interrupts and inputs
//! delivered where the log says, asynchronous points found again; the
//! replay-time tools (`crate::tools`) look on.

use std::path::Path;
use std::time::Instant;

use devices::control::EventRaiser;
use events::abi::SampleMode;
use introspect::event_ring::EventRing;
use introspect::instructions::TF;
use introspect::probe_gate;
use journal::preempt::MarkAt;
use journal::{
    EndReason, Entry, JournalError, LogPosition, Progress, ReplayPoint, Replayer, Sought,
};

use super::inputs;
use super::mode::{Mode, ProgressFn, ProgressReport, HOUSEKEEPING_NS};
use super::outcome::{RunOutcome, StopReason};
use super::threads::run_on_vcpu_thread;
use crate::boot_snapshot::{self, SnapshotRestored};
use crate::points::{Found, PointCounts, PointSearch, SampleStats};
use crate::tools::checkpoints::{self, CheckpointTaker, RestoredFrom};
use crate::tools::control::Advance;
use crate::tools::exec;
use crate::tools::samples::Sampling;
use crate::tools::{CheckpointEvery, CheckpointRestored, ReplayTools};
use crate::vm::state::EventsState;
use crate::vm::{Claimed, Machine, Resumed, Vm, VmError};

/// A machine re-executing a recording.
pub struct ReplaySession {
    pub(super) machine: Machine,
    pub(super) mode: Replaying,
}

pub(super) struct Replaying {
    pub(super) log: Replayer,
    pub(super) points: PointSearch,
    pub(super) tools: ReplayTools,
    /// The heap gate leaves the guest (its events are collected).
    heap_events: bool,
    /// The event ring the gates append to, read at every exit (None:
    /// they leave the guest for each event).
    ring: Option<EventRing>,
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
                heap_events,
                ring: None,
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
        self.mode.tools.stop_at = Some(point);
    }

    /// Takes a checkpoint of the machine in `trace` every `every`,
    /// replacing the checkpoints it had (after a restore, if there is one:
    /// the new set goes on from the restored checkpoint).
    pub fn take_checkpoints(
        &mut self,
        trace: &Path,
        every: CheckpointEvery,
    ) -> Result<(), VmError> {
        let tools = &mut self.mode.tools;
        let taker = CheckpointTaker::new(
            trace,
            every,
            &self.mode.log.position(),
            self.machine.vm.ram_bytes(),
            tools.restored.take(),
        )?;
        tools.checkpoints = Some(taker);
        Ok(())
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
        if let (Some(events), Some(gpa)) =
            (&mut self.mode.tools.events, m.vm.status.switch_ring_gpa)
        {
            events.ring_from_head(&m.vm.mem, gpa);
        }
        if let (Some(debug), Some(gpa)) = (&mut self.mode.tools.debug, m.vm.status.switch_ring_gpa)
        {
            debug.ring_announced(&m.vm.mem, gpa);
        }
        if let (Some(probes), Some(gpa)) =
            (&mut self.mode.tools.probes, m.vm.status.switch_ring_gpa)
        {
            probes.ring_announced(&m.vm.mem, gpa);
        }
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
        let tools = &mut self.mode.tools;
        if let Some(events) = &tools.events {
            let marks = tools.sampling.as_ref().and_then(Sampling::marks_period);
            if let Some(why) =
                checkpoints::unfit_for_events(&chain[0], events.stacks.is_some(), marks)
            {
                return Err(VmError::Restore(format!(
                    "{why}: take the checkpoints again with --events or --diagnose (and the \
                     same --unwind and --sample-period)"
                )));
            }
        }
        let shadow = checkpoints::apply(m, &chain)?;
        // The gates as this replay needs them, whichever replay took the
        // checkpoint.
        super::mode::install_gates(m, &mut self.mode);
        let tools = &mut self.mode.tools;
        let c = &chain[0];
        self.mode.log.seek(&c.log)?;
        self.mode.points.resume(c.vm.point_stats);
        if let (Some(events), Some(state)) = (&mut tools.events, &c.events) {
            events.capture.resume(&state.capture)?;
            events.switch_ring = match state.switch_ring {
                Some((gpa, seen)) => Some(
                    introspect::guest_events::SwitchRing::resume(&m.vm.mem, gpa, seen)
                        .map_err(|why| VmError::Restore(format!("context-switch ring: {why}")))?,
                ),
                None => None,
            };
            if let (Some(stacks), Some(processes)) = (&mut events.stacks, &state.processes) {
                stacks.restore(processes);
            }
        }
        // The exit was checked when the checkpoint was taken: what follows
        // it is delivered now.
        m.vcpu.at_delivery_point = true;
        tools.restored = Some(RestoredFrom {
            checkpoint: (c.exit, digest),
            shadow,
        });
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
    /// Arms the probes given at replay: their engine collects their hits
    /// to the replay's end.
    pub(crate) fn collect_probes(&mut self) -> Result<(), VmError> {
        if let Some(probes) = &mut self.mode.tools.probes {
            probes.start(&mut self.machine)?;
        }
        Ok(())
    }
}

impl Replaying {
    /// Puts a search's trampoline in place with `arm`: the debugger's
    /// breakpoints are out of guest memory meanwhile (the trampoline
    /// copies the code it covers: without `int3`s), and stay out of the
    /// patch.
    fn arm_search<T>(
        &mut self,
        m: &mut Machine,
        arm: impl FnOnce(&mut PointSearch, &mut Machine, &mut Replayer) -> Result<T, VmError>,
    ) -> Result<T, VmError> {
        if let Some(debug) = &mut self.tools.debug {
            debug.lift_breakpoints(&m.vm.mem);
        }
        if let Some(probes) = &mut self.tools.probes {
            probes.lift_breakpoints(&m.vm.mem);
        }
        let armed = arm(&mut self.points, m, &mut self.log);
        self.patched(m, self.points.patched_code());
        armed
    }

    /// The code a trampoline patches changed from `before` (a mark's
    /// search ended): the debugger's breakpoints go back where it was.
    fn patch_changed(&mut self, m: &Machine, before: Option<(u64, u64, u64)>) {
        let now = self.points.patched_code();
        if now != before {
            self.patched(m, now);
        }
    }

    /// The code a trampoline patches is `now`: the breakpoints stay out.
    fn patched(&mut self, m: &Machine, now: Option<(u64, u64, u64)>) {
        if let Some(debug) = &mut self.tools.debug {
            debug.patched(m, now);
        }
        if let Some(probes) = &mut self.tools.probes {
            probes.patched(m, now);
        }
    }

    /// Right after a checked deterministic exit: takes a checkpoint if one
    /// is due and the machine is at rest.
    fn checkpoint_if_due(&mut self, m: &mut Machine) -> Result<(), VmError> {
        let Some(taker) = &mut self.tools.checkpoints else {
            return Ok(());
        };
        let position = self.log.position();
        // Not while a mark keeps the events' time ahead of the last clock
        // read: a replay from the checkpoint would not know it.
        if !taker.due(&position)
            || self.points.patched()
            || self.log.mark_time_pending()
            || !checkpoints::at_rest(m)
        {
            return Ok(());
        }
        let events = self.tools.events.as_ref().map(|e| EventsState {
            capture: e.capture.state(),
            switch_ring: e.switch_ring.as_ref().map(|r| r.position()),
            processes: e.stacks.as_ref().map(|p| p.state()),
            sample_marks: self
                .tools
                .sampling
                .as_ref()
                .and_then(Sampling::marks_period),
        });
        taker.take(m, position, self.points.stats, events)
    }

    /// A store to the probe gate's address: when the gate made it, a probe
    /// raised an event whose buffer is at the address stored; it is
    /// captured at the recording's latest time known (`event_ns`), and
    /// the guest goes on as if nothing happened.
    fn gate_event(&mut self, m: &mut Machine, data: &[u8]) -> Result<Claimed, VmError> {
        let rip = m.vcpu.synced_regs().rip;
        let Ok(address) = <[u8; 8]>::try_from(data).map(u64::from_le_bytes) else {
            return Ok(Claimed::NotOurs);
        };
        if !probe_gate::is_gate_store(rip, &m.stub_mappings()) {
            return Ok(Claimed::NotOurs);
        }
        self.points.gate_exit();
        let Some(events) = &mut self.tools.events else {
            return Ok(Claimed::Passed);
        };
        events.raised_at_gate(m, address, self.log.event_ns())?;
        // A probe event: its task may be one to trace.
        self.arm_tracing(m)?;
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
                    let wanted =
                        (self.tools.sampling.as_mut()).is_some_and(|s| s.wants_mark(mark.ns));
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
        if let (Some(sampling), Some(events)) = (&mut self.tools.sampling, &mut self.tools.events) {
            let guest_ns = self.log.event_ns();
            sampling.take_mark(m, events, &self.points, guest_ns, mode, rip)?;
        }
        Ok(())
    }

    /// Sets the trap flag of the traced process's task on the CPU.
    fn arm_tracing(&mut self, m: &mut Machine) -> Result<(), VmError> {
        match (&mut self.tools.tracing, &self.tools.events) {
            (Some(tracer), Some(events)) => {
                let exit = self.log.position().exits;
                tracer.arm(m, events, self.tools.kernel_stack_top, exit)
            }
            _ => Ok(()),
        }
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
            self.checkpoint_if_due(m)?;
            let position = self.log.position();
            if self.tools.stop_at.is_some_and(|p| p.reached(&position)) {
                return Ok(Some(StopReason::WindowEnded));
            }
        }
        if let Some(debug) = &mut self.tools.debug {
            if debug.pause(after_exit) {
                return Ok(Some(StopReason::Debug));
            }
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
        let sample = self
            .tools
            .sampling
            .as_ref()
            .map_or(u64::MAX, |s| s.next_ns());
        (now + HOUSEKEEPING_NS).min(sample)
    }

    fn debug_armed(&self) -> bool {
        self.tools.debug.is_some()
            || self.tools.probes.is_some()
            || self.tools.tracing.as_ref().is_some_and(|t| t.armed())
    }

    fn debug_exit(&mut self, m: &mut Machine) -> Result<(), VmError> {
        if let Some(debug) = &mut self.tools.debug {
            return debug.debug_exit(m, &self.points);
        }
        if let Some(probes) = &mut self.tools.probes {
            let ns = self.log.event_ns();
            return probes.debug_exit(m, &self.points, self.tools.events.as_mut(), ns);
        }
        if let (Some(tracer), Some(events)) = (&mut self.tools.tracing, &mut self.tools.events) {
            // Its accesses happened at the time events raised now would
            // have.
            let at = LogPosition {
                guest_ns: self.log.event_ns(),
                ..self.log.position()
            };
            let steps = tracer.step(m, events, &self.points, at)?;
            self.points.traced_steps(steps);
            return Ok(());
        }
        self.points.traced_steps(1);
        Ok(())
    }

    fn claims(&self, addr: u64) -> bool {
        self.points.claims(addr)
            || addr == probe_gate::STORE_GPA
            || self.tools.debug.as_ref().is_some_and(|d| d.claims(addr))
    }

    fn wrote_for_guest(&mut self, m: &mut Machine, written: &[u64]) -> Result<(), VmError> {
        // The watches are looked at once, whichever watched pages it wrote.
        let debug = self.tools.debug.as_mut();
        match debug.filter(|d| written.iter().any(|&gpa| d.claims(gpa))) {
            Some(debug) => debug.written_for_guest(m),
            None => Ok(()),
        }
    }

    fn store(&mut self, m: &mut Machine, addr: u64, data: &[u8]) -> Result<Claimed, VmError> {
        if addr == probe_gate::STORE_GPA {
            return self.gate_event(m, data);
        }
        if let Some(debug) = self.tools.debug.as_mut().filter(|d| d.claims(addr)) {
            debug.watched_write(m, addr, data)?;
            return Ok(Claimed::Passed);
        }
        // The replay's tools set the trap flag where the recording did
        // not: a traced process runs with it, and the debugger steps a
        // thread with it (through the trampoline, when a step starts at
        // the point's position).
        let stepped = self.tools.tracing.is_some()
            || self.tools.debug.is_some()
            || self.tools.probes.is_some();
        let ignored = if stepped { TF } else { 0 };
        let mut written = (self.tools.debug.as_ref())
            .map(|d| d.originals())
            .unwrap_or_default();
        written.extend(
            (self.tools.probes.as_ref())
                .map(|p| p.originals())
                .unwrap_or_default(),
        );
        match self.points.store(m, &mut self.log, ignored, &written)? {
            Found::NotOurs => Ok(Claimed::NotOurs),
            Found::Passed => Ok(Claimed::Passed),
            Found::Point => {
                if let Some(debug) = &mut self.tools.debug {
                    debug.patched(m, None);
                    debug.advanced(m, Advance::Point, &self.log.position())?;
                }
                if let Some(probes) = &mut self.tools.probes {
                    probes.patched(m, None);
                    probes.advanced(m, Advance::Point, None)?;
                }
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
                self.patched(m, self.points.patched_code());
                Ok(Claimed::Passed)
            }
        }
    }

    fn log(&mut self) -> Option<&mut Replayer> {
        Some(&mut self.log)
    }

    fn unemulated(&mut self, m: &mut Machine) -> Result<bool, VmError> {
        match &mut self.tools.debug {
            Some(debug) => debug.unemulated(m),
            None => Ok(false),
        }
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
        self.log.exit(entry, regs)?;
        // The virtio console writes at its transmit notification: the
        // same bytes as the recording's, or the replay stops here.
        self.log.console_out(m.vm.console.take_transmitted())?;
        // Switches before this exit come before what it raises.
        if let Some(events) = &mut self.tools.events {
            events.drain_switches(&m.vm.mem, self.log.event_ns())?;
            if let (Some(tracer), true) = (&mut self.tools.tracing, kernel_entry) {
                tracer.kernel_entry(m, events, self.tools.kernel_stack_top)?;
            }
        }
        let advance = Advance::Exit { kernel_entry };
        if let Some(debug) = &mut self.tools.debug {
            debug.advanced(m, advance, &self.log.position())?;
        }
        if let Some(probes) = &mut self.tools.probes {
            probes.advanced(m, advance, self.tools.events.as_mut())?;
        }
        Ok(())
    }

    fn kicked(&mut self, m: &mut Machine, resumed: Resumed) -> Result<bool, VmError> {
        let patched = self.points.patched_code();
        if self.points.check_time(m, &mut self.log)? {
            self.log.sample_mark_done(false);
            self.samples_given_up += 1;
            self.search_next(m, true)?;
        }
        self.patch_changed(m, patched);
        // A kick: the guest stopped wherever it was, which is what a
        // sample wants (exits would bias it).
        if let (Some(sampling), Some(events)) = (&mut self.tools.sampling, &mut self.tools.events) {
            let guest_ns = self.log.event_ns();
            sampling.take(m, events, &self.points, resumed, guest_ns)?;
        }
        Ok(false)
    }

    fn event_raised(&mut self, m: &mut Machine, raiser: EventRaiser) -> Result<(), VmError> {
        let ns = self.log.event_raised()?;
        if let (Some(debug), EventRaiser::Kernel) = (&mut self.tools.debug, raiser) {
            debug.kernel_event(m)?;
        }
        if let (Some(probes), EventRaiser::Kernel) = (&mut self.tools.probes, raiser) {
            probes.kernel_event(m)?;
        }
        match &mut self.tools.events {
            Some(events) => events.raised(m, raiser, ns),
            None => Ok(()),
        }
    }

    fn switch_ring_announced(&mut self, m: &mut Machine) {
        let Some(gpa) = m.vm.status.switch_ring_gpa else {
            return;
        };
        if let Some(events) = &mut self.tools.events {
            events.attach_switch_ring(&m.vm.mem, gpa);
        }
        if let Some(debug) = &mut self.tools.debug {
            debug.ring_announced(&m.vm.mem, gpa);
        }
        if let Some(probes) = &mut self.tools.probes {
            probes.ring_announced(&m.vm.mem, gpa);
        }
    }

    /// The gates append to the event ring unless something needs to stop
    /// at each event (the debugger, probes given at replay and
    /// `--trace-process` act when one is raised) or `--event-exits` asks
    /// for an exit each; then they leave the guest. A replay that collects
    /// no events empties the ring unread.
    fn gate_modes(&self) -> (probe_gate::GateMode, probe_gate::GateMode) {
        let t = &self.tools;
        let gate = if t.debug.is_none()
            && t.probes.is_none()
            && t.tracing.is_none()
            && !self.event_exits
        {
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
        self.ring = ring;
    }

    /// Events the gates put in the ring since the last exit are captured
    /// before anything this exit brings (switches, clock readings, marks)
    /// moves the capture on: at the time and in the order the exit gate
    /// would have captured them.
    fn left_guest(&mut self, vm: &Vm) -> Result<(), VmError> {
        match (self.ring, &mut self.tools.events) {
            (Some(ring), Some(events)) => events.drain_ring(&vm.mem, ring, self.log.event_ns()),
            (Some(ring), None) => {
                ring.discard(&vm.mem);
                Ok(())
            }
            (None, _) => Ok(()),
        }
    }

    fn ended(&mut self, reason: &EndReason) -> Result<(), VmError> {
        Ok(self.log.end(reason)?)
    }

    fn exit_handled(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.arm_tracing(m)
    }

    fn halted(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        // Idle time is skipped: the interrupt that ended it is due at once.
        if !m.vcpu.halted_interruptible() {
            return Err(VmError::GuestHalted {
                rip: m.vcpu.rip_or_zero(),
            });
        }
        if !self.log.wakeup_due()? {
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
        };
        if let Some(taker) = &self.tools.checkpoints {
            outcome.checkpoints = taker.taken().to_vec();
        }
        outcome.expansion = self.tools.tracing.as_ref().map(|t| t.stats());
    }

    fn finish(
        mut self,
        m: &mut Machine,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError> {
        let result = self.describe_divergence(m, result);
        self.points.end(m);
        let result = match (result, self.tools.tracing.as_mut().map(|t| t.finish())) {
            (Ok(_), Some(Err(e))) => Err(e),
            (result, _) => result,
        };
        let Some(mut events) = self.tools.events.take() else {
            return result;
        };
        let ns = self.log.event_ns();
        let drained = match self.ring {
            Some(ring) => events.drain_ring(&m.vm.mem, ring, ns),
            None => Ok(()),
        }
        .and_then(|()| events.drain_switches(&m.vm.mem, ns));
        let finished = events.finish();
        let mut outcome = result.and_then(|o| drained.map(|()| o))?;
        outcome.events = Some(finished?);
        Ok(outcome)
    }
}
