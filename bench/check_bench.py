"""Model-checking throughput: distinct states per second, one and several workers.

    python bench/check_bench.py [--model large] [--repeat 3] [--no-symmetry] [--workers 2]

Prints, per run, kvproof with 1 and with --workers N processes (the counts must be equal;
the speed-up is printed), each with its wall time and its CPU time (user + sys, of this
process and of the workers: less noisy than wall time on a shared machine), then the
medians; and TLC with 1 and N workers on the same .cfg when a TLC jar is present, all in
the same run so that the figures share the machine's load. Each figure names the command
that gives the same check: `kvproof check --model M [--symmetry] --workers N`.

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
import os
import resource
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.clikit import process_count  # noqa: E402
from spec import core  # noqa: E402
from spec.check.cfgfile import load  # noqa: E402
from spec.check.checker import Checker  # noqa: E402
from spec.check.pool import cpus_available  # noqa: E402
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


def cpu_seconds() -> float:
    """User + sys time of this process and of its children that have ended (the pool's
    workers, once it has shut down)."""
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def kvproof_check(model, symmetry: bool, liveness: bool, workers: int = 1):
    """(distinct states, states generated, seconds, CPU seconds) of `kvproof check
    --workers N`."""
    from spec.check.parallel import ParallelChecker

    def progress(distinct: int, generated: int, depth: int, seconds: float) -> None:
        print(f"  ... {distinct:,} distinct, depth {depth}, {seconds:.0f} s", flush=True)

    options = dict(symmetry=symmetry, liveness=liveness, progress=progress, progress_every_s=15)
    checker = (ParallelChecker(model, workers=workers, **options) if workers > 1
               else Checker(model, **options))
    cpu = cpu_seconds()
    result = checker.run()
    cpu = cpu_seconds() - cpu
    assert result.ok, f"the {model.name} model must hold: {result.violation.property}"
    return result.distinct_states, result.states_generated, result.seconds, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-symmetry", action="store_true")
    parser.add_argument("--no-liveness", action="store_true")
    parser.add_argument("--workers", type=process_count, default=2,
                        help="the parallel run's workers, kvproof's and TLC's (default 2)")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare enumeration")
    args = parser.parse_args()
    _, model = load(args.model)
    symmetry = not args.no_symmetry
    print(f"{model.describe()}; symmetry {'on' if symmetry else 'off'}; "
          f"{args.repeat} repeat(s); {cpus_available()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    command = (f"kvproof check --model {args.model}" + (" --symmetry" if symmetry else "")
               + (" (no liveness)" if args.no_liveness else ""))
    rates, parallel_rates, base_rates = [], [], []
    walls: dict[int, list[float]] = {1: [], args.workers: []}
    cpus: dict[int, list[float]] = {1: [], args.workers: []}
    for run in range(1, args.repeat + 1):
        counts = None
        for workers in (1, args.workers):
            found = kvproof_check(model, symmetry, not args.no_liveness, workers)
            assert counts is None or found[:2] == counts, "workers must find the same states"
            counts, seconds, cpu = found[:2], found[2], found[3]
            walls[workers].append(seconds)
            cpus[workers].append(cpu)
            print(f"run {run}: {command} --workers {workers}: {counts[0]:,} distinct states, "
                  f"{counts[1]:,} generated, in {seconds:.1f} s wall, {cpu:.1f} s CPU "
                  f"(user+sys) = {counts[0] / seconds:,.0f} distinct states/s", flush=True)
        distinct = counts[0]
        rates.append(distinct / walls[1][-1])
        parallel_rates.append(distinct / walls[args.workers][-1])
        print(f"run {run}: speed-up with {args.workers} workers "
              f"{walls[1][-1] / walls[args.workers][-1]:.2f}x (wall)", flush=True)
        if args.no_bare:
            continue
        base_distinct, base_seconds = bare_enumeration(model, symmetry)
        assert base_distinct == distinct, "the bare enumeration must find the same states"
        base_rates.append(base_distinct / base_seconds)
        print(f"run {run}: bare BFS       {base_distinct:,} distinct states in "
              f"{base_seconds:.1f} s = {base_rates[-1]:,.0f} distinct states/s")
    median, parallel = statistics.median(rates), statistics.median(parallel_rates)
    for workers in (1, args.workers):
        print(f"median of {args.repeat}: {command} --workers {workers}: "
              f"{statistics.median(walls[workers]):.1f} s wall, "
              f"{statistics.median(cpus[workers]):.1f} s CPU")
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
