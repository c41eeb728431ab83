"""Replay-time expansion against Valgrind's lackey, measured side by side.

One program, tests/programs/mem_access.c (a global array written once and
read twice, a loop of 2,001 instructions; built with -O1 -no-pie), is

  * recorded once with the probe library, then replayed RUNS times without
    tracing, RUNS times with `--trace-process PID --trace-instructions
    --trace-memory` and RUNS times with `--trace-by-traps` too (every
    instruction a debug exception in user mode, as before instructions were
    stepped in guest kernel mode), alternating (wall time, medians): the
    replay's slowdown, and the instructions and accesses traced per second
    the tracing added;
  * run natively RUNS times, and RUNS times under `valgrind --tool=lackey
    --trace-mem=yes` (wall time, medians): lackey's slowdown, and the
    instructions and accesses per second it traced.

Usage: tools/bench expand [--runs N]
  --runs N   repetitions of each timed command (default 3)
Needs a built guest (tools/build-guest) and gcc; installs valgrind from
Debian's packages if it is missing.
"""
import os
import re
import tempfile

from . import stats
from .common import REPO, die, insight, log, need, run as timed
from .harness import Report
from .stats import Row

TITLE = "Replay-time tracing against Valgrind's lackey"
DURATION = "6 min"
RUNS = 3

SUMMARY = re.compile(
    r"traced process (\d+): (\d+) instructions and (\d+) memory accesses in \d+ threads? ")


def run(ctx):
    need({"valgrind": "valgrind"})
    with tempfile.TemporaryDirectory(prefix="insight-bench-expand-", ignore_cleanup_errors=True) as tmp:
        return measure(ctx.runs, tmp)


def measure(runs, tmp):
    prog = os.path.join(tmp, "mem_access")
    timed(["gcc", "-O1", "-no-pie", "-o", prog, os.path.join(REPO, "tests", "programs", "mem_access.c")])
    cfg = os.path.join(tmp, "vm.toml")
    with open(cfg, "w") as f:
        f.write('command = "mem_access"\n[[files]]\nhost = "mem_access"\n'
                'guest = "/usr/local/bin/mem_access"\n')
    trace = os.path.join(tmp, "trace")
    log("recording mem_access")
    insight(["record", "--no-stdin", "--probes", "-o", trace, cfg])
    db = os.path.join(tmp, "plain.db")
    insight(["replay", trace, "--no-console", "--events", db])
    p, _ = insight(["report", "threads", db])
    pid = next((l.split()[1] for l in p.stdout.splitlines()
                if len(l.split()) > 2 and l.split()[2] == "mem_access"), None)
    if pid is None:
        die(f"no mem_access thread in:\n{p.stdout}")

    tracing = {"plain": None, "traced": [], "trapped": ["--trace-by-traps"]}
    counts = []

    def replay(mode, i):
        if i == 0 or mode == "plain":
            log(f"replay {mode}, round {i + 1} of {runs}")
        argv = ["replay", trace, "--no-console", "--events", db]
        if tracing[mode] is not None:
            argv += ["--trace-process", pid, "--trace-instructions", os.path.join(tmp, "i.zst"),
                     "--trace-memory", os.path.join(tmp, "m.txt")] + tracing[mode]
        p, wall = insight(argv)
        if tracing[mode] is not None:
            m = SUMMARY.search(p.stderr)
            if not m:
                die(f"no tracing summary in:\n{p.stderr}")
            if mode == "traced":
                counts.append((int(m[2]), int(m[3])))
        return wall
    walls = stats.alternate(list(tracing), runs, replay)
    trace_size = os.path.getsize(os.path.join(tmp, "i.zst"))

    lackey_log = os.path.join(tmp, "lackey.txt")

    def natively(mode, i):
        if mode == "native":
            log(f"native and under lackey, round {i + 1} of {runs}")
            return timed([prog])[1]
        return timed(["valgrind", "--tool=lackey", "--trace-mem=yes", f"--log-file={lackey_log}",
                      prog])[1]
    native = stats.alternate(["native", "lackey"], runs, natively)
    lk_insns = lk_accesses = 0
    with open(lackey_log) as f:
        for line in f:
            if line.startswith("I "):
                lk_insns += 1
            elif line[:3] in (" L ", " S ", " M "):
                lk_accesses += 1

    med = stats.median
    plain, traced, trapped = walls["plain"], walls["traced"], walls["trapped"]
    lackey = native["lackey"]
    insns, accesses = (med([c[k] for c in counts]) for k in range(2))
    # What tracing added to the replay: the steps' time.
    stepping = max(med(traced) - med(plain), 1e-3)
    trapping = max(med(trapped) - med(plain), 1e-3)
    print(f"mem_access, {runs} runs each, medians (wall time)\n")
    print("| | insight replay | insight replay, --trace-by-traps | Valgrind lackey (native) |")
    print("|---|---|---|---|")
    print(f"| instructions traced | {insns:.0f} | {insns:.0f} | {lk_insns} |")
    print(f"| accesses traced | {accesses:.0f} | {accesses:.0f} | {lk_accesses} |")
    print(f"| instructions per second traced | {insns / stepping:,.0f} | {insns / trapping:,.0f} | "
          f"{lk_insns / med(lackey):,.0f} |")
    print(f"| accesses per second traced | {accesses / stepping:,.0f} | "
          f"{accesses / trapping:,.0f} | {lk_accesses / med(lackey):,.0f} |")
    print(f"\nsteps in guest kernel mode against traps: {trapping / stepping:.2f}x faster; "
          f"instruction trace: {trace_size} bytes compressed ({trace_size / max(insns, 1):.2f} "
          f"bytes per instruction); insight's rates are per second the tracing added to the "
          f"replay ({stepping:.1f} s, {trapping:.1f} s by traps), lackey's per second of its "
          f"whole run")
    rows = [
        Row("replay (wall): without tracing, with it", traced, plain),
        Row("replay (wall): without tracing, with it by traps (--trace-by-traps)", trapped, plain),
        Row("mem_access natively (wall): alone, under Valgrind lackey", lackey, native["native"]),
        Row.computed("slowdown of tracing: Valgrind lackey, insight replay",
                     med(traced) / med(plain), med(lackey) / med(native["native"]), unit="x", n=runs),
        Row.computed("host time per traced instruction: Valgrind lackey, insight",
                     stepping / insns * 1e6, med(lackey) / max(lk_insns, 1) * 1e6, unit="µs", n=runs),
        Row.computed("host time per traced instruction: Valgrind lackey, insight by traps",
                     trapping / insns * 1e6, med(lackey) / max(lk_insns, 1) * 1e6, unit="µs", n=runs),
    ]
    return Report(rows, {"plain_s": med(plain), "traced_s": med(traced), "trapped_s": med(trapped),
                         "slowdown": med(traced) / med(plain),
                         "trapped_slowdown": med(trapped) / med(plain),
                         "lackey_slowdown": med(lackey) / med(native["native"]),
                         "instructions": insns, "accesses": accesses,
                         "us_per_instruction": stepping / insns * 1e6,
                         "us_per_instruction_trapped": trapping / insns * 1e6})
