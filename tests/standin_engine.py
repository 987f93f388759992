"""STAND-IN ENGINE, for the server's tests only: engine.service.Engine implemented over the
single-process engine.generate.Generator (real model, real tokens), until the
protocol-driven prefill/decode engine (`build_engine`) lands.

It is not the protocol engine and must never be served: there is no prefill worker, no
transfer and no protocol core here. One pool ("generator-0") is reserved whole per request
(prompt + max_tokens) as Generator does; the timeline names the Generator's own steps with
the protocol's action names where they correspond (Arrive, Reserve, Finish, Abort,
Release). What it does honour is the contract's shape, which is what the server is built
against: one background thread runs the loop, `submit`/`abort` are thread-safe and never
block on model work, events arrive in order (TokenOut*, then exactly one Finished),
refusals are raised before anything is allocated, `stop(drain_s)` drains then aborts.

The loop drives Generator's own admission, prefill and decode steps (the same three calls
`Generator.run` makes, on queues kept across calls), and turns what changed in each
sequence after a step into events. Test hooks: `step_delay_s` slows every step (to catch a
request mid-prefill or mid-stream), `fail_next` makes the next finishing requests end with
a given outcome (guard trips without a fault injector).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

import torch

from engine.generate import Generator, GeneratorConfig, Request
from engine.service import (ContextTooLong, EngineStopped, Finished, GenerationRequest,
                            Overloaded, PoolSnapshot, RequestSnapshot, Snapshot, TokenOut)

RECENT_MAX = 64
POOL_NAME = "generator-0"


class _Live:
    """One submitted request as the stand-in tracks it."""

    def __init__(self, request_id: int, request: GenerationRequest, on_event, started: float):
        self.request_id, self.request, self.on_event = request_id, request, on_event
        self.sequence = None  # the Generator's Sequence once admitted
        self.emitted_tokens = 0
        self.emitted_text = ""
        self.timeline = [(time.perf_counter() - started, "Arrive")]
        self.outcome = None


class StandInEngine:
    """engine.service.Engine over engine.generate.Generator (see the module docstring)."""

    def __init__(self, loaded, *, num_pages: int = 256, page_tokens: int = 16,
                 max_batch: int = 32, queue_max: int = 64, step_delay_s: float = 0.0,
                 retry_after_s: float = 1.0, prefill_chunk_tokens: int = 512):
        assert loaded.tokenizer is not None, "the stand-in needs a tokenizer"
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.path.name
        self.generator = Generator(loaded.model, GeneratorConfig(
            num_pages=num_pages, page_tokens=page_tokens, max_batch=max_batch,
            prefill_chunk_tokens=prefill_chunk_tokens, keep_logits=True), loaded.tokenizer)
        self.context_length = min(loaded.model.config.max_position_embeddings,
                                  num_pages * page_tokens)
        self.queue_max, self.step_delay_s, self.retry_after_s = queue_max, step_delay_s, retry_after_s
        self.fail_next: deque = deque()  # (outcome, guard) for the next requests to finish
        self.fail_at_admission: deque = deque()  # (outcome, guard): fail before any token
        self.last_error: Exception | None = None  # what a step raised, if one did
        self._started = time.perf_counter()
        self._lock = threading.Condition()
        self._inbox: deque = deque()
        self._aborts: set = set()
        self._live: dict[int, _Live] = {}
        self._waiting, self._prefilling, self._running = deque(), [], []
        self._recent: deque = deque(maxlen=RECENT_MAX)
        self._outcomes, self._rejects, self._guards = Counter(), Counter(), Counter()
        self._next_id = 1
        self._accepting, self._stopping = True, False
        self._thread = threading.Thread(target=self._loop, name="standin-engine", daemon=True)

    # ---- the contract --------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest, on_event) -> int:
        max_tokens = request.sampling.max_tokens
        with self._lock:
            if not self._accepting:
                raise EngineStopped("the engine is stopping")
            if len(request.prompt_ids) + max_tokens > self.context_length:
                self._rejects["too long"] += 1
                raise ContextTooLong(len(request.prompt_ids), max_tokens, self.context_length)
            if len(self._inbox) + len(self._waiting) >= self.queue_max:
                self._rejects["capacity"] += 1
                raise Overloaded(len(self._inbox) + len(self._waiting), self.retry_after_s)
            request_id = self._next_id
            self._next_id += 1
            live = _Live(request_id, request, on_event, self._started)
            self._live[request_id] = live
            self._recent.append(live)
            self._inbox.append(live)
            self._lock.notify()
        return request_id

    def abort(self, request_id: int) -> None:
        with self._lock:
            self._aborts.add(request_id)
            self._lock.notify()

    def snapshot(self) -> Snapshot:
        with self._lock:
            pages = self.generator.config.num_pages
            free = len(self.generator.free_pages)
            pool = PoolSnapshot(worker=POOL_NAME, pages=pages, free=free, held=pages - free,
                                tombstoned=0, writes_in_flight=0)
            recent = tuple(RequestSnapshot(live.request_id, live.outcome, tuple(live.timeline))
                           for live in self._recent)
            return Snapshot(pools=(pool,), queued=len(self._inbox) + len(self._waiting),
                            running=len(self._prefilling) + len(self._running), recent=recent,
                            guard_trips=dict(self._guards), refusals={},
                            rejects=dict(self._rejects), outcomes=dict(self._outcomes))

    def stop(self, drain_s: float = 0.0) -> None:
        deadline = time.monotonic() + drain_s
        with self._lock:
            self._accepting = False
            while self._live and time.monotonic() < deadline:
                self._lock.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            self._aborts.update(self._live)
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        assert not self._live, "the stand-in stopped with live requests"
        free = len(self.generator.free_pages)
        assert free == self.generator.config.num_pages, f"pool not whole: {free} free"

    # ---- the loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._aborts or self._stopping or self._waiting
                           or self._prefilling or self._running):
                    self._lock.wait()
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                aborts, self._aborts = self._aborts, set()
                if self._stopping and not self._live and not aborts:
                    return
            self._abort(aborts)
            try:
                self._step()
            except Exception as error:  # an engine bug: fail what is admitted, loudly
                self._fail_admitted(error)

    def _fail_admitted(self, error: Exception) -> None:
        """A step raised: every admitted request ends ErrDecode (a 500 the tests see), its
        pages given back, and the loop goes on for the others."""
        import traceback

        traceback.print_exc()
        admitted = {s.request.request_id: s for s in self._prefilling + self._running}
        for live in [live for live in self._live.values() if live not in self._waiting]:
            sequence = admitted.get(live.request_id)
            if sequence is not None:
                self._drop(sequence)
                live.sequence = sequence
            self._finish(live, "ErrDecode", None, None, detail=f"the step raised {error!r}")
        self.last_error = error

    def _step(self) -> None:
        """One round of Generator.run's loop over the queues kept between rounds."""
        done: dict = {}
        waiting = deque(Request(live.request_id, live.request.prompt_ids, live.request.sampling)
                        for live in self._waiting)
        generator = self.generator
        with self._lock:  # the free list is read by snapshot()
            generator._admit(waiting, self._prefilling, self._running, done)
        admitted = len(self._waiting) - len(waiting)
        for _ in range(admitted):
            live = self._waiting.popleft()
            live.timeline.append((self._now(), "Reserve"))
        for sequence in list(self._prefilling):
            live = self._live[sequence.request.request_id]
            if live.sequence is None and self.fail_at_admission:
                live.sequence = sequence
                self._drop(sequence)
                self._finish(live, self.fail_at_admission[0][0], None,
                             self.fail_at_admission.popleft()[1])
            live.sequence = sequence
        if self._prefilling:
            generator._prefill(self._prefilling, self._running, done, self._started)
        if self._running:
            generator._decode(self._running, done)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        for sequence in self._running:
            self._emit_tokens(self._live[sequence.request.request_id], final=False)
        for request_id, sequence in done.items():
            live = self._live[request_id]
            live.sequence = sequence
            self._emit_tokens(live, final=True)
            self._finish(live, *self._outcome_of(sequence.finish_reason))

    def _abort(self, request_ids: set) -> None:
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                continue  # finished already, or never ours: abort is idempotent
            sequence = live.sequence
            if live in self._waiting:
                self._waiting.remove(live)
            elif sequence is not None:
                self._drop(sequence)
            live.timeline.append((self._now(), "Abort"))
            self._finish(live, "Gone", None, None)

    def _drop(self, sequence) -> None:
        """Take an admitted sequence out of the loop and give its pages back."""
        for queue in (self._prefilling, self._running):
            if sequence in queue:
                queue.remove(sequence)
        with self._lock:
            self.generator.free_pages.give_back(sequence.pages)

    def _outcome_of(self, finish_reason: str) -> tuple[str, str | None, str | None]:
        """(outcome, finish_reason, guard) for a Generator finish reason."""
        if self.fail_next:
            outcome, guard = self.fail_next.popleft()
            return outcome, None, guard
        if finish_reason in ("stop", "length"):
            return "Ok", finish_reason, None
        if finish_reason == "tag_mismatch":
            return "ErrTag", None, "tag"
        return "ErrTooLong", None, None  # "rejected": submit's check makes this unreachable

    def _finish(self, live: _Live, outcome: str, finish_reason, guard,
                detail: str = "") -> None:
        sequence = live.sequence
        completion_tokens = len(sequence.output_ids) if sequence is not None else 0
        if outcome != "Gone":
            live.timeline.append((self._now(), "Finish"))
        if sequence is not None and sequence.pages:
            live.timeline.append((self._now(), "Release"))
        with self._lock:
            live.outcome = outcome
            self._outcomes[outcome] += 1
            if guard is not None:
                self._guards[guard] += 1
            del self._live[live.request_id]
            self._lock.notify_all()
        live.on_event(Finished(live.request_id, outcome, finish_reason, guard,
                               len(live.request.prompt_ids), completion_tokens,
                               detail=detail or ("injected by the test"
                                                 if outcome not in ("Ok", "Gone") else "")))

    def _emit_tokens(self, live: _Live, final: bool) -> None:
        """A TokenOut for every token the sequence gained, text held back while it could
        still become a stop string or an incomplete character."""
        sequence = live.sequence
        output = sequence.output_ids
        for index in range(live.emitted_tokens, len(output)):
            last = final and index == len(output) - 1
            text = self._visible_text(sequence, index + 1, last)
            delta = text[len(live.emitted_text):] if text.startswith(live.emitted_text) else ""
            live.emitted_text += delta
            logprob, top = self._logprobs(live, index)
            live.on_event(TokenOut(live.request_id, output[index], delta, logprob, top))
        live.emitted_tokens = len(output)

    def _visible_text(self, sequence, tokens: int, last: bool) -> str:
        if last and sequence.text is not None:
            return sequence.text  # cut before the stop string by the Generator
        text = self.tokenizer.decode(sequence.output_ids[:tokens])
        if last:
            return text
        text = text.rstrip("\ufffd")
        for stop in sequence.request.sampling.stop:
            for length in range(min(len(stop), len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    return text[:-length]
        return text

    def _logprobs(self, live: _Live, index: int):
        if live.request.logprobs is None or index >= len(live.sequence.logits):
            return None, ()
        logits = live.sequence.logits[index]
        live.sequence.logits[index] = None  # one row of the vocabulary per token: let it go
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        chosen = float(log_probs[live.sequence.output_ids[index]])
        if live.request.logprobs == 0:
            return chosen, ()
        values, ids = log_probs.topk(live.request.logprobs)
        return chosen, tuple(zip(ids.tolist(), values.tolist()))

    def _now(self) -> float:
        return time.perf_counter() - self._started


def build_engine(loaded, config=None) -> StandInEngine:
    """The stand-in under build_engine's name, for `kvproof serve --engine-factory`."""
    options = dict(config or {})
    if options.pop("disaggregated", False):
        raise NotImplementedError("the stand-in engine is a single process")
    options.pop("prefill_workers", None), options.pop("decode_workers", None)
    return StandInEngine(loaded, **options)


def build_engine_below_capacity(loaded, config=None):
    """A factory whose startup capacity check fails, as the real engine's does when a KV
    pool is smaller than the advertised context."""
    raise ValueError(f"decode-0's KV pool holds 64 tokens, below the advertised context "
                     f"({loaded.model.config.max_position_embeddings} tokens)")
