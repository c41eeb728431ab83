//! Where a recorded user-mode position can be found again: the
//! instructions the trampoline's `jmp rel32` overwrites, and their copy in
//! the stub.
//!
//! The patch needs five bytes, so it covers the instruction at the target
//! and as many following ones as make five. Each covered instruction must
//! run the same from the stub: near branches and RIP-relative operands are
//! re-encoded for the new address; anything that pushes its own address
//! (`call`), enters the kernel or reads a port cannot move, and a position
//! inside a `rep` string instruction cannot be reached at all. The patch
//! never reaches past an unconditional jump or return, since the bytes
//! after one are reached from elsewhere; the one exception is a jump back
//! to a loop that no branch leaves for those bytes (a spin loop shorter
//! than the patch), which this thread cannot leave while the patch is in
//! place. The recorder asks the same question before it logs a position,
//! so every logged position can be patched at replay.

use iced_x86::{
    BlockEncoder, BlockEncoderOptions, Decoder, DecoderOptions, FlowControl, Instruction,
    InstructionBlock, InstructionInfoFactory, Mnemonic, OpAccess, OpKind, Register,
};

/// Bytes a `jmp rel32` takes.
pub const PATCH_LEN: usize = 5;
/// Code bytes the recorder reads at a position: the longest patch (four
/// 15-byte instructions cannot all be needed, five bytes are), and the
/// code after it, where a loop's back edge may jump into the bytes the
/// patch covers (`Site::entered_inside`). Busybox's `bc` has such a loop
/// whose back edge is 43 bytes after its head. At most a page, so that the
/// three pages an asynchronous point keeps hold it.
pub const CODE_WINDOW: usize = 1024;
/// How far back the start of a spin loop may be.
pub const LOOP_WINDOW: u64 = 64;
/// How far back the recorder looks for a direct branch into the bytes a
/// patch would cover (`Site::entered_inside`). Function entries are where
/// user code is most often stopped, and glibc enters its string functions
/// past their first instruction from a sibling entry: `__mempcpy_*` sets
/// RAX and jumps to the `cmp` after `__memmove_*`'s `mov %rdi, %rax`, 74
/// bytes back in the AVX2 variants of glibc 2.36, which a 64-byte window
/// missed (a replay patched memcpy's entry, a mempcpy call ran the middle
/// of the jump, and the program went wrong or died where the recording's
/// did not).
pub const ENTRY_WINDOW: u64 = 256;
/// How far after a position the recorder looks for a `switch`'s dispatch
/// (`jump_tables`); before it, ENTRY_WINDOW.
pub const TABLE_WINDOW: usize = 256;
/// How many entries of a jump table the recorder reads.
pub const TABLE_ENTRIES: usize = 512;

/// Why a position cannot be patched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Decline {
    #[error("code is not readable there")]
    Unreadable,
    #[error("invalid instruction")]
    Invalid,
    #[error("inside a rep string instruction")]
    RepString,
    #[error("{0} cannot run from the stub")]
    Immovable(String),
    #[error("a {0} ends the code before the patch does")]
    EndsEarly(String),
}

/// The instructions a patch at `rip` covers.
#[derive(Clone, Debug)]
pub struct Site {
    pub rip: u64,
    /// Bytes the patch overwrites (at least PATCH_LEN).
    pub len: usize,
    /// The covered instructions the stub runs, in order (the ones after an
    /// unconditional jump back are covered but never run).
    moved: Vec<Instruction>,
    /// The instructions from the start of the loop the position is in up
    /// to it, where a covered branch shows that start.
    body: Vec<Instruction>,
}

fn name(i: &Instruction) -> String {
    format!("{:?}", i.mnemonic()).to_lowercase()
}

/// Whether instruction `i` behaves the same at another address.
fn movable(i: &Instruction) -> Result<(), Decline> {
    if i.is_invalid() {
        return Err(Decline::Invalid);
    }
    match i.flow_control() {
        FlowControl::Next
        | FlowControl::UnconditionalBranch
        | FlowControl::ConditionalBranch
        | FlowControl::IndirectBranch
        | FlowControl::Return => {}
        FlowControl::Call
        | FlowControl::IndirectCall
        | FlowControl::Interrupt
        | FlowControl::XbeginXabortXend
        | FlowControl::Exception => return Err(Decline::Immovable(name(i))),
    }
    if i.is_privileged() || i.is_jmp_far() || i.is_jmp_far_indirect() {
        return Err(Decline::Immovable(name(i)));
    }
    use iced_x86::Mnemonic::{Int, Int3, Into, Retf, Syscall, Sysenter, Ud0, Ud1, Ud2};
    if matches!(
        i.mnemonic(),
        Syscall | Sysenter | Ud0 | Ud1 | Ud2 | Int3 | Int | Into | Retf
    ) {
        return Err(Decline::Immovable(name(i)));
    }
    Ok(())
}

/// Where a patch over the code `code` (read at `rip`) would go, or why it
/// cannot. `before` holds the LOOP_WINDOW bytes before `rip` when they are
/// readable (an empty slice otherwise): a jump back into them must be a
/// loop that never branches past the patch.
pub fn choose(rip: u64, code: &[u8], before: &[u8]) -> Result<Site, Decline> {
    let mut decoder = Decoder::with_ip(64, code, rip, DecoderOptions::NONE);
    let mut moved = Vec::new();
    let mut len = 0usize;
    while len < PATCH_LEN {
        if !decoder.can_decode() {
            return Err(Decline::Unreadable);
        }
        let i = decoder.decode();
        if i.is_invalid() {
            // The bytes ran out in the middle of an instruction, or are
            // no instruction at all.
            return Err(if decoder.position() >= code.len() {
                Decline::Unreadable
            } else {
                Decline::Invalid
            });
        }
        if len == 0 && (i.has_rep_prefix() || i.has_repne_prefix()) && i.is_string_instruction() {
            return Err(Decline::RepString);
        }
        movable(&i)?;
        len += i.len();
        moved.push(i);
        let ends = matches!(
            i.flow_control(),
            FlowControl::UnconditionalBranch | FlowControl::IndirectBranch | FlowControl::Return
        );
        if ends && len < PATCH_LEN {
            if !closed_loop(&i, rip, len, before) {
                return Err(Decline::EndsEarly(name(&i)));
            }
            // Cover the rest of the patch with bytes that never run.
            len = PATCH_LEN;
        }
    }
    let body = moved
        .iter()
        .filter(|i| i.flow_control() == FlowControl::ConditionalBranch || i.is_jmp_short_or_near())
        .find_map(|i| loop_body(i.near_branch_target(), rip, before))
        .unwrap_or_default();
    Ok(Site {
        rip,
        len,
        moved,
        body,
    })
}

/// The straight-line instructions from `start` (a branch target, so an
/// instruction boundary) to `rip`, decoded from `before` (the bytes just
/// before `rip`), if they land on `rip` exactly.
fn loop_body(start: u64, rip: u64, before: &[u8]) -> Option<Vec<Instruction>> {
    if start > rip || rip - start > before.len() as u64 {
        return None;
    }
    let offset = before.len() - (rip - start) as usize;
    let mut decoder = Decoder::with_ip(64, &before[offset..], start, DecoderOptions::NONE);
    let mut body = Vec::new();
    while decoder.ip() < rip {
        if !decoder.can_decode() {
            return None;
        }
        let i = decoder.decode();
        if i.is_invalid() {
            return None;
        }
        body.push(i);
    }
    (decoder.ip() == rip).then_some(body)
}

/// Whether `jmp` (the last covered instruction, ending `len` bytes after
/// `rip`) jumps back to a loop that contains `rip` and never branches to
/// the bytes after the jump: the loop cannot be left then, so the bytes
/// the patch covers past the jump are not run while it is in place.
fn closed_loop(jmp: &Instruction, rip: u64, len: usize, before: &[u8]) -> bool {
    if !jmp.is_jmp_short_or_near() {
        return false;
    }
    let start = jmp.near_branch_target();
    let end = rip + len as u64;
    if start > rip || rip - start > before.len() as u64 {
        return false;
    }
    // Decode the loop from its start (a branch target, so an instruction
    // boundary) up to `rip`: it must land on `rip` exactly, and no branch
    // in it may leave for the bytes the patch covers past the jump.
    let offset = before.len() - (rip - start) as usize;
    let mut decoder = Decoder::with_ip(64, &before[offset..], start, DecoderOptions::NONE);
    while decoder.ip() < rip {
        if !decoder.can_decode() {
            return false;
        }
        let i = decoder.decode();
        if i.is_invalid() {
            return false;
        }
        match i.flow_control() {
            FlowControl::Next => {}
            FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch => {
                let target = i.near_branch_target();
                if target > rip && target < rip + PATCH_LEN as u64 {
                    return false;
                }
            }
            // An indirect jump might go anywhere.
            _ => return false,
        }
    }
    decoder.ip() == rip && end >= rip
}

/// The general register a 64-bit register operand names, by encoding
/// number (None for anything else: a 32-bit address size, segment
/// registers, RIP).
fn gpr_number(r: Register) -> Option<usize> {
    use Register::*;
    let all = [
        RAX, RCX, RDX, RBX, RSP, RBP, RSI, RDI, R8, R9, R10, R11, R12, R13, R14, R15,
    ];
    all.iter().position(|&g| g == r)
}

impl Site {
    /// Whether a direct branch near the site jumps strictly inside the
    /// bytes the patch covers: into the middle of the `jmp rel32` that
    /// replaces them, where the code it reaches is no instruction at all.
    /// Compilers enter rotated loops that way (`jmp` to the condition in
    /// the middle of the loop), glibc its string functions (ENTRY_WINDOW),
    /// and a thread that enters while the patch waits for another
    /// position runs garbage. Looks at the covered instructions and those
    /// after them in `code` (read at `rip`), and at the `before` bytes
    /// (up to ENTRY_WINDOW) decoded from every offset that leads to `rip`
    /// exactly (one of them is the real instruction stream; a false one
    /// can only make this say yes more often).
    pub fn entered_inside(&self, code: &[u8], before: &[u8]) -> bool {
        let end = self.rip + self.len as u64;
        let into = |i: &Instruction| {
            matches!(
                i.flow_control(),
                FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch
            ) && (self.rip + 1..end).contains(&i.near_branch_target())
        };
        let mut after = Decoder::with_ip(64, code, self.rip, DecoderOptions::NONE);
        while after.can_decode() {
            let i = after.decode();
            if i.is_invalid() {
                break;
            }
            if into(&i) {
                return true;
            }
        }
        // From the last offset back: the instruction decoded at an offset
        // leads to `rip` exactly when the one after it does, and branches
        // in on the way when it or one after it does. One decode per
        // offset, however long the window.
        let n = before.len();
        let base = self.rip - n as u64;
        let mut lands = vec![false; n + 1];
        let mut enters = vec![false; n + 1];
        lands[n] = true;
        let mut d = Decoder::with_ip(64, before, base, DecoderOptions::NONE);
        for offset in (0..n).rev() {
            if d.set_position(offset).is_err() {
                continue;
            }
            d.set_ip(base + offset as u64);
            let i = d.decode();
            // The slice ends at `rip`: an instruction that would reach
            // past it decodes as invalid.
            if i.is_invalid() {
                continue;
            }
            let next = offset + i.len();
            lands[offset] = lands[next];
            enters[offset] = into(&i) || enters[next];
            if lands[offset] && enters[offset] {
                return true;
            }
        }
        false
    }

    /// Addresses of memory the code at the position reads or writes, as
    /// far as the registers at the position determine them: the memory
    /// operands of the covered instructions and of the loop body before
    /// the position whose base and index no instruction between them and
    /// the position changes (RIP-relative ones always). Telling states
    /// apart that differ only in memory, the trampoline compares these
    /// words natively. `gprs` are RAX..R15, `fs`/`gs` the segment bases.
    pub fn memory_words(&self, gprs: &[u64; 16], fs: u64, gs: u64) -> Vec<u64> {
        let mut info = InstructionInfoFactory::new();
        // Instructions in execution order ending with the covered ones; the
        // registers at the position are those before `moved[0]`.
        let mut order: Vec<&Instruction> = self.body.iter().collect();
        let at = order.len();
        order.extend(self.moved.iter());
        let mut words = Vec::new();
        for (k, i) in order.iter().enumerate() {
            let Some(op) = (0..i.op_count()).find(|&n| i.op_kind(n) == OpKind::Memory) else {
                continue;
            };
            let _ = op;
            let address = if i.is_ip_rel_memory_operand() {
                Some(i.ip_rel_memory_address())
            } else {
                // The registers between this instruction and the position
                // (before it) or between the position and it (after).
                let between = if k < at { &order[k..at] } else { &order[at..k] };
                let written: Vec<Register> = between
                    .iter()
                    .flat_map(|j| {
                        info.info(j)
                            .used_registers()
                            .iter()
                            .filter(|u| !matches!(u.access(), OpAccess::Read | OpAccess::CondRead))
                            .map(|u| u.register().full_register())
                            .collect::<Vec<_>>()
                    })
                    .collect();
                address_from(i, gprs, fs, gs, &written)
            };
            if let Some(a) = address {
                if !words.contains(&a) {
                    words.push(a);
                }
            }
        }
        words
    }

    /// The covered instructions re-encoded to run at `ip` (in the stub).
    pub fn relocated(&self, ip: u64) -> Result<Vec<u8>, String> {
        let block = InstructionBlock::new(&self.moved, ip);
        BlockEncoder::encode(64, block, BlockEncoderOptions::NONE)
            .map(|r| r.code_buffer)
            .map_err(|e| e.to_string())
    }

    /// Where each covered instruction the stub runs starts once
    /// re-encoded at `ip` (as `relocated(ip)` lays them out): (address in
    /// the stub, original address, original length).
    pub fn relocated_layout(&self, ip: u64) -> Result<Vec<(u64, u64, usize)>, String> {
        let block = InstructionBlock::new(&self.moved, ip);
        let encoded = BlockEncoder::encode(
            64,
            block,
            BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
        )
        .map_err(|e| e.to_string())?;
        Ok(self
            .moved
            .iter()
            .zip(&encoded.new_instruction_offsets)
            .filter(|(_, &at)| at != u32::MAX)
            .map(|(i, &at)| (ip + u64::from(at), i.ip(), i.len()))
            .collect())
    }

    /// Where execution continues after the covered instructions.
    pub fn resume(&self) -> u64 {
        self.rip + self.len as u64
    }
}

/// The effective address of `i`'s memory operand from the registers at
/// the position, unless it uses a register in `written` or one that is not
/// a 64-bit general register.
fn address_from(
    i: &Instruction,
    gprs: &[u64; 16],
    fs: u64,
    gs: u64,
    written: &[Register],
) -> Option<u64> {
    let reg = |r: Register| -> Option<u64> {
        if r == Register::None {
            return Some(0);
        }
        if written.contains(&r) {
            return None;
        }
        gpr_number(r).map(|n| gprs[n])
    };
    let base = reg(i.memory_base())?;
    let index = reg(i.memory_index())?;
    let segment = match i.memory_segment() {
        Register::FS => fs,
        Register::GS => gs,
        _ => 0,
    };
    Some(
        segment
            .wrapping_add(base)
            .wrapping_add(index.wrapping_mul(u64::from(i.memory_index_scale())))
            .wrapping_add(i.memory_displacement64()),
    )
}

/// A `switch`'s jump table as gcc lays them out: where it is and what
/// its entries hold. Its targets enter the code anywhere a case begins,
/// which no direct branch shows (`Site::entered_inside`): in busybox's
/// `bc` a position right after a dispatch covered two cases, the table
/// sent the thread to the second, inside the patch, and the replay ran
/// the middle of the `jmp rel32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JumpTable {
    /// 32-bit offsets from the table's own address, in position-independent
    /// code: `lea table(%rip), %rT; movslq (%rT,%rI,4), %rX; add %rT, %rX;
    /// jmp *%rX`.
    Relative(u64),
    /// 64-bit addresses: `jmp *table(,%rI,8)`.
    Absolute(u64),
}

impl JumpTable {
    /// The table's address.
    pub fn address(&self) -> u64 {
        match *self {
            JumpTable::Relative(a) | JumpTable::Absolute(a) => a,
        }
    }

    /// Bytes an entry takes.
    pub fn entry_len(&self) -> usize {
        match self {
            JumpTable::Relative(_) => 4,
            JumpTable::Absolute(_) => 8,
        }
    }

    /// Where the entries in `bytes`, read at the table's address, send a
    /// thread.
    pub fn targets<'a>(&self, bytes: &'a [u8]) -> impl Iterator<Item = u64> + 'a {
        let table = *self;
        bytes
            .chunks_exact(self.entry_len())
            .map(move |e| match table {
                JumpTable::Relative(a) => {
                    let offset = i32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                    a.wrapping_add(offset as i64 as u64)
                }
                JumpTable::Absolute(_) => {
                    u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]])
                }
            })
    }
}

/// The jump tables of the dispatches in `before` (the bytes that end at
/// `rip`) and in the first TABLE_WINDOW bytes of `code` (from `rip` on),
/// decoded at every offset whose bytes can start one: a RIP-relative
/// `lea` whose register a `movsxd` of 4-byte entries takes as its base
/// within the next 16 bytes, or a `jmp` through 8-byte entries at an
/// absolute address. Something else of that shape (a table of data) only
/// makes the recorder decline a position more often.
pub fn jump_tables(rip: u64, code: &[u8], before: &[u8]) -> Vec<JumpTable> {
    let after = &code[..code.len().min(TABLE_WINDOW)];
    let bytes: Vec<u8> = before.iter().chain(after).copied().collect();
    let base = rip.wrapping_sub(before.len() as u64);
    let mut d = Decoder::with_ip(64, &bytes, base, DecoderOptions::NONE);
    let mut at = |offset: usize| -> Option<Instruction> {
        d.set_position(offset).ok()?;
        d.set_ip(base.wrapping_add(offset as u64));
        let i = d.decode();
        (!i.is_invalid()).then_some(i)
    };
    let byte = |o: usize| bytes.get(o).copied().unwrap_or(0);
    let mut tables = Vec::new();
    for o in 0..bytes.len() {
        // REX.W 8d /r with mod 00, r/m 101: `lea reg, [rip + disp32]`.
        if byte(o) & 0xf8 == 0x48 && byte(o + 1) == 0x8d && byte(o + 2) & 0xc7 == 0x05 {
            let Some(lea) = at(o) else { continue };
            let reg = lea.op0_register();
            let end = o + lea.len();
            let dispatches = (end..(end + 16).min(bytes.len())).any(|m| {
                at(m).is_some_and(|i| {
                    i.mnemonic() == Mnemonic::Movsxd
                        && i.op1_kind() == OpKind::Memory
                        && i.memory_base() == reg
                        && i.memory_index_scale() == 4
                })
            });
            if dispatches {
                tables.push(JumpTable::Relative(lea.ip_rel_memory_address()));
            }
        }
        // ff /4 with a SIB of scale 8 and no base: `jmp [index*8 + disp32]`.
        if byte(o) == 0xff && byte(o + 1) == 0x24 && byte(o + 2) & 0xc7 == 0xc5 {
            let start = if o > 0 && byte(o - 1) & 0xf0 == 0x40 {
                o - 1
            } else {
                o
            };
            if let Some(jmp) = at(start) {
                if jmp.flow_control() == FlowControl::IndirectBranch
                    && jmp.op0_kind() == OpKind::Memory
                    && jmp.memory_base() == Register::None
                {
                    tables.push(JumpTable::Absolute(jmp.memory_displacement64()));
                }
            }
        }
    }
    tables.sort_unstable_by_key(JumpTable::address);
    tables.dedup();
    tables
}

#[cfg(test)]
mod tests {
    use super::*;

    const AT: u64 = 0x40_1000;

    fn site(code: &[u8]) -> Result<Site, Decline> {
        choose(AT, code, &[])
    }

    #[test]
    fn a_switch_dispatch_names_its_table_and_the_cases_it_jumps_to() {
        // busybox bc, the bytes before a recorded position (0x...d4e2):
        // cmp $0x25,%r13; ja; lea 0x18c47(%rip),%rsi; movslq
        // (%rsi,%r13,4),%rax; add %rsi,%rax; jmp *%rax.
        let rip = 0x7efe_f9f6_d4e2;
        let before = [
            0x49, 0x83, 0xfd, 0x25, 0x0f, 0x87, 0x6e, 0x07, 0x00, 0x00, 0x48, 0x8d, 0x35, 0x47,
            0x8c, 0x01, 0x00, 0x4a, 0x63, 0x04, 0xae, 0x48, 0x01, 0xf0, 0xff, 0xe0,
        ];
        // A case of one `mov` and then the next case.
        let code = [0x4c, 0x89, 0x08, 0x8b, 0x43, 0x08, 0x48, 0x83, 0xf8, 0x07];
        let tables = jump_tables(rip, &code, &before);
        assert_eq!(tables, vec![JumpTable::Relative(0x7efe_f9f8_6120)]);
        // Entries are offsets from the table: the second sends a thread 3
        // bytes into a patch at `rip`.
        let table = tables[0];
        let mut entries = Vec::new();
        for target in [rip, rip + 3, rip + 0x100] {
            let offset = (target as i64 - table.address() as i64) as i32;
            entries.extend(offset.to_le_bytes());
        }
        let targets: Vec<u64> = table.targets(&entries).collect();
        assert_eq!(targets, vec![rip, rip + 3, rip + 0x100]);
        // Without the `movsxd` the `lea` is no dispatch.
        let lea_alone = [0x48, 0x8d, 0x35, 0x47, 0x8c, 0x01, 0x00, 0x90, 0x90];
        assert!(jump_tables(rip, &code, &lea_alone).is_empty());
        // Non-PIC code: `jmp *0x601000(,%rax,8)` and, with an index of
        // r8 and up, its REX prefix; absolute 8-byte entries.
        for jmp in [
            &[0xff, 0x24, 0xc5, 0x00, 0x10, 0x60, 0x00][..],
            &[0x42, 0xff, 0x24, 0xc5, 0x00, 0x10, 0x60, 0x00][..],
        ] {
            assert_eq!(
                jump_tables(AT, &[0x90; 8], jmp),
                vec![JumpTable::Absolute(0x60_1000)]
            );
        }
        let absolute: Vec<u8> = [AT + 2, AT + 9]
            .iter()
            .flat_map(|a| a.to_le_bytes())
            .collect();
        assert_eq!(
            JumpTable::Absolute(0x60_1000)
                .targets(&absolute)
                .collect::<Vec<_>>(),
            vec![AT + 2, AT + 9]
        );
    }

    #[test]
    fn a_patch_entered_in_its_middle_is_refused() {
        // The spin loop gcc -O2 makes of `while (flag != r) n++;`, entered
        // at its condition:
        //   xor edx,edx; jmp 1f; nopl 0(rax)
        //   0: add rdx,1
        //   1: movslq flag(rip),rax; cmp rax,r14; jne 0b; ...
        let before = [0x31, 0xd2, 0xeb, 0x08, 0x0f, 0x1f, 0x40, 0x00];
        let code = [
            0x48, 0x83, 0xc2, 0x01, // add
            0x48, 0x63, 0x05, 0xa5, 0x2d, 0x00, 0x00, // movslq
            0x4c, 0x39, 0xf0, // cmp
            0x75, 0xf0, // jne -16
            0x48, 0x81, 0xfa, 0xe9, 0x03, 0x00, 0x00,
        ];
        let loop_at = AT + before.len() as u64;
        let mut all = before.to_vec();
        all.extend(code);
        let at = |offset: usize| {
            let rip = AT + offset as u64;
            let s = choose(rip, &all[offset..], &all[..offset]).unwrap();
            s.entered_inside(&all[offset..], &all[..offset])
        };
        // At the add, the patch covers the movslq the jmp enters at.
        assert_eq!(loop_at, AT + 8);
        assert!(at(8));
        // At the movslq or the cmp, every branch lands outside the patch.
        assert!(!at(12));
        assert!(!at(19));
        // A backward branch into the middle of the patch counts too.
        // nop; nop; nop; nop; nop; jne -6 (to the second nop)
        let code = [0x90, 0x90, 0x90, 0x90, 0x90, 0x75, 0xfa];
        let s = choose(AT, &code, &[]).unwrap();
        assert!(s.entered_inside(&code, &[]));
    }

    #[test]
    fn a_sibling_entry_far_before_the_patch_is_seen() {
        // The layout of glibc's memmove-vec-unaligned-erms.S: mempcpy sets
        // RAX and jumps to the `cmp` after memmove's first instruction,
        // more than LOOP_WINDOW bytes back; padding in between.
        let mut before = vec![
            0x48, 0x89, 0xf8, // mempcpy: mov rax,rdi
            0x48, 0x01, 0xd0, // add rax,rdx
            0xeb, 0x00, // jmp rel8 to memmove+3 (filled in below)
        ];
        before.resize(0x50, 0x90);
        let memmove = AT + before.len() as u64;
        let code = [
            0x48, 0x89, 0xf8, // memmove: mov rax,rdi
            0x48, 0x83, 0xfa, 0x20, // +3: cmp rdx,0x20
            0x72, 0x10, // jb
            0xc3, // ret
        ];
        before[7] = (memmove + 3 - (AT + 8)) as u8;
        assert!(before.len() as u64 > LOOP_WINDOW);
        assert!(before.len() as u64 <= ENTRY_WINDOW);
        let s = choose(
            memmove,
            &code,
            &before[before.len() - LOOP_WINDOW as usize..],
        )
        .unwrap();
        assert_eq!(s.len, 7);
        assert!(s.entered_inside(&code, &before));
        // The window the loops use does not reach the jump.
        assert!(!s.entered_inside(&code, &before[before.len() - LOOP_WINDOW as usize..]));
        // Aimed at memmove itself, the jump enters nothing.
        before[7] = (memmove - (AT + 8)) as u8;
        assert!(!s.entered_inside(&code, &before));
    }

    #[test]
    fn a_back_edge_far_after_the_patch_is_seen() {
        // Busybox bc's digit subtraction: the inner loop's `jmp` at +0x26
        // goes back to the `mov` at +0x11, the outer one's at +0x2b to the
        // `cmp` at +0x2; both land inside a patch at +0x0 or +0xd.
        let code = [
            0x31, 0xc0, // +0x00 xor eax,eax
            0x48, 0x39, 0xd0, // +0x02 cmp rax,rdx
            0x74, 0x26, // +0x05 je +0x2d
            0x8a, 0x0c, 0x06, // +0x07 mov cl,[rsi+rax]
            0x28, 0x0c, 0x07, // +0x0a sub [rdi+rax],cl
            0x48, 0x8d, 0x0c, 0x07, // +0x0d lea rcx,[rdi+rax]
            0x44, 0x8a, 0x01, // +0x11 mov r8b,[rcx]
            0x48, 0xff, 0xc1, // +0x14 inc rcx
            0x45, 0x84, 0xc0, // +0x17 test r8b,r8b
            0x79, 0x0c, // +0x1a jns +0x28
            0x41, 0x83, 0xc0, 0x0a, // +0x1c add r8d,10
            0xfe, 0x09, // +0x20 dec byte [rcx]
            0x44, 0x88, 0x41, 0xff, // +0x22 mov [rcx-1],r8b
            0xeb, 0xe9, // +0x26 jmp +0x11
            0x48, 0xff, 0xc0, // +0x28 inc rax
            0xeb, 0xd5, // +0x2b jmp +0x02
            0xc3, // +0x2d ret
        ];
        assert!(code.len() <= CODE_WINDOW);
        for offset in [0x0, 0xd] {
            let s = choose(
                AT + offset,
                &code[offset as usize..],
                &code[..offset as usize],
            )
            .unwrap();
            assert!(
                s.entered_inside(&code[offset as usize..], &code[..offset as usize]),
                "a patch at +{offset:#x} is entered in its middle"
            );
        }
        // At the `sub`, the patch covers the `sub` and the `lea`: nothing
        // enters there.
        let s = choose(AT + 0xa, &code[0xa..], &code[..0xa]).unwrap();
        assert!(!s.entered_inside(&code[0xa..], &code[..0xa]));
    }

    #[test]
    fn one_long_instruction_is_enough() {
        // add rax, 0x01234567
        let s = site(&[0x48, 0x05, 0x67, 0x45, 0x23, 0x01, 0x90]).unwrap();
        assert_eq!((s.len, s.resume()), (6, AT + 6));
        assert_eq!(
            s.relocated(0x7000).unwrap(),
            [0x48, 0x05, 0x67, 0x45, 0x23, 0x01]
        );
    }

    #[test]
    fn short_instructions_are_covered_together_and_branches_move() {
        // inc rbx; jmp -11 (a loop starting 6 bytes before)
        let before = [0x48, 0x05, 0x67, 0x45, 0x23, 0x01];
        let s = choose(AT, &[0x48, 0xff, 0xc3, 0xeb, 0xf5, 0xcc], &before).unwrap();
        assert_eq!(s.len, 5);
        let moved = s.relocated(0x7000).unwrap();
        // inc rbx; jmp rel32 back to AT - 6
        assert_eq!(&moved[..3], &[0x48, 0xff, 0xc3]);
        assert_eq!(moved[3], 0xe9);
        let rel = i32::from_le_bytes(moved[4..8].try_into().unwrap());
        assert_eq!(0x7008i64 + i64::from(rel), (AT - 6) as i64);
        // Where each lands in the stub, and where it came from.
        assert_eq!(
            s.relocated_layout(0x7000).unwrap(),
            vec![(0x7000, AT, 3), (0x7003, AT + 3, 2)]
        );
    }

    #[test]
    fn rip_relative_operands_keep_their_target() {
        // mov eax, [rip+0x100]
        let s = site(&[0x8b, 0x05, 0x00, 0x01, 0x00, 0x00]).unwrap();
        let moved = s.relocated(AT - 0x1000).unwrap();
        let disp = i32::from_le_bytes(moved[2..6].try_into().unwrap());
        assert_eq!(AT - 0x1000 + 6 + disp as u64, AT + 6 + 0x100);
    }

    #[test]
    fn positions_that_cannot_be_found_again_are_declined() {
        // rep movsb
        assert_eq!(
            site(&[0xf3, 0xa4, 0x90, 0x90, 0x90]).unwrap_err(),
            Decline::RepString
        );
        // call rel32; syscall; ud2; in al, dx
        assert!(matches!(
            site(&[0xe8, 0, 0, 0, 0]),
            Err(Decline::Immovable(_))
        ));
        assert!(matches!(
            site(&[0x0f, 0x05, 0x90, 0x90, 0x90]),
            Err(Decline::Immovable(_))
        ));
        assert!(matches!(
            site(&[0x0f, 0x0b, 0x90, 0x90, 0x90]),
            Err(Decline::Immovable(_))
        ));
        assert!(matches!(
            site(&[0xec, 0x90, 0x90, 0x90, 0x90]),
            Err(Decline::Immovable(_))
        ));
        // A call after a short first instruction cannot move either.
        assert!(matches!(
            site(&[0x90, 0xe8, 0, 0, 0, 0]),
            Err(Decline::Immovable(_))
        ));
        // ret ends the code: the next bytes are someone else's.
        assert!(matches!(
            site(&[0xc3, 0x90, 0x90, 0x90, 0x90]),
            Err(Decline::EndsEarly(_))
        ));
        // Bytes that run out mid-instruction.
        assert_eq!(site(&[0x48, 0x05, 0x67]).unwrap_err(), Decline::Unreadable);
    }

    #[test]
    fn memory_the_position_uses_is_found_from_its_registers() {
        let mut gprs = [0u64; 16];
        gprs[3] = 0x60_0000; // rbx
                             // L: add qword [rbx+8], 1; add rax, [rip+0x100]; AT: inc rcx; jmp L
        let before = [
            0x48, 0x83, 0x43, 0x08, 0x01, 0x48, 0x03, 0x05, 0x00, 0x01, 0x00, 0x00,
        ];
        let code = [0x48, 0xff, 0xc1, 0xeb, 0xef];
        let s = choose(AT, &code, &before).unwrap();
        assert_eq!(s.body.len(), 2);
        assert_eq!(s.memory_words(&gprs, 0, 0), [0x60_0008, AT + 0x100]);
        // A base the loop changes before the position says nothing there.
        // L: add qword [rbx+8], 1; add rbx, 8; add rax, [rip+0x100]; AT: ...
        let before = [
            0x48, 0x83, 0x43, 0x08, 0x01, 0x48, 0x83, 0xc3, 0x08, 0x48, 0x03, 0x05, 0x00, 0x01,
            0x00, 0x00,
        ];
        let code = [0x48, 0xff, 0xc1, 0xeb, 0xeb];
        let s = choose(AT, &code, &before).unwrap();
        assert_eq!(s.body.len(), 3);
        assert_eq!(s.memory_words(&gprs, 0, 0), [AT + 0x100]);
        // A TLS operand: fs:[rax].
        gprs[0] = 0x10;
        let s = site(&[0x64, 0x48, 0x8b, 0x00, 0x90, 0x90]).unwrap();
        assert_eq!(s.memory_words(&gprs, 0x7000, 0), [0x7010]);
    }

    #[test]
    fn a_short_spin_loop_is_covered_only_when_nothing_leaves_it_for_the_patch() {
        // L: pause; jmp L, then the code after the loop.
        let code = [0xf3, 0x90, 0xeb, 0xfc, 0x48, 0x31, 0xc0];
        let s = choose(AT, &code, &[]).unwrap();
        assert_eq!(s.len, PATCH_LEN);
        // The kick on the jump itself: the loop starts 2 bytes back.
        let s = choose(AT + 2, &code[2..], &code[..2]).unwrap();
        assert_eq!(s.len, PATCH_LEN);
        // Without the bytes before, the loop cannot be checked.
        assert!(choose(AT + 2, &code[2..], &[]).is_err());
        // L: test eax,eax; jne OUT; jmp L; OUT: — the loop leaves for the
        // bytes right after the jump, which a patch on the jump would cover.
        let code = [0x85, 0xc0, 0x75, 0x02, 0xeb, 0xfa, 0x90, 0x90, 0x90];
        assert!(choose(AT + 4, &code[4..], &code[..4]).is_err());
    }
}
