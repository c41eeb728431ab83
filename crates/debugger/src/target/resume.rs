//! Resuming: continue and single steps (the vCPU runs when gdb's resume
//! is performed, `ReplayTarget::perform`); the other threads always run
//! as recorded.

use gdbstub::common::{Signal, Tid};
use gdbstub::target::ext::base::multithread::{
    MultiThreadResume, MultiThreadSchedulerLocking, MultiThreadSchedulerLockingOps,
    MultiThreadSingleStep, MultiThreadSingleStepOps,
};
use gdbstub::target::ext::base::reverse_exec::{ReverseContOps, ReverseStepOps};

use super::{lwpid, Action, Error, ReplayTarget};

impl MultiThreadResume for ReplayTarget {
    fn resume(&mut self) -> Result<(), Error> {
        if self.action.is_none() {
            self.action = Some(Action::Continue);
        }
        Ok(())
    }

    fn clear_resume_actions(&mut self) -> Result<(), Error> {
        self.action = None;
        Ok(())
    }

    fn set_resume_action_continue(&mut self, _: Tid, _: Option<Signal>) -> Result<(), Error> {
        // Signals cannot be given to a replay: the recorded run's go on.
        Ok(())
    }

    fn support_single_step(&mut self) -> Option<MultiThreadSingleStepOps<'_, Self>> {
        Some(self)
    }

    fn support_reverse_cont(&mut self) -> Option<ReverseContOps<'_, Tid, Self>> {
        Some(self)
    }

    fn support_reverse_step(&mut self) -> Option<ReverseStepOps<'_, Tid, Self>> {
        Some(self)
    }

    fn support_scheduler_locking(&mut self) -> Option<MultiThreadSchedulerLockingOps<'_, Self>> {
        Some(self)
    }
}

impl MultiThreadSingleStep for ReplayTarget {
    fn set_resume_action_step(&mut self, tid: Tid, _: Option<Signal>) -> Result<(), Error> {
        self.action = Some(Action::Step(lwpid(tid)));
        Ok(())
    }
}

impl MultiThreadSchedulerLocking for ReplayTarget {
    fn set_resume_action_scheduler_lock(&mut self) -> Result<(), Error> {
        // The other threads run as recorded: a replay cannot hold them.
        Ok(())
    }
}
