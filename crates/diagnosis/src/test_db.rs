//! Event databases made from given rows, for unit tests.

use std::path::PathBuf;

use events::db::{EventDb, EventWriter, Row};
use guestfiles::GuestFiles;

use crate::plugin::PluginContext;

/// A probe's row: process 1, thread 2, lock address 0x40, no caller.
pub fn probe_row(time: u64, kind: events::abi::Kind, value: Option<i64>) -> Row {
    Row {
        seq: 0,
        time,
        kind,
        source: events::abi::Source::Probe,
        pid: 1,
        lwpid: 2,
        addr: Some(0x40),
        caller: None,
        value,
    }
}

/// An event database in a directory of its own, removed on drop.
pub struct TestDb {
    dir: PathBuf,
    pub db: EventDb,
    files: GuestFiles,
}

impl TestDb {
    /// Writes `rows` (in the default format) to a new database; `name`
    /// keeps concurrent tests apart.
    pub fn with_rows(name: &str, rows: &[Row]) -> TestDb {
        Self::with_stacks(name, rows, &[])
    }

    /// The same, and stacks of some of the events: (seq, frames).
    pub fn with_stacks(name: &str, rows: &[Row], stacks: &[(u64, &[u64])]) -> TestDb {
        let dir = std::env::temp_dir().join(format!("insight-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("e.db");
        let mut w = EventWriter::create(&path, &[]).unwrap();
        for row in rows {
            let seq = w.push(row).unwrap();
            for (_, frames) in stacks.iter().filter(|(s, _)| *s == seq) {
                w.stack(seq, frames).unwrap();
            }
        }
        w.finish().unwrap();
        let db = EventDb::open(&path).unwrap();
        TestDb {
            dir,
            db,
            files: GuestFiles::default(),
        }
    }

    /// A plugin context over the database, with no guest files.
    pub fn context(&self) -> PluginContext<'_> {
        PluginContext {
            db: &self.db,
            files: &self.files,
            files_missing: None,
            label: "e.db".into(),
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
