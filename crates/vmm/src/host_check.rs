//! What this host's KVM can do, measured with tiny hand-assembled guests,
//! and the strategy insight chooses from it.
//!
//! Each probe boots a 4 MiB guest straight into 64-bit mode with a GDT
//! (kernel and user segments), a TSS, an IDT whose handlers report their
//! vector, and identity page tables open to user mode. Guest code signals
//! progress by writing a marker byte to port 0xf1; the probe reads the
//! marker and the privilege level it was written at.

use kvm_bindings::{
    kvm_guest_debug, kvm_msr_entry, Msrs, KVM_GUESTDBG_ENABLE, KVM_GUESTDBG_SINGLESTEP,
    KVM_GUESTDBG_USE_HW_BP, KVM_GUESTDBG_USE_SW_BP, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::boot::{descriptor_segment, gdt_entry};
use crate::{cpuid, kvm_ext, preempt, sys};

const MEM_SIZE: usize = 4 << 20;
const GDT: u64 = 0x500;
const TSS: u64 = 0x600;
const IDT: u64 = 0x2000;
const HANDLERS: u64 = 0x3000;
const KERNEL_CODE: u64 = 0x4000;
const USER_CODE: u64 = 0x5000;
const LSTAR_CODE: u64 = 0x6000;
const KERNEL_STACK: u64 = 0x7000;
const USER_STACK: u64 = 0x8000;
const PML4: u64 = 0x9000;
const PDPT: u64 = 0xa000;
const PD: u64 = 0xb000;
const MARKER_PORT: u16 = 0xf1;

const KERNEL_CS: u16 = 0x08;
const KERNEL_DS: u16 = 0x10;
const USER_DS: u16 = 0x18;
const USER_CS: u16 = 0x20;
const TSS_SEL: u16 = 0x28;

const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_SFMASK: u32 = 0xc000_0084;
const EFER_SCE: u64 = 1;
const CR4_TSD: u64 = 1 << 2;

/// Markers the probe programs write.
const M_LSTAR: u8 = 0x01;
const M_AFTER: u8 = 0x02;
/// Handlers write 0x80 | vector.
const M_VECTOR: u8 = 0x80;

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot open /dev/kvm (is KVM available and accessible?)")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("KVM {op} failed in a host probe")]
    Kvm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("host probe guest memory: {0}")]
    Memory(String),
    #[error("this host's KVM runs a user-mode SYSCALL in a way insight does not know ({0}); see `insight host-check`")]
    UnknownSyscall(String),
}

fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> ProbeError {
    move |source| ProbeError::Kvm { op, source }
}

/// What a probe guest did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    /// Wrote `marker` to the marker port at privilege level `cpl`.
    Marker {
        marker: u8,
        cpl: u8,
    },
    /// KVM reported a debug exit (breakpoint or single-step).
    Debug {
        exception: u32,
        pc: u64,
        cpl: u8,
    },
    Halted,
    TripleFault,
    /// KVM's instruction emulator could not execute an instruction.
    EmulationFailure,
    Other,
}

/// One probe guest.
struct ProbeVm {
    vcpu: VcpuFd,
    _vm: VmFd,
    _mem: GuestMemoryMmap,
}

/// Machine code for "write marker `m` to the marker port; halt".
fn marker_code(m: u8) -> [u8; 5] {
    [0xb0, m, 0xe6, MARKER_PORT as u8, 0xf4]
}

/// Kernel code that enters user mode at USER_CODE with IOPL 3 (so user
/// code may write the marker port), via IRETQ.
fn enter_user_code() -> Vec<u8> {
    let mut c = vec![0x6a, (USER_DS | 3) as u8]; // push ss
    c.extend([0x68]); // push imm32 rsp
    c.extend((USER_STACK as u32).to_le_bytes());
    c.extend([0x68]); // push imm32 rflags: IOPL 3, IF 0
    c.extend(0x3002u32.to_le_bytes());
    c.extend([0x6a, (USER_CS | 3) as u8]); // push cs
    c.extend([0x68]); // push imm32 rip
    c.extend((USER_CODE as u32).to_le_bytes());
    c.extend([0x48, 0xcf]); // iretq
    c
}

/// Descriptors of the probe GDT: (selector, flags, base, limit).
const KERNEL_CODE_DESC: (u16, u16, u32, u32) = (KERNEL_CS, 0xa09b, 0, 0xfffff);
const KERNEL_DATA_DESC: (u16, u16, u32, u32) = (KERNEL_DS, 0xc093, 0, 0xfffff);
const USER_DATA_DESC: (u16, u16, u32, u32) = (USER_DS, 0xc0f3, 0, 0xfffff);
const USER_CODE_DESC: (u16, u16, u32, u32) = (USER_CS, 0xa0fb, 0, 0xfffff);
/// 64-bit TSS (available), byte-granular limit.
const TSS_DESC: (u16, u16, u32, u32) = (TSS_SEL, 0x0089, TSS as u32, 0x67);

impl ProbeVm {
    /// A probe that enters user mode and runs `user`; a SYSCALL lands on
    /// the M_LSTAR marker.
    fn user(kvm: &Kvm, user: &[u8], tsd: bool) -> Result<Self, ProbeError> {
        ProbeVm::new(kvm, &enter_user_code(), user, &marker_code(M_LSTAR), tsd)
    }

    /// A probe that runs `body` in `mode`, then writes M_AFTER.
    fn running(kvm: &Kvm, mode: Mode, body: &[u8], tsd: bool) -> Result<Self, ProbeError> {
        let (k, u) = in_mode(mode, body);
        ProbeVm::new(kvm, &k, &u, &marker_code(M_LSTAR), tsd)
    }

    fn new(
        kvm: &Kvm,
        kernel_code: &[u8],
        user_code: &[u8],
        lstar_code: &[u8],
        tsd: bool,
    ) -> Result<Self, ProbeError> {
        let vm = kvm.create_vm().map_err(kvm_err("CREATE_VM"))?;
        vm.set_tss_address(0xfffb_d000)
            .map_err(kvm_err("SET_TSS_ADDR"))?;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)])
            .map_err(|e| ProbeError::Memory(e.to_string()))?;
        let w = |addr: u64, bytes: &[u8]| {
            mem.write_slice(bytes, GuestAddress(addr))
                .map_err(|e| ProbeError::Memory(e.to_string()))
        };
        // GDT: null, kernel code/data, user data/code, 16-byte TSS.
        let entry = |(_, flags, base, limit): (u16, u16, u32, u32)| gdt_entry(flags, base, limit);
        let gdt = [
            0,
            entry(KERNEL_CODE_DESC),
            entry(KERNEL_DATA_DESC),
            entry(USER_DATA_DESC),
            entry(USER_CODE_DESC),
            entry(TSS_DESC),
            0, // upper half of the 16-byte TSS descriptor
        ];
        for (i, e) in gdt.iter().enumerate() {
            w(GDT + 8 * i as u64, &e.to_le_bytes())?;
        }
        // TSS: RSP0 for entries from user mode.
        w(TSS + 4, &KERNEL_STACK.to_le_bytes())?;
        // IDT: every vector's handler reports 0x80|vector. Gates are DPL 3
        // so that `int3` from user mode reaches its handler.
        for v in 0..32u64 {
            let handler = HANDLERS + v * 8;
            w(handler, &marker_code(M_VECTOR | v as u8))?;
            let lo = (handler & 0xffff)
                | (u64::from(KERNEL_CS) << 16)
                | (0xeeu64 << 40)
                | ((handler >> 16) & 0xffff) << 48;
            w(IDT + v * 16, &lo.to_le_bytes())?;
            w(IDT + v * 16 + 8, &(handler >> 32).to_le_bytes())?;
        }
        w(KERNEL_CODE, kernel_code)?;
        w(USER_CODE, user_code)?;
        w(LSTAR_CODE, lstar_code)?;
        // Identity map of the first 4 MiB, user-accessible.
        w(PML4, &(PDPT | 7).to_le_bytes())?;
        w(PDPT, &(PD | 7).to_le_bytes())?;
        w(PD, &(0x87u64).to_le_bytes())?;
        w(PD + 8, &((1u64 << 21) | 0x87).to_le_bytes())?;

        kvm_ext::map_guest_memory(&vm, &mem).map_err(kvm_err("SET_USER_MEMORY_REGION"))?;

        let vcpu = vm.create_vcpu(0).map_err(kvm_err("CREATE_VCPU"))?;
        cpuid::apply(kvm, &vcpu).map_err(kvm_err("SET_CPUID2"))?;

        let mut sregs = vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        sregs.gdt.base = GDT;
        sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
        sregs.idt.base = IDT;
        sregs.idt.limit = 32 * 16 - 1;
        let load = |(sel, flags, base, limit): (u16, u16, u32, u32)| {
            descriptor_segment(sel, flags, base, limit)
        };
        sregs.cs = load(KERNEL_CODE_DESC);
        let ds = load(KERNEL_DATA_DESC);
        (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (ds, ds, ds, ds, ds);
        let mut tr = load(TSS_DESC);
        tr.type_ = 0xb; // loaded TSS is busy
        sregs.tr = tr;
        sregs.cr3 = PML4;
        sregs.cr4 = (1 << 5) | if tsd { CR4_TSD } else { 0 };
        sregs.cr0 = 0x8000_0011;
        sregs.efer = (1 << 8) | (1 << 10) | EFER_SCE;
        vcpu.set_sregs(&sregs).map_err(kvm_err("SET_SREGS"))?;
        let regs = kvm_bindings::kvm_regs {
            rip: KERNEL_CODE,
            rsp: KERNEL_STACK,
            rflags: 2,
            ..Default::default()
        };
        vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))?;
        let star = (u64::from(USER_DS - 8) << 48) | (u64::from(KERNEL_CS) << 32);
        let msrs = Msrs::from_entries(&[
            kvm_msr_entry {
                index: MSR_STAR,
                data: star,
                ..Default::default()
            },
            kvm_msr_entry {
                index: MSR_LSTAR,
                data: LSTAR_CODE,
                ..Default::default()
            },
            kvm_msr_entry {
                index: MSR_SFMASK,
                data: 0,
                ..Default::default()
            },
        ])
        .map_err(|_| ProbeError::Memory("MSR list".into()))?;
        vcpu.set_msrs(&msrs).map_err(kvm_err("SET_MSRS"))?;
        Ok(ProbeVm {
            vcpu,
            _vm: vm,
            _mem: mem,
        })
    }

    fn debug(&self, control: u32, dr0: Option<u64>) -> Result<(), ProbeError> {
        let mut dbg = kvm_guest_debug {
            control,
            ..Default::default()
        };
        if let Some(addr) = dr0 {
            dbg.arch.debugreg[0] = addr;
            dbg.arch.debugreg[7] = 0x1; // L0, execute, 1 byte
        }
        self.vcpu
            .set_guest_debug(&dbg)
            .map_err(kvm_err("SET_GUEST_DEBUG"))
    }

    fn cpl(&self) -> u8 {
        self.vcpu
            .get_sregs()
            .map(|s| (s.cs.selector & 3) as u8)
            .unwrap_or(0xff)
    }

    /// Runs to the next event of interest.
    fn next_event(&mut self) -> Result<Event, ProbeError> {
        for _ in 0..1000 {
            let exit = self.vcpu.run();
            let event = match exit {
                Ok(VcpuExit::IoOut(port, data)) if port == MARKER_PORT => {
                    let marker = data.first().copied().unwrap_or(0);
                    Event::Marker { marker, cpl: 0 }
                }
                Ok(VcpuExit::Debug(arch)) => Event::Debug {
                    exception: arch.exception,
                    pc: arch.pc,
                    cpl: 0,
                },
                Ok(VcpuExit::Hlt) => Event::Halted,
                Ok(VcpuExit::Shutdown) => Event::TripleFault,
                Ok(VcpuExit::InternalError) => Event::EmulationFailure,
                Ok(VcpuExit::IoOut(..)) | Ok(VcpuExit::IoIn(..)) | Ok(VcpuExit::IrqWindowOpen) => {
                    continue
                }
                Ok(_) => Event::Other,
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
                Err(e) => return Err(kvm_err("RUN")(e)),
            };
            return Ok(match event {
                Event::Marker { marker, .. } => Event::Marker {
                    marker,
                    cpl: self.cpl(),
                },
                Event::Debug { exception, pc, .. } => Event::Debug {
                    exception,
                    pc,
                    cpl: self.cpl(),
                },
                e => e,
            });
        }
        Ok(Event::Other)
    }
}

/// Where a user-mode SYSCALL lands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SyscallBehaviour {
    /// At MSR_LSTAR in ring 0, as the architecture says.
    EntersKernel,
    /// At MSR_LSTAR but still in ring 3 (KVM's nested "PVM" mode for
    /// non-PVM guests): the guest kernel needs insight's syscall trap.
    StaysInUserMode,
    /// Something else happened; the text says what.
    Unknown(String),
}

fn open_kvm() -> Result<Kvm, ProbeError> {
    Kvm::new().map_err(ProbeError::OpenKvm)
}

/// Executes SYSCALL in user mode and reports where it lands.
pub fn probe_syscall() -> Result<SyscallBehaviour, ProbeError> {
    let kvm = open_kvm()?;
    let mut user = vec![0x0f, 0x05]; // syscall
    user.extend(marker_code(M_AFTER));
    let mut vm = ProbeVm::user(&kvm, &user, false)?;
    Ok(match vm.next_event()? {
        Event::Marker {
            marker: M_LSTAR,
            cpl: 0,
        } => SyscallBehaviour::EntersKernel,
        Event::Marker {
            marker: M_LSTAR,
            cpl: 3,
        } => SyscallBehaviour::StaysInUserMode,
        other => SyscallBehaviour::Unknown(format!("{other:?}")),
    })
}

/// Mode of guest execution a probe targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Kernel,
    User,
}

/// Code that runs `body` in `mode` and then writes M_AFTER: returns
/// (kernel code, user code).
fn in_mode(mode: Mode, body: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut code = body.to_vec();
    code.extend(marker_code(M_AFTER));
    match mode {
        Mode::Kernel => (code, marker_code(0x7f).to_vec()),
        Mode::User => (enter_user_code(), code),
    }
}

fn body_addr(mode: Mode) -> u64 {
    match mode {
        Mode::Kernel => KERNEL_CODE,
        Mode::User => USER_CODE,
    }
}

/// How an `int3` executed by the guest is handled with
/// `KVM_GUESTDBG_USE_SW_BP` set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Int3Behaviour {
    /// KVM exits to the VMM: probes can be invisible to the guest.
    Intercepted,
    /// The guest's own #BP handler runs.
    GuestHandler,
    /// KVM cannot execute it at all (interpreted guest kernel); the VMM
    /// completes it by injecting #BP.
    NotEmulated,
    Unknown(String),
}

pub fn probe_sw_breakpoint(mode: Mode) -> Result<Int3Behaviour, ProbeError> {
    let kvm = open_kvm()?;
    let mut vm = ProbeVm::running(&kvm, mode, &[0xcc], false)?;
    vm.debug(KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_SW_BP, None)?;
    Ok(match vm.next_event()? {
        Event::Debug { exception: 3, .. } => Int3Behaviour::Intercepted,
        Event::Marker { marker, .. } if marker == M_VECTOR | 3 => Int3Behaviour::GuestHandler,
        Event::EmulationFailure => Int3Behaviour::NotEmulated,
        other => Int3Behaviour::Unknown(format!("{other:?}")),
    })
}

/// Whether a hardware execution breakpoint on a guest instruction exits.
pub fn probe_hw_breakpoint(mode: Mode) -> Result<bool, ProbeError> {
    let kvm = open_kvm()?;
    let mut vm = ProbeVm::running(&kvm, mode, &[0x90, 0x90, 0x90], false)?;
    let target = body_addr(mode) + 1;
    vm.debug(KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_HW_BP, Some(target))?;
    loop {
        match vm.next_event()? {
            Event::Debug { pc, .. } if pc == target => return Ok(true),
            Event::Debug { .. } => continue,
            _ => return Ok(false),
        }
    }
}

/// Whether single-stepping reports steps inside code running in `mode`.
pub fn probe_single_step(mode: Mode) -> Result<bool, ProbeError> {
    let kvm = open_kvm()?;
    let mut vm = ProbeVm::running(&kvm, mode, &[0x90, 0x90, 0x90], false)?;
    vm.debug(KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_SINGLESTEP, None)?;
    let body = body_addr(mode);
    for _ in 0..64 {
        match vm.next_event()? {
            Event::Debug { pc, .. } if (body..body + 3).contains(&pc) && pc != body => {
                return Ok(true)
            }
            Event::Debug { .. } => continue,
            _ => return Ok(false),
        }
    }
    Ok(false)
}

/// Where interrupts injected at a VM exit reach the guest, over `rounds`
/// tries: the guest enables interrupts, writes a marker (the exit at which
/// the VMM injects vector 31) and counts in RAX; the handler reports, and
/// the interrupt frame on its stack says where the guest was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryReport {
    pub rounds: u32,
    /// Deliveries at the instruction right after the exiting one.
    pub exact: u32,
    /// The most instructions the guest ran between exit and delivery.
    pub max_late: u64,
}

pub fn probe_interrupt_delivery(rounds: u32) -> Result<DeliveryReport, ProbeError> {
    const LOOP: u32 = 4000;
    let kvm = open_kvm()?;
    let mut report = DeliveryReport {
        rounds,
        exact: 0,
        max_late: 0,
    };
    // sti; nop; out MARKER, al (al = M_AFTER); then LOOP x `inc rax`.
    let mut body = vec![0xfb, 0x90, 0xb0, M_AFTER, 0xe6, MARKER_PORT as u8];
    let after_out = KERNEL_CODE + body.len() as u64;
    for _ in 0..LOOP {
        body.extend([0x48, 0xff, 0xc0]);
    }
    for _ in 0..rounds {
        let mut vm = ProbeVm::new(
            &kvm,
            &body,
            &marker_code(0x7f),
            &marker_code(M_LSTAR),
            false,
        )?;
        match vm.next_event()? {
            Event::Marker {
                marker: M_AFTER, ..
            } => {}
            _ => return Ok(report),
        }
        kvm_ext::inject_interrupt(&vm.vcpu, 31).map_err(|e| ProbeError::Kvm {
            op: "INTERRUPT",
            source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)),
        })?;
        if vm.next_event()?
            != (Event::Marker {
                marker: M_VECTOR | 31,
                cpl: 0,
            })
        {
            return Ok(report);
        }
        // The frame: RIP, CS, RFLAGS, RSP, SS below the stack top.
        let mut rip = [0u8; 8];
        vm._mem
            .read_slice(&mut rip, GuestAddress(KERNEL_STACK - 40))
            .map_err(|e| ProbeError::Memory(e.to_string()))?;
        let rip = u64::from_le_bytes(rip);
        if rip == after_out {
            report.exact += 1;
        } else {
            report.max_late = report.max_late.max(rip.saturating_sub(after_out) / 3);
        }
    }
    Ok(report)
}

/// Whether user-mode RDTSC faults when the guest sets CR4.TSD.
pub fn probe_user_tsd() -> Result<bool, ProbeError> {
    let kvm = open_kvm()?;
    let mut vm = ProbeVm::running(&kvm, Mode::User, &[0x0f, 0x31], true)?;
    Ok(matches!(vm.next_event()?, Event::Marker { marker, .. } if marker == M_VECTOR | 13))
}

/// Whether user-mode port I/O exits to the VMM (the marker arrives from
/// ring 3).
pub fn probe_user_port_io() -> Result<bool, ProbeError> {
    let kvm = open_kvm()?;
    let mut vm = ProbeVm::running(&kvm, Mode::User, &[], false)?;
    Ok(matches!(
        vm.next_event()?,
        Event::Marker {
            marker: M_AFTER,
            cpl: 3
        }
    ))
}

/// XCR0 as guest user code reads it with XGETBV (low byte) after the
/// guest enabled CR4.OSXSAVE with XCR0 = x87|SSE. 3 where the host honours
/// the guest's XCR0; the host's own value where it does not (guest user
/// code can then use AVX state whatever the guest kernel enabled).
pub fn probe_user_xcr0() -> Result<u8, ProbeError> {
    let kvm = open_kvm()?;
    // xor ecx, ecx; xgetbv; out 0xf1, al; hlt
    let user = [0x31, 0xc9, 0x0f, 0x01, 0xd0, 0xe6, MARKER_PORT as u8, 0xf4];
    let mut vm = ProbeVm::user(&kvm, &user, false)?;
    let mut sregs = vm.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
    sregs.cr4 |= 1 << 18; // OSXSAVE
    vm.vcpu.set_sregs(&sregs).map_err(kvm_err("SET_SREGS"))?;
    let mut xcrs = vm.vcpu.get_xcrs().map_err(kvm_err("GET_XCRS"))?;
    xcrs.nr_xcrs = 1;
    xcrs.xcrs[0].xcr = 0;
    xcrs.xcrs[0].value = 3;
    vm.vcpu.set_xcrs(&xcrs).map_err(kvm_err("SET_XCRS"))?;
    match vm.next_event()? {
        Event::Marker { marker, .. } => Ok(marker),
        _ => Ok(0),
    }
}

/// Performance counters: on the host, and offered to guests by KVM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PmuSupport {
    /// `Err` text when perf_event_open of a hardware branch counter fails.
    pub host_branch_counter: Result<(), String>,
    /// General-purpose counters KVM offers guests (CPUID leaf 0xA).
    pub guest_counters: u32,
}

pub fn probe_pmu() -> Result<PmuSupport, ProbeError> {
    let kvm = open_kvm()?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("GET_SUPPORTED_CPUID"))?;
    let guest_counters = cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == 0xa)
        .map(|e| (e.eax >> 8) & 0xff)
        .unwrap_or(0);
    Ok(PmuSupport {
        host_branch_counter: sys::hardware_branch_counter().map_err(|e| e.to_string()),
        guest_counters,
    })
}

/// Everything `insight host-check` reports.
#[derive(Clone, Debug)]
pub struct HostReport {
    pub syscall: SyscallBehaviour,
    pub user_port_io: bool,
    pub int3_kernel: Int3Behaviour,
    pub int3_user: Int3Behaviour,
    pub hw_breakpoint_kernel: bool,
    pub hw_breakpoint_user: bool,
    pub single_step_kernel: bool,
    pub single_step_user: bool,
    pub user_tsd: bool,
    /// Low byte of XCR0 as guest user code sees it (see probe_user_xcr0).
    pub user_xcr0: u8,
    pub pmu: PmuSupport,
    /// Where interrupts injected at an exit arrive (exit clock premise).
    pub delivery: DeliveryReport,
    /// Whether user code can be preempted where it stands and the state
    /// found again at replay (asynchronous points).
    pub state_match: StateMatchReport,
}

/// The timestamp clock record/replay will use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockKind {
    /// Retired guest branches counted by the PMU.
    Branch,
    /// Ordinals of deterministic VM exits.
    Exit,
}

impl HostReport {
    pub fn measure() -> Result<Self, ProbeError> {
        Ok(HostReport {
            syscall: probe_syscall()?,
            user_port_io: probe_user_port_io()?,
            int3_kernel: probe_sw_breakpoint(Mode::Kernel)?,
            int3_user: probe_sw_breakpoint(Mode::User)?,
            hw_breakpoint_kernel: probe_hw_breakpoint(Mode::Kernel)?,
            hw_breakpoint_user: probe_hw_breakpoint(Mode::User)?,
            single_step_kernel: probe_single_step(Mode::Kernel)?,
            single_step_user: probe_single_step(Mode::User)?,
            user_tsd: probe_user_tsd()?,
            user_xcr0: probe_user_xcr0()?,
            pmu: probe_pmu()?,
            delivery: probe_interrupt_delivery(20)?,
            state_match: probe_state_match()?,
        })
    }

    /// Whether insight can boot its guest here at all.
    pub fn can_run(&self) -> bool {
        !matches!(self.syscall, SyscallBehaviour::Unknown(_))
    }

    pub fn clock(&self) -> ClockKind {
        if self.pmu.host_branch_counter.is_ok() && self.pmu.guest_counters > 0 {
            ClockKind::Branch
        } else {
            ClockKind::Exit
        }
    }
}

/// What the state-matched preemption of user code rests on, measured with
/// a probe guest whose user code loops without ever exiting
/// (`add rax, imm32; inc rbx; jmp`):
/// - recording: a kick out of KVM_RUN stops the vCPU in user mode, and an
///   interrupt injected there reaches the guest at exactly that RIP;
/// - replay: in a fresh run of the same guest, a trampoline patched over
///   the loop compares the registers natively on every iteration and
///   exits through an MMIO store once they equal the recorded ones; the
///   VMM then completes the store, moves RIP back to the target and
///   injects the interrupt there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateMatchReport {
    /// An interrupt injected at a user-mode kick arrived at the kicked
    /// RIP with the kicked registers.
    pub kick_delivers_in_place: bool,
    /// The trampoline's exit came with the recorded registers.
    pub trampoline_found_state: bool,
    /// The interrupt injected after redirecting RIP arrived at the target.
    pub redirected_delivery: bool,
    /// Loop iterations the trampoline rejected before the match.
    pub rejected: u64,
    /// Wall time of that search, in nanoseconds.
    pub search_ns: u64,
    /// Whether the host reports the exit's RIP past the store (else at it).
    pub exit_rip_after_store: bool,
    /// Why the probe stopped short, if it did.
    pub failure: Option<String>,
}

impl StateMatchReport {
    /// Whether recording may preempt user code where it stands.
    pub fn works(&self) -> bool {
        self.kick_delivers_in_place && self.trampoline_found_state && self.redirected_delivery
    }
}

/// Where the probe's stub lives, and the MMIO page it exits through.
const STUB_PAGES: preempt::trampoline::StubPages = preempt::trampoline::StubPages {
    code: 0xc000,
    data: 0xd000,
    exit: 0x40_0000,
};
/// The probe loop: add rax, 0x01234567; inc rbx; jmp back.
const LOOP_CODE: [u8; 11] = [
    0x48, 0x05, 0x67, 0x45, 0x23, 0x01, 0x48, 0xff, 0xc3, 0xeb, 0xf5,
];
const VECTOR: u8 = 31;

/// Kernel code entering USER_CODE with interrupts enabled.
fn enter_user_code_interruptible() -> Vec<u8> {
    let mut c = enter_user_code();
    // The pushed RFLAGS immediate sits after push ss (2) and push rsp (5).
    let flags_at = 2 + 5 + 1;
    c[flags_at..flags_at + 4].copy_from_slice(&0x3202u32.to_le_bytes());
    c
}

impl ProbeVm {
    fn looping(kvm: &Kvm) -> Result<Self, ProbeError> {
        let vm = ProbeVm::new(
            kvm,
            &enter_user_code_interruptible(),
            &LOOP_CODE,
            &marker_code(M_LSTAR),
            false,
        )?;
        // A 2 MiB page past the end of RAM: stores there are MMIO exits.
        vm._mem
            .write_obj(STUB_PAGES.exit | 0x87, GuestAddress(PD + 16))
            .map_err(|e| ProbeError::Memory(e.to_string()))?;
        Ok(vm)
    }

    fn inject(&self, vector: u8) -> Result<(), ProbeError> {
        kvm_ext::inject_interrupt(&self.vcpu, vector).map_err(|e| ProbeError::Kvm {
            op: "INTERRUPT",
            source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)),
        })
    }

    /// After an injection: the RIP and RBX the interrupt found, from the
    /// handler's frame and registers.
    fn delivered(&mut self) -> Result<Option<(u64, u64)>, ProbeError> {
        if self.next_event()?
            != (Event::Marker {
                marker: M_VECTOR | VECTOR,
                cpl: 0,
            })
        {
            return Ok(None);
        }
        let rip: u64 = self
            ._mem
            .read_obj(GuestAddress(KERNEL_STACK - 40))
            .map_err(|e| ProbeError::Memory(e.to_string()))?;
        let rbx = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?.rbx;
        Ok(Some((rip, rbx)))
    }
}

/// Runs `f` with the probe VM on a thread of its own, kicking it out of
/// KVM_RUN every `period` until `f` returns.
fn kicked<R: Send + 'static>(
    vm: ProbeVm,
    period: std::time::Duration,
    f: impl FnOnce(ProbeVm) -> Result<R, ProbeError> + Send + 'static,
) -> Result<R, ProbeError> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};
    extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}
    register_signal_handler(SIGRTMIN(), on_kick).map_err(kvm_err("signal handler"))?;
    let done = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&done);
    let handle = std::thread::Builder::new()
        .name("probe-vcpu".into())
        .spawn(move || {
            let r = f(vm);
            flag.store(true, Ordering::Release);
            r
        })
        .map_err(|e| ProbeError::Memory(format!("cannot start a probe thread: {e}")))?;
    while !done.load(Ordering::Acquire) {
        std::thread::sleep(period);
        let _ = handle.kill(SIGRTMIN());
    }
    handle
        .join()
        .unwrap_or_else(|_| Err(ProbeError::Memory("the probe thread panicked".into())))
}

pub fn probe_state_match() -> Result<StateMatchReport, ProbeError> {
    let kvm = open_kvm()?;
    let mut report = StateMatchReport {
        kick_delivers_in_place: false,
        trampoline_found_state: false,
        redirected_delivery: false,
        rejected: 0,
        search_ns: 0,
        exit_rip_after_store: false,
        failure: None,
    };
    // Recording: kick until the vCPU stops in the user-mode loop, and
    // inject there.
    let recorded = kicked(
        ProbeVm::looping(&kvm)?,
        std::time::Duration::from_millis(3),
        |mut vm| {
            for _ in 0..500 {
                match vm.vcpu.run() {
                    Err(e) if e.errno() == libc::EINTR => {}
                    Ok(VcpuExit::IoOut(..)) | Ok(VcpuExit::IrqWindowOpen) => continue,
                    _ => return Ok(None),
                }
                let regs = vm.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
                let run = vm.vcpu.get_kvm_run();
                let ready = run.ready_for_interrupt_injection != 0 && run.if_flag != 0;
                let in_loop = (USER_CODE..USER_CODE + LOOP_CODE.len() as u64).contains(&regs.rip);
                if !in_loop || vm.cpl() != 3 || !ready || regs.rbx == 0 {
                    continue;
                }
                vm.inject(VECTOR)?;
                return Ok(Some((regs, vm.delivered()?)));
            }
            Ok(None)
        },
    )?;
    let Some((target, delivered)) = recorded else {
        report.failure = Some("no kick stopped the loop at its head".into());
        return Ok(report);
    };
    report.kick_delivers_in_place = delivered == Some((target.rip, target.rbx));

    // Replay: a fresh run, the target patched to the trampoline.
    let mut vm = ProbeVm::looping(&kvm)?;
    let at = (target.rip - USER_CODE) as usize;
    let site = preempt::site::choose(target.rip, &LOOP_CODE[at..], &LOOP_CODE[..at])
        .map_err(|e| ProbeError::Memory(format!("the loop cannot be patched: {e}")))?;
    let stub = preempt::trampoline::build(
        STUB_PAGES,
        &[],
        |ip| {
            site.relocated(ip)
                .map_err(preempt::trampoline::StubError::Relocation)
        },
        site.resume(),
    )
    .map_err(|e| ProbeError::Memory(e.to_string()))?;
    let patch = preempt::trampoline::patch(target.rip, STUB_PAGES.code, site.len)
        .map_err(|e| ProbeError::Memory(e.to_string()))?;
    let w = |vm: &ProbeVm, addr: u64, bytes: &[u8]| {
        vm._mem
            .write_slice(bytes, GuestAddress(addr))
            .map_err(|e| ProbeError::Memory(e.to_string()))
    };
    w(&vm, STUB_PAGES.code, &stub.code)?;
    w(
        &vm,
        STUB_PAGES.data,
        &preempt::trampoline::data_page(&target, &[]),
    )?;
    w(&vm, target.rip, &patch)?;
    let started = std::time::Instant::now();
    let exited = loop {
        match vm.vcpu.run() {
            Ok(VcpuExit::MmioWrite(addr, _)) => break addr == STUB_PAGES.exit,
            Ok(VcpuExit::IoOut(..)) | Ok(VcpuExit::IrqWindowOpen) => continue,
            Err(e) if e.errno() == libc::EINTR => continue,
            _ => break false,
        }
    };
    report.search_ns = started.elapsed().as_nanos() as u64;
    if !exited {
        report.failure = Some("the trampoline never exited".into());
        return Ok(report);
    }
    let at_exit = vm.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
    report.rejected = at_exit.rbx;
    report.trampoline_found_state = at_exit.rax == target.rax
        && at_exit.rbx == target.rbx
        && at_exit.rsp == target.rsp
        && (at_exit.rflags & 0x8d5) == (target.rflags & 0x8d5);
    report.exit_rip_after_store = at_exit.rip == STUB_PAGES.code + stub.exit_end;
    // Complete the store without running the guest on, then deliver at
    // the target with the original code back in place.
    vm.vcpu.set_kvm_immediate_exit(1);
    let completed = vm.vcpu.run().err().map(|e| e.errno());
    vm.vcpu.set_kvm_immediate_exit(0);
    if completed != Some(libc::EINTR) {
        report.failure = Some(format!("completing the exit: {completed:?}"));
        return Ok(report);
    }
    w(&vm, target.rip, &LOOP_CODE[at..at + site.len])?;
    let mut regs = vm.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
    regs.rip = target.rip;
    vm.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))?;
    vm.inject(VECTOR)?;
    report.redirected_delivery = vm.delivered()? == Some((target.rip, target.rbx));
    Ok(report)
}
