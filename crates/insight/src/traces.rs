//! Where recordings go when the user names none, and how a trace is
//! found again by its short name or as the latest one, as rr does.
//!
//! The store is `$INSIGHT_TRACE_DIR`, else `$XDG_DATA_HOME/insight/traces`,
//! else `~/.local/share/insight/traces`. A recording gets `NAME-N`, NAME
//! from its config file or command and N the first number free; the
//! directory is created with `mkdir`, which fails if another recording took
//! the name first, so two recordings started at once never share one. The
//! `latest` link names the last recording started (once its header is
//! written), replaced atomically (a new link renamed over the old one). A
//! directory whose recorder ended before writing a header is a leftover:
//! `ls` shows it, `rm` removes it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use guestfiles::GuestFiles;

/// The link to the last recording started, in the store.
pub const LATEST: &str = "latest";
/// The event database `replay --diagnose` writes into a trace.
pub const EVENTS_DB: &str = "events.db";

/// Where `replay --diagnose` writes a tool's attachment of `format` for
/// the event database `db`: beside it, as `STEM.TOOL.FORMAT`
/// (`events.timeline.json` for `events.db`).
pub fn beside_events(db: &Path, tool: &str, format: &str) -> PathBuf {
    let stem = db.file_stem().unwrap_or_default().to_string_lossy();
    db.with_file_name(format!("{stem}.{tool}.{format}"))
}

/// The trace store, from the environment (`vars` reads a variable).
pub fn store_from(vars: impl Fn(&str) -> Option<String>) -> Result<PathBuf> {
    let set = |v: &str| vars(v).filter(|s| !s.is_empty()).map(PathBuf::from);
    if let Some(dir) = set("INSIGHT_TRACE_DIR") {
        return Ok(dir);
    }
    if let Some(data) = set("XDG_DATA_HOME") {
        return Ok(data.join("insight").join("traces"));
    }
    match set("HOME") {
        Some(home) => Ok(home.join(".local/share/insight/traces")),
        None => {
            bail!("no place for traces: set INSIGHT_TRACE_DIR (or HOME), or name one with -o DIR")
        }
    }
}

/// The trace store of this process's environment.
pub fn store() -> Result<PathBuf> {
    store_from(|v| std::env::var(v).ok())
}

/// A short name for a recording of `command` (the guest command) or of
/// the config file `config`: the config's file stem, else the program's
/// name (past `env` and its settings, and a shell's `-c`), kept to
/// letters, digits, `.`, `_` and `-`.
pub fn base_name(config: Option<&Path>, command: &[String]) -> String {
    let from_config = config
        .and_then(|c| c.file_stem())
        .map(|s| s.to_string_lossy().into_owned());
    let name = from_config
        .or_else(|| command_program(command))
        .unwrap_or_default();
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let clean = clean.trim_matches('.').to_owned();
    if clean.is_empty() || clean == LATEST {
        "trace".to_owned()
    } else {
        clean
    }
}

/// Makes a new, empty trace directory `BASE-N` in `store` (N the first
/// number not taken). `latest` moves to it only once it is a trace (its
/// header written: [`set_latest`]).
pub fn new_trace(store: &Path, base: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(store)
        .with_context(|| format!("cannot create the trace store {}", store.display()))?;
    for n in 0..100_000u32 {
        let dir = store.join(format!("{base}-{n}"));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("cannot create {}", dir.display()));
            }
        }
    }
    bail!("{}: no free name for another {base} trace", store.display())
}

/// Points `latest` in `store` at `trace`, atomically.
pub fn set_latest(store: &Path, trace: &Path) -> Result<()> {
    let target = trace.file_name().map(PathBuf::from).unwrap_or_default();
    // A name no other writer uses: trace names are unique in the store.
    let tmp = store.join(format!(
        ".{LATEST}-{}-{}",
        std::process::id(),
        target.display()
    ));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&target, &tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    std::fs::rename(&tmp, store.join(LATEST))
        .with_context(|| format!("cannot update {}", store.join(LATEST).display()))
}

/// The trace `name` stands for: a directory path, or a short name in
/// `store`; with no name, the latest recording.
pub fn resolve_in(store: &Path, name: Option<&Path>) -> Result<PathBuf> {
    let Some(name) = name else {
        return latest(store);
    };
    if name.is_dir() {
        return Ok(name.to_owned());
    }
    let short = store.join(name);
    if name.components().count() == 1 && short.is_dir() {
        return Ok(short);
    }
    bail!(
        "no trace {}: neither a directory nor a recording in {} (insight ls lists them)",
        name.display(),
        store.display()
    )
}

/// The trace `name` stands for, in this environment's store.
pub fn resolve(name: Option<&Path>) -> Result<PathBuf> {
    match name {
        Some(n) if n.is_dir() => Ok(n.to_owned()),
        _ => resolve_in(&store()?, name),
    }
}

fn latest(store: &Path) -> Result<PathBuf> {
    let link = store.join(LATEST);
    let Ok(target) = std::fs::read_link(&link) else {
        bail!(
            "no trace named, and no recording yet in {}: record one with `insight record`, or \
             name a trace directory",
            store.display()
        );
    };
    let trace = store.join(&target);
    if !trace.is_dir() {
        bail!(
            "the latest recording, {}, is gone (removed?): name a trace, or see `insight ls`",
            target.display()
        );
    }
    Ok(trace)
}

/// Whether `dir` is a directory of `store` that a recorder made and left
/// empty (it ended before writing the header), and no command holds.
fn leftover(store: &Path, dir: &Path) -> bool {
    let parent = dir.parent().and_then(|p| std::fs::canonicalize(p).ok());
    parent.is_some() && parent == std::fs::canonicalize(store).ok() && empty_unheld(dir)
}

/// Whether the store entry `dir` is an empty directory (not `latest`, not
/// a link) that no command holds.
fn empty_unheld(dir: &Path) -> bool {
    !dir.is_symlink()
        && dir.file_name().is_some_and(|n| n != LATEST)
        && is_empty_dir(dir)
        && hold(dir, TraceUse::Exclusive).is_ok()
}

/// Whether `dir` is a directory with nothing in it.
pub fn is_empty_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none())
}

/// The leftover directories of `store` (see [`leftover`]), by name.
pub fn leftovers(store: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(store) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && empty_unheld(p))
        .collect();
    found.sort();
    found
}

/// The recordings in `store`, oldest first.
pub fn list(store: &Path) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(store) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", store.display())),
    };
    let mut traces: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().is_some_and(|n| n != LATEST)
                && !p.is_symlink()
                && p.is_dir()
                && trace::is_trace(p)
        })
        .map(|p| {
            let time = std::fs::metadata(&p)
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            (time, p)
        })
        .collect();
    traces.sort();
    Ok(traces.into_iter().map(|t| t.1).collect())
}

/// How a command uses a trace it holds (see [`hold`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceUse {
    /// Recording into it, or removing it: no other command may use it.
    Exclusive,
    /// Replaying it (and writing its event database or checkpoints):
    /// other replays may too, a recorder or `rm` may not.
    Shared,
}

/// A command's hold on a trace directory: a `flock` on the directory,
/// which the kernel releases when the process ends, however it ends (no
/// stale lock after a crash or SIGKILL).
#[derive(Debug)]
pub struct TraceHold {
    dir: std::fs::File,
}

impl TraceHold {
    /// Whether `path` still names the directory held (not one made in its
    /// place after it was removed).
    pub fn is_at(&self, path: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (self.dir.metadata(), std::fs::metadata(path)) {
            (Ok(held), Ok(named)) => (held.dev(), held.ino()) == (named.dev(), named.ino()),
            _ => false,
        }
    }
}

/// Takes a hold on the trace directory `trace` for `how`, or says which
/// command holds it. A file system without `flock` gives no hold and no
/// error.
pub fn hold(trace: &Path, how: TraceUse) -> Result<Option<TraceHold>> {
    let dir = std::fs::File::open(trace)
        .with_context(|| format!("cannot open the trace {}", trace.display()))?;
    let taken = match how {
        TraceUse::Exclusive => dir.try_lock(),
        TraceUse::Shared => dir.try_lock_shared(),
    };
    match taken {
        Ok(()) => Ok(Some(TraceHold { dir })),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "{} is in use by {}",
            trace.display(),
            holders(trace).unwrap_or_else(|| "another insight command".to_owned())
        ),
        Err(std::fs::TryLockError::Error(_)) => Ok(None),
    }
}

/// Whether an `insight record` is writing the trace `dir` now.
pub fn being_recorded(dir: &Path) -> bool {
    holders(dir).is_some_and(|h| h.contains(" record)"))
}

/// The processes holding `flock`s on `dir`, as "pid N (insight record),
/// …", from /proc/locks; `None` if none can be named.
fn holders(dir: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).ok()?;
    let dev = meta.dev();
    // As glibc's gnu_dev_major/gnu_dev_minor split st_dev.
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let id = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    // "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF": (pid, dev:ino).
    let flocks: Vec<(u32, &str)> = locks
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let at = fields.iter().position(|f| *f == "FLOCK")?;
            Some((fields.get(at + 3)?.parse().ok()?, *fields.get(at + 4)?))
        })
        .collect();
    let mut pids: Vec<u32> = flocks.iter().filter(|l| l.1 == id).map(|l| l.0).collect();
    if pids.is_empty() {
        // File systems whose stat shows another device than the kernel's
        // lock table (btrfs subvolumes): by inode alone.
        let ino = format!(":{}", meta.ino());
        pids = flocks
            .iter()
            .filter(|l| l.1.ends_with(&ino))
            .map(|l| l.0)
            .collect();
    }
    pids.sort_unstable();
    pids.dedup();
    let named: Vec<String> = pids
        .iter()
        .map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let mut args = cmdline.split(|&b| b == 0).filter(|a| !a.is_empty());
            let program = args.next().map(|a| {
                String::from_utf8_lossy(a.rsplit(|&b| b == b'/').next().unwrap_or(a)).into_owned()
            });
            match (program, args.next()) {
                (Some(p), Some(sub)) => format!("pid {pid} ({p} {})", String::from_utf8_lossy(sub)),
                (Some(p), None) => format!("pid {pid} ({p})"),
                _ => format!("pid {pid}"),
            }
        })
        .collect();
    (!named.is_empty()).then(|| named.join(", "))
}

/// Removes the trace directory `trace` (refusing anything that is not
/// one, and a trace another command is using); if `latest` in `store`
/// named it, it names the newest one left.
pub fn remove(store: &Path, trace: &Path) -> Result<()> {
    if leftover(store, trace) {
        // Nothing in it to lose, nothing pointing at it.
        return std::fs::remove_dir(trace)
            .with_context(|| format!("cannot remove {}", trace.display()));
    }
    if trace.is_symlink() || !trace.is_dir() || !trace::is_trace(trace) {
        bail!(
            "{} is not a trace directory (no trace header in it): not removed",
            trace.display()
        );
    }
    let _hold = hold(trace, TraceUse::Exclusive).context("not removed")?;
    std::fs::remove_dir_all(trace).with_context(|| format!("cannot remove {}", trace.display()))?;
    let link = store.join(LATEST);
    let dangling = std::fs::read_link(&link).is_ok_and(|t| !store.join(t).is_dir());
    if dangling {
        match list(store)?.last() {
            Some(newest) => set_latest(store, newest)?,
            None => std::fs::remove_file(&link)
                .with_context(|| format!("cannot remove {}", link.display()))?,
        }
    }
    Ok(())
}

/// The event database to read for `arg`: a database file, the one in a
/// trace (by path or short name), or, with no argument, the one in the
/// latest recording. A trace without one says which replay makes it.
pub fn events_db(arg: Option<&Path>, tool: &str) -> Result<PathBuf> {
    if let Some(path) = arg {
        if path.is_file() {
            return Ok(path.to_owned());
        }
        // A file name (`e3.db`) that names nothing: not a recording either.
        if path.extension().is_some() && !path.exists() && resolve(arg).is_err() {
            bail!(
                "{}: no such file (name an event database, or a recording by path or name)",
                path.display()
            );
        }
    }
    let trace = resolve(arg)?;
    let db = trace.join(EVENTS_DB);
    if !db.is_file() {
        bail!(
            "{} has no event database yet: replay it with `insight replay {} --diagnose {tool}` \
             (or --events FILE and name that file)",
            trace.display(),
            trace.display()
        );
    }
    Ok(db)
}

/// The file name of the program a guest command runs, past `env` and its
/// settings.
pub fn command_program(command: &[String]) -> Option<String> {
    program_word(command).map(|w| file_name_of(&w))
}

/// The word naming the program a guest command runs (a name or a path),
/// past `env` and its settings.
fn program_word(command: &[String]) -> Option<String> {
    let mut words = command.iter().map(String::as_str).peekable();
    while let Some(&w) = words.peek() {
        if w == "env" || w.contains('=') || w.starts_with('-') {
            words.next();
        } else {
            break;
        }
    }
    words.next().map(str::to_owned)
}

fn file_name_of(word: &str) -> String {
    word.rsplit('/').next().unwrap_or(word).to_owned()
}

/// The program a shell's `-c` script starts with (`sh -c "VAR=1 exec
/// prog args"`), the process it runs in.
fn script_program(command: &[String]) -> Option<String> {
    script_program_word(command).map(|w| file_name_of(&w))
}

/// The word naming that program.
fn script_program_word(command: &[String]) -> Option<String> {
    let (shell, rest) = command.split_first()?;
    let shell = file_name_of(shell);
    let [flag, script, ..] = rest else {
        return None;
    };
    if flag != "-c" || !["sh", "bash", "dash", "ash"].contains(&shell.as_str()) {
        return None;
    }
    let words: Vec<String> = script
        .split([';', '&', '|', '\n'])
        .next()?
        .split_whitespace()
        .filter(|w| *w != "exec")
        .map(str::to_owned)
        .collect();
    program_word(&words)
}

/// The words of a file of the run's archive `/init` reads (the command,
/// its environment): NUL-separated.
fn archive_words(archive: &guestfiles::ArchiveFiles, file: &str) -> Vec<String> {
    archive
        .file(Path::new(file))
        .map(|bytes| {
            bytes
                .split(|&b| b == 0)
                .filter(|w| !w.is_empty())
                .map(|w| String::from_utf8_lossy(w).into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
}

/// The run's archive of a trace's header.
fn run_archive(header: &trace::Header) -> guestfiles::ArchiveFiles<'_> {
    let mut archive = guestfiles::ArchiveFiles::default();
    archive.add(&header.boot.archive);
    archive
}

/// The program of the command the trace in `dir` recorded
/// (`command_program`), as the run's archive (in its header) gave it to
/// the guest.
pub fn recorded_program(header: &trace::Header, dir: &Path) -> Result<String> {
    let command = archive_words(&run_archive(header), guest::spec::COMMAND_FILE);
    script_program(&command)
        .or_else(|| command_program(&command))
        .with_context(|| {
            format!(
                "{} does not say which program its command ran: name the process to trace with \
             --trace-process PID|NAME",
                dir.display()
            )
        })
}

/// The PATH insight-init gives the command, unless its environment sets
/// one.
const INIT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where the recorded command's program is among the guest's `files`, as
/// the guest found it: the path the command names (a relative one from
/// the command's working directory), or its name looked up in the
/// command's PATH (its environment's, else insight-init's). `None` where
/// no such file is there (a shell builtin, a program the command never
/// ran).
pub fn recorded_program_path(header: &trace::Header, files: &GuestFiles) -> Option<String> {
    let archive = run_archive(header);
    let command = archive_words(&archive, guest::spec::COMMAND_FILE);
    let word = script_program_word(&command).or_else(|| program_word(&command))?;
    if word.contains('/') {
        let workdir = archive
            .file(Path::new(guest::spec::WORKDIR_FILE))
            .map(|b| String::from_utf8_lossy(b).trim_end_matches('\n').to_owned())
            .unwrap_or_else(|| "/root".to_owned());
        let path = normalize(&workdir, &word);
        return files.get(&path).map(|_| path);
    }
    let env = archive_words(&archive, guest::spec::ENV_FILE);
    let path_var = env
        .iter()
        .rev()
        .find_map(|kv| kv.strip_prefix("PATH="))
        .unwrap_or(INIT_PATH);
    path_var
        .split(':')
        .filter(|d| d.starts_with('/'))
        .map(|dir| normalize(dir, &word))
        .find(|p| files.get(p).is_some())
}

/// `path` from the directory `dir` (unless it is absolute), with `.`,
/// `..` and repeated slashes resolved.
fn normalize(dir: &str, path: &str) -> String {
    let joined = match path.starts_with('/') {
        true => path.to_owned(),
        false => format!("{dir}/{path}"),
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

/// The guest's files as a trace's run had them (`header` read from
/// `dir`): its initramfs and the run's archive, and its kernel.
pub fn guest_files(header: &trace::Header, dir: &Path) -> Result<GuestFiles> {
    let spec = guest::from_trace(header, dir)
        .with_context(|| format!("cannot read the guest files of {}", dir.display()))?;
    let mut files =
        GuestFiles::from_initramfs(&guest::with_archive(&spec.initramfs, &spec.archive));
    files.set_kernel(spec.kernel_image);
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("insight-traces-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A directory that looks like a trace (its header has the magic).
    fn fake_trace(dir: &Path) {
        std::fs::write(dir.join("header"), trace::MAGIC).unwrap();
    }

    #[test]
    fn the_store_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |v: &str| pairs.iter().find(|p| p.0 == v).map(|p| p.1.to_owned())
        };
        assert_eq!(
            store_from(env(&[("INSIGHT_TRACE_DIR", "/t"), ("HOME", "/h")])).unwrap(),
            PathBuf::from("/t")
        );
        assert_eq!(
            store_from(env(&[("XDG_DATA_HOME", "/x"), ("HOME", "/h")])).unwrap(),
            PathBuf::from("/x/insight/traces")
        );
        assert_eq!(
            store_from(env(&[("HOME", "/h"), ("XDG_DATA_HOME", "")])).unwrap(),
            PathBuf::from("/h/.local/share/insight/traces")
        );
        assert!(store_from(env(&[])).is_err());
    }

    #[test]
    fn names_come_from_the_config_or_the_program() {
        let cmd = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(base_name(Some(Path::new("dir/vm.toml")), &[]), "vm");
        assert_eq!(
            base_name(None, &cmd(&["/usr/bin/syn_cont", "1000"])),
            "syn_cont"
        );
        assert_eq!(
            base_name(
                None,
                &cmd(&["env", "LD_PRELOAD=/x.so", "A=1", "sort", "-n"])
            ),
            "sort"
        );
        assert_eq!(base_name(None, &cmd(&["sh", "-c", "x"])), "sh");
        // The process a recorded command's program runs in.
        let script = |c: &[&str]| script_program(&cmd(c));
        assert_eq!(
            script(&["sh", "-c", "mem_access"]).as_deref(),
            Some("mem_access")
        );
        assert_eq!(
            script(&["/bin/sh", "-c", "A=1 exec ./bin/prog x; echo done"]).as_deref(),
            Some("prog")
        );
        assert_eq!(script(&["sh", "script.sh"]), None);
        assert_eq!(script(&["python3", "-c", "print(1)"]), None);
        assert_eq!(base_name(None, &cmd(&["a b/c d"])), "c_d");
        assert_eq!(base_name(None, &[]), "trace");
        assert_eq!(base_name(Some(Path::new("latest.toml")), &[]), "trace");
    }

    #[test]
    fn recordings_get_numbers_of_their_own_and_latest_follows() {
        let store = scratch("numbers");
        let a = new_trace(&store, "w").unwrap();
        let b = new_trace(&store, "w").unwrap();
        assert_eq!(a.file_name().unwrap(), "w-0");
        assert_eq!(b.file_name().unwrap(), "w-1");
        // Not a trace yet: not the latest.
        assert!(resolve_in(&store, None).is_err());
        // As record does once the header is written.
        set_latest(&store, &b).unwrap();
        assert_eq!(resolve_in(&store, None).unwrap(), b);
        assert_eq!(resolve_in(&store, Some(Path::new("w-0"))).unwrap(), a);
        assert!(resolve_in(&store, Some(Path::new("w-7"))).is_err());
        // Many at once: every one a directory of its own.
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let t = new_trace(&store, "c").unwrap();
                    set_latest(&store, &t).unwrap();
                    t
                })
            })
            .collect();
        let mut made: Vec<PathBuf> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        made.sort();
        made.dedup();
        assert_eq!(made.len(), 8);
        assert!(resolve_in(&store, None).unwrap().starts_with(&store));
        std::fs::remove_dir_all(&store).unwrap();
    }

    #[test]
    fn a_latest_that_is_gone_is_said_so() {
        let store = scratch("gone");
        assert!(format!("{:#}", resolve_in(&store, None).unwrap_err()).contains("no recording"));
        let a = new_trace(&store, "w").unwrap();
        set_latest(&store, &a).unwrap();
        std::fs::remove_dir_all(&a).unwrap();
        let e = format!("{:#}", resolve_in(&store, None).unwrap_err());
        assert!(e.contains("w-0") && e.contains("gone"), "{e}");
        std::fs::remove_dir_all(&store).unwrap();
    }

    #[test]
    fn a_trace_in_use_is_not_removed_and_its_user_is_named() {
        let store = scratch("held");
        let a = new_trace(&store, "w").unwrap();
        fake_trace(&a);
        let me = format!("pid {}", std::process::id());
        let replaying = hold(&a, TraceUse::Shared).unwrap().unwrap();
        // Another replay may share it; a recorder or rm may not.
        let also = hold(&a, TraceUse::Shared).unwrap();
        assert!(also.is_some());
        let e = format!("{:#}", hold(&a, TraceUse::Exclusive).unwrap_err());
        assert!(e.contains("is in use by") && e.contains(&me), "{e}");
        let e = format!("{:#}", remove(&store, &a).unwrap_err());
        assert!(e.starts_with("not removed: ") && e.contains(&me), "{e}");
        assert!(a.join("header").exists());
        drop((replaying, also));
        let recording = hold(&a, TraceUse::Exclusive).unwrap();
        let e = format!("{:#}", hold(&a, TraceUse::Shared).unwrap_err());
        assert!(e.contains(&me), "{e}");
        drop(recording);
        remove(&store, &a).unwrap();
        assert!(!a.exists());
        std::fs::remove_dir_all(&store).unwrap();
    }

    #[test]
    fn rm_removes_traces_only_and_moves_latest() {
        let store = scratch("rm");
        let a = new_trace(&store, "w").unwrap();
        let b = new_trace(&store, "w").unwrap();
        fake_trace(&a);
        fake_trace(&b);
        set_latest(&store, &b).unwrap();
        // Not a trace: an ordinary directory with files in it.
        let other = store.join("notes");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("header"), b"not a trace").unwrap();
        assert!(remove(&store, &other).is_err());
        assert!(other.join("header").exists());
        assert!(remove(&store, &store.join(LATEST)).is_err());
        assert_eq!(list(&store).unwrap(), [a.clone(), b.clone()]);
        remove(&store, &b).unwrap();
        assert!(!b.exists());
        assert_eq!(resolve_in(&store, None).unwrap(), a);
        remove(&store, &a).unwrap();
        assert!(std::fs::symlink_metadata(store.join(LATEST)).is_err());
        std::fs::remove_dir_all(&store).unwrap();
    }

    #[test]
    fn an_empty_directory_a_recorder_left_is_a_leftover_rm_removes() {
        let store = scratch("leftover");
        let a = new_trace(&store, "w").unwrap();
        fake_trace(&a);
        set_latest(&store, &a).unwrap();
        // Killed before its header: empty, and `latest` still names `a`.
        let b = new_trace(&store, "w").unwrap();
        assert_eq!(resolve_in(&store, None).unwrap(), a);
        assert_eq!(list(&store).unwrap(), std::slice::from_ref(&a));
        assert_eq!(leftovers(&store), std::slice::from_ref(&b));
        // While a recorder holds it, it is not one.
        let recording = hold(&b, TraceUse::Exclusive).unwrap();
        assert!(leftovers(&store).is_empty());
        assert!(remove(&store, &b).is_err());
        drop(recording);
        remove(&store, &b).unwrap();
        assert!(!b.exists());
        // An empty directory outside the store is not insight's.
        let elsewhere = scratch("leftover-elsewhere");
        assert!(remove(&store, &elsewhere).is_err());
        assert!(elsewhere.is_dir());
        assert_eq!(resolve_in(&store, None).unwrap(), a);
        std::fs::remove_dir_all(&store).unwrap();
        std::fs::remove_dir_all(&elsewhere).unwrap();
    }

    #[test]
    fn a_program_word_resolves_from_the_working_directory_or_the_path() {
        assert_eq!(normalize("/tmp/pr", "./calls"), "/tmp/pr/calls");
        assert_eq!(normalize("/tmp/pr/", "../x/./y"), "/tmp/x/y");
        assert_eq!(normalize("/root", "/usr//bin/sh"), "/usr/bin/sh");
        let words = |ws: &[&str]| ws.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        assert_eq!(
            program_word(&words(&["env", "A=1", "./prog", "x"])).as_deref(),
            Some("./prog")
        );
        assert_eq!(
            script_program_word(&words(&["/bin/sh", "-c", "X=1 exec ../bin/prog -v; true"]))
                .as_deref(),
            Some("../bin/prog")
        );
        assert_eq!(
            command_program(&words(&["/opt/app/prog"])).as_deref(),
            Some("prog")
        );
    }
}
