"""Unit tests of the harness's statistics, its result rows and the
rewriting of a document's blocks between markers; no KVM, no guest.

  python3 -m unittest discover -s tools/benches -t tools
"""
import unittest

from benches import doc, stats
from benches.stats import Row


class Statistics(unittest.TestCase):
    def test_rounds_alternate_the_sides(self):
        self.assertEqual(list(stats.rounds(["A", "B"], 3)),
                         [(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B")])

    def test_alternate_collects_each_side_in_order(self):
        order = []

        def measure(side, i):
            order.append(side)
            return None if (side, i) == ("B", 1) else f"{side}{i}"
        got = stats.alternate(["A", "B"], 2, measure)
        self.assertEqual(order, ["A", "B", "A", "B"])
        self.assertEqual(got, {"A": ["A0", "A1"], "B": ["B0"]})

    def test_median_best_and_spread(self):
        self.assertEqual(stats.figure([3, 1, 2]), 2)
        self.assertEqual(stats.figure([4, 1, 2, 3]), 2.5)
        self.assertEqual(stats.figure([3, 1, 2], stats.BEST), 1)
        self.assertIsNone(stats.figure([]))
        self.assertEqual(stats.spread([3, 1, 2]), (1, 3))
        self.assertIsNone(stats.spread([5]))

    def test_row_ratio_n_and_spread(self):
        r = Row("run", [1.0, 1.2, 1.1], [10.0, 11.0, 12.0])
        self.assertAlmostEqual(r.ratio, 1.1 / 11.0)
        self.assertEqual(r.n, 3)
        self.assertEqual(r.spread("baseline"), (10.0, 12.0))
        best = Row("run", [1.0, 1.2, 1.1], [10.0, 11.0, 12.0], statistic=stats.BEST)
        self.assertAlmostEqual(best.ratio, 0.1)
        self.assertIsNone(Row("alone", [2.0]).ratio)
        self.assertIsNone(Row("zero", [2.0], [0.0]).ratio)

    def test_computed_row_has_its_n_and_no_spread(self):
        r = Row.computed("per hit", 81.0, unit="µs", n=3)
        self.assertEqual((r.n, r.value(), r.spread()), (3, 81.0, None))

    def test_row_round_trips_through_json(self):
        r = Row("record", [1.0, 2.0], [0.5, 0.7], unit="ms", statistic=stats.BEST)
        back = Row.from_json(r.to_json())
        self.assertEqual((back.name, back.insight, back.baseline, back.unit, back.statistic, back.n),
                         (r.name, r.insight, r.baseline, r.unit, r.statistic, r.n))
        self.assertAlmostEqual(r.to_json()["ratio"], 2.0)

    def test_table_shows_every_field(self):
        text = stats.table([Row("run -- true", [1.0, 1.1], [11.0, 12.0]),
                            Row("size", [5.0], unit="MiB", statistic=stats.BEST)])
        lines = text.splitlines()
        self.assertEqual(len(lines), 4)
        self.assertIn("| run -- true | 11.5 s | 1.05 s | 0.09x | 2 | 11.0–12.0 / 1.00–1.10 |", lines[2])
        self.assertIn("| size | — | 5.00 MiB | — | 1, best | — |", lines[3])

    def test_number_keeps_about_three_digits(self):
        self.assertEqual([stats.number(x) for x in (1234.5, 123.4, 12.34, 1.234, 0.01234, 0, 3.0)],
                         ["1,234", "123", "12.3", "1.23", "0.0123", "0", "3.00"])
        self.assertEqual([stats.quantity(2.5, "x"), stats.quantity(3.0, "cycles")],
                         ["2.50x", "3 cycles"])


class Separation(unittest.TestCase):
    def test_overlapping_ranges_are_noise(self):
        self.assertEqual(stats.separation([1.0, 1.2, 1.4], [1.1, 1.3, 1.5]), "within noise")

    def test_apart_with_three_a_side_differ(self):
        self.assertEqual(stats.separation([1.0, 1.1, 1.2], [1.5, 1.6, 1.7]), "B higher")
        self.assertEqual(stats.separation([1.5, 1.6, 1.7], [1.0, 1.1, 1.2]), "B lower")

    def test_two_a_side_cannot_tell(self):
        self.assertTrue(stats.separation([1.0, 1.1], [2.0, 2.1]).startswith("within noise (too few"))

    def test_comparisons_pair_rows_by_name_and_baselines_apart(self):
        a = [Row("x", [1.0, 1.1, 1.2], [5.0, 5.0, 5.0]), Row("only in A", [1.0])]
        b = [Row("x", [2.0, 2.1, 2.2], [5.0, 5.1, 4.9])]
        items = stats.comparisons(a, b)
        self.assertEqual([c.name for c in items], ["x", "x [baseline]"])
        self.assertAlmostEqual(items[0].ratio, 2.1 / 1.1)
        self.assertEqual([c.verdict() for c in items], ["B higher", "within noise"])
        self.assertIn("| x | 1.10 s | 2.10 s | 1.909 | 3, 3 | 1.00–1.20 | 2.00–2.20 | B higher |",
                      stats.comparison_table(items))


DOC = """# Benchmarks

Prose written by people.

## Boot snapshots

<!-- bench snapshot: begin -->
old figures
<!-- bench snapshot: end -->

More prose, kept.

## Boot time

<!-- bench boot: begin -->
<!-- bench boot: end -->
"""


class Markers(unittest.TestCase):
    def test_replace_keeps_everything_outside(self):
        text = doc.replace(DOC, "snapshot", "| new | row |\n")
        self.assertIn("<!-- bench snapshot: begin -->\n| new | row |\n<!-- bench snapshot: end -->", text)
        self.assertNotIn("old figures", text)
        self.assertEqual(text.replace("| new | row |", "old figures"), DOC)

    def test_replace_fills_an_empty_section(self):
        text = doc.replace(DOC, "boot", "figures")
        self.assertTrue(text.endswith("<!-- bench boot: begin -->\nfigures\n<!-- bench boot: end -->\n"))
        self.assertIn("old figures", text)

    def test_missing_section_is_added_with_a_heading_or_refused(self):
        text = doc.replace(DOC, "heap", "figures", title="Heap events (tools/bench heap)")
        self.assertTrue(text.endswith("## Heap events (tools/bench heap)\n\n<!-- bench heap: begin -->\n"
                                      "figures\n<!-- bench heap: end -->\n"))
        with self.assertRaises(doc.MarkerError):
            doc.replace(DOC, "heap", "figures")

    def test_unpaired_markers_are_refused(self):
        for broken in (DOC.replace("<!-- bench boot: end -->", ""),
                       DOC.replace("<!-- bench snapshot: end -->", ""),
                       DOC + "\n<!-- bench boot: begin -->\n<!-- bench boot: end -->\n",
                       DOC.replace("<!-- bench snapshot: begin -->", "")):
            with self.assertRaises(doc.MarkerError):
                doc.replace(broken, "snapshot", "x")

    def test_rewriting_twice_is_stable(self):
        once = doc.replace(DOC, "snapshot", "figures")
        self.assertEqual(doc.replace(once, "snapshot", "figures"), once)

    def test_detail_headings_become_bold_and_tables_stand_apart(self):
        self.assertEqual(doc.markdown_body("### hotspot\nsome text\n| a |\n|---|\nafter\n\n\n"),
                         "**hotspot**\nsome text\n\n| a |\n|---|\n\nafter")


if __name__ == "__main__":
    unittest.main()
