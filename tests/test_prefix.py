"""Prefix caching in the core (issue 27, decode side): hits, the tail, sealing, references,
eviction, step by step on the prefix model. The model checker and conformance cover every
interleaving; these pin what one behaviour does, page by page."""

from __future__ import annotations

from spec import core
from spec.core import (Accept, Admit, Arrive, Evict, Finish, LandWrite, Refusal, Release,
                       Reserve, SendDone, SendPage, apply, initial_state)
from spec.check.zoo import BASES
from spec.model import Model

M = Model(name="prefix", **BASES["prefix"])


def run(m: Model, events, s=None):
    s = s if s is not None else initial_state(m)
    for event in events:
        out = apply(m, s, event)
        assert type(out) is not Refusal, out
        s = out
    return s


def first_request(m: Model = M, salt: int = 1):
    """r1 (tokens 1 1, salt 1) through to Release: its two pages end sealed and cached."""
    return run(m, [Arrive(0, 2, 0, 0, (1, 1), salt), Reserve(0, (0, 1)), Admit(0, (0, 1)),
                   SendPage(0), SendPage(0), LandWrite(0, 0), LandWrite(0, 1), SendDone(0),
                   Accept(0, True), Finish(0, True), Release(0)])


def test_an_accepted_transfer_is_sealed_and_stays_cached_after_release():
    s = first_request()
    assert s.requests[0][core.CLIENT] == core.OK
    for page, tokens in ((0, (1,)), (1, (1, 1))):
        owner, _, _, _, readers, ident, kv = s.decode_pool[page]
        assert (owner, readers, ident, kv) == (core.NONE, (), (1, tokens), (1, tokens))


def test_a_partial_hit_references_the_cached_page_and_the_prefill_sends_only_the_tail():
    m = Model(name="prefix3", **{**BASES["prefix"], "decode_pages": 3, "context_pages": 3,
                                 "prefill_pages": 3, "max_prompt_pages": 3})
    s = run(m, [Arrive(0, 1, 0, 0, (1,), 1), Reserve(0, (0,)), Admit(0, (0,)), SendPage(0),
                LandWrite(0, 0), SendDone(0), Accept(0, True)])
    s = run(m, [Arrive(1, 2, 0, 0, (1, 1), 1)], s)
    assert core.allocation_need(m, s, Reserve, 1) == 1  # one page cached, one to reserve
    s = run(m, [Reserve(1, (1,)), Admit(1, (1, 2))], s)
    row = s.requests[1]
    assert (row[core.HIT], row[core.PHIT], row[core.TABLE]) == (1, 1, ((0, 1), (1, 1)))
    assert s.decode_pool[0][core.READERS] == (0, 1)
    s = run(m, [SendPage(1)], s)
    assert s.writes == ((1, 2, 1, 1),)  # its second source page into table entry 2
    assert type(apply(m, s, SendPage(1))) is Refusal  # the cached page is not sent
    s = run(m, [LandWrite(1, 1), SendDone(1), Accept(1, True), Finish(1, True)], s)
    assert s.requests[1][core.CLIENT] == core.OK and not s.requests[1][core.LEAKED]


def test_a_full_hit_sends_nothing_and_the_final_word_still_flows():
    s = run(M, [Arrive(1, 2, 0, 0, (1, 1), 1), Reserve(1, ()), Admit(1, (0, 1))],
            first_request())
    assert type(apply(M, s, SendPage(1))) is Refusal
    s = run(M, [SendDone(1)], s)
    assert (s.requests[1][core.FW_COUNT], s.requests[1][core.PST]) == (0, core.P_DONE)
    s = run(M, [Accept(1, True), Finish(1, True), Release(1)], s)
    assert s.requests[1][core.CLIENT] == core.OK
    assert s.decode_pool[0][core.READERS] == () and s.decode_pool[0][core.IDENT] != ()


def test_another_salt_misses_and_noSalt_hits():
    s = run(M, [Arrive(1, 1, 0, 0, (1,), 2)], first_request())
    assert core.allocation_need(M, s, Reserve, 1) == 1  # salt 2 holds nothing cached
    nosalt = M.with_bugs({"NoSalt"})
    s = run(nosalt, [Arrive(1, 1, 0, 0, (1,), 2)], first_request(nosalt))
    assert core.allocation_need(nosalt, s, Reserve, 1) == 0  # the bug: tenant 1's page


def test_eviction_takes_only_a_page_nobody_reads():
    s = run(M, [Arrive(1, 1, 0, 0, (1,), 1), Reserve(1, ())], first_request())
    assert "has readers" in apply(M, s, Evict(0, 0)).reason
    s = run(M, [Evict(0, 1)], s)
    assert s.decode_pool[1][core.IDENT] == () and s.decode_pool[1][core.KV] == (1, (1, 1))


def test_without_a_prefix_cache_a_prompt_has_no_tokens_and_nothing_is_evicted():
    m = Model(name="solo", **BASES["solo"])
    assert type(apply(m, initial_state(m), Arrive(0, 1, 0, 0, (1,), 1))) is Refusal
    assert type(apply(m, initial_state(m), Evict(0, 0))) is Refusal
