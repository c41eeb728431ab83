//! The host files a recording's guest read, stored by content: each
//! file's bytes once, zstd-compressed, named by the hex SHA-256 of the
//! uncompressed bytes (`objects/<digest>` in the trace). A trace in the
//! trace store shares its objects with the store's other recordings: an
//! object is written once into the store's `.objects/` and hard-linked
//! into each trace that read it, so a second recording of the same
//! program stores nothing new, and a trace copied elsewhere still holds
//! every file it needs.
//!
//! An object is read back only after its digest is checked: a replay gets
//! the bytes the recording's guest read, or an error naming the object.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use crate::TraceError;

/// The directory of a trace that holds its objects.
pub const OBJECTS_DIR: &str = "objects";
/// The directory of the trace store its traces share objects in.
pub const SHARED_OBJECTS_DIR: &str = ".objects";
/// Largest object read back (the largest file the host-file server
/// serves, `devices::host_files::MAX_FILE_BYTES`).
pub const MAX_OBJECT_BYTES: u64 = 1 << 30;

/// The SHA-256 of an object's bytes.
pub type ObjectDigest = [u8; 32];

/// An object's file name: its digest in hex.
pub fn object_name(digest: &ObjectDigest) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes a recording's objects.
pub struct ObjectWriter {
    dir: PathBuf,
    shared: Option<PathBuf>,
    stored: HashSet<ObjectDigest>,
    /// Compressed bytes this recording added to the store (or the trace).
    new_bytes: u64,
}

impl ObjectWriter {
    /// Objects of the trace in `trace_dir`, shared through `shared` (the
    /// store's `.objects`) if given.
    pub fn new(trace_dir: &Path, shared: Option<PathBuf>) -> Self {
        ObjectWriter {
            dir: trace_dir.join(OBJECTS_DIR),
            shared,
            stored: HashSet::new(),
            new_bytes: 0,
        }
    }

    /// Compressed bytes written that were not in the store before.
    pub fn new_bytes(&self) -> u64 {
        self.new_bytes
    }

    /// Stores `bytes` as `digest` (the caller's SHA-256 of them) unless
    /// this trace has it already.
    pub fn put(&mut self, digest: &ObjectDigest, bytes: &[u8]) -> Result<(), TraceError> {
        if self.stored.contains(digest) {
            return Ok(());
        }
        let name = object_name(digest);
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| TraceError::Io { path, source }
        };
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let target = self.dir.join(&name);
        if let Some(shared) = &self.shared {
            std::fs::create_dir_all(shared).map_err(io(shared))?;
            let in_store = shared.join(&name);
            if !in_store.exists() {
                self.new_bytes += write_object(&in_store, bytes)?;
            }
            // Another file system, or one without links: a copy of its own.
            if std::fs::hard_link(&in_store, &target).is_err() && !target.exists() {
                self.new_bytes += write_object(&target, bytes)?;
            }
        } else if !target.exists() {
            self.new_bytes += write_object(&target, bytes)?;
        }
        self.stored.insert(*digest);
        Ok(())
    }
}

/// Writes `bytes` compressed to `path` whole (a file renamed into place);
/// returns the compressed size.
fn write_object(path: &Path, bytes: &[u8]) -> Result<u64, TraceError> {
    let io = |source| TraceError::Io {
        path: path.to_owned(),
        source,
    };
    let partial = path.with_extension(format!("partial.{}", std::process::id()));
    let compressed = zstd::bulk::compress(bytes, 3).map_err(io)?;
    let mut f = std::fs::File::create(&partial).map_err(io)?;
    f.write_all(&compressed).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&partial, path).map_err(io)?;
    Ok(compressed.len() as u64)
}

/// Removes the host files a trace in `trace_dir` stored (its `objects/`
/// directory, whose files are links to the store's copies or its own),
/// for a trace that is discarded.
pub fn discard(trace_dir: &Path) -> std::io::Result<()> {
    let absent = |r: std::io::Result<()>| match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    let objects = trace_dir.join(OBJECTS_DIR);
    let entries = match std::fs::read_dir(&objects) {
        Ok(entries) => entries,
        Err(e) => return absent(Err(e)),
    };
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            absent(std::fs::remove_file(entry.path()))?;
        }
    }
    absent(std::fs::remove_dir(&objects))
}

/// Removes the objects of a store's `shared` directory that no trace links
/// any more (their only name is the store's); returns how many. A
/// recording storing one at the same time writes its own copy if the
/// store's is gone before it links it.
pub fn prune_shared(shared: &Path) -> Result<usize, TraceError> {
    use std::os::unix::fs::MetadataExt;
    let io = |source| TraceError::Io {
        path: shared.to_owned(),
        source,
    };
    let entries = match std::fs::read_dir(shared) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io(e)),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(io)?;
        let meta = entry.metadata().map_err(io)?;
        if meta.is_file() && meta.nlink() == 1 {
            std::fs::remove_file(entry.path()).map_err(io)?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Reads a trace's objects, each checked against its digest, keeping the
/// ones read.
pub struct ObjectReader {
    dir: PathBuf,
    cache: HashMap<ObjectDigest, Arc<Vec<u8>>>,
}

impl ObjectReader {
    pub fn new(trace_dir: &Path) -> Self {
        ObjectReader {
            dir: trace_dir.join(OBJECTS_DIR),
            cache: HashMap::new(),
        }
    }

    /// The bytes of object `digest`.
    pub fn get(&mut self, digest: &ObjectDigest) -> Result<Arc<Vec<u8>>, TraceError> {
        if let Some(bytes) = self.cache.get(digest) {
            return Ok(bytes.clone());
        }
        let path = self.dir.join(object_name(digest));
        let damaged = |message: String| TraceError::Damaged {
            path: path.clone(),
            at: "the stored host file".into(),
            message,
        };
        let file = crate::files::open_regular(&path)?;
        let mut decoder = zstd::stream::read::Decoder::new(file).map_err(|e| TraceError::Io {
            path: path.clone(),
            source: e,
        })?;
        let mut bytes = Vec::new();
        (&mut decoder)
            .take(MAX_OBJECT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| damaged(format!("cannot decompress it: {e}")))?;
        if bytes.len() as u64 > MAX_OBJECT_BYTES {
            return Err(damaged(format!(
                "it holds more than {MAX_OBJECT_BYTES} bytes"
            )));
        }
        let found: ObjectDigest = Sha256::digest(&bytes).into();
        if &found != digest {
            return Err(damaged(format!(
                "its bytes have SHA-256 {}, not the one it is named by",
                object_name(&found)
            )));
        }
        let bytes = Arc::new(bytes);
        self.cache.insert(*digest, bytes.clone());
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_are_stored_once_shared_and_checked_when_read() {
        let root = std::env::temp_dir().join(format!("insight-objects-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let shared = root.join(SHARED_OBJECTS_DIR);
        let data = vec![7u8; 100_000];
        let digest: ObjectDigest = Sha256::digest(&data).into();
        let (a, b) = (root.join("a"), root.join("b"));
        let mut first = ObjectWriter::new(&a, Some(shared.clone()));
        first.put(&digest, &data).unwrap();
        first.put(&digest, &data).unwrap();
        assert!(first.new_bytes() > 0 && first.new_bytes() < 1000);
        // A second trace links the store's copy: nothing new.
        let mut second = ObjectWriter::new(&b, Some(shared.clone()));
        second.put(&digest, &data).unwrap();
        assert_eq!(second.new_bytes(), 0);
        assert_eq!(
            *ObjectReader::new(&b).get(&digest).unwrap(),
            data,
            "read back as written"
        );
        // Bytes that are not the digest's are refused by name.
        let path = b.join(OBJECTS_DIR).join(object_name(&digest));
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, zstd::bulk::compress(b"other", 3).unwrap()).unwrap();
        let err = ObjectReader::new(&b).get(&digest).unwrap_err().to_string();
        assert!(err.contains("damaged") && err.contains("SHA-256"), "{err}");
        // Once no trace links it, pruning the store removes it.
        assert_eq!(prune_shared(&shared).unwrap(), 0);
        std::fs::remove_dir_all(&a).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(prune_shared(&shared).unwrap(), 1);
        assert_eq!(std::fs::read_dir(&shared).unwrap().count(), 0);
        std::fs::write(&path, zstd::bulk::compress(b"other", 3).unwrap()).unwrap();
        // A missing one, and garbage, are errors too.
        assert!(ObjectReader::new(&root.join("c")).get(&digest).is_err());
        std::fs::write(&path, b"not zstd").unwrap();
        assert!(ObjectReader::new(&b).get(&digest).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
