//! Software breakpoints in the debugged process: an `int3` written over
//! the first byte of the instruction, in the guest physical page the
//! process maps there.
//!
//! The page may be shared (a library's code): every process running that
//! code traps, and the VMM steps the others over it. It may not be mapped
//! yet (code not run so far): the breakpoint waits, and is put in place
//! as soon as the process maps the page. Reads of the process's memory
//! never show the `int3`.

use std::collections::{BTreeMap, BTreeSet};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use introspect::gva;

/// The x86 breakpoint instruction.
pub(crate) const INT3: u8 = 0xcc;

/// An `int3` in guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Inserted {
    /// Where the process has it.
    va: u64,
    /// The byte it replaced.
    original: u8,
}

/// The breakpoints of the debugged process.
#[derive(Clone, Default)]
pub(crate) struct Breakpoints {
    /// Where the debugger wants one, by the process's virtual address.
    wanted: BTreeSet<u64>,
    /// Where the VMM wants one for itself (a position to reach).
    internal: Option<u64>,
    /// The `int3`s in guest memory, by guest physical address.
    inserted: BTreeMap<u64, Inserted>,
    /// The debugger's breakpoints are out of memory for now (a replay to
    /// a position that records no hits on this stretch).
    dormant: bool,
    /// The VMM's own breakpoint is in memory (only the exits before the
    /// position's can pass it).
    internal_armed: bool,
}

impl Breakpoints {
    pub(crate) fn add(&mut self, va: u64) {
        self.wanted.insert(va);
    }

    pub(crate) fn remove(&mut self, va: u64) {
        self.wanted.remove(&va);
    }

    /// The debugger's breakpoints, all taken away (until `sync`).
    pub(crate) fn take(&mut self) -> BTreeSet<u64> {
        std::mem::take(&mut self.wanted)
    }

    /// Puts back what `take` took.
    pub(crate) fn put(&mut self, wanted: BTreeSet<u64>) {
        self.wanted = wanted;
    }

    /// The VMM's own breakpoint, at most one: where a position to reach
    /// is.
    pub(crate) fn set_internal(&mut self, va: Option<u64>) {
        self.internal = va;
    }

    /// Which of the breakpoints go into memory at the next `sync`: the
    /// debugger's (`user`), the VMM's own (`internal`).
    pub(crate) fn set_armed(&mut self, user: bool, internal: bool) {
        self.dormant = !user;
        self.internal_armed = internal;
    }

    /// What `set_armed` said.
    pub(crate) fn armed(&self) -> (bool, bool) {
        (!self.dormant, self.internal_armed)
    }

    /// Whether the debugger wants a breakpoint at `va` (the VMM's own
    /// does not count).
    pub(crate) fn is_wanted(&self, va: u64) -> bool {
        self.wanted.contains(&va)
    }

    /// Every address a breakpoint belongs at now.
    fn all_wanted(&self) -> BTreeSet<u64> {
        let mut all = if self.dormant {
            BTreeSet::new()
        } else {
            self.wanted.clone()
        };
        all.extend(self.internal.filter(|_| self.internal_armed));
        all
    }

    /// Whether any breakpoint waits for its page to be mapped.
    pub(crate) fn pending(&self) -> bool {
        self.all_wanted().len() > self.inserted.len()
    }

    /// Whether the `int3` at guest physical `gpa` is one of these; the
    /// address the process has it at.
    pub(crate) fn at(&self, gpa: u64) -> Option<u64> {
        self.inserted.get(&gpa).map(|i| i.va)
    }

    /// Puts every wanted breakpoint the process `cr3` maps in place and
    /// takes out those no longer wanted (or whose page moved). None goes
    /// into `[start, end)` of `avoid` (an address space and a range of it):
    /// code a trampoline's patch covers.
    pub(crate) fn sync(&mut self, mem: &GuestMemoryMmap, cr3: u64, avoid: Option<(u64, u64, u64)>) {
        let mut wanted = self.all_wanted();
        if let Some((_, start, end)) = avoid.filter(|a| a.0 == cr3) {
            wanted.retain(|va| !(start..end).contains(va));
        }
        let stale: Vec<u64> = self
            .inserted
            .iter()
            .filter(|(&gpa, i)| {
                !wanted.contains(&i.va) || gva::translate_user(mem, cr3, i.va) != Ok(gpa)
            })
            .map(|(&gpa, _)| gpa)
            .collect();
        for gpa in stale {
            self.lift(mem, gpa);
        }
        let placed: BTreeSet<u64> = self.inserted.values().map(|i| i.va).collect();
        for &va in wanted.difference(&placed) {
            let Ok(gpa) = gva::translate_user(mem, cr3, va) else {
                continue;
            };
            let Ok(original) = mem.read_obj::<u8>(GuestAddress(gpa)) else {
                continue;
            };
            if original == INT3 && self.inserted.contains_key(&gpa) {
                continue;
            }
            if mem.write_obj(INT3, GuestAddress(gpa)).is_ok() {
                self.inserted.insert(gpa, Inserted { va, original });
            }
        }
    }

    /// Takes the `int3` at `gpa` out (to run the instruction under it, or
    /// for good); `sync` puts it back if it is still wanted.
    pub(crate) fn lift(&mut self, mem: &GuestMemoryMmap, gpa: u64) {
        if let Some(i) = self.inserted.remove(&gpa) {
            let _ = mem.write_obj(i.original, GuestAddress(gpa));
        }
    }

    /// Takes every `int3` out (guest memory as the guest wrote it: for a
    /// snapshot, or the end of the session).
    pub(crate) fn lift_all(&mut self, mem: &GuestMemoryMmap) {
        let all: Vec<u64> = self.inserted.keys().copied().collect();
        for gpa in all {
            self.lift(mem, gpa);
        }
    }

    /// Puts the original bytes over the breakpoints in `buf`, read from
    /// virtual address `va` of the process `cr3`.
    pub(crate) fn hide(&self, mem: &GuestMemoryMmap, cr3: u64, va: u64, buf: &mut [u8]) {
        let end = va.saturating_add(buf.len() as u64);
        for (&gpa, i) in &self.inserted {
            if (va..end).contains(&i.va) && gva::translate_user(mem, cr3, i.va) == Ok(gpa) {
                buf[(i.va - va) as usize] = i.original;
            }
        }
    }

    /// The original bytes of the breakpoints in guest memory, as
    /// (guest physical address, bytes): what a digest of memory must see
    /// instead.
    pub(crate) fn originals(&self) -> Vec<(u64, Vec<u8>)> {
        self.inserted
            .iter()
            .map(|(&gpa, i)| (gpa, vec![i.original]))
            .collect()
    }
}

/// Puts over `buf`, read at `va` of the address space `cr3`, the bytes
/// `saved` holds for the guest physical addresses it covers (what the VMM
/// wrote over: a trampoline's patch).
pub(crate) fn hide_saved(
    mem: &GuestMemoryMmap,
    cr3: u64,
    va: u64,
    buf: &mut [u8],
    saved: &[(u64, Vec<u8>)],
) {
    for (i, byte) in buf.iter_mut().enumerate() {
        let Ok(gpa) = gva::translate_user(mem, cr3, va + i as u64) else {
            continue;
        };
        for (at, bytes) in saved {
            if (*at..*at + bytes.len() as u64).contains(&gpa) {
                *byte = bytes[(gpa - at) as usize];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::test_memory::user_code;

    #[test]
    fn breakpoints_go_in_where_mapped_wait_where_not_and_never_show() {
        let m = user_code(&[0x90, 0x55, 0x48, 0x89, 0xe5]);
        let mut b = Breakpoints::default();
        b.add(0x40_0001);
        // Not mapped: waits.
        b.add(0x80_0000);
        b.sync(&m, 0x1000, None);
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x20_0001)).unwrap(), INT3);
        assert_eq!(b.at(0x20_0001), Some(0x40_0001));
        assert!(b.pending());
        // Reads show the program's bytes.
        let mut buf = [0u8; 5];
        m.read_slice(&mut buf, GuestAddress(0x20_0000)).unwrap();
        assert_eq!(buf, [0x90, INT3, 0x48, 0x89, 0xe5]);
        b.hide(&m, 0x1000, 0x40_0000, &mut buf);
        assert_eq!(buf, [0x90, 0x55, 0x48, 0x89, 0xe5]);
        // A read that starts past it is left alone.
        let mut later = [0u8; 2];
        m.read_slice(&mut later, GuestAddress(0x20_0002)).unwrap();
        b.hide(&m, 0x1000, 0x40_0002, &mut later);
        assert_eq!(later, [0x48, 0x89]);
        // Syncing again changes nothing; removing takes it out.
        b.sync(&m, 0x1000, None);
        assert_eq!(b.originals(), vec![(0x20_0001, vec![0x55])]);
        b.remove(0x40_0001);
        b.sync(&m, 0x1000, None);
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x20_0001)).unwrap(), 0x55);
        assert_eq!(b.at(0x20_0001), None);
        // Lifting all puts every byte back, and a sync puts them in again.
        b.add(0x40_0004);
        b.sync(&m, 0x1000, None);
        b.lift_all(&m);
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x20_0004)).unwrap(), 0xe5);
        b.sync(&m, 0x1000, None);
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x20_0004)).unwrap(), INT3);
    }

    #[test]
    fn dormant_breakpoints_and_the_internal_one_stay_out_until_armed() {
        let m = user_code(&[0x90, 0x55, 0x48, 0x89, 0xe5]);
        let byte = |gpa| m.read_obj::<u8>(GuestAddress(gpa)).unwrap();
        let mut b = Breakpoints::default();
        b.add(0x40_0001);
        b.set_internal(Some(0x40_0003));
        // The debugger's in, the VMM's own not armed.
        b.sync(&m, 0x1000, None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (INT3, 0x89));
        assert!(!b.pending());
        // Dormant: out of memory, nothing waits for a page.
        b.set_armed(false, false);
        b.sync(&m, 0x1000, None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (0x55, 0x89));
        assert_eq!(b.at(0x20_0001), None);
        assert!(b.originals().is_empty());
        // Only the internal one.
        b.set_armed(false, true);
        b.sync(&m, 0x1000, None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (0x55, INT3));
        assert!(!b.is_wanted(0x40_0003));
        // Both, and back.
        b.set_armed(true, true);
        b.sync(&m, 0x1000, None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (INT3, INT3));
        b.set_armed(true, false);
        b.sync(&m, 0x1000, None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (INT3, 0x89));
        assert_eq!(b.armed(), (true, false));
    }
}
