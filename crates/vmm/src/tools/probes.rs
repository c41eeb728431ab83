//! Probes given at replay (`insight replay --probe`, docs/probes.md):
//! breakpoints the debugger's engine puts in one process's code
//! (`DebugTool::collecting`), whose hits become PROBE and PROBE_RET
//! events with the values each probe captures. Nothing of this exists
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

use super::debug::{DebugTool, ProbeHit, ProcessSelector};
use super::events::EventTool;
use crate::vm::{Machine, VmError};

/// The probes a replay arms, resolved against the recording's files.
#[derive(Clone, Debug)]
pub struct ProbePlan {
    /// The process they go into.
    pub process: ProcessSelector,
    /// Its executable's path in the guest.
    pub exe_path: String,
    /// The ELF entry point of its executable (its load bias is where the
    /// kernel says the program starts, less this).
    pub exe_entry: u64,
    pub probes: Vec<PlannedProbe>,
}

/// One probe: its number, its spec, and where it goes in the executable
/// (before the load bias).
#[derive(Clone, Debug)]
pub struct PlannedProbe {
    pub id: u32,
    pub spec: ProbeSpec,
    pub site: u64,
    /// The global variables it captures or compares: their addresses in
    /// the executable and sizes (1 to 8 bytes).
    pub globals: Vec<(String, u64, u8)>,
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

/// The name of a return probe's last value slot.
pub const DURATION: &str = "duration_ns";

/// A call of a `return` probe's function, until it returns.
struct PendingCall {
    probe: usize,
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

/// The probes' state in a replay.
pub(crate) struct ProbeTool {
    probes: Vec<PlannedProbe>,
    /// Calls of `return` probes under way, per thread, innermost last.
    calls: HashMap<u32, Vec<PendingCall>>,
    /// Breakpoints at return addresses, with how many calls wait there.
    return_sites: HashMap<u64, usize>,
    exe_path: String,
    /// The process whose executable the events tool was told of.
    announced: Option<u32>,
}

impl ProbeTool {
    pub(crate) fn new(plan: &ProbePlan) -> Self {
        ProbeTool {
            probes: plan.probes.clone(),
            calls: HashMap::new(),
            return_sites: HashMap::new(),
            exe_path: plan.exe_path.clone(),
            announced: None,
        }
    }

    /// The breakpoints the process needs from its start: every probe's
    /// site.
    pub(crate) fn sites(&self) -> Vec<u64> {
        let mut sites: Vec<u64> = self.probes.iter().map(|p| p.site).collect();
        sites.sort_unstable();
        sites.dedup();
        sites
    }

    /// Turns the hits the debugger's engine collected into events, at
    /// the replay's event time `ns`. The hit thread still stands where it
    /// hit (nothing ran since).
    pub(crate) fn collect(
        &mut self,
        m: &Machine,
        debug: &mut DebugTool,
        events: &mut EventTool,
        ns: u64,
    ) -> Result<(), VmError> {
        let hits = debug.take_probe_hits();
        if hits.is_empty() {
            return Ok(());
        }
        let bias = debug.collecting.as_ref().and_then(|s| s.bias).unwrap_or(0);
        if let Some(first) = hits.first().filter(|h| self.announced != Some(h.pid)) {
            self.announced = Some(first.pid);
            events.executable_seen(first.pid, bias, &self.exe_path)?;
        }
        let mut changed = false;
        for hit in hits {
            changed |= self.returned(m, debug, events, ns, &hit)?;
            changed |= self.entered(m, debug, events, ns, bias, &hit)?;
        }
        if changed {
            debug.sync_breakpoints(m);
        }
        Ok(())
    }

    /// A hit at the entry of probed functions; whether a return
    /// breakpoint went in.
    fn entered(
        &mut self,
        m: &Machine,
        debug: &mut DebugTool,
        events: &mut EventTool,
        ns: u64,
        bias: u64,
        hit: &ProbeHit,
    ) -> Result<bool, VmError> {
        let va = hit.regs.rip;
        let mut added = false;
        for (index, probe) in self.probes.iter().enumerate() {
            if probe.site.wrapping_add(bias) != va {
                continue;
            }
            let returns_to = read_u64(m, debug, hit.regs.rsp).unwrap_or(0);
            let reader = Reader { m, debug, bias };
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
                    let values = capture(&reader, probe, &hit.regs, Phase::Entry);
                    self.calls.entry(hit.lwpid).or_default().push(PendingCall {
                        probe: index,
                        rsp: hit.regs.rsp,
                        function: va,
                        returns_to,
                        values,
                        start_ns: ns,
                    });
                    let waiting = self.return_sites.entry(returns_to).or_insert(0);
                    if *waiting == 0 {
                        debug.add_breakpoint(returns_to);
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
        debug: &mut DebugTool,
        events: &mut EventTool,
        ns: u64,
        hit: &ProbeHit,
    ) -> Result<bool, VmError> {
        let Some(calls) = self.calls.get_mut(&hit.lwpid) else {
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
        let mut removed = false;
        let bias = debug.collecting.as_ref().and_then(|s| s.bias).unwrap_or(0);
        for call in ended {
            let waiting = self.return_sites.entry(call.returns_to).or_insert(1);
            *waiting -= 1;
            if *waiting == 0 {
                self.return_sites.remove(&call.returns_to);
                if !self
                    .probes
                    .iter()
                    .any(|p| p.site.wrapping_add(bias) == call.returns_to)
                {
                    debug.remove_breakpoint(call.returns_to);
                }
                removed = true;
            }
            // A frame left without returning (longjmp, an exception):
            // no return.
            if call.rsp.wrapping_add(8) != rsp || call.returns_to != va {
                continue;
            }
            let probe = &self.probes[call.probe];
            let reader = Reader { m, debug, bias };
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
        if calls.is_empty() {
            self.calls.remove(&hit.lwpid);
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

/// Reads the process's memory as the program sees it.
struct Reader<'a> {
    m: &'a Machine,
    debug: &'a DebugTool,
    bias: u64,
}

impl Reader<'_> {
    fn read(&self, va: u64, buf: &mut [u8]) -> usize {
        self.debug.read_user(self.m, &[], va, buf)
    }

    fn global(&self, probe: &PlannedProbe, name: &str) -> Option<i64> {
        let &(_, rel, size) = probe.globals.iter().find(|g| g.0 == name)?;
        let mut buf = [0u8; 8];
        let size = usize::from(size.clamp(1, 8));
        (self.read(rel.wrapping_add(self.bias), &mut buf[..size]) == size)
            .then(|| i64::from_le_bytes(buf))
    }
}

fn read_u64(m: &Machine, debug: &DebugTool, va: u64) -> Option<u64> {
    let mut buf = [0u8; 8];
    (debug.read_user(m, &[], va, &mut buf) == 8).then(|| u64::from_le_bytes(buf))
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
            site: 0x1130,
            globals: Vec::new(),
        }
    }

    #[test]
    fn return_probes_take_their_duration_in_the_last_slot() {
        let row = planned("work return capture arg0, retval").row();
        assert_eq!(row.captures, ["arg0", "retval", DURATION]);
        assert_eq!(row.id, 3);
        assert_eq!(planned("work capture arg1").row().captures, ["arg1"]);
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
