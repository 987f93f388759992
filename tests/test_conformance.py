"""Spec ≡ code: KVTransfer.tla, evaluated from its text, and the core have the same graph."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from spec import core
from spec.check.cfgfile import load, model_names
from spec.tlaplus.conformance import (SPEC_PATH, check_conformance, sample_conformance,
                                      spec_for)
from spec.model import ALL_BUGS, Model
from spec.tlaplus.tlaeval import EvalError, Spec, explore
from spec.tlaplus.tlaview import ModelValue
from spec.check.zoo import BASES

# Every .cfg of spec/models, grouped by the transition system it defines: cfgs with the same
# constants (a bug-X cfg and a zoo entry with the one switch X) are one model, checked once;
# conformance does not read a cfg's invariants.
MODELS: dict[Model, list[str]] = {}
for _name in model_names():
    MODELS.setdefault(replace(load(_name)[1], name=""), []).append(_name)

# Distinct states the check visits: one per orbit under renaming of requests where there is
# more than one request, exactly the core checker's counts (`kvproof check --symmetry`).
STATES = {
    "bug-AdmitBeforeReserve": 435319, "bug-EagerRelease": 1152801,
    "bug-FinishedNotRejected": 386013, "bug-NoAbortNotice": 199837, "bug-NoCancel": 88791,
    "bug-NoChecksum": 386013, "bug-NoCountCheck": 386013, "bug-NoGenBump": 379125,
    "bug-NoTimeout": 145074, "bug-NoTombstone": 394491, "bug-PoolBelowContext": 428992,
    "bug-SourceReuse": 499923, "crash": 633874, "decode-crash": 161422, "default": 386013,
    "incident": 483615, "large": 1227556, "reject-paths": 1078, "small": 33198, "solo": 963,
    "solo-crash": 1252, "solo-decode-crash": 2095, "wide": 964, "zoo-dead-prefill": 742,
    "zoo-late-write-looks-current": 1035873, "zoo-lost-tombstone": 617,
    "zoo-no-cancel": 676, "zoo-no-timeout": 171412, "zoo-rejected-decodes": 496789,
    "zoo-silent-prefill-abort": 433, "zoo-source-reuse-unverified": 508107,
    # Timely timers: on default's constants no timer fires without a crash (so it is
    # bug-NoTimeout's graph); StopwatchTimeout brings back default's early timers.
    "timely": 145074, "timely-crash": 266707, "bug-StopwatchTimeout": 386013,
    # An early final word and a decode restart (issue 25).
    "bug-EarlyDone": 1612, "bug-NoLandedCount": 33198, "bug-GenerationReset": 1626,
    "bug-NoEpochCheck": 2806, "zoo-early-done": 1281, "zoo-revived-bootstrap": 1708,
    # A network that loses things for good (issue 25), on solo-crash's constants, with the
    # resends of lost messages and decode's write timer (lossy: every kind of loss;
    # bug-NoRetransmit and bug-NoRevoke: on lossy).
    "loss-Bootstrap": 1264, "loss-FinalWord": 1492, "loss-Cancel": 1432, "loss-Write": 2011,
    "lossy": 2635, "bug-NoRetransmit": 2605, "bug-NoRevoke": 2404,
    # Both kinds of crash on that network: a decode crash's notice is the prefill's failure
    # detector, which no network loses (bug-NoFailureDetector: a message it may lose).
    "lossy-decode-crash": 4380, "bug-NoFailureDetector": 4519,
    # Worker sets (issue 25): one request, every placement, each worker crashing alone.
    "workers-1x2": 5284, "workers-2x1": 5284, "workers-2x2": 10566,
    # Prefix caching, decode side (issue 27): the prefix models and the graphs of its
    # switches (each zoo-X of one switch is bug-X's graph).
    "prefix": 420895, "prefix-chain": 633677, "prefix-crash": 1094048,
    "bug-StaleHitLength": 196137,
    "bug-NoRefCount": 401311, "bug-FullHitNoNotice": 412907, "bug-NoSalt": 435743,
    "zoo-stale-hit-reads-unwritten": 189172,
    # Prefix caching at the prefill too (issue 27): the prefix model with one salt and the
    # prefill's own cache, and EvictWhileSending on it (zoo-evict-while-sending's graph).
    "prefix-prefill": 211869, "bug-EvictWhileSending": 215997, "prefix-prefill-crash": 280919,
    # The content identity in the page tag (issue 28): without it the prefix model's graph;
    # with NoSalt too, zoo-cross-tenant-read: bug-NoSalt's graph before the identity, which
    # turned its cross-tenant reads into ErrTag (436,279 orbits then, its companion 95,882).
    "bug-NoIdentTag": 420895, "zoo-cross-tenant-read": 436279,
}
# The switches of an early final word and of a decode restart came after the pinned
# every-switch figure: it stays pinned for the thirteen before them.
LATER = frozenset({"EarlyDone", "NoLandedCount", "GenerationReset", "NoEpochCheck"})


def _cost(model: Model) -> int:
    return STATES[MODELS[model][0]] * model.requests


# The models whose whole graph costs most of a minute or more of one core (together about
# ten minutes here: half of the suite's time) are compared along random walks in CI, every
# state on a walk exactly as the whole-graph check compares it; every other model, default
# and the prefix models without a switch among them, is compared whole.
# KVPROOF_FULL_CONFORMANCE=1 compares every model whole (`python -m spec.tlaplus.conformance
# --all` does too, printing progress). Each sampled model has a companion compared whole:
# its switches (and its prefix cache, crashes and token kinds) on smaller pools (`companion`),
# so what only walks see is the larger pools, prompts and placements.
SAMPLED_ABOVE_ORBITS = 400_000
ALWAYS_WHOLE = frozenset({"prefix", "prefix-chain"})  # a companion would lose their tails
FULL = os.environ.get("KVPROOF_FULL_CONFORMANCE") == "1"
WALKS, WALK_SEED = 1000, 0
SAMPLED = frozenset(names[0] for names in MODELS.values()
                    if STATES[names[0]] > SAMPLED_ABOVE_ORBITS and names[0] not in ALWAYS_WHOLE)
# States each sampled model's walks compare (the core lists successors in one order in
# every process, so the walks are the same under any PYTHONHASHSEED).
SAMPLED_STATES = {
    "bug-AdmitBeforeReserve": 14676, "bug-EagerRelease": 16114,
    "bug-PoolBelowContext": 18836, "bug-SourceReuse": 12858, "crash": 11049,
    "incident": 19234, "large": 17069, "zoo-late-write-looks-current": 16112,
    "zoo-rejected-decodes": 19239, "zoo-source-reuse-unverified": 12858,
    "bug-FullHitNoNotice": 18287, "bug-NoRefCount": 17918, "bug-NoSalt": 18277,
    "prefix-crash": 11121, "bug-NoIdentTag": 18287, "zoo-cross-tenant-read": 18277,
}


def companion(model: Model) -> Model:
    """A sampled model's companion, compared whole. Without a prefix cache: its switches on
    the two-request small model (pools of 1 and 2 pages, prefill crashes). With one: the
    model itself with a one-page prefill pool (one-page prompts served: hits, misses,
    evictions and salts, but no tail after a partial hit: the prefix model, compared whole,
    has those)."""
    if model.prefix_cache:
        return replace(model, name="", prefill_pages=1)
    return Model(bugs=model.bugs, **BASES["small"])


# Orbits of each companion, by the sampled models it stands for.
COMPANION_STATES = {
    ("bug-AdmitBeforeReserve",): 38234, ("bug-EagerRelease",): 87783,
    ("bug-PoolBelowContext",): 47128, ("bug-SourceReuse",): 45136,
    ("crash", "large"): 33198, ("incident",): 56298, ("zoo-late-write-looks-current",): 81891,
    ("zoo-rejected-decodes",): 57601, ("zoo-source-reuse-unverified",): 45896,
    ("bug-FullHitNoNotice",): 92514, ("bug-NoRefCount",): 90458, ("bug-NoSalt",): 95826,
    ("prefix-crash",): 166284, ("bug-NoIdentTag",): 93930, ("zoo-cross-tenant-read",): 95882,
}
COMPANIONS: dict[Model, list[str]] = {}
for _model, _names in MODELS.items():
    if _names[0] in SAMPLED:
        COMPANIONS.setdefault(companion(_model), []).append(_names[0])


@pytest.mark.alone  # each model is a unit of work of its own for pytest-xdist (conftest.py)
@pytest.mark.parametrize("model", sorted(MODELS, key=_cost, reverse=True),
                         ids=lambda model: "=".join(MODELS[model]))
@pytest.mark.slow
def test_every_model_conforms(model, capsys):
    """The largest first, so that the parallel run ends on the small ones. About 20 s of
    one core per 400k orbits here."""
    names = MODELS[model]
    model = replace(model, name=names[0])
    if names[0] in SAMPLED and not FULL:
        result = sample_conformance(model, walks=WALKS, seed=WALK_SEED)
        with capsys.disabled():
            print(f"\n{names[0]}: {WALKS} random walks, seed {WALK_SEED}: {result.states:,} "
                  f"states compared of {STATES[names[0]]:,} orbits "
                  "(KVPROOF_FULL_CONFORMANCE=1: all)")
        assert result.ok, result.disagreement.report(model)
        assert result.states == SAMPLED_STATES[names[0]]
        return
    result = check_conformance(model, symmetry=model.requests > 1)
    assert result.ok, result.disagreement.report(model)
    assert result.states == STATES[names[0]]
    if names[0] == "default":
        assert result.edges == 1041251


def test_every_sampled_model_has_its_walks_and_its_companion_pinned():
    assert set(SAMPLED_STATES) == SAMPLED
    assert {tuple(names) for names in COMPANIONS.values()} == set(COMPANION_STATES)


@pytest.mark.slow
@pytest.mark.parametrize("names", sorted(COMPANION_STATES), ids="+".join)
def test_each_sampled_models_companion_conforms_whole(names):
    model = next(m for m, stands_for in COMPANIONS.items() if tuple(stands_for) == names)
    result = check_conformance(model, symmetry=True)
    assert result.ok, result.disagreement.report(model)
    assert result.states == COMPANION_STATES[names]


# The prefill-side cache beside the switches that touch its pages, on a one-page prefill
# pool (none of them is a shipped model's): a placeholder that is never sealed, an early
# Done over sealed sources, an eviction under a send, reused sources, salts and references.
PREFILL_CACHE_CORNERS = {
    ("PoolBelowContext", "FinishedNotRejected", "EarlyDone"): (1, 70927),
    ("EvictWhileSending", "SourceReuse", "NoChecksum"): (1, 33524),
    ("NoSalt", "NoRefCount", "StaleHitLength"): (2, 85442),
}


@pytest.mark.slow
@pytest.mark.parametrize("bugs", sorted(PREFILL_CACHE_CORNERS), ids="+".join)
def test_the_prefill_cache_conforms_beside_the_switches_that_touch_its_pages(bugs):
    tenants, states = PREFILL_CACHE_CORNERS[bugs]
    model = Model(name="prefill-cache-corner", bugs=frozenset(bugs),
                  **{**BASES["prefix-prefill"], "prefill_pages": 1, "tenants": tenants})
    result = check_conformance(model, symmetry=True)
    assert result.ok, result.disagreement.report(model)
    assert result.states == states


def test_random_walks_catch_a_mutated_core_on_a_large_model(monkeypatch):
    """The walks have teeth: the Release mutant below is found on `large` within the CI
    walks (on its first walks: most runs end in a Release)."""
    mutated = tuple((cls, _patched_release if fn is core.release else fn)
                    for cls, fn in core._SIMPLE_ACTIONS)
    monkeypatch.setattr(core, "_SIMPLE_ACTIONS", mutated)
    monkeypatch.setattr(core, "_CACHES", {})
    model = next(replace(m, name="large") for m, names in MODELS.items() if "large" in names)
    result = sample_conformance(model, walks=WALKS, seed=WALK_SEED)
    assert not result.ok
    assert "the core allows, the spec does not:\n  Release:" in result.disagreement.report(model)


@pytest.mark.slow
@pytest.mark.parametrize("bugs, states", [(frozenset(), 66384), (ALL_BUGS - LATER, 26909),
                                          (ALL_BUGS, 57611)],
                         ids=["guards-on", "every-first-switch", "every-switch"])
def test_the_two_request_conformance_model_conforms(bugs, states):
    """Every switch off, then every switch on: each guard's branch is compared both ways,
    with two requests contending for pages and prefill crashes on."""
    model = Model(bugs=bugs, **BASES["small"])
    result = check_conformance(model)
    assert result.ok, result.disagreement.report(model)
    assert result.states == states


@pytest.mark.slow
def test_symmetric_conformance_visits_one_state_per_orbit():
    model = Model(bugs=frozenset({"EagerRelease", "NoTimeout"}), **BASES["small"])
    plain, reduced = check_conformance(model), check_conformance(model, symmetry=True)
    assert plain.ok and reduced.ok
    assert reduced.states < plain.states
    from spec.check.checker import check
    explored = check(model, symmetry=True, liveness=False, invariants=())
    assert reduced.states == explored.distinct_states


def _patched_release(m, s, r):
    """A mutant: release without waiting for the prefill's final word or in-flight writes."""
    if s.requests[r][core.DST] != core.CLOSING:
        return "not closing"
    return core.release(m.with_bugs(m.bugs | {"EagerRelease"}), s, r)


def test_a_mutated_core_is_caught_with_a_readable_diff(monkeypatch):
    mutated = tuple((cls, _patched_release if fn is core.release else fn)
                    for cls, fn in core._SIMPLE_ACTIONS)
    monkeypatch.setattr(core, "_SIMPLE_ACTIONS", mutated)
    monkeypatch.setattr(core, "_CACHES", {})
    model = Model(**BASES["solo"])
    result = check_conformance(model)
    assert not result.ok
    report = result.disagreement.report(model)
    assert "spec and core disagree after 3 steps" in report
    assert "the core allows, the spec does not:\n  Release:" in report
    assert "Timeout(r1)" in report


def test_a_mutated_spec_is_caught_too():
    text = SPEC_PATH.read_text()
    guard = 'Timeout(r) ==\n    /\\ "NoTimeout" \\notin Bugs\n    /\\ dst[r] = "Waiting"\n'
    assert guard in text
    weaker = guard.replace('dst[r] = "Waiting"', 'dst[r] \\in {"Waiting", "Decoding"}')
    model = Model(**BASES["solo"])
    result = check_conformance(model, spec_for(model, text.replace(guard, weaker, 1)))
    assert not result.ok
    report = result.disagreement.report(model)
    assert "the spec allows, the core does not:\n  Timeout:" in report


def test_a_spec_that_cannot_be_evaluated_is_reported_at_its_state():
    """Dropping SendPage's guard on the prefill's copy of the page table makes the spec
    index an empty table, which TLC would report as an error too (with AdmitBeforeReserve:
    the bootstrap queue would otherwise make the guard redundant)."""
    guard = "    /\\ ptable[r] # <<>>\n"
    assert SPEC_PATH.read_text().count(guard) == 1
    text = SPEC_PATH.read_text().replace(guard, "", 1)
    model = Model(bugs={"AdmitBeforeReserve"}, **BASES["solo"])
    result = check_conformance(model, spec_for(model, text))
    assert not result.ok
    lines = text.splitlines()
    line = next(i for i, x in enumerate(lines, 1) if x.strip().startswith("IN /\\ writes' ="))
    assert f"(line {line}: 1 is not in the domain" in result.disagreement.report(model)


def _module(*definitions: str) -> str:
    return "---- MODULE M ----\nVARIABLE x\n" + "\n".join(definitions) + "\n====\n"


@pytest.mark.parametrize("next_, error", [
    ("x' = [x EXCEPT ![3] = 1]", "line 4: EXCEPT: 3 is not in the domain"),
    ("x' = CHOOSE i \\in 1..2 : i > 2", "line 4: CHOOSE found no value"),
    ("x' = x[1] + x'[2]", "line 4: x' is read before it is assigned"),
    ("x' = x /\\ x' = <<0, 0>>", None),
    ("\\E i \\in 1..2 : x' = [x EXCEPT ![i] = @ + i]", None),
])
def test_evaluation_errors_name_their_line(next_, error):
    """Run-time errors in the compiled spec are reported at the spec's line; the last two
    actions are fine: a second `x' = e` compares, @ is the old value."""
    spec = Spec(_module("Init == x = <<0, 0>>", f"Next == {next_}"), {})
    (init,) = spec.initial_states()
    if error is None:
        assert [label for label, _ in spec.successors(init)] in (["Next"], ["Next", "Next"])
        return
    with pytest.raises(EvalError, match=error):
        list(spec.successors(init))


def test_constructs_outside_the_subset_are_named_with_their_line():
    text = ("---- MODULE M ----\nVARIABLE x\nInit == x = 0\n"
            "Next == x' = x + 1\nF == ENABLED Next\n====\n")
    spec = Spec(text, {})
    with pytest.raises(EvalError, match="line 5.*ENABLED"):
        spec.value("F")
    with pytest.raises(EvalError, match="constant N has no value"):
        Spec("---- MODULE M ----\nCONSTANT N\n====\n", {})


@pytest.mark.slow
def test_the_spec_alone_has_the_cores_graph():
    """explore() enumerates KVTransfer.tla's reachable graph from its text alone, as TLC
    would: the same states and labelled edges as the core's (conformance counts)."""
    model = Model(**BASES["small"])
    result = explore(spec_for(model))
    assert (result.states, result.edges) == (66384, 181044)
    assert len(result.labels) == 18


def test_the_evaluator_computes_spec_level_definitions():
    spec = spec_for(Model(bugs={"PoolBelowContext"}, **BASES["default"]))
    assert spec.value("Advertised") == 3
    assert spec.value("DPages") == frozenset({1, 2, 3})
    assert spec.value("BugNames") == ALL_BUGS
    assert spec.constants["Requests"] == frozenset({ModelValue("r1"), ModelValue("r2")})


def test_the_cli_walks_print_their_seed_and_replay_from_it(capsys):
    from api.cli import main

    assert main(["conformance", "--model", "small", "--walks", "50", "--quiet"]) == 0
    out = capsys.readouterr().out
    replay = out.split("(replay: kvproof ")[1].split(")")[0].split()
    assert replay[:5] == ["conformance", "--model", "small", "--walks", "50"]
    first = out.splitlines()[-1]
    assert "the same successors on every state of 50 random walks" in first
    assert main(replay + ["--quiet"]) == 0
    again = capsys.readouterr().out.splitlines()[-1]
    states = first.split(":")[1].split(" states")[0]
    assert again.split(":")[1].split(" states")[0] == states


def test_a_large_subset_is_tested_not_enumerated():
    """TypeOK's `readers[d][p] \\in SUBSET Requests` on a run's model of 10,000 requests
    (engine/process_engine.py) enumerated 2^10,000 subsets: above 16 elements SUBSET is
    only tested for membership, as TLC does; enumerating it is an error that says so."""
    spec = Spec(_module("S == 1..40", "Small == SUBSET (1..3)", "Init == x = {2, 40}",
                        "Next == x' = x", "Typed == x \\in SUBSET S",
                        "Outside == {41} \\in SUBSET S",
                        "Each == \\A T \\in SUBSET S : 1 \\notin T"), {})
    (init,) = spec.initial_states()
    assert len(spec.value("Small")) == 8
    assert spec.value("Outside") is False
    assert spec.value("Typed", init) is True
    with pytest.raises(EvalError, match="cannot enumerate SUBSET"):
        spec.value("Each")
