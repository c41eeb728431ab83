//! Write watchpoints: the watched pages made read only, every write to
//! them trapped (`vmm::tools::control`).

use gdbstub::target::ext::breakpoints::{HwWatchpoint, WatchKind};
use gdbstub::target::TargetResult;

use super::ReplayTarget;

/// Write watchpoints trap every write to the watched pages; reads cannot
/// be trapped (user-mode loads never exit on these hosts).
impl HwWatchpoint for ReplayTarget {
    fn add_hw_watchpoint(
        &mut self,
        addr: u64,
        len: u64,
        kind: WatchKind,
    ) -> TargetResult<bool, Self> {
        if kind != WatchKind::Write {
            if !self.told_no_read_watch {
                eprintln!(
                    "insight: read and access watchpoints are not supported (loads in user mode \
                     cannot be trapped on this host); use watch, which traps every write"
                );
                self.told_no_read_watch = true;
            }
            return Ok(false);
        }
        if len == 0 || len > 4096 {
            return Ok(false);
        }
        self.driver.debug_mut().add_watch(addr, len);
        Ok(true)
    }

    fn remove_hw_watchpoint(
        &mut self,
        addr: u64,
        len: u64,
        kind: WatchKind,
    ) -> TargetResult<bool, Self> {
        Ok(kind == WatchKind::Write && self.driver.debug_mut().remove_watch(addr, len))
    }
}
