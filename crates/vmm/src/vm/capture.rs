//! Replay-time event capture: the events the guest raises at VM exits,
//! the guest kernel's context-switch ring, and host samples of the
//! tracked tasks.

use super::*;
use events::abi::SampleMode;
use kvm_bindings::kvm_regs;

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
        });
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
    /// stack's return addresses by frame pointers. `resumed_at`: the RIP
    /// at which the interrupted KVM_RUN started right after a VM exit.
    pub(super) fn take_sample(&mut self, resumed_at: Option<u64>) -> Result<(), VmError> {
        let (Some(sampling), true) = (&mut self.sampling, self.events.is_some()) else {
            return Ok(());
        };
        let now = self.clock.now_ns();
        if now < sampling.next_ns {
            return Ok(());
        }
        sampling.next_ns = now.saturating_add(sampling.period_ns);
        self.drain_switches()?;
        let Some(capture) = &mut self.events else {
            return Ok(());
        };
        let Some((pid, lwpid)) = capture.current() else {
            return Ok(());
        };
        if !capture.is_tracked(lwpid) {
            return Ok(());
        }
        let regs = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
        let sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        let user = sregs.cs.selector & 3 == 3;
        let (mode, stack) = if user {
            let boundary = regs.rflags & RFLAGS_RF != 0
                || resumed_at == Some(regs.rip)
                || after_kernel_entry(&self.mem, sregs.cr3, &regs);
            let mode = if boundary {
                SampleMode::KernelBoundary
            } else {
                SampleMode::User
            };
            let stack =
                guest_events::frame_chain(&self.mem, sregs.cr3, regs.rbp, MAX_SAMPLE_FRAMES);
            (mode, stack)
        } else {
            (SampleMode::Kernel, Vec::new())
        };
        let time = self.journal.progress().guest_ns;
        capture.sample(time, pid, lwpid, regs.rip, mode, &stack)?;
        Ok(())
    }

    /// The guest kernel announced its context-switch ring (at boot).
    pub(super) fn attach_switch_ring(&mut self) {
        let Some(capture) = &mut self.events else {
            return;
        };
        let gpa = self.vcpu.sync_regs().regs.rsi;
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
                capture.raised(ns, source, raised_by, buffer)?;
                Ok(())
            }
        }
    }
}

/// RFLAGS.RF: set when a fault handler returns to restart the instruction
/// that faulted, cleared once an instruction completes.
const RFLAGS_RF: u64 = 1 << 16;

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
    use vm_memory::Bytes;

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
}
