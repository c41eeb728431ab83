//! Diagnosis over the events a replay collects: lock contention,
//! potential deadlocks, the function profiler, per-thread summaries.
//! Each tool is a [`plugin::Plugin`]; the built-in ones are in
//! [`plugins`].
//!
//! The analyses work on plain event streams, so they can be built and
//! tested on synthetic streams; the event database feeds them in
//! production.

pub mod event_stacks;
pub mod from_db;
pub mod lock_events;
pub mod plugin;
pub mod plugins;
pub mod render;
#[cfg(test)]
mod test_db;

/// A comment every flame graph insight writes carries, by which insight
/// knows the file as its own before replacing it.
pub const FLAME_GRAPH_MARK: &str = "<!-- flame graph written by insight -->";
/// The same for the page heat maps of `report memory --svg`.
pub const HEAT_MAP_MARK: &str = "<!-- memory heat map written by insight -->";
/// How every timeline insight writes (Trace Event Format JSON) starts.
pub const TIMELINE_MARK: &str = "{\"otherData\":{\"generator\":\"insight report timeline\"";
