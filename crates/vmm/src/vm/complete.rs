//! Completing what KVM cannot emulate on these hosts (XSAVE family), and
//! injecting the exceptions that completion raises.

use super::{kvm_err, Vm, VmError};
use crate::kvm_ext;
use crate::unemulated::{self, Completion};
use introspect::gva;
use introspect::xstate::{self, XOp, XstateFault};

/// KVM_INTERNAL_ERROR_EMULATION.
const INTERNAL_ERROR_EMULATION: u32 = 1;
/// Longest x86 instruction.
const MAX_INSN_LEN: usize = 15;

impl Vm {
    /// Completes the instruction of the last exit now, without entering
    /// the guest (a KVM_RUN with `immediate_exit`): its registers are then
    /// the ones to read or change. False if the vCPU ran on instead.
    pub(super) fn complete_exit_now(&mut self, what: &'static str) -> Result<bool, VmError> {
        self.vcpu.set_kvm_immediate_exit(1);
        let completed = self.vcpu.run().map(|_| ());
        self.vcpu.set_kvm_immediate_exit(0);
        match completed {
            Err(e) if e.errno() == libc::EINTR => Ok(true),
            Err(e) => Err(kvm_err(what)(e)),
            Ok(()) => Ok(false),
        }
    }

    /// KVM could not emulate a guest instruction: complete it if it is one
    /// the VMM knows, otherwise stop with its bytes.
    pub(super) fn complete_unemulated(&mut self) -> Result<(), VmError> {
        let (suberror, data) = kvm_ext::internal_error(self.vcpu.get_kvm_run());
        let mut regs = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
        if suberror != INTERNAL_ERROR_EMULATION {
            return Err(VmError::GuestFault {
                reason: format!("KVM internal error {suberror}"),
                rip: regs.rip,
                detail: format!(" (data {data:x?})"),
            });
        }
        let sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        // The bytes up to the end of the page must be readable; those on
        // the next page only if the instruction continues there.
        let mut insn = [0u8; MAX_INSN_LEN];
        let pc = sregs.cs.base.wrapping_add(regs.rip);
        let in_page = MAX_INSN_LEN.min((0x1000 - (pc & 0xfff)) as usize);
        let fetched = gva::read_virt(&self.mem, sregs.cr3, pc, &mut insn[..in_page]);
        if fetched.is_ok() && in_page < MAX_INSN_LEN {
            let rest = pc.wrapping_add(in_page as u64);
            let _ = gva::read_virt(&self.mem, sregs.cr3, rest, &mut insn[in_page..]);
        }
        let completion = fetched
            .as_ref()
            .ok()
            .and_then(|_| unemulated::complete(&insn));
        if let Some(completion) = completion {
            self.exits.emulation_completions += 1;
            return match completion {
                Completion::Xstate(x) => self.complete_xstate(x, regs, sregs.cr3),
                Completion::Skip(len) => {
                    regs.rip = regs.rip.wrapping_add(len);
                    self.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))
                }
                Completion::Trap { len, vector } => {
                    regs.rip = regs.rip.wrapping_add(len);
                    self.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))?;
                    self.inject_exception(vector, None)
                }
            };
        }
        Err(VmError::GuestFault {
            reason: "instruction the host cannot emulate".into(),
            rip: regs.rip,
            detail: match fetched {
                Ok(()) => format!(" (bytes {})", unemulated::hex_bytes(&insn)),
                Err(e) => format!(" ({e})"),
            },
        })
    }
}

impl Vm {
    /// Raises exception `vector` in the guest at the current RIP.
    pub(super) fn inject_exception(
        &mut self,
        vector: u8,
        error_code: Option<u32>,
    ) -> Result<(), VmError> {
        if let Some(sampling) = &mut self.sampling {
            sampling.injected = true;
        }
        let mut events = self
            .vcpu
            .get_vcpu_events()
            .map_err(kvm_err("GET_VCPU_EVENTS"))?;
        events.exception.injected = 1;
        events.exception.nr = vector;
        events.exception.has_error_code = u8::from(error_code.is_some());
        events.exception.error_code = error_code.unwrap_or(0);
        self.exception_pending = true;
        self.vcpu
            .set_vcpu_events(&events)
            .map_err(kvm_err("SET_VCPU_EVENTS"))
    }

    /// Raises a page fault for a supervisor access to `addr`.
    pub(super) fn inject_page_fault(
        &mut self,
        addr: u64,
        present: bool,
        write: bool,
    ) -> Result<(), VmError> {
        let mut sregs = self.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        sregs.cr2 = addr;
        self.vcpu.set_sregs(&sregs).map_err(kvm_err("SET_SREGS"))?;
        self.inject_exception(14, Some(u32::from(present) | (u32::from(write) << 1)))
    }

    /// Completes XSAVE/XRSTOR for the guest kernel (see `xstate`).
    pub(super) fn complete_xstate(
        &mut self,
        x: xstate::XInsn,
        mut regs: kvm_bindings::kvm_regs,
        cr3: u64,
    ) -> Result<(), VmError> {
        const GP: u8 = 13;
        let gprs = [
            regs.rax, regs.rcx, regs.rdx, regs.rbx, regs.rsp, regs.rbp, regs.rsi, regs.rdi,
            regs.r8, regs.r9, regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15,
        ];
        let next_rip = regs.rip.wrapping_add(x.len);
        let addr = x.mem.address(&gprs, next_rip);
        if xstate::check_alignment(addr).is_err() {
            return self.inject_exception(GP, Some(0));
        }
        let xcrs = self.vcpu.get_xcrs().map_err(kvm_err("GET_XCRS"))?;
        let xcr0 = xcrs.xcrs[..(xcrs.nr_xcrs as usize).min(xcrs.xcrs.len())]
            .iter()
            .find(|x| x.xcr == 0)
            .map(|x| x.value)
            .unwrap_or(1);
        let rfbm = ((regs.rdx << 32) | (regs.rax & 0xffff_ffff)) & xcr0;
        let Some(size) = self.xsave_layout.area_size(rfbm) else {
            return Err(VmError::GuestFault {
                reason: format!("XSAVE of state components {rfbm:#x} insight cannot complete"),
                rip: regs.rip,
                detail: String::new(),
            });
        };
        let write = x.op == XOp::Save;
        // XRSTOR reads the legacy area and header, then only the
        // components the header marks as in use; XSAVE writes them all.
        let mut area = vec![0u8; size];
        let read =
            |len: usize, area: &mut [u8]| gva::read_virt(&self.mem, cr3, addr, &mut area[..len]);
        let mut result = read(size.min(xstate::LEGACY_AND_HEADER), &mut area);
        if result.is_ok() && size > xstate::LEGACY_AND_HEADER {
            let needed = match x.op {
                XOp::Save => size,
                XOp::Restore => self
                    .xsave_layout
                    .area_size(rfbm & xstate::header_xstate_bv(&area))
                    .unwrap_or(size),
            };
            if needed > xstate::LEGACY_AND_HEADER {
                result = read(needed, &mut area);
            }
        }
        match result {
            Ok(()) => {}
            Err(gva::TranslateError::NotMapped(at)) => {
                return self.inject_page_fault(at, false, write)
            }
            Err(e) => return Err(xsave_memory_fault(&regs, e)),
        }
        let mut kvm_state = self.vcpu.get_xsave().map_err(kvm_err("GET_XSAVE"))?;
        let mut cpu: Vec<u8> = kvm_state
            .region
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        match x.op {
            XOp::Save => {
                xstate::save(&cpu, &mut area, rfbm, &self.xsave_layout);
                match gva::write_virt(&self.mem, cr3, addr, &area) {
                    Ok(()) => {}
                    Err(gva::TranslateError::NotMapped(at)) => {
                        return self.inject_page_fault(at, false, true)
                    }
                    Err(gva::TranslateError::NotWritable(at)) => {
                        return self.inject_page_fault(at, true, true)
                    }
                    Err(e) => return Err(xsave_memory_fault(&regs, e)),
                }
            }
            XOp::Restore => {
                if let Err(
                    XstateFault::BadHeader | XstateFault::BadMxcsr | XstateFault::Misaligned,
                ) = xstate::restore(&mut cpu, &area, rfbm, xcr0, &self.xsave_layout)
                {
                    return self.inject_exception(GP, Some(0));
                }
                for (word, bytes) in kvm_state.region.iter_mut().zip(cpu.chunks_exact(4)) {
                    *word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                }
                kvm_ext::set_xsave(&self.vcpu, &kvm_state, self.xsave_max_size)
                    .map_err(kvm_err("SET_XSAVE"))?;
            }
        }
        regs.rip = next_rip;
        self.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))
    }
}

fn xsave_memory_fault(regs: &kvm_bindings::kvm_regs, e: gva::TranslateError) -> VmError {
    VmError::GuestFault {
        reason: "XSAVE area outside guest memory".into(),
        rip: regs.rip,
        detail: format!(" ({e})"),
    }
}
