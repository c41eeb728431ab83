//! `insight host-check`: what this host's KVM can do, the strategy
//! insight takes, and how fast guest user code runs here.

mod guest;

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use trace::ClockKind;
use vmm::host_check::{HostReport, Int3Behaviour, PvmProbe, SyscallBehaviour};

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn int3_text(b: &Int3Behaviour) -> String {
    match b {
        Int3Behaviour::Intercepted => "intercepted by the VMM".into(),
        Int3Behaviour::GuestHandler => "goes to the guest's #BP handler".into(),
        Int3Behaviour::NotEmulated => "not emulated by KVM; insight injects #BP itself".into(),
        Int3Behaviour::Unknown(what) => format!("unexpected: {what}"),
    }
}

#[derive(Args, Debug)]
pub struct HostCheckArgs {
    /// Skip the guest measurement (the built-in guest image runs six
    /// times: about half a minute, and half a minute more for each of
    /// its two command lines the first time)
    #[arg(long)]
    pub no_guest: bool,
}

/// The guest measurement's lines.
fn pvm_probe_text(p: &PvmProbe) -> String {
    match p {
        PvmProbe::Answered => "answered".to_string(),
        PvmProbe::Faulted(vector) => format!("exception {vector}"),
        PvmProbe::Unknown(what) => format!("unexpected: {what}"),
    }
}

fn print_guest_speed(args: &HostCheckArgs) {
    if args.no_guest {
        println!("guest user code: not measured (--no-guest)");
        return;
    }
    let s = match guest::measure(|line| eprintln!("insight: {line}")) {
        Ok(s) => s,
        Err(e) => {
            println!("guest user code: not measured ({e:#})");
            return;
        }
    };
    let rate = |run: &guest::TickCount| match guest::GuestSpeed::rate(run) {
        Some(r) => format!("{r:.0} interrupts a second"),
        None => "not counted (no timer line in the guest's /proc/interrupts)".into(),
    };
    println!(
        "guest user code (the image's tick_count, {} rounds, best of {})",
        s.rounds,
        guest::RUNS
    );
    println!(
        "  speed against native:            {:.2}x ({:.2} s in the guest, {:.2} s natively)",
        s.speed(&s.guest),
        s.guest.ns as f64 / 1e9,
        s.native.ns as f64 / 1e9
    );
    println!(
        "  guest timer, one busy task:      {} (the guest kernel stops its tick)",
        rate(&s.guest)
    );
    println!(
        "  with the periodic tick:          {:.2}x native, {} (nohz=off)",
        s.speed(&s.periodic),
        rate(&s.periodic)
    );
    match s.tick_cost() {
        Some(cost) => println!(
            "  one tick costs the program:      {:.2} ms (the periodic run's extra time per extra interrupt)",
            cost * 1e3
        ),
        None => println!(
            "  one tick costs the program:      not measurable (the periodic run was no longer: host noise)"
        ),
    }
}

pub fn host_check(args: HostCheckArgs) -> Result<ExitCode> {
    let r = HostReport::measure()?;
    let syscall = match &r.syscall {
        SyscallBehaviour::EntersKernel => "enters ring 0 (architectural)".to_string(),
        SyscallBehaviour::StaysInUserMode => {
            "stays in ring 3 -> guest kernel uses its page-fault syscall trap".to_string()
        }
        SyscallBehaviour::Unknown(what) => format!("unexpected: {what}"),
    };
    let pmu = match &r.pmu.host_branch_counter {
        Ok(()) => "available".to_string(),
        Err(e) => format!("not available ({e})"),
    };
    println!("insight host check");
    println!("  user-mode SYSCALL:               {syscall}");
    println!(
        "  user-mode port I/O exits:        {}",
        yes_no(r.user_port_io)
    );
    println!(
        "  int3 in kernel mode:             {}",
        int3_text(&r.int3_kernel)
    );
    println!(
        "  int3 in user mode:               {}",
        int3_text(&r.int3_user)
    );
    println!(
        "  hardware breakpoint, kernel:     {}",
        yes_no(r.hw_breakpoint_kernel)
    );
    println!(
        "  hardware breakpoint, user:       {}",
        yes_no(r.hw_breakpoint_user)
    );
    println!(
        "  single-step, kernel:             {}",
        yes_no(r.single_step_kernel)
    );
    println!(
        "  single-step, user:               {}",
        yes_no(r.single_step_user)
    );
    println!("  CR4.TSD traps user RDTSC:        {}", yes_no(r.user_tsd));
    println!(
        "  user-mode XCR0 (guest set 0x3):   {:#x}{}",
        r.user_xcr0,
        if r.user_xcr0 == 3 {
            ""
        } else {
            " (host's: the VMM completes XSAVE/XRSTOR for the guest kernel)"
        }
    );
    println!(
        "  interrupt at exit, delivered:    {}",
        if r.delivery.exact == r.delivery.rounds {
            format!(
                "before the next instruction ({} of {})",
                r.delivery.exact, r.delivery.rounds
            )
        } else {
            format!(
                "late in {} of {} tries (up to {} instructions): recordings are not exact here",
                r.delivery.rounds - r.delivery.exact,
                r.delivery.rounds,
                r.delivery.max_late
            )
        }
    );
    let m = &r.state_match;
    println!(
        "  user code stopped by a kick:     {}",
        if m.kick_delivers_in_place {
            "an interrupt injected there arrives at that instruction"
        } else {
            "the interrupt arrives elsewhere"
        }
    );
    println!(
        "  replay trampoline:               {}",
        if m.trampoline_found_state && m.redirected_delivery {
            format!(
                "found the state after {} passes in {:.1} ms ({:.1} ns a pass), delivered there",
                m.rejected,
                m.search_ns as f64 / 1e6,
                m.search_ns as f64 / m.rejected.max(1) as f64
            )
        } else {
            format!(
                "did not work ({})",
                m.failure.as_deref().unwrap_or("wrong state or delivery")
            )
        }
    );
    let k = &r.kernel_steps;
    println!(
        "  user code stepped in kernel mode: {}",
        match k.differences.first() {
            None => format!(
                "runs as in user mode ({} steps, one instruction each)",
                k.steps
            ),
            Some(first) => format!("differs from user mode: {first}"),
        }
    );
    let pvm = &r.pvm_guest_abi;
    println!(
        "  PVM guest ABI:                   {} (KVM's PVM signature: {}; MSR_PVM_LINEAR_ADDRESS_RANGE: {}; synthetic CPUID: {})",
        if pvm.present() {
            "offered: a PVM-enlightened guest kernel could run natively"
        } else {
            "not offered: a PVM-enlightened guest kernel would be interpreted like any other"
        },
        yes_no(pvm.kvm_signature),
        pvm_probe_text(&pvm.linear_range_msr),
        pvm_probe_text(&pvm.synthetic_cpuid)
    );
    println!("  host branch counter (PMU):       {pmu}");
    println!(
        "  PMU counters offered to guests:  {}",
        r.pmu.guest_counters
    );
    println!("strategy");
    match r.clock() {
        ClockKind::Branch => {
            println!("  clock: branch (guest retired branches, exact positions anywhere)")
        }
        ClockKind::Exit => println!(
            "  clock: exit (no usable PMU: asynchronous events land at deterministic VM exits, \
             or at logged user-mode states, below)"
        ),
    }
    if r.state_match.works() {
        println!(
            "  preemption: user code that runs 2 ms without an exit is interrupted where it \
             stands; its state is logged and found again at replay"
        );
    } else {
        println!(
            "  preemption: only at deterministic exits (a busy-waiting program may not finish \
             while recording)"
        );
    }
    if r.kernel_steps.differences.is_empty() {
        println!(
            "  tracing (replay --trace-process): most user instructions stepped in guest kernel \
             mode, without a debug exception each"
        );
    } else {
        println!(
            "  tracing (replay --trace-process): every user instruction a debug exception (its \
             kernel-mode steps differ here)"
        );
    }
    println!(
        "  probes: int3 handled by the guest kernel, forwarded to the VMM with a deterministic \
         exit{}",
        if r.int3_user == Int3Behaviour::Intercepted {
            " (this host could intercept int3 itself; insight does not use that)"
        } else {
            ""
        }
    );
    if r.user_tsd {
        println!(
            "  user-mode RDTSC: faults, and the guest kernel answers it from the replayed clock"
        );
    } else {
        println!(
            "  user-mode RDTSC cannot be trapped here, so the guest kernel cannot emulate it: \
             a program that reads the TSC (or RDRAND) directly is not replayed faithfully \
             (busybox and the guest image do not; glibc's dynamic loader reads it once at \
             start for statistics nothing reads)"
        );
    }
    if r.can_run() {
        print_guest_speed(&args);
        println!("insight can run on this host.");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("insight cannot run on this host: the SYSCALL behaviour is not one it knows.");
        Ok(ExitCode::from(1))
    }
}
