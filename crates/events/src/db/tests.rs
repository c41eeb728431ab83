//! The event database against databases written in the tests.

use super::*;
use crate::db::digest;
use crate::packed::{self, BLOCK_EVENTS};
use crate::testing::TempDb;
use rusqlite::Connection;

fn temp(name: &str) -> TempDb {
    TempDb::new("insight-db", name)
}

/// Runs `sql` on the database at `path` and recomputes its table digests,
/// as a forger would: what only the deeper checks can catch.
fn tamper_and_reseal(path: &Path, sql: &str) {
    let conn = Connection::open(path).unwrap();
    conn.execute_batch(sql).unwrap();
    let digests = digest::table_digests(&conn, path).unwrap();
    conn.execute(
        "UPDATE meta SET value = ?1 WHERE key = ?2",
        [digests.as_str(), digest::DIGEST_KEY],
    )
    .unwrap();
}

fn row(time: u64, kind: Kind, addr: Option<u64>, caller: Option<u64>, value: Option<i64>) -> Row {
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
        EventWriter::create_with(&rows_path, &[("trace", "t".into())], EventFormat::Rows).unwrap();
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
    tamper_and_reseal(&rows_path, "DELETE FROM events WHERE seq = 10;");
    let gap = temp("copy-gap");
    let mut w = EventWriter::create(&gap, &[]).unwrap();
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
    let long_stack = format!("x'{}'", "00".repeat((packed::MAX_FRAMES + 1) * 8));
    tamper_and_reseal(
        &path,
        &format!("INSERT INTO stacks VALUES (1, {long_stack});"),
    );
    let err = EventDb::open(&path).unwrap().stacks().unwrap_err();
    assert!(err.to_string().contains("the stack of event 1"), "{err}");
    tamper_and_reseal(&path, "DELETE FROM stacks WHERE seq = 1;");

    // A damaged block is an error naming it, not a panic: by its checksum,
    // and by its decoding once the checksum is forged too.
    tamper_and_reseal(
        &path,
        "UPDATE event_blocks SET data = x'28b52ffd00' WHERE first_seq = 4097;",
    );
    let db = EventDb::open(&path).unwrap();
    let err = db.for_each(&[], |_| Ok(())).unwrap_err();
    assert!(
        err.to_string()
            .contains("event block 4097: checksum mismatch"),
        "{err}"
    );
    drop(db);
    tamper_and_reseal(&path, "DELETE FROM event_blocks WHERE first_seq = 4097;");
    let err = EventDb::open(&path).unwrap().counts().unwrap_err();
    assert!(err.to_string().contains("start at event 4097"), "{err}");
    // Blocks lost at the end are noticed too.
    tamper_and_reseal(&path, "DELETE FROM event_blocks WHERE first_seq > 4096;");
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
    let partial = EventWriter::partial_path(&path);
    assert!(partial
        .to_string_lossy()
        .ends_with(&format!(".partial.{}", std::process::id())));
    let db = EventDb::open(&partial).unwrap();
    assert_eq!(
        db.counts().unwrap(),
        vec![(Kind::Lock, BLOCK_EVENTS as u64 + 5)]
    );
}

#[test]
fn changed_blocks_and_metadata_are_refused_naming_the_table() {
    let path = temp("digest");
    let mut w = EventWriter::create(&path, &[("trace", "t".into())]).unwrap();
    for i in 0..(BLOCK_EVENTS as u64 + 100) {
        w.push(&row(i * 10, Kind::Lock, Some(0x1000), Some(0x400), None))
            .unwrap();
    }
    w.set_meta("events", &(BLOCK_EVENTS + 100).to_string())
        .unwrap();
    w.finish().unwrap();
    let pristine = std::fs::read(&path).unwrap();
    let run = |sql: &str| {
        std::fs::write(&path, &pristine).unwrap();
        Connection::open(&path).unwrap().execute_batch(sql).unwrap();
        EventDb::open(&path)
            .and_then(|db| db.counts().map(|_| ()))
            .unwrap_err()
            .to_string()
    };
    // One byte of a block's data changed: a lock's times would change.
    let err = run("UPDATE event_blocks SET data = \
                   substr(data, 1, 20) || x'ff' || substr(data, 22) WHERE first_seq = 1;");
    assert!(
        err.contains("its event_blocks table does not match its checksum"),
        "{err}"
    );
    // The format key deleted: the database would read as empty.
    let err = run("DELETE FROM meta WHERE key = 'events_format';");
    assert!(err.contains("its meta table does not match"), "{err}");
    let err = run("UPDATE threads SET comm = 'other' WHERE 0; \
                   INSERT INTO threads VALUES (9, 5, 'forged', 1);");
    assert!(err.contains("its threads table"), "{err}");
    // Labelled as an older version to skip the checks.
    let err = run("PRAGMA user_version = 2;");
    assert!(err.contains("carries version 3's checksums"), "{err}");
    let err =
        run("PRAGMA user_version = 2; DELETE FROM meta WHERE key IN ('digest', 'events_format');");
    assert!(err.contains("names no events_format"), "{err}");
    std::fs::write(&path, &pristine).unwrap();
    assert_eq!(
        EventDb::open(&path).unwrap().counts().unwrap(),
        vec![(Kind::Lock, BLOCK_EVENTS as u64 + 100)]
    );
}

/// Everything a tool can read from a database.
type Contents = (
    Vec<Row>,
    HashMap<u64, Vec<u64>>,
    Vec<(u32, u32, String)>,
    Vec<(u64, String)>,
    Vec<(String, u64, String)>,
    Option<String>,
);

fn contents(path: &Path) -> Result<Contents, DbError> {
    let db = EventDb::open(path)?;
    let mut rows = Vec::new();
    db.for_each(&[], |r| {
        rows.push(r);
        Ok(())
    })?;
    Ok((
        rows,
        db.stacks()?,
        db.threads()?,
        db.objects(5)?,
        db.anomalies()?,
        db.meta("trace")?,
    ))
}

#[test]
fn randomly_damaged_databases_are_read_faithfully_or_refused() {
    const CASES: u64 = 10_000;
    let path = temp("damage-fuzz");
    let mut w = EventWriter::create(&path, &[("trace", "t".into())]).unwrap();
    for i in 0..300u64 {
        let seq = w
            .push(&row(i * 7, Kind::Sample, Some(0x4000 + i), None, Some(0)))
            .unwrap();
        w.stack(seq, &[0x4000 + i, 0x5000]).unwrap();
    }
    w.thread(5, 6, "worker", 1).unwrap();
    w.object(5, 0x4000, "/usr/bin/prog", 1).unwrap();
    w.anomalies(&[("lost".into(), 1, "x".into())]).unwrap();
    w.set_meta("events", "300").unwrap();
    w.finish().unwrap();
    let pristine = std::fs::read(&path).unwrap();
    let expected = contents(&path).unwrap();
    let page = 4096.min(pristine.len());
    let pages = pristine.len() / page;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rand = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n.max(1) as u64) as usize
    };
    let (mut refused, mut unchanged) = (0u64, 0u64);
    for case in 0..CASES {
        let mut bytes = pristine.clone();
        let what = match case % 5 {
            0 | 1 => {
                let at = rand(bytes.len());
                bytes[at] ^= 1 << rand(8);
                format!("bit flip at {at}")
            }
            2 => {
                let at = if rand(2) == 0 {
                    page * rand(pages)
                } else {
                    rand(bytes.len())
                };
                bytes.truncate(at);
                format!("cut at {at}")
            }
            3 => {
                let (a, b) = (rand(pages) * page, rand(pages) * page);
                let copy = bytes[a..a + page].to_vec();
                bytes[b..b + page].copy_from_slice(&copy);
                format!("page at {a} copied over page at {b}")
            }
            _ => {
                // A large value in a random 4-byte field.
                let at = rand(bytes.len() - 4);
                bytes[at..at + 4].copy_from_slice(&[0x7f, 0xff, 0xff, 0xff]);
                format!("0x7fffffff at {at}")
            }
        };
        std::fs::write(&path, &bytes).unwrap();
        match contents(&path) {
            Err(_) => refused += 1,
            Ok(got) => {
                assert!(got == expected, "{what}: read as changed");
                unchanged += 1;
            }
        }
    }
    // Most of a small database's pages is free space SQLite never reads:
    // damage there leaves the content as it was (about 6 cases in 10).
    // The rest is refused, none is read as something else.
    assert!(
        refused > CASES / 4,
        "{refused} refused, {unchanged} unchanged"
    );
    assert_eq!(refused + unchanged, CASES);
}

fn all_rows(db: &EventDb) -> Vec<Row> {
    let mut rows = Vec::new();
    db.for_each(&[], |r| {
        rows.push(r);
        Ok(())
    })
    .unwrap();
    rows
}

#[test]
fn segments_numbered_from_where_the_last_ended_merge_into_one_replay() {
    let whole = temp("merge-whole");
    let mut all = Vec::new();
    for i in 0..(BLOCK_EVENTS as u64 + 20) {
        all.push(row(i * 10, Kind::Lock, Some(0x1000 + i), Some(0x40), None));
    }
    // One database of the whole run, and the same run in three segments
    // (the second and third numbered from where the one before ended).
    let mut w = EventWriter::create(&whole, &[("trace", "t".into())]).unwrap();
    for r in &all {
        w.push(r).unwrap();
    }
    w.thread(5, 6, "worker", 1).unwrap();
    w.set_meta("events", &all.len().to_string()).unwrap();
    w.finish().unwrap();
    let cuts = [0, 7, BLOCK_EVENTS + 3, all.len()];
    let mut parts = Vec::new();
    for (n, span) in cuts.windows(2).enumerate() {
        let path = temp(&format!("merge-{n}"));
        let mut w = EventWriter::create(&path, &[("trace", "t".into())]).unwrap();
        if span[0] > 0 {
            w.start_at(span[0] as u64 + 1).unwrap();
            assert!(w.start_at(1).is_ok(), "still nothing written");
            w.start_at(span[0] as u64 + 1).unwrap();
        }
        for (i, r) in all[span[0]..span[1]].iter().enumerate() {
            assert_eq!(w.push(r).unwrap(), (span[0] + i + 1) as u64);
        }
        assert!(w.start_at(1).is_err(), "events already written");
        // Every segment knows the thread (a checkpoint carries it).
        w.thread(5, 6, "worker", 1).unwrap();
        w.anomalies(&[("odd".into(), 2, "example".into())]).unwrap();
        let count = w.events_written();
        w.set_meta("events", &count.to_string()).unwrap();
        w.finish().unwrap();
        // Each segment reads back on its own, numbered as in the whole.
        let db = EventDb::open(&path).unwrap();
        let seqs: Vec<u64> = all_rows(&db).iter().map(|r| r.seq).collect();
        assert_eq!(seqs.first(), Some(&(span[0] as u64 + 1)));
        assert_eq!(seqs.len(), span[1] - span[0]);
        parts.push(path);
    }
    let merged = temp("merge-out");
    let mut w = EventWriter::create(&merged, &[]).unwrap();
    for p in &parts {
        EventDb::open(p).unwrap().append_to(&mut w).unwrap();
    }
    let n = w.events_written();
    w.set_meta("events", &n.to_string()).unwrap();
    w.finish().unwrap();
    let (a, b) = (
        EventDb::open(&whole).unwrap(),
        EventDb::open(&merged).unwrap(),
    );
    assert_eq!(all_rows(&a), all_rows(&b));
    assert_eq!(b.threads().unwrap(), vec![(5, 6, "worker".to_owned())]);
    assert_eq!(
        b.anomalies().unwrap(),
        vec![("odd".into(), 6, "example".into())]
    );
    assert_eq!(b.meta("trace").unwrap().as_deref(), Some("t"));

    // A segment left out, or out of order, is named.
    let out = temp("merge-gap");
    let mut w = EventWriter::create(&out, &[]).unwrap();
    EventDb::open(&parts[0]).unwrap().append_to(&mut w).unwrap();
    let e = EventDb::open(&parts[2])
        .unwrap()
        .append_to(&mut w)
        .unwrap_err();
    assert!(e.to_string().contains("a segment missing"), "{e}");
}

#[test]
fn only_regular_partial_files_of_processes_that_are_gone_are_stale() {
    let path = temp("stale");
    let dir = path.parent().unwrap().to_owned();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let at = |tail: &str| dir.join(format!("{name}{tail}"));
    // Left by a writer that is gone: nobody holds it.
    let gone = at(".partial.4000000000");
    std::fs::write(&gone, b"half").unwrap();
    std::fs::write(EventWriter::partial_path(&path), b"mine").unwrap();
    // Held by a writer (another process's; here a lock of this test's).
    std::fs::write(at(".partial.1"), b"a live writer's").unwrap();
    let live = std::fs::File::open(at(".partial.1")).unwrap();
    live.try_lock().unwrap();
    std::fs::write(at(".partial.04000000001"), b"not a name insight gives").unwrap();
    std::os::unix::fs::symlink("/nonexistent", at(".partial.4000000002")).unwrap();
    std::fs::write(at(".partial"), b"an older insight's").unwrap();
    std::fs::write(dir.join(format!("other-{name}.partial.4000000003")), b"x").unwrap();
    assert_eq!(
        EventWriter::stale_partials(&path),
        vec![(gone.clone(), 4_000_000_000)]
    );
    // Released: left behind too.
    drop(live);
    assert_eq!(EventWriter::stale_partials(&path).len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}
