//! `insight convert`: rewrite an event database in the other format.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use events::db::{EventDb, EventWriter};

#[derive(clap::Args)]
pub struct ConvertArgs {
    /// The event database to read.
    db: PathBuf,
    /// The database to write (replaced if it exists).
    out: PathBuf,
    /// The format of OUT.
    #[arg(long, value_enum, default_value = "rows", value_name = "FORMAT")]
    events_format: super::replay::EventsFormat,
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
    let mut w = EventWriter::create_with(&args.out, &[], args.events_format.into())
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    src.copy_to(&mut w)?;
    let events = w.events_written();
    let format = w.format().name();
    w.finish()?;
    let size = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "insight: {events} events written to {} ({format}, {size} bytes)",
        args.out.display()
    );
    Ok(ExitCode::SUCCESS)
}
