//! When a recording's guest has made no progress for its limit
//! (`record --timeout`): the time counted is the vCPU's, not the host's
//! wall clock. While the guest runs, that is the host CPU time the vCPU
//! thread got; while it idles (HLT), the host's time. On a host loaded by
//! other work the vCPU thread may wait for a CPU for seconds between two
//! of the guest's exits (single-stepped user code makes none for
//! hundreds of instructions), which wall time counted as a hang; a
//! deadlock (the guest idle) or a spin (the vCPU busy) is counted in full
//! either way.

use std::time::{Duration, Instant};

/// How often the vCPU's time is looked at: a hang is seen this much
/// late at most, and a progress this much early.
const LOOK_EVERY: Duration = Duration::from_millis(100);

pub(crate) struct HangClock {
    limit: Duration,
    /// The guest made progress since the last look.
    progressed: bool,
    last_look: Instant,
    /// When progress was last seen: the vCPU thread's CPU time then
    /// (`None` until looked at on the vCPU thread, or when the host does
    /// not tell: wall time is counted instead), and the host's time.
    since_cpu: Option<Duration>,
    since_wall: Instant,
    /// Time the guest spent idle since then, and since when it idles now.
    idle: Duration,
    idle_from: Option<Instant>,
}

impl HangClock {
    pub(crate) fn new(limit: Duration, now: Instant) -> Self {
        HangClock {
            limit,
            progressed: true,
            last_look: now,
            since_cpu: None,
            since_wall: now,
            idle: Duration::ZERO,
            idle_from: None,
        }
    }

    pub(crate) fn limit(&self) -> Duration {
        self.limit
    }

    /// The guest's user code made progress (a system call or a fault).
    pub(crate) fn progressed(&mut self) {
        self.progressed = true;
    }

    /// The guest idles from `now` (HLT) until [`HangClock::woke`].
    pub(crate) fn idles(&mut self, now: Instant) {
        self.idle_from = Some(now);
    }

    pub(crate) fn woke(&mut self, now: Instant) {
        if let Some(from) = self.idle_from.take() {
            self.idle += now.saturating_duration_since(from);
        }
    }

    /// Whether the guest has made no progress for the limit, looked at
    /// most every `LOOK_EVERY`; `cpu` reads the vCPU thread's CPU time.
    pub(crate) fn hung(&mut self, now: Instant, cpu: impl FnOnce() -> Option<Duration>) -> bool {
        if now.saturating_duration_since(self.last_look) < LOOK_EVERY {
            return false;
        }
        self.last_look = now;
        let cpu = cpu();
        if self.progressed || (self.since_cpu.is_none() && cpu.is_some()) {
            self.progressed = false;
            self.since_cpu = cpu;
            self.since_wall = now;
            self.idle = Duration::ZERO;
            if self.idle_from.is_some() {
                self.idle_from = Some(now);
            }
            return false;
        }
        let idle_now = self
            .idle_from
            .map_or(Duration::ZERO, |from| now.saturating_duration_since(from));
        let waited = match (self.since_cpu, cpu) {
            (Some(since), Some(cpu)) => cpu.saturating_sub(since) + self.idle + idle_now,
            _ => now.saturating_duration_since(self.since_wall),
        };
        waited >= self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(10);

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_vcpu_that_gets_no_cpu_is_not_hung() {
        let t0 = Instant::now();
        let mut c = HangClock::new(LIMIT, t0);
        assert!(!c.hung(t0 + secs(0.2), || Some(secs(1.0))));
        // 30 s of the host's time, 2 s of them on a CPU: no hang.
        assert!(!c.hung(t0 + secs(30.0), || Some(secs(3.0))));
        // 10 s on a CPU with no progress: a hang (a spin).
        assert!(c.hung(t0 + secs(40.0), || Some(secs(11.0))));
    }

    #[test]
    fn progress_starts_the_count_again() {
        let t0 = Instant::now();
        let mut c = HangClock::new(LIMIT, t0);
        assert!(!c.hung(t0 + secs(0.2), || Some(secs(0.0))));
        assert!(!c.hung(t0 + secs(9.0), || Some(secs(9.0))));
        c.progressed();
        assert!(!c.hung(t0 + secs(12.0), || Some(secs(12.0))));
        assert!(!c.hung(t0 + secs(21.0), || Some(secs(21.0))));
        assert!(c.hung(t0 + secs(22.5), || Some(secs(22.5))));
    }

    #[test]
    fn an_idle_guest_counts_the_hosts_time() {
        let t0 = Instant::now();
        let mut c = HangClock::new(LIMIT, t0);
        assert!(!c.hung(t0 + secs(0.2), || Some(secs(0.0))));
        c.idles(t0 + secs(1.0));
        // Asleep for 9.5 s, the CPU time standing still: no hang yet.
        assert!(!c.hung(t0 + secs(10.5), || Some(secs(0.1))));
        c.woke(t0 + secs(10.5));
        // Half a second of running more: a deadlock's 10 s.
        assert!(c.hung(t0 + secs(11.0), || Some(secs(0.6))));
    }

    #[test]
    fn it_looks_at_most_every_tenth_of_a_second_and_falls_back_on_wall_time() {
        let t0 = Instant::now();
        let mut c = HangClock::new(LIMIT, t0);
        let mut looked = 0;
        for ms in 1..100 {
            c.hung(t0 + Duration::from_millis(ms), || {
                looked += 1;
                None
            });
        }
        assert_eq!(looked, 0);
        assert!(!c.hung(t0 + secs(0.2), || None));
        assert!(c.hung(t0 + secs(10.3), || None));
    }
}
