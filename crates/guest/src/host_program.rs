//! Programs named by their host path (`insight record -- ./myprog`): what
//! the guest needs to run one its image does not hold. The program goes to
//! the same absolute path in the guest, with the shared libraries the
//! image lacks or has in another version, found as the dynamic loader
//! finds them (DT_NEEDED, DT_RPATH, LD_LIBRARY_PATH, DT_RUNPATH, the
//! host's ld.so.conf, the system directories), on the host and then in
//! the image.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use guestfiles::elf::{self, DynamicLinking, ElfError};
use guestfiles::ArchiveFiles;

use crate::initramfs::MAX_GUEST_FILE_BYTES;

/// How the command line's command is found on the host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostCommand {
    /// The host's working directory when the command was given: relative
    /// paths are relative to it.
    pub cwd: PathBuf,
    /// A bare program name is looked up on the host's PATH
    /// (`--host-path`), not on the guest's.
    pub search_path: bool,
}

/// Why a host file was placed in the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacementReason {
    /// The program the command runs.
    Program,
    /// A library (or the dynamic loader) the image does not have.
    Missing,
    /// A library (or the dynamic loader) the image has in another version,
    /// replaced at the path where the guest's loader finds it.
    OtherVersion,
}

/// One host file placed in the guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Brought {
    pub host: PathBuf,
    pub guest: PathBuf,
    pub reason: PlacementReason,
}

/// What the guest needs to run a host program.
#[derive(Debug, Default)]
pub struct HostProgram {
    /// The program's absolute path, on the host and in the guest.
    pub path: PathBuf,
    /// The files to place, with their contents (the program first).
    pub files: Vec<(Brought, Vec<u8>)>,
    /// Directories the guest's loader searches only if told to
    /// (`LD_LIBRARY_PATH`), where brought libraries are.
    pub library_dirs: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum HostProgramError {
    #[error("{0}: no such file on the host, nor in the guest image")]
    Missing(PathBuf),
    #[error("{name}: not found on the host's PATH ({path})")]
    NotOnPath { name: String, path: String },
    #[error("{0} is not an executable file")]
    NotExecutable(PathBuf),
    #[error("cannot bring a host program into the guest")]
    Read(#[from] trace::files::FileError),
    #[error("{path} is not an x86-64 ELF program or library the guest can run")]
    BadElf {
        path: PathBuf,
        #[source]
        source: ElfError,
    },
    #[error(
        "{object} needs {library}, which neither the host's dynamic loader (searching {searched}) \
         nor the guest image has"
    )]
    MissingLibrary {
        object: PathBuf,
        library: String,
        searched: String,
    },
}

/// Directories glibc's loader on x86-64 Debian searches after everything
/// else (`ld.so --help`, "system search path").
const SYSTEM_DIRS: [&str; 4] = [
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib",
    "/usr/lib",
];

/// Where the host's `ld.so.cache` comes from.
const LD_SO_CONF: &str = "/etc/ld.so.conf";

/// The host program the command's first `word` names, with what it needs
/// that `image` lacks. `None` when the guest runs `word` itself: a bare
/// name (found on the guest's PATH) unless `how` searches the host's, or
/// an absolute path the image holds. `guest_library_path` is the
/// command's own `LD_LIBRARY_PATH`, which the guest's loader searches too.
pub fn find(
    word: &str,
    how: &HostCommand,
    image: &ArchiveFiles,
    guest_library_path: Option<&str>,
) -> Result<Option<HostProgram>, HostProgramError> {
    let path = if !word.contains('/') {
        if !how.search_path {
            return Ok(None);
        }
        on_host_path(word)?
    } else {
        let path = absolute(&how.cwd, Path::new(word));
        if word.starts_with('/') && image.file(&path).is_some() {
            return Ok(None);
        }
        path
    };
    let meta = std::fs::metadata(&path).map_err(|_| HostProgramError::Missing(path.clone()))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(HostProgramError::NotExecutable(path));
    }
    let data = trace::files::read_bounded(&path, MAX_GUEST_FILE_BYTES, "host program")?;
    let elf = elf_info(&path, &data)?;
    let mut walk = Walk {
        image,
        exe_rpath: Vec::new(),
        // The host's loader takes relative entries against the working
        // directory.
        host_library_path: std::env::var("LD_LIBRARY_PATH")
            .unwrap_or_default()
            .split(':')
            .filter(|d| !d.is_empty() && !d.contains('$'))
            .map(|d| absolute(&how.cwd, Path::new(d)))
            .collect(),
        guest_library_path: split_dirs(guest_library_path, None),
        host_conf_dirs: ld_so_conf_dirs(Path::new(LD_SO_CONF), 0),
        seen: BTreeSet::new(),
        out: HostProgram {
            path: path.clone(),
            ..Default::default()
        },
    };
    walk.bring(&path, &path, PlacementReason::Program, data);
    if let Some(elf) = elf {
        if let Some(interp) = &elf.interp {
            walk.interpreter(Path::new(interp))?;
        }
        if elf.runpath.is_empty() {
            walk.exe_rpath = split_dirs(Some(&elf.rpath), Some(parent(&path)));
        }
        walk.libraries(&path, &path, &elf)?;
    }
    Ok(Some(walk.out))
}

/// `word` made absolute against `cwd` by its names alone (`.` and `..`
/// removed), as the guest will see the same path.
pub fn absolute(cwd: &Path, word: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in cwd.join(word).components() {
        match c {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// The executable file `name` is on the host's PATH.
pub fn on_host_path(name: &str) -> Result<PathBuf, HostProgramError> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .filter(|d| d.starts_with('/'))
        .map(|d| Path::new(d).join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| HostProgramError::NotOnPath {
            name: name.to_owned(),
            path,
        })
}

fn parent(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new("/"))
}

/// The absolute directories of a colon-separated list, `$ORIGIN` replaced
/// by `origin` (without one, entries naming it are left out, as are
/// relative ones and those with other substitutions the loader makes).
fn split_dirs(list: Option<&str>, origin: Option<&Path>) -> Vec<PathBuf> {
    let Some(list) = list else {
        return Vec::new();
    };
    list.split(':')
        .filter_map(|d| {
            let d = match origin {
                Some(o) => d
                    .replace("${ORIGIN}", &o.to_string_lossy())
                    .replace("$ORIGIN", &o.to_string_lossy()),
                None => d.to_owned(),
            };
            (d.starts_with('/') && !d.contains('$')).then(|| absolute(Path::new("/"), d.as_ref()))
        })
        .collect()
}

/// The directories the host's `ld.so.conf` lists (`include` globs whose
/// only wildcard is a `*` in the file name), in order.
fn ld_so_conf_dirs(conf: &Path, depth: usize) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string(conf) else {
        return Vec::new();
    };
    let mut dirs = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(pattern) = line.strip_prefix("include") {
            let pattern = absolute(parent(conf), Path::new(pattern.trim()));
            if depth < 4 {
                for file in glob_file_names(&pattern) {
                    dirs.extend(ld_so_conf_dirs(&file, depth + 1));
                }
            }
        } else if line.starts_with('/') {
            dirs.push(PathBuf::from(line));
        }
    }
    dirs
}

/// The files `pattern` matches, sorted; only its last name may hold `*`.
fn glob_file_names(pattern: &Path) -> Vec<PathBuf> {
    let name = pattern
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Some((prefix, suffix)) = name.split_once('*') else {
        return vec![pattern.to_owned()];
    };
    let Ok(entries) = std::fs::read_dir(parent(pattern)) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().map(|n| n.to_string_lossy().into_owned());
            n.is_some_and(|n| {
                n.len() >= prefix.len() + suffix.len()
                    && n.starts_with(prefix)
                    && n.ends_with(suffix)
            })
        })
        .collect();
    out.sort();
    out
}

/// The dynamic linking of the file at `path` (see
/// [`elf::dynamic_linking`]).
fn elf_info(path: &Path, data: &[u8]) -> Result<Option<DynamicLinking>, HostProgramError> {
    elf::dynamic_linking(data).map_err(|source| HostProgramError::BadElf {
        path: path.to_owned(),
        source,
    })
}

/// Whether two builds of a file are the same version: by their GNU build
/// IDs when both have one (the image's copies of system libraries have
/// their RDTSC instructions patched out, which leaves the ID alone),
/// otherwise by their bytes.
fn same_version(a: &[u8], b: &[u8]) -> bool {
    match (elf::build_id(a), elf::build_id(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// The search for a program's libraries.
struct Walk<'w, 'a> {
    image: &'w ArchiveFiles<'a>,
    /// The executable's DT_RPATH (when it has no DT_RUNPATH): searched for
    /// every library's needs, on both sides.
    exe_rpath: Vec<PathBuf>,
    host_library_path: Vec<PathBuf>,
    guest_library_path: Vec<PathBuf>,
    host_conf_dirs: Vec<PathBuf>,
    /// Library names already dealt with.
    seen: BTreeSet<String>,
    out: HostProgram,
}

impl Walk<'_, '_> {
    fn bring(&mut self, host: &Path, guest: &Path, reason: PlacementReason, data: Vec<u8>) {
        let brought = Brought {
            host: host.to_owned(),
            guest: guest.to_owned(),
            reason,
        };
        self.out.files.push((brought, data));
    }

    /// The contents of `path` in the guest: brought, or in the image.
    fn in_guest(&self, path: &Path) -> Option<&[u8]> {
        self.out
            .files
            .iter()
            .rev()
            .find(|(b, _)| b.guest == path)
            .map(|(_, d)| d.as_slice())
            .or_else(|| self.image.file(path))
    }

    /// The program's dynamic loader, if the image lacks it or has another.
    fn interpreter(&mut self, interp: &Path) -> Result<(), HostProgramError> {
        // The loader is loaded already when libraries name it.
        if let Some(name) = interp.file_name() {
            self.seen.insert(name.to_string_lossy().into_owned());
        }
        let host = trace::files::read_bounded(interp, MAX_GUEST_FILE_BYTES, "dynamic loader")?;
        let reason = match self.in_guest(interp) {
            Some(guest) if same_version(guest, &host) => return Ok(()),
            Some(_) => PlacementReason::OtherVersion,
            None => PlacementReason::Missing,
        };
        self.bring(interp, interp, reason, host);
        Ok(())
    }

    /// Brings the libraries `elf` (at `host` and `guest`) needs, and
    /// theirs, that the guest would not find in the same version.
    fn libraries(
        &mut self,
        host: &Path,
        guest: &Path,
        elf: &DynamicLinking,
    ) -> Result<(), HostProgramError> {
        let own_rpath = |origin: &Path| {
            let mut dirs = Vec::new();
            if elf.runpath.is_empty() {
                dirs = split_dirs(Some(&elf.rpath), Some(origin));
            }
            dirs
        };
        let runpath = |origin: &Path| split_dirs(Some(&elf.runpath), Some(origin));
        let system = SYSTEM_DIRS.iter().map(PathBuf::from);
        let host_dirs: Vec<PathBuf> = own_rpath(parent(host))
            .into_iter()
            .chain(self.exe_rpath.iter().cloned())
            .chain(self.host_library_path.iter().cloned())
            .chain(runpath(parent(host)))
            .chain(self.host_conf_dirs.iter().cloned())
            .chain(system.clone())
            .collect();
        // The guest has no ld.so.cache: its loader searches the system
        // directories after the object's own paths and LD_LIBRARY_PATH.
        let guest_dirs: Vec<PathBuf> = own_rpath(parent(guest))
            .into_iter()
            .chain(self.exe_rpath.iter().cloned())
            .chain(self.guest_library_path.iter().cloned())
            .chain(runpath(parent(guest)))
            .chain(system)
            .collect();
        for name in &elf.needed {
            if !self.seen.insert(name.clone()) {
                continue;
            }
            let candidates = |dirs: &[PathBuf]| -> Vec<PathBuf> {
                match name.contains('/') {
                    true => vec![PathBuf::from(name)],
                    false => dirs.iter().map(|d| d.join(name)).collect(),
                }
            };
            let on_host = candidates(&host_dirs)
                .into_iter()
                .find_map(|p| Some((loadable(&p)?, p)));
            let in_guest = candidates(&guest_dirs)
                .into_iter()
                .find(|p| self.in_guest(p).is_some());
            let (data, found) = match (on_host, &in_guest) {
                (Some(host), _) => host,
                (None, Some(_)) => continue,
                (None, None) => {
                    return Err(HostProgramError::MissingLibrary {
                        object: host.to_owned(),
                        library: name.clone(),
                        searched: host_dirs
                            .iter()
                            .map(|d| d.display().to_string())
                            .collect::<Vec<_>>()
                            .join(":"),
                    })
                }
            };
            let (target, reason) = match in_guest {
                Some(at) if self.in_guest(&at).is_some_and(|g| same_version(g, &data)) => continue,
                Some(at) => (at, PlacementReason::OtherVersion),
                None => {
                    let dir = parent(&found).to_owned();
                    if !guest_dirs.contains(&dir) && !self.out.library_dirs.contains(&dir) {
                        self.out.library_dirs.push(dir);
                    }
                    (found.clone(), PlacementReason::Missing)
                }
            };
            let info = elf_info(&found, &data)?.unwrap_or_default();
            self.bring(&found, &target, reason, data);
            self.libraries(&found, &target, &info)?;
        }
        Ok(())
    }
}

/// The contents of the library at `path` if the loader would take it: a
/// readable 64-bit x86-64 ELF file (it skips other architectures' files
/// of the same name and searches on).
fn loadable(path: &Path) -> Option<Vec<u8>> {
    let data = trace::files::read_bounded(path, MAX_GUEST_FILE_BYTES, "library").ok()?;
    elf::is_x86_64(&data).then_some(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::initramfs::CpioWriter;

    #[test]
    fn paths_are_made_absolute_by_their_names() {
        let cwd = Path::new("/home/u/src");
        assert_eq!(
            absolute(cwd, Path::new("./prog")),
            Path::new("/home/u/src/prog")
        );
        assert_eq!(
            absolute(cwd, Path::new("../bin/p")),
            Path::new("/home/u/bin/p")
        );
        assert_eq!(absolute(cwd, Path::new("/opt/x/../y")), Path::new("/opt/y"));
        assert_eq!(absolute(cwd, Path::new("/../..")), Path::new("/"));
    }

    #[test]
    fn search_lists_expand_origin_and_drop_what_the_guest_cannot_use() {
        let origin = Path::new("/opt/app/bin");
        assert_eq!(
            split_dirs(
                Some("$ORIGIN/../lib:/usr/local/lib:rel:${ORIGIN}:$PLATFORM/x"),
                Some(origin)
            ),
            [
                PathBuf::from("/opt/app/lib"),
                PathBuf::from("/usr/local/lib"),
                PathBuf::from("/opt/app/bin")
            ]
        );
        assert!(split_dirs(None, Some(origin)).is_empty());
    }

    #[test]
    fn ld_so_conf_includes_are_followed_in_order() {
        let dir = std::env::temp_dir().join(format!("insight-ldconf-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("conf.d")).unwrap();
        std::fs::write(
            dir.join("ld.so.conf"),
            "# comment\n/first\ninclude conf.d/*.conf\n/last # trailing\n",
        )
        .unwrap();
        std::fs::write(dir.join("conf.d/b.conf"), "/from-b\n").unwrap();
        std::fs::write(
            dir.join("conf.d/a.conf"),
            "/from-a\ninclude ../ld.so.conf\n",
        )
        .unwrap();
        std::fs::write(dir.join("conf.d/c.txt"), "/not-a-conf\n").unwrap();
        let dirs = ld_so_conf_dirs(&dir.join("ld.so.conf"), 3);
        std::fs::remove_dir_all(&dir).unwrap();
        // The include loop ends at the depth bound.
        assert_eq!(
            dirs,
            ["/first", "/from-a", "/from-b", "/last"].map(PathBuf::from)
        );
    }

    /// An image holding this test's own executable's libraries, as the
    /// host has them.
    #[test]
    fn a_host_program_brings_only_what_the_image_lacks() {
        let exe = std::env::current_exe().unwrap();
        let data = std::fs::read(&exe).unwrap();
        let elf = elf_info(&exe, &data).unwrap().unwrap();
        assert!(
            elf.needed.iter().any(|n| n.starts_with("libc.so")),
            "{:?}",
            elf.needed
        );
        let how = HostCommand {
            cwd: parent(&exe).to_owned(),
            search_path: false,
        };
        let word = format!("./{}", exe.file_name().unwrap().to_str().unwrap());

        // An empty image: the program, its loader and every library come.
        let empty = ArchiveFiles::default();
        let all = find(&word, &how, &empty, None).unwrap().unwrap();
        assert_eq!(all.path, exe);
        assert_eq!(all.files[0].0.reason, PlacementReason::Program);
        let names: Vec<String> = all
            .files
            .iter()
            .map(|(b, _)| b.guest.display().to_string())
            .collect();
        assert!(names.iter().any(|n| n.ends_with("/libc.so.6")), "{names:?}");
        assert!(names.contains(&elf.interp.clone().unwrap()), "{names:?}");
        assert!(all.files[1..]
            .iter()
            .all(|(b, _)| b.reason == PlacementReason::Missing));

        // An image with all of them: only the program comes.
        let mut w = CpioWriter::new();
        for (b, d) in &all.files[1..] {
            w.add_file(&b.guest, 0o755, d).unwrap();
        }
        let archive = w.finish();
        let mut full = ArchiveFiles::default();
        full.add(&archive);
        let only = find(&word, &how, &full, None).unwrap().unwrap();
        assert_eq!(only.files.len(), 1);
        assert!(only.library_dirs.is_empty());

        // The image's copy of libc patched (as the image's RDTSC patching
        // does): the same build, by its ID, so it stays.
        let (libc, _) = all
            .files
            .iter()
            .find(|(b, _)| b.guest.ends_with("libc.so.6"))
            .unwrap();
        let mut w = CpioWriter::new();
        for (b, d) in &all.files[1..] {
            let mut d = d.clone();
            if b.guest == libc.guest {
                *d.last_mut().unwrap() ^= 0xff;
            }
            w.add_file(&b.guest, 0o755, &d).unwrap();
        }
        let archive = w.finish();
        let mut patched = ArchiveFiles::default();
        patched.add(&archive);
        assert_eq!(
            find(&word, &how, &patched, None)
                .unwrap()
                .unwrap()
                .files
                .len(),
            1
        );

        // An image with another libc at the same path: replaced in place.
        let mut w = CpioWriter::new();
        for (b, d) in &all.files[1..] {
            let other = b"\x7fELF not this one".to_vec();
            w.add_file(
                &b.guest,
                0o755,
                if b.guest == libc.guest { &other } else { d },
            )
            .unwrap();
        }
        let archive = w.finish();
        let mut other = ArchiveFiles::default();
        other.add(&archive);
        let replaced = find(&word, &how, &other, None).unwrap().unwrap();
        let kinds: Vec<_> = replaced
            .files
            .iter()
            .map(|(b, _)| (b.guest.clone(), b.reason))
            .collect();
        assert_eq!(
            kinds,
            [
                (exe.clone(), PlacementReason::Program),
                (libc.guest.clone(), PlacementReason::OtherVersion)
            ]
        );
    }

    #[test]
    fn the_guest_runs_its_own_programs_and_missing_ones_are_named() {
        let how = HostCommand {
            cwd: PathBuf::from("/"),
            search_path: false,
        };
        let mut w = CpioWriter::new();
        w.add_file(Path::new("/usr/bin/tool"), 0o755, b"#!/bin/sh\n")
            .unwrap();
        let archive = w.finish();
        let mut image = ArchiveFiles::default();
        image.add(&archive);
        assert!(find("tool", &how, &image, None).unwrap().is_none());
        assert!(find("/usr/bin/tool", &how, &image, None).unwrap().is_none());
        let err = find("/no/such/prog", &how, &image, None).unwrap_err();
        assert!(err.to_string().contains("/no/such/prog"), "{err}");
        // Not executable.
        let err = find("/etc/passwd", &how, &image, None).unwrap_err();
        assert!(err.to_string().contains("not an executable"), "{err}");
        let searched = HostCommand {
            search_path: true,
            ..how
        };
        let err = find("no-such-program-anywhere", &searched, &image, None).unwrap_err();
        assert!(err.to_string().contains("PATH"), "{err}");
    }
}
