//! Where a task that a kick stopped in user mode stands: in its own code,
//! or between its kernel (or the hypervisor) and the program. Recording
//! asks at a sample mark ([`super::PointTaker`]), replay at a sample
//! (`crate::tools`), with the same answer for the same state.

use events::abi::SampleMode;
use events::capture::{USER_CODE_END, USER_CODE_MIN};
use introspect::guest_events::{self, SYSCALL_TRAP_RIP};
use introspect::instructions::MAX_INSN;
use introspect::{gva, probe_gate};
use journal::preempt::state;
use kvm_bindings::kvm_regs;
use vm_memory::GuestMemoryMmap;

use crate::vm::Resumed;

/// Where a task in user mode at `regs` is, for a sample: in user code
/// (`User`), or between its kernel (or the hypervisor) and the program
/// (`KernelBoundary`). `regs` is moved to where the program is: at the
/// probe gate, to the probe's return; in the system-call trap page, to the
/// call's return. `resumed`: how the interrupted KVM_RUN started;
/// `kernel_stack_top`: the guest kernel variable (see `Sampling::every`).
pub(crate) fn user_position(
    mem: &GuestMemoryMmap,
    cr3: u64,
    regs: &mut kvm_regs,
    stubs: &[u64],
    resumed: Resumed,
    kernel_stack_top: Option<u64>,
) -> SampleMode {
    // In the probe gate's code: the vCPU is copying an event into the
    // ring or on its way back from the gate's exit, replay's own time (the
    // gate only returns while recording). The sample is the probe's, at
    // its return address, as at a kernel boundary.
    let at_gate = probe_gate::in_gate_code(regs.rip, stubs);
    if let Some(probe) = at_gate
        .then(|| probe_gate::probe_at_gate(mem, cr3, regs))
        .flatten()
    {
        (regs.rip, regs.rsp) = (probe.rip, probe.rsp);
    }
    // A system call on its way into the kernel through the trap page: the
    // program is at the call's return address.
    let in_syscall_trap =
        regs.rip == SYSCALL_TRAP_RIP && (USER_CODE_MIN..USER_CODE_END).contains(&regs.rcx);
    if in_syscall_trap {
        regs.rip = regs.rcx;
    }
    // Started in the kernel and not moved on since it returned, with the
    // registers its entry saved: the time is the kernel's, or the host's
    // on its behalf (after a page fault the faulting instruction
    // apparently waits while the host maps the fresh page; kicks are
    // answered within 30-70 us in either mode, so they are not held
    // back). A spin loop whose registers repeat those saved would count
    // too, in the first run after a kernel entry only.
    let kernel_time = resumed.in_kernel
        && kernel_stack_top
            .is_some_and(|top| guest_events::user_regs_as_saved(mem, cr3, top, regs));
    if at_gate || in_syscall_trap || kernel_time || at_kernel_boundary(mem, cr3, regs, resumed) {
        SampleMode::KernelBoundary
    } else {
        SampleMode::User
    }
}

/// RFLAGS.RF: set when a fault handler returns to restart the instruction
/// that faulted, and when a REP string instruction is interrupted between
/// iterations; cleared once an instruction completes.
const RFLAGS_RF: u64 = 1 << 16;

/// Whether a user-mode task at `regs` is between its kernel (or the
/// hypervisor) and the instruction at RIP rather than running user code
/// (see `SampleMode::KernelBoundary`). `resumed`: how the interrupted
/// KVM_RUN started, the VM exit right before it.
pub(crate) fn at_kernel_boundary(
    mem: &GuestMemoryMmap,
    cr3: u64,
    regs: &kvm_regs,
    resumed: Resumed,
) -> bool {
    // Restarting after a fault; an interrupted REP string instruction
    // has RF set too, and is user time.
    let restarting = regs.rflags & RFLAGS_RF != 0 && !is_rep_string(&code_at(mem, cr3, regs.rip));
    // Not moved on since an exit at RIP: hosts report the exit with RIP at
    // the port I/O instruction or already past it. Back at RIP with other
    // registers, the task went round a loop since (a tight loop passes the
    // position of a trampoline's exit about every few instructions).
    let unmoved = resumed.rip.is_some_and(|exit_rip| {
        let past_io = || {
            port_io_len(&code_at(mem, cr3, exit_rip))
                .is_some_and(|n| exit_rip.wrapping_add(n) == regs.rip)
        };
        let same_gprs = |io: bool| {
            resumed.gprs.is_none_or(|then| {
                let now = state::gprs(regs);
                // An IN writes RAX (the first of `gprs`).
                then.iter()
                    .zip(now)
                    .skip(usize::from(io))
                    .all(|(a, b)| *a == b)
            })
        };
        (exit_rip == regs.rip && same_gprs(false)) || (past_io() && same_gprs(true))
    });
    restarting || unmoved || after_kernel_entry(mem, cr3, regs)
}

/// Up to `MAX_INSN` bytes of guest code at `rip`, fewer where the page
/// ends (and none where it is not mapped).
fn code_at(mem: &GuestMemoryMmap, cr3: u64, rip: u64) -> Vec<u8> {
    let mut code = vec![0u8; (MAX_INSN as u64).min(0x1000 - (rip & 0xfff)) as usize];
    match gva::read_virt(mem, cr3, rip, &mut code) {
        Ok(()) => code,
        Err(_) => Vec::new(),
    }
}

/// Whether a prefix byte (legacy or REX) can come before an opcode.
fn is_prefix(b: u8) -> bool {
    matches!(
        b,
        0x26 | 0x2e | 0x36 | 0x3e | 0x40..=0x4f | 0x64..=0x67 | 0xf0 | 0xf2 | 0xf3
    )
}

/// Whether `code` starts with a string instruction (ins, outs, movs, cmps,
/// stos, lods, scas) with a REP prefix.
fn is_rep_string(code: &[u8]) -> bool {
    let Some(op) = code.iter().position(|b| !is_prefix(*b)) else {
        return false;
    };
    let rep = code[..op].iter().any(|b| matches!(b, 0xf2 | 0xf3));
    rep && matches!(code[op], 0x6c..=0x6f | 0xa4..=0xa7 | 0xaa..=0xaf)
}

/// The length of the port I/O instruction `code` starts with (in, out,
/// ins, outs, with their prefixes), if it is one.
fn port_io_len(code: &[u8]) -> Option<u64> {
    let op = code.iter().position(|b| !is_prefix(*b))?;
    let len = match code[op] {
        0xe4..=0xe7 => op + 2,
        0x6c..=0x6f | 0xec..=0xef => op + 1,
        _ => return None,
    };
    Some(len as u64)
}

/// Whether the instruction before RIP entered the guest kernel: a system
/// call (`syscall`, `sysenter`, `int $0x80`), or a probe's `int3` (EBX
/// still holds the EVENTNOTIFY key). User code at RIP is then where the
/// kernel returns. Two bytes for a system call: an instruction of another
/// kind ending in them is rare enough; one byte and the key for a probe.
fn after_kernel_entry(mem: &GuestMemoryMmap, cr3: u64, regs: &kvm_regs) -> bool {
    let mut code = [0u8; 2];
    let read = regs
        .rip
        .checked_sub(2)
        .is_some_and(|at| gva::read_virt(mem, cr3, at, &mut code).is_ok());
    read && (matches!(code, [0x0f, 0x05] | [0x0f, 0x34] | [0xcd, 0x80])
        || (code[1] == 0xcc && regs.rbx as u32 == events::abi::EVENTNOTIFY))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::test_memory::user_code;

    fn at(rip: u64, rbx: u64) -> kvm_regs {
        kvm_regs {
            rip,
            rbx,
            ..Default::default()
        }
    }

    #[test]
    fn returns_from_system_calls_and_probe_int3_are_kernel_entries() {
        let key = u64::from(events::abi::EVENTNOTIFY);
        // syscall; nop; int3; nop; mov $0x50f,%eax (ends in 05 00 00)
        let m = user_code(&[0x0f, 0x05, 0x90, 0xcc, 0x90, 0xb8, 0x0f, 0x05, 0, 0, 0x90]);
        let base = 0x40_0000;
        assert!(after_kernel_entry(&m, 0x1000, &at(base + 2, 0)));
        // int3 is a kernel entry only as a probe's EVENTNOTIFY.
        assert!(after_kernel_entry(&m, 0x1000, &at(base + 4, key)));
        assert!(!after_kernel_entry(&m, 0x1000, &at(base + 4, 0)));
        // An instruction that merely contains 0f 05 is not a system call
        // unless those are its last two bytes.
        assert!(!after_kernel_entry(&m, 0x1000, &at(base + 10, key)));
        assert!(!after_kernel_entry(&m, 0x1000, &at(base + 3, key)));
        // Unmapped, or too low to have an instruction before it.
        assert!(!after_kernel_entry(&m, 0x1000, &at(0x80_0000, key)));
        assert!(!after_kernel_entry(&m, 0x1000, &at(1, key)));
    }

    #[test]
    fn decodes_rep_string_and_port_io_instructions() {
        assert!(is_rep_string(&[0xf3, 0xaa])); // rep stosb
        assert!(is_rep_string(&[0xf3, 0x48, 0xab])); // rep stosq
        assert!(is_rep_string(&[0x66, 0xf3, 0xa5, 0x90])); // rep movsw
        assert!(!is_rep_string(&[0xaa])); // stosb, no rep
        assert!(!is_rep_string(&[0xf3, 0x0f, 0x10, 0x07])); // movss
        assert!(!is_rep_string(&[0xf3, 0xf3]));
        assert!(!is_rep_string(&[]));
        assert_eq!(port_io_len(&[0xef, 0x90]), Some(1)); // out %eax,(%dx)
        assert_eq!(port_io_len(&[0x66, 0xef]), Some(2)); // out %ax,(%dx)
        assert_eq!(port_io_len(&[0xe6, 0x80]), Some(2)); // out %al,$0x80
        assert_eq!(port_io_len(&[0xf3, 0x6e]), Some(2)); // rep outsb
        assert_eq!(port_io_len(&[0x89, 0x07]), None); // mov
        assert_eq!(port_io_len(&[0x66]), None);
    }

    #[test]
    fn interrupted_rep_strings_are_user_time_and_exit_round_trips_are_not() {
        // rep stosb; out %eax,(%dx); nop; mov (%rdi),%eax
        let m = user_code(&[0xf3, 0xaa, 0xef, 0x90, 0x8b, 0x07]);
        let base = 0x40_0000;
        let rf = |rip| kvm_regs {
            rip,
            rflags: 0x202 | RFLAGS_RF,
            ..Default::default()
        };
        let boundary = |regs: &kvm_regs, resumed| at_kernel_boundary(&m, 0x1000, regs, resumed);
        let none = Resumed::default();
        assert!(!boundary(&rf(base), none));
        // A load restarting after a fault.
        assert!(boundary(&rf(base + 4), none));
        assert!(!boundary(&at(base + 4, 0), none));
        // The exit was reported at the out, or already past it; registers
        // unknown (after a checkpoint's restore) or as they were then.
        let after_out = at(base + 3, 7);
        let exit = |rip, gprs: Option<&kvm_regs>| Resumed {
            rip: Some(rip),
            gprs: gprs.map(state::gprs),
            in_kernel: false,
        };
        for gprs in [None, Some(&after_out)] {
            assert!(boundary(&after_out, exit(base + 2, gprs)));
            assert!(boundary(&after_out, exit(base + 3, gprs)));
            assert!(!boundary(&after_out, exit(base, gprs)));
        }
        assert!(!boundary(&after_out, none));
        // An IN past the exit changed RAX only: still the exit's round trip.
        let read = kvm_regs {
            rax: 0x1234,
            ..after_out
        };
        assert!(boundary(&read, exit(base + 2, Some(&after_out))));
        // Back at the exit's RIP with another RBX (a loop's counter): the
        // task went round the loop since, user time.
        let round = at(base + 3, 8);
        assert!(!boundary(&round, exit(base + 3, Some(&after_out))));
        assert!(!boundary(&round, exit(base + 2, Some(&after_out))));
    }
}
