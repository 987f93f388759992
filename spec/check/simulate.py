"""Random behaviours of a model too large to exhaust (TLC's -simulate).

Each behaviour starts in the initial state and takes a uniformly drawn enabled event at
every step, for at most `depth_max` steps or until nothing is enabled. Every state is checked
against the state invariants, and a state where no fair action is enabled against the rest
invariants (as the breadth-first checker does). Behaviour k is drawn from its own seed,
`seed + k`, so each violation names the one seed that replays it (`--seed S --traces 1`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from spec import core
from spec.properties import Violation
from spec.model import Model
from spec.properties import REST_INVARIANTS, STATE_INVARIANTS


@dataclass
class SimulationResult:
    model: Model
    traces: int = 0
    steps: int = 0
    seconds: float = 0.0
    # (the behaviour's seed, its violation), the first violation of each behaviour
    violations: list[tuple[int, Violation]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def _violated(m: Model, s, names: tuple[str, ...], table: dict) -> str | None:
    for name in names:
        if name in table and not table[name](m, s):
            return name
    return None


def behaviour(m: Model, rng: random.Random, depth_max: int):
    """A behaviour of m drawn step by step: (state, event, the state after) for at most
    `depth_max` steps, each event drawn uniformly from those enabled, until none is."""
    state = core.initial_state(m)
    for _ in range(depth_max):
        enabled = list(core.successors(m, state))
        if not enabled:
            return
        event, after = enabled[rng.randrange(len(enabled))]
        yield state, event, after
        state = after


def walk(m: Model, seed: int, depth_max: int, invariants: tuple[str, ...]):
    """One behaviour: its steps taken and its first violation, or None."""
    rng = random.Random(seed)
    state = core.initial_state(m)
    trace = [(None, state)]
    for _ in range(depth_max + 1):
        failed = _violated(m, state, invariants, STATE_INVARIANTS)
        if failed:
            return len(trace) - 1, Violation(failed, kind="invariant", trace=trace)
        enabled = list(core.successors(m, state))
        if not any(e.action not in core.UNFAIR_ACTIONS for e, _ in enabled):
            failed = _violated(m, state, invariants, REST_INVARIANTS)
            if failed:
                return len(trace) - 1, Violation(failed, kind="rest" if enabled else "deadlock", trace=trace)
        if not enabled or len(trace) > depth_max:
            break
        event, state = enabled[rng.randrange(len(enabled))]
        trace.append((event, state))
    return len(trace) - 1, None


def simulate(m: Model, *, seed: int, depth_max: int, traces: int,
             invariants: tuple[str, ...], keep_going: bool = False) -> SimulationResult:
    """`traces` behaviours; stops at the first violation unless keep_going."""
    result = SimulationResult(m)
    started = time.perf_counter()
    for k in range(traces):
        steps, violation = walk(m, seed + k, depth_max, invariants)
        result.traces += 1
        result.steps += steps
        if violation is not None:
            result.violations.append((seed + k, violation))
            if not keep_going:
                break
    result.seconds = time.perf_counter() - started
    return result
