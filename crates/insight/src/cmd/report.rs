//! `insight report`: the diagnosis tools over an event database, offline.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use diagnosis::plugin::{self, Output, Plugin};
use diagnosis::plugins::{self, deadlock, locks, memory, probes, profile, threads, timeline};
use events::db::EventDb;
use guestfiles::GuestFiles;

use crate::outputs::{self, OutputKind};
use crate::position::{self, PositionArg};
use crate::status::printable;
use crate::traces;
use vmm::ReplayPoint;

#[derive(clap::Args)]
pub struct ReportArgs {
    #[command(subcommand)]
    tool: Tool,
}

#[derive(clap::Subcommand)]
enum Tool {
    /// Lock contention per lock: requests, blocked requests, ownership
    /// changes, hold and wait times.
    #[command(
        long_about = "Lock contention per lock, modelled on mutrace, computed from \
the LOCK/TRYLOCK/TIMEDLOCK, their RET and UNLOCK events of an event database.\n\n\
Columns: requests (lock, trylock, timedlock calls); acquired (calls that returned 0); \
blocked (requests made while another thread held the lock) and their share of requests; \
changes (acquisitions by a thread other than the previous owner) and their share of \
acquisitions; contended (acquisitions that had been blocked); hold and wait times \
(total, average, maximum, in microseconds of the recorded run); trylock failures and \
timedlock timeouts. Locks are sorted by blocked requests, then wait time. A lock is \
named by its global variable where the program's symbols have one, otherwise by where \
pthread_mutex_init was called on it (\"init at make_queue+0x1c in prog (prog.c:40)\"), \
otherwise by its address alone.\n\n\
Example:\n  insight replay t1 --events t1.db && insight report locks t1.db --limit 5"
    )]
    Locks(LocksArgs),
    /// Where the sampled threads spent their time, per function.
    #[command(
        long_about = "Where the sampled threads spent their time: the share of \
SAMPLE events per function, overall and per thread, like `perf report`. Addresses are \
symbolized with the symbol tables of the guest's ELF files, read from the initramfs of the \
trace the database was replayed from (its digest is checked), and for stripped libraries \
(the guest's glibc) their debug files under --debug-dir.\n\n\
Samples are taken at replay with --sample-period (or --diagnose profile), only of threads \
of processes that raised a probe event (record them with `insight record --probes`). A \
sample taken in the guest kernel is named by the kernel's function, from the symbol table of \
the trace's kernel image (a vmlinux; object [kernel]); one taken as a thread enters or leaves \
the kernel counts as [kernel] time. The folded stacks show which user function kernel time \
served.\n\n\
Example:\n  insight replay t1 --events t1.db --sample-period 1ms\n  \
insight report profile t1.db --threads --folded t1.folded"
    )]
    Profile(ProfileArgs),
    /// Potential deadlocks: lock-order cycles between threads.
    #[command(
        long_about = "Potential deadlocks, found from the order in which threads \
took locks (lock trees after Agarwal and Stoller, as the InSight paper applies them), per \
process. A cycle of \"held A while taking B\" edges from different threads that could run \
at the same time is a potential deadlock, even if the run did not deadlock. Not reported: \
cycles through a lock a thread only took by trylock (it never waits there), failed \
trylock/timedlock calls, one thread's own edges, and threads ordered by creation or join. \
A cycle whose threads all hold a common gate lock is listed as protected by it.\n\n\
Each cycle is printed in the paper's notation, e.g. L1(T1) -> L2(T1) -> L2(T2) -> L1(T2) \
-> L1(T1), with the threads, the locks (named by their global variable where the symbol \
tables tell) and where each lock was taken. -o FILE also writes a self-contained HTML \
report.\n\n\
Example:\n  insight replay t1 --events t1.db && insight report deadlock t1.db -o t1.html"
    )]
    Deadlock(DeadlockArgs),
    /// Per thread: lifetime, context switches, samples, lock calls and
    /// time waiting in them.
    #[command(
        long_about = "Per thread of the processes that raised probe events: when it \
started and ended, how often it was switched in, its samples, its lock calls and the time \
it waited in them, from the context-switch, thread and lock events of an event database.\n\n\
Example:\n  insight replay t1 --events t1.db && insight report threads t1.db"
    )]
    Threads(PluginArgs),
    /// Per variable and heap block of a process traced at replay: loads,
    /// stores, read-modify-writes, uses after free; a page heat map.
    #[command(
        long_about = "Per variable and heap block of a process traced at replay (`insight replay TRACE --trace-process PID --trace-memory FILE`, docs/expansion.md), from the MEMACCESS and heap events of its event database: loads, stores, read-modify-writes and bytes. Global and static variables are named by the symbol tables of the objects the process loaded, heap blocks by their allocation site (malloc@function+0x1f, from the probe library's heap events: record with --probes), other memory by its page. An access to a heap block after it was freed is listed under \"Use after free\" with where the block was freed and the first such access; the allocator's own accesses (inside malloc, free ...) are counted apart. --svg FILE draws a heat map: a row per page, the accesses in the order made from left to right.\n\nExample:\n  insight replay t1 --trace-process 19 --trace-memory t1.mem\n  insight report memory t1 --svg t1-pages.svg"
    )]
    Memory(MemoryArgs),
    /// What the probes given at replay saw: calls per thread, histograms
    /// of captured values and of call durations, top stacks.
    #[command(
        long_about = "What the probes given at replay (`insight replay TRACE --probe SPEC`, \
docs/probes.md) saw, from the PROBE and PROBE_RET events of an event database. Per probe, \
named by its spec: its calls (hits whose condition held), per thread; for each integer it \
captured (arguments, the return value, registers, variables) the least, greatest and mean \
value and a log2 histogram, as bpftrace's hist() draws it; for a `return` probe the same of \
its calls' durations (duration_ns, the recording's guest time); for memory and strings the \
most frequent values; with `ustack` the most frequent call stacks. --csv prints one row per \
hit instead.\n\n\
Example:\n  insight replay t1 --probe 'parse_request capture arg1' --probe 'compress return'\n  \
insight report probes t1 --json"
    )]
    Probes(ProbesArgs),
    /// Threads, lock waits and holds, context switches and samples over
    /// time: Perfetto's JSON, or a page.
    #[command(
        long_about = "What every thread did over the recording's time, from the \
context-switch, lock, thread and SAMPLE events of an event database: when it ran, which lock \
it waited for and which it held (nested as taken), whose release woke it, where it started, \
ended and was sampled.\n\n\
-o FILE.json writes the Trace Event Format, which Perfetto's UI (ui.perfetto.dev, Open trace \
file) and chrome://tracing open: a track per guest thread with `wait L`, `hold L` and \
`failed L` slices carrying their call stacks, flow arrows from a release to the waiter it \
woke, instants for thread events and samples, and a CPU track of what the guest's vCPU ran. \
-o FILE.html writes one self-contained page (no network): a row per thread, wheel to zoom, \
drag to pan, hover for a slice's lock and stack, a lock filter. Both may be given. Times are \
the recorded run's guest time; locks are named as `report locks` names them.\n\n\
--from and --to cut a window: guest time since the VM started (28s, 28500ms; the summary \
says which the events cover) or the first event of a kind (first:lock, first:lock:LWPID). \
Slices crossing an edge are cut at it.\n\n\
Example:\n  insight replay t1 --diagnose timeline        # t1/events.timeline.json and .html\n  \
insight report timeline t1 -o t1.html --from first:lock --to 28500ms"
    )]
    Timeline(TimelineArgs),
    /// Any other tool: `insight report NAME [DB] [--trace DIR] [--json]`.
    #[command(external_subcommand)]
    Other(Vec<OsString>),
}

/// What every tool reads.
#[derive(clap::Args)]
struct ReportInput {
    /// Event database written by `insight replay --events`, or a trace (a
    /// directory or a recording's name) whose events.db `replay
    /// --diagnose` wrote; default: the latest recording's.
    db: Option<PathBuf>,
    /// The trace the database came from (default: the one it names), for
    /// the guest's ELF files (symbols).
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// Where detached debug files of stripped guest libraries are looked
    /// up by build ID (DIR/.build-id/xx/yyyy.debug). The guest's libraries
    /// are the host's Debian ones, so the host's debug packages name their
    /// internal functions (libc6-dbg for glibc).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_DEBUG_DIR)]
    debug_dir: PathBuf,
    /// Replace an existing output file (-o, --svg, --folded) even if it is
    /// not one insight wrote (never a device, link, directory, or a file
    /// of a trace).
    #[arg(long)]
    force: bool,
}

/// Where Debian installs detached debug files.
pub const DEFAULT_DEBUG_DIR: &str = "/usr/lib/debug";

#[derive(clap::Args)]
pub struct DeadlockArgs {
    #[command(flatten)]
    input: ReportInput,
    /// Also write the report as a self-contained HTML page to FILE.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    html: Option<PathBuf>,
    /// JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    input: ReportInput,
    /// Show at most this many functions (per thread with --threads).
    #[arg(long, default_value_t = 20, value_name = "N")]
    limit: usize,
    /// Also a profile per thread.
    #[arg(long)]
    threads: bool,
    /// User code only: the samples taken in the guest kernel (or entering
    /// or leaving it) left out, as a profile of a program alone is
    /// compared with perf's of it (`perf report --comm PROG` with kernel
    /// samples excluded).
    #[arg(long)]
    user: bool,
    /// Write folded stacks ("thread;caller;...;function COUNT" lines, the
    /// input of flame-graph tools) to FILE.
    #[arg(long, value_name = "FILE")]
    folded: Option<PathBuf>,
    /// Write a flame graph (SVG, opens in a browser) to FILE.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct LocksArgs {
    #[command(flatten)]
    input: ReportInput,
    /// Show at most this many locks.
    #[arg(long, default_value_t = 20, value_name = "N")]
    limit: usize,
    /// Only locks with at least this many blocked requests.
    #[arg(long, default_value_t = 0, value_name = "N")]
    min_blocked: u64,
    /// Also break each lock down per thread.
    #[arg(long)]
    threads: bool,
    /// Also show, per lock, the N call stacks whose contended acquisitions
    /// waited longest in all (whole stacks where the replay unwound them,
    /// the default; else the caller alone).
    #[arg(long, default_value_t = 0, value_name = "N")]
    stacks: usize,
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// CSV instead of a table.
    #[arg(long, conflicts_with = "json")]
    csv: bool,
}

#[derive(clap::Args)]
pub struct TimelineArgs {
    #[command(flatten)]
    input: ReportInput,
    /// Write the timeline to FILE: the Trace Event Format if it ends in
    /// .json (Perfetto, chrome://tracing), a page if in .html. Repeatable.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    outputs: Vec<PathBuf>,
    /// Start of the window shown: guest time (1500ms) or first:KIND[:LWPID].
    #[arg(long, value_name = "POS", value_parser = position::parse_position)]
    from: Option<PositionArg>,
    /// End of the window shown, as for --from.
    #[arg(long, value_name = "POS", value_parser = position::parse_position)]
    to: Option<PositionArg>,
    /// JSON instead of text (the summary; the timeline itself goes to -o).
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct MemoryArgs {
    #[command(flatten)]
    input: ReportInput,
    /// Write a heat map of the accesses per page over the trace (SVG,
    /// opens in a browser) to FILE.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// JSON instead of text (every variable, block and page).
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct ProbesArgs {
    #[command(flatten)]
    input: ReportInput,
    /// JSON instead of text.
    #[arg(long)]
    json: bool,
    /// One CSV row per hit (seq, time_ns, probe, event, pid, lwpid, the
    /// captured values as name=value separated by ';', bytes in hex).
    #[arg(long, conflicts_with = "json")]
    csv: bool,
}

/// Any plugin without options of its own: `insight report NAME DB`.
#[derive(clap::Parser)]
struct PluginArgs {
    #[command(flatten)]
    input: ReportInput,
    /// JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn report(args: ReportArgs) -> Result<ExitCode> {
    match args.tool {
        Tool::Locks(a) => {
            let options = locks::LocksOptions {
                limit: a.limit,
                min_blocked: a.min_blocked,
                threads: a.threads,
                stacks: a.stacks,
            };
            let out = run_one(Box::new(locks::Locks::new(options)), &a.input)?;
            if a.csv {
                print!("{}", printable(out.attachment("csv").unwrap_or_default()));
            } else {
                print_output(&out, a.json);
            }
        }
        Tool::Profile(a) => {
            let options = profile::ProfileOptions {
                limit: a.limit,
                threads: a.threads,
                user_only: a.user,
            };
            let out = run_one(Box::new(profile::Profile::new(options)), &a.input)?;
            print_output(&out, a.json);
            save(
                &out,
                OutputKind::Folded,
                a.folded.as_deref(),
                "folded stacks",
                a.input.force,
            )?;
            save(
                &out,
                OutputKind::Svg,
                a.svg.as_deref(),
                "flame graph",
                a.input.force,
            )?;
        }
        Tool::Deadlock(a) => {
            let out = run_one(Box::new(deadlock::Deadlock::new()), &a.input)?;
            print_output(&out, a.json);
            save(
                &out,
                OutputKind::Html,
                a.html.as_deref(),
                "HTML report",
                a.input.force,
            )?;
        }
        Tool::Threads(a) => {
            let out = run_one(Box::new(threads::Threads::new()), &a.input)?;
            print_output(&out, a.json);
        }
        Tool::Memory(a) => {
            let out = run_one(Box::new(memory::Memory::new()), &a.input)?;
            print_output(&out, a.json);
            save(
                &out,
                OutputKind::HeatMap,
                a.svg.as_deref(),
                "heat map",
                a.input.force,
            )?;
        }
        Tool::Probes(a) => {
            let out = run_one(Box::new(probes::Probes::new()), &a.input)?;
            if a.csv {
                print!("{}", printable(out.attachment("csv").unwrap_or_default()));
            } else {
                print_output(&out, a.json);
            }
        }
        Tool::Timeline(a) => {
            let db = traces::events_db(a.input.db.as_deref(), "timeline")?;
            let window = timeline_window(&db, a.from, a.to)?;
            let kinds: Vec<(OutputKind, &str)> = a
                .outputs
                .iter()
                .map(|path| timeline_kind(path))
                .collect::<Result<_>>()?;
            for (path, (kind, _)) in a.outputs.iter().zip(&kinds) {
                outputs::check(path, *kind, a.input.force)?;
            }
            let plugin = Box::new(timeline::Timeline::new(window));
            let mut outs = run_plugins(
                vec![plugin],
                &db,
                a.input.trace.as_deref(),
                &a.input.debug_dir,
            )?;
            let out = outs.remove(0);
            print_output(&out, a.json);
            for (path, (kind, format)) in a.outputs.iter().zip(kinds) {
                save(&out, kind, Some(path), format, a.input.force)?;
            }
        }
        Tool::Other(argv) => {
            let Some(name) = argv.first().and_then(|n| n.to_str()) else {
                bail!("which tool? {}", tool_list());
            };
            let Some(plugin) = plugins::by_name(name) else {
                bail!("no diagnosis tool '{name}': {}", tool_list());
            };
            let mut full: Vec<OsString> = vec![format!("insight report {name}").into()];
            full.extend(argv.iter().skip(1).cloned());
            let a = <PluginArgs as clap::Parser>::try_parse_from(full).unwrap_or_else(|e| e.exit());
            let out = run_one(plugin, &a.input)?;
            print_output(&out, a.json);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// "tools: locks (...), ...".
pub fn tool_list() -> String {
    let names: Vec<String> = plugins::registry()
        .iter()
        .map(|p| format!("{} ({})", p.name(), p.about()))
        .collect();
    format!("the tools are {}", names.join("; "))
}

/// The name of a built-in tool, for `--diagnose`.
pub fn parse_tool(name: &str) -> Result<String, String> {
    match plugins::by_name(name) {
        Some(_) => Ok(name.to_owned()),
        None => Err(tool_list()),
    }
}

fn print_output(out: &Output, json: bool) {
    match (&out.json, json) {
        (Some(doc), true) => println!("{doc}"),
        // Thread names, paths and symbols come from the guest.
        _ => print!("{}", printable(&out.text)),
    }
}

/// Writes the plugin's attachment of `kind` (`what`, for the message) to
/// `path`, if given.
fn save(
    out: &Output,
    kind: OutputKind,
    path: Option<&Path>,
    what: &str,
    force: bool,
) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let format = match kind {
        OutputKind::Html => "html",
        OutputKind::Svg | OutputKind::HeatMap => "svg",
        OutputKind::Timeline => "json",
        _ => "folded",
    };
    outputs::check(path, kind, force)?;
    write_attachment(out, format, path, what)
}

/// Writes the plugin's attachment of `format` to `path` (checked already)
/// and says so, calling it `what`.
fn write_attachment(out: &Output, format: &str, path: &Path, what: &str) -> Result<()> {
    let content = out.attachment(format).unwrap_or_default();
    std::fs::write(path, content).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("insight: {what} written to {}", path.display());
    Ok(())
}

/// What `-o PATH` of the timeline writes, by its extension, and what the
/// message calls it.
fn timeline_kind(path: &Path) -> Result<(OutputKind, &'static str)> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("json") => Ok((OutputKind::Timeline, "timeline (Trace Event Format)")),
        Some("html" | "htm") => Ok((OutputKind::Html, "timeline page")),
        _ => bail!(
            "{}: a timeline is written as FILE.json (Perfetto, chrome://tracing) or FILE.html \
             (a page)",
            path.display()
        ),
    }
}

/// The window of the recorded time `--from`/`--to` name, in nanoseconds;
/// `None` for the whole.
fn timeline_window(
    db: &Path,
    from: Option<PositionArg>,
    to: Option<PositionArg>,
) -> Result<Option<timeline::model::Window>> {
    let ns = |p: Option<PositionArg>, flag: &str| -> Result<Option<u64>> {
        Ok(match p {
            None => None,
            Some(PositionArg::At(ReplayPoint::GuestNs(ns))) => Some(ns),
            Some(PositionArg::At(_)) => bail!(
                "{flag}: an event database does not know exits; give guest time (1500ms) or \
                 an event (first:lock)"
            ),
            Some(PositionArg::First { kind, lwpid }) => {
                Some(position::first_event_time(db, kind, lwpid)?)
            }
        })
    };
    let (from, to) = (ns(from, "--from")?, ns(to, "--to")?);
    if from.is_none() && to.is_none() {
        return Ok(None);
    }
    let window = timeline::model::Window {
        from: from.unwrap_or(0),
        to: to.unwrap_or(u64::MAX),
    };
    if window.to < window.from {
        bail!("--to comes before --from: the window is empty");
    }
    Ok(Some(window))
}

fn run_one(plugin: Box<dyn Plugin>, input: &ReportInput) -> Result<Output> {
    let db = traces::events_db(input.db.as_deref(), plugin.name())?;
    let mut outs = run_plugins(vec![plugin], &db, input.trace.as_deref(), &input.debug_dir)?;
    Ok(outs.remove(0))
}

/// Runs `plugins` over the database at `db` (one pass), with the guest's
/// files of `trace` (default: the trace the database names) and the debug
/// files under `debug_dir` for symbols. Warnings go to standard error.
pub fn run_plugins(
    mut plugins: Vec<Box<dyn Plugin>>,
    db: &Path,
    trace: Option<&Path>,
    debug_dir: &Path,
) -> Result<Vec<Output>> {
    let events = EventDb::open(db)?;
    let (files, files_missing) = match files_of_events(&events, trace, debug_dir) {
        Ok(f) => (f, None),
        Err(e) => (GuestFiles::default(), Some(crate::exit::error_chain(&e))),
    };
    let cx = plugin::PluginContext {
        db: &events,
        files: &files,
        files_missing,
        label: db.display().to_string(),
    };
    let outs = plugin::run(&mut plugins, &cx)?;
    for w in outs.iter().flat_map(|o| &o.warnings) {
        eprintln!("insight: {w}");
    }
    Ok(outs)
}

/// The guest's files of the trace `events` came from (or `trace`), with
/// the debug files under `debug_dir` of the objects its processes loaded.
pub fn files_of_events(
    events: &EventDb,
    trace: Option<&Path>,
    debug_dir: &Path,
) -> Result<GuestFiles> {
    let mut files = guest_files(events, trace)?;
    let paths = events.object_paths()?;
    files.add_debug_files(debug_dir, paths.iter().map(String::as_str));
    Ok(files)
}

/// The guest's files, from the initramfs of the trace `db` came from.
fn guest_files(db: &EventDb, trace: Option<&Path>) -> Result<GuestFiles> {
    let trace_dir = match trace {
        Some(t) => t.to_owned(),
        None => db.meta("trace")?.map(PathBuf::from).with_context(|| {
            format!(
                "{} does not name its trace: pass --trace DIR",
                db.path().display()
            )
        })?,
    };
    let reader = trace::TraceReader::<journal::Entry>::open(&trace_dir)
        .with_context(|| format!("cannot open trace {}", trace_dir.display()))?;
    traces::guest_files(&reader.header, &trace_dir)
}

/// Runs the diagnosis `tools` over the event database at `path` and
/// prints what they found.
pub fn diagnose(tools: Vec<Box<dyn Plugin>>, path: &Path) -> Result<()> {
    if tools.is_empty() {
        return Ok(());
    }
    let beside: Vec<(&str, &[&str])> = tools
        .iter()
        .map(|t| (t.name(), t.beside_events()))
        .collect();
    let outs = run_plugins(tools, path, None, Path::new(DEFAULT_DEBUG_DIR))?;
    for (i, (out, (name, formats))) in outs.iter().zip(beside).enumerate() {
        if i > 0 {
            println!();
        }
        print!("{}", printable(&out.text));
        for format in formats {
            let file = traces::beside_events(path, name, format);
            let (kind, what) = timeline_kind(&file)?;
            // Never over a file insight did not write: said, and the
            // other outputs go on.
            if let Err(e) = outputs::check(&file, kind, false) {
                eprintln!(
                    "insight: {name} not written: {}",
                    crate::exit::error_chain(&e)
                );
                continue;
            }
            write_attachment(out, format, &file, what)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeline_is_json_or_a_page_by_its_name() {
        assert_eq!(
            timeline_kind(Path::new("t.json")).unwrap().0,
            OutputKind::Timeline
        );
        assert_eq!(
            timeline_kind(Path::new("t.html")).unwrap().0,
            OutputKind::Html
        );
        let err = timeline_kind(Path::new("t.svg")).unwrap_err().to_string();
        assert!(
            err.contains("FILE.json") && err.contains("FILE.html"),
            "{err}"
        );
    }

    #[test]
    fn timeline_windows_are_guest_times_in_order() {
        let db = Path::new("unused.db");
        let at = |text: &str| Some(position::parse_position(text).unwrap());
        assert_eq!(timeline_window(db, None, None).unwrap(), None);
        let w = timeline_window(db, at("1s"), at("1500ms"))
            .unwrap()
            .unwrap();
        assert_eq!((w.from, w.to), (1_000_000_000, 1_500_000_000));
        let w = timeline_window(db, None, at("2s")).unwrap().unwrap();
        assert_eq!((w.from, w.to), (0, 2_000_000_000));
        let err = timeline_window(db, at("2s"), at("1s"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--to comes before --from"), "{err}");
        let err = timeline_window(db, at("12345"), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not know exits"), "{err}");
    }
}
