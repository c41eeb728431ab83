//! Reverse execution: `reverse-continue` and `reverse-stepi`, performed
//! by the history (`crate::history`).

use gdbstub::common::Tid;
use gdbstub::target::ext::base::reverse_exec::{ReverseCont, ReverseStep};

use super::{lwpid, Action, Error, ReplayTarget};

impl ReverseCont<Tid> for ReplayTarget {
    fn reverse_cont(&mut self) -> Result<(), Error> {
        self.action = Some(Action::ReverseContinue);
        Ok(())
    }
}

impl ReverseStep<Tid> for ReplayTarget {
    fn reverse_step(&mut self, tid: Tid) -> Result<(), Error> {
        // gdb asks for "any thread" before `bs`, meaning the one selected.
        let lwpid = match (self.selection.continue_any, self.selection.general) {
            (true, Some(selected)) => selected,
            _ => lwpid(tid),
        };
        self.action = Some(Action::ReverseStep(lwpid));
        Ok(())
    }
}
