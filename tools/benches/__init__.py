"""insight's benchmarks, one module each, run by tools/bench.

harness.py runs one and records it, stats.py holds the repeats, the
alternation and the result row they all report through, doc.py rewrites
docs/BENCHMARKS.md's sections, compare.py sets two revisions side by
side, common.py is what the benchmarks share, cli.py the command line and
selection.py the benchmarks and options it names.
"""

# In the order `tools/bench --list` gives them.
BENCHMARKS = [
    "native", "boot", "snapshot", "replay", "checkpoints", "console", "net", "events", "heap",
    "probes", "samples", "expand", "debug", "analysis", "profile", "qemu", "locktools", "papers",
    "chaos",
]
