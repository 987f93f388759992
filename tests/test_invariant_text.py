"""Every state invariant is written twice: in KVTransfer.tla (what TLC and `kvproof validate`
evaluate) and in spec/properties.py (what `kvproof check`, the simulator and the fuzzers
evaluate). Nothing else ties the two texts together: conformance compares states, not
invariants. So here both are evaluated on the same states, along seeded random walks of
the core over models that cover every variable they read (prefix caching, workers, losses,
crashes) and over bug models whose walks break them, and must agree on every state.

A restatement of an invariant's TLA text for speed (ReadersAreLive as its two directions,
so that a deployment's 10,000 request slots are not each visited for every page) is
checked by this test against the Python property it must keep meaning."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from spec import core
from spec.check.cfgfile import load
from spec.properties import STATE_INVARIANTS
from spec.tlaplus.runcheck import checker_for

MODELS = Path(__file__).resolve().parent.parent / "spec" / "models"
SEED, WALKS, STEPS, BRANCHES = 7, 40, 40, 3

A, R, Ad, S, L, D = core.Arrive, core.Reserve, core.Admit, core.SendPage, core.LandWrite, core.SendDone
# The checker's shortest counterexamples (`kvproof check --model spec/models/CFG.cfg`), pinned:
# walks rarely reach them (they need a dozen steps in one order), and on them and on walks
# branching off every state of them both verdicts of the invariant they break occur.
TRACES = {
    "bug-NoRefCount": [A(0, 1, 0, 0, (1,), 1), R(0, (0,)), Ad(0, (0,)), S(0), A(1, 1, 0, 0, (1,), 1),
                       L(0, 0), D(0), core.Accept(0, True), core.Finish(0, True), R(1, ()),
                       core.Release(0)],
    "bug-NoSalt": [A(0, 1, 0, 0, (1,), 1), R(0, (0,)), Ad(0, (0,)), S(0), A(1, 1, 0, 0, (1,), 2),
                   L(0, 0), D(0), core.Accept(0, True), R(1, ())],
    "incident": [A(0, 2, 0, 0), R(0, (1, 2)), Ad(0, (0, 1)), S(0), S(0), A(1, 3, 0, 0), L(0, 1),
                 L(0, 2), core.PrefillFail(0), core.Notice(0), core.Release(0),
                 R(1, (0, 1, 2)), Ad(1, (0,)), S(1), L(1, 0), D(1), core.Accept(1, True),
                 core.Finish(1, True)],
    "bug-SourceReuse": [A(0, 1, 0, 0), R(0, (0,)), Ad(0, (0,)), S(0)],
    "bug-EvictWhileSending": [A(0, 1, 0, 0, (1,), 1), A(1, 1, 0, 0, (1,), 1), R(0, (0,)),
                              R(1, (1,)), Ad(0, (0,)), S(0), L(0, 0), D(0), Ad(1, ()),
                              core.PrefillEvict(0, 0)],
    "bug-EagerRelease": [A(0, 1, 0, 0), R(0, (0,)), Ad(0, (0,)), S(0), core.Timeout(0),
                         core.Release(0)],
}
# (cfg, the invariants its pinned trace breaks: the test sees both verdicts of each)
CASES = [
    ("prefix", ()),
    ("prefix-chain", ()),
    ("workers-2x2", ()),
    ("lossy-decode-crash", ()),
    ("bug-NoRefCount", ("ExclusiveOwner", "ReadersAreLive")),
    ("bug-NoSalt", ("SaltsApart",)),
    ("incident", ("RejectedIsError", "Isolation", "OkIsClean")),
    ("bug-SourceReuse", ("SourceHeld",)),
    ("bug-EagerRelease", ("NoWriteIntoForeign",)),
    ("prefix-prefill", ()),
    ("prefix-prefill-crash", ()),
    ("bug-EvictWhileSending", ("SealedIsQuiet",)),
]


def walk(m, s, rng, steps: int):
    """The states of one random walk of at most `steps` steps from s (s excluded)."""
    for _ in range(steps):
        moves = list(core.successors(m, s))
        if not moves:
            return
        _, s = rng.choice(moves)
        yield s


def states_of(m, trace, seed: int):
    """The start, WALKS random walks from it, the pinned trace (each step legal) and
    BRANCHES short walks off every state of the trace."""
    rng = random.Random(seed)
    start = core.initial_state(m)
    yield start
    for _ in range(WALKS):
        yield from walk(m, start, rng, STEPS)
    s = start
    for event in trace:
        out = core.apply(m, s, event)
        assert type(out) is not core.Refusal, (event, out)
        s = out
        yield s
        for _ in range(BRANCHES):
            yield from walk(m, s, rng, 6)


@pytest.mark.parametrize("name, must_break", CASES, ids=[c[0] for c in CASES])
def test_every_state_invariant_means_the_same_in_the_spec_and_in_python(name, must_break):
    _, m = load(str(MODELS / f"{name}.cfg"))
    checker = checker_for(m)
    assert set(checker.invariants) == set(STATE_INVARIANTS)
    verdicts, states = Counter(), 0
    for s in states_of(m, TRACES.get(name, ()), SEED):
        states += 1
        tla_state = checker.keys(s)
        for invariant, holds in checker.invariants.items():
            python = bool(STATE_INVARIANTS[invariant](m, s))
            assert bool(holds(tla_state)) == python, (
                f"{name}: {invariant} is {python} in spec/properties.py and "
                f"{not python} in KVTransfer.tla on {s}")
            verdicts[invariant, python] += 1
    assert states > WALKS
    for invariant in must_break:
        assert verdicts[invariant, False] and verdicts[invariant, True], (name, invariant)
