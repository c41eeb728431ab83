//! Archives in the "newc" cpio format the Linux initramfs unpacker reads
//! (`guestfiles::newc`), written to append the guest command and the
//! user's files to the image at boot without touching the base image.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use guestfiles::newc::{write_entry, S_IFDIR, S_IFLNK, S_IFREG};

#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot copy a file into the guest")]
    File(#[from] trace::files::FileError),
    #[error("guest path {path} {why}")]
    BadGuestPath { path: PathBuf, why: &'static str },
    #[error("{path} is not a regular file, directory or symbolic link")]
    Unsupported { path: PathBuf },
    #[error("{0} is too large for a cpio archive (4 GiB per file)")]
    TooLarge(PathBuf),
}

/// Largest single file copied into the guest: the trace header that
/// carries the archive is bounded by the same amount.
pub const MAX_GUEST_FILE_BYTES: u64 = trace::MAX_FRAME_BYTES as u64;

/// An archive being built in memory.
#[derive(Default)]
pub struct CpioWriter {
    buf: Vec<u8>,
    next_ino: u32,
}

impl CpioWriter {
    pub fn new() -> Self {
        CpioWriter {
            buf: Vec::new(),
            next_ino: 1,
        }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        write_entry(&mut self.buf, self.next_ino, name, mode, data);
        self.next_ino += 1;
    }

    /// A regular file with the given contents and permission bits.
    pub fn add_file(&mut self, guest: &Path, mode: u32, data: &[u8]) -> Result<(), InitramfsError> {
        if u32::try_from(data.len()).is_err() {
            return Err(InitramfsError::TooLarge(guest.to_owned()));
        }
        let name = archive_name(guest)?;
        self.add_parents(&name);
        self.entry(&name, S_IFREG | (mode & 0o7777), data);
        Ok(())
    }

    /// A directory (with its parents), left as it is if the guest has it.
    pub fn add_dir(&mut self, guest: &Path) -> Result<(), InitramfsError> {
        let name = archive_name(guest)?;
        self.add_parents(&name);
        self.entry(&name, S_IFDIR | 0o755, &[]);
        Ok(())
    }

    fn add_parents(&mut self, name: &str) {
        let mut prefix = String::new();
        let parts: Vec<&str> = name.split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(part);
            // Existing directories are left as they are by the unpacker.
            self.entry(&prefix, S_IFDIR | 0o755, &[]);
        }
    }

    /// Copies a host file, directory tree or symbolic link to `guest`.
    pub fn add_host_path(&mut self, host: &Path, guest: &Path) -> Result<(), InitramfsError> {
        let read_err = |source| InitramfsError::Read {
            path: host.to_owned(),
            source,
        };
        let meta = fs::symlink_metadata(host).map_err(read_err)?;
        let mode = meta.permissions().mode();
        if meta.file_type().is_symlink() {
            let target = fs::read_link(host).map_err(read_err)?;
            let name = archive_name(guest)?;
            self.add_parents(&name);
            self.entry(
                &name,
                S_IFLNK | 0o777,
                target.as_os_str().as_encoded_bytes(),
            );
        } else if meta.is_file() {
            let data = trace::files::read_bounded(host, MAX_GUEST_FILE_BYTES, "guest file")?;
            self.add_file(guest, mode, &data)?;
        } else if meta.is_dir() {
            let name = archive_name(guest)?;
            self.add_parents(&name);
            self.entry(&name, S_IFDIR | (mode & 0o7777), &[]);
            let mut children: Vec<_> = fs::read_dir(host)
                .map_err(read_err)?
                .collect::<Result<_, _>>()
                .map_err(read_err)?;
            children.sort_by_key(|e| e.file_name());
            for child in children {
                self.add_host_path(&child.path(), &guest.join(child.file_name()))?;
            }
        } else {
            return Err(InitramfsError::Unsupported {
                path: host.to_owned(),
            });
        }
        Ok(())
    }

    /// The entries written so far (without the trailer).
    pub fn written(&self) -> &[u8] {
        &self.buf
    }

    /// Ends the archive with its trailer and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.buf
    }
}

/// The archive name of an absolute guest path: relative, no `..`.
fn archive_name(guest: &Path) -> Result<String, InitramfsError> {
    let bad = |why| InitramfsError::BadGuestPath {
        path: guest.to_owned(),
        why,
    };
    if !guest.is_absolute() {
        return Err(bad("is not absolute"));
    }
    let mut parts = Vec::new();
    for c in guest.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(p) => parts.push(p.to_str().ok_or_else(|| bad("is not UTF-8"))?),
            Component::ParentDir | Component::Prefix(_) => return Err(bad("contains '..'")),
        }
    }
    if parts.is_empty() {
        return Err(bad(
            "is the root directory: name a file or directory under it",
        ));
    }
    Ok(parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestfiles::newc::TRAILER;

    /// Reads a newc archive back into (name, mode, data): read to its
    /// end, its trailer last and only there.
    fn parse(b: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut entries = guestfiles::newc::entries(b);
        let mut out: Vec<_> = (entries.by_ref())
            .map(|e| (e.name.into_owned(), e.mode, e.body.to_vec()))
            .collect();
        assert_eq!(entries.offset(), b.len());
        assert_eq!(out.pop().map(|e| e.0).as_deref(), Some(TRAILER));
        assert!(out.iter().all(|e| e.0 != TRAILER));
        out
    }

    #[test]
    fn round_trips_files_with_parents() {
        let mut w = CpioWriter::new();
        w.add_file(Path::new("/etc/insight/command"), 0o644, b"sh\0-c\0true\0")
            .unwrap();
        let entries = parse(&w.finish());
        let names: Vec<_> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["etc", "etc/insight", "etc/insight/command"]);
        assert_eq!(entries[2].1, S_IFREG | 0o644);
        assert_eq!(entries[2].2, b"sh\0-c\0true\0");
        assert_eq!(entries[0].1, S_IFDIR | 0o755);
    }

    #[test]
    fn copies_host_trees() {
        let dir = std::env::temp_dir().join(format!("insight-cpio-{}", std::process::id()));
        fs::create_dir_all(dir.join("sub")).unwrap();
        fs::write(dir.join("sub/a.txt"), b"hello").unwrap();
        std::os::unix::fs::symlink("sub/a.txt", dir.join("link")).unwrap();
        let mut w = CpioWriter::new();
        w.add_host_path(&dir, Path::new("/opt/app")).unwrap();
        let entries = parse(&w.finish());
        fs::remove_dir_all(&dir).unwrap();
        let find = |n: &str| entries.iter().find(|e| e.0 == n).unwrap().clone();
        assert_eq!(find("opt/app/sub/a.txt").2, b"hello");
        let link = find("opt/app/link");
        assert_eq!(link.1 & 0o170000, S_IFLNK);
        assert_eq!(link.2, b"sub/a.txt");
    }

    #[test]
    fn rejects_escaping_or_relative_guest_paths() {
        let mut w = CpioWriter::new();
        // Each refused with its own reason.
        for (path, why) in [
            ("rel/x", "is not absolute"),
            ("/a/../../x", "contains '..'"),
            ("/", "is the root directory"),
        ] {
            let err = w.add_file(Path::new(path), 0o644, b"").unwrap_err();
            assert!(err.to_string().contains(why), "{path}: {err}");
        }
    }

    #[test]
    fn missing_host_file_is_named() {
        let mut w = CpioWriter::new();
        let err = w
            .add_host_path(Path::new("/no/such/file"), Path::new("/x"))
            .unwrap_err();
        assert!(err.to_string().contains("/no/such/file"));
    }
}
