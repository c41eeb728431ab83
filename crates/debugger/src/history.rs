//! Going forwards and backwards in a replay without an instruction or
//! branch counter.
//!
//! Positions are the debug tool's: the deterministic exits and
//! asynchronous points replayed, and a thread's registers in user code
//! (`vmm::tools::debug::Position`). Going back is going forward again from
//! a snapshot taken earlier, to a position whose breakpoint goes in only
//! after the exit before it (`DebugTool::set_hits_from`):
//!
//! - `reverse-continue`: from the last snapshot before now, replay to now
//!   with the breakpoints and watchpoints recording their hits; go to the
//!   last hit (for a watchpoint, to right before the instruction that
//!   wrote). No hit: the snapshot before that, back to the program's
//!   start, where gdb is told that history ends (rr and QEMU do it this
//!   way).
//! - `reverse-stepi`: the position before now, when a forward step came
//!   from it. Otherwise the instruction that ends where this one starts
//!   (found by decoding forwards from the start of the function the
//!   symbols name) gets a breakpoint, the replay goes to now again, and
//!   the thread's last hit of it is the answer if one step from it comes
//!   back to now. The breakpoint goes in only after the exit before now
//!   (then the one before that, then from the snapshot): a thread passing
//!   it costs an exit, and the last pass is almost always there. Where no
//!   instruction falls through to this one (it is a jump's target, or no
//!   symbol covers it), the thread is single-stepped forward from an
//!   earlier position: its last pass over this instruction since the exit
//!   before now (a loop's previous round), its first instruction after
//!   that exit, or the stretch of user code before.

use std::collections::HashMap;

use vmm::session::{DebugDriver, DebugEvent};
use vmm::tools::debug::{Hit, HitKind, Position, Resume, Stop, StopKind};
use vmm::VmError;

/// At most this many single steps to find the instruction before another
/// (about 30-60 µs each on a host without user-mode single-stepping).
pub(crate) const MAX_STEPS_BACK: usize = 50_000;
/// How many exits back to look for a thread's previous run of user code.
const MAX_STRETCHES_BACK: u64 = 64;
/// At most this many remembered steps back to a position a breakpoint can
/// reach, from one in code a trampoline covers (its patch is one jump, a
/// few instructions).
const MAX_PATCHED_STEPS: usize = 16;
/// The longest stretch of a function decoded to find the instruction
/// before another.
const MAX_FUNCTION_SCAN: u64 = 1 << 20;

/// Where the function that holds an address of the debugged process's
/// code starts; `None` where no symbol covers it.
pub(crate) type FunctionStarts<'a> = &'a dyn Fn(u64) -> Option<u64>;

/// Where a reverse command ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Back {
    /// At a breakpoint or watchpoint, or after a step.
    Stopped(Stop),
    /// At the start of history: the program's first instruction.
    Start,
}

/// The replay's history as the debugger moves through it.
pub(crate) struct History {
    /// Where the program started: history begins there.
    pub(crate) start: Position,
    /// Where the replay stands.
    pub(crate) now: Position,
    /// Single steps seen: the position a step reached, and the one it
    /// started from.
    steps: HashMap<Position, Position>,
}

impl History {
    pub(crate) fn new(start: Position) -> Self {
        History {
            start,
            now: start,
            steps: HashMap::new(),
        }
    }

    /// A forward step went from `from` to `to`.
    pub(crate) fn stepped(&mut self, from: Position, to: Position) {
        if from != to {
            self.steps.insert(to, from);
        }
    }

    /// The latest snapshot from which `target` lies ahead.
    fn snapshot_before(driver: &DebugDriver, target: &Position) -> Option<usize> {
        driver.snapshots().iter().rposition(|s| {
            s.ordinal() < target.ordinal || (s.ordinal() == target.ordinal && target.user.is_some())
        })
    }

    /// Puts the replay at `target` (a position it passed before).
    ///
    /// A position in code that a trampoline searching for an asynchronous
    /// point covers is never reached by a breakpoint (none goes there; the
    /// thread runs a copy of the code): it is reached from the position a
    /// remembered step came from, by that step again — going back to the
    /// first position outside the patch at most `MAX_PATCHED_STEPS` steps
    /// earlier.
    pub(crate) fn seek(
        &mut self,
        driver: &mut DebugDriver,
        target: Position,
    ) -> Result<(), VmError> {
        // The positions to step to again, from the target back (popped,
        // the earliest comes first), with their thread.
        let mut chain = Vec::new();
        let mut at = target;
        loop {
            match self.seek_directly(driver, at) {
                Ok(()) => break,
                Err(VmError::Debug(why)) => match (self.steps.get(&at), at.user) {
                    (Some(&before), Some(u)) if chain.len() < MAX_PATCHED_STEPS => {
                        chain.push((at, u.lwpid));
                        at = before;
                    }
                    _ => return Err(VmError::Debug(why)),
                },
                Err(e) => return Err(e),
            }
        }
        while let Some((next, lwpid)) = chain.pop() {
            match driver.resume(Resume::Step(lwpid))? {
                DebugEvent::Stopped(s) if stepped(&s.kind) && s.position == next => {}
                other => {
                    return Err(VmError::Debug(format!(
                        "a step did not come back to a position it reached before ({other:?})"
                    )))
                }
            }
        }
        self.now = target;
        Ok(())
    }

    /// `seek` by a snapshot and a replay to `target` (a breakpoint where
    /// it is in user code).
    fn seek_directly(&mut self, driver: &mut DebugDriver, target: Position) -> Result<(), VmError> {
        let exact = driver
            .snapshots()
            .iter()
            .rposition(|s| s.ordinal() == target.ordinal && target.user.is_none());
        let index = exact
            .or_else(|| Self::snapshot_before(driver, &target))
            .ok_or_else(|| VmError::Debug("no snapshot was taken before that position".into()))?;
        driver.restore(index)?;
        if exact.is_none() {
            Self::replay_to(driver, target, u64::MAX)?;
        }
        Ok(())
    }

    /// Replays to `target`, which lies ahead; the hits on the way after
    /// exit `hits_from` (before it, and with `u64::MAX` all the way, the
    /// breakpoints and watchpoints stay out of the guest: a thread in a
    /// loop passes them at the cost of an exit each).
    fn replay_to(
        driver: &mut DebugDriver,
        target: Position,
        hits_from: u64,
    ) -> Result<Vec<Hit>, VmError> {
        driver.debug_mut().take_hits();
        driver.debug_mut().set_hits_from(hits_from);
        match driver.resume(Resume::To(target))? {
            DebugEvent::Stopped(Stop {
                kind: StopKind::Reached,
                ..
            }) => Ok(driver.debug_mut().take_hits()),
            other => Err(VmError::Debug(format!(
                "the replay did not come back to a position it passed ({other:?})"
            ))),
        }
    }

    /// `reverse-continue`: the last breakpoint or watchpoint hit before
    /// now, or the start of history.
    pub(crate) fn reverse_continue(
        &mut self,
        driver: &mut DebugDriver,
        starts: FunctionStarts,
    ) -> Result<Back, VmError> {
        let now = self.now;
        let mut end = now;
        while let Some(index) = Self::snapshot_before(driver, &end) {
            let from = driver.snapshots()[index].ordinal();
            driver.restore(index)?;
            let hits = Self::replay_to(driver, end, 0)?;
            // A breakpoint at the position itself is not gone back to; a
            // write right before it is.
            let last = hits.into_iter().rev().find(|h| {
                self.after_start(&h.position)
                    && match h.kind {
                        HitKind::Breakpoint { .. } => h.position != now,
                        HitKind::Watch { .. } => true,
                    }
            });
            if let Some(hit) = last {
                return self.go_to_hit(driver, hit, starts);
            }
            end = Position {
                ordinal: from,
                user: None,
            };
            if from < self.start.ordinal {
                break;
            }
        }
        self.seek(driver, self.start)?;
        Ok(Back::Start)
    }

    /// Goes to a hit: a breakpoint's position, or right before the
    /// instruction that wrote a watched value (for a write by the kernel,
    /// the system call that made it).
    fn go_to_hit(
        &mut self,
        driver: &mut DebugDriver,
        hit: Hit,
        starts: FunctionStarts,
    ) -> Result<Back, VmError> {
        let lwpid = hit.position.user.map(|u| u.lwpid);
        let (kind, position) = match hit.kind {
            HitKind::Breakpoint { addr } => (StopKind::Breakpoint { addr }, hit.position),
            HitKind::Watch { addr } => {
                let lwpid = lwpid.ok_or_else(|| {
                    VmError::Debug("a watchpoint hit outside the thread's user code".into())
                })?;
                self.seek(driver, hit.position)?;
                let before = self.previous(driver, lwpid, starts)?;
                (StopKind::Watch { addr }, before)
            }
        };
        self.seek(driver, position)?;
        Ok(Back::Stopped(Stop {
            kind,
            lwpid,
            position,
        }))
    }

    /// Whether `at` is at or after the start of history.
    fn after_start(&self, at: &Position) -> bool {
        at.ordinal > self.start.ordinal
            || *at == self.start
            || at.user.is_some() && at.ordinal == self.start.ordinal
    }

    /// `reverse-stepi` of thread `lwpid`: the instruction it ran before
    /// now, or the start of history.
    pub(crate) fn reverse_step(
        &mut self,
        driver: &mut DebugDriver,
        lwpid: u32,
        starts: FunctionStarts,
    ) -> Result<Back, VmError> {
        if self.now == self.start {
            return Ok(Back::Start);
        }
        let previous = self.previous(driver, lwpid, starts)?;
        if !self.after_start(&previous) {
            self.seek(driver, self.start)?;
            return Ok(Back::Start);
        }
        self.seek(driver, previous)?;
        Ok(Back::Stopped(Stop {
            kind: StopKind::Step,
            lwpid: Some(lwpid),
            position: previous,
        }))
    }

    /// The position of thread `lwpid` before now (the start of history if
    /// none is found before it). Leaves the replay anywhere.
    fn previous(
        &mut self,
        driver: &mut DebugDriver,
        lwpid: u32,
        starts: FunctionStarts,
    ) -> Result<Position, VmError> {
        if let Some(p) = self.steps.get(&self.now) {
            return Ok(*p);
        }
        let now = self.now;
        if now.user.is_none_or(|u| u.lwpid != lwpid) {
            return Err(VmError::Debug(
                "reverse-stepi needs the thread stopped in its user code".into(),
            ));
        }
        let saved = driver.debug_mut().take_breakpoints();
        let result = self
            .fall_through(driver, lwpid, now, starts)
            .and_then(|found| match found {
                Some(p) => Ok(p),
                None => self.step_from_anchor(driver, lwpid, now),
            });
        driver.debug_mut().put_breakpoints(saved);
        let previous = result?;
        self.steps.insert(now, previous);
        Ok(previous)
    }

    /// The thread's last pass before `now` over the instruction that
    /// falls through to the one at `now` (or over this one, for the
    /// previous round of a string instruction), if one step from it comes
    /// to `now`. The instruction before is found by decoding forwards
    /// from the start of the function (a breakpoint anywhere but on an
    /// instruction's first byte would change the program): without a
    /// symbol for the code, or with data among it, there is none.
    fn fall_through(
        &mut self,
        driver: &mut DebugDriver,
        lwpid: u32,
        now: Position,
        starts: FunctionStarts,
    ) -> Result<Option<Position>, VmError> {
        let Some(here) = now.user else {
            return Ok(None);
        };
        let mut candidates = Vec::new();
        let mut code = [0u8; introspect::instructions::MAX_INSN];
        let n = driver.read_user(here.rip, &mut code);
        if introspect::instructions::repeats(&code[..n], here.rip) {
            candidates.push(here.rip);
        }
        if let Some(start) = starts(here.rip).filter(|s| here.rip - s <= MAX_FUNCTION_SCAN) {
            let mut body = vec![0u8; (here.rip - start) as usize];
            if driver.read_user(start, &mut body) == body.len() {
                if let Some(Some(p)) = introspect::instructions::predecessor(&body, start, here.rip)
                {
                    candidates.push(p);
                }
            }
        }
        if candidates.is_empty() {
            return Ok(None);
        }
        for &c in &candidates {
            driver.debug_mut().add_breakpoint(c);
        }
        // The thread's last pass: first looked for since the exit before
        // now (where it almost always is), then since the one before
        // that, then all the way from the snapshot (each pass recorded
        // costs an exit; the replays without them cost little).
        let last_pass =
            |driver: &mut DebugDriver, index, hits_from| -> Result<Option<Hit>, VmError> {
                driver.restore(index)?;
                let hits = Self::replay_to(driver, now, hits_from)?;
                Ok(hits.into_iter().rev().find(|h| {
                    h.position != now && h.position.user.is_some_and(|u| u.lwpid == lwpid)
                }))
            };
        let mut last = Ok(None);
        if let Some(index) = Self::snapshot_before(driver, &now) {
            let snapshot = driver.snapshots()[index].ordinal();
            for hits_from in stretches_back(now.ordinal, snapshot) {
                last = last_pass(driver, index, hits_from);
                if !matches!(last, Ok(None)) {
                    break;
                }
            }
        }
        for &c in &candidates {
            driver.debug_mut().remove_breakpoint(c);
        }
        let Some(hit) = last? else {
            return Ok(None);
        };
        self.seek(driver, hit.position)?;
        match driver.resume(Resume::Step(lwpid))? {
            DebugEvent::Stopped(s)
                if stepped(&s.kind)
                    && s.position.user == now.user
                    && s.position.ordinal <= now.ordinal =>
            {
                Ok(Some(hit.position))
            }
            _ => Ok(None),
        }
    }

    /// Finds the position before `now` of thread `lwpid` by stepping it
    /// forward from an earlier one.
    fn step_from_anchor(
        &mut self,
        driver: &mut DebugDriver,
        lwpid: u32,
        now: Position,
    ) -> Result<Position, VmError> {
        let here = now
            .user
            .ok_or_else(|| VmError::Debug("not in user code".into()))?;
        let exit = Position {
            ordinal: now.ordinal,
            user: None,
        };
        // The thread's last pass over this instruction since the exit
        // before now (a loop's previous round), if any.
        driver.debug_mut().add_breakpoint(here.rip);
        self.seek(driver, exit)?;
        let hits = Self::replay_to(driver, now, 0);
        driver.debug_mut().remove_breakpoint(here.rip);
        let anchor = hits?
            .into_iter()
            .map(|h| h.position)
            .rfind(|at| at.user.is_some_and(|u| u.lwpid == lwpid) && *at != now);
        let anchor = match anchor {
            Some(a) => Some(a),
            None => {
                // Its first instruction after the exit.
                self.seek(driver, exit)?;
                match driver.resume(Resume::Enter(lwpid))? {
                    DebugEvent::Stopped(s) if s.kind == StopKind::Reached => {
                        Some(s.position).filter(|p| *p != now && p.ordinal <= now.ordinal)
                    }
                    _ => None,
                }
            }
        };
        match anchor {
            Some(a) => self.step_until(driver, lwpid, a, now),
            None => self.previous_stretch(driver, lwpid, now),
        }
    }

    /// Now is the thread's first user instruction after an exit: its
    /// previous instruction ran before, in a stretch of user code that
    /// ended at a kernel entry. Finds it, looking further back exit by
    /// exit.
    fn previous_stretch(
        &mut self,
        driver: &mut DebugDriver,
        lwpid: u32,
        now: Position,
    ) -> Result<Position, VmError> {
        let mut ordinal = now.ordinal;
        for _ in 0..MAX_STRETCHES_BACK {
            let Some(earlier) = ordinal.checked_sub(1) else {
                break;
            };
            ordinal = earlier;
            if ordinal < self.start.ordinal {
                break;
            }
            let exit = Position {
                ordinal,
                user: None,
            };
            if Self::snapshot_before(driver, &exit).is_none()
                && !driver.snapshots().iter().any(|s| s.ordinal() == ordinal)
            {
                break;
            }
            self.seek(driver, exit)?;
            if let DebugEvent::Stopped(s) = driver.resume(Resume::Enter(lwpid))? {
                if s.kind == StopKind::Reached && s.position.ordinal < now.ordinal {
                    return self.step_until(driver, lwpid, s.position, now);
                }
                // Its first instruction after this exit comes after the
                // one before now: go on from before that one.
                if s.kind == StopKind::Reached {
                    continue;
                }
            }
        }
        Ok(self.start)
    }

    /// Single-steps thread `lwpid` from `from` until it stands where `to`
    /// names (its registers there, whatever the exits in between); the
    /// position before. Every step is remembered for later reverse steps.
    fn step_until(
        &mut self,
        driver: &mut DebugDriver,
        lwpid: u32,
        from: Position,
        to: Position,
    ) -> Result<Position, VmError> {
        self.seek(driver, from)?;
        let mut last = from;
        for _ in 0..MAX_STEPS_BACK {
            let next = match driver.resume(Resume::Step(lwpid))? {
                DebugEvent::Stopped(s) if stepped(&s.kind) => s.position,
                DebugEvent::Stopped(s) if s.kind == StopKind::Interrupted => {
                    return Err(VmError::Debug("interrupted".into()))
                }
                other => {
                    return Err(VmError::Debug(format!(
                        "the thread did not come back to where it was ({other:?})"
                    )))
                }
            };
            self.stepped(last, next);
            if next.user == to.user {
                return Ok(last);
            }
            if next.ordinal > to.ordinal {
                break;
            }
            last = next;
        }
        Err(VmError::Debug(format!(
            "the instruction before this one is more than {MAX_STEPS_BACK} single steps from any \
             earlier position found; use reverse-continue with a breakpoint instead"
        )))
    }
}

/// Where `fall_through` looks for the last pass over an instruction
/// before a position after exit `ordinal`, replaying from a snapshot at
/// exit `snapshot`: from that exit, from the one before, from the
/// snapshot (a stretch that starts at or before it is the whole replay).
fn stretches_back(ordinal: u64, snapshot: u64) -> Vec<u64> {
    let mut from = Vec::new();
    for start in [ordinal, ordinal.saturating_sub(1), 0] {
        if from
            .last()
            .is_some_and(|&last| last <= snapshot || last == start)
        {
            break;
        }
        from.push(start);
    }
    from
}

/// Whether a stop ends a single step: the step's own, or a watched write
/// by the instruction stepped.
fn stepped(kind: &StopKind) -> bool {
    matches!(kind, StopKind::Step | StopKind::Watch { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_pass_is_looked_for_in_the_stretch_then_the_one_before_then_everywhere() {
        assert_eq!(stretches_back(7, 2), vec![7, 6, 0]);
        assert_eq!(stretches_back(1, 0), vec![1, 0]);
        assert_eq!(stretches_back(0, 0), vec![0]);
        // The snapshot is in the stretch before: nothing further back.
        assert_eq!(stretches_back(7, 6), vec![7, 6]);
        // In the stretch itself: the one replay.
        assert_eq!(stretches_back(7, 7), vec![7]);
    }
}
