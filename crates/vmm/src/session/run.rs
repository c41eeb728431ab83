//! The vCPU loop every session shares: run, dispatch the exit, act on what
//! the guest asked for; the session's [`Mode`] is called at fixed places.

use std::time::Duration;

use devices::ControlMessage;
use introspect::guest_events::KERNEL_START;
use introspect::stub_area::GuestArea;
use journal::{EndReason, Entry, JournalError};
use kvm_ioctls::VcpuExit;

use super::mode::{install_gates, Mode};
use super::outcome::{NetReport, RunOutcome, StopReason};
use crate::vm::dispatch::Next;
use crate::vm::{kvm_err, Claimed, Machine, Resumed, VmClock, VmError};

/// Runs the machine in `mode` until the guest stops, the mode stops it or
/// something fails. `deadline` tells the kick thread when the vCPU must
/// be out of KVM_RUN (VM time, by the machine's clock, which it is given).
pub(super) fn run<M: Mode>(
    m: &mut Machine,
    mode: &mut M,
    deadline: &dyn Fn(u64, &VmClock),
) -> Result<RunOutcome, VmError> {
    match run_until_stopped(m, mode, deadline) {
        // An incomplete trace's log ran out at an exit, not only where
        // the loop looks before running the vCPU.
        Err(VmError::Journal(JournalError::LogEnded)) => {
            Ok(outcome(m, mode, StopReason::TraceEnded))
        }
        other => other,
    }
}

fn run_until_stopped<M: Mode>(
    m: &mut Machine,
    mode: &mut M,
    deadline: &dyn Fn(u64, &VmClock),
) -> Result<RunOutcome, VmError> {
    if let Some(cpu) = m.vcpu.host_cpu {
        crate::sys::pin_to_cpu(cpu).map_err(|source| VmError::Pin { cpu, source })?;
    }
    mode.start(m)?;
    loop {
        m.feed_input()?;
        let now = m.vm.clock.now_ns();
        m.vm.platform.advance_to(now);
        mode.housekeeping()?;
        if let Some(stop) = mode.before_run(m)? {
            return Ok(outcome(m, mode, stop));
        }
        deadline(mode.kick_deadline(m, now), &m.vm.clock);

        let resumed = Resumed {
            rip: m.vcpu.resume_rip.take(),
            gprs: m.vcpu.resume_gprs.take(),
            in_kernel: std::mem::take(&mut m.vcpu.injected)
                || m.vcpu.synced_regs().rip >= KERNEL_START,
        };
        let debug_armed = mode.debug_armed();
        let exit = m.vcpu.run();
        mode.left_guest(&m.vm)?;
        let claimed = match &exit {
            Ok(VcpuExit::MmioWrite(addr, data)) if mode.claims(*addr) => {
                Some((*addr, data.to_vec()))
            }
            _ => None,
        };
        if debug_armed && matches!(exit, Ok(VcpuExit::Debug(_))) {
            drop(exit);
            mode.debug_exit(m)?;
            continue;
        }
        let (next, observed) = if let Some((addr, data)) = claimed {
            drop(exit);
            match mode.store(m, addr, &data)? {
                Claimed::Reached => {
                    m.vcpu.at_delivery_point = true;
                    continue;
                }
                Claimed::Passed => continue,
                Claimed::NotOurs => {
                    Machine::dispatch(&mut m.vm, mode.answers(), VcpuExit::MmioWrite(addr, &data))?
                }
            }
        } else {
            match exit {
                Ok(exit) => Machine::dispatch(&mut m.vm, mode.answers(), exit)?,
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    m.vm.exits.kicks += 1;
                    (Next::Continue, None)
                }
                Err(e) => return Err(kvm_err("RUN")(e)),
            }
        };
        let observed_exit = observed.is_some();
        m.vcpu.at_delivery_point = observed_exit;
        m.vcpu.after_exit = observed_exit;
        match observed {
            None => m.vcpu.at_delivery_point = mode.kicked(m, resumed)?,
            Some(event) => {
                // KVM raises #GP for a refused MSR access when the vCPU
                // resumes; an interrupt injected with it would reach the
                // guest at a point that depends on timing.
                if matches!(
                    event,
                    Entry::RdMsr { fault: true, .. } | Entry::WrMsr { fault: true, .. }
                ) {
                    m.vcpu.exception_pending = true;
                }
                let regs = m.vcpu.synced_regs();
                m.vcpu.resume_at(&regs);
                mode.exit(m, event.with_rip(regs.rip), &regs)?;
            }
        }
        if let Some(stop) = messages(m, mode)? {
            return Ok(outcome(m, mode, stop));
        }
        if observed_exit {
            mode.exit_handled(m)?;
        }
        match next {
            Next::Continue => {}
            Next::WaitForInterrupt => {
                if let Some(stop) = mode.halted(m)? {
                    return Ok(outcome(m, mode, stop));
                }
            }
            Next::InternalError => {
                if !mode.unemulated(m)? {
                    m.complete_unemulated()?;
                }
            }
            Next::Fault(reason, detail) => {
                return Err(VmError::GuestFault {
                    reason,
                    rip: m.vcpu.rip_or_zero(),
                    detail,
                });
            }
        }
    }
}

/// Acts on the messages the guest left on its control port; the reason
/// to stop, if one ends the run.
fn messages<M: Mode>(m: &mut Machine, mode: &mut M) -> Result<Option<StopReason>, VmError> {
    for message in m.vm.platform.take_messages() {
        match message {
            ControlMessage::InitReached { announces_terminal } => {
                m.vm.status.init_reached = Some(Duration::from_nanos(m.vm.clock.now_ns()));
                if !announces_terminal {
                    // An `/init` from before the virtio console: its
                    // command has the serial one, where input goes.
                    m.vm.status.terminal = Some(false);
                }
            }
            ControlMessage::ExitStatus(s) => {
                m.vm.status.exit_status = Some(s);
                mode.ended(&EndReason::CommandExited(s))?;
                return Ok(Some(StopReason::CommandExited));
            }
            ControlMessage::PowerOff => {
                mode.ended(&EndReason::PowerOff)?;
                return Ok(Some(StopReason::PowerOff));
            }
            ControlMessage::Panic => return Err(VmError::GuestPanic),
            ControlMessage::Event(raiser) => mode.event_raised(m, raiser)?,
            ControlMessage::SwitchRing => {
                m.vm.status.switch_ring_gpa = Some(m.vcpu.synced_regs().rsi);
                mode.switch_ring_announced(m);
            }
            ControlMessage::PreemptArea => {
                // The probe gate goes at the end of the area's code page,
                // silent unless replaying (`introspect::probe_gate`).
                let gpa = m.vcpu.synced_regs().rsi;
                if GuestArea::read(&m.vm.mem, gpa).is_ok() {
                    m.vm.status.stub_area_gpa = Some(gpa);
                    install_gates(m, mode);
                }
            }
            ControlMessage::Ready => {
                if let Some(stop) = mode.ready(m)? {
                    return Ok(Some(stop));
                }
                m.vm.status.devices_attached = true;
            }
            ControlMessage::Fetch => m.fetch_archive()?,
            ControlMessage::Copy => {
                let written = m.guest_copy()?;
                mode.wrote_for_guest(m, &written)?;
            }
            ControlMessage::Terminal { virtio } => m.vm.status.terminal = Some(virtio),
            ControlMessage::Output { stream } => {
                let written = m.stream_output(stream)?;
                if mode.stream_written(stream, written)? {
                    if let Some(gpa) = m.answer_stream_closed()? {
                        mode.wrote_for_guest(m, &[gpa])?;
                    }
                }
            }
            ControlMessage::Input => {
                let max = m.stdin_request()?;
                let (bytes, end) = mode.stream_input(m, max)?;
                let written = m.answer_stdin(&bytes, end)?;
                mode.wrote_for_guest(m, &written)?;
            }
            // (The platform loads the PIT with a wide count itself.)
            ControlMessage::Sync => mode.kernel_entered(m)?,
            ControlMessage::PitCount(_) | ControlMessage::Unknown(_) => {}
        }
    }
    Ok(None)
}

/// The outcome of a run that stopped for `stop`.
pub(super) fn outcome<M: Mode>(m: &mut Machine, mode: &M, stop: StopReason) -> RunOutcome {
    use std::io::Write;
    let vm = &mut m.vm;
    let _ = vm.platform.serial.writer_mut().flush();
    let mut outcome = RunOutcome {
        stop,
        exit_status: vm.status.exit_status,
        init_reached: vm.status.init_reached,
        elapsed: Duration::from_nanos(vm.clock.now_ns()),
        exits: vm.exits,
        platform: vm.platform.stats(),
        journal: mode.progress(),
        trace: None,
        disk: vm.block.as_ref().map(|b| b.stats()),
        net: vm.net.as_ref().map(|n| NetReport {
            stats: n.stats(),
            failure: n.failure().map(str::to_owned),
        }),
        events: None,
        points: Default::default(),
        checkpoints: Vec::new(),
        boot_snapshot: None,
        expansion: None,
    };
    mode.outcome(m, &mut outcome);
    outcome
}
