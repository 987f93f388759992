"""The engine's side of the one runtime's interfaces (spec/interfaces.py): real workers,
the in-process transport, the wall clock and the serving edge.

Theory of operation. spec/runtime.py takes every event to the core and routes each
command of the core's answer to one of these; each turns it into what the engine does:
a prefill worker (engine/workers.py) queues and computes on its real KV pool, its page
writes go through engine/transport.py with the source page's checksum, a decode worker
adds the request to its batch, a message becomes one of the request's wants (delivered
by engine/delivery.py when the core enables its consumer), a lease is a deadline on the
wall clock polled by the loop (engine/loop.py), and an answer reaches the serving edge's
callback. They read the runtime's state (its live requests, the store's rows) and never
change protocol state themselves.

Each adapter holds the runtime `rt`; the workers, pools and transport stay the runtime's
(`rt.prefills`, `rt.decodes`, `rt.transport`), where the loop and the tests find them.
"""

from __future__ import annotations

from engine.delivery import GONE_DECODE, GONE_PREFILL
from engine.generate import Request
from engine.transport import PageWrite
from spec import codec, core
from spec import commands as cmd


class EnginePrefill:
    """interfaces.PrefillWorker over prefill worker `index` (engine/workers.py)."""

    def __init__(self, rt, index: int) -> None:
        self.rt, self.worker, self.index = rt, rt.prefills[index], index

    def queue_request(self, r: int) -> None:
        self.worker.queue.append(r)

    def compute(self, r: int) -> None:
        live = self.rt.live[r]
        request = Request(r, live.request.prompt_ids, live.request.sampling)
        row = self.rt.store.rows[r]
        self.worker.start(request, row[core.SRC], row[core.PCACHED])

    def post(self, write: tuple, d: int) -> None:
        r, source, page, tag = write
        self.rt.transport.post(PageWrite(r, source, page, tag, self.worker.checksum(source),
                                         self.index, d))

    def pages_freed(self, r: int) -> None:
        """Source pages came back (Done, an abort, or SourceReuse's early free): nothing
        may compute into them for this request any more."""
        self.worker.stop(r)


class EngineDecode:
    """interfaces.DecodeWorker over decode worker `index` (engine/workers.py)."""

    def __init__(self, rt, index: int) -> None:
        self.rt, self.worker, self.index = rt, rt.decodes[index], index

    def start_decoding(self, r: int) -> None:
        live = self.rt.live[r]
        if live.first is None:  # the core decoded with no final word (FullHitNoNotice)
            raise core.ProtocolMisuse(
                f"request {r}: decoding started before the prefill's first token reached "
                "decode (no final word came: a full decode-side hit without its notice?)")
        token, logits, generator = live.first
        request = Request(r, live.request.prompt_ids, live.request.sampling)
        row = self.rt.store.rows[r]
        live.sequence = self.worker.start(request, row[core.TABLE], generator,
                                          core.tag_idents(self.rt.store.model, row))
        self.rt._next_token(live, token, logits)

    def stop_decoding(self, r: int) -> None:
        self.worker.stop(r)

    def pages_freed(self, r: int) -> None:
        """Nothing to wake: waiting bootstraps retry their Reserve on the next step."""


class InProcessMessages:
    """interfaces.Transport in one process: a message is a want of its request, taken by
    engine/delivery.py when the core enables the action that consumes it."""

    def __init__(self, rt) -> None:
        self.rt = rt

    def send(self, r: int, message: str, p: int, d: int) -> None:
        if message != cmd.PAGE_TABLE:  # in-process it reaches the prefill with the Reserve
            self.rt._want(r, message)


class WallClock:
    """interfaces.Clock on the wall clock (or a test's `read`): leases as deadlines in
    `timers`, which the loop polls (engine/loop.py `_timers`).

    Decode's transfer deadline is a lease (engine/runtime.py "Timers"): ArmTimer starts it;
    every sign of progress from the request's prefill renews it to lease_s from now, never
    past transfer_timeout_s after the Admit. StopwatchTimeout (the zoo's switch) is the old
    deadline: transfer_timeout_s from reservation, never renewed."""

    def __init__(self, read, config) -> None:
        self.read, self.config = read, config
        self.started = read()
        self.timers: dict[int, float] = {}       # request -> when its lease lapses
        self.admitted_at: dict[int, float] = {}  # request -> when its prefill admitted it
        self.stopwatch = "StopwatchTimeout" in config.bugs

    def now(self) -> float:
        return self.read() - self.started

    def arm(self, r: int) -> None:
        self.timers[r] = self.read() + (
            self.config.transfer_timeout_s if self.stopwatch else self.config.lease_s)

    def cancel(self, r: int) -> None:
        self.timers.pop(r, None)

    def renew(self, r: int, kind: type = None, p: int = -1) -> None:
        """Progress from r's prefill: its lease runs lease_s from now, but never past
        transfer_timeout_s after its Admit. In one process the renewal is a call; between
        processes it is a message from the prefill like any other."""
        if kind is core.Admit:
            self.admitted_at[r] = self.read()
        if r not in self.timers or self.stopwatch:
            return
        lapse = self.read() + self.config.lease_s
        admitted = self.admitted_at.get(r)
        if admitted is not None:
            lapse = min(lapse, admitted + self.config.transfer_timeout_s)
        self.timers[r] = lapse

    def forget(self, r: int) -> None:
        self.timers.pop(r, None)
        self.admitted_at.pop(r, None)


class ServingClients:
    """interfaces.Client: the serving edge's callbacks (an HTTP request, a test), through
    the runtime's `_finished` (one Finished event per request)."""

    def __init__(self, rt) -> None:
        self.rt = rt

    def answer(self, r: int, outcome: str) -> None:
        rt = self.rt
        live = rt.live[r]
        if outcome == "ErrTag":
            live.guard = "tag"
        elif outcome == "ErrTransfer":
            sent = live.pages - live.hit_pages  # the pages decode held cached are not sent
            live.guard = ("count" if live.count_sent != sent
                          else live.transfer_fault or "checksum")
        if live.guard:
            trips = rt.counts["guard_trips"]
            trips[live.guard] = trips.get(live.guard, 0) + 1
            if live.hit_pages or live.prefill_hit_pages:  # it read shared pages
                shared = rt.counts["prefix_shared_guard_trips"]
                shared[live.guard] = shared.get(live.guard, 0) + 1
                rt._count_tenant(live, shared_guard_trips=1)
        if outcome == "ErrTooLong":
            rejects = rt.counts["rejects"]
            rejects["too long"] = rejects.get("too long", 0) + 1
        rt._finished(live, outcome)

    def gone(self, r: int, p: int, d: int) -> None:
        """The client went away: both workers are told (wants), the client has its Gone."""
        rt = self.rt
        rt._want(r, GONE_PREFILL)
        rt._want(r, GONE_DECODE)
        live = rt.live[r]
        rt._finished(live, "Gone", detail=live.detail or "the client went away")


class MemoryLog:
    """The event log in memory (`rt.log`, bounded by log_records_max records), and each
    live request's timeline (what a server's request snapshots show)."""

    def __init__(self, rt) -> None:
        self.rt = rt

    def record(self, now: float, event: core.Event, p: int, d: int) -> None:
        rt = self.rt
        limit = rt.config.log_records_max
        if limit and len(rt.log) < limit:
            record = {"t": round(now, 6), **codec.encode(event)}
            if type(event) is core.Arrive:
                record["p"], record["d"] = p, d
            rt.log.append(record)
        live = rt.live.get(event.request)
        if live is not None:
            live.timeline.append((now, event.label()))
