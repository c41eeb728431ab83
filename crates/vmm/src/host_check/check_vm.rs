//! The check guest: a 4 MiB guest in 64-bit mode with a GDT (kernel and
//! user segments), a TSS, an IDT whose handlers report their vector, and
//! identity page tables open to user mode; guest code reports progress by
//! writing a marker byte to port 0xf1.

use kvm_bindings::{kvm_guest_debug, kvm_msr_entry, Msrs};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::{cpuid, kvm_ext};
use guest::boot::{descriptor_segment, gdt_entry};

#[derive(Debug, thiserror::Error)]
pub enum HostCheckError {
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

pub(super) fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> HostCheckError {
    move |source| HostCheckError::Kvm { op, source }
}

/// KVM, for a check guest.
pub(super) fn open_kvm() -> Result<Kvm, HostCheckError> {
    Kvm::new().map_err(HostCheckError::OpenKvm)
}

pub(super) const MEM_SIZE: usize = 4 << 20;
pub(super) const GDT: u64 = 0x500;
pub(super) const TSS: u64 = 0x600;
pub(super) const IDT: u64 = 0x2000;
pub(super) const HANDLERS: u64 = 0x3000;
pub(super) const KERNEL_CODE: u64 = 0x4000;
pub(super) const USER_CODE: u64 = 0x5000;
pub(super) const LSTAR_CODE: u64 = 0x6000;
pub(super) const KERNEL_STACK: u64 = 0x7000;
pub(super) const USER_STACK: u64 = 0x8000;
pub(super) const PML4: u64 = 0x9000;
pub(super) const PDPT: u64 = 0xa000;
pub(super) const PD: u64 = 0xb000;
pub(super) const MARKER_PORT: u16 = 0xf1;

pub(super) const KERNEL_CS: u16 = 0x08;
pub(super) const KERNEL_DS: u16 = 0x10;
pub(super) const USER_DS: u16 = 0x18;
pub(super) const USER_CS: u16 = 0x20;
pub(super) const TSS_SEL: u16 = 0x28;

pub(super) const MSR_STAR: u32 = 0xc000_0081;
pub(super) const MSR_LSTAR: u32 = 0xc000_0082;
pub(super) const MSR_SFMASK: u32 = 0xc000_0084;
pub(super) const EFER_SCE: u64 = 1;
pub(super) const CR4_TSD: u64 = 1 << 2;

/// Markers the check programs write.
pub(super) const M_LSTAR: u8 = 0x01;
pub(super) const M_AFTER: u8 = 0x02;
/// Handlers write 0x80 | vector.
pub(super) const M_VECTOR: u8 = 0x80;

/// What a check guest did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CheckVmExit {
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

/// One check guest.
pub(super) struct CheckVm {
    pub(super) vcpu: VcpuFd,
    _vm: VmFd,
    pub(super) _mem: GuestMemoryMmap,
}

/// Machine code for "write marker `m` to the marker port; halt".
pub(super) fn marker_code(m: u8) -> [u8; 5] {
    [0xb0, m, 0xe6, MARKER_PORT as u8, 0xf4]
}

/// Kernel code that enters user mode at USER_CODE with IOPL 3 (so user
/// code may write the marker port), via IRETQ.
pub(super) fn enter_user_code() -> Vec<u8> {
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

/// Descriptors of the check GDT: (selector, flags, base, limit).
pub(super) const KERNEL_CODE_DESC: (u16, u16, u32, u32) = (KERNEL_CS, 0xa09b, 0, 0xfffff);
pub(super) const KERNEL_DATA_DESC: (u16, u16, u32, u32) = (KERNEL_DS, 0xc093, 0, 0xfffff);
pub(super) const USER_DATA_DESC: (u16, u16, u32, u32) = (USER_DS, 0xc0f3, 0, 0xfffff);
pub(super) const USER_CODE_DESC: (u16, u16, u32, u32) = (USER_CS, 0xa0fb, 0, 0xfffff);
/// 64-bit TSS (available), byte-granular limit.
pub(super) const TSS_DESC: (u16, u16, u32, u32) = (TSS_SEL, 0x0089, TSS as u32, 0x67);

impl CheckVm {
    /// A check that enters user mode and runs `user`; a SYSCALL lands on
    /// the M_LSTAR marker.
    pub(super) fn user(kvm: &Kvm, user: &[u8], tsd: bool) -> Result<Self, HostCheckError> {
        CheckVm::new(kvm, &enter_user_code(), user, &marker_code(M_LSTAR), tsd)
    }

    /// A check that runs `body` in `mode`, then writes M_AFTER.
    pub(super) fn running(
        kvm: &Kvm,
        mode: Privilege,
        body: &[u8],
        tsd: bool,
    ) -> Result<Self, HostCheckError> {
        let (k, u) = in_mode(mode, body);
        CheckVm::new(kvm, &k, &u, &marker_code(M_LSTAR), tsd)
    }

    pub(super) fn new(
        kvm: &Kvm,
        kernel_code: &[u8],
        user_code: &[u8],
        lstar_code: &[u8],
        tsd: bool,
    ) -> Result<Self, HostCheckError> {
        let vm = kvm.create_vm().map_err(kvm_err("CREATE_VM"))?;
        vm.set_tss_address(0xfffb_d000)
            .map_err(kvm_err("SET_TSS_ADDR"))?;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)])
            .map_err(|e| HostCheckError::Memory(e.to_string()))?;
        let w = |addr: u64, bytes: &[u8]| {
            mem.write_slice(bytes, GuestAddress(addr))
                .map_err(|e| HostCheckError::Memory(e.to_string()))
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
        .map_err(|_| HostCheckError::Memory("MSR list".into()))?;
        vcpu.set_msrs(&msrs).map_err(kvm_err("SET_MSRS"))?;
        Ok(CheckVm {
            vcpu,
            _vm: vm,
            _mem: mem,
        })
    }

    pub(super) fn debug(&self, control: u32, dr0: Option<u64>) -> Result<(), HostCheckError> {
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

    pub(super) fn cpl(&self) -> u8 {
        self.vcpu
            .get_sregs()
            .map(|s| (s.cs.selector & 3) as u8)
            .unwrap_or(0xff)
    }

    /// Runs to the next event of interest.
    pub(super) fn next_event(&mut self) -> Result<CheckVmExit, HostCheckError> {
        for _ in 0..1000 {
            let exit = self.vcpu.run();
            let event = match exit {
                Ok(VcpuExit::IoOut(port, data)) if port == MARKER_PORT => {
                    let marker = data.first().copied().unwrap_or(0);
                    CheckVmExit::Marker { marker, cpl: 0 }
                }
                Ok(VcpuExit::Debug(arch)) => CheckVmExit::Debug {
                    exception: arch.exception,
                    pc: arch.pc,
                    cpl: 0,
                },
                Ok(VcpuExit::Hlt) => CheckVmExit::Halted,
                Ok(VcpuExit::Shutdown) => CheckVmExit::TripleFault,
                Ok(VcpuExit::InternalError) => CheckVmExit::EmulationFailure,
                Ok(VcpuExit::IoOut(..)) | Ok(VcpuExit::IoIn(..)) | Ok(VcpuExit::IrqWindowOpen) => {
                    continue
                }
                Ok(_) => CheckVmExit::Other,
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
                Err(e) => return Err(kvm_err("RUN")(e)),
            };
            return Ok(match event {
                CheckVmExit::Marker { marker, .. } => CheckVmExit::Marker {
                    marker,
                    cpl: self.cpl(),
                },
                CheckVmExit::Debug { exception, pc, .. } => CheckVmExit::Debug {
                    exception,
                    pc,
                    cpl: self.cpl(),
                },
                e => e,
            });
        }
        Ok(CheckVmExit::Other)
    }
}

/// Privilege of guest execution a check targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Privilege {
    Kernel,
    User,
}

/// Code that runs `body` in `mode` and then writes M_AFTER: returns
/// (kernel code, user code).
pub(super) fn in_mode(mode: Privilege, body: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut code = body.to_vec();
    code.extend(marker_code(M_AFTER));
    match mode {
        Privilege::Kernel => (code, marker_code(0x7f).to_vec()),
        Privilege::User => (enter_user_code(), code),
    }
}

pub(super) fn body_addr(mode: Privilege) -> u64 {
    match mode {
        Privilege::Kernel => KERNEL_CODE,
        Privilege::User => USER_CODE,
    }
}
