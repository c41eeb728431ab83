//! The vCPU: KVM's vCPU object and what the VMM must remember of its run
//! between two `KVM_RUN`s.

use journal::preempt::state;
use kvm_bindings::{kvm_regs, kvm_sregs};
use kvm_ioctls::{VcpuExit, VcpuFd};

use super::{kvm_err, VmError};
use crate::kvm_ext;

/// The (only) vCPU and the state of its run.
pub struct Vcpu {
    pub(crate) fd: VcpuFd,
    /// An exception was injected since the last KVM_RUN: KVM would drop an
    /// interrupt injected alongside it, so interrupts wait for the window.
    pub(crate) exception_pending: bool,
    /// An interrupt or exception was injected for the next KVM_RUN: the
    /// vCPU starts it in the guest kernel.
    pub(crate) injected: bool,
    /// Where the guest resumes after the last VM exit, until the next
    /// KVM_RUN returns: a kick that finds it still there came during the
    /// hypervisor's round trip, not while the guest ran.
    pub(crate) resume_rip: Option<u64>,
    /// The general registers there (`state::gprs` order): not kept in
    /// checkpoints, so unknown after a restore.
    pub(crate) resume_gprs: Option<[u64; 16]>,
    /// The last KVM_RUN ended in a deterministic exit, or the vCPU is at an
    /// asynchronous point: under the exit clock the only moments an
    /// interrupt may be injected or input made visible.
    pub(crate) at_delivery_point: bool,
    /// The last KVM_RUN ended in a deterministic exit, checked: a
    /// checkpoint may be taken before anything else happens.
    pub(crate) after_exit: bool,
    /// The host CPU the vCPU thread is kept on (`crate::host_cpu`).
    pub(crate) host_cpu: Option<usize>,
    /// Which register sets `kvm_run` holds as they are now.
    in_run: RunCopies,
    /// KVM stores the system registers in `kvm_run` at every exit.
    sregs_at_exits: bool,
    /// The debug control last set without single-stepping (control word
    /// and debug registers): setting it again changes nothing.
    guest_debug: Option<(u32, [u64; 8])>,
}

/// Whether `kvm_run`'s copies of the general and the system registers are
/// the vCPU's: after an exit (that KVM filled), or set there for the next
/// KVM_RUN to load.
#[derive(Clone, Copy, Default)]
struct RunCopies {
    regs: bool,
    sregs: bool,
}

impl Vcpu {
    pub(crate) fn new(fd: VcpuFd) -> Self {
        Vcpu {
            fd,
            exception_pending: false,
            injected: false,
            resume_rip: None,
            resume_gprs: None,
            at_delivery_point: false,
            after_exit: false,
            host_cpu: None,
            in_run: RunCopies::default(),
            sregs_at_exits: false,
            guest_debug: None,
        }
    }

    /// Runs the guest until its next exit.
    pub(crate) fn run(&mut self) -> Result<VcpuExit<'_>, kvm_ioctls::Error> {
        self.mark_run();
        self.fd.run()
    }

    /// A KVM_RUN is about to load what waits in `kvm_run` and leave the
    /// registers there when it returns.
    fn mark_run(&mut self) {
        if self.sregs_at_exits {
            // KVM sets the bit of an interrupt still being delivered in the
            // system registers it stores at an exit, but does not clear the
            // others: a bit left there by an earlier exit (measured: the
            // timer's, at nearly every exit after the first) would be an
            // interrupt that no longer waits, and a KVM_SET_SREGS of them
            // raises it again, unlogged. Cleared here, the exit's copy
            // holds just what KVM sets. A copy set for this KVM_RUN to load
            // is left as it was.
            let run = self.fd.get_kvm_run();
            if run.kvm_dirty_regs & u64::from(kvm_bindings::KVM_SYNC_X86_SREGS) == 0 {
                self.fd.sync_regs_mut().sregs.interrupt_bitmap = [0; 4];
            }
        }
        self.in_run = RunCopies {
            regs: true,
            sregs: self.sregs_at_exits,
        };
    }

    /// The guest resumes at `regs` after the exit being handled.
    pub(crate) fn resume_at(&mut self, regs: &kvm_regs) {
        self.resume_rip = Some(regs.rip);
        self.resume_gprs = Some(state::gprs(regs));
    }

    /// The vCPU's registers (as `kvm_run` carries them with every exit).
    pub(crate) fn synced_regs(&self) -> kvm_regs {
        match self.regs() {
            Ok(regs) => regs,
            Err(_) => self.fd.sync_regs().regs,
        }
    }

    /// The vCPU's registers: `kvm_run`'s copy while it holds them (right
    /// after an exit, or set there), else KVM's.
    pub(crate) fn regs(&self) -> Result<kvm_regs, VmError> {
        if self.in_run.regs {
            return Ok(self.fd.sync_regs().regs);
        }
        self.fd.get_regs().map_err(kvm_err("GET_REGS"))
    }

    pub(crate) fn set_regs(&mut self, regs: &kvm_regs) -> Result<(), VmError> {
        if self.in_run.regs {
            self.fd.sync_regs_mut().regs = *regs;
            self.fd.set_sync_dirty_reg(kvm_ioctls::SyncReg::Register);
            return Ok(());
        }
        self.fd.set_regs(regs).map_err(kvm_err("SET_REGS"))
    }

    pub(crate) fn sregs(&self) -> Result<kvm_sregs, VmError> {
        if self.in_run.sregs {
            return Ok(self.fd.sync_regs().sregs);
        }
        self.fd.get_sregs().map_err(kvm_err("GET_SREGS"))
    }

    /// Sets the system registers in KVM at once (an exception injected
    /// next is delivered with them); `kvm_run`'s copy, while it holds
    /// them, says the same.
    pub(crate) fn set_sregs(&mut self, sregs: &kvm_sregs) -> Result<(), VmError> {
        self.fd.set_sregs(sregs).map_err(kvm_err("SET_SREGS"))?;
        if self.in_run.sregs {
            self.fd.sync_regs_mut().sregs = *sregs;
        }
        Ok(())
    }

    /// Sets KVM's debug control (breakpoints, single-stepping). The same
    /// breakpoints again without single-stepping are not set again (the
    /// debugger and the tracer set them at every stop); a single step is
    /// always set, as KVM takes it from where the vCPU stands.
    pub(crate) fn set_guest_debug(
        &mut self,
        debug: &kvm_bindings::kvm_guest_debug,
    ) -> Result<(), VmError> {
        let key = (debug.control, debug.arch.debugreg);
        let stepping = debug.control & kvm_bindings::KVM_GUESTDBG_SINGLESTEP != 0;
        if !stepping && self.guest_debug == Some(key) {
            return Ok(());
        }
        self.fd
            .set_guest_debug(debug)
            .map_err(kvm_err("SET_GUEST_DEBUG"))?;
        self.guest_debug = (!stepping).then_some(key);
        Ok(())
    }

    /// Has KVM carry the system registers in `kvm_run` too, from the next
    /// exit on (tools that read and write them at every stop).
    pub(crate) fn sync_sregs_at_exits(&mut self) {
        self.fd
            .set_sync_valid_reg(kvm_ioctls::SyncReg::SystemRegister);
        self.sregs_at_exits = true;
    }

    /// Forgets `kvm_run`'s copies (KVM's registers are set otherwise):
    /// nothing waiting there is loaded, and they are read from KVM.
    pub(crate) fn forget_run_copies(&mut self) {
        self.fd.get_kvm_run().kvm_dirty_regs = 0;
        self.in_run = RunCopies::default();
    }

    /// Sets both register sets through `kvm_run`, for the next KVM_RUN to
    /// load (no ioctl); until then [`Vcpu::regs`] and [`Vcpu::sregs`] read
    /// them there, KVM's own copy being stale.
    pub(crate) fn set_registers_in_run(&mut self, regs: kvm_regs, sregs: kvm_sregs) {
        let synced = self.fd.sync_regs_mut();
        (synced.regs, synced.sregs) = (regs, sregs);
        self.fd.set_sync_dirty_reg(kvm_ioctls::SyncReg::Register);
        self.fd
            .set_sync_dirty_reg(kvm_ioctls::SyncReg::SystemRegister);
        self.in_run = RunCopies {
            regs: true,
            sregs: true,
        };
    }

    /// RIP for an error report (0 if even that cannot be read).
    pub(crate) fn rip_or_zero(&self) -> u64 {
        self.regs().map(|r| r.rip).unwrap_or(0)
    }

    /// Keeps the vCPU thread on host CPU `cpu` (`crate::host_cpu`).
    pub fn run_on_host_cpu(&mut self, cpu: usize) {
        self.host_cpu = Some(cpu);
    }

    /// Whether the vCPU can take an interrupt now, as the last exit left
    /// it (before any exception the VMM injected since).
    pub(crate) fn interruptible(&mut self) -> bool {
        let run = self.fd.get_kvm_run();
        !self.exception_pending && run.ready_for_interrupt_injection != 0 && run.if_flag != 0
    }

    /// Asks KVM to exit as soon as the guest can take an interrupt.
    pub(crate) fn request_interrupt_window(&mut self, request: bool) {
        self.fd.get_kvm_run().request_interrupt_window = u8::from(request);
    }

    /// Whether the guest halted with interrupts enabled.
    pub(crate) fn halted_interruptible(&mut self) -> bool {
        self.fd.get_kvm_run().if_flag != 0
    }

    /// Injects external interrupt `vector`.
    pub(crate) fn inject(&mut self, vector: u8) -> Result<(), VmError> {
        kvm_ext::inject_interrupt(&self.fd, vector).map_err(|e| VmError::Kvm {
            op: "INTERRUPT",
            source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)),
        })?;
        self.injected = true;
        Ok(())
    }

    /// Raises exception `vector` in the guest at the current RIP.
    pub(crate) fn inject_exception(
        &mut self,
        vector: u8,
        error_code: Option<u32>,
    ) -> Result<(), VmError> {
        let mut events = self
            .fd
            .get_vcpu_events()
            .map_err(kvm_err("GET_VCPU_EVENTS"))?;
        events.exception.injected = 1;
        events.exception.nr = vector;
        events.exception.has_error_code = u8::from(error_code.is_some());
        events.exception.error_code = error_code.unwrap_or(0);
        self.exception_pending = true;
        self.injected = true;
        self.fd
            .set_vcpu_events(&events)
            .map_err(kvm_err("SET_VCPU_EVENTS"))
    }

    /// Raises a page fault for a supervisor access to `addr`.
    pub(crate) fn inject_page_fault(
        &mut self,
        addr: u64,
        present: bool,
        write: bool,
    ) -> Result<(), VmError> {
        let mut sregs = self.sregs()?;
        sregs.cr2 = addr;
        self.set_sregs(&sregs)?;
        self.inject_exception(14, Some(u32::from(present) | (u32::from(write) << 1)))
    }

    /// Completes the instruction of the last exit now, without entering
    /// the guest (a KVM_RUN with `immediate_exit`): its registers are then
    /// the ones to read or change. False if the vCPU ran on instead.
    pub(crate) fn complete_exit_now(&mut self, what: &'static str) -> Result<bool, VmError> {
        self.fd.set_kvm_immediate_exit(1);
        self.mark_run();
        let completed = self.fd.run().map(|_| ());
        self.fd.set_kvm_immediate_exit(0);
        match completed {
            Err(e) if e.errno() == libc::EINTR => Ok(true),
            Err(e) => Err(kvm_err(what)(e)),
            Ok(()) => Ok(false),
        }
    }

    /// Lets KVM finish the instruction of the last exit (store what a read
    /// returned, move RIP past it) without entering the guest. KVM keeps
    /// that completion to itself until the next KVM_RUN, and a new VM
    /// would not have it: state taken before would restore to the
    /// instruction's start, and the guest would execute it again.
    pub(crate) fn complete_exit(&mut self) -> Result<(), VmError> {
        if self.complete_exit_now("RUN (immediate exit)")? {
            Ok(())
        } else {
            // An exit with immediate_exit set would be a KVM without the
            // completion-first order this relies on.
            Err(VmError::Restore(
                "KVM ran the guest although asked to exit at once".into(),
            ))
        }
    }
}

/// How the KVM_RUN that a kick or window interrupted started.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Resumed {
    /// The RIP of the VM exit right before it, if it followed one.
    pub rip: Option<u64>,
    /// The general registers at that exit (`state::gprs` order), where
    /// known (not right after a checkpoint's restore): a task found at
    /// that RIP with other registers ran on and came back to it, as in a
    /// loop.
    pub gprs: Option<[u64; 16]>,
    /// The vCPU started in the guest kernel: it had stopped there, or an
    /// interrupt or exception had just been injected.
    pub in_kernel: bool,
}

/// What a store to the exit page was, for the mode that may own it.
pub(crate) enum Claimed {
    /// Not the mode's: an ordinary (deterministic) MMIO exit.
    NotOurs,
    /// The mode's, and the guest goes on.
    Passed,
    /// The mode's, and the vCPU now stands at a delivery point (an
    /// asynchronous point).
    Reached,
}
