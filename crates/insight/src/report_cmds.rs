//! `insight report`: the diagnosis tools over an event database, offline.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use diagnosis::contention::{self, ContentionReport, Durations, LockStats};
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
    }
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
