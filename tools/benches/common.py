"""What the benchmarks share: where things are, building and running
insight and the guest, the Debian packages they need, and reading the
guest's timings.

The insight binary they run is the harness's choice (`use_binary`): this
checkout's release build, or each revision's in `tools/bench compare`.
"""
import os
import platform
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A guest command setting this runs with the probe library.
PRELOAD = "LD_PRELOAD=/usr/lib/libinsight-probes.so"
# The start of the kernel command line insight passes (crates/vmm/src/image.rs),
# for booting the guest image under QEMU.
GUEST_CMDLINE = ("console=ttyS0 noapic nolapic "
                 "clearcpuid=smap,popcnt,ssse3,rdpid,tsc,rdrand,rdseed,erms,fsrm,xsaveopt,xsavec,xsaves "
                 "nofsgsbase noinvpcid mitigations=off lpj=5000 io_delay=none panic=-1")

_binary = os.path.join(REPO, "target", "release", "insight")
_name = None


class BenchError(Exception):
    """A benchmark could not be measured; the message says why."""


def use_binary(path):
    """Makes `path` the insight binary the benchmarks run."""
    global _binary
    _binary = path


def binary():
    """The insight binary the benchmarks run."""
    return _binary


def set_name(name):
    """Names the benchmark running (None: none), for log lines; returns
    the name before."""
    global _name
    before, _name = _name, name
    return before


def die(msg):
    """Stops the benchmark with msg."""
    raise BenchError(msg)


def log(msg):
    """Progress, on standard error, naming the benchmark."""
    print(f"bench {_name}: {msg}" if _name else f"bench: {msg}", file=sys.stderr, flush=True)


def build_insight(repo=REPO, target_dir=None):
    """Builds insight in release mode from `repo` (into target_dir, else
    its own target/); returns the binary's path."""
    env = dict(os.environ)
    if target_dir:
        env["CARGO_TARGET_DIR"] = target_dir
    p = subprocess.run(["cargo", "build", "--release", "-q", "-p", "insight"], cwd=repo, env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if p.returncode != 0:
        die(f"cargo build --release -p insight in {repo} failed:\n{p.stderr[-3000:]}")
    return os.path.join(target_dir or os.path.join(repo, "target"), "release", "insight")


def warm_boot_snapshot():
    """Runs `insight run -- true` once, so that the boot snapshot runs of
    the built-in guest restore is taken before anything is measured (the
    first run of an image boots it and takes the snapshot)."""
    p = subprocess.run([binary(), "run", "--no-stdin", "--", "true"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    if p.returncode != 0:
        die(f"insight run -- true failed ({p.returncode}):\n{p.stderr}")


def need(commands):
    """Makes sure every command of {command: Debian package} is there:
    installs the missing packages with apt-get when running as root,
    else stops naming them."""
    missing = sorted({pkg for cmd, pkg in commands.items() if not shutil.which(cmd)})
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        die(f"needs {', '.join(missing)}: apt-get install {' '.join(missing)}")
    log(f"installing {', '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends"] + missing
    for argv in (install, ["apt-get", "update", "-q"], install):
        subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True)
        if all(shutil.which(cmd) for cmd in commands):
            return
    die(f"{' '.join(install)} failed")


def cache_dir():
    """The guest image cache, as tools/build-guest chooses it."""
    d = os.environ.get("INSIGHT_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "insight")


def guest_dir():
    """The directory of the guest image insight boots by default (vmlinux,
    bzImage, initramfs.cpio); stops the benchmark if it has not been built."""
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
    return initrd_with_archive(guest, lst, path)


def initrd_with_archive(guest, listing, path):
    """The guest's initramfs plus the cpio archive gen_init_cpio makes of
    the list file `listing`, written to path; returns path."""
    kernel_dir = os.path.dirname(os.path.realpath(os.path.join(guest, "vmlinux")))
    gen = [os.path.join(kernel_dir, "gen_init_cpio"), listing]
    p = subprocess.run(gen, capture_output=True)
    if p.returncode != 0:
        tail = "\n".join(p.stderr.decode(errors="replace").strip().splitlines()[-15:])
        die(f"gen_init_cpio failed (exit status {p.returncode}):\n  {' '.join(gen)}\n{tail}")
    with open(os.path.join(guest, "initramfs.cpio"), "rb") as f:
        base = f.read()
    with open(path, "wb") as f:
        f.write(base + b"\0" * (-len(base) % 4) + p.stdout)
    return path


def initramfs_entries(guest):
    """(name, contents) of every file of the guest's initramfs.cpio (newc
    format, as gen_init_cpio writes it), in order."""
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
            return
        yield entry.lstrip("/"), data[body:body + size]
        at = body + size
        at += -at % 4


def file_from_initramfs(guest, name, path):
    """Copies the file `name` (e.g. "usr/bin/ticker") out of the guest's
    initramfs to path; returns path. Stops the benchmark if the archive
    has no such file."""
    for entry, contents in initramfs_entries(guest):
        if entry == name:
            with open(path, "wb") as out:
                out.write(contents)
            os.chmod(path, 0o755)
            return path
    die(f"the guest's initramfs has no {name}")


def run(argv, what=None, ok=(0,), **kw):
    """Runs argv, standard input closed unless input is given; returns the
    finished process (text output) and its wall time in seconds. An exit
    status not in ok stops the benchmark, naming the command and the tail
    of its output."""
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    start = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, **kw)
    wall = time.monotonic() - start
    if ok is not None and p.returncode not in ok:
        tail = "\n".join((p.stderr or p.stdout).splitlines()[-40:])
        die(f"{what or argv[0]} failed (exit {p.returncode}):\n  command: {' '.join(argv)}\n{tail}")
    return p, wall


def insight(args, check=True):
    """Runs insight with args, standard input closed; returns the finished
    process (text output) and its wall time in seconds. With check, stops
    the benchmark if it fails."""
    return run([binary()] + args, f"insight {' '.join(args)}", ok=(0,) if check else None)


def matched(stderr, what):
    """Stops the benchmark unless a replay's stderr says it matched."""
    if "replay matched the recording" not in stderr:
        die(f"{what} did not match the recording:\n{stderr[-3000:]}")


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
    """timeit_ns(text); stops the benchmark if there is no timeit line."""
    ns = timeit_ns(text)
    if ns is None:
        if isinstance(text, list):
            text = "\n".join(text)
        die(f"no timeit line in {what}:\n{text[-2000:]}")
    return ns


def guest_seconds(stderr, trace):
    """The guest time `insight record --summary` says it recorded, from
    the boot snapshot the recording started at (`insight dump --header`)."""
    m = re.search(r"([\d.]+) s of guest time", stderr)
    if not m:
        die(f"no guest time in insight record's output:\n{stderr[-1500:]}")
    dump, _ = insight(["dump", "--header", trace])
    start = re.search(r"taken at guest time ([\d.]+) s", dump.stdout)
    return float(m.group(1)) - (float(start.group(1)) if start else 0.0)


def host_description():
    """CPUs, CPU model, kernel and KVM of this host, in one line."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "?")
    except OSError:
        pass
    kvm = "kvm_pvm (nested, guest ring 0 interpreted)" if os.path.exists("/sys/module/kvm_pvm") \
        else "kvm"
    return f"{os.cpu_count()} CPUs, {cpu}; Linux {platform.release()}; {kvm}"


def describe(repo=REPO, rev="HEAD"):
    """A revision of repo as `git describe --always` (with -dirty for a
    work tree's HEAD that has changes), or "?"."""
    argv = ["git", "-C", repo, "describe", "--always"] + (["--dirty"] if rev == "HEAD" else [rev])
    p = subprocess.run(argv, capture_output=True, text=True)
    return p.stdout.strip() or "?"
