//! What gdb's `info threads` says of each thread: running user code, in
//! a system call, in the kernel.

use gdbstub::common::Tid;
use gdbstub::target::ext::thread_extra_info::ThreadExtraInfo;

use super::{lwpid, Error, ReplayTarget};
use crate::files::copy_out;

impl ThreadExtraInfo for ReplayTarget {
    fn thread_extra_info(&self, tid: Tid, buf: &mut [u8]) -> Result<usize, Error> {
        let text = match self.driver.thread_regs(lwpid(tid)) {
            Some(t) if t.running => "running user code".to_owned(),
            Some(t) if t.orig_rax != u64::MAX => format!("in system call {}", t.orig_rax),
            Some(_) => "in the kernel".to_owned(),
            None => "not yet run".to_owned(),
        };
        Ok(copy_out(text.as_bytes(), 0, buf.len(), buf))
    }
}
