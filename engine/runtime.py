"""The protocol-driven engine loop: N prefill workers, M decode workers (one of each by
default), one transport between their pools, and every protocol step decided by the core
through one spec.store.Store.

Theory of operation. The runtime is a shell in DESIGN.md's sense: it turns what happens
(a request arrives, a bootstrap reaches decode, a prompt is computed, a write lands, a
decode step reads its pages, a timer fires, a client goes away) into core events, hands
each to `Store.take`, and carries out the commands of the core's answer by their type
(spec/commands.py). It never compares rows to find out what happened and never decides an
outcome: a refusal leaves everything as it was, and the client's answer is the `Answer`
command's outcome.

Messages between the workers (bootstrap, page table, final word, cancel, client gone) are
"wants": a message in flight waits, per request, until the action the core names for it
(`core.consumer`) is enabled and has what it needs (free pages for a Reserve), and is then
taken. `step()` runs one iteration: deliver messages, admit at the prefill (the bootstrap
queue: a request is admitted once its page table has come back), one chunked prefill step
(completed prompts post their page writes: one SendPage per page), the writes the
transport delivers (LandWrite, then the copy and the tag), one decode step over the
continuous batch (Finish with the observed tag verdict), releases, timers.

Workers. The store keeps each worker's pool and decides every event on the view of the
request's own pair (spec/store.py), as it does for the simulator's clusters; the runtime
places each arriving request on a pair (`place`: the prefill with the fewest requests
queued or computing, the decode whose live requests need the fewest pages, ties in turn;
the placement is the store's own, `Store.placement`) and from then on every command of
that request goes to the workers of its pair. All workers run in this one loop, in turn;
the pools, batches and transport are theirs.

Where the parts live: this module holds the configuration, the runtime's hooks into the
one runtime (spec/runtime.py holds the path into the core, `take_event`, and the one
handler table of the core's commands, shared with the simulator; engine/adapters.py is the
engine's side of its interfaces: workers, messages, clock, clients, log), the client's side
(`arrive`, `abort`) and what a server or a test looks at; `Runtime` also has the loop and its data-path steps (engine/loop.py),
the delivery of messages and the admission queue (engine/delivery.py), and streams tokens
through engine/streaming.py (`Live`, the held-back text at a possible stop string).

Timers. Decode's transfer deadline is a lease, not a stopwatch (spec: LeaseLapsed). ArmTimer
(at Reserve) starts it; every sign of progress from the request's prefill renews it: the
prefill admitted it, computed one of its chunks, posted or landed one of its pages; while it
is queued at its prefill, any progress of that worker renews it (the worker is alive and its
queue moves; how long it may wait there is admission's bound, not a timer's). It lapses
after `lease_s` of silence, or `transfer_timeout_s` after Admit at the latest; then decode
times out, cancels, and waits for the prefill's final word before it releases. A fitting,
fault-free request is never failed by it, provided a prefill step takes well under
`lease_s` (the startup check in engine/serving.py verifies that). StopwatchTimeout is the old
deadline (transfer_timeout_s from reservation, never renewed): the zoo's switch.

Reservation sizing. The core's request has one page count, `prompt_pages`: decode
reserves that many pages, the prefill admits that many source pages and must write every
one of them, and decode's count check compares the pages written with the pages reserved.
The engine passes the count of pages the request can ever occupy at decode:
pages_needed(prompt + max_tokens). The prefill computes the prompt into the first pages
and sends all of them (the tail pages' bytes are whatever the source pages held, with
their checksums, and decode overwrites them as it generates). So every decode page a
request ever reads or writes was reserved, tagged and counted by the core, at the cost of
a prefill pool sized for prompt + max_tokens and tail pages sent needlessly (README).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from engine.adapters import (EngineDecode, EnginePrefill, InProcessMessages, MemoryLog,
                             ServingClients, WallClock)
from engine.delivery import RELEASE, Delivery
from engine.eventlog import LOG_FORMAT
from engine.generate import pages_needed
from engine.loop import Loop
from engine.model import LlamaModel
from engine.pool import PoolConfig
from engine.prefix import SALT_MAX, Nonces, page_tokens_of, with_caches
from engine.service import Finished, GenerationRequest, PoolSnapshot, RequestSnapshot
from engine.streaming import Live
from engine.transport import InProcessTransport
from engine.workers import DecodeWorker, PrefillWorker
from spec.runtime import ShellRuntime
from spec import codec, core
from spec.core import Refusal
from spec.model import Model, ProtocolConfig
from spec.store import Store

__all__ = ["Live", "Runtime", "RuntimeConfig"]

RECENT_KEPT = 64  # finished requests kept for snapshots


@dataclass(frozen=True)
class RuntimeConfig:
    prefill_pages: int = 256
    decode_pages: int = 256
    page_tokens: int = 16
    context_tokens: int = 2048  # what the engine advertises (ContextTooLong above it)
    max_batch: int = 64
    prefill_chunk_tokens: int = 512
    # Decode's transfer deadline is a lease (see "Timers" above): it lapses after lease_s
    # without progress from the request's prefill, and at the latest transfer_timeout_s
    # after the prefill admitted it (a backstop for a prefill that renews but never ends).
    # Queueing counts against neither: admission bounds it (engine/serving.py).
    lease_s: float = 60.0
    transfer_timeout_s: float = 600.0
    bugs: frozenset = frozenset()
    transport_seed: int | None = None
    lands_per_step: int = 1 << 30
    log_records_max: int = 100_000  # in-memory event log bound, in records (0: no log)
    keep_kv: bool = False  # tests and fuzzers: keep each request's prompt KV (the leak oracle)
    prefill_workers: int = 1  # each with a pool of prefill_pages
    decode_workers: int = 1  # each with a pool of decode_pages
    # Decode's prefix cache (engine/prefix.py; the core's PrefixCache): a request whose
    # prompt starts with pages decode holds cached under its salt reads them instead of
    # having them sent.
    prefix_cache: bool = False
    # The prefill's prefix cache too (the core's PrefillCache; needs prefix_cache): a
    # request whose prompt starts with full pages the prefill holds cached under its salt
    # computes only the rest, its attention reading the cached pages' KV.
    prefill_cache: bool = False

    def __post_init__(self) -> None:
        if self.prefill_cache and not self.prefix_cache:
            raise ValueError("prefill_cache needs prefix_cache: the prefill's cache files "
                             "pages under the keys decode's cache gives them")
        for name in ("prefill_pages", "decode_pages", "page_tokens", "context_tokens",
                     "max_batch", "prefill_chunk_tokens", "prefill_workers", "decode_workers"):
            assert getattr(self, name) > 0, f"{name} must be positive"
        assert self.transfer_timeout_s > 0 and self.lease_s > 0
        object.__setattr__(self, "bugs", frozenset(self.bugs))

    @property
    def context_pages(self) -> int:
        return -(-self.context_tokens // self.page_tokens)

    def protocol(self) -> ProtocolConfig:
        return ProtocolConfig(self.context_pages, self.prefill_pages, self.decode_pages,
                              self.bugs)


class Runtime(ShellRuntime, Loop, Delivery):
    """Single-threaded: call `arrive`, `abort` and `step` from one thread (the threaded
    engine in engine/serving.py does). The path into the core and the command handlers
    are the one runtime's (spec/runtime.py); the engine's worlds behind its interfaces
    are engine/adapters.py."""

    def __init__(self, model: LlamaModel, config: RuntimeConfig = RuntimeConfig(),
                 tokenizer=None, clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.core_model = core_model_for(config)
        self.store = Store(self.core_model, config.prefill_workers, config.decode_workers)
        pool = PoolConfig.for_model(model.config, 1, config.page_tokens, model.dtype,
                                    model.device)
        # With a prefill-side cache each prefill pool has one page past the core's pages:
        # the scratch page of PrefillWorker.spare_cached, never allocated, never sent.
        scratch = config.prefill_pages if config.prefill_cache else None
        self.prefills = [PrefillWorker(model, _sized(pool, config.prefill_pages
                                                     + (scratch is not None)),
                                       config.prefill_chunk_tokens, name=f"prefill-{k}",
                                       scratch_page=scratch)
                         for k in range(config.prefill_workers)]
        self.decodes = [DecodeWorker(model, _sized(pool, config.decode_pages), config.max_batch,
                                     name=f"decode-{k}") for k in range(config.decode_workers)]
        self.transport = InProcessTransport([w.pool for w in self.prefills],
                                            [w.pool for w in self.decodes],
                                            config.lands_per_step, config.transport_seed)
        # The one runtime's interfaces (spec/interfaces.py), real side.
        self.clock = WallClock(clock, config)
        self.prefill_at = [EnginePrefill(self, k) for k in range(config.prefill_workers)]
        self.decode_at = [EngineDecode(self, k) for k in range(config.decode_workers)]
        self.link = InProcessMessages(self)
        self.client = ServingClients(self)
        self.event_log = MemoryLog(self)
        self._turn = 0  # the router's tie-break
        self.live: dict[int, Live] = {}
        self.recent: list[Live] = []
        self.log: list[dict] = []
        # The leak oracle's evidence (config.keep_kv): per request, the prompt KV its prefill
        # computed, and the prompt KV its decode read at its last step, both as tensors
        # [tokens, layers, 2, kv_heads, dim] copied out of the pools.
        self.prompt_kv: dict[int, torch.Tensor] = {}
        self.read_kv: dict[int, torch.Tensor] = {}
        self.next_id = 0
        # n > 1 siblings (`_sibling_place`): each group's first live request, and each
        # sibling's first.
        self.first_of_group: dict[int, int] = {}
        self.first_of: dict[int, int] = {}
        self.nonces = Nonces()  # the tokens of pages no other request may share (prefix.py)
        self.on_commit: Callable | None = None  # fuzzers: (event, change) after each commit
        self.counts = {"guard_trips": {}, "refusals": {}, "rejects": {}, "outcomes": {},
                       "prefix": {"reserved_prompt_pages": 0, "hit_pages": 0,
                                  "evicted_lru_pages": 0, "evicted_unshareable_pages": 0},
                       # The prompt tokens the prefill workers ran through the model.
                       "prefill": {"computed_tokens": 0, "admitted_prompt_pages": 0,
                                   "hit_pages": 0, "evicted_lru_pages": 0,
                                   "evicted_unshareable_pages": 0},
                       # Guard trips of requests that read shared pages, by guard; and
                       # each tenant's TenantCache (engine/delivery.py `_count_tenant`).
                       "prefix_shared_guard_trips": {}, "prefix_tenants": {}}
        self._start_runtime()

    # -- the one path into the core (spec/runtime.py) and its hooks ----------------------

    def take(self, r: int, event: core.Event) -> core.Change | None:
        """The core decides; an accepted event is logged and its commands carried out."""
        assert event.request == r, (r, event)
        return self.take_event(event)

    def refused(self, refusal: Refusal) -> None:
        reasons = self.counts["refusals"]
        reasons[refusal.reason] = reasons.get(refusal.reason, 0) + 1

    def commit(self, now: float, r: int, change: core.Change,
               event: core.Event) -> tuple[int, int]:
        store = self.store
        store.check_observation(r, event)
        store.commit(r, change)
        return store.placement[r]

    def moved(self, r: int, p: int) -> None:
        row = self.store.rows.get(r)
        if row is not None and core.settled(row):
            self._forget(r)

    def want(self, r: int, worker: str, what: str) -> None:
        assert what == "Release", what  # the one want the runtime's commands name
        self._want(r, RELEASE)

    @property
    def timers(self) -> dict[int, float]:
        """request -> when its lease lapses (the clock's; the loop polls them)."""
        return self.clock.timers

    @property
    def admitted_at(self) -> dict[int, float]:
        """request -> when its prefill admitted it (the clock's: the lease's backstop)."""
        return self.clock.admitted_at

    def renew(self, r: int) -> None:
        """Progress from r's prefill that is no event (a chunk computed, engine/loop.py)."""
        self.clock.renew(r)

    def _view(self, r: int):
        return self.store.view(r)

    def _row(self, r: int) -> tuple:
        return self.store.rows[r]

    # -- workers -----------------------------------------------------------------------

    @property
    def prefill(self) -> PrefillWorker:
        """The prefill worker of a one-prefill deployment (tests, benches)."""
        assert len(self.prefills) == 1, "several prefill workers: use prefill_of(r)"
        return self.prefills[0]

    @property
    def decode(self) -> DecodeWorker:
        """The decode worker of a one-decode deployment (tests, benches)."""
        assert len(self.decodes) == 1, "several decode workers: use decode_of(r)"
        return self.decodes[0]

    def prefill_of(self, r: int) -> PrefillWorker:
        return self.prefills[self.store.placement[r][0]]

    def decode_of(self, r: int) -> DecodeWorker:
        return self.decodes[self.store.placement[r][1]]

    def place(self) -> tuple[int, int]:
        """The router: the prefill with the fewest requests queued or computing, and the
        decode whose live requests need the fewest pages (reserved already or still to
        come); ties go round in turn, so that requests one after another spread too. A
        policy, not a protocol step: whatever it picks, the core decides every event on
        that pair's view."""
        turn, self._turn = self._turn, self._turn + 1
        prefills, decodes = len(self.prefills), len(self.decodes)
        p = min(range(prefills), key=lambda k: (
            len(self.prefills[k].queue) + len(self.prefills[k].computing),
            (k - turn) % prefills))
        demand = [0] * decodes
        for r, (_, d) in self.store.placement.items():
            demand[d] += self.live[r].pages
        return p, min(range(decodes), key=lambda k: (demand[k], (k - turn) % decodes))

    # -- the client's side -----------------------------------------------------------------

    def arrive(self, request: GenerationRequest, on_event: Callable,
               request_id: int | None = None) -> int:
        r = self.next_id if request_id is None else request_id
        assert r not in self.live, f"request id {r} is live"
        self.next_id = r + 1
        n = pages_needed(len(request.prompt_ids), request.sampling.max_tokens,
                         self.config.page_tokens)
        p, d = self._sibling_place(r, request) or self.place()
        self.live[r] = Live(r, request, on_event, n, self.clock.read())
        if self.take_arrival(self._arrival(r, request, n), p, d) is None:
            self._finished(self.live.pop(r), "ErrTooLong", detail="the core refused Arrive")
        return r

    def _sibling_place(self, r: int, request: GenerationRequest) -> tuple[int, int] | None:
        """n > 1 siblings share their prompt's pages through the prefix cache (a policy:
        spec/README.md, "n > 1 siblings"): a request of a group whose first is still live
        goes on the first's workers and waits for it (`sibling_waits`); the first of a
        group is placed by the router. None: the router places it."""
        group = request.sibling_group
        if group is None or not self.core_model.prefix_cache:
            return None
        first = self.first_of_group.get(group)
        if first is None or first not in self.store.rows:
            self.first_of_group[group] = r
            return None
        self.first_of[r] = first
        return self.store.placement[first]

    def sibling_waits(self, r: int) -> bool:
        """Whether r, a sibling, holds its Reserve for its first's transfer (the core's
        rule, core.sibling_waits, on the first's row); a first already gone does not hold
        it."""
        first = self.first_of.get(r)
        return first is not None and first in self.store.rows and core.sibling_waits(
            self.store.rows[first])

    def _arrival(self, r: int, request: GenerationRequest, n: int) -> core.Arrive:
        """The core's Arrive; with a prefix cache it carries the prompt's page tokens and
        its salt (engine/prefix.py)."""
        if not self.core_model.prefix_cache:
            return core.Arrive(r, n)
        assert 1 <= request.cache_salt <= SALT_MAX, request.cache_salt
        tokens = page_tokens_of(request.prompt_ids, n, self.config.page_tokens, self.nonces)
        self.live[r].full_pages = len(request.prompt_ids) // self.config.page_tokens
        return core.Arrive(r, n, tokens=tokens, salt=request.cache_salt)

    def evict(self, d: int, page: int, why: str = "lru") -> bool:
        """Decode worker d's prefix cache forgets `page` (the shell's pick, `why`: "lru"
        under pool pressure, "unshareable" for a page no prompt can hit), if the core
        allows it; logged like every accepted event."""
        return self._evicted(core.Evict(d, page), self.store.evict(d, page), "prefix", why)

    def prefill_evict(self, p: int, page: int, why: str = "lru") -> bool:
        """The same for prefill worker p's cache (the core's PrefillEvict)."""
        return self._evicted(core.PrefillEvict(p, page), self.store.prefill_evict(p, page),
                             "prefill", why)

    def _evicted(self, event: core.WorkerEvent, out, counts: str, why: str) -> bool:
        if type(out) is Refusal:
            self.refused(out)
            return False
        limit = self.config.log_records_max
        if limit and len(self.log) < limit:
            self.log.append({"t": round(self.clock.now(), 6), **codec.encode(event)})
        self.counts[counts][f"evicted_{why}_pages"] += 1
        if self.on_commit is not None:
            self.on_commit(event, out)
        self.checked()
        return True

    def evict_for(self, r: int, d: int, need: int) -> bool:
        """Pool pressure at decode d: evict least recently released idle cached pages, not
        those r is about to hit, until `need` pages are free. False if the idle cache
        cannot make up the difference (r waits for pages, as without a cache)."""
        hits = core.hit_pages(self.core_model, self._view(r), self._row(r))
        victims = self.store.lru_victims(d, hits, need)
        return victims is not None and all([self.evict(d, page) for page in victims])

    def prefill_evict_for(self, r: int, p: int, need: int) -> bool:
        """The same at prefill worker p for r's Admit (the store's pick, not the pages r
        is about to read from the prefill's cache)."""
        hits = core.prefill_hit_pages(self.core_model, self._view(r), self._row(r))
        victims = self.store.prefill_lru_victims(p, hits, need)
        return victims is not None and all([self.prefill_evict(p, page) for page in victims])

    def abort(self, r: int, why: str = "the client went away") -> None:
        """The serving edge gives up on r: a client that left, or (`why`) a server that is
        stopping; for the protocol both are the client gone (Abort)."""
        if r in self.store.rows and self._row(r)[core.CLIENT] == core.WAITING:
            self.live[r].detail = why
            self.take(r, core.Abort(r))

    # -- commands ----------------------------------------------------------------------

    def _want(self, r: int, what: str) -> None:
        live = self.live.get(r)
        if live is not None:
            live.wants.add(what)

    def _finished(self, live: Live, outcome: str, detail: str = "") -> None:
        if live.outcome is not None:
            return
        live.outcome = outcome
        outcomes = self.counts["outcomes"]
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        reason = live.finish_reason if outcome == "Ok" else None
        if not detail and live.guard:
            detail = f"the {live.guard} guard tripped"
        detail = detail or live.detail
        prompt_tokens = len(live.request.prompt_ids)
        # OpenAI's cached_tokens: prompt tokens served from a cache. With the prefill's
        # cache, those the prefill did not compute; with decode's alone, those decode read
        # from its cache instead of receiving them (the prefill computed them all).
        hit = live.prefill_hit_pages if self.config.prefill_cache else live.hit_pages
        cached = min(hit * self.config.page_tokens, prompt_tokens)
        live.on_event(Finished(live.request_id, outcome, reason, live.guard, prompt_tokens,
                               live.completion_tokens, detail, cached))

    def _forget(self, r: int) -> None:
        p, d = self.store.placement[r]
        self.store.forget(r)
        self.first_of.pop(r, None)
        group = self.live[r].request.sibling_group if r in self.live else None
        if group is not None and self.first_of_group.get(group) == r:
            del self.first_of_group[group]
        live = self.live.pop(r, None)
        self.clock.forget(r)
        self.prefills[p].stop(r)
        self.decodes[d].stop(r)
        if live is not None:
            self.recent.append(live)
            del self.recent[:-RECENT_KEPT]

    # -- what a server or a test looks at --------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.live and not self.transport.in_flight

    def queued(self) -> int:
        """Requests admitted by the router and not yet computing at the prefill."""
        return sum(1 for r in self.live if r in self.store.rows
                   and self._row(r)[core.PST] == core.QUEUED)

    def queued_tokens(self) -> int:
        """Their prompt tokens: what admission bounds (engine/serving.py)."""
        return sum(len(live.request.prompt_ids) for r, live in self.live.items()
                   if r in self.store.rows and self._row(r)[core.PST] == core.QUEUED)

    def pool_snapshots(self) -> tuple[PoolSnapshot, ...]:
        """Every worker's pool: prefill workers first, then decode workers, by index."""
        store, transport = self.store, self.transport
        tombs = [0] * len(self.decodes)
        for r, row in store.rows.items():
            if row[core.DST] == core.TOMB:
                tombs[store.placement[r][1]] += 1
        out = []
        for kind, workers, pages in (("prefill", self.prefills, self.config.prefill_pages),
                                     ("decode", self.decodes, self.config.decode_pages)):
            for k, worker in enumerate(workers):
                # A cached page nobody reads counts as free (an allocation evicts it).
                idle = len((store.decode_idle if kind == "decode" else store.prefill_idle)[k])
                free = store.free_pages(kind, k) + idle
                out.append(PoolSnapshot(worker.name, pages, free, pages - free,
                                        tombs[k] if kind == "decode" else 0,
                                        transport.in_flight_at(kind, k),
                                        self._cached_pages(kind, k), idle))
        return tuple(out)

    def _cached_pages(self, kind: str, k: int) -> int:
        """Worker k's cached pages (sealed: filed under a key), read or idle."""
        if kind == "decode":
            return sum(1 for page in self.store.decode_pools[k] if page[core.IDENT])
        return sum(1 for page in self.store.prefill_pools[k] if page[core.P_IDENT])

    def request_snapshots(self) -> tuple[RequestSnapshot, ...]:
        everyone = self.recent + [self.live[r] for r in sorted(self.live)]
        return tuple(RequestSnapshot(x.request_id, x.outcome, tuple(x.timeline))
                     for x in everyone[-RECENT_KEPT:])

    def whole(self) -> bool:
        """Every page of every pool free and no write in flight: the state after a drain."""
        store = self.store
        # With a prefix cache a drained pool holds free pages and idle cached ones.
        return (all(len(free) + len(idle) == self.config.prefill_pages
                    for free, idle in zip(store.prefill_free, store.prefill_idle))
                and all(len(free) + len(idle) == self.config.decode_pages
                        for free, idle in zip(store.decode_free, store.decode_idle))
                and not self.transport.in_flight and not store.rows)

    def log_header(self) -> dict:
        protocol = self.config.protocol()
        return {"format": LOG_FORMAT, "context_pages": protocol.context_pages,
                "prefill_pages": protocol.prefill_pages, "decode_pages": protocol.decode_pages,
                "bugs": sorted(protocol.bugs), "max_prompt_pages": self.config.context_pages,
                "prefill_workers": self.config.prefill_workers,
                "decode_workers": self.config.decode_workers,
                **({"prefix_cache": True} if self.config.prefix_cache else {}),
                **({"prefill_cache": True} if self.config.prefill_cache else {})}


def core_model_for(config: RuntimeConfig) -> Model:
    """The Model the runtime hands the core (and a replay of its log, engine/eventlog.py)."""
    shell = Model.for_shell(config.protocol(), config.context_pages, name="engine",
                            crashes=False, decode_crashes=False)
    return with_caches(shell, config.prefix_cache, config.prefill_cache)


def _sized(pool: PoolConfig, pages: int) -> PoolConfig:
    return replace(pool, num_pages=pages)

