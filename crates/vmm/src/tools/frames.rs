//! A user-mode exception caught where the guest kernel would handle it.
//!
//! This host's KVM never stops in guest user mode, but the guest kernel
//! receives the user's own debug exceptions (#DB after a trap-flag step,
//! #BP after an `int3`), and a hardware breakpoint fires in guest kernel
//! mode. So a breakpoint on the first instruction of the guest's handler
//! stops the vCPU with the exception's frame on the kernel stack and the
//! other registers still the user's; the VMM reads the frame and returns
//! the vCPU to user mode itself. The guest kernel never runs for it.

use kvm_bindings::{kvm_guest_debug, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::GuestMemoryMmap;

use crate::vm::{kvm_err, Machine, VmError};
use introspect::gva;

/// The exception vectors whose handlers these breakpoints stop at.
pub(crate) const DEBUG_VECTOR: u8 = 1;
pub(crate) const BREAKPOINT_VECTOR: u8 = 3;

/// What the CPU pushed for an exception: where user mode stood.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExceptionFrame {
    pub(crate) rip: u64,
    pub(crate) cs: u64,
    pub(crate) rflags: u64,
    pub(crate) rsp: u64,
    pub(crate) ss: u64,
}

impl ExceptionFrame {
    /// The frame at the kernel stack pointer `rsp` in the address space
    /// `cr3`.
    pub(crate) fn read(mem: &GuestMemoryMmap, cr3: u64, rsp: u64) -> Result<Self, String> {
        let mut frame = [0u8; 40];
        gva::read_virt(mem, cr3, rsp, &mut frame)
            .map_err(|e| format!("cannot read the exception's frame at {rsp:#x}: {e}"))?;
        let word =
            |i: usize| u64::from_le_bytes(frame[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        Ok(ExceptionFrame {
            rip: word(0),
            cs: word(1),
            rflags: word(2),
            rsp: word(3),
            ss: word(4),
        })
    }

    /// Whether the exception came from user mode.
    pub(crate) fn came_from_user(&self) -> bool {
        self.cs & 3 == 3
    }

    /// The user registers at the exception: `regs` (the vCPU's, still the
    /// user's but for these) with RIP, RSP and RFLAGS from the frame.
    pub(crate) fn user_regs(&self, regs: &kvm_regs) -> kvm_regs {
        let mut user = *regs;
        (user.rip, user.rsp, user.rflags) = (self.rip, self.rsp, self.rflags);
        user
    }
}

/// Completes the `iretq` of `frame`: the vCPU gets `user` registers (back
/// in user mode, or in the kernel code the frame returns to) and the
/// code and stack segments of the frame, through `kvm_run`.
pub(crate) fn return_by_iret(
    m: &mut Machine,
    frame: &ExceptionFrame,
    user: kvm_regs,
) -> Result<(), VmError> {
    let mut sregs = m.vcpu.sregs()?;
    let cr3 = sregs.cr3;
    sregs.cs = gdt_segment(&m.vm.mem, cr3, &sregs, frame.cs)?;
    sregs.ss = gdt_segment(&m.vm.mem, cr3, &sregs, frame.ss)?;
    m.vcpu.set_registers_in_run(user, sregs);
    Ok(())
}

/// The address of the guest's handler of exception `vector`, from its
/// IDT at `idt`.
pub(crate) fn idt_handler(
    mem: &GuestMemoryMmap,
    cr3: u64,
    idt: u64,
    vector: u8,
) -> Result<u64, VmError> {
    let mut gate = [0u8; 16];
    gva::read_virt(mem, cr3, idt + 16 * u64::from(vector), &mut gate)
        .map_err(|e| VmError::Expansion(format!("cannot read the guest's IDT at {idt:#x}: {e}")))?;
    let lo = u64::from(u16::from_le_bytes([gate[0], gate[1]]));
    let mid = u64::from(u16::from_le_bytes([gate[6], gate[7]]));
    let hi = u64::from(u32::from_le_bytes([gate[8], gate[9], gate[10], gate[11]]));
    Ok(lo | (mid << 16) | (hi << 32))
}

/// Hardware breakpoints on guest kernel code, all at once: execution, one
/// byte, at each address given (at most four). `single_step` adds KVM's
/// single step (in kernel mode, one instruction per exit).
pub(crate) fn set_kernel_breakpoints(
    m: &mut Machine,
    at: &[u64],
    single_step: bool,
) -> Result<(), VmError> {
    let mut debug = kvm_guest_debug {
        control: kvm_bindings::KVM_GUESTDBG_ENABLE | kvm_bindings::KVM_GUESTDBG_USE_HW_BP,
        ..Default::default()
    };
    if single_step {
        debug.control |= kvm_bindings::KVM_GUESTDBG_SINGLESTEP;
    }
    for (i, &addr) in at.iter().take(4).enumerate() {
        debug.arch.debugreg[i] = addr;
        // Li: local enable; R/W and LEN 0: execution, one byte.
        debug.arch.debugreg[7] |= 1 << (2 * i);
    }
    m.vcpu.set_guest_debug(&debug)?;
    // Each stop reads and writes both register sets: through `kvm_run`,
    // not four ioctls.
    m.vcpu.sync_sregs_at_exits();
    Ok(())
}

/// The segment `selector` names, as its GDT descriptor loads it.
fn gdt_segment(
    mem: &GuestMemoryMmap,
    cr3: u64,
    sregs: &kvm_sregs,
    selector: u64,
) -> Result<kvm_segment, VmError> {
    let selector = selector as u16;
    let at = sregs.gdt.base + u64::from(selector & !7);
    let mut d = [0u8; 8];
    gva::read_virt(mem, cr3, at, &mut d).map_err(|e| {
        VmError::Expansion(format!(
            "cannot read the guest's GDT entry {selector:#x}: {e}"
        ))
    })?;
    let d = u64::from_le_bytes(d);
    let limit = ((d & 0xffff) | ((d >> 32) & 0xf_0000)) as u32;
    let base = (((d >> 16) & 0xff_ffff) | ((d >> 32) & 0xff00_0000)) as u32;
    let flags = ((d >> 40) & 0xf0ff) as u16;
    Ok(guest::boot::descriptor_segment(
        selector, flags, base, limit,
    ))
}

/// The guest kernel's code and stack segments, as a system call loads
/// them (the selectors STAR names), for a vCPU with system registers
/// `sregs`.
pub(crate) fn kernel_segments(
    m: &Machine,
    sregs: &kvm_sregs,
) -> Result<(kvm_segment, kvm_segment), VmError> {
    let [star] = read_msrs(m, [MSR_STAR])?;
    let kernel_cs = (star >> 32) & 0xfffc;
    let cr3 = sregs.cr3;
    Ok((
        gdt_segment(&m.vm.mem, cr3, sregs, kernel_cs)?,
        gdt_segment(&m.vm.mem, cr3, sregs, kernel_cs + 8)?,
    ))
}

/// MSRs a fast system-call return uses.
const MSR_STAR: u32 = 0xc000_0081;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
/// RFLAGS bits SYSRET clears from R11: RF and VM.
const SYSRET_CLEARS: u64 = (1 << 16) | (1 << 17);

/// The vCPU's MSRs `indices`, in their order.
fn read_msrs<const N: usize>(m: &Machine, indices: [u32; N]) -> Result<[u64; N], VmError> {
    let entries = indices.map(|index| kvm_bindings::kvm_msr_entry {
        index,
        ..Default::default()
    });
    let mut msrs = kvm_bindings::Msrs::from_entries(&entries)
        .map_err(|_| VmError::Debug("cannot make an MSR list".into()))?;
    if m.vcpu.fd.get_msrs(&mut msrs).map_err(kvm_err("GET_MSRS"))? != N {
        return Err(VmError::Debug(format!(
            "cannot read the MSRs {indices:#x?}"
        )));
    }
    let mut values = [0; N];
    for (value, entry) in values.iter_mut().zip(msrs.as_slice()) {
        *value = entry.data;
    }
    Ok(values)
}

/// Does what the guest kernel's `swapgs` would: the GS base and
/// `KERNEL_GS_BASE` trade places (in `sregs`, and in the MSR); the value
/// STAR holds, which names the user segments.
fn swapgs(m: &mut Machine, sregs: &mut kvm_sregs) -> Result<u64, VmError> {
    let [star, kernel_gs] = read_msrs(m, [MSR_STAR, MSR_KERNEL_GS_BASE])?;
    let swapped = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: MSR_KERNEL_GS_BASE,
        data: sregs.gs.base,
        ..Default::default()
    }])
    .map_err(|_| VmError::Debug("cannot make an MSR list".into()))?;
    m.vcpu.fd.set_msrs(&swapped).map_err(kvm_err("SET_MSRS"))?;
    sregs.gs.base = kernel_gs;
    Ok(star)
}

/// The guest kernel stands at the `swapgs; sysretq` of a fast
/// system-call return: completes it as the CPU would (the GS bases
/// swapped, RIP from RCX, RFLAGS from R11, the user code and stack
/// segments STAR names) and returns the user registers.
pub(crate) fn return_by_sysret(m: &mut Machine) -> Result<kvm_regs, VmError> {
    let mut regs = m.vcpu.regs()?;
    let mut sregs = m.vcpu.sregs()?;
    let star = swapgs(m, &mut sregs)?;
    let selectors = (star >> 48) & 0xffff;
    let cr3 = sregs.cr3;
    sregs.cs = gdt_segment(&m.vm.mem, cr3, &sregs, (selectors + 16) | 3)?;
    sregs.ss = gdt_segment(&m.vm.mem, cr3, &sregs, (selectors + 8) | 3)?;
    regs.rip = regs.rcx;
    regs.rflags = (regs.r11 & !SYSRET_CLEARS) | 2;
    m.vcpu.set_registers_in_run(regs, sregs);
    Ok(regs)
}

/// The guest kernel stands at the `swapgs` before the `iretq` of a return
/// to user mode, the stack on the return frame: completes both as the
/// CPU would and returns the user registers.
pub(crate) fn return_by_swapgs_iret(m: &mut Machine) -> Result<kvm_regs, VmError> {
    let regs = m.vcpu.regs()?;
    let mut sregs = m.vcpu.sregs()?;
    let frame = ExceptionFrame::read(&m.vm.mem, sregs.cr3, regs.rsp).map_err(VmError::Debug)?;
    if !frame.came_from_user() {
        return Err(VmError::Debug(format!(
            "the return to user mode at {:#x} has a kernel frame (CS {:#x})",
            regs.rip, frame.cs
        )));
    }
    swapgs(m, &mut sregs)?;
    let user = frame.user_regs(&regs);
    let cr3 = sregs.cr3;
    sregs.cs = gdt_segment(&m.vm.mem, cr3, &sregs, frame.cs)?;
    sregs.ss = gdt_segment(&m.vm.mem, cr3, &sregs, frame.ss)?;
    m.vcpu.set_registers_in_run(user, sregs);
    Ok(user)
}
