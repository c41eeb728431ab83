//! The CPUID the guest sees, shaped from what KVM supports.
//!
//! Removed: everything whose value or timing differs between a recording
//! and its replay or between hosts (RDRAND/RDSEED, the KVM paravirtual
//! leaves such as kvmclock, PMU), the local APIC (interrupts come from the
//! user-space PIC), and instructions that KVM's emulator cannot execute in
//! guest ring 0 on hosts that interpret the guest kernel (CMPXCHG16B,
//! SMAP's CLAC/STAC, POPCNT, SSSE3, RDPID, FSGSBASE, INVPCID, LA57).
//!
//! Guest user mode may still read the host's own CPUID where the host does
//! not trap it; the guest kernel compensates (see guest-kernel-patches/).

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuFd};

/// Gives `vcpu` KVM's supported CPUID, shaped by [`shape`]; returns the
/// entries set.
pub fn apply(kvm: &Kvm, vcpu: &VcpuFd) -> Result<Vec<kvm_cpuid_entry2>, kvm_ioctls::Error> {
    let mut supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?;
    let mut entries: Vec<kvm_cpuid_entry2> = supported.as_mut_slice().to_vec();
    shape(&mut entries);
    // Shaping only removes entries, so the list still fits.
    let shaped = CpuId::from_entries(&entries).map_err(|_| kvm_ioctls::Error::new(libc::E2BIG))?;
    vcpu.set_cpuid2(&shaped)?;
    Ok(entries)
}

const fn bit(n: u32) -> u32 {
    1 << n
}

/// Leaf 1 ECX bits hidden from the guest.
const LEAF1_ECX_HIDE: u32 = bit(5) // VMX
    | bit(9) // SSSE3
    | bit(13) // CMPXCHG16B
    | bit(21) // x2APIC
    | bit(23) // POPCNT
    | bit(24) // TSC deadline
    | bit(30) // RDRAND
    | bit(31); // hypervisor present (no paravirtual leaves follow)
/// Leaf 1 EDX bits hidden from the guest.
const LEAF1_EDX_HIDE: u32 = bit(4) // TSC: the guest kernel must not use it
    | bit(9); // APIC
/// Leaf 7.0 EBX bits hidden from the guest.
const LEAF7_EBX_HIDE: u32 = bit(0) // FSGSBASE
    | bit(9) // ERMS: byte-wise `rep movsb/stosb` costs 8x the emulated iterations
    | bit(10) // INVPCID
    | bit(18) // RDSEED
    | bit(20); // SMAP
/// Leaf 7.0 ECX bits hidden from the guest.
const LEAF7_ECX_HIDE: u32 = bit(16) // LA57
    | bit(22); // RDPID
/// Leaf 7.0 EDX bits hidden from the guest.
const LEAF7_EDX_HIDE: u32 = bit(4); // FSRM (fast short `rep movsb`), as ERMS
/// Leaf 0xD.1 EAX: XSAVEOPT, XSAVEC, XGETBV with ECX=1, XSAVES, XFD. The
/// VMM completes plain XSAVE/XRSTOR for the guest kernel (see xstate.rs);
/// the compacted forms and supervisor states are not offered.
const XSAVE_EXT_HIDE: u32 = 0x1f;
/// Leaf 0x80000001 ECX: SVM.
const EXT1_ECX_HIDE: u32 = bit(2);
/// Leaf 0x80000001 EDX: RDTSCP.
const EXT1_EDX_HIDE: u32 = bit(27);

/// Shapes KVM's supported CPUID into the guest's.
pub fn shape(entries: &mut Vec<kvm_cpuid_entry2>) {
    // KVM's own leaves (kvmclock, async PF, steal time...) and the
    // architectural PMU leaf go entirely.
    entries.retain(|e| !(0x4000_0000..=0x4fff_ffff).contains(&e.function));
    for e in entries.iter_mut() {
        match (e.function, e.index) {
            (1, _) => {
                e.ecx &= !LEAF1_ECX_HIDE;
                e.edx &= !LEAF1_EDX_HIDE;
                // One logical processor, initial APIC ID 0.
                e.ebx &= 0x0000_ffff;
                e.ebx |= 1 << 16;
            }
            (7, 0) => {
                e.ebx &= !LEAF7_EBX_HIDE;
                e.ecx &= !LEAF7_ECX_HIDE;
                e.edx &= !LEAF7_EDX_HIDE;
            }
            (0xd, 1) => {
                e.eax &= !XSAVE_EXT_HIDE;
                // No supervisor states (IA32_XSS) without XSAVES.
                e.ecx = 0;
                e.edx = 0;
            }
            (0xa, _) => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            (0x8000_0001, _) => {
                e.ecx &= !EXT1_ECX_HIDE;
                e.edx &= !EXT1_EDX_HIDE;
            }
            // x2APIC ID (topology leaves) and extended APIC ID: KVM fills
            // in the host CPU the VMM happens to run on; the guest's one
            // CPU is 0, in every run.
            (0xb, _) | (0x1f, _) => e.edx = 0,
            (0x8000_001e, _) => e.eax = 0,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, regs: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: regs,
            ebx: regs,
            ecx: regs,
            edx: regs,
            ..Default::default()
        }
    }

    #[test]
    fn hides_non_deterministic_and_unemulated_features() {
        let mut v = vec![
            entry(0, 0, 0xd),
            entry(1, 0, u32::MAX),
            entry(7, 0, u32::MAX),
            entry(0xa, 0, u32::MAX),
            entry(0xd, 1, u32::MAX),
            entry(0x4000_0000, 0, u32::MAX),
            entry(0x4000_0001, 0, u32::MAX),
            entry(0x8000_0001, 0, u32::MAX),
            entry(0xb, 0, u32::MAX),
            entry(0x1f, 1, u32::MAX),
            entry(0x8000_001e, 0, u32::MAX),
        ];
        shape(&mut v);
        for (function, index) in [(0xb, 0), (0x1f, 1)] {
            let e = v
                .iter()
                .find(|e| (e.function, e.index) == (function, index));
            assert_eq!(e.unwrap().edx, 0, "x2APIC ID of leaf {function:#x}");
        }
        let ext = v.iter().find(|e| e.function == 0x8000_001e).unwrap();
        assert_eq!(ext.eax, 0, "extended APIC ID");
        assert!(v
            .iter()
            .all(|e| e.function < 0x4000_0000 || e.function >= 0x8000_0000));
        let l1 = v.iter().find(|e| e.function == 1).unwrap();
        assert_eq!(l1.ecx & bit(30), 0, "RDRAND");
        assert_eq!(l1.ecx & bit(13), 0, "CMPXCHG16B");
        assert_eq!(l1.edx & bit(9), 0, "APIC");
        assert_eq!(l1.ebx >> 16, 1, "one logical CPU, APIC ID 0");
        assert_ne!(
            l1.ecx & bit(26),
            0,
            "XSAVE stays: the VMM completes it for the guest kernel"
        );
        let l7 = v.iter().find(|e| e.function == 7).unwrap();
        assert_eq!(l7.ebx & (bit(18) | bit(20)), 0, "RDSEED, SMAP");
        assert_eq!(l7.ecx & bit(22), 0, "RDPID");
        assert_eq!((l7.ebx & bit(9), l7.edx & bit(4)), (0, 0), "ERMS, FSRM");
        let xsave_ext = v
            .iter()
            .find(|e| (e.function, e.index) == (0xd, 1))
            .unwrap();
        assert_eq!(xsave_ext.eax & 0x1f, 0, "only plain XSAVE/XRSTOR");
        let pmu = v.iter().find(|e| e.function == 0xa).unwrap();
        assert_eq!((pmu.eax, pmu.ebx, pmu.ecx, pmu.edx), (0, 0, 0, 0));
        let ext = v.iter().find(|e| e.function == 0x8000_0001).unwrap();
        assert_eq!(ext.edx & bit(27), 0, "RDTSCP");
        assert_eq!(v[0].eax, 0xd, "other leaves untouched");
    }
}
