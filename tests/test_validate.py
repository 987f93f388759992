"""Trace validation: legal traces are accepted, corrupted ones rejected at the right step."""

from __future__ import annotations

import copy
import json
import random

import pytest

from api.cli import main
from spec import core
from spec.core import (
    Accept, Admit, Arrive, Finish, LandWrite, Release, Reserve, SendDone, SendPage,
    apply, initial_state, successors,
)
from spec.tlaplus.itf import trace_to_itf
from spec.model import Model
from spec.tlaplus.validate import TraceError, load_trace, validate
from spec.check.zoo import BASES, ENTRIES
from tests.conftest import checked

DEFAULT = Model(name="default", **BASES["default"])


def as_json(trace: dict) -> dict:
    return json.loads(json.dumps(trace))


def run_trace(m: Model, *events) -> dict:
    steps = [(None, initial_state(m))]
    for event in events:
        state = apply(m, steps[-1][1], event)
        assert not isinstance(state, core.Refusal), state
        steps.append((event, state))
    return as_json(trace_to_itf(m, steps))


TWO_REQUESTS = (Arrive(0, 1), Reserve(0, (1,)), Admit(0, (0,)), Arrive(1, 1),
                Reserve(1, (2,)), Admit(1, (1,)), SendPage(0), SendPage(1), LandWrite(0, 1),
                LandWrite(1, 2), SendDone(0), Accept(0, True), Finish(0, True), Release(0))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_every_counterexample_the_checker_prints_is_a_legal_trace(entry):
    violation = checked(entry.base, entry.bugs, entry.invariants, symmetry=False).violation
    verdict = validate(entry.model(), as_json(trace_to_itf(entry.model(), violation.trace)))
    assert verdict.ok, verdict.message
    assert verdict.steps == entry.length


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_random_walks_over_the_core_validate(seed, capsys):
    print(f"random walk seed={seed}")
    rng = random.Random(seed)
    m = Model(name="crash", **BASES["crash"])
    steps = [(None, initial_state(m))]
    for _ in range(40):
        options = list(successors(m, steps[-1][1]))
        if not options:
            break
        steps.append(rng.choice(options))
    verdict = validate(m, as_json(trace_to_itf(m, steps)))
    assert verdict.ok, f"seed={seed}: {verdict.message}"


def test_a_trace_that_observes_only_some_variables_is_accepted():
    trace = run_trace(DEFAULT, *TWO_REQUESTS)
    for state in trace["states"]:
        for name in list(state):
            if name not in ("#meta", "client", "dst"):
                del state[name]
        state["#meta"].pop("label")
    verdict = validate(DEFAULT, trace)
    assert verdict.ok, verdict.message


def test_an_illegal_step_is_rejected_where_it_happens():
    trace = run_trace(DEFAULT, *TWO_REQUESTS)
    del trace["states"][7]  # SendPage(r1) vanishes; its effects are still recorded after it
    verdict = validate(DEFAULT, trace)
    assert not verdict.ok and verdict.bad_step == 7
    assert "step 7 (SendPage(r2)) is illegal" in verdict.message
    assert "differs from the recorded state in sent, writes" in verdict.message


def test_a_wrong_label_is_rejected_at_its_step():
    trace = run_trace(DEFAULT, *TWO_REQUESTS)
    trace["states"][12]["#meta"].update(action="Notice", label="Notice(r1)")  # was Accept
    verdict = validate(DEFAULT, trace)
    assert not verdict.ok and verdict.bad_step == 12
    assert "not enabled" in verdict.message


def test_a_write_into_a_foreign_page_is_rejected_at_its_step():
    """The recorded LandWrite puts r2's data into r1's page: no legal step does that."""
    trace = run_trace(DEFAULT, *TWO_REQUESTS)
    step = trace["states"][9]
    assert step["#meta"]["label"] == "LandWrite(r1, page 2)"
    decode_worker, pool = step["content"]["#map"][0]  # content[d][p]: decode worker d1's pool
    assert decode_worker == "d1"
    for pair in pool["#map"]:
        if pair[0] == 2:
            pair[1] = {"#tup": ["r2", 1]}
    for later in trace["states"][10:]:
        later["content"] = copy.deepcopy(step["content"])
    verdict = validate(DEFAULT, trace)
    assert not verdict.ok and verdict.bad_step == 9
    assert "differs from the recorded state in content" in verdict.message


def test_cli_validates_a_trace_file_and_names_the_first_illegal_step(tmp_path, capsys):
    good = tmp_path / "good.itf.json"
    good.write_text(json.dumps(run_trace(DEFAULT, *TWO_REQUESTS)))
    assert main(["validate", str(good)]) == 0
    assert "trace OK: 14 steps" in capsys.readouterr().out
    bad_trace = run_trace(DEFAULT, *TWO_REQUESTS)
    del bad_trace["states"][7]
    bad = tmp_path / "bad.itf.json"
    bad.write_text(json.dumps(bad_trace))
    assert main(["validate", str(bad)]) == 1
    assert "step 7 (SendPage(r2)) is illegal" in capsys.readouterr().out


def test_unreadable_traces_are_clear_errors(tmp_path, capsys):
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    assert main(["validate", str(junk)]) == 2
    assert "cannot read" in capsys.readouterr().err
    alien = tmp_path / "alien.json"
    alien.write_text(json.dumps({"states": [{"nosuchvar": 1}]}))
    with pytest.raises(TraceError, match="nosuchvar"):
        load_trace(alien)
