//! Software breakpoints in the processes held: an `int3` written over
//! the first byte of the instruction, in the guest physical page the
//! process maps there.
//!
//! The page may be shared (a library's code): every process running that
//! code traps, and the VMM steps the others over it. It may not be mapped
//! yet (code not run so far): the breakpoint waits, and is put in place
//! as soon as the process maps the page. Reads of the process's memory
//! never show the `int3`.
//!
//! A collecting tool (probes given at replay) follows several processes
//! at once: each has its own breakpoints, by its address space's
//! page-table root. Processes running one program share its code pages,
//! so one `int3` serves every process that maps its page.

use std::collections::{BTreeMap, BTreeSet};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use introspect::gva;

/// The x86 breakpoint instruction.
pub(crate) const INT3: u8 = 0xcc;

/// An `int3` in guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Inserted {
    /// Where the process it was put in for has it.
    va: u64,
    /// The byte it replaced.
    original: u8,
}

/// The breakpoints of the process held and of the processes followed.
#[derive(Clone, Default)]
pub(crate) struct Breakpoints {
    /// Where the supervisor wants one in the process held, by its
    /// virtual address.
    wanted: BTreeSet<u64>,
    /// Where a collecting tool wants them in the processes it follows,
    /// by address space (page-table root) and virtual address.
    spaces: BTreeMap<u64, BTreeSet<u64>>,
    /// Where the VMM wants one for itself (a position to reach).
    internal: Option<u64>,
    /// The `int3`s in guest memory, by guest physical address.
    inserted: BTreeMap<u64, Inserted>,
    /// The supervisor's breakpoints are out of memory for now (a replay to
    /// a position that records no hits on this stretch).
    dormant: bool,
    /// The VMM's own breakpoint is in memory (only the exits before the
    /// position's can pass it).
    internal_armed: bool,
    /// Wanted breakpoints whose page was not mapped at the last `sync`.
    unmapped: usize,
}

impl Breakpoints {
    pub(crate) fn add(&mut self, va: u64) {
        self.wanted.insert(va);
    }

    pub(crate) fn remove(&mut self, va: u64) {
        self.wanted.remove(&va);
    }

    /// A breakpoint at `va` of the address space `cr3` (a process a
    /// collecting tool follows).
    pub(crate) fn add_in(&mut self, cr3: u64, va: u64) {
        self.spaces.entry(cr3).or_default().insert(va);
    }

    pub(crate) fn remove_in(&mut self, cr3: u64, va: u64) {
        if let Some(space) = self.spaces.get_mut(&cr3) {
            space.remove(&va);
        }
    }

    /// The process of the address space `cr3` ended (or executed another
    /// program): its breakpoints go, out of memory at the next `sync`
    /// unless another process wants them too.
    pub(crate) fn drop_space(&mut self, cr3: u64) {
        self.spaces.remove(&cr3);
    }

    /// The followed address space a collected hit at `va` of the address
    /// space `cr3`, on the `int3` at `gpa`, belongs to: `cr3` itself if it
    /// wants a breakpoint there, else one that wants it at the same
    /// address of the same page (the process forked `cr3`: same code at
    /// the same addresses).
    pub(crate) fn space_of_hit(
        &self,
        mem: &GuestMemoryMmap,
        cr3: u64,
        va: u64,
        gpa: u64,
    ) -> Option<u64> {
        if self.dormant {
            return None;
        }
        if self.spaces.get(&cr3).is_some_and(|s| s.contains(&va)) {
            return Some(cr3);
        }
        (self.spaces.iter())
            .find(|(&c, s)| s.contains(&va) && gva::translate_user(mem, c, va) == Ok(gpa))
            .map(|(&c, _)| c)
    }

    /// The supervisor's breakpoints in the process held, all taken away
    /// (until `sync`).
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
    /// supervisor's (`user`), the VMM's own (`internal`).
    pub(crate) fn set_armed(&mut self, user: bool, internal: bool) {
        self.dormant = !user;
        self.internal_armed = internal;
    }

    /// What `set_armed` said.
    pub(crate) fn armed(&self) -> (bool, bool) {
        (!self.dormant, self.internal_armed)
    }

    /// Whether the supervisor wants a breakpoint at `va` (the VMM's own
    /// does not count).
    pub(crate) fn is_wanted(&self, va: u64) -> bool {
        self.wanted.contains(&va)
    }

    /// Every breakpoint that belongs in memory now, as (address space,
    /// virtual address): the supervisor's and the VMM's own in the process
    /// `cr3`, a collecting tool's in each process it follows.
    fn all_wanted(&self, cr3: Option<u64>) -> Vec<(u64, u64)> {
        let mut all = Vec::new();
        if let Some(cr3) = cr3 {
            if !self.dormant {
                all.extend(self.wanted.iter().map(|&va| (cr3, va)));
            }
            all.extend(
                self.internal
                    .filter(|_| self.internal_armed)
                    .map(|va| (cr3, va)),
            );
        }
        if !self.dormant {
            for (&space, vas) in &self.spaces {
                all.extend(vas.iter().map(|&va| (space, va)));
            }
        }
        all
    }

    /// Whether a breakpoint waited for its page to be mapped at the last
    /// `sync`.
    pub(crate) fn pending(&self) -> bool {
        self.unmapped > 0
    }

    /// Whether the `int3` at guest physical `gpa` is one of these; the
    /// address the process it was put in for has it at.
    pub(crate) fn at(&self, gpa: u64) -> Option<u64> {
        self.inserted.get(&gpa).map(|i| i.va)
    }

    /// Puts every wanted breakpoint in place where its process maps it
    /// (`cr3`: the process held, if it runs) and takes out those no
    /// longer wanted (or whose page moved). None goes into `[start, end)`
    /// of `avoid` (an address space and a range of it): code a
    /// trampoline's patch covers.
    pub(crate) fn sync(
        &mut self,
        mem: &GuestMemoryMmap,
        cr3: Option<u64>,
        avoid: Option<(u64, u64, u64)>,
    ) {
        let mut wanted = self.all_wanted(cr3);
        // The patched code's guest physical bytes: every process that maps
        // them (a fork child, another run of the program) sees the patch.
        let mut patched: BTreeSet<u64> = BTreeSet::new();
        if let Some((space, start, end)) = avoid {
            wanted.retain(|&(c, va)| c != space || !(start..end).contains(&va));
            for va in start..end.min(start.saturating_add(64)) {
                if let Ok(gpa) = gva::translate_user(mem, space, va) {
                    patched.insert(gpa);
                }
            }
        }
        // Where each goes in guest memory: one `int3` for every process
        // that maps the page there.
        let mut at: BTreeMap<u64, u64> = BTreeMap::new();
        self.unmapped = 0;
        for (c, va) in wanted {
            match gva::translate_user(mem, c, va) {
                Ok(gpa) if patched.contains(&gpa) => {}
                Ok(gpa) => {
                    at.entry(gpa).or_insert(va);
                }
                Err(_) => self.unmapped += 1,
            }
        }
        let stale: Vec<u64> = (self.inserted.keys())
            .filter(|gpa| !at.contains_key(gpa))
            .copied()
            .collect();
        for gpa in stale {
            self.lift(mem, gpa);
        }
        for (gpa, va) in at {
            if self.inserted.contains_key(&gpa) {
                continue;
            }
            let Ok(original) = mem.read_obj::<u8>(GuestAddress(gpa)) else {
                continue;
            };
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
    /// virtual address `va` of the process `cr3` (whichever process they
    /// were put in for).
    pub(crate) fn hide(&self, mem: &GuestMemoryMmap, cr3: u64, va: u64, buf: &mut [u8]) {
        if self.inserted.is_empty() {
            return;
        }
        let end = va.saturating_add(buf.len() as u64);
        let mut page = va & !0xfff;
        while page < end {
            if let Ok(base) = gva::translate_user(mem, cr3, page) {
                for (&gpa, i) in self.inserted.range(base..base + 0x1000) {
                    let at = page + (gpa - base);
                    if (va..end).contains(&at) {
                        buf[(at - va) as usize] = i.original;
                    }
                }
            }
            let Some(next) = page.checked_add(0x1000) else {
                break;
            };
            page = next;
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
    use crate::vm::test_memory::user_code;

    #[test]
    fn breakpoints_go_in_where_mapped_wait_where_not_and_never_show() {
        let m = user_code(&[0x90, 0x55, 0x48, 0x89, 0xe5]);
        let mut b = Breakpoints::default();
        b.add(0x40_0001);
        // Not mapped: waits.
        b.add(0x80_0000);
        b.sync(&m, Some(0x1000), None);
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
        b.sync(&m, Some(0x1000), None);
        assert_eq!(b.originals(), vec![(0x20_0001, vec![0x55])]);
        b.remove(0x40_0001);
        b.sync(&m, Some(0x1000), None);
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x20_0001)).unwrap(), 0x55);
        assert_eq!(b.at(0x20_0001), None);
        // Lifting all puts every byte back, and a sync puts them in again.
        b.add(0x40_0004);
        b.sync(&m, Some(0x1000), None);
        b.lift_all(&m);
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x20_0004)).unwrap(), 0xe5);
        b.sync(&m, Some(0x1000), None);
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x20_0004)).unwrap(), INT3);
    }

    #[test]
    fn processes_that_share_code_share_its_breakpoints() {
        let m = user_code(&[0x90, 0x55, 0x48, 0x89, 0xe5]);
        // Address space 0x5000 maps the same code at 0xa0_0000; 0x9000 (a
        // child of 0x1000's process) at 0x40_0000, as its parent.
        m.write_obj(0x6000u64 | 7, GuestAddress(0x5000)).unwrap();
        m.write_obj(0x7000u64 | 7, GuestAddress(0x6000)).unwrap();
        m.write_obj(0x20_0000u64 | 0x87, GuestAddress(0x7000 + 5 * 8))
            .unwrap();
        m.write_obj(0x2000u64 | 7, GuestAddress(0x9000)).unwrap();
        let byte = |gpa| m.read_obj::<u8>(GuestAddress(gpa)).unwrap();
        let mut b = Breakpoints::default();
        b.add_in(0x1000, 0x40_0001);
        b.add_in(0x5000, 0xa0_0001);
        b.add_in(0x5000, 0xa0_0004);
        b.sync(&m, None, None);
        // One int3 a page offset, whichever process wanted it.
        assert_eq!((byte(0x20_0001), byte(0x20_0004)), (INT3, INT3));
        assert_eq!(
            b.originals(),
            vec![(0x20_0001, vec![0x55]), (0x20_0004, vec![0xe5])]
        );
        assert!(!b.pending());
        // Every process reads the program's bytes.
        for (cr3, va) in [
            (0x1000, 0x40_0000),
            (0x5000, 0xa0_0000),
            (0x9000, 0x40_0000),
        ] {
            let mut buf = [0u8; 5];
            m.read_slice(&mut buf, GuestAddress(0x20_0000)).unwrap();
            b.hide(&m, cr3, va, &mut buf);
            assert_eq!(buf, [0x90, 0x55, 0x48, 0x89, 0xe5], "{cr3:#x}");
        }
        // A hit is its own process's, a forked child's is its parent's, a
        // process passing an address no process wants there is nobody's.
        assert_eq!(
            b.space_of_hit(&m, 0x5000, 0xa0_0004, 0x20_0004),
            Some(0x5000)
        );
        assert_eq!(
            b.space_of_hit(&m, 0x9000, 0x40_0001, 0x20_0001),
            Some(0x1000)
        );
        assert_eq!(b.space_of_hit(&m, 0x9000, 0x40_0004, 0x20_0004), None);
        assert_eq!(b.space_of_hit(&m, 0x1000, 0x40_0004, 0x20_0004), None);
        // A trampoline patches 0x40_0001.. in 0x1000's process: the page is
        // 0x5000's too, whose breakpoint there stays out of the patch.
        b.sync(&m, None, Some((0x1000, 0x40_0001, 0x40_0003)));
        assert_eq!((byte(0x20_0001), byte(0x20_0004)), (0x55, INT3));
        b.sync(&m, None, None);
        assert_eq!(byte(0x20_0001), INT3);
        // A process ends: what only it wanted comes out.
        b.drop_space(0x5000);
        b.sync(&m, None, None);
        assert_eq!((byte(0x20_0001), byte(0x20_0004)), (INT3, 0xe5));
        // A page not mapped yet waits.
        b.add_in(0x1000, 0x80_0000);
        b.sync(&m, None, None);
        assert!(b.pending());
        b.remove_in(0x1000, 0x80_0000);
        b.sync(&m, None, None);
        assert!(!b.pending());
    }

    #[test]
    fn dormant_breakpoints_and_the_internal_one_stay_out_until_armed() {
        let m = user_code(&[0x90, 0x55, 0x48, 0x89, 0xe5]);
        let byte = |gpa| m.read_obj::<u8>(GuestAddress(gpa)).unwrap();
        let mut b = Breakpoints::default();
        b.add(0x40_0001);
        b.set_internal(Some(0x40_0003));
        // The debugger's in, the VMM's own not armed.
        b.sync(&m, Some(0x1000), None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (INT3, 0x89));
        assert!(!b.pending());
        // Dormant: out of memory, nothing waits for a page.
        b.set_armed(false, false);
        b.sync(&m, Some(0x1000), None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (0x55, 0x89));
        assert_eq!(b.at(0x20_0001), None);
        assert!(b.originals().is_empty());
        // Only the internal one.
        b.set_armed(false, true);
        b.sync(&m, Some(0x1000), None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (0x55, INT3));
        assert!(!b.is_wanted(0x40_0003));
        // Both, and back.
        b.set_armed(true, true);
        b.sync(&m, Some(0x1000), None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (INT3, INT3));
        b.set_armed(true, false);
        b.sync(&m, Some(0x1000), None);
        assert_eq!((byte(0x20_0001), byte(0x20_0003)), (INT3, 0x89));
        assert_eq!(b.armed(), (true, false));
    }
}
