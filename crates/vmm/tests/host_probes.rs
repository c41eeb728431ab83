//! KVM tests: each runs one tiny hand-assembled guest for one mechanism
//! (see `vmm::host_check`). Needs /dev/kvm; where the device does not
//! exist the tests say so and do nothing else.

use std::path::Path;

use vmm::host_check::{self, Int3Behaviour, Mode, SyscallBehaviour};

fn kvm_present() -> bool {
    let present = Path::new("/dev/kvm").exists();
    if !present {
        eprintln!("SKIPPED: /dev/kvm does not exist on this machine");
    }
    present
}

#[test]
fn syscall_lands_at_lstar_in_a_known_mode() {
    if !kvm_present() {
        return;
    }
    let b = host_check::probe_syscall().unwrap();
    assert!(
        matches!(
            b,
            SyscallBehaviour::EntersKernel | SyscallBehaviour::StaysInUserMode
        ),
        "{b:?}"
    );
}

#[test]
fn kernel_mode_single_step_and_hardware_breakpoints_exit() {
    if !kvm_present() {
        return;
    }
    // Architectural on VT-x/AMD-V and measured on interpreting hosts.
    assert!(host_check::probe_single_step(Mode::Kernel).unwrap());
    assert!(host_check::probe_hw_breakpoint(Mode::Kernel).unwrap());
}

#[test]
fn int3_is_handled_somewhere_known() {
    if !kvm_present() {
        return;
    }
    for mode in [Mode::Kernel, Mode::User] {
        let b = host_check::probe_sw_breakpoint(mode).unwrap();
        assert!(!matches!(b, Int3Behaviour::Unknown(_)), "{mode:?}: {b:?}");
    }
    // In user mode the instruction always executes natively or is
    // intercepted; it is never an emulation failure.
    assert_ne!(
        host_check::probe_sw_breakpoint(Mode::User).unwrap(),
        Int3Behaviour::NotEmulated
    );
}

#[test]
fn user_port_io_reaches_the_vmm() {
    if !kvm_present() {
        return;
    }
    assert!(host_check::probe_user_port_io().unwrap());
}

#[test]
fn host_report_is_consistent() {
    if !kvm_present() {
        return;
    }
    let r = host_check::HostReport::measure().unwrap();
    assert!(r.can_run(), "{r:?}");
    if r.pmu.host_branch_counter.is_err() || r.pmu.guest_counters == 0 {
        assert_eq!(r.clock(), host_check::ClockKind::Exit);
    }
}

#[test]
fn user_mode_xcr0_is_measured() {
    if !kvm_present() {
        return;
    }
    // x87 and SSE are always enabled; whether the rest follows the
    // guest's XCR0 (3) or the host's is what the probe tells.
    let xcr0 = host_check::probe_user_xcr0().unwrap();
    assert_eq!(xcr0 & 3, 3, "{xcr0:#x}");
}

#[test]
fn interrupts_injected_at_an_exit_arrive_before_the_next_instruction() {
    if !kvm_present() {
        return;
    }
    // The exit clock depends on this: an interrupt injected at a
    // deterministic exit must reach the guest at exactly that point.
    let r = host_check::probe_interrupt_delivery(50).unwrap();
    assert_eq!(r.exact, r.rounds, "{r:?}");
}
