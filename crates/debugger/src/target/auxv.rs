//! The auxiliary vector the kernel gave the program.

use gdbstub::target::ext::auxv::Auxv;
use gdbstub::target::TargetResult;

use super::ReplayTarget;
use crate::files::copy_out;

impl Auxv for ReplayTarget {
    fn get_auxv(&self, offset: u64, length: usize, buf: &mut [u8]) -> TargetResult<usize, Self> {
        let auxv = self
            .driver
            .debug()
            .process()
            .map_or(&[][..], |p| &p.auxv[..]);
        Ok(copy_out(auxv, offset, length, buf))
    }
}
