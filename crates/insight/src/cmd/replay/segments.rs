//! Checkpoints and segments of `insight replay`: the checkpoint listing,
//! the segments' bounds, and `--jobs N`, where
//! the segments between a trace's checkpoints replay side by side, each
//! by an `insight replay --segment K/M` of its own, and their event
//! databases are merged: the same commands an external scheduler runs
//! (docs/scale-out.md), run here N at a time.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use diagnosis::plugin::Plugin;

use super::args::{ReplayArgs, Unwind};
use crate::cmd::events::merge;
use crate::cmd::report::diagnose;
use crate::exit::{EXIT_DIVERGED, EXIT_INSIGHT_ERROR, EXIT_STOPPED_BY_USER};
use crate::status::printable;
use vmm::CheckpointEvery;

/// The exits segment `k` of `n` runs between: from the checkpoint at the
/// first (`None`: boot) to the second (`None`: the recording's end).
pub(super) fn segment_bounds(
    trace: &Path,
    segment: (usize, usize),
) -> Result<(Option<u64>, Option<u64>)> {
    let exits: Vec<u64> = own_checkpoints(trace)?.iter().map(|c| c.exit).collect();
    split(&exits, segment).with_context(|| {
        format!(
            "{} has {} checkpoint{}, so at most {} segments: take more with --checkpoint-every",
            trace.display(),
            exits.len(),
            if exits.len() == 1 { "" } else { "s" },
            exits.len() + 1
        )
    })
}

/// Segment `k` of `n` when checkpoints are at `exits`: the starts (boot,
/// then each checkpoint) split into `n` runs of about as many each.
fn split(exits: &[u64], (k, n): (usize, usize)) -> Option<(Option<u64>, Option<u64>)> {
    let starts: Vec<Option<u64>> = std::iter::once(None)
        .chain(exits.iter().copied().map(Some))
        .collect();
    if n > starts.len() || k == 0 || k > n {
        return None;
    }
    let at = |i: usize| i * starts.len() / n;
    Some((starts[at(k - 1)], starts.get(at(k)).copied().flatten()))
}

/// Checkpoints this replay would start event capture from but cannot (a
/// replay without events took them) are not used: the replay runs from
/// boot, in one piece, and takes the set again with what event capture
/// needs, so that the next replay starts from them. Says so.
pub(super) fn checkpoints_for_events(trace: &Path, args: &mut ReplayArgs) -> Result<()> {
    if args.capture.events.is_none() || args.window.segment.is_some() {
        return Ok(());
    }
    let stored = own_checkpoints(trace)?;
    let starts: Vec<u64> = match (args.window.jobs, args.window.from) {
        (Some(_), _) => stored.iter().map(|c| c.exit).collect(),
        (None, Some(from)) => vmm::checkpoint_before(trace, from.resolve(trace, false)?)?
            .map(|c| c.exit)
            .into_iter()
            .collect(),
        (None, None) => Vec::new(),
    };
    let stacks = args.capture.unwind == Unwind::Cfi;
    let header = super::open_trace(trace)?.header;
    let marks = vmm::builder::sample_marks_period(
        &header,
        args.capture.sample_period,
        args.capture.replay_time_samples,
    );
    for exit in starts {
        let Some(why) = vmm::checkpoint_unfit(trace, exit, stacks, marks)? else {
            continue;
        };
        if args.window.checkpoint_every.is_none() {
            args.window.checkpoint_every = CheckpointEvery::like(&stored);
        }
        let every = match args.window.checkpoint_every {
            Some(CheckpointEvery::GuestNs(ns)) => format!(" every {:.1} s", ns as f64 / 1e9),
            Some(CheckpointEvery::Exits(n)) => format!(" every {n} exits"),
            None => String::new(),
        };
        eprintln!(
            "insight: {why}, which cannot start event capture: replaying from boot{}, taking \
             the checkpoints again{every} with what event capture needs",
            if args.window.jobs.is_some() {
                " in one segment"
            } else {
                ""
            }
        );
        args.window.jobs = None;
        args.window.from = None;
        return Ok(());
    }
    Ok(())
}

/// The trace's checkpoints but those another trace wrote (copied in).
fn own_checkpoints(trace: &Path) -> Result<Vec<trace::checkpoints::StoredCheckpoint>> {
    let mut stored = trace::checkpoints::list(trace)?;
    stored.retain(|c| !c.foreign);
    Ok(stored)
}

/// `--list-checkpoints`.
pub(super) fn list_checkpoints(trace: &Path) -> Result<ExitCode> {
    let all = trace::checkpoints::list(trace)?;
    let (foreign, stored): (Vec<_>, Vec<_>) = all.into_iter().partition(|c| c.foreign);
    for c in &foreign {
        println!(
            "{}: another trace's checkpoint (copied in?), never used: remove it",
            c.path.display()
        );
    }
    if stored.is_empty() {
        println!(
            "{} has no checkpoints (take some with `insight replay {} --checkpoint-every 2s`)",
            trace.display(),
            trace.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:>14}  {:>12}  {:>12}", "exit", "guest time", "size");
    let mut total = 0;
    for c in &stored {
        total += c.bytes;
        println!(
            "{:>14}  {:>10.3} s  {:>9.2} MiB",
            c.exit,
            c.guest_ns as f64 / 1e9,
            c.bytes as f64 / f64::from(1 << 20)
        );
    }
    println!(
        "{} checkpoints, {:.1} MiB in all",
        stored.len(),
        total as f64 / f64::from(1 << 20)
    );
    Ok(ExitCode::SUCCESS)
}

/// What the checkpoints a replay took cost.
pub(super) fn report_checkpoints(taken: &[vmm::CheckpointTaken], trace: &Path) {
    if taken.is_empty() {
        return;
    }
    let bytes: u64 = taken.iter().map(|c| c.bytes).sum();
    let ns: u64 = taken.iter().map(|c| c.took_ns).sum();
    eprintln!(
        "insight: {} checkpoints written to {} ({:.1} MiB in all, {:.0} ms each on average)",
        taken.len(),
        trace.join(trace::checkpoints::CHECKPOINTS_DIR).display(),
        bytes as f64 / f64::from(1 << 20),
        ns as f64 / 1e6 / taken.len() as f64
    );
}

/// Names, in a segment's environment, the pid of the replay that started
/// it: the segment then ends when that process does.
pub const PARENT_ENV: &str = "INSIGHT_SEGMENT_OF";

/// A segment started by `replay --jobs` (its environment names the
/// parent) ends with its parent; a segment started by hand does not.
pub fn end_with_parent() -> Result<()> {
    let Some(parent) = std::env::var_os(PARENT_ENV) else {
        return Ok(());
    };
    let parent: u32 = parent
        .to_str()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("{PARENT_ENV} is not a process ID: {parent:?}"))?;
    vmm::end_with_parent(parent).context("a segment of replay --jobs")
}

/// A segment's replay under way: its number, whether it may run on any
/// host CPU, and where its outputs go.
struct Running {
    k: usize,
    any_cpu: bool,
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
    /// The command's standard error, as the segment replayed it.
    error_stream: PathBuf,
}

/// Replays every segment of `trace`, `jobs` at a time; prints their
/// console output in order, merges their events into `args.capture.events`, and
/// runs `tools` over them.
pub fn replay_in_parallel(
    trace: &Path,
    args: &ReplayArgs,
    jobs: usize,
    tools: Vec<Box<dyn Plugin>>,
) -> Result<ExitCode> {
    if jobs == 0 {
        bail!("--jobs 0: say how many segments may replay at once (1 or more)");
    }
    let stored = own_checkpoints(trace)?;
    if stored.is_empty() {
        bail!(
            "{} has no checkpoints to split its replay at: take some first with \
             `insight replay {} --checkpoint-every 2s{}`",
            trace.display(),
            trace.display(),
            if args.capture.events.is_some() {
                " --events FILE"
            } else {
                ""
            }
        );
    }
    let segments = stored.len() + 1;
    let work = tempdir()?;
    let exe = std::env::current_exe().context("cannot find the insight executable")?;
    let started = Instant::now();
    eprintln!(
        "insight: replaying {} in {segments} segments, {} at a time",
        trace.display(),
        jobs.min(segments)
    );
    // A segment runs on any host CPU, so that segments run side by side.
    // One that diverges there is replayed once more on the CPU the
    // recording ran on: a program that starts inside a segment keeps what
    // CPUID told it, which user code reads untrapped (--any-cpu), and
    // --jobs must give the answer one replay gives.
    // Only where a CPU of this host reports the recording's APIC ID: a
    // replay elsewhere runs on any CPU anyway.
    let pinnable = trace::TraceReader::<journal::Entry>::open(trace)
        .ok()
        .and_then(|r| r.header.host_apic_id)
        .is_some_and(|id| matches!(vmm::host_cpu::with_apic_id(id), Ok(Some(_))));
    let spawn = |k: usize, any_cpu: bool| -> Result<Running> {
        let stdout = work.join(format!("segment-{k}.out"));
        let stderr = work.join(format!("segment-{k}.err"));
        let error_stream = work.join(format!("segment-{k}.stream2"));
        let mut cmd = Command::new(&exe);
        cmd.arg("replay")
            .arg(trace)
            .args(["--segment", &format!("{k}/{segments}")])
            // The segment ends when this process does, however it ends.
            .env(PARENT_ENV, std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(File::create(&stdout)?)
            .stderr(File::create(&stderr)?);
        if any_cpu {
            cmd.arg("--any-cpu");
        }
        if args.no_console {
            cmd.arg("--no-console");
        } else {
            cmd.arg("--error-stream").arg(&error_stream);
        }
        if args.capture.events.is_some() {
            cmd.arg("--events")
                .arg(work.join(format!("segment-{k}.db")))
                .args(["--unwind", args.capture.unwind.name()]);
            if let Some(period) = args.capture.sample_period {
                cmd.arg("--sample-period")
                    .arg(format!("{}us", period.as_micros()));
            }
            if args.capture.replay_time_samples {
                cmd.arg("--replay-time-samples");
            }
            if args.capture.heap_events {
                cmd.arg("--heap-events");
            }
            if args.capture.event_exits {
                cmd.arg("--event-exits");
            }
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        Ok(Running {
            k,
            any_cpu,
            child,
            stdout,
            stderr,
            error_stream,
        })
    };
    // Ctrl-C or SIGTERM: the segments are stopped, and what finished is
    // said, before this process ends.
    vmm::catch_interrupts().context("cannot catch SIGINT and SIGTERM")?;
    let mut running: std::collections::VecDeque<Running> = std::collections::VecDeque::new();
    let mut finished: Vec<usize> = Vec::new();
    let mut next = 1;
    let mut last_words = String::new();
    let result = (|| -> Result<Option<ExitCode>> {
        while next <= segments || !running.is_empty() {
            while next <= segments && running.len() < jobs {
                running.push_back(spawn(next, true)?);
                next += 1;
            }
            // In order: a segment's console output follows the one before.
            let Some(mut r) = running.pop_front() else {
                break;
            };
            // A Ctrl-C reaches the segments too (one process group): one
            // that ended by it counts as stopped, not failed.
            let status = loop {
                let ended = r.child.try_wait()?;
                if vmm::interrupted() && ended.is_none_or(|s| !s.success()) {
                    running.push_front(r);
                    return Ok(Some(stop_segments(&mut running, &finished, segments)));
                }
                if let Some(status) = ended {
                    break status;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let err = std::fs::read_to_string(&r.stderr).unwrap_or_default();
            if status.code() == Some(i32::from(EXIT_DIVERGED)) && r.any_cpu && pinnable {
                eprintln!(
                    "insight: segment {}/{segments} diverged on another host CPU than the \
                     recording's ({}); replaying it again on the recording's CPU",
                    r.k,
                    first_divergence(&err)
                );
                let db = work.join(format!("segment-{}.db", r.k));
                for stale in [events::db::EventWriter::partial_path(&db), db] {
                    let _ = std::fs::remove_file(stale);
                }
                running.push_front(spawn(r.k, false)?);
                continue;
            }
            let out = std::fs::read(&r.stdout).unwrap_or_default();
            std::io::stdout().write_all(&out)?;
            let errors = std::fs::read(&r.error_stream).unwrap_or_default();
            std::io::stderr().write_all(&errors)?;
            if !status.success() {
                eprint!("{}", printable(&err));
                eprintln!("insight: segment {}/{segments} failed", r.k);
                for mut other in running.drain(..) {
                    let _ = other.child.kill();
                    let _ = other.child.wait();
                }
                let code = status.code().map_or(EXIT_INSIGHT_ERROR, |c| c as u8);
                return Ok(Some(ExitCode::from(code)));
            }
            finished.push(r.k);
            if r.k == segments {
                last_words = err
                    .lines()
                    .filter(|l| l.starts_with("insight: replay matched"))
                    .collect::<Vec<_>>()
                    .join("\n");
            }
        }
        Ok(None)
    })();
    // Merging and diagnosing end at a Ctrl-C as before; one that came
    // after the last segment's end stops here.
    vmm::release_interrupts();
    let result = match result {
        Ok(None) if vmm::interrupted() => {
            Ok(Some(stop_segments(&mut running, &finished, segments)))
        }
        other => other,
    };
    let outcome = match result {
        Ok(Some(code)) => {
            let _ = std::fs::remove_dir_all(&work);
            return Ok(code);
        }
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    let merged = outcome.and_then(|()| match &args.capture.events {
        Some(path) => {
            let dbs: Vec<PathBuf> = (1..=segments)
                .map(|k| work.join(format!("segment-{k}.db")))
                .collect();
            let events = merge(path, &dbs, args.capture.events_format.into())?;
            eprintln!(
                "insight: {events} events of {segments} segments written to {}",
                path.display()
            );
            Ok(())
        }
        None => Ok(()),
    });
    let _ = std::fs::remove_dir_all(&work);
    merged?;
    if !last_words.is_empty() {
        eprintln!("{last_words}");
    }
    eprintln!(
        "insight: {segments} segments replayed faithfully in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.capture.events {
        diagnose(tools, path)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The line of a segment's standard error that says where it diverged,
/// or the last line it wrote.
fn first_divergence(stderr: &str) -> String {
    let line = stderr
        .lines()
        .find(|l| l.contains("diverged"))
        .or_else(|| stderr.lines().last())
        .unwrap_or("no message");
    let line: String = line
        .trim_start_matches("insight: ")
        .chars()
        .take(240)
        .collect();
    printable(&line).into_owned()
}

/// Stops the segments still `running` after an interruption and says
/// which of them all had finished; the exit status to end with.
fn stop_segments(
    running: &mut std::collections::VecDeque<Running>,
    finished: &[usize],
    segments: usize,
) -> ExitCode {
    let mut finished = finished.to_vec();
    for other in running.iter_mut() {
        if other
            .child
            .try_wait()
            .ok()
            .flatten()
            .is_some_and(|s| s.success())
        {
            finished.push(other.k);
        }
        let _ = other.child.kill();
        let _ = other.child.wait();
    }
    finished.sort_unstable();
    let which = if finished.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = finished.iter().map(|k| format!("{k}/{segments}")).collect();
        format!(" ({})", names.join(", "))
    };
    eprintln!(
        "insight: interrupted: {} of {segments} segments had finished{which}; the others were \
         stopped",
        finished.len()
    );
    ExitCode::from(EXIT_STOPPED_BY_USER)
}

/// A new private directory for the segments' outputs.
fn tempdir() -> Result<PathBuf> {
    let base = std::env::temp_dir();
    for attempt in 0..100u32 {
        let dir = base.join(format!("insight-segments-{}-{attempt}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create {}", dir.display())),
        }
    }
    bail!(
        "cannot create a directory for the segments in {}",
        base.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_run_once_in_order() {
        let exits = [100, 200, 300, 400, 500];
        // As many segments as starts: one between each pair.
        let all: Vec<_> = (1..=6).map(|k| split(&exits, (k, 6)).unwrap()).collect();
        assert_eq!(all[0], (None, Some(100)));
        assert_eq!(all[2], (Some(200), Some(300)));
        assert_eq!(all[5], (Some(500), None));
        // Fewer: each takes a run of checkpoints, end to start.
        for n in 1..=6 {
            let segs: Vec<_> = (1..=n).map(|k| split(&exits, (k, n)).unwrap()).collect();
            assert_eq!(segs[0].0, None, "{n} segments start at boot");
            assert_eq!(segs[n - 1].1, None, "{n} segments end at the end");
            for w in segs.windows(2) {
                assert_eq!(
                    w[0].1, w[1].0,
                    "{n} segments: each starts where the last ended"
                );
                assert!(w[1].0.is_some());
            }
        }
        assert_eq!(split(&exits, (1, 7)), None);
        assert_eq!(split(&[], (1, 1)), Some((None, None)));
    }
}
