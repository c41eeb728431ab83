//! The probes' tool on a replay: an engine of its own
//! (`tools::control`), whose supervisor collects the hits of followed
//! processes and the process changes, and the probes' state, which
//! makes them events.

use super::plan::ProbePlan;
use super::state::{ProbeHit, ProbeState, ProcessChange};
use crate::points::PointSearch;
use crate::tools::control::{
    Advance, Arming, BreakpointHit, Control, KernelPoints, ProcessInfo, Scope, Supervisor, Verdict,
};
use crate::tools::events::EventTool;
use crate::tools::tool::{ReplayTool, ToolContext};
use crate::vm::{Machine, VmError};
use devices::control::EventRaiser;

/// The engine's supervisor for the probes: every thread passes its
/// breakpoints, each hit of a followed process kept with its registers,
/// and the process changes with them, until the tool looks.
#[derive(Default)]
struct Collected {
    hits: Vec<ProbeHit>,
    changes: Vec<ProcessChange>,
}

impl Supervisor for Collected {
    fn breakpoint(&mut self, _control: &Control, hit: &BreakpointHit) -> Verdict {
        if let (Some(space), Some((pid, lwpid))) = (hit.space, hit.task) {
            self.hits.push(ProbeHit {
                pid,
                lwpid,
                cr3: hit.cr3,
                space,
                regs: hit.regs,
            });
        }
        Verdict::Pass
    }

    fn started(
        &mut self,
        _control: &Control,
        _m: &Machine,
        process: &ProcessInfo,
    ) -> Result<(), VmError> {
        self.changes.push(ProcessChange::Started(process.clone()));
        Ok(())
    }

    fn ended(&mut self, cr3: u64) {
        self.changes.push(ProcessChange::Ended { cr3 });
    }

    fn forked(&mut self, pid: u32, cr3: u64, parent: u64) {
        self.changes
            .push(ProcessChange::Forked { pid, cr3, parent });
    }
}

/// The probes' tool on a replay: an engine of its own, which tells every
/// program a process starts and follows the processes the probes go
/// into, and the probes' state, which makes the hits events.
pub(crate) struct ProbeTool {
    control: Control,
    collected: Collected,
    state: ProbeState,
}

impl ProbeTool {
    pub(crate) fn new(plan: &ProbePlan, kernel: KernelPoints) -> Self {
        ProbeTool {
            control: Control::new(Scope::Every, kernel),
            collected: Collected::default(),
            state: ProbeState::new(plan),
        }
    }

    /// The replay is ready to run: the engine follows programs and
    /// collects hits from here to the replay's end, never stopping.
    pub(crate) fn start(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.control.prepare(m, Arming::OWN, None)?;
        self.control.update_returns(m)
    }

    /// After every deterministic exit and asynchronous point (`advance`):
    /// the engine moves on; after an exit, the processes followed are
    /// looked at (`ProbeState::advanced`).
    pub(crate) fn advanced(
        &mut self,
        m: &mut Machine,
        advance: Advance,
        events: Option<&mut EventTool>,
    ) -> Result<(), VmError> {
        let c = &mut self.control;
        c.advanced(m, advance, &mut self.collected)?;
        c.settle(m, Arming::OWN)?;
        match (advance, events) {
            (Advance::Exit { .. }, Some(events)) => {
                let changes = std::mem::take(&mut self.collected.changes);
                self.state.advanced(m, c, changes, events)
            }
            _ => Ok(()),
        }
    }

    /// A debug exit: one of the engine's kernel breakpoints; the hits it
    /// collected become events at the replay's event time `ns`.
    pub(crate) fn debug_exit(
        &mut self,
        m: &mut Machine,
        search: &PointSearch,
        events: Option<&mut EventTool>,
        ns: u64,
    ) -> Result<(), VmError> {
        let c = &mut self.control;
        c.debug_exit(m, search, &mut self.collected)?;
        let Some(events) = events else {
            return Ok(());
        };
        let changes = std::mem::take(&mut self.collected.changes);
        let hits = std::mem::take(&mut self.collected.hits);
        self.state.collect(m, c, changes, hits, events, ns)
    }
}

/// The probes on the replay: their engine moves on at every exit and
/// point and takes the debug exits and the kernel's events, its
/// breakpoints kept out of a trampoline's code; the hits become events.
impl ReplayTool for ProbeTool {
    fn ready(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.start(m)
    }

    fn exit(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
        kernel_entry: bool,
    ) -> Result<(), VmError> {
        self.advanced(m, Advance::Exit { kernel_entry }, cx.events.as_deref_mut())
    }

    fn point_reached(&mut self, _cx: &mut ToolContext, m: &mut Machine) -> Result<(), VmError> {
        self.advanced(m, Advance::Point, None)
    }

    /// A followed process may have ended.
    fn event_raised(
        &mut self,
        _cx: &mut ToolContext,
        m: &mut Machine,
        raiser: EventRaiser,
    ) -> Result<(), VmError> {
        self.control.event_raised(m, raiser, &mut self.collected)
    }

    fn debug_armed(&self) -> bool {
        true
    }

    fn debug_exit(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
    ) -> Result<Option<u64>, VmError> {
        let ns = cx.event_ns();
        ProbeTool::debug_exit(self, m, cx.points, cx.events.as_deref_mut(), ns)?;
        Ok(Some(0))
    }

    fn switch_ring_announced(&mut self, m: &Machine, gpa: u64) {
        self.control.ring_announced(&m.vm.mem, gpa);
    }

    fn stops_at_events(&self) -> bool {
        true
    }

    fn sets_trap_flag(&self) -> bool {
        true
    }

    fn written_over(&self) -> Vec<(u64, Vec<u8>)> {
        self.control.originals()
    }

    fn patching(&mut self, m: &Machine) {
        self.control.lift_breakpoints(&m.vm.mem);
    }

    fn patched(&mut self, m: &Machine, code: Option<(u64, u64, u64)>) {
        self.control.patched(m, code);
    }
}
