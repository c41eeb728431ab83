//! `insight convert`: event databases from one format to the other, never
//! at the cost of the database being read. Needs no KVM.

mod common;

use common::*;
use events::abi::Kind;
use events::db::{EventDb, EventFormat, EventWriter};

#[test]
fn converts_both_ways_and_never_overwrites_its_input() {
    let dir = scratch("convert");
    let packed = dir.join("packed.db");
    let mut w = EventWriter::create(&packed, &[]).unwrap();
    for i in 0..100 {
        w.push(&lock_row(2 * i, Kind::Lock)).unwrap();
        w.push(&lock_row(2 * i + 1, Kind::Unlock)).unwrap();
    }
    w.set_meta("events", "200").unwrap();
    w.finish().unwrap();

    let rows = dir.join("rows.db");
    run_expecting(
        ["convert".as_ref(), packed.as_os_str(), rows.as_os_str()],
        0,
    );
    let back = dir.join("back.db");
    run_expecting(
        [
            "convert".as_ref(),
            rows.as_os_str(),
            back.as_os_str(),
            "--events-format".as_ref(),
            "packed".as_ref(),
        ],
        0,
    );
    let read = |path| (EventDb::open(path).unwrap().format(), common::rows(path));
    let (f0, original) = read(&packed);
    let (f1, as_rows) = read(&rows);
    let (f2, again) = read(&back);
    assert_eq!(
        (f0, f1, f2),
        (EventFormat::Packed, EventFormat::Rows, EventFormat::Packed)
    );
    assert_eq!(original.len(), 200);
    assert_eq!(original, as_rows);
    assert_eq!(original, again);

    // Into itself: refused, and the input is still whole.
    let run = insight()
        .arg("convert")
        .arg(&packed)
        .arg(&packed)
        .output()
        .unwrap();
    let (_, stderr) = text(&run);
    assert!(!run.status.success(), "{stderr}");
    assert!(stderr.contains("is the database being read"), "{stderr}");
    assert_eq!(read(&packed).1, original);
    // A partial file left by a conversion that is gone is removed (and
    // said) by the next one into the same OUT; the input is untouched.
    let stale = dir.join("out.db.partial.4000000000");
    std::fs::copy(&packed, &stale).unwrap();
    let out = dir.join("out.db");
    let run = insight()
        .arg("convert")
        .arg(&packed)
        .arg(&out)
        .output()
        .unwrap();
    let (_, stderr) = text(&run);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "out.db.partial.4000000000, left unfinished by a command (pid 4000000000) that is gone"
        ),
        "{stderr}"
    );
    assert!(!stale.exists());
    assert_eq!(read(&out).1, original);
    std::fs::remove_dir_all(&dir).unwrap();
}
