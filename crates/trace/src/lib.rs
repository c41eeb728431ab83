//! The insight trace: a directory holding what a recording logged.
//!
//! ```text
//! TRACE/
//!   header     magic "INSIGHT\0", u32 LE format version, u32 LE CRC-32 of
//!              the rest, bincode(Header)
//!   events     frames: u32 LE compressed length, u32 LE event count, u64 LE
//!              index of the frame's first event, zstd (with checksum) of
//!              bincode(Vec<event>)
//!   payloads   raw bytes of large payloads (packets, DMA data), referenced
//!              from events by PayloadRef { offset, len, crc32 }
//!   complete   u32 LE CRC-32 of the rest, bincode(Summary), written last:
//!              its absence means the recording did not end cleanly
//! ```
//!
//! Frames are appended as they fill (and on `flush`), payloads before the
//! frames that reference them, so a crashed recorder leaves a readable
//! prefix. The reader validates everything it reads: every stored byte is
//! covered by a checksum, and a complete trace's sizes and counts must be
//! those its summary gives. A torn tail of an unfinished recording ends
//! the stream and is reported ([`TailProblem`]); anything else that fails
//! its checks is [`TraceError::Damaged`], never trusted. The format is
//! documented in docs/trace-format.md; its version is [`TRACE_VERSION`].

use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub mod checkpoints;
pub mod files;
pub mod objects;

/// Format version, bumped on every change of the layout or of the types
/// serialized in it.
pub const TRACE_VERSION: u32 = 21;
pub const MAGIC: [u8; 8] = *b"INSIGHT\0";

const HEADER_FILE: &str = "header";
const EVENTS_FILE: &str = "events";
const PAYLOADS_FILE: &str = "payloads";
const COMPLETE_FILE: &str = "complete";
/// The boot snapshot a recording started from, in the checkpoint format
/// (`checkpoints::read_at`), when it did not boot from power-on.
pub const SNAPSHOT_FILE: &str = "boot.snap";

/// Events per frame before the writer compresses and appends it.
pub const FRAME_EVENTS: usize = 4096;
/// Largest frame accepted, compressed or not (a bound on allocations for
/// untrusted files).
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Largest header file accepted (its appended archive holds the user's
/// files; the header is encoded under the same bound as a frame).
pub const MAX_HEADER_BYTES: u64 = MAX_FRAME_BYTES as u64 + 16;
/// Largest completion summary accepted (it is a few dozen bytes).
pub const MAX_SUMMARY_BYTES: u64 = 4096;
/// Bytes before a frame's compressed events.
const FRAME_HEAD: usize = 16;
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
    /// Stored bytes fail their checksum, or a complete trace's sizes and
    /// counts differ from its summary: the trace is damaged.
    #[error("{path} is damaged: {at}: {message}")]
    Damaged {
        path: PathBuf,
        /// Where: "frame 3 at byte 81920", "payload at byte 512"...
        at: String,
        message: String,
    },
    #[error(
        "{0} was removed while it was written: nothing more goes into it, nor into \
         whatever has its name now"
    )]
    Removed(PathBuf),
    #[error(transparent)]
    File(#[from] files::FileError),
    /// A checkpoint that must not be restored: the message says why;
    /// `damaged` when its bytes are not those written (cut short, or its
    /// body fails its digest), not merely foreign or of another version.
    #[error("checkpoint {path} is refused: {message}")]
    Checkpoint {
        path: PathBuf,
        message: String,
        damaged: bool,
    },
}

impl TraceError {
    /// Whether the trace's stored bytes are damaged (as opposed to
    /// missing, unreadable, foreign, or cut short by a crash).
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            TraceError::Damaged { .. } | TraceError::Checkpoint { damaged: true, .. }
        )
    }
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
    /// The recording's sampling clock: a sample mark about every so many
    /// nanoseconds of the recording's time (0: none were taken).
    pub sample_period_ns: u64,
    /// The chaos the recording's schedule was perturbed with (`record
    /// --chaos`); `None`: none. For people and for recording again: a
    /// replay needs none of it (every choice it made is in the log).
    pub chaos: Option<ChaosSettings>,
}

/// Chaos settings (docs/chaos.md), handed to the guest kernel's chaos
/// scheduler: its draws come from `seed`; one system-call entry or return
/// to user mode in `entry_one_in`, and one tick in `tick_one_in`, gives
/// the running task a new random priority (0: never); a thread is
/// single-stepped in runs up to a priority change point, each drawn below
/// twice a mean, the mean a power of two between `1 << step_log_min` and
/// `1 << step_log_max` (0: no stepping); a thread steps at most
/// `thread_budget` instructions, a process `process_budget`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChaosSettings {
    pub seed: u64,
    pub entry_one_in: u8,
    pub tick_one_in: u8,
    pub step_log_min: u8,
    pub step_log_max: u8,
    pub thread_budget: u16,
    pub process_budget: u16,
}

/// The guest's initial state besides the image files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootParams {
    /// Kernel command line.
    pub cmdline: String,
    pub memory_mib: u64,
    /// Seed handed to the guest kernel's random number generator.
    pub rng_seed: Vec<u8>,
    /// The run's archive, which the guest's `/init` fetches once it is
    /// ready (command, environment, the user's files, the devices to
    /// attach), followed by the seed and the wall-clock time.
    pub archive: Vec<u8>,
    /// The wall-clock time `/init` sets, (seconds, nanoseconds) since the
    /// Unix epoch: given to a guest restored from a boot snapshot.
    pub wall_clock: Option<(u64, u32)>,
    /// The virtio network device, if the guest had one.
    pub net: Option<NetParams>,
    /// The boot snapshot the recording started from (`SNAPSHOT_FILE`);
    /// `None`: it booted from power-on.
    pub snapshot: Option<SnapshotRef>,
}

/// A boot snapshot, by content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRef {
    /// SHA-256 of what determines the boot (its cache key), in hex.
    pub key: String,
    /// SHA-256 of the snapshot's compressed body, in hex.
    pub digest: String,
    /// Guest time at which it was taken (ns).
    pub guest_ns: u64,
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
    /// CRC-32 of the payload's bytes.
    pub crc32: u32,
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
    /// Frames the host received for the guest that never reached it (too
    /// large for the guest, arriving while it took none, or dropped by the
    /// host kernel at the TAP device): not in the log, and not in any
    /// replay. Said with `set_net_rx_dropped`.
    pub net_rx_dropped: u64,
}

/// Appends to a new trace.
pub struct TraceWriter<E> {
    dir: PathBuf,
    /// The directory itself, open: files made later (`complete`) go into
    /// it through this handle, never by its name, which another recording
    /// may take if the directory is removed.
    dir_handle: File,
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
        let dir_handle = File::open(dir).map_err(io_err(dir))?;
        let encoded = encode(header, "header")?;
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&TRACE_VERSION.to_le_bytes());
        bytes.extend_from_slice(&crc32fast::hash(&encoded).to_le_bytes());
        bytes.extend(encoded);
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
            dir_handle,
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
    /// The trace directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn payload(&mut self, bytes: &[u8]) -> Result<PayloadRef, TraceError> {
        let len = u32::try_from(bytes.len()).map_err(|_| TraceError::Encode {
            what: "payload",
            message: format!("{} bytes is more than 4 GiB", bytes.len()),
        })?;
        let at = PayloadRef {
            offset: self.summary.payload_bytes,
            len,
            crc32: crc32fast::hash(bytes),
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
            let mut frame = Vec::with_capacity(FRAME_HEAD + compressed.len());
            frame.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
            frame.extend_from_slice(&count.to_le_bytes());
            frame.extend_from_slice(&self.summary.events.to_le_bytes());
            frame.extend_from_slice(&compressed);
            self.events.write_all(&frame).map_err(io_err(&path))?;
            self.summary.event_bytes += frame.len() as u64;
            self.summary.events += u64::from(count);
            self.summary.frames += 1;
            self.pending.clear();
        }
        let path = self.dir.join(EVENTS_FILE);
        self.events.flush().map_err(io_err(&path))?;
        self.still_there()
    }

    /// Fails with [`TraceError::Removed`] once the directory is gone (its
    /// link count drops to 0 when it is removed).
    fn still_there(&self) -> Result<(), TraceError> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.dir_handle.metadata().map_err(io_err(&self.dir))?;
        if meta.nlink() == 0 {
            return Err(TraceError::Removed(self.dir.clone()));
        }
        Ok(())
    }

    /// Where the file `name` of the trace is reached through the open
    /// directory (its name where /proc is not mounted).
    fn in_dir(&self, name: &str) -> PathBuf {
        use std::os::fd::AsRawFd;
        let fds = Path::new("/proc/self/fd");
        if fds.is_dir() {
            fds.join(self.dir_handle.as_raw_fd().to_string()).join(name)
        } else {
            self.dir.join(name)
        }
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
        std::fs::write(
            self.in_dir(COMPLETE_FILE),
            with_crc(encode(&self.summary, "summary")?),
        )
        .map_err(|e| match self.still_there() {
            Err(removed) => removed,
            Ok(()) => io_err(&path)(e),
        })?;
        Ok(self.summary)
    }

    /// The guest time the recording has covered so far (for the summary).
    pub fn set_guest_ns(&mut self, ns: u64) {
        self.summary.guest_ns = ns;
    }

    /// Received frames the guest never got (for the summary).
    pub fn set_net_rx_dropped(&mut self, frames: u64) {
        self.summary.net_rx_dropped = frames;
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
    files::open_regular(&dir.join(HEADER_FILE)).is_ok_and(|mut f| f.read_exact(&mut magic).is_ok())
        && magic == MAGIC
}

/// Removes the files a recording writes into `dir` (header, log,
/// payloads, completion summary, boot snapshot), for a recording that
/// failed before its run began: nothing in them is worth keeping. Other
/// files, and the directory, stay (`objects::discard` removes the host
/// files it stored).
pub fn discard_unstarted(dir: &Path) -> std::io::Result<()> {
    for name in [
        HEADER_FILE,
        EVENTS_FILE,
        PAYLOADS_FILE,
        COMPLETE_FILE,
        SNAPSHOT_FILE,
    ] {
        match std::fs::remove_file(dir.join(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
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

/// `bytes` behind their CRC-32.
fn with_crc(bytes: Vec<u8>) -> Vec<u8> {
    let mut out = crc32fast::hash(&bytes).to_le_bytes().to_vec();
    out.extend(bytes);
    out
}

/// The bytes behind a CRC-32 that matches them.
fn check_crc<'a>(stored: &'a [u8], path: &Path, what: &str) -> Result<&'a [u8], TraceError> {
    let damaged = |message: String| TraceError::Damaged {
        path: path.to_owned(),
        at: what.to_owned(),
        message,
    };
    let Some((crc, rest)) = stored.split_first_chunk::<4>() else {
        return Err(damaged(format!(
            "{} bytes, too short for its checksum",
            stored.len()
        )));
    };
    let (stored, computed) = (u32::from_le_bytes(*crc), crc32fast::hash(rest));
    if stored != computed {
        return Err(damaged(format!(
            "checksum mismatch (stored {stored:08x}, computed {computed:08x})"
        )));
    }
    Ok(rest)
}

fn decode<T: DeserializeOwned>(
    bytes: &[u8],
    path: &Path,
    what: &'static str,
) -> Result<T, TraceError> {
    decode_value(bytes).map_err(|message| TraceError::Malformed {
        path: path.to_owned(),
        what,
        message,
    })
}

/// Decodes all of `bytes`; the error says what is wrong in words.
fn decode_value<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    use bincode::error::DecodeError;
    let (value, used) =
        bincode::serde::decode_from_slice(bytes, bincode_config()).map_err(|e| match e {
            DecodeError::UnexpectedEnd { additional } => {
                format!("it ends {additional} bytes before its last value")
            }
            DecodeError::LimitExceeded => {
                format!("it declares more than {MAX_FRAME_BYTES} bytes of values")
            }
            DecodeError::UnexpectedVariant { found, .. } => {
                format!("it holds an unknown variant {found}")
            }
            other => other.to_string(),
        })?;
    if used != bytes.len() {
        return Err(format!(
            "{} bytes follow its last value",
            bytes.len() - used
        ));
    }
    Ok(value)
}

/// Why the event stream of an unfinished recording ended before a clean
/// end (in a complete trace the same is [`TraceError::Damaged`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TailProblem {
    /// The last frame is cut short (the recorder stopped while writing).
    Truncated { frame: u64 },
    /// The last frame fails its checks (checksum, length, decoding).
    Corrupt { frame: u64, message: String },
}

impl std::fmt::Display for TailProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TailProblem::Truncated { frame } => write!(f, "frame {frame} is cut short"),
            TailProblem::Corrupt { frame, message } => write!(f, "frame {frame}: {message}"),
        }
    }
}

/// Reads a trace.
pub struct TraceReader<E> {
    dir: PathBuf,
    pub header: Header,
    /// `None` when the recording did not end cleanly.
    pub complete: Option<Summary>,
    events: BufReader<File>,
    /// Size of the events file when opened.
    events_size: u64,
    /// Opened at the first payload read.
    payloads: Option<File>,
    frames_read: u64,
    events_read: u64,
    /// Byte offset of the next frame.
    offset: u64,
    /// The rest of the frame `next_event` is in.
    current: std::vec::IntoIter<E>,
    /// Set when the stream of an unfinished recording ended on a torn or
    /// corrupt last frame.
    pub tail_problem: Option<TailProblem>,
    _events: PhantomData<E>,
}

impl<E: DeserializeOwned> TraceReader<E> {
    pub fn open(dir: &Path) -> Result<Self, TraceError> {
        let header_path = dir.join(HEADER_FILE);
        let bytes = files::read_bounded(&header_path, MAX_HEADER_BYTES, "trace header")?;
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
        let encoded = check_crc(&bytes[12..], &header_path, "header")?;
        let header = decode(encoded, &header_path, "header")?;
        let complete_path = dir.join(COMPLETE_FILE);
        let complete: Option<Summary> =
            match files::read_bounded(&complete_path, MAX_SUMMARY_BYTES, "completion summary") {
                Ok(b) => {
                    let encoded = check_crc(&b, &complete_path, "completion summary")?;
                    Some(decode(encoded, &complete_path, "completion summary")?)
                }
                Err(files::FileError::Io { source, .. })
                    if source.kind() == ErrorKind::NotFound =>
                {
                    None
                }
                Err(e) => return Err(e.into()),
            };
        let events_path = dir.join(EVENTS_FILE);
        let events = files::open_regular(&events_path)?;
        let events_size = events.metadata().map_err(io_err(&events_path))?.len();
        let mut reader = TraceReader {
            dir: dir.to_owned(),
            header,
            complete,
            events: BufReader::new(events),
            events_size,
            payloads: None,
            frames_read: 0,
            events_read: 0,
            offset: 0,
            current: Vec::new().into_iter(),
            tail_problem: None,
            _events: PhantomData,
        };
        if let Some(summary) = complete {
            // A complete trace's files are as long as its summary says,
            // before anything is replayed from them.
            let payloads_size = reader
                .payload_file()?
                .metadata()
                .map_err(io_err(dir))?
                .len();
            for (file, size, said) in [
                (EVENTS_FILE, events_size, summary.event_bytes),
                (PAYLOADS_FILE, payloads_size, summary.payload_bytes),
            ] {
                if size != said {
                    return Err(reader.damaged(
                        file,
                        "its size".into(),
                        format!("{size} bytes, its completion summary says {said}"),
                    ));
                }
            }
        }
        Ok(reader)
    }

    /// The trace directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn damaged(&self, file: &str, at: String, message: String) -> TraceError {
        TraceError::Damaged {
            path: self.dir.join(file),
            at,
            message,
        }
    }

    /// Moves to event `index` (0-based) of the log: the next
    /// `next_event` returns it. Frames before it are skipped by their
    /// heads alone; the frame holding it is read and checked as usual.
    pub fn seek_event(&mut self, index: u64) -> Result<(), TraceError> {
        use std::io::{Seek, SeekFrom};
        let path = self.dir.join(EVENTS_FILE);
        let (mut offset, mut frames, mut events) = (0u64, 0u64, 0u64);
        loop {
            self.events
                .seek(SeekFrom::Start(offset))
                .map_err(io_err(&path))?;
            let mut head = [0u8; FRAME_HEAD];
            if read_full(&mut self.events, &mut head).map_err(io_err(&path))? < FRAME_HEAD {
                return Err(self.damaged(
                    EVENTS_FILE,
                    format!("byte {offset}"),
                    format!("the log ends at event {events}, before event {index}"),
                ));
            }
            let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as u64;
            let count = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as u64;
            let first = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
            if first != events || count == 0 || len > MAX_FRAME_BYTES as u64 {
                return Err(self.damaged(
                    EVENTS_FILE,
                    format!("frame {frames} at byte {offset}"),
                    format!("its head says {count} events from event {first} in {len} bytes"),
                ));
            }
            if index < first + count {
                self.events
                    .seek(SeekFrom::Start(offset))
                    .map_err(io_err(&path))?;
                (self.offset, self.frames_read, self.events_read) = (offset, frames, events);
                self.tail_problem = None;
                self.current = Vec::new().into_iter();
                let Some(frame) = self.next_frame()? else {
                    return Err(self.damaged(
                        EVENTS_FILE,
                        format!("frame {frames} at byte {offset}"),
                        "it is cut short".into(),
                    ));
                };
                let mut rest = frame.into_iter();
                for _ in first..index {
                    rest.next();
                }
                self.current = rest;
                return Ok(());
            }
            offset += (FRAME_HEAD as u64) + len;
            frames += 1;
            events += count;
        }
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
        let mut head = [0u8; FRAME_HEAD];
        match read_full(&mut self.events, &mut head).map_err(io_err(&path))? {
            0 => return self.end_of_log().map(|()| None),
            FRAME_HEAD => {}
            _ => return self.stop(TailProblem::Truncated { frame }, true),
        }
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let count = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        let first = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
        if len > MAX_FRAME_BYTES || count == 0 {
            // Where the next frame would start is unknown: the stream ends.
            let message = format!("its head declares {len} bytes and {count} events");
            return self.stop(TailProblem::Corrupt { frame, message }, true);
        }
        let end = self.offset + (FRAME_HEAD + len) as u64;
        if end > self.events_size {
            return self.stop(TailProblem::Truncated { frame }, true);
        }
        let mut compressed = vec![0u8; len];
        if read_full(&mut self.events, &mut compressed).map_err(io_err(&path))? < len {
            return self.stop(TailProblem::Truncated { frame }, true);
        }
        let last = end == self.events_size;
        if first != self.events_read {
            // A frame duplicated, moved or lost.
            let message = format!(
                "it starts at event {first}, the frames before it end at event {}",
                self.events_read
            );
            return self.stop(TailProblem::Corrupt { frame, message }, last);
        }
        // Room for what the frame says it holds, within the bound.
        let capacity = match zstd::zstd_safe::get_frame_content_size(&compressed) {
            Ok(Some(n)) if n <= MAX_FRAME_BYTES as u64 => n as usize,
            Ok(None) => MAX_FRAME_BYTES,
            _ => {
                let message = "its compressed events declare no valid size".to_owned();
                return self.stop(TailProblem::Corrupt { frame, message }, last);
            }
        };
        let raw = match zstd::bulk::decompress(&compressed, capacity) {
            Ok(raw) => raw,
            Err(e) => {
                let message = format!("its compressed events fail to decompress ({e})");
                return self.stop(TailProblem::Corrupt { frame, message }, last);
            }
        };
        let events: Vec<E> = match decode_value(&raw) {
            Ok(events) => events,
            Err(message) => {
                let message = format!("its events do not decode ({message})");
                return self.stop(TailProblem::Corrupt { frame, message }, last);
            }
        };
        if events.len() != count {
            let message = format!("it holds {} events, its head says {count}", events.len());
            return self.stop(TailProblem::Corrupt { frame, message }, last);
        }
        self.frames_read += 1;
        self.events_read += count as u64;
        self.offset = end;
        Ok(Some(events))
    }

    /// The log ended cleanly after whole frames: a complete trace's counts
    /// must be its summary's.
    fn end_of_log(&self) -> Result<(), TraceError> {
        let Some(summary) = self.complete else {
            return Ok(());
        };
        let read = (self.frames_read, self.events_read, self.offset);
        let said = (summary.frames, summary.events, summary.event_bytes);
        if read != said {
            return Err(self.damaged(
                EVENTS_FILE,
                format!("its end at byte {}", self.offset),
                format!(
                    "{} frames of {} events, its completion summary says {} frames of {} events",
                    read.0, read.1, said.0, said.1
                ),
            ));
        }
        Ok(())
    }

    /// Ends the stream of an unfinished recording on `problem`, found in
    /// its last frame; in a complete trace, or before the last frame, it
    /// is damage.
    fn stop(&mut self, problem: TailProblem, last: bool) -> Result<Option<Vec<E>>, TraceError> {
        if self.complete.is_some() || !last {
            let (frame, message) = match problem {
                TailProblem::Truncated { frame } => (frame, "it is cut short".to_owned()),
                TailProblem::Corrupt { frame, message } => (frame, message),
            };
            return Err(self.damaged(
                EVENTS_FILE,
                format!("frame {frame} at byte {}", self.offset),
                message,
            ));
        }
        self.tail_problem = Some(problem);
        Ok(None)
    }

    fn payload_file(&mut self) -> Result<&File, TraceError> {
        if self.payloads.is_none() {
            let path = self.dir.join(PAYLOADS_FILE);
            self.payloads = Some(files::open_regular(&path)?);
        }
        Ok(self.payloads.as_ref().expect("opened above"))
    }

    /// Reads a payload the events reference (checked against the payload
    /// file's size before anything is allocated, and against its
    /// checksum after).
    pub fn payload(&mut self, at: PayloadRef) -> Result<Vec<u8>, TraceError> {
        use std::os::unix::fs::FileExt;
        let path = self.dir.join(PAYLOADS_FILE);
        let file = self.payload_file()?;
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
        let crc = crc32fast::hash(&buf);
        if crc != at.crc32 {
            return Err(self.damaged(
                PAYLOADS_FILE,
                format!("the {} bytes at byte {}", at.len, at.offset),
                format!(
                    "checksum mismatch (logged {:08x}, computed {crc:08x})",
                    at.crc32
                ),
            ));
        }
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
