//! The command line: the clap tree, and which subcommand runs.

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::cmd;

#[derive(Parser)]
#[command(
    name = "insight",
    version,
    about = "Record and replay a Linux VM, and diagnose the programs in it",
    long_about = "insight boots a Linux guest on KVM with every asynchronous input routed \
through the VMM, so that a run can be recorded once and replayed deterministically.\n\n\
Start with `insight run` (boots the built-in guest and runs a demo) and \
`insight host-check` (what this host's KVM can do); then `insight record --probes -- CMD` \
(the probe library preloaded in the command) and `insight replay --diagnose locks`.",
    after_help = "Exit status: the guest command's status for `run` and `record`; for \
`replay` 0 (faithful), 1 (diverged), 4 (prefix of an incomplete trace); 3 when a trace or \
event database is damaged (a checksum, size or count does not match; any command); 124 \
when `record --timeout` ended a command that hung; 125 when insight itself fails; 2 for \
usage errors."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a guest and run a command in it.
    // Options from 1: --probes (0) leads.
    #[command(
        next_display_order = 1,
        long_about = "Boot a guest and run a command in it.\n\n\
The guest's console is this terminal: its output goes to standard output, and standard \
input is forwarded to it (on a terminal, keys go to the guest raw, Ctrl-C included; \
Ctrl-A x stops the VM, Ctrl-A Ctrl-A sends Ctrl-A). insight exits with the guest \
command's exit status (128+N if a signal N killed it; 130 if you stopped the VM).\n\n\
--probes preloads the probe library in the command, as `insight record --probes` does \
(events are collected when a recording is replayed).\n\n\
A command whose program is a bare name on the host's PATH runs in the host's files \
(read-only, writes kept in the guest's memory; the image's programs last on PATH); \
--image runs the built-in guest alone, as a config, --file, --host-path, a program named \
by its path and a bare name only the image has do (docs/host-files.md).\n\n\
The guest starts from a snapshot of its boot, restored in about a second: the first run of \
a kernel, initramfs, memory size and command line boots it and takes the snapshot \
(`insight cache` lists them). --cold-boot boots the kernel instead.\n\n\
Examples:\n  \
insight run --probes -- syn_cont 1000 2000   # a workload with the probe library\n  \
insight run                                  # built-in guest, demo workload\n  \
insight run -- sh                            # the host's shell, in the host's files\n  \
insight run -- sh -c 'uname -r; exit 3'      # exits with status 3\n  \
insight run --image -- sh                    # the built-in guest's busybox shell\n  \
insight run -- ./myprog --flag               # a host program, with its libraries\n  \
insight run my-vm.toml                       # your kernel, files, command\n  \
insight run my-vm.toml -- /usr/local/bin/prog --flag\n\n\
The config file format is described in docs/config.md."
    )]
    Run(cmd::run::RunArgs),
    /// Measure what this host's KVM supports and which strategy insight uses.
    #[command(
        long_about = "Measure what this host's KVM supports, with tiny probe guests, \
and print which strategy insight will use.\n\n\
Probes: where a user-mode SYSCALL lands; whether user-mode port I/O exits; whether `int3`, \
hardware breakpoints and single-step are intercepted in kernel and user mode; whether \
CR4.TSD makes user-mode RDTSC fault; whether an interrupt injected at a VM exit reaches \
the guest before its next instruction (what the exit clock rests on); whether user code \
stopped by a signal can be interrupted where it stands and found again by a replay \
trampoline (asynchronous points); whether a hardware branch counter (PMU) exists.\n\n\
Then, where insight can run, how fast guest user code runs here: the built-in image's \
`tick_count` loop, one busy task, natively (the same binary) and under `insight run` \
(the guest kernel stops its tick while one task runs in user mode) and booted with \
`nohz=off` (the periodic tick), best of 3; from these, the guest's timer interrupts a second \
and what one tick costs the program. --no-guest skips it.\n\n\
Exit status 0 when insight can run its guest on this host, 1 otherwise."
    )]
    HostCheck(cmd::host_check::HostCheckArgs),
    /// Boot a guest, run a command in it, and record the run into a trace.
    // Options from 1: --probes (0) leads.
    #[command(
        next_display_order = 1,
        long_about = "Boot a guest, run a command in it, and record the run into a \
trace directory that `insight replay` re-executes exactly.\n\n\
With --probes the command runs with the probe library preloaded (LD_PRELOAD), so that \
`insight replay --diagnose locks` (or --events) finds its lock, thread, fork and exit \
events. The probes cost the recording no VM exit: the events come out at replay. The \
trace keeps the setting, and replay needs no --probes. `probes = true` in a config does \
the same, and `env LD_PRELOAD=...` in the command still works.\n\n\
Takes the same config, options and command as `insight run`; the console works the same \
way, and what you type is recorded. Like a run, the recording starts from the guest's boot \
snapshot (--cold-boot: from power-on); the trace holds the snapshot (boot.snap, a hard link \
to the cached one), so it replays anywhere it is copied. Only the guest's non-deterministic inputs are logged: \
the values it reads from devices and the paravirtual clock, and where each interrupt was \
delivered. Asynchronous input reaches the guest at deterministic VM exits (the exit \
clock) or, when its user code runs 2 ms without one, where that code stands (an \
asynchronous point, logged with the complete state there), so the guest may take \
interrupts a little later than in `insight run`.\n\n\
The trace is written as the run goes; if the recorder dies, what it wrote is still a \
replayable prefix. On a terminal a status line shows guest time, exits and trace size.\n\n\
Without -o the trace goes to the trace store ($INSIGHT_TRACE_DIR, else \
$XDG_DATA_HOME/insight/traces, else ~/.local/share/insight/traces) under a name taken \
from the config or the command, and becomes the latest recording, which `replay`, \
`dump` and `report` take when no trace is named (`insight ls` lists them).\n\n\
Examples:\n  \
insight record --probes -- syn_cont 1000 2000  # a workload, with the probe library\n  \
insight replay --diagnose locks                # replay the latest, diagnose its locks\n  \
insight record --probes -- sysbench mutex     # a host program, in the host's files\n  \
insight record --probes -- ./myprog 8          # your program, brought from the host\n  \
insight record my-vm.toml                      # record your guest (into my-vm-0)\n  \
insight record -- syn_cont                     # a workload of the built-in guest\n  \
insight replay                                 # re-execute the latest\n  \
insight record -o t1 -- syn_cont               # into trace directory t1\n  \
insight record --until-fail --timeout 30s -- ./flaky  # keep the first run that fails\n\n\
With --until-fail the command is recorded again and again, each try from the boot \
snapshot, until it exits with a non-zero status or hangs (no progress for --timeout); only \
that recording is kept.\n\n\
Exit status: the guest command's, as for `run`; 124 for a hang (--timeout); with \
--until-fail, 0 when no try failed. The trace format is in \
docs/trace-format.md."
    )]
    Record(cmd::record::RecordArgs),
    /// Re-execute a recorded trace, checking every step against the log.
    #[command(
        long_about = "Re-execute a recorded trace from the same initial state with \
the recorded inputs, checking every deterministic exit against the log (kind, port or \
address, RIP, value written; a register digest every 64 exits by default). The guest's console \
output is printed again. Guest idle time is skipped.\n\n\
The first mismatch stops the replay with its position (exit ordinal) and both states. \
With no TRACE, the latest recording (`insight ls`).\n\n\
Checkpoints (the whole VM state, docs/trace-format.md) let a replay start where one \
is instead of at boot, and split a replay into segments that run side by side \
(docs/scale-out.md).\n\n\
Examples:\n  \
insight replay                               # the latest recording\n  \
insight replay --diagnose locks,deadlock     # and diagnose it (events in TRACE/events.db)\n  \
insight replay syn_cont-1 --events s.db --sample-period 1ms\n  \
insight replay t1 --checkpoint-every 2s --events t1.db  # and keep a checkpoint every 2 s\n  \
insight replay t1 --from 30s --to 32s         # two seconds of it, from the checkpoint before\n  \
insight replay t1 --jobs 2 --events t1.db    # the segments between checkpoints, 2 at a time\n\n\
Exit status: 0 when the replay matched the whole recording; 1 when it diverged; 4 when \
the trace is incomplete (its recorder did not finish) and its whole prefix replayed \
faithfully; 125 when insight could not replay (missing or changed image, unreadable \
trace, different host CPU)."
    )]
    Replay(Box<cmd::replay::ReplayArgs>),
    /// Debug a recording's process with gdb, forwards and backwards.
    #[command(
        long_about = "Replay a recording and debug one of its processes with gdb: breakpoints, single steps and watchpoints, forwards and backwards (reverse-continue, reverse-stepi, reverse-step, reverse-finish), on hosts without a hardware performance counter. gdb starts already connected, with the program's symbols and shared libraries read from the recording's own files, stopped at the program's first instruction (docs/debugging.md). The replay stays the recorded run: registers and memory are read only.

Without --process, the process is the one running the guest command's program.

Examples:
  insight debug                                # the latest recording's command
  insight debug syn_cont-0 --process syn_cont  # by program name (or pid)
  insight debug t1 --at first:lock:35          # start at a line of a lock report
  insight debug t1 -- -batch -ex 'break main' -ex continue -ex bt
  insight replay t1 --gdb 1234                 # serve an IDE's gdb instead

Exit status: gdb's."
    )]
    Debug(cmd::debug::DebugArgs),
    /// Which choices of a failing chaos recording's schedule make it fail.
    #[command(
        long_about = "Which choices of a failing chaos recording's schedule make \
the command fail (docs/chaos.md, \"Why it failed\").\n\n\
The command, given as it was recorded, is recorded again with the recording's scheduling \
decisions forced (`record --schedule TRACE:keep=LIST`), some of its choices left out; delta \
debugging narrows them to a set with which it still fails and without any one of which it \
passes. For each such choice: the task, where it stood (function and source line of the \
program), and where the other tasks ran to meanwhile. --confirm N then records the minimal \
set and each neighbour again N times and counts how often each failed and passed.\n\n\
Example:\n  insight record --chaos=1 --until-fail=200 -o t1 -- ./stack_bad\n  \
insight why t1 --confirm 10 -- ./stack_bad"
    )]
    Why(cmd::why::WhyArgs),
    /// Print a trace's header and event log (text or JSON lines).
    #[command(long_about = "Print a trace's header and event log.\n\n\
Text: one line per log entry, deterministic exits numbered by ordinal, interrupts and \
register digests under the exit they follow. --json: one JSON object per line, \
{\"exit\": N, \"event\": {...}}, after a first line holding the header.")]
    Dump(cmd::dump::DumpArgs),
    /// Find the first difference between two traces.
    #[command(
        long_about = "Compare two traces: their initial state (images, command \
line, memory, command) and their logs, entry by entry, and print the first difference \
with its position (log entry and deterministic exit ordinal). Two recordings of the same \
workload show where their executions parted (typically the first interrupt delivered at \
another exit, or a different value read).\n\n\
Exit status: 0 when the traces are the same run, 1 when they differ."
    )]
    Diff(cmd::diff::DiffArgs),
    /// Run a diagnosis tool over an event database, offline.
    #[command(long_about = "Run a diagnosis tool over an event database that \
`insight replay --events` wrote, without replaying again; as many times as you like.\n\n\
Tools: `locks` (lock contention), `profile` (function profile from samples, flame \
graph), `deadlock` (potential deadlocks from lock order), `threads` (per thread: \
lifetime, switches, samples, lock calls and waits), `memory` (accesses per variable and \
heap block of a traced process), `timeline` (threads, lock waits and holds over time, for \
Perfetto or as a page). Each is a plugin (docs/plugins.md); \
`insight report NAME DB [--trace DIR] [--json]` runs any of them with default options.")]
    Report(cmd::report::ReportArgs),
    /// Rewrite an event database in the other storage format.
    #[command(long_about = "Rewrite an event database in another storage format: \
`rows` (one SQL row per event, for your own queries with sqlite3) or `packed` (compressed \
blocks, a few bytes per event, what `insight replay --events` writes by default). \
Everything is kept: events in order with their sequence numbers, stacks, threads, objects, \
anomalies, meta. OUT is written as OUT.partial.PID (this process's own) and renamed when complete.\n\n\
Example:\n  insight convert t1.db t1-rows.db --events-format rows\n  \
sqlite3 t1-rows.db 'SELECT kind, count(*) FROM named_events GROUP BY kind'")]
    Convert(cmd::convert::ConvertArgs),
    /// Work on event databases: merge the databases of replay segments.
    Events(cmd::events::EventsArgs),
    /// List the recordings in the trace store.
    #[command(
        long_about = "List the recordings `insight record` made without -o, in \
the trace store ($INSIGHT_TRACE_DIR, else $XDG_DATA_HOME/insight/traces, else \
~/.local/share/insight/traces): name (* marks the latest, which `replay`, `dump` and \
`report` take when no trace is named), when it was recorded, the guest time it covers, \
its size, its state (complete; recording: a recorder is writing it now; incomplete: its \
recorder ended without finishing it), the size of the event database a replay wrote into \
it, and the command."
    )]
    Ls(cmd::ls::LsArgs),
    /// Remove recordings from the trace store.
    #[command(
        long_about = "Remove recordings: names in the trace store (`insight ls`) \
or trace directories. A directory that is not a trace is refused and left alone, and so is \
a trace another command is using (being recorded or replayed: the refusal names its pid). \
If the latest recording goes, the newest one left becomes the latest."
    )]
    Rm(cmd::ls::RmArgs),
    /// List or clear the cached boot snapshots.
    #[command(
        long_about = "List or clear the boot snapshots insight keeps so that `run` and \
`record` need not boot the guest kernel: one per kernel, initramfs, memory size, kernel \
command line and guest CPU, taken the first time it is needed and restored in about a \
second after that. A snapshot whose key no longer matches is never used, and one that \
fails its digest is taken again. The cache ($INSIGHT_SNAPSHOT_DIR, else `snapshots` in \
the guest image cache) keeps the snapshots used last. A trace recorded from a snapshot \
holds its own link or copy (boot.snap), so clearing the cache never breaks a trace.\n\n\
Examples:\n  \
insight cache          # list them\n  \
insight cache clear    # remove them all"
    )]
    Cache(cmd::cache::CacheArgs),
}

pub fn main() -> Result<ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => cmd::run::run(args),
        Command::HostCheck(args) => cmd::host_check::host_check(args),
        Command::Record(args) => cmd::record::record(args),
        Command::Replay(args) => match &args.gdb {
            Some(listen) => cmd::debug::serve_replay(&args, listen),
            None => cmd::replay::replay(*args),
        },
        Command::Debug(args) => cmd::debug::debug(args),
        Command::Dump(args) => cmd::dump::dump(args),
        Command::Why(args) => cmd::why::why(args),
        Command::Diff(args) => cmd::diff::diff(args),
        Command::Report(args) => cmd::report::report(args),
        Command::Convert(args) => cmd::convert::convert(&args),
        Command::Events(args) => cmd::events::events(args),
        Command::Ls(args) => cmd::ls::ls(args),
        Command::Rm(args) => cmd::ls::rm(args),
        Command::Cache(args) => cmd::cache::cache(args),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[test]
    fn record_and_run_take_probes_and_their_help_leads_with_it() {
        for sub in ["record", "run"] {
            let argv = ["insight", sub, "--probes", "--", "syn_cont", "1000", "2000"];
            assert!(Cli::try_parse_from(argv).is_ok(), "{sub}");
            let mut cli = Cli::command();
            let help = cli
                .find_subcommand_mut(sub)
                .unwrap()
                .render_long_help()
                .to_string();
            let first = |section: &str| {
                help.split(section)
                    .nth(1)
                    .and_then(|s| s.lines().find(|l| !l.trim().is_empty()))
                    .map(str::trim_start)
                    .unwrap_or_default()
                    .to_owned()
            };
            let example = format!("insight {sub} --probes -- syn_cont 1000 2000");
            assert!(first("Examples:").starts_with(&example), "{help}");
            assert!(first("Options:").starts_with("--probes"), "{help}");
            assert!(help.contains("/usr/lib/libinsight-probes.so"), "{help}");
        }
    }
}
