//! Checkpoints a replay stores in its trace directory: complete VM states
//! at deterministic exits, from which a later replay starts instead of
//! booting.
//!
//! ```text
//! TRACE/checkpoints/exit-<ordinal, 16 decimal digits>.ckpt
//!   magic "INSCKPT\0", u32 LE format version,
//!   32 bytes: SHA-256 of the trace's header file (whose trace it is),
//!   u64 LE: the exit ordinal (as in the name),
//!   u64 LE: the recorded guest time there (ns),
//!   32 bytes: SHA-256 of the body,
//!   body: zstd (with checksum) of bincode(the state)
//! ```
//!
//! What the state holds is the VMM's business (docs/trace-format.md); this
//! module stores and checks it. A checkpoint whose digest, trace or exit
//! does not match is refused with an error naming the cause, never
//! decoded.

use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::{files, io_err, TraceError, HEADER_FILE, MAX_HEADER_BYTES};

/// Format version of checkpoint files, bumped on every change of their
/// layout or of the state they hold.
pub const CHECKPOINT_VERSION: u32 = 5;
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"INSCKPT\0";
/// The subdirectory of a trace that holds its checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
const HEAD: usize = 8 + 4 + 32 + 8 + 8 + 32;
const ZSTD_LEVEL: i32 = 1;

/// A SHA-256 digest.
pub type Digest32 = [u8; 32];

/// Largest decoded checkpoint accepted: the largest guest memory insight
/// gives a guest, and room for the devices.
pub const MAX_CHECKPOINT_BYTES: u64 = (3 << 30) + (256 << 20);

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ MAX_CHECKPOINT_BYTES as usize }>()
}

/// A checkpoint file of a trace, by its exit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredCheckpoint {
    /// The deterministic exit it was taken after.
    pub exit: u64,
    /// The recorded guest time there, in ns (from its head; 0 if the head
    /// cannot be read: reading the checkpoint says why).
    pub guest_ns: u64,
    pub path: PathBuf,
    /// Its size on disk.
    pub bytes: u64,
    /// Its head names another trace (a file copied in from elsewhere): a
    /// replay never starts from it (reading it says why).
    pub foreign: bool,
}

/// What identifies a trace to its checkpoints: the SHA-256 of its header
/// file, which names the recording's images, host and start time.
pub fn trace_identity(trace: &Path) -> Result<Digest32, TraceError> {
    let bytes = files::read_bounded(&trace.join(HEADER_FILE), MAX_HEADER_BYTES, "trace header")?;
    Ok(Sha256::digest(&bytes).into())
}

fn file_name(exit: u64) -> String {
    format!("exit-{exit:016}.ckpt")
}

fn exit_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("exit-")?.strip_suffix(".ckpt")?;
    (digits.len() == 16 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// Whether the checkpoint directory `dir` exists; anything else there (a
/// link, a file) is refused by name.
fn is_directory(dir: &Path) -> Result<bool, TraceError> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(dir)(e)),
        Ok(m) if m.is_dir() => Ok(true),
        Ok(m) => Err(files::FileError::NotRegular {
            path: dir.to_owned(),
            kind: files::kind_of(m.file_type()),
        }
        .into()),
    }
}

/// The trace's checkpoints, by exit (none if it has no checkpoint
/// directory). Files of other names are not checkpoints and are left
/// alone; a checkpoint that is not a regular file is an error.
pub fn list(trace: &Path) -> Result<Vec<StoredCheckpoint>, TraceError> {
    let dir = trace.join(CHECKPOINTS_DIR);
    if !is_directory(&dir)? {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(&dir).map_err(io_err(&dir))?;
    // A header that cannot be read makes none foreign: reading says why.
    let identity = trace_identity(trace).ok();
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err(&dir))?;
        let Some(exit) = entry.file_name().to_str().and_then(exit_of) else {
            continue;
        };
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path).map_err(io_err(&path))?;
        if !meta.is_file() {
            return Err(files::FileError::NotRegular {
                path,
                kind: files::kind_of(meta.file_type()),
            }
            .into());
        }
        let mut head = [0u8; 8 + 4 + 32 + 8 + 8];
        let read = std::fs::File::open(&path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
            .is_ok();
        let guest_ns = if read {
            u64::from_le_bytes(head[52..60].try_into().expect("8 bytes"))
        } else {
            0
        };
        let foreign = read
            && head[..8] == CHECKPOINT_MAGIC
            && identity.is_some_and(|id| head[12..44] != id[..]);
        found.push(StoredCheckpoint {
            exit,
            guest_ns,
            path,
            bytes: meta.len(),
            foreign,
        });
    }
    found.sort_by_key(|c| c.exit);
    Ok(found)
}

/// Removes the trace's checkpoints (a new set is about to be taken).
pub fn clear(trace: &Path) -> Result<usize, TraceError> {
    let old = list(trace)?;
    for c in &old {
        std::fs::remove_file(&c.path).map_err(io_err(&c.path))?;
    }
    Ok(old.len())
}

/// Stores `state` as the checkpoint of `trace` (identified by `identity`)
/// at `exit`, replacing one there; returns its body's digest. Written to
/// a new file first and renamed, so a checkpoint is whole or absent.
pub fn write<T: Serialize>(
    trace: &Path,
    identity: &Digest32,
    exit: u64,
    guest_ns: u64,
    state: &T,
) -> Result<(Digest32, u64), TraceError> {
    let dir = trace.join(CHECKPOINTS_DIR);
    if !is_directory(&dir)? {
        std::fs::create_dir(&dir).map_err(io_err(&dir))?;
    }
    write_to(&dir.join(file_name(exit)), identity, exit, guest_ns, state)
}

/// Writes a state in the checkpoint format to `path` (through a partial
/// file renamed into place): a checkpoint, or a boot snapshot, whose
/// identity is its cache key. Returns the body's digest and the file size.
pub fn write_to<T: Serialize>(
    path: &Path,
    identity: &Digest32,
    exit: u64,
    guest_ns: u64,
    state: &T,
) -> Result<(Digest32, u64), TraceError> {
    let encoded =
        bincode::serde::encode_to_vec(state, bincode_config()).map_err(|e| TraceError::Encode {
            what: "checkpoint",
            message: e.to_string(),
        })?;
    let mut compressor = zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(io_err(path))?;
    compressor.include_checksum(true).map_err(io_err(path))?;
    compressor.include_contentsize(true).map_err(io_err(path))?;
    let body = compressor.compress(&encoded).map_err(io_err(path))?;
    let digest: Digest32 = Sha256::digest(&body).into();
    let mut bytes = Vec::with_capacity(HEAD + body.len());
    bytes.extend_from_slice(&CHECKPOINT_MAGIC);
    bytes.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
    bytes.extend_from_slice(identity);
    bytes.extend_from_slice(&exit.to_le_bytes());
    bytes.extend_from_slice(&guest_ns.to_le_bytes());
    bytes.extend_from_slice(&digest);
    bytes.extend_from_slice(&body);

    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let partial = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    let _ = std::fs::remove_file(&partial);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)
        .map_err(io_err(&partial))?;
    let written = file
        .write_all(&bytes)
        .and_then(|()| file.sync_data())
        .map_err(io_err(&partial))
        .and_then(|()| std::fs::rename(&partial, path).map_err(io_err(path)));
    if let Err(e) = written {
        // A disk that is full keeps nothing of it.
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    Ok((digest, bytes.len() as u64))
}

/// Reads and checks the checkpoint at `path`: it must be a checkpoint of
/// this format, of the trace `identity` names, at the exit its name says,
/// and its body must match its digest. Returns the state and the digest.
pub fn read<T: DeserializeOwned>(
    path: &Path,
    identity: &Digest32,
) -> Result<(T, Digest32), TraceError> {
    let named_exit = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(exit_of)
        .ok_or_else(|| TraceError::Checkpoint {
            path: path.to_owned(),
            message: "its name is not exit-<16 digits>.ckpt".into(),
            damaged: false,
        })?;
    read_at(path, identity, named_exit, "trace")
}

/// The body digest a file in the checkpoint format says it has, read
/// from its head alone (not checked against the body: `read_at` does that).
pub fn stored_digest(path: &Path) -> Result<Digest32, TraceError> {
    let mut head = [0u8; HEAD];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
        .map_err(io_err(path))?;
    Ok(head[60..HEAD].try_into().expect("32 bytes"))
}

/// Reads and checks a state in the checkpoint format at `path`, which
/// must have been taken at `named_exit` for the owner `identity` names (a
/// trace, or a boot image for a snapshot); returns it with its digest.
pub fn read_at<T: DeserializeOwned>(
    path: &Path,
    identity: &Digest32,
    named_exit: u64,
    owner: &str,
) -> Result<(T, Digest32), TraceError> {
    let refused = |message: String| TraceError::Checkpoint {
        path: path.to_owned(),
        message,
        damaged: false,
    };
    let damaged = |message: String| TraceError::Checkpoint {
        path: path.to_owned(),
        message,
        damaged: true,
    };
    let bytes = files::read_bounded(path, MAX_CHECKPOINT_BYTES, "checkpoint")?;
    if bytes.len() < HEAD {
        return Err(damaged(format!(
            "it is cut short ({} bytes, its head alone has {HEAD})",
            bytes.len()
        )));
    }
    if bytes[..8] != CHECKPOINT_MAGIC {
        return Err(refused(
            "it is not an insight checkpoint (bad magic)".into(),
        ));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != CHECKPOINT_VERSION {
        return Err(refused(format!(
            "it has checkpoint format version {version}; this insight reads version \
             {CHECKPOINT_VERSION} (take the checkpoints again)"
        )));
    }
    if bytes[12..44] != identity[..] {
        return Err(refused(format!(
            "it belongs to another {owner} (its identity digest differs from this {owner}'s)"
        )));
    }
    let exit = u64::from_le_bytes(bytes[44..52].try_into().expect("8 bytes"));
    if exit != named_exit {
        return Err(refused(format!(
            "it was taken at exit {exit}, its name says {named_exit}"
        )));
    }
    let stored: Digest32 = bytes[60..92].try_into().expect("32 bytes");
    let body = &bytes[HEAD..];
    let digest: Digest32 = Sha256::digest(body).into();
    if digest != stored {
        return Err(damaged(
            "its contents do not match its digest (damaged or cut short)".into(),
        ));
    }
    let capacity = match zstd::zstd_safe::get_frame_content_size(body) {
        Ok(Some(n)) if n <= MAX_CHECKPOINT_BYTES => n as usize,
        _ => return Err(refused("its body declares no valid size".into())),
    };
    let raw = zstd::bulk::decompress(body, capacity)
        .map_err(|e| refused(format!("its body does not decompress ({e})")))?;
    let (state, used) = bincode::serde::decode_from_slice(&raw, bincode_config())
        .map_err(|e| refused(format!("its state does not decode ({e})")))?;
    if used != raw.len() {
        return Err(refused(format!(
            "{} bytes follow its state",
            raw.len() - used
        )));
    }
    Ok((state, digest))
}

/// The digest as text, for messages and listings.
pub fn hex(digest: &Digest32) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_trace(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("insight-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(HEADER_FILE), format!("header of {name}")).unwrap();
        dir
    }

    #[test]
    fn a_checkpoint_reads_back_and_every_damage_is_refused_by_name() {
        let dir = temp_trace("roundtrip");
        let id = trace_identity(&dir).unwrap();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let noise: Vec<u8> = (0..10_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let state = (7u64, noise, "devices".to_owned());
        let (digest, bytes) = write(&dir, &id, 1234, 5_000, &state).unwrap();
        let listed = list(&dir).unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (listed[0].exit, listed[0].guest_ns, listed[0].bytes),
            (1234, 5_000, bytes)
        );
        let (back, d): ((u64, Vec<u8>, String), _) = read(&listed[0].path, &id).unwrap();
        assert_eq!((back, d), (state.clone(), digest));

        let path = listed[0].path.clone();
        let good = std::fs::read(&path).unwrap();
        // The message, and whether the file counts as damaged (exit 3).
        let refusal = |bytes: &[u8], id: &Digest32| {
            std::fs::write(&path, bytes).unwrap();
            let e = read::<(u64, Vec<u8>, String)>(&path, id).unwrap_err();
            (e.to_string(), e.is_damage())
        };
        let damaged = |(message, damage): (String, bool), what: &str| {
            assert!(message.contains(what) && damage, "{message}");
        };
        // One byte of the body changed.
        let mut flipped = good.clone();
        let at = flipped.len() - 5;
        flipped[at] ^= 1;
        damaged(refusal(&flipped, &id), "do not match its digest");
        // Cut short, in the body and in the head.
        assert!(good.len() > 10_000);
        damaged(
            refusal(&good[..good.len() - 100], &id),
            "do not match its digest",
        );
        damaged(refusal(&good[..20], &id), "cut short");
        // Another trace's: refused, but nothing is damaged.
        let other = temp_trace("other");
        let other_id = trace_identity(&other).unwrap();
        let (message, damage) = refusal(&good, &other_id);
        assert!(
            message.contains("belongs to another trace") && !damage,
            "{message}"
        );
        // Renamed to another exit.
        std::fs::write(&path, &good).unwrap();
        let renamed = dir.join(CHECKPOINTS_DIR).join(file_name(99));
        std::fs::copy(&path, &renamed).unwrap();
        let e = read::<(u64, Vec<u8>, String)>(&renamed, &id).unwrap_err();
        assert!(
            e.to_string()
                .contains("taken at exit 1234, its name says 99"),
            "{e}"
        );
        // Each message is one line naming the file.
        assert!(!e.to_string().contains('\n'));
        assert!(e.to_string().contains("exit-0000000000000099.ckpt"));

        assert_eq!(clear(&dir).unwrap(), 2);
        assert!(list(&dir).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&other);
    }

    #[test]
    fn a_checkpoint_directory_that_is_not_one_is_refused() {
        let dir = temp_trace("symlink");
        std::os::unix::fs::symlink("/tmp", dir.join(CHECKPOINTS_DIR)).unwrap();
        assert!(list(&dir).is_err());
        let id = trace_identity(&dir).unwrap();
        assert!(write(&dir, &id, 1, 0, &1u8).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
