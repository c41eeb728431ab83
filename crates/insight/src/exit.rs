//! insight's exit statuses (besides the guest command's own, which `run`
//! and `record` pass through), and how an error reads on one line.

/// Exit status when insight itself fails (bad config, no KVM, the guest
/// crashed); guest command statuses pass through unchanged otherwise.
pub const EXIT_INSIGHT_ERROR: u8 = 125;

/// Exit status when the user stopped the VM from the terminal.
pub const EXIT_STOPPED_BY_USER: u8 = 130;

/// `replay` exit status when the guest did not do what was recorded.
pub const EXIT_DIVERGED: u8 = 1;

/// `replay` exit status when an incomplete trace's prefix replayed.
pub const EXIT_PREFIX_ONLY: u8 = 4;

/// Formats an error with its causes on one line.
pub fn error_chain(err: &anyhow::Error) -> String {
    err.chain()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(": ")
}
