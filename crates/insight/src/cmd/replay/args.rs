//! What `insight replay` takes: its arguments, and the positions,
//! intervals, periods and segments they name.

use std::path::PathBuf;
use std::time::Duration;

use crate::cmd::events::EventsFormat;
use anyhow::Result;
use vmm::CheckpointEvery;

use crate::cmd::report;
pub use crate::position::{parse_duration, parse_position, PositionArg};

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// Trace directory written by `insight record`, or a recording's name
    /// in the trace store (`insight ls`); default: the latest recording.
    pub trace: Option<PathBuf>,
    /// Do not print the guest's console output, nor the command's
    /// standard output and error.
    #[arg(long)]
    pub no_console: bool,
    /// Write the command's relayed standard error to FILE instead of
    /// standard error (a segment of `--jobs`, whose standard error is
    /// insight's messages).
    #[arg(long, value_name = "FILE", hide = true)]
    pub error_stream: Option<PathBuf>,
    /// Write the Ethernet frames the guest sends to FILE (pcap). At replay
    /// they go nowhere else: no network is used.
    #[arg(long, value_name = "FILE")]
    pub tx_pcap: Option<PathBuf>,
    /// After replay, run diagnosis tools over the events (written to
    /// TRACE/events.db unless --events names a file), several separated by
    /// commas: locks, deadlock, profile (samples every 1 ms unless
    /// --sample-period says otherwise), threads, memory (traces the
    /// command's process), probes (with --probe), timeline (writes its
    /// page beside the database). `insight report --help` says what each
    /// tells.
    #[arg(long, value_name = "TOOL,...", value_delimiter = ',', value_parser = report::parse_tool)]
    pub diagnose: Vec<String>,
    /// Find the positions where the recording preempted user code by
    /// their registers alone, without the memory and extended-state
    /// checks: shows that those checks are needed (such a replay can
    /// deliver at the wrong pass of a loop and diverge). Never needed
    /// otherwise.
    #[arg(long, hide = true)]
    pub match_registers_only: bool,
    /// Serve a gdb (or an IDE) on [ADDR:]PORT instead of replaying to the
    /// end: one process of the recording under gdb, forwards and
    /// backwards, as `insight debug` serves the gdb it starts (loopback
    /// unless an address is given).
    #[arg(long, value_name = "[ADDR:]PORT", conflicts_with_all = ["events", "diagnose", "trace_process", "jobs", "segment", "from", "to", "checkpoint_every", "tx_pcap"])]
    pub gdb: Option<String>,
    /// With --gdb: the process to debug, its pid or its program's name
    /// (default: the guest command's program).
    #[arg(long, value_name = "PID|NAME", requires = "gdb")]
    pub process: Option<String>,
    /// Probe the recorded program at replay, with no change to it and
    /// nothing paid while recording (docs/probes.md): SPEC names a
    /// function of the program (`parse`) or of a library it loads
    /// (`libc.so.6:fsync`), a FILE:LINE, or an address,
    /// then optionally `return`, `in PROGRAM` or `in pid PID` (default:
    /// every process that runs the program, or for a library's function
    /// every process that loads it, from each one's start), `capture`
    /// values (arg0..arg5, retval, registers, *argN:LEN, str(argN), a
    /// global variable, ustack) and `if OPERAND OP NUMBER`. E.g.
    /// --probe 'parse_request capture arg1 if arg1 > 4096'. Hits become
    /// PROBE and PROBE_RET events (`insight report probes`); each costs
    /// the replay two exits. Repeatable; the events go to TRACE/events.db
    /// unless --events names a file.
    #[arg(long, value_name = "SPEC", conflicts_with_all = ["gdb", "trace_process", "jobs", "segment", "from", "checkpoint_every"])]
    pub probe: Vec<String>,
    /// Probes from FILE, one spec per line (`#` starts a comment line).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["gdb", "trace_process", "jobs", "segment", "from", "checkpoint_every"])]
    pub probes_file: Option<PathBuf>,
    /// Replace an existing --events or --tx-pcap file even if it is not
    /// one insight wrote (never a device, link, directory, or a file of a
    /// trace).
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub capture: CaptureArgs,
    #[command(flatten)]
    pub window: WindowArgs,
    #[command(flatten)]
    pub tracing: TracingArgs,
}

/// What a replay collects into its event database, and how.
#[derive(clap::Args)]
#[command(next_help_heading = "Events and samples")]
pub struct CaptureArgs {
    /// Collect the events the guest raises (the probe library's, in
    /// programs recorded with `record --probes`, and the guest kernel's
    /// context switches and exits) into the event database FILE (SQLite,
    /// docs/events.md). It is written as FILE.partial.PID (this
    /// process's own) and renamed when replay ends, so concurrent replays
    /// into one FILE never damage it (the last to finish wins); an
    /// existing FILE is replaced only if it is an insight event database
    /// (see --force).
    #[arg(long, value_name = "FILE")]
    pub events: Option<PathBuf>,
    /// Also collect the heap events of programs recorded with --probes:
    /// HEAPCALL, ALLOC and FREE around each call to malloc, calloc,
    /// realloc, free, posix_memalign, aligned_alloc, memalign, mmap and
    /// munmap (docs/events.md). They name heap blocks by their allocation
    /// site in `insight report memory`, and cost this replay a copy into
    /// the event ring per event (an exit each with --event-exits); other
    /// replays skip them at no cost. On with --trace-process.
    #[arg(long)]
    pub heap_events: bool,
    /// Capture every probe event at a VM exit of its own, as insight did
    /// before the event ring: the events, their order and stacks are the
    /// same, the replay slower (one exit per event, ~75 us on nested
    /// hosts). For measuring what the ring saves (`tools/bench events`).
    #[arg(long)]
    pub event_exits: bool,
    /// How the database stores events: packed (compressed blocks, a few
    /// bytes per event; read them with `insight report`) or rows (one SQL
    /// row per event, about 37 bytes, for your own queries with sqlite3).
    #[arg(long, value_enum, default_value = "packed", value_name = "FORMAT")]
    pub events_format: EventsFormat,
    /// Sample the tracked task on the CPU (RIP and user stack) about every
    /// PERIOD, e.g. 1ms (the least), 5ms, 20ms; into the event database.
    /// Where the recording marked samples (`insight record
    /// --sample-period`, on by default) they are taken at its marks: every
    /// one at the recorded period, the first after each PERIOD of recorded
    /// time for a longer one; the same samples in every replay. Otherwise
    /// by this replay's host time. Tasks are tracked once they raise a
    /// probe event.
    #[arg(long, value_name = "PERIOD", value_parser = parse_period)]
    pub sample_period: Option<Duration>,
    /// Sample by this replay's host time even where the recording marked
    /// its samples (how insight sampled before it could mark them: two
    /// replays then give different samples, and a function slowed down by
    /// the replay's own work gets more of them). The marks then do not
    /// time events either: events between exits take the guest clock's
    /// last reading (docs/events.md, "Event times").
    #[arg(long)]
    pub replay_time_samples: bool,
    /// Of a chaos recording: also sample the task at each decision of its
    /// schedule (`insight dump --schedule`), tracked or not: its user
    /// position and stack, where `insight why` finds its source line.
    #[arg(long)]
    pub decision_samples: bool,
    /// How the user stacks of samples and lock events are found: cfi
    /// (the call-frame information of the guest's executables and
    /// libraries, their .eh_frame, as exceptions and `perf --call-graph
    /// dwarf` use it; whole stacks without frame pointers) or
    /// frame-pointers (samples follow RBP, lock events keep their caller
    /// only: for programs built with -fno-omit-frame-pointer, and to
    /// compare).
    #[arg(long, value_enum, default_value = "cfi", value_name = "HOW")]
    pub unwind: Unwind,
}

/// Where a replay starts and stops, its checkpoints, and replaying in segments.
#[derive(clap::Args)]
#[command(next_help_heading = "Checkpoints and windows")]
pub struct WindowArgs {
    /// Take a checkpoint (the whole VM state, docs/trace-format.md) every
    /// INTERVAL into TRACE/checkpoints, replacing those it had (or, with
    /// --from, those after the one restored): recorded guest time such as
    /// 2s or 500ms, or a number of deterministic exits such as 200000.
    /// Checkpoints land at the first exit after each interval where no
    /// disk request is in flight, at the same exits in every replay.
    #[arg(long, value_name = "INTERVAL", value_parser = parse_interval)]
    pub checkpoint_every: Option<CheckpointEvery>,
    /// Start from the trace's latest checkpoint at or before POS instead
    /// of booting: an exit ordinal (123456), recorded guest time (12s,
    /// 1500ms), or the first event of a kind, of one thread or any
    /// (first:lock:LWPID, first:threadcreate), as the trace's event
    /// database TRACE/events.db has it. Every exit from there on is
    /// checked as usual.
    #[arg(long, value_name = "POS", value_parser = parse_position)]
    pub from: Option<PositionArg>,
    /// Stop after POS (as for --from) instead of at the recording's end.
    /// A window ending at an event holds that event and nothing after it
    /// (the replay runs on to the next exit, storing no more events).
    #[arg(long, value_name = "POS", value_parser = parse_position)]
    pub to: Option<PositionArg>,
    /// List the trace's checkpoints (exit, guest time, size) and exit.
    #[arg(long)]
    pub list_checkpoints: bool,
    /// Replay segment K of N only: the trace's checkpoints (and boot)
    /// start the segments, split into N runs of about as many each; K
    /// runs from its first start to the next segment's. With --events,
    /// the database holds that span's events, numbered as in a whole
    /// replay; `insight events merge` joins the segments' databases.
    /// For running segments on several machines (docs/scale-out.md).
    #[arg(long, value_name = "K/N", value_parser = parse_segment, conflicts_with_all = ["from", "to", "jobs", "checkpoint_every"])]
    pub segment: Option<(usize, usize)>,
    /// Replay the segments between the trace's checkpoints N at a time, in
    /// separate processes, and join their events: the same database as one
    /// replay, samples at the recording's marks included, sooner. Needs
    /// checkpoints taken collecting the same events (--events, --unwind,
    /// --sample-period); others are taken again first, in one segment.
    /// Segments run on any host CPU (see --any-cpu), or they would all
    /// share the one the recording ran on; one that diverges there is
    /// replayed again on the recording's CPU.
    #[arg(long, value_name = "N", conflicts_with_all = ["from", "to", "checkpoint_every", "tx_pcap"])]
    pub jobs: Option<usize>,
    /// Run on any host CPU, not only one reporting the APIC ID the
    /// recording ran on. Guest user code reads CPUID without the host
    /// trapping it, so a program that starts in this replay and keeps the
    /// APIC ID CPUID gave it (glibc does) may differ from the recording;
    /// replay's checks then report a divergence, never a wrong result.
    #[arg(long)]
    pub any_cpu: bool,
}

/// Single-stepping one process for its instructions and memory accesses (docs/expansion.md).
#[derive(clap::Args)]
#[command(next_help_heading = "Tracing a process")]
pub struct TracingArgs {
    /// Single-step the user code of one process at replay: its pid, or the
    /// name of the program it executes (the first process to execute it),
    /// and write what it executed with --trace-instructions and the memory
    /// it read and wrote with --trace-memory (and as MEMACCESS events to
    /// --events). A pid is traced from the first exit it is on the CPU
    /// for, a name from its `execve` (`insight report threads` lists the
    /// pids of programs recorded with --probes). --diagnose memory traces
    /// the recorded command's program unless this names another. About
    /// 10,000 instructions a second on hosts without user-mode
    /// single-stepping: for short programs and windows
    /// (docs/expansion.md).
    #[arg(long, value_name = "PID|NAME", value_parser = parse_trace_target)]
    pub trace_process: Option<vmm::TraceTarget>,
    /// Write each user instruction the traced process executed (thread,
    /// address, bytes) to FILE, zstd-compressed (docs/expansion.md).
    #[arg(long, value_name = "FILE", requires = "trace_process")]
    pub trace_instructions: Option<PathBuf>,
    /// Also write each instruction's registers before it ran (the 16
    /// general-purpose registers and RFLAGS) in the --trace-instructions
    /// file: 136 bytes more per instruction before compression.
    #[arg(long, requires = "trace_instructions")]
    pub trace_registers: bool,
    /// Step every traced instruction in user mode, a debug exception and a
    /// VM exit each (~106 µs on nested hosts), instead of stepping the
    /// instructions KVM emulates in guest kernel mode (~10 µs): the traces
    /// are the same, this is slower (docs/expansion.md).
    #[arg(long, requires = "trace_process")]
    pub trace_by_traps: bool,
    /// Write each load and store of the traced process's user code to
    /// FILE, a line per access: kind (L, S or M for read-modify-write, as
    /// Valgrind's lackey), address, size, thread, instruction address.
    #[arg(long, value_name = "FILE", requires = "trace_process")]
    pub trace_memory: Option<PathBuf>,
}

/// `--trace-process`: a pid, or a process name.
pub fn parse_trace_target(text: &str) -> Result<vmm::TraceTarget, String> {
    if text.is_empty() {
        return Err("name a process: its pid or its name".into());
    }
    Ok(match text.parse::<u32>() {
        Ok(pid) => vmm::TraceTarget::Pid(pid),
        Err(_) => vmm::TraceTarget::Name(text.to_owned()),
    })
}

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

/// "500us", "1ms", "2s", "1000000ns".
const MIN_SAMPLE_PERIOD: Duration = Duration::from_millis(1);

pub fn parse_period(text: &str) -> Result<Duration, String> {
    let period = parse_duration(text)?;
    // The vCPU is woken for a sample at most once a millisecond.
    if period < MIN_SAMPLE_PERIOD {
        return Err(format!(
            "'{text}' is shorter than the least sampling period, 1ms"
        ));
    }
    Ok(period)
}

/// `--segment K/N`: segment K of N, K from 1 to N.
pub fn parse_segment(text: &str) -> Result<(usize, usize), String> {
    let parsed = text
        .split_once('/')
        .and_then(|(k, n)| Some((k.parse::<usize>().ok()?, n.parse::<usize>().ok()?)));
    match parsed {
        Some((k, n)) if k >= 1 && k <= n => Ok((k, n)),
        _ => Err(format!(
            "'{text}' is not a segment such as 2/4 (K from 1 to N)"
        )),
    }
}

pub fn parse_interval(text: &str) -> Result<CheckpointEvery, String> {
    let every = match text.parse::<u64>() {
        Ok(exits) => CheckpointEvery::Exits(exits),
        Err(_) => match parse_duration(text) {
            Ok(d) => CheckpointEvery::GuestNs(d.as_nanos() as u64),
            Err(_) => {
                return Err(format!(
                    "'{text}' is not an interval: a number of exits (200000) or guest time \
                     (2s, 500ms)"
                ))
            }
        },
    };
    match every {
        CheckpointEvery::Exits(0) | CheckpointEvery::GuestNs(0) => {
            Err("the interval between checkpoints must not be 0".into())
        }
        every => Ok(every),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use events::abi::Kind;
    use vmm::ReplayPoint;

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

    #[test]
    fn positions_intervals_and_segments_parse_or_say_why_not() {
        let at = |p| Ok(PositionArg::At(p));
        assert_eq!(parse_position("1234"), at(ReplayPoint::Exit(1234)));
        assert_eq!(
            parse_position("12s"),
            at(ReplayPoint::GuestNs(12_000_000_000))
        );
        assert!(parse_position("soon")
            .unwrap_err()
            .contains("not a position"));
        assert_eq!(
            parse_position("first:lock:77"),
            Ok(PositionArg::First {
                kind: Kind::Lock,
                lwpid: Some(77)
            })
        );
        assert_eq!(
            parse_position("first:THREADCREATE"),
            Ok(PositionArg::First {
                kind: Kind::ThreadCreate,
                lwpid: None
            })
        );
        assert!(parse_position("first:lok")
            .unwrap_err()
            .contains("not an event kind"));
        assert!(parse_position("first:lock:x")
            .unwrap_err()
            .contains("not a thread id"));
        assert_eq!(
            parse_interval("500ms"),
            Ok(CheckpointEvery::GuestNs(500_000_000))
        );
        assert_eq!(
            parse_interval("200000"),
            Ok(CheckpointEvery::Exits(200_000))
        );
        assert!(parse_interval("0").is_err());
        assert!(parse_interval("0s").is_err());
        assert_eq!(parse_segment("2/4"), Ok((2, 4)));
        for bad in ["0/4", "5/4", "2", "a/b", "2/"] {
            assert!(parse_segment(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_diagnose_help_names_every_plugin() {
        use clap::CommandFactory;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            replay: ReplayArgs,
        }
        let cmd = Cli::command();
        let arg = (cmd.get_arguments())
            .find(|a| a.get_id() == "diagnose")
            .expect("--diagnose");
        let help = (arg.get_long_help().or(arg.get_help()))
            .map(|h| h.to_string())
            .unwrap_or_default();
        for plugin in diagnosis::plugins::registry() {
            assert!(
                help.contains(plugin.name()),
                "--diagnose's help does not name {}",
                plugin.name()
            );
        }
    }
}
