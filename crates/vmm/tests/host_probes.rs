//! KVM tests: each runs one tiny hand-assembled guest for one mechanism
//! (see `vmm::host_check`). They need /dev/kvm, so they are `#[ignore]`d:
//! `tools/test` runs them (`--include-ignored`) on hosts that have it.

use std::path::Path;

use vmm::host_check::{self, Int3Behaviour, Privilege, PvmProbe, SyscallBehaviour};

/// Fails if /dev/kvm does not exist: these tests were asked to run where
/// they cannot.
fn kvm_present() {
    assert!(
        Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm, which this machine does not have"
    );
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn syscall_lands_at_lstar_in_a_known_mode() {
    kvm_present();
    let b = host_check::check_syscall().unwrap();
    assert!(
        matches!(
            b,
            SyscallBehaviour::EntersKernel | SyscallBehaviour::StaysInUserMode
        ),
        "{b:?}"
    );
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn kernel_mode_single_step_and_hardware_breakpoints_exit() {
    kvm_present();
    // Architectural on VT-x/AMD-V and measured on interpreting hosts.
    assert!(host_check::check_single_step(Privilege::Kernel).unwrap());
    assert!(host_check::check_hw_breakpoint(Privilege::Kernel).unwrap());
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn int3_is_handled_somewhere_known() {
    kvm_present();
    for mode in [Privilege::Kernel, Privilege::User] {
        let b = host_check::check_sw_breakpoint(mode).unwrap();
        assert!(!matches!(b, Int3Behaviour::Unknown(_)), "{mode:?}: {b:?}");
    }
    // In user mode the instruction always executes natively or is
    // intercepted; it is never an emulation failure.
    assert_ne!(
        host_check::check_sw_breakpoint(Privilege::User).unwrap(),
        Int3Behaviour::NotEmulated
    );
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn user_port_io_reaches_the_vmm() {
    kvm_present();
    assert!(host_check::check_user_port_io().unwrap());
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn host_report_is_consistent() {
    kvm_present();
    let r = host_check::HostReport::measure().unwrap();
    assert!(r.can_run(), "{r:?}");
    // Facts about the host do not change between two measurements.
    let again = host_check::HostReport::measure().unwrap();
    let facts = |r: &host_check::HostReport| {
        format!(
            "{:?}",
            (
                &r.syscall,
                r.user_port_io,
                &r.int3_kernel,
                &r.int3_user,
                (r.hw_breakpoint_kernel, r.hw_breakpoint_user),
                (r.single_step_kernel, r.single_step_user),
                r.user_tsd,
                r.user_xcr0,
                &r.pmu,
                &r.pvm_guest_abi,
            )
        )
    };
    assert_eq!(facts(&r), facts(&again));
    // Against what the host says elsewhere: without a CPU PMU driver in
    // sysfs no hardware branch counter can be opened, and the exit clock
    // is the one left.
    if !std::path::Path::new("/sys/bus/event_source/devices/cpu").exists() {
        assert!(r.pmu.host_branch_counter.is_err(), "{r:?}");
        assert_eq!(r.clock(), trace::ClockKind::Exit);
    }
    // Guest counters come from KVM's CPUID leaf 0xA, asked here directly.
    let kvm = kvm_ioctls::Kvm::new().unwrap();
    let cpuid = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .unwrap();
    let leaf_a = cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == 0xa)
        .map_or(0, |e| (e.eax >> 8) & 0xff);
    assert_eq!(r.pmu.guest_counters, leaf_a, "{r:?}");
    // KVM offers guests no more counters than the host CPU has (CPUID run
    // here), and none where the host kernel found no architectural PMU.
    let host_counters = if host_cpuid(0).eax >= 0xa {
        (host_cpuid(0xa).eax >> 8) & 0xff
    } else {
        0
    };
    assert!(r.pmu.guest_counters <= host_counters, "{r:?}");
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
    let arch_perfmon = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|l| l.split_whitespace().any(|f| f == "arch_perfmon"));
    if !arch_perfmon {
        assert_eq!(r.pmu.guest_counters, 0, "{r:?}");
    }
    // The branch clock only where both halves exist on this host.
    if r.clock() == trace::ClockKind::Branch {
        assert!(
            Path::new("/sys/bus/event_source/devices/cpu").exists() && leaf_a > 0,
            "{r:?}"
        );
    }
    // x87 and SSE state are always enabled for user code.
    assert_eq!(r.user_xcr0 & 3, 3, "{r:?}");
    // User code sees the guest's XCR0 (x87|SSE) or the host's own, read
    // here with XGETBV.
    let host_xcr0 = host_xcr0();
    assert!(
        r.user_xcr0 == 3 || u64::from(r.user_xcr0) == host_xcr0 & 0xff,
        "user code saw XCR0 {:#x}, the host's is {host_xcr0:#x}",
        r.user_xcr0
    );
    // Breakpoints and single steps exit to the VMM only through guest
    // debugging, which KVM must then report it has.
    let debug_exits = r.single_step_kernel
        || r.single_step_user
        || r.hw_breakpoint_kernel
        || r.hw_breakpoint_user
        || r.int3_kernel == Int3Behaviour::Intercepted
        || r.int3_user == Int3Behaviour::Intercepted;
    if debug_exits {
        assert!(kvm.check_extension(kvm_ioctls::Cap::SetGuestDebug), "{r:?}");
    }
    // The delivery rounds add up: every one exact means none was late.
    let d = &r.delivery;
    assert!(d.rounds > 0 && d.exact <= d.rounds, "{d:?}");
    assert!(d.exact < d.rounds || d.max_late == 0, "{d:?}");
    // A state-matching probe that works stopped for no reason.
    let m = &r.state_match;
    if m.works() {
        assert_eq!(m.failure, None, "{m:?}");
    }
}

/// CPUID run on the host (not through KVM).
fn host_cpuid(leaf: u32) -> std::arch::x86_64::CpuidResult {
    std::arch::x86_64::__cpuid(leaf)
}

/// The host's XCR0, with XGETBV.
fn host_xcr0() -> u64 {
    assert!(
        std::arch::is_x86_feature_detected!("xsave"),
        "KVM's probes enable XSAVE in their guest; this host has none"
    );
    // SAFETY: XGETBV with ECX = 0 only reads XCR0, which exists when the
    // CPU has XSAVE and the OS enabled it (checked above).
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn user_mode_xcr0_is_measured() {
    kvm_present();
    // x87 and SSE are always enabled; whether the rest follows the
    // guest's XCR0 (3) or the host's is what the probe tells.
    let xcr0 = host_check::check_user_xcr0().unwrap();
    assert_eq!(xcr0 & 3, 3, "{xcr0:#x}");
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn interrupts_injected_at_an_exit_arrive_before_the_next_instruction() {
    kvm_present();
    // The exit clock depends on this: an interrupt injected at a
    // deterministic exit must reach the guest at exactly that point.
    let r = host_check::check_interrupt_delivery(50).unwrap();
    assert_eq!(r.exact, r.rounds, "{r:?}");
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn user_code_stepped_in_kernel_mode_runs_as_in_user_mode() {
    kvm_present();
    // The replay-time tracer steps these kinds of instruction in guest
    // kernel mode, where KVM's emulator runs them (`tools::kernel_steps`).
    let report = host_check::check_kernel_steps().unwrap();
    assert!(report.differences.is_empty(), "{:#?}", report.differences);
    assert!(report.steps > 150, "{report:?}");
}

#[ignore = "needs /dev/kvm (tools/test runs it)"]
#[test]
fn pvm_guest_abi_probes_end_in_a_known_way() {
    kvm_present();
    let abi = host_check::check_pvm_guest_abi().unwrap();
    for p in [&abi.linear_range_msr, &abi.synthetic_cpuid] {
        assert!(!matches!(p, PvmProbe::Unknown(_)), "{abi:?}");
        // A host without the ABI refuses both with #GP, as the
        // architecture does for an unknown MSR and for INVLPG in ring 3.
        if let PvmProbe::Faulted(vector) = p {
            assert_eq!(*vector, 13, "{abi:?}");
        }
    }
    // What KVM tells the VMM agrees with what the guest meets: the PVM
    // signature in the vendor leaf exactly where the guest can read the
    // PVM MSR.
    assert_eq!(
        abi.kvm_signature,
        abi.linear_range_msr == PvmProbe::Answered,
        "{abi:?}"
    );
    // The VMM's view agrees with the guest's: where the guest cannot read
    // the MSR, KVM_GET_MSRS reads none of it either (and the other way
    // round).
    let kvm = kvm_ioctls::Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    let vcpu = vm.create_vcpu(0).unwrap();
    let mut msrs = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: host_check::MSR_PVM_LINEAR_ADDRESS_RANGE,
        ..Default::default()
    }])
    .unwrap();
    let read = vcpu.get_msrs(&mut msrs).unwrap();
    assert_eq!(
        read == 1,
        abi.linear_range_msr == PvmProbe::Answered,
        "{abi:?}, KVM_GET_MSRS read {read}"
    );
}
