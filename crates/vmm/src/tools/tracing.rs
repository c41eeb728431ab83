//! Replay-time expansion: every user instruction of one process, and the
//! memory each touched, by single-stepping it (docs/expansion.md).
//!
//! This host's KVM never stops in guest user mode, but the guest kernel
//! receives the user's own debug exceptions. So the replay sets the trap
//! flag in the traced process's user RFLAGS (its threads and the threads
//! it creates keep it across kernel entries) and puts a hardware
//! breakpoint, which fires in kernel mode, on the guest's #DB handler. A
//! step exits there before the handler runs: the VMM reads the
//! exception's frame for the user RIP, RSP and RFLAGS (the other
//! registers are still the user's), logs the instruction about to run,
//! and returns to user mode itself. The guest kernel never sees the step,
//! and these exits are not the exit clock's: interrupts are never
//! delivered at them. From such a stop most of the instructions that
//! follow are stepped in guest kernel mode instead, where KVM steps them
//! itself for a fraction of a trap's cost (`kernel_steps`).

use std::collections::{HashMap, HashSet};
use std::io::Write;

use iced_x86::InstructionInfoFactory;

use events::capture::Capture;
use introspect::guest_events::{self, SavedReg};
use introspect::instructions::{self, InstructionTrace, MemoryTrace, UserRegs, MAX_INSN, TF};
use introspect::{gva, probe_gate};
use journal::preempt::state::CR3_ROOT;
use journal::LogPosition;

use super::events::EventTool;
use super::exec;
use super::frames::{
    idt_handler, return_by_iret, set_kernel_breakpoints, ExceptionFrame, DEBUG_VECTOR,
};
use super::kernel_steps;
use super::report::{ExpansionStats, ToolReport, TraceStart};
use super::tool::{ReplayTool, ToolContext};
use crate::points::PointSearch;
use crate::vm::{Machine, VmError};

/// The most instructions stepped in kernel mode at one stop: the vCPU loop
/// gets its turn (kicks, housekeeping) at least this often.
const MAX_KERNEL_STEPS: u64 = 1000;

/// The process to trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceTarget {
    Pid(u32),
    /// The first process whose threads raise events under this name
    /// (the kernel's `comm`, 15 characters at most).
    Name(String),
}

/// What to trace, and where it goes.
pub struct ExpansionSpec {
    pub target: TraceTarget,
    /// The instruction trace (`expand::InstructionTrace`'s records).
    pub instructions: Option<Box<dyn Write + Send>>,
    /// The memory-access trace (`expand::MemoryTrace`'s lines).
    pub memory: Option<Box<dyn Write + Send>>,
    /// Whether the instruction trace carries each instruction's registers.
    pub registers: bool,
    /// Whether instructions may be stepped in guest kernel mode, where
    /// KVM steps them (`kernel_steps`); otherwise each is a debug
    /// exception in user mode.
    pub kernel_steps: bool,
}

/// How the process to trace is found.
struct Finder {
    target: TraceTarget,
    /// A process whose task entered `execve` of the program the target
    /// names: (pid, its address space then, the path). The program runs
    /// once the process is in another address space (a failed `execve`
    /// returns to the old one; a thread other than the leader that
    /// executes a program takes the leader's id).
    exec: Option<(u32, u64, String)>,
}

/// A stop of the traced process at the #DB handler: the system registers
/// there, and its trampoline pages (which stay where they are while the
/// guest kernel does not run).
struct HandlerStop {
    sregs: kvm_bindings::kvm_sregs,
    stubs: [u64; 2],
}

/// How the tracer steps.
struct StepMethod {
    /// The guest's #DB handler, where the breakpoint is (once armed).
    handler: Option<u64>,
    /// Whether it may step in guest kernel mode (`ExpansionSpec::kernel_steps`).
    in_kernel_mode: bool,
}

/// Single-stepping one process at replay.
pub(crate) struct ProcessTracer {
    finder: Finder,
    /// Threads stepping (from their first step to their next SYSCALL),
    /// and all that were seen stepping.
    stepping: HashSet<u32>,
    seen: HashSet<u32>,
    /// Threads whose last logged instruction was a SYSCALL, and where it
    /// returns: the instruction there runs before the next step.
    in_syscall: HashMap<u32, u64>,
    /// Threads in a system call made with the trap flag, whose saved R11
    /// is to lose it.
    r11_fix: HashSet<u32>,
    /// Threads whose last step stood at an instruction on a page not yet
    /// mapped (its fetch faults it in): the registers there, to log the
    /// instruction at the thread's next step.
    unread: HashMap<u32, UserRegs>,
    /// Threads whose last step stood at a trampoline's jump: the registers
    /// before the instruction it covers.
    at_patch: HashMap<u32, UserRegs>,
    /// Accesses of the step not yet in the event capture (MEMACCESS):
    /// thread, RIP, the access and whether on the thread's stack.
    to_capture: Vec<(u32, u64, instructions::Access, bool)>,
    /// The traced threads' stacks.
    stacks: instructions::Stacks,
    /// Deterministic exits replayed before the step under way.
    exit: u64,
    how: StepMethod,
    instructions: Option<InstructionTrace>,
    memory: Option<MemoryTrace>,
    factory: InstructionInfoFactory,
    stats: ExpansionStats,
}

impl ProcessTracer {
    /// Single-steps the user code of `spec.target` and writes what it
    /// executed (needs an event capture, which says which task is on the
    /// CPU).
    pub(crate) fn new(spec: ExpansionSpec) -> Self {
        ProcessTracer {
            finder: Finder {
                target: spec.target,
                exec: None,
            },
            stepping: HashSet::new(),
            seen: HashSet::new(),
            in_syscall: HashMap::new(),
            r11_fix: HashSet::new(),
            unread: HashMap::new(),
            at_patch: HashMap::new(),
            to_capture: Vec::new(),
            stacks: instructions::Stacks::default(),
            exit: 0,
            how: StepMethod {
                handler: None,
                in_kernel_mode: spec.kernel_steps,
            },
            instructions: spec
                .instructions
                .map(|out| InstructionTrace::new(out, spec.registers)),
            memory: spec.memory.map(MemoryTrace::new),
            factory: InstructionInfoFactory::new(),
            stats: ExpansionStats::default(),
        }
    }

    /// What the tracing did so far.
    pub(crate) fn stats(&self) -> ExpansionStats {
        ExpansionStats {
            threads: self.seen.len(),
            ..self.stats.clone()
        }
    }

    /// At the guest kernel's deterministic point at a kernel entry from
    /// user mode: a task executing the program the target names is
    /// followed until the program runs.
    pub(crate) fn kernel_entry(
        &mut self,
        m: &Machine,
        events: &EventTool,
        kernel_stack_top: Option<u64>,
    ) -> Result<(), VmError> {
        let (TraceTarget::Name(name), None, Some(var), Some((pid, _))) = (
            &self.finder.target,
            self.stats.pid,
            kernel_stack_top,
            events.capture.current(),
        ) else {
            return Ok(());
        };
        let cr3 = m.vcpu.sregs()?.cr3;
        if let Some(call) = exec::exec_call(&m.vm.mem, cr3, var) {
            if exec::program_named(&call.path, name) {
                self.finder.exec = Some((pid, cr3 & CR3_ROOT, call.path));
            }
        }
        Ok(())
    }

    /// Whether process `pid`, on the CPU, is the one to trace,
    /// found at exit `exit`: where its tracing starts.
    fn found(
        &self,
        m: &Machine,
        capture: &Capture,
        pid: u32,
        exit: u64,
    ) -> Result<Option<TraceStart>, VmError> {
        Ok(match &self.finder.target {
            TraceTarget::Pid(p) => (*p == pid).then_some(TraceStart::OnCpu { exit }),
            TraceTarget::Name(name) => {
                if let Some((p, before, path)) = &self.finder.exec {
                    if *p == pid && m.vcpu.sregs()?.cr3 & CR3_ROOT != *before {
                        return Ok(Some(TraceStart::Exec {
                            exit,
                            path: path.clone(),
                        }));
                    }
                }
                let want: String = name.chars().take(15).collect();
                capture
                    .comm_of(pid)
                    .is_some_and(|comm| comm == want)
                    .then_some(TraceStart::Named { exit })
            }
        })
    }

    /// After a deterministic exit (the `exit`th): if the task on the CPU
    /// is one of the traced process's and not yet stepping, sets its trap
    /// flag. `kernel_stack_top`: where the guest kernel keeps the top of
    /// the current task's kernel stack (its saved user registers are
    /// below).
    pub(crate) fn arm(
        &mut self,
        m: &mut Machine,
        events: &EventTool,
        kernel_stack_top: Option<u64>,
        exit: u64,
    ) -> Result<(), VmError> {
        let x = self;
        let capture = &events.capture;
        let Some((pid, lwpid)) = capture.current() else {
            return Ok(());
        };
        if x.stats.pid.is_none() {
            let Some(start) = x.found(m, capture, pid, exit)? else {
                return Ok(());
            };
            x.stats.pid = Some(pid);
            x.stats.start = Some(start);
            x.finder.exec = None;
        }
        let fix_r11 = x.r11_fix.contains(&lwpid);
        if x.stats.pid != Some(pid) || (x.stepping.contains(&lwpid) && !fix_r11) {
            return Ok(());
        }
        let sregs = m.vcpu.sregs()?;
        if fix_r11 {
            // In a system call the thread made with the trap flag: R11,
            // which it gets back, is the RFLAGS it had, the flag with it.
            // Its first exit (the entry's deterministic point) comes
            // before the return, which loads RFLAGS from another slot.
            // Only in the system call's own saved registers (they return
            // after the SYSCALL), not a later entry's.
            let ret = x.in_syscall.get(&lwpid).copied();
            let fixed = sregs.cs.selector & 3 != 3
                && ret.is_some()
                && kernel_stack_top.is_some_and(|top| {
                    guest_events::update_saved_user_reg(
                        &m.vm.mem,
                        sregs.cr3,
                        top,
                        SavedReg::R11,
                        (0, TF),
                        ret,
                    )
                });
            if fixed {
                x.r11_fix.remove(&lwpid);
            }
            if x.stepping.contains(&lwpid) {
                return Ok(());
            }
        }
        if x.how.handler.is_none() {
            let handler = idt_handler(&m.vm.mem, sregs.cr3, sregs.idt.base, DEBUG_VECTOR)?;
            set_kernel_breakpoints(m, &[handler], false)?;
            x.how.handler = Some(handler);
        }
        if sregs.cs.selector & 3 == 3 {
            // The exit's instruction is completed first: its registers
            // are then the ones to change.
            if !m.vcpu.complete_exit_now("RUN (completing an exit)")? {
                return Err(VmError::Expansion(
                    "the vCPU ran on while the trap flag was being set".into(),
                ));
            }
            let mut regs = m.vcpu.regs()?;
            regs.rflags |= TF;
            m.vcpu.set_regs(&regs)?;
        } else if let Some(top) = kernel_stack_top {
            // Until the task's first step, this is tried again at every
            // exit it is on the CPU for (a kernel thread's, or a task's
            // on its way out of the kernel, has no user frame yet).
            guest_events::update_saved_user_reg(
                &m.vm.mem,
                sregs.cr3,
                top,
                SavedReg::Flags,
                (TF, 0),
                None,
            );
        }
        Ok(())
    }

    /// The breakpoint on the guest's #DB handler fired. A step of the
    /// traced process is logged; any other task's trap flag (a fork's
    /// child inherits it) is cleared. The instructions that follow, while
    /// [`kernel_steps::plan`] lets them, are stepped in kernel mode and logged
    /// the same way; then the task goes back to user mode where the last
    /// step left it. `at`: where replay stands in the log. How many steps
    /// were made.
    pub(crate) fn step(
        &mut self,
        m: &mut Machine,
        events: &mut EventTool,
        search: &PointSearch,
        at: LogPosition,
    ) -> Result<u64, VmError> {
        let synced = m.vcpu.fd.sync_regs();
        let (regs, sregs) = (synced.regs, synced.sregs);
        let cr3 = sregs.cr3;
        let frame = ExceptionFrame::read(&m.vm.mem, cr3, regs.rsp).map_err(VmError::Expansion)?;
        let (rip, rflags) = (frame.rip, frame.rflags);
        if !frame.came_from_user() || rflags & TF == 0 {
            return Err(VmError::Expansion(format!(
                "a debug exception the tracing did not cause (from {rip:#x}, CS {:#x}, RFLAGS \
                 {rflags:#x})",
                frame.cs
            )));
        }
        let mut user = frame.user_regs(&regs);
        let mut steps = 1;
        let mut stepping = false;
        let stop = HandlerStop {
            sregs,
            stubs: m.stub_mappings(),
        };
        loop {
            let next = self.landed(m, events, search, at, &mut user, &stop)?;
            let Some(insn) = next.filter(|_| self.how.in_kernel_mode && steps <= MAX_KERNEL_STEPS)
            else {
                break;
            };
            match kernel_steps::plan(&m.vm.mem, &sregs, &mut self.factory, &insn, &user) {
                kernel_steps::Plan::Skip => {
                    user.rip = insn.next_ip();
                    steps += 1;
                    self.stats.kernel_steps += 1;
                    continue;
                }
                kernel_steps::Plan::InKernelMode => {}
                kernel_steps::Plan::Trap => break,
            }
            if !stepping {
                set_kernel_breakpoints(m, &[self.how.handler.unwrap_or_default()], true)?;
            }
            match kernel_steps::step(m, &user, &sregs, !stepping, &stop.stubs)? {
                kernel_steps::Stepped::Ran(after) => {
                    user = after;
                    steps += 1;
                    self.stats.kernel_steps += 1;
                    stepping = true;
                }
                kernel_steps::Stepped::Raised | kernel_steps::Stepped::NotEmulated => {
                    self.stats.kernel_steps_refused += 1;
                    stepping = true;
                    break;
                }
            }
        }
        if stepping {
            set_kernel_breakpoints(m, &[self.how.handler.unwrap_or_default()], false)?;
            // The stop's system registers, which the return starts from.
            m.vcpu.set_registers_in_run(user, sregs);
        }
        return_by_iret(m, &frame, user)?;
        Ok(steps)
    }

    /// A step of the task on the CPU came to `user`, in user mode, at the
    /// stop `stop`: logs what it ran and what it is about to run. The
    /// instruction logged as about to run, if it is the traced process's
    /// own code, whole, and not a system call: one that may be stepped in
    /// kernel mode.
    fn landed(
        &mut self,
        m: &mut Machine,
        events: &mut EventTool,
        search: &PointSearch,
        at: LogPosition,
        user: &mut kvm_bindings::kvm_regs,
        stop: &HandlerStop,
    ) -> Result<Option<iced_x86::Instruction>, VmError> {
        let sregs = &stop.sregs;
        let cr3 = sregs.cr3;
        let rip = user.rip;
        let mut next = None;
        events.drain_switches(&m.vm.mem, at.guest_ns)?;
        let current = events.capture.current();
        let in_stub = probe_gate::in_stub_pages(rip, &stop.stubs);
        let moved = if in_stub {
            search.moved_instruction(cr3, rip)
        } else {
            None
        };
        let patch_rip = search.patch_at(cr3);
        let at_patch = patch_rip == Some(rip);
        let x = self;
        let mem = &m.vm.mem;
        x.exit = at.exits;
        match current {
            Some((pid, lwpid)) if Some(pid) == x.stats.pid => {
                x.stepping.insert(lwpid);
                x.seen.insert(lwpid);
                let mut at = UserRegs::from_kvm(user);
                (at.fs_base, at.gs_base) = (sregs.fs.base, sregs.gs.base);
                // A thread still where it was, with the same registers,
                // has not run that instruction yet.
                let ran = |before: &UserRegs| before.rip != at.rip || before.gprs != at.gprs;
                // An instruction whose page was not mapped yet at its step
                // ran before this one (after the fault that mapped it): it
                // is logged first, before a trampoline's jump or a moved
                // instruction this step may log.
                if let Some(before) = x.unread.remove(&lwpid).filter(ran) {
                    let logged = x.log_step(mem, cr3, lwpid, &before, false)?;
                    if logged.is_some_and(|i| i.mnemonic() == iced_x86::Mnemonic::Syscall) {
                        // A SYSCALL, whose R11 nobody fixed.
                        x.r11_fix.insert(lwpid);
                        x.in_syscall.insert(lwpid, before.rip + 2);
                    }
                }
                if at_patch {
                    // The instruction a system call returned to ran if the
                    // thread is past it: it is logged now, before the
                    // instruction under the jump, which is logged later.
                    // (Where the point is reached, an interrupt delivered
                    // there lets that one run before the next step, and
                    // its log came first: a gap in the trace.)
                    if let Some(ret) = x.in_syscall.get(&lwpid).copied().filter(|&r| r != rip) {
                        x.in_syscall.remove(&lwpid);
                        x.after_syscall(mem, cr3, lwpid, ret, user, sregs)?;
                        at.gprs[11] = user.r11;
                    }
                    // The jump of a trampoline searching for a point: the
                    // instruction it covers runs moved (next) or, where
                    // the point is reached, in place after the interrupt.
                    x.at_patch.insert(lwpid, at);
                } else if let Some((ip, bytes)) = moved {
                    // The first instruction the trampoline moved is
                    // logged here if the thread came to it through the
                    // trampoline's jump, or returning from a system call
                    // (not again in `after_syscall`). Resuming into the
                    // trampoline after a fault or an interrupt there, it
                    // was logged at the step before it.
                    let jumped = x.at_patch.remove(&lwpid).is_some();
                    let returned = x.in_syscall.get(&lwpid) == Some(&ip);
                    if returned {
                        x.in_syscall.remove(&lwpid);
                        if x.r11_fix.remove(&lwpid) {
                            user.r11 &= !TF;
                            at.gprs[11] = user.r11;
                        }
                    }
                    if jumped || returned || patch_rip != Some(ip) {
                        at.rip = ip;
                        let insn = instructions::decode(&bytes, ip);
                        x.log(lwpid, &at, &bytes, insn.as_ref())?;
                    }
                } else if !in_stub {
                    // The program's own code (other steps in the stub
                    // pages are the probe gate's or a trampoline's: left
                    // out). A thread still at the patched position has not
                    // run its instruction yet: it is logged below, once.
                    // (Where the point is reached, the trampoline's store
                    // leaves a single-step trap pending, taken back at the
                    // position.)
                    if let Some(before) = x.at_patch.remove(&lwpid).filter(ran) {
                        x.log_step(mem, cr3, lwpid, &before, false)?;
                    }
                    if let Some(ret) = x.in_syscall.remove(&lwpid) {
                        x.after_syscall(mem, cr3, lwpid, ret, user, sregs)?;
                        at.gprs[11] = user.r11;
                    }
                    let logged = x.log_step(mem, cr3, lwpid, &at, true)?;
                    if logged.is_some_and(|i| i.mnemonic() == iced_x86::Mnemonic::Syscall) {
                        // SYSCALL saves RFLAGS, the trap flag with it, in
                        // R11, where the program would see it: cleared
                        // at the system call's first exit
                        // (`arm_expansion`). An execve clears the flag:
                        // the thread is armed again at its exits until
                        // its next step.
                        x.r11_fix.insert(lwpid);
                        x.in_syscall.insert(lwpid, rip + 2);
                        x.stepping.remove(&lwpid);
                    } else {
                        next = logged;
                    }
                }
            }
            _ => {
                // Another process that inherited the flag (a fork's
                // child): let go.
                user.rflags &= !TF;
            }
        }
        let accesses = std::mem::take(&mut x.to_capture);
        let pid = x.stats.pid.unwrap_or(0);
        for (lwpid, rip, a, on_stack) in &accesses {
            let value = a.kind.value(a.size, *on_stack);
            events
                .capture
                .memory_access(at.guest_ns, (pid, *lwpid), *rip, a.addr, value)?;
        }
        Ok(next)
    }

    /// Whether the breakpoint on the #DB handler is armed (debug exits are
    /// then the tracer's).
    pub(crate) fn armed(&self) -> bool {
        self.how.handler.is_some()
    }

    /// The run ended: the traces are flushed.
    pub(crate) fn finish(&mut self) -> Result<(), VmError> {
        let x = self;
        let write = |e: std::io::Error| VmError::Expansion(format!("cannot write a trace: {e}"));
        if let Some(t) = &mut x.instructions {
            t.finish().map_err(write)?;
        }
        if let Some(t) = &mut x.memory {
            t.finish().map_err(write)?;
        }
        Ok(())
    }
}

/// The tracing of a process (with an event capture, which says which
/// task is on the CPU): armed at exits and probe events, stepped at debug
/// exits.
impl ReplayTool for ProcessTracer {
    fn exit(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
        kernel_entry: bool,
    ) -> Result<(), VmError> {
        match cx.events.as_deref() {
            Some(events) if kernel_entry => self.kernel_entry(m, events, cx.kernel_stack_top),
            _ => Ok(()),
        }
    }

    /// Sets the trap flag of the traced process's task on the CPU.
    fn exit_handled(&mut self, cx: &mut ToolContext, m: &mut Machine) -> Result<(), VmError> {
        match cx.events.as_deref() {
            Some(events) => {
                let exit = cx.log.position().exits;
                self.arm(m, events, cx.kernel_stack_top, exit)
            }
            None => Ok(()),
        }
    }

    /// A probe event: its task may be one to trace.
    fn gate_event(&mut self, cx: &mut ToolContext, m: &mut Machine) -> Result<(), VmError> {
        self.exit_handled(cx, m)
    }

    fn debug_armed(&self) -> bool {
        self.armed()
    }

    fn debug_exit(
        &mut self,
        cx: &mut ToolContext,
        m: &mut Machine,
    ) -> Result<Option<u64>, VmError> {
        // Its accesses happened at the time events raised now would have.
        let at = LogPosition {
            guest_ns: cx.event_ns(),
            ..cx.log.position()
        };
        match cx.events.as_deref_mut() {
            Some(events) => Ok(Some(self.step(m, events, cx.points, at)?)),
            None => Ok(None),
        }
    }

    fn stops_at_events(&self) -> bool {
        true
    }

    fn sets_trap_flag(&self) -> bool {
        true
    }

    fn report(&self, report: &mut ToolReport) {
        report.expansion = Some(self.stats());
    }

    fn finish(&mut self) -> Result<(), VmError> {
        ProcessTracer::finish(self)
    }
}

impl ProcessTracer {
    /// A step after a SYSCALL: if the guest kernel returned to `ret`
    /// (with the trap flag), the instruction there ran before this step.
    /// It is logged, its accesses computed from the registers after it
    /// (left out if it changed one its address uses). If R11 still holds
    /// the trap flag (the system call had no exit to clear it at), it
    /// loses it now, unless that instruction wrote R11.
    fn after_syscall(
        &mut self,
        mem: &vm_memory::GuestMemoryMmap,
        cr3: u64,
        lwpid: u32,
        ret: u64,
        user: &mut kvm_bindings::kvm_regs,
        sregs: &kvm_bindings::kvm_sregs,
    ) -> Result<(), VmError> {
        let mut at = UserRegs::from_kvm(user);
        (at.rip, at.fs_base, at.gs_base) = (ret, sregs.fs.base, sregs.gs.base);
        let (bytes, len) = read_instruction(mem, cr3, ret);
        let insn = instructions::decode(&bytes[..len], ret);
        let written = insn
            .as_ref()
            .map(|i| instructions::written_registers(&mut self.factory, i))
            .unwrap_or_default();
        let late_r11 = self.r11_fix.remove(&lwpid);
        // A system call that did not return there (execve, rt_sigreturn,
        // exit) left RCX other than its return address, which SYSCALL
        // put there.
        if user.rcx != ret && !written.contains(&iced_x86::Register::RCX) {
            self.stacks.moved(lwpid);
            return Ok(());
        }
        if late_r11 && !written.contains(&iced_x86::Register::R11) {
            user.r11 &= !TF;
        }
        let exact = insn
            .as_ref()
            .is_some_and(|i| !instructions::address_uses_any(&mut self.factory, i, &written));
        self.log(lwpid, &at, &bytes[..len], insn.as_ref().filter(|_| exact))
    }

    /// Logs the instruction the task `lwpid` is about to run (or, if its
    /// bytes are on a page not mapped yet and `may_wait`, keeps it for the
    /// thread's next step): the instruction, if logged whole and decoded.
    fn log_step(
        &mut self,
        mem: &vm_memory::GuestMemoryMmap,
        cr3: u64,
        lwpid: u32,
        regs: &UserRegs,
        may_wait: bool,
    ) -> Result<Option<iced_x86::Instruction>, VmError> {
        let (bytes, len) = read_instruction(mem, cr3, regs.rip);
        let insn = instructions::decode(&bytes[..len], regs.rip);
        // Cut short by an unmapped page: a prefix may decode as another
        // instruction, so only a whole one counts.
        if insn.is_none() && len < MAX_INSN || insn.is_some_and(|i| i.len() > len) {
            if may_wait {
                self.unread.insert(lwpid, *regs);
            } else {
                self.stats.unreadable += 1;
            }
            return Ok(None);
        }
        self.log(lwpid, regs, &bytes[..len], insn.as_ref())?;
        Ok(insn)
    }

    /// Writes one instruction (`bytes` read at `regs.rip`, decoded as
    /// `insn`) and, if it was decoded, its accesses.
    fn log(
        &mut self,
        lwpid: u32,
        regs: &UserRegs,
        bytes: &[u8],
        insn: Option<&iced_x86::Instruction>,
    ) -> Result<(), VmError> {
        if bytes.is_empty() {
            self.stats.unreadable += 1;
            return Ok(());
        }
        let insn_len = insn.map_or(bytes.len().min(1), |i| i.len());
        self.stats.instructions += 1;
        let write = |e: std::io::Error| VmError::Expansion(format!("cannot write a trace: {e}"));
        if let Some(t) = &mut self.instructions {
            t.push(lwpid, regs, &bytes[..insn_len]).map_err(write)?;
        }
        if let (Some(t), Some(insn)) = (&mut self.memory, insn) {
            self.stacks.saw(lwpid, regs.rsp());
            for access in instructions::accesses(&mut self.factory, insn, regs) {
                self.stats.accesses += 1;
                t.push(lwpid, regs.rip, &access, self.exit).map_err(write)?;
                let on_stack = self.stacks.holds(lwpid, regs.rsp(), access.addr);
                self.to_capture.push((lwpid, regs.rip, access, on_stack));
            }
        }
        Ok(())
    }
}

/// The bytes at user address `rip` (up to 15; fewer where the process
/// has not mapped the next page) and how many could be read.
fn read_instruction(
    mem: &vm_memory::GuestMemoryMmap,
    cr3: u64,
    rip: u64,
) -> ([u8; MAX_INSN], usize) {
    let mut bytes = [0u8; MAX_INSN];
    let first = ((0x1000 - (rip & 0xfff)) as usize).min(MAX_INSN);
    let mut len = 0;
    if gva::read_virt(mem, cr3, rip, &mut bytes[..first]).is_ok() {
        len = first;
        if first < MAX_INSN
            && gva::read_virt(mem, cr3, rip + first as u64, &mut bytes[first..]).is_ok()
        {
            len = MAX_INSN;
        }
    }
    (bytes, len)
}
