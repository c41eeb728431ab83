"""Network costs of recording, measured side by side in one run.

  * TCP throughput host -> guest: a 20 MiB stream from the host side of a
    TAP device to `tcp_sink` in the guest, under `insight run` and under
    `insight record`, alternating; timed in the guest from the first byte
    to the end of the stream (the guest clock is the host's monotonic
    clock in both modes);
  * trace bytes per received byte: the recording's trace (events and
    payloads) over the bytes of the stream;
  * UDP datagrams received, run vs record: two senders on the host side
    send 140-byte datagrams to `udp_sink` in the guest at a fixed total
    rate (100, 500 and 2,000 per second by default) for a fixed count,
    then "end" each; the guest counts what reached the program. UDP does
    not retransmit: what the guest drops is lost, so recording must
    receive what a plain run receives.

Every run gets a network namespace of its own (a TAP device insight
creates in it, 10.0.2.2 on the host side, 10.0.2.15 in the guest); no
packet leaves it. The namespace's TCP congestion control is Reno: BBR, a
common host default, paces the sender to the ACK clock of a guest whose
kernel is interpreted, and would measure the pacing instead.

Usage: tools/bench net [--runs N] [--mib M] [--udp-rates R,R,...] [--udp-seconds S]
                       [--only tcp|udp]
Needs root, iproute2 and a built guest (tools/build-guest).
"""
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from .common import binary, die, log, trace_bytes
from .stats import Row

TITLE = "Network"
DURATION = "15 min"
RUNS = 3

GUEST = "10.0.2.15"


def sh(*args):
    subprocess.run(list(args), check=True, capture_output=True)


@contextlib.contextmanager
def namespace(tag):
    """A network namespace of this run's own (loopback up, Reno), deleted
    afterwards; yields its name."""
    ns = f"insight-bench-{os.getpid()}-{tag}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_congestion_control=reno")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def start_listening(ns, mode, command, tmp, trace, files=(), wait=180):
    """Starts `insight run` (mode "run") or `insight record -o trace` in
    namespace `ns`, its guest running `command` with a TAP device and
    `files` ((host path, guest path) each), and waits up to `wait` seconds
    for the guest to print "listening"; returns the process and the output
    so far."""
    cfg = os.path.join(tmp, "vm.toml")
    with open(cfg, "w") as f:
        f.write(f'command = "{command}"\n')
        for host, guest in files:
            f.write(f'[[files]]\nhost = "{host}"\nguest = "{guest}"\n')
        f.write(f'[net]\ntap = "insight0"\nguest_address = "{GUEST}/24"\n'
                f'host_address = "10.0.2.2/24"\n')
    args = ["run"] if mode == "run" else ["record", "-o", trace]
    p = subprocess.Popen(["ip", "netns", "exec", ns, binary()] + args + ["--no-stdin", cfg],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out = ""
    deadline = time.monotonic() + wait
    while "listening" not in out:
        line = p.stdout.readline()
        if not line or time.monotonic() > deadline:
            p.kill()
            die(f"the guest never listened:\n{out}{p.stderr.read()}")
        out += line
    return p, out


def transfer(mode, data, tmp, i):
    """One run: returns (guest ns, trace bytes or None)."""
    with namespace(f"{mode}-{i}") as ns:
        trace = os.path.join(tmp, f"trace-{i}")
        p, out = start_listening(ns, mode, "tcp_sink 5001", tmp, trace)
        sh("ip", "netns", "exec", ns, "bash", "-c", f"cat {data} > /dev/tcp/{GUEST}/5001")
        rest, err = p.communicate(timeout=900)
        out += rest
        if p.returncode != 0:
            die(f"insight {mode} failed ({p.returncode}):\n{out}{err}")
        m = re.search(r"tcp_sink: received in (\d+) ns", out)
        if not m:
            die(f"no timing in guest output:\n{out}")
        size = None
        if mode == "record":
            size = trace_bytes(trace)
            shutil.rmtree(trace, ignore_errors=True)
        return int(m.group(1)), size


def tcp_rows(mib, runs, tmp):
    data = os.path.join(tmp, "bulk")
    with open(data, "wb") as f:
        f.write(os.urandom(mib << 20))
    nbytes = mib << 20
    live, rec, sizes = [], [], []
    for i in range(runs):
        ns, _ = transfer("run", data, tmp, i)
        live.append(ns / 1e9)
        ns, size = transfer("record", data, tmp, i)
        rec.append(ns / 1e9)
        sizes.append(size / nbytes)
        log(f"TCP run {i + 1}: run {nbytes / live[-1] / 1e6:.2f} MB/s, "
            f"record {nbytes / rec[-1] / 1e6:.2f} MB/s")
    return [
        Row(f"TCP host -> guest, {mib} MiB, time in the guest: run, record", rec, live),
        Row("trace bytes per received byte", sizes, unit="B/B"),
    ]


# One sender: COUNT datagrams of 140 bytes to the guest, one every PERIOD
# seconds on an absolute schedule (so that a late wake-up does not slow
# the rate), then "end".
SENDER = r"""
import socket, sys, time
tag, count, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
start = time.monotonic()
for i in range(count):
    delay = start + i * period - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    s.sendto(f"{tag} {i:06d} ".encode().ljust(139, b".") + b"\n", ("%s", 5000))
s.sendto(b"end\n", ("%s", 5000))
""" % (GUEST, GUEST)


def udp_receive(mode, rate, seconds, tmp, i):
    """One run: two senders at `rate` datagrams per second in total for
    `seconds`; returns (datagrams sent, datagrams the guest received,
    frames insight reports it dropped because the guest took none)."""
    per_sender = rate * seconds // 2
    with namespace(f"udp{mode}-{i}") as ns:
        trace = os.path.join(tmp, f"udp-trace-{i}")
        p, out = start_listening(ns, mode, "udp_sink 5000 2 /tmp/got 10", tmp, trace)
        senders = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SENDER,
                                     tag, str(per_sender), str(2 / rate)])
                   for tag in ("a", "b")]
        for s in senders:
            if s.wait(timeout=seconds + 60) != 0:
                p.kill()
                die("a UDP sender failed")
        rest, err = p.communicate(timeout=900)
        out += rest
        m = re.search(r"udp_sink: (\d+) datagrams", out)
        if not m:
            die(f"udp_sink printed no count ({mode}, exit status "
                     f"{p.returncode}):\n{out}{err}")
        d = re.search(r"(\d+) received frames were dropped", err)
        shutil.rmtree(trace, ignore_errors=True)
        return 2 * per_sender + 2, int(m.group(1)), int(d.group(1)) if d else 0


def udp_rows(rates, seconds, runs, tmp):
    rows = []
    for rate in rates:
        live, rec = [], []
        for i in range(runs):
            sent, got, dropped_run = udp_receive("run", rate, seconds, tmp, i)
            live.append(got)
            sent, got, dropped_rec = udp_receive("record", rate, seconds, tmp, i)
            rec.append(got)
            log(f"UDP {rate}/s run {i + 1}: {sent} sent; received: run {live[-1]}, "
                f"record {rec[-1]}; dropped by insight: run {dropped_run}, record {dropped_rec}")
        rows.append(Row(f"UDP host -> guest, {rate} datagrams/s, {sent} sent: received, run, record",
                        rec, live, unit="datagrams"))
    return rows


def options(ap):
    ap.add_argument("--mib", type=int, default=20, help="MiB of the TCP stream (default 20)")
    ap.add_argument("--udp-rates", default="100,500,2000",
                    help="total datagrams per second of the UDP rows, comma-separated")
    ap.add_argument("--udp-seconds", type=int, default=2,
                    help="how long each UDP row's senders send")
    ap.add_argument("--only", choices=["tcp", "udp"], help="run only the TCP or the UDP rows")


def run(ctx):
    args = ctx.args
    rates = [int(r) for r in args.udp_rates.split(",") if r]
    if any(r < 2 for r in rates) or args.udp_seconds < 1:
        die("UDP rates must be at least 2 per second, and --udp-seconds at least 1")
    if os.geteuid() != 0:
        die("needs root (network namespaces, TAP devices)")
    tmp = tempfile.mkdtemp(prefix="insight-bench-net-")
    rows = []
    try:
        if args.only != "udp":
            rows += tcp_rows(args.mib, ctx.runs, tmp)
        if args.only != "tcp":
            rows += udp_rows(rates, args.udp_seconds, ctx.runs, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows
