//! The host's files in the guest (`--host-fs`, docs/host-files.md): a
//! command named by its bare name runs as it runs on the host, reading the
//! host's programs, libraries, interpreters and data files with no flag
//! bringing them; what it read is stored in the trace (each file once, in
//! the trace store), so a replay needs neither the host's files nor their
//! being unchanged.

mod common;

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::*;

/// The PATH the commands run with, on the host and in the guest: the
/// system's directories (a user's PATH may put a version manager's shims,
/// shell scripts that start several programs each, before them).
const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `insight ARGS` run in `dir` with the system's PATH (and the trace
/// store `store`, if given).
fn insight_in(dir: &Path, store: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = insight();
    cmd.current_dir(dir).env("PATH", SYSTEM_PATH).args(args);
    if let Some(store) = store {
        cmd.env("INSIGHT_TRACE_DIR", store);
    }
    output_within(cmd, Duration::from_secs(1200))
}

/// `command` run natively in `dir` with the system's PATH.
fn native(dir: &Path, command: &[&str]) -> String {
    let out = Command::new(command[0])
        .args(&command[1..])
        .current_dir(dir)
        .env("PATH", SYSTEM_PATH)
        .output()
        .unwrap();
    assert!(out.status.success(), "{command:?} natively: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Records `command` with `--host-fs` in `dir` into `trace`; returns what
/// it printed.
fn record_host_fs(dir: &Path, trace: &Path, command: &[&str]) -> String {
    let trace = trace.to_str().unwrap();
    let args = [
        &["record", "--no-stdin", "--host-fs", "-o", trace, "--"],
        command,
    ]
    .concat();
    let out = insight_in(dir, None, &args);
    expect_status(&out, 0)
}

/// Replays `trace` from `dir` and checks that it matched the recording
/// and printed `expected`.
fn assert_replays(dir: &Path, trace: &Path, expected: &str) {
    let out = insight_in(dir, None, &["replay", trace.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "replay: {stderr}");
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert_eq!(stdout, expected, "the replay printed something else");
}

const THREADS_SCRIPT: &str = r#"
import threading

lock = threading.Lock()
total = 0

def work(n):
    global total
    for i in range(200):
        with lock:
            total += n

threads = [threading.Thread(target=work, args=(n,)) for n in range(1, 5)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("threads", len(threads), "total", total)
"#;

#[test]
#[ignore = "boots the guest: tools/test runs it"]
fn python_by_bare_name_records_and_replays() {
    guest_ready();
    let dir = scratch("host-files-python");
    std::fs::write(dir.join("threads.py"), THREADS_SCRIPT).unwrap();
    let command = ["python3", "threads.py"];
    let expected = native(&dir, &command);
    assert_eq!(expected, "threads 4 total 2000\n");
    let trace = dir.join("trace");
    let printed = record_host_fs(&dir, &trace, &command);
    assert_eq!(printed, expected, "the recording printed something else");
    assert_replays(&dir, &trace, &expected);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A shell script in the working directory that runs host programs by
/// their bare names over a data file beside it.
const SCRIPT: &str =
    "#!/bin/sh\nset -e\nsha256sum data.txt\nwc -l < data.txt\ntr a-z A-Z < data.txt | head -n 2\n";

fn script_dir(name: &str) -> std::path::PathBuf {
    let dir = scratch(name);
    let script = dir.join("count.sh");
    std::fs::write(&script, SCRIPT).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::write(dir.join("data.txt"), "alpha\nbeta\ngamma\ndelta\n").unwrap();
    dir
}

#[test]
#[ignore = "boots the guest: tools/test runs it"]
fn a_script_and_its_data_replay_after_the_host_files_change() {
    guest_ready();
    let dir = script_dir("host-files-script");
    let expected = native(&dir, &["./count.sh"]);
    assert!(expected.contains("ALPHA\nBETA\n"), "{expected}");
    let trace = dir.join("trace");
    let printed = record_host_fs(&dir, &trace, &["./count.sh"]);
    assert_eq!(printed, expected);

    // The trace holds what was read: the data file among its objects.
    let objects: Vec<_> = std::fs::read_dir(trace.join("objects"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let data_digest = native(&dir, &["sha256sum", "data.txt"]);
    let data_digest = data_digest.split(' ').next().unwrap();
    assert!(
        objects.iter().any(|o| o == data_digest),
        "data.txt ({data_digest}) is not among the trace's objects: {objects:?}"
    );

    // The host's file changes: a native run now prints something else,
    // the replay what the recording read.
    std::fs::write(dir.join("data.txt"), "changed\n").unwrap();
    assert_ne!(native(&dir, &["./count.sh"]), expected);
    assert_replays(&dir, &trace, &expected);
    // Checkpoints hold the device: replays from them match too.
    let out = replay_with(&trace, &["--checkpoint-every", CHECKPOINT_EVERY]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    assert_checkpoints_replay_faithfully(&trace, &expected);

    // A copy of the trace elsewhere, without the directory it was
    // recorded in, replays the same.
    let elsewhere = scratch("host-files-copy");
    let copy = elsewhere.join("trace");
    let cp = Command::new("cp")
        .args(["-a"])
        .arg(&trace)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(cp.success());
    std::fs::remove_dir_all(&dir).unwrap();
    assert_replays(&elsewhere, &copy, &expected);

    // A stored file that is not what the log names is refused by name.
    let victim = copy.join("objects").join(data_digest);
    std::fs::remove_file(&victim).unwrap();
    std::fs::write(&victim, zstd_of(b"other bytes\n")).unwrap();
    let out = insight_in(&elsewhere, None, &["replay", copy.to_str().unwrap()]);
    let (_, stderr) = text(&out);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        stderr.contains(data_digest) && stderr.contains("SHA-256"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&elsewhere).unwrap();
}

/// `bytes` compressed as the trace stores its objects.
fn zstd_of(bytes: &[u8]) -> Vec<u8> {
    let dir = scratch("host-files-zstd");
    let path = dir.join("plain");
    std::fs::write(&path, bytes).unwrap();
    let status = Command::new("zstd")
        .args(["-q", "-f"])
        .arg(&path)
        .status()
        .expect("zstd is needed");
    assert!(status.success());
    let out = std::fs::read(dir.join("plain.zst")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    out
}

/// Bytes the files under `dir` take, each file (inode) once however many
/// names it has.
fn unique_bytes(dir: &Path, seen: &mut HashSet<(u64, u64)>) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = std::fs::symlink_metadata(entry.path()).unwrap();
        if meta.is_dir() {
            total += unique_bytes(&entry.path(), seen);
        } else if seen.insert((meta.dev(), meta.ino())) {
            total += meta.size();
        }
    }
    total
}

#[test]
#[ignore = "boots the guest: tools/test runs it"]
fn a_second_recording_of_the_same_command_stores_no_file_again() {
    guest_ready();
    let dir = script_dir("host-files-store");
    let store = dir.join("store");
    let record = |dir: &Path| {
        let out = insight_in(
            dir,
            Some(&store),
            &["record", "--no-stdin", "--host-fs", "--", "./count.sh"],
        );
        expect_status(&out, 0)
    };
    let first = record(&dir);
    let before = unique_bytes(&store, &mut HashSet::new());
    let shared: HashSet<_> = std::fs::read_dir(store.join(".objects"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(!shared.is_empty(), "the store keeps no objects");
    assert_eq!(record(&dir), first);
    let after = unique_bytes(&store, &mut HashSet::new());
    let shared_after: HashSet<_> = std::fs::read_dir(store.join(".objects"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        shared_after, shared,
        "the second recording stored files again"
    );
    // The bytes of the host files the second recording read (its objects
    // uncompressed) against what the store grew by: its log only.
    let traces: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.is_symlink() && p.join("header").exists())
        .collect();
    assert_eq!(traces.len(), 2, "{traces:?}");
    let second = traces
        .iter()
        .max_by_key(|p| p.metadata().unwrap().modified().unwrap());
    let second = second.unwrap();
    let mut read = 0u64;
    for entry in std::fs::read_dir(second.join("objects")).unwrap() {
        let entry = entry.unwrap();
        assert!(
            entry.metadata().unwrap().nlink() >= 2,
            "{} is not linked to the store's copy",
            entry.path().display()
        );
        let out = Command::new("zstd")
            .args(["-q", "-d", "-c"])
            .arg(entry.path())
            .output()
            .unwrap();
        read += out.stdout.len() as u64;
    }
    assert!(
        after - before < read,
        "the store grew by {} bytes, the files read are {read} bytes",
        after - before
    );
    assert_replays(&dir, second, &first);
    // Both removed, nothing is left in the store's objects.
    let names: Vec<String> = traces
        .iter()
        .map(|t| t.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let rm = [
        &["rm"],
        &names.iter().map(String::as_str).collect::<Vec<_>>()[..],
    ]
    .concat();
    let out = insight_in(&dir, Some(&store), &rm);
    let said = expect_status(&out, 0);
    assert!(said.contains("stored host files"), "{said}");
    assert_eq!(
        std::fs::read_dir(store.join(".objects")).unwrap().count(),
        0
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `insight record --probes -- COMMAND` in `dir` into the trace store
/// `store`, with no other flag: the command's program, a bare name on the
/// host's PATH, runs in the host's files by default. Returns what it
/// printed and the trace it made (the store's newest).
fn record_by_default(dir: &Path, store: &Path, command: &[&str]) -> (String, std::path::PathBuf) {
    let args = [&["record", "--probes", "--"], command].concat();
    let out = insight_in(dir, Some(store), &args);
    let printed = expect_status(&out, 0);
    let (_, said) = text(&out);
    let trace = newest_trace(store);
    assert!(
        trace.join("objects").is_dir(),
        "{command:?} did not run in the host's files: {said}"
    );
    (printed, trace)
}

/// The trace directory the store `store` holds that was made last.
fn newest_trace(store: &Path) -> std::path::PathBuf {
    std::fs::read_dir(store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.is_symlink() && p.join("header").exists())
        .max_by_key(|p| p.metadata().unwrap().modified().unwrap())
        .expect("the store holds no trace")
}

/// Bytes of the host files `trace` read: its objects, uncompressed.
fn bytes_read(trace: &Path) -> u64 {
    let mut read = 0u64;
    for entry in std::fs::read_dir(trace.join("objects")).unwrap() {
        let out = Command::new("zstd")
            .args(["-q", "-d", "-c"])
            .arg(entry.unwrap().path())
            .output()
            .expect("zstd is needed");
        assert!(out.status.success());
        read += out.stdout.len() as u64;
    }
    read
}

#[test]
#[ignore = "boots the guest: tools/test runs it"]
fn python_threads_by_default_replay_with_the_native_output() {
    guest_ready();
    let dir = scratch("host-files-default-python");
    std::fs::write(dir.join("threads.py"), THREADS_SCRIPT).unwrap();
    let command = ["python3", "threads.py"];
    let expected = native(&dir, &command);
    let store = dir.join("store");
    let (printed, trace) = record_by_default(&dir, &store, &command);
    assert_eq!(printed, expected, "the recording printed something else");
    assert_replays(&dir, &trace, &expected);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "boots the guest: tools/test runs it"]
fn memcached_under_memcslap_by_default_replays() {
    guest_ready();
    let dir = scratch("host-files-default-memcached");
    // The server's start takes the guest seconds: memcslap waits for it
    // (it counts refused connections as done).
    let script = "memcached -u root -t 4 & \
                  until memcping --servers=127.0.0.1; do sleep 1; done; \
                  memcslap --servers=127.0.0.1 --test=set --concurrency=4 --execute-number=200; \
                  status=$?; kill $!; wait; exit $status";
    let store = dir.join("store");
    let (printed, trace) = record_by_default(&dir, &store, &["sh", "-c", script]);
    // Sets made by four threads: memcslap counts fewer than it asks for in
    // the slow guest (1,812 of 4,000 in one recording), so any; the
    // replay prints the same.
    let keys: u64 = printed
        .lines()
        .find_map(|l| l.strip_prefix("Time to set"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no sets reported: {printed}"));
    assert!(
        keys > 0 && printed.contains("keys by    4 threads"),
        "{printed}"
    );
    assert_replays(&dir, &trace, &printed);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "boots the guest: tools/test runs it"]
fn sysbench_mutex_by_default_replays_and_a_second_recording_shares_its_files() {
    guest_ready();
    let dir = scratch("host-files-default-sysbench");
    let command = [
        "sysbench",
        "mutex",
        "--threads=4",
        "--mutex-num=64",
        "--mutex-locks=2000",
        "--mutex-loops=10",
        "run",
    ];
    let store = dir.join("store");
    let (printed, first) = record_by_default(&dir, &store, &command);
    assert!(
        printed.contains("Number of threads: 4")
            && printed.contains("total number of events:              4"),
        "{printed}"
    );
    assert_replays(&dir, &first, &printed);

    // Recorded again: the store grows by less than the files it read.
    let before = unique_bytes(&store, &mut HashSet::new());
    let (again, second) = record_by_default(&dir, &store, &command);
    assert_ne!(first, second);
    assert!(
        again.contains("total number of events:              4"),
        "{again}"
    );
    let grown = unique_bytes(&store, &mut HashSet::new()) - before;
    let read = bytes_read(&second);
    assert!(
        grown < read,
        "the store grew by {grown} bytes, the files read are {read} bytes"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "boots the guest: tools/test runs it"]
fn a_large_data_file_in_the_working_directory_is_read_by_default_and_replays() {
    guest_ready();
    let dir = scratch("host-files-default-large");
    // Bytes that do not compress (xorshift), so that the trace holds them
    // all. 32 MiB: a 200 MB file goes the same way but takes about 20
    // minutes here (the interpreted guest kernel fills its page cache a
    // page at a time), too long for the suite (docs/host-files.md).
    const SIZE: usize = 32 << 20;
    let mut data = Vec::with_capacity(SIZE);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    while data.len() < SIZE {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&x.to_le_bytes());
    }
    std::fs::write(dir.join("data.bin"), &data).unwrap();
    drop(data);
    let command = ["sha256sum", "data.bin"];
    let expected = native(&dir, &command);
    let store = dir.join("store");
    let (printed, trace) = record_by_default(&dir, &store, &command);
    assert_eq!(printed, expected);
    assert!(bytes_read(&trace) >= SIZE as u64);
    assert_replays(&dir, &trace, &expected);
    std::fs::remove_dir_all(&dir).unwrap();
}
