//! The insight virtual machine monitor.
//!
//! Boots a Linux guest on KVM with a user-space interrupt controller and
//! timer, so that every asynchronous input passes through one place (see
//! docs/ARCHITECTURE.md). The machine (`vm`: the VM, its vCPU and the exit
//! dispatch) is driven by a session (`session`): a plain run, a recording
//! or a replay; a replay carries the tools that look into it (`tools`).
//! `builder` turns plain options into a session.

pub mod boot_snapshot;
pub mod builder;
pub mod console;
pub mod cpuid;
pub mod host_check;
pub mod host_cpu;
mod kvm_ext;
mod points;
pub mod session;
pub mod snapshot_cache;
mod sys;
pub mod tools;
pub mod unemulated;
pub mod vm;

pub use journal::ReplayPoint;
pub use points::{
    chaos_settings, ChaosPoint, ChaosStats, Decision, ForcedDecisions, ForcedTick, PointCounts,
    PointKind, PointStats, SampleStats, Schedule, ScheduleEdits, ScheduleError, TickAt,
};
pub use session::{
    LiveRun, NetReport, ProgressFn, RecordSession, ReplaySession, RunOutcome, StopReason,
};
pub use sys::{catch_interrupts, end_with_parent, interrupted, release_interrupts};
pub use tools::{
    checkpoint_before, checkpoint_unfit, CheckpointEvery, CheckpointRestored, CheckpointTaken,
    ExpansionSpec, ExpansionStats, TraceStart, TraceTarget,
};
pub use vm::{Machine, VmError};
