"""tools/bench compare REV_A REV_B NAME... [options]: two revisions of
insight side by side, as Firecracker's ab_test.py does.

Each revision is checked out in a temporary git work tree (outside the
repository, removed afterwards) and its insight built there, into a
shared target directory in the cache (crates.io dependencies built once;
each binary copied out as soon as it is built). Then each benchmark runs
--runs rounds (default: the benchmark's runs, at least 3), a round being
one run of it (--runs 1) with A's insight, then one with B's, each
revision with a boot snapshot cache of its own. The rows of A's runs
against B's give each figure's median in A and in B, B/A, both spreads,
and whether they differ beyond the noise (stats.separation).

The benchmarks themselves, the programs they build and the guest image
are this checkout's, the same for both: the comparison is of insight. A
revision whose guest inputs (guest-kernel-patches/, images/, probes/)
differ from the other's is compared on this checkout's guest all the
same, which the output says.
"""
import os
import shutil
import subprocess
import tempfile
import time

from . import common, harness, stats
from .selection import Selection, usage_error

GUEST_INPUTS = ["guest-kernel-patches", "images", "probes", "tools/build-guest"]


def git(*args, check=True):
    p = subprocess.run(["git", "-C", common.REPO] + list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        common.die(f"git {' '.join(args)} failed:\n{p.stderr.strip()}")
    return p


class Revision:
    """One side: its revision, its work tree, its insight binary and its
    boot snapshot cache."""

    def __init__(self, label, rev, tmp):
        self.label, self.rev = label, rev
        self.commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").stdout.strip()
        self.tree = os.path.join(tmp, f"tree-{label.lower()}")
        self.binary = os.path.join(tmp, f"insight-{label.lower()}")
        self.snapshots = os.path.join(tmp, f"snapshots-{label.lower()}")
        self.warm = False

    def describe(self):
        return f"{self.rev} ({self.commit[:12]})"

    def build(self, target):
        common.log(f"{self.label} = {self.describe()}: work tree and release build")
        git("worktree", "add", "--detach", "--quiet", self.tree, self.commit)
        built = common.build_insight(self.tree, target)
        shutil.copy2(built, self.binary)

    def activate(self):
        """Makes this side's insight the one the benchmarks run."""
        common.use_binary(self.binary)
        os.environ["INSIGHT_SNAPSHOT_DIR"] = self.snapshots
        if not self.warm:
            common.warm_boot_snapshot()
            self.warm = True

    def remove(self):
        if os.path.isdir(self.tree):
            git("worktree", "remove", "--force", self.tree, check=False)


def merge(reports):
    """One set of rows from the reports of several runs of a benchmark:
    each row's samples over all of them (a computed figure's too: one a
    run)."""
    rows = {}
    for report in reports:
        for r in report.rows:
            if r.name not in rows:
                rows[r.name] = stats.Row(r.name, [], None if r.baseline is None else [], r.unit,
                                         r.statistic)
            m = rows[r.name]
            m.insight += r.insight
            if r.baseline is not None and m.baseline is not None:
                m.baseline += r.baseline
    for m in rows.values():
        m.n = len(m.insight)
    return list(rows.values())


def main(tokens):
    if len(tokens) < 3 or tokens[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if tokens[:1] in (["-h"], ["--help"]) else 2
    rev_a, rev_b = tokens[:2]
    try:
        sel = Selection(tokens[2:])
    except KeyError as e:
        return usage_error(f"no benchmark {e}")
    if not sel.chosen:
        return usage_error("name one benchmark or more to compare (tools/bench --list)")
    tmp = tempfile.mkdtemp(prefix="insight-bench-compare-")
    sides = []
    saved_env = os.environ.get("INSIGHT_SNAPSHOT_DIR")
    try:
        sides = [Revision("A", rev_a, tmp), Revision("B", rev_b, tmp)]
        return compare(sel, sides)
    except common.BenchError as e:
        common.log(str(e))
        return 2
    finally:
        for side in sides:
            side.remove()
        git("worktree", "prune", check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        if saved_env is None:
            os.environ.pop("INSIGHT_SNAPSHOT_DIR", None)
        else:
            os.environ["INSIGHT_SNAPSHOT_DIR"] = saved_env


def compare(sel, sides):
    a, b = sides
    start = time.monotonic()
    target = os.path.join(common.cache_dir(), "bench", "target")
    for side in sides:
        side.build(target)
    guest_differs = git("diff", "--quiet", a.commit, b.commit, "--", *GUEST_INPUTS,
                        check=False).returncode != 0
    results = harness.header()
    results.update({"a": {"rev": a.rev, "commit": a.commit}, "b": {"rev": b.rev, "commit": b.commit},
                    "compare": {}})
    print(f"A = {a.describe()}, B = {b.describe()}; {results['host']}")
    if guest_differs:
        print("The revisions' guest inputs differ; both ran this checkout's guest image.")
    for name, runs, args, _ in sel.chosen:
        rounds = max(runs, 3) if sel.top.runs is None and not explicit_runs(sel, name) else runs
        mod = harness.module(name)
        reports = {a.label: [], b.label: []}
        for i, side in stats.rounds(sides, rounds):
            common.log(f"{name}: round {i + 1} of {rounds}, {side.label} ({side.describe()})")
            side.activate()
            ctx = harness.Context(name, 1, args, repo=side.tree, write=False)
            report, _, _ = harness.run(ctx)
            reports[side.label].append(report)
        rows_a, rows_b = merge(reports[a.label]), merge(reports[b.label])
        items = stats.comparisons(rows_a, rows_b)
        print(f"\n## {name}: {mod.TITLE}\n")
        print(f"{rounds} rounds, each a run of `tools/bench {name} --runs 1` with A's insight, "
              f"then one with B's. Each figure is the median of its samples (the least where n "
              f"says best), the spread their range; the difference is beyond the noise only where "
              f"A's and B's samples separate (stats.separation).\n")
        print(stats.comparison_table(items), flush=True)
        results["compare"][name] = {"rounds": rounds, "options": vars(args),
                                    "a": [r.to_json() for r in rows_a],
                                    "b": [r.to_json() for r in rows_b]}
    path = harness.save(results, names=["compare"] + [n for n, *_ in sel.chosen])
    common.log(f"comparison written to {path}")
    if sel.json:
        harness.save(results, sel.json)
    common.log(f"done in {(time.monotonic() - start) / 60:.1f} min")
    return 0


def explicit_runs(sel, name):
    """Whether --runs was given after `name`."""
    return any(n == name and ("--runs" in argv or any(t.startswith("--runs=") for t in argv))
               for n, _, _, argv in sel.chosen)
