//! Steps of a thread's user code: one instruction under the trap flag
//! (caught at the guest's #DB handler), or run in guest kernel mode where
//! KVM's emulator steps it without the guest (`tools::kernel_steps`), and
//! the step over a breakpoint a thread stands on.

use kvm_bindings::kvm_regs;

use super::engine::{Control, Lifted, Stepping};
use super::tasks::UserPoint;
use crate::tools::kernel_steps;
use crate::vm::{Machine, VmError};
use introspect::gva::peek_user;
use introspect::instructions::{self, TF};
use journal::preempt::state::CR3_ROOT;

/// The `syscall` instruction.
const SYSCALL: [u8; 2] = [0x0f, 0x05];

impl Control {
    /// Thread `lwpid`, on the CPU in user mode, runs its next instruction
    /// from the next run (over a breakpoint under it; a system call's step
    /// ends at the instruction the kernel returns to, told by
    /// `Supervisor::entered`). Whether the step is done already: it ran
    /// in guest kernel mode, and the thread stands after it.
    pub(crate) fn step(&mut self, m: &mut Machine, lwpid: u32) -> Result<bool, VmError> {
        let mut regs = m.vcpu.regs()?;
        let mut code = [0u8; 2];
        self.read_user(m, &[], regs.rip, &mut code);
        self.step_over_breakpoint(m, &mut regs)?;
        if code == SYSCALL {
            // A system call: the step ends at the instruction the
            // kernel returns to (the trap flag would end it one
            // instruction later).
            self.stepping = Some(Stepping::AtReturn(lwpid));
            return Ok(false);
        }
        if self.lifted.is_none() && self.kernel_step(m, &regs)? {
            return Ok(true);
        }
        self.trap_step(m, lwpid, regs)?;
        Ok(false)
    }

    /// Thread `lwpid`, not in user code now, steps its first user
    /// instruction after the kernel.
    pub(crate) fn step_after_return(&mut self, lwpid: u32) {
        self.stepping = Some(Stepping::ReturnThenTrap(lwpid));
    }

    /// Thread `lwpid`, not in user code now, is told about to run its
    /// first user instruction after the kernel (`Supervisor::entered`).
    pub(crate) fn wait_for_return(&mut self, lwpid: u32) {
        self.stepping = Some(Stepping::AtReturn(lwpid));
    }

    /// The vCPU in user mode runs the instruction under the breakpoint it
    /// stands on, if it stands on one, before the breakpoint goes back.
    pub(crate) fn pass_breakpoint_here(&mut self, m: &mut Machine) -> Result<(), VmError> {
        let mut regs = m.vcpu.regs()?;
        if self.step_over_breakpoint(m, &mut regs)? {
            regs.rflags |= TF;
            m.vcpu.set_regs(&regs)?;
        }
        Ok(())
    }

    /// A stop ends the step under way: the thread's trap flag goes (its
    /// instruction completed).
    pub(super) fn end_step(&mut self, m: &mut Machine) -> Result<(), VmError> {
        if matches!(self.stepping.take(), Some(Stepping::Trap { .. })) {
            let mut regs = m.vcpu.regs()?;
            regs.rflags &= !TF;
            m.vcpu.set_regs(&regs)?;
        }
        Ok(())
    }

    /// Thread `lwpid`, in user mode with `regs`, runs one instruction
    /// under the trap flag.
    pub(super) fn trap_step(
        &mut self,
        m: &mut Machine,
        lwpid: u32,
        mut regs: kvm_regs,
    ) -> Result<(), VmError> {
        self.stepping = Some(Stepping::Trap {
            from: UserPoint::registers(lwpid, &regs),
            ordinal: self.ordinal,
        });
        regs.rflags |= TF;
        m.vcpu.set_regs(&regs)
    }

    /// Runs the instruction the thread stands at in user mode (`regs`) in
    /// guest kernel mode, where KVM steps it without the guest's debug
    /// exception (`kernel_steps`), if it qualifies: whether it ran (the
    /// vCPU is in user mode after it). Not with watchpoints (a store to a
    /// watched page must go through them) nor in the code a search's
    /// trampoline patches.
    fn kernel_step(&mut self, m: &mut Machine, regs: &kvm_regs) -> Result<bool, VmError> {
        let sregs = m.vcpu.sregs()?;
        let cr3 = sregs.cr3;
        let patched = self.avoid.is_some_and(|(space, start, end)| {
            space == cr3 & CR3_ROOT && regs.rip < end && regs.rip + 16 > start
        });
        if !self.watches.is_empty() || patched {
            return Ok(false);
        }
        let mut bytes = [0u8; instructions::MAX_INSN];
        let n = peek_user(&m.vm.mem, cr3, regs.rip, &mut bytes);
        let Some(insn) = instructions::decode(&bytes[..n], regs.rip).filter(|i| i.len() <= n)
        else {
            return Ok(false);
        };
        let mut factory = iced_x86::InstructionInfoFactory::new();
        match kernel_steps::plan(&m.vm.mem, &sregs, &mut factory, &insn, regs) {
            kernel_steps::Plan::Skip => {
                let mut after = *regs;
                after.rip = insn.next_ip();
                m.vcpu.set_regs(&after)?;
                return Ok(true);
            }
            kernel_steps::Plan::InKernelMode => {}
            kernel_steps::Plan::Trap => return Ok(false),
        }
        let (cs, ss) = self.traps.kernel_segments(m, &sregs)?;
        let kernel = kvm_bindings::kvm_sregs { cs, ss, ..sregs };
        self.traps.apply(m, true)?;
        let stubs = m.stub_mappings();
        let stepped = kernel_steps::step(m, regs, &kernel, true, &stubs)?;
        self.traps.apply(m, false)?;
        Ok(match stepped {
            kernel_steps::Stepped::Ran(after) => {
                m.vcpu.set_registers_in_run(after, sregs);
                true
            }
            kernel_steps::Stepped::Raised | kernel_steps::Stepped::NotEmulated => {
                m.vcpu.set_registers_in_run(*regs, sregs);
                false
            }
        })
    }

    /// If the vCPU stands on one of the breakpoints in user mode, takes
    /// it out for the instruction under it (`regs` are the vCPU's):
    /// whether the trap flag must end that (not for a system call, which
    /// the trap flag would end one instruction late: the breakpoint goes
    /// back at the next return to user mode).
    pub(super) fn step_over_breakpoint(
        &mut self,
        m: &mut Machine,
        regs: &mut kvm_regs,
    ) -> Result<bool, VmError> {
        let cr3 = m.vcpu.sregs()?.cr3 & CR3_ROOT;
        let Ok(gpa) = introspect::gva::translate_user(&m.vm.mem, cr3, regs.rip) else {
            return Ok(false);
        };
        // Ours (for whichever process it was put in).
        if self.breakpoints.at(gpa).is_none() {
            return Ok(false);
        }
        Ok(self.lift_for_one(m, cr3, (regs.rip, regs.rflags), gpa))
    }

    /// Takes the breakpoint at `gpa` (at `va` in address space `cr3`, the
    /// thread's flags `rflags`) out for one run of the instruction under
    /// it: whether the trap flag must end that (not for a system call,
    /// whose return puts it back).
    pub(super) fn lift_for_one(
        &mut self,
        m: &Machine,
        cr3: u64,
        (va, rflags): (u64, u64),
        gpa: u64,
    ) -> bool {
        let mut code = [0u8; 2];
        let n = peek_user(&m.vm.mem, cr3, va, &mut code);
        self.breakpoints.hide(&m.vm.mem, cr3, va, &mut code[..n]);
        self.breakpoints.lift(&m.vm.mem, gpa);
        self.lifted = Some(Lifted {
            gpa,
            in_guest_step: rflags & TF != 0,
        });
        self.lifted_until_return = code == SYSCALL;
        !self.lifted_until_return
    }
}
