"""The engine fuzz target with the prefix caches (fuzz/engine_target.py): a page another
request computed is judged by its bytes, so a read of the same prefix's KV passes and a
read of another prompt's (or never-written) KV is reported; and a model without a cache
draws exactly what it drew before the cache moves existed.

Each scenario drives the target with its own moves (Arrive with the token kinds and salt
fuzz/machine.py `arrival` draws, Wait) and checks it with the fuzzer's own checks after
every move, as a campaign does.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fuzz import engine_target  # noqa: E402
from fuzz.engine_target import PAGE_BLOCKS, PAGE_TOKENS, EngineTarget  # noqa: E402
from fuzz.machine import PREFIX_MODEL  # noqa: E402
from fuzz.oracles import LEAK_ORACLE, Checks, check  # noqa: E402
from fuzz.runner import Campaign, run_campaign  # noqa: E402
from fuzz.target import Open, Wait  # noqa: E402
from spec import core  # noqa: E402
from spec.model import Model  # noqa: E402
from test_fuzz_engine_oracles import Driven  # noqa: E402

# Per request: three full prompt pages and three pages of output (decode steps enough that
# the checks see r2 decoding, between its Accept and its Finish).
PAGES = 6
PROMPT_PAGES = 3


def _prefix_model(prefill_cache: bool, bugs=frozenset()) -> Model:
    return Model(requests=3, max_prompt_pages=8, context_pages=8, prefill_pages=16,
                 decode_pages=16, bugs=frozenset(bugs), **PREFIX_MODEL,
                 **({"prefill_cache": True} if prefill_cache else {}))


def _run(monkeypatch, m: Model, arrivals, checks: Checks) -> tuple[EngineTarget, list]:
    """Each arrival (its token kinds and salt) in turn, run to its end, checked after every
    move. Every prompt fills its first three pages (output after them)."""
    monkeypatch.setattr(engine_target, "request_shape", lambda rng, pages: (
        PROMPT_PAGES * PAGE_TOKENS, (pages - PROMPT_PAGES) * PAGE_TOKENS))
    target, found = EngineTarget(), []
    target.reset(m, 0)
    for r, (kinds, salt) in enumerate(arrivals):
        target.step(core.Arrive(r, PAGES, tokens=kinds, salt=salt))
        found.extend(check(checks, m, target))
        for _ in range(200):
            if r not in target.rt.live:
                break
            target.step(Wait())
            found.extend(check(checks, m, target))
        assert r not in target.rt.live, f"request {r + 1} never ended"
    return target, found


@pytest.mark.parametrize("prefill_cache", [False, True], ids=["decode cache", "both caches"])
def test_a_page_another_request_computed_is_read_as_the_reader_s_own(monkeypatch,
                                                                      prefill_cache):
    """r2's prompt is r1's token for token (same kinds, same salt): decode reserves r1's
    three sealed prompt pages for it (and with the prefill's cache the prefill reads r1's
    sources too), so r2 decodes from pages r1 wrote. Every check passes, and the oracle's
    reads name those pages r2's own content; a writer-based oracle would call them r1's."""
    m = _prefix_model(prefill_cache)
    kinds = (1, 1, 2, 2, 2, 2)
    target, found = _run(monkeypatch, m, [(kinds, 1), (kinds, 1)], Checks.for_properties())
    assert found == []
    rt = target.rt
    assert target._outcomes == {0: "Ok", 1: "Ok"}
    assert target._prompt_ids[0] == target._prompt_ids[1] == (
        PAGE_BLOCKS[1] + PAGE_BLOCKS[1] + PAGE_BLOCKS[2])
    assert rt.counts["prefix"]["hit_pages"] == PROMPT_PAGES
    assert rt.counts["prefill"]["hit_pages"] == (PROMPT_PAGES if prefill_cache else 0)
    row = target.protocol_state().requests[1]
    pool = rt.store.decode_pools[0]
    assert [pool[p][core.DATA] for p, _ in row[core.TABLE][:PROMPT_PAGES]] == [0] * 3
    assert target._reads[1] == tuple(core.true_ident(row, i) for i in range(1, PAGES + 1))


def test_another_salt_shares_nothing(monkeypatch):
    """The same prompt under the other salt hits nothing, and is clean."""
    target, found = _run(monkeypatch, _prefix_model(True), [((1, 1, 2, 2, 2, 2), 1),
                                                            ((1, 1, 2, 2, 2, 2), 2)],
                         Checks.for_properties())
    assert found == [] and target._outcomes == {0: "Ok", 1: "Ok"}
    assert target.rt.counts["prefix"]["hit_pages"] == 0
    assert target.rt.counts["prefill"]["hit_pages"] == 0


def test_a_stale_hit_reads_bytes_that_are_not_its_own_and_the_read_oracle_says_so(
        monkeypatch):
    """stale-hit-reads-unwritten (StaleHitLength, NoGenBump, NoIdentTag): decode counts one
    cached page more than it holds (here its first, with nothing cached), the prefill skips
    it, and decode reads a page nobody wrote for r1 (the warm pool's bytes), whose stale
    tag passes the check (it names neither a fresh generation nor any identity). The
    engine's read oracle, which judges the bytes against r1's own tokens computed alone,
    reports the first token computed from them, and the reads the shared leak oracle gets
    name that page's content as nothing ever written (the core's own Isolation sees it
    too, from its state)."""
    m = _prefix_model(False, bugs={"StaleHitLength", "NoGenBump", "NoIdentTag"})
    target, found = _run(monkeypatch, m, [((1,) * PAGES, 1)],
                         Checks.for_properties(("Isolation", "OkIsClean")))
    from_bytes = [v.detail for v in found if v.property == LEAK_ORACLE
                  and v.detail.startswith("engine read oracle")]
    assert from_bytes[0] == (
        "engine read oracle: r1 streamed token 2 (of 2, outcome none yet) computed from a "
        "wrong read: decode step 1: the K/V decode read at positions 0, 1 is not this "
        "request's (reference: its tokens computed alone)")
    row = target.protocol_state().requests[0]
    assert target._outcomes == {0: "Ok"}
    assert target._reads[0] == ((),) + tuple(core.true_ident(row, i) for i in range(2, 7))
    assert any(v.detail.startswith("r1 got Ok, but decode read 6 pages of which 1 hold "
                                   "other KV (page 1 holds nothing ever written")
               for v in found if v.property == LEAK_ORACLE)
    assert "Isolation" in {v.property for v in found}


@pytest.mark.parametrize("bugs", [{"StaleHitLength"}, {"StaleHitLength", "NoGenBump"}],
                         ids=["every tag guard", "identity alone"])
def test_the_page_tags_turn_a_stale_hit_into_err_tag_for_that_request_alone(monkeypatch,
                                                                             bugs):
    """The same stale hit with the tag guards on: the page nobody wrote carries an older
    generation, and an identity that is not r1's (none: the warm pool's), so r1's first
    read fails its tag check, ErrTag, and no decode step's token is computed from it.
    Without generation bumps (NoGenBump) the identity alone catches it. The switch
    misreports every request's hit, so each is refused alone: every property but
    FittingRequestsSucceed (what the switch breaks alone) holds, the leak oracles and
    conservation included."""
    m = _prefix_model(False, bugs=bugs)
    target, found = _run(monkeypatch, m, [((1,) * PAGES, 1), ((2,) * PAGES, 2)],
                         Checks.for_properties())
    assert {v.property for v in found} == {"FittingRequestsSucceed"}
    assert target._outcomes == {0: "ErrTag", 1: "ErrTag"}
    assert target.rt.counts["guard_trips"] == {"tag": 2}
    # Each got the prefill's first token only: no token was computed from the stale page.
    assert [len(target._tokens[r]) for r in (0, 1)] == [1, 1]


def _late_write_into_another_prompt(monkeypatch, bugs: set):
    """x is aborted with its writes held on the wire, decode frees its pages at once
    (EagerRelease), y (another prompt) reserves them and decodes, and x's writes land in
    y's pages (NoGenBump: with the generation y reserved them at). Returns the driven
    target and the pages x's writes landed in."""
    monkeypatch.setattr(engine_target, "request_shape", lambda rng, pages: (
        PAGE_TOKENS, pages * PAGE_TOKENS + 1 - PAGE_TOKENS))  # a page of prompt, then output
    m = Model(requests=2, max_prompt_pages=8, context_pages=8, prefill_pages=16,
              decode_pages=16, bugs=frozenset({"EagerRelease", "NoGenBump"} | bugs),
              **PREFIX_MODEL)
    driven = Driven(m, ("Isolation", "OkIsClean"))
    rt, move, wait_until = driven.rt, driven.move, driven.wait_until
    move(core.Arrive(0, 3, tokens=(2, 2, 2), salt=1))
    wait_until(lambda: any(w.request == 0 for w in rt.transport.writes_of_all()))
    move(Open("Delay", 0, 0, (30,)).close(30))
    move(core.Abort(0))
    wait_until(lambda: 0 not in rt.store.rows or rt.store.rows[0][core.DST] == core.RELEASED)
    move(core.Arrive(1, 8, tokens=(1,) * 8, salt=1))
    wait_until(lambda: 1 in rt.store.rows and rt.store.rows[1][core.DST] == core.DECODING)
    late = {w.decode_page for w in rt.transport.writes_of_all()}
    assert late and late <= {p for p, _ in rt.store.rows[1][core.TABLE]}
    assert rt.land_only(lambda w: w.request == 0) == len(late)  # into y's pages
    wait_until(lambda: 1 not in rt.live)
    return driven, late


def test_another_prompt_s_late_write_is_judged_by_its_bytes(monkeypatch):
    """late-write-looks-current (EagerRelease, NoGenBump) on a prefix-cache model, with tags
    that name no identity (NoIdentTag): x's late writes land in y's pages with a tag that
    passes. The bytes y then reads on such a page are x's, not y's own tokens' K/V: the
    engine's read oracle reports the token computed from them, and y's reads do not name
    that page as its own content."""
    driven, late = _late_write_into_another_prompt(monkeypatch, {"NoIdentTag"})
    target, found = driven.target, driven.found
    assert target._outcomes[1] == "Ok"
    from_bytes = [v.detail for v in found if v.property == LEAK_ORACLE
                  and v.detail.startswith("engine read oracle: r2")]
    assert from_bytes and "is not this request's" in from_bytes[0], found
    row = target.protocol_state().requests[1]
    table = [p for p, _ in row[core.TABLE]]
    own = [core.true_ident(row, i + 1) for i in range(len(table))]
    # The page decode had started to write when x's write landed keeps x's bytes; a page it
    # writes later (its own output) holds y's own bytes again by its last read.
    wrong = [i for i, (got, want) in enumerate(zip(target._reads[1], own)) if got != want]
    assert wrong == [1] and table[1] in late


def test_the_identity_in_the_tag_refuses_another_prompt_s_late_write(monkeypatch):
    """The same late writes with the identity in the tag: without generation bumps the
    generation passes, but the tag x's write left names x's prompt, so y's next read fails
    its tag check (ErrTag) and no token computed from x's bytes reaches y's client."""
    driven, late = _late_write_into_another_prompt(monkeypatch, set())
    target, found = driven.target, driven.found
    assert target._outcomes == {0: "Gone", 1: "ErrTag"}
    assert target.rt.counts["guard_trips"] == {"tag": 1}
    assert not [v for v in found if v.property in (LEAK_ORACLE, "Isolation", "OkIsClean")]


def test_an_old_seed_without_a_cache_draws_what_it_drew_before():
    """An engine campaign on models without a cache takes exactly the steps it took before
    the prefix moves existed (pinned from the commit before them: seed 3, 30 examples)."""
    outcome = run_campaign(Campaign(target="engine", seed=3, examples=30, shrink_seconds=0))
    assert not outcome.caught
    assert (outcome.steps, outcome.drain_steps) == (1302, 509)
