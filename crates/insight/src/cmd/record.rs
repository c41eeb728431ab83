//! `insight record`: run a guest and record the run into a trace.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use journal::{Journal, Recorder};
use trace::{ClockKind, Header, TraceWriter};
use vmm::VmError;

use super::{attach_progress, user_rdtsc_traps};
use crate::exit::EXIT_STOPPED_BY_USER;
use crate::guest_args::{attach_stdin, net_problems, prepare_guest, start_vm, GuestArgs};
use crate::status::{human_bytes, StatusLine};
use crate::traces;

#[derive(clap::Args)]
pub struct RecordArgs {
    /// Trace directory to create (must not exist, or be empty). Default: a
    /// new one in the trace store, named after the config or the command
    /// (`syn_cont-0`, `syn_cont-1`, ...), which becomes the latest
    /// recording that `replay`, `dump` and `report` take when no trace is
    /// named (`insight ls` lists them).
    #[arg(short, long, value_name = "DIR")]
    output: Option<PathBuf>,
    /// Print a summary of the recording on standard error even when it is
    /// not a terminal.
    #[arg(long)]
    summary: bool,
    /// Log a digest of the registers every N deterministic exits (1: at
    /// every exit, finding a divergence exactly; larger: smaller traces).
    #[arg(long, value_name = "N", default_value_t = journal::DEFAULT_DIGEST_INTERVAL,
          value_parser = clap::value_parser!(u64).range(1..))]
    digest_every: u64,
    /// Timestamp clock: `exit` (deterministic VM exits, works on any host)
    /// or `branch` (guest retired branches; needs a hardware PMU that KVM
    /// exposes, see `insight host-check`).
    #[arg(long, value_enum, default_value_t = ClockChoice::Exit)]
    clock: ClockChoice,
    #[command(flatten)]
    guest: GuestArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ClockChoice {
    Exit,
    Branch,
}

/// Checks that the clock asked for can be used here.
fn choose_clock(choice: ClockChoice) -> Result<ClockKind> {
    match choice {
        ClockChoice::Exit => Ok(ClockKind::Exit),
        ClockChoice::Branch => {
            let pmu = vmm::host_check::probe_pmu().context("cannot probe the host's PMU")?;
            let mut missing = Vec::new();
            if let Err(e) = &pmu.host_branch_counter {
                missing.push(format!(
                    "the host cannot count branches (perf_event_open: {e})"
                ));
            }
            if pmu.guest_counters == 0 {
                missing.push("KVM offers guests no PMU counters".to_owned());
            }
            if !missing.is_empty() {
                bail!(
                    "--clock branch needs a hardware branch counter, and this host has none: {}; \
                     record with --clock exit (the default), which needs no PMU",
                    missing.join("; ")
                );
            }
            bail!(
                "--clock branch: this host has a PMU, but this version of insight records with \
                 the exit clock only; record with --clock exit (the default)"
            )
        }
    }
}

pub fn record(args: RecordArgs) -> Result<ExitCode> {
    let clock = choose_clock(args.clock)?;
    let (spec, config) = prepare_guest(&args.guest)?;
    let output = match &args.output {
        Some(dir) => dir.clone(),
        None => {
            let store = traces::store()?;
            let dir = traces::new_trace(&store, &args.guest.trace_name())?;
            eprintln!("insight: recording into {}", dir.display());
            dir
        }
    };
    let status = StatusLine::for_stderr();
    let (mut vm, snapshot) = start_vm(&spec, status.console(Box::new(std::io::stdout())), || {
        status.console(Box::new(std::io::stdout()))
    })?;
    let (images, mut boot) = guest::trace_images(&spec)?;
    boot.snapshot = snapshot.as_ref().map(|s| trace::SnapshotRef {
        key: trace::checkpoints::hex(&s.key),
        digest: trace::checkpoints::hex(&s.restored.digest),
        guest_ns: s.restored.vm_ns,
    });
    let host_cpu =
        vmm::host_cpu::for_recording().context("cannot choose a host CPU for the vCPU")?;
    vm.run_on_host_cpu(host_cpu.cpu);
    let header = Header {
        clock,
        created_unix_secs: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        guest_cpuid: vm.guest_cpuid().to_vec(),
        kvm_caps: vm.kvm_caps().to_vec(),
        user_rdtsc_traps: user_rdtsc_traps()?,
        host_apic_id: Some(host_cpu.apic_id),
        config,
        images,
        boot,
        digest_interval: args.digest_every,
    };
    let writer = TraceWriter::create(&output, &header)
        .with_context(|| format!("cannot create trace {}", output.display()))?;
    if let Some(s) = snapshot {
        vmm::snapshot::link_into(&s, &output.join(trace::SNAPSHOT_FILE))
            .context("cannot put the boot snapshot in the trace")?;
        // Other runs may take the snapshot's lock from here on.
        drop(s);
    }
    vm.set_journal(Journal::Record(Box::new(Recorder::new(
        writer,
        args.digest_every,
    ))));
    let preemption = vmm::host_check::probe_state_match()
        .context("cannot probe whether this host can preempt guest user code")?;
    if !preemption.works() {
        vm.deliver_at_exits_only();
        eprintln!(
            "insight: this host cannot preempt guest user code where it stands ({}): \
             interrupts wait for the guest's next exit, and a program that busy-waits may \
             not finish (insight host-check)",
            preemption
                .failure
                .as_deref()
                .unwrap_or("the state was not found again")
        );
    }
    attach_progress(&mut vm, &status, "record");
    let _terminal = attach_stdin(&mut vm, args.guest.no_stdin);
    let result = vm.run();
    status.clear();
    let outcome = match result {
        Err(VmError::StoppedByUser) => {
            eprintln!(
                "\ninsight: stopped by the user (Ctrl-A x); the trace in {} holds the run up to here",
                output.display()
            );
            return Ok(ExitCode::from(EXIT_STOPPED_BY_USER));
        }
        other => other.with_context(|| {
            format!(
                "recording failed (the trace in {} holds the run up to the failure)",
                output.display()
            )
        })?,
    };
    if let Some(problems) = net_problems(outcome.net.as_ref()) {
        eprintln!("insight: {problems}");
    }
    if args.summary || status.enabled() {
        let bytes = outcome
            .trace
            .map(|s| s.event_bytes + s.payload_bytes)
            .unwrap_or(0);
        eprintln!(
            "insight: recorded {} deterministic exits, {} log entries, {:.2} s of guest time; \
             trace {} ({}) in {}",
            outcome.journal.exits,
            outcome.journal.entries,
            outcome.journal.guest_ns as f64 / 1e9,
            human_bytes(bytes),
            bytes,
            output.display()
        );
        let p = &outcome.preempt;
        if p.points + p.declined > 0 {
            eprintln!(
                "insight: preempted user code at {} asynchronous points ({} at the task's next \
                 pass, {} positions declined; {:.2} s reading their state)",
                p.points,
                p.advanced,
                p.declined,
                p.busy_ns as f64 / 1e9
            );
        }
    }
    Ok(ExitCode::from(outcome.exit_status.unwrap_or(0)))
}
