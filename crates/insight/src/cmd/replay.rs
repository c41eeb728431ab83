//! `insight replay`: re-execute a trace, checking it step by step, and
//! collect the guest's events and samples for the diagnosis tools.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use diagnosis::plugin::Plugin;
use diagnosis::plugins;
use diagnosis::symbols::{ElfSymbols, GuestFiles};
use events::capture::{Capture, CaptureSummary};
use events::db::{EventFormat, EventWriter};
use journal::{EndReason, HostMismatch, Journal, JournalError, Replayer};
use trace::ClockKind;
use vmm::{CheckpointEvery, ReplayPoint, StopReason, Vm, VmError};

use super::report;
use super::segments::{
    describe_point, list_checkpoints, parse_interval, parse_position, parse_segment,
    report_checkpoints, segment_bounds, Position,
};
use super::{attach_progress, open_trace, user_rdtsc_traps};
use crate::exit::{EXIT_DIVERGED, EXIT_PREFIX_ONLY};
use crate::guest_args::net_problems;
use crate::outputs::{self, Output};
use crate::pcap::PcapWriter;
use crate::status::{printable, StatusLine};
use crate::traces;

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// Trace directory written by `insight record`, or a recording's name
    /// in the trace store (`insight ls`); default: the latest recording.
    trace: Option<PathBuf>,
    /// Do not print the guest's console output.
    #[arg(long)]
    pub(super) no_console: bool,
    /// Write the Ethernet frames the guest sends to FILE (pcap). At replay
    /// they go nowhere else: no network is used.
    #[arg(long, value_name = "FILE")]
    tx_pcap: Option<PathBuf>,
    /// Collect the events the guest raises (the probe library's, in
    /// programs recorded with `record --probes`, and the guest kernel's
    /// context switches and exits) into the event database FILE (SQLite,
    /// docs/events.md). It is written as FILE.partial and renamed when
    /// replay ends; an existing FILE is replaced only if it is an insight
    /// event database (see --force).
    #[arg(long, value_name = "FILE")]
    pub(super) events: Option<PathBuf>,
    /// Also collect the heap events of programs recorded with --probes:
    /// HEAPCALL, ALLOC and FREE around each call to malloc, calloc,
    /// realloc, free, posix_memalign, aligned_alloc, memalign, mmap and
    /// munmap (docs/events.md). They name heap blocks by their allocation
    /// site in `insight report memory`, and cost this replay an exit per
    /// event; other replays skip them at no cost. On with
    /// --trace-process.
    #[arg(long)]
    pub(super) heap_events: bool,
    /// Replace an existing --events or --tx-pcap file even if it is not
    /// one insight wrote (never a device, link, directory, or a file of a
    /// trace).
    #[arg(long)]
    pub(super) force: bool,
    /// How the database stores events: packed (compressed blocks, a few
    /// bytes per event; read them with `insight report`) or rows (one SQL
    /// row per event, about 37 bytes, for your own queries with sqlite3).
    #[arg(long, value_enum, default_value = "packed", value_name = "FORMAT")]
    pub(super) events_format: EventsFormat,
    /// After replay, run diagnosis tools over the events (written to
    /// TRACE/events.db unless --events names a file): locks, deadlock,
    /// profile (samples every 1 ms unless --sample-period says otherwise),
    /// threads; several separated by commas.
    #[arg(long, value_name = "TOOL,...", value_delimiter = ',', value_parser = report::parse_tool)]
    diagnose: Vec<String>,
    /// Sample the tracked task on the CPU (RIP and user stack) about every
    /// PERIOD of host time, e.g. 1ms (the least), 5ms, 20ms; into the
    /// event database. Tasks are tracked once they raise a probe event.
    #[arg(long, value_name = "PERIOD", value_parser = parse_period)]
    pub(super) sample_period: Option<Duration>,
    /// How the user stacks of samples and lock events are found: cfi
    /// (the call-frame information of the guest's executables and
    /// libraries, their .eh_frame, as exceptions and `perf --call-graph
    /// dwarf` use it; whole stacks without frame pointers) or
    /// frame-pointers (samples follow RBP, lock events keep their caller
    /// only: for programs built with -fno-omit-frame-pointer, and to
    /// compare).
    #[arg(long, value_enum, default_value = "cfi", value_name = "HOW")]
    pub(super) unwind: Unwind,
    /// Find the positions where the recording preempted user code by
    /// their registers alone, without the memory and extended-state
    /// checks: shows that those checks are needed (such a replay can
    /// deliver at the wrong pass of a loop and diverge). Never needed
    /// otherwise.
    #[arg(long, hide = true)]
    match_registers_only: bool,
    /// Take a checkpoint (the whole VM state, docs/trace-format.md) every
    /// INTERVAL into TRACE/checkpoints, replacing those it had (or, with
    /// --from, those after the one restored): recorded guest time such as
    /// 2s or 500ms, or a number of deterministic exits such as 200000.
    /// Checkpoints land at the first exit after each interval where no
    /// disk request is in flight, at the same exits in every replay.
    #[arg(long, value_name = "INTERVAL", value_parser = parse_interval)]
    checkpoint_every: Option<CheckpointEvery>,
    /// Start from the trace's latest checkpoint at or before POS instead
    /// of booting: an exit ordinal (123456), recorded guest time (12s,
    /// 1500ms), or the first event of a kind, of one thread or any
    /// (first:lock:LWPID, first:threadcreate), as the trace's event
    /// database TRACE/events.db has it. Every exit from there on is
    /// checked as usual.
    #[arg(long, value_name = "POS", value_parser = parse_position)]
    from: Option<Position>,
    /// Stop after POS (as for --from; an event's is the first exit after
    /// it) instead of at the recording's end.
    #[arg(long, value_name = "POS", value_parser = parse_position)]
    to: Option<Position>,
    /// List the trace's checkpoints (exit, guest time, size) and exit.
    #[arg(long)]
    list_checkpoints: bool,
    /// Replay segment K of N only: the trace's checkpoints (and boot)
    /// start the segments, split into N runs of about as many each; K
    /// runs from its first start to the next segment's. With --events,
    /// the database holds that span's events, numbered as in a whole
    /// replay; `insight events merge` joins the segments' databases.
    /// For running segments on several machines (docs/scale-out.md).
    #[arg(long, value_name = "K/N", value_parser = parse_segment, conflicts_with_all = ["from", "to", "jobs", "checkpoint_every"])]
    segment: Option<(usize, usize)>,
    /// Replay the segments between the trace's checkpoints N at a time, in
    /// separate processes, and join their events: the same database as one
    /// replay (samples excepted: they follow host time), sooner. Needs
    /// checkpoints taken with --events when events are collected.
    /// Segments run on any host CPU (see --any-cpu), or they would all
    /// share the one the recording ran on.
    #[arg(long, value_name = "N", conflicts_with_all = ["from", "to", "checkpoint_every", "tx_pcap"])]
    jobs: Option<usize>,
    /// Run on any host CPU, not only one reporting the APIC ID the
    /// recording ran on. Guest user code reads CPUID without the host
    /// trapping it, so a program that starts in this replay and keeps the
    /// APIC ID CPUID gave it (glibc does) may differ from the recording;
    /// replay's checks then report a divergence, never a wrong result.
    #[arg(long)]
    pub(super) any_cpu: bool,
    /// Single-step the user code of one process at replay: its pid, or the
    /// name its threads raise events under (the kernel's 15-character
    /// `comm`; the first such process), and write what it executed with
    /// --trace-instructions and the memory it read and wrote with
    /// --trace-memory. A pid is traced from the first exit it is on the
    /// CPU for, a name from the process's first event (`insight report
    /// threads` lists the pids of programs recorded with --probes). About
    /// 10,000 instructions a second on hosts without user-mode
    /// single-stepping: for short programs and windows
    /// (docs/expansion.md).
    #[arg(long, value_name = "PID|NAME", value_parser = parse_trace_target)]
    trace_process: Option<vmm::TraceTarget>,
    /// Write each user instruction the traced process executed (thread,
    /// address, bytes) to FILE, zstd-compressed (docs/expansion.md).
    #[arg(long, value_name = "FILE", requires = "trace_process")]
    trace_instructions: Option<PathBuf>,
    /// Also write each instruction's registers before it ran (the 16
    /// general-purpose registers and RFLAGS) in the --trace-instructions
    /// file: 136 bytes more per instruction before compression.
    #[arg(long, requires = "trace_instructions")]
    trace_registers: bool,
    /// Write each load and store of the traced process's user code to
    /// FILE, a line per access: kind (L, S or M for read-modify-write, as
    /// Valgrind's lackey), address, size, thread, instruction address.
    #[arg(long, value_name = "FILE", requires = "trace_process")]
    trace_memory: Option<PathBuf>,
}

/// `--trace-process`: a pid, or a process name.
fn parse_trace_target(text: &str) -> Result<vmm::TraceTarget, String> {
    if text.is_empty() {
        return Err("name a process: its pid or its name".into());
    }
    Ok(match text.parse::<u32>() {
        Ok(pid) => vmm::TraceTarget::Pid(pid),
        Err(_) => vmm::TraceTarget::Name(text.to_owned()),
    })
}

/// Where the kernel half of the guest's address space starts.
const KERNEL_HALF: u64 = 0xffff_8000_0000_0000;

/// How user stacks are unwound at replay (`--unwind`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Unwind {
    Cfi,
    FramePointers,
}

impl Unwind {
    /// As `--unwind` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Unwind::Cfi => "cfi",
            Unwind::FramePointers => "frame-pointers",
        }
    }
}

/// How an event database stores its events (`--events-format`).
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum EventsFormat {
    Packed,
    Rows,
}

impl From<EventsFormat> for EventFormat {
    fn from(f: EventsFormat) -> Self {
        match f {
            EventsFormat::Packed => EventFormat::Packed,
            EventsFormat::Rows => EventFormat::Rows,
        }
    }
}

/// "500us", "1ms", "2s", "1000000ns".
const MIN_SAMPLE_PERIOD: Duration = Duration::from_millis(1);

fn parse_period(text: &str) -> Result<Duration, String> {
    let period = parse_duration(text)?;
    // The vCPU is woken for a sample at most once a millisecond.
    if period < MIN_SAMPLE_PERIOD {
        return Err(format!(
            "'{text}' is shorter than the least sampling period, 1ms"
        ));
    }
    Ok(period)
}

/// "500us", "1ms", "2s", "1000000ns" (a unit is required).
pub(super) fn parse_duration(text: &str) -> Result<Duration, String> {
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("'{text}' is not a period such as 1ms, 500us or 2s"))?;
    let period = match &text[digits.len()..] {
        "ns" => Duration::from_nanos(value),
        "us" => Duration::from_micros(value),
        "ms" => Duration::from_millis(value),
        "s" => Duration::from_secs(value),
        "" => {
            return Err(format!(
                "'{text}' has no unit: say {text}ms, {text}us or {text}s"
            ))
        }
        unit => return Err(format!("unknown unit '{unit}' in '{text}' (ns, us, ms, s)")),
    };
    if period.is_zero() {
        return Err(format!("'{text}' is no time at all"));
    }
    Ok(period)
}

pub fn replay(mut args: ReplayArgs) -> Result<ExitCode> {
    let trace = traces::resolve(args.trace.as_deref())?;
    if args.list_checkpoints {
        return list_checkpoints(&trace);
    }
    if let Some(segment) = args.segment {
        let (from, to) = segment_bounds(&trace, segment)?;
        args.from = from.map(|e| Position::At(ReplayPoint::Exit(e)));
        args.to = to.map(|e| Position::At(ReplayPoint::Exit(e)));
    }
    let tools: Vec<Box<dyn Plugin>> = args
        .diagnose
        .iter()
        .filter_map(|name| plugins::by_name(name))
        .collect();
    if !tools.is_empty() && args.events.is_none() {
        args.events = Some(trace.join(traces::EVENTS_DB));
    }
    if args.sample_period.is_none() {
        args.sample_period = tools
            .iter()
            .filter_map(|t| t.replay_needs().sample_period)
            .min();
    }
    if args.trace_process.is_some() {
        if args.trace_instructions.is_none() && args.trace_memory.is_none() {
            bail!(
                "--trace-process needs somewhere to write: --trace-instructions FILE, \
                 --trace-memory FILE or both"
            );
        }
        if args.jobs.is_some() {
            bail!("--trace-process traces one replay: it cannot be split with --jobs");
        }
        // The event capture says which task is on the CPU.
        if args.events.is_none() {
            args.events = Some(trace.join(traces::EVENTS_DB));
        }
        // Heap blocks are named by their allocation events.
        args.heap_events = true;
    }
    if args.heap_events && args.events.is_none() {
        bail!("--heap-events needs somewhere to put the events: --events FILE or --diagnose");
    }
    if args.sample_period.is_some() && args.events.is_none() {
        bail!("--sample-period needs somewhere to put the samples: --events FILE or --diagnose");
    }
    // Outputs are checked before anything runs: a replay can be long.
    if let Some(path) = &args.events {
        outputs::check_event_db(path, args.force)?;
    }
    if let Some(path) = &args.tx_pcap {
        outputs::check(path, Output::Pcap, args.force)?;
    }
    if let Some(path) = &args.trace_instructions {
        outputs::check(path, Output::InstructionTrace, args.force)?;
    }
    if let Some(path) = &args.trace_memory {
        outputs::check(path, Output::MemoryTrace, args.force)?;
    }
    if let Some(jobs) = args.jobs {
        return super::segments::replay_in_parallel(&trace, &args, jobs, tools);
    }
    let reader = open_trace(&trace)?;
    if reader.header.clock != ClockKind::Exit {
        bail!(
            "{} was recorded with the branch clock; this insight replays exit-clock traces only",
            trace.display()
        );
    }
    let complete = reader.complete.is_some();
    let spec = guest::from_trace(&reader.header, &trace)?;
    let status = StatusLine::for_stderr();
    let console: Box<dyn Write + Send> = if args.no_console {
        Box::new(std::io::sink())
    } else {
        status.console(Box::new(std::io::stdout()))
    };
    let mut vm = Vm::new(&spec, console)?;
    if args.match_registers_only {
        vm.match_registers_only();
    }
    if let (Some(apic_id), false) = (reader.header.host_apic_id, args.any_cpu) {
        match vmm::host_cpu::with_apic_id(apic_id).context("cannot list the host's CPUs")? {
            Some(cpu) => vm.run_on_host_cpu(cpu.cpu),
            None => eprintln!(
                "insight: no CPU this replay may run on reports APIC ID {apic_id}, the one \
                 the recording ran on; a program that keeps what CPUID told it (glibc does) \
                 may not be found again where it was preempted"
            ),
        }
    }
    match journal::check_host(
        &reader.header,
        vm.guest_cpuid(),
        vm.kvm_caps(),
        user_rdtsc_traps()?,
    ) {
        Ok(()) => {}
        Err(HostMismatch::Cpu(difference)) => bail!(
            "this host's CPU differs from the one {} was recorded on ({difference}); the \
             guest would see a different CPU: replay on the recording host or one with the \
             same CPU",
            trace.display()
        ),
        Err(HostMismatch::Kvm(difference)) => bail!(
            "this host's KVM cannot replay {} the way it was recorded ({difference}); replay \
             on the recording host or one whose KVM has the same capabilities",
            trace.display()
        ),
    }
    let tx_capture = match &args.tx_pcap {
        Some(path) => Some(capture_tx(&mut vm, path)?),
        None => None,
    };
    if let Some(path) = &args.events {
        let meta = [
            // Absolute, so that `insight report` finds it from anywhere.
            (
                "trace",
                std::fs::canonicalize(&trace)
                    .unwrap_or_else(|_| trace.clone())
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
        let db = EventWriter::create_with(path, &meta, args.events_format.into())
            .with_context(|| format!("cannot create the event database {}", path.display()))?;
        vm.capture_events(Capture::new(db));
        if args.heap_events {
            vm.collect_heap_events();
        }
        if args.unwind == Unwind::Cfi {
            let files =
                GuestFiles::from_initramfs(&guest::with_archive(&spec.initramfs, &spec.archive));
            let load = move |path: &str| files.get(path).map(<[u8]>::to_vec);
            vm.unwind_stacks(unwind::Processes::new(Box::new(load)));
        }
        // Samples in the kernel find the user registers there, and the
        // tracing of a process sets its trap flag there. A uniprocessor
        // kernel's per-CPU variables are plain globals.
        let top = ElfSymbols::parse(&spec.kernel_image)
            .and_then(|k| k.data_address("cpu_current_top_of_stack"))
            .filter(|&a| a >= KERNEL_HALF);
        if let Some(gva) = top {
            vm.user_registers_below(gva);
        }
        if let Some(period) = args.sample_period {
            vm.sample_every(period);
        }
    }
    if let Some(target) = &args.trace_process {
        vm.expand_user(vmm::ExpansionSpec {
            target: target.clone(),
            instructions: args
                .trace_instructions
                .as_deref()
                .map(instruction_trace)
                .transpose()?,
            memory: args
                .trace_memory
                .as_deref()
                .map(|p| -> Result<Box<dyn Write + Send>> {
                    Ok(Box::new(BufWriter::new(create_output(p)?)))
                })
                .transpose()?,
            registers: args.trace_registers,
        });
    }
    vm.set_journal(Journal::Replay(Box::new(Replayer::new(reader))));
    let from = args.from.map(|p| p.resolve(&trace, false)).transpose()?;
    let to = args.to.map(|p| p.resolve(&trace, true)).transpose()?;
    if let Some(from) = from {
        let Some(start) = Vm::checkpoint_before(&trace, from)? else {
            bail!(
                "{} has no checkpoint at or before {}: take some with `insight replay {} \
                 --checkpoint-every 2s`",
                trace.display(),
                describe_point(from),
                trace.display()
            );
        };
        let restored = vm.restore_checkpoint(&trace, start.exit)?;
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
    if from.is_none() {
        vm.restore_trace_snapshot(&spec.start)?;
    }
    if let Some(to) = to {
        vm.stop_at(to);
    }
    if let Some(every) = args.checkpoint_every {
        vm.take_checkpoints(&trace, every)?;
    }
    attach_progress(&mut vm, &status, "replay");
    let started = Instant::now();
    let result = vm.run();
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
            if let Some(path) = &args.events {
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
        other => other?,
    };
    if let Some(problems) = net_problems(outcome.net.as_ref()) {
        eprintln!("insight: {problems}");
    }
    if let Some(stats) = &outcome.expansion {
        report_expansion(stats, &args, replay_time);
    }
    if let (Some(summary), Some(path)) = (&outcome.events, &args.events) {
        report_capture(summary, path);
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
        // A replay never asks for one.
        StopReason::SnapshotTaken => bail!("the replay stopped to take a boot snapshot"),
    };
    Ok(code)
}

/// Runs the diagnosis `tools` over the event database at `path` and
/// prints what they found.
pub(super) fn diagnose(tools: Vec<Box<dyn Plugin>>, path: &Path) -> Result<()> {
    if tools.is_empty() {
        return Ok(());
    }
    for (i, out) in report::run_plugins(tools, path, None, Path::new(report::DEFAULT_DEBUG_DIR))?
        .iter()
        .enumerate()
    {
        if i > 0 {
            println!();
        }
        print!("{}", printable(&out.text));
    }
    Ok(())
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
            "insight: no process matching --trace-process raised an event: nothing was traced \
             (trace a process recorded with --probes, by its pid or name as `insight report \
             threads` lists them)"
        );
        return;
    };
    let mut written = Vec::new();
    if let Some(p) = &args.trace_instructions {
        written.push(format!("instructions to {}", p.display()));
    }
    if let Some(p) = &args.trace_memory {
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
    if stats.unreadable > 0 {
        eprintln!(
            "insight: {} instructions of process {pid} were executed from pages it had unmapped \
             before they could be read: counted, not in the traces",
            stats.unreadable
        );
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

/// Sends the frames the guest transmits to a new pcap file at `path`.
fn capture_tx(vm: &mut Vm, path: &Path) -> Result<SharedPcap> {
    if !vm.has_net() {
        bail!("--tx-pcap: the recorded guest has no network device");
    }
    let pcap =
        PcapWriter::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let pcap = Arc::new(Mutex::new(pcap));
    let sink = Arc::clone(&pcap);
    let started = Instant::now();
    let mut failed = false;
    vm.capture_net_tx(Box::new(move |frame| {
        let ns = started.elapsed().as_nanos() as u64;
        let mut pcap = sink
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !failed && pcap.frame(ns, frame).is_err() {
            failed = true; // reported when the file is flushed at the end
        }
    }));
    Ok(pcap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_need_a_unit_and_a_positive_value() {
        assert_eq!(parse_period("1ms"), Ok(Duration::from_millis(1)));
        assert_eq!(parse_period("1500us"), Ok(Duration::from_micros(1500)));
        assert!(parse_period("500us").is_err());
        assert_eq!(parse_period("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(
            parse_period("5"),
            Err("'5' has no unit: say 5ms, 5us or 5s".into())
        );
        assert!(parse_period("0ms").is_err());
        assert!(parse_period("3h").is_err());
        assert!(parse_period("ms").is_err());
    }
}
