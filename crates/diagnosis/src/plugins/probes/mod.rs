//! `probes`: what the probes given at replay saw (`insight replay --probe`,
//! docs/probes.md). Per probe, named by its spec: the calls, per thread;
//! a log2 histogram (bpftrace's `hist()`) of each integer it captured
//! and, for a `return` probe, of the calls' durations in the recording's
//! guest time; the most frequent values of captured memory and strings;
//! the most frequent stacks (`ustack`). The rows, one per hit, as CSV.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use events::abi::Kind;
use events::db::{ProbeValue, Row};
use guestfiles::Symbolizer;

use crate::plugin::{Attachment, Output, Plugin, PluginContext, PluginError};

/// Distinct byte values and stacks shown per probe.
const TOP: usize = 5;
/// Width of a histogram's bar.
const BAR: u64 = 40;

/// One hit, as stored.
struct StoredHit {
    seq: u64,
    time: u64,
    kind: Kind,
    pid: u32,
    lwpid: u32,
}

#[derive(Default)]
pub struct Probes {
    /// Hits by probe number, in event order.
    hits: BTreeMap<u32, Vec<StoredHit>>,
    /// Stacks of hits (`ustack`), by event.
    stacks: HashMap<u64, Vec<u64>>,
}

impl Probes {
    pub fn new() -> Self {
        Self::default()
    }
}

/// A log2 bucket of bpftrace's `hist()`: 0, then [1, 2), [2, 4), ...;
/// negative values in one bucket of their own.
fn bucket(v: i64) -> i32 {
    match v {
        v if v < 0 => -1,
        0 => 0,
        v => 64 - (v as u64).leading_zeros() as i32,
    }
}

/// The bounds of a bucket, as text and as numbers (low, high exclusive).
fn bucket_range(b: i32) -> (String, Option<(i64, i64)>) {
    match b {
        -1 => ("(..., 0)".into(), None),
        0 => ("[0]".into(), Some((0, 1))),
        b => {
            let low = 1u64 << (b - 1);
            let high = low.saturating_mul(2);
            (
                format!("[{}, {})", short(low), short(high)),
                Some((low as i64, high.min(i64::MAX as u64) as i64)),
            )
        }
    }
}

/// 4096 -> 4K, as bpftrace writes bucket bounds.
fn short(v: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "T"),
        (1 << 30, "G"),
        (1 << 20, "M"),
        (1 << 10, "K"),
    ];
    for (size, unit) in UNITS {
        if v >= size && v.is_multiple_of(size) {
            return format!("{}{unit}", v / size);
        }
    }
    v.to_string()
}

/// A byte value for people: text (newlines and tabs escaped) where it is
/// printable, else hex.
fn show_bytes(b: &[u8]) -> String {
    let text = |c: &u8| c.is_ascii_graphic() || matches!(c, b' ' | b'\n' | b'\t' | b'\r');
    if !b.is_empty() && b.iter().all(text) {
        format!("{:?}", String::from_utf8_lossy(b))
    } else {
        b.iter().map(|c| format!("{c:02x}")).collect()
    }
}

/// What one value slot of a probe held over its hits.
fn summarize_slot(text: &mut String, name: &str, values: &[&ProbeValue]) -> serde_json::Value {
    let ints: Vec<i64> = values
        .iter()
        .filter_map(|v| match v {
            ProbeValue::Int(i) => Some(*i),
            ProbeValue::Bytes(_) => None,
        })
        .collect();
    if ints.len() == values.len() && !ints.is_empty() {
        let (min, max) = (ints.iter().min().unwrap(), ints.iter().max().unwrap());
        let mean = ints.iter().map(|&v| v as f64).sum::<f64>() / ints.len() as f64;
        let _ = writeln!(
            text,
            "  {name}: {} values, min {min}, max {max}, mean {mean:.1}",
            ints.len()
        );
        let mut buckets: BTreeMap<i32, u64> = BTreeMap::new();
        for &v in &ints {
            *buckets.entry(bucket(v)).or_default() += 1;
        }
        let most = buckets.values().copied().max().unwrap_or(1);
        let mut hist = Vec::new();
        for (&b, &n) in &buckets {
            let (label, bounds) = bucket_range(b);
            let bar = "@".repeat((n * BAR).div_ceil(most) as usize);
            let _ = writeln!(
                text,
                "    {label:<22} {n:>8} |{bar:<width$}|",
                width = BAR as usize
            );
            hist.push(serde_json::json!({
                "low": bounds.map(|b| b.0),
                "high": bounds.map(|b| b.1),
                "count": n,
            }));
        }
        return serde_json::json!({
            "name": name,
            "kind": "integer",
            "count": ints.len(),
            "min": min,
            "max": max,
            "mean": mean,
            "histogram": hist,
        });
    }
    let mut counts: HashMap<Vec<u8>, u64> = HashMap::new();
    for v in values {
        let bytes = match v {
            ProbeValue::Bytes(b) => b.clone(),
            ProbeValue::Int(i) => i.to_string().into_bytes(),
        };
        *counts.entry(bytes).or_default() += 1;
    }
    let mut top: Vec<(Vec<u8>, u64)> = counts.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let _ = writeln!(
        text,
        "  {name}: {} values, {} distinct",
        values.len(),
        top.len()
    );
    let mut json = Vec::new();
    for (bytes, n) in top.iter().take(TOP) {
        let _ = writeln!(text, "    {n:>8}  {}", show_bytes(bytes));
        json.push(serde_json::json!({
            "count": n,
            "text": String::from_utf8_lossy(bytes),
            "hex": bytes.iter().map(|c| format!("{c:02x}")).collect::<String>(),
        }));
    }
    serde_json::json!({
        "name": name,
        "kind": "bytes",
        "count": values.len(),
        "distinct": top.len(),
        "top": json,
    })
}

impl Plugin for Probes {
    fn name(&self) -> &'static str {
        "probes"
    }

    fn about(&self) -> &'static str {
        "the probes given at replay (replay --probe): calls per thread, histograms of the \
         values captured and of call durations, top stacks"
    }

    fn subscribes(&self) -> &'static [Kind] {
        &[Kind::Probe, Kind::ProbeReturn]
    }

    fn event(&mut self, row: &Row) {
        let Some(id) = row.value.and_then(|v| u32::try_from(v).ok()) else {
            return;
        };
        self.hits.entry(id).or_default().push(StoredHit {
            seq: row.seq,
            time: row.time,
            kind: row.kind,
            pid: row.pid,
            lwpid: row.lwpid,
        });
    }

    fn wants_stacks(&self) -> bool {
        true
    }

    fn stack(&mut self, seq: u64, frames: &[u64]) {
        self.stacks.insert(seq, frames.to_vec());
    }

    fn finish(&mut self, cx: &PluginContext) -> Result<Output, PluginError> {
        let probes = cx.db.probes()?;
        let values = cx.db.probe_values()?;
        let names: HashMap<(u32, u32), String> = cx
            .db
            .threads()?
            .into_iter()
            .map(|(pid, lwpid, comm)| ((pid, lwpid), comm))
            .collect();
        let mut sym = Symbolizer::new(cx.files);
        let mut added = Vec::new();
        let mut text = format!("Probes in {}: {} given at replay\n", cx.label, probes.len());
        let mut json = Vec::new();
        let mut csv = String::from("seq,time_ns,probe,event,pid,lwpid,values\n");
        for probe in &probes {
            let hits = self
                .hits
                .get(&probe.id)
                .map(Vec::as_slice)
                .unwrap_or_default();
            let _ = writeln!(
                text,
                "\nProbe {}: {}\n  calls: {}",
                probe.id,
                probe.spec,
                hits.len()
            );
            let mut per_thread: BTreeMap<(u32, u32), u64> = BTreeMap::new();
            for h in hits {
                *per_thread.entry((h.pid, h.lwpid)).or_default() += 1;
            }
            let mut threads = Vec::new();
            for (&(pid, lwpid), &n) in &per_thread {
                let name = names.get(&(pid, lwpid)).map(String::as_str).unwrap_or("");
                let _ = writeln!(text, "    thread {lwpid:>6} (pid {pid} {name}): {n}");
                threads.push(serde_json::json!({
                    "pid": pid, "lwpid": lwpid, "name": name, "calls": n,
                }));
            }
            let mut slots = Vec::new();
            for (slot, name) in probe.captures.iter().enumerate() {
                // The stack is the event's, not a value.
                if name == "ustack" {
                    continue;
                }
                let of_slot: Vec<&ProbeValue> = hits
                    .iter()
                    .filter_map(|h| values.get(&h.seq))
                    .filter_map(|v| v.iter().find(|(s, _)| *s as usize == slot).map(|(_, v)| v))
                    .collect();
                if of_slot.is_empty() {
                    let _ = writeln!(text, "  {name}: no values");
                    continue;
                }
                slots.push(summarize_slot(&mut text, name, &of_slot));
            }
            // The most frequent stacks.
            let mut by_stack: HashMap<(u32, &[u64]), u64> = HashMap::new();
            for h in hits {
                if let Some(frames) = self.stacks.get(&h.seq) {
                    *by_stack.entry((h.pid, frames.as_slice())).or_default() += 1;
                }
            }
            let mut stacks: Vec<((u32, &[u64]), u64)> = by_stack.into_iter().collect();
            stacks.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            let mut stacks_json = Vec::new();
            if !stacks.is_empty() {
                let _ = writeln!(text, "  top stacks:");
            } else if probe.captures.iter().any(|c| c == "ustack") && !hits.is_empty() {
                let _ = writeln!(text, "  top stacks: none could be unwound");
            }
            for ((pid, frames), n) in stacks.into_iter().take(TOP) {
                if !added.contains(&pid) {
                    sym.add_process(pid, cx.db.objects(pid)?);
                    added.push(pid);
                }
                let described = sym.describe_stack(pid, frames);
                let _ = writeln!(text, "    {n} calls:");
                for f in &described {
                    let _ = writeln!(text, "      {f}");
                }
                stacks_json.push(serde_json::json!({ "count": n, "frames": described }));
            }
            for h in hits {
                let shown: Vec<String> = values
                    .get(&h.seq)
                    .map(|v| {
                        v.iter()
                            .map(|(slot, value)| {
                                let name = probe
                                    .captures
                                    .get(*slot as usize)
                                    .map_or("?", String::as_str);
                                match value {
                                    ProbeValue::Int(i) => format!("{name}={i}"),
                                    ProbeValue::Bytes(b) => format!(
                                        "{name}=0x{}",
                                        b.iter().map(|c| format!("{c:02x}")).collect::<String>()
                                    ),
                                }
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let _ = writeln!(
                    csv,
                    "{},{},{},{},{},{},{}",
                    h.seq,
                    h.time,
                    probe.id,
                    h.kind.name(),
                    h.pid,
                    h.lwpid,
                    shown.join(";")
                );
            }
            json.push(serde_json::json!({
                "id": probe.id,
                "spec": probe.spec,
                "calls": hits.len(),
                "threads": threads,
                "values": slots,
                "stacks": stacks_json,
            }));
        }
        let mut warnings = Vec::new();
        if probes.is_empty() {
            warnings.push(
                "the database holds no probes: give them at replay (insight replay --probe SPEC, \
                 docs/probes.md)"
                    .to_owned(),
            );
        }
        Ok(Output {
            text,
            json: Some(serde_json::json!({ "probes": json })),
            attachments: vec![Attachment {
                format: "csv",
                content: csv,
            }],
            warnings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(2), 2);
        assert_eq!(bucket(3), 2);
        assert_eq!(bucket(4096), 13);
        assert_eq!(bucket(-5), -1);
        assert_eq!(bucket_range(13).0, "[4K, 8K)");
        assert_eq!(bucket_range(13).1, Some((4096, 8192)));
        assert_eq!(bucket_range(1).0, "[1, 2)");
        assert_eq!(bucket_range(64).1.unwrap().1, i64::MAX);
        assert_eq!(show_bytes(b"GET /"), "\"GET /\"");
        assert_eq!(show_bytes(&[0, 255]), "00ff");
        assert_eq!(show_bytes(b"a\tb\n"), "\"a\\tb\\n\"");
    }

    #[test]
    fn integer_slots_get_a_histogram_and_bytes_their_top_values() {
        let ints = [ProbeValue::Int(1), ProbeValue::Int(5), ProbeValue::Int(6)];
        let mut text = String::new();
        let j = summarize_slot(&mut text, "arg0", &ints.iter().collect::<Vec<_>>());
        assert_eq!(j["min"], 1);
        assert_eq!(j["max"], 6);
        let hist = j["histogram"].as_array().unwrap();
        assert_eq!(hist.len(), 2);
        assert_eq!(hist[1]["low"], 4);
        assert_eq!(hist[1]["count"], 2);
        let bytes = [
            ProbeValue::Bytes(b"a".to_vec()),
            ProbeValue::Bytes(b"b".to_vec()),
            ProbeValue::Bytes(b"b".to_vec()),
        ];
        let j = summarize_slot(&mut text, "str(arg0)", &bytes.iter().collect::<Vec<_>>());
        assert_eq!(j["distinct"], 2);
        assert_eq!(j["top"][0]["text"], "b");
        assert_eq!(j["top"][0]["count"], 2);
    }
}
