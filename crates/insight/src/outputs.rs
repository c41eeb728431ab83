//! What insight may write over. An output path that exists is replaced
//! only if it is a regular file of the kind insight writes there (an
//! insight event database, a pcap capture, an insight HTML report, flame
//! graph or folded stacks), or an empty file; another regular file only
//! with `--force`; a device, FIFO, socket, directory or symbolic link
//! never, and never a file inside a trace directory other than the event
//! database `replay --diagnose` keeps there.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use events::db::{EventFormat, EventWriter};

use crate::traces;

/// A kind of file insight writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    EventDb,
    Pcap,
    Html,
    Svg,
    HeatMap,
    Folded,
    Timeline,
    InstructionTrace,
    MemoryTrace,
}

/// Bytes of an existing file looked at to recognize it.
const HEAD_BYTES: u64 = 4096;

impl OutputKind {
    fn name(self) -> &'static str {
        match self {
            OutputKind::EventDb => "an insight event database",
            OutputKind::Pcap => "a pcap capture",
            OutputKind::Html => "an insight HTML report",
            OutputKind::Svg => "an insight flame graph",
            OutputKind::HeatMap => "an insight memory heat map",
            OutputKind::Folded => "a file of folded stacks",
            OutputKind::Timeline => "an insight timeline",
            OutputKind::InstructionTrace => "an insight instruction trace",
            OutputKind::MemoryTrace => "an insight memory-access trace",
        }
    }

    /// Whether a file starting with `head` is of this kind.
    fn recognizes(self, head: &[u8]) -> bool {
        let text = || String::from_utf8_lossy(head);
        match self {
            OutputKind::EventDb => {
                head.starts_with(b"SQLite format 3\0")
                    && head.get(68..72)
                        == Some(&(events::db::APPLICATION_ID as u32).to_be_bytes()[..])
            }
            OutputKind::Pcap => {
                const MAGICS: [u32; 2] = [0xa1b2_c3d4, 0xa1b2_3c4d];
                head.get(..4)
                    .map(|m| u32::from_le_bytes(m.try_into().expect("4 bytes")))
                    .is_some_and(|m| MAGICS.contains(&m) || MAGICS.contains(&m.swap_bytes()))
            }
            OutputKind::Html => {
                text().starts_with("<!DOCTYPE html>") && text().contains("<title>insight:")
            }
            OutputKind::Svg => {
                text().starts_with("<?xml") && text().contains(diagnosis::FLAME_GRAPH_MARK)
            }
            OutputKind::HeatMap => {
                text().starts_with("<?xml") && text().contains(diagnosis::HEAT_MAP_MARK)
            }
            OutputKind::Timeline => head.starts_with(diagnosis::TIMELINE_MARK.as_bytes()),
            // A zstd frame.
            OutputKind::InstructionTrace => head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]),
            OutputKind::MemoryTrace => lines_of(head).is_some_and(|lines| {
                lines.iter().all(|l| {
                    let f: Vec<&str> = l.split(' ').collect();
                    // Five fields before the exit ordinal was added.
                    (f.len() == 5 || f.len() == 6)
                        && matches!(f[0], "L" | "S" | "M")
                        && f[1].starts_with("0x")
                        && f[4].starts_with("0x")
                })
            }),
            // Lines of "frame;frame;... COUNT".
            OutputKind::Folded => lines_of(head).is_some_and(|lines| {
                lines.iter().all(|l| {
                    l.rsplit_once(' ').is_some_and(|(_, n)| {
                        !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
                    })
                })
            }),
        }
    }
}

/// The whole lines of a file's `head` (which may end inside a character
/// and a line); `None` if it is not text or has none.
fn lines_of(head: &[u8]) -> Option<Vec<&str>> {
    let cut = head.len() as u64 == HEAD_BYTES;
    let text = match std::str::from_utf8(head) {
        Ok(t) => t,
        Err(e) if cut => std::str::from_utf8(&head[..e.valid_up_to()]).unwrap_or(""),
        Err(_) => return None,
    };
    let mut lines: Vec<&str> = text.lines().collect();
    if cut && !text.ends_with('\n') {
        lines.pop();
    }
    (!lines.is_empty()).then_some(lines)
}

/// Checks that `path` may be written as `kind` (see the module's rules);
/// `force` allows replacing a regular file of another kind.
pub fn check(path: &Path, kind: OutputKind, force: bool) -> Result<()> {
    not_in_a_trace(path, kind)?;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot look at {}", path.display())),
    };
    let file_type = meta.file_type();
    if file_type.is_symlink() {
        bail!(
            "{} is a symbolic link: insight does not replace links; name the file itself or a \
             new one",
            path.display()
        );
    }
    if !file_type.is_file() {
        bail!(
            "{} is {}: insight writes only regular files, and never replaces anything else",
            path.display(),
            trace::files::kind_of(file_type)
        );
    }
    if meta.len() == 0 || force {
        return Ok(());
    }
    let mut head = Vec::new();
    trace::files::open_regular(path)?
        .take(HEAD_BYTES)
        .read_to_end(&mut head)
        .with_context(|| format!("cannot read {}", path.display()))?;
    if kind.recognizes(&head) {
        return Ok(());
    }
    bail!(
        "{} exists and is not {}: name a new file, or add --force to replace it",
        path.display(),
        kind.name()
    )
}

/// Checks an event database's path and where it is written until it is
/// finished.
pub fn check_event_db(path: &Path, force: bool) -> Result<()> {
    check(path, OutputKind::EventDb, force)?;
    check(&partial_path(path), OutputKind::EventDb, force)
}

fn partial_path(path: &Path) -> PathBuf {
    EventWriter::partial_path(path)
}

/// Creates the event database `path` (written as this process's partial
/// file until finished), first removing the partial files of `path` that
/// no writer holds any more (left by commands that ended before
/// finishing), each named on standard error.
pub fn create_event_db(
    path: &Path,
    meta: &[(&str, String)],
    format: EventFormat,
) -> Result<EventWriter> {
    for (stale, pid) in EventWriter::stale_partials(path) {
        // A writer killed inside a transaction also leaves SQLite's
        // journal of the partial file: of no use without it.
        for side in sqlite_sidecars(&stale) {
            if side.symlink_metadata().is_ok_and(|m| m.is_file()) {
                let _ = std::fs::remove_file(&side);
            }
        }
        match std::fs::remove_file(&stale) {
            Ok(()) => eprintln!(
                "insight: removed {}, left unfinished by a command (pid {pid}) that is gone",
                stale.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => eprintln!(
                "insight: cannot remove {}, left unfinished by pid {pid}: {e}",
                stale.display()
            ),
        }
    }
    EventWriter::create_with(path, meta, format)
        .with_context(|| format!("cannot create the event database {}", path.display()))
}

/// The files SQLite keeps beside the database `db` while it writes it:
/// its rollback journal, or its write-ahead log and that log's index.
fn sqlite_sidecars(db: &Path) -> [PathBuf; 3] {
    ["-journal", "-wal", "-shm"].map(|suffix| {
        let mut side = db.as_os_str().to_owned();
        side.push(suffix);
        PathBuf::from(side)
    })
}

/// Refuses a path inside a trace directory, except its event database.
fn not_in_a_trace(path: &Path, kind: OutputKind) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !trace::is_trace(dir) {
        return Ok(());
    }
    let name = path.file_name().unwrap_or_default();
    let db = Path::new(traces::EVENTS_DB);
    if kind == OutputKind::EventDb && (name == db || name == partial_path(db)) {
        return Ok(());
    }
    // What `replay --diagnose` writes beside the trace's event database.
    let beside = |format| traces::beside_events(db, "timeline", format).into_os_string();
    if (kind == OutputKind::Timeline && name == beside("json"))
        || (kind == OutputKind::Html && name == beside("html"))
    {
        return Ok(());
    }
    bail!(
        "{} is inside the trace {}: insight writes nothing there but its event database \
         ({}) and what `replay --diagnose` writes beside it; name a path outside the trace",
        path.display(),
        dir.display(),
        traces::EVENTS_DB
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("insight-outputs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_gone_writers_partial_database_goes_with_its_journal() {
        let dir = temp_dir("stale");
        let db = dir.join("e.db");
        // A writer that was killed inside a transaction: nobody holds its
        // partial file, and SQLite's journal of it is beside it.
        let partial = dir.join("e.db.partial.4000000");
        let journal = dir.join("e.db.partial.4000000-journal");
        std::fs::write(&partial, b"SQLite format 3\0").unwrap();
        std::fs::write(&journal, b"journal").unwrap();
        // Not a partial of e.db: kept.
        let other = dir.join("f.db.partial.4000000-journal");
        std::fs::write(&other, b"journal").unwrap();
        let writer = create_event_db(&db, &[], EventFormat::Packed).unwrap();
        assert!(!partial.exists() && !journal.exists());
        assert!(other.exists());
        drop(writer);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_files_insight_wrote_are_replaced_without_force() {
        let dir = temp_dir("kinds");
        let new = dir.join("new");
        assert!(check(&new, OutputKind::Pcap, false).is_ok());
        let mine = dir.join("mine.pcap");
        let mut pcap = crate::pcap::PcapWriter::create(&mine).unwrap();
        pcap.flush().unwrap();
        drop(pcap);
        assert!(check(&mine, OutputKind::Pcap, false).is_ok());
        let err = check(&mine, OutputKind::EventDb, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("is not an insight event database"), "{err}");
        assert!(check(&mine, OutputKind::EventDb, true).is_ok());
        let notes = dir.join("notes.txt");
        std::fs::write(&notes, "my notes\n").unwrap();
        for kind in [
            OutputKind::Html,
            OutputKind::Svg,
            OutputKind::HeatMap,
            OutputKind::Folded,
            OutputKind::Pcap,
            OutputKind::Timeline,
        ] {
            let err = check(&notes, kind, false).unwrap_err().to_string();
            assert!(err.contains("add --force"), "{kind:?}: {err}");
        }
        std::fs::write(&notes, "main;work 12\nmain;idle 3\n").unwrap();
        assert!(check(&notes, OutputKind::Folded, false).is_ok());
        // Memory traces with the exit ordinal, and from before it.
        std::fs::write(
            &notes,
            "S 0x404040 4 19 0x401136 812\nL 0x404040 4 19 0x40113a 812\n",
        )
        .unwrap();
        assert!(check(&notes, OutputKind::MemoryTrace, false).is_ok());
        std::fs::write(&notes, "S 0x404040 4 19 0x401136\n").unwrap();
        assert!(check(&notes, OutputKind::MemoryTrace, false).is_ok());
        std::fs::write(&notes, "S 0x404040 4 19 0x401136 812 x\n").unwrap();
        assert!(check(&notes, OutputKind::MemoryTrace, false).is_err());
        std::fs::write(&notes, "{\"traceEvents\":[]}").unwrap();
        assert!(check(&notes, OutputKind::Timeline, false).is_err());
        std::fs::write(
            &notes,
            format!("{},\"database\":\"x\"}}", diagnosis::TIMELINE_MARK),
        )
        .unwrap();
        assert!(check(&notes, OutputKind::Timeline, false).is_ok());
        let empty = dir.join("empty");
        std::fs::write(&empty, "").unwrap();
        assert!(check(&empty, OutputKind::Html, false).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn devices_links_and_directories_are_never_replaced() {
        let dir = temp_dir("special");
        let link = dir.join("link");
        std::os::unix::fs::symlink(dir.join("target"), &link).unwrap();
        let err = check(&link, OutputKind::Pcap, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("symbolic link"), "{err}");
        let err = check(&dir, OutputKind::EventDb, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("is a directory"), "{err}");
        // As root, a scratch character device (the null device's numbers).
        let node = dir.join("null");
        let made = std::process::Command::new("mknod")
            .arg(&node)
            .args(["c", "1", "3"])
            .status()
            .is_ok_and(|s| s.success());
        if made {
            let err = check(&node, OutputKind::EventDb, true)
                .unwrap_err()
                .to_string();
            assert!(err.contains("is a character device"), "{err}");
        } else {
            eprintln!("not root: the character-device case is left to the end-to-end tests");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_traces_own_files_are_never_replaced() {
        let dir = temp_dir("trace");
        std::fs::write(dir.join("header"), b"INSIGHT\0\x06\0\0\0").unwrap();
        assert!(trace::is_trace(&dir));
        for name in ["events", "header", "notes.html"] {
            let err = check(&dir.join(name), OutputKind::Html, true)
                .unwrap_err()
                .to_string();
            assert!(err.contains("is inside the trace"), "{name}: {err}");
        }
        assert!(check_event_db(&dir.join(traces::EVENTS_DB), false).is_ok());
        assert!(check(&dir.join("events"), OutputKind::EventDb, true).is_err());
        // What `replay --diagnose timeline` writes beside the database,
        // and only that, as only that kind.
        let beside =
            |format| traces::beside_events(&dir.join(traces::EVENTS_DB), "timeline", format);
        assert!(check(&beside("json"), OutputKind::Timeline, false).is_ok());
        assert!(check(&beside("html"), OutputKind::Html, false).is_ok());
        assert!(check(&beside("json"), OutputKind::Html, true).is_err());
        assert!(check(&beside("svg"), OutputKind::Svg, true).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
