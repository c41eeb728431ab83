"""insight against QEMU on the same guest kernel, initramfs and workloads.

Measures, side by side in one run (runs alternate between the tools):
insight starts from its boot snapshot (restored instead of booting; the
snapshot is taken once before the measurements), QEMU boots.

 1. Record/replay: QEMU's record/replay (TCG with instruction counting,
    `-icount shift=auto,rr=record|replay`) against `insight record` and
    `insight replay`, for two workloads:
      boot      boot, run `true`, power off;
      syn_cont  boot, run `syn_cont` (default arguments: 16 threads, 1000
                iterations), power off.
    For each tool: plain run time (`insight run`; QEMU TCG without icount,
    and QEMU TCG with `-icount shift=auto` but no record/replay), record
    time and its slowdown against the tool's own plain run, replay time,
    log size, and log bytes per second of recording. Wall times run from
    process start to exit. Each replay's console output is compared with
    its recording's: syn_cont prints the order in which its threads
    finished, which varies between runs; a faithful replay prints the
    recorded order.

 2. Plain VMM baseline: QEMU with KVM (`-accel kvm`) against `insight run`,
    one boot each running `sh -c 'echo bench-ready; timeit syn_cont'`:
    time from process start to the guest's first output line (boot), and
    syn_cont's run time measured by the guest clock (`timeit`) and by the
    host (arrival of the console lines).

How QEMU boots the guest: tools/benches/qemu_guest.py (the image
`insight run` uses, and the same vmlinux through a multiboot header and a
small loader written into a copy of the ELF file's padding). `--bzimage` boots
the bzImage instead (TCG only, unless --kvm-bzimage-timeout is given).
With KVM the kernel also gets `insight.syscall=pf` (needed where KVM
leaves SYSCALL at CPL3; harmless elsewhere) and QEMU `-cpu
host,-arch-capabilities`.

Usage: tools/bench qemu [--runs N] [--quick] [--probes] [--bzimage]
  --runs N      repetitions of every measurement (default 1, about 5
                minutes here; 3: about 13); figures are medians
  --quick       one run, without the QEMU icount-only runs and the
                QEMU/KVM baseline (about 3 minutes)
  --probes      also record and replay syn_cont with the probe library
                preloaded under insight (QEMU has no equivalent)
The results file (tools/bench --json FILE) holds every sample.
Needs a built guest (tools/build-guest) and qemu-system-x86 (installed
with apt-get when running as root).
"""
import os
import re
import shutil
import subprocess
import tempfile

from .common import PRELOAD, binary, guest_dir, guest_ns, initrd_with_command, log
from .harness import Report
from .qemu_guest import (CMDLINE, KVM_CMDLINE, QEMU, QEMU_CMDLINE, TIMEOUT, console, dir_bytes,
                         ensure_qemu, fail, guest_kernel, kvm_refusal, qemu_argv, run as run_guest)
from .stats import Row, median

TITLE = "QEMU record/replay and QEMU with KVM"
DURATION = "5 min"
RUNS = 1
MARK = "bench-ready"
WORKLOADS = [("boot", ["true"]), ("syn_cont", ["syn_cont"])]
BASELINE = ["sh", "-c", f"echo {MARK}; timeit syn_cont >/dev/null"]
KVM_TIMEOUT = 300


def options(ap):
    ap.add_argument("--quick", action="store_true", help="one run, record/replay comparison only")
    ap.add_argument("--probes", action="store_true", help="also syn_cont with the probe library (insight)")
    ap.add_argument("--bzimage", action="store_true", help="QEMU boots the bzImage instead of vmlinux")
    ap.add_argument("--kvm-bzimage-timeout", type=int, metavar="S",
                    help="with --bzimage: also try QEMU/KVM, giving up after S seconds")


def insight_argv(mode, argv, trace=None):
    if mode == "replay":
        return [binary(), "replay", trace]
    out = ["-o", trace] if trace else []
    return [binary(), mode, "--no-stdin"] + out + ["--"] + argv


def finish_order(text):
    m = next((re.search(r"finish order: ([\d ]+)", l) for l in text if "finish order" in l), None)
    return m.group(1).strip() if m else None


def compare(record, replay):
    """None when the replay printed what its recording printed, else the first difference."""
    a = [l for l in console(record) if l.strip()]
    b = [l for l in console(replay) if l.strip()]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"line {i + 1}: recorded {x!r}, replayed {y!r}"
    if len(a) != len(b):
        return f"recorded {len(a)} lines, replayed {len(b)}"
    return None


def baseline(what, argv, timeout):
    """(first output s, guest-timed syn_cont s, host-observed syn_cont s) of one boot,
    or (None, seconds until QEMU stopped, reason) when KVM could not run the guest."""
    wall, lines, err = run_guest(what, argv, timeout=timeout, ok=None)
    reason = kvm_refusal(err)
    if reason:
        return None, wall, reason
    first = next((t for t, l in lines if MARK in l), None)
    done = next((t for t, l in lines if "timeit:" in l), None)
    if first is None or done is None:
        fail(f"{what}: no '{MARK}' or timeit line", argv, 0, "".join(l for _, l in lines[-20:]))
    return first, guest_ns(console(lines), what) / 1e9, done - first


def run(ctx):
    args = ctx.args
    runs = 1 if args.quick else ctx.runs
    guest = guest_dir()
    ensure_qemu()
    qemu_version = subprocess.run([QEMU, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    insight_version = subprocess.run([binary(), "--version"], capture_output=True, text=True).stdout.strip()
    kvm_ok = os.access("/dev/kvm", os.R_OK | os.W_OK)
    do_kvm = kvm_ok and not args.quick and (not args.bzimage or args.kvm_bzimage_timeout)

    tmp = tempfile.mkdtemp(prefix="insight-bench-qemu-")
    try:
        qcmd = {"tcg": CMDLINE + QEMU_CMDLINE, "kvm": CMDLINE + QEMU_CMDLINE + KVM_CMDLINE}
        kernels = {}
        if args.bzimage:
            kernels["tcg"] = kernels["kvm"] = os.path.join(guest, "bzImage")
        else:
            for kind in ("tcg", "kvm"):
                kernels[kind] = guest_kernel(guest, qcmd[kind], os.path.join(tmp, f"vmlinux-{kind}"))
        initrds = {}
        for name, argv in WORKLOADS + [("baseline", BASELINE)]:
            os.makedirs(os.path.join(tmp, name))
            initrds[name] = initrd_with_command(guest, argv, os.path.join(tmp, name, "initrd"))

        workloads = list(WORKLOADS)
        if args.probes:
            workloads.append(("syn_cont+probes", ["env", PRELOAD, "syn_cont"]))
        res = {name: {} for name, _ in workloads}

        def add(name, key, value):
            res[name].setdefault(key, []).append(value)

        # insight restores the guest from its boot snapshot; the first run
        # of an image takes it, once, before anything is measured.
        wall, _, _ = run_guest("insight run (taking the boot snapshot)", insight_argv("run", ["true"]))
        log(f"boot snapshot ready ({wall:.1f} s)")
        for i in range(runs):
            log(f"run {i + 1} of {runs}")
            for name, argv in workloads:
                # insight: run, record, replay.
                wall, _, _ = run_guest(f"insight run ({name})", insight_argv("run", argv))
                add(name, "insight_run_s", wall)
                trace = os.path.join(tmp, f"insight-{name}-{i}")
                wall, rec, _ = run_guest(f"insight record ({name})", insight_argv("record", argv, trace))
                add(name, "insight_record_s", wall)
                add(name, "insight_log_bytes", dir_bytes(trace))
                add(name, "insight_log_bytes_per_s", dir_bytes(trace) / wall)
                wall, rep, err = run_guest(f"insight replay ({name})", insight_argv("replay", argv, trace))
                add(name, "insight_replay_s", wall)
                diff = compare(rec, rep)
                add(name, "insight_replay_matches", diff is None)
                add(name, "insight_finish_order", finish_order(console(rec)))
                if diff:
                    log(f"  insight replay of {name} printed something else: {diff}")
                log(f"  {name}: insight run {res[name]['insight_run_s'][-1]:.1f} s, record "
                    f"{res[name]['insight_record_s'][-1]:.1f} s, replay {wall:.1f} s, "
                    f"log {res[name]['insight_log_bytes'][-1]} B, replay "
                    f"{'matches' if diff is None else 'DIFFERS'}")
                if name not in initrds:
                    continue  # insight only
                # QEMU TCG: plain, icount only, record, replay.
                k, rd, cl = kernels["tcg"], initrds[name], qcmd["tcg"]
                wall, _, _ = run_guest(f"qemu tcg ({name})", qemu_argv(k, rd, cl, "tcg"), timeout=300)
                add(name, "qemu_run_s", wall)
                if not args.quick:
                    wall, _, _ = run_guest(f"qemu tcg icount ({name})", qemu_argv(k, rd, cl, "shift=auto"), timeout=300)
                    add(name, "qemu_icount_s", wall)
                rr = os.path.join(tmp, f"qemu-{name}-{i}.rr")
                wall, rec, _ = run_guest(f"qemu record ({name})",
                                         qemu_argv(k, rd, cl, f"shift=auto,rr=record,rrfile={rr}"), timeout=300)
                add(name, "qemu_record_s", wall)
                add(name, "qemu_log_bytes", dir_bytes(rr))
                add(name, "qemu_log_bytes_per_s", dir_bytes(rr) / wall)
                wall, rep, _ = run_guest(f"qemu replay ({name})",
                                         qemu_argv(k, rd, cl, f"shift=auto,rr=replay,rrfile={rr}"), timeout=300)
                add(name, "qemu_replay_s", wall)
                diff = compare(rec, rep)
                add(name, "qemu_replay_matches", diff is None)
                add(name, "qemu_finish_order", finish_order(console(rec)))
                if diff:
                    log(f"  QEMU replay of {name} printed something else: {diff}")
                log(f"  {name}: qemu run {res[name]['qemu_run_s'][-1]:.1f} s, record "
                    f"{res[name]['qemu_record_s'][-1]:.1f} s, replay {wall:.1f} s, "
                    f"log {res[name]['qemu_log_bytes'][-1]} B, replay "
                    f"{'matches' if diff is None else 'DIFFERS'}")
            if do_kvm:
                b = res.setdefault("baseline", {})
                first, gns, host = baseline("insight run (baseline)", insight_argv("run", BASELINE), TIMEOUT)
                for key, v in (("insight_first_output_s", first), ("insight_syn_cont_guest_s", gns),
                               ("insight_syn_cont_host_s", host)):
                    b.setdefault(key, []).append(v)
                qto = args.kvm_bzimage_timeout or KVM_TIMEOUT
                if b.get("qemu_kvm_failure"):
                    continue  # it will not boot this time either
                first, gns, host = baseline("qemu kvm (baseline)",
                                            qemu_argv(kernels["kvm"], initrds["baseline"],
                                                      qcmd["kvm"], "kvm"), qto)
                if first is None:
                    b["qemu_kvm_failure"] = [f"{host} ({gns:.1f} s after start)"]
                    log(f"  baseline: QEMU/KVM cannot run the guest here: {host}")
                    continue
                for key, v in (("qemu_kvm_first_output_s", first), ("qemu_kvm_syn_cont_guest_s", gns),
                               ("qemu_kvm_syn_cont_host_s", host)):
                    b.setdefault(key, []).append(v)
                log(f"  baseline: first output insight {b['insight_first_output_s'][-1]:.1f} s, "
                    f"qemu-kvm {first:.1f} s; syn_cont (guest clock) insight "
                    f"{b['insight_syn_cont_guest_s'][-1]:.2f} s, qemu-kvm {gns:.2f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    return report(res, runs, args, qemu_version, insight_version, kvm_ok)


def report(res, runs, args, qemu_version, insight_version, kvm_ok):
    def m(name, key):
        return median(res.get(name, {}).get(key, []))

    def s(x, digits=1):
        return "—" if x is None else f"{x:.{digits}f} s"

    def ratio(a, b):
        return "—" if a is None or b is None else f"{a / b:.2f}x"

    def size(b):
        return "—" if b is None else (f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b:.0f} B")

    def rate(b):
        return "—" if b is None else f"{b / 1024:.2f} KiB/s"

    def matched(name, tool):
        v = res.get(name, {}).get(f"{tool}_replay_matches", [])
        return "—" if not v else ("yes" if all(v) else f"no ({v.count(False)} of {len(v)})")

    def orders(name, tool):
        o = [x for x in res.get(name, {}).get(f"{tool}_finish_order", []) if x]
        return len(set(o)), len(o)

    print(f"insight vs QEMU, medians of {runs} run(s); {qemu_version}; {insight_version}")
    print()
    print("| workload | tool | plain run | record | record / plain | replay | replay / record "
          "| log | log per s of recording | replay output = record |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in res:
        if name == "baseline":
            continue
        r = res[name]
        ir, ic, ip = m(name, "insight_run_s"), m(name, "insight_record_s"), m(name, "insight_replay_s")
        print(f"| {name} | insight | {s(ir)} | {s(ic)} | **{ratio(ic, ir)}** | {s(ip)} | {ratio(ip, ic)} "
              f"| {size(m(name, 'insight_log_bytes'))} | {rate(m(name, 'insight_log_bytes_per_s'))} "
              f"| {matched(name, 'insight')} |")
        if "qemu_run_s" not in r:
            continue
        qr, qc, qp = m(name, "qemu_run_s"), m(name, "qemu_record_s"), m(name, "qemu_replay_s")
        qi = m(name, "qemu_icount_s")
        print(f"| {name} | QEMU TCG | {s(qr)} | {s(qc)} | **{ratio(qc, qr)}** | {s(qp)} | {ratio(qp, qc)} "
              f"| {size(m(name, 'qemu_log_bytes'))} | {rate(m(name, 'qemu_log_bytes_per_s'))} "
              f"| {matched(name, 'qemu')} |")
        if qi is not None:
            print(f"| {name} | QEMU TCG, -icount only | {s(qi)} | | {ratio(qi, qr)} | | | | | |")
        print(f"| {name} | **insight / QEMU** | {ratio(ir, qr)} | {ratio(ic, qc)} | | {ratio(ip, qp)} | "
              f"| {ratio(m(name, 'insight_log_bytes'), m(name, 'qemu_log_bytes'))} | | |")
    for name in res:
        for tool in ("insight", "qemu"):
            n, total = orders(name, tool)
            if total > 1:
                print(f"\n{name}: {tool} recorded {n} different finish orders in {total} runs")
    b = res.get("baseline")
    if b:
        print()
        print("| plain VMM, one boot running `echo; timeit syn_cont` | insight run | QEMU KVM | insight / QEMU |")
        print("|---|---|---|---|")
        for label, key, d in (("start to first guest output (boot)", "first_output_s", 1),
                              ("syn_cont, guest clock (timeit)", "syn_cont_guest_s", 2),
                              ("syn_cont, host-observed (console lines)", "syn_cont_host_s", 2)):
            a, q = m("baseline", f"insight_{key}"), m("baseline", f"qemu_kvm_{key}")
            print(f"| {label} | {s(a, d)} | {s(q, d)} | **{ratio(a, q)}** |")
        if b.get("qemu_kvm_failure"):
            print(f"\nQEMU/KVM did not boot the guest: {b['qemu_kvm_failure'][0]}")
    elif not kvm_ok:
        print("\nQEMU/KVM baseline skipped: /dev/kvm is not accessible")
    rows = []
    for name, r in res.items():
        if name == "baseline" or "qemu_run_s" not in r:
            continue
        for label, key in (("plain run", "run_s"), ("record", "record_s"), ("replay", "replay_s")):
            rows.append(Row(f"{name}, {label} (wall): QEMU TCG, insight", r[f"insight_{key}"],
                            r[f"qemu_{key}"]))
        rows.append(Row(f"{name}, log size: QEMU, insight", [b / 1024 for b in r["insight_log_bytes"]],
                        [b / 1024 for b in r["qemu_log_bytes"]], unit="KiB"))
        rows.append(Row(f"{name}, record / plain run: QEMU TCG, insight",
                        [c / p for c, p in zip(r["insight_record_s"], r["insight_run_s"])],
                        [c / p for c, p in zip(r["qemu_record_s"], r["qemu_run_s"])], unit="x"))
    for name, r in res.items():
        if name != "baseline" and "qemu_run_s" not in r:
            for label, key in (("plain run", "run_s"), ("record", "record_s"), ("replay", "replay_s")):
                rows.append(Row(f"{name}, {label} (wall)", r[f"insight_{key}"]))
    b = res.get("baseline", {})
    for label, key in (("start to first guest output (boot)", "first_output_s"),
                       ("syn_cont, guest clock (timeit)", "syn_cont_guest_s"),
                       ("syn_cont, host-observed (console lines)", "syn_cont_host_s")):
        if b.get(f"insight_{key}"):
            rows.append(Row(f"plain VMM, {label}: QEMU KVM, insight run", b[f"insight_{key}"],
                            b.get(f"qemu_kvm_{key}") or None))
    return Report(rows, {"qemu_version": qemu_version, "insight_version": insight_version,
                         "qemu_kernel": "bzImage" if args.bzimage else "vmlinux (multiboot loader)",
                         "samples": res})
