//! What the tools tell of a run in its outcome: the checkpoints taken,
//! what the tracing of a process did.

/// What the tools report of a run (the session puts it in its outcome).
#[derive(Debug, Default)]
pub(crate) struct ToolReport {
    pub(crate) checkpoints: Vec<CheckpointTaken>,
    pub(crate) expansion: Option<ExpansionStats>,
}

/// A checkpoint taken: where, and what it cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointTaken {
    pub exit: u64,
    pub guest_ns: u64,
    /// Pages stored (changed since the previous checkpoint).
    pub pages: u64,
    /// Size of the file.
    pub bytes: u64,
    /// Host time to take and store it.
    pub took_ns: u64,
}

/// Where the tracing of the process started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceStart {
    /// At the first exit after the process executed this program: its
    /// first page fault, or its first system call (what ran before it, the
    /// first instructions of the program or its dynamic loader, is
    /// untraced).
    Exec { exit: u64, path: String },
    /// At the first exit the process was on the CPU for in this replay
    /// (right after its fork, or where the replay started).
    OnCpu { exit: u64 },
    /// At the first exit after an event of the process named it (it
    /// executed the program before the replay started: what it ran
    /// before that exit is untraced).
    Named { exit: u64 },
}

/// What an expansion did.
#[derive(Clone, Debug, Default)]
pub struct ExpansionStats {
    /// The process traced, once found.
    pub pid: Option<u32>,
    /// Where its tracing started.
    pub start: Option<TraceStart>,
    /// Its threads that were stepped.
    pub threads: usize,
    pub instructions: u64,
    pub accesses: u64,
    /// Instructions whose bytes could not be read (on a page the process
    /// unmapped before its next step): counted, not logged.
    pub unreadable: u64,
    /// Instructions stepped in guest kernel mode (`kernel_steps`), and
    /// those admitted there that raised an exception or that KVM could
    /// not emulate, run in user mode instead.
    pub kernel_steps: u64,
    pub kernel_steps_refused: u64,
}
