//! insight's platform control port: how the guest tells the hypervisor
//! that it powered off, panicked, reached `/init`, is ready for the run's
//! files, what its command exited with, and that an event was raised.
//!
//! Protocol (shared with the guest kernel patch and `/init`): 32-bit
//! writes to port 0x0f00; bits 31..24 are the code, bits 23..0 the
//! argument. Reads return `CONTROL_SIGNATURE` so a guest can detect insight.
//! A 32-bit write to port 0x0f04 (`EVENT_PORT`) is a probe raising an event
//! directly from user mode (docs/events.md), when the guest kernel granted
//! the process that port. A 32-bit read of port 0x0f08 (`ARCHIVE_PORT`)
//! returns the size of the run's archive, which `/init` then fetches with
//! `CODE_FETCH` messages (docs/ARCHITECTURE.md, "Boot snapshots"). The
//! guest kernel hands the VMM its larger copies to and from user memory
//! (`CODE_COPY`), and loads the PIT's channel 0 with counts wider than 16
//! bits (`CODE_PIT_COUNT`), where a 32-bit read of port 0x0f0c
//! (`FEATURES_PORT`) says the VMM takes them. `/init` relays the
//! command's standard output and error, where they are pipes, to the
//! host's (`CODE_OUTPUT`), and asks for its standard input, where that is
//! a pipe (`CODE_INPUT`).

pub const CONTROL_PORT: u16 = 0x0f00;
/// Ports the device decodes (four 32-bit registers).
pub const CONTROL_PORTS: u16 = 16;
/// The user-mode event doorbell.
pub const EVENT_PORT: u16 = 0x0f04;
/// Reads: the size of the run's archive in bytes.
pub const ARCHIVE_PORT: u16 = 0x0f08;
/// Reads: what this VMM offers the guest kernel, `FEATURE_*` bits (bit
/// 31 always clear: a read where nothing answers gives all ones).
pub const FEATURES_PORT: u16 = 0x0f0c;
/// The PIT's channel 0 takes counts of up to 24 bits (`CODE_PIT_COUNT`).
pub const FEATURE_PIT_COUNT: u32 = 1 << 0;
/// Everything this VMM offers.
pub const FEATURES: u32 = FEATURE_PIT_COUNT;
/// Read value: "INSG".
pub const CONTROL_SIGNATURE: u32 = 0x4753_4e49;

const CODE_INIT_REACHED: u8 = 0x01;
const CODE_EXIT_STATUS: u8 = 0x02;
const CODE_POWER_OFF: u8 = 0x03;
const CODE_PANIC: u8 = 0x04;
const CODE_SYNC: u8 = 0x05;
const CODE_EVENT: u8 = 0x06;
const CODE_SWITCH_RING: u8 = 0x07;
const CODE_PREEMPT_AREA: u8 = 0x08;
const CODE_READY: u8 = 0x09;
const CODE_FETCH: u8 = 0x0a;
const CODE_TERMINAL: u8 = 0x0b;
const CODE_COPY: u8 = 0x0c;
const CODE_PIT_COUNT: u8 = 0x0d;
const CODE_OUTPUT: u8 = 0x0e;
const CODE_INPUT: u8 = 0x0f;
/// An argument flag of `CODE_INIT_REACHED`: `/init` will say which
/// terminal the command has (`CODE_TERMINAL`). An `/init` from before that
/// message gives its command the serial console.
const INIT_ANNOUNCES_TERMINAL: u32 = 1;
/// Arguments of `CODE_EVENT`: who raised the event.
const EVENT_FROM_PROBE: u32 = 0;
const EVENT_FROM_KERNEL: u32 = 1;

/// How an event reached the hypervisor, which says where its buffer
/// address and the raiser's identity are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventRaiser {
    /// A probe's int3, forwarded by the guest kernel: buffer in RSI, the
    /// raiser's `tgid << 32 | pid` in RDI.
    ProbeTrap,
    /// The guest kernel's own event: the same registers.
    Kernel,
    /// A probe's write to `EVENT_PORT` from user mode: buffer in RAX; the
    /// raiser is the task the last context switch named.
    ProbePort,
}

/// A message from the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControlMessage {
    /// User space `/init` started; whether it will say which terminal
    /// the command has (`Terminal`: else the serial console).
    InitReached { announces_terminal: bool },
    /// The guest command finished with this status (0..=255).
    ExitStatus(u8),
    /// The guest kernel powered off.
    PowerOff,
    /// The guest kernel panicked.
    Panic,
    /// A deterministic point the guest kernel adds on entries from user
    /// mode (and, with probes, on the way back to user mode after a
    /// switch, argument 1: no kernel entry); nothing else happens.
    Sync,
    /// An event was raised (docs/events.md).
    Event(EventRaiser),
    /// The guest kernel's context-switch ring is at the guest physical
    /// address in RSI (docs/events.md).
    SwitchRing,
    /// Where the current task maps the trampoline pages, and where those
    /// pages are: the area at the guest physical address in RSI
    /// (docs/ARCHITECTURE.md, "Asynchronous points").
    PreemptArea,
    /// `/init` has mounted its file systems and waits for the run's
    /// archive: the moment a boot snapshot is taken, and after which the
    /// disk and network devices answer.
    Ready,
    /// `/init` asks for the part of the run's archive at offset RDX, to be
    /// written to its buffer at virtual address RSI of RDI bytes.
    Fetch,
    /// `/init` opened the command's terminal: the virtio console (`true`;
    /// input and the terminal's size reach it from now on, before which
    /// its driver would drop them) or the serial console.
    Terminal { virtio: bool },
    /// The guest kernel asks the VMM to copy RCX bytes from virtual
    /// address RSI to RDI (to or from user memory, or a page it clears or
    /// copies: patches 0013 and 0015) and to write the count of bytes it
    /// could not copy to the u64 at virtual address R8.
    Copy,
    /// The guest kernel loads the PIT's channel 0 (in a one-shot mode)
    /// with this count of its input clock's ticks, 1 to 2^24 - 1: one
    /// exit instead of two byte writes, and up to 14 s where 16 bits give
    /// 55 ms between the interrupts of a stopped tick.
    PitCount(u32),
    /// `/init` relays what the command wrote to its standard output
    /// (`stream` 1) or error (2), a pipe in the guest where the host's
    /// is not a terminal: RDI bytes at virtual address RSI, for the
    /// host's stream of that number.
    Output { stream: u8 },
    /// `/init` asks for the command's standard input, a pipe in the guest
    /// where the host's is not a terminal: at most RDI bytes into its
    /// buffer at virtual address RSI, and in the u64 at virtual address R8
    /// how many were written, bit 63 set where the input ended after them
    /// (0: none yet).
    Input,
    /// A write this version does not understand.
    Unknown(u32),
}

impl ControlMessage {
    pub fn decode(value: u32) -> Self {
        let arg = value & 0x00ff_ffff;
        match (value >> 24) as u8 {
            CODE_INIT_REACHED => ControlMessage::InitReached {
                announces_terminal: arg & INIT_ANNOUNCES_TERMINAL != 0,
            },
            CODE_EXIT_STATUS if arg <= 0xff => ControlMessage::ExitStatus(arg as u8),
            CODE_POWER_OFF => ControlMessage::PowerOff,
            CODE_PANIC => ControlMessage::Panic,
            CODE_SYNC => ControlMessage::Sync,
            CODE_EVENT if arg == EVENT_FROM_PROBE => ControlMessage::Event(EventRaiser::ProbeTrap),
            CODE_EVENT if arg == EVENT_FROM_KERNEL => ControlMessage::Event(EventRaiser::Kernel),
            CODE_SWITCH_RING => ControlMessage::SwitchRing,
            CODE_PREEMPT_AREA => ControlMessage::PreemptArea,
            CODE_READY => ControlMessage::Ready,
            CODE_FETCH => ControlMessage::Fetch,
            CODE_TERMINAL if arg <= 1 => ControlMessage::Terminal { virtio: arg == 1 },
            CODE_COPY if arg == 0 => ControlMessage::Copy,
            CODE_PIT_COUNT if arg > 0 => ControlMessage::PitCount(arg),
            CODE_OUTPUT if arg == 1 || arg == 2 => ControlMessage::Output { stream: arg as u8 },
            CODE_INPUT if arg == 0 => ControlMessage::Input,
            _ => ControlMessage::Unknown(value),
        }
    }
}

/// Decodes a port write of any width at `offset` into the register.
/// Only full 32-bit writes at offset 0 carry a message.
pub fn decode_write(offset: u16, data: &[u8]) -> Option<ControlMessage> {
    let bytes: [u8; 4] = data.try_into().ok()?;
    match offset {
        0 => Some(ControlMessage::decode(u32::from_le_bytes(bytes))),
        o if o == EVENT_PORT - CONTROL_PORT => Some(ControlMessage::Event(EventRaiser::ProbePort)),
        _ => None,
    }
}

/// The bytes a read of `data.len()` bytes at `offset` returns, the run's
/// archive being `archive_len` bytes long.
pub fn read(offset: u16, data: &mut [u8], archive_len: u32) {
    let mut regs = [0xffu8; CONTROL_PORTS as usize];
    regs[..4].copy_from_slice(&CONTROL_SIGNATURE.to_le_bytes());
    let archive = usize::from(ARCHIVE_PORT - CONTROL_PORT);
    regs[archive..archive + 4].copy_from_slice(&archive_len.to_le_bytes());
    let features = usize::from(FEATURES_PORT - CONTROL_PORT);
    regs[features..features + 4].copy_from_slice(&FEATURES.to_le_bytes());
    for (i, b) in data.iter_mut().enumerate() {
        *b = regs.get(usize::from(offset) + i).copied().unwrap_or(0xff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_guest_protocol() {
        assert_eq!(
            ControlMessage::decode(0x0100_0000),
            ControlMessage::InitReached {
                announces_terminal: false
            }
        );
        assert_eq!(
            ControlMessage::decode(0x0100_0001),
            ControlMessage::InitReached {
                announces_terminal: true
            }
        );
        assert_eq!(
            ControlMessage::decode(0x0200_0003),
            ControlMessage::ExitStatus(3)
        );
        assert_eq!(
            ControlMessage::decode(0x0200_00ff),
            ControlMessage::ExitStatus(255)
        );
        assert_eq!(
            ControlMessage::decode(0x0200_0100),
            ControlMessage::Unknown(0x0200_0100)
        );
        assert_eq!(
            ControlMessage::decode(0x0300_0000),
            ControlMessage::PowerOff
        );
        assert_eq!(ControlMessage::decode(0x0400_0000), ControlMessage::Panic);
        assert_eq!(ControlMessage::decode(0x0500_0000), ControlMessage::Sync);
        assert_eq!(ControlMessage::decode(0x0500_0001), ControlMessage::Sync);
        assert_eq!(
            ControlMessage::decode(0x0700_0000),
            ControlMessage::SwitchRing
        );
        assert_eq!(
            ControlMessage::decode(0x0600_0001),
            ControlMessage::Event(EventRaiser::Kernel)
        );
        assert_eq!(
            ControlMessage::decode(0x0600_0002),
            ControlMessage::Unknown(0x0600_0002)
        );
        assert_eq!(ControlMessage::decode(0x0900_0000), ControlMessage::Ready);
        assert_eq!(ControlMessage::decode(0x0a00_0000), ControlMessage::Fetch);
        assert_eq!(
            ControlMessage::decode(0x0b00_0001),
            ControlMessage::Terminal { virtio: true }
        );
        assert_eq!(
            ControlMessage::decode(0x0b00_0000),
            ControlMessage::Terminal { virtio: false }
        );
        assert_eq!(
            ControlMessage::decode(0x0b00_0002),
            ControlMessage::Unknown(0x0b00_0002)
        );
        assert_eq!(ControlMessage::decode(0x0c00_0000), ControlMessage::Copy);
        assert_eq!(
            ControlMessage::decode(0x0dff_ffff),
            ControlMessage::PitCount(0xff_ffff)
        );
        assert_eq!(
            ControlMessage::decode(0x0d00_0000),
            ControlMessage::Unknown(0x0d00_0000)
        );
        assert_eq!(
            ControlMessage::decode(0x0c00_0001),
            ControlMessage::Unknown(0x0c00_0001)
        );
        assert_eq!(
            ControlMessage::decode(0x0e00_0001),
            ControlMessage::Output { stream: 1 }
        );
        assert_eq!(
            ControlMessage::decode(0x0e00_0002),
            ControlMessage::Output { stream: 2 }
        );
        assert_eq!(ControlMessage::decode(0x0f00_0000), ControlMessage::Input);
        for other in [0x0e00_0000, 0x0e00_0003, 0x0f00_0001] {
            assert_eq!(
                ControlMessage::decode(other),
                ControlMessage::Unknown(other)
            );
        }
        assert_eq!(
            ControlMessage::decode(0x7700_0000),
            ControlMessage::Unknown(0x7700_0000)
        );
    }

    #[test]
    fn only_aligned_dword_writes_carry_messages() {
        assert_eq!(
            decode_write(0, &[3, 0, 0, 2]),
            Some(ControlMessage::ExitStatus(3))
        );
        assert_eq!(decode_write(0, &[3]), None);
        assert_eq!(decode_write(1, &[0, 0, 0, 3]), None);
        assert_eq!(
            decode_write(4, &[1, 2, 3, 4]),
            Some(ControlMessage::Event(EventRaiser::ProbePort))
        );
        assert_eq!(decode_write(4, &[1]), None);
    }

    #[test]
    fn reads_return_the_signature() {
        let mut d = [0u8; 4];
        read(0, &mut d, 7);
        assert_eq!(&d, b"INSG");
        let mut b = [0u8; 1];
        read(3, &mut b, 7);
        assert_eq!(b[0], b'G');
        read(8, &mut d, 0x1234_5678);
        assert_eq!(u32::from_le_bytes(d), 0x1234_5678);
        read(4, &mut d, 7);
        assert_eq!(d, [0xff; 4]);
        read(12, &mut d, 7);
        assert_eq!(u32::from_le_bytes(d), FEATURES);
        assert_eq!(FEATURES & (1 << 31), 0, "bit 31 tells no answer apart");
        read(10, &mut d, 0x1234_5678);
        assert_eq!(d, [0x34, 0x12, FEATURES as u8, (FEATURES >> 8) as u8]);
        read(14, &mut d, 0x1234_5678);
        assert_eq!(d[2..], [0xff, 0xff], "past the registers");
    }
}
