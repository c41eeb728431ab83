//! `insight events`: work on event databases themselves; `merge` joins
//! the databases of a recording's replay segments into one.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use events::db::{EventDb, EventFormat, EventWriter};

use crate::outputs;

/// How an event database stores its events (`--events-format`).
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum EventsFormat {
    Packed,
    Rows,
}

impl From<EventsFormat> for EventFormat {
    fn from(f: EventsFormat) -> Self {
        match f {
            EventsFormat::Packed => EventFormat::Packed,
            EventsFormat::Rows => EventFormat::Rows,
        }
    }
}

#[derive(clap::Args)]
pub struct EventsArgs {
    #[command(subcommand)]
    command: EventsCommand,
}

#[derive(clap::Subcommand)]
enum EventsCommand {
    /// Join the event databases of a recording's replay segments.
    #[command(long_about = "Join the event databases that `insight replay TRACE \
--segment K/N --events SEG_K.db` wrote for each K, in segment order, into OUT: the same \
events, in the same order, with the same sequence numbers as one replay from boot \
would have written (samples excepted: they follow host time). Each database must go on \
where the one before it ended; a missing or misplaced segment is named. OUT is written \
as OUT.partial.PID and renamed when complete.\n\n\
Example (docs/scale-out.md):\n  \
parallel insight replay t1 --any-cpu --segment {}/4 --events seg-{}.db ::: 1 2 3 4\n  \
insight events merge t1.db seg-1.db seg-2.db seg-3.db seg-4.db")]
    Merge(MergeArgs),
}

#[derive(clap::Args)]
struct MergeArgs {
    /// The database to write.
    out: PathBuf,
    /// The segments' databases, first segment first.
    #[arg(required = true, num_args = 1..)]
    segments: Vec<PathBuf>,
    /// Replace OUT even if it is not an insight event database (never a
    /// device, link, directory, or a file of a trace).
    #[arg(long)]
    force: bool,
    /// The format of OUT.
    #[arg(long, value_enum, default_value = "packed", value_name = "FORMAT")]
    events_format: EventsFormat,
}

pub fn events(args: EventsArgs) -> Result<ExitCode> {
    match args.command {
        EventsCommand::Merge(m) => {
            for db in &m.segments {
                let same = std::fs::canonicalize(db).ok();
                if same.is_some() && same == std::fs::canonicalize(&m.out).ok() {
                    bail!(
                        "{} is one of the databases being merged: name another OUT",
                        m.out.display()
                    );
                }
            }
            outputs::check_event_db(&m.out, m.force)?;
            let events = merge(&m.out, &m.segments, m.events_format.into())?;
            eprintln!(
                "insight: {events} events of {} segments written to {}",
                m.segments.len(),
                m.out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Writes the databases `segments`, in order, into a new database `out`;
/// returns how many events it holds. Nothing is left at `out` on failure.
pub fn merge(out: &Path, segments: &[PathBuf], format: EventFormat) -> Result<u64> {
    let mut w = crate::outputs::create_event_db(out, &[], format)?;
    let mut appended = || -> Result<()> {
        for path in segments {
            let db = EventDb::open(path)?;
            db.append_to(&mut w)
                .with_context(|| format!("cannot merge {}", path.display()))?;
        }
        let events = w.events_written();
        w.set_meta("events", &events.to_string())?;
        Ok(())
    };
    if let Err(e) = appended() {
        drop(w);
        let _ = std::fs::remove_file(EventWriter::partial_path(out));
        return Err(e);
    }
    let events = w.events_written();
    w.finish()
        .with_context(|| format!("cannot finish {}", out.display()))?;
    Ok(events)
}
