//! Boot snapshots: the VM as it stands when `/init` says it is ready for
//! the run's archive (`ControlMessage::Ready`), in the checkpoint format,
//! so that a run restores it instead of booting the kernel.
//!
//! Everything before that point is the same in every run of a kernel,
//! initramfs, memory size and command line (`crate::snapshot` keys the
//! cache by them); everything a run brings of its own — the command, its
//! files, the devices, a random seed, the wall-clock time — reaches the
//! guest after it, through the archive `/init` fetches. A snapshot holds
//! no disk or network state: those devices answer only from that point.

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use trace::checkpoints::{self, Digest32};

use super::checkpoint::{changed_pages, check_memory, Checkpoint};
use super::{Vm, VmError};
use introspect::guest_events::SwitchRing;
use journal::LogPosition;

/// Taking a boot snapshot when `/init` is ready.
pub(super) struct Builder {
    path: PathBuf,
    key: Digest32,
    pub(super) taken: Option<SnapshotTaken>,
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

impl Vm {
    /// Makes `run` stop when `/init` is ready, with the VM's state written
    /// to `path` as the boot snapshot of `key`
    /// (`StopReason::SnapshotTaken`). The run must be neither a recording
    /// nor a replay.
    pub fn snapshot_when_ready(&mut self, path: &Path, key: Digest32) {
        self.snapshot_builder = Some(Builder {
            path: path.to_owned(),
            key,
            taken: None,
        });
    }

    /// At `/init`'s ready message: writes the boot snapshot. Returns
    /// whether one was asked for.
    pub(super) fn take_boot_snapshot(&mut self) -> Result<bool, VmError> {
        let Some(builder) = &self.snapshot_builder else {
            return Ok(false);
        };
        let (path, key) = (builder.path.clone(), builder.key);
        let started = Instant::now();
        self.complete_exit()?;
        let vcpu = self.vcpu_state()?;
        let mut shadow = vec![0u8; self.ram_bytes()];
        let memory = changed_pages(&self.mem, &mut shadow);
        let vm_ns = self.clock.now_ns();
        let state = Checkpoint {
            exit: 0,
            previous: None,
            log: LogPosition::default(),
            vm_ns,
            memory_bytes: shadow.len() as u64,
            memory,
            vcpu,
            platform: self.platform.state(),
            block: None,
            overlay: Vec::new(),
            net: None,
            vm: self.vm_state(),
            events: None,
        };
        let (digest, bytes) =
            checkpoints::write_to(&path, &key, 0, vm_ns, &state).map_err(VmError::Checkpoint)?;
        if let Some(builder) = &mut self.snapshot_builder {
            builder.taken = Some(SnapshotTaken {
                digest,
                bytes,
                vm_ns,
                took_ns: started.elapsed().as_nanos() as u64,
            });
        }
        Ok(true)
    }

    /// The boot snapshot `run` wrote, if it stopped for one.
    pub fn snapshot_taken(&self) -> Option<&SnapshotTaken> {
        self.snapshot_builder.as_ref()?.taken.as_ref()
    }

    /// Restores the trace's boot snapshot if `start` names one (replay,
    /// after the journal and event capture are set); `None`: the trace
    /// booted from power-on.
    pub fn restore_trace_snapshot(
        &mut self,
        start: &super::Start,
    ) -> Result<Option<SnapshotRestored>, VmError> {
        let super::Start::TraceSnapshot { path, snapshot } = start else {
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
                "the trace was recorded from a boot snapshot, and {} is missing (copy the \
                 trace with all its files)",
                path.display()
            )));
        }
        self.restore_snapshot(path, &key, Some(&expected)).map(Some)
    }

    /// Restores the boot snapshot at `path`, which must be of `key` and,
    /// if `expected` says so, have that digest (before `run`, after the
    /// journal, event capture and console are set). Nothing of the VM
    /// changes if it is refused.
    pub fn restore_snapshot(
        &mut self,
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
        check_memory(&c, self.ram_bytes())?;
        if c.block.is_some() || c.net.is_some() || c.events.is_some() || c.vm.devices_attached {
            return Err(VmError::Restore(format!(
                "{} holds device or event state a boot snapshot never has",
                path.display()
            )));
        }
        self.load_memory(std::iter::once(&c.memory))?;
        self.set_vcpu_state(&c.vcpu)?;
        self.platform
            .restore(&c.platform)
            .map_err(|e| VmError::Restore(e.into()))?;
        self.set_vm_state(&c.vm, c.vm_ns);
        // The ready message's own effect, which the snapshot precedes.
        self.devices_attached = true;
        // The wall clock goes on from now, not from when the snapshot was
        // taken (a replay reads the CMOS clock from the log).
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.platform
            .cmos
            .set_boot_unix_secs(now.saturating_sub(c.vm_ns / 1_000_000_000));
        // The probe gate as this run needs it (a replay's raises events).
        self.install_probe_gate();
        if let (Some(capture), Some(gpa)) = (&mut self.events, self.switch_ring_gpa) {
            match SwitchRing::from_head(&self.mem, gpa) {
                Ok(ring) => self.switch_ring = Some(ring),
                Err(why) => capture.bad_switch_ring(why),
            }
        }
        // Interrupts wait for the first exit of the run: the log starts
        // there.
        self.at_delivery_point = false;
        Ok(SnapshotRestored {
            digest,
            vm_ns: c.vm_ns,
            took_ns: started.elapsed().as_nanos() as u64,
        })
    }
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
