//! Helpers shared by the end-to-end tests.
#![allow(dead_code)]

pub mod gdb_scripts;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn insight() -> Command {
    Command::new(env!("CARGO_BIN_EXE_insight"))
}

/// Checks that a test that boots the guest can run here (such tests are
/// `#[ignore]`d: `tools/test` runs them on hosts with KVM): fails, saying
/// what is missing, if /dev/kvm or the guest image is not there.
pub fn guest_ready() {
    kvm_ready();
    guest_kernel();
}

/// The guest image's kernel; fails, naming tools/build-guest, if the image
/// has not been built.
pub fn guest_kernel() -> PathBuf {
    let kernel = guest::image::default_kernel();
    assert!(
        kernel.exists(),
        "no guest image at {}: run tools/build-guest first",
        kernel.display()
    );
    kernel
}

/// Fails if /dev/kvm does not exist: a test that needs KVM was asked to
/// run where there is none.
pub fn kvm_ready() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm, which this machine does not have"
    );
}

/// A directory of this test process's own for `name`'s files, under the
/// system's temporary directory. Tests remove theirs when they pass; what
/// a failed or killed run (or a recording shared by a binary's tests,
/// which lives as long as the process) left behind is removed by the
/// next run of any test binary, once the process that made it has gone.
pub fn scratch(name: &str) -> PathBuf {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(sweep_scratch_of_ended_processes);
    let dir = std::env::temp_dir().join(format!("{SCRATCH_PREFIX}{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const SCRATCH_PREFIX: &str = "insight-e2e-";

/// Removes the scratch directories of test processes that no longer run.
fn sweep_scratch_of_ended_processes() {
    remove_temp_entries(|name| {
        (name.strip_prefix(SCRATCH_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    });
}

/// Removes what the system's temporary directory holds under a name
/// `doomed` picks.
pub fn remove_temp_entries(doomed: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_str().is_some_and(&doomed) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Compiles tests/programs/`name`.c with gcc and `flags` into `dir`;
/// returns the program.
pub fn compile_test_program(dir: &Path, name: &str, flags: &[&str]) -> PathBuf {
    let prog = dir.join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/programs")
        .join(format!("{name}.c"));
    let cc = Command::new("gcc")
        .args(flags)
        .arg("-o")
        .arg(&prog)
        .arg(&src)
        .status()
        .expect("gcc is needed to build the test program");
    assert!(cc.success(), "gcc failed on {}", src.display());
    prog
}

/// The workload `name` built natively as the guest image builds it, with
/// `flags` (optimisation, frame pointers) into `dir`.
pub fn build_workload(dir: &Path, name: &str, flags: &[&str]) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../images/workloads")
        .join(format!("{name}.c"));
    let prog = dir.join(format!("{name}{}", flags.concat()));
    let cc = std::process::Command::new("gcc")
        .args(flags)
        .args(["-g", "-pthread", "-o"])
        .arg(&prog)
        .arg(&src)
        .status()
        .expect("gcc is needed to build the workload natively");
    assert!(cc.success(), "gcc failed on {}", src.display());
    prog
}

/// Runs `cmd` with `input` on its standard input (then closed); returns
/// its output.
pub fn output_with_input(mut cmd: Command, input: &[u8]) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input).unwrap();
    }
    child.wait_with_output().unwrap()
}

pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts the exit status of a finished `insight`; returns its stdout.
pub fn expect_status(out: &Output, status: i32) -> String {
    let (stdout, stderr) = text(out);
    assert_eq!(
        out.status.code(),
        Some(status),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

/// `insight report TOOL --json EXTRA.. DB`, which must succeed: its
/// report.
pub fn report_json(tool: &str, db: &Path, extra: &[&str]) -> serde_json::Value {
    let out = insight()
        .args(["report", tool, "--json"])
        .args(extra)
        .arg(db)
        .output()
        .unwrap();
    let json = expect_status(&out, 0);
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("report {tool}: {e}:\n{json}"))
}

/// Runs `insight` with `args`; asserts its exit status; returns stdout.
pub fn run_expecting<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
    status: i32,
) -> String {
    expect_status(&insight().args(args).output().unwrap(), status)
}

pub fn host_has_avx() -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.split_whitespace().any(|w| w == "avx"))
        .unwrap_or(false)
}

/// A lock event of thread 8 of process 7 on the mutex at 0x1000.
pub fn lock_row(time: u64, kind: events::abi::Kind) -> events::db::Row {
    events::db::Row {
        seq: 0,
        time,
        kind,
        source: events::abi::Source::Probe,
        pid: 7,
        lwpid: 8,
        addr: Some(0x1000),
        caller: Some(0x40_0000),
        value: None,
    }
}

/// Every event of the database at `db`, in order.
pub fn rows(db: &Path) -> Vec<events::db::Row> {
    let db = events::db::EventDb::open(db).unwrap();
    let mut rows = Vec::new();
    db.for_each(&[], |r| {
        rows.push(r);
        Ok(())
    })
    .unwrap();
    rows
}

/// Events in order, each with its stack if replay unwound one.
pub type EventsWithStacks = Vec<(events::db::Row, Option<Vec<u64>>)>;

/// Every event of the database at `db`, with its stack.
pub fn events_with_stacks(db: &Path) -> EventsWithStacks {
    let db = events::db::EventDb::open(db).unwrap();
    let mut all = Vec::new();
    db.for_each_with_stacks(&[], |r, stack| {
        all.push((r, stack.map(<[u64]>::to_vec)));
        Ok(())
    })
    .unwrap();
    all
}

/// How many times the end-to-end tests replay a recording: once taking
/// checkpoints and once as a user's plain replay (each must match the
/// recording at every exit, so a third adds nothing the two do not check).
pub const REPLAYS: usize = 2;

/// Records `command` into a new trace (`extra`: more `record` arguments);
/// returns the trace and the output.
pub fn record(name: &str, extra: &[&str], command: &[&str]) -> (PathBuf, Output) {
    let trace = scratch(name).join("trace");
    let out = record_into(&trace, extra, command);
    (trace, out)
}

/// Records `command` into the trace directory `trace` (`extra`: more
/// `record` arguments); returns the output.
pub fn record_into(trace: &Path, extra: &[&str], command: &[&str]) -> Output {
    let mut cmd = insight();
    cmd.args(["record", "--no-stdin", "-o"])
        .arg(trace)
        .args(extra)
        .arg("--")
        .args(command);
    output_within(cmd, RECORD_LIMIT)
}

/// Records `command` (`extra`: more `record` arguments), which must exit
/// with `status`, `check`s the trace and the recording's output, replays it
/// REPLAYS times (assert_replays_identically) and removes it; returns what
/// the recording printed.
pub fn record_and_replay(
    name: &str,
    extra: &[&str],
    command: &[&str],
    status: i32,
    check: impl FnOnce(&Path, &Output),
) -> String {
    let (trace, out) = record(name, extra, command);
    let stdout = expect_status(&out, status);
    check(&trace, &out);
    assert_replays_identically(&trace, &stdout);
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
    stdout
}

/// Longer than any recording the tests make takes, with room for a slow
/// host: a recording still running then hangs (the failure preemption of
/// user code exists to prevent), and the test says so instead of waiting.
const RECORD_LIMIT: Duration = Duration::from_secs(600);

/// Polls `found` every few milliseconds until it gives something; fails
/// naming `what` after two minutes (a slow host's worst, far beyond what
/// the tests wait for).
pub fn wait_for<T>(what: &str, mut found: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(t) = found() {
            return t;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{what}: not after 120 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs `cmd` (standard input closed) to its end, or kills it after
/// `limit` and fails.
pub fn output_within(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let started = Instant::now();
    let (done, waiting) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match waiting.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!(
                "{:?} was still running after {:.0} s",
                cmd,
                started.elapsed().as_secs_f64()
            );
        }
    }
}

pub fn replay(trace: &Path) -> Output {
    replay_with(trace, &[])
}

/// Replays `trace` with more `replay` arguments.
pub fn replay_with(trace: &Path, extra: &[&str]) -> Output {
    let mut cmd = insight();
    cmd.arg("replay").arg(trace).args(extra);
    output_within(cmd, RECORD_LIMIT)
}

/// Replays `trace` with `--events db` and `extra`, more `replay`
/// arguments; returns the output.
pub fn replay_into(trace: &Path, db: &Path, extra: &[&str]) -> Output {
    let db = db.to_str().expect("a scratch path in UTF-8");
    replay_with(trace, &[&["--events", db], extra].concat())
}

/// Replays `trace` REPLAYS times and checks that every replay matched the
/// recording and printed exactly what it printed; returns the replays'
/// standard error.
pub fn assert_replays_identically(trace: &Path, recorded_stdout: &str) -> Vec<String> {
    let stderrs = (1..=REPLAYS)
        .map(|round| {
            // The first replay also takes checkpoints, restored below.
            let out = if round == 1 {
                replay_with(trace, &["--checkpoint-every", CHECKPOINT_EVERY])
            } else {
                replay(trace)
            };
            let (stdout, stderr) = text(&out);
            assert_eq!(
                out.status.code(),
                Some(0),
                "replay {round} of {}: {stderr}",
                trace.display()
            );
            assert!(stderr.contains("replay matched the recording"), "{stderr}");
            assert!(
                stdout == recorded_stdout,
                "replay {round} printed something else.\nrecorded:\n{recorded_stdout}\nreplayed:\n{stdout}"
            );
            stderr
        })
        .collect();
    assert_checkpoints_replay_faithfully(trace, recorded_stdout);
    stderrs
}

/// How often the determinism suite's first replay takes a checkpoint
/// (recorded guest time: a few per workload, which starts from a boot
/// snapshot).
pub const CHECKPOINT_EVERY: &str = "500ms";

/// Restores the middle and the last checkpoint of `trace` (all of them:
/// `checkpoints.rs`; the first would replay almost the whole run again)
/// and replays from each to the end: each must match the recording, and
/// print the end of what it printed.
pub fn assert_checkpoints_replay_faithfully(trace: &Path, recorded_stdout: &str) {
    let stored = trace::checkpoints::list(trace).unwrap();
    assert!(
        !stored.is_empty(),
        "a replay with --checkpoint-every {CHECKPOINT_EVERY} took no checkpoint of {}",
        trace.display()
    );
    let mut picks = vec![stored.len() / 2, stored.len() - 1];
    picks.dedup();
    for c in picks.into_iter().map(|i| &stored[i]) {
        let from = c.exit.to_string();
        let out = replay_with(trace, &["--from", &from]);
        let (stdout, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(0),
            "replay of {} from the checkpoint at exit {from}: {stderr}",
            trace.display()
        );
        assert!(
            stderr.contains(&format!("restored the checkpoint at exit {from} ")),
            "{stderr}"
        );
        assert!(stderr.contains("replay matched the recording"), "{stderr}");
        assert!(
            recorded_stdout.ends_with(&stdout),
            "replay from exit {from} printed what the recording did not end with.\n\
             recorded:\n{recorded_stdout}\nreplayed:\n{stdout}"
        );
    }
}

/// All log entries of a trace, with its header.
pub fn read_all(trace: &Path) -> (trace::Header, Vec<journal::Entry>) {
    let mut reader = trace::TraceReader::<journal::Entry>::open(trace).unwrap();
    let mut events = Vec::new();
    while let Some(frame) = reader.next_frame().unwrap() {
        events.extend(frame);
    }
    (reader.header.clone(), events)
}

/// Writes `events` as a complete trace with `header`, and the boot
/// snapshot of `original` (the trace they came from), if it has one.
pub fn write_all(
    trace: &Path,
    original: &Path,
    header: &trace::Header,
    events: Vec<journal::Entry>,
) {
    let mut writer = trace::TraceWriter::create(trace, header).unwrap();
    for e in events {
        writer.push(e).unwrap();
    }
    writer.finish().unwrap();
    copy_snapshot(original, trace);
}

/// Writes `events` as the log of an incomplete trace `trace` (a killed
/// recorder's: no completion marker), with `original`'s boot snapshot.
pub fn write_prefix(
    trace: &Path,
    original: &Path,
    header: &trace::Header,
    events: &[journal::Entry],
) {
    let mut writer = trace::TraceWriter::create(trace, header).unwrap();
    for e in events {
        writer.push(e.clone()).unwrap();
    }
    writer.flush().unwrap();
    drop(writer);
    copy_snapshot(original, trace);
}

/// Copies the boot snapshot of trace `from`, if it has one, into `to`.
pub fn copy_snapshot(from: &Path, to: &Path) {
    let snapshot = from.join(trace::SNAPSHOT_FILE);
    if snapshot.exists() {
        std::fs::copy(snapshot, to.join(trace::SNAPSHOT_FILE)).unwrap();
    }
}

/// The ordinal of the exit that the log entry at `at` follows (or is):
/// the exits up to and including it.
pub fn exit_ordinal(log: &[journal::Entry], at: usize) -> u64 {
    log[..=at].iter().filter(|e| e.is_exit()).count() as u64
}

/// Runs `inner`, a shell command line, in `dir` under a terminal that
/// `script` (util-linux) makes, typing `keys` at it; returns its status
/// and what the terminal showed. Standard input stays open (script ends
/// its session at its end) until the command has ended.
pub fn under_terminal(inner: &str, dir: &Path, keys: &[u8]) -> (Option<i32>, String) {
    use std::io::{Read, Write};
    let mut script = Command::new("script")
        .args(["-q", "-e", "-c", inner, "/dev/null"])
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script (util-linux) runs a command under a terminal");
    let mut typing = script.stdin.take().unwrap();
    typing.write_all(keys).unwrap();
    let mut screen = Vec::new();
    script
        .stdout
        .take()
        .unwrap()
        .read_to_end(&mut screen)
        .unwrap();
    drop(typing);
    let status = script.wait().unwrap();
    (status.code(), String::from_utf8_lossy(&screen).into_owned())
}

/// SCTBench's program `name` (tests/programs/sctbench), built as SCTBench
/// builds it.
pub fn sctbench(dir: &Path, name: &str) -> PathBuf {
    std::fs::create_dir_all(dir.join("sctbench")).unwrap();
    compile_test_program(
        dir,
        &format!("sctbench/{name}"),
        &["-pthread", "-g", "-O0", "-w"],
    )
}

/// The events of `whole_db`, a replay from boot, hold a lock event with
/// its stack and the trace at least 3 checkpoints; a `--jobs 2` replay
/// into `jobs_db` gives the `recorded` console output and the same
/// events. Returns the events and the checkpoints.
pub fn assert_segments_replay_as_the_whole(
    trace: &Path,
    recorded: &str,
    whole_db: &Path,
    jobs_db: &Path,
) -> (EventsWithStacks, Vec<trace::checkpoints::StoredCheckpoint>) {
    let whole = events_with_stacks(whole_db);
    assert!(
        whole
            .iter()
            .any(|(r, s)| r.kind == events::abi::Kind::Lock && s.is_some()),
        "no lock event with a stack"
    );
    let stored = trace::checkpoints::list(trace).unwrap();
    assert!(stored.len() >= 3, "{} checkpoints", stored.len());
    // Every segment in a process of its own, merged.
    let out = replay_with(
        trace,
        &["--jobs", "2", "--events", jobs_db.to_str().unwrap()],
    );
    let stdout = expect_status(&out, 0);
    let stderr = text(&out).1;
    assert!(stderr.contains("segments replayed faithfully"), "{stderr}");
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert_eq!(stdout, recorded, "the segments' console output, in order");
    assert!(events_with_stacks(jobs_db) == whole);
    (whole, stored)
}
