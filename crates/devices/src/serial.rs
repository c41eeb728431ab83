//! The 16550A UART at COM1 (vm-superio's model), wired to IRQ 4 and to a
//! host writer for the guest console.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};

/// Base port and interrupt line of COM1.
pub const COM1_BASE: u16 = 0x3f8;
pub const COM1_IRQ: u8 = 4;
/// Bytes the UART's receive FIFO holds (vm-superio's size).
const UART_FIFO: usize = 64;
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

/// What a checkpoint keeps of the UART: its nine registers (divisor low
/// and high, IER, IIR, LCR, LSR, MCR, MSR, scratch) and the receive FIFO.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UartState {
    pub registers: [u8; 9],
    pub input: Vec<u8>,
}

/// COM1 with its console writer.
pub struct SerialConsole<W: Write> {
    /// Always `Some` but while `restore` swaps it.
    uart: Option<Serial<IrqFlag, NoEvents, W>>,
    irq: IrqFlag,
}

impl<W: Write> SerialConsole<W> {
    pub fn new(out: W) -> Self {
        let irq = IrqFlag::default();
        SerialConsole {
            uart: Some(Serial::new(irq.clone(), out)),
            irq,
        }
    }

    fn uart(&self) -> &Serial<IrqFlag, NoEvents, W> {
        self.uart
            .as_ref()
            .expect("the UART is only taken inside restore")
    }

    fn uart_mut(&mut self) -> &mut Serial<IrqFlag, NoEvents, W> {
        self.uart
            .as_mut()
            .expect("the UART is only taken inside restore")
    }

    /// The UART's registers and receive FIFO, for a checkpoint.
    pub fn state(&self) -> UartState {
        let s = self.uart().state();
        UartState {
            registers: [
                s.baud_divisor_low,
                s.baud_divisor_high,
                s.interrupt_enable,
                s.interrupt_identification,
                s.line_control,
                s.line_status,
                s.modem_control,
                s.modem_status,
                s.scratch,
            ],
            input: s.in_buffer,
        }
    }

    /// Puts the UART in `state`, keeping the console writer. The
    /// interrupt the UART raises for a pending condition is dropped: the
    /// PIC's own state says whether it was seen. `false` if `state` is not
    /// a UART's (a receive FIFO that overflows).
    pub fn restore(&mut self, state: &UartState) -> bool {
        let [bl, bh, ie, ii, lc, ls, mc, ms, sc] = state.registers;
        let s = SerialState {
            baud_divisor_low: bl,
            baud_divisor_high: bh,
            interrupt_enable: ie,
            interrupt_identification: ii,
            line_control: lc,
            line_status: ls,
            modem_control: mc,
            modem_status: ms,
            scratch: sc,
            in_buffer: state.input.clone(),
        };
        if s.in_buffer.len() > UART_FIFO {
            return false;
        }
        let Some(old) = self.uart.take() else {
            return false;
        };
        let out = old.into_writer();
        let uart = Serial::from_state(&s, self.irq.clone(), NoEvents, out);
        // The FIFO was checked above, and the trigger cannot fail.
        self.uart = uart.ok();
        self.irq.take();
        self.uart.is_some()
    }

    pub fn read(&mut self, offset: u8) -> u8 {
        self.uart_mut().read(offset)
    }

    /// A write to a UART register. Console output the host cannot take
    /// (a closed pipe) is dropped: the guest must not stop for it.
    pub fn write(&mut self, offset: u8, value: u8) {
        let _ = self.uart_mut().write(offset, value);
    }

    /// Queues host input for the guest; returns how many bytes fit.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        let room = self.uart().fifo_capacity();
        if room == 0 || bytes.is_empty() {
            return 0;
        }
        self.uart_mut()
            .enqueue_raw_bytes(&bytes[..bytes.len().min(room)])
            .unwrap_or(0)
    }

    /// How many input bytes the receive FIFO can take now.
    pub fn input_room(&self) -> usize {
        self.uart().fifo_capacity()
    }

    /// Whether the UART raised its interrupt since the last call.
    pub fn take_irq(&mut self) -> bool {
        self.irq.take()
    }

    pub fn writer(&self) -> &W {
        self.uart().writer()
    }

    pub fn writer_mut(&mut self) -> &mut W {
        self.uart_mut().writer_mut()
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
