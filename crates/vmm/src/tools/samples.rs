//! SAMPLE events: the task on the vCPU, sampled about every period of
//! host time during replay (the kick thread wakes the vCPU for it),
//! with where it was (user code, the kernel, the boundary between them)
//! and its user stack.

use std::time::Duration;

use events::abi::SampleMode;
use introspect::guest_events::{self, UserMemory};
use unwind::Regs;

use super::events::{EventTool, MAX_STACK_FRAMES};
use super::objects::FoundObjects;
use super::tool::{ReplayTool, ToolContext};
use crate::points::{user_position, PointSearch};
use crate::vm::{Machine, Resumed, VmError};

/// Samples: their period and when the next is due, in host time, or in
/// the recording's time where it took sample marks.
pub(crate) struct Sampling {
    period_ns: u64,
    next_ns: u64,
    /// The recording's sampling period, when samples are taken at its
    /// marks (`journal::preempt::SampleMark`) rather than by host time.
    recorded_ns: Option<u64>,
    /// Where the guest kernel keeps the top of the current task's kernel
    /// stack, so that samples in the kernel find the user registers.
    kernel_stack_top: Option<u64>,
    /// Also a sample at each of a chaos recording's decisions, of the
    /// task that asked (where `insight why` finds its line), unwound
    /// through the objects found in each process's memory.
    at_decisions: Option<FoundObjects>,
}

impl Sampling {
    /// A sample about every `period` of host time (the kick thread wakes
    /// the vCPU at most once a millisecond). `kernel_stack_top`: the guest
    /// kernel variable holding the top of the current task's kernel
    /// stack, below which a task entering the kernel from user mode leaves
    /// its user registers; with it, a sample taken in the kernel carries
    /// the user stack the task entered from.
    pub(crate) fn every(period: Duration, kernel_stack_top: Option<u64>) -> Self {
        let period_ns = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1);
        Sampling {
            period_ns,
            next_ns: period_ns,
            recorded_ns: None,
            kernel_stack_top,
            at_decisions: None,
        }
    }

    /// Samples at a chaos recording's decisions only: the task that asked,
    /// its user registers as it entered the kernel and its user stack.
    pub(crate) fn at_decisions_only(kernel_stack_top: Option<u64>) -> Self {
        Sampling::every(Duration::MAX, kernel_stack_top).with_decisions()
    }

    /// Also a sample at each chaos decision.
    pub(crate) fn with_decisions(self) -> Self {
        Sampling {
            at_decisions: Some(FoundObjects::default()),
            ..self
        }
    }

    /// Samples at the recording's marks, taken about every `recorded_ns`
    /// of its time: every mark, or for a longer `period` the first mark at
    /// least about a period after the last one taken.
    pub(crate) fn at_marks(self, recorded_ns: u64) -> Self {
        Sampling {
            recorded_ns: Some(recorded_ns.max(1)),
            next_ns: 0,
            ..self
        }
    }

    /// The period (ns) of samples taken at the recording's marks; `None`
    /// for samples by host time.
    pub(crate) fn marks_period(&self) -> Option<u64> {
        self.recorded_ns.map(|_| self.period_ns)
    }

    /// When the next sample is due (VM time; never by host time where the
    /// recording's marks are the samples).
    pub(crate) fn next_ns(&self) -> u64 {
        match self.recorded_ns {
            Some(_) => u64::MAX,
            None => self.next_ns,
        }
    }

    /// Whether the recording's mark taken at `ns` (its time) is one this
    /// replay samples at: all of them at the recorded period, fewer for a
    /// longer one.
    pub(crate) fn wants_mark(&mut self, ns: u64) -> bool {
        let Some(recorded) = self.recorded_ns else {
            return false;
        };
        if ns < self.next_ns {
            return false;
        }
        self.next_ns = ns.saturating_add(self.period_ns.saturating_sub(recorded / 2));
        true
    }

    /// A SAMPLE of the task on the vCPU into `events`, if one is due and
    /// the task is tracked: RIP, where the task was (`SampleMode`), and
    /// the user stack's return addresses. `resumed`: how the interrupted
    /// KVM_RUN started; `guest_ns`: guest time as the log has it.
    pub(crate) fn take(
        &mut self,
        m: &Machine,
        events: &mut EventTool,
        search: &PointSearch,
        resumed: Resumed,
        guest_ns: u64,
    ) -> Result<(), VmError> {
        let now = m.vm.clock.now_ns();
        if self.recorded_ns.is_some() || now < self.next_ns {
            return Ok(());
        }
        self.next_ns = now.saturating_add(self.period_ns);
        self.sample(m, events, search, resumed, guest_ns, None, false)
    }

    /// A SAMPLE of the task on the vCPU where a recording's mark put it:
    /// in user code at the mark's position (`recorded` `User`), or, for a
    /// mark the recording took at `rip` in the kernel or at its boundary,
    /// the task where replay stood when it came to the mark (its thread,
    /// its user stack).
    pub(crate) fn take_mark(
        &mut self,
        m: &Machine,
        events: &mut EventTool,
        search: &PointSearch,
        guest_ns: u64,
        recorded: SampleMode,
        rip: Option<u64>,
    ) -> Result<(), VmError> {
        let at = Recorded {
            mode: recorded,
            rip,
        };
        self.sample(
            m,
            events,
            search,
            Resumed::default(),
            guest_ns,
            Some(at),
            false,
        )
    }

    /// A SAMPLE of the task on the vCPU, where it was as `mode` says or as
    /// its state shows; of a tracked task only, unless `any_task` (a
    /// decision's: every task of the recording asks for them).
    #[allow(clippy::too_many_arguments)]
    fn sample(
        &mut self,
        m: &Machine,
        events: &mut EventTool,
        search: &PointSearch,
        resumed: Resumed,
        guest_ns: u64,
        recorded: Option<Recorded>,
        any_task: bool,
    ) -> Result<(), VmError> {
        let mode = recorded.map(|r| r.mode);
        let mem = &m.vm.mem;
        events.drain_switches(mem, guest_ns)?;
        let stubs = m.stub_mappings();
        let capture = &mut events.capture;
        let Some((pid, lwpid)) = capture.current() else {
            return Ok(());
        };
        if !any_task && !capture.is_tracked(lwpid) {
            return Ok(());
        }
        let mut regs = m.vcpu.regs()?;
        let sregs = m.vcpu.sregs()?;
        let user = sregs.cs.selector & 3 == 3;
        let here = user.then(|| {
            let top = self.kernel_stack_top;
            user_position(mem, sregs.cr3, &mut regs, &stubs, resumed, top)
        });
        // Inside the trampoline, the program is at the patched position.
        let rip = match recorded.and_then(|r| r.rip) {
            Some(rip) => rip,
            None => search.sample_rip(regs.rip),
        };
        let (mode, stack) = if let Some(here) = here {
            let mode = mode.unwrap_or(here);
            let stack = match &events.stacks {
                Some(stacks) => {
                    let mut mem = UserMemory {
                        mem,
                        cr3: sregs.cr3,
                    };
                    let at = Regs {
                        rip,
                        rsp: regs.rsp,
                        rbp: regs.rbp,
                    };
                    stacks.unwind(pid, &mut mem, at, MAX_STACK_FRAMES)
                }
                None => guest_events::frame_chain(mem, sregs.cr3, regs.rbp, MAX_STACK_FRAMES),
            };
            (mode, stack)
        } else {
            let user = match (&events.stacks, self.kernel_stack_top) {
                (Some(stacks), Some(top)) => guest_events::user_regs_in_kernel(mem, sregs.cr3, top)
                    .map(|regs| (stacks, regs)),
                _ => None,
            };
            let stack = user.map_or_else(Vec::new, |(stacks, [rip, rsp, rbp])| {
                let mut mem = UserMemory {
                    mem,
                    cr3: sregs.cr3,
                };
                let at = Regs { rip, rsp, rbp };
                let mut frames = vec![rip];
                frames.extend(stacks.unwind(pid, &mut mem, at, MAX_STACK_FRAMES - 1));
                frames
            });
            (mode.unwrap_or(SampleMode::Kernel), stack)
        };
        events
            .capture
            .sample(guest_ns, pid, lwpid, rip, mode, &stack)?;
        Ok(())
    }
}

/// Samples at kicks (host time) and at the recording's marks, into the
/// event capture.
impl ReplayTool for Sampling {
    fn deadline(&self) -> u64 {
        self.next_ns()
    }

    /// A kick: the guest stopped wherever it was, which is what a sample
    /// wants (exits would bias it).
    fn kicked(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
        resumed: Resumed,
    ) -> Result<(), VmError> {
        let guest_ns = cx.event_ns();
        match cx.events.as_deref_mut() {
            Some(events) => self.take(m, events, cx.points, resumed, guest_ns),
            None => Ok(()),
        }
    }

    fn wants_mark(&mut self, ns: u64) -> bool {
        Sampling::wants_mark(self, ns)
    }

    /// A task entering `execve` names its program, for the objects of
    /// the samples at decisions.
    fn exit(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
        kernel_entry: bool,
    ) -> Result<(), VmError> {
        let (Some(objects), Some(events), Some(var)) = (
            self.at_decisions.as_mut(),
            cx.events.as_deref_mut(),
            cx.kernel_stack_top,
        ) else {
            return Ok(());
        };
        if let (true, Some((pid, _))) = (kernel_entry, events.capture.current()) {
            objects.kernel_entry(&m.vm.mem, m.vcpu.sregs()?.cr3, var, pid);
        }
        Ok(())
    }

    fn chaos_decision(&mut self, cx: &mut ToolContext, m: &mut Machine) -> Result<(), VmError> {
        let guest_ns = cx.event_ns();
        let (Some(objects), Some(events)) = (self.at_decisions.as_mut(), cx.events.as_deref_mut())
        else {
            return Ok(());
        };
        events.drain_switches(&m.vm.mem, guest_ns)?;
        let cr3 = m.vcpu.sregs()?.cr3;
        let user = self
            .kernel_stack_top
            .and_then(|top| guest_events::user_regs_in_kernel(&m.vm.mem, cr3, top));
        if let (Some((pid, _)), Some([_, rsp, _])) = (events.capture.current(), user) {
            objects.look(&m.vm.mem, cr3, pid, rsp, events)?;
        }
        self.sample(
            m,
            events,
            cx.points,
            Resumed::default(),
            guest_ns,
            None,
            true,
        )
    }

    fn mark_sample(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
        mode: SampleMode,
        rip: Option<u64>,
    ) -> Result<(), VmError> {
        let guest_ns = cx.event_ns();
        match cx.events.as_deref_mut() {
            Some(events) => self.take_mark(m, events, cx.points, guest_ns, mode, rip),
            None => Ok(()),
        }
    }
}

/// Where a recording's mark found the task.
#[derive(Clone, Copy)]
struct Recorded {
    mode: SampleMode,
    /// Its RIP, where replay samples elsewhere.
    rip: Option<u64>,
}
