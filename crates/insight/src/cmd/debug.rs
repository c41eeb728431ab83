//! `insight debug`: a recording's process under gdb, forwards and
//! backwards; and `insight replay --gdb`, the same for a gdb (or an IDE)
//! started elsewhere.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use debugger::{At, DebugOptions, Prepared};
use guestfiles::GuestFiles;
use vmm::builder::ReplayOptions;
use vmm::tools::control::ProcessSelector;

use super::replay::{parse_duration, parse_position, PositionArg, ReplayArgs};
use super::{open_trace, user_rdtsc_traps};
use crate::traces;

#[derive(clap::Args)]
pub struct DebugArgs {
    /// Trace directory written by `insight record`, or a recording's name
    /// in the trace store (`insight ls`); default: the latest recording.
    trace: Option<PathBuf>,
    /// The process to debug: its pid (as `insight report threads` lists
    /// it), or the name of the program it runs; default: the guest
    /// command's program. The session starts at its first instruction.
    #[arg(long, value_name = "PID|NAME")]
    process: Option<String>,
    /// Stop first at POS instead (anything `replay --from` takes: an exit
    /// ordinal, guest time such as 12s, first:lock:LWPID): the first exit
    /// after it where a thread of the process runs. `end`: the process's
    /// end (its last entry into the kernel from its own code: its exit,
    /// or the signal an `abort` or a failed assertion raises), to step
    /// back from a failure; `exit:PID`: process PID's end. History still
    /// starts at the program's first instruction.
    #[arg(long, value_name = "POS|end|exit:PID", value_parser = parse_at)]
    at: Option<DebugAt>,
    /// How often (host time of replay) the replay keeps a snapshot in
    /// memory: a reverse command replays at most about this long.
    #[arg(long, value_name = "PERIOD", default_value = "250ms", value_parser = parse_duration)]
    snapshot_every: Duration,
    /// Run on any host CPU, not only one reporting the APIC ID the
    /// recording ran on (see `insight replay --any-cpu`).
    #[arg(long)]
    any_cpu: bool,
    /// Arguments for gdb (after --), e.g. -batch -ex 'bt'.
    #[arg(last = true, value_name = "GDB-ARGS")]
    gdb_args: Vec<String>,
}

/// Where `insight debug --at` opens the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DebugAt {
    Position(PositionArg),
    /// The process's end (`end`), or process PID's (`exit:PID`).
    End(Option<u32>),
}

fn parse_at(text: &str) -> Result<DebugAt, String> {
    if text == "end" {
        return Ok(DebugAt::End(None));
    }
    if let Some(pid) = text.strip_prefix("exit:") {
        return match pid.parse::<u32>() {
            Ok(pid) if pid > 0 => Ok(DebugAt::End(Some(pid))),
            _ => Err(format!("'{pid}' in '{text}' is not a process id")),
        };
    }
    parse_position(text).map(DebugAt::Position)
}

/// The selector of `--process`, or the guest command's program.
fn selector(process: Option<&str>, files: &GuestFiles) -> Result<ProcessSelector> {
    if let Some(p) = process {
        if p.is_empty() {
            bail!("--process: name a process: its pid or its program's name");
        }
        return Ok(match p.parse::<u32>() {
            Ok(pid) => ProcessSelector::Pid(pid),
            Err(_) => ProcessSelector::Name(p.to_owned()),
        });
    }
    let command = files
        .get(guest::spec::COMMAND_FILE)
        .and_then(|argv| argv.split(|&b| b == 0).next())
        .map(|argv0| String::from_utf8_lossy(argv0).into_owned())
        .filter(|a| !a.is_empty())
        .context("the trace does not say which command the guest ran: name it with --process")?;
    let name = command.rsplit('/').next().unwrap_or(&command).to_owned();
    Ok(ProcessSelector::Name(name))
}

/// Replays `trace` to where the debugging session begins.
fn prepare(
    trace: &Path,
    process: Option<&str>,
    at: Option<DebugAt>,
    snapshot_every: Duration,
    any_cpu: bool,
) -> Result<Prepared> {
    let reader = open_trace(trace)?;
    let files = traces::guest_files(&reader.header, trace)?;
    let selector = match (at, process) {
        (Some(DebugAt::End(Some(pid))), None) => ProcessSelector::Pid(pid),
        (Some(DebugAt::End(Some(_))), Some(_)) => {
            bail!("--at exit:PID names the process already: leave --process out")
        }
        _ => selector(process, &files)?,
    };
    let at = match at {
        Some(DebugAt::Position(p)) => Some(At::Point(p.resolve(trace, false)?)),
        Some(DebugAt::End(_)) => Some(At::End),
        None => None,
    };
    let options = ReplayOptions {
        trace: trace.to_owned(),
        console: Box::new(std::io::sink()),
        streams: vmm::vm::HostStreams {
            out: Some(Box::new(std::io::sink())),
            err: Some(Box::new(std::io::sink())),
            errors: 0,
            input: None,
        },
        any_cpu,
        user_rdtsc_traps: user_rdtsc_traps()?,
        registers_only: false,
        events: None,
        tracing: None,
        from: None,
        to: None,
        checkpoint_every: None,
        debug: Some(selector.clone()),
        probes: None,
        sent_frames: None,
        progress: None,
    };
    let started = Instant::now();
    let (session, start) = vmm::builder::replay(reader, options)?;
    for note in &start.notes {
        eprintln!("insight: {note}");
    }
    let prepared = debugger::prepare(session, files, &DebugOptions { at, snapshot_every })
        .with_context(|| format!("cannot start debugging {selector:?} in {}", trace.display()))?;
    if let Some((pid, exe)) = prepared.process() {
        eprintln!(
            "insight: process {pid} ({exe}) stopped at its first instruction{} after {:.1} s",
            match at {
                Some(At::End) => " and replayed to its end",
                Some(At::Point(_)) => " and replayed to --at",
                None => "",
            },
            started.elapsed().as_secs_f64()
        );
    }
    Ok(prepared)
}

pub fn debug(args: DebugArgs) -> Result<ExitCode> {
    let trace = traces::resolve(args.trace.as_deref())?;
    let _hold = traces::hold(&trace, traces::TraceUse::Shared)?;
    let gdb = std::env::var_os("INSIGHT_GDB").unwrap_or_else(|| "gdb".into());
    if Command::new(&gdb).arg("--version").output().is_err() {
        bail!(
            "insight debug runs gdb, which is not installed: install it (on Debian: \
             apt-get install gdb), or serve a gdb elsewhere with `insight replay --gdb PORT`"
        );
    }
    let prepared = prepare(
        &trace,
        args.process.as_deref(),
        args.at,
        args.snapshot_every,
        args.any_cpu,
    )?;
    let listener = TcpListener::bind("127.0.0.1:0").context("cannot listen for gdb")?;
    let addr = listener.local_addr()?;
    // gdb shares the terminal: Ctrl-C is for it to pass on.
    vmm::console::leave_interrupt_key_to_child();
    let mut child = Command::new(&gdb)
        .arg("-q")
        .args(["-ex", "set sysroot target:"])
        .args(["-ex", &format!("target remote {addr}")])
        .args(&args.gdb_args)
        .spawn()
        .with_context(|| format!("cannot start {}", gdb.to_string_lossy()))?;
    let (stream, _) = accept_within(&listener, Duration::from_secs(60), &mut child)?;
    let served = debugger::serve(prepared, stream);
    if let Err(e) = &served {
        // Said now: gdb may stay open for the user after the session.
        eprintln!("insight: the debugging session ended: {e}");
    }
    let status = child.wait().context("gdb")?;
    served.context("the debugging session failed")?;
    Ok(ExitCode::from(
        status.code().unwrap_or(1).clamp(0, 255) as u8
    ))
}

/// The connection of the gdb started as `child`, refused if it exits
/// first or does not connect within `limit`.
fn accept_within(
    listener: &TcpListener,
    limit: Duration,
    child: &mut std::process::Child,
) -> Result<(std::net::TcpStream, SocketAddr)> {
    listener.set_nonblocking(true)?;
    let started = Instant::now();
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                stream.set_nonblocking(false)?;
                return Ok((stream, peer));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e).context("cannot accept gdb's connection"),
        }
        if let Some(status) = child.try_wait()? {
            bail!("gdb exited ({status}) before it connected");
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            bail!("gdb did not connect within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `insight replay [TRACE] --gdb [ADDR:]PORT`: the debugging session for a
/// gdb started elsewhere.
pub fn serve_replay(args: &ReplayArgs, listen: &str) -> Result<ExitCode> {
    let trace = traces::resolve(args.trace.as_deref())?;
    serve_gdb(&trace, listen, args.process.as_deref(), args.window.any_cpu)
}

/// `insight replay --gdb [ADDR:]PORT`: serves one gdb connection.
fn serve_gdb(trace: &Path, listen: &str, process: Option<&str>, any_cpu: bool) -> Result<ExitCode> {
    let addr = listen_address(listen)?;
    let listener =
        TcpListener::bind(addr).with_context(|| format!("cannot listen for gdb on {addr}"))?;
    let prepared = prepare(trace, process, None, Duration::from_millis(250), any_cpu)?;
    let addr = listener.local_addr()?;
    eprintln!("insight: waiting for gdb; in gdb: target remote {addr}");
    let (stream, peer) = listener
        .accept()
        .context("cannot accept gdb's connection")?;
    eprintln!("insight: gdb connected from {peer}");
    debugger::serve(prepared, stream).context("the debugging session failed")?;
    Ok(ExitCode::SUCCESS)
}

/// `[ADDR:]PORT`: loopback unless an address is given.
fn listen_address(text: &str) -> Result<SocketAddr> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    text.parse::<SocketAddr>().with_context(|| {
        format!("--gdb {text}: give a port (1234) or an address and port (0.0.0.0:1234)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdb_listens_on_loopback_unless_told_otherwise() {
        assert_eq!(
            listen_address("1234").unwrap(),
            "127.0.0.1:1234".parse().unwrap()
        );
        assert_eq!(
            listen_address("0.0.0.0:9").unwrap(),
            "0.0.0.0:9".parse().unwrap()
        );
        assert!(listen_address("localhost").is_err());
        assert!(listen_address("99999").is_err());
    }
}
