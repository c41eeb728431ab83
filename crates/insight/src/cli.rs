//! Command-line parsing and the subcommands' glue to the library.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use vmm::console::ConsoleInput;
use vmm::guest::{self, BootOptions};
use vmm::host_check::{ClockKind, HostReport, Int3Behaviour, SyscallBehaviour};
use vmm::image::GuestQuirks;
use vmm::{Vm, VmConfig, VmError};

/// Exit status when insight itself fails (bad config, no KVM, the guest
/// crashed); guest command statuses pass through unchanged otherwise.
pub const EXIT_INSIGHT_ERROR: u8 = 125;
/// Exit status when the user stopped the VM from the terminal.
pub const EXIT_STOPPED_BY_USER: u8 = 130;

#[derive(Parser)]
#[command(
    name = "insight",
    version,
    about = "Record and replay a Linux VM, and diagnose the programs in it",
    long_about = "insight boots a Linux guest on KVM with every asynchronous input routed \
through the VMM, so that a run can be recorded once and replayed deterministically.\n\n\
Start with `insight run` (boots the built-in guest and runs a demo) and \
`insight host-check` (what this host's KVM can do); then `insight record -o TRACE -- CMD` \
and `insight replay TRACE`; with the probe library preloaded in the guest, \
`insight replay TRACE --diagnose locks`.",
    after_help = "Exit status: the guest command's status for `run` and `record`; for \
`replay` 0 (faithful), 1 (diverged), 4 (prefix of an incomplete trace); 125 when insight \
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
The guest's console is this terminal: its output goes to standard output, and standard \
input is forwarded to it (on a terminal, keys go to the guest raw, Ctrl-C included; \
Ctrl-A x stops the VM, Ctrl-A Ctrl-A sends Ctrl-A). insight exits with the guest \
command's exit status (128+N if a signal N killed it; 130 if you stopped the VM).\n\n\
Examples:\n  \
insight run                                  # built-in guest, demo workload\n  \
insight run -- sh                            # an interactive shell in the guest\n  \
insight run -- sh -c 'uname -r; exit 3'      # exits with status 3\n  \
insight run my-vm.toml                       # your kernel, files, command\n  \
insight run my-vm.toml -- /usr/local/bin/prog --flag\n\n\
The config file format is described in docs/config.md.")]
    Run(RunArgs),
    /// Measure what this host's KVM supports and which strategy insight uses.
    #[command(
        long_about = "Measure what this host's KVM supports, with tiny probe guests, \
and print which strategy insight will use.\n\n\
Probes: where a user-mode SYSCALL lands; whether user-mode port I/O exits; whether `int3`, \
hardware breakpoints and single-step are intercepted in kernel and user mode; whether \
CR4.TSD makes user-mode RDTSC fault; whether an interrupt injected at a VM exit reaches \
the guest before its next instruction (what the exit clock rests on); whether a hardware \
branch counter (PMU) exists.\n\n\
Exit status 0 when insight can run its guest on this host, 1 otherwise."
    )]
    HostCheck,
    /// Boot a guest, run a command in it, and record the run into a trace.
    #[command(
        long_about = "Boot a guest, run a command in it, and record the run into a \
trace directory that `insight replay` re-executes exactly.\n\n\
Takes the same config, options and command as `insight run`; the console works the same \
way, and what you type is recorded. Only the guest's non-deterministic inputs are logged: \
the values it reads from devices and the paravirtual clock, and where each interrupt was \
delivered. Asynchronous input reaches the guest only at deterministic VM exits (the exit \
clock), so the guest may take interrupts a little later than in `insight run`.\n\n\
The trace is written as the run goes; if the recorder dies, what it wrote is still a \
replayable prefix. On a terminal a status line shows guest time, exits and trace size.\n\n\
Examples:\n  \
insight record -o t1 -- syn_cont             # record a workload of the built-in guest\n  \
insight record my-vm.toml -o t2              # record your guest\n  \
insight replay t1                            # re-execute it\n\n\
Exit status: the guest command's, as for `run`. The trace format is in \
docs/trace-format.md."
    )]
    Record(crate::journal_cmds::RecordArgs),
    /// Re-execute a recorded trace, checking every step against the log.
    #[command(
        long_about = "Re-execute a recorded trace from the same initial state with \
the recorded inputs, checking every deterministic exit against the log (kind, port or \
address, RIP, value written; a register digest every 64 exits by default). The guest's console \
output is printed again. Guest idle time is skipped.\n\n\
The first mismatch stops the replay with its position (exit ordinal) and both states.\n\n\
Exit status: 0 when the replay matched the whole recording; 1 when it diverged; 4 when \
the trace is incomplete (its recorder did not finish) and its whole prefix replayed \
faithfully; 125 when insight could not replay (missing or changed image, unreadable \
trace, different host CPU)."
    )]
    Replay(crate::journal_cmds::ReplayArgs),
    /// Print a trace's header and event log (text or JSON lines).
    #[command(long_about = "Print a trace's header and event log.\n\n\
Text: one line per log entry, deterministic exits numbered by ordinal, interrupts and \
register digests under the exit they follow. --json: one JSON object per line, \
{\"exit\": N, \"event\": {...}}, after a first line holding the header.")]
    Dump(crate::journal_cmds::DumpArgs),
    /// Find the first difference between two traces.
    #[command(
        long_about = "Compare two traces: their initial state (images, command \
line, memory, command) and their logs, entry by entry, and print the first difference \
with its position (log entry and deterministic exit ordinal). Two recordings of the same \
workload show where their executions parted (typically the first interrupt delivered at \
another exit, or a different value read).\n\n\
Exit status: 0 when the traces are the same run, 1 when they differ."
    )]
    Diff(crate::journal_cmds::DiffArgs),
    /// Run a diagnosis tool over an event database, offline.
    #[command(long_about = "Run a diagnosis tool over an event database that \
`insight replay --events` wrote, without replaying again; as many times as you like.\n\n\
Tools: `locks` (lock contention), `profile` (function profile from samples, flame \
graph), `deadlock` (potential deadlocks from lock order), `threads` (per thread: \
lifetime, switches, samples, lock calls and waits). Each is a plugin (docs/plugins.md); \
`insight report NAME DB [--trace DIR] [--json]` runs any of them with default options.")]
    Report(crate::report_cmds::ReportArgs),
    /// Rewrite an event database in the other storage format.
    #[command(long_about = "Rewrite an event database in another storage format: \
`rows` (one SQL row per event, for your own queries with sqlite3) or `packed` (compressed \
blocks, a few bytes per event, what `insight replay --events` writes by default). \
Everything is kept: events in order with their sequence numbers, stacks, threads, objects, \
anomalies, meta. OUT is written as OUT.partial and renamed when complete.\n\n\
Example:\n  insight convert t1.db t1-rows.db --events-format rows\n  \
sqlite3 t1-rows.db 'SELECT kind, count(*) FROM named_events GROUP BY kind'")]
    Convert(crate::report_cmds::ConvertArgs),
}

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

#[derive(Parser)]
struct RunArgs {
    #[command(flatten)]
    guest: GuestArgs,
    /// Print boot and run timings and exit counts on standard error.
    #[arg(long)]
    timings: bool,
}

pub fn main() -> Result<ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => run(args),
        Command::HostCheck => host_check(),
        Command::Record(args) => crate::journal_cmds::record(args),
        Command::Replay(args) => crate::journal_cmds::replay(args),
        Command::Dump(args) => crate::journal_cmds::dump(args),
        Command::Diff(args) => crate::journal_cmds::diff(args),
        Command::Report(args) => crate::report_cmds::report(args),
        Command::Convert(args) => crate::report_cmds::convert(&args),
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
            std::fs::read_to_string(path).unwrap_or_default()
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

fn run(args: RunArgs) -> Result<ExitCode> {
    let (spec, _) = prepare_guest(&args.guest)?;
    let console: vmm::vm::Console = Box::new(std::io::stdout());
    let mut vm = Vm::new(&spec, console)?;
    let _terminal = attach_stdin(&mut vm, args.guest.no_stdin);
    let outcome = match vm.run() {
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
        let _ = writeln!(
            err,
            "insight: /init reached at {init}; guest ran {:.3} s; exits: {} port I/O, {} MMIO, \
             {} HLT, {} kicks; {} interrupts injected; {} instructions completed for the emulator; \
             {} reads and {} writes of unassigned ports",
            outcome.elapsed.as_secs_f64(),
            outcome.exits.port_io,
            outcome.exits.mmio,
            outcome.exits.halts,
            outcome.exits.kicks,
            outcome.exits.interrupts_injected,
            outcome.exits.emulation_completions,
            outcome.platform.unassigned_reads,
            outcome.platform.unassigned_writes,
        );
    }
    Ok(ExitCode::from(outcome.exit_status.unwrap_or(0)))
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

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn int3_text(b: &Int3Behaviour) -> String {
    match b {
        Int3Behaviour::Intercepted => "intercepted by the VMM".into(),
        Int3Behaviour::GuestHandler => "goes to the guest's #BP handler".into(),
        Int3Behaviour::NotEmulated => "not emulated by KVM; insight injects #BP itself".into(),
        Int3Behaviour::Unknown(what) => format!("unexpected: {what}"),
    }
}

fn host_check() -> Result<ExitCode> {
    let r = HostReport::measure()?;
    let syscall = match &r.syscall {
        SyscallBehaviour::EntersKernel => "enters ring 0 (architectural)".to_string(),
        SyscallBehaviour::StaysInUserMode => {
            "stays in ring 3 -> guest kernel uses its page-fault syscall trap".to_string()
        }
        SyscallBehaviour::Unknown(what) => format!("unexpected: {what}"),
    };
    let pmu = match &r.pmu.host_branch_counter {
        Ok(()) => "available".to_string(),
        Err(e) => format!("not available ({e})"),
    };
    println!("insight host check");
    println!("  user-mode SYSCALL:               {syscall}");
    println!(
        "  user-mode port I/O exits:        {}",
        yes_no(r.user_port_io)
    );
    println!(
        "  int3 in kernel mode:             {}",
        int3_text(&r.int3_kernel)
    );
    println!(
        "  int3 in user mode:               {}",
        int3_text(&r.int3_user)
    );
    println!(
        "  hardware breakpoint, kernel:     {}",
        yes_no(r.hw_breakpoint_kernel)
    );
    println!(
        "  hardware breakpoint, user:       {}",
        yes_no(r.hw_breakpoint_user)
    );
    println!(
        "  single-step, kernel:             {}",
        yes_no(r.single_step_kernel)
    );
    println!(
        "  single-step, user:               {}",
        yes_no(r.single_step_user)
    );
    println!("  CR4.TSD traps user RDTSC:        {}", yes_no(r.user_tsd));
    println!(
        "  user-mode XCR0 (guest set 0x3):   {:#x}{}",
        r.user_xcr0,
        if r.user_xcr0 == 3 {
            ""
        } else {
            " (host's: the VMM completes XSAVE/XRSTOR for the guest kernel)"
        }
    );
    println!(
        "  interrupt at exit, delivered:    {}",
        if r.delivery.exact == r.delivery.rounds {
            format!(
                "before the next instruction ({} of {})",
                r.delivery.exact, r.delivery.rounds
            )
        } else {
            format!(
                "late in {} of {} tries (up to {} instructions): recordings are not exact here",
                r.delivery.rounds - r.delivery.exact,
                r.delivery.rounds,
                r.delivery.max_late
            )
        }
    );
    println!("  host branch counter (PMU):       {pmu}");
    println!(
        "  PMU counters offered to guests:  {}",
        r.pmu.guest_counters
    );
    println!("strategy");
    match r.clock() {
        ClockKind::Branch => {
            println!("  clock: branch (guest retired branches, exact positions anywhere)")
        }
        ClockKind::Exit => println!(
            "  clock: exit (no usable PMU: asynchronous events land at deterministic VM exits)"
        ),
    }
    println!(
        "  probes: {}",
        if r.int3_user == Int3Behaviour::Intercepted {
            "int3 intercepted by the VMM, patched to nop after the first hit"
        } else {
            "int3 handled by the guest kernel, forwarded to the VMM with a deterministic exit"
        }
    );
    if r.user_tsd {
        println!(
            "  user-mode RDTSC: faults, and the guest kernel answers it from the replayed clock"
        );
    } else {
        println!(
            "  user-mode RDTSC cannot be trapped here, so the guest kernel cannot emulate it: \
             a program that reads the TSC (or RDRAND) directly is not replayed faithfully \
             (glibc, busybox and the guest image do not)"
        );
    }
    if r.can_run() {
        println!("insight can run on this host.");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("insight cannot run on this host: the SYSCALL behaviour is not one it knows.");
        Ok(ExitCode::from(1))
    }
}
