//! Boot snapshots: runs and recordings restore the guest as it stood when
//! `/init` was ready instead of booting it, each with its own files, seed
//! and clock; a stale or damaged snapshot is never restored; a trace holds
//! its snapshot and replays without the cache.
//!
//! Each test keeps its snapshots in a cache of its own
//! (`INSIGHT_SNAPSHOT_DIR`), so that it sees every snapshot taken.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

/// `insight` with the snapshot cache `cache`.
fn insight_in(cache: &Path) -> Command {
    let mut cmd = insight();
    cmd.env("INSIGHT_SNAPSHOT_DIR", cache);
    cmd
}

fn run_in(cache: &Path, args: &[&str]) -> Output {
    let mut cmd = insight_in(cache);
    cmd.arg("run").arg("--no-stdin").args(args);
    output_within(cmd, std::time::Duration::from_secs(600))
}

fn snapshots(cache: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(cache)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    found.retain(|p| p.extension().is_some_and(|e| e == "snap"));
    found.sort();
    found
}

const TAKING: &str = "taking a boot snapshot";

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn runs_restore_a_snapshot_with_their_own_files_seed_and_clock() {
    guest_ready();
    let dir = scratch("snapshot-runs");
    let cache = dir.join("cache");
    let config = |name: &str, content: &str| {
        let file = dir.join(format!("{name}.txt"));
        std::fs::write(&file, content).unwrap();
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "command = [\"sh\", \"-c\", \"cat /root/mine.txt; date +%s; \
                 head -c 16 /dev/urandom | od -An -tx1\"]\n\
                 [[files]]\nhost = \"{}\"\nguest = \"/root/mine.txt\"\n",
                file.display()
            ),
        )
        .unwrap();
        cfg
    };
    let (a, b) = (
        config("a", "file of run A\n"),
        config("b", "file of run B\n"),
    );

    // The first run takes the snapshot; the second restores it.
    let first = run_in(&cache, &[a.to_str().unwrap()]);
    let (out_a, err) = text(&first);
    assert_eq!(first.status.code(), Some(0), "{err}");
    assert!(err.contains(TAKING), "{err}");
    assert_eq!(snapshots(&cache).len(), 1);
    let second = run_in(&cache, &[b.to_str().unwrap()]);
    let (out_b, err) = text(&second);
    assert_eq!(second.status.code(), Some(0), "{err}");
    assert!(
        !err.contains(TAKING),
        "the cached snapshot was not used: {err}"
    );

    // Same snapshot, same command: each run sees its own file, its own
    // random numbers, and the time it ran at.
    assert!(out_a.starts_with("file of run A\n"), "{out_a}");
    assert!(out_b.starts_with("file of run B\n"), "{out_b}");
    let lines = |out: &str| out.lines().map(str::to_owned).collect::<Vec<_>>();
    let (la, lb) = (lines(&out_a), lines(&out_b));
    assert_eq!((la.len(), lb.len()), (3, 3), "{out_a}\n{out_b}");
    assert_ne!(la[2], lb[2], "two restored runs drew the same random bytes");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    for line in [&la[1], &lb[1]] {
        let guest: i64 = line.trim().parse().unwrap();
        assert!(
            (now - guest).abs() < 600,
            "the guest's clock says {guest}, the host's {now}"
        );
    }

    // Another memory size is another key: a snapshot of its own.
    let other = run_in(&cache, &["--memory", "160", "--", "true"]);
    let (_, err) = text(&other);
    assert_eq!(other.status.code(), Some(0), "{err}");
    assert!(
        err.contains(TAKING),
        "a snapshot of another memory size was used: {err}"
    );
    assert_eq!(snapshots(&cache).len(), 2);

    // A damaged snapshot is found by its digest and taken again.
    let damaged = snapshots(&cache)
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().modified().unwrap())
        .unwrap();
    let mut bytes = std::fs::read(&damaged).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(&damaged, &bytes).unwrap();
    let again = run_in(&cache, &["--memory", "160", "--", "echo", "restored"]);
    let (out, err) = text(&again);
    assert_eq!(again.status.code(), Some(0), "{err}");
    assert!(
        err.contains("cannot be used") && err.contains("digest") && err.contains(TAKING),
        "{err}"
    );
    assert_eq!(out, "restored\n");
    assert_ne!(
        std::fs::read(&damaged).unwrap(),
        bytes,
        "the damaged file is still there"
    );

    // The cache lists and clears them.
    let list = insight_in(&cache).arg("cache").output().unwrap();
    let listed = expect_status(&list, 0);
    assert!(listed.contains("2 boot snapshots"), "{listed}");
    let clear = insight_in(&cache)
        .args(["cache", "clear"])
        .output()
        .unwrap();
    let cleared = expect_status(&clear, 0);
    assert!(cleared.contains("removed 2 boot snapshots"), "{cleared}");
    assert!(snapshots(&cache).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_trace_holds_its_snapshot_and_replays_without_the_cache() {
    guest_ready();
    let dir = scratch("snapshot-trace");
    let cache = dir.join("cache");
    let trace = dir.join("trace");
    let mut cmd = insight_in(&cache);
    cmd.args(["record", "--no-stdin", "--probes", "-o"])
        .arg(&trace)
        .args(["--", "syn_cont", "100", "1000"]);
    let recorded = output_within(cmd, std::time::Duration::from_secs(600));
    let stdout = expect_status(&recorded, 0);
    let snap = trace.join(trace::SNAPSHOT_FILE);
    assert!(snap.exists(), "the trace has no {}", snap.display());
    let header = insight_in(&cache)
        .args(["dump", "--header"])
        .arg(&trace)
        .output()
        .unwrap();
    let header = expect_status(&header, 0);
    assert!(header.contains("start:      boot snapshot"), "{header}");

    // Copied alone, with the cache gone, it replays and diagnoses.
    let copy = dir.join("elsewhere/trace");
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    let cp = Command::new("cp")
        .arg("-r")
        .arg(&trace)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(cp.success());
    std::fs::remove_dir_all(&trace).unwrap();
    std::fs::remove_dir_all(&cache).unwrap();
    assert_replays_identically(&copy, &stdout);
    let diagnosed = replay_with(&copy, &["--diagnose", "locks"]);
    let report = expect_status(&diagnosed, 0);
    assert!(report.contains("level2"), "{report}");
    assert!(!cache.exists(), "a replay wrote to the snapshot cache");

    // A snapshot that is not the one recorded is refused, by name.
    let snap = copy.join(trace::SNAPSHOT_FILE);
    let good = std::fs::read(&snap).unwrap();
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    std::fs::write(&snap, &bad).unwrap();
    let out = replay(&copy);
    let (_, err) = text(&out);
    assert!(err.contains("do not match its digest"), "{err}");
    // A damaged file of the trace: exit 3, as for the rest of it.
    assert_eq!(out.status.code(), Some(3), "{err}");
    std::fs::write(&snap, &good[..good.len() / 2]).unwrap();
    let out = replay(&copy);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out).1);
    std::fs::remove_file(&snap).unwrap();
    let (_, err) = text(&replay(&copy));
    assert!(err.contains("boot.snap is missing"), "{err}");
    std::fs::write(&snap, &good).unwrap();

    // --cold-boot records from power-on, as before snapshots.
    let cold = dir.join("cold");
    let mut cmd = insight_in(&cache);
    cmd.args(["record", "--no-stdin", "--cold-boot", "-o"])
        .arg(&cold)
        .args(["--", "sh", "-c", "echo cold; cat /proc/uptime"]);
    let recorded = output_within(cmd, std::time::Duration::from_secs(600));
    let stdout = expect_status(&recorded, 0);
    assert!(stdout.starts_with("cold\n"), "{stdout}");
    assert!(!cold.join(trace::SNAPSHOT_FILE).exists());
    assert!(!cache.exists(), "--cold-boot used the snapshot cache");
    let header = insight_in(&cache)
        .args(["dump", "--header"])
        .arg(&cold)
        .output()
        .unwrap();
    assert!(expect_status(&header, 0).contains("start:      booted from power-on"));
    let out = replay(&cold);
    assert_eq!(text(&out).0, stdout);
    assert_eq!(out.status.code(), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}
