"""Checkpoints and segmented replay, measured side by side in one run.

One recording of two CPU-bound threads (compute_pair, preempted at
asynchronous points while recording) covering at least 60 s of guest time:

  * a replay from boot that takes a checkpoint every INTERVAL of guest time:
    the time to take one, the size of each and of all against guest memory;
  * the last 10 % of the recording: replayed from the latest checkpoint
    before it (--from) against from boot, and the time to restore one;
  * the whole replay: --jobs 2 against --jobs 1 (segments between the
    checkpoints, in separate processes) and against a plain replay.

Usage: tools/bench checkpoints [--seconds S] [--every INTERVAL] [--runs N]
  --seconds S        compute_pair's run time (default 62: over 60 s of
                     guest time; the recording starts from the boot
                     snapshot)
  --every INTERVAL   --checkpoint-every (default 5s)
  --runs N           repetitions of each timed replay (default 2)
Needs a built guest (tools/build-guest).
"""
import re
import tempfile

from . import stats
from .common import die, insight, log, matched
from .stats import Row

TITLE = "Checkpoints and segmented replay"
DURATION = "12.5 min"
RUNS = 2
MEMORY_MIB = 128


def options(ap):
    ap.add_argument("--seconds", type=int, default=62, help="compute_pair's run time (default 62)")
    ap.add_argument("--every", default="5s", help="--checkpoint-every (default 5s)")


def run(ctx):
    with tempfile.TemporaryDirectory(prefix="insight-bench-ckpt-", ignore_cleanup_errors=True) as tmp:
        return measure(ctx, f"{tmp}/trace")


def measure(ctx, trace):
    args = ctx.args
    log(f"recording compute_pair {args.seconds}")
    p, rec_wall = insight(["record", "--no-stdin", "--summary", "-o", trace, "--", "compute_pair",
                           str(args.seconds)])
    m = re.search(r"([\d.]+) s of guest time", p.stderr)
    guest_s = float(m.group(1)) if m else 0.0
    if guest_s < 60:
        log(f"warning: the recording covers {guest_s:.1f} s of guest time, less than 60 s")

    log(f"replaying from boot, a checkpoint every {args.every}")
    p, ckpt_wall = insight(["replay", trace, "--no-console", "--checkpoint-every", args.every])
    matched(p.stderr, "the replay taking checkpoints")
    m = re.search(r"(\d+) checkpoints written to .* \(([\d.]+) MiB in all, (\d+) ms each on average\)",
                  p.stderr)
    if not m:
        die(f"no checkpoint summary:\n{p.stderr[-2000:]}")
    count, total_mib, take_ms = int(m.group(1)), float(m.group(2)), int(m.group(3))
    listing, _ = insight(["replay", trace, "--list-checkpoints"])
    points = []
    for line in listing.stdout.splitlines():
        f = line.split()
        if len(f) == 5 and f[0].isdigit() and f[2] == "s":
            points.append((int(f[0]), float(f[1]), float(f[3])))
    if len(points) < 2:
        die(f"too few checkpoints to compare:\n{listing.stdout}")
    sizes = [s for _, _, s in points]

    # The last 10 %: the latest checkpoint at or before 90 % of guest time.
    target = 0.9 * guest_s
    start = max((p for p in points if p[1] <= target), key=lambda p: p[1], default=points[0])
    restore_s = []

    def last_tenth(side, _):
        extra = ["--from", str(start[0])] if side == "checkpoint" else []
        p, wall = insight(["replay", trace, "--no-console"] + extra)
        matched(p.stderr, f"the replay from {side}")
        m = re.search(r"checkpoints? read in ([\d.]+) s", p.stderr)
        if side == "checkpoint" and m:
            restore_s.append(float(m.group(1)))
        return wall
    last = stats.alternate(["boot", "checkpoint"], ctx.runs, last_tenth)

    def jobs(side, _):
        p, wall = insight(["replay", trace, "--no-console", "--jobs", side])
        matched(p.stderr, f"--jobs {side}")
        return wall
    segments = stats.alternate(["1", "2"], ctx.runs, jobs)

    print(f"One recording: compute_pair {args.seconds}, {guest_s:.1f} s of guest time, recorded in "
          f"{rec_wall:.1f} s; {count} checkpoints every {args.every}, guest memory "
          f"{MEMORY_MIB} MiB; the last 10 % replayed from the checkpoint at {start[1]:.1f} s.")
    return [
        Row("replay taking checkpoints (one), wall: plain replay, taking them", [ckpt_wall], last["boot"]),
        Row.computed("time to take one checkpoint (mean)", take_ms, unit="ms", n=count),
        Row.computed("first checkpoint's size", sizes[0], unit="MiB"),
        Row("the other checkpoints' sizes", sizes[1:], unit="MiB"),
        Row.computed("all the checkpoints: guest memory, their size", total_mib, MEMORY_MIB,
                     unit="MiB"),
        Row("restore (read the chain, set the VM)", restore_s),
        Row("last 10 %: from boot, from the latest checkpoint before it", last["checkpoint"],
            last["boot"]),
        Row("whole replay: --jobs 1, --jobs 2", segments["2"], segments["1"]),
        Row("whole replay: plain from boot, --jobs 1", segments["1"], last["boot"]),
    ]
