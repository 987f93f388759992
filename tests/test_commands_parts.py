"""Each worker derives the commands it carries out from its own part (spec/parts.py), and
together they are the whole-row derivation's (spec/commands.py `effects`).

For every step: the commands each part yields are exactly those of `core.decide` on the
whole state that the part's worker carries out (by `commands.carrier`, at the worker the
request is placed on), in the same order; the union over the parts is the whole's. The one
difference is pinned, not hidden: a final word repeated (AnswerCancel) while the same word
is still on the wire. The spec's one-slot wire absorbs the repeat, so `effects` asks for no
Send; the prefill cannot see decode's inbox, and sends. Checked on every reachable state
and edge of workers-2x2 and lossy, on random sequences (seed printed), and on a lossy 2 x 2
simulator run; what each process observes of each environment action is pinned too.
"""

from __future__ import annotations

import os
import random
from collections import Counter, deque

import pytest

from spec import codec, core
from spec.check.simulate import behaviour
from spec.check.zoo import BASES
from spec.commands import FreePages, Send, carrier
from spec.model import Model
from spec.partlog import flat_event
from spec.parts import CARRIES, Split
from spec.roles import DECODE, PREFILL, ROUTER
from tests.parts_cases import TWO_REQUESTS_LOSSY_2X2

ROLE_OF_CARRIER = {name: role for role, names in CARRIES.items() for name in names}


def _agree(m: Model, s: core.State, event: core.Event, split: Split) -> int:
    """The split's commands for `event` (just taken) against core.decide's on `s`: per part
    the whole's commands of that worker, in order, plus the repeats the wire absorbed.
    Returns how many such repeats there were."""
    whole = core.decide(m, s, event)
    assert type(whole) is not core.Refusal
    repeats = [Send(x.request, core.FINAL_WORD_MSG) for x in split.absorbed
               if x.to == DECODE and core.FW in dict(x.fields)]
    # Besides those, only answers are absorbed: the edge keeps a client's first.
    assert all(x.to == ROUTER and x.names == ("answer",) for x in split.absorbed
               if core.FW not in dict(x.fields)), f"{event}: {split.absorbed}"
    assert not repeats or event.action == "AnswerCancel", event
    expected: dict[str, list] = {}
    for command in whole.commands:
        role = ROLE_OF_CARRIER[carrier(command)]
        part = split.placed(command.request, role) if command.request != core.NONE \
            else split.taker(event)
        expected.setdefault(part.name, []).append(command)
    got: dict[str, list] = {}
    for part, commands in split.carried:
        assert all(carrier(c) in CARRIES[part.role] for c in commands), (event, part.name)
        got.setdefault(part.name, []).extend(commands)
    for name, commands in got.items():
        kept = [c for c in commands if c not in repeats]
        assert kept == expected.get(name, []), f"{event} in {s}: {name} {commands}"
    assert set(got) >= set(expected), f"{event}: {expected} vs {got}"
    union = Counter(c for commands in got.values() for c in commands)
    assert union == Counter(whole.commands) + Counter(repeats), event
    return len(repeats)


def _explore(m: Model) -> tuple[int, int, int]:
    init = core.initial_state(m)
    seen = {init}
    queue, edges, repeats = deque([(init, Split(m))]), 0, 0
    while queue:
        s, here = queue.popleft()
        for event, t in core.successors(m, s):
            edges += 1
            there = here.copy()
            there.take(event)
            repeats += _agree(m, s, event, there)
            if t not in seen:
                seen.add(t)
                queue.append((t, there))
    return len(seen), edges, repeats


@pytest.mark.parametrize("base, states, edges, repeats", [
    ("workers-2x2", 10566, 16933, 792),
    ("lossy", 2635, 6046, 138),
])
def test_every_edge_the_parts_commands_are_the_wholes(base, states, edges, repeats):
    assert _explore(Model(name=base, **BASES[base])) == (states, edges, repeats)


def test_random_sequences_the_parts_commands_are_the_wholes():
    seed = int(os.environ.get("KVPROOF_PARTS_SEED") or random.randrange(2**32))
    print(f"replay with KVPROOF_PARTS_SEED={seed}")
    rng = random.Random(seed)
    m, steps = TWO_REQUESTS_LOSSY_2X2, 0
    for _ in range(300):
        split = Split(m)
        for s, event, _ in behaviour(m, rng, 40):
            split.take(event)
            _agree(m, s, event, split)
            steps += 1
    assert steps > 2500, steps


def test_a_lossy_cluster_run_the_parts_commands_are_the_wholes(tmp_path):
    from sim.run import simulate
    from sim.scenario import load_scenario
    from sim.trace import log_run
    from spec.tlaplus.runcheck import placed

    print("kvproof sim lossy-cluster --seed 1")
    path = tmp_path / "run.ndjson"
    simulate(load_scenario("lossy-cluster").model_copy(update={"seed": 1}), log_path=str(path))
    run = log_run(str(path))
    m, where = run.model, {}
    s, split = core.initial_state(m), Split(m)
    for line, record in run.records:
        event = flat_event(m, placed(run, line, record, codec.decode(record)), where)
        split.take(event)
        _agree(m, s, event, split)
        s = core.apply(m, s, event)
    assert len(run.records) == 67


# -- what each process observes of the environment's actions ----------------------------

def _observed(m: Model, steps: list[core.Event]) -> list[tuple[str, list]]:
    """The parts the last of `steps` reached, each with the commands it carries out."""
    split = Split(m)
    for event in steps[:-1]:
        assert type(split.take(event)) is not core.Refusal, event
    out = split.take(steps[-1])
    assert type(out) is not core.Refusal, out
    return sorted((part.name, [c.name if type(c) is not Send else f"Send {c.message}"
                               for c in dict(split.carried).get(part, ())])
                  for part in split.reached)


START = [core.Arrive(0, 2, 1, 0), core.Reserve(0, (0, 1)), core.Admit(0, (2, 3)),
         core.SendPage(0)]


@pytest.mark.parametrize("what, steps, observed", [
    ("a write lands: decode counts it, the prefill's post completes", [*START,
     core.LandWrite(0, 0)], [("decode 0", []), ("prefill 1", [])]),
    ("decode 0 crashes: it restarts empty, the prefill's connection breaks (the notice), "
     "the edge answers ErrDecode",
     [*START, core.DecodeCrash(0)],
     [("decode 0", ["Send cancel", "CancelTimer", "FreePages"]), ("prefill 1", []),
      ("router", ["Answer"])]),
    ("the prefill fails the request: its final word, its pages, the edge's answer",
     [*START[:3], core.PrefillFail(0)],
     [("decode 0", []), ("prefill 1", ["Send final word", "FreePages"]),
      ("router", ["Answer"])]),
    ("a write is lost with its poster told: the prefill's false completion",
     [*START, core.LandWrite(0, 0), core.SendPage(0), core.LoseWrite(0, 1)],
     [("prefill 1", [])]),
    ("a bootstrap is lost: decode's inbox loses it, nobody observes anything",
     [core.Arrive(0, 2, 1, 0), core.LoseBootstrap(0)], [("decode 0", [])]),
])
def test_what_each_process_observes_of_an_environment_action(what, steps, observed):
    m = Model(name="workers-2x2", **{**BASES["workers-2x2"],
                                     "losses": frozenset({"Bootstrap", "Write"})})
    assert m.decode_crashes and m.crashes
    assert _observed(m, steps) == observed, what


def test_the_parts_hold_no_table_of_their_own():
    """One derivation: a part's commands are commands.part_effects on its own fields, and
    who carries each is commands.carrier (the runtime's too)."""
    from spec import runtime

    assert runtime.carrier is carrier
    assert {ROLE_OF_CARRIER[carrier(FreePages(0, pool, ()))] for pool in (PREFILL, DECODE)} \
        == {PREFILL, DECODE}
    assert ROLE_OF_CARRIER["client"] == ROUTER
