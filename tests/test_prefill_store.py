"""The shell store's prefill-side cache (the spec's PrefillCache): its books (free stack,
idle cached pages, references), conservation and SourceHeld on shared sources, eviction
decided by the core, a crash wiping it; and the simulator computing only what its prefill
does not hold. Events are taken through Store.take as a shell takes them, step by step."""

from __future__ import annotations

from dataclasses import replace

from spec import core
from spec.core import (Accept, Admit, Arrive, Finish, LandWrite, Refusal, Release, Reserve,
                       SendDone, SendPage)
from spec.model import Model
from spec.store import Store

# Three requests, three prefill pages, one salt: enough for a hit on a page another
# request computed, a third request that needs the pool, and an idle cached page.
PC = Model(requests=3, max_prompt_pages=2, context_pages=2, prefill_pages=3, decode_pages=4,
           prefix_cache=True, tokens=2, tenants=1, prefill_cache=True, crashes=True,
           name="prefill-store")


def take(store: Store, r: int, *events) -> None:
    for event in events:
        if type(event) is Arrive:
            store.arrive(r, 0, 0)
        out = store.take(r, event)
        assert type(out) is not Refusal, out


def allocated(store: Store, r: int, cls: type) -> core.Event:
    """The Reserve or Admit of r with the pages the store's allocator hands out."""
    need = core.allocation_need(store.model, store.view(r), cls, r)
    return cls(r, store.allocate("decode" if cls is Reserve else "prefill", 0, need))


def sealed_first(m: Model = PC) -> Store:
    """r1 (tokens 1 1) through Release: both its source pages sealed at the prefill and
    idle (nobody reads them), decode's cached too."""
    store = Store(m, 1, 1)
    take(store, 0, Arrive(0, 2, 0, 0, (1, 1), 1), Reserve(0, (0, 1)), Admit(0, (0, 1)),
         SendPage(0), SendPage(0), LandWrite(0, 0), LandWrite(0, 1), SendDone(0),
         Accept(0, True), Finish(0, True), Release(0))
    store.forget(0)
    return store


def books(store: Store) -> tuple:
    return (sorted(store.prefill_free[0]), list(store.prefill_idle[0]),
            dict(store.prefill_refs[0]))


def test_sealed_pages_wait_idle_and_conservation_counts_them():
    store = sealed_first()
    assert books(store) == ([2], [0, 1], {})  # free + idle + referenced == 3 pages
    assert store.violations == [] and store.sweep(at_rest=True) == []


def test_a_hit_reads_the_cached_page_and_allocates_only_the_suffix():
    store = sealed_first()
    # r2 (tokens 1 2) hits page 1's key at the prefill (decode too): one fresh page.
    take(store, 1, Arrive(1, 2, 0, 0, (1, 2), 1))
    take(store, 1, allocated(store, 1, Reserve))
    assert core.allocation_need(PC, store.view(1), Admit, 1) == 1
    take(store, 1, allocated(store, 1, Admit))
    row = store.rows[1]
    assert (row[core.SRC], row[core.PCACHED], core.pages_to_compute(PC, row)) == ((0, 2), 1, 1)
    assert books(store) == ([], [1], {0: 1, 2: 1})
    assert store.violations == [] and store.sweep() == []


def test_conservation_fails_when_the_books_lose_an_idle_page():
    store = sealed_first()
    store.prefill_idle[0].pop(1)  # a books bug: a cached page nobody accounts for
    assert type(store.prefill_evict(0, 0)) is not Refusal  # any later check sees it
    assert [v.property for v in store.violations] == ["PageConservation"]
    assert "prefill 0: free pages + pages held by requests is -1 off" in store.violations[0].detail


def test_the_lru_pick_and_eviction_go_through_the_core():
    store = sealed_first()
    take(store, 1, Arrive(1, 2, 0, 0, (1, 2), 1))
    take(store, 1, allocated(store, 1, Reserve))
    hits = core.prefill_hit_pages(PC, store.view(1), store.rows[1])
    assert hits == (0,)
    # Two fresh pages wanted, one free: the idle page r2 does not hit goes (least recent).
    assert store.prefill_lru_victims(0, hits, 2) == [1]
    assert store.prefill_lru_victims(0, hits, 3) is None  # the hit is not a victim
    assert store.prefill_lru_victims(0, hits, 1) == []
    out = store.prefill_evict(0, 1)
    assert out.prefill == ((1, (core.NONE, 0, (), core.NO_IDENT)),)
    assert books(store) == ([1, 2], [0], {})
    assert "not cached" in store.prefill_evict(0, 1).reason  # the core refuses
    take(store, 1, Admit(1, (1,)))
    assert "read by a request" in store.prefill_evict(0, 0).reason
    assert store.prefill_evictable(0) == []  # page 0 is read, page 1 owned
    assert store.violations == []


def test_a_write_out_of_a_cached_page_it_reads_holds_its_source():
    """SourceHeld as the spec says it: a write may read a cached page its request reads
    (owned by nobody); a page evicted under it (EvictWhileSending) is not held, and the
    buggy cache's allocator has it on its free stack while r2 still reads it (the core's
    FreePrefill), which the books see as a page both free and held."""
    for bugs in (frozenset(), frozenset({"EvictWhileSending"})):
        store = sealed_first(replace(PC, bugs=bugs))
        # Decode's cache forgets r1's pages, so decode misses and r2 sends both pages.
        assert all(type(store.evict(0, page)) is not Refusal for page in (0, 1))
        take(store, 1, Arrive(1, 1, 0, 0, (1,), 1), Reserve(1, (0,)), Admit(1, ()), SendPage(1))
        assert [w[1] for w in store.writes_into[0]] == [0]  # out of cached page 0
        assert store.violations == [] and store.sweep() == []
        if not bugs:
            assert "read by a request or by a write in flight" in store.prefill_evict(0, 0).reason
            # It lands the KV r1 computed, read off r1's row though r1 was forgotten.
            take(store, 1, LandWrite(1, 0))
            assert store.decode_pools[0][0][core.KV] == (1, (1,))
            assert 0 in store.rows.writers and 0 not in store.rows
            continue
        assert store.prefill_evictable(0) == [1, 0]  # the buggy cache's pick: every page
        assert type(store.prefill_evict(0, 0)) is not Refusal
        assert [v.property for v in store.violations] == ["PageConservation", "SourceHeld"]
        assert store.allocate("prefill", 0, 1) == (0,)  # the evicted page, though read
        assert {v.property for v in store.sweep()} == {"SourceHeld", "SealedIsQuiet"}


def test_a_prefill_crash_wipes_the_cache_and_its_books():
    store = sealed_first()
    take(store, 1, Arrive(1, 2, 0, 0, (1, 2), 1))
    take(store, 1, allocated(store, 1, Reserve), Admit(1, (2,)))
    assert books(store) == ([], [1], {0: 1, 2: 1})
    assert type(store.take_worker_event(core.PrefillCrash(0))) is not Refusal
    assert books(store) == ([0, 1, 2], [], {})
    assert all(page[core.P_IDENT] == core.NO_IDENT for page in store.prefill_pools[0])
    assert store.violations == [] and store.sweep() == []
