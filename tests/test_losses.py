"""A network that loses things for good (issue 25): what each kind of loss breaks, alone,
with every guard in place, and that no kind breaks a state invariant."""

from __future__ import annotations

import pytest

from spec import core
from spec.check.checker import check
from spec.check.zoo import BASES, LOSS_BASE, LOSSES
from spec.model import LOSS_KINDS, Model, ModelError
from spec.properties import STATE_INVARIANTS


@pytest.mark.parametrize("kind, breaks, length", [row[:3] for row in LOSSES],
                         ids=[row[0] for row in LOSSES])
def test_each_kind_of_loss_breaks_liveness_and_nothing_else(kind, breaks, length):
    model = Model(losses={kind}, **BASES[LOSS_BASE])
    result = check(model)
    assert result.violation is not None
    assert (result.violation.property, result.violation.length) == (breaks, length)
    assert check(model, invariants=tuple(STATE_INVARIANTS), liveness=False).ok


def test_every_kind_of_loss_at_once_keeps_every_state_invariant():
    model = Model(losses=set(LOSS_KINDS), **BASES[LOSS_BASE])
    result = check(model, invariants=tuple(STATE_INVARIANTS), liveness=False)
    assert result.ok, result.violation
    assert result.distinct_states == 2374


def test_a_lost_cancel_is_harmless_where_the_prefill_cannot_crash():
    """The prefill runs only requests decode reserved for (the bootstrap queue), and each
    ends with a final word of its own accord: only a restarted prefill, which has forgotten
    the request, needs the cancel to speak."""
    assert check(Model(losses={"Cancel"}, **BASES["solo"])).ok


def test_a_lost_write_is_never_accepted_as_landed():
    """Decode's count keeps a Done that announces a lost write from being verified: the
    request is never accepted, and decode never releases while the write could be late."""
    model = Model(losses={"Write"}, **BASES["solo"])
    s = core.initial_state(model)
    for event in (core.Arrive(0, 1), core.Reserve(0, (0,)), core.Admit(0, (0,)),
                  core.SendPage(0), core.LoseWrite(0, 0), core.SendDone(0)):
        s = core.apply(model, s, event)
        assert isinstance(s, core.State), s
    refused = core.apply(model, s, core.Accept(0, True))
    assert isinstance(refused, core.Refusal)
    assert refused.reason == "0 of the 1 writes the Done announces have landed"


def test_without_losses_in_the_model_the_network_loses_nothing():
    s = core.initial_state(Model(**BASES["solo"]))
    s = core.apply(Model(**BASES["solo"]), s, core.Arrive(0, 1))
    refused = core.apply(Model(**BASES["solo"]), s, core.LoseBootstrap(0))
    assert isinstance(refused, core.Refusal)
    with pytest.raises(ModelError, match="unknown loss kind"):
        Model(losses={"Everything"})


def test_the_loss_table_in_the_readme_is_what_the_checker_finds():
    from spec.check.guardtable import LOSS_BEGIN, LOSS_END, readme_section, render_losses
    assert readme_section(LOSS_BEGIN, LOSS_END) == render_losses(), (
        "run python -m spec.check.guardtable --write")
