//! Chaos while recording (`record --chaos`): the guest kernel's scheduler
//! decides by the VMM's decisions (guest kernel patch 0031: task
//! priorities, priority change points at single-stepped user
//! instructions, new priorities at system calls and ticks). At each point
//! the kernel names the point and asks; the VMM answers from the chaos
//! seed, a hash of seed and point, so that a point is given the same
//! decision whenever a run reaches it, whatever came before it; or it
//! answers a recording's decisions again (`record --schedule`). The
//! recording logs each question and answer like every MSR access, so a
//! replay takes the same decisions and the trace holds its schedule
//! (`schedule.rs`).

use journal::{
    MSR_INSIGHT_CHAOS_DECISION, MSR_INSIGHT_CHAOS_POINT, MSR_INSIGHT_CHAOS_SEED,
    MSR_INSIGHT_CHAOS_SETTINGS, MSR_INSIGHT_CHAOS_WHERE,
};
use trace::ChaosSettings;

use super::forced_ticks::TickForcer;
use super::schedule::{ChaosPoint, Decision, ForcedDecisions, PointKind, DROPPED_BELOW};
use crate::vm::GuestMsrs;

/// By default one system-call entry or return to user mode in this many
/// gives the running task a new random priority. Such a draw lifts a task
/// above every task that has dropped at a change point: one in 4 undid
/// the drops a program's main thread needs to let its threads run first
/// (account_bad, token_ring_bad).
const DEFAULT_ENTRY_ONE_IN: u8 = 8;
/// At the entry of `exit_group` from a thread whose process has other
/// threads, one time in this many the thread drops (a change point), so
/// that the threads it started may all run before the process ends: a
/// main thread that returns right after starting them (account_bad,
/// token_ring_bad) was otherwise stepped to its `exit_group` for a drop.
const EXIT_DROP_ONE_IN: u8 = 2;
/// By default one scheduler tick in this many (while more than one task
/// can run) does: a task spinning for another of lower priority is not
/// kept waiting for good.
const DEFAULT_TICK_ONE_IN: u8 = 2;
/// By default a run of single-stepped user instructions up to a change
/// point is drawn uniformly below twice a mean, the mean a power of two
/// between these (base-2 logarithms): 1 to 256 instructions, so that a
/// race window a few instructions wide, such as deadlock01_bad's twenty
/// between two `pthread_mutex_lock` calls, holds a change point in one
/// try in five or so (with means up to 4096 most stepped instructions lay
/// in long runs: one try in 40).
const DEFAULT_STEP_LOG_MIN: u8 = 0;
const DEFAULT_STEP_LOG_MAX: u8 = 8;
/// By default a thread single-steps at most this many user instructions,
/// and a process this many in all: a step is a trap into the interpreted
/// guest kernel (its entry and exit only, but for a run's last: guest
/// kernel patch 0034), so this bounds what chaos costs a
/// long-running program, while the short threads of a test program are
/// stepped all through: a main thread's `pthread_create` calls and its
/// way from `main` to `exit_group` take about 3,500 user instructions,
/// and the first thread to take a lock 1,500 more in the dynamic linker
/// (2048 a thread had left both unstepped).
const DEFAULT_THREAD_BUDGET: u16 = 4096;
const DEFAULT_PROCESS_BUDGET: u16 = 6144;

/// The chaos settings of `record --chaos=SEED`: the defaults, drawn from
/// `seed`.
pub fn chaos_settings(seed: u64) -> ChaosSettings {
    ChaosSettings {
        seed,
        entry_one_in: DEFAULT_ENTRY_ONE_IN,
        tick_one_in: DEFAULT_TICK_ONE_IN,
        step_log_min: DEFAULT_STEP_LOG_MIN,
        step_log_max: DEFAULT_STEP_LOG_MAX,
        thread_budget: DEFAULT_THREAD_BUDGET,
        process_budget: DEFAULT_PROCESS_BUDGET,
    }
}

/// The settings as the guest kernel reads them from
/// `MSR_INSIGHT_CHAOS_SETTINGS`: bits 0-7 `entry_one_in`, 8-15
/// `tick_one_in`, 16-23 `step_log_max`, 24-31 `step_log_min`, 32-47
/// `thread_budget`, 48-63 `process_budget`.
pub fn settings_word(s: &ChaosSettings) -> u64 {
    u64::from(s.entry_one_in)
        | u64::from(s.tick_one_in) << 8
        | u64::from(s.step_log_max) << 16
        | u64::from(s.step_log_min) << 24
        | u64::from(s.thread_budget) << 32
        | u64::from(s.process_budget) << 48
}

/// A recording's chaos: the decisions handed to the guest.
pub(crate) struct Chaos {
    settings: ChaosSettings,
    rng: Xoshiro256,
    /// A recording's decisions taken again, instead of the seed's.
    forced: Option<ForcedDecisions>,
    /// The point the guest kernel named last, and its user position.
    point: Option<ChaosPoint>,
    user_ip: u64,
    /// The tick choices of `forced` taken where the recording took them.
    pub(crate) ticks: TickForcer,
    pub(crate) stats: ChaosStats,
}

/// What the chaos did in a recording.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChaosStats {
    /// Seeds handed to the guest kernel (one at each exec).
    pub seeds: u64,
    /// Decisions the guest kernel asked for.
    pub decisions: u64,
    /// Those that are choices of the schedule (`Decision::is_choice`).
    pub choices: u64,
    /// `record --schedule`: tick choices forced where the recording took
    /// them, and forcings given up (the run went elsewhere first).
    pub ticks_forced: u64,
    pub ticks_given_up: u64,
}

impl Chaos {
    /// What the chaos did so far.
    pub(crate) fn stats(&self) -> ChaosStats {
        ChaosStats {
            ticks_forced: self.ticks.stats.forced,
            ticks_given_up: self.ticks.stats.given_up,
            ..self.stats
        }
    }

    pub(crate) fn new(settings: ChaosSettings) -> Self {
        Chaos {
            settings,
            rng: Xoshiro256::seeded(settings.seed),
            forced: None,
            point: None,
            user_ip: 0,
            ticks: TickForcer::default(),
            stats: ChaosStats::default(),
        }
    }

    /// Chaos that takes `forced`'s decisions (`record --schedule`).
    pub(crate) fn forced(settings: ChaosSettings, forced: ForcedDecisions) -> Self {
        Chaos {
            ticks: TickForcer::new(forced.ticks.clone()),
            forced: Some(forced),
            ..Chaos::new(settings)
        }
    }

    /// The decision at `point`.
    fn decide(&self, point: ChaosPoint) -> u64 {
        if let Some(forced) = &self.forced {
            return forced.answer(point);
        }
        seeded_decision(&self.settings, point)
    }
}

/// The decision chaos from `settings.seed` takes at `point`: drawn from a
/// hash of the seed and the point alone.
fn seeded_decision(s: &ChaosSettings, point: ChaosPoint) -> u64 {
    let draw = |salt: u64| {
        splitmix64(
            s.seed
                ^ point.word().wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ salt.wrapping_mul(0xd6e8_feb8_6659_fd93),
        )
    };
    // A drawn priority: above every dropped one.
    let priority = |x: u64| (x >> 34) + DROPPED_BELOW;
    let one_in = |n: u8, x: u64| n != 0 && x.is_multiple_of(u64::from(n));
    match point.kind {
        PointKind::New => priority(draw(1)),
        PointKind::Entry if one_in(s.entry_one_in, draw(1)) => priority(draw(2)),
        PointKind::Tick if one_in(s.tick_one_in, draw(1)) => priority(draw(2)),
        PointKind::Entry | PointKind::Tick => 0,
        // Uniformly below twice a mean, the mean a power of two between
        // the least and the greatest (as the guest kernel caps them).
        PointKind::Steps => {
            let max = u64::from(s.step_log_max.min(20));
            if max == 0 {
                return 0;
            }
            let min = u64::from(s.step_log_min).min(max);
            let mean = 1u64 << (min + draw(1) % (max - min + 1));
            1 + draw(2) % (2 * mean)
        }
        PointKind::Drop => 1 + draw(1) % (DROPPED_BELOW - 1),
        PointKind::Exit if one_in(EXIT_DROP_ONE_IN, draw(1)) => 1 + draw(2) % (DROPPED_BELOW - 1),
        PointKind::Exit => 0,
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl GuestMsrs for Chaos {
    /// The answer to the guest's read of MSR `index`, if it is one of
    /// chaos's.
    fn read_msr(&mut self, index: u32) -> Option<u64> {
        match index {
            MSR_INSIGHT_CHAOS_SEED => {
                self.stats.seeds += 1;
                // Never 0 (chaos off).
                Some(self.rng.next() | 1)
            }
            MSR_INSIGHT_CHAOS_SETTINGS => Some(settings_word(&self.settings)),
            MSR_INSIGHT_CHAOS_DECISION => {
                // Asked with no point named: the read faults.
                let point = self.point.take()?;
                let value = match self.ticks.answer(point) {
                    Some(value) => value,
                    None => self.decide(point),
                };
                self.ticks.decided(point);
                self.stats.decisions += 1;
                let decision = Decision {
                    point,
                    user_ip: self.user_ip,
                    code_start: 0,
                    value,
                };
                self.stats.choices += u64::from(decision.is_choice());
                Some(value)
            }
            _ => None,
        }
    }

    fn write_msr(&mut self, index: u32, value: u64) {
        match index {
            MSR_INSIGHT_CHAOS_POINT => {
                self.point = ChaosPoint::from_word(value);
                self.user_ip = 0;
                if let Some(point) = self.point {
                    self.ticks.point_named(point);
                }
            }
            MSR_INSIGHT_CHAOS_WHERE => self.user_ip = value,
            _ => {}
        }
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

    #[test]
    fn xoshiro_matches_the_reference_output() {
        // The reference implementation's first outputs from the state
        // {1, 2, 3, 4}.
        let mut r = Xoshiro256([1, 2, 3, 4]);
        let first: Vec<u64> = (0..3).map(|_| r.next()).collect();
        assert_eq!(first, [11520, 0, 1509978240]);
    }

    #[test]
    fn seeds_follow_the_chaos_seed_and_are_never_zero() {
        let draw = |seed| {
            let mut c = Chaos::new(chaos_settings(seed));
            (0..1000)
                .map(|_| c.read_msr(MSR_INSIGHT_CHAOS_SEED).unwrap())
                .collect::<Vec<u64>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
        assert!(a.iter().all(|&s| s != 0));
        let mut c = Chaos::new(chaos_settings(7));
        c.read_msr(MSR_INSIGHT_CHAOS_SEED);
        assert_eq!(c.stats.seeds, 1);
        assert_eq!(c.read_msr(0x10), None);
    }

    #[test]
    fn the_settings_word_packs_every_field_where_the_guest_kernel_reads_it() {
        let s = ChaosSettings {
            seed: 1,
            entry_one_in: 0x12,
            tick_one_in: 0x34,
            step_log_max: 0x56,
            step_log_min: 0x78,
            thread_budget: 0x9abc,
            process_budget: 0xdef0,
        };
        assert_eq!(settings_word(&s), 0xdef0_9abc_7856_3412);
        let mut c = Chaos::new(s);
        assert_eq!(
            c.read_msr(MSR_INSIGHT_CHAOS_SETTINGS),
            Some(0xdef0_9abc_7856_3412)
        );
    }

    fn ask(c: &mut Chaos, task: u16, kind: PointKind, count: u64) -> Option<u64> {
        let point = ChaosPoint { task, kind, count };
        c.write_msr(MSR_INSIGHT_CHAOS_POINT, point.word());
        c.write_msr(MSR_INSIGHT_CHAOS_WHERE, 0x40_1000);
        c.read_msr(MSR_INSIGHT_CHAOS_DECISION)
    }

    #[test]
    fn a_seeded_decision_depends_on_its_point_alone() {
        let mut a = Chaos::new(chaos_settings(5));
        let mut b = Chaos::new(chaos_settings(5));
        // Asked in another order, with a tick between: the same answers.
        let first = ask(&mut a, 2, PointKind::Drop, 7).unwrap();
        ask(&mut b, 1, PointKind::Tick, 3 << 8);
        assert_eq!(ask(&mut b, 2, PointKind::Drop, 7), Some(first));
        assert!((1..DROPPED_BELOW).contains(&first));
        assert_ne!(
            (0..20)
                .map(|n| ask(&mut a, 1, PointKind::New, n).unwrap())
                .collect::<Vec<_>>(),
            (0..20)
                .map(|n| ask(&mut Chaos::new(chaos_settings(6)), 1, PointKind::New, n).unwrap())
                .collect::<Vec<_>>()
        );
        // About one kernel point in `entry_one_in` gets a new priority,
        // above every dropped one; the others none.
        let entries: Vec<u64> = (0..4000)
            .map(|n| ask(&mut a, 3, PointKind::Entry, n).unwrap())
            .collect();
        let changed = entries.iter().filter(|&&v| v != 0).count();
        let expected = 4000 / usize::from(DEFAULT_ENTRY_ONE_IN);
        assert!(
            (expected * 4 / 5..expected * 6 / 5).contains(&changed),
            "{changed} of 4000, about {expected} expected"
        );
        assert!(entries.iter().all(|&v| v == 0 || v >= DROPPED_BELOW));
        // Runs of steps: 1 to twice the greatest mean.
        let max = 2u64 << DEFAULT_STEP_LOG_MAX;
        assert!((0..500)
            .map(|n| ask(&mut a, 3, PointKind::Steps, n).unwrap())
            .all(|v| (1..=max).contains(&v)));
        assert_eq!(a.stats.decisions, 1 + 20 + 4000 + 500);
        assert_eq!(
            a.stats.choices,
            1 + 20 + changed as u64,
            "drops, new priorities and changes are choices"
        );
        // No point named: the read faults.
        assert_eq!(a.read_msr(MSR_INSIGHT_CHAOS_DECISION), None);
    }

    #[test]
    fn about_one_exit_group_in_exit_drop_one_in_drops() {
        let mut c = Chaos::new(chaos_settings(11));
        let exits: Vec<u64> = (0..2000)
            .map(|n| ask(&mut c, 1 + (n % 7) as u16, PointKind::Exit, n).unwrap())
            .collect();
        let dropped = exits.iter().filter(|&&v| v != 0).count();
        let expected = 2000 / usize::from(EXIT_DROP_ONE_IN);
        assert!(
            (expected * 4 / 5..expected * 6 / 5).contains(&dropped),
            "{dropped} of 2000, about {expected} expected"
        );
        assert!(exits.iter().all(|&v| v < DROPPED_BELOW), "drops only");
        assert_eq!(c.stats.choices, dropped as u64);
    }

    #[test]
    fn forced_decisions_are_answered_and_the_rest_changes_nothing() {
        let mut log = Vec::new();
        let mut c = Chaos::new(chaos_settings(9));
        let points = [
            (1, PointKind::New, 0),
            (2, PointKind::New, 0),
            (2, PointKind::Steps, 1),
            (2, PointKind::Drop, 2),
        ];
        for (task, kind, count) in points {
            let point = ChaosPoint { task, kind, count };
            let value = ask(&mut c, task, kind, count).unwrap();
            for (index, value) in [
                (MSR_INSIGHT_CHAOS_POINT, point.word()),
                (MSR_INSIGHT_CHAOS_WHERE, 0x40_1000),
            ] {
                log.push(Ok(journal::Entry::WrMsr {
                    index,
                    rip: 0,
                    value,
                    fault: false,
                }));
            }
            log.push(Ok(journal::Entry::RdMsr {
                index: MSR_INSIGHT_CHAOS_DECISION,
                rip: 0,
                value,
                fault: false,
            }));
        }
        let schedule = super::super::Schedule::from_log(log).unwrap();
        assert_eq!(schedule.choices().count(), 3);
        let edits = super::super::ScheduleEdits::parse("drop=3").unwrap();
        let mut again = Chaos::forced(chaos_settings(1), schedule.forced(&edits).unwrap());
        for (n, (task, kind, count)) in points.into_iter().enumerate() {
            let want = match n {
                3 => 0,
                _ => schedule.decisions[n].value,
            };
            assert_eq!(ask(&mut again, task, kind, count), Some(want), "{n}");
        }
        assert_eq!(
            ask(&mut again, 3, PointKind::New, 0),
            Some(super::super::schedule::DEFAULT_PRIORITY)
        );
        assert_eq!(ask(&mut again, 1, PointKind::Tick, 0), Some(0));
    }
}
