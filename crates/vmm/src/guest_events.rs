//! Reading a raised event's buffer out of guest memory (docs/events.md).
//!
//! The buffer address comes from the guest: it is translated through the
//! guest's page tables without touching them (replay must not change
//! guest memory that recording did not), and an event may not cross the
//! page it starts in.

use events::abi::{declared_size, HEADER_LEN, PAGE};
use events::capture::BufferError;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::gva;

/// User addresses end here on x86-64 with 4-level paging.
const USER_END: u64 = 0x0000_8000_0000_0000;

/// The bytes of the event at `gva` (page tables at `cr3`): its declared
/// size, or as much as the page holds when the size is out of bounds (the
/// parser then reports it).
pub fn read_buffer(
    mem: &GuestMemoryMmap,
    cr3: u64,
    gva: u64,
    from_probe: bool,
) -> Result<Vec<u8>, BufferError> {
    if from_probe && gva >= USER_END {
        return Err(BufferError::NotUser(gva));
    }
    let room = PAGE - (gva as usize & (PAGE - 1));
    let pa = gva::translate(mem, cr3, gva).map_err(|_| BufferError::Unmapped(gva))?;
    let mut head = vec![0u8; room.min(HEADER_LEN)];
    mem.read_slice(&mut head, GuestAddress(pa))
        .map_err(|_| BufferError::Unmapped(gva))?;
    let size = declared_size(&head).map(|s| s as usize);
    let len = match size {
        Some(s) if s > room && s <= PAGE => {
            return Err(BufferError::CrossesPage {
                gva,
                size: s as u64,
            })
        }
        None if room < HEADER_LEN => {
            return Err(BufferError::CrossesPage {
                gva,
                size: HEADER_LEN as u64,
            })
        }
        Some(s) if s >= HEADER_LEN && s <= room => s,
        _ => room,
    };
    let mut buf = vec![0u8; len];
    mem.read_slice(&mut buf, GuestAddress(pa))
        .map_err(|_| BufferError::Unmapped(gva))?;
    Ok(buf)
}

/// The return addresses of a user stack, innermost first, by following
/// frame pointers from `rbp`: at most `max`, stopping at the first frame
/// that is unmapped, misaligned, not above the previous one, or outside
/// user memory. Reads only, like [`read_buffer`].
pub fn frame_chain(mem: &GuestMemoryMmap, cr3: u64, rbp: u64, max: usize) -> Vec<u64> {
    let read = |va: u64| -> Option<u64> {
        let pa = gva::translate(mem, cr3, va).ok()?;
        mem.read_obj(GuestAddress(pa)).ok()
    };
    let mut frames = Vec::new();
    let mut fp = rbp;
    while frames.len() < max {
        if fp == 0 || !fp.is_multiple_of(8) || fp >= USER_END - 16 {
            break;
        }
        let (Some(next), Some(ret)) = (read(fp), read(fp + 8)) else {
            break;
        };
        if ret == 0 {
            break;
        }
        frames.push(ret);
        if next <= fp {
            break;
        }
        fp = next;
    }
    frames
}

#[cfg(test)]
mod tests {
    use super::*;
    use events::abi::{encode, lock_payload, Kind};

    const CR3: u64 = 0x1000;

    /// Guest memory whose first 2 MiB are identity-mapped by one huge page,
    /// and page tables at 0x1000.. (PML4 0x1000, PDPT 0x2000, PD 0x3000).
    fn memory() -> GuestMemoryMmap {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        mem.write_obj(0x2003u64, GuestAddress(0x1000)).unwrap();
        mem.write_obj(0x3003u64, GuestAddress(0x2000)).unwrap();
        mem.write_obj(0x83u64, GuestAddress(0x3000)).unwrap();
        mem
    }

    #[test]
    fn reads_exactly_the_declared_event() {
        let mem = memory();
        let ev = encode(Kind::Lock as u16, 1, 2, "a", &lock_payload(1, 2, 3));
        mem.write_slice(&ev, GuestAddress(0x10_0000)).unwrap();
        let got = read_buffer(&mem, CR3, 0x10_0000, true).unwrap();
        assert_eq!(got, ev);
    }

    #[test]
    fn rejects_what_it_cannot_read_safely() {
        let mem = memory();
        assert_eq!(
            read_buffer(&mem, CR3, 0x40_0000, true),
            Err(BufferError::Unmapped(0x40_0000))
        );
        assert_eq!(
            read_buffer(&mem, CR3, 0xffff_8000_0000_0000, true),
            Err(BufferError::NotUser(0xffff_8000_0000_0000))
        );
        // An event whose declared size runs past its page.
        let ev = encode(Kind::Lock as u16, 1, 2, "a", &lock_payload(1, 2, 3));
        let at = 0x10_0000 + PAGE as u64 - 60;
        mem.write_slice(&ev[..60], GuestAddress(at)).unwrap();
        assert_eq!(
            read_buffer(&mem, CR3, at, true),
            Err(BufferError::CrossesPage {
                gva: at,
                size: ev.len() as u64
            })
        );
        // Not even the header fits.
        assert!(matches!(
            read_buffer(&mem, CR3, 0x10_0000 + PAGE as u64 - 8, true),
            Err(BufferError::CrossesPage { .. })
        ));
        // A size beyond any page: the page's bytes, for the parser to refuse.
        let mut big = ev.clone();
        big[8..12].copy_from_slice(&100_000u32.to_le_bytes());
        mem.write_slice(&big, GuestAddress(0x10_2000)).unwrap();
        assert_eq!(read_buffer(&mem, CR3, 0x10_2000, true).unwrap().len(), PAGE);
    }

    #[test]
    fn follows_frame_pointers_until_they_stop_making_sense() {
        let mem = memory();
        // Three frames at 0x11000 -> 0x11100 -> 0x11200 -> 0 (end).
        for (fp, next, ret) in [
            (0x11000u64, 0x11100u64, 0x401000u64),
            (0x11100, 0x11200, 0x402000),
            (0x11200, 0, 0x403000),
        ] {
            mem.write_obj(next, GuestAddress(fp)).unwrap();
            mem.write_obj(ret, GuestAddress(fp + 8)).unwrap();
        }
        assert_eq!(
            frame_chain(&mem, CR3, 0x11000, 32),
            [0x401000, 0x402000, 0x403000]
        );
        assert_eq!(frame_chain(&mem, CR3, 0x11000, 2).len(), 2);
        // A loop, a misaligned and an unmapped frame pointer.
        mem.write_obj(0x11000u64, GuestAddress(0x11200)).unwrap();
        assert_eq!(frame_chain(&mem, CR3, 0x11000, 32).len(), 3);
        assert!(frame_chain(&mem, CR3, 0x11003, 32).is_empty());
        assert!(frame_chain(&mem, CR3, 0x40_0000, 32).is_empty());
    }
}
