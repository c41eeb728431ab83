//! The machine: the VM (KVM's VM object, guest memory, the legacy
//! platform and the virtio devices, the VM clock) and its vCPU
//! ([`Vcpu`]), the single exit dispatch that routes what the guest does to
//! the devices, and what KVM cannot complete on its own.
//!
//! Nothing here knows whether the run is recorded or replayed: the
//! sessions (`crate::session`) drive the machine and attach there.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devices::cow_disk::DiskError;
use devices::doorbell::Doorbell;
use devices::host_files::HostFiles;
use devices::virtio_9p::Virtio9p;
use devices::virtio_blk::{BlockError, VirtioBlock};
use devices::virtio_console::VirtioConsole;
use devices::virtio_net::{NetError, VirtioNet};
use devices::LegacyPlatform;
use events::db::DbError;
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::console::ConsoleInput;
use guest::boot::BootError;
use guest::config::ConsoleKind;
use guest::initramfs;
use introspect::xstate::XsaveLayout;
use journal::JournalError;

mod complete;
pub(crate) mod dispatch;
mod machine;
mod setup;
pub(crate) mod state;
mod vcpu;

pub(crate) use dispatch::GuestMsrs;
pub use machine::Machine;
pub(crate) use machine::StreamWritten;
pub use state::VcpuState;
pub use vcpu::Vcpu;
pub(crate) use vcpu::{Claimed, Resumed};

/// The vCPU id of the (only) vCPU.
pub const BOOT_VCPU: u8 = 0;

/// Where the guest's console output goes.
pub type Console = Box<dyn Write + Send>;

/// The console output both terminals of the guest write to, the UART
/// (kernel messages, or the command's output with `console = "serial"`)
/// and the virtio console, in the order they write.
#[derive(Clone)]
pub struct ConsoleSink(Arc<Mutex<Console>>);

impl ConsoleSink {
    pub(crate) fn new(out: Console) -> Self {
        ConsoleSink(Arc::new(Mutex::new(out)))
    }
}

impl Write for ConsoleSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self.0.lock() {
            Ok(mut out) => out.write(buf),
            Err(_) => Err(std::io::Error::other("the console's writer panicked")),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self.0.lock() {
            Ok(mut out) => out.write_all(buf),
            Err(_) => Err(std::io::Error::other("the console's writer panicked")),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self.0.lock() {
            Ok(mut out) => out.flush(),
            Err(_) => Err(std::io::Error::other("the console's writer panicked")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm (is KVM available and accessible?)")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("KVM {op} failed")]
    Kvm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("cannot allocate {mib} MiB of guest memory")]
    Memory { mib: u64 },
    #[error(transparent)]
    Boot(#[from] BootError),
    #[error("cannot add files to the guest")]
    Files(#[from] initramfs::InitramfsError),
    #[error("cannot start the vCPU thread")]
    Thread(#[source] std::io::Error),
    #[error("cannot keep the vCPU on host CPU {cpu}")]
    Pin {
        cpu: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("the vCPU thread panicked (a bug in insight; please report it)")]
    VcpuThreadPanicked,
    #[error("stopped by the user (Ctrl-A x)")]
    StoppedByUser,
    /// The guest's user code made no progress for the time limit the run
    /// was given (a hang).
    #[error("no progress in user mode for {:.3} s", limit.as_secs_f64())]
    TimeLimit { limit: Duration },
    #[error("guest {reason} at RIP {rip:#x}{detail}")]
    GuestFault {
        reason: String,
        rip: u64,
        detail: String,
    },
    #[error("guest kernel panicked (its message is in the console output above)")]
    GuestPanic,
    #[error("guest halted with interrupts disabled at RIP {rip:#x}; it can never run again")]
    GuestHalted { rip: u64 },
    #[error(
        "the host's extended CPU state (XCR0 {xcr0:#x}) does not fit KVM's 4 KiB XSAVE buffer"
    )]
    XsaveTooLarge { xcr0: u64 },
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error("disk")]
    Block(#[from] BlockError),
    #[error("network")]
    Net(#[from] NetError),
    #[error("event database")]
    Events(#[from] DbError),
    #[error(transparent)]
    Checkpoint(trace::TraceError),
    /// A checkpoint could not be written: how far the replay got.
    #[error("cannot store the checkpoint at exit {exit} ({stored} stored before it)")]
    StoreCheckpoint {
        exit: u64,
        stored: usize,
        #[source]
        source: trace::TraceError,
    },
    #[error("tracing the process: {0}")]
    Expansion(String),
    #[error("debugging: {0}")]
    Debug(String),
    #[error("cannot restore the checkpoint: {0}")]
    Restore(String),
    #[error("the run's archive has {bytes} bytes; the guest's /init takes at most 4 GiB")]
    ArchiveTooLarge { bytes: usize },
    #[error("the guest's /init asked for the run's archive {why}")]
    BadFetch { why: String },
    #[error("the guest's /init relayed {what} {why}")]
    BadOutput { what: String, why: String },
    #[error("the guest's /init asked for standard input {why}")]
    BadInput { why: String },
    #[error("the guest powered off or failed before /init was ready for a boot snapshot")]
    NoSnapshotPoint,
}

impl VmError {
    /// Whether a damaged file caused it (a checkpoint or boot snapshot
    /// whose bytes are not those written): exit status 3, like a damaged
    /// trace.
    pub fn is_damage(&self) -> bool {
        matches!(self, VmError::Checkpoint(t) if t.is_damage())
    }

    /// Whether replay found the guest doing other than the recording
    /// did.
    pub fn is_divergence(&self) -> bool {
        matches!(self, VmError::Journal(JournalError::Diverged(_)))
    }
}

pub(crate) fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { op, source }
}

/// VM time: nanoseconds since the VM was created, from the host's
/// monotonic clock.
#[derive(Clone, Copy, Debug)]
pub struct VmClock {
    start: Instant,
}

impl VmClock {
    pub fn new() -> Self {
        VmClock {
            start: Instant::now(),
        }
    }

    /// A clock that reads `ns` now (a VM restored from a checkpoint).
    pub fn resumed_at(ns: u64) -> Self {
        let now = Instant::now();
        VmClock {
            start: now.checked_sub(Duration::from_nanos(ns)).unwrap_or(now),
        }
    }

    pub fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// The clock stood still for `paused` (a replay stopped in a
    /// debugger): VM time goes on from where it was.
    pub(crate) fn skip(&mut self, paused: Duration) {
        self.start += paused;
    }
}

impl Default for VmClock {
    fn default() -> Self {
        Self::new()
    }
}

/// The copies to and from user memory the guest kernel handed to the VMM
/// (`Machine::guest_copy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CopyStats {
    /// Copies asked for.
    pub calls: u64,
    /// Bytes the VMM copied.
    pub bytes: u64,
    /// Copies the VMM stopped short of (a page either side could not
    /// reach), whose rest the kernel copied itself.
    pub short: u64,
}

/// Counts of VM exits by kind, and other run statistics.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ExitCounts {
    pub port_io: u64,
    pub mmio: u64,
    pub halts: u64,
    pub msr: u64,
    pub interrupts_injected: u64,
    pub kicks: u64,
    pub emulation_completions: u64,
    /// Copies the guest kernel handed to the VMM.
    pub copies: CopyStats,
}

/// The CPU the guest was given, as recordings name it.
pub struct GuestCpu {
    /// CPUID as given to the guest: (function, index, eax, ebx, ecx, edx).
    pub cpuid: Vec<(u32, u32, u32, u32, u32, u32)>,
    /// KVM capabilities the run depends on: (capability, value).
    pub kvm_caps: Vec<(u32, i32)>,
    /// Where each extended state component lives in an XSAVE area.
    pub xsave_layout: XsaveLayout,
    /// Size of the largest XSAVE state the guest can enable.
    pub xsave_max_size: usize,
}

/// What the guest has said about itself on the control port.
#[derive(Clone, Copy, Debug, Default)]
pub struct GuestStatus {
    /// `/init` said it is ready: the disk and network devices answer.
    pub devices_attached: bool,
    /// VM time at which user space `/init` started.
    pub init_reached: Option<Duration>,
    /// Status of the guest command, once `/init` reported it.
    pub exit_status: Option<u8>,
    /// Where the guest kernel announced its context-switch ring.
    pub switch_ring_gpa: Option<u64>,
    /// Where the guest kernel announced its preemption area (the pages
    /// it maps into every process, `introspect::stub_area`).
    pub stub_area_gpa: Option<u64>,
    /// The command's terminal, once `/init` opened it: the virtio console
    /// (`true`) or the serial console.
    pub terminal: Option<bool>,
}

/// A created VM: everything but the vCPU.
pub struct Vm {
    // Field order is drop order: the VM fd goes before the memory it maps.
    fd: VmFd,
    kvm: Kvm,
    pub(crate) mem: GuestMemoryMmap,
    pub(crate) platform: LegacyPlatform<ConsoleSink>,
    /// The virtio console: always there, used once `/init` attaches it.
    pub(crate) console: VirtioConsole<ConsoleSink>,
    /// The command's terminal on the host side.
    pub(crate) terminal: HostTerminal,
    /// The virtio disk.
    pub(crate) block: Option<VirtioBlock>,
    /// The virtio network device.
    pub(crate) net: Option<VirtioNet>,
    /// The host's files (virtio 9P).
    pub(crate) host_files: Option<HostFilesDevice>,
    /// Rung by device threads when they have something for the guest.
    pub(crate) doorbell: Doorbell,
    pub(crate) clock: VmClock,
    pub(crate) exits: ExitCounts,
    pub(crate) cpu: GuestCpu,
    pub(crate) status: GuestStatus,
    /// The run's archive, for `/init` to fetch.
    pub(crate) archive: Vec<u8>,
}

/// The host's files' device, and what serves them when the run reads the
/// host (not at replay, where the log answers).
pub(crate) struct HostFilesDevice {
    pub(crate) device: Virtio9p,
    pub(crate) server: Option<HostFiles>,
}

/// The host's standard output and error, for what `/init` relays of the
/// command's (`ControlMessage::Output`); either unset writes to the
/// console.
#[derive(Default)]
pub struct HostStreams {
    pub out: Option<Console>,
    pub err: Option<Console>,
    /// Writes to them that failed (the guest saw them succeed).
    pub errors: u64,
    /// The command's standard input where it is a pipe in the guest
    /// (`ControlMessage::Input`): the host's, or none for an empty one.
    pub input: Option<ConsoleInput>,
}

/// The command's terminal as the host sees it: which guest device it is,
/// the host input that goes there, and the host terminal's size.
pub(crate) struct HostTerminal {
    /// Where the command's standard output and error go on the host
    /// where they are pipes in the guest.
    pub(crate) streams: HostStreams,
    /// The guest device that is the command's terminal: where host input
    /// goes.
    pub(crate) kind: ConsoleKind,
    /// Host input for the console, if attached.
    pub(crate) input: Option<ConsoleInput>,
    /// The host terminal's size (columns, rows), once known: the virtio
    /// console's driver is told it at the next delivery point.
    pub(crate) size: Option<(u16, u16)>,
}

impl Vm {
    /// KVM's VM object.
    pub(crate) fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// Every MSR KVM lists for a vCPU.
    pub(crate) fn msr_index_list(&self) -> Result<Vec<u32>, VmError> {
        let listed = self
            .kvm
            .get_msr_index_list()
            .map_err(kvm_err("GET_MSR_INDEX_LIST"))?;
        Ok(listed.as_slice().to_vec())
    }

    /// CPUID as the guest sees it in kernel mode.
    pub fn guest_cpuid(&self) -> &[(u32, u32, u32, u32, u32, u32)] {
        &self.cpu.cpuid
    }

    /// The KVM capabilities recordings depend on, with their values.
    pub fn kvm_caps(&self) -> &[(u32, i32)] {
        &self.cpu.kvm_caps
    }

    /// Whether the guest has a network device.
    pub fn has_net(&self) -> bool {
        self.net.is_some()
    }

    /// The size of guest RAM in bytes.
    pub(crate) fn ram_bytes(&self) -> usize {
        self.mem.iter().map(|r| r.len() as usize).sum()
    }
}

/// Guest memory with user code mapped, for the tests of the code that
/// reads it (points, tools).
#[cfg(test)]
pub(crate) mod test_memory {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    /// User code at 0x40_0000: CR3 0x1000 -> PDPT 0x2000 -> PD 0x3000,
    /// one 2 MiB user page at physical 0x20_0000.
    pub(crate) fn user_code(code: &[u8]) -> GuestMemoryMmap {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        m.write_obj(0x2000u64 | 7, GuestAddress(0x1000)).unwrap();
        m.write_obj(0x3000u64 | 7, GuestAddress(0x2000)).unwrap();
        m.write_obj(0x20_0000u64 | 0x87, GuestAddress(0x3000 + 2 * 8))
            .unwrap();
        m.write_slice(code, GuestAddress(0x20_0000)).unwrap();
        m
    }
}
