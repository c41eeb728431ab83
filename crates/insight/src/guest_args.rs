//! What to boot, as `run` and `record` take it: the config, overrides,
//! the command; and what both do with the console and the network report.

use std::path::PathBuf;

use anyhow::{Context, Result};
use vmm::console::ConsoleInput;
use vmm::guest::{self, BootOptions};
use vmm::image::GuestQuirks;
use vmm::{Vm, VmConfig};

/// What to boot: shared by `run` and `record`.
#[derive(clap::Args)]
pub struct GuestArgs {
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
    /// Do not forward standard input to the guest console.
    #[arg(long)]
    pub no_stdin: bool,
    /// Command to run in the guest instead of the config's.
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

impl GuestArgs {
    /// A short name for a recording of this guest (`crate::traces`).
    pub fn trace_name(&self) -> String {
        let command = if self.command.is_empty() && self.config.is_none() {
            VmConfig::builtin().command
        } else {
            self.command.clone()
        };
        crate::traces::base_name(self.config.as_deref(), &command)
    }
}

fn load_config(path: Option<&PathBuf>) -> Result<VmConfig> {
    Ok(match path {
        Some(p) => VmConfig::from_file(p)?,
        None => VmConfig::builtin(),
    })
}

/// The boot specification for `args`, and a description of the config
/// for trace headers.
pub fn prepare_guest(args: &GuestArgs) -> Result<(vmm::VmSpec, String)> {
    let mut config = load_config(args.config.as_ref())?;
    if !args.command.is_empty() {
        config.command = args.command.clone();
    }
    if let Some(mib) = args.memory {
        config.memory_mib = mib;
        config.validate_memory().context("--memory")?;
    }
    if let Some(extra) = &args.cmdline {
        config.cmdline = format!("{} {}", config.cmdline, extra);
    }
    let options = BootOptions {
        quirks: GuestQuirks::for_this_host()?,
        quiet: !args.verbose_boot,
    };
    let spec = guest::prepare(&config, &options)?;
    let description = match &args.config {
        Some(path) => format!(
            "# {}\n{}",
            path.display(),
            trace::files::read_bounded(path, vmm::config::MAX_CONFIG_BYTES, "config file")
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .unwrap_or_default()
        ),
        None => "# built-in guest\n".to_string(),
    };
    Ok((
        spec,
        format!("{description}# command: {:?}\n", config.command),
    ))
}

/// Forwards standard input to the guest unless told not to; the guard
/// keeps the terminal raw until the run ends.
pub fn attach_stdin(vm: &mut Vm, no_stdin: bool) -> Option<vmm::console::TerminalGuard> {
    if no_stdin {
        return None;
    }
    let (input, guard) = ConsoleInput::from_stdin();
    vm.attach_input(input);
    Some(guard)
}

/// What went wrong on the network device, in words (None: nothing did).
pub fn net_problems(report: Option<&vmm::vm::NetReport>) -> Option<String> {
    let report = report?;
    let s = &report.stats;
    let mut parts = Vec::new();
    if let Some(failure) = &report.failure {
        parts.push(format!("the TAP device stopped working ({failure})"));
    }
    let counts = [
        (
            s.rx_bad_size,
            "received frames of a size the guest does not accept were dropped",
        ),
        (
            s.rx_overflow,
            "received frames were dropped while the guest took none",
        ),
        (
            s.rx_bad_chains,
            "receive buffers from the guest were malformed",
        ),
        (
            s.tx_bad_chains,
            "transmit requests from the guest were malformed",
        ),
        (s.tx_errors, "sent frames were refused by the TAP device"),
    ];
    for (n, what) in counts {
        if n > 0 {
            parts.push(format!("{n} {what}"));
        }
    }
    (!parts.is_empty()).then(|| format!("network: {}", parts.join("; ")))
}
