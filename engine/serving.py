"""The engine a server runs: engine/service.py's Engine over the protocol-driven runtime.

`build_engine(loaded_model, config)` checks capacity before anything starts: every node's
KV pool must hold the advertised context (the guard the 2026 incident lacked), or the
engine refuses to start with an exception naming the node and both numbers; with
`lower_context_to_fit` it advertises what the smallest pool holds instead. The
PoolBelowContext switch is this check turned off (for the bug zoo's tests only).

`ThreadedEngine` runs `Runtime.step()` on one background thread. `submit` and `abort` may
be called from any thread: they refuse what must be refused before anything is allocated
(ContextTooLong, Overloaded, EngineStopped) and put the rest in an inbox the loop drains,
so they never wait for model work. Every callback runs on the engine's thread. What submit
refuses is counted with the runtime's rejects ("too long", "capacity"), so the snapshot and
/metrics see every request that was turned away, wherever.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace

from engine.runtime import Runtime, RuntimeConfig
from engine.service import (ContextTooLong, EngineStopped, Finished, GenerationRequest,
                            Overloaded, Snapshot)

POOL_TOKENS_DEFAULT = 16384
IDLE_PUBLISH_S = 0.1  # how stale an idle engine's snapshot may get, at most


class CapacityError(RuntimeError):
    """A node's KV pool cannot hold the advertised context: the engine refuses to start."""

    def __init__(self, node: str, pool_tokens: int, context_tokens: int):
        self.node, self.pool_tokens, self.context_tokens = node, pool_tokens, context_tokens
        super().__init__(f"{node}'s KV pool holds {pool_tokens} tokens, less than the "
                         f"advertised context of {context_tokens} tokens; enlarge the pool "
                         "or set lower_context_to_fit to advertise what it holds")


@dataclass(frozen=True)
class EngineConfig:
    context_length: int | None = None  # None: the model's max_position_embeddings
    lower_context_to_fit: bool = False  # advertise what the smallest pool holds instead
    page_tokens: int = 16
    prefill_pool_tokens: int = POOL_TOKENS_DEFAULT
    decode_pool_tokens: int = POOL_TOKENS_DEFAULT
    max_batch: int = 64
    prefill_chunk_tokens: int = 512
    max_queued: int = 256  # requests admitted by submit and not yet computing
    retry_after_s: float = 1.0
    transfer_timeout_s: float = 30.0
    idle_wait_s: float = 0.005  # how long the loop sleeps when there is nothing to do
    # Tests only: the loop sleeps this long after every step that did work, so that a test
    # can catch a request queued, mid-prefill or mid-stream (0: never).
    step_delay_s: float = 0.0
    bugs: frozenset = frozenset()  # bug switches (spec/model.py): tests of the zoo only
    transport_seed: int | None = None
    disaggregated: bool = True  # always: prefill and decode workers with pools of their own
    prefill_workers: int = 1  # each with a pool of prefill_pool_tokens
    decode_workers: int = 1  # each with a pool of decode_pool_tokens

    def __post_init__(self) -> None:
        for name in ("page_tokens", "prefill_pool_tokens", "decode_pool_tokens", "max_batch",
                     "prefill_chunk_tokens", "max_queued", "prefill_workers", "decode_workers"):
            assert getattr(self, name) > 0, f"{name} must be positive"
        assert self.context_length is None or self.context_length > 0
        assert self.step_delay_s >= 0 and self.idle_wait_s > 0
        object.__setattr__(self, "bugs", frozenset(self.bugs))


def advertised_context(config: EngineConfig, model_context: int) -> tuple[int, int, int]:
    """(context tokens, prefill pages, decode pages) after the startup capacity check."""
    pt = config.page_tokens
    prefill_pages = config.prefill_pool_tokens // pt
    decode_pages = config.decode_pool_tokens // pt
    context = config.context_length or model_context
    if "PoolBelowContext" in config.bugs:
        return context, prefill_pages, decode_pages
    nodes = [(f"prefill-{k}", prefill_pages) for k in range(config.prefill_workers)]
    nodes += [(f"decode-{k}", decode_pages) for k in range(config.decode_workers)]
    for node, pages in nodes:
        if context > pages * pt:
            if not config.lower_context_to_fit:
                raise CapacityError(node, pages * pt, context)
            context = pages * pt
    return context, prefill_pages, decode_pages


def build_engine(loaded_model, config: EngineConfig | dict | None = None) -> "ThreadedEngine":
    """The engine for a loaded model (engine.load.LoadedModel); CapacityError when a pool
    cannot hold the advertised context."""
    if config is None:
        config = EngineConfig()
    elif isinstance(config, dict):
        config = EngineConfig(**config)
    model = loaded_model.model
    context, prefill_pages, decode_pages = advertised_context(
        config, model.config.max_position_embeddings)
    runtime = Runtime(model, RuntimeConfig(
        prefill_pages=prefill_pages, decode_pages=decode_pages, page_tokens=config.page_tokens,
        context_tokens=context, max_batch=config.max_batch,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        transfer_timeout_s=config.transfer_timeout_s, bugs=config.bugs,
        transport_seed=config.transport_seed, prefill_workers=config.prefill_workers,
        decode_workers=config.decode_workers), tokenizer=loaded_model.tokenizer)
    name = getattr(loaded_model, "path", None)
    return ThreadedEngine(runtime, config, model_name=name.stem if name else "model")


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
            queued = len(self._inbox) + self._in_transit + self._published.queued
            if queued >= self.config.max_queued:
                self._refused["capacity"] += 1
                raise Overloaded(queued, self.config.retry_after_s)
            r = self._next_id
            self._next_id += 1
            self._inbox.append((r, request, on_event))
        self._wake.set()
        return r

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
                        running=sum(len(w.running) for w in rt.decodes)
                        + sum(len(w.computing) for w in rt.prefills),
                        recent=rt.request_snapshots(), guard_trips=counts["guard_trips"],
                        refusals=counts["refusals"], rejects=counts["rejects"],
                        outcomes=counts["outcomes"], transfers=rt.transport.writes_landed,
                        transfer_bytes=rt.transport.bytes_landed)

    def _drained(self) -> bool:
        with self._lock:
            return not self._inbox and self._idle

    def _loop(self) -> None:
        published_s = time.monotonic()
        try:
            while not self._quit:
                busy = self._drain_inbox()
                if self._abort_all:
                    for r in list(self.runtime.live):
                        self.runtime.abort(r)
                busy |= self.runtime.step()
                # A snapshot costs a walk over the recent requests: idle turns (every
                # idle_wait_s) publish only every IDLE_PUBLISH_S, enough for what an idle
                # turn may change (a refused event's count).
                now = time.monotonic()
                if busy or now - published_s >= IDLE_PUBLISH_S:
                    published, idle, published_s = self._publish(), self.runtime.idle, now
                    with self._lock:
                        self._published, self._idle, self._in_transit = published, idle, 0
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
        for r, request, on_event in arrivals:
            self.runtime.arrive(request, on_event, request_id=r)
        for r in aborts:
            self.runtime.abort(r)
        return bool(arrivals or aborts)
