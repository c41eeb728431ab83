//! The vCPU loop: run, dispatch the exit, act on what the guest asked
//! for, and the thread that kicks the vCPU out of KVM_RUN when a timer
//! comes due.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::virtio_blk::BlockStats;
use devices::virtio_net::NetStats;
use devices::{ControlMessage, PlatformStats};
use events::capture::{Capture, CaptureSummary};
use kvm_ioctls::VcpuExit;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use super::dispatch::{dispatch, Bus, Next};
use super::preempt::Candidate;
use super::replay_events::Resumed;
use super::{kvm_err, PreemptStats, Vm, VmError, BOOT_VCPU};
use introspect::guest_events::KERNEL_START;
use introspect::probe_gate;
use introspect::stub_area::EXIT_PAGE_GPA;
use journal::{self, EndReason, Entry, Journal, JournalError, Progress};

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
    /// Replay reached the end of the window it was asked for (`stop_at`).
    WindowEnded,
    /// `/init` was ready and the boot snapshot asked for is written
    /// (`snapshot_when_ready`).
    SnapshotTaken,
}

/// Counts of VM exits by kind, and other run statistics.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ExitCounts {
    pub port_io: u64,
    pub mmio: u64,
    pub halts: u64,
    pub msr: u64,
    pub interrupts_injected: u64,
    pub kicks: u64,
    pub emulation_completions: u64,
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
    /// Asynchronous points taken or reached (recording, replay).
    pub preempt: PreemptStats,
    /// Checkpoints taken (replay with `take_checkpoints`).
    pub checkpoints: Vec<super::CheckpointTaken>,
    /// The boot snapshot taken (`snapshot_when_ready`).
    pub boot_snapshot: Option<super::snapshot::SnapshotTaken>,
    /// What the expansion traced (replay with `expand_user`).
    pub expansion: Option<super::ExpansionStats>,
}

/// How the network device fared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetReport {
    pub stats: NetStats,
    /// Why the TAP device stopped working, if it did.
    pub failure: Option<String>,
}

/// State the vCPU thread shares with the thread that kicks it.
struct KickState {
    /// VM time at which the vCPU must be out of KVM_RUN (u64::MAX: none).
    deadline_ns: AtomicU64,
    done: AtomicBool,
}

/// Receives progress counts while a recording or replay runs.
pub type ProgressFn = Box<dyn FnMut(&Progress) + Send>;

/// How often the progress callback runs.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);

/// Under the exit clock the kick thread only wakes the vCPU for
/// housekeeping (progress, flushing the trace, the user's stop key).
pub(super) const HOUSEKEEPING_NS: u64 = 100_000_000;

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Nothing to do: the signal's only job is to make KVM_RUN return.
}

impl Vm {
    /// Dispatches an exit the vCPU is no longer borrowed for.
    fn dispatch(&mut self, exit: VcpuExit<'_>) -> Result<(Next, Option<Entry>), VmError> {
        let attached = self.devices_attached;
        dispatch(
            &mut Bus {
                platform: &mut self.platform,
                block: self.block.as_mut().filter(|_| attached),
                net: self.net.as_mut().filter(|_| attached),
                mem: &self.mem,
            },
            &mut self.journal,
            &self.clock,
            &mut self.exits,
            BOOT_VCPU,
            exit,
        )
    }

    /// Runs the guest until it powers off or fails. The vCPU runs on a
    /// thread of its own; this thread kicks it when timers come due.
    pub fn run(self) -> Result<RunOutcome, VmError> {
        register_signal_handler(SIGRTMIN(), on_kick).map_err(|e| VmError::Kvm {
            op: "signal handler registration",
            source: e,
        })?;
        let kick = Arc::new(KickState {
            deadline_ns: AtomicU64::new(u64::MAX),
            done: AtomicBool::new(false),
        });
        let clock = self.clock;
        let shared = Arc::clone(&kick);
        let handle = std::thread::Builder::new()
            .name("vcpu0".into())
            .spawn(move || {
                let mut vm = self;
                let result = vm.run_vcpu(&shared);
                let result = vm.describe_divergence(result);
                vm.end_patches();
                let result = match (result, vm.end_expansion()) {
                    (Ok(_), Err(e)) => Err(e),
                    (result, _) => result,
                };
                let result = vm.end_journal(result);
                let result = vm.end_events(result);
                shared.done.store(true, Ordering::Release);
                result
            })
            .map_err(VmError::Thread)?;

        while !kick.done.load(Ordering::Acquire) {
            let now = clock.now_ns();
            let deadline = kick.deadline_ns.load(Ordering::Acquire);
            if deadline <= now {
                // A kick that lands while the vCPU is outside KVM_RUN is
                // harmless; the next one follows within a millisecond.
                let _ = handle.kill(SIGRTMIN());
                std::thread::sleep(Duration::from_millis(1));
            } else {
                let wait = (deadline - now).min(5_000_000);
                std::thread::sleep(Duration::from_nanos(wait));
            }
        }
        handle.join().unwrap_or(Err(VmError::VcpuThreadPanicked))
    }

    fn run_vcpu(&mut self, kick: &KickState) -> Result<RunOutcome, VmError> {
        if let Some(cpu) = self.host_cpu {
            crate::sys::pin_to_cpu(cpu).map_err(|source| VmError::Pin { cpu, source })?;
        }
        self.start_dirty_log()?;
        loop {
            self.feed_input()?;
            let now = self.clock.now_ns();
            self.platform.advance_to(now);
            self.housekeeping()?;
            if std::mem::take(&mut self.after_exit) {
                self.checkpoint_if_due()?;
                if self.window_ended() {
                    return Ok(self.outcome(StopReason::WindowEnded));
                }
            }
            if let Journal::Replay(r) = &mut self.journal {
                if let Some(reason) = r.end_reached()? {
                    return Ok(self.outcome(StopReason::RecordingEnded(reason)));
                }
                if r.log_exhausted()? {
                    return Ok(self.outcome(StopReason::TraceEnded));
                }
            }
            self.publish_inputs()?;
            let delivery_point = self.at_delivery_point;
            self.inject_interrupts()?;
            if delivery_point && self.journal.is_replay() {
                self.arm_async_point()?;
            }
            let deadline = if self.journal.exit_clock() {
                let sample = self.sampling.as_ref().map_or(u64::MAX, |s| s.next_ns);
                (now + HOUSEKEEPING_NS)
                    .min(sample)
                    .min(self.preempt_deadline())
            } else {
                self.platform.next_timer_ns().unwrap_or(u64::MAX)
            };
            kick.deadline_ns.store(deadline, Ordering::Release);

            let resumed = Resumed {
                rip: self.resume_rip.take(),
                in_kernel: self.sampling.as_mut().is_some_and(|s| {
                    std::mem::take(&mut s.injected)
                        || self.vcpu.sync_regs().regs.rip >= KERNEL_START
                }),
            };
            let expanding = self.expanding();
            let exit = self.vcpu.run();
            // A store to the exit page while a trampoline is in place is
            // it saying it found what it looks for, and one at replay to
            // the probe gate's address a probe raising an event: not
            // deterministic exits (unless the store is the guest's own).
            let store = match &exit {
                Ok(VcpuExit::MmioWrite(addr, data))
                    if (*addr == EXIT_PAGE_GPA && self.preempt.patched())
                        || (*addr == probe_gate::STORE_GPA && self.journal.is_replay()) =>
                {
                    Some((*addr, data.to_vec()))
                }
                _ => None,
            };
            if expanding && matches!(exit, Ok(VcpuExit::Debug(_))) {
                drop(exit);
                self.expansion_step()?;
                self.preempt.traced_step();
                continue;
            }
            let (next, observed) = if let Some((addr, data)) = store {
                drop(exit);
                let candidate = if addr == probe_gate::STORE_GPA {
                    self.gate_event(&data)?
                } else {
                    self.trampoline_exit(addr)?
                };
                match candidate {
                    Candidate::Reached => {
                        self.at_delivery_point = true;
                        continue;
                    }
                    Candidate::Passed => {
                        if addr == probe_gate::STORE_GPA {
                            // A probe event: its task may be one to trace.
                            self.arm_expansion()?;
                        }
                        continue;
                    }
                    Candidate::NotOurs => self.dispatch(VcpuExit::MmioWrite(addr, &data))?,
                }
            } else {
                let attached = self.devices_attached;
                match exit {
                    Ok(exit) => dispatch(
                        &mut Bus {
                            platform: &mut self.platform,
                            block: self.block.as_mut().filter(|_| attached),
                            net: self.net.as_mut().filter(|_| attached),
                            mem: &self.mem,
                        },
                        &mut self.journal,
                        &self.clock,
                        &mut self.exits,
                        BOOT_VCPU,
                        exit,
                    )?,
                    Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                        self.exits.kicks += 1;
                        (Next::Continue, None)
                    }
                    Err(e) => return Err(kvm_err("RUN")(e)),
                }
            };
            let observed_exit = observed.is_some();
            self.at_delivery_point = observed_exit;
            self.after_exit = observed_exit && self.journal.is_replay();
            if observed.is_some() {
                self.preempt_after_exit(self.clock.now_ns())?;
            } else if matches!(self.journal, Journal::Record(_)) {
                // A kick: an interrupt that waited a tick for an exit may
                // be delivered where the guest's user code stands.
                self.at_delivery_point = self.try_async_point()?;
            } else {
                self.check_search_time()?;
            }
            if observed.is_none() && self.sampling.is_some() {
                // A kick: the guest stopped wherever it was, which is
                // what a sample wants (exits would bias it).
                self.take_sample(resumed)?;
            }
            if let Some(event) = observed {
                // KVM raises #GP for a refused MSR access when the vCPU
                // resumes; an interrupt injected with it would reach the
                // guest at a point that depends on timing.
                if matches!(
                    event,
                    Entry::RdMsr { fault: true, .. } | Entry::WrMsr { fault: true, .. }
                ) {
                    self.exception_pending = true;
                }
                let regs = self.vcpu.sync_regs().regs;
                self.resume_rip = Some(regs.rip);
                self.journal.exit(event.with_rip(regs.rip), &regs)?;
                // Switches before this exit come before what it raises.
                self.drain_switches()?;
            }
            // Messages from the guest's control port.
            for message in self.platform.take_messages() {
                match message {
                    ControlMessage::InitReached => {
                        self.init_reached = Some(Duration::from_nanos(self.clock.now_ns()))
                    }
                    ControlMessage::ExitStatus(s) => {
                        self.exit_status = Some(s);
                        self.journal.replay_end(&EndReason::CommandExited(s))?;
                        return Ok(self.outcome(StopReason::CommandExited));
                    }
                    ControlMessage::PowerOff => {
                        self.journal.replay_end(&EndReason::PowerOff)?;
                        return Ok(self.outcome(StopReason::PowerOff));
                    }
                    ControlMessage::Panic => return Err(VmError::GuestPanic),
                    ControlMessage::Event(raiser) => self.guest_event(raiser)?,
                    ControlMessage::SwitchRing => self.attach_switch_ring(),
                    ControlMessage::PreemptArea => self.attach_preempt_area(),
                    ControlMessage::Ready => {
                        if self.take_boot_snapshot()? {
                            return Ok(self.outcome(StopReason::SnapshotTaken));
                        }
                        self.devices_attached = true;
                    }
                    ControlMessage::Fetch => self.fetch_archive()?,
                    ControlMessage::Sync | ControlMessage::Unknown(_) => {}
                }
            }
            if observed_exit {
                self.arm_expansion()?;
            }
            match next {
                Next::Continue => {}
                Next::WaitForInterrupt if self.journal.is_replay() => {
                    // Idle time is skipped: the interrupt that ended it is
                    // due at once.
                    if self.vcpu.get_kvm_run().if_flag == 0 {
                        let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                        return Err(VmError::GuestHalted { rip });
                    }
                    if !self.journal.replay_wakeup_due()? {
                        // An incomplete trace may end right after the HLT.
                        if let Journal::Replay(r) = &mut self.journal {
                            if r.log_exhausted()? {
                                return Ok(self.outcome(StopReason::TraceEnded));
                            }
                        }
                        let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                        return Err(self.journal.halted_without_interrupt(rip).into());
                    }
                }
                Next::WaitForInterrupt => self.wait_for_interrupt()?,
                Next::InternalError => self.complete_unemulated()?,
                Next::Fault(reason, detail) => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(VmError::GuestFault {
                        reason,
                        rip,
                        detail,
                    });
                }
            }
        }
    }

    pub(super) fn outcome(&mut self, stop: StopReason) -> RunOutcome {
        let _ = self.platform.serial.writer_mut().flush();
        RunOutcome {
            stop,
            exit_status: self.exit_status,
            init_reached: self.init_reached,
            elapsed: Duration::from_nanos(self.clock.now_ns()),
            exits: self.exits,
            platform: self.platform.stats(),
            journal: self.journal.progress(),
            trace: self.trace_summary,
            disk: self.block.as_ref().map(|b| b.stats()),
            net: self.net.as_ref().map(|n| NetReport {
                stats: n.stats(),
                failure: n.failure().map(str::to_owned),
            }),
            events: self.events.as_ref().map(Capture::summary),
            preempt: self.preempt.stats,
            checkpoints: self.checkpoints_taken().to_vec(),
            boot_snapshot: self.snapshot_taken().cloned(),
            expansion: self.expansion_stats(),
        }
    }

    /// Flushes the trace now and then and reports progress.
    pub(super) fn housekeeping(&mut self) -> Result<(), VmError> {
        self.journal.housekeeping()?;
        if let Some(progress) = &mut self.progress {
            if self.last_progress.elapsed() >= PROGRESS_INTERVAL {
                progress(&self.journal.progress());
                self.last_progress = Instant::now();
            }
        }
        Ok(())
    }

    /// Moves pending host input into the UART, as far as its FIFO has room.
    /// Input waits until `/init` runs: the console tty is open by then, and
    /// the kernel's serial driver resets the FIFO while it starts.
    pub(super) fn feed_input(&mut self) -> Result<(), VmError> {
        let Some(input) = &self.input else {
            return Ok(());
        };
        if input.quit_requested() {
            return Err(VmError::StoppedByUser);
        }
        if self.init_reached.is_none() {
            return Ok(());
        }
        let bytes = input.take(self.platform.serial.input_room());
        if !bytes.is_empty() {
            self.platform.receive_input(&bytes);
        }
        Ok(())
    }

    /// `/init` asks for a piece of the run's archive: RCX bytes in, RDI
    /// bytes of it to its buffer at virtual address RSI. The same archive
    /// is written at the same exit in every replay.
    fn fetch_archive(&mut self) -> Result<(), VmError> {
        /// A piece larger than `/init`'s buffer is not one it asks for.
        const MAX_PIECE: u64 = 1 << 20;
        let regs = self.vcpu.sync_regs().regs;
        let (gva, len, offset) = (regs.rsi, regs.rdi, regs.rcx);
        let bad = |why: String| VmError::BadFetch { why };
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= self.archive.len() as u64 && len <= MAX_PIECE)
            .ok_or_else(|| {
                bad(format!(
                    "at offset {offset}, {len} bytes, beyond its {} bytes",
                    self.archive.len()
                ))
            })?;
        let cr3 = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?.cr3;
        introspect::gva::write_virt(
            &self.mem,
            cr3,
            gva,
            &self.archive[offset as usize..end as usize],
        )
        .map_err(|e| bad(format!("into a buffer at {gva:#x} it cannot write ({e})")))
    }

    /// Adds the vCPU's registers to a divergence report, and what the
    /// search for an asynchronous point saw if one was under way.
    fn describe_divergence(
        &mut self,
        result: Result<RunOutcome, VmError>,
    ) -> Result<RunOutcome, VmError> {
        match result {
            Err(VmError::Journal(JournalError::Diverged(mut d))) => {
                if let Ok(regs) = self.vcpu.get_regs() {
                    d.state = journal::regs_text(&regs);
                }
                if let Some(search) = self.preempt.search_progress() {
                    d.state += &format!("; {search}");
                }
                Err(VmError::Journal(JournalError::Diverged(d)))
            }
            other => other,
        }
    }

    /// Ends the recording, if this run is one, the way the run ended: the
    /// trace is marked complete whatever the reason, since everything up
    /// to this point is in it.
    fn end_journal(&mut self, result: Result<RunOutcome, VmError>) -> Result<RunOutcome, VmError> {
        let Journal::Record(_) = self.journal else {
            return result;
        };
        let progress = self.journal.progress();
        let Journal::Record(recorder) = std::mem::replace(&mut self.journal, Journal::Live) else {
            return result;
        };
        let reason = match &result {
            Ok(o) => match o.stop {
                StopReason::CommandExited => EndReason::CommandExited(o.exit_status.unwrap_or(0)),
                _ => EndReason::PowerOff,
            },
            Err(VmError::StoppedByUser) => EndReason::StoppedByUser,
            Err(e) => EndReason::Failed(e.to_string()),
        };
        let dropped = self.net.as_ref().map_or(0, |net| net.stats().rx_dropped());
        let summary = recorder.finish(reason, dropped)?;
        self.trace_summary = Some(summary);
        result.map(|mut o| {
            o.trace = Some(summary);
            o.journal = progress;
            o
        })
    }
}
