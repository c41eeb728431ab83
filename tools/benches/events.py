"""Costs of events, measured side by side in one run.

  * probe overhead while recording: syn_cont 1000 2000 under `insight
    record`, without the probe library, with it (events through the gate,
    free while recording), and with it raising every event as a VM exit
    (INSIGHT_PROBES=port, as before the gate), alternating, timed inside
    the guest; every variant runs through `env`, so that all pay the same
    extra exec;
  * replay time with events: one recording of syn_cont with probes,
    replayed plainly, with the event database only (explicit events,
    through the event ring, and with an exit per event as before it,
    --event-exits), and with sampling every 1, 5 and 20 ms (the shape of
    the paper's Table 2), alternating; wall times as ratios to the plain
    replay, and the replay with events against the recording's own wall
    time (`insight record`, boot snapshot restore included, as replay's);
  * event database size: bytes per lock event (the database of explicit
    events over its event count) and per SAMPLE (what sampling adds over
    the samples it took), in the default packed format and, for
    comparison, with one SQL row per event (--events-format rows);
  * whole stacks: the same replays with user stacks unwound by call-frame
    information (the default) and by frame pointers (--unwind
    frame-pointers), replay time at 1 ms sampling and the bytes the
    stacks of lock events and samples take in the packed blocks.

Usage: tools/bench events [--runs N]
Needs a built guest (tools/build-guest).
"""
import os
import re
import sqlite3
import tempfile

from . import stats
from .common import PRELOAD, die, guest_ns, insight
from .stats import BEST, Row

TITLE = "Events"
DURATION = "about 5 min"
RUNS = 3

SYN = "syn_cont 1000 2000"
PERIODS = ["1ms", "5ms", "20ms"]


def counts(stderr):
    """(events, samples) from replay's summary line."""
    m = re.search(r"(\d+) events written to .*?\((.*)\)", stderr)
    if not m:
        die(f"no event summary in:\n{stderr}")
    s = re.search(r"(\d+) SAMPLE", m.group(2))
    return int(m.group(1)), int(s.group(1)) if s else 0


def block_bytes(db):
    """Bytes of the packed event blocks (stacks included) in `db`."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute("SELECT coalesce(sum(length(data)), 0) FROM event_blocks").fetchone()[0]
    finally:
        con.close()


def run(ctx):
    with tempfile.TemporaryDirectory(prefix="insight-bench-events-", ignore_cleanup_errors=True) as tmp:
        return measure(ctx.runs, tmp)


def measure(runs, tmp):
    rows = []
    variants = [("plain", ""), ("probed", PRELOAD), ("exits", f"{PRELOAD} INSIGHT_PROBES=port")]
    envs = dict(variants)

    def record(v, i):
        p, _ = insight(["record", "--no-stdin", "-o", os.path.join(tmp, f"{v}-{i}"),
                        "--", "sh", "-c", f"timeit env {envs[v]} {SYN} >/dev/null"])
        return guest_ns(p.stdout) / 1e9
    times = stats.alternate(list(envs), runs, record)
    rows.append(Row(f"record, {SYN} (guest time): without probes, with", times["probed"], times["plain"]))
    # The guest's time is the host's: a busy host slows single runs, never
    # speeds them up, so the fastest of each is the least disturbed.
    rows.append(Row(f"record, {SYN} (guest time): without probes, with; fastest runs",
                    times["probed"], times["plain"], statistic=BEST))
    rows.append(Row(f"record, {SYN} (guest time): without probes, with an exit per event "
                    "(INSIGHT_PROBES=port)", times["exits"], times["plain"]))

    trace = os.path.join(tmp, "probed-0")
    # A recording against its replays, as users run them: the probed
    # command alone, `insight record` and `insight replay --events`, wall
    # clock (boot snapshot restores included), alternating.
    recorded = os.path.join(tmp, "rec")

    def pair(mode, i):
        if mode == "record":
            _, wall = insight(["record", "--no-stdin", "--probes", "-o", f"{recorded}-{i}",
                               "--", *SYN.split()])
            return wall
        extra = ["--event-exits"] if mode == "replay exits" else []
        _, wall = insight(["replay", "--no-console", f"{recorded}-0", "--events",
                           os.path.join(tmp, f"rec-{i}.db"), "--force"] + extra)
        return wall
    walls = stats.alternate(["record", "replay", "replay exits"], runs, pair)
    for mode, how in [("replay", "through the event ring"), ("replay exits", "an exit per event")]:
        rows.append(Row(f"`insight replay --events` of `record --probes -- {SYN}` ({how}), wall: "
                        "its recording, the replay", walls[mode], walls["record"]))

    modes = [("plain", [])] + [("events", ["--events", None]),
                               ("events, exit per event", ["--events", None, "--event-exits"])] + \
            [(f"sampling {p}", ["--events", None, "--sample-period", p]) for p in PERIODS] + \
            [("rows", ["--events", None, "--events-format", "rows"]),
             ("rows sampling 1ms", ["--events", None, "--events-format", "rows", "--sample-period", "1ms"]),
             ("events fp", ["--events", None, "--unwind", "frame-pointers"]),
             ("sampling 1ms fp", ["--events", None, "--sample-period", "1ms", "--unwind", "frame-pointers"])]
    extras = dict(modes)
    dbs = {}
    summaries = {}

    def replay(mode, i):
        db = os.path.join(tmp, f"{mode.replace(' ', '-')}-{i}.db")
        argv = ["replay", "--no-console", trace] + [db if a is None else a for a in extras[mode]]
        p, wall = insight(argv)
        if extras[mode]:
            dbs[mode] = db
            summaries[mode] = counts(p.stderr)
        return wall
    walls = stats.alternate(list(extras), runs, replay)
    for mode, _ in modes[1:6]:
        rows.append(Row(f"replay with {mode}: plain replay, with", walls[mode], walls["plain"]))
        if mode.startswith("sampling"):
            print(f"- replay with {mode}: {summaries[mode][1]} samples")

    for label, events, sampled in [("packed", "events", "sampling 1ms"),
                                   ("rows", "rows", "rows sampling 1ms")]:
        ev_total, _ = summaries[events]
        ev_size = os.path.getsize(dbs[events])
        rows.append(Row.computed(f"event database ({label}), explicit events (lock events "
                                 "dominate)", ev_size / ev_total, unit="B/event"))
        print(f"- event database ({label}): {ev_size} B for {ev_total} explicit events")
        s_total, samples = summaries[sampled]
        s_size = os.path.getsize(dbs[sampled])
        if samples > 0:
            rows.append(Row.computed(f"event database ({label}), SAMPLE events (with their stacks)",
                                     (s_size - ev_size) / samples, unit="B/sample"))
            print(f"- event database ({label}): {s_size - ev_size} B more for {samples} samples")

    rows.append(Row("replay with sampling every 1 ms: stacks by frame pointers, by call-frame "
                    "information", walls["sampling 1ms"], walls["sampling 1ms fp"]))
    for label, events, sampled in [("call-frame information", "events", "sampling 1ms"),
                                   ("frame pointers", "events fp", "sampling 1ms fp")]:
        ev_total, _ = summaries[events]
        ev_blocks = block_bytes(dbs[events])
        _, samples = summaries[sampled]
        s_blocks = block_bytes(dbs[sampled])
        rows.append(Row.computed(f"packed blocks, explicit events, stacks by {label}",
                                 ev_blocks / ev_total, unit="B/event"))
        print(f"- packed blocks, stacks by {label}: {ev_blocks} B for {ev_total} events")
        if samples > 0:
            rows.append(Row.computed(f"packed blocks, SAMPLE events, stacks by {label}",
                                     (s_blocks - ev_blocks) / samples, unit="B/sample"))
            print(f"- packed blocks, stacks by {label}: {s_blocks - ev_blocks} B more for {samples} "
                  "samples")
    return rows
