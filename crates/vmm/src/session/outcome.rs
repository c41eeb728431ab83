//! What a run came to: why the guest stopped and the counts of every part
//! of the machine and the session.

use std::time::Duration;

use devices::virtio_blk::BlockStats;
use devices::virtio_net::NetStats;
use devices::PlatformStats;
use events::capture::CaptureSummary;
use journal::{EndReason, Progress};

use crate::boot_snapshot::SnapshotTaken;
use crate::points::PointCounts;
use crate::tools::{CheckpointTaken, ExpansionStats};
use crate::vm::ExitCounts;

/// Why the guest stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `/init` reported the guest command's exit status (after syncing):
    /// the run is over, nothing the guest does later can matter.
    CommandExited,
    /// The guest kernel powered off.
    PowerOff,
    /// Replay reached the point where the recording ended for a reason
    /// outside the guest (the user stopped it, the recorder failed).
    RecordingEnded(EndReason),
    /// Replay of an incomplete trace reached the end of its log.
    TraceEnded,
    /// Replay reached the end of the window it was asked for.
    WindowEnded,
    /// `/init` was ready and the boot snapshot asked for is written.
    SnapshotTaken,
    /// A debugger's stop: the replay goes on when resumed.
    Debug,
}

/// The result of a guest run that ended by the guest's own choice.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub stop: StopReason,
    /// Status of the guest command, if `/init` reported one.
    pub exit_status: Option<u8>,
    /// VM time at which user space `/init` started.
    pub init_reached: Option<Duration>,
    /// VM time at the end.
    pub elapsed: Duration,
    pub exits: ExitCounts,
    pub platform: PlatformStats,
    /// Deterministic exits, log entries, guest time, trace size.
    pub journal: Progress,
    /// The virtio disk's counts, if the guest has one.
    pub disk: Option<BlockStats>,
    /// The network device's counts, if the guest has one.
    pub net: Option<NetReport>,
    /// The finished trace, when recording.
    pub trace: Option<trace::Summary>,
    /// What the event capture stored, when replaying with one.
    pub events: Option<CaptureSummary>,
    /// Asynchronous points taken or reached, sample marks logged or
    /// sampled at (recording, replay).
    pub points: PointCounts,
    /// Checkpoints taken (replay).
    pub checkpoints: Vec<CheckpointTaken>,
    /// The boot snapshot taken (a plain run asked for one).
    pub boot_snapshot: Option<SnapshotTaken>,
    /// What the tracing of a process did (replay).
    pub expansion: Option<ExpansionStats>,
}

/// How the network device fared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetReport {
    pub stats: NetStats,
    /// Why the TAP device stopped working, if it did.
    pub failure: Option<String>,
}
