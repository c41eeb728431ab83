//! One module per subcommand; what several share is here.

use std::time::Instant;

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

pub(crate) fn open_trace(dir: &std::path::Path) -> Result<TraceReader<Entry>> {
    TraceReader::open(dir).with_context(|| format!("cannot open trace {}", dir.display()))
}

/// Whether user-mode RDTSC faults on this host (`insight host-check`),
/// which decides whether the guest kernel emulates it.
pub(crate) fn user_rdtsc_traps() -> Result<bool> {
    vmm::host_check::probe_user_tsd()
        .context("cannot probe whether this host's KVM traps user-mode RDTSC")
}

fn progress_text(verb: &str, p: &Progress, started: Instant) -> String {
    let mut text = format!(
        "[{verb}] guest {:.1} s, {} exits, {} entries",
        p.guest_ns as f64 / 1e9,
        p.exits,
        p.entries
    );
    if p.async_points > 0 {
        text.push_str(&format!(", {} async points", p.async_points));
    }
    if p.trace_bytes > 0 {
        text.push_str(&format!(", trace {}", human_bytes(p.trace_bytes)));
    }
    text.push_str(&format!(" ({:.0} s)", started.elapsed().as_secs_f64()));
    text
}

/// What shows a recording's or replay's progress on the status line, if
/// it is shown.
pub(crate) fn progress_report(status: &StatusLine, verb: &'static str) -> Option<ProgressFn> {
    if !status.enabled() {
        return None;
    }
    let status = status.clone();
    let started = Instant::now();
    Some(Box::new(move |p| {
        status.show(&progress_text(verb, p, started))
    }))
}
