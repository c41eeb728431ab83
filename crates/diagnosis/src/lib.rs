//! Diagnosis over the events a replay collects: lock contention,
//! potential deadlocks, the function profiler.
//!
//! The analyses work on plain event streams, so they can be built and
//! tested on synthetic streams; the event database feeds them in
//! production.

pub mod contention;
pub mod deadlock;
pub mod from_db;
pub mod lock_events;
pub mod profile;
pub mod symbols;
