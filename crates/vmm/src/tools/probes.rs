//! Probes given at replay (`insight replay --probe`, docs/probes.md):
//! breakpoints a process-control engine of their own (`tools::control`)
//! puts in the code of the processes they go into, whose hits become
//! PROBE and PROBE_RET events with the values each probe captures. Nothing of this exists
//! while recording: the replay alone pays, two exits a hit (the `int3`,
//! and the step over the instruction under it).
//!
//! A `return` probe also stops at the function's entry, where it takes
//! the arguments and puts a breakpoint at the return address; the return
//! is that thread's arrival there with the stack pointer just above the
//! entry's (so that recursion and other threads passing the same address
//! are told apart). A call left by `longjmp` or an exception is dropped
//! when the thread returns to an outer frame.

use std::collections::HashMap;

use events::abi::Kind;
use events::db::{ProbeRow, ProbeValue};
use events::probe_spec::{
    CaptureItem, ProbeAt, ProbeSpec, ARG_REGISTERS, MAX_CAPTURE_BYTES, MAX_STRING,
};
use kvm_bindings::kvm_regs;

use super::control::tasks::{auxv_value, AT_ENTRY, AT_PHDR, AT_PHNUM};
use super::control::{
    Advance, Arming, BreakpointHit, Control, KernelPoints, ProcessInfo, ProcessSelector, Scope,
    Supervisor, Verdict,
};
use super::events::EventTool;
use crate::points::PointSearch;
use crate::vm::{Machine, VmError};

/// The probes a replay arms, resolved against the recording's files.
#[derive(Clone, Debug)]
pub struct ProbePlan {
    /// The program the probes in an executable name functions of: its
    /// path in the guest.
    pub exe_path: String,
    /// Its ELF entry point (its load bias is where the kernel says the
    /// program starts, less this).
    pub exe_entry: u64,
    pub probes: Vec<PlannedProbe>,
}

/// One probe: its number, its spec, where it goes in its object (before
/// the object's load bias), and which processes it goes into.
#[derive(Clone, Debug)]
pub struct PlannedProbe {
    pub id: u32,
    pub spec: ProbeSpec,
    /// The shared library it goes into (its guest path), or `None`: the
    /// executable.
    pub object: Option<String>,
    pub site: u64,
    /// The global variables it captures or compares: their addresses in
    /// the object and sizes (1 to 8 bytes).
    pub globals: Vec<(String, u64, u8)>,
    /// The processes it goes into, each from the start of a program it
    /// executes (a probe in the executable: those that execute the plan's
    /// program).
    pub process: ProcessSelector,
}

impl PlannedProbe {
    /// How the event database names it, with its value slots: the
    /// captures, then for a `return` probe the call's duration.
    pub fn row(&self) -> ProbeRow {
        let mut captures = self.spec.capture_names();
        if self.spec.at == ProbeAt::Return {
            captures.push(DURATION.to_owned());
        }
        ProbeRow {
            id: self.id,
            spec: self.spec.text.clone(),
            captures,
        }
    }
}

/// The most calls of `return` probes one thread may have under way; a
/// deeper one is counted as an anomaly and not reported.
const MAX_PENDING_CALLS: usize = 100_000;

/// The name of a return probe's last value slot.
pub const DURATION: &str = "duration_ns";

/// A call of a `return` probe's function, until it returns.
struct PendingCall {
    probe: usize,
    /// The followed address space whose breakpoint waits at its return.
    space: u64,
    /// The stack pointer at the entry (at the return address).
    rsp: u64,
    /// The function's address and the return address.
    function: u64,
    returns_to: u64,
    /// What was captured at the entry, by slot.
    values: Vec<(u32, ProbeValue)>,
    /// Its entry's time.
    start_ns: u64,
}

/// A process the probes go into, from the start of its program.
struct Followed {
    pid: u32,
    /// The program as it executed it, and whether it is the plan's.
    exe: String,
    runs_program: bool,
    /// Which of the plan's probes go into it.
    probes: Vec<bool>,
    /// The executable's load bias, and its dynamic section (`None`: a
    /// static program, or not known yet).
    bias: Option<u64>,
    dynamic: Option<u64>,
    /// Its program headers were read (the dynamic linker reads them
    /// first: they are not in memory at the start).
    headers_read: bool,
    auxv: Vec<u8>,
    /// The libraries found loaded: (path, load bias).
    libraries: Vec<(String, u64)>,
    /// Breakpoints at return addresses, with how many calls wait there.
    return_sites: HashMap<u64, usize>,
}

/// A breakpoint hit of a followed process: the thread and its user
/// registers at the breakpoint's address, the instruction not run yet.
#[derive(Clone, Copy, Debug)]
struct ProbeHit {
    pid: u32,
    lwpid: u32,
    /// The address space of its process.
    cr3: u64,
    /// The address space of the followed process whose breakpoint it is:
    /// `cr3`, or its parent's for a child it forked.
    space: u64,
    regs: kvm_regs,
}

/// What the engine tells of the guest's processes.
#[derive(Clone, Debug)]
enum ProcessChange {
    /// A process started a program (at its first instruction, nothing of
    /// it run yet).
    Started(ProcessInfo),
    /// A followed process ended, or executed another program (whose start
    /// comes next).
    Ended { cr3: u64 },
    /// A followed process (its address space `parent`) forked a child,
    /// followed from its first return to user mode: its memory is a copy
    /// of its parent's.
    Forked { pid: u32, cr3: u64, parent: u64 },
}

/// The engine's supervisor for the probes: every thread passes its
/// breakpoints, each hit of a followed process kept with its registers,
/// and the process changes with them, until the tool looks.
#[derive(Default)]
struct Collected {
    hits: Vec<ProbeHit>,
    changes: Vec<ProcessChange>,
}

impl Supervisor for Collected {
    fn breakpoint(&mut self, _control: &Control, hit: &BreakpointHit) -> Verdict {
        if let (Some(space), Some((pid, lwpid))) = (hit.space, hit.task) {
            self.hits.push(ProbeHit {
                pid,
                lwpid,
                cr3: hit.cr3,
                space,
                regs: hit.regs,
            });
        }
        Verdict::Pass
    }

    fn started(
        &mut self,
        _control: &Control,
        _m: &Machine,
        process: &ProcessInfo,
    ) -> Result<(), VmError> {
        self.changes.push(ProcessChange::Started(process.clone()));
        Ok(())
    }

    fn ended(&mut self, cr3: u64) {
        self.changes.push(ProcessChange::Ended { cr3 });
    }

    fn forked(&mut self, pid: u32, cr3: u64, parent: u64) {
        self.changes
            .push(ProcessChange::Forked { pid, cr3, parent });
    }
}

/// The probes' tool on a replay: an engine of its own, which tells every
/// program a process starts and follows the processes the probes go
/// into, and the probes' state, which makes the hits events.
pub(crate) struct ProbeTool {
    control: Control,
    collected: Collected,
    state: ProbeState,
}

impl ProbeTool {
    pub(crate) fn new(plan: &ProbePlan, kernel: KernelPoints) -> Self {
        ProbeTool {
            control: Control::new(Scope::Every, kernel),
            collected: Collected::default(),
            state: ProbeState::new(plan),
        }
    }

    /// The replay is ready to run: the engine follows programs and
    /// collects hits from here to the replay's end, never stopping.
    pub(crate) fn start(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.control.prepare(m, Arming::OWN, None)?;
        self.control.update_returns(m)
    }

    /// After every deterministic exit and asynchronous point (`advance`):
    /// the engine moves on; after an exit, the processes followed are
    /// looked at (`ProbeState::advanced`).
    pub(crate) fn advanced(
        &mut self,
        m: &mut Machine,
        advance: Advance,
        events: Option<&mut EventTool>,
    ) -> Result<(), VmError> {
        let c = &mut self.control;
        c.advanced(m, advance, &mut self.collected)?;
        c.settle(m, Arming::OWN)?;
        match (advance, events) {
            (Advance::Exit { .. }, Some(events)) => {
                let changes = std::mem::take(&mut self.collected.changes);
                self.state.advanced(m, c, changes, events)
            }
            _ => Ok(()),
        }
    }

    /// A debug exit: one of the engine's kernel breakpoints; the hits it
    /// collected become events at the replay's event time `ns`.
    pub(crate) fn debug_exit(
        &mut self,
        m: &mut Machine,
        search: &PointSearch,
        events: Option<&mut EventTool>,
        ns: u64,
    ) -> Result<(), VmError> {
        let c = &mut self.control;
        c.debug_exit(m, search, &mut self.collected)?;
        let Some(events) = events else {
            return Ok(());
        };
        let changes = std::mem::take(&mut self.collected.changes);
        let hits = std::mem::take(&mut self.collected.hits);
        self.state.collect(m, c, changes, hits, events, ns)
    }

    /// The guest kernel raised an event: a followed process may have
    /// ended.
    pub(crate) fn kernel_event(&mut self, m: &mut Machine) -> Result<(), VmError> {
        self.control.kernel_event(m, &mut self.collected)
    }

    /// A trampoline's patch covers `patched` now (`None`: no more).
    pub(crate) fn patched(&mut self, m: &Machine, patched: Option<(u64, u64, u64)>) {
        self.control.patched(m, patched);
    }

    /// Takes every breakpoint out of guest memory.
    pub(crate) fn lift_breakpoints(&mut self, mem: &vm_memory::GuestMemoryMmap) {
        self.control.lift_breakpoints(mem);
    }

    /// The original bytes of the breakpoints in guest memory.
    pub(crate) fn originals(&self) -> Vec<(u64, Vec<u8>)> {
        self.control.originals()
    }

    /// The guest kernel announced its context-switch ring at `gpa`.
    pub(crate) fn ring_announced(&mut self, mem: &vm_memory::GuestMemoryMmap, gpa: u64) {
        self.control.ring_announced(mem, gpa);
    }
}

/// The probes' state in a replay.
struct ProbeState {
    probes: Vec<PlannedProbe>,
    exe_path: String,
    exe_entry: u64,
    /// The processes followed, by address space.
    followed: HashMap<u64, Followed>,
    /// Calls of `return` probes under way, per thread, innermost last.
    calls: HashMap<u32, Vec<PendingCall>>,
    /// The processes whose objects the events tool was told of.
    announced: Vec<u32>,
}

impl ProbeState {
    fn new(plan: &ProbePlan) -> Self {
        ProbeState {
            probes: plan.probes.clone(),
            exe_path: plan.exe_path.clone(),
            exe_entry: plan.exe_entry,
            followed: HashMap::new(),
            calls: HashMap::new(),
            announced: Vec::new(),
        }
    }

    /// Turns the hits the engine collected into events, at the replay's
    /// event time `ns`, after the process changes told with them. The hit
    /// thread still stands where it hit (nothing ran since).
    fn collect(
        &mut self,
        m: &mut Machine,
        control: &mut Control,
        changes: Vec<ProcessChange>,
        hits: Vec<ProbeHit>,
        events: &mut EventTool,
        ns: u64,
    ) -> Result<(), VmError> {
        let mut changed = self.processes_changed(control, changes);
        for hit in &hits {
            self.announce(m, control, events, hit)?;
        }
        for hit in hits {
            changed |= self.returned(m, control, events, ns, &hit)?;
            changed |= self.entered(m, control, events, ns, &hit)?;
        }
        if changed {
            control.breakpoints_changed(m)?;
        }
        Ok(())
    }

    /// Looks at the programs started and the followed processes ended:
    /// a process that executes a program some probes go into is
    /// followed, with the breakpoints of its executable's probes in
    /// place before its first instruction. Whether breakpoints changed.
    fn processes_changed(&mut self, control: &mut Control, changes: Vec<ProcessChange>) -> bool {
        let mut changed = false;
        for change in changes {
            match change {
                ProcessChange::Started(info) => changed |= self.started(control, &info),
                ProcessChange::Forked { pid, cr3, parent } => {
                    changed |= self.forked(control, pid, cr3, parent)
                }
                ProcessChange::Ended { cr3 } => {
                    self.followed.remove(&cr3);
                    self.calls.retain(|_, calls| {
                        calls.retain(|c| c.space != cr3);
                        !calls.is_empty()
                    });
                }
            }
        }
        changed
    }

    fn started(&mut self, control: &mut Control, info: &ProcessInfo) -> bool {
        let exe_file = self.exe_path.rsplit('/').next().unwrap_or(&self.exe_path);
        let runs_program = crate::tools::exec::program_named(&info.exe, exe_file);
        let probes: Vec<bool> = (self.probes.iter())
            .map(|p| p.process.matches(info.pid, &info.exe) && (p.object.is_some() || runs_program))
            .collect();
        if !probes.iter().any(|&p| p) {
            return false;
        }
        let bias = auxv_value(&info.auxv, AT_ENTRY)
            .map(|e| e.wrapping_sub(self.exe_entry))
            .filter(|_| runs_program);
        control.follow(info.pid, info.cr3);
        let mut changed = false;
        if let Some(bias) = bias.filter(|_| runs_program) {
            for (_, p) in
                (self.probes.iter().enumerate()).filter(|&(i, p)| probes[i] && p.object.is_none())
            {
                control.add_breakpoint_in(info.cr3, p.site.wrapping_add(bias));
                changed = true;
            }
        }
        let exe = match runs_program {
            true => self.exe_path.clone(),
            false => info.exe.clone(),
        };
        self.followed.insert(
            info.cr3,
            Followed {
                pid: info.pid,
                exe,
                runs_program,
                probes,
                bias,
                dynamic: None,
                headers_read: false,
                auxv: info.auxv.clone(),
                libraries: Vec::new(),
                return_sites: HashMap::new(),
            },
        );
        changed
    }

    /// A followed process forked a child, now on its own: the same probes
    /// go into it, at the same addresses, while it runs (also after its
    /// parent ended).
    fn forked(&mut self, control: &mut Control, pid: u32, cr3: u64, parent: u64) -> bool {
        let Some(p) = self.followed.get(&parent) else {
            control.unfollow(pid);
            return false;
        };
        let child = Followed {
            pid,
            exe: p.exe.clone(),
            runs_program: p.runs_program,
            probes: p.probes.clone(),
            bias: p.bias,
            dynamic: p.dynamic,
            headers_read: p.headers_read,
            auxv: p.auxv.clone(),
            libraries: p.libraries.clone(),
            return_sites: HashMap::new(),
        };
        let bases = bases(&self.probes, &child);
        for (probe, base) in self.probes.iter().zip(&bases) {
            if let Some(base) = base {
                control.add_breakpoint_in(cr3, probe.site.wrapping_add(*base));
            }
        }
        self.followed.insert(cr3, child);
        bases.iter().any(Option::is_some)
    }

    /// The first hit of a process: its objects go to the events tool, for
    /// its stacks and symbols (the executable where the probed process
    /// has it, the libraries where its own dynamic linker's list says).
    fn announce(
        &mut self,
        m: &Machine,
        control: &Control,
        events: &mut EventTool,
        hit: &ProbeHit,
    ) -> Result<(), VmError> {
        if self.announced.contains(&hit.pid) {
            return Ok(());
        }
        self.announced.push(hit.pid);
        let Some(f) = self.followed.get(&hit.space) else {
            return Ok(());
        };
        let Some(bias) = f.bias else {
            return Ok(());
        };
        events.executable_seen(hit.pid, bias, &f.exe)?;
        if let Some(dynamic) = f.dynamic {
            let read = |va, buf: &mut [u8]| control.read_in(m, hit.cr3, va, buf);
            for (path, base) in loaded_libraries(&read, dynamic) {
                if !path.is_empty() {
                    events.executable_seen(hit.pid, base, &path)?;
                }
            }
        }
        Ok(())
    }

    /// After a deterministic exit or asynchronous point with a task of a
    /// followed process on the CPU: while a probe's library is not known
    /// to be loaded in that process, the dynamic linker's list of its libraries (`r_debug`, through the
    /// executable's `DT_DEBUG`) is read, and the probes of the libraries
    /// found in it go in, with the libraries' objects for stacks and
    /// symbols.
    fn advanced(
        &mut self,
        m: &mut Machine,
        control: &mut Control,
        changes: Vec<ProcessChange>,
        events: &mut EventTool,
    ) -> Result<(), VmError> {
        let mut added = self.processes_changed(control, changes);
        let mut unfollowed = Vec::new();
        // Only a process's own tasks change its memory's headers and list.
        let current = control.current_pid();
        for (&cr3, f) in &mut self.followed {
            if current != Some(f.pid) {
                continue;
            }
            if !f.headers_read {
                let read = |va, buf: &mut [u8]| control.read_in(m, cr3, va, buf);
                let Some((bias, dynamic)) = loaded_program(&read, &f.auxv) else {
                    continue;
                };
                f.headers_read = true;
                f.bias = f.bias.or(bias);
                f.dynamic = dynamic;
                // A static program runs no library code: a process only
                // library probes go into has nothing for them.
                let in_executable = (self.probes.iter().enumerate())
                    .any(|(i, p)| f.probes[i] && p.object.is_none());
                if dynamic.is_none() && !in_executable {
                    unfollowed.push((cr3, f.pid));
                }
            }
            let Some(dynamic) = f.dynamic else {
                continue;
            };
            let waiting = (self.probes.iter().enumerate())
                .filter(|&(i, _)| f.probes[i])
                .filter_map(|(_, p)| p.object.as_deref())
                .any(|o| library_base(&f.libraries, o).is_none());
            if !waiting {
                continue;
            }
            let found = loaded_libraries(&|va, buf| control.read_in(m, cr3, va, buf), dynamic);
            for (path, base) in found {
                if path.is_empty() || f.libraries.iter().any(|l| l.0 == path) {
                    continue;
                }
                if self.announced.contains(&f.pid) {
                    events.executable_seen(f.pid, base, &path)?;
                }
                for (_, probe) in (self.probes.iter().enumerate()).filter(|&(i, p)| {
                    f.probes[i] && p.object.as_deref().is_some_and(|o| same_object(&path, o))
                }) {
                    control.add_breakpoint_in(cr3, base.wrapping_add(probe.site));
                    added = true;
                }
                f.libraries.push((path, base));
            }
        }
        for (cr3, pid) in unfollowed {
            self.followed.remove(&cr3);
            control.unfollow(pid);
        }
        if added {
            control.breakpoints_changed(m)?;
        }
        Ok(())
    }

    /// A hit at the entry of probed functions; whether a return
    /// breakpoint went in.
    fn entered(
        &mut self,
        m: &Machine,
        control: &mut Control,
        events: &mut EventTool,
        ns: u64,
        hit: &ProbeHit,
    ) -> Result<bool, VmError> {
        let Some(f) = self.followed.get(&hit.space) else {
            return Ok(false);
        };
        let bases = bases(&self.probes, f);
        let va = hit.regs.rip;
        let mut added = false;
        for (index, probe) in self.probes.iter().enumerate() {
            let Some(bias) = bases[index].filter(|b| probe.site.wrapping_add(*b) == va) else {
                continue;
            };
            let reader = Reader {
                m,
                control,
                cr3: hit.cr3,
                bias,
            };
            let returns_to = reader.read_u64(hit.regs.rsp).unwrap_or(0);
            match probe.spec.at {
                ProbeAt::Entry => {
                    let values = capture(&reader, probe, &hit.regs, Phase::Entry);
                    if !holds(&reader, probe, &hit.regs, &values, None) {
                        continue;
                    }
                    events.probe_hit(
                        m,
                        ns,
                        (hit.pid, hit.lwpid),
                        Kind::Probe,
                        probe.id,
                        (va, Some(returns_to)),
                        &values,
                        wants_stack(probe).then_some(&hit.regs),
                    )?;
                }
                ProbeAt::Return => {
                    let pending = self.calls.entry(hit.lwpid).or_default();
                    if pending.len() >= MAX_PENDING_CALLS {
                        events.capture.probe_call_untracked(format!(
                            "probe {} in lwpid {}: {MAX_PENDING_CALLS} calls under way",
                            probe.id, hit.lwpid
                        ));
                        continue;
                    }
                    let values = capture(&reader, probe, &hit.regs, Phase::Entry);
                    pending.push(PendingCall {
                        probe: index,
                        space: hit.space,
                        rsp: hit.regs.rsp,
                        function: va,
                        returns_to,
                        values,
                        start_ns: ns,
                    });
                    let f = self.followed.get_mut(&hit.space).expect("followed");
                    let waiting = f.return_sites.entry(returns_to).or_insert(0);
                    if *waiting == 0 {
                        control.add_breakpoint_in(hit.space, returns_to);
                        added = true;
                    }
                    *waiting += 1;
                }
            }
        }
        Ok(added)
    }

    /// A hit where calls of the thread may return; whether a return
    /// breakpoint came out.
    fn returned(
        &mut self,
        m: &Machine,
        control: &mut Control,
        events: &mut EventTool,
        ns: u64,
        hit: &ProbeHit,
    ) -> Result<bool, VmError> {
        let (Some(calls), Some(f)) = (
            self.calls.get_mut(&hit.lwpid),
            self.followed.get_mut(&hit.space),
        ) else {
            return Ok(false);
        };
        let (va, rsp) = (hit.regs.rip, hit.regs.rsp);
        let mut ended = Vec::new();
        // The calls this return leaves: the innermost ones whose frames
        // are at or below the stack pointer now.
        while let Some(call) = calls.last() {
            if call.rsp.wrapping_add(8) > rsp {
                break;
            }
            ended.push(calls.pop().expect("a call"));
        }
        if calls.is_empty() {
            self.calls.remove(&hit.lwpid);
        }
        let bases = bases(&self.probes, f);
        let mut removed = false;
        let is_site = |va: u64| {
            (self.probes.iter().zip(&bases))
                .any(|(p, b)| b.is_some_and(|b| p.site.wrapping_add(b) == va))
        };
        for call in ended {
            let waiting = f.return_sites.entry(call.returns_to).or_insert(1);
            *waiting -= 1;
            if *waiting == 0 {
                f.return_sites.remove(&call.returns_to);
                if !is_site(call.returns_to) {
                    control.remove_breakpoint_in(hit.space, call.returns_to);
                }
                removed = true;
            }
            // A frame left without returning (longjmp, an exception):
            // no return.
            if call.rsp.wrapping_add(8) != rsp || call.returns_to != va {
                continue;
            }
            let probe = &self.probes[call.probe];
            let bias = bases[call.probe].unwrap_or(0);
            let reader = Reader {
                m,
                control,
                cr3: hit.cr3,
                bias,
            };
            let mut values = call.values;
            values.extend(capture(&reader, probe, &hit.regs, Phase::Return));
            let duration = ns.saturating_sub(call.start_ns);
            values.push((
                probe.spec.captures.len() as u32,
                ProbeValue::Int(duration as i64),
            ));
            values.sort_by_key(|(slot, _)| *slot);
            if !holds(&reader, probe, &hit.regs, &values, Some(hit.regs.rax)) {
                continue;
            }
            events.probe_hit(
                m,
                ns,
                (hit.pid, hit.lwpid),
                Kind::ProbeReturn,
                probe.id,
                (call.function, Some(call.returns_to)),
                &values,
                wants_stack(probe).then_some(&hit.regs),
            )?;
        }
        Ok(removed)
    }
}

/// When a value is taken: a `return` probe takes its arguments, memory
/// and variables at the entry, its registers and return value at the
/// return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Entry,
    Return,
}

fn taken_at(item: &CaptureItem, at: ProbeAt) -> Phase {
    match (item, at) {
        (CaptureItem::Retval | CaptureItem::Reg(_), ProbeAt::Return) => Phase::Return,
        _ => Phase::Entry,
    }
}

/// Reads the memory of a hit's process as its program sees it; `bias`:
/// the load bias of the probe's object.
struct Reader<'a> {
    m: &'a Machine,
    control: &'a Control,
    cr3: u64,
    bias: u64,
}

impl Reader<'_> {
    fn read(&self, va: u64, buf: &mut [u8]) -> usize {
        self.control.read_in(self.m, self.cr3, va, buf)
    }

    fn read_u64(&self, va: u64) -> Option<u64> {
        let mut buf = [0u8; 8];
        (self.read(va, &mut buf) == 8).then(|| u64::from_le_bytes(buf))
    }

    fn global(&self, probe: &PlannedProbe, name: &str) -> Option<i64> {
        let &(_, rel, size) = probe.globals.iter().find(|g| g.0 == name)?;
        let mut buf = [0u8; 8];
        let size = usize::from(size.clamp(1, 8));
        (self.read(rel.wrapping_add(self.bias), &mut buf[..size]) == size)
            .then(|| i64::from_le_bytes(buf))
    }
}

/// The general-purpose registers in [`events::probe_spec::REGISTERS`]
/// order.
fn register(regs: &kvm_regs, index: usize) -> u64 {
    [
        regs.rax, regs.rcx, regs.rdx, regs.rbx, regs.rsp, regs.rbp, regs.rsi, regs.rdi, regs.r8,
        regs.r9, regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15, regs.rip,
    ][index]
}

fn arg(regs: &kvm_regs, n: u8) -> u64 {
    register(regs, ARG_REGISTERS[usize::from(n)])
}

/// The values of `probe` taken at `phase`, by slot; an unreadable
/// variable or memory is left out.
fn capture(
    reader: &Reader,
    probe: &PlannedProbe,
    regs: &kvm_regs,
    phase: Phase,
) -> Vec<(u32, ProbeValue)> {
    let mut out = Vec::new();
    for (slot, item) in probe.spec.captures.iter().enumerate() {
        if taken_at(item, probe.spec.at) != phase {
            continue;
        }
        let value = match item {
            CaptureItem::Arg(n) => Some(ProbeValue::Int(arg(regs, *n) as i64)),
            CaptureItem::Retval => Some(ProbeValue::Int(regs.rax as i64)),
            CaptureItem::Reg(i) => Some(ProbeValue::Int(register(regs, *i) as i64)),
            CaptureItem::Global(name) => reader.global(probe, name).map(ProbeValue::Int),
            CaptureItem::Mem { arg: n, len } => {
                let mut buf = vec![0u8; (*len).min(MAX_CAPTURE_BYTES) as usize];
                let got = reader.read(arg(regs, *n), &mut buf);
                buf.truncate(got);
                Some(ProbeValue::Bytes(buf))
            }
            CaptureItem::Str(n) => {
                let mut buf = vec![0u8; MAX_STRING as usize];
                let got = reader.read(arg(regs, *n), &mut buf);
                buf.truncate(got);
                if let Some(end) = buf.iter().position(|&b| b == 0) {
                    buf.truncate(end);
                }
                Some(ProbeValue::Bytes(buf))
            }
            // The event's stack, not a value.
            CaptureItem::Ustack => None,
        };
        if let Some(v) = value {
            out.push((slot as u32, v));
        }
    }
    out
}

/// Whether the probe's condition holds (no condition: it does), with the
/// values captured, the registers at the hit and the return value (at a
/// return).
fn holds(
    reader: &Reader,
    probe: &PlannedProbe,
    regs: &kvm_regs,
    values: &[(u32, ProbeValue)],
    retval: Option<u64>,
) -> bool {
    let Some(c) = &probe.spec.condition else {
        return true;
    };
    // A captured value first (arguments of a return probe are the
    // entry's), else the hit's registers.
    let captured = probe
        .spec
        .captures
        .iter()
        .position(|i| *i == c.operand)
        .and_then(|slot| values.iter().find(|(s, _)| *s == slot as u32))
        .and_then(|(_, v)| match v {
            ProbeValue::Int(v) => Some(*v),
            ProbeValue::Bytes(_) => None,
        });
    let value = captured.or_else(|| match &c.operand {
        CaptureItem::Arg(n) => Some(arg(regs, *n) as i64),
        CaptureItem::Retval => retval.map(|r| r as i64),
        CaptureItem::Reg(i) => Some(register(regs, *i) as i64),
        CaptureItem::Global(name) => reader.global(probe, name),
        _ => None,
    });
    value.is_some_and(|v| c.op.holds(v, c.value))
}

/// Each probe's object's load bias in the followed process `f`, where
/// known and where the probe goes into it.
fn bases(probes: &[PlannedProbe], f: &Followed) -> Vec<Option<u64>> {
    (probes.iter().enumerate())
        .map(|(i, p)| match &p.object {
            _ if !f.probes[i] => None,
            None => f.bias.filter(|_| f.runs_program),
            Some(path) => library_base(&f.libraries, path),
        })
        .collect()
}

/// The load bias of a library a probe names (`object`) in a process's
/// list of loaded libraries.
fn library_base(libraries: &[(String, u64)], object: &str) -> Option<u64> {
    (libraries.iter())
        .find(|(p, _)| same_object(p, object))
        .map(|&(_, base)| base)
}

/// Program header types.
const PT_DYNAMIC: u32 = 2;
const PT_PHDR: u32 = 6;
/// The size of an `Elf64_Phdr`, and the most read.
const PHDR_SIZE: usize = 56;
const MAX_PHDRS: u64 = 128;

/// A program, from its auxiliary vector and its program headers in
/// memory (read with `read`), as the dynamic linker finds itself: its
/// load bias (where the headers are, less where `PT_PHDR` says they are)
/// and its dynamic section (`None`: a static program). `None` while the
/// headers are not in memory.
fn loaded_program(
    read: &dyn Fn(u64, &mut [u8]) -> usize,
    auxv: &[u8],
) -> Option<(Option<u64>, Option<u64>)> {
    let (Some(phdr), Some(phnum)) = (auxv_value(auxv, AT_PHDR), auxv_value(auxv, AT_PHNUM)) else {
        return Some((None, None));
    };
    let mut headers = vec![0u8; PHDR_SIZE * phnum.min(MAX_PHDRS) as usize];
    if read(phdr, &mut headers) < headers.len() {
        return None;
    }
    let field =
        |h: &[u8], at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
    let of_type = |t: u32| {
        headers
            .chunks_exact(PHDR_SIZE)
            .find(|h| u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) == t)
            .map(|h| field(h, 16))
    };
    let Some(bias) = of_type(PT_PHDR).map(|vaddr| phdr.wrapping_sub(vaddr)) else {
        return Some((None, None));
    };
    Some((
        Some(bias),
        of_type(PT_DYNAMIC).map(|v| bias.wrapping_add(v)),
    ))
}

/// Whether the dynamic linker's name of a library (`path`) is the one a
/// probe names (`object`: a path, or a file name).
fn same_object(path: &str, object: &str) -> bool {
    let name = |p: &str| p.rsplit('/').next().unwrap_or(p).to_owned();
    path == object || name(path) == name(object)
}

/// `DT_DEBUG`, the dynamic-section tag whose value the dynamic linker
/// sets to its `r_debug`.
const DT_DEBUG: u64 = 21;
/// The most dynamic entries and libraries read.
const MAX_DYNAMIC: u64 = 256;
const MAX_LIBRARIES: usize = 1024;

/// The libraries in the dynamic linker's list of a process whose
/// executable's dynamic section is at `dynamic`, read with `read`:
/// (path, load bias). Empty until the dynamic linker has made the list;
/// a list the program damaged ends where it stops making sense.
fn loaded_libraries(read: &dyn Fn(u64, &mut [u8]) -> usize, dynamic: u64) -> Vec<(String, u64)> {
    let u64_at = |va: u64| {
        let mut b = [0u8; 8];
        (read(va, &mut b) == 8).then(|| u64::from_le_bytes(b))
    };
    let mut r_debug = None;
    for i in 0..MAX_DYNAMIC {
        let at = dynamic.wrapping_add(16 * i);
        match u64_at(at) {
            Some(0) | None => break,
            Some(DT_DEBUG) => {
                r_debug = u64_at(at.wrapping_add(8));
                break;
            }
            Some(_) => {}
        }
    }
    let Some(r_debug) = r_debug.filter(|&r| r != 0) else {
        return Vec::new();
    };
    // struct r_debug { int r_version; struct link_map *r_map; ... }
    let mut map = u64_at(r_debug.wrapping_add(8)).unwrap_or(0);
    let mut out = Vec::new();
    while map != 0 && out.len() < MAX_LIBRARIES {
        // struct link_map { l_addr; char *l_name; l_ld; l_next; l_prev }
        let (Some(base), Some(name_at), Some(next)) = (
            u64_at(map),
            u64_at(map.wrapping_add(8)),
            u64_at(map.wrapping_add(24)),
        ) else {
            break;
        };
        let mut name = vec![0u8; 512];
        let n = if name_at == 0 {
            0
        } else {
            read(name_at, &mut name)
        };
        name.truncate(n);
        if let Some(end) = name.iter().position(|&b| b == 0) {
            name.truncate(end);
        }
        out.push((String::from_utf8_lossy(&name).into_owned(), base));
        map = next;
    }
    out
}

fn wants_stack(probe: &PlannedProbe) -> bool {
    probe.spec.captures.contains(&CaptureItem::Ustack)
}

/// The probes of a spec list as the database declares them.
pub fn probe_rows(plan: &ProbePlan) -> Vec<ProbeRow> {
    plan.probes.iter().map(PlannedProbe::row).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(text: &str) -> PlannedProbe {
        PlannedProbe {
            id: 3,
            spec: ProbeSpec::parse(text).unwrap(),
            object: None,
            site: 0x1130,
            globals: Vec::new(),
            process: ProcessSelector::Any,
        }
    }

    #[test]
    fn return_probes_take_their_duration_in_the_last_slot() {
        let row = planned("work return capture arg0, retval").row();
        assert_eq!(row.captures, ["arg0", "retval", DURATION]);
        assert_eq!(row.id, 3);
        assert_eq!(planned("work capture arg1").row().captures, ["arg1"]);
    }

    /// Reads from `mem` as if it were mapped at address 0.
    fn reader(mem: Vec<u8>) -> impl Fn(u64, &mut [u8]) -> usize {
        move |va: u64, buf: &mut [u8]| {
            let at = (va as usize).min(mem.len());
            let n = buf.len().min(mem.len() - at);
            buf[..n].copy_from_slice(&mem[at..at + n]);
            n
        }
    }

    #[test]
    fn libraries_are_read_from_the_dynamic_linkers_list() {
        // Dynamic section at 0x1000: DT_NEEDED, DT_DEBUG -> r_debug at
        // 0x2000, whose r_map lists the executable ("") and libc.
        let mut mem = vec![0u8; 0x4000];
        let put = |mem: &mut Vec<u8>, at: usize, v: u64| {
            mem[at..at + 8].copy_from_slice(&v.to_le_bytes())
        };
        put(&mut mem, 0x1000, 1);
        put(&mut mem, 0x1008, 7);
        put(&mut mem, 0x1010, DT_DEBUG);
        put(&mut mem, 0x1018, 0x2000);
        put(&mut mem, 0x2008, 0x2100);
        put(&mut mem, 0x2100, 0x5555_0000);
        put(&mut mem, 0x2108, 0x3000);
        put(&mut mem, 0x2118, 0x2200);
        put(&mut mem, 0x2200, 0x7f00_0000);
        put(&mut mem, 0x2208, 0x3010);
        let path = b"/lib/x86_64-linux-gnu/libc.so.6\0";
        mem[0x3010..0x3010 + path.len()].copy_from_slice(path);
        let mut early = mem.clone();
        assert_eq!(
            loaded_libraries(&reader(mem), 0x1000),
            [
                (String::new(), 0x5555_0000),
                ("/lib/x86_64-linux-gnu/libc.so.6".to_owned(), 0x7f00_0000)
            ]
        );
        // Before the dynamic linker set DT_DEBUG: nothing.
        early[0x1018..0x1020].fill(0);
        assert!(loaded_libraries(&reader(early), 0x1000).is_empty());
        // A list that loops on itself ends.
        let mut looped = vec![0u8; 0x4000];
        put(&mut looped, 0x1000, DT_DEBUG);
        put(&mut looped, 0x1008, 0x2000);
        put(&mut looped, 0x2008, 0x2100);
        put(&mut looped, 0x2118, 0x2100);
        assert_eq!(
            loaded_libraries(&reader(looped), 0x1000).len(),
            MAX_LIBRARIES
        );
        assert!(same_object("/lib/x86_64-linux-gnu/libc.so.6", "libc.so.6"));
        assert!(same_object(
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/lib/x86_64-linux-gnu/libc.so.6"
        ));
        assert!(!same_object("/lib/libm.so.6", "libc.so.6"));
    }

    #[test]
    fn a_program_finds_its_bias_and_dynamic_section_in_its_headers() {
        // Program headers at 0x5555_0040 (PT_PHDR says 0x40): PT_LOAD,
        // PT_DYNAMIC at 0x2de0.
        let mut mem = vec![0u8; 0x200];
        let phdr = |mem: &mut Vec<u8>, n: usize, kind: u32, vaddr: u64| {
            let at = 0x40 + n * PHDR_SIZE;
            mem[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            mem[at + 16..at + 24].copy_from_slice(&vaddr.to_le_bytes());
        };
        phdr(&mut mem, 0, PT_PHDR, 0x40);
        phdr(&mut mem, 1, 1, 0);
        phdr(&mut mem, 2, PT_DYNAMIC, 0x2de0);
        let base = 0x5555_0000u64;
        let read = |va: u64, buf: &mut [u8]| reader(mem.clone())(va.wrapping_sub(base), buf);
        let auxv: Vec<u8> = [(AT_PHDR, base + 0x40), (AT_PHNUM, 3), (0, 0)]
            .iter()
            .flat_map(|&(k, v): &(u64, u64)| k.to_le_bytes().into_iter().chain(v.to_le_bytes()))
            .collect();
        assert_eq!(
            loaded_program(&read, &auxv),
            Some((Some(base), Some(base + 0x2de0)))
        );
        // A static program: no dynamic section.
        let mut static_mem = mem.clone();
        static_mem[0x40 + 2 * PHDR_SIZE..0x40 + 2 * PHDR_SIZE + 4].fill(0);
        let read_static =
            |va: u64, buf: &mut [u8]| reader(static_mem.clone())(va.wrapping_sub(base), buf);
        assert_eq!(
            loaded_program(&read_static, &auxv),
            Some((Some(base), None))
        );
        // Not said: never known; not in memory yet: later.
        assert_eq!(loaded_program(&read, &auxv[16..]), Some((None, None)));
        assert_eq!(loaded_program(&|_, _| 0, &auxv), None);
    }

    #[test]
    fn arguments_are_the_system_v_registers() {
        let regs = kvm_regs {
            rdi: 1,
            rsi: 2,
            rdx: 3,
            rcx: 4,
            r8: 5,
            r9: 6,
            ..Default::default()
        };
        assert_eq!(
            (0..6).map(|n| arg(&regs, n)).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5, 6]
        );
        assert_eq!(
            taken_at(&CaptureItem::Retval, ProbeAt::Return),
            Phase::Return
        );
        assert_eq!(
            taken_at(&CaptureItem::Arg(0), ProbeAt::Return),
            Phase::Entry
        );
        assert_eq!(taken_at(&CaptureItem::Reg(0), ProbeAt::Entry), Phase::Entry);
    }
}
