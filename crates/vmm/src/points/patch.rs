//! Putting code into the guest and taking it out again: the trampolines of
//! asynchronous points (a recorder's trap, a replay's search) and the
//! probe gate, in the pages the guest kernel maps into every process
//! (`introspect::stub_area`).

use std::time::Instant;

use vm_memory::{Bytes, GuestAddress};

use crate::vm::{Machine, VmError};
use introspect::event_ring::EventRing;
use introspect::gva;
use introspect::probe_gate;
use introspect::stub_area::GuestArea;
use journal::preempt::guest_code::{self, trampoline_entries, PageTables};
use journal::preempt::trampoline::Stub;
use journal::preempt::{AsyncPoint, CodePages};

/// A trampoline in place in the guest.
pub(crate) struct Patch {
    /// The position it stops at.
    pub(crate) rip: u64,
    /// VM time it was put in place.
    pub(crate) since_ns: u64,
    /// Code page of the trampoline mapping it uses.
    pub(crate) stub: u64,
    /// Where its store to the exit page is (and ends).
    pub(crate) exit_rips: [u64; 2],
    /// Guest bytes it overwrote, to put back: (address, bytes).
    pub(crate) saved: Vec<(u64, Vec<u8>)>,
    pub(crate) started: Instant,
}

impl Machine {
    /// The area the guest kernel announced, read again (it is the guest's
    /// word: checked every time).
    pub(crate) fn stub_area(&self) -> Option<GuestArea> {
        let gpa = self.vm.status.stub_area_gpa?;
        GuestArea::read(&self.vm.mem, gpa).ok()
    }

    /// Writes the probe gate (`gate`) and the heap gate (`heap`) into the
    /// announced area's code page. Returns the event ring when a gate
    /// appends to it (emptied for this run), which then must be read at
    /// every exit.
    pub(crate) fn install_probe_gate(
        &mut self,
        gate: probe_gate::GateMode,
        heap: probe_gate::GateMode,
    ) -> Option<EventRing> {
        let area = self.stub_area()?;
        let ring = area.ring.map(|(gpa, pages)| EventRing { gpa, pages });
        let at = GuestAddress(area.code_pa + probe_gate::CODE_START);
        // The area was checked to name a page of RAM.
        let _ = self
            .vm
            .mem
            .write_slice(&probe_gate::bytes(gate, heap, ring), at);
        let ring = ring.filter(|_| [gate, heap].contains(&probe_gate::GateMode::Ring))?;
        ring.reset(&self.vm.mem);
        Some(ring)
    }

    /// The process of the task on the vCPU maps the trampoline pages here
    /// (none before the guest kernel announced its area).
    pub(crate) fn stub_mappings(&self) -> [u64; 2] {
        self.stub_area().map_or([0; 2], |a| a.stub_va)
    }

    /// The 8-byte word at user address `at` in the address space `cr3`,
    /// if user code can read all of it without a fault.
    pub(crate) fn user_word(&self, cr3: u64, at: u64) -> Option<u64> {
        if at & 0xfff > 0xff8 {
            return None;
        }
        let pa = gva::translate_user(&self.vm.mem, cr3, at).ok()?;
        self.vm.mem.read_obj(GuestAddress(pa)).ok()
    }

    /// Puts a trampoline in place: its code (and data) in the mapping at
    /// `stub` of the address space `cr3`, the jump to it at `rip` in the
    /// code pages `code`; keeps every byte it changes, and the entries
    /// that map the trampoline's pages, whose accessed and dirty bits its
    /// run sets.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn install(
        &mut self,
        cr3: u64,
        code_pages: &dyn CodePages,
        rip: u64,
        stub: u64,
        code: &Stub,
        data: Option<Vec<u8>>,
        jump: Vec<u8>,
    ) -> Result<Patch, String> {
        let mem = &self.vm.mem;
        let pages = AsyncPoint::pages_at(stub);
        let mut saved = Vec::new();
        for entry in trampoline_entries(mem, cr3, stub, &[]) {
            let mut old = vec![0u8; 8];
            mem.read_slice(&mut old, GuestAddress(entry))
                .map_err(|e| e.to_string())?;
            saved.push((entry, old));
        }
        let tables = PageTables { mem, cr3 };
        let mut writes: Vec<(&dyn CodePages, u64, Vec<u8>)> =
            vec![(&tables, pages.code, code.code.clone())];
        writes.extend(data.map(|d| (&tables as &dyn CodePages, pages.data, d)));
        writes.push((code_pages, rip, jump));
        for (map, va, bytes) in writes {
            if let Err(why) = guest_code::write_saving(mem, map, va, &bytes, &mut saved) {
                guest_code::restore(mem, &saved);
                return Err(why);
            }
        }
        Ok(Patch {
            rip,
            since_ns: 0,
            stub,
            exit_rips: [pages.code + code.exit_at, pages.code + code.exit_end],
            saved,
            started: Instant::now(),
        })
    }

    /// Puts the guest's bytes back.
    pub(crate) fn restore(&self, saved: &[(u64, Vec<u8>)]) {
        guest_code::restore(&self.vm.mem, saved);
    }

    /// Whether a store to the exit page was made by `patch`'s trampoline.
    pub(crate) fn stopped_by(&self, patch: &Patch) -> Result<bool, VmError> {
        Ok(patch.exit_rips.contains(&self.vcpu.regs()?.rip))
    }

    /// A trampoline's exit is where the task should stop: completes the
    /// store, puts the guest's bytes back and moves RIP to the patched
    /// position, where an interrupt may then be delivered. False if the
    /// vCPU ran on past the trampoline instead.
    pub(crate) fn complete_trampoline_exit(&mut self, patch: &Patch) -> Result<bool, VmError> {
        if !self
            .vcpu
            .complete_exit_now("RUN (completing a trampoline's exit)")?
        {
            return Ok(false);
        }
        self.restore(&patch.saved);
        let mut regs = self.vcpu.regs()?;
        regs.rip = patch.rip;
        self.vcpu.set_regs(&regs)?;
        self.vcpu.resume_at(&regs);
        Ok(true)
    }
}
