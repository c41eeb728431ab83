//! Hostile inputs and outputs: insight never replaces what it did not
//! write, never reads a device or FIFO it is pointed at, and reports
//! damage as damage (exit status 3), naming where it is.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use events::abi::Kind;
use events::db::{EventWriter, Row};

/// A damaged input or a refused output is found at once, before any
/// guest runs: far sooner than this.
const PROMPTLY: Duration = Duration::from_secs(60);

fn run_within(args: &[&std::ffi::OsStr]) -> std::process::Output {
    let mut cmd = insight();
    cmd.args(args);
    output_within(cmd, PROMPTLY)
}

/// Runs insight, expects `status`, returns standard error.
fn refused(args: &[&std::ffi::OsStr], status: i32) -> String {
    let out = run_within(args);
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(status),
        "{args:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stderr
}

fn os(s: &str) -> &std::ffi::OsStr {
    s.as_ref()
}

fn event_db(path: &Path) {
    let mut w = EventWriter::create(path, &[]).unwrap();
    for i in 0..50u64 {
        for kind in [Kind::Lock, Kind::LockRet, Kind::Unlock] {
            w.push(&Row {
                value: (kind == Kind::LockRet).then_some(0),
                ..lock_row(10 * i, kind)
            })
            .unwrap();
        }
    }
    w.set_meta("events", "150").unwrap();
    w.finish().unwrap();
}

/// A character device with the null device's numbers, made in `dir`
/// (needs root).
fn scratch_device(dir: &Path) -> PathBuf {
    let node = dir.join("device");
    let made = std::process::Command::new("mknod")
        .arg(&node)
        .args(["c", "1", "3"])
        .status()
        .unwrap();
    assert!(made.success(), "mknod needs root (tools/test runs as root)");
    node
}

fn mkfifo(path: &Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo {}", path.display());
}

fn is_char_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_char_device())
}

#[test]
fn convert_replaces_only_its_own_kind_of_file() {
    let dir = scratch("hostile-convert");
    let db = dir.join("in.db");
    event_db(&db);
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, "kept\n").unwrap();
    let stderr = refused(&[os("convert"), db.as_os_str(), notes.as_os_str()], 125);
    assert!(
        stderr.contains("is not an insight event database"),
        "{stderr}"
    );
    assert!(stderr.contains("--force"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "kept\n");
    // A database insight wrote is replaced; with --force, anything regular.
    let out = dir.join("out.db");
    run_expecting([os("convert"), db.as_os_str(), out.as_os_str()], 0);
    run_expecting([os("convert"), db.as_os_str(), out.as_os_str()], 0);
    run_expecting(
        [
            os("convert"),
            db.as_os_str(),
            notes.as_os_str(),
            os("--force"),
        ],
        0,
    );
    assert_eq!(rows(&notes).len(), 150);
    // Never a directory or a link, even forced.
    let link = dir.join("link.db");
    std::os::unix::fs::symlink(&out, &link).unwrap();
    for (target, why) in [(&dir, "is a directory"), (&link, "is a symbolic link")] {
        let args = [
            os("convert"),
            db.as_os_str(),
            target.as_os_str(),
            os("--force"),
        ];
        let stderr = refused(&args, 125);
        assert!(stderr.contains(why), "{stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn damaged_event_databases_exit_3_and_leave_nothing_behind() {
    let dir = scratch("hostile-db");
    let db = dir.join("in.db");
    event_db(&db);
    let conn = rusqlite::Connection::open(&db).unwrap();
    // One byte of a block: a lock's times would change.
    conn.execute_batch(
        "UPDATE event_blocks SET data = substr(data, 1, 20) || x'ff' || substr(data, 22);",
    )
    .unwrap();
    drop(conn);
    let stderr = refused(&[os("report"), os("locks"), db.as_os_str()], 3);
    assert!(
        stderr.contains("event_blocks table does not match its checksum"),
        "{stderr}"
    );
    let out = dir.join("out.db");
    let stderr = refused(&[os("convert"), db.as_os_str(), out.as_os_str()], 3);
    assert!(stderr.contains("does not match its checksum"), "{stderr}");
    // Nor its partial file.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("out.db"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs root for mknod (tools/test runs it)"]
fn device_nodes_are_never_replaced_even_forced() {
    let dir = scratch("hostile-device");
    let db = dir.join("in.db");
    event_db(&db);
    let device = scratch_device(&dir);
    let stderr = refused(
        &[
            os("convert"),
            db.as_os_str(),
            device.as_os_str(),
            os("--force"),
        ],
        125,
    );
    assert!(stderr.contains("is a character device"), "{stderr}");
    assert!(is_char_device(&device));
    // Nor one named like the partial file of a writer that is gone (no
    // pid is that large): the next writer removes only regular files.
    let partial_of = dir.join("x.db");
    let stale = dir.join("x.db.partial.4000000000");
    std::fs::rename(&device, &stale).unwrap();
    let out = insight()
        .args(["convert", "--force"])
        .arg(&db)
        .arg(&partial_of)
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(is_char_device(&stale));
    assert!(partial_of.is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Copies a trace directory's files.
fn copy_trace(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

#[test]
#[ignore = "boots the guest (tools/test runs it)"]
fn a_recording_survives_hostile_arguments_and_damage_is_named() {
    guest_ready();
    let dir = scratch("hostile-trace");
    // A config whose text would retitle the terminal if an error quoted
    // it raw.
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "# \x1b]0;owned\x07 a comment\n").unwrap();
    let stderr = refused(&[os("run"), os("--no-stdin"), bad.as_os_str()], 125);
    assert!(stderr.contains("\\x1b]0;owned\\x07"), "{stderr}");
    assert!(!stderr.contains('\x1b'), "{stderr}");

    let config = dir.join("vm.toml");
    std::fs::write(&config, "command = [\"sh\", \"-c\", \"echo hostile-ok\"]\n").unwrap();
    let trace = dir.join("trace");
    let mut cmd = insight();
    // From power-on: the log of a boot spans several frames, which the
    // damage below needs.
    cmd.args(["record", "--no-stdin", "--cold-boot", "-o"])
        .arg(&trace)
        .arg(&config);
    let out = output_within(cmd, Duration::from_secs(600));
    assert!(expect_status(&out, 0).contains("hostile-ok"));

    // Outputs: a trace's own file, a device, a directory are refused
    // before the replay starts, and stay what they were.
    let log = std::fs::read(trace.join("events")).unwrap();
    let own = trace.join("events");
    let stderr = refused(
        &[
            os("replay"),
            trace.as_os_str(),
            os("--events"),
            own.as_os_str(),
        ],
        125,
    );
    assert!(stderr.contains("is inside the trace"), "{stderr}");
    assert_eq!(std::fs::read(&own).unwrap(), log);
    let device = scratch_device(&dir);
    let stderr = refused(
        &[
            os("replay"),
            trace.as_os_str(),
            os("--events"),
            device.as_os_str(),
        ],
        125,
    );
    assert!(stderr.contains("is a character device"), "{stderr}");
    let stderr = refused(
        &[
            os("dump"),
            trace.as_os_str(),
            os("--rx-pcap"),
            device.as_os_str(),
            os("--force"),
        ],
        125,
    );
    assert!(stderr.contains("is a character device"), "{stderr}");
    assert!(is_char_device(&device));
    let empty_dir = dir.join("emptydir");
    std::fs::create_dir(&empty_dir).unwrap();
    let stderr = refused(
        &[
            os("replay"),
            trace.as_os_str(),
            os("--events"),
            empty_dir.as_os_str(),
        ],
        125,
    );
    assert!(stderr.contains("is a directory"), "{stderr}");

    // Inputs that would never end or block: refused by kind.
    let copy = dir.join("zero-header");
    copy_trace(&trace, &copy);
    std::fs::remove_file(copy.join("header")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", copy.join("header")).unwrap();
    let stderr = refused(&[os("dump"), copy.as_os_str()], 125);
    assert!(
        stderr.contains("is a character device, not a regular file"),
        "{stderr}"
    );
    let fifo_complete = dir.join("fifo-complete");
    copy_trace(&trace, &fifo_complete);
    std::fs::remove_file(fifo_complete.join("complete")).unwrap();
    mkfifo(&fifo_complete.join("complete"));
    let stderr = refused(&[os("dump"), fifo_complete.as_os_str()], 125);
    assert!(stderr.contains("is a FIFO"), "{stderr}");
    let fifo_disk = dir.join("disk.img");
    mkfifo(&fifo_disk);
    let disk_config = dir.join("disk.toml");
    std::fs::write(&disk_config, "disk = \"disk.img\"\ncommand = \"true\"\n").unwrap();
    let stderr = refused(&[os("run"), os("--no-stdin"), disk_config.as_os_str()], 125);
    assert!(stderr.contains("disk.img is a FIFO"), "{stderr}");

    // Damage in a complete trace: exit 3, naming the file and the frame,
    // from dump, diff and replay alike.
    let damaged = dir.join("damaged");
    copy_trace(&trace, &damaged);
    let mut bytes = log.clone();
    bytes[40] ^= 0x10;
    std::fs::write(damaged.join("events"), &bytes).unwrap();
    for args in [
        vec![os("dump"), damaged.as_os_str()],
        vec![os("diff"), trace.as_os_str(), damaged.as_os_str()],
        vec![os("replay"), damaged.as_os_str(), os("--no-console")],
    ] {
        let stderr = refused(&args, 3);
        assert!(
            stderr.contains("events is damaged: frame 0 at byte 0"),
            "{args:?}: {stderr}"
        );
    }
    // Cut at a frame boundary, emptied, or with a frame after its end:
    // the summary's counts do not match.
    let first = 16 + u32::from_le_bytes(log[..4].try_into().unwrap()) as usize;
    let mut after_end = log.clone();
    after_end.extend_from_slice(&log[..first]);
    for log in [&log[..first], &[][..], &after_end[..]] {
        std::fs::write(damaged.join("events"), log).unwrap();
        let stderr = refused(&[os("replay"), damaged.as_os_str(), os("--no-console")], 3);
        assert!(stderr.contains("its completion summary says"), "{stderr}");
    }
    // A flipped byte in the header's appended archive.
    copy_trace(&trace, &damaged);
    let mut header = std::fs::read(trace.join("header")).unwrap();
    let at = header.len() - 100;
    header[at] ^= 1;
    std::fs::write(damaged.join("header"), header).unwrap();
    let stderr = refused(&[os("dump"), damaged.as_os_str()], 3);
    assert!(stderr.contains("header is damaged"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_diagnosis_tool_is_listed_in_report_help() {
    let help = run_expecting([os("report"), os("--help")], 0);
    for tool in ["locks", "profile", "deadlock", "threads"] {
        let listed = help
            .lines()
            .any(|l| l.trim_start().starts_with(&format!("{tool} ")));
        assert!(listed, "{tool} is not among the commands:\n{help}");
    }
}

#[test]
fn received_frames_whose_lengths_miss_their_payload_are_refused() {
    let dir = scratch("hostile-netrx");
    let header = trace::Header {
        clock: trace::ClockKind::Exit,
        created_unix_secs: 0,
        guest_cpuid: vec![],
        kvm_caps: vec![],
        user_rdtsc_traps: false,
        host_apic_id: None,
        config: String::new(),
        images: vec![],
        boot: trace::BootParams {
            cmdline: String::new(),
            memory_mib: 16,
            rng_seed: vec![0; 32],
            archive: vec![],
            snapshot: None,
            wall_clock: None,
            net: None,
        },
        digest_interval: 1,
        sample_period_ns: 0,
        chaos: None,
    };
    // A frame of 40 bytes logged with lengths that cover 5 (shorter than
    // the virtio header) and then 35: before, dump wrote a 0-byte frame.
    for (name, lens) in [("short", vec![5, 35]), ("over", vec![40, 10])] {
        let t = dir.join(name);
        let mut w = trace::TraceWriter::create(&t, &header).unwrap();
        let payload = w.payload(&[0x55; 40]).unwrap();
        w.push(journal::Entry::NetRx { payload, lens }).unwrap();
        w.finish().unwrap();
        let pcap = dir.join(format!("{name}.pcap"));
        let stderr = refused(
            &[os("dump"), t.as_os_str(), os("--rx-pcap"), pcap.as_os_str()],
            125,
        );
        assert!(
            stderr.contains("received-frames entry of the log is malformed"),
            "{stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
