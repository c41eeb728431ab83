//! `deadlock`: potential deadlocks from the order in which threads take
//! locks; see [`lock_order`] for the detector.

use std::collections::HashMap;
use std::fmt::Write as _;

use events::abi::Kind;
use events::db::Row;
use guestfiles::Symbolizer;

use crate::event_stacks::EventStacks;
use crate::plugin::{Attachment, Output, Plugin, PluginContext, PluginError};
use crate::render::xml_escape;

pub mod input;
pub mod lock_order;

use input::DeadlockInput;
use lock_order::Cycle;

#[derive(Default)]
pub struct Deadlock {
    input: DeadlockInput,
    /// The user stacks of lock requests and thread spawns.
    stacks: EventStacks,
    /// Whether the last event passed was a lock request or a spawn.
    last_has_stack: bool,
}

impl Deadlock {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Plugin for Deadlock {
    fn name(&self) -> &'static str {
        "deadlock"
    }

    fn about(&self) -> &'static str {
        "potential deadlocks: lock-order cycles between threads that could run at the same time"
    }

    fn subscribes(&self) -> &'static [Kind] {
        // Thread segmentation counts every event a thread raised.
        &[]
    }

    fn event(&mut self, row: &Row) {
        self.last_has_stack = matches!(
            row.kind,
            Kind::Lock | Kind::TryLock | Kind::TimedLock | Kind::ThreadSpawn
        );
        self.input.push(row);
    }

    fn wants_stacks(&self) -> bool {
        true
    }

    fn stack(&mut self, seq: u64, frames: &[u64]) {
        if self.last_has_stack {
            self.stacks.add(seq, frames);
        }
    }

    fn finish(&mut self, cx: &PluginContext) -> Result<Output, PluginError> {
        let db = cx.db;
        // Threads by (pid, lwpid): an lwpid can come back in another process.
        let names: HashMap<(u32, u32), String> = db
            .threads()?
            .into_iter()
            .map(|(pid, lwpid, comm)| ((pid, lwpid), comm))
            .collect();
        let mut sym = Symbolizer::new(cx.files);
        let mut text = String::new();
        let mut html = String::new();
        let (mut blocked, mut deadlocks, mut protected) = (0, 0, 0);
        let mut cycles_json = Vec::new();
        let input = std::mem::take(&mut self.input);
        let spawned_at = input.spawned_at().clone();
        for (pid, events) in input.finish() {
            let report = lock_order::analyze(&events);
            if report.blocked.is_empty()
                && report.deadlocks.is_empty()
                && report.protected.is_empty()
            {
                continue;
            }
            let objects = db.objects(pid)?;
            // The program is the first object a process reports.
            let program = match objects.first() {
                Some((_, path)) => path.rsplit('/').next().unwrap_or(path).to_owned(),
                None => names.get(&(pid, pid)).cloned().unwrap_or_default(),
            };
            let process = if program.is_empty() {
                String::new()
            } else {
                format!(" ({program})")
            };
            sym.add_process(pid, objects);
            let _ = writeln!(text, "Process {pid}{process}");
            let _ = writeln!(html, "<h2>Process {pid}{}</h2>", xml_escape(&process));
            let groups = [
                ("Deadlocked when the recording ended", &report.blocked, true),
                ("Potential deadlock", &report.deadlocks, false),
                ("Protected by a gate lock", &report.protected, false),
            ];
            for (title, cycles, waiting) in groups {
                for (i, c) in cycles.iter().enumerate() {
                    let known = Known {
                        names: &names,
                        stacks: &self.stacks,
                        spawned_at: &spawned_at,
                    };
                    let d = describe_cycle(c, pid, &mut sym, known, waiting);
                    let gate = if d.gates.is_empty() {
                        String::new()
                    } else {
                        format!(" (gate: {})", d.gates)
                    };
                    let _ = writeln!(text, "  {title} {}{gate}: {}", i + 1, d.notation);
                    let _ = writeln!(text, "    {}", d.threads);
                    let _ = writeln!(text, "    {}", d.locks);
                    for step in &d.steps {
                        let _ = writeln!(text, "    {}", step.line);
                        for (title, frames) in step.stacks() {
                            let _ = writeln!(text, "      {title}:");
                            for (i, frame) in frames.iter().enumerate() {
                                let _ = writeln!(text, "        #{i} {frame}");
                            }
                        }
                    }
                    for (thread, frames) in &d.created {
                        let _ = writeln!(text, "    {thread} created at:");
                        for (i, frame) in frames.iter().enumerate() {
                            let _ = writeln!(text, "      #{i} {frame}");
                        }
                    }
                    let _ = writeln!(
                        html,
                        "<div class=\"cycle{}\"><h3>{title} {}{}</h3><p class=\"notation\">{}</p>\
                         <p>{}<br>{}</p><ul>{}</ul></div>",
                        if c.is_protected() { " protected" } else { "" },
                        i + 1,
                        xml_escape(&gate),
                        xml_escape(&d.notation),
                        xml_escape(&d.threads),
                        xml_escape(&d.locks),
                        d.steps.iter().map(StepText::html).collect::<String>()
                            + &d.created
                                .iter()
                                .map(|(thread, frames)| {
                                    format!(
                                        "<li>{} created at:{}</li>",
                                        xml_escape(thread),
                                        stack_html(frames)
                                    )
                                })
                                .collect::<String>()
                    );
                    cycles_json.push(serde_json::json!({
                        "pid": pid,
                        "program": program,
                        "deadlocked": waiting,
                        "protected": c.is_protected(),
                        "gates": d.gates,
                        "notation": d.notation,
                        "threads": d.threads,
                        "locks": d.locks,
                        "steps": d.steps.iter().map(|s| &s.line).collect::<Vec<_>>(),
                        "stacks": d.steps.iter().map(|s| serde_json::json!({
                            "acquired": s.acquired_stack,
                            "held": s.held_stack,
                        })).collect::<Vec<_>>(),
                        "created": d.created.iter().map(|(thread, frames)| serde_json::json!({
                            "thread": thread,
                            "frames": frames,
                        })).collect::<Vec<_>>(),
                    }));
                }
            }
            blocked += report.blocked.len();
            deadlocks += report.deadlocks.len();
            protected += report.protected.len();
        }
        let ended_in = match blocked {
            0 => String::new(),
            1 => "1 deadlock the recording ended in (threads waiting for good), ".to_owned(),
            n => format!("{n} deadlocks the recording ended in (threads waiting for good), "),
        };
        let summary = format!(
            "{ended_in}{} potential deadlock{}, {} cycle{} protected by a gate lock",
            deadlocks,
            if deadlocks == 1 { "" } else { "s" },
            protected,
            if protected == 1 { "" } else { "s" }
        );
        let mut out_text = format!("Lock-order analysis of {}: {summary}\n", cx.label);
        if !text.is_empty() {
            out_text.push('\n');
            out_text.push_str(&text);
        }
        let page = format!(
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">\
             <title>insight: potential deadlocks</title><style>\
             body{{font-family:sans-serif;margin:2em;max-width:60em}}\
             .notation{{font-family:monospace;font-size:1.1em}}\
             .cycle{{border-left:4px solid #c0392b;padding-left:1em;margin:1em 0}}\
             .cycle.protected{{border-color:#7f8c8d}}\
             ol.stack{{font-family:monospace;font-size:0.9em;margin:0.2em 0}}\
             ol.stack li{{list-style:none}}</style></head><body>\
             <h1>Potential deadlocks</h1><p>{} &mdash; {}</p>{}</body></html>\n",
            xml_escape(&cx.label),
            xml_escape(&summary),
            if html.is_empty() {
                "<p>No lock-order cycles.</p>".to_owned()
            } else {
                html
            }
        );
        let mut warnings = Vec::new();
        if let Some(why) = &cx.files_missing {
            warnings.push(format!("addresses are not symbolized: {why}"));
        }
        Ok(Output {
            text: out_text,
            json: Some(serde_json::json!({
                "deadlocked": blocked,
                "deadlocks": deadlocks,
                "protected": protected,
                "cycles": cycles_json,
            })),
            attachments: vec![Attachment {
                format: "html",
                content: page,
            }],
            warnings,
        })
    }
}

/// One cycle, described for people.
struct CycleText {
    notation: String,
    threads: String,
    locks: String,
    steps: Vec<StepText>,
    gates: String,
    /// Per thread of the cycle ("T1"), where it was created, if known.
    created: Vec<(String, Vec<String>)>,
}

/// One step of a cycle: "T1 holds L1 while taking L2 at ...", with the
/// stacks of the two acquisitions (symbolized frames, innermost first;
/// empty when the database has none).
struct StepText {
    line: String,
    acquired: String,
    acquired_stack: Vec<String>,
    held: String,
    held_stack: Vec<String>,
}

impl StepText {
    /// The stacks that are known, with their titles.
    fn stacks(&self) -> impl Iterator<Item = (String, &[String])> {
        [
            (
                format!("{} requested at", self.acquired),
                &self.acquired_stack,
            ),
            (format!("{} taken before, at", self.held), &self.held_stack),
        ]
        .into_iter()
        .filter(|(_, frames)| !frames.is_empty())
        .map(|(title, frames)| (title, frames.as_slice()))
    }

    fn html(&self) -> String {
        let mut li = format!("<li>{}", xml_escape(&self.line));
        for (title, frames) in self.stacks() {
            let _ = write!(li, "<br>{}:{}", xml_escape(&title), stack_html(frames));
        }
        li.push_str("</li>");
        li
    }
}

/// Symbolized frames as a numbered list.
fn stack_html(frames: &[String]) -> String {
    let mut ol = String::from("<ol class=\"stack\">");
    for (i, f) in frames.iter().enumerate() {
        let _ = write!(ol, "<li>#{i} {}</li>", xml_escape(f));
    }
    ol.push_str("</ol>");
    ol
}

/// What a cycle's description draws on besides the cycle.
struct Known<'a> {
    /// Threads' names by (pid, lwpid).
    names: &'a HashMap<(u32, u32), String>,
    /// The stacks of lock requests and thread spawns.
    stacks: &'a EventStacks,
    /// Per created thread, the THREADSPAWN that created it.
    spawned_at: &'a HashMap<(u32, u32), u64>,
}

/// Describes cycle `c` of process `pid`; `waiting`: its threads still
/// wait for the locks they asked for.
fn describe_cycle(
    c: &Cycle,
    pid: u32,
    sym: &mut Symbolizer,
    known: Known,
    waiting: bool,
) -> CycleText {
    let Known {
        names,
        stacks,
        spawned_at,
    } = known;
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
            let comm = names
                .get(&(pid, l))
                .map(|n| format!(" ({n})"))
                .unwrap_or_default();
            format!("{} = thread {l}{comm}", t(l))
        })
        .collect::<Vec<_>>()
        .join(", ");
    let locks_text = locks
        .iter()
        .map(|&l| format!("{} = {l:#x}", name(l)))
        .collect::<Vec<_>>()
        .join(", ");
    let created = lwpids
        .iter()
        .filter_map(|&l| {
            let stack = sym.describe_stack(pid, stacks.get(*spawned_at.get(&(pid, l))?)?);
            (!stack.is_empty()).then(|| (t(l), stack))
        })
        .collect();
    let steps = c
        .steps
        .iter()
        .map(|s| {
            let at = if s.site == 0 {
                String::new()
            } else {
                format!(" at {}", sym.describe_return(pid, s.site))
            };
            StepText {
                line: format!(
                    "{} holds {} {} {}{at}",
                    t(s.thread),
                    name(s.held),
                    if waiting {
                        "and waits for"
                    } else {
                        "while taking"
                    },
                    name(s.acquired)
                ),
                acquired: name(s.acquired),
                acquired_stack: stacks
                    .get(s.acquired_at)
                    .map_or_else(Vec::new, |st| sym.describe_stack(pid, st)),
                held: name(s.held),
                held_stack: stacks
                    .get(s.held_at)
                    .map_or_else(Vec::new, |st| sym.describe_stack(pid, st)),
            }
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
        created,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::run;
    use crate::test_db::{probe_row, TestDb};

    #[test]
    fn each_step_and_each_thread_shows_its_stacks() {
        let on = |lwpid: u32, kind: Kind, addr: u64, caller: u64, value: Option<i64>| {
            let mut r = probe_row(0, kind, value);
            (r.lwpid, r.addr, r.caller) = (lwpid, Some(addr), Some(caller));
            r
        };
        let (a, b) = (0xa0, 0xb0);
        let mut rows = vec![
            // Thread 2 creates threads 3 and 4: each THREADCREATE names
            // the creator's event count right after its THREADSPAWN.
            on(2, Kind::ThreadSpawn, 0x500, 0x1001, None),
            on(2, Kind::ThreadSpawn, 0x600, 0x1101, None),
            on(3, Kind::ThreadCreate, 0x500, 1, Some(2)),
            on(4, Kind::ThreadCreate, 0x600, 2, Some(2)),
        ];
        for (t, first, second) in [(3, a, b), (4, b, a)] {
            rows.extend([
                on(t, Kind::Lock, first, 0x3001, None),
                on(t, Kind::LockRet, first, 0x3001, Some(0)),
                on(t, Kind::Lock, second, 0x3011, None),
                on(t, Kind::LockRet, second, 0x3011, Some(0)),
                on(t, Kind::Unlock, second, 0x3021, None),
                on(t, Kind::Unlock, first, 0x3031, None),
            ]);
        }
        for (time, r) in rows.iter_mut().enumerate() {
            r.time = time as u64 + 1;
        }
        // Sequence numbers start at 1; requests are the 5th, 7th, 11th
        // and 13th events.
        let stacks: [(u64, &[u64]); 6] = [
            (1, &[0x1001, 0x2001]),
            (2, &[0x1101, 0x2001]),
            (5, &[0x3001, 0x4001]),
            (7, &[0x3011, 0x4001]),
            (11, &[0x3001, 0x4101]),
            (13, &[0x3011, 0x4101]),
        ];
        let db = TestDb::with_stacks("deadlock-stacks", &rows, &stacks);
        let mut plugins: Vec<Box<dyn Plugin>> = vec![Box::new(Deadlock::new())];
        let out = run(&mut plugins, &db.context()).unwrap().remove(0);
        assert!(out.text.contains("1 potential deadlock,"), "{}", out.text);
        // No symbols here: frames are addresses, at their calls.
        for expected in [
            "L2 requested at:\n        #0 0x3010\n        #1 0x4000\n",
            "L1 taken before, at:\n        #0 0x3000\n        #1 0x4000\n",
            "L1 requested at:\n        #0 0x3010\n        #1 0x4100\n",
            "T1 created at:\n      #0 0x1000\n      #1 0x2000\n",
            "T2 created at:\n      #0 0x1100\n      #1 0x2000\n",
        ] {
            assert!(out.text.contains(expected), "{expected}\n{}", out.text);
        }
        let json = out.json.clone().unwrap();
        let cycle = &json["cycles"][0];
        assert_eq!(cycle["created"].as_array().unwrap().len(), 2, "{cycle}");
        assert_eq!(cycle["stacks"][0]["acquired"][1], "0x4000", "{cycle}");
        let page = out.attachment("html").unwrap();
        assert!(page.contains("T2 created at:<ol class=\"stack\"><li>#0 0x1100</li>"));
    }
}
