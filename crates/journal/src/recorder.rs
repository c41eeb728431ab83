//! Recording: every deterministic exit, and what the VMM did after it, is
//! appended to the trace.

use std::time::{Duration, Instant};

use trace::objects::{ObjectDigest, ObjectWriter};
use trace::{Summary, TraceWriter};

use super::entry::register_digest;
use super::{clock_read, EndReason, Entry, JournalError, Progress, TIME_GRAIN_NS};
use crate::preempt::{AsyncPoint, SampleMark};

/// The recorder hands complete frames to the OS at least this often, so a
/// crashed recording loses at most this much of its end.
const FLUSH_INTERVAL: Duration = Duration::from_secs(1);

pub struct Recorder {
    writer: TraceWriter<Entry>,
    digest_interval: u64,
    exits: u64,
    entries: u64,
    async_points: u64,
    last_flush: Instant,
    guest_ns: u64,
    /// The host files the guest read, stored by content.
    objects: ObjectWriter,
}

impl Recorder {
    /// Records into `writer`, digesting registers every `digest_interval`
    /// exits (as its header says).
    pub fn new(writer: TraceWriter<Entry>, digest_interval: u64) -> Self {
        let writer_dir = &writer.dir().to_owned();
        Recorder {
            digest_interval: digest_interval.max(1),
            exits: 0,
            entries: 0,
            async_points: 0,
            last_flush: Instant::now(),
            guest_ns: 0,
            objects: ObjectWriter::new(writer_dir, None),
            writer,
        }
    }

    /// Stores the host files the guest reads once in `shared` (the trace
    /// store's objects), linked into the trace.
    pub fn share_objects(&mut self, shared: std::path::PathBuf) {
        self.objects = ObjectWriter::new(self.writer.dir(), Some(shared));
    }

    /// Compressed bytes of host files this recording stored that were not
    /// stored before.
    pub fn new_object_bytes(&self) -> u64 {
        self.objects.new_bytes()
    }

    fn push(&mut self, entry: Entry) -> Result<(), JournalError> {
        self.entries += 1;
        self.writer.push(entry).map_err(|e| self.failed(e))
    }

    /// What a write that failed now reports: how far the recording got.
    fn failed(&self, source: trace::TraceError) -> JournalError {
        JournalError::Write {
            exits: self.exits,
            guest_ns: self.guest_ns,
            source,
        }
    }

    /// Logs deterministic exit `observed` (RIP set; for reads, with the
    /// value the guest got), the digest of the registers `regs` at it
    /// when one is due, and the VM's time `now_ns` at it where that has
    /// moved on by `TIME_GRAIN_NS` from the latest time the log gives.
    pub fn exit(
        &mut self,
        observed: Entry,
        regs: &kvm_bindings::kvm_regs,
        now_ns: u64,
    ) -> Result<(), JournalError> {
        let read = clock_read(&observed);
        self.exits += 1;
        let digest = self.exits.is_multiple_of(self.digest_interval);
        self.push(observed)?;
        if digest {
            self.push(Entry::Registers {
                digest: register_digest(regs),
            })?;
        }
        match read {
            Some(ns) => self.guest_ns = ns,
            None if now_ns >= self.guest_ns.saturating_add(TIME_GRAIN_NS) => {
                self.push(Entry::Time { ns: now_ns })?;
                self.guest_ns = now_ns;
            }
            None => {}
        }
        Ok(())
    }

    /// Hands complete frames to the OS now and then.
    pub fn housekeeping(&mut self) -> Result<(), JournalError> {
        if self.last_flush.elapsed() >= FLUSH_INTERVAL {
            self.writer.flush().map_err(|e| self.failed(e))?;
            self.last_flush = Instant::now();
        }
        Ok(())
    }

    pub fn progress(&self) -> Progress {
        Progress {
            exits: self.exits,
            entries: self.entries,
            async_points: self.async_points,
            guest_ns: self.guest_ns,
            trace_bytes: self.writer.bytes_written(),
        }
    }

    /// Logs the end and marks the trace complete, saying how many
    /// received network frames never reached the guest.
    pub fn finish(
        mut self,
        reason: EndReason,
        net_rx_dropped: u64,
    ) -> Result<Summary, JournalError> {
        self.push(Entry::End(reason))?;
        self.writer.set_guest_ns(self.guest_ns);
        self.writer.set_net_rx_dropped(net_rx_dropped);
        // `finish` takes the writer: how far the recording got is read first.
        let (exits, guest_ns) = (self.exits, self.guest_ns);
        self.writer.finish().map_err(|source| JournalError::Write {
            exits,
            guest_ns,
            source,
        })
    }

    /// Hands everything written so far to the OS without marking the
    /// trace complete, as a killed recorder would leave it.
    #[cfg(test)]
    pub(super) fn abandon(mut self) {
        self.writer.flush().unwrap();
    }
}

/// What the VMM did after an exit.
impl Recorder {
    /// Records an interrupt injected after the last exit.
    pub fn interrupt(&mut self, vector: u8) -> Result<(), JournalError> {
        self.push(Entry::Interrupt { vector })
    }

    /// Records when the guest raised an event at the last exit.
    pub fn event_raised(&mut self, ns: u64) -> Result<(), JournalError> {
        self.push(Entry::EventRaised { ns })
    }

    /// Records that disk completions up to `completed` were published
    /// after the last exit.
    pub fn disk_done(&mut self, completed: u64) -> Result<(), JournalError> {
        self.push(Entry::DiskDone { completed })
    }

    /// Records an asynchronous point: the interrupt injected next, and any
    /// inputs made visible with it, belong to it.
    pub fn async_point(&mut self, point: AsyncPoint) -> Result<(), JournalError> {
        self.async_points += 1;
        self.push(Entry::AsyncPoint(Box::new(point)))
    }

    /// Records a sample the recording's sampling clock took (replay
    /// collects its thread and stack there).
    pub fn sample(&mut self, mark: SampleMark) -> Result<(), JournalError> {
        self.push(Entry::Sample(Box::new(mark)))
    }

    /// Records the network frames made visible after the last exit (their
    /// bytes go to the payload stream).
    pub fn net_rx(&mut self, frames: &[Vec<u8>]) -> Result<(), JournalError> {
        let bytes = frames.concat();
        let payload = self.writer.payload(&bytes).map_err(|e| self.failed(e))?;
        let lens = frames.iter().map(|f| f.len() as u32).collect();
        self.push(Entry::NetRx { payload, lens })
    }

    /// Records the console output the last exit wrote: how many bytes,
    /// and their digest.
    pub fn console_out(&mut self, bytes: u64, digest: u64) -> Result<(), JournalError> {
        self.push(Entry::ConsoleOut { bytes, digest })
    }

    /// Records what the last exit wrote of the command's standard stream
    /// `stream` (1: output, 2: error): how many bytes, their digest, and
    /// whether the host's stream was `closed`.
    pub fn stream_out(
        &mut self,
        stream: u8,
        bytes: u64,
        digest: u64,
        closed: bool,
    ) -> Result<(), JournalError> {
        self.push(Entry::StreamOut {
            stream,
            bytes,
            digest,
            closed,
        })
    }

    /// Records what the last exit gave `/init` of the command's standard
    /// input (`end`: the host's input ended after these bytes).
    pub fn stream_in(&mut self, bytes: Vec<u8>, end: bool) -> Result<(), JournalError> {
        self.push(Entry::StreamIn { bytes, end })
    }

    /// Records the host files' reply to a request (of FNV-1a digest
    /// `request`) the last exit made available.
    pub fn host_files(&mut self, request: u64, reply: &[u8]) -> Result<(), JournalError> {
        let reply = self.writer.payload(reply).map_err(|e| self.failed(e))?;
        self.push(Entry::HostFiles { request, reply })
    }

    /// Records the host files' answer to a read request: `count` bytes
    /// from `offset` of the file `bytes` (of SHA-256 `object`), which is
    /// stored unless the trace has it.
    pub fn host_file_read(
        &mut self,
        request: u64,
        object: &ObjectDigest,
        bytes: &[u8],
        offset: u64,
        count: u32,
    ) -> Result<(), JournalError> {
        self.objects
            .put(object, bytes)
            .map_err(|e| self.failed(e))?;
        self.push(Entry::HostFileRead {
            request,
            object: *object,
            offset,
            count,
        })
    }

    /// Records typed input made visible to the virtio console after the
    /// last exit.
    pub fn console_rx(&mut self, bytes: Vec<u8>) -> Result<(), JournalError> {
        self.push(Entry::ConsoleRx { bytes })
    }

    /// Records the terminal size the virtio console's driver was told
    /// after the last exit.
    pub fn console_size(&mut self, (cols, rows): (u16, u16)) -> Result<(), JournalError> {
        self.push(Entry::ConsoleSize { cols, rows })
    }
}
