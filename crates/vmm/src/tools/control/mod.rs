//! The process-control engine: guest processes held in a replay, their
//! tasks (`tasks.rs`), breakpoints (`breakpoints.rs`) and watched pages
//! (`watch.rs`).

pub(crate) mod breakpoints;
pub(crate) mod tasks;
pub(crate) mod watch;

pub use tasks::{ProcessInfo, ProcessSelector};
