//! The event database: an SQLite file a replay writes and the diagnosis
//! tools (or `sqlite3`) read. Schema version 2, documented in
//! docs/events.md; a change to it bumps [`SCHEMA_VERSION`].
//!
//! Events are stored in one of two formats, named by the `events_format`
//! meta key: `packed` (the default: blocks of compressed column streams,
//! a few bytes per event, see [`crate::packed`]) or `rows` (one row of the
//! `events` table per event, for SQL queries, about 37 bytes per event).
//! Readers take both, and version 1 databases (rows).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OpenFlags};

use crate::abi::{Kind, Source};
use crate::packed::{self, PackedEvent, BLOCK_EVENTS};

/// `PRAGMA user_version` of the databases this insight writes.
pub const SCHEMA_VERSION: i64 = 2;
/// Older versions this insight still reads.
const READABLE_VERSIONS: [i64; 2] = [1, 2];
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
    data BLOB NOT NULL
);
CREATE TABLE stacks(seq INTEGER PRIMARY KEY, frames BLOB NOT NULL);
CREATE TABLE anomalies(what TEXT PRIMARY KEY, count INTEGER NOT NULL, example TEXT);
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

/// Writes a database: into `PATH.partial`, renamed over `PATH` by
/// [`EventWriter::finish`], so a reader never sees half a database; if
/// the writer is dropped without finishing, the partial file stays with
/// every committed batch.
pub struct EventWriter {
    conn: Connection,
    partial: PathBuf,
    path: PathBuf,
    format: EventFormat,
    next_seq: u64,
    in_batch: u64,
    /// Packed: the block being filled, from sequence number `block_seq`.
    block: Vec<PackedEvent>,
    block_seq: u64,
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
    move |source| DbError::Sqlite {
        path: path.to_owned(),
        source,
    }
}

impl EventWriter {
    /// Where a database for `path` is written until it is finished
    /// (replaced when a writer starts).
    pub fn partial_path(path: &Path) -> PathBuf {
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        PathBuf::from(partial)
    }

    /// A packed database.
    pub fn create(path: &Path, meta: &[(&str, String)]) -> Result<Self, DbError> {
        Self::create_with(path, meta, EventFormat::Packed)
    }

    pub fn create_with(
        path: &Path,
        meta: &[(&str, String)],
        format: EventFormat,
    ) -> Result<Self, DbError> {
        let partial = Self::partial_path(path);
        let _ = std::fs::remove_file(&partial);
        let conn = Connection::open(&partial).map_err(sql(&partial))?;
        conn.execute_batch(&format!(
            "PRAGMA application_id = {APPLICATION_ID};
             PRAGMA user_version = {SCHEMA_VERSION};
             PRAGMA journal_mode = OFF;
             PRAGMA synchronous = OFF;
             BEGIN;
             {SCHEMA}"
        ))
        .map_err(sql(&partial))?;
        for kind in Kind::ALL {
            conn.execute(
                "INSERT INTO kinds VALUES (?1, ?2)",
                params![kind as u16, kind.name()],
            )
            .map_err(sql(&partial))?;
        }
        let mut w = EventWriter {
            conn,
            partial,
            path: path.to_owned(),
            format,
            next_seq: 1,
            in_batch: 0,
            block: Vec::new(),
            block_seq: 1,
        };
        w.set_meta("events_format", format.name())?;
        for (k, v) in meta {
            w.set_meta(k, v)?;
        }
        Ok(w)
    }

    pub fn set_meta(&mut self, key: &str, value: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                "INSERT OR REPLACE INTO meta VALUES (?1, ?2)",
                params![key, value],
            )
            .map_err(sql(&self.partial))?;
        Ok(())
    }

    fn commit_if_due(&mut self) -> Result<(), DbError> {
        self.in_batch += 1;
        if self.in_batch >= BATCH {
            self.in_batch = 0;
            self.conn
                .execute_batch("COMMIT; BEGIN;")
                .map_err(sql(&self.partial))?;
        }
        Ok(())
    }

    /// Appends an event (its `seq` is ignored); returns its sequence
    /// number.
    pub fn push(&mut self, e: &Row) -> Result<u64, DbError> {
        let seq = self.next_seq;
        if self.format == EventFormat::Packed {
            if self.block.len() >= BLOCK_EVENTS {
                self.flush_block()?;
            }
            if self.block.is_empty() {
                self.block_seq = seq;
            }
            self.block.push(e.packed());
            self.next_seq += 1;
            return Ok(seq);
        }
        self.conn
            .prepare_cached("INSERT INTO events VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)")
            .and_then(|mut s| {
                s.execute(params![
                    seq,
                    e.time as i64,
                    e.kind as u16,
                    e.source as u8,
                    e.pid,
                    e.lwpid,
                    e.addr.map(|a| a as i64),
                    e.caller.map(|a| a as i64),
                    e.value
                ])
            })
            .map_err(sql(&self.partial))?;
        self.next_seq += 1;
        self.commit_if_due()?;
        Ok(seq)
    }

    /// Writes the block being filled, and commits.
    fn flush_block(&mut self) -> Result<(), DbError> {
        let (Some(first), Some(last)) = (self.block.first(), self.block.last()) else {
            return Ok(());
        };
        let (first_time, last_time) = (first.time, last.time);
        let data = packed::encode(&self.block);
        self.conn
            .prepare_cached("INSERT INTO event_blocks VALUES (?1, ?2, ?3, ?4, ?5)")
            .and_then(|mut s| {
                s.execute(params![
                    self.block_seq as i64,
                    self.block.len() as i64,
                    first_time as i64,
                    last_time as i64,
                    data
                ])
            })
            .map_err(sql(&self.partial))?;
        self.block.clear();
        self.conn
            .execute_batch("COMMIT; BEGIN;")
            .map_err(sql(&self.partial))
    }

    /// Notes a thread's name the first time it is seen.
    pub fn thread(&mut self, pid: u32, lwpid: u32, comm: &str, seq: u64) -> Result<(), DbError> {
        self.conn
            .prepare_cached("INSERT OR IGNORE INTO threads VALUES (?1, ?2, ?3, ?4)")
            .and_then(|mut s| s.execute(params![lwpid, pid, comm, seq]))
            .map_err(sql(&self.partial))?;
        Ok(())
    }

    /// A loaded object of process `pid` (a SYMBOL event).
    pub fn object(&mut self, pid: u32, base: u64, path: &str, seq: u64) -> Result<(), DbError> {
        self.conn
            .prepare_cached("INSERT INTO objects VALUES (?1, ?2, ?3, ?4)")
            .and_then(|mut s| s.execute(params![pid, base as i64, path, seq]))
            .map_err(sql(&self.partial))?;
        Ok(())
    }

    /// The user stack of SAMPLE `seq`: return addresses, innermost first;
    /// the innermost [`packed::MAX_FRAMES`] are kept.
    pub fn stack(&mut self, seq: u64, frames: &[u64]) -> Result<(), DbError> {
        let frames = &frames[..frames.len().min(packed::MAX_FRAMES)];
        if self.format == EventFormat::Packed {
            let pending = seq
                .checked_sub(self.block_seq)
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| self.block.get_mut(i));
            if let Some(e) = pending {
                e.stack = Some(frames.to_vec());
                return Ok(());
            }
        }
        // Rows, or an event already written: the stacks table.
        let blob: Vec<u8> = frames.iter().flat_map(|f| f.to_le_bytes()).collect();
        self.conn
            .prepare_cached("INSERT INTO stacks VALUES (?1, ?2)")
            .and_then(|mut s| s.execute(params![seq, blob]))
            .map_err(sql(&self.partial))?;
        Ok(())
    }

    /// Stores the anomaly counters (what was wrong, how often, an example).
    pub fn anomalies(&mut self, counts: &[(String, u64, String)]) -> Result<(), DbError> {
        for (what, n, example) in counts {
            self.conn
                .execute(
                    "INSERT OR REPLACE INTO anomalies VALUES (?1, ?2, ?3)",
                    params![what, *n as i64, example],
                )
                .map_err(sql(&self.partial))?;
        }
        Ok(())
    }

    pub fn format(&self) -> EventFormat {
        self.format
    }

    pub fn events_written(&self) -> u64 {
        self.next_seq - 1
    }

    /// Commits and moves the database to its final name.
    pub fn finish(mut self) -> Result<PathBuf, DbError> {
        self.flush_block()?;
        self.conn
            .execute_batch("COMMIT;")
            .map_err(sql(&self.partial))?;
        let (partial, path) = (self.partial.clone(), self.path.clone());
        drop(self);
        std::fs::rename(&partial, &path).map_err(|e| DbError::Rename(path.clone(), e))?;
        Ok(path)
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        // Keep what was written: an unfinished writer still commits.
        let _ = self.flush_block();
        let _ = self.conn.execute_batch("COMMIT;");
    }
}

/// An open event database.
pub struct EventDb {
    conn: Connection,
    path: PathBuf,
    format: EventFormat,
}

impl EventDb {
    pub fn open(path: &Path) -> Result<Self, DbError> {
        if !path.is_file() {
            return Err(DbError::Foreign(path.to_owned()));
        }
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(sql(path))?;
        let app: i64 = conn
            .query_row("PRAGMA application_id", [], |r| r.get(0))
            .map_err(|e| match e.sqlite_error_code() {
                Some(rusqlite::ErrorCode::NotADatabase) => DbError::Foreign(path.to_owned()),
                _ => sql(path)(e),
            })?;
        if app != APPLICATION_ID {
            return Err(DbError::Foreign(path.to_owned()));
        }
        let found: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(sql(path))?;
        if !READABLE_VERSIONS.contains(&found) {
            return Err(DbError::Version {
                path: path.to_owned(),
                found,
            });
        }
        let mut db = EventDb {
            conn,
            path: path.to_owned(),
            format: EventFormat::Rows,
        };
        db.format = match db.meta("events_format")?.as_deref() {
            None | Some("rows") => EventFormat::Rows,
            Some("packed") => EventFormat::Packed,
            Some(other) => {
                return Err(DbError::Corrupt {
                    path: path.to_owned(),
                    what: format!("unknown events format '{other}'"),
                })
            }
        };
        Ok(db)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn format(&self) -> EventFormat {
        self.format
    }

    /// Calls `f` for every event of a packed database with its sequence
    /// number, block by block in sequence order.
    fn for_each_packed(
        &self,
        mut f: impl FnMut(u64, PackedEvent) -> Result<(), DbError>,
    ) -> Result<(), DbError> {
        let mut stmt = self
            .conn
            .prepare("SELECT first_seq, count, data FROM event_blocks ORDER BY first_seq")
            .map_err(sql(&self.path))?;
        let mut rows = stmt.query([]).map_err(sql(&self.path))?;
        let mut next = 1u64;
        while let Some(r) = rows.next().map_err(sql(&self.path))? {
            let first: i64 = r.get(0).map_err(sql(&self.path))?;
            let count: i64 = r.get(1).map_err(sql(&self.path))?;
            let corrupt = |what: String| DbError::Corrupt {
                path: self.path.clone(),
                what: format!("event block {first}: {what}"),
            };
            if first as u64 != next {
                return Err(corrupt(format!("expected it to start at event {next}")));
            }
            let count = usize::try_from(count).map_err(|_| corrupt(format!("{count} events")))?;
            let data = r.get_ref(2).map_err(sql(&self.path))?;
            let blob = data
                .as_blob()
                .map_err(|_| corrupt("data is not a blob".into()))?;
            let events = packed::decode(blob, count).map_err(corrupt)?;
            for (i, e) in events.into_iter().enumerate() {
                f(first as u64 + i as u64, e)?;
            }
            next = first as u64 + count as u64;
        }
        // Blocks lost at the end would otherwise go unnoticed.
        if let Some(recorded) = self.meta("events")? {
            if recorded.parse::<u64>().ok() != Some(next - 1) {
                return Err(DbError::Corrupt {
                    path: self.path.clone(),
                    what: format!(
                        "its blocks hold {} events, its meta table says {recorded}",
                        next - 1
                    ),
                });
            }
        }
        Ok(())
    }

    pub fn meta(&self, key: &str) -> Result<Option<String>, DbError> {
        use rusqlite::OptionalExtension;
        self.conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
            .map_err(sql(&self.path))
    }

    /// Calls `f` for every event of the given kinds (all if empty), in
    /// sequence order. A row this version cannot interpret is an error
    /// that names it.
    pub fn for_each(
        &self,
        kinds: &[Kind],
        mut f: impl FnMut(Row) -> Result<(), DbError>,
    ) -> Result<(), DbError> {
        if self.format == EventFormat::Packed {
            return self.for_each_packed(|seq, e| {
                if !kinds.is_empty() && !kinds.contains(&e.kind) {
                    return Ok(());
                }
                f(Row::unpacked(seq, &e))
            });
        }
        let filter = if kinds.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = kinds.iter().map(|k| (*k as u16).to_string()).collect();
            format!("WHERE kind IN ({})", list.join(","))
        };
        let mut stmt = self
            .conn
            .prepare(&format!(
                "SELECT seq, time, kind, source, pid, lwpid, addr, caller, value FROM events {filter} ORDER BY seq"
            ))
            .map_err(sql(&self.path))?;
        let mut rows = stmt.query([]).map_err(sql(&self.path))?;
        while let Some(r) = rows.next().map_err(sql(&self.path))? {
            let seq: i64 = r.get(0).map_err(sql(&self.path))?;
            let raw_kind: i64 = r.get(2).map_err(sql(&self.path))?;
            let kind = u16::try_from(raw_kind)
                .ok()
                .and_then(Kind::from_u16)
                .ok_or_else(|| DbError::Corrupt {
                    path: self.path.clone(),
                    what: format!("event {seq} has unknown kind {raw_kind}"),
                })?;
            let get_u32 = |i: usize| -> Result<u32, DbError> {
                let v: i64 = r.get(i).map_err(sql(&self.path))?;
                u32::try_from(v).map_err(|_| DbError::Corrupt {
                    path: self.path.clone(),
                    what: format!("event {seq}: column {i} is {v}, not a thread or process id"),
                })
            };
            let opt = |i: usize| -> Result<Option<i64>, DbError> {
                r.get::<_, Option<i64>>(i).map_err(sql(&self.path))
            };
            let time: i64 = r.get(1).map_err(sql(&self.path))?;
            let raw_source: i64 = r.get(3).map_err(sql(&self.path))?;
            let source = u8::try_from(raw_source)
                .ok()
                .and_then(Source::from_u8)
                .ok_or_else(|| DbError::Corrupt {
                    path: self.path.clone(),
                    what: format!("event {seq} has unknown source {raw_source}"),
                })?;
            f(Row {
                seq: seq as u64,
                time: time as u64,
                kind,
                source,
                pid: get_u32(4)?,
                lwpid: get_u32(5)?,
                addr: opt(6)?.map(|v| v as u64),
                caller: opt(7)?.map(|v| v as u64),
                value: opt(8)?,
            })?;
        }
        Ok(())
    }

    /// The loaded objects of `pid`: (base, path).
    pub fn objects(&self, pid: u32) -> Result<Vec<(u64, String)>, DbError> {
        let mut stmt = self
            .conn
            .prepare("SELECT base, path FROM objects WHERE pid = ?1 ORDER BY seq")
            .map_err(sql(&self.path))?;
        let rows = stmt
            .query_map([pid], |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?)))
            .map_err(sql(&self.path))?;
        rows.collect::<Result<_, _>>().map_err(sql(&self.path))
    }

    /// Every object path any process loaded (SYMBOL events), once each.
    pub fn object_paths(&self) -> Result<Vec<String>, DbError> {
        let mut stmt = self
            .conn
            .prepare("SELECT DISTINCT path FROM objects ORDER BY path")
            .map_err(sql(&self.path))?;
        let rows = stmt.query_map([], |r| r.get(0)).map_err(sql(&self.path))?;
        rows.collect::<Result<_, _>>().map_err(sql(&self.path))
    }

    /// Thread names: (pid, lwpid, comm).
    pub fn threads(&self) -> Result<Vec<(u32, u32, String)>, DbError> {
        let mut stmt = self
            .conn
            .prepare("SELECT pid, lwpid, comm FROM threads ORDER BY first_seq")
            .map_err(sql(&self.path))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .map_err(sql(&self.path))?;
        rows.collect::<Result<_, _>>().map_err(sql(&self.path))
    }

    /// The stacks of SAMPLE events: seq -> return addresses, innermost
    /// first. A blob that is not a whole number of addresses, or of more
    /// than [`packed::MAX_FRAMES`], is an error.
    pub fn stacks(&self) -> Result<HashMap<u64, Vec<u64>>, DbError> {
        let mut out = self.stacks_table()?;
        if self.format == EventFormat::Packed {
            self.for_each_packed(|seq, e| {
                if let Some(stack) = e.stack {
                    out.insert(seq, stack);
                }
                Ok(())
            })?;
        }
        Ok(out)
    }

    /// Like [`Self::for_each`], with each event's stack (SAMPLE events),
    /// in the same single pass over the events.
    pub fn for_each_with_stacks(
        &self,
        kinds: &[Kind],
        mut f: impl FnMut(Row, Option<&[u64]>) -> Result<(), DbError>,
    ) -> Result<(), DbError> {
        let table = self.stacks_table()?;
        let stored = |seq: u64| table.get(&seq).map(Vec::as_slice);
        if self.format == EventFormat::Packed {
            return self.for_each_packed(|seq, e| {
                if !kinds.is_empty() && !kinds.contains(&e.kind) {
                    return Ok(());
                }
                let stack = e.stack.as_deref().or_else(|| stored(seq));
                f(Row::unpacked(seq, &e), stack)
            });
        }
        self.for_each(kinds, |r| {
            let stack = stored(r.seq);
            f(r, stack)
        })
    }

    /// The `stacks` table: every stack of a rows database, the late ones
    /// of a packed database.
    fn stacks_table(&self) -> Result<HashMap<u64, Vec<u64>>, DbError> {
        let mut stmt = self
            .conn
            .prepare("SELECT seq, frames FROM stacks")
            .map_err(sql(&self.path))?;
        let mut rows = stmt.query([]).map_err(sql(&self.path))?;
        let mut out = HashMap::new();
        while let Some(r) = rows.next().map_err(sql(&self.path))? {
            let seq: i64 = r.get(0).map_err(sql(&self.path))?;
            let blob: Vec<u8> = r.get(1).map_err(sql(&self.path))?;
            if !blob.len().is_multiple_of(8) || blob.len() > packed::MAX_FRAMES * 8 {
                return Err(DbError::Corrupt {
                    path: self.path.clone(),
                    what: format!("the stack of event {seq} is {} bytes long", blob.len()),
                });
            }
            let frames = blob
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect();
            out.insert(seq as u64, frames);
        }
        Ok(out)
    }

    /// Counts per kind.
    pub fn counts(&self) -> Result<Vec<(Kind, u64)>, DbError> {
        if self.format == EventFormat::Packed {
            let mut counts: std::collections::BTreeMap<u16, (Kind, u64)> = Default::default();
            self.for_each_packed(|_, e| {
                counts.entry(e.kind as u16).or_insert((e.kind, 0)).1 += 1;
                Ok(())
            })?;
            return Ok(counts.into_values().collect());
        }
        let mut out = Vec::new();
        let mut stmt = self
            .conn
            .prepare("SELECT kind, count(*) FROM events GROUP BY kind ORDER BY kind")
            .map_err(sql(&self.path))?;
        let mut rows = stmt.query([]).map_err(sql(&self.path))?;
        while let Some(r) = rows.next().map_err(sql(&self.path))? {
            let k: i64 = r.get(0).map_err(sql(&self.path))?;
            let n: i64 = r.get(1).map_err(sql(&self.path))?;
            if let Some(kind) = u16::try_from(k).ok().and_then(Kind::from_u16) {
                out.push((kind, n as u64));
            }
        }
        Ok(out)
    }

    /// Copies everything into `w` (a database of another format, say):
    /// meta (but the format), threads, objects, anomalies, and every event
    /// with its stack, in order. Sequence numbers are kept.
    pub fn copy_to(&self, w: &mut EventWriter) -> Result<(), DbError> {
        let text_rows = |query: &str| -> Result<Vec<Vec<rusqlite::types::Value>>, DbError> {
            let mut stmt = self.conn.prepare(query).map_err(sql(&self.path))?;
            let n = stmt.column_count();
            let rows = stmt
                .query_map([], |r| (0..n).map(|i| r.get(i)).collect())
                .map_err(sql(&self.path))?;
            rows.collect::<Result<_, _>>().map_err(sql(&self.path))
        };
        for table in ["meta", "threads", "objects", "anomalies"] {
            let rows = text_rows(&format!("SELECT * FROM {table}"))?;
            for row in rows {
                if table == "meta"
                    && row.first() == Some(&rusqlite::types::Value::Text("events_format".into()))
                {
                    continue;
                }
                let marks = vec!["?"; row.len()].join(",");
                w.conn
                    .execute(
                        &format!("INSERT OR REPLACE INTO {table} VALUES ({marks})"),
                        rusqlite::params_from_iter(row),
                    )
                    .map_err(sql(&w.partial))?;
            }
        }
        self.for_each_with_stacks(&[], |r, stack| {
            let seq = w.push(&r)?;
            if seq != r.seq {
                return Err(DbError::Corrupt {
                    path: self.path.clone(),
                    what: format!("event {} follows event {}", r.seq, seq - 1),
                });
            }
            if let Some(frames) = stack {
                w.stack(seq, frames)?;
            }
            Ok(())
        })
    }

    /// The anomalies the capture counted: (what, count, example).
    pub fn anomalies(&self) -> Result<Vec<(String, u64, String)>, DbError> {
        let mut stmt = self
            .conn
            .prepare("SELECT what, count, coalesce(example, '') FROM anomalies ORDER BY what")
            .map_err(sql(&self.path))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get(0)?, r.get::<_, i64>(1)? as u64, r.get(2)?))
            })
            .map_err(sql(&self.path))?;
        rows.collect::<Result<_, _>>().map_err(sql(&self.path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("insight-db-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("events.db")
    }

    fn row(
        time: u64,
        kind: Kind,
        addr: Option<u64>,
        caller: Option<u64>,
        value: Option<i64>,
    ) -> Row {
        Row {
            seq: 0,
            time,
            kind,
            source: Source::Probe,
            pid: 5,
            lwpid: 6,
            addr,
            caller,
            value,
        }
    }

    #[test]
    fn writes_and_reads_back_in_order() {
        for format in [EventFormat::Packed, EventFormat::Rows] {
            writes_and_reads_back(format);
        }
    }

    fn writes_and_reads_back(format: EventFormat) {
        let path = temp(format.name());
        let mut w = EventWriter::create_with(&path, &[("trace", "t".into())], format).unwrap();
        let s1 = w
            .push(&row(10, Kind::Lock, Some(0x1000), Some(0x400), None))
            .unwrap();
        w.thread(5, 6, "syn_cont", s1).unwrap();
        w.push(&row(20, Kind::LockRet, Some(0x1000), Some(0x400), Some(0)))
            .unwrap();
        let s3 = w
            .push(&row(30, Kind::Unlock, Some(u64::MAX), None, None))
            .unwrap();
        w.stack(s3, &[0x7000, 0x6000]).unwrap();
        w.object(5, 0x5555_0000, "/usr/bin/syn_cont", s1).unwrap();
        w.anomalies(&[("unmapped buffer".into(), 2, "at 0x0".into())])
            .unwrap();
        assert!(!path.exists(), "only the partial file exists while writing");
        w.finish().unwrap();

        let db = EventDb::open(&path).unwrap();
        assert_eq!(db.format(), format);
        assert_eq!(db.meta("trace").unwrap().as_deref(), Some("t"));
        let mut rows = Vec::new();
        db.for_each(&[], |r| {
            rows.push(r);
            Ok(())
        })
        .unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[1].kind, Kind::LockRet);
        assert_eq!(rows[1].value, Some(0));
        assert_eq!(rows[2].addr, Some(u64::MAX), "addresses keep all 64 bits");
        let mut locks = 0;
        db.for_each(&[Kind::Unlock], |_| {
            locks += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(locks, 1);
        assert_eq!(
            db.objects(5).unwrap(),
            vec![(0x5555_0000, "/usr/bin/syn_cont".into())]
        );
        assert_eq!(db.threads().unwrap(), vec![(5, 6, "syn_cont".into())]);
        assert_eq!(db.anomalies().unwrap()[0].1, 2);
        assert_eq!(db.stacks().unwrap()[&s3], vec![0x7000, 0x6000]);
        assert_eq!(
            db.counts().unwrap(),
            vec![(Kind::Lock, 1), (Kind::LockRet, 1), (Kind::Unlock, 1)]
        );
    }

    #[test]
    fn copies_between_formats_keep_everything() {
        let rows_path = temp("copy-rows");
        let mut w =
            EventWriter::create_with(&rows_path, &[("trace", "t".into())], EventFormat::Rows)
                .unwrap();
        for i in 0..5000u64 {
            let kind = if i % 3 == 0 { Kind::Sample } else { Kind::Lock };
            let seq = w
                .push(&row(i, kind, Some(i * 8), Some(0x400), None))
                .unwrap();
            if kind == Kind::Sample {
                w.stack(seq, &[i, 0x5555]).unwrap();
            }
        }
        w.thread(5, 6, "syn_cont", 1).unwrap();
        w.object(5, 0x5555_0000, "/usr/bin/syn_cont", 1).unwrap();
        w.anomalies(&[("unmapped buffer".into(), 2, "at 0x0".into())])
            .unwrap();
        w.finish().unwrap();
        let all = |db: &EventDb| {
            let mut v = Vec::new();
            db.for_each(&[], |r| {
                v.push(r);
                Ok(())
            })
            .unwrap();
            (
                v,
                db.stacks().unwrap(),
                db.threads().unwrap(),
                db.objects(5).unwrap(),
            )
        };
        let original = EventDb::open(&rows_path).unwrap();
        let packed_path = temp("copy-packed");
        let mut w = EventWriter::create(&packed_path, &[]).unwrap();
        original.copy_to(&mut w).unwrap();
        w.finish().unwrap();
        let packed = EventDb::open(&packed_path).unwrap();
        assert_eq!(packed.format(), EventFormat::Packed);
        assert_eq!(all(&packed), all(&original));
        assert_eq!(packed.meta("trace").unwrap().as_deref(), Some("t"));
        assert_eq!(packed.anomalies().unwrap(), original.anomalies().unwrap());
        // A database with a gap in its sequence is refused, not renumbered.
        drop(original);
        Connection::open(&rows_path)
            .unwrap()
            .execute_batch("DELETE FROM events WHERE seq = 10;")
            .unwrap();
        let mut w = EventWriter::create(&temp("copy-gap"), &[]).unwrap();
        let err = EventDb::open(&rows_path)
            .unwrap()
            .copy_to(&mut w)
            .unwrap_err();
        assert!(
            err.to_string().contains("event 11 follows event 9"),
            "{err}"
        );
    }

    #[test]
    fn packed_blocks_keep_order_stacks_and_refuse_corruption() {
        let path = temp("blocks");
        let mut w = EventWriter::create(&path, &[]).unwrap();
        let n = 2 * BLOCK_EVENTS as u64 + 10;
        for i in 0..n {
            let seq = w
                .push(&row(i * 3, Kind::Sample, Some(i), None, Some(0)))
                .unwrap();
            assert_eq!(seq, i + 1);
            w.stack(seq, &[i, i + 1]).unwrap();
        }
        w.set_meta("events", &n.to_string()).unwrap();
        w.finish().unwrap();
        let size = std::fs::metadata(&path).unwrap().len();
        let db = EventDb::open(&path).unwrap();
        let mut seen = 0u64;
        db.for_each(&[Kind::Sample], |r| {
            seen += 1;
            assert_eq!(
                (r.seq, r.time, r.addr),
                (seen, (seen - 1) * 3, Some(seen - 1))
            );
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, n);
        let stacks = db.stacks().unwrap();
        assert_eq!(stacks.len() as u64, n);
        assert_eq!(stacks[&(BLOCK_EVENTS as u64 + 1)], vec![4096, 4097]);
        drop(db);
        // Rows take several times the room.
        let rows_path = temp("blocks-rows");
        let mut w = EventWriter::create_with(&rows_path, &[], EventFormat::Rows).unwrap();
        for i in 0..n {
            let seq = w
                .push(&row(i * 3, Kind::Sample, Some(i), None, Some(0)))
                .unwrap();
            w.stack(seq, &[i, i + 1]).unwrap();
        }
        w.finish().unwrap();
        assert!(std::fs::metadata(&rows_path).unwrap().len() > 4 * size);

        // A stack longer than any writer keeps is refused.
        let conn = Connection::open(&path).unwrap();
        conn.execute(
            "INSERT INTO stacks VALUES (1, ?1)",
            [vec![0u8; (packed::MAX_FRAMES + 1) * 8]],
        )
        .unwrap();
        let err = EventDb::open(&path).unwrap().stacks().unwrap_err();
        assert!(err.to_string().contains("the stack of event 1"), "{err}");
        conn.execute_batch("DELETE FROM stacks WHERE seq = 1;")
            .unwrap();
        drop(conn);

        // A damaged block is an error naming it, not a panic.
        Connection::open(&path)
            .unwrap()
            .execute_batch("UPDATE event_blocks SET data = x'28b52ffd00' WHERE first_seq = 4097;")
            .unwrap();
        let db = EventDb::open(&path).unwrap();
        let err = db.for_each(&[], |_| Ok(())).unwrap_err();
        assert!(err.to_string().contains("event block 4097"), "{err}");
        drop(db);
        Connection::open(&path)
            .unwrap()
            .execute_batch("DELETE FROM event_blocks WHERE first_seq = 4097;")
            .unwrap();
        let err = EventDb::open(&path).unwrap().counts().unwrap_err();
        assert!(err.to_string().contains("start at event 4097"), "{err}");
        // Blocks lost at the end are noticed too.
        Connection::open(&path)
            .unwrap()
            .execute_batch("DELETE FROM event_blocks WHERE first_seq > 4096;")
            .unwrap();
        let err = EventDb::open(&path).unwrap().counts().unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("hold 4096 events, its meta table says {n}")),
            "{err}"
        );
    }

    #[test]
    fn foreign_and_future_files_are_refused() {
        let path = temp("foreign");
        assert!(matches!(EventDb::open(&path), Err(DbError::Foreign(_))));
        std::fs::write(&path, b"not a database at all, just some text").unwrap();
        assert!(matches!(EventDb::open(&path), Err(DbError::Foreign(_))));
        // A real SQLite file of another application.
        std::fs::remove_file(&path).unwrap();
        Connection::open(&path)
            .unwrap()
            .execute_batch("CREATE TABLE t(x);")
            .unwrap();
        assert!(matches!(EventDb::open(&path), Err(DbError::Foreign(_))));
        // Ours, truncated: SQLite's own complaint, naming the file.
        std::fs::remove_file(&path).unwrap();
        let mut w = EventWriter::create(&path, &[]).unwrap();
        for i in 0..5000 {
            w.push(&row(i, Kind::Lock, Some(i), None, None)).unwrap();
        }
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let err = EventDb::open(&path)
            .and_then(|db| db.for_each(&[], |_| Ok(())))
            .unwrap_err();
        let cause = std::error::Error::source(&err).map(|e| e.to_string());
        assert!(err.to_string().contains("events.db"), "{err}");
        assert!(cause.is_some_and(|c| c.contains("malformed")), "{err:?}");
        // Ours, from a future version.
        std::fs::remove_file(&path).unwrap();
        EventWriter::create(&path, &[]).unwrap().finish().unwrap();
        Connection::open(&path)
            .unwrap()
            .execute_batch("PRAGMA user_version = 99;")
            .unwrap();
        assert!(matches!(
            EventDb::open(&path),
            Err(DbError::Version { found: 99, .. })
        ));
    }

    #[test]
    fn an_unfinished_writer_leaves_its_committed_events() {
        let path = temp("unfinished");
        {
            let mut w = EventWriter::create(&path, &[]).unwrap();
            for i in 0..(BLOCK_EVENTS as u64 + 5) {
                w.push(&row(i, Kind::Lock, Some(1), None, None)).unwrap();
            }
        }
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let db = EventDb::open(Path::new(&partial)).unwrap();
        assert_eq!(
            db.counts().unwrap(),
            vec![(Kind::Lock, BLOCK_EVENTS as u64 + 5)]
        );
    }
}
