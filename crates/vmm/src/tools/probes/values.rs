//! The values a probe captures at a hit (arguments, registers, the
//! return value, globals, memory, strings) and its condition.

use events::db::ProbeValue;
use events::probe_spec::{CaptureItem, ProbeAt, ARG_REGISTERS, MAX_CAPTURE_BYTES, MAX_STRING};
use kvm_bindings::kvm_regs;

use super::plan::PlannedProbe;
use crate::tools::control::Control;
use crate::vm::Machine;

/// When a value is taken: a `return` probe takes its arguments, memory
/// and variables at the entry, its registers and return value at the
/// return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
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
pub(super) struct Reader<'a> {
    pub(super) m: &'a Machine,
    pub(super) control: &'a Control,
    pub(super) cr3: u64,
    pub(super) bias: u64,
}

impl Reader<'_> {
    pub(super) fn read(&self, va: u64, buf: &mut [u8]) -> usize {
        self.control.read_in(self.m, self.cr3, va, buf)
    }

    pub(super) fn read_u64(&self, va: u64) -> Option<u64> {
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
pub(super) fn capture(
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
pub(super) fn holds(
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

pub(super) fn wants_stack(probe: &PlannedProbe) -> bool {
    probe.spec.captures.contains(&CaptureItem::Ustack)
}

#[cfg(test)]
mod tests {
    use super::*;

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
