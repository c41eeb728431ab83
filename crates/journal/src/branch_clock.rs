//! Positioning for the branch clock (hosts with a PMU).
//!
//! There a timestamp is the count of guest conditional branches retired
//! since boot, with RIP and RCX to tell apart the instructions that share a
//! count (a loop body without branches, the iterations of a `rep` string
//! instruction): the <branches, RIP, RCX> of ReVirt, ReTrace and InSight.
//! An asynchronous event recorded at such a timestamp is replayed by
//! bringing the guest to exactly that point, which a performance counter
//! alone cannot do: its overflow interrupt arrives some instructions late
//! (skid). As in rr, [`seek`] lets the counter overflow a safe margin
//! before the target, then finishes with breakpoints at the target RIP and
//! single steps until count, RIP and RCX all match.
//!
//! The vCPU is behind the [`BranchCpu`] trait so that the algorithm is
//! tested against a simulated counter with random skid. Only that
//! simulator implements it so far: the KVM side (`perf_event_open` of
//! guest branches, `KVM_SET_GUEST_DEBUG`) needs a host with a PMU, and
//! `record --clock branch` is refused until it exists.

/// A position in the guest's execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timestamp {
    pub branches: u64,
    pub rip: u64,
    pub rcx: u64,
}

/// What `seek` needs from a vCPU.
pub trait BranchCpu {
    type Error;
    /// Where the guest is now.
    fn now(&self) -> Timestamp;
    /// Runs until the branch counter has counted `branches` more, and
    /// stops at some point after that (the overflow interrupt's skid).
    fn run_branches(&mut self, branches: u64) -> Result<(), Self::Error>;
    /// Runs at least one instruction, until RIP equals `rip`.
    fn run_to(&mut self, rip: u64) -> Result<(), Self::Error>;
    /// Executes one instruction.
    fn step(&mut self) -> Result<(), Self::Error>;
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SeekError<E> {
    #[error("the guest is already past {target:?} (at {now:?})")]
    Overshot { target: Timestamp, now: Timestamp },
    #[error(transparent)]
    Cpu(E),
}

/// How `seek` got there, for tuning the margin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeekStats {
    pub overflow_runs: u32,
    pub breakpoint_runs: u32,
    pub steps: u32,
}

/// Brings `cpu` to exactly `target`. `margin` must exceed the counter's
/// largest skid, in branches.
pub fn seek<C: BranchCpu>(
    cpu: &mut C,
    target: Timestamp,
    margin: u64,
) -> Result<SeekStats, SeekError<C::Error>> {
    let mut stats = SeekStats::default();
    let overshot = |now: Timestamp| SeekError::Overshot { target, now };
    let now = cpu.now();
    if now.branches > target.branches {
        return Err(overshot(now));
    }
    let remaining = target.branches - now.branches;
    if remaining > margin {
        cpu.run_branches(remaining - margin)
            .map_err(SeekError::Cpu)?;
        stats.overflow_runs += 1;
    }
    loop {
        let now = cpu.now();
        if now.branches > target.branches {
            return Err(overshot(now));
        }
        if now == target {
            return Ok(stats);
        }
        if now.rip == target.rip {
            // At the target instruction but not yet at its occurrence:
            // one instruction on (a `rep` iteration, or off the
            // breakpoint).
            cpu.step().map_err(SeekError::Cpu)?;
            stats.steps += 1;
        } else {
            cpu.run_to(target.rip).map_err(SeekError::Cpu)?;
            stats.breakpoint_runs += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated program: each instruction is plain, a conditional
    /// branch (counted), or a `rep` instruction that repeats RCX times at
    /// the same RIP without branching.
    #[derive(Clone, Copy)]
    enum Insn {
        Plain,
        /// Jumps back `back` instructions while its own counter lasts.
        Loop {
            back: usize,
            times: u32,
        },
        Rep {
            count: u64,
        },
    }

    struct Sim<'a> {
        program: &'a [Insn],
        pc: usize,
        branches: u64,
        rcx: u64,
        /// Remaining iterations of each loop instruction.
        loops: Vec<u32>,
        /// Instructions executed, the reference position.
        executed: u64,
        /// xorshift state for the skid.
        seed: u64,
        max_skid: u64,
    }

    impl<'a> Sim<'a> {
        fn new(program: &'a [Insn], seed: u64, max_skid: u64) -> Self {
            Sim {
                program,
                pc: 0,
                branches: 0,
                rcx: 0,
                loops: program
                    .iter()
                    .map(|i| match i {
                        Insn::Loop { times, .. } => *times,
                        _ => 0,
                    })
                    .collect(),
                executed: 0,
                seed: seed | 1,
                max_skid,
            }
        }

        fn rip(&self) -> u64 {
            0x1000 + 4 * self.pc as u64
        }

        fn random(&mut self) -> u64 {
            self.seed ^= self.seed << 13;
            self.seed ^= self.seed >> 7;
            self.seed ^= self.seed << 17;
            self.seed
        }

        /// One instruction (or one `rep` iteration).
        fn exec(&mut self) -> Result<(), &'static str> {
            if self.pc >= self.program.len() {
                return Err("ran off the end of the program");
            }
            self.executed += 1;
            match self.program[self.pc] {
                Insn::Plain => self.pc += 1,
                Insn::Loop { back, times } => {
                    self.branches += 1;
                    if self.loops[self.pc] > 0 {
                        self.loops[self.pc] -= 1;
                        self.pc -= back;
                    } else {
                        // Done; ready for the next time the loop is entered.
                        self.loops[self.pc] = times;
                        self.pc += 1;
                    }
                }
                Insn::Rep { count } => {
                    if self.rcx == 0 {
                        self.rcx = count; // loaded by the previous instruction
                    }
                    self.rcx -= 1;
                    if self.rcx == 0 {
                        self.pc += 1;
                    }
                }
            }
            Ok(())
        }
    }

    impl BranchCpu for Sim<'_> {
        type Error = &'static str;
        fn now(&self) -> Timestamp {
            Timestamp {
                branches: self.branches,
                rip: self.rip(),
                rcx: self.rcx,
            }
        }
        fn run_branches(&mut self, branches: u64) -> Result<(), Self::Error> {
            let until = self.branches + branches;
            while self.branches < until {
                self.exec()?;
            }
            // The overflow interrupt arrives late by up to max_skid
            // instructions.
            let skid = self.random() % (self.max_skid + 1);
            for _ in 0..skid {
                self.exec()?;
            }
            Ok(())
        }
        fn run_to(&mut self, rip: u64) -> Result<(), Self::Error> {
            self.exec()?;
            while self.rip() != rip {
                self.exec()?;
            }
            Ok(())
        }
        fn step(&mut self) -> Result<(), Self::Error> {
            self.exec()
        }
    }

    /// Nested loops with straight-line code and `rep` instructions: many
    /// instructions share a branch count, and `rep` iterations share RIP.
    fn program() -> Vec<Insn> {
        let mut p = vec![Insn::Plain; 3];
        p.push(Insn::Rep { count: 5 });
        p.extend([Insn::Plain; 4]);
        p.push(Insn::Loop { back: 6, times: 7 });
        p.push(Insn::Plain);
        p.push(Insn::Rep { count: 3 });
        p.push(Insn::Loop {
            back: 11,
            times: 40,
        });
        p.extend([Insn::Plain; 2]);
        p.push(Insn::Loop {
            back: 14,
            times: 30,
        });
        p.extend([Insn::Plain; 2]);
        p
    }

    /// Timestamps of every instruction of a reference run, with the
    /// instruction count at which each was reached.
    fn reference(program: &[Insn]) -> Vec<(u64, Timestamp)> {
        let mut sim = Sim::new(program, 1, 0);
        let mut points = Vec::new();
        while sim.pc < program.len() {
            points.push((sim.executed, sim.now()));
            sim.exec().unwrap();
        }
        points
    }

    #[test]
    fn timestamps_are_unique_positions() {
        let p = program();
        let points = reference(&p);
        let mut stamps: Vec<_> = points
            .iter()
            .map(|(_, t)| (t.branches, t.rip, t.rcx))
            .collect();
        stamps.sort();
        stamps.dedup();
        assert_eq!(stamps.len(), points.len(), "the test program is ambiguous");
        assert!(points.len() > 5000, "{} instructions", points.len());
    }

    #[test]
    fn seek_reaches_every_sampled_position_exactly_despite_skid() {
        let p = program();
        let points = reference(&p);
        let max_skid = 40;
        for (i, &(executed, target)) in points.iter().enumerate().step_by(997) {
            let mut sim = Sim::new(&p, i as u64 * 7919 + 3, max_skid);
            let stats = seek(&mut sim, target, max_skid + 2)
                .unwrap_or_else(|e| panic!("seeking {target:?}: {e}"));
            assert_eq!(sim.executed, executed, "stopped elsewhere for {target:?}");
            assert_eq!(sim.now(), target);
            if target.branches > max_skid + 2 {
                assert_eq!(stats.overflow_runs, 1);
            }
        }
    }

    #[test]
    fn seeking_from_a_recorded_position_to_the_next_works() {
        // Replay delivers events in order: seek from each to the next.
        let p = program();
        let points = reference(&p);
        let mut sim = Sim::new(&p, 99, 10);
        for &(executed, target) in points.iter().step_by(1009) {
            seek(&mut sim, target, 12).unwrap();
            assert_eq!(sim.executed, executed);
        }
    }

    #[test]
    fn a_margin_below_the_skid_is_detected_not_silently_wrong() {
        let p = program();
        let points = reference(&p);
        let (_, target) = points[points.len() / 2];
        let mut overshoots = 0;
        for seed in 0..50 {
            let mut sim = Sim::new(&p, seed, 400);
            match seek(&mut sim, target, 1) {
                Ok(_) => assert_eq!(sim.now(), target),
                Err(SeekError::Overshot { now, .. }) => {
                    assert!(now.branches > target.branches);
                    overshoots += 1;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(
            overshoots > 0,
            "a 400-instruction skid never overshot a 1-branch margin"
        );
    }

    #[test]
    fn a_position_already_passed_is_refused() {
        let p = program();
        let points = reference(&p);
        let (_, early) = points[100];
        let (_, late) = points[points.len() - 100];
        let mut sim = Sim::new(&p, 5, 0);
        seek(&mut sim, late, 4).unwrap();
        assert!(matches!(
            seek(&mut sim, early, 4),
            Err(SeekError::Overshot { .. })
        ));
    }
}
