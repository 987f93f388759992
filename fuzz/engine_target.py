"""The protocol-driven engine as a fuzz target: real tensors, real page copies, real tags.

As on the simulator target, the engine's workers take the protocol's own actions
(engine/runtime.py: reserve, admit, compute, post, land, accept, decode, finish, release)
and the rules drive the environment:

- `Arrive`: a request arrives needing the number of decode pages the fuzzer picks
  (prompt + max_tokens - 1 tokens, the core's page count); how they split between prompt
  and output is drawn from the example's seed: prompt-heavy (one or two output tokens),
  output-heavy (a prompt of a page or less and a decode step per token after it) or
  anywhere between, so prompts end and decode steps cross pages at every offset, and
  with prefill chunks of 3, 5 or 16 tokens (per example) chunks end mid-page;
- `Abort`, `PrefillFail`, `Timeout`: a client goes away, a prefill fails, a transfer timer
  fires early, now;
- `Delay`: the request's page writes stay on the wire for a number of engine steps;
- `WireFault`: one write on the wire lands damaged, twice or late (fuzz/wire_faults.py);
- `Wait`: one engine step at a time until the core has accepted an event, or for up to
  STEPS_PER_WAIT_MAX steps while decode runs (a long output decodes for many steps without
  an event); time passes: when nothing but a transfer timer could move, the clock jumps to
  the earliest one.
- with a prefix cache (the model's; the Runtime runs with decode's cache, and the prefill's
  when the model has it): an Arrive's prompt is built from its token kinds (fuzz/machine.py
  `arrival`, the core and sim targets' draw): each page the prompt fills is its kind's
  block of token ids (PAGE_BLOCKS), so two prompts share their KV exactly as far as their
  kinds agree, and a partial last page is the request's own; its salt is the request's
  `cache_salt`. `Evict` and `PrefillEvict` forget a cached page the store lists
  (`idle_cached`, `prefill_evictable`: the core decides which). A model without a cache
  draws exactly what it drew before.

The engine has no worker crashes, so crash moves are never listed (a model with crashes
only widens what may happen). Write landing order comes from the example's seed (the
transport shuffles the writes in flight, one landing per step).

The engine is built as `build_engine` builds it: its context and pools come from the
startup capacity check (engine/serving.py `advertised_context`, lowering the context to
what every pool holds), and a request within what that check advertised (prompt +
max_tokens) must never be turned away as too long (reported as FittingRequestsSucceed).

The oracles share no paging code with the engine (fuzz/engine_reference.py): every decode
call's inputs and reads are recorded at the call (`DecodeRecorder` on each decode worker's
model), and judged against a plain-torch forward of the request's tokens alone (its
prompt and every token its client got): the context attended is exactly those tokens,
the block table and its tags are the core's reservation at the pages' current
generations, and the K/V at every position attended and the logits are the reference's
within a stated tolerance; the prefill's first token is judged by its logits. A token
computed from a read that fails is a violation as soon as it reaches the client, whatever
the request's outcome (reported under LeakOracle); so is a token with no recorded read
behind it. A page another request computed from the same tokens holds the reference's
K/V too, so sharing needs no exception. `Observation.reads` (the shared leak oracle's Ok
check) names each page of a finished request's last read by its bytes: its writer without
a cache (itself where the bytes are its reference's, else the request whose reference
holds exactly those bytes, else nobody), with one its content identity (its own page's
where the bytes are its reference's, whoever computed them). With a cache, conservation
counts the pages a request owns, not those it reads from either cache.
The model is a tiny random Llama (one layer, fp32) built in memory.
"""

from __future__ import annotations

import random

from spec import core
from spec.core import CLIENT_NAMES, GEN, OWNER, PST, RUNNING, SRC, TABLE
from spec.model import Model
from spec.properties import holds_decode_pages

from fuzz import wire_faults
from fuzz.oracles import LEAK_ORACLE
from fuzz.target import (Delay, Observation, Open, PoolView, Target, TargetRefused, Violation,
                         Wait, decoding_reads, expected_reads, listed, owned_pages,
                         owned_sources, register)

PAGE_TOKENS = 2
# Prefill chunk sizes, in tokens, one per example (from its seed): odd ones end chunks
# mid-page, so a chunk boundary and a page boundary fall apart.
CHUNK_TOKENS = (3, 5, 16)
MAX_BATCH = 8
STEPS_PER_WAIT_MAX = 40  # engine steps one Wait may take before it must commit an event
# The lease, in engine steps (the clock is the step count), and the transfer timeout after
# Admit, BACKSTOP_LEASES leases: the runtime's own timers; early timeouts are the fuzzer's
# Timeout moves. (A backstop of one lease timed out most long requests: a prompt in
# 3-token chunks, or 16 pages landing one a step, takes more than 8 steps.)
TIMEOUT_STEPS = (30, 8)
BACKSTOP_LEASES = 4
STALLS_STEPS = (1, 3, 10, 30)
# With a prefix cache, a prompt's real token ids: each page the prompt fills is the block of
# its abstract token kind (fuzz/machine.py `arrival`: b pages of kind 1, then kind 2), so
# two prompts whose kinds agree up to page k agree token for token up to there (and share
# those pages' KV: attention is causal); a partial last page is the request's own random
# tokens, as are the whole prompt's without a cache. Two blocks, as the core's models have
# two token kinds.
PAGE_BLOCKS = {1: (5, 17), 2: (42, 9)}
_REQUEST_FAULTS = (core.Abort, core.PrefillFail, core.Timeout)
_MODEL_CACHE: dict = {}
_TENSORS: list = []  # (weight tensors, config) of the tiny model: the reference's input


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
    if seed == 0:  # the reference's own copy of the weights (the engine fuses its own)
        _TENSORS[:] = [{k: t.clone() for k, t in tensors.items()}, config]
    return model


@register("engine")
class EngineTarget(Target):
    """The protocol-driven engine (engine/runtime.py) on a tiny random model."""

    # Evict: with a prefix cache, the fuzzer may make decode forget any idle cached page
    # now (the runtime's own LRU pick evicts under pool pressure besides); the swarm weighs
    # it only on models with a cache, so every other seed draws what it drew before.
    vocabulary = frozenset({"Arrive", "Abort", "PrefillFail", "Timeout", "Wait", "Delay",
                            wire_faults.ACTION, "Evict"})
    # PrefillEvict: with the prefill's cache too, any cached page its cache may evict now
    # (Store.prefill_evictable: the core says which; EvictWhileSending's cache picks pages
    # still read or sent from).
    prefill_cache_vocabulary = frozenset({"PrefillEvict"})
    in_default_zoo = False

    def reset(self, model: Model, seed: int) -> None:
        from engine.runtime import Runtime, RuntimeConfig
        from fuzz.engine_reference import DecodeRecorder

        self.model = model
        rng = random.Random(f"kvproof-fuzz-engine:{seed}")
        self.timeout_steps = rng.choice(TIMEOUT_STEPS)
        chunk_tokens = rng.choice(CHUNK_TOKENS)
        self.clock = 0.0
        self.context_tokens, prefill_pages, decode_pages = _startup(model)
        config = RuntimeConfig(
            prefill_pages=prefill_pages, decode_pages=decode_pages,
            page_tokens=PAGE_TOKENS, context_tokens=self.context_tokens,
            max_batch=MAX_BATCH, prefill_chunk_tokens=chunk_tokens,
            lease_s=float(self.timeout_steps),
            transfer_timeout_s=float(self.timeout_steps * BACKSTOP_LEASES),
            bugs=model.bugs, transport_seed=seed, lands_per_step=1,
            prefix_cache=model.prefix_cache, prefill_cache=model.prefill_cache)
        self.rt = Runtime(tiny_model(), config, clock=lambda: self.clock)
        self.rt.store.settled_rows = {}
        self.rt.on_commit = self._committed
        for worker in self.rt.decodes:
            worker.model = DecodeRecorder(worker, self._read)
        self.wire = wire_faults.WireFaults(self.rt)
        self._warm_pools()
        self.held: dict[int, float] = {}  # request -> clock until which its writes wait
        self.rt.transport.hold = lambda w: self.held.get(w.request, -1.0) > self.clock
        self._prompts = tuple(range(1, model.max_prompt_pages + 1))
        self._tokens_rng = random.Random(f"kvproof-fuzz-engine-prompts:{seed}")
        self._trace: list[core.Event] = []
        self._story: list[str] = []
        self._reads: dict[int, tuple[int, ...]] = {}
        # The client's side and the oracle's evidence (fuzz/engine_reference.py).
        self._prompt_ids: dict[int, tuple[int, ...]] = {}
        self._asked: dict[int, int] = {}  # request -> prompt + max_tokens
        self._tokens: dict[int, list[int]] = {}  # request -> tokens its client got
        self._outcomes: dict[int, str] = {}
        self._first: dict = {}  # request -> the prefill's logits, not judged yet
        self._pending: list = []  # DecodeReads not judged yet
        self._steps: dict[int, int] = {}  # request -> decode reads recorded
        self._last_read: dict = {}  # request -> its last DecodeRead
        self._tainted: dict[int, tuple[int, str]] = {}  # request -> (tokens before, why)
        self._references: dict = {}
        self._committed_count = 0
        self._stalled = False
        self._moves: dict | None = None
        self._state: core.State | None = None
        self.timing = {"transfer_timeout_steps": self.timeout_steps, "transport_seed": seed,
                       "chunk_tokens": chunk_tokens, "context_tokens": self.context_tokens}

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
        if self.model.prefix_cache and rt.store.idle_cached(0):
            moves["Evict"] = [core.Evict(0, p) for p in rt.store.idle_cached(0)]
        if self.model.prefill_cache and rt.store.prefill_evictable(0):
            moves["PrefillEvict"] = [core.PrefillEvict(0, p)
                                     for p in rt.store.prefill_evictable(0)]
        return moves

    def step(self, event: core.Event) -> None:
        from fuzz.engine_reference import one_torch_thread

        with one_torch_thread():
            self._step(event)

    def _step(self, event: core.Event) -> None:
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
            self._arrive(event)
        elif cls is core.Evict:
            if not rt.evict(event.worker, event.page):
                raise TargetRefused(f"the core refused {event.label(self.model)}, listed")
        elif cls is core.PrefillEvict:
            if not rt.prefill_evict(event.worker, event.page):
                raise TargetRefused(f"the core refused {event.label(self.model)}, listed")
        elif cls is Delay:
            self.held[event.request] = self.clock + event.stall
        elif cls is core.Abort:
            rt.abort(event.request)
        elif cls is wire_faults.WireFault:
            self.wire.inject(event)
        else:
            rt.take(event.request, event)

    def _arrive(self, event: core.Arrive) -> None:
        """A request of the Arrive's pages; with a prefix cache, its prompt built from the
        Arrive's token kinds (`prompt_ids`) and its salt the Arrive's."""
        from engine.sampling import SamplingParams
        from engine.service import GenerationRequest

        rng = self._tokens_rng
        prompt_tokens, max_tokens = request_shape(rng, event.prompt_pages)
        prompt = prompt_ids(rng, prompt_tokens, event.tokens if self.model.prefix_cache else ())
        request = GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens,
                                                           ignore_eos=True),
                                    cache_salt=event.salt if self.model.prefix_cache else 1)
        r = self.rt.next_id
        self._prompt_ids[r] = prompt
        self._asked[r] = len(prompt) + max_tokens
        self.rt.arrive(request, self._client(r))

    def _wait(self) -> None:
        before = self._committed_count
        decoding = False  # a long output decodes for more steps than one Wait takes
        for _ in range(STEPS_PER_WAIT_MAX):
            self.clock += 1.0
            decoding = self.rt.step() and any(w.running for w in self.rt.decodes)
            if self._committed_count != before or self.rt.idle:
                return
        if self.rt.timers and not decoding:  # only a timer can move the protocol on
            self.clock = max(self.clock, min(self.rt.timers.values()))
            self.rt.step()
        if self._committed_count == before and not decoding:
            self._stalled = True  # nothing moves until the fuzzer injects something

    def _committed(self, event: core.Event, change: core.Change) -> None:
        EngineTarget.events_committed += 1
        self._committed_count += 1
        self._story.append(f"{self.clock:8.0f}  {event.label(self.model)}")
        if type(event) is core.Finish and event.request in self.rt.live:
            self._reads[event.request] = self._writers(event.request)

    # -- the client's side and the decode kernel's reads (fuzz/engine_reference.py) -------

    def _client(self, r: int):
        from engine.service import Finished

        def on_event(event) -> None:
            if isinstance(event, Finished):
                self._outcomes[r] = event.outcome
                return
            tokens = self._tokens.setdefault(r, [])
            if not tokens:  # the prefill's token: judged against the prompt's logits
                self._first[r] = self.rt.live[r].first[1].float().clone()
            tokens.append(event.token_id)
        return on_event

    def _read(self, r: int, fields: dict) -> None:
        """The decode kernel's read for r, recorded at the call (DecodeRecorder)."""
        from fuzz.engine_reference import DecodeRead

        store = self.rt.store
        reserved = store.rows[r][TABLE]
        pool = store.decode_pools[store.placement[r][1]]
        steps = self._steps.get(r, 0)
        self._steps[r] = steps + 1
        self._pending.append(DecodeRead(
            request=r, step=steps, tokens_seen=len(self._tokens.get(r, ())),
            reserved=tuple(reserved), generations_now=tuple(pool[p][GEN] for p, _ in reserved),
            idents=core.tag_idents(store.model, store.rows[r]), **fields))

    def _tokens_of(self, r: int) -> tuple[int, ...]:
        """What request r has: its prompt and every token its client got."""
        return self._prompt_ids[r] + tuple(self._tokens.get(r, ()))

    def _reference(self, r: int):
        """The reference's K/V and logits of r's tokens (fuzz/engine_reference.py)."""
        from fuzz.engine_reference import forward

        tokens = self._tokens_of(r)
        cached = self._references.get(r)
        if cached is None or cached[0] != tokens:
            cached = self._references[r] = (tokens, *forward(*_TENSORS, tokens))
        return cached[1], cached[2]

    def _judge_pending(self) -> None:
        """Judge every read and first token recorded since the last check; a read that is
        wrong taints the token its step computed (what `_findings` looks for)."""
        from engine.workers import page_tag
        from fuzz.engine_reference import judge, judge_bytes

        for r, logits in self._first.items():
            kv, reference = self._reference(r)
            n = len(self._prompt_ids[r])
            wrong = judge_bytes(kv[:0], logits, kv, reference, position=n - 1)
            if wrong is not None:
                self._tainted.setdefault(r, (0, f"its first token (the prefill's): {wrong}"))
        self._first.clear()
        for read in self._pending:
            r = read.request
            kv, logits = self._reference(r)
            tokens = self._tokens_of(r)[:len(self._prompt_ids[r]) + read.tokens_seen]
            wrong = judge(read, tokens, kv, logits, page_tag)
            self._last_read[r] = read
            if wrong is not None and r not in self._tainted:
                self._tainted[r] = (read.tokens_seen, f"decode step {read.step + 1}: {wrong}")
        self._pending.clear()

    def _findings(self) -> list[Violation]:
        """A token computed from a read the reference refuses reached the client (whatever
        the request's outcome); a token reached it with no read behind it; a request the
        startup check advertised as fitting was turned away as too long."""
        self._judge_pending()
        found = []
        for r, (seen, why) in self._tainted.items():
            got = len(self._tokens.get(r, ()))
            if got > seen:
                found.append(Violation(LEAK_ORACLE, (
                    f"engine read oracle: {self.model.request_names[r]} streamed token "
                    f"{seen + 1} (of {got}, outcome {self._outcomes.get(r, 'none yet')}) "
                    f"computed from a wrong read: {why}")))
        for r, tokens in self._tokens.items():
            if len(tokens) > 1 + self._steps.get(r, 0):
                found.append(Violation(LEAK_ORACLE, (
                    f"engine read oracle: {self.model.request_names[r]} got {len(tokens)} "
                    f"tokens from {self._steps.get(r, 0)} decode reads and one prefill")))
        for r, outcome in self._outcomes.items():
            if outcome == "ErrTooLong" and self._asked[r] <= self.context_tokens:
                found.append(Violation("FittingRequestsSucceed", (
                    f"engine startup check: it advertised {self.context_tokens} tokens of "
                    f"context, and {self.model.request_names[r]} (prompt + max_tokens = "
                    f"{self._asked[r]}) was refused as too long")))
        return found

    def _writers(self, r: int) -> tuple:
        """What each page of r's table held as decode last read it, judged by its bytes
        alone. Without a prefix cache, its writer: r where the bytes are the reference's for
        r's tokens (and on pages never read), else the request whose reference has exactly
        these bytes on some page, else nobody. With one, pages are shared, so its content
        identity (core.true_ident: salt and tokens up to the page): r's own page's where the
        bytes are r's reference's (whoever computed them: a page another request with the
        same prefix computed is r's own), else that of the page of another request whose
        reference holds them, else nothing."""
        from fuzz.engine_reference import judge_bytes

        self._judge_pending()
        row = self.rt.store.rows[r]
        table, cached = row[TABLE], self.model.prefix_cache
        read = self._last_read.get(r)
        kv = self._reference(r)[0] if read is not None else None
        found = []
        for i in range(len(table)):
            own = core.true_ident(row, i + 1) if cached else r
            # decode never read (its one token came from the prefill), or not this page
            start = i * PAGE_TOKENS
            end = min((i + 1) * PAGE_TOKENS, read.context) if read is not None else start
            if start >= end:
                found.append(own)
                continue
            rows = read.kv[start:end]
            if end <= kv.shape[0] and judge_bytes(rows, None, kv[start:end], None) is None:
                found.append(own)
                continue
            w, page = self._writer_of(rows)
            found.append(w if not cached else () if w == core.NONE else
                         core.true_ident(self._rows()[w], page + 1))
        return tuple(found)

    def _writer_of(self, rows) -> tuple[int, int]:
        """The request whose reference holds exactly these rows at the start of one of its
        pages (a page moves whole, so its rows keep their offsets), and that page; or
        (nobody, -1)."""
        from fuzz.engine_reference import judge_bytes

        for w in sorted(self._prompt_ids):
            kv, _ = self._reference(w)
            for first in range(0, kv.shape[0] - rows.shape[0] + 1, PAGE_TOKENS):
                if judge_bytes(rows, None, kv[first:first + rows.shape[0]], None) is None:
                    return w, first // PAGE_TOKENS
        return core.NONE, -1

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
        # With a prefix cache the pages a request reads from either cache are shared, owned
        # by nobody: a request holds (for conservation) only the pages it owns.
        store, rows = self.rt.store, self.protocol_state().requests
        decode_pool, prefill_pool = store.decode_pools[0], store.prefill_pools[0]
        decode_free, prefill_free = set(store.decode_free[0]), set(store.prefill_free[0])
        decode = PoolView(
            "decode", tuple(core.NONE if p in decode_free else page[OWNER]
                            for p, page in enumerate(decode_pool)),
            tuple(owned_pages(row, decode_pool, r) if holds_decode_pages(row) else ()
                  for r, row in enumerate(rows)))
        prefill = PoolView(
            "prefill", tuple(core.NONE if p in prefill_free else page[0]
                             for p, page in enumerate(prefill_pool)),
            tuple(owned_sources(row, prefill_pool, r) if row[PST] == RUNNING else ()
                  for r, row in enumerate(rows)))
        return Observation(
            pools=(prefill, decode),
            writes=tuple((w.request, w.decode_page) for w in self.rt.transport.writes_of_all()),
            outcomes=tuple(CLIENT_NAMES[row[core.CLIENT]] for row in rows),
            reads=dict(self._reads), decoding=decoding_reads(rows, decode_pool, self.model),
            expected=expected_reads(self.model, rows))

    def check(self) -> list[Violation]:
        from fuzz.engine_reference import one_torch_thread

        with one_torch_thread():
            found = self._findings()
        return found + [Violation(v.property, f"engine store oracle: {v.detail}")
                        for v in self.rt.store.violations] + self.wire.check()

    def data_faulted(self) -> frozenset[int]:
        return self.wire.damaged()

    def trace(self) -> list[core.Event]:
        return list(self._trace)

    def story(self) -> list[str]:
        return list(self._story)


def prompt_ids(rng: random.Random, tokens: int, kinds: tuple[int, ...]) -> tuple[int, ...]:
    """A prompt of `tokens` token ids: the page block of each page's kind (PAGE_BLOCKS) for
    every page the prompt fills, then random ids; without kinds (no prefix cache) all random,
    drawn exactly as before the cache existed."""
    full = min(tokens // PAGE_TOKENS, len(kinds))
    shared = tuple(t for kind in kinds[:full] for t in PAGE_BLOCKS[kind])
    return shared + tuple(rng.randrange(64) for _ in range(tokens - len(shared)))


def request_shape(rng: random.Random, pages: int) -> tuple[int, int]:
    """(prompt tokens, max_tokens) of a request that needs exactly `pages` decode pages,
    split one of three ways, drawn: prompt-heavy (one or two output tokens), output-heavy
    (a prompt of a page or less, many decode steps) or anywhere between; so prompts end,
    and decode steps cross pages, at every offset."""
    stored = rng.randint((pages - 1) * PAGE_TOKENS + 1, pages * PAGE_TOKENS)  # K/V kept
    shape = rng.randrange(3)
    if shape == 0:
        max_tokens = rng.randint(1, min(2, stored))
    elif shape == 1:
        max_tokens = stored + 1 - rng.randint(1, min(PAGE_TOKENS, stored))
    else:
        max_tokens = rng.randint(1, stored)
    return stored + 1 - max_tokens, max_tokens


def _startup(model: Model) -> tuple[int, int, int]:
    """(context tokens, prefill pages, decode pages) as the engine's startup check
    (engine/serving.py `advertised_context`, what `build_engine` runs) sets them for the
    example's pools and context: lowered to what every pool holds, unless the
    PoolBelowContext switch turns the check off."""
    from engine.serving import EngineConfig, advertised_context

    config = EngineConfig(context_length=model.context_pages * PAGE_TOKENS,
                          lower_context_to_fit=True, page_tokens=PAGE_TOKENS,
                          prefill_pool_tokens=model.prefill_pages * PAGE_TOKENS,
                          decode_pool_tokens=model.decode_pages * PAGE_TOKENS,
                          max_batch=MAX_BATCH, bugs=model.bugs)
    context = advertised_context(config, model.context_pages * PAGE_TOKENS)
    return context, config.prefill_pages, config.decode_pages

