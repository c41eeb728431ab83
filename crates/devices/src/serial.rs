//! The 16550A UART at COM1 (vm-superio's model), wired to IRQ 4 and to a
//! host writer for the guest console.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vm_superio::{Serial, Trigger};

/// Base port and interrupt line of COM1.
pub const COM1_BASE: u16 = 0x3f8;
pub const COM1_IRQ: u8 = 4;
/// Number of registers the UART decodes.
pub const UART_PORTS: u16 = 8;

/// Records that the UART asserted its interrupt, for the platform to
/// forward to the PIC after the access. (Atomic only so that the platform
/// can move to the vCPU thread; it is never shared between threads.)
#[derive(Clone, Default)]
pub struct IrqFlag(Arc<AtomicBool>);

impl IrqFlag {
    /// Whether the line was raised since the last call.
    pub fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

impl Trigger for IrqFlag {
    type E = std::convert::Infallible;

    fn trigger(&self) -> Result<(), Self::E> {
        self.0.store(true, Ordering::Relaxed);
        Ok(())
    }
}

/// COM1 with its console writer.
pub struct SerialConsole<W: Write> {
    uart: Serial<IrqFlag, vm_superio::serial::NoEvents, W>,
    irq: IrqFlag,
}

impl<W: Write> SerialConsole<W> {
    pub fn new(out: W) -> Self {
        let irq = IrqFlag::default();
        SerialConsole {
            uart: Serial::new(irq.clone(), out),
            irq,
        }
    }

    pub fn read(&mut self, offset: u8) -> u8 {
        self.uart.read(offset)
    }

    /// A write to a UART register. Console output the host cannot take
    /// (a closed pipe) is dropped: the guest must not stop for it.
    pub fn write(&mut self, offset: u8, value: u8) {
        let _ = self.uart.write(offset, value);
    }

    /// Queues host input for the guest; returns how many bytes fit.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        let room = self.uart.fifo_capacity();
        if room == 0 || bytes.is_empty() {
            return 0;
        }
        self.uart
            .enqueue_raw_bytes(&bytes[..bytes.len().min(room)])
            .unwrap_or(0)
    }

    /// How many input bytes the receive FIFO can take now.
    pub fn input_room(&self) -> usize {
        self.uart.fifo_capacity()
    }

    /// Whether the UART raised its interrupt since the last call.
    pub fn take_irq(&mut self) -> bool {
        self.irq.take()
    }

    pub fn writer(&self) -> &W {
        self.uart.writer()
    }

    pub fn writer_mut(&mut self) -> &mut W {
        self.uart.writer_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THR: u8 = 0;
    const IER: u8 = 1;
    const IIR: u8 = 2;
    const LSR: u8 = 5;

    #[test]
    fn transmitted_bytes_reach_the_writer() {
        let mut com = SerialConsole::new(Vec::new());
        for b in b"hello\n" {
            com.write(THR, *b);
        }
        assert_eq!(com.writer().as_slice(), b"hello\n");
        assert_ne!(com.read(LSR) & 0x20, 0, "THR empty");
    }

    #[test]
    fn thr_empty_interrupt_is_raised_when_enabled() {
        let mut com = SerialConsole::new(Vec::new());
        assert!(!com.take_irq());
        com.write(IER, 0x02);
        assert!(com.take_irq());
        assert_eq!(com.read(IIR) & 0x0f, 0x02);
        assert!(!com.take_irq());
    }

    #[test]
    fn input_sets_data_ready_and_interrupts() {
        let mut com = SerialConsole::new(Vec::new());
        com.write(IER, 0x01);
        assert_eq!(com.enqueue_input(b"ab"), 2);
        assert!(com.take_irq());
        assert_ne!(com.read(LSR) & 0x01, 0);
        assert_eq!(com.read(THR), b'a');
        assert_eq!(com.read(THR), b'b');
        assert_eq!(com.read(LSR) & 0x01, 0);
    }
}
