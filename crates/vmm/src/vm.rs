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

use devices::{ControlMessage, LegacyPlatform, PlatformStats};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::boot::{self, BootError};
use crate::console::ConsoleInput;
use crate::emulation::{self, Completion};
use crate::gva;
use crate::kvm_ext;
use crate::xstate::{self, XOp, XsaveLayout, XstateFault};
use crate::{cpuid, initramfs};

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
}

fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { op, source }
}

/// Why the guest stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `/init` reported the guest command's exit status (after syncing):
    /// the run is over, nothing the guest does later can matter.
    CommandExited,
    /// The guest kernel powered off.
    PowerOff,
}

/// Counts of VM exits by kind, and other run statistics.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExitCounts {
    pub port_io: u64,
    pub mmio: u64,
    pub halts: u64,
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
}

/// Everything needed to boot a VM.
#[derive(Debug)]
pub struct VmSpec {
    pub kernel: PathBuf,
    /// The base initramfs image, followed by archives generated at boot.
    pub initramfs: Vec<u8>,
    pub cmdline: String,
    pub memory_mib: u64,
    /// Seed for the guest kernel's random number generator.
    pub rng_seed: [u8; boot::RNG_SEED_LEN],
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

        let sregs = vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        vcpu.set_sregs(&boot::boot_sregs(sregs))
            .map_err(kvm_err("SET_SREGS"))?;
        vcpu.set_regs(&boot::boot_regs(layout.entry))
            .map_err(kvm_err("SET_REGS"))?;
        vcpu.set_fpu(&boot::boot_fpu())
            .map_err(kvm_err("SET_FPU"))?;

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
            exits: ExitCounts::default(),
            exit_status: None,
            init_reached: None,
            xsave_layout,
            xsave_max_size,
            input: None,
            exception_pending: false,
        })
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
            self.inject_interrupts()?;
            let deadline = self.platform.next_timer_ns().unwrap_or(u64::MAX);
            kick.deadline_ns.store(deadline, Ordering::Release);

            let next = match self.vcpu.run() {
                Ok(exit) => dispatch(
                    &mut self.platform,
                    &self.clock,
                    &mut self.exits,
                    BOOT_VCPU,
                    exit,
                )?,
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    self.exits.kicks += 1;
                    Next::Continue
                }
                Err(e) => return Err(kvm_err("RUN")(e)),
            };
            // Messages from the guest's control port.
            for message in self.platform.take_messages() {
                match message {
                    ControlMessage::InitReached => {
                        self.init_reached = Some(Duration::from_nanos(self.clock.now_ns()))
                    }
                    ControlMessage::ExitStatus(s) => {
                        self.exit_status = Some(s);
                        return Ok(self.outcome(StopReason::CommandExited));
                    }
                    ControlMessage::PowerOff => return Ok(self.outcome(StopReason::PowerOff)),
                    ControlMessage::Panic => return Err(VmError::GuestPanic),
                    ControlMessage::Unknown(_) => {}
                }
            }
            match next {
                Next::Continue => {}
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
        }
    }

    /// Injects the PIC's pending interrupt if the vCPU can take it now,
    /// otherwise asks KVM to exit as soon as it can.
    fn inject_interrupts(&mut self) -> Result<(), VmError> {
        let pending = self.platform.pic.has_pending();
        let exception_pending = std::mem::take(&mut self.exception_pending);
        let run = self.vcpu.get_kvm_run();
        // The flags describe the vCPU at the last exit, before any
        // exception the VMM injected since.
        let can_inject =
            !exception_pending && run.ready_for_interrupt_injection != 0 && run.if_flag != 0;
        run.request_interrupt_window = u8::from(pending && !can_inject);
        if pending && can_inject {
            if let Some(vector) = self.platform.pic.acknowledge() {
                kvm_ext::inject_interrupt(&self.vcpu, vector).map_err(|e| VmError::Kvm {
                    op: "INTERRUPT",
                    source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)),
                })?;
                self.exits.interrupts_injected += 1;
            }
        }
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
            let now = self.clock.now_ns();
            self.platform.advance_to(now);
            if self.platform.pic.has_pending() {
                return Ok(());
            }
            // With input attached, look for keys every few milliseconds.
            let max_sleep = if self.input.is_some() {
                5_000_000
            } else {
                u64::MAX
            };
            match self.platform.next_timer_ns() {
                Some(due) => {
                    std::thread::sleep(Duration::from_nanos(due.saturating_sub(now).min(max_sleep)))
                }
                None => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(VmError::GuestHalted { rip });
                }
            }
        }
    }

    /// KVM could not emulate a guest instruction: complete it if it is one
    /// the VMM knows, otherwise stop with its bytes.
    fn complete_unemulated(&mut self) -> Result<(), VmError> {
        let (suberror, data) = kvm_ext::internal_error(self.vcpu.get_kvm_run());
        let mut regs = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
        if suberror != INTERNAL_ERROR_EMULATION {
            return Err(VmError::GuestFault {
                reason: format!("KVM internal error {suberror}"),
                rip: regs.rip,
                detail: format!(" (data {data:x?})"),
            });
        }
        let sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        // The bytes up to the end of the page must be readable; those on
        // the next page only if the instruction continues there.
        let mut insn = [0u8; MAX_INSN_LEN];
        let pc = sregs.cs.base.wrapping_add(regs.rip);
        let in_page = MAX_INSN_LEN.min((0x1000 - (pc & 0xfff)) as usize);
        let fetched = gva::read_virt(&self.mem, sregs.cr3, pc, &mut insn[..in_page]);
        if fetched.is_ok() && in_page < MAX_INSN_LEN {
            let rest = pc.wrapping_add(in_page as u64);
            let _ = gva::read_virt(&self.mem, sregs.cr3, rest, &mut insn[in_page..]);
        }
        let completion = fetched
            .as_ref()
            .ok()
            .and_then(|_| emulation::complete(&insn));
        if let Some(completion) = completion {
            self.exits.emulation_completions += 1;
            return match completion {
                Completion::Xstate(x) => self.complete_xstate(x, regs, sregs.cr3),
                Completion::Skip(len) => {
                    regs.rip = regs.rip.wrapping_add(len);
                    self.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))
                }
                Completion::Trap { len, vector } => {
                    regs.rip = regs.rip.wrapping_add(len);
                    self.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))?;
                    self.inject_exception(vector, None)
                }
            };
        }
        Err(VmError::GuestFault {
            reason: "instruction the host cannot emulate".into(),
            rip: regs.rip,
            detail: match fetched {
                Ok(()) => format!(" (bytes {})", emulation::hex_bytes(&insn)),
                Err(e) => format!(" ({e})"),
            },
        })
    }
}

impl Vm {
    /// Raises exception `vector` in the guest at the current RIP.
    fn inject_exception(&mut self, vector: u8, error_code: Option<u32>) -> Result<(), VmError> {
        let mut events = self
            .vcpu
            .get_vcpu_events()
            .map_err(kvm_err("GET_VCPU_EVENTS"))?;
        events.exception.injected = 1;
        events.exception.nr = vector;
        events.exception.has_error_code = u8::from(error_code.is_some());
        events.exception.error_code = error_code.unwrap_or(0);
        self.exception_pending = true;
        self.vcpu
            .set_vcpu_events(&events)
            .map_err(kvm_err("SET_VCPU_EVENTS"))
    }

    /// Raises a page fault for a supervisor access to `addr`.
    fn inject_page_fault(&mut self, addr: u64, present: bool, write: bool) -> Result<(), VmError> {
        let mut sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        sregs.cr2 = addr;
        self.vcpu.set_sregs(&sregs).map_err(kvm_err("SET_SREGS"))?;
        self.inject_exception(14, Some(u32::from(present) | (u32::from(write) << 1)))
    }

    /// Completes XSAVE/XRSTOR for the guest kernel (see `xstate`).
    fn complete_xstate(
        &mut self,
        x: xstate::XInsn,
        mut regs: kvm_bindings::kvm_regs,
        cr3: u64,
    ) -> Result<(), VmError> {
        const GP: u8 = 13;
        let gprs = [
            regs.rax, regs.rcx, regs.rdx, regs.rbx, regs.rsp, regs.rbp, regs.rsi, regs.rdi,
            regs.r8, regs.r9, regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15,
        ];
        let next_rip = regs.rip.wrapping_add(x.len);
        let addr = x.mem.address(&gprs, next_rip);
        if xstate::check_alignment(addr).is_err() {
            return self.inject_exception(GP, Some(0));
        }
        let xcrs = self.vcpu.get_xcrs().map_err(kvm_err("GET_XCRS"))?;
        let xcr0 = xcrs.xcrs[..(xcrs.nr_xcrs as usize).min(xcrs.xcrs.len())]
            .iter()
            .find(|x| x.xcr == 0)
            .map(|x| x.value)
            .unwrap_or(1);
        let rfbm = ((regs.rdx << 32) | (regs.rax & 0xffff_ffff)) & xcr0;
        let Some(size) = self.xsave_layout.area_size(rfbm) else {
            return Err(VmError::GuestFault {
                reason: format!("XSAVE of state components {rfbm:#x} insight cannot complete"),
                rip: regs.rip,
                detail: String::new(),
            });
        };
        let write = x.op == XOp::Save;
        // XRSTOR reads the legacy area and header, then only the
        // components the header marks as in use; XSAVE writes them all.
        let mut area = vec![0u8; size];
        let read =
            |len: usize, area: &mut [u8]| gva::read_virt(&self.mem, cr3, addr, &mut area[..len]);
        let mut result = read(size.min(xstate::LEGACY_AND_HEADER), &mut area);
        if result.is_ok() && size > xstate::LEGACY_AND_HEADER {
            let needed = match x.op {
                XOp::Save => size,
                XOp::Restore => self
                    .xsave_layout
                    .area_size(rfbm & xstate::header_xstate_bv(&area))
                    .unwrap_or(size),
            };
            if needed > xstate::LEGACY_AND_HEADER {
                result = read(needed, &mut area);
            }
        }
        match result {
            Ok(()) => {}
            Err(gva::TranslateError::NotMapped(at)) => {
                return self.inject_page_fault(at, false, write)
            }
            Err(e) => return Err(xsave_memory_fault(&regs, e)),
        }
        let mut kvm_state = self.vcpu.get_xsave().map_err(kvm_err("GET_XSAVE"))?;
        let mut cpu: Vec<u8> = kvm_state
            .region
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        match x.op {
            XOp::Save => {
                xstate::save(&cpu, &mut area, rfbm, &self.xsave_layout);
                match gva::write_virt(&self.mem, cr3, addr, &area) {
                    Ok(()) => {}
                    Err(gva::TranslateError::NotMapped(at)) => {
                        return self.inject_page_fault(at, false, true)
                    }
                    Err(gva::TranslateError::NotWritable(at)) => {
                        return self.inject_page_fault(at, true, true)
                    }
                    Err(e) => return Err(xsave_memory_fault(&regs, e)),
                }
            }
            XOp::Restore => {
                if let Err(
                    XstateFault::BadHeader | XstateFault::BadMxcsr | XstateFault::Misaligned,
                ) = xstate::restore(&mut cpu, &area, rfbm, xcr0, &self.xsave_layout)
                {
                    return self.inject_exception(GP, Some(0));
                }
                for (word, bytes) in kvm_state.region.iter_mut().zip(cpu.chunks_exact(4)) {
                    *word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                }
                kvm_ext::set_xsave(&self.vcpu, &kvm_state, self.xsave_max_size)
                    .map_err(kvm_err("SET_XSAVE"))?;
            }
        }
        regs.rip = next_rip;
        self.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))
    }
}

fn xsave_memory_fault(regs: &kvm_bindings::kvm_regs, e: gva::TranslateError) -> VmError {
    VmError::GuestFault {
        reason: "XSAVE area outside guest memory".into(),
        rip: regs.rip,
        detail: format!(" ({e})"),
    }
}

/// The single choke point for VM exits: every exit of every vCPU passes
/// here with the vCPU's id. Recording and replay hook in here only.
fn dispatch<W: Write>(
    platform: &mut LegacyPlatform<W>,
    clock: &VmClock,
    counts: &mut ExitCounts,
    _vcpu: u8,
    exit: VcpuExit<'_>,
) -> Result<Next, VmError> {
    Ok(match exit {
        VcpuExit::IoIn(port, data) => {
            counts.port_io += 1;
            platform.port_read(port, data, clock.now_ns());
            Next::Continue
        }
        VcpuExit::IoOut(port, data) => {
            counts.port_io += 1;
            platform.port_write(port, data, clock.now_ns());
            Next::Continue
        }
        VcpuExit::MmioRead(_, data) => {
            // No MMIO devices yet: reads see an empty bus.
            counts.mmio += 1;
            data.fill(0xff);
            Next::Continue
        }
        VcpuExit::MmioWrite(..) => {
            counts.mmio += 1;
            Next::Continue
        }
        VcpuExit::Hlt => {
            counts.halts += 1;
            Next::WaitForInterrupt
        }
        VcpuExit::IrqWindowOpen | VcpuExit::Intr => Next::Continue,
        VcpuExit::InternalError => Next::InternalError,
        VcpuExit::Shutdown => Next::Fault("triple fault (shutdown)".into(), String::new()),
        VcpuExit::FailEntry(reason, _) => Next::Fault(
            "entry failure".into(),
            format!(" (hardware reason {reason:#x})"),
        ),
        VcpuExit::SystemEvent(kind, _) => {
            Next::Fault(format!("system event {kind}"), String::new())
        }
        other => Next::Fault(format!("unexpected exit {other:?}"), String::new()),
    })
}
