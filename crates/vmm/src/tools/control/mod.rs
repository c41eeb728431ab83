//! The process-control engine: what holds guest processes in a replay for
//! whoever looks into them — the debugger (`tools::debug`), and the
//! probes given at replay (`tools::probes`), each with an engine of its
//! own. As in rr, breakpoints and task control sit below any one user of
//! them.
//!
//! This host's KVM never stops in guest user mode. Breakpoints are `int3`s
//! in a process's code, caught where the guest kernel's #BP handler
//! begins; single steps set the trap flag and are caught where its #DB
//! handler begins (hardware breakpoints fire there, in kernel mode). The
//! VMM then returns the vCPU to user mode itself: the guest kernel never
//! runs for them, and these exits are not the exit clock's. A thread's
//! return to user mode from the kernel is caught the same way at the
//! kernel's `iretq` (and `sysretq`), where the VMM completes the return
//! itself, so that something can happen right before the first
//! instruction after a system call, a page fault or a program's start.
//!
//! The parts: the guest's tasks (`tasks.rs`: who is on the CPU, the
//! process held, the processes followed, a thread's user state),
//! breakpoints (`breakpoints.rs`), watched pages (`watch.rs`), the
//! hardware breakpoints on kernel code (`traps.rs`), the debug exits they
//! cause (`exits.rs`), steps (`stepping.rs`: the trap flag, guest kernel
//! mode, over a breakpoint), programs started, processes forked and ended
//! (`follow.rs`), and the engine that holds them (`engine.rs`: what it
//! is asked between runs and at every exit, user memory and registers as
//! the program sees them).
//!
//! Who decides: the engine reports what happened as it happens, to its
//! [`Supervisor`] — a thread at a breakpoint (its registers), a watched
//! value changed, a step done, a thread back in user mode, a program
//! started, a process forked or ended, the held process's last thread
//! exited — and the supervisor decides what it means: stop there, record
//! a hit on the way to a position (the debugger, `Resume::To`), collect a
//! probe hit (the probes), or let it pass. A trait called back rather than
//! events returned: two verdicts change what the engine does next at the
//! same exit (a thread that passes a breakpoint runs the instruction under
//! it alone; a stop at a watched write ends the step under way), and the
//! supervisor looks at the vCPU where it happened.

pub(crate) mod breakpoints;
mod engine;
mod exits;
mod follow;
mod stepping;
pub(crate) mod tasks;
mod traps;
pub(crate) mod watch;

pub use engine::KernelPoints;
pub(crate) use engine::{Advance, Arming, BreakpointHit, Control, Scope, Supervisor, Verdict};
pub use tasks::{ProcessInfo, ProcessSelector, ThreadRegs, UserPoint};
