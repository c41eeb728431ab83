//! Recording asynchronous points: at a kick, the state where user code
//! stands, or a trap that stops the task where replay can find it.

use std::time::Instant;

use vm_memory::{Bytes, GuestAddress};

use super::sites::Sites;
use super::{user_position, Patch, PointStats, SampleStats};
use crate::vm::{kvm_err, Machine, VmError};
use crate::vm::{Claimed, Resumed};
use events::abi::SampleMode;
use introspect::probe_gate;
use introspect::stub_area::EXIT_PAGE_GPA;
use journal::preempt::guest_code::{trampoline_entries, PageTables};
use journal::preempt::state::{self, PageSet, UserState};
use journal::preempt::trampoline::{self, StubError};
use journal::preempt::{AsyncPoint, CodePages, MarkAt, SampleMark};
use journal::Recorder;

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
/// How soon to look again after the sampling clock's kick found a
/// position replay could not find again (a sample taken later is one
/// taken elsewhere: the sooner, the less it leans to the code after such
/// positions).
const SAMPLE_RETRY_NS: u64 = 50_000;
/// A window older than this when its point is due starts afresh. Only
/// points need a window, so it starts afresh only before one: GNU sort
/// records in 1.2 times its run's time.
const WINDOW_MAX_NS: u64 = 50_000_000;
/// RFLAGS.TF: the guest kernel single-steps the task (chaos, guest kernel
/// patch 0031). No point or mark is taken there: replay would step
/// through its patch and trampoline, where the recording stepped the
/// program's own instructions, and the guest would count other steps.
/// The guest kernel exits at the end of each run of steps, so that no
/// point is taken after a step before the next exit either.
const TRAP_FLAG: u64 = 1 << 8;

/// Taking asynchronous points while recording: at a kick, the state where
/// user code stands, or a trap that stops the task where replay can find
/// it; and KVM's dirty log, whose window of written pages a point lists.
#[derive(Default)]
pub(crate) struct PointTaker {
    /// VM time of the last deterministic exit; `None` before the run's
    /// first (a restored guest's log starts at its first exit, and a
    /// point before it would follow no exit: replay could not look for
    /// it).
    last_exit_ns: Option<u64>,
    /// VM time the dirty log last started afresh (the window of pages a
    /// point lists).
    last_reset_ns: u64,
    /// No new attempt before this VM time.
    retry_ns: u64,
    /// KVM logs the pages the guest writes.
    dirty_logging: bool,
    /// A trap that stops the task at a better position.
    trap: Option<Patch>,
    /// The trap is a sample mark's, not a point's.
    trap_for_mark: bool,
    /// When an interrupt is delivered where user code stands.
    delivery: Delivery,
    /// The host TSC when the recording started.
    tsc_start: u64,
    /// The dirty bitmaps read since the log last started afresh, merged
    /// (a read resets KVM's log; a point declined after one must not lose
    /// the pages it saw).
    window_pages: Vec<u64>,
    /// The recording's sampling clock.
    marks: MarkClock,
    /// The guest kernel variable holding the top of the current task's
    /// kernel stack.
    kernel_stack_top: Option<u64>,
    /// The last sample mark in user code since the last exit or point,
    /// (address space, RIP): where a replay that takes the marks stands
    /// when it puts the next trampoline in place (else the task is in
    /// the kernel then, and resumes user mode at the area's `resume_ip`).
    last_mark: Option<(u64, u64)>,
    /// Where trampolines can go, as judged at the last kicks.
    sites: Sites,
    pub(crate) stats: PointStats,
    pub(crate) sample_stats: SampleStats,
}

/// When a pending interrupt is delivered where user code stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Delivery {
    /// Once the code has run `PREEMPT_AFTER_NS` without an exit.
    #[default]
    AfterATick,
    /// Never: at deterministic exits only (a host where user code cannot
    /// be found again where it stands).
    ExitsOnly,
}

/// The recording's sampling clock: a sample mark about every `period_ns`
/// of VM time (0: none).
#[derive(Default)]
struct MarkClock {
    period_ns: u64,
    /// VM time the next sample is due, and no attempt before the second.
    due_ns: (u64, u64),
    /// The pseudo-random state (`next_interval`).
    jitter: u64,
}

impl MarkClock {
    /// The time to the next sample: the period on average, drawn evenly
    /// from half to one and a half periods. The guest's own periodic work
    /// (its timer tick) would otherwise meet the samples at the same
    /// phase for long stretches: a run of the 1-ms samples lands in the
    /// 10-ms tick's handler two times in ten, another three.
    fn next_interval(&mut self) -> u64 {
        // xorshift64: the marks are logged, so no replay needs the seed.
        let mut x = self.jitter | 1;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.jitter = x;
        let period = self.period_ns;
        period / 2 + x % period.max(1)
    }
}

/// What the recorder makes of the position a sampling kick found.
enum MarkVerdict {
    Take(MarkAt),
    /// Wait until the task gets back to this position.
    Advance(u64),
    Decline,
}

/// What the recorder makes of the position a kick found.
enum PointVerdict {
    Take(Box<AsyncPoint>),
    /// Wait until the task gets back to this position.
    Advance(u64),
    Decline,
    /// Guest kernel code, or an interrupt cannot be taken now: it will
    /// exit soon enough on its own.
    NotNow,
}

impl PointTaker {
    /// Recording on a host where user code cannot be preempted where it
    /// stands (`host_check::check_state_match`): deliver at deterministic
    /// exits only.
    pub(crate) fn at_exits_only() -> Self {
        PointTaker {
            delivery: Delivery::ExitsOnly,
            ..Default::default()
        }
    }

    /// Takes a sample mark about every `period_ns` of VM time (0: none);
    /// on a host that delivers at exits only, none (replay could not find
    /// them either). `kernel_stack_top`: the guest kernel variable that
    /// tells user code just back from the kernel (`Sampling::every`).
    pub(crate) fn sample_every(&mut self, period_ns: u64, kernel_stack_top: Option<u64>) {
        if self.delivery != Delivery::ExitsOnly {
            self.marks.period_ns = period_ns;
            self.kernel_stack_top = kernel_stack_top;
        }
    }

    /// The sampling clock's period in nanoseconds (0: no samples).
    pub(crate) fn sample_period_ns(&self) -> u64 {
        self.marks.period_ns
    }

    /// Before the first KVM_RUN: KVM's dirty log on (the pages a point
    /// lists).
    pub(crate) fn start(&mut self, m: &Machine) -> Result<(), VmError> {
        if !self.dirty_logging {
            m.start_dirty_log()?;
            self.dirty_logging = true;
            self.tsc_start = crate::sys::host_tsc();
            self.marks.jitter = self.tsc_start;
            let first = m.vm.clock.now_ns().saturating_add(self.marks.period_ns);
            self.marks.due_ns = (first, first);
        }
        Ok(())
    }

    /// When the vCPU should be kicked to look for an asynchronous point
    /// or to take a sample (u64::MAX: not before something else happens).
    pub(crate) fn deadline(&self, m: &Machine) -> u64 {
        let (point, window) = self.point_and_window_due(m);
        let sample = self.sample_due(m.vm.status.stub_area_gpa.is_some());
        point.min(window).min(sample)
    }

    /// When the next sample mark is due (u64::MAX: never, or not before an
    /// exit): as a point, only after the run's first exit, with the guest
    /// kernel's area announced, and not while a trap is set (its jump
    /// would be read as the program's code).
    fn sample_due(&self, announced: bool) -> u64 {
        if self.marks.period_ns == 0
            || !announced
            || self.last_exit_ns.is_none()
            || self.trap.is_some()
        {
            return u64::MAX;
        }
        self.marks.due_ns.0.max(self.marks.due_ns.1)
    }

    /// At a kick: if a sample is due, a mark of where the task stands
    /// (before any point taken at the same kick: replay finds the mark
    /// first). `resumed`: how the interrupted KVM_RUN started.
    pub(crate) fn try_sample(
        &mut self,
        m: &mut Machine,
        recorder: &mut Recorder,
        resumed: Resumed,
    ) -> Result<(), VmError> {
        let now = m.vm.clock.now_ns();
        if self.trap_for_mark {
            // The task did not come back: the sample is missed.
            if self
                .trap
                .as_ref()
                .is_some_and(|t| now >= t.since_ns + TRAP_NS)
            {
                self.leave_trap(m)?;
                self.sample_stats.missed += 1;
            }
            return Ok(());
        }
        if now < self.sample_due(m.vm.status.stub_area_gpa.is_some()) {
            return Ok(());
        }
        let started = Instant::now();
        let verdict = self.mark_position(m, resumed, now);
        self.stats.busy_ns += started.elapsed().as_nanos() as u64;
        match verdict? {
            MarkVerdict::Take(at) => self.take_mark(recorder, at, now)?,
            MarkVerdict::Advance(to) if self.arm_trap(m, to)? => self.trap_for_mark = true,
            MarkVerdict::Advance(_) | MarkVerdict::Decline => {
                self.sample_stats.missed += 1;
                self.marks.due_ns.1 = now + SAMPLE_RETRY_NS;
            }
        }
        Ok(())
    }

    /// Logs a sample mark at `at`, taken at VM time `now`, and when the
    /// next is due.
    fn take_mark(&mut self, recorder: &mut Recorder, at: MarkAt, now: u64) -> Result<(), VmError> {
        if let MarkAt::User(p) = &at {
            self.last_mark = Some((p.state.cr3, p.state.rip));
        }
        recorder.sample(SampleMark { ns: now, at })?;
        self.sample_stats.taken += 1;
        // A late kick does not bunch the next samples up.
        let next = self
            .marks
            .due_ns
            .0
            .saturating_add(self.marks.next_interval());
        let next = next.max(now + self.marks.period_ns / 2);
        self.marks.due_ns = (next, next);
        Ok(())
    }

    /// Takes the trap out of the guest's code.
    fn drop_trap(&mut self, m: &Machine) {
        if let Some(trap) = self.trap.take() {
            m.restore(&trap.saved);
        }
        self.trap_for_mark = false;
    }

    /// Takes the trap out at a kick. The kick may have stopped the task
    /// on the trap's first instruction, its store, not run yet (the jump
    /// to it taken, often with the fault of the first fetch from the
    /// trap's page): the task goes back to the trapped position, which
    /// gets the guest's bytes back, instead of running on in a page the
    /// trap's code is gone from (zeros: the guest died of a write to
    /// address 0 at the page's first byte). Nothing else of the trap's
    /// code runs before its store exits.
    fn leave_trap(&mut self, m: &mut Machine) -> Result<(), VmError> {
        if let Some(trap) = &self.trap {
            let mut regs = m.vcpu.regs()?;
            if regs.rip == trap.exit_rips[0] {
                regs.rip = trap.rip;
                m.vcpu.set_regs(&regs)?;
            }
        }
        self.drop_trap(m);
        Ok(())
    }

    /// Where the task on the vCPU stands, as a sample mark: one replay
    /// can find again, a position to take it at instead, or none (the
    /// sample is tried again soon).
    fn mark_position(
        &mut self,
        m: &Machine,
        resumed: Resumed,
        now: u64,
    ) -> Result<MarkVerdict, VmError> {
        let sregs = m.vcpu.sregs()?;
        let regs = m.vcpu.regs()?;
        if sregs.cs.selector & 3 != 3 {
            return Ok(MarkVerdict::Take(MarkAt::Kernel { rip: regs.rip }));
        }
        if regs.rflags & TRAP_FLAG != 0 {
            return Ok(MarkVerdict::Decline);
        }
        let mem = &m.vm.mem;
        let cr3 = sregs.cr3 & state::CR3_ROOT;
        let area = match m.stub_area() {
            Some(a) if a.cr3 == cr3 => a,
            _ => return Ok(MarkVerdict::Decline),
        };
        let mut moved = regs;
        let top = self.kernel_stack_top;
        let mode = user_position(mem, sregs.cr3, &mut moved, &area.stub_va, resumed, top);
        if mode != SampleMode::User || probe_gate::in_stub_pages(regs.rip, &area.stub_va) {
            return Ok(MarkVerdict::Take(MarkAt::Boundary { rip: moved.rip }));
        }
        let tables = PageTables { mem, cr3 };
        let judged = self.sites.patchable(mem, &tables, regs.rip, &area.stub_va);
        let Some((site, stub)) = judged else {
            // Taken where the task passes next, a few instructions on.
            return Ok(self
                .sites
                .next_patchable(mem, &tables, regs.rip, &area.stub_va)
                .map_or(MarkVerdict::Decline, MarkVerdict::Advance));
        };
        // Replay could not stop the task here if it went on inside the
        // patch's bytes. From the mark before this one, replay moves it to
        // the trampoline's copy of its instruction (search.rs); but a task
        // can also come back from the kernel without an exit (another
        // task of the address space resuming where it stopped: a thread,
        // a shell back from vfork). Where user mode last resumed, it
        // passes again (it got here from there): the mark is taken
        // there, at its next pass.
        if (regs.rip + 1..site.resume()).contains(&area.resume_ip) {
            return Ok(MarkVerdict::Advance(area.resume_ip));
        }
        let gprs = state::gprs(&regs);
        let tsc = self.tsc_start..=crate::sys::host_tsc();
        if gprs.iter().any(|v| tsc.contains(v)) {
            return Ok(MarkVerdict::Decline);
        }
        Ok(MarkVerdict::Take(MarkAt::User(Box::new(AsyncPoint {
            state: UserState::of_registers(cr3, &regs, sregs.fs.base, sregs.gs.base),
            stub,
            code_pages: code_pages(&tables, regs.rip),
            run_ns: now.saturating_sub(self.last_exit_ns.unwrap_or(now)),
        }))))
    }

    /// When a point is due, and when its dirty window should start
    /// (u64::MAX: not before something else happens).
    fn point_and_window_due(&self, m: &Machine) -> (u64, u64) {
        let platform = &m.vm.platform;
        let interrupt = if platform.pic.has_pending() {
            Some(0)
        } else {
            platform.next_timer_ns()
        };
        let point = self.point_due(m.vm.status.stub_area_gpa.is_some(), interrupt);
        (point, self.window_due(point))
    }

    /// After a deterministic exit at VM time `now`: the clock for "a tick
    /// without an exit", and no trap left behind.
    pub(crate) fn after_exit(&mut self, m: &Machine, now: u64) {
        self.last_exit_ns = Some(now);
        self.last_mark = None;
        if self.trap_for_mark && self.trap.is_some() {
            self.sample_stats.missed += 1;
        }
        self.drop_trap(m);
    }

    /// Whether a store to `addr` may be the trap's.
    pub(crate) fn claims(&self, addr: u64) -> bool {
        addr == EXIT_PAGE_GPA && self.trap.is_some()
    }

    /// A store to the exit page: the trap's, or not.
    pub(crate) fn store(
        &mut self,
        m: &mut Machine,
        recorder: &mut Recorder,
    ) -> Result<Claimed, VmError> {
        match &self.trap {
            Some(trap) if m.stopped_by(trap)? => self.trap_reached(m, recorder),
            _ => Ok(Claimed::NotOurs),
        }
    }

    /// The run stopped: the guest's bytes back.
    pub(crate) fn end(&mut self, m: &Machine) {
        self.drop_trap(m);
    }

    /// At a kick: if an interrupt has waited a tick for an exit and the
    /// vCPU stands in user code at a position replay can find again, logs
    /// the state there and returns true; the interrupt is then injected as
    /// at an exit.
    pub(crate) fn try_point(
        &mut self,
        m: &mut Machine,
        recorder: &mut Recorder,
    ) -> Result<bool, VmError> {
        let now = m.vm.clock.now_ns();
        m.vm.platform.advance_to(now);
        let (point, window) = self.point_and_window_due(m);
        if window <= now {
            self.restart_dirty_log(m, now)?;
            if point <= now + WINDOW_NS {
                // A point taken now would list no page written: it waits
                // for the window (a kick noticed late, a retry).
                self.retry_ns = self.retry_ns.max(now + WINDOW_NS);
                return Ok(false);
            }
        }
        if point > now || !m.vm.platform.pic.has_pending() {
            return Ok(false);
        }
        if self.trap_for_mark {
            // A point is due: the mark's trap gives way (the sample is
            // missed).
            self.leave_trap(m)?;
            self.sample_stats.missed += 1;
        } else if self.trap.is_some() {
            // The task did not come back: look again at the next kick.
            self.leave_trap(m)?;
            self.stats.declined += 1;
            self.retry_ns = now + RETRY_NS;
            return Ok(false);
        }
        let started = Instant::now();
        let position = self.examine(m, now);
        self.stats.busy_ns += started.elapsed().as_nanos() as u64;
        match position? {
            PointVerdict::Take(point) => {
                self.last_mark = None;
                recorder.async_point(*point)?;
                self.stats.points += 1;
                return Ok(true);
            }
            PointVerdict::Advance(to) => {
                if self.arm_trap(m, to)? {
                    return Ok(false);
                }
                self.stats.declined += 1;
            }
            PointVerdict::Decline => self.stats.declined += 1,
            PointVerdict::NotNow => {}
        }
        self.retry_ns = now + RETRY_NS;
        Ok(false)
    }

    /// The pages the guest wrote since the dirty log last started afresh.
    fn take_dirty_pages(&mut self, m: &Machine) -> Result<PageSet, VmError> {
        let bitmap = m.dirty_log()?;
        let window = &mut self.window_pages;
        if window.len() < bitmap.len() {
            window.resize(bitmap.len(), 0);
        }
        for (w, b) in window.iter_mut().zip(&bitmap) {
            *w |= b;
        }
        Ok(PageSet::from_bitmap(window))
    }

    /// Starts the dirty log afresh, so that a point lists the pages
    /// written from now on (any of those is reproduced by a faithful
    /// replay, but a page written long ago is more likely to hold what is
    /// not, such as a host TSC a user-mode RDTSC returned on hosts that
    /// cannot trap it, and a long window costs a long digest;
    /// `without_timestamps` leaves the timestamps out).
    fn restart_dirty_log(&mut self, m: &Machine, now: u64) -> Result<(), VmError> {
        self.take_dirty_pages(m)?;
        self.window_pages.fill(0);
        self.last_reset_ns = now;
        Ok(())
    }

    /// What the recorder can make of the position the vCPU is stopped at.
    fn examine(&mut self, m: &mut Machine, now: u64) -> Result<PointVerdict, VmError> {
        if !m.vcpu.interruptible() {
            return Ok(PointVerdict::NotNow);
        }
        let sregs = m.vcpu.sregs()?;
        if sregs.cs.selector & 3 != 3 {
            return Ok(PointVerdict::NotNow);
        }
        let regs = m.vcpu.regs()?;
        if regs.rflags & TRAP_FLAG != 0 {
            return Ok(PointVerdict::NotNow);
        }
        let cr3 = sregs.cr3 & state::CR3_ROOT;
        let area = match m.stub_area() {
            Some(a) if a.cr3 == cr3 => a,
            _ => return Ok(PointVerdict::Decline),
        };
        let mem = &m.vm.mem;
        let tables = PageTables { mem, cr3 };
        let Some((site, stub)) = self.sites.patchable(mem, &tables, regs.rip, &area.stub_va) else {
            return Ok(PointVerdict::Decline);
        };
        let code_pages = code_pages(&tables, regs.rip);
        // At replay the task resumes user mode where it did here, before
        // it reaches the position: inside the patch it would run its
        // bytes. It passes there again (it got here from there), so the
        // point is taken there, at its next pass.
        if (regs.rip + 1..site.resume()).contains(&area.resume_ip) {
            return Ok(PointVerdict::Advance(area.resume_ip));
        }
        // A replay that takes the sample marks stands at the last one
        // (in user mode, nothing delivered) when it puts this point's
        // trampoline in place; one that does not, where the task resumes.
        let after_mark = self.last_mark.filter(|&(c, _)| c == cr3);
        if after_mark.is_some_and(|(_, at)| (regs.rip + 1..site.resume()).contains(&at)) {
            return Ok(PointVerdict::Decline);
        }
        let gprs = state::gprs(&regs);
        let words: Vec<(u64, u64)> = site
            .memory_words(&gprs, sregs.fs.base, sregs.gs.base)
            .into_iter()
            .filter_map(|at| m.user_word(cr3, at).map(|v| (at, v)))
            .take(trampoline::MAX_WORDS)
            .collect();
        // Values a user-mode RDTSC returned differ in every run on hosts
        // that cannot trap it (glibc's dynamic loader keeps start-up
        // timestamps, and they travel in callee-saved registers and their
        // spills). A state holding one in a register is never found again:
        // the next kick looks again. Pages holding one are left out of the
        // memory compared.
        let tsc = self.tsc_start..=crate::sys::host_tsc();
        if gprs.iter().any(|v| tsc.contains(v)) {
            return Ok(PointVerdict::Decline);
        }
        let xsave = m.vcpu.fd.get_xsave().map_err(kvm_err("GET_XSAVE"))?;
        let cpu: Vec<u8> = xsave.region.iter().flat_map(|w| w.to_le_bytes()).collect();
        let written = self.take_dirty_pages(m)?;
        let pages = without_timestamps(mem, &user_pages(mem, cr3, &written, area.ring), &tsc);
        let entries = trampoline_entries(mem, cr3, stub, &words);
        let memory = state::memory_digest(mem, &pages, &[], &entries);
        Ok(PointVerdict::Take(Box::new(AsyncPoint {
            state: UserState {
                xstate: state::xstate_digest(&cpu, &m.vm.cpu.xsave_layout),
                words,
                pages,
                memory,
                ..UserState::of_registers(cr3, &regs, sregs.fs.base, sregs.gs.base)
            },
            stub,
            code_pages,
            run_ns: now.saturating_sub(self.last_exit_ns.unwrap_or(now)),
        })))
    }

    /// Stops the task when it gets to `rip` (a trap that exits at once);
    /// false if no trap can go there.
    fn arm_trap(&mut self, m: &mut Machine, rip: u64) -> Result<bool, VmError> {
        let sregs = m.vcpu.sregs()?;
        let here = m.vcpu.regs()?.rip;
        let cr3 = sregs.cr3 & state::CR3_ROOT;
        let Some(area) = m.stub_area() else {
            return Ok(false);
        };
        let tables = PageTables {
            mem: &m.vm.mem,
            cr3,
        };
        let Some((site, stub)) = self.sites.patchable(&m.vm.mem, &tables, rip, &area.stub_va)
        else {
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
        match m.install(cr3, &code_pages, rip, stub, &code, None, jump) {
            Ok(mut patch) => {
                patch.since_ns = m.vm.clock.now_ns();
                self.trap = Some(patch);
                Ok(true)
            }
            Err(_) => Ok(false),
        }
    }

    /// The task reached the trap; the point is taken here if the position
    /// allows it now.
    fn trap_reached(
        &mut self,
        m: &mut Machine,
        recorder: &mut Recorder,
    ) -> Result<Claimed, VmError> {
        let Some(trap) = self.trap.take() else {
            return Ok(Claimed::NotOurs);
        };
        if !m.complete_trampoline_exit(&trap)? {
            return Err(VmError::GuestFault {
                reason: "the vCPU ran on past the recorder's trap".into(),
                rip: trap.rip,
                detail: String::new(),
            });
        }
        let now = m.vm.clock.now_ns();
        if std::mem::take(&mut self.trap_for_mark) {
            // Nothing is delivered at a mark: the guest goes on.
            match self.mark_position(m, Resumed::default(), now)? {
                MarkVerdict::Take(at) => self.take_mark(recorder, at, now)?,
                MarkVerdict::Advance(_) | MarkVerdict::Decline => {
                    self.sample_stats.missed += 1;
                    self.marks.due_ns.1 = now + SAMPLE_RETRY_NS;
                }
            }
            return Ok(Claimed::Passed);
        }
        match self.examine(m, now)? {
            PointVerdict::Take(point) => {
                self.last_mark = None;
                recorder.async_point(*point)?;
                self.stats.points += 1;
                self.stats.advanced += 1;
                Ok(Claimed::Reached)
            }
            PointVerdict::Advance(_) | PointVerdict::Decline | PointVerdict::NotNow => {
                self.stats.declined += 1;
                self.retry_ns = now + RETRY_NS;
                Ok(Claimed::Passed)
            }
        }
    }

    /// The VM time at which to look for an asynchronous point,
    /// given whether the guest kernel announced its area and when an
    /// interrupt is or will be pending (`interrupt`);
    /// u64::MAX for never before something else happens. A tick after the
    /// last deterministic exit, and never before the run's first: a point
    /// must follow an exit, where replay puts its trampoline in place (a
    /// restored guest's first kick may come before its first exit).
    fn point_due(&self, announced: bool, interrupt: Option<u64>) -> u64 {
        if !announced || self.delivery == Delivery::ExitsOnly {
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

/// The pages of code around `rip` that `tables` map, (virtual, guest
/// physical): the one it is on and the ones before and after.
fn code_pages(tables: &PageTables<'_>, rip: u64) -> Vec<(u64, u64)> {
    let page = rip & !0xfff;
    [page.wrapping_sub(0x1000), page, page + 0x1000]
        .into_iter()
        .filter_map(|p| tables.page_gpa(p).map(|gpa| (p, gpa)))
        .collect()
}

/// Of `pages`, those the address space `cr3` maps for user mode: the
/// memory the program can see, but the event ring's (`ring`: its first
/// frame's address, pages), which replay's gates write and the
/// recording's do not. The guest kernel's pages are left out: a
/// point tells loop iterations apart by what the program sees (registers
/// and its memory), and the kernel's state is checked at every
/// deterministic exit. With the kernel's pages in the digest, one replay
/// of a UDP recording, in a loaded run of the whole suite, missed a point
/// (every later replay of that trace too) whose 35 written pages were all
/// but one the kernel's (stacks, per-CPU data, timers, sockets); which
/// page differed, a digest cannot say.
fn user_pages(
    mem: &vm_memory::GuestMemoryMmap,
    cr3: u64,
    pages: &PageSet,
    ring: Option<(u64, u64)>,
) -> PageSet {
    let runs = introspect::gva::user_frames(mem, cr3);
    let ring = ring.map_or(0..0, |(gpa, n)| gpa >> 12..(gpa >> 12) + n);
    PageSet::from_frames(
        pages
            .frames()
            .filter(|&f| introspect::gva::in_runs(&runs, f) && !ring.contains(&f)),
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
    use super::*;

    #[test]
    fn points_are_due_a_tick_after_an_exit_and_never_before_the_first() {
        // A guest whose kernel never announced its area.
        let mut p = PointTaker {
            last_exit_ns: Some(0),
            ..Default::default()
        };
        assert_eq!(p.point_due(false, Some(0)), u64::MAX);
        p.last_exit_ns = None;
        // A restored guest 10 s into its boot, before its first exit.
        assert_eq!(p.point_due(true, Some(0)), u64::MAX);
        p.last_exit_ns = Some(10_000_000_000);
        assert_eq!(
            p.point_due(true, Some(0)),
            10_000_000_000 + PREEMPT_AFTER_NS
        );
        assert_eq!(p.point_due(true, Some(20_000_000_000)), 20_000_000_000);
        assert_eq!(p.point_due(true, None), u64::MAX);
        p.retry_ns = 10_050_000_000;
        assert_eq!(p.point_due(true, Some(0)), 10_050_000_000);
        p.delivery = Delivery::ExitsOnly;
        assert_eq!(p.point_due(true, Some(0)), u64::MAX);
    }

    #[test]
    fn samples_are_due_by_the_clock_after_the_first_exit_and_never_under_a_trap() {
        // No sampling clock.
        let mut p = PointTaker {
            marks: MarkClock {
                due_ns: (5_000_000, 5_000_000),
                ..Default::default()
            },
            last_exit_ns: Some(0),
            ..Default::default()
        };
        assert_eq!(p.sample_due(true), u64::MAX);
        p.sample_every(1_000_000, None);
        assert_eq!(p.sample_due(true), 5_000_000);
        // Before the guest kernel announced its area, before the first
        // exit (replay looks for marks after exits).
        assert_eq!(p.sample_due(false), u64::MAX);
        p.last_exit_ns = None;
        assert_eq!(p.sample_due(true), u64::MAX);
        p.last_exit_ns = Some(0);
        // A declined kick tries again later; the due time stays.
        p.marks.due_ns.1 = 5_050_000;
        assert_eq!(p.sample_due(true), 5_050_000);
        // Never while the recorder's trap is set.
        p.trap = Some(Patch {
            rip: 0x40_1000,
            since_ns: 0,
            stub: 0,
            exit_rips: [0; 2],
            saved: Vec::new(),
            started: Instant::now(),
        });
        assert_eq!(p.sample_due(true), u64::MAX);
        // A host that delivers at exits only takes none.
        let mut q = PointTaker::at_exits_only();
        q.sample_every(1_000_000, None);
        assert_eq!(q.sample_period_ns(), 0);
    }

    #[test]
    fn the_dirty_window_starts_afresh_only_before_a_point_that_would_find_it_old() {
        let mut p = PointTaker::default();
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
