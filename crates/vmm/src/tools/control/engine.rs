//! The engine itself: what it holds, what it tells its supervisor and
//! asks it, and what a supervisor asks of it between runs and at every
//! deterministic exit or asynchronous point.

use kvm_bindings::kvm_regs;
use vm_memory::GuestMemoryMmap;

use super::breakpoints::{self, Breakpoints};
use super::tasks::{ProcessInfo, ProcessSelector, Tasks, ThreadRegs, UserPoint, RF};
use super::traps::KernelTraps;
use super::watch::Watches;
use crate::points::PointSearch;
use crate::vm::{Machine, VmError};
use introspect::gva::peek_user;
use introspect::instructions::TF;
use journal::preempt::state::CR3_ROOT;

/// Guest kernel code and data the engine uses, from the kernel image's
/// symbols (`vmm::builder` looks them up).
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelPoints {
    /// The variable that holds the top of the current task's kernel
    /// stack.
    pub stack_top_var: Option<u64>,
    /// The `swapgs` before the `iretq` of every return to user mode but
    /// fast system-call returns (in
    /// `swapgs_restore_regs_and_return_to_usermode`).
    pub iret: Option<u64>,
    /// The `swapgs; sysretq` of fast system-call returns
    /// (`entry_SYSRETQ_unsafe_stack`).
    pub sysret: Option<u64>,
    /// The guest kernel single-steps user threads (a chaos recording,
    /// docs/chaos.md): a single-step trap the engine did not ask for is
    /// the guest's own. Otherwise it is what is left of one of the
    /// engine's steps (a stop ended it), and the engine takes it.
    pub guest_steps: bool,
}

/// Which processes the engine holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// One: the first that executes a program the selector names, with
    /// its threads (a debugger's).
    One(ProcessSelector),
    /// Every program a process starts is told; the supervisor follows the
    /// processes it wants (`Control::follow`), and the children they fork
    /// (probes given at replay).
    Every,
}

impl Scope {
    /// Whether a program executed from `path` by process `pid` may be one
    /// to tell of.
    pub(super) fn selects(&self, pid: u32, path: &str) -> bool {
        match self {
            Scope::One(selector) => selector.matches(pid, path),
            Scope::Every => true,
        }
    }
}

/// Which of the breakpoints and watchpoints are in the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Arming {
    /// The supervisor's (out on a stretch where it records nothing: a
    /// thread passing one would cost an exit for nothing).
    pub(crate) own: bool,
    /// The one at the position to reach (`Control::prepare`).
    pub(crate) position: bool,
}

impl Arming {
    /// The supervisor's own, and no position to reach.
    pub(crate) const OWN: Arming = Arming {
        own: true,
        position: false,
    };
}

/// What moved the replay on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Advance {
    /// A deterministic exit; `kernel_entry`: the guest kernel's point at
    /// an entry from user mode (a system call's).
    Exit { kernel_entry: bool },
    /// An asynchronous point.
    Point,
}

/// What a supervisor makes of what the engine told it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The thread stops there: the replay pauses before it goes on.
    Stop,
    /// It goes on.
    Pass,
}

/// A thread at one of the breakpoints, the instruction under it not run
/// yet.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BreakpointHit<'m> {
    /// The task on the CPU: (pid, lwpid).
    pub(crate) task: Option<(u32, u32)>,
    /// The task as a thread of the process held, if the breakpoint is
    /// that process's at this address.
    pub(crate) thread: Option<u32>,
    /// The address space it runs in.
    pub(crate) cr3: u64,
    /// The followed address space whose breakpoint it is: `cr3`, or its
    /// parent's for a child it forked.
    pub(crate) space: Option<u64>,
    /// The supervisor asked for a breakpoint here (not only the one at a
    /// position to reach).
    pub(crate) wanted: bool,
    /// Its user registers, RIP at the breakpoint's address.
    pub(crate) regs: kvm_regs,
    /// Guest memory, where its position's stack is read.
    pub(crate) mem: &'m GuestMemoryMmap,
}

impl BreakpointHit<'_> {
    /// Where the thread `lwpid` stands: its position.
    pub(crate) fn point(&self, lwpid: u32) -> UserPoint {
        UserPoint::at(self.mem, self.cr3, lwpid, &self.regs)
    }
}

/// The engine's user, which decides what happened means: told as it
/// happens (the vCPU where it happened), its verdict acted on at once.
/// Every method but `breakpoint` and `watch_changed` is told only.
pub(crate) trait Supervisor {
    /// A thread stands at one of the breakpoints: whether it stops there
    /// (else it runs the instruction under it, alone, and goes on).
    fn breakpoint(&mut self, _control: &Control, _hit: &BreakpointHit) -> Verdict {
        Verdict::Pass
    }

    /// A write changed the watched bytes at `addr`: the process's thread
    /// on the CPU is in user mode right after the instruction that wrote,
    /// or, for a write by the kernel (a system call's), at its return to
    /// user mode. Whether it stops there (a step under way ends).
    fn watch_changed(
        &mut self,
        _control: &Control,
        _m: &Machine,
        _addr: u64,
    ) -> Result<Verdict, VmError> {
        Ok(Verdict::Pass)
    }

    /// The step under way ended: its thread ran one user instruction.
    /// `moved`: the program's own address of the instruction the thread
    /// stands at, where that is a trampoline's copy.
    fn stepped(
        &mut self,
        _control: &Control,
        _m: &Machine,
        _moved: Option<u64>,
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// The task `lwpid` on the CPU came back to user mode from the
    /// kernel, its next instruction at `user`.
    fn returned(
        &mut self,
        _control: &Control,
        _m: &Machine,
        _lwpid: u32,
        _user: &kvm_regs,
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// The thread waited for (`Control::wait_for_return`) is about to run
    /// a user instruction.
    fn entered(&mut self, _control: &Control, _m: &Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// A process started a program, at its first instruction, nothing of
    /// it run yet (under `Scope::One`: the process held from now on).
    fn started(
        &mut self,
        _control: &Control,
        _m: &Machine,
        _process: &ProcessInfo,
    ) -> Result<(), VmError> {
        Ok(())
    }

    /// The followed process of address space `cr3` ended, or executed
    /// another program (whose start comes next).
    fn ended(&mut self, _cr3: u64) {}

    /// A followed process (its address space `parent`) forked a child
    /// (`pid`, `cr3`), followed from its first return to user mode, now:
    /// its memory is a copy of its parent's.
    fn forked(&mut self, _pid: u32, _cr3: u64, _parent: u64) {}

    /// The process held ended: its last thread exited with `status`.
    fn exited(&mut self, _control: &Control, _m: &Machine, _status: i32) -> Result<(), VmError> {
        Ok(())
    }
}

/// A stepping in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stepping {
    /// The thread runs one instruction under the trap flag, from where it
    /// stood (`from`) after `ordinal` exits and points.
    Trap { from: UserPoint, ordinal: u64 },
    /// The thread is in the kernel (or about to enter it with a system
    /// call): told at its first user instruction after the kernel.
    AtReturn(u32),
    /// Then run that instruction under the trap flag.
    ReturnThenTrap(u32),
}

/// A breakpoint out of memory for one step of the instruction under it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Lifted {
    pub(super) gpa: u64,
    /// The thread stepped over it had the trap flag set already: the
    /// guest kernel single-steps it (`record --chaos`), so the trap that
    /// ends the step is the guest's too, and goes to its #DB handler as in
    /// the recording.
    pub(super) in_guest_step: bool,
}

/// The engine on a replay.
pub(crate) struct Control {
    pub(super) scope: Scope,
    /// The guest kernel variable with the top of the current task's
    /// kernel stack.
    pub(super) stack_top_var: Option<u64>,
    /// `KernelPoints::guest_steps`.
    pub(super) guest_steps: bool,
    pub(super) traps: KernelTraps,
    pub(super) tasks: Tasks,
    pub(super) breakpoints: Breakpoints,
    pub(super) watches: Watches,
    pub(super) stepping: Option<Stepping>,
    /// The breakpoint under the instruction a thread is being stepped
    /// over, out of memory until the step ends.
    pub(super) lifted: Option<Lifted>,
    /// That instruction is a system call: the breakpoint goes back at the
    /// next return to user mode.
    pub(super) lifted_until_return: bool,
    /// The kernel changed watched bytes for this thread (the watch's
    /// address): the change is told at its return to user mode.
    pub(super) kernel_wrote: Option<(u32, u64)>,
    /// A store to a watched page the VMM could not perform (a vector
    /// store): the page is writable for one step of the thread.
    pub(super) watch_step: bool,
    /// Code no breakpoint may go into: what an asynchronous point's
    /// trampoline patches, while its search lasts (address space, start,
    /// end).
    pub(super) avoid: Option<(u64, u64, u64)>,
    /// The deterministic exits and asynchronous points replayed.
    pub(super) ordinal: u64,
    pub(super) arming: Arming,
}

impl Control {
    pub(crate) fn new(scope: Scope, kernel: KernelPoints) -> Self {
        Control {
            scope,
            stack_top_var: kernel.stack_top_var,
            guest_steps: kernel.guest_steps,
            traps: KernelTraps::new(kernel.iret, kernel.sysret),
            tasks: Tasks::default(),
            breakpoints: Breakpoints::default(),
            watches: Watches::default(),
            stepping: None,
            lifted: None,
            lifted_until_return: false,
            kernel_wrote: None,
            watch_step: false,
            avoid: None,
            ordinal: 0,
            arming: Arming::OWN,
        }
    }

    /// The deterministic exits and asynchronous points replayed.
    pub(crate) fn ordinal(&self) -> u64 {
        self.ordinal
    }

    /// The tasks as of the last look.
    pub(crate) fn tasks(&self) -> &Tasks {
        &self.tasks
    }

    /// The pid of the task on the CPU, as of the last look.
    pub(crate) fn current_pid(&self) -> Option<u32> {
        self.tasks.current.map(|(pid, _)| pid)
    }

    /// The task on the CPU, if it is a thread of the process held.
    pub(crate) fn current_thread(&self) -> Option<u32> {
        self.tasks.current_thread()
    }

    /// The process held, once started.
    pub(crate) fn process(&self) -> Option<&ProcessInfo> {
        self.tasks.process.as_ref()
    }

    /// The process's threads that have not exited, first seen first.
    pub(crate) fn threads(&self) -> Vec<u32> {
        self.tasks.live_threads()
    }

    /// The guest kernel announced its context-switch ring at `gpa` (or a
    /// boot snapshot was restored with it): switches are read from its
    /// head on.
    pub(crate) fn ring_announced(&mut self, mem: &GuestMemoryMmap, gpa: u64) {
        self.tasks.ring_announced(mem, gpa);
    }

    /// Before a run the supervisor resumes: nothing under way any more,
    /// the kernel breakpoints as the run needs them, the breakpoints and
    /// watchpoints in the guest as `arming` says, the one at the position
    /// to reach at `position` (the process's virtual address).
    pub(crate) fn prepare(
        &mut self,
        m: &mut Machine,
        arming: Arming,
        position: Option<u64>,
    ) -> Result<(), VmError> {
        self.stepping = None;
        self.arming = arming;
        self.traps.arm(m)?;
        self.breakpoints.set_internal(position);
        self.lifted = None;
        self.lifted_until_return = false;
        self.sync_breakpoints(m);
        self.sync_watches(m, true)
    }

    /// After every deterministic exit and every asynchronous point
    /// reached: the ordinal moves on, and where the tasks are is looked
    /// at (a program executed, a process forked). `settle` follows, once
    /// the supervisor has looked too.
    pub(crate) fn advanced(
        &mut self,
        m: &mut Machine,
        advance: Advance,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        self.ordinal += 1;
        self.tasks.follow_switches(&m.vm.mem);
        let sregs = m.vcpu.sregs()?;
        let cr3 = sregs.cr3 & CR3_ROOT;
        let user = sregs.cs.selector & 3 == 3;
        if self.tasks.process.as_ref().is_some_and(|p| p.cr3 == cr3) {
            self.tasks.note_current(
                &m.vm.mem,
                sregs.cr3,
                self.stack_top_var,
                (sregs.fs.base, sregs.gs.base),
            );
        }
        if !user && advance == (Advance::Exit { kernel_entry: true }) {
            self.look_for_exec(m, sregs.cr3, sup)?;
            self.look_for_fork(m, sregs.cr3);
        }
        Ok(())
    }

    /// Which breakpoints and watchpoints are in the guest from the next
    /// look (`settle`, `prepare` or `restored` put them there).
    pub(crate) fn set_arming(&mut self, arming: Arming) {
        self.arming = arming;
    }

    /// At a new ordinal, once the supervisor looked (`arming`: what it
    /// wants in the guest now): the breakpoints and watchpoints go in or
    /// out as it says, and the returns to user mode are watched while
    /// something waits for one.
    pub(crate) fn settle(&mut self, m: &mut Machine, arming: Arming) -> Result<(), VmError> {
        self.arming = arming;
        if self.breakpoints.armed() != (arming.own, arming.position) {
            self.sync_breakpoints(m);
        }
        if arming.own != self.watches.armed {
            self.sync_watches(m, true)?;
        }
        self.update_returns(m)
    }

    /// Whether a return to user mode must be caught: a program starting,
    /// a fork's child, a step that ends there, a breakpoint or watch
    /// waiting for its page, a position to reach in user code.
    fn returns_needed(&self) -> bool {
        !self.tasks.execs.is_empty()
            || !self.tasks.forks.is_empty()
            || (self.scope == Scope::Every && self.breakpoints.pending())
            || matches!(
                self.stepping,
                Some(Stepping::AtReturn(_) | Stepping::ReturnThenTrap(_))
            )
            || (self.tasks.process.is_some()
                && (self.breakpoints.pending() || self.watches.missing))
            || self.kernel_wrote.is_some()
            || self.lifted_until_return
            || self.arming.position
    }

    /// The returns to user mode caught while something waits for one.
    pub(crate) fn update_returns(&mut self, m: &mut Machine) -> Result<(), VmError> {
        let needed = self.returns_needed();
        self.traps.set_returns(m, needed)
    }

    /// A breakpoint at `va` of the process held (from the next run).
    pub(crate) fn add_breakpoint(&mut self, va: u64) {
        self.breakpoints.add(va);
    }

    pub(crate) fn remove_breakpoint(&mut self, va: u64) {
        self.breakpoints.remove(va);
    }

    /// Takes every breakpoint of the process held away (they leave memory
    /// at the next run); `put_breakpoints` gives them back.
    pub(crate) fn take_breakpoints(&mut self) -> std::collections::BTreeSet<u64> {
        self.breakpoints.take()
    }

    pub(crate) fn put_breakpoints(&mut self, wanted: std::collections::BTreeSet<u64>) {
        self.breakpoints.put(wanted);
    }

    /// A breakpoint at `va` of a followed process's address space `cr3`
    /// (from the next run; `breakpoints_changed` after a change).
    pub(crate) fn add_breakpoint_in(&mut self, cr3: u64, va: u64) {
        self.breakpoints.add_in(cr3, va);
    }

    pub(crate) fn remove_breakpoint_in(&mut self, cr3: u64, va: u64) {
        self.breakpoints.remove_in(cr3, va);
    }

    /// Breakpoints were added or removed: they go in (or out) where the
    /// process maps their pages, and the returns to user mode are watched
    /// while some wait for theirs.
    pub(crate) fn breakpoints_changed(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.sync_breakpoints(m);
        self.update_returns(m)
    }

    /// The original bytes of the breakpoints in guest memory, as (guest
    /// physical address, bytes): what a digest of memory must see
    /// instead.
    pub(crate) fn originals(&self) -> Vec<(u64, Vec<u8>)> {
        self.breakpoints.originals()
    }

    /// Takes every breakpoint out of guest memory (guest memory exactly
    /// as the guest wrote it).
    pub(crate) fn lift_breakpoints(&mut self, mem: &GuestMemoryMmap) {
        self.breakpoints.lift_all(mem);
    }

    /// Puts the breakpoints the processes map in place, as armed.
    pub(crate) fn sync_breakpoints(&mut self, m: &Machine) {
        self.breakpoints
            .set_armed(self.arming.own, self.arming.position);
        let cr3 = self.tasks.process.as_ref().map(|p| p.cr3);
        self.breakpoints.sync(&m.vm.mem, cr3, self.avoid);
        // The one a thread is stepped over stays out until it is.
        if let Some(Lifted { gpa, .. }) = self.lifted {
            self.breakpoints.lift(&m.vm.mem, gpa);
        }
    }

    /// A trampoline's patch covers `patched` now (`None`: no more): the
    /// breakpoints stay out of it, and go back in where it was.
    pub(crate) fn patched(&mut self, m: &Machine, patched: Option<(u64, u64, u64)>) {
        self.avoid = patched;
        self.sync_breakpoints(m);
    }

    /// Watches writes to `len` bytes at `addr` of the process held (from
    /// the next run).
    pub(crate) fn add_watch(&mut self, addr: u64, len: u64) {
        self.watches.add(addr, len);
    }

    pub(crate) fn remove_watch(&mut self, addr: u64, len: u64) -> bool {
        self.watches.remove(addr, len)
    }

    /// Whether a write to guest physical `gpa` is the engine's to perform
    /// (a watched page).
    pub(crate) fn claims(&self, gpa: u64) -> bool {
        self.watches.claims(gpa)
    }

    /// The guest wrote `data` at `gpa`, in a watched page: the write is
    /// performed, and the watches looked at.
    pub(crate) fn watched_write(
        &mut self,
        m: &mut Machine,
        gpa: u64,
        data: &[u8],
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        Watches::write(m, gpa, data)?;
        self.look_at_watches(m, sup)
    }

    /// The VMM wrote into a watched page for the guest kernel (a copy it
    /// asked for): the watches are looked at, as after the kernel's own
    /// write.
    pub(crate) fn written_for_guest(
        &mut self,
        m: &mut Machine,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        self.look_at_watches(m, sup)
    }

    /// After a write to a watched page: a change of the watched bytes by
    /// the process's thread is told (by its user code: here; by the
    /// kernel: at its return to user mode). Other processes' writes to a
    /// shared page only update the values.
    pub(super) fn look_at_watches(
        &mut self,
        m: &mut Machine,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        let Some(cr3) = self.tasks.process.as_ref().map(|p| p.cr3) else {
            return Ok(());
        };
        let Some(&addr) = self.watches.changed(m, cr3).first() else {
            return Ok(());
        };
        self.tasks.follow_switches(&m.vm.mem);
        let sregs = m.vcpu.sregs()?;
        let Some(lwpid) = self
            .tasks
            .current_thread()
            .filter(|_| sregs.cr3 & CR3_ROOT == cr3)
        else {
            return Ok(());
        };
        if sregs.cs.selector & 3 == 3 {
            self.watch_changed(m, addr, sup)
        } else {
            self.kernel_wrote = Some((lwpid, addr));
            self.update_returns(m)
        }
    }

    /// The watched bytes at `addr` changed, the thread in user mode right
    /// after the write: a stop ends the step under way.
    pub(super) fn watch_changed(
        &mut self,
        m: &mut Machine,
        addr: u64,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        if sup.watch_changed(self, m, addr)? == Verdict::Stop {
            self.end_step(m)?;
        }
        Ok(())
    }

    /// The vCPU stopped at an instruction KVM could not emulate: if it is
    /// a user store to a watched page (a vector store), the page becomes
    /// writable for one step of the thread, after which the watches are
    /// looked at. Whether the engine took it.
    pub(crate) fn unemulated(&mut self, m: &mut Machine) -> Result<bool, VmError> {
        if self.watches.is_empty() || m.vcpu.sregs()?.cs.selector & 3 != 3 {
            return Ok(false);
        }
        self.watches.unprotect(m)?;
        let mut regs = m.vcpu.regs()?;
        regs.rflags |= TF;
        m.vcpu.set_regs(&regs)?;
        self.watch_step = true;
        Ok(true)
    }

    /// Protects the watched pages of the process as mapped now, and takes
    /// the watched values (`all`: every one, else those not known yet).
    pub(super) fn sync_watches(&mut self, m: &Machine, all: bool) -> Result<(), VmError> {
        self.watches.armed = self.arming.own;
        let cr3 = self
            .tasks
            .process
            .as_ref()
            .map(|p| p.cr3)
            .filter(|_| self.watches.armed);
        self.watches.sync(m, cr3, all)
    }

    /// The machine was put back to a moment after exit `ordinal`, when
    /// the tasks were `tasks` (breakpoints out): nothing under way, the
    /// breakpoints and watchpoints back in as `arming` says.
    pub(crate) fn restored(
        &mut self,
        m: &mut Machine,
        tasks: &Tasks,
        ordinal: u64,
        arming: Arming,
    ) -> Result<(), VmError> {
        self.tasks = tasks.clone();
        self.ordinal = ordinal;
        self.arming = arming;
        self.avoid = None;
        self.stepping = None;
        self.lifted = None;
        self.lifted_until_return = false;
        self.kernel_wrote = None;
        self.watch_step = false;
        self.sync_watches(m, true)?;
        self.sync_breakpoints(m);
        self.update_returns(m)
    }

    /// Reads the held process's memory at `va` into `buf` as the program
    /// would see it (never a breakpoint's byte); how many bytes could be
    /// read. `replaced`: the bytes an asynchronous point's trampoline
    /// replaced.
    pub(crate) fn read_user(
        &self,
        m: &Machine,
        replaced: &[(u64, Vec<u8>)],
        va: u64,
        buf: &mut [u8],
    ) -> usize {
        let Some(cr3) = self.tasks.process.as_ref().map(|p| p.cr3) else {
            return 0;
        };
        let n = peek_user(&m.vm.mem, cr3, va, buf);
        self.breakpoints.hide(&m.vm.mem, cr3, va, &mut buf[..n]);
        if self.avoid.is_some_and(|a| a.0 == cr3) {
            breakpoints::hide_saved(&m.vm.mem, cr3, va, &mut buf[..n], replaced);
        }
        n
    }

    /// Reads the memory of the address space `cr3` (a followed process)
    /// at `va` into `buf` as its program would see it; how many bytes
    /// could be read.
    pub(crate) fn read_in(&self, m: &Machine, cr3: u64, va: u64, buf: &mut [u8]) -> usize {
        let n = peek_user(&m.vm.mem, cr3, va, buf);
        self.breakpoints.hide(&m.vm.mem, cr3, va, &mut buf[..n]);
        n
    }

    /// The user registers of thread `lwpid` of the process held as the
    /// program sees them: the vCPU's if it runs user code now, else those
    /// its kernel entry saved; with its FS and GS bases. In a trampoline
    /// searching for an asynchronous point, RIP is the program's own
    /// address of the instruction (`PointSearch::program_rip`).
    pub(crate) fn thread_regs(
        &self,
        m: &Machine,
        search: &PointSearch,
        lwpid: u32,
    ) -> Option<ThreadRegs> {
        let info = self.tasks.threads.get(&lwpid)?;
        let sregs = m.vcpu.sregs().ok()?;
        let on_cpu = self.tasks.current_thread() == Some(lwpid);
        let cr3 = self.tasks.process.as_ref().map_or(sregs.cr3, |p| p.cr3);
        if on_cpu && sregs.cs.selector & 3 == 3 {
            let mut regs = m.vcpu.regs().ok()?;
            regs.rflags &= !(TF | RF);
            regs.rip = search.program_rip(cr3, regs.rip);
            return Some(ThreadRegs {
                regs,
                orig_rax: u64::MAX,
                fs_base: sregs.fs.base,
                gs_base: sregs.gs.base,
                running: true,
            });
        }
        let mut saved = (self.tasks).saved_regs(&m.vm.mem, sregs.cr3 & CR3_ROOT, lwpid)?;
        saved.regs.rip = search.program_rip(cr3, saved.regs.rip);
        Some(ThreadRegs {
            regs: saved.regs,
            orig_rax: saved.orig_rax,
            fs_base: info.fs_base,
            gs_base: info.gs_base,
            running: false,
        })
    }
}
