//! A virtio console (device type 3) on the virtio-mmio transport: a
//! terminal for the guest (`hvc0`) with one port (no multiport), whose
//! output costs one VM exit per buffer where the 16550 costs one per byte.
//!
//! Output is synchronous. The guest's driver puts a buffer (up to a page
//! of text) on the transmit queue, notifies the device — a deterministic
//! exit — and spins with interrupts off until the buffer comes back used;
//! so the device writes every queued buffer to the host and completes it
//! within that exit, and the guest sees the same whether the bytes go to a
//! terminal, a file or nowhere. insight's guest kernel skips the queue: with
//! [`VIRTIO_CONSOLE_F_INSIGHT_WRITE`] it hands a whole write over in one
//! 8-byte register of the configuration space (the buffer's guest-physical
//! address and length), which the device writes out within that exit;
//! with [`VIRTIO_CONSOLE_F_INSIGHT_WRITE_USER`] it names the writing
//! process's own buffer instead (its page tables, user address and
//! length), which the device reads through those tables, so the guest
//! never copies the bytes.
//!
//! Input waits in the device until the VMM makes it visible at a
//! deterministic exit, as the network device's frames do:
//! [`VirtioConsole::deliver_input`] while recording (it returns what went
//! in, for the log), [`VirtioConsole::deliver`] at replay with exactly the
//! bytes logged. The terminal's size is the device's configuration
//! (`VIRTIO_CONSOLE_F_SIZE`): [`VirtioConsole::resize`] changes it and
//! raises the configuration interrupt, which the VMM likewise does only at
//! a deterministic exit.
//!
//! Everything the guest hands over is validated: a malformed chain is
//! counted and returned unused, never fatal.

use std::collections::VecDeque;
use std::io::Write;

use serde::{Deserialize, Serialize};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::virtio_mmio::{
    self, Desc, DriverRequest, MmioTransport, TransportState, VIRTIO_F_VERSION_1,
};

/// Where the device's registers are in guest physical memory (after the
/// network device's).
pub const MMIO_BASE: u64 = 0xd000_0400;
pub const MMIO_SIZE: u64 = 0x200;
/// Its PIC line.
pub const IRQ: u8 = 7;
/// The virtio device type of a console.
const DEVICE_ID: u32 = 3;
const QUEUE_SIZE: u16 = 64;
/// Port 0's receive and transmit queues.
const RX: usize = 0;
const TX: usize = 1;
/// The configuration holds the terminal's columns and rows.
const VIRTIO_CONSOLE_F_SIZE: u64 = 1 << 0;
/// insight's own (device-specific bit 23): the driver may write a buffer
/// out with one 8-byte write of [`INSIGHT_WRITE`] instead of through the
/// transmit queue. The value holds the buffer's guest-physical address in
/// bits 0-47 and its length less one in bits 48-63; the device has the
/// bytes out when the write returns. Guest kernel patch 0011 uses it.
pub const VIRTIO_CONSOLE_F_INSIGHT_WRITE: u64 = 1 << 23;
/// The register's offset in the device's registers: 16 into the
/// configuration space, after the standard fields (cols, rows,
/// max_nr_ports, emerg_wr).
pub const INSIGHT_WRITE: u64 = 0x100 + 16;
/// insight's own (device-specific bit 24, offered where the VMM gives the
/// device a [`UserRead`] walk): the driver may write a buffer of the
/// writing process out with one 8-byte write of [`INSIGHT_WRITE_USER`],
/// whose value is the guest-physical address of a [`UserWrite`]. The
/// device reads the bytes through the page tables it names, open to user
/// mode only, writes them out and stores how many in its `done`, all
/// within that exit. Guest kernel patch 0012 uses it for the tty's
/// writes: under an interpreting hypervisor the kernel's copy of a page
/// out of the program cost about half a millisecond.
pub const VIRTIO_CONSOLE_F_INSIGHT_WRITE_USER: u64 = 1 << 24;
/// Its register: 24 into the configuration space.
pub const INSIGHT_WRITE_USER: u64 = 0x100 + 24;
const DEVICE_FEATURES: u64 =
    VIRTIO_F_VERSION_1 | VIRTIO_CONSOLE_F_SIZE | VIRTIO_CONSOLE_F_INSIGHT_WRITE;

/// Reads what a user-mode read of `buf.len()` bytes at `va` sees through
/// the page tables whose root is at `root`, up to the first page that is
/// absent or not open to user mode; how many bytes it read. The VMM's
/// page walk; the device never writes the tables.
pub type UserRead = fn(mem: &GuestMemoryMmap, root: u64, va: u64, buf: &mut [u8]) -> usize;

/// What a write of [`INSIGHT_WRITE_USER`] points at, 32 bytes in guest
/// memory, little-endian: the physical address of the writing process's
/// top-level page table, the buffer's user address, its length (1 to
/// 65536), and `done`, which the device sets to the bytes it wrote out
/// (fewer than the length where a page did not translate: the driver
/// writes the rest another way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserWrite {
    pub root: u64,
    pub addr: u64,
    pub len: u64,
}

impl UserWrite {
    const SIZE: usize = 32;
    const DONE: u64 = 24;

    fn read(mem: &GuestMemoryMmap, at: GuestAddress) -> Option<Self> {
        let mut raw = [0u8; Self::SIZE];
        mem.read_slice(&mut raw, at).ok()?;
        let word =
            |i: usize| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        Some(UserWrite {
            root: word(0),
            addr: word(1),
            len: word(2),
        })
    }
}
/// Input waiting for the guest, at most: what arrives beyond it is
/// counted and dropped.
pub const MAX_PENDING_INPUT: usize = 64 << 10;
/// The longest transmitted chain taken (Linux sends a page at a time).
const MAX_TX_CHAIN: usize = 64 << 10;

/// The kernel command-line text that declares the device.
pub fn kernel_cmdline() -> String {
    virtio_mmio::kernel_cmdline(MMIO_BASE, MMIO_SIZE, IRQ)
}

/// What the device counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleStats {
    /// Buffers and bytes the guest wrote.
    pub tx_buffers: u64,
    pub tx_bytes: u64,
    /// Transmit chains with a device-writable or unreadable descriptor,
    /// or longer than the device takes; writes of the insight register
    /// naming memory the guest does not have, or made without the feature.
    pub tx_bad_chains: u64,
    /// Writes to the host that failed (the guest saw them succeed).
    pub tx_errors: u64,
    /// Bytes delivered to the guest.
    pub rx_bytes: u64,
    /// Receive chains with a device-readable or unwritable descriptor.
    pub rx_bad_chains: u64,
    /// Input bytes dropped because too much was waiting.
    pub rx_overflow: u64,
}

/// What a checkpoint keeps of the console: the transport, the input
/// waiting, the terminal's size and the counts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleState {
    pub transport: TransportState,
    pub pending: Vec<u8>,
    pub size: (u16, u16),
    pub generation: u32,
    pub irq: bool,
    pub stats: ConsoleStats,
}

#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("the guest has receive buffers for {fit} of the {needed} input bytes to be delivered")]
    NoBuffers { needed: usize, fit: usize },
}

pub struct VirtioConsole<W: Write> {
    transport: MmioTransport,
    out: W,
    /// Input received, waiting for a deterministic point and a buffer.
    pending: VecDeque<u8>,
    /// Columns and rows.
    size: (u16, u16),
    /// The configuration generation: one more at every size change.
    generation: u32,
    irq: bool,
    stats: ConsoleStats,
    /// Output written since [`VirtioConsole::take_transmitted`] last
    /// looked: its length and FNV-1a digest.
    transmitted: Option<(u64, u64)>,
    /// The page walk for writes from a process's memory; without it the
    /// device does not offer them.
    user_read: Option<UserRead>,
}

/// FNV-1a's offset basis and prime (64-bit).
const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// A receive chain taken for input: its head, descriptors, and the bytes
/// it holds (`None`: malformed, returned empty).
type RxChain = (u16, Vec<Desc>, Option<usize>);

impl<W: Write> VirtioConsole<W> {
    /// A console writing the guest's output to `out`, for a terminal of
    /// `size` (columns, rows); with `user_read`, offering writes straight
    /// from a process's memory ([`VIRTIO_CONSOLE_F_INSIGHT_WRITE_USER`]).
    pub fn new(out: W, size: (u16, u16), user_read: Option<UserRead>) -> Self {
        let features = match user_read {
            Some(_) => DEVICE_FEATURES | VIRTIO_CONSOLE_F_INSIGHT_WRITE_USER,
            None => DEVICE_FEATURES,
        };
        VirtioConsole {
            transport: MmioTransport::new(DEVICE_ID, features, &[QUEUE_SIZE, QUEUE_SIZE]),
            out,
            pending: VecDeque::new(),
            size,
            generation: 0,
            irq: false,
            stats: ConsoleStats::default(),
            transmitted: None,
            user_read,
        }
    }

    pub fn state(&self) -> ConsoleState {
        ConsoleState {
            transport: self.transport.state(),
            pending: self.pending.iter().copied().collect(),
            size: self.size,
            generation: self.generation,
            irq: self.irq,
            stats: self.stats,
        }
    }

    /// Puts the device in `state` (where its output goes stays as is).
    pub fn restore(&mut self, state: &ConsoleState) -> Result<(), String> {
        if state.pending.len() > MAX_PENDING_INPUT {
            return Err(format!(
                "{} input bytes pending, at most {MAX_PENDING_INPUT}",
                state.pending.len()
            ));
        }
        self.transport.restore(&state.transport)?;
        self.pending = state.pending.iter().copied().collect();
        self.size = state.size;
        self.generation = state.generation;
        self.irq = state.irq;
        self.stats = state.stats;
        Ok(())
    }

    pub fn stats(&self) -> ConsoleStats {
        self.stats
    }

    /// Where the guest's output goes.
    pub fn writer(&self) -> &W {
        &self.out
    }

    pub fn writer_mut(&mut self) -> &mut W {
        &mut self.out
    }

    /// The output written since the last call, as its length and FNV-1a
    /// digest (`None`: nothing was written): what a recording logs with
    /// the transmit notification, and a replay checks.
    pub fn take_transmitted(&mut self) -> Option<(u64, u64)> {
        self.transmitted.take()
    }

    /// The terminal size the device's configuration holds (columns, rows).
    pub fn size(&self) -> (u16, u16) {
        self.size
    }

    /// Whether the device raised its interrupt since the last call.
    pub fn take_irq(&mut self) -> bool {
        std::mem::take(&mut self.irq)
    }

    /// Whether the driver has the device running (DRIVER_OK): before it
    /// does, nothing reads input or the size.
    pub fn driver_ok(&self) -> bool {
        self.transport.driver_ok()
    }

    pub fn mmio_read(&mut self, offset: u64, data: &mut [u8]) {
        if offset == 0x0fc {
            virtio_mmio::read_register(self.generation, data);
            return;
        }
        // cols, rows, max_nr_ports (one), emerg_wr (not offered).
        let mut config = [0u8; 12];
        config[0..2].copy_from_slice(&self.size.0.to_le_bytes());
        config[2..4].copy_from_slice(&self.size.1.to_le_bytes());
        config[4..8].copy_from_slice(&1u32.to_le_bytes());
        self.transport.read(offset, data, &config);
    }

    pub fn mmio_write(&mut self, offset: u64, data: &[u8], mem: &GuestMemoryMmap) {
        if offset == INSIGHT_WRITE {
            self.write_register(data, mem);
            return;
        }
        if offset == INSIGHT_WRITE_USER {
            self.write_user_register(data, mem);
            return;
        }
        // Receive buffers the guest adds are used at the next delivery; a
        // reset drops no input already received.
        if let DriverRequest::Notify(n) = self.transport.write(offset, data, mem) {
            if usize::from(n) == TX {
                self.transmit(mem);
            }
        }
    }

    /// A write of the insight register: the buffer it names goes out. A
    /// write of another width, before the driver runs, without the feature
    /// negotiated, or naming memory the guest lacks writes nothing and is
    /// counted.
    fn write_register(&mut self, data: &[u8], mem: &GuestMemoryMmap) {
        let accepted =
            self.driver_ok() && self.transport.negotiated(VIRTIO_CONSOLE_F_INSIGHT_WRITE);
        let text = <[u8; 8]>::try_from(data)
            .ok()
            .filter(|_| accepted)
            .map(u64::from_le_bytes)
            .and_then(|value| {
                let gpa = value & ((1 << 48) - 1);
                let len = (value >> 48) as usize + 1;
                let mut text = vec![0u8; len];
                mem.read_slice(&mut text, GuestAddress(gpa)).ok()?;
                Some(text)
            });
        match text {
            Some(text) => {
                self.emit(&text);
                if self.out.flush().is_err() {
                    self.stats.tx_errors += 1;
                }
            }
            None => self.stats.tx_bad_chains += 1,
        }
    }

    /// A write of the user write register: the bytes of the process's
    /// buffer its [`UserWrite`] names go out, up to the first page that
    /// does not translate, and their count goes into its `done`. A write
    /// of another width, before the driver runs, without the feature
    /// negotiated, naming memory the guest lacks or a length out of range
    /// writes nothing and is counted; so is a buffer only partly written.
    fn write_user_register(&mut self, data: &[u8], mem: &GuestMemoryMmap) {
        let read = self.user_read.filter(|_| self.driver_ok()).filter(|_| {
            self.transport
                .negotiated(VIRTIO_CONSOLE_F_INSIGHT_WRITE_USER)
        });
        let request = <[u8; 8]>::try_from(data)
            .ok()
            .zip(read)
            .map(|(value, read)| (GuestAddress(u64::from_le_bytes(value)), read))
            .and_then(|(at, read)| Some((at, UserWrite::read(mem, at)?, read)))
            .filter(|(_, w, _)| (1..=MAX_TX_CHAIN as u64).contains(&w.len));
        let Some((at, write, read)) = request else {
            self.stats.tx_bad_chains += 1;
            return;
        };
        let mut text = vec![0u8; write.len as usize];
        let done = read(mem, write.root, write.addr, &mut text);
        text.truncate(done);
        if !text.is_empty() {
            self.emit(&text);
            if self.out.flush().is_err() {
                self.stats.tx_errors += 1;
            }
        }
        if text.len() as u64 != write.len {
            self.stats.tx_bad_chains += 1;
        }
        // The structure was read whole, so its last word is there.
        let done = GuestAddress(at.0 + UserWrite::DONE);
        if mem.write_obj((text.len() as u64).to_le(), done).is_err() {
            self.stats.tx_bad_chains += 1;
        }
    }

    /// Writes `text` to the host, counted and digested.
    fn emit(&mut self, text: &[u8]) {
        self.stats.tx_buffers += 1;
        self.stats.tx_bytes += text.len() as u64;
        let (len, mut digest) = self.transmitted.unwrap_or((0, FNV_BASIS));
        for &b in text {
            digest = (digest ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        self.transmitted = Some((len + text.len() as u64, digest));
        if self.out.write_all(text).is_err() {
            self.stats.tx_errors += 1;
        }
    }

    /// Writes every buffer the guest queued for output to the host, and
    /// returns them used.
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
            let Some(text) = virtio_mmio::read_chain(&descs, mem, MAX_TX_CHAIN) else {
                self.stats.tx_bad_chains += 1;
                continue;
            };
            self.emit(&text);
        }
        if !used.is_empty() && self.out.flush().is_err() {
            self.stats.tx_errors += 1;
        }
        let Some(queue) = self.transport.queue(TX) else {
            return;
        };
        for head in used {
            if queue.add_used(mem, head, 0).is_err() {
                self.stats.tx_bad_chains += 1;
            }
        }
        // A driver that waits for its output buffers itself may ask for
        // no interrupt.
        if !virtio_mmio::interrupt_suppressed(queue, mem) {
            self.transport.signal_used();
            self.irq = true;
        }
    }

    /// Keeps host input for the guest, as much as fits; returns how many
    /// of `bytes` were kept (the rest is counted as dropped).
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(self.input_room());
        self.pending.extend(&bytes[..n]);
        self.stats.rx_overflow += (bytes.len() - n) as u64;
        n
    }

    /// How many more input bytes the device keeps.
    pub fn input_room(&self) -> usize {
        MAX_PENDING_INPUT - self.pending.len()
    }

    /// Input waiting for the guest.
    pub fn pending_input(&self) -> usize {
        self.pending.len()
    }

    /// Delivers as much waiting input as the guest has buffers for, and
    /// returns it (what a recording logs). The buffers are then taken as
    /// `deliver` takes them at replay, so that the guest gets back the
    /// same ones: none when no byte fits (not even unusable ones), and
    /// none past the last that holds a delivered byte.
    pub fn deliver_input(&mut self, mem: &GuestMemoryMmap) -> Vec<u8> {
        if self.pending.is_empty() || !self.driver_ok() {
            return Vec::new();
        }
        let start = self.transport.queue(RX).map(|q| q.next_avail());
        let chains = self.take_buffers(self.pending.len(), mem);
        let room: usize = chains.iter().filter_map(|c| c.2).sum();
        if let (Some(queue), Some(start)) = (self.transport.queue(RX), start) {
            queue.set_next_avail(start);
        }
        let bytes: Vec<u8> = self.pending.iter().take(room).copied().collect();
        if bytes.is_empty() || self.deliver(&bytes, mem).is_err() {
            return Vec::new();
        }
        self.pending.drain(..bytes.len());
        bytes
    }

    /// Delivers exactly `bytes` into the guest's receive buffers and
    /// raises the interrupt; errors, delivering nothing, if the buffers
    /// cannot hold them all.
    pub fn deliver(&mut self, bytes: &[u8], mem: &GuestMemoryMmap) -> Result<(), ConsoleError> {
        if bytes.is_empty() {
            return Ok(());
        }
        if !self.driver_ok() {
            return Err(ConsoleError::NoBuffers {
                needed: bytes.len(),
                fit: 0,
            });
        }
        let start = self.transport.queue(RX).map(|q| q.next_avail());
        let chains = self.take_buffers(bytes.len(), mem);
        let fit: usize = chains.iter().filter_map(|c| c.2).sum();
        if fit < bytes.len() {
            if let (Some(queue), Some(start)) = (self.transport.queue(RX), start) {
                queue.set_next_avail(start);
            }
            return Err(ConsoleError::NoBuffers {
                needed: bytes.len(),
                fit,
            });
        }
        self.fill(bytes, chains, mem);
        Ok(())
    }

    /// Takes receive chains, in order, until they hold `needed` bytes or
    /// the guest has no more.
    fn take_buffers(&mut self, needed: usize, mem: &GuestMemoryMmap) -> Vec<RxChain> {
        let mut chains = Vec::new();
        let mut room = 0;
        let Some(queue) = self.transport.queue(RX) else {
            return chains;
        };
        while room < needed {
            let Some(mut popped) = virtio_mmio::pop_chains(queue, mem, 1) else {
                break;
            };
            let Some((head, descs)) = popped.pop() else {
                break;
            };
            let holds = descs
                .iter()
                .all(|d| d.2)
                .then(|| descs.iter().map(|d| d.1 as usize).sum::<usize>());
            room += holds.unwrap_or(0);
            chains.push((head, descs, holds));
        }
        chains
    }

    /// Writes `bytes` into `chains` (which hold them all) in order, returns
    /// the chains used and raises the interrupt.
    fn fill(&mut self, bytes: &[u8], chains: Vec<RxChain>, mem: &GuestMemoryMmap) {
        let mut rest = bytes;
        let mut used = Vec::with_capacity(chains.len());
        for (head, descs, holds) in chains {
            let Some(holds) = holds else {
                self.stats.rx_bad_chains += 1;
                used.push((head, 0));
                continue;
            };
            let (piece, after) = rest.split_at(holds.min(rest.len()));
            rest = after;
            match virtio_mmio::write_chain(&descs, mem, piece) {
                Some(n) => {
                    self.stats.rx_bytes += u64::from(n);
                    used.push((head, n));
                }
                None => {
                    self.stats.rx_bad_chains += 1;
                    used.push((head, 0));
                }
            }
        }
        let Some(queue) = self.transport.queue(RX).filter(|_| !used.is_empty()) else {
            return;
        };
        for (head, len) in used {
            if queue.add_used(mem, head, len).is_err() {
                self.stats.rx_bad_chains += 1;
            }
        }
        self.transport.signal_used();
        self.irq = true;
    }

    /// The host terminal's size changed: the guest is told through a
    /// configuration interrupt once its driver runs. Returns whether the
    /// size differs from the one the device had.
    pub fn resize(&mut self, size: (u16, u16)) -> bool {
        if size == self.size {
            return false;
        }
        self.size = size;
        self.generation = self.generation.wrapping_add(1);
        if self.driver_ok() {
            self.transport.signal_config_change();
            self.irq = true;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio_mmio::test_driver::{offer, set_up, used_idx, used_len};

    const RXQ: [u64; 3] = [0x1000, 0x2000, 0x3000];
    const TXQ: [u64; 3] = [0x4000, 0x5000, 0x6000];
    const BUF: u64 = 0x8000;

    fn read32(dev: &mut VirtioConsole<Vec<u8>>, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        dev.mmio_read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    fn driver_sets_up(dev: &mut VirtioConsole<Vec<u8>>, mem: &GuestMemoryMmap) {
        let write = |at: u64, v: u32| dev.mmio_write(at, &v.to_le_bytes(), mem);
        set_up(
            write,
            DEVICE_FEATURES | VIRTIO_CONSOLE_F_INSIGHT_WRITE_USER,
            &[RXQ, TXQ],
        );
    }

    /// The page tables of the user write tests: under root [`ROOT`], user
    /// addresses from [`USER_VA`] map to guest memory from [`USER_PA`],
    /// 32 pages, except the page at `USER_VA + 0x3000`.
    const ROOT: u64 = 0x7000;
    const USER_VA: u64 = 0x4000_0000;
    const USER_PA: u64 = 0x10000;

    fn test_read(mem: &GuestMemoryMmap, root: u64, va: u64, buf: &mut [u8]) -> usize {
        let pa = |va: u64| {
            let page = va.checked_sub(USER_VA)? >> 12;
            (root == ROOT && page < 32 && page != 3).then(|| USER_PA + (va - USER_VA))
        };
        // Byte by byte: where the first byte user mode cannot read is.
        let readable = (0..buf.len()).take_while(|&i| {
            pa(va + i as u64)
                .is_some_and(|pa| mem.read_slice(&mut buf[i..=i], GuestAddress(pa)).is_ok())
        });
        readable.count()
    }

    fn features_offered(dev: &mut VirtioConsole<Vec<u8>>, mem: &GuestMemoryMmap) -> u64 {
        dev.mmio_write(0x014, &0u32.to_le_bytes(), mem);
        u64::from(read32(dev, 0x010))
    }

    /// A console of 80x25 whose driver set up both queues.
    fn setup() -> (VirtioConsole<Vec<u8>>, GuestMemoryMmap) {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x40000)]).unwrap();
        let mut dev = VirtioConsole::new(Vec::new(), (80, 25), Some(test_read));
        assert_eq!(read32(&mut dev, 0x008), DEVICE_ID);
        driver_sets_up(&mut dev, &mem);
        assert!(dev.driver_ok());
        (dev, mem)
    }

    #[test]
    fn queued_output_is_written_and_completed_within_the_notification() {
        let (mut dev, mem) = setup();
        mem.write_slice(b"hello, ", GuestAddress(BUF)).unwrap();
        mem.write_slice(b"world\n", GuestAddress(BUF + 0x100))
            .unwrap();
        offer(&mem, TXQ, 0, 0, BUF, 7, false);
        offer(&mem, TXQ, 1, 1, BUF + 0x100, 6, false);
        // Queued, not yet notified: nothing is written.
        assert!(dev.writer().is_empty());
        dev.mmio_write(0x050, &1u32.to_le_bytes(), &mem);
        assert_eq!(dev.writer(), b"hello, world\n");
        assert_eq!(used_idx(&mem, TXQ), 2);
        assert!(dev.take_irq());
        assert_eq!(read32(&mut dev, 0x060) & 1, 1, "used-buffer interrupt");
        let stats = dev.stats();
        assert_eq!((stats.tx_buffers, stats.tx_bytes), (2, 13));
        let (len, digest) = dev.take_transmitted().unwrap();
        assert_eq!(len, 13);
        let fnv = b"hello, world\n".iter().fold(FNV_BASIS, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
        });
        assert_eq!(digest, fnv, "one digest over the buffers, in order");
        assert_eq!(dev.take_transmitted(), None, "taken once");
        // A device-writable chain and one outside guest memory are
        // returned unwritten, and counted.
        offer(&mem, TXQ, 2, 2, BUF, 4, true);
        offer(&mem, TXQ, 3, 3, 0xffff_0000, 4, false);
        dev.mmio_write(0x050, &1u32.to_le_bytes(), &mem);
        assert_eq!(used_idx(&mem, TXQ), 4);
        assert_eq!(dev.stats().tx_bad_chains, 2);
        assert_eq!(dev.writer(), b"hello, world\n");
        assert_eq!(dev.take_transmitted(), None, "bad chains write nothing");
        assert!(dev.take_irq());
        // A driver that waits for its output itself asks for no
        // interrupt (VRING_AVAIL_F_NO_INTERRUPT): the buffer is written
        // and used all the same.
        mem.write_obj(1u16, GuestAddress(TXQ[1])).unwrap();
        mem.write_slice(b"quiet\n", GuestAddress(BUF)).unwrap();
        offer(&mem, TXQ, 4, 4, BUF, 6, false);
        dev.mmio_write(0x050, &1u32.to_le_bytes(), &mem);
        assert_eq!(dev.writer(), b"hello, world\nquiet\n");
        assert_eq!(used_idx(&mem, TXQ), 5);
        assert!(!dev.take_irq(), "an interrupt the driver asked not to have");
    }

    #[test]
    fn a_write_of_the_insight_register_writes_the_buffer_it_names() {
        let (mut dev, mem) = setup();
        let register = |gpa: u64, len: u64| (gpa | ((len - 1) << 48)).to_le_bytes();
        mem.write_slice(b"one write\n", GuestAddress(BUF)).unwrap();
        dev.mmio_write(INSIGHT_WRITE, &register(BUF, 10), &mem);
        assert_eq!(dev.writer(), b"one write\n");
        let stats = dev.stats();
        assert_eq!((stats.tx_buffers, stats.tx_bytes), (1, 10));
        let fnv = b"one write\n".iter().fold(FNV_BASIS, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
        });
        assert_eq!(
            dev.take_transmitted(),
            Some((10, fnv)),
            "digested as queued output is"
        );
        assert!(!dev.take_irq(), "nothing to complete, no interrupt");
        assert_eq!(used_idx(&mem, TXQ), 0, "the queue is not touched");
        // The longest write (65536 bytes: length field 0xffff), across
        // pages.
        let big: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
        mem.write_slice(&big, GuestAddress(0x10000)).unwrap();
        dev.mmio_write(INSIGHT_WRITE, &register(0x10000, 65536), &mem);
        assert_eq!(&dev.writer()[10..], &big[..]);
        // Memory the guest lacks, a 4-byte write, and a driver that did
        // not take the feature: nothing written, each counted.
        dev.mmio_write(INSIGHT_WRITE, &register(0x3ffff, 2), &mem);
        dev.mmio_write(INSIGHT_WRITE, &(BUF as u32).to_le_bytes(), &mem);
        assert_eq!(dev.writer().len(), 10 + 65536);
        assert_eq!(dev.stats().tx_bad_chains, 2);
        let mut plain = VirtioConsole::new(Vec::new(), (80, 25), Some(test_read));
        let write = |at: u64, v: u32| plain.mmio_write(at, &v.to_le_bytes(), &mem);
        set_up(
            write,
            VIRTIO_F_VERSION_1 | VIRTIO_CONSOLE_F_SIZE,
            &[RXQ, TXQ],
        );
        plain.mmio_write(INSIGHT_WRITE, &register(BUF, 10), &mem);
        assert!(plain.writer().is_empty());
        assert_eq!(plain.stats().tx_bad_chains, 1);
    }

    #[test]
    fn a_write_from_user_memory_goes_out_through_the_page_tables_it_names() {
        let (mut dev, mem) = setup();
        const DESC: u64 = 0x9000;
        let request = |addr: u64, len: u64, root: u64| {
            for (i, word) in [root, addr, len, 0xdead].into_iter().enumerate() {
                mem.write_obj(word, GuestAddress(DESC + 8 * i as u64))
                    .unwrap();
            }
        };
        let done = || mem.read_obj::<u64>(GuestAddress(DESC + 24)).unwrap();
        // A buffer across a page boundary: the bytes of both pages, in
        // order, digested as any output; done says all of them.
        let text = b"a line the program wrote.\n";
        mem.write_slice(text, GuestAddress(USER_PA + 0x0ff0))
            .unwrap();
        request(USER_VA + 0x0ff0, text.len() as u64, ROOT);
        dev.mmio_write(INSIGHT_WRITE_USER, &DESC.to_le_bytes(), &mem);
        assert_eq!(dev.writer(), text);
        assert_eq!(done(), text.len() as u64);
        let fnv = text.iter().fold(FNV_BASIS, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
        });
        assert_eq!(dev.take_transmitted(), Some((text.len() as u64, fnv)));
        let stats = dev.stats();
        assert_eq!(
            (stats.tx_buffers, stats.tx_bytes, stats.tx_bad_chains),
            (1, 26, 0)
        );
        assert_eq!(used_idx(&mem, TXQ), 0, "the queue is not touched");
        // Up to a page that does not translate: what comes before it goes
        // out, done says how much, the rest is the driver's to write.
        mem.write_slice(b"tail", GuestAddress(USER_PA + 0x2ffc))
            .unwrap();
        request(USER_VA + 0x2ffc, 8, ROOT);
        dev.mmio_write(INSIGHT_WRITE_USER, &DESC.to_le_bytes(), &mem);
        assert_eq!(&dev.writer()[26..], b"tail");
        assert_eq!(done(), 4);
        assert_eq!(dev.stats().tx_bad_chains, 1);
        // Another process's tables (nothing maps), no length, too long a
        // buffer, a structure outside guest memory, a 4-byte write:
        // nothing written, each counted; done is 0 where the structure
        // was taken.
        request(USER_VA, 8, ROOT + 0x1000);
        dev.mmio_write(INSIGHT_WRITE_USER, &DESC.to_le_bytes(), &mem);
        assert_eq!(done(), 0);
        for len in [0, 65537] {
            request(USER_VA, len, ROOT);
            dev.mmio_write(INSIGHT_WRITE_USER, &DESC.to_le_bytes(), &mem);
            assert_eq!(done(), 0xdead, "a request refused whole is not answered");
        }
        dev.mmio_write(INSIGHT_WRITE_USER, &0x3fff0u64.to_le_bytes(), &mem);
        dev.mmio_write(INSIGHT_WRITE_USER, &(DESC as u32).to_le_bytes(), &mem);
        assert_eq!(dev.writer().len(), 30);
        assert_eq!(dev.stats().tx_bad_chains, 6);
        // The longest buffer (16 pages from USER_VA + 0x4000) whole.
        let big: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
        mem.write_slice(&big, GuestAddress(USER_PA + 0x4000))
            .unwrap();
        request(USER_VA + 0x4000, 65536, ROOT);
        dev.mmio_write(INSIGHT_WRITE_USER, &DESC.to_le_bytes(), &mem);
        assert_eq!(&dev.writer()[30..], &big[..]);
        assert_eq!(done(), 65536);
        // Offered only by a device given the page walk; without it, or
        // with a driver that did not take it, the register writes nothing.
        assert_ne!(
            features_offered(&mut dev, &mem) & VIRTIO_CONSOLE_F_INSIGHT_WRITE_USER,
            0
        );
        let mut plain = VirtioConsole::new(Vec::new(), (80, 25), None);
        assert_eq!(
            features_offered(&mut plain, &mem) & VIRTIO_CONSOLE_F_INSIGHT_WRITE_USER,
            0
        );
        let write = |at: u64, v: u32| plain.mmio_write(at, &v.to_le_bytes(), &mem);
        set_up(write, DEVICE_FEATURES, &[RXQ, TXQ]);
        request(USER_VA + 0x0ff0, 4, ROOT);
        plain.mmio_write(INSIGHT_WRITE_USER, &DESC.to_le_bytes(), &mem);
        let mut unasked = VirtioConsole::new(Vec::new(), (80, 25), Some(test_read));
        let write = |at: u64, v: u32| unasked.mmio_write(at, &v.to_le_bytes(), &mem);
        set_up(write, DEVICE_FEATURES, &[RXQ, TXQ]);
        unasked.mmio_write(INSIGHT_WRITE_USER, &DESC.to_le_bytes(), &mem);
        for dev in [&plain, &unasked] {
            assert!(dev.writer().is_empty());
            assert_eq!(dev.stats().tx_bad_chains, 1);
        }
        assert_eq!(done(), 0xdead);
    }

    #[test]
    fn input_reaches_the_guest_only_when_delivered_and_only_into_buffers() {
        let (mut dev, mem) = setup();
        assert_eq!(dev.enqueue_input(b"ls -l\n"), 6);
        // No receive buffers: nothing goes in, the input keeps waiting.
        assert!(dev.deliver_input(&mem).is_empty());
        assert_eq!(dev.pending_input(), 6);
        assert!(!dev.take_irq());
        // Two 4-byte buffers: the recorder delivers 8 bytes at most.
        offer(&mem, RXQ, 0, 0, BUF, 4, true);
        offer(&mem, RXQ, 1, 1, BUF + 0x100, 4, true);
        assert_eq!(dev.deliver_input(&mem), b"ls -l\n");
        assert_eq!(used_idx(&mem, RXQ), 2);
        assert_eq!((used_len(&mem, RXQ, 0), used_len(&mem, RXQ, 1)), (4, 2));
        let mut got = [0u8; 6];
        mem.read_slice(&mut got[..4], GuestAddress(BUF)).unwrap();
        mem.read_slice(&mut got[4..], GuestAddress(BUF + 0x100))
            .unwrap();
        assert_eq!(&got, b"ls -l\n");
        assert!(dev.take_irq());
        assert_eq!(dev.pending_input(), 0);
        // More than the buffers hold: the rest waits for the next ones.
        offer(&mem, RXQ, 2, 2, BUF + 0x200, 3, true);
        dev.enqueue_input(b"abcdef");
        assert_eq!(dev.deliver_input(&mem), b"abc");
        assert_eq!(dev.pending_input(), 3);
    }

    #[test]
    fn the_recorder_returns_the_buffers_replay_will_return() {
        // Offered: a buffer the device cannot write, a 2-byte one, and
        // another it cannot write; 5 bytes wait.
        let offers = |mem: &GuestMemoryMmap| {
            offer(mem, RXQ, 0, 0, BUF, 8, false);
            offer(mem, RXQ, 1, 1, BUF + 0x100, 2, true);
            offer(mem, RXQ, 2, 2, BUF + 0x200, 8, false);
        };
        let (mut rec, rec_mem) = setup();
        let (mut rep, rep_mem) = setup();
        offers(&rec_mem);
        offers(&rep_mem);
        rec.enqueue_input(b"hello");
        let logged = rec.deliver_input(&rec_mem);
        assert_eq!(logged, b"he");
        rep.deliver(&logged, &rep_mem).unwrap();
        // The trailing unusable buffer stays with the guest on both sides.
        assert_eq!(used_idx(&rec_mem, RXQ), 2);
        assert_eq!(used_idx(&rep_mem, RXQ), 2);
        assert_eq!(rec.pending_input(), 3);

        // Only unusable buffers: nothing is delivered, none is returned
        // (a replay, logging nothing, returns none), no interrupt.
        let (mut rec, mem) = setup();
        offer(&mem, RXQ, 0, 0, BUF, 8, false);
        rec.enqueue_input(b"x");
        assert!(rec.deliver_input(&mem).is_empty());
        assert_eq!(used_idx(&mem, RXQ), 0);
        assert!(!rec.take_irq());
        assert_eq!(rec.pending_input(), 1);
    }

    #[test]
    fn replay_delivers_exactly_the_logged_bytes_or_nothing() {
        let (mut dev, mem) = setup();
        offer(&mem, RXQ, 0, 0, BUF, 4, true);
        // 6 bytes do not fit one 4-byte buffer: nothing is taken.
        let err = dev.deliver(b"abcdef", &mem).unwrap_err();
        assert!(matches!(err, ConsoleError::NoBuffers { needed: 6, fit: 4 }));
        assert_eq!(used_idx(&mem, RXQ), 0);
        // A device-readable buffer is returned empty; the bytes go on
        // into the next.
        offer(&mem, RXQ, 1, 1, BUF + 0x100, 8, false);
        offer(&mem, RXQ, 2, 2, BUF + 0x200, 8, true);
        dev.deliver(b"abcdef", &mem).unwrap();
        assert_eq!(used_idx(&mem, RXQ), 3);
        let lens: Vec<u32> = (0..3).map(|n| used_len(&mem, RXQ, n)).collect();
        assert_eq!(lens, [4, 0, 2]);
        assert_eq!(dev.stats().rx_bad_chains, 1);
        assert_eq!(dev.stats().rx_bytes, 6);
        // Input beyond what the device keeps is dropped and counted.
        let big = vec![b'x'; MAX_PENDING_INPUT + 10];
        assert_eq!(dev.enqueue_input(&big), MAX_PENDING_INPUT);
        assert_eq!(dev.stats().rx_overflow, 10);
    }

    #[test]
    fn a_size_change_is_configuration_and_an_interrupt() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x40000)]).unwrap();
        let mut dev = VirtioConsole::new(Vec::new(), (80, 25), None);
        // Offered: the size; read from the configuration space.
        assert_eq!(
            read32(&mut dev, 0x010) as u64,
            DEVICE_FEATURES & 0xffff_ffff
        );
        assert_eq!(read32(&mut dev, 0x100), 80 | 25 << 16);
        assert_eq!(read32(&mut dev, 0x104), 1, "one port");
        // Before the driver runs, a resize changes the configuration but
        // raises nothing.
        assert!(dev.resize((100, 30)));
        assert!(!dev.take_irq());
        assert_eq!(read32(&mut dev, 0x100), 100 | 30 << 16);
        let generation = read32(&mut dev, 0x0fc);
        driver_sets_up(&mut dev, &mem);
        assert!(!dev.resize((100, 30)), "the same size is no change");
        assert!(dev.resize((132, 43)));
        assert!(dev.take_irq());
        assert_eq!(read32(&mut dev, 0x060) & 2, 2, "configuration interrupt");
        assert_ne!(read32(&mut dev, 0x0fc), generation);
        assert_eq!(read32(&mut dev, 0x100), 132 | 43 << 16);
        // A checkpoint's state restores into a new device.
        dev.enqueue_input(b"q");
        let state = dev.state();
        let mut other = VirtioConsole::new(Vec::new(), (1, 1), None);
        other.restore(&state).unwrap();
        assert_eq!(other.state(), state);
        let mut bad = state;
        bad.pending = vec![0; MAX_PENDING_INPUT + 1];
        assert!(other.restore(&bad).is_err());
    }
}
