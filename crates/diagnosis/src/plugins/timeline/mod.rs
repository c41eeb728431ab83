//! `timeline`: what every thread did over the recording's time — when it
//! ran, which lock it waited for and which it held, who woke it, where it
//! was sampled — as the Trace Event Format that Perfetto and
//! chrome://tracing open ([`trace_event`]) and as a self-contained page
//! ([`page`]). [`model`] builds the slices from the events.

use std::fmt::Write as _;

use events::abi::Kind;
use events::db::Row;

use crate::event_stacks::EventStacks;
use crate::plugin::{Attachment, Output, Plugin, PluginContext, PluginError};

pub mod model;
pub mod page;
pub mod trace_event;
mod view;

use model::{Builder, SliceKind, Window};
pub use view::{ThreadRow, View};

/// The kinds the timeline reads.
const KINDS: [Kind; 24] = [
    Kind::Lock,
    Kind::LockRet,
    Kind::TryLock,
    Kind::TryLockRet,
    Kind::TimedLock,
    Kind::TimedLockRet,
    Kind::Unlock,
    Kind::LockInit,
    Kind::RwLock,
    Kind::RwLockRet,
    Kind::RwUnlock,
    Kind::CondWait,
    Kind::CondWaitRet,
    Kind::Barrier,
    Kind::BarrierRet,
    Kind::SemWait,
    Kind::SemWaitRet,
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
        "threads, lock waits and holds, condition variable, barrier and semaphore waits, \
         context switches and samples over time, for Perfetto (JSON) and as a page"
    }

    fn subscribes(&self) -> &'static [Kind] {
        &KINDS
    }

    fn event(&mut self, row: &Row) {
        // The requests' stacks, which their slices show.
        self.last_has_stack = row.kind == Kind::Sample
            || (row.kind.keeps_stack()
                && !matches!(row.kind, Kind::Unlock | Kind::RwUnlock | Kind::LockInit));
        self.builder.push(row);
    }

    fn wants_stacks(&self) -> bool {
        true
    }

    fn stack(&mut self, seq: u64, frames: &[u64]) {
        self.builder.names.stack(frames);
        if self.last_has_stack {
            self.stacks
                .add(seq, &frames[..frames.len().min(MAX_FRAMES)]);
        }
    }

    fn beside_events(&self) -> &'static [&'static str] {
        &["json", "html"]
    }

    fn finish(&mut self, cx: &PluginContext) -> Result<Output, PluginError> {
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
