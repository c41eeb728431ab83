//! Preemption of guest user code while recording (asynchronous points),
//! end to end: programs that only finish when user code is preempted
//! record and replay faithfully, two CPU-bound threads share the CPU while
//! recording as they do in a run, a single busy task runs without the
//! periodic tick (and is still charged its time) while two keep it, a
//! loop that only memory tells apart needs the memory checks, and marks at
//! functions that another enters past their first instruction replay.
//!
//! Like the other end-to-end tests they need /dev/kvm and the guest image
//! (the test command builds it first).

mod common;

use std::path::Path;

use common::*;

/// The asynchronous points a trace holds.
fn async_points(trace: &Path) -> usize {
    let dump = run_expecting([Path::new("dump").as_os_str(), trace.as_os_str()], 0);
    dump.lines().filter(|l| l.contains("async point")).count()
}

/// Records `command`, checks it preempted user code at least once and
/// replays it REPLAYS times; returns the recording's output.
fn record_preempted_and_replay(name: &str, command: &[&str]) -> String {
    record_and_replay(name, &["--summary"], command, 0, |trace, out| {
        let (_, stderr) = text(out);
        let points = async_points(trace);
        assert!(
            points > 0,
            "no asynchronous point in the recording of {command:?}: {stderr}"
        );
        assert!(stderr.contains("asynchronous points"), "{stderr}");
    })
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_busy_waiting_thread_is_preempted_and_replays() {
    guest_ready();
    // The waiter never enters the kernel while it spins: without
    // preemption of user code the main thread never runs again and the
    // recording never ends.
    let stdout = record_preempted_and_replay("spin-flag", &["spin_flag", "5"]);
    assert!(stdout.contains("spin_flag: ok (5 rounds)"), "{stdout}");
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn points_in_loops_whose_back_edge_is_far_from_their_head_replay() {
    guest_ready();
    // Busybox bc's digit loops jump back into the first bytes of the loop
    // from 25 and 43 bytes further on: a trampoline placed over those
    // bytes, with the back edge unseen, made the replay run garbage.
    let stdout = record_preempted_and_replay(
        "busybox-bc",
        &["sh", "-c", "echo 'scale=1000; a(1)*4' | bc -l | head -c 8"],
    );
    assert_eq!(stdout, "3.141592", "{stdout}");
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn spin_lock_holders_preempted_in_their_critical_section_replay() {
    guest_ready();
    let stdout = record_preempted_and_replay("spin-lock", &["spin_lock", "4", "300"]);
    assert!(
        stdout.contains("spin_lock: ok (counter 1200 of 1200"),
        "{stdout}"
    );
}

/// The CPU shares compute_pair printed, one per window.
fn shares(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("window "))
        .filter_map(|l| l.split("thread 0 ").nth(1))
        .filter_map(|l| l.split('%').next())
        .map(|s| s.parse().unwrap())
        .collect()
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn two_cpu_bound_threads_share_the_cpu_while_recording_as_in_a_run() {
    guest_ready();
    // Neither thread enters the kernel between its progress lines; the
    // guest measures each thread's share of the work per 2 s window.
    let command = ["compute_pair", "6"];
    let run = run_expecting(["run", "--no-stdin", "--"].iter().chain(&command), 0);
    let recorded = record_preempted_and_replay("compute-pair", &command);
    for (what, stdout) in [("run", &run), ("recording", &recorded)] {
        let shares = shares(stdout);
        assert!(!shares.is_empty(), "{what}: no window in\n{stdout}");
        for s in &shares {
            assert!(
                (35.0..=65.0).contains(s),
                "{what}: thread 0 got {s}% of a window:\n{stdout}"
            );
        }
    }
}

/// What tick_count printed: its run's guest time in seconds, the timer
/// interrupts over it and the user time it was charged, in seconds.
fn tick_counts(stdout: &str) -> (f64, f64, f64) {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("tick_count: "))
        .unwrap_or_else(|| panic!("no tick_count line in\n{stdout}"));
    let field = |name: &str| -> f64 {
        let mut words = line.split_whitespace();
        words.find(|w| *w == name);
        let value = words
            .next()
            .unwrap_or_else(|| panic!("no {name} in {line}"));
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name} {value} in {line}"))
    };
    // The guest kernel's clock ticks: HZ=100.
    (field("ns") / 1e9, field("timer"), field("user") / 100.0)
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_single_busy_task_runs_without_the_periodic_tick_and_two_keep_it() {
    guest_ready();
    // One task hashing in user mode: the guest kernel stops its tick until
    // a timer is due, where the periodic tick would come 100 times a
    // second; with the PIT's one-shot counts of up to 24 bits (patch
    // 0014) nothing is due for seconds, and only the program's start and
    // end take interrupts (about 10; with the 16-bit counter's 55 ms,
    // about 18 more a second). The task is still charged its whole run as
    // user time. Two such tasks need the tick to share the CPU, and get
    // it.
    // (Recorded and replayed: with nothing due, the recording may need
    // no asynchronous point at all.)
    let one = record_and_replay(
        "tickless",
        &[],
        &["tick_count", "1", "1500000000"],
        0,
        |_, _| {},
    );
    let (secs, timer, user) = tick_counts(&one);
    assert!(secs > 1.0, "too short to judge: {one}");
    assert!(
        timer < 20.0,
        "one busy task: {timer} timer interrupts in {secs:.2} s\n{one}"
    );
    // Charged in whole jiffies, at each restart of the tick: a run of
    // 1.78 s was once charged 1.83 s (two VMs sharing the host's CPUs).
    // The upper bound catches a run charged twice, not a few jiffies.
    assert!(
        user >= 0.8 * secs && user <= 1.05 * secs + 0.05,
        "one busy task: charged {user:.2} s of user time in {secs:.2} s\n{one}"
    );
    let two = run_expecting(
        ["run", "--no-stdin", "--", "tick_count", "2", "150000000"],
        0,
    );
    let (secs, timer, user) = tick_counts(&two);
    assert!(
        timer / secs > 80.0,
        "two busy tasks: {timer} timer interrupts in {secs:.2} s\n{two}"
    );
    assert!(
        user >= 0.8 * secs,
        "two busy tasks: charged {user:.2} s of user time in {secs:.2} s\n{two}"
    );
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_loop_only_memory_tells_apart_needs_the_memory_checks() {
    guest_ready();
    // Every pass of mem_only's loop has the same registers; only the
    // counter in memory differs. A faithful replay finds the recorded pass
    // at every point...
    let (trace, out) = record("mem-only", &[], &["mem_only", "300"]);
    let stdout = expect_status(&out, 0);
    assert!(async_points(&trace) > 0);
    assert_replays_identically(&trace, &stdout);
    // ...one that matched registers alone delivers at an earlier pass and
    // the guest goes another way.
    let out = replay_with(&trace, &["--match-registers-only"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("replay diverged"), "{stderr}");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn marks_at_functions_a_sibling_enters_past_their_start_replay() {
    guest_ready();
    // glibc's mempcpy jumps into memmove just past its first instruction,
    // from 74 bytes before memmove's entry (the AVX2 variant). copy_calls
    // calls both for a few seconds without a system call, and the
    // recording marks a sample about every millisecond, often in them. A
    // replay that takes the samples puts a trampoline at every mark:
    // one over memmove's entry was entered in its middle by the next
    // mempcpy call, and the program died (half of the recordings, before
    // the recorder looked that far back).
    let (trace, out) = record("copy-calls", &[], &["copy_calls", "40000000"]);
    let stdout = expect_status(&out, 0);
    assert!(stdout.starts_with("copy_calls: sum "), "{stdout}");
    let db = trace.parent().unwrap().join("samples.db");
    let out = replay_into(&trace, &db, &["--sample-period", "1ms"]);
    let (replayed, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert_eq!(replayed, stdout);
    // It stood at the marks (no task is tracked: nothing is stored).
    let marks: u64 = stderr
        .split("sampled at ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of marks sampled at: {stderr}"));
    assert!(marks > 1000, "{stderr}");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}
