//! Breakpoints: software and hardware ones are the same `int3`s in the
//! process's code (`vmm::tools::control`).

use gdbstub::target::ext::breakpoints::{
    Breakpoints, HwBreakpoint, HwBreakpointOps, HwWatchpointOps, SwBreakpoint, SwBreakpointOps,
};
use gdbstub::target::TargetResult;

use super::ReplayTarget;

impl Breakpoints for ReplayTarget {
    fn support_sw_breakpoint(&mut self) -> Option<SwBreakpointOps<'_, Self>> {
        Some(self)
    }

    fn support_hw_breakpoint(&mut self) -> Option<HwBreakpointOps<'_, Self>> {
        Some(self)
    }

    fn support_hw_watchpoint(&mut self) -> Option<HwWatchpointOps<'_, Self>> {
        Some(self)
    }
}

impl SwBreakpoint for ReplayTarget {
    fn add_sw_breakpoint(&mut self, addr: u64, _: usize) -> TargetResult<bool, Self> {
        self.driver.debug_mut().add_breakpoint(addr);
        Ok(true)
    }

    fn remove_sw_breakpoint(&mut self, addr: u64, _: usize) -> TargetResult<bool, Self> {
        self.driver.debug_mut().remove_breakpoint(addr);
        Ok(true)
    }
}

/// Hardware breakpoints are the same breakpoints: this host's KVM has no
/// user-mode debug registers.
impl HwBreakpoint for ReplayTarget {
    fn add_hw_breakpoint(&mut self, addr: u64, kind: usize) -> TargetResult<bool, Self> {
        self.add_sw_breakpoint(addr, kind)
    }

    fn remove_hw_breakpoint(&mut self, addr: u64, kind: usize) -> TargetResult<bool, Self> {
        self.remove_sw_breakpoint(addr, kind)
    }
}
