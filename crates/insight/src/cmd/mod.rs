//! One module per subcommand; what several share is here.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use journal::{Entry, Progress};
use trace::TraceReader;
use vmm::ProgressFn;

use crate::status::{human_bytes, StatusLine};

pub mod cache;
pub mod convert;
pub mod debug;
pub mod diff;
pub mod dump;
pub mod events;
pub mod host_check;
pub mod ls;
pub mod record;
pub mod replay;
pub mod report;
pub mod run;
pub mod schedule;
pub mod why;

pub(crate) fn open_trace(dir: &std::path::Path) -> Result<TraceReader<Entry>> {
    TraceReader::open(dir).with_context(|| format!("cannot open trace {}", dir.display()))
}

/// Whether user-mode RDTSC faults on this host (`insight host-check`),
/// which decides whether the guest kernel emulates it.
pub(crate) fn user_rdtsc_traps() -> Result<bool> {
    vmm::host_check::check_user_tsd()
        .context("cannot probe whether this host's KVM traps user-mode RDTSC")
}

/// How often progress goes to a standard error that is no terminal.
const PROGRESS_LINE_EVERY: Duration = Duration::from_secs(10);

/// What a run still has to go, where it is known: the recording's log
/// entries and guest time (a replay of a complete trace).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ProgressTotal {
    pub entries: u64,
    pub guest_ns: u64,
}

impl From<&trace::Summary> for ProgressTotal {
    fn from(s: &trace::Summary) -> Self {
        ProgressTotal {
            entries: s.events,
            guest_ns: s.guest_ns,
        }
    }
}

/// "1 h 5 min", "3 min 20 s", "45 s".
fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

/// The progress of a run at `p`: how far (in percent and time left, with
/// a `total`), guest time, exits. `start_entries`: where the run began in
/// the log (a replay from a checkpoint starts part of the way).
fn progress_text(
    p: &Progress,
    started: Instant,
    total: Option<ProgressTotal>,
    start_entries: u64,
) -> String {
    let elapsed = started.elapsed();
    let mut text = String::new();
    match total.filter(|t| t.entries > 0) {
        Some(t) => {
            let done = p.entries.min(t.entries);
            let _ = write!(
                text,
                "{:.0}% · guest {:.1} s of {:.1} s · {} exits",
                100.0 * done as f64 / t.entries as f64,
                p.guest_ns as f64 / 1e9,
                t.guest_ns as f64 / 1e9,
                p.exits
            );
            let run = done.saturating_sub(start_entries);
            let left = t.entries - done;
            if run > 0 && elapsed >= Duration::from_secs(2) {
                let eta = elapsed.mul_f64(left as f64 / run as f64);
                let _ = write!(text, " · about {} left", human_duration(eta));
            }
        }
        None => {
            let _ = write!(
                text,
                "guest {:.1} s · {} exits · {} entries",
                p.guest_ns as f64 / 1e9,
                p.exits,
                p.entries
            );
        }
    }
    if p.async_points > 0 {
        let _ = write!(text, " · {} async points", p.async_points);
    }
    if p.trace_bytes > 0 {
        let _ = write!(text, " · trace {}", human_bytes(p.trace_bytes));
    }
    let _ = write!(text, " ({} so far)", human_duration(elapsed));
    text
}

/// What shows a recording's or replay's progress: on the status line
/// where standard error is a terminal, else a line every
/// `PROGRESS_LINE_EVERY` (none for a run shorter than that). `total`:
/// what the run goes to, where known (a replay).
pub(crate) fn progress_report(
    status: &StatusLine,
    verb: &'static str,
    total: Option<ProgressTotal>,
) -> Option<ProgressFn> {
    let status = status.clone();
    let started = Instant::now();
    let mut start_entries = None;
    let mut last_line = Instant::now();
    Some(Box::new(move |p| {
        let start = *start_entries.get_or_insert(p.entries);
        let text = progress_text(p, started, total, start);
        if status.enabled() {
            status.show(&format!("[{verb}] {text}"));
        } else if last_line.elapsed() >= PROGRESS_LINE_EVERY {
            eprintln!("insight: {verb}: {text}");
            last_line = Instant::now();
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_says_how_far_and_how_long_is_left() {
        let p = Progress {
            exits: 1200,
            entries: 500,
            async_points: 0,
            guest_ns: 3_100_000_000,
            trace_bytes: 0,
        };
        let total = ProgressTotal {
            entries: 1000,
            guest_ns: 7_400_000_000,
        };
        let started = Instant::now() - Duration::from_secs(30);
        let text = progress_text(&p, started, Some(total), 0);
        assert!(
            text.starts_with("50% · guest 3.1 s of 7.4 s · 1200 exits"),
            "{text}"
        );
        assert!(
            text.contains("about 30 s left") || text.contains("about 31 s left"),
            "{text}"
        );
        // From a checkpoint half-way: the rate is of what this run did.
        let text = progress_text(&p, started, Some(total), 250);
        assert!(
            text.contains("about 1 min 0 s left") || text.contains("about 1 min 1 s left"),
            "{text}"
        );
        let text = progress_text(&p, started, None, 0);
        assert!(
            text.starts_with("guest 3.1 s · 1200 exits · 500 entries"),
            "{text}"
        );
        assert_eq!(human_duration(Duration::from_secs(3725)), "1 h 2 min");
    }
}
