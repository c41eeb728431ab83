//! The command's terminal: the virtio console (`hvc0`, a VM exit per
//! buffer of output) by default, the UART (`ttyS0`) with `--console
//! serial`. Output reaches the host byte for byte and replays identically,
//! checked by the log; typed input, Ctrl-C and the host terminal's size
//! reach the command and replay from the log.

mod common;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use journal::Entry;

/// Ten million bytes, a block at a time (busybox `head` writes a line at
/// a time to a terminal; `cat` writes what it reads): `run` prints them
/// all, `record` logs every transmitted buffer's length and digest, and
/// a replay prints the same bytes.
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn ten_million_bytes_reach_the_host_and_replay_identically() {
    guest_ready();
    const BYTES: usize = 10_000_000;
    // To the terminal: insight's standard output here is a pipe, which
    // the command's would be too (streams.rs).
    let command = ["sh", "-c", "exec >/dev/tty; yes | head -c 10000000 | cat"];
    let check = |stdout: &[u8], what: &str| {
        assert_eq!(stdout.len(), BYTES, "{what} printed another length");
        assert!(
            stdout.chunks(2).all(|c| c == b"y\n"),
            "{what} printed other bytes than yes's"
        );
    };

    let mut run = insight();
    run.args(["run", "--no-stdin", "--"]).args(command);
    let out = output_within(run, Duration::from_secs(600));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    check(&out.stdout, "run");

    let (trace, out) = record("console-10m", &[], &command);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    check(&out.stdout, "record");
    // Every byte went through the virtio console, in buffers of at most
    // one tty write (64 KiB), each logged with the notification that
    // sent it.
    let (_, log) = read_all(&trace);
    let logged: Vec<u64> = log
        .iter()
        .filter_map(|e| match e {
            Entry::ConsoleOut { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .collect();
    assert_eq!(logged.iter().sum::<u64>(), BYTES as u64);
    assert!(
        logged.iter().all(|&b| b <= 64 << 10),
        "a buffer beyond a tty write"
    );
    assert!(
        logged.len() < BYTES / 1000,
        "{} buffers: the output went a few bytes at a time",
        logged.len()
    );

    let replayed = replay(&trace);
    let (_, stderr) = text(&replayed);
    assert_eq!(replayed.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert!(
        replayed.stdout == out.stdout,
        "the replay printed {} bytes, not the recording's",
        replayed.stdout.len()
    );
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

/// insight's guest kernel takes the console's write registers (one VM exit
/// and no virtqueue work a write, no copy of a program's write): the
/// driver accepted the features the device offers
/// (`VIRTIO_CONSOLE_F_INSIGHT_WRITE`, bit 23, and `..._WRITE_USER`, bit
/// 24), and what it wrote through them reached the host byte for byte,
/// including the cases images/workloads/console_writes.c makes: buffers
/// across pages, 17 pages at once, `writev` segments, a buffer the
/// program cannot read (EFAULT, nothing written) and a page never touched.
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn the_guest_writes_its_output_through_the_console_register() {
    guest_ready();
    // The features, then text that is different on every page of a
    // write: `cat` writes what `seq` piped to it in 4 KiB pieces, each read
    // by the device through the program's page tables.
    let script = "exec >/dev/tty; for d in /sys/bus/virtio/devices/*; do \
                  [ \"$(cat $d/device)\" = 0x0003 ] && echo \"features $(cat $d/features)\"; \
                  done; seq 1 100000 | cat; console_writes";
    let mut run = insight();
    run.args(["run", "--no-stdin", "--", "sh", "-c", script]);
    let out = output_within(run, Duration::from_secs(300));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let features = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("features "))
        .unwrap_or_else(|| panic!("no virtio console in the guest: {stdout}"));
    // The file lists the negotiated bits from bit 0 on.
    assert_eq!(
        features.as_bytes().get(23),
        Some(&b'1'),
        "the driver did not take the write register: {features}"
    );
    assert_eq!(
        features.as_bytes().get(24),
        Some(&b'1'),
        "the driver did not take the user write register: {features}"
    );
    let printed = stdout
        .split_once("features ")
        .and_then(|(_, rest)| rest.split_once('\n'))
        .map(|(_, rest)| rest)
        .unwrap_or_default();
    let mut expected: String = (1..=100_000).map(|i| format!("{i}\n")).collect();
    expected += &console_writes_text();
    assert!(
        printed == expected,
        "{} bytes came out as {} bytes, first difference at byte {:?}",
        expected.len(),
        printed.len(),
        printed
            .bytes()
            .zip(expected.bytes())
            .position(|(a, b)| a != b)
    );
}

/// What images/workloads/console_writes.c prints: its buffers' text (32-byte
/// lines "TAG OFFSET" padded with '-') and a line per case with what
/// write() returned.
fn console_writes_text() -> String {
    const PAGE: usize = 4096;
    let fill = |n: usize, tag: &str| -> String {
        let mut text = String::new();
        for off in (0..n).step_by(32) {
            let mut line = format!("{tag} {off:06}");
            line.extend(std::iter::repeat_n('-', 31 - line.len()));
            line.push('\n');
            text += &line[..32.min(n - off)];
        }
        text
    };
    let big = fill(17 * PAGE, "big");
    let mut out = fill(96, "cross");
    out += "\ncross: 96 ok\n";
    out += &big;
    out += &format!("\nbig: {} ok\n", 17 * PAGE);
    out += &big[100..150];
    out += &fill(32, "stack");
    out += &big[3 * PAGE - 10..3 * PAGE + 10];
    out += "\nwritev: 102 ok\n";
    out += "\nefault: -1 Bad address\n";
    out += &"\0".repeat(16);
    out += "\nfresh: 16 ok\n";
    out
}

/// A replay whose console output differs from the recording's stops at
/// the notification that sent it, saying what was logged.
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn console_output_is_checked_at_replay() {
    guest_ready();
    // The built-in guest: the log is rewritten below, which keeps no
    // host-files replies.
    let (trace, out) = record(
        "console-tamper",
        &["--image"],
        &[
            "sh",
            "-c",
            "exec >/dev/tty; echo first line; echo second line",
        ],
    );
    let recorded = expect_status(&out, 0);
    let (header, log) = read_all(&trace);
    let at = log
        .iter()
        .position(|e| matches!(e, Entry::ConsoleOut { .. }))
        .expect("no console output logged");
    let ordinal = exit_ordinal(&log, at);
    let mut tampered = log.clone();
    if let Entry::ConsoleOut { digest, .. } = &mut tampered[at] {
        *digest ^= 1;
    }
    let bad = trace.parent().unwrap().join("bad-output");
    write_all(&bad, &trace, &header, tampered);
    let out = replay(&bad);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("replay diverged at exit {ordinal}:")),
        "{stderr}"
    );
    assert!(stderr.contains("console output"), "{stderr}");
    // The untouched trace replays.
    let out = replay(&trace);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    assert_eq!(text(&out).0, recorded);
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

/// Typed input through the UART, as for a guest kernel without
/// virtio-console (the default console's input is
/// `a_terminal_gives_its_size_and_its_ctrl_c_and_both_replay`).
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_serial_console_takes_typed_input_and_replays_it() {
    guest_ready();
    let trace = scratch("typed-serial").join("trace");
    // Typed at a terminal (`script` makes one): input piped to insight
    // would be the command's standard input, a pipe.
    let inner = format!(
        "{} record --console serial -o {} -- sh -c 'readlink /proc/self/fd/0; read line; echo got-$line'",
        env!("CARGO_BIN_EXE_insight"),
        trace.display()
    );
    // The keys wait on the host until the serial console takes them.
    let (status, screen) = under_terminal(&inner, trace.parent().unwrap(), b"serial-input\r");
    let stdout = screen.replace("\r\n", "\n");
    assert_eq!(status, Some(0), "{stdout}");
    assert!(stdout.contains("/dev/console\n"), "{stdout}");
    assert!(stdout.contains("got-serial-input\n"), "{stdout}");
    let (_, log) = read_all(&trace);
    assert!(
        !log.iter().any(|e| matches!(
            e,
            Entry::ConsoleOut { .. } | Entry::ConsoleRx { .. } | Entry::ConsoleSize { .. }
        )),
        "the serial console's run used the virtio console"
    );
    // What the guest wrote, the typed line's echo included (the host
    // terminal's line ends aside).
    let out = replay(&trace);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out).1);
    let replayed = text(&out).0.replace("\r\n", "\n");
    assert!(replayed.contains("/dev/console\n"), "{replayed}");
    assert!(replayed.contains("serial-input"), "{replayed}");
    assert!(replayed.contains("got-serial-input\n"), "{replayed}");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

/// `top` draws the same screens in a replay as in its recording.
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn top_replays_identically() {
    guest_ready();
    let stdout = record_and_replay(
        "console-top",
        &[],
        &["top", "-b", "-n", "2", "-d", "1"],
        0,
        |_, _| {},
    );
    // busybox's top says "Load average:", procps's "load average:".
    let screens = stdout.to_lowercase().matches("load average:").count();
    assert_eq!(screens, 2, "{stdout}");
}

/// `insight` under a terminal (`script` makes one): its size reaches the
/// command's terminal and the log, Ctrl-C interrupts the command's
/// foreground job, and a replay (no terminal at all) does the same.
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_terminal_gives_its_size_and_its_ctrl_c_and_both_replay() {
    guest_ready();
    let trace = scratch("console-pty").join("trace");
    let inner = format!(
        "stty cols 123 rows 45; exec {} record -o {} -- env PS1='ready> ' sh",
        env!("CARGO_BIN_EXE_insight"),
        trace.display()
    );
    let mut script = Command::new("script")
        .args(["-q", "-e", "-c", &inner, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script (util-linux) runs a command under a terminal");
    let mut keys = script.stdin.take().unwrap();
    let mut output = script.stdout.take().unwrap();
    let (seen_tx, seen) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = output.read(&mut buf) {
            if seen_tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut screen = Vec::new();
    // Waits until `text` is on the terminal `times` times.
    let mut wait_for_text = |text: &str, times: usize| {
        let started = Instant::now();
        while String::from_utf8_lossy(&screen).matches(text).count() < times {
            let left = Duration::from_secs(120).saturating_sub(started.elapsed());
            match seen.recv_timeout(left) {
                Ok(bytes) => screen.extend(bytes),
                Err(_) => panic!(
                    "no {text:?} on the terminal after 120 s:\n{}",
                    String::from_utf8_lossy(&screen)
                ),
            }
        }
    };
    // The shell's prompt (the host's shell, or busybox's: the one it is
    // given), then a job that would run 100 s, interrupted (the next
    // prompt comes when it ends).
    const PROMPT: &str = "ready> ";
    wait_for_text(PROMPT, 1);
    keys.write_all(b"stty size\n").unwrap();
    wait_for_text(PROMPT, 2);
    keys.write_all(b"sleep 100\n").unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let interrupted = Instant::now();
    keys.write_all(b"\x03").unwrap();
    wait_for_text(PROMPT, 3);
    keys.write_all(b"echo sleep-status-$?\n").unwrap();
    wait_for_text("sleep-status-130", 1);
    assert!(
        interrupted.elapsed() < Duration::from_secs(60),
        "Ctrl-C did not interrupt sleep"
    );
    keys.write_all(b"exit 7\n").unwrap();
    let status = script.wait().unwrap();
    let recorded = String::from_utf8_lossy(&screen).into_owned();
    assert_eq!(status.code(), Some(7), "{recorded}");
    assert!(recorded.contains("45 123"), "{recorded}");

    let (_, log) = read_all(&trace);
    assert!(
        log.contains(&Entry::ConsoleSize {
            cols: 123,
            rows: 45
        }),
        "the terminal's size is not in the log"
    );
    assert!(
        log.iter()
            .any(|e| matches!(e, Entry::ConsoleRx { bytes } if bytes.contains(&3))),
        "Ctrl-C is not in the log"
    );
    let replayed = replay(&trace);
    let (stdout, stderr) = text(&replayed);
    assert_eq!(replayed.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("replay matched the recording"), "{stderr}");
    assert!(stdout.contains("45 123"), "{stdout}");
    assert!(stdout.contains("sleep-status-130"), "{stdout}");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}
