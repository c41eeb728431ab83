//! insight's exit statuses (besides the guest command's own, which `run`
//! and `record` pass through), and how an error reads on one line.

/// Exit status when insight itself fails (bad config, no KVM, the guest
/// crashed); guest command statuses pass through unchanged otherwise.
pub const EXIT_INSIGHT_ERROR: u8 = 125;

/// Exit status when the user stopped the VM from the terminal.
pub const EXIT_STOPPED_BY_USER: u8 = 130;

/// `record` exit status when the command made no progress for `--timeout`
/// (a hang), as timeout(1)'s.
pub const EXIT_HUNG: u8 = 124;

/// `replay` exit status when the guest did not do what was recorded.
pub const EXIT_DIVERGED: u8 = 1;

/// `replay` exit status when an incomplete trace's prefix replayed.
pub const EXIT_PREFIX_ONLY: u8 = 4;

/// Exit status when a trace or an event database is damaged: stored
/// bytes fail their checksum, or its sizes and counts contradict each
/// other (distinct from an incomplete trace, which is not an error).
pub const EXIT_DAMAGED: u8 = 3;

/// The exit status for an error: [`EXIT_DAMAGED`] when a damaged trace or
/// database caused it, [`EXIT_INSIGHT_ERROR`] otherwise.
pub fn status_of(err: &anyhow::Error) -> u8 {
    let damaged = err.chain().any(|e| {
        e.downcast_ref::<trace::TraceError>()
            .is_some_and(trace::TraceError::is_damage)
            // A checkpoint's error passes through the VM's and the
            // builder's transparently.
            || e.downcast_ref::<vmm::VmError>()
                .is_some_and(vmm::VmError::is_damage)
            || e.downcast_ref::<vmm::builder::BuildError>()
                .is_some_and(vmm::builder::BuildError::is_damage)
            || matches!(
                e.downcast_ref::<events::db::DbError>(),
                Some(events::db::DbError::Corrupt { .. })
            )
    });
    if damaged {
        EXIT_DAMAGED
    } else {
        EXIT_INSIGHT_ERROR
    }
}

/// Formats an error with its causes on one line.
pub fn error_chain(err: &anyhow::Error) -> String {
    err.chain()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(": ")
}

/// Whether the file system was full: ENOSPC from any file operation, or
/// SQLite's SQLITE_FULL.
pub fn disk_full(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        matches!(
            e.downcast_ref::<events::db::DbError>(),
            Some(events::db::DbError::DiskFull(_))
        ) || e
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::StorageFull)
    })
}

/// The one line an error is reported as: its causes, and "disk full"
/// first when the disk was, whichever library said it.
pub fn message(err: &anyhow::Error) -> String {
    let chain = error_chain(err);
    if disk_full(err) && !chain.contains("disk full") {
        format!("disk full: {chain}")
    } else {
        chain
    }
}
