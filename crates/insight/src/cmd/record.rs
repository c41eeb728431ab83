//! `insight record`: run a guest and record the run into a trace.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use trace::ClockKind;
use vmm::builder::RecordOptions;
use vmm::VmError;

use super::{progress_report, user_rdtsc_traps};
use crate::exit::EXIT_STOPPED_BY_USER;
use crate::guest_args::{
    host_streams, net_problems, prepare_guest, start_machine, stdin_input, terminal_output,
    GuestArgs,
};
use crate::status::{human_bytes, StatusLine};
use crate::traces;

#[derive(clap::Args)]
pub struct RecordArgs {
    /// Trace directory to create (must not exist, or be empty). Default: a
    /// new one in the trace store, named after the config or the command
    /// (`syn_cont-0`, `syn_cont-1`, ...), which becomes the latest
    /// recording that `replay`, `dump` and `report` take when no trace is
    /// named (`insight ls` lists them).
    #[arg(short, long, value_name = "DIR")]
    output: Option<PathBuf>,
    /// Print a summary of the recording on standard error even when it is
    /// not a terminal.
    #[arg(long)]
    summary: bool,
    /// Log a digest of the registers every N deterministic exits (1: at
    /// every exit, finding a divergence exactly; larger: smaller traces).
    #[arg(long, value_name = "N", default_value_t = journal::DEFAULT_DIGEST_INTERVAL,
          value_parser = clap::value_parser!(u64).range(1..))]
    digest_every: u64,
    /// Timestamp clock: `exit` (deterministic VM exits, works on any host)
    /// or `branch` (guest retired branches; needs a hardware PMU that KVM
    /// exposes, see `insight host-check`).
    #[arg(long, value_enum, default_value_t = ClockChoice::Exit)]
    clock: ClockChoice,
    /// Mark where the guest's task stands about every PERIOD of the
    /// recording's time (1ms, the least, to 1s; `off` for none): replays
    /// take their samples (`--diagnose profile`, `--sample-period`) at
    /// these marks, so that every replay has the same samples and a
    /// profile's shares are shares of the recorded run (docs/events.md,
    /// "Samples"). Each mark stops the guest for about 55 us on hosts
    /// like these, most of it the exit itself: 4-7 % at 1ms, 0-3 % at
    /// 4ms (docs/BENCHMARKS.md, "Sample marks").
    #[arg(long, value_name = "PERIOD", default_value = "1ms", value_parser = parse_mark_period)]
    sample_period: MarkPeriod,
    #[command(flatten)]
    guest: GuestArgs,
}

/// `--sample-period`: a period, or `off`.
#[derive(Clone, Copy, Debug)]
struct MarkPeriod(Option<Duration>);

fn parse_mark_period(text: &str) -> Result<MarkPeriod, String> {
    if text == "off" {
        return Ok(MarkPeriod(None));
    }
    let period = super::replay::args::parse_period(text)?;
    if period > Duration::from_secs(1) {
        return Err(format!(
            "'{text}' is longer than the longest sampling period, 1s"
        ));
    }
    Ok(MarkPeriod(Some(period)))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ClockChoice {
    Exit,
    Branch,
}

/// Checks that the clock asked for can be used here.
fn choose_clock(choice: ClockChoice) -> Result<ClockKind> {
    match choice {
        ClockChoice::Exit => Ok(ClockKind::Exit),
        ClockChoice::Branch => {
            let pmu = vmm::host_check::check_pmu().context("cannot probe the host's PMU")?;
            let mut missing = Vec::new();
            if let Err(e) = &pmu.host_branch_counter {
                missing.push(format!(
                    "the host cannot count branches (perf_event_open: {e})"
                ));
            }
            if pmu.guest_counters == 0 {
                missing.push("KVM offers guests no PMU counters".to_owned());
            }
            if !missing.is_empty() {
                bail!(
                    "--clock branch needs a hardware branch counter, and this host has none: {}; \
                     record with --clock exit (the default), which needs no PMU",
                    missing.join("; ")
                );
            }
            bail!(
                "--clock branch: this host has a PMU, but this version of insight records with \
                 the exit clock only; record with --clock exit (the default)"
            )
        }
    }
}

/// After a recording failed before its run began (its header may be
/// written, its boot snapshot not): removes what it wrote, and the
/// directory if it `created` it, so that no trace that holds nothing is
/// left behind. Called only for a directory that was empty before.
fn discard_unstarted(dir: &Path, created: bool, hold: Option<&traces::TraceHold>) {
    if hold.is_some_and(|h| !h.is_at(dir)) {
        eprintln!(
            "insight: {} is no longer the directory this recording made: nothing removed",
            dir.display()
        );
        return;
    }
    if let Err(e) = trace::discard_unstarted(dir) {
        eprintln!(
            "insight: cannot remove the unstarted trace in {}: {e}",
            dir.display()
        );
        return;
    }
    if created {
        let _ = std::fs::remove_dir(dir);
    }
    eprintln!(
        "insight: removed the trace in {}: its run never began",
        dir.display()
    );
}

pub fn record(args: RecordArgs) -> Result<ExitCode> {
    choose_clock(args.clock)?;
    let (spec, config) = prepare_guest(&args.guest)?;
    // The store, when the trace goes into it.
    let mut store = None;
    // Whether this recording made the directory (and may remove it).
    let mut created = true;
    let output = match &args.output {
        Some(dir) => {
            if dir.exists() {
                created = false;
            } else {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create {}", dir.display()))?;
            }
            dir.clone()
        }
        None => {
            let dir = traces::new_trace(store.insert(traces::store()?), &args.guest.trace_name())?;
            eprintln!("insight: recording into {}", dir.display());
            dir
        }
    };
    // No other command uses the trace while it is recorded: `rm` and
    // replays are refused, naming this process.
    let hold =
        traces::hold(&output, traces::TraceUse::Exclusive).context("cannot record into it")?;
    // What a failed start may remove: only what this recording wrote, into
    // a directory that was empty (a trace is recorded into no other).
    let fresh = created || traces::is_empty_dir(&output);
    let status = StatusLine::for_stderr();
    let (mut machine, snapshot) = start_machine(&spec, status.console(terminal_output()), || {
        status.console(terminal_output())
    })
    .inspect_err(|_| {
        if fresh {
            discard_unstarted(&output, created, hold.as_ref())
        }
    })?;
    machine.set_streams(host_streams(|w| status.console(w)));
    let (input, _terminal) = stdin_input(args.guest.no_stdin).unzip();
    let (session, notes) = vmm::builder::record(
        machine,
        RecordOptions {
            spec: &spec,
            snapshot: snapshot.as_ref(),
            output: output.clone(),
            config_text: config,
            digest_every: args.digest_every,
            user_rdtsc_traps: user_rdtsc_traps()?,
            input,
            progress: progress_report(&status, "record", None),
            sample_period: args.sample_period.0,
        },
    )
    .inspect_err(|_| {
        if fresh {
            discard_unstarted(&output, created, hold.as_ref())
        }
    })?;
    // Its header is written: a trace, the latest one.
    if let Some(store) = &store {
        traces::set_latest(store, &output)?;
    }
    // Other runs may take the snapshot's lock from here on.
    drop(snapshot);
    for note in notes {
        eprintln!("insight: {note}");
    }
    let result = session.run();
    status.clear();
    let outcome = match result {
        Err(VmError::StoppedByUser) => {
            eprintln!(
                "\ninsight: stopped by the user (Ctrl-A x); the trace in {} holds the run up to here",
                output.display()
            );
            return Ok(ExitCode::from(EXIT_STOPPED_BY_USER));
        }
        other => other.map_err(|e| {
            let e = anyhow::Error::from(e);
            let removed = e.chain().any(|c| {
                matches!(
                    c.downcast_ref::<trace::TraceError>(),
                    Some(trace::TraceError::Removed(_))
                )
            });
            if removed {
                e.context("recording stopped")
            } else {
                e.context(format!(
                    "recording failed (the trace in {} holds the run up to the failure)",
                    output.display()
                ))
            }
        })?,
    };
    if let Some(problems) = net_problems(outcome.net.as_ref()) {
        eprintln!("insight: {problems}");
    }
    if args.summary || status.enabled() {
        let bytes = outcome
            .trace
            .map(|s| s.event_bytes + s.payload_bytes)
            .unwrap_or(0);
        eprintln!(
            "insight: recorded {} deterministic exits, {} log entries, {:.2} s of guest time; \
             trace {} ({}) in {}",
            outcome.journal.exits,
            outcome.journal.entries,
            outcome.journal.guest_ns as f64 / 1e9,
            human_bytes(bytes),
            bytes,
            output.display()
        );
        let p = &outcome.points.asynchronous;
        if p.points + p.declined > 0 {
            eprintln!(
                "insight: preempted user code at {} asynchronous points ({} at the task's next \
                 pass, {} positions declined; {:.2} s reading their state)",
                p.points,
                p.advanced,
                p.declined,
                p.busy_ns as f64 / 1e9
            );
        }
        let s = &outcome.points.samples;
        if s.taken + s.missed > 0 {
            eprintln!(
                "insight: {} sample marks ({} kicks at positions a replay could not find again, \
                 each tried again 50 us later)",
                s.taken, s.missed
            );
        }
    }
    Ok(ExitCode::from(outcome.exit_status.unwrap_or(0)))
}
