//! The virtio-mmio transport (version 2) shared by insight's virtio
//! devices: the register block, feature negotiation, device status and
//! the queues' addresses. The device behind it supplies its config space
//! and acts on what [`MmioTransport::write`] returns (a queue notification,
//! a reset).
//!
//! Also here: copying bytes in and out of descriptor chains, with every
//! address and length the guest wrote validated.

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Device status bits.
const STATUS_DRIVER_OK: u32 = 0x04;
const STATUS_FAILED: u32 = 0x80;
/// Interrupt status: the device used buffers.
const INT_USED_BUFFER: u32 = 1;
/// Interrupt status: the device's configuration changed.
const INT_CONFIG_CHANGE: u32 = 2;

/// What a register write asks of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverRequest {
    None,
    /// The driver notified queue `n`.
    Notify(u16),
    /// The driver reset the device (the transport already reset itself).
    Reset,
    /// The driver set DRIVER_OK: features are final.
    DriverOk,
}

/// What a checkpoint keeps of a transport: the driver's registers and
/// each queue's addresses and positions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub driver_features: u64,
    pub status: u32,
    pub interrupt_status: u32,
    pub queue_sel: u32,
    pub queues: Vec<QueueRegs>,
}

/// A queue's state (virtio-queue's `QueueState`, which is not serde).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueRegs {
    pub max_size: u16,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx: bool,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

pub struct MmioTransport {
    device_id: u32,
    device_features: u64,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    status: u32,
    interrupt_status: u32,
    queue_sel: u32,
    queues: Vec<Queue>,
    max_sizes: Vec<u16>,
}

impl MmioTransport {
    /// A transport for device type `device_id` offering `device_features`,
    /// with one queue per entry of `queue_sizes` (powers of two).
    pub fn new(device_id: u32, device_features: u64, queue_sizes: &[u16]) -> Self {
        MmioTransport {
            device_id,
            device_features,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            status: 0,
            interrupt_status: 0,
            queue_sel: 0,
            queues: queue_sizes
                .iter()
                .map(|&n| Queue::new(n).expect("queue sizes are powers of two"))
                .collect(),
            max_sizes: queue_sizes.to_vec(),
        }
    }

    pub fn state(&self) -> TransportState {
        TransportState {
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            status: self.status,
            interrupt_status: self.interrupt_status,
            queue_sel: self.queue_sel,
            queues: self
                .queues
                .iter()
                .map(|q| {
                    let s = q.state();
                    QueueRegs {
                        max_size: s.max_size,
                        next_avail: s.next_avail,
                        next_used: s.next_used,
                        event_idx: s.event_idx_enabled,
                        size: s.size,
                        ready: s.ready,
                        desc_table: s.desc_table,
                        avail_ring: s.avail_ring,
                        used_ring: s.used_ring,
                    }
                })
                .collect(),
        }
    }

    /// Puts the transport in `state`; an error says what no transport of
    /// this device can be (other queues, an invalid queue size).
    pub fn restore(&mut self, state: &TransportState) -> Result<(), String> {
        if state.queues.len() != self.queues.len() {
            return Err(format!(
                "{} queues, the device has {}",
                state.queues.len(),
                self.queues.len()
            ));
        }
        let mut queues = Vec::with_capacity(state.queues.len());
        for (i, (q, &max)) in state.queues.iter().zip(&self.max_sizes).enumerate() {
            if q.max_size != max {
                return Err(format!(
                    "queue {i} has {} entries at most, not {max}",
                    q.max_size
                ));
            }
            let queue = Queue::try_from(QueueState {
                max_size: q.max_size,
                next_avail: q.next_avail,
                next_used: q.next_used,
                event_idx_enabled: q.event_idx,
                size: q.size,
                ready: q.ready,
                desc_table: q.desc_table,
                avail_ring: q.avail_ring,
                used_ring: q.used_ring,
            })
            .map_err(|e| format!("queue {i}: {e}"))?;
            queues.push(queue);
        }
        self.device_features_sel = state.device_features_sel;
        self.driver_features_sel = state.driver_features_sel;
        self.driver_features = state.driver_features;
        self.status = state.status;
        self.interrupt_status = state.interrupt_status;
        self.queue_sel = state.queue_sel;
        self.queues = queues;
        Ok(())
    }

    /// Whether the driver accepted `feature`.
    pub fn negotiated(&self, feature: u64) -> bool {
        self.driver_features & feature == feature
    }

    /// Whether the driver has set DRIVER_OK (and the device has not failed).
    pub fn driver_ok(&self) -> bool {
        self.status & (STATUS_DRIVER_OK | STATUS_FAILED) == STATUS_DRIVER_OK
    }

    pub fn queue(&mut self, n: usize) -> Option<&mut Queue> {
        self.queues.get_mut(n).filter(|q| q.ready())
    }

    /// Marks that buffers were used; the device raises its line.
    pub fn signal_used(&mut self) {
        self.interrupt_status |= INT_USED_BUFFER;
    }

    /// Marks that the configuration changed; the device raises its line
    /// (and answers the config generation register itself).
    pub fn signal_config_change(&mut self) {
        self.interrupt_status |= INT_CONFIG_CHANGE;
    }

    /// A register read; `config` is the device's configuration space.
    pub fn read(&self, offset: u64, data: &mut [u8], config: &[u8]) {
        let queue = self.queues.get(self.queue_sel as usize);
        let value: u32 = match offset {
            0x000 => 0x7472_6976, // "virt"
            0x004 => 2,           // version
            0x008 => self.device_id,
            0x00c => 0x5347_4e49, // vendor "INSG"
            0x010 => match self.device_features_sel {
                0 => self.device_features as u32,
                1 => (self.device_features >> 32) as u32,
                _ => 0,
            },
            0x034 => queue.map_or(0, |_| u32::from(self.max_sizes[self.queue_sel as usize])),
            0x044 => u32::from(queue.is_some_and(|q| q.ready())),
            0x060 => self.interrupt_status,
            0x070 => self.status,
            0x0fc => 0, // config generation: a device whose config changes answers it
            0x100.. => {
                let start = (offset - 0x100) as usize;
                for (i, b) in data.iter_mut().enumerate() {
                    *b = config.get(start + i).copied().unwrap_or(0);
                }
                return;
            }
            _ => 0,
        };
        read_register(value, data);
    }

    /// A register write (config space is read-only).
    pub fn write(&mut self, offset: u64, data: &[u8], mem: &GuestMemoryMmap) -> DriverRequest {
        if data.len() != 4 {
            return DriverRequest::None; // registers are 32-bit
        }
        let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let sel = self.queue_sel as usize;
        match offset {
            0x014 => self.device_features_sel = v,
            0x020 => match self.driver_features_sel {
                0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(v),
                1 => {
                    self.driver_features =
                        (self.driver_features & 0xffff_ffff) | (u64::from(v) << 32)
                }
                _ => {}
            },
            0x024 => self.driver_features_sel = v,
            0x030 => self.queue_sel = v,
            0x050 => {
                return match u16::try_from(v) {
                    Ok(n) if usize::from(n) < self.queues.len() => DriverRequest::Notify(n),
                    _ => DriverRequest::None,
                }
            }
            0x064 => self.interrupt_status &= !v,
            0x070 => {
                if v == 0 {
                    self.reset();
                    return DriverRequest::Reset;
                }
                let newly_ok = v & STATUS_DRIVER_OK != 0 && self.status & STATUS_DRIVER_OK == 0;
                self.status = v | (self.status & STATUS_FAILED);
                if newly_ok {
                    return DriverRequest::DriverOk;
                }
            }
            _ => {
                let max = self.max_sizes.get(sel).copied().unwrap_or(0);
                let Some(q) = self.queues.get_mut(sel) else {
                    return DriverRequest::None;
                };
                match offset {
                    0x038 => q.set_size(v.min(u32::from(max)) as u16),
                    0x044 => {
                        q.set_ready(v == 1);
                        if v == 1 && !q.is_valid(mem) {
                            // A queue outside guest memory: the device fails.
                            q.set_ready(false);
                            self.status |= STATUS_FAILED;
                        }
                    }
                    0x080 => q.set_desc_table_address(Some(v), None),
                    0x084 => q.set_desc_table_address(None, Some(v)),
                    0x090 => q.set_avail_ring_address(Some(v), None),
                    0x094 => q.set_avail_ring_address(None, Some(v)),
                    0x0a0 => q.set_used_ring_address(Some(v), None),
                    0x0a4 => q.set_used_ring_address(None, Some(v)),
                    _ => {}
                }
            }
        }
        DriverRequest::None
    }

    fn reset(&mut self) {
        self.status = 0;
        self.interrupt_status = 0;
        self.driver_features = 0;
        for q in &mut self.queues {
            q.reset();
        }
    }
}

/// Answers a read of a 32-bit register holding `value` (bytes the
/// register lacks read as 0).
pub fn read_register(value: u32, data: &mut [u8]) {
    let bytes = value.to_le_bytes();
    for (i, b) in data.iter_mut().enumerate() {
        *b = bytes.get(i).copied().unwrap_or(0);
    }
}

/// The kernel command-line text that declares a device whose `size` bytes
/// of registers are at `base`, on PIC line `irq`.
pub fn kernel_cmdline(base: u64, size: u64, irq: u8) -> String {
    format!("virtio_mmio.device={size:#x}@{base:#x}:{irq}")
}

/// A descriptor: guest address, length, device-writable.
pub type Desc = (GuestAddress, u32, bool);

/// Whether the driver asks for no used-buffer interrupt on `queue`
/// (VRING_AVAIL_F_NO_INTERRUPT in its available ring's flags; virtio-queue
/// does not look at it). An unreadable ring asks for nothing.
pub fn interrupt_suppressed(queue: &Queue, mem: &GuestMemoryMmap) -> bool {
    const VRING_AVAIL_F_NO_INTERRUPT: u16 = 1;
    mem.read_obj::<u16>(GuestAddress(queue.avail_ring()))
        .is_ok_and(|flags| u16::from_le(flags) & VRING_AVAIL_F_NO_INTERRUPT != 0)
}

/// The chains the guest made available on `queue`, as (head, descriptors);
/// `None` when the available ring itself is unreadable.
pub fn pop_chains(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    max: usize,
) -> Option<Vec<(u16, Vec<Desc>)>> {
    let mut chains = Vec::new();
    let iter = queue.iter(mem).ok()?;
    for chain in iter.take(max) {
        let head = chain.head_index();
        let descs = chain
            .map(|d| (d.addr(), d.len(), d.is_write_only()))
            .collect();
        chains.push((head, descs));
    }
    Some(chains)
}

/// Copies the device-readable part of a chain out of guest memory, at most
/// `max` bytes; `None` if a descriptor is device-writable, outside guest
/// memory, or the total exceeds `max`.
pub fn read_chain(descs: &[Desc], mem: &GuestMemoryMmap, max: usize) -> Option<Vec<u8>> {
    let total: u64 = descs.iter().map(|d| u64::from(d.1)).sum();
    if descs.iter().any(|d| d.2) || total > max as u64 {
        return None;
    }
    let mut bytes = vec![0u8; total as usize];
    let mut at = 0usize;
    for &(addr, len, _) in descs {
        let end = at + len as usize;
        mem.read_slice(&mut bytes[at..end], addr).ok()?;
        at = end;
    }
    Some(bytes)
}

/// Copies `data` into the device-writable descriptors of a chain; returns
/// the bytes written, or `None` if the chain has a device-readable
/// descriptor, points outside guest memory or is too short for `data`.
pub fn write_chain(descs: &[Desc], mem: &GuestMemoryMmap, data: &[u8]) -> Option<u32> {
    let room: u64 = descs.iter().map(|d| u64::from(d.1)).sum();
    if descs.iter().any(|d| !d.2) || room < data.len() as u64 {
        return None;
    }
    let mut at = 0usize;
    for &(addr, len, _) in descs {
        if at == data.len() {
            break;
        }
        let end = (at + len as usize).min(data.len());
        mem.write_slice(&data[at..end], addr).ok()?;
        at = end;
    }
    u32::try_from(at).ok()
}

/// Driving a device's queues as its driver would, for the devices' tests.
#[cfg(test)]
pub(crate) mod test_driver {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    /// A queue's descriptor table, available ring and used ring.
    pub(crate) type QueueAt = [u64; 3];

    /// Accepts `features` and sets up `queues` (8 entries each) through
    /// `write` (offset, value), then sets DRIVER_OK.
    pub(crate) fn set_up(mut write: impl FnMut(u64, u32), features: u64, queues: &[QueueAt]) {
        write(0x024, 0);
        write(0x020, features as u32);
        write(0x024, 1);
        write(0x020, (features >> 32) as u32);
        for (n, q) in queues.iter().enumerate() {
            write(0x030, n as u32);
            write(0x038, 8);
            write(0x080, q[0] as u32);
            write(0x090, q[1] as u32);
            write(0x0a0, q[2] as u32);
            write(0x044, 1);
        }
        write(0x070, 0x0f);
    }

    /// Descriptor `i` of queue `q`; offers it as chain number `n`.
    pub(crate) fn offer(
        mem: &GuestMemoryMmap,
        q: QueueAt,
        i: u16,
        n: u16,
        addr: u64,
        len: u32,
        write: bool,
    ) {
        let at = q[0] + 16 * u64::from(i);
        mem.write_obj(addr, GuestAddress(at)).unwrap();
        mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        mem.write_obj(if write { 2u16 } else { 0 }, GuestAddress(at + 12))
            .unwrap();
        mem.write_obj(i, GuestAddress(q[1] + 4 + 2 * u64::from(n)))
            .unwrap();
        mem.write_obj(n + 1, GuestAddress(q[1] + 2)).unwrap();
    }

    /// How many chains the device has used on queue `q`.
    pub(crate) fn used_idx(mem: &GuestMemoryMmap, q: QueueAt) -> u16 {
        mem.read_obj(GuestAddress(q[2] + 2)).unwrap()
    }

    /// The length the device wrote in used-ring entry `n` of queue `q`.
    pub(crate) fn used_len(mem: &GuestMemoryMmap, q: QueueAt, n: u64) -> u32 {
        mem.read_obj(GuestAddress(q[2] + 4 + 8 * n + 4)).unwrap()
    }
}
