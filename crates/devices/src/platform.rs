//! The legacy PC platform insight emulates: the devices on the port bus
//! and the interrupt lines between them and the PIC.
//!
//! Everything here runs on the vCPU thread at VM exits, in the order the
//! exits happen; nothing here reads a host clock. Callers pass VM time.

use std::io::Write;

use serde::{Deserialize, Serialize};

use crate::cmos::{Cmos, CmosState};
use crate::control::{self, ControlMessage, CONTROL_PORT, CONTROL_PORTS};
use crate::pic::DualPic;
use crate::pit::{Pit, PORT_61};
use crate::serial::{SerialConsole, UartState, COM1_BASE, COM1_IRQ, UART_PORTS};

/// ISA line of the PIT's channel 0.
pub const PIT_IRQ: u8 = 0;

/// Which device a port belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortOwner {
    Pic,
    Pit,
    Port61,
    Cmos,
    Serial(u8),
    Control(u16),
    /// The POST/IO-delay port: accepted and ignored.
    Post,
    Unassigned,
}

/// Maps a port to its device.
pub fn port_owner(port: u16) -> PortOwner {
    match port {
        0x20 | 0x21 | 0xa0 | 0xa1 => PortOwner::Pic,
        0x40..=0x43 => PortOwner::Pit,
        PORT_61 => PortOwner::Port61,
        0x70 | 0x71 => PortOwner::Cmos,
        0x80 => PortOwner::Post,
        p if (COM1_BASE..COM1_BASE + UART_PORTS).contains(&p) => {
            PortOwner::Serial((p - COM1_BASE) as u8)
        }
        p if (CONTROL_PORT..CONTROL_PORT + CONTROL_PORTS).contains(&p) => {
            PortOwner::Control(p - CONTROL_PORT)
        }
        _ => PortOwner::Unassigned,
    }
}

/// Counters of accesses the platform could not make sense of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlatformStats {
    pub unassigned_reads: u64,
    pub unassigned_writes: u64,
    pub unknown_control_messages: u64,
}

/// What a checkpoint keeps of the legacy platform: every device's state.
/// Taken between exits, when no control message is waiting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlatformState {
    pub pic: DualPic,
    pub pit: Pit,
    pub cmos: CmosState,
    pub serial: UartState,
    pub stats: PlatformStats,
}

/// The legacy devices and their interrupt wiring.
pub struct LegacyPlatform<W: Write> {
    pub pic: DualPic,
    pub pit: Pit,
    pub cmos: Cmos,
    pub serial: SerialConsole<W>,
    messages: Vec<ControlMessage>,
    stats: PlatformStats,
    /// Size of the run's archive, as the control port tells `/init`.
    archive_len: u32,
}

impl<W: Write> LegacyPlatform<W> {
    /// `boot_unix_secs`: wall-clock time at VM time 0; `console`: where the
    /// guest's serial output goes.
    pub fn new(boot_unix_secs: u64, console: W) -> Self {
        LegacyPlatform {
            pic: DualPic::new(),
            pit: Pit::new(),
            cmos: Cmos::new(boot_unix_secs),
            serial: SerialConsole::new(console),
            messages: Vec::new(),
            stats: PlatformStats::default(),
            archive_len: 0,
        }
    }

    /// Sets the size of the run's archive the control port reports.
    pub fn set_archive_len(&mut self, len: u32) {
        self.archive_len = len;
    }

    pub fn state(&self) -> PlatformState {
        PlatformState {
            pic: self.pic.clone(),
            pit: self.pit.clone(),
            cmos: self.cmos.state(),
            serial: self.serial.state(),
            stats: self.stats,
        }
    }

    /// Puts every device in the state `state` gives, keeping the console
    /// writer; on an error (a state no device can be in) nothing changed
    /// but possibly the UART.
    pub fn restore(&mut self, state: &PlatformState) -> Result<(), &'static str> {
        let cmos = Cmos::from_state(&state.cmos).ok_or("the CMOS state is malformed")?;
        if !self.serial.restore(&state.serial) {
            return Err("the UART state is malformed");
        }
        self.pic = state.pic.clone();
        self.pit = state.pit.clone();
        self.cmos = cmos;
        self.stats = state.stats;
        self.messages.clear();
        Ok(())
    }

    /// A port read of `data.len()` bytes.
    pub fn port_read(&mut self, port: u16, data: &mut [u8], now_ns: u64) {
        let value = match port_owner(port) {
            PortOwner::Pic => self.pic.read(port),
            PortOwner::Pit => self.pit.read(port, now_ns),
            PortOwner::Port61 => self.pit.read_port61(now_ns),
            PortOwner::Cmos => self.cmos.read(port, now_ns),
            PortOwner::Serial(offset) => self.serial.read(offset),
            PortOwner::Control(offset) => {
                control::read(offset, data, self.archive_len);
                return;
            }
            PortOwner::Post => 0xff,
            PortOwner::Unassigned => {
                self.stats.unassigned_reads += 1;
                0xff
            }
        };
        // Byte-wide devices: wider reads see 0xff in the upper bytes.
        data.fill(0xff);
        if let Some(first) = data.first_mut() {
            *first = value;
        }
        self.route_interrupts();
    }

    /// A port write of `data.len()` bytes.
    pub fn port_write(&mut self, port: u16, data: &[u8], now_ns: u64) {
        let value = data.first().copied().unwrap_or(0);
        match port_owner(port) {
            PortOwner::Pic => self.pic.write(port, value),
            PortOwner::Pit => self.pit.write(port, value, now_ns),
            PortOwner::Port61 => self.pit.write_port61(value, now_ns),
            PortOwner::Cmos => self.cmos.write(port, value),
            PortOwner::Serial(offset) => self.serial.write(offset, value),
            PortOwner::Control(offset) => match control::decode_write(offset, data) {
                Some(ControlMessage::PitCount(count)) => {
                    if !self.pit.load_wide_count(count, now_ns) {
                        self.stats.unknown_control_messages += 1;
                    }
                }
                Some(ControlMessage::Unknown(_)) | None => self.stats.unknown_control_messages += 1,
                Some(message) => self.messages.push(message),
            },
            PortOwner::Post => {}
            PortOwner::Unassigned => self.stats.unassigned_writes += 1,
        }
        self.route_interrupts();
    }

    /// Raises the interrupts that devices asserted and timers that came
    /// due by `now_ns`.
    pub fn advance_to(&mut self, now_ns: u64) {
        if self.pit.poll(now_ns) {
            self.pic.pulse_irq(PIT_IRQ);
        }
        self.route_interrupts();
    }

    fn route_interrupts(&mut self) {
        if self.serial.take_irq() {
            self.pic.pulse_irq(COM1_IRQ);
        }
    }

    /// Host input for the serial console (at most `serial.input_room()`
    /// bytes are taken).
    pub fn receive_input(&mut self, bytes: &[u8]) {
        self.serial.enqueue_input(bytes);
        self.route_interrupts();
    }

    /// When a timer will next raise an interrupt, in VM time.
    pub fn next_timer_ns(&self) -> Option<u64> {
        self.pit.next_irq_ns()
    }

    /// Control messages from the guest since the last call, in order.
    pub fn take_messages(&mut self) -> Vec<ControlMessage> {
        std::mem::take(&mut self.messages)
    }

    pub fn stats(&self) -> PlatformStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn platform() -> LegacyPlatform<Vec<u8>> {
        let mut p = LegacyPlatform::new(0, Vec::new());
        for (port, v) in [
            (0x20, 0x11),
            (0x21, 0x30),
            (0x21, 0x04),
            (0x21, 0x01),
            (0x21, 0x00),
        ] {
            p.port_write(port, &[v], 0);
        }
        p
    }

    #[test]
    fn ports_map_to_devices() {
        assert_eq!(port_owner(0x3f8), PortOwner::Serial(0));
        assert_eq!(port_owner(0x3fd), PortOwner::Serial(5));
        assert_eq!(port_owner(0xf00), PortOwner::Control(0));
        assert_eq!(port_owner(0x43), PortOwner::Pit);
        assert_eq!(port_owner(0x2f8), PortOwner::Unassigned);
    }

    #[test]
    fn pit_tick_reaches_the_pic() {
        let mut p = platform();
        p.port_write(0x43, &[0x34], 0);
        p.port_write(0x40, &[0x9c], 0);
        p.port_write(0x40, &[0x2e], 0);
        let due = p.next_timer_ns().unwrap();
        p.advance_to(due - 1);
        assert!(!p.pic.has_pending());
        p.advance_to(due);
        assert_eq!(p.pic.acknowledge(), Some(0x30));
    }

    #[test]
    fn the_control_port_loads_the_pits_one_shot_with_a_wide_count() {
        let mut p = platform();
        let mut d = [0u8; 4];
        p.port_read(0xf0c, &mut d, 0);
        assert_ne!(u32::from_le_bytes(d) & control::FEATURE_PIT_COUNT, 0);
        // In a periodic mode the message is refused, and counted.
        p.port_write(0x43, &[0x34], 0);
        p.port_write(0xf00, &0x0d12_3456u32.to_le_bytes(), 0);
        assert_eq!(p.next_timer_ns(), None);
        assert_eq!(p.stats().unknown_control_messages, 1);
        // One-shot (mode 4, as Linux sets it): the interrupt comes that
        // many ticks later, past the 55 ms of 16 bits.
        p.port_write(0x43, &[0x38], 0);
        p.port_write(0xf00, &0x0d12_3456u32.to_le_bytes(), 1000);
        let due = p.next_timer_ns().unwrap();
        let ticks = (due - 1000) * crate::pit::PIT_HZ / 1_000_000_000;
        assert!((0x12_3455..=0x12_3456).contains(&ticks), "{ticks:#x}");
        assert!(p.take_messages().is_empty(), "the platform's own message");
        p.advance_to(due);
        assert_eq!(p.pic.acknowledge(), Some(0x30));
        assert_eq!(p.stats().unknown_control_messages, 1);
    }

    #[test]
    fn serial_interrupt_reaches_the_pic() {
        let mut p = platform();
        p.port_write(0x3f9, &[0x02], 0);
        assert_eq!(p.pic.acknowledge(), Some(0x34));
    }

    #[test]
    fn control_messages_and_unassigned_ports_are_counted() {
        let mut p = platform();
        p.port_write(0xf00, &0x0200_0007u32.to_le_bytes(), 0);
        p.port_write(0xf00, &0x0300_0000u32.to_le_bytes(), 0);
        p.port_write(0xf00, &0x5500_0000u32.to_le_bytes(), 0);
        assert_eq!(
            p.take_messages(),
            vec![ControlMessage::ExitStatus(7), ControlMessage::PowerOff]
        );
        let mut d = [0u8; 2];
        p.port_read(0x2f8, &mut d, 0);
        assert_eq!(d, [0xff, 0xff]);
        assert_eq!(
            p.stats(),
            PlatformStats {
                unassigned_reads: 1,
                unassigned_writes: 0,
                unknown_control_messages: 1
            }
        );
    }

    #[test]
    fn a_platform_restored_from_its_state_behaves_the_same() {
        let mut a = platform();
        a.port_write(0x43, &[0x34], 0);
        a.port_write(0x40, &[0x9c], 0);
        a.port_write(0x40, &[0x2e], 0);
        a.port_write(0x70, &[0x0e], 0);
        a.port_write(0x71, &[0x5a], 0);
        a.port_write(0x3f9, &[0x01], 0);
        a.receive_input(b"xy");
        let state = a.state();
        let mut b = LegacyPlatform::new(99, Vec::new());
        b.restore(&state).unwrap();
        assert_eq!(b.state(), state);
        assert_eq!(a.next_timer_ns(), b.next_timer_ns());
        for p in [&mut a, &mut b] {
            let mut d = [0u8; 1];
            p.port_read(0x3f8, &mut d, 0);
            assert_eq!(d, [b'x']);
            p.port_read(0x71, &mut d, 0);
            assert_eq!(d, [0x5a]);
        }
        let mut bad = state.clone();
        bad.cmos.ram.pop();
        assert!(b.restore(&bad).is_err());
        let mut bad = state;
        bad.serial.input = vec![0; 65];
        assert!(b.restore(&bad).is_err());
    }
}
