//! The "newc" cpio format the Linux initramfs unpacker reads: a writer,
//! used to append the guest command and the user's files to the image at
//! boot without touching the base image, and a reader of what an image
//! holds (to bring into the guest only what it lacks).

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

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

const S_IFMT: u32 = 0o170000;
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

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
        let ino = self.next_ino;
        self.next_ino += 1;
        let nlink = if mode & S_IFDIR == S_IFDIR { 2 } else { 1 };
        let header = format!(
            "070701{ino:08X}{mode:08X}{uid:08X}{gid:08X}{nlink:08X}{mtime:08X}{size:08X}\
             {dmaj:08X}{dmin:08X}{rmaj:08X}{rmin:08X}{namesize:08X}{check:08X}",
            uid = 0,
            gid = 0,
            mtime = 0,
            size = data.len(),
            dmaj = 0,
            dmin = 0,
            rmaj = 0,
            rmin = 0,
            namesize = name.len() + 1,
            check = 0,
        );
        self.buf.extend_from_slice(header.as_bytes());
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
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

/// What an archive (or several, one after another, as an initramfs
/// holds them) leaves in the guest's file system: later entries replace
/// earlier ones, as the unpacker does.
#[derive(Default)]
pub struct ArchiveFiles<'a> {
    entries: HashMap<String, Entry<'a>>,
}

#[derive(Clone, Copy)]
enum Entry<'a> {
    File(&'a [u8]),
    Link(&'a [u8]),
    Dir,
}

/// Links followed before a lookup gives up (a loop, or a long chain).
const MAX_LINKS: usize = 16;

impl<'a> ArchiveFiles<'a> {
    /// Adds what `data` holds. Reading stops at the first malformed
    /// header, keeping what came before: an archive cut short still says
    /// what its complete entries are.
    pub fn add(&mut self, data: &'a [u8]) {
        let field = |at: usize| -> Option<usize> {
            let text = std::str::from_utf8(data.get(at..at + 8)?).ok()?;
            usize::from_str_radix(text, 16).ok()
        };
        let mut at = 0;
        while at + 110 <= data.len() {
            // Archives are padded with zeros between them.
            if data[at] == 0 {
                at += 4;
                continue;
            }
            let (true, Some(mode), Some(size), Some(namesize)) = (
                data[at..].starts_with(b"070701"),
                field(at + 14),
                field(at + 54),
                field(at + 94),
            ) else {
                return;
            };
            let name_start = at + 110;
            let body_start = (name_start + namesize).next_multiple_of(4);
            let body_end = body_start + size;
            if namesize == 0 || body_end > data.len() {
                return;
            }
            let name = String::from_utf8_lossy(&data[name_start..name_start + namesize - 1]);
            let body = &data[body_start..body_end];
            at = body_end.next_multiple_of(4);
            let name = name.trim_start_matches("./").trim_matches('/');
            let entry = match mode as u32 & S_IFMT {
                S_IFREG => Entry::File(body),
                S_IFLNK => Entry::Link(body),
                S_IFDIR => Entry::Dir,
                _ => continue,
            };
            if name != "TRAILER!!!" && !name.is_empty() && name != "." {
                self.entries.insert(name.to_owned(), entry);
            }
        }
    }

    /// The contents of the regular file at the absolute `path`, following
    /// symbolic links in every component as the guest's kernel would.
    pub fn file(&self, path: &Path) -> Option<&'a [u8]> {
        match self.resolve(path)? {
            Entry::File(body) => Some(body),
            _ => None,
        }
    }

    /// Whether the absolute `path` names a directory (following links).
    pub fn is_dir(&self, path: &Path) -> bool {
        matches!(self.resolve(path), Some(Entry::Dir))
    }

    fn resolve(&self, path: &Path) -> Option<Entry<'a>> {
        let mut pending: Vec<String> = components(path.to_str()?);
        pending.reverse();
        let mut done: Vec<String> = Vec::new();
        let mut links = 0;
        let mut entry = Entry::Dir;
        while let Some(part) = pending.pop() {
            if part == ".." {
                done.pop();
                entry = match done.is_empty() {
                    true => Entry::Dir,
                    false => *self.entries.get(&done.join("/"))?,
                };
                continue;
            }
            done.push(part);
            entry = *self.entries.get(&done.join("/"))?;
            if let Entry::Link(target) = entry {
                links += 1;
                if links > MAX_LINKS {
                    return None;
                }
                let target = std::str::from_utf8(target).ok()?;
                done.pop();
                if target.starts_with('/') {
                    done.clear();
                }
                pending.extend(components(target).into_iter().rev());
                entry = Entry::Dir;
            }
        }
        Some(entry)
    }
}

/// The names between slashes in `path`, without `.` and empty ones.
fn components(path: &str) -> Vec<String> {
    path.split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .map(str::to_owned)
        .collect()
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

    /// Parses a newc archive back into (name, mode, data).
    fn parse(mut b: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let start = b.as_ptr() as usize;
        let hex = |s: &[u8]| u32::from_str_radix(std::str::from_utf8(s).unwrap(), 16).unwrap();
        loop {
            assert_eq!(&b[..6], b"070701");
            let mode = hex(&b[14..22]);
            let size = hex(&b[54..62]) as usize;
            let namesize = hex(&b[94..102]) as usize;
            let name = String::from_utf8(b[110..110 + namesize - 1].to_vec()).unwrap();
            let mut off = 110 + namesize;
            off += (4 - (b.as_ptr() as usize - start + off) % 4) % 4;
            let data = b[off..off + size].to_vec();
            off += size;
            off += (4 - (b.as_ptr() as usize - start + off) % 4) % 4;
            b = &b[off..];
            if name == "TRAILER!!!" {
                assert!(b.is_empty());
                return out;
            }
            out.push((name, mode, data));
        }
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
