"""Guest boot time: insight vs QEMU (TCG) on the same kernel and initramfs.

insight boots from power-on here (--cold-boot), as QEMU does: its boot
snapshot, which runs restore instead, is measured by tools/bench snapshot.

Measures, side by side in one run:
  * insight: VM time at which user-space /init started (reported by /init
    itself through the platform control port), and wall time from starting
    `insight run` to the guest command's first output line;
  * the same wall time for QEMU with TCG, booting the same kernel (as
    bzImage) and initramfs with the same guest command;
  * a breakdown of insight's boot by phase, from the arrival time of the
    kernel's console lines in a verbose boot.

Usage: tools/bench boot [--runs N] [--no-qemu]
Needs a built guest (tools/build-guest).
"""
import os
import re
import subprocess
import tempfile
import time

from .common import GUEST_CMDLINE, binary, die, guest_dir, initrd_with_command, log, need
from .stats import Row

TITLE = "Boot time"
DURATION = "about 2 min"
RUNS = 3
MARK = "bench-ready"

# Console lines that open a boot phase, in order. Messages printed before
# the serial console is registered arrive in one burst when it is, so the
# first phase ends at the first line of output.
FIRST_LINE = re.compile(r".")
PHASES = [
    ("kernel entry to console (memory, IRQ, scheduler setup)", None),
    ("initcalls", FIRST_LINE),
    ("initramfs unpacking (async initcalls alongside)", re.compile(r"Unpacking initramfs")),
    ("late initcalls", re.compile(r"Freeing initrd memory")),
    ("freeing init memory, read-only data", re.compile(r"Freeing unused kernel image \(initmem\)")),
    ("/init", re.compile(r"Run /init as init process")),
]


def options(ap):
    ap.add_argument("--no-qemu", action="store_true", help="leave QEMU's boot out")


def timed_lines(cmd, until=None, timeout=600):
    """Runs cmd; returns [(seconds since start, line)] of its stdout and its stderr."""
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    lines = []
    try:
        for raw in iter(p.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            lines.append((time.monotonic() - start, line))
            if until and until in line:
                break
            if time.monotonic() - start > timeout:
                break
    finally:
        if until:
            p.kill()
        err = p.stderr.read().decode(errors="replace")
        p.wait()
    return lines, err


def insight_boot():
    lines, err = timed_lines([binary(), "run", "--cold-boot", "--timings", "--", "sh", "-c", f"echo {MARK}"])
    wall = next((t for t, l in lines if MARK in l), None)
    m = re.search(r"/init reached at ([0-9.]+) s", err)
    if wall is None or not m:
        die(f"insight did not boot:\n{err}")
    return float(m.group(1)), wall


def insight_phases():
    lines, err = timed_lines([binary(), "run", "--cold-boot", "--verbose-boot", "--", "sh", "-c",
                              f"echo {MARK}"])
    marks = [0.0]
    for _, pattern in PHASES[1:]:
        t = next((t for t, l in lines if pattern.search(l)), None)
        marks.append(t if t is not None else marks[-1])
    end = next((t for t, l in lines if MARK in l), marks[-1])
    spans = [(PHASES[i][0], marks[i + 1] - marks[i]) for i in range(len(PHASES) - 1)]
    spans.append(("/init to first output", end - marks[-1]))
    return spans, end


def qemu_boot(guest):
    with tempfile.TemporaryDirectory() as tmp:
        initrd = initrd_with_command(guest, ["sh", "-c", f"echo {MARK}"], os.path.join(tmp, "initrd"))
        cmdline = GUEST_CMDLINE + " quiet"
        lines, _ = timed_lines(["qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", "256",
                                "-nographic", "-no-reboot", "-kernel", os.path.join(guest, "bzImage"),
                                "-initrd", initrd, "-append", cmdline], until=MARK, timeout=120)
        return next((t for t, l in lines if MARK in l), None)


def run(ctx):
    guest = guest_dir()
    if not ctx.args.no_qemu:
        need({"qemu-system-x86_64": "qemu-system-x86"})
    init_t, wall_t, qemu_t = [], [], []
    for i in range(ctx.runs):
        vm_init, wall = insight_boot()
        init_t.append(vm_init)
        wall_t.append(wall)
        q = None if ctx.args.no_qemu else qemu_boot(guest)
        if q is not None:
            qemu_t.append(q)
        log(f"run {i + 1}: insight /init at {vm_init:.2f} s VM time, first output at {wall:.2f} s"
            + (f"; qemu-tcg first output at {q:.2f} s" if q is not None else ""))
    rows = [Row("insight: boot to /init (VM time)", init_t),
            Row("start to first guest output (wall): QEMU TCG, insight", wall_t, qemu_t or None)]

    spans, total = insight_phases()
    print(f"Breakdown of a verbose boot (console line arrival times; total {total:.2f} s):\n")
    print("| phase | time | share |")
    print("|---|---:|---:|")
    for name, secs in spans:
        print(f"| {name} | {secs:.2f} s | {100 * secs / total:.1f} % |")
    return rows
