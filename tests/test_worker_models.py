"""Worker sets in the spec and the core (issue 25 item 1): placement, per-worker crashes,
symmetry over workers, and the figures of the worker models.

The shipped worker models (spec/models/workers-*.cfg) conform in tests/test_conformance.py
and their TLC figures are pinned in tests/test_tlc.py. The two-request worker models are
larger: their figures are pinned here behind KVPROOF_WORKER_MODELS=1 (a few minutes of one
core; `python -m bench.worker_models` prints them with times and memory).
"""

from __future__ import annotations

import os
import random
from itertools import permutations

import pytest

from spec import core
from spec.check.checker import Checker
from spec.check.parallel import ParallelChecker
from spec.check.symmetry import canonical, orbit_size, relabel, relabel_workers
from spec.check.zoo import BASES, THREE_REQUEST_WORKER_BASES, TWO_REQUEST_WORKER_BASES
from spec.core import (ABORTED, DW, ERR_PREFILL, PST, PW, QUEUED, Arrive, DecodeCrash,
                       PrefillCrash, Reserve, apply, initial_state)
from spec.model import Model
from spec.tlaplus.conformance import check_conformance

TWO_BY_ONE = Model(requests=2, max_prompt_pages=1, context_pages=1, prefill_pages=1,
                   decode_pages=1, crashes=True, decode_crashes=True, prefill_workers=2)


def run(m, *events):
    s = initial_state(m)
    for event in events:
        s = apply(m, s, event)
        assert not isinstance(s, core.Refusal), s
    return s


def test_the_router_places_a_request_on_the_workers_it_names():
    s = run(TWO_BY_ONE, Arrive(0, 1, 1, 0))
    assert (s.requests[0][PW], s.requests[0][DW]) == (1, 0)
    # A prompt the router refuses is placed nowhere.
    m = Model(requests=1, max_prompt_pages=2, context_pages=1, prefill_pages=1,
              decode_pages=1, prefill_workers=2)
    s = run(m, Arrive(0, 2, 1, 0))
    assert (s.requests[0][PW], s.requests[0][DW]) == (core.NONE, core.NONE)


def test_a_prefill_crash_takes_only_its_own_requests():
    s = run(TWO_BY_ONE, Arrive(0, 1, 0, 0), Arrive(1, 1, 1, 0), PrefillCrash(0))
    assert s.requests[0][PST] == ABORTED and s.requests[0][core.CLIENT] == ERR_PREFILL
    assert s.requests[1][PST] == QUEUED
    assert isinstance(apply(TWO_BY_ONE, run(TWO_BY_ONE, Arrive(0, 1, 0, 0)), PrefillCrash(1)),
                      core.Refusal)  # worker 1 has nothing to lose


def test_a_decode_crash_takes_only_its_own_requests_and_pages():
    m = Model(**{**BASES["workers-1x2"], "requests": 2})
    s = run(m, Arrive(0, 1, 0, 0), Arrive(1, 1, 0, 1), Reserve(0, (0,)), Reserve(1, (3,)),
            DecodeCrash(1))
    assert s.requests[1][core.DST] == core.TOMB and s.requests[0][core.DST] == core.D_WAITING
    assert s.decode_pool[0][core.OWNER] == 0 and s.decode_pool[3][core.OWNER] == core.NONE


def test_a_request_allocates_only_in_its_own_workers_pools():
    m = Model(**BASES["workers-1x2"])
    s = run(m, Arrive(0, 1, 0, 1))
    assert "does not exist in the request's decode worker" in \
        str(apply(m, s, Reserve(0, (0,))))  # page 0 is decode worker 0's
    assert not isinstance(apply(m, s, Reserve(0, (3,))), core.Refusal)


def test_a_core_that_reserves_in_another_workers_pool_does_not_conform(monkeypatch):
    """The mutant: decode takes free pages of any decode worker. Conformance on the 1x2 model
    finds it; the same check passes on the correct core (tests/test_conformance.py)."""
    monkeypatch.setattr(core, "decode_pages_of", lambda m, s, row: range(len(s.decode_pool)))
    result = check_conformance(Model(**BASES["workers-1x2"]))
    assert not result.ok
    assert "Reserve" in result.disagreement.report(result.model)


def test_worker_symmetry_is_a_canonical_form():
    """Every renaming of workers (and requests) of a reachable state has the same
    representative, and the reduced count is pinned (10,566 states, 2,643 orbits)."""
    m = Model(**BASES["workers-2x2"])
    result = Checker(m, symmetry=True, invariants=(), liveness=False).run()
    assert result.distinct_states == 2643
    s = run(m, Arrive(0, 2, 1, 0), Reserve(0, (0, 1)))
    c = canonical(s, m)
    for prefill in permutations(range(2)):
        for decode in permutations(range(2)):
            renamed = relabel_workers(s, prefill, decode, m.prefill_pages, m.decode_pages)
            assert canonical(renamed, m) == c



def test_the_canonical_form_is_one_per_orbit_along_random_walks():
    """`canonical` tries only the worker renamings that sort the workers' signatures: along
    random walks of the three-request 2 x 2 model (seed 7, printed; 300 states), every one of the 24
    renamings of requests, prefill and decode workers of each state visited has the same
    representative as the state, the representative is in the state's orbit, and
    `orbit_size` is the number of distinct renamings."""
    m = Model(name="workers3-2x2", **THREE_REQUEST_WORKER_BASES["workers3-2x2"])
    seed = 7
    print(f"seed {seed}")
    rng = random.Random(seed)
    renamings = [(p, d, r) for p in permutations(range(2)) for d in permutations(range(2))
                 for r in permutations(range(3))]
    visited = walks = 0
    while visited < 300 and walks < 100:
        walks += 1
        s = initial_state(m)
        for _ in range(30):
            c = canonical(s, m)
            images = {relabel(relabel_workers(s, p, d, m.prefill_pages, m.decode_pages), r)
                      for p, d, r in renamings}
            assert c in images
            assert all(canonical(image, m) == c for image in images), s
            assert orbit_size(s, m) == len(images), s
            visited += 1
            nexts = list(core.successors(m, s))
            if not nexts:
                break
            s = rng.choice(nexts)[1]
    assert visited >= 300


TWO_REQUESTS_ONE_PAIR = dict(requests=2, max_prompt_pages=1, context_pages=1, prefill_pages=1,
                             decode_pages=1, crashes=True)  # 10,621 states, 5,316 orbits


@pytest.mark.parametrize("name", ["workers-2x2", "workers-2x1", "two-requests-one-pair"])
def test_the_orbits_of_a_reduced_search_count_the_unreduced_states(name):
    """With orbits=True a reduced search sums the sizes of the orbits it expands: the
    states of the search without symmetry (serial and parallel alike)."""
    m = Model(name=name, **BASES.get(name, TWO_REQUESTS_ONE_PAIR))
    plain = Checker(m, invariants=(), liveness=False).run()
    serial = Checker(m, symmetry=True, orbits=True, invariants=(), liveness=False).run()
    parallel = ParallelChecker(m, workers=2, symmetry=True, orbits=True, invariants=(),
                               liveness=False).run()
    assert serial.distinct_states < plain.distinct_states
    assert serial.orbit_states == parallel.orbit_states == plain.distinct_states
    with pytest.raises(ValueError, match="needs symmetry"):
        Checker(m, orbits=True)

# The two-request worker models: (distinct states, orbits under requests and workers).
WORKER_FIGURES = {
    "workers2-1x1": (82895, 41476),
    "workers2-2x1": (334487, 83701),
    "workers2-1x2": (373741, 93501),
    "workers2-2x2": (1378641, 172582),
}


@pytest.mark.skipif(os.environ.get("KVPROOF_WORKER_MODELS") != "1",
                    reason="the two-request worker models take minutes: KVPROOF_WORKER_MODELS=1")
@pytest.mark.parametrize("name", sorted(WORKER_FIGURES))
def test_the_two_request_worker_models_figures(name):
    m = Model(name=name, **TWO_REQUEST_WORKER_BASES[name])
    plain = Checker(m, invariants=(), liveness=False).run()
    reduced = Checker(m, symmetry=True, orbits=True, invariants=(), liveness=False).run()
    assert (plain.distinct_states, reduced.distinct_states) == WORKER_FIGURES[name]
    assert reduced.orbit_states == plain.distinct_states


SAMPLE_SEED = 1  # replay: simulate(m, seed=SAMPLE_SEED + k, traces=1, ...)
SAMPLE_STEPS = 13640  # steps of the 1,000 behaviours drawn from SAMPLE_SEED


def test_the_three_request_two_by_two_model_is_sampled():
    """Beyond exhaustive checking here, so CI samples it: behaviours drawn at random, every
    invariant on every state (kvproof check --simulate). A mutant that lets a decode crash
    free another worker's pages is found by the same sample."""
    from spec.check.simulate import simulate
    from spec.check.zoo import THREE_REQUEST_WORKER_BASES
    from spec.properties import ALL_INVARIANTS

    m = Model(name="workers3-2x2", **THREE_REQUEST_WORKER_BASES["workers3-2x2"])
    print(f"seed {SAMPLE_SEED}")
    result = simulate(m, seed=SAMPLE_SEED, depth_max=40, traces=1000, invariants=ALL_INVARIANTS)
    assert result.ok, result.violations[:1]
    assert result.steps == SAMPLE_STEPS


def test_the_sample_catches_a_crash_that_frees_another_workers_pages(monkeypatch):
    from spec.check.simulate import simulate
    from spec.check.zoo import THREE_REQUEST_WORKER_BASES
    from spec.properties import ALL_INVARIANTS

    real = core.decode_crash

    def crash_everything(m, s, d=0):  # the mutant: frees every decode worker's pages
        out = real(m, s, d)
        if isinstance(out, str):
            return out
        freed = tuple((k, (core.NONE, g, data, tag, *cache)) for k, (o, g, data, tag, *cache)
                      in enumerate(s.decode_pool) if o != core.NONE)
        return out._replace(decode=freed)

    monkeypatch.setitem(core.ACTIONS, core.DecodeCrash, crash_everything)
    monkeypatch.setattr(core, "decode_crash", crash_everything)
    m = Model(name="workers3-2x2", **THREE_REQUEST_WORKER_BASES["workers3-2x2"])
    result = simulate(m, seed=SAMPLE_SEED, depth_max=40, traces=1000, invariants=ALL_INVARIANTS)
    assert not result.ok
