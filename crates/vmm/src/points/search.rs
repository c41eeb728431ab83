//! Replaying asynchronous points: the trampoline in place after the exit
//! before one, its candidates checked, the interrupt delivered there.

use std::time::Duration;

use vm_memory::GuestMemoryMmap;

use super::{Patch, PointStats};
use crate::vm::{kvm_err, Machine, VmError};
use introspect::stub_area::EXIT_PAGE_GPA;
use journal::preempt::guest_code::{build_stub, code_around, code_before, trampoline_entries};
use journal::preempt::site::{self, Site};
use journal::preempt::state::{self, PageSet, UserState};
use journal::preempt::{trampoline, AsyncPoint};
use journal::Replayer;

/// What a probe gate exit, or a single step of a traced process, may add
/// to a search's time: a user-mode exit costs 30-45 us on these hosts,
/// and the event's capture (or the step's logging) a few more.
const GATE_EXIT_ALLOWANCE: Duration = Duration::from_micros(200);

/// How many times a search's bound (of the vCPU's time) it may take by the
/// host's clock: a vCPU that halted makes no progress and has no CPU time.
const WALL_PATIENCE: u32 = 20;

/// How many times a point search's bound a mark's search may take.
const MARK_PATIENCE: u32 = 10;

/// A point replay is looking for.
struct Search {
    point: AsyncPoint,
    patch: Patch,
    /// Passes over the position with the recorded registers (and words).
    candidates: u64,
    /// Those whose extended state or memory differed.
    rejected: u64,
    /// How the last rejected candidate differed, for the report.
    last_rejection: Vec<String>,
    /// The instructions the trampoline moved into its code page: (address
    /// there, original address, original bytes), for a traced process.
    moved: Vec<(u64, u64, Vec<u8>)>,
    /// Probe gate exits and traced steps since the search began: replay's
    /// alone, each a round trip the recording did not make.
    gate_exits: u64,
    /// Where the patch goes: the instructions it covers.
    site: Site,
    /// The code at `patch.rip` as it was before the patch.
    code: Vec<u8>,
    /// A sample mark's position (found by its registers alone), not an
    /// asynchronous point.
    mark: bool,
    /// The CPU time of the vCPU's thread when the search began (on that
    /// thread), if the host tells.
    cpu_at_start: Option<Duration>,
}

/// How much slower than the recording replay may run the code before a
/// point: every pass over the patched position goes through the
/// trampoline. A spin loop of a few instructions ran 0.36 ns a pass
/// natively and 2.6 ns through the trampoline (7.2 times slower: a
/// recording of `spin_flag` whose waiter spun 551 ms before its point,
/// 1.5 billion passes, timed out at three times the recorded time).
const SEARCH_SLOWDOWN: u64 = 10;

impl Search {
    /// How long the search may take: the recording got there in
    /// `run_ns`; replay is slower by the trampoline's passes at most
    /// `SEARCH_SLOWDOWN` times, so longer than that (and two seconds for a
    /// loaded host) means the state will never come.
    fn bound(&self) -> Duration {
        let bound = Duration::from_nanos(self.point.run_ns.saturating_mul(SEARCH_SLOWDOWN))
            + Duration::from_secs(2)
            + GATE_EXIT_ALLOWANCE.saturating_mul(self.gate_exits.min(u32::MAX as u64) as u32);
        // A mark's search never stops the replay: it is given up only
        // when it cannot be a loaded host's delay (giving up changes the
        // samples), the next exit passes it by otherwise.
        if self.mark {
            bound.saturating_mul(MARK_PATIENCE)
        } else {
            bound
        }
    }

    /// The CPU time the vCPU's thread has had since the search began (on
    /// that thread): the time a loaded host left it waiting for a CPU is
    /// not counted. The host's time where the host does not tell.
    fn vcpu_time(&self) -> Duration {
        match (self.cpu_at_start, crate::sys::thread_cpu_time()) {
            (Some(then), Some(now)) => now.saturating_sub(then),
            _ => self.patch.started.elapsed(),
        }
    }

    /// What the search has seen, for a report that it failed (`mem`: the
    /// guest's memory, for the code before the position).
    fn progress(&self, mem: &GuestMemoryMmap) -> String {
        let mut text = format!(
            "the trampoline for the asynchronous point at {:#x} saw the recorded registers {} \
             time{} and rejected {}",
            self.point.state.rip,
            self.candidates,
            if self.candidates == 1 { "" } else { "s" },
            self.rejected
        );
        if !self.last_rejection.is_empty() {
            text += &format!(" (the last differed in {})", self.last_rejection.join(", "));
        }
        // A direct branch nearby enters the patch in its middle: a
        // position recorded by an insight whose recorder did not look as
        // far, which the search may never find.
        let rip = self.point.state.rip;
        let before = code_before(mem, &self.point.code_pages, rip, site::ENTRY_WINDOW);
        if self.site.entered_inside(&self.code, &before) {
            text += &format!(
                "; the program's code jumps into the middle of the bytes the trampoline's jump \
                 covers at {:#x} (from within {} bytes before it or {} after): the recording \
                 was made by an insight whose recorder did not check that far, and the \
                 program may have run the middle of the jump",
                rip,
                site::ENTRY_WINDOW,
                site::CODE_WINDOW
            );
        }
        text
    }
}

/// What a store to the exit page was.
pub(crate) enum Found {
    NotOurs,
    /// A pass the search goes on after.
    Passed,
    /// The asynchronous point: the vCPU stands at a delivery point.
    Point,
    /// The sample mark's position: the vCPU stands there.
    Mark,
}

/// Finding the recorded asynchronous points again at replay.
#[derive(Default)]
pub(crate) struct PointSearch {
    /// The point being searched for.
    search: Option<Search>,
    /// Accept a candidate on its registers alone (shows what the memory
    /// checks are for; never what a user wants).
    registers_only: bool,
    pub(crate) stats: PointStats,
}

impl PointSearch {
    /// Accepts trampoline candidates on their registers alone, as a
    /// replay that did not check memory would (a demonstration that the
    /// checks matter, never what a user wants).
    pub(crate) fn registers_only() -> Self {
        PointSearch {
            registers_only: true,
            ..Default::default()
        }
    }

    /// Goes on with the counts of a restored checkpoint.
    pub(crate) fn resume(&mut self, stats: PointStats) {
        self.stats = stats;
    }

    /// Whether a trampoline is in place.
    pub(crate) fn patched(&self) -> bool {
        self.search.is_some()
    }

    /// Whether a store to `addr` may be the trampoline's.
    pub(crate) fn claims(&self, addr: u64) -> bool {
        addr == EXIT_PAGE_GPA && self.search.is_some()
    }

    /// A probe gate exit (a search under way allows for it).
    pub(crate) fn gate_exit(&mut self) {
        self.stats.gate_exits += 1;
        if let Some(search) = &mut self.search {
            search.gate_exits += 1;
        }
    }

    /// `steps` single steps of a traced process (a search under way
    /// allows for each, as for a gate exit).
    pub(crate) fn traced_steps(&mut self, steps: u64) {
        if let Some(search) = &mut self.search {
            search.gate_exits += steps;
        }
    }

    /// Stepping a traced process in the address space `cr3`: where the
    /// search under way put its trampoline's jump, if there.
    pub(crate) fn patch_at(&self, cr3: u64) -> Option<u64> {
        let search = self.search.as_ref()?;
        (search.point.state.cr3 == cr3 & state::CR3_ROOT).then_some(search.patch.rip)
    }

    /// Stepping a traced process: the instruction the trampoline moved to
    /// `rip` in its code page, as (original address, bytes).
    pub(crate) fn moved_instruction(&self, cr3: u64, rip: u64) -> Option<(u64, Vec<u8>)> {
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

    /// What the search for a point under way has seen.
    pub(crate) fn progress(&self, m: &Machine) -> Option<String> {
        self.search.as_ref().map(|s| s.progress(&m.vm.mem))
    }

    /// Where a SAMPLE taken now should say the guest is: inside the
    /// trampoline is at the patched position.
    pub(crate) fn sample_rip(&self, rip: u64) -> u64 {
        match &self.search {
            Some(s) if (s.patch.stub..s.patch.stub + 0x1000).contains(&rip) => s.patch.rip,
            _ => rip,
        }
    }

    /// Where the program stands, for a thread of address space `cr3` whose
    /// RIP is `rip`: in the trampoline, at the original address of the
    /// instruction moved there, or at the patched position for the
    /// trampoline's own code (it runs before the instruction there).
    pub(crate) fn program_rip(&self, cr3: u64, rip: u64) -> u64 {
        match &self.search {
            Some(s) if s.point.state.cr3 == cr3 & state::CR3_ROOT => s
                .moved
                .iter()
                .find(|m| m.0 == rip)
                .map_or_else(|| self.sample_rip(rip), |m| m.1),
            _ => rip,
        }
    }

    /// The code the search under way covers with its patch: (address
    /// space, first byte, end); none of it runs where it is meanwhile.
    pub(crate) fn patched_code(&self) -> Option<(u64, u64, u64)> {
        let s = self.search.as_ref()?;
        Some((
            s.point.state.cr3,
            s.patch.rip,
            s.patch.rip + s.site.len as u64,
        ))
    }

    /// The guest bytes the search's patch replaced, by guest physical
    /// address: what a reader of the program's code must see instead.
    pub(crate) fn replaced(&self) -> &[(u64, Vec<u8>)] {
        self.search.as_ref().map_or(&[], |s| &s.patch.saved)
    }

    /// Forgets the search under way without touching guest memory (the
    /// machine is being put back to a moment before it began).
    pub(crate) fn forget(&mut self) {
        self.search = None;
    }

    /// The run stopped (the end, a divergence, a failure): the guest's
    /// bytes back.
    pub(crate) fn end(&mut self, m: &Machine) {
        if let Some(search) = self.search.take() {
            m.restore(&search.patch.saved);
        }
    }

    /// At a delivery point (or where a mark's search ended: `at_mark`):
    /// the trampoline in place to find asynchronous point `point`, the
    /// log's next entry.
    pub(crate) fn arm_point(
        &mut self,
        m: &mut Machine,
        log: &mut Replayer,
        point: AsyncPoint,
        at_mark: bool,
    ) -> Result<(), VmError> {
        let words = if self.registers_only {
            Vec::new()
        } else {
            point.state.words.clone()
        };
        match self.install(m, point, &words, false, at_mark) {
            Ok(()) => Ok(()),
            Err(why) => Err(log.async_point_missed(why).into()),
        }
    }

    /// The trampoline in place to find a sample mark's position `at`
    /// (by its registers alone); false if it cannot be put there now (the
    /// mark is passed by): the position cannot be patched, or the task
    /// would go on inside the bytes the patch covers.
    pub(crate) fn arm_mark(
        &mut self,
        m: &mut Machine,
        at: AsyncPoint,
        at_mark: bool,
    ) -> Result<bool, VmError> {
        Ok(self.install(m, at, &[], true, at_mark).is_ok())
    }

    /// Puts the trampoline for `point` in place, comparing `words` too.
    /// `at_mark`: the task stands where a mark's search left it (in user
    /// code, nothing injected), not at a delivery point.
    fn install(
        &mut self,
        m: &mut Machine,
        point: AsyncPoint,
        words: &[(u64, u64)],
        mark: bool,
        at_mark: bool,
    ) -> Result<(), String> {
        if self.search.is_some() {
            return Err("a search is under way".into());
        }
        let (cr3, rip) = (point.state.cr3, point.state.rip);
        let (code, before) = code_around(&m.vm.mem, &point.code_pages, rip);
        let site = site::choose(rip, &code, &before)
            .map_err(|why| format!("the recorded position cannot be patched: {why}"))?;
        let addrs: Vec<u64> = words.iter().map(|w| w.0).collect();
        let values: Vec<u64> = words.iter().map(|w| w.1).collect();
        let (stub, jump) = build_stub(&site, point.stub, &addrs)
            .map_err(|why| format!("no trampoline for the recorded position: {why}"))?;

        let displaced = AsyncPoint::pages_at(point.stub).code + stub.displaced_at;
        let moved: Vec<(u64, u64, Vec<u8>)> = site
            .relocated_layout(displaced)
            .unwrap_or_default()
            .into_iter()
            .map(|(at, ip, len)| {
                let from = (ip - rip) as usize;
                (
                    at,
                    ip,
                    code.get(from..from + len).unwrap_or_default().to_vec(),
                )
            })
            .collect();
        // The task must not go on inside the bytes the jump covers. The
        // recorder chose positions so that it never does, but for one: a
        // mark's position just after the mark before it in the same loop.
        // The task stands there in user code, on its way from that mark,
        // and goes on from the trampoline's copy of its instruction.
        let mut redirect = None;
        let sregs = m.vcpu.sregs().map_err(|e| e.to_string())?;
        let inside = |at: u64| at > rip && at < site.resume();
        if sregs.cs.selector & 3 == 3 && sregs.cr3 & state::CR3_ROOT == cr3 {
            let mut regs = m.vcpu.regs().map_err(|e| e.to_string())?;
            if inside(regs.rip) {
                let copy = moved
                    .iter()
                    .find(|c: &&(u64, u64, Vec<u8>)| c.1 == regs.rip);
                match copy {
                    Some(&(at, _, _)) if at_mark => {
                        regs.rip = at;
                        redirect = Some(regs);
                    }
                    _ => {
                        return Err(format!(
                            "the task stands at {:#x}, inside the bytes the trampoline's jump \
                             at {rip:#x} covers",
                            regs.rip
                        ))
                    }
                }
            }
        }
        let data = trampoline::data_page(&point.state.kvm_regs(), &values);
        let code_pages = point.code_pages.clone();
        let patch = m.install(cr3, &code_pages, rip, point.stub, &stub, Some(data), jump)?;
        if let Some(regs) = redirect {
            if let Err(e) = m.vcpu.set_regs(&regs) {
                m.restore(&patch.saved);
                return Err(e.to_string());
            }
        }
        self.search = Some(Search {
            point,
            patch,
            candidates: 0,
            rejected: 0,
            last_rejection: Vec::new(),
            moved,
            gate_exits: 0,
            site,
            code,
            mark,
            cpu_at_start: crate::sys::thread_cpu_time(),
        });
        Ok(())
    }

    /// Whether the search under way is a sample mark's.
    pub(crate) fn seeking_mark(&self) -> bool {
        self.search.as_ref().is_some_and(|s| s.mark)
    }

    /// Gives up the search for a sample mark (it ran out of time): the
    /// guest's bytes back. False if the vCPU stands in the trampoline's
    /// code page, which the guest's bytes would replace under it (the
    /// search goes on).
    pub(crate) fn give_up_mark(&mut self, m: &Machine) -> Result<bool, VmError> {
        let Some(search) = self.search.as_ref().filter(|s| s.mark) else {
            return Ok(false);
        };
        let rip = m.vcpu.regs()?.rip;
        if (search.patch.stub..search.patch.stub + 0x1000).contains(&rip) {
            return Ok(false);
        }
        self.abandon_mark(m);
        Ok(true)
    }

    /// A deterministic exit came before the sample mark's position (the
    /// log passed the mark by): the search ends, the guest's bytes back.
    /// (A faithful replay reaches a mark's position before the exit after
    /// it, as it does a point's; the trampoline's code runs no exit.)
    pub(crate) fn abandon_mark(&mut self, m: &Machine) {
        if self.seeking_mark() {
            if let Some(search) = self.search.take() {
                m.restore(&search.patch.saved);
            }
        }
    }

    /// A store to the exit page: the trampoline's, or not. `ignored_flags`
    /// are RFLAGS bits the replay's tools may have set (the trap flag of
    /// a traced process, or of a thread the debugger steps), compared as
    /// the recording had them; `written` the bytes they wrote over
    /// in guest memory (a debugger's breakpoints), by guest physical
    /// address, as the guest had them.
    pub(crate) fn store(
        &mut self,
        m: &mut Machine,
        log: &mut Replayer,
        ignored_flags: u64,
        written: &[(u64, Vec<u8>)],
    ) -> Result<Found, VmError> {
        let regs = m.vcpu.regs()?;
        match &self.search {
            Some(search) if search.patch.exit_rips.contains(&regs.rip) => {
                self.candidate(m, log, &regs, ignored_flags, written)
            }
            _ => Ok(Found::NotOurs),
        }
    }

    /// The trampoline found the recorded registers (`regs`); whether the
    /// rest of the state is the recorded one.
    fn candidate(
        &mut self,
        m: &mut Machine,
        log: &mut Replayer,
        regs: &kvm_bindings::kvm_regs,
        ignored_flags: u64,
        written: &[(u64, Vec<u8>)],
    ) -> Result<Found, VmError> {
        let sregs = m.vcpu.sregs()?;
        let Some(search) = &self.search else {
            return Ok(Found::NotOurs);
        };
        let mark = search.mark;
        if !mark {
            self.stats.candidates += 1;
        }
        let logged = &search.point.state;
        let mut found = UserState {
            cr3: sregs.cr3 & state::CR3_ROOT,
            rip: logged.rip,
            // The flags the replay's tools set count as the recording
            // had them.
            rflags: (regs.rflags & !state::RF & !ignored_flags) | (logged.rflags & ignored_flags),
            gprs: state::gprs(regs),
            fs_base: sregs.fs.base,
            gs_base: sregs.gs.base,
            xstate: logged.xstate,
            words: logged.words.clone(),
            pages: PageSet::default(),
            memory: logged.memory,
        };
        if !self.registers_only && !mark {
            found.words = logged
                .words
                .iter()
                .map(|&(at, v)| (at, m.user_word(logged.cr3, at).unwrap_or(!v)))
                .collect();
            if logged.differences(&found).is_empty() {
                let mem = &m.vm.mem;
                let xsave = m.vcpu.fd.get_xsave().map_err(kvm_err("GET_XSAVE"))?;
                let cpu: Vec<u8> = xsave.region.iter().flat_map(|w| w.to_le_bytes()).collect();
                found.xstate = state::xstate_digest(&cpu, &m.vm.cpu.xsave_layout);
                let entries = trampoline_entries(mem, logged.cr3, search.point.stub, &logged.words);
                let mut saved = search.patch.saved.clone();
                saved.extend_from_slice(written);
                found.memory = state::memory_digest(mem, &logged.pages, &saved, &entries);
            }
        }
        let differences = logged.differences(&found);
        if let Some(search) = &mut self.search {
            search.candidates += 1;
        }
        if !differences.is_empty() {
            if !mark {
                self.stats.rejected += 1;
            }
            if let Some(search) = &mut self.search {
                search.rejected += 1;
                search.last_rejection = differences;
            }
            return Ok(Found::Passed);
        }
        let Some(search) = self.search.take() else {
            return Ok(Found::NotOurs);
        };
        if !m.complete_trampoline_exit(&search.patch)? {
            return Err(log
                .async_point_missed("the vCPU ran on past the trampoline".into())
                .into());
        }
        if mark {
            return Ok(Found::Mark);
        }
        self.stats.points += 1;
        self.stats.busy_ns += search.patch.started.elapsed().as_nanos() as u64;
        log.async_point_reached()?;
        Ok(Found::Point)
    }

    /// A search that has gone on far longer than the recording took to get
    /// there will not succeed: a point's is a divergence; a mark's is given
    /// up (true: the next entry may be sought).
    pub(crate) fn check_time(&mut self, m: &Machine, log: &mut Replayer) -> Result<bool, VmError> {
        let Some(search) = &self.search else {
            return Ok(false);
        };
        // The vCPU's time, not the host's: on a loaded host the vCPU's
        // thread may wait seconds for a CPU. The host's time bounds it
        // too, far above, for a vCPU that stopped running (halted).
        let (cpu, wall) = (search.vcpu_time(), search.patch.started.elapsed());
        if cpu <= search.bound() && wall <= search.bound().saturating_mul(WALL_PATIENCE) {
            return Ok(false);
        }
        if search.mark {
            return self.give_up_mark(m);
        }
        let why = format!(
            "the recorded state was not reached within {:.1} s of the vCPU's time ({:.1} s of the \
             host's; the recording got there {:.3} s after the exit); {}",
            cpu.as_secs_f64(),
            wall.as_secs_f64(),
            search.point.run_ns as f64 / 1e9,
            search.progress(&m.vm.mem)
        );
        Err(log.async_point_missed(why).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    /// Where the searched position's code page is, virtual and physical.
    const PAGE_VA: u64 = 0x7f00_0000_1000;
    const PAGE_GPA: u64 = 0x3000;

    /// A search for the position after `before` in a page of guest
    /// memory `mem` that holds `before` and then `code`.
    fn search(mem: &GuestMemoryMmap, before: &[u8], code: &[u8]) -> Search {
        let mut page = before.to_vec();
        page.extend_from_slice(code);
        mem.write_slice(&page, GuestAddress(PAGE_GPA)).unwrap();
        let rip = PAGE_VA + before.len() as u64;
        let regs = kvm_bindings::kvm_regs {
            rip,
            ..Default::default()
        };
        Search {
            point: AsyncPoint {
                state: UserState::of_registers(0x1000, &regs, 0, 0),
                stub: 0x7f00_0010_0000,
                code_pages: vec![(PAGE_VA, PAGE_GPA)],
                run_ns: 1_000_000,
            },
            patch: Patch {
                rip,
                since_ns: 0,
                stub: 0x7f00_0010_0000,
                exit_rips: [0; 2],
                saved: Vec::new(),
                started: std::time::Instant::now(),
            },
            candidates: 2,
            rejected: 2,
            last_rejection: vec!["memory (3 written pages)".into()],
            moved: Vec::new(),
            gate_exits: 0,
            site: site::choose(rip, code, &[]).unwrap(),
            code: code.to_vec(),
            mark: false,
            cpu_at_start: None,
        }
    }

    #[test]
    fn a_failed_search_says_when_the_code_enters_its_patch_in_the_middle() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        // glibc's layout: mempcpy jumps to memmove's second instruction
        // from 80 bytes before memmove, farther than the loop window.
        let mut before = vec![
            0x48, 0x89, 0xf8, // mempcpy: mov rax,rdi
            0x48, 0x01, 0xd0, // add rax,rdx
            0xeb, 0x4b, // jmp memmove+3
        ];
        before.resize(0x50, 0x90);
        let code = [
            0x48, 0x89, 0xf8, // memmove: mov rax,rdi
            0x48, 0x83, 0xfa, 0x20, // cmp rdx,0x20
            0x72, 0x10, // jb
            0xc3, // ret
        ];
        let entered = search(&mem, &before, &code).progress(&mem);
        let plain = "the trampoline for the asynchronous point at 0x7f0000001050 saw the \
                     recorded registers 2 times and rejected 2 (the last differed in memory (3 \
                     written pages))";
        assert!(entered.starts_with(plain), "{entered}");
        assert!(
            entered.contains(
                "jumps into the middle of the bytes the trampoline's jump covers at \
                 0x7f0000001050 (from within 256 bytes before it"
            ),
            "{entered}"
        );
        // Aimed at memmove itself, the jump enters nothing.
        before[7] = 0x48;
        assert_eq!(search(&mem, &before, &code).progress(&mem), plain);
    }
}
