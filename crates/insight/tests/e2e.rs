//! End-to-end tests: boot the real guest image with the `insight` binary.
//!
//! They need /dev/kvm and the guest image that `tools/build-guest` builds,
//! so they are `#[ignore]`d: `tools/test` builds the image and runs them
//! (`--include-ignored`). Asked to run without /dev/kvm or the image, they
//! fail saying which is missing.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn exit_status_and_output_pass_through() {
    guest_ready();
    let stdout = run_expecting(
        ["run", "--", "sh", "-c", "echo insight-ok; uname -r; exit 3"],
        3,
    );
    assert!(stdout.contains("insight-ok\n"), "{stdout}");
    assert!(
        stdout.contains("6.1.") && stdout.contains("-insight\n"),
        "{stdout}"
    );
}

/// The number before `word` on the line of host-check's output that
/// starts with `label`.
fn host_check_figure(stdout: &str, label: &str, word: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` line in\n{stdout}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == word)
        .unwrap_or_else(|| panic!("no `{word}` in {line}"));
    words[at - 1]
        .trim_end_matches('x')
        .parse()
        .unwrap_or_else(|_| panic!("{} in {line}", words[at - 1]))
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn host_check_measures_guest_user_code_and_the_tick() {
    guest_ready();
    let stdout = run_expecting(["host-check"], 0);
    assert!(stdout.contains("insight can run on this host."), "{stdout}");
    // Speeds are the host's (not judged here); the interrupt rates are the
    // guest kernel's: a busy task without its tick takes far fewer than
    // the periodic tick's 100 a second.
    let speed = stdout
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("speed against native:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|w| w.trim_end_matches('x').parse::<f64>().ok());
    assert!(speed.is_some_and(|s| s > 0.0), "{stdout}");
    let tickless = host_check_figure(&stdout, "guest timer, one busy task:", "interrupts");
    let periodic = host_check_figure(&stdout, "with the periodic tick:", "interrupts");
    assert!(
        tickless < 50.0 && periodic > 80.0,
        "timer interrupts a second: {tickless} without the tick, {periodic} with it\n{stdout}"
    );
    assert!(stdout.contains("one tick costs the program:"), "{stdout}");
    let skipped = run_expecting(["host-check", "--no-guest"], 0);
    assert!(
        skipped.contains("guest user code: not measured (--no-guest)")
            && !skipped.contains("speed against native"),
        "{skipped}"
    );
    // The PVM line says what the probes find, asked here directly.
    let pvm = skipped
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("PVM guest ABI:"))
        .unwrap_or_else(|| panic!("no PVM line in\n{skipped}"));
    let abi = vmm::host_check::check_pvm_guest_abi().unwrap();
    assert_eq!(
        pvm.trim_start().starts_with("offered"),
        abi.present(),
        "{pvm} against {abi:?}"
    );
    assert!(
        pvm.contains(&format!(
            "KVM's PVM signature: {}",
            if abi.kvm_signature { "yes" } else { "no" }
        )),
        "{pvm} against {abi:?}"
    );
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn config_file_runs_a_users_threaded_program() {
    guest_ready();
    let dir = scratch("config");
    compile_test_program(&dir, "pthread_hello", &["-O2", "-pthread"]);
    let cfg = dir.join("vm.toml");
    std::fs::write(
        &cfg,
        r#"
memory_mib = 192
command = "echo insight-ok; uname -r; pthread_hello 8; echo VAR=$GREETING; exit 3"
env = { GREETING = "hello from the config" }
[[files]]
host = "pthread_hello"
guest = "/usr/local/bin/pthread_hello"
"#,
    )
    .unwrap();
    let stdout = run_expecting([Path::new("run"), &cfg], 3);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(stdout.contains("insight-ok\n"), "{stdout}");
    assert!(
        stdout.contains("pthread_hello: 8 threads, sum 36\n"),
        "{stdout}"
    );
    assert!(stdout.contains("VAR=hello from the config\n"), "{stdout}");
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn concurrent_processes_and_threads_are_correct() {
    guest_ready();
    // The same pipelines several times in one boot: they crashed
    // intermittently while the guest kernel saved only FXSAVE state and
    // user code (glibc's memcpy) used AVX registers natively.
    let script = "for i in 1 2 3 4 5; do \
                      seq 100000 | sort -n | tail -1; \
                      seq 1 300000 > /tmp/big; cat /tmp/big | md5sum; \
                      cat /proc/version | head -1 >/dev/null || echo head-failed; \
                  done; \
                  thread_check 16 2000; vector_check 4 2 30";
    let stdout = run_expecting(["run", "--", "sh", "-c", script], 0);

    let host_seq = Command::new("sh")
        .args(["-c", "seq 1 300000 | md5sum"])
        .output()
        .unwrap();
    let want_md5 = String::from_utf8_lossy(&host_seq.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.iter().filter(|l| **l == "100000").count(),
        5,
        "{stdout}"
    );
    assert_eq!(
        lines.iter().filter(|l| l.starts_with(&want_md5)).count(),
        5,
        "md5 of seq 1 300000 should be {want_md5}:\n{stdout}"
    );
    assert!(!stdout.contains("head-failed"), "{stdout}");
    assert!(stdout.contains("thread_check: ok threads=16"), "{stdout}");
    assert!(stdout.contains("vector_check: ok"), "{stdout}");
    if host_has_avx() {
        // AVX state in use across context switches, and preserved.
        assert!(stdout.contains("avx=used"), "{stdout}");
    }
}

/// Copies to and from user memory that the guest kernel hands to insight
/// (guest kernel patch 0013) move the bytes the kernel's own copy would,
/// in every case images/workloads/user_copies.c makes: pages never
/// touched, a read-only and an unreadable page (short counts), a page
/// shared copy-on-write with a child that reads into it, private and
/// shared file mappings, vectors across pages and a pipe; and the pages
/// the kernel clears and copies itself (patch 0015): memory mapped again
/// reads as zeros, a copy-on-write fault copies the whole page. insight made
/// most of the copies and left some to the kernel (the pages it could not
/// reach), and the recording replays. (With the destination's write
/// permission ignored, the copy-on-write and private-mapping cases fail.)
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn copies_to_and_from_user_memory_move_what_the_kernels_would() {
    guest_ready();
    let out = insight()
        .args(["run", "--no-stdin", "--timings", "--", "user_copies"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(
        stdout.lines().filter(|l| l.ends_with(" ok")).count(),
        12,
        "{stdout}"
    );
    // "...; N copies by the VMM for the guest kernel (X MiB; M left partly
    // to it)"
    let counts = stderr
        .split_once("ports; ")
        .map(|(_, rest)| rest.split_whitespace().collect::<Vec<_>>())
        .unwrap_or_default();
    let count = |at: usize| -> u64 {
        counts
            .get(at)
            .and_then(|n| n.trim_start_matches('(').parse().ok())
            .unwrap_or_else(|| panic!("no copy counts: {stderr}"))
    };
    let (copies, short) = (count(0), count(11));
    assert!(copies >= 100 && short >= 5 && short < copies, "{stderr}");
    record_and_replay("user-copies", &[], &["user_copies"], 0, |_, _| {});
}

/// A minimal ELF64 executable whose one segment, loaded at 16 MiB, holds
/// `code` at its entry point.
fn tiny_elf(code: &[u8]) -> Vec<u8> {
    let entry: u64 = 0x100_0000;
    let mut e = Vec::new();
    e.extend(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    e.extend(2u16.to_le_bytes()); // ET_EXEC
    e.extend(62u16.to_le_bytes()); // x86-64
    e.extend(1u32.to_le_bytes());
    e.extend(entry.to_le_bytes());
    e.extend(64u64.to_le_bytes()); // phoff
    e.extend(0u64.to_le_bytes()); // shoff
    e.extend(0u32.to_le_bytes());
    e.extend(64u16.to_le_bytes()); // ehsize
    e.extend(56u16.to_le_bytes()); // phentsize
    e.extend(1u16.to_le_bytes()); // phnum
    e.extend([0u8; 6]);
    let off = 64 + 56;
    e.extend(1u32.to_le_bytes()); // PT_LOAD
    e.extend(5u32.to_le_bytes()); // R+X
    e.extend((off as u64).to_le_bytes());
    e.extend(entry.to_le_bytes());
    e.extend(entry.to_le_bytes());
    e.extend((code.len() as u64).to_le_bytes());
    e.extend((code.len() as u64).to_le_bytes());
    e.extend(0x1000u64.to_le_bytes());
    e.extend(code);
    e
}

fn run_with_kernel(name: &str, kernel: Option<&[u8]>, config_extra: &str) -> Output {
    let dir = scratch(name);
    let kernel_path = dir.join("vmlinux");
    if let Some(k) = kernel {
        std::fs::write(&kernel_path, k).unwrap();
    }
    std::fs::write(dir.join("initrd.cpio"), b"").unwrap();
    let cfg = dir.join("vm.toml");
    std::fs::write(
        &cfg,
        format!("kernel = \"vmlinux\"\ninitramfs = \"initrd.cpio\"\n{config_extra}"),
    )
    .unwrap();
    // These kernels never reach an /init to take a boot snapshot at.
    let out = insight()
        .args(["run", "--cold-boot"])
        .arg(&cfg)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    out
}

fn assert_one_line_error(out: &Output, needles: &[&str]) {
    let (_, stderr) = text(out);
    assert_eq!(out.status.code(), Some(125), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line expected: {stderr}");
    assert!(stderr.starts_with("insight: error: "), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{n:?} missing from: {stderr}");
    }
}

#[test]
fn bad_inputs_give_one_line_errors() {
    // No KVM needed: these fail before a VM exists.
    let out = run_with_kernel("nokernel", None, "");
    assert_one_line_error(&out, &["vmlinux", "no guest kernel"]);

    let out = run_with_kernel("badcfg", Some(b""), "memory_mib = \"lots\"\n");
    assert_one_line_error(&out, &["vm.toml", "memory_mib"]);

    let out = insight()
        .args(["run", "/nonexistent/vm.toml"])
        .output()
        .unwrap();
    assert_one_line_error(&out, &["/nonexistent/vm.toml"]);

    let out = run_with_kernel("notelf", Some(b"MZ this is not an ELF kernel"), "");
    assert_one_line_error(&out, &["ELF"]);
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn guest_faults_give_one_line_errors_with_rip() {
    kvm_ready();
    // ud2 with no IDT: #UD, #DF, triple fault.
    let out = run_with_kernel("triple", Some(&tiny_elf(&[0x0f, 0x0b])), "");
    assert_one_line_error(&out, &["triple fault", "RIP 0x1000000"]);

    // xsave [rax] in ring 0: not emulated on interpreting hosts (an
    // emulation failure), #UD without CR4.OSXSAVE elsewhere (a triple
    // fault); either way the VM stops with RIP.
    let out = run_with_kernel("emul", Some(&tiny_elf(&[0x0f, 0xae, 0x20, 0x0f, 0x0b])), "");
    assert_one_line_error(&out, &["RIP 0x100000"]);
}

/// Input piped to insight is the command's standard input: here a
/// script the shell reads.
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn piped_standard_input_reaches_the_command() {
    guest_ready();
    let mut cmd = insight();
    cmd.args(["run", "--", "sh"]);
    let out = output_with_input(cmd, b"echo piped-$((6*7))\nexit 5\n");
    let stdout = expect_status(&out, 5);
    assert!(stdout.contains("piped-42\n"), "{stdout}");
}

/// Signal frames on pages never touched (images/workloads/signal_frames.c):
/// the kernel's XSAVE into a frame that crosses into a page not mapped yet,
/// which insight completes, raises the page fault the instruction would
/// have (with CR2 set through KVM_SET_SREGS), the kernel maps the page and
/// saves again; the program's registers survive each signal, and the
/// recording replays exactly (an interrupt bit left in the registers set
/// there would raise an interrupt the recording never logged).
#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn signal_frames_on_fresh_pages_record_and_replay() {
    guest_ready();
    let stdout = record_and_replay("signal-frames", &[], &["signal_frames", "40"], 0, |_, _| {});
    assert!(stdout.contains("signal_frames: 40 rounds ok"), "{stdout}");
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn vector_check_detects_state_an_fxsave_only_kernel_loses() {
    guest_ready();
    // Only meaningful where guest user code runs with the host's XCR0
    // whatever the guest sets: there, a guest kernel booted with `noxsave`
    // saves only FXSAVE state while user code uses AVX. This shows that the
    // check in concurrent_processes_and_threads_are_correct can fail.
    let user_xcr0 = vmm::host_check::check_user_xcr0().unwrap();
    if user_xcr0 & 0x4 == 0 {
        eprintln!(
            "not run: guest user code cannot use AVX state on this host ({user_xcr0:#x}), \
             so there is no state an FXSAVE-only kernel could lose"
        );
        return;
    }
    let out = insight()
        .args(["run", "--no-stdin", "--cmdline", "noxsave", "--"])
        .args(["vector_check", "4", "2", "30"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    // Some hosts (or host kernels) report CPUID.OSXSAVE to guest user code
    // as the guest kernel set it: under `noxsave` user code then finds no
    // AVX state (vector_check prints xcr0=0, and glibc keeps to SSE), and
    // FXSAVE saves all it uses.
    if out.status.code() == Some(0) && stdout.contains(" xcr0=0 avx=off") {
        eprintln!(
            "not run: under noxsave guest user code sees no XSAVE state on this host \
             ({}), so an FXSAVE-only kernel loses nothing",
            stdout.trim()
        );
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    // Its standard error, as insight's.
    assert!(stderr.contains("vector_check: FAILED"), "{stderr}");
}

/// The requests column of the `report locks` row whose name ends with
/// `name`.
fn lock_requests(report: &str, name: &str) -> u64 {
    report
        .lines()
        .find_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            (words.len() > 2 && words[1].ends_with(name)).then(|| words[2].parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no lock {name} in the report:\n{report}"))
}

/// Records and replays `command` run from `dir` with probes (`extra`:
/// more `record` arguments); returns what the recording printed on both
/// streams and the replay's lock report.
fn record_from(dir: &Path, extra: &[&str], command: &[&str]) -> (String, String, String) {
    let trace = dir.join("trace");
    let mut cmd = insight();
    cmd.current_dir(dir)
        .args(["record", "--no-stdin", "--probes", "-o"])
        .arg(&trace)
        .args(extra)
        .arg("--")
        .args(command);
    let out = output_within(cmd, std::time::Duration::from_secs(600));
    let stdout = expect_status(&out, 0);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let replayed = replay_with(&trace, &["--diagnose", "locks"]);
    let report = expect_status(&replayed, 0);
    (stdout, stderr, report)
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_host_program_named_by_its_path_is_recorded_with_what_it_needs() {
    guest_ready();
    let dir = scratch("host-program");
    compile_test_program(&dir, "pthread_hello", &["-O2", "-g", "-pthread"]);

    // A C program by its relative path: brought alone (the image has glibc).
    let (stdout, stderr, report) = record_from(&dir, &[], &["./pthread_hello", "6"]);
    assert!(
        stdout.contains("pthread_hello: 6 threads, sum 21\n"),
        "{stdout}"
    );
    let program = dir.join("pthread_hello");
    assert!(
        stderr.contains(&format!(
            "brought from the host: {} (the program)\n",
            program.display()
        )),
        "{stderr}"
    );
    assert_eq!(lock_requests(&report, "lock"), 6, "{report}");
    std::fs::remove_dir_all(dir.join("trace")).unwrap();

    // C++ with a library of its own and a data file given relatively.
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/programs");
    std::fs::create_dir_all(dir.join("lib")).unwrap();
    let gxx = |args: &[&str]| {
        let ok = Command::new("g++")
            .current_dir(&dir)
            .args(args)
            .status()
            .expect("g++ is needed to build the C++ test program")
            .success();
        assert!(ok, "g++ {args:?} failed");
    };
    let source = |name: &str| sources.join(name).to_str().unwrap().to_owned();
    gxx(&[
        "-O2",
        "-g",
        "-fPIC",
        "-shared",
        "-o",
        "lib/libshared.so",
        &source("cxx_shared.cpp"),
    ]);
    gxx(&[
        "-O2",
        "-g",
        "-pthread",
        "-o",
        "cxx_counter",
        &source("cxx_counter.cpp"),
        "-Llib",
        "-lshared",
        "-Wl,-rpath,$ORIGIN/lib",
    ]);
    std::fs::write(dir.join("count.txt"), "2500\n").unwrap();
    let (stdout, stderr, report) = record_from(
        &dir,
        &["--file", "count.txt"],
        &["./cxx_counter", "count.txt"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(stdout.contains("cxx_counter: total 5000\n"), "{stdout}");
    let library = dir.join("lib/libshared.so");
    assert!(
        stderr.contains(&format!("{} (not in the guest image)", library.display())),
        "{stderr}"
    );
    assert!(
        stderr.contains("libstdc++.so.6 (not in the guest image)"),
        "{stderr}"
    );
    assert_eq!(lock_requests(&report, "shared"), 5000, "{report}");
}

#[ignore = "needs /dev/kvm and the guest image (tools/test runs it)"]
#[test]
fn a_missing_host_program_is_named_before_the_guest_boots() {
    guest_ready();
    let dir = scratch("host-program-missing");
    std::fs::write(dir.join("notes.txt"), "not a program\n").unwrap();
    for (word, needle) in [
        ("./no-such-prog", "no-such-prog: no such file on the host"),
        ("./notes.txt", "notes.txt is not an executable file"),
    ] {
        let out = output_within(
            {
                let mut cmd = insight();
                cmd.current_dir(&dir)
                    .args(["run", "--no-stdin", "--", word]);
                cmd
            },
            std::time::Duration::from_secs(60),
        );
        assert_one_line_error(&out, &[needle]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
