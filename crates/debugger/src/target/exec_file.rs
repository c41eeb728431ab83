//! The program the process executed, as it named it.

use gdbstub::common::Pid;
use gdbstub::target::ext::exec_file::ExecFile;
use gdbstub::target::TargetResult;

use super::ReplayTarget;
use crate::files::copy_out;

impl ExecFile for ReplayTarget {
    fn get_exec_file(
        &self,
        _: Option<Pid>,
        offset: u64,
        length: usize,
        buf: &mut [u8],
    ) -> TargetResult<usize, Self> {
        let exe = self.driver.debug().process().map_or("", |p| p.exe.as_str());
        // The path gdb opens with host I/O: where the guest's file is.
        let exe = self.files.program_path(exe);
        Ok(copy_out(exe.as_bytes(), offset, length, buf))
    }
}
