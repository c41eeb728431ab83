//! The processes the probes go into, from the start of their programs
//! (or their forks), where each probe's object is loaded in them, and the
//! calls of `return` probes under way; hits made PROBE and PROBE_RET
//! events.

use std::collections::HashMap;

use events::abi::Kind;
use events::db::ProbeValue;
use events::probe_spec::ProbeAt;
use kvm_bindings::kvm_regs;

use super::loaded::{library_base, loaded_libraries, loaded_program, same_object};
use super::plan::{PlannedProbe, ProbePlan};
use super::values::{capture, holds, wants_stack, Phase, Reader};
use crate::tools::control::tasks::{auxv_value, AT_ENTRY};
use crate::tools::control::{Control, ProcessInfo};
use crate::tools::events::EventTool;
use crate::vm::{Machine, VmError};

/// The most calls of `return` probes one thread may have under way; a
/// deeper one is counted as an anomaly and not reported.
const MAX_PENDING_CALLS: usize = 100_000;

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
struct ProbedProcess {
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
pub(super) struct ProbeHit {
    pub(super) pid: u32,
    pub(super) lwpid: u32,
    /// The address space of its process.
    pub(super) cr3: u64,
    /// The address space of the followed process whose breakpoint it is:
    /// `cr3`, or its parent's for a child it forked.
    pub(super) space: u64,
    pub(super) regs: kvm_regs,
}

/// What the engine tells of the guest's processes.
#[derive(Clone, Debug)]
pub(super) enum ProcessChange {
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

/// The probes' state in a replay.
pub(super) struct ProbeState {
    probes: Vec<PlannedProbe>,
    exe_path: String,
    exe_entry: u64,
    /// The processes followed, by address space.
    followed: HashMap<u64, ProbedProcess>,
    /// Calls of `return` probes under way, per thread, innermost last.
    calls: HashMap<u32, Vec<PendingCall>>,
    /// The processes whose objects the events tool was told of.
    announced: Vec<u32>,
}

impl ProbeState {
    pub(super) fn new(plan: &ProbePlan) -> Self {
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
    pub(super) fn collect(
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
            ProbedProcess {
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
        let child = ProbedProcess {
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
    pub(super) fn advanced(
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

/// Each probe's object's load bias in the followed process `f`, where
/// known and where the probe goes into it.
fn bases(probes: &[PlannedProbe], f: &ProbedProcess) -> Vec<Option<u64>> {
    (probes.iter().enumerate())
        .map(|(i, p)| match &p.object {
            _ if !f.probes[i] => None,
            None => f.bias.filter(|_| f.runs_program),
            Some(path) => library_base(&f.libraries, path),
        })
        .collect()
}
