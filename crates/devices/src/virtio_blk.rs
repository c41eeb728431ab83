//! A virtio block device on the virtio-mmio transport (version 2), over a
//! [`CowDisk`], with completions made visible only when the VMM says so.
//!
//! Requests are taken from the queue when the guest notifies it (a VM
//! exit), and the data of writes is copied out of guest memory right then.
//! An I/O thread does the disk work. Its results are *not* given to the
//! guest when they are ready: [`VirtioBlock::publish`] copies read data
//! into guest memory, writes the status bytes, fills used-ring entries and
//! raises the interrupt, for the oldest finished requests, in submission
//! order, at a moment the caller chooses. The caller (the VMM) chooses a
//! deterministic VM exit and logs the number of completions published so
//! far (the paper's ADMA count); at replay it publishes up to the logged
//! count (RDMA) at the same exit, waiting for the disk if it is slower.
//! Nothing the I/O thread does is visible to the guest in between.
//!
//! Everything read from guest memory (descriptor chains, addresses) is
//! validated; a malformed request completes with an error status, or is
//! dropped when it has no status byte, and is counted.

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::cow_disk::{CowDisk, SectorRun, SECTOR_SIZE};
use crate::doorbell::Doorbell;
use crate::virtio_mmio::{
    self, Desc, DriverRequest, MmioTransport, TransportState, VIRTIO_F_VERSION_1,
};

/// Where the device's registers are in guest physical memory.
pub const MMIO_BASE: u64 = 0xd000_0000;
pub const MMIO_SIZE: u64 = 0x200;
/// Its PIC line.
pub const IRQ: u8 = 5;
const QUEUE_SIZE: u16 = 128;
/// The kernel command-line text that declares the device.
pub fn kernel_cmdline() -> String {
    virtio_mmio::kernel_cmdline(MMIO_BASE, MMIO_SIZE, IRQ)
}

const VIRTIO_BLK_F_SEG_MAX: u64 = 1 << 2;
const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
const DEVICE_FEATURES: u64 = VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_SEG_MAX | VIRTIO_BLK_F_FLUSH;
/// Data segments per request the driver may use.
const SEG_MAX: u32 = 126;

const REQ_IN: u32 = 0;
const REQ_OUT: u32 = 1;
const REQ_FLUSH: u32 = 4;
const REQ_GET_ID: u32 = 8;
const STATUS_OK: u8 = 0;
const STATUS_IOERR: u8 = 1;
const STATUS_UNSUPP: u8 = 2;
/// Largest request accepted (bounds host allocations).
const MAX_REQUEST_BYTES: u64 = 4 << 20;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockStats {
    pub requests: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Requests the guest formed wrongly (counted, answered with an error).
    pub bad_requests: u64,
    /// Requests the disk failed.
    pub io_errors: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("the disk I/O thread stopped")]
    WorkerGone,
    #[error("the disk overlay")]
    Overlay(#[source] std::io::Error),
    #[error("cannot start the disk I/O thread")]
    Thread(#[source] std::io::Error),
}

enum Job {
    Read {
        id: u64,
        sector: u64,
        len: usize,
    },
    Write {
        id: u64,
        sector: u64,
        data: Vec<u8>,
    },
    /// The overlay's sectors written since the last `Changes`.
    Changes(Sender<std::io::Result<Vec<SectorRun>>>),
    /// Writes sectors into the overlay (a checkpoint restored).
    Apply(Vec<SectorRun>, Sender<std::io::Result<()>>),
}

/// What a checkpoint keeps of the block device: the transport and the
/// counts. Taken only when no request is in flight, so nothing else is
/// pending; the overlay's contents go with it as sector runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub transport: TransportState,
    pub submitted: u64,
    pub published: u64,
    pub irq: bool,
    pub stats: BlockStats,
}

struct Done {
    id: u64,
    /// Read data (empty for writes), or the failure.
    result: std::io::Result<Vec<u8>>,
}

/// A request taken from the queue, in submission order.
struct InFlight {
    id: u64,
    head: u16,
    /// Device-writable buffers for read data.
    read_into: Vec<(GuestAddress, u32)>,
    /// Where the status byte goes (None: malformed, no status byte).
    status_at: Option<GuestAddress>,
    /// Known at submission (errors, flush, GET_ID): no disk work.
    immediate: Option<(u8, Vec<u8>)>,
}

pub struct VirtioBlock {
    transport: MmioTransport,
    sectors: u64,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    worker: Option<JoinHandle<()>>,
    in_flight: VecDeque<InFlight>,
    /// Results from the I/O thread, by request id.
    ready: BTreeMap<u64, std::io::Result<Vec<u8>>>,
    next_id: u64,
    /// Completions made visible to the guest so far (ADMA).
    published: u64,
    irq: bool,
    stats: BlockStats,
}

impl VirtioBlock {
    /// The I/O thread rings `doorbell` whenever a request finishes.
    pub fn new(disk: CowDisk, doorbell: Doorbell) -> Result<Self, BlockError> {
        let sectors = disk.sectors();
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let worker = std::thread::Builder::new()
            .name("disk-io".into())
            .spawn(move || io_thread(disk, jobs_rx, done_tx, doorbell))
            .map_err(BlockError::Thread)?;
        Ok(VirtioBlock {
            transport: MmioTransport::new(2, DEVICE_FEATURES, &[QUEUE_SIZE]),
            sectors,
            jobs: Some(jobs_tx),
            done: done_rx,
            worker: Some(worker),
            in_flight: VecDeque::new(),
            ready: BTreeMap::new(),
            next_id: 0,
            published: 0,
            irq: false,
            stats: BlockStats::default(),
        })
    }

    pub fn stats(&self) -> BlockStats {
        self.stats
    }

    /// Completions made visible to the guest so far.
    pub fn published(&self) -> u64 {
        self.published
    }

    /// Requests taken from the queue so far.
    pub fn submitted(&self) -> u64 {
        self.next_id
    }

    /// Whether no request is in flight: a checkpoint waits for an exit
    /// where none is.
    pub fn at_rest(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// The device's state, if it is at rest.
    pub fn state(&self) -> Option<BlockState> {
        self.at_rest().then(|| BlockState {
            transport: self.transport.state(),
            submitted: self.next_id,
            published: self.published,
            irq: self.irq,
            stats: self.stats,
        })
    }

    /// Puts the device in `state` (it must be at rest, as after creation).
    pub fn restore(&mut self, state: &BlockState) -> Result<(), String> {
        if !self.in_flight.is_empty() {
            return Err("the device has requests in flight".into());
        }
        if state.published != state.submitted {
            return Err(format!(
                "{} requests submitted but {} published: not at rest",
                state.submitted, state.published
            ));
        }
        self.transport.restore(&state.transport)?;
        self.next_id = state.submitted;
        self.published = state.published;
        self.irq = state.irq;
        self.stats = state.stats;
        Ok(())
    }

    /// The overlay's sectors written since the last call (since the
    /// device was created for the first), as runs.
    pub fn overlay_changes(&mut self) -> Result<Vec<SectorRun>, BlockError> {
        let (tx, rx) = mpsc::channel();
        self.send(Job::Changes(tx))?;
        rx.recv()
            .map_err(|_| BlockError::WorkerGone)?
            .map_err(BlockError::Overlay)
    }

    /// Writes `runs` into the overlay, as a restored checkpoint has them.
    pub fn apply_overlay(&mut self, runs: Vec<SectorRun>) -> Result<(), BlockError> {
        let (tx, rx) = mpsc::channel();
        self.send(Job::Apply(runs, tx))?;
        rx.recv()
            .map_err(|_| BlockError::WorkerGone)?
            .map_err(BlockError::Overlay)
    }

    fn send(&self, job: Job) -> Result<(), BlockError> {
        match &self.jobs {
            Some(jobs) => jobs.send(job).map_err(|_| BlockError::WorkerGone),
            None => Err(BlockError::WorkerGone),
        }
    }

    /// Whether the device raised its interrupt since the last call.
    pub fn take_irq(&mut self) -> bool {
        std::mem::take(&mut self.irq)
    }

    pub fn mmio_read(&mut self, offset: u64, data: &mut [u8]) {
        self.transport.read(offset, data, &self.config_space());
    }

    fn config_space(&self) -> [u8; 16] {
        let mut c = [0u8; 16];
        c[..8].copy_from_slice(&self.sectors.to_le_bytes());
        // size_max (unused without its feature), then seg_max.
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        c
    }

    pub fn mmio_write(&mut self, offset: u64, data: &[u8], mem: &GuestMemoryMmap) {
        match self.transport.write(offset, data, mem) {
            DriverRequest::Notify(0) => self.submit(mem),
            DriverRequest::Reset => self.reset(),
            _ => {}
        }
    }

    /// Device reset by the driver. Requests in flight still finish on the
    /// disk (their results are dropped), so ids stay in step.
    fn reset(&mut self) {
        self.published += self.in_flight.len() as u64;
        for r in self.in_flight.drain(..) {
            self.ready.remove(&r.id);
        }
    }

    /// Takes every available request from the queue.
    fn submit(&mut self, mem: &GuestMemoryMmap) {
        let Some(queue) = self.transport.queue(0) else {
            return;
        };
        let Some(chains) = virtio_mmio::pop_chains(queue, mem, usize::MAX) else {
            self.stats.bad_requests += 1;
            return;
        };
        for (head, descs) in chains {
            self.stats.requests += 1;
            let id = self.next_id;
            self.next_id += 1;
            let request = self.parse(id, head, &descs, mem);
            self.in_flight.push_back(request);
        }
    }

    /// Turns a descriptor chain into a request: a disk job, or an
    /// immediate answer.
    fn parse(&mut self, id: u64, head: u16, descs: &[Desc], mem: &GuestMemoryMmap) -> InFlight {
        let mut req = InFlight {
            id,
            head,
            read_into: Vec::new(),
            status_at: None,
            immediate: None,
        };
        let bad = |req: &mut InFlight, stats: &mut BlockStats| {
            stats.bad_requests += 1;
            req.immediate = Some((STATUS_IOERR, Vec::new()));
        };
        // Status byte: the last descriptor, device-writable.
        match descs.last() {
            Some(&(addr, len, true)) if len >= 1 => req.status_at = Some(addr),
            _ => {
                bad(&mut req, &mut self.stats);
                return req;
            }
        }
        // Header: the first descriptor, device-readable, 16 bytes.
        let mut header = [0u8; 16];
        let header_ok = match descs.first() {
            Some(&(addr, len, false)) if len >= 16 && descs.len() >= 2 => {
                mem.read_slice(&mut header, addr).is_ok()
            }
            _ => false,
        };
        if !header_ok {
            bad(&mut req, &mut self.stats);
            return req;
        }
        let kind = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
        let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
        let data = &descs[1..descs.len() - 1];
        let total: u64 = data.iter().map(|d| u64::from(d.1)).sum();
        match kind {
            REQ_IN | REQ_OUT => {
                let writable = kind == REQ_IN;
                let in_disk = sector
                    .checked_add(total / SECTOR_SIZE)
                    .is_some_and(|end| end <= self.sectors);
                if data.iter().any(|d| d.2 != writable)
                    || total > MAX_REQUEST_BYTES
                    || !total.is_multiple_of(SECTOR_SIZE)
                    || !in_disk
                {
                    bad(&mut req, &mut self.stats);
                    return req;
                }
                let job = if writable {
                    req.read_into = data.iter().map(|d| (d.0, d.1)).collect();
                    Job::Read {
                        id,
                        sector,
                        len: total as usize,
                    }
                } else {
                    // The data is taken now: later guest writes to the
                    // buffers must not change what reaches the disk.
                    let mut bytes = vec![0u8; total as usize];
                    let mut at = 0usize;
                    for d in data {
                        let end = at + d.1 as usize;
                        if mem.read_slice(&mut bytes[at..end], d.0).is_err() {
                            bad(&mut req, &mut self.stats);
                            return req;
                        }
                        at = end;
                    }
                    self.stats.bytes_written += total;
                    Job::Write {
                        id,
                        sector,
                        data: bytes,
                    }
                };
                match &self.jobs {
                    Some(jobs) if jobs.send(job).is_ok() => {}
                    _ => req.immediate = Some((STATUS_IOERR, Vec::new())),
                }
            }
            // Writes reach the overlay in order and the overlay lives only
            // as long as the run: nothing to flush beyond ordering.
            REQ_FLUSH => req.immediate = Some((STATUS_OK, Vec::new())),
            REQ_GET_ID => {
                req.read_into = data.iter().filter(|d| d.2).map(|d| (d.0, d.1)).collect();
                let mut id_bytes = b"insight-disk".to_vec();
                id_bytes.resize(20, 0);
                req.immediate = Some((STATUS_OK, id_bytes));
            }
            _ => req.immediate = Some((STATUS_UNSUPP, Vec::new())),
        }
        req
    }

    /// Moves results from the I/O thread in, without waiting.
    fn collect(&mut self) {
        while let Ok(done) = self.done.try_recv() {
            self.ready.insert(done.id, done.result);
        }
    }

    /// How many of the oldest requests are finished and can be published.
    pub fn publishable(&mut self) -> u64 {
        self.collect();
        self.in_flight
            .iter()
            .take_while(|r| r.immediate.is_some() || self.ready.contains_key(&r.id))
            .count() as u64
    }

    /// Waits until at least `count` requests can be published (replay: the
    /// recording published them here). Errors if they can never be.
    pub fn wait_publishable(&mut self, count: u64) -> Result<(), BlockError> {
        loop {
            if self.publishable() >= count {
                return Ok(());
            }
            match self.done.recv_timeout(Duration::from_secs(1)) {
                Ok(done) => {
                    self.ready.insert(done.id, done.result);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(BlockError::WorkerGone),
            }
        }
    }

    /// Makes the `count` oldest finished requests visible to the guest:
    /// data, status, used ring, interrupt. Returns how many it published.
    pub fn publish(&mut self, count: u64, mem: &GuestMemoryMmap) -> u64 {
        let count = count.min(self.publishable());
        for _ in 0..count {
            let Some(req) = self.in_flight.pop_front() else {
                break;
            };
            let (status, data) = match req.immediate {
                Some(answer) => answer,
                None => match self.ready.remove(&req.id) {
                    Some(Ok(data)) => (STATUS_OK, data),
                    Some(Err(_)) | None => {
                        self.stats.io_errors += 1;
                        (STATUS_IOERR, Vec::new())
                    }
                },
            };
            let mut written = 0u32;
            if status == STATUS_OK {
                let mut at = 0usize;
                for &(addr, len) in &req.read_into {
                    let end = (at + len as usize).min(data.len());
                    if at >= end {
                        break;
                    }
                    if mem.write_slice(&data[at..end], addr).is_err() {
                        self.stats.bad_requests += 1;
                        break;
                    }
                    written += (end - at) as u32;
                    at = end;
                }
                self.stats.bytes_read += u64::from(written);
            }
            if let Some(status_at) = req.status_at {
                if mem.write_obj(status, status_at).is_ok() {
                    written += 1;
                }
                let used = self
                    .transport
                    .queue(0)
                    .map(|q| q.add_used(mem, req.head, written));
                if !matches!(used, Some(Ok(()))) {
                    self.stats.bad_requests += 1;
                }
            }
            self.published += 1;
        }
        if count > 0 {
            self.transport.signal_used();
            self.irq = true;
        }
        count
    }
}

impl Drop for VirtioBlock {
    fn drop(&mut self) {
        self.jobs = None; // ends the I/O thread's loop
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

fn io_thread(mut disk: CowDisk, jobs: Receiver<Job>, done: Sender<Done>, doorbell: Doorbell) {
    for job in jobs {
        let (id, result) = match job {
            Job::Read { id, sector, len } => {
                let mut buf = vec![0u8; len];
                (id, disk.read(sector, &mut buf).map(|()| buf))
            }
            Job::Write { id, sector, data } => (id, disk.write(sector, &data).map(|()| Vec::new())),
            Job::Changes(reply) => {
                let _ = reply.send(disk.take_changes());
                continue;
            }
            Job::Apply(runs, reply) => {
                let _ = reply.send(disk.apply(&runs));
                continue;
            }
        };
        if done.send(Done { id, result }).is_err() {
            return;
        }
        doorbell.ring();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const HEADER: u64 = 0x4000;
    const DATA: u64 = 0x5000;
    const STATUS: u64 = 0x6000;

    fn base(name: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("insight-blk-{}-{name}", std::process::id()));
        let data: Vec<u8> = (0..8 * 512u32).map(|i| (i / 512) as u8 + 1).collect();
        std::fs::write(&path, data).unwrap();
        path
    }

    fn w32(dev: &mut VirtioBlock, mem: &GuestMemoryMmap, offset: u64, v: u32) {
        dev.mmio_write(offset, &v.to_le_bytes(), mem);
    }

    fn setup(name: &str) -> (VirtioBlock, GuestMemoryMmap, PathBuf) {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let path = base(name);
        let mut dev = VirtioBlock::new(
            CowDisk::open(&path, &std::env::temp_dir()).unwrap(),
            Doorbell::new(),
        )
        .unwrap();
        let mut magic = [0u8; 4];
        dev.mmio_read(0, &mut magic);
        assert_eq!(&magic, b"virt");
        w32(&mut dev, &mem, 0x030, 0);
        w32(&mut dev, &mem, 0x038, 8);
        w32(&mut dev, &mem, 0x080, DESC as u32);
        w32(&mut dev, &mem, 0x090, AVAIL as u32);
        w32(&mut dev, &mem, 0x0a0, USED as u32);
        w32(&mut dev, &mem, 0x044, 1);
        (dev, mem, path)
    }

    /// Writes descriptor `i` and makes chain head 0 available as entry `n`.
    fn desc(mem: &GuestMemoryMmap, i: u64, addr: u64, len: u32, write: bool, next: Option<u16>) {
        let flags: u16 = u16::from(next.is_some()) | if write { 2 } else { 0 };
        let at = DESC + 16 * i;
        mem.write_obj(addr, GuestAddress(at)).unwrap();
        mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        mem.write_obj(next.unwrap_or(0), GuestAddress(at + 14))
            .unwrap();
    }

    fn offer(dev: &mut VirtioBlock, mem: &GuestMemoryMmap, n: u16) {
        mem.write_obj(0u16, GuestAddress(AVAIL + 4 + 2 * u64::from(n)))
            .unwrap();
        mem.write_obj(n + 1, GuestAddress(AVAIL + 2)).unwrap();
        w32(dev, mem, 0x050, 0);
    }

    fn header(mem: &GuestMemoryMmap, kind: u32, sector: u64) {
        mem.write_obj(kind, GuestAddress(HEADER)).unwrap();
        mem.write_obj(sector, GuestAddress(HEADER + 8)).unwrap();
    }

    fn used_idx(mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    #[test]
    fn a_read_completes_only_when_published() {
        let (mut dev, mem, path) = setup("read");
        header(&mem, REQ_IN, 3);
        desc(&mem, 0, HEADER, 16, false, Some(1));
        desc(&mem, 1, DATA, 512, true, Some(2));
        desc(&mem, 2, STATUS, 1, true, None);
        mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        offer(&mut dev, &mem, 0);
        assert_eq!(dev.submitted(), 1);
        dev.wait_publishable(1).unwrap();
        // Finished on the disk, but the guest sees nothing yet.
        assert_eq!(used_idx(&mem), 0);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA)).unwrap(), 0);
        assert_eq!(dev.publish(1, &mem), 1);
        assert_eq!(used_idx(&mem), 1);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), STATUS_OK);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(DATA + 511)).unwrap(), 4);
        assert!(dev.take_irq());
        assert_eq!(dev.published(), 1);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn malformed_requests_are_counted_never_fatal() {
        let (mut dev, mem, path) = setup("bad");
        // Beyond the end of the disk: an I/O error status.
        header(&mem, REQ_IN, 7);
        desc(&mem, 0, HEADER, 16, false, Some(1));
        desc(&mem, 1, DATA, 1024, true, Some(2));
        desc(&mem, 2, STATUS, 1, true, None);
        offer(&mut dev, &mem, 0);
        // No status byte at all: dropped, counted.
        desc(&mem, 0, HEADER, 16, false, Some(1));
        desc(&mem, 1, DATA, 512, false, None);
        offer(&mut dev, &mem, 1);
        // A descriptor pointing outside guest memory.
        header(&mem, REQ_OUT, 0);
        desc(&mem, 0, HEADER, 16, false, Some(1));
        desc(&mem, 1, 0xffff_0000, 512, false, Some(2));
        desc(&mem, 2, STATUS, 1, true, None);
        offer(&mut dev, &mem, 2);
        dev.wait_publishable(3).unwrap();
        assert_eq!(dev.publish(3, &mem), 3);
        assert_eq!(
            mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap(),
            STATUS_IOERR
        );
        assert_eq!(dev.stats().bad_requests, 3);
        assert_eq!(
            used_idx(&mem),
            2,
            "the request without status is not returned"
        );
        std::fs::remove_file(&path).unwrap();
    }
}
