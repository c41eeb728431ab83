//! The insight trace: a directory holding what a recording logged.
//!
//! ```text
//! TRACE/
//!   header     magic "INSIGHT\0", u32 LE format version, bincode(Header)
//!   events     frames: u32 LE compressed length, u32 LE event count,
//!              zstd (with checksum) of bincode(Vec<event>)
//!   payloads   raw bytes of large payloads (packets, DMA data), referenced
//!              from events by PayloadRef { offset, len }
//!   complete   bincode(Summary), written last: its absence means the
//!              recording did not end cleanly
//! ```
//!
//! Frames are appended as they fill (and on `flush`), payloads before the
//! frames that reference them, so a crashed recorder leaves a readable
//! prefix. The reader validates everything it reads: a torn or corrupt
//! tail ends the stream and is reported, never trusted. The format is
//! documented in docs/trace-format.md; its version is [`TRACE_VERSION`].

use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Format version, bumped on every change of the layout or of the types
/// serialized in it.
pub const TRACE_VERSION: u32 = 5;
pub const MAGIC: [u8; 8] = *b"INSIGHT\0";

const HEADER_FILE: &str = "header";
const EVENTS_FILE: &str = "events";
const PAYLOADS_FILE: &str = "payloads";
const COMPLETE_FILE: &str = "complete";

/// Events per frame before the writer compresses and appends it.
pub const FRAME_EVENTS: usize = 4096;
/// Largest frame accepted, compressed or not (a bound on allocations for
/// untrusted files).
pub const MAX_FRAME_BYTES: usize = 64 << 20;
const ZSTD_LEVEL: i32 = 3;

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} already exists and is not empty; choose a new trace directory")]
    NotEmpty(PathBuf),
    #[error("{0} is not an insight trace (bad magic)")]
    BadMagic(PathBuf),
    #[error("{path} has trace format version {found}; this insight reads version {TRACE_VERSION} (use the insight that recorded it)")]
    UnsupportedVersion { path: PathBuf, found: u32 },
    #[error("{path}: malformed {what}: {message}")]
    Malformed {
        path: PathBuf,
        what: &'static str,
        message: String,
    },
    #[error("cannot encode {what}: {message}")]
    Encode { what: &'static str, message: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TraceError + '_ {
    move |source| TraceError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Which timestamps the events carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClockKind {
    /// Ordinals of deterministic VM exits (+ RIP and register digests).
    Exit,
    /// Guest retired conditional branches counted by the PMU.
    Branch,
}

/// A file the recording depended on, by content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageDigest {
    pub role: String,
    pub path: String,
    pub digest: String,
}

/// What a replay must match to be faithful.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub clock: ClockKind,
    pub created_unix_secs: u64,
    /// CPUID entries given to the guest: (function, index, eax, ebx, ecx, edx).
    pub guest_cpuid: Vec<(u32, u32, u32, u32, u32, u32)>,
    /// KVM capabilities that matter to the recording: (capability, value).
    pub kvm_caps: Vec<(u32, i32)>,
    /// Whether user-mode RDTSC faulted on the recording host (it honours
    /// CR4.TSD), so that the guest kernel answered it from the logged
    /// clock. A replay must see the same: the emulation reads the clock.
    pub user_rdtsc_traps: bool,
    /// The initial APIC ID of the host CPU the recording kept its vCPU on
    /// (`vmm::host_cpu`): where the host does not trap user-mode CPUID a
    /// program reads it, so a replay runs on a CPU with the same ID.
    pub host_apic_id: Option<u8>,
    /// The VM configuration the recording was made from, for people: the
    /// config file's text, or a description of the built-in guest.
    pub config: String,
    /// Files the initial state is made of (kernel, base initramfs), with
    /// their SHA-256: replay refuses files whose content differs.
    pub images: Vec<ImageDigest>,
    /// Everything else the initial state is made of.
    pub boot: BootParams,
    /// A register digest is logged at every deterministic exit whose
    /// ordinal is a multiple of this.
    pub digest_interval: u64,
}

/// The guest's initial state besides the image files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootParams {
    /// Kernel command line.
    pub cmdline: String,
    pub memory_mib: u64,
    /// Seed handed to the guest kernel's random number generator.
    pub rng_seed: Vec<u8>,
    /// The archive appended to the base initramfs (command, environment,
    /// the user's files).
    pub extra_initramfs: Vec<u8>,
    /// The virtio network device, if the guest had one.
    pub net: Option<NetParams>,
}

/// The guest's network device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetParams {
    pub mac: [u8; 6],
}

/// A large payload in the payload stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayloadRef {
    pub offset: u64,
    pub len: u32,
}

/// Written when a recording ends cleanly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub events: u64,
    pub frames: u64,
    /// Size of the compressed event stream, frame headers included.
    pub event_bytes: u64,
    pub payload_bytes: u64,
    /// Guest time the recording covers (the guest clock's last value),
    /// in nanoseconds, as the recorder says with `set_guest_ns`.
    pub guest_ns: u64,
}

/// Appends to a new trace.
pub struct TraceWriter<E> {
    dir: PathBuf,
    events: BufWriter<File>,
    payloads: BufWriter<File>,
    pending: Vec<E>,
    summary: Summary,
    compressor: zstd::bulk::Compressor<'static>,
}

impl<E: Serialize> TraceWriter<E> {
    /// Creates the trace directory (which must be new or empty) and writes
    /// the header.
    pub fn create(dir: &Path, header: &Header) -> Result<Self, TraceError> {
        match std::fs::read_dir(dir) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    return Err(TraceError::NotEmpty(dir.to_owned()));
                }
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                std::fs::create_dir_all(dir).map_err(io_err(dir))?
            }
            Err(e) => return Err(io_err(dir)(e)),
        }
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&TRACE_VERSION.to_le_bytes());
        bytes.extend(encode(header, "header")?);
        let header_path = dir.join(HEADER_FILE);
        std::fs::write(&header_path, bytes).map_err(io_err(&header_path))?;
        let create = |name: &str| -> Result<BufWriter<File>, TraceError> {
            let path = dir.join(name);
            let file = OpenOptions::new()
                .create_new(true)
                .append(true)
                .open(&path)
                .map_err(io_err(&path))?;
            Ok(BufWriter::new(file))
        };
        let mut compressor = zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(io_err(dir))?;
        compressor.include_checksum(true).map_err(io_err(dir))?;
        Ok(TraceWriter {
            dir: dir.to_owned(),
            events: create(EVENTS_FILE)?,
            payloads: create(PAYLOADS_FILE)?,
            pending: Vec::with_capacity(FRAME_EVENTS),
            summary: Summary::default(),
            compressor,
        })
    }

    /// Appends an event; a full frame is written out.
    pub fn push(&mut self, event: E) -> Result<(), TraceError> {
        self.pending.push(event);
        if self.pending.len() >= FRAME_EVENTS {
            self.flush()?;
        }
        Ok(())
    }

    /// Appends a large payload; returns where it is.
    pub fn payload(&mut self, bytes: &[u8]) -> Result<PayloadRef, TraceError> {
        let len = u32::try_from(bytes.len()).map_err(|_| TraceError::Encode {
            what: "payload",
            message: format!("{} bytes is more than 4 GiB", bytes.len()),
        })?;
        let at = PayloadRef {
            offset: self.summary.payload_bytes,
            len,
        };
        let path = self.dir.join(PAYLOADS_FILE);
        self.payloads.write_all(bytes).map_err(io_err(&path))?;
        self.summary.payload_bytes += u64::from(len);
        Ok(at)
    }

    /// Writes the pending events as a frame, after the payloads they may
    /// reference, and hands both files to the OS.
    pub fn flush(&mut self) -> Result<(), TraceError> {
        let payloads = self.dir.join(PAYLOADS_FILE);
        self.payloads.flush().map_err(io_err(&payloads))?;
        if !self.pending.is_empty() {
            let raw = encode(&self.pending, "events")?;
            let compressed = self.compressor.compress(&raw).map_err(io_err(&self.dir))?;
            let count = self.pending.len() as u32;
            let path = self.dir.join(EVENTS_FILE);
            let mut frame = Vec::with_capacity(8 + compressed.len());
            frame.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
            frame.extend_from_slice(&count.to_le_bytes());
            frame.extend_from_slice(&compressed);
            self.events.write_all(&frame).map_err(io_err(&path))?;
            self.summary.event_bytes += frame.len() as u64;
            self.summary.events += u64::from(count);
            self.summary.frames += 1;
            self.pending.clear();
        }
        let path = self.dir.join(EVENTS_FILE);
        self.events.flush().map_err(io_err(&path))
    }

    /// Writes what is pending, syncs, and marks the trace complete.
    pub fn finish(mut self) -> Result<Summary, TraceError> {
        self.flush()?;
        for (file, name) in [
            (self.payloads.get_ref(), PAYLOADS_FILE),
            (self.events.get_ref(), EVENTS_FILE),
        ] {
            file.sync_all().map_err(io_err(&self.dir.join(name)))?;
        }
        let path = self.dir.join(COMPLETE_FILE);
        std::fs::write(&path, encode(&self.summary, "summary")?).map_err(io_err(&path))?;
        Ok(self.summary)
    }

    /// The guest time the recording has covered so far (for the summary).
    pub fn set_guest_ns(&mut self, ns: u64) {
        self.summary.guest_ns = ns;
    }

    pub fn summary(&self) -> Summary {
        self.summary
    }

    /// Bytes of events and payloads written out so far.
    pub fn bytes_written(&self) -> u64 {
        self.summary.event_bytes + self.summary.payload_bytes
    }
}

/// Whether `dir` holds a trace: its header file starts with [`MAGIC`].
pub fn is_trace(dir: &Path) -> bool {
    let mut magic = [0u8; 8];
    File::open(dir.join(HEADER_FILE))
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == MAGIC
}

/// The bytes a trace's header, log and payloads take on disk (what is
/// missing counts as 0).
pub fn stored_bytes(dir: &Path) -> u64 {
    [HEADER_FILE, EVENTS_FILE, PAYLOADS_FILE]
        .iter()
        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
        .map(|m| m.len())
        .sum()
}

/// How many bytes an event takes in a frame before compression (for
/// statistics of what a trace is made of).
pub fn encoded_len<E: Serialize>(event: &E) -> usize {
    encode(event, "event").map_or(0, |b| b.len())
}

fn encode<T: Serialize>(value: &T, what: &'static str) -> Result<Vec<u8>, TraceError> {
    bincode::serde::encode_to_vec(value, bincode_config()).map_err(|e| TraceError::Encode {
        what,
        message: e.to_string(),
    })
}

fn decode<T: DeserializeOwned>(
    bytes: &[u8],
    path: &Path,
    what: &'static str,
) -> Result<T, TraceError> {
    let (value, used) =
        bincode::serde::decode_from_slice(bytes, bincode_config()).map_err(|e| {
            TraceError::Malformed {
                path: path.to_owned(),
                what,
                message: e.to_string(),
            }
        })?;
    if used != bytes.len() {
        return Err(TraceError::Malformed {
            path: path.to_owned(),
            what,
            message: format!("{} trailing bytes", bytes.len() - used),
        });
    }
    Ok(value)
}

/// Why the event stream ended before a clean end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TailProblem {
    /// The last frame is cut short (the recorder stopped while writing).
    Truncated { frame: u64 },
    /// A frame fails its checks (checksum, length, decoding).
    Corrupt { frame: u64, message: String },
}

/// Reads a trace.
pub struct TraceReader<E> {
    dir: PathBuf,
    pub header: Header,
    /// `None` when the recording did not end cleanly.
    pub complete: Option<Summary>,
    events: BufReader<File>,
    /// Opened at the first payload read.
    payloads: Option<File>,
    frames_read: u64,
    /// The rest of the frame `next_event` is in.
    current: std::vec::IntoIter<E>,
    /// Set when the stream ended on a torn or corrupt frame.
    pub tail_problem: Option<TailProblem>,
    _events: PhantomData<E>,
}

impl<E: DeserializeOwned> TraceReader<E> {
    pub fn open(dir: &Path) -> Result<Self, TraceError> {
        let header_path = dir.join(HEADER_FILE);
        let bytes = std::fs::read(&header_path).map_err(io_err(&header_path))?;
        if bytes.len() < 12 || bytes[..8] != MAGIC {
            return Err(TraceError::BadMagic(dir.to_owned()));
        }
        let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if version != TRACE_VERSION {
            return Err(TraceError::UnsupportedVersion {
                path: dir.to_owned(),
                found: version,
            });
        }
        let header = decode(&bytes[12..], &header_path, "header")?;
        let complete_path = dir.join(COMPLETE_FILE);
        let complete = match std::fs::read(&complete_path) {
            Ok(b) => Some(decode(&b, &complete_path, "completion summary")?),
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(e) => return Err(io_err(&complete_path)(e)),
        };
        let events_path = dir.join(EVENTS_FILE);
        let events = File::open(&events_path).map_err(io_err(&events_path))?;
        Ok(TraceReader {
            dir: dir.to_owned(),
            header,
            complete,
            events: BufReader::new(events),
            payloads: None,
            frames_read: 0,
            current: Vec::new().into_iter(),
            tail_problem: None,
            _events: PhantomData,
        })
    }

    /// The next event, across frames; `None` at the end of the stream
    /// (see `tail_problem` for an unclean end). Do not mix with
    /// `next_frame`, which skips what is left of the current frame.
    pub fn next_event(&mut self) -> Result<Option<E>, TraceError> {
        loop {
            if let Some(e) = self.current.next() {
                return Ok(Some(e));
            }
            match self.next_frame()? {
                Some(frame) => self.current = frame.into_iter(),
                None => return Ok(None),
            }
        }
    }

    /// The next frame's events; `None` at the end of the stream (see
    /// `tail_problem` for an unclean end).
    pub fn next_frame(&mut self) -> Result<Option<Vec<E>>, TraceError> {
        if self.tail_problem.is_some() {
            return Ok(None);
        }
        let path = self.dir.join(EVENTS_FILE);
        let frame = self.frames_read;
        let mut head = [0u8; 8];
        match read_full(&mut self.events, &mut head).map_err(io_err(&path))? {
            0 => return Ok(None),
            8 => {}
            _ => return self.stop(TailProblem::Truncated { frame }),
        }
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let count = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        if len > MAX_FRAME_BYTES || count == 0 {
            let message = format!("length {len}, {count} events");
            return self.stop(TailProblem::Corrupt { frame, message });
        }
        let mut compressed = vec![0u8; len];
        if read_full(&mut self.events, &mut compressed).map_err(io_err(&path))? < len {
            return self.stop(TailProblem::Truncated { frame });
        }
        let raw = match zstd::bulk::decompress(&compressed, MAX_FRAME_BYTES) {
            Ok(raw) => raw,
            Err(e) => {
                let message = e.to_string();
                return self.stop(TailProblem::Corrupt { frame, message });
            }
        };
        let events: Vec<E> = match decode(&raw, &path, "event frame") {
            Ok(events) => events,
            Err(e) => {
                let message = e.to_string();
                return self.stop(TailProblem::Corrupt { frame, message });
            }
        };
        if events.len() != count {
            let message = format!("{} events, header says {count}", events.len());
            return self.stop(TailProblem::Corrupt { frame, message });
        }
        self.frames_read += 1;
        Ok(Some(events))
    }

    fn stop(&mut self, problem: TailProblem) -> Result<Option<Vec<E>>, TraceError> {
        self.tail_problem = Some(problem);
        Ok(None)
    }

    /// Reads a payload the events reference (checked against the payload
    /// file's size before anything is allocated).
    pub fn payload(&mut self, at: PayloadRef) -> Result<Vec<u8>, TraceError> {
        use std::os::unix::fs::FileExt;
        let path = self.dir.join(PAYLOADS_FILE);
        let file = match self.payloads.take() {
            Some(f) => self.payloads.insert(f),
            None => self
                .payloads
                .insert(File::open(&path).map_err(io_err(&path))?),
        };
        let size = file.metadata().map_err(io_err(&path))?.len();
        if at
            .offset
            .checked_add(u64::from(at.len))
            .is_none_or(|end| end > size)
        {
            return Err(TraceError::Malformed {
                path,
                what: "payload reference",
                message: format!(
                    "{} bytes at {} run past the end ({size} bytes)",
                    at.len, at.offset
                ),
            });
        }
        let mut buf = vec![0u8; at.len as usize];
        file.read_exact_at(&mut buf, at.offset)
            .map_err(io_err(&path))?;
        Ok(buf)
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests;
