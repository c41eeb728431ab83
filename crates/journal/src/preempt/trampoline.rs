//! The trampoline that finds a recorded user-mode state at replay.
//!
//! The code at the target RIP is overwritten with a `jmp rel32` to this
//! stub. The stub compares the general registers, the arithmetic flags and
//! a few memory words the code there uses with the recorded ones,
//! natively and without touching the stack (the program's red zone lies
//! below RSP): a mismatch costs a few nanoseconds and goes on with the
//! displaced instructions. When everything matches it restores the
//! registers and flags and stores to the exit page, which is not guest
//! RAM: the store is an MMIO exit at which the VMM checks what the stub
//! cannot (segment bases, extended state, the written memory). If the VMM
//! resumes the stub instead of delivering, it goes on as on a mismatch.
//!
//! The recorded values are in the stub's data page (`data_page`), so the
//! code compares registers with memory. Flags are saved with LAHF/SETO and
//! restored with `add al, 0x7f; sahf` (OF from AL, the rest from AH), as
//! binary translators do, since PUSHF/POPF would write below RSP.

/// Data page layout: where the stub keeps RAX and the saved flags, the
/// recorded flags (as LAHF/SETO leave them in AX), the recorded general
/// registers in encoding order, and the recorded memory words.
const SAVE_RAX: u64 = 0;
const SAVE_FLAGS: u64 = 8;
const WANT_FLAGS: u64 = 16;
const WANT_GPRS: u64 = 24;
const WANT_WORDS: u64 = WANT_GPRS + 16 * 8;
/// The most memory words a stub compares.
pub const MAX_WORDS: usize = 8;
/// The most code a stub may take: its page, up to the probe gate's code.
const MAX_CODE: usize = introspect::probe_gate::CODE_START as usize;

/// The order the stub compares the general registers other than RAX in
/// (encoding numbers): the stack pointer first, which tells threads apart.
const COMPARED: [u8; 15] = [4, 3, 1, 2, 6, 7, 5, 8, 9, 10, 11, 12, 13, 14, 15];

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum StubError {
    #[error("the stub does not fit its page")]
    TooLarge,
    #[error("{what} is out of reach of a 32-bit displacement from the stub")]
    OutOfReach { what: &'static str },
    #[error("the displaced instructions cannot be moved to the stub: {0}")]
    Relocation(String),
}

/// Where a stub runs: the virtual addresses of its code page, its data
/// page and the exit page in the target's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StubPages {
    pub code: u64,
    pub data: u64,
    pub exit: u64,
}

/// A stub, and where in it the interesting instructions are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stub {
    /// Machine code for the start of the code page.
    pub code: Vec<u8>,
    /// Offset of the store to the exit page: RIP at the exit (the host
    /// may report the RIP after it instead, see `exit_end`).
    pub exit_at: u64,
    /// Offset just past that store.
    pub exit_end: u64,
    /// Offset of the displaced instructions.
    pub displaced_at: u64,
}

/// The flags as LAHF (AH: SF ZF AF PF CF, bit 1 set) and SETO (AL: OF)
/// leave them in AX.
fn lahf_seto(rflags: u64) -> u16 {
    let ah = (rflags & 0xd5) as u16 | 0x02;
    let al = ((rflags >> 11) & 1) as u16;
    (ah << 8) | al
}

/// The data page's recorded values, from its start: the registers `regs`
/// (RIP is not compared) and the memory words' values.
pub fn data_page(regs: &kvm_bindings::kvm_regs, words: &[u64]) -> Vec<u8> {
    let mut d = vec![0u8; (WANT_WORDS as usize) + 8 * words.len()];
    let put = |d: &mut Vec<u8>, at: u64, v: u64| {
        d[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes())
    };
    put(&mut d, WANT_FLAGS, u64::from(lahf_seto(regs.rflags)));
    let gprs = [
        regs.rax, regs.rcx, regs.rdx, regs.rbx, regs.rsp, regs.rbp, regs.rsi, regs.rdi, regs.r8,
        regs.r9, regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15,
    ];
    for (i, v) in gprs.iter().enumerate() {
        put(&mut d, WANT_GPRS + 8 * i as u64, *v);
    }
    for (i, v) in words.iter().enumerate() {
        put(&mut d, WANT_WORDS + 8 * i as u64, *v);
    }
    d
}

/// A small x86-64 emitter for exactly the instructions the stub uses.
struct Asm {
    base: u64,
    code: Vec<u8>,
}

impl Asm {
    fn ip(&self) -> u64 {
        self.base + self.code.len() as u64
    }

    /// Ends a stub: the displaced instructions (`displaced` builds them
    /// for where they land), a jump back to `resume`, and the size check.
    fn finish(
        mut self,
        displaced: impl FnOnce(u64) -> Result<Vec<u8>, StubError>,
        resume: u64,
        exit_at: u64,
        exit_end: u64,
        displaced_at: u64,
    ) -> Result<Stub, StubError> {
        let moved = displaced(self.ip())?;
        self.bytes(&moved);
        let back = self.rel32(5, resume, "the patched code")?;
        self.bytes(&[0xe9]);
        self.bytes(&back);
        if self.code.len() > MAX_CODE {
            return Err(StubError::TooLarge);
        }
        Ok(Stub {
            code: self.code,
            exit_at,
            exit_end,
            displaced_at,
        })
    }

    /// A rel32 from the end of an instruction of `len` bytes starting here.
    fn rel32(&self, len: u64, target: u64, what: &'static str) -> Result<[u8; 4], StubError> {
        let next = self.ip() + len;
        let rel = target.wrapping_sub(next) as i64;
        i32::try_from(rel)
            .map(i32::to_le_bytes)
            .map_err(|_| StubError::OutOfReach { what })
    }

    fn bytes(&mut self, b: &[u8]) {
        self.code.extend_from_slice(b);
    }

    /// `prefix disp32 [imm]`, where `prefix` ends with a ModRM byte that
    /// selects a RIP-relative memory operand.
    fn rip_rel(
        &mut self,
        prefix: &[u8],
        target: u64,
        imm: &[u8],
        what: &'static str,
    ) -> Result<(), StubError> {
        let len = (prefix.len() + 4 + imm.len()) as u64;
        let rel = self.rel32(len, target, what)?;
        self.bytes(prefix);
        self.bytes(&rel);
        self.bytes(imm);
        Ok(())
    }

    fn save_rax_and_flags(&mut self, data: u64) -> Result<(), StubError> {
        self.rip_rel(&[0x48, 0x89, 0x05], data + SAVE_RAX, &[], "the data page")?; // mov [rip+d], rax
        self.bytes(&[0x9f]); // lahf
        self.bytes(&[0x0f, 0x90, 0xc0]); // seto al
        self.rip_rel(&[0x66, 0x89, 0x05], data + SAVE_FLAGS, &[], "the data page")
        // mov [rip+d], ax
    }

    fn restore_flags_and_rax(&mut self, data: u64) -> Result<(), StubError> {
        self.rip_rel(&[0x66, 0x8b, 0x05], data + SAVE_FLAGS, &[], "the data page")?; // mov ax, [rip+d]
        self.bytes(&[0x04, 0x7f]); // add al, 0x7f: OF = saved OF
        self.bytes(&[0x9e]); // sahf
        self.rip_rel(&[0x48, 0x8b, 0x05], data + SAVE_RAX, &[], "the data page")
        // mov rax, [rip+d]
    }

    /// `cmp reg, [rip+d]` for general register `num`.
    fn cmp_reg_mem(&mut self, num: u8, at: u64) -> Result<(), StubError> {
        let rex = 0x48 | if num >= 8 { 0x04 } else { 0 }; // REX.W, REX.R
        let modrm = ((num & 7) << 3) | 0x05;
        self.rip_rel(&[rex, 0x3b, modrm], at, &[], "the data page")
    }

    /// `jne` to a label patched later; returns where its rel32 is.
    fn jne_forward(&mut self) -> usize {
        self.bytes(&[0x0f, 0x85, 0, 0, 0, 0]);
        self.code.len() - 4
    }

    fn patch_here(&mut self, at: usize) {
        let rel = (self.code.len() - (at + 4)) as i32;
        self.code[at..at + 4].copy_from_slice(&rel.to_le_bytes());
    }
}

/// Builds the stub for `pages`, comparing the registers and the memory
/// words at `words` (user addresses, each readable as 8 bytes within one
/// page) with the values `data_page` puts in the data page. `displaced`
/// produces the displaced instructions for the address it is given, and
/// `resume` is where execution continues after them (the first byte the
/// patch did not overwrite).
pub fn build(
    pages: StubPages,
    words: &[u64],
    displaced: impl FnOnce(u64) -> Result<Vec<u8>, StubError>,
    resume: u64,
) -> Result<Stub, StubError> {
    let (page, data) = (pages.code, pages.data);
    let mut a = Asm {
        base: page,
        code: Vec::with_capacity(512),
    };
    a.save_rax_and_flags(data)?;
    let mut mismatches = Vec::with_capacity(COMPARED.len() + 2 + words.len());
    for num in COMPARED {
        a.cmp_reg_mem(num, data + WANT_GPRS + 8 * u64::from(num))?;
        mismatches.push(a.jne_forward());
    }
    // AX holds the flags LAHF/SETO saw.
    a.rip_rel(&[0x66, 0x3b, 0x05], data + WANT_FLAGS, &[], "the data page")?; // cmp ax, [rip+d]
    mismatches.push(a.jne_forward());
    a.rip_rel(&[0x48, 0x8b, 0x05], data + SAVE_RAX, &[], "the data page")?; // mov rax, [rip+d]
    a.cmp_reg_mem(0, data + WANT_GPRS)?;
    mismatches.push(a.jne_forward());
    for (i, &addr) in words.iter().take(MAX_WORDS).enumerate() {
        a.bytes(&[0x48, 0xa1]); // mov rax, [moffs64]
        a.bytes(&addr.to_le_bytes());
        a.cmp_reg_mem(0, data + WANT_WORDS + 8 * i as u64)?;
        mismatches.push(a.jne_forward());
    }
    // Everything the stub can see matches: restore, and let the VMM look.
    a.restore_flags_and_rax(data)?;
    let exit_at = a.ip() - page;
    a.rip_rel(&[0xc6, 0x05], pages.exit, &[0x00], "the exit page")?; // mov byte [rip+d], 0
    let exit_end = a.ip() - page;
    let to_displaced = a.code.len();
    a.bytes(&[0xe9, 0, 0, 0, 0]); // jmp displaced
    for at in mismatches {
        a.patch_here(at);
    }
    a.restore_flags_and_rax(data)?;
    let rel = (a.code.len() - (to_displaced + 5)) as i32;
    a.code[to_displaced + 1..to_displaced + 5].copy_from_slice(&rel.to_le_bytes());
    let displaced_at = a.ip() - page;
    a.finish(displaced, resume, exit_at, exit_end, displaced_at)
}

/// A stub that exits at once, for the recorder: it stops a task when it
/// reaches the patched position, whatever its state. Resumed after the
/// exit, it runs the displaced instructions and goes back.
pub fn build_trap(
    pages: StubPages,
    displaced: impl FnOnce(u64) -> Result<Vec<u8>, StubError>,
    resume: u64,
) -> Result<Stub, StubError> {
    let mut a = Asm {
        base: pages.code,
        code: Vec::with_capacity(64),
    };
    let exit_at = 0;
    a.rip_rel(&[0xc6, 0x05], pages.exit, &[0x00], "the exit page")?; // mov byte [rip+d], 0
    let exit_end = a.ip() - pages.code;
    a.finish(displaced, resume, exit_at, exit_end, exit_end)
}

/// The `jmp rel32` that sends the patched instruction at `at` to the stub
/// at `page`, padded with `int3` to `len` bytes (an unexpected jump into
/// the middle of the patch then traps instead of running garbage).
pub fn patch(at: u64, page: u64, len: usize) -> Result<Vec<u8>, StubError> {
    let rel = page.wrapping_sub(at + 5) as i64;
    let rel = i32::try_from(rel).map_err(|_| StubError::OutOfReach { what: "the stub" })?;
    let mut code = vec![0xe9];
    code.extend(rel.to_le_bytes());
    code.resize(len.max(5), 0xcc);
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGES: StubPages = StubPages {
        code: 0x7000_0000,
        data: 0x7000_1000,
        exit: 0x7000_2000,
    };

    #[test]
    fn flags_are_kept_the_way_lahf_and_seto_see_them() {
        // CF ZF, and OF.
        assert_eq!(lahf_seto(0x41 | 0x800 | 0x200), 0x4301);
        // Bits outside SF ZF AF PF CF OF never count.
        assert_eq!(lahf_seto(0x2 | 0x400 | 0x100 | 0x28), 0x0200);
    }

    #[test]
    fn the_data_page_holds_what_the_stub_compares() {
        let regs = kvm_bindings::kvm_regs {
            rax: 1,
            rsp: 5,
            r15: 16,
            rflags: 0x246,
            ..Default::default()
        };
        let d = data_page(&regs, &[0xaa, 0xbb]);
        let word =
            |at: u64| u64::from_le_bytes(d[at as usize..at as usize + 8].try_into().unwrap());
        assert_eq!(word(WANT_GPRS), 1);
        assert_eq!(word(WANT_GPRS + 4 * 8), 5);
        assert_eq!(word(WANT_GPRS + 15 * 8), 16);
        assert_eq!(word(WANT_FLAGS), u64::from(lahf_seto(0x246)));
        assert_eq!((word(WANT_WORDS), word(WANT_WORDS + 8)), (0xaa, 0xbb));
    }

    #[test]
    fn a_stub_reaches_its_pages_and_returns_after_the_patch() {
        let stub = build(PAGES, &[0x6000_0000], |_| Ok(vec![0x90]), 0x7000_5005).unwrap();
        let code = &stub.code;
        // The store to the exit page: C6 05 disp32 00, aimed at the exit.
        let at = stub.exit_at as usize;
        assert_eq!(&code[at..at + 2], &[0xc6, 0x05]);
        let disp = i32::from_le_bytes(code[at + 2..at + 6].try_into().unwrap());
        assert_eq!(PAGES.code + stub.exit_end + disp as u64, PAGES.exit);
        // The displaced instruction, then the jump back.
        let d = stub.displaced_at as usize;
        assert_eq!(code[d], 0x90);
        assert_eq!(code[d + 1], 0xe9);
        let back = i32::from_le_bytes(code[d + 2..d + 6].try_into().unwrap());
        assert_eq!(PAGES.code + d as u64 + 6 + back as i64 as u64, 0x7000_5005);
        // The memory word is read from its absolute address.
        let moffs = code
            .windows(10)
            .any(|w| w[..2] == [0x48, 0xa1] && w[2..] == 0x6000_0000u64.to_le_bytes());
        assert!(moffs);
    }

    #[test]
    fn what_a_jump_cannot_reach_is_refused() {
        let far = StubPages {
            exit: 0x7fff_0000_0000,
            ..PAGES
        };
        assert_eq!(
            build(far, &[], |_| Ok(vec![]), PAGES.code).unwrap_err(),
            StubError::OutOfReach {
                what: "the exit page"
            }
        );
        assert!(patch(0x40_0000, 0x7fff_0000_0000, 5).is_err());
        let p = patch(0x40_0000, 0x3f_d000, 7).unwrap();
        assert_eq!(p.len(), 7);
        assert_eq!(&p[5..], &[0xcc, 0xcc]);
    }
}
