//! Intel 8259A programmable interrupt controller, as the master/slave pair
//! of the PC (slave cascaded on master line 2).
//!
//! insight delivers every asynchronous interrupt from user space, so this
//! model, not KVM's in-kernel irqchip, decides which vector the guest sees
//! and when. Lines are edge-triggered, as the PC's ELCR leaves them for the
//! legacy devices insight emulates.

use serde::{Deserialize, Serialize};

/// I/O ports of the master and slave controllers.
pub const MASTER_PORTS: [u16; 2] = [0x20, 0x21];
pub const SLAVE_PORTS: [u16; 2] = [0xa0, 0xa1];

const CASCADE_LINE: u8 = 2;

/// Where the controller is in its initialization command sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum InitStep {
    Ready,
    Icw2,
    Icw3,
    Icw4,
}

/// One 8259A.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pic8259 {
    irr: u8,
    isr: u8,
    imr: u8,
    /// Line levels last seen, for edge detection.
    levels: u8,
    vector_base: u8,
    /// Lowest-priority line + 1 (mod 8): priority rotation.
    priority_add: u8,
    init_step: InitStep,
    icw4_needed: bool,
    single: bool,
    auto_eoi: bool,
    rotate_on_auto_eoi: bool,
    read_isr: bool,
    poll: bool,
    special_mask: bool,
}

impl Default for Pic8259 {
    fn default() -> Self {
        Self::new()
    }
}

impl Pic8259 {
    pub fn new() -> Self {
        Pic8259 {
            irr: 0,
            isr: 0,
            imr: 0xff,
            levels: 0,
            vector_base: 0,
            priority_add: 0,
            init_step: InitStep::Ready,
            icw4_needed: false,
            single: false,
            auto_eoi: false,
            rotate_on_auto_eoi: false,
            read_isr: false,
            poll: false,
            special_mask: false,
        }
    }

    /// Drives input line `line` (0..8) to `level`; a rising edge latches
    /// a request.
    pub fn set_line(&mut self, line: u8, level: bool) {
        let bit = 1u8 << (line & 7);
        if level {
            if self.levels & bit == 0 {
                self.irr |= bit;
            }
            self.levels |= bit;
        } else {
            self.levels &= !bit;
        }
    }

    /// Highest-priority set bit of `mask`, as a line number.
    fn highest_priority(&self, mask: u8) -> Option<u8> {
        (0..8u8)
            .map(|p| (p + self.priority_add) & 7)
            .find(|&line| mask & (1 << line) != 0)
    }

    /// Priority rank of a line: 0 is highest.
    fn rank(&self, line: u8) -> u8 {
        line.wrapping_sub(self.priority_add) & 7
    }

    /// The line this controller would present to the CPU now, if any.
    pub fn output(&self) -> Option<u8> {
        let requested = self.highest_priority(self.irr & !self.imr)?;
        // In special mask mode masked in-service lines do not block others.
        let in_service = if self.special_mask {
            self.isr & !self.imr
        } else {
            self.isr
        };
        match self.highest_priority(in_service) {
            Some(busy) if self.rank(busy) <= self.rank(requested) => None,
            _ => Some(requested),
        }
    }

    /// The CPU acknowledges `line`: moves it from IRR to ISR.
    fn acknowledge(&mut self, line: u8) {
        let bit = 1 << line;
        self.irr &= !bit;
        if self.auto_eoi {
            if self.rotate_on_auto_eoi {
                self.priority_add = (line + 1) & 7;
            }
        } else {
            self.isr |= bit;
        }
    }

    fn vector(&self, line: u8) -> u8 {
        self.vector_base.wrapping_add(line)
    }

    pub fn write_command(&mut self, value: u8) {
        if value & 0x10 != 0 {
            // ICW1: restart initialization.
            self.irr = 0;
            self.isr = 0;
            self.imr = 0;
            self.levels = 0;
            self.priority_add = 0;
            self.read_isr = false;
            self.poll = false;
            self.special_mask = false;
            self.auto_eoi = false;
            self.rotate_on_auto_eoi = false;
            self.icw4_needed = value & 0x01 != 0;
            self.single = value & 0x02 != 0;
            self.init_step = InitStep::Icw2;
        } else if value & 0x08 != 0 {
            // OCW3.
            if value & 0x04 != 0 {
                self.poll = true;
            }
            if value & 0x02 != 0 {
                self.read_isr = value & 0x01 != 0;
            }
            if value & 0x40 != 0 {
                self.special_mask = value & 0x20 != 0;
            }
        } else {
            // OCW2.
            let line = value & 7;
            match value >> 5 {
                0 => self.rotate_on_auto_eoi = false,
                4 => self.rotate_on_auto_eoi = true,
                1 | 5 => {
                    if let Some(top) = self.highest_priority(self.isr) {
                        self.isr &= !(1 << top);
                        if value >> 5 == 5 {
                            self.priority_add = (top + 1) & 7;
                        }
                    }
                }
                3 => self.isr &= !(1 << line),
                7 => {
                    self.isr &= !(1 << line);
                    self.priority_add = (line + 1) & 7;
                }
                6 => self.priority_add = (line + 1) & 7,
                _ => {} // 2: no operation
            }
        }
    }

    pub fn write_data(&mut self, value: u8) {
        self.init_step = match self.init_step {
            InitStep::Ready => {
                self.imr = value;
                InitStep::Ready
            }
            InitStep::Icw2 => {
                self.vector_base = value & 0xf8;
                if !self.single {
                    InitStep::Icw3
                } else if self.icw4_needed {
                    InitStep::Icw4
                } else {
                    InitStep::Ready
                }
            }
            InitStep::Icw3 if self.icw4_needed => InitStep::Icw4,
            InitStep::Icw3 => InitStep::Ready,
            InitStep::Icw4 => {
                self.auto_eoi = value & 0x02 != 0;
                InitStep::Ready
            }
        };
    }

    pub fn read_command(&mut self) -> u8 {
        if self.poll {
            self.poll = false;
            return match self.output() {
                Some(line) => {
                    self.acknowledge(line);
                    0x80 | line
                }
                None => 0,
            };
        }
        if self.read_isr {
            self.isr
        } else {
            self.irr
        }
    }

    pub fn read_data(&self) -> u8 {
        self.imr
    }

    pub fn imr(&self) -> u8 {
        self.imr
    }

    pub fn isr(&self) -> u8 {
        self.isr
    }

    pub fn irr(&self) -> u8 {
        self.irr
    }
}

/// The PC's cascaded pair (its state is all there is: a checkpoint keeps
/// it whole).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DualPic {
    pub master: Pic8259,
    pub slave: Pic8259,
}

impl DualPic {
    pub fn new() -> Self {
        DualPic {
            master: Pic8259::new(),
            slave: Pic8259::new(),
        }
    }

    /// Drives ISA line `irq` (0..16).
    pub fn set_irq(&mut self, irq: u8, level: bool) {
        if irq < 8 {
            self.master.set_line(irq, level);
        } else {
            self.slave.set_line(irq - 8, level);
        }
        self.update_cascade();
    }

    /// Raises and lowers a line: one edge-triggered request.
    pub fn pulse_irq(&mut self, irq: u8) {
        self.set_irq(irq, true);
        self.set_irq(irq, false);
    }

    fn update_cascade(&mut self) {
        let slave_out = self.slave.output().is_some();
        self.master.set_line(CASCADE_LINE, slave_out);
    }

    /// Whether an interrupt is waiting for the CPU.
    pub fn has_pending(&self) -> bool {
        self.master.output().is_some()
    }

    /// The CPU's interrupt acknowledge cycle: the vector to inject, or
    /// `None` when nothing is pending.
    pub fn acknowledge(&mut self) -> Option<u8> {
        let line = self.master.output()?;
        self.master.acknowledge(line);
        let vector = if line == CASCADE_LINE {
            match self.slave.output() {
                Some(slave_line) => {
                    self.slave.acknowledge(slave_line);
                    self.slave.vector(slave_line)
                }
                // The request went away: spurious IRQ 15.
                None => self.slave.vector(7),
            }
        } else {
            self.master.vector(line)
        };
        self.update_cascade();
        Some(vector)
    }

    pub fn read(&mut self, port: u16) -> u8 {
        let v = match port {
            0x20 => self.master.read_command(),
            0x21 => self.master.read_data(),
            0xa0 => self.slave.read_command(),
            0xa1 => self.slave.read_data(),
            _ => 0xff,
        };
        self.update_cascade();
        v
    }

    pub fn write(&mut self, port: u16, value: u8) {
        match port {
            0x20 => self.master.write_command(value),
            0x21 => self.master.write_data(value),
            0xa0 => self.slave.write_command(value),
            0xa1 => self.slave.write_data(value),
            _ => {}
        }
        self.update_cascade();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Linux's init sequence for the PC pair (arch/x86/kernel/i8259.c).
    fn linux_init(pic: &mut DualPic) {
        pic.write(0x21, 0xff);
        pic.write(0xa1, 0xff);
        pic.write(0x20, 0x11); // ICW1: edge, cascade, ICW4
        pic.write(0x21, 0x30); // ICW2: vectors 0x30..0x37
        pic.write(0x21, 0x04); // ICW3: slave on IR2
        pic.write(0x21, 0x01); // ICW4: 8086 mode, normal EOI
        pic.write(0xa0, 0x11);
        pic.write(0xa1, 0x38);
        pic.write(0xa1, 0x02);
        pic.write(0xa1, 0x01);
        pic.write(0x21, 0x00);
        pic.write(0xa1, 0x00);
    }

    #[test]
    fn masked_line_is_not_delivered_until_unmasked() {
        let mut pic = DualPic::new();
        linux_init(&mut pic);
        pic.write(0x21, 0x01);
        pic.pulse_irq(0);
        assert!(!pic.has_pending());
        pic.write(0x21, 0x00);
        assert_eq!(pic.acknowledge(), Some(0x30));
    }

    #[test]
    fn in_service_line_blocks_lower_priority_until_eoi() {
        let mut pic = DualPic::new();
        linux_init(&mut pic);
        pic.pulse_irq(0);
        assert_eq!(pic.acknowledge(), Some(0x30));
        pic.pulse_irq(4);
        assert!(!pic.has_pending(), "IRQ4 must wait for EOI of IRQ0");
        pic.pulse_irq(0);
        assert!(!pic.has_pending(), "IRQ0 is in service");
        pic.write(0x20, 0x60); // specific EOI for line 0
        assert_eq!(pic.acknowledge(), Some(0x30));
        pic.write(0x20, 0x20); // non-specific EOI
        assert_eq!(pic.acknowledge(), Some(0x34));
        assert_eq!(pic.acknowledge(), None);
    }

    #[test]
    fn higher_priority_preempts_in_service_line() {
        let mut pic = DualPic::new();
        linux_init(&mut pic);
        pic.pulse_irq(4);
        assert_eq!(pic.acknowledge(), Some(0x34));
        pic.pulse_irq(1);
        assert_eq!(pic.acknowledge(), Some(0x31));
    }

    #[test]
    fn slave_lines_cascade_through_line_2() {
        let mut pic = DualPic::new();
        linux_init(&mut pic);
        pic.pulse_irq(12);
        assert_eq!(pic.acknowledge(), Some(0x3c));
        assert_eq!(pic.master.isr(), 1 << 2);
        assert_eq!(pic.slave.isr(), 1 << 4);
        pic.write(0xa0, 0x20);
        pic.write(0x20, 0x20);
        assert_eq!(pic.master.isr(), 0);
        assert_eq!(pic.slave.isr(), 0);
    }

    /// The master in auto-EOI mode, the slave with normal EOI (Linux's
    /// setup when it asks for auto-EOI).
    #[test]
    fn an_auto_eoi_master_takes_no_eoi_and_the_slave_takes_its_own() {
        let mut pic = DualPic::new();
        linux_init(&mut pic);
        pic.write(0x20, 0x11);
        pic.write(0x21, 0x30);
        pic.write(0x21, 0x04);
        pic.write(0x21, 0x03); // ICW4: 8086 mode, auto EOI
        pic.pulse_irq(0);
        assert_eq!(pic.acknowledge(), Some(0x30));
        assert_eq!(pic.master.isr(), 0);
        // Nothing in service: the next edge and a lower line go through.
        pic.pulse_irq(0);
        pic.pulse_irq(4);
        assert_eq!(pic.acknowledge(), Some(0x30));
        assert_eq!(pic.acknowledge(), Some(0x34));
        assert_eq!(pic.acknowledge(), None);
        // A slave line: the cascade clears itself, the slave's line waits
        // for its EOI.
        pic.pulse_irq(12);
        assert_eq!(pic.acknowledge(), Some(0x3c));
        assert_eq!((pic.master.isr(), pic.slave.isr()), (0, 1 << 4));
        pic.pulse_irq(13);
        pic.pulse_irq(1);
        assert_eq!(pic.acknowledge(), Some(0x31), "the master is not held");
        assert_eq!(pic.acknowledge(), None, "IRQ13 waits for IRQ12's EOI");
        pic.write(0xa0, 0x64); // specific EOI for slave line 4
        assert_eq!(pic.acknowledge(), Some(0x3d));
    }

    #[test]
    fn edge_needs_a_falling_edge_before_the_next_request() {
        let mut pic = DualPic::new();
        linux_init(&mut pic);
        pic.set_irq(3, true);
        assert_eq!(pic.acknowledge(), Some(0x33));
        pic.write(0x20, 0x20);
        pic.set_irq(3, true); // still high: no new edge
        assert_eq!(pic.acknowledge(), None);
        pic.set_irq(3, false);
        pic.set_irq(3, true);
        assert_eq!(pic.acknowledge(), Some(0x33));
    }

    #[test]
    fn ocw3_selects_irr_or_isr_and_imr_reads_back() {
        let mut pic = DualPic::new();
        linux_init(&mut pic);
        pic.write(0x21, 0xfe);
        assert_eq!(pic.read(0x21), 0xfe);
        pic.pulse_irq(5);
        pic.write(0x20, 0x0a); // read IRR
        assert_eq!(pic.read(0x20), 1 << 5);
        pic.write(0x20, 0x0b); // read ISR
        assert_eq!(pic.read(0x20), 0);
    }

    #[test]
    fn poll_mode_acknowledges() {
        let mut pic = DualPic::new();
        linux_init(&mut pic);
        pic.pulse_irq(6);
        pic.write(0x20, 0x0c);
        assert_eq!(pic.read(0x20), 0x86);
        assert_eq!(pic.master.isr(), 1 << 6);
    }

    #[test]
    fn auto_eoi_leaves_nothing_in_service() {
        let mut pic = DualPic::new();
        pic.write(0x20, 0x11);
        pic.write(0x21, 0x08);
        pic.write(0x21, 0x04);
        pic.write(0x21, 0x03); // ICW4 with AEOI
        pic.write(0x21, 0x00);
        pic.pulse_irq(1);
        assert_eq!(pic.acknowledge(), Some(0x09));
        assert_eq!(pic.master.isr(), 0);
    }
}
