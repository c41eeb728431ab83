//! The entries of the journal, the trace's log: what a recording writes
//! and a replay reads back, in order.

use std::fmt;

use serde::{Deserialize, Serialize};
use trace::PayloadRef;

use crate::preempt::{AsyncPoint, MarkAt, SampleMark};

/// A journal entry: one record of the trace's log. The exit entries (`In`
/// to `Completed`) are the deterministic exits in order: the n-th of them
/// is exit n. The others tell what happened after the exit before them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Entry {
    /// Port read, and the value the guest got.
    In {
        port: u16,
        size: u8,
        rip: u64,
        value: u32,
    },
    /// Port write.
    Out {
        port: u16,
        size: u8,
        rip: u64,
        value: u32,
    },
    /// MMIO read, and the value the guest got.
    MmioRead {
        addr: u64,
        size: u8,
        rip: u64,
        value: u64,
    },
    /// MMIO write.
    MmioWrite {
        addr: u64,
        size: u8,
        rip: u64,
        value: u64,
    },
    /// HLT.
    Halt { rip: u64 },
    /// RDMSR of an MSR KVM leaves to the VMM, and its result (`fault`: the
    /// guest got #GP).
    RdMsr {
        index: u32,
        rip: u64,
        value: u64,
        fault: bool,
    },
    /// WRMSR of an MSR KVM leaves to the VMM.
    WrMsr {
        index: u32,
        rip: u64,
        value: u64,
        fault: bool,
    },
    /// An instruction KVM could not emulate, completed by the VMM.
    Completed { rip: u64 },
    /// Interrupt `vector` was injected after the preceding exit.
    Interrupt { vector: u8 },
    /// Disk completions were made visible to the guest after the
    /// preceding exit: `completed` is the total so far (the recorded
    /// count, RDMA; the device's own count is ADMA).
    DiskDone { completed: u64 },
    /// Received network frames were made visible to the guest after the
    /// preceding exit: their bytes (virtio-net header and Ethernet frame,
    /// one after the other) are in the payload stream at `payload`, and
    /// `lens` are the frames' lengths.
    NetRx { payload: PayloadRef, lens: Vec<u32> },
    /// The preceding exit raised a guest event (docs/events.md) at this
    /// time of the recording, in nanoseconds since the VM started: the
    /// time replay gives the event.
    EventRaised { ns: u64 },
    /// Digest of the general registers at the preceding exit.
    Registers { digest: u64 },
    /// The preceding exit (the virtio console's transmit notification)
    /// wrote `bytes` bytes of console output whose FNV-1a digest is
    /// `digest`: replay checks that it writes the same.
    ConsoleOut { bytes: u64, digest: u64 },
    /// Typed input was made visible to the guest's virtio console after
    /// the preceding exit: these bytes, in its receive buffers.
    ConsoleRx { bytes: Vec<u8> },
    /// The guest was told after the preceding exit that its virtio
    /// console's terminal is `cols` columns by `rows` rows.
    ConsoleSize { cols: u16, rows: u16 },
    /// The preceding exit (`/init`'s control-port message) wrote `bytes`
    /// bytes of the command's standard output (`stream` 1) or error (2),
    /// a pipe in the guest, to the host's, whose FNV-1a digest is
    /// `digest`: replay checks that it writes the same. `closed`: the
    /// host's stream took no more (a pipe whose reader had gone), which
    /// `/init` was told, and a replay tells it again.
    StreamOut {
        stream: u8,
        bytes: u64,
        digest: u64,
        closed: bool,
    },
    /// The preceding exit (`/init`'s control-port message 0x0f) asked for
    /// the command's standard input, a pipe in the guest where the
    /// recording's own was no terminal: these bytes were written to
    /// `/init`'s buffer, and `end`: the host's input had ended after them.
    /// Replay writes the same.
    StreamIn { bytes: Vec<u8>, end: bool },
    /// The host's files (the 9P device) answered a request the preceding
    /// exit made available with this reply, in the payload stream;
    /// `request` is the FNV-1a digest of the request's bytes.
    HostFiles { request: u64, reply: PayloadRef },
    /// The host's files answered a read request (`request`, as above) with
    /// `count` bytes from `offset` of the stored file `object` (the
    /// SHA-256 of its bytes: `objects/<hex>` in the trace).
    HostFileRead {
        request: u64,
        object: [u8; 32],
        offset: u64,
        count: u32,
    },
    /// The guest's user code, running on after the preceding exit without
    /// one of its own, was stopped at this state and the interrupt of the
    /// `Interrupt` entry that follows delivered there (an asynchronous
    /// point; inputs may be made visible there too). Not an exit: it has
    /// no ordinal.
    AsyncPoint(Box<AsyncPoint>),
    /// The recording's sampling clock found the task here, after the
    /// preceding exit (and before the next entry's position): replay
    /// takes a SAMPLE there. Not an exit; nothing is delivered there.
    Sample(Box<SampleMark>),
    /// The VM's time at the preceding exit, in nanoseconds since it
    /// started, logged where it had moved on by `TIME_GRAIN_NS` from the
    /// latest time the log gave: replay times the events raised after
    /// that exit by it. Not an exit.
    Time { ns: u64 },
    /// The recording ended here.
    End(EndReason),
}

/// An input replay makes visible after an exit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Publish disk completions up to this count.
    Disk(u64),
    /// Deliver these network frames.
    Net(Vec<Vec<u8>>),
    /// Deliver these bytes of typed input to the virtio console.
    Console(Vec<u8>),
    /// Tell the virtio console's driver this terminal size (columns, rows).
    ConsoleSize(u16, u16),
}

/// Why a recording ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EndReason {
    /// `/init` reported the command's exit status.
    CommandExited(u8),
    /// The guest powered off.
    PowerOff,
    /// The user stopped the VM.
    StoppedByUser,
    /// The run failed (guest crash, VMM error): the message.
    Failed(String),
    /// The guest's user code made no progress (no system call or fault
    /// from user mode) for the recording's time limit (in milliseconds of
    /// the host's time): taken as a hang, the threads left where they
    /// stood.
    Hung { limit_ms: u64 },
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndReason::CommandExited(s) => write!(f, "command exited with status {s}"),
            EndReason::PowerOff => f.write_str("guest powered off"),
            EndReason::StoppedByUser => f.write_str("stopped by the user"),
            EndReason::Failed(m) => write!(f, "run failed: {m}"),
            EndReason::Hung { limit_ms } => write!(
                f,
                "no progress in user mode for {:.3} s (the time limit): a hang",
                *limit_ms as f64 / 1e3
            ),
        }
    }
}

impl Entry {
    /// Whether this entry is a deterministic exit (and so has an ordinal).
    pub fn is_exit(&self) -> bool {
        !matches!(
            self,
            Entry::Interrupt { .. }
                | Entry::DiskDone { .. }
                | Entry::NetRx { .. }
                | Entry::EventRaised { .. }
                | Entry::Registers { .. }
                | Entry::ConsoleOut { .. }
                | Entry::ConsoleRx { .. }
                | Entry::ConsoleSize { .. }
                | Entry::StreamOut { .. }
                | Entry::StreamIn { .. }
                | Entry::HostFiles { .. }
                | Entry::HostFileRead { .. }
                | Entry::AsyncPoint(_)
                | Entry::Sample(_)
                | Entry::Time { .. }
                | Entry::End(_)
        )
    }

    /// The kind of entry, as its variant is named.
    pub fn kind(&self) -> &'static str {
        match self {
            Entry::In { .. } => "In",
            Entry::Out { .. } => "Out",
            Entry::MmioRead { .. } => "MmioRead",
            Entry::MmioWrite { .. } => "MmioWrite",
            Entry::Halt { .. } => "Halt",
            Entry::RdMsr { .. } => "RdMsr",
            Entry::WrMsr { .. } => "WrMsr",
            Entry::Completed { .. } => "Completed",
            Entry::Interrupt { .. } => "Interrupt",
            Entry::DiskDone { .. } => "DiskDone",
            Entry::NetRx { .. } => "NetRx",
            Entry::EventRaised { .. } => "EventRaised",
            Entry::Registers { .. } => "Registers",
            Entry::ConsoleOut { .. } => "ConsoleOut",
            Entry::ConsoleRx { .. } => "ConsoleRx",
            Entry::ConsoleSize { .. } => "ConsoleSize",
            Entry::StreamOut { .. } => "StreamOut",
            Entry::StreamIn { .. } => "StreamIn",
            Entry::HostFiles { .. } => "HostFiles",
            Entry::HostFileRead { .. } => "HostFileRead",
            Entry::AsyncPoint(_) => "AsyncPoint",
            Entry::Sample(_) => "Sample",
            Entry::Time { .. } => "Time",
            Entry::End(_) => "End",
        }
    }

    /// The same exit with its RIP set.
    pub fn with_rip(mut self, at: u64) -> Self {
        match &mut self {
            Entry::In { rip, .. }
            | Entry::Out { rip, .. }
            | Entry::MmioRead { rip, .. }
            | Entry::MmioWrite { rip, .. }
            | Entry::Halt { rip }
            | Entry::RdMsr { rip, .. }
            | Entry::WrMsr { rip, .. }
            | Entry::Completed { rip } => *rip = at,
            Entry::Interrupt { .. }
            | Entry::DiskDone { .. }
            | Entry::NetRx { .. }
            | Entry::EventRaised { .. }
            | Entry::Registers { .. }
            | Entry::ConsoleOut { .. }
            | Entry::ConsoleRx { .. }
            | Entry::ConsoleSize { .. }
            | Entry::StreamOut { .. }
            | Entry::StreamIn { .. }
            | Entry::HostFiles { .. }
            | Entry::HostFileRead { .. }
            | Entry::AsyncPoint(_)
            | Entry::Sample(_)
            | Entry::Time { .. }
            | Entry::End(_) => {}
        }
        self
    }

    /// Whether `self` (logged) and `other` (observed) are the same exit,
    /// ignoring the values read (those come from the log at replay).
    pub fn same_exit(&self, other: &Entry) -> bool {
        use Entry::*;
        match (self, other) {
            (
                In {
                    port, size, rip, ..
                },
                In {
                    port: p,
                    size: s,
                    rip: r,
                    ..
                },
            ) => (port, size, rip) == (p, s, r),
            (
                MmioRead {
                    addr, size, rip, ..
                },
                MmioRead {
                    addr: a,
                    size: s,
                    rip: r,
                    ..
                },
            ) => (addr, size, rip) == (a, s, r),
            (
                RdMsr { index, rip, .. },
                RdMsr {
                    index: i, rip: r, ..
                },
            ) => (index, rip) == (i, r),
            (a, b) => a == b,
        }
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::In {
                port,
                size,
                rip,
                value,
            } => write!(
                f,
                "in    port {port:#06x}/{size} -> {value:#x}  rip {rip:#x}"
            ),
            Entry::Out {
                port,
                size,
                rip,
                value,
            } => write!(
                f,
                "out   port {port:#06x}/{size} <- {value:#x}  rip {rip:#x}"
            ),
            Entry::MmioRead {
                addr,
                size,
                rip,
                value,
            } => write!(f, "mmio  read {addr:#x}/{size} -> {value:#x}  rip {rip:#x}"),
            Entry::MmioWrite {
                addr,
                size,
                rip,
                value,
            } => write!(
                f,
                "mmio  write {addr:#x}/{size} <- {value:#x}  rip {rip:#x}"
            ),
            Entry::Halt { rip } => write!(f, "hlt   rip {rip:#x}"),
            Entry::RdMsr {
                index,
                rip,
                value,
                fault,
            } => {
                write!(f, "rdmsr {index:#x} -> ")?;
                if *fault {
                    write!(f, "#GP")?;
                } else {
                    write!(f, "{value:#x}")?;
                }
                write!(f, "  rip {rip:#x}")
            }
            Entry::WrMsr {
                index,
                rip,
                value,
                fault,
            } => write!(
                f,
                "wrmsr {index:#x} <- {value:#x}{}  rip {rip:#x}",
                if *fault { " (#GP)" } else { "" }
            ),
            Entry::Completed { rip } => write!(f, "completed instruction  rip {rip:#x}"),
            Entry::Interrupt { vector } => write!(f, "  interrupt vector {vector:#x}"),
            Entry::DiskDone { completed } => {
                write!(f, "  disk completions published up to {completed}")
            }
            Entry::NetRx { payload, lens } => write!(
                f,
                "  net: {} frame{} received, {} bytes (payload {}+{})",
                lens.len(),
                if lens.len() == 1 { "" } else { "s" },
                lens.iter().map(|&l| u64::from(l)).sum::<u64>(),
                payload.offset,
                payload.len
            ),
            Entry::EventRaised { ns } => write!(f, "  guest event raised at {ns} ns"),
            Entry::Registers { digest } => write!(f, "  registers digest {digest:016x}"),
            Entry::ConsoleOut { bytes, digest } => {
                write!(f, "  console output, {bytes} bytes, digest {digest:016x}")
            }
            Entry::ConsoleRx { bytes } => write!(
                f,
                "  console input, {} byte{}",
                bytes.len(),
                if bytes.len() == 1 { "" } else { "s" }
            ),
            Entry::ConsoleSize { cols, rows } => {
                write!(f, "  console size {cols}x{rows}")
            }
            Entry::StreamOut {
                stream,
                bytes,
                digest,
                closed,
            } => write!(
                f,
                "  {}, {bytes} bytes, digest {digest:016x}{}",
                stream_name(*stream),
                if *closed { ", closed on the host" } else { "" }
            ),
            Entry::StreamIn { bytes, end } => write!(
                f,
                "  standard input, {} byte{}{}",
                bytes.len(),
                if bytes.len() == 1 { "" } else { "s" },
                if *end { ", then its end" } else { "" }
            ),
            Entry::HostFiles { request, reply } => write!(
                f,
                "  host files: reply of {} bytes to request {request:016x} (payload {})",
                reply.len, reply.offset
            ),
            Entry::HostFileRead {
                request,
                object,
                offset,
                count,
            } => write!(
                f,
                "  host files: {count} bytes at {offset} of {} to request {request:016x}",
                trace::objects::object_name(object)
            ),
            Entry::AsyncPoint(p) => {
                let s = &p.state;
                write!(
                    f,
                    "async point  rip {:#x} rsp {:#x} cr3 {:#x}, {} page{} written, {} us after the exit",
                    s.rip,
                    s.gprs[4],
                    s.cr3,
                    s.pages.len(),
                    if s.pages.len() == 1 { "" } else { "s" },
                    p.run_ns / 1000
                )
            }
            Entry::Sample(mark) => match &mark.at {
                MarkAt::Kernel { rip } => {
                    write!(f, "  sample  in the kernel at {rip:#x}, {} ns", mark.ns)
                }
                MarkAt::Boundary { rip } => write!(
                    f,
                    "  sample  at the kernel's boundary at {rip:#x}, {} ns",
                    mark.ns
                ),
                MarkAt::User(p) => write!(
                    f,
                    "  sample  rip {:#x} rsp {:#x} cr3 {:#x} at {} ns",
                    p.state.rip, p.state.gprs[4], p.state.cr3, mark.ns
                ),
            },
            Entry::Time { ns } => write!(f, "  time {ns} ns"),
            Entry::End(reason) => write!(f, "end: {reason}"),
        }
    }
}

/// The digest `StreamOut` logs of output: FNV-1a (64-bit), as the
/// virtio console's of its own.
pub fn output_digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What the command's standard stream `stream` is called.
pub fn stream_name(stream: u8) -> String {
    match stream {
        1 => "standard output".to_owned(),
        2 => "standard error".to_owned(),
        n => format!("stream {n}"),
    }
}

pub fn rip_of(e: &Entry) -> u64 {
    match e {
        Entry::In { rip, .. }
        | Entry::Out { rip, .. }
        | Entry::MmioRead { rip, .. }
        | Entry::MmioWrite { rip, .. }
        | Entry::Halt { rip }
        | Entry::RdMsr { rip, .. }
        | Entry::WrMsr { rip, .. }
        | Entry::Completed { rip } => *rip,
        _ => 0,
    }
}

/// A digest of the registers that determine the guest's execution.
pub fn register_digest(regs: &kvm_bindings::kvm_regs) -> u64 {
    // FNV-1a over the 18 registers: cheap, stable across versions.
    let words = [
        regs.rax,
        regs.rbx,
        regs.rcx,
        regs.rdx,
        regs.rsi,
        regs.rdi,
        regs.rsp,
        regs.rbp,
        regs.r8,
        regs.r9,
        regs.r10,
        regs.r11,
        regs.r12,
        regs.r13,
        regs.r14,
        regs.r15,
        regs.rip,
        regs.rflags,
    ];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
