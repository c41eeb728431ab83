//! Recording and replay at the exit choke point.
//!
//! Under the exit clock, the guest's execution between two deterministic
//! VM exits depends only on its state at the first. So a recording is the
//! sequence of deterministic exits, each with the value the guest read
//! there (port, MMIO, MSR), the interrupts injected after it, and now and
//! then a digest of the registers to check against. Replay runs the same
//! guest from the same initial state and walks the log in lockstep: every
//! exit must match the next logged one (kind, port or address, size, RIP,
//! value written), every read returns the logged value, and interrupts are
//! injected where they were. The first mismatch stops replay.
//!
//! Exits that are not deterministic (kicks out of `KVM_RUN`, interrupt
//! windows) are neither logged nor used to deliver anything.

use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use trace::{PayloadRef, Summary, TraceError, TraceReader, TraceWriter};

/// Default for how often registers are digested: at every exit whose
/// ordinal is a multiple of this.
pub const DEFAULT_DIGEST_INTERVAL: u64 = 64;

/// The recorder hands complete frames to the OS at least this often, so a
/// crashed recording loses at most this much of its end.
const FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// An entry of the event log. The exit entries (`In` to `Completed`) are
/// the deterministic exits in order: the n-th of them is exit n. The
/// others tell what happened after the exit before them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
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
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndReason::CommandExited(s) => write!(f, "command exited with status {s}"),
            EndReason::PowerOff => f.write_str("guest powered off"),
            EndReason::StoppedByUser => f.write_str("stopped by the user"),
            EndReason::Failed(m) => write!(f, "run failed: {m}"),
        }
    }
}

impl Event {
    /// Whether this entry is a deterministic exit (and so has an ordinal).
    pub fn is_exit(&self) -> bool {
        !matches!(
            self,
            Event::Interrupt { .. }
                | Event::DiskDone { .. }
                | Event::NetRx { .. }
                | Event::EventRaised { .. }
                | Event::Registers { .. }
                | Event::End(_)
        )
    }

    /// The same exit with its RIP set.
    pub fn with_rip(mut self, at: u64) -> Self {
        match &mut self {
            Event::In { rip, .. }
            | Event::Out { rip, .. }
            | Event::MmioRead { rip, .. }
            | Event::MmioWrite { rip, .. }
            | Event::Halt { rip }
            | Event::RdMsr { rip, .. }
            | Event::WrMsr { rip, .. }
            | Event::Completed { rip } => *rip = at,
            Event::Interrupt { .. }
            | Event::DiskDone { .. }
            | Event::NetRx { .. }
            | Event::EventRaised { .. }
            | Event::Registers { .. }
            | Event::End(_) => {}
        }
        self
    }

    /// Whether `self` (logged) and `other` (observed) are the same exit,
    /// ignoring the values read (those come from the log at replay).
    fn same_exit(&self, other: &Event) -> bool {
        use Event::*;
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

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::In {
                port,
                size,
                rip,
                value,
            } => write!(
                f,
                "in    port {port:#06x}/{size} -> {value:#x}  rip {rip:#x}"
            ),
            Event::Out {
                port,
                size,
                rip,
                value,
            } => write!(
                f,
                "out   port {port:#06x}/{size} <- {value:#x}  rip {rip:#x}"
            ),
            Event::MmioRead {
                addr,
                size,
                rip,
                value,
            } => write!(f, "mmio  read {addr:#x}/{size} -> {value:#x}  rip {rip:#x}"),
            Event::MmioWrite {
                addr,
                size,
                rip,
                value,
            } => write!(
                f,
                "mmio  write {addr:#x}/{size} <- {value:#x}  rip {rip:#x}"
            ),
            Event::Halt { rip } => write!(f, "hlt   rip {rip:#x}"),
            Event::RdMsr {
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
            Event::WrMsr {
                index,
                rip,
                value,
                fault,
            } => write!(
                f,
                "wrmsr {index:#x} <- {value:#x}{}  rip {rip:#x}",
                if *fault { " (#GP)" } else { "" }
            ),
            Event::Completed { rip } => write!(f, "completed instruction  rip {rip:#x}"),
            Event::Interrupt { vector } => write!(f, "  interrupt vector {vector:#x}"),
            Event::DiskDone { completed } => {
                write!(f, "  disk completions published up to {completed}")
            }
            Event::NetRx { payload, lens } => write!(
                f,
                "  net: {} frame{} received, {} bytes (payload {}+{})",
                lens.len(),
                if lens.len() == 1 { "" } else { "s" },
                lens.iter().map(|&l| u64::from(l)).sum::<u64>(),
                payload.offset,
                payload.len
            ),
            Event::EventRaised { ns } => write!(f, "  guest event raised at {ns} ns"),
            Event::Registers { digest } => write!(f, "  registers digest {digest:016x}"),
            Event::End(reason) => write!(f, "end: {reason}"),
        }
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

/// Replay found the guest doing something other than what was recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// Ordinal of the exit where it showed.
    pub exit: u64,
    /// What the log says (None: the log has nothing more).
    pub expected: Option<Event>,
    /// What the guest did.
    pub found: String,
    /// The vCPU's registers when replay stopped.
    pub state: String,
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replay diverged at exit {}: recorded ", self.exit)?;
        match &self.expected {
            Some(e) => write!(f, "[{e}]")?,
            None => write!(f, "[end of log]")?,
        }
        write!(f, ", replay [{}]", self.found)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{0}")]
    Diverged(Box<Divergence>),
    #[error("trace")]
    Trace(#[from] TraceError),
}

/// Whether and how the run is journaled.
pub enum Journal {
    /// Not recorded: timely interrupt delivery, nothing logged.
    Live,
    Record(Box<Recorder>),
    Replay(Box<Replayer>),
}

/// Counts shown while a recording or replay runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    /// Deterministic exits so far.
    pub exits: u64,
    /// Log entries written or read.
    pub events: u64,
    /// Guest time: the last paravirtual clock value the guest read (ns).
    pub guest_ns: u64,
    /// Compressed bytes of the trace so far (recording only).
    pub trace_bytes: u64,
}

pub struct Recorder {
    writer: TraceWriter<Event>,
    digest_interval: u64,
    exits: u64,
    events: u64,
    last_flush: Instant,
    guest_ns: u64,
}

impl Recorder {
    /// Records into `writer`, digesting registers every `digest_interval`
    /// exits (as its header says).
    pub fn new(writer: TraceWriter<Event>, digest_interval: u64) -> Self {
        Recorder {
            writer,
            digest_interval: digest_interval.max(1),
            exits: 0,
            events: 0,
            last_flush: Instant::now(),
            guest_ns: 0,
        }
    }

    fn push(&mut self, event: Event) -> Result<(), JournalError> {
        self.events += 1;
        self.writer.push(event)?;
        Ok(())
    }

    /// Logs the end and marks the trace complete.
    pub fn finish(mut self, reason: EndReason) -> Result<Summary, JournalError> {
        self.push(Event::End(reason))?;
        Ok(self.writer.finish()?)
    }
}

pub struct Replayer {
    reader: TraceReader<Event>,
    digest_interval: u64,
    peeked: Option<Event>,
    /// The exit entry matched for the exit in progress, if taken early
    /// (reads take theirs before the RIP is known).
    current: Option<Event>,
    exits: u64,
    events: u64,
    guest_ns: u64,
    /// The log ran out (an incomplete trace).
    exhausted: bool,
    /// The input entry `replay_input` took last.
    last_input: Option<Event>,
}

impl Replayer {
    pub fn new(reader: TraceReader<Event>) -> Self {
        Replayer {
            digest_interval: reader.header.digest_interval.max(1),
            reader,
            peeked: None,
            current: None,
            exits: 0,
            events: 0,
            guest_ns: 0,
            exhausted: false,
            last_input: None,
        }
    }

    /// Whether the trace was marked complete by its recorder.
    pub fn trace_complete(&self) -> bool {
        self.reader.complete.is_some()
    }

    fn peek(&mut self) -> Result<Option<&Event>, JournalError> {
        if self.peeked.is_none() && !self.exhausted {
            self.peeked = self.reader.next_event()?;
            self.exhausted = self.peeked.is_none();
        }
        Ok(self.peeked.as_ref())
    }

    fn next(&mut self) -> Result<Option<Event>, JournalError> {
        self.peek()?;
        let e = self.peeked.take();
        if e.is_some() {
            self.events += 1;
        }
        Ok(e)
    }

    fn diverged(&self, expected: Option<Event>, found: String) -> JournalError {
        self.diverged_at(self.exits, expected, found)
    }

    fn diverged_at(&self, exit: u64, expected: Option<Event>, found: String) -> JournalError {
        JournalError::Diverged(Box::new(Divergence {
            exit,
            expected,
            found,
            state: String::new(),
        }))
    }

    /// Takes the log entry for exit `ordinal`, which must be the same kind
    /// of exit as `observed` (whose RIP may not be known yet).
    fn take_exit(&mut self, observed: &Event, ordinal: u64) -> Result<Event, JournalError> {
        // A read is matched before its RIP and value are known: leave them
        // out of the report (the registers that follow show the RIP).
        let found = if rip_of(observed) == 0 {
            let text = observed.to_string();
            text.split("  rip ")
                .next()
                .unwrap_or(&text)
                .replace(" -> 0x0", "")
        } else {
            observed.to_string()
        };
        let logged = match self.peek()? {
            Some(e) if e.is_exit() => self.next()?.unwrap_or_else(|| observed.clone()),
            _ => {
                let expected = self.peek()?.cloned();
                return Err(self.diverged_at(ordinal, expected, found));
            }
        };
        let comparable = observed.clone().with_rip(rip_of(&logged));
        if !logged.same_exit(&comparable) {
            return Err(self.diverged_at(ordinal, Some(logged), found));
        }
        Ok(logged)
    }

    /// The recorded end, if the log has reached it: replay stops there.
    pub fn end_reached(&mut self) -> Result<Option<EndReason>, JournalError> {
        Ok(match self.peek()? {
            Some(Event::End(reason)) => Some(reason.clone()),
            _ => None,
        })
    }

    /// Whether the log has run out without an end entry.
    pub fn log_exhausted(&mut self) -> Result<bool, JournalError> {
        Ok(self.peek()?.is_none())
    }
}

fn rip_of(e: &Event) -> u64 {
    match e {
        Event::In { rip, .. }
        | Event::Out { rip, .. }
        | Event::MmioRead { rip, .. }
        | Event::MmioWrite { rip, .. }
        | Event::Halt { rip }
        | Event::RdMsr { rip, .. }
        | Event::WrMsr { rip, .. }
        | Event::Completed { rip } => *rip,
        _ => 0,
    }
}

/// MSR index of the guest kernel's paravirtual clock (asm/insight.h).
pub const MSR_INSIGHT_CLOCK: u32 = 0x4953_4e00;
/// IA32_TSC, which the VMM filters so that it never returns host time.
pub const MSR_IA32_TSC: u32 = 0x10;

impl Journal {
    pub fn is_replay(&self) -> bool {
        matches!(self, Journal::Replay(_))
    }

    /// Whether interrupts may be injected only at deterministic exits.
    pub fn exit_clock(&self) -> bool {
        !matches!(self, Journal::Live)
    }

    /// At replay, the logged result of the read `observed` (an exit entry
    /// whose RIP is not known yet); `None` when not replaying.
    pub fn replay_read(&mut self, observed: &Event) -> Result<Option<Event>, JournalError> {
        let Journal::Replay(r) = self else {
            return Ok(None);
        };
        let logged = r.take_exit(observed, r.exits + 1)?;
        r.current = Some(logged.clone());
        Ok(Some(logged))
    }

    /// Accounts for deterministic exit `observed` (RIP set; for reads, with
    /// the value the guest got). `regs` are the registers at the exit.
    pub fn exit(
        &mut self,
        observed: Event,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), JournalError> {
        if let Event::RdMsr {
            index: MSR_INSIGHT_CLOCK,
            value,
            fault: false,
            ..
        } = observed
        {
            match self {
                Journal::Record(r) => r.guest_ns = value,
                Journal::Replay(r) => r.guest_ns = value,
                Journal::Live => {}
            }
        }
        match self {
            Journal::Live => Ok(()),
            Journal::Record(r) => {
                r.exits += 1;
                let digest = r.exits % r.digest_interval == 0;
                r.push(observed)?;
                if digest {
                    r.push(Event::Registers {
                        digest: register_digest(regs),
                    })?;
                }
                Ok(())
            }
            Journal::Replay(r) => {
                r.exits += 1;
                let logged = match r.current.take() {
                    Some(l) => l,
                    None => r.take_exit(&observed, r.exits)?,
                };
                if logged != observed {
                    return Err(r.diverged(Some(logged), observed.to_string()));
                }
                if r.exits % r.digest_interval == 0 {
                    let digest = register_digest(regs);
                    match r.next()? {
                        Some(Event::Registers { digest: d }) if d == digest => {}
                        // A killed recorder may have written the exit but
                        // not its digest: the prefix ends here.
                        None if !r.trace_complete() => {}
                        other => {
                            return Err(r.diverged(
                                other,
                                format!("registers digest {digest:016x} ({})", regs_text(regs)),
                            ))
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// Records an entry about the last exit (an interrupt, completions).
    fn record_after(&mut self, event: Event) -> Result<(), JournalError> {
        if let Journal::Record(r) = self {
            r.push(event)?;
        }
        Ok(())
    }

    /// At replay, takes the next entry about the last exit if `pick`
    /// accepts it.
    fn replay_take<T>(
        &mut self,
        pick: impl Fn(&Event) -> Option<T>,
    ) -> Result<Option<T>, JournalError> {
        let Journal::Replay(r) = self else {
            return Ok(None);
        };
        let Some(value) = r.peek()?.and_then(pick) else {
            return Ok(None);
        };
        r.next()?;
        Ok(Some(value))
    }

    /// A divergence at the current exit, expecting `expected`.
    fn divergence(&mut self, expected: Option<Event>, found: String) -> JournalError {
        match self {
            Journal::Replay(r) => r.diverged(expected, found),
            _ => JournalError::Diverged(Box::new(Divergence {
                exit: 0,
                expected,
                found,
                state: String::new(),
            })),
        }
    }

    /// Records when the guest raised an event at the last exit.
    pub fn record_event_raised(&mut self, ns: u64) -> Result<(), JournalError> {
        self.record_after(Event::EventRaised { ns })
    }

    /// At replay, when the recording saw the event the last exit raised.
    pub fn replay_event_raised(&mut self) -> Result<u64, JournalError> {
        match self.replay_take(|e| match e {
            Event::EventRaised { ns } => Some(*ns),
            _ => None,
        })? {
            Some(ns) => Ok(ns),
            None => {
                let found = "a guest event that the recording did not see".to_owned();
                Err(self.divergence(Some(Event::EventRaised { ns: 0 }), found))
            }
        }
    }

    /// Records that disk completions up to `completed` were published
    /// after the last exit.
    pub fn record_disk_done(&mut self, completed: u64) -> Result<(), JournalError> {
        self.record_after(Event::DiskDone { completed })
    }

    /// The divergence for a logged disk completion count the device
    /// cannot reach (it never had that many requests).
    pub fn impossible_disk_done(&mut self, completed: u64, submitted: u64) -> JournalError {
        let found = format!("disk has {submitted} requests, cannot complete {completed}");
        self.divergence(Some(Event::DiskDone { completed }), found)
    }

    /// Records the network frames made visible after the last exit (their
    /// bytes go to the payload stream).
    pub fn record_net_rx(&mut self, frames: &[Vec<u8>]) -> Result<(), JournalError> {
        let Journal::Record(r) = self else {
            return Ok(());
        };
        let bytes = frames.concat();
        let payload = r.writer.payload(&bytes)?;
        let lens = frames.iter().map(|f| f.len() as u32).collect();
        r.push(Event::NetRx { payload, lens })
    }

    /// At replay, the next input the recording made visible after the last
    /// exit (disk completions, network frames), if there is one more.
    pub fn replay_input(&mut self) -> Result<Option<Input>, JournalError> {
        let Journal::Replay(r) = self else {
            return Ok(None);
        };
        let input = match r.peek()? {
            Some(Event::DiskDone { completed }) => Input::Disk(*completed),
            Some(Event::NetRx { payload, lens }) => {
                let (payload, lens) = (*payload, lens.clone());
                let bytes = r.reader.payload(payload)?;
                let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
                if total != bytes.len() as u64 {
                    let found = format!(
                        "the frames' lengths add up to {total} bytes, the payload has {}",
                        bytes.len()
                    );
                    let expected = r.peeked.clone();
                    return Err(r.diverged(expected, found));
                }
                let mut frames = Vec::with_capacity(lens.len());
                let mut at = 0usize;
                for len in lens {
                    let end = at + len as usize;
                    frames.push(bytes[at..end].to_vec());
                    at = end;
                }
                Input::Net(frames)
            }
            _ => return Ok(None),
        };
        r.last_input = r.next()?;
        Ok(Some(input))
    }

    /// The divergence for logged network frames the device cannot deliver
    /// (`why`: too few receive buffers, a size the guest does not accept).
    pub fn undeliverable_frames(&mut self, frames: &[Vec<u8>], why: String) -> JournalError {
        let found = format!("{} frames cannot be delivered: {why}", frames.len());
        let expected = match self {
            Journal::Replay(r) => r.last_input.clone(),
            _ => None,
        };
        self.divergence(expected, found)
    }

    /// Records an interrupt injected after the last exit.
    pub fn record_interrupt(&mut self, vector: u8) -> Result<(), JournalError> {
        self.record_after(Event::Interrupt { vector })
    }

    /// At replay, the interrupt to inject after the last exit, if any.
    pub fn replay_interrupt(&mut self) -> Result<Option<u8>, JournalError> {
        self.replay_take(|e| match e {
            Event::Interrupt { vector } => Some(*vector),
            _ => None,
        })
    }

    /// At replay, whether something that wakes a halted guest (an
    /// interrupt, disk completions) is logged after the last exit.
    pub fn replay_wakeup_due(&mut self) -> Result<bool, JournalError> {
        let Journal::Replay(r) = self else {
            return Ok(false);
        };
        Ok(matches!(
            r.peek()?,
            Some(Event::Interrupt { .. } | Event::DiskDone { .. } | Event::NetRx { .. })
        ))
    }

    /// The divergence for a logged interrupt the vCPU cannot take now.
    pub fn replay_uninjectable(&mut self, vector: u8, exception_pending: bool) -> JournalError {
        let found = format!(
            "vCPU cannot take interrupt {vector:#x} here{}",
            if exception_pending {
                " (an exception is being delivered)"
            } else {
                " (interrupts disabled or shadowed)"
            }
        );
        self.divergence(Some(Event::Interrupt { vector }), found)
    }

    /// At replay, checks that the guest ended the way the recording did.
    pub fn replay_end(&mut self, reason: &EndReason) -> Result<(), JournalError> {
        let Journal::Replay(r) = self else {
            return Ok(());
        };
        match r.next()? {
            Some(Event::End(e)) if &e == reason => Ok(()),
            None => Ok(()),
            other => Err(r.diverged(other, format!("end: {reason}"))),
        }
    }

    /// Hands complete frames to the OS now and then.
    pub fn housekeeping(&mut self) -> Result<(), JournalError> {
        if let Journal::Record(r) = self {
            if r.last_flush.elapsed() >= FLUSH_INTERVAL {
                r.writer.flush()?;
                r.last_flush = Instant::now();
            }
        }
        Ok(())
    }

    pub fn progress(&self) -> Progress {
        match self {
            Journal::Live => Progress::default(),
            Journal::Record(r) => Progress {
                exits: r.exits,
                events: r.events,
                guest_ns: r.guest_ns,
                trace_bytes: r.writer.bytes_written(),
            },
            Journal::Replay(r) => Progress {
                exits: r.exits,
                events: r.events,
                guest_ns: r.guest_ns,
                trace_bytes: 0,
            },
        }
    }

    /// The divergence for a replayed guest that halted where the log has
    /// nothing to wake it.
    pub fn halted_without_interrupt(&mut self, rip: u64) -> JournalError {
        let expected = match self {
            Journal::Replay(r) => r.peek().ok().flatten().cloned(),
            _ => None,
        };
        self.divergence(
            expected,
            format!("guest halted at rip {rip:#x} with no interrupt due"),
        )
    }
}

/// The registers, for divergence reports.
pub fn regs_text(r: &kvm_bindings::kvm_regs) -> String {
    format!(
        "rip {:#x} rflags {:#x} rax {:#x} rbx {:#x} rcx {:#x} rdx {:#x} rsi {:#x} rdi {:#x} \
         rsp {:#x} rbp {:#x} r8 {:#x} r9 {:#x} r10 {:#x} r11 {:#x} r12 {:#x} r13 {:#x} \
         r14 {:#x} r15 {:#x}",
        r.rip,
        r.rflags,
        r.rax,
        r.rbx,
        r.rcx,
        r.rdx,
        r.rsi,
        r.rdi,
        r.rsp,
        r.rbp,
        r.r8,
        r.r9,
        r.r10,
        r.r11,
        r.r12,
        r.r13,
        r.r14,
        r.r15
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_regs;

    fn temp_trace(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("insight-journal-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn header(digest_interval: u64) -> trace::Header {
        trace::Header {
            clock: trace::ClockKind::Exit,
            created_unix_secs: 0,
            guest_cpuid: vec![],
            kvm_caps: vec![],
            user_rdtsc_traps: false,
            config: String::new(),
            images: vec![],
            boot: trace::BootParams {
                cmdline: String::new(),
                memory_mib: 16,
                rng_seed: vec![0; 32],
                extra_initramfs: vec![],
                net: None,
            },
            digest_interval,
        }
    }

    fn regs(rip: u64, rax: u64) -> kvm_regs {
        kvm_regs {
            rip,
            rax,
            ..Default::default()
        }
    }

    fn port_in(port: u16, rip: u64, value: u32) -> Event {
        Event::In {
            port,
            size: 1,
            rip,
            value,
        }
    }

    /// Records a small run: reads, a write, an interrupt, a halt.
    fn record(dir: &std::path::Path, complete: bool) {
        let writer = TraceWriter::create(dir, &header(2)).unwrap();
        let mut j = Journal::Record(Box::new(Recorder::new(writer, 2)));
        j.exit(port_in(0x40, 0x100, 7), &regs(0x100, 1)).unwrap();
        j.exit(port_in(0x40, 0x104, 9), &regs(0x104, 2)).unwrap();
        j.record_interrupt(0x30).unwrap();
        j.exit(serial_out(b'A'), &regs(0x200, 3)).unwrap();
        j.exit(Event::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
        j.record_interrupt(0x30).unwrap();
        let Journal::Record(r) = j else {
            unreachable!()
        };
        if complete {
            r.finish(EndReason::CommandExited(3)).unwrap();
        } else {
            let mut w = r.writer;
            w.flush().unwrap();
        }
    }

    fn replayer(dir: &std::path::Path) -> Journal {
        Journal::Replay(Box::new(Replayer::new(TraceReader::open(dir).unwrap())))
    }

    /// Replays one read exit the way dispatch and the vCPU loop do.
    fn replay_read(j: &mut Journal, port: u16, rip: u64, rax: u64) -> Result<u32, JournalError> {
        let observed = port_in(port, 0, 0);
        let value = match j.replay_read(&observed)? {
            Some(Event::In { value, .. }) => value,
            other => panic!("no logged read: {other:?}"),
        };
        j.exit(port_in(port, rip, value), &regs(rip, rax))?;
        Ok(value)
    }

    fn serial_out(byte: u8) -> Event {
        Event::Out {
            port: 0x3f8,
            size: 1,
            rip: 0x200,
            value: byte.into(),
        }
    }

    /// Replays the two reads and the interrupt of `record`.
    fn replay_reads(j: &mut Journal) {
        replay_read(j, 0x40, 0x100, 1).unwrap();
        replay_read(j, 0x40, 0x104, 2).unwrap();
        assert_eq!(j.replay_interrupt().unwrap(), Some(0x30));
    }

    /// Replays all of `record`'s exits faithfully.
    fn replay_all(j: &mut Journal) {
        replay_reads(j);
        j.exit(serial_out(b'A'), &regs(0x200, 3)).unwrap();
        j.exit(Event::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
        assert!(j.replay_wakeup_due().unwrap());
        assert_eq!(j.replay_interrupt().unwrap(), Some(0x30));
    }

    fn diverged_at(e: JournalError) -> u64 {
        match e {
            JournalError::Diverged(d) => d.exit,
            other => panic!("expected a divergence, got {other}"),
        }
    }

    #[test]
    fn faithful_replay_gets_logged_values_and_interrupts() {
        let dir = temp_trace("faithful");
        record(&dir, true);
        let mut j = replayer(&dir);
        assert_eq!(replay_read(&mut j, 0x40, 0x100, 1).unwrap(), 7);
        assert_eq!(j.replay_interrupt().unwrap(), None);
        assert_eq!(replay_read(&mut j, 0x40, 0x104, 2).unwrap(), 9);
        assert_eq!(j.replay_interrupt().unwrap(), Some(0x30));
        j.exit(serial_out(b'A'), &regs(0x200, 3)).unwrap();
        j.exit(Event::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
        assert!(j.replay_wakeup_due().unwrap());
        assert_eq!(j.replay_interrupt().unwrap(), Some(0x30));
        let Journal::Replay(r) = &mut j else {
            unreachable!()
        };
        assert_eq!(r.end_reached().unwrap(), Some(EndReason::CommandExited(3)));
        j.replay_end(&EndReason::CommandExited(3)).unwrap();
        assert_eq!(j.progress().exits, 4);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn inputs_replay_in_their_recorded_order_with_their_payloads() {
        let dir = temp_trace("inputs");
        let frames = vec![vec![1u8; 60], vec![2u8; 1514]];
        {
            let writer = TraceWriter::create(&dir, &header(64)).unwrap();
            let mut j = Journal::Record(Box::new(Recorder::new(writer, 64)));
            j.exit(Event::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
            j.record_net_rx(&frames).unwrap();
            j.record_disk_done(1).unwrap();
            j.record_net_rx(&frames[1..]).unwrap();
            j.record_interrupt(0x26).unwrap();
            let Journal::Record(r) = j else {
                unreachable!()
            };
            r.finish(EndReason::PowerOff).unwrap();
        }
        let mut j = replayer(&dir);
        j.exit(Event::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
        assert!(j.replay_wakeup_due().unwrap());
        assert_eq!(j.replay_interrupt().unwrap(), None);
        assert_eq!(j.replay_input().unwrap(), Some(Input::Net(frames.clone())));
        assert_eq!(j.replay_input().unwrap(), Some(Input::Disk(1)));
        assert_eq!(
            j.replay_input().unwrap(),
            Some(Input::Net(frames[1..].to_vec()))
        );
        assert_eq!(j.replay_input().unwrap(), None);
        assert_eq!(j.replay_interrupt().unwrap(), Some(0x26));

        // A payload cut short: an error naming the payload, no panic.
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("payloads"))
            .unwrap()
            .set_len(100)
            .unwrap();
        let mut j = replayer(&dir);
        j.exit(Event::Halt { rip: 0x300 }, &regs(0x300, 4)).unwrap();
        match j.replay_input() {
            Err(JournalError::Trace(e)) => {
                let text = format!(
                    "{e}: {}",
                    std::error::Error::source(&e).map_or(String::new(), |s| s.to_string())
                );
                assert!(text.contains("payload"), "{text}");
            }
            other => panic!(
                "a cut payload was accepted: {:?}",
                other.map(|i| i.is_some())
            ),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mismatches_are_reported_at_their_exit() {
        let dir = temp_trace("mismatch");
        record(&dir, true);

        // Another port at exit 1.
        let mut j = replayer(&dir);
        assert_eq!(
            diverged_at(replay_read(&mut j, 0x41, 0x100, 1).unwrap_err()),
            1
        );

        // Another RIP at exit 2: found once the RIP is known.
        let mut j = replayer(&dir);
        replay_read(&mut j, 0x40, 0x100, 1).unwrap();
        assert_eq!(
            diverged_at(replay_read(&mut j, 0x40, 0x999, 2).unwrap_err()),
            2
        );

        // Other registers at exit 2 (digested every 2 exits).
        let mut j = replayer(&dir);
        replay_read(&mut j, 0x40, 0x100, 1).unwrap();
        assert_eq!(
            diverged_at(replay_read(&mut j, 0x40, 0x104, 99).unwrap_err()),
            2
        );

        // Another value written at exit 3.
        let mut j = replayer(&dir);
        replay_reads(&mut j);
        let err = j.exit(serial_out(b'B'), &regs(0x200, 3)).unwrap_err();
        assert_eq!(diverged_at(err), 3);

        // A different end.
        let mut j = replayer(&dir);
        replay_all(&mut j);
        assert!(j.replay_end(&EndReason::PowerOff).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_incomplete_trace_ends_where_its_log_does() {
        let dir = temp_trace("incomplete");
        record(&dir, false);
        let mut j = replayer(&dir);
        let Journal::Replay(r) = &j else {
            unreachable!()
        };
        assert!(!r.trace_complete());
        replay_all(&mut j);
        let Journal::Replay(r) = &mut j else {
            unreachable!()
        };
        assert!(r.log_exhausted().unwrap());
        assert_eq!(r.end_reached().unwrap(), None);
        // The guest going on past the log is a divergence, never a panic.
        assert_eq!(
            diverged_at(
                j.exit(Event::Halt { rip: 0x300 }, &regs(0x300, 4))
                    .unwrap_err()
            ),
            5
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn digests_depend_on_every_register() {
        let base = register_digest(&regs(1, 2));
        let mut r = regs(1, 2);
        r.r15 = 1;
        assert_ne!(register_digest(&r), base);
        let mut r = regs(1, 2);
        r.rflags = 2;
        assert_ne!(register_digest(&r), base);
        assert_eq!(register_digest(&regs(1, 2)), base);
    }
}
