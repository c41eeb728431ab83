"""Costs of `insight debug`, measured side by side in one run.

  * the first prompt: `insight debug` until gdb stands at the program's
    first instruction (gdb started, connected, symbols read), against a
    forward `insight replay` of the same recording to its end;
  * reverse-continue: from overwriter's final report, back to the write
    one of four threads made at a random round (a watchpoint), timed
    inside gdb, against the forward replay of the same stretch;
  * reverse-stepi: N steps back from the report, each not served by a
    forward step already taken (the instruction before is found by a
    breakpoint and a replay from a snapshot, or by single steps): median
    and worst, timed inside gdb;
  * reverse-continue across a 30 s recording to a breakpoint hit 10,000
    times (ticker: tick() every 3 ms): from done() back to the last call
    and the one before, against the snapshot interval (a reverse command
    replays from the snapshot before now: its goal is at most two
    intervals);
  * the same ticker scenario under QEMU's record/replay (TCG with
    instruction counting, `-icount shift=auto,rr=record|replay`, its one
    snapshot at the start kept in a scratch qcow2 image), debugged
    through QEMU's gdb stub: the same guest kernel and initramfs, booted
    as tools/bench qemu boots them, with `norandmaps` so that ticker's
    symbols can be placed at the kernel's fixed PIE base. QEMU's stub
    shows the whole machine, not a process: its first prompt is at the
    machine's first instruction, so the figure beside insight's is the
    time until gdb stands at ticker's main(). QEMU replays under gdb
    about ten times slower than it records, and each reverse command
    replays from the recording's start: ticker runs 100 calls there
    (`--qemu-calls`), a hundredth of insight's scenario, and the session
    stops after `--qemu-limit` seconds (1200), its figures so far kept.
    One run, two reverse-stepi. `--no-qemu` skips it;
  * rr needs a hardware PMU: the table says whether the host has one
    (/sys/bus/event_source/devices/cpu); rr is not measured by this tool.

Each gdb command is timed by gdb's own Python (`time.monotonic()` around
it), so gdb's start and symbol reading are outside those figures.

Usage: tools/bench debug [--runs N] [--steps N] [--no-qemu] [--qemu-calls N]
                         [--qemu-limit S]
Needs a built guest (tools/build-guest) and gdb, for QEMU
qemu-system-x86 and qemu-utils (installed with apt-get when running as
root). About 30 minutes with QEMU.
"""
import os
import re
import socket
import subprocess
import tempfile
import time

from . import qemu_guest
from .common import (die, file_from_initramfs, guest_dir, initrd_with_command, insight, log,
                     need)
from .stats import Row

TITLE = "Debugging a recording"
DURATION = "20-30 min"
RUNS = 3


# insight debug's default --snapshot-every: the stretch a reverse command
# replays at most, before the stretch back to the hit.
SNAPSHOT_INTERVAL = 0.25


def timed(label, command):
    """gdb commands that run `command` and print how long it took."""
    return [
        "python import time; _t = time.monotonic()",
        command,
        f"python print('BENCH {label} %.3f' % (time.monotonic() - _t))",
    ]


def gdb_session(trace, commands, process=None):
    """Runs gdb in batch mode over `trace`; the BENCH figures it printed
    (label -> seconds, in order) and the session's wall time."""
    args = ["debug", trace]
    if process:
        args += ["--process", process]
    p, wall = insight(args + ["--"] + gdb_commands(commands)[1:])
    return bench_figures(p.stdout), wall, p.stdout + p.stderr


# Where Linux puts a PIE executable when randomization is off
# (`norandmaps`): ELF_ET_DYN_BASE of x86-64, page aligned.
PIE_BASE = 0x555555554000
TICKER = ["ticker", "10000", "2000000"]


def gdb_commands(commands):
    """gdb in batch mode running `commands`: its command line."""
    args = ["gdb", "-batch", "-nx"]
    for c in commands:
        args += ["-ex", c]
    return args


def bench_figures(text):
    return [(m.group(1), float(m.group(2)))
            for m in re.finditer(r"^BENCH (\S+) ([0-9.]+)$", text, re.M)]


def wait_listening(port, process, timeout=30):
    """Waits until something listens on 127.0.0.1:port (read from
    /proc/net/tcp, so that no connection is made to it) while `process`
    runs."""
    local = f"0100007F:{port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with open("/proc/net/tcp") as f:
            if any(l.split()[1] == local and l.split()[3] == "0A" for l in f.readlines()[1:]):
                return
        time.sleep(0.05)
    die(f"QEMU's gdb stub did not listen on port {port}")


def qemu_ticker(work, calls, steps, limit):
    """The ticker scenario, with `calls` calls, under QEMU's record/replay
    and gdb stub, the gdb session stopped after `limit` seconds: a dict of
    the record's wall time and the figures gdb printed by label (those of
    the commands done in time)."""
    qemu = qemu_guest
    need({qemu.QEMU: "qemu-system-x86", "qemu-img": "qemu-utils"})
    guest = guest_dir()
    d = os.path.join(work, "qemu")
    os.makedirs(d)
    cmdline = qemu.CMDLINE + qemu.QEMU_CMDLINE + " norandmaps"
    kernel = qemu.guest_kernel(guest, cmdline, os.path.join(d, "vmlinux"))
    initrd = initrd_with_command(guest, ["ticker", str(calls), TICKER[2]], os.path.join(d, "initrd"))
    exe = file_from_initramfs(guest, "usr/bin/ticker", os.path.join(d, "ticker"))
    # QEMU keeps the snapshot a replay starts from (and reverse commands
    # go back to) in a qcow2 image named by the `rr` drive.
    snap = os.path.join(d, "snapshots.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", snap, "64M"], check=True)
    rr = os.path.join(d, "ticker.rr")

    def argv(mode):
        icount = f"shift=auto,rr={mode},rrfile={rr},rrsnapshot=init"
        return qemu.qemu_argv(kernel, initrd, cmdline, icount) + ["-drive", f"file={snap},if=none,id=rr"]

    log(f"QEMU: recording ticker {calls} (TCG, icount)")
    wall, lines, _ = qemu.run("QEMU record of ticker", argv("record"), timeout=1800)
    if not any(f"ticker: {calls} calls" in l for _, l in lines):
        die("ticker under QEMU printed no report:\n" + "".join(l for _, l in lines[-20:]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    commands = ["set pagination off", f"add-symbol-file {exe} -o {PIE_BASE:#x}",
                f"target remote 127.0.0.1:{port}", "break main", "continue",
                "python print('BENCH at-main %.3f' % time.monotonic())", "delete",
                "break done"]
    commands += timed("forward", "continue")
    commands += ["break tick"]
    commands += timed("last-hit", "reverse-continue") + ["print calls"]
    commands += timed("hit-before", "reverse-continue") + ["print calls", "delete"]
    for _ in range(steps):
        commands += timed("reverse-stepi", "reverse-stepi")
    log(f"QEMU: replaying under gdb (at most {limit} s)")
    out_path = os.path.join(d, "gdb.out")
    start = time.monotonic()
    q = subprocess.Popen(argv("replay") + ["-gdb", f"tcp:127.0.0.1:{port}", "-S"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, q)
        with open(out_path, "w") as out:
            subprocess.run(gdb_commands(["python import time"] + commands), stdin=subprocess.DEVNULL,
                           stdout=out, stderr=subprocess.STDOUT, timeout=limit)
    except subprocess.TimeoutExpired:
        pass
    finally:
        q.kill()
        q.wait()
    with open(out_path) as f:
        text = f.read()
    got = {}
    for label, v in bench_figures(text):
        got.setdefault(label, []).append(v)
    if "at-main" not in got or "forward" not in got:
        die(f"gdb did not reach ticker's main() and done() under QEMU:\n{text[-3000:]}")
    for label, value in (("last-hit", calls - 1), ("hit-before", calls - 2)):
        if label in got and f"= {value}" not in text:
            die(f"QEMU's reverse-continue did not stop at call {value} of tick():\n{text[-3000:]}")
    got["first-prompt"] = [got.pop("at-main")[0] - start]
    return {"record": wall, "figures": got}


def has_pmu():
    """Whether the kernel knows a hardware PMU (rr's requirement)."""
    devices = "/sys/bus/event_source/devices"
    return any(os.path.isdir(os.path.join(devices, d)) for d in ("cpu", "cpu_core", "cpu_atom"))


def options(ap):
    ap.add_argument("--steps", type=int, default=20, help="reverse-stepi per session (default 20)")
    ap.add_argument("--no-qemu", action="store_true", help="skip QEMU's record/replay gdb stub")
    ap.add_argument("--qemu-calls", type=int, default=100,
                    help="ticker's calls under QEMU (default 100: its replay under gdb is slow)")
    ap.add_argument("--qemu-limit", type=int, default=1200,
                    help="seconds QEMU's gdb session may take (default 1200)")


def run(ctx):
    need({"gdb": "gdb"})
    with tempfile.TemporaryDirectory(prefix="insight-bench-debug-", ignore_cleanup_errors=True) as work:
        return measure(ctx.runs, ctx.args, work)


def measure(runs, args, work):
    trace = os.path.join(work, "overwriter")
    rec, rec_wall = insight(["record", "--no-stdin", "-o", trace, "--",
                             "overwriter", "4", "2000000"])
    if "overwriter: shared" not in rec.stdout:
        die(f"overwriter printed no report:\n{rec.stdout}")

    replay_walls, first_prompt, back, back_hits, steps = [], [], [], [], []
    for _ in range(runs):
        _, wall = insight(["replay", trace])
        replay_walls.append(wall)
        _, wall, _ = gdb_session(trace, ["info registers rip"], "overwriter")
        first_prompt.append(wall)
        commands = ["break report", "continue", "delete", "watch -l shared"]
        commands += timed("reverse-continue", "reverse-continue")
        commands += ["delete"]
        for i in range(args.steps):
            commands += timed("reverse-stepi", "reverse-stepi")
        figures, _, out = gdb_session(trace, commands, "overwriter")
        if "scribble" not in out:
            die(f"reverse-continue did not reach the write:\n{out}")
        back += [s for label, s in figures if label == "reverse-continue"]
        steps += [s for label, s in figures if label == "reverse-stepi"]
        back_hits.append(out.count("Hardware watchpoint"))
    if not back or len(steps) < args.steps:
        die("gdb printed no timings")

    # The 10,000-hit scenario: one recording, replayed and debugged per run.
    ticker = os.path.join(work, "ticker")
    rec, ticker_rec_wall = insight(["record", "--no-stdin", "-o", ticker, "--"] + TICKER)
    if "ticker: 10000 calls" not in rec.stdout:
        die(f"ticker printed no report:\n{rec.stdout}")
    ticker_replays, last_hit, hit_before = [], [], []
    for _ in range(runs):
        _, wall = insight(["replay", ticker])
        ticker_replays.append(wall)
        commands = ["break done", "continue", "break tick"]
        commands += timed("last-hit", "reverse-continue") + ["print calls"]
        commands += timed("hit-before", "reverse-continue") + ["print calls"]
        figures, _, out = gdb_session(ticker, commands)
        if "= 9999" not in out or "= 9998" not in out:
            die(f"reverse-continue did not stop at the last two calls of tick():\n{out}")
        last_hit += [s for label, s in figures if label == "last-hit"]
        hit_before += [s for label, s in figures if label == "hit-before"]

    qemu_result = None if args.no_qemu else qemu_ticker(work, args.qemu_calls, 2, args.qemu_limit)

    print(f"overwriter 4 2000000 recorded in {rec_wall:.1f} s; ticker {' '.join(TICKER[1:])} "
          f"(tick() every ~3 ms) recorded in {ticker_rec_wall:.1f} s.")
    if qemu_result:
        got = qemu_result["figures"]
        print(f"ticker {args.qemu_calls} {TICKER[2]} under QEMU TCG record/replay: recorded in "
              f"{qemu_result['record']:.1f} s; forward replay main() to done() "
              f"{got['forward'][0]:.1f} s (in gdb); set against insight's figures for {TICKER[1]} "
              "calls.")
        for label, key in (("reverse-continue to the last hit", "last-hit"),
                           ("reverse-continue to the hit before it", "hit-before"),
                           ("reverse-stepi", "reverse-stepi")):
            if key not in got:
                print(f"QEMU: {label} not done in the session's {args.qemu_limit} s.")
    print("rr: " + ("this host has a hardware PMU; rr is not measured by this benchmark."
                    if has_pmu() else "cannot run here: the host has no hardware PMU "
                    "(no /sys/bus/event_source/devices/cpu)."))
    rows = [
        Row("overwriter: forward replay to the end (wall)", replay_walls),
        Row("first prompt (`insight debug`, gdb started, quit): forward replay, first prompt",
            first_prompt, replay_walls),
        Row("reverse-continue to the write (in gdb): forward replay, reverse-continue", back,
            replay_walls),
        Row("reverse-stepi (in gdb)", steps),
        Row.computed("reverse-stepi, worst (in gdb)", max(steps), n=len(steps)),
        Row("ticker: forward replay to the end (wall)", ticker_replays),
        Row(f"reverse-continue to the last of 10,000 hits (in gdb): the {SNAPSHOT_INTERVAL * 1000:.0f}-ms "
            "snapshot interval, reverse-continue", last_hit, [SNAPSHOT_INTERVAL]),
        Row("reverse-continue to the hit before it (in gdb): the snapshot interval, reverse-continue",
            hit_before, [SNAPSHOT_INTERVAL]),
    ]
    if qemu_result:
        got = qemu_result["figures"]
        rows.append(Row(f"first prompt at main(): QEMU (ticker {args.qemu_calls}), insight",
                        first_prompt, got["first-prompt"]))
        for label, key, ours in (("reverse-continue to the last hit", "last-hit", last_hit),
                                 ("reverse-continue to the hit before it", "hit-before", hit_before),
                                 ("reverse-stepi", "reverse-stepi", steps)):
            if key in got:
                rows.append(Row(f"{label} (in gdb): QEMU ({args.qemu_calls} calls), insight "
                                f"({TICKER[1]} calls)", ours, got[key]))
    return rows
