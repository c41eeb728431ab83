"""Repeats, alternation and the one result row every benchmark reports.

A benchmark measures each thing `runs` times (`tools/bench --runs N`),
the sides it compares in turn (A B A B ..., `rounds` and `alternate`), so
that a host that slows down for a while slows both. A row gives, for its
baseline and for insight, one figure of those samples: the median, or for
rows that say so the best (the least: a busy host only ever lengthens a
run), their ratio, how many samples each side had, and their spread:
the range, min to max (with the two to five samples these benchmarks
afford, quartiles say no more than the range does).

Two sets of samples of one figure, from two revisions or two result
files, differ beyond their noise when their ranges do not overlap and
such a split is unlikely by chance (`separation`).
"""
import math
import statistics
from dataclasses import dataclass, field

MEDIAN = "median"
BEST = "best"
# The largest chance of two ranges not overlapping by luck alone that
# still counts as a difference: with three samples a side it is 0.1.
SEPARATION_P = 0.1
# Units of things counted, whole numbers shown as such.
COUNTS = {"cycles", "datagrams", "programs", "runs", "tries"}


def rounds(sides, runs):
    """(round, side) in the order a benchmark measures them: every side
    once a round, the sides in turn (A B A B ...)."""
    for i in range(runs):
        for side in sides:
            yield i, side


def alternate(sides, runs, measure):
    """Calls measure(side, round) in `rounds` order; returns {side: [its
    results]}, a result of None left out."""
    got = {side: [] for side in sides}
    for i, side in rounds(sides, runs):
        value = measure(side, i)
        if value is not None:
            got[side].append(value)
    return got


def figure(samples, statistic=MEDIAN):
    """The samples' median, or their least with BEST; None for none."""
    if not samples:
        return None
    return min(samples) if statistic == BEST else statistics.median(samples)


def median(samples):
    return figure(samples, MEDIAN)


def spread(samples):
    """(min, max) of two samples or more, else None."""
    return (min(samples), max(samples)) if len(samples) > 1 else None


@dataclass
class Row:
    """One figure of a benchmark: insight's samples against the
    baseline's (None where the row has no baseline), in `unit`, with the
    statistic that makes one figure of each. `n`, when given, is how many
    measurements a figure computed from other figures stands on (its
    samples are then that one figure, without a spread)."""
    name: str
    insight: list
    baseline: list = None
    unit: str = "s"
    statistic: str = MEDIAN
    n: int = None
    derived: bool = field(default=False)

    def __post_init__(self):
        self.insight = [float(x) for x in self.insight]
        if self.baseline is not None:
            self.baseline = [float(x) for x in self.baseline]
        if self.n is None:
            self.n = len(self.insight)

    @classmethod
    def computed(cls, name, insight, baseline=None, unit="s", n=1):
        """A row of one figure computed from others (a difference over a
        count, a rate): no spread of its own."""
        return cls(name, [insight], None if baseline is None else [baseline], unit, n=n,
                   derived=True)

    def value(self, side="insight"):
        return figure(getattr(self, side) or [], self.statistic)

    @property
    def ratio(self):
        """insight's figure over the baseline's, or None."""
        a, b = self.value("insight"), self.value("baseline")
        if a is None or b is None or b == 0:
            return None
        return a / b

    def spread(self, side="insight"):
        return None if self.derived else spread(getattr(self, side) or [])

    def to_json(self):
        return {"name": self.name, "unit": self.unit, "statistic": self.statistic, "n": self.n,
                "baseline": self.value("baseline"), "insight": self.value("insight"),
                "ratio": self.ratio, "spread": {"baseline": self.spread("baseline"),
                                                "insight": self.spread("insight")},
                "samples": {"baseline": self.baseline, "insight": self.insight},
                "derived": self.derived}

    @classmethod
    def from_json(cls, d):
        s = d["samples"]
        return cls(d["name"], s["insight"], s["baseline"], d["unit"], d["statistic"], d["n"],
                   d.get("derived", False))


def number(x):
    """x with about three significant digits."""
    if x is None:
        return "—"
    a = abs(x)
    if a == 0 or a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def quantity(x, unit):
    if x is None:
        return "—"
    if unit == "x":
        return f"{number(x)}x"
    if unit in COUNTS and float(x).is_integer():
        return f"{int(x):,} {unit}"
    return f"{number(x)} {unit}".rstrip()


def span(s):
    return "—" if s is None else f"{number(s[0])}–{number(s[1])}"


def table(rows):
    """The rows as a Markdown table."""
    lines = ["| measurement | baseline | insight | ratio | n | spread (min–max): baseline / insight |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        ratio = "—" if r.ratio is None else f"{r.ratio:.2f}x"
        n = f"{r.n}" + (", best" if r.statistic == BEST else "") + (", computed" if r.derived else "")
        spreads = "—" if r.derived else (
            (f"{span(r.spread('baseline'))} / " if r.baseline is not None else "") +
            span(r.spread("insight")))
        lines.append(f"| {r.name} | {quantity(r.value('baseline'), r.unit)} | "
                     f"{quantity(r.value('insight'), r.unit)} | {ratio} | {n} | {spreads} |")
    return "\n".join(lines)


def separation(a, b):
    """Whether samples a and b of one figure differ beyond their noise,
    and how: "within noise", "B higher" or "B lower". They differ when
    their ranges do not overlap and the chance of so clean a split under
    no difference at all, 2 / C(|a| + |b|, |a|) (the exact permutation
    test's), is at most SEPARATION_P; with fewer than three samples a
    side it never is, which the verdict says."""
    if not a or not b:
        return "not measured"
    p = 2 / math.comb(len(a) + len(b), len(a))
    apart = max(a) < min(b) or max(b) < min(a)
    if apart and p <= SEPARATION_P:
        return "B higher" if min(b) > max(a) else "B lower"
    if apart:
        return f"within noise (too few samples to tell: p {p:.2f})"
    return "within noise"


@dataclass
class Comparison:
    """One figure of two runs (A and B) side by side."""
    name: str
    unit: str
    statistic: str
    a: list
    b: list

    @property
    def ratio(self):
        fa, fb = figure(self.a, self.statistic), figure(self.b, self.statistic)
        return None if fa in (None, 0) or fb is None else fb / fa

    def verdict(self):
        return separation(self.a, self.b)


def comparisons(a_rows, b_rows):
    """Comparisons of the rows of two runs of one benchmark, matched by
    name: insight's figure of each row, and the baseline's, marked so."""
    b_by = {r.name: r for r in b_rows}
    out = []
    for ra in a_rows:
        rb = b_by.get(ra.name)
        if rb is None:
            continue
        out.append(Comparison(ra.name, ra.unit, ra.statistic, ra.insight, rb.insight))
        if ra.baseline is not None and rb.baseline is not None:
            out.append(Comparison(f"{ra.name} [baseline]", ra.unit, ra.statistic, ra.baseline,
                                  rb.baseline))
    return out


def comparison_table(items):
    """Comparisons as a Markdown table: A, B, B/A, each one's spread, and
    whether the difference is beyond the noise."""
    lines = ["| measurement | A | B | B/A | n A, B | spread A (min–max) | spread B | difference |",
             "|---|---:|---:|---:|---|---|---|---|"]
    for c in items:
        ratio = "—" if c.ratio is None else f"{c.ratio:.3f}"
        stat = ", best" if c.statistic == BEST else ""
        lines.append(f"| {c.name} | {quantity(figure(c.a, c.statistic), c.unit)} | "
                     f"{quantity(figure(c.b, c.statistic), c.unit)} | {ratio} | "
                     f"{len(c.a)}, {len(c.b)}{stat} | {span(spread(c.a))} | {span(spread(c.b))} | "
                     f"{c.verdict()} |")
    return "\n".join(lines)
