//! The hardware breakpoints the engine puts on guest kernel code: the
//! first instructions of the guest's #BP and #DB handlers (a user `int3`
//! and a user single step stop there), and, while something waits for
//! one, the kernel's returns to user mode (`iretq`, `sysretq`). A debug
//! exit is one of them, or the end of a step over one.

use kvm_bindings::{kvm_segment, kvm_sregs};

use crate::tools::frames::{
    self, idt_handler, set_kernel_breakpoints, BREAKPOINT_VECTOR, DEBUG_VECTOR,
};
use crate::vm::{Machine, VmError};

/// Which kernel breakpoint a debug exit stopped at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KernelStop {
    /// The #BP handler: a user `int3`.
    Int3,
    /// The #DB handler: a user single step.
    TrapFlag,
    /// The return to user mode by `iretq`.
    Iret,
    /// The return to user mode by `sysretq`.
    Sysret,
}

/// The hardware breakpoints on guest kernel code.
pub(crate) struct KernelTraps {
    /// The #BP and #DB handlers' first instructions (once read from the
    /// IDT).
    handlers: Option<[u64; 2]>,
    /// The `swapgs` before the `iretq` of returns to user mode, and the
    /// `swapgs; sysretq` of fast system-call returns.
    iret: Option<u64>,
    sysret: Option<u64>,
    /// The returns to user mode have breakpoints too.
    returns_armed: bool,
    /// The kernel breakpoint being stepped over (it would fire again at
    /// the same instruction).
    stepping_over_kernel: bool,
    /// The guest kernel's code and stack segments (once read), which a
    /// step made in kernel mode runs with.
    kernel_segments: Option<(kvm_segment, kvm_segment)>,
}

impl KernelTraps {
    pub(crate) fn new(iret: Option<u64>, sysret: Option<u64>) -> Self {
        KernelTraps {
            handlers: None,
            iret,
            sysret,
            returns_armed: false,
            stepping_over_kernel: false,
            kernel_segments: None,
        }
    }

    /// The kernel breakpoints as a run needs them (the handlers read from
    /// the IDT the first time).
    pub(crate) fn arm(&mut self, m: &mut Machine) -> Result<(), VmError> {
        if self.handlers.is_none() {
            let sregs = m.vcpu.sregs()?;
            let idt = |v| idt_handler(&m.vm.mem, sregs.cr3, sregs.idt.base, v);
            self.handlers = Some([idt(BREAKPOINT_VECTOR)?, idt(DEBUG_VECTOR)?]);
        }
        self.apply(m, false)
    }

    fn all(&self) -> Vec<u64> {
        let mut at: Vec<u64> = self.handlers.map(|h| h.to_vec()).unwrap_or_default();
        if self.returns_armed {
            at.extend(self.iret);
            at.extend(self.sysret);
        }
        at
    }

    /// Puts the breakpoints in place (`single_step`: with KVM's single
    /// step, the one the vCPU stands on left out).
    pub(crate) fn apply(&self, m: &mut Machine, single_step: bool) -> Result<(), VmError> {
        let mut at = self.all();
        if single_step {
            // The one the vCPU stands on is left out for the step.
            let rip = m.vcpu.synced_regs().rip;
            at.retain(|&a| a != rip);
        }
        set_kernel_breakpoints(m, &at, single_step)
    }

    /// Whether the returns to user mode have breakpoints: `needed` and
    /// the kernel has them.
    pub(crate) fn set_returns(&mut self, m: &mut Machine, needed: bool) -> Result<(), VmError> {
        let needed = needed && (self.iret.is_some() || self.sysret.is_some());
        if needed != self.returns_armed {
            self.returns_armed = needed;
            self.apply(m, false)?;
        }
        Ok(())
    }

    /// Lets the guest run the kernel instruction a breakpoint stopped at
    /// (it would stop there again): one step without that breakpoint.
    pub(crate) fn pass(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.stepping_over_kernel = true;
        self.apply(m, true)
    }

    /// A debug exit: the breakpoint it stopped at, or `None` for the end
    /// of a step over one (the breakpoints are back).
    pub(crate) fn which(&mut self, m: &mut Machine) -> Result<Option<KernelStop>, VmError> {
        if std::mem::take(&mut self.stepping_over_kernel) {
            self.apply(m, false)?;
            return Ok(None);
        }
        let rip = m.vcpu.synced_regs().rip;
        let trap =
            self.all()
                .iter()
                .position(|&a| a == rip)
                .map(|i| match (i, self.returns_armed) {
                    (0, _) => KernelStop::Int3,
                    (1, _) => KernelStop::TrapFlag,
                    (_, true) if Some(rip) == self.iret => KernelStop::Iret,
                    _ => KernelStop::Sysret,
                });
        match trap {
            Some(trap) => Ok(Some(trap)),
            None => Err(VmError::Debug(format!(
                "a debug exit at {rip:#x} that no breakpoint explains"
            ))),
        }
    }

    /// The guest kernel's code and stack segments, read once.
    pub(crate) fn kernel_segments(
        &mut self,
        m: &Machine,
        sregs: &kvm_sregs,
    ) -> Result<(kvm_segment, kvm_segment), VmError> {
        match self.kernel_segments {
            Some(segments) => Ok(segments),
            None => Ok(*self
                .kernel_segments
                .insert(frames::kernel_segments(m, sregs)?)),
        }
    }
}
