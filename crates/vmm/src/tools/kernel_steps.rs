//! Steps of user code made in guest kernel mode, where KVM single-steps.
//!
//! This host's KVM runs guest kernel code in its instruction emulator and
//! single-steps it there for a KVM_RUN each (~9 µs), while a step in user
//! mode is a debug exception the guest kernel receives and a breakpoint
//! exit on its handler (~50-106 µs). So at a traced step's stop, where the
//! vCPU is in the guest's #DB handler with the user's registers, the
//! tracer runs the instructions that follow there: the vCPU keeps the
//! handler's code and stack segments and takes the user's RIP, RSP and
//! RFLAGS, and KVM executes one instruction per KVM_RUN, on the user's
//! page tables. The guest kernel never runs. The debugger's single steps
//! are made the same way, with the kernel's segments STAR names.
//!
//! An instruction runs so only where it does exactly what it would in user
//! mode: [`admits`] takes instructions the emulator executes as the CPU
//! does (integer, branch, stack and SSE moves; measured on these hosts,
//! `crates/vmm/tests/host_probes.rs`) and whose every access goes to
//! present, user-accessible (and, for writes, writable) RAM, so none
//! faults. One that raises an exception all the same (a division by zero,
//! a misaligned SSE move) is taken back: its registers, the bytes the
//! exception's frame overwrote below the stack pointer and CR2 are
//! restored, and it runs in user mode like the others.

use kvm_bindings::{kvm_regs, kvm_sregs};
use kvm_ioctls::VcpuExit;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use iced_x86::{Instruction, InstructionInfoFactory, Mnemonic, OpKind};
use introspect::guest_events::KERNEL_START;
use introspect::instructions::{self, UserRegs, TF};
use introspect::{gva, probe_gate};

use crate::vm::{kvm_err, Machine, VmError};

/// RFLAGS bits a step in kernel mode must not have: the trap flag (the
/// guest's own #DB would follow) and interrupts (none may arrive on the
/// user's stack). The user's are put back after it.
const IF: u64 = 1 << 9;
const RF: u64 = 1 << 16;
const KEPT: u64 = TF | IF | RF;
/// Where canonical user addresses end (4-level paging).
const USER_END: u64 = 1 << 47;
/// CR4.SMEP: kernel mode may not execute user pages while it is set.
const CR4_SMEP: u64 = 1 << 20;
/// How far below the stack pointer an exception's frame reaches (SS, RSP,
/// RFLAGS, CS, RIP, an error code, 16-byte alignment), with a margin.
const FRAME_REACH: u64 = 128;

/// How a step of a user instruction is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// By the VMM: it only moves RIP past itself ([`without_effect`]).
    Skip,
    /// In guest kernel mode ([`admits`] it): [`step`].
    InKernelMode,
    /// By the trap flag in user mode.
    Trap,
}

/// How to step `insn`, about to run with user registers `user` and system
/// registers `sregs` (their address space and FS and GS bases).
pub(crate) fn plan(
    mem: &GuestMemoryMmap,
    sregs: &kvm_sregs,
    factory: &mut InstructionInfoFactory,
    insn: &Instruction,
    user: &kvm_regs,
) -> Plan {
    if without_effect(insn) {
        return Plan::Skip;
    }
    let mut at = UserRegs::from_kvm(user);
    (at.fs_base, at.gs_base) = (sregs.fs.base, sregs.gs.base);
    if admits(mem, sregs.cr3, factory, insn, &at) {
        Plan::InKernelMode
    } else {
        Plan::Trap
    }
}

/// Whether the instruction `insn`, at user registers `regs` in the address
/// space `cr3`, runs in kernel mode exactly as in user mode.
fn admits(
    mem: &GuestMemoryMmap,
    cr3: u64,
    factory: &mut InstructionInfoFactory,
    insn: &Instruction,
    regs: &UserRegs,
) -> bool {
    emulated_as_executed(insn)
        && user_ram(mem, cr3, insn.ip(), insn.len() as u64, false)
        && instructions::all_accesses(factory, insn, regs).is_some_and(|accesses| {
            accesses.iter().all(|a| {
                let write = a.kind != instructions::MemAccess::Load;
                user_ram(mem, cr3, a.addr, u64::from(a.size), write)
            })
        })
}

/// Whether `len` bytes at `va` are in present, user-accessible pages of
/// guest RAM (writable ones for a write): no access there faults or exits.
fn user_ram(mem: &GuestMemoryMmap, cr3: u64, va: u64, len: u64, write: bool) -> bool {
    let Some(end) = va.checked_add(len) else {
        return false;
    };
    if len == 0 || end > USER_END {
        return false;
    }
    let mut page = va & !(gva::PAGE_SIZE - 1);
    while page < end {
        match gva::translate_user_access(mem, cr3, page, write) {
            Ok(gpa) if mem.address_in_range(GuestAddress(gpa)) => {}
            _ => return false,
        }
        page += gva::PAGE_SIZE;
    }
    true
}

/// Whether KVM's emulator executes `insn` as the CPU does in user mode.
/// Measured on these hosts: the SSE arithmetic, scalar moves (`movss`,
/// `movsd`, `movq`, `movd`), x87, AVX, BMI and POPCNT are not emulated at
/// all (an internal error each, ~1.7 ms); TZCNT and LZCNT run as BSF and
/// BSR (their REP prefix ignored). CPUID, RDTSC and XGETBV would answer
/// differently in kernel mode; string instructions with REP run their
/// rounds in one step; privileged, segment, flag-register and far-control
/// instructions behave otherwise at CPL 0.
fn emulated_as_executed(insn: &Instruction) -> bool {
    use Mnemonic::*;
    if insn.encoding() != iced_x86::EncodingKind::Legacy
        || insn.has_rep_prefix()
        || insn.has_repne_prefix()
        || insn.is_call_far()
        || insn.is_call_far_indirect()
        || insn.is_jmp_far()
        || insn.is_jmp_far_indirect()
    {
        return false;
    }
    let registers_plain = (0..insn.op_count()).all(|i| {
        insn.op_kind(i) != OpKind::Register || {
            let r = insn.op_register(i);
            r.is_gpr() || r.is_xmm()
        }
    });
    if !registers_plain {
        return false;
    }
    let string = insn.is_string_instruction();
    match insn.mnemonic() {
        Mov | Movzx | Movsx | Movsxd | Lea | Push | Pop | Call | Ret | Jmp | Leave => true,
        Ja | Jae | Jb | Jbe | Je | Jne | Jg | Jge | Jl | Jle | Jo | Jno | Jp | Jnp | Js | Jns => {
            true
        }
        Seta | Setae | Setb | Setbe | Sete | Setne | Setg | Setge | Setl | Setle | Seto | Setno
        | Setp | Setnp | Sets | Setns => true,
        Cmova | Cmovae | Cmovb | Cmovbe | Cmove | Cmovne | Cmovg | Cmovge | Cmovl | Cmovle
        | Cmovo | Cmovno | Cmovp | Cmovnp | Cmovs | Cmovns => true,
        Add | Or | Adc | Sbb | And | Sub | Xor | Cmp | Test | Inc | Dec | Neg | Not | Mul
        | Imul | Div | Idiv | Shl | Shr | Sar | Rol | Ror | Rcl | Rcr | Shld | Shrd | Bt | Bts
        | Btr | Btc | Bsf | Bsr | Xchg | Xadd | Cmpxchg | Cmpxchg8b | Cbw | Cwde | Cdqe | Cwd
        | Cdq | Cqo | Bswap => true,
        // The SSE moves the emulator has (aligned and unaligned, packed;
        // MMX forms are refused above by their registers).
        Movdqu | Movdqa | Movaps | Movups | Movapd | Movupd | Movntdq | Movntps | Movntpd => true,
        // Once each, without REP (`Movsd` and `Cmpsd` are also SSE names).
        Movsb | Movsw | Movsd | Movsq | Stosb | Stosw | Stosd | Stosq | Lodsb | Lodsw | Lodsd
        | Lodsq | Cmpsb | Cmpsw | Cmpsd | Cmpsq | Scasb | Scasw | Scasd | Scasq => string,
        _ => false,
    }
}

/// Whether `insn` does nothing in user mode but move RIP past itself (a
/// NOP, ENDBR64 without CET, a hint, a fence on the one vCPU, a
/// prefetch): the VMM makes its step itself. KVM's emulator does not stop
/// after ENDBR64 and the fences (measured: the step runs on through the
/// next instruction, or several).
fn without_effect(insn: &Instruction) -> bool {
    use Mnemonic::*;
    insn.encoding() == iced_x86::EncodingKind::Legacy
        && !insn.has_rep_prefix()
        && !insn.has_repne_prefix()
        && matches!(
            insn.mnemonic(),
            Nop | Endbr64
                | Pause
                | Lfence
                | Sfence
                | Mfence
                | Prefetcht0
                | Prefetcht1
                | Prefetcht2
                | Prefetchnta
        )
}

/// How a step in kernel mode went.
pub(crate) enum Stepped {
    /// The instruction ran: the user registers after it.
    Ran(kvm_regs),
    /// It raised an exception, taken back: it is to run in user mode.
    Raised,
    /// KVM could not emulate it after all (nothing changed).
    NotEmulated,
}

/// Runs the user instruction at `user` (admitted, logged) in kernel mode
/// with the system registers of the stop `stop` (`first`: the first of
/// the stop, which loads them). Unless it ran, the vCPU is left as at the
/// stop, with `user`. A step into the trampoline pages `stubs` (the probe
/// gate, a search's trampoline) is taken back too: there the user-mode
/// step knows what to do.
pub(crate) fn step(
    m: &mut Machine,
    user: &kvm_regs,
    stop: &kvm_sregs,
    first: bool,
    stubs: &[u64],
) -> Result<Stepped, VmError> {
    let mut regs = *user;
    regs.rflags &= !KEPT;
    let below = user.rsp.wrapping_sub(FRAME_REACH);
    let mut stack = [0u8; FRAME_REACH as usize];
    let saved = peek_pages(&m.vm.mem, stop.cr3, below, &mut stack);
    if first {
        let mut sregs = *stop;
        sregs.cr4 &= !CR4_SMEP;
        m.vcpu.set_registers_in_run(regs, sregs);
    } else {
        m.vcpu.set_regs(&regs)?;
    }
    loop {
        match m.vcpu.run() {
            Ok(VcpuExit::Debug(_)) => break,
            Ok(VcpuExit::InternalError) => {
                m.vcpu.set_registers_in_run(*user, *stop);
                return Ok(Stepped::NotEmulated);
            }
            Ok(other) => {
                return Err(VmError::Expansion(format!(
                    "a user instruction at {:#x} stepped in kernel mode made an exit ({other:?})",
                    user.rip
                )))
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
            Err(e) => return Err(kvm_err("RUN (a step in kernel mode)")(e)),
        }
    }
    let after = m.vcpu.fd.sync_regs();
    let raised = after.regs.rip >= KERNEL_START || after.sregs.cs.selector != stop.cs.selector;
    if raised || probe_gate::in_stub_pages(after.regs.rip, stubs) {
        // An exception, delivered on the user's stack, or a jump or call
        // into the trampoline pages: taken back.
        for (start, bytes) in saved {
            let at = below + start as u64;
            gva::write_virt(&m.vm.mem, stop.cr3, at, &stack[start..start + bytes]).map_err(
                |e| VmError::Expansion(format!("cannot restore the stack at {at:#x}: {e}")),
            )?;
        }
        m.vcpu.set_registers_in_run(*user, *stop);
        return Ok(Stepped::Raised);
    }
    let mut regs = after.regs;
    regs.rflags = (regs.rflags & !KEPT) | (user.rflags & KEPT);
    Ok(Stepped::Ran(regs))
}

/// Reads what it can of `buf.len()` bytes at `va`, page by page: the
/// pieces read, as (offset, length).
fn peek_pages(mem: &GuestMemoryMmap, cr3: u64, va: u64, buf: &mut [u8]) -> Vec<(usize, usize)> {
    let mut pieces = Vec::new();
    let mut off = 0;
    while off < buf.len() {
        let at = va.wrapping_add(off as u64);
        let n = ((gva::PAGE_SIZE - (at & (gva::PAGE_SIZE - 1))) as usize).min(buf.len() - off);
        if gva::peek_virt(mem, cr3, at, &mut buf[off..off + n]).is_ok() {
            pieces.push((off, n));
        }
        off += n;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::test_memory;

    const CODE_AT: u64 = 0x40_0000;

    fn decoded(bytes: &[u8]) -> Instruction {
        instructions::decode(bytes, CODE_AT).expect("an instruction")
    }

    #[test]
    fn only_instructions_the_emulator_runs_as_the_cpu_are_admitted() {
        let emulated: &[&[u8]] = &[
            &[0x48, 0x01, 0xc8],                            // add rax, rcx
            &[0x48, 0x8b, 0x06],                            // mov rax, [rsi]
            &[0xf3, 0x0f, 0x6f, 0x06],                      // movdqu xmm0, [rsi]
            &[0xf0, 0x48, 0x0f, 0xb1, 0x0e],                // lock cmpxchg [rsi], rcx
            &[0xff, 0x10],                                  // call [rax]
            &[0xa4],                                        // movsb
            &[0x64, 0x48, 0x8b, 0x04, 0x25, 0x28, 0, 0, 0], // mov rax, fs:[0x28]
        ];
        for bytes in emulated {
            assert!(emulated_as_executed(&decoded(bytes)), "{bytes:x?}");
        }
        let refused: &[&[u8]] = &[
            &[0xf3, 0x48, 0x0f, 0xbc, 0xc1], // tzcnt rax, rcx (runs as bsf)
            &[0x66, 0x0f, 0xef, 0xc0],       // pxor xmm0, xmm0
            &[0xf2, 0x0f, 0x10, 0x06],       // movsd xmm0, [rsi]
            &[0xf3, 0xa4],                   // rep movsb
            &[0x0f, 0x05],                   // syscall
            &[0x0f, 0xa2],                   // cpuid
            &[0x0f, 0x31],                   // rdtsc
            &[0x9c],                         // pushfq
            &[0x8e, 0xd8],                   // mov ds, eax
            &[0xc5, 0xfe, 0x6f, 0x06],       // vmovdqu ymm0, [rsi]
            &[0x0f, 0x6f, 0x06],             // movq mm0, [rsi]
            &[0xd9, 0x06],                   // fld dword [rsi]
            &[0xff, 0x1e],                   // call far [rsi]
        ];
        for bytes in refused {
            assert!(!emulated_as_executed(&decoded(bytes)), "{bytes:x?}");
        }
        for bytes in [
            &[0xf3, 0x0f, 0x1e, 0xfa][..], // endbr64
            &[0x0f, 0x1f, 0x00],           // nop dword [rax]
            &[0x0f, 0xae, 0xe8],           // lfence
        ] {
            let insn = decoded(bytes);
            assert!(without_effect(&insn) && !emulated_as_executed(&insn));
        }
    }

    #[test]
    fn an_access_to_an_unmapped_or_read_only_page_is_not_admitted() {
        // The 2 MiB user page at 0x40_0000 (writable), nothing above it.
        let code = [0x48, 0x89, 0x06]; // mov [rsi], rax
        let mem = test_memory::user_code(&code);
        let insn = decoded(&code);
        let mut factory = InstructionInfoFactory::new();
        let at = |rsi: u64| {
            let mut regs = UserRegs {
                rip: CODE_AT,
                ..Default::default()
            };
            regs.gprs[6] = rsi;
            regs
        };
        assert!(admits(
            &mem,
            0x1000,
            &mut factory,
            &insn,
            &at(CODE_AT + 0x1000)
        ));
        // Straddling the page's end, and beyond it.
        assert!(!admits(
            &mem,
            0x1000,
            &mut factory,
            &insn,
            &at(CODE_AT + (2 << 20) - 4)
        ));
        assert!(!admits(&mem, 0x1000, &mut factory, &insn, &at(0x60_0000)));
        // Kernel addresses are never a user access.
        assert!(!admits(
            &mem,
            0x1000,
            &mut factory,
            &insn,
            &at(KERNEL_START + 0x40_0000)
        ));
        // Read-only: a load is admitted, a store is not.
        use vm_memory::Bytes;
        mem.write_obj(0x20_0000u64 | 0x85, GuestAddress(0x3000 + 2 * 8))
            .unwrap();
        assert!(!admits(
            &mem,
            0x1000,
            &mut factory,
            &insn,
            &at(CODE_AT + 0x1000)
        ));
        let load = [0x48, 0x8b, 0x06]; // mov rax, [rsi]
        assert!(admits(
            &mem,
            0x1000,
            &mut factory,
            &decoded(&load),
            &at(CODE_AT + 0x1000)
        ));
    }
}
