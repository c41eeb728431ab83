//! Snapshots of a replay kept in memory, for going back: the whole
//! machine (vCPU, memory, devices, the VMM's own state), where the log
//! is, and what the debugger's engine knew of the tasks, taken right
//! after a deterministic exit where nothing is half done, and put back
//! into the same machine; and the clock that says when one is due.
//!
//! Memory is kept as pages shared between snapshots: a snapshot holds the
//! pages that changed since the one before (found by comparing with it)
//! and shares the rest, so a snapshot costs the pages the guest wrote in
//! between. Putting one back writes only the pages that differ.

use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::platform::PlatformState;
use devices::virtio_9p::NinePState;
use devices::virtio_console::ConsoleState;
use devices::virtio_net::NetState;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::tools::control::tasks::Tasks;
use crate::vm::state::PointStats;
use crate::vm::state::{MachineState, VcpuState, VmState};
use crate::vm::{Machine, VmError};
use journal::LogPosition;

/// When the replay pauses for a snapshot.
#[derive(Default)]
pub(crate) struct SnapshotClock {
    /// How often the driver wants one (host time).
    pub(crate) every: Option<Duration>,
    /// When it took the last.
    last: Option<Instant>,
    /// The replay paused for one.
    pub(crate) due: bool,
}

impl SnapshotClock {
    /// A snapshot was taken (or restored) now.
    pub(crate) fn taken(&mut self) {
        self.last = Some(Instant::now());
        self.due = false;
    }

    /// Before a run (`after_exit`: right after a checked exit): whether
    /// one is due here.
    pub(crate) fn due(&mut self, after_exit: bool) -> bool {
        self.due = after_exit
            && self
                .every
                .is_some_and(|every| self.last.is_none_or(|t| t.elapsed() >= every));
        self.due
    }
}

const PAGE: usize = introspect::gva::PAGE_SIZE as usize;

/// Guest memory as pages, each shared with the images it is the same in.
#[derive(Clone)]
pub(crate) struct PageImage {
    pages: Vec<Arc<[u8; PAGE]>>,
}

impl PageImage {
    /// `mem` as it is now, sharing the pages that are the same as in
    /// `previous`.
    fn take(mem: &GuestMemoryMmap, ram: usize, previous: Option<&PageImage>) -> Self {
        let zero: Arc<[u8; PAGE]> = Arc::new([0u8; PAGE]);
        let mut pages = Vec::with_capacity(ram / PAGE);
        let mut buf = [0u8; PAGE];
        for i in 0..ram / PAGE {
            if mem
                .read_slice(&mut buf, GuestAddress((i * PAGE) as u64))
                .is_err()
            {
                pages.push(Arc::clone(&zero));
                continue;
            }
            match previous.and_then(|p| p.pages.get(i)) {
                Some(old) if old[..] == buf[..] => pages.push(Arc::clone(old)),
                _ if buf == [0u8; PAGE] => pages.push(Arc::clone(&zero)),
                _ => pages.push(Arc::new(buf)),
            }
        }
        PageImage { pages }
    }

    /// Writes into `mem` every page that differs from this image; how
    /// many.
    fn put_back(&self, mem: &GuestMemoryMmap) -> Result<usize, VmError> {
        let mut buf = [0u8; PAGE];
        let mut written = 0;
        for (i, page) in self.pages.iter().enumerate() {
            let at = GuestAddress((i * PAGE) as u64);
            mem.read_slice(&mut buf, at)
                .map_err(|_| VmError::Restore("guest memory cannot be read".into()))?;
            if buf[..] != page[..] {
                mem.write_slice(&page[..], at)
                    .map_err(|_| VmError::Restore("guest memory cannot be written".into()))?;
                written += 1;
            }
        }
        Ok(written)
    }
}

/// A replay's complete state at one moment, in memory.
pub struct Snapshot {
    pub(crate) ordinal: u64,
    pub(crate) log: LogPosition,
    pub(crate) vm_ns: u64,
    pub(crate) memory: PageImage,
    pub(crate) vcpu: VcpuState,
    pub(crate) platform: PlatformState,
    pub(crate) net: Option<NetState>,
    pub(crate) console: ConsoleState,
    pub(crate) host_files: Option<NinePState>,
    pub(crate) vm: VmState,
    pub(crate) tasks: Tasks,
}

impl Snapshot {
    /// The deterministic exits and asynchronous points replayed when it
    /// was taken.
    pub fn ordinal(&self) -> u64 {
        self.ordinal
    }

    /// Takes the machine's state (right after a deterministic exit, at
    /// rest, breakpoints out of memory), sharing pages with `previous`.
    pub(crate) fn take(
        m: &mut Machine,
        ordinal: u64,
        log: LogPosition,
        points: PointStats,
        tasks: &Tasks,
        previous: Option<&Snapshot>,
    ) -> Result<Self, VmError> {
        if m.vm.block.is_some() {
            return Err(VmError::Debug(
                "going back in a guest with a disk is not supported: its overlay is not kept"
                    .into(),
            ));
        }
        m.vcpu.complete_exit()?;
        let msrs = m.vm.msr_index_list()?;
        let vcpu = m.vcpu.state(&msrs)?;
        let ram = m.vm.ram_bytes();
        let memory = PageImage::take(&m.vm.mem, ram, previous.map(|p| &p.memory));
        Ok(Snapshot {
            ordinal,
            log,
            vm_ns: m.vm.clock.now_ns(),
            memory,
            vcpu,
            platform: m.vm.platform.state(),
            net: m.vm.net.as_ref().map(|n| n.state()),
            console: m.vm.console.state(),
            host_files: m.vm.host_files.as_ref().map(|h| h.device.state()),
            vm: VmState::of(&m.vm, &m.vcpu, points),
            tasks: tasks.clone(),
        })
    }

    /// Puts the machine back as it was (breakpoints out of memory); the
    /// log position and the rest are the caller's to put back.
    pub(crate) fn restore(&self, m: &mut Machine) -> Result<(), VmError> {
        // KVM finishes the instruction of the last exit at the next
        // KVM_RUN (its emulator keeps that instruction's context), over
        // whatever registers were set since: it finishes it now.
        m.vcpu.complete_exit()?;
        self.memory.put_back(&m.vm.mem)?;
        crate::kvm_ext::forget_guest_mappings(m.vm.fd(), &m.vm.mem)
            .map_err(|e| VmError::Restore(format!("KVM would keep stale guest mappings: {e}")))?;
        MachineState {
            vcpu: &self.vcpu,
            platform: &self.platform,
            // Refused when taken: a guest with a disk is not snapshotted.
            block: None,
            net: self.net.as_ref(),
            console: &self.console,
            host_files: self.host_files.as_ref(),
            vm: &self.vm,
            vm_ns: self.vm_ns,
        }
        .put_into(m)?;
        // Right after the exit it was taken at: what follows is delivered
        // next.
        m.vcpu.at_delivery_point = true;
        m.vcpu.after_exit = false;
        Ok(())
    }
}
