//! A replay session driven by a debugger: run on the calling thread until
//! the debugger's next stop, looked into while stopped, and put back to
//! snapshots it took on the way.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::outcome::StopReason;
use super::replay::ReplaySession;
use super::run;
use super::threads::{KickState, Kicker};
use crate::tools::checkpoints;
use crate::tools::debug::{DebugTool, Resume, Snapshot, Stop, ThreadRegs};
use crate::vm::{Machine, VmError};

/// MXCSR's 32-bit word in the XSAVE area (the legacy region's byte 24).
const MXCSR_WORD: usize = 6;

/// How a resumed replay ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DebugEvent {
    /// The debugger's stop: the replay can go on.
    Stopped(Stop),
    /// The replay reached the recording's end (the guest command exited,
    /// the guest powered off, the log ended): it cannot go further.
    Ended {
        stop: StopReason,
        exit_status: Option<u8>,
    },
}

/// Interrupts a running replay from another thread: it stops at its next
/// deterministic exit or asynchronous point.
#[derive(Clone)]
pub struct Interrupter {
    flag: Arc<AtomicBool>,
    kick: Arc<KickState>,
}

impl Interrupter {
    pub fn interrupt(&self) {
        self.flag.store(true, Ordering::Release);
        self.kick.kick_now();
    }
}

/// A replay session with a debugger's tool, run on the thread that made
/// it: the thread must stay the same for the driver's life.
pub struct DebugDriver {
    session: ReplaySession,
    kicker: Kicker,
    /// The snapshots taken on the way, oldest first.
    snapshots: Vec<Snapshot>,
    /// Where the replay ended, once it did: it goes no further.
    ended: Option<DebugEvent>,
    /// Since when the replay stands still (stopped for the debugger, or
    /// restored): VM time does not pass meanwhile.
    stopped_at: Option<Instant>,
    /// The last deadline the run set, in VM time (u64::MAX: none).
    deadline_ns: std::cell::Cell<u64>,
}

impl DebugDriver {
    /// Takes `session`, which must have a debug tool, to run it on this
    /// thread, pausing for a snapshot about every `snapshot_every` of
    /// replay.
    pub fn new(
        mut session: ReplaySession,
        snapshot_every: Option<Duration>,
    ) -> Result<Self, VmError> {
        let tool = (session.mode.tools.find_mut::<DebugTool>())
            .ok_or_else(|| VmError::Debug("the replay session has no debugger attached".into()))?;
        tool.snapshot_every(snapshot_every);
        let kicker = Kicker::for_this_thread(session.machine.vm.clock)?;
        Ok(DebugDriver {
            session,
            kicker,
            snapshots: Vec::new(),
            ended: None,
            stopped_at: Some(Instant::now()),
            deadline_ns: std::cell::Cell::new(u64::MAX),
        })
    }

    fn tool(&self) -> &DebugTool {
        (self.session.mode.tools.find::<DebugTool>())
            .expect("a DebugDriver's session has a debug tool")
    }

    fn parts(&mut self) -> (&mut Machine, &mut DebugTool) {
        let s = &mut self.session;
        let tool = (s.mode.tools.find_mut::<DebugTool>())
            .expect("a DebugDriver's session has a debug tool");
        (&mut s.machine, tool)
    }

    /// What stops a run from another thread.
    pub fn interrupter(&self) -> Interrupter {
        Interrupter {
            flag: self.tool().interrupt_flag(),
            kick: Arc::clone(self.kicker.state()),
        }
    }

    /// The debugger's tool: the process, its threads, breakpoints.
    pub fn debug(&self) -> &DebugTool {
        self.tool()
    }

    pub fn debug_mut(&mut self) -> &mut DebugTool {
        self.parts().1
    }

    /// Resumes the replay `how` until the debugger's next stop or the
    /// replay's end; snapshots are taken on the way as set.
    pub fn resume(&mut self, how: Resume) -> Result<DebugEvent, VmError> {
        if let Some(ended) = &self.ended {
            return Ok(ended.clone());
        }
        {
            let (m, tool) = self.parts();
            tool.resume(m, how)?;
        }
        // VM time stood still while the replay was stopped: a deadline
        // (an asynchronous point's search) counts only time run.
        if let Some(stopped) = self.stopped_at.take() {
            self.session.machine.vm.clock.skip(stopped.elapsed());
        }
        let result = self.run_to_stop();
        self.stopped_at = Some(Instant::now());
        result
    }

    fn run_to_stop(&mut self) -> Result<DebugEvent, VmError> {
        loop {
            let s = &mut self.session;
            let clock = s.machine.vm.clock;
            let kicker = &self.kicker;
            kicker.set_deadline(&clock, self.deadline_ns.get());
            let deadline = &self.deadline_ns;
            let outcome = run::run(&mut s.machine, &mut s.mode, &|d, _| {
                deadline.set(d);
                kicker.set_deadline(&clock, d);
            })?;
            if outcome.stop != StopReason::Debug {
                let event = DebugEvent::Ended {
                    stop: outcome.stop,
                    exit_status: outcome.exit_status,
                };
                self.ended = Some(event.clone());
                return Ok(event);
            }
            let (_, tool) = self.parts();
            if let Some(stop) = tool.take_stop() {
                return Ok(DebugEvent::Stopped(stop));
            }
            if tool.snapshots.due {
                // Taking it is no time of the guest's either.
                let started = Instant::now();
                self.take_snapshot()?;
                self.session.machine.vm.clock.skip(started.elapsed());
            }
        }
    }

    /// Whether the replay stands where a snapshot can be taken: right
    /// after a deterministic exit, nothing half done.
    fn at_rest(&self) -> bool {
        let s = &self.session;
        self.tool().at_exit
            && !s.mode.points.patched()
            && checkpoints::at_rest(&s.machine)
            && self.ended.is_none()
    }

    /// Takes a snapshot here if the replay is at rest.
    fn take_snapshot(&mut self) -> Result<(), VmError> {
        if !self.at_rest() {
            return Ok(());
        }
        let ordinal = self.tool().ordinal();
        if self
            .snapshots
            .last()
            .is_some_and(|s| s.ordinal() >= ordinal)
        {
            self.parts().1.snapshot_taken();
            return Ok(());
        }
        let s = &mut self.session;
        let tool = (s.mode.tools.find_mut::<DebugTool>()).expect("debug tool");
        tool.lift_breakpoints(&s.machine.vm.mem);
        let taken = tool.take_snapshot(
            &mut s.machine,
            s.mode.log.position(),
            s.mode.points.stats,
            self.snapshots.last(),
        );
        tool.sync_breakpoints(&s.machine);
        tool.snapshot_taken();
        self.snapshots.push(taken?);
        Ok(())
    }

    /// The snapshots taken so far, oldest first.
    pub fn snapshots(&self) -> &[Snapshot] {
        &self.snapshots
    }

    /// Puts the replay back to snapshot `index` (of `snapshots`).
    pub fn restore(&mut self, index: usize) -> Result<(), VmError> {
        let Some(snapshot) = self.snapshots.get(index) else {
            return Err(VmError::Debug(format!("there is no snapshot {index}")));
        };
        let s = &mut self.session;
        let tool = (s.mode.tools.find_mut::<DebugTool>()).expect("debug tool");
        tool.lift_breakpoints(&s.machine.vm.mem);
        s.mode.points.forget();
        snapshot.restore(&mut s.machine)?;
        s.mode.log.seek(&snapshot.log)?;
        s.mode.points.resume(snapshot.vm.point_stats);
        tool.restored(&mut s.machine, snapshot)?;
        self.ended = None;
        // The clock reads the snapshot's time, from now on; nothing the
        // run after it had set is due.
        self.stopped_at = Some(Instant::now());
        self.deadline_ns.set(u64::MAX);
        Ok(())
    }

    /// Reads the process's memory as the program sees it; how many bytes
    /// could be read.
    pub fn read_user(&self, va: u64, buf: &mut [u8]) -> usize {
        let s = &self.session;
        self.tool()
            .read_user(&s.machine, s.mode.points.replaced(), va, buf)
    }

    /// Thread `lwpid`'s user registers.
    pub fn thread_regs(&self, lwpid: u32) -> Option<ThreadRegs> {
        let s = &self.session;
        self.tool().thread_regs(&s.machine, &s.mode.points, lwpid)
    }

    /// The vCPU's x87 and SSE state (the thread running user code's).
    /// MXCSR comes from the XSAVE area's legacy region (bytes 24..28):
    /// KVM_GET_FPU leaves it 0 on hosts that run the guest under kvm_pvm.
    pub fn fpu(&self) -> Option<kvm_bindings::kvm_fpu> {
        let vcpu = &self.session.machine.vcpu.fd;
        let mut fpu = vcpu.get_fpu().ok()?;
        if let Ok(xsave) = vcpu.get_xsave() {
            fpu.mxcsr = xsave.region[MXCSR_WORD];
        }
        Some(fpu)
    }

    /// Ends the session: guest memory without breakpoints.
    pub fn finish(mut self) {
        let (m, tool) = self.parts();
        tool.lift_breakpoints(&m.vm.mem);
    }
}
