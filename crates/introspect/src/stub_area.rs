//! The pages the patched guest kernel maps into every process, and the
//! area in which it says where they are (struct insight_preempt_area,
//! guest-kernel-patches 0006): the trampoline code page (whose end holds
//! the probe gate, `crate::probe_gate`), its data page, and the exit page,
//! which is neither RAM nor a device, so that a store there leaves the
//! guest. Asynchronous points put their trampolines there, and probes
//! raise events through the gate.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// The exit page's guest physical address: no RAM, no device; a store
/// there is the trampoline saying "found" (asm/insight.h,
/// INSIGHT_EXIT_PAGE_PA).
pub const EXIT_PAGE_GPA: u64 = 0xd010_0000;
/// The guest kernel's area: magic "INSP" and version.
const AREA_MAGIC: u32 = 0x5053_4e49;
const AREA_VERSION: u32 = 1;
use crate::gva::PAGE_SIZE;

/// What the guest kernel's preemption area says about the task on the CPU
/// (struct insight_preempt_area).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestArea {
    /// The trampoline's code and data pages (guest physical).
    pub code_pa: u64,
    pub data_pa: u64,
    /// The current task's page-table root.
    pub cr3: u64,
    /// Where its process maps the trampoline pages (0: nowhere).
    pub stub_va: [u64; 2],
    /// Where user mode last resumed after the kernel (a patch must not
    /// cover it but with its first byte: the task may be about to resume
    /// there).
    pub resume_ip: u64,
}

impl GuestArea {
    /// Reads and checks the area at `gpa` (everything in it is the
    /// guest's word, so nothing is trusted).
    pub fn read(mem: &GuestMemoryMmap, gpa: u64) -> Result<Self, String> {
        let mut raw = [0u8; 64];
        mem.read_slice(&mut raw, GuestAddress(gpa))
            .map_err(|_| format!("the preemption area at {gpa:#x} is outside guest memory"))?;
        let word = |i: usize| u64::from_le_bytes(raw[i..i + 8].try_into().unwrap_or([0; 8]));
        let magic = u32::from_le_bytes(raw[0..4].try_into().unwrap_or([0; 4]));
        let version = u32::from_le_bytes(raw[4..8].try_into().unwrap_or([0; 4]));
        if magic != AREA_MAGIC || version != AREA_VERSION {
            return Err(format!(
                "no preemption area at {gpa:#x} (magic {magic:#x}, version {version})"
            ));
        }
        let area = GuestArea {
            code_pa: word(8),
            data_pa: word(16),
            cr3: word(32),
            stub_va: [word(40), word(48)],
            resume_ip: word(56),
        };
        let exit_pa = word(24);
        let in_ram = |pa: u64| {
            pa.is_multiple_of(PAGE_SIZE) && mem.address_in_range(GuestAddress(pa + PAGE_SIZE - 1))
        };
        if exit_pa != EXIT_PAGE_GPA || !in_ram(area.code_pa) || !in_ram(area.data_pa) {
            return Err(format!(
                "the preemption area at {gpa:#x} names impossible pages"
            ));
        }
        Ok(area)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn area_bytes(magic: u32, exit: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(magic.to_le_bytes());
        b.extend(AREA_VERSION.to_le_bytes());
        for w in [
            0x10_0000u64,
            0x10_1000,
            exit,
            0x20_0000,
            0x3f_d000,
            0x7fff_0000_0000,
            0x40_1000,
        ] {
            b.extend(w.to_le_bytes());
        }
        b
    }

    #[test]
    fn the_guest_area_is_checked_before_it_is_believed() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        mem.write_slice(&area_bytes(AREA_MAGIC, EXIT_PAGE_GPA), GuestAddress(0x1000))
            .unwrap();
        let a = GuestArea::read(&mem, 0x1000).unwrap();
        assert_eq!(a.cr3, 0x20_0000);
        assert_eq!(a.stub_va, [0x3f_d000, 0x7fff_0000_0000]);
        assert_eq!(a.resume_ip, 0x40_1000);
        mem.write_slice(&area_bytes(0, EXIT_PAGE_GPA), GuestAddress(0x1000))
            .unwrap();
        assert!(GuestArea::read(&mem, 0x1000).is_err());
        mem.write_slice(&area_bytes(AREA_MAGIC, 0x1000), GuestAddress(0x1000))
            .unwrap();
        assert!(GuestArea::read(&mem, 0x1000).is_err());
        assert!(GuestArea::read(&mem, 0xffff_0000).is_err());
    }
}
