"""`kvproof check --workers N` is the serial checker's search, only spread: every figure and
every counterexample equal, whatever the chunking (spec/check/parallel.py)."""

from __future__ import annotations

import pytest

from spec.check import parallel
from spec.check.cfgfile import load
from spec.check.checker import Checker
from spec.check.parallel import ParallelChecker


def figures(result, m) -> dict:
    labels = lambda trace: [e.label(m) if e else "Init" for e, _ in trace]  # noqa: E731
    return dict(
        distinct=result.distinct_states, generated=result.states_generated,
        transitions=result.transitions, depth=result.depth, left=result.left_on_queue,
        rest=result.rest_states, edges=result.edges, liveness=result.liveness_checked,
        counts=result.action_counts, per_action=result.action_transitions,
        witness=labels(result.witness) if result.witness else None,
        violations=[(v.property, v.kind, labels(v.trace)) for v in result.violations])


@pytest.mark.parametrize("chunk_states", [3, 1024])
@pytest.mark.parametrize("model, bugs, options", [
    ("solo", (), {}),
    ("solo", (), {"symmetry": True}),
    ("solo-crash", (), {}),
    ("solo", ("NoAbortNotice", "NoTimeout"), {"keep_going": True}),
    ("solo", ("NoGenBump", "NoTombstone"), {}),
    ("zoo-lost-tombstone", (), {"keep_going": True}),
])
def test_workers_give_every_figure_of_the_serial_checker(monkeypatch, chunk_states, model,
                                                         bugs, options):
    monkeypatch.setattr(parallel, "CHUNK_STATES", chunk_states)
    _, m = load(model)
    m = m.with_bugs(m.bugs | set(bugs)) if bugs else m
    one = Checker(m, **options).run()
    two = ParallelChecker(m, workers=2, **options).run()
    assert figures(two, m) == figures(one, m)


@pytest.mark.parametrize("model, options", [
    ("solo-crash", {}),
    ("workers-2x2", {"symmetry": True, "orbits": True}),
    ("zoo-lost-tombstone", {"keep_going": True}),
])
def test_workers_that_forget_what_they_sent_give_the_same_figures(monkeypatch, model, options):
    """A worker's set of the fingerprints it sent is bounded (SEEN_MAX): past it, the worker
    forgets them and sends those states again, which the coordinator drops. Forgetting after
    every 20 changes no figure, no counterexample and no orbit sum."""
    monkeypatch.setattr(parallel, "SEEN_MAX", 20)
    monkeypatch.setattr(parallel, "CHUNK_STATES", 16)
    _, m = load(model)
    one = Checker(m, **options).run()
    two = ParallelChecker(m, workers=2, **options).run()
    assert figures(two, m) == figures(one, m)
    assert two.orbit_states == one.orbit_states


def test_the_coordinator_does_not_rebuild_the_states(monkeypatch):
    """What made 2 workers slower than one (issue 30 item 8: 119 s against 47 s on the
    default model) was the coordinator: it unpickled every state a worker sent, pickled it
    again for the worker that expanded it, and took the results a tuple per state. A state
    now stays pickled from the worker that found it to the one that expands it: the
    coordinator builds only the initial state and the witness's trace."""
    from spec import core

    built = [0]
    new = core.State.__new__

    def counted(cls, *fields, **named):
        built[0] += 1
        return new(cls, *fields, **named)

    monkeypatch.setattr(core.State, "__new__", counted)
    _, m = load("solo")
    result = ParallelChecker(m, workers=2).run()
    assert result.distinct_states == 963
    assert built[0] < 100


def test_a_worker_that_dies_ends_the_check_with_one_line_not_a_hang():
    """A worker killed (for memory, say) must not leave the coordinator waiting forever on
    a pipe whose other end it holds itself."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import os, sys\n"
              "from spec.check import parallel\n"
              "parallel._expand = lambda segments: os._exit(9)\n"
              "from api.cli import main\n"
              "sys.exit(main(['check', '--model', 'solo', '--workers', '2', '--quiet']))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "kvproof check: a checker worker process ended in the middle of the search (exit "
        "status 9; killed for memory?): no verdict"]
