"""Costs of the heap events, measured side by side in one run.

  * recording: alloc_churn (a malloc/free/realloc/calloc loop) under
    `insight record`, without the probe library, with it (heap events
    through the heap gate: a call to a bare `ret` each), and with it but
    INSIGHT_PROBES=noheap, alternating, timed inside the guest by the
    guest's clock; every variant runs through `env`, so all pay the same
    extra exec;
  * replay: one recording with probes, replayed with --events (the heap
    gate silent), with --events --heap-events (each heap event copied into
    the event ring) and with --events --heap-events --event-exits (an exit
    per heap event, as before the ring), alternating; wall times, the heap
    events written, and the host time per heap event each way.

Usage: tools/bench heap [--runs N] [--record-rounds N] [--replay-rounds N]
Needs a built guest (tools/build-guest).
"""
import os
import re
import tempfile

from . import stats
from .common import PRELOAD, die, guest_ns, insight
from .stats import Row

TITLE = "Heap events"
DURATION = "3 min"
RUNS = 3


def options(ap):
    ap.add_argument("--record-rounds", type=int, default=1000000,
                    help="rounds of alloc_churn in the recordings timed (default 1000000)")
    ap.add_argument("--replay-rounds", type=int, default=20000,
                    help="rounds in the recording replayed (an exit per heap event; default 20000)")


def heap_events(stderr):
    """The heap events of replay's summary line."""
    m = re.search(r"events written to .*?\((.*)\)", stderr)
    if not m:
        die(f"no event summary in:\n{stderr}")
    return sum(int(n) for n, kind in re.findall(r"(\d+) (HEAPCALL|ALLOC|FREE)\b", m.group(1)))


def run(ctx):
    with tempfile.TemporaryDirectory(prefix="insight-bench-heap-", ignore_cleanup_errors=True) as tmp:
        return measure(ctx, tmp)


def measure(ctx, tmp):
    work = f"alloc_churn {ctx.args.record_rounds}"
    envs = {"plain": "", "heap": PRELOAD, "noheap": f"{PRELOAD} INSIGHT_PROBES=noheap"}

    def record(v, i):
        p, _ = insight(["record", "--no-stdin", "-o", os.path.join(tmp, f"{v}-{i}"),
                        "--", "sh", "-c", f"timeit env {envs[v]} {work} >/dev/null"])
        return guest_ns(p.stdout) / 1e9
    times = stats.alternate(list(envs), ctx.runs, record)
    rows = [
        Row(f"record, {work} (guest time): without probes, with (heap events)", times["heap"],
            times["plain"]),
        Row(f"record, {work} (guest time): without probes, with INSIGHT_PROBES=noheap",
            times["noheap"], times["plain"]),
    ]

    work = f"alloc_churn {ctx.args.replay_rounds}"
    trace = os.path.join(tmp, "replayed")
    insight(["record", "--no-stdin", "-o", trace, "--", "env", PRELOAD, *work.split()])
    modes = {"events": [], "heap": ["--heap-events"], "heap exits": ["--heap-events", "--event-exits"]}
    counted = []

    def replay(mode, i):
        db = os.path.join(tmp, f"{mode}-{i}.db")
        p, wall = insight(["replay", "--no-console", trace, "--events", db] + modes[mode])
        if modes[mode]:
            counted.append(heap_events(p.stderr))
        elif heap_events(p.stderr):
            die("a replay without --heap-events wrote heap events")
        return wall
    walls = stats.alternate(list(modes), ctx.runs, replay)
    count = counted[-1]
    print(f"The replays with --heap-events wrote {count} heap events.")
    base = stats.median(walls["events"])
    for mode, how in [("heap", "through the event ring"), ("heap exits", "an exit each (--event-exits)")]:
        rows.append(Row(f"replay of {work}, {how}: without --heap-events, with", walls[mode],
                        walls["events"]))
        if count:
            with_heap = stats.median(walls[mode])
            rows.append(Row.computed(f"host time per heap event at replay, {how}",
                                     (with_heap - base) / count * 1e6, unit="µs", n=ctx.runs))
    return rows
