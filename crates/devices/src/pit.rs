//! Intel 8254 programmable interval timer (channels 0–2) and the PC's
//! port 0x61, which gates channel 2 and reads its output.
//!
//! The model keeps no thread and no host timer: every access passes the
//! current VM time in nanoseconds, and the owner asks [`Pit::poll`] whether
//! channel 0 has raised IRQ 0 and [`Pit::next_irq_ns`] when it next will.
//! That keeps the timer deterministic given the times it is shown.

/// Input clock of the PC's 8254, in Hz.
pub const PIT_HZ: u64 = 1_193_182;
/// Data ports of channels 0–2 and the mode/command port.
pub const PIT_PORTS: [u16; 4] = [0x40, 0x41, 0x42, 0x43];
/// System control port B.
pub const PORT_61: u16 = 0x61;

use serde::{Deserialize, Serialize};

const NS_PER_SEC: u64 = 1_000_000_000;

/// Which bytes of the 16-bit count a data-port access moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum ByteAccess {
    Low,
    High,
    LowThenHigh,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Channel {
    mode: u8,
    access: ByteAccess,
    /// Reload value; 0 stands for 65536. Channel 0 may take wider ones
    /// (`Pit::load_wide_count`).
    reload: u32,
    /// VM time the current count was loaded (or the gate last rose).
    loaded_at_ns: u64,
    /// Whether a count has been written since the last mode command.
    running: bool,
    gate: bool,
    /// Low byte of a count being written in two parts.
    write_low: Option<u8>,
    /// A latched count, as the two bytes still to be read.
    latched: Option<(u16, bool)>,
    latched_status: Option<u8>,
    /// Next byte of a two-part read is the high byte.
    read_high_next: bool,
    bcd: bool,
}

impl Channel {
    fn new(gate: bool) -> Self {
        Channel {
            mode: 0,
            access: ByteAccess::LowThenHigh,
            reload: 0x10000,
            loaded_at_ns: 0,
            running: false,
            gate,
            write_low: None,
            latched: None,
            latched_status: None,
            read_high_next: false,
            bcd: false,
        }
    }

    fn ticks_since_load(&self, now_ns: u64) -> u64 {
        let ns = now_ns.saturating_sub(self.loaded_at_ns);
        // 128-bit intermediate: no overflow for any realistic run.
        (u128::from(ns) * u128::from(PIT_HZ) / u128::from(NS_PER_SEC)) as u64
    }

    /// Counting element value at `now_ns`.
    fn count(&self, now_ns: u64) -> u16 {
        if !self.running {
            return (self.reload & 0xffff) as u16;
        }
        let reload = u64::from(self.reload);
        let d = self.ticks_since_load(now_ns);
        let v = match self.mode {
            2 => reload - d % reload,
            3 => (reload - (2 * d) % reload) & !1,
            _ => reload.wrapping_sub(d) & 0xffff,
        };
        (v & 0xffff) as u16
    }

    /// Output pin level at `now_ns`.
    fn output(&self, now_ns: u64) -> bool {
        if !self.running {
            return self.mode != 0;
        }
        let reload = u64::from(self.reload);
        let d = self.ticks_since_load(now_ns);
        match self.mode {
            0 | 1 => d >= reload,
            2 => d % reload != reload - 1,
            3 => d % reload < reload.div_ceil(2),
            4 | 5 => d != reload,
            _ => true,
        }
    }

    /// Period of the interrupts a periodic mode produces.
    fn period_ns(&self) -> u64 {
        (u64::from(self.reload) * NS_PER_SEC).div_ceil(PIT_HZ)
    }

    fn status(&self, now_ns: u64) -> u8 {
        let access = match self.access {
            ByteAccess::Low => 1,
            ByteAccess::High => 2,
            ByteAccess::LowThenHigh => 3,
        };
        (u8::from(self.output(now_ns)) << 7)
            | (u8::from(!self.running) << 6)
            | (access << 4)
            | (self.mode << 1)
            | u8::from(self.bcd)
    }
}

/// The three-channel timer (its state is all there is: a checkpoint
/// keeps it whole, its times in VM time).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pit {
    channels: [Channel; 3],
    speaker: bool,
    /// When channel 0 next raises IRQ 0, if it will.
    next_irq_ns: Option<u64>,
}

impl Default for Pit {
    fn default() -> Self {
        Self::new()
    }
}

impl Pit {
    pub fn new() -> Self {
        Pit {
            // Gates of channels 0 and 1 are tied high on the PC.
            channels: [Channel::new(true), Channel::new(true), Channel::new(false)],
            speaker: false,
            next_irq_ns: None,
        }
    }

    /// When channel 0 will next raise IRQ 0.
    pub fn next_irq_ns(&self) -> Option<u64> {
        self.next_irq_ns
    }

    /// Whether IRQ 0 fired since the last poll. Several missed periods
    /// collapse into one request, as they would on a PC whose CPU had
    /// interrupts disabled.
    pub fn poll(&mut self, now_ns: u64) -> bool {
        let Some(due) = self.next_irq_ns else {
            return false;
        };
        if now_ns < due {
            return false;
        }
        let ch = &self.channels[0];
        self.next_irq_ns = match ch.mode {
            2 | 3 => {
                let period = ch.period_ns().max(1);
                let since = now_ns - ch.loaded_at_ns;
                Some(ch.loaded_at_ns + (since / period + 1) * period)
            }
            _ => None,
        };
        true
    }

    fn schedule_channel0(&mut self) {
        let ch = &self.channels[0];
        self.next_irq_ns = match ch.mode {
            _ if !ch.running => None,
            0 | 2 | 3 | 4 => Some(ch.loaded_at_ns + ch.period_ns()),
            _ => None,
        };
    }

    pub fn read(&mut self, port: u16, now_ns: u64) -> u8 {
        let Some(index) = channel_index(port) else {
            return 0xff; // the command port is write-only
        };
        let ch = &mut self.channels[index];
        if let Some(status) = ch.latched_status.take() {
            return status;
        }
        let (value, high_pending) = match ch.latched {
            Some(latched) => latched,
            None => (ch.count(now_ns), ch.read_high_next),
        };
        match ch.access {
            ByteAccess::Low => {
                ch.latched = None;
                (value & 0xff) as u8
            }
            ByteAccess::High => {
                ch.latched = None;
                (value >> 8) as u8
            }
            ByteAccess::LowThenHigh => {
                if high_pending {
                    ch.latched = None;
                    ch.read_high_next = false;
                    (value >> 8) as u8
                } else {
                    if ch.latched.is_some() {
                        ch.latched = Some((value, true));
                    } else {
                        ch.read_high_next = true;
                    }
                    (value & 0xff) as u8
                }
            }
        }
    }

    pub fn write(&mut self, port: u16, value: u8, now_ns: u64) {
        if port == 0x43 {
            self.write_command(value, now_ns);
            return;
        }
        let Some(index) = channel_index(port) else {
            return;
        };
        let ch = &mut self.channels[index];
        let count = match ch.access {
            ByteAccess::Low => Some(u16::from(value)),
            ByteAccess::High => Some(u16::from(value) << 8),
            ByteAccess::LowThenHigh => match ch.write_low.take() {
                None => {
                    ch.write_low = Some(value);
                    None
                }
                Some(low) => Some(u16::from(low) | (u16::from(value) << 8)),
            },
        };
        if let Some(count) = count {
            ch.reload = if count == 0 {
                0x10000
            } else {
                u32::from(count)
            };
            ch.loaded_at_ns = now_ns;
            ch.running = true;
            if index == 0 {
                self.schedule_channel0();
            }
        }
    }

    /// Loads channel 0 with `count` ticks at once, past the 16 bits its
    /// data port takes (insight's control port, `CODE_PIT_COUNT`): a
    /// one-shot mode's interrupt comes `count` ticks from now. False, and
    /// nothing changes, in another mode or with a count of 0.
    pub fn load_wide_count(&mut self, count: u32, now_ns: u64) -> bool {
        let ch = &mut self.channels[0];
        if count == 0 || !matches!(ch.mode, 0 | 4) {
            return false;
        }
        ch.reload = count;
        ch.loaded_at_ns = now_ns;
        ch.running = true;
        ch.write_low = None;
        self.schedule_channel0();
        true
    }

    fn write_command(&mut self, value: u8, now_ns: u64) {
        let select = value >> 6;
        if select == 3 {
            // Read-back: bit 5 clear latches counts, bit 4 clear latches status.
            for (i, ch) in self.channels.iter_mut().enumerate() {
                if value & (2 << i) == 0 {
                    continue;
                }
                if value & 0x20 == 0 && ch.latched.is_none() {
                    ch.latched = Some((ch.count(now_ns), false));
                }
                if value & 0x10 == 0 && ch.latched_status.is_none() {
                    ch.latched_status = Some(ch.status(now_ns));
                }
            }
            return;
        }
        let index = usize::from(select);
        let ch = &mut self.channels[index];
        let access = (value >> 4) & 3;
        if access == 0 {
            // Counter latch command.
            if ch.latched.is_none() {
                ch.latched = Some((ch.count(now_ns), false));
            }
            return;
        }
        ch.access = match access {
            1 => ByteAccess::Low,
            2 => ByteAccess::High,
            _ => ByteAccess::LowThenHigh,
        };
        let mode = (value >> 1) & 7;
        ch.mode = if mode >= 6 { mode - 4 } else { mode };
        ch.bcd = value & 1 != 0;
        ch.running = false;
        ch.write_low = None;
        ch.latched = None;
        ch.read_high_next = false;
        if index == 0 {
            self.next_irq_ns = None;
        }
    }

    /// Port 0x61: bit 0 channel 2 gate, bit 1 speaker data, bit 5 channel
    /// 2 output, bit 4 the refresh toggle (derived from time, ~15 µs).
    pub fn read_port61(&self, now_ns: u64) -> u8 {
        let ch2 = &self.channels[2];
        let refresh = (now_ns / 15_085) & 1 != 0;
        u8::from(ch2.gate)
            | (u8::from(self.speaker) << 1)
            | (u8::from(refresh) << 4)
            | (u8::from(ch2.output(now_ns)) << 5)
    }

    pub fn write_port61(&mut self, value: u8, now_ns: u64) {
        let gate = value & 1 != 0;
        let ch2 = &mut self.channels[2];
        if gate && !ch2.gate && matches!(ch2.mode, 1 | 2 | 3 | 5) && ch2.running {
            ch2.loaded_at_ns = now_ns;
        }
        ch2.gate = gate;
        self.speaker = value & 2 != 0;
    }
}

fn channel_index(port: u16) -> Option<usize> {
    match port {
        0x40..=0x42 => Some(usize::from(port - 0x40)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn program(pit: &mut Pit, ch: u8, mode: u8, count: u16, now: u64) {
        pit.write(0x43, (ch << 6) | 0x30 | (mode << 1), now);
        pit.write(0x40 + u16::from(ch), (count & 0xff) as u8, now);
        pit.write(0x40 + u16::from(ch), (count >> 8) as u8, now);
    }

    #[test]
    fn periodic_mode_fires_every_period() {
        let mut pit = Pit::new();
        // Linux at HZ=100: LATCH = (1193182 + 50) / 100 = 11932.
        program(&mut pit, 0, 2, 11932, 0);
        let period = pit.next_irq_ns().unwrap();
        assert!((9_999_000..10_001_000).contains(&period), "{period}");
        assert!(!pit.poll(period - 1));
        assert!(pit.poll(period));
        assert!(!pit.poll(period + 1));
        assert!(pit.poll(2 * period));
        // Three missed periods collapse into one request.
        assert!(pit.poll(5 * period + 7));
        assert!(!pit.poll(5 * period + 8));
        assert_eq!(pit.next_irq_ns(), Some(6 * period));
    }

    #[test]
    fn a_wide_count_sets_a_one_shot_seconds_away_in_one_write() {
        let mut pit = Pit::new();
        // Linux's oneshot setup: mode 4, no count yet.
        pit.write(0x43, 0x38, 0);
        assert_eq!(pit.next_irq_ns(), None);
        // 10 s of ticks, more than 16 bits hold.
        assert!(pit.load_wide_count(11_931_820, 5 * MS));
        let due = pit.next_irq_ns().unwrap();
        assert!(
            (10_005 * MS - 1000..10_005 * MS + 1000).contains(&due),
            "{due}"
        );
        assert!(!pit.poll(due - 1));
        assert!(pit.poll(due));
        assert_eq!(pit.next_irq_ns(), None, "one interrupt, not a period");
        // The data port's 16-bit counts still work after it.
        program(&mut pit, 0, 4, 1193, due);
        assert!(pit.poll(due + MS + 1000));
        // Not in a periodic mode, and not a count of 0.
        program(&mut pit, 0, 2, 11932, 0);
        let periodic = pit.next_irq_ns();
        assert!(!pit.load_wide_count(11_931_820, 0));
        assert!(!pit.load_wide_count(0, 0));
        assert_eq!(pit.next_irq_ns(), periodic);
    }

    #[test]
    fn one_shot_mode_fires_once() {
        let mut pit = Pit::new();
        program(&mut pit, 0, 0, 1193, 0);
        assert!(pit.poll(MS + 1000));
        assert!(!pit.poll(100 * MS));
        assert_eq!(pit.next_irq_ns(), None);
    }

    #[test]
    fn mode_command_stops_channel_until_count_written() {
        let mut pit = Pit::new();
        program(&mut pit, 0, 2, 100, 0);
        pit.write(0x43, 0x34, 5);
        assert_eq!(pit.next_irq_ns(), None);
        assert!(!pit.poll(100 * MS));
    }

    #[test]
    fn counts_down_and_latches() {
        let mut pit = Pit::new();
        program(&mut pit, 2, 0, 0xffff, 0);
        // After 1 ms, 1193 ticks have elapsed.
        pit.write(0x43, 0x80, MS); // latch channel 2
        let lo = pit.read(0x42, 50 * MS);
        let hi = pit.read(0x42, 50 * MS);
        let count = u16::from(lo) | (u16::from(hi) << 8);
        assert_eq!(count, 0xffff - 1193);
        // Unlatched reads follow time.
        let lo = pit.read(0x42, 2 * MS);
        let hi = pit.read(0x42, 2 * MS);
        assert_eq!(u16::from(lo) | (u16::from(hi) << 8), 0xffff - 2386);
    }

    #[test]
    fn read_back_status_reports_mode_and_output() {
        let mut pit = Pit::new();
        program(&mut pit, 0, 3, 1000, 0);
        pit.write(0x43, 0xe2, 0); // read-back status of channel 0
        let status = pit.read(0x40, 0);
        assert_eq!(status & 0x3f, 0x36);
        assert_eq!(status & 0x80, 0x80, "square wave starts high");
    }

    #[test]
    fn port61_gates_channel2_and_shows_its_output() {
        let mut pit = Pit::new();
        pit.write_port61(0x01, 0);
        program(&mut pit, 2, 0, 1193, 0);
        assert_eq!(pit.read_port61(MS / 2) & 0x20, 0);
        assert_eq!(pit.read_port61(MS + 1000) & 0x21, 0x21);
    }

    #[test]
    fn square_wave_counts_by_two() {
        let mut pit = Pit::new();
        program(&mut pit, 1, 3, 100, 0);
        let ns_per_tick = NS_PER_SEC / PIT_HZ + 1;
        let lo = pit.read(0x41, 10 * ns_per_tick);
        let hi = pit.read(0x41, 10 * ns_per_tick);
        assert_eq!(u16::from(lo) | (u16::from(hi) << 8), 80);
    }
}
