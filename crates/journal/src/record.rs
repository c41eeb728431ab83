//! Recording: every deterministic exit, and what the VMM did after it, is
//! appended to the trace.

use std::time::{Duration, Instant};

use trace::{Summary, TraceWriter};

use super::entry::register_digest;
use super::{EndReason, Entry, Journal, JournalError, Progress};
use crate::preempt::AsyncPoint;

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
    pub(super) guest_ns: u64,
}

impl Recorder {
    /// Records into `writer`, digesting registers every `digest_interval`
    /// exits (as its header says).
    pub fn new(writer: TraceWriter<Entry>, digest_interval: u64) -> Self {
        Recorder {
            writer,
            digest_interval: digest_interval.max(1),
            exits: 0,
            entries: 0,
            async_points: 0,
            last_flush: Instant::now(),
            guest_ns: 0,
        }
    }

    fn push(&mut self, entry: Entry) -> Result<(), JournalError> {
        self.entries += 1;
        self.writer.push(entry)?;
        Ok(())
    }

    /// Logs deterministic exit `observed`, and the registers' digest when
    /// one is due.
    pub(super) fn exit(
        &mut self,
        observed: Entry,
        regs: &kvm_bindings::kvm_regs,
    ) -> Result<(), JournalError> {
        self.exits += 1;
        let digest = self.exits.is_multiple_of(self.digest_interval);
        self.push(observed)?;
        if digest {
            self.push(Entry::Registers {
                digest: register_digest(regs),
            })?;
        }
        Ok(())
    }

    /// Hands complete frames to the OS now and then.
    pub(super) fn housekeeping(&mut self) -> Result<(), JournalError> {
        if self.last_flush.elapsed() >= FLUSH_INTERVAL {
            self.writer.flush()?;
            self.last_flush = Instant::now();
        }
        Ok(())
    }

    pub(super) fn progress(&self) -> Progress {
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
        Ok(self.writer.finish()?)
    }

    /// Hands everything written so far to the OS without marking the
    /// trace complete, as a killed recorder would leave it.
    #[cfg(test)]
    pub(super) fn abandon(mut self) {
        self.writer.flush().unwrap();
    }
}

/// What the VMM did after an exit, logged when recording (nothing
/// otherwise).
impl Journal {
    /// Records an entry about the last exit (an interrupt, completions).
    fn record_after(&mut self, entry: Entry) -> Result<(), JournalError> {
        if let Journal::Record(r) = self {
            r.push(entry)?;
        }
        Ok(())
    }

    /// Records an interrupt injected after the last exit.
    pub fn record_interrupt(&mut self, vector: u8) -> Result<(), JournalError> {
        self.record_after(Entry::Interrupt { vector })
    }

    /// Records when the guest raised an event at the last exit.
    pub fn record_event_raised(&mut self, ns: u64) -> Result<(), JournalError> {
        self.record_after(Entry::EventRaised { ns })
    }

    /// Records that disk completions up to `completed` were published
    /// after the last exit.
    pub fn record_disk_done(&mut self, completed: u64) -> Result<(), JournalError> {
        self.record_after(Entry::DiskDone { completed })
    }

    /// Records an asynchronous point: the interrupt injected next, and any
    /// inputs made visible with it, belong to it.
    pub fn record_async_point(&mut self, point: AsyncPoint) -> Result<(), JournalError> {
        if let Journal::Record(r) = self {
            r.async_points += 1;
            r.push(Entry::AsyncPoint(Box::new(point)))?;
        }
        Ok(())
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
        r.push(Entry::NetRx { payload, lens })
    }
}
