"""tools/bench's command line.

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
import argparse
import sys
import time
import traceback

from . import BENCHMARKS, common, harness, stats


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
    ap = argparse.ArgumentParser(prog="tools/bench", description=__doc__,
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


def list_benchmarks():
    width = max(len(n) for n in BENCHMARKS)
    for name in BENCHMARKS:
        mod = harness.module(name)
        print(f"{name:<{width}}  {mod.DURATION:>12}  {harness.summary(mod)}")
    print("\n(durations at the defaults on a 2-core nested-KVM host; tools/bench NAME --help)")


def run_selection(sel):
    results = harness.header()
    results["benchmarks"] = {}
    status = 0
    if any(getattr(harness.module(n), "NEEDS_INSIGHT", True) for n, *_ in sel.chosen):
        common.log("building insight (cargo build --release -p insight)")
        try:
            common.use_binary(common.build_insight())
            common.warm_boot_snapshot()
        except common.BenchError as e:
            common.log(str(e))
            return 2
    for name, runs, args, argv in sel.chosen:
        mod = harness.module(name)
        common.log(f"{name}: {harness.summary(mod)} ({mod.DURATION}, --runs {runs})")
        ctx = harness.Context(name, runs, args, write=sel.write)
        try:
            report, printed, seconds = harness.run(ctx)
        except common.BenchError as e:
            common.log(f"{name}: could not be measured: {e}")
            status = max(status, 2)
            continue
        except Exception:  # a benchmark's own fault: the others' results are still kept
            common.log(f"{name} failed:\n{traceback.format_exc()}")
            status = max(status, 2)
            continue
        entry = {"title": mod.TITLE, "runs": runs, "options": vars(args),
                 "command": harness.command_line(name, runs, own_options(argv)),
                 "date": results["date"], "host": results["host"], "insight": results["insight"],
                 "seconds": round(seconds, 1), "status": report.status,
                 "rows": [r.to_json() for r in report.rows], "detail": printed,
                 "data": report.data}
        results["benchmarks"][name] = entry
        status = max(status, report.status)
        print(f"## {name}: {mod.TITLE} ({seconds / 60:.1f} min)\n")
        print(stats.table(report.rows) if report.rows else "(no rows)")
        if printed.strip():
            print("\n" + printed.rstrip())
        print(flush=True)
    if results["benchmarks"]:
        names = list(results["benchmarks"])
        path = harness.save(results, names=names)
        common.log(f"results written to {path}")
        if sel.json:
            harness.save(results, sel.json)
            common.log(f"results written to {sel.json}")
        if sel.write:
            harness.write_sections(results["benchmarks"])
            common.log(f"docs/BENCHMARKS.md: the sections of {', '.join(names)} rewritten")
    return status


def own_options(argv):
    """A benchmark's options without the harness's (--runs N, --json FILE,
    --no-write): what its section says it ran with, beside its runs."""
    out, skip = [], False
    for t in argv:
        if skip:
            skip = False
        elif t in ("--runs", "--json"):
            skip = True
        elif t != "--no-write" and not t.startswith(("--runs=", "--json=")):
            out.append(t)
    return out


def diff(tokens):
    ap = argparse.ArgumentParser(prog="tools/bench diff",
                                 description="Two results files of tools/bench side by side: "
                                             "each row's figure in A and in B, B/A, each one's "
                                             "spread, and whether they differ beyond their noise.")
    ap.add_argument("a", metavar="A.json")
    ap.add_argument("b", metavar="B.json")
    ap.add_argument("names", nargs="*", metavar="NAME", help="only these benchmarks")
    args = ap.parse_args(tokens)
    try:
        a, b = harness.load(args.a), harness.load(args.b)
    except (OSError, ValueError, common.BenchError) as e:
        return usage_error(str(e))
    print(f"A: {args.a} ({a['date']}, insight {a['insight']}; {a['host']})")
    print(f"B: {args.b} ({b['date']}, insight {b['insight']}; {b['host']})\n")
    shared = [n for n in a["benchmarks"] if n in b["benchmarks"] and (not args.names or n in args.names)]
    if not shared:
        return usage_error("the two files have no benchmark in common")
    for name in shared:
        rows = [[stats.Row.from_json(r) for r in x["benchmarks"][name]["rows"]] for x in (a, b)]
        print(f"## {name}\n")
        print(stats.comparison_table(stats.comparisons(*rows)) + "\n")
    return 0


def main(tokens):
    if tokens and tokens[0] == "diff":
        return diff(tokens[1:])
    if tokens and tokens[0] == "compare":
        from . import compare
        return compare.main(tokens[1:])
    try:
        sel = Selection(tokens)
    except KeyError as e:
        return usage_error(f"no benchmark {e}")
    if sel.top.list:
        list_benchmarks()
        return 0
    if not sel.chosen:
        return usage_error("name one benchmark or more (tools/bench --list)")
    start = time.monotonic()
    status = run_selection(sel)
    common.log(f"done in {(time.monotonic() - start) / 60:.1f} min")
    return status
