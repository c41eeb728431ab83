//! Record and replay, end to end: the determinism suite (every workload
//! recorded once with the probe library preloaded and replayed twice, and
//! from two of its checkpoints, with byte-identical console output),
//! proof that recordings capture real non-determinism, and replays of
//! tampered, truncated, future-version and foreign-image traces.
//!
//! Like the other end-to-end tests they need /dev/kvm and the guest image
//! (the test command builds it first).

mod common;

use std::process::Stdio;

use common::*;
use journal::Entry;

/// Records a workload with the probe library preloaded (`--probes`: its
/// events must change nothing the workload computes) and replays it
/// REPLAYS times; returns the recorded output. Recordings without the
/// probes are the other suites' (preempt.rs, e2e.rs, network.rs).
fn determinism(name: &str, command: &[&str], status: i32) -> String {
    record_and_replay(name, &["--probes"], command, status, |_, _| {})
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn boot_and_clean_shutdown_replay() {
    guest_ready();
    // poweroff -f: the kernel's power-off path, not /init's status report;
    // busybox's (the image's), which calls reboot(2) itself where a host's
    // may ask its init system.
    let stdout = record_and_replay(
        "poweroff",
        &["--probes", "--image"],
        &["sh", "-c", "echo booted; poweroff -f"],
        0,
        |_, _| {},
    );
    assert!(stdout.contains("booted\n"), "{stdout}");
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn clock_readings_replay() {
    guest_ready();
    let stdout = determinism("clock", &["clock_sleep", "4"], 0);
    assert!(
        stdout.contains("clock_sleep: time advanced by at least every sleep"),
        "{stdout}"
    );
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn pipeline_replays() {
    guest_ready();
    let stdout = determinism("pipeline", &["sort_pipeline", "3000"], 0);
    assert!(
        stdout.contains("sort_pipeline: 251 distinct values"),
        "{stdout}"
    );
}

fn finish_order(stdout: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with("syn_cont: finish order:"))
        .unwrap_or_else(|| panic!("no finish order in:\n{stdout}"))
        .to_string()
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn syn_cont_replays_and_its_schedule_is_recorded_not_fixed() {
    guest_ready();
    // Under the exit clock a thread is preempted only at a kernel entry.
    // Without the probe library, whose int3 makes every lock operation one,
    // syn_cont's threads would run one after the other in creation order
    // in every recording; its third argument makes them enter the kernel
    // every 10 iterations instead, as probes would.
    let command = ["syn_cont", "1000", "2000", "10"];
    let first = determinism("syn_cont", &command, 0);
    assert!(first.contains("syn_cont: counts correct"), "{first}");
    // Which thread finishes when depends on where timer interrupts landed:
    // separate recordings differ, replays of one do not. A few recordings
    // make a coincidence unlikely.
    let mut orders = vec![finish_order(&first)];
    for i in 0..3 {
        let (trace, out) = record(&format!("syn_cont{i}"), &[], &command);
        let _ = std::fs::remove_dir_all(trace.parent().unwrap());
        orders.push(finish_order(&expect_status(&out, 0)));
    }
    let mut distinct = orders.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() > 1,
        "four recordings, one finish order: {orders:?}"
    );
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn urandom_replays_and_differs_between_recordings() {
    guest_ready();
    let first = determinism("urandom", &["urandom_sha"], 0);
    let (trace, out) = record("urandom2", &[], &["urandom_sha"]);
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
    let second = expect_status(&out, 0);
    let sha = |s: &str| s.split_whitespace().next().unwrap_or("").to_string();
    assert_eq!(sha(&first).len(), 64, "{first}");
    assert_ne!(
        sha(&first),
        sha(&second),
        "two recordings read the same random bytes"
    );
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn piped_input_is_recorded_and_replayed() {
    guest_ready();
    let trace = scratch("typed").join("trace");
    let mut cmd = insight();
    cmd.args(["record", "-o"]).arg(&trace).args(["--", "sh"]);
    let out = output_with_input(cmd, b"echo typed-$((6*7))\nexit 5\n");
    let stdout = expect_status(&out, 5);
    assert!(stdout.contains("typed-42\n"), "{stdout}");
    // Replay reads nothing from its standard input: the command's comes
    // from the log.
    assert_replays_identically(&trace, &stdout);
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

/// The exit ordinal reported by a divergence message.
fn divergence_exit(stderr: &str) -> u64 {
    let rest = stderr
        .split("replay diverged at exit ")
        .nth(1)
        .unwrap_or_else(|| panic!("no divergence reported: {stderr}"));
    rest.split(':').next().unwrap().parse().unwrap()
}

/// Index in `events` and ordinal of the `n`-th exit entry matching `pick`.
fn nth_exit(events: &[Entry], n: usize, pick: impl Fn(&Entry) -> bool) -> (usize, u64) {
    let mut ordinal = 0;
    let mut seen = 0;
    for (i, e) in events.iter().enumerate() {
        if e.is_exit() {
            ordinal += 1;
            if pick(e) {
                seen += 1;
                if seen == n {
                    return (i, ordinal);
                }
            }
        }
    }
    panic!("fewer than {n} such exits");
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn tampered_truncated_and_foreign_traces() {
    guest_ready();
    // On the UART, whose every byte is an exit with its value logged
    // (the virtio console's output: console.rs): to the terminal, standard
    // input, since standard output here is a pipe, which would make the
    // command's one too (streams.rs).
    // The built-in guest: the log is rewritten below, which keeps no
    // host-files replies.
    let (trace, out) = record(
        "tamper",
        &["--digest-every", "1", "--console", "serial", "--image"],
        &[
            "sh",
            "-c",
            "exec >&0; echo some output to tamper with; sleep 0.3",
        ],
    );
    let recorded = expect_status(&out, 0);
    let dir = trace.parent().unwrap().to_owned();
    let (header, events) = read_all(&trace);

    // A recorded RIP changed: replay stops at exactly that exit.
    let (at, ordinal) = nth_exit(&events, 200, |_| true);
    let mut tampered = events.clone();
    tampered[at] = tampered[at].clone().with_rip(0xdead_beef);
    let bad_rip = dir.join("bad-rip");
    write_all(&bad_rip, &trace, &header, tampered);
    let out = replay(&bad_rip);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(divergence_exit(&stderr), ordinal, "{stderr}");
    assert!(stderr.contains("0xdeadbeef"), "{stderr}");
    // `insight diff` finds the same place without running anything.
    let out = insight()
        .arg("diff")
        .arg(&trace)
        .arg(&bad_rip)
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(&format!(
            "first difference at log entry {}, exit {ordinal}:",
            at + 1
        )),
        "{stdout}"
    );
    let out = insight()
        .arg("diff")
        .arg(&trace)
        .arg(&trace)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).0);

    // A recorded device value changed: the UART's line status read right
    // before the driver sent bytes (after reading the modem status) now
    // says "not ready".
    let lsr_then_send = |i: usize| {
        let next: Vec<&Entry> = events[i + 1..]
            .iter()
            .filter(|e| e.is_exit())
            .take(2)
            .collect();
        matches!(events[i], Entry::In { port: 0x3fd, value, .. } if value & 0x20 != 0)
            && matches!(
                next[..],
                [
                    Entry::In { port: 0x3fe, .. },
                    Entry::Out { port: 0x3f8, .. }
                ]
            )
    };
    let at = (0..events.len() - 1)
        .find(|&i| lsr_then_send(i))
        .expect("no serial output in the recording");
    let ordinal = events[..=at].iter().filter(|e| e.is_exit()).count() as u64;
    let mut tampered = events.clone();
    if let Entry::In { value, .. } = &mut tampered[at] {
        *value = 0;
    }
    let bad_value = dir.join("bad-value");
    write_all(&bad_value, &trace, &header, tampered);
    let out = replay(&bad_value);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    // The driver keeps the status in a register: the digest at the very
    // next exit (every exit here) already differs.
    assert_eq!(divergence_exit(&stderr), ordinal + 1, "{stderr}");
    assert!(stderr.contains("registers digest"), "{stderr}");

    // Truncated in the middle of a frame, without the completion marker:
    // the whole frames before the cut replay, and replay says so.
    let cut = dir.join("cut");
    std::fs::create_dir_all(&cut).unwrap();
    for f in ["header", "payloads"] {
        std::fs::copy(trace.join(f), cut.join(f)).unwrap();
    }
    copy_snapshot(&trace, &cut);
    let full = std::fs::read(trace.join("events")).unwrap();
    // A frame: a 16-byte head, then its compressed events.
    let first_frame = 16 + u32::from_le_bytes(full[..4].try_into().unwrap()) as usize;
    assert!(full.len() > first_frame + 16, "one frame only");
    std::fs::write(cut.join("events"), &full[..first_frame + 16]).unwrap();
    let out = replay(&cut);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("incomplete"), "{stderr}");

    // Cut right after a HLT, before the interrupt that woke the guest:
    // the natural end of a killed recording of an idle guest.
    let (at, ordinal) = nth_exit(&events, 1, |e| matches!(e, Entry::Halt { .. }));
    let after_hlt = dir.join("cut-after-hlt");
    write_prefix(&after_hlt, &trace, &header, &events[..=at]);
    let out = replay(&after_hlt);
    let (replayed, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    // Every exit up to the HLT replayed, and what the guest printed by
    // then is what the recording printed first.
    assert!(
        stderr.contains(&format!("all {ordinal} deterministic exits it holds")),
        "{stderr}"
    );
    assert!(
        recorded.starts_with(&replayed),
        "{replayed:?} / {recorded:?}"
    );

    // Cut right after an interrupt delivered to a running guest: the
    // guest's next exit is past the log, and the replay ends there.
    let at = (1..events.len())
        .find(|&i| {
            matches!(events[i], Entry::Interrupt { .. })
                && !matches!(events[i - 1], Entry::Halt { .. })
                && events.get(i + 1).is_some_and(Entry::is_exit)
        })
        .expect("no interrupt delivered to a running guest");
    let ordinal = exit_ordinal(&events, at);
    let after_interrupt = dir.join("cut-after-interrupt");
    write_prefix(&after_interrupt, &trace, &header, &events[..=at]);
    let out = replay(&after_interrupt);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(
        stderr.contains(&format!("all {ordinal} deterministic exits it holds")),
        "{stderr}"
    );

    // A future format version is refused, naming the versions.
    let future = dir.join("future");
    std::fs::create_dir_all(&future).unwrap();
    for f in ["events", "payloads", "complete"] {
        std::fs::copy(trace.join(f), future.join(f)).unwrap();
    }
    let mut bytes = std::fs::read(trace.join("header")).unwrap();
    bytes[8..12].copy_from_slice(&(trace::TRACE_VERSION + 1).to_le_bytes());
    std::fs::write(future.join("header"), bytes).unwrap();
    let out = replay(&future);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("format version"), "{stderr}");

    // A trace of another kernel image is refused before booting.
    let mut foreign = header.clone();
    foreign.images[0].digest = "0".repeat(64);
    let other = dir.join("other-image");
    write_all(&other, &trace, &foreign, events);
    let out = replay(&other);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("SHA-256"), "{stderr}");

    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn killed_recorder_leaves_a_replayable_prefix() {
    guest_ready();
    let trace = scratch("killed").join("trace");
    let mut child = insight()
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .args([
            "--",
            "sh",
            "-c",
            "echo started; i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait for the guest command's third tick, then 2 s more, then kill -9.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("tick 3\n") {
        use std::io::Read;
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "recorder ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    std::thread::sleep(std::time::Duration::from_secs(2));
    child.kill().unwrap();
    child.wait().unwrap();
    {
        use std::io::Read;
        stdout.read_to_end(&mut seen).unwrap();
    }
    let recorded = String::from_utf8_lossy(&seen).into_owned();
    assert!(!trace.join("complete").exists());

    let out = replay(&trace);
    let (replayed, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("incomplete"), "{stderr}");
    // The replay prints what the recording printed, up to where its log
    // ends; the recorder flushes at least once a second, so the log holds
    // what was printed 2 s before the kill.
    assert!(
        recorded.starts_with(&replayed),
        "{replayed:?} / {recorded:?}"
    );
    assert!(replayed.contains("tick 3\n"), "{replayed:?} / {recorded:?}");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn disk_workload_replays_and_the_base_image_never_changes() {
    guest_ready();
    let dir = scratch("disk");
    let base = dir.join("base.img");
    std::fs::write(&base, vec![0u8; 16 << 20]).unwrap();
    let digest = || guest::sha256_hex(&std::fs::read(&base).unwrap());
    let before = digest();
    let cfg = dir.join("vm.toml");
    std::fs::write(&cfg, "disk = \"base.img\"\ncommand = \"disk_check\"\n").unwrap();
    let trace = dir.join("trace");
    let out = insight()
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .arg(&cfg)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = expect_status(&out, 0);
    assert!(
        stdout.contains("disk_check: 4 files of 256 KiB read back from the disk intact"),
        "{stdout}"
    );
    // Completions were logged where the guest saw them.
    let (_, events) = read_all(&trace);
    let completions = events
        .iter()
        .filter(|e| matches!(e, Entry::DiskDone { .. }))
        .count();
    assert!(completions > 10, "{completions} disk completion entries");
    assert_replays_identically(&trace, &stdout);
    assert_eq!(digest(), before, "the base image changed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn branch_clock_is_refused_with_the_reason() {
    // The refusal comes before the guest is prepared: only KVM is needed.
    kvm_ready();
    let (trace, out) = record("branch-clock", &["--clock", "branch"], &["true"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    // On a host without a PMU the reason names what is missing; on one with
    // a PMU this version still records with the exit clock only.
    assert!(
        stderr.contains("this host has none") || stderr.contains("exit clock only"),
        "{stderr}"
    );
    assert!(stderr.contains("--clock exit"), "{stderr}");
    assert!(
        !trace.exists(),
        "a refused recording left {}",
        trace.display()
    );
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}
