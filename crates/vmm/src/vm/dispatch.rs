//! The single exit dispatch, and the bus that routes port and MMIO
//! accesses to the devices.

use std::io::Write;

use devices::virtio_9p::{self, Virtio9p};
use devices::virtio_blk::{self, VirtioBlock};
use devices::virtio_console::{self, VirtioConsole};
use devices::virtio_net::{self, VirtioNet};
use devices::LegacyPlatform;
use kvm_ioctls::VcpuExit;
use vm_memory::GuestMemoryMmap;

use super::{ExitCounts, VmClock, VmError};
use journal::{self, Entry, Replayer};

/// What the vCPU loop does after an exit.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    Continue,
    WaitForInterrupt,
    InternalError,
    /// The guest cannot continue: what happened, and details.
    Fault(String, String),
}

/// MSRs a recording answers beyond the VMM's own (`record --chaos`: the
/// seed and settings of the guest scheduler's chaos, and its decisions).
pub(crate) trait GuestMsrs {
    /// The value the guest reads from MSR `index`, if it is one of these.
    fn read_msr(&mut self, index: u32) -> Option<u64>;
    /// The guest wrote `value` to MSR `index`, one of `WRITABLE_MSRS`.
    fn write_msr(&mut self, index: u32, value: u64);
}

/// MSRs the guest may write (others fault, as on hardware): the chaos
/// scheduler's point of a decision, its user position and where the
/// program's code starts. Recording and replay accept them alike.
const WRITABLE_MSRS: [u32; 3] = [
    journal::MSR_INSIGHT_CHAOS_POINT,
    journal::MSR_INSIGHT_CHAOS_WHERE,
    journal::MSR_INSIGHT_CHAOS_CODE,
];

/// The single choke point for VM exits: every exit of every vCPU passes
/// here with the vCPU's id. Recording and replay hook in here only: a
/// deterministic exit comes back as the event it is (its RIP still to be
/// filled in), and at replay every value the guest reads comes from the
/// `log` instead of the devices (and of `msrs`, a recording's).
pub(crate) fn dispatch<W: Write>(
    bus: &mut Bus<'_, W>,
    mut log: Option<&mut Replayer>,
    msrs: Option<&mut dyn GuestMsrs>,
    clock: &VmClock,
    counts: &mut ExitCounts,
    _vcpu: u8,
    exit: VcpuExit<'_>,
) -> Result<(Next, Option<Entry>), VmError> {
    let platform = &mut *bus.platform;
    Ok(match exit {
        VcpuExit::IoIn(port, data) => {
            counts.port_io += 1;
            let size = data.len() as u8;
            let observed = Entry::In {
                port,
                size,
                rip: 0,
                value: 0,
            };
            let value = match logged(&mut log, &observed)? {
                Some(Entry::In { value, .. }) => value,
                _ => {
                    platform.port_read(port, data, clock.now_ns());
                    le_value(data) as u32
                }
            };
            fill_le(data, u64::from(value));
            (
                Next::Continue,
                Some(Entry::In {
                    port,
                    size,
                    rip: 0,
                    value,
                }),
            )
        }
        VcpuExit::IoOut(port, data) => {
            counts.port_io += 1;
            platform.port_write(port, data, clock.now_ns());
            let event = Entry::Out {
                port,
                size: data.len() as u8,
                rip: 0,
                value: le_value(data) as u32,
            };
            (Next::Continue, Some(event))
        }
        VcpuExit::MmioRead(addr, data) => {
            counts.mmio += 1;
            let size = data.len() as u8;
            let observed = Entry::MmioRead {
                addr,
                size,
                rip: 0,
                value: 0,
            };
            let value = match logged(&mut log, &observed)? {
                Some(Entry::MmioRead { value, .. }) => value,
                // The clock page: the vDSO's clock, read in user mode.
                _ if addr == journal::CLOCK_PAGE_GPA && size == 8 => clock.now_ns(),
                _ => {
                    bus.mmio_read(addr, data);
                    le_value(data)
                }
            };
            fill_le(data, value);
            (
                Next::Continue,
                Some(Entry::MmioRead {
                    addr,
                    size,
                    rip: 0,
                    value,
                }),
            )
        }
        VcpuExit::MmioWrite(addr, data) => {
            counts.mmio += 1;
            bus.mmio_write(addr, data);
            let event = Entry::MmioWrite {
                addr,
                size: data.len() as u8,
                rip: 0,
                value: le_value(data),
            };
            (Next::Continue, Some(event))
        }
        VcpuExit::X86Rdmsr(msr) => {
            counts.msr += 1;
            let observed = Entry::RdMsr {
                index: msr.index,
                rip: 0,
                value: 0,
                fault: false,
            };
            let (value, fault) = match logged(&mut log, &observed)? {
                Some(Entry::RdMsr { value, fault, .. }) => (value, fault),
                // The paravirtual clock, and the TSC as a 1 GHz counter
                // of the same time (the guest kernel uses neither TSC
                // instruction nor MSR, but a guest may).
                _ if msr.index == journal::MSR_INSIGHT_CLOCK
                    || msr.index == journal::MSR_IA32_TSC =>
                {
                    (clock.now_ns(), false)
                }
                _ => match msrs.and_then(|m| m.read_msr(msr.index)) {
                    Some(value) => (value, false),
                    // The chaos seed without chaos: 0, chaos off.
                    None if msr.index == journal::MSR_INSIGHT_CHAOS_SEED => (0, false),
                    // Anything else KVM does not know faults, as on hardware.
                    None => (0, true),
                },
            };
            *msr.data = value;
            *msr.error = u8::from(fault);
            let event = Entry::RdMsr {
                index: msr.index,
                rip: 0,
                value,
                fault,
            };
            (Next::Continue, Some(event))
        }
        VcpuExit::X86Wrmsr(msr) => {
            counts.msr += 1;
            let fault = !WRITABLE_MSRS.contains(&msr.index);
            if let (false, Some(m)) = (fault, msrs) {
                m.write_msr(msr.index, msr.data);
            }
            *msr.error = u8::from(fault);
            let event = Entry::WrMsr {
                index: msr.index,
                rip: 0,
                value: msr.data,
                fault,
            };
            (Next::Continue, Some(event))
        }
        VcpuExit::Hlt => {
            counts.halts += 1;
            (Next::WaitForInterrupt, Some(Entry::Halt { rip: 0 }))
        }
        VcpuExit::IrqWindowOpen | VcpuExit::Intr => (Next::Continue, None),
        VcpuExit::InternalError => (Next::InternalError, Some(Entry::Completed { rip: 0 })),
        VcpuExit::Shutdown => (
            Next::Fault("triple fault (shutdown)".into(), String::new()),
            None,
        ),
        VcpuExit::FailEntry(reason, _) => (
            Next::Fault(
                "entry failure".into(),
                format!(" (hardware reason {reason:#x})"),
            ),
            None,
        ),
        VcpuExit::SystemEvent(kind, _) => (
            Next::Fault(format!("system event {kind}"), String::new()),
            None,
        ),
        other => (
            Next::Fault(format!("unexpected exit {other:?}"), String::new()),
            None,
        ),
    })
}

/// The devices an exit can reach.
pub(crate) struct Bus<'a, W: Write> {
    pub(crate) platform: &'a mut LegacyPlatform<W>,
    pub(crate) block: Option<&'a mut VirtioBlock>,
    pub(crate) net: Option<&'a mut VirtioNet>,
    pub(crate) console: Option<&'a mut VirtioConsole<W>>,
    pub(crate) host_files: Option<&'a mut Virtio9p>,
    pub(crate) mem: &'a GuestMemoryMmap,
}

/// A virtio device's register window an MMIO access falls in, and the
/// offset there.
enum Mmio {
    Block(u64),
    Net(u64),
    Console(u64),
    HostFiles(u64),
    Unmapped,
}

impl Mmio {
    fn at(addr: u64) -> Self {
        if let Some(offset) = window(addr, virtio_blk::MMIO_BASE, virtio_blk::MMIO_SIZE) {
            Mmio::Block(offset)
        } else if let Some(offset) = window(addr, virtio_net::MMIO_BASE, virtio_net::MMIO_SIZE) {
            Mmio::Net(offset)
        } else if let Some(offset) =
            window(addr, virtio_console::MMIO_BASE, virtio_console::MMIO_SIZE)
        {
            Mmio::Console(offset)
        } else if let Some(offset) = window(addr, virtio_9p::MMIO_BASE, virtio_9p::MMIO_SIZE) {
            Mmio::HostFiles(offset)
        } else {
            Mmio::Unmapped
        }
    }
}

impl<W: Write> Bus<'_, W> {
    fn mmio_read(&mut self, addr: u64, data: &mut [u8]) {
        let answered = match Mmio::at(addr) {
            Mmio::Block(offset) => self.block.as_deref_mut().map(|d| d.mmio_read(offset, data)),
            Mmio::Net(offset) => self.net.as_deref_mut().map(|d| d.mmio_read(offset, data)),
            Mmio::Console(offset) => self
                .console
                .as_deref_mut()
                .map(|d| d.mmio_read(offset, data)),
            Mmio::HostFiles(offset) => self
                .host_files
                .as_deref_mut()
                .map(|d| d.mmio_read(offset, data)),
            Mmio::Unmapped => None,
        };
        if answered.is_none() {
            // Nothing is there: reads see an empty bus.
            data.fill(0xff);
        }
    }

    fn mmio_write(&mut self, addr: u64, data: &[u8]) {
        let mem = self.mem;
        match Mmio::at(addr) {
            Mmio::Block(offset) => {
                if let Some(d) = self.block.as_deref_mut() {
                    d.mmio_write(offset, data, mem);
                }
            }
            Mmio::Net(offset) => {
                if let Some(d) = self.net.as_deref_mut() {
                    d.mmio_write(offset, data, mem);
                }
            }
            Mmio::Console(offset) => {
                if let Some(d) = self.console.as_deref_mut() {
                    d.mmio_write(offset, data, mem);
                }
            }
            // Requests wait for the session, right after this exit.
            Mmio::HostFiles(offset) => {
                if let Some(d) = self.host_files.as_deref_mut() {
                    d.mmio_write(offset, data, mem);
                }
            }
            Mmio::Unmapped => {}
        }
    }
}

/// The log's answer to the read `observed`, at replay.
fn logged(log: &mut Option<&mut Replayer>, observed: &Entry) -> Result<Option<Entry>, VmError> {
    match log {
        Some(replayer) => Ok(Some(replayer.read(observed)?)),
        None => Ok(None),
    }
}

/// The offset of `addr` in the register window at `base`.
fn window(addr: u64, base: u64, size: u64) -> Option<u64> {
    let offset = addr.checked_sub(base)?;
    (offset < size).then_some(offset)
}

/// The little-endian value of up to 8 bytes.
fn le_value(data: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    let n = data.len().min(8);
    bytes[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(bytes)
}

/// Stores `value` little-endian into `data` (up to 8 bytes).
fn fill_le(data: &mut [u8], value: u64) {
    let n = data.len().min(8);
    data[..n].copy_from_slice(&value.to_le_bytes()[..n]);
}

#[cfg(test)]
mod tests {
    //! `dispatch` fed synthetic exits, as KVM would return them, without a
    //! VM: what the devices see, what comes back to the guest, and what
    //! the journal logs or checks.

    use super::*;
    use journal::testing::{header, temp_trace};
    use journal::{JournalError, Recorder};
    use kvm_ioctls::{MsrExitReason, ReadMsrExit, WriteMsrExit};
    use vm_memory::GuestAddress;

    /// How a test accounts for its exits, as the sessions do: not at all
    /// (a plain run), logged, or checked against the log.
    enum Journal {
        Live,
        Record(Box<Recorder>),
        Replay(Box<Replayer>),
    }

    impl Journal {
        fn exit(
            &mut self,
            observed: Entry,
            regs: &kvm_bindings::kvm_regs,
        ) -> Result<(), JournalError> {
            match self {
                Journal::Live => Ok(()),
                Journal::Record(r) => r.exit(observed, regs, 0),
                Journal::Replay(r) => r.exit(observed, regs),
            }
        }

        fn log(&mut self) -> Option<&mut Replayer> {
            match self {
                Journal::Replay(r) => Some(r),
                _ => None,
            }
        }
    }

    /// Everything `dispatch` needs, with the platform's wall clock at
    /// `boot_unix_secs` (CMOS reads depend on it).
    struct Harness {
        platform: LegacyPlatform<Vec<u8>>,
        mem: GuestMemoryMmap,
        clock: VmClock,
        counts: ExitCounts,
    }

    impl Harness {
        fn new(boot_unix_secs: u64) -> Self {
            Harness {
                platform: LegacyPlatform::new(boot_unix_secs, Vec::new()),
                mem: GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap(),
                clock: VmClock::new(),
                counts: ExitCounts::default(),
            }
        }

        fn run(&mut self, journal: &mut Journal, exit: VcpuExit<'_>) -> (Next, Option<Entry>) {
            self.try_run(journal, exit).unwrap()
        }

        fn try_run(
            &mut self,
            journal: &mut Journal,
            exit: VcpuExit<'_>,
        ) -> Result<(Next, Option<Entry>), VmError> {
            let mut bus = Bus {
                platform: &mut self.platform,
                block: None,
                net: None,
                console: None,
                host_files: None,
                mem: &self.mem,
            };
            dispatch(
                &mut bus,
                journal.log(),
                None,
                &self.clock,
                &mut self.counts,
                0,
                exit,
            )
        }

        /// Reads CMOS register `index` (an OUT to 0x70, an IN from 0x71),
        /// accounting both exits to `journal` as the vCPU loop does.
        fn cmos(&mut self, journal: &mut Journal, index: u8, rip: u64) -> u8 {
            let (_, out) = self.run(journal, VcpuExit::IoOut(0x70, &[index]));
            journal
                .exit(out.unwrap().with_rip(rip), &regs(rip))
                .unwrap();
            let mut data = [0u8];
            let (_, read) = self.run(journal, VcpuExit::IoIn(0x71, &mut data));
            journal
                .exit(read.unwrap().with_rip(rip + 2), &regs(rip + 2))
                .unwrap();
            data[0]
        }
    }

    fn regs(rip: u64) -> kvm_bindings::kvm_regs {
        kvm_bindings::kvm_regs {
            rip,
            ..Default::default()
        }
    }

    fn rdmsr(h: &mut Harness, journal: &mut Journal, index: u32) -> (u64, u8, Entry) {
        let (mut data, mut error) = (0u64, 0u8);
        let exit = VcpuExit::X86Rdmsr(ReadMsrExit {
            error: &mut error,
            reason: MsrExitReason::Unknown,
            index,
            data: &mut data,
        });
        let (next, entry) = h.run(journal, exit);
        assert_eq!(next, Next::Continue);
        (data, error, entry.unwrap())
    }

    #[test]
    fn port_and_mmio_exits_reach_the_devices_and_come_back_as_entries() {
        let mut h = Harness::new(1_700_000_000);
        let mut live = Journal::Live;
        // Serial output goes to the console; the exit is a logged write.
        let (next, entry) = h.run(&mut live, VcpuExit::IoOut(0x3f8, b"A"));
        assert_eq!(next, Next::Continue);
        assert_eq!(
            entry,
            Some(Entry::Out {
                port: 0x3f8,
                size: 1,
                rip: 0,
                value: u32::from(b'A')
            })
        );
        assert_eq!(h.platform.serial.writer_mut().as_slice(), b"A");
        // A read of an unassigned port and of an unmapped MMIO address
        // sees an empty bus, and the entry carries the value read.
        let mut data = [0u8; 2];
        let (_, entry) = h.run(&mut live, VcpuExit::IoIn(0x2f0, &mut data));
        assert_eq!(data, [0xff, 0xff]);
        assert!(matches!(
            entry,
            Some(Entry::In {
                port: 0x2f0,
                size: 2,
                value: 0xffff,
                ..
            })
        ));
        let mut data = [0u8; 4];
        let (_, entry) = h.run(&mut live, VcpuExit::MmioRead(0xe000_0000, &mut data));
        assert_eq!(data, [0xff; 4]);
        assert!(matches!(
            entry,
            Some(Entry::MmioRead {
                addr: 0xe000_0000,
                size: 4,
                value: 0xffff_ffff,
                ..
            })
        ));
        assert_eq!((h.counts.port_io, h.counts.mmio), (2, 1));
    }

    #[test]
    fn msr_halt_and_fatal_exits() {
        let mut h = Harness::new(0);
        let mut live = Journal::Live;
        // The paravirtual clock is VM time; an MSR nobody knows faults.
        let (clock, error, entry) = rdmsr(&mut h, &mut live, journal::MSR_INSIGHT_CLOCK);
        assert_eq!(error, 0);
        assert!(clock <= h.clock.now_ns());
        assert!(matches!(entry, Entry::RdMsr { fault: false, .. }));
        let (_, error, entry) = rdmsr(&mut h, &mut live, 0x1234);
        assert_eq!(error, 1);
        assert!(matches!(
            entry,
            Entry::RdMsr {
                index: 0x1234,
                fault: true,
                ..
            }
        ));
        // Writes to the MSRs KVM leaves to the VMM fault too.
        let mut error = 0u8;
        let exit = VcpuExit::X86Wrmsr(WriteMsrExit {
            error: &mut error,
            reason: MsrExitReason::Filter,
            index: journal::MSR_IA32_TSC,
            data: 5,
        });
        let (_, entry) = h.run(&mut live, exit);
        assert_eq!(error, 1);
        assert!(matches!(
            entry,
            Some(Entry::WrMsr {
                value: 5,
                fault: true,
                ..
            })
        ));
        // But the chaos scheduler's points, with or without chaos.
        let mut error = 1u8;
        let exit = VcpuExit::X86Wrmsr(WriteMsrExit {
            error: &mut error,
            reason: MsrExitReason::Unknown,
            index: journal::MSR_INSIGHT_CHAOS_POINT,
            data: 0x102,
        });
        let (_, entry) = h.run(&mut live, exit);
        assert_eq!(error, 0);
        assert!(matches!(
            entry,
            Some(Entry::WrMsr {
                value: 0x102,
                fault: false,
                ..
            })
        ));
        assert_eq!(
            h.run(&mut live, VcpuExit::Hlt),
            (Next::WaitForInterrupt, Some(Entry::Halt { rip: 0 }))
        );
        // Kicks and windows are not deterministic: no entry.
        assert_eq!(h.run(&mut live, VcpuExit::Intr), (Next::Continue, None));
        assert!(matches!(
            h.run(&mut live, VcpuExit::Shutdown),
            (Next::Fault(..), None)
        ));
        assert_eq!(
            h.run(&mut live, VcpuExit::InternalError),
            (Next::InternalError, Some(Entry::Completed { rip: 0 }))
        );
    }

    #[test]
    fn replay_answers_reads_from_the_log_and_never_asks_the_device() {
        let dir = temp_trace("dispatch-reads");
        let writer = trace::TraceWriter::create(&dir, &header(1)).unwrap();
        let mut record = Journal::Record(Box::new(Recorder::new(writer, 1)));
        let mut h = Harness::new(1_700_000_000);
        let year = h.cmos(&mut record, 0x09, 0x100);
        let (clock, _, entry) = rdmsr(&mut h, &mut record, journal::MSR_INSIGHT_CLOCK);
        record.exit(entry.with_rip(0x200), &regs(0x200)).unwrap();
        let Journal::Record(r) = record else {
            unreachable!()
        };
        r.finish(journal::EndReason::PowerOff, 0).unwrap();

        // The same exits on a platform whose wall clock is years later:
        // the guest reads what the recording read.
        let reader = trace::TraceReader::open(&dir).unwrap();
        let mut replay = Journal::Replay(Box::new(Replayer::new(reader)));
        let mut later = Harness::new(1_900_000_000);
        assert_ne!(later.cmos(&mut Journal::Live, 0x09, 0), year);
        assert_eq!(later.cmos(&mut replay, 0x09, 0x100), year);
        let (replayed, _, entry) = rdmsr(&mut later, &mut replay, journal::MSR_INSIGHT_CLOCK);
        assert_eq!(replayed, clock);
        replay.exit(entry.with_rip(0x200), &regs(0x200)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn replay_stops_at_an_exit_the_recording_did_not_make() {
        let dir = temp_trace("dispatch-mismatch");
        let writer = trace::TraceWriter::create(&dir, &header(1)).unwrap();
        let mut record = Journal::Record(Box::new(Recorder::new(writer, 1)));
        let mut h = Harness::new(0);
        h.cmos(&mut record, 0x00, 0x100);
        let Journal::Record(r) = record else {
            unreachable!()
        };
        r.finish(journal::EndReason::PowerOff, 0).unwrap();

        let reader = trace::TraceReader::open(&dir).unwrap();
        let mut replay = Journal::Replay(Box::new(Replayer::new(reader)));
        let (_, out) = h.run(&mut replay, VcpuExit::IoOut(0x70, &[0x00]));
        replay
            .exit(out.unwrap().with_rip(0x100), &regs(0x100))
            .unwrap();
        // The recording read port 0x71 here; a read of another port is
        // caught before any device answers it.
        let mut data = [0u8];
        match h.try_run(&mut replay, VcpuExit::IoIn(0x61, &mut data)) {
            Err(VmError::Journal(JournalError::Diverged(d))) => assert_eq!(d.exit, 2),
            other => panic!(
                "expected a divergence at exit 2, got {:?}",
                other.map(|r| r.0)
            ),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
