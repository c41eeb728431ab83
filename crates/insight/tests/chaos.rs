//! Chaos while recording (`record --chaos`), end to end: a kept failing
//! try names its seed in the trace header and its replay, given no seed,
//! fails the same way; each of SCTBench's eight buggy programs
//! (tests/programs/sctbench) fails under chaos within its tries, and the
//! kept recording replays to the same failure, with a probe at replay on
//! a function its single-stepped threads run; the correct twins pass
//! their chaos tries, which leave nothing behind; a chaos recording of a
//! multi-threaded program replays exactly, from boot and from its
//! checkpoints, and its `--jobs 2` segments merge into the replay from
//! boot as any recording's do. How many tries the bugs
//! take over several seeds is measured by tools/bench chaos
//! (docs/chaos.md, "Measured").
//!
//! Like the other end-to-end tests they need /dev/kvm and the guest image
//! (the test command builds it first).

mod common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::*;

/// Records `prog` with chaos from `seed` until it fails, at most `max`
/// tries, into `trace`.
fn record_until_fail(trace: &Path, seed: u64, max: u32, prog: &Path) -> Output {
    let mut cmd = insight();
    cmd.args(["record", "--no-stdin", "-o"])
        .arg(trace)
        .args([
            &format!("--chaos={seed}"),
            &format!("--until-fail={max}"),
            // Far longer than a passing try goes without a system call on
            // a loaded host.
            "--timeout",
            HANG,
            "--",
        ])
        .arg(prog);
    // A try takes 5 to 10 s here: 200 of them, for the rare seed that
    // needs that many.
    output_within(cmd, Duration::from_secs(3600))
}

/// Chaos tries of each correct twin.
const OK_TRIES: u32 = 5;

/// No progress for this long is a hang (`record --timeout`).
const HANG: &str = "20s";

/// The chaos seed the correct twins are recorded with.
const SEED: u64 = 1;

/// Each buggy program's seed: try N of seed S draws as seed S + N - 1,
/// and these are draws at which the program failed in the tries measured
/// (docs/chaos.md, "Measured", (6)), so that the test's tries fit its
/// budget; how many tries the bugs take from other seeds is tools/bench
/// chaos's to measure. A draw fixes the schedule only as far as the
/// guest's timer interrupts fall in the same places: `--until-fail=200`
/// goes on to later draws where it does not fail.
fn seed_of(name: &str) -> u64 {
    match name {
        "account_bad" => 12,
        "token_ring_bad" => 13,
        "deadlock01_bad" => 67,
        _ => 1,
    }
}

/// A function of SCTBench's buggy program `name` that one of its threads
/// runs before the failure, single-stepped by the guest kernel.
fn probed_in(name: &str) -> &'static str {
    match name {
        "account_bad" => "withdraw",
        "bluetooth_driver_bad" => "BCSP_PnpStop",
        "deadlock01_bad" => "thread2",
        "stack_bad" => "pop",
        _ => "t2",
    }
}

/// Records SCTBench's buggy program `name` with chaos until it fails (at
/// most 200 tries), checks it failed as its bug makes it (`status`: 134,
/// the abort of a failed assert; 124, the hang of a deadlock), and that
/// the kept recording, replayed with no seed, fails the same way. The
/// replay puts a probe on a function a thread runs while the guest kernel
/// single-steps it: the probe's breakpoint must leave the guest's own
/// single-step traps to the guest, or the steps the guest kernel counts,
/// and the schedule with them, would differ from the recording's.
fn assert_bug_found_and_replayed(dir: &Path, name: &str, status: i32) {
    let prog = sctbench(dir, name);
    let trace = dir.join(format!("{name}-trace"));
    let seed = seed_of(name);
    let out = record_until_fail(&trace, seed, 200, &prog);
    let stdout = expect_status(&out, status);
    let (_, stderr) = text(&out);
    assert_header_names_the_seed(&trace, seed, &stderr);
    let probed = probed_in(name);
    let replayed = replay_with(&trace, &["--probe", probed]);
    let (rout, rerr) = text(&replayed);
    // The console's output, then the probes' report.
    let (rout, report) = rout.split_at(
        rout.find("Probes in ")
            .unwrap_or_else(|| panic!("{name}: no probes' report in: {rout}\n{rerr}")),
    );
    let calls = report
        .split_once(&format!("Probe 1: {probed}\n  calls: "))
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse::<u64>().ok());
    assert!(
        calls.is_some_and(|n| n > 0),
        "{name}: no call of {probed} in: {report}\n{rerr}"
    );
    assert!(replayed.status.success(), "{name}: {rerr}");
    let end = match status {
        124 => format!("the recording ended there: no progress in user mode for {HANG}"),
        _ => format!("command exited with status {status}"),
    };
    assert!(
        rerr.replace(".000 s", "s").contains(&end),
        "{name}: no '{end}' in: {rerr}"
    );
    assert_eq!(rout, stdout, "{name}: {rerr}");
}

/// Checks the header names the chaos seed of the try kept: `seed` plus
/// the try's number less one.
fn assert_header_names_the_seed(trace: &Path, seed: u64, stderr: &str) {
    let tries: u64 = stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("insight: try ")?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no kept try in: {stderr}"));
    let dump = run_expecting([Path::new("dump").as_os_str(), trace.as_os_str()], 0);
    let want = format!("chaos:      seed {}", seed + tries - 1);
    assert!(dump.contains(&want), "no '{want}' in the dump:\n{dump}");
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_failing_chaos_try_is_kept_and_replays_the_same_failure_with_no_seed() {
    guest_ready();
    let dir = scratch("chaos-flaky");
    // Fails in one run of three by its clock, whatever the schedule: what
    // is checked here is that chaos seeded the guest's scheduler, that the kept try
    // names its seed, and that its replay, which is given no seed, fails
    // the same way.
    let prog = compile_test_program(&dir, "flaky_exit", &["-O1", "-pthread"]);
    let trace = dir.join("trace");
    let out = record_into(
        &trace,
        &["--chaos=7", "--until-fail=60", "--summary"],
        &[prog.to_str().unwrap()],
    );
    let stdout = expect_status(&out, 1);
    let (_, stderr) = text(&out);
    assert_eq!(stdout, "flaky_exit: fails\n", "{stderr}");
    assert_header_names_the_seed(&trace, 7, &stderr);
    let seeded: u64 = stderr
        .split("chaos seeded the guest's scheduler ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no chaos count in: {stderr}"));
    assert!(seeded > 0, "chaos never seeded the guest: {stderr}");
    let replayed = replay(&trace);
    let (rout, rerr) = text(&replayed);
    assert!(replayed.status.success(), "{rerr}");
    assert!(rerr.contains("command exited with status 1"), "{rerr}");
    assert_eq!(rout, stdout, "{rerr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_chaos_recording_replays_exactly_and_its_segments_merge() {
    guest_ready();
    // syn_cont's 16 threads take and release locks (probe events) and are
    // single-stepped from their start, switched out at change points, as
    // far as their budgets go: the determinism suite's checks, and
    // checkpoints.rs's of `--jobs 2`, made of a chaos recording.
    let (trace, out) = record(
        "chaos-replay",
        // Seed 5 made a recording whose replay did not find one of its
        // asynchronous points (docs/chaos.md, "What is not there yet").
        &["--chaos=7", "--probes", "--summary"],
        &["syn_cont", "1000", "2000"],
    );
    let recorded = expect_status(&out, 0);
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains("chaos seeded the guest's scheduler"),
        "{stderr}"
    );
    // From boot, taking checkpoints; then from the middle and the last
    // checkpoint to the end.
    let dir = trace.parent().unwrap().to_owned();
    let db = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let out = replay_with(
        &trace,
        &["--checkpoint-every", "100ms", "--events", &db("whole.db")],
    );
    let stdout = expect_status(&out, 0);
    let (_, stderr) = text(&out);
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert_eq!(stdout, recorded, "{stderr}");
    assert_checkpoints_replay_faithfully(&trace, &recorded);
    // Every segment in a process of its own, merged: the same console
    // output and the same events as the replay from boot.
    assert_segments_replay_as_the_whole(
        &trace,
        &recorded,
        &dir.join("whole.db"),
        &dir.join("jobs.db"),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn sctbench_assertion_bugs_fail_under_chaos_and_replay_their_failure() {
    guest_ready();
    let dir = scratch("chaos-asserts");
    for name in [
        "account_bad",
        "bluetooth_driver_bad",
        "circular_buffer_bad",
        "queue_bad",
        "stack_bad",
        "token_ring_bad",
    ] {
        assert_bug_found_and_replayed(&dir, name, 134);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn sctbench_deadlocks_hang_under_chaos_and_replay_to_the_hang() {
    guest_ready();
    let dir = scratch("chaos-deadlocks");
    assert_bug_found_and_replayed(&dir, "carter01_bad", 124);
    assert_bug_found_and_replayed(&dir, "deadlock01_bad", 124);
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn sctbench_correct_twins_pass_their_chaos_tries() {
    guest_ready();
    let dir = scratch("chaos-ok");
    for name in ["stack_ok", "account_ok", "queue_ok", "circular_buffer_ok"] {
        let prog = sctbench(&dir, name);
        let trace = dir.join(format!("{name}-trace"));
        let out = record_until_fail(&trace, SEED, OK_TRIES, &prog);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{name}: {stderr}");
        assert!(
            stderr.contains(&format!("no failure in {OK_TRIES} tries")),
            "{name}: {stderr}"
        );
        // Nothing left of the passing tries.
        assert!(!trace.join("header").exists(), "{name}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
