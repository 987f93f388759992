"""The split state (spec/parts.py) decides every event as the whole state does.

Each role's part holds only its own fields, its inbox and the router's facts it is granted;
every other field is a sentinel that raises when read. So the equivalence below is two
claims at once: no core action, run on its own worker's part, reads another role's state
(the sentinel would fire), and the parts, reassembled, are the core's state after every
step. Checked on every reachable state and edge of the worker and lossy models, on random
event sequences with refused events among them (seed printed), and on simulator runs of
the lossy shapes; mutants of the core that read another role's field, another worker's
pool or write another role's field are caught at the action and field they name.
"""

from __future__ import annotations

import inspect
import os
import random
import textwrap
from collections import deque

import pytest

from spec import codec, core
from spec.check.zoo import BASES
from spec.model import Model
from spec.partlog import flat_event
from spec.parts import AUTHORITY, HELD, LocalityBreach, Split, Taken, replay
from spec.roles import DECODE, PREFILL, ROUTER
from spec.core import ROW_FIELDS

LOSSES = frozenset({"Bootstrap", "FinalWord", "Cancel", "Write"})


def names(fields) -> set:
    return {ROW_FIELDS[k] for k in fields}


def test_each_part_holds_what_its_role_may_read_and_no_more():
    # tokens, salt (the router's), phit, pcached and hit: prefix caching's (issue 27).
    assert names(HELD[ROUTER]) == {"client", "prompt", "pworker", "dworker", "tokens", "salt"}
    assert names(HELD[PREFILL]) == {"pst", "sent", "src", "ptable", "cancel", "phit", "pcached",
                                    "client", "prompt", "pworker", "tokens", "salt"}
    assert names(HELD[DECODE]) == {"dst", "table", "dfw", "announced", "landed", "boot",
                                   "fwMsg", "fwCount", "hit", "client", "prompt", "dworker",
                                   "tokens", "salt"}
    # The granted facts are copies: the router is the one authority on them.
    assert names(AUTHORITY[PREFILL]) == {"pst", "sent", "src", "ptable", "cancel", "phit",
                                         "pcached"}
    assert names(AUTHORITY[DECODE]) == {"dst", "table", "dfw", "announced", "landed", "boot",
                                        "fwMsg", "fwCount", "hit"}
    # Every field has one authority, except the ghost, which the split keeps.
    counted = sorted(k for role in AUTHORITY for k in AUTHORITY[role])
    assert [ROW_FIELDS[k] for k in range(len(ROW_FIELDS)) if k not in counted] == ["leaked"]
    assert len(counted) == len(set(counted))


def _explore(m: Model) -> tuple[int, int]:
    """Breadth-first over the core's states, carrying a Split along every edge: each event
    the core takes, the split takes too, to the same whole state; and a state reached twice
    finds the parts holding the same (what a part knows is a function of the state)."""
    init = core.initial_state(m)
    split = Split(m)
    assert split.whole() == init
    seen = {init: split.snapshot()}
    queue, edges = deque([(init, split)]), 0
    while queue:
        s, here = queue.popleft()
        for event, t in core.successors(m, s):
            edges += 1
            there = here.copy()
            out = there.take(event)
            assert type(out) is not core.Refusal, f"{event} in {s}: the split refuses {out}"
            assert there.whole() == t, f"{event} in {s}"
            if t in seen:
                assert seen[t] == there.snapshot(), f"{event} in {s}: parts differ"
            else:
                seen[t] = there.snapshot()
                queue.append((t, there))
    return len(seen), edges


@pytest.mark.parametrize("base, states, edges", [
    ("workers-2x2", 10566, 16933),   # both crash kinds, every placement
    ("lossy", 2635, 6046),           # every loss, resends, the write timer, prefill crashes
])
def test_every_reachable_state_splits_and_decides_as_the_whole(base, states, edges):
    assert _explore(Model(name=base, **BASES[base])) == (states, edges)


# -- random sequences, refusals among them -----------------------------------------------

def _any_event(m: Model, s: core.State, rng: random.Random) -> core.Event:
    """An event of any action, enabled or not (the core refuses most of them)."""
    r = rng.randrange(m.requests)
    kind = rng.choice(core.ACTION_TABLE).event
    if kind is core.Arrive:
        return core.Arrive(r, rng.randint(1, m.max_prompt_pages),
                           rng.randrange(m.prefill_workers), rng.randrange(m.decode_workers))
    if kind in (core.PrefillCrash, core.DecodeCrash):
        workers = m.prefill_workers if kind is core.PrefillCrash else m.decode_workers
        return kind(rng.randrange(workers))
    if kind in (core.Admit, core.Reserve):
        pages = m.prefill_pages * m.prefill_workers if kind is core.Admit \
            else m.decode_pages * m.decode_workers
        return kind(r, tuple(sorted(rng.sample(range(pages), rng.randint(1, 3)))))
    if kind in (core.LandWrite, core.LoseWrite):
        return kind(r, rng.randrange(m.decode_pages * m.decode_workers))
    if kind is core.Accept:
        return kind(r, rng.random() < 0.8)
    if kind is core.Finish:
        return kind(r, rng.random() < 0.8)
    return kind(r)


def test_random_sequences_with_refused_events_decide_as_the_whole():
    seed = int(os.environ.get("KVPROOF_PARTS_SEED") or random.randrange(2**32))
    print(f"replay with KVPROOF_PARTS_SEED={seed}")
    rng = random.Random(seed)
    m = Model(name="workers-2x2-two", **{**BASES["workers-2x2"], "requests": 2,
                                          "losses": LOSSES})
    refused = taken = 0
    for _ in range(300):
        s, split = core.initial_state(m), Split(m)
        for _ in range(40):
            enabled = [e for e, _ in core.successors(m, s)]
            event = rng.choice(enabled) if enabled and rng.random() < 0.6 \
                else _any_event(m, s, rng)
            whole = core.change_for(m, s, event)
            out = split.take(event)
            assert (type(out) is core.Refusal) == (type(whole) is core.Refusal), \
                f"seed={seed}: {event} in {s}: whole {whole}, split {out}"
            if type(whole) is core.Refusal:
                refused += 1
                if type(split.taker(event)) is not str:  # a part decided: the same reason
                    assert out.reason == whole.reason, f"seed={seed}: {event}"
            else:
                taken += 1
                s = core.commit(s, whole)
            assert split.whole() == s, f"seed={seed}: after {event}"
    assert refused > 3000 and taken > 2000, (refused, taken)


# -- simulator runs ------------------------------------------------------------------------

@pytest.mark.parametrize("scenario, seed, events", [
    ("lossy-cluster", 1, 67),   # 2x2: losses of every kind, a decode crash, resends
    ("lossy-cluster", 3, 51),
    ("lossy-pair", 2, 48),      # a lost bootstrap resent, an abort, both crashes
])
def test_a_simulator_run_splits_and_decides_as_the_whole(tmp_path, scenario, seed, events):
    from sim.run import simulate
    from sim.scenario import load_scenario
    from sim.trace import log_run
    from spec.tlaplus.runcheck import placed

    print(f"kvproof sim {scenario} --seed {seed}")
    path = tmp_path / "run.ndjson"
    simulate(load_scenario(scenario).model_copy(update={"seed": seed}), log_path=str(path))
    run = log_run(str(path))
    m, where = run.model, {}
    s, split = core.initial_state(m), Split(m)
    for line, record in run.records:
        event = flat_event(m, placed(run, line, record, codec.decode(record)), where)
        whole = core.change_for(m, s, event)
        assert type(whole) is not core.Refusal, f"line {line}: {whole}"
        out = split.take(event)
        assert type(out) is not core.Refusal, f"line {line}: {out}"
        s = core.commit(s, whole)
        assert split.whole() == s, f"line {line}: {event}"
    assert len(run.records) == events


# -- what crosses between the parts --------------------------------------------------------

def test_a_transfer_sends_exactly_the_messages_of_the_protocol():
    """One clean transfer on prefill 1 and decode 0 of workers-2x2: who takes each step and
    what it sends to whom."""
    m = Model(name="workers-2x2", **BASES["workers-2x2"])
    split = Split(m)
    prefill, decode = 3, 0   # the second prefill worker's first page, decode 0's first
    steps = [core.Arrive(0, 1, 1, 0), core.Reserve(0, (decode,)), core.Admit(0, (prefill,)),
             core.SendPage(0), core.LandWrite(0, decode), core.SendDone(0),
             core.Accept(0, True), core.Finish(0, True), core.Release(0)]
    seen = []
    for event in steps:
        out = split.take(event)
        assert type(out) is not core.Refusal, out
        taker = split.taker(event)
        who = "environment" if taker is None else taker.name
        sent = sorted((m_.to, m_.names, tuple(sorted(names(f for f, _ in m_.fields))))
                      for m_ in out.messages) if type(out) is Taken else []
        seen.append((event.action, who, sent))
    assert seen == [
        ("Arrive", "router", [
            ("decode", ("bootstrap",), ("boot", "client", "dworker", "prompt")),
            ("prefill", ("queue entry",), ("client", "prompt", "pst", "pworker"))]),
        ("Reserve", "decode 0", [("prefill", ("page table",), ("phit", "ptable"))]),
        ("Admit", "prefill 1", []),
        ("SendPage", "prefill 1", []),
        ("LandWrite", "environment", []),
        ("SendDone", "prefill 1", [("decode", ("final word",), ("fwCount", "fwMsg"))]),
        ("Accept", "decode 0", []),
        ("Finish", "decode 0", [("router", ("answer",), ("client",))]),
        ("Release", "decode 0", []),
    ]
    assert split.whole().requests[0][core.CLIENT] == core.OK


def test_the_edge_keeps_the_first_answer_and_tells_both_workers_the_client_left():
    m = Model(name="workers-2x2", **BASES["workers-2x2"])
    split = Split(m)
    split.take(core.Arrive(0, 1, 0, 1))
    out = split.take(core.Abort(0))
    assert sorted((x.to, x.names) for x in out.messages) == [
        ("decode", ("client gone",)), ("prefill", ("client gone",))]
    assert split.decodes[1].rows[0][core.CLIENT] == core.GONE
    out = split.take(core.PrefillAbort(0))      # the prefill stops on the notice
    assert type(out) is Taken
    assert split.whole().requests[0][core.CLIENT] == core.GONE


# -- mutants: a core action that leaves its own part -----------------------------------------

def _mutant(monkeypatch, function, old: str, new: str, action: type | None = None) -> None:
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == 1, old
    namespace = dict(vars(core))
    exec(source.replace(old, new), namespace)
    if action is None:
        monkeypatch.setattr(core, function.__name__, namespace[function.__name__])
    else:
        monkeypatch.setitem(core.ACTIONS, action, namespace[function.__name__])


TRANSFER = [core.Arrive(0, 1, 0, 1), core.Reserve(0, (3,)), core.Admit(0, (0,)),
            core.SendPage(0), core.LandWrite(0, 3), core.SendDone(0), core.Accept(0, True),
            core.Finish(0, True), core.Release(0)]


def _run_transfer() -> None:
    m = Model(name="workers-2x2", **BASES["workers-2x2"])
    split, outcomes = replay(m, TRANSFER)
    assert [type(out) is core.Refusal for out in outcomes] == [False] * len(TRANSFER)
    assert split.whole().requests[0][core.CLIENT] == core.OK


@pytest.mark.parametrize("function, action, old, new, message", [
    # The spec's SendPage before the locality change: addressed from decode's own table.
    (core.send_page, core.SendPage, "table = row[PTABLE]", "table = row[TABLE]",
     "SendPage (prefill 0) reads table: table is the decode's"),
    # A Release that waits for the prefill to be done (what decode cannot see).
    (core.release, core.Release, '    if "EagerRelease" not in m.bugs:\n',
     '    if row[PST] == RUNNING:\n        return "busy"\n    if "EagerRelease" not in m.bugs:\n',
     "Release (decode 1) reads pst: pst is the prefill's"),
    # Accept checking the count against what the prefill posted, not what Done announced.
    (core._transfer_fault, core.Accept, "row[FW_COUNT] != len(row[TABLE])",
     "row[SENT] != len(row[TABLE])", "Accept (decode 1) reads sent: sent is the prefill's"),
    # A decode that records the count the prefill keeps: a write nothing carries.
    (core.accept, core.Accept, "DST, DECODING, DFW, 1, ANNOUNCED, count)",
     "DST, DECODING, DFW, 1, ANNOUNCED, count, SENT, 0)",
     "Accept (decode 1) writes sent: sent is the prefill's, and no message carries it"),
])
def test_a_core_action_that_reads_or_writes_another_roles_field_is_caught(
        monkeypatch, function, action, old, new, message):
    _mutant(monkeypatch, function, old, new,
            None if function.__name__.startswith("_") else action)
    with pytest.raises(LocalityBreach) as caught:
        _run_transfer()
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_release_that_scans_every_decode_workers_pool_is_caught(monkeypatch):
    _mutant(monkeypatch, core._released, "    for page, _ in row[TABLE]:\n",
            "    for page in range(len(pool)):\n")
    with pytest.raises(LocalityBreach, match=r"^Release \(decode 1\) reads page 0: a page of "
                                             r"another worker's pool, not decode 1's own"):
        _run_transfer()


def test_a_timer_reads_the_other_side_only_through_its_timing_assumption(monkeypatch):
    """Timeout's lease rests on LeaseLapsed (the environment's); the same read written
    into the timer's own guard is decode reading the prefill's state. (Timers that may fire
    early read nothing of the other side: the model without them.)"""
    m = Model(name="workers-2x2", **{**BASES["workers-2x2"], "early_timeouts": False})
    split = Split(m)
    for event in (core.Arrive(0, 1, 0, 1), core.Reserve(0, (3,)), core.PrefillCrash(0)):
        split.take(event)
    assert split.decodes[1].take(core.Timeout(0), split.whole).event == core.Timeout(0)
    split = Split(m)
    for event in (core.Arrive(0, 1, 0, 1), core.Reserve(0, (3,)), core.PrefillCrash(0)):
        split.take(event)
    with pytest.raises(LocalityBreach, match=r"^Timeout \(decode 1\) reads pst"):
        split.decodes[1].take(core.Timeout(0))   # no environment: a process has its clock
    _mutant(monkeypatch, core.timeout, "if not lease_lapsed(m, s, r):",
            "if not prefill_silent(s, r):", core.Timeout)
    with pytest.raises(LocalityBreach, match=r"^Timeout \(decode 1\) reads pst"):
        split.take(core.Timeout(0))


# -- the environment's actions as each process applies them (engine/processes.py) ------------

def _shares_agree(split: Split, s: core.State, event: core.Event) -> list[str]:
    """What each process applies of LandWrite or DecodeCrash by itself (Part.land,
    completed, decode_crashed) against what the Split writes into its part; the parts that
    differ, by name."""
    after = split.copy()
    after.take(event)
    pairs = []
    if type(event) is core.LandWrite:
        w = next(w for w in s.writes if w[0] == event.request and w[2] == event.page)
        q, d = s.requests[w[0]][core.PW], s.requests[w[0]][core.DW]
        decode, prefill = split.decodes[d].copy(), split.prefills[q].copy()
        decode.land(w, s.prefill_pool[w[1]][1])
        prefill.completed(w)
        pairs = [(decode, after.decodes[d]), (prefill, after.prefills[q])]
    else:
        here = [r for r, row in split.router.rows.items() if row[core.DW] == event.worker]
        for mine, theirs in zip([split.router, *split.prefills],
                                [after.router, *after.prefills]):
            mine = mine.copy()
            mine.decode_crashed(here)
            pairs.append((mine, theirs))
    return [mine.name for mine, theirs in pairs if _known(mine) != _known(theirs)]


def _known(part) -> tuple:
    """A part's snapshot, but the page table of a request its prefill has finished with:
    after a decode crash the spec drops it only where decode still held the request, which
    the prefill cannot tell; nothing reads it again (Admit and SendPage need Queued or
    Running). engine/README.md lists this among the findings."""
    part = part.copy()
    if part.role == PREFILL:
        for r, row in part.rows.items():
            if row[core.PST] not in (core.QUEUED, core.RUNNING):
                part.rows[r] = core._row(row, core.PTABLE, ())
    return part.snapshot()


def test_each_process_applies_its_share_of_a_landing_and_a_decode_crash():
    """engine/processes.py has no whole state: decode lands a write, the prefill sees it
    complete, the router and each prefill see a decode crash, each on its own part. On
    every reachable LandWrite and DecodeCrash edge of workers-2x2 those shares are what
    the Split (the reference) writes into the same parts."""
    m = Model(name="workers-2x2", **BASES["workers-2x2"])
    init = core.initial_state(m)
    seen, frontier = {init: Split(m)}, deque([init])
    checked = {core.LandWrite: 0, core.DecodeCrash: 0}
    while frontier:
        s = frontier.popleft()
        split = seen[s]
        for event, t in core.successors(m, s):
            if type(event) in checked:
                assert _shares_agree(split, s, event) == [], f"{event} in {s}"
                checked[type(event)] += 1
            if t not in seen:
                twin = split.copy()
                twin.take(event)
                seen[t] = twin
                frontier.append(t)
    assert checked == {core.LandWrite: 336, core.DecodeCrash: 3796}


def test_a_part_offers_every_protocol_action_its_role_may_take_and_only_those():
    """Part.offers (what a process offers its part, from the core's table) against the
    core's own successors: on random behaviours of two requests over 2 x 2 workers with
    every loss and crash, at every state, for each worker and request placed on it, the
    kinds of the offered events the core accepts are exactly the kinds of its role's
    enabled protocol events (an allocation offered with the worker's lowest free pages)."""
    from spec.check.simulate import behaviour
    from tests.parts_cases import TWO_REQUESTS_LOSSY_2X2 as m

    seed = int(os.environ.get("KVPROOF_PARTS_SEED") or random.randrange(2**32))
    print(f"replay with KVPROOF_PARTS_SEED={seed}")
    rng, checked = random.Random(seed), 0
    for _ in range(60):
        split = Split(m)
        for s, event, _ in behaviour(m, rng, 40):
            enabled = {(type(e), e.request) for e, _ in core.successors(m, s)
                       if core.INFO[type(e)].kind == "protocol"}
            for part in split.prefills + split.decodes:
                def lowest(need, part=part):
                    free = [part.base + i for i, page in enumerate(part.pool)
                            if page[0] == core.NONE]
                    return tuple(free[:need]) if len(free) >= need else None
                for r in part.rows:
                    if split.placed(r, part.role) is not part:
                        continue
                    accepted = {(type(e), r) for e in part.offers(r, lowest)
                                if type(core.change_for(m, s, e)) is not core.Refusal}
                    mine = {(kind, q) for kind, q in enabled if q == r
                            and core.INFO[kind].worker == part.role}
                    assert accepted == mine, (seed, part.name, r, s)
                    checked += 1
            split.take(event)
    assert checked > 1000, checked
