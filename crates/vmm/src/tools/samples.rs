//! SAMPLE events: the task on the vCPU, sampled about every period of
//! host time during replay (the kick thread wakes the vCPU for it),
//! with where it was (user code, the kernel, the boundary between them)
//! and its user stack.

use std::time::Duration;

use events::abi::SampleMode;
use events::capture::{USER_CODE_END, USER_CODE_MIN};
use introspect::guest_events::{self, UserMemory, SYSCALL_TRAP_RIP};
use introspect::{gva, probe_gate};
use journal::preempt::state;
use kvm_bindings::kvm_regs;
use unwind::Regs;
use vm_memory::GuestMemoryMmap;

use super::events::{probe_at_gate, EventTool};
use super::MAX_STACK_FRAMES;
use crate::points::PointSearch;
use crate::session::Resumed;
use crate::vm::{Machine, VmError};

/// Samples: their period and when the next is due, in host time, or in
/// the recording's time where it took sample marks.
pub(crate) struct Sampling {
    period_ns: u64,
    next_ns: u64,
    /// The recording's sampling period, when samples are taken at its
    /// marks (`journal::preempt::SampleMark`) rather than by host time.
    recorded_ns: Option<u64>,
    /// Where the guest kernel keeps the top of the current task's kernel
    /// stack, so that samples in the kernel find the user registers.
    kernel_stack_top: Option<u64>,
}

impl Sampling {
    /// A sample about every `period` of host time (the kick thread wakes
    /// the vCPU at most once a millisecond). `kernel_stack_top`: the guest
    /// kernel variable holding the top of the current task's kernel
    /// stack, below which a task entering the kernel from user mode leaves
    /// its user registers; with it, a sample taken in the kernel carries
    /// the user stack the task entered from.
    pub(crate) fn every(period: Duration, kernel_stack_top: Option<u64>) -> Self {
        let period_ns = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1);
        Sampling {
            period_ns,
            next_ns: period_ns,
            recorded_ns: None,
            kernel_stack_top,
        }
    }

    /// Samples at the recording's marks, taken about every `recorded_ns`
    /// of its time: every mark, or for a longer `period` the first mark at
    /// least about a period after the last one taken.
    pub(crate) fn at_marks(self, recorded_ns: u64) -> Self {
        Sampling {
            recorded_ns: Some(recorded_ns.max(1)),
            next_ns: 0,
            ..self
        }
    }

    /// The period (ns) of samples taken at the recording's marks; `None`
    /// for samples by host time.
    pub(crate) fn marks_period(&self) -> Option<u64> {
        self.recorded_ns.map(|_| self.period_ns)
    }

    /// When the next sample is due (VM time; never by host time where the
    /// recording's marks are the samples).
    pub(crate) fn next_ns(&self) -> u64 {
        match self.recorded_ns {
            Some(_) => u64::MAX,
            None => self.next_ns,
        }
    }

    /// Whether the recording's mark taken at `ns` (its time) is one this
    /// replay samples at: all of them at the recorded period, fewer for a
    /// longer one.
    pub(crate) fn wants_mark(&mut self, ns: u64) -> bool {
        let Some(recorded) = self.recorded_ns else {
            return false;
        };
        if ns < self.next_ns {
            return false;
        }
        self.next_ns = ns.saturating_add(self.period_ns.saturating_sub(recorded / 2));
        true
    }

    /// A SAMPLE of the task on the vCPU into `events`, if one is due and
    /// the task is tracked: RIP, where the task was (`SampleMode`), and
    /// the user stack's return addresses. `resumed`: how the interrupted
    /// KVM_RUN started; `guest_ns`: guest time as the log has it.
    pub(crate) fn take(
        &mut self,
        m: &Machine,
        events: &mut EventTool,
        search: &PointSearch,
        resumed: Resumed,
        guest_ns: u64,
    ) -> Result<(), VmError> {
        let now = m.vm.clock.now_ns();
        if self.recorded_ns.is_some() || now < self.next_ns {
            return Ok(());
        }
        self.next_ns = now.saturating_add(self.period_ns);
        self.sample(m, events, search, resumed, guest_ns, None)
    }

    /// A SAMPLE of the task on the vCPU where a recording's mark put it:
    /// in user code at the mark's position (`recorded` `User`), or, for a
    /// mark the recording took at `rip` in the kernel or at its boundary,
    /// the task where replay stood when it came to the mark (its thread,
    /// its user stack).
    pub(crate) fn take_mark(
        &mut self,
        m: &Machine,
        events: &mut EventTool,
        search: &PointSearch,
        guest_ns: u64,
        recorded: SampleMode,
        rip: Option<u64>,
    ) -> Result<(), VmError> {
        let at = Recorded {
            mode: recorded,
            rip,
        };
        self.sample(m, events, search, Resumed::default(), guest_ns, Some(at))
    }

    /// A SAMPLE of the task on the vCPU, where it was as `mode` says or as
    /// its state shows.
    fn sample(
        &mut self,
        m: &Machine,
        events: &mut EventTool,
        search: &PointSearch,
        resumed: Resumed,
        guest_ns: u64,
        recorded: Option<Recorded>,
    ) -> Result<(), VmError> {
        let mode = recorded.map(|r| r.mode);
        let mem = &m.vm.mem;
        events.drain_switches(mem, guest_ns)?;
        let stubs = m.stub_mappings();
        let capture = &mut events.capture;
        let Some((pid, lwpid)) = capture.current() else {
            return Ok(());
        };
        if !capture.is_tracked(lwpid) {
            return Ok(());
        }
        let mut regs = m.vcpu.regs()?;
        let sregs = m.vcpu.sregs()?;
        let user = sregs.cs.selector & 3 == 3;
        let here = user.then(|| {
            let top = self.kernel_stack_top;
            user_position(mem, sregs.cr3, &mut regs, &stubs, resumed, top)
        });
        // Inside the trampoline, the program is at the patched position.
        let rip = match recorded.and_then(|r| r.rip) {
            Some(rip) => rip,
            None => search.sample_rip(regs.rip),
        };
        let (mode, stack) = if let Some(here) = here {
            let mode = mode.unwrap_or(here);
            let stack = match &events.stacks {
                Some(stacks) => {
                    let mut mem = UserMemory {
                        mem,
                        cr3: sregs.cr3,
                    };
                    let at = Regs {
                        rip,
                        rsp: regs.rsp,
                        rbp: regs.rbp,
                    };
                    stacks.unwind(pid, &mut mem, at, MAX_STACK_FRAMES)
                }
                None => guest_events::frame_chain(mem, sregs.cr3, regs.rbp, MAX_STACK_FRAMES),
            };
            (mode, stack)
        } else {
            let user = match (&events.stacks, self.kernel_stack_top) {
                (Some(stacks), Some(top)) => guest_events::user_regs_in_kernel(mem, sregs.cr3, top)
                    .map(|regs| (stacks, regs)),
                _ => None,
            };
            let stack = user.map_or_else(Vec::new, |(stacks, [rip, rsp, rbp])| {
                let mut mem = UserMemory {
                    mem,
                    cr3: sregs.cr3,
                };
                let at = Regs { rip, rsp, rbp };
                let mut frames = vec![rip];
                frames.extend(stacks.unwind(pid, &mut mem, at, MAX_STACK_FRAMES - 1));
                frames
            });
            (mode.unwrap_or(SampleMode::Kernel), stack)
        };
        events
            .capture
            .sample(guest_ns, pid, lwpid, rip, mode, &stack)?;
        Ok(())
    }
}

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
    // gate is a bare `ret` while recording). The sample is the probe's, at
    // its return address, as at a kernel boundary.
    let at_gate = probe_gate::in_gate_code(regs.rip, stubs);
    if let Some(probe) = at_gate.then(|| probe_at_gate(mem, cr3, regs)).flatten() {
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

/// Where a recording's mark found the task.
#[derive(Clone, Copy)]
struct Recorded {
    mode: SampleMode,
    /// Its RIP, where replay samples elsewhere.
    rip: Option<u64>,
}

/// RFLAGS.RF: set when a fault handler returns to restart the instruction
/// that faulted, and when a REP string instruction is interrupted between
/// iterations; cleared once an instruction completes.
const RFLAGS_RF: u64 = 1 << 16;

/// The longest x86 instruction.
const MAX_INSN: u64 = 15;

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
    let mut code = vec![0u8; MAX_INSN.min(0x1000 - (rip & 0xfff)) as usize];
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
    use crate::tools::test_memory::user_code;

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
