//! A running VM: KVM objects, guest memory, the legacy platform, and the
//! vCPU loop with its single exit dispatch.
//!
//! Threads: the vCPU runs on its own thread and owns every device; the
//! calling thread only kicks it (a signal) when a timer interrupt is due
//! while the guest runs without exiting. Interrupts are injected from here
//! with `KVM_INTERRUPT`; KVM has no irqchip and no PIT of its own.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use devices::control::EventRaiser;
use devices::cow_disk::{CowDisk, DiskError};
use devices::doorbell::Doorbell;
use devices::virtio_blk::{self, BlockError, BlockStats, VirtioBlock};
use devices::virtio_net::{self, NetBackend, NetError, NetStats, VirtioNet};
use devices::{ControlMessage, LegacyPlatform, PlatformStats};
use events::abi::Source;
use events::capture::{Capture, CaptureSummary};
use events::db::DbError;
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::boot::{self, BootError};
use crate::console::ConsoleInput;
use crate::emulation::{self, Completion};
use crate::guest_events::{self, SwitchRing};
use crate::gva;
use crate::journal::{self, EndReason, Entry, Input, Journal, JournalError, Progress};
use crate::kvm_ext;
use crate::xstate::{self, XOp, XsaveLayout, XstateFault};
use crate::{cpuid, initramfs};

mod capture;
mod dispatch;
mod emulate;

use dispatch::{dispatch, Bus};

/// KVM_INTERNAL_ERROR_EMULATION.
const INTERNAL_ERROR_EMULATION: u32 = 1;
/// Longest x86 instruction.
const MAX_INSN_LEN: usize = 15;
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
}

fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { op, source }
}

/// Why the guest stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `/init` reported the guest command's exit status (after syncing):
    /// the run is over, nothing the guest does later can matter.
    CommandExited,
    /// The guest kernel powered off.
    PowerOff,
    /// Replay reached the point where the recording ended for a reason
    /// outside the guest (the user stopped it, the recorder failed).
    RecordingEnded(EndReason),
    /// Replay of an incomplete trace reached the end of its log.
    TraceEnded,
}

/// Counts of VM exits by kind, and other run statistics.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExitCounts {
    pub port_io: u64,
    pub mmio: u64,
    pub halts: u64,
    pub msr: u64,
    pub interrupts_injected: u64,
    pub kicks: u64,
    pub emulation_completions: u64,
}

/// The result of a guest run that ended by the guest's own choice.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub stop: StopReason,
    /// Status of the guest command, if `/init` reported one.
    pub exit_status: Option<u8>,
    /// VM time at which user space `/init` started.
    pub init_reached: Option<Duration>,
    /// VM time at the end.
    pub elapsed: Duration,
    pub exits: ExitCounts,
    pub platform: PlatformStats,
    /// Deterministic exits, log entries, guest time, trace size.
    pub journal: Progress,
    /// The virtio disk's counts, if the guest has one.
    pub disk: Option<BlockStats>,
    /// The network device's counts, if the guest has one.
    pub net: Option<NetReport>,
    /// The finished trace, when recording.
    pub trace: Option<trace::Summary>,
    /// What the event capture stored, when replaying with one.
    pub events: Option<CaptureSummary>,
}

/// How the network device fared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetReport {
    pub stats: NetStats,
    /// Why the TAP device stopped working, if it did.
    pub failure: Option<String>,
}

/// Everything needed to boot a VM.
#[derive(Debug)]
pub struct VmSpec {
    /// Where the kernel came from, and its content as read once: what is
    /// digested for a trace is what boots.
    pub kernel: PathBuf,
    pub kernel_image: Vec<u8>,
    /// The base initramfs image, followed by archives generated at boot.
    pub initramfs: Vec<u8>,
    /// How many bytes of `initramfs` are the base image.
    pub initramfs_base_len: usize,
    /// Where the base initramfs image came from.
    pub initramfs_path: PathBuf,
    /// The archive appended to it (already part of `initramfs`).
    pub extra_initramfs: Vec<u8>,
    /// Base image of the virtio disk, if the guest has one.
    pub disk: Option<DiskImage>,
    /// The virtio network device, if the guest has one.
    pub net: Option<NetSpec>,
    pub cmdline: String,
    pub memory_mib: u64,
    /// Seed for the guest kernel's random number generator.
    pub rng_seed: [u8; boot::RNG_SEED_LEN],
}

/// The base image of the guest's disk, opened once: the file a trace's
/// digest was computed from is the file the guest reads.
#[derive(Debug)]
pub struct DiskImage {
    pub path: PathBuf,
    pub file: std::fs::File,
}

/// The guest's network device.
#[derive(Clone, Debug)]
pub struct NetSpec {
    pub mac: [u8; 6],
    /// The host TAP device and the address to give it; `None` at replay,
    /// where received frames come from the log and sent ones go nowhere.
    pub tap: Option<(String, Option<crate::config::Ipv4Net>)>,
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

    pub fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }
}

impl Default for VmClock {
    fn default() -> Self {
        Self::new()
    }
}

/// State the vCPU thread shares with the thread that kicks it.
struct KickState {
    /// VM time at which the vCPU must be out of KVM_RUN (u64::MAX: none).
    deadline_ns: AtomicU64,
    done: AtomicBool,
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
    /// Rung by device threads when they have something for the guest.
    doorbell: Doorbell,
    /// The last KVM_RUN ended in a deterministic exit: under the exit clock
    /// the only moment an interrupt may be injected.
    at_deterministic_exit: bool,
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
}

/// Receives progress counts while a recording or replay runs.
pub type ProgressFn = Box<dyn FnMut(&Progress) + Send>;

/// How often the progress callback runs.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);

/// Under the exit clock the kick thread only wakes the vCPU for
/// housekeeping (progress, flushing the trace, the user's stop key).
const HOUSEKEEPING_NS: u64 = 100_000_000;

/// Return addresses a SAMPLE keeps.
const MAX_SAMPLE_FRAMES: usize = 32;

struct Sampling {
    period_ns: u64,
    next_ns: u64,
}

/// What the vCPU loop does after an exit.
enum Next {
    Continue,
    WaitForInterrupt,
    InternalError,
    /// The guest cannot continue: what happened, and details.
    Fault(String, String),
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Nothing to do: the signal's only job is to make KVM_RUN return.
}

impl Vm {
    /// Creates the VM, loads the guest and sets the boot vCPU's registers.
    pub fn new(spec: &VmSpec, console: Console) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let vm = kvm.create_vm().map_err(kvm_err("CREATE_VM"))?;
        vm.set_tss_address(0xfffb_d000)
            .map_err(kvm_err("SET_TSS_ADDR"))?;

        let ram_size = spec.memory_mib << 20;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), ram_size as usize)])
            .map_err(|_| VmError::Memory {
                mib: spec.memory_mib,
            })?;
        kvm_ext::map_guest_memory(&vm, &mem).map_err(kvm_err("SET_USER_MEMORY_REGION"))?;

        let layout = boot::load_guest(
            &mem,
            ram_size,
            &spec.kernel,
            &spec.kernel_image,
            &spec.initramfs,
            &spec.cmdline,
            &spec.rng_seed,
        )?;

        let vcpu = vm
            .create_vcpu(u64::from(BOOT_VCPU))
            .map_err(kvm_err("CREATE_VCPU"))?;
        let cpuid = cpuid::apply(&kvm, &vcpu).map_err(kvm_err("SET_CPUID2"))?;
        let xsave_layout = XsaveLayout::from_cpuid(
            cpuid
                .iter()
                .filter(|e| e.function == 0xd)
                .map(|e| (e.index, e.eax, e.ebx)),
        );
        let guest_cpuid = cpuid
            .as_slice()
            .iter()
            .map(|e| (e.function, e.index, e.eax, e.ebx, e.ecx, e.edx))
            .collect();
        let kvm_caps = [
            kvm_bindings::KVM_CAP_X86_USER_SPACE_MSR,
            kvm_bindings::KVM_CAP_SYNC_REGS,
            kvm_bindings::KVM_CAP_XSAVE,
            kvm_bindings::KVM_CAP_IMMEDIATE_EXIT,
        ]
        .iter()
        .map(|&c| (c, vm.check_extension_raw(u64::from(c))))
        .collect();
        let supported_xcr0 = cpuid
            .iter()
            .find(|e| (e.function, e.index) == (0xd, 0))
            .map(|e| u64::from(e.eax) | (u64::from(e.edx) << 32))
            .unwrap_or(0b11);
        let xsave_max_size =
            xsave_layout
                .area_size(supported_xcr0)
                .ok_or(VmError::XsaveTooLarge {
                    xcr0: supported_xcr0,
                })?;

        // MSRs KVM does not know exit to the VMM (the paravirtual clock),
        // and so does the TSC MSR, which KVM would answer with host time.
        let mut cap = kvm_bindings::kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_X86_USER_SPACE_MSR,
            ..Default::default()
        };
        cap.args[0] = u64::from(
            kvm_bindings::KVM_MSR_EXIT_REASON_UNKNOWN | kvm_bindings::KVM_MSR_EXIT_REASON_FILTER,
        );
        vm.enable_cap(&cap)
            .map_err(kvm_err("ENABLE_CAP(X86_USER_SPACE_MSR)"))?;
        vm.set_msr_filter(
            kvm_ioctls::MsrFilterDefaultAction::ALLOW,
            &[kvm_ioctls::MsrFilterRange {
                flags: kvm_ioctls::MsrFilterRangeFlags::READ
                    | kvm_ioctls::MsrFilterRangeFlags::WRITE,
                base: journal::MSR_IA32_TSC,
                msr_count: 1,
                bitmap: &[0],
            }],
        )
        .map_err(kvm_err("X86_SET_MSR_FILTER"))?;

        let mut vcpu = vcpu;
        // Registers come with every exit in kvm_run, for the journal.
        vcpu.set_sync_valid_reg(kvm_ioctls::SyncReg::Register);
        let sregs = vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        vcpu.set_sregs(&boot::boot_sregs(sregs))
            .map_err(kvm_err("SET_SREGS"))?;
        vcpu.set_regs(&boot::boot_regs(layout.entry))
            .map_err(kvm_err("SET_REGS"))?;
        vcpu.set_fpu(&boot::boot_fpu())
            .map_err(kvm_err("SET_FPU"))?;

        let doorbell = Doorbell::new();
        let block = match &spec.disk {
            Some(base) => {
                let file = base.file.try_clone().map_err(|source| DiskError::Open {
                    path: base.path.clone(),
                    source,
                })?;
                Some(VirtioBlock::new(
                    CowDisk::over(file, &base.path, &std::env::temp_dir())?,
                    doorbell.clone(),
                )?)
            }
            None => None,
        };
        let net = match &spec.net {
            Some(n) => {
                let backend = match &n.tap {
                    Some((name, host_address)) => NetBackend::Tap {
                        name: name.clone(),
                        host_address: *host_address,
                    },
                    None => NetBackend::None,
                };
                Some(VirtioNet::new(n.mac, backend, doorbell.clone())?)
            }
            None => None,
        };

        let boot_unix_secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Ok(Vm {
            vcpu,
            _vm: vm,
            _kvm: kvm,
            mem,
            platform: LegacyPlatform::new(boot_unix_secs, console),
            clock: VmClock::new(),
            resume_rip: None,
            exits: ExitCounts::default(),
            exit_status: None,
            init_reached: None,
            xsave_layout,
            xsave_max_size,
            input: None,
            exception_pending: false,
            journal: Journal::Live,
            block,
            net,
            doorbell,
            at_deterministic_exit: false,
            progress: None,
            last_progress: Instant::now(),
            trace_summary: None,
            events: None,
            sampling: None,
            switch_ring: None,
            guest_cpuid,
            kvm_caps,
        })
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

    /// Moves pending host input into the UART, as far as its FIFO has room.
    /// Input waits until `/init` runs: the console tty is open by then, and
    /// the kernel's serial driver resets the FIFO while it starts.
    fn feed_input(&mut self) -> Result<(), VmError> {
        let Some(input) = &self.input else {
            return Ok(());
        };
        if input.quit_requested() {
            return Err(VmError::StoppedByUser);
        }
        if self.init_reached.is_none() {
            return Ok(());
        }
        let bytes = input.take(self.platform.serial.input_room());
        if !bytes.is_empty() {
            self.platform.receive_input(&bytes);
        }
        Ok(())
    }

    /// Runs the guest until it powers off or fails. The vCPU runs on a
    /// thread of its own; this thread kicks it when timers come due.
    pub fn run(self) -> Result<RunOutcome, VmError> {
        register_signal_handler(SIGRTMIN(), on_kick).map_err(|e| VmError::Kvm {
            op: "signal handler registration",
            source: e,
        })?;
        let kick = Arc::new(KickState {
            deadline_ns: AtomicU64::new(u64::MAX),
            done: AtomicBool::new(false),
        });
        let clock = self.clock;
        let shared = Arc::clone(&kick);
        let handle = std::thread::Builder::new()
            .name("vcpu0".into())
            .spawn(move || {
                let mut vm = self;
                let result = vm.run_vcpu(&shared);
                let result = vm.end_journal(result);
                let result = vm.end_events(result);
                let result = vm.describe_divergence(result);
                shared.done.store(true, Ordering::Release);
                result
            })
            .map_err(VmError::Thread)?;

        while !kick.done.load(Ordering::Acquire) {
            let now = clock.now_ns();
            let deadline = kick.deadline_ns.load(Ordering::Acquire);
            if deadline <= now {
                // A kick that lands while the vCPU is outside KVM_RUN is
                // harmless; the next one follows within a millisecond.
                let _ = handle.kill(SIGRTMIN());
                std::thread::sleep(Duration::from_millis(1));
            } else {
                let wait = (deadline - now).min(5_000_000);
                std::thread::sleep(Duration::from_nanos(wait));
            }
        }
        handle.join().unwrap_or(Err(VmError::VcpuThreadPanicked))
    }

    fn run_vcpu(&mut self, kick: &KickState) -> Result<RunOutcome, VmError> {
        loop {
            self.feed_input()?;
            let now = self.clock.now_ns();
            self.platform.advance_to(now);
            self.housekeeping()?;
            if let Journal::Replay(r) = &mut self.journal {
                if let Some(reason) = r.end_reached()? {
                    return Ok(self.outcome(StopReason::RecordingEnded(reason)));
                }
                if r.log_exhausted()? {
                    return Ok(self.outcome(StopReason::TraceEnded));
                }
            }
            self.publish_inputs()?;
            self.inject_interrupts()?;
            let deadline = if self.journal.exit_clock() {
                let sample = self.sampling.as_ref().map_or(u64::MAX, |s| s.next_ns);
                (now + HOUSEKEEPING_NS).min(sample)
            } else {
                self.platform.next_timer_ns().unwrap_or(u64::MAX)
            };
            kick.deadline_ns.store(deadline, Ordering::Release);

            let resumed_at = self.resume_rip.take();
            let (next, observed) = match self.vcpu.run() {
                Ok(exit) => dispatch(
                    &mut Bus {
                        platform: &mut self.platform,
                        block: self.block.as_mut(),
                        net: self.net.as_mut(),
                        mem: &self.mem,
                    },
                    &mut self.journal,
                    &self.clock,
                    &mut self.exits,
                    BOOT_VCPU,
                    exit,
                )?,
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    self.exits.kicks += 1;
                    (Next::Continue, None)
                }
                Err(e) => return Err(kvm_err("RUN")(e)),
            };
            self.at_deterministic_exit = observed.is_some();
            if observed.is_none() && self.sampling.is_some() {
                // A kick: the guest stopped wherever it was, which is
                // what a sample wants (exits would bias it).
                self.take_sample(resumed_at)?;
            }
            if let Some(event) = observed {
                // KVM raises #GP for a refused MSR access when the vCPU
                // resumes; an interrupt injected with it would reach the
                // guest at a point that depends on timing.
                if matches!(
                    event,
                    Entry::RdMsr { fault: true, .. } | Entry::WrMsr { fault: true, .. }
                ) {
                    self.exception_pending = true;
                }
                let regs = self.vcpu.sync_regs().regs;
                self.resume_rip = Some(regs.rip);
                self.journal.exit(event.with_rip(regs.rip), &regs)?;
                // Switches before this exit come before what it raises.
                self.drain_switches()?;
            }
            // Messages from the guest's control port.
            for message in self.platform.take_messages() {
                match message {
                    ControlMessage::InitReached => {
                        self.init_reached = Some(Duration::from_nanos(self.clock.now_ns()))
                    }
                    ControlMessage::ExitStatus(s) => {
                        self.exit_status = Some(s);
                        self.journal.replay_end(&EndReason::CommandExited(s))?;
                        return Ok(self.outcome(StopReason::CommandExited));
                    }
                    ControlMessage::PowerOff => {
                        self.journal.replay_end(&EndReason::PowerOff)?;
                        return Ok(self.outcome(StopReason::PowerOff));
                    }
                    ControlMessage::Panic => return Err(VmError::GuestPanic),
                    ControlMessage::Event(raiser) => self.guest_event(raiser)?,
                    ControlMessage::SwitchRing => self.attach_switch_ring(),
                    ControlMessage::Sync | ControlMessage::Unknown(_) => {}
                }
            }
            match next {
                Next::Continue => {}
                Next::WaitForInterrupt if self.journal.is_replay() => {
                    // Idle time is skipped: the interrupt that ended it is
                    // due at once.
                    if self.vcpu.get_kvm_run().if_flag == 0 {
                        let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                        return Err(VmError::GuestHalted { rip });
                    }
                    if !self.journal.replay_wakeup_due()? {
                        // An incomplete trace may end right after the HLT.
                        if let Journal::Replay(r) = &mut self.journal {
                            if r.log_exhausted()? {
                                return Ok(self.outcome(StopReason::TraceEnded));
                            }
                        }
                        let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                        return Err(self.journal.halted_without_interrupt(rip).into());
                    }
                }
                Next::WaitForInterrupt => self.wait_for_interrupt()?,
                Next::InternalError => self.complete_unemulated()?,
                Next::Fault(reason, detail) => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(VmError::GuestFault {
                        reason,
                        rip,
                        detail,
                    });
                }
            }
        }
    }

    fn outcome(&mut self, stop: StopReason) -> RunOutcome {
        let _ = self.platform.serial.writer_mut().flush();
        RunOutcome {
            stop,
            exit_status: self.exit_status,
            init_reached: self.init_reached,
            elapsed: Duration::from_nanos(self.clock.now_ns()),
            exits: self.exits,
            platform: self.platform.stats(),
            journal: self.journal.progress(),
            trace: self.trace_summary,
            disk: self.block.as_ref().map(|b| b.stats()),
            net: self.net.as_ref().map(|n| NetReport {
                stats: n.stats(),
                failure: n.failure().map(str::to_owned),
            }),
            events: self.events.as_ref().map(Capture::summary),
        }
    }

    /// Makes what devices received visible to the guest — finished disk
    /// requests, network frames —: at any time when not recording; right
    /// after a deterministic exit when recording (logged); where the log
    /// says when replaying (waiting for the disk if needed).
    fn publish_inputs(&mut self) -> Result<(), VmError> {
        match &self.journal {
            Journal::Live => {
                if let Some(block) = &mut self.block {
                    let n = block.publishable();
                    block.publish(n, &self.mem);
                }
                if let Some(net) = &mut self.net {
                    net.deliver_received(&self.mem);
                }
            }
            Journal::Record(_) if self.at_deterministic_exit => {
                if let Some(block) = &mut self.block {
                    let n = block.publishable();
                    if block.publish(n, &self.mem) > 0 {
                        self.journal.record_disk_done(block.published())?;
                    }
                }
                if let Some(net) = &mut self.net {
                    let frames = net.deliver_received(&self.mem);
                    if !frames.is_empty() {
                        self.journal.record_net_rx(&frames)?;
                    }
                }
            }
            Journal::Replay(_) if self.at_deterministic_exit => {
                while let Some(input) = self.journal.replay_input()? {
                    self.replay_input(input)?;
                }
            }
            Journal::Record(_) | Journal::Replay(_) => {}
        }
        if self.block.as_mut().is_some_and(|b| b.take_irq()) {
            self.platform.pic.pulse_irq(virtio_blk::IRQ);
        }
        if self.net.as_mut().is_some_and(|n| n.take_irq()) {
            self.platform.pic.pulse_irq(virtio_net::IRQ);
        }
        Ok(())
    }

    /// Makes visible what the recording made visible here.
    fn replay_input(&mut self, input: Input) -> Result<(), VmError> {
        match input {
            Input::Disk(completed) => {
                let (published, submitted) = self
                    .block
                    .as_ref()
                    .map_or((0, 0), |b| (b.published(), b.submitted()));
                let Some(block) = self
                    .block
                    .as_mut()
                    .filter(|_| completed > published && completed <= submitted)
                else {
                    return Err(self
                        .journal
                        .impossible_disk_done(completed, submitted)
                        .into());
                };
                let count = completed - published;
                block.wait_publishable(count)?;
                block.publish(count, &self.mem);
            }
            Input::Net(frames) => {
                let result = match self.net.as_mut() {
                    Some(net) => net.deliver(&frames, &self.mem).map_err(|e| e.to_string()),
                    None => Err("the guest has no network device".to_owned()),
                };
                if let Err(why) = result {
                    return Err(self.journal.undeliverable_frames(&frames, why).into());
                }
            }
        }
        Ok(())
    }

    /// Flushes the trace now and then and reports progress.
    fn housekeeping(&mut self) -> Result<(), VmError> {
        self.journal.housekeeping()?;
        if let Some(progress) = &mut self.progress {
            if self.last_progress.elapsed() >= PROGRESS_INTERVAL {
                progress(&self.journal.progress());
                self.last_progress = Instant::now();
            }
        }
        Ok(())
    }

    /// Adds the vCPU's registers to a divergence report.
    fn describe_divergence(
        &mut self,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError> {
        match result {
            Err(VmError::Journal(JournalError::Diverged(mut d))) => {
                if let Ok(regs) = self.vcpu.get_regs() {
                    d.state = journal::regs_text(&regs);
                }
                Err(VmError::Journal(JournalError::Diverged(d)))
            }
            other => other,
        }
    }

    /// Ends the recording, if this run is one, the way the run ended: the
    /// trace is marked complete whatever the reason, since everything up
    /// to this point is in it.
    fn end_journal(&mut self, result: Result<RunOutcome, VmError>) -> Result<RunOutcome, VmError> {
        let Journal::Record(_) = self.journal else {
            return result;
        };
        let progress = self.journal.progress();
        let Journal::Record(recorder) = std::mem::replace(&mut self.journal, Journal::Live) else {
            return result;
        };
        let reason = match &result {
            Ok(o) => match o.stop {
                StopReason::CommandExited => EndReason::CommandExited(o.exit_status.unwrap_or(0)),
                _ => EndReason::PowerOff,
            },
            Err(VmError::StoppedByUser) => EndReason::StoppedByUser,
            Err(e) => EndReason::Failed(e.to_string()),
        };
        let summary = recorder.finish(reason)?;
        self.trace_summary = Some(summary);
        result.map(|mut o| {
            o.trace = Some(summary);
            o.journal = progress;
            o
        })
    }

    /// Injects the PIC's pending interrupt if the vCPU can take it now,
    /// otherwise asks KVM to exit as soon as it can.
    ///
    /// Under the exit clock (recording, replay) interrupts are injected only
    /// right after a deterministic exit and the vCPU never asks for a
    /// window: the window exit is not a deterministic point.
    fn inject_interrupts(&mut self) -> Result<(), VmError> {
        let exit_clock = self.journal.exit_clock();
        let at_exit = std::mem::take(&mut self.at_deterministic_exit);
        let exception_pending = std::mem::take(&mut self.exception_pending);
        let run = self.vcpu.get_kvm_run();
        // The flags describe the vCPU at the last exit, before any
        // exception the VMM injected since.
        let can_inject = !exception_pending
            && run.ready_for_interrupt_injection != 0
            && run.if_flag != 0
            && (at_exit || !exit_clock);
        if self.journal.is_replay() {
            run.request_interrupt_window = 0;
            if !at_exit {
                return Ok(());
            }
            if let Some(vector) = self.journal.replay_interrupt()? {
                if !can_inject {
                    return Err(self
                        .journal
                        .replay_uninjectable(vector, exception_pending)
                        .into());
                }
                self.inject(vector)?;
            }
            return Ok(());
        }
        let pending = self.platform.pic.has_pending();
        run.request_interrupt_window = u8::from(pending && !can_inject && !exit_clock);
        if pending && can_inject {
            if let Some(vector) = self.platform.pic.acknowledge() {
                self.inject(vector)?;
                self.journal.record_interrupt(vector)?;
            }
        }
        Ok(())
    }

    fn inject(&mut self, vector: u8) -> Result<(), VmError> {
        kvm_ext::inject_interrupt(&self.vcpu, vector).map_err(|e| VmError::Kvm {
            op: "INTERRUPT",
            source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)),
        })?;
        self.exits.interrupts_injected += 1;
        Ok(())
    }

    /// The guest executed HLT: sleep until an interrupt is due.
    fn wait_for_interrupt(&mut self) -> Result<(), VmError> {
        if self.vcpu.get_kvm_run().if_flag == 0 {
            let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
            return Err(VmError::GuestHalted { rip });
        }
        loop {
            self.feed_input()?;
            self.housekeeping()?;
            let now = self.clock.now_ns();
            self.platform.advance_to(now);
            self.publish_inputs()?;
            if self.platform.pic.has_pending() {
                return Ok(());
            }
            // With input attached, look for keys every few milliseconds;
            // devices ring the doorbell when they have something.
            let max_sleep = if self.input.is_some() {
                5_000_000
            } else if self.journal.exit_clock() {
                HOUSEKEEPING_NS
            } else {
                u64::MAX
            };
            match self.platform.next_timer_ns() {
                Some(due) => {
                    let wait = due.saturating_sub(now).min(max_sleep);
                    self.doorbell.wait(Duration::from_nanos(wait));
                }
                None => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(VmError::GuestHalted { rip });
                }
            }
        }
    }
}
