//! Probes given at replay (`insight replay --probe`, docs/probes.md):
//! breakpoints a process-control engine of their own (`tools::control`)
//! puts in the code of the processes they go into, whose hits become
//! PROBE and PROBE_RET events with the values each probe captures.
//! Nothing of this exists while recording: the replay alone pays, two
//! exits a hit (the `int3`, and the step over the instruction under it).
//!
//! The parts: the plan (`plan.rs`), the tool with its engine
//! (`tool.rs`), the processes the probes go into and their calls under
//! way (`state.rs`), the values a probe captures and its condition
//! (`values.rs`), and a process's program and libraries as its dynamic
//! linker finds them (`loaded.rs`).
//!
//! A `return` probe also stops at the function's entry, where it takes
//! the arguments and puts a breakpoint at the return address; the return
//! is that thread's arrival there with the stack pointer just above the
//! entry's (so that recursion and other threads passing the same address
//! are told apart). A call left by `longjmp` or an exception is dropped
//! when the thread returns to an outer frame.

pub(crate) mod loaded;
mod plan;
mod state;
mod tool;
mod values;

pub use plan::{probe_rows, PlannedProbe, ProbePlan, DURATION};
pub(crate) use tool::ProbeTool;
