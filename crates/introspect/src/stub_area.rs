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
/// The guest kernel's area: magic "INSP" and version (2 adds the event
/// ring).
const AREA_MAGIC: u32 = 0x5053_4e49;
const AREA_VERSIONS: std::ops::RangeInclusive<u32> = 1..=2;
/// The most pages an event ring may have.
const RING_MAX_PAGES: u64 = 1024;
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
    /// The replay's event ring (`crate::event_ring`), mapped right below
    /// the code page of each mapping: its first page (guest physical) and
    /// its length in pages. None from kernels without one.
    pub ring: Option<(u64, u64)>,
}

impl GuestArea {
    /// Reads and checks the area at `gpa` (everything in it is the
    /// guest's word, so nothing is trusted).
    pub fn read(mem: &GuestMemoryMmap, gpa: u64) -> Result<Self, String> {
        let mut raw = [0u8; 80];
        mem.read_slice(&mut raw, GuestAddress(gpa))
            .map_err(|_| format!("the preemption area at {gpa:#x} is outside guest memory"))?;
        let word = |i: usize| u64::from_le_bytes(raw[i..i + 8].try_into().unwrap_or([0; 8]));
        let magic = u32::from_le_bytes(raw[0..4].try_into().unwrap_or([0; 4]));
        let version = u32::from_le_bytes(raw[4..8].try_into().unwrap_or([0; 4]));
        if magic != AREA_MAGIC || !AREA_VERSIONS.contains(&version) {
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
            ring: (version >= 2 && word(64) != 0).then(|| (word(64), word(72))),
        };
        let exit_pa = word(24);
        let in_ram = |pa: u64, pages: u64| {
            pa.is_multiple_of(PAGE_SIZE)
                && mem.address_in_range(GuestAddress(pa))
                && mem.address_in_range(GuestAddress(pa + pages * PAGE_SIZE - 1))
        };
        let ring_ok = area
            .ring
            .is_none_or(|(pa, pages)| (2..=RING_MAX_PAGES).contains(&pages) && in_ram(pa, pages));
        if exit_pa != EXIT_PAGE_GPA
            || !in_ram(area.code_pa, 1)
            || !in_ram(area.data_pa, 1)
            || !ring_ok
        {
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
        area_with_ring(magic, exit, 1, (0, 0))
    }

    fn area_with_ring(magic: u32, exit: u64, version: u32, ring: (u64, u64)) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(magic.to_le_bytes());
        b.extend(version.to_le_bytes());
        for w in [
            0x10_0000u64,
            0x10_1000,
            exit,
            0x20_0000,
            0x3f_d000,
            0x7fff_0000_0000,
            0x40_1000,
            ring.0,
            ring.1,
        ] {
            b.extend(w.to_le_bytes());
        }
        b
    }

    #[test]
    fn a_version_2_area_names_an_event_ring_inside_guest_memory() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let put = |b: Vec<u8>| mem.write_slice(&b, GuestAddress(0x1000)).unwrap();
        put(area_with_ring(
            AREA_MAGIC,
            EXIT_PAGE_GPA,
            2,
            (0x20_0000, 64),
        ));
        assert_eq!(
            GuestArea::read(&mem, 0x1000).unwrap().ring,
            Some((0x20_0000, 64))
        );
        // Version 1 has no ring, whatever follows the area.
        put(area_with_ring(
            AREA_MAGIC,
            EXIT_PAGE_GPA,
            1,
            (0x20_0000, 64),
        ));
        assert_eq!(GuestArea::read(&mem, 0x1000).unwrap().ring, None);
        put(area_with_ring(AREA_MAGIC, EXIT_PAGE_GPA, 2, (0, 0)));
        assert_eq!(GuestArea::read(&mem, 0x1000).unwrap().ring, None);
        // Past the end of memory, unaligned, or absurdly long: refused.
        for ring in [
            (0x3f_0000, 64),
            (0x20_0800, 64),
            (0x20_0000, 1 << 40),
            (0x20_0000, 1),
        ] {
            put(area_with_ring(AREA_MAGIC, EXIT_PAGE_GPA, 2, ring));
            assert!(GuestArea::read(&mem, 0x1000).is_err(), "{ring:x?}");
        }
        put(area_with_ring(AREA_MAGIC, EXIT_PAGE_GPA, 3, (0, 0)));
        assert!(GuestArea::read(&mem, 0x1000).is_err());
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
