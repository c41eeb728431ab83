"""The benchmarks a tools/bench command line names, with their options
(for running them here and for comparing two revisions)."""
import argparse
import sys

from . import BENCHMARKS, harness

USAGE = """tools/bench's command line.

  tools/bench --list                      the benchmarks, what each
                                          measures and how long it takes
  tools/bench NAME... [options]           run them; NAME --help: options
  tools/bench compare REV_A REV_B NAME... the same for two revisions,
                                          built in temporary work trees,
                                          A and B alternating
  tools/bench diff A.json B.json [NAME...] two results files side by side

Options after a NAME are that benchmark's (`tools/bench NAME --help`);
--runs N before any NAME is every benchmark's. A run prints each
benchmark's rows (and its detail), writes the results to
~/.cache/insight/bench/results/ (and to --json FILE), and rewrites each
benchmark's section of docs/BENCHMARKS.md (not with --no-write).

Every figure is measured `--runs` times (each benchmark has its default),
the sides compared in turn; a row gives the median (or, where it says
so, the best) of each side, their ratio, the samples' count and range.

Exit status: 0; 1 when a check a benchmark makes failed; 2 when a
benchmark, or part of one, could not be measured.
"""


def usage_error(msg):
    print(f"tools/bench: {msg} (tools/bench --help)", file=sys.stderr)
    return 2


def takes_value(ap, token):
    """Whether `token` is an option of ap that takes a value (so that the
    next token is its value, even one that names a benchmark)."""
    action = ap._option_string_actions.get(token)  # argparse keeps no public table
    return action is not None and action.nargs != 0


def groups(tokens):
    """Splits tokens into the options before any benchmark name and
    [(name, its options)]."""
    first, out = [], []
    current = harness_parser()
    skip = False
    for t in tokens:
        if not skip and t in BENCHMARKS:
            out.append((t, []))
            current = harness.parser(t)
        else:
            (out[-1][1] if out else first).append(t)
        skip = not skip and takes_value(current, t)
    return first, out


def harness_parser():
    ap = argparse.ArgumentParser(prog="tools/bench", description=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the benchmarks")
    harness.add_harness_options(ap)
    return ap


class Selection:
    """The benchmarks a command line names, each with its options and
    runs, and the harness's options."""

    def __init__(self, tokens):
        first, named = groups(tokens)
        self.top = harness_parser().parse_args(first)
        self.json, self.write = self.top.json, not self.top.no_write
        self.chosen = []
        for name, argv in named:
            args = harness.parser(name).parse_args(argv)
            if args.json:
                self.json = args.json
            if args.no_write:
                self.write = False
            runs = args.runs or self.top.runs or harness.module(name).RUNS
            for k in ("runs", "json", "no_write"):
                delattr(args, k)
            self.chosen.append((name, runs, args, argv))
