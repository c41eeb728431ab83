//! Asynchronous points (`journal::preempt`): taken at kicks while
//! recording, found again by the trampoline at replay.

use std::time::Instant;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::{kvm_err, Vm, VmError};
use introspect::gva;
use introspect::probe_gate;
use introspect::stub_area::{GuestArea, EXIT_PAGE_GPA};
use journal::preempt::guest_code::{self, build_stub, code_around, trampoline_entries, PageTables};
use journal::preempt::site::{self, Site};
use journal::preempt::state::{self, PageSet};
use journal::preempt::trampoline::Stub;
use journal::preempt::{AsyncPoint, CodeMap};
use journal::Journal;

mod record;
mod replay;

use replay::Search;

/// How long user code must have run without an exit of its own before a
/// pending interrupt is delivered where it stands. A run delivers a timer
/// tick at once; waiting for a whole tick (10 ms, HZ=100) let a spinning
/// thread keep the CPU twice as long as in a run (spin_lock took 1.9
/// times as long recorded as run; 1.0 with 2 ms), while code that enters
/// the kernel at least this often is never preempted asynchronously.
const PREEMPT_AFTER_NS: u64 = 2_000_000;
/// How soon to look again after a kick found a position replay could not
/// find (inside a `rep` string, on a `call`, in the guest kernel).
const RETRY_NS: u64 = 200_000;
/// How long a recorder's trap waits for the task to come back to its
/// position before it is given up (and the next kick looks again).
const TRAP_NS: u64 = 2_000_000;
/// How long before a point is due the dirty log starts afresh, when it
/// must (`WINDOW_MAX_NS`): the point then lists the pages written in the
/// last millisecond or so (at least this long: a point due sooner after
/// the restart waits), otherwise those written since the last restart,
/// at most `WINDOW_MAX_NS` before. Every restart write-protects the pages written
/// since, and each next write to one faults (through two hypervisors on a
/// nested host, where such a fault can take a millisecond): restarting it
/// every 5 ms at exits made GNU sort record in 1.5 times its run's time,
/// every 20 ms 1.45 times, never 1.1 times; restarting at every exit made
/// a probed syn_cont record 7.3 times slower than without probes.
const WINDOW_NS: u64 = 1_000_000;
/// A window older than this when its point is due starts afresh. Only
/// points need a window, so it starts afresh only before one: GNU sort
/// records in 1.2 times its run's time.
const WINDOW_MAX_NS: u64 = 50_000_000;
/// The slot of guest RAM (the only one).
const RAM_SLOT: u32 = 0;

/// Counts shown with a run's outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreemptStats {
    /// Asynchronous points recorded, or reached at replay.
    pub points: u64,
    /// Kicks at a position replay could not find again: the next kick
    /// tries again.
    pub declined: u64,
    /// Recording: points taken at the task's next pass over the position
    /// where it resumed, because a patch at the kicked one would have
    /// covered it.
    pub advanced: u64,
    /// Replay: trampoline exits whose registers matched.
    pub candidates: u64,
    /// Replay: candidates whose extended state or memory differed.
    pub rejected: u64,
    /// Replay: probe gate exits (events raised, none of them the
    /// recording's exits).
    pub gate_exits: u64,
    /// Host time spent on the points: reading the state and its digests
    /// when recording, searching when replaying.
    pub busy_ns: u64,
}

/// Preemption state of a VM.
#[derive(Default)]
pub(super) struct Preemption {
    /// Where the guest kernel keeps its area, once announced.
    area_gpa: Option<u64>,
    /// VM time of the last deterministic exit; `None` before the run's
    /// first (a restored guest's log starts at its first exit, and a
    /// point before it would follow no exit: replay could not look for
    /// it).
    last_exit_ns: Option<u64>,
    /// Recording: VM time the dirty log last started afresh (the window
    /// of pages a point lists).
    last_reset_ns: u64,
    /// No new attempt before this VM time.
    retry_ns: u64,
    /// Recording: KVM logs the pages the guest writes.
    dirty_logging: bool,
    /// Recording: a trap that stops the task at a better position.
    trap: Option<Patch>,
    /// Replay: the point being searched for.
    search: Option<Search>,
    /// Replay: accept a candidate on its registers alone (shows what the
    /// memory checks are for; never what a user wants).
    registers_only: bool,
    /// Recording: deliver at deterministic exits only.
    exits_only: bool,
    /// Replay: the heap gate leaves the guest (its events are collected).
    heap_events: bool,
    /// Recording: the host TSC when the recording started.
    tsc_start: u64,
    /// Recording: the dirty bitmaps read since the log last started
    /// afresh, merged (a read resets KVM's log; a point declined after one
    /// must not lose the pages it saw).
    window_pages: Vec<u64>,
    pub(super) stats: PreemptStats,
}

/// A trampoline in place in the guest.
pub(super) struct Patch {
    /// The position it stops at.
    rip: u64,
    /// VM time it was put in place.
    since_ns: u64,
    /// Code page of the trampoline mapping it uses.
    stub: u64,
    /// Where its store to the exit page is (and ends).
    exit_rips: [u64; 2],
    /// Guest bytes it overwrote, to put back: (address, bytes).
    saved: Vec<(u64, Vec<u8>)>,
    started: Instant,
}

/// What a store to the exit page was.
pub(super) enum Candidate {
    /// Not a trampoline's: an ordinary (deterministic) MMIO exit.
    NotOurs,
    /// A trampoline's, but not a point: the guest goes on.
    Passed,
    /// A point: the interrupt is delivered here.
    Reached,
}

impl Preemption {
    /// Where the guest kernel keeps its area, once announced.
    pub(in crate::vm) fn area_gpa(&self) -> Option<u64> {
        self.area_gpa
    }

    /// A restored checkpoint's: the area the guest announced (its probe
    /// gate is in the restored memory), and the counts so far.
    pub(in crate::vm) fn resume(&mut self, area_gpa: Option<u64>, stats: PreemptStats) {
        self.area_gpa = area_gpa;
        self.stats = stats;
    }

    /// Whether a trampoline is in place.
    pub(in crate::vm) fn patched(&self) -> bool {
        self.search.is_some() || self.trap.is_some()
    }

    /// Replay: a probe gate exit (a search under way allows for it).
    pub(in crate::vm) fn gate_exit(&mut self) {
        self.stats.gate_exits += 1;
        if let Some(search) = &mut self.search {
            search.gate_exits += 1;
        }
    }

    /// Replay: a single step of a traced process (a search under way
    /// allows for it, as for a gate exit).
    pub(in crate::vm) fn traced_step(&mut self) {
        if let Some(search) = &mut self.search {
            search.gate_exits += 1;
        }
    }

    /// Replay, stepping a traced process in the address space `cr3`:
    /// where the search under way put its trampoline's jump, if there.
    pub(in crate::vm) fn search_patch_at(&self, cr3: u64) -> Option<u64> {
        let search = self.search.as_ref()?;
        (search.point.state.cr3 == cr3 & state::CR3_ROOT).then_some(search.patch.rip)
    }

    /// Replay, stepping a traced process: the instruction the trampoline
    /// moved to `rip` in its code page, as (original address, bytes).
    pub(in crate::vm) fn moved_instruction(&self, cr3: u64, rip: u64) -> Option<(u64, Vec<u8>)> {
        let search = self.search.as_ref()?;
        if search.point.state.cr3 != cr3 & state::CR3_ROOT {
            return None;
        }
        search
            .moved
            .iter()
            .find(|m| m.0 == rip)
            .map(|m| (m.1, m.2.clone()))
    }

    /// Replay: what the search for a point under way has seen.
    pub(in crate::vm) fn search_progress(&self) -> Option<String> {
        self.search.as_ref().map(Search::progress)
    }

    /// Where a SAMPLE taken now should say the guest is: inside the
    /// trampoline is at the patched position.
    pub(in crate::vm) fn sample_rip(&self, rip: u64) -> u64 {
        match &self.search {
            Some(s) if (s.patch.stub..s.patch.stub + 0x1000).contains(&rip) => s.patch.rip,
            _ => rip,
        }
    }
}

impl Vm {
    /// The guest kernel announced its preemption area (RSI).
    /// The probe gate goes at the end of its code page, silent unless
    /// replaying (`introspect::probe_gate`): every replay takes the same path,
    /// whether it captures events or not.
    pub(in crate::vm) fn attach_preempt_area(&mut self) {
        let gpa = self.vcpu.sync_regs().regs.rsi;
        if GuestArea::read(&self.mem, gpa).is_err() {
            return;
        }
        self.preempt.area_gpa = Some(gpa);
        self.install_probe_gate();
    }

    /// Writes the probe gate into the announced area's code page, in the
    /// mode this run needs.
    pub(in crate::vm) fn install_probe_gate(&mut self) {
        let Some(area) = self
            .preempt
            .area_gpa
            .and_then(|gpa| GuestArea::read(&self.mem, gpa).ok())
        else {
            return;
        };
        let (mode, heap) = match (self.journal.is_replay(), self.preempt.heap_events) {
            (false, _) => (probe_gate::Mode::Silent, probe_gate::Mode::Silent),
            (true, false) => (probe_gate::Mode::Exit, probe_gate::Mode::Silent),
            (true, true) => (probe_gate::Mode::Exit, probe_gate::Mode::Exit),
        };
        let at = GuestAddress(area.code_pa + probe_gate::HEADER_OFFSET);
        // The area was checked to name a page of RAM.
        let _ = self.mem.write_slice(&probe_gate::bytes(mode, heap), at);
    }

    /// Replay: collect the probe library's heap events (HEAPCALL, ALLOC,
    /// FREE) too: the heap gate leaves the guest like the other.
    pub fn collect_heap_events(&mut self) {
        self.preempt.heap_events = true;
        self.install_probe_gate();
    }

    /// The process of the task on the vCPU maps the trampoline pages here
    /// (none before the guest kernel announced its area).
    pub(in crate::vm) fn stub_mappings(&self) -> [u64; 2] {
        self.preempt
            .area_gpa
            .and_then(|gpa| GuestArea::read(&self.mem, gpa).ok())
            .map_or([0; 2], |a| a.stub_va)
    }

    /// Recording: never preempt user code where it stands (for hosts where
    /// `host_check::probe_state_match` says it cannot work).
    pub fn deliver_at_exits_only(&mut self) {
        self.preempt.exits_only = true;
    }

    /// Replay: accept trampoline candidates on their registers alone, as
    /// a replay that did not check memory would (a demonstration that the
    /// checks matter, never what a user wants).
    pub fn match_registers_only(&mut self) {
        self.preempt.registers_only = true;
    }

    /// Turns KVM's dirty log on when recording (the pages an asynchronous
    /// point lists).
    pub(in crate::vm) fn start_dirty_log(&mut self) -> Result<(), VmError> {
        if matches!(self.journal, Journal::Record(_)) && !self.preempt.dirty_logging {
            crate::kvm_ext::log_dirty_pages(&self._vm, &self.mem)
                .map_err(kvm_err("SET_USER_MEMORY_REGION (dirty log)"))?;
            self.preempt.dirty_logging = true;
            self.preempt.tsc_start = crate::sys::host_tsc();
        }
        Ok(())
    }

    /// The pages the guest wrote since the dirty log last started afresh.
    pub(in crate::vm) fn take_dirty_pages(&mut self) -> Result<PageSet, VmError> {
        let size = self.mem.iter().next().map_or(0, |r| r.len() as usize);
        let bitmap = self
            ._vm
            .get_dirty_log(RAM_SLOT, size)
            .map_err(kvm_err("GET_DIRTY_LOG"))?;
        let window = &mut self.preempt.window_pages;
        if window.len() < bitmap.len() {
            window.resize(bitmap.len(), 0);
        }
        for (w, b) in window.iter_mut().zip(&bitmap) {
            *w |= b;
        }
        Ok(PageSet::from_bitmap(window))
    }

    /// After a deterministic exit: the clock for "a tick without an exit",
    /// and no trap left behind.
    pub(in crate::vm) fn preempt_after_exit(&mut self, now: u64) -> Result<(), VmError> {
        self.preempt.last_exit_ns = Some(now);
        if let Some(trap) = self.preempt.trap.take() {
            self.restore(&trap.saved);
        }
        Ok(())
    }

    /// Recording: starts the dirty log afresh, so that a point lists the
    /// pages written from now on (any of those is reproduced by a faithful
    /// replay, but a page written long ago is more likely to hold what is
    /// not, such as a host TSC a user-mode RDTSC returned on hosts that
    /// cannot trap it, and a long window costs a long digest;
    /// `without_timestamps` leaves the timestamps out).
    pub(in crate::vm) fn restart_dirty_log(&mut self, now: u64) -> Result<(), VmError> {
        self.take_dirty_pages()?;
        self.preempt.window_pages.fill(0);
        self.preempt.last_reset_ns = now;
        Ok(())
    }

    /// Whether a trampoline can be placed at `rip` in the code `map`
    /// finds, with one of the process's trampoline mappings `stubs`: the
    /// site and the mapping to use. Never inside those mappings: the probe
    /// gate runs there, silently while recording, otherwise at replay, so
    /// no position there can be found again. Never where a branch nearby
    /// enters the patch in its middle (`Site::entered_inside`): the
    /// recorder takes the position at another pass instead.
    pub(in crate::vm) fn patchable(
        &self,
        map: &dyn CodeMap,
        rip: u64,
        stubs: &[u64],
    ) -> Option<(Site, u64)> {
        if probe_gate::in_stub_pages(rip, stubs) {
            return None;
        }
        let (code, before) = code_around(&self.mem, map, rip);
        let site = site::choose(rip, &code, &before).ok()?;
        if site.entered_inside(&code, &before) {
            return None;
        }
        let stub = stubs
            .iter()
            .copied()
            .filter(|&s| s != 0)
            .find(|&s| build_stub(&site, s, &[]).is_ok())?;
        Some((site, stub))
    }

    /// The 8-byte word at user address `at` in the address space `cr3`,
    /// if user code can read all of it without a fault.
    pub(in crate::vm) fn user_word(&self, cr3: u64, at: u64) -> Option<u64> {
        if at & 0xfff > 0xff8 {
            return None;
        }
        let pa = gva::translate_user(&self.mem, cr3, at).ok()?;
        self.mem.read_obj(GuestAddress(pa)).ok()
    }

    /// Puts a trampoline in place: its code (and data) in the mapping at
    /// `stub` of the address space `cr3`, the jump to it at `rip` in the
    /// code pages `code`; keeps every byte it changes, and the entries
    /// that map the trampoline's pages, whose accessed and dirty bits its
    /// run sets.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::vm) fn install(
        &mut self,
        cr3: u64,
        code_pages: &dyn CodeMap,
        rip: u64,
        stub: u64,
        code: &Stub,
        data: Option<Vec<u8>>,
        jump: Vec<u8>,
    ) -> Result<Patch, String> {
        let pages = AsyncPoint::pages_at(stub);
        let mut saved = Vec::new();
        for entry in trampoline_entries(&self.mem, cr3, stub, &[]) {
            let mut old = vec![0u8; 8];
            self.mem
                .read_slice(&mut old, GuestAddress(entry))
                .map_err(|e| e.to_string())?;
            saved.push((entry, old));
        }
        let tables = PageTables {
            mem: &self.mem,
            cr3,
        };
        let mut writes: Vec<(&dyn CodeMap, u64, Vec<u8>)> =
            vec![(&tables, pages.code, code.code.clone())];
        writes.extend(data.map(|d| (&tables as &dyn CodeMap, pages.data, d)));
        writes.push((code_pages, rip, jump));
        for (map, va, bytes) in writes {
            if let Err(why) = guest_code::write_saving(&self.mem, map, va, &bytes, &mut saved) {
                guest_code::restore(&self.mem, &saved);
                return Err(why);
            }
        }
        Ok(Patch {
            rip,
            since_ns: 0,
            stub,
            exit_rips: [pages.code + code.exit_at, pages.code + code.exit_end],
            saved,
            started: Instant::now(),
        })
    }

    pub(in crate::vm) fn restore(&self, saved: &[(u64, Vec<u8>)]) {
        guest_code::restore(&self.mem, saved);
    }

    /// A store to the exit page (`addr`) at replay or while recording:
    /// whether it is a trampoline's, and what it found.
    pub(in crate::vm) fn trampoline_exit(&mut self, addr: u64) -> Result<Candidate, VmError> {
        let regs = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
        let ours = |p: &Patch| addr == EXIT_PAGE_GPA && p.exit_rips.contains(&regs.rip);
        if self.preempt.trap.as_ref().is_some_and(ours) {
            return self.trap_reached();
        }
        if self.preempt.search.as_ref().is_some_and(|s| ours(&s.patch)) {
            return self.async_candidate(&regs);
        }
        Ok(Candidate::NotOurs)
    }

    /// A trampoline's exit is where the task should stop: completes the
    /// store, puts the guest's bytes back and moves RIP to the patched
    /// position, where an interrupt may then be delivered.
    pub(in crate::vm) fn complete_trampoline_exit(&mut self, patch: &Patch) -> Result<(), VmError> {
        if !self.complete_exit_now("RUN (completing a trampoline's exit)")? {
            return Err(self
                .journal
                .async_point_missed("the vCPU ran on past the trampoline".into())
                .into());
        }
        self.restore(&patch.saved);
        let mut regs = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
        regs.rip = patch.rip;
        self.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))?;
        self.resume_rip = Some(regs.rip);
        Ok(())
    }

    /// The run stopped (the end, a divergence, a failure): the guest's
    /// bytes back.
    pub(in crate::vm) fn end_patches(&mut self) {
        if let Some(search) = self.preempt.search.take() {
            self.restore(&search.patch.saved);
        }
        if let Some(trap) = self.preempt.trap.take() {
            self.restore(&trap.saved);
        }
    }
}
