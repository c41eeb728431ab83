//! Sessions: a machine driven by one kind of run. A plain run
//! ([`LiveRun`]) delivers interrupts when they are due; a recording
//! ([`RecordSession`]) delivers them only at deterministic points and logs
//! where; a replay ([`ReplaySession`]) delivers them where the log says
//! and checks every exit, with the replay-time tools (`crate::tools`)
//! attached. All three share one vCPU loop (`run.rs`); what differs is
//! their [`Mode`], whose hooks the loop calls at fixed places.
//!
//! Threads: the vCPU runs on its own thread and owns every device; the
//! calling thread only kicks it (a signal) when something is due while the
//! guest runs without exiting.

mod debug;
mod hang_clock;
mod host_files;
mod inputs;
mod live;
mod mode;
mod outcome;
mod record;
mod replay;
mod run;
mod threads;

pub use debug::{DebugDriver, DebugEvent, Interrupter};
pub use live::LiveRun;
pub use mode::ProgressFn;
pub use outcome::{NetReport, RunOutcome, StopReason};
pub use record::RecordSession;
pub use replay::ReplaySession;
