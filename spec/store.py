"""The shared store: the core's State spread over P prefill and D decode workers.

The core (spec/core.py) decides every transition on a view of one prefill and one decode
pool. A real deployment has many of each and far more requests than the model checker ever
sees, so copying whole-state tuples per event is out of the question. Instead each event is
decided on a *view* of the request's worker pair — the live request rows, the request's
prefill pool, its decode pool and the writes into that decode pool — and the Change the
core returns is committed in place (`Store.take`). Nothing here decides anything: an event
the core refuses changes nothing, and the caller gets the core's Refusal. Every shell (the
simulator, the fuzzer's simulator target, the engine, the server) keeps its protocol state
here, so all of them fold the same events the same way.

After every committed event the oracles check what the event touched (`_check_local`): page
conservation on both workers (the allocator's free set and the pages' owner fields agree,
free + owned == total, and decode pages claimed by request rows == decode pages owned), the
core's invariants on the request, the pages and the writes the change touched, and that an
observed verdict the shell reported agrees with the abstract page contents. Every
`sweep_every_events` events, and at the end, `sweep` flattens the whole store into one core
State and runs the core's own invariant functions on it, which is what shows that the local
checks miss nothing.

With a prefix cache (the spec's PrefixCache, and PrefillCache at the prefill) a pool's pages
are free, idle (cached, nobody owns or reads them) or held (owned or read), and
conservation is free + idle + referenced == total. A shell with a cache asks the core how
many fresh pages an allocation takes (core.allocation_need), takes them with `allocate`,
and under pool pressure evicts the store's pick first, each eviction decided by the core:
`lru_victims` then `evict` at decode, `prefill_lru_victims` then `prefill_evict` at the
prefill (`prefill_evictable` lists what the prefill's cache may forget now, as the core's
prefill_evictable says). A log's evictions fold through `take_worker_event` like crashes.

Like the core, this module is pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from spec import core
from spec.core import (CLIENT, CLIENT_NAMES, DATA, DECODE_NAMES, DECODING, DST, GEN, IDENT, KV,
                       LEAKED, NO_IDENT, NONE, OK, OWNER, P_DATA, P_IDENT, P_READERS, PROMPT, PST,
                       PTABLE, READERS, RUNNING, SRC, TABLE, TAG, Change, Refusal, State)
from spec.model import Model
from spec.properties import (REST_INVARIANTS, ROW_STEP_PROPERTIES, STATE_INVARIANTS,
                             Violation, holds_decode_pages)


VIOLATIONS_KEPT = 100  # details kept per run; every violation is counted
# The oracle that compares a shell's observed verdicts with the abstract page contents.
TRUTHFUL_OBSERVATION = "TruthfulObservation"


class View:
    """A core.View of one worker pair: the store's live rows (a dict), its pools, its writes."""

    __slots__ = ("requests", "decode_pool", "prefill_pool", "writes")

    def __init__(self, requests, decode_pool, prefill_pool, writes) -> None:
        self.requests = requests
        self.decode_pool = decode_pool
        self.prefill_pool = prefill_pool
        self.writes = writes

    def has_request(self, r: int) -> bool:
        return r in self.requests

    def request_items(self):
        return self.requests.items()

    def pages_of(self, worker: int, pages: int) -> range:
        """A pair's view holds one pool of each kind: the worker's pages are all of it."""
        return range(pages)


class Rows(dict):
    """The live rows, by request; and, readable by index only, the rows of requests
    forgotten while a prefill page still holds the KV they computed (`writers`: request ->
    (row, placement)). With a prefill-side cache a request sends from a page another
    request computed, and what the page holds is read off its writer's row (the spec's
    SourceIdent: the writer's salt and tokens up to the page); the spec never forgets a
    request, a long run must. A writer is no live row: not `in`, not iterated, not `get`."""

    __slots__ = ("writers",)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.writers: dict[int, tuple] = {}

    def __missing__(self, r: int) -> tuple:
        return self.writers[r][0]


@dataclass
class Store:
    """Rows, pools and writes of every worker; placement of every live request."""

    model: Model
    prefill_workers: int
    decode_workers: int
    rows: Rows = field(default_factory=Rows)
    placement: dict = field(default_factory=dict)   # request -> (prefill worker, decode worker)

    def __post_init__(self) -> None:
        if (self.model.prefill_workers, self.model.decode_workers) != (
                self.prefill_workers, self.decode_workers):
            # The core checks a placement against the model's workers (Arrive, the crashes).
            self.model = replace(self.model, prefill_workers=self.prefill_workers,
                                 decode_workers=self.decode_workers)
        m = self.model
        self.prefill_pools = [[core.FRESH_PREFILL_PAGE] * m.prefill_pages
                              for _ in range(self.prefill_workers)]
        self.decode_pools = [[core.FRESH_DECODE_PAGE] * m.decode_pages
                             for _ in range(self.decode_workers)]
        # Free pages as stacks: the page freed last is reused first, as real allocators do,
        # which is what puts another request's stale KV under a new owner.
        self.prefill_free = [list(range(m.prefill_pages - 1, -1, -1))
                             for _ in range(self.prefill_workers)]
        self.decode_free = [list(range(m.decode_pages - 1, -1, -1))
                            for _ in range(self.decode_workers)]
        # With a prefix cache (the spec's PrefixCache) a decode page may be cached: sealed,
        # owned by nobody, read by the requests that hit it. The free stack then holds only
        # pages that are neither owned, read nor cached; a cached page nobody reads waits
        # in `decode_idle`, oldest release first (the order an LRU policy evicts in, with
        # an Evict event the core decides, `evict`), and `decode_refs` counts, per page,
        # the live rows whose tables name it: conservation is free + idle + referenced.
        self.prefix_cache = m.prefix_cache
        self.decode_idle: list[dict] = [{} for _ in range(self.decode_workers)]
        self.decode_refs: list[dict] = [{} for _ in range(self.decode_workers)]
        # The prefill-side cache (the spec's PrefillCache) the same way: a prefill page is
        # cached once SendDone seals it, read by the running requests that hit it at Admit.
        # `prefill_idle` holds the cached pages nobody owns or reads, least recently
        # released first (what `prefill_lru_victims` picks from, and PrefillEvict frees,
        # `prefill_evict`); `prefill_refs` counts, per page, the running rows whose sources
        # name it (owned or read): conservation is free + idle + referenced.
        self.prefill_cache = m.prefill_cache
        self.prefill_idle: list[dict] = [{} for _ in range(self.prefill_workers)]
        self.prefill_refs: list[dict] = [{} for _ in range(self.prefill_workers)]
        # Per request, how many prefill pages hold the KV it computed (their `data`): a
        # request forgotten while any does is kept as a writer (Rows.writers).
        self.kv_pages: dict[int, int] = {}
        self.pool_pages_min = min(m.prefill_pages, m.decode_pages)
        self.decode_pages_total = m.decode_pages * self.decode_workers
        self.decode_pages_used = 0
        # Pages whose owner or generation the last commit changed: what the oracles check.
        self.moved_prefill: list[int] = []
        self.moved_decode: list[int] = []
        self.writes_into = [[] for _ in range(self.decode_workers)]   # the core's `writes`
        # Pages that request rows say they hold, counted from row fields alone: the second,
        # independent count that conservation compares with the pools' owner fields.
        self.decode_claimed = [0] * self.decode_workers
        self.prefill_claimed = [0] * self.prefill_workers
        self.claims_moved = False   # whether the last commit recounted a claim
        self.violations: list[Violation] = []   # the first VIOLATIONS_KEPT, in order
        self.violation_counts: dict[str, int] = {}
        self.violation_total = 0
        self._imbalance = {"prefill": [0] * self.prefill_workers,
                           "decode": [0] * self.decode_workers}
        # Settled rows, when a caller wants them kept (the fuzzer's sim target reads every
        # request's end); None: forgotten rows are gone, as a long run needs.
        self.settled_rows: dict | None = None
        self._views: dict[tuple[int, int], View] = {}
        self._view_of: dict[int, View] = {}   # live request -> its pair's view

    # -- the core's answers ------------------------------------------------------------

    def view(self, r: int) -> View:
        """The view of r's worker pair. Views are kept per pair: the lists they hold are
        changed in place, so a view stays current; and per live request, since every
        decision asks for one."""
        try:
            return self._view_of[r]
        except KeyError:
            view = self._view_of[r] = self._pair_view(r)
            return view

    def _pair_view(self, r: int) -> View:
        pair = self.placement[r]
        view = self._views.get(pair)
        if view is None:
            p, d = pair
            view = self._views[pair] = View(self.rows, self.decode_pools[d],
                                            self.prefill_pools[p], self.writes_into[d])
        return view

    def decide(self, r: int, event: core.Event) -> Change | Refusal:
        """The core's answer to `event` on request r; nothing changes yet. An Arrive is
        decided at the placement `arrive` recorded (the one fact of where r is placed)."""
        if type(event) is core.Arrive:
            p, d = self.placement[r]
            if (event.prefill_worker, event.decode_worker) != (p, d):
                event = replace(event, prefill_worker=p, decode_worker=d)
        return core.decide(self.model, self.view(r), event)

    def commit(self, r: int, change: Change) -> None:
        """Carry out a change the core decided for request r, then run the oracles."""
        p, d = self.placement[r]
        old = self.rows[r]
        self._commit(p, d, change)
        self._check_local(p, d, r, old, change)

    def take(self, r: int, event: core.Event) -> Change | Refusal:
        out = self.decide(r, event)
        if type(out) is not Refusal:
            self.check_observation(r, event)
            self.commit(r, out)
        return out

    def check_observation(self, r: int, event: core.Event) -> None:
        """An observed verdict the shell reported (a checksum, a tag check) against what the
        abstract page contents imply: before the commit, on the pages the data path read."""
        if core.INFO[type(event)].observed is None:
            return  # nothing observed (most events): no view to build
        conflict = core.observation_conflict(self.model, self.view(r), event)
        if conflict:
            self._violate(TRUTHFUL_OBSERVATION, conflict, r)

    def decide_crash(self, kind: str, worker: int) -> Change | Refusal:
        """The core's answer to a crash of prefill or decode `worker`; nothing changes yet.
        A prefill's view holds the rows of requests placed there and the writes it posted;
        a decode's, the rows of requests placed there and the writes into its pool."""
        if kind == "prefill":
            rows = {r: self.rows[r] for r, (q, _) in self.placement.items() if q == worker}
            posted = [w for ws in self.writes_into for w in ws
                      if self.placement[w[0]][0] == worker]
            view = View(rows, [], self.prefill_pools[worker], posted)
            return core.decide(self.model, view, core.PrefillCrash(worker))
        rows = {r: self.rows[r] for r, (_, e) in self.placement.items() if e == worker}
        view = View(rows, self.decode_pools[worker], [], self.writes_into[worker])
        return core.decide(self.model, view, core.DecodeCrash(worker))

    def crash_prefill(self, p: int) -> Change | Refusal:
        """PrefillCrash at worker p, if the core says the crash loses anything."""
        out = self.decide_crash("prefill", p)
        if type(out) is not Refusal:
            olds = {r: self.rows[r] for r, _ in out.rows}
            for d in range(self.decode_workers):
                self._commit(p, d, out._replace(rows=(), prefill=()))
            self._commit(p, 0, out._replace(flushed=()))
            for r, _ in out.rows:
                self._check_local(p, self.placement[r][1], r, olds[r], Change())
        return out

    def crash_decode(self, d: int) -> Change | Refusal:
        """DecodeCrash at worker d, if the core says the crash loses anything."""
        out = self.decide_crash("decode", d)
        if type(out) is not Refusal:
            olds = {r: self.rows[r] for r, _ in out.rows}
            self._commit(0, d, out._replace(flushed=()))
            self.writes_into[d].clear()
            for r, _ in out.rows:
                self._check_local(self.placement[r][0], d, r, olds[r], Change())
        return out

    def arrive(self, r: int, p: int, d: int) -> None:
        """A new request enters with an empty row, placed by the router."""
        assert r not in self.rows, f"request {r} arrives twice"
        self.rows[r] = core.EMPTY_ROW
        self.placement[r] = (p, d)

    def withdraw(self, r: int) -> None:
        """Undo `arrive` for a request whose Arrive the core refused."""
        assert self.rows[r] == core.EMPTY_ROW
        del self.rows[r]
        del self.placement[r]
        self._view_of.pop(r, None)

    def forget(self, r: int) -> None:
        """Drop a settled request's row: nothing can happen to it any more."""
        assert core.settled(self.rows[r]), f"request {r} is not settled"
        if self.settled_rows is not None:
            self.settled_rows[r] = self.rows[r]
        if r in self.kv_pages:
            self.rows.writers[r] = (self.rows[r], self.placement[r])
        del self.rows[r]
        del self.placement[r]
        self._view_of.pop(r, None)

    # -- committing a Change in place ---------------------------------------------------

    def _commit(self, p: int, d: int, c: Change) -> None:
        rows = self.rows
        self.claims_moved = False
        for r, row in c.rows:
            old = rows[r]
            # The claims count pages from the decode state and table, and from the
            # prefill state and sources: recounted only when those fields changed.
            if row[DST] != old[DST] or row[TABLE] is not old[TABLE]:
                self.decode_claimed[self.placement[r][1]] += _claim(row) - _claim(old)
                self.claims_moved = True
                if self.prefix_cache:
                    _count_refs(self.decode_refs[self.placement[r][1]], old, row)
            if row[PST] != old[PST] or row[SRC] is not old[SRC]:
                self.prefill_claimed[self.placement[r][0]] += (_source_claim(row)
                                                              - _source_claim(old))
                self.claims_moved = True
                if self.prefill_cache:
                    _count_sources(self.prefill_refs[self.placement[r][0]], old, row)
            rows[r] = row
        self.moved_prefill.clear()
        self.moved_decode.clear()
        if c.prefill and self.prefill_cache:
            self._count_kv_pages(self.prefill_pools[p], c.prefill)
            _put_cached_pages(self.prefill_pools[p], self.prefill_free[p], self.prefill_idle[p],
                              c.prefill, self.moved_prefill, P_READERS, P_IDENT)
        elif c.prefill:
            _put_pages(self.prefill_pools[p], self.prefill_free[p], c.prefill, self.moved_prefill)
        if c.decode:
            pool = self.decode_pools[d]
            for page, value in c.decode:
                if value[GEN] < pool[page][GEN]:
                    self._violate("GenerationsNeverGoBack", f"decode {d} page {page}: "
                                  f"generation {pool[page][GEN]} -> {value[GEN]}")
            if self.prefix_cache:
                self.decode_pages_used -= _put_cached_pages(
                    pool, self.decode_free[d], self.decode_idle[d], c.decode, self.moved_decode,
                    READERS, IDENT)
            else:
                self.decode_pages_used -= _put_pages(pool, self.decode_free[d], c.decode,
                                                     self.moved_decode)
        writes = self.writes_into[d]
        for w in c.landed:
            writes.remove(w)
        writes.extend(c.posted)
        if c.flushed:
            flushed = set(c.flushed)
            writes[:] = [w for w in writes if w[0] not in flushed]

    def _count_kv_pages(self, pool: list, changes: tuple) -> None:
        """Move the count of prefill pages holding each request's KV (`kv_pages`) to the
        pages' new `data`; a forgotten writer whose last page is overwritten goes."""
        counts = self.kv_pages
        for page, value in changes:
            old, new = pool[page][P_DATA], value[P_DATA]
            if old == new:
                continue
            if old != NONE:
                left = counts[old] - 1
                if left:
                    counts[old] = left
                else:
                    del counts[old]
                    self.rows.writers.pop(old, None)
            if new != NONE:
                counts[new] = counts.get(new, 0) + 1

    def allocate(self, pool: str, worker: int, need: int) -> tuple | None:
        """`need` free pages of a worker's pool, ascending, or None if it has too few. The
        pages stay free until the core commits an Admit or Reserve naming them."""
        stack = self.prefill_free[worker] if pool == "prefill" else self.decode_free[worker]
        if len(stack) < need:
            return None
        return tuple(sorted(stack[-need:])) if need else ()

    def decode_used(self, worker: int) -> int:
        """Pages of a decode worker's pool that requests own now."""
        return self.model.decode_pages - len(self.decode_free[worker])

    def free_pages(self, pool: str, worker: int) -> int:
        return len(self.prefill_free[worker] if pool == "prefill" else self.decode_free[worker])

    # -- oracles ------------------------------------------------------------------------

    def _violate(self, name: str, detail: str, r: int = NONE) -> None:
        self.violation_counts[name] = self.violation_counts.get(name, 0) + 1
        self.violation_total += 1
        if len(self.violations) < VIOLATIONS_KEPT:
            self.violations.append(Violation(name, detail, r, kind="oracle"))

    def _check_local(self, p: int, d: int, r: int, old: tuple, c: Change) -> None:
        if self.claims_moved or self.moved_decode or self.moved_prefill or not c.rows:
            # Conservation counts the free stacks and the claims, which only a page owner
            # or a claim that changed can change (a page posted or landed changes neither;
            # a crash, committed in parts, is checked whatever it changed).
            self._check_conservation(p, d)
        row = self.rows[r]
        if row is not old and (row[CLIENT] != old[CLIENT] or row[DST] != old[DST]
                               or row[LEAKED] != old[LEAKED]):
            self._check_row(r, old, row)  # (its own first test, inlined here: most steps)
        if self.moved_decode or self.moved_prefill:
            self._check_pages(p, d)
            self._check_writes(p, d)
        for w in c.posted:
            self._check_write(p, d, w)

    def _check_row(self, r: int, old: tuple, row: tuple) -> None:
        """The row properties a step of r can break. Each compares the old and new row and
        is broken only by a step that changes the client state, the decode state or the
        leaked flag (the step properties read only the client and decode states; Isolation
        needs the flag to turn on; OkIsClean and RejectedIsError a client or decode state
        to change). So a step that changes none of the three (most steps: a page posted, a
        final word sent) is checked with one comparison instead of every property."""
        if row[CLIENT] == old[CLIENT] and row[DST] == old[DST] and row[LEAKED] == old[LEAKED]:
            return
        for name, broken in ROW_STEP_PROPERTIES.items():
            if broken(old, row):
                self._violate(name, f"request {r}: client {CLIENT_NAMES[old[CLIENT]]} -> "
                              f"{CLIENT_NAMES[row[CLIENT]]}, decode {DECODE_NAMES[old[DST]]}"
                              f" -> {DECODE_NAMES[row[DST]]}", r)
        if row[LEAKED] and not old[LEAKED]:
            self._violate("Isolation", f"request {r} read a page that is not its own", r)
        if row[LEAKED] and row[CLIENT] == OK and old[CLIENT] != OK:
            self._violate("OkIsClean", f"request {r} got success on foreign KV", r)
        if row[PROMPT] > self.pool_pages_min and (row[CLIENT] == OK or row[DST] == DECODING) \
                and not (old[CLIENT] == OK or old[DST] == DECODING):
            self._violate("RejectedIsError", f"request {r}: a {row[PROMPT]}-page prompt is "
                          f"longer than a pool ({self.pool_pages_min} pages) but decodes or "
                          f"succeeds", r)

    def _check_conservation(self, p: int, d: int) -> None:
        """free + held == total on both workers, where "free" comes from the pages' owner
        fields (through the allocator's free stack) and "held" from the request rows.
        An imbalance is reported when it changes, so that one lost page is one violation."""
        held = (len(self.prefill_idle[p]) + len(self.prefill_refs[p]) if self.prefill_cache
                else self.prefill_claimed[p])
        imbalance = len(self.prefill_free[p]) + held - self.model.prefill_pages
        if imbalance != self._imbalance["prefill"][p]:
            self._imbalanced("prefill", p, imbalance)
        held = (len(self.decode_idle[d]) + len(self.decode_refs[d]) if self.prefix_cache
                else self.decode_claimed[d])
        imbalance = len(self.decode_free[d]) + held - self.model.decode_pages
        if imbalance != self._imbalance["decode"][d]:
            self._imbalanced("decode", d, imbalance)

    def _imbalanced(self, pool: str, worker: int, imbalance: int) -> None:
        self._imbalance[pool][worker] = imbalance
        if imbalance:
            self._violate("PageConservation", f"{pool} {worker}: free pages + pages held by "
                          f"requests is {imbalance:+d} off the pool's size")

    def _check_pages(self, p: int, d: int) -> None:
        """ExclusiveOwner for every page whose owner or generation the change moved."""
        pool = self.decode_pools[d]
        tables: dict[int, set] = {}
        for page in self.moved_decode:
            owner, gen = pool[page][OWNER], pool[page][GEN]
            if owner == NONE:
                continue
            table = tables.get(owner)
            if table is None:
                row = self.rows.get(owner)
                table = tables[owner] = set(row[TABLE]) if row and holds_decode_pages(row) else set()
            if (page, gen) not in table:
                self._violate("ExclusiveOwner", f"decode {d} page {page} is owned by "
                              f"request {owner} at gen {gen}, not in its table", owner)
        sources: dict[int, frozenset] = {}  # owner -> the source pages its row holds
        for page in self.moved_prefill:
            owner = self.prefill_pools[p][page][0]
            if owner == NONE:
                continue
            held = sources.get(owner)
            if held is None:
                row = self.rows.get(owner)
                held = sources[owner] = (frozenset(row[SRC]) if row is not None
                                         and row[PST] == RUNNING else frozenset())
            if page not in held:
                self._violate("ExclusiveOwner", f"prefill {p} page {page} is owned by "
                              f"request {owner}, which does not hold it", owner)

    def _check_writes(self, p: int, d: int) -> None:
        """NoWriteIntoForeign and SourceHeld for the writes in flight whose pages the change
        moved: only a change of a page's owner or generation can break either."""
        targets, sources = set(self.moved_decode), set(self.moved_prefill)
        for w in self.writes_into[d]:
            if w[2] in targets or w[1] in sources:
                self._check_write(p, d, w)

    def _check_write(self, p: int, d: int, w: tuple) -> None:
        r, source, page, tag = w
        target = self.decode_pools[d][page]
        if target[OWNER] != r or target[GEN] != tag:
            self._violate("NoWriteIntoForeign", f"a write of request {r} into decode {d} page "
                          f"{page} (tag {tag}) outlived its page", r)
        if self.placement[r][0] == p and not _source_held(self.prefill_pools[p][source], r):
            self._violate("SourceHeld", f"prefill {p} page {source} was freed, reused or "
                          f"evicted while request {r}'s write still reads it", r)

    def leak_check(self, r: int) -> bool:
        """The leak oracle, independent of the core's flag: did request r's decode read a
        page whose content is not its own at the page's current generation? With a prefix
        cache pages are shared, and "its own" is content: each page must hold the KV of
        r's own tokens and salt up to it (core.true_ident, the spec's TrueIdent)."""
        row = self.rows[r]
        pool = self.decode_pools[self.placement[r][1]]
        if self.prefix_cache:
            return any(pool[page][KV] != core.true_ident(row, i + 1) or pool[page][TAG] != gen
                       for i, (page, gen) in enumerate(row[TABLE]))
        return any(pool[page][DATA] != r or pool[page][TAG] != gen for page, gen in row[TABLE])

    def evict(self, d: int, page: int) -> Change | Refusal:
        """Evict at decode worker d (prefix caching: the cache forgets `page`), if the core
        allows it (a cached page nobody reads); the page goes back to the free stack."""
        rows = {r: self.rows[r] for r, (_, e) in self.placement.items() if e == d}
        view = View(rows, self.decode_pools[d], [], self.writes_into[d])
        out = core.decide(self.model, view, core.Evict(d, page))
        if type(out) is not Refusal:
            self._commit(0, d, out)
            self._check_conservation(0, d)
        return out

    def prefill_view(self, p: int) -> View:
        """Prefill worker p's view: the rows placed there, its pool, and the writes it
        posted (into any decode worker), which are what reads out of its pages."""
        rows = {r: self.rows[r] for r, (q, _) in self.placement.items() if q == p}
        posted = [w for ws in self.writes_into for w in ws if self.placement[w[0]][0] == p]
        return View(rows, [], self.prefill_pools[p], posted)

    def prefill_evict(self, p: int, page: int) -> Change | Refusal:
        """PrefillEvict at prefill worker p (its cache forgets `page`), if the core allows
        it (core.prefill_evictable: a cached page nobody reads and no write in flight reads
        out of); a page nobody reads goes back to the free stack."""
        view = self.prefill_view(p)
        out = core.decide(self.model, view, core.PrefillEvict(p, page))
        if type(out) is not Refusal:
            self._commit(p, 0, out)
            self._check_conservation(p, 0)
            # SourceHeld for the writes still reading the page: only a buggy cache
            # (EvictWhileSending) evicts a page a write reads, which moves no owner.
            for w in view.writes:
                if w[1] == page:
                    self._check_write(p, self.placement[w[0]][1], w)
        return out

    def take_worker_event(self, event: core.WorkerEvent) -> Change | Refusal:
        """A worker's event (one with no request) from a log: a crash, or either side's
        eviction (Evict, PrefillEvict), so every fold of a log answers every record."""
        if type(event) is core.PrefillCrash:
            return self.crash_prefill(event.worker)
        if type(event) is core.DecodeCrash:
            return self.crash_decode(event.worker)
        if type(event) is core.Evict:
            return self.evict(event.worker, event.page)
        if type(event) is core.PrefillEvict:
            return self.prefill_evict(event.worker, event.page)
        raise core.ProtocolMisuse(f"{event.action} is no worker event the store knows")

    def idle_cached(self, d: int) -> list[int]:
        """Decode worker d's cached pages nobody reads, least recently released first."""
        return list(self.decode_idle[d])

    def lru_victims(self, d: int, hits, need: int) -> list[int] | None:
        """The shells' eviction pick under pool pressure at decode worker d (a policy, not
        the protocol's: the core still decides each Evict): the least recently released
        idle cached pages, not `hits` (those the reserving request is about to read), until
        `need` pages are free; [] when they are, None when the idle cache cannot make up
        the difference."""
        short = need - len(self.decode_free[d])
        if short <= 0:
            return []
        hit = set(hits)
        victims = [p for p in self.decode_idle[d] if p not in hit][:short]
        return victims if len(victims) == short else None

    def prefill_evictable(self, p: int, hits=()) -> list[int]:
        """The cached pages of prefill worker p its cache may evict now, not `hits` (those
        a request about to be admitted will read), least recently used first: the idle
        ones, oldest release first, then the ones requests read (used now: most recent).
        The core says which may go (core.prefill_evictable: the idle ones, or with
        EvictWhileSending, the buggy cache, every one), so a bug lives in one place."""
        pool, hit = self.prefill_pools[p], set(hits)
        read = [page for page in self.prefill_refs[p]
                if pool[page][P_IDENT] != NO_IDENT and pool[page][0] == NONE]
        view = self.prefill_view(p)
        return [page for page in (*self.prefill_idle[p], *read)
                if page not in hit and core.prefill_evictable(self.model, view, page)]

    def prefill_lru_victims(self, p: int, hits, need: int) -> list[int] | None:
        """The shells' eviction pick under pool pressure at prefill worker p (a policy:
        the core decides each PrefillEvict), as `lru_victims` is decode's: the least
        recently used evictable cached pages, not `hits`, until `need` pages are free; []
        when they are, None when the cache cannot make up the difference."""
        short = need - len(self.prefill_free[p])
        if short <= 0:
            return []
        victims = self.prefill_evictable(p, hits)[:short]
        return victims if len(victims) == short else None

    # -- the whole cluster as one core State -----------------------------------------------

    def flatten(self) -> tuple[Model, State]:
        """The cluster as one core State of a model with the store's workers: pools side by
        side (the core's flat pools), requests renumbered 0..n-1 (the live rows, then the
        forgotten writers a prefill page's KV is read off, Rows), and index n standing for
        every other writer that has already been forgotten."""
        m = self.model
        writers = self.rows.writers  # forgotten, read by SourceIdent: kept, after the live
        ids = sorted(self.rows) + sorted(writers)
        index = {r: k for k, r in enumerate(ids)}
        gone = len(ids)
        pp, dp = m.prefill_pages, m.decode_pages

        def who(r: int) -> int:
            return NONE if r == NONE else index.get(r, gone)

        rows = []
        for r in ids:
            p, d = self.placement[r] if r in self.placement else writers[r][1]
            row = list(self.rows[r] if r in self.placement else _writer_stand_in(self.rows[r]))
            row[SRC] = tuple(x + p * pp for x in row[SRC])
            row[TABLE] = tuple((x + d * dp, g) for x, g in row[TABLE])
            row[PTABLE] = tuple((x + d * dp, g) for x, g in row[PTABLE])
            rows.append(tuple(row))
        rows.append(core.EMPTY_ROW)
        decode = tuple((who(o), g, who(data), t, tuple(who(x) for x in readers), ident, kv, tid)
                       for pool in self.decode_pools
                       for o, g, data, t, readers, ident, kv, tid in pool)
        prefill = tuple((who(o), who(data), tuple(who(x) for x in readers), ident)
                        for pool in self.prefill_pools for o, data, readers, ident in pool)
        writes = tuple(sorted((index[r], s + self.placement[r][0] * pp, t + d * dp, tag)
                              for d, ws in enumerate(self.writes_into) for r, s, t, tag in ws))
        flat = replace(m, requests=len(rows), request_names=())
        return flat, State(tuple(rows), decode, prefill, writes)

    def sweep(self, at_rest: bool = False) -> list[Violation]:
        """Every invariant of spec/properties.py on the flattened cluster (and the rest
        invariants when the run has drained)."""
        flat, state = self.flatten()
        found = []
        for name, check in STATE_INVARIANTS.items():
            if not check(flat, state):
                found.append(Violation(name, "the full-cluster sweep finds it violated", kind="oracle"))
        if at_rest:
            for name, check in REST_INVARIANTS.items():
                if not check(flat, state):
                    found.append(Violation(name, "the drained cluster violates it", kind="rest"))
        return found


def _writer_stand_in(row: tuple) -> tuple:
    """A forgotten writer in the flattened state: what SourceIdent reads of it (its prompt,
    sources, placement, tokens and salt), none of its answer, which the oracles judged
    while it lived (a leak it read is not reported again by every sweep while a page holds
    its KV)."""
    stand_in = list(core.EMPTY_ROW)
    for k in (PROMPT, SRC, core.PW, core.DW, core.TOKENS, core.SALT):
        stand_in[k] = row[k]
    return tuple(stand_in)


def _source_held(page: tuple, r: int) -> bool:
    """The spec's SourceHeld for one write of r out of `page`: r owns the page or (a
    prefill-side cache) reads it, still sealed."""
    owner, _, readers, ident = page
    return owner == r or (r in readers and ident != NO_IDENT)


def _claim(row: tuple) -> int:
    return len(row[TABLE]) if holds_decode_pages(row) else 0


def _source_claim(row: tuple) -> int:
    return len(row[SRC]) if row[PST] == RUNNING else 0


def _unstack(stack: list, page: int) -> None:
    """Remove a page from the free stack; allocations take the top, so search from there."""
    for k in range(len(stack) - 1, -1, -1):
        if stack[k] == page:
            del stack[k]
            return
    raise AssertionError(f"page {page} is not on the free stack")


def _count_refs(refs: dict, old: tuple, row: tuple) -> None:
    """Move a row's references (the pages its table names while it holds decode pages)
    from its old table to its new one."""
    if holds_decode_pages(old):
        for page, _ in old[TABLE]:
            left = refs[page] - 1
            if left:
                refs[page] = left
            else:
                del refs[page]
    if holds_decode_pages(row):
        for page, _ in row[TABLE]:
            refs[page] = refs.get(page, 0) + 1


def _count_sources(refs: dict, old: tuple, row: tuple) -> None:
    """Move a row's references to prefill pages (its sources, owned or read, while its
    prefill runs) from its old sources to its new ones."""
    if old[PST] == RUNNING:
        for page in old[SRC]:
            left = refs[page] - 1
            if left:
                refs[page] = left
            else:
                del refs[page]
    if row[PST] == RUNNING:
        for page in row[SRC]:
            refs[page] = refs.get(page, 0) + 1


def _put_cached_pages(pool: list, stack: list, idle: dict, changes: tuple, moved: list,
                      readers: int, ident: int) -> int:
    """_put_pages for a pool with a cache (decode's or the prefill's: `readers` and `ident`
    are the pool's fields): a page is on the free stack when nobody owns it, reads it or
    has it cached, and in `idle` (re-inserted last: most recent) when it is cached and
    nobody owns or reads it; return pages freed minus taken."""
    freed = 0
    for page, value in changes:
        before = pool[page]
        pool[page] = value
        if before[OWNER] != value[OWNER] or before[GEN] != value[GEN]:
            moved.append(page)
        was, now = _cache_state(before, readers, ident), _cache_state(value, readers, ident)
        if was == now:
            continue
        if was == "free":
            _unstack(stack, page)
            freed -= 1
        elif now == "free":
            stack.append(page)
            freed += 1
        if was == "idle":
            del idle[page]
        elif now == "idle":
            idle[page] = None
    return freed


def _cache_state(page: tuple, readers: int, ident: int) -> str:
    """A page's place in the books. A page nobody owns and no cache keeps is free even if
    a request still reads it: that is the core's FreePrefill (on decode a page with
    readers is always cached, SealedIsQuiet); only a buggy cache (EvictWhileSending) forgets
    a page still read, and then its allocator hands it out, as the bug's real cache does."""
    if page[0] != NONE:  # the owner: field 0 of both kinds of page
        return "held"
    if page[ident]:
        return "held" if page[readers] else "idle"
    return "free"


def _put_pages(pool: list, stack: list, changes: tuple, moved: list) -> int:
    """Replace pages in place, keeping the free stack in step with the owner fields; append
    to `moved` the pages whose owner or generation changed; return pages freed minus taken."""
    freed = 0
    taken = len(changes)
    if taken > 1 and sorted(stack[-taken:]) == [page for page, _ in changes]:
        for page, value in changes:
            if pool[page][0] != NONE or value[0] == NONE:
                break
        else:
            # An allocation of the pages on top of the free stack (what `allocate` hands
            # out): taken off in one slice, not searched for one at a time.
            del stack[-taken:]
            for page, value in changes:
                pool[page] = value
                moved.append(page)
            return -taken
    for page, value in changes:
        before = pool[page]
        pool[page] = value
        if before[0] == value[0] and before[1] == value[1]:
            continue  # data landed: no owner or generation changed
        moved.append(page)
        if before[0] == NONE:
            _unstack(stack, page)
            freed -= 1
        elif value[0] == NONE:
            stack.append(page)
            freed += 1
    return freed
