"""What the benchmark tools share: where things are, building insight,
finding the guest image, running insight and the guest, and reading the
guest's timings.

The tools import it from their own directory (Python puts a script's
directory first on sys.path).
"""
import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSIGHT = os.path.join(REPO, "target", "release", "insight")
TOOL = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "bench"
# The command that builds INSIGHT, run in REPO.
BUILD_INSIGHT = ["cargo", "build", "--release", "-q", "-p", "insight"]
# A guest command setting this runs with the probe library.
PRELOAD = "LD_PRELOAD=/usr/lib/libinsight-probes.so"
# The start of the kernel command line insight passes (crates/vmm/src/image.rs),
# for booting the guest image under QEMU.
GUEST_CMDLINE = ("console=ttyS0 noapic nolapic "
                 "clearcpuid=smap,popcnt,ssse3,rdpid,tsc,rdrand,rdseed,erms,fsrm,xsaveopt,xsavec,xsaves "
                 "nofsgsbase noinvpcid mitigations=off lpj=5000 io_delay=none panic=-1")


def die(msg):
    """Stops the tool with `msg`, naming it."""
    sys.exit(f"{TOOL}: {msg}")


def log(msg):
    """Progress, on standard error, naming the tool."""
    print(f"{TOOL}: {msg}", file=sys.stderr, flush=True)


def build_insight():
    """Builds the release binary the tools run (INSIGHT), and makes sure
    the built-in guest's boot snapshot is cached (warm_boot_snapshot)."""
    p = subprocess.run(BUILD_INSIGHT, cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        die(f"cargo build --release -p insight failed:\n{p.stderr}")
    warm_boot_snapshot()


def warm_boot_snapshot():
    """Runs `insight run -- true` once, so that the boot snapshot runs of
    the built-in guest restore is taken before anything is measured (the
    first run of an image boots it and takes the snapshot)."""
    p = subprocess.run([INSIGHT, "run", "--no-stdin", "--", "true"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    if p.returncode != 0:
        die(f"insight run -- true failed ({p.returncode}):\n{p.stderr}")


def cache_dir():
    """The guest image cache, as tools/build-guest chooses it."""
    d = os.environ.get("INSIGHT_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "insight")


def guest_dir():
    """The directory of the guest image insight boots by default (vmlinux,
    bzImage, initramfs.cpio); stops the tool if it has not been built."""
    guest = os.path.join(cache_dir(), "default")
    if not os.path.exists(os.path.join(guest, "vmlinux")):
        die("no guest image: run tools/build-guest")
    return guest


def initrd_with_command(guest, argv, path):
    """The guest's initramfs plus /etc/insight/command = argv (the command
    its /init runs), written to path, beside which it leaves two small
    files; returns path."""
    d = os.path.dirname(path)
    cmdfile = os.path.join(d, "command")
    with open(cmdfile, "wb") as f:
        f.write(b"".join(a.encode() + b"\0" for a in argv))
    lst = os.path.join(d, "list")
    with open(lst, "w") as f:
        f.write(f"file /etc/insight/command {cmdfile} 0644 0 0\n")
    kernel_dir = os.path.dirname(os.path.realpath(os.path.join(guest, "vmlinux")))
    gen = [os.path.join(kernel_dir, "gen_init_cpio"), lst]
    p = subprocess.run(gen, capture_output=True)
    if p.returncode != 0:
        tail = "\n".join(p.stderr.decode(errors="replace").strip().splitlines()[-15:])
        die(f"gen_init_cpio failed (exit status {p.returncode}):\n  {' '.join(gen)}\n{tail}")
    with open(os.path.join(guest, "initramfs.cpio"), "rb") as f:
        base = f.read()
    with open(path, "wb") as f:
        f.write(base + b"\0" * (-len(base) % 4) + p.stdout)
    return path


def file_from_initramfs(guest, name, path):
    """Copies the file `name` (e.g. "usr/bin/ticker") out of the guest's
    initramfs.cpio (newc format, as gen_init_cpio writes it) to path;
    returns path. Stops the tool if the archive has no such file."""
    with open(os.path.join(guest, "initramfs.cpio"), "rb") as f:
        data = f.read()
    at = 0
    while at + 110 <= len(data) and data[at:at + 6] in (b"070701", b"070702"):
        size = int(data[at + 54:at + 62], 16)
        name_len = int(data[at + 94:at + 102], 16)
        entry = data[at + 110:at + 110 + name_len - 1].decode(errors="replace")
        body = at + 110 + name_len
        body += -body % 4
        if entry == "TRAILER!!!":
            break
        if entry.lstrip("/") == name:
            with open(path, "wb") as out:
                out.write(data[body:body + size])
            os.chmod(path, 0o755)
            return path
        at = body + size
        at += -at % 4
    die(f"the guest's initramfs has no {name}")


def load_tool(name):
    """Another benchmark tool (a script in tools/ without .py) as a module."""
    path = os.path.join(REPO, "tools", name)
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def insight(args, check=True):
    """Runs INSIGHT with args, standard input closed; returns the finished
    process (text output) and its wall time in seconds. With check, stops
    the tool if it fails."""
    start = time.monotonic()
    p = subprocess.run([INSIGHT] + args, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    wall = time.monotonic() - start
    if check and p.returncode != 0:
        die(f"insight {' '.join(args)} failed ({p.returncode}):\n{p.stderr}")
    return p, wall


def trace_bytes(trace):
    """The size of a trace's log: its events and payloads files."""
    return sum(os.path.getsize(os.path.join(trace, f)) for f in ("events", "payloads"))


TIMEIT = re.compile(r"timeit: (\d+) ns")


def timeit_ns(text):
    """The nanoseconds the guest's `timeit` printed in `text` (a string or
    a list of lines), or None."""
    if isinstance(text, list):
        text = "\n".join(text)
    m = TIMEIT.search(text)
    return int(m.group(1)) if m else None


def guest_ns(text, what="the guest's output"):
    """timeit_ns(text); stops the tool if there is no timeit line."""
    ns = timeit_ns(text)
    if ns is None:
        if isinstance(text, list):
            text = "\n".join(text)
        die(f"no timeit line in {what}:\n{text[-2000:]}")
    return ns
