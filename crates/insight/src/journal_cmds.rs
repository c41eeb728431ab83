//! `insight record`, `insight replay` and `insight dump`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use diagnosis::plugin::Plugin;
use diagnosis::plugins;
use events::capture::{Capture, CaptureSummary};
use events::db::{EventFormat, EventWriter};
use trace::{ClockKind, Header, TraceReader, TraceWriter};
use vmm::journal::{
    EndReason, Entry, HostMismatch, Journal, JournalError, Progress, Recorder, Replayer,
};
use vmm::{guest, StopReason, Vm, VmError};

use crate::cli::{attach_stdin, net_problems, prepare_guest, GuestArgs, EXIT_STOPPED_BY_USER};
use crate::pcap::PcapWriter;
use crate::report_cmds;
use crate::status::{human_bytes, StatusLine};

/// `replay` exit status when the guest did not do what was recorded.
pub const EXIT_DIVERGED: u8 = 1;
/// `replay` exit status when an incomplete trace's prefix replayed.
pub const EXIT_PREFIX_ONLY: u8 = 4;

#[derive(clap::Args)]
pub struct RecordArgs {
    /// Trace directory to create (must not exist, or be empty).
    #[arg(short, long, value_name = "DIR")]
    output: PathBuf,
    /// Print a summary of the recording on standard error even when it is
    /// not a terminal.
    #[arg(long)]
    summary: bool,
    /// Log a digest of the registers every N deterministic exits (1: at
    /// every exit, finding a divergence exactly; larger: smaller traces).
    #[arg(long, value_name = "N", default_value_t = vmm::journal::DEFAULT_DIGEST_INTERVAL,
          value_parser = clap::value_parser!(u64).range(1..))]
    digest_every: u64,
    /// Timestamp clock: `exit` (deterministic VM exits, works on any host)
    /// or `branch` (guest retired branches; needs a hardware PMU that KVM
    /// exposes, see `insight host-check`).
    #[arg(long, value_enum, default_value_t = ClockChoice::Exit)]
    clock: ClockChoice,
    #[command(flatten)]
    guest: GuestArgs,
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
            let pmu = vmm::host_check::probe_pmu().context("cannot probe the host's PMU")?;
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

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// Trace directory written by `insight record`.
    trace: PathBuf,
    /// Do not print the guest's console output.
    #[arg(long)]
    no_console: bool,
    /// Write the Ethernet frames the guest sends to FILE (pcap). At replay
    /// they go nowhere else: no network is used.
    #[arg(long, value_name = "FILE")]
    tx_pcap: Option<PathBuf>,
    /// Collect the events the guest raises (probes preloaded with
    /// LD_PRELOAD=/usr/lib/libinsight-probes.so, and the guest kernel's
    /// context switches and exits) into the event database FILE (SQLite,
    /// docs/events.md). An existing FILE is replaced when replay ends.
    #[arg(long, value_name = "FILE")]
    events: Option<PathBuf>,
    /// How the database stores events: packed (compressed blocks, a few
    /// bytes per event; read them with `insight report`) or rows (one SQL
    /// row per event, about 37 bytes, for your own queries with sqlite3).
    #[arg(long, value_enum, default_value = "packed", value_name = "FORMAT")]
    events_format: EventsFormat,
    /// After replay, run diagnosis tools over the events (written to
    /// TRACE/events.db unless --events names a file): locks, deadlock,
    /// profile (samples every 1 ms unless --sample-period says otherwise),
    /// threads; several separated by commas.
    #[arg(long, value_name = "TOOL,...", value_delimiter = ',', value_parser = report_cmds::parse_tool)]
    diagnose: Vec<String>,
    /// Sample the tracked task on the CPU (RIP and user stack) about every
    /// PERIOD of host time, e.g. 1ms (the least), 5ms, 20ms; into the
    /// event database. Tasks are tracked once they raise a probe event.
    #[arg(long, value_name = "PERIOD", value_parser = parse_period)]
    sample_period: Option<Duration>,
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
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("'{text}' is not a period such as 1ms, 500us or 2s"))?;
    let period = match &text[digits.len()..] {
        "ns" => Duration::from_nanos(value),
        "us" => Duration::from_micros(value),
        "ms" => Duration::from_millis(value),
        "s" => Duration::from_secs(value),
        unit => return Err(format!("unknown unit '{unit}' in '{text}' (ns, us, ms, s)")),
    };
    // The vCPU is woken for a sample at most once a millisecond.
    if period < MIN_SAMPLE_PERIOD {
        return Err(format!(
            "'{text}' is shorter than the least sampling period, 1ms"
        ));
    }
    Ok(period)
}

#[derive(clap::Args)]
pub struct DiffArgs {
    /// First trace directory.
    first: PathBuf,
    /// Second trace directory.
    second: PathBuf,
}

#[derive(clap::Args)]
pub struct DumpArgs {
    /// Trace directory written by `insight record`.
    trace: PathBuf,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
    /// Print the header only.
    #[arg(long, conflicts_with = "json")]
    header: bool,
    /// Stop after this many log entries.
    #[arg(long, value_name = "N")]
    limit: Option<u64>,
    /// Write the network frames the recording delivered to the guest to
    /// FILE (pcap, stamped with guest time) instead of printing the log.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json", "header", "limit"])]
    rx_pcap: Option<PathBuf>,
}

fn progress_text(verb: &str, p: &Progress, started: Instant) -> String {
    let mut text = format!(
        "[{verb}] guest {:.1} s, {} exits, {} events",
        p.guest_ns as f64 / 1e9,
        p.exits,
        p.entries
    );
    if p.trace_bytes > 0 {
        text.push_str(&format!(", trace {}", human_bytes(p.trace_bytes)));
    }
    text.push_str(&format!(" ({:.0} s)", started.elapsed().as_secs_f64()));
    text
}

fn attach_progress(vm: &mut Vm, status: &StatusLine, verb: &'static str) {
    if !status.enabled() {
        return;
    }
    let status = status.clone();
    let started = Instant::now();
    vm.on_progress(Box::new(move |p| {
        status.show(&progress_text(verb, p, started))
    }));
}

pub fn record(args: RecordArgs) -> Result<ExitCode> {
    let clock = choose_clock(args.clock)?;
    let (spec, config) = prepare_guest(&args.guest)?;
    let status = StatusLine::for_stderr();
    let mut vm = Vm::new(&spec, status.console(Box::new(std::io::stdout())))?;
    let (images, boot) = guest::trace_images(&spec)?;
    let header = Header {
        clock,
        created_unix_secs: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        guest_cpuid: vm.guest_cpuid().to_vec(),
        kvm_caps: vm.kvm_caps().to_vec(),
        user_rdtsc_traps: user_rdtsc_traps()?,
        config,
        images,
        boot,
        digest_interval: args.digest_every,
    };
    let writer = TraceWriter::create(&args.output, &header)
        .with_context(|| format!("cannot create trace {}", args.output.display()))?;
    vm.set_journal(Journal::Record(Box::new(Recorder::new(
        writer,
        args.digest_every,
    ))));
    attach_progress(&mut vm, &status, "record");
    let _terminal = attach_stdin(&mut vm, args.guest.no_stdin);
    let result = vm.run();
    status.clear();
    let outcome = match result {
        Err(VmError::StoppedByUser) => {
            eprintln!(
                "\ninsight: stopped by the user (Ctrl-A x); the trace in {} holds the run up to here",
                args.output.display()
            );
            return Ok(ExitCode::from(EXIT_STOPPED_BY_USER));
        }
        other => other.with_context(|| {
            format!(
                "recording failed (the trace in {} holds the run up to the failure)",
                args.output.display()
            )
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
            args.output.display()
        );
    }
    Ok(ExitCode::from(outcome.exit_status.unwrap_or(0)))
}

fn open_trace(dir: &std::path::Path) -> Result<TraceReader<Entry>> {
    TraceReader::open(dir).with_context(|| format!("cannot open trace {}", dir.display()))
}

pub fn replay(mut args: ReplayArgs) -> Result<ExitCode> {
    let tools: Vec<Box<dyn Plugin>> = args
        .diagnose
        .iter()
        .filter_map(|name| plugins::by_name(name))
        .collect();
    if !tools.is_empty() && args.events.is_none() {
        args.events = Some(args.trace.join("events.db"));
    }
    if args.sample_period.is_none() {
        args.sample_period = tools
            .iter()
            .filter_map(|t| t.replay_needs().sample_period)
            .min();
    }
    if args.sample_period.is_some() && args.events.is_none() {
        bail!("--sample-period needs somewhere to put the samples: --events FILE or --diagnose");
    }
    let reader = open_trace(&args.trace)?;
    if reader.header.clock != ClockKind::Exit {
        bail!(
            "{} was recorded with the branch clock; this insight replays exit-clock traces only",
            args.trace.display()
        );
    }
    let complete = reader.complete.is_some();
    let spec = guest::from_trace(&reader.header)?;
    let status = StatusLine::for_stderr();
    let console: Box<dyn Write + Send> = if args.no_console {
        Box::new(std::io::sink())
    } else {
        status.console(Box::new(std::io::stdout()))
    };
    let mut vm = Vm::new(&spec, console)?;
    match vmm::journal::check_host(
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
            args.trace.display()
        ),
        Err(HostMismatch::Kvm(difference)) => bail!(
            "this host's KVM cannot replay {} the way it was recorded ({difference}); replay \
             on the recording host or one whose KVM has the same capabilities",
            args.trace.display()
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
                std::fs::canonicalize(&args.trace)
                    .unwrap_or_else(|_| args.trace.clone())
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
        if let Some(period) = args.sample_period {
            vm.sample_every(period);
        }
    }
    vm.set_journal(Journal::Replay(Box::new(Replayer::new(reader))));
    attach_progress(&mut vm, &status, "replay");
    let result = vm.run();
    status.clear();
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
            eprintln!("insight: {d}");
            if !d.state.is_empty() {
                eprintln!("insight: replay state at the divergence: {}", d.state);
            }
            if let Some(path) = &args.events {
                eprintln!(
                    "insight: {} holds the events raised before the divergence",
                    path.display()
                );
            }
            return Ok(ExitCode::from(EXIT_DIVERGED));
        }
        other => other?,
    };
    if let Some(problems) = net_problems(outcome.net.as_ref()) {
        eprintln!("insight: {problems}");
    }
    if let (Some(summary), Some(path)) = (&outcome.events, &args.events) {
        report_capture(summary, path);
        if !tools.is_empty() {
            for (i, out) in report_cmds::run_plugins(
                tools,
                path,
                None,
                Path::new(report_cmds::DEFAULT_DEBUG_DIR),
            )?
            .iter()
            .enumerate()
            {
                if i > 0 {
                    println!();
                }
                print!("{}", out.text);
            }
        }
    }
    let exits = outcome.journal.exits;
    let code = match &outcome.stop {
        StopReason::CommandExited | StopReason::PowerOff => {
            let how = match outcome.exit_status {
                Some(s) => EndReason::CommandExited(s),
                None => EndReason::PowerOff,
            };
            eprintln!("insight: replay matched the recording: {exits} deterministic exits; {how}");
            ExitCode::SUCCESS
        }
        StopReason::RecordingEnded(reason) => {
            eprintln!(
                "insight: replay matched the recording up to its end after {exits} deterministic \
                 exits (the recording ended there: {reason})"
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
    };
    Ok(code)
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

/// Whether user-mode RDTSC faults on this host (`insight host-check`),
/// which decides whether the guest kernel emulates it.
fn user_rdtsc_traps() -> Result<bool> {
    vmm::host_check::probe_user_tsd()
        .context("cannot probe whether this host's KVM traps user-mode RDTSC")
}

/// Writes the frames a recording delivered as a pcap file.
fn dump_rx_pcap(mut reader: TraceReader<Entry>, path: &Path) -> Result<ExitCode> {
    let mut pcap =
        PcapWriter::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut guest_ns = 0;
    let mut bytes = 0u64;
    while let Some(event) = reader.next_event()? {
        match event {
            Entry::RdMsr {
                index: vmm::journal::MSR_INSIGHT_CLOCK,
                value,
                fault: false,
                ..
            } => guest_ns = value,
            Entry::NetRx { payload, lens } => {
                let data = reader.payload(payload)?;
                let mut at = 0usize;
                for len in lens {
                    let end = at.saturating_add(len as usize);
                    let Some(frame) = data.get(at..end) else {
                        bail!(
                            "a network event's frame lengths exceed its payload ({} bytes)",
                            data.len()
                        );
                    };
                    let ethernet = frame.get(devices::tap::VNET_HDR_LEN..).unwrap_or(&[]);
                    pcap.frame(guest_ns, ethernet)
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    bytes += ethernet.len() as u64;
                    at = end;
                }
            }
            _ => {}
        }
    }
    pcap.flush()
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!(
        "insight: {} received frames ({}) written to {}",
        pcap.frames(),
        human_bytes(bytes),
        path.display()
    );
    if let Some(problem) = &reader.tail_problem {
        eprintln!("insight: the log ends early: {problem:?}");
    }
    Ok(ExitCode::SUCCESS)
}

pub fn dump(args: DumpArgs) -> Result<ExitCode> {
    let mut reader = open_trace(&args.trace)?;
    if let Some(path) = &args.rx_pcap {
        return dump_rx_pcap(reader, path);
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let h = &reader.header;
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({ "header": header_json(h, &reader) })
        )?;
    } else {
        print_header(&mut out, h, &reader)?;
        if args.header {
            return Ok(ExitCode::SUCCESS);
        }
        writeln!(out, "log:")?;
    }
    let mut exit: u64 = 0;
    let mut entries: u64 = 0;
    while let Some(event) = reader.next_event()? {
        if args.limit.is_some_and(|l| entries >= l) {
            break;
        }
        entries += 1;
        if event.is_exit() {
            exit += 1;
        }
        if args.json {
            writeln!(
                out,
                "{}",
                serde_json::json!({ "exit": exit, "event": event })
            )?;
        } else if event.is_exit() {
            writeln!(out, "{exit:>10}  {event}")?;
        } else {
            writeln!(out, "{:>10}  {event}", "")?;
        }
    }
    if let Some(problem) = &reader.tail_problem {
        if args.json {
            writeln!(
                out,
                "{}",
                serde_json::json!({ "tail_problem": format!("{problem:?}") })
            )?;
        } else {
            writeln!(out, "(log ends early: {problem:?})")?;
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

pub fn diff(args: DiffArgs) -> Result<ExitCode> {
    let a = open_trace(&args.first)?;
    let b = open_trace(&args.second)?;
    let mut same_start = true;
    if a.header.images != b.header.images {
        println!("the traces booted different images");
        same_start = false;
    }
    if a.header.boot.cmdline != b.header.boot.cmdline
        || a.header.boot.memory_mib != b.header.boot.memory_mib
        || a.header.boot.extra_initramfs != b.header.boot.extra_initramfs
    {
        println!("the traces booted with different command lines, memory or commands");
        same_start = false;
    }
    if a.header.boot.rng_seed != b.header.boot.rng_seed {
        println!("the guests' random seeds differ (every recording has its own)");
    }
    let (mut a, mut b) = (a, b);
    let mut exit: u64 = 0;
    let mut entries: u64 = 0;
    loop {
        let (x, y) = (a.next_event()?, b.next_event()?);
        if x.as_ref().is_some_and(Entry::is_exit) {
            exit += 1;
        }
        let show = |e: &Option<Entry>| match e {
            Some(e) => e.to_string().trim_start().to_string(),
            None => "(end of log)".to_string(),
        };
        if x != y {
            println!(
                "first difference at log entry {}, exit {exit}:\n  {}: {}\n  {}: {}",
                entries + 1,
                args.first.display(),
                show(&x),
                args.second.display(),
                show(&y)
            );
            return Ok(ExitCode::from(1));
        }
        if x.is_none() {
            break;
        }
        entries += 1;
    }
    println!("the logs are identical: {entries} entries, {exit} deterministic exits");
    Ok(if same_start {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn header_json(h: &Header, reader: &TraceReader<Entry>) -> serde_json::Value {
    serde_json::json!({
        "format_version": trace::TRACE_VERSION,
        "clock": format!("{:?}", h.clock),
        "created_unix_secs": h.created_unix_secs,
        "complete": reader.complete.is_some(),
        "summary": reader.complete,
        "images": h.images,
        "cmdline": h.boot.cmdline,
        "memory_mib": h.boot.memory_mib,
        "extra_initramfs_bytes": h.boot.extra_initramfs.len(),
        "config": h.config,
        "guest_cpuid_entries": h.guest_cpuid.len(),
        "kvm_caps": h.kvm_caps,
        "user_rdtsc_traps": h.user_rdtsc_traps,
    })
}

fn print_header(out: &mut impl Write, h: &Header, reader: &TraceReader<Entry>) -> Result<()> {
    writeln!(
        out,
        "insight trace, format version {}",
        trace::TRACE_VERSION
    )?;
    writeln!(out, "  clock:      {:?}", h.clock)?;
    writeln!(out, "  created:    {} (unix seconds)", h.created_unix_secs)?;
    match &reader.complete {
        Some(s) => writeln!(
            out,
            "  complete:   yes, {} log entries in {} frames, {} of events, {} of payloads",
            s.events,
            s.frames,
            human_bytes(s.event_bytes),
            human_bytes(s.payload_bytes)
        )?,
        None => writeln!(out, "  complete:   no (the recorder did not finish)")?,
    }
    for image in &h.images {
        writeln!(
            out,
            "  {:<11} {} (sha256 {})",
            format!("{}:", image.role),
            image.path,
            image.digest
        )?;
    }
    writeln!(out, "  memory:     {} MiB", h.boot.memory_mib)?;
    writeln!(out, "  cmdline:    {}", h.boot.cmdline)?;
    writeln!(
        out,
        "  extra initramfs: {} bytes (command, environment, files)",
        h.boot.extra_initramfs.len()
    )?;
    writeln!(out, "  CPUID:      {} entries", h.guest_cpuid.len())?;
    writeln!(
        out,
        "  user RDTSC: {}",
        if h.user_rdtsc_traps {
            "faulted, emulated by the guest kernel from the logged clock"
        } else {
            "ran natively (not replayed faithfully)"
        }
    )?;
    writeln!(out, "  config:")?;
    for line in h.config.lines() {
        writeln!(out, "    {line}")?;
    }
    Ok(())
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
        assert!(parse_period("5").is_err());
        assert!(parse_period("0ms").is_err());
        assert!(parse_period("3h").is_err());
        assert!(parse_period("ms").is_err());
    }
}
