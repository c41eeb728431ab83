//! The guest's files as a run had them: its initramfs (the "newc" cpio
//! archives the kernel unpacked, the run's archive among them), its
//! kernel's image, and the detached debug files the host has for its
//! stripped libraries.

use std::collections::HashMap;
use std::path::Path;

use object::Object;

use crate::archive::FileTree;
use crate::elf::build_id;

/// The guest's files, each a copy of its archive's entry.
#[derive(Default)]
pub struct GuestFiles {
    tree: FileTree<Vec<u8>>,
    /// Detached debug files of stripped ELF files, by the ELF file's name
    /// in the tree.
    debug: HashMap<String, Vec<u8>>,
    /// The guest kernel's ELF image (`vmlinux`), for the names of kernel
    /// functions.
    kernel: Option<Vec<u8>>,
}

/// Where a run in the host's files has the image's programs
/// (`guest::IMAGE_PROGRAMS`, which `/init` binds there).
pub const IMAGE_PROGRAMS: &str = "/.insight-image/bin";

/// Debug files larger than this are not read (1 GiB).
const MAX_DEBUG_FILE: u64 = 1 << 30;

impl GuestFiles {
    /// Reads every archive in `data`; stops quietly at the first malformed
    /// header (what came before stays).
    pub fn from_initramfs(data: &[u8]) -> Self {
        let mut g = GuestFiles::default();
        g.tree.add_with(data, <[u8]>::to_vec);
        g
    }

    /// The contents of the file at `path`, following symbolic links. In
    /// the host's files, `/init` shows the image's `/usr/bin` at
    /// [`IMAGE_PROGRAMS`]: a program there is the image's.
    pub fn get(&self, path: &str) -> Option<&[u8]> {
        let image = path
            .trim_start_matches('/')
            .strip_prefix(IMAGE_PROGRAMS.trim_start_matches('/'))
            .and_then(|rest| rest.strip_prefix('/'))
            .map(|name| format!("/usr/bin/{name}"));
        self.tree
            .get(image.as_deref().unwrap_or(path))
            .map(Vec::as_slice)
    }

    /// The paths of its regular files (without the leading `/`).
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.tree.files().map(|(path, _)| path)
    }

    /// Gives the guest kernel's image: kernel addresses are then named by
    /// its symbol table (a `vmlinux` has one; a compressed `bzImage` is
    /// not an ELF file, and kernel addresses stay `[kernel]`).
    pub fn set_kernel(&mut self, image: Vec<u8>) {
        self.kernel = Some(image);
    }

    /// The guest kernel's image, if given.
    pub fn kernel(&self) -> Option<&[u8]> {
        self.kernel.as_deref()
    }

    /// The detached debug file found for the ELF file at `path`.
    pub fn debug_file(&self, path: &str) -> Option<&[u8]> {
        let (key, _) = self.tree.file_entry(path)?;
        self.debug.get(&key).map(Vec::as_slice)
    }

    /// Finds, for each of the guest files at `paths` that is an ELF file
    /// without a symbol table of its own (a stripped library), its
    /// detached debug file by build ID under `dir` (`.build-id/xx/yyyy.debug`,
    /// the layout of Debian's `-dbg` and `-dbgsym` packages, with `dir`
    /// usually `/usr/lib/debug`), and keeps it when it is a regular file of
    /// at most `MAX_DEBUG_FILE` bytes with the same build ID. Returns how
    /// many were found.
    pub fn add_debug_files<'p>(
        &mut self,
        dir: &Path,
        paths: impl IntoIterator<Item = &'p str>,
    ) -> usize {
        let mut found = 0;
        for path in paths {
            let Some((key, data)) = self.tree.file_entry(path) else {
                continue;
            };
            if self.debug.contains_key(&key) {
                continue;
            }
            let Some(id) = stripped_build_id(data) else {
                continue;
            };
            let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
            let path = dir
                .join(".build-id")
                .join(&hex[..2])
                .join(format!("{}.debug", &hex[2..]));
            let usable =
                std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() <= MAX_DEBUG_FILE);
            let Some(debug) = usable.then(|| std::fs::read(&path).ok()).flatten() else {
                continue;
            };
            if build_id(&debug) == Some(id.as_slice()) {
                self.debug.insert(key, debug);
                found += 1;
            }
        }
        found
    }
}

/// The build ID of an ELF file without a `.symtab`, at least 4 bytes long
/// (shorter ones would make a file name of nothing).
pub(crate) fn stripped_build_id(data: &[u8]) -> Option<Vec<u8>> {
    let file = object::File::parse(data).ok()?;
    if file.section_by_name(".symtab").is_some() {
        return None;
    }
    let id = file.build_id().ok()??;
    (id.len() >= 4).then(|| id.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::newc::{write_entry, S_IFDIR, S_IFLNK, S_IFREG, TRAILER};

    #[test]
    fn reads_files_and_links_of_concatenated_archives() {
        let mut a = Vec::new();
        for dir in ["usr", "usr/bin", "lib", "lib64"] {
            write_entry(&mut a, 1, dir, S_IFDIR | 0o755, b"");
        }
        write_entry(&mut a, 2, "usr/bin/x", S_IFREG | 0o755, b"first");
        write_entry(
            &mut a,
            3,
            "lib64/ld.so",
            S_IFLNK | 0o777,
            b"/lib/real-ld.so",
        );
        write_entry(&mut a, 4, "lib/real-ld.so", S_IFREG | 0o755, b"loader");
        write_entry(&mut a, 5, TRAILER, 0, b"");
        a.extend_from_slice(&[0; 512]);
        write_entry(&mut a, 1, "usr/bin/x", S_IFREG | 0o755, b"second");
        write_entry(&mut a, 2, TRAILER, 0, b"");
        let g = GuestFiles::from_initramfs(&a);
        assert_eq!(g.get("/usr/bin/x"), Some(&b"second"[..]));
        assert_eq!(g.get("/lib64/ld.so"), Some(&b"loader"[..]));
        assert_eq!(g.get("/nope"), None);
        // Any truncation keeps what came before it and never panics.
        for n in 0..a.len() {
            let _ = GuestFiles::from_initramfs(&a[..n]).get("/usr/bin/x");
        }
    }

    #[test]
    fn link_loops_end() {
        let mut a = Vec::new();
        write_entry(&mut a, 1, "a", S_IFLNK | 0o777, b"b");
        write_entry(&mut a, 2, "b", S_IFLNK | 0o777, b"a");
        assert_eq!(GuestFiles::from_initramfs(&a).get("/a"), None);
    }
}
