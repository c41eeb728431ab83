"""Unit tests of tools/bench's command line and of what every benchmark
module and docs/BENCHMARKS.md must declare; no KVM, no guest.

  python3 -m unittest discover -s tools/benches -t tools
"""
import unittest

from benches import BENCHMARKS, cli, doc, harness, selection


class CommandLine(unittest.TestCase):
    def test_options_follow_their_benchmark(self):
        first, named = selection.groups(["--runs", "2", "profile", "--sampled-at", "replay", "replay",
                                   "--quick"])
        self.assertEqual(first, ["--runs", "2"])
        self.assertEqual(named, [("profile", ["--sampled-at", "replay"]), ("replay", ["--quick"])])

    def test_runs_default_per_benchmark_and_harness_options_anywhere(self):
        sel = selection.Selection(["snapshot", "--no-write", "replay", "--runs", "1", "--quick"])
        self.assertFalse(sel.write)
        self.assertEqual([(n, r) for n, r, _, _ in sel.chosen], [("snapshot", 3), ("replay", 1)])
        self.assertTrue(sel.chosen[1][2].quick)
        self.assertEqual(cli.own_options(["--runs", "1", "--quick", "--json", "f"]), ["--quick"])

    def test_every_benchmark_module_declares_itself(self):
        for name in BENCHMARKS:
            mod = harness.module(name)
            self.assertTrue(harness.summary(mod), name)
            self.assertTrue(mod.TITLE and mod.DURATION and mod.RUNS >= 1, name)
            self.assertTrue(callable(mod.run), name)
            harness.parser(name).parse_args([])

    def test_the_document_has_one_section_per_benchmark(self):
        with open(harness.DOC) as f:
            found = doc.sections(f.read())
        self.assertEqual(sorted(found), sorted(BENCHMARKS))


if __name__ == "__main__":
    unittest.main()
