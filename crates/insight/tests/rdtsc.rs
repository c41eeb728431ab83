//! The guest kernel's emulation of user-mode RDTSC and RDTSCP
//! (`insight.rdtsc=emulate`, on insight's kernel command line).
//!
//! The emulation works only where the CPU honours CR4.TSD in user mode,
//! which the KVM of the development hosts does not (`insight host-check`).
//! QEMU's TCG does, so these tests boot insight's own kernel, command line
//! and initramfs under QEMU, with the clock set to jiffies because TCG
//! answers insight's clock MSR with 0. They need the guest image and QEMU,
//! so they are `#[ignore]`d: `tools/test` builds the one, installs the
//! other and runs them (`--include-ignored`).

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guest::config::{FileSpec, VmConfig};
use guest::image::GuestQuirks;
use guest::BootOptions;

const QEMU: &str = "qemu-system-x86_64";
/// TCG boots this guest in a few seconds; busy CI hosts get much more.
const TIMEOUT: Duration = Duration::from_secs(300);

/// The lines tests/programs/rdtsc_check.c prints, in order.
const CHECKS: [&str; 6] = [
    "rdtsc: ",
    "rdtscp: ",
    "rdtsc with PR_TSC_SIGSEGV: ",
    "rdtsc with PR_TSC_ENABLE: ",
    "rdtsc in a PR_TSC_SIGSEGV child: ",
    "rdtsc after the child: ",
];

/// Boots rdtsc_check under QEMU/TCG with insight's guest and `extra`
/// appended to the kernel command line; returns what each check printed.
fn run_under_tcg(name: &str, extra: &str) -> Vec<String> {
    let bzimage = common::guest_kernel().with_file_name("bzImage");
    assert!(
        Command::new(QEMU)
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success()),
        "{QEMU} is needed: apt-get install qemu-system-x86 (tools/test installs it)"
    );
    let dir = common::scratch(name);
    let prog =
        common::compile_test_program(&dir, "rdtsc_check", &["-O2", "-Wall", "-Wextra", "-Werror"]);
    let config = VmConfig {
        command: vec!["rdtsc_check".to_owned()],
        files: vec![FileSpec {
            host: prog,
            guest: "/usr/local/bin/rdtsc_check".into(),
        }],
        cmdline: format!("clocksource=jiffies {extra}"),
        ..VmConfig::builtin()
    };
    let options = BootOptions {
        quirks: GuestQuirks {
            syscall_trap: false,
        },
        quiet: true,
        cold_boot: true,
        streams: Default::default(),
    };
    let spec = guest::prepare(&config, &options).unwrap();
    assert!(
        spec.cmdline.contains("insight.rdtsc=emulate"),
        "insight no longer asks the guest kernel to emulate RDTSC: {}",
        spec.cmdline
    );
    let initrd = dir.join("initrd");
    let archive = guest::delivered_archive(&spec.archive, &spec.rng_seed, None).unwrap();
    std::fs::write(&initrd, guest::with_archive(&spec.initramfs, &archive)).unwrap();

    let mut qemu = Command::new(QEMU)
        .args(["-accel", "tcg", "-cpu", "max", "-m"])
        .arg(spec.memory_mib.to_string())
        .args(["-display", "none", "-serial", "stdio", "-monitor", "none"])
        .args(["-net", "none", "-no-reboot", "-kernel"])
        .arg(&bzimage)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(&spec.cmdline)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Both pipes are drained as QEMU writes, so that neither can fill.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            pipe.read_to_end(&mut out).map(|_| out)
        })
    };
    let reader = drain(Box::new(qemu.stdout.take().unwrap()));
    let err_reader = drain(Box::new(qemu.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = qemu.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > TIMEOUT {
            let _ = qemu.kill();
            let _ = qemu.wait();
            let out = reader.join().unwrap().unwrap_or_default();
            panic!(
                "QEMU did not finish in {TIMEOUT:?}; console:\n{}",
                String::from_utf8_lossy(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = String::from_utf8_lossy(&reader.join().unwrap().unwrap()).into_owned();
    let err = String::from_utf8_lossy(&err_reader.join().unwrap().unwrap()).into_owned();
    let _ = std::fs::remove_dir_all(&dir);
    CHECKS
        .iter()
        .map(|check| {
            out.lines()
                .find_map(|l| l.trim_end().strip_prefix(check))
                .unwrap_or_else(|| {
                    panic!("no '{check}' line (QEMU {status}); console:\n{out}\nstderr:\n{err}")
                })
                .to_owned()
        })
        .collect()
}

#[ignore = "needs the guest image and QEMU (tools/test runs it)"]
#[test]
fn user_rdtsc_is_answered_by_the_guest_clock_where_tsd_traps() {
    let got = run_under_tcg("rdtsc-emulate", "");
    assert_eq!(
        got,
        [
            "emulated",
            "emulated aux=0",
            "SIGSEGV",
            "emulated",
            "SIGSEGV",
            "emulated"
        ],
        "what each read of the TSC gave, in the order of {CHECKS:?}"
    );
}

/// The control: the same boot without the emulation reads the CPU's TSC,
/// so the test above can tell the two apart.
#[ignore = "needs the guest image and QEMU (tools/test runs it)"]
#[test]
fn without_emulation_user_rdtsc_reads_the_cpu() {
    let got = run_under_tcg("rdtsc-native", "insight.rdtsc=native");
    assert_eq!(got[0], "native");
    assert!(got[1].starts_with("native aux="), "{got:?}");
    assert_eq!(got[2..], ["SIGSEGV", "native", "SIGSEGV", "native"]);
}
