//! Recordings without names, end to end: `insight record vm.toml`, then
//! `insight replay --diagnose ...` and `insight report ...` with no trace
//! named, give what the same commands give with every path typed; `ls`
//! and `rm` manage the store.

mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::*;

/// Runs insight in `dir` with the trace store at `store`.
fn in_store(dir: &Path, store: &Path, args: &[&OsStr]) -> Output {
    let mut cmd = insight();
    cmd.current_dir(dir)
        .env("INSIGHT_TRACE_DIR", store)
        .args(args);
    output_within(cmd, Duration::from_secs(600))
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn record_replay_and_report_need_no_trace_named() {
    guest_ready();
    let dir = scratch("store");
    let store = dir.join("traces");
    std::fs::write(
        dir.join("vm.toml"),
        "command = [\"env\", \"LD_PRELOAD=/usr/lib/libinsight-probes.so\", \"sh\", \"-c\", \
         \"deadlock_trylock && deadlock_transitive\"]\n",
    )
    .unwrap();

    // No trace yet: said so, not a crash.
    let out = in_store(&dir, &store, &[os("replay")]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("no recording yet"), "{stderr}");

    let out = in_store(
        &dir,
        &store,
        &[os("record"), os("--no-stdin"), os("vm.toml")],
    );
    let (recorded, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let trace = store.join("vm-0");
    assert!(
        stderr.contains(&format!("recording into {}", trace.display())),
        "{stderr}"
    );
    assert!(recorded.contains("no deadlock"), "{recorded}");

    // Replay the latest, and diagnose it.
    let out = in_store(
        &dir,
        &store,
        &[os("replay"), os("--diagnose"), os("locks,deadlock")],
    );
    let (replayed, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert!(replayed.contains("potential deadlock"), "{replayed}");
    let db = trace.join("events.db");
    assert!(db.is_file());

    // Reports of the latest, by name and by path: the same.
    let implicit = in_store(
        &dir,
        &store,
        &[os("report"), os("deadlock"), os("-o"), os("report.html")],
    );
    let explicit = in_store(
        &dir,
        &store,
        &[os("report"), os("deadlock"), db.as_os_str()],
    );
    let (a, stderr) = text(&implicit);
    assert_eq!(implicit.status.code(), Some(0), "{stderr}");
    assert!(a.contains("2 potential deadlocks"), "{a}");
    assert_eq!(a, text(&explicit).0);
    assert!(dir.join("report.html").is_file());
    let by_name = in_store(&dir, &store, &[os("report"), os("locks"), os("vm-0")]);
    let by_path = in_store(&dir, &store, &[os("report"), os("locks"), db.as_os_str()]);
    assert_eq!(by_name.status.code(), Some(0));
    assert_eq!(text(&by_name).0, text(&by_path).0);
    assert!(replayed.contains(&text(&by_path).0), "{replayed}");

    // ls names it as the latest, complete, with its database.
    let out = in_store(&dir, &store, &[os("ls")]);
    let (listing, _) = text(&out);
    let line = listing
        .lines()
        .find(|l| l.starts_with("vm-0*"))
        .unwrap_or_else(|| panic!("{listing}"));
    assert!(
        line.contains("complete") && line.contains("deadlock_trylock"),
        "{line}"
    );

    // rm refuses what is not a trace, removes what is.
    let out = in_store(&dir, &store, &[os("rm"), dir.as_os_str()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(dir.join("vm.toml").exists());
    let out = in_store(&dir, &store, &[os("rm"), os("vm-0")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    assert!(!trace.exists());
    let out = in_store(&dir, &store, &[os("ls")]);
    assert!(text(&out).0.contains("no recordings"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_database_that_is_not_there_is_said_so() {
    // No KVM needed: nothing boots.
    let dir = scratch("no-db");
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    let out = in_store(&dir, &store, &[os("report"), os("locks"), os("e3.db")]);
    let (_, stderr) = text(&out);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("e3.db: no such file"), "{stderr}");
    // A name without an extension is a recording's.
    let out = in_store(&dir, &store, &[os("report"), os("locks"), os("e3")]);
    assert!(text(&out).1.contains("no trace e3"), "{}", text(&out).1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The partial files of the event database `db` in its directory.
fn partials_of(db: &Path) -> Vec<String> {
    let name = format!("{}.partial", db.file_name().unwrap().to_string_lossy());
    std::fs::read_dir(db.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&name))
        .collect()
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn replays_into_one_database_never_damage_it() {
    guest_ready();
    let (trace, out) = record("one-db", &["--probes"], &["syn_cont", "300", "2000"]);
    expect_status(&out, 0);
    let dir = trace.parent().unwrap();
    let db = dir.join("e.db");
    // Two at once: each writes its own partial file; the last to finish
    // replaces the other's whole database.
    let replay_into = || {
        let mut cmd = insight();
        cmd.arg("replay")
            .arg(&trace)
            .arg("--events")
            .arg(&db)
            .args(["--diagnose", "locks"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd.spawn().unwrap()
    };
    let (first, second) = (replay_into(), replay_into());
    for child in [first, second] {
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert!(stdout.contains("Lock contention"), "{stdout}{stderr}");
    }
    let whole = rows(&db);
    assert!(
        whole.iter().any(|r| r.kind == events::abi::Kind::Lock),
        "{} events",
        whole.len()
    );
    assert!(partials_of(&db).is_empty(), "{:?}", partials_of(&db));

    // A replay killed while writing leaves its partial file; the next
    // replay into the same database removes it and says so.
    let mut killed = replay_into();
    wait_for("a partial file", || {
        (!partials_of(&db).is_empty()).then_some(())
    });
    killed.kill().unwrap();
    killed.wait().unwrap();
    // The partial database, and SQLite's journal of it if the replay was
    // killed inside a transaction: the next replay removes both.
    let left: Vec<String> = partials_of(&db)
        .into_iter()
        .filter(|n| !n.ends_with("-journal"))
        .collect();
    assert_eq!(left.len(), 1, "{:?}", partials_of(&db));
    let out = replay_with(&trace, &["--events", db.to_str().unwrap()]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!("removed {}", dir.join(&left[0]).display()))
            && stderr.contains("left unfinished by a command"),
        "{stderr}"
    );
    assert!(partials_of(&db).is_empty(), "{:?}", partials_of(&db));
    let _ = std::fs::remove_dir_all(dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_trace_being_recorded_is_neither_removed_nor_replayed() {
    guest_ready();
    let dir = scratch("held-store");
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    let mut recorder = insight()
        .current_dir(&dir)
        .env("INSIGHT_TRACE_DIR", &store)
        .args(["record", "--no-stdin", "--", "sh", "-c", "sleep 120"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let trace = wait_for("a trace header", || {
        std::fs::read_dir(&store)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| !p.is_symlink() && p.join("header").is_file())
    });
    let name = trace.file_name().unwrap().to_owned();
    let user = format!("in use by pid {} (insight record)", recorder.id());
    // Listed as being recorded, not as a recording that was cut short.
    let out = in_store(&dir, &store, &[os("ls")]);
    let (listed, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let line = listed
        .lines()
        .find(|l| l.starts_with(name.to_str().unwrap()))
        .unwrap_or_default();
    assert!(line.contains(" recording "), "{listed}");
    let out = in_store(&dir, &store, &[os("rm"), &name]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&user) && stderr.contains("not removed"),
        "{stderr}"
    );
    assert!(trace.join("header").is_file());
    let out = in_store(&dir, &store, &[os("replay"), &name]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains(&user), "{stderr}");
    // Killed, the recorder holds nothing: its prefix replays, and rm
    // removes it.
    recorder.kill().unwrap();
    recorder.wait().unwrap();
    let out = in_store(&dir, &store, &[os("rm"), &name]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stdout.contains("removed"), "{stdout}");
    assert!(!trace.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_recording_removed_behind_its_back_stops_and_leaves_its_successor_alone() {
    guest_ready();
    let dir = scratch("removed-store");
    let trace = dir.join("t");
    let recorder = insight()
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .args(["--", "sh", "-c", "sleep 120"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its header written and its boot snapshot in place: the run begins.
    wait_for("the trace's boot snapshot", || {
        trace.join(trace::SNAPSHOT_FILE).is_file().then_some(())
    });
    // Removed by hand (not by `insight rm`, which refuses), and the name
    // taken by something else.
    std::fs::remove_dir_all(&trace).unwrap();
    std::fs::create_dir(&trace).unwrap();
    std::fs::write(trace.join("notes"), "mine\n").unwrap();
    let out = recorder.wait_with_output().unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("recording stopped") && stderr.contains("was removed while it was written"),
        "{stderr}"
    );
    let names: Vec<_> = std::fs::read_dir(&trace)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, ["notes"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A small tmpfs mounted on a directory of the test's own, unmounted when
/// dropped.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    /// `None` where the test may not mount one (not root, no
    /// CAP_SYS_ADMIN): the reason is printed.
    fn mount(at: &Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(at).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallFs(at.to_owned())),
            Ok(o) => {
                eprintln!(
                    "skipped: cannot mount a tmpfs here: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                None
            }
            Err(e) => {
                eprintln!("skipped: cannot run mount: {e}");
                None
            }
        }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[ignore = "needs /dev/kvm, the guest image and root (tools/test runs it)"]
#[test]
fn an_event_database_on_a_full_disk_is_said_so_and_removed() {
    guest_ready();
    let (trace, out) = record("full-disk", &["--probes"], &["syn_cont", "300", "2000"]);
    expect_status(&out, 0);
    let dir = trace.parent().unwrap();
    // The database's size depends on the recording's schedule: the small
    // disk holds half of what this replay writes.
    let whole = dir.join("whole.db");
    let out = replay_with(&trace, &["--events", whole.to_str().unwrap()]);
    expect_status(&out, 0);
    let pages = std::fs::metadata(&whole).unwrap().len() / 4096;
    assert!(
        pages >= 8,
        "{pages} pages of events: too few to fill a disk"
    );
    let room = format!("{}k", pages / 2 * 4);
    let Some(full) = SmallFs::mount(&dir.join("full"), &room) else {
        return;
    };
    let db = full.0.join("e.db");
    let out = replay_with(&trace, &["--events", db.to_str().unwrap()]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("e.db.partial.") && stderr.contains("disk full"),
        "{stderr}"
    );
    assert!(stderr.contains("the unfinished event database"), "{stderr}");
    let left: Vec<_> = std::fs::read_dir(&full.0).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
    // A recording whose boot snapshot does not fit: said so, naming the
    // trace's copy, and no half copy is left.
    let into = full.0.join("t");
    let out = record_into(&into, &[], &["true"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "disk full: cannot put the boot snapshot in the trace: cannot copy the boot \
             snapshot into the trace as {}",
            into.join("boot.snap").display()
        )) && stderr.contains("No space left on device"),
        "{stderr}"
    );
    // Nothing was recorded: the directory it made is gone.
    assert!(
        stderr.contains("its run never began") && !into.exists(),
        "{stderr}"
    );
    drop(full);
    // A recording that fills the disk as it runs: said so, with how far
    // it got, and what it wrote replays as an incomplete trace.
    let snap = std::fs::metadata(trace.join(trace::SNAPSHOT_FILE))
        .unwrap()
        .len();
    let room = format!("{}k", snap.div_ceil(1024) + 24);
    let full = SmallFs::mount(&dir.join("full"), &room).unwrap();
    let into = full.0.join("t");
    let out = record_into(
        &into,
        &[],
        &[
            "sh",
            "-c",
            "dd if=/dev/urandom bs=1k count=1000 | sha256sum",
        ],
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    // Either of the files the recorder appends to may be the one that
    // finds the disk full (each is written through its own buffer): the
    // error names the one that did.
    let named =
        |file: &str| stderr.contains(&format!("{}: No space left", into.join(file).display()));
    assert!(
        stderr.contains("disk full: recording failed")
            && stderr.contains("writing the trace failed at exit ")
            && (named("events") || named("payloads")),
        "{stderr}"
    );
    let out = replay(&into);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    drop(full);
    // Checkpoints that do not fit: the error names the disk's state, and
    // no partial checkpoint is left behind.
    let ckpts = SmallFs::mount(&trace.join("checkpoints"), "48k").unwrap();
    let out = replay_with(&trace, &["--checkpoint-every", "250ms"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("disk full: cannot store the checkpoint at exit ")
            && stderr.contains("No space left on device"),
        "{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(&ckpts.0).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
    drop(ckpts);
    // Recording into it is refused, and a refused start removes nothing
    // it did not write.
    let out = record_into(&trace, &[], &["true"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("is not empty") && !stderr.contains("removed"),
        "{stderr}"
    );
    // The trace itself is untouched: it still replays.
    let out = replay(&trace);
    expect_status(&out, 0);
    let _ = std::fs::remove_dir_all(dir);
}
