//! The lock report on programs users run, against what the programs count
//! themselves: condition variables (whose waits give their mutex up and
//! take it again inside glibc), read-write locks, semaphores and barriers
//! in a program built on the host and recorded by its path, and the stock
//! Debian programs pigz and sysbench, whose locks must all come out
//! consistent (as many releases as acquisitions, nothing that contradicts
//! the lock model).
//!
//! They need /dev/kvm and the guest image (the test command builds it),
//! gcc, pigz and sysbench (the test command installs them).

mod common;

use std::path::Path;

use common::*;

/// Records `command` by its path from `dir` with the probe library
/// (`extra`: more `record` arguments), replays it into an event database
/// and returns what the program printed and `report locks --json`.
fn record_locks(dir: &Path, extra: &[&str], command: &[&str]) -> (String, serde_json::Value) {
    let trace = dir.join("trace");
    let mut cmd = insight();
    cmd.current_dir(dir)
        .args(["record", "--no-stdin", "--probes", "-o"])
        .arg(&trace)
        .args(extra)
        .arg("--")
        .args(command);
    let out = output_within(cmd, std::time::Duration::from_secs(900));
    let stdout = expect_status(&out, 0);
    let db = dir.join("events.db");
    let replayed = replay_into(&trace, &db, &[]);
    expect_status(&replayed, 0);
    let report = report_json("locks", &db, &[]);
    std::fs::remove_dir_all(&trace).unwrap();
    (stdout, report)
}

/// Asserts that no lock event contradicted the model and that every lock
/// was released as often as it was taken.
fn assert_consistent(report: &serde_json::Value) {
    let anomalies = &report["anomalies"];
    for (what, n) in anomalies.as_object().unwrap() {
        assert_eq!(n.as_u64(), Some(0), "{what}: {report:#}");
    }
    let locks = report["locks"].as_array().unwrap();
    assert!(!locks.is_empty(), "{report:#}");
    for l in locks {
        assert_eq!(
            l["acquisitions"], l["hold"]["count"],
            "acquired and released: {l:#}"
        );
    }
}

/// The lock or wait object named `name` in the report's `list`.
fn named<'a>(report: &'a serde_json::Value, list: &str, name: &str) -> &'a serde_json::Value {
    report[list]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {list}: {report:#}"))
}

/// "key N" of the program's line.
fn count(line: &str, key: &str) -> u64 {
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .windows(2)
        .find(|w| w[0] == key)
        .and_then(|w| w[1].parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn condition_variables_rwlocks_semaphores_and_barriers_match_the_programs_own_counts() {
    guest_ready();
    let dir = scratch("sync-queue");
    compile_test_program(&dir, "sync_queue", &["-O2", "-g", "-pthread"]);
    let (stdout, report) = record_locks(&dir, &[], &["./sync_queue", "150"]);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("sync_queue: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(count(line, "items"), 300, "{line}");
    assert_consistent(&report);

    // The queue's mutex: every lock call and every return of a wait on one
    // of its condition variables holds it; the waits are the program's.
    let queue = named(&report, "locks", "queue_lock");
    let waits = count(line, "waits");
    assert_eq!(
        queue["cond_waits"]["count"].as_u64(),
        Some(waits),
        "{line}\n{queue:#}"
    );
    let cond = |name| named(&report, "waits", name);
    let (full, empty) = (cond("not_full"), cond("not_empty"));
    assert_eq!(
        full["waits"].as_u64().unwrap() + empty["waits"].as_u64().unwrap(),
        waits,
        "{report:#}"
    );
    // Signals and the one broadcast, counted by kind.
    let wakeups = full["wakeups"].as_u64().unwrap() + empty["wakeups"].as_u64().unwrap();
    let (signals, broadcasts) = (count(line, "signals"), count(line, "broadcasts"));
    assert_eq!(wakeups, signals + broadcasts, "{report:#}");
    assert_eq!(empty["broadcasts"].as_u64(), Some(broadcasts), "{report:#}");

    // The read-write lock: its read locks shared, its write locks not.
    let totals = named(&report, "locks", "totals");
    let (reads, writes) = (count(line, "reads"), count(line, "writes"));
    assert_eq!(totals["rwlock"], true, "{totals:#}");
    assert_eq!(
        totals["shared_acquisitions"].as_u64(),
        Some(reads),
        "{totals:#}"
    );
    assert_eq!(
        totals["acquisitions"].as_u64(),
        Some(reads + writes),
        "{totals:#}"
    );

    // The semaphore: a wait per item taken, a post per item; the barrier
    // the two consumers meet at.
    let taken = cond("taken");
    assert_eq!(taken["kind"], "semaphore");
    assert_eq!(taken["waits"].as_u64(), Some(count(line, "sem_waits")));
    assert_eq!(taken["wakeups"].as_u64(), Some(count(line, "items")));
    let start = cond("start");
    assert_eq!(
        (start["kind"].as_str(), start["waits"].as_u64()),
        (Some("barrier"), Some(2))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Debian program's path, which the test command installs.
fn installed(program: &str) -> String {
    let path = format!("/usr/bin/{program}");
    assert!(
        Path::new(&path).exists(),
        "{path} is missing: tools/test installs it (apt-get install {program})"
    );
    path
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn pigz_and_sysbench_keep_every_lock_consistent() {
    guest_ready();
    let dir = scratch("sync-stock");
    // pigz -p 4: a reader, compressing threads and a writer hand blocks
    // over through condition variables.
    let pigz = installed("pigz");
    let data: String = (0..40_000)
        .map(|i| format!("line {i} {}\n", i * 7919 % 104_729))
        .collect();
    std::fs::write(dir.join("data.txt"), data).unwrap();
    let input = dir.join("data.txt");
    let input = input.to_str().unwrap();
    let (_, report) = record_locks(
        &dir,
        &["--file", input],
        &[&pigz, "-p", "4", "-k", "-f", input],
    );
    assert_consistent(&report);
    let waited: u64 = report["waits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["waits"].as_u64().unwrap())
        .sum();
    assert!(
        waited > 0,
        "pigz's threads wait on condition variables: {report:#}"
    );
    // Stripped, pigz initialises every lock in one helper: each is named
    // (its static by pigz's offset, the others by the helper's callers),
    // and no two alike.
    let names: Vec<&str> = report["locks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            l["name"]
                .as_str()
                .unwrap_or_else(|| panic!("unnamed: {l:#}"))
        })
        .collect();
    let distinct: std::collections::HashSet<&&str> = names.iter().collect();
    assert_eq!(distinct.len(), names.len(), "{names:#?}");
    assert!(
        names.iter().filter(|n| n.contains(" ← pigz+0x")).count() >= 2,
        "{names:#?}"
    );

    // sysbench threads: its threads meet at a barrier of its own (a mutex
    // and a condition variable) before they lock and yield.
    let sysbench = installed("sysbench");
    let (stdout, report) = record_locks(
        &dir,
        &[],
        &[
            &sysbench,
            "threads",
            "--threads=4",
            "--events=24",
            "--thread-yields=10",
            "--time=0",
            "run",
        ],
    );
    assert!(
        stdout.contains("total number of events:              24"),
        "{stdout}"
    );
    assert_consistent(&report);
    let barrier = report["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["cond_waits"]["count"].as_u64() > Some(0))
        .unwrap_or_else(|| panic!("no mutex of a condition variable's wait: {report:#}"));
    // Its waits are waits, not holds: the hold is short against them.
    assert!(
        barrier["hold"]["total_ns"].as_u64() < barrier["cond_waits"]["total_ns"].as_u64(),
        "{barrier:#}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn hold_times_cover_the_programs_own_and_say_what_the_holder_spent_off_the_cpu() {
    guest_ready();
    let dir = scratch("sync-hold");
    compile_test_program(&dir, "hold_clock", &["-O2", "-g", "-pthread"]);
    let (stdout, report) = record_locks(&dir, &[], &["./hold_clock", "20"]);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("hold_clock: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert_consistent(&report);
    let held = named(&report, "locks", "held");
    let hold = &held["hold"];
    assert_eq!(
        hold["count"].as_u64(),
        Some(count(line, "holds")),
        "{held:#}"
    );
    // The program measures from its first clock read after the lock to
    // its last before the unlock, inside the hold: never more than the
    // hold. Its reads are system calls (the guest has no vDSO clock),
    // each ~1 ms of interpreted kernel, and on the guest's one vCPU a
    // holder is preempted at their returns: what the report says of the
    // time off the CPU.
    let (own_avg, own_max) = (count(line, "avg_ns"), count(line, "max_ns"));
    let (avg, max) = (
        hold["avg_ns"].as_u64().unwrap(),
        hold["max_ns"].as_u64().unwrap(),
    );
    assert!(avg >= own_avg && max >= own_max, "{line}\n{held:#}");
    let off = held["hold_off_cpu_ns"].as_u64().unwrap();
    assert!(
        off > 0 && off < hold["total_ns"].as_u64().unwrap(),
        "{held:#}"
    );
    eprintln!(
        "hold_clock: the program's own average {own_avg} ns, max {own_max} ns; the report's \
         {avg} ns, max {max} ns, {} % of the hold time off the CPU",
        100 * off / hold["total_ns"].as_u64().unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn programs_recorded_by_their_path_get_deadlock_timeline_and_memory_reports() {
    guest_ready();
    let dir = scratch("sync-diagnose");
    // The paper's transitive deadlock program, built on the host.
    let prog = build_workload(&dir, "deadlock_transitive", &["-O1"]);
    let name = prog.file_name().unwrap().to_str().unwrap().to_owned();
    let trace = dir.join("trace");
    let mut cmd = insight();
    cmd.current_dir(&dir)
        .args(["record", "--no-stdin", "--probes", "-o"])
        .arg(&trace)
        .args(["--", &format!("./{name}")]);
    expect_status(&output_within(cmd, std::time::Duration::from_secs(900)), 0);
    let out = replay_with(&trace, &["--diagnose", "deadlock,timeline"]);
    let report = expect_status(&out, 0);
    assert!(report.contains("Potential deadlock"), "{report}");
    assert!(report.contains("deadlock_transitive.c:"), "{report}");
    let page = std::fs::read_to_string(trace.join("events.timeline.html")).unwrap();
    assert!(
        page.contains("L1") && page.contains("hold"),
        "the page names the locks"
    );

    // Memory accesses of a program recorded by its path, by variable (the
    // probe library names its objects).
    compile_test_program(&dir, "mem_access", &["-O1", "-no-pie"]);
    let trace = dir.join("memory");
    let mut cmd = insight();
    cmd.current_dir(&dir)
        .args(["record", "--no-stdin", "--probes", "-o"])
        .arg(&trace)
        .args(["--", "./mem_access"]);
    expect_status(&output_within(cmd, std::time::Duration::from_secs(900)), 0);
    let out = replay_with(&trace, &["--diagnose", "memory"]);
    let report = expect_status(&out, 0);
    let row = report
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| w.len() > 3 && w[1] == "a")
        .unwrap_or_else(|| panic!("no row for a in:\n{report}"));
    assert_eq!((row[2], row[3]), ("2000", "1000"), "{report}");
    std::fs::remove_dir_all(&dir).unwrap();
}
