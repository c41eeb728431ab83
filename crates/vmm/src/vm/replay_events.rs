//! Replay-time event capture: the events the guest raises at VM exits,
//! the guest kernel's context-switch ring, and host samples of the
//! tracked tasks.

use std::time::Duration;

use devices::control::EventRaiser;
use events::abi::Source;
use events::capture::{Capture, USER_CODE_END, USER_CODE_MIN};
use vm_memory::GuestMemoryMmap;

use super::preempt::Candidate;
use super::run::RunOutcome;
use super::{kvm_err, Sampling, Vm, VmError, MAX_STACK_FRAMES};
use events::abi::{Kind, Payload, SampleMode};
use events::capture::Stored;
use introspect::guest_events::{self, SwitchRing, UserMemory, SYSCALL_TRAP_RIP};
use introspect::gva;
use introspect::probe_gate;
use journal::Journal;
use kvm_bindings::kvm_regs;
use unwind::Regs;

/// How the KVM_RUN a kick interrupted started.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Resumed {
    /// The RIP of the VM exit right before it, if it followed one.
    pub rip: Option<u64>,
    /// The vCPU started in the guest kernel: it had stopped there, or an
    /// interrupt had just been injected (samples only).
    pub in_kernel: bool,
}

impl Vm {
    /// Stores the events the guest raises during replay in `capture`.
    pub fn capture_events(&mut self, capture: Capture) {
        self.events = Some(capture);
    }

    /// Also takes a SAMPLE of the tracked task on the vCPU about every
    /// `period` of host time during replay, into the event capture (the
    /// kick thread wakes the vCPU at most once a millisecond).
    pub fn sample_every(&mut self, period: Duration) {
        let period_ns = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.sampling = Some(Sampling {
            period_ns,
            next_ns: period_ns,
            injected: false,
        });
    }

    /// Unwinds the user stacks of samples and lock events by the
    /// call-frame information of the objects each process announces
    /// (SYMBOL events), read from the guest's files; without it, samples
    /// follow frame pointers and lock events keep their caller only.
    pub fn unwind_stacks(&mut self, processes: unwind::Processes) {
        self.stacks = Some(processes);
    }

    /// `gva`: the guest kernel variable holding the top of the current
    /// task's kernel stack (`cpu_current_top_of_stack` of a uniprocessor
    /// kernel), below which a task entering the kernel from user mode
    /// leaves its user registers. With it (and [`Vm::unwind_stacks`]), a
    /// sample taken in the kernel carries the user stack the task entered
    /// from: the user RIP first, then its callers.
    pub fn user_registers_below(&mut self, gva: u64) {
        self.kernel_stack_top = Some(gva);
    }

    /// Closes the event database, keeping what was captured even when the
    /// run failed.
    pub(super) fn end_events(
        &mut self,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError> {
        let drained = self.drain_switches();
        let Some(capture) = self.events.take() else {
            return result;
        };
        let finished = capture.finish();
        let result = result.and_then(|o| drained.map(|()| o));
        let mut outcome = result?;
        outcome.events = Some(finished?);
        Ok(outcome)
    }

    /// A SAMPLE of the task on the vCPU, if one is due and the task is
    /// tracked: RIP, where the task was (`SampleMode`), and the user
    /// stack's return addresses. `resumed`: how the interrupted KVM_RUN
    /// started.
    pub(super) fn take_sample(&mut self, resumed: Resumed) -> Result<(), VmError> {
        let (Some(sampling), true) = (&mut self.sampling, self.events.is_some()) else {
            return Ok(());
        };
        let now = self.clock.now_ns();
        if now < sampling.next_ns {
            return Ok(());
        }
        sampling.next_ns = now.saturating_add(sampling.period_ns);
        self.drain_switches()?;
        let stubs = self.stub_mappings();
        let Some(capture) = &mut self.events else {
            return Ok(());
        };
        let Some((pid, lwpid)) = capture.current() else {
            return Ok(());
        };
        if !capture.is_tracked(lwpid) {
            return Ok(());
        }
        let mut regs = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
        let sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        let user = sregs.cs.selector & 3 == 3;
        // At the probe gate's store or the `ret` after it: the vCPU is on
        // its way back from the gate's exit, replay's own time (the gate
        // is a bare `ret` while recording). The sample is the probe's, at
        // its return address, as at a kernel boundary.
        let at_gate = user && probe_gate::is_gate_store(regs.rip, &stubs);
        if let Some(probe) = at_gate
            .then(|| probe_at_gate(&self.mem, sregs.cr3, &regs))
            .flatten()
        {
            (regs.rip, regs.rsp) = (probe.rip, probe.rsp);
        }
        // A system call on its way into the kernel through the trap page:
        // the program is at the call's return address.
        let in_syscall_trap = user
            && regs.rip == SYSCALL_TRAP_RIP
            && (USER_CODE_MIN..USER_CODE_END).contains(&regs.rcx);
        if in_syscall_trap {
            regs.rip = regs.rcx;
        }
        // Inside the trampoline, the program is at the patched position.
        let rip = self.preempt.sample_rip(regs.rip);
        let (mode, stack) = if user {
            // Started in the kernel and not moved on since it returned,
            // with the registers its entry saved: the time is the
            // kernel's, or the host's on its behalf (after a page fault
            // the faulting instruction apparently waits while the host
            // maps the fresh page; kicks are answered within 30-70 us in
            // either mode, so they are not held back). A spin loop whose
            // registers repeat those saved would count too, in the first
            // run after a kernel entry only.
            let kernel_time = resumed.in_kernel
                && self.kernel_stack_top.is_some_and(|top| {
                    guest_events::user_regs_as_saved(&self.mem, sregs.cr3, top, &regs)
                });
            let mode = if at_gate
                || in_syscall_trap
                || kernel_time
                || at_kernel_boundary(&self.mem, sregs.cr3, &regs, resumed.rip)
            {
                SampleMode::KernelBoundary
            } else {
                SampleMode::User
            };
            let stack = match &self.stacks {
                Some(stacks) => {
                    let mut mem = UserMemory {
                        mem: &self.mem,
                        cr3: sregs.cr3,
                    };
                    let at = Regs {
                        rip,
                        rsp: regs.rsp,
                        rbp: regs.rbp,
                    };
                    stacks.unwind(pid, &mut mem, at, MAX_STACK_FRAMES)
                }
                None => guest_events::frame_chain(&self.mem, sregs.cr3, regs.rbp, MAX_STACK_FRAMES),
            };
            (mode, stack)
        } else {
            let user = match (&self.stacks, self.kernel_stack_top) {
                (Some(stacks), Some(top)) => {
                    guest_events::user_regs_in_kernel(&self.mem, sregs.cr3, top)
                        .map(|regs| (stacks, regs))
                }
                _ => None,
            };
            let stack = user.map_or_else(Vec::new, |(stacks, [rip, rsp, rbp])| {
                let mut mem = UserMemory {
                    mem: &self.mem,
                    cr3: sregs.cr3,
                };
                let at = Regs { rip, rsp, rbp };
                let mut frames = vec![rip];
                frames.extend(stacks.unwind(pid, &mut mem, at, MAX_STACK_FRAMES - 1));
                frames
            });
            (SampleMode::Kernel, stack)
        };
        let time = self.journal.progress().guest_ns;
        capture.sample(time, pid, lwpid, rip, mode, &stack)?;
        Ok(())
    }

    /// The guest kernel announced its context-switch ring (at boot).
    pub(super) fn attach_switch_ring(&mut self) {
        let gpa = self.vcpu.sync_regs().regs.rsi;
        self.switch_ring_gpa = Some(gpa);
        let Some(capture) = &mut self.events else {
            return;
        };
        match SwitchRing::new(&self.mem, gpa) {
            Ok(ring) => self.switch_ring = Some(ring),
            Err(why) => capture.bad_switch_ring(why),
        }
    }

    /// Moves the context switches the guest kernel logged since the last
    /// call into the event capture.
    pub(super) fn drain_switches(&mut self) -> Result<(), VmError> {
        let (Some(ring), Some(capture)) = (&mut self.switch_ring, &mut self.events) else {
            return Ok(());
        };
        let switches = ring.drain(&self.mem);
        // Called at every replay exit: most find nothing new.
        if switches.records.is_empty() && switches.lost == 0 {
            return Ok(());
        }
        let hint = self.journal.progress().guest_ns;
        if switches.lost > 0 {
            let example = format!(
                "{} records overwritten before guest time {hint} ns",
                switches.lost
            );
            capture.lost_switches(switches.lost, example);
        }
        for [from_pid, from_lwpid, to_pid, to_lwpid] in switches.records {
            capture.context_switch(hint, (from_pid, from_lwpid), (to_pid, to_lwpid))?;
        }
        Ok(())
    }

    /// The guest raised an event at the last exit (docs/events.md). The
    /// recording notes when; replay reads the event from guest memory.
    pub(super) fn guest_event(&mut self, raiser: EventRaiser) -> Result<(), VmError> {
        match self.journal {
            Journal::Live => Ok(()),
            Journal::Record(_) => Ok(self.journal.record_event_raised(self.clock.now_ns())?),
            Journal::Replay(_) => {
                let ns = self.journal.replay_event_raised()?;
                let Some(capture) = &mut self.events else {
                    return Ok(());
                };
                let regs = self.vcpu.sync_regs().regs;
                let cr3 = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?.cr3;
                let named_by_kernel = Some(((regs.rdi >> 32) as u32, regs.rdi as u32));
                let (source, address, raised_by) = match raiser {
                    EventRaiser::ProbeTrap => (Source::Probe, regs.rsi, named_by_kernel),
                    EventRaiser::Kernel => (Source::Kernel, regs.rsi, named_by_kernel),
                    EventRaiser::ProbePort => (Source::Probe, regs.rax, capture.current()),
                };
                let buffer =
                    guest_events::read_buffer(&self.mem, cr3, address, source == Source::Probe);
                let buffer = buffer.as_deref().map_err(Clone::clone);
                let stored = capture.raised(ns, source, raised_by, buffer)?;
                // At the port the registers are the probe's own; a trap's
                // are the kernel's, which forwarded it.
                let at = (raiser == EventRaiser::ProbePort).then_some(Regs {
                    rip: regs.rip,
                    rsp: regs.rsp,
                    rbp: regs.rbp,
                });
                self.stack_of(stored, cr3, at)
            }
        }
    }
}

impl Vm {
    /// Replay: a store to the probe gate's address (`introspect::probe_gate`).
    /// When the gate made it, a probe raised an event whose buffer is at
    /// the address stored: it is captured at the VM time of the last
    /// deterministic exit, and the guest goes on as if nothing happened.
    pub(super) fn gate_event(&mut self, data: &[u8]) -> Result<Candidate, VmError> {
        let rip = self.vcpu.sync_regs().regs.rip;
        let Ok(address) = <[u8; 8]>::try_from(data).map(u64::from_le_bytes) else {
            return Ok(Candidate::NotOurs);
        };
        if !probe_gate::is_gate_store(rip, &self.stub_mappings()) {
            return Ok(Candidate::NotOurs);
        }
        self.preempt.gate_exit();
        if self.events.is_none() {
            return Ok(Candidate::Passed);
        }
        // Switches since the last exit come before the event.
        self.drain_switches()?;
        let cr3 = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?.cr3;
        let ns = self.journal.progress().guest_ns;
        let Some(capture) = &mut self.events else {
            return Ok(Candidate::Passed);
        };
        let buffer = guest_events::read_buffer(&self.mem, cr3, address, true);
        let raised_by = capture.current();
        let stored = capture.raised(
            ns,
            Source::Probe,
            raised_by,
            buffer.as_deref().map_err(Clone::clone),
        )?;
        // Read only when unwinding: each replayed event passes here.
        let at = match self.stacks {
            Some(_) => probe_at_gate(&self.mem, cr3, &self.vcpu.sync_regs().regs),
            None => None,
        };
        self.stack_of(stored, cr3, at)?;
        Ok(Candidate::Passed)
    }

    /// Follows what a stored event tells of the process's objects, and
    /// gives lock, unlock, thread spawn and ALLOC events the stack of
    /// their caller, unwound from the probe's registers `at` (when known).
    fn stack_of(
        &mut self,
        stored: Option<Stored>,
        cr3: u64,
        at: Option<Regs>,
    ) -> Result<(), VmError> {
        let (Some(stacks), Some(capture), Some(stored)) =
            (&mut self.stacks, &mut self.events, stored)
        else {
            return Ok(());
        };
        let caller = match &stored.event.payload {
            Payload::Symbol { base, path } => {
                stacks.mapped(stored.pid, *base, path);
                return Ok(());
            }
            Payload::Lock { caller, .. } if has_stack(stored.event.kind) => *caller,
            Payload::ThreadSpawn { caller, .. } => *caller,
            Payload::Heap { caller, .. } if stored.event.kind == Kind::Alloc => *caller,
            _ => {
                stacks.raised(stored.pid);
                return Ok(());
            }
        };
        stacks.raised(stored.pid);
        let Some(at) = at else {
            return Ok(());
        };
        let mut mem = UserMemory {
            mem: &self.mem,
            cr3,
        };
        // The probe library's own frames come first: the stack starts at
        // the caller the probe named.
        let frames = stacks.unwind(stored.pid, &mut mem, at, MAX_STACK_FRAMES + 4);
        if let Some(first) = frames.iter().position(|&ra| ra == caller) {
            let end = frames.len().min(first + MAX_STACK_FRAMES);
            capture.stack(stored.seq, &frames[first..end])?;
        }
        Ok(())
    }
}

/// Where the probe that called the gate stands, for a task at the gate
/// with `regs`: its return address, and its stack pointer before the
/// call (the probe called the gate past its 128-byte red zone).
fn probe_at_gate(mem: &GuestMemoryMmap, cr3: u64, regs: &kvm_regs) -> Option<Regs> {
    let rip = unwind::Memory::read_u64(&mut UserMemory { mem, cr3 }, regs.rsp)?;
    Some(Regs {
        rip,
        rsp: regs.rsp.wrapping_add(8 + 128),
        rbp: regs.rbp,
    })
}

/// Lock events that keep their caller's whole stack: requests and
/// releases (a request's return shares its request's).
fn has_stack(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Lock | Kind::TryLock | Kind::TimedLock | Kind::Unlock
    )
}

/// RFLAGS.RF: set when a fault handler returns to restart the instruction
/// that faulted, and when a REP string instruction is interrupted between
/// iterations; cleared once an instruction completes.
const RFLAGS_RF: u64 = 1 << 16;

/// The longest x86 instruction.
const MAX_INSN: u64 = 15;

/// Whether a user-mode task at `regs` is between its kernel (or the
/// hypervisor) and the instruction at RIP rather than running user code
/// (see `SampleMode::KernelBoundary`). `resumed_at`: the RIP of the VM
/// exit right before the interrupted KVM_RUN.
fn at_kernel_boundary(
    mem: &GuestMemoryMmap,
    cr3: u64,
    regs: &kvm_regs,
    resumed_at: Option<u64>,
) -> bool {
    // Restarting after a fault; an interrupted REP string instruction
    // has RF set too, and is user time.
    let restarting = regs.rflags & RFLAGS_RF != 0 && !is_rep_string(&code_at(mem, cr3, regs.rip));
    // Not moved on since an exit at RIP: hosts report the exit with RIP at
    // the port I/O instruction or already past it.
    let resumed = resumed_at.is_some_and(|exit_rip| {
        exit_rip == regs.rip
            || port_io_len(&code_at(mem, cr3, exit_rip))
                .is_some_and(|n| exit_rip.wrapping_add(n) == regs.rip)
    });
    restarting || resumed || after_kernel_entry(mem, cr3, regs)
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
    use vm_memory::{Bytes, GuestAddress};

    /// User code at 0x40_0000: CR3 0x1000 -> PDPT 0x2000 -> PD 0x3000,
    /// one 2 MiB page at physical 0x20_0000.
    fn user_code(code: &[u8]) -> GuestMemoryMmap {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        m.write_obj(0x2000u64 | 7, GuestAddress(0x1000)).unwrap();
        m.write_obj(0x3000u64 | 7, GuestAddress(0x2000)).unwrap();
        m.write_obj(0x20_0000u64 | 0x87, GuestAddress(0x3000 + 2 * 8))
            .unwrap();
        m.write_slice(code, GuestAddress(0x20_0000)).unwrap();
        m
    }

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
        assert!(!at_kernel_boundary(&m, 0x1000, &rf(base), None));
        // A load restarting after a fault.
        assert!(at_kernel_boundary(&m, 0x1000, &rf(base + 4), None));
        assert!(!at_kernel_boundary(&m, 0x1000, &at(base + 4, 0), None));
        // The exit was reported at the out, or already past it.
        let after_out = at(base + 3, 0);
        assert!(at_kernel_boundary(&m, 0x1000, &after_out, Some(base + 2)));
        assert!(at_kernel_boundary(&m, 0x1000, &after_out, Some(base + 3)));
        assert!(!at_kernel_boundary(&m, 0x1000, &after_out, Some(base)));
        assert!(!at_kernel_boundary(&m, 0x1000, &after_out, None));
    }
}
