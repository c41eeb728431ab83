//! Checkpoints: the complete state of a replaying VM at a deterministic
//! exit — vCPU, memory, devices, disk overlay, clock, the log position —
//! stored in the trace (`trace::checkpoints`) and restored into a new VM,
//! which then replays on from there, every exit checked as usual.
//!
//! Memory is stored incrementally: each checkpoint holds the pages that
//! differ from the previous checkpoint of the same replay (the first, the
//! pages that are not zero), found by comparing guest memory with a copy
//! kept since then, so the VMM's own writes (disk and network data, the
//! probe gate) count as much as the guest's. A checkpoint names its
//! predecessor by exit and digest; restoring one applies the chain from
//! the first. The disk overlay is stored the same way, as sector runs.
//!
//! A checkpoint is taken only where the VM is at rest: right after a
//! deterministic exit, with no disk request in flight, no frame waiting
//! for the guest, and no search for an asynchronous point under way.
//! Which exits those are depends only on the log, so every replay with
//! the same interval takes its checkpoints at the same exits.

use std::path::{Path, PathBuf};
use std::time::Instant;

use devices::cow_disk::SectorRun;
use devices::platform::PlatformState;
use devices::virtio_blk::{BlockState, VirtioBlock};
use devices::virtio_net::NetState;
use kvm_bindings::{
    kvm_debugregs, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave, Msrs,
};
use serde::{Deserialize, Serialize};
use trace::checkpoints::{self, Digest32};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::{kvm_err, ExitCounts, PreemptStats, Vm, VmClock, VmError};
use journal::{Journal, LogPosition};

const PAGE: usize = 4096;

/// How often a replay takes a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointEvery {
    /// Every so many deterministic exits.
    Exits(u64),
    /// Every so much recorded guest time (the paravirtual clock's
    /// nanoseconds, as the log has them: the same in every replay).
    GuestNs(u64),
}

/// A position in a recording.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayPoint {
    /// A deterministic exit's ordinal.
    Exit(u64),
    /// Recorded guest time (ns): the first exit where the guest clock
    /// has reached it.
    GuestNs(u64),
}

impl CheckpointEvery {
    /// Where the next checkpoint is due when one was taken at `position`.
    fn after(self, position: &LogPosition) -> ReplayPoint {
        match self {
            CheckpointEvery::Exits(n) => ReplayPoint::Exit(position.exits + n),
            CheckpointEvery::GuestNs(ns) => ReplayPoint::GuestNs(position.guest_ns + ns),
        }
    }
}

impl ReplayPoint {
    /// Whether replay at `position` has reached this point.
    fn reached(&self, position: &LogPosition) -> bool {
        match *self {
            ReplayPoint::Exit(e) => position.exits >= e,
            ReplayPoint::GuestNs(ns) => position.guest_ns >= ns,
        }
    }
}

/// The vCPU as KVM describes it.
#[derive(Serialize, Deserialize)]
pub(super) struct VcpuState {
    regs: kvm_regs,
    sregs: kvm_sregs,
    xsave: kvm_xsave,
    xcrs: Option<kvm_xcrs>,
    events: kvm_vcpu_events,
    debugregs: kvm_debugregs,
    mp_state: kvm_mp_state,
    /// Every MSR KVM lists that could be read: (index, value).
    msrs: Vec<(u32, u64)>,
    /// What the last exit told of interrupts (kvm_run's `if_flag` and
    /// `ready_for_interrupt_injection`): whether the interrupt logged
    /// after the exit can be injected depends on them.
    if_flag: u8,
    ready_for_injection: u8,
}

/// Pages of guest memory: their numbers and, in the same order, their
/// bytes.
#[derive(Clone, Default, Serialize, Deserialize)]
pub(super) struct MemoryDelta {
    pages: Vec<u32>,
    data: Vec<u8>,
}

/// What the VMM itself keeps about the run.
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct VmState {
    exits: ExitCounts,
    init_reached_ns: Option<u64>,
    exception_pending: bool,
    resume_rip: Option<u64>,
    preempt_area: Option<u64>,
    preempt_stats: PreemptStats,
    /// `/init` was ready: the disk and network devices answer.
    pub(super) devices_attached: bool,
    /// Where the guest kernel announced its context-switch ring.
    switch_ring_gpa: Option<u64>,
}

/// What the event capture had reached, when the replay captured events:
/// a replay restored here goes on capturing with the same numbers, the
/// same threads tracked, and the same objects to unwind stacks by.
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct EventsState {
    capture: events::capture::CaptureState,
    /// The guest kernel's context-switch ring: (address, records read).
    switch_ring: Option<(u64, u64)>,
    /// Each process's objects, when stacks are unwound by them.
    processes: Option<unwind::ProcessesState>,
}

/// One checkpoint, as stored; a boot snapshot is one too (`super::snapshot`).
#[derive(Serialize, Deserialize)]
pub(super) struct Checkpoint {
    /// The deterministic exit it follows.
    pub(super) exit: u64,
    /// The checkpoint before it in the same replay (exit, digest): its
    /// memory and overlay are changes since that one.
    pub(super) previous: Option<(u64, Digest32)>,
    pub(super) log: LogPosition,
    /// VM time (ns since the VM started).
    pub(super) vm_ns: u64,
    pub(super) memory_bytes: u64,
    pub(super) memory: MemoryDelta,
    pub(super) vcpu: VcpuState,
    pub(super) platform: PlatformState,
    pub(super) block: Option<BlockState>,
    pub(super) overlay: Vec<SectorRun>,
    pub(super) net: Option<NetState>,
    pub(super) vm: VmState,
    pub(super) events: Option<EventsState>,
}

/// A checkpoint taken: where, and what it cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointTaken {
    pub exit: u64,
    pub guest_ns: u64,
    /// Pages stored (changed since the previous checkpoint).
    pub pages: u64,
    /// Size of the file.
    pub bytes: u64,
    /// Host time to take and store it.
    pub took_ns: u64,
}

/// A checkpoint restored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointRestored {
    pub exit: u64,
    pub guest_ns: u64,
    /// Checkpoints read (the chain from the first).
    pub chain: usize,
    pub took_ns: u64,
}

/// Taking checkpoints during a replay.
pub(super) struct Taker {
    trace: PathBuf,
    identity: Digest32,
    every: CheckpointEvery,
    /// Where the next one is due.
    next_due: ReplayPoint,
    /// Guest memory as of the last checkpoint (zeros before the first).
    shadow: Vec<u8>,
    previous: Option<(u64, Digest32)>,
    pub(super) taken: Vec<CheckpointTaken>,
}

impl Vm {
    /// Replay: takes a checkpoint of the VM in `trace` every `every`,
    /// replacing the checkpoints it had (before `run`, after the journal
    /// is set, and after a restore if there is one: the new set goes on
    /// from the restored checkpoint).
    pub fn take_checkpoints(
        &mut self,
        trace: &Path,
        every: CheckpointEvery,
    ) -> Result<(), VmError> {
        let identity = checkpoints::trace_identity(trace).map_err(ckpt_err)?;
        let size = self.ram_bytes();
        let (previous, shadow) = match self.restored.take() {
            Some((prev, shadow)) => (Some(prev), shadow),
            None => {
                checkpoints::clear(trace).map_err(ckpt_err)?;
                (None, vec![0u8; size])
            }
        };
        if let Some((exit, _)) = previous {
            // Checkpoints after the restored one belong to another set.
            for c in checkpoints::list(trace).map_err(ckpt_err)? {
                if c.exit > exit {
                    std::fs::remove_file(&c.path).map_err(|source| {
                        ckpt_err(trace::TraceError::Io {
                            path: c.path.clone(),
                            source,
                        })
                    })?;
                }
            }
        }
        self.checkpoints = Some(Taker {
            trace: trace.to_owned(),
            identity,
            every,
            next_due: every.after(&self.log_position()),
            shadow,
            previous,
            taken: Vec::new(),
        });
        Ok(())
    }

    /// Replay: stops at the first exit at or after `point` (a window's
    /// end) instead of at the recording's end.
    pub fn stop_at(&mut self, point: ReplayPoint) {
        self.stop_at = Some(point);
    }

    /// Whether replay has reached the end of its window.
    pub(super) fn window_ended(&self) -> bool {
        self.stop_at
            .is_some_and(|p| self.journal.is_replay() && p.reached(&self.log_position()))
    }

    /// The checkpoints this replay took.
    pub fn checkpoints_taken(&self) -> &[CheckpointTaken] {
        self.checkpoints.as_ref().map_or(&[], |t| &t.taken)
    }

    pub(super) fn ram_bytes(&self) -> usize {
        self.mem.iter().map(|r| r.len() as usize).sum()
    }

    fn log_position(&self) -> LogPosition {
        match &self.journal {
            Journal::Replay(r) => r.position(),
            _ => LogPosition::default(),
        }
    }

    /// Right after a deterministic exit at replay: takes a checkpoint if
    /// one is due and the VM is at rest.
    pub(super) fn checkpoint_if_due(&mut self) -> Result<(), VmError> {
        let Some(taker) = &self.checkpoints else {
            return Ok(());
        };
        let position = self.log_position();
        if !taker.next_due.reached(&position) || !self.at_rest() {
            return Ok(());
        }
        let started = Instant::now();
        self.complete_exit()?;
        let vcpu = self.vcpu_state()?;
        let (block, overlay) = match &mut self.block {
            Some(b) => (b.state(), b.overlay_changes()?),
            None => (None, Vec::new()),
        };
        let vm = self.vm_state();
        let taker = self.checkpoints.as_mut().expect("checked above");
        let memory = changed_pages(&self.mem, &mut taker.shadow);
        let pages = memory.pages.len() as u64;
        let checkpoint = Checkpoint {
            exit: position.exits,
            previous: taker.previous,
            log: position,
            vm_ns: self.clock.now_ns(),
            memory_bytes: taker.shadow.len() as u64,
            memory,
            vcpu,
            platform: self.platform.state(),
            block,
            overlay,
            net: self.net.as_ref().map(|n| n.state()),
            vm,
            events: self.events.as_ref().map(|capture| EventsState {
                capture: capture.state(),
                switch_ring: self.switch_ring.as_ref().map(|r| r.position()),
                processes: self.stacks.as_ref().map(|p| p.state()),
            }),
        };
        let (digest, bytes) = checkpoints::write(
            &taker.trace,
            &taker.identity,
            position.exits,
            position.guest_ns,
            &checkpoint,
        )
        .map_err(ckpt_err)?;
        taker.previous = Some((position.exits, digest));
        taker.next_due = taker.every.after(&position);
        taker.taken.push(CheckpointTaken {
            exit: position.exits,
            guest_ns: position.guest_ns,
            pages,
            bytes,
            took_ns: started.elapsed().as_nanos() as u64,
        });
        Ok(())
    }

    pub(super) fn vm_state(&self) -> VmState {
        VmState {
            exits: self.exits,
            init_reached_ns: self.init_reached.map(|d| d.as_nanos() as u64),
            exception_pending: self.exception_pending,
            resume_rip: self.resume_rip,
            preempt_area: self.preempt.area_gpa(),
            preempt_stats: self.preempt.stats,
            devices_attached: self.devices_attached,
            switch_ring_gpa: self.switch_ring_gpa,
        }
    }

    /// Puts back what `vm_state` took, and the clock at `vm_ns`.
    pub(super) fn set_vm_state(&mut self, vm: &VmState, vm_ns: u64) {
        self.clock = VmClock::resumed_at(vm_ns);
        self.exits = vm.exits;
        self.init_reached = vm.init_reached_ns.map(std::time::Duration::from_nanos);
        self.exception_pending = vm.exception_pending;
        self.resume_rip = vm.resume_rip;
        self.preempt.resume(vm.preempt_area, vm.preempt_stats);
        self.devices_attached = vm.devices_attached;
        self.switch_ring_gpa = vm.switch_ring_gpa;
    }

    /// Guest memory from zeros and `deltas`, oldest first; returns it as
    /// written, the copy a new set of checkpoints compares with.
    pub(super) fn load_memory<'a>(
        &mut self,
        deltas: impl Iterator<Item = &'a MemoryDelta>,
    ) -> Result<Vec<u8>, VmError> {
        let mut shadow = vec![0u8; self.ram_bytes()];
        for delta in deltas {
            for (i, &page) in delta.pages.iter().enumerate() {
                let at = page as usize * PAGE;
                shadow[at..at + PAGE].copy_from_slice(&delta.data[i * PAGE..(i + 1) * PAGE]);
            }
        }
        self.mem
            .write_slice(&shadow, GuestAddress(0))
            .map_err(|_| VmError::Restore("guest memory cannot be written".into()))?;
        Ok(shadow)
    }

    /// Lets KVM finish the instruction of the last exit (store what a read
    /// returned, move RIP past it) without entering the guest: a KVM_RUN
    /// with `immediate_exit`. KVM keeps that completion to itself until
    /// the next KVM_RUN, and a new VM would not have it: a checkpoint
    /// taken before would restore to the instruction's start, and the
    /// guest would execute it again.
    pub(super) fn complete_exit(&mut self) -> Result<(), VmError> {
        self.vcpu.set_kvm_immediate_exit(1);
        let result = self.vcpu.run().map(|_| ());
        self.vcpu.set_kvm_immediate_exit(0);
        match result {
            Err(e) if e.errno() == libc::EINTR => Ok(()),
            Err(e) => Err(kvm_err("RUN (immediate exit)")(e)),
            // An exit with immediate_exit set would be a KVM without the
            // completion-first order this relies on.
            Ok(()) => Err(VmError::Restore(
                "KVM ran the guest although asked to exit at once".into(),
            )),
        }
    }

    /// Whether nothing is half done: no disk request in flight, no frame
    /// waiting, no trampoline in place, no exception on its way.
    fn at_rest(&self) -> bool {
        !self.exception_pending
            && !self.preempt.patched()
            && self.block.as_ref().is_none_or(VirtioBlock::at_rest)
            && self.net.as_ref().is_none_or(|n| n.pending_frames() == 0)
    }

    pub(super) fn vcpu_state(&mut self) -> Result<VcpuState, VmError> {
        let run = self.vcpu.get_kvm_run();
        let (if_flag, ready_for_injection) = (run.if_flag, run.ready_for_interrupt_injection);
        let v = &self.vcpu;
        let listed = self
            ._kvm
            .get_msr_index_list()
            .map_err(kvm_err("GET_MSR_INDEX_LIST"))?;
        let mut msrs = Vec::new();
        for &index in listed.as_slice() {
            let mut one = Msrs::from_entries(&[kvm_msr_entry {
                index,
                ..Default::default()
            }])
            .map_err(|_| VmError::Kvm {
                op: "GET_MSRS",
                source: kvm_ioctls::Error::new(libc::ENOMEM),
            })?;
            if let Ok(1) = v.get_msrs(&mut one) {
                msrs.push((index, one.as_slice()[0].data));
            }
        }
        Ok(VcpuState {
            if_flag,
            ready_for_injection,
            regs: v.get_regs().map_err(kvm_err("GET_REGS"))?,
            sregs: v.get_sregs().map_err(kvm_err("GET_SREGS"))?,
            xsave: v.get_xsave().map_err(kvm_err("GET_XSAVE"))?,
            xcrs: v.get_xcrs().ok(),
            events: v.get_vcpu_events().map_err(kvm_err("GET_VCPU_EVENTS"))?,
            debugregs: v.get_debug_regs().map_err(kvm_err("GET_DEBUGREGS"))?,
            mp_state: v.get_mp_state().map_err(kvm_err("GET_MP_STATE"))?,
            msrs,
        })
    }

    pub(super) fn set_vcpu_state(&mut self, s: &VcpuState) -> Result<(), VmError> {
        let v = &self.vcpu;
        v.set_sregs(&s.sregs).map_err(kvm_err("SET_SREGS"))?;
        if let Some(xcrs) = &s.xcrs {
            v.set_xcrs(xcrs).map_err(kvm_err("SET_XCRS"))?;
        }
        crate::kvm_ext::set_xsave(v, &s.xsave, self.xsave_max_size)
            .map_err(kvm_err("SET_XSAVE"))?;
        for &(index, data) in &s.msrs {
            let entry = kvm_msr_entry {
                index,
                data,
                ..Default::default()
            };
            let one = Msrs::from_entries(&[entry]).map_err(|_| VmError::Kvm {
                op: "SET_MSRS",
                source: kvm_ioctls::Error::new(libc::ENOMEM),
            })?;
            if v.set_msrs(&one) != Ok(1) {
                // What KVM will not set (a read-only MSR, the TSC it
                // ignores here) must already be what it was.
                let mut now = one.clone();
                let same = matches!(v.get_msrs(&mut now), Ok(1) if now.as_slice()[0].data == data);
                if !same && index != journal::MSR_IA32_TSC {
                    return Err(VmError::Restore(format!(
                        "KVM will not set MSR {index:#x} to {data:#x}"
                    )));
                }
            }
        }
        v.set_debug_regs(&s.debugregs)
            .map_err(kvm_err("SET_DEBUGREGS"))?;
        v.set_mp_state(s.mp_state)
            .map_err(kvm_err("SET_MP_STATE"))?;
        v.set_vcpu_events(&s.events)
            .map_err(kvm_err("SET_VCPU_EVENTS"))?;
        v.set_regs(&s.regs).map_err(kvm_err("SET_REGS"))?;
        let run = self.vcpu.get_kvm_run();
        run.if_flag = s.if_flag;
        run.ready_for_interrupt_injection = s.ready_for_injection;
        Ok(())
    }

    /// The trace's checkpoint a replay from `point` starts at: the latest
    /// at or before it (`None`: there is none).
    pub fn checkpoint_before(
        trace: &Path,
        point: ReplayPoint,
    ) -> Result<Option<checkpoints::StoredCheckpoint>, VmError> {
        let stored = checkpoints::list(trace).map_err(ckpt_err)?;
        Ok(stored.into_iter().rfind(|c| match point {
            ReplayPoint::Exit(e) => c.exit <= e,
            ReplayPoint::GuestNs(ns) => c.guest_ns <= ns,
        }))
    }

    /// Replay: restores the trace's checkpoint at `exit` (before `run`,
    /// after the journal is set). Every checkpoint of its chain is checked
    /// first; nothing of the VM changes if one is refused.
    pub fn restore_checkpoint(
        &mut self,
        trace: &Path,
        exit: u64,
    ) -> Result<CheckpointRestored, VmError> {
        let started = Instant::now();
        let identity = checkpoints::trace_identity(trace).map_err(ckpt_err)?;
        let stored = checkpoints::list(trace).map_err(ckpt_err)?;
        let path_of = |exit: u64| {
            stored
                .iter()
                .find(|c| c.exit == exit)
                .map(|c| c.path.clone())
        };
        let Some(path) = path_of(exit) else {
            return Err(VmError::Restore(format!(
                "the trace has no checkpoint at exit {exit}"
            )));
        };
        // The chain, newest first, each link checked.
        let (newest, digest) =
            checkpoints::read::<Checkpoint>(&path, &identity).map_err(ckpt_err)?;
        let mut chain = vec![newest];
        while let Some((exit, digest)) = chain.last().and_then(|c| c.previous) {
            let Some(path) = path_of(exit) else {
                return Err(VmError::Restore(format!(
                    "checkpoint at exit {} needs the one at exit {exit}, which is missing",
                    chain.last().map_or(0, |c| c.exit)
                )));
            };
            let (older, found) =
                checkpoints::read::<Checkpoint>(&path, &identity).map_err(ckpt_err)?;
            if found != digest || older.exit != exit {
                return Err(VmError::Restore(format!(
                    "checkpoint at exit {} follows a checkpoint at exit {exit} that has since \
                     been replaced",
                    chain.last().map_or(0, |c| c.exit)
                )));
            }
            chain.push(older);
        }
        let size = self.ram_bytes();
        for c in &chain {
            check_shape(c, size, self.block.is_some(), self.net.is_some())?;
        }
        if self.events.is_some() {
            match &chain[0].events {
                None => {
                    return Err(VmError::Restore(format!(
                        "the checkpoint at exit {} was taken by a replay that collected no \
                         events: take the checkpoints again with --events or --diagnose",
                        chain[0].exit
                    )))
                }
                Some(e) if self.stacks.is_some() && e.processes.is_none() => {
                    return Err(VmError::Restore(format!(
                        "the checkpoint at exit {} was taken by a replay that did not unwind \
                         stacks by call-frame information: replay with --unwind \
                         frame-pointers, or take the checkpoints again",
                        chain[0].exit
                    )))
                }
                Some(_) => {}
            }
        }

        // Memory: from zeros, oldest changes first; the copy kept for a
        // new set of checkpoints is the same.
        let shadow = self.load_memory(chain.iter().rev().map(|c| &c.memory))?;
        if let Some(block) = &mut self.block {
            for c in chain.iter().rev() {
                block.apply_overlay(c.overlay.clone())?;
            }
        }
        let c = &chain[0];
        self.set_vcpu_state(&c.vcpu)?;
        self.platform
            .restore(&c.platform)
            .map_err(|e| VmError::Restore(e.into()))?;
        if let (Some(block), Some(state)) = (&mut self.block, &c.block) {
            block
                .restore(state)
                .map_err(|e| VmError::Restore(format!("disk: {e}")))?;
        }
        if let (Some(net), Some(state)) = (&mut self.net, &c.net) {
            net.restore(state)
                .map_err(|e| VmError::Restore(format!("network: {e}")))?;
        }
        if let Journal::Replay(r) = &mut self.journal {
            r.seek(&c.log)?;
        }
        self.set_vm_state(&c.vm, c.vm_ns);
        if let (Some(capture), Some(state)) = (&mut self.events, &c.events) {
            capture.resume(&state.capture)?;
            self.switch_ring = match state.switch_ring {
                Some((gpa, seen)) => Some(
                    introspect::guest_events::SwitchRing::resume(&self.mem, gpa, seen)
                        .map_err(|why| VmError::Restore(format!("context-switch ring: {why}")))?,
                ),
                None => None,
            };
            if let (Some(stacks), Some(processes)) = (&mut self.stacks, &state.processes) {
                stacks.restore(processes);
            }
        }
        // The exit was checked when the checkpoint was taken: what follows
        // it is delivered now.
        self.at_delivery_point = true;
        self.restored = Some(((c.exit, digest), shadow));
        Ok(CheckpointRestored {
            exit: c.exit,
            guest_ns: c.log.guest_ns,
            chain: chain.len(),
            took_ns: started.elapsed().as_nanos() as u64,
        })
    }
}

/// Checks what a checkpoint says against this VM before any of it is
/// used: memory size, page numbers and lengths, the devices it has.
fn check_shape(c: &Checkpoint, ram: usize, block: bool, net: bool) -> Result<(), VmError> {
    check_memory(c, ram)?;
    let refuse = |why: String| {
        Err(VmError::Restore(format!(
            "checkpoint at exit {}: {why}",
            c.exit
        )))
    };
    if c.block.is_some() != block || (!block && !c.overlay.is_empty()) {
        return refuse("its disk differs from the trace's".into());
    }
    if c.net.is_some() != net {
        return refuse("its network device differs from the trace's".into());
    }
    Ok(())
}

/// Checks a checkpoint's memory against this VM's: its size, page numbers
/// and lengths.
pub(super) fn check_memory(c: &Checkpoint, ram: usize) -> Result<(), VmError> {
    let refuse = |why: String| {
        Err(VmError::Restore(format!(
            "checkpoint at exit {}: {why}",
            c.exit
        )))
    };
    if c.memory_bytes != ram as u64 {
        return refuse(format!(
            "it is of a guest with {} MiB of memory, this one has {}",
            c.memory_bytes >> 20,
            ram >> 20
        ));
    }
    let pages = ram / PAGE;
    if c.memory.data.len() != c.memory.pages.len() * PAGE {
        return refuse("its pages and their bytes differ in number".into());
    }
    if let Some(p) = c.memory.pages.iter().find(|&&p| p as usize >= pages) {
        return refuse(format!("it holds page {p}, beyond guest memory"));
    }
    Ok(())
}

/// The pages of `mem` that differ from `shadow`, which is brought up to
/// date.
pub(super) fn changed_pages(mem: &vm_memory::GuestMemoryMmap, shadow: &mut [u8]) -> MemoryDelta {
    let mut delta = MemoryDelta::default();
    let mut page = [0u8; PAGE];
    for (i, old) in shadow.chunks_exact_mut(PAGE).enumerate() {
        if mem
            .read_slice(&mut page, GuestAddress((i * PAGE) as u64))
            .is_err()
        {
            continue;
        }
        if page[..] != old[..] {
            old.copy_from_slice(&page);
            delta.pages.push(i as u32);
            delta.data.extend_from_slice(&page);
        }
    }
    delta
}

fn ckpt_err(e: trace::TraceError) -> VmError {
    VmError::Checkpoint(e)
}
