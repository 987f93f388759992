"""Model-checking throughput: distinct states per second, one and several workers.

    python bench/check_bench.py [--model large] [--repeat 3] [--no-symmetry] [--workers 2]

Prints, per run, kvproof with 1 and with --workers N processes (the counts must be equal;
the speed-up is printed), and TLC with 1 and N workers on the same .cfg when a TLC jar is
present, all in the same run so that the figures share the machine's load.

Prints, per run and as medians, the distinct states/s of `kvproof check` (every invariant,
liveness graph, fingerprints), next to a baseline measured in the same run: a bare
breadth-first enumeration of the same core with a set of full states and nothing checked.
The ratio is what checking costs over enumeration. When `java` and a tla2tools.jar
(TLA2TOOLS_JAR) are present, TLC with one worker runs on the same .cfg for the comparison
the foundation issue asks for; otherwise the reference figure from that issue is printed
(TLC found 2-3e4 distinct states/s on a prototype of this spec on this 2-core machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec import core  # noqa: E402
from spec.check.cfgfile import load  # noqa: E402
from spec.check.checker import Checker  # noqa: E402
from spec.properties import ALL_INVARIANTS  # noqa: E402
from spec.check.symmetry import canonical  # noqa: E402
from spec.tlaplus.tlc import find_tlc, run_tlc  # noqa: E402

TLC_REFERENCE = "2e4-3e4 distinct states/s (TLC, 1 worker, prototype spec, this machine class)"


def bare_enumeration(model, symmetry: bool) -> tuple[int, float]:
    start = time.perf_counter()
    init = core.initial_state(model)
    seen = {canonical(init) if symmetry else init}
    queue = deque(seen)
    while queue:
        for _, nxt in core.successors(model, queue.popleft()):
            key = canonical(nxt) if symmetry else nxt
            if key not in seen:
                seen.add(key)
                queue.append(key)
    return len(seen), time.perf_counter() - start


def kvproof_check(model, symmetry: bool, liveness: bool, workers: int = 1):
    """(distinct states, states generated, seconds) of `kvproof check --workers N`."""
    from spec.check.parallel import ParallelChecker

    def progress(distinct: int, generated: int, depth: int, seconds: float) -> None:
        print(f"  ... {distinct:,} distinct, depth {depth}, {seconds:.0f} s", flush=True)

    options = dict(symmetry=symmetry, liveness=liveness, progress=progress, progress_every_s=15)
    checker = (ParallelChecker(model, workers=workers, **options) if workers > 1
               else Checker(model, **options))
    result = checker.run()
    assert result.ok, f"the {model.name} model must hold: {result.violation.property}"
    return result.distinct_states, result.states_generated, result.seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-symmetry", action="store_true")
    parser.add_argument("--no-liveness", action="store_true")
    parser.add_argument("--workers", type=int, default=2,
                        help="the parallel run's workers, kvproof's and TLC's (default 2)")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare enumeration")
    args = parser.parse_args()
    _, model = load(args.model)
    symmetry = not args.no_symmetry
    print(f"{model.describe()}; symmetry {'on' if symmetry else 'off'}; "
          f"{args.repeat} repeat(s)")
    rates, parallel_rates, base_rates = [], [], []
    for run in range(1, args.repeat + 1):
        distinct, generated, seconds = kvproof_check(model, symmetry, not args.no_liveness)
        rates.append(distinct / seconds)
        print(f"run {run}: kvproof check, 1 worker   {distinct:,} distinct states in "
              f"{seconds:.1f} s = {rates[-1]:,.0f} distinct states/s", flush=True)
        counts = kvproof_check(model, symmetry, not args.no_liveness, args.workers)
        assert counts[:2] == (distinct, generated), "workers must find the same states"
        parallel_rates.append(distinct / counts[2])
        print(f"run {run}: kvproof check, {args.workers} workers  {distinct:,} distinct states "
              f"in {counts[2]:.1f} s = {parallel_rates[-1]:,.0f} distinct states/s; "
              f"speed-up {seconds / counts[2]:.2f}x", flush=True)
        if args.no_bare:
            continue
        base_distinct, base_seconds = bare_enumeration(model, symmetry)
        assert base_distinct == distinct, "the bare enumeration must find the same states"
        base_rates.append(base_distinct / base_seconds)
        print(f"run {run}: bare BFS       {base_distinct:,} distinct states in "
              f"{base_seconds:.1f} s = {base_rates[-1]:,.0f} distinct states/s")
    median, parallel = statistics.median(rates), statistics.median(parallel_rates)
    print(f"median: kvproof check {median:,.0f} distinct states/s with 1 worker, "
          f"{parallel:,.0f} with {args.workers} (speed-up {parallel / median:.2f}x)")
    if base_rates:
        base_median = statistics.median(base_rates)
        print(f"bare BFS {base_median:,.0f} distinct states/s; checking costs "
              f"{base_median / median:.2f}x enumeration")
    _tlc(model, median, args.workers)
    return 0


def _tlc(model, kvproof_rate: float, workers: int) -> None:
    """TLC with 1 and `workers` workers on the same model, when a TLC jar is present."""
    found = find_tlc()
    if isinstance(found, str):
        print(f"TLC: not run ({found}); reference: {TLC_REFERENCE}")
        return
    for count in (1, workers):
        tlc_result = run_tlc(model, ALL_INVARIANTS, (), workers=count)
        tlc_rate = tlc_result.distinct_states / tlc_result.seconds
        print(f"TLC ({count} worker{'s' if count > 1 else ''}, no symmetry, every invariant): "
              f"{tlc_result.distinct_states:,} distinct states in {tlc_result.seconds:.1f} s = "
              f"{tlc_rate:,.0f} distinct states/s; kvproof (1 worker)/TLC = "
              f"{kvproof_rate / tlc_rate:.2f} (compare with --no-symmetry)")


if __name__ == "__main__":
    sys.exit(main())
