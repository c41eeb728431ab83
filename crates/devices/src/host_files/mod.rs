//! A read-only 9P2000.L server of the host's files: the directories a run
//! exports (`/usr`, `/etc`, the working directory…) at their host paths,
//! and their ancestors showing only the way to them.
//!
//! A regular file is read whole when the guest opens it and served from
//! that copy (an x86-64 ELF file with its RDTSC instructions made NOPs, as
//! the image's are: `no_rdtsc`), named by its SHA-256 digest ([`FileContent`]): what the
//! guest reads of it is one version of the file, and a recording stores
//! those bytes once, by digest, instead of each read. Everything that
//! would change a file is refused (`EROFS`); a file that is not regular or
//! a directory (a FIFO, a device) is never opened on the host.
//!
//! The server follows no symbolic link itself: the guest reads the link
//! and resolves it in its own tree, which has the host's layout. A name
//! with a `/`, `.` or an empty one is refused, `..` at the root stays
//! there, and a path outside the exports is not found.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::p9::{self, Qid, Reader, Short, Writer};

/// Largest message either side may send (the driver asks for less).
pub const MAX_MSIZE: u32 = 512 * 1024;
/// Largest file the server copies when it is opened.
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// Most fids the guest may hold at once (bounds the server's memory).
const MAX_FIDS: usize = 1 << 16;

const ENOENT: i32 = 2;
const EIO: i32 = 5;
const EBADF: i32 = 9;
const EACCES: i32 = 13;
const EEXIST: i32 = 17;
const ENOTDIR: i32 = 20;
const EINVAL: i32 = 22;
const EFBIG: i32 = 27;
const EROFS: i32 = 30;
const EMFILE: i32 = 24;
const EPROTO: i32 = 71;
const EOPNOTSUPP: i32 = 95;

/// The bytes of a regular file as the guest opened it, and their digest.
#[derive(Debug, PartialEq, Eq)]
pub struct FileContent {
    pub digest: [u8; 32],
    pub bytes: Vec<u8>,
}

impl FileContent {
    pub fn new(bytes: Vec<u8>) -> Self {
        FileContent {
            digest: Sha256::digest(&bytes).into(),
            bytes,
        }
    }
}

/// The server's answer to one request.
#[derive(Debug)]
pub enum Answer {
    /// A whole reply message.
    Message(Vec<u8>),
    /// An `Rread`: `count` bytes of `content` from `offset`, after
    /// [`p9::read_header`].
    Read {
        tag: u16,
        content: Arc<FileContent>,
        offset: u64,
        count: u32,
    },
}

impl Answer {
    /// The reply's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            Answer::Message(m) => m.clone(),
            Answer::Read {
                tag,
                content,
                offset,
                count,
            } => {
                let mut out = p9::read_header(*tag, *count).to_vec();
                let start = *offset as usize;
                out.extend_from_slice(&content.bytes[start..start + *count as usize]);
                out
            }
        }
    }
}

/// What an exported path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Visibility {
    /// In an exported tree.
    Exported,
    /// On the way to one: only the names leading there are listed.
    Ancestor,
    Hidden,
}

struct Fid {
    path: PathBuf,
    open: Option<Opened>,
}

enum Opened {
    File(Arc<FileContent>),
    /// A directory, its listing read at the first `Treaddir`.
    Dir(Option<Vec<DirEntry>>),
}

struct DirEntry {
    qid: Qid,
    kind: u8,
    name: Vec<u8>,
}

/// Identity of a file's version, to read a file opened again only once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Version {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

pub struct HostFiles {
    exports: Vec<PathBuf>,
    msize: u32,
    fids: HashMap<u32, Fid>,
    contents: HashMap<Version, Arc<FileContent>>,
}

type Reply = Result<Vec<u8>, i32>;

impl HostFiles {
    /// A server of `exports` (absolute paths; others are dropped, and
    /// `..` and `.` in them resolved lexically).
    pub fn new(exports: &[PathBuf]) -> Self {
        let mut clean: Vec<PathBuf> = exports
            .iter()
            .filter(|p| p.is_absolute())
            .map(|p| normalize(p))
            .collect();
        clean.sort();
        clean.dedup();
        HostFiles {
            exports: clean,
            msize: 8192,
            fids: HashMap::new(),
            contents: HashMap::new(),
        }
    }

    /// Answers `request`, whose reply may take `room` bytes.
    pub fn answer(&mut self, request: &[u8], room: u32) -> Answer {
        let Some((kind, tag)) = p9::header(request) else {
            return Answer::Message(p9::error(u16::MAX, EPROTO));
        };
        let mut r = Reader::body(request);
        let reply = match kind {
            p9::TREAD => match self.read(&mut r, tag, room) {
                Ok(answer) => return answer,
                Err(e) => Err(e),
            },
            _ => self.message(kind, tag, &mut r),
        };
        Answer::Message(match reply {
            Ok(m) if m.len() <= room as usize => m,
            Ok(_) => p9::error(tag, EPROTO),
            Err(errno) => p9::error(tag, errno),
        })
    }

    fn message(&mut self, kind: u8, tag: u16, r: &mut Reader<'_>) -> Reply {
        let short = |_: Short| EPROTO;
        match kind {
            p9::TVERSION => {
                let msize = r.u32().map_err(short)?;
                let version = r.string().map_err(short)?;
                self.fids.clear();
                self.msize = msize.clamp(4096, MAX_MSIZE);
                let ours: &[u8] = if version.starts_with(b"9P2000.L") {
                    b"9P2000.L"
                } else {
                    b"unknown"
                };
                let mut w = Writer::new(p9::RVERSION, tag);
                w.u32(self.msize).string(ours);
                Ok(w.finish())
            }
            p9::TATTACH => {
                let fid = r.u32().map_err(short)?;
                let root = PathBuf::from("/");
                let qid = qid(&lstat(&root)?);
                self.insert(fid, root)?;
                let mut w = Writer::new(p9::RATTACH, tag);
                w.qid(qid);
                Ok(w.finish())
            }
            p9::TWALK => self.walk(tag, r),
            p9::TGETATTR => {
                let fid = r.u32().map_err(short)?;
                let meta = lstat(&self.fid(fid)?.path)?;
                Ok(getattr(tag, &meta))
            }
            p9::TLOPEN => self.lopen(tag, r),
            p9::TREADDIR => self.readdir(tag, r),
            p9::TREADLINK => {
                let fid = r.u32().map_err(short)?;
                let target = std::fs::read_link(&self.fid(fid)?.path).map_err(errno)?;
                let mut w = Writer::new(p9::RREADLINK, tag);
                w.string(target.as_os_str().as_bytes());
                Ok(w.finish())
            }
            p9::TCLUNK => {
                let fid = r.u32().map_err(short)?;
                self.fids.remove(&fid).ok_or(EBADF)?;
                Ok(Writer::new(p9::RCLUNK, tag).finish())
            }
            p9::TSTATFS => {
                let fid = r.u32().map_err(short)?;
                self.fid(fid)?;
                let mut w = Writer::new(p9::RSTATFS, tag);
                // V9FS_MAGIC; sizes the guest has no use for.
                w.u32(0x0102_1997).u32(4096).u64(0).u64(0).u64(0);
                w.u64(0).u64(0).u64(0).u32(255);
                Ok(w.finish())
            }
            p9::TFLUSH => Ok(Writer::new(p9::RFLUSH, tag).finish()),
            p9::TFSYNC => Ok(Writer::new(p9::RFSYNC, tag).finish()),
            // Locks of files nobody else writes: granted.
            p9::TLOCK => {
                let mut w = Writer::new(p9::RLOCK, tag);
                w.u8(0);
                Ok(w.finish())
            }
            p9::TXATTRWALK => Err(EOPNOTSUPP),
            k if p9::is_write(k) => Err(EROFS),
            _ => Err(EOPNOTSUPP),
        }
    }

    fn fid(&self, fid: u32) -> Result<&Fid, i32> {
        self.fids.get(&fid).ok_or(EBADF)
    }

    fn insert(&mut self, fid: u32, path: PathBuf) -> Result<(), i32> {
        if self.fids.contains_key(&fid) {
            return Err(EEXIST);
        }
        if self.fids.len() >= MAX_FIDS {
            return Err(EMFILE);
        }
        self.fids.insert(fid, Fid { path, open: None });
        Ok(())
    }

    fn walk(&mut self, tag: u16, r: &mut Reader<'_>) -> Reply {
        let short = |_: Short| EPROTO;
        let fid = r.u32().map_err(short)?;
        let newfid = r.u32().map_err(short)?;
        let count = r.u16().map_err(short)?;
        if count > 16 {
            return Err(EINVAL);
        }
        let start = self.fid(fid)?;
        if start.open.is_some() {
            return Err(EBADF);
        }
        let mut path = start.path.clone();
        let mut qids = Vec::new();
        for i in 0..count {
            let name = r.string().map_err(short)?;
            let step = match name {
                b".." => Ok(path.parent().unwrap_or(Path::new("/")).to_owned()),
                b"" | b"." => Err(EINVAL),
                n if n.contains(&b'/') || n.contains(&0) => Err(EINVAL),
                n => match lstat(&path) {
                    Ok(m) if m.is_dir() => Ok(path.join(OsStr::from_bytes(n))),
                    Ok(_) => Err(ENOTDIR),
                    Err(e) => Err(e),
                },
            };
            let found = step.and_then(|p| {
                if self.visibility(&p) == Visibility::Hidden {
                    return Err(ENOENT);
                }
                lstat(&p).map(|m| (p, m))
            });
            match found {
                Ok((p, m)) => {
                    qids.push(qid(&m));
                    path = p;
                }
                // The first name not found is an error; a later one ends
                // the walk there, newfid untouched.
                Err(e) if i == 0 => return Err(e),
                Err(_) => break,
            }
        }
        if qids.len() == usize::from(count) {
            if newfid == fid {
                if let Some(f) = self.fids.get_mut(&fid) {
                    f.path = path;
                }
            } else {
                self.insert(newfid, path)?;
            }
        }
        let mut w = Writer::new(p9::RWALK, tag);
        w.u16(qids.len() as u16);
        for q in qids {
            w.qid(q);
        }
        Ok(w.finish())
    }

    fn lopen(&mut self, tag: u16, r: &mut Reader<'_>) -> Reply {
        let short = |_: Short| EPROTO;
        let fid = r.u32().map_err(short)?;
        let flags = r.u32().map_err(short)?;
        // O_WRONLY, O_RDWR, O_CREAT, O_TRUNC, O_APPEND.
        if flags & 0o3 != 0 || flags & (0o100 | 0o1000 | 0o2000) != 0 {
            return Err(EROFS);
        }
        let f = self.fid(fid)?;
        if f.open.is_some() {
            return Err(EBADF);
        }
        let meta = lstat(&f.path)?;
        let path = f.path.clone();
        let opened = if meta.is_dir() {
            Opened::Dir(None)
        } else if meta.file_type().is_file() {
            Opened::File(self.content(&path, &meta)?)
        } else {
            // A FIFO or a device would block or reach host hardware.
            return Err(EACCES);
        };
        if let Some(f) = self.fids.get_mut(&fid) {
            f.open = Some(opened);
        }
        let mut w = Writer::new(p9::RLOPEN, tag);
        w.qid(qid(&meta)).u32(0);
        Ok(w.finish())
    }

    /// The file at `path` as it is now, read once per version.
    fn content(&mut self, path: &Path, meta: &std::fs::Metadata) -> Result<Arc<FileContent>, i32> {
        let version = Version {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        };
        if let Some(c) = self.contents.get(&version) {
            return Ok(c.clone());
        }
        if meta.size() > MAX_FILE_BYTES {
            return Err(EFBIG);
        }
        // O_NOFOLLOW | O_NONBLOCK: a file swapped for a link or a FIFO
        // since it was looked at is not followed or waited on.
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(errno)?;
        if !file.metadata().map_err(errno)?.file_type().is_file() {
            return Err(EACCES);
        }
        let mut bytes = Vec::with_capacity(meta.size() as usize);
        file.take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(errno)?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(EFBIG);
        }
        // Programs as the image carries its own: no RDTSC.
        crate::no_rdtsc::patch(&mut bytes);
        let content = Arc::new(FileContent::new(bytes));
        self.contents.insert(version, content.clone());
        Ok(content)
    }

    fn read(&mut self, r: &mut Reader<'_>, tag: u16, room: u32) -> Result<Answer, i32> {
        let short = |_: Short| EPROTO;
        let fid = r.u32().map_err(short)?;
        let offset = r.u64().map_err(short)?;
        let count = r.u32().map_err(short)?;
        let Some(Opened::File(content)) = &self.fid(fid)?.open else {
            return Err(EBADF);
        };
        let len = content.bytes.len() as u64;
        let room = room
            .min(self.msize)
            .saturating_sub(p9::READ_HEADER_BYTES as u32);
        let count = if offset >= len {
            0
        } else {
            (len - offset).min(u64::from(count.min(room))) as u32
        };
        Ok(Answer::Read {
            tag,
            content: content.clone(),
            offset: offset.min(len),
            count,
        })
    }

    fn readdir(&mut self, tag: u16, r: &mut Reader<'_>) -> Reply {
        let short = |_: Short| EPROTO;
        let fid = r.u32().map_err(short)?;
        let offset = r.u64().map_err(short)?;
        let count = r.u32().map_err(short)?;
        let f = self.fid(fid)?;
        let path = f.path.clone();
        if !matches!(f.open, Some(Opened::Dir(_))) {
            return Err(EBADF);
        }
        if matches!(f.open, Some(Opened::Dir(None))) {
            let listing = self.listing(&path)?;
            if let Some(f) = self.fids.get_mut(&fid) {
                f.open = Some(Opened::Dir(Some(listing)));
            }
        }
        let Some(Fid {
            open: Some(Opened::Dir(Some(entries))),
            ..
        }) = self.fids.get(&fid)
        else {
            return Err(EIO);
        };
        let limit = count.min(self.msize).saturating_sub(11) as usize;
        let mut data = Writer::new(0, 0);
        let header = data.len();
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        for (i, e) in entries.iter().enumerate().skip(start) {
            let size = 13 + 8 + 1 + 2 + e.name.len();
            if data.len() - header + size > limit {
                break;
            }
            data.qid(e.qid).u64(i as u64 + 1).u8(e.kind).string(&e.name);
        }
        let data = &data.finish()[header..];
        let mut w = Writer::new(p9::RREADDIR, tag);
        w.u32(data.len() as u32).bytes(data);
        Ok(w.finish())
    }

    /// A directory's entries as the guest sees them: `.`, `..`, then the
    /// visible names in byte order.
    fn listing(&self, path: &Path) -> Result<Vec<DirEntry>, i32> {
        let mut names: Vec<Vec<u8>> = Vec::new();
        for entry in std::fs::read_dir(path).map_err(errno)? {
            let entry = entry.map_err(errno)?;
            let name = entry.file_name();
            if self.visibility(&path.join(&name)) != Visibility::Hidden {
                names.push(name.as_bytes().to_vec());
            }
        }
        names.sort();
        let mut entries = Vec::with_capacity(names.len() + 2);
        for (name, at) in [
            (&b"."[..], path.to_owned()),
            (b"..", path.parent().unwrap_or(Path::new("/")).to_owned()),
        ] {
            let meta = lstat(&at)?;
            entries.push(DirEntry {
                qid: qid(&meta),
                kind: dirent_type(&meta),
                name: name.to_vec(),
            });
        }
        for name in names {
            // A file gone since the listing was read is left out.
            if let Ok(meta) = lstat(&path.join(OsStr::from_bytes(&name))) {
                entries.push(DirEntry {
                    qid: qid(&meta),
                    kind: dirent_type(&meta),
                    name,
                });
            }
        }
        Ok(entries)
    }

    fn visibility(&self, path: &Path) -> Visibility {
        if self.exports.iter().any(|e| path.starts_with(e)) {
            Visibility::Exported
        } else if self.exports.iter().any(|e| e.starts_with(path)) {
            Visibility::Ancestor
        } else {
            Visibility::Hidden
        }
    }
}

/// `path` with `.` dropped and `..` taken back, without touching the
/// file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

fn errno(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(EIO)
}

fn lstat(path: &Path) -> Result<std::fs::Metadata, i32> {
    std::fs::symlink_metadata(path).map_err(errno)
}

fn qid(meta: &std::fs::Metadata) -> Qid {
    let kind = if meta.is_dir() {
        p9::QTDIR
    } else if meta.file_type().is_symlink() {
        p9::QTSYMLINK
    } else {
        p9::QTFILE
    };
    // Files of several host file systems in one tree: the device in the
    // high bits keeps their numbers apart.
    Qid {
        kind,
        version: 0,
        path: meta.ino() ^ meta.dev().rotate_left(48),
    }
}

/// The `d_type` of a directory entry.
fn dirent_type(meta: &std::fs::Metadata) -> u8 {
    let t = meta.file_type();
    if t.is_dir() {
        4
    } else if t.is_symlink() {
        10
    } else if t.is_file() {
        8
    } else if t.is_char_device() {
        2
    } else if t.is_block_device() {
        6
    } else if t.is_fifo() {
        1
    } else if t.is_socket() {
        12
    } else {
        0
    }
}

fn getattr(tag: u16, m: &std::fs::Metadata) -> Vec<u8> {
    // P9_GETATTR_BASIC: everything but btime, gen and data version.
    const BASIC: u64 = 0x7ff;
    let mut w = Writer::new(p9::RGETATTR, tag);
    w.u64(BASIC).qid(qid(m));
    w.u32(m.mode()).u32(m.uid()).u32(m.gid()).u64(m.nlink());
    w.u64(m.rdev())
        .u64(m.size())
        .u64(m.blksize())
        .u64(m.blocks());
    for (s, ns) in [
        (m.atime(), m.atime_nsec()),
        (m.mtime(), m.mtime_nsec()),
        (m.ctime(), m.ctime_nsec()),
        (0, 0),
    ] {
        w.u64(s as u64).u64(ns as u64);
    }
    w.u64(0).u64(0);
    w.finish()
}

#[cfg(test)]
mod tests;
