"""The protocol-driven engine as a fuzz target: real tensors, real page copies, real tags.

As on the simulator target, the engine's workers take the protocol's own actions
(engine/runtime.py: reserve, admit, compute, post, land, accept, decode, finish, release)
and the rules drive the environment:

- `Arrive`: a request arrives with the prompt length the fuzzer picks, in pages: the
  engine's request has (pages - 1) * PAGE_TOKENS + 1 prompt tokens and PAGE_TOKENS output
  tokens, so it reserves exactly that many decode pages and its decode steps go through the
  tag-checking kernel;
- `Abort`, `PrefillFail`, `Timeout`: a client goes away, a prefill fails, a transfer timer
  fires early, now;
- `Delay`: the request's page writes stay on the wire for a number of engine steps;
- `WireFault`: one write on the wire lands damaged, twice or late (fuzz/wire_faults.py);
- `Wait`: one engine step at a time until the core has accepted an event (time passes: when
  nothing but a transfer timer could move, the clock jumps to the earliest one).

The engine has no worker crashes, so crash moves are never listed (a model with crashes
only widens what may happen). Write landing order comes from the example's seed (the
transport shuffles the writes in flight, one landing per step).

The leak oracle is bit for bit (`Observation.reads`): when decode finishes a request, the
writer of each page it read is found by comparing the prompt positions' K/V in the decode
page with the K/V each request's own prefill computed for the same positions; a page
whose bytes match nobody's (never computed for anyone, or half overwritten) is read as
nobody's. Pages past the prompt hold only what decode wrote itself, and are the request's.
The model is a tiny random Llama (one layer, fp32) built in memory.
"""

from __future__ import annotations

import random

from spec import core
from spec.core import CLIENT_NAMES, OWNER, PST, RUNNING, SRC, TABLE
from spec.model import Model
from spec.properties import holds_decode_pages

from fuzz import wire_faults
from fuzz.target import (Delay, Observation, Open, PoolView, Target, TargetRefused, Violation,
                         Wait, decoding_reads, listed, register)

PAGE_TOKENS = 2
STEPS_PER_WAIT_MAX = 40  # engine steps one Wait may take before it must commit an event
# The lease and the transfer timeout, in engine steps (the clock is the step count): the
# runtime's own timers; early timeouts are the fuzzer's Timeout moves.
TIMEOUT_STEPS = (30, 8)
STALLS_STEPS = (1, 3, 10, 30)
_REQUEST_FAULTS = (core.Abort, core.PrefillFail, core.Timeout)
_MODEL_CACHE: dict = {}


def tiny_model(seed: int = 0):
    """A one-layer random Llama, fp32, on the CPU; built once per process."""
    if seed in _MODEL_CACHE:
        return _MODEL_CACHE[seed]
    import torch

    from engine.config import ModelConfig
    from engine.model import LlamaModel
    from engine.weights import Checkpoint

    config = ModelConfig(architecture="llama", hidden_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, intermediate_size=48, vocab_size=64,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.3
    h, q, kv = 32, 2 * 16, 16
    tensors = {"embed": rand(64, h), "output": rand(64, h), "final_norm": torch.ones(h),
               "layers.0.attention_norm": torch.ones(h), "layers.0.mlp_norm": torch.ones(h),
               "layers.0.q": rand(q, h), "layers.0.k": rand(kv, h), "layers.0.v": rand(kv, h),
               "layers.0.o": rand(h, q), "layers.0.gate": rand(48, h),
               "layers.0.up": rand(48, h), "layers.0.down": rand(h, 48)}
    model = _MODEL_CACHE[seed] = LlamaModel(Checkpoint(config, tensors, None, None))
    return model


@register("engine")
class EngineTarget(Target):
    """The protocol-driven engine (engine/runtime.py) on a tiny random model."""

    vocabulary = frozenset({"Arrive", "Abort", "PrefillFail", "Timeout", "Wait", "Delay",
                            wire_faults.ACTION})
    in_default_zoo = False

    def reset(self, model: Model, seed: int) -> None:
        import torch

        from engine.runtime import Runtime, RuntimeConfig

        self.model = model
        self._torch = torch
        rng = random.Random(f"kvproof-fuzz-engine:{seed}")
        self.timeout_steps = rng.choice(TIMEOUT_STEPS)
        self.clock = 0.0
        config = RuntimeConfig(
            prefill_pages=model.prefill_pages, decode_pages=model.decode_pages,
            page_tokens=PAGE_TOKENS, context_tokens=model.context_pages * PAGE_TOKENS,
            max_batch=8, prefill_chunk_tokens=8 * PAGE_TOKENS,
            lease_s=float(self.timeout_steps), transfer_timeout_s=float(self.timeout_steps),
            bugs=model.bugs,
            transport_seed=seed, lands_per_step=1, keep_kv=True)
        self.rt = Runtime(tiny_model(), config, clock=lambda: self.clock)
        self.rt.store.settled_rows = {}
        self.rt.on_commit = self._committed
        self.wire = wire_faults.WireFaults(self.rt)
        self._warm_pools()
        self.held: dict[int, float] = {}  # request -> clock until which its writes wait
        self.rt.transport.hold = lambda w: self.held.get(w.request, -1.0) > self.clock
        self._prompts = tuple(range(1, model.max_prompt_pages + 1))
        self._tokens_rng = random.Random(f"kvproof-fuzz-engine-prompts:{seed}")
        self._trace: list[core.Event] = []
        self._story: list[str] = []
        self._reads: dict[int, tuple[int, ...]] = {}
        self._committed_count = 0
        self._stalled = False
        self._moves: dict | None = None
        self._state: core.State | None = None
        self.timing = {"transfer_timeout_steps": self.timeout_steps, "transport_seed": seed}

    def _warm_pools(self) -> None:
        """Start from the spec's initial state: every decode page tagged with generation 0,
        as if written once before, not with the fresh pool's FRESH_TAG. A served pool is
        warm after its first minutes; a fresh tag would stop a never-written page's read
        on its own and hide, on the few pages still fresh, the bugs a missing generation
        bump lets through (the incident, the late write), which the core's model reaches."""
        from engine.workers import page_tag

        for worker in self.rt.decodes:
            pages = worker.pool.config.num_pages
            worker.pool.set_tags(list(range(pages)), [page_tag(0)] * pages)

    def describe(self) -> str:
        return "engine: " + ", ".join(f"{k} {v}" for k, v in self.timing.items())

    def holding(self) -> bool:
        return any(until > self.clock for until in self.held.values())

    # -- moves ----------------------------------------------------------------------------

    def enabled(self) -> dict[str, list]:
        if self._moves is None:
            self._moves = self._list_moves()
        return self._moves

    def _list_moves(self) -> dict[str, list]:
        rt, m = self.rt, self.model
        moves: dict[str, list] = {}
        if rt.next_id < m.requests:
            moves["Arrive"] = [Open("Arrive", rt.next_id, 0, self._prompts)]
        on_wire = {w.request for w in rt.transport.writes_of_all()}
        for r in sorted(rt.store.rows):
            for cls in _REQUEST_FAULTS:
                event = cls(r)
                if type(rt.store.decide(r, event)) is not core.Refusal:
                    moves.setdefault(cls.__name__, []).append(event)
            if r in on_wire and self.held.get(r, -1.0) <= self.clock:
                moves.setdefault("Delay", []).append(Open("Delay", r, 0, STALLS_STEPS))
        if not rt.idle and not self._stalled:
            moves["Wait"] = [Wait()]
        moves.update(self.wire.moves())
        return moves

    def step(self, event: core.Event) -> None:
        moves = self.enabled().get(event.action, ())
        if not listed(event, moves):
            raise TargetRefused(f"{event} is not enabled in the engine now")
        self._trace.append(event)
        self._moves = self._state = None
        self._stalled = False
        self._story.append(f"{'':10}fuzzer: {event.label(self.model)}")
        cls, rt = type(event), self.rt
        if cls is Wait:
            self._wait()
        elif cls is core.Arrive:
            self._arrive(event.prompt_pages)
        elif cls is Delay:
            self.held[event.request] = self.clock + event.stall
        elif cls is core.Abort:
            rt.abort(event.request)
        elif cls is wire_faults.WireFault:
            self.wire.inject(event)
        else:
            rt.take(event.request, event)

    def _arrive(self, pages: int) -> None:
        from engine.sampling import SamplingParams
        from engine.service import GenerationRequest

        tokens = (pages - 1) * PAGE_TOKENS + 1
        prompt = tuple(self._tokens_rng.randrange(64) for _ in range(tokens))
        request = GenerationRequest(prompt, SamplingParams(max_tokens=PAGE_TOKENS,
                                                           ignore_eos=True))
        self.rt.arrive(request, lambda event: None)

    def _wait(self) -> None:
        before = self._committed_count
        for _ in range(STEPS_PER_WAIT_MAX):
            self.clock += 1.0
            self.rt.step()
            if self._committed_count != before or self.rt.idle:
                return
        if self.rt.timers:  # only a timer can move the protocol on: its time comes
            self.clock = max(self.clock, min(self.rt.timers.values()))
            self.rt.step()
        if self._committed_count == before:
            self._stalled = True  # nothing moves until the fuzzer injects something

    def _committed(self, event: core.Event, change: core.Change) -> None:
        EngineTarget.events_committed += 1
        self._committed_count += 1
        self._story.append(f"{self.clock:8.0f}  {event.label(self.model)}")
        if type(event) is core.Finish and event.request in self.rt.live:
            self._reads[event.request] = self._writers(event.request)

    def _writers(self, r: int) -> tuple[int, ...]:
        """Who wrote each page decode read for r, from the bytes (the module header)."""
        rt = self.rt
        live = rt.live[r]
        prompt_tokens = len(live.request.prompt_ids)
        read = rt.read_kv.get(r)
        writers = []
        for i, (page, _) in enumerate(rt.store.rows[r][TABLE]):
            start, end = i * PAGE_TOKENS, min((i + 1) * PAGE_TOKENS, prompt_tokens)
            if start >= prompt_tokens:
                writers.append(r)
                continue
            if read is None:  # decode never read (a tag failure before any step)
                writers.append(core.NONE)
                continue
            writers.append(self._writer_of(r, i, read[start:end]))
        return tuple(writers)

    def _writer_of(self, r: int, index: int, rows) -> int:
        """The request whose prefill computed exactly these K/V rows into some page of its
        own: r itself at this page of its table first (two prompts with the same first
        tokens have the same K/V there, and bytes equal to its own are its own), then any
        page of any request (a stale page keeps what its last writer put there)."""
        torch, n = self._torch, rows.shape[0]
        own = self.rt.prompt_kv.get(r)
        start = index * PAGE_TOKENS
        if own is not None and own.shape[0] >= start + n \
                and torch.equal(own[start:start + n], rows):
            return r
        for w, kv in self.rt.prompt_kv.items():
            for first in range(0, kv.shape[0] - n + 1, PAGE_TOKENS):
                if torch.equal(kv[first:first + n], rows):
                    return w
        return core.NONE

    # -- what the fuzzer checks -------------------------------------------------------------

    def _rows(self) -> tuple:
        rows, settled = self.rt.store.rows, self.rt.store.settled_rows
        return tuple(rows.get(r) or settled.get(r) or core.EMPTY_ROW
                     for r in range(self.model.requests))

    def protocol_state(self) -> core.State:
        if self._state is None:
            store = self.rt.store
            self._state = core.State(self._rows(), tuple(store.decode_pools[0]),
                                     tuple(store.prefill_pools[0]),
                                     tuple(sorted(store.writes_into[0])))
        return self._state

    def observe(self) -> Observation:
        store, rows = self.rt.store, self.protocol_state().requests
        decode_free, prefill_free = set(store.decode_free[0]), set(store.prefill_free[0])
        decode = PoolView(
            "decode", tuple(core.NONE if p in decode_free else page[OWNER]
                            for p, page in enumerate(store.decode_pools[0])),
            tuple(tuple(p for p, _ in row[TABLE]) if holds_decode_pages(row) else ()
                  for row in rows))
        prefill = PoolView(
            "prefill", tuple(core.NONE if p in prefill_free else page[0]
                             for p, page in enumerate(store.prefill_pools[0])),
            tuple(row[SRC] if row[PST] == RUNNING else () for row in rows))
        return Observation(
            pools=(prefill, decode),
            writes=tuple((w.request, w.decode_page) for w in self.rt.transport.writes_of_all()),
            outcomes=tuple(CLIENT_NAMES[row[core.CLIENT]] for row in rows),
            reads=dict(self._reads), decoding=decoding_reads(rows, store.decode_pools[0]))

    def check(self) -> list[Violation]:
        return [Violation(v.property, f"engine store oracle: {v.detail}")
                for v in self.rt.store.violations] + self.wire.check()

    def data_faulted(self) -> frozenset[int]:
        return self.wire.damaged()

    def trace(self) -> list[core.Event]:
        return list(self._trace)

    def story(self) -> list[str]:
        return list(self._story)
