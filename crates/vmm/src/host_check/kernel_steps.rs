//! Whether user code runs the same when KVM single-steps it in guest
//! kernel mode (how the replay-time tracer steps most instructions,
//! `tools::kernel_steps`), with the check guest: one block of user code
//! (the instruction kinds the tracer steps so, with the arithmetic flags of
//! each group folded into R14) runs once natively in user mode and once a
//! step at a time at CPL 0, from the same registers; the registers, the
//! SSE registers and the memory it wrote must come out the same, and every
//! step must have run exactly one instruction.

use iced_x86::{Decoder, DecoderOptions, FlowControl};
use kvm_bindings::{KVM_GUESTDBG_ENABLE, KVM_GUESTDBG_SINGLESTEP};
use kvm_ioctls::Kvm;
use vm_memory::{Bytes, GuestAddress};

use super::check_vm::*;

/// What the comparison found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelStepReport {
    /// Steps the kernel-mode run took.
    pub steps: u64,
    /// Each way the two runs differed (empty: none).
    pub differences: Vec<String>,
}

/// One instruction of the block: its bytes, and its text (`objdump -M
/// intel`; offsets in a branch's text are the block's).
type Insn = (&'static [u8], &'static str);

/// The block's groups of instructions, assembled: registers set, then each
/// kind of instruction. After each group [`FOLD`] folds the arithmetic
/// flags (CF, PF, AF, ZF, SF, OF) of what came before into R14, undefined
/// ones included (the emulator must leave them as the CPU does), and
/// clears the stack word PUSHFQ wrote (its IOPL and IF differ); R14 is
/// rotated before the next group.
const GROUPS: &[&[Insn]] = &[
    &[
        (
            &[0x48, 0xb8, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80],
            "movabs rax,0x8000000000000001",
        ),
        (
            &[0x48, 0xb9, 0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01],
            "movabs rcx,0x123456789abcdef",
        ),
        (
            &[0x48, 0xc7, 0xc2, 0xf9, 0xff, 0xff, 0xff],
            "mov rdx,0xfffffffffffffff9",
        ),
        (&[0x48, 0xc7, 0xc3, 0x03, 0x00, 0x00, 0x00], "mov rbx,0x3"),
        (
            &[0x48, 0xc7, 0xc6, 0x00, 0x00, 0x10, 0x00],
            "mov rsi,0x100000",
        ),
        (
            &[0x48, 0xc7, 0xc7, 0x00, 0x01, 0x10, 0x00],
            "mov rdi,0x100100",
        ),
        (
            &[0x48, 0xbd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
            "movabs rbp,0x7fffffffffffffff",
        ),
        (&[0x49, 0xc7, 0xc0, 0x55, 0x55, 0x00, 0x00], "mov r8,0x5555"),
        (
            &[0x48, 0xc7, 0x06, 0x34, 0x12, 0x00, 0x00],
            "mov QWORD PTR [rsi],0x1234",
        ),
        (
            &[0x48, 0xc7, 0x46, 0x08, 0xff, 0xff, 0xff, 0xff],
            "mov QWORD PTR [rsi+0x8],0xffffffffffffffff",
        ),
        (&[0xf3, 0x0f, 0x6f, 0x06], "movdqu xmm0,XMMWORD PTR [rsi]"),
        (&[0x66, 0x0f, 0x6f, 0x0e], "movdqa xmm1,XMMWORD PTR [rsi]"),
        (&[0x0f, 0x28, 0x16], "movaps xmm2,XMMWORD PTR [rsi]"),
        (
            &[0x0f, 0x11, 0x4e, 0x20],
            "movups XMMWORD PTR [rsi+0x20],xmm1",
        ),
        (&[0x66, 0x0f, 0x28, 0xd8], "movapd xmm3,xmm0"),
        (
            &[0x66, 0x0f, 0x11, 0x56, 0x30],
            "movupd XMMWORD PTR [rsi+0x30],xmm2",
        ),
        (
            &[0x66, 0x0f, 0xe7, 0x46, 0x40],
            "movntdq XMMWORD PTR [rsi+0x40],xmm0",
        ),
        (
            &[0x0f, 0x2b, 0x4e, 0x50],
            "movntps XMMWORD PTR [rsi+0x50],xmm1",
        ),
        (
            &[0x66, 0x0f, 0x2b, 0x56, 0x60],
            "movntpd XMMWORD PTR [rsi+0x60],xmm2",
        ),
        (&[0x48, 0x01, 0xc8], "add rax,rcx"),
    ],
    &[
        (&[0x48, 0x11, 0xd1], "adc rcx,rdx"),
        (&[0x48, 0x19, 0xda], "sbb rdx,rbx"),
    ],
    &[(&[0x48, 0x0f, 0xaf, 0xc1], "imul rax,rcx")],
    &[
        (
            &[0x48, 0x69, 0xd3, 0x43, 0x42, 0x0f, 0x00],
            "imul rdx,rbx,0xf4243",
        ),
        (&[0x48, 0xf7, 0xe1], "mul rcx"),
    ],
    &[
        (&[0x48, 0xc7, 0xc1, 0x0d, 0x00, 0x00, 0x00], "mov rcx,0xd"),
        (&[0x31, 0xd2], "xor edx,edx"),
        (&[0x48, 0xf7, 0xf1], "div rcx"),
    ],
    &[
        (
            &[0x48, 0xc7, 0xc1, 0xfb, 0xff, 0xff, 0xff],
            "mov rcx,0xfffffffffffffffb",
        ),
        (&[0x48, 0x99], "cqo"),
        (&[0x48, 0xf7, 0xf9], "idiv rcx"),
    ],
    &[(&[0x48, 0xd3, 0xe0], "shl rax,cl")],
    &[
        (&[0x48, 0xc1, 0xea, 0x03], "shr rdx,0x3"),
        (&[0x48, 0xd3, 0xfd], "sar rbp,cl"),
        (&[0x48, 0xd3, 0xc0], "rol rax,cl"),
        (&[0x48, 0xd1, 0xca], "ror rdx,1"),
        (&[0x48, 0xd3, 0xd3], "rcl rbx,cl"),
        (&[0x48, 0xc1, 0xdd, 0x02], "rcr rbp,0x2"),
    ],
    &[
        (&[0x48, 0x0f, 0xa5, 0xd0], "shld rax,rdx,cl"),
        (&[0x48, 0x0f, 0xac, 0xeb, 0x09], "shrd rbx,rbp,0x9"),
    ],
    &[
        (&[0x48, 0x0f, 0xba, 0xe0, 0x21], "bt rax,0x21"),
        (&[0x48, 0x0f, 0xab, 0xcb], "bts rbx,rcx"),
        (&[0x48, 0x0f, 0xba, 0xf2, 0x05], "btr rdx,0x5"),
        (&[0x48, 0x0f, 0xba, 0xfd, 0x3f], "btc rbp,0x3f"),
    ],
    &[
        (&[0x4c, 0x0f, 0xbc, 0xc8], "bsf r9,rax"),
        (&[0x4c, 0x0f, 0xbd, 0xd2], "bsr r10,rdx"),
    ],
    &[
        (&[0x49, 0x0f, 0xc8], "bswap r8"),
        (&[0x48, 0xf7, 0xdb], "neg rbx"),
        (&[0x48, 0xf7, 0xd5], "not rbp"),
        (&[0x48, 0xff, 0xc0], "inc rax"),
        (&[0x48, 0xff, 0xca], "dec rdx"),
        (&[0x48, 0x21, 0xc1], "and rcx,rax"),
        (&[0x48, 0x09, 0xda], "or rdx,rbx"),
        (&[0x48, 0x31, 0xc5], "xor rbp,rax"),
        (&[0x48, 0x29, 0xe8], "sub rax,rbp"),
        (&[0x48, 0x39, 0xd0], "cmp rax,rdx"),
        (&[0x41, 0x0f, 0x94, 0xc3], "sete r11b"),
        (&[0x41, 0x0f, 0x9c, 0xc4], "setl r12b"),
        (&[0x41, 0x0f, 0x97, 0xc5], "seta r13b"),
        (&[0x48, 0x0f, 0x4f, 0xd8], "cmovg rbx,rax"),
        (&[0x48, 0x0f, 0x46, 0xd1], "cmovbe rdx,rcx"),
        (&[0x48, 0x85, 0xed], "test rbp,rbp"),
    ],
    &[
        (&[0x4c, 0x8d, 0x4c, 0x88, 0x40], "lea r9,[rax+rcx*4+0x40]"),
        (
            &[0x44, 0x0f, 0xb6, 0x56, 0x08],
            "movzx r10d,BYTE PTR [rsi+0x8]",
        ),
        (&[0x4c, 0x0f, 0xbf, 0x1e], "movsx r11,WORD PTR [rsi]"),
        (&[0x4c, 0x63, 0x66, 0x08], "movsxd r12,DWORD PTR [rsi+0x8]"),
        (&[0x66, 0x98], "cbw"),
        (&[0x98], "cwde"),
        (&[0x48, 0x98], "cdqe"),
        (&[0x66, 0x99], "cwd"),
        (&[0x99], "cdq"),
        (&[0x48, 0x87, 0x46, 0x10], "xchg QWORD PTR [rsi+0x10],rax"),
        (
            &[0x48, 0x0f, 0xc1, 0x56, 0x18],
            "xadd QWORD PTR [rsi+0x18],rdx",
        ),
        (
            &[0xf0, 0x48, 0x0f, 0xc1, 0x4e, 0x18],
            "lock xadd QWORD PTR [rsi+0x18],rcx",
        ),
        (
            &[0x48, 0xc7, 0xc0, 0x34, 0x12, 0x00, 0x00],
            "mov rax,0x1234",
        ),
        (
            &[0xf0, 0x48, 0x0f, 0xb1, 0x1e],
            "lock cmpxchg QWORD PTR [rsi],rbx",
        ),
        (&[0x48, 0x0f, 0xb1, 0x0e], "cmpxchg QWORD PTR [rsi],rcx"),
        (
            &[0xf0, 0x0f, 0xc7, 0x4e, 0x08],
            "lock cmpxchg8b QWORD PTR [rsi+0x8]",
        ),
        (&[0x53], "push rbx"),
        (&[0xff, 0x36], "push QWORD PTR [rsi]"),
        (&[0x59], "pop rcx"),
        (&[0x8f, 0x46, 0x28], "pop QWORD PTR [rsi+0x28]"),
        (&[0x55], "push rbp"),
        (&[0x48, 0x89, 0xe5], "mov rbp,rsp"),
        (&[0x48, 0x83, 0xec, 0x20], "sub rsp,0x20"),
        (&[0xc9], "leave"),
        (&[0xe8, 0x02, 0x00, 0x00, 0x00], "call 0x2a2"),
        (&[0xeb, 0x05], "jmp 0x2a7"),
        (&[0x48, 0x83, 0xc0, 0x01], "add rax,0x1"),
        (&[0xc3], "ret"),
        (&[0x49, 0xc7, 0xc5, 0x05, 0x00, 0x00, 0x00], "mov r13,0x5"),
        (&[0x4c, 0x01, 0xe8], "add rax,r13"),
        (&[0x49, 0xff, 0xcd], "dec r13"),
        (&[0x75, 0xf8], "jne 0x2ae"),
        (&[0xfc], "cld"),
        (&[0xa4], "movs BYTE PTR es:[rdi],BYTE PTR ds:[rsi]"),
        (&[0x48, 0xa5], "movs QWORD PTR es:[rdi],QWORD PTR ds:[rsi]"),
        (&[0xab], "stos DWORD PTR es:[rdi],eax"),
        (&[0x66, 0xad], "lods ax,WORD PTR ds:[rsi]"),
        (&[0xa6], "cmps BYTE PTR ds:[rsi],BYTE PTR es:[rdi]"),
        (&[0x48, 0xaf], "scas rax,QWORD PTR es:[rdi]"),
    ],
];

/// `pushfq; pop r15; mov qword ptr [rsp-8], 0; and r15d, 0x8d5; xor r14,
/// r15`.
const FOLD: &[Insn] = &[
    (&[0x9c], "pushf"),
    (&[0x41, 0x5f], "pop r15"),
    (
        &[0x48, 0xc7, 0x44, 0x24, 0xf8, 0x00, 0x00, 0x00, 0x00],
        "mov QWORD PTR [rsp-0x8],0x0",
    ),
    (
        &[0x41, 0x81, 0xe7, 0xd5, 0x08, 0x00, 0x00],
        "and r15d,0x8d5",
    ),
    (&[0x4d, 0x31, 0xfe], "xor r14,r15"),
];

/// Between two groups.
const ROTATE: Insn = (&[0x49, 0xc1, 0xc6, 0x07], "rol r14,0x7");

/// The end: the marker, then a halt.
const END: &[Insn] = &[
    (&[0xb0, 0x42], "mov al,0x42"),
    (&[0xe6, 0xf1], "out 0xf1,al"),
    (&[0xf4], "hlt"),
];

/// The whole block, in order.
fn block() -> Vec<Insn> {
    let mut block = Vec::new();
    for (i, group) in GROUPS.iter().enumerate() {
        block.extend_from_slice(group);
        block.extend_from_slice(FOLD);
        if i + 1 < GROUPS.len() {
            block.push(ROTATE);
        }
    }
    block.extend_from_slice(END);
    block
}

/// Where the block keeps its data (and the bytes compared), and the stack
/// bytes below the check's user stack compared.
const DATA: u64 = 0x10_0000;
const DATA_LEN: usize = 0x200;
const STACK_LEN: usize = 0x100;
/// The marker the block ends with (`mov al, 0x42; out 0xf1, al`).
const DONE: u8 = 0x42;
/// RFLAGS' arithmetic flags: CF, PF, AF, ZF, SF, OF.
const ARITH_FLAGS: u64 = 0x8d5;

/// What one run left: the general registers and RFLAGS' arithmetic flags,
/// XMM0-3, and the data and stack bytes.
struct Outcome {
    gprs: [u64; 16],
    flags: u64,
    xmm: [[u8; 16]; 4],
    memory: Vec<u8>,
}

fn outcome(vm: &CheckVm) -> Result<Outcome, HostCheckError> {
    let r = vm.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
    let fpu = vm.vcpu.get_fpu().map_err(kvm_err("GET_FPU"))?;
    let mut memory = vec![0u8; DATA_LEN + STACK_LEN];
    let (data, stack) = memory.split_at_mut(DATA_LEN);
    let read = |buf: &mut [u8], at: u64| {
        vm._mem
            .read_slice(buf, GuestAddress(at))
            .map_err(|e| HostCheckError::Memory(e.to_string()))
    };
    read(data, DATA)?;
    read(stack, USER_STACK - STACK_LEN as u64)?;
    Ok(Outcome {
        gprs: [
            r.rax, r.rcx, r.rdx, r.rbx, r.rsp, r.rbp, r.rsi, r.rdi, r.r8, r.r9, r.r10, r.r11,
            r.r12, r.r13, r.r14, r.r15,
        ],
        flags: r.rflags & ARITH_FLAGS,
        xmm: [fpu.xmm[0], fpu.xmm[1], fpu.xmm[2], fpu.xmm[3]],
        memory,
    })
}

/// A check guest whose user code is the block, with SSE enabled
/// (CR4.OSFXSR and OSXMMEXCPT).
fn block_vm(kvm: &Kvm, code: &[u8]) -> Result<CheckVm, HostCheckError> {
    let vm = CheckVm::new(kvm, &enter_user_code(), code, &marker_code(M_LSTAR), false)?;
    let mut sregs = vm.vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
    sregs.cr4 |= (1 << 9) | (1 << 10);
    vm.vcpu.set_sregs(&sregs).map_err(kvm_err("SET_SREGS"))?;
    Ok(vm)
}

/// The instruction of `block` at `offset`, for a report.
fn text_at(block: &[Insn], offset: u64) -> String {
    let mut at = 0u64;
    for (bytes, text) in block {
        if at == offset {
            return format!("`{text}` at +{offset:#x}");
        }
        at += bytes.len() as u64;
    }
    format!("+{offset:#x}")
}

/// Runs the block in user mode, then a step at a time in kernel mode, and
/// compares.
pub fn check_kernel_steps() -> Result<KernelStepReport, HostCheckError> {
    let block = block();
    let code: Vec<u8> = block
        .iter()
        .flat_map(|(bytes, _)| bytes.iter().copied())
        .collect();
    let kvm = open_kvm()?;
    let mut report = KernelStepReport::default();

    let mut native = block_vm(&kvm, &code)?;
    let ended = native.next_event()?;
    if ended
        != (CheckVmExit::Marker {
            marker: DONE,
            cpl: 3,
        })
    {
        report
            .differences
            .push(format!("in user mode the block ended with {ended:?}"));
        return Ok(report);
    }
    let user = outcome(&native)?;

    // The registers user mode started with, at CPL 0.
    let mut stepped = block_vm(&kvm, &code)?;
    let regs = kvm_bindings::kvm_regs {
        rip: USER_CODE,
        rsp: USER_STACK,
        rflags: 2,
        ..Default::default()
    };
    stepped.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))?;
    stepped.debug(KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_SINGLESTEP, None)?;
    let end = USER_CODE + code.len() as u64;
    let mut pc = USER_CODE;
    loop {
        match stepped.next_event()? {
            CheckVmExit::Debug { pc: next, .. } => {
                report.steps += 1;
                let offset = (pc - USER_CODE) as usize;
                let mut decoder = Decoder::with_ip(64, &code[offset..], pc, DecoderOptions::NONE);
                let insn = decoder.decode();
                if insn.flow_control() == FlowControl::Next && next != insn.next_ip() {
                    report.differences.push(format!(
                        "the step of {} stopped at {}",
                        text_at(&block, pc - USER_CODE),
                        text_at(&block, next.wrapping_sub(USER_CODE))
                    ));
                }
                if !(USER_CODE..end).contains(&next) || report.steps > 10 * block.len() as u64 {
                    report.differences.push(format!(
                        "in kernel mode the block went to {next:#x} after {}",
                        text_at(&block, pc - USER_CODE)
                    ));
                    return Ok(report);
                }
                pc = next;
            }
            CheckVmExit::Marker { marker: DONE, .. } => break,
            other => {
                report.differences.push(format!(
                    "in kernel mode the block ended with {other:?} at {}",
                    text_at(&block, pc - USER_CODE)
                ));
                return Ok(report);
            }
        }
    }
    let kernel = outcome(&stepped)?;

    const NAMES: [&str; 16] = [
        "RAX", "RCX", "RDX", "RBX", "RSP", "RBP", "RSI", "RDI", "R8", "R9", "R10", "R11", "R12",
        "R13", "R14", "R15",
    ];
    let d = &mut report.differences;
    for (i, name) in NAMES.iter().enumerate() {
        if user.gprs[i] != kernel.gprs[i] {
            d.push(format!(
                "{name}: {:#x} in user mode, {:#x} stepped in kernel mode",
                user.gprs[i], kernel.gprs[i]
            ));
        }
    }
    if user.flags != kernel.flags {
        d.push(format!(
            "arithmetic flags: {:#x} in user mode, {:#x} stepped in kernel mode",
            user.flags, kernel.flags
        ));
    }
    for i in 0..user.xmm.len() {
        if user.xmm[i] != kernel.xmm[i] {
            d.push(format!("XMM{i} differs"));
        }
    }
    if let Some(at) = (0..user.memory.len()).find(|&i| user.memory[i] != kernel.memory[i]) {
        let addr = if at < DATA_LEN {
            DATA + at as u64
        } else {
            USER_STACK - STACK_LEN as u64 + (at - DATA_LEN) as u64
        };
        d.push(format!("memory differs first at {addr:#x}"));
    }
    Ok(report)
}
