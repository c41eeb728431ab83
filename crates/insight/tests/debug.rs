//! `insight debug`: the system's gdb over a replay, forwards and
//! backwards, driven in batch mode over one recording of the guest's
//! `debug_target` (it writes the global `value` 0, then 42 by a store,
//! then 1337 by a `read()` from a pipe, and prints the shared objects it
//! maps).

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use common::*;

/// The recording every test here debugs, and what the program printed.
fn recording() -> &'static (PathBuf, String) {
    static RECORDING: OnceLock<(PathBuf, String)> = OnceLock::new();
    RECORDING.get_or_init(|| {
        guest_ready();
        let (trace, out) = record("debug", &[], &["debug_target"]);
        let stdout = expect_status(&out, 0);
        assert!(stdout.contains("debug_target: value 1337"), "{stdout}");
        (trace, stdout)
    })
}

/// Longer than any session here takes on a slow host.
const SESSION_LIMIT: Duration = Duration::from_secs(900);

/// Runs gdb in batch mode on the recording with `commands`; returns what
/// gdb and insight printed (both streams).
fn gdb(commands: &[&str]) -> String {
    gdb_on(&recording().0, &[], commands)
}

/// `gdb` on `trace`, with `extra` arguments for `insight debug`.
fn gdb_on(trace: &std::path::Path, extra: &[&str], commands: &[&str]) -> String {
    let mut cmd = insight();
    cmd.arg("debug")
        .arg(trace)
        .args(extra)
        .args(["--", "-batch", "-nx"]);
    for c in commands {
        cmd.args(["-ex", c]);
    }
    let out = output_within(cmd, SESSION_LIMIT);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "insight debug failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    format!("{stdout}\n{stderr}")
}

/// The values gdb printed for `print/x EXPR` commands, in order.
fn printed(output: &str) -> Vec<u64> {
    output
        .lines()
        .filter_map(|l| l.split_once(" = 0x"))
        .filter(|(name, _)| name.starts_with('$'))
        .filter_map(|(_, v)| u64::from_str_radix(v.trim(), 16).ok())
        .collect()
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn steps_go_back_to_the_same_instruction_and_registers() {
    let out = gdb(&[
        "break report",
        "continue",
        "print/x $pc",
        // Back over the call: the caller's call instruction, its
        // registers as they were.
        "reverse-stepi",
        "print/x $pc",
        "print/x $rsp",
        "x/i $pc",
        // Forward again: report's first instruction.
        "stepi",
        "print/x $pc",
        // Three more back, then three forward: the same places.
        "reverse-stepi",
        "reverse-stepi",
        "reverse-stepi",
        "print/x $pc",
        "stepi 3",
        "print/x $pc",
        "print/x $rsp",
    ]);
    let v = printed(&out);
    assert_eq!(v.len(), 7, "{out}");
    let (report, call_rsp) = (v[0], v[2]);
    assert!(
        out.contains("call") && out.contains("<main+"),
        "reverse-stepi did not come back to main's call: {out}"
    );
    assert_eq!(v[3], report, "stepi from the call: {out}");
    assert_ne!(v[4], report, "three back: {out}");
    assert_eq!(v[5], report, "three forward again: {out}");
    // The call pushed its return address.
    assert_eq!(v[6], call_rsp - 8, "{out}");
}

/// The (old, new) values of each watchpoint stop gdb printed.
fn watch_changes(out: &str) -> Vec<(i64, i64)> {
    out.lines()
        .zip(out.lines().skip(1))
        .filter_map(|(old, new)| {
            let old = old.strip_prefix("Old value = ")?.trim().parse().ok()?;
            let new = new.strip_prefix("New value = ")?.trim().parse().ok()?;
            Some((old, new))
        })
        .collect()
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn a_watchpoint_goes_back_to_each_write_of_the_value() {
    let out = gdb(&[
        "break report",
        "continue",
        "print value",
        "watch -l value",
        // The read() from the pipe wrote it: the system call.
        "reverse-continue",
        "bt 1",
        // The store in set_value(42).
        "reverse-continue",
        "bt 1",
        // Forwards again: the store happens.
        "continue",
        "print value",
    ]);
    let changes = watch_changes(&out);
    // Going back, "old" is the later value.
    assert_eq!(changes, vec![(1337, 42), (42, 0), (0, 42)], "{out}");
    let frames: Vec<&str> = out.lines().filter(|l| l.starts_with("#0")).collect();
    assert_eq!(frames.len(), 2, "{out}");
    assert!(frames[0].contains("read"), "{out}");
    assert!(frames[1].contains("set_value"), "{out}");
    assert!(
        out.contains("$1 = 1337") && out.contains("$2 = 42"),
        "{out}"
    );
}

/// A watched word that one large read() fills: insight makes that copy
/// for the guest kernel (guest kernel patch 0013), and the watchpoint sees
/// it as the kernel's write, going back and forwards.
#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn a_watchpoint_sees_a_copy_the_kernel_left_to_insight() {
    let (_, stdout) = recording();
    assert!(stdout.contains("debug_target: big[100] 1100"), "{stdout}");
    let out = gdb(&[
        "break report",
        "continue",
        "watch -l big[100]",
        "reverse-continue",
        "bt 1",
        "continue",
        "print big[100]",
    ]);
    let changes = watch_changes(&out);
    assert_eq!(changes, vec![(1100, 0), (0, 1100)], "{out}");
    let frames: Vec<&str> = out.lines().filter(|l| l.starts_with("#0")).collect();
    assert_eq!(frames.len(), 1, "{out}");
    assert!(frames[0].contains("read"), "{out}");
    assert!(out.contains("$1 = 1100"), "{out}");
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn libraries_threads_and_the_start_of_history() {
    let (_, stdout) = recording();
    let out = gdb(&[
        "break write",
        "continue",
        "info sharedlibrary",
        "bt",
        "info threads",
        "delete",
        // Nothing to stop at before: the program's first instruction.
        "reverse-continue",
        "print/x $pc",
        "reverse-stepi",
    ]);
    // Every shared object the program listed from /proc/self/maps, gdb
    // knows of.
    let maps: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("debug_target: maps "))
        .collect();
    assert!(!maps.is_empty(), "{stdout}");
    for m in &maps {
        let name = m.rsplit('/').next().unwrap_or(m);
        assert!(
            out.lines().any(|l| l.starts_with("0x") && l.contains(name)),
            "{name} missing from info sharedlibrary: {out}"
        );
    }
    // The write() into the pipe, called from main.
    let bt: Vec<&str> = out.lines().filter(|l| l.starts_with('#')).collect();
    assert!(bt.first().is_some_and(|f| f.contains("write")), "{out}");
    assert!(bt.iter().any(|f| f.contains("main")), "{out}");
    assert!(out.contains("process"), "info threads: {out}");
    // History starts at the dynamic linker's entry, twice said.
    assert_eq!(
        out.matches("No more reverse-execution history").count(),
        2,
        "{out}"
    );
    assert!(out.contains("_start"), "{out}");
}

/// A recording of `overwriter` (four threads; one, chosen at random, sets
/// `shared` at a random round) beside `libc_loop`, another process running
/// the same libc code; what the guest printed.
fn threads_recording() -> &'static (PathBuf, String) {
    static RECORDING: OnceLock<(PathBuf, String)> = OnceLock::new();
    RECORDING.get_or_init(|| {
        guest_ready();
        let (trace, out) = record(
            "debug-threads",
            &[],
            &["sh", "-c", "libc_loop 3000 & overwriter 4 20000; wait"],
        );
        let stdout = expect_status(&out, 0);
        assert!(stdout.contains("libc_loop: sum"), "{stdout}");
        (trace, stdout)
    })
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn a_watchpoint_finds_the_thread_that_wrote_and_others_run_on_unchanged() {
    let (trace, stdout) = threads_recording();
    // "overwriter: thread 2 (tid 23) wrote at round 11853"
    let wrote = stdout
        .lines()
        .find_map(|l| l.strip_prefix("overwriter: thread "))
        .unwrap_or_else(|| panic!("{stdout}"));
    let words: Vec<&str> = wrote
        .split([' ', '(', ')'])
        .filter(|w| !w.is_empty())
        .collect();
    let (tid, round) = match words[..] {
        [_, "tid", tid, "wrote", "at", "round", round] => (tid, round),
        _ => panic!("{wrote}"),
    };
    let all = gdb_on(
        trace,
        &["--process", "overwriter"],
        &[
            "break report",
            "continue",
            "watch -l shared",
            "reverse-continue",
            "bt 1",
            "print i",
            "info threads",
            "delete",
            // A breakpoint in libc code libc_loop runs too: the other process
            // neither stops nor changes; memory shows the program's byte.
            "break write",
            "continue",
            "x/1xb $pc",
        ],
    );
    assert!(
        all.lines()
            .any(|l| l.starts_with("#0") && l.contains("scribble")),
        "{all}"
    );
    assert!(
        all.contains(&format!("$1 = {round}")),
        "round {round}: {all}"
    );
    // The current thread is the writer.
    assert!(
        all.lines()
            .any(|l| l.starts_with('*') && l.contains(&format!(".{tid} "))),
        "tid {tid}: {all}"
    );
    let byte = all
        .lines()
        .find_map(|l| l.split_once(":\t0x").map(|(_, b)| b.trim().to_owned()))
        .unwrap_or_else(|| panic!("{all}"));
    assert_ne!(byte, "cc", "a breakpoint's byte shows: {all}");
    // After the session the recording replays to the end, unchanged.
    let replayed = replay(trace);
    let (replay_out, replay_err) = text(&replayed);
    assert_eq!(replayed.status.code(), Some(0), "{replay_err}");
    assert_eq!(&replay_out, stdout);
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn breakpoints_go_back_hit_by_hit_and_every_thread_has_a_stack() {
    let (trace, _) = threads_recording();
    let all = gdb_on(
        trace,
        &["--process", "overwriter"],
        &[
            "break scribble",
            "break report",
            "continue",
            // Every thread of the process at the write: each one's stack.
            "info threads",
            "thread apply all bt",
            "continue",
            // To the process's end, then back hit by hit: report, scribble
            // (report's breakpoint, under the current PC, is passed over),
            // then the start of history, twice.
            "continue",
            "reverse-continue",
            "info symbol $pc",
            "reverse-continue",
            "info symbol $pc",
            "reverse-continue",
            "reverse-continue",
            "info symbol $pc",
        ],
    );
    // `info threads` rows, then one stack per thread.
    let threads = all
        .lines()
        .filter(|l| {
            l.trim_start_matches('*')
                .trim_start()
                .starts_with(|c: char| c.is_ascii_digit())
        })
        .filter(|l| l.contains("Thread "))
        .count();
    assert!(threads >= 2, "{all}");
    // "Thread 2 (Thread 21.23 (running user code)):" heads each stack.
    let stacks: Vec<&str> = all
        .split("\nThread ")
        .skip(1)
        .filter(|s| s.lines().next().is_some_and(|head| head.ends_with("):")))
        .collect();
    assert_eq!(stacks.len(), threads, "a stack for each thread: {all}");
    for stack in &stacks {
        assert!(
            stack.lines().nth(1).is_some_and(|l| l.starts_with("#0")),
            "no frame: {stack}"
        );
    }
    assert!(
        stacks.iter().any(|s| s.contains(" scribble ("))
            && stacks.iter().any(|s| s.contains(" main (")),
        "{all}"
    );
    // Back from the end: report, then scribble, then the start.
    let symbols: Vec<&str> = all
        .lines()
        .filter(|l| l.contains(" in section .text"))
        .collect();
    assert_eq!(symbols.len(), 3, "{all}");
    assert!(symbols[0].starts_with("report "), "{all}");
    assert!(symbols[1].starts_with("scribble "), "{all}");
    assert!(symbols[2].starts_with("_start "), "{all}");
    // The end of the process once, the start of history twice.
    assert_eq!(
        all.matches("No more reverse-execution history").count(),
        3,
        "{all}"
    );
}

/// The states gdb printed with `printf "TAG %d %lx %lx %lx %lx\n"`, by
/// step, for `tag`.
fn states(output: &str, tag: &str) -> Vec<(u64, String)> {
    tagged_lines(output, tag)
        .filter_map(|l| {
            let (i, state) = l.split_once(' ')?;
            Some((i.parse().ok()?, state.to_owned()))
        })
        .collect()
}

/// A gdb script: `setup`, then the state (pc, rsp, rax, eflags) before
/// and after each of `steps` forward steps ("F i ..."), after each of as
/// many reverse steps ("B i ..."), and after each of the forward steps
/// again ("G i ..."), each tagged with the step count from the start.
fn back_and_forth(setup: &str, steps: usize) -> String {
    // (The tag is in the format: a string argument would be made in the
    // program's memory, which a replay does not let gdb write.)
    let print = |tag: &str| {
        format!("printf \"{tag} %d %lx %lx %lx %lx\\n\", $i, $pc, $rsp, $rax, $eflags\n")
    };
    format!(
        "{setup}\nset $i = 0\n{f}\
         while $i < {steps}\n  stepi\n  set $i = $i + 1\n  {f}end\n\
         while $i > 0\n  reverse-stepi\n  set $i = $i - 1\n  {b}end\n\
         while $i < {steps}\n  stepi\n  set $i = $i + 1\n  {g}end\n",
        f = print("F"),
        b = print("B"),
        g = print("G"),
    )
}

/// Runs `insight debug TRACE EXTRA -- -batch -nx -x SCRIPT` with a
/// `back_and_forth` script of `steps` (written in a scratch directory of
/// its own, `name`); checks that the states backwards and forwards again
/// are those forwards. Returns the forward states and everything printed.
fn steps_of(
    name: &str,
    trace: &std::path::Path,
    extra: &[&str],
    script: &str,
    steps: usize,
) -> (Vec<(u64, String)>, String) {
    let file = scratch(name).join("steps.gdb");
    std::fs::write(&file, script).unwrap();
    let output = gdb_on(trace, extra, &[&format!("source {}", file.display())]);
    let _ = std::fs::remove_dir_all(file.parent().unwrap());
    let forward = states(&output, "F");
    assert_eq!(forward.len(), steps + 1, "{output}");
    let mut back = states(&output, "B");
    back.reverse();
    assert_eq!(back[..], forward[..steps], "backwards:\n{output}");
    let again = states(&output, "G");
    assert_eq!(again[..], forward[1..], "forwards again:\n{output}");
    (forward, output)
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn a_thousand_steps_back_and_forth_through_system_calls_and_a_page_fault() {
    let (trace, _) = recording();
    // window(): mmap (its first call, through the dynamic linker's lazy
    // binding), getpid, the first touch of the new page, munmap.
    let steps = 1500;
    let script = back_and_forth("break window\ncontinue", steps);
    let (forward, output) = steps_of("debug-steps", trace, &[], &script, steps);
    // The window went through getpid(): RAX held the pid after a step.
    let pid = output
        .split("(process ")
        .nth(1)
        .and_then(|rest| rest.split(')').next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no pid: {output}"));
    assert!(
        forward
            .iter()
            .any(|(_, s)| s.split(' ').nth(2) == Some(&format!("{pid:x}"))),
        "no step saw getpid's result {pid}"
    );
}

/// The number after `"key":` in a line of `insight dump --json`.
fn json_number(line: &str, key: &str) -> Option<u64> {
    let rest = &line[line.find(&format!("\"{key}\":"))? + key.len() + 3..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// An asynchronous point of a recording, from `insight dump --json`.
struct RecordedPoint {
    /// The deterministic exit it follows.
    exit: u64,
    /// The address space it is in (its process).
    cr3: u64,
    rip: u64,
    rsp: u64,
    rax: u64,
    rcx: u64,
    r8: u64,
    rflags: u64,
    /// Where the trampoline that searches for it at replay is put.
    stub: u64,
    /// How long the guest ran since the exit before it, in nanoseconds.
    run_ns: u64,
}

fn recorded_points(trace: &std::path::Path) -> Vec<RecordedPoint> {
    let out = insight()
        .args(["dump", "--json"])
        .arg(trace)
        .output()
        .unwrap();
    let dump = expect_status(&out, 0);
    dump.lines()
        .filter(|l| l.contains("\"AsyncPoint\""))
        .map(|l| {
            let gprs: Vec<u64> = l
                .split("\"gprs\":[")
                .nth(1)
                .and_then(|g| g.split(']').next())
                .map(|g| g.split(',').filter_map(|v| v.parse().ok()).collect())
                .unwrap_or_default();
            let number = |key| json_number(l, key).unwrap_or_else(|| panic!("no {key}: {l}"));
            assert_eq!(gprs.len(), 16, "{l}");
            RecordedPoint {
                exit: number("exit"),
                cr3: number("cr3"),
                rip: number("rip"),
                rsp: gprs[4],
                rax: gprs[0],
                rcx: gprs[1],
                r8: gprs[8],
                rflags: number("rflags"),
                stub: number("stub"),
                run_ns: number("run_ns"),
            }
        })
        .collect()
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn steps_cross_an_asynchronous_preemption_point_and_come_back() {
    guest_ready();
    // Two threads that never leave user code: the tick preempts them
    // there, at asynchronous points.
    let (trace, out) = record("debug-preempted", &[], &["tick_count", "2", "100000000"]);
    expect_status(&out, 0);
    let points: Vec<RecordedPoint> = recorded_points(&trace)
        .into_iter()
        .filter(|p| p.rip < 0x7000_0000_0000)
        .collect();
    assert!(points.len() >= 4, "too few asynchronous points recorded");
    let point = &points[points.len() / 2];
    // Right after the point the session stops; the interrupted thread's
    // user registers are those of the point (it runs the tick's handler,
    // or the tick switched to the other thread), and gdb selects it by its
    // stack pointer. Each step crosses into what the thread ran after the
    // preemption; each reverse step back across it.
    let at = (point.exit + 1).to_string();
    let steps = 100;
    let select = format!(
        "info threads\nthread 1\nif $rsp != {:#x}\n  thread 2\nend",
        point.rsp
    );
    let script = back_and_forth(&select, steps);
    let (forward, output) = steps_of(
        "debug-preempted-steps",
        &trace,
        &["--process", "tick_count", "--at", &at],
        &script,
        steps,
    );
    let recorded = format!(
        "{:x} {:x} {:x} {:x}",
        point.rip, point.rsp, point.rax, point.rflags
    );
    assert_eq!(forward[0].1, recorded, "not at the point: {output}");
    // The trampoline searching for the next point is never where gdb
    // sees the thread: the program's own addresses only.
    for (i, state) in &forward {
        let pc = u64::from_str_radix(state.split(' ').next().unwrap(), 16).unwrap();
        assert!(
            !(point.stub..point.stub + 0x2000).contains(&pc),
            "step {i} stands in insight's trampoline at {pc:#x}: {output}"
        );
    }
    let _ = std::fs::remove_dir_all(trace);
}

/// What follows "TAG " in the lines of `output` that begin with it.
fn tagged_lines<'a>(output: &'a str, tag: &'a str) -> impl Iterator<Item = &'a str> {
    // gdb may leave a line it printed for a step unfinished ("0x...\t").
    output
        .lines()
        .filter_map(move |l| l.rsplit('\t').next()?.strip_prefix(tag)?.strip_prefix(' '))
}

/// The register values gdb printed on the line tagged `tag` ("TAG A B ...").
fn tagged(output: &str, tag: &str) -> Vec<u64> {
    tagged_lines(output, tag)
        .next()
        .map(|rest| {
            rest.split(' ')
                .filter_map(|v| u64::from_str_radix(v, 16).ok())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn a_step_from_where_an_asynchronous_point_was_recorded_finds_it() {
    guest_ready();
    // A timer interrupt comes due while the kernel maps a MiB of a file
    // for mmap: the recorder delivers it at an asynchronous point after
    // the call returns, in a loop of slow CPUID instructions (R8 counts
    // its rounds down from 1000) or at the return itself (RCX = RIP).
    let (trace, out) = record("debug-long-calls", &[], &["long_calls", "4"]);
    let stdout = expect_status(&out, 0);
    assert!(stdout.contains("long_calls: 4 rounds"), "{stdout}");
    let spins = 1000;
    let points = recorded_points(&trace);
    // The program's address space: where its loop was preempted (a
    // return to user mode of another process, such as the one that
    // started it, is no point of the program's).
    let in_loop = |p: &RecordedPoint| p.rip < 0x7000_0000_0000 && (1..=spins).contains(&p.r8);
    let program: Vec<u64> = points
        .iter()
        .filter(|p| in_loop(p))
        .map(|p| p.cr3)
        .collect();
    // The single steps from the call's return to each point taken after
    // a long call, at most: the loop is four instructions a round.
    let steps_to = |p: &RecordedPoint| match p.rip < 0x7000_0000_0000 {
        true if in_loop(p) => Some(100 + 4 * (spins - p.r8)),
        false if p.rcx == p.rip && program.contains(&p.cr3) => Some(0),
        _ => None,
    };
    let (point, limit) = points
        .into_iter()
        .filter(|p| p.run_ns > 50_000_000)
        .filter_map(|p| Some((steps_to(&p)?, p)))
        .min_by_key(|(steps, _)| *steps)
        .map(|(steps, p)| (p, steps + 100))
        .expect("no asynchronous point after a long system call was recorded");
    // From the exit before the point (the thread in the kernel, in the
    // call), steps to the point's position; the next step runs the
    // trampoline under the trap flag, which must find the point there.
    let print = |tag: &str| format!("printf \"{tag} %lx %lx %lx %lx\\n\", $pc, $rsp, $r8, $rax\n");
    let script = format!(
        "set $i = 0\n\
         while !($pc == {rip:#x} && $rsp == {rsp:#x} && $r8 == {r8:#x}) && $i < {limit}\n  \
         stepi\n  set $i = $i + 1\nend\n{at}\
         stepi\n{f1}stepi\n{f2}reverse-stepi\n{b1}reverse-stepi\n{b0}stepi\n{g1}stepi\n{g2}\
         continue\n",
        rip = point.rip,
        rsp = point.rsp,
        r8 = point.r8,
        at = print("AT"),
        f1 = print("F1"),
        f2 = print("F2"),
        b1 = print("B1"),
        b0 = print("B0"),
        g1 = print("G1"),
        g2 = print("G2"),
    );
    let file = scratch("debug-long-calls-steps").join("steps.gdb");
    std::fs::write(&file, script).unwrap();
    let at = point.exit.to_string();
    let output = gdb_on(
        &trace,
        &["--process", "long_calls", "--at", &at],
        &[&format!("source {}", file.display())],
    );
    let _ = std::fs::remove_dir_all(file.parent().unwrap());
    let there = tagged(&output, "AT");
    assert_eq!(
        there[..3],
        [point.rip, point.rsp, point.r8],
        "the steps did not reach the point: {output}"
    );
    let f1 = tagged(&output, "F1");
    assert_ne!(
        f1[0], point.rip,
        "the step did not run the instruction: {output}"
    );
    assert_eq!(f1[1], point.rsp, "{output}");
    assert_eq!(tagged(&output, "B1"), f1, "backwards: {output}");
    assert_eq!(tagged(&output, "B0"), there, "backwards: {output}");
    assert_eq!(tagged(&output, "G1"), f1, "forwards again: {output}");
    assert_eq!(
        tagged(&output, "G2"),
        tagged(&output, "F2"),
        "forwards again: {output}"
    );
    // The replay went on past the point to the program's end.
    assert!(output.contains("the process exited (status 0)"), "{output}");
    let _ = std::fs::remove_dir_all(trace.parent().unwrap());
}

#[test]
#[ignore = "needs /dev/kvm, the guest image and gdb (tools/test runs it)"]
fn a_session_opens_where_the_program_failed_and_steps_back_from_it() {
    guest_ready();
    let dir = scratch("debug-at-end");
    compile_test_program(&dir, "aborts", &["-g", "-O0"]);
    // Recorded by its path, as users do; it dies of SIGABRT.
    let trace = dir.join("trace");
    let mut record = insight();
    record
        .current_dir(&dir)
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .args(["--", "./aborts"]);
    let out = output_within(record, SESSION_LIMIT);
    assert!(
        // Its standard error, as insight's.
        text(&out).1.contains("aborts: bad value 41"),
        "{:?}",
        text(&out)
    );
    let out = gdb_on(
        &trace,
        &["--at", "end"],
        &["bt", "echo @@BACK\\n", "reverse-finish", "bt"],
    );
    let (before, after) = out
        .split_once("@@BACK")
        .unwrap_or_else(|| panic!("no reverse-finish:\n{out}"));
    // At the end: the signal abort raised, its callers whole.
    assert!(before.contains("abort ()"), "{out}");
    assert!(before.contains("check (v=41) at"), "{out}");
    // Back to where the frame it stood in was called: its caller is the
    // innermost frame now.
    let functions = |bt: &str| -> Vec<String> {
        bt.lines()
            .filter(|l| l.starts_with('#'))
            .filter_map(|l| {
                let call = l.split_once(" in ").map_or(l, |(_, f)| f);
                let call = call.trim_start_matches(|c: char| c == '#' || c.is_ascii_digit());
                Some(call.trim().split(' ').next()?.to_owned())
            })
            .collect()
    };
    let (was, now) = (functions(before), functions(after));
    assert!(
        was.len() > 2 && now.first() == was.get(1),
        "{was:?} then {now:?}:\n{out}"
    );
    assert!(after.contains("check (v=41) at"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs /dev/kvm, the guest image, gdb and pigz (tools/test runs it)"]
fn reverse_steps_in_a_stock_threaded_program_stay_on_their_thread() {
    guest_ready();
    let pigz = std::path::Path::new("/usr/bin/pigz");
    assert!(
        pigz.exists(),
        "/usr/bin/pigz is missing: tools/test installs it"
    );
    let dir = scratch("debug-pigz");
    let data: String = (0..30_000)
        .map(|i| format!("line {i} {}\n", i * 7919 % 104_729))
        .collect();
    let input = dir.join("data.txt");
    std::fs::write(&input, data).unwrap();
    let input = input.to_str().unwrap();
    let trace = dir.join("trace");
    let mut record = insight();
    record
        .args(["record", "--no-stdin", "-o"])
        .arg(&trace)
        .args([
            "--file",
            input,
            "--",
            "/usr/bin/pigz",
            "-p",
            "4",
            "-k",
            "-f",
            input,
        ]);
    expect_status(&output_within(record, SESSION_LIMIT), 0);
    // A compressing thread stopped in deflate, three steps on, twenty
    // back (past the breakpoint, into pigz's call of it) and twenty on
    // again: QEMU's reverse-debugging test, on a stock program's thread.
    let out = gdb_on(
        &trace,
        &[],
        &[
            "break deflate",
            "continue",
            "python t0 = gdb.selected_thread().num; fwd = [int(gdb.parse_and_eval('$pc'))]",
            "python exec(\"for i in range(3):\\n    gdb.execute('stepi', to_string=True)\\n    \
             fwd.append(int(gdb.parse_and_eval('$pc')))\")",
            "python back = []",
            "python exec(\"for i in range(20):\\n    gdb.execute('reverse-stepi', to_string=True)\\n    \
             back.append((gdb.selected_thread().num, int(gdb.parse_and_eval('$pc'))))\")",
            "python again = [int(gdb.parse_and_eval('$pc'))]",
            "python exec(\"for i in range(20):\\n    gdb.execute('stepi', to_string=True)\\n    \
             again.append(int(gdb.parse_and_eval('$pc')))\")",
            "python print('same thread: %s' % all(t == t0 for t, _ in back))",
            "python print('back over the steps: %s' % ([pc for _, pc in back[:3]] == fwd[-2::-1]))",
            "python print('forward again: %s' % (again == [pc for _, pc in back][::-1] + [fwd[-1]]))",
        ],
    );
    for check in ["same thread", "back over the steps", "forward again"] {
        assert!(out.contains(&format!("{check}: True")), "{check}:\n{out}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
