"""A network that loses things for good (issue 25): what each kind of loss breaks, alone,
with every guard in place, and that no kind breaks a state invariant."""

from __future__ import annotations

import pytest

from spec import core
from spec.check.checker import check
from spec.check.cfgfile import MODELS_DIR
from spec.check.guardtable import recovering_switches
from spec.check.zoo import BASES, LOSS_BASE, LOSSES
from spec.model import LOSS_KINDS, Model, ModelError
from spec.properties import STATE_INVARIANTS
from sim.run import simulate
from sim.scenario import load_scenario


LOSS_STATES = {"Bootstrap": 1264, "FinalWord": 1492, "Cancel": 1432, "Write": 2011}


@pytest.mark.parametrize("kind, states", LOSS_STATES.items(), ids=list(LOSS_STATES))
def test_the_guards_keep_every_property_when_one_kind_is_lost(kind, states):
    """A message is sent again (ResendBootstrap, ResendCancel); a page write lost silently
    is given up on by decode's write timer, which revokes the pages and releases them."""
    result = check(Model(losses={kind}, **BASES[LOSS_BASE]))
    assert result.ok, result.violation
    assert result.distinct_states == states
    assert result.liveness_checked


def test_every_kind_lost_and_recovered_still_ends_every_request():
    """The lossy model: any bootstrap, final word, cancel (each again after its resend) or
    page write may be lost, the prefill may crash; every property holds, liveness under
    finitely many losses. Without the loss steps in the liveness graph it would have cycles
    (see below), so the checker's verdict rests on FiniteLosses, which the .cfg says."""
    model = Model(**BASES["lossy"])
    result = check(model)
    assert result.ok, result.violation
    assert result.distinct_states == 2635
    assert result.witness  # some behaviour ends with the client answered Ok
    assert "SPECIFICATION LossyFairSpec" in (MODELS_DIR / "lossy.cfg").read_text()


def test_a_decode_crash_on_a_lossy_network_still_ends_every_request():
    """A decode crash's notice is the prefill's own failure detector, which no network
    loses (core.crash_notice, the spec's CrashNotice); as a message (NoFailureDetector) it
    is lost, the restarted decode holds only a tombstone and asks nothing, and the prefill
    holds the request for ever."""
    result = check(Model(**BASES["lossy-decode-crash"]))
    assert result.ok, result.violation
    assert result.distinct_states == 4380
    broken = check(Model(bugs={"NoFailureDetector"}, **BASES["lossy-decode-crash"]))
    assert broken.violation.property == "NoStuckRequest"
    assert [e.action for e, _ in broken.violation.trace[1:]] == ["Arrive", "DecodeCrash",
                                                                "LoseCancel"]


LOSSY_SEEDS = range(1, 41)


@pytest.mark.parametrize("scenario", ["lossy-pair", "lossy-cluster"])
def test_every_lossy_simulator_run_ends_at_rest(scenario):
    """Forty seeds of each lossy scenario (crashes of both kinds, aborts, every kind of
    loss): every run ends with every request ended and no oracle violated. Two shell bugs
    left runs at their horizon: a decode crash's notice lost for good (now the failure
    detector's), and a Done that reached decode before its writes' count and was dropped
    instead of waiting (sim/run.py on_final_word)."""
    for seed in LOSSY_SEEDS:
        print(f"kvproof sim {scenario} --seed {seed}")
        out, sim = simulate(load_scenario(scenario).model_copy(update={"seed": seed}))
        assert out["violations"] == {} and not sim.cluster.rows, (seed, out["violations"])


def test_a_crash_notice_lost_as_a_message_strands_its_request_in_the_simulator():
    """lossy-pair at seed 5 loses a decode crash's notice when NoFailureDetector makes it a
    message: the run ends at its horizon with the request stuck."""
    out, _ = simulate(load_scenario("lossy-pair").model_copy(
        update={"seed": 5, "bugs": ("NoFailureDetector",)}))
    assert out["violations"] == {"NoStuckRequest": 1}


def test_a_lost_and_resent_bootstrap_is_a_cycle_only_through_the_loss():
    """Lose, resend, lose again: the state comes back. That cycle is excluded only by the
    assumption that the network loses finitely many things, never by the protocol."""
    model = Model(**BASES["lossy"])
    s = core.apply(model, core.initial_state(model), core.Arrive(0, 1))
    lost = core.apply(model, s, core.LoseBootstrap(0))
    again = core.apply(model, core.apply(model, lost, core.ResendBootstrap(0)),
                       core.LoseBootstrap(0))
    assert again == lost
    assert isinstance(core.apply(model, s, core.ResendBootstrap(0)), core.Refusal)  # on the wire


@pytest.mark.parametrize("kind, breaks, length", [row[:3] for row in LOSSES],
                         ids=[row[0] for row in LOSSES])
def test_each_kind_of_loss_breaks_liveness_without_its_guard(kind, breaks, length):
    model = Model(losses={kind}, bugs=recovering_switches(frozenset({kind})),
                  **BASES[LOSS_BASE])
    result = check(model)
    assert result.violation is not None
    assert (result.violation.property, result.violation.length) == (breaks, length)
    assert check(model, invariants=tuple(STATE_INVARIANTS), liveness=False).ok


def test_a_lost_write_is_given_up_on_only_once_no_write_is_on_the_wire():
    """Decode's write timer rests on the revocation: it releases only when no write of the
    request can still land, and fails the transfer it had not accepted."""
    model = Model(losses={"Write"}, **BASES["solo"])
    s = core.initial_state(model)
    for event in (core.Arrive(0, 2), core.Reserve(0, (0, 1)), core.Admit(0, (0, 1)),
                  core.SendPage(0), core.SendPage(0), core.LoseWrite(0, 0)):
        s = core.apply(model, s, event)
        assert isinstance(s, core.State), s
    assert isinstance(core.apply(model, s, core.RevokeRelease(0)), core.Refusal)  # no Done
    s = core.apply(model, core.apply(model, s, core.LandWrite(0, 1)), core.SendDone(0))
    released = core.apply(model, s, core.RevokeRelease(0))
    assert isinstance(released, core.State), released
    row = released.requests[0]
    assert (row[core.CLIENT], row[core.DST]) == (core.ERR_TRANSFER, core.RELEASED)
    assert all(page[0] == core.NONE for page in released.decode_pool)
    without = Model(losses={"Write"}, bugs={"NoRevoke"}, **BASES["solo"])
    assert isinstance(core.apply(without, s, core.RevokeRelease(0)), core.Refusal)
    reliable = Model(**BASES["solo"])  # no silent write loss: no write timer is armed
    assert isinstance(core.apply(reliable, s, core.RevokeRelease(0)), core.Refusal)


def test_without_losses_nothing_is_ever_sent_again():
    """Each model's graph is what it was before retransmission: the resends' timing
    assumption (the message and its answer off the wire) holds only after a loss."""
    for base, states in (("solo-crash", 1252), ("solo-decode-crash", 2095), ("small", 66384)):
        result = check(Model(**BASES[base]))
        assert result.distinct_states == states
        assert "ResendBootstrap" not in result.action_transitions
        assert "ResendCancel" not in result.action_transitions


def test_without_the_guards_every_state_invariant_still_holds():
    """Retransmission and the write timer keep liveness; safety never rested on them."""
    model = Model(losses=set(LOSS_KINDS), bugs={"NoRetransmit", "NoRevoke"},
                  **BASES[LOSS_BASE])
    result = check(model, invariants=tuple(STATE_INVARIANTS), liveness=False)
    assert result.ok, result.violation
    assert result.distinct_states == 2374


def test_a_model_with_losses_under_plain_fairspec_is_refused(tmp_path):
    from spec.check.cfgfile import CfgError, load

    text = (MODELS_DIR / "lossy.cfg").read_text()
    path = tmp_path / "lossy-fair.cfg"
    path.write_text(text.replace("SPECIFICATION LossyFairSpec", "SPECIFICATION FairSpec"))
    with pytest.raises(CfgError, match="LossyFairSpec"):
        load(str(path))


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
