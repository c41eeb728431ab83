//! The insight virtual machine monitor.
//!
//! Boots a Linux guest on KVM with a user-space interrupt controller and
//! timer, so that every asynchronous input passes through one place (see
//! docs/ARCHITECTURE.md).

pub mod console;
pub mod cpuid;
pub mod host_check;
pub mod host_cpu;
mod kvm_ext;
pub mod snapshot;
mod sys;
pub mod unemulated;
pub mod vm;

pub use vm::{
    CheckpointEvery, CheckpointRestored, CheckpointTaken, ExpansionSpec, ExpansionStats,
    ReplayPoint, RunOutcome, StopReason, TraceTarget, Vm, VmError,
};
