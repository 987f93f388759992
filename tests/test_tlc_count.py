"""States generated, counted as TLC counts them, checked against the spec's own text.

TLC reported 2,385,281 states generated on default.cfg where kvproof said 2,357,447: TLC
generates a successor once per way its guard holds (spec/check/tlccount.py). The evaluator,
compiled to branch where TLC branches, lists TLC's successors from KVTransfer.tla itself;
the checker's count over the core must equal it.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from spec.check import checker, tlccount
from spec.check.checker import Checker
from spec.check.zoo import BASES
from spec.model import ALL_BUGS, Model
from spec.tlaplus.conformance import spec_for
from spec.tlaplus.tlaeval import explore

TINY = dict(requests=2, max_prompt_pages=1, context_pages=1, prefill_pages=1, decode_pages=1)
# The switches of a final word before the writes and of a decode restart came later: the
# thirteen before them keep the figures pinned first, and the four get models of their own.
LATER = frozenset({"EarlyDone", "NoLandedCount", "GenerationReset", "NoEpochCheck"})
# name -> the model, and (distinct states, generated as TLC counts them, core transitions + 1);
# re-pinned when the prefill began to wait for decode's page table (the bootstrap queue), and
# for the locality change (issue 11): a crashed prefill restarts with sent = 0 (fewer states
# with crashes), decode counts landed writes itself (more states where a crash flushed some)
MODELS: dict[str, tuple[Model, tuple[int, int, int]]] = {
    "solo": (Model(**BASES["solo"]), (963, 1581, 1554)),
    "solo-crash": (Model(**BASES["solo-crash"]), (1252, 2047, 2020)),
    "solo-decode-crash": (Model(**BASES["solo-decode-crash"]), (2095, 3306, 3232)),
    # Admit and Release guards that hold two ways
    "solo-bugs": (Model(bugs={"EagerRelease", "FinishedNotRejected", "PoolBelowContext"},
                        **BASES["solo"]), (1655, 3125, 2706)),
    "small-every-switch": (Model(bugs=ALL_BUGS - LATER, **BASES["small"]),
                           (26909, 89383, 78932)),
    # SendDone's and Release's guards with EarlyDone and NoLandedCount, a revived bootstrap's
    # three ways to lose something at a decode crash (NoEpochCheck)
    "solo-decode-crash-later": (Model(bugs=LATER | {"NoTimeout"}, **BASES["solo-decode-crash"]),
                                (1783, 3755, 3674)),
    # every kind of loss (with the resends of lost messages and the write timer), and the
    # prefill crash that an early Done's writes enable
    "solo-crash-lossy": (Model(bugs={"EarlyDone"}, losses={"Bootstrap", "FinalWord", "Cancel",
                                                            "Write"}, **BASES["solo-crash"]),
                         (3013, 8216, 8171)),
    # two requests a decode crash can catch at once
    "tiny-decode-crash": (Model(decode_crashes=True, bugs={"NoTimeout"}, **TINY),
                          (24709, 58841, 56313)),
    # worker sets: a refused prompt is placed nowhere, once per placement for TLC; crashes
    # per worker count only that worker's requests
    "tiny-placements": (Model(requests=1, max_prompt_pages=2, context_pages=1, prefill_pages=1,
                              decode_pages=1, crashes=True, decode_crashes=True,
                              prefill_workers=2, decode_workers=2), (1086, 1789, 1754)),
}


@lru_cache(maxsize=None)
def tlc_generated_from_the_spec(name: str) -> tuple[int, int]:
    found = explore(spec_for(MODELS[name][0], tlc_branching=True))
    return found.states, found.generated


def checked(name: str):
    return Checker(MODELS[name][0], invariants=(), liveness=False).run()


@pytest.mark.parametrize("name", MODELS)
def test_the_checker_counts_generated_states_as_tlc_enumerates_the_spec(name):
    result = checked(name)
    assert (result.distinct_states, result.states_generated) == tlc_generated_from_the_spec(name)
    assert (result.distinct_states, result.states_generated, result.transitions + 1) == \
        MODELS[name][1]


@pytest.mark.parametrize("action", sorted(tlccount.WAYS))
def test_every_guard_in_the_table_is_needed(monkeypatch, action):
    """Without its entry, some model's count leaves TLC's."""
    monkeypatch.setattr(checker, "TLC_WAYS",
                        {a: f for a, f in tlccount.WAYS.items() if a != action})
    assert any(checked(name).states_generated != tlc_generated_from_the_spec(name)[1]
               for name in MODELS)


def test_without_tlc_branching_the_evaluator_lists_each_successor_once():
    plain = explore(spec_for(MODELS["solo"][0]))
    assert plain.generated == MODELS["solo"][1][2]
