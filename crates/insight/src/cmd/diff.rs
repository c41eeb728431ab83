//! `insight diff`: where two traces first differ.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use journal::Entry;

use super::open_trace;
use crate::status::printable;
use crate::traces;

#[derive(clap::Args)]
pub struct DiffArgs {
    /// First trace: a directory, or a recording's name (`insight ls`).
    first: PathBuf,
    /// Second trace, the same way.
    second: PathBuf,
}

pub fn diff(args: DiffArgs) -> Result<ExitCode> {
    let a = open_trace(&traces::resolve(Some(&args.first))?)?;
    let b = open_trace(&traces::resolve(Some(&args.second))?)?;
    let mut same_start = true;
    if a.header.images != b.header.images {
        println!("the traces booted different images");
        same_start = false;
    }
    if a.header.boot.cmdline != b.header.boot.cmdline
        || a.header.boot.memory_mib != b.header.boot.memory_mib
        || a.header.boot.archive != b.header.boot.archive
    {
        println!("the traces booted with different command lines, memory or commands");
        same_start = false;
    }
    if a.header.boot.snapshot != b.header.boot.snapshot {
        println!("the traces started from different boot snapshots (or one booted cold)");
        same_start = false;
    }
    if a.header.boot.rng_seed != b.header.boot.rng_seed {
        println!("the guests' random seeds differ (every recording has its own)");
    }
    let (mut a, mut b) = (a, b);
    let mut exit: u64 = 0;
    let mut entries: u64 = 0;
    loop {
        let (x, y) = (a.next_event()?, b.next_event()?);
        if x.as_ref().is_some_and(Entry::is_exit) {
            exit += 1;
        }
        let show = |e: &Option<Entry>| match e {
            Some(e) => printable(e.to_string().trim_start()).into_owned(),
            None => "(end of log)".to_string(),
        };
        if x != y {
            println!(
                "first difference at log entry {}, exit {exit}:\n  {}: {}\n  {}: {}",
                entries + 1,
                args.first.display(),
                show(&x),
                args.second.display(),
                show(&y)
            );
            return Ok(ExitCode::from(1));
        }
        if x.is_none() {
            break;
        }
        entries += 1;
    }
    println!("the logs are identical: {entries} entries, {exit} deterministic exits");
    for (name, reader) in [(&args.first, &a), (&args.second, &b)] {
        if let Some(problem) = &reader.tail_problem {
            eprintln!(
                "insight: {} is incomplete and its log ends early: {problem}",
                name.display()
            );
        }
    }
    Ok(if same_start {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
