//! Call stacks of guest user code, unwound by call-frame information.
//!
//! Programs built with `-O2` keep no frame pointers: the only record of
//! where a function's caller's frame is lies in the call-frame information
//! (`.eh_frame`) compilers emit for exception handling, one table row per
//! range of instructions saying how to find the canonical frame address
//! (CFA) and where the return address and saved registers are. This crate
//! reads those tables with `gimli` and walks a stack from a thread's
//! registers through any [`ProcessMemory`] (guest memory through the guest's page
//! tables, or a snapshot), object by object as the process mapped them.
//!
//! Where an address has no call-frame information (code without it, a
//! JIT), the walk falls back to the frame pointer. Every step is bounded:
//! a frame must lie above the one before it, and a walk stops after the
//! number of frames it is given.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameOffset, LittleEndian, RegisterRule, UnwindContext,
    UnwindSection, X86_64,
};
use guestfiles::elf::unwind_sections;

/// Reads the unwound process's memory.
pub trait ProcessMemory {
    /// The 8 bytes at `addr`, little-endian; `None` if unmapped.
    fn read_u64(&mut self, addr: u64) -> Option<u64>;
}

/// The registers a walk starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regs {
    pub rip: u64,
    pub rsp: u64,
    pub rbp: u64,
}

/// One object file's call-frame information, parsed once and shared by
/// every process that maps the object.
pub struct ObjectCfi {
    eh_frame: Vec<u8>,
    bases: BaseAddresses,
    /// (first address, end, offset of its FDE in `eh_frame`), by address,
    /// in the object's own addresses.
    fdes: Vec<(u64, u64, usize)>,
    /// The object's loadable addresses, lowest and end.
    span: (u64, u64),
}

impl ObjectCfi {
    /// Parses an ELF file's `.eh_frame`. `None` if the file is not a
    /// 64-bit little-endian ELF file; an object without `.eh_frame` gets
    /// an empty table (its frames are walked by frame pointer).
    pub fn parse(elf: &[u8]) -> Option<Self> {
        let sections = unwind_sections(elf)?;
        let mut bases = BaseAddresses::default();
        if let Some(text) = sections.text {
            bases = bases.set_text(text);
        }
        if let Some(got) = sections.got {
            bases = bases.set_got(got);
        }
        let mut cfi = ObjectCfi {
            eh_frame: sections.eh_frame.to_vec(),
            bases: bases.set_eh_frame(sections.eh_frame_address),
            fdes: Vec::new(),
            span: sections.span,
        };
        cfi.fdes = cfi.index();
        Some(cfi)
    }

    /// Every FDE's address range, sorted; malformed entries end the index
    /// (what was read before them stays usable).
    fn index(&self) -> Vec<(u64, u64, usize)> {
        let section = EhFrame::new(&self.eh_frame, LittleEndian);
        let mut fdes = Vec::new();
        let mut entries = section.entries(&self.bases);
        while let Ok(Some(entry)) = entries.next() {
            if let gimli::CieOrFde::Fde(partial) = entry {
                let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else {
                    continue;
                };
                let start = fde.initial_address();
                let end = start.saturating_add(fde.len());
                if end > start {
                    fdes.push((start, end, fde.offset()));
                }
            }
        }
        fdes.sort_unstable();
        fdes
    }

    /// The number of functions described.
    pub fn functions(&self) -> usize {
        self.fdes.len()
    }

    /// How to find the caller's frame at `addr` (the object's own
    /// address): the CFA as (register, offset), and where the return
    /// address and the caller's RBP are relative to it. `None` where there
    /// is no row or a rule this walk does not follow (expressions).
    fn rule_at(&self, ctx: &mut UnwindContext<usize>, addr: u64) -> Option<FrameRule> {
        let i = self.fdes.partition_point(|&(start, _, _)| start <= addr);
        let &(start, end, offset) = self.fdes.get(i.checked_sub(1)?)?;
        if addr < start || addr >= end {
            return None;
        }
        let section = EhFrame::new(&self.eh_frame, LittleEndian);
        let fde = section
            .fde_from_offset(&self.bases, EhFrameOffset(offset), EhFrame::cie_from_offset)
            .ok()?;
        let row = fde
            .unwind_info_for_address(&section, &self.bases, ctx, addr)
            .ok()?;
        let (cfa_reg, cfa_offset) = match *row.cfa() {
            CfaRule::RegisterAndOffset { register, offset } => (register, offset),
            CfaRule::Expression(_) => return None,
        };
        let cfa_reg = match cfa_reg {
            X86_64::RSP => CfaBase::Rsp,
            X86_64::RBP => CfaBase::Rbp,
            _ => return None,
        };
        let ra = match row.register(X86_64::RA) {
            RegisterRule::Offset(n) => Some(n),
            RegisterRule::Undefined => None,
            _ => return None,
        };
        let rbp = match row.register(X86_64::RBP) {
            RegisterRule::Offset(n) => Some(n),
            RegisterRule::SameValue | RegisterRule::Undefined => None,
            _ => return None,
        };
        Some(FrameRule {
            cfa: (cfa_reg, cfa_offset),
            ra,
            rbp,
        })
    }
}

#[derive(Clone, Copy, Debug)]
enum CfaBase {
    Rsp,
    Rbp,
}

#[derive(Clone, Copy, Debug)]
struct FrameRule {
    cfa: (CfaBase, i64),
    /// Offset of the return address from the CFA; `None`: the outermost
    /// frame (the thread's or process's first function).
    ra: Option<i64>,
    /// Offset of the saved RBP from the CFA; `None`: RBP is unchanged.
    rbp: Option<i64>,
}

/// The objects one process has mapped: each object's call-frame
/// information and its load bias (what its own addresses are offset by,
/// the `dlpi_addr` of `dl_iterate_phdr`).
#[derive(Default)]
pub struct AddressSpace {
    /// (lowest address, end, bias, object), by address.
    objects: Vec<(u64, u64, u64, Arc<ObjectCfi>)>,
}

impl AddressSpace {
    /// Adds an object loaded at `bias`; a later object overlapping an
    /// earlier one replaces it (the earlier was unmapped).
    pub fn add(&mut self, bias: u64, object: Arc<ObjectCfi>) {
        let lo = object.span.0.wrapping_add(bias);
        let hi = object.span.1.wrapping_add(bias);
        if hi <= lo {
            return;
        }
        self.objects.retain(|&(l, h, _, _)| h <= lo || l >= hi);
        let at = self.objects.partition_point(|&(l, _, _, _)| l < lo);
        self.objects.insert(at, (lo, hi, bias, object));
    }

    fn object_at(&self, addr: u64) -> Option<(u64, &ObjectCfi)> {
        let i = self.objects.partition_point(|&(lo, _, _, _)| lo <= addr);
        let (_, hi, bias, object) = self.objects.get(i.checked_sub(1)?)?;
        (addr < *hi).then_some((*bias, object.as_ref()))
    }

    /// The return addresses of the stack `regs` describe, innermost
    /// first (the frame at `regs.rip` itself is not among them): at most
    /// `max`. Each frame is unwound by its object's call-frame
    /// information, or by the frame pointer where there is none; the walk
    /// stops at the outermost frame, at unreadable memory, or at a frame
    /// not above the one before it.
    pub fn unwind(&self, mem: &mut impl ProcessMemory, regs: Regs, max: usize) -> Vec<u64> {
        let mut ctx = UnwindContext::new();
        let mut frames = Vec::new();
        let Regs {
            mut rip,
            mut rsp,
            mut rbp,
        } = regs;
        // The innermost frame is at `rip`; a caller's is at its call
        // instruction, the byte before the return address.
        let mut lookup = rip;
        while frames.len() < max {
            let rule = self
                .object_at(lookup)
                .and_then(|(bias, object)| object.rule_at(&mut ctx, lookup.wrapping_sub(bias)));
            let (cfa, ra, saved_rbp) = match rule {
                Some(rule) => {
                    let base = match rule.cfa.0 {
                        CfaBase::Rsp => rsp,
                        CfaBase::Rbp => rbp,
                    };
                    let cfa = base.wrapping_add_signed(rule.cfa.1);
                    let Some(ra_at) = rule.ra else {
                        break;
                    };
                    let Some(ra) = mem.read_u64(cfa.wrapping_add_signed(ra_at)) else {
                        break;
                    };
                    let saved_rbp = match rule.rbp {
                        Some(at) => match mem.read_u64(cfa.wrapping_add_signed(at)) {
                            Some(v) => v,
                            None => break,
                        },
                        None => rbp,
                    };
                    (cfa, ra, saved_rbp)
                }
                None => {
                    // The frame pointer: [rbp] is the caller's RBP,
                    // [rbp + 8] the return address.
                    if rbp < rsp || !rbp.is_multiple_of(8) {
                        break;
                    }
                    let (Some(next), Some(ra)) = (mem.read_u64(rbp), mem.read_u64(rbp + 8)) else {
                        break;
                    };
                    (rbp.wrapping_add(16), ra, next)
                }
            };
            if ra == 0 || cfa <= rsp {
                break;
            }
            frames.push(ra);
            (rip, rsp, rbp) = (ra, cfa, saved_rbp);
            lookup = rip.wrapping_sub(1);
        }
        frames
    }
}

/// Reads a guest file by its absolute path (`None`: no such file).
pub type FileLoader = Box<dyn FnMut(&str) -> Option<Vec<u8>> + Send>;

/// The objects every process has mapped, as the processes announced them
/// (a path and a load bias per object), with each file's call-frame
/// information read once, however many processes map it.
pub struct Processes {
    load: FileLoader,
    /// Per path: its call-frame information, or `None` when the file is
    /// missing or not an ELF file this reads (its frames are walked by
    /// frame pointer).
    objects: HashMap<String, Option<Arc<ObjectCfi>>>,
    spaces: HashMap<u32, AddressSpace>,
    /// What each process announced, in order: (load bias, path).
    announced: HashMap<u32, Vec<(u64, String)>>,
    /// Processes that raised an event after announcing their objects: a
    /// new announcement is of a new program (exec).
    settled: HashSet<u32>,
}

/// What [`Processes`] knows of each process, without the files: the
/// objects each announced (bias, path) and those that settled. Enough to
/// put it back as it was (a replay checkpoint).
pub type ProcessesState = (Vec<(u32, Vec<(u64, String)>)>, Vec<u32>);

/// Files larger than this are not read for their call-frame information
/// (1 GiB).
const MAX_OBJECT: usize = 1 << 30;

impl Processes {
    /// Reads files through `load` as processes map them.
    pub fn new(load: FileLoader) -> Self {
        Processes {
            load,
            objects: HashMap::new(),
            spaces: HashMap::new(),
            announced: HashMap::new(),
            settled: HashSet::new(),
        }
    }

    /// The processes' announcements, by pid.
    pub fn state(&self) -> ProcessesState {
        let mut spaces: Vec<_> = self
            .announced
            .iter()
            .map(|(pid, objects)| (*pid, objects.clone()))
            .collect();
        spaces.sort_by_key(|s| s.0);
        let mut settled: Vec<u32> = self.settled.iter().copied().collect();
        settled.sort_unstable();
        (spaces, settled)
    }

    /// Announces again what `state` says each process announced (files
    /// are read as they were the first time).
    pub fn restore(&mut self, state: &ProcessesState) {
        self.spaces.clear();
        self.announced.clear();
        self.settled.clear();
        for (pid, objects) in &state.0 {
            for (bias, path) in objects {
                self.mapped(*pid, *bias, path);
            }
        }
        self.settled = state.1.iter().copied().collect();
    }

    /// Process `pid` has the object at `path` loaded at `bias`. Processes
    /// announce all their objects before their first other event, and
    /// again after an exec: an announcement after another event starts
    /// the process's list anew.
    pub fn mapped(&mut self, pid: u32, bias: u64, path: &str) {
        if self.settled.remove(&pid) {
            self.spaces.remove(&pid);
            self.announced.remove(&pid);
        }
        self.announced
            .entry(pid)
            .or_default()
            .push((bias, path.to_owned()));
        let object = match self.objects.get(path) {
            Some(object) => object.clone(),
            None => {
                let object = (self.load)(path)
                    .filter(|data| data.len() <= MAX_OBJECT)
                    .and_then(|data| ObjectCfi::parse(&data))
                    .map(Arc::new);
                self.objects.insert(path.to_owned(), object.clone());
                object
            }
        };
        if let Some(object) = object {
            self.spaces.entry(pid).or_default().add(bias, object);
        }
    }

    /// Process `pid` raised an event other than an object's announcement.
    pub fn raised(&mut self, pid: u32) {
        if self.spaces.contains_key(&pid) {
            self.settled.insert(pid);
        }
    }

    /// The stack of a thread of `pid` (see [`AddressSpace::unwind`]); a
    /// process that announced nothing is walked by frame pointer.
    pub fn unwind(
        &self,
        pid: u32,
        mem: &mut impl ProcessMemory,
        regs: Regs,
        max: usize,
    ) -> Vec<u64> {
        match self.spaces.get(&pid) {
            Some(space) => space.unwind(mem, regs, max),
            None => AddressSpace::default().unwind(mem, regs, max),
        }
    }

    /// The files read so far and how many had call-frame information.
    pub fn files(&self) -> (usize, usize) {
        let with = self.objects.values().filter(|o| o.is_some()).count();
        (self.objects.len(), with)
    }
}
