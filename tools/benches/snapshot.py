"""Boot snapshots against cold boots, measured side by side in one run.

  * `insight run -- true`: restored from the cached boot snapshot against
    --cold-boot, the two alternating, RUNS times each (wall time, medians);
  * taking the snapshot: the first run of an empty cache;
  * `insight record` and `insight replay` of syn_cont with the probe
    library, restored against --cold-boot (record wall time, replay wall
    time, trace size without the snapshot, and the snapshot's size).

The snapshots go to a cache of the benchmark's own (INSIGHT_SNAPSHOT_DIR
in a temporary directory), removed at the end.

Usage: tools/bench snapshot [--runs N] [--syn-cont ARGS]
  --runs N          repetitions of each timed command (default 3)
  --syn-cont ARGS   syn_cont's arguments (default "1000 2000")
Needs a built guest (tools/build-guest).
"""
import os
import shutil
import tempfile

from . import stats
from .common import die, insight, log, matched, trace_bytes
from .stats import Row

TITLE = "Boot snapshots"
DURATION = "3.2 min"
RUNS = 3


def options(ap):
    ap.add_argument("--syn-cont", default="1000 2000", help='syn_cont\'s arguments (default "1000 2000")')


def run(ctx):
    tmp = tempfile.mkdtemp(prefix="insight-bench-snapshot-")
    cache = os.path.join(tmp, "cache")
    before = os.environ.get("INSIGHT_SNAPSHOT_DIR")
    os.environ["INSIGHT_SNAPSHOT_DIR"] = cache
    try:
        log("taking the boot snapshot (first run, empty cache)")
        p, first = insight(["run", "--no-stdin", "--", "true"])
        if "taking a boot snapshot" not in p.stderr:
            die(f"the first run took no snapshot:\n{p.stderr}")
        snap = next(f for f in os.listdir(cache) if f.endswith(".snap"))
        snap_bytes = os.path.getsize(os.path.join(cache, snap))

        def run_true(mode, i):
            log(f"insight run -- true ({mode}), round {i + 1} of {ctx.runs}")
            extra = ["--cold-boot"] if mode == "cold" else []
            p, wall = insight(["run", "--no-stdin"] + extra + ["--", "true"])
            if mode == "restored" and "taking a boot snapshot" in p.stderr:
                die(f"a restored run took the snapshot again:\n{p.stderr}")
            return wall
        true = stats.alternate(["restored", "cold"], ctx.runs, run_true)

        syn = ["syn_cont"] + ctx.args.syn_cont.split()
        rec = {"restored": [], "cold": []}
        rep = {"restored": [], "cold": []}
        size = {"restored": [], "cold": []}
        for i, mode in stats.rounds(["restored", "cold"], ctx.runs):
            log(f"record and replay {' '.join(syn)} ({mode}), round {i + 1} of {ctx.runs}")
            trace = os.path.join(tmp, f"{mode}-{i}")
            extra = ["--cold-boot"] if mode == "cold" else []
            _, wall = insight(["record", "--no-stdin", "--probes"] + extra + ["-o", trace, "--"] + syn)
            rec[mode].append(wall)
            p, wall = insight(["replay", trace, "--no-console"])
            matched(p.stderr, f"the replay of {trace}")
            rep[mode].append(wall)
            size[mode].append(trace_bytes(trace) / 1024)
            shutil.rmtree(trace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if before is None:
            os.environ.pop("INSIGHT_SNAPSHOT_DIR", None)
        else:
            os.environ["INSIGHT_SNAPSHOT_DIR"] = before

    both = {m: [a + b for a, b in zip(rec[m], rep[m])] for m in rec}
    name = " ".join(syn)
    print(f"Each restored run is followed by a cold one; baseline: --cold-boot, insight: restored "
          f"from the boot snapshot. The snapshot, taken on the first run in {first:.1f} s (boot "
          f"and take), is {snap_bytes / 2**20:.1f} MiB.")
    return [
        Row("taking the boot snapshot (the first run of an empty cache), wall", [first]),
        Row("boot snapshot size", [snap_bytes / 2**20], unit="MiB"),
        Row("`insight run -- true` (wall): --cold-boot, restored", true["restored"], true["cold"]),
        Row(f"`insight record --probes -- {name}` (wall): --cold-boot, restored", rec["restored"],
            rec["cold"]),
        Row("`insight replay` of that recording (wall): --cold-boot, restored", rep["restored"],
            rep["cold"]),
        Row("record + replay: --cold-boot, restored", both["restored"], both["cold"]),
        Row("trace log (events + payloads): --cold-boot, restored", size["restored"], size["cold"],
            unit="KiB"),
    ]
