//! The debugger's hold on a replay: one guest process (its first program
//! execution, found by pid or name), stopped and resumed at positions a
//! later replay reaches again, with breakpoints, watchpoints and single
//! steps in its user code. The process-control engine (`tools::control`)
//! holds the process; this tool decides where a run stops (`stop.rs`),
//! names positions (`position.rs`), and keeps snapshots for going back
//! (`snapshot.rs`); `tool.rs` puts them together.
//!
//! A position is named without any counter: the deterministic exits and
//! asynchronous points replayed (`ordinal`) and, for a thread in user
//! code, its registers there. Reaching one again is replaying to the
//! ordinal, then stopping the thread at that instruction with those
//! registers (the first time after the ordinal: two instants of one
//! thread's run between two exits with the same instruction and the same
//! registers are the same position).

mod position;
pub(crate) mod snapshot;
mod stop;
mod tool;

pub use crate::tools::control::{ThreadRegs, UserPoint};
pub use position::{Hit, HitKind, Position};
pub use snapshot::Snapshot;
pub use stop::{Resume, Stop, StopKind};
pub use tool::DebugTool;
