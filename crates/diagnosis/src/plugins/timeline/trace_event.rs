//! The timeline in the Trace Event Format: the JSON that Perfetto's UI
//! (ui.perfetto.dev) and chrome://tracing open.
//!
//! - one process per guest process, one thread track per guest thread
//!   (named as `report threads` names it: "comm lwpid"); a thread whose
//!   releases came out of order gets extra tracks ("… lane 2") so that
//!   slices on every track nest;
//! - complete events (`"ph":"X"`): `wait L` (request to acquisition),
//!   `hold L` (acquisition to release), `failed L` (a trylock that failed,
//!   a timedlock that timed out), each with its request's call stack
//!   (`sf`, into `stackFrames`, a tree: frames stacks share are written
//!   once);
//! - flows (`bind_id`, `flow_out` on the hold whose release woke a waiter,
//!   `flow_in` on that waiter's wait);
//! - instants (`"ph":"i"`) for thread creation, exit, joins and forks
//!   (named by the event: `THREADCREATE`), and for samples (named by their
//!   function, with their stack);
//! - a process "CPU" with one track: which task the guest's vCPU ran, from
//!   the context switches.
//!
//! Timestamps are microseconds (with nanosecond decimals) of the recorded
//! run's guest time, since the VM started.

use std::collections::HashMap;
use std::fmt::Write as _;

use super::model::SliceKind;
use super::view::View;
use crate::render::json_string;

/// The pid of the CPU's process (no guest process has it: pid 0 is the
/// idle task, never drawn).
const CPU_PID: u32 = 0;
/// Extra lanes of a thread are tracks with these tids: lwpid + lane <<
/// LANE_SHIFT (lwpids stay below 2^22).
const LANE_SHIFT: u32 = 22;

/// The whole trace as JSON text.
pub fn write(view: &View, label: &str) -> String {
    let mut w = Writer::default();
    let frames = FrameTree::new(&view.stacks);
    let _ = write!(
        w.out,
        "{},\"database\":{},\"from_ns\":{},\"to_ns\":{}}},\n\"displayTimeUnit\":\"ns\",\n\
         \"traceEvents\":[\n",
        crate::TIMELINE_MARK,
        json_string(label),
        view.window.from,
        view.window.to.min(view.b.last)
    );
    w.metadata(view);
    for (i, s) in view.slices() {
        let (start, end) = view.window.clip(s.start, s.end);
        let tid = s.tid.1 | (s.lane << LANE_SHIFT);
        let name = format!("{} {}", s.kind.verb(), view.lock_name(s.lock));
        w.begin("X", s.tid.0, tid, start);
        let _ = write!(
            w.out,
            ",\"dur\":{},\"name\":{}",
            dur(end - start),
            json_string(&name)
        );
        if let Some(stack) = view.slice_stack[i] {
            let _ = write!(w.out, ",\"sf\":\"{}\"", frames.innermost[stack]);
        }
        match (s.wakes, s.woken_by) {
            (Some(id), _) if s.kind == SliceKind::Hold => {
                let _ = write!(w.out, ",\"bind_id\":{id},\"flow_out\":true");
            }
            (_, Some(id)) => {
                let _ = write!(w.out, ",\"bind_id\":{id},\"flow_in\":true");
            }
            _ => {}
        }
        if s.unfinished {
            w.out.push_str(",\"args\":{\"unfinished\":true}");
        }
        w.end();
    }
    for r in view.runs() {
        let (start, end) = view.window.clip(r.start, r.end);
        let name = view
            .task_names
            .get(&r.tid)
            .cloned()
            .unwrap_or_else(|| format!("task {}/{}", r.tid.0, r.tid.1));
        w.begin("X", CPU_PID, 0, start);
        let _ = write!(
            w.out,
            ",\"dur\":{},\"name\":{}",
            dur(end - start),
            json_string(&name)
        );
        w.end();
    }
    for i in view.instants() {
        w.begin("i", i.tid.0, i.tid.1, i.time);
        let _ = write!(w.out, ",\"s\":\"t\",\"name\":\"{}\"", i.kind.name());
        if let Some(v) = i.value {
            let _ = write!(w.out, ",\"args\":{{\"value\":{v}}}");
        }
        w.end();
    }
    for (i, s) in view.samples() {
        w.begin("i", s.tid.0, s.tid.1, s.time);
        let _ = write!(
            w.out,
            ",\"s\":\"t\",\"name\":{}",
            json_string(&view.sample_function[i])
        );
        if let Some(stack) = view.sample_stack[i] {
            let _ = write!(w.out, ",\"sf\":\"{}\"", frames.innermost[stack]);
        }
        w.end();
    }
    w.out.push_str("\n],\n\"stackFrames\":{");
    frames.write(&mut w.out);
    w.out.push_str("}}\n");
    w.out
}

/// The stacks as a tree for `stackFrames`: a node per distinct (caller
/// node, frame), so the frames stacks share (the thread's start, the
/// worker loop) are written once. Node ids are decimal strings.
struct FrameTree<'a> {
    /// (name, parent node).
    nodes: Vec<(&'a str, Option<usize>)>,
    /// Per stack of the view, its innermost frame's node.
    innermost: Vec<usize>,
}

impl<'a> FrameTree<'a> {
    fn new(stacks: &'a [Vec<String>]) -> Self {
        let mut nodes = Vec::new();
        let mut ids: HashMap<(Option<usize>, &str), usize> = HashMap::new();
        let innermost = stacks
            .iter()
            .map(|frames| {
                let mut parent = None;
                for frame in frames.iter().rev() {
                    let next = nodes.len();
                    let id = *ids.entry((parent, frame.as_str())).or_insert(next);
                    if id == next {
                        nodes.push((frame.as_str(), parent));
                    }
                    parent = Some(id);
                }
                parent.expect("stacks are never empty")
            })
            .collect();
        FrameTree { nodes, innermost }
    }

    fn write(&self, out: &mut String) {
        for (id, (name, parent)) in self.nodes.iter().enumerate() {
            let sep = if id > 0 { "," } else { "" };
            let _ = write!(out, "{sep}\n\"{id}\":{{\"name\":{}", json_string(name));
            if let Some(p) = parent {
                let _ = write!(out, ",\"parent\":\"{p}\"");
            }
            out.push('}');
        }
    }
}

#[derive(Default)]
struct Writer {
    out: String,
    first: bool,
}

impl Writer {
    fn begin(&mut self, ph: &str, pid: u32, tid: u32, ns: u64) {
        if self.first {
            self.out.push_str(",\n");
        }
        self.first = true;
        let _ = write!(
            self.out,
            "{{\"ph\":\"{ph}\",\"pid\":{pid},\"tid\":{tid},\"ts\":{}",
            us(ns)
        );
    }

    fn end(&mut self) {
        self.out.push('}');
    }

    fn metadata(&mut self, view: &View) {
        let mut pids: Vec<u32> = view.threads.iter().map(|t| t.tid.0).collect();
        pids.dedup();
        for pid in pids {
            let comm = view
                .threads
                .iter()
                .find(|t| t.tid.0 == pid)
                .map(|t| t.name.rsplit_once(' ').map_or(t.name.as_str(), |(c, _)| c))
                .unwrap_or("");
            self.meta("process_name", pid, None, &format!("{comm} (pid {pid})"));
        }
        for t in &view.threads {
            self.meta("thread_name", t.tid.0, Some(t.tid.1), &t.name);
            for lane in 1..t.lanes {
                let tid = t.tid.1 | (lane << LANE_SHIFT);
                let name = format!("{} lane {}", t.name, lane + 1);
                self.meta("thread_name", t.tid.0, Some(tid), &name);
            }
        }
        self.meta("process_name", CPU_PID, None, "CPU (the guest's vCPU)");
        self.meta("thread_name", CPU_PID, Some(0), "running");
    }

    fn meta(&mut self, what: &str, pid: u32, tid: Option<u32>, name: &str) {
        if self.first {
            self.out.push_str(",\n");
        }
        self.first = true;
        let _ = write!(self.out, "{{\"ph\":\"M\",\"name\":\"{what}\",\"pid\":{pid}");
        if let Some(tid) = tid {
            let _ = write!(self.out, ",\"tid\":{tid}");
        }
        let _ = write!(self.out, ",\"args\":{{\"name\":{}}}}}", json_string(name));
    }
}

/// Nanoseconds as microseconds with three decimals.
fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

/// A duration in nanoseconds as microseconds, without trailing zeros.
fn dur(ns: u64) -> String {
    let text = us(ns);
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    use super::super::tests::lock_rows;
    use super::super::Timeline;
    use crate::plugin::{run, Plugin};
    use crate::test_db::TestDb;
    use serde_json::Value;

    #[test]
    fn the_json_parses_and_carries_slices_flows_runs_and_samples() {
        let db = TestDb::with_stacks("timeline-json", &lock_rows(), &[(5, &[0x4011, 0x4022])]);
        let mut plugins: Vec<Box<dyn Plugin>> = vec![Box::new(Timeline::new(None))];
        let out = run(&mut plugins, &db.context()).unwrap();
        let doc: Value = serde_json::from_str(out[0].attachment("json").unwrap()).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        let named = |ph: &str, name: &str| -> Vec<&Value> {
            events
                .iter()
                .filter(|e| e["ph"] == ph && e["name"].as_str().unwrap().starts_with(name))
                .collect()
        };
        let holds = named("X", "hold 0xa0");
        assert_eq!(holds.len(), 2);
        assert_eq!(holds[0]["ts"].as_f64(), Some(1.5));
        assert_eq!(holds[0]["dur"].as_f64(), Some(2.5));
        let waits = named("X", "wait 0xa0");
        let woken = waits.iter().find(|w| w["tid"] == 9).unwrap();
        assert_eq!(woken["dur"].as_f64(), Some(1.7));
        assert_eq!(woken["flow_in"], true);
        assert_eq!(woken["bind_id"], holds[0]["bind_id"]);
        assert_eq!(holds[0]["flow_out"], true);
        // The request's stack: two frames, innermost first.
        let sf = woken["sf"].as_str().unwrap();
        let frame = &doc["stackFrames"][sf];
        assert_eq!(frame["name"], "0x4010");
        assert_eq!(
            doc["stackFrames"][frame["parent"].as_str().unwrap()]["name"],
            "0x4021"
        );
        assert_eq!(
            named("X", "task 7/8").len() + named("X", "thread 8").len(),
            2
        );
        // A sample, named by its function (none known here).
        assert_eq!(named("i", "[unknown]").len(), 1);
        assert_eq!(named("i", "EXIT").len(), 1);
        let threads: Vec<_> = named("M", "thread_name")
            .iter()
            .map(|e| e["args"]["name"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(threads, ["thread 8", "thread 9", "running"]);
    }
}
