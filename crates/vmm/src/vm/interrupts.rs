//! Interrupt injection, and waiting at HLT until an interrupt is due.

use std::time::Duration;

use super::run::HOUSEKEEPING_NS;
use super::{Vm, VmError};
use crate::kvm_ext;

impl Vm {
    /// Injects the PIC's pending interrupt if the vCPU can take it now,
    /// otherwise asks KVM to exit as soon as it can.
    ///
    /// Under the exit clock (recording, replay) interrupts are injected only
    /// right after a deterministic exit and the vCPU never asks for a
    /// window: the window exit is not a deterministic point.
    pub(super) fn inject_interrupts(&mut self) -> Result<(), VmError> {
        let exit_clock = self.journal.exit_clock();
        let at_exit = std::mem::take(&mut self.at_delivery_point);
        let exception_pending = std::mem::take(&mut self.exception_pending);
        let run = self.vcpu.get_kvm_run();
        // The flags describe the vCPU at the last exit, before any
        // exception the VMM injected since.
        let can_inject = !exception_pending
            && run.ready_for_interrupt_injection != 0
            && run.if_flag != 0
            && (at_exit || !exit_clock);
        if self.journal.is_replay() {
            run.request_interrupt_window = 0;
            if !at_exit {
                return Ok(());
            }
            if let Some(vector) = self.journal.replay_interrupt()? {
                if !can_inject {
                    return Err(self
                        .journal
                        .replay_uninjectable(vector, exception_pending)
                        .into());
                }
                self.inject(vector)?;
            }
            return Ok(());
        }
        let pending = self.platform.pic.has_pending();
        run.request_interrupt_window = u8::from(pending && !can_inject && !exit_clock);
        if pending && can_inject {
            if let Some(vector) = self.platform.pic.acknowledge() {
                self.inject(vector)?;
                self.journal.record_interrupt(vector)?;
            }
        }
        Ok(())
    }

    pub(super) fn inject(&mut self, vector: u8) -> Result<(), VmError> {
        if let Some(sampling) = &mut self.sampling {
            sampling.injected = true;
        }
        kvm_ext::inject_interrupt(&self.vcpu, vector).map_err(|e| VmError::Kvm {
            op: "INTERRUPT",
            source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)),
        })?;
        self.exits.interrupts_injected += 1;
        Ok(())
    }

    /// The guest executed HLT: sleep until an interrupt is due.
    pub(super) fn wait_for_interrupt(&mut self) -> Result<(), VmError> {
        if self.vcpu.get_kvm_run().if_flag == 0 {
            let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
            return Err(VmError::GuestHalted { rip });
        }
        loop {
            self.feed_input()?;
            self.housekeeping()?;
            let now = self.clock.now_ns();
            self.platform.advance_to(now);
            self.publish_inputs()?;
            if self.platform.pic.has_pending() {
                return Ok(());
            }
            // With input attached, look for keys every few milliseconds;
            // devices ring the doorbell when they have something.
            let max_sleep = if self.input.is_some() {
                5_000_000
            } else if self.journal.exit_clock() {
                HOUSEKEEPING_NS
            } else {
                u64::MAX
            };
            match self.platform.next_timer_ns() {
                Some(due) => {
                    let wait = due.saturating_sub(now).min(max_sleep);
                    self.doorbell.wait(Duration::from_nanos(wait));
                }
                None => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(VmError::GuestHalted { rip });
                }
            }
        }
    }
}
