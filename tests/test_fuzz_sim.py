"""The simulator as a fuzz target (fuzz/sim_target.py): what the target reports is a run of
the core, its faults, replays and determinism. The zoo and the broken guards run on both
targets in tests/test_fuzz.py."""

from __future__ import annotations

import json
import random

import pytest

from api.cli import main
from spec import core
from spec.model import Model

from fuzz.oracles import Checks, check
from fuzz.replay import load, replay
from fuzz.runner import Campaign, run_campaign
from fuzz.sim_target import SimTarget, scenario_for
from fuzz.target import AtWorker, Open, Wait


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
    assert all(o.replayed.property == "SourceHeld" for o in runs)
