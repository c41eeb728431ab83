//! Completing what KVM cannot emulate on these hosts (XSAVE family), and
//! injecting the exceptions that completion raises.

use super::{kvm_err, Machine, VmError};
use crate::kvm_ext;
use crate::unemulated::{self, Completion};
use introspect::gva;
use introspect::xstate::{self, XOp, XstateFault};

/// KVM_INTERNAL_ERROR_EMULATION.
const INTERNAL_ERROR_EMULATION: u32 = 1;
/// Longest x86 instruction.
const MAX_INSN_LEN: usize = 15;

impl Machine {
    /// KVM could not emulate a guest instruction: complete it if it is one
    /// the VMM knows, otherwise stop with its bytes.
    pub(crate) fn complete_unemulated(&mut self) -> Result<(), VmError> {
        let (suberror, data) = kvm_ext::internal_error(self.vcpu.fd.get_kvm_run());
        let mut regs = self.vcpu.regs()?;
        if suberror != INTERNAL_ERROR_EMULATION {
            return Err(VmError::GuestFault {
                reason: format!("KVM internal error {suberror}"),
                rip: regs.rip,
                detail: format!(" (data {data:x?})"),
            });
        }
        let sregs = self.vcpu.sregs()?;
        // The bytes up to the end of the page must be readable; those on
        // the next page only if the instruction continues there.
        let mut insn = [0u8; MAX_INSN_LEN];
        let pc = sregs.cs.base.wrapping_add(regs.rip);
        let in_page = MAX_INSN_LEN.min((0x1000 - (pc & 0xfff)) as usize);
        let fetched = gva::read_virt(&self.vm.mem, sregs.cr3, pc, &mut insn[..in_page]);
        if fetched.is_ok() && in_page < MAX_INSN_LEN {
            let rest = pc.wrapping_add(in_page as u64);
            let _ = gva::read_virt(&self.vm.mem, sregs.cr3, rest, &mut insn[in_page..]);
        }
        let completion = fetched
            .as_ref()
            .ok()
            .and_then(|_| unemulated::complete(&insn));
        if let Some(completion) = completion {
            self.vm.exits.emulation_completions += 1;
            return match completion {
                Completion::Xstate(x) => self.complete_xstate(x, regs, sregs.cr3),
                Completion::Skip(len) => {
                    regs.rip = regs.rip.wrapping_add(len);
                    self.vcpu.set_regs(&regs)
                }
                Completion::Trap { len, vector } => {
                    regs.rip = regs.rip.wrapping_add(len);
                    self.vcpu.set_regs(&regs)?;
                    self.vcpu.inject_exception(vector, None)
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

impl Machine {
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
            return self.vcpu.inject_exception(GP, Some(0));
        }
        let xcrs = self.vcpu.fd.get_xcrs().map_err(kvm_err("GET_XCRS"))?;
        let xcr0 = xcrs.xcrs[..(xcrs.nr_xcrs as usize).min(xcrs.xcrs.len())]
            .iter()
            .find(|x| x.xcr == 0)
            .map(|x| x.value)
            .unwrap_or(1);
        let rfbm = ((regs.rdx << 32) | (regs.rax & 0xffff_ffff)) & xcr0;
        let Some(size) = self.vm.cpu.xsave_layout.area_size(rfbm) else {
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
            |len: usize, area: &mut [u8]| gva::read_virt(&self.vm.mem, cr3, addr, &mut area[..len]);
        let mut result = read(size.min(xstate::LEGACY_AND_HEADER), &mut area);
        if result.is_ok() && size > xstate::LEGACY_AND_HEADER {
            let needed = match x.op {
                XOp::Save => size,
                XOp::Restore => self
                    .vm
                    .cpu
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
                return self.vcpu.inject_page_fault(at, false, write)
            }
            Err(e) => return Err(xsave_memory_fault(&regs, e)),
        }
        let mut kvm_state = self.vcpu.fd.get_xsave().map_err(kvm_err("GET_XSAVE"))?;
        let mut cpu: Vec<u8> = kvm_state
            .region
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        match x.op {
            XOp::Save => {
                xstate::save(&cpu, &mut area, rfbm, &self.vm.cpu.xsave_layout);
                match gva::write_virt(&self.vm.mem, cr3, addr, &area) {
                    Ok(()) => {}
                    Err(gva::TranslateError::NotMapped(at)) => {
                        return self.vcpu.inject_page_fault(at, false, true)
                    }
                    Err(gva::TranslateError::NotWritable(at)) => {
                        return self.vcpu.inject_page_fault(at, true, true)
                    }
                    Err(e) => return Err(xsave_memory_fault(&regs, e)),
                }
            }
            XOp::Restore => {
                if let Err(
                    XstateFault::BadHeader | XstateFault::BadMxcsr | XstateFault::Misaligned,
                ) = xstate::restore(&mut cpu, &area, rfbm, xcr0, &self.vm.cpu.xsave_layout)
                {
                    return self.vcpu.inject_exception(GP, Some(0));
                }
                for (word, bytes) in kvm_state.region.iter_mut().zip(cpu.chunks_exact(4)) {
                    *word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                }
                kvm_ext::set_xsave(&self.vcpu.fd, &kvm_state, self.vm.cpu.xsave_max_size)
                    .map_err(kvm_err("SET_XSAVE"))?;
            }
        }
        regs.rip = next_rip;
        self.vcpu.set_regs(&regs)
    }
}

fn xsave_memory_fault(regs: &kvm_bindings::kvm_regs, e: gva::TranslateError) -> VmError {
    VmError::GuestFault {
        reason: "XSAVE area outside guest memory".into(),
        rip: regs.rip,
        detail: format!(" ({e})"),
    }
}
