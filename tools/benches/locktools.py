"""insight's lock diagnosis against Valgrind's DRD and Helgrind, side by side.

The same programs (images/workloads, built here with the guest image's
flags) run natively on this host under Valgrind and in the insight guest
under `insight record`, then `insight replay --events` and `insight report`.

Syn_cont (`syn_cont 1000 2000`: 16 threads; 8 level-1 locks each shared by 2
threads, 2 level-2 locks each shared by 8):
  * natively: the plain run time (median of 5 per run), and the run time
    under `valgrind --tool=none` (Valgrind's core alone), DRD and Helgrind,
    as slowdowns over the plain run;
  * DRD with --exclusive-threshold=N (default 1 ms): its reports "Lock on
    mutex ... was held during ... ms", counted per lock level (DRD groups
    them by call stack; each level's unlock is one stack; the counts come
    from its XML output). That is DRD's only lock-timing measure: long
    holds, whether or not anyone waited;
  * Helgrind: the errors it reports (count and kind). It has no measure of
    contention at all;
  * insight: record overhead as tools/bench events measures it (guest time
    of `timeit syn_cont 1000 2000` under `insight record`, with the probe
    library preloaded and without); then one probed recording replayed
    with `--events` and `insight report locks --json`: per lock level
    (level-1 locks are requested 2*ITER times, level-2 ones 8*ITER times)
    the requests, blocked %, ownership change %, and, to set next to DRD,
    the holds longer than the same threshold (counted from the event
    database, which is written in its SQL rows format for that).
The host has more cores than the guest (1 vCPU), so the native and guest
runs do not contend alike; under Valgrind, which runs one thread at a time,
the program is serialised too, but by Valgrind's own scheduler.

Syn_cont at the paper's proportions (`syn_cont 20 500000 0 500000`: comp()
of about a millisecond before and inside each lock, as the paper's threads
ran `comp(); lock(); comp(); unlock();`): one probed recording, its
`report locks` per lock beside the program's own count of the requests
that found their lock held.

Potential deadlocks (deadlock_trylock, deadlock_trylock_fail,
deadlock_transitive, deadlock_gatelock; their threads take their turns one
after the other, so they never actually deadlock): each runs natively
under Helgrind ("lock order ... violated") and DRD (which has no lock-order
check), and all four in one insight recording, replayed with `--events`
and analysed with `insight report deadlock`. The table marks false
positives and false negatives against the expected result:
  trylock 1 (a cycle through a lock taken by a successful trylock),
  trylock_fail 0 (the trylock fails, so no cycle), transitive 1 (3 threads,
  3 locks), gatelock 0 (a cycle whose threads all hold the gate lock G).

mutrace, the other lock profiler one would compare with, is not packaged
in Debian bookworm; the script says whether one is installed, and does not
fetch it.

Usage: tools/bench locktools [--runs N] [--iterations N] [--work N]
                             [--drd-threshold MS] [--keep]
Needs a built guest (tools/build-guest), gcc and valgrind (installed with
apt-get when run as root, else named). Takes about 3 minutes with --runs 1
(each further run adds about 1 minute: two recordings of syn_cont). The
tables, in Markdown for docs/locktools-comparison.md, are its detail; the
results file holds every figure.
"""
import json
import os
import platform
import re
import shutil
import sqlite3
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET

from . import stats
from .common import PRELOAD, REPO, binary, die, guest_ns, log, need, run as command
from .harness import Report
from .stats import Row

TITLE = "Lock analysis: Valgrind DRD and Helgrind"
DURATION = "3 min"
RUNS = 1

WORKLOADS = os.path.join(REPO, "images", "workloads")
PROBES = os.path.join(REPO, "probes")
CFLAGS = "-O2 -g -fno-omit-frame-pointer -Wall -Wextra -Werror -pthread".split()
NATIVE_REPEAT = 5
# (program, potential deadlocks expected, the expected result in words)
DEADLOCKS = [
    ("deadlock_trylock", 1, "1 (cycle through a lock taken by a successful trylock)"),
    ("deadlock_trylock_fail", 0, "0 (the trylock fails: no cycle)"),
    ("deadlock_transitive", 1, "1 (3 threads, 3 locks)"),
    ("deadlock_gatelock", 0, "0 (the cycle is protected by gate lock G)"),
]


def versions():
    v = {"valgrind": command(["valgrind", "--version"])[0].stdout.strip(),
         "gcc": command(["gcc", "-dumpfullversion"])[0].stdout.strip(),
         "kernel": platform.release()}
    g = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    v["insight_commit"] = g.stdout.strip() if g.returncode == 0 else "unknown"
    return v


def build_programs(work):
    bins = {}
    for name in ["syn_cont"] + [d[0] for d in DEADLOCKS]:
        out = os.path.join(work, name)
        command(["gcc"] + CFLAGS + ["-I", PROBES, "-o", out, os.path.join(WORKLOADS, name + ".c")],
                f"compiling {name}")
        bins[name] = out
    return bins


def syn_cont_lines():
    """Source line -> lock level, for the lock and unlock calls of each level."""
    levels = {}
    with open(os.path.join(WORKLOADS, "syn_cont.c")) as f:
        for n, line in enumerate(f, 1):
            m = re.search(r"pthread_mutex_(?:un)?lock\(l([12])\)", line)
            if m:
                levels[n] = int(m.group(1))
    if sorted(set(levels.values())) != [1, 2]:
        die("cannot find the level-1 and level-2 lock calls in syn_cont.c")
    return levels


# ---- Valgrind -------------------------------------------------------------

def valgrind(tool, opts, argv, work, tag):
    """Runs argv under a Valgrind tool; returns (stdout, stderr text, xml path
    or None, wall seconds)."""
    xml = os.path.join(work, f"{tag}.xml") if tool == "drd" else None
    cmd = ["valgrind", f"--tool={tool}"] + opts
    if xml:
        cmd += ["--xml=yes", f"--xml-file={xml}"]
    p, wall = command(cmd + argv, f"valgrind --tool={tool} {os.path.basename(argv[0])}")
    return p.stdout, p.stderr, xml, wall


def frames(stack):
    return [(f.findtext("fn") or "", f.findtext("file") or "", int(f.findtext("line") or 0))
            for f in stack.iter("frame")]


def drd_errors(xml):
    """DRD's XML: [(kind, what, count, main-stack frames, acquired-at frames)]."""
    root = ET.parse(xml).getroot()
    counts = {p.findtext("unique"): int(p.findtext("count"))
              for p in root.iter("pair") if p.find("unique") is not None}
    errors = []
    for e in root.findall("error"):
        what = e.findtext("what") or (e.find("xwhat").findtext("text") if e.find("xwhat") is not None else "")
        main = e.find("stack")
        acq = e.find("acquired_at")
        errors.append((e.findtext("kind"), what, counts.get(e.findtext("unique"), 1),
                       frames(main) if main is not None else [],
                       frames(acq) if acq is not None else []))
    return errors


def drd_holds(errors, levels):
    """DRD's long-hold reports per lock level (1, 2; 0 = a mutex of libc or of
    DRD's own pthread_create wrapper), and anything else it reported."""
    holds = {1: 0, 2: 0, 0: 0}
    other = {}
    for kind, what, count, main, acq in errors:
        if kind != "HoldtimeErr":
            other[kind] = other.get(kind, 0) + count
            continue
        level = 0
        for fn, file, line in main + acq:
            if file == "syn_cont.c" and line in levels:
                level = levels[line]
                break
        holds[level] += count
    return holds, other


def helgrind_report(stderr):
    """Helgrind's text output: errors, contexts, suppressed, and the headline
    of each error context with lock addresses named by their symbols."""
    lines = [re.sub(r"^==\d+== ?", "", l) for l in stderr.splitlines()]
    m = re.search(r"ERROR SUMMARY: (\d+) errors from (\d+) contexts \(suppressed: (\d+) from (\d+)\)",
                  stderr)
    if not m:
        die(f"no ERROR SUMMARY in Helgrind's output:\n{stderr[-2000:]}")
    symbols = {a.lower(): s for a, s in
               re.findall(r"Address (0x[0-9a-fA-F]+) is \d+ bytes inside data symbol \"([^\"]+)\"", stderr)}
    heads = []
    for i, l in enumerate(lines):
        if re.fullmatch(r"-{40,}", l):
            for h in lines[i + 1:]:
                if h.strip():
                    h = re.sub(r"^Thread #\d+: ", "", h.strip())
                    h = re.sub(r"0x[0-9a-fA-F]+", lambda a: symbols.get(a.group(0).lower(), a.group(0)), h)
                    heads.append(h)
                    break
    return {"errors": int(m.group(1)), "contexts": int(m.group(2)),
            "suppressed": int(m.group(3)), "reports": heads,
            "lock_order": sum(1 for h in heads if re.search(r"lock order .* violated", h))}


# ---- insight --------------------------------------------------------------

def insight(args, what):
    return command([binary()] + args, f"insight {what}")


def long_holds(db, threshold_ns):
    """Holds longer than threshold_ns per lock address, from a rows-format
    event database: acquisition (a *_RET with result 0) to UNLOCK by the
    same thread."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    kinds = dict(con.execute("SELECT name, kind FROM kinds"))
    rets = {kinds[k] for k in ("LOCK_RET", "TRYLOCK_RET", "TIMEDLOCK_RET") if k in kinds}
    unlock = kinds["UNLOCK"]
    held, counts = {}, {}
    q = (f"SELECT time, kind, lwpid, addr, value FROM events WHERE kind IN "
         f"({','.join(str(k) for k in rets | {unlock})}) ORDER BY seq")
    for t, kind, lwpid, addr, value in con.execute(q):
        addr &= (1 << 64) - 1
        if kind == unlock:
            start = held.pop((lwpid, addr), None)
            if start is not None and t - start > threshold_ns:
                counts[addr] = counts.get(addr, 0) + 1
        elif value == 0:
            held[(lwpid, addr)] = t
    con.close()
    return counts


def level_summary(locks, holds, iterations):
    """insight's per-lock figures summed per level (1: 2*ITER requests, 2:
    8*ITER, 0: anything else)."""
    out = {}
    for level in (1, 2, 0):
        want = {1: 2 * iterations, 2: 8 * iterations}.get(level)
        ls = [l for l in locks if (l["requests"] == want if want else
                                   l["requests"] not in (2 * iterations, 8 * iterations))]
        if not ls:
            continue
        req = sum(l["requests"] for l in ls)
        acq = sum(l["acquisitions"] for l in ls)
        blocked = sum(l["blocked"] for l in ls)
        changes = sum(l["ownership_changes"] for l in ls)
        out[level] = {
            "locks": len(ls),
            "requests": req,
            "requests_per_lock": sorted({l["requests"] for l in ls}),
            "blocked": blocked,
            "blocked_percent": 100.0 * blocked / req if req else 0.0,
            "blocked_percent_range": [min(l["blocked_percent"] for l in ls),
                                      max(l["blocked_percent"] for l in ls)],
            "ownership_changes": changes,
            "ownership_change_percent": 100.0 * changes / acq if acq else 0.0,
            "ownership_change_percent_range": [min(l["ownership_change_percent"] for l in ls),
                                               max(l["ownership_change_percent"] for l in ls)],
            "hold_avg_us": sum(l["hold"]["total_ns"] for l in ls) / acq / 1e3 if acq else 0.0,
            "hold_max_ms": max(l["hold"]["max_ns"] for l in ls) / 1e6,
            "long_holds": sum(holds.get(int(l["lock"], 16), 0) for l in ls),
        }
    return out


# ---- the two comparisons --------------------------------------------------

def syn_cont(args, bins, work):
    it, wk = args.iterations, args.work
    argv = [bins["syn_cont"], str(it), str(wk)]
    levels = syn_cont_lines()
    thr = args.drd_threshold
    r = {"command": f"syn_cont {it} {wk}", "drd_threshold_ms": thr}

    native, none, drd, hg = [], [], [], []
    drd_runs, hg_res = [], None
    for i in range(args.runs):
        walls = []
        for _ in range(NATIVE_REPEAT):
            p, w = command(argv, "syn_cont (native)")
            if "counts correct" not in p.stdout:
                die(f"syn_cont counted wrong natively:\n{p.stdout}")
            walls.append(w)
        native.append(stats.median(walls))
        _, _, _, w = valgrind("none", [], argv, work, "none")
        none.append(w)
        out, err, xml, w = valgrind("drd", [f"--exclusive-threshold={thr}"], argv, work, f"drd-{i}")
        if "counts correct" not in out:
            die(f"syn_cont counted wrong under DRD:\n{out}")
        drd.append(w)
        drd_runs.append(drd_holds(drd_errors(xml), levels))
        out, err, _, w = valgrind("helgrind", [], argv, work, f"helgrind-{i}")
        hg.append(w)
        hg_res = helgrind_report(err) if hg_res is None else hg_res
        log(f"syn_cont run {i + 1}: native {native[-1]:.3f} s, valgrind none {none[-1]:.2f} s, "
            f"DRD {drd[-1]:.2f} s, Helgrind {hg[-1]:.2f} s")
    n = stats.median(native)
    r["native_s"] = n
    for key, walls in (("valgrind_none", none), ("drd", drd), ("helgrind", hg)):
        m = stats.median(walls)
        r[key] = {"wall_s": m, "slowdown": m / n}
    # Per level: the median over the runs, and each run's count.
    per_run = {name: [h[level] for h, _ in drd_runs]
               for name, level in (("level1", 1), ("level2", 2), ("other", 0))}
    other = {}
    for _, o in drd_runs:
        for k, c in o.items():
            other.setdefault(k, []).append(c)
    r["drd"].update({"long_holds": {k: stats.median(v) for k, v in per_run.items()},
                     "long_holds_per_run": per_run,
                     "other_errors": {k: stats.median(v + [0] * (args.runs - len(v)))
                                      for k, v in other.items()}})
    r["helgrind"].update(hg_res)

    cmd = f"syn_cont {it} {wk}"
    plain, probed, rec_wall = [], [], []
    for i in range(args.runs):
        p, _ = insight(["record", "--no-stdin", "-o", os.path.join(work, f"plain-{i}"),
                        "--", "sh", "-c", f"timeit {cmd} >/dev/null"], "record (syn_cont)")
        plain.append(guest_ns(p.stdout))
        p, w = insight(["record", "--no-stdin", "-o", os.path.join(work, f"probed-{i}"),
                        "--", "sh", "-c", f"timeit env {PRELOAD} {cmd} >/dev/null"],
                       "record (syn_cont with probes)")
        probed.append(guest_ns(p.stdout))
        rec_wall.append(w)
        log(f"syn_cont record {i + 1}: guest time without probes {plain[-1] / 1e9:.2f} s, "
            f"with {probed[-1] / 1e9:.2f} s")
    pm, qm = stats.median(plain) / 1e9, stats.median(probed) / 1e9
    ins = {"guest_plain_s": pm, "guest_probed_s": qm, "record_overhead": qm / pm,
           "record_wall_s": stats.median(rec_wall)}
    db = os.path.join(work, "syn_cont.db")
    log("syn_cont: replaying the first probed recording with --events")
    p, w = insight(["replay", "--no-console", os.path.join(work, "probed-0"), "--events", db,
                    "--events-format", "rows"], "replay --events (syn_cont)")
    if "replay matched the recording" not in p.stderr:
        die(f"insight replay of syn_cont did not match its recording:\n{p.stderr[-2000:]}")
    ins["replay_wall_s"] = w
    m = re.search(r"(\d+) events written", p.stderr)
    ins["events"] = int(m.group(1)) if m else None
    p, w = insight(["report", "locks", db, "--json", "--limit", "1000"], "report locks")
    ins["report_wall_s"] = w
    rep = json.loads(p.stdout)
    ins["anomalies"] = rep.get("anomalies", {})
    ins["levels"] = {f"level{k}" if k else "other": v for k, v in
                     level_summary(rep["locks"], long_holds(db, thr * 1_000_000), it).items()}
    for k in ("level1", "level2"):
        if k not in ins["levels"]:
            die(f"insight's lock report has no {k} locks (requests {2 * it} or {8 * it}):\n"
                 f"{p.stdout[:2000]}")
    r["insight"] = ins
    return r


MUTEX_BYTES = 40  # sizeof(pthread_mutex_t) on x86-64 glibc


def paper_proportions(args, work):
    """Syn_cont at the paper's proportions (`comp(); lock(); comp();
    unlock();`, comp() about a millisecond inside and outside both locks):
    one probed recording in the 1-vCPU guest, its lock report beside the
    program's own count of requests that found their lock held."""
    it, wk = args.paper_iterations, args.paper_work
    cmd = ["syn_cont", str(it), str(wk), "0", str(wk)]
    trace = os.path.join(work, "paper")
    p, wall = insight(["record", "--no-stdin", "--probes", "-o", trace, "--"] + cmd,
                      "record (syn_cont, paper proportions)")
    own = {}
    for level, index, acq, held in re.findall(
            r"level-(\d) lock (\d+): (\d+) acquisitions, (\d+) found it held", p.stdout):
        own[(int(level), int(index))] = {"acquisitions": int(acq), "held": int(held)}
    if "counts correct" not in p.stdout or len(own) != 10:
        die(f"syn_cont at the paper's proportions did not count right:\n{p.stdout[-2000:]}")
    db = os.path.join(work, "paper.db")
    log(f"{' '.join(cmd)}: replaying with --events")
    p, _ = insight(["replay", "--no-console", trace, "--events", db], "replay --events (paper)")
    if "replay matched the recording" not in p.stderr:
        die(f"insight replay of syn_cont did not match its recording:\n{p.stderr[-2000:]}")
    p, _ = insight(["report", "locks", db, "--json", "--limit", "1000"], "report locks (paper)")
    locks = []
    for lock in json.loads(p.stdout)["locks"]:
        m = re.fullmatch(r"level([12])(?:\+0x([0-9a-f]+))?", lock.get("name") or "")
        if not m:
            continue
        key = (int(m.group(1)), int(m.group(2) or "0", 16) // MUTEX_BYTES)
        locks.append({"level": key[0], "index": key[1], "requests": lock["requests"],
                      "blocked": lock["blocked"], "own_held": own[key]["held"],
                      "ownership_changes": lock["ownership_changes"]})
    if len(locks) != len(own):
        die(f"insight's report names {len(locks)} of syn_cont's {len(own)} locks")
    levels = {}
    for level in (1, 2):
        ls = [l for l in locks if l["level"] == level]
        req = sum(l["requests"] for l in ls)
        levels[f"level{level}"] = {
            "requests_per_lock": sorted({l["requests"] for l in ls}),
            "blocked_percent": 100.0 * sum(l["blocked"] for l in ls) / req,
            "own_held_percent": 100.0 * sum(l["own_held"] for l in ls) / req,
            "ownership_change_percent": 100.0 * sum(l["ownership_changes"] for l in ls) / req,
            "locks_equal_to_own_count": sum(l["blocked"] == l["own_held"] for l in ls),
            "locks": len(ls),
        }
    log(f"{' '.join(cmd)}: blocked level-1 {levels['level1']['blocked_percent']:.2f} % "
        f"(own count {levels['level1']['own_held_percent']:.2f} %), level-2 "
        f"{levels['level2']['blocked_percent']:.2f} % "
        f"(own count {levels['level2']['own_held_percent']:.2f} %)")
    return {"command": " ".join(cmd), "record_wall_s": wall, "locks": sorted(
        locks, key=lambda l: (l["level"], l["index"])), "levels": levels}


def print_paper(r):
    print(f"### {r['command']}: the paper's proportions\n")
    print("comp() of about a millisecond inside and outside both locks (`syn_cont ITER WORK 0 "
          "INSIDE`), one probed recording in the 1-vCPU guest; beside insight's blocked "
          "requests, the program's own count of the requests that found their lock held "
          "(its lock word read right before each `pthread_mutex_lock`).\n")
    print("| lock | requests | insight: blocked | program: found held | ownership changes |")
    print("|---|---:|---:|---:|---:|")
    for l in r["locks"]:
        print(f"| level-{l['level']} lock {l['index']} | {l['requests']} | {l['blocked']} | "
              f"{l['own_held']} | {l['ownership_changes']} |")
    print("")


def deadlocks(args, bins, work):
    rows = []
    for name, expected, _ in DEADLOCKS:
        argv = [bins[name]]
        p, w = command(argv, f"{name} (native)")
        out, err, _, hw = valgrind("helgrind", [], argv, work, f"hg-{name}")
        hg = helgrind_report(err)
        out, err, xml, dw = valgrind("drd", [], argv, work, f"drd-{name}")
        errs = drd_errors(xml)
        drd_kinds = {}
        for kind, _, count, _, _ in errs:
            drd_kinds[kind] = drd_kinds.get(kind, 0) + count
        rows.append({"program": name, "expected": expected, "native_s": w,
                     "helgrind": dict(hg, wall_s=hw),
                     "drd": {"errors": sum(drd_kinds.values()), "kinds": drd_kinds,
                             "lock_order": 0, "wall_s": dw}})
        log(f"{name}: Helgrind {hg['lock_order']} lock-order report(s) in {hw:.2f} s, "
            f"DRD {sum(drd_kinds.values())} error(s) in {dw:.2f} s")

    script = " && ".join(d[0] for d in DEADLOCKS)
    trace = os.path.join(work, "deadlocks")
    p, rw = insight(["record", "--no-stdin", "-o", trace, "--", "env", PRELOAD, "sh", "-c", script],
                    "record (deadlock programs)")
    if p.stdout.count("no deadlock") != len(DEADLOCKS):
        die(f"the deadlock programs did not all finish in the guest:\n{p.stdout[-2000:]}")
    db = os.path.join(work, "deadlocks.db")
    p, pw = insight(["replay", "--no-console", trace, "--events", db, "--diagnose", "deadlock"],
                    "replay --diagnose deadlock")
    text = p.stdout
    p, _ = insight(["report", "deadlock", db, "--json"], "report deadlock")
    rep = json.loads(p.stdout)
    pids = {int(pid): prog for pid, prog in re.findall(r"^Process (\d+) \((.+)\)$", text, re.M)}
    for row in rows:
        cycles = [c for c in rep["cycles"] if pids.get(c["pid"]) == row["program"]]
        row["insight"] = {
            "deadlocks": sum(1 for c in cycles if not c["protected"]),
            "protected": sum(1 for c in cycles if c["protected"]),
            "cycles": [{"notation": c["notation"], "protected": c["protected"],
                        "gates": c["gates"]} for c in cycles]}
    unknown = [c for c in rep["cycles"] if pids.get(c["pid"]) not in {d[0] for d in DEADLOCKS}]
    return {"programs": rows, "insight_record_wall_s": rw, "insight_replay_wall_s": pw,
            "insight_summary": text.splitlines()[0].split(": ", 1)[-1] if text else "",
            "insight_unattributed_cycles": len(unknown)}


# ---- output ---------------------------------------------------------------

def verdict(found, expected, detects=True):
    if not detects:
        return "false negative" if expected else "correct (no lock-order check)"
    if found == expected:
        return "correct"
    return "false positive" if found > expected else "false negative"


def pct_range(v, key):
    lo, hi = v[key + "_range"]
    return f"{v[key]:.1f} % ({lo:.1f}–{hi:.1f})"


def print_syn(r):
    n = r["native_s"]
    d, h, z, ins = r["drd"], r["helgrind"], r["valgrind_none"], r["insight"]
    thr = r["drd_threshold_ms"]
    print(f"### {r['command']}\n")
    print("| run | time | slowdown | what it reports about the locks |")
    print("|---|---:|---:|---|")
    print(f"| native, host (2 cores) | {n:.3f} s | 1.0x | (nothing) |")
    print(f"| `valgrind --tool=none` | {z['wall_s']:.2f} s | {z['slowdown']:.0f}x | "
          f"(nothing: Valgrind's core alone, threads serialised) |")
    lh, pr = d["long_holds"], d["long_holds_per_run"]

    def holds(key):
        runs = f" (runs: {'/'.join(map(str, pr[key]))})" if len(pr[key]) > 1 else ""
        return f"{lh[key]:g}{runs}"
    other = f", {holds('other')} of libc's or DRD's own mutexes" if lh["other"] else ""
    extra = "".join(f"; {c:g} {k}" for k, c in d["other_errors"].items())
    print(f"| DRD `--exclusive-threshold={thr}` | {d['wall_s']:.2f} s | {d['slowdown']:.0f}x | "
          f"holds > {thr} ms: level 1 {holds('level1')}, level 2 {holds('level2')}{other}{extra}; "
          f"no waiting or contention figures |")
    kinds = "".join(f"{k}; " for k in h["reports"])
    print(f"| Helgrind | {h['wall_s']:.2f} s | {h['slowdown']:.0f}x | {h['errors']} errors "
          f"({kinds}{h['suppressed']} suppressed by Valgrind's default suppressions); "
          f"no contention measure |")
    print(f"| insight record, no probes (guest, 1 vCPU) | {ins['guest_plain_s']:.2f} s guest | "
          f"{ins['guest_plain_s'] / n:.0f}x | (nothing) |")
    print(f"| insight record, probes preloaded | {ins['guest_probed_s']:.2f} s guest | "
          f"{ins['guest_probed_s'] / n:.0f}x ({ins['record_overhead']:.2f}x no probes) | "
          f"{ins['events']} events after replay (below) |")
    print(f"| insight replay `--events` + `report locks` | {ins['replay_wall_s']:.1f} s + "
          f"{ins['report_wall_s']:.1f} s wall | | per lock: requests, blocked, ownership "
          f"changes, hold and wait times |")
    print()
    print("Record wall time with probes, restoring the boot snapshot included: "
          f"{ins['record_wall_s']:.1f} s.\n")
    print(f"| lock level | locks | requests per lock | insight blocked % (range) | "
          f"insight ownership changes % (range) | insight hold avg / max | "
          f"insight holds > {thr} ms (probe time included) | DRD holds > {thr} ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, label in (("level1", "level 1 (2 threads)"), ("level2", "level 2 (8 threads)"),
                       ("other", "other")):
        v = ins["levels"].get(key)
        if not v:
            continue
        print(f"| {label} | {v['locks']} | {', '.join(map(str, v['requests_per_lock']))} | "
              f"{pct_range(v, 'blocked_percent')} | {pct_range(v, 'ownership_change_percent')} | "
              f"{v['hold_avg_us']:.0f} µs / {v['hold_max_ms']:.1f} ms | {v['long_holds']} | "
              f"{lh[key]:g} |")
    print()
    runs = len(d["long_holds_per_run"]["level1"])
    print(f"insight's lock figures are from the first recording with probes, replayed once; "
          f"DRD's counts are medians of {runs} run{'s' if runs > 1 else ''}. Level-1 locks are "
          f"those insight saw requested {ins['levels']['level1']['requests_per_lock'][0]} times, "
          f"level-2 ones {ins['levels']['level2']['requests_per_lock'][0]} times; DRD's reports "
          f"are assigned by the source line of the unlock (or lock) in their stack.\n")


def print_deadlocks(r):
    print("### Potential deadlocks\n")
    print("| program | expected | insight | Helgrind | DRD |")
    print("|---|---|---|---|---|")
    exp = {d[0]: d[2] for d in DEADLOCKS}
    for row in r["programs"]:
        e = row["expected"]
        i = row["insight"]
        cyc = "; ".join(f"`{c['notation']}`" + (f" (protected, gate {c['gates']})"
                                                  if c["protected"] else "") for c in i["cycles"])
        ins = (f"{i['deadlocks']}" + (f" + {i['protected']} protected" if i["protected"] else "")
               + (f": {cyc}" if cyc else "") + f" — **{verdict(i['deadlocks'], e)}**")
        h = row["helgrind"]
        hg = (f"{h['lock_order']}" + (f": {'; '.join(h['reports'])}" if h["reports"] else "")
              + f" — **{verdict(h['lock_order'], e)}**")
        d = row["drd"]
        drd = (f"{d['errors']} errors" + (f" ({', '.join(d['kinds'])})" if d["kinds"] else "")
               + f" — **{verdict(0, e, detects=False)}**")
        print(f"| {row['program']} | {exp[row['program']]} | {ins} | {hg} | {drd} |")
    print()
    times = ", ".join(f"{row['program']} {row['helgrind']['wall_s']:.2f} / {row['drd']['wall_s']:.2f} s"
                      for row in r["programs"])
    print(f"Helgrind / DRD wall times: {times}. insight: one recording of all four "
          f"{r['insight_record_wall_s']:.1f} s, replay with the analysis "
          f"{r['insight_replay_wall_s']:.1f} s (restores of the boot snapshot included). insight's summary: "
          f"\"{r['insight_summary']}\".\n")


def options(ap):
    ap.add_argument("--iterations", type=int, default=1000,
                    help="syn_cont ITER (default 1000: level-1 locks get 2*ITER requests, "
                         "level-2 ones 8*ITER)")
    ap.add_argument("--work", type=int, default=2000, help="syn_cont WORK (default 2000)")
    ap.add_argument("--drd-threshold", type=int, default=1, metavar="MS",
                    help="DRD's --exclusive-threshold, and the hold time insight's holds are "
                         "counted above (default 1 ms: a critical section of syn_cont takes "
                         "microseconds, so a longer hold means its holder was descheduled)")
    ap.add_argument("--paper-iterations", type=int, default=20,
                    help="syn_cont ITER at the paper's proportions (default 20)")
    ap.add_argument("--paper-work", type=int, default=500000,
                    help="syn_cont WORK and INSIDE at the paper's proportions (default 500000, "
                         "about a millisecond of CPU on these hosts)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")


def run(ctx):
    args = ctx.args
    args.runs = ctx.runs
    if args.iterations < 1 or args.work < 0 or args.drd_threshold < 1:
        die("--iterations and --drd-threshold must be at least 1, --work at least 0")
    start = time.monotonic()
    need({"valgrind": "valgrind"})
    work = tempfile.mkdtemp(prefix="insight-bench-locktools-")
    try:
        bins = build_programs(work)
        result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "versions": versions(),
                  "host_cpus": os.cpu_count(), "runs": args.runs}
        mutrace = shutil.which("mutrace")
        result["mutrace"] = (f"installed at {mutrace}, not compared" if mutrace else
                             "not available (not packaged in Debian bookworm)")
        result["syn_cont"] = syn_cont(args, bins, work)
        result["paper_proportions"] = paper_proportions(args, work)
        result["deadlocks"] = deadlocks(args, bins, work)
    finally:
        if args.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["total_s"] = time.monotonic() - start

    v = result["versions"]
    print(f"## insight vs DRD and Helgrind ({v['valgrind']}, gcc {v['gcc']}; insight "
          f"{v['insight_commit']}; host {result['host_cpus']} CPUs, guest 1 vCPU; "
          f"medians of {args.runs} run{'s' if args.runs > 1 else ''})\n")
    print_syn(result["syn_cont"])
    print_paper(result["paper_proportions"])
    print_deadlocks(result["deadlocks"])
    print(f"mutrace: {result['mutrace']}.")
    return Report(rows(result), result)


def rows(result):
    """The result's rows (figures that are medians of the runs): syn_cont's
    costs and the deadlock programs' findings."""
    r = result["syn_cont"]
    ins, native, n = r["insight"], r["native_s"], result["runs"]
    out = [Row.computed(f"{r['command']}: natively, under Valgrind {tool}", r[key]["wall_s"], native,
                        n=n)
           for key, tool in (("valgrind_none", "--tool=none"), ("drd", "DRD"), ("helgrind", "Helgrind"))]
    out.append(Row.computed(f"{r['command']} recorded (guest time): without probes, with",
                            ins["guest_probed_s"], ins["guest_plain_s"], n=n))
    out.append(Row.computed(f"{r['command']}: slowdown over native: DRD, insight record with probes",
                            ins["guest_probed_s"] / native, r["drd"]["slowdown"], unit="x", n=n))
    out.append(Row.computed(f"{r['command']}: replay --events and report locks (wall)",
                            ins["replay_wall_s"] + ins["report_wall_s"]))
    for row in result["deadlocks"]["programs"]:
        out.append(Row.computed(f"{row['program']} (expected {row['expected']}): potential "
                                "deadlocks found by Helgrind, by insight", row["insight"]["deadlocks"],
                                row["helgrind"]["lock_order"], unit="cycles"))
    return out
