//! Chaos while recording (`record --chaos`): the schedule perturbed from
//! a seed. At instants drawn at random, down to tens of microseconds of
//! the guest's time apart, the kick that looks for an asynchronous point
//! finds user code where it stands, and VM time moves on past the guest
//! kernel's next tick by a whole time slice: the tick's interrupt is then
//! due, delivered there, and the guest's scheduler finds the running
//! thread's slice used up and switches to another one if any can run.
//! Every choice reaches the guest as an input the recording already logs
//! (where the interrupt was delivered, what the clock read), so a replay
//! needs no seed.

use trace::ChaosSettings;

/// The default least and greatest stretch of the guest's time between
/// two chaos preemptions: drawn log-uniformly between them, so that short
/// stretches (a race window a few instructions wide, hit by a kick that
/// lands in it) are as likely per decade as long ones (a thread kept off
/// the CPU for a while).
const DEFAULT_MIN_GAP_NS: u64 = 5_000;
const DEFAULT_MAX_GAP_NS: u64 = 500_000;
/// How far past the guest's next tick its time moves at a chaos
/// preemption by default: more than the guest scheduler's whole latency
/// period (6 ms on one CPU, Linux's `sysctl_sched_latency`), so that the
/// running thread has used up its slice whatever the other threads.
const DEFAULT_SLICE_NS: u64 = 8_000_000;
/// By default one kernel entry from user mode in this many ends the
/// running thread's slice there (the tick is delivered after the entry's
/// exit, and the thread is switched out when the kernel returns to user
/// mode): a thread is then preempted at its system calls, where a thread
/// just created, or just woken, often stands.
const DEFAULT_ONE_ENTRY_IN: u32 = 8;
/// A tick further away than this is not the periodic tick of a guest
/// with more than one task to run (Linux stops it while one task runs in
/// user mode: guest kernel patch 0008): no preemption is forced then, as
/// nothing else would run, and the guest's time is not moved that far.
const MAX_TICK_WAIT_NS: u64 = 12_000_000;

/// The chaos settings of `record --chaos=SEED`: the default gaps and
/// slice, drawn from `seed`.
pub fn chaos_settings(seed: u64) -> ChaosSettings {
    ChaosSettings {
        seed,
        min_gap_ns: DEFAULT_MIN_GAP_NS,
        max_gap_ns: DEFAULT_MAX_GAP_NS,
        slice_ns: DEFAULT_SLICE_NS,
        one_entry_in: DEFAULT_ONE_ENTRY_IN,
    }
}

/// The recording's chaos: when the next preemption is due, and the
/// pseudo-random draws.
pub(crate) struct Chaos {
    settings: ChaosSettings,
    rng: Xoshiro256,
    /// VM time at which the next preemption is due.
    due_ns: u64,
    /// Preemptions forced, and kicks due that found no other task to run
    /// or no user code.
    pub(crate) stats: ChaosStats,
}

/// What the chaos did in a recording.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChaosStats {
    /// Preemptions forced: the guest's time moved on, its tick delivered.
    pub preemptions: u64,
    /// Kernel entries chosen to end the slice at (`preemptions` counts
    /// those that had a tick near).
    pub at_entries: u64,
    /// Times the guest's time moved on in all, ns.
    pub moved_ns: u64,
    /// Chaos kicks that found the guest kernel running: nothing forced.
    pub in_kernel: u64,
    /// Chaos kicks that found no tick due soon (one task to run): nothing
    /// forced.
    pub alone: u64,
}

impl Chaos {
    pub(crate) fn new(settings: ChaosSettings) -> Self {
        Chaos {
            settings,
            rng: Xoshiro256::seeded(settings.seed),
            due_ns: u64::MAX,
            stats: ChaosStats::default(),
        }
    }

    /// The run starts at VM time `now`: the first preemption is drawn.
    pub(crate) fn start(&mut self, now: u64) {
        self.due_ns = now.saturating_add(self.next_gap());
    }

    /// When the next preemption is due (VM time).
    pub(crate) fn due_ns(&self) -> u64 {
        self.due_ns
    }

    /// At a kick at VM time `now` with the vCPU in user code (`in_user`)
    /// and the guest's next tick at `tick`: if a preemption is due, how
    /// far to move VM time on so that the tick is due and the running
    /// thread's slice used up (`None`: nothing to force now). The next
    /// one is drawn either way.
    pub(crate) fn preempt(&mut self, now: u64, in_user: bool, tick: Option<u64>) -> Option<u64> {
        if now < self.due_ns {
            return None;
        }
        self.due_ns = now.saturating_add(self.next_gap());
        if !in_user {
            self.stats.in_kernel += 1;
            return None;
        }
        self.preempt_now(now, tick)
    }

    /// A preemption due at `now` is not forced (one is on its way): the
    /// next one is drawn.
    pub(crate) fn postpone(&mut self, now: u64) {
        if now >= self.due_ns {
            self.due_ns = now.saturating_add(self.next_gap());
        }
    }

    /// At a kernel entry from user mode: whether to end the slice here
    /// (one entry in `one_entry_in`, drawn).
    pub(crate) fn at_kernel_entry(&mut self) -> bool {
        let n = u64::from(self.settings.one_entry_in);
        let chosen = n > 0 && self.rng.next().is_multiple_of(n);
        self.stats.at_entries += u64::from(chosen);
        chosen
    }

    /// Ends the running thread's slice now (VM time `now`), the guest's
    /// next tick at `tick`: how far to move VM time on, if a tick is near.
    pub(crate) fn preempt_now(&mut self, now: u64, tick: Option<u64>) -> Option<u64> {
        match tick {
            Some(t) if t.saturating_sub(now) <= MAX_TICK_WAIT_NS => {
                let by = t.saturating_sub(now) + self.settings.slice_ns;
                self.stats.preemptions += 1;
                self.stats.moved_ns += by;
                Some(by)
            }
            _ => {
                self.stats.alone += 1;
                None
            }
        }
    }

    /// A stretch of VM time drawn log-uniformly between the least and the
    /// greatest gap.
    fn next_gap(&mut self) -> u64 {
        let (lo, hi) = (self.settings.min_gap_ns.max(1), self.settings.max_gap_ns);
        if hi <= lo {
            return lo;
        }
        let unit = (self.rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        let (ln_lo, ln_hi) = ((lo as f64).ln(), (hi as f64).ln());
        ((ln_lo + unit * (ln_hi - ln_lo)).exp() as u64).clamp(lo, hi)
    }
}

/// xoshiro256** (Blackman and Vigna), seeded through splitmix64: small,
/// fast, and the same draws from the same seed on every host.
struct Xoshiro256([u64; 4]);

impl Xoshiro256 {
    fn seeded(seed: u64) -> Self {
        let mut s = seed;
        let mut splitmix = || {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Xoshiro256([splitmix(), splitmix(), splitmix(), splitmix()])
    }

    fn next(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(seed: u64) -> ChaosSettings {
        chaos_settings(seed)
    }

    #[test]
    fn xoshiro_matches_the_reference_output() {
        // The reference implementation's first outputs from the state
        // {1, 2, 3, 4}.
        let mut r = Xoshiro256([1, 2, 3, 4]);
        let first: Vec<u64> = (0..3).map(|_| r.next()).collect();
        assert_eq!(first, [11520, 0, 1509978240]);
    }

    #[test]
    fn gaps_follow_the_seed_and_spread_over_the_decades_between_the_bounds() {
        let draw = |seed| {
            let mut c = Chaos::new(settings(seed));
            (0..2000).map(|_| c.next_gap()).collect::<Vec<u64>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
        assert!(a
            .iter()
            .all(|&g| (DEFAULT_MIN_GAP_NS..=DEFAULT_MAX_GAP_NS).contains(&g)));
        // Log-uniform: half of them below the bounds' geometric mean.
        let mean = ((DEFAULT_MIN_GAP_NS as f64) * (DEFAULT_MAX_GAP_NS as f64)).sqrt() as u64;
        let short = a.iter().filter(|&&g| g < mean).count();
        assert!(
            (900..1100).contains(&short),
            "{short} of 2000 below {mean} ns"
        );
    }

    #[test]
    fn a_preemption_moves_time_past_the_next_tick_only_when_one_is_near() {
        let mut c = Chaos::new(settings(1));
        c.start(0);
        let due = c.due_ns();
        assert_eq!(c.preempt(due - 1, true, Some(due + 1000)), None);
        assert_eq!(
            c.preempt(due, true, Some(due + 3_000_000)),
            Some(3_000_000 + DEFAULT_SLICE_NS)
        );
        assert!(c.due_ns() > due);
        // No tick near (one task runs), or the guest kernel runs: nothing.
        let due = c.due_ns();
        assert_eq!(c.preempt(due, true, Some(due + 1_000_000_000)), None);
        let due = c.due_ns();
        assert_eq!(c.preempt(due, false, Some(due + 1000)), None);
        assert_eq!(c.stats.preemptions, 1);
        assert_eq!((c.stats.alone, c.stats.in_kernel), (1, 1));
    }
}
