//! `timeline`: what every thread did over the recording's time — when it
//! ran, which lock it waited for and which it held, who woke it, where it
//! was sampled — as the Trace Event Format that Perfetto and
//! chrome://tracing open ([`trace_event`]) and as a self-contained page
//! ([`page`]). [`model`] builds the slices from the events.

use std::collections::HashMap;
use std::fmt::Write as _;

use events::abi::Kind;
use events::db::Row;
use guestfiles::Symbolizer;

use crate::event_stacks::EventStacks;
use crate::plugin::{Attachment, Context, Output, Plugin, PluginError};
use crate::plugins::locks::lock_names;

pub mod model;
pub mod page;
pub mod trace_event;

use model::{Builder, SliceKind, Tid, Window};

/// The kinds the timeline reads.
const KINDS: [Kind; 15] = [
    Kind::Lock,
    Kind::LockRet,
    Kind::TryLock,
    Kind::TryLockRet,
    Kind::TimedLock,
    Kind::TimedLockRet,
    Kind::Unlock,
    Kind::LockInit,
    Kind::ThreadCreate,
    Kind::ThreadSpawn,
    Kind::ThreadJoin,
    Kind::Exit,
    Kind::Fork,
    Kind::ContextSwitch,
    Kind::Sample,
];

/// At most this many frames of a stack are shown.
const MAX_FRAMES: usize = 16;

#[derive(Default)]
pub struct Timeline {
    window: Option<Window>,
    builder: Builder,
    stacks: EventStacks,
    /// Whether the last event passed has a stack worth keeping.
    last_has_stack: bool,
}

impl Timeline {
    /// The timeline of the whole recording, or of `window` of it.
    pub fn new(window: Option<Window>) -> Self {
        Timeline {
            window,
            ..Timeline::default()
        }
    }
}

impl Plugin for Timeline {
    fn name(&self) -> &'static str {
        "timeline"
    }

    fn about(&self) -> &'static str {
        "threads, lock waits and holds, context switches and samples over time, for Perfetto \
         (JSON) and as a page"
    }

    fn subscribes(&self) -> &'static [Kind] {
        &KINDS
    }

    fn event(&mut self, row: &Row) {
        self.last_has_stack = matches!(
            row.kind,
            Kind::Lock | Kind::TryLock | Kind::TimedLock | Kind::Sample
        );
        self.builder.push(row);
    }

    fn wants_stacks(&self) -> bool {
        true
    }

    fn stack(&mut self, seq: u64, frames: &[u64]) {
        if self.last_has_stack {
            self.stacks
                .add(seq, &frames[..frames.len().min(MAX_FRAMES)]);
        }
    }

    fn beside_events(&self) -> &'static [&'static str] {
        &["json", "html"]
    }

    fn finish(&mut self, cx: &Context) -> Result<Output, PluginError> {
        let mut b = std::mem::take(&mut self.builder);
        b.finish();
        let window = self.window.unwrap_or(Window::ALL);
        let view = View::new(&b, window, &self.stacks, cx)?;
        let mut text = format!(
            "Timeline of {}: {} threads, {} lock holds, {} waits ({} woken by another thread's \
             release), {} runs on the CPU, {} samples",
            cx.label,
            view.threads.len(),
            view.count(SliceKind::Hold),
            view.count(SliceKind::Wait),
            view.slices().filter(|(_, s)| s.woken_by.is_some()).count(),
            view.runs().count(),
            view.samples().count(),
        );
        match (b.first, window == Window::ALL) {
            (None, _) => text.push_str("; no events\n"),
            (Some(first), true) => {
                let _ = writeln!(
                    text,
                    " over {} ms (guest time {} ms to {} ms)",
                    ms(b.last.saturating_sub(first)),
                    ms(first),
                    ms(b.last)
                );
            }
            (Some(_), false) => {
                let _ = writeln!(
                    text,
                    " in the window {} ms to {} ms",
                    ms(window.from),
                    ms(window.to.min(b.last))
                );
            }
        }
        text.push_str(
            "Open it with `insight report timeline DB -o FILE.json` (Perfetto, chrome://tracing) \
             or `-o FILE.html` (a page for any browser).\n",
        );
        let mut warnings = Vec::new();
        if b.anomalies > 0 {
            warnings.push(format!(
                "{} lock events contradict the lock model and are not drawn",
                b.anomalies
            ));
        }
        if let Some(why) = &cx.files_missing {
            warnings.push(format!("locks and stacks are not named: {why}"));
        }
        let json = serde_json::json!({
            "threads": view.threads.len(),
            "holds": view.count(SliceKind::Hold),
            "waits": view.count(SliceKind::Wait),
            "failed": view.count(SliceKind::Failed),
            "runs": view.runs().count(),
            "samples": view.samples().count(),
            "from_ns": window.from,
            "to_ns": window.to.min(b.last),
        });
        Ok(Output {
            text,
            json: Some(json),
            attachments: vec![
                Attachment {
                    format: "json",
                    content: trace_event::write(&view, &cx.label),
                },
                Attachment {
                    format: "html",
                    content: page::write(&view, &cx.label),
                },
            ],
            warnings,
        })
    }
}

fn ms(ns: u64) -> String {
    format!("{:.3}", ns as f64 / 1e6)
}

/// A thread's row: its track and the lanes its out-of-order slices need.
pub struct ThreadRow {
    pub tid: Tid,
    pub name: String,
    pub lanes: u32,
}

/// The timeline cut to a window, with everything named: what both
/// renderings draw.
pub struct View<'a> {
    pub b: &'a Builder,
    pub window: Window,
    pub threads: Vec<ThreadRow>,
    /// Thread -> its index in `threads`.
    pub row_of: HashMap<Tid, usize>,
    /// Task -> its name ("syn_cont 81"), for the CPU track too.
    pub task_names: HashMap<Tid, String>,
    pub lock_names: HashMap<u64, String>,
    /// Distinct stacks, innermost frame first, each frame described.
    pub stacks: Vec<Vec<String>>,
    /// Per slice of `b.slices`, its request's stack.
    pub slice_stack: Vec<Option<usize>>,
    /// Per sample of `b.samples`: its function and its stack.
    pub sample_function: Vec<String>,
    pub sample_stack: Vec<Option<usize>>,
}

impl<'a> View<'a> {
    fn new(
        b: &'a Builder,
        window: Window,
        event_stacks: &EventStacks,
        cx: &Context,
    ) -> Result<Self, PluginError> {
        let mut task_names: HashMap<Tid, String> = cx
            .db
            .threads()?
            .into_iter()
            .map(|(pid, lwpid, comm)| ((pid, lwpid), format!("{comm} {lwpid}")))
            .collect();
        let threads: Vec<ThreadRow> = b
            .threads
            .iter()
            .map(|&tid| ThreadRow {
                tid,
                name: task_names
                    .entry(tid)
                    .or_insert_with(|| format!("thread {}", tid.1))
                    .clone(),
                lanes: b.lanes.get(&tid).map_or(1, |l| l.len() as u32),
            })
            .collect();
        for r in &b.runs {
            task_names
                .entry(r.tid)
                .or_insert_with(|| format!("task {}/{}", r.tid.0, r.tid.1));
        }
        let row_of = threads
            .iter()
            .enumerate()
            .map(|(i, t)| (t.tid, i))
            .collect();
        let lock_names = lock_names(cx, &b.first_user, &b.init_site)?;

        let mut sym = Symbolizer::new(cx.files);
        let mut pids: Vec<u32> = b.threads.iter().map(|t| t.0).collect();
        pids.dedup();
        for pid in pids {
            sym.add_process(pid, cx.db.objects(pid)?);
        }
        let mut names = Names::default();
        let mut slice_stack = Vec::with_capacity(b.slices.len());
        for s in &b.slices {
            let frames = match event_stacks.get(s.request) {
                Some(f) => f.to_vec(),
                None if s.site != 0 => vec![s.site],
                None => Vec::new(),
            };
            let described: Vec<String> = frames
                .iter()
                .map(|&ra| names.describe(&mut sym, s.tid.0, ra))
                .collect();
            slice_stack.push(names.stack(described));
        }
        let mut sample_function = Vec::with_capacity(b.samples.len());
        let mut sample_stack = Vec::with_capacity(b.samples.len());
        for s in &b.samples {
            let function = if s.user {
                sym.locate(s.tid.0, s.rip).function
            } else {
                sym.locate_kernel(s.rip).function
            };
            let mut described = vec![if s.user {
                sym.describe_code(s.tid.0, s.rip)
            } else {
                format!("{function} in [kernel]")
            }];
            for &ra in event_stacks.get(s.seq).unwrap_or_default() {
                described.push(names.describe(&mut sym, s.tid.0, ra));
            }
            sample_function.push(function);
            sample_stack.push(names.stack(described));
        }
        Ok(View {
            b,
            window,
            threads,
            row_of,
            task_names,
            lock_names,
            stacks: names.stacks,
            slice_stack,
            sample_function,
            sample_stack,
        })
    }

    /// The lock as the lock reports name it, else its address.
    pub fn lock_name(&self, lock: u64) -> String {
        self.lock_names
            .get(&lock)
            .cloned()
            .unwrap_or_else(|| format!("{lock:#x}"))
    }

    /// The slices in the window, with their indices.
    pub fn slices(&self) -> impl Iterator<Item = (usize, &model::Slice)> {
        self.b
            .slices
            .iter()
            .enumerate()
            .filter(|(_, s)| self.window.overlaps(s.start, s.end))
    }

    fn count(&self, kind: SliceKind) -> usize {
        self.slices().filter(|(_, s)| s.kind == kind).count()
    }

    pub fn runs(&self) -> impl Iterator<Item = &model::Run> {
        self.b
            .runs
            .iter()
            .filter(|r| self.window.overlaps(r.start, r.end))
    }

    /// The samples in the window, with their indices.
    pub fn samples(&self) -> impl Iterator<Item = (usize, &model::Sample)> {
        self.b
            .samples
            .iter()
            .enumerate()
            .filter(|(_, s)| self.window.contains(s.time))
    }

    pub fn instants(&self) -> impl Iterator<Item = &model::Instant> {
        self.b
            .instants
            .iter()
            .filter(|i| self.window.contains(i.time))
    }
}

/// Frames described once each, stacks kept once each.
#[derive(Default)]
struct Names {
    frames: HashMap<(u32, u64), String>,
    ids: HashMap<Vec<String>, usize>,
    stacks: Vec<Vec<String>>,
}

impl Names {
    fn describe(&mut self, sym: &mut Symbolizer, pid: u32, ra: u64) -> String {
        self.frames
            .entry((pid, ra))
            .or_insert_with(|| sym.describe_return(pid, ra))
            .clone()
    }

    fn stack(&mut self, frames: Vec<String>) -> Option<usize> {
        if frames.is_empty() {
            return None;
        }
        let next = self.stacks.len();
        let id = *self.ids.entry(frames.clone()).or_insert(next);
        if id == next {
            self.stacks.push(frames);
        }
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::run;
    use crate::test_db::TestDb;
    use events::abi::Source;

    pub(super) fn lock_rows() -> Vec<Row> {
        let row = |time, lwpid, kind, value| Row {
            seq: 0,
            time,
            kind,
            source: Source::Probe,
            pid: 7,
            lwpid,
            addr: Some(0xa0),
            caller: Some(0x4010),
            value,
        };
        let switch = |time, from: u32, to: i64| Row {
            seq: 0,
            time,
            kind: Kind::ContextSwitch,
            source: Source::Kernel,
            pid: 7,
            lwpid: from,
            addr: Some(7),
            caller: None,
            value: Some(to),
        };
        vec![
            switch(0, 0, 8),
            row(1_000, 8, Kind::Lock, None),
            row(1_500, 8, Kind::LockRet, Some(0)),
            switch(2_000, 8, 9),
            row(2_500, 9, Kind::Lock, None),
            switch(3_000, 9, 8),
            row(4_000, 8, Kind::Unlock, None),
            switch(4_100, 8, 9),
            row(4_200, 9, Kind::LockRet, Some(0)),
            Row {
                seq: 0,
                time: 4_300,
                kind: Kind::Sample,
                source: Source::Host,
                pid: 7,
                lwpid: 9,
                addr: Some(0x4444),
                caller: None,
                value: Some(0),
            },
            row(5_000, 9, Kind::Unlock, None),
            row(5_100, 9, Kind::Exit, Some(0)),
        ]
    }

    #[test]
    fn the_summary_counts_what_is_drawn_and_a_window_cuts_it() {
        let db = TestDb::with_stacks("timeline-summary", &lock_rows(), &[(5, &[0x4011, 0x4022])]);
        let mut plugins: Vec<Box<dyn Plugin>> = vec![
            Box::new(Timeline::new(None)),
            Box::new(Timeline::new(Some(Window {
                from: 4_150,
                to: 4_250,
            }))),
        ];
        let out = run(&mut plugins, &db.context()).unwrap();
        let all = out[0].json.as_ref().unwrap();
        assert_eq!(all["threads"], 2);
        assert_eq!(all["holds"], 2);
        assert_eq!(all["waits"], 2);
        assert_eq!(all["runs"], 4);
        assert_eq!(all["samples"], 1);
        assert!(out[0].text.contains("1 woken by another thread's release"));
        let cut = out[1].json.as_ref().unwrap();
        // Thread 9's wait (2500-4200) and hold (4200-5000), thread 8's
        // last run ended at 4100.
        assert_eq!(
            (&cut["waits"], &cut["holds"], &cut["runs"]),
            (&1.into(), &1.into(), &1.into())
        );
        assert_eq!(cut["samples"], 0);
        assert!(out[0].attachment("json").is_some() && out[0].attachment("html").is_some());
    }
}
