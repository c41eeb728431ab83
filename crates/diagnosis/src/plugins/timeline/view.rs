//! The timeline cut to a window, with every thread, lock, frame and stack
//! named: what both renderings ([`super::trace_event`], [`super::page`])
//! draw.

use std::collections::HashMap;

use super::model::{self, Builder, SliceKind, Tid, Window};
use crate::event_stacks::EventStacks;
use crate::plugin::{PluginContext, PluginError};
use guestfiles::Symbolizer;

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
    pub(super) fn new(
        b: &'a Builder,
        window: Window,
        event_stacks: &EventStacks,
        cx: &PluginContext,
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
        let lock_names = b.names.names(cx)?;

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

    pub(super) fn count(&self, kind: SliceKind) -> usize {
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
