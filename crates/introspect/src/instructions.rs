//! Replay-time expansion: what one user instruction of a traced process
//! was and which memory it touched, and the files that hold them
//! (docs/expansion.md).
//!
//! The replaying VM single-steps the traced process (`vm/expand.rs`) and
//! hands each step here as the registers before the instruction and its
//! bytes; the accesses are computed from the decoded operands, as the
//! processor computes them, so a step costs no second look at memory.

use std::collections::HashMap;
use std::io::{self, Write};

pub use events::abi::MemAccess;
use iced_x86::{Decoder, DecoderOptions, Instruction, InstructionInfoFactory, OpAccess, Register};

/// The longest x86 instruction.
pub const MAX_INSN: usize = 15;

/// Magic at the start of an instruction trace (after decompression).
pub const INSN_MAGIC: &[u8; 8] = b"INSITRC1";
/// The same, for a trace whose records carry the registers.
pub const INSN_REGS_MAGIC: &[u8; 8] = b"INSITRR1";
/// RFLAGS.TF, which the tracing sets (and leaves out of the registers it
/// logs).
pub const TF: u64 = 1 << 8;

/// One memory access of one instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub addr: u64,
    pub size: u32,
    pub kind: MemAccess,
}

/// The user registers before an instruction, as the decoder needs them.
#[derive(Clone, Copy, Debug, Default)]
pub struct UserRegs {
    pub gprs: [u64; 16],
    pub rip: u64,
    pub rflags: u64,
    pub fs_base: u64,
    pub gs_base: u64,
}

impl UserRegs {
    pub fn from_kvm(regs: &kvm_bindings::kvm_regs) -> Self {
        UserRegs {
            gprs: [
                regs.rax, regs.rcx, regs.rdx, regs.rbx, regs.rsp, regs.rbp, regs.rsi, regs.rdi,
                regs.r8, regs.r9, regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15,
            ],
            rip: regs.rip,
            rflags: regs.rflags,
            fs_base: 0,
            gs_base: 0,
        }
    }

    /// The stack pointer.
    pub fn rsp(&self) -> u64 {
        self.gprs[4]
    }

    /// The value of a register an address is computed from; `None` for
    /// one that never is (vector index registers: gathers are left out).
    fn value(&self, reg: Register, next_ip: u64) -> Option<u64> {
        let full = reg.full_register();
        let value = match full {
            Register::RIP => next_ip,
            // Segment bases, whole: the register itself is 16 bits.
            Register::FS => return Some(self.fs_base),
            Register::GS => return Some(self.gs_base),
            Register::ES | Register::CS | Register::SS | Register::DS => return Some(0),
            _ if full.is_gpr64() => *self.gprs.get(full.number())?,
            _ => return None,
        };
        Some(match reg.size() {
            4 => value & 0xffff_ffff,
            2 => value & 0xffff,
            _ => value,
        })
    }
}

/// Whether an instruction reads FS- or GS-relative memory (the bases are
/// read from the vCPU only then).
pub fn uses_segment_base(insn: &Instruction) -> bool {
    matches!(insn.memory_segment(), Register::FS | Register::GS)
}

/// Decodes the instruction at `rip` from `bytes` (which may be shorter
/// than 15 where the next page is not mapped); `None` if they are not one.
pub fn decode(bytes: &[u8], rip: u64) -> Option<Instruction> {
    let mut decoder = Decoder::with_ip(64, bytes, rip, DecoderOptions::NONE);
    let insn = decoder.decode();
    (!insn.is_invalid()).then_some(insn)
}

/// The instructions in `code` (at `base`), decoded from its start, whose
/// result the VMM cannot record on a host that runs guest user code
/// natively and cannot trap them there: RDRAND and RDSEED (their
/// addresses and names). User-mode CPUID and RDTSC are left out: the
/// replay runs on the recording's host CPU, and RDTSC's trap is a host
/// check of its own.
pub fn unrecordable(code: &[u8], base: u64) -> Vec<(u64, &'static str)> {
    let mut decoder = Decoder::with_ip(64, code, base, DecoderOptions::NONE);
    let mut found = Vec::new();
    let mut insn = Instruction::default();
    while decoder.can_decode() {
        decoder.decode_out(&mut insn);
        let name = match insn.mnemonic() {
            iced_x86::Mnemonic::Rdrand => "RDRAND",
            iced_x86::Mnemonic::Rdseed => "RDSEED",
            _ => continue,
        };
        found.push((insn.ip(), name));
    }
    found
}

/// Whether the next instruction a thread executes after `insn` is the
/// one that follows it in memory (no branch, call, return, system call or
/// interrupt; a REP string instruction is stepped once per iteration, so
/// it follows itself until its count runs out).
pub fn continues_at_next(insn: &Instruction) -> bool {
    insn.flow_control() == iced_x86::FlowControl::Next
        && !insn.has_rep_prefix()
        && !insn.has_repne_prefix()
}

/// The instruction before the one at `end` in straight-line code:
/// `code` holds the bytes from `start` (an instruction boundary, such as
/// the start of the function) up to `end`. Decoding forwards from a known
/// boundary is exact where decoding backwards is not: the bytes before an
/// instruction often decode as several different instructions ending
/// there, and a breakpoint put in the middle of the real one changes what
/// the program runs (`31 c0`, `xor %eax,%eax`, becomes `31 cc`, `xor
/// %ecx,%esp`).
///
/// `Some(Some(p))`: the instruction at `p` ends at `end` and a thread may
/// go on from it to `end` (a conditional jump not taken, a system call
/// or a string instruction's last round too; no jump, call or return). `Some(None)`: `end` is the
/// first instruction, or the one before it never falls through to it.
/// `None`: decoding from `start` does not come to `end` exactly (data
/// among the code, or `start` not a boundary).
pub fn predecessor(code: &[u8], start: u64, end: u64) -> Option<Option<u64>> {
    if end.checked_sub(start)? != code.len() as u64 {
        return None;
    }
    let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
    let mut last = None;
    while decoder.can_decode() {
        let insn = decoder.decode();
        if insn.is_invalid() {
            return None;
        }
        last = Some(insn);
    }
    let Some(insn) = last else {
        return Some(None);
    };
    if insn.next_ip() != end {
        return None;
    }
    let falls_through = matches!(
        insn.flow_control(),
        iced_x86::FlowControl::Next | iced_x86::FlowControl::ConditionalBranch
    ) || insn.code() == iced_x86::Code::Syscall;
    Some(falls_through.then_some(insn.ip()))
}

/// Whether the instruction at the start of `bytes` is a string
/// instruction with a REP prefix, which runs its rounds one at a time.
pub fn repeats(bytes: &[u8], rip: u64) -> bool {
    decode(bytes, rip).is_some_and(|i| i.has_rep_prefix() || i.has_repne_prefix())
}

/// The general-purpose registers (64-bit names) an instruction writes.
pub fn written_registers(
    factory: &mut InstructionInfoFactory,
    insn: &Instruction,
) -> Vec<Register> {
    factory
        .info(insn)
        .used_registers()
        .iter()
        .filter(|u| {
            matches!(
                u.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            )
        })
        .map(|u| u.register().full_register())
        .filter(|r| r.is_gpr64())
        .collect()
}

/// Whether any memory an instruction accesses (implicit stack operands
/// included) is addressed through one of `regs` (64-bit names).
pub fn address_uses_any(
    factory: &mut InstructionInfoFactory,
    insn: &Instruction,
    regs: &[Register],
) -> bool {
    factory.info(insn).used_memory().iter().any(|m| {
        [m.base(), m.index()]
            .iter()
            .any(|r| *r != Register::None && regs.contains(&r.full_register()))
    })
}

/// The memory an instruction reads and writes, from the registers before
/// it. Conditional accesses (CMOVcc) count as done, as lackey counts them.
pub fn accesses(
    factory: &mut InstructionInfoFactory,
    insn: &Instruction,
    regs: &UserRegs,
) -> Vec<Access> {
    let mut out = Vec::new();
    each_access(factory, insn, regs, |access| {
        if let Some(access) = access {
            out.push(access);
        }
    });
    out
}

/// Every access an instruction makes, as [`accesses`] counts them, if the
/// address of each is known (`None` if one is not: a vector index, or a
/// size the decoder does not give).
pub fn all_accesses(
    factory: &mut InstructionInfoFactory,
    insn: &Instruction,
    regs: &UserRegs,
) -> Option<Vec<Access>> {
    let mut out = Some(Vec::new());
    each_access(factory, insn, regs, |access| match (access, &mut out) {
        (Some(access), Some(list)) => list.push(access),
        _ => out = None,
    });
    out
}

/// Calls `f` with each memory access of `insn` (`None` for one whose
/// address or size is unknown).
fn each_access(
    factory: &mut InstructionInfoFactory,
    insn: &Instruction,
    regs: &UserRegs,
    mut f: impl FnMut(Option<Access>),
) {
    let next_ip = insn.next_ip();
    let info = factory.info(insn);
    for used in info.used_memory() {
        let kind = match used.access() {
            OpAccess::Read | OpAccess::CondRead => MemAccess::Load,
            OpAccess::Write | OpAccess::CondWrite => MemAccess::Store,
            OpAccess::ReadWrite | OpAccess::ReadCondWrite => MemAccess::Modify,
            // LEA, prefetches, NOP with a memory operand: no access.
            _ => continue,
        };
        let size = used.memory_size().size() as u32;
        let addr = used.virtual_address(0, |reg, _, _| regs.value(reg, next_ip));
        f(addr
            .filter(|_| size != 0)
            .map(|addr| Access { addr, size, kind }));
    }
}

/// Bytes of the registers in a record of a trace with registers: the 16
/// general-purpose registers and RFLAGS.
const REGS_BYTES: usize = 17 * 8;

/// The instruction trace: a zstd stream of `INSN_MAGIC`, then per
/// instruction its thread (u32), address (u64), length (u8) and bytes,
/// little-endian; with registers, `INSN_REGS_MAGIC` and after each
/// record's bytes the registers before the instruction (RAX, RCX, RDX,
/// RBX, RSP, RBP, RSI, RDI, R8–R15, RFLAGS; u64 each).
pub struct InstructionTrace {
    out: Box<dyn Write + Send>,
    registers: bool,
    started: bool,
}

impl InstructionTrace {
    pub fn new(out: Box<dyn Write + Send>, registers: bool) -> Self {
        InstructionTrace {
            out,
            registers,
            started: false,
        }
    }

    fn start(&mut self) -> io::Result<()> {
        if !self.started {
            let magic = if self.registers {
                INSN_REGS_MAGIC
            } else {
                INSN_MAGIC
            };
            self.out.write_all(magic)?;
            self.started = true;
        }
        Ok(())
    }

    /// The instruction `bytes` thread `lwpid` ran at `regs.rip`, with
    /// the registers before it.
    pub fn push(&mut self, lwpid: u32, regs: &UserRegs, bytes: &[u8]) -> io::Result<()> {
        self.start()?;
        let mut record = [0u8; 13 + MAX_INSN + REGS_BYTES];
        let len = bytes.len().min(MAX_INSN);
        record[..4].copy_from_slice(&lwpid.to_le_bytes());
        record[4..12].copy_from_slice(&regs.rip.to_le_bytes());
        record[12] = len as u8;
        record[13..13 + len].copy_from_slice(&bytes[..len]);
        let mut end = 13 + len;
        if self.registers {
            // RFLAGS as the program has it, without the tracing's TF.
            for value in regs.gprs.iter().chain([&(regs.rflags & !TF)]) {
                record[end..end + 8].copy_from_slice(&value.to_le_bytes());
                end += 8;
            }
        }
        self.out.write_all(&record[..end])
    }

    pub fn finish(&mut self) -> io::Result<()> {
        self.start()?;
        self.out.flush()
    }
}

/// Registers of a traced instruction, before it ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registers {
    /// RAX, RCX, RDX, RBX, RSP, RBP, RSI, RDI, R8–R15.
    pub gprs: [u64; 16],
    pub rflags: u64,
}

/// One instruction read back from an instruction trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TracedInstruction {
    pub lwpid: u32,
    pub rip: u64,
    pub bytes: Vec<u8>,
    /// In a trace written with registers.
    pub registers: Option<Registers>,
}

/// Reads the records of a decompressed instruction trace; an error names
/// what is wrong with it.
pub fn read_instructions(data: &[u8]) -> Result<Vec<TracedInstruction>, String> {
    let (rest, with_registers) = match data.get(..8) {
        Some(m) if m == INSN_MAGIC => (&data[8..], false),
        Some(m) if m == INSN_REGS_MAGIC => (&data[8..], true),
        _ => return Err("not an insight instruction trace (no INSITRC1 or INSITRR1 magic)".into()),
    };
    let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8"));
    let mut out = Vec::new();
    let mut at = 0;
    while at < rest.len() {
        let head = rest
            .get(at..at + 13)
            .ok_or_else(|| format!("the record at byte {} is cut short", at + 8))?;
        let len = head[12] as usize;
        if len == 0 || len > MAX_INSN {
            return Err(format!(
                "the record at byte {} says its instruction is {len} bytes long",
                at + 8
            ));
        }
        let end = at + 13 + len + if with_registers { REGS_BYTES } else { 0 };
        let record = rest
            .get(at..end)
            .ok_or_else(|| format!("the record at byte {} is cut short", at + 8))?;
        let registers = with_registers.then(|| {
            let r = &record[13 + len..];
            Registers {
                gprs: std::array::from_fn(|i| word(r, i)),
                rflags: word(r, 16),
            }
        });
        out.push(TracedInstruction {
            lwpid: u32::from_le_bytes(head[..4].try_into().expect("4 bytes")),
            rip: u64::from_le_bytes(head[4..12].try_into().expect("8 bytes")),
            bytes: record[13..13 + len].to_vec(),
            registers,
        });
        at = end;
    }
    Ok(out)
}

/// The memory trace: a text line per access, `KIND ADDRESS SIZE LWPID
/// RIP EXIT` (KIND as lackey's L, S, M; addresses in hex; EXIT the
/// deterministic exits replayed before it, its position with the line's
/// order).
pub struct MemoryTrace {
    out: Box<dyn Write + Send>,
}

impl MemoryTrace {
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        MemoryTrace { out }
    }

    pub fn push(&mut self, lwpid: u32, rip: u64, access: &Access, exit: u64) -> io::Result<()> {
        writeln!(
            self.out,
            "{} {:#x} {} {lwpid} {rip:#x} {exit}",
            access.kind.letter(),
            access.addr,
            access.size
        )
    }

    pub fn finish(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// Bytes below RSP a function may use without moving it (the x86-64 ABI's
/// red zone).
const RED_ZONE: u64 = 128;
/// An RSP this far below the top seen is on another stack.
const STACK_SPAN: u64 = 64 << 20;

/// Where each traced thread's stack is, as its RSP tells: from RSP (less
/// the red zone) up to the end of the page of the highest RSP the thread
/// had on that stack. Its callers' frames lie there; the arguments and
/// environment above the first frame, and frames of callers that ran
/// before tracing began, do not count until RSP has been that high.
#[derive(Default)]
pub struct Stacks {
    top: HashMap<u32, u64>,
}

impl Stacks {
    /// Thread `lwpid` is about to run an instruction with `rsp`.
    pub fn saw(&mut self, lwpid: u32, rsp: u64) {
        let end = (rsp | 0xfff).saturating_add(1);
        let top = self.top.entry(lwpid).or_insert(end);
        // Above the top: the stack has grown back; far below: another
        // stack (a coroutine's, or a new program's).
        if rsp >= *top || *top - rsp > STACK_SPAN {
            *top = end;
        }
    }

    /// The thread's stack is not where it was (it ran execve).
    pub fn moved(&mut self, lwpid: u32) {
        self.top.remove(&lwpid);
    }

    /// Whether `addr`, accessed by `lwpid` with `rsp`, is on its stack.
    pub fn holds(&self, lwpid: u32, rsp: u64, addr: u64) -> bool {
        self.top
            .get(&lwpid)
            .is_some_and(|&top| addr >= rsp.saturating_sub(RED_ZONE) && addr < top)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_instruction_before_one_is_found_by_decoding_from_a_boundary() {
        // glibc's read(): cmpb $0,..(%rip); je +0x17; xor %eax,%eax;
        // syscall; then the instruction at 0x10ad. Backwards, 0x10aa
        // (`c0 0f 05`, a rotate) would end there too.
        let code = [
            0x80, 0x3d, 0x31, 0x33, 0x0e, 0x00, 0x00, 0x74, 0x17, 0x31, 0xc0, 0x0f, 0x05,
        ];
        assert_eq!(predecessor(&code, 0x10a0, 0x10ad), Some(Some(0x10ab)));
        assert_eq!(predecessor(&code[..11], 0x10a0, 0x10ab), Some(Some(0x10a9)));
        // After a conditional jump the thread may go on at the next one.
        assert_eq!(predecessor(&code[..9], 0x10a0, 0x10a9), Some(Some(0x10a7)));
        // The first instruction has none before it.
        assert_eq!(predecessor(&[], 0x10a0, 0x10a0), Some(None));
        // Not a boundary: decoding from the start runs past it.
        assert_eq!(predecessor(&code[..10], 0x10a0, 0x10aa), None);
        // Bytes that do not cover start..end exactly.
        assert_eq!(predecessor(&code, 0x10a0, 0x10ae), None);
        // After a jump or a call nothing falls through.
        assert_eq!(predecessor(&[0xeb, 0x10], 0x2000, 0x2002), Some(None));
        assert_eq!(predecessor(&[0xe8, 0, 0, 0, 0], 0x3000, 0x3005), Some(None));
        // REP MOVSB runs round by round; MOVSB alone does not.
        assert!(repeats(&[0xf3, 0xa4], 0));
        assert!(!repeats(&[0xa4], 0));
    }

    #[test]
    fn a_stack_reaches_from_the_red_zone_to_the_highest_frame() {
        let mut s = Stacks::default();
        assert!(!s.holds(1, 0x7ffd_0000_1800, 0x7ffd_0000_1800));
        s.saw(1, 0x7ffd_0000_1800);
        // Deeper: the caller's frame above still counts.
        s.saw(1, 0x7ffd_0000_1000);
        assert!(s.holds(1, 0x7ffd_0000_1000, 0x7ffd_0000_1000 - 128));
        assert!(s.holds(1, 0x7ffd_0000_1000, 0x7ffd_0000_1ff8));
        assert!(!s.holds(1, 0x7ffd_0000_1000, 0x7ffd_0000_1000 - 129));
        assert!(!s.holds(1, 0x7ffd_0000_1000, 0x7ffd_0000_2000));
        // Another thread's stack is not this one's.
        assert!(!s.holds(2, 0x7ffd_0000_1000, 0x7ffd_0000_1008));
        // Back above the first frame: the top follows.
        s.saw(1, 0x7ffd_0000_2100);
        assert!(s.holds(1, 0x7ffd_0000_2100, 0x7ffd_0000_2ff0));
        // A stack far below (a coroutine's on the heap): its own top.
        s.saw(1, 0x5555_0000_0800);
        assert!(s.holds(1, 0x5555_0000_0800, 0x5555_0000_0f00));
        assert!(!s.holds(1, 0x5555_0000_0800, 0x7ffd_0000_1000));
        s.moved(1);
        assert!(!s.holds(1, 0x5555_0000_0800, 0x5555_0000_0808));
    }

    fn regs() -> UserRegs {
        let mut r = UserRegs {
            rip: 0x401000,
            fs_base: 0x7000_0000,
            ..Default::default()
        };
        for (i, g) in r.gprs.iter_mut().enumerate() {
            *g = 0x10_0000 * (i as u64 + 1);
        }
        r
    }

    fn one(bytes: &[u8]) -> Vec<Access> {
        let r = regs();
        let insn = decode(bytes, r.rip).expect("an instruction");
        accesses(&mut InstructionInfoFactory::new(), &insn, &r)
    }

    #[test]
    fn operands_give_addresses_sizes_and_kinds() {
        // mov dword [rax+rcx*4+8], edx
        assert_eq!(
            one(&[0x89, 0x54, 0x88, 0x08]),
            vec![Access {
                addr: 0x10_0000 + 0x20_0000 * 4 + 8,
                size: 4,
                kind: MemAccess::Store
            }]
        );
        // mov eax, [rip+0x100] (7 bytes: next_ip + 0x100)
        assert_eq!(
            one(&[0x8b, 0x05, 0x00, 0x01, 0x00, 0x00]),
            vec![Access {
                addr: 0x401006 + 0x100,
                size: 4,
                kind: MemAccess::Load
            }]
        );
        // add qword [rbx], 1
        assert_eq!(
            one(&[0x48, 0x83, 0x03, 0x01]),
            vec![Access {
                addr: 0x40_0000,
                size: 8,
                kind: MemAccess::Modify
            }]
        );
        // push rbp: a store below RSP
        assert_eq!(
            one(&[0x55]),
            vec![Access {
                addr: 0x50_0000 - 8,
                size: 8,
                kind: MemAccess::Store
            }]
        );
        // mov rax, fs:[0x28]
        assert_eq!(
            one(&[0x64, 0x48, 0x8b, 0x04, 0x25, 0x28, 0, 0, 0]),
            vec![Access {
                addr: 0x7000_0028,
                size: 8,
                kind: MemAccess::Load
            }]
        );
        // lea rax, [rbx+8] and nop: no access
        assert!(one(&[0x48, 0x8d, 0x43, 0x08]).is_empty());
        assert!(one(&[0x90]).is_empty());
    }

    #[test]
    fn instruction_traces_read_back_and_damage_is_named() {
        struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        for with_registers in [false, true] {
            buf.lock().unwrap().clear();
            let mut t = InstructionTrace::new(Box::new(Shared(buf.clone())), with_registers);
            let mut r = regs();
            r.rflags = 0x346; // TF (0x100) set by the tracing
            t.push(7, &r, &[0x90]).unwrap();
            r.rip += 1;
            t.push(8, &r, &[0x48, 0x83, 0x03, 0x01]).unwrap();
            t.finish().unwrap();
            let data = buf.lock().unwrap().clone();
            let read = read_instructions(&data).unwrap();
            assert_eq!(read.len(), 2);
            assert_eq!((read[1].lwpid, read[1].rip), (8, 0x401001));
            assert_eq!(read[1].bytes, vec![0x48, 0x83, 0x03, 0x01]);
            match read[1].registers {
                Some(got) => {
                    assert!(with_registers);
                    assert_eq!(got.gprs, r.gprs);
                    assert_eq!(got.rflags, 0x246);
                }
                None => assert!(!with_registers),
            }
            assert!(read_instructions(&data[..data.len() - 1])
                .unwrap_err()
                .contains("cut short"));
        }
        assert!(read_instructions(b"nothing").unwrap_err().contains("magic"));
    }

    #[test]
    fn finds_the_instructions_whose_results_cannot_be_recorded() {
        // mov eax,1; rdrand rax; nop; rdseed ecx; a constant holding
        // rdrand's bytes inside a mov's immediate is no rdrand.
        let code = [
            0xb8, 1, 0, 0, 0, 0x48, 0x0f, 0xc7, 0xf0, 0x90, 0x0f, 0xc7, 0xf9, 0xb8, 0x0f, 0xc7,
            0xf0, 0x90,
        ];
        assert_eq!(
            unrecordable(&code, 0x1000),
            [(0x1005, "RDRAND"), (0x100a, "RDSEED")]
        );
        assert!(unrecordable(&[0x90, 0xc3], 0).is_empty());
    }
}
