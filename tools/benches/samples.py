"""Sample marks: what they cost a recording, and how true a profile is.

Cost: the built-in guest's `profile_split 40` (two threads, CPU-bound, no
system calls in their loops) and `syn_cont 1000 2000` (four threads taking
locks, futex calls) recorded with the probe library preloaded, with
`insight record --sample-period off`, `1ms` (the default) and `4ms`, rounds
alternating between the three; each figure is the best of N. Times are
the programs' own (profile_split's CLOCK_MONOTONIC time from its threads'
start to their end; syn_cont under the guest's `timeit`), so that the
boot-snapshot restore and the trace's writing are not in them; the ratio
is against `off` in the same rounds.

Stalls: tools/native/stalls.c, built here, a CPU-bound loop that reads
the TSC every few hundred nanoseconds and adds up the gaps of over 5 us
(time it did not run), for 4 s natively (pinned to one CPU, like the
1-vCPU guest) and recorded with each setting, in the same rounds: what a
mark stops the program for, without the noise of whole-run times. "A
mark" is the stalled time above `off` over the gaps above `off`.

Truth: `profile_split 40 phased` (both threads run all their arith()
calls, then chase(), then hash(), in five passes, and the program times
each phase: each function alone, in the very run the profile is of; each
phase's time over the five passes), built here with -O1 and -O2 without frame
pointers, recorded once each; replayed with
`--diagnose profile` (samples at the recording's marks) twice, and with
`--replay-time-samples` (samples by the replay's host time, how insight
sampled before) once. Printed: each function's share of the three
functions' user-mode samples against its phase's share of the phases'
time, and whether the two replays at the marks stored the same samples.

Usage: tools/bench samples [--runs N] [--keep]
  --runs N   rounds of the cost measurement (default 3)
  --keep     keep the work directory (traces, databases)
Needs a built guest (tools/build-guest) and gcc.
"""
import os
import re
import shutil
import sqlite3
import subprocess
import tempfile

from .common import REPO, die, guest_ns, insight, log
from .stats import BEST, Row

TITLE = "Sample marks"
DURATION = "8 min"
RUNS = 3

SETUPS = [("off", "off"), ("1ms", "1ms"), ("4ms", "4ms")]
FUNCS = ["arith", "chase", "hash"]
ALL_ROUNDS = re.compile(r"profile_split: all \d+ rounds (\d+) ns")
PASS = re.compile(r"profile_split: pass \d+ arith (\d+) ns chase (\d+) ns hash (\d+) ns")
MARKS = re.compile(r"insight: (\d+) sample marks")
STALLS = re.compile(r"stalls: (\d+) gaps in [\d.]+ s, mean [\d.]+ us, longest [\d.]+ us, "
                    r"total ([\d.]+) ms")
STALL_SECONDS = 4


def record(work, name, period, command, files=()):
    """Records `command` with sample marks every `period` (or off) into
    work/name; returns the trace and the recording's output."""
    trace = os.path.join(work, name)
    shutil.rmtree(trace, ignore_errors=True)
    args = ["record", "--no-stdin", "--summary", "--probes", "-o", trace,
            "--sample-period", period]
    for f in files:
        args += ["--file", f]
    p, _ = insight(args + ["--"] + command)
    return trace, p.stdout + p.stderr


def cost(work, runs):
    """Program times (ns) per workload and setup, each round's, and the
    marks taken."""
    times = {}
    marks = {}
    for r in range(runs):
        for label, period in SETUPS:
            _, out = record(work, "cost", period, ["profile_split", "40"])
            m = ALL_ROUNDS.search(out)
            if not m:
                die(f"no profile_split time in:\n{out[-2000:]}")
            times.setdefault(("split", label), []).append(int(m.group(1)))
            if (mk := MARKS.search(out)):
                marks[("split", label)] = int(mk.group(1))
            _, out = record(work, "cost", period, ["timeit", "syn_cont", "1000", "2000"])
            times.setdefault(("syn_cont", label), []).append(guest_ns(out, "syn_cont's recording"))
            if (mk := MARKS.search(out)):
                marks[("syn_cont", label)] = int(mk.group(1))
            log(f"round {r + 1}/{runs}: {label} done")
    return times, marks


def stalls(work, runs):
    """Per setting (and natively): tools/native/stalls.c's stalled
    milliseconds and gaps, each round's."""
    prog = os.path.join(work, "stalls")
    src = os.path.join(REPO, "tools", "native", "stalls.c")
    p = subprocess.run(["gcc", "-O2", "-static", "-o", prog, src], capture_output=True, text=True)
    if p.returncode != 0:
        die(f"cannot build tools/native/stalls.c:\n{p.stderr}")
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []

    def parse(out, what):
        m = STALLS.search(out)
        if not m:
            die(f"no stalls line from {what}:\n{out[-2000:]}")
        return float(m.group(2)), int(m.group(1))

    got_all = {}
    for r in range(runs):
        p = subprocess.run(pin + [prog, str(STALL_SECONDS)], capture_output=True, text=True,
                           check=True)
        got = [("native", parse(p.stdout, "the native run"))]
        for label, period in SETUPS:
            _, out = record(work, "stalls-trace", period, [prog, str(STALL_SECONDS)],
                            files=[prog])
            got.append((label, parse(out, f"the recording with marks {label}")))
        for label, v in got:
            got_all.setdefault(label, []).append(v)
        log(f"stalls round {r + 1}/{runs} done")
    return got_all


def build(work, opt):
    """profile_split built here with `opt` and without frame pointers."""
    src = os.path.join(REPO, "images", "workloads", "profile_split.c")
    out = os.path.join(work, f"profile_split{opt}")
    p = subprocess.run(["gcc", opt, "-g", "-fomit-frame-pointer", "-pthread", "-o", out, src],
                       capture_output=True, text=True)
    if p.returncode != 0:
        die(f"gcc {opt} failed:\n{p.stderr}")
    return out


def shares(work, trace, db, extra):
    """Replays `trace` with --diagnose profile into `db`; the three
    functions' shares of their user-mode samples, and the sample count."""
    p, wall = insight(["replay", trace, "--diagnose", "profile", "--events", db] + extra)
    counts = {}
    for line in p.stdout.splitlines():
        w = line.split()
        if len(w) >= 4 and w[3] in FUNCS and w[1].isdigit():
            counts[w[3]] = int(w[1])
    total = sum(counts.values())
    if total == 0:
        die(f"no samples of the three functions in:\n{p.stdout[-2000:]}")
    return {f: 100.0 * counts.get(f, 0) / total for f in FUNCS}, total, wall


def samples_of(db):
    """The SAMPLE rows of an event database in rows format (kind 14,
    docs/events.md), with their stacks."""
    with sqlite3.connect(db) as c:
        return c.execute("select e.*, s.frames from events e left join stacks s "
                         "on s.seq = e.seq where e.kind = 14 order by e.seq").fetchall()


def truth(work):
    """Per build: the phases' split, the profile at the marks (twice), and
    by replay-time sampling."""
    rows = []
    for opt in ["-O1", "-O2"]:
        prog = build(work, opt)
        trace, out = record(work, f"split{opt}", "1ms", [prog, "40", "phased"], files=[prog])
        passes = [[int(x) for x in m.groups()] for m in PASS.finditer(out)]
        if not passes:
            die(f"no phases in:\n{out[-2000:]}")
        # Each phase's time over the passes: a pass whose phase the host
        # slowed is time the program spent there, and the samples see it.
        phases = [sum(p[i] for p in passes) for i in range(3)]
        split = {f: 100.0 * ns / sum(phases) for f, ns in zip(FUNCS, phases)}
        truth = "phases (the program's own timing, 5 passes)"
        rows.append((opt, truth, split, None, None))
        dbs = []
        for i in (1, 2):
            db = os.path.join(work, f"marks{opt}-{i}.db")
            got, n, wall = shares(work, trace, db, ["--events-format", "rows"])
            rows.append((opt, f"at the recording's marks, replay {i}", got, n, wall))
            dbs.append(db)
        a, b = samples_of(dbs[0]), samples_of(dbs[1])
        same = f"the same {len(a)}" if a == b else f"differ ({len(a)} and {len(b)})"
        rows.append((opt, f"the two replays' SAMPLE rows: {same}", None, None, None))
        db = os.path.join(work, f"host{opt}.db")
        got, n, wall = shares(work, trace, db, ["--replay-time-samples"])
        rows.append((opt, "by replay's host time (--replay-time-samples)", got, n, wall))
    return rows


def options(ap):
    ap.add_argument("--keep", action="store_true", help="keep the work directory (traces, databases)")


def run(ctx):
    if shutil.which("gcc") is None:
        die("gcc is needed to build profile_split")
    work = tempfile.mkdtemp(prefix="insight-bench-samples-")
    try:
        return measure(ctx.runs, work)
    finally:
        if ctx.args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def measure(runs, work):
    times, marks = cost(work, runs)
    rows = []
    print(f"## Recording cost, best of {runs}\n")
    print("| workload | marks off | 1ms | ratio | 4ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for w in ["split", "syn_cont"]:
        off = min(times[(w, "off")])
        cells = [f"{off / 1e6:.0f} ms"]
        name = "profile_split 40" if w == "split" else "syn_cont 1000 2000"
        for label in ["1ms", "4ms"]:
            ns = min(times[(w, label)])
            n = marks.get((w, label))
            cells += [f"{ns / 1e6:.0f} ms ({n} marks)" if n else f"{ns / 1e6:.0f} ms",
                      f"**{ns / off:.3f}x**"]
            rows.append(Row(f"{name} (the program's time): marks off, every {label}",
                            [t / 1e6 for t in times[(w, label)]],
                            [t / 1e6 for t in times[(w, "off")]], unit="ms", statistic=BEST))
        print(f"| {name} | " + " | ".join(cells) + " |")
    got = stalls(work, runs)
    best = {label: min(v) for label, v in got.items()}
    print(f"\n## Stalls of a {STALL_SECONDS}-s CPU-bound loop, least of {runs}\n")
    print("| run | gaps over 5 us | stalled | share of the run | a mark |")
    print("|---|---:|---:|---:|---:|")
    off_ms, off_gaps = best["off"]
    for label in ["native", "off", "1ms", "4ms"]:
        ms, gaps = best[label]
        per = ""
        if label in ("1ms", "4ms") and gaps > off_gaps:
            per = f"{(ms - off_ms) * 1000 / (gaps - off_gaps):.0f} us"
        name = "natively, one CPU" if label == "native" else f"recorded, marks {label}"
        print(f"| {name} | {gaps} | {ms:.1f} ms | {ms / (STALL_SECONDS * 10):.2f} % | {per} |")
    for base, label in (("native", "off"), ("off", "1ms"), ("off", "4ms")):
        rows.append(Row(f"stalls {STALL_SECONDS} (stalled time): {base}, {label}",
                        [v[0] for v in got[label]], [v[0] for v in got[base]], unit="ms",
                        statistic=BEST))
    for label in ("1ms", "4ms"):
        ms, gaps = best[label]
        if gaps > off_gaps:
            rows.append(Row.computed(f"what a mark stops a CPU-bound loop for, marks every {label}",
                                     (ms - off_ms) * 1000 / (gaps - off_gaps), unit="µs", n=runs))
    print("\n## Profile shares of profile_split 40 phased (user-mode samples)\n")
    print("| build | samples | arith | chase | hash | largest error | samples | replay |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    split = None
    for opt, what, shares, n, wall in truth(work):
        if shares is None:
            print(f"| {opt} | {what} | | | | | | |")
            continue
        if n is None:
            split = shares
            err = ""
        else:
            error = max(abs(shares[f] - split[f]) for f in FUNCS)
            err = f"{error:.1f} pp"
            rows.append(Row.computed(f"profile_split 40 phased {opt}: the largest error of the "
                                     f"profile {what} against the program's own split", error,
                                     unit="pp"))
        cells = " | ".join(f"{shares[f]:.1f} %" for f in FUNCS)
        print(f"| {opt} | {what} | {cells} | {err} | {n or ''} | "
              f"{f'{wall:.1f} s' if wall else ''} |")
    return rows
