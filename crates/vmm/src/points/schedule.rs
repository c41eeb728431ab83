//! A chaos schedule as data: every decision of the guest kernel's chaos
//! scheduler (guest kernel patch 0031) is the VMM's answer to a question
//! the kernel asks at a point named by its kind, the task and the task's
//! count of points. The recording logs question and answer (two MSR
//! writes and a read), so a trace holds its schedule; [`Schedule`] reads
//! it back, and a new recording can take the same decisions, or some left
//! out (`record --schedule TRACE:EDITS`, docs/chaos.md).

use std::collections::HashMap;
use std::fmt;
use std::ops::RangeInclusive;

use journal::{
    Entry, MSR_INSIGHT_CHAOS_CODE, MSR_INSIGHT_CHAOS_DECISION, MSR_INSIGHT_CHAOS_POINT,
    MSR_INSIGHT_CHAOS_WHERE,
};

/// Priorities below this are a change point's drops; drawn ones lie
/// above (the guest kernel's `INSIGHT_CHAOS_DROPPED`).
pub const DROPPED_BELOW: u64 = 0x1_0000;

/// The priority of a new task whose decision is left out: the middle of
/// the drawn range. Tasks of equal priority run as without chaos (the
/// running one goes on until it blocks, the others in the order they
/// became runnable).
pub const DEFAULT_PRIORITY: u64 = 1 << 29;

/// Where the guest kernel asks for a decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PointKind {
    /// A new task's priority (at its creation, or its exec).
    New,
    /// A system-call entry or return to user mode: no change, or a new
    /// priority.
    Entry,
    /// The user instructions to single-step to the next change point.
    Steps,
    /// A change point (the end of a run of steps): no change, or the
    /// priority the thread drops to.
    Drop,
    /// A tick: no change, or a new priority.
    Tick,
    /// The entry of `exit_group` from a thread whose process has other
    /// threads: no change, or the priority the thread drops to, so that
    /// they may run before the process ends.
    Exit,
}

impl PointKind {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => PointKind::New,
            2 => PointKind::Entry,
            3 => PointKind::Steps,
            4 => PointKind::Drop,
            5 => PointKind::Tick,
            6 => PointKind::Exit,
            _ => return None,
        })
    }

    fn code(self) -> u64 {
        match self {
            PointKind::New => 1,
            PointKind::Entry => 2,
            PointKind::Steps => 3,
            PointKind::Drop => 4,
            PointKind::Tick => 5,
            PointKind::Exit => 6,
        }
    }

    /// The answer that changes nothing: what a left-out decision becomes.
    pub fn default_value(self) -> u64 {
        match self {
            PointKind::New => DEFAULT_PRIORITY,
            _ => 0,
        }
    }
}

/// A point at which the guest kernel asks (`MSR_INSIGHT_CHAOS_POINT`):
/// the same in every run that takes the same decisions up to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChaosPoint {
    /// The task, numbered from 1 in order of appearance under chaos.
    pub task: u16,
    pub kind: PointKind,
    /// The task's points before this one; for a tick, that count shifted
    /// left 8 bits and or-ed with the ticks since (up to 255).
    pub count: u64,
}

impl ChaosPoint {
    /// The point the guest kernel wrote, if `word` is one.
    pub fn from_word(word: u64) -> Option<Self> {
        Some(ChaosPoint {
            kind: PointKind::from_code(word as u8)?,
            task: (word >> 8) as u16,
            count: word >> 24,
        })
    }

    pub fn word(&self) -> u64 {
        self.kind.code() | u64::from(self.task) << 8 | self.count << 24
    }
}

/// One decision: the point, the task's user instruction pointer there
/// (where it entered the kernel last), where its program's code starts
/// (0: not told), and the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub point: ChaosPoint,
    pub user_ip: u64,
    pub code_start: u64,
    pub value: u64,
}

impl Decision {
    /// Whether the decision is a choice of the schedule, one that can be
    /// left out: a priority other than the default, a change point that
    /// drops. Runs of steps are not: they only say where the next change
    /// point is.
    pub fn is_choice(&self) -> bool {
        self.point.kind != PointKind::Steps && self.value != self.point.kind.default_value()
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.point;
        let at = format!("task {} at user {:#x}", p.task, self.user_ip);
        match p.kind {
            PointKind::New => write!(f, "{at}: new task, priority {:#x}", self.value),
            PointKind::Entry if self.value == 0 => {
                write!(f, "{at}: kernel point {}, no change", p.count)
            }
            PointKind::Entry => write!(
                f,
                "{at}: kernel point {}, new priority {:#x}",
                p.count, self.value
            ),
            PointKind::Steps => write!(f, "{at}: point {}, {} steps", p.count, self.value),
            PointKind::Drop if self.value == 0 => {
                write!(f, "{at}: change point {}, no drop", p.count)
            }
            PointKind::Drop => write!(
                f,
                "{at}: change point {}, drops to {:#x}",
                p.count, self.value
            ),
            PointKind::Exit if self.value == 0 => {
                write!(f, "{at}: exit_group at point {}, no drop", p.count)
            }
            PointKind::Exit => write!(
                f,
                "{at}: exit_group at point {}, drops to {:#x}",
                p.count, self.value
            ),
            PointKind::Tick => write!(
                f,
                "{at}: tick {} after point {}, {}",
                p.count & 0xff,
                p.count >> 8,
                if self.value == 0 {
                    "no change".to_owned()
                } else {
                    format!("new priority {:#x}", self.value)
                }
            ),
        }
    }
}

/// What is wrong with a schedule's log or edits.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    #[error("log entry {entry}: chaos point {word:#x} of no known kind")]
    UnknownPoint { entry: u64, word: u64 },
    #[error("log entry {entry}: a chaos decision read with no point written before it")]
    NoPoint { entry: u64 },
    #[error("'{0}' is no schedule edit (drop=LIST or keep=LIST, LIST of numbers and ranges N-M)")]
    BadEdits(String),
    #[error("the schedule has {choices} choices: no choice {wanted}")]
    NoSuchChoice { wanted: usize, choices: usize },
}

/// Where a recording delivered the interrupt that made a tick: at a
/// deterministic exit the task made after its last decision that was no
/// tick's (the *anchor*), so that a re-run can deliver it at the task's
/// next such exit (`record --schedule`, docs/chaos.md). A single-stepped
/// task takes its ticks at exits only, most often the one that ends its
/// run of steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TickAt {
    /// The task's last decision before the tick that was no tick's.
    pub anchor: ChaosPoint,
    /// The exit the interrupt followed, compared by `Entry::same_exit`.
    pub exit: Entry,
}

/// A recording's decisions, in the order the guest asked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    pub decisions: Vec<Decision>,
    /// Where each tick's interrupt came, by the tick's point: only ticks
    /// whose interrupt came at a deterministic exit (not at an
    /// asynchronous point, which is no exit) after the task's anchor.
    pub ticks: HashMap<ChaosPoint, TickAt>,
}

impl Schedule {
    /// The decisions in a recording's log: each an `MSR_INSIGHT_CHAOS_POINT`
    /// write, an `MSR_INSIGHT_CHAOS_WHERE` write and an
    /// `MSR_INSIGHT_CHAOS_DECISION` read.
    pub fn from_log(
        entries: impl IntoIterator<Item = Result<Entry, ScheduleError>>,
    ) -> Result<Self, ScheduleError> {
        let mut decisions = Vec::new();
        let mut ticks = HashMap::new();
        let (mut point, mut user_ip, mut code_start) = (None, 0, 0);
        // Each task's last decision that was no tick's, with its entry's
        // number; the last exit, and the last interrupt: the exit it
        // followed (none at an asynchronous point) and its entry's number.
        let mut anchors: HashMap<u16, (ChaosPoint, u64)> = HashMap::new();
        let mut last_exit: Option<Entry> = None;
        let mut delivered: Option<(Option<Entry>, u64)> = None;
        for (n, entry) in entries.into_iter().enumerate() {
            let entry_no = n as u64 + 1;
            let entry = entry?;
            match &entry {
                e if e.is_exit() => last_exit = Some(e.clone()),
                Entry::AsyncPoint(_) => last_exit = None,
                Entry::Interrupt { .. } => delivered = Some((last_exit.clone(), entry_no)),
                _ => {}
            }
            match entry {
                Entry::WrMsr {
                    index,
                    value,
                    fault: false,
                    ..
                } if index == MSR_INSIGHT_CHAOS_POINT => {
                    point = Some(ChaosPoint::from_word(value).ok_or(
                        ScheduleError::UnknownPoint {
                            entry: entry_no,
                            word: value,
                        },
                    )?);
                    user_ip = 0;
                }
                Entry::WrMsr {
                    index,
                    value,
                    fault: false,
                    ..
                } if index == MSR_INSIGHT_CHAOS_WHERE => user_ip = value,
                Entry::WrMsr {
                    index,
                    value,
                    fault: false,
                    ..
                } if index == MSR_INSIGHT_CHAOS_CODE => code_start = value,
                Entry::RdMsr {
                    index,
                    value,
                    fault: false,
                    ..
                } if index == MSR_INSIGHT_CHAOS_DECISION => {
                    let point = point
                        .take()
                        .ok_or(ScheduleError::NoPoint { entry: entry_no })?;
                    match (point.kind, anchors.get(&point.task), &delivered) {
                        (PointKind::Tick, Some(&(anchor, at)), Some((Some(exit), after)))
                            if *after > at =>
                        {
                            let exit = exit.clone();
                            ticks.insert(point, TickAt { anchor, exit });
                        }
                        (PointKind::Tick, ..) => {}
                        _ => {
                            anchors.insert(point.task, (point, entry_no));
                        }
                    }
                    decisions.push(Decision {
                        point,
                        user_ip,
                        code_start,
                        value,
                    });
                }
                _ => {}
            }
        }
        Ok(Schedule { decisions, ticks })
    }

    /// The decisions that are choices (`Decision::is_choice`), numbered
    /// from 1 as edits name them.
    pub fn choices(&self) -> impl Iterator<Item = (usize, &Decision)> {
        self.decisions
            .iter()
            .filter(|d| d.is_choice())
            .enumerate()
            .map(|(i, d)| (i + 1, d))
    }

    /// The decisions to force in a new run: all of them, but the choices
    /// `edits` leaves out (given their default). A tick's choice whose
    /// interrupt came at a deterministic exit is forced there
    /// ([`ForcedTick`]); another, whenever a tick comes at its point.
    pub fn forced(&self, edits: &ScheduleEdits) -> Result<ForcedDecisions, ScheduleError> {
        let choices = self.choices().count();
        let kept = edits.kept(choices)?;
        let mut answers = HashMap::new();
        let mut ticks = Vec::new();
        let mut choice = 0;
        for d in &self.decisions {
            if d.is_choice() {
                choice += 1;
                if !kept[choice - 1] {
                    continue;
                }
                if let Some(at) = self.ticks.get(&d.point) {
                    ticks.push(ForcedTick {
                        point: d.point,
                        value: d.value,
                        at: at.clone(),
                    });
                    continue;
                }
            }
            answers.insert(d.point, d.value);
        }
        Ok(ForcedDecisions { answers, ticks })
    }
}

/// A tick's choice forced where the recording took it: after the
/// decision at `at.anchor`, the task's next exit like `at.exit` is given
/// the timer's interrupt, and the task's next tick takes `value`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForcedTick {
    pub point: ChaosPoint,
    pub value: u64,
    pub at: TickAt,
}

/// The answers a re-run gives: at a point of the schedule its decision,
/// elsewhere the default (no change); and the ticks to force.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForcedDecisions {
    answers: HashMap<ChaosPoint, u64>,
    pub ticks: Vec<ForcedTick>,
}

impl ForcedDecisions {
    pub fn answer(&self, point: ChaosPoint) -> u64 {
        self.answers
            .get(&point)
            .copied()
            .unwrap_or(point.kind.default_value())
    }
}

/// Which of a schedule's choices a re-run takes: `drop=LIST` all but
/// those, `keep=LIST` only those; LIST is numbers and ranges (`3,7,10-12`)
/// of choices numbered from 1 (`insight dump --schedule`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ScheduleEdits {
    /// All of them.
    #[default]
    None,
    Drop(Vec<RangeInclusive<usize>>),
    Keep(Vec<RangeInclusive<usize>>),
}

impl ScheduleEdits {
    pub fn parse(text: &str) -> Result<Self, ScheduleError> {
        let bad = || ScheduleError::BadEdits(text.to_owned());
        let (keep, list) = if let Some(list) = text.strip_prefix("drop=") {
            (false, list)
        } else if let Some(list) = text.strip_prefix("keep=") {
            (true, list)
        } else {
            return Err(bad());
        };
        let mut ranges = Vec::new();
        for item in list.split(',').filter(|i| !i.is_empty()) {
            let (a, b) = item.split_once('-').unwrap_or((item, item));
            let (a, b): (usize, usize) = (
                a.trim().parse().map_err(|_| bad())?,
                b.trim().parse().map_err(|_| bad())?,
            );
            if a == 0 || b < a {
                return Err(bad());
            }
            ranges.push(a..=b);
        }
        Ok(if keep {
            ScheduleEdits::Keep(ranges)
        } else {
            ScheduleEdits::Drop(ranges)
        })
    }

    /// Keep only the choices in `kept` (numbered from 1).
    pub fn keep_only(kept: &[usize]) -> Self {
        ScheduleEdits::Keep(kept.iter().map(|&c| c..=c).collect())
    }

    /// Whether each of `choices` choices is kept.
    pub fn kept(&self, choices: usize) -> Result<Vec<bool>, ScheduleError> {
        let (ranges, listed) = match self {
            ScheduleEdits::None => return Ok(vec![true; choices]),
            ScheduleEdits::Drop(r) => (r, false),
            ScheduleEdits::Keep(r) => (r, true),
        };
        let mut kept = vec![!listed; choices];
        for r in ranges {
            if *r.end() > choices {
                return Err(ScheduleError::NoSuchChoice {
                    wanted: *r.end(),
                    choices,
                });
            }
            for c in r.clone() {
                kept[c - 1] = listed;
            }
        }
        Ok(kept)
    }
}

impl fmt::Display for ScheduleEdits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (what, ranges) = match self {
            ScheduleEdits::None => return Ok(()),
            ScheduleEdits::Drop(r) => ("drop", r),
            ScheduleEdits::Keep(r) => ("keep", r),
        };
        let list: Vec<String> = ranges
            .iter()
            .map(|r| match r.start() == r.end() {
                true => r.start().to_string(),
                false => format!("{}-{}", r.start(), r.end()),
            })
            .collect();
        write!(f, "{what}={}", list.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(point: ChaosPoint, ip: u64, value: u64) -> Vec<Result<Entry, ScheduleError>> {
        vec![
            Ok(Entry::WrMsr {
                index: MSR_INSIGHT_CHAOS_POINT,
                rip: 1,
                value: point.word(),
                fault: false,
            }),
            Ok(Entry::WrMsr {
                index: MSR_INSIGHT_CHAOS_WHERE,
                rip: 2,
                value: ip,
                fault: false,
            }),
            Ok(Entry::RdMsr {
                index: MSR_INSIGHT_CHAOS_DECISION,
                rip: 3,
                value,
                fault: false,
            }),
        ]
    }

    fn point(task: u16, kind: PointKind, count: u64) -> ChaosPoint {
        ChaosPoint { task, kind, count }
    }

    #[test]
    fn a_point_word_is_read_back_as_the_kernel_packs_it() {
        let p = ChaosPoint::from_word(0x0000_0123_0002_0304).unwrap();
        assert_eq!(p, point(0x0203, PointKind::Drop, 0x0001_2300));
        assert_eq!(p.word(), 0x0000_0123_0002_0304);
        assert_eq!(ChaosPoint::from_word(0x0100), None);
        assert_eq!(ChaosPoint::from_word(7), None);
        let exit = ChaosPoint::from_word(0x0000_0009_0003_0106).unwrap();
        assert_eq!(exit, point(0x0301, PointKind::Exit, 0x0900));
        assert_eq!(exit.word(), 0x0000_0009_0003_0106);
    }

    #[test]
    fn the_log_gives_the_decisions_and_their_choices() {
        let mut log = vec![Ok(Entry::WrMsr {
            index: MSR_INSIGHT_CHAOS_CODE,
            rip: 0,
            value: 0x5555_0000_1000,
            fault: false,
        })];
        log.extend(asked(point(1, PointKind::New, 0), 0x40, DEFAULT_PRIORITY));
        log.extend(asked(point(2, PointKind::New, 0), 0x41, 0x7777_0000));
        log.extend(asked(point(2, PointKind::Steps, 1), 0x42, 17));
        log.extend(asked(point(2, PointKind::Drop, 2), 0x43, 0x99));
        log.extend(asked(point(1, PointKind::Entry, 1), 0x44, 0));
        log.extend(asked(point(1, PointKind::Exit, 2), 0x45, 0x55));
        log.extend(asked(point(2, PointKind::Exit, 3), 0x46, 0));
        log.insert(
            3,
            Ok(Entry::RdMsr {
                index: 0x10,
                rip: 0,
                value: 5,
                fault: false,
            }),
        );
        let s = Schedule::from_log(log).unwrap();
        assert_eq!(s.decisions.len(), 7);
        assert_eq!(s.decisions[3].user_ip, 0x43);
        assert_eq!(s.decisions[4].code_start, 0x5555_0000_1000);
        let choices: Vec<_> = s
            .choices()
            .map(|(n, d)| (n, d.point.task, d.value))
            .collect();
        assert_eq!(choices, [(1, 2, 0x7777_0000), (2, 2, 0x99), (3, 1, 0x55)]);
        assert_eq!(
            s.decisions[3].to_string(),
            "task 2 at user 0x43: change point 2, drops to 0x99"
        );
        assert_eq!(
            s.decisions[5].to_string(),
            "task 1 at user 0x45: exit_group at point 2, drops to 0x55"
        );

        let all = s.forced(&ScheduleEdits::None).unwrap();
        assert_eq!(all.answer(point(2, PointKind::New, 0)), 0x7777_0000);
        assert_eq!(all.answer(point(2, PointKind::Steps, 1)), 17);
        // A point the schedule never reached: no change.
        assert_eq!(all.answer(point(3, PointKind::New, 0)), DEFAULT_PRIORITY);
        assert_eq!(all.answer(point(2, PointKind::Drop, 9)), 0);
        assert_eq!(all.answer(point(1, PointKind::Exit, 2)), 0x55);

        let dropped = s.forced(&ScheduleEdits::parse("drop=2").unwrap()).unwrap();
        assert_eq!(dropped.answer(point(2, PointKind::New, 0)), 0x7777_0000);
        assert_eq!(dropped.answer(point(2, PointKind::Drop, 2)), 0);
        assert_eq!(dropped.answer(point(2, PointKind::Steps, 1)), 17);
        let kept = s.forced(&ScheduleEdits::keep_only(&[2])).unwrap();
        assert_eq!(kept.answer(point(2, PointKind::New, 0)), DEFAULT_PRIORITY);
        assert_eq!(kept.answer(point(2, PointKind::Drop, 2)), 0x99);
        assert_eq!(kept.answer(point(1, PointKind::Exit, 2)), 0);
        assert_eq!(
            s.forced(&ScheduleEdits::parse("drop=1-4").unwrap()),
            Err(ScheduleError::NoSuchChoice {
                wanted: 4,
                choices: 3
            })
        );
    }

    fn sync() -> Entry {
        Entry::Out {
            port: 0xf00,
            size: 4,
            rip: 9,
            value: 0x500_0000,
        }
    }

    #[test]
    fn a_ticks_interrupt_is_placed_at_the_exit_it_followed() {
        let tick = |task: u16, n: u64| point(task, PointKind::Tick, 5 << 8 | n);
        let mut log = asked(point(2, PointKind::Steps, 4), 0x40, 9);
        // Another task's decision between: the anchor stays task 2's.
        log.extend(asked(point(3, PointKind::Entry, 7), 0x50, 0));
        log.extend([Ok(sync()), Ok(Entry::Interrupt { vector: 0x30 })]);
        log.extend(asked(tick(2, 0), 0x41, 0x7000_0000));
        // A tick whose interrupt came before the task's anchor is not
        // placed, nor one of a task with no anchor.
        log.extend(asked(point(2, PointKind::Drop, 5), 0x42, 0x99));
        log.extend(asked(point(2, PointKind::Tick, 6 << 8), 0x43, 0x6000_0000));
        log.extend(asked(tick(4, 0), 0x44, 0x5000_0000));
        let s = Schedule::from_log(log).unwrap();
        assert_eq!(s.ticks.len(), 1);
        let at = &s.ticks[&tick(2, 0)];
        assert_eq!(at.anchor, point(2, PointKind::Steps, 4));
        assert!(at.exit.same_exit(&sync()));
        let mut other = sync();
        if let Entry::Out { value, .. } = &mut other {
            *value = 0x500_0001;
        }
        assert!(!at.exit.same_exit(&other));
        // Forced there, not by its point; the unplaced ones by their point.
        let forced = s.forced(&ScheduleEdits::None).unwrap();
        assert_eq!(forced.ticks.len(), 1);
        assert_eq!(forced.ticks[0].point, tick(2, 0));
        assert_eq!(forced.ticks[0].value, 0x7000_0000);
        assert_eq!(forced.answer(tick(2, 0)), 0);
        assert_eq!(
            forced.answer(point(2, PointKind::Tick, 6 << 8)),
            0x6000_0000
        );
        let none = s.forced(&ScheduleEdits::parse("keep=").unwrap()).unwrap();
        assert!(none.ticks.is_empty());
    }

    #[test]
    fn a_bad_log_is_named() {
        let mut log = asked(point(1, PointKind::New, 0), 0, 1);
        let _ = log.remove(0);
        assert_eq!(
            Schedule::from_log(log),
            Err(ScheduleError::NoPoint { entry: 2 })
        );
        let log = vec![Ok(Entry::WrMsr {
            index: MSR_INSIGHT_CHAOS_POINT,
            rip: 0,
            value: 9,
            fault: false,
        })];
        assert_eq!(
            Schedule::from_log(log),
            Err(ScheduleError::UnknownPoint { entry: 1, word: 9 })
        );
    }

    #[test]
    fn edits_parse_and_print() {
        let e = ScheduleEdits::parse("drop=3,7,10-12").unwrap();
        assert_eq!(e, ScheduleEdits::Drop(vec![3..=3, 7..=7, 10..=12]));
        assert_eq!(e.to_string(), "drop=3,7,10-12");
        assert_eq!(
            e.kept(12).unwrap(),
            [true, true, false, true, true, true, false, true, true, false, false, false]
        );
        assert_eq!(
            ScheduleEdits::parse("keep=").unwrap().kept(2).unwrap(),
            [false, false]
        );
        for bad in ["3,4", "drop=0", "drop=4-2", "keep=x", "drop=1-"] {
            assert!(ScheduleEdits::parse(bad).is_err(), "{bad}");
        }
    }
}
