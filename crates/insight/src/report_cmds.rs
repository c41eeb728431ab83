//! `insight report`: the diagnosis tools over an event database, offline.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use diagnosis::contention::{self, ContentionReport, Durations, LockStats};
use diagnosis::deadlock::{self, Cycle};
use diagnosis::from_db;
use diagnosis::profile::ProfileRow;
use diagnosis::symbols::{GuestFiles, Symbolizer};
use events::abi::Kind;
use events::db::EventDb;

#[derive(clap::Args)]
pub struct ReportArgs {
    #[command(subcommand)]
    tool: Tool,
}

/// The diagnosis tools `insight replay --diagnose` can run too.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum ToolName {
    /// Lock contention (`insight report locks`).
    Locks,
    /// The function profile of the sampled threads (`insight report
    /// profile`); samples every 1 ms unless --sample-period says otherwise.
    Profile,
    /// Potential deadlocks from lock order (`insight report deadlock`).
    Deadlock,
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
timedlock timeouts. Locks are sorted by blocked requests, then wait time.\n\n\
Example:\n  insight replay t1 --events t1.db && insight report locks t1.db --limit 5"
    )]
    Locks(LocksArgs),
    /// Where the sampled threads spent their time, per function.
    #[command(
        long_about = "Where the sampled threads spent their time: the share of \
SAMPLE events per function, overall and per thread, like `perf report`. Addresses are \
symbolized with the symbol tables of the guest's ELF files, read from the initramfs of the \
trace the database was replayed from (its digest is checked).\n\n\
Samples are taken at replay with --sample-period (or --diagnose profile), only of threads \
of processes that raised a probe event (run them with the probe library preloaded).\n\n\
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
}

#[derive(clap::Args)]
pub struct DeadlockArgs {
    /// Event database written by `insight replay --events`.
    db: PathBuf,
    /// The trace the database came from (default: the one it names), for
    /// symbols.
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// Also write the report as a self-contained HTML page to FILE.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    html: Option<PathBuf>,
}

impl DeadlockArgs {
    /// The default report of `insight replay --diagnose deadlock`.
    pub fn for_replay(db: PathBuf) -> Self {
        DeadlockArgs {
            db,
            trace: None,
            html: None,
        }
    }
}

#[derive(clap::Args)]
pub struct ProfileArgs {
    /// Event database written by `insight replay --events`.
    db: PathBuf,
    /// The trace the database came from (default: the one it names).
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// Show at most this many functions (per thread with --threads).
    #[arg(long, default_value_t = 20, value_name = "N")]
    limit: usize,
    /// Also a profile per thread.
    #[arg(long)]
    threads: bool,
    /// Write folded stacks ("thread;caller;...;function COUNT" lines, the
    /// input of flame-graph tools) to FILE.
    #[arg(long, value_name = "FILE")]
    folded: Option<PathBuf>,
}

impl ProfileArgs {
    /// The default report of `insight replay --diagnose profile`.
    pub fn for_replay(db: PathBuf) -> Self {
        ProfileArgs {
            db,
            trace: None,
            limit: 20,
            threads: false,
            folded: None,
        }
    }
}

#[derive(clap::Args)]
pub struct LocksArgs {
    /// Event database written by `insight replay --events`.
    db: PathBuf,
    /// The trace the database came from (default: the one it names), to
    /// name locks by their global variables.
    #[arg(long, value_name = "DIR")]
    trace: Option<PathBuf>,
    /// Show at most this many locks.
    #[arg(long, default_value_t = 20, value_name = "N")]
    limit: usize,
    /// Only locks with at least this many blocked requests.
    #[arg(long, default_value_t = 0, value_name = "N")]
    min_blocked: u64,
    /// Also break each lock down per thread.
    #[arg(long)]
    threads: bool,
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// CSV instead of a table.
    #[arg(long, conflicts_with = "json")]
    csv: bool,
}

impl LocksArgs {
    /// The default report of `insight replay --diagnose locks`.
    pub fn for_replay(db: PathBuf) -> Self {
        LocksArgs {
            db,
            trace: None,
            limit: 20,
            min_blocked: 0,
            threads: false,
            json: false,
            csv: false,
        }
    }
}

pub fn report(args: ReportArgs) -> Result<ExitCode> {
    match args.tool {
        Tool::Locks(a) => locks(&a),
        Tool::Profile(a) => profile(&a),
        Tool::Deadlock(a) => deadlock(&a),
    }
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
    let reader = trace::TraceReader::<vmm::journal::Event>::open(&trace_dir)
        .with_context(|| format!("cannot open trace {}", trace_dir.display()))?;
    let spec = vmm::guest::from_trace(&reader.header)
        .with_context(|| format!("cannot read the guest files of {}", trace_dir.display()))?;
    Ok(GuestFiles::from_initramfs(&spec.initramfs))
}

/// One cycle, described for people.
struct CycleText {
    notation: String,
    threads: String,
    locks: String,
    steps: Vec<String>,
    gates: String,
}

fn describe_cycle(
    c: &Cycle,
    pid: u32,
    sym: &mut Symbolizer,
    names: &HashMap<u32, String>,
) -> CycleText {
    let mut lwpids: Vec<u32> = c.steps.iter().map(|s| s.thread).collect();
    lwpids.sort_unstable();
    lwpids.dedup();
    let t = |lwpid: u32| {
        format!(
            "T{}",
            lwpids.iter().position(|&l| l == lwpid).unwrap_or(0) + 1
        )
    };
    let mut locks: Vec<u64> = Vec::new();
    for s in &c.steps {
        for l in [s.held, s.acquired] {
            if !locks.contains(&l) {
                locks.push(l);
            }
        }
    }
    let mut lock_names: HashMap<u64, String> = HashMap::new();
    for (i, l) in locks.iter().enumerate() {
        let name = sym
            .variable(pid, *l)
            .unwrap_or_else(|| format!("L{}", i + 1));
        lock_names.insert(*l, name);
    }
    let mut gates: Vec<u64> = c.gates.iter().copied().collect();
    gates.sort_unstable();
    for g in &gates {
        let name = sym.variable(pid, *g).unwrap_or_else(|| format!("G{g:#x}"));
        lock_names.insert(*g, name);
    }
    let name = |l: u64| {
        lock_names
            .get(&l)
            .cloned()
            .unwrap_or_else(|| format!("{l:#x}"))
    };
    let mut parts = Vec::new();
    for s in &c.steps {
        parts.push(format!("{}({})", name(s.held), t(s.thread)));
        parts.push(format!("{}({})", name(s.acquired), t(s.thread)));
    }
    if let Some(first) = parts.first().cloned() {
        parts.push(first);
    }
    let threads = lwpids
        .iter()
        .map(|&l| {
            let comm = names.get(&l).map(|n| format!(" ({n})")).unwrap_or_default();
            format!("{} = thread {l}{comm}", t(l))
        })
        .collect::<Vec<_>>()
        .join(", ");
    let locks_text = locks
        .iter()
        .map(|&l| format!("{} = {l:#x}", name(l)))
        .collect::<Vec<_>>()
        .join(", ");
    let steps = c
        .steps
        .iter()
        .map(|s| {
            let at = if s.site == 0 {
                String::new()
            } else {
                format!(" at {}", sym.describe_code(pid, s.site.saturating_sub(1)))
            };
            format!(
                "{} holds {} while taking {}{at}",
                t(s.thread),
                name(s.held),
                name(s.acquired)
            )
        })
        .collect();
    CycleText {
        notation: parts.join(" -> "),
        threads,
        locks: locks_text,
        steps,
        gates: gates
            .iter()
            .map(|&g| name(g))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

pub fn deadlock(args: &DeadlockArgs) -> Result<ExitCode> {
    let db = open(&args.db)?;
    let files = match guest_files(&db, args.trace.as_deref()) {
        Ok(f) => f,
        Err(e) => {
            eprintln!(
                "insight: addresses are not symbolized: {}",
                crate::cli::error_chain(&e)
            );
            GuestFiles::default()
        }
    };
    let names: HashMap<u32, String> = db
        .threads()?
        .into_iter()
        .map(|(_, lwpid, comm)| (lwpid, comm))
        .collect();
    let mut sym = Symbolizer::new(&files);
    let mut text = String::new();
    let mut html = String::new();
    let (mut deadlocks, mut protected) = (0, 0);
    for (pid, events) in from_db::deadlock_events(&db)? {
        let report = deadlock::analyze(&events);
        if report.deadlocks.is_empty() && report.protected.is_empty() {
            continue;
        }
        let objects = db.objects(pid)?;
        // The program is the first object a process reports.
        let process = match objects.first() {
            Some((_, path)) => format!(" ({})", path.rsplit('/').next().unwrap_or(path)),
            None => names
                .get(&pid)
                .map(|comm| format!(" ({comm})"))
                .unwrap_or_default(),
        };
        sym.add_process(pid, objects);
        let _ = writeln!(text, "Process {pid}{process}");
        let _ = writeln!(html, "<h2>Process {pid}{}</h2>", html_escape(&process));
        let groups = [
            ("Potential deadlock", &report.deadlocks),
            ("Protected by a gate lock", &report.protected),
        ];
        for (title, cycles) in groups {
            for (i, c) in cycles.iter().enumerate() {
                let d = describe_cycle(c, pid, &mut sym, &names);
                let gate = if d.gates.is_empty() {
                    String::new()
                } else {
                    format!(" (gate: {})", d.gates)
                };
                let _ = writeln!(text, "  {title} {}{gate}: {}", i + 1, d.notation);
                let _ = writeln!(text, "    {}", d.threads);
                let _ = writeln!(text, "    {}", d.locks);
                for step in &d.steps {
                    let _ = writeln!(text, "    {step}");
                }
                let _ = writeln!(
                    html,
                    "<div class=\"cycle{}\"><h3>{title} {}{}</h3><p class=\"notation\">{}</p>\
                     <p>{}<br>{}</p><ul>{}</ul></div>",
                    if c.is_protected() { " protected" } else { "" },
                    i + 1,
                    html_escape(&gate),
                    html_escape(&d.notation),
                    html_escape(&d.threads),
                    html_escape(&d.locks),
                    d.steps
                        .iter()
                        .map(|s| format!("<li>{}</li>", html_escape(s)))
                        .collect::<String>()
                );
            }
        }
        deadlocks += report.deadlocks.len();
        protected += report.protected.len();
    }
    let summary = format!(
        "{} potential deadlock{}, {} cycle{} protected by a gate lock",
        deadlocks,
        if deadlocks == 1 { "" } else { "s" },
        protected,
        if protected == 1 { "" } else { "s" }
    );
    println!("Lock-order analysis of {}: {summary}", args.db.display());
    if !text.is_empty() {
        print!("\n{text}");
    }
    if let Some(path) = &args.html {
        let page = format!(
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">\
             <title>insight: potential deadlocks</title><style>\
             body{{font-family:sans-serif;margin:2em;max-width:60em}}\
             .notation{{font-family:monospace;font-size:1.1em}}\
             .cycle{{border-left:4px solid #c0392b;padding-left:1em;margin:1em 0}}\
             .cycle.protected{{border-color:#7f8c8d}}</style></head><body>\
             <h1>Potential deadlocks</h1><p>{} &mdash; {}</p>{}</body></html>\n",
            html_escape(&args.db.display().to_string()),
            html_escape(&summary),
            if html.is_empty() {
                "<p>No lock-order cycles.</p>".to_owned()
            } else {
                html
            }
        );
        std::fs::write(path, page).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("insight: HTML report written to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

pub fn profile(args: &ProfileArgs) -> Result<ExitCode> {
    let db = open(&args.db)?;
    let files = guest_files(&db, args.trace.as_deref())?;
    let p = diagnosis::profile::profile(&db, &files)?;
    if p.samples == 0 {
        println!(
            "No SAMPLE events in {}: replay with --sample-period (threads are sampled once \
             their process raised a probe event).",
            args.db.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "Profile of {}: {} samples ({} in the guest kernel)\n",
        args.db.display(),
        p.samples,
        p.kernel
    );
    print!("{}", profile_table(&p.rows, p.samples, args.limit));
    if args.threads {
        for t in &p.threads {
            println!(
                "\nThread {} (pid {}, {}): {} samples",
                t.lwpid, t.pid, t.comm, t.samples
            );
            print!("{}", profile_table(&t.rows, t.samples, args.limit));
        }
    }
    if let Some(path) = &args.folded {
        let mut text = String::new();
        for (stack, n) in &p.folded {
            let _ = writeln!(text, "{stack} {n}");
        }
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("insight: folded stacks written to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn profile_table(rows: &[ProfileRow], total: u64, limit: usize) -> String {
    let mut out = format!(
        "{:>8}  {:>8}  {:<32}  {}\n",
        "share", "samples", "object", "function"
    );
    for r in rows.iter().take(limit) {
        let share = if total == 0 {
            0.0
        } else {
            100.0 * r.samples as f64 / total as f64
        };
        let object = r.location.object.rsplit('/').next().unwrap_or("");
        let _ = writeln!(
            out,
            "{:>7.2}%  {:>8}  {:<32}  {}",
            share, r.samples, object, r.location.function
        );
    }
    out
}

pub fn locks(args: &LocksArgs) -> Result<ExitCode> {
    let db = open(&args.db)?;
    let events = diagnosis::from_db::lock_events(&db)?;
    let report = contention::analyze(&events);
    let ranked: Vec<(u64, &LockStats)> = report
        .ranked(usize::MAX)
        .into_iter()
        .filter(|(_, s)| s.blocked >= args.min_blocked)
        .take(args.limit)
        .collect();
    let names = lock_names(&db, args.trace.as_deref())?;
    let out = if args.json {
        locks_json(&report, &ranked, &names, args.threads)
    } else if args.csv {
        locks_csv(&report, &ranked, &names, args.threads)
    } else {
        let mut text = format!(
            "Lock contention in {}: {} locks, {} lock events; times in µs of the recorded run\n\n",
            args.db.display(),
            report.locks.len(),
            events.len()
        );
        text.push_str(&locks_table(&report, &ranked, &names, args.threads));
        text
    };
    print!("{out}");
    let a = report.anomalies;
    let inconsistent =
        a.release_without_hold + a.return_without_request + a.acquired_while_held + a.out_of_order;
    if inconsistent > 0 && !args.json && !args.csv {
        eprintln!(
            "insight: {inconsistent} lock events contradict the lock model and were not counted \
             ({} releases without a hold, {} returns without a request, {} acquisitions of a \
             held lock, {} out of order)",
            a.release_without_hold, a.return_without_request, a.acquired_while_held, a.out_of_order
        );
    }
    for (what, n, example) in db.anomalies()? {
        eprintln!("insight: the capture counted {n}× {what} (first: {example})");
    }
    Ok(ExitCode::SUCCESS)
}

/// Lock address -> its global variable ("level2+0x28"), where the symbol
/// tables of the process that first used it tell. Empty when the guest's
/// files cannot be read (said once on standard error).
fn lock_names(db: &EventDb, trace: Option<&Path>) -> Result<HashMap<u64, String>> {
    let files = match guest_files(db, trace) {
        Ok(f) => f,
        Err(e) => {
            eprintln!(
                "insight: locks are not named: {}",
                crate::cli::error_chain(&e)
            );
            return Ok(HashMap::new());
        }
    };
    let mut first_user: HashMap<u64, u32> = HashMap::new();
    db.for_each(&[Kind::Lock, Kind::TryLock, Kind::TimedLock], |r| {
        if let Some(lock) = r.addr {
            first_user.entry(lock).or_insert(r.pid);
        }
        Ok(())
    })?;
    let mut sym = Symbolizer::new(&files);
    let mut pids: Vec<u32> = first_user.values().copied().collect();
    pids.sort_unstable();
    pids.dedup();
    for pid in pids {
        sym.add_process(pid, db.objects(pid)?);
    }
    Ok(first_user
        .into_iter()
        .filter_map(|(lock, pid)| Some((lock, sym.variable(pid, lock)?)))
        .collect())
}

fn open(path: &Path) -> Result<EventDb> {
    Ok(EventDb::open(path)?)
}

fn us(ns: u64) -> String {
    format!("{:.1}", ns as f64 / 1000.0)
}

fn times(d: &Durations) -> String {
    format!("{}/{}/{}", us(d.total), us(d.avg()), us(d.max))
}

const COLUMNS: [&str; 10] = [
    "requests",
    "acquired",
    "blocked",
    "%",
    "changes",
    "%",
    "contended",
    "hold tot/avg/max",
    "wait tot/avg/max",
    "try-fail/timeout",
];

fn cells(s: &LockStats) -> [String; 10] {
    [
        s.requests.to_string(),
        s.acquisitions.to_string(),
        s.blocked.to_string(),
        format!("{:.2}", s.blocked_percent()),
        s.ownership_changes.to_string(),
        format!("{:.2}", s.ownership_change_percent()),
        s.contended.to_string(),
        times(&s.hold),
        times(&s.wait),
        format!("{}/{}", s.trylock_failures, s.timedlock_timeouts),
    ]
}

/// Per-thread rows of `lock`, by thread id.
fn thread_rows(report: &ContentionReport, lock: u64) -> Vec<(u32, &LockStats)> {
    let mut rows: Vec<(u32, &LockStats)> = report
        .per_thread
        .iter()
        .filter(|((l, _), _)| *l == lock)
        .map(|((_, t), s)| (*t, s))
        .collect();
    rows.sort_by_key(|(t, _)| *t);
    rows
}

fn locks_table(
    report: &ContentionReport,
    ranked: &[(u64, &LockStats)],
    names: &HashMap<u64, String>,
    threads: bool,
) -> String {
    let mut rows: Vec<(String, [String; 10])> = Vec::new();
    for (lock, s) in ranked {
        let label = match names.get(lock) {
            Some(name) => format!("{lock:#x} {name}"),
            None => format!("{lock:#x}"),
        };
        rows.push((label, cells(s)));
        if threads {
            for (t, ts) in thread_rows(report, *lock) {
                rows.push((format!("  lwpid {t}"), cells(ts)));
            }
        }
    }
    let mut widths: Vec<usize> = COLUMNS.iter().map(|c| c.len()).collect();
    let mut first = "lock".len();
    for (name, c) in &rows {
        first = first.max(name.len());
        for (w, v) in widths.iter_mut().zip(c) {
            *w = (*w).max(v.len());
        }
    }
    let mut out = format!("{:<first$}", "lock");
    for (c, w) in COLUMNS.iter().zip(&widths) {
        let _ = write!(out, "  {c:>w$}");
    }
    out.push('\n');
    for (name, c) in &rows {
        let _ = write!(out, "{name:<first$}");
        for (v, w) in c.iter().zip(&widths) {
            let _ = write!(out, "  {v:>w$}");
        }
        out.push('\n');
    }
    if ranked.is_empty() {
        out.push_str("(no lock events)\n");
    }
    out
}

fn locks_csv(
    report: &ContentionReport,
    ranked: &[(u64, &LockStats)],
    names: &HashMap<u64, String>,
    threads: bool,
) -> String {
    let mut out = String::from(
        "lock,name,lwpid,requests,acquired,blocked,blocked_percent,ownership_changes,\
         ownership_change_percent,contended,hold_total_ns,hold_avg_ns,hold_max_ns,\
         wait_total_ns,wait_avg_ns,wait_max_ns,trylock_failures,timedlock_timeouts\n",
    );
    let mut line = |lock: u64, thread: Option<u32>, s: &LockStats| {
        let _ = writeln!(
            out,
            "{lock:#x},{},{},{},{},{},{:.4},{},{:.4},{},{},{},{},{},{},{},{},{}",
            names.get(&lock).map(String::as_str).unwrap_or(""),
            thread.map(|t| t.to_string()).unwrap_or_default(),
            s.requests,
            s.acquisitions,
            s.blocked,
            s.blocked_percent(),
            s.ownership_changes,
            s.ownership_change_percent(),
            s.contended,
            s.hold.total,
            s.hold.avg(),
            s.hold.max,
            s.wait.total,
            s.wait.avg(),
            s.wait.max,
            s.trylock_failures,
            s.timedlock_timeouts
        );
    };
    for (lock, s) in ranked {
        line(*lock, None, s);
        if threads {
            for (t, ts) in thread_rows(report, *lock) {
                line(*lock, Some(t), ts);
            }
        }
    }
    out
}

fn stats_json(s: &LockStats) -> serde_json::Value {
    let d = |d: &Durations| serde_json::json!({"total_ns": d.total, "avg_ns": d.avg(), "max_ns": d.max});
    serde_json::json!({
        "requests": s.requests,
        "acquisitions": s.acquisitions,
        "blocked": s.blocked,
        "blocked_percent": s.blocked_percent(),
        "ownership_changes": s.ownership_changes,
        "ownership_change_percent": s.ownership_change_percent(),
        "contended": s.contended,
        "trylock_failures": s.trylock_failures,
        "timedlock_timeouts": s.timedlock_timeouts,
        "hold": d(&s.hold),
        "wait": d(&s.wait),
    })
}

fn locks_json(
    report: &ContentionReport,
    ranked: &[(u64, &LockStats)],
    names: &HashMap<u64, String>,
    threads: bool,
) -> String {
    let locks: Vec<serde_json::Value> = ranked
        .iter()
        .map(|(lock, s)| {
            let mut v = stats_json(s);
            v["lock"] = serde_json::json!(format!("{lock:#x}"));
            v["name"] = serde_json::json!(names.get(lock));
            if threads {
                v["threads"] = thread_rows(report, *lock)
                    .into_iter()
                    .map(|(t, ts)| {
                        let mut tv = stats_json(ts);
                        tv["lwpid"] = serde_json::json!(t);
                        tv
                    })
                    .collect();
            }
            v
        })
        .collect();
    let a = report.anomalies;
    let doc = serde_json::json!({
        "locks": locks,
        "anomalies": {
            "release_without_hold": a.release_without_hold,
            "return_without_request": a.return_without_request,
            "acquired_while_held": a.acquired_while_held,
            "out_of_order": a.out_of_order,
        },
    });
    format!("{doc}\n")
}
