//! A virtio 9P device on the virtio-mmio transport (version 2): the
//! transport of the host's files (`host_files`), mounted by `/init` under
//! the tag [`MOUNT_TAG`].
//!
//! The device answers nothing itself. A notification (a VM exit) only
//! marks its queue; right after the exit the VMM takes the requests
//! ([`Virtio9p::take_requests`]), has each answered (by the host's files
//! when running or recording, from the log when replaying) and completes
//! it ([`Virtio9p::complete`]): reply, used ring and interrupt at that
//! deterministic exit, the same in every run.
//!
//! A chain whose request cannot be read (a writable descriptor first, an
//! address outside guest memory, more than the message size) is completed
//! with nothing written, and counted.

use serde::{Deserialize, Serialize};
use virtio_queue::QueueT;
use vm_memory::GuestMemoryMmap;

use crate::virtio_mmio::{
    self, Desc, DriverRequest, MmioTransport, TransportState, VIRTIO_F_VERSION_1,
};

/// Where the device's registers are in guest physical memory.
pub const MMIO_BASE: u64 = 0xd000_0600;
pub const MMIO_SIZE: u64 = 0x200;
/// Its PIC line.
pub const IRQ: u8 = 3;
/// The tag the guest mounts it by (`mount -t 9p insight-host …`).
pub const MOUNT_TAG: &str = "insight-host";
const DEVICE_ID: u32 = 9;
const VIRTIO_9P_MOUNT_TAG: u64 = 1;
const QUEUE_SIZE: u16 = 128;
/// Largest request read from the guest (the message size it may
/// negotiate; a larger one is malformed).
const MAX_REQUEST_BYTES: usize = crate::host_files::MAX_MSIZE as usize;

/// The kernel command-line text that declares the device.
pub fn kernel_cmdline() -> String {
    virtio_mmio::kernel_cmdline(MMIO_BASE, MMIO_SIZE, IRQ)
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NinePStats {
    pub requests: u64,
    pub reply_bytes: u64,
    /// Chains the guest formed wrongly (completed empty, counted).
    pub bad_requests: u64,
}

/// What a checkpoint keeps of the device: its transport and counts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NinePState {
    pub transport: TransportState,
    pub stats: NinePStats,
}

/// A request taken from the queue, to be answered and completed.
#[derive(Debug)]
pub struct Request {
    head: u16,
    /// The message, or `None` if the chain was malformed.
    pub message: Option<Vec<u8>>,
    reply_to: Vec<Desc>,
    /// Bytes the reply may take.
    pub room: u32,
}

pub struct Virtio9p {
    transport: MmioTransport,
    notified: bool,
    irq: bool,
    stats: NinePStats,
}

impl Default for Virtio9p {
    fn default() -> Self {
        Self::new()
    }
}

impl Virtio9p {
    pub fn new() -> Self {
        Virtio9p {
            transport: MmioTransport::new(
                DEVICE_ID,
                VIRTIO_F_VERSION_1 | VIRTIO_9P_MOUNT_TAG,
                &[QUEUE_SIZE],
            ),
            notified: false,
            irq: false,
            stats: NinePStats::default(),
        }
    }

    pub fn stats(&self) -> NinePStats {
        self.stats
    }

    /// The device's state (it is always at rest between exits).
    pub fn state(&self) -> NinePState {
        NinePState {
            transport: self.transport.state(),
            stats: self.stats,
        }
    }

    pub fn restore(&mut self, state: &NinePState) -> Result<(), String> {
        self.transport.restore(&state.transport)?;
        self.stats = state.stats;
        self.notified = false;
        Ok(())
    }

    /// Whether the device raised its interrupt since the last call.
    pub fn take_irq(&mut self) -> bool {
        std::mem::take(&mut self.irq)
    }

    pub fn mmio_read(&mut self, offset: u64, data: &mut [u8]) {
        self.transport.read(offset, data, &config_space());
    }

    pub fn mmio_write(&mut self, offset: u64, data: &[u8], mem: &GuestMemoryMmap) {
        match self.transport.write(offset, data, mem) {
            DriverRequest::Notify(0) => self.notified = true,
            DriverRequest::Reset => self.notified = false,
            _ => {}
        }
    }

    /// The requests the guest made available, if it notified the queue
    /// since the last call.
    pub fn take_requests(&mut self, mem: &GuestMemoryMmap) -> Vec<Request> {
        if !std::mem::take(&mut self.notified) {
            return Vec::new();
        }
        let Some(queue) = self.transport.queue(0) else {
            return Vec::new();
        };
        let Some(chains) = virtio_mmio::pop_chains(queue, mem, usize::MAX) else {
            self.stats.bad_requests += 1;
            return Vec::new();
        };
        chains
            .into_iter()
            .map(|(head, descs)| {
                self.stats.requests += 1;
                // The request's descriptors come first, then the reply's.
                let split = descs.iter().position(|d| d.2).unwrap_or(descs.len());
                let (out, reply_to) = descs.split_at(split);
                let well_formed = !reply_to.iter().any(|d| !d.2);
                let message = well_formed
                    .then(|| virtio_mmio::read_chain(out, mem, MAX_REQUEST_BYTES))
                    .flatten();
                let room: u64 = reply_to.iter().map(|d| u64::from(d.1)).sum();
                Request {
                    head,
                    message,
                    reply_to: reply_to.to_vec(),
                    room: room.min(u64::from(u32::MAX)) as u32,
                }
            })
            .collect()
    }

    /// Completes `request` with `reply` (nothing for a malformed one):
    /// the reply in its buffers, the used ring, the interrupt.
    pub fn complete(&mut self, request: Request, reply: Option<&[u8]>, mem: &GuestMemoryMmap) {
        let written = match reply {
            Some(reply) => virtio_mmio::write_chain(&request.reply_to, mem, reply),
            None => None,
        };
        match written {
            Some(n) => self.stats.reply_bytes += u64::from(n),
            None => self.stats.bad_requests += 1,
        }
        let used = self
            .transport
            .queue(0)
            .map(|q| q.add_used(mem, request.head, written.unwrap_or(0)));
        if !matches!(used, Some(Ok(()))) {
            self.stats.bad_requests += 1;
        }
        self.transport.signal_used();
        self.irq = true;
    }
}

/// tag_len[2] then the tag.
fn config_space() -> Vec<u8> {
    let mut c = (MOUNT_TAG.len() as u16).to_le_bytes().to_vec();
    c.extend_from_slice(MOUNT_TAG.as_bytes());
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::p9;
    use crate::virtio_mmio::test_driver::{self, QueueAt};
    use vm_memory::{Bytes, GuestAddress};

    const Q: QueueAt = [0x1000, 0x2000, 0x3000];

    #[test]
    fn requests_wait_for_the_vmm_and_replies_fill_the_chain() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut dev = Virtio9p::new();
        let mut tag = [0u8; 14];
        dev.mmio_read(0x100, &mut tag);
        assert_eq!(&tag[2..], MOUNT_TAG.as_bytes());
        test_driver::set_up(
            |o, v| dev.mmio_write(o, &v.to_le_bytes(), &mem),
            VIRTIO_F_VERSION_1 | VIRTIO_9P_MOUNT_TAG,
            &[Q],
        );
        let mut w = p9::Writer::new(p9::TVERSION, 0xffff);
        w.u32(8192).string(b"9P2000.L");
        let msg = w.finish();
        mem.write_slice(&msg, GuestAddress(0x4000)).unwrap();
        // Chain: request (readable), then reply buffer (writable).
        mem.write_obj(0x4000u64, GuestAddress(0x1000)).unwrap();
        mem.write_obj(msg.len() as u32, GuestAddress(0x1008))
            .unwrap();
        mem.write_obj(1u16, GuestAddress(0x100c)).unwrap();
        mem.write_obj(1u16, GuestAddress(0x100e)).unwrap();
        test_driver::offer(&mem, Q, 1, 0, 0x5000, 64, true);
        mem.write_obj(0u16, GuestAddress(0x2004)).unwrap();
        assert!(dev.take_requests(&mem).is_empty(), "not notified yet");
        dev.mmio_write(0x050, &0u32.to_le_bytes(), &mem);
        let mut requests = dev.take_requests(&mem);
        assert_eq!(requests.len(), 1);
        let r = requests.pop().unwrap();
        assert_eq!(r.message.as_deref(), Some(&msg[..]));
        assert_eq!(r.room, 64);
        assert_eq!(test_driver::used_idx(&mem, Q), 0);
        dev.complete(r, Some(b"answer"), &mem);
        assert_eq!(test_driver::used_idx(&mem, Q), 1);
        assert_eq!(test_driver::used_len(&mem, Q, 0), 6);
        let mut out = [0u8; 6];
        mem.read_slice(&mut out, GuestAddress(0x5000)).unwrap();
        assert_eq!(&out, b"answer");
        assert!(dev.take_irq());
    }
}
