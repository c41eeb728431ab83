//! A running VM: KVM objects, guest memory, the legacy platform, and the
//! vCPU loop with its single exit dispatch.
//!
//! Threads: the vCPU runs on its own thread and owns every device; the
//! calling thread only kicks it (a signal) when a timer interrupt is due
//! while the guest runs without exiting. Interrupts are injected from here
//! with `KVM_INTERRUPT`; KVM has no irqchip and no PIT of its own.

use std::io::Write;
use std::time::{Duration, Instant};

use devices::cow_disk::DiskError;
use devices::doorbell::Doorbell;
use devices::virtio_blk::{BlockError, VirtioBlock};
use devices::virtio_net::{NetError, VirtioNet};
use devices::LegacyPlatform;
use events::capture::Capture;
use events::db::DbError;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::GuestMemoryMmap;

use crate::console::ConsoleInput;
use guest::boot::BootError;
use guest::initramfs;
use introspect::guest_events::SwitchRing;
use introspect::xstate::XsaveLayout;
use journal::{Journal, JournalError};

mod checkpoint;
mod complete;
mod dispatch;
mod expand;
mod inputs;
mod interrupts;
mod preempt;
mod replay_events;
mod run;
mod setup;
pub mod snapshot;

pub use checkpoint::{CheckpointEvery, CheckpointRestored, CheckpointTaken, ReplayPoint};
pub use expand::{ExpansionSpec, ExpansionStats, TraceTarget};
pub use guest::{DiskImage, NetSpec, Start, VmSpec};
pub use preempt::PreemptStats;
pub use run::{ExitCounts, NetReport, ProgressFn, RunOutcome, StopReason};

/// The vCPU id of the (only) vCPU.
pub const BOOT_VCPU: u8 = 0;

/// Where the guest's console output goes.
pub type Console = Box<dyn Write + Send>;

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
    #[error("tracing the process: {0}")]
    Expansion(String),
    #[error("cannot restore the checkpoint: {0}")]
    Restore(String),
    #[error("the run's archive has {bytes} bytes; the guest's /init takes at most 4 GiB")]
    ArchiveTooLarge { bytes: usize },
    #[error("the guest's /init asked for the run's archive {why}")]
    BadFetch { why: String },
    #[error("the guest powered off or failed before /init was ready for a boot snapshot")]
    NoSnapshotPoint,
}

pub(super) fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
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
}

impl Default for VmClock {
    fn default() -> Self {
        Self::new()
    }
}

/// A created VM, ready to run.
pub struct Vm {
    // Field order is drop order: the vCPU and VM fds go before the memory
    // they map.
    vcpu: VcpuFd,
    _vm: VmFd,
    _kvm: Kvm,
    mem: GuestMemoryMmap,
    platform: LegacyPlatform<Console>,
    /// The run's archive, for `/init` to fetch.
    archive: Vec<u8>,
    /// `/init` said it is ready: the disk and network devices answer.
    devices_attached: bool,
    /// Where the guest kernel announced its context-switch ring.
    switch_ring_gpa: Option<u64>,
    /// Taking a boot snapshot when `/init` is ready, instead of going on.
    snapshot_builder: Option<snapshot::Builder>,
    clock: VmClock,
    exits: ExitCounts,
    exit_status: Option<u8>,
    init_reached: Option<Duration>,
    /// Where each extended state component lives in an XSAVE area.
    xsave_layout: XsaveLayout,
    /// Size of the largest XSAVE state the guest can enable.
    xsave_max_size: usize,
    /// Host input for the serial console, if attached.
    input: Option<ConsoleInput>,
    /// An exception was injected since the last KVM_RUN: KVM would drop an
    /// interrupt injected alongside it, so interrupts wait for the window.
    exception_pending: bool,
    /// Recording, replay, or neither.
    journal: Journal,
    /// The virtio disk.
    block: Option<VirtioBlock>,
    /// The virtio network device.
    net: Option<VirtioNet>,
    /// Where the guest's events go at replay.
    events: Option<Capture>,
    /// SAMPLE events: host-time period and when the next is due.
    sampling: Option<Sampling>,
    /// The guest kernel's context-switch ring, once announced (replay with
    /// an event capture only).
    switch_ring: Option<SwitchRing>,
    /// What each traced process mapped, for unwinding user stacks by
    /// their call-frame information (replay with events).
    stacks: Option<unwind::Processes>,
    /// Where the guest kernel keeps the top of the current task's kernel
    /// stack, so that samples in the kernel find the user registers.
    kernel_stack_top: Option<u64>,
    /// Rung by device threads when they have something for the guest.
    doorbell: Doorbell,
    /// The last KVM_RUN ended in a deterministic exit, or the vCPU is at an
    /// asynchronous point: under the exit clock the only moments an
    /// interrupt may be injected or input made visible.
    at_delivery_point: bool,
    /// Asynchronous points: taken when recording, searched for at replay.
    preempt: preempt::Preemption,
    /// Called with the journal's counts about twice a second.
    progress: Option<ProgressFn>,
    last_progress: Instant,
    trace_summary: Option<trace::Summary>,
    /// CPUID as given to the guest: (function, index, eax, ebx, ecx, edx).
    guest_cpuid: Vec<(u32, u32, u32, u32, u32, u32)>,
    /// KVM capabilities the run depends on: (capability, value).
    kvm_caps: Vec<(u32, i32)>,
    /// Where the guest resumes after the last VM exit, until the next
    /// KVM_RUN returns: a kick that finds it still there came during the
    /// hypervisor's round trip, not while the guest ran.
    resume_rip: Option<u64>,
    /// The host CPU the vCPU thread is kept on (`crate::host_cpu`).
    host_cpu: Option<usize>,
    /// Replay: checkpoints being taken.
    checkpoints: Option<checkpoint::Taker>,
    /// The checkpoint this VM was restored from (exit, digest), and guest
    /// memory as it restored it: where a new set of checkpoints goes on.
    restored: Option<((u64, trace::checkpoints::Digest32), Vec<u8>)>,
    /// The last KVM_RUN ended in a deterministic exit, checked: a
    /// checkpoint may be taken before anything else happens.
    after_exit: bool,
    /// Replay: where the window ends.
    stop_at: Option<ReplayPoint>,
    /// Replay: a process single-stepped for its instructions and memory
    /// accesses.
    expansion: Option<expand::Expansion>,
}

/// Return addresses a SAMPLE, or a lock event, keeps.
const MAX_STACK_FRAMES: usize = 32;

struct Sampling {
    period_ns: u64,
    next_ns: u64,
    /// An interrupt or exception was injected for the next KVM_RUN: the
    /// vCPU starts it in the guest kernel.
    injected: bool,
}

impl Vm {
    /// Keeps the vCPU thread on host CPU `cpu` (`crate::host_cpu`).
    pub fn run_on_host_cpu(&mut self, cpu: usize) {
        self.host_cpu = Some(cpu);
    }

    /// CPUID as the guest sees it in kernel mode.
    pub fn guest_cpuid(&self) -> &[(u32, u32, u32, u32, u32, u32)] {
        &self.guest_cpuid
    }

    /// The KVM capabilities recordings depend on, with their values.
    pub fn kvm_caps(&self) -> &[(u32, i32)] {
        &self.kvm_caps
    }

    /// Whether the guest has a network device.
    pub fn has_net(&self) -> bool {
        self.net.is_some()
    }

    /// Also hands every Ethernet frame the guest transmits to `capture`.
    pub fn capture_net_tx(&mut self, capture: devices::virtio_net::FrameSink) {
        if let Some(net) = &mut self.net {
            net.capture_tx(capture);
        }
    }

    /// Records or replays this run (before `run`).
    pub fn set_journal(&mut self, journal: Journal) {
        self.journal = journal;
    }

    /// Reports progress while the run goes on.
    pub fn on_progress(&mut self, progress: ProgressFn) {
        self.progress = Some(progress);
    }

    /// Feeds host input to the guest's serial console.
    pub fn attach_input(&mut self, input: ConsoleInput) {
        self.input = Some(input);
    }
}
