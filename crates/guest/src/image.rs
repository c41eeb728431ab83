//! Where the built guest image lives, and the kernel command line insight
//! boots it with.

use std::path::{Path, PathBuf};

/// The cache directory `tools/build-guest` writes to.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("INSIGHT_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("insight");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/insight")
}

/// The default guest kernel and initramfs (links to the last build).
pub fn default_kernel() -> PathBuf {
    cache_dir().join("default/vmlinux")
}

pub fn default_initramfs() -> PathBuf {
    cache_dir().join("default/initramfs.cpio")
}

/// How this host's KVM makes the guest kernel behave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestQuirks {
    /// SYSCALL from user mode does not enter ring 0: the guest kernel must
    /// take system calls through its page-fault trap.
    pub syscall_trap: bool,
}

/// The command line insight boots the guest with, before the user's
/// additions. Every flag is there for a reason:
/// - `noapic nolapic`: interrupts come from the user-space 8259 PIC;
/// - `clearcpuid=`: `tsc`: no TSC (not trappable, not replayable), the
///   kernel keeps time with the paravirtual clock; `rdrand,rdseed`: KVM
///   shows them to the kernel whatever CPUID says, and their values would
///   reach the random pool without a VM exit, so replay could not repeat
///   them; `erms,fsrm`: string
///   operations by qword, 8x fewer emulated iterations; `xsaveopt,xsavec,
///   xsaves`: only the standard-format XSAVE/XRSTOR the VMM completes (KVM
///   shows these to the kernel whatever CPUID says); the others are
///   instructions the host's emulator cannot run in ring 0;
/// - `lpj=`: skips delay-loop calibration;
/// - `io_delay=none`: no port 0x80 writes for I/O delays;
/// - `insight.platform`: power-off and panic reach the control port;
/// - `virtio_net.napi_weight=8`: the receive softirq polls at most 8
///   frames before it looks at the time. On these hosts each frame costs
///   milliseconds of interpreted kernel; with the default 64, one poll ran
///   so long that the program reading the socket never got the CPU before
///   its buffer overflowed, and a recording lost datagrams a plain run
///   received (docs/BENCHMARKS.md, "Network"). The guest kernel also gives
///   a deterministic point after every received frame (patch 0007), so
///   that under the exit clock a due tick arrives there and time passes;
/// - `insight.probes`, only for a run with the probe library: a
///   deterministic point after each context switch to a user task (patch
///   0032), so that a tick due during the switch is delivered before the
///   task's first probe event rather than at its first clock read, and
///   lock hold times start where the program started them. Runs without
///   probes keep their exits and so their schedules (a chaos seed's).
pub fn kernel_cmdline(quirks: GuestQuirks, probes: bool, quiet: bool, extra: &str) -> String {
    let mut parts = vec![
        "console=ttyS0",
        "noapic",
        "nolapic",
        "clearcpuid=smap,popcnt,ssse3,rdpid,tsc,rdrand,rdseed,erms,fsrm,xsaveopt,xsavec,xsaves",
        "nofsgsbase",
        "noinvpcid",
        "mitigations=off",
        "lpj=5000",
        "io_delay=none",
        "panic=-1",
        "insight.platform",
        // User-mode RDTSC/RDTSCP answered by the kernel's (replayed) clock
        // where the host honours CR4.TSD; a no-op where it does not.
        "insight.rdtsc=emulate",
        "virtio_net.napi_weight=8",
    ];
    if quirks.syscall_trap {
        parts.push("insight.syscall=pf");
    }
    if probes {
        parts.push("insight.probes");
    }
    if quiet {
        // Errors and above only: panics and oopses still show, the noise
        // of a host without a PMU does not.
        parts.push("quiet loglevel=3");
    }
    let extra = extra.trim();
    if !extra.is_empty() {
        parts.push(extra);
    }
    parts.join(" ")
}

/// Whether `path` exists, for a friendly message before trying to boot.
pub fn require(path: &Path, what: &str) -> Result<(), String> {
    if path.exists() {
        Ok(())
    } else {
        Err(format!(
            "no {what} at {}: build the guest image with tools/build-guest, or name one in the config",
            path.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_carries_quirks_and_user_text_last() {
        let c = kernel_cmdline(
            GuestQuirks { syscall_trap: true },
            true,
            true,
            " loglevel=7 ",
        );
        assert!(c.starts_with("console=ttyS0 "));
        assert!(c.contains(" insight.syscall=pf "));
        assert!(c.contains(" insight.probes "));
        assert!(c.ends_with(" quiet loglevel=3 loglevel=7"));
        let c = kernel_cmdline(
            GuestQuirks {
                syscall_trap: false,
            },
            false,
            false,
            "",
        );
        assert!(!c.contains("insight.syscall"));
        assert!(!c.contains("insight.probes"));
        assert!(!c.contains("quiet"));
    }
}
