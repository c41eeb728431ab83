//! `insight why TRACE -- COMMAND`: which choices of a failing chaos
//! recording's schedule make the command fail (docs/chaos.md, "Why it
//! failed"). The command is recorded again with the schedule's choices
//! forced, some left out (`record --schedule TRACE:keep=LIST`), and delta
//! debugging (Zeller's ddmin) narrows them to a set that still fails while
//! each of its choices left out alone makes a passing neighbour.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use events::abi::Kind;
use events::db::EventDb;
use guestfiles::Symbolizer;
use journal::EndReason;
use vmm::{Decision, PointKind, Schedule, ScheduleEdits};

use super::schedule::{read_schedule, Recorded};
use crate::exit::EXIT_HUNG;

#[derive(clap::Args)]
pub struct WhyArgs {
    /// The failing chaos recording (`record --chaos --until-fail`): a
    /// trace directory or a recording's name in the trace store.
    trace: PathBuf,
    /// Record the command again at most this many times.
    #[arg(long, value_name = "N", default_value_t = 80)]
    max_runs: u32,
    /// Each run's `record --timeout` (a hang fails as the recording's did).
    #[arg(long, value_name = "DURATION", default_value = "20s",
          value_parser = crate::position::parse_duration)]
    timeout: Duration,
    /// Then record the minimal set's schedule again this many times, and
    /// each of its passing neighbours (one choice left out) as many, one
    /// after the other, and count how often each failed as recorded and
    /// how often it passed: whether the answer holds run after run.
    #[arg(long, value_name = "N", default_value_t = 0)]
    confirm: u32,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// The recording's command, as it was recorded (checked against the
    /// trace header).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

pub fn why(args: WhyArgs) -> Result<ExitCode> {
    let recorded = read_schedule(&args.trace)?;
    let Some(end) = recorded.end.clone() else {
        bail!(
            "{} has no end: an incomplete recording has no failure to explain",
            recorded.trace.display()
        );
    };
    let failing_status = match &end {
        EndReason::CommandExited(s) if *s != 0 => *s,
        EndReason::Hung { .. } => EXIT_HUNG,
        other => bail!(
            "{} did not fail ({other}): nothing to explain",
            recorded.trace.display()
        ),
    };
    let choices = recorded.schedule.choices().count();
    let scratch = std::env::temp_dir().join(format!("insight-why-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)
        .with_context(|| format!("cannot create {}", scratch.display()))?;
    let started = Instant::now();
    let mut runner = Runner {
        recorded: &recorded,
        command: &args.command,
        timeout: args.timeout,
        scratch: &scratch,
        failing_status,
        runs: 0,
        max_runs: args.max_runs,
        known: HashMap::new(),
        confirm_runs: 0,
    };
    let result = explain(&mut runner, choices).map(|explained| {
        // Without them the positions are addresses: still an answer.
        let places = match &explained.minimal_run {
            Some((run, dir)) => places(dir, run, &args.command, &scratch).unwrap_or_else(|e| {
                eprintln!("insight: the positions are not placed in the program: {e:#}");
                HashMap::new()
            }),
            None => HashMap::new(),
        };
        (explained, places)
    });
    let result = result.and_then(|(explained, places)| {
        let confirmed = match explained.reproduced && explained.complete {
            true => confirm(&mut runner, &explained.minimal, args.confirm)?,
            false => None,
        };
        Ok((explained, places, confirmed))
    });
    let _ = std::fs::remove_dir_all(&scratch);
    let (explained, places, confirmed) = result?;
    let elapsed = started.elapsed();
    let report = Report::new(&recorded, &explained, &places);
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "trace": recorded.trace,
                "end": end.to_string(),
                "choices": choices,
                "runs": runner.runs,
                "seconds": elapsed.as_secs_f64(),
                "minimal": report.json(),
                "at_end": report.at_end_json(),
                "reproduced": explained.reproduced,
                "complete": explained.complete,
                "confirmed": confirmed.as_ref().map(Confirmed::json),
            })
        );
    } else {
        println!(
            "{} ended: {end}. Its schedule has {choices} choices; {} re-runs in {:.1} s.",
            recorded.trace.display(),
            runner.runs,
            elapsed.as_secs_f64()
        );
        print!("{}", report.text(&explained));
        if let Some(c) = &confirmed {
            print!("{}", c.text());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What the runs found.
struct Explained {
    /// The forced schedule, all choices kept, failed again.
    reproduced: bool,
    /// The choices that still fail, and the schedule of the run that took
    /// them, with its recording.
    minimal: Vec<usize>,
    minimal_run: Option<(Schedule, PathBuf)>,
    /// Each choice of `minimal` left out alone passed (1-minimal), within
    /// the runs allowed.
    complete: bool,
}

fn explain(runner: &mut Runner<'_>, choices: usize) -> Result<Explained> {
    let all: Vec<usize> = (1..=choices).collect();
    if !runner.fails(&all)? {
        return Ok(Explained {
            reproduced: false,
            minimal: all,
            minimal_run: None,
            complete: false,
        });
    }
    let mut complete = true;
    let minimal = ddmin(&all, |set| match runner.fails(set) {
        Ok(f) => Ok(f),
        Err(e) if e.is::<OutOfRuns>() => {
            complete = false;
            Ok(false)
        }
        Err(e) => Err(e),
    })?;
    // The run of the minimal set, again, for the positions it reached.
    let minimal_run = match minimal.is_empty() {
        true => None,
        false => runner.recording_of(&minimal)?,
    };
    Ok(Explained {
        reproduced: true,
        minimal,
        minimal_run,
        complete,
    })
}

/// The minimal set and its neighbours recorded again (`--confirm N`).
struct Confirmed {
    runs: u32,
    /// The minimal set's runs that failed as recorded, and those that
    /// exited 0.
    minimal: Outcomes,
    /// Each neighbour by the choice left out.
    neighbours: Vec<(usize, Outcomes)>,
}

#[derive(Clone, Copy, Default)]
struct Outcomes {
    failed: u32,
    passed: u32,
}

impl Outcomes {
    fn add(&mut self, status: Option<i32>, failing: u8) {
        match status {
            Some(0) => self.passed += 1,
            s if s == Some(i32::from(failing)) => self.failed += 1,
            _ => {}
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"failed": self.failed, "passed": self.passed})
    }
}

impl Confirmed {
    fn text(&self) -> String {
        let mut s = format!(
            "Recorded again {} times each: the minimal set failed as recorded {} times \
             (passed {});\n",
            self.runs, self.minimal.failed, self.minimal.passed
        );
        for (left_out, o) in &self.neighbours {
            s += &format!(
                "  without choice {left_out}: passed {} times (failed as recorded {})\n",
                o.passed, o.failed
            );
        }
        s
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "runs": self.runs,
            "minimal": self.minimal.json(),
            "neighbours": (self.neighbours.iter())
                .map(|(c, o)| {
                    let mut neighbour = o.json();
                    neighbour["left_out"] = (*c).into();
                    neighbour
                })
                .collect::<Vec<_>>(),
        })
    }
}

/// `runs` rounds of the minimal set's run and each neighbour's, in turns
/// (a host's load then weighs on them alike); none without runs or a set.
fn confirm(runner: &mut Runner<'_>, minimal: &[usize], runs: u32) -> Result<Option<Confirmed>> {
    if runs == 0 || minimal.is_empty() {
        return Ok(None);
    }
    let mut confirmed = Confirmed {
        runs,
        minimal: Outcomes::default(),
        neighbours: minimal.iter().map(|&c| (c, Outcomes::default())).collect(),
    };
    let failing = runner.failing_status;
    for _ in 0..runs {
        let status = runner.status(minimal)?;
        confirmed.minimal.add(status, failing);
        for (left_out, outcomes) in &mut confirmed.neighbours {
            let rest: Vec<usize> = minimal.iter().copied().filter(|c| c != left_out).collect();
            outcomes.add(runner.status(&rest)?, failing);
        }
    }
    Ok(Some(confirmed))
}

/// The runs were used up.
#[derive(Debug)]
struct OutOfRuns;

impl std::fmt::Display for OutOfRuns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no runs left (--max-runs)")
    }
}

impl std::error::Error for OutOfRuns {}

/// Records the command with some of the schedule's choices.
struct Runner<'a> {
    recorded: &'a Recorded,
    command: &'a [String],
    timeout: Duration,
    scratch: &'a Path,
    failing_status: u8,
    runs: u32,
    max_runs: u32,
    known: HashMap<Vec<usize>, bool>,
    /// Runs of `--confirm`, beyond `runs`.
    confirm_runs: u32,
}

impl Runner<'_> {
    /// Whether the command fails as recorded with only the choices `kept`.
    fn fails(&mut self, kept: &[usize]) -> Result<bool> {
        if let Some(&f) = self.known.get(kept) {
            return Ok(f);
        }
        let (fails, _) = self.run(kept, false)?;
        self.known.insert(kept.to_vec(), fails);
        Ok(fails)
    }

    /// The schedule a run with only the choices `kept` took and its
    /// recording, if it failed.
    fn recording_of(&mut self, kept: &[usize]) -> Result<Option<(Schedule, PathBuf)>> {
        self.max_runs = self.max_runs.max(self.runs + 1);
        let (fails, kept_run) = self.run(kept, true)?;
        Ok(kept_run.filter(|_| fails))
    }

    /// The exit status of a run with only the choices `kept` (`--confirm`,
    /// beyond `--max-runs`).
    fn status(&mut self, kept: &[usize]) -> Result<Option<i32>> {
        self.confirm_runs += 1;
        let (code, out) = self.record(kept, &format!("confirm-{}", self.confirm_runs))?;
        let _ = std::fs::remove_dir_all(&out);
        Ok(code)
    }

    fn run(&mut self, kept: &[usize], keep: bool) -> Result<(bool, Option<(Schedule, PathBuf)>)> {
        if self.runs >= self.max_runs {
            return Err(OutOfRuns.into());
        }
        self.runs += 1;
        let (code, out) = self.record(kept, &format!("run-{}", self.runs))?;
        if self.runs == 1 {
            check_same_command(&self.recorded.trace, &out)?;
        }
        let fails = code == Some(i32::from(self.failing_status));
        if keep {
            return Ok((fails, Some((read_schedule(&out)?.schedule, out))));
        }
        let _ = std::fs::remove_dir_all(&out);
        Ok((fails, None))
    }

    /// Records the run `name` with only the choices `kept`: its exit
    /// status and its trace.
    fn record(&mut self, kept: &[usize], name: &str) -> Result<(Option<i32>, PathBuf)> {
        let out = self.scratch.join(name);
        let edits = ScheduleEdits::keep_only(kept);
        let exe = std::env::current_exe().context("cannot find insight's own executable")?;
        let status = Command::new(exe)
            .args(["record", "--no-stdin", "--sample-period", "off", "-o"])
            .arg(&out)
            .arg("--timeout")
            .arg(format!("{}ms", self.timeout.as_millis()))
            .arg("--schedule")
            .arg(format!("{}:{edits}", self.recorded.trace.display()))
            .arg("--")
            .args(self.command)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .context("cannot run insight record")?;
        let code = status.status.code();
        if code == Some(125) || code.is_none() {
            bail!(
                "insight record failed: {}",
                String::from_utf8_lossy(&status.stderr).trim()
            );
        }
        Ok((code, out))
    }
}

/// The re-run recorded the recording's command (the trace headers' configs
/// agree).
fn check_same_command(recorded: &Path, rerun: &Path) -> Result<()> {
    let a = super::open_trace(recorded)?.header.config.clone();
    let b = super::open_trace(rerun)?.header.config.clone();
    if a != b {
        bail!(
            "the command given is not the recording's: {} recorded\n{a}\nbut this runs\n{b}",
            recorded.display()
        );
    }
    Ok(())
}

/// Zeller's ddmin: a subset of `all` for which `fails` holds (it holds for
/// `all`) that is 1-minimal: left out any one element, it no longer does.
pub(crate) fn ddmin(
    all: &[usize],
    mut fails: impl FnMut(&[usize]) -> Result<bool>,
) -> Result<Vec<usize>> {
    let mut current = all.to_vec();
    let mut parts = 2;
    if !current.is_empty() && fails(&[])? {
        return Ok(Vec::new());
    }
    while current.len() >= 2 {
        let chunks = split(&current, parts);
        let mut reduced = false;
        for chunk in &chunks {
            if fails(chunk)? {
                current = chunk.clone();
                parts = 2;
                reduced = true;
                break;
            }
        }
        if !reduced && parts > 2 {
            for chunk in &chunks {
                let rest: Vec<usize> = current
                    .iter()
                    .copied()
                    .filter(|c| !chunk.contains(c))
                    .collect();
                if fails(&rest)? {
                    current = rest;
                    parts = (parts - 1).max(2);
                    reduced = true;
                    break;
                }
            }
        }
        if !reduced {
            if parts >= current.len() {
                break;
            }
            parts = (parts * 2).min(current.len());
        }
    }
    Ok(current)
}

/// `items` in `parts` nearly equal runs.
fn split(items: &[usize], parts: usize) -> Vec<Vec<usize>> {
    let mut chunks = Vec::new();
    let mut start = 0;
    for i in 0..parts {
        let end = start + (items.len() - start) / (parts - i);
        chunks.push(items[start..end].to_vec());
        start = end;
    }
    chunks.retain(|c| !c.is_empty());
    chunks
}

/// Where a decision of a run stood.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Place {
    /// "function+0x1f in object (file.c:42)", and, in a library, the
    /// program's frame that called into it.
    at: String,
    /// The program's own source line ("file.c:42"): of its first frame on
    /// the task's stack.
    line: Option<String>,
    /// The whole stack, each frame described as `at` is, innermost first.
    stack: Vec<String>,
}

/// Where the decisions of the run recorded in `dir` (its `schedule`)
/// stood, by their index: a replay of it samples the task at each
/// decision (`replay --decision-samples`), its user stack unwound by the
/// call-frame information of the program and the libraries it loaded,
/// as the process's memory shows them. Decisions without a sample
/// (kernel threads') have no place.
fn places(
    dir: &Path,
    schedule: &Schedule,
    command: &[String],
    scratch: &Path,
) -> Result<HashMap<usize, Place>> {
    let db = scratch.join("places.db");
    let exe = std::env::current_exe().context("cannot find insight's own executable")?;
    let out = Command::new(exe)
        .args(["replay", "--decision-samples", "--events"])
        .arg(&db)
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .context("cannot run insight replay")?;
    if !out.status.success() {
        bail!(
            "the replay that finds the positions' lines failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let events = EventDb::open(&db)?;
    let mut samples: Vec<(u32, Vec<u64>)> = Vec::new();
    events.for_each_with_stacks(&[Kind::Sample], |row, stack| {
        samples.push((row.pid, stack.unwrap_or_default().to_vec()));
        Ok(())
    })?;
    let debug_dir = Path::new(super::report::DEFAULT_DEBUG_DIR);
    let files = super::report::files_of_events(&events, Some(dir), debug_dir)?;
    let mut sym = Symbolizer::new(&files);
    let mut pids: Vec<u32> = samples.iter().map(|s| s.0).collect();
    pids.sort_unstable();
    pids.dedup();
    for pid in pids {
        sym.add_process(pid, events.objects(pid)?);
    }
    let program = command.first().map(|p| file_name(p)).unwrap_or_default();
    // The samples come in the decisions' order, one for each decision of
    // a task of a process, its user position first.
    let mut found = HashMap::new();
    let mut next = 0;
    for (pid, stack) in &samples {
        let Some(&ip) = stack.first() else {
            continue;
        };
        let Some(i) =
            (next..schedule.decisions.len()).find(|&i| schedule.decisions[i].user_ip == ip)
        else {
            continue;
        };
        next = i + 1;
        found.insert(i, place(&mut sym, *pid, stack, program));
    }
    Ok(found)
}

/// The last part of a path.
fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Where a task of process `pid` stood, by its user `stack` (its position,
/// then return addresses): there, and in a library, the first frame in
/// the `program` that called into it, whose line is the program's.
fn place(sym: &mut Symbolizer, pid: u32, stack: &[u64], program: &str) -> Place {
    // A return address is described at its call, the byte before it.
    let code = |i: usize, addr: u64| if i == 0 { addr } else { addr.saturating_sub(1) };
    let at = sym.describe_code(pid, stack[0]);
    let frames = (stack.iter().enumerate())
        .map(|(i, &a)| sym.describe_code(pid, code(i, a)))
        .collect();
    let in_program = (stack.iter().enumerate())
        .map(|(i, &a)| code(i, a))
        .position(|a| sym.object(pid, a).is_some_and(|o| file_name(o) == program));
    match in_program {
        Some(0) => Place {
            line: sym.line(pid, stack[0]),
            at,
            stack: frames,
        },
        Some(i) => {
            let call = code(i, stack[i]);
            Place {
                at: format!("{at}, called from {}", sym.describe_code(pid, call)),
                line: sym.line(pid, call),
                stack: frames,
            }
        }
        None => Place {
            at,
            line: None,
            stack: frames,
        },
    }
}

/// One choice of the minimal set, and where the other tasks ran to.
struct Finding {
    choice: usize,
    decision: Decision,
    at: Option<Place>,
    others: Vec<(u16, Place)>,
}

struct Report {
    findings: Vec<Finding>,
    /// Where each task of the minimal run last stood in the program before
    /// it failed (a deadlock's tasks: where they wait).
    at_end: Vec<(u16, Place)>,
}

impl Report {
    /// The minimal set's choices, placed by the decisions of its run
    /// (`places`, by their index there).
    fn new(recorded: &Recorded, explained: &Explained, places: &HashMap<usize, Place>) -> Self {
        let chosen: Vec<(usize, Decision)> = recorded
            .schedule
            .choices()
            .filter(|(n, _)| explained.minimal.contains(n))
            .map(|(n, d)| (n, *d))
            .collect();
        let mut findings = Vec::new();
        for (choice, decision) in chosen {
            let mut others = Vec::new();
            let mut at = None;
            let run = explained.minimal_run.as_ref().map(|(run, _)| run);
            let index =
                run.and_then(|r| r.decisions.iter().position(|d| d.point == decision.point));
            if let (Some(run), Some(i)) = (run, index) {
                at = places.get(&i).cloned();
                // Where each other task next asked in the program's code
                // after this choice, in the minimal run: how far it ran
                // while this task was switched out.
                let mut seen = Vec::new();
                for (j, d) in run.decisions.iter().enumerate().skip(i + 1) {
                    if d.point.task == decision.point.task {
                        break;
                    }
                    if seen.contains(&d.point.task) {
                        continue;
                    }
                    if let Some(place) = places.get(&j).filter(|p| p.line.is_some()) {
                        seen.push(d.point.task);
                        others.push((d.point.task, place.clone()));
                    }
                }
            }
            findings.push(Finding {
                choice,
                decision,
                at,
                others,
            });
        }
        let mut at_end: Vec<(u16, Place)> = Vec::new();
        if let Some((run, _)) = &explained.minimal_run {
            for (i, d) in run.decisions.iter().enumerate().rev() {
                if at_end.iter().any(|(t, _)| *t == d.point.task) {
                    continue;
                }
                if let Some(place) = places.get(&i).filter(|p| p.line.is_some()) {
                    at_end.push((d.point.task, place.clone()));
                }
            }
            at_end.sort_by_key(|(t, _)| *t);
        }
        Report { findings, at_end }
    }

    fn text(&self, explained: &Explained) -> String {
        let mut s = String::new();
        if !explained.reproduced {
            s += "The schedule forced again did not fail: the failure depends on more than \
                  the schedule's decisions (ticks fall where the host's time puts them); \
                  nothing narrowed.\n";
            return s;
        }
        if self.findings.is_empty() {
            s += "It fails with none of the schedule's choices: not an interleaving of chaos.\n";
            return s;
        }
        s += &format!(
            "It fails with {} of them{}; each left out alone, it passes:\n",
            self.findings.len(),
            if explained.complete {
                ""
            } else {
                " (the runs ran out before that was checked)"
            }
        );
        for f in &self.findings {
            let d = &f.decision;
            let what = match d.point.kind {
                PointKind::New => "starts with a priority that orders it",
                PointKind::Drop => "is switched out (change point)",
                PointKind::Entry => "gets a new priority at a kernel entry or exit",
                PointKind::Tick => "gets a new priority at a tick",
                PointKind::Exit => "is switched out at its exit_group",
                PointKind::Steps => "steps",
            };
            let at = match &f.at {
                Some(place) => place.at.clone(),
                None => format!("{:#x} (where, not found)", d.user_ip),
            };
            s += &format!(
                "  choice {}: task {} {what} at {at}\n",
                f.choice, d.point.task
            );
            for (task, place) in &f.others {
                s += &format!("      then task {task} ran to {}\n", place.at);
            }
        }
        if !self.at_end.is_empty() {
            s += "Where each task last stood in the program before the end:\n";
            for (task, place) in &self.at_end {
                s += &format!("  task {task} at {}\n", place.at);
            }
        }
        s
    }

    fn at_end_json(&self) -> serde_json::Value {
        (self.at_end.iter())
            .map(|(t, p)| serde_json::json!({"task": t, "at": p.at, "line": p.line}))
            .collect()
    }

    fn json(&self) -> serde_json::Value {
        self.findings
            .iter()
            .map(|f| {
                serde_json::json!({
                    "choice": f.choice,
                    "task": f.decision.point.task,
                    "kind": format!("{:?}", f.decision.point.kind),
                    "user_ip": f.decision.user_ip,
                    "at": f.at.as_ref().map(|p| &p.at),
                    "line": f.at.as_ref().and_then(|p| p.line.as_ref()),
                    "stack": f.at.as_ref().map_or(&[][..], |p| &p.stack[..]),
                    "others": f.others.iter().map(|(t, p)| serde_json::json!({
                        "task": t, "at": p.at, "line": p.line,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ddmin_finds_the_pair_that_fails() {
        // Runs are remembered by the set they kept (`Runner::fails`).
        let mut tested = std::collections::HashSet::new();
        let found = ddmin(&(1..=40).collect::<Vec<_>>(), |set| {
            tested.insert(set.to_vec());
            Ok(set.contains(&7) && set.contains(&31))
        })
        .unwrap();
        assert_eq!(found, [7, 31]);
        assert!(tested.len() < 60, "{} runs", tested.len());
        assert!(tested.contains(&vec![7]) && tested.contains(&vec![31]));
        let one = ddmin(&[1, 2, 3], |set| Ok(set.contains(&2))).unwrap();
        assert_eq!(one, [2]);
        let none = ddmin(&[1, 2, 3], |_| Ok(true)).unwrap();
        assert!(none.is_empty());
    }

    #[test]
    fn confirmed_runs_count_failures_as_recorded_and_passes() {
        let mut o = Outcomes::default();
        for status in [Some(134), Some(0), Some(124), None, Some(134)] {
            o.add(status, 134);
        }
        assert_eq!((o.failed, o.passed), (2, 1));
        let c = Confirmed {
            runs: 5,
            minimal: o,
            neighbours: vec![(
                3,
                Outcomes {
                    failed: 0,
                    passed: 5,
                },
            )],
        };
        assert_eq!(
            c.json(),
            serde_json::json!({"runs": 5, "minimal": {"failed": 2, "passed": 1},
                "neighbours": [{"left_out": 3, "failed": 0, "passed": 5}]})
        );
        assert!(
            c.text().contains("without choice 3: passed 5 times"),
            "{}",
            c.text()
        );
    }

    #[test]
    fn split_makes_nearly_equal_runs() {
        assert_eq!(split(&[1, 2, 3, 4, 5], 2), [vec![1, 2], vec![3, 4, 5]]);
        assert_eq!(split(&[1, 2], 4), [vec![1], vec![2]]);
    }
}
