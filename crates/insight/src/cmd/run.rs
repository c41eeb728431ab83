//! `insight run`: boot a guest and run a command in it.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use vmm::VmError;

use crate::exit::EXIT_STOPPED_BY_USER;
use crate::guest_args::{
    host_streams, net_problems, prepare_guest, start_machine, stdin_input, terminal_output,
    GuestArgs,
};

#[derive(Parser)]
pub struct RunArgs {
    #[command(flatten)]
    guest: GuestArgs,
    /// Print boot and run timings and exit counts on standard error.
    #[arg(long)]
    timings: bool,
}

pub fn run(args: RunArgs) -> Result<ExitCode> {
    let started = std::time::Instant::now();
    let (spec, _) = prepare_guest(&args.guest)?;
    let (mut machine, snapshot) = start_machine(&spec, terminal_output(), terminal_output)?;
    let input = stdin_input(args.guest.no_stdin);
    machine.set_streams(host_streams(|w| w, input.pipe.clone()));
    let restored_in = started.elapsed();
    // Other runs may take the snapshot's lock from here on.
    let snapshot = snapshot.map(|s| s.restored);
    let outcome = match vmm::builder::live(machine, input.terminal.clone()).run() {
        Err(VmError::StoppedByUser) => {
            eprintln!("\ninsight: stopped by the user (Ctrl-A x)");
            return Ok(ExitCode::from(EXIT_STOPPED_BY_USER));
        }
        other => other?,
    };
    if let Some(problems) = net_problems(outcome.net.as_ref()) {
        eprintln!("insight: {problems}");
    }
    if args.timings {
        let mut err = std::io::stderr().lock();
        let init = outcome
            .init_reached
            .map(|d| format!("{:.3} s", d.as_secs_f64()))
            .unwrap_or_else(|| "never".into());
        if let Some(s) = &snapshot {
            let _ = writeln!(
                err,
                "insight: restored the boot snapshot (guest time {:.3} s) in {:.3} s, {:.3} s \
                 after insight started",
                s.vm_ns as f64 / 1e9,
                s.took_ns as f64 / 1e9,
                restored_in.as_secs_f64()
            );
        }
        let _ = writeln!(
            err,
            "insight: /init reached at {init}; guest ran {:.3} s; exits: {} port I/O, {} MMIO, \
             {} HLT, {} kicks; {} interrupts injected; {} instructions completed for the emulator; \
             {} reads and {} writes of unassigned ports; {} copies by the VMM for the guest \
             kernel ({:.1} MiB; {} left partly to it)",
            outcome.elapsed.as_secs_f64(),
            outcome.exits.port_io,
            outcome.exits.mmio,
            outcome.exits.halts,
            outcome.exits.kicks,
            outcome.exits.interrupts_injected,
            outcome.exits.emulation_completions,
            outcome.platform.unassigned_reads,
            outcome.platform.unassigned_writes,
            outcome.exits.copies.calls,
            outcome.exits.copies.bytes as f64 / f64::from(1 << 20),
            outcome.exits.copies.short,
        );
    }
    Ok(ExitCode::from(outcome.exit_status.unwrap_or(0)))
}
