//! Positions in a recording as the commands take them (`replay --from`,
//! `debug --at`, `report timeline --from`): an exit ordinal, guest time,
//! or the first event of a kind; and the durations they are written with.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use events::abi::Kind;
use events::db::EventDb;
use vmm::ReplayPoint;

/// "500us", "1ms", "2s", "1000000ns" (a unit is required).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("'{text}' is not a period such as 1ms, 500us or 2s"))?;
    let period = match &text[digits.len()..] {
        "ns" => Duration::from_nanos(value),
        "us" => Duration::from_micros(value),
        "ms" => Duration::from_millis(value),
        "s" => Duration::from_secs(value),
        "" => {
            return Err(format!(
                "'{text}' has no unit: say {text}ms, {text}us or {text}s"
            ))
        }
        unit => return Err(format!("unknown unit '{unit}' in '{text}' (ns, us, ms, s)")),
    };
    if period.is_zero() {
        return Err(format!("'{text}' is no time at all"));
    }
    Ok(period)
}

/// A position in a recording as `--from` and `--to` take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionArg {
    At(ReplayPoint),
    /// The first event of a kind (of one thread), found in the trace's
    /// event database (`TRACE/events.db`, what `--diagnose` writes).
    First {
        kind: Kind,
        lwpid: Option<u32>,
    },
}

pub fn parse_position(text: &str) -> Result<PositionArg, String> {
    if let Ok(exit) = text.parse::<u64>() {
        return Ok(PositionArg::At(ReplayPoint::Exit(exit)));
    }
    if let Some(event) = text.strip_prefix("first:") {
        let (name, lwpid) = match event.split_once(':') {
            Some((name, lwpid)) => match lwpid.parse::<u32>() {
                Ok(l) => (name, Some(l)),
                Err(_) => return Err(format!("'{lwpid}' in '{text}' is not a thread id")),
            },
            None => (event, None),
        };
        let kind = Kind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                format!(
                    "'{name}' is not an event kind ({})",
                    Kind::ALL.map(|k| k.name().to_ascii_lowercase()).join(", ")
                )
            })?;
        return Ok(PositionArg::First { kind, lwpid });
    }
    parse_duration(text)
        .map(|d| PositionArg::At(ReplayPoint::GuestNs(d.as_nanos() as u64)))
        .map_err(|_| {
            format!(
                "'{text}' is not a position: an exit ordinal (123456), guest time (12s, \
                 1500ms), or the first event of a kind (first:lock, first:lock:LWPID)"
            )
        })
}

impl PositionArg {
    /// The point in the recording: an event's is its recorded time, from
    /// the trace's event database; as a window's end (`end`), the first
    /// exit after it, so that the event is in the window.
    pub fn resolve(self, trace: &Path, end: bool) -> Result<ReplayPoint> {
        let (kind, lwpid) = match self {
            PositionArg::At(p) => return Ok(p),
            PositionArg::First { kind, lwpid } => (kind, lwpid),
        };
        let path = trace.join(crate::traces::EVENTS_DB);
        if !path.exists() {
            bail!(
                "an event position needs the trace's events: replay it once with --events {} \
                 (or --diagnose)",
                path.display()
            );
        }
        let time = first_event_time(&path, kind, lwpid)?;
        Ok(ReplayPoint::GuestNs(if end { time + 1 } else { time }))
    }
}

/// The recorded time of the first `kind` event (of thread `lwpid`) in the
/// event database at `path`.
pub fn first_event_time(path: &Path, kind: Kind, lwpid: Option<u32>) -> Result<u64> {
    let db = EventDb::open(path)?;
    let mut found = None;
    db.for_each(&[kind], |r| {
        if found.is_none() && lwpid.is_none_or(|l| l == r.lwpid) {
            found = Some(r.time);
        }
        Ok(())
    })?;
    found.with_context(|| {
        format!(
            "{} has no {} event{}",
            path.display(),
            kind.name(),
            lwpid.map_or(String::new(), |l| format!(" of thread {l}"))
        )
    })
}
