//! The guest part of `insight host-check`: how fast guest user code runs
//! on this host against the same code natively, and what the guest
//! kernel's timer costs it.
//!
//! The built-in image's `tick_count` workload (a register-only hash loop
//! that counts the timer interrupts and the user time it was given) runs
//! natively — the very binary, taken out of the image — and under
//! `insight run`, as one busy task: once on the default kernel, which stops
//! its tick while one task runs in user mode, and once booted with
//! `nohz=off`, which ticks 100 times a second. The periodic run's extra
//! time, per extra interrupt, is the price of a tick.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

/// Runs of each kind; the best counts (the host is shared and noisy).
pub(super) const RUNS: usize = 3;
/// How long the loop should take natively: long enough for the guest's
/// timer to show, short enough for a quick check.
const TARGET_NS: u64 = 1_000_000_000;
/// Rounds of the calibrating native run.
const CALIBRATION_ROUNDS: u64 = 20_000_000;

/// What one `tick_count` run printed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TickCount {
    /// The loop's time (CLOCK_MONOTONIC; in the guest, insight's clock).
    pub ns: u64,
    /// Timer interrupts over the loop (none natively: the host's are not
    /// counted).
    pub timer: Option<u64>,
    /// User time the process was charged, in clock ticks (HZ=100 in the
    /// guest).
    pub user_ticks: i64,
}

/// Parses tick_count's line: `tick_count: threads T ns NS timer IRQS user
/// U system S (result R)`.
pub fn parse(stdout: &str) -> Option<TickCount> {
    let line = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("tick_count: "))?;
    let field = |name: &str| -> Option<&str> {
        let mut words = line.split_whitespace();
        words.find(|w| *w == name)?;
        words.next()
    };
    Some(TickCount {
        ns: field("ns")?.parse().ok()?,
        timer: field("timer")?.parse::<i64>().ok()?.try_into().ok(),
        user_ticks: field("user")?.parse().ok()?,
    })
}

/// The measurement: the same work natively and as one busy guest task,
/// with and without the periodic tick.
#[derive(Clone, Copy, Debug)]
pub struct GuestSpeed {
    pub rounds: u64,
    pub native: TickCount,
    pub guest: TickCount,
    /// The guest booted with `nohz=off`.
    pub periodic: TickCount,
}

impl GuestSpeed {
    /// Native time over the time of `run` (1.0: native speed).
    pub fn speed(&self, run: &TickCount) -> f64 {
        self.native.ns as f64 / run.ns.max(1) as f64
    }

    /// Timer interrupts per second of a run.
    pub fn rate(run: &TickCount) -> Option<f64> {
        run.timer.map(|t| t as f64 * 1e9 / run.ns.max(1) as f64)
    }

    /// What one timer interrupt costs the program, in seconds: the
    /// periodic run's extra time, per extra interrupt. None when the runs
    /// do not allow it (no more interrupts, or no longer: host noise).
    pub fn tick_cost(&self) -> Option<f64> {
        let (few, many) = (self.guest.timer?, self.periodic.timer?);
        let extra = many.checked_sub(few).filter(|n| *n > 0)?;
        let time = self.periodic.ns.checked_sub(self.guest.ns)?;
        Some(time as f64 / 1e9 / extra as f64)
    }
}

/// The best (shortest) of some runs.
fn best(runs: &[TickCount]) -> TickCount {
    *runs.iter().min_by_key(|r| r.ns).expect("at least one run")
}

/// A directory of ours under the system's temporary directory, removed
/// when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("insight-host-check-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes the image's tick_count where the host can run it.
fn native_binary(initramfs: &Path, scratch: &Scratch) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;

    let image = std::fs::read(initramfs)
        .with_context(|| format!("cannot read the guest image {}", initramfs.display()))?;
    let mut files = guestfiles::ArchiveFiles::default();
    files.add(&image);
    let Some(binary) = files.file(Path::new("/usr/bin/tick_count")) else {
        bail!(
            "{} has no /usr/bin/tick_count: rebuild it with tools/build-guest",
            initramfs.display()
        );
    };
    let path = scratch.0.join("tick_count");
    std::fs::write(&path, binary).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("cannot make {} executable", path.display()))?;
    Ok(path)
}

/// Runs `command` to its end and parses its tick_count line.
fn tick_count(mut command: Command, what: &str) -> Result<TickCount> {
    let out = command
        .output()
        .with_context(|| format!("cannot start {what}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!("{what} failed ({}): {}", out.status, tail.join("\n"));
    }
    parse(&stdout).with_context(|| format!("{what} printed no tick_count line: {stdout}"))
}

fn native(binary: &Path, threads: u32, rounds: u64) -> Result<TickCount> {
    let mut command = Command::new(binary);
    command.arg(threads.to_string()).arg(rounds.to_string());
    tick_count(command, "tick_count natively")
}

fn in_guest(insight: &Path, options: &[&str], rounds: u64) -> Result<TickCount> {
    let mut command = Command::new(insight);
    command
        .args(["run", "--no-stdin"])
        .args(options)
        .args(["--", "tick_count", "1"])
        .arg(rounds.to_string())
        .stdin(std::process::Stdio::null());
    let what = format!(
        "`insight run {}-- tick_count`",
        options.iter().map(|o| format!("{o} ")).collect::<String>()
    );
    tick_count(command, &what)
}

/// Measures, saying what it does on `progress` (standard error: the first
/// run of an image boots it, which takes half a minute here).
pub fn measure(progress: impl Fn(&str)) -> Result<GuestSpeed> {
    let initramfs = guest::image::default_initramfs();
    guest::image::require(&initramfs, "guest initramfs").map_err(anyhow::Error::msg)?;
    let insight = std::env::current_exe().context("cannot find the insight executable")?;
    let scratch = Scratch::new()?;
    let binary = native_binary(&initramfs, &scratch)?;

    // The best of a few calibrating runs: one slowed by other work on the
    // host would make every run too short for the guest's timer to show.
    let calibration = best(
        &(0..RUNS)
            .map(|_| native(&binary, 1, CALIBRATION_ROUNDS))
            .collect::<Result<Vec<_>>>()?,
    );
    let rounds = (CALIBRATION_ROUNDS as u128 * TARGET_NS as u128 / calibration.ns.max(1) as u128)
        .clamp(CALIBRATION_ROUNDS as u128, 100 * CALIBRATION_ROUNDS as u128)
        as u64
        & !1;
    progress(&format!(
        "measuring the guest's user-code speed: tick_count, {rounds} rounds, best of {RUNS} \
         (natively, and under `insight run` with and without nohz=off: the first run of \
         either boots it, half a minute)"
    ));
    let started = Instant::now();
    let (mut natives, mut guests, mut periodics) = (vec![], vec![], vec![]);
    for _ in 0..RUNS {
        natives.push(native(&binary, 1, rounds)?);
        guests.push(in_guest(&insight, &[], rounds)?);
        periodics.push(in_guest(&insight, &["--cmdline", "nohz=off"], rounds)?);
    }
    progress(&format!(
        "measured in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(GuestSpeed {
        rounds,
        native: best(&natives),
        guest: best(&guests),
        periodic: best(&periodics),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ns: u64, timer: Option<u64>) -> TickCount {
        TickCount {
            ns,
            timer,
            user_ticks: 0,
        }
    }

    #[test]
    fn the_workload_line_is_read_natively_and_in_the_guest() {
        let guest =
            "x\ntick_count: threads 1 ns 620048010 timer 22 user 61 system 4 (result ce87)\n";
        assert_eq!(
            parse(guest),
            Some(TickCount {
                ns: 620_048_010,
                timer: Some(22),
                user_ticks: 61
            })
        );
        // A host whose /proc/interrupts names no timer on IRQ 0.
        let host = "tick_count: threads 1 ns 5 timer -1 user 0 system 0 (result 1)";
        assert_eq!(parse(host).unwrap().timer, None);
        assert_eq!(parse("tick_count: threads 1 ns x timer 1 user 0"), None);
        assert_eq!(parse("nothing"), None);
    }

    #[test]
    fn speed_rates_and_the_price_of_a_tick_come_from_the_best_runs() {
        let s = GuestSpeed {
            rounds: 2,
            native: run(500_000_000, None),
            guest: best(&[run(600_000_000, Some(15)), run(550_000_000, Some(14))]),
            periodic: run(700_000_000, Some(74)),
        };
        assert!((s.speed(&s.guest) - 500.0 / 550.0).abs() < 1e-9);
        assert!((GuestSpeed::rate(&s.guest).unwrap() - 14.0 / 0.55).abs() < 1e-9);
        // 150 ms more for 60 more interrupts.
        assert!((s.tick_cost().unwrap() - 0.0025).abs() < 1e-12);
        // A periodic run with no more interrupts says nothing of a tick.
        let s = GuestSpeed {
            periodic: run(700_000_000, Some(14)),
            ..s
        };
        assert_eq!(s.tick_cost(), None);
        assert_eq!(GuestSpeed::rate(&s.native), None);
    }
}
