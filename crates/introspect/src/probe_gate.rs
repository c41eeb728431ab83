//! The probe gate: how a probe raises an event that costs nothing while
//! recording and leaves the guest at replay (docs/events.md, "The gate").
//!
//! The gate is a few bytes at the end of the trampoline code page that the
//! guest kernel maps into every process (`crate::stub_area::GuestArea`). The
//! VMM writes it once, when the kernel announces that page, with a header
//! the probe library checks, and code that differs by mode:
//! - recording and plain runs: `ret` — a probe's `call` to the gate comes
//!   straight back without leaving the guest;
//! - replay: `mov [exit page + STORE_OFFSET], rax; ret` — the store is an
//!   MMIO exit (the exit page is no RAM), RAX holds the event buffer's
//!   address, and the VMM captures the event there.
//!
//! A second gate, the heap gate, serves the probe library's heap events
//! (HEAPCALL, ALLOC, FREE): it has the exit form only in replays that
//! collect them, so that the allocations of a program cost other replays
//! no exit.
//!
//! Neither form changes a register, the flags or memory the program can
//! read but the gate's own bytes, which nothing but the probe library
//! reads. The exits the gate makes at replay are not the recording's: they
//! never advance the exit clock, never deliver interrupts, and are not
//! compared with the log.

use crate::stub_area::EXIT_PAGE_GPA;

use crate::gva::PAGE_SIZE;
/// Where the gate's header starts in the trampoline code page; trampolines
/// keep below it.
pub const HEADER_OFFSET: u64 = 0xfc0;
/// Where the gate's code starts.
pub const CODE_OFFSET: u64 = 0xfe0;
/// Where the heap gate's code starts.
pub const HEAP_CODE_OFFSET: u64 = 0xff0;
/// The header: magic "INSG", version, the code's offset in the page and
/// the heap gate's (probes/insight-events.h, struct insight_gate).
pub const MAGIC: u32 = 0x4753_4e49;
pub const VERSION: u32 = 1;
/// Offset in the exit page of the gate's store (the trampolines store to
/// offset 0).
pub const STORE_OFFSET: u64 = 8;
/// The guest physical address the gate's store exits at.
pub const STORE_GPA: u64 = EXIT_PAGE_GPA + STORE_OFFSET;
/// Length of the replay gate's store: `48 89 05 disp32`.
const STORE_LEN: u64 = 7;

/// What the gate does in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateMode {
    /// Returns at once (recording, plain runs).
    Silent,
    /// Leaves the guest with the event's address (replay).
    Exit,
}

/// The bytes from `HEADER_OFFSET` to the end of the code page: the gate
/// in `mode`, the heap gate in `heap`.
pub fn bytes(mode: GateMode, heap: GateMode) -> Vec<u8> {
    let mut b = Vec::with_capacity((PAGE_SIZE - HEADER_OFFSET) as usize);
    b.extend(MAGIC.to_le_bytes());
    b.extend(VERSION.to_le_bytes());
    b.extend((CODE_OFFSET as u32).to_le_bytes());
    b.extend((HEAP_CODE_OFFSET as u32).to_le_bytes());
    for (offset, mode) in [(CODE_OFFSET, mode), (HEAP_CODE_OFFSET, heap)] {
        // int3 between the header and the gates: nothing jumps there.
        b.resize((offset - HEADER_OFFSET) as usize, 0xcc);
        if mode == GateMode::Exit {
            // The exit page is two pages after the code page in every
            // mapping, so the displacement is the same in all of them.
            let disp = (2 * PAGE_SIZE + STORE_OFFSET) - (offset + STORE_LEN);
            b.extend([0x48, 0x89, 0x05]);
            b.extend((disp as u32).to_le_bytes());
        }
        b.push(0xc3);
    }
    b.resize((PAGE_SIZE - HEADER_OFFSET) as usize, 0xcc);
    b
}

/// Whether a store that exited at `rip` is a replay gate's, for a task
/// whose process maps the trampoline pages at `stubs` (0: not mapped).
/// Hosts report an MMIO exit with RIP at the instruction or past it.
pub fn is_gate_store(rip: u64, stubs: &[u64]) -> bool {
    stubs.iter().any(|&stub| {
        stub != 0
            && [CODE_OFFSET, HEAP_CODE_OFFSET]
                .iter()
                .any(|&code| rip == stub + code || rip == stub + code + STORE_LEN)
    })
}

/// Whether `rip` is inside a trampoline mapping at `stubs` (its code,
/// data or exit page): nowhere a recorded position may be.
pub fn in_stub_pages(rip: u64, stubs: &[u64]) -> bool {
    stubs
        .iter()
        .any(|&stub| stub != 0 && (stub..stub + 3 * PAGE_SIZE).contains(&rip))
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Decoder, DecoderOptions, Mnemonic};

    const STUB: u64 = 0x7f12_3456_7000;

    /// A gate's instructions (at `offset`), decoded at their address in a
    /// mapping.
    fn decode(b: &[u8], offset: u64) -> Vec<iced_x86::Instruction> {
        let code = &b[(offset - HEADER_OFFSET) as usize..];
        let mut d = Decoder::with_ip(64, code, STUB + offset, DecoderOptions::NONE);
        let mut out = Vec::new();
        loop {
            let i = d.decode();
            out.push(i);
            if i.mnemonic() == Mnemonic::Ret {
                return out;
            }
        }
    }

    #[test]
    fn gate_fills_the_page_end_with_its_header_first() {
        for mode in [GateMode::Silent, GateMode::Exit] {
            let b = bytes(mode, mode);
            assert_eq!(b.len() as u64, PAGE_SIZE - HEADER_OFFSET);
            assert_eq!(b[0..4], MAGIC.to_le_bytes());
            assert_eq!(b[4..8], VERSION.to_le_bytes());
            assert_eq!(b[8..12], (CODE_OFFSET as u32).to_le_bytes());
            assert_eq!(b[12..16], (HEAP_CODE_OFFSET as u32).to_le_bytes());
        }
    }

    #[test]
    fn silent_gate_returns_and_the_exit_gate_stores_rax_to_the_exit_page() {
        for (offset, silent_one, exit_one) in [
            (
                CODE_OFFSET,
                bytes(GateMode::Silent, GateMode::Exit),
                bytes(GateMode::Exit, GateMode::Silent),
            ),
            (
                HEAP_CODE_OFFSET,
                bytes(GateMode::Exit, GateMode::Silent),
                bytes(GateMode::Silent, GateMode::Exit),
            ),
        ] {
            let silent = decode(&silent_one, offset);
            assert_eq!(silent.len(), 1);
            assert_eq!(silent[0].ip(), STUB + offset);

            let exit = decode(&exit_one, offset);
            assert_eq!(exit.len(), 2, "{exit:?}");
            let store = exit[0];
            assert_eq!(store.mnemonic(), Mnemonic::Mov);
            assert_eq!(store.op1_register(), iced_x86::Register::RAX);
            assert_eq!(store.memory_size(), iced_x86::MemorySize::UInt64);
            // The exit page follows the code and data pages of the mapping.
            assert_eq!(
                store.memory_displacement64(),
                STUB + 2 * PAGE_SIZE + STORE_OFFSET
            );
            assert_eq!(store.len() as u64, STORE_LEN);
            assert!(is_gate_store(store.ip(), &[0, STUB]));
            assert!(is_gate_store(store.next_ip(), &[STUB, 0]));
            assert!(!is_gate_store(store.ip() + 1, &[STUB]));
            assert!(!is_gate_store(store.ip(), &[0, 0]));
            assert!(!is_gate_store(store.ip(), &[STUB + PAGE_SIZE]));
        }
    }

    #[test]
    fn stub_pages_are_the_three_of_each_mapping() {
        assert!(in_stub_pages(STUB, &[STUB]));
        assert!(in_stub_pages(STUB + 3 * PAGE_SIZE - 1, &[0, STUB]));
        assert!(!in_stub_pages(STUB + 3 * PAGE_SIZE, &[STUB]));
        assert!(!in_stub_pages(STUB - 1, &[STUB]));
        assert!(!in_stub_pages(0, &[0, 0]));
    }
}
