//! `insight report`: the diagnosis tools over an event database, offline.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use diagnosis::contention::{self, ContentionReport, Durations, LockStats};
use diagnosis::profile::ProfileRow;
use diagnosis::symbols::GuestFiles;
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
    }
}

pub fn profile(args: &ProfileArgs) -> Result<ExitCode> {
    let db = open(&args.db)?;
    let trace_dir = match &args.trace {
        Some(t) => t.clone(),
        None => db.meta("trace")?.map(PathBuf::from).with_context(|| {
            format!(
                "{} does not name its trace: pass --trace DIR",
                args.db.display()
            )
        })?,
    };
    let reader = trace::TraceReader::<vmm::journal::Event>::open(&trace_dir)
        .with_context(|| format!("cannot open trace {}", trace_dir.display()))?;
    let spec = vmm::guest::from_trace(&reader.header)
        .with_context(|| format!("cannot read the guest files of {}", trace_dir.display()))?;
    let files = GuestFiles::from_initramfs(&spec.initramfs);
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
    let out = if args.json {
        locks_json(&report, &ranked, args.threads)
    } else if args.csv {
        locks_csv(&report, &ranked, args.threads)
    } else {
        let mut text = format!(
            "Lock contention in {}: {} locks, {} lock events; times in µs of the recorded run\n\n",
            args.db.display(),
            report.locks.len(),
            events.len()
        );
        text.push_str(&locks_table(&report, &ranked, args.threads));
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

fn locks_table(report: &ContentionReport, ranked: &[(u64, &LockStats)], threads: bool) -> String {
    let mut rows: Vec<(String, [String; 10])> = Vec::new();
    for (lock, s) in ranked {
        rows.push((format!("{lock:#x}"), cells(s)));
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

fn locks_csv(report: &ContentionReport, ranked: &[(u64, &LockStats)], threads: bool) -> String {
    let mut out = String::from(
        "lock,lwpid,requests,acquired,blocked,blocked_percent,ownership_changes,\
         ownership_change_percent,contended,hold_total_ns,hold_avg_ns,hold_max_ns,\
         wait_total_ns,wait_avg_ns,wait_max_ns,trylock_failures,timedlock_timeouts\n",
    );
    let mut line = |lock: u64, thread: Option<u32>, s: &LockStats| {
        let _ = writeln!(
            out,
            "{lock:#x},{},{},{},{},{:.4},{},{:.4},{},{},{},{},{},{},{},{},{}",
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

fn locks_json(report: &ContentionReport, ranked: &[(u64, &LockStats)], threads: bool) -> String {
    let locks: Vec<serde_json::Value> = ranked
        .iter()
        .map(|(lock, s)| {
            let mut v = stats_json(s);
            v["lock"] = serde_json::json!(format!("{lock:#x}"));
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
