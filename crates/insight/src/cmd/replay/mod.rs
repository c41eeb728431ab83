//! `insight replay`: re-execute a trace, checking it step by step, and
//! collect the guest's events and samples for the diagnosis tools. Its
//! arguments are in `args.rs`; checkpoints, windows and `--jobs` in
//! `segments.rs`.

pub(crate) mod args;
mod probes;
mod segments;

pub use args::{parse_duration, parse_position, PositionArg, ReplayArgs, Unwind};
use segments::{list_checkpoints, report_checkpoints, segment_bounds};

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use devices::virtio_net::FrameSink;
use diagnosis::plugin::Plugin;
use diagnosis::plugins;
use events::capture::CaptureSummary;
use events::db::EventWriter;
use journal::{EndReason, Entry, JournalError};
use trace::TraceReader;
use vmm::builder::{EventOptions, ReplayOptions};
use vmm::{ReplayPoint, StopReason, VmError};

use super::report::diagnose;
use super::{open_trace, progress_report, user_rdtsc_traps};
use crate::exit::{EXIT_DIVERGED, EXIT_PREFIX_ONLY};
use crate::guest_args::{host_streams, net_problems, terminal_output};
use crate::outputs::{self, OutputKind};
use crate::pcap::PcapWriter;
use crate::status::{printable, StatusLine};
use crate::traces;

pub fn replay(mut args: ReplayArgs) -> Result<ExitCode> {
    if args.window.segment.is_some() {
        // First: nothing a segment does outlives the replay it works for.
        segments::end_with_parent()?;
    }
    let trace = traces::resolve(args.trace.as_deref())?;
    // Other replays may share the trace; a recorder or `rm` may not.
    let _hold = traces::hold(&trace, traces::TraceUse::Shared)?;
    if args.window.list_checkpoints {
        return list_checkpoints(&trace);
    }
    if let Some(segment) = args.window.segment {
        let (from, to) = segment_bounds(&trace, segment)?;
        args.window.from = from.map(|e| PositionArg::At(ReplayPoint::Exit(e)));
        args.window.to = to.map(|e| PositionArg::At(ReplayPoint::Exit(e)));
    }
    let probe_specs = probes::specs(&args.probe, args.probes_file.as_deref())?;
    if !probe_specs.is_empty() && !args.diagnose.iter().any(|d| d == "probes") {
        // The probes' report comes with them.
        args.diagnose.push("probes".into());
    }
    let tools: Vec<Box<dyn Plugin>> = args
        .diagnose
        .iter()
        .filter_map(|name| plugins::by_name(name))
        .collect();
    if !tools.is_empty() && args.capture.events.is_none() {
        args.capture.events = Some(trace.join(traces::EVENTS_DB));
    }
    if args.capture.sample_period.is_none() {
        args.capture.sample_period = tools
            .iter()
            .filter_map(|t| t.replay_needs().sample_period)
            .min();
    }
    if args.tracing.trace_process.is_none() && tools.iter().any(|t| t.replay_needs().traced_process)
    {
        let reader = open_trace(&trace)?;
        let program = traces::recorded_program(&reader.header, &trace)?;
        eprintln!(
            "insight: tracing the recorded command's process, {program}, from its execve \
             (--trace-process PID|NAME traces another)"
        );
        args.tracing.trace_process = Some(vmm::TraceTarget::Name(program));
    }
    if args.tracing.trace_process.is_some() {
        if args.tracing.trace_instructions.is_none()
            && args.tracing.trace_memory.is_none()
            && args.capture.events.is_none()
        {
            bail!(
                "--trace-process needs somewhere to write: --trace-instructions FILE, \
                 --trace-memory FILE, --events FILE (its loads and stores as MEMACCESS events) \
                 or --diagnose memory"
            );
        }
        if args.window.jobs.is_some() {
            bail!("--trace-process traces one replay: it cannot be split with --jobs");
        }
        // The event capture says which task is on the CPU.
        if args.capture.events.is_none() {
            args.capture.events = Some(trace.join(traces::EVENTS_DB));
        }
        // Heap blocks are named by their allocation events.
        args.capture.heap_events = true;
    }
    if args.capture.heap_events && args.capture.events.is_none() {
        bail!("--heap-events needs somewhere to put the events: --events FILE or --diagnose");
    }
    if args.capture.sample_period.is_some() && args.capture.events.is_none() {
        bail!("--sample-period needs somewhere to put the samples: --events FILE or --diagnose");
    }
    if args.capture.decision_samples && args.capture.events.is_none() {
        bail!("--decision-samples needs somewhere to put the samples: --events FILE or --diagnose");
    }
    // Outputs are checked before anything runs: a replay can be long.
    if let Some(path) = &args.capture.events {
        outputs::check_event_db(path, args.force)?;
    }
    if let Some(path) = &args.tx_pcap {
        outputs::check(path, OutputKind::Pcap, args.force)?;
    }
    if let Some(path) = &args.tracing.trace_instructions {
        outputs::check(path, OutputKind::InstructionTrace, args.force)?;
    }
    if let Some(path) = &args.tracing.trace_memory {
        outputs::check(path, OutputKind::MemoryTrace, args.force)?;
    }
    if let (Some(PositionArg::First { .. }), Some(_), Some(_)) = (
        args.window.to,
        args.window.checkpoint_every,
        &args.capture.events,
    ) {
        bail!(
            "--checkpoint-every with --to at an event: the window's events end at that event, \
             and a checkpoint taken after it would lack the events before its exit; take the \
             checkpoints in a replay without --to"
        );
    }
    segments::checkpoints_for_events(&trace, &mut args)?;
    if let Some(jobs) = args.window.jobs {
        return segments::replay_in_parallel(&trace, &args, jobs, tools);
    }
    let reader = open_trace(&trace)?;
    let complete = reader.complete.is_some();
    // A window's end is not the log's: its share is not known.
    let total = (reader.complete.as_ref())
        .filter(|_| args.window.to.is_none())
        .map(super::ProgressTotal::from);
    let probe_plan = match probe_specs.is_empty() {
        true => None,
        false => {
            let mut files = traces::guest_files(&reader.header, &trace)?;
            // Where the guest found the command's program (a host program
            // brought to its path, or one on the command's PATH), else its
            // name.
            let program = traces::recorded_program_path(&reader.header, &files)
                .or_else(|| traces::recorded_program(&reader.header, &trace).ok())
                .unwrap_or_default();
            let plan = probes::plan(probe_specs, &mut files, &program)?;
            eprintln!(
                "insight: {} probe{} armed in {} and the children they fork (docs/probes.md)",
                plan.probes.len(),
                if plan.probes.len() == 1 { "" } else { "s" },
                probes::armed_in(&plan)
            );
            Some(plan)
        }
    };
    let status = StatusLine::for_stderr();
    // The guest's terminal and the command's relayed streams, as the
    // recording wrote them: each to this replay's own.
    let (console, streams): (Box<dyn Write + Send>, _) = if args.no_console {
        let sink = || -> Box<dyn Write + Send> { Box::new(std::io::sink()) };
        let streams = vmm::vm::HostStreams {
            out: Some(sink()),
            err: Some(sink()),
            errors: 0,
            input: None,
        };
        (sink(), streams)
    } else {
        let mut streams = host_streams(|w| status.console(w), None);
        if let Some(path) = &args.error_stream {
            let file =
                File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
            streams.err = Some(Box::new(file));
        }
        (status.console(terminal_output()), streams)
    };
    let events = match &args.capture.events {
        Some(path) => Some(event_options(&args, path, &trace, &reader)?),
        None => None,
    };
    let tracing = match &args.tracing.trace_process {
        Some(target) => Some(vmm::ExpansionSpec {
            target: target.clone(),
            instructions: args
                .tracing
                .trace_instructions
                .as_deref()
                .map(instruction_trace)
                .transpose()?,
            memory: match (&args.tracing.trace_memory, &args.tracing.trace_instructions) {
                (Some(p), _) => Some(Box::new(BufWriter::new(create_output(p)?))),
                // Traced for the event database alone: the accesses go to
                // it as MEMACCESS events, and nowhere else.
                (None, None) => Some(Box::new(std::io::sink())),
                (None, Some(_)) => None,
            },
            registers: args.tracing.trace_registers,
            kernel_steps: !args.tracing.trace_by_traps && kernel_steps_work(),
        }),
        None => None,
    };
    let (tx_capture, sent_frames) = match &args.tx_pcap {
        Some(path) => Some(pcap_of_sent_frames(path)?),
        None => None,
    }
    .unzip();
    let options = ReplayOptions {
        trace: trace.clone(),
        console,
        streams,
        any_cpu: args.window.any_cpu,
        user_rdtsc_traps: user_rdtsc_traps()?,
        registers_only: args.match_registers_only,
        events,
        tracing,
        from: args
            .window
            .from
            .map(|p| p.resolve(&trace, false))
            .transpose()?,
        to: args
            .window
            .to
            .map(|p| p.resolve(&trace, true))
            .transpose()?,
        checkpoint_every: args.window.checkpoint_every,
        debug: None,
        probes: probe_plan,
        sent_frames,
        progress: progress_report(&status, "replay", total),
    };
    let (session, start) = vmm::builder::replay(reader, options)?;
    for note in &start.notes {
        eprintln!("insight: {note}");
    }
    if let Some(restored) = &start.restored {
        eprintln!(
            "insight: restored the checkpoint at exit {} (guest time {:.3} s; {} checkpoint{} \
             read in {:.2} s)",
            restored.exit,
            restored.guest_ns as f64 / 1e9,
            restored.chain,
            if restored.chain == 1 { "" } else { "s" },
            restored.took_ns as f64 / 1e9
        );
    }
    let started = Instant::now();
    let result = session.run();
    let replay_time = started.elapsed();
    status.clear();
    if let Ok(outcome) = &result {
        report_checkpoints(&outcome.checkpoints, &trace);
    }
    if let (Some(capture), Some(path)) = (tx_capture, &args.tx_pcap) {
        let mut pcap = capture
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match pcap.flush() {
            Ok(()) => eprintln!(
                "insight: {} frames the guest sent written to {}",
                pcap.frames(),
                path.display()
            ),
            Err(e) => eprintln!("insight: cannot write {}: {e}", path.display()),
        }
    }
    let outcome = match result {
        Err(VmError::Journal(JournalError::Diverged(d))) => {
            eprintln!("insight: {}", printable(&d.to_string()));
            if !d.state.is_empty() {
                eprintln!("insight: replay state at the divergence: {}", d.state);
            }
            if let Some(path) = &args.capture.events {
                // The database is finished at a divergence too; if that
                // failed (the error is the divergence's), it is left
                // under its partial name, committed up to the divergence.
                let partial = EventWriter::partial_path(path);
                if partial.is_file() {
                    eprintln!(
                        "insight: the event database could not be finished: {} holds the \
                         events raised before the divergence",
                        partial.display()
                    );
                } else {
                    eprintln!(
                        "insight: {} holds the events raised before the divergence",
                        path.display()
                    );
                }
            }
            return Ok(ExitCode::from(EXIT_DIVERGED));
        }
        Err(e) => {
            let e = anyhow::Error::from(e);
            if let Some(path) = args
                .capture
                .events
                .as_deref()
                .filter(|_| crate::exit::disk_full(&e))
            {
                // What it holds is of no use, and it takes the room left.
                let partial = EventWriter::partial_path(path);
                if std::fs::remove_file(&partial).is_ok() {
                    eprintln!(
                        "insight: removed {}, the unfinished event database",
                        partial.display()
                    );
                }
            }
            return Err(e);
        }
        Ok(outcome) => outcome,
    };
    if let Some(problems) = net_problems(outcome.net.as_ref()) {
        eprintln!("insight: {problems}");
    }
    if let Some(stats) = &outcome.expansion {
        report_expansion(stats, &args, replay_time);
    }
    if let (Some(summary), Some(path)) = (&outcome.events, &args.capture.events) {
        report_capture(summary, path);
        let s = &outcome.points.samples;
        if s.taken + s.missed + s.given_up > 0 {
            let mut lost = Vec::new();
            if s.missed > 0 {
                lost.push(format!(
                    "{} passed by: not found before the next exit",
                    s.missed
                ));
            }
            if s.given_up > 0 {
                lost.push(format!(
                    "{} given up: not found in far longer than the recording took",
                    s.given_up
                ));
            }
            eprintln!(
                "insight: sampled at {} of the recording's sample marks{}",
                s.taken,
                match lost.is_empty() {
                    true => String::new(),
                    false => format!(" ({})", lost.join("; ")),
                }
            );
        }
        diagnose(tools, path)?;
    }
    let exits = outcome.journal.exits;
    let code = match &outcome.stop {
        StopReason::CommandExited | StopReason::PowerOff => {
            let how = match outcome.exit_status {
                Some(s) => EndReason::CommandExited(s),
                None => EndReason::PowerOff,
            };
            eprintln!(
                "insight: replay matched the recording: {exits} deterministic exits; {}",
                printable(&how.to_string())
            );
            ExitCode::SUCCESS
        }
        StopReason::RecordingEnded(reason) => {
            eprintln!(
                "insight: replay matched the recording up to its end after {exits} deterministic \
                 exits (the recording ended there: {})",
                printable(&reason.to_string())
            );
            ExitCode::SUCCESS
        }
        StopReason::WindowEnded => {
            eprintln!(
                "insight: replay matched the recording up to the end of the window, after \
                 {exits} deterministic exits (guest time {:.3} s)",
                outcome.journal.guest_ns as f64 / 1e9
            );
            ExitCode::SUCCESS
        }
        StopReason::TraceEnded => {
            let why = if complete {
                "its log ends early"
            } else {
                "its recorder did not finish"
            };
            eprintln!(
                "insight: the trace is incomplete ({why}): replayed its prefix, all \
                 {exits} deterministic exits it holds, faithfully"
            );
            ExitCode::from(EXIT_PREFIX_ONLY)
        }
        // A replay never asks for either.
        StopReason::SnapshotTaken | StopReason::Debug => {
            bail!(
                "the replay stopped for {:?}, which it never asks for",
                outcome.stop
            )
        }
    };
    Ok(code)
}

/// The event capture `args` ask for, into a new database at `path`.
fn event_options(
    args: &ReplayArgs,
    path: &Path,
    trace: &Path,
    reader: &TraceReader<Entry>,
) -> Result<EventOptions> {
    let meta = [
        // Absolute, so that `insight report` finds it from anywhere.
        (
            "trace",
            std::fs::canonicalize(trace)
                .unwrap_or_else(|_| trace.to_owned())
                .display()
                .to_string(),
        ),
        (
            "created_by",
            format!("insight {}", env!("CARGO_PKG_VERSION")),
        ),
        (
            "time_unit",
            "ns since the VM started, as recorded".to_owned(),
        ),
    ];
    let db = crate::outputs::create_event_db(path, &meta, args.capture.events_format.into())?;
    let cfi_files = match args.capture.unwind {
        Unwind::Cfi => {
            let files = traces::guest_files(&reader.header, reader.dir())?;
            Some(
                Box::new(move |path: &str| files.get(path).map(<[u8]>::to_vec))
                    as vmm::builder::GuestFileLoader,
            )
        }
        Unwind::FramePointers => None,
    };
    let end_after = match args.window.to {
        Some(PositionArg::First { kind, lwpid }) => Some((kind, lwpid)),
        _ => None,
    };
    Ok(EventOptions {
        db,
        heap: args.capture.heap_events,
        cfi_files,
        sample_period: args.capture.sample_period,
        replay_time_samples: args.capture.replay_time_samples,
        decision_samples: args.capture.decision_samples,
        end_after,
        exits: args.capture.event_exits,
    })
}

/// A new output file at `path` (checked by `outputs::check` before the
/// replay started).
fn create_output(path: &Path) -> Result<File> {
    File::create(path).with_context(|| format!("cannot create {}", path.display()))
}

/// The zstd-compressed instruction trace at `path`.
fn instruction_trace(path: &Path) -> Result<Box<dyn Write + Send>> {
    let encoder = zstd::Encoder::new(BufWriter::new(create_output(path)?), 3)
        .with_context(|| format!("cannot start compressing {}", path.display()))?;
    Ok(Box::new(encoder.auto_finish()))
}

/// What the single-stepping of `--trace-process` found.
fn report_expansion(stats: &vmm::ExpansionStats, args: &ReplayArgs, replay_time: Duration) {
    let Some(pid) = stats.pid else {
        eprintln!(
            "insight: no process matching --trace-process ran in this replay (by pid), nor \
             executed a program of that name or raised an event under it: nothing was traced \
             (`insight report threads` lists the processes)"
        );
        return;
    };
    match &stats.start {
        Some(vmm::TraceStart::Exec { exit, path }) => eprintln!(
            "insight: traced process {pid} from exit {exit}, its first after it executed \
             {path}: the program's first instructions before that exit (its first page fault \
             or system call) ran untraced"
        ),
        Some(vmm::TraceStart::OnCpu { exit }) => eprintln!(
            "insight: traced process {pid} from exit {exit}, where it was first on the CPU in \
             this replay"
        ),
        Some(vmm::TraceStart::Named { exit }) => eprintln!(
            "insight: traced process {pid} from exit {exit}, the first after an event of its \
             named it: it executed its program earlier, and what it ran before that exit is \
             untraced"
        ),
        None => {}
    }
    let mut written = Vec::new();
    if let Some(p) = &args.tracing.trace_instructions {
        written.push(format!("instructions to {}", p.display()));
    }
    if let Some(p) = &args.tracing.trace_memory {
        written.push(format!("accesses to {}", p.display()));
    }
    let secs = replay_time.as_secs_f64();
    eprintln!(
        "insight: traced process {pid}: {} instructions and {} memory accesses in {} thread{} \
         during a replay of {secs:.1} s (at least {:.0} instructions/s); {}",
        stats.instructions,
        stats.accesses,
        stats.threads,
        if stats.threads == 1 { "" } else { "s" },
        stats.instructions as f64 / secs.max(1e-3),
        written.join(", ")
    );
    if stats.instructions > 0 {
        let refused = if stats.kernel_steps_refused > 0 {
            format!(
                " ({} more raised an exception there or could not be emulated, and were stepped in \
                 user mode)",
                stats.kernel_steps_refused
            )
        } else {
            String::new()
        };
        eprintln!(
            "insight: {} of them stepped in guest kernel mode, where KVM steps an instruction \
             without the guest's debug exception{refused}",
            stats.kernel_steps
        );
    }
    if stats.unreadable > 0 {
        eprintln!(
            "insight: {} instructions of process {pid} were executed from pages it had unmapped \
             before they could be read: counted, not in the traces",
            stats.unreadable
        );
    }
}

/// Whether this host's KVM steps user code in guest kernel mode as it runs
/// in user mode (a probe guest, ~0.1 s): if not, the tracing steps every
/// instruction by a debug exception, and says so.
fn kernel_steps_work() -> bool {
    match vmm::host_check::check_kernel_steps() {
        Ok(report) if report.differences.is_empty() => true,
        Ok(report) => {
            eprintln!(
                "insight: this host's KVM does not step user code in kernel mode as it runs in \
                 user mode ({}): every traced instruction is a debug exception, slower",
                report.differences.join("; ")
            );
            false
        }
        Err(e) => {
            eprintln!(
                "insight: cannot check how this host's KVM steps user code in kernel mode ({e}): \
                 every traced instruction is a debug exception, slower"
            );
            false
        }
    }
}

/// What went into the event database, and what the guest got wrong.
fn report_capture(summary: &CaptureSummary, path: &Path) {
    let kinds: Vec<String> = summary
        .per_kind
        .iter()
        .map(|(k, n)| format!("{n} {}", k.name()))
        .collect();
    eprintln!(
        "insight: {} events written to {}{}",
        summary.events,
        path.display(),
        if kinds.is_empty() {
            String::new()
        } else {
            format!(" ({})", kinds.join(", "))
        }
    );
    for (what, n, example) in &summary.anomalies {
        eprintln!("insight: event capture: {what}: {n} (first: {example})");
    }
}

type SharedPcap = Arc<Mutex<PcapWriter<BufWriter<File>>>>;

/// A new pcap file at `path`, and where to send the frames the guest
/// transmits to have them written there.
fn pcap_of_sent_frames(path: &Path) -> Result<(SharedPcap, FrameSink)> {
    let pcap =
        PcapWriter::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let pcap = Arc::new(Mutex::new(pcap));
    let sink = Arc::clone(&pcap);
    let started = Instant::now();
    let mut failed = false;
    let frames: FrameSink = Box::new(move |frame| {
        let ns = started.elapsed().as_nanos() as u64;
        let mut pcap = sink
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !failed && pcap.frame(ns, frame).is_err() {
            failed = true; // reported when the file is flushed at the end
        }
    });
    Ok((pcap, frames))
}
