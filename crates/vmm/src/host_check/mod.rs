//! What this host's KVM can do, measured with tiny hand-assembled guests,
//! and the strategy insight chooses from it.
//!
//! Each check boots a 4 MiB guest straight into 64-bit mode with a GDT
//! (kernel and user segments), a TSS, an IDT whose handlers report their
//! vector, and identity page tables open to user mode. Guest code signals
//! progress by writing a marker byte to port 0xf1; the check reads the
//! marker and the privilege level it was written at.

use kvm_bindings::{
    KVM_GUESTDBG_ENABLE, KVM_GUESTDBG_SINGLESTEP, KVM_GUESTDBG_USE_HW_BP, KVM_GUESTDBG_USE_SW_BP,
    KVM_MAX_CPUID_ENTRIES,
};
use trace::ClockKind;
use vm_memory::{Bytes, GuestAddress};

use crate::{kvm_ext, sys};

mod check_vm;
mod kernel_steps;
mod pvm_abi;
mod state_match;

use check_vm::*;
pub use check_vm::{HostCheckError, Privilege};
pub use kernel_steps::{check_kernel_steps, KernelStepReport};
pub use pvm_abi::{check_pvm_guest_abi, PvmGuestAbi, PvmProbe, MSR_PVM_LINEAR_ADDRESS_RANGE};
pub use state_match::{check_state_match, StateMatchReport};

/// Where a user-mode SYSCALL lands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SyscallBehaviour {
    /// At MSR_LSTAR in ring 0, as the architecture says.
    EntersKernel,
    /// At MSR_LSTAR but still in ring 3 (KVM's nested "PVM" mode for
    /// non-PVM guests): the guest kernel needs insight's syscall trap.
    StaysInUserMode,
    /// Something else happened; the text says what.
    Unknown(String),
}

/// How this host's KVM makes the guest kernel behave, measured by tiny
/// check guests.
pub fn guest_quirks() -> Result<guest::image::GuestQuirks, HostCheckError> {
    let syscall_trap = match check_syscall()? {
        SyscallBehaviour::EntersKernel => false,
        SyscallBehaviour::StaysInUserMode => true,
        SyscallBehaviour::Unknown(what) => return Err(HostCheckError::UnknownSyscall(what)),
    };
    Ok(guest::image::GuestQuirks { syscall_trap })
}

/// Executes SYSCALL in user mode and reports where it lands.
pub fn check_syscall() -> Result<SyscallBehaviour, HostCheckError> {
    let kvm = open_kvm()?;
    let mut user = vec![0x0f, 0x05]; // syscall
    user.extend(marker_code(M_AFTER));
    let mut vm = CheckVm::user(&kvm, &user, false)?;
    Ok(match vm.next_event()? {
        CheckVmExit::Marker {
            marker: M_LSTAR,
            cpl: 0,
        } => SyscallBehaviour::EntersKernel,
        CheckVmExit::Marker {
            marker: M_LSTAR,
            cpl: 3,
        } => SyscallBehaviour::StaysInUserMode,
        other => SyscallBehaviour::Unknown(format!("{other:?}")),
    })
}

/// How an `int3` executed by the guest is handled with
/// `KVM_GUESTDBG_USE_SW_BP` set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Int3Behaviour {
    /// KVM exits to the VMM: probes can be invisible to the guest.
    Intercepted,
    /// The guest's own #BP handler runs.
    GuestHandler,
    /// KVM cannot execute it at all (interpreted guest kernel); the VMM
    /// completes it by injecting #BP.
    NotEmulated,
    Unknown(String),
}

pub fn check_sw_breakpoint(mode: Privilege) -> Result<Int3Behaviour, HostCheckError> {
    let kvm = open_kvm()?;
    let mut vm = CheckVm::running(&kvm, mode, &[0xcc], false)?;
    vm.debug(KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_SW_BP, None)?;
    Ok(match vm.next_event()? {
        CheckVmExit::Debug { exception: 3, .. } => Int3Behaviour::Intercepted,
        CheckVmExit::Marker { marker, .. } if marker == M_VECTOR | 3 => Int3Behaviour::GuestHandler,
        CheckVmExit::EmulationFailure => Int3Behaviour::NotEmulated,
        other => Int3Behaviour::Unknown(format!("{other:?}")),
    })
}

/// Whether a hardware execution breakpoint on a guest instruction exits.
pub fn check_hw_breakpoint(mode: Privilege) -> Result<bool, HostCheckError> {
    let kvm = open_kvm()?;
    let mut vm = CheckVm::running(&kvm, mode, &[0x90, 0x90, 0x90], false)?;
    let target = body_addr(mode) + 1;
    vm.debug(KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_HW_BP, Some(target))?;
    loop {
        match vm.next_event()? {
            CheckVmExit::Debug { pc, .. } if pc == target => return Ok(true),
            CheckVmExit::Debug { .. } => continue,
            _ => return Ok(false),
        }
    }
}

/// Whether single-stepping reports steps inside code running in `mode`.
pub fn check_single_step(mode: Privilege) -> Result<bool, HostCheckError> {
    let kvm = open_kvm()?;
    let mut vm = CheckVm::running(&kvm, mode, &[0x90, 0x90, 0x90], false)?;
    vm.debug(KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_SINGLESTEP, None)?;
    let body = body_addr(mode);
    for _ in 0..64 {
        match vm.next_event()? {
            CheckVmExit::Debug { pc, .. } if (body..body + 3).contains(&pc) && pc != body => {
                return Ok(true)
            }
            CheckVmExit::Debug { .. } => continue,
            _ => return Ok(false),
        }
    }
    Ok(false)
}

/// Where interrupts injected at a VM exit reach the guest, over `rounds`
/// tries: the guest enables interrupts, writes a marker (the exit at which
/// the VMM injects vector 31) and counts in RAX; the handler reports, and
/// the interrupt frame on its stack says where the guest was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryReport {
    pub rounds: u32,
    /// Deliveries at the instruction right after the exiting one.
    pub exact: u32,
    /// The most instructions the guest ran between exit and delivery.
    pub max_late: u64,
}

pub fn check_interrupt_delivery(rounds: u32) -> Result<DeliveryReport, HostCheckError> {
    const LOOP: u32 = 4000;
    let kvm = open_kvm()?;
    let mut report = DeliveryReport {
        rounds,
        exact: 0,
        max_late: 0,
    };
    // sti; nop; out MARKER, al (al = M_AFTER); then LOOP x `inc rax`.
    let mut body = vec![0xfb, 0x90, 0xb0, M_AFTER, 0xe6, MARKER_PORT as u8];
    let after_out = KERNEL_CODE + body.len() as u64;
    for _ in 0..LOOP {
        body.extend([0x48, 0xff, 0xc0]);
    }
    for _ in 0..rounds {
        let mut vm = CheckVm::new(
            &kvm,
            &body,
            &marker_code(0x7f),
            &marker_code(M_LSTAR),
            false,
        )?;
        match vm.next_event()? {
            CheckVmExit::Marker {
                marker: M_AFTER, ..
            } => {}
            _ => return Ok(report),
        }
        kvm_ext::inject_interrupt(&vm.vcpu, 31).map_err(|e| HostCheckError::Kvm {
            op: "INTERRUPT",
            source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)),
        })?;
        if vm.next_event()?
            != (CheckVmExit::Marker {
                marker: M_VECTOR | 31,
                cpl: 0,
            })
        {
            return Ok(report);
        }
        // The frame: RIP, CS, RFLAGS, RSP, SS below the stack top.
        let mut rip = [0u8; 8];
        vm._mem
            .read_slice(&mut rip, GuestAddress(KERNEL_STACK - 40))
            .map_err(|e| HostCheckError::Memory(e.to_string()))?;
        let rip = u64::from_le_bytes(rip);
        if rip == after_out {
            report.exact += 1;
        } else {
            report.max_late = report.max_late.max(rip.saturating_sub(after_out) / 3);
        }
    }
    Ok(report)
}

/// Whether user-mode RDTSC faults when the guest sets CR4.TSD.
pub fn check_user_tsd() -> Result<bool, HostCheckError> {
    let kvm = open_kvm()?;
    let mut vm = CheckVm::running(&kvm, Privilege::User, &[0x0f, 0x31], true)?;
    Ok(matches!(vm.next_event()?, CheckVmExit::Marker { marker, .. } if marker == M_VECTOR | 13))
}

/// Whether user-mode port I/O exits to the VMM (the marker arrives from
/// ring 3).
pub fn check_user_port_io() -> Result<bool, HostCheckError> {
    let kvm = open_kvm()?;
    let mut vm = CheckVm::running(&kvm, Privilege::User, &[], false)?;
    Ok(matches!(
        vm.next_event()?,
        CheckVmExit::Marker {
            marker: M_AFTER,
            cpl: 3
        }
    ))
}

/// XCR0 as guest user code reads it with XGETBV (low byte) after the
/// guest enabled CR4.OSXSAVE with XCR0 = x87|SSE. 3 where the host honours
/// the guest's XCR0; the host's own value where it does not (guest user
/// code can then use AVX state whatever the guest kernel enabled).
pub fn check_user_xcr0() -> Result<u8, HostCheckError> {
    let kvm = open_kvm()?;
    // xor ecx, ecx; xgetbv; out 0xf1, al; hlt
    let user = [0x31, 0xc9, 0x0f, 0x01, 0xd0, 0xe6, MARKER_PORT as u8, 0xf4];
    let mut vm = CheckVm::user(&kvm, &user, false)?;
    let mut sregs = vm.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
    sregs.cr4 |= 1 << 18; // OSXSAVE
    vm.vcpu.set_sregs(&sregs).map_err(kvm_err("SET_SREGS"))?;
    let mut xcrs = vm.vcpu.get_xcrs().map_err(kvm_err("GET_XCRS"))?;
    xcrs.nr_xcrs = 1;
    xcrs.xcrs[0].xcr = 0;
    xcrs.xcrs[0].value = 3;
    vm.vcpu.set_xcrs(&xcrs).map_err(kvm_err("SET_XCRS"))?;
    match vm.next_event()? {
        CheckVmExit::Marker { marker, .. } => Ok(marker),
        _ => Ok(0),
    }
}

/// Performance counters: on the host, and offered to guests by KVM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PmuSupport {
    /// `Err` text when perf_event_open of a hardware branch counter fails.
    pub host_branch_counter: Result<(), String>,
    /// General-purpose counters KVM offers guests (CPUID leaf 0xA).
    pub guest_counters: u32,
}

pub fn check_pmu() -> Result<PmuSupport, HostCheckError> {
    let kvm = open_kvm()?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("GET_SUPPORTED_CPUID"))?;
    let guest_counters = cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == 0xa)
        .map(|e| (e.eax >> 8) & 0xff)
        .unwrap_or(0);
    Ok(PmuSupport {
        host_branch_counter: sys::hardware_branch_counter().map_err(|e| e.to_string()),
        guest_counters,
    })
}

/// Everything `insight host-check` reports.
#[derive(Clone, Debug)]
pub struct HostReport {
    pub syscall: SyscallBehaviour,
    pub user_port_io: bool,
    pub int3_kernel: Int3Behaviour,
    pub int3_user: Int3Behaviour,
    pub hw_breakpoint_kernel: bool,
    pub hw_breakpoint_user: bool,
    pub single_step_kernel: bool,
    pub single_step_user: bool,
    pub user_tsd: bool,
    /// Low byte of XCR0 as guest user code sees it (see check_user_xcr0).
    pub user_xcr0: u8,
    pub pmu: PmuSupport,
    /// Where interrupts injected at an exit arrive (exit clock premise).
    pub delivery: DeliveryReport,
    /// Whether user code can be preempted where it stands and the state
    /// found again at replay (asynchronous points).
    pub state_match: StateMatchReport,
    /// Whether user code stepped in kernel mode runs as in user mode (the
    /// replay-time tracer's fast steps).
    pub kernel_steps: KernelStepReport,
    /// Whether a PVM-enlightened guest kernel could run natively here.
    pub pvm_guest_abi: PvmGuestAbi,
}

impl HostReport {
    pub fn measure() -> Result<Self, HostCheckError> {
        Ok(HostReport {
            syscall: check_syscall()?,
            user_port_io: check_user_port_io()?,
            int3_kernel: check_sw_breakpoint(Privilege::Kernel)?,
            int3_user: check_sw_breakpoint(Privilege::User)?,
            hw_breakpoint_kernel: check_hw_breakpoint(Privilege::Kernel)?,
            hw_breakpoint_user: check_hw_breakpoint(Privilege::User)?,
            single_step_kernel: check_single_step(Privilege::Kernel)?,
            single_step_user: check_single_step(Privilege::User)?,
            user_tsd: check_user_tsd()?,
            user_xcr0: check_user_xcr0()?,
            pmu: check_pmu()?,
            delivery: check_interrupt_delivery(20)?,
            state_match: check_state_match()?,
            kernel_steps: check_kernel_steps()?,
            pvm_guest_abi: check_pvm_guest_abi()?,
        })
    }

    /// Whether insight can boot its guest here at all.
    pub fn can_run(&self) -> bool {
        !matches!(self.syscall, SyscallBehaviour::Unknown(_))
    }

    /// The timestamp clock record/replay will use.
    pub fn clock(&self) -> ClockKind {
        if self.pmu.host_branch_counter.is_ok() && self.pmu.guest_counters > 0 {
            ClockKind::Branch
        } else {
            ClockKind::Exit
        }
    }
}
