//! Helpers shared by the end-to-end tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn insight() -> Command {
    Command::new(env!("CARGO_BIN_EXE_insight"))
}

/// Whether guest tests can run here; panics if KVM exists but the image
/// does not (the test command builds it).
pub fn guest_ready() -> bool {
    if !Path::new("/dev/kvm").exists() {
        eprintln!("SKIPPED: /dev/kvm does not exist on this machine");
        return false;
    }
    let kernel = vmm::image::default_kernel();
    assert!(
        kernel.exists(),
        "no guest image at {}: run tools/build-guest first",
        kernel.display()
    );
    true
}

pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("insight-e2e-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts the exit status of a finished `insight`; returns its stdout.
pub fn expect_status(out: &Output, status: i32) -> String {
    let (stdout, stderr) = text(out);
    assert_eq!(
        out.status.code(),
        Some(status),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

/// Runs `insight` with `args`; asserts its exit status; returns stdout.
pub fn run_expecting<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
    status: i32,
) -> String {
    expect_status(&insight().args(args).output().unwrap(), status)
}

pub fn host_has_avx() -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.split_whitespace().any(|w| w == "avx"))
        .unwrap_or(false)
}

/// Every event of the database at `db`, in order.
pub fn rows(db: &Path) -> Vec<events::db::Row> {
    let db = events::db::EventDb::open(db).unwrap();
    let mut rows = Vec::new();
    db.for_each(&[], |r| {
        rows.push(r);
        Ok(())
    })
    .unwrap();
    rows
}
