//! `insight record`: run a guest and record the run into a trace.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use trace::ClockKind;
use vmm::builder::RecordOptions;
use vmm::VmError;

use super::{progress_report, user_rdtsc_traps};
use crate::exit::{EXIT_HUNG, EXIT_STOPPED_BY_USER};
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
    /// Record again and again, each try from the boot snapshot, until the
    /// command fails: a non-zero exit status (a signal's included) or no
    /// progress for --timeout (a hang). Only the failing recording is kept
    /// (named as usual, the latest); at most MAX tries (default 1000).
    /// Standard input is not forwarded; the kept try's console output is
    /// shown once it failed.
    #[arg(long, value_name = "MAX", num_args = 0..=1, require_equals = true,
          default_missing_value = "1000",
          value_parser = clap::value_parser!(u32).range(1..))]
    until_fail: Option<u32>,
    /// End the recording when the guest's user code has made no progress
    /// (no system call or fault from user mode) for DURATION of the vCPU's
    /// time ("30s", "500ms"; its CPU time while the guest runs, the
    /// host's time while it idles): it is taken as a hang (a deadlock, a spin
    /// that never ends, or a sleep that long), and the trace ends with the
    /// threads where they stood (exit status 124).
    #[arg(long, value_name = "DURATION", value_parser = crate::position::parse_duration)]
    timeout: Option<Duration>,
    /// Perturb the recorded schedule (docs/chaos.md): the guest's scheduler
    /// runs threads by random priorities, changes them at random system
    /// calls, and switches threads a random number of user instructions
    /// in, drawn from SEED (default: a random seed, printed). The seed goes
    /// in the trace header; a replay needs none. With --until-fail try N
    /// draws from SEED + N - 1.
    #[arg(long, value_name = "SEED", num_args = 0..=1, require_equals = true,
          default_missing_value = "random", value_parser = parse_seed)]
    chaos: Option<Seed>,
    /// Take the decisions of chaos recording TRACE again (docs/chaos.md,
    /// "Why it failed"): the same schedule, as far as the run goes the same
    /// way, with the choices EDITS names left out (`drop=LIST`) or only
    /// those taken (`keep=LIST`); LIST is numbers and ranges (`3,7,10-12`)
    /// of the choices `insight dump --schedule TRACE` numbers.
    #[arg(long, value_name = "TRACE[:EDITS]", conflicts_with_all = ["chaos", "until_fail"],
          value_parser = super::schedule::parse_schedule_arg)]
    schedule: Option<super::schedule::ScheduleArg>,
    #[command(flatten)]
    guest: GuestArgs,
}

/// `--chaos`'s seed.
#[derive(Clone, Copy, Debug)]
enum Seed {
    Random,
    Given(u64),
}

fn parse_seed(text: &str) -> Result<Seed, String> {
    if text == "random" {
        return Ok(Seed::Random);
    }
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed
        .map(Seed::Given)
        .map_err(|_| format!("'{text}' is not a seed (a number below 2^64, or 0x and hex digits)"))
}

impl Seed {
    /// The seed itself: a random one drawn from the host's entropy.
    fn value(self) -> u64 {
        match self {
            Seed::Given(seed) => seed,
            Seed::Random => {
                use std::hash::{BuildHasher, Hasher};
                // std seeds each RandomState from the host's entropy.
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u128(
                    std::time::SystemTime::UNIX_EPOCH
                        .elapsed()
                        .map_or(0, |d| d.as_nanos()),
                );
                h.finish()
            }
        }
    }
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
    if let Err(e) = trace::discard_unstarted(dir).and_then(|()| trace::objects::discard(dir)) {
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

/// Where the recording goes, and what a failed start may remove.
struct Target {
    output: PathBuf,
    /// The trace store, when the trace goes into it.
    store: Option<PathBuf>,
    /// Whether this recording made the directory (and may remove it).
    created: bool,
    /// The directory was empty: what a failed start wrote may go.
    fresh: bool,
    hold: Option<traces::TraceHold>,
}

impl Target {
    fn discard_unstarted(&self) {
        if self.fresh {
            discard_unstarted(&self.output, self.created, self.hold.as_ref());
            self.prune_store();
        }
    }

    /// Removes the host files the store keeps that no trace links any
    /// more, after a trace that stored some was discarded.
    fn prune_store(&self) {
        let Some(store) = &self.store else { return };
        let shared = store.join(trace::objects::SHARED_OBJECTS_DIR);
        if let Err(e) = trace::objects::prune_shared(&shared) {
            eprintln!("insight: {}", crate::exit::error_chain(&e.into()));
        }
    }
}

/// How one recording ended.
enum Ended {
    /// The command exited (its status), or the guest powered off (none).
    Exited(Box<vmm::RunOutcome>),
    /// It made no progress for the time limit: a hang.
    Hung(Duration),
    /// The user stopped it.
    StoppedByUser,
}

impl Ended {
    /// Whether the command failed: a non-zero status (a signal's
    /// included) or a hang.
    fn failed(&self) -> bool {
        match self {
            Ended::Exited(o) => o.exit_status.is_some_and(|s| s != 0),
            Ended::Hung(_) => true,
            Ended::StoppedByUser => false,
        }
    }
}

pub fn record(args: RecordArgs) -> Result<ExitCode> {
    choose_clock(args.clock)?;
    let (spec, config) = prepare_guest(&args.guest)?;
    let mut store = None;
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
    let target = Target {
        output,
        store,
        created,
        fresh,
        hold,
    };
    match args.until_fail {
        Some(max) => record_until_fail(&args, &spec, &config, &target, max),
        None => record_once(&args, &spec, &config, &target),
    }
}

/// One recording, kept whatever its end.
fn record_once(
    args: &RecordArgs,
    spec: &guest::VmSpec,
    config: &str,
    target: &Target,
) -> Result<ExitCode> {
    let status = StatusLine::for_stderr();
    let stdout = || status.console(terminal_output());
    let input = stdin_input(args.guest.no_stdin);
    let progress = progress_report(&status, "record", None);
    let mut chaos = args.chaos.map(|seed| vmm::chaos_settings(seed.value()));
    let mut schedule = None;
    if let Some(arg) = &args.schedule {
        let recorded = super::schedule::read_schedule(&arg.trace)?;
        let forced = recorded
            .schedule
            .forced(&arg.edits)
            .with_context(|| format!("cannot edit the schedule of {}", recorded.trace.display()))?;
        eprintln!(
            "insight: chaos: the schedule of {}{} ({} choices)",
            recorded.trace.display(),
            match &arg.edits {
                vmm::ScheduleEdits::None => String::new(),
                edits => format!(", {edits}"),
            },
            recorded.schedule.choices().count()
        );
        chaos = Some(recorded.settings);
        schedule = Some(forced);
    } else if let Some(c) = &chaos {
        eprintln!("insight: chaos: {}", super::dump::chaos_text(c));
    }
    let ended = record_try(
        args,
        spec,
        config,
        target,
        Try {
            console: (stdout(), &stdout),
            streams: host_streams(|w| status.console(w), input.pipe.clone()),
            input: input.terminal.clone(),
            progress,
            latest_at_start: true,
            notes: true,
            chaos,
            schedule,
        },
    );
    status.clear();
    let output = &target.output;
    match ended? {
        Ended::StoppedByUser => {
            eprintln!(
                "\ninsight: stopped by the user (Ctrl-A x); the trace in {} holds the run up to here",
                output.display()
            );
            Ok(ExitCode::from(EXIT_STOPPED_BY_USER))
        }
        Ended::Hung(limit) => {
            eprintln!(
                "insight: the command made no progress for {:.3} s (--timeout): recorded as a \
                 hang; the trace in {} ends with its threads where they stood",
                limit.as_secs_f64(),
                output.display()
            );
            Ok(ExitCode::from(EXIT_HUNG))
        }
        Ended::Exited(outcome) => {
            if args.summary || status.enabled() {
                print_summary(&outcome, output);
            }
            Ok(ExitCode::from(outcome.exit_status.unwrap_or(0)))
        }
    }
}

/// `--until-fail`: records again and again, each try from the boot
/// snapshot, until the command fails; keeps only that recording.
fn record_until_fail(
    args: &RecordArgs,
    spec: &guest::VmSpec,
    config: &str,
    target: &Target,
    max: u32,
) -> Result<ExitCode> {
    let started = Instant::now();
    // Ctrl-C ends the try under way and the tries, keeping nothing.
    vmm::catch_interrupts().context("cannot catch SIGINT and SIGTERM")?;
    let result = until_fail_tries(args, spec, config, target, max, started);
    vmm::release_interrupts();
    result
}

fn until_fail_tries(
    args: &RecordArgs,
    spec: &guest::VmSpec,
    config: &str,
    target: &Target,
    max: u32,
    started: Instant,
) -> Result<ExitCode> {
    let status = StatusLine::for_stderr();
    // Each try's console output waits here: only the kept try's is shown.
    let held = HeldOutput::default();
    let held_errors = HeldOutput::default();
    let console = || status.console(Box::new(held.clone()));
    let mut last_line = Instant::now();
    let base_seed = args.chaos.map(Seed::value);
    if let Some(seed) = base_seed {
        eprintln!(
            "insight: chaos: {} (try N draws from seed {seed} + N - 1)",
            super::dump::chaos_text(&vmm::chaos_settings(seed))
        );
    }
    for n in 1..=max {
        held.clear();
        held_errors.clear();
        let chaos = base_seed.map(|s| vmm::chaos_settings(s.wrapping_add(u64::from(n) - 1)));
        let ended = record_try(
            args,
            spec,
            config,
            target,
            Try {
                console: (console(), &console),
                streams: vmm::vm::HostStreams {
                    out: Some(status.console(Box::new(held.clone()))),
                    err: Some(status.console(Box::new(held_errors.clone()))),
                    errors: 0,
                    // Every try gets the same: none (an empty pipe where
                    // insight's standard input is no terminal).
                    input: None,
                },
                input: None,
                progress: None,
                latest_at_start: false,
                notes: n == 1,
                chaos,
                schedule: None,
            },
        )?;
        let elapsed = started.elapsed().as_secs_f64();
        if !ended.failed() {
            trace::discard_unstarted(&target.output)
                .and_then(|()| trace::objects::discard(&target.output))
                .with_context(|| {
                    format!(
                        "cannot remove try {n}'s trace in {}",
                        target.output.display()
                    )
                })?;
            target.prune_store();
            if let Ended::StoppedByUser = ended {
                status.clear();
                eprintln!("insight: stopped by the user in try {n}: no failure kept");
                remove_target(target);
                return Ok(ExitCode::from(EXIT_STOPPED_BY_USER));
            }
            let line = format!("[record --until-fail] try {n}/{max}: passed; {elapsed:.1} s");
            if status.enabled() {
                status.show(&line);
            } else if last_line.elapsed() >= TRY_LINE_EVERY || n == 1 {
                eprintln!("insight: {line}");
                last_line = Instant::now();
            }
            continue;
        }
        status.clear();
        held.write_to(&mut std::io::stdout().lock());
        held_errors.write_to(&mut std::io::stderr().lock());
        if let Some(store) = &target.store {
            traces::set_latest(store, &target.output)?;
        }
        let (how, code) = match &ended {
            Ended::Exited(o) => {
                let s = o.exit_status.unwrap_or(0);
                (format!("exited with status {s}"), s)
            }
            Ended::Hung(limit) => (
                format!(
                    "made no progress for {:.3} s (--timeout): a hang, its threads kept where \
                     they stood",
                    limit.as_secs_f64()
                ),
                EXIT_HUNG,
            ),
            Ended::StoppedByUser => unreachable!("a stop is not a failure"),
        };
        let seed = chaos
            .map(|c| format!(" (chaos seed {})", c.seed))
            .unwrap_or_default();
        eprintln!(
            "insight: try {n}{seed} failed after {elapsed:.1} s: the command {how}; its \
             recording is kept in {}",
            target.output.display()
        );
        if let (Ended::Exited(outcome), true) = (&ended, args.summary) {
            print_summary(outcome, &target.output);
        }
        return Ok(ExitCode::from(code));
    }
    status.clear();
    remove_target(target);
    eprintln!(
        "insight: no failure in {max} {} ({:.1} s): no recording kept",
        if max == 1 { "try" } else { "tries" },
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// How often a try's line goes to a standard error that is no terminal.
const TRY_LINE_EVERY: Duration = Duration::from_secs(10);

/// Removes the trace directory of `--until-fail` tries that kept none,
/// if this recording made it.
fn remove_target(target: &Target) {
    let _ = trace::discard_unstarted(&target.output);
    let _ = trace::objects::discard(&target.output);
    target.prune_store();
    if target.created && target.hold.as_ref().is_none_or(|h| h.is_at(&target.output)) {
        let _ = std::fs::remove_dir(&target.output);
    }
}

/// What differs between one recording and a try of several.
struct Try<'a> {
    /// The console, and how to make another (`start_machine`).
    console: (vmm::vm::Console, &'a dyn Fn() -> vmm::vm::Console),
    /// Where the command's relayed standard output and error go.
    streams: vmm::vm::HostStreams,
    input: Option<vmm::console::ConsoleInput>,
    progress: Option<vmm::ProgressFn>,
    /// The trace becomes the latest as soon as its header is written.
    latest_at_start: bool,
    /// Print the builder's notes.
    notes: bool,
    chaos: Option<trace::ChaosSettings>,
    /// With `chaos`, a recording's decisions taken again.
    schedule: Option<vmm::ForcedDecisions>,
}

/// Records one run into `target`, from the boot snapshot.
fn record_try(
    args: &RecordArgs,
    spec: &guest::VmSpec,
    config: &str,
    target: &Target,
    how: Try<'_>,
) -> Result<Ended> {
    let output = &target.output;
    let (console, another) = how.console;
    let (mut machine, snapshot) =
        start_machine(spec, console, another).inspect_err(|_| target.discard_unstarted())?;
    machine.set_streams(how.streams);
    let (session, notes) = vmm::builder::record(
        machine,
        RecordOptions {
            spec,
            snapshot: snapshot.as_ref(),
            output: output.clone(),
            config_text: config.to_owned(),
            digest_every: args.digest_every,
            user_rdtsc_traps: user_rdtsc_traps()?,
            input: how.input,
            progress: how.progress,
            sample_period: args.sample_period.0,
            time_limit: args.timeout,
            chaos: how.chaos,
            schedule: how.schedule,
            shared_objects: (target.store.as_ref())
                .map(|s| s.join(trace::objects::SHARED_OBJECTS_DIR)),
        },
    )
    .inspect_err(|_| target.discard_unstarted())?;
    // Its header is written: a trace, the latest one.
    if let (Some(store), true) = (&target.store, how.latest_at_start) {
        traces::set_latest(store, output)?;
    }
    // Other runs may take the snapshot's lock from here on.
    drop(snapshot);
    if how.notes {
        for note in notes {
            eprintln!("insight: {note}");
        }
    }
    let outcome = match session.run() {
        Err(VmError::StoppedByUser) => return Ok(Ended::StoppedByUser),
        Err(VmError::TimeLimit { limit }) => return Ok(Ended::Hung(limit)),
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
    Ok(Ended::Exited(Box::new(outcome)))
}

/// The recording's counts, on standard error.
fn print_summary(outcome: &vmm::RunOutcome, output: &Path) {
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
    let c = &outcome.points.chaos;
    if c.seeds > 0 {
        eprintln!(
            "insight: chaos seeded the guest's scheduler {} times (once an exec) and took {} \
             decisions, {} of them choices (`insight dump --schedule`)",
            c.seeds, c.decisions, c.choices
        );
    }
    if c.ticks_forced + c.ticks_given_up > 0 {
        eprintln!(
            "insight: chaos: {} tick choices taken at the exits where the recording took \
             them, {} not (the run went elsewhere first)",
            c.ticks_forced, c.ticks_given_up
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

/// The console output of a try of `--until-fail`, held until it is known
/// whether the try is kept: the first `HELD_OUTPUT_MAX` bytes.
#[derive(Clone, Default)]
struct HeldOutput(Arc<Mutex<(Vec<u8>, u64)>>);

/// Console output held per try, at most (the trace has all of it).
const HELD_OUTPUT_MAX: usize = 1 << 20;

impl HeldOutput {
    fn clear(&self) {
        if let Ok(mut held) = self.0.lock() {
            held.0.clear();
            held.1 = 0;
        }
    }

    fn write_to(&self, out: &mut dyn std::io::Write) {
        if let Ok(held) = self.0.lock() {
            let _ = out.write_all(&held.0);
            let _ = out.flush();
            if held.1 > 0 {
                eprintln!(
                    "insight: {} more bytes of its output are in the trace (insight replay shows \
                     them)",
                    held.1
                );
            }
        }
    }
}

impl std::io::Write for HeldOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut held) = self.0.lock() {
            let room = HELD_OUTPUT_MAX.saturating_sub(held.0.len()).min(buf.len());
            held.0.extend_from_slice(&buf[..room]);
            held.1 += (buf.len() - room) as u64;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
