//! Capture at replay: each event the guest raises, validated, tracked and
//! stored in the event database.
//!
//! The hypervisor hands over the kernel's identification of the raiser
//! and the buffer bytes it could read (or why it could not). Problems are
//! counted per kind with an example, stored in the database's `anomalies`
//! table, and never stop the replay.

use std::collections::{BTreeMap, HashSet};

use crate::abi::{self, Kind, Payload, RawEvent, SampleMode, Source};
use crate::db::{DbError, EventWriter, ProbeRow, ProbeValue, Row};

/// The lowest user address Linux lets a process map (`vm.mmap_min_addr`'s
/// default).
pub const USER_CODE_MIN: u64 = 0x1_0000;
/// The end of the user half of a 48-bit address space.
pub const USER_CODE_END: u64 = 1 << 47;
/// Why the hypervisor could not read an event buffer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BufferError {
    #[error("buffer at {0:#x} is not mapped")]
    Unmapped(u64),
    #[error("a probe's buffer at {0:#x} is not a user address")]
    NotUser(u64),
    #[error("event of {size} bytes at {gva:#x} crosses a page boundary")]
    CrossesPage { gva: u64, size: u64 },
}

/// What the capture saw, for the user.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaptureSummary {
    pub events: u64,
    /// Per kind, in kind order.
    pub per_kind: Vec<(Kind, u64)>,
    /// (what, count, an example).
    pub anomalies: Vec<(String, u64, String)>,
}

/// An event the capture stored: its sequence number, the process that
/// raised it, and what it said.
pub struct Stored {
    pub seq: u64,
    pub pid: u32,
    pub event: RawEvent,
}

/// What a checkpoint keeps of a capture, so that a replay restored there
/// goes on capturing as if it had run from boot: the next sequence number,
/// the threads tracked and the one on the CPU, the time reached, and the
/// thread names and loaded objects seen so far (written again into the
/// new database, which the reports need to name threads and symbolize).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CaptureState {
    pub next_seq: u64,
    pub tracked: Vec<u32>,
    pub current: Option<(u32, u32)>,
    pub last_time: u64,
    /// (pid, lwpid, comm, sequence number of its first event).
    pub threads: Vec<(u32, u32, String, u64)>,
    /// (pid, base, path, sequence number of its SYMBOL event).
    pub objects: Vec<(u32, u64, String, u64)>,
}

/// Turns raised events into database rows.
pub struct Capture {
    db: EventWriter,
    per_kind: BTreeMap<Kind, u64>,
    anomalies: BTreeMap<&'static str, (u64, String)>,
    /// Threads of processes that use the probes (the paper's
    /// `tracked_lwpids`): SAMPLE events are taken only for them.
    tracked: HashSet<u32>,
    /// The task on the CPU, (pid, lwpid), from the last CONTEXTSWITCH.
    current: Option<(u32, u32)>,
    last_time: u64,
    named: HashSet<(u32, u32)>,
    /// What `state` reports of thread names and objects.
    threads: Vec<(u32, u32, String, u64)>,
    objects: Vec<(u32, u64, String, u64)>,
    /// The last event to store, (kind, of this thread or any): a window
    /// ending at an event holds nothing after it.
    end: Option<(Kind, Option<u32>)>,
    /// That event has been stored.
    ended: bool,
}

impl Capture {
    pub fn new(db: EventWriter) -> Self {
        Capture {
            db,
            per_kind: BTreeMap::new(),
            anomalies: BTreeMap::new(),
            tracked: HashSet::new(),
            current: None,
            last_time: 0,
            named: HashSet::new(),
            threads: Vec::new(),
            objects: Vec::new(),
            end: None,
            ended: false,
        }
    }

    /// Stores nothing after the first event of `kind` (raised by thread
    /// `lwpid`, or by any): the end of a window at that event.
    pub fn end_after(&mut self, kind: Kind, lwpid: Option<u32>) {
        self.end = Some((kind, lwpid));
    }

    /// Whether the event the window ends at has been stored.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The capture's state, for a checkpoint.
    pub fn state(&self) -> CaptureState {
        let mut tracked: Vec<u32> = self.tracked.iter().copied().collect();
        tracked.sort_unstable();
        CaptureState {
            next_seq: self.db.next_seq(),
            tracked,
            current: self.current,
            last_time: self.last_time,
            threads: self.threads.clone(),
            objects: self.objects.clone(),
        }
    }

    /// Goes on from a checkpoint's `state` (before any event is captured):
    /// the database starts at its sequence number and gets its thread
    /// names and objects. The counts and anomalies are this database's.
    pub fn resume(&mut self, state: &CaptureState) -> Result<(), DbError> {
        self.db.start_at(state.next_seq)?;
        self.tracked = state.tracked.iter().copied().collect();
        self.current = state.current;
        self.last_time = state.last_time;
        for (pid, lwpid, comm, seq) in &state.threads {
            self.named.insert((*pid, *lwpid));
            self.db.thread(*pid, *lwpid, comm, *seq)?;
        }
        for (pid, base, path, seq) in &state.objects {
            self.db.object(*pid, *base, path, *seq)?;
        }
        self.threads = state.threads.clone();
        self.objects = state.objects.clone();
        Ok(())
    }

    /// The task on the CPU as (pid, lwpid), from the last CONTEXTSWITCH.
    pub fn current(&self) -> Option<(u32, u32)> {
        self.current
    }

    pub fn current_lwpid(&self) -> Option<u32> {
        self.current.map(|(_, lwpid)| lwpid)
    }

    /// The name (comm) a process's threads raised their first events
    /// under, if any has.
    pub fn comm_of(&self, pid: u32) -> Option<&str> {
        self.threads
            .iter()
            .find(|t| t.0 == pid)
            .map(|t| t.2.as_str())
    }

    pub fn is_tracked(&self, lwpid: u32) -> bool {
        self.tracked.contains(&lwpid)
    }

    fn anomaly(&mut self, what: &'static str, example: String) {
        let entry = self.anomalies.entry(what).or_insert((0, example));
        entry.0 += 1;
    }

    /// One raised event: `time` in ns of the recording, `raiser` the
    /// (pid, lwpid) the guest kernel says raised it (`None`: unknown, the
    /// buffer's word is taken), `buffer` what could be read. Returns the
    /// event stored, if it was one; only database failures are errors.
    pub fn raised(
        &mut self,
        time: u64,
        source: Source,
        raiser: Option<(u32, u32)>,
        buffer: Result<&[u8], BufferError>,
    ) -> Result<Option<Stored>, DbError> {
        if self.ended {
            return Ok(None);
        }
        let lwpid = raiser.map_or(0, |(_, lwpid)| lwpid);
        let bytes = match buffer {
            Ok(b) => b,
            Err(e) => {
                let what = match e {
                    BufferError::Unmapped(_) => "event buffer not mapped",
                    BufferError::NotUser(_) => "probe buffer outside user memory",
                    BufferError::CrossesPage { .. } => "event buffer crosses a page boundary",
                };
                self.anomaly(what, format!("lwpid {lwpid}: {e}"));
                return Ok(None);
            }
        };
        let time = self.advance(time);
        let event = match abi::parse(bytes, bytes.len()) {
            Ok(e) => e,
            Err(e) => {
                let what = match e {
                    abi::AbiError::UnknownKind(_) | abi::AbiError::HostKind(_) => {
                        "unknown event kind"
                    }
                    abi::AbiError::BadMagic(_) | abi::AbiError::Version(_) => {
                        "not an event (bad magic or version)"
                    }
                    abi::AbiError::Size { .. } => "event size out of bounds",
                    abi::AbiError::BadPath => "bad SYMBOL path",
                    abi::AbiError::BadHeapFunction(_) => "unknown allocation function",
                };
                self.anomaly(what, format!("lwpid {lwpid}: {e}"));
                return Ok(None);
            }
        };
        let Some((pid, lwpid)) = raiser else {
            let (pid, lwpid) = (event.pid, event.lwpid);
            return self.store(time, source, pid, lwpid, event).map(Some);
        };
        if source == Source::Probe && (event.pid, event.lwpid) != (pid, lwpid) {
            self.anomaly(
                "buffer names another thread",
                format!(
                    "lwpid {lwpid} (pid {pid}) raised an event naming lwpid {} (pid {})",
                    event.lwpid, event.pid
                ),
            );
        }
        self.store(time, source, pid, lwpid, event).map(Some)
    }

    fn store(
        &mut self,
        time: u64,
        source: Source,
        pid: u32,
        lwpid: u32,
        e: RawEvent,
    ) -> Result<Stored, DbError> {
        let kind = e.kind;
        let (addr, caller, value) = match &e.payload {
            Payload::Lock {
                lock,
                caller,
                result,
            } => {
                let has_result = matches!(
                    kind,
                    Kind::LockRet | Kind::TryLockRet | Kind::TimedLockRet | Kind::LockInit
                );
                (
                    Some(*lock),
                    Some(*caller),
                    has_result.then_some(i64::from(*result)),
                )
            }
            Payload::ThreadCreate {
                parent_lwpid,
                creator_events,
                start_routine,
            } => (
                Some(*start_routine),
                Some(u64::from(*creator_events)),
                Some(i64::from(*parent_lwpid)),
            ),
            Payload::ThreadSpawn {
                start_routine,
                caller,
            } => (Some(*start_routine), Some(*caller), None),
            Payload::ThreadJoin { joined_lwpid } => (None, None, Some(i64::from(*joined_lwpid))),
            Payload::Fork { parent_pid } => (None, None, Some(i64::from(*parent_pid))),
            Payload::Exit { status } => (None, None, Some(i64::from(*status))),
            Payload::Symbol { base, .. } => (Some(*base), None, None),
            Payload::Heap {
                addr,
                size,
                caller,
                function,
            } => (Some(*addr), Some(*caller), Some(function.value(*size))),
            Payload::Sync {
                object,
                caller,
                mutex,
                result,
                flags,
            } => {
                // A condition variable's wait is the mutex's release and
                // its return the mutex's taking again: the mutex is the
                // address, the condition variable (or the result) the
                // value. Docs/events.md lists every kind's columns.
                let value = match kind {
                    Kind::CondWait => Some(*object as i64),
                    Kind::RwLock | Kind::SemWait => Some(i64::from(*flags)),
                    Kind::CondWaitRet | Kind::BarrierRet | Kind::RwLockRet | Kind::SemWaitRet => {
                        Some(i64::from(*result))
                    }
                    _ => None,
                };
                let addr = match kind {
                    Kind::CondWait | Kind::CondWaitRet => *mutex,
                    _ => *object,
                };
                (Some(addr), Some(*caller), value)
            }
        };
        let seq = self.db.push(&Row {
            seq: 0,
            time,
            kind,
            source,
            pid,
            lwpid,
            addr,
            caller,
            value,
        })?;
        *self.per_kind.entry(kind).or_insert(0) += 1;
        if self.named.insert((pid, lwpid)) {
            self.db.thread(pid, lwpid, &e.comm, seq)?;
            self.threads.push((pid, lwpid, e.comm.clone(), seq));
        }
        match &e.payload {
            Payload::Symbol { base, path } => {
                self.db.object(pid, *base, path, seq)?;
                self.objects.push((pid, *base, path.clone(), seq));
            }
            Payload::Exit { .. } if source == Source::Kernel => {
                self.tracked.remove(&lwpid);
            }
            _ => {}
        }
        if source == Source::Probe && kind != Kind::Exit {
            self.tracked.insert(lwpid);
        }
        self.ended |= self
            .end
            .is_some_and(|(k, l)| k == kind && l.is_none_or(|l| l == lwpid));
        Ok(Stored { seq, pid, event: e })
    }

    /// The user stack of the event just stored as `seq`: return
    /// addresses, innermost first.
    pub fn stack(&mut self, seq: u64, frames: &[u64]) -> Result<(), DbError> {
        if frames.is_empty() {
            return Ok(());
        }
        self.db.stack(seq, frames)
    }

    /// The latest time seen (events are stored with non-decreasing times).
    fn advance(&mut self, time: u64) -> u64 {
        self.last_time = self.last_time.max(time);
        self.last_time
    }

    /// A context switch from the guest kernel's switch ring, at the latest
    /// time known (`time_hint` or later): the from-task's event.
    pub fn context_switch(
        &mut self,
        time_hint: u64,
        from: (u32, u32),
        to: (u32, u32),
    ) -> Result<(), DbError> {
        if self.ended {
            self.current = Some(to);
            return Ok(());
        }
        let time = self.advance(time_hint);
        self.db.push(&Row {
            seq: 0,
            time,
            kind: Kind::ContextSwitch,
            source: Source::Kernel,
            pid: from.0,
            lwpid: from.1,
            addr: Some(u64::from(to.0)),
            caller: None,
            value: Some(i64::from(to.1)),
        })?;
        *self.per_kind.entry(Kind::ContextSwitch).or_insert(0) += 1;
        self.current = Some(to);
        Ok(())
    }

    /// A load or store of task (pid, lwpid), traced at replay: the
    /// instruction at `rip` accessed memory at `addr` as `value` says
    /// (size, access and whether on the thread's stack, as
    /// [`abi::MemAccess::value`] makes it). Stored as a MEMACCESS event: addr,
    /// caller = RIP, value (docs/events.md).
    pub fn memory_access(
        &mut self,
        time_hint: u64,
        (pid, lwpid): (u32, u32),
        rip: u64,
        addr: u64,
        value: i64,
    ) -> Result<(), DbError> {
        if self.ended {
            return Ok(());
        }
        let time = self.advance(time_hint);
        self.db.push(&Row {
            seq: 0,
            time,
            kind: Kind::MemAccess,
            source: Source::Host,
            pid,
            lwpid,
            addr: Some(addr),
            caller: Some(rip),
            value: Some(value),
        })?;
        *self.per_kind.entry(Kind::MemAccess).or_insert(0) += 1;
        Ok(())
    }

    /// Declares the probes a replay arms (before their first hit).
    pub fn probes(&mut self, probes: &[ProbeRow]) -> Result<(), DbError> {
        for p in probes {
            self.db.probe(p)?;
        }
        Ok(())
    }

    /// Process `pid` maps the object at `path` at `base`, as the host
    /// found it (not a SYMBOL event): noted from the next event on, as a
    /// SYMBOL event's object is.
    pub fn object_seen(&mut self, pid: u32, base: u64, path: &str) -> Result<(), DbError> {
        let seq = self.db.next_seq();
        if self
            .objects
            .iter()
            .any(|o| o.0 == pid && o.1 == base && o.2 == path)
        {
            return Ok(());
        }
        self.db.object(pid, base, path, seq)?;
        self.objects.push((pid, base, path.to_owned(), seq));
        Ok(())
    }

    /// A hit of probe `probe` by task (pid, lwpid): at the entry of the
    /// function at `addr` (`kind` PROBE; `caller`: the return address) or
    /// at its return (PROBE_RET, `addr`: where it returns to), with the
    /// values captured by slot and the user stack (for `ustack`). Its
    /// sequence number, unless a window ended before it.
    #[allow(clippy::too_many_arguments)]
    pub fn probe_hit(
        &mut self,
        time_hint: u64,
        (pid, lwpid): (u32, u32),
        kind: Kind,
        probe: u32,
        addr: u64,
        caller: Option<u64>,
        values: &[(u32, ProbeValue)],
        stack: &[u64],
    ) -> Result<Option<u64>, DbError> {
        if self.ended {
            return Ok(None);
        }
        let time = self.advance(time_hint);
        let seq = self.db.push(&Row {
            seq: 0,
            time,
            kind,
            source: Source::Host,
            pid,
            lwpid,
            addr: Some(addr),
            caller,
            value: Some(i64::from(probe)),
        })?;
        for (slot, value) in values {
            self.db.probe_value(seq, *slot, value)?;
        }
        if !stack.is_empty() {
            self.db.stack(seq, stack)?;
        }
        *self.per_kind.entry(kind).or_insert(0) += 1;
        Ok(Some(seq))
    }

    /// A call of a `return` probe's function that will not be reported:
    /// its thread had too many such calls under way (deeper than the
    /// probes follow).
    pub fn probe_call_untracked(&mut self, example: String) {
        self.anomaly("probe calls too deep to follow (no PROBE_RET)", example);
    }

    /// Context switches the ring overwrote before the hypervisor read them.
    pub fn lost_switches(&mut self, n: u64, example: String) {
        let entry = self
            .anomalies
            .entry("context switches lost (ring overrun)")
            .or_insert((0, example));
        entry.0 += n;
    }

    /// The replay's event ring held something the gate never writes.
    pub fn damaged_event_ring(&mut self, why: String) {
        self.anomaly(
            "event ring entries unreadable (overwritten by the guest)",
            why,
        );
    }

    /// The switch ring the guest announced is unusable.
    pub fn bad_switch_ring(&mut self, why: String) {
        self.anomaly("unusable context-switch ring", why);
    }

    /// A SAMPLE of task (pid, lwpid) at `rip`, found in `mode`, with the
    /// return addresses of its user stack, innermost first.
    pub fn sample(
        &mut self,
        time_hint: u64,
        pid: u32,
        lwpid: u32,
        rip: u64,
        mode: SampleMode,
        stack: &[u64],
    ) -> Result<(), DbError> {
        // Linux maps nothing below mmap_min_addr (64 KiB by default) nor
        // above the user half: the registers were read in a transition
        // (seen on nested hosts), not at a place user code runs. A task
        // entering its kernel may stand lower (the system-call trap page
        // of hosts that keep SYSCALL in user mode), never higher.
        if self.ended {
            return Ok(());
        }
        let possible = match mode {
            SampleMode::User => (USER_CODE_MIN..USER_CODE_END).contains(&rip),
            SampleMode::KernelBoundary => rip < USER_CODE_END,
            SampleMode::Kernel => true,
        };
        if !possible {
            self.anomaly(
                "sample at an impossible user address (dropped)",
                format!("lwpid {lwpid}: rip {rip:#x}"),
            );
            return Ok(());
        }
        let time = self.advance(time_hint);
        let seq = self.db.push(&Row {
            seq: 0,
            time,
            kind: Kind::Sample,
            source: Source::Host,
            pid,
            lwpid,
            addr: Some(rip),
            caller: None,
            value: Some(mode as i64),
        })?;
        if !stack.is_empty() {
            self.db.stack(seq, stack)?;
        }
        *self.per_kind.entry(Kind::Sample).or_insert(0) += 1;
        Ok(())
    }

    /// Stores the counters and closes the database under its final name.
    pub fn finish(mut self) -> Result<CaptureSummary, DbError> {
        let summary = self.summary();
        self.db.anomalies(&summary.anomalies)?;
        self.db.set_meta("events", &summary.events.to_string())?;
        self.db.finish()?;
        Ok(summary)
    }

    pub fn summary(&self) -> CaptureSummary {
        CaptureSummary {
            events: self.db.events_written(),
            per_kind: self.per_kind.iter().map(|(k, n)| (*k, *n)).collect(),
            anomalies: self
                .anomalies
                .iter()
                .map(|(w, (n, ex))| ((*w).to_owned(), *n, ex.clone()))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{encode, lock_payload};
    use crate::db::EventDb;
    use crate::testing::TempDb;

    fn capture(name: &str) -> (Capture, TempDb) {
        let path = TempDb::new("insight-cap", name);
        (Capture::new(EventWriter::create(&path, &[]).unwrap()), path)
    }

    #[test]
    fn samples_at_impossible_user_addresses_are_dropped_and_counted() {
        let (mut c, path) = capture("samples");
        let user = SampleMode::User;
        c.sample(10, 7, 8, 0x1000, user, &[0x4141_4141]).unwrap();
        c.sample(11, 7, 8, 1 << 47, user, &[]).unwrap();
        c.sample(12, 7, 8, 0x5555_0000_1000, user, &[0x5555_0000_2000])
            .unwrap();
        c.sample(13, 7, 8, 0xffff_ffff_8100_0000, SampleMode::Kernel, &[])
            .unwrap();
        // The system-call trap address, while the guest enters its kernel.
        c.sample(14, 7, 8, 0x1000, SampleMode::KernelBoundary, &[])
            .unwrap();
        c.sample(15, 7, 8, 1 << 47, SampleMode::KernelBoundary, &[])
            .unwrap();
        let summary = c.finish().unwrap();
        assert_eq!(summary.events, 3);
        assert_eq!(summary.anomalies.len(), 1);
        assert_eq!(summary.anomalies[0].1, 3);
        let db = EventDb::open(&path).unwrap();
        let mut samples = Vec::new();
        db.for_each(&[Kind::Sample], |r| {
            samples.push((r.addr.unwrap(), SampleMode::from_value(r.value).unwrap()));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            samples,
            [
                (0x5555_0000_1000, SampleMode::User),
                (0xffff_ffff_8100_0000, SampleMode::Kernel),
                (0x1000, SampleMode::KernelBoundary)
            ]
        );
        assert_eq!(db.stacks().unwrap().len(), 1);
    }

    #[test]
    fn stores_valid_events_and_counts_the_rest() {
        let (mut c, path) = capture("mixed");
        let lock = encode(Kind::Lock as u16, 7, 8, "app", &lock_payload(0x10, 0x20, 0));
        c.raised(100, Source::Probe, Some((7, 8)), Ok(&lock))
            .unwrap();
        assert!(c.is_tracked(8));
        c.context_switch(105, (7, 8), (1, 9)).unwrap();
        assert_eq!(c.current(), Some((1, 9)));
        // A raiser the kernel did not name: the buffer's word is taken.
        let other = encode(Kind::Unlock as u16, 1, 9, "b", &lock_payload(0x10, 0x20, 0));
        c.raised(115, Source::Probe, None, Ok(&other)).unwrap();
        c.raised(
            120,
            Source::Probe,
            Some((7, 9)),
            Err(BufferError::Unmapped(0)),
        )
        .unwrap();
        c.raised(
            130,
            Source::Probe,
            Some((7, 9)),
            Err(BufferError::CrossesPage {
                gva: 0xff0,
                size: 72,
            }),
        )
        .unwrap();
        let mut unknown = lock.clone();
        unknown[6] = 77;
        c.raised(140, Source::Probe, Some((7, 9)), Ok(&unknown))
            .unwrap();
        // A probe claiming to be another thread: stored as the kernel says.
        c.raised(150, Source::Probe, Some((7, 9)), Ok(&lock))
            .unwrap();
        let summary = c.finish().unwrap();
        assert_eq!(summary.events, 4);
        let names: Vec<_> = summary.anomalies.iter().map(|a| a.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "buffer names another thread",
                "event buffer crosses a page boundary",
                "event buffer not mapped",
                "unknown event kind"
            ]
        );
        let db = EventDb::open(&path).unwrap();
        let mut rows = Vec::new();
        db.for_each(&[], |r| {
            rows.push(r);
            Ok(())
        })
        .unwrap();
        assert_eq!(rows[1].kind, Kind::ContextSwitch);
        assert_eq!((rows[1].lwpid, rows[1].value), (8, Some(9)));
        assert_eq!((rows[2].pid, rows[2].lwpid), (1, 9));
        assert_eq!(rows[3].lwpid, 9, "the kernel's identity wins");
        assert_eq!(db.anomalies().unwrap().len(), 4);
        assert_eq!(rows[1].time, 105);
        assert!(db.threads().unwrap().contains(&(1, 9, "b".into())));
    }

    #[test]
    fn a_window_ending_at_an_event_stores_nothing_after_it() {
        let (mut c, path) = capture("end");
        c.end_after(Kind::Lock, Some(9));
        let lock = |lwpid| {
            encode(
                Kind::Lock as u16,
                7,
                lwpid,
                "app",
                &lock_payload(0x10, 0x20, 0),
            )
        };
        let unlock = encode(
            Kind::Unlock as u16,
            7,
            9,
            "app",
            &lock_payload(0x10, 0x20, 0),
        );
        // Another thread's lock does not end it; thread 9's does.
        c.raised(1, Source::Probe, Some((7, 8)), Ok(&lock(8)))
            .unwrap();
        assert!(!c.ended());
        c.raised(2, Source::Probe, Some((7, 9)), Ok(&lock(9)))
            .unwrap();
        assert!(c.ended());
        // The same time, later in the run: left out, as are switches and
        // samples (the task on the CPU is still followed).
        c.raised(2, Source::Probe, Some((7, 9)), Ok(&unlock))
            .unwrap();
        c.context_switch(3, (7, 9), (7, 8)).unwrap();
        assert_eq!(c.current(), Some((7, 8)));
        c.sample(4, 7, 8, 0x5555_0000_1000, SampleMode::User, &[])
            .unwrap();
        c.memory_access(5, (7, 8), 0x5555_0000_1000, 0x10, 8)
            .unwrap();
        assert_eq!(c.finish().unwrap().events, 2);
        let db = EventDb::open(&path).unwrap();
        let mut last = None;
        db.for_each(&[], |r| {
            last = Some((r.kind, r.lwpid));
            Ok(())
        })
        .unwrap();
        assert_eq!(last, Some((Kind::Lock, 9)));
    }

    #[test]
    fn kernel_exits_untrack_threads() {
        let (mut c, _db) = capture("exit");
        let lock = encode(Kind::Lock as u16, 7, 8, "app", &lock_payload(0x10, 0x20, 0));
        c.raised(1, Source::Probe, Some((7, 8)), Ok(&lock)).unwrap();
        let exit = encode(Kind::Exit as u16, 7, 8, "app", &[0; 8]);
        c.raised(2, Source::Kernel, Some((7, 8)), Ok(&exit))
            .unwrap();
        assert!(!c.is_tracked(8));
    }
}
