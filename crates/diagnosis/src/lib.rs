//! Diagnosis over the events a replay collects.
//!
//! The analyses work on plain event streams, so they can be built and
//! tested on synthetic streams; the event database feeds them in
//! production.

pub mod contention;
pub mod deadlock;
pub mod from_db;
pub mod lock_events;
