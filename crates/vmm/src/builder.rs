//! From plain options to a session ready to run: the machine created from
//! a [`VmSpec`], its boot snapshot restored, the host CPU chosen, the
//! recording's trace created or the recording's host checked, and the
//! replay-time tools attached. The command line only parses, calls one of
//! [`live`], [`record`] or [`replay`], and prints.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use events::capture::Capture;
use events::db::EventWriter;
use guest::VmSpec;
use guestfiles::kernel::{kernel_code, kernel_instruction, kernel_variable};
use introspect::guest_events::KERNEL_START;
use journal::{Entry, HostMismatch, Recorder, ReplayPoint, Replayer};
use trace::{ClockKind, Header, TraceReader, TraceWriter};

use crate::console::ConsoleInput;
use crate::points::{Chaos, PointSearch, PointTaker};
use crate::session::{LiveRun, ProgressFn, RecordSession, ReplaySession};
use crate::snapshot_cache::{self, CacheStart, SnapshotError};
use crate::tools::control::{KernelPoints, ProcessSelector};
use crate::tools::debug::DebugTool;
use crate::tools::events::EventTool;
use crate::tools::probes::{self, ProbePlan, ProbeTool};
use crate::tools::samples::Sampling;
use crate::tools::tracing::ProcessTracer;
use crate::tools::{
    checkpoint_before, CheckpointEvery, CheckpointRestored, ExpansionSpec, ReplayTools,
};
use crate::vm::{Console, Machine, VmError};
use devices::virtio_net::FrameSink;

/// Where a debugger stops a task about to run user code again: the
/// guest kernel's return to user mode by `iretq` (at the `swapgs` within
/// the first bytes of its code), and its `swapgs; sysretq` of fast
/// system-call returns.
const KERNEL_USER_IRET: &str = "swapgs_restore_regs_and_return_to_usermode";
const SWAPGS: [u8; 3] = [0x0f, 0x01, 0xf8];
const KERNEL_SYSRET: &str = "entry_SYSRETQ_unsafe_stack";

/// The guest kernel variable that holds the top of the current task's
/// kernel stack (a uniprocessor kernel's per-CPU variables are plain
/// globals): samples in the kernel find the user registers below it, and
/// the tracing of a process sets its trap flag there.
const KERNEL_STACK_TOP: &str = "cpu_current_top_of_stack";

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("cannot start from a boot snapshot (--cold-boot boots without one)")]
    Snapshot(#[from] SnapshotError),
    #[error("cannot create trace {path}")]
    CreateTrace {
        path: PathBuf,
        #[source]
        source: trace::TraceError,
    },
    #[error("cannot put the boot snapshot in the trace")]
    LinkSnapshot(#[source] SnapshotError),
    #[error("cannot choose a host CPU for the vCPU")]
    HostCpu(#[source] std::io::Error),
    #[error("cannot probe whether this host can preempt guest user code")]
    ProbeHost(#[source] crate::host_check::HostCheckError),
    #[error(transparent)]
    Guest(#[from] guest::GuestError),
    #[error(
        "{trace} was recorded with the branch clock; this insight replays exit-clock traces only"
    )]
    BranchClock { trace: PathBuf },
    #[error(
        "this host's CPU differs from the one {trace} was recorded on ({difference}); the guest \
         would see a different CPU: replay on the recording host or one with the same CPU"
    )]
    OtherCpu { trace: PathBuf, difference: String },
    #[error(
        "this host's KVM cannot replay {trace} the way it was recorded ({difference}); replay on \
         the recording host or one whose KVM has the same capabilities"
    )]
    OtherKvm { trace: PathBuf, difference: String },
    #[error(
        "{trace} has no checkpoint at or before {at}: take some with `insight replay {trace} \
         --checkpoint-every 2s`"
    )]
    NoCheckpoint { trace: PathBuf, at: String },
    #[error("{trace}: the recorded guest has no network device to capture frames of")]
    NoNetwork { trace: PathBuf },
    #[error("a debugger's replay collects no events and traces no process")]
    DebugAndTools,
    #[error("probes given at replay need an event database (--events or --diagnose)")]
    ProbesWithoutEvents,
    #[error("probes given at replay cannot go with a debugger or the tracing of a process")]
    ProbesAndTools,
}

impl BuildError {
    /// Whether a damaged file caused it ([`VmError::is_damage`]).
    pub fn is_damage(&self) -> bool {
        matches!(self, BuildError::Vm(v) if v.is_damage())
    }
}

/// What a build had to say that is not an error (printed by the caller).
pub type Notes = Vec<String>;

/// Creates the machine for `spec` and, unless it boots cold, restores its
/// boot snapshot (taking it first if the cache has none). `console` gets
/// the guest's output; so does the boot that takes a snapshot, through
/// `build_console`, when `spec` shows boot messages. `say` is told what
/// happens to the cache as it happens.
pub fn machine(
    spec: &VmSpec,
    console: Console,
    build_console: impl FnOnce() -> Console,
    say: &mut dyn FnMut(&str),
) -> Result<(Machine, Option<CacheStart>), BuildError> {
    let mut machine = Machine::new(spec, console)?;
    if spec.start != guest::Start::Snapshot {
        return Ok((machine, None));
    }
    let started = snapshot_cache::restore_cached(&mut machine, spec, build_console(), say)?;
    Ok((machine, Some(started)))
}

/// A plain run of `machine` (`machine()` made it), with host `input` for
/// the guest's serial console.
pub fn live(mut machine: Machine, input: Option<ConsoleInput>) -> LiveRun {
    if let Some(input) = input {
        machine.attach_input(input);
    }
    LiveRun::new(machine)
}

/// What a recording needs besides its machine.
pub struct RecordOptions<'a> {
    /// What boots (the machine was made from it).
    pub spec: &'a VmSpec,
    /// The boot snapshot the machine was restored from, if any.
    pub snapshot: Option<&'a CacheStart>,
    /// The trace directory to create.
    pub output: PathBuf,
    /// The config, as people reading the trace header should see it.
    pub config_text: String,
    /// A register digest every so many deterministic exits.
    pub digest_every: u64,
    /// Whether user-mode RDTSC faults on this host.
    pub user_rdtsc_traps: bool,
    /// Host input for the guest's serial console (recorded as the guest
    /// reads it).
    pub input: Option<ConsoleInput>,
    /// Called with the recording's counts about twice a second.
    pub progress: Option<ProgressFn>,
    /// The recording's sampling clock: a sample mark about every so much
    /// VM time, where replay collects the thread and stack
    /// (docs/events.md, "Samples").
    pub sample_period: Option<Duration>,
    /// A run whose guest user code makes no progress (no system call or
    /// fault from user mode) for this long (host time) ends as a hang
    /// (`VmError::TimeLimit`, logged as `EndReason::Hung`).
    pub time_limit: Option<Duration>,
    /// The guest scheduler's chaos, decided from these settings
    /// (docs/chaos.md), written in the trace header.
    pub chaos: Option<trace::ChaosSettings>,
    /// With `chaos`, a recording's decisions taken again instead of the
    /// seed's (`record --schedule`, docs/chaos.md).
    pub schedule: Option<crate::ForcedDecisions>,
    /// Where the trace store keeps the host files its recordings read
    /// (`trace::objects`), if the trace goes into one: each file once.
    pub shared_objects: Option<PathBuf>,
}

/// A recording of `machine` into a new trace: the vCPU kept on one host
/// CPU (named in the header), the trace created with its header and the
/// boot snapshot linked into it, and asynchronous points taken where this
/// host can preempt user code (else a note says it cannot).
pub fn record(
    mut machine: Machine,
    options: RecordOptions<'_>,
) -> Result<(RecordSession, Notes), BuildError> {
    let mut notes = Notes::new();
    let (images, mut boot) = guest::trace_images(options.spec)?;
    boot.snapshot = options.snapshot.map(|s| trace::SnapshotRef {
        key: trace::checkpoints::hex(&s.key),
        digest: trace::checkpoints::hex(&s.restored.digest),
        guest_ns: s.restored.vm_ns,
    });
    let host_cpu = crate::host_cpu::for_recording().map_err(BuildError::HostCpu)?;
    machine.run_on_host_cpu(host_cpu.cpu);
    let preemption = crate::host_check::check_state_match().map_err(BuildError::ProbeHost)?;
    let mut points = if preemption.works() {
        PointTaker::default()
    } else {
        notes.push(format!(
            "this host cannot preempt guest user code where it stands ({}): interrupts wait \
             for the guest's next exit, and a program that busy-waits may not finish \
             (insight host-check)",
            preemption
                .failure
                .as_deref()
                .unwrap_or("the state was not found again")
        ));
        PointTaker::at_exits_only()
    };
    if let Some(period) = options.sample_period {
        let period_ns = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1);
        let top = kernel_variable(&options.spec.kernel_image, KERNEL_STACK_TOP)
            .filter(|&a| a >= KERNEL_START);
        points.sample_every(period_ns, top);
        if points.sample_period_ns() == 0 {
            notes.push(
                "no sample marks in this recording (user code cannot be found again where it \
                 stands): a replay samples by its own time"
                    .to_owned(),
            );
        }
    }
    let vm = machine.vm();
    let header = Header {
        clock: ClockKind::Exit,
        created_unix_secs: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        guest_cpuid: vm.guest_cpuid().to_vec(),
        kvm_caps: vm.kvm_caps().to_vec(),
        user_rdtsc_traps: options.user_rdtsc_traps,
        host_apic_id: Some(host_cpu.apic_id),
        config: options.config_text,
        images,
        boot,
        digest_interval: options.digest_every,
        sample_period_ns: points.sample_period_ns(),
        chaos: options.chaos,
    };
    let writer = TraceWriter::create(&options.output, &header).map_err(|source| {
        BuildError::CreateTrace {
            path: options.output.clone(),
            source,
        }
    })?;
    if let Some(s) = options.snapshot {
        snapshot_cache::link_into(s, &options.output.join(trace::SNAPSHOT_FILE))
            .map_err(BuildError::LinkSnapshot)?;
    }
    if let Some(input) = options.input {
        machine.attach_input(input);
    }
    let mut recorder = Recorder::new(writer, options.digest_every);
    if let Some(shared) = options.shared_objects {
        recorder.share_objects(shared);
    }
    let mut session = RecordSession::new(machine, recorder, points);
    if let Some(progress) = options.progress {
        session.on_progress(progress);
    }
    if let Some(limit) = options.time_limit {
        session.limit_time(limit);
    }
    if let Some(settings) = options.chaos {
        if !preemption.works() {
            notes.push(
                "--chaos forces no preemption on this host: user code cannot be preempted \
                 where it stands"
                    .to_owned(),
            );
        }
        session.perturb(match options.schedule {
            Some(forced) => Chaos::forced(settings, forced),
            None => Chaos::new(settings),
        });
    }
    Ok((session, notes))
}

/// Reads a guest file by its path in the guest (the run's initramfs with
/// its archive): what stacks are unwound by.
pub type GuestFileLoader = Box<dyn Fn(&str) -> Option<Vec<u8>> + Send>;

/// The event capture of a replay.
pub struct EventOptions {
    /// The database the events go to.
    pub db: EventWriter,
    /// Also the probe library's heap events (an exit each at replay).
    pub heap: bool,
    /// Unwind user stacks by the call-frame information of the guest's
    /// files, read with this (`None`: by frame pointers).
    pub cfi_files: Option<GuestFileLoader>,
    /// A SAMPLE of the tracked task on the vCPU about every so much time:
    /// at the recording's sample marks where it took them (every mark at
    /// its period, fewer for a longer one), else by host time.
    pub sample_period: Option<Duration>,
    /// Sample by host time even where the recording took sample marks.
    pub replay_time_samples: bool,
    /// Also a SAMPLE at each of a chaos recording's decisions, of the task
    /// that asked (tracked or not): its user position and stack.
    pub decision_samples: bool,
    /// The window ends at the first event of this kind (of this thread, or
    /// any): nothing after it is stored.
    pub end_after: Option<(events::abi::Kind, Option<u32>)>,
    /// Every probe event leaves the guest, as without an event ring (to
    /// measure what the ring saves). A window that ends at an event does
    /// too, so as to stop where the event was raised.
    pub exits: bool,
}

/// The period (ns) at which a replay samples at the recording's marks,
/// sampling every `period` (`None`: no samples) of a trace whose header is
/// `header`; `None` where it samples by host time (`replay_time_samples`,
/// or a recording without marks) or not at all.
pub fn sample_marks_period(
    header: &Header,
    period: Option<Duration>,
    replay_time_samples: bool,
) -> Option<u64> {
    if header.sample_period_ns == 0 || replay_time_samples {
        return None;
    }
    period.map(|p| u64::try_from(p.as_nanos()).unwrap_or(u64::MAX).max(1))
}

/// What a replay needs besides its trace.
pub struct ReplayOptions {
    /// The trace directory.
    pub trace: PathBuf,
    pub console: Console,
    /// Where the command's relayed standard output and error go.
    pub streams: crate::vm::HostStreams,
    /// Run on any host CPU, not only one reporting the APIC ID the
    /// recording ran on.
    pub any_cpu: bool,
    /// Whether user-mode RDTSC faults on this host.
    pub user_rdtsc_traps: bool,
    /// Find asynchronous points by their registers alone (a
    /// demonstration that the other checks matter).
    pub registers_only: bool,
    pub events: Option<EventOptions>,
    /// Single-step one process (needs `events`).
    pub tracing: Option<ExpansionSpec>,
    /// Attach a debugger to the process selected (no `events`, no
    /// `tracing`): drive the session with `DebugDriver`.
    pub debug: Option<ProcessSelector>,
    /// Probes given at replay (needs `events`; not with `debug` or
    /// `tracing`).
    pub probes: Option<ProbePlan>,
    /// Start from the trace's checkpoint at or before this point.
    pub from: Option<ReplayPoint>,
    /// Stop at the first exit at or after this point.
    pub to: Option<ReplayPoint>,
    /// Take checkpoints this often.
    pub checkpoint_every: Option<CheckpointEvery>,
    /// Where the Ethernet frames the guest sends go (at replay, nowhere
    /// else).
    pub sent_frames: Option<FrameSink>,
    /// Called with the replay's counts about twice a second.
    pub progress: Option<ProgressFn>,
}

/// How a replay session begins.
pub struct ReplayStart {
    /// The checkpoint restored (`ReplayOptions::from`).
    pub restored: Option<CheckpointRestored>,
    pub notes: Notes,
}

/// A replay of the trace `reader` read: the machine rebuilt from its
/// header (kernel and initramfs checked by digest), this host checked
/// against the recording's, the vCPU on a host CPU with the recording's
/// APIC ID, the tools attached, and the start restored (a checkpoint or
/// the boot snapshot).
pub fn replay(
    reader: TraceReader<Entry>,
    options: ReplayOptions,
) -> Result<(ReplaySession, ReplayStart), BuildError> {
    let trace = options.trace;
    if reader.header.clock != ClockKind::Exit {
        return Err(BuildError::BranchClock { trace });
    }
    let mut notes = Notes::new();
    let spec = guest::from_trace(&reader.header, &trace)?;
    let mut machine = Machine::new(&spec, options.console)?;
    machine.set_streams(options.streams);
    if let (Some(apic_id), false) = (reader.header.host_apic_id, options.any_cpu) {
        match crate::host_cpu::with_apic_id(apic_id).map_err(BuildError::HostCpu)? {
            Some(cpu) => machine.run_on_host_cpu(cpu.cpu),
            None => notes.push(format!(
                "no CPU this replay may run on reports APIC ID {apic_id}, the one the recording \
                 ran on; a program that keeps what CPUID told it (glibc does) may not be found \
                 again where it was preempted"
            )),
        }
    }
    let vm = machine.vm();
    match journal::check_host(
        &reader.header,
        vm.guest_cpuid(),
        vm.kvm_caps(),
        options.user_rdtsc_traps,
    ) {
        Ok(()) => {}
        Err(HostMismatch::Cpu(difference)) => {
            return Err(BuildError::OtherCpu { trace, difference })
        }
        Err(HostMismatch::Kvm(difference)) => {
            return Err(BuildError::OtherKvm { trace, difference })
        }
    }
    if let Some(sink) = options.sent_frames {
        if !machine.vm().has_net() {
            return Err(BuildError::NoNetwork { trace });
        }
        machine.capture_net_tx(sink);
    }
    let kernel_stack_top =
        kernel_variable(&spec.kernel_image, KERNEL_STACK_TOP).filter(|&a| a >= KERNEL_START);
    let mut tools = ReplayTools::new(kernel_stack_top);
    let mut heap_events = false;
    let mut event_exits = false;
    // Marks found in user code also time the events raised after them
    // (Replayer::event_ns): every replay that collects events finds them,
    // sampling or not, unless it samples by its own host time.
    let mut take_marks = false;
    if let Some(events) = options.events {
        let stacks = events
            .cfi_files
            .map(|files| unwind::Processes::new(Box::new(files)));
        let mut capture = Capture::new(events.db);
        if let Some((kind, lwpid)) = events.end_after {
            capture.end_after(kind, lwpid);
        }
        let recorded_ns = reader.header.sample_period_ns;
        let at_marks = sample_marks_period(
            &reader.header,
            events.sample_period,
            events.replay_time_samples,
        )
        .is_some();
        let sampling = events.sample_period.map(|period| {
            let sampling = Sampling::every(period, kernel_stack_top);
            match at_marks {
                true => sampling.at_marks(recorded_ns),
                false => sampling,
            }
        });
        let sampling = match (sampling, events.decision_samples) {
            (Some(s), true) => Some(s.with_decisions()),
            (None, true) => Some(Sampling::at_decisions_only(kernel_stack_top)),
            (s, false) => s,
        };
        let sample_marks = sampling.as_ref().and_then(Sampling::marks_period);
        tools.capture(EventTool::new(capture, stacks), sample_marks);
        if let Some(sampling) = sampling {
            tools.attach(sampling);
        }
        if at_marks && events.sample_period < Some(Duration::from_nanos(recorded_ns)) {
            notes.push(format!(
                "sampling at each of the recording's sample marks, about every {:.1} ms: a \
                 replay samples no more often than its recording marked (record \
                 --sample-period)",
                recorded_ns as f64 / 1e6
            ));
        }
        heap_events = events.heap;
        event_exits = events.exits || events.end_after.is_some();
        take_marks = reader.header.sample_period_ns > 0 && !events.replay_time_samples;
    }
    // A chaos recording's guest kernel single-stepped its threads.
    let chaos_recording = reader.header.chaos.is_some();
    let traced = options.tracing.is_some();
    if let Some(spec) = options.tracing {
        tools.attach(ProcessTracer::new(spec));
    }
    if let Some(plan) = &options.probes {
        let Some(events) = tools.events_mut() else {
            return Err(BuildError::ProbesWithoutEvents);
        };
        if options.debug.is_some() || traced {
            return Err(BuildError::ProbesAndTools);
        }
        (events.capture.probes(&probes::probe_rows(plan))).map_err(VmError::from)?;
        let kernel = kernel_points(&spec.kernel_image, kernel_stack_top, chaos_recording);
        tools.attach(ProbeTool::new(plan, kernel));
    }
    if let Some(selector) = options.debug {
        if tools.events_mut().is_some() || traced {
            return Err(BuildError::DebugAndTools);
        }
        let kernel = kernel_points(&spec.kernel_image, kernel_stack_top, chaos_recording);
        tools.attach(DebugTool::new(selector, kernel));
    }
    let points = if options.registers_only {
        PointSearch::registers_only()
    } else {
        PointSearch::default()
    };
    let mut log = Replayer::new(reader);
    if take_marks {
        log.take_sample_marks();
    }
    // A chaos recording's threads were single-stepped by the guest kernel:
    // through the silent gate they took one single-step trap, as through
    // the exit form; the ring form's copy would take more (docs/chaos.md).
    event_exits |= chaos_recording;
    let mut session = ReplaySession::new(machine, log, points, tools, heap_events);
    if event_exits {
        session.events_by_exit();
    }
    let restored = match options.from {
        Some(from) => {
            let Some(start) = checkpoint_before(&trace, from)? else {
                return Err(BuildError::NoCheckpoint {
                    at: from.to_string(),
                    trace,
                });
            };
            Some(session.restore_checkpoint(&trace, start.exit)?)
        }
        None => {
            session.restore_trace_snapshot(&spec.start)?;
            None
        }
    };
    if let Some(to) = options.to {
        session.stop_at(to);
    }
    if let Some(every) = options.checkpoint_every {
        session.take_checkpoints(&trace, every)?;
    }
    if let Some(progress) = options.progress {
        session.on_progress(progress);
    }
    session.ready()?;
    Ok((session, ReplayStart { restored, notes }))
}

/// The guest kernel's code and data the debugger's engine uses, and
/// whether it single-steps user threads (`guest_steps`: a chaos
/// recording).
fn kernel_points(image: &[u8], stack_top_var: Option<u64>, guest_steps: bool) -> KernelPoints {
    KernelPoints {
        stack_top_var,
        iret: kernel_instruction(image, KERNEL_USER_IRET, &SWAPGS, 128),
        sysret: kernel_code(image, KERNEL_SYSRET),
        guest_steps,
    }
}
