//! The state logged at an asynchronous point, and the digests that let
//! replay tell it apart from every other state the program passes through.
//!
//! Between the last deterministic exit and the point, the guest ran from a
//! state replay reproduces exactly, so replay passes through the same
//! sequence of states. A state of that sequence whose registers, extended
//! state, segment bases and written memory all equal the logged ones is
//! the logged state, or one the program cannot tell from it: delivering
//! the interrupt there replays the recording faithfully. Memory is
//! compared over the pages the guest wrote since a point at or before that
//! exit (the dirty log since its last reset): every other page is the same
//! in both runs, and replay passes through the same writes in the same
//! order, so these pages are all that can differ.

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use introspect::xstate::{self, XsaveLayout};

/// The user-mode state at an asynchronous point.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserState {
    /// Page-table root (CR3 without PCID bits).
    pub cr3: u64,
    pub rip: u64,
    /// RFLAGS without RF (which says nothing about the program's state).
    pub rflags: u64,
    /// RAX..R15 in encoding order.
    pub gprs: [u64; 16],
    pub fs_base: u64,
    pub gs_base: u64,
    /// Digest of the extended state (`xstate::visible_state`).
    pub xstate: u64,
    /// Memory words the code at RIP uses (address, value): compared by
    /// the trampoline itself (`site::Site::memory_words`).
    pub words: Vec<(u64, u64)>,
    /// Guest page frames written since the dirty log was last reset.
    pub pages: PageSet,
    /// Digest of those pages' contents.
    pub memory: u64,
}

/// RFLAGS.RF.
pub const RF: u64 = 1 << 16;
/// The bits of CR3 that are the page-table root (not PCID, not flags).
pub const CR3_ROOT: u64 = 0x000f_ffff_ffff_f000;

impl UserState {
    /// The state's registers part, at `regs` in the address space `cr3`
    /// (its root taken) with these segment bases; no extended state, words
    /// or memory.
    pub fn of_registers(
        cr3: u64,
        regs: &kvm_bindings::kvm_regs,
        fs_base: u64,
        gs_base: u64,
    ) -> Self {
        UserState {
            cr3: cr3 & CR3_ROOT,
            rip: regs.rip,
            rflags: regs.rflags & !RF,
            gprs: gprs(regs),
            fs_base,
            gs_base,
            xstate: 0,
            words: Vec::new(),
            pages: PageSet::default(),
            memory: 0,
        }
    }

    /// The registers as `kvm_regs`, for the trampoline.
    pub fn kvm_regs(&self) -> kvm_bindings::kvm_regs {
        let g = self.gprs;
        kvm_bindings::kvm_regs {
            rax: g[0],
            rcx: g[1],
            rdx: g[2],
            rbx: g[3],
            rsp: g[4],
            rbp: g[5],
            rsi: g[6],
            rdi: g[7],
            r8: g[8],
            r9: g[9],
            r10: g[10],
            r11: g[11],
            r12: g[12],
            r13: g[13],
            r14: g[14],
            r15: g[15],
            rip: self.rip,
            rflags: self.rflags,
        }
    }

    /// How `other` (what replay found) differs from this state, one item
    /// per part; empty when they are the same.
    pub fn differences(&self, other: &UserState) -> Vec<String> {
        const NAMES: [&str; 16] = [
            "rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi", "r8", "r9", "r10", "r11",
            "r12", "r13", "r14", "r15",
        ];
        let mut d = Vec::new();
        let mut word = |name: &str, a: u64, b: u64| {
            if a != b {
                d.push(format!("{name} {a:#x} vs {b:#x}"));
            }
        };
        word("cr3", self.cr3, other.cr3);
        word("rip", self.rip, other.rip);
        word("rflags", self.rflags, other.rflags);
        for (i, name) in NAMES.iter().enumerate() {
            word(name, self.gprs[i], other.gprs[i]);
        }
        word("fs base", self.fs_base, other.fs_base);
        word("gs base", self.gs_base, other.gs_base);
        for ((at, a), (_, b)) in self.words.iter().zip(&other.words) {
            word(&format!("memory word at {at:#x}"), *a, *b);
        }
        if self.xstate != other.xstate {
            d.push("extended state".to_owned());
        }
        if self.memory != other.memory {
            d.push(format!("memory ({} written pages)", self.pages.len()));
        }
        d
    }
}

/// RAX..R15 in encoding order.
pub fn gprs(r: &kvm_bindings::kvm_regs) -> [u64; 16] {
    [
        r.rax, r.rcx, r.rdx, r.rbx, r.rsp, r.rbp, r.rsi, r.rdi, r.r8, r.r9, r.r10, r.r11, r.r12,
        r.r13, r.r14, r.r15,
    ]
}

/// A set of guest page frames, kept as the gaps between ascending frame
/// numbers: compact in the log, where runs of pages are common.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageSet {
    gaps: Vec<u64>,
}

impl PageSet {
    /// From a KVM dirty bitmap (bit n of word w: frame 64 w + n).
    pub fn from_bitmap(bitmap: &[u64]) -> Self {
        let mut gaps = Vec::new();
        let mut last = 0u64;
        for (w, &bits) in bitmap.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let frame = w as u64 * 64 + u64::from(bits.trailing_zeros());
                gaps.push(frame - last);
                last = frame;
                bits &= bits - 1;
            }
        }
        PageSet { gaps }
    }

    /// From ascending frame numbers.
    pub fn from_frames(frames: impl IntoIterator<Item = u64>) -> Self {
        let mut last = 0u64;
        let gaps = frames
            .into_iter()
            .map(|f| {
                let gap = f.wrapping_sub(last);
                last = f;
                gap
            })
            .collect();
        PageSet { gaps }
    }

    pub fn len(&self) -> usize {
        self.gaps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.gaps.is_empty()
    }

    /// The frame numbers, ascending.
    pub fn frames(&self) -> impl Iterator<Item = u64> + '_ {
        self.gaps.iter().scan(0u64, |at, &g| {
            *at = at.wrapping_add(g);
            Some(*at)
        })
    }
}

/// A fast 64-bit digest for equality checks between two runs of the same
/// guest (not a defence against a guest that wants to collide it: it
/// could only spoil its own replay).
#[derive(Clone, Copy, Debug)]
pub struct Digest {
    lanes: [u64; 4],
    len: u64,
}

const K: [u64; 4] = [
    0x9e37_79b9_7f4a_7c15,
    0xc2b2_ae3d_27d4_eb4f,
    0x1656_67b1_9e37_79f9,
    0x85eb_ca77_c2b2_ae63,
];

impl Default for Digest {
    fn default() -> Self {
        Self::new()
    }
}

impl Digest {
    pub fn new() -> Self {
        Digest { lanes: K, len: 0 }
    }

    pub fn word(&mut self, w: u64) {
        let lane = (self.len & 3) as usize;
        let x = (self.lanes[lane] ^ w).wrapping_mul(K[lane]);
        self.lanes[lane] = x.rotate_left(31) ^ (x >> 29);
        self.len += 1;
    }

    pub fn bytes(&mut self, b: &[u8]) {
        let mut chunks = b.chunks_exact(8);
        for c in &mut chunks {
            self.word(u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.word(u64::from_le_bytes(last) ^ ((rest.len() as u64) << 56));
        }
    }

    pub fn finish(&self) -> u64 {
        let mut h = self.len;
        for (i, l) in self.lanes.iter().enumerate() {
            h = (h ^ l).wrapping_mul(K[i]).rotate_left(27);
        }
        // murmur3's finalizer
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

/// Digest of the extended state in a `KVM_GET_XSAVE` image.
pub fn xstate_digest(cpu: &[u8], layout: &XsaveLayout) -> u64 {
    let mut d = Digest::new();
    xstate::visible_state(cpu, layout, |part| d.bytes(part));
    d.finish()
}

/// Digest of the contents of `pages` (frame number and bytes of each);
/// frames outside guest memory count as absent. `overlay` holds bytes the
/// digest takes instead of what memory has now, (guest physical address,
/// bytes) within one page each: what the VMM changed to search for a
/// point. `entries` are page-table entries (guest physical addresses)
/// whose accessed and dirty bits do not count: those on the way to the
/// trampoline's pages and to the words it reads, which the trampoline's
/// own accesses set at replay and nothing sets while recording.
pub fn memory_digest(
    mem: &GuestMemoryMmap,
    pages: &PageSet,
    overlay: &[(u64, Vec<u8>)],
    entries: &[u64],
) -> u64 {
    let mut d = Digest::new();
    let mut page = [0u8; 4096];
    for frame in pages.frames() {
        d.word(frame);
        let base = frame << 12;
        match mem.read_slice(&mut page, GuestAddress(base)) {
            Ok(()) => {
                for (gpa, bytes) in overlay {
                    if gpa >> 12 == frame {
                        let at = (gpa - base) as usize;
                        let end = (at + bytes.len()).min(page.len());
                        page[at..end].copy_from_slice(&bytes[..end - at]);
                    }
                }
                for &gpa in entries {
                    if gpa >> 12 == frame && gpa % 8 == 0 {
                        let at = (gpa - base) as usize;
                        let entry =
                            u64::from_le_bytes(page[at..at + 8].try_into().unwrap_or([0; 8]));
                        let masked = entry & !introspect::gva::ACCESSED_DIRTY;
                        page[at..at + 8].copy_from_slice(&masked.to_le_bytes());
                    }
                }
                d.bytes(&page)
            }
            Err(_) => d.word(u64::MAX),
        }
    }
    d.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_sets_round_trip_a_bitmap() {
        let mut bitmap = vec![0u64; 4];
        for frame in [0u64, 1, 63, 64, 200, 255] {
            bitmap[(frame / 64) as usize] |= 1 << (frame % 64);
        }
        let set = PageSet::from_bitmap(&bitmap);
        assert_eq!(set.frames().collect::<Vec<_>>(), [0, 1, 63, 64, 200, 255]);
        assert_eq!(PageSet::from_frames(set.frames()), set);
        assert_eq!(set.len(), 6);
        assert!(PageSet::from_bitmap(&[0, 0]).is_empty());
    }

    #[test]
    fn memory_digests_see_every_byte_of_every_listed_page() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let pages = PageSet::from_bitmap(&[0b1010]);
        let before = memory_digest(&mem, &pages, &[], &[]);
        // A page that is not listed does not count...
        mem.write_obj(1u8, GuestAddress(0x2000)).unwrap();
        assert_eq!(memory_digest(&mem, &pages, &[], &[]), before);
        // ...every byte of a listed one does, the last included.
        mem.write_obj(1u8, GuestAddress(0x3fff)).unwrap();
        let after = memory_digest(&mem, &pages, &[], &[]);
        assert_ne!(after, before);
        // Unless the overlay says what the byte was.
        assert_eq!(
            memory_digest(&mem, &pages, &[(0x3fff, vec![0])], &[]),
            before
        );
        mem.write_obj(0u8, GuestAddress(0x3fff)).unwrap();
        // Accessed and dirty bits of the entries named do not count.
        mem.write_obj(0x1063u64, GuestAddress(0x3ff8)).unwrap();
        let entry = memory_digest(&mem, &pages, &[], &[0x3ff8]);
        mem.write_obj(0x1003u64, GuestAddress(0x3ff8)).unwrap();
        assert_eq!(memory_digest(&mem, &pages, &[], &[0x3ff8]), entry);
        // Unnamed, they count.
        mem.write_obj(0x1063u64, GuestAddress(0x3ff8)).unwrap();
        assert_ne!(memory_digest(&mem, &pages, &[], &[]), entry);
        mem.write_obj(0u64, GuestAddress(0x3ff8)).unwrap();
        mem.write_obj(1u8, GuestAddress(0x3fff)).unwrap();
        mem.write_obj(0u8, GuestAddress(0x3fff)).unwrap();
        mem.write_obj(1u8, GuestAddress(0x1000)).unwrap();
        assert_ne!(memory_digest(&mem, &pages, &[], &[]), before);
        assert_ne!(memory_digest(&mem, &pages, &[], &[]), after);
    }

    #[test]
    fn digests_depend_on_order_and_length() {
        let d = |words: &[u64]| {
            let mut d = Digest::new();
            words.iter().for_each(|&w| d.word(w));
            d.finish()
        };
        assert_ne!(d(&[1, 2]), d(&[2, 1]));
        assert_ne!(d(&[0]), d(&[0, 0]));
        assert_ne!(d(&[1, 0, 0, 0, 0]), d(&[0, 0, 0, 0, 1]));
        let mut a = Digest::new();
        a.bytes(&[1, 2, 3]);
        let mut b = Digest::new();
        b.bytes(&[1, 2, 3, 0]);
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn extended_state_not_in_use_reads_as_its_initial_value() {
        let layout = XsaveLayout::from_cpuid([(2, 256, 576)]);
        let mut cpu = vec![0u8; 4096];
        cpu[0] = 0x7f;
        cpu[1] = 0x03;
        // XSTATE_BV 0: garbage left in the XMM and AVX areas is not state.
        cpu[200] = 0xaa;
        cpu[600] = 0xbb;
        let init = xstate_digest(&cpu, &layout);
        let mut clean = vec![0u8; 4096];
        clean[512] = 0b111; // in use, but all at their initial values
        clean[0] = 0x7f;
        clean[1] = 0x03;
        assert_eq!(xstate_digest(&clean, &layout), init);
        // In use with a value: a different state.
        clean[600] = 1;
        assert_ne!(xstate_digest(&clean, &layout), init);
        // MXCSR always counts.
        cpu[24] = 0x80;
        assert_ne!(xstate_digest(&cpu, &layout), init);
    }

    #[test]
    fn differences_name_each_part() {
        let a = UserState {
            cr3: 0x1000,
            rip: 0x40_1000,
            rflags: 0x246,
            gprs: [0; 16],
            fs_base: 0,
            gs_base: 0,
            xstate: 1,
            words: vec![],
            pages: PageSet::default(),
            memory: 2,
        };
        assert!(a.differences(&a).is_empty());
        let mut b = a.clone();
        b.gprs[3] = 5;
        b.memory = 3;
        assert_eq!(
            a.differences(&b),
            ["rbx 0x0 vs 0x5", "memory (0 written pages)"]
        );
        assert_eq!(b.kvm_regs().rbx, 5);
        assert_eq!(gprs(&b.kvm_regs()), b.gprs);
    }
}
