//! Command-line parsing and the subcommands' glue to the library.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use vmm::guest::{self, BootOptions};
use vmm::image::GuestQuirks;
use vmm::{Vm, VmConfig};

/// Exit status when insight itself fails (bad config, no KVM, the guest
/// crashed); guest command statuses pass through unchanged otherwise.
pub const EXIT_INSIGHT_ERROR: u8 = 125;

#[derive(Parser)]
#[command(
    name = "insight",
    version,
    about = "Record and replay a Linux VM, and diagnose the programs in it",
    long_about = "insight boots a Linux guest on KVM with every asynchronous input routed \
through the VMM, so that a run can be recorded once and replayed deterministically.\n\n\
Start with `insight run` (boots the built-in guest and runs a demo) and \
`insight host-check` (what this host's KVM can do).",
    after_help = "Exit status: the guest command's status for `run`; 125 when insight \
itself fails; 2 for usage errors."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a guest and run a command in it.
    #[command(long_about = "Boot a guest and run a command in it.\n\n\
The guest's console is this terminal's standard output. insight exits with the guest \
command's exit status (128+N if a signal N killed it).\n\n\
Examples:\n  \
insight run                                  # built-in guest, demo workload\n  \
insight run -- sh -c 'uname -r; exit 3'      # exits with status 3\n  \
insight run my-vm.toml                       # your kernel, files, command\n  \
insight run my-vm.toml -- /usr/local/bin/prog --flag\n\n\
The config file format is described in docs/config.md.")]
    Run(RunArgs),
}

#[derive(Parser)]
struct RunArgs {
    /// VM config file (TOML); default: the built-in guest.
    config: Option<PathBuf>,
    /// Guest memory in MiB (overrides the config).
    #[arg(long, value_name = "MIB")]
    memory: Option<u64>,
    /// Extra kernel command-line text (appended to the config's).
    #[arg(long, value_name = "TEXT")]
    cmdline: Option<String>,
    /// Show the kernel's boot messages (no `quiet`).
    #[arg(long)]
    verbose_boot: bool,
    /// Print boot and run timings and exit counts on standard error.
    #[arg(long)]
    timings: bool,
    /// Command to run in the guest instead of the config's.
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

pub fn main() -> Result<ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => run(args),
    }
}

/// Formats an error with its causes on one line.
pub fn error_chain(err: &anyhow::Error) -> String {
    err.chain()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(": ")
}

fn load_config(path: Option<&PathBuf>) -> Result<VmConfig> {
    Ok(match path {
        Some(p) => VmConfig::from_file(p)?,
        None => VmConfig::builtin(),
    })
}

fn run(args: RunArgs) -> Result<ExitCode> {
    let mut config = load_config(args.config.as_ref())?;
    if !args.command.is_empty() {
        config.command = args.command;
    }
    if let Some(mib) = args.memory {
        config.memory_mib = mib;
        config.validate_memory().context("--memory")?;
    }
    if let Some(extra) = args.cmdline {
        config.cmdline = format!("{} {}", config.cmdline, extra);
    }
    let options = BootOptions {
        quirks: GuestQuirks::for_this_host()?,
        quiet: !args.verbose_boot,
    };
    let spec = guest::prepare(&config, &options)?;
    let console: vmm::vm::Console = Box::new(std::io::stdout());
    let vm = Vm::new(&spec, console)?;
    let outcome = vm.run()?;
    if args.timings {
        let mut err = std::io::stderr().lock();
        let init = outcome
            .init_reached
            .map(|d| format!("{:.3} s", d.as_secs_f64()))
            .unwrap_or_else(|| "never".into());
        let _ = writeln!(
            err,
            "insight: /init reached at {init}; guest ran {:.3} s; exits: {} port I/O, {} MMIO, \
             {} HLT, {} kicks; {} interrupts injected; {} instructions completed for the emulator",
            outcome.elapsed.as_secs_f64(),
            outcome.exits.port_io,
            outcome.exits.mmio,
            outcome.exits.halts,
            outcome.exits.kicks,
            outcome.exits.interrupts_injected,
            outcome.exits.emulation_completions,
        );
    }
    Ok(ExitCode::from(outcome.exit_status.unwrap_or(0)))
}
