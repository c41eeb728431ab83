//! Writing an event database, in either format.

use std::path::{Path, PathBuf};

use rusqlite::{params, Connection};

use super::digest;
use super::*;
use crate::packed::{self, PackedEvent, BLOCK_EVENTS};

/// Writes a database: into `PATH.partial.PID` (this process's own, so
/// that two writers of one database never share a file), renamed over
/// `PATH` by [`EventWriter::finish`], so a reader never sees half a
/// database and the last writer to finish wins; if the writer is dropped
/// without finishing, the partial file stays with every committed batch.
pub struct EventWriter {
    pub(super) conn: Connection,
    pub(super) partial: PathBuf,
    path: PathBuf,
    format: EventFormat,
    next_seq: u64,
    /// The sequence number of this database's first event (1 unless it
    /// goes on from a checkpoint).
    first_seq: u64,
    in_batch: u64,
    /// Packed: the block being filled, from sequence number `block_seq`.
    block: Vec<PackedEvent>,
    block_seq: u64,
    /// Sealed and committed: nothing left for `drop` to do.
    done: bool,
    /// The partial file, locked (`flock`) while this writer owns it:
    /// another command never takes it for one a writer left.
    claim: Option<std::fs::File>,
}

impl EventWriter {
    /// Where this process writes a database for `path` until it is
    /// finished (replaced when a writer starts): `PATH.partial.PID`.
    pub fn partial_path(path: &Path) -> PathBuf {
        Self::partial_of(path, std::process::id())
    }

    fn partial_of(path: &Path, pid: u32) -> PathBuf {
        let mut partial = path.as_os_str().to_owned();
        partial.push(format!(".partial.{pid}"));
        PathBuf::from(partial)
    }

    /// The partial files of `path` that writers which are gone left
    /// (`PATH.partial.PID` that no process holds locked, as every writer
    /// holds its own while it writes: true on any file system `flock`
    /// works on, other hosts' writers included), with their PIDs: regular
    /// files only, never this process's.
    pub fn stale_partials(path: &Path) -> Vec<(PathBuf, u32)> {
        let (Some(name), dir) = (path.file_name(), path.parent()) else {
            return Vec::new();
        };
        let dir = match dir {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let prefix = format!("{}.partial.", name.to_string_lossy());
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut stale: Vec<(PathBuf, u32)> = entries
            .flatten()
            .filter_map(|e| {
                let file = e.file_name();
                let file = file.to_str()?;
                let pid: u32 = file.strip_prefix(&prefix)?.parse().ok()?;
                // As this process names them: no leading zeros.
                if file != format!("{prefix}{pid}") {
                    return None;
                }
                let regular = e.file_type().is_ok_and(|t| t.is_file());
                if pid == std::process::id() || !regular {
                    return None;
                }
                let partial = Self::partial_of(path, pid);
                let unowned = std::fs::File::open(&partial).is_ok_and(|f| f.try_lock().is_ok());
                unowned.then_some((partial, pid))
            })
            .collect();
        stale.sort();
        stale
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
        // Claimed before SQLite opens it (an empty file is a new
        // database to SQLite). A file of this name a writer holds (this
        // PID on another host sharing the file system) is not replaced.
        let claim = Self::claim(&partial)?;
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
            first_seq: 1,
            in_batch: 0,
            block: Vec::new(),
            block_seq: 1,
            done: false,
            claim: Some(claim),
        };
        w.set_meta("events_format", format.name())?;
        for (k, v) in meta {
            w.set_meta(k, v)?;
        }
        Ok(w)
    }

    /// Creates `partial` afresh (replacing a file no writer holds) and
    /// locks it for this writer.
    fn claim(partial: &Path) -> Result<std::fs::File, DbError> {
        let io = |e: std::io::Error| DbError::Io(partial.to_owned(), e);
        let busy = || {
            DbError::Invalid(format!(
                "{}: another process is writing it",
                partial.display()
            ))
        };
        if let Ok(old) = std::fs::File::open(partial) {
            if let Err(std::fs::TryLockError::WouldBlock) = old.try_lock() {
                return Err(busy());
            }
            drop(old);
            std::fs::remove_file(partial).map_err(io)?;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(partial)
            .map_err(io)?;
        match file.try_lock() {
            // A file system without flock: no claim, as before.
            Ok(()) | Err(std::fs::TryLockError::Error(_)) => Ok(file),
            Err(std::fs::TryLockError::WouldBlock) => Err(busy()),
        }
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
        let (first_seq, count) = (self.block_seq as i64, self.block.len() as i64);
        let crc = digest::block_crc(first_seq, count, first_time as i64, last_time as i64, &data);
        self.conn
            .prepare_cached("INSERT INTO event_blocks VALUES (?1, ?2, ?3, ?4, ?5, ?6)")
            .and_then(|mut s| {
                s.execute(params![
                    first_seq,
                    count,
                    first_time as i64,
                    last_time as i64,
                    data,
                    i64::from(crc)
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

    /// Declares a probe given at replay.
    pub fn probe(&mut self, probe: &ProbeRow) -> Result<(), DbError> {
        self.conn
            .prepare_cached("INSERT OR REPLACE INTO probes VALUES (?1, ?2, ?3)")
            .and_then(|mut s| s.execute(params![probe.id, probe.spec, probe.captures.join("\t")]))
            .map_err(sql(&self.partial))?;
        Ok(())
    }

    /// A value the hit that made event `seq` captured, in its probe's
    /// capture `slot`.
    pub fn probe_value(&mut self, seq: u64, slot: u32, value: &ProbeValue) -> Result<(), DbError> {
        let (int, bytes) = match value {
            ProbeValue::Int(v) => (Some(*v), None),
            ProbeValue::Bytes(b) => (None, Some(b.as_slice())),
        };
        self.conn
            .prepare_cached("INSERT OR REPLACE INTO probe_values VALUES (?1, ?2, ?3, ?4)")
            .and_then(|mut s| s.execute(params![seq, slot, int, bytes]))
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
        self.next_seq - self.first_seq
    }

    /// The sequence number the next event gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Numbers events from `seq` on (a database that goes on from a
    /// replay checkpoint: its events are those of a whole replay's with
    /// the same numbers). Only before the first event.
    pub fn start_at(&mut self, seq: u64) -> Result<(), DbError> {
        if self.next_seq != self.first_seq || seq == 0 {
            return Err(DbError::Invalid(format!(
                "cannot number events from {seq} after {} were written",
                self.events_written()
            )));
        }
        (self.next_seq, self.first_seq, self.block_seq) = (seq, seq, seq);
        self.set_meta("first_seq", &seq.to_string())
    }

    /// Writes what is pending and the table digests, and commits.
    fn seal(&mut self) -> Result<(), DbError> {
        self.flush_block()?;
        let digests = digest::table_digests(&self.conn, &self.partial)?;
        self.set_meta(digest::DIGEST_KEY, &digests)?;
        self.conn
            .execute_batch("COMMIT; BEGIN;")
            .map_err(sql(&self.partial))
    }

    /// Commits and moves the database to its final name.
    pub fn finish(mut self) -> Result<PathBuf, DbError> {
        self.seal()?;
        self.conn
            .execute_batch("COMMIT;")
            .map_err(sql(&self.partial))?;
        self.done = true;
        let (partial, path) = (self.partial.clone(), self.path.clone());
        // Held until the file has its final name.
        let claim = self.claim.take();
        drop(self);
        std::fs::rename(&partial, &path).map_err(|e| DbError::Rename(path.clone(), e))?;
        drop(claim);
        Ok(path)
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Keep what was written: an unfinished writer still commits, with
        // its digests, so that what it leaves can be read.
        let _ = self.seal();
        let _ = self.conn.execute_batch("COMMIT;");
    }
}
