//! Whether this host's KVM offers the PVM guest ABI (pagetable-based
//! virtualization, the virt-pvm kernel's `CONFIG_PVM_GUEST`), under which
//! an enlightened guest kernel runs natively in hardware ring 3 instead of
//! in KVM's instruction emulator (docs/pvm-guest.md).
//!
//! What the VMM can ask KVM (the vendor leaf of `KVM_GET_SUPPORTED_CPUID`
//! that a PVM host fills with the signature "PVM"), and two of the ABI's
//! first steps as a PVM guest kernel takes them at boot: reading
//! `MSR_PVM_LINEAR_ADDRESS_RANGE` (where the kernel must relocate itself)
//! in kernel mode, and the synthetic CPUID
//! (`invlpg 0xffffffffff4d5650; cpuid`) that a PVM hypervisor must emulate
//! when it traps in hardware user mode.

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;

use super::check_vm::*;

/// The PVM MSR a PVM guest kernel reads first.
pub const MSR_PVM_LINEAR_ADDRESS_RANGE: u32 = 0x4b56_4df0;

/// KVM's leaf naming its paravirtual maximum leaf (and "KVMKVMKVM").
const KVM_CPUID_SIGNATURE: u32 = 0x4000_0000;
/// The vendor leaf a PVM host adds after KVM's feature leaf: vendor
/// features in EAX, the vendor signature in EBX.
const KVM_CPUID_VENDOR_FEATURES: u32 = 0x4000_0002;
/// "PVM", the vendor signature of a PVM host.
const PVM_CPUID_SIGNATURE: u32 = 0x004d_5650;

/// What one probe of the ABI did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PvmProbe {
    /// The instruction completed: the host implements it.
    Answered,
    /// The guest's own handler received this exception vector.
    Faulted(u8),
    /// Something else happened; the text says what.
    Unknown(String),
}

/// The PVM guest ABI on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PvmGuestAbi {
    /// KVM_GET_SUPPORTED_CPUID names a vendor leaf with the signature
    /// "PVM" (what a VMM can see without running a guest).
    pub kvm_signature: bool,
    /// RDMSR of `MSR_PVM_LINEAR_ADDRESS_RANGE` in guest kernel mode.
    pub linear_range_msr: PvmProbe,
    /// `PVM_SYNTHETIC_CPUID` in guest user mode (hardware ring 3 on every
    /// host, where a PVM guest kernel runs too).
    pub synthetic_cpuid: PvmProbe,
}

impl PvmGuestAbi {
    /// KVM says so and both steps are answered: a PVM guest kernel could
    /// start here.
    pub fn present(&self) -> bool {
        self.kvm_signature
            && self.linear_range_msr == PvmProbe::Answered
            && self.synthetic_cpuid == PvmProbe::Answered
    }
}

fn probe(mode: Privilege, body: &[u8]) -> Result<PvmProbe, HostCheckError> {
    let kvm = open_kvm()?;
    let mut vm = CheckVm::running(&kvm, mode, body, false)?;
    Ok(match vm.next_event()? {
        CheckVmExit::Marker {
            marker: M_AFTER, ..
        } => PvmProbe::Answered,
        CheckVmExit::Marker { marker, .. } if marker & M_VECTOR != 0 => {
            PvmProbe::Faulted(marker & !M_VECTOR)
        }
        other => PvmProbe::Unknown(format!("{other:?}")),
    })
}

/// Whether KVM's supported CPUID carries the PVM vendor signature.
fn kvm_offers_pvm_signature() -> Result<bool, HostCheckError> {
    let kvm = open_kvm()?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("GET_SUPPORTED_CPUID"))?;
    let leaf = |function: u32| {
        cpuid
            .as_slice()
            .iter()
            .find(|e| e.function == function)
            .copied()
    };
    Ok(
        leaf(KVM_CPUID_SIGNATURE).is_some_and(|e| e.eax >= KVM_CPUID_VENDOR_FEATURES)
            && leaf(KVM_CPUID_VENDOR_FEATURES).is_some_and(|e| e.ebx == PVM_CPUID_SIGNATURE),
    )
}

/// Asks KVM for the PVM signature, and probes the two first steps of a
/// PVM guest kernel.
pub fn check_pvm_guest_abi() -> Result<PvmGuestAbi, HostCheckError> {
    // mov ecx, MSR_PVM_LINEAR_ADDRESS_RANGE; rdmsr
    let mut rdmsr = vec![0xb9];
    rdmsr.extend(MSR_PVM_LINEAR_ADDRESS_RANGE.to_le_bytes());
    rdmsr.extend([0x0f, 0x32]);
    // mov eax, 0x40000000; invlpg [0xffffffffff4d5650]; cpuid
    let synthetic_cpuid = [
        0xb8, 0x00, 0x00, 0x00, 0x40, 0x0f, 0x01, 0x3c, 0x25, 0x50, 0x56, 0x4d, 0xff, 0x0f, 0xa2,
    ];
    Ok(PvmGuestAbi {
        kvm_signature: kvm_offers_pvm_signature()?,
        linear_range_msr: probe(Privilege::Kernel, &rdmsr)?,
        synthetic_cpuid: probe(Privilege::User, &synthetic_cpuid)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn abi(kvm_signature: bool, msr: PvmProbe, cpuid: PvmProbe) -> PvmGuestAbi {
        PvmGuestAbi {
            kvm_signature,
            linear_range_msr: msr,
            synthetic_cpuid: cpuid,
        }
    }

    #[test]
    fn present_only_when_kvm_says_so_and_both_steps_are_answered() {
        use PvmProbe::{Answered, Faulted};
        assert!(abi(true, Answered, Answered).present());
        // What the development hosts measure.
        assert!(!abi(false, Faulted(13), Faulted(13)).present());
        // Any one missing part is enough to refuse.
        assert!(!abi(false, Answered, Answered).present());
        assert!(!abi(true, Faulted(13), Answered).present());
        assert!(!abi(true, Answered, Faulted(13)).present());
        assert!(!abi(true, Answered, PvmProbe::Unknown("Halted".into())).present());
    }
}
