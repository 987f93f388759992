"""The simulator as a fuzz target (fuzz/sim_target.py): what the target reports is a run of
the core, its faults, replays and determinism. The zoo and the broken guards run on both
targets in tests/test_fuzz.py."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from api.cli import main
from sim.crash import SHELL_CRASH
from sim.run import Simulation
from sim.workers import SimPrefill
from spec import core
from spec.model import Model

from fuzz.oracles import Checks, check
from fuzz.replay import ReplayError, decode_event, encode_event, load, replay
from fuzz.runner import Campaign, run_campaign
from fuzz.sim_target import MID_STEP_PERMILLE, SimTarget, scenario_for
from fuzz.target import AtWorker, MidStep, Open, Wait

from test_step_properties import _finish_rewrites_any_answer, _patch


def _model(*bugs: str, requests: int = 6) -> Model:
    return Model(requests=requests, max_prompt_pages=14, context_pages=12, prefill_pages=12,
                 decode_pages=16, bugs=frozenset(bugs), crashes=True, decode_crashes=True,
                 name="fuzz")


def _seeds_with(prefill_workers: int) -> list[int]:
    """Target seeds whose simulator has this many prefill workers."""
    return [seed for seed in range(200)
            if scenario_for(_model(), seed)[2]["prefill_workers"] == prefill_workers]


def _seed_with(prefill_workers: int) -> int:
    return _seeds_with(prefill_workers)[0]


def _random_run(target: SimTarget, rng: random.Random, steps: int) -> None:
    """Random moves: arrivals early, mostly Wait, a fault now and then; then Wait until the
    simulator is idle."""
    for _ in range(steps):
        moves = target.enabled()
        if not moves:
            break
        if "Arrive" in moves and rng.random() < 0.3:
            action = "Arrive"
        elif "Wait" in moves and rng.random() < 0.9:
            action = "Wait"
        else:
            action = rng.choice(sorted(moves))
        move = rng.choice(moves[action])
        if type(move) is Open:
            move = move.close(rng.choice(move.options))
        target.step(move)
    while "Wait" in target.enabled():
        target.step(Wait())


@pytest.mark.parametrize("seed", range(6))
def test_with_one_prefill_worker_the_simulator_runs_the_core(seed):
    """Trace validation: on one worker pair the protocol events the simulator committed,
    taken by the core from the initial state, give exactly the state the target reports;
    every check holds on the way, and the run ends at rest with every request ended."""
    m = _model()
    target = SimTarget()
    target.reset(m, _seeds_with(1)[seed])
    rng = random.Random(seed)
    checks = Checks.for_properties()
    _random_run(target, rng, 80)
    assert check(checks, m, target) == []
    state = core.initial_state(m)
    for event in target.committed():
        state = core.apply(m, state, event)
        assert type(state) is core.State, f"the core refuses {event}: {state}"
    assert state == target.protocol_state()
    assert len(target.committed()) > 30
    assert all(row[core.CLIENT] not in (core.IDLE, core.WAITING) or row == core.EMPTY_ROW
               for row in state.requests)


def test_with_the_prefill_cache_the_simulator_still_runs_the_core():
    """The same trace validation where both sides cache (PrefillCache) and prompts share
    prefixes: the prefill hits pages other requests computed, computes only the rest, and
    forgets pages (its LRU under pressure, the fuzzer's PrefillEvict moves), each a step
    the core takes from the simulator's committed events to the state the target reports."""
    m = replace(_model(requests=12), prefill_pages=6, prefix_cache=True, tokens=2, tenants=1,
                prefill_cache=True)
    seen = {"hits": 0, "evictions": 0}
    for seed in _seeds_with(1)[:3]:
        target = SimTarget()
        target.reset(m, seed)
        rng = random.Random(seed)
        for _ in range(120):
            moves = target.enabled()
            if not moves:
                break
            action = ("Arrive" if "Arrive" in moves and rng.random() < 0.3 else
                      "Wait" if "Wait" in moves and rng.random() < 0.8 else rng.choice(sorted(moves)))
            move = rng.choice(moves[action])
            if type(move) is Open and action == "Arrive":  # a shared prefix of 1s, then 2s
                n = rng.choice((2, 3, 4))
                move = core.Arrive(move.request, n, tokens=(1,) * (n - 1) + (2,), salt=1)
            elif type(move) is Open:
                move = move.close(rng.choice(move.options))
            target.step(move)
        while "Wait" in target.enabled():
            target.step(Wait())
        assert check(Checks.for_properties(), m, target) == []
        state = core.initial_state(m)
        for event in target.committed():
            state = core.apply(m, state, event)
            assert type(state) is core.State, f"the core refuses {event}: {state}"
            if type(event) is core.Admit:
                seen["hits"] += state.requests[event.request][core.PCACHED] > 0
            seen["evictions"] += type(event) is core.PrefillEvict
        assert state == target.protocol_state()
    assert seen == {"hits": 12, "evictions": 13}


def test_two_prefill_workers_share_one_decode_pool_and_every_check_holds():
    m = _model(requests=10)
    target = SimTarget()
    target.reset(m, _seed_with(2))
    _random_run(target, random.Random(5), 150)
    assert check(Checks.for_properties(), m, target) == []
    placed = {event.request for event in target.committed() if type(event) is core.Admit}
    assert len(placed) >= 2
    assert len(target.protocol_state().prefill_pool) == m.prefill_pages


def test_a_decode_crash_with_writes_on_the_wire_leaves_nothing_behind():
    """The fuzzer's first find on the simulator: a decode crash tombstones a request whose
    writes are still on the NIC; the NIC must free their slots when they complete, and
    the core refuse their landing (the simulator used to fail on the unknown request)."""
    m = _model()
    target = SimTarget()
    target.reset(m, _seed_with(1))
    target.step(core.Arrive(0, 8))
    while not target.protocol_state().writes:
        target.step(Wait())
    target.step(AtWorker(core.DecodeCrash(), 0))
    while "Wait" in target.enabled():
        target.step(Wait())
    assert check(Checks.for_properties(), m, target) == []
    assert target.observe().outcomes[0] == "ErrDecode"
    assert target.sim.nic_in_flight == [0]


def test_an_event_the_simulator_does_not_offer_is_refused():
    target = SimTarget()
    target.reset(_model(), 0)
    with pytest.raises(AssertionError, match="not enabled"):
        target.step(core.Abort(0))  # not arrived yet


def test_a_sim_failure_is_saved_and_replays_from_its_file(tmp_path, capsys):
    path = tmp_path / "f.itf.json"
    status = main(["fuzz", "--target", "sim", "--seed", "0", "--examples", "100",
                   "--bug", "EagerRelease", "--shrink-seconds", "1", "--out", str(path)])
    out = capsys.readouterr().out
    assert status == 1
    assert "what the sim did meanwhile" in out and "simulator: prefill_workers" in out
    saved = load(path)
    assert saved.target == "sim" and saved.events
    meta = json.loads(path.read_text())["#meta"]["fuzz"]
    assert meta["target_seed"] == saved.target_seed
    assert main(["fuzz", "--replay", str(path)]) == 1
    assert f"Reproduced: {saved.violation} after event {saved.steps}" in capsys.readouterr().out
    found = replay("sim", saved.model, saved.events, Checks.for_properties(),
                   seed=saved.target_seed)
    assert found.steps == saved.steps


def test_the_same_seed_finds_the_same_failure():
    """Generation is seeded; shrinking and minimizing are bounded in wall time, so under
    load they may stop at different points: compare the failure before them."""
    runs = [run_campaign(Campaign(target="sim", bugs=frozenset({"SourceReuse"}), seed=4,
                                  examples=50, shrink_seconds=0, minimize_seconds=1))
            for _ in range(2)]
    assert runs[0].caught and runs[1].caught
    assert runs[0].examples_to_catch == runs[1].examples_to_catch
    assert runs[0].failure.trace == runs[1].failure.trace
    # (The failing move may be an abort late in the answer, which passes the whole transfer:
    # SourceHeld comes with the other violations of that move, not necessarily first.)
    assert all("SourceHeld" in {v.property for v in o.replayed.violations} for o in runs)


# ---------------------------------------------------------------------------------------
# The sim target's blind spots (issue 24, item 8). Each mutant below passed the sim target
# before the check named beside it existed: an Abort only ever landed at a protocol event,
# never late in the decode step whose Finish races it (MidStep now lands there); the quiet
# states that judge FittingRequestsSucceed were never reached while the simulator's own
# transfer timers were pending; and nothing read the simulator's own counters or refused
# landings (SimTarget's audit, reported as ShellCrash). The correct code's side: the same
# campaigns find nothing (below), and the zoo's clean row runs every check at its budget.

def _prefill_never_sends_done(original):
    """The prefill computes and writes every page, then never sends its final word: decode
    waits until its lease lapses, and every request ends in a timeout, a fault's outcome
    (the core target catches it where only the timer is left; the sim target never was
    quiet while a timer was pending)."""
    def send_done(m, s, r):
        out = original(m, s, r)
        return out if type(out) is str else "the prefill never sends its final word"
    return send_done


def _nic_completes_each_write_twice(original):
    """The NIC reports each completion twice: the second landing is one the core refuses,
    with no crash to race it (the simulator counted it as a refusal and went on)."""
    def take(self, event, _count_refusal=True):
        out = original(self, event, _count_refusal)
        if type(event) is core.LandWrite and out is not None \
                and event.request in self.cluster.rows:
            original(self, event, _count_refusal)
        return out
    return take


def _nic_frees_a_slot_twice(original):
    """A landing write frees two NIC slots: the in-flight count goes negative, and
    writes_in_flight_max bounds nothing any more (nothing read the count)."""
    def land(self, r, page, epoch, *lost):
        before = self.nic_in_flight
        original(self, r, page, epoch, *lost)
        if self.nic_in_flight < before:
            self.nic_in_flight -= 1
    return land


def _core_mutant(action, mutant):
    return lambda monkeypatch: _patch(monkeypatch, action, mutant)


def _shell_mutant(name, mutant, owner=Simulation):
    return lambda monkeypatch: monkeypatch.setattr(owner, name, mutant(getattr(owner, name)))


# (name, patch, the properties the campaign checks, what catches it, in its detail)
SIM_BLIND_SPOTS = [
    ("abort-overwritten-by-finish", _core_mutant(core.Finish, _finish_rewrites_any_answer),
     ("AnswerNeverChanges",), "AnswerNeverChanges", "Gone -> Ok"),
    ("prefill-never-sends-done", _core_mutant(core.SendDone, _prefill_never_sends_done),
     ("FittingRequestsSucceed",), "FittingRequestsSucceed", "only a timer"),
    ("nic-completes-each-write-twice",
     _shell_mutant("take", _nic_completes_each_write_twice),
     ("NoLeakAtRest",), SHELL_CRASH, "which no crash raced"),
    ("nic-frees-a-slot-twice", _shell_mutant("_land", _nic_frees_a_slot_twice, SimPrefill),
     ("NoLeakAtRest",), SHELL_CRASH, "a write landed twice"),
]
BLIND_SPOT_IDS = [name for name, *_ in SIM_BLIND_SPOTS]
# Seed 1 catches them after 9, 5, 5 and 5 examples; the budget leaves room, and is what
# the correct code runs clean (a seed gives the same examples in every process).
BLIND_SPOT_EXAMPLES = 24


def _blind_spot_campaign(properties) -> Campaign:
    return Campaign(target="sim", seed=1, examples=BLIND_SPOT_EXAMPLES, properties=properties,
                    shrink_seconds=0, minimize_seconds=0)


@pytest.mark.parametrize("name, patch, properties, catcher, detail", SIM_BLIND_SPOTS,
                         ids=BLIND_SPOT_IDS)
def test_the_sim_target_catches_its_blind_spot_mutant(monkeypatch, name, patch, properties,
                                                      catcher, detail):
    patch(monkeypatch)
    outcome = run_campaign(_blind_spot_campaign(properties))
    assert outcome.caught, f"the sim target missed the {name} mutant"
    assert outcome.replayed.property == catcher
    assert detail in " ".join(v.detail for v in outcome.replayed.violations)


def test_the_blind_spot_campaigns_find_nothing_on_the_correct_code():
    properties = tuple(sorted({p for *_, props, _, _ in SIM_BLIND_SPOTS for p in props}))
    outcome = run_campaign(_blind_spot_campaign(properties))
    assert not outcome.caught, outcome.replayed


def test_an_abort_late_in_the_last_decode_step_lands_before_its_finish():
    """MidStep: time passes to r1's last decode step, and the client leaves 99% into it;
    decode's notice comes after the step's Finish, which must leave the client Gone."""
    m = _model()
    target = SimTarget()
    target.reset(m, _seed_with(1))
    target.step(core.Arrive(0, 2))
    while not target.sim.decoding:
        target.step(Wait())
    (abort,) = target.enabled()["Abort"]
    assert abort == Open("Abort", 0, 0, MID_STEP_PERMILLE)
    target.step(abort.close(990))
    while "Wait" in target.enabled():
        target.step(Wait())
    assert check(Checks.for_properties(), m, target) == []
    labels = [e.label(m) for e in target.committed()]
    assert labels[-3:] == ["Abort(r1)", "Finish(r1, tags ok)", "Release(r1)"]
    assert target.observe().outcomes[0] == "Gone"
    story = "\n".join(target.story())
    assert "fuzzer: Abort(r1, 99% into its last decode step)" in story


def test_an_abort_in_the_last_decode_step_replays_from_its_record():
    move = MidStep(3, 900)
    record = encode_event(move)
    assert record == {"a": "Abort", "request": 3, "at_permille": 900}
    assert decode_event(record) == move
    assert decode_event(encode_event(core.Abort(3))) == core.Abort(3)
    with pytest.raises(ReplayError, match="at_permille"):
        decode_event({"a": "Abort", "request": 3, "at_permille": 1000})
