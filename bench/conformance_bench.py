"""Spec-evaluation throughput: states/s of the spec ≡ code check, next to the core checker.

    python bench/conformance_bench.py [--model small] [--repeat 3]

The conformance check evaluates KVTransfer.tla's Next on every reachable state (spec/
tlaeval.py) and compares it with the core's successors; the core checker measured on the
same model in the same run is the baseline. The ratio is what reading the spec from its
text costs over the hand-written core.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec.cfgfile import load  # noqa: E402
from spec.checker import check  # noqa: E402
from spec.conformance import check_conformance, spec_for  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    _, model = load(args.model)
    print(model.describe())
    spec_rates, core_rates = [], []
    for run in range(1, args.repeat + 1):
        spec = spec_for(model)
        result = check_conformance(model, spec, progress=lambda n, s: print(
            f"  ... {n:,} states, {s:.0f} s", flush=True) if n % 20000 == 0 else None)
        # (progress is called every 5,000 states; every fourth call prints)
        assert result.ok, result.disagreement.report(model)
        spec_rates.append(result.states / result.seconds)
        core = check(model)
        core_rates.append(core.distinct_states / core.seconds)
        print(f"run {run}: spec evaluation + comparison {result.states:,} states in "
              f"{result.seconds:.1f} s = {spec_rates[-1]:,.0f} states/s; core checker "
              f"{core.distinct_states:,} in {core.seconds:.1f} s = {core_rates[-1]:,.0f}/s")
    spec_median, core_median = statistics.median(spec_rates), statistics.median(core_rates)
    print(f"median: spec {spec_median:,.0f} states/s, core checker {core_median:,.0f} states/s; "
          f"the spec evaluator is {core_median / spec_median:.1f}x slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
