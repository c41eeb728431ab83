//! Checkpoints taken at replay and restored: windows of a recording, and
//! checkpoints that are damaged, cut short or of another trace, each
//! refused with a one-line error naming the cause. (Every workload of the
//! determinism suite also restores each of its checkpoints and replays on
//! to the end: `common::assert_checkpoints_replay_faithfully`.)

mod common;

use std::path::Path;

use common::*;

/// The processes replaying a segment of `trace` (`--segment` in their
/// command line), by pid.
fn segment_processes(trace: &Path) -> Vec<u32> {
    let trace = trace.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let args: Vec<String> = cmdline
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            (args.iter().any(|a| a == "--segment") && args.contains(&trace)).then_some(pid)
        })
        .collect()
}

/// Starts `replay --jobs 2` of `trace` (its standard error to `stderr`)
/// and waits for its first segment processes; returns both.
fn jobs_with_segments(
    trace: &Path,
    stderr: std::process::Stdio,
) -> (std::process::Child, Vec<u32>) {
    let parent = insight()
        .arg("replay")
        .arg(trace)
        .args(["--jobs", "2", "--no-console"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let segments = wait_for("a segment process", || {
        Some(segment_processes(trace)).filter(|found| !found.is_empty())
    });
    (parent, segments)
}

/// Whether process `pid` holds a `flock` on the directory `trace`, by
/// /proc/locks ("1: FLOCK  ADVISORY  READ 1234 00:2a:5678 0 EOF").
fn holds_trace(pid: u32, trace: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let ino = format!(":{}", std::fs::metadata(trace).unwrap().ino());
    std::fs::read_to_string("/proc/locks")
        .unwrap_or_default()
        .lines()
        .any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.iter().position(|f| *f == "FLOCK").is_some_and(|at| {
                fields.get(at + 3) == Some(&pid.to_string().as_str())
                    && fields.get(at + 4).is_some_and(|id| id.ends_with(&ino))
            })
        })
}

/// Whether process `pid` still runs (a zombie no init reaped does not).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// The error line of a replay `--from` a checkpoint that is refused, which
/// exits with `status`: 3 for a damaged one, 125 (insight's own error, not
/// a divergence) for one that is whole but not the trace's.
fn refusal(trace: &Path, from: u64, status: i32) -> String {
    let out = replay_with(trace, &["--from", &from.to_string()]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(status), "{stderr}");
    let error = stderr
        .lines()
        .find(|l| l.starts_with("insight: error"))
        .unwrap_or_else(|| panic!("no error line in:\n{stderr}"))
        .to_owned();
    assert_eq!(
        stderr.lines().filter(|l| l.contains("is refused")).count(),
        1,
        "{stderr}"
    );
    error
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn windows_and_refused_checkpoints() {
    guest_ready();
    let (trace, out) = record("ckpt", &[], &["clock_sleep", "4"]);
    let recorded = expect_status(&out, 0);
    let out = replay_with(&trace, &["--checkpoint-every", "200ms"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let stored = trace::checkpoints::list(&trace).unwrap();
    assert!(stored.len() >= 3, "{} checkpoints: {stderr}", stored.len());
    assert!(stderr.contains(&format!("{} checkpoints written", stored.len())));

    let out = replay_with(&trace, &["--list-checkpoints"]);
    let listing = expect_status(&out, 0);
    for c in &stored {
        assert!(listing.contains(&format!(" {} ", c.exit)), "{listing}");
    }

    let out = insight()
        .args(["dump", "--header"])
        .arg(&trace)
        .output()
        .unwrap();
    let header = expect_status(&out, 0);
    assert!(
        header.contains(&format!(
            "checkpoints: {} at exits {},",
            stored.len(),
            stored[0].exit
        )),
        "{header}"
    );

    // A window between two checkpoints ends where it was asked to.
    let (from, to) = (stored[1].exit, stored[2].exit + 3);
    let out = replay_with(
        &trace,
        &["--from", &from.to_string(), "--to", &to.to_string()],
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "end of the window, after {to} deterministic exits"
        )),
        "{stderr}"
    );
    // From a position between checkpoints: the one before it.
    let out = replay_with(&trace, &["--from", &(stored[1].exit + 1).to_string()]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains(&format!("restored the checkpoint at exit {from} ")));
    // Every checkpoint restores and replays faithfully to the end.
    for c in &stored {
        let out = replay_with(&trace, &["--from", &c.exit.to_string()]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "from {}: {stderr}", c.exit);
        assert!(stderr.contains("replay matched the recording"), "{stderr}");
        assert!(recorded.ends_with(&stdout));
    }

    // Another trace's checkpoint in place of the second.
    let (other, out) = record("ckpt-other", &[], &["true"]);
    expect_status(&out, 0);
    expect_status(&replay_with(&other, &["--checkpoint-every", "1s"]), 0);
    let foreign = trace::checkpoints::list(&other).unwrap();
    std::fs::copy(&foreign[0].path, &stored[1].path).unwrap();
    // Listed as another trace's, and passed over for the trace's own
    // checkpoint before it.
    let out = replay_with(&trace, &["--list-checkpoints"]);
    let listed = expect_status(&out, 0);
    assert!(
        listed.contains(&format!(
            "{}: another trace's checkpoint",
            stored[1].path.display()
        )),
        "{listed}"
    );
    let out = replay_with(&trace, &["--from", &stored[1].exit.to_string()]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "restored the checkpoint at exit {} ",
            stored[0].exit
        )),
        "{stderr}"
    );
    assert!(recorded.ends_with(&stdout));
    // Its successors need it: refused, naming it.
    let e = refusal(&trace, stored[2].exit, 125);
    assert!(e.contains("belongs to another trace"), "{e}");

    // One byte changed.
    let last = stored.last().unwrap();
    let mut bytes = std::fs::read(&last.path).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&last.path, &bytes).unwrap();
    let e = refusal(&trace, last.exit, 3);
    assert!(e.contains("do not match its digest"), "{e}");
    assert!(e.contains(&last.path.display().to_string()), "{e}");
    // Cut short.
    bytes[at] ^= 0x40;
    std::fs::write(&last.path, &bytes[..bytes.len() - 4096]).unwrap();
    let e = refusal(&trace, last.exit, 3);
    assert!(e.contains("do not match its digest"), "{e}");

    // The first checkpoint is untouched: replay from it still works.
    let out = replay_with(&trace, &["--from", &stored[0].exit.to_string()]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert!(recorded.ends_with(&stdout));

    for t in [&trace, &other] {
        let _ = std::fs::remove_dir_all(t.parent().unwrap());
    }
}

/// A copy of `trace`, its checkpoints included, whose last output (to
/// the console or a relayed stream) has another digest, and the exit that
/// logged it: a replay diverges there.
fn tampered_last_output(trace: &Path) -> (std::path::PathBuf, u64) {
    use journal::Entry;
    let (header, mut log) = read_all(trace);
    let at = log
        .iter()
        .rposition(|e| matches!(e, Entry::ConsoleOut { .. } | Entry::StreamOut { .. }))
        .expect("no output logged");
    let exit = exit_ordinal(&log, at);
    if let Entry::ConsoleOut { digest, .. } | Entry::StreamOut { digest, .. } = &mut log[at] {
        *digest ^= 1;
    }
    let bad = trace.parent().unwrap().join("bad-output");
    write_all(&bad, trace, &header, log);
    let (from, to) = (
        trace.join(trace::checkpoints::CHECKPOINTS_DIR),
        bad.join(trace::checkpoints::CHECKPOINTS_DIR),
    );
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(&from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    // The same header, so the checkpoints are the copy's own.
    let own = trace::checkpoints::list(&bad).unwrap();
    assert!(!own.is_empty() && own.iter().all(|c| !c.foreign), "{own:?}");
    (bad, exit)
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn segments_merge_into_the_replay_from_boot() {
    guest_ready();
    let (trace, out) = record("ckpt-seg", &["--probes"], &["syn_cont", "1000", "2000"]);
    let recorded = expect_status(&out, 0);
    let dir = trace.parent().unwrap().to_owned();
    let db = |name: &str| dir.join(name).to_str().unwrap().to_owned();

    // From boot, taking checkpoints with the capture's state.
    let out = replay_with(
        &trace,
        &["--checkpoint-every", "250ms", "--events", &db("whole.db")],
    );
    expect_status(&out, 0);
    // --jobs 2: every segment in a process of its own, merged.
    let (whole, stored) = assert_segments_replay_as_the_whole(
        &trace,
        &recorded,
        &dir.join("whole.db"),
        &dir.join("jobs.db"),
    );

    // A segment that diverges is replayed once more on the recording's
    // CPU (segments run on any), and a divergence there fails the whole.
    let (bad, exit) = tampered_last_output(&trace);
    let out = replay_with(&bad, &["--jobs", "2", "--no-console"]);
    let stderr = text(&out).1;
    // Checkpoint k is taken after its exit; segment k + 1 starts there.
    let k = 1 + stored.iter().filter(|c| c.exit < exit).count();
    let which = format!("segment {k}/{}", stored.len() + 1);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr
            .matches(&format!(
                "{which} diverged on another host CPU than the recording's"
            ))
            .count(),
        1,
        "{stderr}"
    );
    assert!(
        stderr.contains("replaying it again on the recording's CPU")
            && (stderr.contains("console output") || stderr.contains("standard output"))
            && stderr.contains(&format!("insight: {which} failed")),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&bad);

    // The Slurm job array of docs/scale-out.md, one array task after the
    // other, then its merge job.
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/examples/replay-segments.slurm"
    );
    let segments = 3.to_string();
    let run = |vars: &[(&str, &str)]| {
        let out = std::process::Command::new("bash")
            .arg(script)
            .env("INSIGHT", env!("CARGO_BIN_EXE_insight"))
            .env("TRACE", &trace)
            .env("SEGMENTS", &segments)
            .env("OUT", dir.join("slurm"))
            .envs(vars.iter().copied())
            .output()
            .unwrap();
        expect_status(&out, 0);
    };
    for k in ["1", "2", "3"] {
        run(&[("SLURM_ARRAY_TASK_ID", k)]);
    }
    run(&[("MERGE", "1")]);
    assert!(events_with_stacks(&dir.join("slurm/events.db")) == whole);

    // SIGKILL of a --jobs replay ends its segments too.
    let (mut parent, segments) = jobs_with_segments(&trace, std::process::Stdio::null());
    // Stopped, they cannot finish on their own meanwhile (SIGKILL still
    // ends a stopped process) — once they have asked for it: a segment
    // holds the trace only after that.
    wait_for("the segments holding the trace", || {
        segments
            .iter()
            .all(|&pid| holds_trace(pid, &trace))
            .then_some(())
    });
    let signal = |sig: &str, pids: &[u32]| {
        let _ = std::process::Command::new("kill")
            .arg(sig)
            .args(pids.iter().map(u32::to_string))
            .status();
    };
    signal("-STOP", &segments);
    parent.kill().unwrap();
    parent.wait().unwrap();
    let killed = std::time::Instant::now();
    while segments.iter().any(|&pid| running(pid)) {
        if killed.elapsed().as_secs() >= 10 {
            signal("-KILL", &segments);
            panic!("segments {segments:?} outlived their parent by 10 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Killed, the parent could not remove its directory of the segments'
    // outputs.
    let outputs = format!("insight-segments-{}-", parent.id());
    remove_temp_entries(|name| name.starts_with(&outputs));
    // SIGTERM: the segments are stopped and what finished is said.
    let (parent, segments) = jobs_with_segments(&trace, std::process::Stdio::piped());
    signal("-TERM", &[parent.id()]);
    let out = parent.wait_with_output().unwrap();
    let stderr = text(&out).1;
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("insight: interrupted: ") && stderr.contains("the others were stopped"),
        "{stderr}"
    );
    assert!(!segments.iter().any(|&pid| running(pid)), "{segments:?}");

    // A window with events: the same span of the replay from boot.
    let (from, to) = (stored[stored.len() - 2].exit, stored[stored.len() - 1].exit);
    let out = replay_with(
        &trace,
        &[
            "--from",
            &from.to_string(),
            "--to",
            &to.to_string(),
            "--events",
            &db("window.db"),
        ],
    );
    expect_status(&out, 0);
    let window = events_with_stacks(Path::new(&db("window.db")));
    assert!(!window.is_empty());
    let first = window[0].0.seq;
    let span: Vec<_> = whole
        .iter()
        .filter(|(r, _)| r.seq >= first && r.seq < first + window.len() as u64)
        .cloned()
        .collect();
    assert!(
        span == window,
        "the window's events differ from the same span from boot"
    );
    // The window's database names the threads named before it, as the
    // replay from boot does.
    let threads = |name: &str| {
        events::db::EventDb::open(Path::new(&db(name)))
            .unwrap()
            .threads()
            .unwrap()
    };
    let named = threads("window.db");
    let conn = rusqlite::Connection::open(db("whole.db")).unwrap();
    let mut stmt = conn
        .prepare("SELECT pid, lwpid, comm, first_seq FROM threads")
        .unwrap();
    let before: Vec<(u32, u32, String)> = stmt
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get::<_, i64>(3)?))
        })
        .unwrap()
        .map(Result::unwrap)
        .filter(|t| (t.3 as u64) < first)
        .map(|t| (t.0, t.1, t.2))
        .collect();
    for t in before {
        assert!(named.contains(&t), "{t:?} is not named in the window");
    }

    // A window from and to the first lock call of the thread that calls
    // last, found in the trace's event database.
    std::fs::copy(db("whole.db"), trace.join("events.db")).unwrap();
    let lock = events::abi::Kind::Lock;
    let lwpid = whole
        .iter()
        .rev()
        .find(|(r, _)| r.kind == lock)
        .unwrap()
        .0
        .lwpid;
    let (first_lock, _) = whole
        .iter()
        .find(|(r, _)| r.kind == lock && r.lwpid == lwpid)
        .unwrap();
    let pos = format!("first:lock:{lwpid}");
    let out = replay_with(
        &trace,
        &["--from", &pos, "--to", &pos, "--events", &db("lock.db")],
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("end of the window"), "{stderr}");
    let window = events_with_stacks(Path::new(&db("lock.db")));
    assert!(
        window.iter().any(|(r, _)| r == first_lock),
        "the window {pos} lacks event {first_lock:?}"
    );
    // ... and nothing after it.
    assert_eq!(
        window.last().map(|(r, _)| r),
        Some(first_lock),
        "the window {pos} goes on after its end"
    );
    let out = replay_with(&trace, &["--from", "first:lock:999999"]);
    assert!(text(&out).1.contains("has no LOCK event of thread 999999"));

    // Checkpoints a replay without events took still serve replays that
    // collect them: the first such replay runs from boot and takes them
    // again with what event capture needs; the next starts from them.
    let without_events = || {
        let out = replay_with(&trace, &["--checkpoint-every", "250ms"]);
        expect_status(&out, 0);
        trace::checkpoints::list(&trace).unwrap()
    };
    let fallback = "collected no events, which cannot start event capture: replaying from boot";
    without_events();
    let out = replay_with(&trace, &["--jobs", "2", "--events", &db("refill.db")]);
    let stdout = expect_status(&out, 0);
    let stderr = text(&out).1;
    assert!(
        stderr.contains(&format!("{fallback} in one segment")),
        "{stderr}"
    );
    assert_eq!(stdout, recorded);
    assert!(events_with_stacks(Path::new(&db("refill.db"))) == whole);
    let out = replay_with(&trace, &["--jobs", "2", "--events", &db("again.db")]);
    expect_status(&out, 0);
    let stderr = text(&out).1;
    assert!(stderr.contains("segments replayed faithfully"), "{stderr}");
    assert!(!stderr.contains(fallback), "{stderr}");
    assert!(events_with_stacks(Path::new(&db("again.db"))) == whole);

    // Samples at the recording's marks: checkpoints taken without them
    // are taken again (event numbers count samples), then segments merge
    // to exactly the samples of one replay.
    let sampled = |name: &str| {
        let out = replay_with(
            &trace,
            &[
                "--jobs",
                "2",
                "--events",
                &db(name),
                "--sample-period",
                "1ms",
            ],
        );
        expect_status(&out, 0);
        (text(&out).1, events_with_stacks(Path::new(&db(name))))
    };
    let (stderr, first) = sampled("sampled.db");
    assert!(
        stderr
            .contains("did not sample at the recording's marks, which cannot start event capture")
            && stderr.contains("in one segment"),
        "{stderr}"
    );
    let samples = first
        .iter()
        .filter(|(r, _)| r.kind == events::abi::Kind::Sample)
        .count();
    assert!(samples >= 100, "{samples} samples");
    let (stderr, merged) = sampled("sampled-jobs.db");
    assert!(stderr.contains("segments replayed faithfully"), "{stderr}");
    assert!(
        merged == first,
        "the segments' samples differ from one replay's"
    );

    let stored = without_events();
    let from = stored[stored.len() / 2].exit.to_string();
    let out = replay_with(&trace, &["--from", &from, "--events", &db("from.db")]);
    expect_status(&out, 0);
    let stderr = text(&out).1;
    assert!(stderr.contains(&format!("{fallback}, taking")), "{stderr}");
    assert!(events_with_stacks(Path::new(&db("from.db"))) == whole);
    let _ = std::fs::remove_dir_all(&dir);
}
