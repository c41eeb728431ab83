//! XSAVE and XRSTOR for a guest kernel whose host cannot emulate them.
//!
//! On hosts that interpret guest ring 0, KVM's emulator rejects the XSAVE
//! family, yet guest user code runs natively with the host's XCR0 (AVX and
//! AVX-512 enabled whatever the guest sets). A guest kernel limited to
//! FXSAVE then loses user vector state at every context switch. So the
//! guest kernel uses XSAVE as on hardware, and the VMM completes each
//! XSAVE/XRSTOR from ring 0: the vCPU's extended state comes from
//! `KVM_GET_XSAVE` / goes to `KVM_SET_XSAVE`, whose buffer has the standard
//! (non-compacted) layout the guest uses too. Only the standard form is
//! supported; the guest's CPUID offers neither XSAVEC nor XSAVES.
//!
//! This module is pure: it decodes the instruction and merges state
//! images; `vm/emulate.rs` moves the bytes.

/// Size of the legacy (FXSAVE) region plus the XSAVE header.
pub const LEGACY_AND_HEADER: usize = 576;
/// `KVM_GET_XSAVE` buffer size.
pub const KVM_XSAVE_SIZE: usize = 4096;

const HEADER: usize = 512;
const MXCSR: std::ops::Range<usize> = 24..28;
const MXCSR_MASK: std::ops::Range<usize> = 28..32;
/// x87 state in the legacy region: FCW..FDP and ST0-7 (MXCSR excluded).
const X87: [std::ops::Range<usize>; 2] = [0..24, 32..160];
const XMM: std::ops::Range<usize> = 160..416;

/// Which instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XOp {
    /// XSAVE or XSAVEOPT (the latter may skip unmodified state; saving
    /// everything is a correct implementation).
    Save,
    Restore,
}

/// A decoded XSAVE-family instruction with a memory operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XInsn {
    pub op: XOp,
    pub mem: MemOperand,
    /// Instruction length in bytes.
    pub len: u64,
}

/// A 64-bit ModRM memory operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemOperand {
    /// General register numbers (0 = RAX ... 15 = R15).
    pub base: Option<u8>,
    pub index: Option<(u8, u8)>, // (register, scale)
    pub disp: i64,
    pub rip_relative: bool,
}

impl MemOperand {
    /// The effective address, given the general registers in encoding
    /// order and the address of the next instruction.
    pub fn address(&self, gprs: &[u64; 16], next_rip: u64) -> u64 {
        let mut a = if self.rip_relative { next_rip } else { 0 };
        if let Some(b) = self.base {
            a = a.wrapping_add(gprs[usize::from(b)]);
        }
        if let Some((i, scale)) = self.index {
            a = a.wrapping_add(gprs[usize::from(i)].wrapping_mul(u64::from(scale)));
        }
        a.wrapping_add(self.disp as u64)
    }
}

/// Decodes `[REX] 0F AE /4 (XSAVE), /5 (XRSTOR), /6 (XSAVEOPT)` with a
/// memory operand. Anything else (other prefixes included) is `None`.
pub fn decode(bytes: &[u8]) -> Option<XInsn> {
    let mut i = 0;
    let mut rex = 0u8;
    if let Some(&b) = bytes.first() {
        if (0x40..=0x4f).contains(&b) {
            rex = b;
            i = 1;
        }
    }
    if bytes.get(i..i + 2)? != [0x0f, 0xae] {
        return None;
    }
    i += 2;
    let modrm = *bytes.get(i)?;
    i += 1;
    let (md, reg, rm) = (modrm >> 6, (modrm >> 3) & 7, modrm & 7);
    let op = match reg {
        4 | 6 => XOp::Save,
        5 => XOp::Restore,
        _ => return None,
    };
    if md == 3 {
        return None;
    }
    let rex_b = (rex & 1) << 3;
    let rex_x = (rex & 2) << 2;
    let mut mem = MemOperand {
        base: None,
        index: None,
        disp: 0,
        rip_relative: false,
    };
    let mut disp_len = match md {
        1 => 1,
        2 => 4,
        _ => 0,
    };
    if rm == 4 {
        let sib = *bytes.get(i)?;
        i += 1;
        let (scale, index, base) = (1u8 << (sib >> 6), ((sib >> 3) & 7) | rex_x, sib & 7);
        if index != 4 {
            mem.index = Some((index, scale));
        }
        if base == 5 && md == 0 {
            disp_len = 4;
        } else {
            mem.base = Some(base | rex_b);
        }
    } else if rm == 5 && md == 0 {
        mem.rip_relative = true;
        disp_len = 4;
    } else {
        mem.base = Some(rm | rex_b);
    }
    mem.disp = match disp_len {
        1 => i64::from(*bytes.get(i)? as i8),
        4 => i64::from(i32::from_le_bytes(bytes.get(i..i + 4)?.try_into().ok()?)),
        _ => 0,
    };
    i += disp_len;
    Some(XInsn {
        op,
        mem,
        len: i as u64,
    })
}

/// Offset and size of each extended state component (index >= 2), from
/// CPUID leaf 0xD.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XsaveLayout {
    components: Vec<(u8, usize, usize)>,
}

impl XsaveLayout {
    /// From CPUID 0xD sub-leaves: (index, EAX = size, EBX = offset).
    pub fn from_cpuid(leaves: impl IntoIterator<Item = (u32, u32, u32)>) -> Self {
        let mut components: Vec<_> = leaves
            .into_iter()
            .filter(|&(i, size, offset)| (2..63).contains(&i) && size > 0 && offset > 0)
            .map(|(i, size, offset)| (i as u8, offset as usize, size as usize))
            .collect();
        components.sort();
        XsaveLayout { components }
    }

    fn component(&self, i: u8) -> Option<(usize, usize)> {
        self.components
            .iter()
            .find(|c| c.0 == i)
            .map(|&(_, off, size)| (off, size))
    }

    /// Bytes an XSAVE/XRSTOR with this requested-feature bitmap touches,
    /// from the start of the area. `None` if a requested component is
    /// unknown or does not fit in KVM's buffer.
    pub fn area_size(&self, rfbm: u64) -> Option<usize> {
        let mut end = LEGACY_AND_HEADER;
        for i in 2..63u8 {
            if rfbm & (1 << i) != 0 {
                let (off, size) = self.component(i)?;
                end = end.max(off + size);
            }
        }
        (end <= KVM_XSAVE_SIZE).then_some(end)
    }
}

/// The vCPU's extended state as the program sees it, from a
/// `KVM_GET_XSAVE` image `cpu`, in a form that does not depend on how the
/// hardware tracked which components were in use: a component XSTATE_BV
/// marks as not in use reads as its initial value. Calls `each` with the
/// parts in a fixed order.
pub fn visible_state(cpu: &[u8], layout: &XsaveLayout, mut each: impl FnMut(&[u8])) {
    let bv = header_bv(cpu, HEADER);
    // x87: FCW 0x37f and everything else 0 when not in use.
    let mut x87_init = [0u8; 160];
    x87_init[0] = 0x7f;
    x87_init[1] = 0x03;
    for r in X87 {
        if bv & 1 != 0 {
            each(&cpu[r]);
        } else {
            each(&x87_init[r]);
        }
    }
    each(&cpu[MXCSR]);
    if bv & 0b10 != 0 {
        each(&cpu[XMM]);
    } else {
        each(&[0u8; 256]);
    }
    let zeros = [0u8; 1024];
    for &(i, off, size) in &layout.components {
        if off + size > cpu.len() {
            continue;
        }
        if bv & (1 << i) != 0 {
            each(&cpu[off..off + size]);
        } else {
            for chunk in (0..size).step_by(zeros.len()) {
                each(&zeros[..zeros.len().min(size - chunk)]);
            }
        }
    }
}

/// Why the instruction faults (#GP(0) on hardware).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XstateFault {
    Misaligned,
    /// Compacted form, reserved header bits or XSTATE_BV outside XCR0.
    BadHeader,
    /// MXCSR with reserved bits set.
    BadMxcsr,
}

/// XSTATE_BV of a save area (0 if the area is too short).
pub fn header_xstate_bv(area: &[u8]) -> u64 {
    header_bv(area, HEADER)
}

fn header_bv(area: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(area[at..at + 8].try_into().unwrap_or([0; 8]))
}

/// Checks what the hardware checks before touching memory.
pub fn check_alignment(addr: u64) -> Result<(), XstateFault> {
    if addr.is_multiple_of(64) {
        Ok(())
    } else {
        Err(XstateFault::Misaligned)
    }
}

/// The x87 part of the legacy region in its initial state: FCW 0x37f,
/// everything else 0.
fn x87_init() -> [u8; 160] {
    let mut init = [0u8; 160];
    init[0] = 0x7f;
    init[1] = 0x03;
    init
}

/// XSAVE: writes the requested components of the vCPU state `cpu` (a
/// `KVM_GET_XSAVE` image) into `area` (the guest's save area, read from
/// guest memory, `layout.area_size(rfbm)` bytes).
///
/// What is written depends on the state alone, not on how the hardware
/// tracked which components were in use (its XINUSE bits, which the
/// host's own saves and restores of the vCPU's state can change between
/// two runs): a component is saved as in use exactly when its value is not
/// the initial one, and one that is not in use is written with its initial
/// value. Hardware may do either; doing it the same way every time keeps
/// a replay's memory identical to the recording's.
pub fn save(cpu: &[u8], area: &mut [u8], rfbm: u64, layout: &XsaveLayout) {
    let cpu_bv = header_bv(cpu, HEADER);
    let mut bv = 0u64;
    let x87_init = x87_init();
    if rfbm & 1 != 0 {
        let in_use = cpu_bv & 1 != 0 && X87.iter().any(|r| cpu[r.clone()] != x87_init[r.clone()]);
        for r in X87 {
            let from = if in_use {
                &cpu[r.clone()]
            } else {
                &x87_init[r.clone()]
            };
            area[r].copy_from_slice(from);
        }
        bv |= u64::from(in_use);
    }
    if rfbm & 0b110 != 0 {
        area[MXCSR].copy_from_slice(&cpu[MXCSR]);
        area[MXCSR_MASK].copy_from_slice(&cpu[MXCSR_MASK]);
    }
    if rfbm & 0b10 != 0 {
        let in_use = cpu_bv & 0b10 != 0 && cpu[XMM].iter().any(|&b| b != 0);
        if in_use {
            area[XMM].copy_from_slice(&cpu[XMM]);
            bv |= 0b10;
        } else {
            area[XMM].fill(0);
        }
    }
    for i in 2..63u8 {
        if rfbm & (1 << i) == 0 {
            continue;
        }
        if let Some((off, size)) = layout.component(i) {
            let value = &cpu[off..off + size];
            if cpu_bv & (1 << i) != 0 && value.iter().any(|&b| b != 0) {
                area[off..off + size].copy_from_slice(value);
                bv |= 1 << i;
            } else {
                area[off..off + size].fill(0);
            }
        }
    }
    let guest_bv = header_bv(area, HEADER);
    let bv = (guest_bv & !rfbm) | (bv & rfbm);
    area[HEADER..HEADER + 8].copy_from_slice(&bv.to_le_bytes());
}

/// XRSTOR: loads the requested components from the guest's `area` into
/// the vCPU state image `cpu`; components the area marks as not in use
/// get their initial values. `xcr0` bounds XSTATE_BV.
pub fn restore(
    cpu: &mut [u8],
    area: &[u8],
    rfbm: u64,
    xcr0: u64,
    layout: &XsaveLayout,
) -> Result<(), XstateFault> {
    let bv = header_bv(area, HEADER);
    let comp_bv = header_bv(area, HEADER + 8);
    let reserved_zero = area[HEADER + 16..LEGACY_AND_HEADER].iter().all(|&b| b == 0);
    if comp_bv != 0 || bv & !xcr0 != 0 || !reserved_zero {
        return Err(XstateFault::BadHeader);
    }
    if rfbm & 0b110 != 0 {
        let mask = u32::from_le_bytes(cpu[MXCSR_MASK].try_into().unwrap_or([0; 4]));
        let mask = if mask == 0 { 0xffbf } else { mask };
        let mxcsr = u32::from_le_bytes(area[MXCSR].try_into().unwrap_or([0; 4]));
        if mxcsr & !mask != 0 {
            return Err(XstateFault::BadMxcsr);
        }
        cpu[MXCSR].copy_from_slice(&area[MXCSR]);
    }
    if rfbm & 1 != 0 {
        if bv & 1 != 0 {
            for r in X87 {
                cpu[r.clone()].copy_from_slice(&area[r]);
            }
        } else {
            for r in X87 {
                cpu[r].fill(0);
            }
            cpu[0..2].copy_from_slice(&0x037fu16.to_le_bytes()); // FCW
        }
    }
    if rfbm & 0b10 != 0 {
        if bv & 0b10 != 0 {
            cpu[XMM].copy_from_slice(&area[XMM]);
        } else {
            cpu[XMM].fill(0);
        }
    }
    for i in 2..63u8 {
        if rfbm & (1 << i) == 0 {
            continue;
        }
        if let Some((off, size)) = layout.component(i) {
            if bv & (1 << i) != 0 {
                cpu[off..off + size].copy_from_slice(&area[off..off + size]);
            } else {
                cpu[off..off + size].fill(0);
            }
        }
    }
    let mut cpu_bv = (header_bv(cpu, HEADER) & !rfbm) | (bv & rfbm);
    if rfbm & 0b110 != 0 {
        // MXCSR was loaded even if SSE state is not in use, but KVM_SET_XSAVE
        // takes MXCSR only with a component that covers it: mark SSE in use
        // (its registers already hold their initial values).
        cpu_bv |= 0b10;
    }
    cpu[HEADER..HEADER + 8].copy_from_slice(&cpu_bv.to_le_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(base: Option<u8>, index: Option<(u8, u8)>, disp: i64, rip: bool) -> MemOperand {
        MemOperand {
            base,
            index,
            disp,
            rip_relative: rip,
        }
    }

    #[test]
    fn decodes_the_forms_linux_uses() {
        // xrstor64 (%rdi)
        assert_eq!(
            decode(&[0x48, 0x0f, 0xae, 0x2f, 0x90]),
            Some(XInsn {
                op: XOp::Restore,
                mem: mem(Some(7), None, 0, false),
                len: 4
            })
        );
        // xsave64 (%rdi)
        assert_eq!(decode(&[0x48, 0x0f, 0xae, 0x27]).unwrap().op, XOp::Save);
        // xsaveopt64 0x40(%r12)
        assert_eq!(
            decode(&[0x49, 0x0f, 0xae, 0x74, 0x24, 0x40]),
            Some(XInsn {
                op: XOp::Save,
                mem: mem(Some(12), None, 0x40, false),
                len: 6
            })
        );
        // xrstor -0x10(%rax,%rcx,8)
        assert_eq!(
            decode(&[0x0f, 0xae, 0x6c, 0xc8, 0xf0]),
            Some(XInsn {
                op: XOp::Restore,
                mem: mem(Some(0), Some((1, 8)), -0x10, false),
                len: 5
            })
        );
        // xsave 0x1234(%rip)
        let x = decode(&[0x0f, 0xae, 0x25, 0x34, 0x12, 0, 0]).unwrap();
        assert_eq!(x.mem, mem(None, None, 0x1234, true));
        assert_eq!(x.len, 7);
        assert_eq!(x.mem.address(&[0; 16], 0x1000), 0x2234);
    }

    #[test]
    fn rejects_other_instructions() {
        assert_eq!(decode(&[0x0f, 0xae, 0xe8]), None); // lfence (register form)
        assert_eq!(decode(&[0x0f, 0xae, 0x00]), None); // fxsave
        assert_eq!(decode(&[0x0f, 0xc7, 0x27]), None); // xsavec
        assert_eq!(decode(&[0x66, 0x0f, 0xae, 0x27]), None);
        assert_eq!(decode(&[0x0f, 0xae]), None); // truncated
        assert_eq!(decode(&[0x0f, 0xae, 0x64, 0x24]), None); // truncated disp8
    }

    /// A small xorshift generator: reproducible pseudo-random inputs.
    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_lengths_stay_in_bounds() {
        use iced_x86::{DecoderOptions, Mnemonic, Register};
        const RIP: u64 = 0x7f00_1234_5000;
        let mut decoded_ops = [0; 2];
        let mut seed = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200_000 {
            let r = xorshift(&mut seed);
            let len = (r % 16) as usize;
            // The top byte of xorshift64*: the low bytes of consecutive
            // xorshift values are linked (a ModRM byte would decide bits
            // of the SIB byte after it).
            let mut bytes: Vec<u8> = (0..len)
                .map(|_| (xorshift(&mut seed).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8)
                .collect();
            // Bias towards the opcode so that the operand decoder is reached.
            if len >= 3 && r & 1 == 0 {
                bytes[0] = 0x48;
                bytes[1] = 0x0f;
                bytes[2] = 0xae;
            }
            if let Some(x) = decode(&bytes) {
                assert!(x.len as usize <= bytes.len(), "{bytes:x?} -> {x:?}");
            }
            // A full x86 decoder agrees: the same instructions (those
            // without prefixes other than REX), lengths and addresses.
            let mut full = iced_x86::Decoder::with_ip(64, &bytes, RIP, DecoderOptions::NONE);
            let insn = full.decode();
            let code = insn.code();
            let op = match insn.mnemonic() {
                Mnemonic::Xsave | Mnemonic::Xsave64 | Mnemonic::Xsaveopt | Mnemonic::Xsaveopt64 => {
                    Some(XOp::Save)
                }
                Mnemonic::Xrstor | Mnemonic::Xrstor64 => Some(XOp::Restore),
                _ => None,
            };
            let rex = bytes.first().is_some_and(|b| (0x40..=0x4f).contains(b));
            let plain = bytes[usize::from(rex)..].starts_with(&[0x0f, 0xae]);
            let decoded = decode(&bytes);
            assert_eq!(
                decoded.map(|x| x.op),
                op.filter(|_| plain),
                "{bytes:x?}: {code:?}"
            );
            if let Some(x) = decoded {
                assert_eq!(x.len, insn.len() as u64, "{bytes:x?}: {code:?}");
                let gprs: [u64; 16] = std::array::from_fn(|_| xorshift(&mut seed));
                let value = |reg: Register, _, _| {
                    Some(if reg.is_gpr64() {
                        gprs[reg.number()]
                    } else {
                        0
                    })
                };
                assert_eq!(
                    Some(x.mem.address(&gprs, RIP + x.len)),
                    insn.virtual_address(0, 0, value),
                    "{bytes:x?}: {code:?}"
                );
                decoded_ops[x.op as usize] += 1;
            }
        }
        // Both instructions came up, so the checks above ran.
        assert!(decoded_ops.iter().all(|&n| n > 100), "{decoded_ops:?}");
    }

    #[test]
    fn restore_of_arbitrary_areas_never_panics() {
        let l = layout();
        let mut seed = 7;
        let mut ok = 0;
        let (mut bad_header, mut bad_mxcsr) = (0, 0);
        for _ in 0..2_000 {
            let mut area: Vec<u8> = (0..1152).map(|_| xorshift(&mut seed) as u8).collect();
            if xorshift(&mut seed) & 1 == 0 {
                area[HEADER + 8..LEGACY_AND_HEADER].fill(0);
            }
            if xorshift(&mut seed) & 1 == 0 {
                // A valid header and, three times in four, a valid MXCSR:
                // the restore itself is reached.
                let bv = xorshift(&mut seed) & 0xe7;
                area[HEADER..HEADER + 8].copy_from_slice(&bv.to_le_bytes());
                let mxcsr = xorshift(&mut seed) as u32;
                let mxcsr = if mxcsr & 0x3_0000 == 0 {
                    mxcsr
                } else {
                    mxcsr & 0xffbf
                };
                area[MXCSR].copy_from_slice(&mxcsr.to_le_bytes());
            }
            let mut cpu = cpu_image();
            let before = cpu.clone();
            let rfbm = xorshift(&mut seed) & 0b100111;
            let bv = header_bv(&area, HEADER);
            let mxcsr = u32::from_le_bytes(area[MXCSR].try_into().unwrap());
            let header_ok =
                bv & !0xe7 == 0 && area[HEADER + 8..LEGACY_AND_HEADER].iter().all(|&b| b == 0);
            let mxcsr_ok = rfbm & 0b110 == 0 || mxcsr & !0xffff == 0;
            match restore(&mut cpu, &area, rfbm, 0xe7, &l) {
                // A fault leaves the vCPU state as it was, and is the one
                // the area calls for: the header first, then MXCSR.
                Err(fault) => {
                    assert_eq!(cpu, before);
                    if !header_ok {
                        assert_eq!(fault, XstateFault::BadHeader);
                        bad_header += 1;
                    } else {
                        assert_eq!(fault, XstateFault::BadMxcsr, "{mxcsr:#x}");
                        assert!(!mxcsr_ok, "{mxcsr:#x} refused");
                        bad_mxcsr += 1;
                    }
                }
                Ok(()) => {
                    assert!(header_ok && mxcsr_ok, "bv {bv:#x} mxcsr {mxcsr:#x} taken");
                    // MXCSR comes with SSE or AVX, and x87 state is the
                    // area's or its initial value (FCW 0x37f, the rest 0).
                    let expected = if rfbm & 0b110 == 0 { &before } else { &area };
                    assert_eq!(cpu[MXCSR], expected[MXCSR], "rfbm {rfbm:#x}");
                    let mut x87_init = [0u8; 160];
                    x87_init[..2].copy_from_slice(&0x037fu16.to_le_bytes());
                    for range in X87 {
                        let expected = if rfbm & 1 == 0 {
                            &before[range.clone()]
                        } else if bv & 1 != 0 {
                            &area[range.clone()]
                        } else {
                            &x87_init[range.clone()]
                        };
                        assert_eq!(&cpu[range], expected, "rfbm {rfbm:#x} bv {bv:#x}");
                    }
                    // Each requested component is the area's or its
                    // initial value; the others are untouched.
                    let (sse, avx) = (XMM, 576..576 + 256);
                    for (bit, range) in [(1u64 << 1, sse), (1 << 2, avx)] {
                        let expected = if rfbm & bit == 0 {
                            before[range.clone()].to_vec()
                        } else if bv & bit != 0 {
                            area[range.clone()].to_vec()
                        } else {
                            vec![0; range.len()]
                        };
                        assert_eq!(cpu[range], expected[..], "rfbm {rfbm:#x} bv {bv:#x}");
                    }
                    ok += 1;
                }
            }
        }
        assert!(
            ok > 100,
            "only {ok} areas restored: the checks above went unexercised"
        );
        assert!(
            bad_header > 100 && bad_mxcsr > 10,
            "{bad_header} bad headers, {bad_mxcsr} bad MXCSRs refused"
        );
    }

    #[test]
    fn effective_address_uses_registers() {
        let mut gprs = [0u64; 16];
        gprs[0] = 0x1000;
        gprs[1] = 3;
        let x = decode(&[0x0f, 0xae, 0x6c, 0xc8, 0xf0]).unwrap();
        assert_eq!(x.mem.address(&gprs, 0), 0x1000 + 24 - 0x10);
    }

    fn layout() -> XsaveLayout {
        // AVX (2) at 576, 256 bytes; opmask (5) at 1088, 64 bytes.
        XsaveLayout::from_cpuid([(2, 256, 576), (5, 64, 1088), (0, 0, 0)])
    }

    fn cpu_image() -> Vec<u8> {
        let mut cpu = vec![0u8; KVM_XSAVE_SIZE];
        for (i, b) in cpu.iter_mut().enumerate().take(1152) {
            *b = (i % 251) as u8 | 1;
        }
        cpu[MXCSR].copy_from_slice(&0x1f80u32.to_le_bytes());
        cpu[MXCSR_MASK].copy_from_slice(&0xffffu32.to_le_bytes());
        cpu[HEADER..HEADER + 64].fill(0);
        cpu[HEADER..HEADER + 8].copy_from_slice(&0b100111u64.to_le_bytes());
        cpu
    }

    #[test]
    fn area_size_covers_requested_components() {
        let l = layout();
        assert_eq!(l.area_size(0b11), Some(576));
        assert_eq!(l.area_size(0b111), Some(832));
        assert_eq!(l.area_size(0b100111), Some(1152));
        assert_eq!(l.area_size(1 << 9), None, "unknown component");
    }

    #[test]
    fn save_writes_the_state_whatever_the_hardware_tracked() {
        let layout = XsaveLayout::from_cpuid([(2, 256, 576)]);
        // The same state twice: all initial, but the first image says x87,
        // SSE and AVX are in use and holds stale bytes where the second
        // says nothing is.
        let mut tracked = vec![0u8; KVM_XSAVE_SIZE];
        tracked[0] = 0x7f;
        tracked[1] = 0x03;
        tracked[HEADER] = 0b111;
        let mut untracked = tracked.clone();
        untracked[HEADER] = 0;
        untracked[XMM.start] = 0xaa;
        untracked[600] = 0xbb;
        let save_of = |cpu: &[u8]| {
            let mut area = vec![0x55u8; 832];
            area[HEADER..HEADER + 64].fill(0);
            save(cpu, &mut area, 0b111, &layout);
            area
        };
        let a = save_of(&tracked);
        assert_eq!(a, save_of(&untracked));
        assert_eq!(header_xstate_bv(&a), 0);
        assert_eq!(&a[XMM], &[0u8; 256][..]);
        // A component with a value is in use.
        tracked[600] = 1;
        assert_eq!(header_xstate_bv(&save_of(&tracked)), 0b100);
    }

    #[test]
    fn save_then_restore_round_trips() {
        let l = layout();
        let cpu = cpu_image();
        let rfbm = 0b100111;
        let mut area = vec![0u8; l.area_size(rfbm).unwrap()];
        save(&cpu, &mut area, rfbm, &l);
        assert_eq!(&area[576..832], &cpu[576..832]);
        assert_eq!(header_bv(&area, HEADER), 0b100111);

        let mut other = vec![0u8; KVM_XSAVE_SIZE];
        other[MXCSR_MASK].copy_from_slice(&0xffffu32.to_le_bytes());
        restore(&mut other, &area, rfbm, 0xe7, &l).unwrap();
        for r in [0..24, 24..28, 32..416, 576..832, 1088..1152] {
            assert_eq!(&other[r.clone()], &cpu[r.clone()], "{r:?}");
        }
        assert_eq!(header_bv(&other, HEADER), 0b100111);
    }

    #[test]
    fn save_leaves_unrequested_state_and_header_bits_alone() {
        let l = layout();
        let cpu = cpu_image();
        let mut area = vec![0xaa; 1152];
        area[HEADER..HEADER + 64].fill(0);
        area[HEADER..HEADER + 8].copy_from_slice(&(1u64 << 5).to_le_bytes());
        save(&cpu, &mut area, 0b11, &l);
        assert!(
            area[576..832].iter().all(|&b| b == 0xaa),
            "AVX not requested"
        );
        assert_eq!(header_bv(&area, HEADER), 0b100011);
    }

    #[test]
    fn restore_of_unused_components_gives_initial_state() {
        let l = layout();
        let mut cpu = cpu_image();
        let mut area = vec![0u8; 1152];
        area[MXCSR].copy_from_slice(&0x1f80u32.to_le_bytes());
        restore(&mut cpu, &area, 0b100111, 0xe7, &l).unwrap();
        assert_eq!(&cpu[0..2], &[0x7f, 0x03], "FCW init");
        assert!(cpu[160..416].iter().all(|&b| b == 0));
        assert!(cpu[576..832].iter().all(|&b| b == 0));
        // Only SSE stays marked, so that KVM takes the MXCSR loaded.
        assert_eq!(header_bv(&cpu, HEADER), 0b10);
        assert_eq!(&cpu[MXCSR], &0x1f80u32.to_le_bytes());
    }

    #[test]
    fn restore_faults_like_hardware() {
        let l = layout();
        let mut cpu = cpu_image();
        let mut area = vec![0u8; 1152];
        area[HEADER + 8..HEADER + 16].copy_from_slice(&(1u64 << 63).to_le_bytes());
        assert_eq!(
            restore(&mut cpu, &area, 3, 0xe7, &l),
            Err(XstateFault::BadHeader)
        );
        let mut area = vec![0u8; 1152];
        area[HEADER..HEADER + 8].copy_from_slice(&(1u64 << 9).to_le_bytes());
        assert_eq!(
            restore(&mut cpu, &area, 3, 0xe7, &l),
            Err(XstateFault::BadHeader)
        );
        let mut area = vec![0u8; 1152];
        area[MXCSR].copy_from_slice(&0xffff_0000u32.to_le_bytes());
        assert_eq!(
            restore(&mut cpu, &area, 3, 0xe7, &l),
            Err(XstateFault::BadMxcsr)
        );
        assert_eq!(check_alignment(0x1008), Err(XstateFault::Misaligned));
        assert_eq!(check_alignment(0x1040), Ok(()));
    }
}
