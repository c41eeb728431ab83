//! The debugger's hold on a replay: one guest process (its first program
//! execution, found by pid or name), stopped and resumed at positions a
//! later replay reaches again, with breakpoints and single steps in its
//! user code.
//!
//! This host's KVM never stops in guest user mode. Breakpoints are `int3`s
//! in the process's code, caught where the guest kernel's #BP handler
//! begins; single steps set the trap flag and are caught where its #DB
//! handler begins (hardware breakpoints fire there, in kernel mode). The
//! VMM then returns the vCPU to user mode itself: the guest kernel never
//! runs for them, and these exits are not the exit clock's. The thread's
//! return to user mode from the kernel is caught the same way at the
//! kernel's `iretq` (and `sysretq`), where the VMM completes the return
//! itself, so that a stop can come right before the first instruction
//! after a system call, a page fault or the program's start.
//!
//! A position is named without any counter: the deterministic exits and
//! asynchronous points replayed (`ordinal`) and, for a thread in user
//! code, its registers there. Reaching one again is replaying to the
//! ordinal, then stopping the thread at that instruction with those
//! registers (the first time after the ordinal: two instants of one
//! thread's run between two exits with the same instruction and the same
//! registers are the same position).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvm_bindings::kvm_regs;
use vm_memory::GuestMemoryMmap;

use super::control::breakpoints::{self, Breakpoints};
use super::control::tasks::{self, auxv_at_start, Tasks};
use super::control::watch;
use super::control::{ProcessInfo, ProcessSelector};
use super::exec::{exec_call, fork_call, is_kernel_entry};
use super::frames::{
    self, idt_handler, return_by_iret, set_kernel_breakpoints, ExceptionFrame, BREAKPOINT_VECTOR,
    DEBUG_VECTOR,
};
use super::kernel_steps;
use crate::points::PointSearch;
use crate::vm::{Machine, VmError};
use introspect::gva::peek_user;
use introspect::instructions::{self, TF};
use journal::preempt::state::CR3_ROOT;
use journal::Entry;

pub(crate) mod snapshot;

pub use snapshot::Snapshot;

/// RFLAGS.RF, which the CPU sets and clears on its own around faults.
const RF: u64 = 1 << 16;
/// The `syscall` instruction.
const SYSCALL: [u8; 2] = [0x0f, 0x05];

/// Guest kernel code and data the debugger uses, from the kernel image's
/// symbols (`vmm::builder` looks them up).
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelPoints {
    /// The variable that holds the top of the current task's kernel
    /// stack.
    pub stack_top_var: Option<u64>,
    /// The `swapgs` before the `iretq` of every return to user mode but
    /// fast system-call returns (in
    /// `swapgs_restore_regs_and_return_to_usermode`).
    pub iret: Option<u64>,
    /// The `swapgs; sysretq` of fast system-call returns
    /// (`entry_SYSRETQ_unsafe_stack`).
    pub sysret: Option<u64>,
}

/// A thread's user-mode state that names a position in its run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UserPoint {
    pub lwpid: u32,
    pub rip: u64,
    /// RAX, RCX, RDX, RBX, RSP, RBP, RSI, RDI, R8..R15.
    pub gprs: [u64; 16],
    /// RFLAGS without the trap and resume flags.
    pub rflags: u64,
}

impl UserPoint {
    fn of(lwpid: u32, r: &kvm_regs) -> Self {
        UserPoint {
            lwpid,
            rip: r.rip,
            gprs: [
                r.rax, r.rcx, r.rdx, r.rbx, r.rsp, r.rbp, r.rsi, r.rdi, r.r8, r.r9, r.r10, r.r11,
                r.r12, r.r13, r.r14, r.r15,
            ],
            rflags: r.rflags & !(TF | RF),
        }
    }
}

/// A position in the replay: the deterministic exits and asynchronous
/// points replayed, and where a thread of the process stands in its user
/// code (`None`: right after that exit or point).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Position {
    pub ordinal: u64,
    pub user: Option<UserPoint>,
}

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
    /// To the replay's end, never stopping, for the probes given at
    /// replay: every program execution is told to the collecting tool
    /// (`DebugTool::take_process_changes`), which follows the processes it
    /// wants (`DebugTool::follow`) with breakpoints in each; each
    /// breakpoint a thread of a followed process (or of a child it
    /// forked) hits is kept with its registers
    /// (`DebugTool::take_probe_hits`).
    Collect,
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

/// A breakpoint or watchpoint hit `Resume::To` passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    pub kind: HitKind,
    pub position: Position,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HitKind {
    Breakpoint { addr: u64 },
    Watch { addr: u64 },
}

/// A breakpoint hit while collecting (`Resume::Collect`): the thread and
/// its user registers at the breakpoint's address, the instruction not
/// run yet.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ProbeHit {
    pub(crate) pid: u32,
    pub(crate) lwpid: u32,
    /// The address space of its process.
    pub(crate) cr3: u64,
    /// The address space of the followed process whose breakpoint it is:
    /// `cr3`, or its parent's for a child it forked.
    pub(crate) space: u64,
    pub(crate) regs: kvm_regs,
}

/// What a collecting tool learns of the guest's processes.
#[derive(Clone, Debug)]
pub(crate) enum ProcessChange {
    /// A process started a program (at its first instruction, nothing of
    /// it run yet).
    Started(ProcessInfo),
    /// A followed process ended, or executed another program (whose start
    /// comes next).
    Ended { cr3: u64 },
    /// A followed process (its address space `parent`) forked a child,
    /// followed from its first return to user mode: its memory is a copy
    /// of its parent's.
    Forked { pid: u32, cr3: u64, parent: u64 },
}

/// A tool collecting breakpoint hits (`Resume::Collect`): the hits and
/// the process changes since the last look.
#[derive(Clone, Debug, Default)]
pub(crate) struct Collecting {
    hits: Vec<ProbeHit>,
    changes: Vec<ProcessChange>,
}

/// A stop: why, which thread of the process is concerned, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stop {
    pub kind: StopKind,
    pub lwpid: Option<u32>,
    pub position: Position,
}

/// A stepping in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stepping {
    /// The thread runs one instruction under the trap flag, from where it
    /// stood (`from`) after `ordinal` exits and points.
    Trap { from: UserPoint, ordinal: u64 },
    /// The thread is in the kernel (or about to enter it with a system
    /// call): stop at its first user instruction after the kernel.
    AtReturn(u32),
    /// Then run that instruction under the trap flag.
    ReturnThenTrap(u32),
}

/// Which kernel breakpoint slot is which.
const SLOT_BP: usize = 0;
const SLOT_DB: usize = 1;
const SLOT_IRET: usize = 2;
const SLOT_SYSRET: usize = 3;

/// The debugger's tool on a replay session.
pub struct DebugTool {
    selector: ProcessSelector,
    kernel: KernelPoints,
    traps: KernelTraps,
    pub(crate) tasks: Tasks,
    pub(crate) breakpoints: Breakpoints,
    /// The breakpoint under the instruction a thread is being stepped
    /// over, out of memory until the step ends.
    lifted: Option<u64>,
    /// That instruction is a system call: the breakpoint goes back at the
    /// next return to user mode.
    lifted_until_return: bool,
    resume: Resume,
    stepping: Option<Stepping>,
    /// A stop found, reported before anything else happens.
    stop: Option<Stop>,
    /// Breakpoint and watchpoint hits recorded by `Resume::To`.
    hits: Vec<Hit>,
    /// `Resume::To` records hits from this ordinal on: before it, the
    /// breakpoints and watchpoints stay out of the guest (their passes
    /// cost nothing); `u64::MAX`, none at all.
    hits_from: u64,
    pub(crate) watches: watch::Watches,
    /// The kernel changed watched bytes for this thread (the watch's
    /// address): the hit is at its return to user mode.
    kernel_wrote: Option<(u32, u64)>,
    /// A store to a watched page the VMM could not perform (a vector
    /// store): the page is writable for one step of the thread.
    watch_step: bool,
    /// Code no breakpoint may go into: what an asynchronous point's
    /// trampoline patches, while its search lasts (address space, start,
    /// end).
    avoid: Option<(u64, u64, u64)>,
    interrupt: Arc<AtomicBool>,
    /// The deterministic exits and asynchronous points replayed.
    ordinal: u64,
    /// The replay stopped right after an exit (a snapshot may be taken).
    pub(crate) at_exit: bool,
    pub(crate) snapshots: SnapshotClock,
    /// What a collecting tool collects.
    pub(crate) collecting: Option<Collecting>,
}

/// The hardware breakpoints on guest kernel code.
#[derive(Default)]
struct KernelTraps {
    /// The #BP and #DB handlers' first instructions (once read from the
    /// IDT).
    handlers: Option<[u64; 2]>,
    /// The returns to user mode have breakpoints too.
    returns_armed: bool,
    /// The kernel breakpoint being stepped over (it would fire again at
    /// the same instruction).
    stepping_over_kernel: bool,
    /// The guest kernel's code and stack segments (once read), which a
    /// step made in kernel mode runs with.
    kernel_segments: Option<(kvm_bindings::kvm_segment, kvm_bindings::kvm_segment)>,
}

/// When the replay pauses for a snapshot.
#[derive(Default)]
pub(crate) struct SnapshotClock {
    /// How often the driver wants one (host time).
    every: Option<std::time::Duration>,
    /// When it took the last.
    last: Option<std::time::Instant>,
    /// The replay paused for one.
    pub(crate) due: bool,
}

impl DebugTool {
    pub fn new(selector: ProcessSelector, kernel: KernelPoints) -> Self {
        DebugTool {
            selector,
            kernel,
            traps: KernelTraps::default(),
            tasks: Tasks::default(),
            breakpoints: Breakpoints::default(),
            lifted: None,
            lifted_until_return: false,
            resume: Resume::Start,
            stepping: None,
            stop: None,
            hits: Vec::new(),
            hits_from: 0,
            watches: watch::Watches::default(),
            kernel_wrote: None,
            watch_step: false,
            avoid: None,
            interrupt: Arc::new(AtomicBool::new(false)),
            ordinal: 0,
            at_exit: false,
            snapshots: SnapshotClock::default(),
            collecting: None,
        }
    }

    /// A tool that collects the hits of the breakpoints it is given in
    /// the processes it follows, to the replay's end.
    pub(crate) fn collecting(kernel: KernelPoints) -> Self {
        let mut tool = DebugTool::new(ProcessSelector::Any, kernel);
        tool.resume = Resume::Collect;
        tool.collecting = Some(Collecting::default());
        tool
    }

    /// The processes that started and the followed ones that ended since
    /// the last call, in order.
    pub(crate) fn take_process_changes(&mut self) -> Vec<ProcessChange> {
        (self.collecting.as_mut()).map_or_else(Vec::new, |c| std::mem::take(&mut c.changes))
    }

    /// Follows the process `pid` (its address space `cr3`), which just
    /// started: breakpoints go into it (`add_breakpoint_in`), its threads
    /// are followed, and its end is told.
    pub(crate) fn follow(&mut self, pid: u32, cr3: u64) {
        let mut followed = tasks::Followed {
            cr3,
            ..Default::default()
        };
        followed.threads.insert(pid, false);
        self.tasks.followed.insert(pid, followed);
    }

    /// Stops following the process `pid`: its breakpoints come out at
    /// the next run, unless another process wants them too.
    /// Its address space, if it was followed.
    pub(crate) fn unfollow(&mut self, pid: u32) -> Option<u64> {
        let followed = self.tasks.followed.remove(&pid)?;
        self.breakpoints.drop_space(followed.cr3);
        Some(followed.cr3)
    }

    /// A breakpoint at `va` of a followed process's address space `cr3`
    /// (from the next run; `breakpoints_changed` after a change).
    pub(crate) fn add_breakpoint_in(&mut self, cr3: u64, va: u64) {
        self.breakpoints.add_in(cr3, va);
    }

    pub(crate) fn remove_breakpoint_in(&mut self, cr3: u64, va: u64) {
        self.breakpoints.remove_in(cr3, va);
    }

    /// Breakpoints were added or removed: they go in (or out) where the
    /// process maps their pages, and the returns to user mode are watched
    /// while some wait for theirs.
    pub(crate) fn breakpoints_changed(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.sync_breakpoints(m);
        self.update_returns(m)
    }

    /// The breakpoint hits collected since the last call, oldest first.
    pub(crate) fn take_probe_hits(&mut self) -> Vec<ProbeHit> {
        (self.collecting.as_mut()).map_or_else(Vec::new, |c| std::mem::take(&mut c.hits))
    }

    /// Pauses right after an exit for a snapshot about every `every` of
    /// host time.
    pub(crate) fn snapshot_every(&mut self, every: Option<std::time::Duration>) {
        self.snapshots.every = every;
    }

    /// A snapshot was taken (or restored) now.
    pub(crate) fn snapshot_taken(&mut self) {
        self.snapshots.last = Some(std::time::Instant::now());
        self.snapshots.due = false;
    }

    /// Before each KVM_RUN (`after_exit`: right after a checked exit):
    /// whether the replay pauses here, for a stop or a snapshot.
    pub(crate) fn pause(&mut self, after_exit: bool) -> bool {
        self.at_exit = after_exit;
        if self.stop.is_some() {
            return true;
        }
        let clock = &mut self.snapshots;
        clock.due = after_exit
            && clock
                .every
                .is_some_and(|every| clock.last.is_none_or(|t| t.elapsed() >= every));
        clock.due
    }

    /// The guest kernel raised an event (the exit's registers name its
    /// buffer): a thread's exit ends the process when it is its last.
    pub(crate) fn kernel_event(&mut self, m: &mut Machine) -> Result<(), VmError> {
        let regs = m.vcpu.synced_regs();
        let cr3 = m.vcpu.sregs()?.cr3;
        let Ok(buffer) = introspect::guest_events::read_buffer(&m.vm.mem, cr3, regs.rsi, false)
        else {
            return Ok(());
        };
        let Ok(event) = events::abi::parse(&buffer, buffer.len()) else {
            return Ok(());
        };
        if let events::abi::Payload::Exit { status } = event.payload {
            let (pid, lwpid) = ((regs.rdi >> 32) as u32, regs.rdi as u32);
            self.thread_exited(m, pid, lwpid, status)?;
        }
        Ok(())
    }

    /// What interrupts a run (set it, and kick the vCPU).
    pub fn interrupt_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.interrupt)
    }

    /// The pid of the task on the CPU, as of the last look.
    pub(crate) fn current_pid(&self) -> Option<u32> {
        self.tasks.current.map(|(pid, _)| pid)
    }

    /// The process, once started.
    pub fn process(&self) -> Option<&ProcessInfo> {
        self.tasks.process.as_ref()
    }

    /// The process's threads that have not exited, first seen first.
    pub fn threads(&self) -> Vec<u32> {
        self.tasks.live_threads()
    }

    /// The deterministic exits and asynchronous points replayed.
    pub fn ordinal(&self) -> u64 {
        self.ordinal
    }

    pub fn add_breakpoint(&mut self, va: u64) {
        self.breakpoints.add(va);
    }

    pub fn remove_breakpoint(&mut self, va: u64) {
        self.breakpoints.remove(va);
    }

    /// Takes every breakpoint away (they leave memory at the next run);
    /// `put_breakpoints` gives them back.
    pub fn take_breakpoints(&mut self) -> std::collections::BTreeSet<u64> {
        self.breakpoints.take()
    }

    pub fn put_breakpoints(&mut self, wanted: std::collections::BTreeSet<u64>) {
        self.breakpoints.put(wanted);
    }

    /// The next `Resume::To` records the hits from the position after exit
    /// `ordinal` on (0: all its way; `u64::MAX`: none, the breakpoints and
    /// watchpoints out of the guest all its way, where a thread passing
    /// them would cost an exit for nothing).
    pub fn set_hits_from(&mut self, ordinal: u64) {
        self.hits_from = ordinal;
    }

    /// The hits `Resume::To` recorded on its way, oldest first.
    pub fn take_hits(&mut self) -> Vec<Hit> {
        std::mem::take(&mut self.hits)
    }

    /// Watches writes to `len` bytes at `addr` of the process (from the
    /// next resume).
    pub fn add_watch(&mut self, addr: u64, len: u64) {
        self.watches.add(addr, len);
    }

    pub fn remove_watch(&mut self, addr: u64, len: u64) -> bool {
        self.watches.remove(addr, len)
    }

    /// Whether a write to guest physical `gpa` is the debugger's to
    /// perform (a watched page).
    pub(crate) fn claims(&self, gpa: u64) -> bool {
        self.watches.claims(gpa)
    }

    /// The guest wrote `data` at `gpa`, in a watched page: the write is
    /// performed, and the watches looked at.
    pub(crate) fn watched_write(
        &mut self,
        m: &mut Machine,
        gpa: u64,
        data: &[u8],
    ) -> Result<(), VmError> {
        watch::Watches::write(m, gpa, data)?;
        self.look_at_watches(m)
    }

    /// The VMM wrote into a watched page for the guest kernel (a copy it
    /// asked for): the watches are looked at, as after the kernel's own
    /// write.
    pub(crate) fn written_for_guest(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.look_at_watches(m)
    }

    /// After a write to a watched page: a change of the watched bytes by
    /// the process's thread is a hit (by its user code: here; by the
    /// kernel: at its return to user mode). Other processes' writes to a
    /// shared page only update the values.
    fn look_at_watches(&mut self, m: &mut Machine) -> Result<(), VmError> {
        let Some(cr3) = self.tasks.process.as_ref().map(|p| p.cr3) else {
            return Ok(());
        };
        let Some(&addr) = self.watches.changed(m, cr3).first() else {
            return Ok(());
        };
        self.tasks.follow_switches(&m.vm.mem);
        let sregs = m.vcpu.sregs()?;
        let Some(lwpid) = self
            .tasks
            .current_thread()
            .filter(|_| sregs.cr3 & CR3_ROOT == cr3)
        else {
            return Ok(());
        };
        if sregs.cs.selector & 3 == 3 {
            self.watch_hit(m, addr)
        } else {
            self.kernel_wrote = Some((lwpid, addr));
            self.update_returns(m)
        }
    }

    /// The watched bytes at `addr` changed, the thread in user mode right
    /// after the write.
    fn watch_hit(&mut self, m: &mut Machine, addr: u64) -> Result<(), VmError> {
        match self.resume {
            Resume::Continue | Resume::Step(_) if self.stop.is_none() => {
                if matches!(self.stepping.take(), Some(Stepping::Trap { .. })) {
                    // The step is over: the instruction completed.
                    let mut regs = m.vcpu.regs()?;
                    regs.rflags &= !TF;
                    m.vcpu.set_regs(&regs)?;
                }
                self.stop_here(m, StopKind::Watch { addr })
            }
            Resume::To(_) => {
                let lwpid = self.tasks.current_thread();
                if let Some(l) = lwpid {
                    self.hits.push(Hit {
                        kind: HitKind::Watch { addr },
                        position: Position {
                            ordinal: self.ordinal,
                            user: Some(UserPoint::of(l, &m.vcpu.regs()?)),
                        },
                    });
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The vCPU stopped at an instruction KVM could not emulate: if it is
    /// a user store to a watched page (a vector store), the page becomes
    /// writable for one step of the thread, after which the watches are
    /// looked at. Whether the debugger took it.
    pub(crate) fn unemulated(&mut self, m: &mut Machine) -> Result<bool, VmError> {
        if self.watches.is_empty() || m.vcpu.sregs()?.cs.selector & 3 != 3 {
            return Ok(false);
        }
        self.watches.unprotect(m)?;
        let mut regs = m.vcpu.regs()?;
        regs.rflags |= TF;
        m.vcpu.set_regs(&regs)?;
        self.watch_step = true;
        Ok(true)
    }

    /// Protects the watched pages of the process as mapped now, and takes
    /// the watched values (`all`: every one, else those not known yet).
    fn sync_watches(&mut self, m: &Machine, all: bool) -> Result<(), VmError> {
        self.watches.armed = self.hits_armed();
        let cr3 = self
            .tasks
            .process
            .as_ref()
            .map(|p| p.cr3)
            .filter(|_| self.watches.armed);
        self.watches.sync(m, cr3, all)
    }

    /// Whether the debugger's breakpoints and watchpoints are in the guest
    /// now: always, but on the stretch of a `Resume::To` before
    /// `hits_from`.
    fn hits_armed(&self) -> bool {
        !matches!(self.resume, Resume::To(_)) || self.ordinal >= self.hits_from
    }

    /// Whether the breakpoint of the position `Resume::To` goes to is in
    /// the guest now: only after the exit before the position (a thread
    /// passing it earlier is not there).
    fn internal_armed(&self) -> bool {
        matches!(self.resume, Resume::To(Position { ordinal, user: Some(_) }) if ordinal == self.ordinal)
    }

    /// At a new ordinal: the breakpoints and watchpoints go in or out of
    /// the guest where the stretch of a `Resume::To` says so.
    fn rearm(&mut self, m: &Machine) -> Result<(), VmError> {
        let armed = (self.hits_armed(), self.internal_armed());
        if self.breakpoints.armed() != armed {
            self.sync_breakpoints(m);
        }
        if armed.0 != self.watches.armed {
            self.sync_watches(m, true)?;
        }
        Ok(())
    }

    /// Sets how the next run goes (before resuming).
    pub(crate) fn resume(&mut self, m: &mut Machine, how: Resume) -> Result<(), VmError> {
        self.resume = how;
        self.stop = None;
        self.stepping = None;
        self.interrupt.store(false, Ordering::Release);
        self.arm(m)?;
        let internal = match how {
            Resume::To(Position { user: Some(u), .. }) => Some(u.rip),
            _ => None,
        };
        self.breakpoints.set_internal(internal);
        self.lifted = None;
        self.lifted_until_return = false;
        self.sync_breakpoints(m);
        self.sync_watches(m, true)?;
        let user = m.vcpu.sregs()?.cs.selector & 3 == 3;
        let current = self.tasks.current_thread();
        match how {
            Resume::Step(lwpid) if user && current == Some(lwpid) => {
                let mut regs = m.vcpu.regs()?;
                let mut code = [0u8; 2];
                self.read_user(m, &[], regs.rip, &mut code);
                self.step_over_breakpoint(m, &mut regs)?;
                if code == SYSCALL {
                    // A system call: the step ends at the instruction the
                    // kernel returns to (the trap flag would end it one
                    // instruction later).
                    self.stepping = Some(Stepping::AtReturn(lwpid));
                } else if self.lifted.is_none() && self.kernel_step(m, &regs)? {
                    self.stop_here(m, StopKind::Step)?;
                } else {
                    self.trap_step(m, lwpid, regs)?;
                }
            }
            Resume::Step(lwpid) => self.stepping = Some(Stepping::ReturnThenTrap(lwpid)),
            Resume::Enter(lwpid) if user && current == Some(lwpid) => {
                self.stop_here(m, StopKind::Reached)?
            }
            Resume::Enter(lwpid) => self.stepping = Some(Stepping::AtReturn(lwpid)),
            Resume::Continue | Resume::To(_) | Resume::Collect if user && current.is_some() => {
                let mut regs = m.vcpu.regs()?;
                if self.step_over_breakpoint(m, &mut regs)? {
                    regs.rflags |= TF;
                    m.vcpu.set_regs(&regs)?;
                }
            }
            _ => {}
        }
        if let Resume::To(target) = how {
            if target.ordinal < self.ordinal {
                return Err(VmError::Debug(format!(
                    "position at exit {} is behind the replay (exit {})",
                    target.ordinal, self.ordinal
                )));
            }
            if let Some(u) = target.user {
                if target.ordinal == self.ordinal && user && current == Some(u.lwpid) {
                    let regs = m.vcpu.regs()?;
                    if UserPoint::of(u.lwpid, &regs) == u {
                        self.stop_here(m, StopKind::Reached)?;
                    }
                }
            } else if target.ordinal == self.ordinal {
                self.stop_here(m, StopKind::Reached)?;
            }
        }
        self.update_returns(m)
    }

    /// Thread `lwpid`, in user mode with `regs`, runs one instruction
    /// under the trap flag.
    fn trap_step(
        &mut self,
        m: &mut Machine,
        lwpid: u32,
        mut regs: kvm_regs,
    ) -> Result<(), VmError> {
        self.stepping = Some(Stepping::Trap {
            from: UserPoint::of(lwpid, &regs),
            ordinal: self.ordinal,
        });
        regs.rflags |= TF;
        m.vcpu.set_regs(&regs)
    }

    /// Runs the instruction the thread stands at in user mode (`regs`) in
    /// guest kernel mode, where KVM steps it without the guest's debug
    /// exception (`kernel_steps`), if it qualifies: whether it ran (the
    /// vCPU is in user mode after it). Not with watchpoints (a store to a
    /// watched page must go through them) nor in the code a search's
    /// trampoline patches.
    fn kernel_step(&mut self, m: &mut Machine, regs: &kvm_regs) -> Result<bool, VmError> {
        let sregs = m.vcpu.sregs()?;
        let cr3 = sregs.cr3;
        let patched = self.avoid.is_some_and(|(space, start, end)| {
            space == cr3 & CR3_ROOT && regs.rip < end && regs.rip + 16 > start
        });
        if !self.watches.is_empty() || patched {
            return Ok(false);
        }
        let mut bytes = [0u8; instructions::MAX_INSN];
        let n = peek_user(&m.vm.mem, cr3, regs.rip, &mut bytes);
        let Some(insn) = instructions::decode(&bytes[..n], regs.rip).filter(|i| i.len() <= n)
        else {
            return Ok(false);
        };
        let mut factory = iced_x86::InstructionInfoFactory::new();
        match kernel_steps::plan(&m.vm.mem, &sregs, &mut factory, &insn, regs) {
            kernel_steps::Plan::Skip => {
                let mut after = *regs;
                after.rip = insn.next_ip();
                m.vcpu.set_regs(&after)?;
                return Ok(true);
            }
            kernel_steps::Plan::InKernelMode => {}
            kernel_steps::Plan::Trap => return Ok(false),
        }
        let (cs, ss) = match self.traps.kernel_segments {
            Some(segments) => segments,
            None => *self
                .traps
                .kernel_segments
                .insert(frames::kernel_segments(m, &sregs)?),
        };
        let kernel = kvm_bindings::kvm_sregs { cs, ss, ..sregs };
        self.apply_kernel_breakpoints(m, true)?;
        let stubs = m.stub_mappings();
        let stepped = kernel_steps::step(m, regs, &kernel, true, &stubs)?;
        self.apply_kernel_breakpoints(m, false)?;
        Ok(match stepped {
            kernel_steps::Stepped::Ran(after) => {
                m.vcpu.set_registers_in_run(after, sregs);
                true
            }
            kernel_steps::Stepped::Raised | kernel_steps::Stepped::NotEmulated => {
                m.vcpu.set_registers_in_run(*regs, sregs);
                false
            }
        })
    }

    /// If the vCPU stands on one of the breakpoints in user mode, takes
    /// it out for the instruction under it (`regs` are the vCPU's):
    /// whether the trap flag must end that (not for a system call, which
    /// the trap flag would end one instruction late: the breakpoint goes
    /// back at the next return to user mode).
    fn step_over_breakpoint(
        &mut self,
        m: &mut Machine,
        regs: &mut kvm_regs,
    ) -> Result<bool, VmError> {
        let cr3 = m.vcpu.sregs()?.cr3 & CR3_ROOT;
        let Ok(gpa) = introspect::gva::translate_user(&m.vm.mem, cr3, regs.rip) else {
            return Ok(false);
        };
        // Ours (for whichever process it was put in).
        if self.breakpoints.at(gpa).is_none() {
            return Ok(false);
        }
        Ok(self.lift_for_one(m, cr3, regs.rip, gpa))
    }

    /// Takes the breakpoint at `gpa` (at `va` in address space `cr3`) out
    /// for one run of the instruction under it: whether the trap flag must
    /// end that (not for a system call, whose return puts it back).
    fn lift_for_one(&mut self, m: &Machine, cr3: u64, va: u64, gpa: u64) -> bool {
        let mut code = [0u8; 2];
        let n = peek_user(&m.vm.mem, cr3, va, &mut code);
        self.breakpoints.hide(&m.vm.mem, cr3, va, &mut code[..n]);
        self.breakpoints.lift(&m.vm.mem, gpa);
        self.lifted = Some(gpa);
        self.lifted_until_return = code == SYSCALL;
        !self.lifted_until_return
    }

    /// The stop found, if the run is to pause now.
    pub(crate) fn take_stop(&mut self) -> Option<Stop> {
        self.stop.take()
    }

    /// Stops where the replay is: `kind`, with the current thread's
    /// position.
    fn stop_here(&mut self, m: &mut Machine, kind: StopKind) -> Result<(), VmError> {
        let lwpid = self.tasks.current_thread();
        let user = m.vcpu.sregs()?.cs.selector & 3 == 3;
        let position = Position {
            ordinal: self.ordinal,
            user: match (lwpid, user) {
                (Some(l), true) => Some(UserPoint::of(l, &m.vcpu.regs()?)),
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

    /// After every deterministic exit (`entry`, checked), and every
    /// asynchronous point reached (`None`), with the log at `log`: the
    /// ordinal moves on, and what depends on where the tasks are is
    /// looked at.
    pub(crate) fn advanced(
        &mut self,
        m: &mut Machine,
        entry: Option<&Entry>,
        log: &journal::LogPosition,
    ) -> Result<(), VmError> {
        self.ordinal += 1;
        self.at_exit = false;
        self.tasks.follow_switches(&m.vm.mem);
        let sregs = m.vcpu.sregs()?;
        let cr3 = sregs.cr3 & CR3_ROOT;
        let user = sregs.cs.selector & 3 == 3;
        if self.tasks.process.as_ref().is_some_and(|p| p.cr3 == cr3) {
            self.tasks.note_current(
                &m.vm.mem,
                sregs.cr3,
                self.kernel.stack_top_var,
                (sregs.fs.base, sregs.gs.base),
            );
        }
        if !user && entry.is_some_and(is_kernel_entry) {
            self.look_for_exec(m, sregs.cr3)?;
            self.look_for_fork(m, sregs.cr3);
        }
        if self.interrupt.swap(false, Ordering::AcqRel) && self.stop.is_none() {
            self.stop_here(m, StopKind::Interrupted)?;
        }
        if let (Resume::Until(point), Some(_), true) =
            (self.resume, self.tasks.current_thread(), entry.is_some())
        {
            if point.reached(log) && self.stop.is_none() {
                self.stop_here(m, StopKind::Reached)?;
            }
        }
        if let Resume::To(target) = self.resume {
            let here = match (self.tasks.current_thread(), user) {
                (Some(l), true) => Some(UserPoint::of(l, &m.vcpu.regs()?)),
                _ => None,
            };
            if target.ordinal == self.ordinal
                && (target.user.is_none() || target.user == here)
                && self.stop.is_none()
            {
                self.stop_here(m, StopKind::Reached)?;
            } else if target.ordinal < self.ordinal && self.stop.is_none() {
                return Err(VmError::Debug(format!(
                    "the replay passed the position at exit {} without finding it",
                    target.ordinal
                )));
            }
        }
        self.rearm(m)?;
        self.update_returns(m)
    }

    /// A trampoline's patch covers `patched` now (`None`: no more): the
    /// breakpoints stay out of it, and go back in where it was.
    pub(crate) fn patched(&mut self, m: &Machine, patched: Option<(u64, u64, u64)>) {
        self.avoid = patched;
        self.sync_breakpoints(m);
    }

    /// At a system call's entry (the kernel's deterministic point): if
    /// the task executes a program, and it may be the one, its return to
    /// user mode is watched.
    fn look_for_exec(&mut self, m: &mut Machine, cr3: u64) -> Result<(), VmError> {
        if self.tasks.process.is_some() {
            return Ok(());
        }
        let (Some(var), Some((pid, lwpid))) = (self.kernel.stack_top_var, self.tasks.current)
        else {
            return Ok(());
        };
        let Some(call) = exec_call(&m.vm.mem, cr3, var) else {
            return Ok(());
        };
        // A followed process executing a program frees its memory before
        // it returns: its breakpoints come out now, while its page tables
        // are still its own (if the call fails it is no longer followed).
        if self.collecting.is_some() && self.tasks.followed.contains_key(&pid) {
            self.collected_end(m, pid)?;
        }
        if self.selector.matches(pid, &call.path) {
            self.tasks.exec_started(tasks::Exec {
                pid,
                lwpid,
                path: call.path,
                returns_to: call.returns_to,
            });
        }
        Ok(())
    }

    /// At a system call's entry, under a collecting tool: if a thread of a
    /// followed process forks, the returns to user mode are watched for
    /// its child's first.
    fn look_for_fork(&mut self, m: &Machine, cr3: u64) {
        let (Some(_), Some(var), Some((pid, lwpid))) = (
            &self.collecting,
            self.kernel.stack_top_var,
            self.tasks.current,
        ) else {
            return;
        };
        if !self.tasks.followed.contains_key(&pid) {
            return;
        }
        if let Some(returns_to) = fork_call(&m.vm.mem, cr3, var) {
            self.tasks.forks.retain(|f| f.lwpid != lwpid);
            self.tasks.forks.push(tasks::Fork {
                pid,
                lwpid,
                cr3: cr3 & CR3_ROOT,
                returns_to,
                child: None,
                child_seen: false,
            });
        }
    }

    /// A return to user mode of task (pid, lwpid) in the address space
    /// `cr3`, under a collecting tool, with the user registers `user`:
    /// the end of a fork's system call in the parent (with the child's
    /// pid) or in the child (with 0, in its own address space), whose
    /// process is followed from here.
    fn fork_returns(&mut self, pid: u32, lwpid: u32, cr3: u64, user: &kvm_regs) {
        let parent = self
            .tasks
            .forks
            .iter()
            .position(|f| (f.pid, f.lwpid) == (pid, lwpid));
        if let Some(at) = parent {
            let fork = &mut self.tasks.forks[at];
            if user.rip != fork.returns_to || fork.child.is_some() {
                // Another return of the parent (an interrupt's, a fault's).
                return;
            }
            let child = user.rax as i64;
            if child <= 0 || fork.child_seen {
                self.tasks.forks.remove(at);
            } else {
                fork.child = Some(child as u32);
            }
            return;
        }
        if user.rax != 0 || self.tasks.followed.contains_key(&pid) {
            return;
        }
        let child = self.tasks.forks.iter().position(|f| {
            !f.child_seen
                && f.returns_to == user.rip
                && f.cr3 != cr3
                && f.child.is_none_or(|c| c == pid)
        });
        let Some(at) = child else {
            return;
        };
        let fork = &mut self.tasks.forks[at];
        fork.child_seen = true;
        let parent = fork.cr3;
        if fork.child.is_some() {
            self.tasks.forks.remove(at);
        }
        self.follow(pid, cr3);
        if let Some(c) = &mut self.collecting {
            c.changes.push(ProcessChange::Forked { pid, cr3, parent });
        }
    }

    /// The kernel breakpoints as this run needs them.
    fn arm(&mut self, m: &mut Machine) -> Result<(), VmError> {
        if self.traps.handlers.is_none() {
            let sregs = m.vcpu.sregs()?;
            let idt = |v| idt_handler(&m.vm.mem, sregs.cr3, sregs.idt.base, v);
            self.traps.handlers = Some([idt(BREAKPOINT_VECTOR)?, idt(DEBUG_VECTOR)?]);
        }
        self.apply_kernel_breakpoints(m, false)
    }

    fn kernel_breakpoints(&self) -> Vec<u64> {
        let mut at: Vec<u64> = self.traps.handlers.map(|h| h.to_vec()).unwrap_or_default();
        if self.traps.returns_armed {
            at.extend(self.kernel.iret);
            at.extend(self.kernel.sysret);
        }
        at
    }

    fn apply_kernel_breakpoints(
        &mut self,
        m: &mut Machine,
        single_step: bool,
    ) -> Result<(), VmError> {
        let mut at = self.kernel_breakpoints();
        if single_step {
            // The one the vCPU stands on is left out for the step.
            let rip = m.vcpu.synced_regs().rip;
            at.retain(|&a| a != rip);
        }
        set_kernel_breakpoints(m, &at, single_step)
    }

    /// Whether a return to user mode of a thread of the process must be
    /// caught: a program starting, a step that ends there, a breakpoint
    /// waiting for its page, a position to reach in its user code.
    fn returns_needed(&self) -> bool {
        !self.tasks.execs.is_empty()
            || !self.tasks.forks.is_empty()
            || (self.collecting.is_some() && self.breakpoints.pending())
            || matches!(
                self.stepping,
                Some(Stepping::AtReturn(_) | Stepping::ReturnThenTrap(_))
            )
            || (self.tasks.process.is_some()
                && (self.breakpoints.pending() || self.watches.missing))
            || self.kernel_wrote.is_some()
            || self.lifted_until_return
            || matches!(self.resume, Resume::To(Position { ordinal, user: Some(_) }) if ordinal == self.ordinal)
    }

    fn update_returns(&mut self, m: &mut Machine) -> Result<(), VmError> {
        let needed =
            self.returns_needed() && (self.kernel.iret.is_some() || self.kernel.sysret.is_some());
        if needed != self.traps.returns_armed {
            self.traps.returns_armed = needed;
            self.apply_kernel_breakpoints(m, false)?;
        }
        Ok(())
    }

    /// Lets the guest run the kernel instruction a breakpoint stopped at
    /// (it would stop there again): one step without that breakpoint.
    fn pass_kernel_breakpoint(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.traps.stepping_over_kernel = true;
        self.apply_kernel_breakpoints(m, true)
    }

    /// A debug exit: one of the kernel breakpoints, or the end of a step
    /// over one.
    pub(crate) fn debug_exit(
        &mut self,
        m: &mut Machine,
        search: &PointSearch,
    ) -> Result<(), VmError> {
        if std::mem::take(&mut self.traps.stepping_over_kernel) {
            return self.apply_kernel_breakpoints(m, false);
        }
        let rip = m.vcpu.synced_regs().rip;
        let slot = self
            .kernel_breakpoints()
            .iter()
            .position(|&a| a == rip)
            .map(|i| match (i, self.traps.returns_armed) {
                (0, _) => SLOT_BP,
                (1, _) => SLOT_DB,
                (_, true) if Some(rip) == self.kernel.iret => SLOT_IRET,
                _ => SLOT_SYSRET,
            });
        match slot {
            Some(SLOT_BP) => self.on_int3(m),
            Some(SLOT_DB) => self.on_trap_flag(m, search),
            Some(SLOT_IRET) => self.on_return(m, false),
            Some(SLOT_SYSRET) => self.on_return(m, true),
            _ => Err(VmError::Debug(format!(
                "a debug exit at {rip:#x} that no breakpoint explains"
            ))),
        }
    }

    /// The guest's #BP handler is about to run for a user `int3`.
    fn on_int3(&mut self, m: &mut Machine) -> Result<(), VmError> {
        let (regs, sregs) = (m.vcpu.regs()?, m.vcpu.sregs()?);
        let frame = ExceptionFrame::read(&m.vm.mem, sregs.cr3, regs.rsp).map_err(VmError::Debug)?;
        let cr3 = sregs.cr3 & CR3_ROOT;
        let addr = frame.rip.wrapping_sub(1);
        // Ours if it is in the page where one of ours is: another process
        // sharing the page (a library's code) may map it elsewhere.
        let ours = introspect::gva::translate_user(&m.vm.mem, cr3, addr)
            .ok()
            .filter(|_| frame.came_from_user())
            .and_then(|gpa| self.breakpoints.at(gpa).map(|va| (gpa, va)));
        let Some((gpa, va)) = ours else {
            // The program's own int3 (a probe's, say): the guest's.
            return self.pass_kernel_breakpoint(m);
        };
        self.tasks.follow_switches(&m.vm.mem);
        let mut user = frame.user_regs(&regs);
        user.rip = addr;
        let in_process = self.tasks.process.as_ref().is_some_and(|p| p.cr3 == cr3);
        let lwpid = self
            .tasks
            .current_thread()
            .filter(|_| in_process && va == addr);
        // Collecting: a hit of a followed process, or of a child one
        // forked (the same code at the same address).
        let space = (self.resume == Resume::Collect)
            .then(|| (self.breakpoints).space_of_hit(&m.vm.mem, cr3, addr, gpa))
            .flatten();
        if let (Some(space), Some((pid, lwpid)), Some(c)) =
            (space, self.tasks.current, &mut self.collecting)
        {
            c.hits.push(ProbeHit {
                pid,
                lwpid,
                cr3,
                space,
                regs: user,
            });
        }
        let mut stop = None;
        if let Some(lwpid) = lwpid {
            let here = UserPoint::of(lwpid, &user);
            let wanted = self.breakpoints.is_wanted(addr);
            match self.resume {
                Resume::To(target)
                    if target.ordinal == self.ordinal && target.user == Some(here) =>
                {
                    stop = Some(StopKind::Reached)
                }
                Resume::To(_) if wanted => self.hits.push(Hit {
                    kind: HitKind::Breakpoint { addr },
                    position: Position {
                        ordinal: self.ordinal,
                        user: Some(here),
                    },
                }),
                Resume::To(_)
                | Resume::Start
                | Resume::Enter(_)
                | Resume::Until(_)
                | Resume::Collect => {}
                Resume::Continue | Resume::Step(_) if wanted => {
                    stop = Some(StopKind::Breakpoint { addr })
                }
                Resume::Continue | Resume::Step(_) => {}
            }
        }
        if stop.is_none() && self.lift_for_one(m, cr3, addr, gpa) {
            // Not a stop: the instruction under it runs once, alone.
            user.rflags |= TF;
        }
        return_by_iret(m, &frame, user)?;
        if let Some(kind) = stop {
            self.stop_here(m, kind)?;
        }
        Ok(())
    }

    /// The guest's #DB handler is about to run for a user single step.
    fn on_trap_flag(&mut self, m: &mut Machine, search: &PointSearch) -> Result<(), VmError> {
        let (regs, sregs) = (m.vcpu.regs()?, m.vcpu.sregs()?);
        let frame = ExceptionFrame::read(&m.vm.mem, sregs.cr3, regs.rsp).map_err(VmError::Debug)?;
        if !frame.came_from_user() || frame.rflags & TF == 0 {
            return self.pass_kernel_breakpoint(m);
        }
        self.tasks.follow_switches(&m.vm.mem);
        let cr3 = sregs.cr3 & CR3_ROOT;
        if self.lifted.take().is_some() {
            self.sync_breakpoints(m);
        }
        let mut user = frame.user_regs(&regs);
        let lwpid = self.tasks.current_thread();
        let step = match self.stepping {
            Some(Stepping::Trap { from, ordinal }) if Some(from.lwpid) == lwpid => {
                Some((from, ordinal))
            }
            _ => None,
        };
        let stepping = step.is_some();
        // Inside a trampoline that searches for an asynchronous point, the
        // step goes on until the program's next instruction (one the
        // trampoline moved, or the code it returns to).
        let stubs = m.stub_mappings();
        let in_stub = introspect::probe_gate::in_stub_pages(user.rip, &stubs);
        let moved = in_stub
            .then(|| search.moved_instruction(cr3, user.rip))
            .flatten();
        // The copy of the patched instruction itself is where the step
        // over the trampoline's jump arrives: the program has not moved
        // on yet (the jump is not its instruction), so the step goes on.
        let jumped = moved
            .as_ref()
            .is_some_and(|(orig, _)| search.patch_at(cr3) == Some(*orig));
        if stepping && in_stub && (moved.is_none() || jumped) {
            return return_by_iret(m, &frame, user);
        }
        // A step that started where an asynchronous point was recorded ran
        // the trampoline, which found the point: its store left the trap
        // pending at the position, the instruction not run yet (the
        // interrupt the point delivers comes first). The step goes on.
        if let Some((from, _)) = step.filter(|&(from, ordinal)| {
            !in_stub && ordinal != self.ordinal && from == UserPoint::of(from.lwpid, &user)
        }) {
            self.stepping = Some(Stepping::Trap {
                from,
                ordinal: self.ordinal,
            });
            return return_by_iret(m, &frame, user);
        }
        user.rflags &= !TF;
        return_by_iret(m, &frame, user)?;
        if std::mem::take(&mut self.watch_step) {
            self.sync_watches(m, false)?;
            self.look_at_watches(m)?;
        }
        if stepping && self.stop.is_none() {
            self.stepping = None;
            self.stop_here(m, StopKind::Step)?;
            if let (Some(stop), Some((orig, _))) = (&mut self.stop, moved) {
                // The program's own address of the instruction moved.
                if let Some(u) = &mut stop.position.user {
                    u.rip = orig;
                }
            }
        }
        Ok(())
    }

    /// The guest kernel is about to return (`iretq`, or with `sysret`):
    /// to user mode, the VMM completes the return itself and looks at
    /// what waited for it.
    fn on_return(&mut self, m: &mut Machine, sysret: bool) -> Result<(), VmError> {
        // The return completes here, as the CPU would: single-stepping it
        // would not stop before the user instruction on these hosts, and
        // the step would go on in user mode.
        let user = if sysret {
            super::frames::return_by_sysret(m)?
        } else {
            super::frames::return_by_swapgs_iret(m)?
        };
        let sregs = m.vcpu.sregs()?;
        self.tasks.follow_switches(&m.vm.mem);
        let cr3 = sregs.cr3 & CR3_ROOT;
        if std::mem::take(&mut self.lifted_until_return) {
            // The system call under a breakpoint ran: it goes back.
            self.lifted = None;
            self.sync_breakpoints(m);
            self.update_returns(m)?;
        }
        let Some((pid, lwpid)) = self.tasks.current else {
            return Ok(());
        };
        let starting = self.tasks.take_exec(pid, lwpid);
        let in_process = self.tasks.process.as_ref().is_some_and(|p| p.cr3 == cr3);
        if starting.is_none() && !in_process && self.collecting.is_none() {
            return Ok(());
        }
        if self.collecting.is_some() {
            self.fork_returns(pid, lwpid, cr3, &user);
        }
        if let (Some(exec), Some(_)) = (&starting, &self.collecting) {
            if user.rip != exec.returns_to {
                self.collected_start(m, cr3, user.rsp, exec)?;
            }
        } else if let Some(exec) = starting.filter(|_| self.tasks.process.is_none()) {
            if user.rip != exec.returns_to {
                // The program started: its stack holds what the kernel
                // gave it. Another execution under way is not the one.
                self.tasks.execs.clear();
                let auxv = auxv_at_start(&m.vm.mem, cr3, user.rsp).unwrap_or_default();
                self.tasks.process = Some(ProcessInfo {
                    pid,
                    cr3,
                    exe: exec.path,
                    auxv,
                });
                self.tasks.threads.clear();
                self.tasks.threads.entry(lwpid).or_default();
                self.tasks.note_current(
                    &m.vm.mem,
                    sregs.cr3,
                    self.kernel.stack_top_var,
                    (sregs.fs.base, sregs.gs.base),
                );
                if self.resume == Resume::Start {
                    self.stop_here(m, StopKind::Started)?;
                }
            }
        }
        self.sync_breakpoints(m);
        if self.watches.missing {
            self.sync_watches(m, false)?;
        }
        if let Some((_, addr)) = self.kernel_wrote.filter(|&(l, _)| l == lwpid) {
            self.kernel_wrote = None;
            self.watch_hit(m, addr)?;
        }
        if let Resume::To(target) = self.resume {
            // A position right after the kernel: the instruction may
            // fault before a breakpoint there would fire.
            if target.ordinal == self.ordinal
                && target.user == Some(UserPoint::of(lwpid, &user))
                && self.stop.is_none()
            {
                self.stop_here(m, StopKind::Reached)?;
            }
        }
        match self.stepping {
            Some(Stepping::AtReturn(l)) if l == lwpid => {
                self.stepping = None;
                let kind = match self.resume {
                    Resume::Enter(_) => StopKind::Reached,
                    _ => StopKind::Step,
                };
                self.stop_here(m, kind)?;
            }
            Some(Stepping::ReturnThenTrap(l)) if l == lwpid => {
                let mut regs = m.vcpu.regs()?;
                self.step_over_breakpoint(m, &mut regs)?;
                self.trap_step(m, l, regs)?;
            }
            _ => {}
        }
        self.update_returns(m)
    }

    /// A process started a program, at its first instruction (`rsp`: its
    /// stack pointer there), under a collecting tool: a followed process
    /// that executed another program has ended, and the start is told.
    fn collected_start(
        &mut self,
        m: &mut Machine,
        cr3: u64,
        rsp: u64,
        exec: &tasks::Exec,
    ) -> Result<(), VmError> {
        self.collected_end(m, exec.pid)?;
        let auxv = auxv_at_start(&m.vm.mem, cr3, rsp).unwrap_or_default();
        if let Some(c) = &mut self.collecting {
            c.changes.push(ProcessChange::Started(ProcessInfo {
                pid: exec.pid,
                cr3,
                exe: exec.path.clone(),
                auxv,
            }));
        }
        Ok(())
    }

    /// A followed process ended (its last thread exited, or it executes
    /// another program): its breakpoints come out (unless another process
    /// wants them too) and the end is told.
    fn collected_end(&mut self, m: &mut Machine, pid: u32) -> Result<(), VmError> {
        let Some(cr3) = self.unfollow(pid) else {
            return Ok(());
        };
        if let Some(c) = &mut self.collecting {
            c.changes.push(ProcessChange::Ended { cr3 });
        }
        self.sync_breakpoints(m);
        self.update_returns(m)
    }

    /// A kernel event: a thread of the process exited.
    pub(crate) fn thread_exited(
        &mut self,
        m: &mut Machine,
        pid: u32,
        lwpid: u32,
        status: i32,
    ) -> Result<(), VmError> {
        if self.collecting.is_some() {
            // A task that dies executing a program never starts it; a
            // child that dies before it runs is never followed.
            self.tasks.execs.retain(|e| e.lwpid != lwpid);
            (self.tasks.forks).retain(|f| f.lwpid != lwpid && f.child != Some(lwpid));
            self.tasks.follow_switches(&m.vm.mem);
            let Some(followed) = self.tasks.followed.get_mut(&pid) else {
                return self.update_returns(m);
            };
            followed.threads.insert(lwpid, true);
            if followed.threads.values().all(|&exited| exited) {
                self.collected_end(m, pid)?;
            }
            return Ok(());
        }
        if self.tasks.process.as_ref().is_none_or(|p| p.pid != pid) {
            return Ok(());
        }
        self.tasks.threads.entry(lwpid).or_default().exited = true;
        if !self.tasks.live_threads().is_empty() {
            return Ok(());
        }
        if self.stop.is_none() {
            self.stop_here(m, StopKind::ProcessExited { status })?;
        }
        Ok(())
    }

    /// Reads the process's memory at `va` into `buf` as the program would
    /// see it (never a breakpoint's byte); how many bytes could be read.
    /// `replaced`: the bytes an asynchronous point's trampoline replaced.
    pub(crate) fn read_user(
        &self,
        m: &Machine,
        replaced: &[(u64, Vec<u8>)],
        va: u64,
        buf: &mut [u8],
    ) -> usize {
        let Some(cr3) = self.tasks.process.as_ref().map(|p| p.cr3) else {
            return 0;
        };
        let n = peek_user(&m.vm.mem, cr3, va, buf);
        self.breakpoints.hide(&m.vm.mem, cr3, va, &mut buf[..n]);
        if self.avoid.is_some_and(|a| a.0 == cr3) {
            breakpoints::hide_saved(&m.vm.mem, cr3, va, &mut buf[..n], replaced);
        }
        n
    }

    /// Reads the memory of the address space `cr3` (a process the tool
    /// collects hits of) at `va` into `buf` as its program would see it;
    /// how many bytes could be read.
    pub(crate) fn read_in(&self, m: &Machine, cr3: u64, va: u64, buf: &mut [u8]) -> usize {
        let n = peek_user(&m.vm.mem, cr3, va, buf);
        self.breakpoints.hide(&m.vm.mem, cr3, va, &mut buf[..n]);
        n
    }

    /// The user registers of thread `lwpid` as the program sees them: the
    /// vCPU's if it runs user code now, else those its kernel entry
    /// saved; with its FS and GS bases.
    /// In a trampoline searching for an asynchronous point, RIP is the
    /// program's own address of the instruction (`PointSearch::program_rip`).
    pub(crate) fn thread_regs(
        &self,
        m: &Machine,
        search: &PointSearch,
        lwpid: u32,
    ) -> Option<ThreadRegs> {
        let info = self.tasks.threads.get(&lwpid)?;
        let sregs = m.vcpu.sregs().ok()?;
        let on_cpu = self.tasks.current_thread() == Some(lwpid);
        let cr3 = self.tasks.process.as_ref().map_or(sregs.cr3, |p| p.cr3);
        if on_cpu && sregs.cs.selector & 3 == 3 {
            let mut regs = m.vcpu.regs().ok()?;
            regs.rflags &= !(TF | RF);
            regs.rip = search.program_rip(cr3, regs.rip);
            return Some(ThreadRegs {
                regs,
                orig_rax: u64::MAX,
                fs_base: sregs.fs.base,
                gs_base: sregs.gs.base,
                running: true,
            });
        }
        let mut saved = self.tasks.saved_regs(&m.vm.mem, lwpid)?;
        saved.regs.rip = search.program_rip(cr3, saved.regs.rip);
        Some(ThreadRegs {
            regs: saved.regs,
            orig_rax: saved.orig_rax,
            fs_base: info.fs_base,
            gs_base: info.gs_base,
            running: false,
        })
    }

    /// Takes every breakpoint out of guest memory (guest memory exactly
    /// as the guest wrote it).
    pub(crate) fn lift_breakpoints(&mut self, mem: &GuestMemoryMmap) {
        self.breakpoints.lift_all(mem);
    }

    /// Puts the breakpoints the process maps back in place.
    pub(crate) fn sync_breakpoints(&mut self, m: &Machine) {
        let (user, internal) = (self.hits_armed(), self.internal_armed());
        self.breakpoints.set_armed(user, internal);
        let cr3 = self.tasks.process.as_ref().map(|p| p.cr3);
        self.breakpoints.sync(&m.vm.mem, cr3, self.avoid);
        // The one a thread is stepped over stays out until it is.
        if let Some(gpa) = self.lifted {
            self.breakpoints.lift(&m.vm.mem, gpa);
        }
    }

    /// The machine was put back to `snapshot` (breakpoints out): the
    /// tasks as they were then, nothing under way, breakpoints back in.
    pub(crate) fn restored(&mut self, m: &mut Machine, snapshot: &Snapshot) -> Result<(), VmError> {
        self.tasks = snapshot.tasks.clone();
        self.ordinal = snapshot.ordinal;
        self.avoid = None;
        self.stop = None;
        self.stepping = None;
        self.lifted = None;
        self.lifted_until_return = false;
        self.hits.clear();
        self.kernel_wrote = None;
        self.watch_step = false;
        self.sync_watches(m, true)?;
        self.at_exit = true;
        self.snapshot_taken();
        self.sync_breakpoints(m);
        self.update_returns(m)
    }
}

/// A thread's user registers as the debugger shows them.
#[derive(Clone, Copy, Debug)]
pub struct ThreadRegs {
    pub regs: kvm_regs,
    /// The system call it is in (-1: none).
    pub orig_rax: u64,
    pub fs_base: u64,
    pub gs_base: u64,
    /// Whether it is on the vCPU in user mode (its extended state is the
    /// vCPU's).
    pub running: bool,
}
