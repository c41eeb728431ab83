//! Host I/O: gdb reads the recording's files (the program, its
//! libraries) through the replay, read only.

use gdbstub::target::ext::host_io::{
    FsKind, HostIo, HostIoClose, HostIoCloseOps, HostIoErrno, HostIoError, HostIoFstat,
    HostIoFstatOps, HostIoOpen, HostIoOpenFlags, HostIoOpenMode, HostIoOpenOps, HostIoPread,
    HostIoPreadOps, HostIoReadlink, HostIoReadlinkOps, HostIoResult, HostIoSetfs, HostIoSetfsOps,
    HostIoStat,
};

use super::ReplayTarget;
use crate::files::copy_out;

impl HostIo for ReplayTarget {
    fn support_open(&mut self) -> Option<HostIoOpenOps<'_, Self>> {
        Some(self)
    }

    fn support_close(&mut self) -> Option<HostIoCloseOps<'_, Self>> {
        Some(self)
    }

    fn support_pread(&mut self) -> Option<HostIoPreadOps<'_, Self>> {
        Some(self)
    }

    fn support_fstat(&mut self) -> Option<HostIoFstatOps<'_, Self>> {
        Some(self)
    }

    fn support_readlink(&mut self) -> Option<HostIoReadlinkOps<'_, Self>> {
        Some(self)
    }

    fn support_setfs(&mut self) -> Option<HostIoSetfsOps<'_, Self>> {
        Some(self)
    }
}

impl HostIoOpen for ReplayTarget {
    fn open(
        &mut self,
        name: &[u8],
        flags: HostIoOpenFlags,
        _: HostIoOpenMode,
    ) -> HostIoResult<u32, Self> {
        // O_WRONLY, O_RDWR: the recording's files are not to be changed.
        if flags.bits() & 3 != 0 {
            return Err(HostIoError::Errno(HostIoErrno::EROFS));
        }
        let path = String::from_utf8_lossy(name);
        self.files
            .open(&path)
            .ok_or(HostIoError::Errno(HostIoErrno::ENOENT))
    }
}

impl HostIoClose for ReplayTarget {
    fn close(&mut self, fd: u32) -> HostIoResult<(), Self> {
        if self.files.close(fd) {
            Ok(())
        } else {
            Err(HostIoError::Errno(HostIoErrno::EBADF))
        }
    }
}

impl HostIoPread for ReplayTarget {
    fn pread(
        &mut self,
        fd: u32,
        count: usize,
        offset: u64,
        buf: &mut [u8],
    ) -> HostIoResult<usize, Self> {
        let data = self
            .files
            .get(fd)
            .ok_or(HostIoError::Errno(HostIoErrno::EBADF))?;
        Ok(copy_out(data, offset, count, buf))
    }
}

impl HostIoFstat for ReplayTarget {
    fn fstat(&mut self, fd: u32) -> HostIoResult<HostIoStat, Self> {
        let data = self
            .files
            .get(fd)
            .ok_or(HostIoError::Errno(HostIoErrno::EBADF))?;
        Ok(HostIoStat {
            st_dev: 0,
            st_ino: fd,
            st_mode: HostIoOpenMode::from_bits_truncate(0o100_755),
            st_nlink: 1,
            st_uid: 0,
            st_gid: 0,
            st_rdev: 0,
            st_size: data.len() as u64,
            st_blksize: 4096,
            st_blocks: data.len().div_ceil(512) as u64,
            st_atime: 0,
            st_mtime: 0,
            st_ctime: 0,
        })
    }
}

impl HostIoReadlink for ReplayTarget {
    fn readlink(&mut self, _: &[u8], _: &mut [u8]) -> HostIoResult<usize, Self> {
        Err(HostIoError::Errno(HostIoErrno::ENOENT))
    }
}

impl HostIoSetfs for ReplayTarget {
    fn setfs(&mut self, _: FsKind) -> HostIoResult<(), Self> {
        Ok(())
    }
}
