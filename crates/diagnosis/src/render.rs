//! Helpers the tools' reports share.

/// `part` as a percentage of `whole` (0 when `whole` is).
pub fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// A duration in the unit that reads best: "850 ns", "12.3 µs", "4.57 ms",
/// "2.31 s" (three significant digits from 1 µs on).
pub fn duration(ns: u64) -> String {
    let f = ns as f64;
    let (value, unit) = match ns {
        0..=999 => return format!("{ns} ns"),
        // A value that rounds to 1000 of a unit is written in the next.
        1_000..=999_499 => (f / 1e3, "µs"),
        999_500..=999_499_999 => (f / 1e6, "ms"),
        _ => (f / 1e9, "s"),
    };
    let digits = match value {
        v if v < 10.0 => 2,
        v if v < 100.0 => 1,
        _ => 0,
    };
    format!("{value:.digits$} {unit}")
}

/// Text as a JSON string literal, quotes included.
pub fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// Text made safe for HTML and SVG.
pub fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_their_unit() {
        assert_eq!(duration(850), "850 ns");
        assert_eq!(duration(12_340), "12.3 µs");
        assert_eq!(duration(4_567_000), "4.57 ms");
        assert_eq!(duration(145_600_000), "146 ms");
        assert_eq!(duration(2_310_000_000), "2.31 s");
        assert_eq!(duration(15_153_621_800), "15.2 s");
        assert_eq!(duration(999_999), "1.00 ms");
        assert_eq!(duration(999_400), "999 µs");
    }
}
