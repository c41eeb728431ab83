"""Tries to failure of SCTBench's buggy programs under `insight record --chaos --until-fail`, beside how often they fail natively on one CPU.

  * natively: each program (tests/programs/sctbench, built with
    `gcc -pthread -g -O0`) run --native-runs times pinned to one CPU
    (`taskset -c 0`), a run still going after 5 s counted as a hang;
  * under insight: `insight record --chaos=SEED --until-fail=MAX
    --timeout T` for each seed, the try that failed (MAX + 1 where none
    did) and how (exit status or hang). docs/chaos.md says what the
    figures mean;
  * what chaos costs a program that does not fail: `insight record` of
    `syn_cont 1000 2000` with and without `--chaos`, alternating, wall
    time (boot snapshot restore included).

Usage: tools/bench chaos [--runs N] [--max-tries N] [--native-runs N]
                         [--timeout D] [--programs P,...] [--no-cost]
Runs N seeds (1000, 2000, ...). Needs a built guest (tools/build-guest).
"""
import os
import re
import subprocess
import tempfile

from .common import REPO, die, insight, log
from . import stats
from .stats import Row

TITLE = "Chaos"
DURATION = "30-60 min"
RUNS = 3

PROGRAMS = ("account_bad,bluetooth_driver_bad,carter01_bad,circular_buffer_bad,deadlock01_bad,"
            "queue_bad,stack_bad,token_ring_bad")
COST = "syn_cont 1000 2000"


def options(ap):
    ap.add_argument("--max-tries", type=int, default=50,
                    help="tries per seed before giving up (default 50)")
    ap.add_argument("--native-runs", type=int, default=200,
                    help="native runs per program on one CPU (default 200)")
    ap.add_argument("--timeout", default="30s",
                    help="no progress for this long is a hang (default 30s)")
    ap.add_argument("--programs", default=PROGRAMS,
                    help=f"SCTBench programs, comma-separated (default {PROGRAMS})")
    ap.add_argument("--no-cost", action="store_true",
                    help=f"leave out what chaos costs a recording of {COST}")


def native_failures(prog, runs):
    fails = 0
    for _ in range(runs):
        try:
            p = subprocess.run(["taskset", "-c", "0", prog], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=5)
            fails += p.returncode != 0
        except subprocess.TimeoutExpired:
            fails += 1
    return fails


TRY = re.compile(r"insight: try (\d+) \(chaos seed \d+\) failed")
HOW = re.compile(r"insight: try \d+ \(chaos seed \d+\) failed[^\n]*")


def run(ctx):
    with tempfile.TemporaryDirectory(prefix="insight-bench-chaos-", ignore_cleanup_errors=True) as tmp:
        return measure(ctx, tmp)


def measure(ctx, tmp):
    a = ctx.args
    os.environ["INSIGHT_TRACE_DIR"] = os.path.join(tmp, "store")
    rows = []
    for name in [p for p in a.programs.split(",") if p]:
        src = os.path.join(ctx.repo, "tests", "programs", "sctbench", f"{name}.c")
        if not os.path.exists(src):
            src = os.path.join(REPO, "tests", "programs", "sctbench", f"{name}.c")
        if not os.path.exists(src):
            die(f"no SCTBench program {name}")
        prog = os.path.join(tmp, name)
        subprocess.run(["gcc", "-pthread", "-g", "-O0", "-w", "-o", prog, src], check=True)
        log(f"{name}: {a.native_runs} native runs on one CPU")
        fails = native_failures(prog, a.native_runs)
        tries = []
        for i in range(ctx.runs):
            seed = 1000 * (i + 1)
            log(f"{name}: chaos seed {seed}, at most {a.max_tries} tries")
            p, _ = insight(["record", "--no-stdin", f"--chaos={seed}", f"--until-fail={a.max_tries}",
                            "--timeout", a.timeout, "--", prog], check=False)
            m = TRY.search(p.stderr)
            tries.append(int(m.group(1)) if m else a.max_tries + 1)
            how = HOW.search(p.stderr)
            print(f"{name}, seed {seed}: " + (f"failed at try {m.group(1)} (status {p.returncode}; "
                                             f"{how.group(0)})" if m
                                             else f"no failure in {a.max_tries} tries"))
            subprocess.run(["rm", "-rf", os.environ["INSIGHT_TRACE_DIR"]], check=False)
        rows.append(Row.computed(f"{name}: native failures on one CPU, of {a.native_runs}",
                                 fails, unit="runs", n=a.native_runs))
        rows.append(Row(f"{name}: chaos tries to failure ({a.max_tries + 1}: none)", tries,
                        unit="tries"))
    if not a.no_cost:
        rows.append(cost(ctx.runs, tmp))
    return rows


def cost(runs, tmp):
    """`record` of COST with chaos against without, alternating."""
    def record(mode, i):
        chaos = [f"--chaos={1000 * (i + 1)}"] if mode == "chaos" else []
        _, wall = insight(["record", "--no-stdin", "-o", os.path.join(tmp, f"cost-{mode}-{i}"),
                           *chaos, "--", *COST.split()])
        subprocess.run(["rm", "-rf", os.path.join(tmp, f"cost-{mode}-{i}")], check=False)
        return wall
    walls = stats.alternate(["plain", "chaos"], runs, record)
    return Row(f"record {COST}, wall: without chaos, with", walls["chaos"], walls["plain"])
