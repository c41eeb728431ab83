//! Where a recording can put a trampoline: the verdict on a position,
//! and the verdicts on the positions its kicks found last.
//!
//! A task in a loop is stopped at the same few instructions kick after
//! kick, and judging one (decoding the 256 bytes before it from every
//! offset, encoding a trampoline) took about 18 us of a sample mark's
//! ~70 us on nested hosts, where reading its bytes again to compare
//! takes about 2. A verdict depends on nothing but the position, the
//! process's trampoline mappings and those bytes (and the jump tables
//! the code names, its constant data, read only when judging), so a
//! verdict found with the same three is the same verdict.

use iced_x86::{Decoder, DecoderOptions, FlowControl};
use vm_memory::GuestMemoryMmap;

use introspect::probe_gate;
use journal::preempt::guest_code::{self, build_stub, code_around};
use journal::preempt::site::{self, JumpTable, Site};
use journal::preempt::CodePages;

/// How many instructions after an unpatchable position `next_patchable`
/// looks at.
const NEXT_TRIES: usize = 3;

/// How many verdicts are kept: more than the positions a loop's kicks
/// land on, few enough to compare against in a microsecond.
const REMEMBERED: usize = 16;

/// The code a verdict on `rip` is made from.
#[derive(PartialEq, Eq)]
struct Code {
    rip: u64,
    stubs: Vec<u64>,
    /// From `rip` on (up to `site::CODE_WINDOW` bytes, as far as it is
    /// readable).
    after: Vec<u8>,
    /// The `site::LOOP_WINDOW` bytes before it.
    before: Vec<u8>,
    /// The `site::ENTRY_WINDOW` bytes before it.
    entries: Vec<u8>,
}

impl Code {
    fn read(mem: &GuestMemoryMmap, map: &dyn CodePages, rip: u64, stubs: &[u64]) -> Self {
        let (after, before) = code_around(mem, map, rip);
        let entries = guest_code::code_before(mem, map, rip, site::ENTRY_WINDOW);
        Code {
            rip,
            stubs: stubs.to_vec(),
            after,
            before,
            entries,
        }
    }

    /// Whether a trampoline can be placed at this position: the site and
    /// the mapping to use. Never inside the trampoline mappings: the
    /// probe gate runs there, silently while recording, otherwise at
    /// replay, so no position there can be found again. Never where a
    /// branch nearby enters the patch in its middle
    /// (`Site::entered_inside`), or a `switch`'s jump table nearby can
    /// (`site::jump_tables`): the recorder takes the position at another
    /// pass instead.
    fn verdict(&self, mem: &GuestMemoryMmap, map: &dyn CodePages) -> Option<(Site, u64)> {
        if probe_gate::in_stub_pages(self.rip, &self.stubs) {
            return None;
        }
        let site = site::choose(self.rip, &self.after, &self.before).ok()?;
        if site.entered_inside(&self.after, &self.entries) {
            return None;
        }
        // A `switch` nearby may send a thread into the covered bytes; one
        // whose table cannot be read is taken to. Its table is read here,
        // once per verdict: a remembered verdict (on the same code) keeps
        // it, as the table is the code's constant data.
        let inside = site.rip + 1..site.rip + site.len as u64;
        let entered = |table: JumpTable| {
            let len = site::TABLE_ENTRIES * table.entry_len();
            let bytes = guest_code::read_readable(mem, map, table.address(), len);
            bytes.is_empty() || table.targets(&bytes).any(|t| inside.contains(&t))
        };
        if site::jump_tables(self.rip, &self.after, &self.entries)
            .into_iter()
            .any(entered)
        {
            return None;
        }
        let stub = self
            .stubs
            .iter()
            .copied()
            .filter(|&s| s != 0)
            .find(|&s| build_stub(&site, s, &[]).is_ok())?;
        Some((site, stub))
    }
}

/// The verdicts on the positions judged last, the newest first.
#[derive(Default)]
pub(crate) struct Sites {
    recent: Vec<(Code, Option<(Site, u64)>)>,
}

impl Sites {
    /// Whether a trampoline can be placed at `rip` in the code `map`
    /// finds, with one of the process's trampoline mappings `stubs`: the
    /// site and the mapping to use (see `Code::verdict`).
    pub(crate) fn patchable(
        &mut self,
        mem: &GuestMemoryMmap,
        map: &dyn CodePages,
        rip: u64,
        stubs: &[u64],
    ) -> Option<(Site, u64)> {
        let code = Code::read(mem, map, rip, stubs);
        let known = self.recent.iter().position(|(c, _)| *c == code);
        let entry = match known {
            Some(i) => self.recent.remove(i),
            None => {
                let verdict = code.verdict(mem, map);
                self.recent.truncate(REMEMBERED - 1);
                (code, verdict)
            }
        };
        let verdict = entry.1.clone();
        self.recent.insert(0, entry);
        verdict
    }

    /// Where a task standing at `rip`, where no patch can go, passes
    /// next and one can: the first of the `NEXT_TRIES` instructions after
    /// it, in straight-line code from `rip`, that is `patchable`. (A tight
    /// loop can have an instruction the vCPU is mostly stopped after, a
    /// load's, at an unpatchable position: the recorder takes its mark an
    /// instruction or two later rather than none.)
    pub(crate) fn next_patchable(
        &mut self,
        mem: &GuestMemoryMmap,
        map: &dyn CodePages,
        rip: u64,
        stubs: &[u64],
    ) -> Option<u64> {
        let (code, _) = code_around(mem, map, rip);
        let mut decoder = Decoder::with_ip(64, &code, rip, DecoderOptions::NONE);
        for _ in 0..NEXT_TRIES {
            if !decoder.can_decode() {
                return None;
            }
            let i = decoder.decode();
            if i.is_invalid() || i.flow_control() != FlowControl::Next {
                return None;
            }
            if self.patchable(mem, map, i.next_ip(), stubs).is_some() {
                return Some(i.next_ip());
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    /// User code at 0x400000 (guest-physical 0x2000), the page before it
    /// at 0x1000; the process's trampoline mapping within a jump's reach.
    const CODE_VA: u64 = 0x40_0000;
    const STUBS: [u64; 2] = [0x4000_0000, 0];

    fn guest(code: &[u8]) -> (GuestMemoryMmap, Vec<(u64, u64)>) {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x4000)]).unwrap();
        // `add rax, 1`, over and over, on both pages.
        let adds: Vec<u8> = [0x48, 0x83, 0xc0, 0x01].repeat(0x400);
        mem.write_slice(&adds, GuestAddress(0x1000)).unwrap();
        mem.write_slice(&adds, GuestAddress(0x2000)).unwrap();
        mem.write_slice(code, GuestAddress(0x2000 + 0x100)).unwrap();
        (mem, vec![(CODE_VA - 0x1000, 0x1000), (CODE_VA, 0x2000)])
    }

    fn fresh(mem: &GuestMemoryMmap, map: &Vec<(u64, u64)>, rip: u64) -> Option<(u64, usize, u64)> {
        Code::read(mem, map, rip, &STUBS)
            .verdict(mem, map)
            .map(|(site, stub)| (site.rip, site.len, stub))
    }

    #[test]
    fn a_remembered_verdict_is_the_one_judging_again_gives() {
        let (mem, map) = guest(&[]);
        let mut sites = Sites::default();
        let rip = CODE_VA + 0x100;
        let first = sites.patchable(&mem, &map, rip, &STUBS);
        let first = first.map(|(site, stub)| (site.rip, site.len, stub));
        assert_eq!(first, fresh(&mem, &map, rip));
        assert!(first.is_some(), "a run of adds takes a trampoline");
        let again = sites.patchable(&mem, &map, rip, &STUBS);
        assert_eq!(again.map(|(site, stub)| (site.rip, site.len, stub)), first);
        assert_eq!(sites.recent.len(), 1, "the second verdict was remembered");
    }

    #[test]
    fn changed_code_is_judged_again() {
        let (mem, map) = guest(&[]);
        let mut sites = Sites::default();
        let rip = CODE_VA + 0x100;
        assert!(sites.patchable(&mem, &map, rip, &STUBS).is_some());
        // The same position now holds `rep stosb`, where no patch goes.
        mem.write_slice(&[0xf3, 0xaa], GuestAddress(0x2100))
            .unwrap();
        assert_eq!(fresh(&mem, &map, rip), None);
        assert!(sites.patchable(&mem, &map, rip, &STUBS).is_none());
        // A jump 40 bytes on back into the patch's second byte: refused.
        let (mem, map) = guest(&[]);
        let back: i8 = -(40 + 2 - 1);
        mem.write_slice(&[0xeb, back as u8], GuestAddress(0x2100 + 40))
            .unwrap();
        assert_eq!(fresh(&mem, &map, rip), None);
        assert!(sites.patchable(&mem, &map, rip, &STUBS).is_none());
        // And other trampoline mappings are another verdict.
        let (mem, map) = guest(&[]);
        let stubs = [0, 0];
        assert!(sites.patchable(&mem, &map, rip, &STUBS).is_some());
        assert!(sites.patchable(&mem, &map, rip, &stubs).is_none());
    }

    #[test]
    fn a_switch_whose_table_jumps_into_the_patch_is_refused() {
        // Before the position: `lea table(%rip),%rsi; movslq
        // (%rsi,%r13,4),%rax; add %rsi,%rax; jmp *%rax`, the table at
        // 0x500000 (guest-physical 0x3000); the position is a case of
        // adds, two of which the patch covers.
        let (mem, mut map) = guest(&[]);
        let rip = CODE_VA + 0x100;
        let table: u64 = 0x50_0000;
        map.push((table, 0x3000));
        let disp = (table as i64 - (rip - 9) as i64) as i32;
        let mut dispatch = vec![0x48, 0x8d, 0x35];
        dispatch.extend(disp.to_le_bytes());
        dispatch.extend([0x4a, 0x63, 0x04, 0xae, 0x48, 0x01, 0xf0, 0xff, 0xe0]);
        assert_eq!(dispatch.len(), 16);
        mem.write_slice(&dispatch, GuestAddress(0x2100 - 16))
            .unwrap();
        let cases = |targets: &[u64]| {
            let entries: Vec<u8> = (targets.iter())
                .flat_map(|&t| ((t as i64 - table as i64) as i32).to_le_bytes())
                .collect();
            mem.write_slice(&entries, GuestAddress(0x3000)).unwrap();
            fresh(&mem, &map, rip)
        };
        // Cases at the position and past the patch: taken.
        assert!(cases(&[rip, rip + 8, rip + 0x40]).is_some());
        // A case at the second add, inside the patch: refused.
        assert_eq!(cases(&[rip, rip + 4, rip + 0x40]), None);
        // A table that cannot be read: refused too.
        map.pop();
        assert_eq!(fresh(&mem, &map, rip), None);
    }

    #[test]
    fn only_the_latest_verdicts_are_kept() {
        let (mem, map) = guest(&[]);
        let mut sites = Sites::default();
        for i in 0..2 * REMEMBERED as u64 {
            assert!(sites
                .patchable(&mem, &map, CODE_VA + 4 * i, &STUBS)
                .is_some());
        }
        assert_eq!(sites.recent.len(), REMEMBERED);
        assert_eq!(
            sites.recent[0].0.rip,
            CODE_VA + 4 * (2 * REMEMBERED as u64 - 1)
        );
    }
}
