"""User code in the guest against the same code natively, side by side.

Three CPU-bound loops without system calls (tools/native/loops.c: a
floating-point loop over a 32 KiB array, a pointer chase through a
256 KiB table, a register-only hash), built on the host and run

  * natively, pinned to one CPU (`taskset -c 0`, like the 1-vCPU guest),
  * in the guest with `insight run -- LOOPS`,
  * the same with the periodic tick (`--cmdline nohz=off`: the guest kernel
    then ticks 100 times a second whatever runs), and
  * recorded with `insight record -- LOOPS`,

alternating, best of N for each. Each loop times itself with
CLOCK_MONOTONIC (in the guest: insight's paravirtual clock, host time), so
exec and boot are outside the figures. In the guest it also counts the
timer interrupts over the loop and the process's user and system ticks:
"excess per periodic tick" is the periodic run's extra time over native
divided by the ticks that came meanwhile, the price of one tick on this
host.

Then guest-only figures, best of N under `insight run`, with the default
kernel and with `nohz=off` side by side: `timeit sleep 2` beside `timeit
sleep 0` (their difference is the sleep, 2.0 s on a machine whose timer
costs nothing; the rest is the exec of `sleep` in an interpreted kernel)
and `dd bs=1 count=20000`, a system-call-heavy run.

Usage: tools/bench native [--runs N]
Needs a built guest (tools/build-guest) and a C compiler.
"""
import os
import re
import shutil
import tempfile

from . import stats
from .common import REPO, die, guest_ns, insight, log, run as run_command
from .stats import BEST, Row

TITLE = "User code against native"
DURATION = "7 min"
RUNS = 3

# Iterations: about 1.5 s each natively on the development hosts.
LOOPS = [
    ("floating-point loop over a 32 KiB array", "fp", 500000),
    ("pointer chase through a 256 KiB table", "chase", 300000000),
    ("register-only hash loop", "hash", 800000000),
]
LINE = re.compile(r"loops: \w+ (\d+) ns, user (-?\d+) system (-?\d+) ticks, timer (-?\d+)")
PERIODIC = ["--cmdline", "nohz=off"]
SIDES = ["native", "run", "tick", "record"]
GUEST_COMMANDS = [
    ("timeit sleep 0 (the exec of sleep)", ["timeit", "sleep", "0"]),
    ("timeit sleep 2", ["timeit", "sleep", "2"]),
    ("dd bs=1 count=20000 (system calls)",
     ["timeit", "dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=20000"]),
]


def parse(text, what):
    m = LINE.search(text)
    if not m:
        die(f"no loops line from {what}:\n{text[-2000:]}")
    return tuple(int(g) for g in m.groups())


def run(ctx):
    if not shutil.which("taskset"):
        die("taskset (util-linux) is needed to pin the native runs")
    with tempfile.TemporaryDirectory(prefix="insight-bench-native-", ignore_cleanup_errors=True) as tmp:
        return measure(ctx, tmp)


def measure(ctx, tmp):
    loops = os.path.join(tmp, "loops")
    run_command(["cc", "-O2", "-o", loops, os.path.join(REPO, "tools", "native", "loops.c")],
                "building tools/native/loops.c")
    rows, detail = [], []
    for name, kind, n in LOOPS:
        argv = [loops, kind, str(n)]

        def one(side, i):
            if side == "native":
                p, _ = run_command(["taskset", "-c", "0"] + argv, "the native run")
                return parse(p.stdout, "the native run")
            if side == "record":
                trace = os.path.join(tmp, f"{kind}-{i}")
                p, _ = insight(["record", "--no-stdin", "-o", trace, "--"] + argv)
                shutil.rmtree(trace, ignore_errors=True)
                return parse(p.stdout, "insight record")
            extra = PERIODIC if side == "tick" else []
            p, _ = insight(["run", "--no-stdin"] + extra + ["--"] + argv)
            return parse(p.stdout, f"insight run {' '.join(extra)}")
        got = stats.alternate(SIDES, ctx.runs, one)
        secs = {side: [t[0] / 1e9 for t in got[side]] for side in SIDES}
        for side, what in (("run", "insight run"), ("record", "insight record"),
                           ("tick", "insight run, periodic tick (nohz=off)")):
            rows.append(Row(f"{name}: native, {what}", secs[side], secs["native"], statistic=BEST))
        nat, best_run, best_tick = min(got["native"]), min(got["run"]), min(got["tick"])
        _, user, system, timer = best_run
        timer_tick = best_tick[3]
        per_tick = (best_tick[0] - nat[0]) / timer_tick / 1e6 if timer_tick > 0 else float("nan")
        rows.append(Row.computed(f"{name}: excess per periodic tick", per_tick, unit="ms", n=ctx.runs))
        detail.append(f"| {name} | {timer} ({timer * 1e9 / best_run[0]:.0f}/s) | "
                      f"{timer_tick} ({timer_tick * 1e9 / best_tick[0]:.0f}/s) | {user}/{system} |")
        log(f"{name}: run {rows[-4].ratio:.2f}x, record {rows[-3].ratio:.2f}x native")

    for name, cmd in GUEST_COMMANDS:
        def one(side, _):
            extra = PERIODIC if side == "tick" else []
            p, _ = insight(["run", "--no-stdin"] + extra + ["--"] + cmd)
            return guest_ns(p.stdout, f"`{cmd}` {' '.join(extra)}") / 1e9
        got = stats.alternate(["run", "tick"], ctx.runs, one)
        rows.append(Row(f"`insight run`, {name}: default kernel, periodic tick (nohz=off)",
                        got["tick"], got["run"], statistic=BEST))

    print("Ratio: guest time over native time (1.00x: native speed); best of the runs, "
          "alternating. The guest's timer interrupts over each loop and its user/system ticks, "
          "in the best runs:\n")
    print("| loop (no system calls) | timer interrupts in the run | with the periodic tick "
          "| user/system ticks |")
    print("|---|---|---|---|")
    print("\n".join(detail))
    return rows
