//! The insight virtual machine monitor.
//!
//! Boots a Linux guest on KVM with a user-space interrupt controller and
//! timer, so that every asynchronous input passes through one place (see
//! docs/ARCHITECTURE.md).

pub mod boot;
pub mod branch_clock;
pub mod config;
pub mod console;
pub mod cpuid;
pub mod expand;
pub mod guest;
pub mod guest_events;
pub mod gva;
pub mod host_check;
pub mod host_cpu;
pub mod image;
pub mod initramfs;
pub mod journal;
mod kvm_ext;
pub mod preempt;
pub mod probe_gate;
pub mod snapshot;
mod sys;
pub mod unemulated;
pub mod vm;
pub mod xstate;

pub use config::VmConfig;
pub use vm::{
    CheckpointEvery, CheckpointRestored, CheckpointTaken, ExpansionSpec, ExpansionStats,
    ReplayPoint, RunOutcome, StopReason, TraceTarget, Vm, VmError, VmSpec,
};
