//! Recording asynchronous points: at a kick, the state where user code
//! stands, or a trap that stops the task where replay can find it.

use std::time::Instant;

use vm_memory::{Bytes, GuestAddress};

use super::{Candidate, Preemption, PREEMPT_AFTER_NS, RETRY_NS, TRAP_NS, WINDOW_MAX_NS, WINDOW_NS};
use crate::vm::{kvm_err, Vm, VmError};
use introspect::stub_area::GuestArea;
use journal::preempt::guest_code::{trampoline_entries, PageTables};
use journal::preempt::state::{self, PageSet, UserState};
use journal::preempt::trampoline::{self, StubError};
use journal::preempt::{AsyncPoint, CodeMap};
use journal::Journal;

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

impl Vm {
    /// Recording: when the vCPU should be kicked to look for an
    /// asynchronous point (u64::MAX: not before something else happens).
    pub(in crate::vm) fn preempt_deadline(&self) -> u64 {
        let (point, window) = self.point_and_window_due();
        point.min(window)
    }

    /// Recording: when a point is due, and when its dirty window should
    /// start (u64::MAX: not before something else happens).
    fn point_and_window_due(&self) -> (u64, u64) {
        if !matches!(self.journal, Journal::Record(_)) {
            return (u64::MAX, u64::MAX);
        }
        let interrupt = if self.platform.pic.has_pending() {
            Some(0)
        } else {
            self.platform.next_timer_ns()
        };
        let point = self.preempt.point_due(interrupt);
        (point, self.preempt.window_due(point))
    }

    /// Recording, at a kick: if an interrupt has waited a tick for an exit
    /// and the vCPU stands in user code at a position replay can find
    /// again, logs the state there and returns true; the interrupt is then
    /// injected as at an exit.
    pub(in crate::vm) fn try_async_point(&mut self) -> Result<bool, VmError> {
        let now = self.clock.now_ns();
        self.platform.advance_to(now);
        let (point, window) = self.point_and_window_due();
        if window <= now {
            self.restart_dirty_log(now)?;
            if point <= now + WINDOW_NS {
                // A point taken now would list no page written: it waits
                // for the window (a kick noticed late, a retry).
                self.preempt.retry_ns = self.preempt.retry_ns.max(now + WINDOW_NS);
                return Ok(false);
            }
        }
        if point > now || !self.platform.pic.has_pending() {
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
        let pages = without_timestamps(&self.mem, &user_pages(&self.mem, cr3, &written), &tsc);
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
            run_ns: now.saturating_sub(self.preempt.last_exit_ns.unwrap_or(now)),
        })))
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

    /// Recording: the task reached the trap; the point is taken here if
    /// the position allows it now.
    pub(in crate::vm) fn trap_reached(&mut self) -> Result<Candidate, VmError> {
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
}

impl Preemption {
    /// Recording: the VM time at which to look for an asynchronous point,
    /// given when an interrupt is or will be pending (`interrupt`);
    /// u64::MAX for never before something else happens. A tick after the
    /// last deterministic exit, and never before the run's first: a point
    /// must follow an exit, where replay puts its trampoline in place (a
    /// restored guest's first kick may come before its first exit).
    fn point_due(&self, interrupt: Option<u64>) -> u64 {
        if self.area_gpa.is_none() || self.exits_only {
            return u64::MAX;
        }
        if let Some(trap) = &self.trap {
            return trap.since_ns + TRAP_NS;
        }
        let Some(last_exit_ns) = self.last_exit_ns else {
            return u64::MAX;
        };
        (last_exit_ns + PREEMPT_AFTER_NS)
            .max(self.retry_ns)
            .max(interrupt.unwrap_or(u64::MAX))
    }

    /// When the dirty log should start afresh for a point due at `point`:
    /// `WINDOW_NS` before it, unless the window it has then is at most
    /// `WINDOW_MAX_NS` old (or a trap is set: it was set at a point due).
    fn window_due(&self, point: u64) -> u64 {
        if !self.dirty_logging
            || point == u64::MAX
            || self.trap.is_some()
            || point.saturating_sub(self.last_reset_ns) <= WINDOW_MAX_NS
        {
            return u64::MAX;
        }
        point.saturating_sub(WINDOW_NS)
    }
}

/// Of `pages`, those the address space `cr3` maps for user mode: the
/// memory the program can see. The guest kernel's pages are left out: a
/// point tells loop iterations apart by what the program sees (registers
/// and its memory), and the kernel's state is checked at every
/// deterministic exit. With the kernel's pages in the digest, one replay
/// of a UDP recording, in a loaded run of the whole suite, missed a point
/// (every later replay of that trace too) whose 35 written pages were all
/// but one the kernel's (stacks, per-CPU data, timers, sockets); which
/// page differed, a digest cannot say.
fn user_pages(mem: &vm_memory::GuestMemoryMmap, cr3: u64, pages: &PageSet) -> PageSet {
    let runs = introspect::gva::user_frames(mem, cr3);
    PageSet::from_frames(
        pages
            .frames()
            .filter(|&f| introspect::gva::in_runs(&runs, f)),
    )
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

#[cfg(test)]
mod tests {
    use super::super::Patch;
    use super::*;

    #[test]
    fn points_are_due_a_tick_after_an_exit_and_never_before_the_first() {
        let mut p = Preemption {
            area_gpa: Some(0x1000),
            ..Default::default()
        };
        // A restored guest 10 s into its boot, before its first exit.
        assert_eq!(p.point_due(Some(0)), u64::MAX);
        p.last_exit_ns = Some(10_000_000_000);
        assert_eq!(p.point_due(Some(0)), 10_000_000_000 + PREEMPT_AFTER_NS);
        assert_eq!(p.point_due(Some(20_000_000_000)), 20_000_000_000);
        assert_eq!(p.point_due(None), u64::MAX);
        p.retry_ns = 10_050_000_000;
        assert_eq!(p.point_due(Some(0)), 10_050_000_000);
        p.exits_only = true;
        assert_eq!(p.point_due(Some(0)), u64::MAX);
    }

    #[test]
    fn the_dirty_window_starts_afresh_only_before_a_point_that_would_find_it_old() {
        let mut p = Preemption {
            area_gpa: Some(0x1000),
            ..Default::default()
        };
        let point = 10_000_000_000;
        // Not recording (no dirty log), or no point coming.
        assert_eq!(p.window_due(point), u64::MAX);
        p.dirty_logging = true;
        assert_eq!(p.window_due(u64::MAX), u64::MAX);
        // The window started at the recording's start: afresh a
        // millisecond before the point.
        assert_eq!(p.window_due(point), point - WINDOW_NS);
        // Started that millisecond before, or less than WINDOW_MAX_NS
        // before: kept (a point retried soon after its window restarted
        // does not restart it again).
        p.last_reset_ns = point - WINDOW_NS;
        assert_eq!(p.window_due(point), u64::MAX);
        p.last_reset_ns = point - 100_000;
        assert_eq!(p.window_due(point), u64::MAX);
        p.last_reset_ns = point - WINDOW_MAX_NS;
        assert_eq!(p.window_due(point), u64::MAX);
        p.last_reset_ns = point - WINDOW_MAX_NS - 1;
        assert_eq!(p.window_due(point), point - WINDOW_NS);
        // A trap set at a point due keeps the window it had.
        p.trap = Some(Patch {
            rip: 0x40_1000,
            since_ns: point,
            stub: 0,
            exit_rips: [0; 2],
            saved: Vec::new(),
            started: Instant::now(),
        });
        assert_eq!(p.window_due(point), u64::MAX);
    }
}
