//! Small traces for tests, here and in the crates above (feature
//! `test-support`).

/// A fresh path for a test trace.
pub fn temp_trace(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("insight-journal-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The header of a test trace.
pub fn header(digest_interval: u64) -> trace::Header {
    trace::Header {
        clock: trace::ClockKind::Exit,
        created_unix_secs: 0,
        guest_cpuid: vec![],
        kvm_caps: vec![],
        user_rdtsc_traps: false,
        host_apic_id: None,
        config: String::new(),
        images: vec![],
        boot: trace::BootParams {
            cmdline: String::new(),
            memory_mib: 16,
            rng_seed: vec![0; 32],
            archive: vec![],
            snapshot: None,
            wall_clock: None,
            net: None,
        },
        digest_interval,
        sample_period_ns: 0,
        chaos: None,
    }
}
