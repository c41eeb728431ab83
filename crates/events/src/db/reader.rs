//! Reading an event database, either format and version 1.

use std::path::{Path, PathBuf};

use rusqlite::types::Value;
use rusqlite::{Connection, OpenFlags};

use super::*;
use crate::db::digest;
use crate::packed::{self, PackedEvent};

/// An open event database.
pub struct EventDb {
    conn: Connection,
    path: PathBuf,
    format: EventFormat,
    /// Schema version: 3 and later carry checksums.
    version: i64,
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
            version: found,
        };
        let corrupt = |what: String| DbError::Corrupt {
            path: path.to_owned(),
            what,
        };
        let stored_digest = db.meta(digest::DIGEST_KEY)?;
        if found >= 3 {
            digest::check(&db.conn, path, stored_digest.as_deref())?;
        } else if stored_digest.is_some() {
            return Err(corrupt(format!(
                "it says schema version {found} but carries version 3's checksums"
            )));
        }
        db.format = match db.meta("events_format")?.as_deref() {
            None if db.has_blocks()? => {
                return Err(corrupt(
                    "it holds packed event blocks but its meta table names no events_format".into(),
                ))
            }
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

    fn has_blocks(&self) -> Result<bool, DbError> {
        self.conn
            .query_row("SELECT EXISTS(SELECT 1 FROM event_blocks)", [], |r| {
                r.get(0)
            })
            .map_err(sql(&self.path))
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
        let checked = self.version >= 3;
        let query = if checked {
            "SELECT first_seq, count, data, first_time, last_time, crc32 FROM event_blocks \
             ORDER BY first_seq"
        } else {
            "SELECT first_seq, count, data FROM event_blocks ORDER BY first_seq"
        };
        let start = self.first_seq()?;
        let mut stmt = self.conn.prepare(query).map_err(sql(&self.path))?;
        let mut rows = stmt.query([]).map_err(sql(&self.path))?;
        let mut next = start;
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
            if checked {
                let first_time: i64 = r.get(3).map_err(sql(&self.path))?;
                let last_time: i64 = r.get(4).map_err(sql(&self.path))?;
                let stored: i64 = r.get(5).map_err(sql(&self.path))?;
                let crc = digest::block_crc(first, count as i64, first_time, last_time, blob);
                if stored != i64::from(crc) {
                    return Err(corrupt(format!(
                        "checksum mismatch (stored {stored:08x}, computed {crc:08x})"
                    )));
                }
            }
            let events = packed::decode(blob, count).map_err(corrupt)?;
            for (i, e) in events.into_iter().enumerate() {
                f(first as u64 + i as u64, e)?;
            }
            next = first as u64 + count as u64;
        }
        // Blocks lost at the end would otherwise go unnoticed.
        if let Some(recorded) = self.meta("events")? {
            if recorded.parse::<u64>().ok() != Some(next - start) {
                return Err(DbError::Corrupt {
                    path: self.path.clone(),
                    what: format!(
                        "its blocks hold {} events, its meta table says {recorded}",
                        next - start
                    ),
                });
            }
        }
        Ok(())
    }

    /// The sequence number of the database's first event: 1, or where
    /// the replay that wrote it started (a checkpoint, a segment).
    pub fn first_seq(&self) -> Result<u64, DbError> {
        match self.meta("first_seq")? {
            None => Ok(1),
            Some(v) => v
                .parse()
                .ok()
                .filter(|&s| s > 0)
                .ok_or_else(|| DbError::Corrupt {
                    path: self.path.clone(),
                    what: format!("its first_seq is {v:?}, not a sequence number"),
                }),
        }
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
        let first = self.first_seq()?;
        if first != 1 {
            w.start_at(first)?;
        }
        let mut tables = vec!["meta", "threads", "objects", "anomalies"];
        if self.version >= 4 {
            tables.extend(["probes", "probe_values"]);
        }
        for table in tables {
            let rows = self.rows(&format!("SELECT * FROM {table}"))?;
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
        self.push_events_to(w)
    }

    /// Every row `query` returns, as values.
    fn rows(&self, query: &str) -> Result<Vec<Vec<rusqlite::types::Value>>, DbError> {
        let mut stmt = self.conn.prepare(query).map_err(sql(&self.path))?;
        let n = stmt.column_count();
        let rows = stmt
            .query_map([], |r| (0..n).map(|i| r.get(i)).collect())
            .map_err(sql(&self.path))?;
        rows.collect::<Result<_, _>>().map_err(sql(&self.path))
    }

    /// Pushes every event, with its stack, into `w`, which must number
    /// them as they are numbered here.
    fn push_events_to(&self, w: &mut EventWriter) -> Result<(), DbError> {
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

    /// Appends this database to `w`, which holds the databases of the
    /// replay segments before it (or nothing): its events must go on from
    /// their last, with their sequence numbers. Thread names and objects
    /// are added where new, anomaly counts summed, and meta keys the
    /// first database set are kept.
    pub fn append_to(&self, w: &mut EventWriter) -> Result<(), DbError> {
        let first = self.first_seq()?;
        if w.events_written() == 0 && w.next_seq() != first {
            w.start_at(first)?;
        }
        if first != w.next_seq() {
            return Err(DbError::Corrupt {
                path: self.path.clone(),
                what: format!(
                    "its events start at {first}, the databases before it end at event {} \
                     (a segment missing, or out of order)",
                    w.next_seq() - 1
                ),
            });
        }
        let copies = [
            (
                "SELECT key, value FROM meta WHERE key NOT IN \
                 ('events_format', 'events', 'first_seq', 'digest', 'segment')",
                "INSERT OR IGNORE INTO meta VALUES (?1, ?2)",
            ),
            (
                "SELECT * FROM threads",
                "INSERT OR IGNORE INTO threads VALUES (?1, ?2, ?3, ?4)",
            ),
            (
                "SELECT * FROM objects",
                "INSERT INTO objects SELECT ?1, ?2, ?3, ?4 WHERE NOT EXISTS (SELECT 1 FROM \
                 objects WHERE pid = ?1 AND base = ?2 AND path = ?3 AND seq = ?4)",
            ),
            (
                "SELECT * FROM anomalies",
                "INSERT INTO anomalies VALUES (?1, ?2, ?3) ON CONFLICT(what) DO UPDATE SET \
                 count = count + excluded.count",
            ),
        ];
        let probes = [
            (
                "SELECT * FROM probes",
                "INSERT OR IGNORE INTO probes VALUES (?1, ?2, ?3)",
            ),
            (
                "SELECT * FROM probe_values",
                "INSERT OR REPLACE INTO probe_values VALUES (?1, ?2, ?3, ?4)",
            ),
        ];
        let probes = if self.version >= 4 { &probes[..] } else { &[] };
        for (read, write) in copies.iter().chain(probes) {
            for row in self.rows(read)? {
                w.conn
                    .execute(write, rusqlite::params_from_iter(row))
                    .map_err(sql(&w.partial))?;
            }
        }
        self.push_events_to(w)
    }

    /// The probes given at the replay that wrote it (none before schema
    /// version 4), by number.
    pub fn probes(&self) -> Result<Vec<ProbeRow>, DbError> {
        if self.version < 4 {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for row in self.rows("SELECT id, spec, captures FROM probes ORDER BY id")? {
            let (Some(Value::Integer(id)), Some(Value::Text(spec)), Some(Value::Text(captures))) =
                (row.first(), row.get(1), row.get(2))
            else {
                return Err(self.corrupt("a row of its probes table is malformed"));
            };
            let id =
                u32::try_from(*id).map_err(|_| self.corrupt("a probe number is out of range"))?;
            let captures = match captures.is_empty() {
                true => Vec::new(),
                false => captures.split('\t').map(str::to_owned).collect(),
            };
            out.push(ProbeRow {
                id,
                spec: spec.clone(),
                captures,
            });
        }
        Ok(out)
    }

    /// The values probe hits captured: by event, (slot, value) in slot
    /// order.
    pub fn probe_values(&self) -> Result<HashMap<u64, Vec<(u32, ProbeValue)>>, DbError> {
        let mut out: HashMap<u64, Vec<(u32, ProbeValue)>> = HashMap::new();
        if self.version < 4 {
            return Ok(out);
        }
        let rows =
            self.rows("SELECT seq, slot, value, bytes FROM probe_values ORDER BY seq, slot")?;
        for row in rows {
            let value = match (row.get(2), row.get(3)) {
                (Some(Value::Integer(v)), _) => ProbeValue::Int(*v),
                (_, Some(Value::Blob(b))) => ProbeValue::Bytes(b.clone()),
                _ => return Err(self.corrupt("a probe value is neither an integer nor bytes")),
            };
            let (Some(Value::Integer(seq)), Some(Value::Integer(slot))) = (row.first(), row.get(1))
            else {
                return Err(self.corrupt("a row of its probe_values table is malformed"));
            };
            let slot =
                u32::try_from(*slot).map_err(|_| self.corrupt("a probe slot is out of range"))?;
            out.entry(*seq as u64).or_default().push((slot, value));
        }
        Ok(out)
    }

    fn corrupt(&self, what: &str) -> DbError {
        DbError::Corrupt {
            path: self.path.clone(),
            what: what.to_owned(),
        }
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
