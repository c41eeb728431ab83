//! Sessions: a machine driven by one kind of run. A plain run
//! ([`LiveRun`]) delivers interrupts when they are due; a recording
//! ([`RecordSession`]) delivers them only at deterministic points and logs
//! where; a replay ([`ReplaySession`]) delivers them where the log says
//! and checks every exit, with the replay-time tools (`crate::tools`)
//! attached. All three share one vCPU loop (`run.rs`); what differs is
//! their [`Mode`], whose hooks the loop calls at fixed places.
//!
//! Threads: the vCPU runs on its own thread and owns every device; the
//! calling thread only kicks it (a signal) when something is due while the
//! guest runs without exiting.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::control::EventRaiser;
use devices::virtio_blk::BlockStats;
use devices::virtio_net::NetStats;
use devices::PlatformStats;
use events::capture::CaptureSummary;
use introspect::event_ring::EventRing;
use introspect::probe_gate;
use journal::{EndReason, Entry, Progress, Replayer};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::boot_snapshot::SnapshotTaken;
use crate::points::PointCounts;
use crate::tools::{CheckpointTaken, ExpansionStats};
use crate::vm::{ExitCounts, Machine, Vm, VmClock, VmError};

mod debug;
mod inputs;
mod live;
mod record;
mod replay;
mod run;

pub use debug::{DebugDriver, DebugEvent, Interrupter};
pub use live::LiveRun;
pub use record::RecordSession;
pub use replay::ReplaySession;

/// Why the guest stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `/init` reported the guest command's exit status (after syncing):
    /// the run is over, nothing the guest does later can matter.
    CommandExited,
    /// The guest kernel powered off.
    PowerOff,
    /// Replay reached the point where the recording ended for a reason
    /// outside the guest (the user stopped it, the recorder failed).
    RecordingEnded(EndReason),
    /// Replay of an incomplete trace reached the end of its log.
    TraceEnded,
    /// Replay reached the end of the window it was asked for.
    WindowEnded,
    /// `/init` was ready and the boot snapshot asked for is written.
    SnapshotTaken,
    /// A debugger's stop: the replay goes on when resumed.
    Debug,
}

/// The result of a guest run that ended by the guest's own choice.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub stop: StopReason,
    /// Status of the guest command, if `/init` reported one.
    pub exit_status: Option<u8>,
    /// VM time at which user space `/init` started.
    pub init_reached: Option<Duration>,
    /// VM time at the end.
    pub elapsed: Duration,
    pub exits: ExitCounts,
    pub platform: PlatformStats,
    /// Deterministic exits, log entries, guest time, trace size.
    pub journal: Progress,
    /// The virtio disk's counts, if the guest has one.
    pub disk: Option<BlockStats>,
    /// The network device's counts, if the guest has one.
    pub net: Option<NetReport>,
    /// The finished trace, when recording.
    pub trace: Option<trace::Summary>,
    /// What the event capture stored, when replaying with one.
    pub events: Option<CaptureSummary>,
    /// Asynchronous points taken or reached, sample marks logged or
    /// sampled at (recording, replay).
    pub points: PointCounts,
    /// Checkpoints taken (replay).
    pub checkpoints: Vec<CheckpointTaken>,
    /// The boot snapshot taken (a plain run asked for one).
    pub boot_snapshot: Option<SnapshotTaken>,
    /// What the tracing of a process did (replay).
    pub expansion: Option<ExpansionStats>,
}

/// How the network device fared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetReport {
    pub stats: NetStats,
    /// Why the TAP device stopped working, if it did.
    pub failure: Option<String>,
}

/// Receives progress counts while a recording or replay runs.
pub type ProgressFn = Box<dyn FnMut(&Progress) + Send>;

/// How often the progress callback runs.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);

/// Under the exit clock the kick thread wakes the vCPU at least this
/// often for housekeeping (progress, flushing the trace, the user's stop
/// key).
pub(crate) const HOUSEKEEPING_NS: u64 = 100_000_000;

/// Reports progress about twice a second.
pub(crate) struct ProgressReport {
    report: Option<ProgressFn>,
    last: Instant,
}

impl ProgressReport {
    pub(crate) fn new() -> Self {
        ProgressReport {
            report: None,
            last: Instant::now(),
        }
    }

    pub(crate) fn set(&mut self, report: ProgressFn) {
        self.report = Some(report);
    }

    /// Calls the callback with `progress` if it is time to.
    pub(crate) fn tick(&mut self, progress: impl FnOnce() -> Progress) {
        if let Some(report) = &mut self.report {
            if self.last.elapsed() >= PROGRESS_INTERVAL {
                report(&progress());
                self.last = Instant::now();
            }
        }
    }
}

/// How the KVM_RUN that a kick or window interrupted started.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Resumed {
    /// The RIP of the VM exit right before it, if it followed one.
    pub rip: Option<u64>,
    /// The general registers at that exit (`state::gprs` order), where
    /// known (not right after a checkpoint's restore): a task found at
    /// that RIP with other registers ran on and came back to it, as in a
    /// loop.
    pub gprs: Option<[u64; 16]>,
    /// The vCPU started in the guest kernel: it had stopped there, or an
    /// interrupt or exception had just been injected.
    pub in_kernel: bool,
}

/// What a store to the exit page was, for the mode that may own it.
pub(crate) enum Claimed {
    /// Not the mode's: an ordinary (deterministic) MMIO exit.
    NotOurs,
    /// The mode's, and the guest goes on.
    Passed,
    /// The mode's, and the vCPU now stands at a delivery point (an
    /// asynchronous point).
    Reached,
}

/// What differs between a plain run, a recording and a replay: the hooks
/// the vCPU loop (`run.rs`) calls, in the order it calls them.
pub(crate) trait Mode {
    /// Before the first KVM_RUN.
    fn start(&mut self, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// Flushes what the mode writes, and reports progress, now and then.
    fn housekeeping(&mut self) -> Result<(), VmError> {
        Ok(())
    }

    /// Before each KVM_RUN, after housekeeping: inputs made visible,
    /// interrupts injected, or the reason the run ends here.
    fn before_run(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError>;

    /// When the vCPU must be out of KVM_RUN (VM time; u64::MAX: never).
    fn kick_deadline(&self, m: &Machine, now: u64) -> u64;

    /// Whether the mode single-steps or breaks: debug exits are then its.
    fn debug_armed(&self) -> bool {
        false
    }

    /// A debug exit (only when `debug_armed`).
    fn debug_exit(&mut self, m: &mut Machine) -> Result<(), VmError> {
        Err(VmError::GuestFault {
            reason: "debug exit nobody asked for".into(),
            rip: m.vcpu.rip_or_zero(),
            detail: String::new(),
        })
    }

    /// Whether a store to `addr` may be the mode's own (a trampoline's, the
    /// probe gate's), to be looked at before it is dispatched.
    fn claims(&self, _addr: u64) -> bool {
        false
    }

    /// A store `claims` accepted: what it was.
    fn store(&mut self, _m: &mut Machine, _addr: u64, _data: &[u8]) -> Result<Claimed, VmError> {
        Ok(Claimed::NotOurs)
    }

    /// KVM could not emulate the instruction the vCPU stands at: whether
    /// the mode took care of it (else the VMM completes it if it can).
    fn unemulated(&mut self, _m: &mut Machine) -> Result<bool, VmError> {
        Ok(false)
    }

    /// The log that answers the guest's reads (replay).
    fn log(&mut self) -> Option<&mut Replayer> {
        None
    }

    /// A deterministic exit (RIP filled in), with the registers at it.
    fn exit(
        &mut self,
        m: &mut Machine,
        entry: Entry,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), VmError>;

    /// A KVM_RUN ended without a deterministic exit (a kick, a window);
    /// `resumed` says how it started. Returns whether the vCPU now stands
    /// at a delivery point.
    fn kicked(&mut self, _m: &mut Machine, _resumed: Resumed) -> Result<bool, VmError> {
        Ok(false)
    }

    /// The guest raised an event at the last exit.
    fn event_raised(&mut self, _m: &mut Machine, _raiser: EventRaiser) -> Result<(), VmError> {
        Ok(())
    }

    /// The VMM wrote guest memory on the guest kernel's behalf (a copy it
    /// asked for), as the guest's own write: at these guest physical
    /// addresses, each in a page of its own piece.
    fn wrote_for_guest(&mut self, _m: &mut Machine, _written: &[u64]) -> Result<(), VmError> {
        Ok(())
    }

    /// The guest kernel announced its context-switch ring.
    fn switch_ring_announced(&mut self, _m: &mut Machine) {}

    /// How the probe gates are to behave in this run (the gate, the heap
    /// gate): silent unless replaying.
    fn gate_modes(&self) -> (probe_gate::GateMode, probe_gate::GateMode) {
        (probe_gate::GateMode::Silent, probe_gate::GateMode::Silent)
    }

    /// The gates are in place; `ring` is the event ring when one appends
    /// to it.
    fn gate_installed(&mut self, _ring: Option<EventRing>) {}

    /// The vCPU came out of KVM_RUN, for whatever reason, before anything
    /// handles why: what the guest left in memory meanwhile (the event
    /// ring) is read now.
    fn left_guest(&mut self, _vm: &Vm) -> Result<(), VmError> {
        Ok(())
    }

    /// `/init` is ready for the run's archive: the reason to stop here, if
    /// there is one.
    fn ready(&mut self, _m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        Ok(None)
    }

    /// The guest ended its run this way (checked at replay).
    fn ended(&mut self, _reason: &EndReason) -> Result<(), VmError> {
        Ok(())
    }

    /// After a deterministic exit and the messages it carried.
    fn exit_handled(&mut self, _m: &mut Machine) -> Result<(), VmError> {
        Ok(())
    }

    /// The guest executed HLT with interrupts enabled: wait for the next
    /// interrupt, or skip the idle time (replay).
    fn halted(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError>;

    /// The progress counts.
    fn progress(&self) -> Progress {
        Progress::default()
    }

    /// Fills in what the outcome says of the mode.
    fn outcome(&self, _m: &Machine, _outcome: &mut RunOutcome) {}

    /// The run ended with `result`: closes what the mode wrote.
    fn finish(
        self,
        _m: &mut Machine,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError>
    where
        Self: Sized,
    {
        result
    }
}

/// Writes the probe gates as `mode` wants them into the announced area's
/// code page, and tells the mode which event ring they append to.
pub(super) fn install_gates<M: Mode>(m: &mut Machine, mode: &mut M) {
    let (gate, heap) = mode.gate_modes();
    let ring = m.install_probe_gate(gate, heap);
    mode.gate_installed(ring);
}

/// State the vCPU thread shares with the thread that kicks it.
pub(crate) struct KickState {
    /// VM time at which the vCPU must be out of KVM_RUN (u64::MAX: none).
    deadline_ns: AtomicU64,
    /// Kick at once, whatever the deadline.
    now: AtomicBool,
    done: AtomicBool,
}

impl KickState {
    fn new() -> Arc<Self> {
        Arc::new(KickState {
            deadline_ns: AtomicU64::new(u64::MAX),
            now: AtomicBool::new(false),
            done: AtomicBool::new(false),
        })
    }

    pub(crate) fn set_deadline(&self, ns: u64) {
        self.deadline_ns.store(ns, Ordering::Release);
    }

    /// Has the vCPU kicked out of KVM_RUN as soon as possible.
    pub(crate) fn kick_now(&self) {
        self.now.store(true, Ordering::Release);
    }
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Nothing to do: the signal's only job is to make KVM_RUN return.
}

fn register_kick_handler() -> Result<(), VmError> {
    register_signal_handler(SIGRTMIN(), on_kick).map_err(|e| VmError::Kvm {
        op: "signal handler registration",
        source: e,
    })
}

/// Kicks the vCPU with `kick` whenever its deadline passes (or a kick is
/// asked for), until `state` says done.
fn kick_loop(state: &KickState, clock: VmClock, kick: impl Fn()) {
    while !state.done.load(Ordering::Acquire) {
        let now = clock.now_ns();
        let deadline = state.deadline_ns.load(Ordering::Acquire);
        if deadline <= now || state.now.swap(false, Ordering::AcqRel) {
            // A kick that lands while the vCPU is outside KVM_RUN is
            // harmless; the next one follows within a millisecond.
            kick();
            std::thread::sleep(Duration::from_millis(1));
        } else {
            let wait = (deadline - now).min(5_000_000);
            std::thread::sleep(Duration::from_nanos(wait));
        }
    }
}

/// Runs `machine` in `mode` until the guest stops or fails. The vCPU runs
/// on a thread of its own; this thread kicks it when something comes due.
pub(crate) fn run_on_vcpu_thread<M: Mode + Send + 'static>(
    machine: Machine,
    mode: M,
) -> Result<RunOutcome, VmError> {
    register_kick_handler()?;
    let kick = KickState::new();
    let clock = machine.vm.clock;
    let shared = Arc::clone(&kick);
    let handle = std::thread::Builder::new()
        .name("vcpu0".into())
        .spawn(move || {
            let (mut machine, mut mode) = (machine, mode);
            let result = run::run(&mut machine, &mut mode, &|deadline| {
                shared.set_deadline(deadline)
            });
            let result = mode.finish(&mut machine, result);
            shared.done.store(true, Ordering::Release);
            result
        })
        .map_err(VmError::Thread)?;
    kick_loop(&kick, clock, || {
        let _ = handle.kill(SIGRTMIN());
    });
    handle.join().unwrap_or(Err(VmError::VcpuThreadPanicked))
}

/// A thread that kicks the calling thread out of KVM_RUN when something
/// comes due, for a session that runs on the calling thread in steps (a
/// debugger's): stopped and joined when dropped.
pub(crate) struct Kicker {
    state: Arc<KickState>,
    /// The kick thread's clock: the machine's when it started. The
    /// machine's may move since (restored, or standing still while the
    /// replay is stopped); deadlines are translated.
    clock: crate::vm::VmClock,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Kicker {
    /// Starts kicking the calling thread, by `clock`'s deadlines.
    pub(crate) fn for_this_thread(clock: crate::vm::VmClock) -> Result<Self, VmError> {
        register_kick_handler()?;
        let state = KickState::new();
        let target = crate::sys::ThreadHandle::current();
        let shared = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("kick".into())
            .spawn(move || {
                kick_loop(&shared, clock, || {
                    let _ = target.signal(SIGRTMIN());
                })
            })
            .map_err(VmError::Thread)?;
        Ok(Kicker {
            state,
            clock,
            thread: Some(thread),
        })
    }

    pub(crate) fn state(&self) -> &Arc<KickState> {
        &self.state
    }

    /// Kicks when `machine` (the machine's clock now) reads `deadline_ns`
    /// (u64::MAX: never).
    pub(crate) fn set_deadline(&self, machine: &crate::vm::VmClock, deadline_ns: u64) {
        let at = if deadline_ns == u64::MAX {
            u64::MAX
        } else {
            let left = deadline_ns.saturating_sub(machine.now_ns());
            self.clock.now_ns().saturating_add(left)
        };
        self.state.set_deadline(at);
    }
}

impl Drop for Kicker {
    fn drop(&mut self) {
        self.state.done.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
