//! The replay as gdb sees it: one process, its threads, its memory and
//! files, read only; forward and reverse execution. This file is the
//! target itself and what gdb asked it to do; each protocol extension it
//! supports has a file of its own, as in gdbstub's examples: the base
//! (`base.rs`: registers, memory, threads), resuming (`resume.rs`),
//! reverse execution (`reverse_exec.rs`), thread details (`threads.rs`),
//! breakpoints (`breakpoints.rs`), watchpoints (`watchpoints.rs`), the
//! executable (`exec_file.rs`), the auxiliary vector (`auxv.rs`), the
//! libraries (`libraries.rs`), the extended mode (`extended_mode.rs`) and
//! host I/O (`host_io.rs`).

mod auxv;
mod base;
mod breakpoints;
mod exec_file;
mod extended_mode;
mod host_io;
mod libraries;
mod resume;
mod reverse_exec;
mod threads;
mod watchpoints;

use std::num::NonZeroUsize;

use gdbstub::common::{Signal, Tid};
use gdbstub::stub::MultiThreadStopReason;
use gdbstub::target::ext::auxv::AuxvOps;
use gdbstub::target::ext::base::reverse_exec::ReplayLogPosition;
use gdbstub::target::ext::base::BaseOps;
use gdbstub::target::ext::breakpoints::{BreakpointsOps, WatchKind};
use gdbstub::target::ext::exec_file::ExecFileOps;
use gdbstub::target::ext::extended_mode::ExtendedModeOps;
use gdbstub::target::ext::host_io::HostIoOps;
use gdbstub::target::ext::libraries::LibrariesSvr4Ops;
use gdbstub::target::Target;
use vmm::session::{DebugDriver, DebugEvent};
use vmm::tools::debug::{Resume, Stop, StopKind};
use vmm::VmError;

use crate::arch::X86_64Linux;
use crate::files::{
    link_map, read_from_files, unrecordable_text, MappedObjects, OpenFiles, Unrecordable,
};
use crate::history::{Back, History};

pub(crate) type GdbStopReason = MultiThreadStopReason<u64>;

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
    /// A stop is reported: gdb takes its thread for the stub's general
    /// thread from then on (remote.c's `record_currthread`), without an
    /// `Hg`: the next "any thread" step or reverse step is that thread's.
    pub(crate) fn stopped(&mut self, reason: &GdbStopReason) {
        let thread = match reason {
            GdbStopReason::SwBreak(t) | GdbStopReason::HwBreak(t) => Some(*t),
            GdbStopReason::SignalWithThread { tid, .. } | GdbStopReason::Watch { tid, .. } => {
                Some(*tid)
            }
            GdbStopReason::ReplayLog { tid, .. } => *tid,
            _ => None,
        };
        if let Some(t) = thread {
            self.general = Some(lwpid(t));
        }
    }

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
    pub(crate) history: History,
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
    pub(crate) fn new(driver: DebugDriver, history: History, files: OpenFiles) -> Self {
        ReplayTarget {
            driver,
            history,
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
    pub(crate) fn mapped_objects(&self) -> MappedObjects {
        let process = self.driver.debug().process();
        MappedObjects {
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
    pub(crate) fn perform(&mut self) -> Result<GdbStopReason, Error> {
        let action = self.action.take().unwrap_or(Action::Continue);
        let from = self.history.now;
        match action {
            Action::Continue => match self.driver.resume(Resume::Continue) {
                Ok(event) => Ok(self.forward_stop(event, None, from)),
                Err(e) => self.forward_failed(e, from),
            },
            Action::Step(lwpid) => match self.driver.resume(Resume::Step(lwpid)) {
                Ok(event) => Ok(self.forward_stop(event, Some(lwpid), from)),
                Err(e) => self.forward_failed(e, from),
            },
            Action::ReverseContinue | Action::ReverseStep(_) => {
                let map = self.mapped_objects();
                let files = &self.files;
                let starts = |at: u64| map.function_start(files, at);
                let back = match action {
                    Action::ReverseStep(lwpid) => {
                        self.history.reverse_step(&mut self.driver, lwpid, &starts)
                    }
                    _ => self.history.reverse_continue(&mut self.driver, &starts),
                };
                match back {
                    Ok(back) => Ok(self.back_stop(back)),
                    Err(e) => self.back_failed(e, from),
                }
            }
        }
    }

    /// A reverse command failed: the replay goes back to where it was,
    /// and gdb hears of an interruption there. Where the program runs an
    /// instruction whose result this host cannot record (RDRAND), the
    /// replay going forward again gave it another result, and positions
    /// after it cannot be found again: that is said, and the replay stays
    /// at the latest snapshot at or before where it was, which it can
    /// reach. A replay that diverged from the recording shows nothing true
    /// any more: the session ends.
    fn back_failed(
        &mut self,
        e: VmError,
        from: vmm::tools::debug::Position,
    ) -> Result<GdbStopReason, Error> {
        if matches!(e, VmError::Journal(_)) {
            return Err(e);
        }
        let found = self.mapped_objects().unrecordable(&self.files);
        if found.is_empty() {
            eprintln!("insight: {e}");
        } else {
            eprintln!("insight: {}", diverged_text(&found, &e));
        }
        self.stand_reachable(from)
    }

    /// Going forward, the replay met what the recording does not have.
    /// After an instruction whose result this host cannot record (see
    /// [`Self::back_failed`]) that is the replay giving the program
    /// another result, not a broken recording: it is said, and the
    /// replay stays where it can still stand, for going back. Any other
    /// divergence ends the session.
    fn forward_failed(
        &mut self,
        e: VmError,
        from: vmm::tools::debug::Position,
    ) -> Result<GdbStopReason, Error> {
        if !e.is_divergence() {
            return Err(e);
        }
        let found = self.mapped_objects().unrecordable(&self.files);
        if found.is_empty() {
            return Err(e);
        }
        eprintln!(
            "insight: {}; going forward, the replay cannot pass that point: go back with \
             reverse-continue or reverse-stepi",
            diverged_text(&found, &e)
        );
        self.stand_reachable(from)
    }

    /// Takes the replay to `from` or, where that cannot be found again,
    /// to the latest snapshot at or before it; the stop gdb hears of
    /// there (an interruption).
    fn stand_reachable(
        &mut self,
        from: vmm::tools::debug::Position,
    ) -> Result<GdbStopReason, Error> {
        let at = match self.history.seek(&mut self.driver, from) {
            Ok(()) => from,
            Err(VmError::Debug(_)) => {
                let snapshot = (self.driver.snapshots().iter())
                    .rposition(|s| s.ordinal() <= from.ordinal)
                    .unwrap_or(0);
                let ordinal =
                    (self.driver.snapshots().get(snapshot)).map_or(from.ordinal, |s| s.ordinal());
                let at = vmm::tools::debug::Position {
                    ordinal,
                    user: None,
                };
                self.history.seek(&mut self.driver, at)?;
                eprintln!(
                    "insight: the replay stands at the last snapshot it can reach, at exit \
                     {ordinal}"
                );
                at
            }
            Err(e) => return Err(e),
        };
        let lwpid = at.user.map_or_else(|| self.some_thread(), |u| tid(u.lwpid));
        Ok(GdbStopReason::SignalWithThread {
            tid: lwpid,
            signal: Signal::SIGINT,
        })
    }

    fn forward_stop(
        &mut self,
        event: DebugEvent,
        stepping: Option<u32>,
        from: vmm::tools::debug::Position,
    ) -> GdbStopReason {
        match event {
            DebugEvent::Stopped(stop) => {
                self.history.now = stop.position;
                let step_ended = matches!(stop.kind, StopKind::Step | StopKind::Watch { .. });
                if step_ended && stepping.is_some() && stop.lwpid == stepping {
                    self.history.stepped(from, stop.position);
                }
                self.reason(&stop)
            }
            DebugEvent::Ended { stop, exit_status } => {
                eprintln!(
                    "insight: the replay reached the recording's end ({stop:?}{}): go back with \
                     reverse-continue or reverse-stepi",
                    exit_status.map_or(String::new(), |s| format!(", status {s}"))
                );
                GdbStopReason::ReplayLog {
                    tid: Some(self.some_thread()),
                    pos: ReplayLogPosition::End,
                }
            }
        }
    }

    fn back_stop(&mut self, back: Back) -> GdbStopReason {
        match back {
            Back::Stopped(stop) => self.reason(&stop),
            Back::Start => GdbStopReason::ReplayLog {
                tid: Some(
                    self.history
                        .start
                        .user
                        .map_or_else(|| self.some_thread(), |u| tid(u.lwpid)),
                ),
                pos: ReplayLogPosition::Begin,
            },
        }
    }

    fn reason(&self, stop: &Stop) -> GdbStopReason {
        let thread = stop.lwpid.map_or_else(|| self.some_thread(), tid);
        match stop.kind {
            StopKind::Breakpoint { .. } => GdbStopReason::SwBreak(thread),
            StopKind::Watch { addr } => GdbStopReason::Watch {
                tid: thread,
                kind: WatchKind::Write,
                addr,
            },
            StopKind::Interrupted => GdbStopReason::SignalWithThread {
                tid: thread,
                signal: Signal::SIGINT,
            },
            StopKind::ProcessExited { status } => {
                eprintln!(
                    "insight: the process exited (status {status}); the replay stops here: go back \
                     with reverse-continue or reverse-stepi"
                );
                GdbStopReason::ReplayLog {
                    tid: Some(thread),
                    pos: ReplayLogPosition::End,
                }
            }
            StopKind::Started | StopKind::Step | StopKind::Reached => {
                GdbStopReason::SignalWithThread {
                    tid: thread,
                    signal: Signal::SIGTRAP,
                }
            }
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

/// What the debugger says of a replay whose registers left the
/// recording's after one of `found`, the instructions of the process
/// whose result the host cannot record.
fn diverged_text(found: &[Unrecordable], e: &VmError) -> String {
    format!(
        "diverged: the program's registers differ from the recorded run's after {}: an \
         instruction whose result insight cannot record on this host (its user code runs \
         natively, unseen), so positions after it cannot be reached again ({e})",
        unrecordable_text(found)
    )
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
}
