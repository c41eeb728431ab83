//! Devices of the insight virtual machine.
//!
//! The legacy PC platform (8259 PIC pair, 8254 PIT, 16550 serial console,
//! CMOS RTC) and insight's own platform control port. Devices keep no
//! threads and read no host clock: the VMM drives them from the vCPU
//! thread and passes VM time, so the same inputs give the same behaviour.

pub mod cmos;
pub mod control;
pub mod pic;
pub mod pit;
pub mod platform;
pub mod serial;

pub use control::ControlMessage;
pub use platform::{LegacyPlatform, PlatformStats};
