//! The boot snapshot cache: one snapshot (`crate::boot_snapshot`) per kernel,
//! initramfs, memory size, kernel command line and guest CPU, taken on the
//! first run that needs it and restored by every later one.
//!
//! A snapshot is named by its key, the SHA-256 of everything that
//! determines the boot, so a stale one is never found: a rebuilt kernel,
//! another memory size or another command line is another key. A file
//! whose digest does not match its contents is not restored but taken
//! again. The cache keeps the `MAX_CACHED` snapshots used last.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use trace::checkpoints::{self, Digest32};

use crate::boot_snapshot::{self, SnapshotRestored, SnapshotTaken, SnapshotTarget};
use crate::session::{LiveRun, StopReason};
use crate::vm::{Console, Machine, VmError};
use guest::{Start, VmSpec};

/// Bumped whenever what a snapshot holds or what the guest does after it
/// changes in a way its key would not show.
/// 2: the virtio console offers its write register (a snapshot's driver
/// negotiated without it). 3: and its write register for a process's own
/// memory. 4: the VMM makes the copies the guest kernel asks for (a guest
/// an older VMM left unanswered stopped asking). 5: it offers wide PIT
/// counts (a guest that booted without them programs the PIT as before).
pub const SNAPSHOT_FORMAT: u32 = 5;
/// Snapshots kept; the least recently used go first.
pub const MAX_CACHED: usize = 8;
/// File name extension of a cached snapshot.
const EXTENSION: &str = "snap";

/// The snapshot cache directory: `$INSIGHT_SNAPSHOT_DIR`, or `snapshots`
/// in the image cache (`image::cache_dir`).
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("INSIGHT_SNAPSHOT_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => guest::image::cache_dir().join("snapshots"),
    }
}

/// The key of the boot snapshot of `spec` on a vCPU with `cpuid` and a
/// KVM with `caps`.
pub fn key(
    spec: &VmSpec,
    cpuid: &[(u32, u32, u32, u32, u32, u32)],
    caps: &[(u32, i32)],
) -> Digest32 {
    let mut h = Sha256::new();
    h.update(b"insight boot snapshot\0");
    h.update(SNAPSHOT_FORMAT.to_le_bytes());
    h.update(checkpoints::CHECKPOINT_VERSION.to_le_bytes());
    for part in [&spec.kernel_image, &spec.initramfs] {
        h.update(Sha256::digest(part));
    }
    h.update(spec.memory_mib.to_le_bytes());
    h.update((spec.cmdline.len() as u64).to_le_bytes());
    h.update(spec.cmdline.as_bytes());
    for &(function, index, a, b, c, d) in cpuid {
        for word in [function, index, a, b, c, d] {
            h.update(word.to_le_bytes());
        }
    }
    for &(cap, value) in caps {
        h.update(cap.to_le_bytes());
        h.update(value.to_le_bytes());
    }
    h.finalize().into()
}

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("cannot use the snapshot cache {path}")]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The trace's copy of the snapshot it starts from.
    #[error("cannot copy the boot snapshot into the trace as {path}")]
    IntoTrace {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot take the boot snapshot")]
    Build(#[source] VmError),
    #[error(transparent)]
    Vm(#[from] VmError),
}

fn cache_err(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Cache {
        path: path.to_owned(),
        source,
    }
}

/// How a run from the cache began. While it is kept, no other run takes
/// this snapshot again.
#[derive(Debug)]
pub struct CacheStart {
    pub key: Digest32,
    /// The cached file restored.
    pub path: PathBuf,
    pub restored: SnapshotRestored,
    /// The snapshot had to be taken first.
    pub built: Option<SnapshotTaken>,
    /// Why a cached snapshot of this key was not used, if one was not.
    pub discarded: Option<String>,
    _lock: std::fs::File,
}

/// Restores the cached boot snapshot of `spec` into `m` (created from
/// `spec`), taking it first with a machine of its own if the cache has
/// none or has a damaged one. `build_console` gets the guest's output
/// while the snapshot is taken; `say` is told before that starts.
pub fn restore_cached(
    m: &mut Machine,
    spec: &VmSpec,
    build_console: Console,
    say: &mut dyn FnMut(&str),
) -> Result<CacheStart, SnapshotError> {
    let key = key(spec, m.vm().guest_cpuid(), m.vm().kvm_caps());
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).map_err(cache_err(&dir))?;
    let path = dir.join(format!("{}.{EXTENSION}", checkpoints::hex(&key)));
    // One run takes a missing snapshot while the others wait for it.
    let lock_path = path.with_extension("lock");
    let lock = std::fs::File::create(&lock_path).map_err(cache_err(&lock_path))?;
    lock.lock().map_err(cache_err(&lock_path))?;
    let mut discarded = None;
    if path.exists() {
        match boot_snapshot::restore(m, &path, &key, None) {
            Ok(restored) => {
                touch(&path);
                return Ok(CacheStart {
                    key,
                    path,
                    restored,
                    built: None,
                    discarded: None,
                    _lock: lock,
                });
            }
            Err(e) => {
                let why = error_chain(&e);
                say(&format!(
                    "the cached boot snapshot {} cannot be used ({why}); taking it again",
                    path.display()
                ));
                std::fs::remove_file(&path).map_err(cache_err(&path))?;
                discarded = Some(why);
            }
        }
    }
    say("taking a boot snapshot of this guest image: it boots once, later runs restore it");
    let builder = VmSpec {
        kernel: spec.kernel.clone(),
        kernel_image: spec.kernel_image.clone(),
        initramfs: spec.initramfs.clone(),
        initramfs_path: spec.initramfs_path.clone(),
        archive: Vec::new(),
        start: Start::Cold,
        wall_clock: None,
        disk: None,
        net: None,
        console: spec.console,
        cmdline: spec.cmdline.clone(),
        memory_mib: spec.memory_mib,
        rng_seed: spec.rng_seed,
        brought: Default::default(),
        host_files: None,
    };
    let boot = Machine::new(&builder, build_console).map_err(SnapshotError::Build)?;
    let target = SnapshotTarget {
        path: path.clone(),
        key,
    };
    let outcome = LiveRun::snapshot_when_ready(boot, target)
        .run()
        .map_err(SnapshotError::Build)?;
    if outcome.stop != StopReason::SnapshotTaken {
        return Err(SnapshotError::Build(VmError::NoSnapshotPoint));
    }
    let built = outcome
        .boot_snapshot
        .ok_or(SnapshotError::Build(VmError::NoSnapshotPoint))?;
    evict(&dir, MAX_CACHED, &path);
    let restored = boot_snapshot::restore(m, &path, &key, Some(&built.digest))?;
    Ok(CacheStart {
        key,
        path,
        restored,
        built: Some(built),
        discarded,
        _lock: lock,
    })
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text += &format!(": {s}");
        source = s.source();
    }
    text
}

/// Marks a snapshot as just used (the cache evicts by modification time).
fn touch(path: &Path) {
    if let Ok(file) = std::fs::File::options().append(true).open(path) {
        let _ = file.set_modified(std::time::SystemTime::now());
    }
}

/// A cached snapshot.
#[derive(Clone, Debug)]
pub struct Cached {
    pub path: PathBuf,
    pub bytes: u64,
    pub used: std::time::SystemTime,
}

/// The cache's snapshots, most recently used first.
pub fn list(dir: &Path) -> Result<Vec<Cached>, SnapshotError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(cache_err(dir)(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(cache_err(dir))?;
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some(EXTENSION) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        out.push(Cached {
            path,
            bytes: meta.len(),
            used: meta.modified().unwrap_or(std::time::UNIX_EPOCH),
        });
    }
    out.sort_by(|a, b| b.used.cmp(&a.used).then(a.path.cmp(&b.path)));
    Ok(out)
}

/// Removes every cached snapshot (and the lock files, and partial files
/// left by runs that stopped while taking one); returns how many
/// snapshots went.
pub fn clear(dir: &Path) -> Result<usize, SnapshotError> {
    let cached = list(dir)?;
    for c in &cached {
        std::fs::remove_file(&c.path).map_err(cache_err(&c.path))?;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if (name.starts_with('.') && name.ends_with(".partial")) || name.ends_with(".lock") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    Ok(cached.len())
}

/// Keeps the `keep` snapshots used last, and always `current`.
fn evict(dir: &Path, keep: usize, current: &Path) {
    let Ok(cached) = list(dir) else {
        return;
    };
    for c in cached
        .iter()
        .filter(|c| c.path != current)
        .skip(keep.saturating_sub(1))
    {
        let _ = std::fs::remove_file(&c.path);
    }
}

/// Gives a trace its own name for the snapshot a run restored: a hard
/// link where the file system allows one (traces made from one snapshot
/// share its blocks), a copy where it does not. Either way the trace holds
/// the snapshot, and a copy of the trace alone replays. The file linked
/// must still be the one restored (its digest).
pub fn link_into(started: &CacheStart, to: &Path) -> Result<(), SnapshotError> {
    let cached = &started.path;
    if std::fs::hard_link(cached, to).is_err() {
        if let Err(source) = std::fs::copy(cached, to) {
            // Half a snapshot is none: nothing is left under its name.
            let _ = std::fs::remove_file(to);
            return Err(SnapshotError::IntoTrace {
                path: to.to_owned(),
                source,
            });
        }
    }
    let linked = checkpoints::stored_digest(to).map_err(|e| SnapshotError::IntoTrace {
        path: to.to_owned(),
        source: std::io::Error::other(e.to_string()),
    })?;
    if linked != started.restored.digest {
        let _ = std::fs::remove_file(to);
        return Err(SnapshotError::Cache {
            path: cached.clone(),
            source: std::io::Error::other(
                "the cached snapshot was replaced after this run restored it",
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("insight-snapcache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn eviction_keeps_the_most_recently_used_and_the_current() {
        let d = dir("evict");
        let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(100);
        for i in 0..5u64 {
            let p = d.join(format!("{i}.snap"));
            std::fs::write(&p, b"x").unwrap();
            let f = std::fs::File::options().append(true).open(&p).unwrap();
            f.set_modified(t0 + std::time::Duration::from_secs(i))
                .unwrap();
        }
        std::fs::write(d.join("other.txt"), b"not ours").unwrap();
        // 0 is the oldest, but the one in use.
        evict(&d, 3, &d.join("0.snap"));
        let left: Vec<String> = list(&d)
            .unwrap()
            .iter()
            .map(|c| c.path.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["4.snap", "3.snap", "0.snap"]);
        std::fs::write(d.join(".x.snap.1.partial"), b"half").unwrap();
        std::fs::write(d.join("x.lock"), b"").unwrap();
        assert_eq!(clear(&d).unwrap(), 3);
        assert!(list(&d).unwrap().is_empty());
        assert!(d.join("other.txt").exists() && !d.join(".x.snap.1.partial").exists());
        assert!(!d.join("x.lock").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_key_changes_with_everything_that_makes_the_boot() {
        let spec = |memory_mib, cmdline: &str, kernel: &[u8]| VmSpec {
            kernel: "k".into(),
            kernel_image: kernel.to_vec(),
            initramfs: b"i".to_vec(),
            initramfs_path: "i".into(),
            archive: b"per run".to_vec(),
            start: Start::Snapshot,
            wall_clock: None,
            disk: None,
            net: None,
            console: guest::config::ConsoleKind::Virtio,
            cmdline: cmdline.into(),
            memory_mib,
            rng_seed: [0; 32],
            brought: Default::default(),
            host_files: None,
        };
        let cpuid = [(1, 0, 2, 3, 4, 5)];
        let base = key(&spec(128, "a", b"k1"), &cpuid, &[]);
        let mut other = spec(128, "a", b"k1");
        other.archive = b"another run".to_vec();
        other.rng_seed = [9; 32];
        other.wall_clock = Some((1, 2));
        assert_eq!(
            key(&other, &cpuid, &[]),
            base,
            "per-run parts are not in the key"
        );
        assert_ne!(key(&spec(256, "a", b"k1"), &cpuid, &[]), base);
        assert_ne!(key(&spec(128, "a b", b"k1"), &cpuid, &[]), base);
        assert_ne!(key(&spec(128, "a", b"k2"), &cpuid, &[]), base);
        assert_ne!(
            key(&spec(128, "a", b"k1"), &[(1, 0, 2, 3, 4, 6)], &[]),
            base
        );
        assert_ne!(key(&spec(128, "a", b"k1"), &cpuid, &[(1, 1)]), base);
    }
}
