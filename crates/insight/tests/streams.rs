//! The command's standard streams as the user gave them to insight: each
//! a terminal only where insight's is, else a pipe whose bytes reach
//! insight's stream of the same number (files, pipes), logged as
//! `StreamOut` entries and written again, and checked, by a replay; or,
//! for standard input, come from insight's, logged as `StreamIn` entries
//! and given again by a replay.

mod common;

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use journal::Entry;

/// What a command run with its standard output and error in files wrote:
/// its status, standard output, and standard error without insight's own
/// lines.
struct Streams {
    status: Option<i32>,
    out: String,
    err: String,
    /// insight's own lines on standard error, for failure messages.
    said: String,
}

/// Runs `cmd` (standard input closed) with standard output in
/// `dir/name.out` and standard error in `dir/name.err`, or in one file,
/// `dir/name.out`, opened once for both (`>log 2>&1`) with `one_file`.
fn into_files(cmd: Command, dir: &Path, name: &str, one_file: bool) -> Streams {
    into_files_from(cmd, Stdio::null(), dir, name, one_file)
}

/// [`into_files`] with `input` as standard input.
fn into_files_from(
    mut cmd: Command,
    input: Stdio,
    dir: &Path,
    name: &str,
    one_file: bool,
) -> Streams {
    let (out_path, err_path) = (
        dir.join(format!("{name}.out")),
        dir.join(format!("{name}.err")),
    );
    let out = File::create(&out_path).unwrap();
    let err = match one_file {
        true => out.try_clone().unwrap(),
        false => File::create(&err_path).unwrap(),
    };
    let mut child = cmd.stdin(input).stdout(out).stderr(err).spawn().unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(600) {
            let _ = child.kill();
            panic!("{cmd:?} was still running after 600 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let (out, err) = (read(&out_path), read(&err_path));
    let (said, err): (Vec<&str>, Vec<&str>) = err
        .split_inclusive('\n')
        .partition(|l| l.starts_with("insight: "));
    // In one file, insight's lines are among the command's.
    let (said_out, out): (Vec<&str>, Vec<&str>) = out
        .split_inclusive('\n')
        .partition(|l| one_file && l.starts_with("insight: "));
    Streams {
        status: status.code(),
        out: out.concat(),
        err: err.concat(),
        said: [said, said_out].concat().concat(),
    }
}

/// The `StreamOut` entries of a trace: (stream, bytes) in order, and
/// whether the log has console output.
fn logged_streams(trace: &Path) -> (Vec<(u8, u64)>, bool) {
    let (_, log) = read_all(trace);
    let streams = log
        .iter()
        .filter_map(|e| match e {
            Entry::StreamOut { stream, bytes, .. } => Some((*stream, *bytes)),
            _ => None,
        })
        .collect();
    let console = log.iter().any(|e| matches!(e, Entry::ConsoleOut { .. }));
    (streams, console)
}

/// `insight run` with its standard output and error in two files puts
/// each of the command's in its own; a pipe is not a terminal to the
/// command (`test -t 1` fails), while a terminal is; both in one file keep
/// the order they were written in; and pigz, which refuses to write
/// compressed data to a terminal, writes it to a pipe as natively.
#[ignore = "needs /dev/kvm, the guest image, script and pigz (tools/test runs it)"]
#[test]
fn run_gives_the_command_its_streams_as_insight_has_them() {
    guest_ready();
    let dir = scratch("streams-run");
    let run = |args: &[&str]| {
        let mut cmd = insight();
        cmd.args(["run", "--no-stdin", "--"]).args(args);
        cmd
    };

    let got = into_files(
        run(&["sh", "-c", "echo out; echo err >&2"]),
        &dir,
        "two",
        false,
    );
    assert_eq!(got.status, Some(0), "{}", got.said);
    assert_eq!(got.out, "out\n");
    assert_eq!(got.err, "err\n", "insight said: {}", got.said);

    // `insight run -- test -t 1 | cat`: a pipe is not a terminal.
    let piped = output_within(run(&["test", "-t", "1"]), Duration::from_secs(300));
    assert_eq!(piped.status.code(), Some(1), "{}", text(&piped).1);
    let piped = output_within(run(&["test", "-t", "2"]), Duration::from_secs(300));
    assert_eq!(piped.status.code(), Some(1), "{}", text(&piped).1);

    // `insight run -- yes | head -n 1`: once the reader has gone, the
    // command's next write fails as natively (SIGPIPE, status 128 + 13).
    let mut yes = run(&["yes"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut reader = std::io::BufReader::new(yes.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut reader, &mut line).unwrap();
        assert_eq!(line, "y\n");
    }
    let started = Instant::now();
    let status = loop {
        if let Some(status) = yes.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(300) {
            let _ = yes.kill();
            panic!("yes went on writing into a closed pipe for 300 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(141));

    // Under a terminal, both are the command's terminal.
    let insight_bin = env!("CARGO_BIN_EXE_insight");
    let (status, screen) = under_terminal(
        &format!(
            "{insight_bin} run --no-stdin -- sh -c 'test -t 1 && test -t 2 && echo both-terminals'"
        ),
        &dir,
        b"",
    );
    assert_eq!(status, Some(0), "{screen}");
    assert!(screen.contains("both-terminals"), "{screen}");
    // Standard error alone in a file: standard output stays the terminal.
    let (status, screen) = under_terminal(
        &format!(
            "{insight_bin} run --no-stdin -- sh -c 'test -t 1 && ! test -t 2 && echo out-only; \
             echo to-the-file >&2' 2>errors.txt"
        ),
        &dir,
        b"",
    );
    assert_eq!(status, Some(0), "{screen}");
    assert!(screen.contains("out-only"), "{screen}");
    assert!(!screen.contains("to-the-file"), "{screen}");
    let errors = std::fs::read_to_string(dir.join("errors.txt")).unwrap();
    assert!(errors.contains("to-the-file\n"), "{errors}");

    // `>log 2>&1`: one pipe for both, in the order written.
    let got = into_files(
        run(&["sh", "-c", "echo 1; echo 2 >&2; echo 3 >&2; echo 4"]),
        &dir,
        "one",
        true,
    );
    assert_eq!(got.status, Some(0), "{}", got.said);
    assert_eq!(got.out, "1\n2\n3\n4\n");

    // pigz by its host path, compressing a file brought along, into a
    // pipe: what it wrote decompresses to the file.
    let pigz = Path::new("/usr/bin/pigz");
    assert!(
        pigz.exists(),
        "/usr/bin/pigz is missing: tools/test installs it"
    );
    let data = dir.join("data.txt");
    let text_data: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
    std::fs::write(&data, &text_data).unwrap();
    let mut cmd = insight();
    cmd.current_dir(&dir)
        .args(["run", "--no-stdin", "--file", "data.txt", "--"])
        .args(["/usr/bin/pigz", "-c", "data.txt"]);
    let compressed = output_within(cmd, Duration::from_secs(300));
    assert_eq!(compressed.status.code(), Some(0), "{}", text(&compressed).1);
    let mut gunzip = Command::new("gzip")
        .args(["-dc"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = gunzip.stdin.take().unwrap();
        stdin.write_all(&compressed.stdout).unwrap();
    }
    let plain = gunzip.wait_with_output().unwrap();
    assert!(plain.status.success(), "pigz's output is not gzip data");
    assert!(
        plain.stdout == text_data.as_bytes(),
        "pigz's output is not the file's"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `insight record` gives the command its streams as `run` does and logs
/// what each carried; a replay writes each to its own stream again,
/// checking every piece against the log, and stops where one differs.
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn record_logs_each_stream_and_replay_writes_and_checks_it() {
    guest_ready();
    let dir = scratch("streams-record");
    let trace = dir.join("trace");
    // The built-in guest: the log is rewritten below, which keeps no
    // host-files replies (their payloads and stored files).
    let mut cmd = insight();
    cmd.args(["record", "--no-stdin", "--image", "-o"])
        .arg(&trace)
        .args([
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; seq 1 30000; sleep 1; echo done >&2; exit 5",
        ]);
    let recorded = into_files(cmd, &dir, "record", false);
    assert_eq!(recorded.status, Some(5), "{}", recorded.said);
    let seq: String = (1..=30_000).map(|i| format!("{i}\n")).collect();
    assert_eq!(recorded.out, format!("out\n{seq}"));
    assert_eq!(
        recorded.err, "err\ndone\n",
        "insight said: {}",
        recorded.said
    );

    let (streams, console) = logged_streams(&trace);
    assert!(!console, "the command's output went to its terminal");
    let total = |n: u8| -> u64 { streams.iter().filter(|s| s.0 == n).map(|s| s.1).sum() };
    assert_eq!(total(1) as usize, recorded.out.len());
    assert_eq!(total(2) as usize, recorded.err.len());

    // Plain, taking checkpoints, then in segments from them (each
    // segment's standard error follows its standard output).
    for (round, extra) in [
        ["--checkpoint-every", "200ms"].as_slice(),
        &[],
        &["--jobs", "2"],
    ]
    .iter()
    .enumerate()
    {
        let mut cmd = insight();
        cmd.arg("replay").arg(&trace).args(*extra);
        let replayed = into_files(cmd, &dir, &format!("replay-{round}"), false);
        assert_eq!(replayed.status, Some(0), "{}", replayed.said);
        assert!(
            replayed.said.contains("replay matched the recording"),
            "{}",
            replayed.said
        );
        if extra.contains(&"--jobs") {
            assert!(
                replayed.said.contains("segments replayed faithfully"),
                "{}",
                replayed.said
            );
        }
        assert!(
            replayed.out == recorded.out,
            "replay {round}'s standard output differs"
        );
        assert_eq!(replayed.err, recorded.err, "replay {round}");
    }

    // Standard error's first piece with another digest: the replay stops
    // at the exit that wrote it.
    let (header, log) = read_all(&trace);
    let at = log
        .iter()
        .position(|e| matches!(e, Entry::StreamOut { stream: 2, .. }))
        .expect("no standard error logged");
    let ordinal = exit_ordinal(&log, at);
    let mut tampered = log.clone();
    if let Entry::StreamOut { digest, .. } = &mut tampered[at] {
        *digest ^= 1;
    }
    let bad = dir.join("bad-stream");
    write_all(&bad, &trace, &header, tampered);
    let out = replay(&bad);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("replay diverged at exit {ordinal}:")),
        "{stderr}"
    );
    assert!(stderr.contains("standard error"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A program compiled on the host and recorded by its path
/// (tests/programs/two_streams.c) writes to both streams and asks whether
/// each is a terminal: into files it sees pipes, and under a terminal the
/// terminal; its replays write what it wrote, where it wrote it.
#[ignore = "needs /dev/kvm, the guest image, gcc and script (tools/test runs it)"]
#[test]
fn a_host_program_sees_pipes_or_the_terminal_as_insight_has_them() {
    guest_ready();
    let dir = scratch("streams-host");
    compile_test_program(&dir, "two_streams", &["-O2"]);
    let trace = dir.join("trace");
    let mut cmd = insight();
    cmd.current_dir(&dir)
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .args(["--", "./two_streams", "3"]);
    let recorded = into_files(cmd, &dir, "record", false);
    assert_eq!(recorded.status, Some(3), "{}", recorded.said);
    assert_eq!(recorded.out, "out 0\nout 1\nout 2\nstdout not a terminal\n");
    assert_eq!(
        recorded.err, "err 0\nerr 1\nerr 2\nstderr not a terminal\n",
        "insight said: {}",
        recorded.said
    );
    let mut cmd = insight();
    cmd.arg("replay").arg(&trace);
    let replayed = into_files(cmd, &dir, "replay", false);
    assert_eq!(replayed.status, Some(0), "{}", replayed.said);
    assert_eq!(replayed.out, recorded.out);
    assert_eq!(replayed.err, recorded.err);

    // Under a terminal: the terminal, and nothing logged as a stream; a
    // replay without one writes the terminal's output to its own.
    let tty_trace = dir.join("tty-trace");
    let (status, screen) = under_terminal(
        &format!(
            "{} record --no-stdin -o {} -- ./two_streams 1",
            env!("CARGO_BIN_EXE_insight"),
            tty_trace.display()
        ),
        &dir,
        b"",
    );
    assert_eq!(status, Some(3), "{screen}");
    assert!(screen.contains("stdout terminal"), "{screen}");
    assert!(screen.contains("stderr terminal"), "{screen}");
    let (streams, console) = logged_streams(&tty_trace);
    assert!(streams.is_empty() && console, "{streams:?}");
    let out = replay(&tty_trace);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stdout.contains("out 0"), "{stdout}");
    assert!(stdout.contains("stderr terminal"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A program compiled on the host and recorded by its path
/// (tests/programs/stdin_digest.c) reads a file given to insight as its
/// standard input, in reads of changing sizes: it gets every byte, in
/// order, and the end, as natively, from a pipe and not a terminal; the
/// recording logs the input and a replay, given none, gives it the same.
/// `insight run` gives a shell script its input, a command that stops
/// reading early ends as natively, and `--no-stdin` keeps the terminal.
#[ignore = "needs /dev/kvm, the guest image and gcc (tools/test runs it)"]
#[test]
fn standard_input_is_a_pipe_from_insights_where_that_is_no_terminal() {
    guest_ready();
    let dir = scratch("streams-input");
    let prog = compile_test_program(&dir, "stdin_digest", &["-O2"]);
    // 300 kB: several of /init's 64 KiB pieces, none of them full.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..300_000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let input = dir.join("input.bin");
    std::fs::write(&input, &data).unwrap();
    let native = Command::new(&prog)
        .stdin(File::open(&input).unwrap())
        .output()
        .unwrap();
    let native = String::from_utf8(native.stdout).unwrap();
    assert!(native.contains("300000 bytes"), "{native}");

    let trace = dir.join("trace");
    let mut cmd = insight();
    cmd.current_dir(&dir)
        .args(["record", "-o"])
        .arg(&trace)
        .args(["--", "./stdin_digest"]);
    let input_file = || Stdio::from(File::open(&input).unwrap());
    let recorded = into_files_from(cmd, input_file(), &dir, "record", false);
    assert_eq!(recorded.status, Some(0), "{}", recorded.said);
    assert_eq!(recorded.out, native, "{}", recorded.said);
    let (_, log) = read_all(&trace);
    let pieces: Vec<(usize, bool)> = log
        .iter()
        .filter_map(|e| match e {
            Entry::StreamIn { bytes, end } => Some((bytes.len(), *end)),
            _ => None,
        })
        .collect();
    assert_eq!(
        pieces.iter().map(|p| p.0).sum::<usize>(),
        data.len(),
        "{pieces:?}"
    );
    assert_eq!(pieces.iter().filter(|p| p.1).count(), 1, "{pieces:?}");
    assert!(pieces.last().is_some_and(|p| p.1), "{pieces:?}");

    // No input at all for the replay: it comes from the log.
    let mut cmd = insight();
    cmd.arg("replay").arg(&trace);
    let replayed = into_files(cmd, &dir, "replay", false);
    assert_eq!(replayed.status, Some(0), "{}", replayed.said);
    assert!(
        replayed.said.contains("replay matched the recording"),
        "{}",
        replayed.said
    );
    assert_eq!(replayed.out, recorded.out);

    let run = |args: &[&str], input: Stdio, name: &str| {
        let mut cmd = insight();
        cmd.current_dir(&dir).args(["run", "--"]).args(args);
        into_files_from(cmd, input, &dir, name, false)
    };
    std::fs::write(dir.join("lines"), "one\ntwo\n").unwrap();
    let lines = || Stdio::from(File::open(dir.join("lines")).unwrap());
    let got = run(
        &["sh", "-c", "while read l; do echo \"<$l>\"; done; echo end"],
        lines(),
        "script",
    );
    assert_eq!(got.status, Some(0), "{}", got.said);
    assert_eq!(got.out, "<one>\n<two>\nend\n", "{}", got.said);
    // Standard input closed on the host: the end at once, no terminal.
    let got = run(&["test", "-t", "0"], Stdio::null(), "null");
    assert_eq!(got.status, Some(1), "{}", got.said);
    let got = run(&["./stdin_digest"], Stdio::null(), "empty");
    assert_eq!(got.status, Some(0), "{}", got.said);
    assert!(
        got.out.contains("\n0 bytes, digest cbf29ce484222325"),
        "{}",
        got.out
    );
    // A reader that stops early: its status as natively, and /init
    // neither blocks nor fails on the input left.
    let numbers: String = (1..=100_000).map(|i| format!("{i}\n")).collect();
    std::fs::write(dir.join("numbers"), numbers).unwrap();
    let numbers = Stdio::from(File::open(dir.join("numbers")).unwrap());
    let got = run(&["head", "-n", "2"], numbers, "head");
    assert_eq!(got.status, Some(0), "{}", got.said);
    assert_eq!(got.out, "1\n2\n", "{}", got.said);
    // Told not to take insight's input, the command keeps the terminal.
    let mut cmd = insight();
    cmd.args(["run", "--no-stdin", "--", "test", "-t", "0"]);
    let got = into_files_from(cmd, input_file(), &dir, "no-stdin", false);
    assert_eq!(got.status, Some(0), "{}", got.said);
    let _ = std::fs::remove_dir_all(&dir);
}
