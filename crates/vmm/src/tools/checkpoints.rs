//! Checkpoints: the complete state of a replaying VM at a deterministic
//! exit — vCPU, memory, devices, disk overlay, clock, the log position —
//! stored in the trace (`trace::checkpoints`) and restored into a new VM,
//! which then replays on from there, every exit checked as usual.
//!
//! Memory is stored incrementally: each checkpoint holds the pages that
//! differ from the previous checkpoint of the same replay (the first, the
//! pages that are not zero), found by comparing guest memory with a copy
//! kept since then, so the VMM's own writes (disk and network data, the
//! probe gate) count as much as the guest's. A checkpoint names its
//! predecessor by exit and digest; restoring one applies the chain from
//! the first. The disk overlay is stored the same way, as sector runs.
//!
//! A checkpoint is taken only where the VM is at rest: right after a
//! deterministic exit, with no disk request in flight, no frame waiting
//! for the guest, and no search for an asynchronous point under way.
//! Which exits those are depends only on the log, so every replay with
//! the same interval takes its checkpoints at the same exits.

use std::path::{Path, PathBuf};
use std::time::Instant;

use devices::virtio_blk::VirtioBlock;
use trace::checkpoints::{self, Digest32, StoredCheckpoint};

use super::report::{CheckpointTaken, ToolReport};
use super::tool::{ReplayTool, ToolContext};
use crate::vm::state::PointStats;
use crate::vm::state::{changed_pages, check_memory, Checkpoint, EventsState, VmState};
use crate::vm::{Machine, VmError};
use journal::{LogPosition, ReplayPoint};

/// How often a replay takes a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointEvery {
    /// Every so many deterministic exits.
    Exits(u64),
    /// Every so much recorded guest time (the paravirtual clock's
    /// nanoseconds, as the log has them: the same in every replay).
    GuestNs(u64),
}

impl CheckpointEvery {
    /// The spacing of the checkpoints `stored` (in guest time, from the
    /// start of the run), to take a set like it again; `None` if there is
    /// none.
    pub fn like(stored: &[StoredCheckpoint]) -> Option<CheckpointEvery> {
        let last = stored.iter().map(|c| c.guest_ns).max()?;
        let each = last / stored.len() as u64;
        // Checkpoints whose heads say no time are spaced by exits instead.
        Some(match each {
            0 => CheckpointEvery::Exits(stored.iter().map(|c| c.exit).max()? / stored.len() as u64),
            ns => CheckpointEvery::GuestNs(ns),
        })
    }

    /// Where the next checkpoint is due when one was taken at `position`.
    fn after(self, position: &LogPosition) -> ReplayPoint {
        match self {
            CheckpointEvery::Exits(n) => ReplayPoint::Exit(position.exits + n),
            CheckpointEvery::GuestNs(ns) => ReplayPoint::GuestNs(position.guest_ns + ns),
        }
    }
}

/// A checkpoint restored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointRestored {
    pub exit: u64,
    pub guest_ns: u64,
    /// Checkpoints read (the chain from the first).
    pub chain: usize,
    pub took_ns: u64,
}

/// Where a replay restored from a checkpoint stands: the checkpoint
/// (exit, digest), and guest memory as the restore wrote it, where a new
/// set of checkpoints goes on.
pub(crate) struct RestoredFrom {
    pub(crate) checkpoint: (u64, Digest32),
    pub(crate) shadow: Vec<u8>,
}

/// Taking checkpoints during a replay.
pub(crate) struct CheckpointTaker {
    trace: PathBuf,
    identity: Digest32,
    every: CheckpointEvery,
    /// Where the next one is due.
    next_due: ReplayPoint,
    /// Guest memory as of the last checkpoint (zeros before the first).
    shadow: Vec<u8>,
    previous: Option<(u64, Digest32)>,
    taken: Vec<CheckpointTaken>,
}

impl CheckpointTaker {
    /// Takes a checkpoint of a guest with `ram` bytes every `every` into
    /// `trace`, from `position` on, replacing the checkpoints it had (or,
    /// after a restore, those after the checkpoint `restored`).
    pub(crate) fn new(
        trace: &Path,
        every: CheckpointEvery,
        position: &LogPosition,
        ram: usize,
        restored: Option<RestoredFrom>,
    ) -> Result<Self, VmError> {
        let identity = checkpoints::trace_identity(trace).map_err(ckpt_err)?;
        let (previous, shadow) = match restored {
            Some(r) => (Some(r.checkpoint), r.shadow),
            None => {
                checkpoints::clear(trace).map_err(ckpt_err)?;
                (None, vec![0u8; ram])
            }
        };
        if let Some((exit, _)) = previous {
            // Checkpoints after the restored one belong to another set.
            for c in checkpoints::list(trace).map_err(ckpt_err)? {
                if c.exit > exit {
                    std::fs::remove_file(&c.path).map_err(|source| {
                        ckpt_err(trace::TraceError::Io {
                            path: c.path.clone(),
                            source,
                        })
                    })?;
                }
            }
        }
        Ok(CheckpointTaker {
            trace: trace.to_owned(),
            identity,
            every,
            next_due: every.after(position),
            shadow,
            previous,
            taken: Vec::new(),
        })
    }

    /// Whether one is due at `position`.
    pub(crate) fn due(&self, position: &LogPosition) -> bool {
        self.next_due.reached(position)
    }

    /// The checkpoints taken.
    pub(crate) fn taken(&self) -> &[CheckpointTaken] {
        &self.taken
    }

    /// Takes one of the machine `m` (at rest, right after a deterministic
    /// exit), whose replay stands at `position` with `points` reached and
    /// the event capture at `events`.
    pub(crate) fn take(
        &mut self,
        m: &mut Machine,
        position: LogPosition,
        points: PointStats,
        events: Option<EventsState>,
    ) -> Result<(), VmError> {
        let started = Instant::now();
        m.vcpu.complete_exit()?;
        let msrs = m.vm.msr_index_list()?;
        let vcpu = m.vcpu.state(&msrs)?;
        let (block, overlay) = match &mut m.vm.block {
            Some(b) => (b.state(), b.overlay_changes()?),
            None => (None, Vec::new()),
        };
        let memory = changed_pages(&m.vm.mem, &mut self.shadow);
        let pages = memory.pages.len() as u64;
        let checkpoint = Checkpoint {
            exit: position.exits,
            previous: self.previous,
            log: position,
            vm_ns: m.vm.clock.now_ns(),
            memory_bytes: self.shadow.len() as u64,
            memory,
            vcpu,
            platform: m.vm.platform.state(),
            block,
            overlay,
            net: m.vm.net.as_ref().map(|n| n.state()),
            console: m.vm.console.state(),
            host_files: m.vm.host_files.as_ref().map(|h| h.device.state()),
            vm: VmState::of(&m.vm, &m.vcpu, points),
            events,
        };
        let (digest, bytes) = checkpoints::write(
            &self.trace,
            &self.identity,
            position.exits,
            position.guest_ns,
            &checkpoint,
        )
        .map_err(|source| VmError::StoreCheckpoint {
            exit: position.exits,
            stored: self.taken.len(),
            source,
        })?;
        self.previous = Some((position.exits, digest));
        self.next_due = self.every.after(&position);
        self.taken.push(CheckpointTaken {
            exit: position.exits,
            guest_ns: position.guest_ns,
            pages,
            bytes,
            took_ns: started.elapsed().as_nanos() as u64,
        });
        Ok(())
    }
}

/// Checkpoints taken right after the checked exits where one is due.
impl ReplayTool for CheckpointTaker {
    /// Takes a checkpoint if one is due and the machine is at rest. Not
    /// while a mark keeps the events' time ahead of the last clock read:
    /// a replay from the checkpoint would not know it.
    fn after_exit(&mut self, cx: &mut ToolContext, m: &mut Machine) -> Result<(), VmError> {
        let position = cx.log.position();
        if !self.due(&position) || cx.points.patched() || cx.log.mark_time_pending() || !at_rest(m)
        {
            return Ok(());
        }
        let events = cx.events.as_deref().map(|e| e.state(cx.sample_marks));
        self.take(m, position, cx.points.stats, events)
    }

    fn report(&self, report: &mut ToolReport) {
        report.checkpoints = self.taken().to_vec();
    }
}

/// Whether the machine is at rest for a checkpoint: no disk request in
/// flight, no frame waiting, no exception on its way (the caller checks
/// that no trampoline is in place). The host files' requests are all
/// answered at the exit that made them.
pub(crate) fn at_rest(m: &Machine) -> bool {
    !m.vcpu.exception_pending
        && m.vm.block.as_ref().is_none_or(VirtioBlock::at_rest)
        && m.vm.net.as_ref().is_none_or(|n| n.pending_frames() == 0)
}

/// The trace's checkpoint a replay from `point` starts at: the latest at
/// or before it (`None`: there is none).
pub fn checkpoint_before(
    trace: &Path,
    point: ReplayPoint,
) -> Result<Option<StoredCheckpoint>, VmError> {
    let stored = checkpoints::list(trace).map_err(ckpt_err)?;
    // Another trace's checkpoint copied in is passed over for the
    // trace's own before it.
    Ok(stored
        .into_iter()
        .filter(|c| !c.foreign)
        .rfind(|c| match point {
            ReplayPoint::Exit(e) => c.exit <= e,
            ReplayPoint::GuestNs(ns) => c.guest_ns <= ns,
        }))
}

/// Why the trace's checkpoint at `exit` cannot start a replay that
/// collects events (`stacks`: and unwinds stacks by call-frame
/// information); `None` if it can.
pub fn checkpoint_unfit(
    trace: &Path,
    exit: u64,
    stacks: bool,
    sample_marks: Option<u64>,
) -> Result<Option<String>, VmError> {
    let identity = checkpoints::trace_identity(trace).map_err(ckpt_err)?;
    let path = checkpoints::list(trace)
        .map_err(ckpt_err)?
        .into_iter()
        .find(|c| c.exit == exit)
        .ok_or_else(|| VmError::Restore(format!("the trace has no checkpoint at exit {exit}")))?
        .path;
    let (checkpoint, _) = checkpoints::read::<Checkpoint>(&path, &identity).map_err(ckpt_err)?;
    Ok(unfit_for_events(&checkpoint, stacks, sample_marks))
}

/// Why `c` cannot start event capture (with `stacks` unwound by CFI,
/// sampling at the recording's marks every `sample_marks` ns).
pub(crate) fn unfit_for_events(
    c: &Checkpoint,
    stacks: bool,
    sample_marks: Option<u64>,
) -> Option<String> {
    match &c.events {
        None => Some(format!(
            "the checkpoint at exit {} was taken by a replay that collected no events",
            c.exit
        )),
        Some(e) if stacks && e.processes.is_none() => Some(format!(
            "the checkpoint at exit {} was taken by a replay that did not unwind stacks by \
             call-frame information",
            c.exit
        )),
        Some(e) if e.sample_marks != sample_marks => Some(format!(
            "the checkpoint at exit {} was taken by a replay that {}",
            c.exit,
            match e.sample_marks {
                Some(ns) => format!(
                    "sampled at the recording's marks every {:.1} ms",
                    ns as f64 / 1e6
                ),
                None => "did not sample at the recording's marks".to_owned(),
            }
        )),
        Some(_) => None,
    }
}

/// The trace's checkpoint at `exit` and those it builds on, newest first,
/// each link checked, and the digest of the newest.
pub(crate) fn read_chain(trace: &Path, exit: u64) -> Result<(Vec<Checkpoint>, Digest32), VmError> {
    let identity = checkpoints::trace_identity(trace).map_err(ckpt_err)?;
    let stored = checkpoints::list(trace).map_err(ckpt_err)?;
    let path_of = |exit: u64| {
        stored
            .iter()
            .find(|c| c.exit == exit)
            .map(|c| c.path.clone())
    };
    let Some(path) = path_of(exit) else {
        return Err(VmError::Restore(format!(
            "the trace has no checkpoint at exit {exit}"
        )));
    };
    let (newest, digest) = checkpoints::read::<Checkpoint>(&path, &identity).map_err(ckpt_err)?;
    let mut chain = vec![newest];
    while let Some((exit, digest)) = chain.last().and_then(|c| c.previous) {
        let Some(path) = path_of(exit) else {
            return Err(VmError::Restore(format!(
                "checkpoint at exit {} needs the one at exit {exit}, which is missing",
                chain.last().map_or(0, |c| c.exit)
            )));
        };
        let (older, found) = checkpoints::read::<Checkpoint>(&path, &identity).map_err(ckpt_err)?;
        if found != digest || older.exit != exit {
            return Err(VmError::Restore(format!(
                "checkpoint at exit {} follows a checkpoint at exit {exit} that has since been \
                 replaced",
                chain.last().map_or(0, |c| c.exit)
            )));
        }
        chain.push(older);
    }
    Ok((chain, digest))
}

/// Restores the machine (memory, disk overlay, vCPU, devices, the VMM's
/// own state) from `chain`, newest first, every link already checked
/// against it (`check_shape`); returns guest memory as written.
pub(crate) fn apply(m: &mut Machine, chain: &[Checkpoint]) -> Result<Vec<u8>, VmError> {
    // Memory: from zeros, oldest changes first; the copy kept for a new
    // set of checkpoints is the same.
    let shadow = m.vm.load_memory(chain.iter().rev().map(|c| &c.memory))?;
    if let Some(block) = &mut m.vm.block {
        for c in chain.iter().rev() {
            block.apply_overlay(c.overlay.clone())?;
        }
    }
    chain[0].machine_state().put_into(m)?;
    Ok(shadow)
}

/// Checks what a checkpoint says against the machine before any of it is
/// used: memory size, page numbers and lengths, the devices it has.
pub(crate) fn check_shape(c: &Checkpoint, m: &Machine) -> Result<(), VmError> {
    check_memory(c, m.vm.ram_bytes())?;
    let (block, net) = (m.vm.block.is_some(), m.vm.net.is_some());
    let refuse = |why: String| {
        Err(VmError::Restore(format!(
            "checkpoint at exit {}: {why}",
            c.exit
        )))
    };
    if c.block.is_some() != block || (!block && !c.overlay.is_empty()) {
        return refuse("its disk differs from the trace's".into());
    }
    if c.net.is_some() != net {
        return refuse("its network device differs from the trace's".into());
    }
    if c.host_files.is_some() != m.vm.host_files.is_some() {
        return refuse("its host files' device differs from the trace's".into());
    }
    Ok(())
}

pub(crate) fn ckpt_err(e: trace::TraceError) -> VmError {
    VmError::Checkpoint(e)
}
