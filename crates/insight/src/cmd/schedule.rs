//! A chaos recording's schedule (docs/chaos.md, "Why it failed"): read
//! from its log, listed by `dump --schedule`, taken again by `record
//! --schedule TRACE[:EDITS]`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use vmm::{Schedule, ScheduleEdits, ScheduleError};

use super::open_trace;
use crate::traces;

/// `--schedule TRACE[:EDITS]`: a recording, and which of its choices to
/// take again.
#[derive(Clone, Debug)]
pub struct ScheduleArg {
    pub trace: PathBuf,
    pub edits: ScheduleEdits,
}

/// Parses `TRACE`, `TRACE:drop=LIST` or `TRACE:keep=LIST`.
pub fn parse_schedule_arg(text: &str) -> Result<ScheduleArg, String> {
    if let Some((trace, edits)) = text.rsplit_once(':') {
        if edits.starts_with("drop=") || edits.starts_with("keep=") {
            return Ok(ScheduleArg {
                trace: PathBuf::from(trace),
                edits: ScheduleEdits::parse(edits).map_err(|e| e.to_string())?,
            });
        }
    }
    Ok(ScheduleArg {
        trace: PathBuf::from(text),
        edits: ScheduleEdits::None,
    })
}

/// A chaos recording's settings and schedule.
pub struct Recorded {
    pub trace: PathBuf,
    pub settings: trace::ChaosSettings,
    pub schedule: Schedule,
    /// How the recording ended, if its log says.
    pub end: Option<journal::EndReason>,
}

/// Reads the settings and schedule of the chaos recording `name` (a
/// directory or a name in the trace store).
pub fn read_schedule(name: &Path) -> Result<Recorded> {
    let trace = traces::resolve(Some(name))?;
    let mut reader = open_trace(&trace)?;
    let Some(settings) = reader.header.chaos else {
        bail!(
            "{} is no chaos recording (record it with --chaos): it has no schedule",
            trace.display()
        );
    };
    let entries = std::iter::from_fn(|| match reader.next_event() {
        Ok(Some(e)) => Some(Ok(e)),
        Ok(None) => None,
        Err(e) => Some(Err(e)),
    });
    let (mut failure, mut end) = (None, None);
    let schedule = Schedule::from_log(entries.map_while(|e| match e {
        Ok(journal::Entry::End(reason)) => {
            end = Some(reason.clone());
            Some(Ok::<_, ScheduleError>(journal::Entry::End(reason)))
        }
        Ok(e) => Some(Ok::<_, ScheduleError>(e)),
        Err(e) => {
            failure = Some(e);
            None
        }
    }));
    if let Some(e) = failure {
        return Err(e).with_context(|| format!("cannot read the log of {}", trace.display()));
    }
    let schedule =
        schedule.with_context(|| format!("the schedule in {} is damaged", trace.display()))?;
    Ok(Recorded {
        trace,
        settings,
        schedule,
        end,
    })
}

/// `dump --schedule`: every decision, the choices numbered as edits name
/// them.
pub fn print_schedule(out: &mut impl Write, r: &Recorded) -> Result<()> {
    let choices = r.schedule.choices().count();
    writeln!(
        out,
        "schedule of {}: {} decisions, {choices} of them choices (numbered; \
         `record --schedule TRACE:drop=N,M-K` leaves those out)",
        r.trace.display(),
        r.schedule.decisions.len()
    )?;
    let mut choice = 0;
    for d in &r.schedule.decisions {
        if d.is_choice() {
            choice += 1;
            writeln!(out, "{choice:>6}  {d}")?;
        } else {
            writeln!(out, "{:>6}  {d}", "")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_argument_is_a_trace_and_maybe_edits() {
        let a = parse_schedule_arg("t/prog-0:drop=1,3-4").unwrap();
        assert_eq!(a.trace, Path::new("t/prog-0"));
        assert_eq!(a.edits.to_string(), "drop=1,3-4");
        let a = parse_schedule_arg("dir:with:colons").unwrap();
        assert_eq!(a.trace, Path::new("dir:with:colons"));
        assert_eq!(a.edits, ScheduleEdits::None);
        assert!(parse_schedule_arg("t:keep=0").is_err());
    }
}
