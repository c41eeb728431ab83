//! The replay's event ring (docs/events.md, "The event ring"): pages the
//! guest kernel maps right below the trampoline code page of every
//! process, where the probe gate's ring form appends each event at replay
//! and returns, instead of leaving the guest for it. The host reads the
//! ring at its next exit.
//!
//! The first page is the header; entries follow from the second page on.
//! Header (little-endian u64 words):
//!
//! | offset | written by | contents |
//! |---|---|---|
//! | 8 | the kernel, at every context switch | switch records ever written (the switch ring's head) |
//! | 16 | the kernel, at every switch and exec | page-table root of the task on the CPU |
//! | 24 | the gate, after an entry; the host, 0 once read | bytes of entries written |
//! | 32 | the gate | 1 while it runs (the host then leaves the ring alone) |
//! | 40.. | the gate | its scratch: the registers it saves |
//!
//! An entry, 8-byte aligned:
//!
//! | offset | size | contents |
//! |---|---|---|
//! | 0 | 4 | length of the entry |
//! | 4 | 4 | size of the event copied |
//! | 8 | 8 | switch records written when it was raised |
//! | 16 | 8 | page-table root of the raiser |
//! | 24 | 8 | RSP at the gate (the return address into the probe is there) |
//! | 32 | 8 | RBP at the gate |
//! | 40 | 8 | bytes of stack copied from RSP up |
//! | 48 | size, padded to 8 | the event buffer |
//! | then | stack bytes | the stack from RSP up |

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::gva::PAGE_SIZE;

/// Header words.
pub const SWITCHES: u64 = 8;
pub const CR3: u64 = 16;
pub const USED: u64 = 24;
pub const BUSY: u64 = 32;
/// The gate's scratch words: RAX, the flags (as LAHF/SETO leave them in
/// AX), RCX, RDX, RSI, RDI, R8.
pub const SAVE: u64 = 40;
/// Where entries start.
pub const ENTRIES: u64 = PAGE_SIZE;
/// An entry's fixed part.
pub const ENTRY_HEADER: u64 = 48;
/// The largest event the gate copies (the probe library's buffer is a
/// page whose last 8 bytes tell the top of the thread's stack); a larger
/// or smaller declared size leaves the guest as the exit gate does.
pub const MAX_EVENT: u64 = PAGE_SIZE - 8;
/// The smallest: an event header.
pub const MIN_EVENT: u64 = 48;
/// The most stack copied with an event: what unwinding its stack reads
/// above RSP is taken from the copy, anything higher from memory as it is
/// when the ring is read.
pub const STACK_WINDOW: u64 = 4096;
/// Where the probe library keeps the top of the calling thread's stack,
/// in the page of its event buffer (0: unknown; the gate then copies up to
/// the end of RSP's page).
pub const STACK_TOP_AT: u64 = PAGE_SIZE - 8;

/// One event read from the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingEvent {
    /// Switch records written before it was raised.
    pub switches: u64,
    /// The raiser's page-table root.
    pub cr3: u64,
    /// RSP and RBP at the gate.
    pub rsp: u64,
    pub rbp: u64,
    /// The event buffer.
    pub event: Vec<u8>,
    /// The stack from `rsp` up.
    pub stack: Vec<u8>,
}

/// What reading the ring found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Drained {
    pub entries: Vec<RingEvent>,
    /// Why the rest of the ring could not be read (the guest wrote over
    /// it), if it could not.
    pub damaged: Option<String>,
}

/// The ring of `pages` pages at guest physical `gpa`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventRing {
    pub gpa: u64,
    pub pages: u64,
}

impl EventRing {
    /// Bytes entries may take.
    pub fn capacity(&self) -> u64 {
        self.pages * PAGE_SIZE - ENTRIES
    }

    fn word(&self, mem: &GuestMemoryMmap, at: u64) -> u64 {
        mem.read_obj(GuestAddress(self.gpa + at)).unwrap_or(0)
    }

    /// Whether the gate is running (interrupted inside it): the ring must
    /// be left as it is.
    pub fn busy(&self, mem: &GuestMemoryMmap) -> bool {
        self.word(mem, BUSY) != 0
    }

    /// Whether entries wait to be read.
    pub fn pending(&self, mem: &GuestMemoryMmap) -> bool {
        self.word(mem, USED) != 0
    }

    /// Empties the ring for a new run of the gate (it is insight's memory:
    /// nothing of the program's is there).
    pub fn reset(&self, mem: &GuestMemoryMmap) {
        for at in [USED, BUSY] {
            let _ = mem.write_obj(0u64, GuestAddress(self.gpa + at));
        }
    }

    /// Empties the ring unread, unless a gate is running.
    pub fn discard(&self, mem: &GuestMemoryMmap) {
        if !self.busy(mem) && self.pending(mem) {
            let _ = mem.write_obj(0u64, GuestAddress(self.gpa + USED));
        }
    }

    /// Reads the entries published after offset `*read` (where reads
    /// made while a gate ran stopped), oldest first. With no gate
    /// running, empties the ring and sets `*read` back to 0; under a
    /// running gate (interrupted inside, `busy`) leaves the ring as it is
    /// — the gate adds its entry's length to the bytes used it read — and
    /// moves `*read` past what it read. Published entries are complete
    /// either way: the gate publishes with one instruction.
    pub fn drain(&self, mem: &GuestMemoryMmap, read: &mut u64) -> Drained {
        let used = self.word(mem, USED);
        let busy = self.busy(mem);
        let mut out = Drained::default();
        if used > self.capacity() || *read > used {
            out.damaged = Some(format!(
                "{used} bytes of entries in a ring of {} (read to {})",
                self.capacity(),
                *read
            ));
        } else if used > *read {
            let mut bytes = vec![0u8; (used - *read) as usize];
            if mem
                .read_slice(&mut bytes, GuestAddress(self.gpa + ENTRIES + *read))
                .is_err()
            {
                out.damaged = Some(format!("the ring's entries from offset {}", *read));
            } else {
                parse(&bytes, &mut out);
            }
        }
        if busy {
            *read = used;
        } else {
            if used != 0 {
                let _ = mem.write_obj(0u64, GuestAddress(self.gpa + USED));
            }
            *read = 0;
        }
        out
    }
}

/// The entries in `bytes` (the ring's entries, `USED` bytes of them),
/// into `out`.
pub fn parse(bytes: &[u8], out: &mut Drained) {
    let u32_at =
        |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]));
    let u64_at =
        |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < ENTRY_HEADER as usize {
            out.damaged = Some(format!("a {}-byte entry at offset {at}", rest.len()));
            return;
        }
        let len = u32_at(rest, 0) as usize;
        let size = u64::from(u32_at(rest, 4));
        let stack = u64_at(rest, 40);
        let padded = size.div_ceil(8) * 8;
        // The guest's word: bounded before any sum is taken.
        let expected = (stack <= STACK_WINDOW).then(|| ENTRY_HEADER + padded + stack);
        if !(MIN_EVENT..=MAX_EVENT).contains(&size)
            || stack % 8 != 0
            || expected != Some(len as u64)
            || len > rest.len()
        {
            out.damaged = Some(format!(
                "entry at offset {at}: length {len}, event {size} bytes, stack {stack} bytes"
            ));
            return;
        }
        let event_at = ENTRY_HEADER as usize;
        let stack_at = event_at + padded as usize;
        out.entries.push(RingEvent {
            switches: u64_at(rest, 8),
            cr3: u64_at(rest, 16),
            rsp: u64_at(rest, 24),
            rbp: u64_at(rest, 32),
            event: rest[event_at..event_at + size as usize].to_vec(),
            stack: rest[stack_at..stack_at + stack as usize].to_vec(),
        });
        at += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry as the gate writes it.
    pub(crate) fn entry_bytes(e: &RingEvent) -> Vec<u8> {
        let padded = e.event.len().div_ceil(8) * 8;
        let len = ENTRY_HEADER as usize + padded + e.stack.len();
        let mut b = Vec::with_capacity(len);
        b.extend((len as u32).to_le_bytes());
        b.extend((e.event.len() as u32).to_le_bytes());
        for w in [e.switches, e.cr3, e.rsp, e.rbp, e.stack.len() as u64] {
            b.extend(w.to_le_bytes());
        }
        b.extend(&e.event);
        b.resize(ENTRY_HEADER as usize + padded, 0);
        b.extend(&e.stack);
        b
    }

    /// `bytes` of entries in `ring`, as the gate leaves them.
    fn publish(mem: &GuestMemoryMmap, ring: EventRing, bytes: &[u8]) {
        mem.write_slice(bytes, GuestAddress(ring.gpa + ENTRIES))
            .unwrap();
        mem.write_obj(bytes.len() as u64, GuestAddress(ring.gpa + USED))
            .unwrap();
    }

    /// A 4-page ring in 1 MiB of guest memory.
    fn ring_in_memory() -> (GuestMemoryMmap, EventRing) {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let ring = EventRing {
            gpa: 0x4_0000,
            pages: 4,
        };
        (mem, ring)
    }

    fn sample(n: u8, event: usize, stack: usize) -> RingEvent {
        RingEvent {
            switches: 100 + u64::from(n),
            cr3: 0x5000,
            rsp: 0x7ffc_0000_0f00,
            rbp: 0x7ffc_0000_0f80,
            event: vec![n; event],
            stack: vec![n ^ 0xff; stack],
        }
    }

    #[test]
    fn entries_come_back_in_order_and_the_ring_is_emptied() {
        let (mem, ring) = ring_in_memory();
        let entries = [sample(1, 72, 256), sample(2, 61, 0), sample(3, 48, 4096)];
        let bytes: Vec<u8> = entries.iter().flat_map(entry_bytes).collect();
        publish(&mem, ring, &bytes);
        assert!(ring.pending(&mem));
        let mut read = 0;
        let drained = ring.drain(&mem, &mut read);
        assert_eq!(drained.damaged, None);
        assert_eq!(drained.entries, entries);
        assert!(!ring.pending(&mem));
        assert_eq!(read, 0);
        assert_eq!(ring.drain(&mem, &mut read), Drained::default());
        // Discarded unread, but never under a running gate.
        publish(&mem, ring, &bytes);
        mem.write_obj(1u64, GuestAddress(ring.gpa + BUSY)).unwrap();
        ring.discard(&mem);
        assert!(ring.pending(&mem));
        mem.write_obj(0u64, GuestAddress(ring.gpa + BUSY)).unwrap();
        ring.discard(&mem);
        assert!(!ring.pending(&mem));
    }

    #[test]
    fn entries_published_under_a_running_gate_are_read_once_and_the_ring_kept() {
        let (mem, ring) = ring_in_memory();
        let entries = [sample(1, 72, 256), sample(2, 61, 8), sample(3, 48, 64)];
        let bytes: Vec<Vec<u8>> = entries.iter().map(entry_bytes).collect();
        // Two published, a gate running (writing the third).
        publish(&mem, ring, &bytes[..2].concat());
        mem.write_obj(1u64, GuestAddress(ring.gpa + BUSY)).unwrap();
        let mut read = 0;
        assert_eq!(ring.drain(&mem, &mut read).entries, entries[..2]);
        assert_eq!(read, bytes[..2].concat().len() as u64);
        assert!(ring.pending(&mem), "emptied under a running gate");
        // Nothing new yet: nothing read twice.
        assert_eq!(ring.drain(&mem, &mut read), Drained::default());
        // The gate publishes the third and returns.
        publish(&mem, ring, &bytes.concat());
        mem.write_obj(0u64, GuestAddress(ring.gpa + BUSY)).unwrap();
        let drained = ring.drain(&mem, &mut read);
        assert_eq!(
            (drained.entries, drained.damaged),
            (entries[2..].to_vec(), None)
        );
        assert_eq!(read, 0);
        assert!(!ring.pending(&mem));
    }

    #[test]
    fn a_damaged_ring_gives_what_precedes_the_damage_and_says_why() {
        let (mem, ring) = ring_in_memory();
        let mut bytes = entry_bytes(&sample(1, 72, 16));
        let mut bad = entry_bytes(&sample(2, 72, 16));
        bad[0] ^= 8; // length off by 8
        bytes.extend(&bad);
        // A stack length no sum survives: refused, never added up.
        let mut huge = entry_bytes(&sample(3, 72, 16));
        huge[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut lone = Drained::default();
        parse(&huge, &mut lone);
        assert!(lone.entries.is_empty());
        assert!(lone
            .damaged
            .unwrap()
            .contains("stack 18446744073709551615 bytes"));
        publish(&mem, ring, &bytes);
        let mut read = 0;
        let drained = ring.drain(&mem, &mut read);
        assert_eq!(drained.entries, [sample(1, 72, 16)]);
        assert!(drained.damaged.unwrap().contains("offset 136"));
        // More used than the ring holds: nothing is read.
        mem.write_obj(1u64 << 40, GuestAddress(ring.gpa + USED))
            .unwrap();
        let drained = ring.drain(&mem, &mut read);
        assert!(drained.entries.is_empty());
        assert!(drained.damaged.is_some());
        assert!(!ring.pending(&mem));
    }
}
