"""Record and replay costs, measured side by side in one run.

  * record overhead: the same guest workload under `insight run` and under
    `insight record`, alternating, timed inside the guest (the guest's
    clock is the host's monotonic clock in both modes), for a CPU-bound
    user workload, two CPU-bound threads that never enter the kernel
    (preempted at asynchronous points while recording), a spin-lock
    workload and a system-call-heavy one;
  * asynchronous points: replay against record wall time of the
    two-thread workload, points per second of its recording, and the
    bytes an `AsyncPoint` entry takes in the log (`insight dump --stats`);
  * replay speed: wall time of `insight replay` against `insight record`
    of an idle-heavy run (the guest sleeps), where replay skips idle time;
  * trace size: compressed trace bytes per second of guest run, for
    boot-to-shutdown and for each workload of the determinism suite.

Usage: tools/bench replay [--runs N] [--quick]
  --runs N   repetitions of each timed comparison (default 3)
  --quick    skip the slowest trace-size workload (urandom_sha, ~2 min)
Needs a built guest (tools/build-guest).
"""
import os
import re
import shutil
import tempfile

from . import stats
from .common import die, guest_ns, insight, log, trace_bytes
from .stats import Row

TITLE = "Record and replay"
DURATION = "about 12 min"
RUNS = 3

# Guest commands that time their workload with the guest clock (timeit
# prints "timeit: N ns" on standard error, which is the console too).
TIMED = "timeit {w} >/dev/null"
WORKLOADS = {
    "CPU-bound user code (syn_cont 1000 20000)": "syn_cont 1000 20000",
    "two CPU-bound threads, no system calls (compute_pair 6)": "compute_pair 6",
    "spin lock, 4 threads (spin_lock 4 300)": "spin_lock 4 300",
    "system-call heavy (dd bs=1 count=20000)": "dd if=/dev/zero of=/dev/null bs=1 count=20000",
}
IDLE = "sleep 15; echo idle-done"
SUITE = [
    ("boot + shutdown", ["sh", "-c", "poweroff -f"]),
    ("clock_sleep", ["clock_sleep", "4"]),
    ("syn_cont 1000 2000 10", ["syn_cont", "1000", "2000", "10"]),
    ("sort_pipeline 3000", ["sort_pipeline", "3000"]),
    ("urandom_sha", ["urandom_sha"]),
]


def options(ap):
    ap.add_argument("--quick", action="store_true",
                    help="skip the slowest trace-size workload (urandom_sha, ~2 min)")


def recorded(stderr, what):
    m = re.search(r"recorded (\d+) deterministic exits, (\d+) log entries, ([\d.]+) s of guest time", stderr)
    if not m:
        die(f"no recording summary for {what}:\n{stderr}")
    return int(m.group(1)), float(m.group(3))


def async_points(stderr):
    m = re.search(r"preempted user code at (\d+) asynchronous points", stderr)
    return int(m.group(1)) if m else 0


def run(ctx):
    with tempfile.TemporaryDirectory(prefix="insight-bench-", ignore_cleanup_errors=True) as tmp:
        return measure(ctx, tmp)


def measure(ctx, tmp):
    rows = []
    for n, (name, w) in enumerate(WORKLOADS.items()):
        cmd = ["--", "sh", "-c", TIMED.format(w=w)]

        def timed(mode, i):
            trace = ["-o", os.path.join(tmp, f"w{n}-{i}")] if mode == "record" else []
            p, _ = insight([mode, "--no-stdin"] + trace + cmd)
            return guest_ns(p.stdout) / 1e9
        got = stats.alternate(["run", "record"], ctx.runs, timed)
        rows.append(Row(f"record overhead, {name}: run, record (guest time)", got["record"], got["run"]))
        log(f"record overhead, {name}: {rows[-1].ratio:.3f}x")

    walls = {"record": [], "replay": []}
    points = []
    for i in range(ctx.runs):
        trace = os.path.join(tmp, f"pair-{i}")
        p, w1 = insight(["record", "--no-stdin", "--summary", "-o", trace, "--", "compute_pair", "6"])
        _, w2 = insight(["replay", "--no-console", trace])
        walls["record"].append(w1)
        walls["replay"].append(w2)
        secs = recorded(p.stderr, "compute_pair")[1]
        points.append((async_points(p.stderr), secs))
    rows.append(Row("replay / record wall time, two CPU-bound threads (boot + compute_pair 6)",
                    walls["replay"], walls["record"]))
    stats_out, _ = insight(["dump", "--stats", trace])
    m = re.search(r"^AsyncPoint\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)", stats_out.stdout, re.M)
    rows.append(Row("asynchronous points per second of guest time (boot included), two CPU-bound "
                    "threads", [p / s for p, s in points], unit="points/s"))
    if m:
        rows.append(Row.computed("an AsyncPoint log entry, before compression / compressed",
                                 int(m.group(4)) / int(m.group(1)), float(m.group(3)), unit="B"))
    print(f"- asynchronous points: {stats.median([p for p, _ in points]):.0f} in "
          f"{stats.median([s for _, s in points]):.1f} s of guest time (medians of {ctx.runs}); "
          + (f"an entry: {float(m.group(3)):.0f} B before compression, "
             f"~{int(m.group(4)) / int(m.group(1)):.0f} B compressed" if m else "none logged"))

    walls = {"record": [], "replay": []}
    for i in range(ctx.runs):
        trace = os.path.join(tmp, f"idle-{i}")
        _, w1 = insight(["record", "--no-stdin", "-o", trace, "--", "sh", "-c", IDLE])
        _, w2 = insight(["replay", "--no-console", trace])
        walls["record"].append(w1)
        walls["replay"].append(w2)
    rows.append(Row("replay / record wall time, idle-heavy (boot + sleep 15)",
                    walls["replay"], walls["record"]))

    for name, cmd in SUITE:
        if ctx.args.quick and name == "urandom_sha":
            continue
        trace = os.path.join(tmp, "size-" + name.split()[0])
        p, _ = insight(["record", "--no-stdin", "--summary", "-o", trace, "--"] + cmd)
        exits, secs = recorded(p.stderr, name)
        size = trace_bytes(trace)
        rows.append(Row(f"trace size per second of guest time, {name}", [size / secs / 1024],
                        unit="KiB/s"))
        rows.append(Row(f"trace size per deterministic exit, {name}", [size / exits], unit="B"))
        print(f"- trace size, {name}: {size} B for {secs:.1f} s of guest time, {exits} exits")
        shutil.rmtree(trace, ignore_errors=True)
    return rows
