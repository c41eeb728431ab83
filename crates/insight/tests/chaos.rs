//! Chaos while recording (`record --chaos`), end to end: a kept failing
//! try names its seed in the trace header and its replay, given no seed,
//! fails the same way; SCTBench's correct programs (tests/programs/sctbench)
//! pass their chaos tries, which leave nothing behind. How often chaos
//! makes SCTBench's buggy programs fail is measured by tools/bench chaos
//! (docs/chaos.md, "Measured"), not here: it takes tens of tries.
//!
//! Like the other end-to-end tests they need /dev/kvm and the guest image
//! (the test command builds it first).

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

/// SCTBench's program `name`, built as SCTBench builds it.
fn sctbench(dir: &Path, name: &str) -> PathBuf {
    std::fs::create_dir_all(dir.join("sctbench")).unwrap();
    compile_test_program(
        dir,
        &format!("sctbench/{name}"),
        &["-pthread", "-g", "-O0", "-w"],
    )
}

/// Records `prog` with chaos from `seed` until it fails, at most `max`
/// tries, into `trace`.
fn record_until_fail(trace: &Path, seed: u64, max: u32, prog: &Path) -> Output {
    record_into(
        trace,
        &[
            &format!("--chaos={seed}"),
            &format!("--until-fail={max}"),
            // Far longer than a passing try takes on a loaded host.
            "--timeout",
            "30s",
        ],
        &[prog.to_str().unwrap()],
    )
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
    // is checked here is that chaos forced preemptions, that the kept try
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
    let forced: u64 = stderr
        .split("chaos forced ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no chaos count in: {stderr}"));
    assert!(forced > 0, "chaos forced no preemption: {stderr}");
    let replayed = replay(&trace);
    let (rout, rerr) = text(&replayed);
    assert!(replayed.status.success(), "{rerr}");
    assert!(rerr.contains("command exited with status 1"), "{rerr}");
    assert_eq!(rout, stdout, "{rerr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn sctbench_correct_twins_pass_their_chaos_tries() {
    guest_ready();
    let dir = scratch("chaos-ok");
    for name in ["stack_ok", "account_ok"] {
        let prog = sctbench(&dir, name);
        let trace = dir.join(format!("{name}-trace"));
        let out = record_until_fail(&trace, 1, 3, &prog);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{name}: {stderr}");
        assert!(stderr.contains("no failure in 3 tries"), "{name}: {stderr}");
        // Nothing left of the passing tries.
        assert!(!trace.join("header").exists(), "{name}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
