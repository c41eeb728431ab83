//! Replay-time event capture: the events the guest raises at VM exits and
//! through the probe gate, the guest kernel's context-switch ring, and the
//! stacks of lock, thread and allocation events.

use devices::control::EventRaiser;
use events::abi::{Kind, Payload, Source};
use events::capture::{Capture, CaptureSummary, Stored};
use events::db::ProbeValue;
use introspect::event_ring::EventRing;
use introspect::guest_events::{self, SwitchRing, UserMemory};
use introspect::probe_gate;
use kvm_bindings::kvm_regs;
use unwind::Regs;
use vm_memory::GuestMemoryMmap;

use crate::vm::state::EventsState;
use crate::vm::{Machine, VmError};

/// Return addresses a SAMPLE, or a lock event, keeps.
pub(crate) const MAX_STACK_FRAMES: usize = 32;

/// Where the guest's events go at replay.
pub(crate) struct EventTool {
    pub(crate) capture: Capture,
    /// The guest kernel's context-switch ring, once announced.
    pub(crate) switch_ring: Option<SwitchRing>,
    /// What each traced process mapped, for unwinding user stacks by
    /// their call-frame information (without it, stacks follow frame
    /// pointers and lock events keep their caller only).
    pub(crate) stacks: Option<unwind::Processes>,
    /// Where reads of the event ring made while a gate ran stopped
    /// (`EventRing::drain`).
    ring_read: u64,
}

impl EventTool {
    pub(crate) fn new(capture: Capture, stacks: Option<unwind::Processes>) -> Self {
        EventTool {
            capture,
            switch_ring: None,
            stacks,
            ring_read: 0,
        }
    }

    /// The guest kernel announced its context-switch ring at `gpa`.
    pub(crate) fn attach_switch_ring(&mut self, mem: &GuestMemoryMmap, gpa: u64) {
        match SwitchRing::new(mem, gpa) {
            Ok(ring) => self.switch_ring = Some(ring),
            Err(why) => self.capture.bad_switch_ring(why),
        }
    }

    /// A boot snapshot was restored: the ring goes on from its head.
    pub(crate) fn ring_from_head(&mut self, mem: &GuestMemoryMmap, gpa: u64) {
        match SwitchRing::from_head(mem, gpa) {
            Ok(ring) => self.switch_ring = Some(ring),
            Err(why) => self.capture.bad_switch_ring(why),
        }
    }

    /// Moves the context switches the guest kernel logged since the last
    /// call into the capture, at guest time `hint`.
    pub(crate) fn drain_switches(
        &mut self,
        mem: &GuestMemoryMmap,
        hint: u64,
    ) -> Result<(), VmError> {
        self.drain_switches_to(mem, hint, u64::MAX)
    }

    /// `drain_switches`, of the records before record number `until`.
    fn drain_switches_to(
        &mut self,
        mem: &GuestMemoryMmap,
        hint: u64,
        until: u64,
    ) -> Result<(), VmError> {
        let Some(ring) = &mut self.switch_ring else {
            return Ok(());
        };
        let switches = ring.drain_to(mem, until);
        // Called at every replay exit: most find nothing new.
        if switches.records.is_empty() && switches.lost == 0 {
            return Ok(());
        }
        if switches.lost > 0 {
            let example = format!(
                "{} records overwritten before guest time {hint} ns",
                switches.lost
            );
            self.capture.lost_switches(switches.lost, example);
        }
        for [from_pid, from_lwpid, to_pid, to_lwpid] in switches.records {
            self.capture
                .context_switch(hint, (from_pid, from_lwpid), (to_pid, to_lwpid))?;
        }
        Ok(())
    }

    /// The guest raised an event at the last exit, which the recording saw
    /// at guest time `ns`: read from guest memory into the capture.
    pub(crate) fn raised(
        &mut self,
        m: &Machine,
        raiser: EventRaiser,
        ns: u64,
    ) -> Result<(), VmError> {
        let regs = m.vcpu.synced_regs();
        let cr3 = m.vcpu.sregs()?.cr3;
        let named_by_kernel = Some(((regs.rdi >> 32) as u32, regs.rdi as u32));
        let (source, address, raised_by) = match raiser {
            EventRaiser::ProbeTrap => (Source::Probe, regs.rsi, named_by_kernel),
            EventRaiser::Kernel => (Source::Kernel, regs.rsi, named_by_kernel),
            EventRaiser::ProbePort => (Source::Probe, regs.rax, self.capture.current()),
        };
        let buffer = guest_events::read_buffer(&m.vm.mem, cr3, address, source == Source::Probe);
        let buffer = buffer.as_deref().map_err(Clone::clone);
        let stored = self.capture.raised(ns, source, raised_by, buffer)?;
        // At the port the registers are the probe's own; a trap's are the
        // kernel's, which forwarded it.
        let at = (raiser == EventRaiser::ProbePort).then_some(Regs {
            rip: regs.rip,
            rsp: regs.rsp,
            rbp: regs.rbp,
        });
        let mut mem = UserMemory {
            mem: &m.vm.mem,
            cr3,
        };
        self.stack_of(&mut mem, stored, at)
    }

    /// Captures the events the gates appended to `ring` since the last
    /// call (those published, where the vCPU stopped inside a gate), each
    /// after the context switches that preceded it, at guest time `ns`,
    /// with its stack unwound from the copy the gate took.
    pub(crate) fn drain_ring(
        &mut self,
        mem: &GuestMemoryMmap,
        ring: EventRing,
        ns: u64,
    ) -> Result<(), VmError> {
        if !ring.pending(mem) {
            return Ok(());
        }
        let drained = ring.drain(mem, &mut self.ring_read);
        for entry in drained.entries {
            self.drain_switches_to(mem, ns, entry.switches)?;
            let raised_by = self.capture.current();
            let stored = self
                .capture
                .raised(ns, Source::Probe, raised_by, Ok(&entry.event))?;
            if self.stacks.is_none() {
                continue;
            }
            let mut stack = CopiedStack {
                at: entry.rsp,
                bytes: &entry.stack,
                rest: UserMemory {
                    mem,
                    cr3: entry.cr3,
                },
            };
            let at = probe_gate::probe_at_gate_in(&mut stack, entry.rsp, entry.rbp);
            self.stack_of(&mut stack, stored, at)?;
        }
        if let Some(why) = drained.damaged {
            self.capture.damaged_event_ring(why);
        }
        Ok(())
    }

    /// Process `pid` runs the executable at guest `path`, loaded at
    /// `bias`: its stacks unwind through it, and reports name its code.
    pub(crate) fn executable_seen(
        &mut self,
        pid: u32,
        bias: u64,
        path: &str,
    ) -> Result<(), VmError> {
        if let Some(stacks) = &mut self.stacks {
            stacks.mapped(pid, bias, path);
        }
        self.capture.object_seen(pid, bias, path)?;
        Ok(())
    }

    /// A hit of a probe given at replay by task (pid, lwpid), stored at
    /// guest time `ns` after the switches before it; with the user stack
    /// unwound from `stack_from` (for `ustack`), where the objects of the
    /// process are known.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn probe_hit(
        &mut self,
        m: &Machine,
        ns: u64,
        task: (u32, u32),
        kind: Kind,
        probe: u32,
        (addr, caller): (u64, Option<u64>),
        values: &[(u32, ProbeValue)],
        stack_from: Option<&kvm_regs>,
    ) -> Result<(), VmError> {
        self.drain_switches(&m.vm.mem, ns)?;
        let mut frames = Vec::new();
        if let (Some(stacks), Some(r)) = (&mut self.stacks, stack_from) {
            let cr3 = m.vcpu.sregs()?.cr3;
            let mut mem = UserMemory {
                mem: &m.vm.mem,
                cr3,
            };
            let at = Regs {
                rip: r.rip,
                rsp: r.rsp,
                rbp: r.rbp,
            };
            frames = stacks.unwind(task.0, &mut mem, at, MAX_STACK_FRAMES);
        }
        self.capture
            .probe_hit(ns, task, kind, probe, addr, caller, values, &frames)?;
        Ok(())
    }

    /// A probe raised an event through the gate, its buffer at `address`:
    /// captured at guest time `ns` (`Replayer::event_ns`).
    pub(crate) fn raised_at_gate(
        &mut self,
        m: &Machine,
        address: u64,
        ns: u64,
    ) -> Result<(), VmError> {
        // Switches since the last exit come before the event.
        self.drain_switches(&m.vm.mem, ns)?;
        let cr3 = m.vcpu.sregs()?.cr3;
        let buffer = guest_events::read_buffer(&m.vm.mem, cr3, address, true);
        let raised_by = self.capture.current();
        let stored = self.capture.raised(
            ns,
            Source::Probe,
            raised_by,
            buffer.as_deref().map_err(Clone::clone),
        )?;
        // Read only when unwinding: each replayed event passes here.
        let at = match self.stacks {
            Some(_) => probe_gate::probe_at_gate(&m.vm.mem, cr3, &m.vcpu.synced_regs()),
            None => None,
        };
        let mut mem = UserMemory {
            mem: &m.vm.mem,
            cr3,
        };
        self.stack_of(&mut mem, stored, at)
    }

    /// Follows what a stored event tells of the process's objects, and
    /// gives lock, unlock, wait, thread spawn and ALLOC events the stack of
    /// their caller, unwound from the probe's registers `at` (when known).
    fn stack_of(
        &mut self,
        mem: &mut impl unwind::ProcessMemory,
        stored: Option<Stored>,
        at: Option<Regs>,
    ) -> Result<(), VmError> {
        let (Some(stacks), Some(stored)) = (&mut self.stacks, stored) else {
            return Ok(());
        };
        let caller = match &stored.event.payload {
            Payload::Symbol { base, path } => {
                stacks.mapped(stored.pid, *base, path);
                return Ok(());
            }
            Payload::Lock { caller, .. } | Payload::Sync { caller, .. }
                if stored.event.kind.keeps_stack() =>
            {
                *caller
            }
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
        // The probe library's own frames come first: the stack starts at
        // the caller the probe named.
        let frames = stacks.unwind(stored.pid, mem, at, MAX_STACK_FRAMES + 4);
        if let Some(first) = frames.iter().position(|&ra| ra == caller) {
            let end = frames.len().min(first + MAX_STACK_FRAMES);
            self.capture.stack(stored.seq, &frames[first..end])?;
        }
        Ok(())
    }

    /// Where the capture stands, for a checkpoint; `sample_marks`: the
    /// period of the samples taken at the recording's marks.
    pub(crate) fn state(&self, sample_marks: Option<u64>) -> EventsState {
        EventsState {
            capture: self.capture.state(),
            switch_ring: self.switch_ring.as_ref().map(|r| r.position()),
            processes: self.stacks.as_ref().map(|p| p.state()),
            sample_marks,
        }
    }

    /// Goes on from where a checkpoint's capture stood (`state`).
    pub(crate) fn resume_from(
        &mut self,
        mem: &GuestMemoryMmap,
        state: &EventsState,
    ) -> Result<(), VmError> {
        self.capture.resume(&state.capture)?;
        self.switch_ring = match state.switch_ring {
            Some((gpa, seen)) => Some(
                SwitchRing::resume(mem, gpa, seen)
                    .map_err(|why| VmError::Restore(format!("context-switch ring: {why}")))?,
            ),
            None => None,
        };
        if let (Some(stacks), Some(processes)) = (&mut self.stacks, &state.processes) {
            stacks.restore(processes);
        }
        Ok(())
    }

    /// Closes the event database, keeping what was captured.
    pub(crate) fn finish(self) -> Result<CaptureSummary, VmError> {
        Ok(self.capture.finish()?)
    }
}

/// A stack as the ring gate copied it when the event was raised: words
/// from `at` up are read from the copy, any others from memory as it is.
struct CopiedStack<'a> {
    at: u64,
    bytes: &'a [u8],
    rest: UserMemory<'a>,
}

impl unwind::ProcessMemory for CopiedStack<'_> {
    fn read_u64(&mut self, addr: u64) -> Option<u64> {
        let copied = addr
            .checked_sub(self.at)
            .and_then(|off| usize::try_from(off).ok())
            .and_then(|off| self.bytes.get(off..off.checked_add(8)?));
        match copied {
            Some(word) => Some(u64::from_le_bytes(word.try_into().ok()?)),
            None => self.rest.read_u64(addr),
        }
    }
}
