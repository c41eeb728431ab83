//! The few KVM operations kvm-ioctls does not wrap safely. Every `unsafe`
//! block of the VMM lives here.

use std::io;

use kvm_bindings::{kvm_interrupt, kvm_run, kvm_userspace_memory_region, KVMIO};
use kvm_ioctls::{VcpuFd, VmFd};
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iow_nr;

ioctl_iow_nr!(KVM_INTERRUPT, KVMIO, 0x86, kvm_interrupt);

/// `KVM_INTERRUPT`: queue external interrupt `vector` for a vCPU of a VM
/// without an in-kernel irqchip.
pub fn inject_interrupt(vcpu: &VcpuFd, vector: u8) -> io::Result<()> {
    let irq = kvm_interrupt {
        irq: u32::from(vector),
    };
    // SAFETY: `vcpu` is an open vCPU fd and KVM_INTERRUPT reads exactly one
    // `kvm_interrupt`, which lives for the duration of the call.
    let ret = unsafe { ioctl_with_ref(vcpu, KVM_INTERRUPT(), &irq) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Maps `len` bytes of host memory at `host_addr` as guest RAM at
/// `guest_addr` in memory slot `slot`.
///
/// The caller keeps the mapping alive for as long as the VM exists: the
/// VMM owns both the guest memory and the `VmFd`, and drops the VM first.
pub fn map_guest_ram(
    vm: &VmFd,
    slot: u32,
    guest_addr: u64,
    len: u64,
    host_addr: *mut u8,
) -> io::Result<()> {
    let region = kvm_userspace_memory_region {
        slot,
        flags: 0,
        guest_phys_addr: guest_addr,
        memory_size: len,
        userspace_addr: host_addr as u64,
    };
    // SAFETY: `host_addr..host_addr+len` is a live anonymous mapping owned
    // by the VMM's guest memory, which outlives the VM (see above).
    unsafe { vm.set_user_memory_region(region) }.map_err(io::Error::from)
}

/// The `internal` member of `kvm_run` after a `KVM_EXIT_INTERNAL_ERROR`:
/// suberror and the data words KVM provided.
pub fn internal_error(run: &kvm_run) -> (u32, Vec<u64>) {
    // SAFETY: the caller saw exit reason KVM_EXIT_INTERNAL_ERROR, for
    // which KVM fills the `internal` member of the union.
    let internal = unsafe { run.__bindgen_anon_1.internal };
    let n = (internal.ndata as usize).min(internal.data.len());
    (internal.suberror, internal.data[..n].to_vec())
}
