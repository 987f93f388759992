"""Observed verdicts: the core decides on what the data path reports, and the page contents
are the oracle a report is checked against.

Both directions, as a real engine would meet them: a bad observation over clean pages (a
bit flip the model does not know of) fails the request with the guard's error; a "clean"
observation over foreign pages (a data-path guard that failed) lets the core go on, because
the core cannot know better, and the store's oracle flags the report.
"""

from __future__ import annotations

from spec import core
from spec.core import (Accept, Admit, Arrive, Finish, LandWrite, Reserve, SendDone, SendPage,
                       apply, initial_state)
from spec.model import Model
from spec.store import TRUTHFUL_OBSERVATION, Store

M = Model(requests=2, max_prompt_pages=2, context_pages=2, prefill_pages=2, decode_pages=4)


def _transferred(m: Model = M):
    """r1 (request 0) with its one page transferred cleanly and Done in flight."""
    s = initial_state(m)
    for event in (Arrive(0, 1), Reserve(0, (2,)), Admit(0, (0,)), SendPage(0),
                  LandWrite(0, 2), SendDone(0)):
        s = apply(m, s, event)
        assert not isinstance(s, core.Refusal), s
    return s


def test_a_bad_checksum_over_clean_pages_fails_the_request_with_err_transfer():
    s = _transferred()
    assert core.checksums_match(M, s, 0)  # the pages are clean
    after = apply(M, s, Accept(0, False))
    row = after.requests[0]
    assert (row[core.CLIENT], row[core.DST]) == (core.ERR_TRANSFER, core.CLOSING)
    assert "checksums_ok=False" in core.observation_conflict(M, s, Accept(0, False))


def test_a_bad_tag_check_over_clean_pages_fails_the_request_with_err_tag():
    s = apply(M, _transferred(), Accept(0, True))
    assert s.requests[0][core.DST] == core.DECODING and core.tags_match(M, s, 0)
    after = apply(M, s, Finish(0, False))
    assert after.requests[0][core.CLIENT] == core.ERR_TAG
    assert core.observation_conflict(M, s, Finish(0, False))


def test_a_truthful_observation_is_no_conflict():
    s = _transferred()
    assert core.observation_conflict(M, s, Accept(0, True)) == ""
    assert core.observation_conflict(M, s, SendDone(0)) == ""  # nothing observed


def test_without_the_checksum_guard_a_bad_observation_changes_nothing():
    m = M.with_bugs({"NoChecksum"})
    after = apply(m, _transferred(m), Accept(0, False))
    assert after.requests[0][core.DST] == core.DECODING


def _store_with_clean_transfer() -> Store:
    store = Store(M, prefill_workers=1, decode_workers=1)
    store.arrive(0, 0, 0)
    for event in (Arrive(0, 1), Reserve(0, (2,)), Admit(0, (0,)), SendPage(0),
                  LandWrite(0, 2), SendDone(0)):
        out = store.take(0, event)
        assert not isinstance(out, core.Refusal), out
    return store


def test_the_store_flags_clean_reported_over_foreign_data():
    store = _store_with_clean_transfer()
    # The page now holds another request's bytes (what a late foreign write leaves behind).
    owner, gen, _, tag = store.decode_pools[0][2][:4]
    store.decode_pools[0][2] = (owner, gen, 1, tag)
    out = store.take(0, Accept(0, True))
    assert not isinstance(out, core.Refusal)
    assert store.rows[0][core.DST] == core.DECODING  # the core decides on the report...
    assert [v.property for v in store.violations] == [TRUTHFUL_OBSERVATION]  # ...and it is flagged
    assert "page contents say False" in store.violations[0].detail


def test_the_store_flags_bad_reported_over_clean_data_and_the_request_fails():
    store = _store_with_clean_transfer()
    store.take(0, Accept(0, False))
    assert store.rows[0][core.CLIENT] == core.ERR_TRANSFER
    assert [v.property for v in store.violations] == [TRUTHFUL_OBSERVATION]


def test_a_truthful_shell_raises_no_flag():
    store = _store_with_clean_transfer()
    store.take(0, Accept(0, True))
    store.take(0, Finish(0, True))
    assert store.rows[0][core.CLIENT] == core.OK
    assert store.violations == []


def test_every_enumerated_observation_is_the_oracles():
    """The checker's successors report what the page contents imply, never a contradiction."""
    s = _transferred()
    events = [event for event, _ in core.successors(M, s) if core.INFO[type(event)].observed]
    assert events == [Accept(0, True)]
