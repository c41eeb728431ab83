//! A plain run (`insight run`, and the boot that takes a boot snapshot):
//! interrupts are delivered as soon as they are due, inputs as soon as
//! they arrive, and nothing is logged.

use journal::Entry;

use super::host_files;
use super::inputs;
use super::mode::Mode;
use super::outcome::{RunOutcome, StopReason};
use super::threads::run_on_vcpu_thread;
use crate::boot_snapshot::{self, SnapshotTaken, SnapshotTarget};
use crate::vm::{Machine, VmError};

/// A machine run without recording.
pub struct LiveRun {
    machine: Machine,
    mode: Live,
}

struct Live {
    /// Where a boot snapshot goes when `/init` is ready, instead of going
    /// on; and the one taken there.
    snapshot: Option<(SnapshotTarget, Option<SnapshotTaken>)>,
}

impl LiveRun {
    pub fn new(machine: Machine) -> Self {
        LiveRun {
            machine,
            mode: Live { snapshot: None },
        }
    }

    /// A run that stops when `/init` is ready, with the machine's state
    /// written to `target` (`StopReason::SnapshotTaken`).
    pub(crate) fn snapshot_when_ready(machine: Machine, target: SnapshotTarget) -> Self {
        LiveRun {
            machine,
            mode: Live {
                snapshot: Some((target, None)),
            },
        }
    }

    /// Runs the guest until it powers off or fails.
    pub fn run(self) -> Result<RunOutcome, VmError> {
        run_on_vcpu_thread(self.machine, self.mode)
    }
}

impl Mode for Live {
    fn before_run(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        inputs::publish_live(m);
        let delivery = m.take_delivery(false);
        m.inject_pending(delivery.can_inject, false)?;
        Ok(None)
    }

    fn kick_deadline(&self, m: &Machine, _now: u64) -> u64 {
        m.vm.platform.next_timer_ns().unwrap_or(u64::MAX)
    }

    fn exit(
        &mut self,
        m: &mut Machine,
        _entry: Entry,
        _regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), VmError> {
        // Nothing checks the console's output here.
        m.vm.console.take_transmitted();
        host_files::serve_live(m);
        Ok(())
    }

    fn ready(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        let Some((target, taken)) = &mut self.snapshot else {
            return Ok(None);
        };
        *taken = Some(boot_snapshot::take(m, target)?);
        Ok(Some(StopReason::SnapshotTaken))
    }

    fn halted(&mut self, m: &mut Machine) -> Result<Option<StopReason>, VmError> {
        m.wait_for_interrupt(u64::MAX, |m| {
            inputs::publish_live(m);
            Ok(())
        })?;
        Ok(None)
    }

    fn outcome(&self, _m: &Machine, outcome: &mut RunOutcome) {
        outcome.boot_snapshot = self.snapshot.as_ref().and_then(|(_, t)| t.clone());
    }
}
