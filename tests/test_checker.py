"""The explicit-state checker: exact counts, symmetry, counterexamples, liveness."""

from __future__ import annotations

import pytest

import random
from itertools import permutations

from spec import core
from spec.check.checker import Checker, _Graph, check
from spec.core import Finish, Reserve, apply, initial_state, successors
from spec.model import Model
from spec.check.symmetry import canonical, relabel
from spec.check.zoo import BASES, ENTRY_BY_NAME
from tests.conftest import checked


@pytest.mark.slow
def test_default_model_exact_counts_with_symmetry():
    result = checked("default", frozenset())
    assert result.ok
    assert result.liveness_checked
    assert (result.distinct_states, result.states_generated, result.depth) == (386013, 1054623, 26)
    assert result.transitions == 1041251


def test_solo_model_exact_counts_without_and_with_symmetry():
    """One request: symmetry has nothing to merge."""
    plain = checked("solo", frozenset(), symmetry=False)
    reduced = checked("solo", frozenset())
    assert plain.ok and reduced.ok
    # States generated in TLC's convention (spec/check/tlccount.py); 1,616 transitions.
    assert (plain.distinct_states, plain.states_generated, plain.depth) == (963, 1581, 13)
    assert plain.transitions == 1553
    assert reduced.distinct_states == 963


def _random_reachable_states(m: Model, count: int, seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        s = initial_state(m)
        for _ in range(rng.randrange(1, 30)):
            steps = list(successors(m, s))
            if not steps:
                break
            s = rng.choice(steps)[1]
        out.append(s)
    return out


def test_canonical_form_is_invariant_under_renaming_requests():
    m = Model(**BASES["large"])
    for s in _random_reachable_states(m, 300, seed=7):
        c = canonical(s)
        for order in permutations(range(m.requests)):
            assert canonical(relabel(s, order)) == c


def test_symmetry_reduction_respects_the_transition_relation():
    """Successors of a state and of any renaming of it have the same canonical forms."""
    m = Model(**BASES["large"])
    for s in _random_reachable_states(m, 100, seed=11):
        mine = {canonical(n) for _, n in successors(m, s)}
        for order in permutations(range(m.requests)):
            theirs = {canonical(n) for _, n in successors(m, relabel(s, order))}
            assert mine == theirs


@pytest.mark.slow
def test_counterexample_is_a_real_behaviour_of_the_core():
    entry = ENTRY_BY_NAME["incident"]
    violation = checked("default", entry.bugs, entry.invariants).violation
    state = initial_state(entry.model())
    for event, expected in violation.trace[1:]:
        state = apply(entry.model(), state, event)
        assert state == expected


def test_incident_trace_reads_another_requests_pages_and_the_client_gets_ok():
    entry = ENTRY_BY_NAME["incident"]
    m = entry.model()
    violation = checked("default", entry.bugs, entry.invariants).violation
    assert violation.property == "OkIsClean" and violation.length == 18
    (_, before), (last_event, after) = violation.trace[-2], violation.trace[-1]
    assert isinstance(last_event, Finish)
    r = last_event.request
    table = before.requests[r][core.TABLE]
    owners = {before.decode_pool[page][core.DATA] for page, _ in table}
    others = owners - {r, core.NONE}
    assert others, "decode read a page holding another request's data"
    assert core.CLIENT_NAMES[after.requests[r][core.CLIENT]] == "Ok"
    # The over-long prompt was larger than the prefill pool and sent one page for three.
    assert before.requests[r][core.PROMPT] > m.prefill_pages
    assert (before.requests[r][core.SENT], len(table)) == (1, 3)


def test_state_invariant_violation_reports_the_shortest_trace():
    result = checked("default", frozenset({"SourceReuse"}), symmetry=False)
    v = result.violation
    assert (v.property, v.kind, v.length) == ("SourceHeld", "invariant", 4)
    assert [e.action for e, _ in v.trace[1:]] == ["Arrive", "Reserve", "Admit", "SendPage"]


def test_deadlock_is_reported_as_such():
    entry = ENTRY_BY_NAME["silent-prefill-abort"]
    v = check(entry.model()).violation
    assert (v.property, v.kind, v.length) == ("NoLeakAtRest", "deadlock", 3)
    assert list(successors(entry.model(), v.trace[-1][1])) == []


def test_cycle_finder_finds_a_lasso_and_accepts_a_dag():
    dag = _Graph()
    for succ in ([1, 2], [2], [3], []):
        dag.add(succ)
    assert dag.find_cycle(4) is None
    loop = _Graph()
    for succ in ([1], [2], [3], [1]):
        loop.add(succ)
    assert loop.find_cycle(4) == [1, 2, 3, 1]


def test_invariants_can_be_chosen_and_unknown_ones_are_refused():
    result = check(Model(bugs={"SourceReuse"}, **BASES["solo"]), invariants=("Isolation",))
    assert result.ok
    try:
        Checker(Model(), invariants=("Nope",))
    except ValueError as error:
        assert "Nope" in str(error)
    else:
        raise AssertionError("an unknown invariant must be refused")


def test_max_states_bounds_a_run():
    try:
        check(Model(**BASES["default"]), max_states=1000)
    except RuntimeError as error:
        assert "1000" in str(error)
    else:
        raise AssertionError("max_states must stop the run")


def test_reserve_is_refused_for_a_prompt_longer_than_the_decode_pool():
    m = Model(bugs={"PoolBelowContext"}, requests=1, max_prompt_pages=3, context_pages=3,
              prefill_pages=3, decode_pages=2)
    s = apply(m, initial_state(m), core.Arrive(0, 3))
    assert "longer than the decode pool" in apply(m, s, Reserve(0, (0, 1))).reason
    assert not isinstance(apply(m, s, core.DecodeReject(0)), core.Refusal)


@pytest.mark.slow
def test_every_action_fires_in_the_default_model_except_the_reject_paths():
    """Coverage: a guard whose action never fires proves nothing. The default model's
    startup check keeps over-long prompts at the router, so the workers' reject paths are
    exercised by the reject-paths model instead (next test); crashes by the crash models,
    losses by the lossy one, eviction by the prefix models."""
    result = checked("default", frozenset())
    never = {a for a in core.ACTION_NAMES if result.action_transitions.get(a, 0) == 0}
    assert never == {"Reject", "DecodeReject", "PrefillCrash", "DecodeCrash", "LoseBootstrap",
                     "LoseFinalWord", "LoseCancel", "LoseWrite", "ResendBootstrap",
                     "ResendCancel", "RevokeRelease", "Evict", "PrefillEvict"}
    crash = checked("crash", frozenset())
    assert crash.action_transitions["PrefillCrash"] > 0
    lossy = checked("lossy", frozenset())  # the network's losses and what recovers from them
    assert all(lossy.action_transitions.get(a, 0) > 0
               for a in ("LoseBootstrap", "LoseFinalWord", "LoseCancel", "LoseWrite",
                         "ResendBootstrap", "ResendCancel", "RevokeRelease"))
    prefix = checked("prefix", frozenset())  # a prefix cache evicts
    assert prefix.action_transitions["Evict"] > 0
    prefill = checked("prefix-prefill", frozenset())  # and so does the prefill's own cache
    assert prefill.action_transitions["PrefillEvict"] > 0


def test_reject_paths_model_holds_and_exercises_both_reject_paths():
    from spec.check.cfgfile import load
    from spec.check.zoo import HOLDS

    for name, _, _, actions, _ in HOLDS:
        _, model = load(name)
        result = check(model)
        assert result.ok and result.liveness_checked
        assert result.distinct_states == 1078
        for action in actions:
            assert result.action_counts.get(action, 0) > 0, f"{action} never fired in {name}"


def test_crash_models_hold_with_exact_counts():
    assert checked("solo-crash", frozenset(), symmetry=False).distinct_states == 1252
    result = checked("crash", frozenset())
    assert result.ok and result.liveness_checked
    assert result.distinct_states == 633874


@pytest.mark.slow
def test_decode_crash_models_hold_with_exact_counts():
    solo = checked("solo-decode-crash", frozenset(), symmetry=False)
    assert solo.ok and solo.distinct_states == 2095
    both = checked("decode-crash", frozenset(), symmetry=False)
    assert both.ok and both.liveness_checked and both.distinct_states == 322726
    assert both.action_transitions["DecodeCrash"] > 0
    assert both.action_transitions["PrefillCrash"] > 0
