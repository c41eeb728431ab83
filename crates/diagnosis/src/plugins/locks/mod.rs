//! `locks`: lock contention per lock (and per thread), modelled on
//! mutrace; see [`contention`] for the definitions. Waits on condition
//! variables, at barriers and on semaphores follow ([`waits`]).

use std::collections::HashMap;
use std::fmt::Write as _;

use events::abi::Kind;
use events::db::Row;
use guestfiles::Symbolizer;

use crate::event_stacks::EventStacks;
use crate::from_db::LockEvents;
use crate::plugin::{Attachment, Output, Plugin, PluginContext, PluginError};
use crate::render::{duration, percent};

pub mod contention;
pub mod names;
pub mod stacks;
pub mod waits;

use contention::{Contention, ContentionReport, Durations, LockStats};
use names::LockNames;
use stacks::StackShare;
use waits::Waits;

/// The kinds the report reads: the lock events, LOCKINIT, and the other
/// synchronisation's.
const KINDS: [Kind; 21] = [
    Kind::Lock,
    Kind::LockRet,
    Kind::TryLock,
    Kind::TryLockRet,
    Kind::TimedLock,
    Kind::TimedLockRet,
    Kind::Unlock,
    Kind::RwLock,
    Kind::RwLockRet,
    Kind::RwUnlock,
    Kind::CondWait,
    Kind::CondWaitRet,
    Kind::LockInit,
    Kind::CondSignal,
    Kind::CondBroadcast,
    Kind::Barrier,
    Kind::BarrierRet,
    Kind::SemWait,
    Kind::SemWaitRet,
    Kind::SemPost,
    Kind::ContextSwitch,
];

/// How the report is cut.
#[derive(Clone, Copy, Debug)]
pub struct LocksOptions {
    /// At most this many locks.
    pub limit: usize,
    /// Only locks with at least this many blocked requests.
    pub min_blocked: u64,
    /// Each lock broken down per thread.
    pub threads: bool,
    /// Per lock, the call stacks of this many of its contended
    /// acquisitions' requests, most waited-for first (0: none).
    pub stacks: usize,
}

impl Default for LocksOptions {
    fn default() -> Self {
        LocksOptions {
            limit: 20,
            min_blocked: 0,
            threads: false,
            stacks: 0,
        }
    }
}

pub struct Locks {
    options: LocksOptions,
    analysis: Contention,
    events: u64,
    /// What names each lock: its first user, its first init.
    names: LockNames,
    /// The stacks of lock requests (with `options.stacks`).
    request_stacks: EventStacks,
    /// Whether the last event passed was a lock request.
    last_was_request: bool,
    rows: LockEvents,
    waits: Waits,
}

impl Locks {
    pub fn new(options: LocksOptions) -> Self {
        Locks {
            options,
            analysis: Contention::new(),
            events: 0,
            names: LockNames::default(),
            request_stacks: EventStacks::default(),
            last_was_request: false,
            rows: LockEvents::default(),
            waits: Waits::default(),
        }
    }
}

impl Plugin for Locks {
    fn name(&self) -> &'static str {
        "locks"
    }

    fn about(&self) -> &'static str {
        "lock contention: requests, blocked requests, ownership changes, hold and wait times"
    }

    fn subscribes(&self) -> &'static [Kind] {
        &KINDS
    }

    fn wants_stacks(&self) -> bool {
        // The inits' stacks name the locks a helper initialises.
        true
    }

    fn stack(&mut self, seq: u64, frames: &[u64]) {
        if self.last_was_request && self.options.stacks > 0 {
            self.request_stacks.add(seq, frames);
        }
        self.names.stack(frames);
    }

    fn event(&mut self, row: &Row) {
        if row.kind == Kind::ContextSwitch {
            // pid/lwpid switched out; value = lwpid switched in.
            if let Some(to) = row.value.and_then(|v| u32::try_from(v).ok()) {
                self.analysis.switch(row.lwpid, to, row.time);
            }
            return;
        }
        self.last_was_request = matches!(
            row.kind,
            Kind::Lock | Kind::TryLock | Kind::TimedLock | Kind::RwLock
        );
        self.names.event(row);
        if row.kind == Kind::LockInit {
            return;
        }
        if row.kind.is_sync() {
            self.waits.push(row);
            if let (Some(addr), false) = (row.addr, row.kind == Kind::CondWait) {
                self.names.used(addr, row.pid);
            }
            if let (Kind::CondWait, Some(cond)) = (row.kind, row.value) {
                self.names.used(cond as u64, row.pid);
            }
        }
        if let Some(e) = self.rows.event(row) {
            self.events += 1;
            self.names.used(e.lock, row.pid);
            self.analysis.push(&e);
        }
    }

    fn finish(&mut self, cx: &PluginContext) -> Result<Output, PluginError> {
        let report = std::mem::take(&mut self.analysis).finish();
        let names = self.names.names(cx)?;
        let ranked: Vec<(u64, &LockStats)> = report
            .ranked(usize::MAX)
            .into_iter()
            .filter(|(_, s)| s.blocked >= self.options.min_blocked)
            .take(self.options.limit)
            .collect();
        let threads = self.options.threads;
        let mut text = format!(
            "Lock contention in {}: {} locks, {} lock events; times are the recorded run's\n\n",
            cx.label,
            report.locks.len(),
            self.events
        );
        text.push_str(&table(&report, &ranked, &names, threads));
        text.push_str(&longest_holds(&ranked, &names));
        if report.locks.is_empty() {
            // Objects loaded: the probe library ran, and the program took
            // no lock; none: it did not run.
            let probed = cx
                .db
                .counts()?
                .iter()
                .any(|&(k, n)| k == Kind::Symbol && n > 0);
            text.push_str(if probed {
                "(no lock events: the programs took no lock through pthreads)\n"
            } else {
                "(no lock events: lock calls raise events in programs recorded with \
                 `insight record --probes`)\n"
            });
        }
        let stacks = self.top_stacks(cx, &report, &ranked)?;
        for ((lock, s), top) in ranked.iter().zip(&stacks) {
            if top.is_empty() {
                continue;
            }
            let name = names.get(lock).map(|n| format!(" {n}")).unwrap_or_default();
            let _ = writeln!(
                text,
                "\nContended acquisitions of {lock:#x}{name} ({} in all), by call stack:",
                s.contended
            );
            for share in top {
                let _ = writeln!(
                    text,
                    "  {} acquisitions, waited {}:",
                    share.acquisitions,
                    duration(share.wait)
                );
                for (i, frame) in share.frames.iter().enumerate() {
                    let _ = writeln!(text, "    #{i} {frame}");
                }
            }
        }
        text.push_str(&waits_table(&self.waits, &names));
        if !report.locks.is_empty() {
            text.push_str(
                "\nThe guest has one vCPU: a thread finds a lock held only where its holder \
                 was preempted (or waited) while holding it.\n",
            );
        }
        let mut warnings = Vec::new();
        if let Some(why) = &cx.files_missing {
            warnings.push(format!("locks are not named: {why}"));
        }
        let a = report.anomalies;
        let inconsistent = a.release_without_hold
            + a.return_without_request
            + a.acquired_while_held
            + a.out_of_order
            + self.waits.anomalies;
        if inconsistent > 0 {
            warnings.push(format!(
                "{inconsistent} lock events contradict the lock model and were not counted \
                 ({} releases without a hold, {} returns without a request, {} acquisitions \
                 of a held lock, {} out of order, {} waits without a call or return)",
                a.release_without_hold,
                a.return_without_request,
                a.acquired_while_held,
                a.out_of_order,
                self.waits.anomalies
            ));
        }
        for (what, n, example) in cx.db.anomalies()? {
            warnings.push(format!(
                "the capture counted {n}× {what} (first: {example})"
            ));
        }
        Ok(Output {
            text,
            json: Some(json(
                &report,
                &ranked,
                &names,
                threads,
                &stacks,
                &self.waits,
            )),
            attachments: vec![Attachment {
                format: "csv",
                content: csv(&report, &ranked, &names, threads),
            }],
            warnings,
        })
    }
}

impl Locks {
    /// Per ranked lock, the stacks of its contended acquisitions (none
    /// unless `options.stacks`), symbolized in the process that first
    /// used the lock.
    fn top_stacks(
        &self,
        cx: &PluginContext,
        report: &ContentionReport,
        ranked: &[(u64, &LockStats)],
    ) -> Result<Vec<Vec<StackShare>>, PluginError> {
        let n = self.options.stacks;
        let mut sym = Symbolizer::new(cx.files);
        let mut added = Vec::new();
        let mut out = Vec::new();
        for (lock, _) in ranked {
            let Some(pid) = self.names.first_user(*lock).filter(|_| n > 0) else {
                out.push(Vec::new());
                continue;
            };
            if !added.contains(&pid) {
                sym.add_process(pid, cx.db.objects(pid)?);
                added.push(pid);
            }
            out.push(stacks::top_stacks(
                &report.contended,
                &self.request_stacks,
                *lock,
                n,
                pid,
                &mut sym,
            ));
        }
        Ok(out)
    }
}

fn times(d: &Durations) -> String {
    if d.count == 0 {
        return "-".into();
    }
    format!(
        "{} / {} / {}",
        duration(d.total),
        duration(d.avg()),
        duration(d.max)
    )
}

const COLUMNS: [&str; 12] = [
    "requests",
    "acquired",
    "blocked",
    "%",
    "changes",
    "%",
    "contended",
    "hold tot/avg/max",
    "of it off-CPU",
    "wait tot/avg/max",
    "cond waits n / total",
    "try-fail/timeout",
];

fn cells(s: &LockStats) -> [String; 12] {
    [
        s.requests.to_string(),
        s.acquisitions.to_string(),
        s.blocked.to_string(),
        format!("{:.2}", s.blocked_percent()),
        s.ownership_changes.to_string(),
        format!("{:.2}", s.ownership_change_percent()),
        s.contended.to_string(),
        times(&s.hold),
        match s.hold.total {
            0 => "-".into(),
            total => format!(
                "{} ({:.0} %)",
                duration(s.hold_off_cpu),
                percent(s.hold_off_cpu, total)
            ),
        },
        times(&s.wait),
        match s.cond_waits.count {
            0 => "-".into(),
            n => format!("{n} / {}", duration(s.cond_waits.total)),
        },
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

fn table(
    report: &ContentionReport,
    ranked: &[(u64, &LockStats)],
    names: &HashMap<u64, String>,
    threads: bool,
) -> String {
    let mut rows: Vec<(String, [String; 12])> = Vec::new();
    for (lock, s) in ranked {
        let kind = if s.rwlock { " (rwlock)" } else { "" };
        let label = match names.get(lock) {
            Some(name) => format!("{lock:#x} {name}{kind}"),
            None => format!("{lock:#x}{kind}"),
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
    out
}

/// The waits that are not for a lock, by object: "" where there are none.
fn waits_table(waits: &Waits, names: &HashMap<u64, String>) -> String {
    let ranked = waits.ranked();
    if ranked.is_empty() {
        return String::new();
    }
    let rows: Vec<[String; 6]> = ranked
        .iter()
        .map(|(addr, s)| {
            let label = match names.get(addr) {
                Some(name) => format!("{addr:#x} {name}"),
                None => format!("{addr:#x}"),
            };
            let wakeups = match s.object {
                waits::WaitObject::CondVar => format!("{} ({} broadcast)", s.wakeups, s.broadcasts),
                waits::WaitObject::Semaphore => s.wakeups.to_string(),
                waits::WaitObject::Barrier => "-".into(),
            };
            [
                label,
                s.object.name().into(),
                s.waits.count.to_string(),
                times(&s.waits),
                s.failed.to_string(),
                wakeups,
            ]
        })
        .collect();
    let head = [
        "object",
        "kind",
        "waits",
        "wait tot/avg/max",
        "timeout/try-fail",
        "signals/posts",
    ];
    let mut widths: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, v) in widths.iter_mut().zip(r) {
            *w = (*w).max(v.chars().count());
        }
    }
    let mut out = String::from(
        "\nWaits that are not for a lock (a condition variable's gives its mutex up):\n\n",
    );
    let line = |out: &mut String, cells: &[&str]| {
        for (i, (v, w)) in cells.iter().zip(&widths).enumerate() {
            let pad = w.saturating_sub(v.chars().count());
            match i {
                0 | 1 => {
                    let _ = write!(out, "{v}{}  ", " ".repeat(pad));
                }
                _ => {
                    let _ = write!(out, "{}{v}  ", " ".repeat(pad));
                }
            }
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
    };
    line(&mut out, &head);
    for r in &rows {
        let cells: Vec<&str> = r.iter().map(String::as_str).collect();
        line(&mut out, &cells);
    }
    out
}

fn csv(
    report: &ContentionReport,
    ranked: &[(u64, &LockStats)],
    names: &HashMap<u64, String>,
    threads: bool,
) -> String {
    let mut out = String::from(
        "lock,name,lwpid,requests,acquired,blocked,blocked_percent,ownership_changes,\
         ownership_change_percent,contended,hold_total_ns,hold_avg_ns,hold_max_ns,\
         wait_total_ns,wait_avg_ns,wait_max_ns,trylock_failures,timedlock_timeouts,\
         shared_acquisitions,cond_waits,cond_wait_total_ns,cond_timeouts,hold_off_cpu_ns\n",
    );
    let mut line = |lock: u64, thread: Option<u32>, s: &LockStats| {
        let _ = writeln!(
            out,
            "{lock:#x},{},{},{},{},{},{:.4},{},{:.4},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
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
            s.timedlock_timeouts,
            s.shared_acquisitions,
            s.cond_waits.count,
            s.cond_waits.total,
            s.cond_timeouts,
            s.hold_off_cpu
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

/// For each lock of the table, its longest hold: by whom, when, and how
/// much of it the holder spent off the CPU. A holder preempted between
/// its acquisition and its first look at the clock held the lock for
/// time its own measure cannot see: this says where that went.
fn longest_holds(ranked: &[(u64, &LockStats)], names: &HashMap<u64, String>) -> String {
    let mut text = String::new();
    for (lock, s) in ranked {
        let Some(l) = s.longest_hold else {
            continue;
        };
        if text.is_empty() {
            text.push_str("\nLongest holds:\n");
        }
        let name = names.get(lock).map(|n| format!(" {n}")).unwrap_or_default();
        let _ = writeln!(
            text,
            "  {lock:#x}{name}: {} by thread {} from {:.6} s, {} of it off the CPU ({:.0} %)",
            duration(l.time),
            l.thread,
            l.start as f64 / 1e9,
            duration(l.off_cpu),
            percent(l.off_cpu, l.time)
        );
    }
    text
}

fn stats_json(s: &LockStats) -> serde_json::Value {
    let d = |d: &Durations| serde_json::json!({"count": d.count, "total_ns": d.total, "avg_ns": d.avg(), "max_ns": d.max});
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
        "hold_off_cpu_ns": s.hold_off_cpu,
        "longest_hold": s.longest_hold.map(|l| serde_json::json!({
            "lwpid": l.thread, "start_ns": l.start, "ns": l.time, "off_cpu_ns": l.off_cpu,
        })),
        "rwlock": s.rwlock,
        "shared_acquisitions": s.shared_acquisitions,
        "cond_waits": {"count": s.cond_waits.count, "total_ns": s.cond_waits.total,
                       "max_ns": s.cond_waits.max, "timeouts": s.cond_timeouts},
    })
}

fn json(
    report: &ContentionReport,
    ranked: &[(u64, &LockStats)],
    names: &HashMap<u64, String>,
    threads: bool,
    stacks: &[Vec<StackShare>],
    waits: &Waits,
) -> serde_json::Value {
    let locks: Vec<serde_json::Value> = ranked
        .iter()
        .zip(stacks)
        .map(|((lock, s), top)| {
            let mut v = stats_json(s);
            v["lock"] = serde_json::json!(format!("{lock:#x}"));
            v["name"] = serde_json::json!(names.get(lock));
            if !top.is_empty() {
                v["stacks"] = top
                    .iter()
                    .map(|share| {
                        serde_json::json!({
                            "acquisitions": share.acquisitions,
                            "wait_ns": share.wait,
                            "frames": share.frames,
                        })
                    })
                    .collect();
            }
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
    let objects: Vec<serde_json::Value> = waits
        .ranked()
        .into_iter()
        .map(|(addr, s)| {
            serde_json::json!({
                "object": format!("{addr:#x}"),
                "name": names.get(&addr),
                "kind": s.object.name(),
                "waits": s.waits.count,
                "wait": {"total_ns": s.waits.total, "avg_ns": s.waits.avg(), "max_ns": s.waits.max},
                "failed": s.failed,
                "wakeups": s.wakeups,
                "broadcasts": s.broadcasts,
            })
        })
        .collect();
    let a = report.anomalies;
    serde_json::json!({
        "locks": locks,
        "waits": objects,
        "anomalies": {
            "release_without_hold": a.release_without_hold,
            "return_without_request": a.return_without_request,
            "acquired_while_held": a.acquired_while_held,
            "out_of_order": a.out_of_order,
            "waits": waits.anomalies,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::run;
    use crate::test_db::TestDb;
    use events::abi::Source;

    #[test]
    fn locks_without_a_variable_are_named_by_their_init_site() {
        let row = |kind, addr, caller, value| Row {
            seq: 0,
            time: 1,
            kind,
            source: Source::Probe,
            pid: 3,
            lwpid: 4,
            addr: Some(addr),
            caller,
            value,
        };
        let db = TestDb::with_rows(
            "locks",
            &[
                row(Kind::LockInit, 0x9000, Some(0x40_1234), Some(0)),
                row(Kind::Lock, 0x9000, Some(0x40_2000), None),
                row(Kind::LockRet, 0x9000, Some(0x40_2000), Some(0)),
                row(Kind::Unlock, 0x9000, Some(0x40_2010), None),
                row(Kind::Lock, 0xa000, Some(0x40_2000), None),
                // Two locks a helper initialises: one call site.
                row(Kind::LockInit, 0xb000, Some(0x40_3000), Some(0)),
                row(Kind::LockInit, 0xc000, Some(0x40_3000), Some(0)),
                row(Kind::Lock, 0xc000, Some(0x40_2000), None),
                row(Kind::Lock, 0xb000, Some(0x40_2000), None),
            ],
        );
        let mut plugins: Vec<Box<dyn Plugin>> = vec![Box::new(Locks::new(LocksOptions::default()))];
        let out = run(&mut plugins, &db.context()).unwrap().remove(0);
        let json = out.json.unwrap();
        let name = |lock: &str| {
            json["locks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["lock"] == lock)
                .map(|l| l["name"].clone())
        };
        // No symbols here: the init site is an address.
        assert_eq!(name("0x9000"), Some(serde_json::json!("init at 0x401233")));
        assert_eq!(name("0xa000"), Some(serde_json::Value::Null));
        assert_eq!(json["locks"][0]["requests"], 1);
        // Never one name for two locks: numbered by address.
        assert_eq!(
            name("0xb000"),
            Some(serde_json::json!("init at 0x402fff #1"))
        );
        assert_eq!(
            name("0xc000"),
            Some(serde_json::json!("init at 0x402fff #2"))
        );
    }

    #[test]
    fn locks_a_helper_initialises_are_named_by_its_callers() {
        let row = |kind, addr, caller| Row {
            seq: 0,
            time: 1,
            kind,
            source: Source::Probe,
            pid: 3,
            lwpid: 4,
            addr: Some(addr),
            caller: Some(caller),
            value: Some(0),
        };
        let mut rows = Vec::new();
        let mut stacks: Vec<(u64, Vec<u64>)> = Vec::new();
        // One helper (its init at 0x403000) called from three places, the
        // third in a loop; stacks start at the wrapper.
        for (lock, from) in [
            (0xb000, 0x41_0010),
            (0xc000, 0x41_0020),
            (0xd000, 0x41_0030),
            (0xe000, 0x41_0030),
        ] {
            stacks.push((
                rows.len() as u64 + 1,
                vec![0x7f00_0000, 0x40_3000, from, 0x42_0000],
            ));
            rows.push(row(Kind::LockInit, lock, 0x40_3000));
            rows.push(row(Kind::Lock, lock, 0x40_2000));
        }
        let stacks: Vec<(u64, &[u64])> = stacks.iter().map(|(s, f)| (*s, &f[..])).collect();
        let db = TestDb::with_stacks("lock-callers", &rows, &stacks);
        let mut plugins: Vec<Box<dyn Plugin>> = vec![Box::new(Locks::new(LocksOptions::default()))];
        let json = run(&mut plugins, &db.context())
            .unwrap()
            .remove(0)
            .json
            .unwrap();
        let name = |lock: &str| {
            json["locks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["lock"] == lock)
                .map(|l| l["name"].as_str().unwrap().to_string())
                .unwrap()
        };
        // One caller tells the first two apart; more would not tell the
        // loop's two apart: numbered.
        assert_eq!(name("0xb000"), "init at 0x402fff ← 0x410010");
        assert_eq!(name("0xc000"), "init at 0x402fff ← 0x410020");
        assert_eq!(name("0xd000"), "init at 0x402fff ← 0x410030 #1");
        assert_eq!(name("0xe000"), "init at 0x402fff ← 0x410030 #2");
    }
}
