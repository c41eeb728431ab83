"""insight's sampling profiler against `perf record -e cpu-clock`, side by side.

The same binaries are profiled twice: in the insight guest (`insight record
--sample-period 1ms` with the probe library preloaded, `insight replay`,
`insight report profile`; --sampled-at replay samples by the replay's host
time instead, as insight did before recordings marked their samples), and
natively on this host under
`perf record -e cpu-clock -c 250000` (a sample every 250 us of CPU time, so
that the reference's own sampling noise stays small). For each function the
share of the samples of the compared threads is printed for both.

Workloads (--workloads, default all of them):
  * hotspot (images/workloads/hotspot.c, built here with -O2 -g
    -fno-omit-frame-pointer, the flags of docs/profiler-comparison.md):
    one worker thread spending about 80/14/6 % of its time in
    hot()/warm()/cool(). The check: the same top 3 functions, each share
    within 10 percentage points (pp) of perf's. Exit status 1 if it fails.
  * sort, awk, sed: the three programs of the InSight paper's Table 4,
    built here from Debian bookworm's upstream sources with -O2 -g
    -fno-omit-frame-pointer (Debian's binaries are stripped): GNU sort
    (coreutils 9.1) sorting generated text with --parallel=2, --sort-runs
    times in a row; gawk 5.2.1 running a field-processing program (sums
    per key in associative arrays, a per-field loop, a regex match,
    printf) over generated records, --awk-runs times; GNU sed 4.9 running
    three regex substitutions (one with a back-reference; the matching is
    glibc's regex code) over the same records, --sed-runs times. The same
    check is printed for each, but does not set the exit status.

For sort, awk and sed a third column gives the guest's own profile, a
view from inside the guest: the same command in an unrecorded `insight
run`, --own-repeat times as many runs, with tools/native/tickprof.c
preloaded, which has the guest kernel send it SIGVTALRM every 10 ms of
user time and notes the instruction each signal interrupted (one sample
a guest timer tick that finds the process in user mode, 100 a second).
It shows how the guest's run itself differs from the native one, which
perf measures. Its own bias, stated with it: a tick that falls due while
the interpreted guest kernel runs with interrupts off is taken when the
kernel returns to user mode, so it is charged to the instruction the
kernel returns to, after a system call (those samples are left out and
counted) or at an instruction that faulted (allocators touching new
pages: `_int_malloc`, gawk's `more_blocks`). Not in the recorded run: a
recording delivers a pending tick at the next exit, within 2 ms, and for
a program that makes system calls that often that is always one, so its
guest kernel sees it in user mode at no tick at all.

Shares are given of all samples and of user-mode samples. The check uses
user-mode shares: the guest kernel is interpreted on hosts without
hardware-assisted ring 0 (about 1-2 MIPS), so its share of the guest's time
says nothing about the profiler; [kernel] is one row on both sides. The
guest runs the programs with the probe library preloaded, and perf's
native runs do not: insight's rows in libinsight-probes.so are that
library's own time (its heap events, two per malloc or free, weigh in
programs that allocate as often as sed's regex matcher). When they hold
1 % or more of insight's user-mode samples, a line after the check
compares the other user-mode samples alone.

Which threads: insight samples only threads that raised a probe event (a
worker from its start; a main thread from its first probe event: its first
malloc, near its start). For hotspot both sides count the worker thread
only (its main thread only waits, then exits). For sort the perf samples
are filtered to match insight's: the threads of processes that created
threads, main threads included from their start. gawk and sed are
single-threaded: both sides count the processes running them (insight's
threads of that name; perf's samples of that command name, from the
program's start).

Names: the guest's libc is the host's, stripped; insight names its internal
functions (memcmp's AVX2 variant, the regex matcher's...) from the host's
detached debug file (Debian: libc6-dbg) by build ID. Where insight still
prints a bare address, the script names it with the host's debug symbols
and marks it with *. A row is a function of an object (the probe
library's malloc is not libc's); a function with several names at one
address (malloc, __libc_malloc, __GI___libc_malloc; memcpy's and
memmove's variants) is named alike on both sides, by the name with the
fewest leading underscores, then the shortest.

Usage: tools/bench profile [--workloads hotspot,sort,awk,sed] [--rounds N]
         [--size MB] [--sort-runs N] [--awk-runs N] [--awk-buffer BYTES|exact]
         [--sed-runs N] [--own-repeat K]
         [--sampled-at record|replay] [--keep]
Needs a built guest (tools/build-guest), perf (Debian: linux-perf), gcc,
make, perl and xz. Downloads the coreutils,
gawk and sed sources once from Debian's archive (SHA-256 checked, as the
packages' .dsc files give them; about 10 MB in all) and caches them and the
built programs in $INSIGHT_CACHE_DIR/bench (default ~/.cache/insight/bench);
building them takes a few minutes the first time. Then takes about 11
minutes: hotspot about 15 s, sort about 5 minutes, awk about 3, sed
about 2 (with --sampled-at record each workload is also recorded
without sample marks, for what they cost the recording; the guest's own
samples take an unrecorded run of --own-repeat times the runs: sort's
2.5 minutes, awk's 1.5, sed's 45 s at the default). Progress goes
to stderr; the tables, in Markdown for docs/profiler-comparison.md, to
stdout. Status (tools/bench's exit status): 0 when hotspot's
comparison passed its check (or hotspot was not run), 1 when it failed it,
2 when something could not be measured (the other workloads are still
measured and printed).
"""
import argparse
import hashlib
import os
import random
import re
import shutil
import tempfile
import urllib.request

from . import profiles
from .common import REPO, BenchError, cache_dir, die, log, need, run as run_command
from .harness import Report
from .profiles import (PROBES_GUEST, TICKPROF_GUEST, TOP, build_tickprof, compare, insight_profile,
                       own_profile, perf_profile, probe_library)

TITLE = "Profiles: perf"
DURATION = "11 min"
RUNS = 1

BENCH = os.path.join(cache_dir(), "bench")
CFLAGS = "-O2 -g -fno-omit-frame-pointer"
GUEST_TEXT = "/root/words.txt"


# ---- binaries -------------------------------------------------------------

def build_hotspot(work):
    out = os.path.join(work, "hotspot")
    run_command(["gcc"] + CFLAGS.split() + ["-pthread", "-I", os.path.join(REPO, "probes"),
            os.path.join(REPO, "images", "workloads", "hotspot.c"), "-o", out], "compiling hotspot")
    return out


class Source:
    """A program built from a Debian bookworm upstream tarball (SHA-256 as
    the package's .dsc gives it) with CFLAGS: configure's arguments, the
    make runs that build the program (after the generated headers), its
    path in the source tree, and the name it is cached under."""

    def __init__(self, package, version, sha256, configure, makes, program, cached, env=None):
        self.package, self.version, self.sha256 = package, version, sha256
        self.url = (f"http://deb.debian.org/debian/pool/main/{package[0]}/{package}/"
                    f"{package}_{version}.orig.tar.xz")
        self.configure, self.makes, self.program = configure, makes, program
        self.cached, self.env = cached, env or {}


# Debian bookworm's coreutils (9.1-1), gawk (5.2.1-2) and sed (4.9-1+deb12u1).
SORT = Source("coreutils", "9.1",
              "61a1f410d78ba7e7f37a5a4f50e6d1320aca33375484a3255eddf17a38580423",
              ["--disable-nls", "--without-selinux", "--disable-acl", "--disable-xattr",
               "--without-gmp", "--without-openssl", "--disable-libcap"],
              [["src/sort"]], "src/sort", "sort", env={"FORCE_UNSAFE_CONFIGURE": "1"})
GAWK = Source("gawk", "5.2.1",
              "2337a0283b180ec1b9c727973a34781c6478b3ae9bcbdcca0a4dc49861d75a65",
              ["--disable-nls", "--disable-extensions", "--disable-pma", "--disable-mpfr",
               "--without-readline", "--without-libsigsegv-prefix"],
              [["-C", "support"], ["gawk"]], "gawk", "gawk")
SED = Source("sed", "4.9",
             "6e226b732e1cd739464ad6862bd1a1aba42d7982922da7a53519631d24975181",
             ["--disable-nls", "--without-selinux", "--disable-acl"],
             [["sed/sed"]], "sed/sed", "sed")
# What the guest image carries of the host's libraries (tools/build-guest).
GUEST_LIBS = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
              "libgcc_s.so.1"}


def fetch(src):
    """src's tarball, downloaded once into BENCH and checked."""
    tarball = os.path.join(BENCH, os.path.basename(src.url))
    if os.path.exists(tarball):
        with open(tarball, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() == src.sha256:
                return tarball
    log(f"downloading {src.url}")
    try:
        with urllib.request.urlopen(src.url, timeout=120) as r:
            data = r.read()
    except OSError as e:
        die(f"cannot download {src.url}: {e}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != src.sha256:
        die(f"{src.url} has SHA-256 {digest}, expected {src.sha256}")
    with open(tarball + ".part", "wb") as f:
        f.write(data)
    os.replace(tarball + ".part", tarball)
    return tarball


def build(src):
    """src's program with symbols and frame pointers, cached in BENCH by
    version, flags, gcc and how it is configured and made
    (NAME-VERSION-KEY)."""
    gcc = run_command(["gcc", "-dumpfullversion"])[0].stdout.strip()
    how = f"{src.version} {CFLAGS} gcc {gcc} {src.configure} {src.makes} {sorted(src.env.items())}"
    key = hashlib.sha256(how.encode()).hexdigest()[:12]
    out = os.path.join(BENCH, f"{src.cached}-{src.version}-{key}")
    if os.path.exists(out):
        return out
    for tool in ("gcc", "make", "xz", "perl"):
        if not shutil.which(tool):
            die(f"building {src.package} needs {tool} (Debian: apt-get install "
                "build-essential xz-utils perl)")
    tarball = fetch(src)
    work = tempfile.mkdtemp(prefix=f"tmp-{src.package}-", dir=BENCH)
    try:
        log(f"building {src.program} of {src.package} {src.version} with {CFLAGS} "
            "(once; a few minutes)")
        run_command(["tar", "-C", work, "-xf", tarball], f"unpacking {src.package}")
        tree = os.path.join(work, f"{src.package}-{src.version}")
        env = dict(os.environ, LC_ALL="C", **src.env)
        run_command(["./configure", "--quiet"] + src.configure + [f"CFLAGS={CFLAGS}"],
                f"{src.package} configure", cwd=tree, env=env)
        # Only the program and what it needs: first the generated headers
        # (BUILT_SOURCES, which `make all` would make first), then the
        # program, so that no documentation is rebuilt.
        jobs = f"-j{os.cpu_count() or 1}"
        built, _ = run_command(["make", "-s", "--no-print-directory", "-f", "Makefile", "-f", "-",
                           "print-built-sources"], f"listing {src.package}'s BUILT_SOURCES",
                          cwd=tree, env=env, input="print-built-sources:\n\t@echo $(BUILT_SOURCES)\n")
        if built.stdout.split():
            run_command(["make", jobs] + built.stdout.split(), f"make BUILT_SOURCES ({src.package})",
                    cwd=tree, env=env)
        for argv in src.makes:
            run_command(["make", jobs] + argv, f"make {' '.join(argv)} ({src.package})", cwd=tree, env=env)
        program = os.path.join(tree, src.program)
        dynamic, _ = run_command(["readelf", "-d", program], f"readelf -d {src.program}")
        needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", dynamic.stdout))
        if needed - GUEST_LIBS:
            die(f"{src.program} of {src.package} needs "
                f"{', '.join(sorted(needed - GUEST_LIBS))}, which the guest does not carry")
        shutil.copy2(program, out + ".part")
        os.replace(out + ".part", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def vocabulary(rng, words, longest):
    """Up to `words` random lowercase words of 2 to `longest` letters, in
    random order, with cumulative Zipf weights (the i-th word 1/i)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = sorted({"".join(rng.choice(letters) for _ in range(rng.randint(2, longest)))
                    for _ in range(words)})
    rng.shuffle(vocab)
    cum, acc = [], 0.0
    for i in range(len(vocab)):
        acc += 1.0 / (i + 1)
        cum.append(acc)
    return vocab, cum


def write_lines(path, megabytes, line):
    """Writes line() until the file holds megabytes MB; returns the lines."""
    target = int(megabytes * 1e6)
    size, lines, chunk = 0, 0, []
    with open(path, "w") as f:
        while size < target:
            text = line()
            chunk.append(text)
            size += len(text)
            lines += 1
        f.write("".join(chunk))
    return lines


def make_text(path, megabytes, seed=1):
    """Deterministic text for sort: lines of 1-6 words from a Zipf-like
    vocabulary."""
    rng = random.Random(seed)
    vocab, cum = vocabulary(rng, 20000, 12)
    return write_lines(path, megabytes, lambda: " ".join(
        rng.choices(vocab, cum_weights=cum, k=rng.randint(1, 6))) + "\n")


def make_records(path, megabytes, seed=2):
    """Deterministic records for awk and sed: a key (one of 300 words), a
    number (1-99999) and 2-6 words of a Zipf-like vocabulary, 30 % of them
    followed by a digit."""
    rng = random.Random(seed)
    vocab, cum = vocabulary(rng, 5000, 10)
    keys = vocab[:300]

    def line():
        words = [w + str(rng.randint(0, 9)) if rng.random() < 0.3 else w
                 for w in rng.choices(vocab, cum_weights=cum, k=rng.randint(2, 6))]
        return f"{rng.choice(keys)} {rng.randint(1, 99999)} {' '.join(words)}\n"
    return write_lines(path, megabytes, line)


WORKLOADS = ("hotspot", "sort", "awk", "sed")
GUEST_BIN = "/usr/local/bin"
GUEST_RECORDS = "/root/records.txt"
# gawk's r_interpret is the paper's top awk function: a per-record
# program, its per-field loop, associative arrays, a regex and printf.
AWK_PROGRAM = r"""{
    total[$1] += $2; count[$1]++
    for (i = 3; i <= NF; i++) {
        w = $i
        if (w ~ /[0-9]$/) { digits++; w = substr(w, 1, length(w) - 1) }
        seen[w]++
        letters += length(w)
    }
}
$3 ~ /^[b-m][a-z]*[aeiou]$/ { printf "%s %05d %s\n", toupper($1), $2 % 1000, substr($3, 1, 3) }
END {
    for (k in total) printf "%s %d %.2f\n", k, count[k], total[k] / count[k]
    printf "%d words, %d with a digit, %d letters\n", length(seen), digits, letters
}
"""
# Substitutions, one with a back-reference in its regex: glibc's regex
# matcher (re_search_internal and its helpers), the paper's top sed function.
SED_SCRIPT = r"""s/[aeiou][a-z]*[0-9]/X/g
s/^\([a-z]*\) \([0-9]*\)/\2 \1/
s/\([a-z]\)\1/<\1\1>/g
"""


def guest_and_host(name, work, files, body, runs, memory, program, own_runs, sampled_at, comm=None):
    """Profiles `sh -c` running body runs times in a row, in the guest and
    natively; returns insight's profile, perf's (both of the threads comm
    chooses: see insight_profile), and the guest's own of the processes
    running program (tools/native/tickprof.c's samples in an unrecorded
    `insight run` of body own_runs times; see own_profile). files maps a
    name to a host path and a guest path: the guest gets the host file
    there through a [[files]] config; body names the file as {name}, and
    both sides run it from their own path."""
    files = dict(files, tickprof=(build_tickprof(work), TICKPROF_GUEST))
    config = os.path.join(work, f"{name}.toml")
    with open(config, "w") as f:
        f.write("\n".join(f'[[files]]\nhost = "{host}"\nguest = "{guest}"\n'
                          for host, guest in files.values()))
    loop = "i=0; while [ $i -lt {n} ]; do {body} || exit 1; i=$((i+1)); done; echo {name}-done"

    def script(side, n=runs):
        return loop.format(n=n, name=name,
                           body=body.format(**{k: paths[side] for k, paths in files.items()}))
    ins, out = insight_profile(name, work, ["sh", "-c", script(1)], sampled_at, config=config,
                               memory=memory, comm=comm)
    if f"{name}-done" not in out:
        die(f"{name} did not finish in the guest:\n{out}")
    names = {guest: host for host, guest in files.values()}
    names[PROBES_GUEST] = probe_library(work)
    own = own_profile(name, config, ["sh", "-c", script(1, own_runs)], memory, program, names)
    prf, _ = perf_profile(name, work, ["sh", "-c", script(0)], comm=comm)
    return ins, prf, own


def copy(program, work, name):
    """binary, named name in work and in the guest: both sides' object
    names are the same. Returns the host path and the guest path."""
    path = os.path.join(work, name)
    shutil.copy2(program, path)
    return path, f"{GUEST_BIN}/{name}"


def profile_hotspot(args, work):
    """Returns whether the check passed, and the rows."""
    hotspot = build_hotspot(work)
    ins, out = insight_profile("hotspot", work, ["hotspot", str(args.rounds)], args.sampled_at,
                               workers=True)
    if f"hotspot: {args.rounds} rounds" not in out:
        die(f"hotspot did not finish in the guest:\n{out}")
    prf, _ = perf_profile("hotspot", work, [hotspot, str(args.rounds)], workers=True)
    title = f"hotspot {args.rounds}, worker thread"
    return compare(title, ins, prf, TOP), profiles.rows(title, ins, prf)


def profile_sort(args, work):
    sort = build(SORT)
    text = os.path.join(work, "words.txt")
    lines = make_text(text, args.size)
    log(f"sort: {lines} lines, {os.path.getsize(text)} bytes of text")
    ins, prf, own = guest_and_host(
        "sort", work, {"sort": copy(sort, work, "gnu-sort"), "text": (text, GUEST_TEXT)},
        "{sort} --parallel=2 -o /dev/null {text}", args.sort_runs, args.memory, "gnu-sort",
        args.sort_runs * args.own_repeat, args.sampled_at)
    if ins.creates < args.sort_runs or prf.threads < 2 * args.sort_runs:
        die(f"sort did not start a second thread in each run ({lines} lines; "
            f"it needs 131072 or more): insight saw {ins.creates} thread creations, perf "
            f"sampled {prf.threads} threads in multi-threaded processes")
    title = (f"GNU sort {SORT.version} --parallel=2, {args.sort_runs} runs over "
             f"{os.path.getsize(text) / 1e6:.1f} MB ({lines} lines)")
    compare(title, ins, prf, args.rows, own=own)
    return profiles.rows("GNU sort", ins, prf)


RECORDS = {}  # work directory -> records_file's answer


def records_file(args, work):
    """The records awk and sed read, made once per work directory: their
    path and their description."""
    if work not in RECORDS:
        records = os.path.join(work, "records.txt")
        lines = make_records(records, args.size)
        log(f"awk, sed: {lines} lines, {os.path.getsize(records)} bytes of records")
        with open(records) as f:
            sample = "; ".join(f"`{f.readline().strip()}`" for _ in range(2))
        RECORDS[work] = (records, f"{os.path.getsize(records) / 1e6:.1f} MB ({lines} lines)",
                         sample)
    return RECORDS[work]


def profile_program(args, work, workload):
    """gawk (awk) or GNU sed (sed) running its program over the records."""
    src, name, source, runs = {
        "awk": (GAWK, "gawk", AWK_PROGRAM, args.awk_runs),
        "sed": (SED, "gnu-sed", SED_SCRIPT, args.sed_runs)}[workload]
    built = build(src)
    records, size, sample = records_file(args, work)
    program = os.path.join(work, f"program.{workload}")
    with open(program, "w") as f:
        f.write(source)
    env = f"AWKBUFSIZE={args.awk_buffer} " if workload == "awk" and args.awk_buffer else ""
    ins, prf, own = guest_and_host(
        workload, work, {"bin": copy(built, work, name),
                         "program": (program, f"/root/program.{workload}"),
                         "records": (records, GUEST_RECORDS)},
        env + "{bin} -f {program} {records} > /dev/null", runs, args.memory, name,
        runs * args.own_repeat, args.sampled_at, comm=name)
    program_name = f"{'GNU ' if workload == 'sed' else ''}{src.package}"
    compare(f"{program_name} {src.version}, {runs} runs over {size}", ins, prf, args.rows,
            f"`{env}{name} -f program.{workload} records.txt > /dev/null`, records such as "
            f"{sample}; program.{workload}:\n\n```\n{source.strip()}\n```", own=own)
    return profiles.rows(program_name, ins, prf)


def awk_buffer(text):
    """--awk-buffer's value: a positive number of bytes, or `exact`."""
    if text == "exact" or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"'{text}' is neither a positive number of bytes nor 'exact'")


def options(ap):
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated subset of {', '.join(WORKLOADS)} (default all)")
    ap.add_argument("--rounds", type=int, default=150,
                    help="hotspot rounds (about 14 ms each natively; default 150)")
    ap.add_argument("--size", type=float, default=6.0,
                    help="MB of text for sort, and of records for awk and sed (default 6; sort "
                         "needs 131072 lines or more to start its second thread)")
    ap.add_argument("--sort-runs", type=int, default=4,
                    help="times sort runs in a row, for enough samples (default 4; each "
                         "takes about 10 s to record and 8 s to replay)")
    ap.add_argument("--awk-runs", type=int, default=6,
                    help="times gawk runs in a row (default 6; about 0.15 s each natively, "
                         "10 s to record and 4 s to replay)")
    ap.add_argument("--awk-buffer", metavar="BYTES|exact", type=awk_buffer,
                    help="gawk's input buffer, given to both sides as AWKBUFSIZE: a size, or "
                         "`exact` for each file in one read (default gawk's own: the file "
                         "system's block size, 4 KiB in the guest; each read is a system call "
                         "the guest's interpreted kernel takes ~1 ms over, after which "
                         "gawk's memory-bound lookups run on cold caches: "
                         "docs/profiler-comparison.md)")
    ap.add_argument("--sed-runs", type=int, default=3,
                    help="times sed runs in a row (default 3; about 0.5 s each natively, "
                         "4 s to record and as long to replay)")
    ap.add_argument("--own-repeat", type=int, default=3, metavar="K",
                    help="the guest's own samples of sort, awk and sed (tools/native/tickprof.c, "
                         "one a guest tick: 100 a second of user time) are taken in an "
                         "unrecorded run of K times as many runs as the recording's, for enough "
                         "of them (default 3)")
    ap.add_argument("--memory", type=int, default=128,
                    help="guest MiB for the sort, awk and sed runs (default 128, insight's "
                         "default)")
    ap.add_argument("--rows", type=int, default=8,
                    help="functions listed for sort, awk and sed (default 8)")
    ap.add_argument("--sampled-at", choices=("record", "replay"), default="record",
                    help="record (default): the recording marks a sample every 1 ms of its "
                         "time and the replay collects them; replay: the replay samples by "
                         "its own host time")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")


def run(ctx):
    args = ctx.args
    if args.own_repeat < 1:
        die(f"--own-repeat: {args.own_repeat} is not a positive number of times")
    chosen = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown or not chosen:
        die(f"--workloads: {', '.join(unknown) or 'none given'}; choose from {', '.join(WORKLOADS)}")
    need({"perf": "linux-perf"})
    os.makedirs(BENCH, exist_ok=True)
    work = tempfile.mkdtemp(prefix="insight-bench-profile-")
    ok, unmeasured, rows = True, [], []
    try:
        # In the order of WORKLOADS; one that cannot be measured does not
        # stop the others.
        for workload in WORKLOADS:
            if workload not in chosen:
                continue
            try:
                if workload == "hotspot":
                    ok, got = profile_hotspot(args, work)
                elif workload == "sort":
                    got = profile_sort(args, work)
                else:
                    got = profile_program(args, work, workload)
                rows += got
            except BenchError as e:
                log(f"{workload}: not measured: {e}")
                unmeasured.append(workload)
    finally:
        if args.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    # 2: something could not be measured; 1: hotspot's comparison failed its check.
    return Report(rows, {"unmeasured": unmeasured, "hotspot_check": ok},
                  status=2 if unmeasured else 0 if ok else 1)
