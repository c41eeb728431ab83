//! The shared libraries loaded, from the dynamic linker's list (SVR4).

use gdbstub::target::ext::libraries::LibrariesSvr4;
use gdbstub::target::TargetResult;

use super::ReplayTarget;
use crate::files::{copy_out, libraries_svr4};

impl LibrariesSvr4 for ReplayTarget {
    fn get_libraries_svr4(
        &self,
        offset: u64,
        length: usize,
        buf: &mut [u8],
    ) -> TargetResult<usize, Self> {
        let auxv = self
            .driver
            .debug()
            .process()
            .map_or(&[][..], |p| &p.auxv[..]);
        let xml = libraries_svr4(auxv, &|at, b| self.read_memory(at, b));
        Ok(copy_out(xml.as_bytes(), offset, length, buf))
    }
}
