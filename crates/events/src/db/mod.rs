//! The event database: an SQLite file a replay writes and the diagnosis
//! tools (or `sqlite3`) read. Schema version 5, documented in
//! docs/events.md; a change to it bumps [`SCHEMA_VERSION`].
//!
//! Events are stored in one of two formats, named by the `events_format`
//! meta key: `packed` (the default: blocks of compressed column streams,
//! a few bytes per event, see [`crate::packed`]) or `rows` (one row of the
//! `events` table per event, for SQL queries, about 37 bytes per event).
//! Readers take both, and version 1 and 2 databases. Version 3 adds the
//! checksums of [`digest`]: every block's, and every table's. Version 4
//! adds the probes given at replay (`probes`) and the values their hits
//! captured (`probe_values`). Version 5 adds the kinds of the condition
//! variables', barriers', read-write locks' and semaphores' events
//! (CONDWAIT .. SEMPOST) to `kinds`, whose rows an older insight cannot
//! read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::abi::{Kind, Source};
use crate::packed::PackedEvent;

pub mod digest;
mod reader;
#[cfg(test)]
mod tests;
mod writer;

pub use reader::EventDb;
pub use writer::EventWriter;

/// `PRAGMA user_version` of the databases this insight writes.
pub const SCHEMA_VERSION: i64 = 5;
/// Older versions this insight still reads (without checksums).
const READABLE_VERSIONS: [i64; 5] = [1, 2, 3, 4, 5];
/// `PRAGMA application_id`: "INSG".
pub const APPLICATION_ID: i64 = 0x494e_5347;

/// Rows per transaction while writing.
const BATCH: u64 = 20_000;

const SCHEMA: &str = "
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE kinds(kind INTEGER PRIMARY KEY, name TEXT NOT NULL);
CREATE TABLE events(
    seq INTEGER PRIMARY KEY,
    time INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    source INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    lwpid INTEGER NOT NULL,
    addr INTEGER,
    caller INTEGER,
    value INTEGER
);
CREATE TABLE threads(
    lwpid INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    comm TEXT NOT NULL,
    first_seq INTEGER NOT NULL,
    PRIMARY KEY(lwpid, pid)
) WITHOUT ROWID;
CREATE TABLE objects(
    pid INTEGER NOT NULL,
    base INTEGER NOT NULL,
    path TEXT NOT NULL,
    seq INTEGER NOT NULL
);
CREATE TABLE event_blocks(
    first_seq INTEGER PRIMARY KEY,
    count INTEGER NOT NULL,
    first_time INTEGER NOT NULL,
    last_time INTEGER NOT NULL,
    data BLOB NOT NULL,
    crc32 INTEGER NOT NULL
);
CREATE TABLE stacks(seq INTEGER PRIMARY KEY, frames BLOB NOT NULL);
CREATE TABLE anomalies(what TEXT PRIMARY KEY, count INTEGER NOT NULL, example TEXT);
CREATE TABLE probes(id INTEGER PRIMARY KEY, spec TEXT NOT NULL, captures TEXT NOT NULL);
CREATE TABLE probe_values(
    seq INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    value INTEGER,
    bytes BLOB,
    PRIMARY KEY(seq, slot)
) WITHOUT ROWID;
CREATE VIEW named_events AS
    SELECT e.seq, e.time, k.name AS kind,
        CASE e.source WHEN 0 THEN 'probe' WHEN 1 THEN 'kernel' ELSE 'host' END AS source,
        e.pid, e.lwpid, e.addr, e.caller, e.value
    FROM events e JOIN kinds k USING(kind);
";

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("{path}")]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("{0}: not an insight event database (no such file, or another kind of file)")]
    Foreign(PathBuf),
    #[error("{path}: event database schema version {found}; this insight reads versions 1 to {SCHEMA_VERSION}")]
    Version { path: PathBuf, found: i64 },
    #[error("{path}: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("{0}: cannot replace it: {1}")]
    Rename(PathBuf, #[source] std::io::Error),
    #[error("{0}")]
    Io(PathBuf, #[source] std::io::Error),
    /// The file system has no room for more (SQLite's SQLITE_FULL).
    #[error("{0}: disk full (no space left on its file system)")]
    DiskFull(PathBuf),
    /// A request the database cannot honour (a bug in its caller).
    #[error("{0}")]
    Invalid(String),
}

/// One event as stored. Column meanings per kind are in docs/events.md.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub seq: u64,
    /// Nanoseconds since the VM started, as the recording saw them.
    pub time: u64,
    pub kind: Kind,
    pub source: Source,
    pub pid: u32,
    pub lwpid: u32,
    pub addr: Option<u64>,
    pub caller: Option<u64>,
    pub value: Option<i64>,
}

impl Row {
    /// The event as a packed block holds it (a sample's stack aside).
    fn packed(&self) -> PackedEvent {
        PackedEvent {
            time: self.time,
            kind: self.kind,
            source: self.source,
            pid: self.pid,
            lwpid: self.lwpid,
            addr: self.addr,
            caller: self.caller,
            value: self.value,
            stack: None,
        }
    }

    fn unpacked(seq: u64, e: &PackedEvent) -> Row {
        Row {
            seq,
            time: e.time,
            kind: e.kind,
            source: e.source,
            pid: e.pid,
            lwpid: e.lwpid,
            addr: e.addr,
            caller: e.caller,
            value: e.value,
        }
    }
}

/// A probe given at replay, as the database keeps it: its number (the
/// `value` of its PROBE and PROBE_RET events), the spec's text, and the
/// names of the values each hit captured, by slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeRow {
    pub id: u32,
    pub spec: String,
    pub captures: Vec<String>,
}

/// A value a probe's hit captured: an integer, or bytes (memory, a
/// string).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeValue {
    Int(i64),
    Bytes(Vec<u8>),
}

/// How events are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventFormat {
    /// Compressed blocks: small (a few bytes per event).
    #[default]
    Packed,
    /// One SQL row per event: for queries with `sqlite3` and the like.
    Rows,
}

impl EventFormat {
    pub fn name(self) -> &'static str {
        match self {
            EventFormat::Packed => "packed",
            EventFormat::Rows => "rows",
        }
    }
}

fn sql(path: &Path) -> impl Fn(rusqlite::Error) -> DbError + '_ {
    move |source| match source.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DiskFull) => DbError::DiskFull(path.to_owned()),
        _ => DbError::Sqlite {
            path: path.to_owned(),
            source,
        },
    }
}
