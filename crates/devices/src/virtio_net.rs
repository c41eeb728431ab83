//! A virtio network device on the virtio-mmio transport (version 2), with
//! received frames made visible only when the VMM says so.
//!
//! Frames from the host (a TAP device, read by a thread of its own) wait in
//! the device. They reach the guest — written into its receive buffers,
//! used-ring entries filled, the interrupt raised, all while the vCPU is
//! stopped — only in [`VirtioNet::deliver_received`] or
//! [`VirtioNet::deliver`], which the VMM calls at deterministic VM exits:
//! the "complete bit" of InSight. The VMM logs the frames delivered at each
//! exit when recording, and at replay hands exactly those to `deliver` at
//! the same exits, with no TAP device at all.
//!
//! Transmission is synchronous: frames are taken when the guest notifies
//! the transmit queue (itself a deterministic exit) and completed at once,
//! so the guest sees the same whether they go to a TAP device, nowhere, or
//! to a capture file.
//!
//! Frames carry the 12-byte virtio-net header in front (the TAP device is
//! opened with the same header), so they pass through unchanged. Everything
//! from the guest and the host is validated; malformed frames and chains
//! are counted, never fatal.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use virtio_queue::QueueT;
use vm_memory::GuestMemoryMmap;

use crate::doorbell::Doorbell;
use crate::tap::{self, Tap, VNET_HDR_LEN};
use crate::virtio_mmio::{
    self, Desc, DriverRequest, MmioTransport, TransportState, VIRTIO_F_VERSION_1,
};

/// Where the device's registers are in guest physical memory (after the
/// block device's).
pub const MMIO_BASE: u64 = 0xd000_0200;
pub const MMIO_SIZE: u64 = 0x200;
/// Its PIC line.
pub const IRQ: u8 = 6;
const QUEUE_SIZE: u16 = 256;
const RX: usize = 0;
const TX: usize = 1;

/// The kernel command-line text that declares the device.
pub fn kernel_cmdline() -> String {
    virtio_mmio::kernel_cmdline(MMIO_BASE, MMIO_SIZE, IRQ)
}

const VIRTIO_NET_F_GUEST_CSUM: u64 = 1 << 1;
const VIRTIO_NET_F_MAC: u64 = 1 << 5;
const VIRTIO_NET_F_GUEST_TSO4: u64 = 1 << 7;
/// The guest posts small receive buffers and a frame may span several:
/// without it, a guest that takes TSO frames posts 64 KiB buffers, each a
/// chain of 17 pages the driver allocates for every frame, and charges a
/// page or more of its sockets' receive buffers to every small datagram.
const VIRTIO_NET_F_MRG_RXBUF: u64 = 1 << 15;
const DEVICE_FEATURES: u64 = VIRTIO_F_VERSION_1
    | VIRTIO_NET_F_MAC
    | VIRTIO_NET_F_GUEST_CSUM
    | VIRTIO_NET_F_GUEST_TSO4
    | VIRTIO_NET_F_MRG_RXBUF;

/// Ethernet header; frames shorter than it and the virtio header are runts.
const ETH_HLEN: usize = 14;
/// Largest frame without receive segmentation offload (with a VLAN tag).
const MAX_PLAIN_FRAME: usize = 1518;
/// Largest frame with TSO: a 64 KiB IP packet and its Ethernet header.
const MAX_GSO_FRAME: usize = 65_550;
/// Frames buffered while the guest has no receive buffers.
const MAX_PENDING: usize = 1024;
/// The TAP reader's read buffer: larger than any frame, so a frame too
/// large for the guest is seen whole (and dropped), never truncated.
const READ_BUFFER: usize = 128 << 10;

/// The default MAC address (locally administered).
pub const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetStats {
    /// Frames made visible to the guest, and their bytes (headers included).
    pub rx_frames: u64,
    pub rx_bytes: u64,
    /// Frames the guest sent, and their bytes.
    pub tx_frames: u64,
    pub tx_bytes: u64,
    /// Received frames larger than the guest's negotiated size, or shorter
    /// than an Ethernet header: dropped.
    pub rx_bad_size: u64,
    /// Received frames dropped because the guest took none for a while.
    pub rx_overflow: u64,
    /// Frames for the guest the host kernel dropped at the TAP device
    /// before the device's reader took them (the interface's queue was
    /// full), since the device opened.
    pub rx_host_dropped: u64,
    /// Receive chains the guest formed wrongly (device-readable, outside
    /// guest memory, too short for the frame): the frame is dropped.
    pub rx_bad_chains: u64,
    /// Transmit chains formed wrongly: nothing sent.
    pub tx_bad_chains: u64,
    /// Frames the host would not take (the TAP device failed).
    pub tx_errors: u64,
}

impl NetStats {
    /// Received frames that never reached the guest: dropped by the host
    /// kernel, by the device's queue, or for their size.
    pub fn rx_dropped(&self) -> u64 {
        self.rx_host_dropped + self.rx_overflow + self.rx_bad_size
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("cannot open TAP device {name}")]
    Open {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot configure TAP device {name}")]
    Configure {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the network reader thread")]
    Thread(#[source] std::io::Error),
    #[error("the guest has receive buffers for {fit} of the {needed} frames to be delivered")]
    NoBuffers { needed: usize, fit: usize },
    #[error("a frame of {len} bytes cannot be delivered (the guest accepts {min} to {max})")]
    BadFrame { len: usize, min: usize, max: usize },
}

/// A TAP device and the thread that reads it.
struct TapBackend {
    tap: Arc<Tap>,
    frames: Receiver<std::io::Result<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    overflow: Arc<AtomicU64>,
    /// The interface's drop counter when the device opened.
    host_dropped_at_start: Option<u64>,
    reader: Option<JoinHandle<()>>,
}

impl TapBackend {
    fn start(tap: Tap, doorbell: Doorbell) -> Result<Self, NetError> {
        let host_dropped_at_start = tap.host_dropped();
        let tap = Arc::new(tap);
        let (tx, rx) = mpsc::sync_channel(MAX_PENDING);
        let stop = Arc::new(AtomicBool::new(false));
        let overflow = Arc::new(AtomicU64::new(0));
        let reader = {
            let (tap, stop, overflow) =
                (Arc::clone(&tap), Arc::clone(&stop), Arc::clone(&overflow));
            std::thread::Builder::new()
                .name("net-rx".into())
                .spawn(move || read_tap(&tap, &tx, &stop, &overflow, &doorbell))
                .map_err(NetError::Thread)?
        };
        Ok(TapBackend {
            tap,
            frames: rx,
            stop,
            overflow,
            host_dropped_at_start,
            reader: Some(reader),
        })
    }
}

impl Drop for TapBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

fn read_tap(
    tap: &Tap,
    frames: &SyncSender<std::io::Result<Vec<u8>>>,
    stop: &AtomicBool,
    overflow: &AtomicU64,
    doorbell: &Doorbell,
) {
    let mut buf = vec![0u8; READ_BUFFER];
    while !stop.load(Ordering::Acquire) {
        let item = match tap.wait_readable(Duration::from_millis(100)) {
            Ok(false) => continue,
            Ok(true) => match tap.file().read(&mut buf) {
                Ok(n) => Ok(buf[..n].to_vec()),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        let failed = item.is_err();
        match frames.try_send(item) {
            Ok(()) => doorbell.ring(),
            Err(TrySendError::Full(_)) => {
                overflow.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => return,
        }
        if failed {
            doorbell.ring();
            return;
        }
    }
}

/// Where the device's frames come from and go to.
pub enum NetBackend {
    /// A TAP device of the host, created if needed, optionally given an
    /// IPv4 address and brought up.
    Tap {
        name: String,
        host_address: Option<(std::net::Ipv4Addr, u8)>,
    },
    /// Nothing: received frames come only from [`VirtioNet::deliver`]
    /// (replay), transmitted ones go to the capture, if any.
    None,
}

/// Receives Ethernet frames (without the virtio header).
pub type FrameSink = Box<dyn FnMut(&[u8]) + Send>;

/// What a checkpoint keeps of the network device: the transport, the
/// frames waiting for the guest, the counts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub transport: TransportState,
    pub pending: Vec<Vec<u8>>,
    pub irq: bool,
    pub stats: NetStats,
    pub failure: Option<String>,
}

pub struct VirtioNet {
    transport: MmioTransport,
    mac: [u8; 6],
    tap: Option<TapBackend>,
    /// Frames received, waiting for a deterministic point and a buffer.
    pending: VecDeque<Vec<u8>>,
    /// Transmitted frames go here too (Ethernet frames, no virtio header).
    capture: Option<FrameSink>,
    irq: bool,
    stats: NetStats,
    /// Why the TAP device stopped working, once it has.
    failure: Option<String>,
}

impl VirtioNet {
    pub fn new(mac: [u8; 6], backend: NetBackend, doorbell: Doorbell) -> Result<Self, NetError> {
        let tap = match backend {
            NetBackend::Tap { name, host_address } => {
                let tap = Tap::open(&name).map_err(|source| NetError::Open {
                    name: name.clone(),
                    source,
                })?;
                if let Some((addr, prefix)) = host_address {
                    tap.configure(addr, prefix)
                        .map_err(|source| NetError::Configure { name, source })?;
                }
                Some(TapBackend::start(tap, doorbell)?)
            }
            NetBackend::None => None,
        };
        Ok(VirtioNet {
            transport: MmioTransport::new(1, DEVICE_FEATURES, &[QUEUE_SIZE, QUEUE_SIZE]),
            mac,
            tap,
            pending: VecDeque::new(),
            capture: None,
            irq: false,
            stats: NetStats::default(),
            failure: None,
        })
    }

    pub fn state(&self) -> NetState {
        NetState {
            transport: self.transport.state(),
            pending: self.pending.iter().cloned().collect(),
            irq: self.irq,
            stats: self.stats,
            failure: self.failure.clone(),
        }
    }

    /// Received frames waiting for the guest to take them.
    pub fn pending_frames(&self) -> usize {
        self.pending.len()
    }

    /// Puts the device in `state` (its TAP device, if any, stays as is).
    pub fn restore(&mut self, state: &NetState) -> Result<(), String> {
        if state.pending.len() > MAX_PENDING {
            return Err(format!(
                "{} frames pending, at most {MAX_PENDING}",
                state.pending.len()
            ));
        }
        self.transport.restore(&state.transport)?;
        self.pending = state.pending.iter().cloned().collect();
        self.irq = state.irq;
        self.stats = state.stats;
        self.failure = state.failure.clone();
        Ok(())
    }

    /// Also hands every transmitted Ethernet frame to `capture`.
    pub fn capture_tx(&mut self, capture: FrameSink) {
        self.capture = Some(capture);
    }

    pub fn stats(&self) -> NetStats {
        let mut stats = self.stats;
        if let Some(tap) = &self.tap {
            stats.rx_overflow += tap.overflow.load(Ordering::Relaxed);
            if let (Some(start), Some(now)) = (tap.host_dropped_at_start, tap.tap.host_dropped()) {
                stats.rx_host_dropped = now.saturating_sub(start);
            }
        }
        stats
    }

    /// Why the TAP device stopped working, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Whether the device raised its interrupt since the last call.
    pub fn take_irq(&mut self) -> bool {
        std::mem::take(&mut self.irq)
    }

    /// The largest frame (virtio header included) the guest accepts.
    pub fn max_frame_len(&self) -> usize {
        VNET_HDR_LEN
            + if self.transport.negotiated(VIRTIO_NET_F_GUEST_TSO4) {
                MAX_GSO_FRAME
            } else {
                MAX_PLAIN_FRAME
            }
    }

    pub fn mmio_read(&mut self, offset: u64, data: &mut [u8]) {
        let mut config = [0u8; 8];
        config[..6].copy_from_slice(&self.mac);
        self.transport.read(offset, data, &config);
    }

    pub fn mmio_write(&mut self, offset: u64, data: &[u8], mem: &GuestMemoryMmap) {
        match self.transport.write(offset, data, mem) {
            DriverRequest::Notify(n) if usize::from(n) == TX => self.transmit(mem),
            DriverRequest::DriverOk => {
                if let Some(tap) = &self.tap {
                    let mut offload = 0;
                    if self.transport.negotiated(VIRTIO_NET_F_GUEST_CSUM) {
                        offload |= tap::OFFLOAD_CSUM;
                    }
                    if self.transport.negotiated(VIRTIO_NET_F_GUEST_TSO4) {
                        offload |= tap::OFFLOAD_TSO4;
                    }
                    if let Err(e) = tap.tap.set_offload(offload) {
                        self.fail(format!("cannot set offloads: {e}"));
                    }
                }
            }
            // Buffers the guest added to the receive queue are used at the
            // next delivery; a reset drops nothing already received.
            _ => {}
        }
    }

    fn fail(&mut self, why: String) {
        if self.failure.is_none() {
            self.failure = Some(why);
        }
    }

    /// Sends every frame the guest queued for transmission.
    fn transmit(&mut self, mem: &GuestMemoryMmap) {
        let Some(queue) = self.transport.queue(TX) else {
            return;
        };
        let Some(chains) = virtio_mmio::pop_chains(queue, mem, usize::MAX) else {
            self.stats.tx_bad_chains += 1;
            return;
        };
        let mut used = Vec::with_capacity(chains.len());
        for (head, descs) in chains {
            used.push(head);
            let frame = match virtio_mmio::read_chain(&descs, mem, VNET_HDR_LEN + MAX_GSO_FRAME) {
                Some(f) if f.len() >= VNET_HDR_LEN + ETH_HLEN => f,
                _ => {
                    self.stats.tx_bad_chains += 1;
                    continue;
                }
            };
            self.stats.tx_frames += 1;
            self.stats.tx_bytes += frame.len() as u64;
            if let Some(capture) = &mut self.capture {
                capture(&frame[VNET_HDR_LEN..]);
            }
            if let Some(tap) = &self.tap {
                if let Err(e) = tap.tap.file().write(&frame) {
                    self.stats.tx_errors += 1;
                    let why = format!("writing to TAP device {}: {e}", tap.tap.name());
                    self.fail(why);
                }
            }
        }
        let Some(queue) = self.transport.queue(TX) else {
            return;
        };
        for head in used {
            if queue.add_used(mem, head, 0).is_err() {
                self.stats.tx_bad_chains += 1;
            }
        }
        self.transport.signal_used();
        self.irq = true;
    }

    /// Moves frames the TAP reader received into the device, dropping
    /// those the guest could not take.
    fn collect(&mut self) {
        let max = self.max_frame_len();
        let mut failure = None;
        if let Some(tap) = &self.tap {
            while let Ok(item) = tap.frames.try_recv() {
                match item {
                    Ok(frame) => {
                        if frame.len() < VNET_HDR_LEN + ETH_HLEN || frame.len() > max {
                            self.stats.rx_bad_size += 1;
                        } else if self.pending.len() >= MAX_PENDING {
                            self.stats.rx_overflow += 1;
                        } else {
                            self.pending.push_back(frame);
                        }
                    }
                    Err(e) => failure = Some(format!("reading TAP device {}: {e}", tap.tap.name())),
                }
            }
        }
        if let Some(why) = failure {
            self.fail(why);
        }
    }

    /// Delivers as many received frames as the guest has buffers for, and
    /// returns them (what a recording logs).
    pub fn deliver_received(&mut self, mem: &GuestMemoryMmap) -> Vec<Vec<u8>> {
        self.collect();
        // Sizes were checked on arrival, but the guest may have
        // renegotiated (smaller) since: only what it accepts now goes in.
        let max = self.max_frame_len();
        let before = self.pending.len();
        self.pending.retain(|f| f.len() <= max);
        self.stats.rx_bad_size += (before - self.pending.len()) as u64;
        let lens: Vec<usize> = self.pending.iter().map(Vec::len).collect();
        let buffers = self.take_buffers(lens.into_iter(), mem);
        if buffers.is_empty() {
            return Vec::new();
        }
        let frames: Vec<Vec<u8>> = self.pending.drain(..buffers.len()).collect();
        self.fill(&frames, buffers, mem);
        frames
    }

    /// Delivers exactly `frames` (each with its virtio header), each into
    /// one receive buffer or, when the guest merges buffers, into as many
    /// as it needs, and raises the interrupt. Errors, delivering nothing,
    /// if a frame has a size the guest does not accept or the guest's
    /// buffers cannot hold them all.
    pub fn deliver(&mut self, frames: &[Vec<u8>], mem: &GuestMemoryMmap) -> Result<(), NetError> {
        let (min, max) = (VNET_HDR_LEN + ETH_HLEN, self.max_frame_len());
        if let Some(f) = frames.iter().find(|f| f.len() < min || f.len() > max) {
            return Err(NetError::BadFrame {
                len: f.len(),
                min,
                max,
            });
        }
        if frames.is_empty() {
            return Ok(());
        }
        let start = self.transport.queue(RX).map(|q| q.next_avail());
        let buffers = self.take_buffers(frames.iter().map(Vec::len), mem);
        if buffers.len() < frames.len() {
            if let (Some(queue), Some(start)) = (self.transport.queue(RX), start) {
                queue.set_next_avail(start);
            }
            return Err(NetError::NoBuffers {
                needed: frames.len(),
                fit: buffers.len(),
            });
        }
        self.fill(frames, buffers, mem);
        Ok(())
    }

    /// Takes receive chains for frames of the given lengths, in order, as
    /// many frames as the guest's buffers hold: a chain per frame, or as
    /// many as the frame needs when buffers are merged. The queue is left
    /// after the chains of the last frame that fits. A malformed chain
    /// ends its frame's chains (the frame will be dropped).
    fn take_buffers(
        &mut self,
        lens: impl Iterator<Item = usize>,
        mem: &GuestMemoryMmap,
    ) -> Vec<Vec<(u16, Vec<Desc>)>> {
        let mergeable = self.transport.negotiated(VIRTIO_NET_F_MRG_RXBUF);
        let mut taken = Vec::new();
        if !self.transport.driver_ok() {
            return taken;
        }
        let Some(queue) = self.transport.queue(RX) else {
            return taken;
        };
        'frames: for len in lens {
            let start = queue.next_avail();
            let (mut chains, mut room) = (Vec::new(), 0u64);
            loop {
                let Some((head, descs)) =
                    virtio_mmio::pop_chains(queue, mem, 1).and_then(|mut c| c.pop())
                else {
                    queue.set_next_avail(start);
                    break 'frames;
                };
                let chain_room = writable_room(&descs);
                chains.push((head, descs));
                match chain_room {
                    Some(r) if mergeable => room += r,
                    _ => break,
                }
                if room >= len as u64 {
                    break;
                }
            }
            taken.push(chains);
        }
        taken
    }

    /// Writes each frame into the chains taken for it (its virtio header
    /// saying how many), returns them used, and raises the interrupt.
    fn fill(
        &mut self,
        frames: &[Vec<u8>],
        buffers: Vec<Vec<(u16, Vec<Desc>)>>,
        mem: &GuestMemoryMmap,
    ) {
        let Some(queue) = self.transport.queue(RX) else {
            return;
        };
        for (frame, chains) in frames.iter().zip(buffers) {
            let lens = write_frame(frame, &chains, mem);
            if lens.is_some() {
                self.stats.rx_frames += 1;
                self.stats.rx_bytes += frame.len() as u64;
            } else {
                self.stats.rx_bad_chains += 1;
            }
            for (i, (head, _)) in chains.iter().enumerate() {
                let len = lens.as_ref().map_or(0, |l| l[i]);
                if queue.add_used(mem, *head, len).is_err() {
                    self.stats.rx_bad_chains += 1;
                }
            }
        }
        self.transport.signal_used();
        self.irq = true;
    }
}

/// The bytes a receive chain can take; `None` if a descriptor is
/// device-readable.
fn writable_room(descs: &[Desc]) -> Option<u64> {
    if descs.iter().any(|d| !d.2) {
        return None;
    }
    Some(descs.iter().map(|d| u64::from(d.1)).sum())
}

/// Writes `frame` across `chains` in order, its header's `num_buffers`
/// set to their number; returns the bytes written into each, or `None` if
/// they cannot hold it (a readable descriptor, outside guest memory, too
/// short).
fn write_frame(
    frame: &[u8],
    chains: &[(u16, Vec<Desc>)],
    mem: &GuestMemoryMmap,
) -> Option<Vec<u32>> {
    let mut bytes = frame.to_vec();
    let count = u16::try_from(chains.len()).ok()?;
    bytes.get_mut(10..12)?.copy_from_slice(&count.to_le_bytes());
    let mut rest = &bytes[..];
    let mut lens = Vec::with_capacity(chains.len());
    for (_, descs) in chains {
        let room = usize::try_from(writable_room(descs)?).ok()?;
        let (piece, after) = rest.split_at(room.min(rest.len()));
        lens.push(virtio_mmio::write_chain(descs, mem, piece)?);
        rest = after;
    }
    rest.is_empty().then_some(lens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio_mmio::test_driver::{offer, set_up, used_idx, used_len};
    use vm_memory::{Bytes, GuestAddress};

    const RXQ: [u64; 3] = [0x1000, 0x2000, 0x3000];
    const TXQ: [u64; 3] = [0x4000, 0x5000, 0x6000];
    const BUF: u64 = 0x8000;

    fn w32(dev: &mut VirtioNet, mem: &GuestMemoryMmap, offset: u64, v: u32) {
        dev.mmio_write(offset, &v.to_le_bytes(), mem);
    }

    /// A device whose driver accepted `features` and set up both queues.
    fn setup(features: u64) -> (VirtioNet, GuestMemoryMmap) {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x40000)]).unwrap();
        let mut dev = VirtioNet::new(DEFAULT_MAC, NetBackend::None, Doorbell::new()).unwrap();
        let mut id = [0u8; 4];
        dev.mmio_read(0x008, &mut id);
        assert_eq!(u32::from_le_bytes(id), 1);
        let mut mac = [0u8; 6];
        dev.mmio_read(0x100, &mut mac);
        assert_eq!(mac, DEFAULT_MAC);
        set_up(|at, v| w32(&mut dev, &mem, at, v), features, &[RXQ, TXQ]);
        (dev, mem)
    }

    fn frame(len: usize, fill: u8) -> Vec<u8> {
        let mut f = vec![fill; len];
        f[..VNET_HDR_LEN].fill(0);
        f
    }

    #[test]
    fn frames_are_delivered_only_when_asked_and_only_into_buffers() {
        let (mut dev, mem) = setup(DEVICE_FEATURES);
        // No receive buffers: nothing can be delivered, nothing changes.
        let err = dev.deliver(&[frame(100, 7)], &mem).unwrap_err();
        assert!(matches!(err, NetError::NoBuffers { needed: 1, fit: 0 }));
        offer(&mem, RXQ, 0, 0, BUF, 2048, true);
        offer(&mem, RXQ, 1, 1, BUF + 0x1000, 2048, true);
        assert_eq!(used_idx(&mem, RXQ), 0);
        dev.deliver(&[frame(100, 7), frame(60, 9)], &mem).unwrap();
        assert_eq!(used_idx(&mem, RXQ), 2);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(BUF + 99)).unwrap(), 7);
        assert_eq!(
            mem.read_obj::<u8>(GuestAddress(BUF + 0x1000 + 59)).unwrap(),
            9
        );
        assert_eq!(used_len(&mem, RXQ, 0), 100);
        assert!(dev.take_irq());
        assert_eq!(dev.stats().rx_frames, 2);
    }

    #[test]
    fn bad_frames_and_chains_are_counted_never_fatal() {
        // One buffer per frame: a short buffer is a bad chain.
        let (mut dev, mem) = setup(DEVICE_FEATURES & !VIRTIO_NET_F_MRG_RXBUF);
        offer(&mem, RXQ, 0, 0, BUF, 2048, true);
        // Larger than the negotiated size, or a runt: refused.
        let huge = frame(VNET_HDR_LEN + MAX_GSO_FRAME + 1, 1);
        assert!(matches!(
            dev.deliver(&[huge], &mem),
            Err(NetError::BadFrame { .. })
        ));
        assert!(matches!(
            dev.deliver(&[frame(20, 1)], &mem),
            Err(NetError::BadFrame { .. })
        ));
        assert_eq!(used_idx(&mem, RXQ), 0);
        // A device-readable receive buffer: the frame is dropped, the
        // buffer returned empty.
        offer(&mem, RXQ, 0, 0, BUF, 2048, false);
        dev.deliver(&[frame(100, 1)], &mem).unwrap();
        assert_eq!(used_idx(&mem, RXQ), 1);
        assert_eq!(dev.stats().rx_bad_chains, 1);
        // A buffer outside guest memory, another too short.
        offer(&mem, RXQ, 1, 1, 0xffff_0000, 2048, true);
        offer(&mem, RXQ, 2, 2, BUF, 50, true);
        dev.deliver(&[frame(100, 1), frame(100, 1)], &mem).unwrap();
        assert_eq!(dev.stats().rx_bad_chains, 3);
        // Transmit: a device-writable chain and a runt are bad; a good
        // frame is captured without its virtio header.
        let captured = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = Arc::clone(&captured);
        dev.capture_tx(Box::new(move |f| sink.lock().unwrap().push(f.to_vec())));
        offer(&mem, TXQ, 0, 0, BUF, 100, true);
        offer(&mem, TXQ, 1, 1, BUF, 10, false);
        mem.write_slice(&frame(80, 3), GuestAddress(BUF + 0x2000))
            .unwrap();
        offer(&mem, TXQ, 2, 2, BUF + 0x2000, 80, false);
        w32(&mut dev, &mem, 0x050, 1);
        assert_eq!(used_idx(&mem, TXQ), 3);
        assert_eq!(dev.stats().tx_bad_chains, 2);
        assert_eq!(dev.stats().tx_frames, 1);
        let captured = captured.lock().unwrap();
        assert_eq!(captured.len(), 1);
        assert_eq!(captured[0].len(), 80 - VNET_HDR_LEN);
    }

    #[test]
    fn merged_buffers_take_a_frame_in_pieces_or_not_at_all() {
        let (mut dev, mem) = setup(DEVICE_FEATURES);
        for i in 0..3 {
            offer(&mem, RXQ, i, i, BUF + 0x100 * u64::from(i), 64, true);
        }
        // 150 bytes need all three 64-byte buffers; two frames do not fit,
        // and nothing is taken.
        let err = dev
            .deliver(&[frame(150, 5), frame(60, 6)], &mem)
            .unwrap_err();
        assert!(matches!(err, NetError::NoBuffers { needed: 2, fit: 1 }));
        assert_eq!(used_idx(&mem, RXQ), 0);
        dev.deliver(&[frame(150, 5)], &mem).unwrap();
        assert_eq!(used_idx(&mem, RXQ), 3);
        let num_buffers: u16 = mem.read_obj(GuestAddress(BUF + 10)).unwrap();
        assert_eq!(num_buffers, 3);
        let used_len = |n: u64| used_len(&mem, RXQ, n);
        assert_eq!((used_len(0), used_len(1), used_len(2)), (64, 64, 22));
        assert_eq!(
            mem.read_obj::<u8>(GuestAddress(BUF + 0x200 + 21)).unwrap(),
            5
        );
        assert_eq!(dev.stats().rx_frames, 1);
        // What the recorder delivers stops at the first frame that does
        // not fit, and keeps it for later.
        offer(&mem, RXQ, 3, 3, BUF + 0x400, 2048, true);
        dev.pending.extend([frame(100, 7), frame(100, 8)]);
        let delivered = dev.deliver_received(&mem);
        assert_eq!(delivered.len(), 1);
        assert_eq!(dev.pending.len(), 1);
        assert_eq!(
            mem.read_obj::<u8>(GuestAddress(BUF + 0x400 + 99)).unwrap(),
            7
        );
    }
}
