//! Guest-virtual to guest-physical translation by walking the guest's
//! 4-level page tables in guest memory, and reads through it.
//!
//! Everything read here is guest-controlled: a malformed table yields an
//! error, never a panic or a read outside guest memory.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const PRESENT: u64 = 1;
const WRITABLE: u64 = 1 << 1;
const USER: u64 = 1 << 2;
const ACCESSED: u64 = 1 << 5;
const DIRTY: u64 = 1 << 6;
const HUGE: u64 = 1 << 7;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

/// The size of a guest page (4 KiB pages; larger ones are multiples).
pub const PAGE_SIZE: u64 = 4096;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TranslateError {
    #[error("guest virtual address {0:#x} is not mapped")]
    NotMapped(u64),
    #[error("guest virtual address {0:#x} is not writable")]
    NotWritable(u64),
    #[error("guest virtual address {0:#x} is not accessible from user mode")]
    NotUser(u64),
    #[error("guest page table at {0:#x} is outside guest memory")]
    TableOutsideMemory(u64),
    #[error("guest virtual address {0:#x} maps outside guest memory")]
    OutsideMemory(u64),
}

/// Translates `gva` with page-table root `cr3` (4-level paging).
pub fn translate(mem: &GuestMemoryMmap, cr3: u64, gva: u64) -> Result<u64, TranslateError> {
    translate_access(mem, cr3, gva, false)
}

/// Translates `gva` for a read or a write. Writes need every level
/// writable, as for a supervisor access with CR0.WP set (Linux's setting):
/// a copy-on-write page must fault, not be written behind the guest's back.
/// Does not touch the accessed and dirty bits; see [`access`].
pub fn translate_access(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    write: bool,
) -> Result<u64, TranslateError> {
    walk(mem, cr3, gva, write, false)
}

/// Translates `gva` as a user-mode read would see it: every level present
/// and open to user mode. Does not touch the accessed bits.
pub fn translate_user(mem: &GuestMemoryMmap, cr3: u64, gva: u64) -> Result<u64, TranslateError> {
    walk(mem, cr3, gva, false, true)
}

/// Translates `gva` as a user-mode read or write would: every level
/// present and open to user mode, and writable for a write. Does not touch
/// the accessed bits.
pub fn translate_user_access(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    write: bool,
) -> Result<u64, TranslateError> {
    walk(mem, cr3, gva, write, true)
}

/// Reads `buf.len()` bytes at `gva` without touching the accessed bits:
/// the VMM looking, not the guest accessing (the guest's page tables stay
/// exactly as they were).
pub fn peek_virt(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    buf: &mut [u8],
) -> Result<(), TranslateError> {
    let len = buf.len();
    let translate = |va| translate(mem, cr3, va);
    for_each_page(gva, len, translate, |off, n, pa| {
        mem.read_slice(&mut buf[off..off + n], GuestAddress(pa))
    })
    .1
}

/// Reads what a user-mode read of `buf.len()` bytes at `gva` would see,
/// page by page up to the first page that is not mapped, not open to user
/// mode or outside guest memory; how many bytes it read. Does not touch
/// the accessed bits.
pub fn peek_user(mem: &GuestMemoryMmap, cr3: u64, gva: u64, buf: &mut [u8]) -> usize {
    let len = buf.len();
    let translate = |va| translate_user(mem, cr3, va);
    for_each_page(gva, len, translate, |off, n, pa| {
        mem.read_slice(&mut buf[off..off + n], GuestAddress(pa))
    })
    .0
}

/// The guest physical addresses of the entries a walk for `gva` reads,
/// from the top level to the last-level entry that maps it (a 4 KiB
/// page's PTE, or a huge page's directory entry).
pub fn path_entries(mem: &GuestMemoryMmap, cr3: u64, gva: u64) -> Result<Vec<u64>, TranslateError> {
    let mut table = cr3 & ADDR_MASK;
    let mut path = Vec::with_capacity(4);
    for level in (0..4).rev() {
        let shift = 12 + 9 * level;
        let entry_addr = table + ((gva >> shift) & 0x1ff) * 8;
        let entry: u64 = mem
            .read_obj(GuestAddress(entry_addr))
            .map_err(|_| TranslateError::TableOutsideMemory(entry_addr))?;
        if entry & PRESENT == 0 {
            return Err(TranslateError::NotMapped(gva));
        }
        path.push(entry_addr);
        if level == 0 || (entry & HUGE != 0 && (level == 1 || level == 2)) {
            return Ok(path);
        }
        table = entry & ADDR_MASK;
    }
    Err(TranslateError::NotMapped(gva))
}

/// The guest physical frames the address space `cr3` maps for user mode
/// (the user bit set at every level), as ascending, merged (first frame,
/// count) runs. Each table is read once however often it is referenced,
/// so a guest's aliased tables cost no more than its memory holds;
/// entries outside guest memory are skipped.
pub fn user_frames(mem: &GuestMemoryMmap, cr3: u64) -> Vec<(u64, u64)> {
    let mut runs = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // (table, level): the PML4's lower half holds user space.
    let mut tables = vec![(cr3 & ADDR_MASK, 3u32, 256usize)];
    let mut entries = [0u64; 512];
    while let Some((table, level, count)) = tables.pop() {
        if !seen.insert((table, level)) {
            continue;
        }
        let mut bytes = [0u8; 4096];
        if mem.read_slice(&mut bytes, GuestAddress(table)).is_err() {
            continue;
        }
        for (e, chunk) in entries.iter_mut().zip(bytes.chunks_exact(8)) {
            *e = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
        }
        for &entry in &entries[..count] {
            if entry & (PRESENT | USER) != PRESENT | USER {
                continue;
            }
            let frame = (entry & ADDR_MASK) >> 12;
            match level {
                0 => runs.push((frame, 1)),
                1 | 2 if entry & HUGE != 0 => {
                    let pages = 1u64 << (9 * level);
                    runs.push((frame & !(pages - 1), pages));
                }
                _ => tables.push((entry & ADDR_MASK, level - 1, 512)),
            }
        }
    }
    runs.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
    for (first, count) in runs {
        match merged.last_mut() {
            Some((f, c)) if first <= *f + *c => *c = (*c).max(first + count - *f),
            _ => merged.push((first, count)),
        }
    }
    merged
}

/// Whether `frame` lies in one of the ascending `runs` of [`user_frames`].
pub fn in_runs(runs: &[(u64, u64)], frame: u64) -> bool {
    let i = runs.partition_point(|&(first, _)| first <= frame);
    i > 0 && frame < runs[i - 1].0 + runs[i - 1].1
}

/// The accessed and dirty bits of a page-table entry.
pub const ACCESSED_DIRTY: u64 = ACCESSED | DIRTY;

fn walk(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    write: bool,
    user: bool,
) -> Result<u64, TranslateError> {
    let mut table = cr3 & ADDR_MASK;
    let mut writable = true;
    // Levels: PML4 (bits 47..39), PDPT (38..30), PD (29..21), PT (20..12).
    for level in (0..4).rev() {
        let shift = 12 + 9 * level;
        let index = (gva >> shift) & 0x1ff;
        let entry_addr = table + index * 8;
        let entry: u64 = mem
            .read_obj(GuestAddress(entry_addr))
            .map_err(|_| TranslateError::TableOutsideMemory(entry_addr))?;
        if entry & PRESENT == 0 {
            return Err(TranslateError::NotMapped(gva));
        }
        writable &= entry & WRITABLE != 0;
        if user && entry & USER == 0 {
            return Err(TranslateError::NotUser(gva));
        }
        let page_mask = (1u64 << shift) - 1;
        if level == 0 || (entry & HUGE != 0 && (level == 1 || level == 2)) {
            if write && !writable {
                return Err(TranslateError::NotWritable(gva));
            }
            return Ok((entry & ADDR_MASK & !page_mask) | (gva & page_mask));
        }
        table = entry & ADDR_MASK;
    }
    Err(TranslateError::NotMapped(gva))
}

/// Translates `gva` like [`translate_access`] and, as the CPU does for an
/// access it performs, sets the accessed bit at every level and, for a
/// write, the dirty bit of the leaf (Linux relies on it, e.g. to keep a
/// lazily freed page that was written). The vCPU is stopped while this
/// runs, so plain read-modify-writes of the entries are safe.
pub fn access(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    write: bool,
) -> Result<u64, TranslateError> {
    let pa = translate_access(mem, cr3, gva, write)?;
    let mut table = cr3 & ADDR_MASK;
    for level in (0..4).rev() {
        let shift = 12 + 9 * level;
        let entry_addr = table + ((gva >> shift) & 0x1ff) * 8;
        let entry: u64 = mem
            .read_obj(GuestAddress(entry_addr))
            .map_err(|_| TranslateError::TableOutsideMemory(entry_addr))?;
        let leaf = level == 0 || (entry & HUGE != 0 && (level == 1 || level == 2));
        let mut updated = entry | ACCESSED;
        if leaf && write {
            updated |= DIRTY;
        }
        if updated != entry {
            mem.write_obj(updated, GuestAddress(entry_addr))
                .map_err(|_| TranslateError::TableOutsideMemory(entry_addr))?;
        }
        if leaf {
            break;
        }
        table = entry & ADDR_MASK;
    }
    Ok(pa)
}

/// Goes over `len` bytes from `gva` a page's piece at a time: `translate`
/// gives each piece's guest-physical address and `f` gets its offset,
/// length and address. Stops at the first piece either fails for (`f`'s
/// failure is the piece's `OutsideMemory`): how many bytes were done, and
/// why it stopped before the end.
fn for_each_page<E>(
    gva: u64,
    len: usize,
    translate: impl Fn(u64) -> Result<u64, TranslateError>,
    mut f: impl FnMut(usize, usize, u64) -> Result<(), E>,
) -> (usize, Result<(), TranslateError>) {
    let mut done = 0;
    while done < len {
        let va = gva.wrapping_add(done as u64);
        let n = ((0x1000 - (va & 0xfff)) as usize).min(len - done);
        let piece = translate(va)
            .and_then(|pa| f(done, n, pa).map_err(|_| TranslateError::OutsideMemory(va)));
        if let Err(e) = piece {
            return (done, Err(e));
        }
        done += n;
    }
    (done, Ok(()))
}

/// Checks that user code could write `len` bytes at `gva`: every page
/// present, open to user mode and writable. Touches nothing; the error
/// names the first page that is not.
pub fn user_writable(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    len: usize,
) -> Result<(), TranslateError> {
    let translate = |va| translate_user_access(mem, cr3, va, true);
    for_each_page(gva, len, translate, |_, _, _| Ok::<(), ()>(())).1
}

/// Reads `buf.len()` bytes at `gva`, page by page.
pub fn read_virt(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    buf: &mut [u8],
) -> Result<(), TranslateError> {
    let len = buf.len();
    let translate = |va| access(mem, cr3, va, false);
    for_each_page(gva, len, translate, |off, n, pa| {
        mem.read_slice(&mut buf[off..off + n], GuestAddress(pa))
    })
    .1
}

/// Writes `buf` at `gva`, page by page; fails on the first page that is
/// absent or read-only (earlier pages stay written, as with hardware).
pub fn write_virt(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    buf: &[u8],
) -> Result<(), TranslateError> {
    write_virt_pieces(mem, cr3, gva, buf).map(|_| ())
}

/// [`write_virt`], returning the guest-physical address of each piece
/// written (each within one page), for who tracks the pages written.
pub fn write_virt_pieces(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    buf: &[u8],
) -> Result<Vec<u64>, TranslateError> {
    let translate = |va| access(mem, cr3, va, true);
    let mut pieces = Vec::new();
    for_each_page(gva, buf.len(), translate, |off, n, pa| {
        pieces.push(pa);
        mem.write_slice(&buf[off..off + n], GuestAddress(pa))
    })
    .1
    .map(|()| pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap()
    }

    fn put(m: &GuestMemoryMmap, addr: u64, v: u64) {
        m.write_obj(v, GuestAddress(addr)).unwrap();
    }

    /// CR3 0x1000 -> PDPT 0x2000 -> PD 0x3000 -> PT 0x4000.
    fn tables(m: &GuestMemoryMmap) {
        let va = 0xffff_8000_0040_0000u64;
        put(m, 0x1000 + ((va >> 39) & 0x1ff) * 8, 0x2000 | 3);
        put(m, 0x2000 + ((va >> 30) & 0x1ff) * 8, 0x3000 | 3);
        // 4 KiB page for the first 2 MiB of that region: PT at 0x4000.
        put(m, 0x3000 + ((va >> 21) & 0x1ff) * 8, 0x4000 | 3);
        put(m, 0x4000 + 5 * 8, 0x10_0000 | 3);
        // A 2 MiB page right after.
        put(m, 0x3000 + (((va >> 21) & 0x1ff) + 1) * 8, 0x20_0000 | 0x83);
        // A read-only 4 KiB page.
        put(m, 0x4000 + 7 * 8, 0x11_0000 | 1);
    }

    /// User space under CR3 0x1000: PML4[0] -> PDPT 0x6000 -> PD 0x7000,
    /// whose second entry (2 MiB up) is PT 0x8000 holding `pt`.
    fn user_tables(m: &GuestMemoryMmap, pt: &[u64]) {
        put(m, 0x1000, 0x6000 | 7);
        put(m, 0x6000, 0x7000 | 7);
        put(m, 0x7000 + 8, 0x8000 | 7);
        for (i, &entry) in pt.iter().enumerate() {
            put(m, 0x8000 + 8 * i as u64, entry);
        }
    }

    #[test]
    fn user_frames_are_those_mapped_user_at_every_level() {
        let m = mem();
        // User space: PML4[0] -> PDPT 0x6000 -> PD 0x7000, which maps a
        // 2 MiB user page and, through PT 0x8000, two user pages and one
        // supervisor page. PML4[1] is not user; PML4[2] aliases PDPT
        // 0x6000 (walked once). The kernel half (tables()) does not count.
        tables(&m);
        user_tables(&m, &[0x9000 | 7, 0xa000 | 5, 0xb000 | 3]);
        put(&m, 0x1000 + 8, 0x6000 | 3);
        put(&m, 0x1000 + 16, 0x6000 | 7);
        put(&m, 0x7000, 0x40_0000 | 0x87);
        let runs = user_frames(&m, 0x1000);
        assert_eq!(runs, [(0x9, 2), (0x400, 512)]);
        assert!(in_runs(&runs, 0x9) && in_runs(&runs, 0xa) && in_runs(&runs, 0x5ff));
        assert!(!in_runs(&runs, 0xb) && !in_runs(&runs, 0x8) && !in_runs(&runs, 0x600));
        assert!(!in_runs(&runs, 0x100));
        // A table pointing at itself ends.
        put(&m, 0x8000 + 24, 0x8000 | 7);
        put(&m, 0x7000 + 16, 0x7000 | 7);
        assert_eq!(user_frames(&m, 0x1000).len(), 2);
    }

    #[test]
    fn user_reads_stop_at_the_first_page_user_mode_cannot_read() {
        let m = mem();
        tables(&m);
        // User pages 0x9000 and 0xa000, then a supervisor page, a page
        // outside guest memory, and none.
        let pages = [0x9000 | 7, 0xa000 | 7, 0xb000 | 3, 0x7f00_0000 | 7];
        user_tables(&m, &pages);
        m.write_slice(b"abcd", GuestAddress(0x9ffe)).unwrap();
        m.write_slice(b"efgh", GuestAddress(0xaffe)).unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(peek_user(&m, 0x1000, 0x20_0ffe, &mut buf), 4);
        assert_eq!(&buf, b"abcd");
        let mut buf = [0u8; 4];
        assert_eq!(peek_user(&m, 0x1000, 0x20_1ffe, &mut buf), 2);
        assert_eq!(&buf, b"ef\0\0");
        // The kernel's view reads the supervisor page.
        peek_virt(&m, 0x1000, 0x20_1ffe, &mut buf).unwrap();
        assert_eq!(&buf, b"efgh");
        assert_eq!(peek_user(&m, 0x1000, 0x20_3000, &mut buf), 0);
        assert_eq!(
            peek_virt(&m, 0x1000, 0x20_3000, &mut buf),
            Err(TranslateError::OutsideMemory(0x20_3000))
        );
        assert_eq!(peek_user(&m, 0x1000, 0x20_4000, &mut buf), 0);
        assert_eq!(peek_user(&m, 0x1000, 0x20_0000, &mut []), 0);
        // No byte of the tables changed: no accessed bit set.
        let mut entry = [0u8; 8];
        m.read_slice(&mut entry, GuestAddress(0x8000)).unwrap();
        assert_eq!(u64::from_le_bytes(entry), 0x9000 | 7);
    }

    #[test]
    fn user_writable_names_the_first_page_user_code_cannot_write() {
        let m = mem();
        tables(&m);
        // Writable user pages, a read-only user page, a supervisor page.
        user_tables(&m, &[0x9000 | 7, 0xa000 | 7, 0xb000 | 5, 0xc000 | 3]);
        assert_eq!(user_writable(&m, 0x1000, 0x20_0800, 0x1800), Ok(()));
        let read_only = user_writable(&m, 0x1000, 0x20_1ff8, 16);
        assert!(read_only.is_err_and(|e| e.to_string().contains("0x202000")));
        assert!(user_writable(&m, 0x1000, 0x20_3000, 1).is_err());
        assert_eq!(user_writable(&m, 0x1000, 0x20_2000, 0), Ok(()));
        // Nothing was touched: no accessed bit set.
        let mut entry = [0u8; 8];
        m.read_slice(&mut entry, GuestAddress(0x8000)).unwrap();
        assert_eq!(u64::from_le_bytes(entry), 0x9000 | 7);
    }

    #[test]
    fn walks_4k_and_2m_pages() {
        let m = mem();
        tables(&m);
        let base = 0xffff_8000_0040_0000u64;
        assert_eq!(translate(&m, 0x1000, base + 0x5123), Ok(0x10_0123));
        assert_eq!(
            translate(&m, 0x1000, base + 0x20_0000 + 0x1234),
            Ok(0x20_1234)
        );
        assert_eq!(
            translate(&m, 0x1000, base + 0x6000),
            Err(TranslateError::NotMapped(base + 0x6000))
        );
    }

    #[test]
    fn random_page_tables_never_panic() {
        let m = mem();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        // Guest-controlled garbage in the first 64 KiB: a quarter of the
        // entries not present, a quarter present and pointing anywhere
        // (often outside guest memory), half present and pointing into the
        // garbage itself, so that some walks end in a translation.
        let mut image = vec![0u64; 8192];
        for (i, slot) in image.iter_mut().enumerate() {
            let raw = next();
            let entry = match raw % 4 {
                0 | 1 => (raw & 0xf000) | (raw & 0xfff) | 1,
                _ => raw,
            };
            *slot = entry;
            put(&m, i as u64 * 8, entry);
        }
        // The walk the architecture defines, over the test's own copy of
        // those tables (the rest of the 8 MiB is zero).
        let expected = |cr3: u64, va: u64| {
            let mut table = cr3 & ADDR_MASK;
            for level in (0..4).rev() {
                let shift = 12 + 9 * level;
                let at = table + ((va >> shift) & 0x1ff) * 8;
                let entry = if at + 8 > 8 << 20 {
                    return Err(TranslateError::TableOutsideMemory(at));
                } else if at < 0x10000 {
                    image[at as usize / 8]
                } else {
                    0
                };
                if entry & PRESENT == 0 {
                    return Err(TranslateError::NotMapped(va));
                }
                let mask = (1u64 << shift) - 1;
                if level == 0 || (entry & HUGE != 0 && level <= 2) {
                    return Ok((entry & ADDR_MASK & !mask) | (va & mask));
                }
                table = entry & ADDR_MASK;
            }
            unreachable!("level 0 ends the walk")
        };
        let mut buf = [0u8; 64];
        let (mut mapped, mut unmapped) = (0, 0);
        let (mut not_present, mut outside) = (0, 0);
        for _ in 0..20_000 {
            let cr3 = next() & 0xf000;
            let va = next();
            // Each walk ends where the tables say: a translation, a
            // non-present entry, or a table outside guest memory.
            let result = translate(&m, cr3, va);
            assert_eq!(result, expected(cr3, va), "cr3 {cr3:#x} va {va:#x}");
            match result {
                Err(TranslateError::NotMapped(_)) => not_present += 1,
                Err(TranslateError::TableOutsideMemory(_)) => outside += 1,
                _ => {}
            }
            match result {
                // A translation keeps the offset in the page, and what it
                // reads is guest memory at that address.
                Ok(pa) => {
                    assert_eq!(pa & 0xfff, va & 0xfff, "{va:#x} -> {pa:#x}");
                    let mut byte = [0u8; 1];
                    if read_virt(&m, cr3, va, &mut byte).is_ok() {
                        let at: u8 = m.read_obj(GuestAddress(pa)).unwrap();
                        assert_eq!(byte[0], at, "{va:#x} -> {pa:#x}");
                    }
                    mapped += 1;
                }
                // What does not translate cannot be read.
                Err(_) => {
                    assert!(read_virt(&m, cr3, va, &mut buf).is_err(), "{va:#x}");
                    unmapped += 1;
                }
            }
        }
        assert!(
            mapped > 0 && unmapped > 0,
            "{mapped} mapped, {unmapped} not"
        );
        assert!(
            not_present > 0 && outside > 0,
            "{not_present} not present, {outside} outside guest memory"
        );
    }

    #[test]
    fn accesses_set_accessed_and_dirty_bits() {
        let m = mem();
        tables(&m);
        let base = 0xffff_8000_0040_0000u64;
        let mut buf = [0u8; 1];
        read_virt(&m, 0x1000, base + 0x5000, &mut buf).unwrap();
        let pte: u64 = m.read_obj(GuestAddress(0x4000 + 5 * 8)).unwrap();
        assert_eq!(pte & (ACCESSED | DIRTY), ACCESSED);
        write_virt(&m, 0x1000, base + 0x5000, b"x").unwrap();
        let pte: u64 = m.read_obj(GuestAddress(0x4000 + 5 * 8)).unwrap();
        assert_eq!(pte & (ACCESSED | DIRTY), ACCESSED | DIRTY);
        let pml4e: u64 = m
            .read_obj(GuestAddress(0x1000 + ((base >> 39) & 0x1ff) * 8))
            .unwrap();
        assert_eq!(
            pml4e & (ACCESSED | DIRTY),
            ACCESSED,
            "only the leaf gets dirty"
        );
    }

    #[test]
    fn writes_need_writable_pages() {
        let m = mem();
        tables(&m);
        let base = 0xffff_8000_0040_0000u64;
        write_virt(&m, 0x1000, base + 0x5ffe, b"ok").unwrap();
        let mut buf = [0u8; 2];
        m.read_slice(&mut buf, GuestAddress(0x10_0ffe)).unwrap();
        assert_eq!(&buf, b"ok");
        assert_eq!(translate(&m, 0x1000, base + 0x7000), Ok(0x11_0000));
        assert_eq!(
            write_virt(&m, 0x1000, base + 0x7000, b"x"),
            Err(TranslateError::NotWritable(base + 0x7000))
        );
    }

    #[test]
    fn reads_across_pages_and_rejects_bad_tables() {
        let m = mem();
        tables(&m);
        m.write_slice(b"int3", GuestAddress(0x10_0ffe)).unwrap();
        let base = 0xffff_8000_0040_0000u64;
        let mut buf = [0u8; 2];
        read_virt(&m, 0x1000, base + 0x5ffe, &mut buf).unwrap();
        assert_eq!(&buf, b"in");
        let mut buf = [0u8; 4];
        assert!(read_virt(&m, 0x1000, base + 0x5ffe, &mut buf).is_err());
        // A table pointer outside guest memory.
        put(&m, 0x1000, 0x7fff_f000 | 3);
        assert!(matches!(
            translate(&m, 0x1000, 0x1000),
            Err(TranslateError::TableOutsideMemory(_))
        ));
    }
}
