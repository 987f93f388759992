"""The protocol core: transitions, refusals, enumeration."""

from __future__ import annotations

from collections import deque
from itertools import combinations

import pytest

from spec import core
from spec.core import (
    Abort, Accept, Admit, AnswerCancel, Arrive, DecodeAbort, DecodeReject, DropBootstrap,
    Finish, LandWrite, Notice, PrefillAbort, PrefillFail, ProtocolMisuse, Refusal, Reject,
    Release, Reserve, SendDone, SendPage, Timeout, apply, initial_state, successors,
)
from spec.model import Model, ModelError
from spec.check.zoo import BASES

DEFAULT = Model(**BASES["default"])


def run(m: Model, *events):
    state = initial_state(m)
    for event in events:
        state = apply(m, state, event)
        assert not isinstance(state, Refusal), state
    return state


HAPPY = (Arrive(0, 2), Reserve(0, (0, 1)), Admit(0, (0, 1)), SendPage(0), SendPage(0),
         LandWrite(0, 0), LandWrite(0, 1), SendDone(0), Accept(0, True), Finish(0, True), Release(0))


def test_happy_path_ends_clean_with_every_page_back():
    s = run(DEFAULT, *HAPPY)
    row = s.requests[0]
    assert core.CLIENT_NAMES[row[core.CLIENT]] == "Ok"
    assert core.DECODE_NAMES[row[core.DST]] == "Released"
    assert core.PREFILL_NAMES[row[core.PST]] == "Done"
    assert all(page[core.OWNER] == core.NONE for page in s.decode_pool)
    assert all(page[0] == core.NONE for page in s.prefill_pool)
    # Freed pages keep their content: request 0's data, tagged with generation 1.
    assert [page[core.DATA] for page in s.decode_pool] == [0, 0, core.NONE]
    assert [page[core.TAG] for page in s.decode_pool] == [1, 1, -1]
    assert s.writes == ()


CORRUPTED = [
    # (events before, the corrupted event, words the reason must contain)
    ((), LandWrite(0, 0), "no write"),
    ((Arrive(0, 1),), Accept(0, True), "no Done"),
    ((Arrive(0, 1),), Release(0), "not Closing"),
    ((Arrive(0, 1),), SendPage(0), "not Running"),
    ((Arrive(0, 1),), Admit(0, (0,)), "page table"),
    ((Arrive(0, 1),), Reserve(0, (0, 1)), "1 decode pages needed, 2 given"),
    ((Arrive(0, 1), Reserve(0, (0,)), Arrive(1, 1)), Reserve(1, (0,)), "not free"),
    ((Arrive(0, 2), Reserve(0, (0, 1))), Admit(0, (1, 0)), "ascending"),
    ((Arrive(0, 2),), Reject(0), "fits the prefill pool"),
    ((Arrive(0, 1), Reserve(0, (0,)), Timeout(0)), Release(0), "final word"),
    ((Arrive(0, 1), Reserve(0, (0,)), Admit(0, (0,)), SendPage(0)), SendDone(0),
     "in flight"),
    ((Arrive(0, 1), Reserve(0, (0,)), Admit(0, (0,)), SendPage(0)), PrefillFail(0),
     "in flight"),
    ((Arrive(0, 1),), Arrive(0, 1), "already arrived"),
    ((), Arrive(0, 4), "outside 1..3"),
    ((Arrive(0, 1),), DecodeAbort(0), "has not gone"),
    ((Arrive(0, 1),), PrefillAbort(0), "neither a cancel nor a client abort"),
    ((Arrive(0, 1),), AnswerCancel(0), "no cancel"),
    ((Arrive(0, 1),), DropBootstrap(0), "not Tomb"),
    ((Arrive(0, 1),), DecodeReject(0), "fits the decode pool"),
    ((Arrive(0, 1),), Notice(0), "no Reject or Abort"),
    ((Arrive(0, 1),), Finish(0, True), "not Decoding"),
    ((), Abort(0), "not Waiting"),
]


@pytest.mark.parametrize("before, event, reason", CORRUPTED,
                         ids=[c[1].label() for c in CORRUPTED])
def test_corrupted_event_is_refused_with_a_reason_and_changes_nothing(before, event, reason):
    state = run(DEFAULT, *before)
    answer = apply(DEFAULT, state, event)
    assert isinstance(answer, Refusal)
    assert reason in answer.reason
    assert event.label() in str(answer)


def test_a_write_into_a_foreign_page_cannot_be_forged():
    """A LandWrite naming another request's page is refused: writes are the core's, not the
    caller's."""
    s = run(DEFAULT, Arrive(0, 1), Reserve(0, (0,)), Admit(0, (0,)), SendPage(0))
    assert isinstance(apply(DEFAULT, s, LandWrite(1, 0)), Refusal)
    assert isinstance(apply(DEFAULT, s, LandWrite(0, 2)), Refusal)


def test_misuse_raises():
    s = initial_state(DEFAULT)
    with pytest.raises(ProtocolMisuse):
        apply(DEFAULT, s, Arrive(7, 1))
    with pytest.raises(ProtocolMisuse):
        apply(DEFAULT, s, LandWrite(0, 99))
    with pytest.raises(ProtocolMisuse):
        apply(DEFAULT, s, Admit(0, [0]))
    with pytest.raises(ModelError):
        Model(bugs={"NoSuchBug"})
    with pytest.raises(ModelError):
        Model(prefill_pages=0)


def _brute_force(m: Model, s):
    """Every event the model's alphabet has, tried one by one through apply."""
    out = []
    for r in range(m.requests):
        for n in range(1, m.max_prompt_pages + 1):
            out.append(Arrive(r, n))
        for k in range(m.max_prompt_pages + 1):
            out += [Admit(r, pages) for pages in combinations(range(m.prefill_pages), k)]
            out += [Reserve(r, pages) for pages in combinations(range(m.decode_pages), k)]
        out += [LandWrite(r, p) for p in range(m.decode_pages)]
        for cls, _ in core._SIMPLE_ACTIONS:
            events = core.interned_events(cls, r)
            out += events if isinstance(events, tuple) else [events]
    out.append(core.PrefillCrash())
    enabled = {}
    for event in out:
        if core.observation_conflict(m, s, event):
            continue  # the enumeration reports what the page contents imply, nothing else
        nxt = apply(m, s, event)
        if not isinstance(nxt, Refusal):
            enabled[event] = nxt
    return enabled


@pytest.mark.parametrize("base, bugs", [("solo-crash", frozenset()), ("solo", frozenset(
    {"PoolBelowContext", "FinishedNotRejected", "EagerRelease", "NoTombstone"})),
    ("crash", frozenset({"SourceReuse", "NoGenBump"}))])
def test_successors_equal_apply_over_the_whole_alphabet(base, bugs):
    """The fast enumeration misses nothing and invents nothing, on every reachable state
    (up to a bound for the two-request model)."""
    m = Model(bugs=bugs, **BASES[base])
    seen = {initial_state(m)}
    queue = deque(seen)
    while queue and len(seen) < 4000:
        s = queue.popleft()
        fast = dict(successors(m, s))
        assert fast == _brute_force(m, s)
        for nxt in fast.values():
            assert nxt != s, "no action stutters"
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)


def test_states_are_plain_hashable_tuples_with_stable_hashes():
    s = run(DEFAULT, *HAPPY[:5])
    assert isinstance(s, tuple) and hash(s) == hash(tuple(s))
    # ints and tuples hash the same in every process: fingerprints are reproducible.
    assert hash(initial_state(DEFAULT)) == hash(initial_state(Model(**BASES["default"])))


def test_finished_not_rejected_swaps_an_overlong_prompt_for_one_page():
    m = Model(bugs={"FinishedNotRejected", "PoolBelowContext"}, **BASES["default"])
    s = run(m, Arrive(0, 3))
    assert isinstance(apply(m, s, Reject(0)), Refusal)
    s = run(m, Arrive(0, 3), Reserve(0, (0, 1, 2)), Admit(0, (0,)))
    assert s.requests[0][core.SRC] == (0,)
    assert core.CLIENT_NAMES[s.requests[0][core.CLIENT]] == "Waiting"


def test_prefill_crash_loses_running_requests_and_flushes_their_writes():
    m = Model(**BASES["solo-crash"])
    s = run(m, Arrive(0, 2), Reserve(0, (0, 1)), Admit(0, (0, 1)), SendPage(0))
    s = apply(m, s, core.PrefillCrash())
    row = s.requests[0]
    assert core.PREFILL_NAMES[row[core.PST]] == "Aborted"
    assert core.CLIENT_NAMES[row[core.CLIENT]] == "ErrPrefill"
    assert s.writes == () and all(page[0] == core.NONE for page in s.prefill_pool)
    # Nothing left to lose: a second crash is refused, and models without crashes refuse it.
    assert isinstance(apply(m, s, core.PrefillCrash()), Refusal)
    assert "Crashes = FALSE" in apply(DEFAULT, initial_state(DEFAULT), core.PrefillCrash()).reason
    # Decode learns by timing out; the restarted prefill answers the cancel with Abort.
    s = run(m, Arrive(0, 1), Reserve(0, (0,)), core.PrefillCrash(), Timeout(0), AnswerCancel(0),
            Notice(0), Release(0))
    assert all(page[core.OWNER] == core.NONE for page in s.decode_pool)


def test_decode_crash_tombstones_what_decode_knew_and_frees_its_pool_keeping_generations():
    m = Model(**BASES["solo-decode-crash"])
    s = run(m, Arrive(0, 2), Reserve(0, (0, 1)), Admit(0, (0, 1)), SendPage(0))
    gens = [page[core.GEN] for page in s.decode_pool]
    s = apply(m, s, core.DecodeCrash())
    row = s.requests[0]
    assert core.DECODE_NAMES[row[core.DST]] == "Tomb" and row[core.TABLE] == ()
    assert core.CLIENT_NAMES[row[core.CLIENT]] == "ErrDecode"
    assert row[core.CANCEL] == 1 and row[core.BOOT] == 0      # the prefill learns; no re-reserve
    assert s.writes == () and all(page[core.OWNER] == core.NONE for page in s.decode_pool)
    assert [page[core.GEN] for page in s.decode_pool] == gens  # generations survive
    assert isinstance(apply(m, s, SendPage(0)), Refusal)      # no table to write into
    for event in (PrefillAbort(0), Notice(0)):  # decode ignores the old epoch's final word
        s = apply(m, s, event)
        assert not isinstance(s, Refusal), s
    assert core.settled(s.requests[0])
    assert "DecodeCrashes = FALSE" in apply(DEFAULT, initial_state(DEFAULT),
                                            core.DecodeCrash()).reason


def test_message_pending_names_where_each_message_waits_in_a_row():
    row = core.EMPTY_ROW
    for message, field, value in ((core.BOOTSTRAP, core.BOOT, 1),
                                  (core.FINAL_WORD_MSG, core.FW, core.MSG_DONE),
                                  (core.CANCEL_MSG, core.CANCEL, 1)):
        assert not core.message_pending(row, message)
        assert core.message_pending(core._row(row, field, value), message)
    running = core._row(row, core.PST, core.RUNNING)
    assert core.message_pending(running, core.CLIENT_GONE, "prefill")
    assert not core.message_pending(row, core.CLIENT_GONE, "prefill")
    booted = core._row(row, core.BOOT, 1)
    assert core.message_pending(booted, core.CLIENT_GONE, "decode")
    assert not core.message_pending(core._row(booted, core.DST, core.D_WAITING),
                                    core.CLIENT_GONE, "decode")
    with pytest.raises(core.ProtocolMisuse):
        core.message_pending(row, core.CLIENT_GONE)
