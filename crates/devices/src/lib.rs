//! Devices of the insight virtual machine.
//!
//! The legacy PC platform (8259 PIC pair, 8254 PIT, 16550 serial console,
//! CMOS RTC), insight's own platform control port, and virtio block,
//! network, console and 9P devices (the host's files, read-only). Devices read no host clock: the VMM drives them from
//! the vCPU thread and passes VM time, so the same inputs give the same
//! behaviour. The block device's I/O thread touches only the disk files,
//! the network device's reader only its TAP device; what they produce
//! reaches the guest when the VMM publishes it.

pub mod cmos;
pub mod control;
pub mod cow_disk;
pub mod doorbell;
pub mod host_files;
pub mod no_rdtsc;
pub mod p9;
pub mod pic;
pub mod pit;
pub mod platform;
pub mod serial;
pub mod tap;
pub mod virtio_9p;
pub mod virtio_blk;
pub mod virtio_console;
pub mod virtio_mmio;
pub mod virtio_net;

pub use control::ControlMessage;
pub use platform::{LegacyPlatform, PlatformStats};
