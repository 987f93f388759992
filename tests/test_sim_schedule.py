"""sim/schedule.py puts calls on SimPy's queue itself: they must run exactly when, and in
exactly the order, SimPy's own Timeouts would (ties included), interleaved with processes
and plain Timeouts, or the simulator's logs would change."""

from __future__ import annotations

import random

import pytest
import simpy

from sim.schedule import Scheduler

SEED = 5


def _run(use_calls: bool) -> list[tuple[float, str]]:
    """A process and a web of callbacks that schedule more callbacks, with many ties (delays
    drawn from a few values); each callback is a Call or a Timeout."""
    env = simpy.Environment()
    scheduler = Scheduler(env)
    rng = random.Random(SEED)
    seen = []

    def later(delay_s, fn, *args):
        if use_calls:
            scheduler.at(delay_s, fn, *args)
        else:
            env.timeout(delay_s).callbacks.append(lambda _event: fn(*args))

    def fire(name: str, depth: int) -> None:
        seen.append((env.now, name))
        if depth < 4:
            for k in range(rng.randrange(4)):
                later(rng.choice((0.0, 0.5, 1.0)), fire, f"{name}.{k}", depth + 1)

    def process():
        for k in range(6):
            yield env.timeout(rng.choice((0.0, 0.5)))
            seen.append((env.now, f"process {k}"))
            later(rng.choice((0.0, 0.5)), fire, f"p{k}", 1)

    env.process(process())
    for k in range(8):
        later(rng.choice((0.0, 0.5, 1.0)), fire, f"c{k}", 0)
    env.run()
    assert scheduler.pending == 0
    return seen


def test_calls_run_in_the_order_simpy_s_timeouts_would():
    print(f"seed {SEED}")
    with_timeouts, with_calls = _run(False), _run(True)
    assert len(with_timeouts) == 170  # callbacks at 9 distinct times: ties everywhere
    assert with_calls == with_timeouts


def test_the_scheduler_counts_what_is_pending_and_refuses_negative_delays():
    env = simpy.Environment()
    scheduler = Scheduler(env)
    out = []
    scheduler.at(1.0, out.append, "a")
    scheduler.at(2.0, out.append, "b")
    assert scheduler.pending == 2
    env.run(until=1.5)
    assert (out, scheduler.pending) == (["a"], 1)
    with pytest.raises(ValueError, match="negative delay"):
        scheduler.at(-0.1, out.append, "c")
    env.run()
    assert (out, scheduler.pending, env.now) == (["a", "b"], 0, 2.0)
