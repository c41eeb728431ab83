//! Forcing a recording's tick choices where it took them (`record
//! --schedule`, docs/chaos.md). A tick comes when the host's time says:
//! the timer interrupt waits for the next deterministic exit, or for an
//! asynchronous point. A re-run that answered a tick's choice only when a
//! tick came at its point took it where the host's time put it, or not at
//! all. A single-stepped task, though, takes its ticks at exits only, most
//! often the one that ends its run of steps (the guest kernel's
//! deterministic point there, before it asks whether the task drops). So
//! after the task's decision before the tick (the anchor), the re-run
//! waits for the task's next exit like the one the recording delivered
//! the tick at (the same instruction doing the same thing, on the task's
//! kernel stack), delivers the timer's interrupt there (waiting for the
//! timer to fire if it has not yet), and answers the task's tick with the
//! choice. If the task asks another decision first, the forcing is given
//! up, and the choice is taken only by a tick at its very point, as the
//! host's time puts it.

use std::collections::HashMap;
use std::time::Duration;

use journal::{Entry, MSR_INSIGHT_CHAOS_DECISION};

use super::schedule::{ChaosPoint, ForcedTick, PointKind};
use crate::vm::{Machine, VmError};

/// How long to wait at a forced tick's exit for the timer to fire (VM
/// time): the guest's tick period is 10 ms (HZ=100).
const TIMER_WAIT_MAX_NS: u64 = 100_000_000;

/// The guest kernel's stacks are 16 KiB, aligned: a task's kernel stack
/// pointer, so masked, names the task.
const KERNEL_STACK_MASK: u64 = !0x3fff;

/// Where forced ticks stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Its anchor not reached yet.
    Waiting,
    /// Its anchor reached: the task's exit is looked for.
    Armed,
    /// Its interrupt delivered at the exit.
    Forced,
    /// The task went on without that exit, or the interrupt could not
    /// come there: its choice is taken at a tick at its very point.
    GivenUp,
    /// Answered at its point (not forced).
    Answered,
}

/// The ticks of a re-run to force.
#[derive(Default)]
pub(crate) struct TickForcer {
    ticks: Vec<ForcedTick>,
    states: Vec<State>,
    /// Each task's kernel stack (masked), as its last decision's exit
    /// showed it.
    stacks: HashMap<u16, u64>,
    /// The point the guest was answered at last: its exit is the next.
    decided: Option<ChaosPoint>,
    /// A tick whose exit the task reached: delivered before it runs on.
    deliver: Option<usize>,
    /// The tick whose interrupt was delivered: its task's next tick takes
    /// the choice.
    due: Option<(u16, u64)>,
    pub(crate) stats: TickStats,
}

/// What the forcing of ticks came to in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TickStats {
    /// Ticks forced where the recording took them.
    pub forced: u64,
    /// Forcings given up (the task went on without the exit).
    pub given_up: u64,
}

impl TickForcer {
    pub(crate) fn new(ticks: Vec<ForcedTick>) -> Self {
        TickForcer {
            states: vec![State::Waiting; ticks.len()],
            ticks,
            ..TickForcer::default()
        }
    }

    /// The guest named `point` (before asking): the task's ticks still
    /// armed are given up (it asks again without having made the exit).
    pub(crate) fn point_named(&mut self, point: ChaosPoint) {
        if point.kind == PointKind::Tick {
            return;
        }
        for (t, state) in self.ticks.iter().zip(&mut self.states) {
            if *state == State::Armed && t.point.task == point.task {
                *state = State::GivenUp;
                self.stats.given_up += 1;
            }
        }
        if self.due.is_some_and(|(task, _)| task == point.task) {
            // The interrupt came but made no tick of that task.
            self.due = None;
        }
    }

    /// The answer to `point`, if it is a forced tick's: the task's tick
    /// after the interrupt delivered at the exit; or, for a tick not
    /// forced, a tick at the very point, wherever the host's time put it.
    pub(crate) fn answer(&mut self, point: ChaosPoint) -> Option<u64> {
        if point.kind != PointKind::Tick {
            return None;
        }
        if let Some((task, value)) = self.due {
            if point.task == task {
                self.due = None;
                self.stats.forced += 1;
                return Some(value);
            }
        }
        let i = (0..self.ticks.len()).find(|&i| {
            self.ticks[i].point == point
                && matches!(self.states[i], State::Waiting | State::GivenUp)
        })?;
        self.states[i] = State::Answered;
        Some(self.ticks[i].value)
    }

    /// The guest was answered at `point`: it arms the ticks it anchors.
    pub(crate) fn decided(&mut self, point: ChaosPoint) {
        self.decided = Some(point);
        if point.kind == PointKind::Tick {
            return;
        }
        for (t, state) in self.ticks.iter().zip(&mut self.states) {
            if *state == State::Waiting && t.at.anchor == point {
                *state = State::Armed;
            }
        }
    }

    /// A deterministic exit, the vCPU's kernel stack pointer `rsp`.
    pub(crate) fn exited(&mut self, entry: &Entry, rsp: u64) {
        let decided = self.decided.take();
        if self.ticks.is_empty() {
            return;
        }
        if let (Entry::RdMsr { index, .. }, Some(point)) = (entry, decided) {
            // A task's decision is asked on its own kernel stack, but a
            // new task's (its parent's) and a tick's (the interrupt's).
            if *index == MSR_INSIGHT_CHAOS_DECISION
                && !matches!(point.kind, PointKind::New | PointKind::Tick)
            {
                self.stacks.insert(point.task, rsp & KERNEL_STACK_MASK);
            }
            return;
        }
        let stack = rsp & KERNEL_STACK_MASK;
        self.deliver = (0..self.ticks.len()).find(|&i| {
            let t = &self.ticks[i];
            self.states[i] == State::Armed
                && t.at.exit.same_exit(entry)
                && self.stacks.get(&t.point.task) == Some(&stack)
        });
    }

    /// Before the vCPU runs on after an exit: whether to deliver the
    /// timer's interrupt now (a forced tick's exit, the timer waited
    /// for); `None`: as without forcing. `at_exit`: right after a
    /// deterministic exit, `can_inject`: the vCPU can take an interrupt.
    pub(crate) fn before_run(
        &mut self,
        m: &mut Machine,
        at_exit: bool,
        can_inject: bool,
    ) -> Result<Option<bool>, VmError> {
        let Some(i) = self.deliver.take() else {
            return Ok(None);
        };
        if !at_exit || !can_inject || !wait_for_timer(m) {
            self.states[i] = State::GivenUp;
            self.stats.given_up += 1;
            return Ok(None);
        }
        self.states[i] = State::Forced;
        let t = &self.ticks[i];
        self.due = Some((t.point.task, t.value));
        Ok(Some(true))
    }
}

/// Waits, the vCPU stopped at an exit, until the platform has an
/// interrupt pending (the timer fired), at most `TIMER_WAIT_MAX_NS`:
/// whether it has.
fn wait_for_timer(m: &mut Machine) -> bool {
    let start = m.vm.clock.now_ns();
    loop {
        let now = m.vm.clock.now_ns();
        m.vm.platform.advance_to(now);
        if m.vm.platform.pic.has_pending() {
            return true;
        }
        if now.saturating_sub(start) > TIMER_WAIT_MAX_NS {
            return false;
        }
        let wait = match m.vm.platform.next_timer_ns() {
            Some(due) => due.saturating_sub(now).clamp(20_000, 1_000_000),
            None => 1_000_000,
        };
        std::thread::sleep(Duration::from_nanos(wait));
    }
}

#[cfg(test)]
mod tests {
    use super::super::schedule::TickAt;
    use super::*;

    fn point(task: u16, kind: PointKind, count: u64) -> ChaosPoint {
        ChaosPoint { task, kind, count }
    }

    fn sync(rip: u64) -> Entry {
        Entry::Out {
            port: 0xf00,
            size: 4,
            rip,
            value: 0x500_0000,
        }
    }

    fn decision() -> Entry {
        Entry::RdMsr {
            index: MSR_INSIGHT_CHAOS_DECISION,
            rip: 1,
            value: 0,
            fault: false,
        }
    }

    fn forcer() -> TickForcer {
        TickForcer::new(vec![ForcedTick {
            point: point(2, PointKind::Tick, 5 << 8),
            value: 0x7000_0000,
            at: TickAt {
                anchor: point(2, PointKind::Steps, 4),
                exit: sync(0x10),
            },
        }])
    }

    /// The guest asks `p` on the kernel stack at `rsp`.
    fn ask(f: &mut TickForcer, p: ChaosPoint, rsp: u64) -> Option<u64> {
        f.point_named(p);
        let answer = f.answer(p);
        f.decided(p);
        f.exited(&decision(), rsp);
        answer
    }

    #[test]
    fn the_tasks_exit_like_the_recorded_one_after_its_anchor_gets_the_tick() {
        let mut f = forcer();
        ask(&mut f, point(2, PointKind::Steps, 3), 0x8000_4100);
        // Before the anchor: not looked for.
        f.exited(&sync(0x10), 0x8000_4200);
        assert_eq!(f.deliver, None);
        ask(&mut f, point(2, PointKind::Steps, 4), 0x8000_4100);
        assert_eq!(f.states[0], State::Armed);
        // Another task's like exit (another stack), another exit of the
        // task: not it.
        f.exited(&sync(0x10), 0x9000_4200);
        assert_eq!(f.deliver, None);
        f.exited(&sync(0x11), 0x8000_4200);
        assert_eq!(f.deliver, None);
        f.exited(&sync(0x10), 0x8000_4f00);
        assert_eq!(f.deliver, Some(0));
        // Delivered (as `before_run` does): the task's next tick, whatever
        // its count, takes the choice; another task's does not.
        f.deliver = None;
        f.states[0] = State::Forced;
        f.due = Some((2, 0x7000_0000));
        assert_eq!(f.answer(point(3, PointKind::Tick, 0)), None);
        assert_eq!(
            f.answer(point(2, PointKind::Tick, 5 << 8 | 1)),
            Some(0x7000_0000)
        );
        assert_eq!(f.answer(point(2, PointKind::Tick, 5 << 8)), None);
        assert_eq!(f.stats.forced, 1);
    }

    #[test]
    fn a_task_that_asks_again_first_gives_the_forcing_up() {
        let mut f = forcer();
        ask(&mut f, point(2, PointKind::Steps, 4), 0x8000_4100);
        // A tick of its own does not, another decision does.
        assert_eq!(
            ask(&mut f, point(2, PointKind::Tick, 5 << 8 | 1), 0x100),
            None
        );
        assert_eq!(f.states[0], State::Armed);
        ask(&mut f, point(2, PointKind::Drop, 5), 0x8000_4100);
        assert_eq!(f.states[0], State::GivenUp);
        assert_eq!(f.stats.given_up, 1);
        f.exited(&sync(0x10), 0x8000_4f00);
        assert_eq!(f.deliver, None);
        // Its choice is then taken at a tick at its very point, once.
        assert_eq!(
            f.answer(point(2, PointKind::Tick, 5 << 8)),
            Some(0x7000_0000)
        );
        assert_eq!(f.answer(point(2, PointKind::Tick, 5 << 8)), None);
    }
}
