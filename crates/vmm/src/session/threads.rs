//! The vCPU's thread and the thread that kicks it: the vCPU runs on a
//! thread of its own and owns every device; the other thread only kicks
//! it (a signal out of KVM_RUN) when something comes due while the guest
//! runs without exiting.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use super::mode::Mode;
use super::outcome::RunOutcome;
use super::run;
use crate::vm::{Machine, VmClock, VmError};

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
            let result = run::run(&mut machine, &mut mode, &|deadline, _clock| {
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
