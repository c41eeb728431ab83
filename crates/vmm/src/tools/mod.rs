//! The tools that look into a replay, each a [`tool::ReplayTool`] in a
//! file or folder of its own: samples (`samples.rs`), the tracing of one
//! process's instructions and memory accesses (`tracing.rs`), checkpoints
//! (`checkpoints.rs`), a debugger's hold on one process (`debug/`) and
//! probes given at replay (`probes/`), the last two over the
//! process-control engine (`control/`). The event capture (`events.rs`)
//! is what they share, with the rest of a [`tool::ToolContext`]. The replay
//! session owns them ([`ReplayTools`]) and hands each of its hooks to
//! them in the order they were attached; the vCPU loop never sees them.

pub(crate) mod checkpoints;
pub mod control;
pub mod debug;
pub(crate) mod events;
pub(crate) mod exec;
pub(crate) mod frames;
pub(crate) mod kernel_steps;
pub(crate) mod objects;
pub mod probes;
pub(crate) mod report;
pub(crate) mod samples;
pub(crate) mod tool;
pub(crate) mod tracing;

pub use checkpoints::{checkpoint_before, checkpoint_unfit, CheckpointEvery, CheckpointRestored};
pub use report::{CheckpointTaken, ExpansionStats, TraceStart};
pub use tracing::{ExpansionSpec, TraceTarget};

use std::any::Any;
use std::path::Path;

use ::events::abi::SampleMode;
use ::events::capture::CaptureSummary;
use devices::control::EventRaiser;
use introspect::event_ring::EventRing;
use journal::{LogPosition, Replayer};
use trace::checkpoints::Digest32;
use vm_memory::GuestMemoryMmap;

use checkpoints::{CheckpointTaker, RestoredFrom};
use events::EventTool;
use report::ToolReport;
use tool::{ReplayTool, ToolContext};

use crate::points::PointSearch;
use crate::vm::state::Checkpoint;
use crate::vm::{Claimed, Machine, Resumed, VmError};

/// What a replay session has attached: the tools, in order, and what they
/// share.
#[derive(Default)]
pub(crate) struct ReplayTools {
    /// Where the guest's events go (with the tools that add to them).
    events: Option<EventTool>,
    /// The event ring the gates append to (`None`: they leave the guest
    /// for each event).
    ring: Option<EventRing>,
    /// Where the guest kernel keeps the top of the current task's kernel
    /// stack.
    kernel_stack_top: Option<u64>,
    /// The period of the samples taken at the recording's marks.
    sample_marks: Option<u64>,
    /// The checkpoint this replay was restored from, where a new set of
    /// checkpoints goes on.
    restored: Option<RestoredFrom>,
    tools: Vec<Box<dyn ReplayTool>>,
}

impl ReplayTools {
    pub(crate) fn new(kernel_stack_top: Option<u64>) -> Self {
        ReplayTools {
            kernel_stack_top,
            ..Default::default()
        }
    }

    /// The guest's events go to `events`; `sample_marks`: the period of
    /// the samples taken at the recording's marks, if they are.
    pub(crate) fn capture(&mut self, events: EventTool, sample_marks: Option<u64>) {
        self.events = Some(events);
        self.sample_marks = sample_marks;
    }

    /// The event capture, if the replay collects events.
    pub(crate) fn events_mut(&mut self) -> Option<&mut EventTool> {
        self.events.as_mut()
    }

    /// Attaches `tool`, after those attached before.
    pub(crate) fn attach(&mut self, tool: impl ReplayTool) {
        self.tools.push(Box::new(tool));
    }

    /// The tool of type `T`, if one is attached.
    pub(crate) fn find<T: ReplayTool>(&self) -> Option<&T> {
        (self.tools.iter()).find_map(|t| (t.as_ref() as &dyn Any).downcast_ref::<T>())
    }

    pub(crate) fn find_mut<T: ReplayTool>(&mut self) -> Option<&mut T> {
        (self.tools.iter_mut()).find_map(|t| (t.as_mut() as &mut dyn Any).downcast_mut::<T>())
    }

    /// Calls `hook` on each tool in turn, with the shared context.
    fn each(
        &mut self,
        log: &Replayer,
        points: &PointSearch,
        mut hook: impl FnMut(&mut dyn ReplayTool, &mut ToolContext) -> Result<(), VmError>,
    ) -> Result<(), VmError> {
        let mut cx = ToolContext {
            events: self.events.as_mut(),
            log,
            points,
            kernel_stack_top: self.kernel_stack_top,
            sample_marks: self.sample_marks,
        };
        for tool in &mut self.tools {
            hook(tool.as_mut(), &mut cx)?;
        }
        Ok(())
    }

    /// The first answer a tool gives `hook`, asked in turn.
    fn first<T>(
        &mut self,
        log: &Replayer,
        points: &PointSearch,
        mut hook: impl FnMut(&mut dyn ReplayTool, &mut ToolContext) -> Result<Option<T>, VmError>,
    ) -> Result<Option<T>, VmError> {
        let mut answer = None;
        self.each(log, points, |tool, cx| {
            if answer.is_none() {
                answer = hook(tool, cx)?;
            }
            Ok(())
        })?;
        Ok(answer)
    }

    /// The replay is built and its start restored.
    pub(crate) fn ready(&mut self, m: &mut Machine) -> Result<(), VmError> {
        (self.tools.iter_mut()).try_for_each(|t| t.ready(m))
    }

    /// Before each run: whether a tool pauses the replay here.
    pub(crate) fn pause(&mut self, after_exit: bool) -> bool {
        let mut pause = false;
        for t in &mut self.tools {
            pause |= t.pause(after_exit);
        }
        pause
    }

    /// Right after a checked deterministic exit, before the next run.
    pub(crate) fn after_exit(
        &mut self,
        m: &mut Machine,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        self.each(log, points, |t, cx| t.after_exit(cx, m))
    }

    /// When the vCPU must next be out of KVM_RUN for the tools.
    pub(crate) fn deadline(&self) -> u64 {
        (self.tools.iter()).fold(u64::MAX, |at, t| at.min(t.deadline()))
    }

    /// The exit just checked was the guest kernel reading a chaos decision.
    pub(crate) fn chaos_decision(
        &mut self,
        m: &mut Machine,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        self.each(log, points, |t, cx| t.chaos_decision(cx, m))
    }

    /// A deterministic exit, checked: the context switches before it are
    /// captured before anything it raises, then the tools look.
    pub(crate) fn exit(
        &mut self,
        m: &mut Machine,
        kernel_entry: bool,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        if let Some(events) = &mut self.events {
            events.drain_switches(&m.vm.mem, log.event_ns())?;
        }
        self.each(log, points, |t, cx| t.exit(cx, m, kernel_entry))
    }

    /// After a deterministic exit and the messages it carried.
    pub(crate) fn exit_handled(
        &mut self,
        m: &mut Machine,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        self.each(log, points, |t, cx| t.exit_handled(cx, m))
    }

    /// An asynchronous point was reached.
    pub(crate) fn point_reached(
        &mut self,
        m: &mut Machine,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        self.each(log, points, |t, cx| t.point_reached(cx, m))
    }

    /// A kick.
    pub(crate) fn kicked(
        &mut self,
        m: &mut Machine,
        resumed: Resumed,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        self.each(log, points, |t, cx| t.kicked(cx, m, resumed))
    }

    /// Whether a tool samples at the recording's mark taken at `ns` (each
    /// is asked).
    pub(crate) fn wants_mark(&mut self, ns: u64) -> bool {
        let mut wanted = false;
        for t in &mut self.tools {
            wanted |= t.wants_mark(ns);
        }
        wanted
    }

    /// A sample where a recording's mark put the task.
    pub(crate) fn mark_sample(
        &mut self,
        m: &mut Machine,
        (mode, rip): (SampleMode, Option<u64>),
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        self.each(log, points, |t, cx| t.mark_sample(cx, m, mode, rip))
    }

    /// The guest raised an event at the last exit, which the recording
    /// saw at guest time `ns`: the tools look, then it is captured.
    pub(crate) fn event_raised(
        &mut self,
        m: &mut Machine,
        raiser: EventRaiser,
        ns: u64,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        self.each(log, points, |t, cx| t.event_raised(cx, m, raiser))?;
        match &mut self.events {
            Some(events) => events.raised(m, raiser, ns),
            None => Ok(()),
        }
    }

    /// A probe raised an event through the gate, its buffer at `address`:
    /// captured at the recording's latest time known, then the tools look.
    pub(crate) fn gate_event(
        &mut self,
        m: &mut Machine,
        address: u64,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        let Some(events) = &mut self.events else {
            return Ok(());
        };
        events.raised_at_gate(m, address, log.event_ns())?;
        self.each(log, points, |t, cx| t.gate_event(cx, m))
    }

    /// Whether a tool may take debug exits.
    pub(crate) fn debug_armed(&self) -> bool {
        self.tools.iter().any(|t| t.debug_armed())
    }

    /// A debug exit: the steps of a traced process it was, if a tool took
    /// it.
    pub(crate) fn debug_exit(
        &mut self,
        m: &mut Machine,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<Option<u64>, VmError> {
        self.first(log, points, |t, cx| t.debug_exit(cx, m))
    }

    /// Whether a store to `gpa` may be a tool's.
    pub(crate) fn claims(&self, gpa: u64) -> bool {
        self.tools.iter().any(|t| t.claims(gpa))
    }

    /// A store the tools may claim: what it was, if a tool's.
    pub(crate) fn store(
        &mut self,
        m: &mut Machine,
        (gpa, data): (u64, &[u8]),
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<Option<Claimed>, VmError> {
        self.first(log, points, |t, cx| t.store(cx, m, gpa, data))
    }

    /// The VMM wrote guest memory for the guest kernel.
    pub(crate) fn wrote_for_guest(
        &mut self,
        m: &mut Machine,
        written: &[u64],
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        self.each(log, points, |t, cx| t.wrote_for_guest(cx, m, written))
    }

    /// An instruction KVM could not emulate: whether a tool took it.
    pub(crate) fn unemulated(
        &mut self,
        m: &mut Machine,
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<bool, VmError> {
        let took = self.first(log, points, |t, cx| Ok(t.unemulated(cx, m)?.then_some(())))?;
        Ok(took.is_some())
    }

    /// The guest kernel announced its context-switch ring.
    pub(crate) fn switch_ring_announced(&mut self, m: &Machine) {
        let Some(gpa) = m.vm.status.switch_ring_gpa else {
            return;
        };
        if let Some(events) = &mut self.events {
            events.attach_switch_ring(&m.vm.mem, gpa);
        }
        for t in &mut self.tools {
            t.switch_ring_announced(m, gpa);
        }
    }

    /// A boot snapshot was restored: the context-switch ring it announced
    /// goes on from its head.
    pub(crate) fn snapshot_restored(&mut self, m: &Machine) {
        let Some(gpa) = m.vm.status.switch_ring_gpa else {
            return;
        };
        if let Some(events) = &mut self.events {
            events.ring_from_head(&m.vm.mem, gpa);
        }
        for t in &mut self.tools {
            t.switch_ring_announced(m, gpa);
        }
    }

    /// Whether a tool acts on each event raised.
    pub(crate) fn stops_at_events(&self) -> bool {
        self.tools.iter().any(|t| t.stops_at_events())
    }

    /// Whether a tool sets the trap flag where the recording did not.
    pub(crate) fn sets_trap_flag(&self) -> bool {
        self.tools.iter().any(|t| t.sets_trap_flag())
    }

    /// The guest bytes the tools wrote over.
    pub(crate) fn written_over(&self) -> Vec<(u64, Vec<u8>)> {
        self.tools.iter().flat_map(|t| t.written_over()).collect()
    }

    /// A trampoline is about to be put in place.
    pub(crate) fn patching(&mut self, m: &Machine) {
        for t in &mut self.tools {
            t.patching(m);
        }
    }

    /// The code a trampoline patches is `code` now.
    pub(crate) fn patched(&mut self, m: &Machine, code: Option<(u64, u64, u64)>) {
        for t in &mut self.tools {
            t.patched(m, code);
        }
    }

    /// The gates are in place; `ring` is the event ring when they append
    /// to it.
    pub(crate) fn gate_installed(&mut self, ring: Option<EventRing>) {
        self.ring = ring;
    }

    /// Events the gates put in the ring since the last exit are captured
    /// at `ns`, before anything this exit brings moves the capture on; a
    /// replay that collects no events empties the ring unread.
    pub(crate) fn left_guest(&mut self, mem: &GuestMemoryMmap, ns: u64) -> Result<(), VmError> {
        match (self.ring, &mut self.events) {
            (Some(ring), Some(events)) => events.drain_ring(mem, ring, ns),
            (Some(ring), None) => {
                ring.discard(mem);
                Ok(())
            }
            (None, _) => Ok(()),
        }
    }

    /// Why the checkpoint `c` cannot start this replay, if it cannot: its
    /// events were captured otherwise.
    pub(crate) fn check_checkpoint(&self, c: &Checkpoint) -> Result<(), VmError> {
        let Some(events) = &self.events else {
            return Ok(());
        };
        match checkpoints::unfit_for_events(c, events.stacks.is_some(), self.sample_marks) {
            Some(why) => Err(VmError::Restore(format!(
                "{why}: take the checkpoints again with --events or --diagnose (and the same \
                 --unwind and --sample-period)"
            ))),
            None => Ok(()),
        }
    }

    /// The replay was restored from the checkpoint `c` (`digest`, guest
    /// memory as the restore wrote it in `shadow`): the capture goes on
    /// from where it stood, and a new set of checkpoints from there.
    pub(crate) fn checkpoint_restored(
        &mut self,
        m: &mut Machine,
        (c, digest, shadow): (&Checkpoint, Digest32, Vec<u8>),
        log: &Replayer,
        points: &PointSearch,
    ) -> Result<(), VmError> {
        if let (Some(events), Some(state)) = (&mut self.events, &c.events) {
            events.resume_from(&m.vm.mem, state)?;
        }
        self.each(log, points, |t, cx| t.checkpoint_restored(cx, m, c))?;
        self.restored = Some(RestoredFrom {
            checkpoint: (c.exit, digest),
            shadow,
        });
        Ok(())
    }

    /// Takes a checkpoint in `trace` every `every` from `position` on, of a
    /// guest with `ram` bytes, replacing the checkpoints it had (after a
    /// restore: from the restored one on).
    pub(crate) fn take_checkpoints(
        &mut self,
        trace: &Path,
        every: checkpoints::CheckpointEvery,
        position: &LogPosition,
        ram: usize,
    ) -> Result<(), VmError> {
        let taker = CheckpointTaker::new(trace, every, position, ram, self.restored.take())?;
        self.tools
            .retain(|t| !(t.as_ref() as &dyn Any).is::<CheckpointTaker>());
        self.attach(taker);
        Ok(())
    }

    /// What the tools tell of the run.
    pub(crate) fn report(&self) -> ToolReport {
        let mut report = ToolReport::default();
        for t in &self.tools {
            t.report(&mut report);
        }
        report
    }

    /// The run ended with `result`: each tool closes what it wrote (the
    /// first failure counts, after the run's own), then the capture takes
    /// what is left in the rings, at `ns`, and closes the database.
    pub(crate) fn finish<T>(
        mut self,
        mem: &GuestMemoryMmap,
        ns: u64,
        result: Result<T, VmError>,
    ) -> Result<(T, Option<CaptureSummary>), VmError> {
        let mut result = result;
        for t in &mut self.tools {
            let closed = t.finish();
            if let (Ok(_), Err(e)) = (&result, closed) {
                result = Err(e);
            }
        }
        let Some(mut events) = self.events.take() else {
            return result.map(|r| (r, None));
        };
        let drained = match self.ring {
            Some(ring) => events.drain_ring(mem, ring, ns),
            None => Ok(()),
        }
        .and_then(|()| events.drain_switches(mem, ns));
        let finished = events.finish();
        let r = result.and_then(|r| drained.map(|()| r))?;
        Ok((r, Some(finished?)))
    }
}
