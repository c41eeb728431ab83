//! `profile`: where the sampled threads spent their time, per function,
//! from SAMPLE events; see [`functions`].

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use events::abi::Kind;
use events::db::Row;

use crate::plugin::{Attachment, Output, Plugin, PluginContext, PluginError, ReplayNeeds};
use crate::render::percent;

pub mod flamegraph;
pub mod functions;

use functions::ProfileRow;

#[derive(Clone, Copy, Debug)]
pub struct ProfileOptions {
    /// At most this many functions (per thread too).
    pub limit: usize,
    /// Also a profile per thread.
    pub threads: bool,
    /// User code only: samples in the guest kernel (or entering or
    /// leaving it) left out.
    pub user_only: bool,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        ProfileOptions {
            limit: 20,
            threads: false,
            user_only: false,
        }
    }
}

pub struct Profile {
    options: ProfileOptions,
    /// Every SAMPLE event passed, `samples` those profiled.
    all: u64,
    samples: Vec<Row>,
    stacks: HashMap<u64, Vec<u64>>,
}

impl Profile {
    pub fn new(options: ProfileOptions) -> Self {
        Profile {
            options,
            all: 0,
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
            ..ReplayNeeds::default()
        }
    }

    fn event(&mut self, row: &Row) {
        self.all += 1;
        // SAMPLE's value: 0 in user code, else the kernel's time.
        if !self.options.user_only || row.value == Some(0) {
            self.samples.push(row.clone());
        }
    }

    fn wants_stacks(&self) -> bool {
        true
    }

    fn stack(&mut self, seq: u64, frames: &[u64]) {
        self.stacks.insert(seq, frames.to_vec());
    }

    fn finish(&mut self, cx: &PluginContext) -> Result<Output, PluginError> {
        let p = functions::profile(&self.samples, &self.stacks, cx.db, cx.files)?;
        if p.samples == 0 {
            let why = if self.all > 0 {
                // The same first line as a profile with user samples: a
                // program that spends its time in system calls is an
                // answer, not an error.
                format!(
                    "Profile of {}, user code only: 0 samples ({} more in the guest kernel, \
                     100.0 % of all): no sample found a sampled thread in its user code",
                    cx.label, self.all
                )
            } else {
                format!(
                    "No SAMPLE events in {}: threads are sampled once their process raised a \
                     probe event, so record the program with `insight record --probes`, then \
                     replay with --diagnose profile (or --sample-period)",
                    cx.label
                )
            };
            return Ok(Output {
                text: format!("{why}.\n"),
                json: Some(serde_json::json!({"samples": 0, "functions": [], "threads": []})),
                ..Output::default()
            });
        }
        let limit = self.options.limit;
        let boundary = if p.kernel_boundary > 0 {
            format!(", {} of them entering or leaving it", p.kernel_boundary)
        } else {
            String::new()
        };
        let mut text = match self.options.user_only {
            true => format!(
                "Profile of {}, user code only: {} samples ({} more in the guest kernel, {:.1} % \
                 of all)\n\n",
                cx.label,
                p.samples,
                self.all - p.samples,
                percent(self.all - p.samples, self.all)
            ),
            false => format!(
                "Profile of {}: {} samples ({} in the guest kernel{boundary}: {:.1} %; \
                 --user shows user code alone)\n\n",
                cx.label,
                p.samples,
                p.kernel,
                percent(p.kernel, p.samples)
            ),
        };
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
            "kernel_boundary": p.kernel_boundary,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::run;
    use crate::test_db::TestDb;
    use events::abi::{SampleMode, Source};

    /// A SAMPLE of thread 4 (pid 3) at `rip`.
    fn sample(rip: u64, mode: SampleMode) -> Row {
        Row {
            seq: 0,
            time: 1,
            kind: Kind::Sample,
            source: Source::Host,
            pid: 3,
            lwpid: 4,
            addr: Some(rip),
            caller: None,
            value: Some(mode as i64),
        }
    }

    /// The profile of `db`'s user code alone.
    fn user_profile(db: &TestDb) -> Output {
        let user = ProfileOptions {
            user_only: true,
            ..ProfileOptions::default()
        };
        let mut plugins: Vec<Box<dyn Plugin>> = vec![Box::new(Profile::new(user))];
        run(&mut plugins, &db.context()).unwrap().remove(0)
    }

    #[test]
    fn samples_at_kernel_boundaries_count_as_kernel_time_under_their_user_stack() {
        let rows = [
            sample(0x40_1000, SampleMode::User),
            sample(0x40_1000, SampleMode::User),
            sample(0xffff_ffff_8100_0000, SampleMode::Kernel),
            sample(0x40_2002, SampleMode::KernelBoundary),
            sample(0x40_2002, SampleMode::KernelBoundary),
        ];
        let stack: &[u64] = &[0x40_3005];
        let db = TestDb::with_stacks("profile-boundary", &rows, &[(4, stack), (5, stack)]);
        let mut plugins: Vec<Box<dyn Plugin>> =
            vec![Box::new(Profile::new(ProfileOptions::default()))];
        let out = run(&mut plugins, &db.context()).unwrap().remove(0);
        let json = out.json.unwrap();
        assert_eq!(json["samples"], 5);
        assert_eq!(json["kernel"], 3);
        assert_eq!(json["kernel_boundary"], 2);
        assert_eq!(json["functions"][0]["function"], "[kernel]");
        assert_eq!(json["functions"][0]["samples"], 3);
        assert!(
            out.text
                .contains("(3 in the guest kernel, 2 of them entering or leaving it: 60.0 %;"),
            "{}",
            out.text
        );
        // User code alone: the two user samples, the kernel's share said.
        let out_user = user_profile(&db);
        assert_eq!(out_user.json.as_ref().unwrap()["samples"], 2);
        assert!(
            out_user
                .text
                .contains("user code only: 2 samples (3 more in the guest kernel, 60.0 % of all)"),
            "{}",
            out_user.text
        );
        // No guest files here, so every user frame is [unknown]: the
        // caller, then the function at RIP, then the kernel's time.
        let folded = &out
            .attachments
            .iter()
            .find(|f| f.format == "folded")
            .unwrap()
            .content;
        assert!(
            folded.contains("lwpid 4;[unknown];[unknown];[kernel] 2\n"),
            "{folded}"
        );
    }

    #[test]
    fn a_program_sampled_only_in_the_kernel_gets_the_same_first_line() {
        let kernel = sample(0xffff_ffff_8100_0000, SampleMode::Kernel);
        let db = TestDb::with_stacks("profile-kernel-only", &[kernel.clone(), kernel], &[]);
        let out = user_profile(&db);
        assert_eq!(out.json.as_ref().unwrap()["samples"], 0);
        assert!(
            out.text
                .contains("user code only: 0 samples (2 more in the guest kernel, 100.0 % of all)"),
            "{}",
            out.text
        );
    }
}
