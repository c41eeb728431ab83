"""tools/bench's command line: runs what it names (selection.py reads it,
and says the whole usage: tools/bench --help), compares two revisions
(compare.py), or two results files side by side (diff)."""
import argparse
import time
import traceback

from . import BENCHMARKS, common, harness, stats
from .selection import Selection, usage_error


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
