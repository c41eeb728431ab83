//! Whether user code can be preempted where it stands and the state found
//! again at replay (asynchronous points), with the check guest.

use kvm_ioctls::{Kvm, VcpuExit};
use vm_memory::{Bytes, GuestAddress};

use super::check_vm::*;
use crate::kvm_ext;
use journal::preempt;

/// What the state-matched preemption of user code rests on, measured with
/// a check guest whose user code loops without ever exiting
/// (`add rax, imm32; inc rbx; jmp`):
/// - recording: a kick out of KVM_RUN stops the vCPU in user mode, and an
///   interrupt injected there reaches the guest at exactly that RIP;
/// - replay: in a fresh run of the same guest, a trampoline patched over
///   the loop compares the registers natively on every iteration and
///   exits through an MMIO store once they equal the recorded ones; the
///   VMM then completes the store, moves RIP back to the target and
///   injects the interrupt there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateMatchReport {
    /// An interrupt injected at a user-mode kick arrived at the kicked
    /// RIP with the kicked registers.
    pub kick_delivers_in_place: bool,
    /// The trampoline's exit came with the recorded registers.
    pub trampoline_found_state: bool,
    /// The interrupt injected after redirecting RIP arrived at the target.
    pub redirected_delivery: bool,
    /// Loop iterations the trampoline rejected before the match.
    pub rejected: u64,
    /// Wall time of that search, in nanoseconds.
    pub search_ns: u64,
    /// Whether the host reports the exit's RIP past the store (else at it).
    pub exit_rip_after_store: bool,
    /// Why the check stopped short, if it did.
    pub failure: Option<String>,
}

impl StateMatchReport {
    /// Whether recording may preempt user code where it stands.
    pub fn works(&self) -> bool {
        self.kick_delivers_in_place && self.trampoline_found_state && self.redirected_delivery
    }
}

/// Where the check's stub lives, and the MMIO page it exits through.
const STUB_PAGES: preempt::trampoline::StubPages = preempt::trampoline::StubPages {
    code: 0xc000,
    data: 0xd000,
    exit: 0x40_0000,
};
/// The check loop: add rax, 0x01234567; inc rbx; jmp back.
const LOOP_CODE: [u8; 11] = [
    0x48, 0x05, 0x67, 0x45, 0x23, 0x01, 0x48, 0xff, 0xc3, 0xeb, 0xf5,
];
const VECTOR: u8 = 31;

/// Kernel code entering USER_CODE with interrupts enabled.
fn enter_user_code_interruptible() -> Vec<u8> {
    let mut c = enter_user_code();
    // The pushed RFLAGS immediate sits after push ss (2) and push rsp (5).
    let flags_at = 2 + 5 + 1;
    c[flags_at..flags_at + 4].copy_from_slice(&0x3202u32.to_le_bytes());
    c
}

impl CheckVm {
    fn looping(kvm: &Kvm) -> Result<Self, HostCheckError> {
        let vm = CheckVm::new(
            kvm,
            &enter_user_code_interruptible(),
            &LOOP_CODE,
            &marker_code(M_LSTAR),
            false,
        )?;
        // A 2 MiB page past the end of RAM: stores there are MMIO exits.
        vm._mem
            .write_obj(STUB_PAGES.exit | 0x87, GuestAddress(PD + 16))
            .map_err(|e| HostCheckError::Memory(e.to_string()))?;
        Ok(vm)
    }

    fn inject(&self, vector: u8) -> Result<(), HostCheckError> {
        kvm_ext::inject_interrupt(&self.vcpu, vector).map_err(|e| HostCheckError::Kvm {
            op: "INTERRUPT",
            source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EINVAL)),
        })
    }

    /// After an injection: the RIP and RBX the interrupt found, from the
    /// handler's frame and registers.
    fn delivered(&mut self) -> Result<Option<(u64, u64)>, HostCheckError> {
        if self.next_event()?
            != (CheckVmExit::Marker {
                marker: M_VECTOR | VECTOR,
                cpl: 0,
            })
        {
            return Ok(None);
        }
        let rip: u64 = self
            ._mem
            .read_obj(GuestAddress(KERNEL_STACK - 40))
            .map_err(|e| HostCheckError::Memory(e.to_string()))?;
        let rbx = self.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?.rbx;
        Ok(Some((rip, rbx)))
    }
}

/// Runs `f` with the check VM on a thread of its own, kicking it out of
/// KVM_RUN every `period` until `f` returns.
fn kicked<R: Send + 'static>(
    vm: CheckVm,
    period: std::time::Duration,
    f: impl FnOnce(CheckVm) -> Result<R, HostCheckError> + Send + 'static,
) -> Result<R, HostCheckError> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};
    extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}
    register_signal_handler(SIGRTMIN(), on_kick).map_err(kvm_err("signal handler"))?;
    let done = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&done);
    let handle = std::thread::Builder::new()
        .name("probe-vcpu".into())
        .spawn(move || {
            let r = f(vm);
            flag.store(true, Ordering::Release);
            r
        })
        .map_err(|e| HostCheckError::Memory(format!("cannot start a probe thread: {e}")))?;
    while !done.load(Ordering::Acquire) {
        std::thread::sleep(period);
        let _ = handle.kill(SIGRTMIN());
    }
    handle
        .join()
        .unwrap_or_else(|_| Err(HostCheckError::Memory("the probe thread panicked".into())))
}

pub fn check_state_match() -> Result<StateMatchReport, HostCheckError> {
    let kvm = open_kvm()?;
    let mut report = StateMatchReport {
        kick_delivers_in_place: false,
        trampoline_found_state: false,
        redirected_delivery: false,
        rejected: 0,
        search_ns: 0,
        exit_rip_after_store: false,
        failure: None,
    };
    // Recording: kick until the vCPU stops in the user-mode loop, and
    // inject there.
    let recorded = kicked(
        CheckVm::looping(&kvm)?,
        std::time::Duration::from_millis(3),
        |mut vm| {
            for _ in 0..500 {
                match vm.vcpu.run() {
                    Err(e) if e.errno() == libc::EINTR => {}
                    Ok(VcpuExit::IoOut(..)) | Ok(VcpuExit::IrqWindowOpen) => continue,
                    _ => return Ok(None),
                }
                let regs = vm.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
                let run = vm.vcpu.get_kvm_run();
                let ready = run.ready_for_interrupt_injection != 0 && run.if_flag != 0;
                let in_loop = (USER_CODE..USER_CODE + LOOP_CODE.len() as u64).contains(&regs.rip);
                if !in_loop || vm.cpl() != 3 || !ready || regs.rbx == 0 {
                    continue;
                }
                vm.inject(VECTOR)?;
                return Ok(Some((regs, vm.delivered()?)));
            }
            Ok(None)
        },
    )?;
    let Some((target, delivered)) = recorded else {
        report.failure = Some("no kick stopped the loop at its head".into());
        return Ok(report);
    };
    report.kick_delivers_in_place = delivered == Some((target.rip, target.rbx));

    // Replay: a fresh run, the target patched to the trampoline.
    let mut vm = CheckVm::looping(&kvm)?;
    let at = (target.rip - USER_CODE) as usize;
    let site = preempt::site::choose(target.rip, &LOOP_CODE[at..], &LOOP_CODE[..at])
        .map_err(|e| HostCheckError::Memory(format!("the loop cannot be patched: {e}")))?;
    let stub = preempt::trampoline::build(
        STUB_PAGES,
        &[],
        |ip| {
            site.relocated(ip)
                .map_err(preempt::trampoline::StubError::Relocation)
        },
        site.resume(),
    )
    .map_err(|e| HostCheckError::Memory(e.to_string()))?;
    let patch = preempt::trampoline::patch(target.rip, STUB_PAGES.code, site.len)
        .map_err(|e| HostCheckError::Memory(e.to_string()))?;
    let w = |vm: &CheckVm, addr: u64, bytes: &[u8]| {
        vm._mem
            .write_slice(bytes, GuestAddress(addr))
            .map_err(|e| HostCheckError::Memory(e.to_string()))
    };
    w(&vm, STUB_PAGES.code, &stub.code)?;
    w(
        &vm,
        STUB_PAGES.data,
        &preempt::trampoline::data_page(&target, &[]),
    )?;
    // What the patch covers, to put back (the site may reach past the
    // loop's code, where the page holds what it held).
    let mut covered = vec![0u8; patch.len()];
    vm._mem
        .read_slice(&mut covered, GuestAddress(target.rip))
        .map_err(|e| HostCheckError::Memory(e.to_string()))?;
    w(&vm, target.rip, &patch)?;
    let started = std::time::Instant::now();
    let exited = loop {
        match vm.vcpu.run() {
            Ok(VcpuExit::MmioWrite(addr, _)) => break addr == STUB_PAGES.exit,
            Ok(VcpuExit::IoOut(..)) | Ok(VcpuExit::IrqWindowOpen) => continue,
            Err(e) if e.errno() == libc::EINTR => continue,
            _ => break false,
        }
    };
    report.search_ns = started.elapsed().as_nanos() as u64;
    if !exited {
        report.failure = Some("the trampoline never exited".into());
        return Ok(report);
    }
    let at_exit = vm.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
    report.rejected = at_exit.rbx;
    report.trampoline_found_state = at_exit.rax == target.rax
        && at_exit.rbx == target.rbx
        && at_exit.rsp == target.rsp
        && (at_exit.rflags & 0x8d5) == (target.rflags & 0x8d5);
    report.exit_rip_after_store = at_exit.rip == STUB_PAGES.code + stub.exit_end;
    // Complete the store without running the guest on, then deliver at
    // the target with the original code back in place.
    vm.vcpu.set_kvm_immediate_exit(1);
    let completed = vm.vcpu.run().err().map(|e| e.errno());
    vm.vcpu.set_kvm_immediate_exit(0);
    if completed != Some(libc::EINTR) {
        report.failure = Some(format!("completing the exit: {completed:?}"));
        return Ok(report);
    }
    w(&vm, target.rip, &covered)?;
    let mut regs = vm.vcpu.get_regs().map_err(kvm_err("GET_REGS"))?;
    regs.rip = target.rip;
    vm.vcpu.set_regs(&regs).map_err(kvm_err("SET_REGS"))?;
    vm.inject(VECTOR)?;
    report.redirected_delivery = vm.delivered()? == Some((target.rip, target.rbx));
    Ok(report)
}
