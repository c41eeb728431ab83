//! What a tool looking into a replay is: a [`ReplayTool`], told at each of
//! the replay's hooks that it cares about (the rest are no-ops), in the
//! order the tools were attached, with what the tools share in a
//! [`ToolContext`]. A tool is one file or folder under `tools/` and one line
//! where `vmm::builder` attaches it.

use std::any::Any;

use devices::control::EventRaiser;
use events::abi::SampleMode;
use journal::Replayer;

use super::events::EventTool;
use super::report::ToolReport;
use crate::points::PointSearch;
use crate::vm::state::Checkpoint;
use crate::vm::{Claimed, Machine, Resumed, VmError};

/// What the tools share, handed to each in turn: the event capture, the
/// log (where replay stands, the time events raised now are captured
/// at), the search for an asynchronous point (reads through its
/// trampoline), and facts of the guest kernel and the recording.
pub(crate) struct ToolContext<'a> {
    /// Where the guest's events go, when the replay collects them.
    pub(crate) events: Option<&'a mut EventTool>,
    pub(crate) log: &'a Replayer,
    pub(crate) points: &'a PointSearch,
    /// Where the guest kernel keeps the top of the current task's kernel
    /// stack, below which a task that entered it from user mode left its
    /// user registers.
    pub(crate) kernel_stack_top: Option<u64>,
    /// The period (ns) of the samples taken at the recording's sample
    /// marks, if they are (what a checkpoint's events must match).
    pub(crate) sample_marks: Option<u64>,
}

impl ToolContext<'_> {
    /// The guest time events raised now are captured at.
    pub(crate) fn event_ns(&self) -> u64 {
        self.log.event_ns()
    }
}

/// A tool that looks into a replay: one method per hook of the replay it
/// may care about, each a no-op unless it does.
pub(crate) trait ReplayTool: Any + Send {
    /// The replay is built and its start restored: what the tool arms
    /// before the first run.
    fn ready(&mut self, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// Before each run (`after_exit`: right after a checked exit):
    /// whether the replay pauses here for the tool.
    fn pause(&mut self, _after_exit: bool) -> bool {
        false
    }

    /// Right after a checked deterministic exit, before the next run,
    /// where the machine may be at rest (a checkpoint).
    fn after_exit(&mut self, _cx: &mut ToolContext, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// When the vCPU must next be out of KVM_RUN for the tool (VM time;
    /// `u64::MAX`: never).
    fn deadline(&self) -> u64 {
        u64::MAX
    }

    /// A deterministic exit, checked against the log (the context
    /// switches before it captured); `kernel_entry`: the guest kernel's
    /// point at an entry from user mode (a system call's).
    fn exit(
        &mut self,
        _cx: &mut ToolContext,
        _m: &mut Machine,
        _kernel_entry: bool,
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// The deterministic exit just checked was the guest kernel reading a
    /// chaos decision (`MSR_INSIGHT_CHAOS_DECISION`): the task asking is
    /// on the vCPU, in the kernel.
    fn chaos_decision(&mut self, _cx: &mut ToolContext, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// After a deterministic exit and the messages it carried.
    fn exit_handled(&mut self, _cx: &mut ToolContext, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// An asynchronous point was reached (its trampoline is out).
    fn point_reached(&mut self, _cx: &mut ToolContext, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// A KVM_RUN ended without a deterministic exit (a kick); `resumed`
    /// says how it started.
    fn kicked(
        &mut self,
        _cx: &mut ToolContext,
        _m: &mut Machine,
        _resumed: Resumed,
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// Whether the recording's sample mark taken at `ns` (its time) is
    /// one to sample at.
    fn wants_mark(&mut self, _ns: u64) -> bool {
        false
    }

    /// A sample where a recording's mark put the task (`mode`: where the
    /// recording found it, at `rip` if not where the vCPU stands).
    fn mark_sample(
        &mut self,
        _cx: &mut ToolContext,
        _m: &mut Machine,
        _mode: SampleMode,
        _rip: Option<u64>,
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// The guest raised an event at the last exit (captured after the
    /// tools looked).
    fn event_raised(
        &mut self,
        _cx: &mut ToolContext,
        _m: &mut Machine,
        _raiser: EventRaiser,
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// A probe raised an event through the probe gate (captured).
    fn gate_event(&mut self, _cx: &mut ToolContext, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// Whether debug exits may be the tool's (it breaks or single-steps).
    fn debug_armed(&self) -> bool {
        false
    }

    /// A debug exit: `None` if not the tool's, else how many single steps
    /// of a traced process it was (a search under way allows for each).
    fn debug_exit(
        &mut self,
        _cx: &mut ToolContext,
        _m: &mut Machine,
    ) -> Result<Option<u64>, VmError> {
        Ok(None)
    }

    /// Whether a store to guest physical `gpa` may be the tool's to
    /// perform.
    fn claims(&self, _gpa: u64) -> bool {
        false
    }

    /// A store the tools may claim: what it was, if the tool's.
    fn store(
        &mut self,
        _cx: &mut ToolContext,
        _m: &mut Machine,
        _gpa: u64,
        _data: &[u8],
    ) -> Result<Option<Claimed>, VmError> {
        Ok(None)
    }

    /// The VMM wrote guest memory for the guest kernel, at these guest
    /// physical addresses, as the guest's own write.
    fn wrote_for_guest(
        &mut self,
        _cx: &mut ToolContext,
        _m: &mut Machine,
        _written: &[u64],
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// KVM could not emulate the instruction the vCPU stands at: whether
    /// the tool took care of it.
    fn unemulated(&mut self, _cx: &mut ToolContext, _m: &mut Machine) -> Result<bool, VmError> {
        Ok(false)
    }

    /// The guest kernel announced its context-switch ring at `gpa` (or a
    /// boot snapshot was restored with it).
    fn switch_ring_announced(&mut self, _m: &Machine, _gpa: u64) {}

    /// Whether the tool acts on each event raised: the probe gates leave
    /// the guest for every event instead of appending to the ring.
    fn stops_at_events(&self) -> bool {
        false
    }

    /// Whether the tool sets the trap flag where the recording did not.
    fn sets_trap_flag(&self) -> bool {
        false
    }

    /// The guest bytes the tool wrote over, as (guest physical address,
    /// original bytes): what a digest of memory must see instead.
    fn written_over(&self) -> Vec<(u64, Vec<u8>)> {
        Vec::new()
    }

    /// A trampoline is about to be put in place: it copies the code it
    /// covers, which must be the guest's own.
    fn patching(&mut self, _m: &Machine) {}

    /// The code a trampoline patches is `code` now (address space,
    /// start, end; `None`: none).
    fn patched(&mut self, _m: &Machine, _code: Option<(u64, u64, u64)>) {}

    /// The replay was restored from checkpoint `c`.
    fn checkpoint_restored(
        &mut self,
        _cx: &mut ToolContext,
        _m: &mut Machine,
        _c: &Checkpoint,
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// What the tool tells of the run, for its outcome.
    fn report(&self, _report: &mut ToolReport) {}

    /// The run ended: the tool closes what it wrote.
    fn finish(&mut self) -> Result<(), VmError> {
        Ok(())
    }
}
