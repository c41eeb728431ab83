//! Chaos while recording (`record --chaos`): the guest kernel's scheduler
//! decides by random draws (guest kernel patch 0031: random task
//! priorities, priority change points at random single-stepped user
//! instructions, new priorities at random system calls and ticks). The
//! VMM hands the guest the seed of those draws at every exec, and the
//! settings, as the answers to two MSR reads; the recording logs them
//! like every value the guest reads, so a replay makes the same draws and
//! needs no seed.

use journal::{MSR_INSIGHT_CHAOS_SEED, MSR_INSIGHT_CHAOS_SETTINGS};
use trace::ChaosSettings;

use crate::vm::GuestMsrs;

/// By default one system-call entry or return to user mode in this many
/// gives the running task a new random priority. Such a draw lifts a task
/// above every task that has dropped at a change point: one in 4 undid
/// the drops a program's main thread needs to let its threads run first
/// (account_bad, token_ring_bad).
const DEFAULT_ENTRY_ONE_IN: u8 = 8;
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
/// guest kernel (about 0.6 ms), so this bounds what chaos costs a
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

/// A recording's chaos: the draws handed to the guest.
pub(crate) struct Chaos {
    settings: ChaosSettings,
    rng: Xoshiro256,
    pub(crate) stats: ChaosStats,
}

/// What the chaos did in a recording.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChaosStats {
    /// Seeds handed to the guest kernel (one at each exec).
    pub seeds: u64,
}

impl Chaos {
    pub(crate) fn new(settings: ChaosSettings) -> Self {
        Chaos {
            settings,
            rng: Xoshiro256::seeded(settings.seed),
            stats: ChaosStats::default(),
        }
    }
}

impl GuestMsrs for Chaos {
    /// The answer to the guest's read of MSR `index`, if it is one of
    /// chaos's.
    fn read_msr(&mut self, index: u32) -> Option<u64> {
        match index {
            MSR_INSIGHT_CHAOS_SEED => {
                self.stats.seeds += 1;
                // Never 0 (chaos off), nor a state xorshift cannot leave.
                Some(self.rng.next() | 1)
            }
            MSR_INSIGHT_CHAOS_SETTINGS => Some(settings_word(&self.settings)),
            _ => None,
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
}
