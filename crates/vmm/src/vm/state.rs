//! The machine's state as checkpoints and boot snapshots store it
//! (`trace::checkpoints` frames it; docs/trace-format.md): the vCPU as
//! KVM describes it, guest memory as pages, the devices, and what the VMM
//! itself keeps about the run.

use devices::cow_disk::SectorRun;
use devices::platform::PlatformState;
use devices::virtio_9p::NinePState;
use devices::virtio_blk::BlockState;
use devices::virtio_console::ConsoleState;
use devices::virtio_net::NetState;
use kvm_bindings::{
    kvm_debugregs, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave, Msrs,
};
use serde::{Deserialize, Serialize};
use trace::checkpoints::Digest32;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::{kvm_err, ExitCounts, Machine, Vcpu, Vm, VmClock, VmError};
use journal::LogPosition;

/// A page of guest memory, as checkpoints store them.
const PAGE: usize = introspect::gva::PAGE_SIZE as usize;

/// What the asynchronous points came to in a run: counts shown with its
/// outcome, and stored with the machine so that a replay restored from a
/// checkpoint goes on counting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PointStats {
    /// Asynchronous points recorded, or reached at replay.
    pub points: u64,
    /// Kicks at a position replay could not find again: the next kick
    /// tries again.
    pub declined: u64,
    /// Recording: points taken at the task's next pass over the position
    /// where it resumed, because a patch at the kicked one would have
    /// covered it.
    pub advanced: u64,
    /// Replay: trampoline exits whose registers matched.
    pub candidates: u64,
    /// Replay: candidates whose extended state or memory differed.
    pub rejected: u64,
    /// Replay: probe gate exits (events raised, none of them the
    /// recording's exits).
    pub gate_exits: u64,
    /// Host time spent on the points: reading the state and its digests
    /// when recording, searching when replaying.
    pub busy_ns: u64,
}

/// The vCPU as KVM describes it.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub(crate) regs: kvm_regs,
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
pub(crate) struct MemoryDelta {
    pub(crate) pages: Vec<u32>,
    pub(crate) data: Vec<u8>,
}

/// What the VMM itself keeps about the run.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct VmState {
    exits: ExitCounts,
    init_reached_ns: Option<u64>,
    exception_pending: bool,
    resume_rip: Option<u64>,
    stub_area_gpa: Option<u64>,
    pub(crate) point_stats: PointStats,
    /// `/init` was ready: the disk and network devices answer.
    pub(crate) devices_attached: bool,
    /// Where the guest kernel announced its context-switch ring.
    switch_ring_gpa: Option<u64>,
    /// The command's terminal, once `/init` said which.
    terminal: Option<bool>,
}

/// What the event capture had reached, when the replay captured events:
/// a replay restored here goes on capturing with the same numbers, the
/// same threads tracked, and the same objects to unwind stacks by.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct EventsState {
    pub(crate) capture: events::capture::CaptureState,
    /// The guest kernel's context-switch ring: (address, records read).
    pub(crate) switch_ring: Option<(u64, u64)>,
    /// Each process's objects, when stacks are unwound by them.
    pub(crate) processes: Option<unwind::ProcessesState>,
    /// The sampling period (ns) of a replay that sampled at the
    /// recording's marks: a replay that starts here must sample the same
    /// way, or its events would be numbered otherwise than the events
    /// before this checkpoint.
    pub(crate) sample_marks: Option<u64>,
}

/// One checkpoint, as stored; a boot snapshot is one too.
#[derive(Serialize, Deserialize)]
pub(crate) struct Checkpoint {
    /// The deterministic exit it follows.
    pub(crate) exit: u64,
    /// The checkpoint before it in the same replay (exit, digest): its
    /// memory and overlay are changes since that one.
    pub(crate) previous: Option<(u64, Digest32)>,
    pub(crate) log: LogPosition,
    /// VM time (ns since the VM started).
    pub(crate) vm_ns: u64,
    pub(crate) memory_bytes: u64,
    pub(crate) memory: MemoryDelta,
    pub(crate) vcpu: VcpuState,
    pub(crate) platform: PlatformState,
    pub(crate) block: Option<BlockState>,
    pub(crate) overlay: Vec<SectorRun>,
    pub(crate) net: Option<NetState>,
    pub(crate) console: ConsoleState,
    pub(crate) host_files: Option<NinePState>,
    pub(crate) vm: VmState,
    pub(crate) events: Option<EventsState>,
}

/// What a checkpoint, a boot snapshot and a debugger's snapshot put back
/// once guest memory is in place: the vCPU, the devices, and what the VMM
/// keeps about the run, with the VM clock at `vm_ns`.
pub(crate) struct MachineState<'a> {
    pub(crate) vcpu: &'a VcpuState,
    pub(crate) platform: &'a PlatformState,
    pub(crate) block: Option<&'a BlockState>,
    pub(crate) net: Option<&'a NetState>,
    pub(crate) console: &'a ConsoleState,
    pub(crate) host_files: Option<&'a NinePState>,
    pub(crate) vm: &'a VmState,
    pub(crate) vm_ns: u64,
}

impl MachineState<'_> {
    /// Puts it into `m` (a device the machine lacks is left out: the
    /// caller checked the shapes agree).
    pub(crate) fn put_into(&self, m: &mut Machine) -> Result<(), VmError> {
        m.vcpu.restore(self.vcpu, m.vm.cpu.xsave_max_size)?;
        m.vm.platform
            .restore(self.platform)
            .map_err(|e| VmError::Restore(e.into()))?;
        if let (Some(block), Some(state)) = (&mut m.vm.block, self.block) {
            block
                .restore(state)
                .map_err(|e| VmError::Restore(format!("disk: {e}")))?;
        }
        if let (Some(net), Some(state)) = (&mut m.vm.net, self.net) {
            net.restore(state)
                .map_err(|e| VmError::Restore(format!("network: {e}")))?;
        }
        m.vm.console
            .restore(self.console)
            .map_err(|e| VmError::Restore(format!("console: {e}")))?;
        if let (Some(h), Some(state)) = (&mut m.vm.host_files, self.host_files) {
            (h.device.restore(state)).map_err(|e| VmError::Restore(format!("host files: {e}")))?;
        }
        self.vm.restore(&mut m.vm, &mut m.vcpu, self.vm_ns);
        Ok(())
    }
}

impl Checkpoint {
    /// What it puts back besides memory and the disk's overlay.
    pub(crate) fn machine_state(&self) -> MachineState<'_> {
        MachineState {
            vcpu: &self.vcpu,
            platform: &self.platform,
            block: self.block.as_ref(),
            net: self.net.as_ref(),
            console: &self.console,
            host_files: self.host_files.as_ref(),
            vm: &self.vm,
            vm_ns: self.vm_ns,
        }
    }
}

impl Vcpu {
    /// The vCPU's whole state (after `complete_exit`), reading every MSR
    /// in `msrs`.
    pub(crate) fn state(&mut self, msrs: &[u32]) -> Result<VcpuState, VmError> {
        let run = self.fd.get_kvm_run();
        let (if_flag, ready_for_injection) = (run.if_flag, run.ready_for_interrupt_injection);
        let v = &self.fd;
        let mut values = Vec::new();
        for &index in msrs {
            let mut one = one_msr(index, 0, "GET_MSRS")?;
            if let Ok(1) = v.get_msrs(&mut one) {
                values.push((index, one.as_slice()[0].data));
            }
        }
        Ok(VcpuState {
            if_flag,
            ready_for_injection,
            regs: self.regs()?,
            sregs: self.sregs()?,
            xsave: v.get_xsave().map_err(kvm_err("GET_XSAVE"))?,
            xcrs: v.get_xcrs().ok(),
            events: v.get_vcpu_events().map_err(kvm_err("GET_VCPU_EVENTS"))?,
            debugregs: v.get_debug_regs().map_err(kvm_err("GET_DEBUGREGS"))?,
            mp_state: v.get_mp_state().map_err(kvm_err("GET_MP_STATE"))?,
            msrs: values,
        })
    }

    /// Puts back what `state` took; `xsave_max_size` bounds the XSAVE
    /// state KVM is given.
    pub(crate) fn restore(&mut self, s: &VcpuState, xsave_max_size: usize) -> Result<(), VmError> {
        // Registers waiting in `kvm_run` would overwrite the restored ones.
        self.forget_run_copies();
        let v = &self.fd;
        v.set_sregs(&s.sregs).map_err(kvm_err("SET_SREGS"))?;
        if let Some(xcrs) = &s.xcrs {
            v.set_xcrs(xcrs).map_err(kvm_err("SET_XCRS"))?;
        }
        crate::kvm_ext::set_xsave(v, &s.xsave, xsave_max_size).map_err(kvm_err("SET_XSAVE"))?;
        for &(index, data) in &s.msrs {
            let one = one_msr(index, data, "SET_MSRS")?;
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
        let run = self.fd.get_kvm_run();
        run.if_flag = s.if_flag;
        run.ready_for_interrupt_injection = s.ready_for_injection;
        Ok(())
    }
}

fn one_msr(index: u32, data: u64, op: &'static str) -> Result<Msrs, VmError> {
    Msrs::from_entries(&[kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }])
    .map_err(|_| VmError::Kvm {
        op,
        source: kvm_ioctls::Error::new(libc::ENOMEM),
    })
}

impl VmState {
    /// What the VM, its vCPU and the points of the session (`points`)
    /// keep about the run.
    pub(crate) fn of(vm: &Vm, vcpu: &Vcpu, points: PointStats) -> Self {
        VmState {
            exits: vm.exits,
            init_reached_ns: vm.status.init_reached.map(|d| d.as_nanos() as u64),
            exception_pending: vcpu.exception_pending,
            resume_rip: vcpu.resume_rip,
            stub_area_gpa: vm.status.stub_area_gpa,
            point_stats: points,
            devices_attached: vm.status.devices_attached,
            switch_ring_gpa: vm.status.switch_ring_gpa,
            terminal: vm.status.terminal,
        }
    }

    /// Puts it back, and the VM clock at `vm_ns`.
    pub(crate) fn restore(&self, vm: &mut Vm, vcpu: &mut Vcpu, vm_ns: u64) {
        vm.clock = VmClock::resumed_at(vm_ns);
        vm.exits = self.exits;
        vm.status.init_reached = self.init_reached_ns.map(std::time::Duration::from_nanos);
        vcpu.exception_pending = self.exception_pending;
        vcpu.resume_rip = self.resume_rip;
        vcpu.resume_gprs = None;
        vm.status.stub_area_gpa = self.stub_area_gpa;
        vm.status.devices_attached = self.devices_attached;
        vm.status.switch_ring_gpa = self.switch_ring_gpa;
        vm.status.terminal = self.terminal;
    }
}

impl Vm {
    /// Guest memory from zeros and `deltas`, oldest first; returns it as
    /// written, the copy a new set of checkpoints compares with.
    pub(crate) fn load_memory<'a>(
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
}

/// Checks a checkpoint's memory against a guest with `ram` bytes: its
/// size, page numbers and lengths.
pub(crate) fn check_memory(c: &Checkpoint, ram: usize) -> Result<(), VmError> {
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
pub(crate) fn changed_pages(mem: &GuestMemoryMmap, shadow: &mut [u8]) -> MemoryDelta {
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
