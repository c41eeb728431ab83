//! Setting up the machine: KVM, guest memory and the boot image, the vCPU
//! with its CPUID and MSR filter, and the devices.

use guest::VmSpec;
use std::time::{SystemTime, UNIX_EPOCH};

use devices::cow_disk::{CowDisk, DiskError};
use devices::doorbell::Doorbell;
use devices::host_files::HostFiles;
use devices::virtio_9p::Virtio9p;
use devices::virtio_blk::VirtioBlock;
use devices::virtio_console::VirtioConsole;
use devices::virtio_net::{NetBackend, VirtioNet};
use devices::LegacyPlatform;
use kvm_ioctls::Kvm;
use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::{
    kvm_err, Console, ConsoleSink, ExitCounts, GuestCpu, GuestStatus, HostFilesDevice,
    HostTerminal, Machine, Vcpu, Vm, VmClock, VmError, BOOT_VCPU,
};
use crate::{cpuid, kvm_ext};
use guest::boot;
use introspect::xstate::XsaveLayout;

impl Machine {
    /// Creates the VM and its vCPU, loads the guest and sets the vCPU's
    /// boot registers.
    pub fn new(spec: &VmSpec, console: Console) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let vm = kvm.create_vm().map_err(kvm_err("CREATE_VM"))?;
        vm.set_tss_address(0xfffb_d000)
            .map_err(kvm_err("SET_TSS_ADDR"))?;

        let ram_size = spec.memory_mib << 20;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), ram_size as usize)])
            .map_err(|_| VmError::Memory {
                mib: spec.memory_mib,
            })?;
        kvm_ext::map_guest_memory(&vm, &mem).map_err(kvm_err("SET_USER_MEMORY_REGION"))?;

        let layout = boot::load_guest(
            &mem,
            ram_size,
            &spec.kernel,
            &spec.kernel_image,
            &spec.initramfs,
            &spec.cmdline,
            &spec.rng_seed,
        )?;

        let vcpu = vm
            .create_vcpu(u64::from(BOOT_VCPU))
            .map_err(kvm_err("CREATE_VCPU"))?;
        let cpuid = cpuid::apply(&kvm, &vcpu).map_err(kvm_err("SET_CPUID2"))?;
        let xsave_layout = XsaveLayout::from_cpuid(
            cpuid
                .iter()
                .filter(|e| e.function == 0xd)
                .map(|e| (e.index, e.eax, e.ebx)),
        );
        let guest_cpuid = cpuid
            .as_slice()
            .iter()
            .map(|e| (e.function, e.index, e.eax, e.ebx, e.ecx, e.edx))
            .collect();
        let kvm_caps = [
            kvm_bindings::KVM_CAP_X86_USER_SPACE_MSR,
            kvm_bindings::KVM_CAP_SYNC_REGS,
            kvm_bindings::KVM_CAP_XSAVE,
            kvm_bindings::KVM_CAP_IMMEDIATE_EXIT,
        ]
        .iter()
        .map(|&c| (c, vm.check_extension_raw(u64::from(c))))
        .collect();
        let supported_xcr0 = cpuid
            .iter()
            .find(|e| (e.function, e.index) == (0xd, 0))
            .map(|e| u64::from(e.eax) | (u64::from(e.edx) << 32))
            .unwrap_or(0b11);
        let xsave_max_size =
            xsave_layout
                .area_size(supported_xcr0)
                .ok_or(VmError::XsaveTooLarge {
                    xcr0: supported_xcr0,
                })?;

        // MSRs KVM does not know exit to the VMM (the paravirtual clock),
        // and so does the TSC MSR, which KVM would answer with host time.
        let mut cap = kvm_bindings::kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_X86_USER_SPACE_MSR,
            ..Default::default()
        };
        cap.args[0] = u64::from(
            kvm_bindings::KVM_MSR_EXIT_REASON_UNKNOWN | kvm_bindings::KVM_MSR_EXIT_REASON_FILTER,
        );
        vm.enable_cap(&cap)
            .map_err(kvm_err("ENABLE_CAP(X86_USER_SPACE_MSR)"))?;
        vm.set_msr_filter(
            kvm_ioctls::MsrFilterDefaultAction::ALLOW,
            &[kvm_ioctls::MsrFilterRange {
                flags: kvm_ioctls::MsrFilterRangeFlags::READ
                    | kvm_ioctls::MsrFilterRangeFlags::WRITE,
                base: journal::MSR_IA32_TSC,
                msr_count: 1,
                bitmap: &[0],
            }],
        )
        .map_err(kvm_err("X86_SET_MSR_FILTER"))?;

        let mut vcpu = vcpu;
        // Registers come with every exit in kvm_run, for the journal.
        vcpu.set_sync_valid_reg(kvm_ioctls::SyncReg::Register);
        let sregs = vcpu.get_sregs().map_err(kvm_err("GET_SREGS"))?;
        vcpu.set_sregs(&boot::boot_sregs(sregs))
            .map_err(kvm_err("SET_SREGS"))?;
        vcpu.set_regs(&boot::boot_regs(layout.entry))
            .map_err(kvm_err("SET_REGS"))?;
        vcpu.set_fpu(&boot::boot_fpu())
            .map_err(kvm_err("SET_FPU"))?;

        let doorbell = Doorbell::new();
        let block = match &spec.disk {
            Some(base) => {
                let file = base.file.try_clone().map_err(|source| DiskError::Open {
                    path: base.path.clone(),
                    source,
                })?;
                Some(VirtioBlock::new(
                    CowDisk::over(file, &base.path, &std::env::temp_dir())?,
                    doorbell.clone(),
                )?)
            }
            None => None,
        };
        let net = match &spec.net {
            Some(n) => {
                let backend = match &n.tap {
                    Some((name, host_address)) => NetBackend::Tap {
                        name: name.clone(),
                        host_address: *host_address,
                    },
                    None => NetBackend::None,
                };
                Some(VirtioNet::new(n.mac, backend, doorbell.clone())?)
            }
            None => None,
        };

        let boot_unix_secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let sink = ConsoleSink::new(console);
        let mut platform = LegacyPlatform::new(boot_unix_secs, sink.clone());
        // The size is unknown (0x0) until the VMM tells the driver the
        // host terminal's: a change is what makes the driver read it.
        // Writes straight from a process's buffer go through the guest's
        // page tables, read as user mode would.
        let console = VirtioConsole::new(sink, (0, 0), Some(introspect::gva::peek_user));
        let archive =
            guest::spec::delivered_archive(&spec.archive, &spec.rng_seed, spec.wall_clock)
                .map_err(|e| VmError::Restore(format!("the run's archive: {e}")))?;
        let archive_len = u32::try_from(archive.len()).map_err(|_| VmError::ArchiveTooLarge {
            bytes: archive.len(),
        })?;
        platform.set_archive_len(archive_len);
        Ok(Machine {
            vcpu: Vcpu::new(vcpu),
            vm: Vm {
                fd: vm,
                kvm,
                mem,
                platform,
                console,
                terminal: HostTerminal {
                    kind: spec.console,
                    input: None,
                    size: None,
                    streams: super::HostStreams::default(),
                },
                block,
                net,
                host_files: spec.host_files.as_deref().map(|exports| HostFilesDevice {
                    device: Virtio9p::new(),
                    server: (!exports.is_empty()).then(|| HostFiles::new(exports)),
                }),
                doorbell,
                clock: VmClock::new(),
                exits: ExitCounts::default(),
                cpu: GuestCpu {
                    cpuid: guest_cpuid,
                    kvm_caps,
                    xsave_layout,
                    xsave_max_size,
                },
                status: GuestStatus::default(),
                archive,
            },
        })
    }
}
