//! Boot snapshots: the machine as it stands when `/init` says it is ready
//! for the run's archive (`ControlMessage::Ready`), in the checkpoint
//! format, so that a run restores it instead of booting the kernel. Their
//! cache, above the sessions that take them, is `crate::snapshot_cache`.
//!
//! Everything before that point is the same in every run of a kernel,
//! initramfs, memory size and command line (`crate::snapshot_cache` keys
//! the cache by them); everything a run brings of its own — the command, its
//! files, the devices, a random seed, the wall-clock time — reaches the
//! guest after it, through the archive `/init` fetches. A snapshot holds
//! no disk or network state: those devices answer only from that point.

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use trace::checkpoints::{self, Digest32};

use crate::vm::state::{changed_pages, check_memory, Checkpoint, PointStats, VmState};
use crate::vm::{Machine, VmError};
use journal::LogPosition;

/// Where a boot snapshot is to be written when `/init` is ready, and
/// under which key.
pub(crate) struct SnapshotTarget {
    pub(crate) path: PathBuf,
    pub(crate) key: Digest32,
}

/// A boot snapshot written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotTaken {
    pub digest: Digest32,
    /// Size of the file.
    pub bytes: u64,
    /// VM time at which it was taken.
    pub vm_ns: u64,
    /// Host time to take and store it.
    pub took_ns: u64,
}

/// A boot snapshot restored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRestored {
    pub digest: Digest32,
    /// VM time at which it was taken, where this VM's clock goes on.
    pub vm_ns: u64,
    pub took_ns: u64,
}

/// What a boot snapshot's identity is called in refusals.
const OWNER: &str = "boot image (kernel, initramfs, memory size and command line)";

/// At `/init`'s ready message: writes the machine's state to `target`
/// as a boot snapshot.
pub(crate) fn take(m: &mut Machine, target: &SnapshotTarget) -> Result<SnapshotTaken, VmError> {
    let started = Instant::now();
    m.vcpu.complete_exit()?;
    let msrs = m.vm.msr_index_list()?;
    let vcpu = m.vcpu.state(&msrs)?;
    let mut shadow = vec![0u8; m.vm.ram_bytes()];
    let memory = changed_pages(&m.vm.mem, &mut shadow);
    let vm_ns = m.vm.clock.now_ns();
    let state = Checkpoint {
        exit: 0,
        previous: None,
        log: LogPosition::default(),
        vm_ns,
        memory_bytes: shadow.len() as u64,
        memory,
        vcpu,
        platform: m.vm.platform.state(),
        block: None,
        overlay: Vec::new(),
        net: None,
        console: m.vm.console.state(),
        host_files: None,
        vm: VmState::of(&m.vm, &m.vcpu, PointStats::default()),
        events: None,
    };
    let (digest, bytes) = checkpoints::write_to(&target.path, &target.key, 0, vm_ns, &state)
        .map_err(VmError::Checkpoint)?;
    Ok(SnapshotTaken {
        digest,
        bytes,
        vm_ns,
        took_ns: started.elapsed().as_nanos() as u64,
    })
}

/// The boot snapshot a trace was recorded from, if `start` names one
/// (`None`: the trace booted from power-on): its path, key and digest,
/// checked to be there.
pub(crate) fn of_trace(
    start: &guest::Start,
) -> Result<Option<(&Path, Digest32, Digest32)>, VmError> {
    let guest::Start::TraceSnapshot { path, snapshot } = start else {
        return Ok(None);
    };
    let digest = |what: &str, hex: &str| {
        parse_digest(hex).ok_or_else(|| {
            VmError::Restore(format!(
                "the trace header's boot snapshot {what} is not a SHA-256 digest"
            ))
        })
    };
    let key = digest("key", &snapshot.key)?;
    let expected = digest("digest", &snapshot.digest)?;
    if !path.exists() {
        return Err(VmError::Restore(format!(
            "the trace was recorded from a boot snapshot, and {} is missing (copy the trace \
             with all its files)",
            path.display()
        )));
    }
    Ok(Some((path, key, expected)))
}

/// Restores the boot snapshot at `path` into the machine `m`, which must
/// be of `key` and, if `expected` says so, have that digest (before the
/// run). Nothing of the machine changes if it is refused. The probe gate
/// and the event capture are the session's to set up afterwards.
pub(crate) fn restore(
    m: &mut Machine,
    path: &Path,
    key: &Digest32,
    expected: Option<&Digest32>,
) -> Result<SnapshotRestored, VmError> {
    let started = Instant::now();
    let (c, digest) =
        checkpoints::read_at::<Checkpoint>(path, key, 0, OWNER).map_err(VmError::Checkpoint)?;
    if expected.is_some_and(|e| *e != digest) {
        return Err(VmError::Restore(format!(
            "{} is not the boot snapshot the trace was recorded from (its digest is {})",
            path.display(),
            checkpoints::hex(&digest)
        )));
    }
    check_memory(&c, m.vm.ram_bytes())?;
    if c.block.is_some()
        || c.net.is_some()
        || c.host_files.is_some()
        || c.events.is_some()
        || c.vm.devices_attached
    {
        return Err(VmError::Restore(format!(
            "{} holds device or event state a boot snapshot never has",
            path.display()
        )));
    }
    m.vm.load_memory(std::iter::once(&c.memory))?;
    c.machine_state().put_into(m)?;
    // The ready message's own effect, which the snapshot precedes.
    m.vm.status.devices_attached = true;
    // The wall clock goes on from now, not from when the snapshot was
    // taken (a replay reads the CMOS clock from the log).
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    m.vm.platform
        .cmos
        .set_boot_unix_secs(now.saturating_sub(c.vm_ns / 1_000_000_000));
    // Interrupts wait for the first exit of the run: the log starts
    // there.
    m.vcpu.at_delivery_point = false;
    Ok(SnapshotRestored {
        digest,
        vm_ns: c.vm_ns,
        took_ns: started.elapsed().as_nanos() as u64,
    })
}

/// A SHA-256 digest from its 64 hex digits.
fn parse_digest(hex: &str) -> Option<Digest32> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_from_exactly_64_hex_digits() {
        let d: Digest32 = std::array::from_fn(|i| i as u8 * 7);
        assert_eq!(parse_digest(&checkpoints::hex(&d)), Some(d));
        assert_eq!(parse_digest(&checkpoints::hex(&d)[1..]), None);
        assert_eq!(parse_digest(&"g".repeat(64)), None);
        assert_eq!(parse_digest(&"é".repeat(32)), None);
    }
}
