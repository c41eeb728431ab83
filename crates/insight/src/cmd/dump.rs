//! `insight dump`: a trace's header and log, as text, JSON lines, a pcap
//! of the frames it received, or statistics.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use journal::Entry;
use trace::{Header, TraceReader};

use super::open_trace;
use crate::outputs::{self, OutputKind};
use crate::pcap::PcapWriter;
use crate::status::{human_bytes, printable};
use crate::traces;

#[derive(clap::Args)]
pub struct DumpArgs {
    /// Trace directory written by `insight record`, or a recording's name
    /// in the trace store (`insight ls`); default: the latest recording.
    trace: Option<PathBuf>,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
    /// Print the header only.
    #[arg(long, conflicts_with = "json")]
    header: bool,
    /// Stop after this many log entries.
    #[arg(long, value_name = "N")]
    limit: Option<u64>,
    /// Print what the log is made of instead: entries of each kind, their
    /// bytes before compression, and the share of the compressed log each
    /// kind accounts for (in proportion to its bytes).
    #[arg(long, conflicts_with_all = ["json", "header"])]
    stats: bool,
    /// Write the network frames the recording delivered to the guest to
    /// FILE (pcap, stamped with guest time) instead of printing the log.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json", "header", "limit"])]
    rx_pcap: Option<PathBuf>,
    /// Print the chaos schedule instead: every decision of the guest's
    /// chaos scheduler, its choices numbered as `record --schedule
    /// TRACE:EDITS` names them (docs/chaos.md, "Why it failed").
    #[arg(long, conflicts_with_all = ["json", "header", "limit", "stats", "rx_pcap"])]
    schedule: bool,
    /// Replace an existing --rx-pcap file even if it is not a pcap capture
    /// (never a device, link, directory, or a file of a trace).
    #[arg(long, requires = "rx_pcap")]
    force: bool,
}

pub fn dump(args: DumpArgs) -> Result<ExitCode> {
    let trace = traces::resolve(args.trace.as_deref())?;
    if args.schedule {
        let recorded = super::schedule::read_schedule(&trace)?;
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        super::schedule::print_schedule(&mut out, &recorded)?;
        out.flush()?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(path) = &args.rx_pcap {
        outputs::check(path, OutputKind::Pcap, args.force)?;
    }
    let mut reader = open_trace(&trace)?;
    if let Some(path) = &args.rx_pcap {
        return dump_rx_pcap(reader, path);
    }
    if args.stats {
        return dump_stats(reader, &trace);
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let h = &reader.header;
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({ "header": header_json(h, &reader) })
        )?;
    } else {
        print_header(&mut out, h, &reader)?;
        if args.header {
            return Ok(ExitCode::SUCCESS);
        }
        writeln!(out, "log:")?;
    }
    let mut exit: u64 = 0;
    let mut entries: u64 = 0;
    while let Some(event) = reader.next_event()? {
        if args.limit.is_some_and(|l| entries >= l) {
            break;
        }
        entries += 1;
        if event.is_exit() {
            exit += 1;
        }
        if args.json {
            writeln!(
                out,
                "{}",
                serde_json::json!({ "exit": exit, "event": event })
            )?;
        } else if event.is_exit() {
            writeln!(out, "{exit:>10}  {}", printable(&event.to_string()))?;
        } else {
            writeln!(out, "{:>10}  {}", "", printable(&event.to_string()))?;
        }
    }
    if let Some(problem) = &reader.tail_problem {
        if args.json {
            writeln!(
                out,
                "{}",
                serde_json::json!({ "tail_problem": problem.to_string() })
            )?;
        } else {
            writeln!(out, "(the log ends early: {problem})")?;
        }
    }
    out.flush()?;
    report_tail(&reader);
    Ok(ExitCode::SUCCESS)
}

/// `dump --stats`: entries and bytes by kind.
fn dump_stats(mut reader: TraceReader<Entry>, trace: &Path) -> Result<ExitCode> {
    let mut kinds: Vec<(&'static str, u64, u64)> = Vec::new();
    while let Some(entry) = reader.next_event()? {
        let bytes = trace::encoded_len(&entry) as u64;
        match kinds.iter_mut().find(|k| k.0 == entry.kind()) {
            Some(k) => {
                k.1 += 1;
                k.2 += bytes;
            }
            None => kinds.push((entry.kind(), 1, bytes)),
        }
    }
    let compressed = std::fs::metadata(trace.join("events"))
        .with_context(|| format!("cannot read {}", trace.join("events").display()))?
        .len();
    let raw: u64 = kinds.iter().map(|k| k.2).sum();
    let ratio = compressed as f64 / raw.max(1) as f64;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    writeln!(
        out,
        "{:<12} {:>10} {:>12} {:>10} {:>14}",
        "kind", "entries", "bytes", "B/entry", "compressed ~B"
    )?;
    kinds.sort_by_key(|k| std::cmp::Reverse(k.2));
    for (kind, n, bytes) in &kinds {
        writeln!(
            out,
            "{kind:<12} {n:>10} {bytes:>12} {:>10.1} {:>14.0}",
            *bytes as f64 / *n as f64,
            *bytes as f64 * ratio
        )?;
    }
    writeln!(
        out,
        "log: {raw} bytes of entries in {compressed} compressed ({:.2}x)",
        1.0 / ratio.max(f64::MIN_POSITIVE)
    )?;
    if let Some(problem) = &reader.tail_problem {
        writeln!(out, "(the log ends early: {problem})")?;
    }
    out.flush()?;
    report_tail(&reader);
    Ok(ExitCode::SUCCESS)
}

/// Writes the frames a recording delivered as a pcap file.
fn dump_rx_pcap(mut reader: TraceReader<Entry>, path: &Path) -> Result<ExitCode> {
    let mut pcap =
        PcapWriter::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut guest_ns = 0;
    let mut bytes = 0u64;
    while let Some(event) = reader.next_event()? {
        match event {
            Entry::RdMsr {
                index: journal::MSR_INSIGHT_CLOCK,
                value,
                fault: false,
                ..
            } => guest_ns = value,
            Entry::NetRx { payload, lens } => {
                let data = reader.payload(payload)?;
                let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
                let short = lens
                    .iter()
                    .any(|&l| (l as usize) < devices::tap::VNET_HDR_LEN);
                if total != data.len() as u64 || short {
                    bail!(
                        "a received-frames entry of the log is malformed: its frame lengths \
                         {lens:?} do not divide its {}-byte payload into frames of at least \
                         {} bytes",
                        data.len(),
                        devices::tap::VNET_HDR_LEN
                    );
                }
                let mut at = 0usize;
                for len in lens {
                    let end = at + len as usize;
                    let frame = &data[at..end];
                    let ethernet = &frame[devices::tap::VNET_HDR_LEN..];
                    pcap.frame(guest_ns, ethernet)
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    bytes += ethernet.len() as u64;
                    at = end;
                }
            }
            _ => {}
        }
    }
    pcap.flush()
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!(
        "insight: {} received frames ({}) written to {}",
        pcap.frames(),
        human_bytes(bytes),
        path.display()
    );
    report_tail(&reader);
    Ok(ExitCode::SUCCESS)
}

/// Says on standard error that an unfinished recording's log ends on a
/// torn or unreadable frame (a complete trace's would be an error).
fn report_tail(reader: &TraceReader<Entry>) {
    if let Some(problem) = &reader.tail_problem {
        eprintln!(
            "insight: the trace is incomplete (its recorder did not finish) and its log ends \
             early: {problem}"
        );
    }
}

fn header_json(h: &Header, reader: &TraceReader<Entry>) -> serde_json::Value {
    serde_json::json!({
        "format_version": trace::TRACE_VERSION,
        "clock": format!("{:?}", h.clock),
        "created_unix_secs": h.created_unix_secs,
        "complete": reader.complete.is_some(),
        "summary": reader.complete,
        "images": h.images,
        "cmdline": h.boot.cmdline,
        "memory_mib": h.boot.memory_mib,
        "archive_bytes": h.boot.archive.len(),
        "snapshot": h.boot.snapshot,
        "config": h.config,
        "guest_cpuid_entries": h.guest_cpuid.len(),
        "kvm_caps": h.kvm_caps,
        "user_rdtsc_traps": h.user_rdtsc_traps,
        "host_apic_id": h.host_apic_id,
        "chaos": h.chaos,
    })
}

fn print_header(out: &mut impl Write, h: &Header, reader: &TraceReader<Entry>) -> Result<()> {
    writeln!(
        out,
        "insight trace, format version {}",
        trace::TRACE_VERSION
    )?;
    writeln!(out, "  clock:      {:?}", h.clock)?;
    if let Some(c) = &h.chaos {
        writeln!(out, "  chaos:      {}", chaos_text(c))?;
    }
    writeln!(out, "  created:    {} (unix seconds)", h.created_unix_secs)?;
    match &reader.complete {
        Some(s) => writeln!(
            out,
            "  complete:   yes, {} log entries in {} frames, {} of events, {} of payloads",
            s.events,
            s.frames,
            human_bytes(s.event_bytes),
            human_bytes(s.payload_bytes)
        )?,
        None => writeln!(out, "  complete:   no (the recorder did not finish)")?,
    }
    if let Some(s) = reader.complete.filter(|s| s.net_rx_dropped > 0) {
        writeln!(
            out,
            "  dropped:    {} received network frames never reached the guest (too large for \
             it, arriving while it took none, or dropped by the host kernel at the TAP \
             device); no replay has them",
            s.net_rx_dropped
        )?;
    }
    for image in &h.images {
        writeln!(
            out,
            "  {:<11} {} (sha256 {})",
            printable(&format!("{}:", image.role)),
            printable(&image.path),
            printable(&image.digest)
        )?;
    }
    // Checkpoints a replay took (docs/trace-format.md): listed, not read.
    match trace::checkpoints::list(reader.dir()) {
        Ok(c) if c.is_empty() => {}
        Ok(c) => writeln!(
            out,
            "  checkpoints: {} at exits {} ({} in all; `insight replay --list-checkpoints`)",
            c.len(),
            c.iter()
                .map(|c| c.exit.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            human_bytes(c.iter().map(|c| c.bytes).sum())
        )?,
        Err(e) => writeln!(
            out,
            "  checkpoints: unreadable ({})",
            printable(&e.to_string())
        )?,
    }
    writeln!(out, "  memory:     {} MiB", h.boot.memory_mib)?;
    writeln!(out, "  cmdline:    {}", printable(&h.boot.cmdline))?;
    writeln!(
        out,
        "  archive:    {} bytes (command, environment, files, devices)",
        h.boot.archive.len()
    )?;
    match &h.boot.snapshot {
        Some(s) => writeln!(
            out,
            "  start:      boot snapshot {} (taken at guest time {:.3} s; {})",
            printable(&s.digest),
            s.guest_ns as f64 / 1e9,
            trace::SNAPSHOT_FILE
        )?,
        None => writeln!(out, "  start:      booted from power-on")?,
    }
    writeln!(out, "  CPUID:      {} entries", h.guest_cpuid.len())?;
    writeln!(
        out,
        "  user RDTSC: {}",
        if h.user_rdtsc_traps {
            "faulted, emulated by the guest kernel from the logged clock"
        } else {
            "ran natively (not replayed faithfully)"
        }
    )?;
    if let Some(id) = h.host_apic_id {
        writeln!(
            out,
            "  host CPU:   APIC ID {id} (replay runs on a CPU with the same)"
        )?;
    }
    writeln!(out, "  config:")?;
    for line in h.config.lines() {
        writeln!(out, "    {}", printable(line))?;
    }
    Ok(())
}

/// A recording's chaos settings in words (`dump`, `ls`).
pub fn chaos_text(c: &trace::ChaosSettings) -> String {
    format!(
        "seed {}, a new priority at one kernel point in {} and one tick in {}, a change point \
         every {} to {} single-stepped user instructions on average ({} a thread, {} a process)",
        c.seed,
        c.entry_one_in,
        c.tick_one_in,
        1u32 << c.step_log_min.min(31),
        1u32 << c.step_log_max.min(31),
        c.thread_budget,
        c.process_budget
    )
}
