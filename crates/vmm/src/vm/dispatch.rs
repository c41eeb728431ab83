//! The single exit dispatch, and the bus that routes port and MMIO
//! accesses to the devices.

use super::*;

/// The single choke point for VM exits: every exit of every vCPU passes
/// here with the vCPU's id. Recording and replay hook in here only: a
/// deterministic exit comes back as the event it is (its RIP still to be
/// filled in), and at replay every value the guest reads comes from the
/// log instead of the devices.
pub(super) fn dispatch<W: Write>(
    bus: &mut Bus<'_, W>,
    journal: &mut Journal,
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
            let value = match journal.replay_read(&observed)? {
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
            let value = match journal.replay_read(&observed)? {
                Some(Entry::MmioRead { value, .. }) => value,
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
            let (value, fault) = match journal.replay_read(&observed)? {
                Some(Entry::RdMsr { value, fault, .. }) => (value, fault),
                // The paravirtual clock, and the TSC as a 1 GHz counter
                // of the same time (the guest kernel uses neither TSC
                // instruction nor MSR, but a guest may).
                _ if msr.index == journal::MSR_INSIGHT_CLOCK
                    || msr.index == journal::MSR_IA32_TSC =>
                {
                    (clock.now_ns(), false)
                }
                // Anything else KVM does not know faults, as on hardware.
                _ => (0, true),
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
            *msr.error = 1;
            let event = Entry::WrMsr {
                index: msr.index,
                rip: 0,
                value: msr.data,
                fault: true,
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
pub(super) struct Bus<'a, W: Write> {
    pub(super) platform: &'a mut LegacyPlatform<W>,
    pub(super) block: Option<&'a mut VirtioBlock>,
    pub(super) net: Option<&'a mut VirtioNet>,
    pub(super) mem: &'a GuestMemoryMmap,
}

impl<W: Write> Bus<'_, W> {
    fn mmio_read(&mut self, addr: u64, data: &mut [u8]) {
        let block = window(addr, virtio_blk::MMIO_BASE, virtio_blk::MMIO_SIZE);
        let net = window(addr, virtio_net::MMIO_BASE, virtio_net::MMIO_SIZE);
        if let (Some(dev), Some(offset)) = (self.block.as_deref_mut(), block) {
            dev.mmio_read(offset, data);
        } else if let (Some(dev), Some(offset)) = (self.net.as_deref_mut(), net) {
            dev.mmio_read(offset, data);
        } else {
            // Nothing else is mapped: reads see an empty bus.
            data.fill(0xff);
        }
    }

    fn mmio_write(&mut self, addr: u64, data: &[u8]) {
        if let (Some(block), Some(offset)) = (
            self.block.as_deref_mut(),
            window(addr, virtio_blk::MMIO_BASE, virtio_blk::MMIO_SIZE),
        ) {
            block.mmio_write(offset, data, self.mem);
        }
        if let (Some(net), Some(offset)) = (
            self.net.as_deref_mut(),
            window(addr, virtio_net::MMIO_BASE, virtio_net::MMIO_SIZE),
        ) {
            net.mmio_write(offset, data, self.mem);
        }
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
