//! The few KVM operations kvm-ioctls does not wrap safely. Every `unsafe`
//! block of the VMM lives here.

use std::io;

use kvm_bindings::{kvm_interrupt, kvm_run, kvm_userspace_memory_region, kvm_xsave, KVMIO};
use kvm_ioctls::{VcpuFd, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress};
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

/// Registers every region of `mem` as guest RAM, one memory slot each.
///
/// The caller keeps `mem` alive for as long as the VM exists (the VMM
/// structs own both and drop the VM first).
pub fn map_guest_memory(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), kvm_ioctls::Error> {
    register_guest_memory(vm, mem, 0)
}

/// Registers `mem` again with KVM's dirty log on: from now on
/// `VmFd::get_dirty_log` of each slot returns the pages the guest wrote
/// since the previous call.
pub fn log_dirty_pages(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), kvm_ioctls::Error> {
    register_guest_memory(vm, mem, kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES)
}

fn register_guest_memory(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    flags: u32,
) -> Result<(), kvm_ioctls::Error> {
    for (slot, region) in mem.iter().enumerate() {
        let host = region
            .get_host_address(MemoryRegionAddress(0))
            .map_err(|_| kvm_ioctls::Error::new(libc::EFAULT))?;
        map_guest_ram(
            vm,
            slot as u32,
            region.start_addr().0,
            region.len(),
            host,
            flags,
        )
        .map_err(|e| kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)))?;
    }
    Ok(())
}

/// Registers guest RAM again as memory slots `0..`, the pages at
/// `read_only` (guest physical, page aligned, sorted) read only: the
/// guest's writes there exit as MMIO writes for the VMM to perform. The
/// slots of the previous layout (`previous` of them, `0..previous`) are
/// deleted first; the number of slots now is returned. An empty
/// `read_only` gives back the plain layout of [`map_guest_memory`].
pub fn layout_ram(
    vm: &VmFd,
    mem: &GuestMemoryMmap,
    read_only: &[u64],
    previous: u32,
) -> io::Result<u32> {
    let mut regions = mem.iter();
    let (Some(region), None) = (regions.next(), regions.next()) else {
        return Err(io::Error::other("guest RAM is not one region"));
    };
    let (start, len) = (region.start_addr().0, region.len());
    let host_at = |gpa: u64| {
        region
            .get_host_address(MemoryRegionAddress(gpa - start))
            .map_err(|_| io::Error::from_raw_os_error(libc::EFAULT))
    };
    for slot in (0..previous.max(1)).rev() {
        let region = kvm_userspace_memory_region {
            slot,
            ..Default::default()
        };
        // SAFETY: a zero size deletes the slot; no memory is mapped.
        unsafe { vm.set_user_memory_region(region) }.map_err(io::Error::from)?;
    }
    let mut slots = 0;
    let mut add = |at: u64, size: u64, flags: u32| -> io::Result<()> {
        map_guest_ram(vm, slots, at, size, host_at(at)?, flags)?;
        slots += 1;
        Ok(())
    };
    let mut cursor = start;
    for &page in read_only
        .iter()
        .filter(|&&p| p >= start && p + 4096 <= start + len)
    {
        if page < cursor {
            continue;
        }
        if page > cursor {
            add(cursor, page - cursor, 0)?;
        }
        add(page, 4096, kvm_bindings::KVM_MEM_READONLY)?;
        cursor = page + 4096;
    }
    if cursor < start + len {
        add(cursor, start + len - cursor, 0)?;
    }
    Ok(slots)
}

/// A memory slot no guest RAM uses, and where it goes (far above RAM and
/// devices), for [`forget_guest_mappings`].
const SCRATCH_SLOT: u32 = 0x100;
const SCRATCH_GPA: u64 = 0xf_0000_0000;

/// Makes KVM drop every translation it built from the guest's page
/// tables. KVM's shadow page tables (these hosts' KVM has no EPT) only
/// follow the guest's writes to its page tables: when the VMM writes
/// guest memory behind its back (putting a snapshot back), they would
/// keep mapping what the restored page tables do not, and the guest would
/// not fault where it did. Deleting a memory slot makes KVM zap them all;
/// a one-page scratch slot (aliasing the first page of RAM) is added and
/// deleted for that.
pub fn forget_guest_mappings(vm: &VmFd, mem: &GuestMemoryMmap) -> io::Result<()> {
    let host = mem
        .iter()
        .next()
        .and_then(|r| r.get_host_address(MemoryRegionAddress(0)).ok())
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
    map_guest_ram(vm, SCRATCH_SLOT, SCRATCH_GPA, 4096, host, 0)?;
    let region = kvm_userspace_memory_region {
        slot: SCRATCH_SLOT,
        flags: 0,
        guest_phys_addr: SCRATCH_GPA,
        memory_size: 0,
        userspace_addr: host as u64,
    };
    // SAFETY: a zero size deletes the slot; no memory is mapped.
    unsafe { vm.set_user_memory_region(region) }.map_err(io::Error::from)
}

/// Maps `len` bytes of host memory at `host_addr` as guest RAM at
/// `guest_addr` in memory slot `slot`.
fn map_guest_ram(
    vm: &VmFd,
    slot: u32,
    guest_addr: u64,
    len: u64,
    host_addr: *mut u8,
    flags: u32,
) -> io::Result<()> {
    let region = kvm_userspace_memory_region {
        slot,
        flags,
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

/// `KVM_SET_XSAVE` with the 4096-byte legacy buffer. `state_size` is the
/// size of the largest state the guest can enable (from its CPUID); it
/// must fit the buffer, or KVM would read past it.
pub fn set_xsave(
    vcpu: &VcpuFd,
    xsave: &kvm_xsave,
    state_size: usize,
) -> Result<(), kvm_ioctls::Error> {
    if state_size > std::mem::size_of_val(&xsave.region) {
        return Err(kvm_ioctls::Error::new(libc::E2BIG));
    }
    // SAFETY: KVM reads at most the guest's enabled XSAVE state, which is
    // `state_size` bytes or fewer, all within `xsave.region` (checked above).
    unsafe { vcpu.set_xsave(xsave) }
}
