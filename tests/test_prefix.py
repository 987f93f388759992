"""Prefix caching in the core (issue 27, decode side): hits, the tail, sealing, references,
eviction, step by step on the prefix model. The model checker and conformance cover every
interleaving; these pin what one behaviour does, page by page."""

from __future__ import annotations

from dataclasses import replace

from spec import core
from spec.core import (Accept, Admit, Arrive, Evict, Finish, LandWrite, Refusal, Release,
                       Reserve, SendDone, SendPage, apply, initial_state)
from spec.check.zoo import BASES
from spec.properties import SaltsApart
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
        owner, _, _, _, readers, ident, kv, tid = s.decode_pool[page]
        assert (owner, readers, ident, kv, tid) == (core.NONE, (), (1, tokens), (1, tokens),
                                                    (1, tokens))


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


# The prefill-side cache (PrefillCache): hits at Admit, the suffix computed, sends from
# cached sources, sealing at SendDone, PrefillEvict, EvictWhileSending.

PP = Model(name="prefix-prefill", **BASES["prefix-prefill"])
# Three requests and two salts, for the behaviour two requests cannot reach: a third
# request's allocation overwriting a cached source while a send still reads it.
PP3 = Model(name="prefix-prefill3", **{**BASES["prefix-prefill"], "requests": 3,
                                       "decode_pages": 3, "tenants": 2})


def prefill_sealed(m: Model = PP, n: int = 1):
    """r1 (n pages of token 1, salt 1) through SendDone: its source pages sealed at the
    prefill, nothing accepted at decode yet (so a later request misses there)."""
    return run(m, [Arrive(0, n, 0, 0, (1,) * n, 1), Reserve(0, tuple(range(n))),
                   Admit(0, tuple(range(n))), *[SendPage(0)] * n,
                   *[LandWrite(0, p) for p in range(n)], SendDone(0)])


def test_sendDone_seals_the_pages_the_prefill_computed():
    s = prefill_sealed()
    assert s.prefill_pool[0] == (core.NONE, 0, (), (1, (1,)))  # owned by nobody, findable
    assert s.prefill_pool[1] == core.FRESH_PREFILL_PAGE


def test_a_prefill_hit_allocates_only_the_suffix_and_sends_the_cached_page_from_its_source():
    m = PP3
    s = run(m, [Arrive(1, 2, 0, 0, (1, 1), 1), Reserve(1, (1, 2))], prefill_sealed(m))
    assert core.allocation_need(m, s, Admit, 1) == 1  # page 1 is cached at the prefill
    assert type(apply(m, s, Admit(1, (0, 1)))) is Refusal  # the hit page is not free
    s = run(m, [Admit(1, (1,))], s)
    row = s.requests[1]
    assert (row[core.SRC], row[core.PCACHED], core.pages_to_compute(m, row)) == ((0, 1), 1, 1)
    assert s.prefill_pool[0][core.P_READERS] == (1,)
    # Decode missed (r1 was not accepted when r2 reserved): both pages are sent, the first
    # from the source r1 computed.
    s = run(m, [SendPage(1)], s)
    assert s.writes == ((1, 0, 1, 1),)
    assert "read by a request" in apply(m, s, core.PrefillEvict(0, 0)).reason
    s = run(m, [SendPage(1), LandWrite(1, 1), LandWrite(1, 2), SendDone(1), Accept(1, True),
                Finish(1, True)], s)
    assert s.requests[1][core.CLIENT] == core.OK and not s.requests[1][core.LEAKED]
    assert s.decode_pool[1][core.KV] == (1, (1,))  # r1 computed it; r2's identity all the same
    assert s.prefill_pool[0][core.P_READERS] == ()  # r2's reference dropped at its SendDone
    assert s.prefill_pool[1][core.P_IDENT] == (1, (1, 1))  # and its own page sealed


def test_a_full_prefill_hit_computes_nothing_and_still_sends_what_decode_lacks():
    s = run(PP, [Arrive(1, 1, 0, 0, (1,), 1), Reserve(1, (1,))], prefill_sealed())
    assert core.allocation_need(PP, s, Admit, 1) == 0
    s = run(PP, [Admit(1, ())], s)
    assert core.pages_to_compute(PP, s.requests[1]) == 0
    s = run(PP, [SendPage(1), LandWrite(1, 1), SendDone(1)], s)
    assert (s.requests[1][core.FW], s.requests[1][core.FW_COUNT]) == (core.MSG_DONE, 1)
    s = run(PP, [Accept(1, True), Finish(1, True), Release(1)], s)
    assert s.requests[1][core.CLIENT] == core.OK and not s.requests[1][core.LEAKED]


def test_prefill_eviction_waits_for_the_last_reader_and_a_crash_wipes_the_cache():
    s = run(PP, [Arrive(1, 1, 0, 0, (1,), 1), Reserve(1, (1,)), Admit(1, ())], prefill_sealed())
    assert type(apply(PP, s, core.PrefillEvict(0, 0))) is Refusal  # r2 reads it
    assert "not cached" in apply(PP, s, core.PrefillEvict(0, 1)).reason
    s = run(PP, [core.PrefillFail(1)], s)  # a stopped prefill drops its reference too
    s = run(PP, [core.PrefillEvict(0, 0)], s)
    assert s.prefill_pool[0] == (core.NONE, 0, (), ())  # forgotten; the memory keeps its KV
    crash = replace(PP, crashes=True)
    s = run(crash, [Arrive(1, 1, 0, 0, (1,), 1), Reserve(1, (1,)), Admit(1, ()),
                    core.PrefillCrash(0)], prefill_sealed(crash))
    assert s.prefill_pool[0] == (core.NONE, 0, (), ())


def _overwritten_while_sending(m: Model):
    """r2 hits r1's cached source at the prefill; r3, another tenant, allocates that page
    while r2's write out of it is still to be posted."""
    s = run(m, [Arrive(1, 1, 0, 0, (1,), 1), Reserve(1, (1,)), Admit(1, ()),
                Arrive(2, 1, 0, 0, (1,), 2), Reserve(2, (2,))], prefill_sealed(m))
    return s, apply(m, s, Admit(2, (0,)))


def test_a_cached_source_being_sent_from_is_not_reallocated():
    _, out = _overwritten_while_sending(PP3)
    assert type(out) is Refusal and "in use" in out.reason


def test_evictWhileSending_makes_decode_read_another_prompts_kv():
    bug = PP3.with_bugs({"EvictWhileSending"})
    s, out = _overwritten_while_sending(bug)
    s = run(bug, [SendPage(1), LandWrite(1, 1)], out)
    assert s.decode_pool[1][core.KV] == (2, (1,))  # r3's tenant's KV in r2's page
    assert not core.checksums_match(bug, s, 1)  # the checksum catches it: ErrTransfer
    assert run(bug, [SendDone(1), Accept(1, False)], s).requests[1][core.CLIENT] \
        == core.ERR_TRANSFER
    unverified = PP3.with_bugs({"EvictWhileSending", "NoChecksum"})
    s, out = _overwritten_while_sending(unverified)
    s = run(unverified, [SendPage(1), LandWrite(1, 1), SendDone(1), Accept(1, False),
                         Finish(1, True)], out)
    assert s.requests[1][core.CLIENT] == core.OK and s.requests[1][core.LEAKED]  # Isolation


def test_the_prefill_cache_keeps_salts_apart_and_noSalt_shares_across_tenants():
    s = run(PP3, [Arrive(1, 1, 0, 0, (1,), 2), Reserve(1, (1,))], prefill_sealed(PP3))
    assert core.allocation_need(PP3, s, Admit, 1) == 1  # tenant 2 holds nothing cached
    nosalt = PP3.with_bugs({"NoSalt"})
    s = run(nosalt, [Arrive(1, 1, 0, 0, (1,), 2), Reserve(1, (1,)), Admit(1, ())],
            prefill_sealed(nosalt))
    assert s.requests[1][core.SRC] == (0,)  # the bug: tenant 1's page as tenant 2's source
    assert not SaltsApart(nosalt, s) and SaltsApart(PP3, prefill_sealed(PP3))


def test_a_page_a_write_still_reads_out_of_is_not_evicted_even_with_no_reader():
    """With an early Done (EarlyDone) the prefill seals a source its write still reads, and
    nobody reads it as a cached page: the write in flight alone keeps it from eviction and
    reallocation (without the bug the writes have all completed by SendDone)."""
    early = PP.with_bugs({"EarlyDone"})
    s = run(early, [Arrive(0, 1, 0, 0, (1,), 1), Reserve(0, (0,)), Admit(0, (0,)),
                    SendPage(0), SendDone(0)])
    assert s.prefill_pool[0][core.P_IDENT] == (1, (1,)) and s.writes
    assert "by a write in flight" in apply(early, s, core.PrefillEvict(0, 0)).reason
    assert not core.prefill_free(early, s, 0)
    s = run(early, [LandWrite(0, 0), core.PrefillEvict(0, 0)], s)
    assert s.prefill_pool[0][core.P_IDENT] == ()


def test_n_siblings_share_every_prompt_page_once_the_first_is_accepted():
    """Two completions of one prompt (siblings: same tokens and salt) on the two-sided
    cache: the second holds its Reserve while the first's transfer is under way
    (core.sibling_waits), then hits every page at decode and at the prefill, so the prompt
    is computed and transferred once and its pages are held once, read by both."""
    s = run(PP, [Arrive(0, 2, 0, 0, (1, 1), 1), Arrive(1, 2, 0, 0, (1, 1), 1)])
    steps = [Reserve(0, (0, 1)), Admit(0, (0, 1)), SendPage(0), SendPage(0),
             LandWrite(0, 0), LandWrite(0, 1), SendDone(0)]
    for event in steps:
        assert core.sibling_waits(s.requests[0]), event
        s = run(PP, [event], s)
    assert core.sibling_waits(s.requests[0])  # sealed at the prefill, not yet at decode
    s = run(PP, [Accept(0, True)], s)
    assert not core.sibling_waits(s.requests[0])
    s = run(PP, [Reserve(1, ()), Admit(1, ())], s)  # full hits on both sides
    row = s.requests[1]
    assert (row[core.HIT], row[core.PCACHED], core.pages_to_compute(PP, row)) == (2, 2, 0)
    assert [s.decode_pool[p][core.READERS] for p in (0, 1)] == [(0, 1), (0, 1)]
    s = run(PP, [SendDone(1), Accept(1, True), Finish(0, True), Release(0)], s)
    assert s.requests[1][core.FW_COUNT] == 0  # nothing sent for the sibling
    assert [s.decode_pool[p][core.READERS] for p in (0, 1)] == [(1,), (1,)]  # still read
    s = run(PP, [Finish(1, True), Release(1)], s)
    assert [s.requests[r][core.CLIENT] for r in (0, 1)] == [core.OK, core.OK]
    assert not any(s.requests[r][core.LEAKED] for r in (0, 1))


def test_a_sibling_whose_first_failed_goes_on_alone():
    """Decode times the first out just as its Done is on the way: decode seals nothing, so
    the sibling stops waiting and misses at decode (it reserves and is sent its own page),
    while the prefill, whose SendDone sealed what it computed, still spares it the compute."""
    m = replace(PP, early_timeouts=True)
    s = run(m, [Arrive(0, 1, 0, 0, (1,), 1), Arrive(1, 1, 0, 0, (1,), 1),
                Reserve(0, (0,)), Admit(0, (0,)), SendPage(0), LandWrite(0, 0), SendDone(0),
                core.Timeout(0)])
    assert s.requests[0][core.CLIENT] == core.ERR_TIMEOUT
    assert not core.sibling_waits(s.requests[0])
    s = run(m, [Reserve(1, (1,)), Admit(1, ())], s)
    row = s.requests[1]
    assert (row[core.HIT], row[core.PCACHED]) == (0, 1)
    s = run(m, [SendPage(1), LandWrite(1, 1), SendDone(1), Accept(1, True), Finish(1, True)], s)
    assert s.requests[1][core.CLIENT] == core.OK and not s.requests[1][core.LEAKED]
