//! Replay: the guest re-executes from the same initial state while the
//! log is walked in lockstep. Every exit must match the next logged one,
//! every read returns the logged value, inputs and interrupts are made
//! visible where they were, and the first mismatch stops replay with a
//! [`Divergence`].

use std::collections::VecDeque;
use std::fmt;

use trace::objects::ObjectReader;
use trace::{Header, TraceError, TraceReader};

use super::entry::{register_digest, rip_of};
use super::{clock_read, EndReason, Entry, Input, JournalError, Progress};
use crate::preempt::{AsyncPoint, SampleMark};

/// A position in the log, and the counts replay had reached there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LogPosition {
    /// Entries taken: the index of the next one.
    pub entry: u64,
    /// Deterministic exits so far.
    pub exits: u64,
    pub async_points: u64,
    /// The last guest clock value read.
    pub guest_ns: u64,
}

/// A position in a recording.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayPoint {
    /// A deterministic exit's ordinal.
    Exit(u64),
    /// Recorded guest time (ns): the first exit where the guest clock
    /// has reached it.
    GuestNs(u64),
}

impl std::fmt::Display for ReplayPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            ReplayPoint::Exit(e) => write!(f, "exit {e}"),
            ReplayPoint::GuestNs(ns) => write!(f, "guest time {:.3} s", ns as f64 / 1e9),
        }
    }
}

impl ReplayPoint {
    /// Whether replay at `position` has reached this point.
    pub fn reached(&self, position: &LogPosition) -> bool {
        match *self {
            ReplayPoint::Exit(e) => position.exits >= e,
            ReplayPoint::GuestNs(ns) => position.guest_ns >= ns,
        }
    }
}

pub struct Replayer {
    reader: TraceReader<Entry>,
    peeked: Option<Entry>,
    /// The exit entry matched for the exit in progress, if taken early
    /// (reads take theirs before the RIP is known).
    current: Option<Entry>,
    exits: u64,
    entries: u64,
    async_points: u64,
    guest_ns: u64,
    /// The log ran out (an incomplete trace).
    exhausted: bool,
    /// The input entry `replay_input` took last.
    last_input: Option<Entry>,
    /// Nothing follows the log's end entry.
    end_checked: bool,
    /// Whether the recording's sample marks are wanted (else they are
    /// passed over as they are read).
    take_marks: bool,
    /// Sample marks read and not yet taken: they come before `peeked`.
    marks: VecDeque<SampleMark>,
    /// Sample marks passed by (the next exit, or the entry after them, was
    /// taken first).
    marks_missed: u64,
    /// The recording's time at the last mark found in user code, if it is
    /// later than the last clock read (`event_ns`).
    mark_ns: Option<u64>,
    /// The host files the recording's guest read.
    objects: ObjectReader,
}

/// What replay looks for next between exits: a recorded sample's position
/// or an asynchronous point (the log's order).
#[derive(Clone, Debug)]
pub enum Sought {
    Mark(SampleMark),
    Point(Box<AsyncPoint>),
}

impl Replayer {
    pub fn new(reader: TraceReader<Entry>) -> Self {
        let trace_dir = reader.dir().to_owned();
        Replayer {
            reader,
            peeked: None,
            current: None,
            exits: 0,
            entries: 0,
            async_points: 0,
            guest_ns: 0,
            exhausted: false,
            last_input: None,
            end_checked: false,
            take_marks: false,
            marks: VecDeque::new(),
            marks_missed: 0,
            mark_ns: None,
            objects: ObjectReader::new(&trace_dir),
        }
    }

    /// Returns the recording's sample marks (`sought`) instead of passing
    /// over them.
    pub fn take_sample_marks(&mut self) {
        self.take_marks = true;
    }

    /// Where replay stands in the log (between exits: no exit entry
    /// taken early).
    pub fn position(&self) -> LogPosition {
        LogPosition {
            entry: self.entries,
            exits: self.exits,
            async_points: self.async_points,
            guest_ns: self.guest_ns,
        }
    }

    /// Goes on from `at` (a checkpoint's position) instead of the start.
    pub fn seek(&mut self, at: &LogPosition) -> Result<(), JournalError> {
        self.reader.seek_event(at.entry)?;
        self.entries = at.entry;
        self.exits = at.exits;
        self.async_points = at.async_points;
        self.guest_ns = at.guest_ns;
        self.peeked = None;
        self.current = None;
        self.exhausted = false;
        self.last_input = None;
        self.marks.clear();
        self.mark_ns = None;
        Ok(())
    }

    /// Whether the trace was marked complete by its recorder.
    pub fn trace_complete(&self) -> bool {
        self.reader.complete.is_some()
    }

    /// The next entry other than a sample mark (marks read on the way are
    /// kept, in order, if wanted).
    fn peek(&mut self) -> Result<Option<&Entry>, JournalError> {
        while self.peeked.is_none() && !self.exhausted {
            match self.reader.next_event()? {
                Some(Entry::Sample(mark)) if self.take_marks => self.marks.push_back(*mark),
                Some(Entry::Sample(_)) => self.entries += 1,
                // The time at the exit before it: taken on the way.
                Some(Entry::Time { ns }) => {
                    self.entries += 1;
                    self.time_reached(ns);
                }
                Some(e) => self.peeked = Some(e),
                None => self.exhausted = true,
            }
        }
        Ok(self.peeked.as_ref())
    }

    /// Takes the next entry other than a sample mark; marks before it not
    /// taken yet were missed (a position is the index of the first entry
    /// not taken).
    fn next(&mut self) -> Result<Option<Entry>, JournalError> {
        self.peek()?;
        let e = self.peeked.take();
        if e.is_some() {
            let missed = self.marks.len() as u64;
            self.marks.clear();
            self.marks_missed += missed;
            self.entries += missed + 1;
        }
        Ok(e)
    }

    fn diverged(&self, expected: Option<Entry>, found: String) -> JournalError {
        self.diverged_at(self.exits, expected, found)
    }

    fn diverged_at(&self, exit: u64, expected: Option<Entry>, found: String) -> JournalError {
        JournalError::Diverged(Box::new(Divergence {
            exit,
            expected,
            found,
            state: String::new(),
        }))
    }

    /// Takes the log entry for exit `ordinal`, which must be the same kind
    /// of exit as `observed` (whose RIP may not be known yet).
    fn take_exit(&mut self, observed: &Entry, ordinal: u64) -> Result<Entry, JournalError> {
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
        let complete = self.trace_complete();
        let logged = match self.peek()? {
            Some(e) if e.is_exit() => self.next()?.unwrap_or_else(|| observed.clone()),
            // A killed recorder's log may end anywhere after an exit: the
            // replay ends where it does, whatever came in between (an
            // interrupt delivered, a mark reached).
            None if !complete => return Err(JournalError::LogEnded),
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
        let reason = match self.peek()? {
            Some(Entry::End(reason)) => reason.clone(),
            _ => return Ok(None),
        };
        // The end is the last entry: anything after it is damage, and
        // reading on to the end of the log checks a complete trace's
        // counts.
        if !self.end_checked {
            if let Some(after) = self.reader.next_event()? {
                return Err(TraceError::Damaged {
                    path: self.reader.dir().to_owned(),
                    at: format!("entry {} of its log", self.entries + 1),
                    message: format!("the log goes on after its end entry ({after})"),
                }
                .into());
            }
            self.end_checked = true;
        }
        Ok(Some(reason))
    }

    /// Whether the log has run out without an end entry.
    pub fn log_exhausted(&mut self) -> Result<bool, JournalError> {
        Ok(self.peek()?.is_none())
    }
    /// Checks deterministic exit `observed` (RIP set; for reads, with the
    /// value the guest got) against the log, and the registers `regs` at
    /// it against the logged digest when one is due.
    pub fn exit(
        &mut self,
        observed: Entry,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), JournalError> {
        if let Some(ns) = clock_read(&observed) {
            self.time_reached(ns);
        }
        let ordinal = self.exits + 1;
        let logged = match self.current.take() {
            Some(l) => l,
            None => self.take_exit(&observed, ordinal)?,
        };
        self.exits = ordinal;
        if logged != observed {
            return Err(self.diverged(Some(logged), observed.to_string()));
        }
        if self
            .exits
            .is_multiple_of(self.reader.header.digest_interval.max(1))
        {
            let digest = register_digest(regs);
            match self.next()? {
                Some(Entry::Registers { digest: d }) if d == digest => {}
                // A killed recorder may have written the exit but not its
                // digest: the prefix ends here.
                None if !self.trace_complete() => {}
                other => {
                    return Err(self.diverged(
                        other,
                        format!("registers digest {digest:016x} ({})", regs_text(regs)),
                    ))
                }
            }
        }
        // The exit's time, if logged, times what the guest raises next.
        self.peek()?;
        Ok(())
    }

    /// The recorded run had reached `ns` here.
    fn time_reached(&mut self, ns: u64) {
        self.guest_ns = ns;
        // A time after a mark is a later one (in a trace that says
        // otherwise, the times still never decrease).
        self.mark_ns = self.mark_ns.filter(|&m| m > ns);
    }

    /// Checks the console output the last exit wrote (`written`: its
    /// length and digest, `None` if it wrote none) against the log.
    pub fn console_out(&mut self, written: Option<(u64, u64)>) -> Result<(), JournalError> {
        let logged = self.take(|e| match e {
            Entry::ConsoleOut { bytes, digest } => Some((*bytes, *digest)),
            _ => None,
        })?;
        if logged == written {
            return Ok(());
        }
        // A killed recorder may have written the exit but not what followed.
        if logged.is_none() && self.peek()?.is_none() && !self.trace_complete() {
            return Ok(());
        }
        let expected = match logged {
            Some((bytes, digest)) => Some(Entry::ConsoleOut { bytes, digest }),
            None => self.peek()?.cloned(),
        };
        let found = match written {
            Some((bytes, digest)) => {
                format!("console output, {bytes} bytes, digest {digest:016x}")
            }
            None => "no console output".to_owned(),
        };
        Err(self.diverged(expected, found))
    }

    /// Checks what the last exit wrote of the command's standard stream
    /// `stream` (`bytes` of digest `digest`) against the log; returns
    /// whether the recording's host stream was closed there.
    pub fn stream_out(
        &mut self,
        stream: u8,
        bytes: u64,
        digest: u64,
    ) -> Result<bool, JournalError> {
        let logged = self.take(|e| match e {
            Entry::StreamOut {
                stream,
                bytes,
                digest,
                closed,
            } => Some((*stream, *bytes, *digest, *closed)),
            _ => None,
        })?;
        let found = || {
            format!(
                "{}, {bytes} bytes, digest {digest:016x}",
                crate::entry::stream_name(stream)
            )
        };
        match logged {
            Some((s, b, d, closed)) if (s, b, d) == (stream, bytes, digest) => Ok(closed),
            // A killed recorder may have written the exit but not what
            // followed.
            None if self.peek()?.is_none() && !self.trace_complete() => Ok(false),
            Some((stream, bytes, digest, closed)) => {
                let logged = Entry::StreamOut {
                    stream,
                    bytes,
                    digest,
                    closed,
                };
                Err(self.diverged(Some(logged), found()))
            }
            None => {
                let expected = self.peek()?.cloned();
                Err(self.diverged(expected, found()))
            }
        }
    }

    /// What the recording gave `/init` of the command's standard input at
    /// the last exit, which asked for at most `max` bytes: the bytes, and
    /// whether the input ended after them.
    pub fn stream_in(&mut self, max: usize) -> Result<(Vec<u8>, bool), JournalError> {
        let logged = self.take(|e| match e {
            Entry::StreamIn { bytes, end } => Some((bytes.clone(), *end)),
            _ => None,
        })?;
        let found = || format!("standard input asked for, at most {max} bytes");
        match logged {
            Some((bytes, end)) if bytes.len() <= max => Ok((bytes, end)),
            Some((bytes, end)) => Err(self.diverged(Some(Entry::StreamIn { bytes, end }), found())),
            None if self.peek()?.is_none() && !self.trace_complete() => Err(JournalError::LogEnded),
            None => {
                let expected = self.peek()?.cloned();
                Err(self.diverged(expected, found()))
            }
        }
    }

    pub fn progress(&self) -> Progress {
        Progress {
            exits: self.exits,
            entries: self.entries,
            async_points: self.async_points,
            guest_ns: self.guest_ns,
            trace_bytes: 0,
        }
    }

    /// The reply the host's files gave, at the recording, to `request`
    /// (made available at the last exit): from the log and, for a read,
    /// the trace's stored file. (A reply larger than the guest's buffers
    /// is not written, at the recording as at replay.)
    pub fn host_files(&mut self, request: &[u8]) -> Result<Vec<u8>, JournalError> {
        let digest = crate::entry::output_digest(request);
        let found = || {
            format!(
                "a host-files request of {} bytes, digest {digest:016x}",
                request.len()
            )
        };
        let logged = self.take(|e| match e {
            Entry::HostFiles { .. } | Entry::HostFileRead { .. } => Some(e.clone()),
            _ => None,
        })?;
        let reply = match &logged {
            Some(Entry::HostFiles { request: r, reply }) if *r == digest => {
                self.reader.payload(*reply)?
            }
            Some(Entry::HostFileRead {
                request: r,
                object,
                offset,
                count,
            }) if *r == digest => {
                let bytes = self.objects.get(object)?;
                let start = usize::try_from(*offset).unwrap_or(usize::MAX);
                let Some(data) = start
                    .checked_add(*count as usize)
                    .and_then(|end| bytes.get(start..end))
                else {
                    let why = format!(
                        "{found}, answered with {count} bytes at {offset} of a stored file of {} bytes",
                        bytes.len(),
                        found = found()
                    );
                    return Err(self.diverged(logged, why));
                };
                let tag = devices_tag(request);
                let mut reply = read_header(tag, *count).to_vec();
                reply.extend_from_slice(data);
                reply
            }
            // A log cut short by a killed recorder: the replay ends here
            // (the guest cannot go on without the reply).
            None if self.peek()?.is_none() && !self.trace_complete() => {
                return Err(JournalError::LogEnded)
            }
            None => {
                let expected = self.peek()?.cloned();
                return Err(self.diverged(expected, found()));
            }
            Some(_) => return Err(self.diverged(logged, found())),
        };
        Ok(reply)
    }
}

/// A 9P message's tag (0xffff, NOTAG, if it has none).
fn devices_tag(message: &[u8]) -> u16 {
    match message.get(5..7) {
        Some(t) => u16::from_le_bytes([t[0], t[1]]),
        None => u16::MAX,
    }
}

/// The header of a 9P `Rread` of `count` bytes: size[4] type[1] tag[2]
/// count[4].
fn read_header(tag: u16, count: u32) -> [u8; 11] {
    const RREAD: u8 = 117;
    let mut h = [0u8; 11];
    h[..4].copy_from_slice(&(11 + count).to_le_bytes());
    h[4] = RREAD;
    h[5..7].copy_from_slice(&tag.to_le_bytes());
    h[7..].copy_from_slice(&count.to_le_bytes());
    h
}

/// What replay takes from the log after an exit, and the divergences
/// found there.
impl Replayer {
    /// The logged result of the read `observed` (an exit entry whose RIP
    /// is not known yet).
    pub fn read(&mut self, observed: &Entry) -> Result<Entry, JournalError> {
        let logged = self.take_exit(observed, self.exits + 1)?;
        self.current = Some(logged.clone());
        Ok(logged)
    }

    /// Takes the next entry about the last exit if `pick` accepts it.
    fn take<T>(&mut self, pick: impl Fn(&Entry) -> Option<T>) -> Result<Option<T>, JournalError> {
        let Some(value) = self.peek()?.and_then(pick) else {
            return Ok(None);
        };
        self.next()?;
        Ok(Some(value))
    }

    /// The sample mark or asynchronous point the log has next, if it has
    /// one before the next exit (left in the log until it is reached, or
    /// the mark `sample_mark_done`).
    pub fn sought(&mut self) -> Result<Option<Sought>, JournalError> {
        self.peek()?;
        if let Some(mark) = self.marks.front() {
            return Ok(Some(Sought::Mark(mark.clone())));
        }
        Ok(match &self.peeked {
            Some(Entry::AsyncPoint(p)) => Some(Sought::Point(p.clone())),
            _ => None,
        })
    }

    /// The sample mark `sought` returned was taken (`taken`), or given up.
    pub fn sample_mark_done(&mut self, taken: bool) {
        if self.marks.pop_front().is_some() {
            self.entries += 1;
            self.marks_missed += u64::from(!taken);
        }
    }

    /// A sample mark the recording took in user code was found where it
    /// was taken (the mark `sought` returned; `sample_mark_done` follows):
    /// events from here on happened at its time or later.
    pub fn mark_found(&mut self) {
        if let Some(mark) = self.marks.front() {
            self.mark_ns = Some(mark.ns.max(self.guest_ns));
        }
    }

    /// The recording's time for an event raised now: the last time replay
    /// knows the recorded run had reached, the last clock value the guest
    /// read or the last mark found in user code, whichever is later.
    /// Deterministic, and never decreasing.
    pub fn event_ns(&self) -> u64 {
        self.mark_ns.unwrap_or(self.guest_ns)
    }

    /// Whether a mark found since the last clock read holds `event_ns`
    /// ahead of `position().guest_ns`: a checkpoint taken now would lose
    /// it (a replay from there would time its first events earlier).
    pub fn mark_time_pending(&self) -> bool {
        self.mark_ns.is_some()
    }

    /// How many sample marks replay passed by without taking them.
    pub fn sample_marks_missed(&self) -> u64 {
        self.marks_missed
    }

    /// The asynchronous point the log has next was reached: what follows
    /// it in the log is delivered now.
    pub fn async_point_reached(&mut self) -> Result<(), JournalError> {
        if let Some(Entry::AsyncPoint(_)) = self.peek()? {
            self.next()?;
            self.async_points += 1;
        }
        Ok(())
    }

    /// The divergence for an asynchronous point replay did not reach:
    /// `why` says what happened instead.
    pub fn async_point_missed(&mut self, why: String) -> JournalError {
        let expected = self.peek().ok().flatten().cloned();
        self.diverged(expected, why)
    }

    /// The interrupt to inject after the last exit, if any.
    pub fn interrupt(&mut self) -> Result<Option<u8>, JournalError> {
        self.take(|e| match e {
            Entry::Interrupt { vector } => Some(*vector),
            _ => None,
        })
    }

    /// Whether something that wakes a halted guest (an interrupt, disk
    /// completions) is logged after the last exit.
    pub fn wakeup_due(&mut self) -> Result<bool, JournalError> {
        Ok(matches!(
            self.peek()?,
            Some(
                Entry::Interrupt { .. }
                    | Entry::DiskDone { .. }
                    | Entry::NetRx { .. }
                    | Entry::ConsoleRx { .. }
                    | Entry::ConsoleSize { .. }
            )
        ))
    }

    /// The divergence for a logged interrupt the vCPU cannot take now.
    pub fn uninjectable(&mut self, vector: u8, exception_pending: bool) -> JournalError {
        let found = format!(
            "vCPU cannot take interrupt {vector:#x} here{}",
            if exception_pending {
                " (an exception is being delivered)"
            } else {
                " (interrupts disabled or shadowed)"
            }
        );
        self.diverged(Some(Entry::Interrupt { vector }), found)
    }

    /// The next input the recording made visible after the last exit
    /// (disk completions, network frames), if there is one more.
    pub fn input(&mut self) -> Result<Option<Input>, JournalError> {
        let input = match self.peek()? {
            Some(Entry::DiskDone { completed }) => Input::Disk(*completed),
            Some(Entry::NetRx { payload, lens }) => {
                let (payload, lens) = (*payload, lens.clone());
                let bytes = self.reader.payload(payload)?;
                let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
                if total != bytes.len() as u64 {
                    let found = format!(
                        "the frames' lengths add up to {total} bytes, the payload has {}",
                        bytes.len()
                    );
                    let expected = self.peeked.clone();
                    return Err(self.diverged(expected, found));
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
            Some(Entry::ConsoleRx { bytes }) => Input::Console(bytes.clone()),
            Some(Entry::ConsoleSize { cols, rows }) => Input::ConsoleSize(*cols, *rows),
            _ => return Ok(None),
        };
        self.last_input = self.next()?;
        Ok(Some(input))
    }

    /// The divergence for logged network frames the device cannot deliver
    /// (`why`: too few receive buffers, a size the guest does not accept).
    pub fn undeliverable_frames(&mut self, frames: &[Vec<u8>], why: String) -> JournalError {
        let found = format!("{} frames cannot be delivered: {why}", frames.len());
        let expected = self.last_input.clone();
        self.diverged(expected, found)
    }

    /// The divergence for logged console input or a terminal size the
    /// guest's virtio console cannot take now: `why`.
    pub fn undeliverable_console(&mut self, why: String) -> JournalError {
        let expected = self.last_input.clone();
        self.diverged(expected, why)
    }

    /// When the recording saw the event the last exit raised.
    pub fn event_raised(&mut self) -> Result<u64, JournalError> {
        match self.take(|e| match e {
            Entry::EventRaised { ns } => Some(*ns),
            _ => None,
        })? {
            Some(ns) => Ok(ns),
            None => {
                let found = "a guest event that the recording did not see".to_owned();
                Err(self.diverged(Some(Entry::EventRaised { ns: 0 }), found))
            }
        }
    }

    /// The divergence for a logged disk completion count the device
    /// cannot reach (it never had that many requests).
    pub fn impossible_disk_done(&mut self, completed: u64, submitted: u64) -> JournalError {
        let found = format!("disk has {submitted} requests, cannot complete {completed}");
        self.diverged(Some(Entry::DiskDone { completed }), found)
    }

    /// Checks that the guest ended the way the recording did.
    pub fn end(&mut self, reason: &EndReason) -> Result<(), JournalError> {
        match self.next()? {
            Some(Entry::End(e)) if &e == reason => Ok(()),
            None => Ok(()),
            other => Err(self.diverged(other, format!("end: {reason}"))),
        }
    }

    /// The divergence for a replayed guest that halted where the log has
    /// nothing to wake it.
    pub fn halted_without_interrupt(&mut self, rip: u64) -> JournalError {
        let expected = self.peek().ok().flatten().cloned();
        self.diverged(
            expected,
            format!("guest halted at rip {rip:#x} with no interrupt due"),
        )
    }
}

/// Replay found the guest doing something other than what was recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// Ordinal of the exit where it showed.
    pub exit: u64,
    /// What the log says (None: the log has nothing more).
    pub expected: Option<Entry>,
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

/// A CPUID entry as a trace header keeps it: (function, index, eax, ebx,
/// ecx, edx).
pub type CpuidEntry = (u32, u32, u32, u32, u32, u32);

/// How this host differs from the recording host in a way replay cannot
/// make up for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostMismatch {
    /// The guest would see another CPU.
    Cpu(String),
    /// KVM lacks a capability the recording relied on, or traps user-mode
    /// RDTSC where the recording host did not (or the other way round).
    Kvm(String),
}

/// Checks this host against the one `header` was recorded on: the CPUID
/// the guest gets, the KVM capabilities, and whether user-mode RDTSC
/// faults (`insight host-check`).
pub fn check_host(
    header: &Header,
    cpuid: &[CpuidEntry],
    kvm_caps: &[(u32, i32)],
    user_rdtsc_traps: bool,
) -> Result<(), HostMismatch> {
    if let Some(d) = cpuid_difference(&header.guest_cpuid, cpuid) {
        return Err(HostMismatch::Cpu(d));
    }
    let kvm = kvm_caps_difference(&header.kvm_caps, kvm_caps)
        .or_else(|| rdtsc_difference(header.user_rdtsc_traps, user_rdtsc_traps));
    match kvm {
        Some(d) => Err(HostMismatch::Kvm(d)),
        None => Ok(()),
    }
}

/// The first CPUID entry that differs between a recording and this host.
fn cpuid_difference(recorded: &[CpuidEntry], now: &[CpuidEntry]) -> Option<String> {
    let show = |e: &CpuidEntry| {
        format!(
            "eax {:#x} ebx {:#x} ecx {:#x} edx {:#x}",
            e.2, e.3, e.4, e.5
        )
    };
    for r in recorded {
        match now.iter().find(|n| (n.0, n.1) == (r.0, r.1)) {
            None => return Some(format!("CPUID leaf {:#x}.{} is gone", r.0, r.1)),
            Some(n) if n != r => {
                return Some(format!(
                    "CPUID leaf {:#x}.{}: recorded {}, now {}",
                    r.0,
                    r.1,
                    show(r),
                    show(n)
                ))
            }
            Some(_) => {}
        }
    }
    now.iter()
        .find(|n| !recorded.iter().any(|r| (r.0, r.1) == (n.0, n.1)))
        .map(|n| format!("CPUID leaf {:#x}.{} is new", n.0, n.1))
}

/// How the recording host and this one differ in trapping user-mode
/// RDTSC, if they do: the guest kernel emulates it only where it traps,
/// reading the logged clock, so a program that reads the TSC would take
/// another path.
fn rdtsc_difference(recorded: bool, now: bool) -> Option<String> {
    let how = |traps: bool| {
        if traps {
            "faults and the guest kernel emulates it"
        } else {
            "runs natively"
        }
    };
    (recorded != now).then(|| {
        format!(
            "user-mode RDTSC {} on the recording host and {} on this one",
            how(recorded),
            how(now)
        )
    })
}

/// A KVM capability the recording host had and this one lacks (a value is
/// a set of bits the recording may have relied on: every bit must still
/// be there).
fn kvm_caps_difference(recorded: &[(u32, i32)], now: &[(u32, i32)]) -> Option<String> {
    recorded.iter().find_map(|&(cap, had)| {
        let has = now.iter().find(|n| n.0 == cap).map_or(0, |n| n.1);
        (had > 0 && has & had != had).then(|| {
            format!("KVM capability {cap} was {had} when recording and is {has} on this host")
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kvm_capability_the_recording_had_must_still_be_there() {
        let recorded = [(1, 1), (2, 7), (3, 0)];
        assert_eq!(
            kvm_caps_difference(&recorded, &[(1, 1), (2, 15), (3, 0)]),
            None
        );
        // Missing altogether, a bit fewer, turned off.
        assert!(
            kvm_caps_difference(&recorded, &[(2, 7)]).is_some_and(|d| d.contains("capability 1"))
        );
        assert!(
            kvm_caps_difference(&recorded, &[(1, 1), (2, 3)]).is_some_and(|d| d.contains("was 7"))
        );
        assert!(kvm_caps_difference(&recorded, &[(1, 0), (2, 7)]).is_some());
        // What the recording did without does not matter.
        assert_eq!(kvm_caps_difference(&recorded, &[(1, 1), (2, 7)]), None);
    }

    #[test]
    fn user_rdtsc_must_be_trapped_at_replay_as_when_recording() {
        assert_eq!(rdtsc_difference(true, true), None);
        assert_eq!(rdtsc_difference(false, false), None);
        let d = rdtsc_difference(true, false).unwrap();
        assert!(
            d.contains("emulates it on the recording host and runs natively on this one"),
            "{d}"
        );
        assert!(rdtsc_difference(false, true)
            .unwrap()
            .contains("runs natively on the recording"));
    }

    #[test]
    fn a_cpuid_leaf_that_changed_appeared_or_went_is_named() {
        let recorded = [(1, 0, 1, 2, 3, 4), (7, 0, 0, 0, 0, 0)];
        assert_eq!(cpuid_difference(&recorded, &recorded), None);
        let changed = [(1, 0, 1, 2, 3, 5), (7, 0, 0, 0, 0, 0)];
        assert!(cpuid_difference(&recorded, &changed).is_some_and(|d| d.contains("leaf 0x1.0")));
        assert!(cpuid_difference(&recorded, &recorded[..1]).is_some_and(|d| d.contains("gone")));
        let more = [recorded[0], recorded[1], (0xd, 1, 0, 0, 0, 0)];
        assert!(cpuid_difference(&recorded, &more).is_some_and(|d| d.contains("0xd.1 is new")));
    }
}
