//! The replay as gdb sees it: one process, its threads, its memory and
//! files, read only; forward and reverse execution.

use std::num::NonZeroUsize;

use gdbstub::common::{Pid, Signal, Tid};
use gdbstub::stub::MultiThreadStopReason;
use gdbstub::target::ext::auxv::{Auxv, AuxvOps};
use gdbstub::target::ext::base::multithread::{
    MultiThreadBase, MultiThreadResume, MultiThreadResumeOps, MultiThreadSchedulerLocking,
    MultiThreadSchedulerLockingOps, MultiThreadSingleStep, MultiThreadSingleStepOps,
};
use gdbstub::target::ext::base::reverse_exec::{
    ReplayLogPosition, ReverseCont, ReverseContOps, ReverseStep, ReverseStepOps,
};
use gdbstub::target::ext::base::BaseOps;
use gdbstub::target::ext::breakpoints::{
    Breakpoints, BreakpointsOps, HwBreakpoint, HwBreakpointOps, HwWatchpoint, HwWatchpointOps,
    SwBreakpoint, SwBreakpointOps, WatchKind,
};
use gdbstub::target::ext::exec_file::{ExecFile, ExecFileOps};
use gdbstub::target::ext::extended_mode::{
    Args, AttachKind, CurrentActivePid, CurrentActivePidOps, ExtendedMode, ExtendedModeOps,
    ShouldTerminate,
};
use gdbstub::target::ext::host_io::{
    FsKind, HostIo, HostIoClose, HostIoCloseOps, HostIoErrno, HostIoError, HostIoFstat,
    HostIoFstatOps, HostIoOpen, HostIoOpenFlags, HostIoOpenMode, HostIoOpenOps, HostIoOps,
    HostIoPread, HostIoPreadOps, HostIoReadlink, HostIoReadlinkOps, HostIoResult, HostIoSetfs,
    HostIoSetfsOps, HostIoStat,
};
use gdbstub::target::ext::libraries::{LibrariesSvr4, LibrariesSvr4Ops};
use gdbstub::target::ext::thread_extra_info::{ThreadExtraInfo, ThreadExtraInfoOps};
use gdbstub::target::{Target, TargetError, TargetResult};
use vmm::session::{DebugDriver, DebugEvent};
use vmm::tools::debug::{Resume, Stop, StopKind};
use vmm::VmError;

use crate::arch::{LinuxRegs, X86_64Linux};
use crate::files::{copy_out, libraries_svr4, link_map, read_from_files, CodeMap, OpenFiles};
use crate::timeline::{Back, Timeline};

pub(crate) type Reason = MultiThreadStopReason<u64>;

const PAGE_SIZE: u64 = 4096;

/// What gdb asked the replay to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    Continue,
    Step(u32),
    ReverseContinue,
    ReverseStep(u32),
}

/// The gdb selection of threads (`Hg`, `Hc`), seen in the packets: gdb
/// sends `Hc` "any thread" before `bs`, which gdbstub resolves to the
/// first thread, not the one the user selected.
#[derive(Default)]
pub(crate) struct Selection {
    packet: Vec<u8>,
    in_packet: bool,
    pub(crate) general: Option<u32>,
    pub(crate) continue_any: bool,
}

impl Selection {
    pub(crate) fn feed(&mut self, b: u8) {
        match b {
            b'$' => {
                self.in_packet = true;
                self.packet.clear();
            }
            b'#' if self.in_packet => {
                self.in_packet = false;
                if self.packet.len() > 2 && self.packet[0] == b'H' {
                    let id = std::str::from_utf8(&self.packet[2..]).unwrap_or("");
                    let tid = id.rsplit('.').next().unwrap_or(id);
                    let tid = if tid == "-1" {
                        None
                    } else {
                        u32::from_str_radix(tid.trim_start_matches('p'), 16)
                            .ok()
                            .filter(|&t| t != 0)
                    };
                    match self.packet[1] {
                        b'g' if tid.is_some() => self.general = tid,
                        b'c' => self.continue_any = tid.is_none(),
                        _ => {}
                    }
                }
            }
            _ if self.in_packet && self.packet.len() < 64 => self.packet.push(b),
            _ => {}
        }
    }
}

/// The replay served to gdb.
pub(crate) struct ReplayTarget {
    pub(crate) driver: DebugDriver,
    pub(crate) timeline: Timeline,
    pub(crate) files: OpenFiles,
    pub(crate) selection: Selection,
    action: Option<Action>,
    /// Said once: the replay is read only.
    told_read_only: bool,
    /// Said once: no read or access watchpoints.
    told_no_read_watch: bool,
}

/// Errors end the gdb session only when the replay itself failed.
pub(crate) type Error = VmError;

impl ReplayTarget {
    pub(crate) fn new(driver: DebugDriver, timeline: Timeline, files: OpenFiles) -> Self {
        ReplayTarget {
            driver,
            timeline,
            files,
            selection: Selection::default(),
            action: None,
            told_read_only: false,
            told_no_read_watch: false,
        }
    }

    fn pid(&self) -> u32 {
        self.driver.debug().process().map_or(1, |p| p.pid)
    }

    /// A thread to name when none is concerned.
    fn some_thread(&self) -> Tid {
        let lwpid = self
            .driver
            .debug()
            .threads()
            .first()
            .copied()
            .unwrap_or_else(|| self.pid());
        tid(lwpid)
    }

    /// Reads the process's memory at `at`: what its pages hold, and for
    /// pages of its files it has not touched yet, the files' bytes.
    fn read_memory(&self, at: u64, buf: &mut [u8]) -> usize {
        let Some(process) = self.driver.debug().process() else {
            return 0;
        };
        let mut done = 0;
        let mut libraries = None;
        while done < buf.len() {
            let at = at.wrapping_add(done as u64);
            // To the end of the page at most: the next may be in memory.
            let page_left = (PAGE_SIZE - at % PAGE_SIZE) as usize;
            let end = buf.len().min(done + page_left);
            let mut n = self.driver.read_user(at, &mut buf[done..end]);
            if n == 0 {
                let libraries = libraries.get_or_insert_with(|| self.libraries());
                n = read_from_files(
                    &self.files,
                    &process.exe,
                    &process.auxv,
                    libraries,
                    at,
                    &mut buf[done..end],
                );
            }
            if n == 0 {
                break;
            }
            done += n;
        }
        done
    }

    /// The shared libraries the dynamic linker has loaded, as (path, load
    /// bias).
    fn libraries(&self) -> Vec<(String, u64)> {
        let Some(process) = self.driver.debug().process() else {
            return Vec::new();
        };
        let memory = |at: u64, buf: &mut [u8]| self.driver.read_user(at, buf);
        link_map(&process.auxv, &|at, b| {
            let n = memory(at, b);
            if n > 0 {
                return n;
            }
            read_from_files(&self.files, &process.exe, &process.auxv, &[], at, b)
        })
        .map(|(_, entries)| entries.into_iter().map(|e| (e.name, e.l_addr)).collect())
        .unwrap_or_default()
    }

    /// Where the functions of the process's code start, for going back
    /// an instruction (the objects as they are mapped now).
    fn code_map(&self) -> CodeMap {
        let process = self.driver.debug().process();
        CodeMap {
            exe: process.map(|p| p.exe.clone()).unwrap_or_default(),
            auxv: process.map(|p| p.auxv.clone()).unwrap_or_default(),
            libraries: self.libraries(),
        }
    }

    fn read_only(&mut self, what: &str) {
        if !self.told_read_only {
            eprintln!(
                "insight: {what} refused: a replay is read only (it must stay the recorded run)"
            );
            self.told_read_only = true;
        }
    }

    /// Does what gdb asked (the vCPU runs on this thread meanwhile); the
    /// stop to report.
    pub(crate) fn perform(&mut self) -> Result<Reason, Error> {
        let action = self.action.take().unwrap_or(Action::Continue);
        let from = self.timeline.now;
        match action {
            Action::Continue => {
                let event = self.driver.resume(Resume::Continue)?;
                Ok(self.forward_stop(event, None, from))
            }
            Action::Step(lwpid) => {
                let event = self.driver.resume(Resume::Step(lwpid))?;
                Ok(self.forward_stop(event, Some(lwpid), from))
            }
            Action::ReverseContinue | Action::ReverseStep(_) => {
                let map = self.code_map();
                let files = &self.files;
                let starts = |at: u64| map.function_start(files, at);
                let back = match action {
                    Action::ReverseStep(lwpid) => {
                        self.timeline.reverse_step(&mut self.driver, lwpid, &starts)
                    }
                    _ => self.timeline.reverse_continue(&mut self.driver, &starts),
                };
                match back {
                    Ok(back) => Ok(self.back_stop(back)),
                    Err(e) => self.back_failed(e, from),
                }
            }
        }
    }

    /// A reverse command failed: the replay goes back to where it was,
    /// and gdb hears of an interruption there. A replay that diverged
    /// from the recording shows nothing true any more: the session ends.
    fn back_failed(
        &mut self,
        e: VmError,
        from: vmm::tools::debug::Position,
    ) -> Result<Reason, Error> {
        if matches!(e, VmError::Journal(_)) {
            return Err(e);
        }
        eprintln!("insight: {e}");
        self.timeline.seek(&mut self.driver, from)?;
        let lwpid = from
            .user
            .map_or_else(|| self.some_thread(), |u| tid(u.lwpid));
        Ok(Reason::SignalWithThread {
            tid: lwpid,
            signal: Signal::SIGINT,
        })
    }

    fn forward_stop(
        &mut self,
        event: DebugEvent,
        stepping: Option<u32>,
        from: vmm::tools::debug::Position,
    ) -> Reason {
        match event {
            DebugEvent::Stopped(stop) => {
                self.timeline.now = stop.position;
                let step_ended = matches!(stop.kind, StopKind::Step | StopKind::Watch { .. });
                if step_ended && stepping.is_some() && stop.lwpid == stepping {
                    self.timeline.stepped(from, stop.position);
                }
                self.reason(&stop)
            }
            DebugEvent::Ended { stop, exit_status } => {
                eprintln!(
                    "insight: the replay reached the recording's end ({stop:?}{}): go back with \
                     reverse-continue or reverse-stepi",
                    exit_status.map_or(String::new(), |s| format!(", status {s}"))
                );
                Reason::ReplayLog {
                    tid: Some(self.some_thread()),
                    pos: ReplayLogPosition::End,
                }
            }
        }
    }

    fn back_stop(&mut self, back: Back) -> Reason {
        match back {
            Back::Stopped(stop) => self.reason(&stop),
            Back::Start => Reason::ReplayLog {
                tid: Some(
                    self.timeline
                        .start
                        .user
                        .map_or_else(|| self.some_thread(), |u| tid(u.lwpid)),
                ),
                pos: ReplayLogPosition::Begin,
            },
        }
    }

    fn reason(&self, stop: &Stop) -> Reason {
        let thread = stop.lwpid.map_or_else(|| self.some_thread(), tid);
        match stop.kind {
            StopKind::Breakpoint { .. } => Reason::SwBreak(thread),
            StopKind::Watch { addr } => Reason::Watch {
                tid: thread,
                kind: WatchKind::Write,
                addr,
            },
            StopKind::Interrupted => Reason::SignalWithThread {
                tid: thread,
                signal: Signal::SIGINT,
            },
            StopKind::ProcessExited { status } => {
                eprintln!(
                    "insight: the process exited (status {status}); the replay stops here: go back \
                     with reverse-continue or reverse-stepi"
                );
                Reason::ReplayLog {
                    tid: Some(thread),
                    pos: ReplayLogPosition::End,
                }
            }
            StopKind::Started | StopKind::Step | StopKind::Reached => Reason::SignalWithThread {
                tid: thread,
                signal: Signal::SIGTRAP,
            },
        }
    }
}

fn tid(lwpid: u32) -> Tid {
    NonZeroUsize::new(lwpid as usize).unwrap_or(NonZeroUsize::MIN)
}

fn lwpid(tid: Tid) -> u32 {
    u32::try_from(tid.get()).unwrap_or(u32::MAX)
}

impl Target for ReplayTarget {
    type Arch = X86_64Linux;
    type Error = Error;

    fn base_ops(&mut self) -> BaseOps<'_, X86_64Linux, Error> {
        BaseOps::MultiThread(self)
    }

    fn support_breakpoints(&mut self) -> Option<BreakpointsOps<'_, Self>> {
        Some(self)
    }

    fn support_exec_file(&mut self) -> Option<ExecFileOps<'_, Self>> {
        Some(self)
    }

    fn support_host_io(&mut self) -> Option<HostIoOps<'_, Self>> {
        Some(self)
    }

    fn support_auxv(&mut self) -> Option<AuxvOps<'_, Self>> {
        Some(self)
    }

    fn support_libraries_svr4(&mut self) -> Option<LibrariesSvr4Ops<'_, Self>> {
        Some(self)
    }

    fn support_extended_mode(&mut self) -> Option<ExtendedModeOps<'_, Self>> {
        Some(self)
    }

    fn use_fork_stop_reason(&self) -> bool {
        false
    }

    fn use_vfork_stop_reason(&self) -> bool {
        false
    }

    fn use_vforkdone_stop_reason(&self) -> bool {
        false
    }
}

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

impl MultiThreadResume for ReplayTarget {
    fn resume(&mut self) -> Result<(), Error> {
        if self.action.is_none() {
            self.action = Some(Action::Continue);
        }
        Ok(())
    }

    fn clear_resume_actions(&mut self) -> Result<(), Error> {
        self.action = None;
        Ok(())
    }

    fn set_resume_action_continue(&mut self, _: Tid, _: Option<Signal>) -> Result<(), Error> {
        // Signals cannot be given to a replay: the recorded run's go on.
        Ok(())
    }

    fn support_single_step(&mut self) -> Option<MultiThreadSingleStepOps<'_, Self>> {
        Some(self)
    }

    fn support_reverse_cont(&mut self) -> Option<ReverseContOps<'_, Tid, Self>> {
        Some(self)
    }

    fn support_reverse_step(&mut self) -> Option<ReverseStepOps<'_, Tid, Self>> {
        Some(self)
    }

    fn support_scheduler_locking(&mut self) -> Option<MultiThreadSchedulerLockingOps<'_, Self>> {
        Some(self)
    }
}

impl MultiThreadSingleStep for ReplayTarget {
    fn set_resume_action_step(&mut self, tid: Tid, _: Option<Signal>) -> Result<(), Error> {
        self.action = Some(Action::Step(lwpid(tid)));
        Ok(())
    }
}

impl MultiThreadSchedulerLocking for ReplayTarget {
    fn set_resume_action_scheduler_lock(&mut self) -> Result<(), Error> {
        // The other threads run as recorded: a replay cannot hold them.
        Ok(())
    }
}

impl ReverseCont<Tid> for ReplayTarget {
    fn reverse_cont(&mut self) -> Result<(), Error> {
        self.action = Some(Action::ReverseContinue);
        Ok(())
    }
}

impl ReverseStep<Tid> for ReplayTarget {
    fn reverse_step(&mut self, tid: Tid) -> Result<(), Error> {
        // gdb asks for "any thread" before `bs`, meaning the one selected.
        let lwpid = match (self.selection.continue_any, self.selection.general) {
            (true, Some(selected)) => selected,
            _ => lwpid(tid),
        };
        self.action = Some(Action::ReverseStep(lwpid));
        Ok(())
    }
}

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

impl Breakpoints for ReplayTarget {
    fn support_sw_breakpoint(&mut self) -> Option<SwBreakpointOps<'_, Self>> {
        Some(self)
    }

    fn support_hw_breakpoint(&mut self) -> Option<HwBreakpointOps<'_, Self>> {
        Some(self)
    }

    fn support_hw_watchpoint(&mut self) -> Option<HwWatchpointOps<'_, Self>> {
        Some(self)
    }
}

/// Write watchpoints trap every write to the watched pages; reads cannot
/// be trapped (user-mode loads never exit on these hosts).
impl HwWatchpoint for ReplayTarget {
    fn add_hw_watchpoint(
        &mut self,
        addr: u64,
        len: u64,
        kind: WatchKind,
    ) -> TargetResult<bool, Self> {
        if kind != WatchKind::Write {
            if !self.told_no_read_watch {
                eprintln!(
                    "insight: read and access watchpoints are not supported (loads in user mode \
                     cannot be trapped on this host); use watch, which traps every write"
                );
                self.told_no_read_watch = true;
            }
            return Ok(false);
        }
        if len == 0 || len > 4096 {
            return Ok(false);
        }
        self.driver.debug_mut().add_watch(addr, len);
        Ok(true)
    }

    fn remove_hw_watchpoint(
        &mut self,
        addr: u64,
        len: u64,
        kind: WatchKind,
    ) -> TargetResult<bool, Self> {
        Ok(kind == WatchKind::Write && self.driver.debug_mut().remove_watch(addr, len))
    }
}

impl SwBreakpoint for ReplayTarget {
    fn add_sw_breakpoint(&mut self, addr: u64, _: usize) -> TargetResult<bool, Self> {
        self.driver.debug_mut().add_breakpoint(addr);
        Ok(true)
    }

    fn remove_sw_breakpoint(&mut self, addr: u64, _: usize) -> TargetResult<bool, Self> {
        self.driver.debug_mut().remove_breakpoint(addr);
        Ok(true)
    }
}

/// Hardware breakpoints are the same breakpoints: this host's KVM has no
/// user-mode debug registers.
impl HwBreakpoint for ReplayTarget {
    fn add_hw_breakpoint(&mut self, addr: u64, kind: usize) -> TargetResult<bool, Self> {
        self.add_sw_breakpoint(addr, kind)
    }

    fn remove_hw_breakpoint(&mut self, addr: u64, kind: usize) -> TargetResult<bool, Self> {
        self.remove_sw_breakpoint(addr, kind)
    }
}

impl ExecFile for ReplayTarget {
    fn get_exec_file(
        &self,
        _: Option<Pid>,
        offset: u64,
        length: usize,
        buf: &mut [u8],
    ) -> TargetResult<usize, Self> {
        let exe = self.driver.debug().process().map_or("", |p| p.exe.as_str());
        Ok(copy_out(exe.as_bytes(), offset, length, buf))
    }
}

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

impl ExtendedMode for ReplayTarget {
    fn run(&mut self, _: Option<&[u8]>, _: Args<'_, '_>) -> TargetResult<Pid, Self> {
        Err(TargetError::NonFatal)
    }

    fn attach(&mut self, _: Pid) -> TargetResult<(), Self> {
        Err(TargetError::NonFatal)
    }

    fn query_if_attached(&mut self, _: Pid) -> TargetResult<AttachKind, Self> {
        Ok(AttachKind::Attach)
    }

    fn kill(&mut self, _: Option<Pid>) -> TargetResult<ShouldTerminate, Self> {
        Ok(ShouldTerminate::Yes)
    }

    fn restart(&mut self) -> Result<(), Error> {
        Ok(())
    }

    fn support_current_active_pid(&mut self) -> Option<CurrentActivePidOps<'_, Self>> {
        Some(self)
    }
}

impl CurrentActivePid for ReplayTarget {
    fn current_active_pid(&mut self) -> Result<Pid, Error> {
        Ok(NonZeroUsize::new(self.pid() as usize).unwrap_or(NonZeroUsize::MIN))
    }
}

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
    fn the_selection_follows_hg_and_hc_packets() {
        let mut s = Selection::default();
        for b in b"$Hgp1092.1094#00$Hcp1092.0#00" {
            s.feed(*b);
        }
        assert_eq!(s.general, Some(0x1094));
        assert!(s.continue_any);
        for b in b"$Hc1093#00" {
            s.feed(*b);
        }
        assert!(!s.continue_any);
        // "Hg0" (any) keeps the thread selected.
        for b in b"$Hg0#00$Hc-1#00" {
            s.feed(*b);
        }
        assert_eq!(s.general, Some(0x1094));
        assert!(s.continue_any);
    }

    #[test]
    fn x87_tags_are_empty_or_valid() {
        assert_eq!(full_tag_word(0), 0xffff);
        assert_eq!(full_tag_word(0xff), 0);
        assert_eq!(full_tag_word(0b1000_0001), 0x3ffc);
    }
}
