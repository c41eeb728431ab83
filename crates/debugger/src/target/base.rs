//! The base of the protocol: a thread's registers (read only), the
//! process's memory (read only), the threads listed.

use gdbstub::common::Tid;
use gdbstub::target::ext::base::multithread::{MultiThreadBase, MultiThreadResumeOps};
use gdbstub::target::ext::thread_extra_info::ThreadExtraInfoOps;
use gdbstub::target::{TargetError, TargetResult};

use super::{lwpid, tid, Error, ReplayTarget};
use crate::arch::LinuxRegs;

impl MultiThreadBase for ReplayTarget {
    fn read_registers(&mut self, regs: &mut LinuxRegs, tid: Tid) -> TargetResult<(), Self> {
        let Some(t) = self.driver.thread_regs(lwpid(tid)) else {
            return Err(TargetError::NonFatal);
        };
        let r = &t.regs;
        *regs = LinuxRegs::default();
        regs.core.regs = [
            r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi, r.rbp, r.rsp, r.r8, r.r9, r.r10, r.r11,
            r.r12, r.r13, r.r14, r.r15,
        ];
        regs.core.rip = r.rip;
        regs.core.eflags = r.rflags as u32;
        // The x86-64 GNU/Linux user segments.
        regs.core.segments.cs = 0x33;
        regs.core.segments.ss = 0x2b;
        regs.orig_rax = t.orig_rax;
        regs.fs_base = t.fs_base;
        regs.gs_base = t.gs_base;
        if t.running {
            if let Some(fpu) = self.driver.fpu() {
                for (st, raw) in regs.core.st.iter_mut().zip(&fpu.fpr) {
                    st.copy_from_slice(&raw[..10]);
                }
                regs.core.fpu.fctrl = u32::from(fpu.fcw);
                regs.core.fpu.fstat = u32::from(fpu.fsw);
                regs.core.fpu.ftag = full_tag_word(fpu.ftwx);
                regs.core.fpu.fop = u32::from(fpu.last_opcode);
                regs.core.fpu.fioff = fpu.last_ip as u32;
                regs.core.fpu.fooff = fpu.last_dp as u32;
                for (x, raw) in regs.core.xmm.iter_mut().zip(&fpu.xmm) {
                    *x = u128::from_le_bytes(*raw);
                }
                regs.core.mxcsr = fpu.mxcsr;
            }
        }
        Ok(())
    }

    fn write_registers(&mut self, _: &LinuxRegs, _: Tid) -> TargetResult<(), Self> {
        self.read_only("writing registers");
        Err(TargetError::Errno(30))
    }

    fn read_addrs(&mut self, start: u64, data: &mut [u8], _: Tid) -> TargetResult<usize, Self> {
        match self.read_memory(start, data) {
            0 => Err(TargetError::Errno(14)),
            n => Ok(n),
        }
    }

    fn write_addrs(&mut self, _: u64, _: &[u8], _: Tid) -> TargetResult<(), Self> {
        self.read_only("writing memory");
        Err(TargetError::Errno(30))
    }

    fn list_active_threads(&mut self, thread: &mut dyn FnMut(Tid)) -> Result<(), Error> {
        let threads = self.driver.debug().threads();
        if threads.is_empty() {
            thread(tid(self.pid()));
        }
        for t in threads {
            thread(tid(t));
        }
        Ok(())
    }

    fn support_resume(&mut self) -> Option<MultiThreadResumeOps<'_, Self>> {
        Some(self)
    }

    fn support_thread_extra_info(&mut self) -> Option<ThreadExtraInfoOps<'_, Self>> {
        Some(self)
    }
}

/// The x87 tag word gdb shows (two bits a register) from FXSAVE's
/// abridged one (a bit a register: in use or empty); registers in use
/// are shown valid.
fn full_tag_word(abridged: u8) -> u32 {
    (0..8).fold(0, |tag, i| {
        let empty = abridged & (1 << i) == 0;
        tag | (if empty { 0b11 } else { 0b00 } << (2 * i))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x87_tags_are_empty_or_valid() {
        assert_eq!(full_tag_word(0), 0xffff);
        assert_eq!(full_tag_word(0xff), 0);
        assert_eq!(full_tag_word(0b1000_0001), 0x3ffc);
    }
}
