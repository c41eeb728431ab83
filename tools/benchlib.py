"""What the benchmark tools share: where things are, building insight,
running it, and reading the guest's timings.

The tools import it from their own directory (Python puts a script's
directory first on sys.path).
"""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSIGHT = os.path.join(REPO, "target", "release", "insight")
TOOL = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "bench"


def die(msg):
    """Stops the tool with `msg`, naming it."""
    sys.exit(f"{TOOL}: {msg}")


def build_insight():
    """Builds the release binary the tools run (INSIGHT)."""
    p = subprocess.run(["cargo", "build", "--release", "-q", "-p", "insight"], cwd=REPO,
                       capture_output=True, text=True)
    if p.returncode != 0:
        die(f"cargo build --release -p insight failed:\n{p.stderr}")


def cache_dir():
    """The guest image cache, as tools/build-guest chooses it."""
    d = os.environ.get("INSIGHT_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "insight")


TIMEIT = re.compile(r"timeit: (\d+) ns")


def guest_ns(text, what="the guest's output"):
    """The nanoseconds the guest's `timeit` printed in `text` (a string
    or a list of lines)."""
    if isinstance(text, list):
        text = "\n".join(text)
    m = TIMEIT.search(text)
    if not m:
        die(f"no timeit line in {what}:\n{text[-2000:]}")
    return int(m.group(1))
