//! The debug exits the kernel breakpoints cause: a user `int3` at the
//! #BP handler, a user single step at the #DB handler, a return to user
//! mode at the kernel's `iretq` or `sysretq`. The VMM completes each
//! itself (the guest kernel never runs for them) and tells the
//! supervisor what it found.

use super::engine::{BreakpointHit, Control, Scope, Stepping, Supervisor, Verdict};
use super::tasks::UserPoint;
use super::traps::KernelStop;
use crate::points::PointSearch;
use crate::tools::frames::{self, return_by_iret, ExceptionFrame};
use crate::vm::{Machine, VmError};
use introspect::instructions::TF;
use journal::preempt::state::CR3_ROOT;

impl Control {
    /// A debug exit: one of the kernel breakpoints, or the end of a step
    /// over one. `search`: the search for an asynchronous point under
    /// way, whose trampoline a step may pass through.
    pub(crate) fn debug_exit(
        &mut self,
        m: &mut Machine,
        search: &PointSearch,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        match self.traps.which(m)? {
            None => Ok(()),
            Some(KernelStop::Int3) => self.on_int3(m, sup),
            Some(KernelStop::TrapFlag) => self.on_trap_flag(m, search, sup),
            Some(KernelStop::Iret) => self.on_return(m, false, sup),
            Some(KernelStop::Sysret) => self.on_return(m, true, sup),
        }
    }

    /// The guest's #BP handler is about to run for a user `int3`.
    fn on_int3(&mut self, m: &mut Machine, sup: &mut dyn Supervisor) -> Result<(), VmError> {
        let (regs, sregs) = (m.vcpu.regs()?, m.vcpu.sregs()?);
        let frame = ExceptionFrame::read(&m.vm.mem, sregs.cr3, regs.rsp).map_err(VmError::Debug)?;
        let cr3 = sregs.cr3 & CR3_ROOT;
        let addr = frame.rip.wrapping_sub(1);
        // Ours if it is in the page where one of ours is: another process
        // sharing the page (a library's code) may map it elsewhere.
        let ours = introspect::gva::translate_user(&m.vm.mem, cr3, addr)
            .ok()
            .filter(|_| frame.came_from_user())
            .and_then(|gpa| self.breakpoints.at(gpa).map(|va| (gpa, va)));
        let Some((gpa, va)) = ours else {
            // The program's own int3 (a probe's, say): the guest's.
            return self.traps.pass(m);
        };
        self.tasks.follow_switches(&m.vm.mem);
        let mut user = frame.user_regs(&regs);
        user.rip = addr;
        let in_process = self.tasks.process.as_ref().is_some_and(|p| p.cr3 == cr3);
        let hit = BreakpointHit {
            task: self.tasks.current,
            thread: (self.tasks.current_thread()).filter(|_| in_process && va == addr),
            cr3,
            // A followed process's, or a child's one forked (the same
            // code at the same address).
            space: (self.breakpoints).space_of_hit(&m.vm.mem, cr3, addr, gpa),
            wanted: self.breakpoints.is_wanted(addr),
            regs: user,
            mem: &m.vm.mem,
        };
        let stop = sup.breakpoint(self, &hit) == Verdict::Stop;
        if !stop && self.lift_for_one(m, cr3, (addr, frame.rflags), gpa) {
            // Not a stop: the instruction under it runs once, alone (the
            // frame's flags are the thread's: a thread the guest kernel
            // single-steps has the trap flag already).
            user.rflags |= TF;
        }
        return_by_iret(m, &frame, user)
    }

    /// The guest's #DB handler is about to run for a user single step.
    fn on_trap_flag(
        &mut self,
        m: &mut Machine,
        search: &PointSearch,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        let (regs, sregs) = (m.vcpu.regs()?, m.vcpu.sregs()?);
        let frame = ExceptionFrame::read(&m.vm.mem, sregs.cr3, regs.rsp).map_err(VmError::Debug)?;
        if !frame.came_from_user() || frame.rflags & TF == 0 {
            return self.traps.pass(m);
        }
        self.tasks.follow_switches(&m.vm.mem);
        let cr3 = sregs.cr3 & CR3_ROOT;
        let lifted = self.lifted.take();
        if lifted.is_some() {
            self.sync_breakpoints(m);
        }
        let mut user = frame.user_regs(&regs);
        let lwpid = self.tasks.current_thread();
        let step = match self.stepping {
            Some(Stepping::Trap { from, ordinal }) if Some(from.lwpid) == lwpid => {
                Some((from, ordinal))
            }
            _ => None,
        };
        let stepping = step.is_some();
        // Where the guest kernel single-steps threads (`record --chaos`),
        // a trap the engine did not ask for is the guest's, which counts
        // its steps as the recording did; so is the trap that ends a step
        // over a breakpoint in such a thread, once the breakpoint is back.
        if self.guest_steps
            && !stepping
            && !self.watch_step
            && lifted.is_none_or(|l| l.in_guest_step)
        {
            return self.traps.pass(m);
        }
        // Inside a trampoline that searches for an asynchronous point, the
        // step goes on until the program's next instruction (one the
        // trampoline moved, or the code it returns to).
        let stubs = m.stub_mappings();
        let in_stub = introspect::probe_gate::in_stub_pages(user.rip, &stubs);
        let moved = in_stub
            .then(|| search.moved_instruction(cr3, user.rip))
            .flatten();
        // The copy of the patched instruction itself is where the step
        // over the trampoline's jump arrives: the program has not moved
        // on yet (the jump is not its instruction), so the step goes on.
        let jumped = moved
            .as_ref()
            .is_some_and(|(orig, _)| search.patch_at(cr3) == Some(*orig));
        if stepping && in_stub && (moved.is_none() || jumped) {
            return return_by_iret(m, &frame, user);
        }
        // A step that started where an asynchronous point was recorded ran
        // the trampoline, which found the point: its store left the trap
        // pending at the position, the instruction not run yet (the
        // interrupt the point delivers comes first). The step goes on.
        if let Some((from, _)) = step.filter(|&(from, ordinal)| {
            !in_stub && ordinal != self.ordinal && from == UserPoint::registers(from.lwpid, &user)
        }) {
            self.stepping = Some(Stepping::Trap {
                from,
                ordinal: self.ordinal,
            });
            return return_by_iret(m, &frame, user);
        }
        user.rflags &= !TF;
        return_by_iret(m, &frame, user)?;
        if std::mem::take(&mut self.watch_step) {
            self.sync_watches(m, false)?;
            self.look_at_watches(m, sup)?;
        }
        // Unless a stop at a watched write ended it, the step is over.
        if stepping && self.stepping.take().is_some() {
            sup.stepped(self, m, moved.map(|(orig, _)| orig))?;
        }
        Ok(())
    }

    /// The guest kernel is about to return (`iretq`, or with `sysret`):
    /// to user mode, the VMM completes the return itself and looks at
    /// what waited for it.
    fn on_return(
        &mut self,
        m: &mut Machine,
        sysret: bool,
        sup: &mut dyn Supervisor,
    ) -> Result<(), VmError> {
        // The return completes here, as the CPU would: single-stepping it
        // would not stop before the user instruction on these hosts, and
        // the step would go on in user mode.
        let user = if sysret {
            frames::return_by_sysret(m)?
        } else {
            frames::return_by_swapgs_iret(m)?
        };
        let sregs = m.vcpu.sregs()?;
        self.tasks.follow_switches(&m.vm.mem);
        let cr3 = sregs.cr3 & CR3_ROOT;
        if std::mem::take(&mut self.lifted_until_return) {
            // The system call under a breakpoint ran: it goes back.
            self.lifted = None;
            self.sync_breakpoints(m);
            self.update_returns(m)?;
        }
        let Some((pid, lwpid)) = self.tasks.current else {
            return Ok(());
        };
        let starting = self.tasks.take_exec(pid, lwpid);
        let in_process = self.tasks.process.as_ref().is_some_and(|p| p.cr3 == cr3);
        let every = self.scope == Scope::Every;
        if starting.is_none() && !in_process && !every {
            return Ok(());
        }
        if every {
            self.fork_returns(pid, lwpid, cr3, &user, sup);
        }
        if let Some(exec) = starting {
            self.exec_returned(m, &sregs, &user, exec, sup)?;
        }
        self.sync_breakpoints(m);
        if self.watches.missing {
            self.sync_watches(m, false)?;
        }
        if let Some((_, addr)) = self.kernel_wrote.filter(|&(l, _)| l == lwpid) {
            self.kernel_wrote = None;
            self.watch_changed(m, addr, sup)?;
        }
        sup.returned(self, m, lwpid, &user)?;
        match self.stepping {
            Some(Stepping::AtReturn(l)) if l == lwpid => {
                self.stepping = None;
                sup.entered(self, m)?;
            }
            Some(Stepping::ReturnThenTrap(l)) if l == lwpid => {
                let mut regs = m.vcpu.regs()?;
                self.step_over_breakpoint(m, &mut regs)?;
                self.trap_step(m, l, regs)?;
            }
            _ => {}
        }
        self.update_returns(m)
    }
}
