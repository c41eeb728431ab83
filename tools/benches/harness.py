"""Running one benchmark: its context in, its report out, and the record
of a run: the results file (JSON) and docs/BENCHMARKS.md's section.

A benchmark module has a docstring (its first paragraph is what
`tools/bench --list` says of it, the whole its --help), DURATION (how long it usually
takes), RUNS (its default repeats), optionally NEEDS_INSIGHT = False and
options(parser), and run(ctx), which returns a Report or a list of rows.
What it prints to standard output is its detail: shown after its rows,
and written with them into its section.
"""
import argparse
import contextlib
import importlib
import io
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field

from . import BENCHMARKS, common, doc, stats

DOC = os.path.join(common.REPO, "docs", "BENCHMARKS.md")
FORMAT = 1


@dataclass
class Context:
    """What a benchmark runs with: its repeats, its options, and the
    checkout whose insight it measures (this one, or a revision's work
    tree in `tools/bench compare`)."""
    name: str
    runs: int
    args: argparse.Namespace
    repo: str = common.REPO
    write: bool = True


@dataclass
class Report:
    """A benchmark's result: its rows, any figures beyond them (kept in
    the results file), and its status: 0, 1 when a check it makes failed,
    2 when part of it could not be measured."""
    rows: list
    data: dict = field(default_factory=dict)
    status: int = 0


def module(name):
    if name not in BENCHMARKS:
        raise KeyError(name)
    return importlib.import_module(f"benches.{name}")


def summary(mod):
    """The first sentence of a benchmark's docstring: up to its first
    blank line, on one line."""
    return " ".join((mod.__doc__ or "?").strip().split("\n\n")[0].split())


def parser(name, with_harness=True):
    """The option parser of benchmark `name`; with_harness adds --runs,
    --json and --no-write, which every benchmark takes."""
    mod = module(name)
    ap = argparse.ArgumentParser(prog=f"tools/bench {name}", description=mod.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if with_harness:
        add_harness_options(ap, name)
    if hasattr(mod, "options"):
        mod.options(ap)
    return ap


def add_harness_options(ap, name=None):
    g = ap.add_argument_group("every benchmark")
    default = f" (default: {module(name).RUNS})" if name else " (default: each benchmark's own)"
    g.add_argument("--runs", type=int, metavar="N", help="repeats of every measurement" + default)
    g.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    g.add_argument("--no-write", action="store_true",
                   help="leave docs/ alone (the results file is still written)")


def defaults(name, **overrides):
    """A benchmark's options at their defaults, with overrides."""
    args = parser(name, with_harness=False).parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def run(ctx):
    """Runs ctx's benchmark; returns its report, what it printed and its
    seconds. A benchmark that stops (BenchError) raises it on."""
    mod = module(ctx.name)
    if ctx.runs < 1:
        common.die("--runs must be at least 1")
    before = common.set_name(ctx.name)
    printed = io.StringIO()
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(printed):
            report = mod.run(ctx)
    finally:
        common.set_name(before)
    if not isinstance(report, Report):
        report = Report(list(report))
    return report, printed.getvalue(), time.monotonic() - start


def nested(name, runs=None, **options):
    """Runs benchmark `name` from within another (tools/bench papers):
    its report and printed detail, or None and the reason when it could
    not be measured."""
    mod = module(name)
    ctx = Context(name, runs or mod.RUNS, defaults(name, **options), write=False)
    try:
        report, printed, _ = run(ctx)
        return report, printed
    except Exception as e:  # its fault or its host's: the outer benchmark goes on without it
        common.log(f"{name}: not measured: {e}")
        return None, str(e)


def command_line(name, runs, argv):
    """How a section says it was made."""
    return shlex.join(["tools/bench", name, "--runs", str(runs)] + argv)


def section(entry):
    """The body of a benchmark's docs/BENCHMARKS.md section."""
    head = (f"`{entry['command']}` on {entry['date']} ({entry['seconds'] / 60:.1f} min), insight "
            f"{entry['insight']}; host: {entry['host']}. Each figure is the median of its n "
            f"samples (the least where n says best), the spread their range, the ratio insight "
            f"/ baseline.")
    if entry.get("status"):
        head += {1: " A check it makes failed.", 2: " Part of it could not be measured."}.get(
            entry["status"], "")
    rows = [stats.Row.from_json(r) for r in entry["rows"]]
    parts = [head, stats.table(rows) if rows else "(no rows)"]
    if entry.get("detail", "").strip():
        parts.append(doc.markdown_body(entry["detail"]))
    return "\n\n".join(parts)


def write_sections(entries):
    """Rewrites the sections of `entries` ({name: results entry}) in
    docs/BENCHMARKS.md."""
    with open(DOC) as f:
        text = f.read()
    for name, entry in entries.items():
        text = doc.replace(text, name, section(entry), title=f"{module(name).TITLE} (tools/bench {name})")
    with open(DOC, "w") as f:
        f.write(text)


def results_dir():
    """Where results files go by default: outside the repository, in
    the cache (INSIGHT_CACHE_DIR as tools/build-guest has it)/bench/results."""
    return os.path.join(common.cache_dir(), "bench", "results")


def save(results, path=None, names=()):
    """Writes a results document to path, or to a new file in
    results_dir(); returns the path."""
    if path is None:
        d = results_dir()
        os.makedirs(d, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        path = os.path.join(d, f"{stamp}-{'+'.join(names) or 'bench'}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    return path


def load(path):
    with open(path) as f:
        results = json.load(f)
    if results.get("format") != FORMAT or "benchmarks" not in results:
        common.die(f"{path} is not a results file of this tools/bench (format {FORMAT})")
    return results


def header():
    """What every results file says of its run."""
    return {"format": FORMAT, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": common.host_description(), "insight": common.describe(),
            "command": " ".join(["tools/bench"] + sys.argv[1:])}
