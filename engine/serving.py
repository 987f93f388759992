"""The engine a server runs: engine/service.py's Engine over the protocol-driven runtime.

`build_engine(loaded_model, config)` checks capacity before anything starts: every node's
KV pool must hold the advertised context (the guard the 2026 incident lacked), or the
engine refuses to start with an exception naming the node and both numbers; with
`lower_context_to_fit` it advertises what the smallest pool holds instead. The
PoolBelowContext switch is this check turned off (for the bug zoo's tests only).

The startup check covers time as well as pages. A request's transfer deadline is a lease
(engine/runtime.py, "Timers"): a prefill step that takes longer than the lease would fail a
healthy request, and a prompt at the advertised context must prefill within the transfer
timeout. So `build_engine` measures, on the loaded model, one prefill chunk at the start of
the context and one at its end (`measure_prefill`: garbage KV in free pages, which are never
zeroed anyway), models the chunks between as linear in position (attention grows with it),
and refuses to start (TimingError) when the longest chunk, or the whole prefill of the
advertised context, exceeds what its timers allow with TIMING_MARGIN to spare for load; with
`lower_context_to_fit` it advertises the longest context that passes instead. An operator can
tell it the figure (`context_prefill_s`) instead of measuring. The verdict is kept
(`ThreadedEngine.timing`) for the banner and /v1/models.

Admission refuses up front (Overloaded: 503 with Retry-After): beyond `max_queued` requests,
or once `queued_tokens_max` prompt tokens wait at the prefill workers ahead of it (queued
and not yet computing): `max_queued_tokens`, lowered to what the prefill workers compute in
`queue_wait_s_max` at the rate the startup check measured. So what is admitted starts within
about that bound (plus one prompt's worth), instead of failing later for having waited (no
timer counts the wait); a prompt that fits always starts on an empty queue.

`ThreadedEngine` runs `Runtime.step()` on one background thread. `submit` and `abort` may
be called from any thread: they refuse what must be refused before anything is allocated
(ContextTooLong, Overloaded, EngineStopped) and put the rest in an inbox the loop drains,
so they never wait for model work. Every callback runs on the engine's thread. What submit
refuses is counted with the runtime's rejects ("too long", "capacity"), so the snapshot and
/metrics see every request that was turned away, wherever.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace

import torch

from engine.generate import Request, Sequence, plan_chunks
from engine.runtime import Runtime, RuntimeConfig
from engine.sampling import SamplingParams
from engine.service import (ContextTooLong, EngineStopped, Finished, GenerationRequest,
                            Overloaded, Snapshot)

POOL_TOKENS_DEFAULT = 16384
# How much lower the engine loop's scheduling priority is than the server's (a nice
# increment, 0..19). The loop and its torch threads compute whenever there is work; the
# event loop only needs a core in bursts, and then it must get one: on 2 cores two busy
# torch threads and the loop left it a third of a core, and a burst's 503s queued behind
# prefill (p50 ~480 ms instead of ~60 ms). The torch threads the loop starts inherit it.
# The increment counts against every task in the server's session (Linux's autogroup), not
# only the server's own threads: beside other busy processes started from the same shell
# the loop gets a tenth of a core, so `--loop-nice 0` turns it off (and the tests do).
ENGINE_NICE_INCREMENT = 10
IDLE_PUBLISH_S = 0.1  # how stale an idle engine's snapshot may get, at most
# Timers must allow this many times the measured prefill time: the loop runs every worker in
# turn (a request's chunks wait for the others' steps) and a loaded machine runs slower.
TIMING_MARGIN = 2.0


class TimingError(RuntimeError):
    """Prefilling the advertised context takes longer than the engine's timers allow: the
    engine refuses to start rather than fail healthy requests later."""


@dataclass(frozen=True)
class PrefillTiming:
    """The startup check's figures: how long prefilling `context_tokens` takes here (in
    chunks of `chunk_tokens`), measured or told, and the limits it was held to."""

    context_tokens: int
    chunk_tokens: int
    first_chunk_s: float
    last_chunk_s: float
    measured: bool
    lease_s: float
    transfer_timeout_s: float

    @property
    def chunks(self) -> int:
        return -(-self.context_tokens // self.chunk_tokens)

    @property
    def prefill_s(self) -> float:
        """The whole prompt, chunk times linear in position from the first to the last."""
        return self.chunks * (self.first_chunk_s + self.last_chunk_s) / 2

    def at(self, context_tokens: int) -> "PrefillTiming":
        """The same machine at a shorter context: the last chunk's cost scales with its
        position (linear), never below the first's."""
        ratio = max(0.0, (context_tokens - self.chunk_tokens)
                    / max(1, self.context_tokens - self.chunk_tokens))
        last = self.first_chunk_s + (self.last_chunk_s - self.first_chunk_s) * min(1.0, ratio)
        return replace(self, context_tokens=context_tokens, last_chunk_s=last)

    def problem(self, prefill_workers: int = 1) -> str | None:
        """Why these timers fail healthy requests at this context, or None."""
        step_s = self.last_chunk_s * prefill_workers * TIMING_MARGIN
        if step_s > self.lease_s:
            return (f"a prefill step at the end of the context takes {self.last_chunk_s:.2f} s "
                    f"(x{prefill_workers} prefill workers x{TIMING_MARGIN:g} margin = "
                    f"{step_s:.2f} s), longer than the lease of {self.lease_s:g} s "
                    "(--lease-s)")
        if self.prefill_s * TIMING_MARGIN > self.transfer_timeout_s:
            return (f"prefilling {self.context_tokens} tokens takes {self.prefill_s:.1f} s "
                    f"(x{TIMING_MARGIN:g} margin = {self.prefill_s * TIMING_MARGIN:.1f} s), "
                    f"longer than the transfer timeout of {self.transfer_timeout_s:g} s "
                    "(--transfer-timeout-s)")
        return None

    @property
    def tokens_per_s(self) -> float:
        """One worker's prefill rate over the whole context."""
        return self.context_tokens / self.prefill_s if self.prefill_s > 0 else float("inf")

    def describe(self) -> str:
        how = "measured" if self.measured else "as told"
        return (f"prefill of {self.context_tokens} tokens ~{self.prefill_s:.1f} s ({how}; "
                f"last chunk {self.last_chunk_s:.2f} s), within lease {self.lease_s:g} s and "
                f"transfer timeout {self.transfer_timeout_s:g} s")


class CapacityError(RuntimeError):
    """A node's KV pool cannot hold the advertised context: the engine refuses to start."""

    def __init__(self, node: str, pool_tokens: int, context_tokens: int):
        self.node, self.pool_tokens, self.context_tokens = node, pool_tokens, context_tokens
        super().__init__(f"{node}'s KV pool holds {pool_tokens} tokens, less than the "
                         f"advertised context of {context_tokens} tokens; enlarge the pool "
                         "or set lower_context_to_fit to advertise what it holds")


@dataclass(frozen=True)
class Shape:
    """What every engine a server runs is configured with, in-process or over worker
    processes (engine/process_engine.py's EngineConfig extends it too): the workers, their
    pools, pages and batches, the context advertised, the admission bound, the switches."""

    context_length: int | None = None  # None: the model's max_position_embeddings
    lower_context_to_fit: bool = False  # advertise what the smallest pool holds instead
    page_tokens: int = 16
    prefill_pool_tokens: int = POOL_TOKENS_DEFAULT
    decode_pool_tokens: int = POOL_TOKENS_DEFAULT
    max_batch: int = 64
    prefill_chunk_tokens: int = 512
    max_queued: int = 256  # requests admitted and not yet computing (processes: not answered)
    bugs: frozenset = frozenset()  # bug switches (spec/model.py): tests of the zoo only
    disaggregated: bool = True  # always: prefill and decode workers with pools of their own
    prefill_workers: int = 1  # each with a pool of prefill_pool_tokens
    decode_workers: int = 1  # each with a pool of decode_pool_tokens

    POSITIVE = ("page_tokens", "prefill_pool_tokens", "decode_pool_tokens", "max_batch",
                "prefill_chunk_tokens", "max_queued", "prefill_workers", "decode_workers")

    def __post_init__(self) -> None:
        for name in self.POSITIVE:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.context_length is not None and not self.context_length > 0:
            raise ValueError(f"context_length must be positive, got {self.context_length!r}")
        object.__setattr__(self, "bugs", frozenset(self.bugs))

    @property
    def prefill_pages(self) -> int:
        return self.prefill_pool_tokens // self.page_tokens

    @property
    def decode_pages(self) -> int:
        return self.decode_pool_tokens // self.page_tokens


@dataclass(frozen=True)
class EngineConfig(Shape):
    """The in-process engine's configuration: the shape, and its timers and admission."""

    max_queued_tokens: int = 65536  # their prompt tokens, all prefill workers together
    # ... and no more than the prefill workers compute in this long, at the rate the
    # startup check measured: what is admitted starts within about this bound.
    queue_wait_s_max: float = 30.0
    retry_after_s: float = 1.0
    lease_s: float = 60.0  # decode's lease: the longest silence from a request's prefill
    transfer_timeout_s: float = 600.0  # a request's transfer from its Admit, at most
    # The startup timing check: None measures; a figure (seconds to prefill the advertised
    # context here) is taken as told; 0 skips the check (tests of tiny models only).
    context_prefill_s: float | None = None
    idle_wait_s: float = 0.005  # how long the loop sleeps when there is nothing to do
    # Tests only: the loop sleeps this long after every step that did work, so that a test
    # can catch a request queued, mid-prefill or mid-stream (0: never).
    step_delay_s: float = 0.0
    loop_nice: int = ENGINE_NICE_INCREMENT  # the loop thread's nice increment, 0..19
    transport_seed: int | None = None
    # The prefix caches (engine/prefix.py), both sides: requests of one salt whose prompts
    # share leading pages read them from decode's cache instead of having them sent, and
    # the prefill computes only what its own cache does not hold (RuntimeConfig's
    # prefix_cache and prefill_cache).
    prefix_cache: bool = False

    POSITIVE = Shape.POSITIVE + ("max_queued_tokens", "lease_s", "transfer_timeout_s",
                                 "queue_wait_s_max", "idle_wait_s")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.context_prefill_s is not None and self.context_prefill_s < 0:
            raise ValueError("context_prefill_s must be >= 0")
        if self.step_delay_s < 0:
            raise ValueError("step_delay_s must be >= 0")
        if not 0 <= self.loop_nice <= 19:
            raise ValueError("loop_nice must be 0 to 19")


def advertised_context(shape: Shape, model_context: int) -> int:
    """The context the server advertises: the model's or the configured one, lowered to
    what the smallest pool holds when asked (`lower_context_to_fit`; PoolBelowContext, the
    startup check turned off, never lowers it). Whether every pool holds it is
    `check_capacity`'s (in-process) or each worker's own (processes)."""
    context = shape.context_length or model_context
    if shape.lower_context_to_fit and "PoolBelowContext" not in shape.bugs:
        smallest = min(shape.prefill_pages, shape.decode_pages) * shape.page_tokens
        context = min(context, smallest)
    return context


def check_capacity(shape: Shape, context: int) -> None:
    """CapacityError naming the first worker whose pool holds less than `context` tokens
    (unless PoolBelowContext, the zoo's switch, turns the check off)."""
    if "PoolBelowContext" in shape.bugs:
        return
    nodes = [(f"prefill-{k}", shape.prefill_pages) for k in range(shape.prefill_workers)]
    nodes += [(f"decode-{k}", shape.decode_pages) for k in range(shape.decode_workers)]
    for node, pages in nodes:
        if context > pages * shape.page_tokens:
            raise CapacityError(node, pages * shape.page_tokens, context)


def build_engine(loaded_model, config: EngineConfig | dict | None = None) -> "ThreadedEngine":
    """The engine for a loaded model (engine.load.LoadedModel); CapacityError when a pool
    cannot hold the advertised context."""
    if config is None:
        config = EngineConfig()
    elif isinstance(config, dict):
        config = EngineConfig(**config)
    model = loaded_model.model
    context = advertised_context(config, model.config.max_position_embeddings)
    check_capacity(config, context)
    runtime = Runtime(model, RuntimeConfig(
        prefill_pages=config.prefill_pages, decode_pages=config.decode_pages,
        page_tokens=config.page_tokens,
        context_tokens=context, max_batch=config.max_batch,
        prefill_chunk_tokens=config.prefill_chunk_tokens, lease_s=config.lease_s,
        transfer_timeout_s=config.transfer_timeout_s, bugs=config.bugs,
        transport_seed=config.transport_seed, prefill_workers=config.prefill_workers,
        decode_workers=config.decode_workers, prefix_cache=config.prefix_cache,
        prefill_cache=config.prefix_cache),
        tokenizer=loaded_model.tokenizer)
    timing = checked_timing(runtime, config, context)
    if timing is not None and timing.context_tokens < context:
        lowered = replace(runtime.config, context_tokens=timing.context_tokens)
        runtime = None  # its pools go before the new ones are made
        runtime = Runtime(model, lowered, tokenizer=loaded_model.tokenizer)
    name = getattr(loaded_model, "path", None)
    engine = ThreadedEngine(runtime, config, model_name=name.stem if name else "model")
    engine.timing = timing
    if timing is not None:
        rate = timing.tokens_per_s * config.prefill_workers
        engine.queued_tokens_max = max(1, min(config.max_queued_tokens,
                                              int(rate * config.queue_wait_s_max)))
    return engine


def measure_prefill(runtime: Runtime, context_tokens: int) -> tuple[float, float]:
    """Seconds for one prefill chunk at the start of the context and one ending at
    `context_tokens`, on prefill worker 0's model and pool (the pool is free at startup;
    what the chunks write is garbage in free pages, as every freed page holds), after a
    one-page warm-up: about two chunks' time added to startup."""
    worker = runtime.prefills[0]
    # A pool below the context (only with PoolBelowContext) is measured as far as it holds.
    context_tokens = min(context_tokens, worker.pool.config.num_pages * worker.pool.page_tokens)
    chunk = min(runtime.config.prefill_chunk_tokens, context_tokens)
    pages = list(range(-(-context_tokens // worker.pool.page_tokens)))
    device = worker.model.device
    request = Request(0, (1,) * context_tokens, SamplingParams(max_tokens=1))
    sequence = Sequence(request=request, pages=pages,
                        page_tensor=torch.tensor(pages, dtype=torch.int32, device=device),
                        tag_tensor=torch.empty(0, dtype=torch.int64), generator=None)

    def one(start: int) -> float:
        sequence.prefilled_tokens = start
        plan = plan_chunks([sequence], chunk, device, worker.pool.page_tokens)
        began = time.perf_counter()
        with torch.inference_mode():
            worker.model.prefill(worker.pool, [c for _, c in plan])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    sequence.prefilled_tokens = 0  # a warm-up chunk of one page (first-use costs)
    with torch.inference_mode():
        worker.model.prefill(worker.pool, [c for _, c in plan_chunks(
            [sequence], worker.pool.page_tokens, device, worker.pool.page_tokens)])
    first = one(0)
    last = one(context_tokens - chunk)
    return first, max(first, last)


def checked_timing(runtime: Runtime, config: EngineConfig,
                   context: int) -> PrefillTiming | None:
    """The startup timing check (module header): the timing the engine will advertise, at
    `context` or, with lower_context_to_fit, at the longest context that passes;
    TimingError otherwise. None when told to skip it (context_prefill_s = 0)."""
    chunk = min(config.prefill_chunk_tokens, context)
    if config.context_prefill_s == 0:
        return None
    if config.context_prefill_s is None:
        first, last = measure_prefill(runtime, context)
        timing = PrefillTiming(context, chunk, first, last, True, config.lease_s,
                               config.transfer_timeout_s)
    else:  # told the whole: chunks linear in position from ~0 (a lower bound for the last)
        chunks = -(-context // chunk)
        last = 2 * config.context_prefill_s / (chunks + 1)
        timing = PrefillTiming(context, chunk, last / chunks, last, False, config.lease_s,
                               config.transfer_timeout_s)
    problem = timing.problem(config.prefill_workers)
    if problem is None:
        return timing
    if not config.lower_context_to_fit:
        raise TimingError(f"{problem}; raise that timer, or pass --lower-context-to-fit "
                          "to advertise what fits")
    fits = context
    while fits > config.page_tokens and timing.at(fits).problem(config.prefill_workers):
        fits -= config.page_tokens
    lowered = timing.at(fits)
    if lowered.problem(config.prefill_workers):
        raise TimingError(f"{lowered.problem(config.prefill_workers)}, even at {fits} tokens")
    return lowered


@dataclass(eq=False)
class ThreadedEngine:
    runtime: Runtime
    config: EngineConfig
    model_name: str = "model"
    _inbox: deque = field(default_factory=deque)
    _aborts: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.context_length = self.runtime.config.context_tokens
        self.tokenizer = self.runtime.tokenizer
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._quit = False
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self._idle = True
        self._abort_all = False
        self._in_transit = 0  # drained from the inbox since the last publish
        self._transit_tokens = 0  # their prompt tokens, likewise
        self.timing: PrefillTiming | None = None  # the startup timing check's verdict
        # What admission lets wait, in prompt tokens (build_engine lowers it to what the
        # prefill workers compute in queue_wait_s_max at the measured rate).
        self.queued_tokens_max = self.config.max_queued_tokens
        self._refused: Counter = Counter()  # submit's refusals by reject reason
        self._published = self._publish()
        self.error: BaseException | None = None  # what killed the loop, if anything

    # -- the Engine protocol ------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is None, "started twice"
        self._thread = threading.Thread(target=self._loop, name="kvproof-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest, on_event) -> int:
        prompt, max_tokens = len(request.prompt_ids), request.sampling.max_tokens
        vocabulary = self.runtime.model.config.vocab_size
        if not prompt or not all(0 <= t < vocabulary for t in request.prompt_ids):
            raise ValueError(f"a prompt is 1 or more token ids in [0, {vocabulary})")
        with self._lock:
            if prompt + max_tokens > self.context_length:
                self._refused["too long"] += 1
                raise ContextTooLong(prompt, max_tokens, self.context_length)
            if self._stopping:
                raise EngineStopped("the engine is stopping")
            queued = self._at_capacity()
            if queued is not None:
                self._refused["capacity"] += 1
                raise Overloaded(queued, self.config.retry_after_s)
            r = self._next_id
            self._next_id += 1
            self._inbox.append((r, request, on_event))
        self._wake.set()
        return r

    def full(self, pending: int = 0, pending_tokens: int = 0) -> float | None:
        """None when submit would admit one more request now, with `pending` more (of at
        most `pending_tokens` prompt tokens in all) on their way to it; else the
        Retry-After, in seconds, for the refusal. The HTTP admission gate asks before it
        reads a body and refuses when told a time (counted with submit's capacity
        refusals)."""
        with self._lock:
            if self._at_capacity(pending, pending_tokens) is None:
                return None
            self._refused["capacity"] += 1
            return self.config.retry_after_s

    def _at_capacity(self, pending: int = 0, pending_tokens: int = 0) -> int | None:
        """The requests queued (with `pending`) when admission must refuse one more, else
        None. What bounds a request's wait to start is the prompt tokens ahead of it, not
        its own: on an empty queue any prompt that fits starts at once. Under the lock."""
        queued = len(self._inbox) + self._in_transit + self._published.queued + pending
        waiting = (sum(len(request.prompt_ids) for _, request, _ in self._inbox)
                   + self._transit_tokens + self._published.queued_tokens + pending_tokens)
        if queued >= self.config.max_queued or waiting >= self.queued_tokens_max:
            return queued
        return None

    def abort(self, request_id: int) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def snapshot(self) -> Snapshot:
        """The loop publishes one after every step; the inbox is added at call time."""
        with self._lock:
            published, waiting = self._published, len(self._inbox) + self._in_transit
            refused = dict(self._refused)
        rejects = {reason: published.rejects.get(reason, 0) + refused.get(reason, 0)
                   for reason in published.rejects.keys() | refused.keys()}
        return replace(published, queued=published.queued + waiting, rejects=rejects)

    def stop(self, drain_s: float = 0.0) -> None:
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and not self._drained():
            time.sleep(0.01)
        self._abort_all = True  # the loop aborts every live request through the protocol
        while self._thread is not None and self._thread.is_alive() and not self._drained():
            self._wake.set()
            time.sleep(0.01)
        self._quit = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    # -- the loop -----------------------------------------------------------------------

    def _publish(self) -> Snapshot:
        """Built on the engine's thread (or before it starts): never while a step runs."""
        rt = self.runtime
        counts = {k: dict(v) for k, v in rt.counts.items()}
        return Snapshot(pools=rt.pool_snapshots(), queued=rt.queued(),
                        queued_tokens=rt.queued_tokens(),
                        running=sum(len(w.running) for w in rt.decodes)
                        + sum(len(w.computing) for w in rt.prefills),
                        recent=rt.request_snapshots(), guard_trips=counts["guard_trips"],
                        refusals=counts["refusals"], rejects=counts["rejects"],
                        outcomes=counts["outcomes"], transfers=rt.transport.writes_landed,
                        transfer_bytes=rt.transport.bytes_landed,
                        prefix=counts["prefix"] if rt.config.prefix_cache else {},
                        prefill_cache=counts["prefill"] if rt.config.prefill_cache else {},
                        prefix_shared_guard_trips=counts["prefix_shared_guard_trips"],
                        prefix_tenants=counts["prefix_tenants"])

    def _drained(self) -> bool:
        with self._lock:
            return not self._inbox and self._idle

    def _loop(self) -> None:
        if self.config.loop_nice:
            lower_thread_priority(self.config.loop_nice)
        published_s = time.monotonic()
        try:
            while not self._quit:
                busy = self._drain_inbox()
                if self._abort_all:
                    for r in list(self.runtime.live):
                        self.runtime.abort(r, "the server is stopping")
                busy |= self.runtime.step()
                # A snapshot costs a walk over the recent requests: idle turns (every
                # idle_wait_s) publish only every IDLE_PUBLISH_S, enough for what an idle
                # turn may change (a refused event's count).
                now = time.monotonic()
                if busy or now - published_s >= IDLE_PUBLISH_S:
                    published, idle, published_s = self._publish(), self.runtime.idle, now
                    with self._lock:
                        self._published, self._idle, self._in_transit = published, idle, 0
                        self._transit_tokens = 0
                if busy and self.config.step_delay_s:
                    time.sleep(self.config.step_delay_s)
                if not busy:
                    self._wake.wait(self.config.idle_wait_s)
                    self._wake.clear()
        except BaseException as error:  # a bug: keep it for stop() and the tests to see
            self.error = error
            self._fail_everyone(error)
            raise

    def _fail_everyone(self, error: BaseException) -> None:
        """The loop died (a bug): no request may hang. Every live one gets a Finished with
        ErrDecode, the outcome of a decode worker that is gone, outside the protocol (the
        core cannot take events any more), with the error in `detail`."""
        with self._lock:
            self._stopping = True
            inbox, self._inbox = list(self._inbox), deque()
        pending = [(r, request, on_event) for r, request, on_event in inbox]
        pending += [(live.request_id, live.request, live.on_event)
                    for live in self.runtime.live.values() if live.outcome is None]
        for r, request, on_event in pending:
            try:
                on_event(Finished(r, "ErrDecode", None, None, len(request.prompt_ids), 0,
                                  f"engine failure: {type(error).__name__}: {error}"))
            except Exception:  # noqa: BLE001 - the callback's own failure changes nothing
                pass

    def _drain_inbox(self) -> bool:
        with self._lock:
            arrivals, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = list(self._aborts), deque()
            self._in_transit += len(arrivals)
            self._transit_tokens += sum(len(request.prompt_ids) for _, request, _ in arrivals)
        for r, request, on_event in arrivals:
            self.runtime.arrive(request, on_event, request_id=r)
        for r in aborts:
            self.runtime.abort(r)
        return bool(arrivals or aborts)


def lower_thread_priority(increment: int) -> bool:
    """Lower the calling thread's priority by `increment` (Linux: a thread is a task with a
    nice value of its own, and threads it starts inherit it). Elsewhere, or where the
    scheduler refuses, nothing changes and the answer is False: the engine is then only
    less responsive in bursts, never wrong."""
    if not hasattr(os, "setpriority") or not os.uname().sysname == "Linux":
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid)
                                                 + increment))
    except OSError:
        return False
    return True
