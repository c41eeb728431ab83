//! The debugger's tool on a replay session: its engine (`tools::control`)
//! holding the process selected, the stops of the runs it resumes, and
//! the pauses for snapshots.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vm_memory::GuestMemoryMmap;

use super::position::{Hit, Position};
use super::snapshot::{Snapshot, SnapshotClock};
use super::stop::{Resume, Stop, StopFinder, StopKind};
use crate::points::PointSearch;
use crate::tools::control::{
    Advance, Control, KernelPoints, ProcessInfo, ProcessSelector, Scope, ThreadRegs,
};
use crate::tools::tool::{ReplayTool, ToolContext};
use crate::vm::{Claimed, Machine, VmError};
use devices::control::EventRaiser;

/// The debugger's tool on a replay session.
pub struct DebugTool {
    control: Control,
    finder: StopFinder,
    interrupt: Arc<AtomicBool>,
    /// The replay stopped right after an exit (a snapshot may be taken).
    pub(crate) at_exit: bool,
    pub(crate) snapshots: SnapshotClock,
}

impl DebugTool {
    pub fn new(selector: ProcessSelector, kernel: KernelPoints) -> Self {
        DebugTool {
            control: Control::new(Scope::One(selector), kernel),
            finder: StopFinder::new(),
            interrupt: Arc::new(AtomicBool::new(false)),
            at_exit: false,
            snapshots: SnapshotClock::default(),
        }
    }

    /// Pauses right after an exit for a snapshot about every `every` of
    /// host time.
    pub(crate) fn snapshot_every(&mut self, every: Option<std::time::Duration>) {
        self.snapshots.every = every;
    }

    /// A snapshot was taken (or restored) now.
    pub(crate) fn snapshot_taken(&mut self) {
        self.snapshots.taken();
    }

    /// What interrupts a run (set it, and kick the vCPU).
    pub fn interrupt_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.interrupt)
    }

    /// The process, once started.
    pub fn process(&self) -> Option<&ProcessInfo> {
        self.control.process()
    }

    /// The process's threads that have not exited, first seen first.
    pub fn threads(&self) -> Vec<u32> {
        self.control.threads()
    }

    /// The deterministic exits and asynchronous points replayed.
    pub fn ordinal(&self) -> u64 {
        self.control.ordinal()
    }

    pub fn add_breakpoint(&mut self, va: u64) {
        self.control.add_breakpoint(va);
    }

    pub fn remove_breakpoint(&mut self, va: u64) {
        self.control.remove_breakpoint(va);
    }

    /// Takes every breakpoint away (they leave memory at the next run);
    /// `put_breakpoints` gives them back.
    pub fn take_breakpoints(&mut self) -> std::collections::BTreeSet<u64> {
        self.control.take_breakpoints()
    }

    pub fn put_breakpoints(&mut self, wanted: std::collections::BTreeSet<u64>) {
        self.control.put_breakpoints(wanted);
    }

    /// The next `Resume::To` records the hits from the position after exit
    /// `ordinal` on (0: all its way; `u64::MAX`: none, the breakpoints and
    /// watchpoints out of the guest all its way, where a thread passing
    /// them would cost an exit for nothing).
    pub fn set_hits_from(&mut self, ordinal: u64) {
        self.finder.hits_from = ordinal;
        let arming = self.finder.arming(self.control.ordinal());
        self.control.set_arming(arming);
    }

    /// The hits `Resume::To` recorded on its way, oldest first.
    pub fn take_hits(&mut self) -> Vec<Hit> {
        std::mem::take(&mut self.finder.hits)
    }

    /// Watches writes to `len` bytes at `addr` of the process (from the
    /// next resume).
    pub fn add_watch(&mut self, addr: u64, len: u64) {
        self.control.add_watch(addr, len);
    }

    pub fn remove_watch(&mut self, addr: u64, len: u64) -> bool {
        self.control.remove_watch(addr, len)
    }

    /// Sets how the next run goes (before resuming).
    pub(crate) fn resume(&mut self, m: &mut Machine, how: Resume) -> Result<(), VmError> {
        let (c, f) = (&mut self.control, &mut self.finder);
        f.resume = how;
        f.stop = None;
        self.interrupt.store(false, Ordering::Release);
        let position = match how {
            Resume::To(Position { user: Some(u), .. }) => Some(u.rip),
            _ => None,
        };
        c.prepare(m, f.arming(c.ordinal()), position)?;
        let user = m.vcpu.sregs()?.cs.selector & 3 == 3;
        let current = c.current_thread();
        match how {
            Resume::Step(lwpid) if user && current == Some(lwpid) => {
                // Done at once where it ran in guest kernel mode.
                let done = c.step(m, lwpid)?;
                if done {
                    f.stop_here(c, m, StopKind::Step)?;
                }
            }
            Resume::Step(lwpid) => c.step_after_return(lwpid),
            Resume::Enter(lwpid) if user && current == Some(lwpid) => {
                f.stop_here(c, m, StopKind::Reached)?
            }
            Resume::Enter(lwpid) => c.wait_for_return(lwpid),
            Resume::Continue | Resume::To(_) if user && current.is_some() => {
                c.pass_breakpoint_here(m)?
            }
            _ => {}
        }
        f.resumed(c, m, how)?;
        c.update_returns(m)
    }

    /// The last exit at which a thread of the process entered the guest
    /// kernel from user mode, as far as the replay went (a session opened
    /// at the process's end goes back there).
    pub fn last_kernel_entry(&self) -> Option<u64> {
        self.finder.last_entry
    }

    /// The stop found, if the run is to pause now.
    pub(crate) fn take_stop(&mut self) -> Option<Stop> {
        self.finder.stop.take()
    }

    /// After every deterministic exit and every asynchronous point
    /// reached (`advance`), with the log at `log`: the ordinal moves on,
    /// and what depends on where the tasks are is looked at.
    pub(crate) fn advanced(
        &mut self,
        m: &mut Machine,
        advance: Advance,
        log: &journal::LogPosition,
    ) -> Result<(), VmError> {
        self.at_exit = false;
        let (c, f) = (&mut self.control, &mut self.finder);
        c.advanced(m, advance, f)?;
        f.advanced(c, m, advance, log, &self.interrupt)?;
        c.settle(m, f.arming(c.ordinal()))
    }

    /// Reads the process's memory at `va` into `buf` as the program would
    /// see it (never a breakpoint's byte); how many bytes could be read.
    /// `replaced`: the bytes an asynchronous point's trampoline replaced.
    pub(crate) fn read_user(
        &self,
        m: &Machine,
        replaced: &[(u64, Vec<u8>)],
        va: u64,
        buf: &mut [u8],
    ) -> usize {
        self.control.read_user(m, replaced, va, buf)
    }

    /// The user registers of thread `lwpid` as the program sees them.
    pub(crate) fn thread_regs(
        &self,
        m: &Machine,
        search: &PointSearch,
        lwpid: u32,
    ) -> Option<ThreadRegs> {
        self.control.thread_regs(m, search, lwpid)
    }

    /// Takes every breakpoint out of guest memory (guest memory exactly
    /// as the guest wrote it).
    pub(crate) fn lift_breakpoints(&mut self, mem: &GuestMemoryMmap) {
        self.control.lift_breakpoints(mem);
    }

    /// Puts the breakpoints the process maps back in place.
    pub(crate) fn sync_breakpoints(&mut self, m: &Machine) {
        self.control.sync_breakpoints(m);
    }

    /// A snapshot of the replay here (right after a deterministic exit,
    /// at rest, breakpoints out of memory), sharing pages with
    /// `previous`.
    pub(crate) fn take_snapshot(
        &self,
        m: &mut Machine,
        log: journal::LogPosition,
        points: crate::vm::state::PointStats,
        previous: Option<&Snapshot>,
    ) -> Result<Snapshot, VmError> {
        let c = &self.control;
        Snapshot::take(m, c.ordinal(), log, points, c.tasks(), previous)
    }

    /// The machine was put back to `snapshot` (breakpoints out): the
    /// tasks as they were then, nothing under way, breakpoints back in.
    pub(crate) fn restored(&mut self, m: &mut Machine, snapshot: &Snapshot) -> Result<(), VmError> {
        let f = &mut self.finder;
        f.stop = None;
        f.hits.clear();
        let arming = f.arming(snapshot.ordinal);
        self.control
            .restored(m, &snapshot.tasks, snapshot.ordinal, arming)?;
        self.at_exit = true;
        self.snapshot_taken();
        Ok(())
    }
}

/// The debugger on the replay: it pauses the run at its stops and
/// snapshots, moves its engine on at every exit and point, takes the
/// debug exits, the writes to watched pages and the kernel's events, and
/// keeps its breakpoints out of a trampoline's code.
impl ReplayTool for DebugTool {
    /// Before each KVM_RUN: whether the replay pauses here, for a stop or
    /// a snapshot.
    fn pause(&mut self, after_exit: bool) -> bool {
        self.at_exit = after_exit;
        if self.finder.stop.is_some() {
            return true;
        }
        self.snapshots.due(after_exit)
    }

    fn exit(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
        kernel_entry: bool,
    ) -> Result<(), VmError> {
        self.advanced(m, Advance::Exit { kernel_entry }, &cx.log.position())
    }

    fn point_reached(&mut self, cx: &mut ToolContext, m: &mut Machine) -> Result<(), VmError> {
        self.advanced(m, Advance::Point, &cx.log.position())
    }

    /// A thread's exit ends the process when it is its last.
    fn event_raised(
        &mut self,
        _cx: &mut ToolContext,
        m: &mut Machine,
        raiser: EventRaiser,
    ) -> Result<(), VmError> {
        self.control.event_raised(m, raiser, &mut self.finder)
    }

    fn debug_armed(&self) -> bool {
        true
    }

    fn debug_exit(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
    ) -> Result<Option<u64>, VmError> {
        self.control.debug_exit(m, cx.points, &mut self.finder)?;
        Ok(Some(0))
    }

    /// A write to a watched page.
    fn claims(&self, gpa: u64) -> bool {
        self.control.claims(gpa)
    }

    /// The guest's write to a watched page: performed, and the watches
    /// looked at.
    fn store(
        &mut self,
        _cx: &mut ToolContext,
        m: &mut Machine,
        gpa: u64,
        data: &[u8],
    ) -> Result<Option<Claimed>, VmError> {
        if !self.control.claims(gpa) {
            return Ok(None);
        }
        (self.control).watched_write(m, gpa, data, &mut self.finder)?;
        Ok(Some(Claimed::Passed))
    }

    /// The watches are looked at once, whichever watched pages it wrote,
    /// as after the kernel's own write.
    fn wrote_for_guest(
        &mut self,
        _cx: &mut ToolContext,
        m: &mut Machine,
        written: &[u64],
    ) -> Result<(), VmError> {
        if !written.iter().any(|&gpa| self.control.claims(gpa)) {
            return Ok(());
        }
        self.control.written_for_guest(m, &mut self.finder)
    }

    /// A store to a watched page KVM could not emulate (a vector store).
    fn unemulated(&mut self, _cx: &mut ToolContext, m: &mut Machine) -> Result<bool, VmError> {
        self.control.unemulated(m)
    }

    fn switch_ring_announced(&mut self, m: &Machine, gpa: u64) {
        self.control.ring_announced(&m.vm.mem, gpa);
    }

    fn stops_at_events(&self) -> bool {
        true
    }

    /// It steps a thread with the trap flag (through the trampoline, when
    /// a step starts at the point's position).
    fn sets_trap_flag(&self) -> bool {
        true
    }

    fn written_over(&self) -> Vec<(u64, Vec<u8>)> {
        self.control.originals()
    }

    /// The trampoline copies the code it covers: without `int3`s.
    fn patching(&mut self, m: &Machine) {
        self.control.lift_breakpoints(&m.vm.mem);
    }

    /// The breakpoints stay out of the patch, and go back in where it
    /// was.
    fn patched(&mut self, m: &Machine, code: Option<(u64, u64, u64)>) {
        self.control.patched(m, code);
    }
}
