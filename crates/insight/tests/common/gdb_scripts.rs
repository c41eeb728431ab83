//! Reverse-debugging scenarios: a C program and a gdb session over it with
//! what each command must print (tests/reverse/README.md has the format).
//! A scenario runs under `insight debug` on a recording of the program,
//! recorded by its path as users do, and under the host's gdb with `record
//! full`, which checks the expectations themselves.

use std::fmt::Write as _;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{expect_status, guest_ready, insight, output_within, scratch};

/// What a scenario's session runs under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Debugger {
    /// `insight debug` on a recording of the program.
    Insight,
    /// The host's gdb running the program, with `record full`.
    RecordFull,
}

/// One step of a session: what gdb runs, and what its output must hold.
#[derive(Debug)]
struct Step {
    /// The script's line it was written on (1-based).
    line: usize,
    /// The script's text of it, placeholders resolved.
    text: String,
    action: Action,
    expect: Vec<Expect>,
}

#[derive(Debug)]
enum Action {
    /// A gdb command, as written.
    Command(String),
    /// `runto FUNC`: a breakpoint at FUNC and the program run to it, from
    /// its start (record full) or from its first instruction (insight).
    RunTo(String),
    /// `record`: `record full` there; insight's recording has it all.
    Record,
    /// `repeat FIRST [then NEXT] [until LINE [start]] [over LINE, ...]`:
    /// FIRST, then NEXT again while the stop is on one of the `over` lines
    /// (or, with `start`, inside the `until` line but not at its start),
    /// at most REPEAT_LIMIT times; the stop must then be on the `until`
    /// line (at its start), if there is one.
    Repeat {
        first: String,
        then: String,
        until: Option<u32>,
        start: bool,
        over: Vec<u32>,
    },
    /// `step_until COMMAND | CURRENT | TARGET`, the gdb testsuite's
    /// `step_until`: COMMAND again while the stop (as `frame` shows it)
    /// matches the Python regular expression CURRENT, at most
    /// STEP_UNTIL_LIMIT times; the last stop must then match TARGET.
    StepUntil {
        command: String,
        current: String,
        target: String,
    },
}

/// How often a `step_until` runs its command at most.
const STEP_UNTIL_LIMIT: usize = 100;

/// How often a `repeat` runs its command at most.
const REPEAT_LIMIT: usize = 200;

/// What a step's output must hold.
#[derive(Debug)]
enum Expect {
    /// One of these texts.
    AnyOf(Vec<String>),
    /// Not this text.
    Lacks(String),
    /// This text, any run of blanks in it matching any other run.
    Spaced(String),
    /// This text, under this debugger only (where the two must differ:
    /// what this host cannot record, insight must name instead).
    Under(Debugger, String),
}

/// A scenario: its files and its session.
pub struct Scenario {
    name: String,
    dir: PathBuf,
    /// The program's C sources, in the scenario's directory.
    sources: Vec<String>,
    flags: Vec<String>,
    /// The program's arguments.
    args: Vec<String>,
    /// Shared libraries the program links: (file name, its sources).
    shared: Vec<(String, Vec<String>)>,
    steps: Vec<Step>,
}

/// Longer than a session here takes on a slow, shared host.
const SESSION_LIMIT: Duration = Duration::from_secs(900);

impl Scenario {
    /// Reads `dir`/`name`.script (or the name with `-` for `_`, as the
    /// scenarios' files may be named).
    pub fn load(dir: &Path, name: &str) -> Scenario {
        let file_name = [name.to_owned(), name.replace('_', "-")]
            .into_iter()
            .find(|n| dir.join(format!("{n}.script")).exists())
            .unwrap_or_else(|| panic!("no {name}.script in {}", dir.display()));
        let script = dir.join(format!("{file_name}.script"));
        let text = std::fs::read_to_string(&script)
            .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
        let mut scenario = Scenario {
            name: file_name.clone(),
            dir: dir.to_owned(),
            sources: vec![format!("{file_name}.c")],
            flags: vec!["-g".to_owned()],
            args: Vec::new(),
            shared: Vec::new(),
            steps: Vec::new(),
        };
        // Headers first: placeholders look in the sources they name.
        for line in text.lines() {
            scenario.header(line.trim());
        }
        for (i, raw) in text.lines().enumerate() {
            // An expectation keeps its trailing blanks.
            let line = match raw.trim_start() {
                l if l.starts_with('>') => l,
                l => l.trim_end(),
            };
            if let Err(e) = scenario.body_line(line) {
                panic!("{}:{}: {e}", script.display(), i + 1);
            }
            if let Some(step) = scenario.steps.last_mut().filter(|s| s.line == 0) {
                step.line = i + 1;
            }
        }
        scenario
    }

    fn header(&mut self, line: &str) {
        let Some(header) = line.strip_prefix('%') else {
            return;
        };
        let words = |s: &str| s.split_whitespace().map(str::to_owned).collect();
        match header.trim().split_once(':') {
            Some(("sources", list)) => self.sources = words(list),
            Some(("flags", list)) => self.flags = words(list),
            Some(("args", list)) => self.args = words(list),
            Some((lib, list)) if lib.starts_with("shared ") => {
                let lib = lib["shared ".len()..].trim().to_owned();
                self.shared.push((lib, words(list)));
            }
            _ => panic!("{}: unknown header {line}", self.name),
        }
    }

    fn body_line(&mut self, line: &str) -> Result<(), String> {
        if line.is_empty() || line.starts_with('#') || line.starts_with('%') {
            return Ok(());
        }
        let line = self.resolve(line)?;
        if let Some(rest) = line.strip_prefix('>') {
            let step = self
                .steps
                .last_mut()
                .ok_or("an expectation before any command")?;
            let (kind, text) = rest.split_at(rest.find(' ').unwrap_or(rest.len()));
            let text = unescape(text.strip_prefix(' ').unwrap_or(text));
            match (kind, step.expect.last_mut()) {
                ("", _) => step.expect.push(Expect::AnyOf(vec![text])),
                ("|", Some(Expect::AnyOf(any))) => any.push(text),
                ("!", _) => step.expect.push(Expect::Lacks(text)),
                ("~", _) => step.expect.push(Expect::Spaced(blanks_folded(&text))),
                ("insight", _) => step.expect.push(Expect::Under(Debugger::Insight, text)),
                ("full", _) => step.expect.push(Expect::Under(Debugger::RecordFull, text)),
                _ => return Err(format!("bad expectation {line}")),
            }
            return Ok(());
        }
        let action = match line.split_once(' ') {
            _ if line == "record" => Action::Record,
            Some(("runto", func)) => Action::RunTo(func.trim().to_owned()),
            Some(("repeat", rest)) => repeat(rest)?,
            Some(("step_until", rest)) => match rest.split(" | ").collect::<Vec<_>>()[..] {
                [command, current, target] => Action::StepUntil {
                    command: command.trim().to_owned(),
                    current: current.trim().to_owned(),
                    target: target.trim().to_owned(),
                },
                _ => return Err(format!("step_until needs three parts: {line}")),
            },
            _ => Action::Command(line.clone()),
        };
        self.steps.push(Step {
            line: 0,
            text: line,
            action,
            expect: Vec::new(),
        });
        Ok(())
    }

    /// `line` with each `{line MARKER}` (`{line@FILE MARKER}`) replaced by
    /// the number of the first line of the sources (of FILE) holding
    /// MARKER.
    fn resolve(&self, line: &str) -> Result<String, String> {
        let mut out = String::new();
        let mut rest = line;
        while let Some(start) = rest.find("{line") {
            out.push_str(&rest[..start]);
            let end = rest[start..]
                .find('}')
                .ok_or_else(|| format!("unclosed placeholder in {line}"))?;
            let inner = &rest[start + "{line".len()..start + end];
            let (files, marker) = match inner.strip_prefix('@') {
                Some(spec) => {
                    let (file, marker) = spec.split_once(' ').unwrap_or((spec, ""));
                    (vec![file.to_owned()], marker)
                }
                None => (self.all_sources(), inner.trim_start()),
            };
            let number = files
                .iter()
                .find_map(|f| {
                    let text = std::fs::read_to_string(self.dir.join(f)).ok()?;
                    text.lines().position(|l| l.contains(marker))
                })
                .ok_or_else(|| format!("no line holds {marker:?} in {files:?}"))?;
            write!(out, "{}", number + 1).unwrap();
            rest = &rest[start + end + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    fn all_sources(&self) -> Vec<String> {
        let shared = self.shared.iter().flat_map(|(_, s)| s.iter());
        (self.sources.iter().chain(shared))
            .filter(|s| !s.starts_with('-'))
            .cloned()
            .collect()
    }

    /// Builds the program (and its shared libraries) with gcc into `dir`;
    /// returns its file name there.
    fn build(&self, dir: &Path) -> String {
        let gcc = |args: &[String], what: &str| {
            let out = Command::new("gcc")
                .current_dir(dir)
                .args(args)
                .output()
                .expect("gcc is needed to build the scenarios");
            let (_, err) = super::text(&out);
            assert!(out.status.success(), "gcc failed on {what}: {err}");
        };
        // A source's path in the scenario's directory; a flag as it is.
        let here = |f: &String| match f.starts_with('-') {
            true => f.clone(),
            false => self.dir.join(f).to_string_lossy().into_owned(),
        };
        let mut libs = Vec::new();
        for (lib, sources) in &self.shared {
            let mut args = self.flags.clone();
            args.extend(["-shared", "-fPIC", "-o", lib].map(str::to_owned));
            args.push(format!("-Wl,-soname,{lib}"));
            args.extend(sources.iter().map(here));
            gcc(&args, lib);
            libs.push(lib.clone());
        }
        let prog = self.name.clone();
        let mut args = self.flags.clone();
        args.extend(["-o".to_owned(), prog.clone()]);
        args.extend(self.sources.iter().map(here));
        if !libs.is_empty() {
            args.extend(libs.iter().map(|l| format!("./{l}")));
            args.push("-Wl,-rpath,$ORIGIN".to_owned());
        }
        gcc(&args, &prog);
        prog
    }

    /// The gdb Python script that runs the session under `debugger`: each
    /// step after a line "@@STEP i", a command's error as "@@ERROR ...",
    /// where a `repeat` ended as "@@AT LINE START", "@@END" at the end.
    fn session_script(&self, debugger: Debugger) -> String {
        let mut steps = String::new();
        for step in &self.steps {
            let commands = |list: &[&str]| format!("(\"do\", [{}])", quoted(list));
            let entry = match (&step.action, debugger) {
                (Action::Command(c), _) => commands(&[c]),
                (Action::RunTo(f), Debugger::Insight) => {
                    commands(&["delete", &format!("break {f}"), "continue"])
                }
                (Action::RunTo(f), Debugger::RecordFull) => {
                    commands(&["delete", &format!("break {f}"), "run"])
                }
                (Action::Record, Debugger::Insight) => commands(&[]),
                (Action::Record, Debugger::RecordFull) => commands(&["record full"]),
                (
                    Action::Repeat {
                        first,
                        then,
                        until,
                        start,
                        over,
                    },
                    _,
                ) => format!(
                    "(\"repeat\", {}, {}, {}, {over:?})",
                    quoted(&[first, then]),
                    until.map_or(-1, i64::from),
                    u8::from(*start)
                ),
                (
                    Action::StepUntil {
                        command,
                        current,
                        target,
                    },
                    _,
                ) => format!("(\"step_until\", {})", quoted(&[command, current, target])),
            };
            writeln!(steps, "    {entry},").unwrap();
        }
        format!(
            "{SESSION_HEAD}STEPS = [\n{steps}]\nLIMIT = {REPEAT_LIMIT}\n\
             STEP_UNTIL_LIMIT = {STEP_UNTIL_LIMIT}\n{SESSION_RUN}"
        )
    }

    /// Runs the scenario under `debugger`; fails naming the first step
    /// whose output does not hold what it must, with that output.
    pub fn check(&self, debugger: Debugger) {
        let dir = scratch(&format!("reverse-{}-{debugger:?}", self.name));
        let prog = self.build(&dir);
        let script = dir.join("session.py");
        std::fs::write(&script, self.session_script(debugger)).unwrap();
        let log = dir.join("gdb.log");
        let mut cmd;
        match debugger {
            Debugger::Insight => {
                guest_ready();
                // Recorded by its path from its directory, as users do.
                let mut record = insight();
                record
                    .current_dir(&dir)
                    .args(["record", "--no-stdin", "-o", "trace", "--"])
                    .arg(format!("./{prog}"))
                    .args(&self.args);
                // It exits as it does on the host.
                let native = Command::new(format!("./{prog}"))
                    .current_dir(&dir)
                    .args(&self.args)
                    .stdin(Stdio::null())
                    .output()
                    .unwrap_or_else(|e| panic!("{prog}: {e}"));
                let status = native.status.code().unwrap_or(-1);
                expect_status(&output_within(record, SESSION_LIMIT), status);
                cmd = insight();
                cmd.args(["debug", "trace", "--", "-batch", "-nx", "-x", "session.py"]);
            }
            Debugger::RecordFull => {
                cmd = Command::new("gdb");
                cmd.args(["-batch", "-nx", "-x", "session.py", "--args", &prog])
                    .args(&self.args);
            }
        }
        cmd.current_dir(&dir);
        let status = run_logged(cmd, &log, SESSION_LIMIT);
        let output = std::fs::read_to_string(&log).unwrap_or_default();
        if let Err(failure) = self.verify(&output, debugger) {
            panic!(
                "{} under {debugger:?} ({status}): {failure}\n(whole session in {})",
                self.name,
                log.display()
            );
        }
        assert!(status.success(), "{status}:\n{output}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Checks each step's output; the first that fails, said.
    fn verify(&self, output: &str, debugger: Debugger) -> Result<(), String> {
        let mut outputs = vec!["\n".to_owned(); self.steps.len()];
        let mut current = None;
        let mut ended = false;
        for line in output.lines() {
            if let Some(i) = line.strip_prefix("@@STEP ") {
                current = i.trim().parse::<usize>().ok();
            } else if line == "@@END" {
                ended = true;
                current = None;
            } else if let Some(out) = current.and_then(|i| outputs.get_mut(i)) {
                out.push_str(line);
                out.push('\n');
            }
        }
        for (step, out) in self.steps.iter().zip(&outputs) {
            let failed = |what: String| {
                Err(format!(
                    "line {} `{}`: {what}; it printed:\n{out}",
                    step.line, step.text
                ))
            };
            if !ended && out == "\n" {
                return failed("the session ended before this step".to_owned());
            }
            // A command's error fails its step, unless the step says what
            // it must print.
            if let Some(error) = out.lines().find(|l| l.starts_with("@@ERROR")) {
                if step.expect.is_empty() {
                    return failed(format!("gdb: {}", &error["@@ERROR ".len()..]));
                }
            }
            if matches!(step.action, Action::StepUntil { .. }) && !out.contains("@@MATCHED 1") {
                return failed("the last stop does not match the target".to_owned());
            }
            if let Action::Repeat {
                until: Some(until),
                start,
                ..
            } = step.action
            {
                let at = out.lines().find_map(|l| l.strip_prefix("@@AT "));
                let at = at.and_then(|a| a.split_once(' '));
                if at.is_none_or(|(line, at_start)| {
                    line != until.to_string() || (start && at_start != "1")
                }) {
                    let start = if start { "the start of " } else { "" };
                    return failed(format!("not stopped at {start}line {until}"));
                }
            }
            for expect in &step.expect {
                match expect {
                    Expect::AnyOf(any) if !any.iter().any(|t| out.contains(t.as_str())) => {
                        return failed(format!("expected {}", any.join(" or ")));
                    }
                    Expect::Lacks(t) if out.contains(t.as_str()) => {
                        return failed(format!("unexpected {t:?}"));
                    }
                    Expect::Under(under, t) if *under == debugger && !out.contains(t.as_str()) => {
                        return failed(format!("expected {t:?} under {under:?}"));
                    }
                    Expect::Spaced(t) if !blanks_folded(out).contains(t.as_str()) => {
                        return failed(format!("expected {t:?} (blanks folded)"));
                    }
                    _ => {}
                }
            }
        }
        if !ended {
            return Err(format!("the session did not end:\n{output}"));
        }
        Ok(())
    }
}

/// `FIRST [then NEXT] [until LINE [start]] [over LINE, ...]`.
fn repeat(spec: &str) -> Result<Action, String> {
    let cut = [" until ", " over "]
        .iter()
        .filter_map(|k| spec.find(k))
        .min()
        .ok_or_else(|| format!("repeat without until or over: {spec}"))?;
    let (commands, lines) = spec.split_at(cut);
    let (first, then) = commands
        .split_once(" then ")
        .unwrap_or((commands, commands));
    let (until, over) = match lines.strip_prefix(" until ") {
        Some(rest) => rest.split_once(" over ").unwrap_or((rest, "")),
        None => ("", &lines[" over ".len()..]),
    };
    let (until, start) = match until.trim().strip_suffix(" start") {
        Some(line) => (line, true),
        None => (until, false),
    };
    let number = |s: &str| {
        s.trim()
            .parse::<u32>()
            .map_err(|_| format!("not a line: {s:?}"))
    };
    Ok(Action::Repeat {
        first: first.trim().to_owned(),
        then: then.trim().to_owned(),
        until: Some(until)
            .filter(|u| !u.trim().is_empty())
            .map(number)
            .transpose()?,
        start,
        over: (over.split(',').filter(|s| !s.trim().is_empty()))
            .map(number)
            .collect::<Result<_, _>>()?,
    })
}

/// `\t`, `\n` and `\\` in an expectation.
fn unescape(text: &str) -> String {
    text.replace("\\t", "\t")
        .replace("\\n", "\n")
        .replace("\\\\", "\\")
}

/// `text` with each run of spaces and tabs made one space.
fn blanks_folded(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, part) in text.split([' ', '\t']).enumerate() {
        if i > 0 && !out.ends_with(' ') {
            out.push(' ');
        }
        out.push_str(part);
    }
    out
}

/// Python string literals, comma-separated.
fn quoted(list: &[&str]) -> String {
    let quote = |s: &&str| {
        let escaped = s.replace('\\', "\\\\").replace('"', "\\\"");
        format!("\"{escaped}\"")
    };
    list.iter().map(quote).collect::<Vec<_>>().join(", ")
}

const SESSION_HEAD: &str = "import re\n\nimport gdb\n\n";

const SESSION_RUN: &str = r#"

def here():
    try:
        frame = gdb.selected_frame()
        sal = frame.find_sal()
        return sal.line, int(sal.pc == frame.pc())
    except gdb.error:
        return 0, 0


def run(command):
    try:
        gdb.execute(command)
        return True
    except gdb.error as e:
        print("@@ERROR %s" % e)
        return False


def step_until(command, current, target):
    for _ in range(STEP_UNTIL_LIMIT):
        # The stop as `frame` shows it: its function and line, which is
        # what the stop printed (gdb prints a stop to its own stream).
        try:
            gdb.execute(command)
            out = gdb.execute("frame", to_string=True)
        except gdb.error as e:
            print("@@ERROR %s" % e)
            return 0
        if not re.search(current, out):
            return int(bool(re.search(target, out)))
    return 0


for i, step in enumerate(STEPS):
    print("@@STEP %d" % i)
    if step[0] == "do":
        for command in step[1]:
            if not run(command):
                break
        continue
    if step[0] == "step_until":
        print("@@MATCHED %d" % step_until(*step[1:]))
        continue
    _, first, then, until, at_start, over = step
    ok = run(first)
    for _ in range(LIMIT):
        line, start = here()
        inside = at_start and line == until and not start
        if not ok or not (line in over or inside):
            break
        ok = run(then)
    print("@@AT %d %d" % here())
print("@@END")
"#;

/// Runs `cmd` with its standard output and error into `log`, standard
/// input closed; kills it and fails after `limit`.
fn run_logged(mut cmd: Command, log: &Path, limit: Duration) -> ExitStatus {
    let file = File::create(log).unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let out = std::fs::read_to_string(log).unwrap_or_default();
            panic!("{cmd:?} still ran after {limit:?}:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
