//! The probe gate: how a probe raises an event that costs nothing while
//! recording and leaves the guest at replay (docs/events.md, "The gate").
//!
//! The gate is a few bytes at the end of the trampoline code page that the
//! guest kernel maps into every process (`crate::stub_area::GuestArea`). The
//! VMM writes it once, when the kernel announces that page, with a header
//! the probe library checks, and code that differs by mode:
//! - recording and plain runs: `ret` — a probe's `call` to the gate comes
//!   straight back without leaving the guest;
//! - replay, the ring form: a copy of the event and of the top of the
//!   caller's stack into the event ring (`crate::event_ring`), which the
//!   VMM reads at its next exit;
//! - replay, the exit form (and the ring form's way out for an event the
//!   ring cannot take): `mov [exit page + STORE_OFFSET], rax; ret` — the
//!   store is an MMIO exit (the exit page is no RAM), RAX holds the event
//!   buffer's address, and the VMM captures the event there.
//!
//! A second gate, the heap gate, serves the probe library's heap events
//! (HEAPCALL, ALLOC, FREE): it is more than a `ret` only in replays that
//! collect them, so that the allocations of a program cost other replays
//! nothing.
//!
//! No form changes a register, the flags or memory the program can read
//! but the gate's own bytes and the ring, which nothing but the probe
//! library reads. A thread the guest kernel single-steps (`record
//! --chaos`) takes as many single-step traps through the silent form as
//! through the exit form: one, after the `ret`, since KVM, which
//! completes the exit form's MMIO store once the VMM has taken it, never
//! raises the trap flag's #DB for such a store. The replay of a chaos
//! recording therefore takes the exit form (the ring form's copy would
//! add traps the recording did not take). The exits the gate makes at replay are not the
//! recording's: they never advance the exit clock, never deliver
//! interrupts, and are not compared with the log.

use crate::event_ring::{self as ring, EventRing};
use crate::guest_events::UserMemory;
use crate::gva::PAGE_SIZE;
use crate::stub_area::EXIT_PAGE_GPA;
use kvm_bindings::kvm_regs;
use unwind::Regs;
use vm_memory::GuestMemoryMmap;

/// Where the gates' code starts in the trampoline code page (the ring
/// form's body, then the header and the gates' entries); trampolines keep
/// below it.
pub const CODE_START: u64 = 0xe00;
/// The ring form's store to the exit page, when an event does not go into
/// the ring: at `CODE_START`, then `ret`.
pub const RING_STORE_OFFSET: u64 = CODE_START;
/// Where the ring form's body starts.
const RING_BODY_OFFSET: u64 = RING_STORE_OFFSET + STORE_LEN + 1;
/// Where the gate's header starts.
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
    /// Appends the event to the event ring and returns (replay, with a
    /// guest kernel that maps a ring); an event the ring cannot take
    /// leaves the guest as with `Exit`.
    Ring,
}

/// The bytes from `CODE_START` to the end of the code page: the gate in
/// `mode`, the heap gate in `heap`; `ring` is the guest kernel's event
/// ring (without one, `Ring` is `Exit`).
pub fn bytes(mode: GateMode, heap: GateMode, ring: Option<EventRing>) -> Vec<u8> {
    let resolve = |m: GateMode| match (m, ring) {
        (GateMode::Ring, None) => GateMode::Exit,
        (m, _) => m,
    };
    let (mode, heap) = (resolve(mode), resolve(heap));
    let mut b = Vec::with_capacity((PAGE_SIZE - CODE_START) as usize);
    store_to_exit_page(&mut b, RING_STORE_OFFSET);
    b.push(0xc3);
    match ring {
        Some(ring) if mode == GateMode::Ring || heap == GateMode::Ring => {
            b.extend(ring_body(ring.pages * PAGE_SIZE));
        }
        _ => {}
    }
    assert!(
        b.len() as u64 <= HEADER_OFFSET - CODE_START,
        "the ring gate outgrew its room"
    );
    b.resize((HEADER_OFFSET - CODE_START) as usize, 0xcc);
    b.extend(MAGIC.to_le_bytes());
    b.extend(VERSION.to_le_bytes());
    b.extend((CODE_OFFSET as u32).to_le_bytes());
    b.extend((HEAP_CODE_OFFSET as u32).to_le_bytes());
    for (offset, mode) in [(CODE_OFFSET, mode), (HEAP_CODE_OFFSET, heap)] {
        // int3 between the header and the gates: nothing jumps there.
        b.resize((offset - CODE_START) as usize, 0xcc);
        match mode {
            GateMode::Silent => b.push(0xc3),
            GateMode::Exit => {
                store_to_exit_page(&mut b, offset);
                b.push(0xc3);
            }
            GateMode::Ring => {
                let rel = RING_BODY_OFFSET as i64 - (offset as i64 + 5);
                b.push(0xe9); // jmp rel32
                b.extend((rel as i32).to_le_bytes());
            }
        }
    }
    b.resize((PAGE_SIZE - CODE_START) as usize, 0xcc);
    b
}

/// `mov [exit page + STORE_OFFSET], rax` at `offset` in the code page. The
/// exit page is two pages after the code page in every mapping, so the
/// displacement is the same in all of them.
fn store_to_exit_page(b: &mut Vec<u8>, offset: u64) {
    let disp = (2 * PAGE_SIZE + STORE_OFFSET) - (offset + STORE_LEN);
    b.extend([0x48, 0x89, 0x05]);
    b.extend((disp as u32).to_le_bytes());
}

/// A small emitter for the ring form's body, at `RING_BODY_OFFSET` in the
/// code page, whose ring is `ring_len` bytes right below that page.
struct Body {
    code: Vec<u8>,
    ring_len: u64,
}

impl Body {
    fn ip(&self) -> i64 {
        (RING_BODY_OFFSET + self.code.len() as u64) as i64
    }

    /// `prefix disp32 [imm]` addressing the ring's header word `at`,
    /// RIP-relative (`prefix` ends with a ModRM byte selecting it).
    fn ring(&mut self, prefix: &[u8], at: u64, imm: &[u8]) {
        let end = self.ip() + (prefix.len() + 4 + imm.len()) as i64;
        let target = at as i64 - self.ring_len as i64;
        self.code.extend(prefix);
        self.code.extend(((target - end) as i32).to_le_bytes());
        self.code.extend(imm);
    }

    fn bytes(&mut self, b: &[u8]) {
        self.code.extend(b);
    }

    /// A `jcc`/`jmp` rel32 (`opcode` without its rel32) to a label placed
    /// later; returns where the rel32 is.
    fn forward(&mut self, opcode: &[u8]) -> usize {
        self.code.extend(opcode);
        self.code.extend([0; 4]);
        self.code.len() - 4
    }

    fn here(&mut self, at: usize) {
        let rel = (self.code.len() - (at + 4)) as i32;
        self.code[at..at + 4].copy_from_slice(&rel.to_le_bytes());
    }

    /// Registers and flags as the probe called the gate, and the ring no
    /// longer busy.
    fn restore(&mut self) {
        let save = |i: u64| ring::SAVE + 8 * i;
        self.ring(&[0x48, 0x8b, 0x0d], save(2), &[]); // mov rcx, [save.rcx]
        self.ring(&[0x48, 0x8b, 0x15], save(3), &[]); // mov rdx, [save.rdx]
        self.ring(&[0x48, 0x8b, 0x35], save(4), &[]); // mov rsi, [save.rsi]
        self.ring(&[0x48, 0x8b, 0x3d], save(5), &[]); // mov rdi, [save.rdi]
        self.ring(&[0x4c, 0x8b, 0x05], save(6), &[]); // mov r8, [save.r8]
        self.ring(&[0x66, 0x8b, 0x05], save(1), &[]); // mov ax, [save.flags]
        self.bytes(&[0x04, 0x7f]); // add al, 0x7f: OF as saved
        self.bytes(&[0x9e]); // sahf
        self.ring(&[0x48, 0x8b, 0x05], save(0), &[]); // mov rax, [save.rax]
        self.ring(&[0x48, 0xc7, 0x05], ring::BUSY, &0u32.to_le_bytes()); // mov qword [busy], 0
    }
}

/// The lowest buffer address the ring form reads (the guest kernel maps
/// nothing below `mmap_min_addr`, 64 KiB).
const LOWEST_BUFFER: u64 = 0x1_0000;

/// The ring form: saves what it uses in the ring's scratch words (never
/// below RSP: the probe's stack is the program's), copies the event and
/// the stack above RSP into a new entry (`crate::event_ring`), publishes
/// it, restores everything and returns. An event that is not in a
/// page-aligned buffer of user memory above `LOWEST_BUFFER`, whose size
/// is out of bounds, or that the ring has no room for, goes to the store
/// at `RING_STORE_OFFSET` with everything restored: the exit gate's path.
/// The buffer's page is read: a program that calls the gate itself with
/// the address of a page it has not mapped faults at replay, where the
/// recording's gate returned (the probe library's buffers are mapped). Flags are kept with LAHF/SETO and
/// SAHF, as the trampolines keep them; the copies rely on DF being clear,
/// as the ABI has it at every call.
fn ring_body(ring_len: u64) -> Vec<u8> {
    let save = |i: u64| ring::SAVE + 8 * i;
    let mut a = Body {
        code: Vec::with_capacity(320),
        ring_len,
    };
    a.ring(&[0x48, 0xc7, 0x05], ring::BUSY, &1u32.to_le_bytes()); // mov qword [busy], 1
    a.ring(&[0x48, 0x89, 0x05], save(0), &[]); // mov [save.rax], rax
    a.bytes(&[0x9f]); // lahf
    a.bytes(&[0x0f, 0x90, 0xc0]); // seto al
    a.ring(&[0x66, 0x89, 0x05], save(1), &[]); // mov [save.flags], ax
    a.ring(&[0x48, 0x8b, 0x05], save(0), &[]); // mov rax, [save.rax]
    a.ring(&[0x48, 0x89, 0x0d], save(2), &[]); // mov [save.rcx], rcx
    a.ring(&[0x48, 0x89, 0x15], save(3), &[]); // mov [save.rdx], rdx
    a.ring(&[0x48, 0x89, 0x35], save(4), &[]); // mov [save.rsi], rsi
    a.ring(&[0x48, 0x89, 0x3d], save(5), &[]); // mov [save.rdi], rdi
    a.ring(&[0x4c, 0x89, 0x05], save(6), &[]); // mov [save.r8], r8
    let mut slow = Vec::new();
    a.bytes(&[0xa9, 0xff, 0x0f, 0, 0]); // test eax, 0xfff
    slow.push(a.forward(&[0x0f, 0x85])); // jnz slow
    a.bytes(&[0x48, 0x3d]); // cmp rax, LOWEST_BUFFER
    a.bytes(&(LOWEST_BUFFER as u32).to_le_bytes());
    slow.push(a.forward(&[0x0f, 0x82])); // jb slow
    a.bytes(&[0x48, 0x89, 0xc2]); // mov rdx, rax
    a.bytes(&[0x48, 0xc1, 0xea, 47]); // shr rdx, 47
    slow.push(a.forward(&[0x0f, 0x85])); // jnz slow: not a user address
    a.bytes(&[0x8b, 0x48, 0x08]); // mov ecx, [rax + 8]: the event's size
    a.bytes(&[0x8d, 0x51, (ring::MIN_EVENT as i8).wrapping_neg() as u8]); // lea edx, [rcx - MIN_EVENT]
    a.bytes(&[0x81, 0xfa]); // cmp edx, MAX_EVENT - MIN_EVENT
    a.bytes(&((ring::MAX_EVENT - ring::MIN_EVENT) as u32).to_le_bytes());
    slow.push(a.forward(&[0x0f, 0x87])); // ja slow
                                         // RSI: the top of the stack the library gives, else RSP's page end.
    a.bytes(&[0x48, 0x8b, 0xb0]); // mov rsi, [rax + STACK_TOP_AT]
    a.bytes(&(ring::STACK_TOP_AT as u32).to_le_bytes());
    a.bytes(&[0x48, 0x89, 0xe2]); // mov rdx, rsp
    a.bytes(&[0x48, 0x39, 0xd6]); // cmp rsi, rdx
    let have_top = a.forward(&[0x0f, 0x87]); // ja have_top
    a.bytes(&[0x48, 0x89, 0xd6]); // mov rsi, rdx
    a.bytes(&[0x48, 0x81, 0xce, 0xff, 0x0f, 0, 0]); // or rsi, 0xfff
    a.bytes(&[0x48, 0xff, 0xc6]); // inc rsi
    a.here(have_top);
    a.bytes(&[0x48, 0x29, 0xd6]); // sub rsi, rdx: bytes above RSP
    a.bytes(&[0x48, 0x81, 0xfe]); // cmp rsi, STACK_WINDOW
    a.bytes(&(ring::STACK_WINDOW as u32).to_le_bytes());
    let in_window = a.forward(&[0x0f, 0x86]); // jbe in_window
    a.bytes(&[0xbe]); // mov esi, STACK_WINDOW
    a.bytes(&(ring::STACK_WINDOW as u32).to_le_bytes());
    a.here(in_window);
    a.bytes(&[0x48, 0x83, 0xe6, 0xf8]); // and rsi, -8: the stack's length
    a.bytes(&[0x48, 0x8d, 0x79, 0x07]); // lea rdi, [rcx + 7]
    a.bytes(&[0x48, 0x83, 0xe7, 0xf8]); // and rdi, -8
    a.bytes(&[0x48, 0x8d, 0x7c, 0x37, ring::ENTRY_HEADER as u8]); // lea rdi, [rdi + rsi + ENTRY_HEADER]: the entry's length
    a.ring(&[0x4c, 0x8b, 0x05], ring::USED, &[]); // mov r8, [used]
    a.bytes(&[0x49, 0x8d, 0x14, 0x38]); // lea rdx, [r8 + rdi]
    a.bytes(&[0x48, 0x81, 0xfa]); // cmp rdx, capacity
    a.bytes(&((ring_len - ring::ENTRIES) as u32).to_le_bytes());
    slow.push(a.forward(&[0x0f, 0x87])); // ja slow
    a.ring(&[0x48, 0x8d, 0x15], ring::ENTRIES, &[]); // lea rdx, [entries]
    a.bytes(&[0x49, 0x01, 0xd0]); // add r8, rdx: the entry
    a.bytes(&[0x41, 0x89, 0x38]); // mov [r8], edi
    a.bytes(&[0x41, 0x89, 0x48, 0x04]); // mov [r8 + 4], ecx
    a.ring(&[0x48, 0x8b, 0x15], ring::SWITCHES, &[]); // mov rdx, [switches]
    a.bytes(&[0x49, 0x89, 0x50, 0x08]); // mov [r8 + 8], rdx
    a.ring(&[0x48, 0x8b, 0x15], ring::CR3, &[]); // mov rdx, [cr3]
    a.bytes(&[0x49, 0x89, 0x50, 0x10]); // mov [r8 + 16], rdx
    a.bytes(&[0x49, 0x89, 0x60, 0x18]); // mov [r8 + 24], rsp
    a.bytes(&[0x49, 0x89, 0x68, 0x20]); // mov [r8 + 32], rbp
    a.bytes(&[0x49, 0x89, 0x70, 0x28]); // mov [r8 + 40], rsi
    a.bytes(&[0x48, 0x89, 0xfa]); // mov rdx, rdi: the entry's length
    a.bytes(&[0x49, 0x8d, 0x78, ring::ENTRY_HEADER as u8]); // lea rdi, [r8 + ENTRY_HEADER]
    a.bytes(&[0x48, 0x89, 0xc6]); // mov rsi, rax
    a.bytes(&[0xf3, 0xa4]); // rep movsb: the event
    a.bytes(&[0x49, 0x8b, 0x48, 0x28]); // mov rcx, [r8 + 40]
    a.bytes(&[0x49, 0x8d, 0x3c, 0x10]); // lea rdi, [r8 + rdx]
    a.bytes(&[0x48, 0x29, 0xcf]); // sub rdi, rcx
    a.bytes(&[0x48, 0x89, 0xe6]); // mov rsi, rsp
    a.bytes(&[0xf3, 0xa4]); // rep movsb: the stack
    a.ring(&[0x48, 0x01, 0x15], ring::USED, &[]); // add [used], rdx: published
    a.restore();
    a.bytes(&[0xc3]); // ret
    for at in slow {
        a.here(at);
    }
    a.restore();
    let rel = RING_STORE_OFFSET as i64 - (a.ip() + 5);
    a.bytes(&[0xe9]); // jmp store
    a.bytes(&(rel as i32).to_le_bytes());
    a.code
}

/// Whether a store that exited at `rip` is a replay gate's, for a task
/// whose process maps the trampoline pages at `stubs` (0: not mapped).
/// Hosts report an MMIO exit with RIP at the instruction or past it.
pub fn is_gate_store(rip: u64, stubs: &[u64]) -> bool {
    stubs.iter().any(|&stub| {
        stub != 0
            && [CODE_OFFSET, HEAP_CODE_OFFSET, RING_STORE_OFFSET]
                .iter()
                .any(|&code| rip == stub + code || rip == stub + code + STORE_LEN)
    })
}

/// Where the probe that called the gate stands, for a task at the gate
/// with `regs`: its return address, and its stack pointer before the
/// call (the probe called the gate past its 128-byte red zone).
pub fn probe_at_gate(mem: &GuestMemoryMmap, cr3: u64, regs: &kvm_regs) -> Option<Regs> {
    probe_at_gate_in(&mut UserMemory { mem, cr3 }, regs.rsp, regs.rbp)
}

/// [`probe_at_gate`], for a task that was at the gate with `rsp` and `rbp`,
/// its stack in `mem`.
pub fn probe_at_gate_in(mem: &mut impl unwind::ProcessMemory, rsp: u64, rbp: u64) -> Option<Regs> {
    let rip = mem.read_u64(rsp)?;
    Some(Regs {
        rip,
        rsp: rsp.wrapping_add(8 + 128),
        rbp,
    })
}

/// Whether `rip` is in the gates' code of a trampoline mapping at `stubs`:
/// a task there has the return address into its probe at RSP (no form of
/// the gate pushes anything).
pub fn in_gate_code(rip: u64, stubs: &[u64]) -> bool {
    stubs
        .iter()
        .any(|&stub| stub != 0 && (stub + CODE_START..stub + PAGE_SIZE).contains(&rip))
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
    const RING: EventRing = EventRing {
        gpa: 0x10_0000,
        pages: 64,
    };

    /// A gate's instructions (at `offset`), decoded at their address in a
    /// mapping.
    fn decode(b: &[u8], offset: u64) -> Vec<iced_x86::Instruction> {
        let code = &b[(offset - CODE_START) as usize..];
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
        for mode in [GateMode::Silent, GateMode::Exit, GateMode::Ring] {
            let b = bytes(mode, mode, Some(RING));
            assert_eq!(b.len() as u64, PAGE_SIZE - CODE_START);
            let h = &b[(HEADER_OFFSET - CODE_START) as usize..];
            assert_eq!(h[0..4], MAGIC.to_le_bytes());
            assert_eq!(h[4..8], VERSION.to_le_bytes());
            assert_eq!(h[8..12], (CODE_OFFSET as u32).to_le_bytes());
            assert_eq!(h[12..16], (HEAP_CODE_OFFSET as u32).to_le_bytes());
        }
    }

    #[test]
    fn silent_gate_returns_and_the_exit_gate_stores_rax_to_the_exit_page() {
        for (offset, silent_one, exit_one) in [
            (
                CODE_OFFSET,
                bytes(GateMode::Silent, GateMode::Exit, None),
                bytes(GateMode::Exit, GateMode::Silent, None),
            ),
            (
                HEAP_CODE_OFFSET,
                bytes(GateMode::Exit, GateMode::Silent, None),
                bytes(GateMode::Silent, GateMode::Exit, None),
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

    #[test]
    fn the_ring_gates_jump_into_a_body_that_fits_below_the_header() {
        let b = bytes(GateMode::Ring, GateMode::Ring, Some(RING));
        for offset in [CODE_OFFSET, HEAP_CODE_OFFSET] {
            let i = Decoder::with_ip(
                64,
                &b[(offset - CODE_START) as usize..],
                STUB + offset,
                DecoderOptions::NONE,
            )
            .decode();
            assert_eq!(i.mnemonic(), Mnemonic::Jmp);
            assert_eq!(i.near_branch_target(), STUB + RING_BODY_OFFSET);
        }
        let store = decode(&b, RING_STORE_OFFSET);
        assert_eq!(
            store[0].memory_displacement64(),
            STUB + 2 * PAGE_SIZE + STORE_OFFSET
        );
        assert!(is_gate_store(store[0].ip(), &[STUB]));
        assert!(is_gate_store(store[0].next_ip(), &[STUB]));
        assert!(in_gate_code(STUB + RING_BODY_OFFSET + 40, &[0, STUB]));
        assert!(!in_gate_code(STUB + CODE_START - 1, &[STUB]));
        assert!(!in_gate_code(STUB + PAGE_SIZE, &[STUB]));
        // Every instruction of the body decodes, and none runs into the
        // header.
        let body =
            &b[(RING_BODY_OFFSET - CODE_START) as usize..(HEADER_OFFSET - CODE_START) as usize];
        let mut d = Decoder::with_ip(64, body, STUB + RING_BODY_OFFSET, DecoderOptions::NONE);
        let mut last_jmp_back = false;
        while d.can_decode() {
            let i = d.decode();
            if i.code() == iced_x86::Code::Int3 {
                break;
            }
            assert!(!i.is_invalid(), "at {:#x}", i.ip());
            last_jmp_back =
                i.mnemonic() == Mnemonic::Jmp && i.near_branch_target() == STUB + RING_STORE_OFFSET;
        }
        assert!(last_jmp_back, "the body ends with the jump to the store");
        // Without a ring the ring form is the exit form.
        assert_eq!(
            bytes(GateMode::Ring, GateMode::Silent, None),
            bytes(GateMode::Exit, GateMode::Silent, None)
        );
    }

    /// The ring gate's code run natively, in pages laid out as the guest
    /// kernel maps them.
    #[cfg(target_arch = "x86_64")]
    mod native {
        use super::*;
        use crate::event_ring::{parse, Drained};

        const PAGES: u64 = 8;
        const PAGE: usize = PAGE_SIZE as usize;

        /// An anonymous mapping, unmapped when dropped.
        struct Mapping {
            at: *mut u8,
            len: usize,
        }

        impl Mapping {
            fn new(len: usize, exec: bool) -> Mapping {
                let prot =
                    libc::PROT_READ | libc::PROT_WRITE | if exec { libc::PROT_EXEC } else { 0 };
                // SAFETY: a fresh anonymous mapping; nothing else refers to it.
                let at = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        prot,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                assert_ne!(at, libc::MAP_FAILED);
                Mapping { at: at.cast(), len }
            }

            fn bytes(&mut self) -> &mut [u8] {
                // SAFETY: the mapping is `len` bytes, readable and
                // writable, and only this borrow refers to it now.
                unsafe { std::slice::from_raw_parts_mut(self.at, self.len) }
            }

            fn word(&mut self, at: usize) -> u64 {
                u64::from_le_bytes(self.bytes()[at..at + 8].try_into().unwrap())
            }
        }

        impl Drop for Mapping {
            fn drop(&mut self) {
                // SAFETY: unmaps exactly what `new` mapped.
                unsafe { libc::munmap(self.at.cast(), self.len) };
            }
        }

        /// What a call of the gate left: the registers it must keep, the
        /// flags, and RSP at the gate.
        #[derive(Debug, PartialEq, Eq)]
        struct After {
            regs: [u64; 7],
            flags: u64,
        }

        /// Calls the gate at `gate` with RAX = `buffer` the way the probe
        /// library does, the flags set by `cmp a, b` first; returns what
        /// came back, what went in, and RSP at the gate. Never inlined: the
        /// gate's return address is then the same from every caller.
        #[inline(never)]
        fn call(gate: u64, buffer: u64, (a, b): (u64, u64)) -> (After, After, u64) {
            let regs_in = [0x1111, 0x2222, 0x3333, 0x4444, 0x5555, 0x6666, 0x7777u64];
            let mut r = regs_in;
            let (flags_in, flags_out, sp): (u64, u64, u64);
            // SAFETY: the gate is the code under test, in an executable
            // mapping; it keeps every register and the flags (what the
            // test checks), writes only its ring and (its slow path) the
            // exit page of the same mapping, and returns. The call runs
            // below the red zone, as the probe library's does.
            unsafe {
                std::arch::asm!(
                    "cmp {a}, {b}",
                    "pushfq",
                    "pop {fi}",
                    "lea rsp, [rsp - 128]",
                    "mov {sp}, rsp",
                    "call {g}",
                    "lea rsp, [rsp + 128]",
                    "pushfq",
                    "pop {fo}",
                    a = in(reg) a,
                    b = in(reg) b,
                    g = in(reg) gate,
                    fi = out(reg) flags_in,
                    fo = out(reg) flags_out,
                    sp = out(reg) sp,
                    inout("rax") buffer => _,
                    inout("rcx") r[0],
                    inout("rdx") r[1],
                    inout("rsi") r[2],
                    inout("rdi") r[3],
                    inout("r8") r[4],
                    inout("r9") r[5],
                    inout("r10") r[6],
                );
            }
            const ARITHMETIC: u64 = 0x8d5;
            (
                After {
                    regs: r,
                    flags: flags_out & ARITHMETIC,
                },
                After {
                    regs: regs_in,
                    flags: flags_in & ARITHMETIC,
                },
                sp - 8,
            )
        }

        /// The ring, code, data and exit pages, the gate in place.
        fn pages() -> (Mapping, u64) {
            let mut m = Mapping::new(((PAGES + 3) * PAGE_SIZE) as usize, true);
            let ring = EventRing {
                gpa: 0,
                pages: PAGES,
            };
            let code = (PAGES * PAGE_SIZE) as usize;
            let gate = bytes(GateMode::Ring, GateMode::Ring, Some(ring));
            m.bytes()[code + CODE_START as usize..code + PAGE].copy_from_slice(&gate);
            let base = m.at as u64;
            (m, base + PAGES * PAGE_SIZE)
        }

        fn event(buffer: &mut Mapping, size: u32, fill: u8) {
            let b = buffer.bytes();
            b[..PAGE - 8].fill(fill);
            b[8..12].copy_from_slice(&size.to_le_bytes());
        }

        fn drained(m: &mut Mapping) -> Drained {
            let used = m.word(ring::USED as usize) as usize;
            let mut out = Drained::default();
            let start = ring::ENTRIES as usize;
            parse(&m.bytes()[start..start + used], &mut out);
            out
        }

        #[test]
        fn the_ring_gate_copies_the_event_and_stack_and_keeps_every_register() {
            let (mut m, code) = pages();
            let mut buffer = Mapping::new(PAGE, false);
            let addr = buffer.at as u64;
            m.bytes()[ring::SWITCHES as usize..][..8].copy_from_slice(&77u64.to_le_bytes());
            m.bytes()[ring::CR3 as usize..][..8].copy_from_slice(&0x5000u64.to_le_bytes());

            // No stack top given: up to the end of RSP's page. Flags:
            // CF SF (0 - 1), then OF (MIN - 1).
            event(&mut buffer, 72, 0xab);
            let (after, before, rsp) = call(code + CODE_OFFSET, addr, (0, 1));
            assert_eq!(after, before);
            assert_ne!(before.flags & 1, 0);
            // A stack top 64 bytes above the probe's RSP, from the heap gate.
            event(&mut buffer, 61, 0xcd);
            let top = rsp + 8 + 128 + 64;
            buffer.bytes()[PAGE - 8..].copy_from_slice(&top.to_le_bytes());
            let (after, before, rsp2) = call(code + HEAP_CODE_OFFSET, addr, (1 << 63, 1));
            assert_eq!(after, before);
            assert_ne!(before.flags & 0x800, 0);
            assert_eq!(m.word(ring::BUSY as usize), 0);

            let d = drained(&mut m);
            assert_eq!(d.damaged, None);
            assert_eq!(d.entries.len(), 2);
            let (e, f) = (&d.entries[0], &d.entries[1]);
            assert_eq!(e.event.len(), 72);
            assert!(e.event[12..].iter().all(|&b| b == 0xab));
            assert_eq!((e.switches, e.cr3, e.rsp), (77, 0x5000, rsp));
            let to_page_end = ((rsp | 0xfff) + 1 - rsp).min(ring::STACK_WINDOW);
            assert_eq!(e.stack.len() as u64, to_page_end);
            assert_eq!(f.event.len(), 61);
            assert!(f.event[12..].iter().all(|&b| b == 0xcd));
            assert_eq!(f.rsp, rsp2);
            assert_eq!(f.stack.len() as u64, top - rsp2);
            // The return address into the test is the first word of each.
            let ret = |s: &[u8]| u64::from_le_bytes(s[..8].try_into().unwrap());
            assert_eq!(ret(&e.stack), ret(&f.stack));
            // The exit page was never written.
            let exit = ((PAGES + 2) * PAGE_SIZE) as usize;
            assert_eq!(m.word(exit + STORE_OFFSET as usize), 0);
        }

        #[test]
        fn what_the_ring_cannot_take_leaves_by_the_exit_page_with_registers_kept() {
            let (mut m, code) = pages();
            let mut buffer = Mapping::new(PAGE, false);
            let addr = buffer.at as u64;
            let exit = ((PAGES + 2) * PAGE_SIZE + STORE_OFFSET) as usize;
            let capacity = (PAGES - 1) * PAGE_SIZE;
            // Too large, too small, not page-aligned, no room left, and
            // addresses that are not user memory (never read).
            for (size, buffer_at, used) in [
                (5000, addr, 0),
                (20, addr, 0),
                (72, addr + 8, 0),
                (72, addr, capacity - 64),
                (72, 0, 0),
                (72, 0xf000, 0),
                (72, 0xffff_ffff_8100_0000, 0),
                (72, 0x8000_0000_0000, 0),
            ] {
                event(&mut buffer, size, 1);
                m.bytes()[ring::USED as usize..][..8].copy_from_slice(&used.to_le_bytes());
                m.bytes()[exit..exit + 8].fill(0);
                let (after, before, _) = call(code + CODE_OFFSET, buffer_at, (5, 5));
                assert_eq!(after, before);
                assert_eq!(m.word(exit), buffer_at, "size {size} at {buffer_at:#x}");
                assert_eq!(m.word(ring::USED as usize), used);
                assert_eq!(m.word(ring::BUSY as usize), 0);
            }
        }
    }
}
