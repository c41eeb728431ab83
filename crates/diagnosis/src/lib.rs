//! Diagnosis over the events a replay collects: lock contention,
//! potential deadlocks, the function profiler, per-thread summaries.
//! Each tool is a [`plugin::Plugin`]; the built-in ones are in
//! [`plugins`].
//!
//! The analyses work on plain event streams, so they can be built and
//! tested on synthetic streams; the event database feeds them in
//! production.

pub mod contention;
pub mod deadlock;
pub mod flamegraph;
pub mod from_db;
pub mod lock_events;
pub mod plugin;
pub mod plugins;
pub mod profile;
pub mod symbols;
#[cfg(test)]
mod test_db;

/// `part` as a percentage of `whole` (0 when `whole` is).
pub(crate) fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}
