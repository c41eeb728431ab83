//! Guest memory layout and the x86-64 Linux boot protocol: the kernel ELF,
//! the initramfs, the zero page, identity page tables, a GDT and the
//! registers the 64-bit entry point expects.

use std::path::{Path, PathBuf};

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{load_cmdline, Elf, KernelLoader};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

/// Guest-physical layout of the boot structures (below 1 MiB).
pub const GDT_ADDR: u64 = 0x500;
/// setup_data entries (the RNG seed), linked from the zero page.
pub const SETUP_DATA_ADDR: u64 = 0x6000;
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
pub const BOOT_STACK_ADDR: u64 = 0x8ff0;
pub const PML4_ADDR: u64 = 0x9000;
pub const PDPT_ADDR: u64 = 0xa000;
/// Page directories, one per GiB identity-mapped (up to 4).
pub const PD_ADDR: u64 = 0xb000;
pub const CMDLINE_ADDR: u64 = 0x20000;
/// x86 Linux accepts at most 2048 bytes of command line.
pub const CMDLINE_MAX: usize = 2048;
/// End of conventional memory usable by the guest (EBDA above).
pub const LOW_RAM_END: u64 = 0x9fc00;
/// Start of high memory: the kernel must load at or above it.
pub const HIGH_RAM_START: u64 = 0x10_0000;

/// setup_data type of a seed for the kernel's random number generator.
const SETUP_RNG_SEED: u32 = 9;
/// Bytes of seed handed to the kernel.
pub const RNG_SEED_LEN: usize = 32;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;

/// GDT selectors: null, 64-bit code, data, TSS.
const CODE_SELECTOR: u16 = 0x08;
const DATA_SELECTOR: u16 = 0x10;
const TSS_SELECTOR: u16 = 0x18;

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot load kernel {path}: {source} (an uncompressed ELF vmlinux is required)")]
    LoadKernel {
        path: PathBuf,
        source: linux_loader::loader::Error,
    },
    #[error("initramfs ({initrd} bytes) does not fit in guest memory above the kernel (ends at {kernel_end:#x}, RAM ends at {ram_end:#x})")]
    InitramfsTooLarge {
        initrd: u64,
        kernel_end: u64,
        ram_end: u64,
    },
    #[error("kernel command line is {len} bytes, more than the {CMDLINE_MAX} Linux accepts")]
    CmdlineTooLong { len: usize },
    #[error("invalid kernel command line: {0}")]
    Cmdline(linux_loader::cmdline::Error),
    #[error("cannot write boot data to guest memory: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
}

/// Where the boot data ended up.
#[derive(Clone, Copy, Debug)]
pub struct BootLayout {
    pub entry: u64,
    pub kernel_end: u64,
    pub initrd_addr: u64,
    pub initrd_size: u64,
}

/// Loads `kernel` (ELF vmlinux), the initramfs parts (concatenated, each
/// padded to 4 bytes as the kernel's unpacker allows), the command line,
/// the RNG seed and the zero page into `mem`.
///
/// The seed makes the guest's random number generator ready at once: a
/// kernel without one recomputes its entropy pool hash on every request
/// until enough interrupts have been seen, which costs tens of seconds
/// when the kernel is interpreted. It is an input of the run like any
/// other, so a replay can give the same one.
pub fn load_guest(
    mem: &GuestMemoryMmap,
    ram_size: u64,
    kernel: &Path,
    kernel_image: &[u8],
    initramfs: &[u8],
    cmdline: &str,
    rng_seed: &[u8; RNG_SEED_LEN],
) -> Result<BootLayout, BootError> {
    let mut image = std::io::Cursor::new(kernel_image);
    let loaded =
        Elf::load(mem, None, &mut image, Some(GuestAddress(HIGH_RAM_START))).map_err(|source| {
            BootError::LoadKernel {
                path: kernel.to_owned(),
                source,
            }
        })?;
    let kernel_end = loaded.kernel_end;

    // The initramfs goes at the top of RAM, page-aligned.
    let initrd_size = initramfs.len() as u64;
    let initrd_addr = ram_size
        .checked_sub(initrd_size)
        .map(|a| a & !0xfff)
        .filter(|&a| a >= kernel_end.next_multiple_of(0x1000))
        .ok_or(BootError::InitramfsTooLarge {
            initrd: initrd_size,
            kernel_end,
            ram_end: ram_size,
        })?;
    mem.write_slice(initramfs, GuestAddress(initrd_addr))?;

    if cmdline.len() >= CMDLINE_MAX {
        return Err(BootError::CmdlineTooLong { len: cmdline.len() });
    }
    let mut cl = Cmdline::new(CMDLINE_MAX).map_err(BootError::Cmdline)?;
    cl.insert_str(cmdline).map_err(BootError::Cmdline)?;
    load_cmdline(mem, GuestAddress(CMDLINE_ADDR), &cl).map_err(|_| {
        BootError::GuestMemory(vm_memory::GuestMemoryError::InvalidGuestAddress(
            GuestAddress(CMDLINE_ADDR),
        ))
    })?;

    // struct setup_data { u64 next; u32 type; u32 len; u8 data[]; }
    let mut setup = Vec::with_capacity(16 + RNG_SEED_LEN);
    setup.extend_from_slice(&0u64.to_le_bytes());
    setup.extend_from_slice(&SETUP_RNG_SEED.to_le_bytes());
    setup.extend_from_slice(&(RNG_SEED_LEN as u32).to_le_bytes());
    setup.extend_from_slice(rng_seed);
    mem.write_slice(&setup, GuestAddress(SETUP_DATA_ADDR))?;

    let mut params = zero_page(ram_size, cmdline.len(), initrd_addr, initrd_size);
    params.hdr.setup_data = SETUP_DATA_ADDR;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_ADDR))?;
    write_gdt(mem)?;
    write_page_tables(mem, ram_size)?;

    Ok(BootLayout {
        entry: loaded.kernel_load.raw_value(),
        kernel_end,
        initrd_addr,
        initrd_size,
    })
}

fn zero_page(ram_size: u64, cmdline_len: usize, initrd_addr: u64, initrd_size: u64) -> boot_params {
    let mut p = boot_params::default();
    p.hdr.type_of_loader = 0xff;
    p.hdr.boot_flag = 0xaa55;
    p.hdr.header = 0x5372_6448; // "HdrS"
    p.hdr.version = 0x020f;
    p.hdr.loadflags = 0x01; // LOADED_HIGH
    p.hdr.kernel_alignment = 0x100_0000;
    p.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    p.hdr.cmdline_size = cmdline_len as u32;
    p.hdr.ramdisk_image = initrd_addr as u32;
    p.hdr.ramdisk_size = initrd_size as u32;
    let map = [
        (0, LOW_RAM_END, E820_RAM),
        (LOW_RAM_END, HIGH_RAM_START - LOW_RAM_END, E820_RESERVED),
        (HIGH_RAM_START, ram_size - HIGH_RAM_START, E820_RAM),
    ];
    for (i, (addr, size, kind)) in map.into_iter().enumerate() {
        p.e820_table[i] = boot_e820_entry {
            addr,
            size,
            r#type: kind,
        };
    }
    p.e820_entries = map.len() as u8;
    p
}

/// Packs a GDT descriptor from flags (the 0xF0FF bits of the access and
/// flags bytes), base and limit.
pub fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (u64::from(flags), u64::from(base), u64::from(limit));
    ((base & 0xff00_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
        | ((limit & 0x000f_0000) << 32)
        | ((flags & 0xf0ff) << 40)
}

const GDT: [(u16, u32, u32); 4] = [
    (0, 0, 0),
    (0xa09b, 0, 0xfffff), // 64-bit code, DPL 0
    (0xc093, 0, 0xfffff), // data, DPL 0
    (0x808b, 0, 0xfffff), // 64-bit TSS (busy)
];

fn write_gdt(mem: &GuestMemoryMmap) -> Result<(), BootError> {
    for (i, (flags, base, limit)) in GDT.iter().enumerate() {
        mem.write_obj(
            gdt_entry(*flags, *base, *limit),
            GuestAddress(GDT_ADDR + 8 * i as u64),
        )?;
    }
    Ok(())
}

/// Identity-maps the first GiBs of guest-physical memory with 2 MiB pages.
fn write_page_tables(mem: &GuestMemoryMmap, ram_size: u64) -> Result<(), BootError> {
    const PRESENT_RW: u64 = 0x3;
    const HUGE: u64 = 0x80;
    let gibs = ram_size.div_ceil(1 << 30).clamp(1, 4);
    mem.write_obj(PDPT_ADDR | PRESENT_RW, GuestAddress(PML4_ADDR))?;
    for g in 0..gibs {
        let pd = PD_ADDR + g * 0x1000;
        mem.write_obj(pd | PRESENT_RW, GuestAddress(PDPT_ADDR + g * 8))?;
        for i in 0..512u64 {
            let phys = (g << 30) | (i << 21);
            mem.write_obj(phys | PRESENT_RW | HUGE, GuestAddress(pd + i * 8))?;
        }
    }
    Ok(())
}

fn segment(selector: u16) -> kvm_segment {
    let (flags, base, limit) = GDT[usize::from(selector >> 3)];
    descriptor_segment(selector, flags, base, limit)
}

/// The `kvm_segment` a descriptor with these flags, base and limit (as
/// for [`gdt_entry`]) loads into a segment register.
pub fn descriptor_segment(selector: u16, flags: u16, base: u32, limit: u32) -> kvm_segment {
    let g = (flags >> 15) & 1;
    kvm_segment {
        base: u64::from(base),
        limit: if g == 1 { (limit << 12) | 0xfff } else { limit },
        selector,
        type_: (flags & 0xf) as u8,
        present: ((flags >> 7) & 1) as u8,
        dpl: ((flags >> 5) & 3) as u8,
        db: ((flags >> 14) & 1) as u8,
        s: ((flags >> 4) & 1) as u8,
        l: ((flags >> 13) & 1) as u8,
        g: g as u8,
        avl: ((flags >> 12) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

/// Special registers for the 64-bit entry: long mode with paging on the
/// identity map, flat segments from the GDT above.
pub fn boot_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (8 * GDT.len() - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cs = segment(CODE_SELECTOR);
    let data = segment(DATA_SELECTOR);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(TSS_SELECTOR);
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = X86_CR4_PAE;
    sregs.cr0 = X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
    sregs.efer = EFER_LME | EFER_LMA;
    sregs
}

/// General registers for the 64-bit entry point.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsp: BOOT_STACK_ADDR,
        rbp: BOOT_STACK_ADDR,
        rsi: ZERO_PAGE_ADDR,
        rflags: 0x2,
        ..Default::default()
    }
}

/// FPU state after reset.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_match_the_architectural_encoding() {
        assert_eq!(gdt_entry(0xa09b, 0, 0xfffff), 0x00af_9b00_0000_ffff);
        assert_eq!(gdt_entry(0xc093, 0, 0xfffff), 0x00cf_9300_0000_ffff);
        let cs = segment(CODE_SELECTOR);
        assert_eq!(
            (cs.l, cs.db, cs.type_, cs.g, cs.limit),
            (1, 0, 0xb, 1, 0xffff_ffff)
        );
    }

    #[test]
    fn page_tables_identity_map_ram() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        write_page_tables(&mem, 64 << 20).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_ADDR)).unwrap();
        assert_eq!(pml4, PDPT_ADDR | 3);
        let pde: u64 = mem.read_obj(GuestAddress(PD_ADDR + 8 * 8)).unwrap();
        assert_eq!(pde, (8 << 21) | 0x83);
    }

    #[test]
    fn e820_map_covers_ram_minus_the_bios_hole() {
        let p = zero_page(128 << 20, 10, 0x700_0000, 0x1000);
        assert_eq!(p.e820_entries, 3);
        let last = p.e820_table[2];
        let (addr, size, kind) = (last.addr, last.size, last.r#type);
        assert_eq!(
            (addr, size, kind),
            (HIGH_RAM_START, (128 << 20) - HIGH_RAM_START, E820_RAM)
        );
        let ramdisk = p.hdr.ramdisk_image;
        assert_eq!(ramdisk, 0x700_0000);
    }

    #[test]
    fn non_elf_kernel_is_refused() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        let k = Path::new("/boot/bzImage");
        let err = load_guest(
            &mem,
            64 << 20,
            k,
            b"MZ not an elf file at all",
            &[],
            "",
            &[0; 32],
        )
        .unwrap_err();
        assert!(err.to_string().contains("ELF"), "{err}");
        assert!(err.to_string().contains("/boot/bzImage"), "{err}");
    }
}
