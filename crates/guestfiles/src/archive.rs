//! What archives (or several, one after another, as an initramfs holds
//! them) leave in the guest's file system: later entries replace earlier
//! ones, as the unpacker does, and paths are looked up following symbolic
//! links in every component, as the guest's kernel would.

use std::collections::HashMap;
use std::path::Path;

use crate::newc::{self, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG, TRAILER};

/// The regular files, symbolic links and directories of archives, each
/// file's contents held as `B` (borrowed from the archive, or a copy).
pub struct FileTree<B> {
    entries: HashMap<String, Node<B>>,
}

/// A tree borrowing its files from the archives it was read from.
pub type ArchiveFiles<'a> = FileTree<&'a [u8]>;

enum Node<B> {
    File(B),
    /// Its target.
    Link(B),
    Dir,
}

/// Links followed before a lookup gives up (a loop, or a long chain).
const MAX_LINKS: usize = 16;

impl<B> Default for FileTree<B> {
    fn default() -> Self {
        FileTree {
            entries: HashMap::new(),
        }
    }
}

impl<B: AsRef<[u8]>> FileTree<B> {
    /// Adds what the archives in `data` hold, each file's contents (and
    /// each link's target) kept as `keep` makes them. Reading stops at the
    /// first malformed header (see [`newc::entries`]).
    pub fn add_with<'d>(&mut self, data: &'d [u8], mut keep: impl FnMut(&'d [u8]) -> B) {
        for entry in newc::entries(data) {
            let name = entry.name.trim_start_matches("./").trim_matches('/');
            if name == TRAILER || name.is_empty() || name == "." {
                continue;
            }
            let node = match entry.mode & S_IFMT {
                S_IFREG => Node::File(keep(entry.body)),
                S_IFLNK => Node::Link(keep(entry.body)),
                S_IFDIR => Node::Dir,
                _ => continue,
            };
            self.entries.insert(name.to_owned(), node);
        }
    }

    /// The contents of the regular file at `path` (absolute, or relative
    /// to the root), following symbolic links.
    pub fn get(&self, path: &str) -> Option<&B> {
        self.file_entry(path).map(|(_, body)| body)
    }

    /// The name the regular file at `path` is stored under (without the
    /// leading `/`, links followed), and its contents.
    pub fn file_entry(&self, path: &str) -> Option<(String, &B)> {
        match self.resolve(path)? {
            (key, Some(Node::File(body))) => Some((key, body)),
            _ => None,
        }
    }

    /// The paths of its regular files (without the leading `/`) and their
    /// contents.
    pub fn files(&self) -> impl Iterator<Item = (&str, &B)> {
        self.entries.iter().filter_map(|(name, node)| match node {
            Node::File(body) => Some((name.as_str(), body)),
            _ => None,
        })
    }

    /// The entry `path` leads to and its name; `None` for the entry of the
    /// root directory.
    fn resolve(&self, path: &str) -> Option<(String, Option<&Node<B>>)> {
        let mut pending: Vec<String> = components(path);
        pending.reverse();
        let mut done: Vec<String> = Vec::new();
        let mut links = 0;
        let mut entry = None;
        while let Some(part) = pending.pop() {
            if part == ".." {
                done.pop();
                entry = match done.is_empty() {
                    true => None,
                    false => Some(self.entries.get(&done.join("/"))?),
                };
                continue;
            }
            done.push(part);
            let node = self.entries.get(&done.join("/"))?;
            entry = Some(node);
            if let Node::Link(target) = node {
                links += 1;
                if links > MAX_LINKS {
                    return None;
                }
                let target = std::str::from_utf8(target.as_ref()).ok()?;
                done.pop();
                if target.starts_with('/') {
                    done.clear();
                }
                pending.extend(components(target).into_iter().rev());
                entry = None;
            }
        }
        Some((done.join("/"), entry))
    }
}

impl<'a> ArchiveFiles<'a> {
    /// Adds what the archives in `data` hold. Reading stops at the first
    /// malformed header, keeping what came before.
    pub fn add(&mut self, data: &'a [u8]) {
        self.add_with(data, |body| body);
    }

    /// The contents of the regular file at the absolute `path`, following
    /// symbolic links in every component as the guest's kernel would.
    pub fn file(&self, path: &Path) -> Option<&'a [u8]> {
        self.get(path.to_str()?).copied()
    }
}

/// The names between slashes in `path`, without `.` and empty ones.
fn components(path: &str) -> Vec<String> {
    path.split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::newc::write_entry;

    fn archive(entries: &[(&str, u32, &[u8])]) -> Vec<u8> {
        let mut a = Vec::new();
        for (ino, (name, mode, body)) in entries.iter().enumerate() {
            write_entry(&mut a, ino as u32 + 1, name, *mode, body);
        }
        write_entry(&mut a, 0, TRAILER, 0, b"");
        a
    }

    #[test]
    fn links_are_followed_in_every_component() {
        let a = archive(&[
            ("usr", S_IFDIR | 0o755, b""),
            ("usr/lib", S_IFDIR | 0o755, b""),
            ("usr/lib/libc.so.6", S_IFREG | 0o755, b"libc"),
            ("lib", S_IFLNK | 0o777, b"usr/lib"),
            ("lib64", S_IFLNK | 0o777, b"/lib/../lib/"),
            ("usr/lib/self", S_IFLNK | 0o777, b"../lib/self"),
        ]);
        let mut files = ArchiveFiles::default();
        files.add(&a);
        let libc = Some(&b"libc"[..]);
        assert_eq!(files.file(Path::new("/usr/lib/libc.so.6")), libc);
        assert_eq!(files.file(Path::new("/lib/libc.so.6")), libc);
        assert_eq!(files.file(Path::new("/lib64/./libc.so.6")), libc);
        assert_eq!(
            files.file_entry("/lib64/libc.so.6").map(|(key, _)| key),
            Some("usr/lib/libc.so.6".to_owned())
        );
        // Directories and link loops are no files.
        assert_eq!(files.file(Path::new("/usr/lib")), None);
        assert_eq!(files.file(Path::new("/usr/lib/self")), None);
        // A file needs its directory.
        let orphan = archive(&[("opt/x", S_IFREG | 0o644, b"x")]);
        files.add(&orphan);
        assert_eq!(files.file(Path::new("/opt/x")), None);
    }

    #[test]
    fn later_entries_replace_earlier_ones() {
        let first = archive(&[
            ("bin", S_IFDIR | 0o755, b""),
            ("bin/sh", S_IFREG | 0o755, b"old"),
        ]);
        let second = archive(&[("bin/sh", S_IFLNK | 0o777, b"busybox")]);
        let third = archive(&[("bin/busybox", S_IFREG | 0o755, b"new")]);
        let mut files = ArchiveFiles::default();
        for a in [&first, &second, &third] {
            files.add(a);
        }
        assert_eq!(files.file(Path::new("/bin/sh")), Some(&b"new"[..]));
        let mut paths: Vec<_> = files.files().map(|(p, _)| p).collect();
        paths.sort_unstable();
        assert_eq!(paths, ["bin/busybox"]);
    }
}
