"""Profiles of one program by insight, by `perf record -e cpu-clock`
natively and by the guest's own timer ticks (tools/native/tickprof.c),
and their comparison, for tools/bench profile (whose help says how each
is taken and what the comparison checks).
"""
import collections
import math
import os
import re
import shutil
import sqlite3
import subprocess

from .common import (PRELOAD, REPO, binary, die, file_from_initramfs, guest_dir, guest_seconds, log,
                     run as run_command)
from .stats import Row

PERIOD = "1ms"
PERF_PERIOD_NS = 250000
TOP = 3
MAX_DIFF = 10.0


def plural(n, word):
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"


# ---- profiles -------------------------------------------------------------

KERNEL = ("[kernel]", "")  # all kernel samples: one row
PROBES = "libinsight-probes.so"  # the probe library, preloaded in the guest only


class Profile:
    def __init__(self):
        self.counts = collections.Counter()  # (function, object) or KERNEL -> samples
        self.total = 0
        self.note = ""
        self.cost = None                      # insight: (guest s with marks, without, in words)
        self.verbatim = []                    # insight: its own top rows, as it printed them
        self.workers = False

    @property
    def kernel(self):
        return self.counts.get(KERNEL, 0)

    def share(self, key, base):
        """Percent of all samples, or of user-mode samples ("user")."""
        if key == KERNEL or base == "all":
            total = self.total
        else:
            total = self.total - self.kernel
        return 100.0 * self.counts.get(key, 0) / total if total else 0.0

    def ranked(self, base):
        """Its keys, most samples first."""
        return [k for k, _ in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
                if not (base == "user" and k == KERNEL)]


def function_symbols(path, dynamic=False):
    """The function symbols of the ELF file at path (its dynamic ones
    with dynamic), by address: (start, size, name), without symbol
    versions (cfree@GLIBC_2.2.5), as insight names them."""
    argv = ["nm"] + (["-D"] if dynamic else []) + ["-n", "-S", "--defined-only", path]
    syms = []
    for line in subprocess.run(argv, capture_output=True, text=True).stdout.splitlines():
        f = line.split()
        if len(f) == 4 and f[2] in "tTiWw":
            syms.append((int(f[0], 16), int(f[1], 16), f[3].split("@")[0]))
    return syms


def preferred(names):
    """Of several names of one function, the one with the fewest leading
    underscores, then the shortest."""
    return min(names, key=lambda n: (len(n) - len(n.lstrip("_")), len(n), n))


class DebugSymbols:
    """Function symbols of the host's detached debug files (Debian *-dbg
    packages, /usr/lib/debug/.build-id), for the addresses insight's
    symbolizer leaves unnamed: it reads only the guest's (stripped) ELF
    files. The guest carries this host's glibc, so the files are the same."""

    LIBDIRS = ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib"]

    def __init__(self):
        self.tables = {}
        self.aliases = {}

    def table(self, obj):
        if obj in self.tables:
            return self.tables[obj]
        self.tables[obj] = None
        host = next((os.path.join(d, obj) for d in self.LIBDIRS
                     if os.path.exists(os.path.join(d, obj))), None)
        if not host or not shutil.which("readelf") or not shutil.which("nm"):
            return None
        notes = subprocess.run(["readelf", "-n", host], capture_output=True, text=True).stdout
        m = re.search(r"Build ID: ([0-9a-f]+)", notes)
        if not m:
            return None
        debug = f"/usr/lib/debug/.build-id/{m.group(1)[:2]}/{m.group(1)[2:]}.debug"
        if not os.path.exists(debug):
            return None
        self.tables[obj] = (debug, function_symbols(debug))
        return self.tables[obj]

    def name(self, obj, addr):
        t = self.table(obj)
        if not t:
            return None
        best = None
        for start, size, name in t[1]:
            if start > addr:
                break
            if addr < start + size:
                best = name
        return best

    def canonical(self, obj, function):
        """One name for all the aliases of a function of obj (glibc's
        malloc is also __libc_malloc and __GI___libc_malloc, free also
        cfree...; perf and insight do not pick the same one): the one with
        the fewest leading underscores, then the shortest. function itself
        when obj has no debug file or the name is not one address's."""
        if obj not in self.aliases:
            t = self.table(obj) if obj and not obj.startswith("[") else None
            starts, names = collections.defaultdict(set), collections.defaultdict(list)
            for start, _, name in t[1] if t else []:
                starts[name].add(start)
                names[start].append(name)
            self.aliases[obj] = {name: preferred(names[next(iter(at))])
                                 for name, at in starts.items() if len(at) == 1}
        return self.aliases[obj].get(function, function)


DEBUG = DebugSymbols()


def insight_profile(name, work, command, sampled_at, config=None, memory=None, workers=False,
                    comm=None):
    """insight's profile of command; returns it and the recording's
    console output. sampled_at "record": the recording marks its samples
    (record --sample-period), the replay finds them; "replay": the replay
    samples by its own host time."""
    trace = os.path.join(work, f"{name}.trace")
    db = os.path.join(work, f"{name}.db")
    argv = ["record"]
    if config:
        argv.append(config)
    argv += ["--no-stdin", "--summary",
             "--sample-period", PERIOD if sampled_at == "record" else "off"]
    if memory:
        argv += ["--memory", str(memory)]
    argv += ["-o", trace, "--", "env", PRELOAD, "LC_ALL=C"] + command
    log(f"{name}: insight {' '.join(argv)}")
    cost = None
    if sampled_at == "record":
        # What the marks cost the recording: the same command recorded
        # without them just before, compared in guest time (the
        # recording's own clock, boot-snapshot restore left out).
        bare = argv[:]
        bare[bare.index("--sample-period") + 1] = "off"
        bare[bare.index("-o") + 1] = trace + ".bare"
        log(f"{name}: recording without sample marks first, for their cost")
        plain, _ = run_command([binary()] + bare, f"insight record --sample-period off ({name})")
        cost = guest_seconds(plain.stderr, trace + ".bare")
        shutil.rmtree(trace + ".bare", ignore_errors=True)
    rec, wall = run_command([binary()] + argv, f"insight record ({name})")
    if cost is not None:
        marked = guest_seconds(rec.stderr, trace)
        marks = re.search(r"(\d+) sample marks", rec.stderr)
        cost = (marked, cost, f"recording with marks every {PERIOD}: {marked:.2f} s of guest time "
                f"({marks.group(1) if marks else 'no'} marks) against {cost:.2f} s without "
                f"them, **{marked / cost:.3f}x** (one recording each)")
    log(f"{name}: recorded in {wall:.0f} s; replaying (samples taken at the {sampled_at})")
    # One SQL row per event: the thread counts below are SQL queries.
    argv = [binary(), "replay", "--no-console", trace, "--events", db,
            "--events-format", "rows", "--sample-period", PERIOD]
    if sampled_at == "replay":
        argv.append("--replay-time-samples")
    _, wall = run_command(argv, f"insight replay ({name})")
    log(f"{name}: replayed in {wall:.0f} s")
    profile = read_insight_profile(name, db, workers, comm)
    profile.cost = cost
    return profile, rec.stdout


def read_insight_profile(name, db, workers=False, comm=None):
    """What `insight report profile` says about the database db: all
    sampled threads, or (workers) those that are not their process's main
    thread, or (comm) those of processes running the program comm."""
    rep, _ = run_command([binary(), "report", "profile", db, "--limit", "100000", "--threads"],
                     f"insight report profile ({name})")
    p = Profile()
    header = re.search(r"(\d+) samples \((\d+) in the guest kernel"
                       r"(?:, (\d+) of them entering or leaving it)?\)", rep.stdout)
    if not header:
        die(f"no samples in insight's profile of {name}:\n{rep.stdout}")
    # The table of all threads, then "Thread LWPID (pid PID, COMM): N samples"
    # and its table for each thread.
    blocks = rep.stdout.split("\n\n")
    sampled = [(m.groups(), b.split("\n", 1)[1]) for b in blocks[2:]
               if (m := re.match(r"Thread (\d+) \(pid (\d+), (.*)\): \d+ samples\n", b))]
    chosen = [table for (lwpid, pid, command), table in sampled
              if (not workers or lwpid != pid) and (comm is None or command == comm)]
    # Every sampled thread chosen: insight's own table of them all.
    whole = len(chosen) == len(sampled)
    if not chosen:
        die(f"insight sampled no thread of {comm or 'a worker'} in {name}:\n"
            f"{rep.stdout[:3000]}")
    tables = [blocks[1]] if whole else chosen
    others = sorted({command for (_, _, command), _ in sampled} - {comm})
    named_here = collections.Counter()
    for table in tables:
        for line in table.strip("\n").splitlines()[1:]:
            # "  81.23%      1234  hotspot   hot"; the object column may be empty.
            parts = line.split(None, 3)
            if len(parts) == 3:
                parts.insert(2, "")
            share, samples, obj, function = parts
            if whole:
                p.verbatim.append((function, obj, share))
            named = False
            if re.fullmatch(r"0x[0-9a-f]+", function):
                better = DEBUG.name(obj, int(function, 16))
                if better:
                    function, named = better, True
            # Kernel samples are one row, whichever kernel function they name.
            key = KERNEL if obj == "[kernel]" else (DEBUG.canonical(obj, function), obj)
            if named:
                named_here[key] += int(samples)
            p.counts[key] += int(samples)
            p.total += int(samples)
    if whole and (p.total != int(header.group(1)) or p.kernel != int(header.group(2))):
        die(f"insight's table of {name} does not add up to "
                 f"{header.group(1)} samples:\n{rep.stdout}")
    if not whole:
        p.verbatim = [(f, obj, f"{100 * n / p.total:.2f}%")
                      for (f, obj), n in sorted(p.counts.items(), key=lambda kv: -kv[1])]
    p.named_here = named_here
    p.workers = not whole
    c = sqlite3.connect(db)
    threads = c.execute("SELECT count(DISTINCT lwpid), count(DISTINCT pid) FROM events "
                        "WHERE kind = 14").fetchone()
    creates = c.execute("SELECT count(*) FROM events WHERE kind = 9").fetchone()[0]
    c.close()
    p.threads, p.creates = threads[0], creates
    boundary = int(header.group(3) or 0)
    p.note = (f"{p.total} samples, {p.kernel} of them in the guest kernel"
              + (f" ({boundary} entering or leaving it)" if boundary and whole else "")
              + (f", in the {'worker threads' if workers else comm + ' threads'} (of "
                 f"{header.group(1)} samples, {header.group(2)} in the guest kernel, in all "
                 "sampled threads" + ("" if workers else f", also of {', '.join(others)}") + ")"
                 if not whole else "")
              + f"; {plural(threads[0], 'thread')} sampled in {plural(threads[1], 'process')}"
              + f", {plural(creates, 'thread creation')}")
    return p


PERF_LINE = re.compile(r"^\s*(.*?)\s+(\d+)/(\d+)\s+([\d.]+):\s+([0-9a-f]+)\s+(.*?)\s+\((.*)\)\s*$")


def perf_profile(name, work, command, workers=False, comm=None):
    """perf's profile of command: the threads of processes that created
    threads, or (workers) those threads but their processes' main ones, or
    (comm) the threads of processes while they run the program comm."""
    data = os.path.join(work, f"{name}.perf.data")
    argv = ["perf", "record", "-q", "-e", "cpu-clock", "-c", str(PERF_PERIOD_NS),
            "-o", data, "--", "env", "LC_ALL=C"] + command
    log(f"{name}: {' '.join(argv)}")
    rec, _ = run_command(argv, f"perf record ({name})")
    script, _ = run_command(["perf", "script", "-i", data, "-F", "comm,pid,tid,time,ip,sym,dso"],
                        f"perf script ({name})")
    samples = []
    for line in script.stdout.splitlines():
        m = PERF_LINE.match(line)
        if not m:
            die(f"unexpected line in perf script's output: {line!r}")
        command_name, pid, tid, _, _, sym, dso = m.groups()
        kernel = dso.startswith("[kernel") or dso.startswith("[guest.kernel")
        sym = re.sub(r"@@?GLIBC_[0-9.]+$", "", sym)  # insight names no symbol versions
        obj = os.path.basename(dso)
        samples.append((command_name, int(pid), int(tid),
                        KERNEL if kernel else (DEBUG.canonical(obj, sym), obj)))
    # Count a thread as insight would track it: the threads of processes
    # that created threads (a main thread from its first malloc, near its
    # start: from its start here), or the workers alone; or, for a
    # single-threaded program, its process from its start (its exec).
    if comm:
        processes = {pid for c, pid, _, _ in samples if c == comm}
    else:
        processes = {pid for _, pid, tid, _ in samples if tid != pid}
    p = Profile()
    threads, dropped = set(), 0
    for c, pid, tid, key in samples:
        if pid not in processes or (comm and c != comm):
            continue
        if tid == pid and workers:
            dropped += 1
            continue
        threads.add(tid)
        p.counts[key] += 1
        p.total += 1
    if p.total == 0:
        die(f"perf took no samples in "
            f"{comm or 'threads of multi-threaded processes'} for {name} "
            f"({len(samples)} samples in all)")
    p.threads = len(threads)
    p.note = (f"{p.total} of the run's {len(samples)} samples, {p.kernel} of them in the kernel; "
              f"{plural(len(threads), 'thread')} sampled in {plural(len(processes), 'process')}"
              + (f" running {comm}" if comm else
                 f"; {plural(dropped, 'sample')} of main threads left out"))
    return p, rec.stdout


# ---- the guest's own samples ---------------------------------------------

TICKPROF_GUEST = "/usr/local/lib/tickprof.so"
TICKPROF_LINE = re.compile(r"^tickprof (\d+) (\S+) (map|pc|end) (.*)$")


PROBES_GUEST = "/usr/lib/libinsight-probes.so"


def probe_library(work):
    """The guest's probe library, out of its initramfs (the host has no
    copy): the host path, to name its functions by."""
    path = os.path.join(work, PROBES)
    if not os.path.exists(path):
        file_from_initramfs(guest_dir(), PROBES_GUEST.lstrip("/"), path)
    return path


def build_tickprof(work):
    """tools/native/tickprof.c as a shared library: the host path."""
    out = os.path.join(work, "tickprof.so")
    run_command(["gcc", "-O2", "-Wall", "-shared", "-fPIC", "-o", out,
            os.path.join(REPO, "tools", "native", "tickprof.c")], "building tools/native/tickprof.c")
    return out


class ElfFunctions:
    """Function names of host ELF files by the file offsets of their
    code: the guest's processes map the same files (the guest carries this
    host's libraries; the programs are copied in)."""

    def __init__(self):
        self.files = {}

    def load(self, host):
        if host in self.files:
            return self.files[host]
        segments = []
        heads = subprocess.run(["readelf", "-lW", host], capture_output=True, text=True).stdout
        for m in re.finditer(r"^\s*LOAD\s+0x([0-9a-f]+)\s+0x([0-9a-f]+)\s+0x[0-9a-f]+\s+"
                             r"0x([0-9a-f]+)", heads, re.M):
            segments.append(tuple(int(g, 16) for g in m.groups()))
        syms = function_symbols(host)
        if not syms:  # stripped: the host's detached debug file, as for insight's rows
            t = DEBUG.table(os.path.basename(host))
            syms = t[1] if t else []
        if not syms:  # nor that: the dynamic symbols, which insight reads too
            syms = function_symbols(host, dynamic=True)
        self.files[host] = (segments, syms)
        return self.files[host]

    def after_syscall(self, host, offset):
        """Whether the two bytes before file offset of host are a SYSCALL
        instruction (0f 05)."""
        if offset < 2:
            return False
        with open(host, "rb") as f:
            f.seek(offset - 2)
            return f.read(2) == b"\x0f\x05"

    def name(self, host, offset):
        """The function at file offset of host, or its address as insight
        prints an unnamed one."""
        segments, syms = self.load(host)
        addr = next((offset - off + vaddr for off, vaddr, size in segments
                     if off <= offset < off + size), offset)
        names = [n for start, size, n in syms if start <= addr < start + size]
        if not names:
            return f"0x{addr:x}"
        return preferred(names)


ELF = ElfFunctions()


def own_profile(name, config, command, memory, comm, files):
    """The guest's own profile of command's processes running comm: an
    `insight run` (not a recording: a recording delivers a timer tick
    that finds user code between two system calls at the next one, so
    the guest kernel never sees a program that makes them often in user
    mode) with tools/native/tickprof.c preloaded after the probe library.
    files maps guest paths to host ones."""
    argv = [binary(), "run", config, "--no-stdin", "--memory", str(memory), "--",
            "env", f"{PRELOAD}:{TICKPROF_GUEST}", "LC_ALL=C"] + command
    log(f"{name}: the guest's own samples: {' '.join(argv[1:])}")
    p, wall = run_command(argv, f"insight run ({name}, the guest's own samples)")
    if f"{name}-done" not in p.stdout:
        die(f"{name} did not finish in the guest's own run:\n{p.stdout[-3000:]}")
    log(f"{name}: ran in {wall:.0f} s")
    return tick_profile(p.stdout, files, comm)


def tick_profile(console, files, comm):
    """The profile tickprof's lines in console give, of the processes
    running comm, each sample named as insight names its rows. files maps
    guest paths to host ones."""
    maps, counts, lost, ended = collections.defaultdict(list), collections.Counter(), 0, set()
    for line in console.splitlines():
        m = TICKPROF_LINE.match(line.strip())
        if not m or m.group(2) != comm:
            continue
        pid, kind, rest = int(m.group(1)), m.group(3), m.group(4)
        if kind == "map":
            start, end, offset, path = rest.split(" ", 3)
            maps[pid].append((int(start, 16), int(end, 16), int(offset, 16), path))
        elif kind == "pc":
            pc, n = rest.split()
            counts[(pid, int(pc, 16))] += int(n)
        else:
            ended.add(pid)
            lost += int(rest.split()[1])
    p = Profile()
    edge = 0  # samples just after a system call instruction
    for (pid, pc), n in counts.items():
        where = next((m for m in maps[pid] if m[0] <= pc < m[1]), None)
        if where is None:
            key = (f"0x{pc:x}", "[unmapped]")
        else:
            start, _, offset, path = where
            host, at = files.get(path, path), pc - start + offset
            obj = os.path.basename(path)
            if os.path.exists(host) and ELF.after_syscall(host, at):
                edge += n
                continue
            function = ELF.name(host, at) if os.path.exists(host) else f"0x{at:x}"
            key = (DEBUG.canonical(obj, function), obj)
        p.counts[key] += n
        p.total += n
    if not p.total:
        die(f"no tick samples of {comm} in user code in the guest's console "
            f"output ({edge} after system calls)")
    p.note = (f"{p.total} samples in {plural(len(ended), 'process')} running {comm}, one for "
              "each guest timer tick (100 Hz) that found them in user mode "
              "(tools/native/tickprof.c preloaded: SIGVTALRM every 10 ms of user time); "
              f"{edge} more just after a system call instruction, not counted (ticks that "
              "fell due while the guest kernel had interrupts off in the call, taken as it "
              "returned)"
              + (f"; {lost} over its buffer, not counted" if lost else ""))
    return p


# ---- comparison -----------------------------------------------------------

def compare(title, ins, prf, rows, workload=None, own=None):
    """Prints the table, after the workload's description (Markdown) if
    given; returns whether the check passed (user-mode shares). own: the
    guest's own tick samples (own_profile), a third column."""
    top_i, top_p = ins.ranked("user")[:TOP], prf.ranked("user")[:TOP]
    all_i, all_p = ins.ranked("all")[:TOP], prf.ranked("all")[:TOP]
    keys = list(prf.ranked("user")[:rows])
    keys += [k for k in ins.ranked("user")[:rows] if k not in keys]
    if own:
        keys += [k for k in own.ranked("user")[:rows] if k not in keys]
    keys.append(KERNEL)

    def names(ks):
        return ", ".join(f for f, _ in ks)
    print(f"### {title}\n")
    if workload:
        print(f"{workload}\n")
    print(f"- insight: {ins.note}")
    if ins.cost:
        print(f"- insight, {ins.cost[2]}")
    print(f"- perf: {prf.note}")
    if ins.named_here:
        named = ins.named_here.most_common()
        print("- insight printed " + ", ".join(f"{n} samples in `{f}`" for (f, _), n in named[:4]) +
              (f" (and {len(named) - 4} more functions)" if len(named) > 4 else "") +
              " as bare addresses, one row per address (the guest's libc is stripped); named "
              "here (marked *) with the host's detached debug symbols")
    if own:
        print(f"- the guest's own: {own.note}")
    print("\n| function | object | insight, all | perf, all | insight, user | perf, user "
          "| difference, user |" + (" guest's own, user | insight - own |" if own else ""))
    print("|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if own else ""))
    worst = 0.0
    for key in keys:
        f, obj = key
        mark = "*" if key in ins.named_here else ""
        a, b = ins.share(key, "all"), prf.share(key, "all")
        if key == KERNEL:
            print(f"| `{f}` | | {a:.1f} % | {b:.1f} % | | | |" + (" | |" if own else ""))
            continue
        c, d = ins.share(key, "user"), prf.share(key, "user")
        line = (f"| `{f}`{mark} | {obj} | {a:.1f} % | {b:.1f} % | {c:.1f} % | {d:.1f} % "
                f"| {c - d:+.1f} pp |")
        if own:
            e = own.share(key, "user")
            line += f" {e:.1f} % | {c - e:+.1f} pp |"
        print(line)
        if key in top_p:
            worst = max(worst, abs(c - d))
    same = set(top_i) == set(top_p)
    ok = same and worst <= MAX_DIFF
    print()
    print(f"Top {TOP} of user-mode samples: insight {names(top_i)}; perf {names(top_p)}: "
          f"{'same functions' if same else 'DIFFERENT functions'}; largest difference "
          f"{worst:.1f} pp (limit {MAX_DIFF:.0f} pp): **{'PASS' if ok else 'FAIL'}**  ")
    print(f"Top {TOP} of all samples: insight {names(all_i)}; perf {names(all_p)}  ")
    if own:
        top_o = own.ranked("user")[:TOP]
        gap = {k: abs(ins.share(k, "user") - own.share(k, "user")) for k in top_o}
        native = max(abs(prf.share(k, "user") - own.share(k, "user")) for k in top_o)
        far = max(top_o, key=lambda k: gap[k])
        same_o = "same functions as insight" if set(top_o) == set(top_i) else "NOT insight's"
        # One standard deviation of the difference of two shares, each
        # measured from its own samples (binomial).
        var = sum((x.share(far, "user") / 100) * (1 - x.share(far, "user") / 100) / n
                  for x, n in ((own, own.total), (ins, ins.total - ins.kernel)) if n)
        print(f"Against the guest's own samples (top {TOP}: {names(top_o)}; "
              f"{same_o}):"
              f" largest difference {gap[far]:.1f} pp (`{far[0]}`; both sides' sampling noise "
              f"there ±{100.0 * math.sqrt(var):.1f} pp, one standard deviation); perf's native "
              f"run differs from them by up to {native:.1f} pp  ")
    # The probe library runs in the guest only: the same comparison without it.
    user = ins.total - ins.kernel
    probes = sum(n for (_, obj), n in ins.counts.items() if obj == PROBES)
    if probes and user > probes and probes >= user / 100:
        top_o = [k for k in ins.ranked("user") if k[1] != PROBES][:TOP]
        worst_o = max((abs(100.0 * ins.counts.get(k, 0) / (user - probes) - prf.share(k, "user"))
                       for k in top_p), default=0.0)
        print(f"Without {PROBES} ({probes} of insight's {user} user-mode samples, "
              f"{100.0 * probes / user:.1f} %; the native runs do not load it): top {TOP} of "
              f"insight's other user-mode samples {names(top_o)}: "
              f"{'same functions' if set(top_o) == set(top_p) else 'DIFFERENT functions'}; "
              f"largest difference {worst_o:.1f} pp")
    print()
    print(("insight's first rows, summed over its per-thread tables of these threads: "
           if ins.workers else "insight's first rows as `insight report profile` printed them: ")
          + "; ".join(
        f"{share} {f}" for f, _, share in ins.verbatim[:rows + 2]) + "\n", flush=True)
    return ok


def rows(title, ins, prf):
    """The comparison's rows: perf's top functions (user-mode shares,
    perf's against insight's), the largest difference among them, and
    what the sample marks cost the recording."""
    top = prf.ranked("user")[:TOP]
    out = [Row.computed(f"{title}: `{f}` ({obj}), share of user-mode samples: perf, insight",
                        ins.share((f, obj), "user"), prf.share((f, obj), "user"), unit="%")
           for f, obj in top]
    out.append(Row.computed(f"{title}: largest difference of perf's top {TOP} (limit "
                            f"{MAX_DIFF:.0f} pp)",
                            max(abs(ins.share(k, "user") - prf.share(k, "user")) for k in top),
                            unit="pp"))
    if ins.cost:
        marked, bare, _ = ins.cost
        out.append(Row.computed(f"{title}: recording (guest time): sample marks off, every {PERIOD}",
                                marked, bare))
    return out
