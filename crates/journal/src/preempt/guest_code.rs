//! Reading, patching and restoring guest code and the trampoline's pages
//! through a process's page tables or the code pages a point recorded.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::site::{Site, CODE_WINDOW, LOOP_WINDOW};
use super::trampoline::{self, Stub, StubError};
use super::{AsyncPoint, CodePages};
use introspect::gva;

/// A process's page tables as the code pages it maps.
pub struct PageTables<'a> {
    pub mem: &'a GuestMemoryMmap,
    pub cr3: u64,
}

impl CodePages for PageTables<'_> {
    fn page_gpa(&self, page: u64) -> Option<u64> {
        gva::translate(self.mem, self.cr3, page).ok()
    }
}

/// The trampoline for `site` with its code page at `stub`, comparing the
/// memory words at `words`; and the jump to it.
pub fn build_stub(site: &Site, stub: u64, words: &[u64]) -> Result<(Stub, Vec<u8>), StubError> {
    let code = trampoline::build(
        AsyncPoint::pages_at(stub),
        words,
        |ip| site.relocated(ip).map_err(StubError::Relocation),
        site.resume(),
    )?;
    let jump = trampoline::patch(site.rip, stub, site.len)?;
    Ok((code, jump))
}

/// The page-table entries on the way to the trampoline's pages of the
/// mapping at `stub` and to the memory `words` it reads (see
/// `state::memory_digest`).
pub fn trampoline_entries(
    mem: &GuestMemoryMmap,
    cr3: u64,
    stub: u64,
    words: &[(u64, u64)],
) -> Vec<u64> {
    let pages = AsyncPoint::pages_at(stub);
    let mut entries: Vec<u64> = [pages.code, pages.data, pages.exit]
        .into_iter()
        .chain(words.iter().map(|w| w.0))
        .filter_map(|va| gva::path_entries(mem, cr3, va).ok())
        .flatten()
        .collect();
    entries.sort_unstable();
    entries.dedup();
    entries
}

/// Writes `bytes` at `va`, whose pages `map` finds, whatever the page
/// permissions (code is read-only to the guest), keeping what was there
/// in `saved`.
pub fn write_saving(
    mem: &GuestMemoryMmap,
    map: &dyn CodePages,
    va: u64,
    bytes: &[u8],
    saved: &mut Vec<(u64, Vec<u8>)>,
) -> Result<(), String> {
    let mut at = 0usize;
    while at < bytes.len() {
        let addr = va + at as u64;
        let room = (0x1000 - (addr & 0xfff)) as usize;
        let len = room.min(bytes.len() - at);
        let gpa = map
            .gpa(addr)
            .ok_or_else(|| format!("guest virtual address {addr:#x} is not mapped"))?;
        let mut old = vec![0u8; len];
        mem.read_slice(&mut old, GuestAddress(gpa))
            .map_err(|e| e.to_string())?;
        mem.write_slice(&bytes[at..at + len], GuestAddress(gpa))
            .map_err(|e| e.to_string())?;
        saved.push((gpa, old));
        at += len;
    }
    Ok(())
}

/// Puts back the bytes `saved` kept, last first.
pub fn restore(mem: &GuestMemoryMmap, saved: &[(u64, Vec<u8>)]) {
    for (gpa, bytes) in saved.iter().rev() {
        let _ = mem.write_slice(bytes, GuestAddress(*gpa));
    }
}

/// Reads `buf.len()` bytes at `va` through `map`; false where a page is
/// not there.
pub fn read_code(mem: &GuestMemoryMmap, map: &dyn CodePages, va: u64, buf: &mut [u8]) -> bool {
    let mut at = 0usize;
    while at < buf.len() {
        let addr = va + at as u64;
        let len = ((0x1000 - (addr & 0xfff)) as usize).min(buf.len() - at);
        let ok = map.gpa(addr).is_some_and(|gpa| {
            mem.read_slice(&mut buf[at..at + len], GuestAddress(gpa))
                .is_ok()
        });
        if !ok {
            return false;
        }
        at += len;
    }
    true
}

/// The code at `rip` (up to CODE_WINDOW bytes, as far as it is readable)
/// and the LOOP_WINDOW bytes before it (`code_before`), from the pages
/// `map` finds (read without touching the page tables' accessed bits).
pub fn code_around(mem: &GuestMemoryMmap, map: &dyn CodePages, rip: u64) -> (Vec<u8>, Vec<u8>) {
    let code = read_readable(mem, map, rip, CODE_WINDOW);
    (code, code_before(mem, map, rip, LOOP_WINDOW))
}

/// Up to `len` bytes from `va` on, page by page, as far as they are
/// readable (none where `va`'s page is not mapped; they end at the top of
/// the address space).
pub fn read_readable(mem: &GuestMemoryMmap, map: &dyn CodePages, va: u64, len: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(len);
    let mut at = va;
    while bytes.len() < len {
        let room = (0x1000 - (at & 0xfff)) as usize;
        let mut part = vec![0u8; room.min(len - bytes.len())];
        if !read_code(mem, map, at, &mut part) {
            break;
        }
        bytes.extend(&part);
        let Some(next) = at.checked_add(part.len() as u64) else {
            break;
        };
        at = next;
    }
    bytes
}

/// The `len` bytes of code before `rip`; where the page before is not
/// mapped, those of `rip`'s own page (fewer at the start of a mapping).
pub fn code_before(mem: &GuestMemoryMmap, map: &dyn CodePages, rip: u64, len: u64) -> Vec<u8> {
    let mut before = vec![0u8; len as usize];
    let start = rip.wrapping_sub(len);
    if start > rip || !read_code(mem, map, start, &mut before) {
        before = vec![0u8; (rip & 0xfff).min(len) as usize];
        if !read_code(mem, map, rip - before.len() as u64, &mut before) {
            before.clear();
        }
    }
    before
}
