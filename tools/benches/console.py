"""Console output against writing the same bytes to /dev/null, side by side.

A guest command prints through the command's terminal: the virtio console
(hvc0, the default: a VM exit per buffer of output) or the 16550 UART
(`--console serial`: a VM exit per byte). Two kinds of writer, each timed
by the guest's clock (`timeit`), printing to the terminal and, in the same
round, into /dev/null:

  blocks  `head -c N /dev/zero`: stdio's 4 KiB buffer at a time (a
          terminal's output is line-buffered, and zeros end no line);
  lines   `yes | head -c N`: 2-byte writes ("y\\n"), one system call
          each, as a program that prints a line at a time.

under `insight run` and `insight record` with the virtio console, `insight
run --console serial`, `insight run` into a pipe (the command's standard
output a pipe that /init relays, as where insight's is no terminal), and
the anchors: QEMU 7.2 TCG with its serial port
(the same kernel, initramfs and command, booted as tools/bench qemu boots
it) and with a virtio console (QEMU's `microvm` machine, the only one with
virtio-mmio: the guest kernel has no PCI; its CPU without a local APIC, so
that the 8259's interrupts reach it with no firmware to set the APIC's
LINT0 up; QEMU is stopped once `timeit` has printed, since that machine
cannot power off). Rounds alternate between the setups; each figure is the
best of N.
Throughput is bytes over the guest-timed seconds; "/ null" is the time
against the same command writing into /dev/null in the same setup.

Usage: tools/bench console [--runs N] [--quick]
  --runs N   rounds (default 3)
  --quick    smaller sizes (1 MB blocks, 4000 bytes of lines), one round
Needs a built guest (tools/build-guest); QEMU (qemu-system-x86) is
skipped with a note where it is missing.
"""
import os
import shutil
import subprocess
import tempfile
import time

from . import qemu_guest
from .common import binary, die, guest_dir, initrd_with_command, log, timeit_ns
from .stats import BEST, Row

TITLE = "Console output"
DURATION = "14 min"
RUNS = 3
QEMU = qemu_guest.QEMU


def options(ap):
    ap.add_argument("--quick", action="store_true",
                    help="smaller sizes (1 MB blocks, 4000 bytes of lines), one round")


def writer(kind, n, null, terminal=True):
    """The guest command for one measurement: `timeit` around the writer,
    both writing to the command's terminal (`terminal`: insight's standard
    output here is a pipe, which would make the command's one too), else
    to standard output, a pipe."""
    inner = f"head -c {n} /dev/zero" if kind == "blocks" else f"yes | head -c {n}"
    if null:
        inner += " > /dev/null"
    # Standard input is the terminal, opened for reading and writing.
    to = "exec >&0 2>&1; " if terminal else "exec 2>&1; "
    return ["sh", "-c", f"{to}timeit sh -c '{inner}'"]


def measure(argv, kind, expect, what, timeout=1800, console_file=None):
    """Runs argv (standard input closed); returns the guest-timed seconds,
    after checking that it printed `expect` bytes of the writer's
    output. `console_file`: where the guest's console output goes instead
    of argv's standard output; the guest cannot power off, so the run is
    stopped once its `timeit` line is there."""
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
        if console_file is None:
            try:
                stdout, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                die(f"{what} did not end within {timeout} s")
        else:
            p.stdout.close()
            started = time.monotonic()
            while p.poll() is None and time.monotonic() - started < timeout:
                with open(console_file, "rb") as f:
                    if timeit_ns(f.read().decode(errors="replace")) is not None:
                        break
                time.sleep(0.05)
            p.kill()
            with open(console_file, "rb") as f:
                stdout = f.read()
        rc = p.wait()
        err.seek(0)
        errors = err.read().decode(errors="replace")
    out = stdout.decode(errors="replace")
    ns = timeit_ns(out)
    if (rc != 0 and console_file is None) or ns is None:
        die(f"{what} failed ({rc}):\n{errors[-2000:]}\n{out[-500:]}")
    printed = out.count("\0") if kind == "blocks" else out.count("y\n") * 2
    if printed != expect:
        die(f"{what} printed {printed} bytes of its writer's output, not {expect}")
    return ns / 1e9


def run(ctx):
    with tempfile.TemporaryDirectory(prefix="insight-bench-console-", ignore_cleanup_errors=True) as tmp:
        return measure_all(ctx, tmp)


def measure_all(ctx, tmp):
    quick = ctx.args.quick
    runs = 1 if quick else ctx.runs
    # Sizes: about ten seconds each where the setup is slow (the UART's
    # bytes, every setup's lines), the figure for 10 MB elsewhere.
    blocks = 1_000_000 if quick else 10_000_000
    lines = 4000 if quick else 20000
    sizes = {
        "blocks": {"virtio": blocks, "serial": 200_000, "qemu": blocks, "qemu-virtio": blocks},
        "lines": {"virtio": lines, "serial": lines, "qemu": lines, "qemu-virtio": lines},
    }
    guest = guest_dir()
    traces = []

    def fresh_trace():
        traces.append(os.path.join(tmp, f"trace-{len(traces)}"))
        return traces[-1]

    setups = [
        ("insight run, virtio console", "virtio",
         lambda cmd: [binary(), "run", "--no-stdin", "--"] + cmd),
        ("insight record, virtio console", "virtio",
         lambda cmd: [binary(), "record", "--no-stdin", "-o", fresh_trace(), "--"] + cmd),
        ("insight run, serial console", "serial",
         lambda cmd: [binary(), "run", "--no-stdin", "--console", "serial", "--"] + cmd),
        ("insight run, pipe", "virtio",
         lambda cmd: [binary(), "run", "--no-stdin", "--"] + cmd),
    ]
    # The setups whose writer writes to its standard output, a pipe.
    piped = {"insight run, pipe"}
    # QEMU's virtio console drops what its character device cannot take at
    # once (a pipe that is full): its output goes to a file.
    qemu_console = os.path.join(tmp, "qemu-console")
    if shutil.which(QEMU):
        cmdline = qemu_guest.CMDLINE + qemu_guest.QEMU_CMDLINE
        kernel = qemu_guest.guest_kernel(guest, cmdline, os.path.join(tmp, "vmlinux-qemu"))
        initrds = {}

        def initrd(cmd):
            key = " ".join(cmd)
            if key not in initrds:
                d = os.path.join(tmp, f"initrd-{len(initrds)}")
                os.makedirs(d)
                initrds[key] = initrd_with_command(guest, cmd, os.path.join(d, "initrd"))
            return initrds[key]

        def qemu(cmd):
            return qemu_guest.qemu_argv(kernel, initrd(cmd), cmdline, "tcg")

        def qemu_virtio(cmd):
            open(qemu_console, "wb").close()
            return [QEMU, "-M", "microvm,pic=on,pit=on,rtc=on,isa-serial=on,acpi=off",
                    "-accel", "tcg", "-cpu", "max,-apic", "-m", str(qemu_guest.MEMORY_MIB),
                    "-display", "none", "-monitor", "none", "-serial", "null", "-net", "none",
                    "-no-reboot", "-kernel", os.path.join(guest, "bzImage"),
                    "-initrd", initrd(cmd), "-append", cmdline,
                    "-device", "virtio-serial-device",
                    "-chardev", f"file,id=console,path={qemu_console}",
                    "-device", "virtconsole,chardev=console"]

        setups.append(("QEMU TCG, serial", "qemu", qemu))
        setups.append(("QEMU TCG, virtio console", "qemu-virtio", qemu_virtio))
        version = subprocess.run([QEMU, "--version"], capture_output=True, text=True).stdout
        qemu_note = version.splitlines()[0] if version else QEMU
    else:
        qemu_note = f"{QEMU} not found: QEMU's anchor skipped (apt-get install qemu-system-x86)"

    times = {}
    for i in range(runs):
        for kind in ("blocks", "lines"):
            for name, size_key, argv in setups:
                n = sizes[kind][size_key]
                for null in (False, True):
                    what = f"{name}, {kind}{' to /dev/null' if null else ''}"
                    cmd = writer(kind, n, null, terminal=name not in piped)
                    s = measure(argv(cmd), kind, 0 if null else n, what,
                                console_file=qemu_console if size_key == "qemu-virtio" else None)
                    times.setdefault((name, kind, null), []).append(s)
                    log(f"round {i + 1}: {what}: {n} bytes in {s:.2f} s")
                for t in traces:
                    shutil.rmtree(t, ignore_errors=True)

    rows = []
    print(f"Best of {runs}, alternating; guest-timed (`timeit`). {qemu_note}\n")
    print("| writer | setup | bytes | to the console | throughput | to /dev/null | console / null |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("blocks", "lines"):
        for name, size_key, _ in setups:
            n = sizes[kind][size_key]
            console, null = times[(name, kind, False)], times[(name, kind, True)]
            rows.append(Row(f"{kind}, {name}, {n:,} bytes: to /dev/null, to the console", console,
                            null, statistic=BEST))
            rate = n / min(console)
            rate_text = f"{rate / 1e6:.2f} MB/s" if rate >= 1e5 else f"{rate / 1e3:.1f} KB/s"
            print(f"| {kind} | {name} | {n:,} | {min(console):.2f} s | {rate_text} | {min(null):.2f} s "
                  f"| {min(console) / min(null):.2f}x |")
    return rows
