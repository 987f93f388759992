"""Spec-evaluation throughput: states/s of the evaluator, next to the core checker's.

    python bench/conformance_bench.py [--model default] [--repeat 1] [--symmetry]

Three figures per run, on the same model in the same process (the machine is shared, so
compare the ratios of one run, not figures across runs):
- the spec alone: KVTransfer.tla's reachable graph enumerated from its text by the
  evaluator (spec/tlaplus/tlaeval.py `explore`), what TLC would do;
- spec ≡ code: the conformance check (spec/tlaplus/conformance.py), which evaluates the spec's Next
  on every state the core reaches and compares it with the core's successors;
- the core checker (spec/check/checker.py) with its invariants: the baseline.
The issue's target: the evaluator through the default model (772,008 states) in under 60 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec.check.cfgfile import load  # noqa: E402
from spec.check.checker import check  # noqa: E402
from spec.tlaplus.conformance import check_conformance, spec_for  # noqa: E402
from spec.tlaplus.tlaeval import explore  # noqa: E402


def _progress(what: str):
    def report(states: int, seconds: float) -> None:
        if states % 200_000 == 0:
            print(f"  ... {what}: {states:,} states, {seconds:.0f} s", flush=True)
    return report


def one_run(model, symmetry: bool) -> tuple[float, float, float]:
    spec = spec_for(model)
    alone = explore(spec, progress=None if symmetry else _progress("spec alone"))
    both = check_conformance(model, spec, symmetry=symmetry, progress=_progress("spec ≡ code"))
    assert both.ok, both.disagreement.report(model)
    core = check(model, symmetry=symmetry)
    rates = (alone.states / alone.seconds, both.states / both.seconds,
             core.distinct_states / core.seconds)
    print(f"  spec alone    {alone.states:>9,} states {alone.edges:>10,} edges "
          f"{alone.seconds:6.1f} s {rates[0]:>8,.0f} states/s")
    print(f"  spec ≡ code   {both.states:>9,} states {both.edges:>10,} edges "
          f"{both.seconds:6.1f} s {rates[1]:>8,.0f} states/s"
          f"{'  (one state per orbit)' if symmetry else ''}")
    print(f"  core checker  {core.distinct_states:>9,} states {'':>16} "
          f"{core.seconds:6.1f} s {rates[2]:>8,.0f} states/s")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--symmetry", action="store_true",
                        help="conformance and core checker up to symmetry (the spec alone "
                             "is always enumerated in full)")
    args = parser.parse_args()
    _, model = load(args.model)
    print(model.describe())
    runs = []
    for run in range(1, args.repeat + 1):
        print(f"run {run}:")
        runs.append(one_run(model, args.symmetry))
    alone, both, core = (statistics.median(r[i] for r in runs) for i in range(3))
    print(f"median: spec alone {alone:,.0f} states/s, spec ≡ code {both:,.0f} states/s, core "
          f"checker {core:,.0f} states/s; the evaluator is {core / alone:.1f}x slower than the "
          f"core checker, the whole spec ≡ code check {core / both:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
