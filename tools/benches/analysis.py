"""Analysis throughput of every diagnosis plugin, in events per second.

On a synthetic event database of EVENTS events (default 10 million): a
simulated uniprocessor run of a Syn_cont-like program (16 threads, two
levels of shared locks, blocking, context switches, a sample every
millisecond), in the packed format and with one SQL row per event. Each
plugin runs alone over the whole database, next to a plain read of it, so
the table separates the storage's cost from the analyses'. The work is
crates/diagnosis/examples/bench_analysis.rs, built here; each run is one
run of it. Needs no guest and no KVM; about 400 MB of temporary disk.

Usage: tools/bench analysis [--runs N] [--events EVENTS]
"""
import os
import re

from .common import log, run as run_command
from .stats import Row

TITLE = "Analysis throughput"
DURATION = "about 2 min"
RUNS = 1
NEEDS_INSIGHT = False

DATABASE = re.compile(r"^(\w+) database: (\d+) events, ([\d.]+) MB \(([\d.]+) B/event\), "
                      r"written in ([\d.]+) s \(([\d.]+) M events/s\)")
TOOL = re.compile(r"^(.+?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$")


def options(ap):
    ap.add_argument("--events", type=int, default=10_000_000,
                    help="events in the synthetic database (default 10000000)")


def parse(text):
    """{format: {"write": M events/s, "size": B/event, tool: M events/s}}
    from bench_analysis's output."""
    got, current = {}, None
    for line in text.splitlines():
        if (m := DATABASE.match(line)):
            current = got.setdefault(m.group(1), {"write": float(m.group(6)),
                                                  "size": float(m.group(4))})
        elif current is not None and (m := TOOL.match(line.strip())):
            current[m.group(1)] = float(m.group(4))
    return got


def run(ctx):
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ctx.repo, "target")
    run_command(["cargo", "build", "--release", "--quiet", "-p", "diagnosis", "--example",
                "bench_analysis"], "building the bench_analysis example", cwd=ctx.repo)
    example = os.path.join(target, "release", "examples", "bench_analysis")
    samples = {}
    for i in range(ctx.runs):
        log(f"run {i + 1} of {ctx.runs}: {ctx.args.events} events")
        p, _ = run_command([example, str(ctx.args.events)], "bench_analysis")
        if i == 0:
            print("\n".join(line for line in p.stdout.splitlines() if DATABASE.match(line)))
        for fmt, figures in parse(p.stdout).items():
            for key, v in figures.items():
                samples.setdefault((fmt, key), []).append(v)
    rows = []
    keys = [k for fmt, k in samples if fmt == "packed"]
    for key in keys:
        if ("rows", key) not in samples:
            continue
        what = {"write": "writing the database", "size": "database size"}.get(key, key)
        unit = "B/event" if key == "size" else "M events/s"
        rows.append(Row(f"{what}: rows database, packed", samples[("packed", key)],
                        samples[("rows", key)], unit=unit))
    return rows
