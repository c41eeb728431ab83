//! Recording until the command fails (`record --until-fail`, `--timeout`),
//! end to end: the first failing try is kept, in the trace store as any
//! recording and as the latest, and its replay fails the same way; passing
//! tries leave nothing; a command that hangs is recorded up to the time
//! limit and replays to the same hang; a kept deadlock is where the
//! deadlock report and the debugger start.
//!
//! Like the other end-to-end tests they need /dev/kvm and the guest image
//! (the test command builds it first).

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

/// Records `command` with `extra` into the trace store `store`.
fn record_in_store(store: &Path, extra: &[&str], command: &[&str]) -> Output {
    let mut cmd = insight();
    cmd.env("INSIGHT_TRACE_DIR", store)
        .args(["record", "--no-stdin"])
        .args(extra)
        .arg("--")
        .args(command);
    output_within(cmd, std::time::Duration::from_secs(900))
}

/// The store's entries, by name (the `latest` link among them).
fn store_entries(store: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(store)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn flaky_program(dir: &Path) -> PathBuf {
    compile_test_program(dir, "flaky_exit", &["-O1", "-pthread"])
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn the_first_failing_try_is_kept_and_its_replay_fails_the_same_way() {
    guest_ready();
    let dir = scratch("until-fail");
    let prog = flaky_program(&dir);
    let store = dir.join("store");
    // One run in three fails: 60 tries all pass one time in 10^10.
    let out = record_in_store(&store, &["--until-fail=60"], &[prog.to_str().unwrap()]);
    let stdout = expect_status(&out, 1);
    let (_, stderr) = text(&out);
    // Only the failing try's output is shown, and only its trace is left.
    assert_eq!(stdout, "flaky_exit: fails\n", "{stderr}");
    assert!(stderr.contains("failed after"), "{stderr}");
    assert_eq!(
        store_entries(&store),
        ["flaky_exit-0", "latest"],
        "{stderr}"
    );
    let latest = std::fs::read_link(store.join("latest")).unwrap();
    assert_eq!(latest, Path::new("flaky_exit-0"));
    let trace = store.join("flaky_exit-0");
    let replayed = replay(&trace);
    let (rout, rerr) = text(&replayed);
    assert!(replayed.status.success(), "{rerr}");
    assert!(rerr.contains("command exited with status 1"), "{rerr}");
    assert_eq!(rout, "flaky_exit: fails\n", "{rerr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn tries_that_all_pass_leave_nothing() {
    guest_ready();
    let dir = scratch("until-fail-none");
    let store = dir.join("store");
    let out = record_in_store(&store, &["--until-fail=3"], &["true"]);
    expect_status(&out, 0);
    let (_, stderr) = text(&out);
    assert!(stderr.contains("no failure in 3 tries"), "{stderr}");
    // No trace, and none of the host files the tries stored (`true` runs
    // in the host's files).
    let shared = store.join(".objects");
    let entries: Vec<_> = store_entries(&store)
        .into_iter()
        .filter(|e| e != ".objects")
        .collect();
    assert!(entries.is_empty(), "{entries:?} {stderr}");
    assert_eq!(store_entries(&shared), Vec::<String>::new(), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_hang_is_recorded_up_to_the_time_limit_and_replays_to_it() {
    guest_ready();
    let dir = scratch("until-fail-hang");
    let prog = flaky_program(&dir);
    let store = dir.join("store");
    let out = record_in_store(
        &store,
        // Far longer than a passing try takes on a loaded host.
        &["--until-fail=60", "--timeout", "20s"],
        &[prog.to_str().unwrap(), "hang"],
    );
    let stdout = expect_status(&out, 124);
    let (_, stderr) = text(&out);
    assert_eq!(stdout, "flaky_exit: fails\n", "{stderr}");
    assert!(stderr.contains("a hang"), "{stderr}");
    let trace = store.join("flaky_exit-0");
    let replayed = replay(&trace);
    let (rout, rerr) = text(&replayed);
    assert!(replayed.status.success(), "{rerr}");
    assert!(
        rerr.contains("the recording ended there: no progress in user mode for 20.000 s"),
        "{rerr}"
    );
    assert_eq!(rout, "flaky_exit: fails\n", "{rerr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A program compiled on the host and recorded by its path
/// (tests/programs/lock_order.c) deadlocks every run: two threads take two
/// mutexes in opposite orders. The kept recording, replayed with the
/// deadlock report, names the cycle the threads ended in, with the lines
/// where each waits; the debugger opened at its end shows each thread in
/// its lock call, on the mutex the other holds.
#[ignore = "needs /dev/kvm, the guest image, gcc and gdb (tools/test runs it)"]
#[test]
fn a_kept_deadlock_is_named_and_the_debugger_opens_where_its_threads_wait() {
    guest_ready();
    let dir = scratch("until-fail-deadlock");
    compile_test_program(&dir, "lock_order", &["-O0", "-g", "-pthread"]);
    let store = dir.join("store");
    let mut cmd = insight();
    cmd.current_dir(&dir)
        .env("INSIGHT_TRACE_DIR", &store)
        .args(["record", "--no-stdin", "--probes", "--until-fail=3"])
        .args(["--timeout", "20s", "--", "./lock_order"]);
    let out = output_within(cmd, std::time::Duration::from_secs(900));
    expect_status(&out, 124);
    let trace = store.join("lock_order-0");

    let mut cmd = insight();
    cmd.arg("replay")
        .arg(&trace)
        .args(["--diagnose", "deadlock"]);
    let out = output_within(cmd, std::time::Duration::from_secs(900));
    let report = expect_status(&out, 0);
    let (_, said) = text(&out);
    assert!(
        report
            .contains("1 deadlock the recording ended in (threads waiting for good), 0 potential"),
        "{report}\n{said}"
    );
    assert!(
        report
            .contains("accounts(T1) -> journal(T1) -> journal(T2) -> accounts(T2) -> accounts(T1)"),
        "{report}"
    );
    for (held, waits) in [("accounts", "journal"), ("journal", "accounts")] {
        assert!(
            report.contains(&format!("holds {held} and waits for {waits} at take_both")),
            "{report}"
        );
    }
    // Each waits where it asks for its second lock, line 22.
    assert_eq!(report.matches("(lock_order.c:22)\n").count(), 4, "{report}");

    let mut cmd = insight();
    cmd.arg("debug")
        .arg(&trace)
        .args(["--at", "end", "--", "-batch", "-nx"])
        .args(["-ex", "info threads", "-ex", "thread apply all bt"]);
    let out = output_within(cmd, std::time::Duration::from_secs(900));
    let (gdb, said) = text(&out);
    assert!(out.status.success(), "{gdb}\n{said}");
    for lock in ["accounts", "journal"] {
        let waits =
            |l: &str| l.contains("pthread_mutex_lock (mutex=") && l.contains(&format!("<{lock}>"));
        assert!(gdb.lines().any(waits), "{gdb}\n{said}");
    }
    // Thread 21 asked for journal, thread 22 for accounts, in take_both.
    assert_eq!(gdb.matches("in take_both (").count(), 2, "{gdb}");
    let _ = std::fs::remove_dir_all(&dir);
}
