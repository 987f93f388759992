"""Fuzzer throughput: steps per second on each target next to a trivial state machine.

The trivial machine (a counter with two rules and an invariant) measures what Hypothesis's
rule-based machinery costs per step by itself; a target's rate is worth reading only as a
fraction of it, measured in the same run, since the machine running this may be shared.
Rounds alternate between the two so that a change in load hits both. CPU time of this
process is the clock (wall time is printed too); the target of issue 5 for the core is at
least 25% of the trivial machine's rate.

    python bench/fuzz_bench.py [--examples N] [--rounds N] [--target NAME ...]

"Steps" on a target are the moves taken: the ones the rules chose and the ones the
end-of-example drain took (those skip Hypothesis's per-step cost, so the rules-only rate is
printed as well). On the core a move is one protocol event, or a Delay (the fuzzer's
scheduling). On the simulator most moves are Wait, which runs the simulator until it commits
at least one protocol event. The protocol events each target committed per second are
printed too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine, invariant, rule, run_state_machine_as_test,
)

from fuzz.profiles import PROFILES  # noqa: E402
from fuzz.runner import Campaign, run_campaign  # noqa: E402
from fuzz.target import TARGETS, load_targets  # noqa: E402


class Counter(RuleBasedStateMachine):
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.value = 0

    @rule()
    def up(self) -> None:
        Counter.steps += 1
        self.value += 1

    @rule()
    def down(self) -> None:
        Counter.steps += 1
        self.value -= 1

    @invariant()
    def is_int(self) -> None:
        assert isinstance(self.value, int)


def trivial_round(examples: int, steps_max: int, round_seed: int) -> tuple[int, float, float]:
    """Steps, CPU seconds and wall seconds of `examples` examples of the counter."""
    Counter.steps = 0
    options = settings(max_examples=examples, database=None, deadline=None,
                       stateful_step_count=steps_max, phases=[Phase.generate],
                       suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    cpu, wall = time.process_time(), time.perf_counter()
    run_state_machine_as_test(seed(round_seed)(Counter), settings=options)
    return Counter.steps, time.process_time() - cpu, time.perf_counter() - wall


def target_round(target: str, examples: int,
                 round_seed: int) -> tuple[int, int, float, float, int]:
    """Rule steps, drain steps, CPU seconds, wall seconds and protocol events on `target`,
    no bug on."""
    campaign = Campaign(target=target, seed=round_seed, examples=examples, shrink_seconds=0)
    counted = TARGETS[target]
    committed = counted.events_committed
    cpu, wall = time.process_time(), time.perf_counter()
    outcome = run_campaign(campaign)
    assert not outcome.caught, f"a false alarm on {target} with no bug on: seed {round_seed}"
    return (outcome.steps, outcome.drain_steps, time.process_time() - cpu,
            time.perf_counter() - wall, counted.events_committed - committed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100, help="examples per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target", action="append", default=[], choices=sorted(load_targets()))
    args = parser.parse_args(argv)
    targets = args.target or sorted(load_targets())
    steps_max = PROFILES["default"].steps_max
    trivial = [0, 0.0, 0.0]
    totals = {t: [0, 0, 0.0, 0.0, 0] for t in targets}
    for k in range(args.rounds):
        for i, value in enumerate(trivial_round(args.examples, steps_max, k)):
            trivial[i] += value
        for t in targets:
            for i, value in enumerate(target_round(t, args.examples, k)):
                totals[t][i] += value
    trivial_rate = trivial[0] / trivial[1]
    print(f"{args.rounds} rounds of {args.examples} examples (seeds 0..{args.rounds - 1}), "
          f"{steps_max} rule steps at most per example; rates per CPU second of this process")
    print(f"trivial counter machine: {trivial[0]} steps, {trivial_rate:,.0f} steps/s "
          f"(wall {trivial[0] / trivial[2]:,.0f}/s)")
    for t, (rules, drain, cpu, wall, events) in totals.items():
        rate = (rules + drain) / cpu
        print(f"{t}: {rules + drain} steps ({rules} by the rules, {drain} by the drain), "
              f"{rate:,.0f} steps/s (wall {(rules + drain) / wall:,.0f}/s), "
              f"{rules / cpu:,.0f} rule steps/s; {events / cpu:,.0f} protocol events/s")
        goal = "; issue 5's target for the core: >= 25%" if t == "core" else ""
        print(f"{t}: {rate / trivial_rate:.0%} of the trivial machine's rate "
              f"(rule steps alone: {rules / cpu / trivial_rate:.0%}){goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
