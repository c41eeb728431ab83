//! The registers gdb is shown: x86-64 GNU/Linux, the core and SSE
//! registers of `gdbstub_arch` followed by `orig_rax` and the FS and GS
//! bases. The target description names the GNU/Linux ABI and the
//! `org.gnu.gdb.i386.linux` feature: without them gdb leaves out its
//! Linux support (thread-local storage, the dynamic linker's list of
//! libraries, signal frames).

use core::num::NonZeroUsize;

use gdbstub::arch::{Arch, RegId, Registers};
use gdbstub_arch::x86::reg::id::X86_64CoreRegId;
use gdbstub_arch::x86::reg::X86_64CoreRegs;

/// x86-64 GNU/Linux user code.
pub enum X86_64Linux {}

/// The registers of one thread.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LinuxRegs {
    pub core: X86_64CoreRegs,
    pub orig_rax: u64,
    pub fs_base: u64,
    pub gs_base: u64,
}

/// Bytes of the core and SSE registers in a `g` packet.
const CORE_BYTES: usize = 0x218;

impl Registers for LinuxRegs {
    type ProgramCounter = u64;

    fn pc(&self) -> u64 {
        self.core.rip
    }

    fn gdb_serialize(&self, mut write: impl FnMut(Option<u8>)) {
        self.core.gdb_serialize(&mut write);
        for value in [self.orig_rax, self.fs_base, self.gs_base] {
            for b in value.to_le_bytes() {
                write(Some(b));
            }
        }
    }

    fn gdb_deserialize(&mut self, bytes: &[u8]) -> Result<(), ()> {
        if bytes.len() < CORE_BYTES + 24 {
            return Err(());
        }
        self.core.gdb_deserialize(&bytes[..CORE_BYTES])?;
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default());
        self.orig_rax = word(CORE_BYTES);
        self.fs_base = word(CORE_BYTES + 8);
        self.gs_base = word(CORE_BYTES + 16);
        Ok(())
    }
}

/// A register, by gdb's number.
#[derive(Debug, Clone, Copy)]
pub enum LinuxRegId {
    Core(X86_64CoreRegId),
    OrigRax,
    FsBase,
    GsBase,
}

/// gdb's numbers of the registers after the core and SSE ones.
const ORIG_RAX: usize = 57;
const FS_BASE: usize = 58;
const GS_BASE: usize = 59;
/// gdb's number of RIP.
const RIP: usize = 16;

impl RegId for LinuxRegId {
    fn from_raw_id(id: usize) -> Option<(Self, Option<NonZeroUsize>)> {
        let eight = NonZeroUsize::new(8);
        match id {
            ORIG_RAX => Some((LinuxRegId::OrigRax, eight)),
            FS_BASE => Some((LinuxRegId::FsBase, eight)),
            GS_BASE => Some((LinuxRegId::GsBase, eight)),
            _ => X86_64CoreRegId::from_raw_id(id).map(|(r, size)| (LinuxRegId::Core(r), size)),
        }
    }

    fn to_raw_id(&self) -> Option<usize> {
        match self {
            LinuxRegId::OrigRax => Some(ORIG_RAX),
            LinuxRegId::FsBase => Some(FS_BASE),
            LinuxRegId::GsBase => Some(GS_BASE),
            LinuxRegId::Core(X86_64CoreRegId::Rip) => Some(RIP),
            LinuxRegId::Core(X86_64CoreRegId::Gpr(n)) => Some(usize::from(*n)),
            LinuxRegId::Core(_) => None,
        }
    }
}

impl Arch for X86_64Linux {
    type Usize = u64;
    type Registers = LinuxRegs;
    type RegId = LinuxRegId;
    type BreakpointKind = usize;

    fn target_description_xml() -> Option<&'static str> {
        Some(TARGET_XML)
    }
}

/// The target description: the registers in the order of a `g` packet.
const TARGET_XML: &str = concat!(
    r#"<?xml version="1.0"?><!DOCTYPE target SYSTEM "gdb-target.dtd">"#,
    r#"<target version="1.0"><architecture>i386:x86-64</architecture>"#,
    r#"<osabi>GNU/Linux</osabi>"#,
    r#"<feature name="org.gnu.gdb.i386.core">"#,
    r#"<flags id="i386_eflags" size="4">"#,
    r#"<field name="CF" start="0" end="0"/><field name="" start="1" end="1"/>"#,
    r#"<field name="PF" start="2" end="2"/><field name="AF" start="4" end="4"/>"#,
    r#"<field name="ZF" start="6" end="6"/><field name="SF" start="7" end="7"/>"#,
    r#"<field name="TF" start="8" end="8"/><field name="IF" start="9" end="9"/>"#,
    r#"<field name="DF" start="10" end="10"/><field name="OF" start="11" end="11"/>"#,
    r#"<field name="NT" start="14" end="14"/><field name="RF" start="16" end="16"/>"#,
    r#"<field name="VM" start="17" end="17"/><field name="AC" start="18" end="18"/>"#,
    r#"<field name="VIF" start="19" end="19"/><field name="VIP" start="20" end="20"/>"#,
    r#"<field name="ID" start="21" end="21"/></flags>"#,
    r#"<reg name="rax" bitsize="64" type="int64" regnum="0"/>"#,
    r#"<reg name="rbx" bitsize="64" type="int64"/><reg name="rcx" bitsize="64" type="int64"/>"#,
    r#"<reg name="rdx" bitsize="64" type="int64"/><reg name="rsi" bitsize="64" type="int64"/>"#,
    r#"<reg name="rdi" bitsize="64" type="int64"/><reg name="rbp" bitsize="64" type="data_ptr"/>"#,
    r#"<reg name="rsp" bitsize="64" type="data_ptr"/><reg name="r8" bitsize="64" type="int64"/>"#,
    r#"<reg name="r9" bitsize="64" type="int64"/><reg name="r10" bitsize="64" type="int64"/>"#,
    r#"<reg name="r11" bitsize="64" type="int64"/><reg name="r12" bitsize="64" type="int64"/>"#,
    r#"<reg name="r13" bitsize="64" type="int64"/><reg name="r14" bitsize="64" type="int64"/>"#,
    r#"<reg name="r15" bitsize="64" type="int64"/>"#,
    r#"<reg name="rip" bitsize="64" type="code_ptr"/>"#,
    r#"<reg name="eflags" bitsize="32" type="i386_eflags"/>"#,
    r#"<reg name="cs" bitsize="32" type="int32"/><reg name="ss" bitsize="32" type="int32"/>"#,
    r#"<reg name="ds" bitsize="32" type="int32"/><reg name="es" bitsize="32" type="int32"/>"#,
    r#"<reg name="fs" bitsize="32" type="int32"/><reg name="gs" bitsize="32" type="int32"/>"#,
    r#"<reg name="st0" bitsize="80" type="i387_ext"/><reg name="st1" bitsize="80" type="i387_ext"/>"#,
    r#"<reg name="st2" bitsize="80" type="i387_ext"/><reg name="st3" bitsize="80" type="i387_ext"/>"#,
    r#"<reg name="st4" bitsize="80" type="i387_ext"/><reg name="st5" bitsize="80" type="i387_ext"/>"#,
    r#"<reg name="st6" bitsize="80" type="i387_ext"/><reg name="st7" bitsize="80" type="i387_ext"/>"#,
    r#"<reg name="fctrl" bitsize="32" type="int" group="float"/>"#,
    r#"<reg name="fstat" bitsize="32" type="int" group="float"/>"#,
    r#"<reg name="ftag" bitsize="32" type="int" group="float"/>"#,
    r#"<reg name="fiseg" bitsize="32" type="int" group="float"/>"#,
    r#"<reg name="fioff" bitsize="32" type="int" group="float"/>"#,
    r#"<reg name="foseg" bitsize="32" type="int" group="float"/>"#,
    r#"<reg name="fooff" bitsize="32" type="int" group="float"/>"#,
    r#"<reg name="fop" bitsize="32" type="int" group="float"/>"#,
    r#"</feature><feature name="org.gnu.gdb.i386.sse">"#,
    r#"<vector id="v4f" type="ieee_single" count="4"/>"#,
    r#"<vector id="v2d" type="ieee_double" count="2"/>"#,
    r#"<vector id="v16i8" type="int8" count="16"/>"#,
    r#"<vector id="v8i16" type="int16" count="8"/>"#,
    r#"<vector id="v4i32" type="int32" count="4"/>"#,
    r#"<vector id="v2i64" type="int64" count="2"/>"#,
    r#"<union id="vec128"><field name="v4_float" type="v4f"/>"#,
    r#"<field name="v2_double" type="v2d"/><field name="v16_int8" type="v16i8"/>"#,
    r#"<field name="v8_int16" type="v8i16"/><field name="v4_int32" type="v4i32"/>"#,
    r#"<field name="v2_int64" type="v2i64"/><field name="uint128" type="uint128"/></union>"#,
    r#"<flags id="i386_mxcsr" size="4">"#,
    r#"<field name="IE" start="0" end="0"/><field name="DE" start="1" end="1"/>"#,
    r#"<field name="ZE" start="2" end="2"/><field name="OE" start="3" end="3"/>"#,
    r#"<field name="UE" start="4" end="4"/><field name="PE" start="5" end="5"/>"#,
    r#"<field name="DAZ" start="6" end="6"/><field name="IM" start="7" end="7"/>"#,
    r#"<field name="DM" start="8" end="8"/><field name="ZM" start="9" end="9"/>"#,
    r#"<field name="OM" start="10" end="10"/><field name="UM" start="11" end="11"/>"#,
    r#"<field name="PM" start="12" end="12"/><field name="FZ" start="15" end="15"/></flags>"#,
    r#"<reg name="xmm0" bitsize="128" type="vec128" regnum="40"/>"#,
    r#"<reg name="xmm1" bitsize="128" type="vec128"/><reg name="xmm2" bitsize="128" type="vec128"/>"#,
    r#"<reg name="xmm3" bitsize="128" type="vec128"/><reg name="xmm4" bitsize="128" type="vec128"/>"#,
    r#"<reg name="xmm5" bitsize="128" type="vec128"/><reg name="xmm6" bitsize="128" type="vec128"/>"#,
    r#"<reg name="xmm7" bitsize="128" type="vec128"/><reg name="xmm8" bitsize="128" type="vec128"/>"#,
    r#"<reg name="xmm9" bitsize="128" type="vec128"/><reg name="xmm10" bitsize="128" type="vec128"/>"#,
    r#"<reg name="xmm11" bitsize="128" type="vec128"/><reg name="xmm12" bitsize="128" type="vec128"/>"#,
    r#"<reg name="xmm13" bitsize="128" type="vec128"/><reg name="xmm14" bitsize="128" type="vec128"/>"#,
    r#"<reg name="xmm15" bitsize="128" type="vec128"/>"#,
    r#"<reg name="mxcsr" bitsize="32" type="i386_mxcsr" group="vector"/></feature>"#,
    r#"<feature name="org.gnu.gdb.i386.linux">"#,
    r#"<reg name="orig_rax" bitsize="64" type="int" regnum="57"/></feature>"#,
    r#"<feature name="org.gnu.gdb.i386.segments">"#,
    r#"<reg name="fs_base" bitsize="64" type="int"/><reg name="gs_base" bitsize="64" type="int"/>"#,
    r#"</feature></target>"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_round_trip_through_a_g_packet_in_the_description_order() {
        let mut regs = LinuxRegs::default();
        regs.core.regs[0] = 0x1122;
        regs.core.rip = 0x40_1000;
        regs.orig_rax = u64::MAX;
        regs.fs_base = 0x7f00_0000_1000;
        regs.gs_base = 7;
        let mut bytes = Vec::new();
        regs.gdb_serialize(|b| bytes.push(b.unwrap_or(0)));
        assert_eq!(bytes.len(), CORE_BYTES + 24);
        // orig_rax, fs_base and gs_base follow the core and SSE registers,
        // as numbers 57, 58 and 59.
        assert_eq!(&bytes[CORE_BYTES..CORE_BYTES + 8], &[0xff; 8]);
        let mut back = LinuxRegs::default();
        back.gdb_deserialize(&bytes).unwrap();
        assert_eq!(back, regs);
        assert!(back.gdb_deserialize(&bytes[..CORE_BYTES]).is_err());
        assert!(matches!(
            LinuxRegId::from_raw_id(58),
            Some((LinuxRegId::FsBase, _))
        ));
        assert_eq!(LinuxRegId::FsBase.to_raw_id(), Some(58));
        // The description declares exactly those registers, by name.
        for name in [
            "orig_rax",
            "fs_base",
            "gs_base",
            "xmm15",
            "mxcsr",
            "GNU/Linux",
        ] {
            assert!(TARGET_XML.contains(name), "{name}");
        }
        assert_eq!(TARGET_XML.matches("<reg ").count(), 60);
    }
}
