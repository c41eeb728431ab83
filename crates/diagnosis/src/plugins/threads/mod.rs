//! `threads`: one line per thread: how long it lived, how often it was
//! switched in, how much it was sampled on the CPU, how many lock calls it
//! made and how long it waited in them. A first look at where each thread
//! spends its time, and the example of docs/plugins.md.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use events::abi::{Kind, Source};
use events::db::Row;

use crate::plugin::{Output, Plugin, PluginContext, PluginError};

#[derive(Default)]
struct Thread {
    pid: u32,
    first: Option<u64>,
    last: u64,
    events: u64,
    switched_in: u64,
    samples: u64,
    /// Of `samples`, those running user code (SAMPLE value 0).
    user_samples: u64,
    lock_calls: u64,
    lock_wait: u64,
}

/// Threads by (pid, lwpid): an lwpid another process had before is
/// another thread.
type Tid = (u32, u32);

#[derive(Default)]
pub struct Threads {
    threads: BTreeMap<Tid, Thread>,
    /// Lock calls not yet returned -> request time.
    waiting: HashMap<Tid, u64>,
    samples: u64,
    /// The time of the last event seen.
    end: u64,
}

impl Threads {
    pub fn new() -> Self {
        Self::default()
    }

    fn thread(&mut self, pid: u32, lwpid: u32, time: u64) -> &mut Thread {
        let t = self.threads.entry((pid, lwpid)).or_default();
        t.pid = pid;
        t.first.get_or_insert(time);
        t.last = t.last.max(time);
        t
    }
}

impl Plugin for Threads {
    fn name(&self) -> &'static str {
        "threads"
    }

    fn about(&self) -> &'static str {
        "per thread: lifetime, switches, samples on the CPU (and the share in user code), lock \
         calls and time waiting in them"
    }

    fn subscribes(&self) -> &'static [Kind] {
        &[]
    }

    fn event(&mut self, row: &Row) {
        self.end = self.end.max(row.time);
        match (row.kind, row.source) {
            (Kind::ContextSwitch, _) => {
                // pid/lwpid switched out; value = lwpid, addr = pid switched in.
                let (Some(to), Some(to_pid)) = (row.value, row.addr) else {
                    return;
                };
                let (Ok(to), Ok(to_pid)) = (u32::try_from(to), u32::try_from(to_pid)) else {
                    return;
                };
                // Only threads the probes made known: the switch ring names
                // every task, kernel threads included.
                if let Some(t) = self.threads.get_mut(&(to_pid, to)) {
                    t.switched_in += 1;
                }
            }
            (Kind::Sample, _) => {
                self.samples += 1;
                let t = self.thread(row.pid, row.lwpid, row.time);
                t.samples += 1;
                if row.value == Some(0) {
                    t.user_samples += 1;
                }
            }
            (_, Source::Probe | Source::Kernel) => {
                let time = row.time;
                let waited = match row.kind {
                    Kind::Lock | Kind::TryLock | Kind::TimedLock => {
                        self.waiting.insert((row.pid, row.lwpid), time);
                        None
                    }
                    Kind::LockRet | Kind::TryLockRet | Kind::TimedLockRet => self
                        .waiting
                        .remove(&(row.pid, row.lwpid))
                        .map(|since| time.saturating_sub(since)),
                    _ => None,
                };
                let t = self.thread(row.pid, row.lwpid, time);
                t.events += 1;
                t.lock_wait += waited.unwrap_or(0);
                if matches!(row.kind, Kind::Lock | Kind::TryLock | Kind::TimedLock) {
                    t.lock_calls += 1;
                }
            }
            _ => {}
        }
    }

    fn finish(&mut self, cx: &PluginContext) -> Result<Output, PluginError> {
        // A call still waiting when the events end (a thread blocked for
        // good, say) has waited until then.
        for (tid, since) in std::mem::take(&mut self.waiting) {
            if let Some(t) = self.threads.get_mut(&tid) {
                t.lock_wait += self.end.saturating_sub(since);
                t.last = self.end;
            }
        }
        let names: HashMap<Tid, String> = cx
            .db
            .threads()?
            .into_iter()
            .map(|(pid, lwpid, comm)| ((pid, lwpid), comm))
            .collect();
        let ms = |ns: u64| ns as f64 / 1e6;
        let mut text = format!(
            "Threads in {}: {} threads; times in ms of the recorded run\n\n\
             {:>7}  {:>7}  {:<16}  {:>10}  {:>8}  {:>8}  {:>7}  {:>6}  {:>10}  {:>10}  {:>6}\n",
            cx.label,
            self.threads.len(),
            "lwpid",
            "pid",
            "name",
            "lifetime",
            "events",
            "switches",
            "samples",
            "user%",
            "lock calls",
            "lock wait",
            "wait%"
        );
        let mut rows = Vec::new();
        for (tid @ (_, lwpid), t) in &self.threads {
            let lifetime = t.last - t.first.unwrap_or(t.last);
            let wait_share = if lifetime == 0 {
                0.0
            } else {
                100.0 * t.lock_wait as f64 / lifetime as f64
            };
            let name = names.get(tid).map(String::as_str).unwrap_or("");
            // Where its sampled CPU time went: user code, or its kernel.
            let user_share = if t.samples == 0 {
                "-".to_owned()
            } else {
                format!("{:.1}%", 100.0 * t.user_samples as f64 / t.samples as f64)
            };
            let _ = writeln!(
                text,
                "{lwpid:>7}  {:>7}  {name:<16}  {:>10.3}  {:>8}  {:>8}  {:>7}  {user_share:>6}  {:>10}  {:>10.3}  {wait_share:>5.1}%",
                t.pid,
                ms(lifetime),
                t.events,
                t.switched_in,
                t.samples,
                t.lock_calls,
                ms(t.lock_wait),
            );
            rows.push(serde_json::json!({
                "lwpid": lwpid,
                "pid": t.pid,
                "name": name,
                "first_ns": t.first,
                "last_ns": t.last,
                "events": t.events,
                "switched_in": t.switched_in,
                "samples": t.samples,
                "user_samples": t.user_samples,
                "lock_calls": t.lock_calls,
                "lock_wait_ns": t.lock_wait,
            }));
        }
        if self.threads.is_empty() {
            text.push_str("(no events from threads)\n");
        }
        Ok(Output {
            text,
            json: Some(serde_json::json!({ "threads": rows, "samples": self.samples })),
            ..Output::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_db::TestDb;

    fn row(time: u64, kind: Kind, lwpid: u32) -> Row {
        Row {
            seq: 0,
            time,
            kind,
            source: Source::Probe,
            pid: 10,
            lwpid,
            addr: Some(0x1000),
            caller: None,
            value: Some(0),
        }
    }

    #[test]
    fn counts_lock_wait_switches_and_samples() {
        let mut p = Threads::new();
        p.event(&row(100, Kind::ThreadCreate, 11));
        p.event(&row(200, Kind::Lock, 11));
        p.event(&row(700, Kind::LockRet, 11));
        p.event(&row(900, Kind::Unlock, 11));
        // A return without a request is not a wait.
        p.event(&row(950, Kind::LockRet, 12));
        let mut switch = row(1000, Kind::ContextSwitch, 12);
        (switch.source, switch.pid, switch.addr, switch.value) =
            (Source::Kernel, 10, Some(10), Some(11));
        p.event(&switch);
        // A switch to an unknown task is not counted.
        switch.value = Some(99);
        p.event(&switch);
        let mut sample = row(1100, Kind::Sample, 11);
        sample.source = Source::Host;
        p.event(&sample);
        // In the kernel, and at a kernel boundary: not user time.
        for value in [1, 2] {
            sample.value = Some(value);
            p.event(&sample);
        }
        // The same lwpid in another process is another thread.
        let mut other = row(1150, Kind::Lock, 11);
        other.pid = 20;
        p.event(&other);
        let t = &p.threads[&(10, 11)];
        assert_eq!((t.first, t.last), (Some(100), 1100));
        assert_eq!((t.events, t.lock_calls, t.lock_wait), (4, 1, 500));
        assert_eq!((t.switched_in, t.samples, t.user_samples), (1, 3, 1));
        assert_eq!(p.threads[&(10, 12)].lock_wait, 0);
        assert!(!p.threads.keys().any(|&(_, lwpid)| lwpid == 99));
        // Its lock call never returned: it waits until the last event.
        p.event(&row(1400, Kind::Unlock, 12));
        p.finish(&TestDb::with_rows("threads", &[]).context())
            .unwrap();
        let t = &p.threads[&(20, 11)];
        assert_eq!((t.lock_calls, t.lock_wait, t.last), (1, 250, 1400));
    }
}
