//! What the guest is: the VM config, the built guest image and the kernel
//! command line, the run's archive that `/init` fetches, and the boot
//! protocol that puts the kernel and initramfs into guest memory. Nothing
//! here touches KVM: the VMM (`vmm`) boots what [`VmSpec`] describes.

pub mod boot;
pub mod config;
pub mod host_program;
pub mod image;
pub mod initramfs;
pub mod spec;

pub use config::VmConfig;
pub use spec::{
    command_env, delivered_archive, from_trace, prepare, sha256_hex, trace_images, with_archive,
    BootOptions, CommandStreams, DiskImage, GuestError, NetSpec, Start, StreamKind, VmSpec,
    DEFAULT_PATH, IMAGE_PROGRAMS, PROBE_LIBRARY,
};
