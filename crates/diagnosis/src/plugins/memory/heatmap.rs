//! The page heat map of `report memory --svg`: one row per page, the
//! accesses to it over the trace in columns, darker for more; a
//! self-contained SVG.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::render::xml_escape;

/// Accesses per stored bucket of a page's history.
pub const BUCKET: u64 = 256;
/// Columns drawn, and pages at most (the most accessed).
const COLUMNS: u64 = 200;
const MAX_ROWS: usize = 128;
const CELL_W: f64 = 4.0;
const CELL_H: f64 = 10.0;
const LABEL_W: f64 = 280.0;
const TOP: f64 = 58.0;
const BOTTOM: f64 = 28.0;

/// One page's row: its label and its accesses per bucket of [`BUCKET`]
/// accesses of the whole trace.
pub struct PageRow<'a> {
    pub label: String,
    pub buckets: &'a BTreeMap<u64, u32>,
}

impl PageRow<'_> {
    fn total(&self) -> u64 {
        self.buckets.values().map(|&n| u64::from(n)).sum()
    }
}

/// Draws `rows` (in the order given) over `accesses` accesses in all,
/// titled `title`; the most accessed [`MAX_ROWS`] only.
pub fn svg(title: &str, mut rows: Vec<PageRow<'_>>, accesses: u64) -> String {
    let left_out = rows.len().saturating_sub(MAX_ROWS);
    if left_out > 0 {
        let mut by_total: Vec<(u64, usize)> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| (r.total(), i))
            .collect();
        by_total.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut keep: Vec<usize> = by_total[..MAX_ROWS].iter().map(|x| x.1).collect();
        keep.sort_unstable();
        let mut i = 0;
        rows.retain(|_| {
            let kept = keep.binary_search(&i).is_ok();
            i += 1;
            kept
        });
    }
    let buckets = accesses.div_ceil(BUCKET).max(1);
    let per_column = buckets.div_ceil(COLUMNS).max(1);
    let columns = buckets.div_ceil(per_column);
    // Accesses per cell, and the most in any.
    let cells: Vec<BTreeMap<u64, u64>> = rows
        .iter()
        .map(|r| {
            let mut c = BTreeMap::new();
            for (&b, &n) in r.buckets {
                *c.entry(b / per_column).or_insert(0) += u64::from(n);
            }
            c
        })
        .collect();
    let most = cells
        .iter()
        .flat_map(|c| c.values().copied())
        .max()
        .unwrap_or(1);
    let width = LABEL_W + CELL_W * columns as f64 + 10.0;
    let height = TOP + CELL_H * rows.len().max(1) as f64 + BOTTOM;
    let mut out = format!(
        "<?xml version=\"1.0\" standalone=\"no\"?>\n{}\n\
         <svg version=\"1.1\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" xmlns=\"http://www.w3.org/2000/svg\">\n\
         <style>text{{font-family:monospace;font-size:9px;fill:#000}}</style>\n\
         <rect width=\"{width}\" height=\"{height}\" fill=\"#ffffff\"/>\n\
         <text x=\"10\" y=\"18\" style=\"font-size:13px\">{}</text>\n\
         <text x=\"10\" y=\"34\">one row per page{}</text>\n\
         <text x=\"10\" y=\"46\">left to right: the {accesses} accesses in the order made, {} \
         per column; darker: more (at most {most} in a cell)</text>\n",
        crate::HEAT_MAP_MARK,
        xml_escape(title),
        if left_out > 0 {
            format!(" (the {MAX_ROWS} most accessed; {left_out} more left out)")
        } else {
            String::new()
        },
        per_column * BUCKET,
    );
    if rows.is_empty() {
        out.push_str("<text x=\"10\" y=\"70\">no memory accesses</text>\n</svg>\n");
        return out;
    }
    for (i, (row, cells)) in rows.iter().zip(&cells).enumerate() {
        let y = TOP + CELL_H * i as f64;
        let _ = writeln!(
            out,
            "<text x=\"4\" y=\"{:.1}\">{}</text>",
            y + CELL_H - 2.0,
            xml_escape(&row.label)
        );
        for (&column, &n) in cells {
            // Logarithmic: a page read once still shows.
            let shade = ((n as f64).ln_1p() / (most as f64).ln_1p()).clamp(0.0, 1.0);
            let light = (235.0 - 200.0 * shade) as u8;
            let _ = writeln!(
                out,
                "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{CELL_W}\" height=\"{:.1}\" \
                 fill=\"rgb(255,{light},{})\"><title>{n} accesses</title></rect>",
                LABEL_W + CELL_W * column as f64,
                CELL_H - 1.0,
                light / 2
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_pages_and_columns_time() {
        let hot: BTreeMap<u64, u32> = [(0, 256), (1, 256), (9, 10)].into();
        let cold: BTreeMap<u64, u32> = [(5, 1)].into();
        let svg = svg(
            "t <1>",
            vec![
                PageRow {
                    label: "0x404000 a".into(),
                    buckets: &hot,
                },
                PageRow {
                    label: "0x7ffd0000 [page]".into(),
                    buckets: &cold,
                },
            ],
            10 * BUCKET,
        );
        assert!(svg.starts_with("<?xml") && svg.contains(crate::HEAT_MAP_MARK));
        assert!(svg.contains("t &lt;1&gt;"));
        assert!(svg.contains(">0x404000 a</text>") && svg.contains("0x7ffd0000 [page]"));
        // Ten buckets, a column each: four cells drawn, the hottest darkest.
        assert_eq!(svg.matches("<rect x=").count(), 4);
        assert!(svg.contains("fill=\"rgb(255,35,17)\"><title>256 accesses"));
        assert!(svg.contains("<title>1 accesses"));
        assert!(!svg.contains("left out"));
    }

    #[test]
    fn only_the_most_accessed_pages_are_drawn() {
        let lists: Vec<BTreeMap<u64, u32>> = (0..MAX_ROWS as u32 + 3)
            .map(|n| [(0, n + 1)].into())
            .collect();
        let rows = lists
            .iter()
            .enumerate()
            .map(|(i, b)| PageRow {
                label: format!("page{i}"),
                buckets: b,
            })
            .collect();
        let svg = svg("t", rows, 1);
        assert!(svg.contains("3 more left out"));
        assert!(!svg.contains(">page0<") && !svg.contains(">page2<"));
        assert!(svg.contains(">page3<") && svg.contains(&format!(">page{}<", MAX_ROWS + 2)));
    }
}
