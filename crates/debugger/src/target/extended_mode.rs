//! The extended mode gdb asks for: one process, already attached, never
//! run anew.

use std::num::NonZeroUsize;

use gdbstub::common::Pid;
use gdbstub::target::ext::extended_mode::{
    Args, AttachKind, CurrentActivePid, CurrentActivePidOps, ExtendedMode, ShouldTerminate,
};
use gdbstub::target::{TargetError, TargetResult};

use super::{Error, ReplayTarget};

impl ExtendedMode for ReplayTarget {
    fn run(&mut self, _: Option<&[u8]>, _: Args<'_, '_>) -> TargetResult<Pid, Self> {
        Err(TargetError::NonFatal)
    }

    fn attach(&mut self, _: Pid) -> TargetResult<(), Self> {
        Err(TargetError::NonFatal)
    }

    fn query_if_attached(&mut self, _: Pid) -> TargetResult<AttachKind, Self> {
        Ok(AttachKind::Attach)
    }

    fn kill(&mut self, _: Option<Pid>) -> TargetResult<ShouldTerminate, Self> {
        Ok(ShouldTerminate::Yes)
    }

    fn restart(&mut self) -> Result<(), Error> {
        Ok(())
    }

    fn support_current_active_pid(&mut self) -> Option<CurrentActivePidOps<'_, Self>> {
        Some(self)
    }
}

impl CurrentActivePid for ReplayTarget {
    fn current_active_pid(&mut self) -> Result<Pid, Error> {
        Ok(NonZeroUsize::new(self.pid() as usize).unwrap_or(NonZeroUsize::MIN))
    }
}
