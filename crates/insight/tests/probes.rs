//! Probes given at replay (`insight replay --probe`, docs/probes.md) on one
//! recording of the guest's `probe_target`: two threads call
//! `parse_request(method, len)`, the main thread `factorial(6)`
//! recursively, then two children it forks call `parse_request` 10 times
//! each; the program prints how many calls it made, how many had a
//! length over 4096, and the factorial's calls and result.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::*;

/// What probe_target printed about itself.
struct Counts {
    /// parse_request calls of its two threads, and of them with a length
    /// over 4096.
    calls: u64,
    over: u64,
    /// Per worker thread, by its lwpid: (calls, over 4096).
    threads: BTreeMap<u64, (u64, u64)>,
    factorial_calls: u64,
    /// Its write() calls.
    writes: u64,
}

/// The value after `key` on the line of probe_target's output that starts
/// with `start`, the `nth` such line.
fn field(stdout: &str, start: &str, nth: usize, key: &str) -> u64 {
    let line = (stdout.lines())
        .filter(|l| l.starts_with(&format!("probe_target: {start}")))
        .nth(nth)
        .unwrap_or_else(|| panic!("no line {nth} '{start}' in {stdout}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == key).unwrap();
    words[at + 1].parse().unwrap()
}

/// The recording the tests probe, and the program's own counts; each of
/// its 2 children makes 10 more calls.
fn recording() -> &'static (PathBuf, Counts) {
    static RECORDING: OnceLock<(PathBuf, Counts)> = OnceLock::new();
    RECORDING.get_or_init(|| {
        guest_ready();
        let (trace, out) = record("probes", &[], &["probe_target", "60", "2"]);
        let stdout = expect_status(&out, 0);
        assert_eq!(field(&stdout, "children", 0, "children"), CHILDREN);
        assert_eq!(field(&stdout, "children", 0, "calls_each"), 10);
        let threads = (0..2)
            .map(|i| {
                let tid = field(&stdout, "thread", i, "thread");
                let calls = field(&stdout, "thread", i, "calls");
                (tid, (calls, field(&stdout, "thread", i, "over_4096")))
            })
            .collect();
        let counts = Counts {
            calls: field(&stdout, "parse_request", 0, "calls"),
            over: field(&stdout, "parse_request", 0, "over_4096"),
            threads,
            factorial_calls: field(&stdout, "factorial", 0, "calls"),
            writes: field(&stdout, "writes", 0, "writes"),
        };
        (trace, counts)
    })
}

/// Per thread of the main process (pid `pid`): its lwpid and calls.
fn thread_calls(probe: &serde_json::Value, pid: u64) -> BTreeMap<u64, u64> {
    (probe["threads"].as_array().unwrap().iter())
        .filter(|t| t["pid"] == pid)
        .map(|t| (t["lwpid"].as_u64().unwrap(), t["calls"].as_u64().unwrap()))
        .collect()
}

/// Replays the recording with `probes` into `db`; the report's JSON.
fn probe_report(db: &Path, probes: &[&str]) -> serde_json::Value {
    let mut extra = vec!["--no-console"];
    for p in probes {
        extra.extend(["--probe", p]);
    }
    let out = replay_into(&recording().0, db, &extra);
    expect_status(&out, 0);
    report_json("probes", db, &[])
}

/// The children probe_target forks, and their calls each.
const CHILDREN: u64 = 2;
const CHILD_CALLS: u64 = CHILDREN * 10;

fn probe(report: &serde_json::Value, id: u64) -> &serde_json::Value {
    report["probes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == id)
        .unwrap_or_else(|| panic!("no probe {id} in {report}"))
}

fn value<'a>(probe: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    probe["values"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no value {name} in {probe}"))
}

#[test]
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
fn probes_count_what_the_program_counts_and_capture_its_values() {
    let counts = &recording().1;
    let (calls, over, factorial_calls) = (counts.calls, counts.over, counts.factorial_calls);
    // The program's own: (lwpid -> calls), (lwpid -> of them over 4096).
    let own_calls: BTreeMap<u64, u64> = counts.threads.iter().map(|(&t, c)| (t, c.0)).collect();
    let own_over: BTreeMap<u64, u64> = counts.threads.iter().map(|(&t, c)| (t, c.1)).collect();
    let dir = scratch("probes-values");
    let db = dir.join("events.db");
    // factorial's first statement, as the workload's source has it.
    let source = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../images/workloads/probe_target.c"),
    )
    .unwrap();
    let line = 1 + source
        .lines()
        .position(|l| l.trim() == "factorial_calls++;")
        .unwrap();
    let line_probe = format!("probe_target.c:{line} capture rdi");
    let report = probe_report(
        &db,
        &[
            "parse_request capture arg1, str(arg0), ustack if arg1 > 4096",
            "factorial return capture arg0, retval",
            "parse_request return capture retval, requests",
            &line_probe,
            "libc.so.6:pthread_mutex_lock capture ustack",
            "libc.so.6:write capture arg2",
        ],
    );
    // Entry, with a condition and a string.
    let p1 = probe(&report, 1);
    assert_eq!(p1["calls"], over, "{p1}");
    let pid = p1["threads"][0]["pid"].as_u64().unwrap();
    assert_eq!(thread_calls(p1, pid), own_over, "per thread: {p1}");
    let len = value(p1, "arg1");
    assert_eq!(
        (len["min"].as_i64(), len["max"].as_i64()),
        (Some(5000), Some(9000))
    );
    let methods: Vec<&str> = value(p1, "str(arg0)")["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["text"].as_str().unwrap())
        .collect();
    let mut sorted = methods.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, ["GET", "POST", "PUT"]);
    // The stacks name the caller, from the program's call-frame
    // information.
    let stacks = p1["stacks"].as_array().unwrap();
    assert!(!stacks.is_empty(), "{p1}");
    assert!(
        stacks[0]["frames"][0]
            .as_str()
            .unwrap()
            .starts_with("worker+"),
        "{p1}"
    );
    // Return, through a recursion six deep.
    let p2 = probe(&report, 2);
    assert_eq!(p2["calls"], factorial_calls, "{p2}");
    let (n, r) = (value(p2, "arg0"), value(p2, "retval"));
    assert_eq!((n["min"].as_i64(), n["max"].as_i64()), (Some(1), Some(6)));
    assert_eq!((r["min"].as_i64(), r["max"].as_i64()), (Some(1), Some(720)));
    // 1 + 2 + 6 + 24 + 120 + 720: each return matched its own call.
    assert_eq!(r["mean"].as_f64().unwrap() * 6.0, 873.0, "{p2}");
    assert_eq!(value(p2, "duration_ns")["count"], factorial_calls);
    // Return of a function two threads run at once, and the children the
    // process forks (its code at the same addresses); a global variable as
    // it was at the entry (a child's starts from its parent's count).
    let p3 = probe(&report, 3);
    assert_eq!(p3["calls"], calls + CHILD_CALLS, "{p3}");
    assert_eq!(value(p3, "retval")["max"], 18000);
    let requests = value(p3, "requests");
    assert_eq!(
        (requests["min"].as_u64(), requests["max"].as_u64()),
        (Some(0), Some(calls + 9))
    );
    let mut by_pid: std::collections::BTreeMap<u64, u64> = Default::default();
    for t in p3["threads"].as_array().unwrap() {
        *by_pid.entry(t["pid"].as_u64().unwrap()).or_default() += t["calls"].as_u64().unwrap();
    }
    let per_process: Vec<u64> = by_pid.values().copied().collect();
    assert_eq!(per_process, [calls, 10, 10], "{p3}");
    assert_eq!(thread_calls(p3, pid), own_calls, "per thread: {p3}");
    // A source line (factorial's first statement), and a register there.
    let p4 = probe(&report, 4);
    assert_eq!(p4["calls"], factorial_calls, "{p4}");
    assert_eq!(value(p4, "rdi")["max"], 6);
    // A function of a shared library (found in the dynamic linker's list),
    // under one of its names (glibc's own is __pthread_mutex_lock): every
    // parse_request call takes the lock once, from one place.
    let p5 = probe(&report, 5);
    assert!(p5["calls"].as_u64().unwrap() >= calls, "{p5}");
    let top = &p5["stacks"][0];
    assert_eq!(top["count"], calls, "{p5}");
    assert!(
        top["frames"][0]
            .as_str()
            .unwrap()
            .starts_with("parse_request+"),
        "{p5}"
    );
    assert!(
        top["frames"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str().unwrap().contains("libc.so.6")),
        "the stack goes on through libc: {p5}"
    );
    let lib_calls = p5["calls"].as_u64().unwrap();
    // glibc's write() of the program's own lines, and no other process's.
    let p6 = probe(&report, 6);
    assert_eq!(p6["calls"], counts.writes, "{p6}");
    assert_eq!(thread_calls(p6, pid).values().sum::<u64>(), counts.writes);
    // One row per hit.
    let csv = insight()
        .args(["report", "probes", "--csv"])
        .arg(&db)
        .output()
        .unwrap();
    let csv = expect_status(&csv, 0);
    let rows = csv.lines().skip(1).count() as u64;
    assert_eq!(
        rows,
        over + factorial_calls + calls + CHILD_CALLS + factorial_calls + lib_calls + counts.writes,
        "{csv}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
fn probe_events_are_the_same_in_every_replay() {
    let dir = scratch("probes-again");
    let specs = [
        "parse_request return capture arg1, retval",
        "factorial capture arg0",
    ];
    let mut seen = Vec::new();
    for round in 0..2 {
        let db = dir.join(format!("events-{round}.db"));
        probe_report(&db, &specs);
        let probe_rows: Vec<String> = rows(&db)
            .into_iter()
            .filter(|r| {
                matches!(
                    r.kind,
                    events::abi::Kind::Probe | events::abi::Kind::ProbeReturn
                )
            })
            .map(|r| format!("{r:?}"))
            .collect();
        assert!(!probe_rows.is_empty());
        let values = events::db::EventDb::open(&db)
            .unwrap()
            .probe_values()
            .unwrap();
        let mut values: Vec<String> = values.into_iter().map(|v| format!("{v:?}")).collect();
        values.sort();
        seen.push((probe_rows, values));
    }
    assert_eq!(seen[0], seen[1]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
#[ignore = "needs the guest image (tools/test runs it)"]
fn bad_probes_are_refused_before_the_replay_boots_naming_the_nearest() {
    let trace = &recording().0;
    let refused = |spec: &str| -> String {
        let out = replay_with(trace, &["--no-console", "--probe", spec]);
        assert!(!out.status.success(), "{spec} was accepted");
        let (stdout, stderr) = text(&out);
        assert!(
            !stdout.contains("probe_target:"),
            "{spec}: the replay ran: {stdout}"
        );
        stderr
    };
    assert!(refused("parse_requst").contains("nearest: parse_request"));
    assert!(refused("parse_request capture nosuch").contains("no global variable 'nosuch'"));
    assert!(refused("probe_target.c:2").contains("nearest lines with code"));
    assert!(refused("parse_request capture retval").contains("add 'return'"));
    assert!(refused("libnosuch.so:f").contains("no library 'libnosuch.so'"));
    assert!(refused("libcc.so.6:write").contains("nearest: libc.so.6"));
    assert!(refused("libc.so.6:strlen").contains("indirect function"));
    assert!(refused("libc.so.6:write in nosuchprog").contains("no program 'nosuchprog'"));
    // Two programs' own functions in one replay.
    let out = replay_with(
        trace,
        &[
            "--no-console",
            "--probe",
            "parse_request in probe_target",
            "--probe",
            "main in lock_hold",
        ],
    );
    assert!(
        text(&out).1.contains("functions of different programs"),
        "{out:?}"
    );
}

/// Records `command`, which runs `probe_target 5` and `probe_target 7 1`
/// (one child), and replays it probing `parse_request` and
/// `libc.so.6:write`: each run counted from its own start, its library
/// at its own address (2 x 5, 2 x 7 and the child's 10), and every write
/// of both (the shell is static: it has no libc.so.6; the image's
/// busybox, so `--image`). The trace, the event database and the replay's
/// standard error.
fn two_runs_probed(name: &str, command: &str) -> (PathBuf, PathBuf, String) {
    guest_ready();
    let (trace, out) = record(name, &["--image"], &["sh", "-c", command]);
    let stdout = expect_status(&out, 0);
    let writes: u64 = (0..2).map(|i| field(&stdout, "writes", i, "writes")).sum();
    let db = trace.with_file_name("events.db");
    let out = replay_into(
        &trace,
        &db,
        &[
            "--no-console",
            "--probe",
            "parse_request",
            "--probe",
            "libc.so.6:write",
        ],
    );
    let stderr = text(&out).1;
    expect_status(&out, 0);
    let report = report_json("probes", &db, &[]);
    let mut by_pid: BTreeMap<u64, u64> = BTreeMap::new();
    for t in probe(&report, 1)["threads"].as_array().unwrap() {
        *by_pid.entry(t["pid"].as_u64().unwrap()).or_default() += t["calls"].as_u64().unwrap();
    }
    let mut per_process: Vec<u64> = by_pid.into_values().collect();
    per_process.sort_unstable();
    assert_eq!(per_process, [10, 10, 14], "{report}");
    assert_eq!(probe(&report, 2)["calls"], writes, "{report}");
    (trace, db, stderr)
}

#[test]
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
fn every_run_of_the_program_is_probed_one_after_the_other() {
    let (trace, _, _) = two_runs_probed("probes-runs", "probe_target 5; probe_target 7 1");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

#[test]
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
fn programs_running_at_once_are_each_probed_from_its_start() {
    // The first pauses 2 s between its threads' calls and its writes; the
    // second runs meanwhile.
    let (trace, db, stderr) = two_runs_probed(
        "probes-at-once",
        "probe_target 5 0 2000 & probe_target 7 1; wait",
    );
    assert!(
        stderr.contains("every process that runs probe_target")
            && stderr.contains("every process that loads libc.so.6"),
        "{stderr}"
    );
    // They ran at once: two processes' hits interleave.
    let mut spans: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for row in rows(&db)
        .iter()
        .filter(|r| r.kind == events::abi::Kind::Probe)
    {
        let span = spans.entry(row.pid).or_insert((row.seq, row.seq));
        span.1 = row.seq;
    }
    let overlap = spans
        .values()
        .any(|a| (spans.values()).any(|b| a != b && a.0 < b.1 && b.0 < a.1));
    assert!(overlap, "{spans:?}");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

#[test]
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
fn a_child_is_probed_after_its_parent_ended() {
    // The child sleeps 1 s before its calls, and the program does not
    // wait for it (cat waits for the pipe's end: the child's exit).
    let (trace, db, _) = two_runs_probed(
        "probes-orphan",
        "probe_target 5 0 0; probe_target 7 1 1000 | cat",
    );
    let rows = rows(&db);
    let probe_pids: std::collections::BTreeSet<u32> = (rows.iter())
        .filter(|r| r.kind == events::abi::Kind::Probe)
        .map(|r| r.pid)
        .collect();
    // The child: the last process probed; its parent: the one before.
    let pids: Vec<u32> = probe_pids.into_iter().collect();
    let (parent, child) = (pids[pids.len() - 2], pids[pids.len() - 1]);
    let parent_exit = (rows.iter())
        .filter(|r| r.kind == events::abi::Kind::Exit && r.pid == parent)
        .map(|r| r.seq)
        .max()
        .unwrap_or_else(|| panic!("no exit of {parent}"));
    let child_first = (rows.iter())
        .filter(|r| r.kind == events::abi::Kind::Probe && r.pid == child && r.value == Some(1))
        .map(|r| r.seq)
        .min()
        .unwrap();
    assert!(parent_exit < child_first, "{parent_exit} {child_first}");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

/// The calls of probe 1 and 2 (`parse`, `fib` of probe_calls) a replay of
/// `trace` with `probes` counts.
fn host_program_calls(trace: &Path, probes: &[&str]) -> (u64, u64) {
    let db = trace.with_extension("db");
    let mut extra = vec!["--no-console"];
    for p in probes {
        extra.extend(["--probe", p]);
    }
    expect_status(&replay_into(trace, &db, &extra), 0);
    let report = report_json("probes", &db, &[]);
    let calls = |id| probe(&report, id)["calls"].as_u64().unwrap();
    (calls(1), calls(2))
}

/// "probe_calls: parse=P fib=F" -> (P, F).
fn own_calls(stdout: &str) -> (u64, u64) {
    let line = (stdout.lines())
        .find_map(|l| l.strip_prefix("probe_calls: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    let count = |key: &str| -> u64 {
        (line.split_whitespace())
            .find_map(|w| w.strip_prefix(key)?.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {line}"))
    };
    (count("parse="), count("fib="))
}

#[test]
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
fn a_program_from_the_host_is_probed_by_name_and_by_path() {
    guest_ready();
    let dir = scratch("probes-host");
    let prog = compile_test_program(&dir, "probe_calls", &["-O1", "-g", "-pthread"]);
    let path = prog.to_str().unwrap();

    // Recorded by its path from its directory, as users do.
    let trace = dir.join("by-path");
    let mut cmd = insight();
    cmd.current_dir(&dir)
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .args(["--", "./probe_calls"]);
    let own = own_calls(&expect_status(&cmd.output().unwrap(), 0));
    assert_eq!(host_program_calls(&trace, &["parse", "fib"]), own);
    let by_path = [format!("{path}:parse"), format!("{path}:fib")];
    let by_path: Vec<&str> = by_path.iter().map(String::as_str).collect();
    assert_eq!(host_program_calls(&trace, &by_path), own);

    // From a config that puts it on the command's PATH.
    let config = dir.join("vm.toml");
    std::fs::write(
        &config,
        format!(
            "command = [\"probe_calls\"]\n[env]\nPATH = \"/opt/app/bin:/usr/bin:/bin\"\n\
             [[files]]\nhost = \"{path}\"\nguest = \"/opt/app/bin/probe_calls\"\n"
        ),
    )
    .unwrap();
    let trace = dir.join("by-config");
    let out = insight()
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .arg(&config)
        .output()
        .unwrap();
    let own = own_calls(&expect_status(&out, 0));
    assert_eq!(host_program_calls(&trace, &["parse", "fib"]), own);
    std::fs::remove_dir_all(&dir).unwrap();
}
