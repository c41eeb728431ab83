//! `profile`: where the sampled threads spent their time, per function,
//! from SAMPLE events; see [`crate::profile`].

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use events::abi::Kind;
use events::db::Row;

use crate::flamegraph;
use crate::percent;
use crate::plugin::{Attachment, Context, Output, Plugin, PluginError, ReplayNeeds};
use crate::profile::{self, ProfileRow};

#[derive(Clone, Copy, Debug)]
pub struct ProfileOptions {
    /// At most this many functions (per thread too).
    pub limit: usize,
    /// Also a profile per thread.
    pub threads: bool,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        ProfileOptions {
            limit: 20,
            threads: false,
        }
    }
}

pub struct Profile {
    options: ProfileOptions,
    samples: Vec<Row>,
    stacks: HashMap<u64, Vec<u64>>,
}

impl Profile {
    pub fn new(options: ProfileOptions) -> Self {
        Profile {
            options,
            samples: Vec::new(),
            stacks: HashMap::new(),
        }
    }
}

impl Plugin for Profile {
    fn name(&self) -> &'static str {
        "profile"
    }

    fn about(&self) -> &'static str {
        "function profile of the sampled threads, overall and per thread; flame graphs"
    }

    fn subscribes(&self) -> &'static [Kind] {
        &[Kind::Sample]
    }

    fn replay_needs(&self) -> ReplayNeeds {
        ReplayNeeds {
            sample_period: Some(Duration::from_millis(1)),
        }
    }

    fn event(&mut self, row: &Row) {
        self.samples.push(row.clone());
    }

    fn wants_stacks(&self) -> bool {
        true
    }

    fn stack(&mut self, seq: u64, frames: &[u64]) {
        self.stacks.insert(seq, frames.to_vec());
    }

    fn finish(&mut self, cx: &Context) -> Result<Output, PluginError> {
        let p = profile::profile(&self.samples, &self.stacks, cx.db, cx.files)?;
        if p.samples == 0 {
            return Ok(Output {
                text: format!(
                    "No SAMPLE events in {}: replay with --sample-period (threads are sampled \
                     once their process raised a probe event).\n",
                    cx.label
                ),
                json: Some(serde_json::json!({"samples": 0, "functions": [], "threads": []})),
                ..Output::default()
            });
        }
        let limit = self.options.limit;
        let mut text = format!(
            "Profile of {}: {} samples ({} in the guest kernel)\n\n",
            cx.label, p.samples, p.kernel
        );
        text.push_str(&table(&p.rows, p.samples, limit));
        if self.options.threads {
            for t in &p.threads {
                let _ = write!(
                    text,
                    "\nThread {} (pid {}, {}): {} samples\n",
                    t.lwpid, t.pid, t.comm, t.samples
                );
                text.push_str(&table(&t.rows, t.samples, limit));
            }
        }
        let rows_json = |rows: &[ProfileRow], total: u64| -> Vec<serde_json::Value> {
            rows.iter()
                .take(limit)
                .map(|r| {
                    serde_json::json!({
                        "function": r.location.function,
                        "object": r.location.object,
                        "samples": r.samples,
                        "share": percent(r.samples, total),
                    })
                })
                .collect()
        };
        let json = serde_json::json!({
            "samples": p.samples,
            "kernel": p.kernel,
            "functions": rows_json(&p.rows, p.samples),
            "threads": p.threads.iter().map(|t| serde_json::json!({
                "pid": t.pid,
                "lwpid": t.lwpid,
                "comm": t.comm,
                "samples": t.samples,
                "functions": rows_json(&t.rows, t.samples),
            })).collect::<Vec<_>>(),
        });
        let mut folded = String::new();
        for (stack, n) in &p.folded {
            let _ = writeln!(folded, "{stack} {n}");
        }
        let svg = flamegraph::svg(
            &format!("insight profile of {} ({} samples)", cx.label, p.samples),
            &p.folded,
        );
        Ok(Output {
            text,
            json: Some(json),
            attachments: vec![
                Attachment {
                    format: "folded",
                    content: folded,
                },
                Attachment {
                    format: "svg",
                    content: svg,
                },
            ],
            warnings: cx
                .files_missing
                .iter()
                .map(|why| format!("functions are not named: {why}"))
                .collect(),
        })
    }
}

fn table(rows: &[ProfileRow], total: u64, limit: usize) -> String {
    let mut out = format!(
        "{:>8}  {:>8}  {:<32}  {}\n",
        "share", "samples", "object", "function"
    );
    for r in rows.iter().take(limit) {
        let object = r.location.object.rsplit('/').next().unwrap_or("");
        let _ = writeln!(
            out,
            "{:>7.2}%  {:>8}  {:<32}  {}",
            percent(r.samples, total),
            r.samples,
            object,
            r.location.function
        );
    }
    out
}
