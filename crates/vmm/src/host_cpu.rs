//! The host CPU a recording's vCPU runs on.
//!
//! Where the host does not trap a guest's user-mode CPUID (`insight
//! host-check`), a program reads the initial APIC ID of whichever host
//! CPU it happens to run on, and glibc keeps it in memory at every start.
//! A memory compared at an asynchronous point would then differ between a
//! recording and a replay on different host CPUs (measured: a replay on
//! the other CPU of a two-CPU host missed such a point every time, one on
//! the recording's CPU found it every time). So a recording keeps its
//! vCPU on one host CPU and names it in the trace by its APIC ID, and a
//! replay runs on a CPU with the same ID.

use std::io;

use crate::sys;

/// A host CPU and the initial APIC ID it reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostCpu {
    pub cpu: usize,
    pub apic_id: u8,
}

/// The initial APIC ID the CPU the calling thread runs on reports
/// (CPUID.1:EBX[31:24]): what a guest's user-mode CPUID returns there on
/// hosts that do not trap it.
fn apic_id() -> u8 {
    (core::arch::x86_64::__cpuid(1).ebx >> 24) as u8
}

/// The host CPUs this process may run on, with their APIC IDs (a
/// short-lived thread visits each).
pub fn cpus() -> io::Result<Vec<HostCpu>> {
    let allowed = sys::allowed_cpus()?;
    std::thread::scope(|s| {
        s.spawn(|| {
            allowed
                .iter()
                .map(|&cpu| {
                    sys::pin_to_cpu(cpu)?;
                    Ok(HostCpu {
                        cpu,
                        apic_id: apic_id(),
                    })
                })
                .collect()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the thread visiting the CPUs panicked")))
    })
}

/// For a recording: the CPU the calling thread runs on now (the host's
/// scheduler chose it), else the first allowed one.
pub fn for_recording() -> io::Result<HostCpu> {
    let all = cpus()?;
    let now = sys::current_cpu();
    all.iter()
        .find(|c| Some(c.cpu) == now)
        .or_else(|| all.first())
        .copied()
        .ok_or_else(|| io::Error::other("this process may run on no CPU"))
}

/// For a replay: a CPU with APIC ID `apic_id`, if this host has one this
/// process may run on.
pub fn with_apic_id(apic_id: u8) -> io::Result<Option<HostCpu>> {
    Ok(cpus()?.into_iter().find(|c| c.apic_id == apic_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_allowed_cpu_is_visited_and_found_by_its_id() {
        let all = cpus().unwrap();
        assert!(!all.is_empty());
        for c in &all {
            let found = with_apic_id(c.apic_id).unwrap().unwrap();
            assert_eq!(found.apic_id, c.apic_id);
        }
        let mine = for_recording().unwrap();
        assert!(all.contains(&mine));
    }
}
