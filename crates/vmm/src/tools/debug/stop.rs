//! How the debugger resumes a replay and where it stops: the engine's
//! supervisor for the debugger ([`StopFinder`]), which decides what each
//! thing the engine tells means for the run resumed.

use std::sync::atomic::{AtomicBool, Ordering};

use super::position::{Hit, HitKind, Position};
use crate::tools::control::{
    Advance, Arming, BreakpointHit, Control, ProcessInfo, Supervisor, UserPoint, Verdict,
};
use crate::vm::{Machine, VmError};

/// How to resume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// Until the program selected starts (its first instruction).
    Start,
    /// Until a breakpoint, the process's end, an interrupt or the
    /// replay's end.
    Continue,
    /// Until thread `lwpid` of the process has run one user instruction
    /// (or anything `Continue` stops at comes first).
    Step(u32),
    /// Until the replay stands at the position, nothing else stopping it:
    /// the breakpoints hit on the way are recorded as positions
    /// (`DebugTool::take_hits`).
    To(Position),
    /// Until thread `lwpid` is about to run a user instruction (at once if
    /// it is), nothing else stopping it.
    Enter(u32),
    /// Until the replay has reached the point and a thread of the process
    /// is on the CPU at a deterministic exit.
    Until(journal::ReplayPoint),
}

/// Why a resumed replay stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopKind {
    /// The program selected started.
    Started,
    Breakpoint {
        addr: u64,
    },
    /// A write changed the watched bytes at `addr`: right after the
    /// instruction that wrote, or, for a write by the kernel (a system
    /// call's), at the thread's return to user mode.
    Watch {
        addr: u64,
    },
    Step,
    /// Interrupted by the debugger: at the next deterministic exit or
    /// asynchronous point.
    Interrupted,
    /// `Resume::To`, `Resume::Enter` or `Resume::Until` got there.
    Reached,
    /// The process's last thread exited.
    ProcessExited {
        status: i32,
    },
}

/// A stop: why, which thread of the process is concerned, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stop {
    pub kind: StopKind,
    pub lwpid: Option<u32>,
    pub position: Position,
}

/// Where the run resumed stops, and what it records on its way.
pub(crate) struct StopFinder {
    pub(crate) resume: Resume,
    /// A stop found, reported before anything else happens.
    pub(crate) stop: Option<Stop>,
    /// Breakpoint and watchpoint hits recorded by `Resume::To`.
    pub(crate) hits: Vec<Hit>,
    /// `Resume::To` records hits from this ordinal on: before it, the
    /// breakpoints and watchpoints stay out of the guest (their passes
    /// cost nothing); `u64::MAX`, none at all.
    pub(crate) hits_from: u64,
    /// The last exit at which a thread of the process entered the guest
    /// kernel from user mode (a system call's): where the process last
    /// stood in its own code, with its memory, before it ended.
    pub(crate) last_entry: Option<u64>,
}

impl StopFinder {
    pub(crate) fn new() -> Self {
        StopFinder {
            resume: Resume::Start,
            stop: None,
            hits: Vec::new(),
            hits_from: 0,
            last_entry: None,
        }
    }

    /// Which of the breakpoints and watchpoints are in the guest after
    /// `ordinal` exits and points: the debugger's always, but on the
    /// stretch of a `Resume::To` before `hits_from`; the one of the
    /// position `Resume::To` goes to only after the exit before it (a
    /// thread passing it earlier is not there).
    pub(crate) fn arming(&self, ordinal: u64) -> Arming {
        Arming {
            own: !matches!(self.resume, Resume::To(_)) || ordinal >= self.hits_from,
            position: matches!(self.resume, Resume::To(Position { ordinal: o, user: Some(_) }) if o == ordinal),
        }
    }

    /// Stops where the replay is: `kind`, with the current thread's
    /// position.
    pub(crate) fn stop_here(
        &mut self,
        c: &Control,
        m: &Machine,
        kind: StopKind,
    ) -> Result<(), VmError> {
        let lwpid = c.current_thread();
        let user = m.vcpu.sregs()?.cs.selector & 3 == 3;
        let position = Position {
            ordinal: c.ordinal(),
            user: match (lwpid, user) {
                (Some(l), true) => Some(point(m, l, &m.vcpu.regs()?)?),
                _ => None,
            },
        };
        self.stop = Some(Stop {
            kind,
            lwpid,
            position,
        });
        Ok(())
    }

    /// The run is resumed `how` (the engine prepared): what stops at once,
    /// where the replay stands.
    pub(crate) fn resumed(&mut self, c: &Control, m: &Machine, how: Resume) -> Result<(), VmError> {
        let Resume::To(target) = how else {
            return Ok(());
        };
        let ordinal = c.ordinal();
        if target.ordinal < ordinal {
            return Err(VmError::Debug(format!(
                "position at exit {} is behind the replay (exit {ordinal})",
                target.ordinal
            )));
        }
        if let Some(u) = target.user {
            let user = m.vcpu.sregs()?.cs.selector & 3 == 3;
            if target.ordinal == ordinal && user && c.current_thread() == Some(u.lwpid) {
                let regs = m.vcpu.regs()?;
                if point(m, u.lwpid, &regs)? == u {
                    self.stop_here(c, m, StopKind::Reached)?;
                }
            }
        } else if target.ordinal == ordinal {
            self.stop_here(c, m, StopKind::Reached)?;
        }
        Ok(())
    }

    /// After the engine moved on (`advance`), with the log at `log`: an
    /// interrupt asked for, `Resume::Until` and `Resume::To` got there.
    pub(crate) fn advanced(
        &mut self,
        c: &Control,
        m: &Machine,
        advance: Advance,
        log: &journal::LogPosition,
        interrupt: &AtomicBool,
    ) -> Result<(), VmError> {
        let user = m.vcpu.sregs()?.cs.selector & 3 == 3;
        if let (Advance::Exit { kernel_entry: true }, Some(_)) = (advance, c.current_thread()) {
            self.last_entry = Some(c.ordinal());
        }
        if interrupt.swap(false, Ordering::AcqRel) && self.stop.is_none() {
            self.stop_here(c, m, StopKind::Interrupted)?;
        }
        if let (Resume::Until(point), Some(_), Advance::Exit { .. }) =
            (self.resume, c.current_thread(), advance)
        {
            if point.reached(log) && self.stop.is_none() {
                self.stop_here(c, m, StopKind::Reached)?;
            }
        }
        if let Resume::To(target) = self.resume {
            let here = match (c.current_thread(), user) {
                (Some(l), true) => Some(point(m, l, &m.vcpu.regs()?)?),
                _ => None,
            };
            if target.ordinal == c.ordinal()
                && (target.user.is_none() || target.user == here)
                && self.stop.is_none()
            {
                self.stop_here(c, m, StopKind::Reached)?;
            } else if target.ordinal < c.ordinal() && self.stop.is_none() {
                return Err(VmError::Debug(format!(
                    "the replay passed the position at exit {} without finding it",
                    target.ordinal
                )));
            }
        }
        Ok(())
    }
}

impl Supervisor for StopFinder {
    /// A breakpoint of the process: the position to reach, a hit recorded
    /// on the way there, or a stop (`Continue`, `Step`).
    fn breakpoint(&mut self, c: &Control, hit: &BreakpointHit) -> Verdict {
        let Some(lwpid) = hit.thread else {
            return Verdict::Pass;
        };
        // The thread stays there if it stops: its position.
        let position = Position {
            ordinal: c.ordinal(),
            user: Some(hit.point(lwpid)),
        };
        let addr = hit.regs.rip;
        let kind = match self.resume {
            Resume::To(target) if target.ordinal == c.ordinal() && target.user == position.user => {
                StopKind::Reached
            }
            Resume::To(_) if hit.wanted => {
                self.hits.push(Hit {
                    kind: HitKind::Breakpoint { addr },
                    position,
                });
                return Verdict::Pass;
            }
            Resume::Continue | Resume::Step(_) if hit.wanted => StopKind::Breakpoint { addr },
            _ => return Verdict::Pass,
        };
        self.stop = Some(Stop {
            kind,
            lwpid: Some(lwpid),
            position,
        });
        Verdict::Stop
    }

    fn watch_changed(&mut self, c: &Control, m: &Machine, addr: u64) -> Result<Verdict, VmError> {
        match self.resume {
            Resume::Continue | Resume::Step(_) if self.stop.is_none() => {
                self.stop_here(c, m, StopKind::Watch { addr })?;
                Ok(Verdict::Stop)
            }
            Resume::To(_) => {
                if let Some(l) = c.current_thread() {
                    self.hits.push(Hit {
                        kind: HitKind::Watch { addr },
                        position: Position {
                            ordinal: c.ordinal(),
                            user: Some(point(m, l, &m.vcpu.regs()?)?),
                        },
                    });
                }
                Ok(Verdict::Pass)
            }
            _ => Ok(Verdict::Pass),
        }
    }

    fn stepped(&mut self, c: &Control, m: &Machine, moved: Option<u64>) -> Result<(), VmError> {
        if self.stop.is_some() {
            return Ok(());
        }
        self.stop_here(c, m, StopKind::Step)?;
        if let (Some(stop), Some(orig)) = (&mut self.stop, moved) {
            // The program's own address of the instruction moved.
            if let Some(u) = &mut stop.position.user {
                u.rip = orig;
            }
        }
        Ok(())
    }

    /// A position right after the kernel: the instruction may fault
    /// before a breakpoint there would fire.
    fn returned(
        &mut self,
        c: &Control,
        m: &Machine,
        lwpid: u32,
        user: &kvm_bindings::kvm_regs,
    ) -> Result<(), VmError> {
        if let Resume::To(target) = self.resume {
            if target.ordinal == c.ordinal()
                && target.user == Some(point(m, lwpid, user)?)
                && self.stop.is_none()
            {
                self.stop_here(c, m, StopKind::Reached)?;
            }
        }
        Ok(())
    }

    fn entered(&mut self, c: &Control, m: &Machine) -> Result<(), VmError> {
        let kind = match self.resume {
            Resume::Enter(_) => StopKind::Reached,
            _ => StopKind::Step,
        };
        self.stop_here(c, m, kind)
    }

    fn started(&mut self, c: &Control, m: &Machine, _process: &ProcessInfo) -> Result<(), VmError> {
        if self.resume == Resume::Start {
            self.stop_here(c, m, StopKind::Started)?;
        }
        Ok(())
    }

    fn exited(&mut self, c: &Control, m: &Machine, status: i32) -> Result<(), VmError> {
        if self.stop.is_none() {
            self.stop_here(c, m, StopKind::ProcessExited { status })?;
        }
        Ok(())
    }
}

/// Thread `lwpid`'s position at `regs`, its stack read in the address
/// space the vCPU runs in.
fn point(m: &Machine, lwpid: u32, regs: &kvm_bindings::kvm_regs) -> Result<UserPoint, VmError> {
    let cr3 = m.vcpu.sregs()?.cr3;
    Ok(UserPoint::at(&m.vm.mem, cr3, lwpid, regs))
}
