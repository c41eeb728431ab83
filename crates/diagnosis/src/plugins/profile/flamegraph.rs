//! Flame graphs: folded stacks drawn as a self-contained SVG, each frame
//! a box as wide as its share of the samples, callers below callees.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::render::xml_escape;

const WIDTH: f64 = 1200.0;
const FRAME_HEIGHT: f64 = 16.0;
const TOP: f64 = 36.0;
const BOTTOM: f64 = 8.0;
/// Frames narrower than this (in pixels) are not drawn.
const MIN_WIDTH: f64 = 0.3;
/// Approximate width of a character of the 11px label font.
const CHAR_WIDTH: f64 = 6.6;

#[derive(Default)]
struct Node {
    samples: u64,
    children: BTreeMap<String, Node>,
}

impl Node {
    fn depth(&self) -> usize {
        self.children
            .values()
            .map(|c| c.depth() + 1)
            .max()
            .unwrap_or(0)
    }
}

/// A stable warm colour for a function name.
fn colour(name: &str) -> String {
    let h = name.bytes().fold(2166136261u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(16777619)
    });
    let r = 205 + (h % 50);
    let g = 80 + ((h >> 8) % 130);
    let b = (h >> 16) % 55;
    format!("rgb({r},{g},{b})")
}

/// Draws `folded` ("outer;...;inner" -> samples) as an SVG document
/// titled `title`.
pub fn svg(title: &str, folded: &BTreeMap<String, u64>) -> String {
    let mut root = Node::default();
    for (stack, &n) in folded {
        root.samples += n;
        let mut node = &mut root;
        for frame in stack.split(';') {
            node = node.children.entry(frame.to_owned()).or_default();
            node.samples += n;
        }
    }
    let depth = root.depth();
    let height = TOP + FRAME_HEIGHT * (depth + 1) as f64 + BOTTOM;
    let mut out = format!(
        "<?xml version=\"1.0\" standalone=\"no\"?>\n{}\n\
         <svg version=\"1.1\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" xmlns=\"http://www.w3.org/2000/svg\">\n\
         <style>text{{font-family:monospace;font-size:11px;fill:#000}}\
         rect{{stroke:#fff;stroke-width:0.5}}</style>\n\
         <rect width=\"{WIDTH}\" height=\"{height}\" fill=\"#f8f8f8\"/>\n\
         <text x=\"{}\" y=\"20\" text-anchor=\"middle\" style=\"font-size:15px\">{}</text>\n",
        crate::FLAME_GRAPH_MARK,
        WIDTH / 2.0,
        xml_escape(title)
    );
    if root.samples == 0 {
        out.push_str("<text x=\"10\" y=\"50\">no samples</text>\n</svg>\n");
        return out;
    }
    let scale = WIDTH / root.samples as f64;
    let total = root.samples;
    let base = height - BOTTOM - FRAME_HEIGHT;
    draw(&mut out, "all", &root, 0.0, base, scale, total);
    out.push_str("</svg>\n");
    out
}

fn draw(out: &mut String, name: &str, node: &Node, x: f64, y: f64, scale: f64, total: u64) {
    let w = node.samples as f64 * scale;
    if w < MIN_WIDTH {
        return;
    }
    let share = 100.0 * node.samples as f64 / total as f64;
    let label = xml_escape(name);
    let _ = write!(
        out,
        "<g><title>{label} ({} samples, {share:.2}%)</title>\
         <rect x=\"{x:.2}\" y=\"{y:.2}\" width=\"{w:.2}\" height=\"{}\" fill=\"{}\" rx=\"2\"/>",
        node.samples,
        FRAME_HEIGHT - 1.0,
        colour(name)
    );
    let fits = ((w - 6.0) / CHAR_WIDTH).floor();
    if fits >= 3.0 {
        let fits = fits as usize;
        let shown: String = if name.chars().count() > fits {
            let mut s: String = name.chars().take(fits.saturating_sub(2)).collect();
            s.push_str("..");
            s
        } else {
            name.to_owned()
        };
        let _ = write!(
            out,
            "<text x=\"{:.2}\" y=\"{:.2}\">{}</text>",
            x + 3.0,
            y + FRAME_HEIGHT - 4.5,
            xml_escape(&shown)
        );
    }
    out.push_str("</g>\n");
    let mut cx = x;
    for (child_name, child) in &node.children {
        draw(out, child_name, child, cx, y - FRAME_HEIGHT, scale, total);
        cx += child.samples as f64 * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_follow_samples() {
        let mut folded = BTreeMap::new();
        folded.insert("main;hot".to_owned(), 75);
        folded.insert("main;cool<x>".to_owned(), 25);
        let s = svg("t & u", &folded);
        assert!(s.starts_with("<?xml"));
        assert!(s.contains("t &amp; u"));
        assert!(s.contains("<title>hot (75 samples, 75.00%)</title>"));
        assert!(s.contains(&format!("width=\"{:.2}\"", WIDTH * 0.75)));
        assert!(s.contains("cool&lt;x&gt;"));
        assert!(!s.contains("cool<x>"));
        // all, main, and the two leaves.
        assert_eq!(s.matches("<rect x=").count(), 4);
        assert!(svg("empty", &BTreeMap::new()).contains("no samples"));
    }
}
