"""Costs of probes given at replay (`insight replay --probe`), side by side
in one run.

  * One recording of probe_target (two threads calling parse_request()
    CALLS times each; the recording needs no option for the probes added
    later), replayed alternately with --events and no probe, with one
    probe (parse_request's entry), and with ten (entries and returns in
    the program and in glibc); wall times, the probe events written, and
    the host time per hit of the one probe.
  * The live anchor, natively on this host where perf and uprobes allow:
    the same binary, built as the guest's, run alone and under
    `perf record -e` a uprobe on parse_request (`perf probe -x`),
    alternately, each also with no calls (perf's own start cancels out);
    the time per hit. The uprobe is deleted at the end.

Usage: tools/bench probes [--runs N] [--calls N] [--native-calls N]
Needs a built guest (tools/build-guest).
"""
import os
import re
import shutil
import subprocess
import tempfile
import time

from . import stats
from .common import REPO, die, insight, log
from .stats import BEST, Row

TITLE = "Probes given at replay"
DURATION = "2 min"
RUNS = 3

ONE = ["parse_request"]
TEN = [
    "parse_request capture arg1",
    "parse_request return capture retval",
    "factorial",
    "factorial return capture retval",
    "worker",
    "main",
    "libc.so.6:pthread_mutex_lock",
    "libc.so.6:pthread_mutex_unlock",
    "libc.so.6:write",
    "libc.so.6:exit",
]


def probe_events(stderr):
    """(PROBE, PROBE_RET) events of replay's summary line."""
    m = re.search(r"events written to .*?\((.*)\)", stderr)
    if not m:
        die(f"no event summary in:\n{stderr}")
    counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) ([A-Z_]+)", m.group(1)))
    return counts.get("PROBE", 0), counts.get("PROBE_RET", 0)


def native_anchor(tmp, calls, runs):
    """Per-hit cost of a uprobe on parse_request natively, or why not: the
    program with CALLS and with 0 calls, alone and under perf record, so
    that perf's own start and the program's work cancel out."""
    if not shutil.which("perf"):
        return None, "perf is not installed"
    binary = os.path.join(tmp, "probe_target")
    src = os.path.join(REPO, "images", "workloads", "probe_target.c")
    subprocess.run(["gcc", "-O2", "-g", "-fomit-frame-pointer", "-pthread", "-o", binary, src],
                   check=True)
    add = subprocess.run(["perf", "probe", "-x", binary, "parse_request"],
                         capture_output=True, text=True)
    if add.returncode != 0:
        return None, f"perf probe failed: {(add.stderr + add.stdout).strip()[:300]}"
    event = "probe_probe_target:parse_request"
    data = os.path.join(tmp, "perf.data")

    def timed(n, under_perf):
        argv = ["taskset", "-c", "0", binary, str(n)]
        if under_perf:
            argv = ["perf", "record", "-q", "-o", data, "-e", event, "--"] + argv
        start = time.monotonic()
        p = subprocess.run(argv, capture_output=True, text=True)
        if p.returncode != 0:
            die(f"{' '.join(argv)} failed: {p.stderr.strip()[:300]}")
        return time.monotonic() - start

    try:
        keys = [(calls, False), (0, False), (calls, True), (0, True)]
        times = stats.alternate(keys, runs, lambda key, _: timed(*key))
        best = {key: min(v) for key, v in times.items()}
        timed(calls, True)
        script = subprocess.run(["perf", "script", "-i", data, "-F", "event"],
                                capture_output=True, text=True).stdout
        hits = sum(1 for line in script.splitlines() if line.strip().startswith(event))
    finally:
        subprocess.run(["perf", "probe", "-q", "-d", event], capture_output=True)
    alone = best[(calls, False)] - best[(0, False)]
    probed = best[(calls, True)] - best[(0, True)]
    return (alone, probed, hits), None


def options(ap):
    ap.add_argument("--calls", type=int, default=20000,
                    help="parse_request calls of each of probe_target's two threads "
                         "(default 20000)")
    ap.add_argument("--native-calls", type=int, default=200000,
                    help="the same natively, where a hit costs far less than perf's own "
                         "start (default 200000)")


def run(ctx):
    with tempfile.TemporaryDirectory(prefix="insight-bench-probes-", ignore_cleanup_errors=True) as tmp:
        return measure(ctx, tmp)


def measure(ctx, tmp):
    args = ctx.args
    trace = os.path.join(tmp, "trace")
    log(f"recording probe_target {args.calls}")
    insight(["record", "--no-stdin", "-o", trace, "--", "probe_target", str(args.calls)])
    modes = {"plain": [], "1 probe": ONE, "10 probes": TEN}
    events = {}

    def replay(mode, i):
        db = os.path.join(tmp, f"{i}.db")
        argv = ["replay", "--no-console", trace, "--events", db, "--force"]
        for s in modes[mode]:
            argv += ["--probe", s]
        p, wall = insight(argv)
        events[mode] = probe_events(p.stderr)
        return wall
    walls = stats.alternate(list(modes), ctx.runs, replay)
    best = {m: min(w) for m, w in walls.items()}
    one_hits = events["1 probe"][0]
    if one_hits != 2 * args.calls:
        die(f"1 probe: {one_hits} hits, the program made {2 * args.calls} calls")
    entries, returns = events["10 probes"]
    rows = [
        Row(f"replay: plain, with 1 probe (parse_request; {one_hits} hits)", walls["1 probe"],
            walls["plain"], statistic=BEST),
        Row.computed("host time per hit at replay (1 probe)",
                     (best["1 probe"] - best["plain"]) / one_hits * 1e6, unit="µs", n=ctx.runs),
        Row(f"replay: plain, with 10 probes ({entries} PROBE, {returns} PROBE_RET events)",
            walls["10 probes"], walls["plain"], statistic=BEST),
    ]
    anchor, why = native_anchor(tmp, args.native_calls, ctx.runs)
    if anchor:
        alone, probed, hits = anchor
        rows.append(Row.computed(f"natively: the calls' time alone, under perf record of a uprobe "
                                 f"on parse_request ({hits} hits; best, less a run without calls)",
                                 probed, alone, n=ctx.runs))
        rows.append(Row.computed("natively: perf's time per uprobe hit",
                                 (probed - alone) / max(hits, 1) * 1e6, unit="µs", n=ctx.runs))
    else:
        print(f"natively: perf uprobe not measured: {why}")
    return rows
