"""The simulator as a fuzz target (fuzz/sim_target.py): the zoo, broken guards, replays,
and that what the target reports is a run of the core.

The zoo test is the sim half of issue 5's CI profile: every entry must be caught on the sim
target within the budget below, and no switch at all must end the same budget clean.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from api.cli import main
from spec import core
from spec.core import CLOSING, DFW, DST, D_WAITING
from spec.model import Model

from fuzz.oracles import Checks, check
from fuzz.replay import load, replay
from fuzz.runner import Campaign, run_campaign
from fuzz.sim_target import SimTarget, scenario_for
from fuzz.target import AtWorker, Open, Wait
from fuzz.zoo import format_matrix, run_zoo, zoo_rows

ZOO_SEED = 7
ZOO_EXAMPLES = 1500      # per cell; the none row runs all of them
ZOO_SHRINK_SECONDS = 1.0
ZOO_MINIMIZE_SECONDS = 2.0


def test_zoo_on_the_sim_target_catches_every_entry_and_raises_no_false_alarm(capsys):
    base = Campaign(seed=ZOO_SEED, examples=ZOO_EXAMPLES, shrink_seconds=ZOO_SHRINK_SECONDS,
                    minimize_seconds=ZOO_MINIMIZE_SECONDS)
    cells = run_zoo(["sim"], base)
    with capsys.disabled():
        print("\n" + format_matrix(cells))
    missed = [c.row.name for c in cells if c.row.must_fail and not c.outcome.caught]
    false_alarms = [c.outcome.replayed for c in cells if not c.row.must_fail and c.outcome.caught]
    assert not missed, f"missed within {ZOO_EXAMPLES} examples: {missed}"
    assert not false_alarms, f"false alarm with no switch on: {false_alarms}"
    assert len(cells) == len(zoo_rows())
    for cell in cells:
        if cell.outcome.caught:  # what is reported was replayed on the simulator
            assert cell.outcome.replayed.steps == len(cell.outcome.minimal)
            assert cell.outcome.replayed.story  # and says what the simulator did


# ---------------------------------------------------------------------------------------
# Guards that are not switches, broken by a monkeypatch of the core the simulator runs.

def _release_before_the_final_word(original):
    """Decode frees a closing request's pages without waiting for the prefill's final word
    (the first lesson of DESIGN.md), but still waits for writes already in flight. No
    switch does just this: EagerRelease drops both conditions."""
    def release(m, s, r):
        row = s.requests[r]
        if row[DST] != CLOSING or row[DFW]:
            return original(m, s, r)
        heard = row[:DFW] + (1,) + row[DFW + 1:]
        view = SimpleNamespace(requests={r: heard}, decode_pool=s.decode_pool,
                               prefill_pool=s.prefill_pool, writes=s.writes)
        out = original(m, view, r)
        if type(out) is str:
            return out
        (_, new), = out.rows
        return out._replace(rows=((r, new[:DFW] + (0,) + new[DFW + 1:]),))
    return release


def _notice_forgets_the_final_word(original):
    """Decode takes a Reject or Abort while waiting for KV but forgets it heard the final
    word, so Release waits for it forever (nothing recovers: the timer has been spent)."""
    def notice(m, s, r):
        out = original(m, s, r)
        if type(out) is str or s.requests[r][DST] != D_WAITING:
            return out
        (_, row), = out.rows
        return out._replace(rows=((r, row[:DFW] + (0,) + row[DFW + 1:]),))
    return notice


@pytest.mark.parametrize("target", ["sim", "core"])
@pytest.mark.parametrize("action, patch, expected", [
    (core.Release, _release_before_the_final_word, {"NoWriteIntoForeign", "PageConservation"}),
    (core.Notice, _notice_forgets_the_final_word, {"NoLeakAtRest"}),
], ids=["release-before-final-word", "notice-forgets-final-word"])
def test_a_broken_guard_that_is_no_switch_is_caught(monkeypatch, target, action, patch,
                                                     expected):
    monkeypatch.setitem(core.ACTIONS, action, patch(core.ACTIONS[action]))
    outcome = run_campaign(Campaign(target=target, seed=1, examples=300, shrink_seconds=1,
                                    minimize_seconds=2))
    assert outcome.caught, f"the fuzzer missed a guard that is not a switch on {target}"
    assert expected & {v.property for v in outcome.replayed.violations}
    print(f"{target}: caught after {outcome.examples_to_catch} examples: "
          f"{outcome.replayed.violations[0]} in {len(outcome.minimal)} events")


# ---------------------------------------------------------------------------------------
# The target itself.

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
    assert "Reproduced: NoWriteIntoForeign" in capsys.readouterr().out
    found = replay("sim", saved.model, saved.events, Checks.for_properties(),
                   seed=saved.target_seed)
    assert found.steps == saved.steps


def test_the_same_seed_gives_the_same_campaign():
    runs = [run_campaign(Campaign(target="sim", bugs=frozenset({"SourceReuse"}), seed=4,
                                  examples=50, shrink_seconds=1, minimize_seconds=1))
            for _ in range(2)]
    assert runs[0].caught and runs[1].caught
    assert runs[0].failure.trace == runs[1].failure.trace
    assert runs[0].minimal == runs[1].minimal
