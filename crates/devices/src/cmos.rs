//! The PC's CMOS RAM and real-time clock (MC146818) at ports 0x70/0x71.
//!
//! Linux reads the wall clock from it once at boot. The time it shows is
//! the wall-clock time the VM started at plus elapsed VM time, both given
//! by the owner, so that a replay can show the recorded time.

use serde::{Deserialize, Serialize};

pub const CMOS_PORTS: [u16; 2] = [0x70, 0x71];

const REG_SECONDS: usize = 0x00;
const REG_MINUTES: usize = 0x02;
const REG_HOURS: usize = 0x04;
const REG_WEEKDAY: usize = 0x06;
const REG_DAY: usize = 0x07;
const REG_MONTH: usize = 0x08;
const REG_YEAR: usize = 0x09;
const REG_A: usize = 0x0a;
const REG_B: usize = 0x0b;
const REG_C: usize = 0x0c;
const REG_D: usize = 0x0d;
const REG_CENTURY: usize = 0x32;

const REG_B_24H: u8 = 0x02;
const REG_B_BINARY: u8 = 0x04;

/// A calendar date and time of day (UTC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CivilTime {
    pub year: i64,
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 = Sunday.
    pub weekday: u32,
}

impl CivilTime {
    /// Converts seconds since the Unix epoch (Howard Hinnant's
    /// days-to-civil algorithm).
    pub fn from_unix(secs: u64) -> Self {
        let days = (secs / 86_400) as i64;
        let rem = secs % 86_400;
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        CivilTime {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem / 60 % 60) as u32,
            second: (rem % 60) as u32,
            weekday: ((days + 4).rem_euclid(7)) as u32,
        }
    }
}

/// CMOS RAM with the clock registers computed on read.
#[derive(Clone, Debug)]
pub struct Cmos {
    index: usize,
    ram: [u8; 128],
    boot_unix_secs: u64,
}

/// What a checkpoint keeps of the CMOS: the selected register, the RAM,
/// and the wall-clock time VM time 0 stands for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmosState {
    pub index: u8,
    pub ram: Vec<u8>,
    pub boot_unix_secs: u64,
}

impl Cmos {
    pub fn state(&self) -> CmosState {
        CmosState {
            index: self.index as u8,
            ram: self.ram.to_vec(),
            boot_unix_secs: self.boot_unix_secs,
        }
    }

    /// The CMOS as `state` describes it (`None` if it is not one).
    pub fn from_state(state: &CmosState) -> Option<Self> {
        let ram: [u8; 128] = state.ram.as_slice().try_into().ok()?;
        (usize::from(state.index) < ram.len()).then_some(Cmos {
            index: usize::from(state.index),
            ram,
            boot_unix_secs: state.boot_unix_secs,
        })
    }

    /// Makes VM time 0 stand for `boot_unix_secs` from now on (a VM
    /// restored from a boot snapshot taken at another time).
    pub fn set_boot_unix_secs(&mut self, boot_unix_secs: u64) {
        self.boot_unix_secs = boot_unix_secs;
    }

    /// `boot_unix_secs`: the wall-clock time VM time 0 stands for.
    pub fn new(boot_unix_secs: u64) -> Self {
        let mut ram = [0u8; 128];
        ram[REG_A] = 0x26; // 32.768 kHz time base, 1.024 kHz rate
        ram[REG_B] = REG_B_24H;
        ram[REG_D] = 0x80; // RAM and time valid
        Cmos {
            index: 0,
            ram,
            boot_unix_secs,
        }
    }

    fn encode(&self, v: u32) -> u8 {
        let v = (v % 100) as u8;
        if self.ram[REG_B] & REG_B_BINARY != 0 {
            v
        } else {
            ((v / 10) << 4) | (v % 10)
        }
    }

    pub fn read(&mut self, port: u16, now_ns: u64) -> u8 {
        if port == 0x70 {
            return 0xff;
        }
        let t = CivilTime::from_unix(self.boot_unix_secs + now_ns / 1_000_000_000);
        match self.index {
            REG_SECONDS => self.encode(t.second),
            REG_MINUTES => self.encode(t.minute),
            REG_HOURS => self.encode(t.hour),
            REG_WEEKDAY => self.encode(t.weekday + 1),
            REG_DAY => self.encode(t.day),
            REG_MONTH => self.encode(t.month),
            REG_YEAR => self.encode(t.year.rem_euclid(100) as u32),
            REG_CENTURY => self.encode(t.year.div_euclid(100) as u32),
            REG_A => self.ram[REG_A] & 0x7f, // never "update in progress"
            REG_C => 0,
            i => self.ram[i],
        }
    }

    pub fn write(&mut self, port: u16, value: u8) {
        if port == 0x70 {
            // Bit 7 is the NMI mask, which has no effect here.
            self.index = usize::from(value & 0x7f);
            return;
        }
        match self.index {
            // The clock is derived from VM time; setting it is ignored.
            REG_SECONDS | REG_MINUTES | REG_HOURS | REG_WEEKDAY | REG_DAY | REG_MONTH
            | REG_YEAR | REG_CENTURY | REG_C | REG_D => {}
            i => self.ram[i] = value,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_time_known_dates() {
        assert_eq!(
            CivilTime::from_unix(0),
            CivilTime {
                year: 1970,
                month: 1,
                day: 1,
                hour: 0,
                minute: 0,
                second: 0,
                weekday: 4
            }
        );
        // 2024-02-29T12:34:56Z, a Thursday.
        assert_eq!(
            CivilTime::from_unix(1_709_210_096),
            CivilTime {
                year: 2024,
                month: 2,
                day: 29,
                hour: 12,
                minute: 34,
                second: 56,
                weekday: 4
            }
        );
    }

    fn reg(c: &mut Cmos, r: u8, now: u64) -> u8 {
        c.write(0x70, r);
        c.read(0x71, now)
    }

    #[test]
    fn clock_registers_are_bcd_and_advance_with_vm_time() {
        let mut c = Cmos::new(1_709_210_096);
        assert_eq!(reg(&mut c, 0x00, 0), 0x56);
        assert_eq!(reg(&mut c, 0x02, 0), 0x34);
        assert_eq!(reg(&mut c, 0x04, 0), 0x12);
        assert_eq!(reg(&mut c, 0x07, 0), 0x29);
        assert_eq!(reg(&mut c, 0x08, 0), 0x02);
        assert_eq!(reg(&mut c, 0x09, 0), 0x24);
        assert_eq!(reg(&mut c, 0x32, 0), 0x20);
        assert_eq!(reg(&mut c, 0x00, 3_000_000_000), 0x59);
        assert_eq!(reg(&mut c, 0x0a, 0) & 0x80, 0);
    }

    #[test]
    fn binary_mode_and_ram() {
        let mut c = Cmos::new(1_709_210_096);
        c.write(0x70, 0x0b);
        c.write(0x71, REG_B_24H | REG_B_BINARY);
        assert_eq!(reg(&mut c, 0x00, 0), 56);
        c.write(0x70, 0x40);
        c.write(0x71, 0xab);
        assert_eq!(reg(&mut c, 0x40, 0), 0xab);
        c.write(0x70, 0x00);
        c.write(0x71, 0x11); // ignored
        assert_eq!(reg(&mut c, 0x00, 0), 56);
    }
}
