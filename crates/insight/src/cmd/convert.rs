//! `insight convert`: rewrite an event database in the other format.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use events::db::{EventDb, EventWriter};

use crate::outputs;

#[derive(clap::Args)]
pub struct ConvertArgs {
    /// The event database to read.
    db: PathBuf,
    /// The database to write, as OUT.partial.PID renamed when complete; an
    /// existing OUT is replaced only if it is an insight event database.
    out: PathBuf,
    /// Replace OUT even if it is not an insight event database (never a
    /// device, link, directory, or a file of a trace).
    #[arg(long)]
    force: bool,
    /// The format of OUT.
    #[arg(long, value_enum, default_value = "rows", value_name = "FORMAT")]
    events_format: super::events::EventsFormat,
}

pub fn convert(args: &ConvertArgs) -> Result<ExitCode> {
    let src = EventDb::open(&args.db)?;
    let src_path = std::fs::canonicalize(&args.db).ok();
    for written in [args.out.clone(), EventWriter::partial_path(&args.out)] {
        if src_path.is_some() && src_path == std::fs::canonicalize(&written).ok() {
            bail!(
                "{} is the database being read, and converting into {} writes {}: name another file",
                args.db.display(),
                args.out.display(),
                written.display()
            );
        }
    }
    outputs::check_event_db(&args.out, args.force)?;
    let mut w = outputs::create_event_db(&args.out, &[], args.events_format.into())?;
    let copied = src.copy_to(&mut w);
    let events = w.events_written();
    let format = w.format().name();
    if let Err(e) = copied.map(|()| w).and_then(EventWriter::finish) {
        // Nothing half-written is left: the source is still there.
        let partial = EventWriter::partial_path(&args.out);
        let _ = std::fs::remove_file(&partial);
        return Err(e).with_context(|| format!("cannot convert {}", args.db.display()));
    }
    let size = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "insight: {events} events written to {} ({format}, {size} bytes)",
        args.out.display()
    );
    Ok(ExitCode::SUCCESS)
}
