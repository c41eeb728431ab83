//! Asynchronous points (`crate::preempt`): taken at kicks while
//! recording, found again by the trampoline at replay.

use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::{kvm_err, Vm, VmError};
use crate::gva;
use crate::journal::Journal;
use crate::preempt::site::{self, Site, CODE_WINDOW, LOOP_WINDOW};
use crate::preempt::state::{self, PageSet, UserState};
use crate::preempt::trampoline::{self, Stub, StubError};
use crate::preempt::{AsyncPoint, CodeMap, GuestArea, EXIT_PAGE_GPA};

/// A process's page tables as a code map.
struct PageTables<'a> {
    mem: &'a vm_memory::GuestMemoryMmap,
    cr3: u64,
}

impl CodeMap for PageTables<'_> {
    fn page_gpa(&self, page: u64) -> Option<u64> {
        gva::translate(self.mem, self.cr3, page).ok()
    }
}

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
/// The slot of guest RAM (the only one).
const RAM_SLOT: u32 = 0;

/// Counts shown with a run's outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    /// Host time spent on the points: reading the state and its digests
    /// when recording, searching when replaying.
    pub busy_ns: u64,
}

/// Preemption state of a VM.
#[derive(Default)]
pub(super) struct Preemption {
    /// Where the guest kernel keeps its area, once announced.
    area_gpa: Option<u64>,
    /// VM time of the last deterministic exit.
    last_exit_ns: u64,
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
    /// Recording: the host TSC when the recording started.
    tsc_start: u64,
    /// Recording: the dirty bitmaps read since the last exit, merged (a
    /// read resets KVM's log; a point declined after one must not lose
    /// the pages it saw).
    window_pages: Vec<u64>,
    pub(super) stats: PreemptStats,
}

/// A trampoline in place in the guest.
struct Patch {
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

/// A point replay is looking for.
struct Search {
    point: AsyncPoint,
    patch: Patch,
    /// How the last rejected candidate differed, for the report.
    last_rejection: Vec<String>,
}

impl Search {
    /// How long the search may take: the recording got there in
    /// `run_ns`; replay is slower only by the false hits' few nanoseconds,
    /// so three times that (and two seconds for a loaded host) means the
    /// state will never come.
    fn bound(&self) -> Duration {
        Duration::from_nanos(self.point.run_ns.saturating_mul(3)) + Duration::from_secs(2)
    }
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

/// What the recorder makes of the position a kick found.
enum Position {
    Take(Box<AsyncPoint>),
    /// Wait until the task gets back to this position.
    Advance(u64),
    Decline,
    /// Guest kernel code, or an interrupt cannot be taken now: it will
    /// exit soon enough on its own.
    NotNow,
}

impl Preemption {
    /// Whether a trampoline is in place.
    pub(super) fn patched(&self) -> bool {
        self.search.is_some() || self.trap.is_some()
    }

    /// Where a SAMPLE taken now should say the guest is: inside the
    /// trampoline is at the patched position.
    pub(super) fn sample_rip(&self, rip: u64) -> u64 {
        match &self.search {
            Some(s) if (s.patch.stub..s.patch.stub + 0x1000).contains(&rip) => s.patch.rip,
            _ => rip,
        }
    }
}

impl Vm {
    /// The guest kernel announced its preemption area (RSI).
    pub(super) fn attach_preempt_area(&mut self) {
        let gpa = self.vcpu.sync_regs().regs.rsi;
        if GuestArea::read(&self.mem, gpa).is_ok() {
            self.preempt.area_gpa = Some(gpa);
        }
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
    pub(super) fn start_dirty_log(&mut self) -> Result<(), VmError> {
        if matches!(self.journal, Journal::Record(_)) && !self.preempt.dirty_logging {
            crate::kvm_ext::log_dirty_pages(&self._vm, &self.mem)
                .map_err(kvm_err("SET_USER_MEMORY_REGION (dirty log)"))?;
            self.preempt.dirty_logging = true;
            self.preempt.tsc_start = crate::sys::host_tsc();
        }
        Ok(())
    }

    /// The pages the guest wrote since the last deterministic exit.
    fn take_dirty_pages(&mut self) -> Result<PageSet, VmError> {
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
    /// a fresh dirty log, so that a point lists exactly the pages written
    /// since the exit before it (pages written earlier may hold what no
    /// replay reproduces, such as the host TSC a user-mode RDTSC returned
    /// on hosts that cannot trap it: glibc's dynamic loader stores some at
    /// every start; measured, the reset is lost in the cost of the exit
    /// where the guest kernel is interpreted), and no trap left behind.
    pub(super) fn preempt_after_exit(&mut self, now: u64) -> Result<(), VmError> {
        self.preempt.last_exit_ns = now;
        if let Some(trap) = self.preempt.trap.take() {
            self.restore(&trap.saved);
        }
        if self.preempt.dirty_logging {
            self.take_dirty_pages()?;
            self.preempt.window_pages.fill(0);
        }
        Ok(())
    }

    /// Recording: when the vCPU should be kicked to look for an
    /// asynchronous point (u64::MAX: not before something else happens).
    pub(super) fn preempt_deadline(&self) -> u64 {
        if !matches!(self.journal, Journal::Record(_))
            || self.preempt.area_gpa.is_none()
            || self.preempt.exits_only
        {
            return u64::MAX;
        }
        if let Some(trap) = &self.preempt.trap {
            return trap.since_ns + TRAP_NS;
        }
        let mut due = (self.preempt.last_exit_ns + PREEMPT_AFTER_NS).max(self.preempt.retry_ns);
        if !self.platform.pic.has_pending() {
            due = due.max(self.platform.next_timer_ns().unwrap_or(u64::MAX));
        }
        due
    }

    /// Recording, at a kick: if an interrupt has waited a tick for an exit
    /// and the vCPU stands in user code at a position replay can find
    /// again, logs the state there and returns true; the interrupt is then
    /// injected as at an exit.
    pub(super) fn try_async_point(&mut self) -> Result<bool, VmError> {
        let now = self.clock.now_ns();
        self.platform.advance_to(now);
        if self.preempt_deadline() > now || !self.platform.pic.has_pending() {
            return Ok(false);
        }
        if let Some(trap) = self.preempt.trap.take() {
            // The task did not come back: look again at the next kick.
            self.restore(&trap.saved);
            self.preempt.stats.declined += 1;
            self.preempt.retry_ns = now + RETRY_NS;
            return Ok(false);
        }
        let started = Instant::now();
        let position = self.examine(now);
        self.preempt.stats.busy_ns += started.elapsed().as_nanos() as u64;
        match position? {
            Position::Take(point) => {
                self.journal.record_async_point(*point)?;
                self.preempt.stats.points += 1;
                return Ok(true);
            }
            Position::Advance(to) => {
                if self.arm_trap(to)? {
                    return Ok(false);
                }
                self.preempt.stats.declined += 1;
            }
            Position::Decline => self.preempt.stats.declined += 1,
            Position::NotNow => {}
        }
        self.preempt.retry_ns = now + RETRY_NS;
        Ok(false)
    }

    /// What the recorder can make of the position the vCPU is stopped at.
    fn examine(&mut self, now: u64) -> Result<Position, VmError> {
        let run = self.vcpu.get_kvm_run();
        if run.ready_for_interrupt_injection == 0 || run.if_flag == 0 || self.exception_pending {
            return Ok(Position::NotNow);
        }
        let sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        if sregs.cs.selector & 3 != 3 {
            return Ok(Position::NotNow);
        }
        let regs = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
        let Some(area_gpa) = self.preempt.area_gpa else {
            return Ok(Position::Decline);
        };
        let cr3 = sregs.cr3 & state::CR3_ROOT;
        let area = match GuestArea::read(&self.mem, area_gpa) {
            Ok(a) if a.cr3 == cr3 => a,
            _ => return Ok(Position::Decline),
        };
        let tables = PageTables {
            mem: &self.mem,
            cr3,
        };
        let Some((site, stub)) = self.patchable(&tables, regs.rip, &area.stub_va) else {
            return Ok(Position::Decline);
        };
        let page = regs.rip & !0xfff;
        let code_pages: Vec<(u64, u64)> = [page.wrapping_sub(0x1000), page, page + 0x1000]
            .into_iter()
            .filter_map(|p| tables.page_gpa(p).map(|gpa| (p, gpa)))
            .collect();
        // At replay the task resumes user mode where it did here, before
        // it reaches the position: inside the patch it would run its
        // bytes. It passes there again (it got here from there), so the
        // point is taken there, at its next pass.
        if (regs.rip + 1..site.resume()).contains(&area.resume_ip) {
            return Ok(Position::Advance(area.resume_ip));
        }
        let gprs = state::gprs(&regs);
        let words: Vec<(u64, u64)> = site
            .memory_words(&gprs, sregs.fs.base, sregs.gs.base)
            .into_iter()
            .filter_map(|at| self.user_word(cr3, at).map(|v| (at, v)))
            .take(trampoline::MAX_WORDS)
            .collect();
        // Values a user-mode RDTSC returned differ in every run on hosts
        // that cannot trap it (glibc's dynamic loader keeps start-up
        // timestamps, and they travel in callee-saved registers and their
        // spills). A state holding one in a register is never found again:
        // the next kick looks again. Pages holding one are left out of the
        // memory compared.
        let tsc = self.preempt.tsc_start..=crate::sys::host_tsc();
        if gprs.iter().any(|v| tsc.contains(v)) {
            return Ok(Position::Decline);
        }
        let xsave = self.vcpu.get_xsave().map_err(kvm_err("GET_XSAVE"))?;
        let cpu: Vec<u8> = xsave.region.iter().flat_map(|w| w.to_le_bytes()).collect();
        let written = self.take_dirty_pages()?;
        let pages = without_timestamps(&self.mem, &written, &tsc);
        let entries = trampoline_entries(&self.mem, cr3, stub, &words);
        let memory = state::memory_digest(&self.mem, &pages, &[], &entries);
        Ok(Position::Take(Box::new(AsyncPoint {
            state: UserState {
                cr3,
                rip: regs.rip,
                rflags: regs.rflags & !state::RF,
                gprs,
                fs_base: sregs.fs.base,
                gs_base: sregs.gs.base,
                xstate: state::xstate_digest(&cpu, &self.xsave_layout),
                words,
                pages,
                memory,
            },
            stub,
            code_pages,
            run_ns: now.saturating_sub(self.preempt.last_exit_ns),
        })))
    }

    /// Whether a trampoline can be placed at `rip` in the code `map`
    /// finds, with one of the process's trampoline mappings `stubs`: the
    /// site and the mapping to use.
    fn patchable(&self, map: &dyn CodeMap, rip: u64, stubs: &[u64]) -> Option<(Site, u64)> {
        let (code, before) = code_around(&self.mem, map, rip);
        let site = site::choose(rip, &code, &before).ok()?;
        let stub = stubs
            .iter()
            .copied()
            .filter(|&s| s != 0)
            .find(|&s| build_stub(&site, s, &[]).is_ok())?;
        Some((site, stub))
    }

    /// The 8-byte word at user address `at` in the address space `cr3`,
    /// if user code can read all of it without a fault.
    fn user_word(&self, cr3: u64, at: u64) -> Option<u64> {
        if at & 0xfff > 0xff8 {
            return None;
        }
        let pa = gva::translate_user(&self.mem, cr3, at).ok()?;
        self.mem.read_obj(GuestAddress(pa)).ok()
    }

    /// Recording: stops the task when it gets to `rip` (a trap that
    /// exits at once); false if no trap can go there.
    fn arm_trap(&mut self, rip: u64) -> Result<bool, VmError> {
        let sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        let here = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?.rip;
        let cr3 = sregs.cr3 & state::CR3_ROOT;
        let Some(area) = self
            .preempt
            .area_gpa
            .and_then(|gpa| GuestArea::read(&self.mem, gpa).ok())
        else {
            return Ok(false);
        };
        let tables = PageTables {
            mem: &self.mem,
            cr3,
        };
        let Some((site, stub)) = self.patchable(&tables, rip, &area.stub_va) else {
            return Ok(false);
        };
        // The task, stopped here, must not run into the middle of it.
        if (rip + 1..site.resume()).contains(&here) {
            return Ok(false);
        }
        let pages = AsyncPoint::pages_at(stub);
        let code = trampoline::build_trap(
            pages,
            |ip| site.relocated(ip).map_err(StubError::Relocation),
            site.resume(),
        );
        let Ok(code) = code else {
            return Ok(false);
        };
        let Ok(jump) = trampoline::patch(rip, stub, site.len) else {
            return Ok(false);
        };
        let code_pages: Vec<(u64, u64)> = [rip & !0xfff, (rip & !0xfff) + 0x1000]
            .into_iter()
            .filter_map(|p| tables.page_gpa(p).map(|gpa| (p, gpa)))
            .collect();
        match self.install(cr3, &code_pages, rip, stub, &code, None, jump) {
            Ok(mut patch) => {
                patch.since_ns = self.clock.now_ns();
                self.preempt.trap = Some(patch);
                Ok(true)
            }
            Err(_) => Ok(false),
        }
    }

    /// Puts a trampoline in place: its code (and data) in the mapping at
    /// `stub` of the address space `cr3`, the jump to it at `rip` in the
    /// code pages `code`; keeps every byte it changes, and the entries
    /// that map the trampoline's pages, whose accessed and dirty bits its
    /// run sets.
    #[allow(clippy::too_many_arguments)]
    fn install(
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
            if let Err(why) = write_saving(&self.mem, map, va, &bytes, &mut saved) {
                restore(&self.mem, &saved);
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

    fn restore(&self, saved: &[(u64, Vec<u8>)]) {
        restore(&self.mem, saved);
    }

    /// Replay, at a delivery point: if the log's next entry is an
    /// asynchronous point, puts the trampoline in place to find it.
    pub(super) fn arm_async_point(&mut self) -> Result<(), VmError> {
        if self.preempt.search.is_some() {
            return Ok(());
        }
        let Some(point) = self.journal.replay_async_point()? else {
            return Ok(());
        };
        let (cr3, rip) = (point.state.cr3, point.state.rip);
        let (code, before) = code_around(&self.mem, &point.code_pages, rip);
        let site = match site::choose(rip, &code, &before) {
            Ok(s) => s,
            Err(why) => {
                let why = format!("the recorded position cannot be patched: {why}");
                return Err(self.journal.async_point_missed(why).into());
            }
        };
        let words: &[(u64, u64)] = if self.preempt.registers_only {
            &[]
        } else {
            &point.state.words
        };
        let addrs: Vec<u64> = words.iter().map(|w| w.0).collect();
        let values: Vec<u64> = words.iter().map(|w| w.1).collect();
        let (stub, jump) = match build_stub(&site, point.stub, &addrs) {
            Ok(s) => s,
            Err(why) => {
                let why = format!("no trampoline for the recorded position: {why}");
                return Err(self.journal.async_point_missed(why).into());
            }
        };

        let data = trampoline::data_page(&point.state.kvm_regs(), &values);
        let code_pages = point.code_pages.clone();
        let patch = match self.install(cr3, &code_pages, rip, point.stub, &stub, Some(data), jump) {
            Ok(p) => p,
            Err(why) => return Err(self.journal.async_point_missed(why).into()),
        };
        self.preempt.search = Some(Search {
            point,
            patch,
            last_rejection: Vec::new(),
        });
        Ok(())
    }

    /// A store to the exit page (`addr`) at replay or while recording:
    /// whether it is a trampoline's, and what it found.
    pub(super) fn trampoline_exit(&mut self, addr: u64) -> Result<Candidate, VmError> {
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

    /// Recording: the task reached the trap; the point is taken here if
    /// the position allows it now.
    fn trap_reached(&mut self) -> Result<Candidate, VmError> {
        let Some(trap) = self.preempt.trap.take() else {
            return Ok(Candidate::NotOurs);
        };
        self.complete_trampoline_exit(&trap)?;
        let now = self.clock.now_ns();
        match self.examine(now)? {
            Position::Take(point) => {
                self.journal.record_async_point(*point)?;
                self.preempt.stats.points += 1;
                self.preempt.stats.advanced += 1;
                Ok(Candidate::Reached)
            }
            Position::Advance(_) | Position::Decline | Position::NotNow => {
                self.preempt.stats.declined += 1;
                self.preempt.retry_ns = now + RETRY_NS;
                Ok(Candidate::Passed)
            }
        }
    }

    /// Replay: the trampoline found the recorded registers (`regs`);
    /// whether the rest of the state is the recorded one.
    fn async_candidate(&mut self, regs: &kvm_bindings::kvm_regs) -> Result<Candidate, VmError> {
        self.preempt.stats.candidates += 1;
        let sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        let Some(search) = &self.preempt.search else {
            return Ok(Candidate::NotOurs);
        };
        let logged = &search.point.state;
        let mut found = UserState {
            cr3: sregs.cr3 & state::CR3_ROOT,
            rip: logged.rip,
            rflags: regs.rflags & !state::RF,
            gprs: state::gprs(regs),
            fs_base: sregs.fs.base,
            gs_base: sregs.gs.base,
            xstate: logged.xstate,
            words: logged.words.clone(),
            pages: PageSet::default(),
            memory: logged.memory,
        };
        if !self.preempt.registers_only {
            found.words = logged
                .words
                .iter()
                .map(|&(at, v)| (at, self.user_word(logged.cr3, at).unwrap_or(!v)))
                .collect();
            if logged.differences(&found).is_empty() {
                let xsave = self.vcpu.get_xsave().map_err(kvm_err("GET_XSAVE"))?;
                let cpu: Vec<u8> = xsave.region.iter().flat_map(|w| w.to_le_bytes()).collect();
                found.xstate = state::xstate_digest(&cpu, &self.xsave_layout);
                let entries =
                    trampoline_entries(&self.mem, logged.cr3, search.point.stub, &logged.words);
                found.memory =
                    state::memory_digest(&self.mem, &logged.pages, &search.patch.saved, &entries);
            }
        }
        let differences = logged.differences(&found);
        if !differences.is_empty() {
            self.preempt.stats.rejected += 1;
            if let Some(search) = &mut self.preempt.search {
                search.last_rejection = differences;
            }
            return Ok(Candidate::Passed);
        }
        let Some(search) = self.preempt.search.take() else {
            return Ok(Candidate::NotOurs);
        };
        self.complete_trampoline_exit(&search.patch)?;
        self.preempt.stats.points += 1;
        self.preempt.stats.busy_ns += search.patch.started.elapsed().as_nanos() as u64;
        self.journal.replay_async_point_reached()?;
        Ok(Candidate::Reached)
    }

    /// A trampoline's exit is where the task should stop: completes the
    /// store, puts the guest's bytes back and moves RIP to the patched
    /// position, where an interrupt may then be delivered.
    fn complete_trampoline_exit(&mut self, patch: &Patch) -> Result<(), VmError> {
        self.vcpu.set_kvm_immediate_exit(1);
        let completed = self.vcpu.run().map(|_| ());
        self.vcpu.set_kvm_immediate_exit(0);
        match completed {
            Err(e) if e.errno() == libc::EINTR => {}
            Err(e) => return Err(kvm_err("RUN (completing a trampoline's exit)")(e)),
            Ok(()) => {
                return Err(self
                    .journal
                    .async_point_missed("the vCPU ran on past the trampoline".into())
                    .into())
            }
        }
        self.restore(&patch.saved);
        let mut regs = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
        regs.rip = patch.rip;
        self.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))?;
        self.resume_rip = Some(regs.rip);
        Ok(())
    }

    /// Replay: a search that has gone on far longer than the recording
    /// took to get there will not succeed.
    pub(super) fn check_search_time(&mut self) -> Result<(), VmError> {
        let Some(search) = &self.preempt.search else {
            return Ok(());
        };
        if search.patch.started.elapsed() <= search.bound() {
            return Ok(());
        }
        let mut why = format!(
            "the recorded state was not reached within {:.1} s (the recording got there {:.3} s \
             after the exit; {} candidates rejected)",
            search.bound().as_secs_f64(),
            search.point.run_ns as f64 / 1e9,
            self.preempt.stats.rejected
        );
        if !search.last_rejection.is_empty() {
            why += &format!(
                "; the last one differed in {}",
                search.last_rejection.join(", ")
            );
        }
        Err(self.journal.async_point_missed(why).into())
    }

    /// The run stopped (the end, a divergence, a failure): the guest's
    /// bytes back.
    pub(super) fn end_patches(&mut self) {
        if let Some(search) = self.preempt.search.take() {
            self.restore(&search.patch.saved);
        }
        if let Some(trap) = self.preempt.trap.take() {
            self.restore(&trap.saved);
        }
    }
}

/// The trampoline for `site` with its code page at `stub`, comparing the
/// memory words at `words`; and the jump to it.
fn build_stub(site: &Site, stub: u64, words: &[u64]) -> Result<(Stub, Vec<u8>), StubError> {
    let code = trampoline::build(
        AsyncPoint::pages_at(stub),
        words,
        |ip| site.relocated(ip).map_err(StubError::Relocation),
        site.resume(),
    )?;
    let jump = trampoline::patch(site.rip, stub, site.len)?;
    Ok((code, jump))
}

/// `pages` without those that hold an aligned 8-byte word in `tsc` (the
/// host TSC values of this recording).
fn without_timestamps(
    mem: &vm_memory::GuestMemoryMmap,
    pages: &PageSet,
    tsc: &std::ops::RangeInclusive<u64>,
) -> PageSet {
    let mut page = [0u8; 4096];
    PageSet::from_frames(pages.frames().filter(|&frame| {
        mem.read_slice(&mut page, GuestAddress(frame << 12))
            .is_err()
            || !page
                .chunks_exact(8)
                .any(|w| tsc.contains(&u64::from_le_bytes(w.try_into().unwrap_or([0; 8]))))
    }))
}

/// The page-table entries on the way to the trampoline's pages of the
/// mapping at `stub` and to the memory `words` it reads (see
/// `state::memory_digest`).
fn trampoline_entries(
    mem: &vm_memory::GuestMemoryMmap,
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
fn write_saving(
    mem: &vm_memory::GuestMemoryMmap,
    map: &dyn CodeMap,
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
fn restore(mem: &vm_memory::GuestMemoryMmap, saved: &[(u64, Vec<u8>)]) {
    for (gpa, bytes) in saved.iter().rev() {
        let _ = mem.write_slice(bytes, GuestAddress(*gpa));
    }
}

/// Reads `buf.len()` bytes at `va` through `map`; false where a page is
/// not there.
fn read_code(mem: &vm_memory::GuestMemoryMmap, map: &dyn CodeMap, va: u64, buf: &mut [u8]) -> bool {
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
/// and the LOOP_WINDOW bytes before it (fewer at the start of a mapping),
/// from the pages `map` finds (read without touching the page tables'
/// accessed bits).
fn code_around(
    mem: &vm_memory::GuestMemoryMmap,
    map: &dyn CodeMap,
    rip: u64,
) -> (Vec<u8>, Vec<u8>) {
    let mut code = Vec::with_capacity(CODE_WINDOW);
    let mut at = rip;
    while code.len() < CODE_WINDOW {
        let room = (0x1000 - (at & 0xfff)) as usize;
        let mut part = vec![0u8; room.min(CODE_WINDOW - code.len())];
        if !read_code(mem, map, at, &mut part) {
            break;
        }
        at += part.len() as u64;
        code.extend(part);
    }
    let mut before = vec![0u8; LOOP_WINDOW as usize];
    let start = rip.wrapping_sub(LOOP_WINDOW);
    if start > rip || !read_code(mem, map, start, &mut before) {
        before = vec![0u8; (rip & 0xfff) as usize];
        if !read_code(mem, map, rip & !0xfff, &mut before) {
            before.clear();
        }
    }
    (code, before)
}
