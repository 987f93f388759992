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

Where the parts live: this module holds the configuration, the one path into the core
(`take`), the client's side (`arrive`, `abort`), the command handlers and what a server
or a test looks at; `Runtime` also has the loop and its data-path steps (engine/loop.py),
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

from engine.delivery import GONE_DECODE, GONE_PREFILL, RELEASE, Delivery
from engine.eventlog import LOG_FORMAT
from engine.generate import Request, pages_needed
from engine.loop import Loop
from engine.model import LlamaModel
from engine.pool import PoolConfig
from engine.service import Finished, GenerationRequest, PoolSnapshot, RequestSnapshot
from engine.streaming import Live
from engine.transport import InProcessTransport, PageWrite
from engine.workers import DecodeWorker, PrefillWorker
from spec import codec, core
from spec import commands as cmd
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

    def __post_init__(self) -> None:
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


class Runtime(Loop, Delivery):
    """Single-threaded: call `arrive`, `abort` and `step` from one thread (the threaded
    engine in engine/serving.py does)."""

    def __init__(self, model: LlamaModel, config: RuntimeConfig = RuntimeConfig(),
                 tokenizer=None, clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.config, self.tokenizer, self.clock = model, config, tokenizer, clock
        self.core_model = Model.for_shell(config.protocol(), config.context_pages,
                                          name="engine", crashes=False, decode_crashes=False)
        self.store = Store(self.core_model, config.prefill_workers, config.decode_workers)
        pool = PoolConfig.for_model(model.config, 1, config.page_tokens, model.dtype,
                                    model.device)
        self.prefills = [PrefillWorker(model, _sized(pool, config.prefill_pages),
                                       config.prefill_chunk_tokens, name=f"prefill-{k}")
                         for k in range(config.prefill_workers)]
        self.decodes = [DecodeWorker(model, _sized(pool, config.decode_pages), config.max_batch,
                                     name=f"decode-{k}") for k in range(config.decode_workers)]
        self.transport = InProcessTransport([w.pool for w in self.prefills],
                                            [w.pool for w in self.decodes],
                                            config.lands_per_step, config.transport_seed)
        self._turn = 0  # the router's tie-break
        self.live: dict[int, Live] = {}
        self.timers: dict[int, float] = {}  # request -> when its lease lapses
        self.admitted_at: dict[int, float] = {}  # request -> when its prefill admitted it
        self.recent: list[Live] = []
        self.log: list[dict] = []
        # The leak oracle's evidence (config.keep_kv): per request, the prompt KV its prefill
        # computed, and the prompt KV its decode read at its last step, both as tensors
        # [tokens, layers, 2, kv_heads, dim] copied out of the pools.
        self.prompt_kv: dict[int, torch.Tensor] = {}
        self.read_kv: dict[int, torch.Tensor] = {}
        self.started = clock()
        self.next_id = 0
        self.on_commit: Callable | None = None  # fuzzers: (event, change) after each commit
        self.counts = {"guard_trips": {}, "refusals": {}, "rejects": {}, "outcomes": {}}
        self._handlers = {
            cmd.Send: self._send, cmd.Queue: self._queue, cmd.Compute: self._compute,
            cmd.Post: self._post, cmd.ArmTimer: self._arm_timer,
            cmd.CancelTimer: self._cancel_timer, cmd.StartDecoding: self._start_decoding,
            cmd.StopDecoding: self._stop_decoding,
            cmd.ReleaseWhenReady: lambda c: self._want(c.request, RELEASE),
            cmd.Answer: self._answer, cmd.FreePages: self._pages_freed,
        }

    # -- the one path into the core ------------------------------------------------------

    def take(self, r: int, event: core.Event) -> core.Change | None:
        """The core decides; an accepted event is logged and its commands carried out."""
        out = self.store.take(r, event)
        if type(out) is Refusal:
            reasons = self.counts["refusals"]
            reasons[out.reason] = reasons.get(out.reason, 0) + 1
            return None
        now = self.clock() - self.started
        if self.config.log_records_max and len(self.log) < self.config.log_records_max:
            record = {"t": round(now, 6), **codec.encode(event)}
            if type(event) is core.Arrive:
                record["p"], record["d"] = self.store.placement[r]
            self.log.append(record)
        live = self.live.get(r)
        if live is not None:
            live.timeline.append((now, event.label()))
        if self.on_commit is not None:
            self.on_commit(event, out)
        for command in out.commands:
            self._handlers[type(command)](command)
        if type(event) in core.LEASE_RENEWALS:  # a chunk computed renews too (loop.py)
            if type(event) is core.Admit:
                self.admitted_at[r] = self.clock()
            self.renew(r)
        row = self.store.rows.get(r)
        if row is not None and core.settled(row):
            self._forget(r)
        return out

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
        p, d = self.place()
        self.live[r] = Live(r, request, on_event, n, self.clock())
        self.store.arrive(r, p, d)
        if self.take(r, core.Arrive(r, n)) is None:
            self.store.withdraw(r)
            self._finished(self.live.pop(r), "ErrTooLong", detail="the core refused Arrive")
        return r

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

    def _send(self, c: cmd.Send) -> None:
        r, message = c.request, c.message
        if message == cmd.PAGE_TABLE:
            pass  # in-process it reaches the prefill with the Reserve; admission asks the core
        elif message == core.CLIENT_GONE:
            self._want(r, GONE_PREFILL)
            self._want(r, GONE_DECODE)
            live = self.live[r]
            self._finished(live, "Gone", detail=live.detail or "the client went away")
        else:
            self._want(r, message)

    def _queue(self, c: cmd.Queue) -> None:
        self.prefill_of(c.request).queue.append(c.request)

    def _compute(self, c: cmd.Compute) -> None:
        r = c.request
        live = self.live[r]
        request = Request(r, live.request.prompt_ids, live.request.sampling)
        self.prefill_of(r).start(request, self._row(r)[core.SRC])

    def _post(self, c: cmd.Post) -> None:
        r, source, page, tag = c.write
        p, d = self.store.placement[r]
        self.transport.post(PageWrite(r, source, page, tag, self.prefills[p].checksum(source),
                                      p, d))

    def _arm_timer(self, c: cmd.ArmTimer) -> None:
        stopwatch = "StopwatchTimeout" in self.config.bugs
        self.timers[c.request] = self.clock() + (
            self.config.transfer_timeout_s if stopwatch else self.config.lease_s)

    def renew(self, r: int) -> None:
        """Progress from r's prefill: its lease runs lease_s from now, but never past
        transfer_timeout_s after its Admit. In one process the renewal is a call; between
        processes it is a message from the prefill like any other."""
        if r not in self.timers or "StopwatchTimeout" in self.config.bugs:
            return
        now = self.clock()
        lapse = now + self.config.lease_s
        admitted = self.admitted_at.get(r)
        if admitted is not None:
            lapse = min(lapse, admitted + self.config.transfer_timeout_s)
        self.timers[r] = lapse

    def _cancel_timer(self, c: cmd.CancelTimer) -> None:
        self.timers.pop(c.request, None)

    def _start_decoding(self, c: cmd.StartDecoding) -> None:
        r = c.request
        live = self.live[r]
        token, logits, generator = live.first
        request = Request(r, live.request.prompt_ids, live.request.sampling)
        live.sequence = self.decode_of(r).start(request, self._row(r)[core.TABLE], generator)
        self._next_token(live, token, logits)

    def _stop_decoding(self, c: cmd.StopDecoding) -> None:
        self.decode_of(c.request).stop(c.request)

    def _pages_freed(self, c: cmd.FreePages) -> None:
        """Source pages came back (Done, an abort, or SourceReuse's early free): nothing
        may compute into them for this request any more. Freed decode pages need nothing:
        waiting bootstraps retry their Reserve on the next step."""
        if c.pool == "prefill":
            self.prefill_of(c.request).stop(c.request)

    def _answer(self, c: cmd.Answer) -> None:
        live = self.live[c.request]
        if c.outcome == "ErrTag":
            live.guard = "tag"
        elif c.outcome == "ErrTransfer":
            live.guard = ("count" if live.count_sent != live.pages
                          else live.transfer_fault or "checksum")
        if live.guard:
            trips = self.counts["guard_trips"]
            trips[live.guard] = trips.get(live.guard, 0) + 1
        if c.outcome == "ErrTooLong":
            rejects = self.counts["rejects"]
            rejects["too long"] = rejects.get("too long", 0) + 1
        self._finished(live, c.outcome)

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
        live.on_event(Finished(live.request_id, outcome, reason, live.guard,
                               len(live.request.prompt_ids), live.completion_tokens, detail))

    def _forget(self, r: int) -> None:
        p, d = self.store.placement[r]
        self.store.forget(r)
        live = self.live.pop(r, None)
        self.timers.pop(r, None)
        self.admitted_at.pop(r, None)
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
                free = store.free_pages(kind, k)
                out.append(PoolSnapshot(worker.name, pages, free, pages - free,
                                        tombs[k] if kind == "decode" else 0,
                                        transport.in_flight_at(kind, k)))
        return tuple(out)

    def request_snapshots(self) -> tuple[RequestSnapshot, ...]:
        everyone = self.recent + [self.live[r] for r in sorted(self.live)]
        return tuple(RequestSnapshot(x.request_id, x.outcome, tuple(x.timeline))
                     for x in everyone[-RECENT_KEPT:])

    def whole(self) -> bool:
        """Every page of every pool free and no write in flight: the state after a drain."""
        store = self.store
        return (all(len(free) == self.config.prefill_pages for free in store.prefill_free)
                and all(len(free) == self.config.decode_pages for free in store.decode_free)
                and not self.transport.in_flight and not store.rows)

    def log_header(self) -> dict:
        protocol = self.config.protocol()
        return {"format": LOG_FORMAT, "context_pages": protocol.context_pages,
                "prefill_pages": protocol.prefill_pages, "decode_pages": protocol.decode_pages,
                "bugs": sorted(protocol.bugs), "max_prompt_pages": self.config.context_pages,
                "prefill_workers": self.config.prefill_workers,
                "decode_workers": self.config.decode_workers}


def _sized(pool: PoolConfig, pages: int) -> PoolConfig:
    return replace(pool, num_pages=pages)

