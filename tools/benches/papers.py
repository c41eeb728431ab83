"""The seed papers' evaluations, reproduced side by side: docs/PAPERS.md.

For every experiment of the InSight paper's evaluation (correctness, Tables
1-4, the deadlock programs) and of ReTrace's (capture overhead, log size,
replay speed) that can run on this host, runs insight's version of it here
and writes docs/PAPERS.md: the paper's published figure, insight's, their
ratio or difference, and why they differ. Experiments that cannot run here
say so, and what insight does instead.

What runs (all through insight's release build and the built guest):
  * InSight 5.1: `top -b`, `dd if=/dev/urandom`, syn_cont and a UDP
    receiver fed by two senders: recorded once and replayed twice, console
    output compared;
  * InSight Table 1: W1, the host's `bc` computing an arctangent, timed in
    the guest, `insight run` against `insight record`; W3, a TCP stream
    host -> guest (tools/bench net's), run against record;
  * InSight Table 2: `sort` of a generated file and syn_cont: run, record,
    and replay collecting events with sampling off and at three periods
    (wall time, event database size);
  * InSight Table 3 and 5.4.3: tools/bench locktools (syn_cont's per-level
    lock figures; the Trylock, Transitive and Gatelock programs);
  * InSight Table 4: tools/bench profile (GNU sort, gawk and GNU sed
    profiled by insight, by `perf record -e cpu-clock` natively and by
    the guest's own timer ticks in an unrecorded run);
  * ReTrace's expansion: tools/bench expand (a traced replay against a
    plain one, and Valgrind lackey natively);
  * ReTrace: busybox httpd in the guest under `ab` from the host side of
    its TAP device (requests per second, run against record); log growth
    in bytes per 1,000 instructions for W1, its instructions counted under
    QEMU TCG with `-icount shift=0` (one nanosecond of virtual time per
    instruction); replay of an idle guest against its recorded time.

Network experiments run in network namespaces the benchmark creates
(tools/bench net's), with bounded request counts; no packet leaves them.

Usage: tools/bench papers [--no-write] [--runs N]
  --runs N     repetitions of each timed comparison (default 2; medians)
  --no-write   print the document; leave docs/PAPERS.md alone
Needs root (network namespaces, apt-get for apache2-utils, valgrind, perf
and QEMU when missing), /dev/kvm and a built guest (tools/build-guest).
"""
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

from . import harness, net, qemu_guest, stats
from .common import (REPO, die, guest_dir, initramfs_entries, initrd_with_archive,
                     insight as run_insight, log, matched as check_matched, need, timeit_ns,
                     trace_bytes)
from .harness import Report
from .stats import Row

TITLE = "The seed papers' evaluations"
DURATION = "36 min"
RUNS = 2

DOC = os.path.join(REPO, "docs", "PAPERS.md")
PACKAGES = {"ab": "apache2-utils", "qemu-system-x86_64": "qemu-system-x86", "valgrind": "valgrind",
            "perf": "linux-perf", "bc": "bc"}
GUEST_LIBS = "/lib/x86_64-linux-gnu"
# tools/bench profile's sections for Table 4: the paper's program, the
# start of the section's title.
PROFILE_SECTIONS = (("sort", "GNU sort"), ("awk", "gawk"), ("sed", "GNU sed"))
# W1: an arctangent by the bc at `{bc}`, twice.
W1_LOOP = "for i in 1 2; do echo 'scale=2000; a(1)*4' | {bc} -l >/dev/null; done"
# Where the guest has the host's bc (named by path: the guest's busybox sh
# would run its own bc applet).
GUEST_BC = "/usr/local/bin/bc"


def insight(args, what):
    """Runs insight; returns (process, wall seconds); stops the benchmark if it fails."""
    return run_insight(args)


def matched(p, what):
    check_matched(p.stderr, what)


def guest_libraries():
    """File names of the shared libraries the guest image has."""
    return {os.path.basename(name) for name, _ in initramfs_entries(guest_dir())}


def host_program_files(program, have):
    """[[files]] entries bringing the host's `program` and the libraries it
    needs that the guest lacks into the guest."""
    path = shutil.which(program)
    if not path:
        die(f"{program} is not installed on the host")
    entries = [(os.path.realpath(path), f"/usr/local/bin/{program}")]
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    for lib in re.findall(r"=> (/\S+)", out):
        if os.path.basename(lib) not in have:
            entries.append((os.path.realpath(lib), f"{GUEST_LIBS}/{os.path.basename(lib)}"))
    return entries


def config(path, command, files=(), memory=None, extra=""):
    """Writes a VM config running `command` (a list) with `files`."""
    with open(path, "w") as f:
        if memory:
            f.write(f"memory_mib = {memory}\n")
        f.write("command = " + json.dumps(command) + "\n" + extra)
        for host, guest in files:
            f.write(f'[[files]]\nhost = "{host}"\nguest = "{guest}"\n')
    return path


def med(xs):
    return stats.median(xs)


def pct(a, b):
    return f"{(a / b - 1) * 100:+.1f} %"


# ---- InSight 5.1: correctness ---------------------------------------------

UDP_PER_SENDER = 100

def correctness(tmp, net):
    rows = []
    cases = [
        ("top -b -n 3 -d 1", ["top", "-b", "-n", "3", "-d", "1"]),
        ("dd from /dev/urandom, checksum", ["sh", "-c", "dd if=/dev/urandom of=/tmp/f bs=1024 count=2048 "
                                                        "2>/dev/null; sha256sum /tmp/f"]),
        ("syn_cont (16 threads, its finishing order)", ["syn_cont", "1000", "2000"]),
    ]
    for name, argv in cases:
        trace = os.path.join(tmp, f"c-{len(rows)}")
        p, _ = insight(["record", "--no-stdin", "-o", trace, "--"] + argv, f"record {name}")
        outs = [p.stdout]
        for _ in range(2):
            r, _ = insight(["replay", trace], f"replay {name}")
            matched(r, name)
            outs.append(r.stdout)
        rows.append((name, len(p.stdout.splitlines()), all(o == outs[0] for o in outs)))
        shutil.rmtree(trace)
    # UDP: two senders to a receiver that writes every datagram to a file.
    with net.namespace("papers-udp") as ns:
        trace = os.path.join(tmp, "c-udp")
        # udp_sink prints the count and the file's SHA-256; its status says
        # whether both senders' ends arrived, which a run may not see.
        p, out = net.start_listening(ns, "record", "sh -c 'udp_sink 5000 2 /tmp/got 10; exit 0'",
                                     tmp, trace)
        senders = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", net.SENDER,
                                     tag, str(UDP_PER_SENDER), "0.02"]) for tag in ("a", "b")]
        for s in senders:
            if s.wait(timeout=120) != 0:
                p.kill()
                die("a UDP sender failed")
        rest, err = p.communicate(timeout=900)
        out += rest
        if p.returncode != 0:
            die(f"the UDP recording failed:\n{out}{err}")
    outs = [out]
    for _ in range(2):
        r, _ = insight(["replay", trace], "replay UDP")
        matched(r, "UDP")
        outs.append(r.stdout)
    got = re.search(r"udp_sink: (\d+) datagrams", out)
    rows.append((f"UDP receiver writing every datagram to a file, 2 senders at 50/s each, "
                 f"{got.group(1) if got else '?'} of {2 * UDP_PER_SENDER + 2} datagrams received; "
                 "the file's SHA-256", len(out.splitlines()), all(o == outs[0] for o in outs)))
    shutil.rmtree(trace)
    return rows


# ---- InSight Table 1 ------------------------------------------------------

def table1(tmp, net, runs, have):
    bc_files = host_program_files("bc", have)
    cfg = config(os.path.join(tmp, "bc.toml"),
                 ["timeit", "sh", "-c", W1_LOOP.format(bc=GUEST_BC)], bc_files)
    # The same loop natively, on one CPU like the 1-vCPU guest (the host's
    # bc is the binary the guest runs).
    native_cmd = ["taskset", "-c", "0", "sh", "-c", W1_LOOP.format(bc=bc_files[0][0])]
    native_ns, run_ns, rec_ns, traces = [], [], [], []
    for i in range(runs):
        start = time.monotonic_ns()
        subprocess.run(native_cmd, stdin=subprocess.DEVNULL, check=True)
        native_ns.append(time.monotonic_ns() - start)
        p, _ = insight(["run", "--no-stdin", cfg], "run W1")
        run_ns.append(timeit_ns(p.stdout))
        trace = os.path.join(tmp, f"w1-{i}")
        p, _ = insight(["record", "--no-stdin", "-o", trace, cfg], "record W1")
        rec_ns.append(timeit_ns(p.stdout))
        traces.append(trace)
        log(f"W1 round {i + 1}: native {native_ns[-1] / 1e9:.2f} s, run {run_ns[-1] / 1e9:.2f} s, "
            f"record {rec_ns[-1] / 1e9:.2f} s")
    if None in run_ns + rec_ns:
        die("W1 printed no timeit line")
    w1 = (med(run_ns) / 1e9, med(rec_ns) / 1e9)
    log_bytes = int(med([trace_bytes(t) for t in traces]))
    r, replay_wall = insight(["replay", "--no-console", traces[0]], "replay W1")
    matched(r, "W1")
    for t in traces:
        shutil.rmtree(t)

    data = os.path.join(tmp, "bulk")
    mib = 20
    with open(data, "wb") as f:
        f.write(os.urandom(mib << 20))
    live, rec = [], []
    for i in range(runs):
        live.append(net.transfer("run", data, tmp, f"p{i}")[0])
        rec.append(net.transfer("record", data, tmp, f"p{i}")[0])
    mbps = lambda ns: (mib << 20) * 8 / (ns / 1e9) / 1e6
    w3 = (mbps(med(live)), mbps(med(rec)))
    return {"w1": w1, "w1_native": med(native_ns) / 1e9, "w1_log_bytes": log_bytes,
            "w1_replay_wall": replay_wall, "w3": w3, "w3_mib": mib, "bc_files": bc_files,
            "bc_cfg": cfg, "samples": {"w1_native": native_ns, "w1_run": run_ns, "w1_record": rec_ns,
                                       "w3_run": live, "w3_record": rec}}


# ---- InSight Table 2 ------------------------------------------------------

PERIODS = [None, "10ms", "4ms", "1ms"]


def table2(tmp, runs, have):
    words = os.path.join(tmp, "words.txt")
    rng = random.Random(1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with open(words, "w") as f:
        for _ in range(200_000):
            f.write("".join(rng.choice(letters) for _ in range(rng.randint(4, 30))) + "\n")
    size_mib = os.path.getsize(words) / 2**20
    # The host's GNU sort (dynamically linked, so the probe library is
    # preloaded in it and insight samples its threads; busybox's is static).
    sort_files = host_program_files("sort", have) + [(words, "/root/words.txt")]
    sort_cfg = config(os.path.join(tmp, "sort.toml"),
                      ["sh", "-c", "S=/usr/local/bin/sort; $S /root/words.txt > /tmp/sorted; "
                       "$S -r /root/words.txt > /tmp/r; wc -l < /tmp/sorted"],
                      sort_files, memory=256, extra="probes = true\n")
    syn_cfg = config(os.path.join(tmp, "syn.toml"), ["syn_cont", "1000", "2000"], extra="probes = true\n")
    out = {}
    # A guest of 256 MiB has a boot snapshot of its own: taken here, not
    # in a timed run.
    insight(["run", "--no-stdin", "--memory", "256", "--", "true"], "boot snapshot of 256 MiB")
    for name, cfg in ((f"GNU sort, {size_mib:.1f} MiB of lines, twice, probes", sort_cfg),
                      ("syn_cont 1000 2000, probes", syn_cfg)):
        runs_w, recs_w, reps = [], [], {p: [] for p in PERIODS}
        dbs = {}
        for i in range(runs):
            _, w = insight(["run", "--no-stdin", cfg], f"run {name}")
            runs_w.append(w)
            trace = os.path.join(tmp, f"t2-{i}")
            _, w = insight(["record", "--no-stdin", "-o", trace, cfg], f"record {name}")
            recs_w.append(w)
            for period in PERIODS:
                db = os.path.join(tmp, "t2.db")
                args = ["replay", "--no-console", trace, "--events", db, "--force"]
                if period:
                    args += ["--sample-period", period]
                r, w = insight(args, f"replay {name}")
                matched(r, name)
                reps[period].append(w)
                dbs[period] = os.path.getsize(db)
                os.remove(db)
            shutil.rmtree(trace)
            log(f"Table 2, {name}, round {i + 1}: run {runs_w[-1]:.1f} s, record {recs_w[-1]:.1f} s, "
                f"replays {', '.join(f'{reps[p][-1]:.1f}' for p in PERIODS)} s")
        out[name] = {"run": med(runs_w), "record": med(recs_w),
                     "replay": {p: med(reps[p]) for p in PERIODS}, "db": dbs,
                     "samples": {"run": runs_w, "record": recs_w, "replay": reps[None],
                                 "replay 1ms": reps["1ms"]}}
    return out


# ---- ReTrace ----------------------------------------------------------------

def httpd(tmp, net, runs):
    page = os.path.join(tmp, "index.html")
    with open(page, "w") as f:
        f.write("<html><body>" + "insight " * 1200 + "</body></html>\n")
    files = [(page, "/root/www/index.html")]
    command = ("sh -c 'httpd -p 80 -h /root/www && echo listening && nc -l -p 5002 >/dev/null; "
               "echo stopped'")
    results = {"run": [], "record": []}
    sizes = []
    for i in range(runs):
        for mode in ("run", "record"):
            with net.namespace(f"papers-ab-{mode}-{i}") as ns:
                cfg_dir = os.path.join(tmp, f"ab-{mode}-{i}")
                os.makedirs(cfg_dir)
                trace = os.path.join(cfg_dir, "trace")
                p, out = net.start_listening(ns, mode, command, cfg_dir, trace, files, wait=300)
                ab = subprocess.run(["ip", "netns", "exec", ns, "ab", "-q", "-n", "300", "-c", "4",
                                     f"http://{net.GUEST}/index.html"],
                                    capture_output=True, text=True, timeout=600)
                subprocess.run(["ip", "netns", "exec", ns, "bash", "-c",
                                f"echo stop > /dev/tcp/{net.GUEST}/5002"], capture_output=True)
                rest, err = p.communicate(timeout=600)
                if ab.returncode != 0 or p.returncode != 0:
                    die(f"ab against httpd ({mode}) failed:\n{ab.stdout[-1500:]}{ab.stderr[-500:]}"
                        f"{out}{rest}{err[-1500:]}")
                m = re.search(r"Requests per second:\s+([\d.]+)", ab.stdout)
                failed = re.search(r"Failed requests:\s+(\d+)", ab.stdout)
                if not m or (failed and int(failed.group(1))):
                    die(f"ab reported no rate or failed requests ({mode}):\n{ab.stdout[-1500:]}")
                results[mode].append(float(m.group(1)))
                if mode == "record":
                    sizes.append(trace_bytes(trace))
                    r, _ = insight(["replay", "--no-console", trace], "replay httpd")
                    matched(r, "httpd")
                shutil.rmtree(cfg_dir)
        log(f"httpd round {i + 1}: run {results['run'][-1]:.0f} req/s, "
            f"record {results['record'][-1]:.0f} req/s")
    return {"run": med(results["run"]), "record": med(results["record"]), "log_bytes": int(med(sizes)),
            "samples": results}


def instructions_under_qemu(tmp, t1):
    """W1's instructions, counted as QEMU TCG's virtual nanoseconds with
    -icount shift=0 (one per instruction) over the guest's `timeit` window."""
    qemu = qemu_guest
    guest = guest_dir()
    work = os.path.join(tmp, "qemu")
    os.makedirs(work)
    # The files W1 needs, in an archive appended to the guest's initramfs.
    lst = os.path.join(work, "list")
    cmdfile = os.path.join(work, "command")
    with open(cmdfile, "wb") as f:
        argv = ["timeit", "sh", "-c", W1_LOOP.format(bc=GUEST_BC)]
        f.write(b"".join(a.encode() + b"\0" for a in argv))
    dirs = {"/etc", "/etc/insight", "/usr", "/usr/local", "/usr/local/bin", "/lib", GUEST_LIBS}
    with open(lst, "w") as f:
        for d in sorted(dirs):
            f.write(f"dir {d} 0755 0 0\n")
        f.write(f"file /etc/insight/command {cmdfile} 0644 0 0\n")
        for host, g in t1["bc_files"]:
            f.write(f"file {g} {host} 0755 0 0\n")
    initrd = initrd_with_archive(guest, lst, os.path.join(work, "initrd"))
    cmdline = qemu.CMDLINE + qemu.QEMU_CMDLINE
    kernel = qemu.guest_kernel(guest, cmdline, os.path.join(work, "vmlinux"))
    argv = qemu.qemu_argv(kernel, initrd, cmdline, "shift=0,sleep=off")
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
    ns = timeit_ns(p.stdout)
    if ns is None:
        die(f"W1 under QEMU printed no timeit line:\n{p.stdout[-2000:]}{p.stderr[-1000:]}")
    return ns


def idle_replay(tmp):
    trace = os.path.join(tmp, "idle")
    p, rec_wall = insight(["record", "--no-stdin", "--summary", "-o", trace, "--", "sleep", "10"], "record idle")
    end = re.search(r"([\d.]+) s of guest time", p.stderr)
    h, _ = insight(["dump", "--header", trace], "dump --header")
    start = re.search(r"taken at guest time ([\d.]+) s", h.stdout)
    r, rep_wall = insight(["replay", "--no-console", trace], "replay idle")
    matched(r, "idle")
    shutil.rmtree(trace)
    # The recording's guest time goes on from the boot snapshot's.
    guest = float(end.group(1)) - (float(start.group(1)) if start else 0.0) if end else None
    return {"guest_s": guest, "record_wall": rec_wall, "replay_wall": rep_wall}


# ---- the benchmarks this one builds on ----------------------------------------

def expansion(runs):
    """ReTrace's expansion against insight's: tools/bench expand's figures
    as the document prints them (None if it could not be measured)."""
    report, _ = harness.nested("expand", runs)
    if report is None:
        return None
    x = report.data
    return {"plain": f"{x['plain_s']:.2f} s", "traced": f"{x['traced_s']:.2f} s",
            "slowdown": f"{x['slowdown']:.1f}", "trapped_slowdown": f"{x['trapped_slowdown']:.1f}",
            "lackey": f"{x['lackey_slowdown']:.0f}", "insns": f"{x['instructions']:.0f}",
            "accesses": f"{x['accesses']:.0f}", "per_insn": f"{x['us_per_instruction']:.1f}",
            "per_insn_trapped": f"{x['us_per_instruction_trapped']:.1f}"}


# ---- the document -------------------------------------------------------------

def document(r, started, runs):
    host = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                          capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    took = (time.monotonic() - started) / 60
    L = []
    a = L.append
    a("# The seed papers' evaluations, side by side\n")
    a(f"Written by `tools/bench papers --runs {runs}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
      f"({took:.0f} minutes): insight {commit}, {os.cpu_count()} CPUs ({host}), nested KVM that "
      "interprets the guest kernel and has no PMU (docs/BENCHMARKS.md). Every insight figure below "
      "comes from that one run; the papers' figures are as published (InSight: Core i5 2.8 GHz, "
      "4 cores, a 1-vCPU 1.5 GB guest on KVM/QEMU 0.14, Linux 2.6.38; ReTrace: VMware Workstation "
      "6.0, a 1-vCPU 2 GB guest, two dual-core Opterons). The hosts differ, the guests differ, and "
      "most workloads are scaled down to run in minutes here, so ratios (record against run, "
      "replay against record) are the comparable figures, not absolute times.\n")

    a("## InSight\n")
    a("### 5.1 Correctness of record and replay\n")
    a("The paper compared `top`'s output, Syn_cont's statistics, a UDP receiver's file and a "
      "`dd` file from `/dev/urandom` between record and replay: all identical. Here each "
      "program was recorded once and replayed twice (every exit checked); the table compares "
      "the console output.\n")
    a("| program | paper | insight: console lines | insight: record = replay 1 = replay 2 |")
    a("|---|---|---:|---|")
    for name, lines, same in r["correctness"]:
        a(f"| {name} | identical | {lines} | {'**yes**' if same else '**NO**'} |")
    a("")

    t1 = r["table1"]
    a("### Table 1: cost of recording\n")
    a("| workload | paper: run | paper: record | paper: change | insight: run | insight: record | insight: change |")
    a("|---|---:|---:|---:|---:|---:|---:|")
    a(f"| W1: `bc` arctangent (paper: scale 3000, 10 times; here the host's bc, scale 2000, twice), time | "
      f"8.66 s | 8.77 s | +1.3 % | {t1['w1'][0]:.2f} s | {t1['w1'][1]:.2f} s | {pct(t1['w1'][1], t1['w1'][0])} |")
    a("| W2: 10 million RDTSC, time | 0.08 s | 11.81 s | 148x | not measured | | |")
    a(f"| W3: host -> guest transfer (paper: 100 MB, 5 times; here {t1['w3_mib']} MiB over TCP), bandwidth | "
      f"225.6 Mbps | 184.16 Mbps | -18.4 % | {t1['w3'][0]:.1f} Mbps | {t1['w3'][1]:.1f} Mbps | "
      f"{pct(t1['w3'][1], t1['w3'][0])} |")
    a("")
    a(f"W1 natively, the same bc binary and loop pinned to one CPU (the guest has one vCPU), "
      f"timed by this tool: {t1['w1_native']:.2f} s, so `insight run` goes at "
      f"{t1['w1_native'] / t1['w1'][0]:.2f}x native speed and `insight record` at "
      f"{t1['w1_native'] / t1['w1'][1]:.2f}x (medians of {runs} rounds, each native, run and "
      f"record in turn).\n")
    a("W1 is timed by the guest (`timeit`, the paravirtual clock, which is the host's monotonic "
      "clock in both modes). W2 cannot run here: these hosts' KVM ignores CR4.TSD in user mode, "
      "so user-mode RDTSC never traps (`insight host-check`); insight instead has the guest "
      "kernel emulate RDTSC where the host does trap it, and its guest image's own binaries do "
      "not execute it (docs/ARCHITECTURE.md). W3 is tools/bench net's TCP stream, timed in the "
      "guest from the first byte to the last; the guest kernel is interpreted here, which "
      "bounds both modes far below the paper's bandwidth.\n")

    t2 = r["table2"]
    a("### Table 2: replay time and event database size with sampling\n")
    a("The paper sampled every 800K, 400K and 100K CPU cycles with the PMU (0.29, 0.14 and "
      "0.036 ms at 2.8 GHz); these hosts have no PMU, so insight samples on host time, at "
      "most once a millisecond: 10, 4 and 1 ms here. Wall times, insight restored from its "
      "boot snapshot (the paper timed from boot to shutdown).\n")
    a("| workload | scenario | paper: time | paper: DB | insight: time | insight: DB |")
    a("|---|---|---:|---:|---:|---:|")
    paper = {"sort": [("run", 1346, None), ("record", 1477, None), ("replay, no sampling", 1401, 5.8),
                      ("replay, sampling 800K / 10 ms", 1551, 165), ("replay, sampling 400K / 4 ms", 1635, 324),
                      ("replay, sampling 100K / 1 ms", 2394, 1279)],
             "syn_cont": [("run", 886, None), ("record", 883, None), ("replay, no sampling", 941, 31),
                          ("replay, sampling 800K / 10 ms", 998, 120), ("replay, sampling 400K / 4 ms", 1070, 208),
                          ("replay, sampling 100K / 1 ms", 1321, 737)]}
    for name, m in t2.items():
        key = "sort" if "sort" in name else "syn_cont"
        ours = [(m["run"], None), (m["record"], None)] + [(m["replay"][p], m["db"][p]) for p in PERIODS]
        for (scenario, pt, pdb), (t, db) in zip(paper[key], ours):
            a(f"| {name} | {scenario} | {pt} s | {'' if pdb is None else f'{pdb} MB'} | {t:.1f} s | "
              f"{'' if db is None else f'{db / 2**20:.2f} MiB'} |")
    a("")
    a("Both run with the probe library, which is what makes insight sample a process's "
      "threads. Its events cost nothing while recording and, at replay, a copy into the event "
      "ring each (docs/events.md), read at the next exit: no exit per event. sort's probes are "
      "its allocations, whose heap events are raised only in replays that collect them "
      "(`--heap-events`), not these. Recording costs sort more than syn_cont because sort "
      "writes much memory: an asynchronous point lists the pages written in the last "
      "milliseconds, from KVM's dirty log, and each restart of that log makes the next write "
      "to each page fault, slowly on a nested host (it restarts only before a point). The "
      "paper's RUBiS rows need a web application and database tier outside the VM; not "
      "reproduced.\n")

    lk = r["locktools"]
    a("### Table 3: Syn_cont's locks\n")
    if lk and lk.get("paper_proportions"):
        pp = lk["paper_proportions"]
        a(f"Syn_cont at the paper's proportions (16 threads; level-1 locks shared by 2 threads, "
          f"level-2 by 8; comp() of about a millisecond before and inside each lock, as the "
          f"paper's `comp(); lock(); comp(); unlock();`), `{pp['command']}`, one probed "
          f"recording in a 1-vCPU guest, from tools/bench locktools. Beside insight's blocked "
          f"requests, the program's own count for the same recording: the requests that found "
          f"their lock held (its lock word read right before each `pthread_mutex_lock`).\n")
        a("| level | paper: requests | paper: blocked | paper: ownership changes | insight: requests per lock | insight: blocked | program: found held | insight: ownership changes |")
        a("|---|---:|---:|---:|---:|---:|---:|---:|")
        for level, preq, pb, pc in (("level1", 2000, 6.32, 71.46), ("level2", 8000, 73.66, 78.85)):
            v = pp["levels"][level]
            a(f"| {level} | {preq} | {pb} % | {pc} % | {', '.join(map(str, v['requests_per_lock']))} | "
              f"{v['blocked_percent']:.2f} % | {v['own_held_percent']:.2f} % | "
              f"{v['ownership_change_percent']:.2f} % |")
        a("")
        a("Per lock, insight's blocked count equals the program's own count for "
          + ", ".join(f"{pp['levels'][l]['locks_equal_to_own_count']} of "
                      f"{pp['levels'][l]['locks']} {l} locks" for l in ("level1", "level2"))
          + ". The paper ran 1000 iterations for about 180 s; 20 iterations keep the "
          "proportions (critical sections as long as the work between them) in a few seconds "
          "of guest time. Level-2 locks, each shared by 8 threads, block far more often than "
          "level-1 ones, shared by 2, as in the paper; the paper's higher level-2 figure "
          "comes from its host preempting the guest's threads anywhere, where insight's "
          "guest switches threads on its own tick.\n")
    if lk:
        s = lk["syn_cont"]["insight"]["levels"]
        a(f"The short variant, `{lk['syn_cont']['command']}` (a few microseconds of work per "
          f"step, so a thread finishes within a tick and is almost never preempted holding a "
          f"lock): what the lock tools see when nothing contends.\n")
        a("| level | insight: requests per lock | insight: blocked | insight: ownership changes |")
        a("|---|---:|---:|---:|")
        for level in ("level1", "level2"):
            v = s[level]
            a(f"| {level} | {', '.join(map(str, v['requests_per_lock']))} | "
              f"{v['blocked_percent']:.2f} % | {v['ownership_change_percent']:.2f} % |")
        a("")
    else:
        a("tools/bench locktools failed in this run: not measured.\n")

    a("### Table 4: function profiles against perf\n")
    prof = r["profile"]
    if any(prof.values()):
        a("The paper profiled awk, sed and sort on a 750 MB file, InSight against perf on the "
          "host (top functions: sort `strcoll_l` 85.26 % / perf 77.16 %, `memcmp_sse2` 4.81 / "
          "6.67 %; awk `r_interpret` 22.56 / 24.9 %; sed `re_search_internal` 28.81 / "
          "28.90 %). Here tools/bench profile profiles GNU sort, gawk and GNU sed, built with "
          "symbols from Debian's sources (Debian's binaries are stripped), in the guest "
          "(insight's samples at the recording's 1-ms marks, collected at replay) and natively "
          "(`perf record -e cpu-clock`), "
          "over generated text a few MB long, several runs in a row. Most of insight's "
          "samples fall in the guest kernel, which these hosts interpret (about 1000x slower "
          "than native): the user-mode columns are the comparable ones. The guest runs the "
          "programs with insight's probe library preloaded, the native runs without it: "
          "insight's rows in `libinsight-probes.so` are that library's own time (two heap "
          "events per malloc or free), absent from the native runs. The C locale is used on both "
          "sides, so sort compares with `memcmp` rather than the paper's `strcoll_l`."
          " A third column gives the guest's own profile of the program, from inside the guest: "
          "the same command in an unrecorded `insight run` with tools/native/tickprof.c "
          "preloaded, one sample a guest timer tick that finds the program in user mode (its "
          "kernel sends SIGVTALRM every 10 ms of user time), three times as many runs. It says "
          "how the guest's run differs from the native one that perf measures. It has a bias of "
          "its own: a tick that falls due while the interpreted kernel runs with interrupts off "
          "is charged to the instruction the kernel returns to, so instructions that fault "
          "collect ticks that were kernel time (gawk's `_int_malloc` and `more_blocks`; nearly "
          "all of sort's own samples, whose kernel time is page faults: those columns say nothing"
          " about sort).\n")
        for key, title in PROFILE_SECTIONS:
            if prof[key]:
                a(prof[key])
                a("")
            else:
                a(f"{key} ({title}): not measured, tools/bench profile failed for it in this "
                  "run.\n")
    else:
        a("tools/bench profile failed in this run: not measured.\n")

    a("### 5.4.3 Potential deadlocks: Trylock, Transitive, Gatelock\n")
    if lk:
        a("| program | paper | insight | Helgrind | DRD |")
        a("|---|---|---|---|---|")
        paper_dl = {"deadlock_trylock": "1 cycle (the trylock succeeds)", "deadlock_trylock_fail":
                    "none (the trylock fails)", "deadlock_transitive": "1 deadlock",
                    "deadlock_gatelock": "none: the cycle is protected by gate lock Gate"}
        for row in lk["deadlocks"]["programs"]:
            ins = row["insight"]
            a(f"| {row['program']} | {paper_dl.get(row['program'], '')} | {ins['deadlocks']} potential "
              f"deadlock(s), {ins['protected']} protected | {row['helgrind'].get('lock_order', '?')} lock-order "
              f"report(s) | {row['drd']['errors']} error(s) |")
        a("")
    else:
        a("tools/bench locktools failed in this run: not measured.\n")

    a("## ReTrace\n")
    h = r["httpd"]
    a("### Capture overhead\n")
    a("| workload | paper: without | paper: with capture | paper: change | insight: run | insight: record | insight: change |")
    a("|---|---:|---:|---:|---:|---:|---:|")
    a(f"| web server under Apache Benchmark (paper: Apache 2.0, AB in the same VM, KB/s; here busybox "
      f"httpd in the guest, `ab -n 300 -c 4` from the host side of its TAP device, requests/s) | "
      f"747 KB/s | 283 KB/s | -62 % | {h['run']:.1f} req/s | {h['record']:.1f} req/s | {pct(h['record'], h['run'])} |")
    a(f"| CPU-bound (paper: SPEC CPU2006, geometric mean; here W1, the host's bc) | | | +5.09 % | "
      f"{t1['w1'][0]:.2f} s | {t1['w1'][1]:.2f} s | {pct(t1['w1'][1], t1['w1'][0])} |")
    a("")
    a("SPEC CPU2006 is not freely available; W1 stands in for a CPU-bound program.\n")

    a("### Log size\n")
    q = r["qemu_insn"]
    a("| workload | paper: bytes per 1,000 instructions | insight: log | insight: instructions | insight: bytes per 1,000 instructions |")
    a("|---|---:|---:|---:|---:|")
    if q:
        a(f"| CPU-bound (paper: 400.perlbench; here W1) | 4.1 (1.1 gzip) | {t1['w1_log_bytes']} B | "
          f"{q / 1e9:.2f} billion | {t1['w1_log_bytes'] / (q / 1000):.5f} |")
    a(f"| web server (paper: Apache Benchmark) | 5.4 (0.5 gzip) | {h['log_bytes']} B | not counted | |")
    a("")
    a("insight's log is compressed (zstd) as it is written: compare with the paper's gzip "
      "column. The instructions are the guest's `timeit` window of W1 run under QEMU TCG with "
      "`-icount shift=0,sleep=off`, where virtual time advances one nanosecond per "
      "instruction: an honest count of the instructions the same guest executes for the same "
      "work, kernel included. insight's log covers the whole recording (the guest fetching "
      "its files, W1, the shutdown), so the figure is an upper bound for W1 alone. The web "
      "server's instructions are not counted: QEMU's run has no network device here.\n")

    i = r["idle"]
    a("### Replay speed\n")
    a("| case | paper | insight |")
    a("|---|---|---|")
    a(f"| idle guest (`sleep 10`): replay against the recorded run | faster than the original, no number | "
      f"record {i['record_wall']:.1f} s wall ({i['guest_s']:.1f} s of guest time from the boot snapshot), replay "
      f"{i['replay_wall']:.1f} s: **{i['replay_wall'] / i['record_wall']:.2f}x** |")
    a(f"| CPU-bound: replay against record | 400.perlbench replayed in 117 s (no original time given) | "
      f"W1 replay {t1['w1_replay_wall']:.1f} s wall, its recording's guest-timed work {t1['w1'][1]:.1f} s |")
    x = r.get("expand")
    if x:
        a(f"| replay with instruction-trace expansion | > 2 hours (> 60x) | tests/programs/mem_access.c "
          f"({x['insns']} instructions and {x['accesses']} memory accesses of its process traced, "
          f"`--trace-process`): replay {x['plain']} without tracing, {x['traced']} with it, "
          f"**{x['slowdown']}x**; {x['per_insn']} µs of host time per traced instruction, most "
          f"stepped in guest kernel mode ({x['per_insn_trapped']} µs, {x['trapped_slowdown']}x, "
          f"with every step a trap: `--trace-by-traps`; Valgrind lackey, natively: {x['lackey']}x) |")
    else:
        a("| replay with instruction-trace expansion | > 2 hours (> 60x) | tools/bench expand failed in "
          "this run: not measured |")
    a("")
    return "\n".join(L) + "\n"


def run(ctx):
    if os.geteuid() != 0:
        die("needs root: the network experiments create network namespaces")
    runs = ctx.runs
    started = time.monotonic()
    need(PACKAGES)
    have = guest_libraries()
    tmp = tempfile.mkdtemp(prefix="insight-bench-papers-")
    r = {}
    try:
        log("InSight 5.1: correctness")
        r["correctness"] = correctness(tmp, net)
        log("InSight Table 1")
        r["table1"] = table1(tmp, net, runs, have)
        log("InSight Table 2")
        r["table2"] = table2(tmp, runs, have)
        log("ReTrace: httpd under ab")
        r["httpd"] = httpd(tmp, net, runs)
        log("ReTrace: instructions of W1 under QEMU -icount")
        r["qemu_insn"] = instructions_under_qemu(tmp, r["table1"])
        log("ReTrace: idle replay")
        r["idle"] = idle_replay(tmp)
        report, _ = harness.nested("locktools", 1)
        r["locktools"] = report.data if report else None
        # sort spends nearly all its guest time in the guest kernel: 12
        # runs give it several hundred user-mode samples.
        report, printed = harness.nested("profile", sort_runs=12)
        # Its sections are "### TITLE", each printed once its workload was
        # measured (one that could not be is left out); the sort, awk and
        # sed ones, as bold titles here.
        r["profile"] = {}
        for key, title in PROFILE_SECTIONS:
            m = re.search(rf"^### ({title}[^\n]*)\n(.*?)(?=^### |\Z)", printed or "", re.S | re.M)
            r["profile"][key] = f"**{m.group(1)}**\n\n{m.group(2).strip()}" if m else None
            if not m:
                log(f"tools/bench profile: no {key} section")
        r["expand"] = expansion(runs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = document(r, started, runs)
    if ctx.write:
        with open(DOC, "w") as f:
            f.write(doc)
        print("The figures beside the papers' are in docs/PAPERS.md, written by this run.")
    else:
        print(doc)
    return Report(rows(r, runs), {k: v for k, v in r.items() if k in ("correctness", "idle", "httpd")})


def rows(r, runs):
    """The run's own figures as rows: the recordings' costs, the replays'
    speed and whether replays matched."""
    t1, h, i = r["table1"]["samples"], r["httpd"], r["idle"]
    same = sum(1 for _, _, ok in r["correctness"] if ok)
    out = [
        Row.computed("InSight 5.1: programs whose two replays printed what the recording did",
                     same, len(r["correctness"]), unit="programs"),
        Row("Table 1, W1 (bc), guest time: insight run, insight record",
            [ns / 1e9 for ns in t1["w1_record"]], [ns / 1e9 for ns in t1["w1_run"]]),
        Row("Table 1, W1 (bc): natively (pinned to one CPU), insight run",
            [ns / 1e9 for ns in t1["w1_run"]], [ns / 1e9 for ns in t1["w1_native"]]),
        Row(f"Table 1, W3 ({r['table1']['w3_mib']} MiB over TCP), time in the guest: run, record",
            [ns / 1e9 for ns in t1["w3_record"]], [ns / 1e9 for ns in t1["w3_run"]]),
    ]
    for name, m in r["table2"].items():
        t = m["samples"]
        out.append(Row(f"Table 2, {name} (wall): run, record", t["record"], t["run"]))
        out.append(Row(f"Table 2, {name} (wall): replay without sampling, with sampling every 1 ms",
                       t["replay 1ms"], t["replay"]))
    out.append(Row("ReTrace, httpd under ab: run, record", h["samples"]["record"], h["samples"]["run"],
                   unit="requests/s"))
    out.append(Row.computed("ReTrace, idle guest (sleep 10), wall: record, replay", i["replay_wall"],
                            i["record_wall"]))
    return out
