//! The guest's files and what insight reads in them: the archives its
//! initramfs is made of, the ELF files among them, and the names of guest
//! addresses (functions, variables, source lines) their symbol tables and
//! DWARF give.
//!
//! Named for what it holds, the guest's files as insight reads them,
//! rather than for one use of them: booting, bringing host programs in,
//! unwinding, symbolizing and debugging all read them here, and nothing
//! here knows of events, traces or KVM. Everything in the files is
//! untrusted: a malformed archive or ELF file yields fewer files, no
//! symbols or an error naming the cause, never a panic.

pub mod archive;
pub mod elf;
pub mod guest_files;
pub mod kernel;
pub mod newc;
pub mod symbolizer;
pub mod symbols;

pub use archive::ArchiveFiles;
pub use guest_files::{GuestFiles, IMAGE_PROGRAMS};
pub use symbolizer::{CodeLocation, Symbolizer, KERNEL};
pub use symbols::ElfSymbols;
