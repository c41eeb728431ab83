//! `insight ls` and `insight rm`: the recordings in the trace store.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use journal::Entry;
use trace::TraceReader;

use crate::status::{human_bytes, printable};
use crate::traces;

#[derive(clap::Args)]
pub struct LsArgs {}

#[derive(clap::Args)]
pub struct RmArgs {
    /// Recordings to remove: names in the trace store (`insight ls`) or
    /// trace directories. Anything that is not a trace is left alone.
    #[arg(required = true, value_name = "TRACE")]
    traces: Vec<PathBuf>,
}

/// `YYYY-MM-DD HH:MM` (UTC) of Unix time `secs`.
pub(crate) fn utc(secs: u64) -> String {
    let t = devices::cmos::CivilTime::from_unix(secs);
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}",
        t.year, t.month, t.day, t.hour, t.minute
    )
}

/// The command a trace header's config description names.
fn command_of(config: &str) -> String {
    config
        .lines()
        .find_map(|l| l.strip_prefix("# command: "))
        .map(|c| {
            c.trim_start_matches('[')
                .trim_end_matches(']')
                .split("\", \"")
                .map(|w| w.trim_matches('"'))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

pub fn ls(_: LsArgs) -> Result<ExitCode> {
    let store = traces::store()?;
    let all = traces::list(&store)?;
    let leftovers = traces::leftovers(&store);
    if all.is_empty() && leftovers.is_empty() {
        println!("no recordings in {}", store.display());
        return Ok(ExitCode::SUCCESS);
    }
    let latest = std::fs::read_link(store.join(traces::LATEST)).ok();
    println!(
        "{:<22} {:<16} {:>9} {:>10} {:<10} {:>9}  command",
        "name", "recorded (UTC)", "guest", "size", "state", "events"
    );
    for dir in all {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        let mark = if latest.as_deref() == Some(Path::new(&name)) {
            "*"
        } else {
            ""
        };
        let name = printable(&name).into_owned();
        let bytes = trace::stored_bytes(&dir);
        let db = dir.join(traces::EVENTS_DB);
        let events = if db.is_file() {
            human_bytes(std::fs::metadata(&db).map_or(0, |m| m.len()))
        } else {
            "-".to_owned()
        };
        match TraceReader::<Entry>::open(&dir) {
            Ok(r) => {
                let (state, guest) = match &r.complete {
                    Some(s) => ("complete", format!("{:.1} s", s.guest_ns as f64 / 1e9)),
                    None if traces::being_recorded(&dir) => ("recording", "-".to_owned()),
                    None => ("incomplete", "-".to_owned()),
                };
                let chaos = r
                    .header
                    .chaos
                    .map(|c| format!("  (chaos seed {})", c.seed))
                    .unwrap_or_default();
                println!(
                    "{:<22} {:<16} {:>9} {:>10} {:<10} {:>9}  {}{chaos}",
                    format!("{name}{mark}"),
                    utc(r.header.created_unix_secs),
                    guest,
                    human_bytes(bytes),
                    state,
                    events,
                    printable(&command_of(&r.header.config))
                );
            }
            Err(e) => println!(
                "{name:<22} unreadable: {}",
                printable(&crate::exit::error_chain(&e.into()))
            ),
        }
    }
    for dir in leftovers {
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        println!(
            "{:<22} failed: empty, its recorder ended before writing a header (`insight rm {}` removes it)",
            printable(&name),
            printable(&name)
        );
    }
    println!("(* latest; {})", store.display());
    Ok(ExitCode::SUCCESS)
}

pub fn rm(args: RmArgs) -> Result<ExitCode> {
    let store = traces::store()?;
    let mut failed = false;
    let mut removed_any = false;
    for name in &args.traces {
        let removed = traces::resolve(Some(name)).and_then(|dir| {
            traces::remove(&store, &dir)?;
            Ok(dir)
        });
        match removed {
            Ok(dir) => {
                println!("removed {}", dir.display());
                removed_any = true;
            }
            Err(e) => {
                eprintln!("insight: {}", crate::exit::error_chain(&e));
                failed = true;
            }
        }
    }
    // The host files only removed traces read (docs/host-files.md).
    if removed_any {
        let shared = store.join(trace::objects::SHARED_OBJECTS_DIR);
        match trace::objects::prune_shared(&shared) {
            Ok(0) => {}
            Ok(n) => println!("removed {n} stored host files no recording reads any more"),
            Err(e) => {
                eprintln!("insight: {}", crate::exit::error_chain(&e.into()));
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_commands_read_as_people_write_them() {
        assert_eq!(utc(0), "1970-01-01 00:00");
        assert_eq!(utc(1_795_000_000), "2026-11-18 11:06");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00");
        let config = "# built-in guest\n# command: [\"syn_cont\", \"1000\", \"2000\"]\n";
        assert_eq!(command_of(config), "syn_cont 1000 2000");
        assert_eq!(command_of("# built-in guest\n"), "");
    }
}
