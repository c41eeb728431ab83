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
    record_locks_sampled(dir, extra, &[], command)
}

/// [`record_locks`], the replay given `replay` too (`--diagnose profile`
/// for samples in the database).
fn record_locks_sampled(
    dir: &Path,
    extra: &[&str],
    replay: &[&str],
    command: &[&str],
) -> (String, serde_json::Value) {
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
    let replayed = replay_into(&trace, &db, replay);
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

/// The hold slices of the timeline of `dir/events.db`, as (start, end)
/// in nanoseconds of the VM's time, in order.
fn hold_slices(dir: &Path) -> Vec<(i64, i64)> {
    let json = dir.join("timeline.json");
    let mut cmd = insight();
    cmd.args(["report", "timeline"])
        .arg(dir.join("events.db"))
        .arg("-o")
        .arg(&json);
    expect_status(&output_within(cmd, std::time::Duration::from_secs(300)), 0);
    let page: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let mut holds: Vec<(i64, i64)> = page["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"].as_str().is_some_and(|n| n.starts_with("hold ")))
        .map(|e| {
            let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
            (
                (ts * 1000.0).round() as i64,
                ((ts + dur) * 1000.0).round() as i64,
            )
        })
        .collect();
    holds.sort_unstable();
    holds
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
    let sampled = ["--diagnose", "profile"];
    let (_, report) = record_locks_sampled(
        &dir,
        &["--file", input],
        &sampled,
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
    assert_reads_as_a_newcomer_would(&dir, "pigz");

    // sysbench threads: its threads meet at a barrier of its own (a mutex
    // and a condition variable) before they lock and yield.
    let sysbench = installed("sysbench");
    let (stdout, report) = record_locks_sampled(
        &dir,
        &[],
        &sampled,
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
    assert_reads_as_a_newcomer_would(&dir, "sysbench");

    // Recorded without the probe library, the reports say what to do.
    let trace = dir.join("plain");
    let mut cmd = insight();
    cmd.current_dir(&dir)
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .args(["--", &sysbench, "--version"]);
    expect_status(&output_within(cmd, std::time::Duration::from_secs(300)), 0);
    let mut cmd = insight();
    cmd.arg("replay")
        .arg(&trace)
        .args(["--diagnose", "locks", "--diagnose", "profile"]);
    let out = output_within(cmd, std::time::Duration::from_secs(300));
    let said = expect_status(&out, 0) + &text(&out).1;
    for hint in [
        "(no lock events: lock calls raise events in programs recorded with `insight record \
         --probes`)",
        "record the program with `insight record --probes`",
    ] {
        assert!(said.contains(hint), "no hint {hint:?}: {said}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The text reports of `dir/events.db` (a replay of `program` recorded
/// with `--probes`): durations with their units, never raw counts of
/// microseconds; the note that on one vCPU contention comes from
/// preemption; a user-code profile that names the program's share of
/// the guest kernel in one line.
fn assert_reads_as_a_newcomer_would(dir: &Path, program: &str) {
    let db = dir.join("events.db");
    let report = |args: &[&str]| {
        let mut cmd = insight();
        cmd.arg("report").args(args).arg(&db);
        expect_status(&output_within(cmd, std::time::Duration::from_secs(300)), 0)
    };
    let locks = report(&["locks"]);
    let unit = regex_like_duration(&locks);
    assert!(unit, "{program}: no duration with its unit: {locks}");
    assert!(
        locks.contains("The guest has one vCPU: a thread finds a lock held only where its holder"),
        "{program}: {locks}"
    );
    let profile = report(&["profile", "--user"]);
    assert!(
        profile.contains(", user code only: ") && profile.contains("more in the guest kernel, "),
        "{program}: {profile}"
    );
}

/// Whether `text` has a duration as the reports write them: a number and
/// one of ns, µs, ms, s.
fn regex_like_duration(text: &str) -> bool {
    let words: Vec<&str> = text.split_whitespace().collect();
    words.windows(2).any(|w| {
        w[0].parse::<f64>().is_ok()
            && ["ns", "µs", "ms", "s"].contains(&w[1].trim_end_matches([',', ';', ')']))
    })
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
    // hold. On the guest's one vCPU a holder may also be preempted
    // between the acquisition and its first read (the first hold, while
    // the main thread creates the second thread, is the longest): time
    // the report counts, and says was spent off the CPU, and the program
    // cannot see.
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
    // The longest hold is the maximum, by one of the two threads, and
    // says its time off the CPU, no more than it lasted.
    let longest = &held["longest_hold"];
    assert_eq!(longest["ns"], hold["max_ns"], "{held:#}");
    assert!(
        longest["off_cpu_ns"].as_u64() <= longest["ns"].as_u64(),
        "{held:#}"
    );
    // Hold by hold, against the timeline's slices (one lock: its holds
    // follow one another). The program's clock is the guest's
    // CLOCK_MONOTONIC, the report's the VM's: they differ by a constant,
    // which the releases give (timed by the exit of the program's last
    // reading, exactly).
    let own: Vec<(i64, i64)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("hold "))
        .map(|l| {
            let mut w = l.split_whitespace().map(|v| v.parse::<i64>().unwrap());
            (w.next().unwrap(), w.next().unwrap())
        })
        .collect();
    let reported = hold_slices(&dir);
    assert_eq!(reported.len(), own.len(), "{reported:?}\n{stdout}");
    // The longest hold is one of the timeline's (which has microseconds
    // with three decimals).
    let (start, ns) = (
        longest["start_ns"].as_i64().unwrap(),
        longest["ns"].as_i64().unwrap(),
    );
    assert!(
        reported
            .iter()
            .any(|r| (r.0 - start).abs() <= 1 && (r.1 - start - ns).abs() <= 1),
        "{longest:#} in {reported:?}"
    );
    let mut offsets: Vec<i64> = reported.iter().zip(&own).map(|(r, o)| r.1 - o.1).collect();
    offsets.sort_unstable();
    let offset = offsets[offsets.len() / 2];
    let exact = offsets
        .iter()
        .filter(|&&d| (d - offset).abs() < 20_000)
        .count();
    assert!(4 * exact >= 3 * own.len(), "releases: {offsets:?}");
    let mut excess = Vec::new();
    for (r, o) in reported.iter().zip(&own) {
        // Every hold covers the program's own.
        assert!(
            r.0 - offset <= o.0 + 20_000 && r.1 - offset >= o.1 - 20_000,
            "hold {r:?} (less {offset}) does not cover the program's {o:?}"
        );
        excess.push((r.1 - r.0) - (o.1 - o.0));
    }
    // What the measure adds to a hold, typically: the exit where the
    // holder, switched in, returns to user mode times the acquisition
    // (patch 0033), and the program's first reading comes one exit and a
    // few user instructions later (0.10 to 0.17 ms median on these
    // hosts). Before, the exit at the switch timed it, and the interpreted
    // kernel's way back to user mode (0.12 to 0.35 ms, medians of 0.77
    // and 2.3 ms on a loaded host) counted in the hold. Host load
    // stretches the program's own holds alike: a stall of the vCPU in a
    // hold's last loop ends it late, and the program counts that (its
    // median 2-ms hold measured 2.06 to 8.1 ms in four recordings on a
    // host at load 3 to 10). So the median excess is held to an eighth of
    // the program's median hold, measured in the same run: about 0.25 ms
    // where the host stalls the program's loop little.
    excess.sort_unstable();
    let median_excess = excess[excess.len() / 2];
    let mut own_holds: Vec<i64> = own.iter().map(|o| o.1 - o.0).collect();
    own_holds.sort_unstable();
    let own_median = own_holds[own_holds.len() / 2];
    assert!(
        8 * median_excess < own_median,
        "excess per hold (ns): {excess:?}, the program's holds: {own_holds:?}"
    );
    eprintln!(
        "hold_clock: the program's own average {own_avg} ns, max {own_max} ns; the report's \
         {avg} ns, max {max} ns, {} % of the hold time off the CPU; median hold {} us longer \
         than the program's own",
        100 * off / hold["total_ns"].as_u64().unwrap(),
        median_excess / 1000
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
