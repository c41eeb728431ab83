//! The plugin interface every diagnosis tool implements.
//!
//! A plugin names the event kinds it reads, may ask the replay for
//! something (samples at some period), receives the events of its kinds in
//! capture order, and at the end produces its output: text for people,
//! optionally JSON and files (CSV, HTML, folded stacks, SVG). [`run`] reads
//! an event database once for any number of plugins. `docs/plugins.md`
//! shows how to write one; [`crate::plugins`] holds the built-in ones.

use std::time::Duration;

use events::abi::Kind;
use events::db::{DbError, EventDb, Row};

use guestfiles::GuestFiles;

/// What a plugin needs the replay to collect besides the events the guest
/// raises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayNeeds {
    /// SAMPLE events about this often, unless the user chose a period.
    pub sample_period: Option<Duration>,
    /// The MEMACCESS events of a process traced at replay: the recorded
    /// command's, unless the user chose one (`--trace-process`).
    pub traced_process: bool,
}

/// What a plugin's analysis can see besides its events.
pub struct PluginContext<'a> {
    /// The database the events came from (threads, objects, stacks, the
    /// capture's anomalies).
    pub db: &'a EventDb,
    /// The guest's files (ELF files for symbols); empty when unavailable.
    pub files: &'a GuestFiles,
    /// Why `files` is empty, when it is.
    pub files_missing: Option<String>,
    /// How the database is named in output.
    pub label: String,
}

/// A file a plugin offers besides its text; the CLI decides where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// Its format: "csv", "html", "folded", "svg", ...
    pub format: &'static str,
    pub content: String,
}

/// What a plugin produced.
#[derive(Clone, Debug, Default)]
pub struct Output {
    /// The report for people.
    pub text: String,
    /// The same content for programs, if the plugin has a JSON form.
    pub json: Option<serde_json::Value>,
    /// Other renderings.
    pub attachments: Vec<Attachment>,
    /// Things the user should know about the input (standard error).
    pub warnings: Vec<String>,
}

impl Output {
    /// The attachment of `format`, if the plugin produced one.
    pub fn attachment(&self, format: &str) -> Option<&str> {
        self.attachments
            .iter()
            .find(|a| a.format == format)
            .map(|a| a.content.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error(transparent)]
    Db(#[from] DbError),
    /// The plugin cannot produce its report from this input.
    #[error("{0}")]
    Input(String),
}

/// One diagnosis tool.
pub trait Plugin {
    /// Its name on the command line (`--diagnose NAME`).
    fn name(&self) -> &'static str;

    /// One line saying what it tells.
    fn about(&self) -> &'static str;

    /// The event kinds it reads; empty for all.
    fn subscribes(&self) -> &'static [Kind];

    /// What the replay must collect for it.
    fn replay_needs(&self) -> ReplayNeeds {
        ReplayNeeds::default()
    }

    /// One event of a subscribed kind, in capture order. Input comes from
    /// the guest: count what does not make sense, never panic.
    fn event(&mut self, row: &Row);

    /// Whether it wants the stacks of SAMPLE events ([`Plugin::stack`]).
    fn wants_stacks(&self) -> bool {
        false
    }

    /// The user stack of the event just passed to [`Plugin::event`]:
    /// return addresses, innermost first. Called only if
    /// [`Plugin::wants_stacks`], and only for events that have one.
    fn stack(&mut self, _seq: u64, _frames: &[u64]) {}

    /// The attachments (by format) that `replay --diagnose` writes next
    /// to the event database, as `STEM.NAME.FORMAT` (events.timeline.json
    /// beside events.db); the others go out only when asked for.
    fn beside_events(&self) -> &'static [&'static str] {
        &[]
    }

    /// After the last event: the analysis and its output.
    fn finish(&mut self, cx: &PluginContext) -> Result<Output, PluginError>;
}

/// Feeds the events of `cx.db` to every plugin (one pass over the
/// database for all of them), then collects their outputs in order.
pub fn run(
    plugins: &mut [Box<dyn Plugin>],
    cx: &PluginContext,
) -> Result<Vec<Output>, PluginError> {
    let all = plugins.iter().any(|p| p.subscribes().is_empty());
    let mut kinds: Vec<Kind> = Vec::new();
    if !all {
        for p in plugins.iter() {
            for k in p.subscribes() {
                if !kinds.contains(k) {
                    kinds.push(*k);
                }
            }
        }
    }
    let wants: Vec<(Vec<Kind>, bool)> = plugins
        .iter()
        .map(|p| (p.subscribes().to_vec(), p.wants_stacks()))
        .collect();
    let mut deliver = |row: Row, stack: Option<&[u64]>| {
        for (p, (kinds, stacks)) in plugins.iter_mut().zip(&wants) {
            if kinds.is_empty() || kinds.contains(&row.kind) {
                p.event(&row);
                if let (true, Some(frames)) = (*stacks, stack) {
                    p.stack(row.seq, frames);
                }
            }
        }
        Ok(())
    };
    if all || !kinds.is_empty() {
        if wants.iter().any(|(_, stacks)| *stacks) {
            cx.db.for_each_with_stacks(&kinds, deliver)?;
        } else {
            cx.db.for_each(&kinds, |row| deliver(row, None))?;
        }
    }
    plugins.iter_mut().map(|p| p.finish(cx)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_db::TestDb;
    use events::abi::Source;

    /// Counts what it receives.
    struct Counter {
        kinds: &'static [Kind],
        seen: Vec<(u64, Kind)>,
    }

    impl Plugin for Counter {
        fn name(&self) -> &'static str {
            "counter"
        }
        fn about(&self) -> &'static str {
            "counts events"
        }
        fn subscribes(&self) -> &'static [Kind] {
            self.kinds
        }
        fn event(&mut self, row: &Row) {
            self.seen.push((row.seq, row.kind));
        }
        fn finish(&mut self, _: &PluginContext) -> Result<Output, PluginError> {
            Ok(Output {
                text: format!("{:?}", self.seen),
                ..Output::default()
            })
        }
    }

    #[test]
    fn dispatches_subscribed_kinds_in_order() {
        let rows: Vec<Row> = [(1, Kind::Lock), (2, Kind::Sample), (3, Kind::Unlock)]
            .into_iter()
            .map(|(time, kind)| Row {
                seq: 0,
                time,
                kind,
                source: Source::Probe,
                pid: 1,
                lwpid: 1,
                addr: Some(8),
                caller: None,
                value: None,
            })
            .collect();
        let db = TestDb::with_rows("plugin", &rows);
        let mut plugins: Vec<Box<dyn Plugin>> = vec![
            Box::new(Counter {
                kinds: &[Kind::Unlock, Kind::Lock],
                seen: Vec::new(),
            }),
            Box::new(Counter {
                kinds: &[],
                seen: Vec::new(),
            }),
            Box::new(Counter {
                kinds: &[Kind::Exit],
                seen: Vec::new(),
            }),
        ];
        let out = run(&mut plugins, &db.context()).unwrap();
        let seq = |o: &Output| o.text.clone();
        assert_eq!(seq(&out[0]), "[(1, Lock), (3, Unlock)]");
        assert_eq!(seq(&out[1]), "[(1, Lock), (2, Sample), (3, Unlock)]");
        assert_eq!(seq(&out[2]), "[]");
    }

    /// Keeps the stacks it is given.
    struct Stacks(Vec<(u64, Vec<u64>)>);

    impl Plugin for Stacks {
        fn name(&self) -> &'static str {
            "stacks"
        }
        fn about(&self) -> &'static str {
            "stacks"
        }
        fn subscribes(&self) -> &'static [Kind] {
            &[Kind::Sample]
        }
        fn event(&mut self, _: &Row) {}
        fn wants_stacks(&self) -> bool {
            true
        }
        fn stack(&mut self, seq: u64, frames: &[u64]) {
            self.0.push((seq, frames.to_vec()));
        }
        fn finish(&mut self, _: &PluginContext) -> Result<Output, PluginError> {
            Ok(Output {
                text: format!("{:?}", self.0),
                ..Output::default()
            })
        }
    }

    #[test]
    fn stacks_reach_the_plugins_that_want_them() {
        let rows: Vec<Row> = [Kind::Sample, Kind::Lock, Kind::Sample, Kind::Sample]
            .into_iter()
            .map(|kind| Row {
                seq: 0,
                time: 1,
                kind,
                source: Source::Host,
                pid: 1,
                lwpid: 1,
                addr: Some(0x40_0000),
                caller: None,
                value: Some(0),
            })
            .collect();
        let db = TestDb::with_stacks("stacks", &rows, &[(1, &[7, 8]), (4, &[9])]);
        let mut plugins: Vec<Box<dyn Plugin>> = vec![
            Box::new(Stacks(Vec::new())),
            Box::new(Counter {
                kinds: &[Kind::Sample],
                seen: Vec::new(),
            }),
        ];
        let out = run(&mut plugins, &db.context()).unwrap();
        assert_eq!(out[0].text, "[(1, [7, 8]), (4, [9])]");
        assert_eq!(out[1].text, "[(1, Sample), (3, Sample), (4, Sample)]");
    }
}
