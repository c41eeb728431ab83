//! The timeline as one self-contained HTML page: no network, no external
//! script. The data is a compact JSON document inside the page (arrays,
//! times in nanoseconds from the window's start); `page.js` draws a row per
//! thread on canvases, zooms and pans the time axis, aggregates what is
//! narrower than a pixel, and shows a slice's lock, stack and source line
//! on hover.

use std::collections::HashMap;
use std::fmt::Write as _;

use super::model::SliceKind;
use super::view::View;
use crate::render::{json_string, xml_escape};

/// A comment every timeline page carries, by which insight knows the file
/// as its own.
pub const MARK: &str = "<!-- timeline written by insight -->";

const SCRIPT: &str = include_str!("page.js");
const STYLE: &str = include_str!("page.css");

/// The page.
pub fn write(view: &View, label: &str) -> String {
    let data = data(view, label).replace('<', "\\u003c");
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n\
         <title>insight: timeline of {title}</title>\n{MARK}\n<style>{STYLE}</style></head>\n\
         <body>\n<header><h1>Timeline of {title}</h1>\n\
         <p id=\"summary\"></p>\n\
         <p class=\"controls\"><label>Lock <select id=\"lock\"><option value=\"-1\">all locks\
         </option></select></label> <button id=\"reset\">whole time</button> \
         <span class=\"help\">wheel: zoom · drag: pan · double-click: whole time · hover: \
         details</span></p>\n\
         <p class=\"legend\"><span class=\"run\"></span>running <span class=\"wait\"></span>\
         waiting for a lock <span class=\"hold\"></span>holding a lock <span class=\"failed\">\
         </span>failed trylock/timedlock <span class=\"condwait\"></span>waiting on a condition \
         variable <span class=\"barrier\"></span>at a barrier <span class=\"semwait\"></span>on \
         a semaphore <span class=\"sample\"></span>sample <span class=\"other\"></span>\
         another task on the CPU</p></header>\n\
         <div id=\"axis\"><canvas></canvas></div>\n<div id=\"rows\"></div>\n\
         <div id=\"tip\" hidden></div>\n\
         <script id=\"data\" type=\"application/json\">{data}</script>\n\
         <script>{SCRIPT}</script>\n</body></html>\n",
        title = xml_escape(label),
    )
}

/// The document page.js reads. Times are nanoseconds after `origin` (the
/// window's start, or the first event), rows index `threads`, -1 is none:
/// - `slices`: [row, kind (0 wait, 1 hold, 2 failed, 3 condition variable
///   wait, 4 barrier, 5 semaphore), lock or object (into `locks`),
///   start, end, stack (into `stacks`), level in the row, the row whose
///   release woke it, unfinished (0/1)];
/// - `runs`: [row, start, end, task name]; `instants`: [row, kind, time];
/// - `samples`: [row, time, function (into `functions`), stack].
fn data(view: &View, label: &str) -> String {
    let origin = view.window.from.max(view.b.first.unwrap_or(0));
    let end = view.window.to.min(view.b.last);
    let t = |ns: u64| ns.saturating_sub(origin);
    let mut out = String::with_capacity(64 * view.b.slices.len() + 4096);
    let _ = write!(
        out,
        "{{\"label\":{},\"origin\":{origin},\"span\":{},\"threads\":[",
        json_string(label),
        end.saturating_sub(origin)
    );
    for (i, r) in view.threads.iter().enumerate() {
        let sep = if i > 0 { "," } else { "" };
        let _ = write!(
            out,
            "{sep}{{\"name\":{},\"pid\":{},\"lanes\":{}}}",
            json_string(&r.name),
            r.tid.0,
            r.lanes
        );
    }
    let mut locks: HashMap<u64, usize> = HashMap::new();
    let mut lock_list: Vec<String> = Vec::new();
    let mut rows = String::new();
    let wakers: HashMap<u64, super::model::Tid> = view
        .b
        .slices
        .iter()
        .filter_map(|h| Some((h.wakes?, h.tid)))
        .collect();
    // Each lane of a thread below the one before: the level of a slice in
    // its row is its lane's first level plus its depth.
    let lane_start = |tid, lane: u32| -> u32 { view.b.lanes[&tid][..lane as usize].iter().sum() };
    for (i, s) in view.slices() {
        let Some(&row) = view.row_of.get(&s.tid) else {
            continue;
        };
        let lock = *locks.entry(s.lock).or_insert_with(|| {
            lock_list.push(view.lock_name(s.lock));
            lock_list.len() - 1
        });
        let kind = match s.kind {
            SliceKind::Wait => 0,
            SliceKind::Hold => 1,
            SliceKind::Failed => 2,
            SliceKind::CondWait => 3,
            SliceKind::Barrier => 4,
            SliceKind::Semaphore => 5,
        };
        let (start, end) = view.window.clip(s.start, s.end);
        let stack = view.slice_stack[i].map_or(-1, |s| s as i64);
        // The waker: the thread whose hold flowed into this wait.
        let waker = s
            .woken_by
            .and_then(|id| wakers.get(&id))
            .and_then(|tid| view.row_of.get(tid))
            .map_or(-1, |&r| r as i64);
        let sep = if rows.is_empty() { "" } else { "," };
        let _ = write!(
            rows,
            "{sep}[{row},{kind},{lock},{},{},{stack},{},{waker},{}]",
            t(start),
            t(end),
            lane_start(s.tid, s.lane) + s.depth,
            u8::from(s.unfinished)
        );
    }
    out.push_str("],\"locks\":[");
    push_strings(&mut out, &lock_list);
    let _ = write!(out, "],\"slices\":[{rows}],\"runs\":[");
    for (i, r) in view.runs().enumerate() {
        let sep = if i > 0 { "," } else { "" };
        let row = view.row_of.get(&r.tid).map_or(-1, |&r| r as i64);
        let (start, end) = view.window.clip(r.start, r.end);
        let name = view.task_names.get(&r.tid).map_or("", String::as_str);
        let _ = write!(
            out,
            "{sep}[{row},{},{},{}]",
            t(start),
            t(end),
            json_string(name)
        );
    }
    out.push_str("],\"instants\":[");
    for (i, e) in view.instants().enumerate() {
        let sep = if i > 0 { "," } else { "" };
        let row = view.row_of.get(&e.tid).map_or(-1, |&r| r as i64);
        let _ = write!(out, "{sep}[{row},\"{}\",{}]", e.kind.name(), t(e.time));
    }
    out.push_str("],\"samples\":[");
    let mut functions: HashMap<&str, usize> = HashMap::new();
    let mut function_list: Vec<String> = Vec::new();
    for (n, (i, s)) in view.samples().enumerate() {
        let sep = if n > 0 { "," } else { "" };
        let row = view.row_of.get(&s.tid).map_or(-1, |&r| r as i64);
        let name = view.sample_function[i].as_str();
        let f = *functions.entry(name).or_insert_with(|| {
            function_list.push(name.to_owned());
            function_list.len() - 1
        });
        let stack = view.sample_stack[i].map_or(-1, |s| s as i64);
        let _ = write!(out, "{sep}[{row},{},{f},{stack}]", t(s.time));
    }
    out.push_str("],\"functions\":[");
    push_strings(&mut out, &function_list);
    out.push_str("],\"stacks\":[");
    for (i, frames) in view.stacks.iter().enumerate() {
        out.push_str(if i > 0 { ",[" } else { "[" });
        push_strings(&mut out, frames);
        out.push(']');
    }
    out.push_str("]}");
    out
}

fn push_strings(out: &mut String, strings: &[String]) {
    for (i, s) in strings.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&json_string(s));
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::lock_rows;
    use super::super::Timeline;
    use super::*;
    use crate::plugin::{run, Plugin};
    use crate::test_db::TestDb;

    #[test]
    fn the_page_holds_its_data_and_no_outside_reference() {
        let db = TestDb::with_rows("timeline-page", &lock_rows());
        let mut plugins: Vec<Box<dyn Plugin>> = vec![Box::new(Timeline::new(None))];
        let mut cx = db.context();
        // A label that would end the script if it were not escaped.
        cx.label = "</script><b>x".into();
        let out = run(&mut plugins, &cx).unwrap();
        let page = out[0].attachment("html").unwrap();
        assert!(page.starts_with("<!DOCTYPE html>") && page.contains(MARK));
        assert!(!page.contains("</script><b>") && page.contains("&lt;/script&gt;&lt;b&gt;x"));
        assert!(!page.contains("http://") && !page.contains("https://") && !page.contains(" src="));
        let start = page.find("type=\"application/json\">").unwrap() + 24;
        let len = page[start..].find("</script>").unwrap();
        let doc: serde_json::Value = serde_json::from_str(&page[start..start + len]).unwrap();
        assert_eq!(doc["label"], "</script><b>x");
        assert_eq!(doc["threads"].as_array().unwrap().len(), 2);
        assert_eq!(doc["origin"], 0);
        assert_eq!(doc["span"], 5_100);
        let slices = doc["slices"].as_array().unwrap();
        // The wait of thread 9 (row 1), woken by row 0's release.
        assert!(slices.iter().any(|s| s[0] == 1
            && s[1] == 0
            && s[3] == 2_500
            && s[4] == 4_200
            && s[8] == 0));
        assert_eq!(doc["runs"].as_array().unwrap().len(), 4);
        assert_eq!(doc["samples"][0][1], 4_300);
    }
}
