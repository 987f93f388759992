"""The engine as a server sees it: submit a request, receive its tokens and its outcome,
abort it, look at the pools. This module is the contract between engine/ (which
implements it over protocol-driven prefill and decode workers) and api/ (which serves it
over HTTP); it holds types only, no behaviour.

Threading. An engine runs its workers' loop on one background thread of its own
(`start()`); `submit` and `abort` may be called from any thread and never block on model
work. A request's events reach its `on_event` callback on the engine's thread, in order:
zero or more `TokenOut`, then exactly one `Finished`, then nothing. A server bridges them
into asyncio with `loop.call_soon_threadsafe`.

Outcomes. `Finished.outcome` is the protocol core's final client state for the request
(spec/core.py CLIENT_NAMES: "Ok", "Gone", "ErrTooLong", "ErrPrefill", "ErrTransfer",
"ErrTag", "ErrTimeout", "ErrDecode"), never a separate judgement of the engine's: the one
mapping from outcome to HTTP answer lives in api/.

Refusals before anything is allocated are exceptions of `submit`: `ContextTooLong` (the
prompt plus max_tokens exceed the advertised context: an HTTP 400), `Overloaded` (the
bounded admission queue is full: an HTTP 503 with Retry-After), `EngineStopped`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from engine.sampling import SamplingParams

OUTCOMES = ("Ok", "Gone", "ErrTooLong", "ErrPrefill", "ErrTransfer", "ErrTag", "ErrTimeout",
            "ErrDecode")
GUARDS = ("count", "checksum", "tag")
DEFAULT_TENANT = "default"  # the tenant of a request its server names none for (no API keys)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k
    # The prefix cache's salt (engine/prefix.py, 1..SALT_MAX): only requests of one salt
    # share cached pages. A server derives it from the tenant and the request's cache_salt.
    cache_salt: int = 1
    # n > 1 completions of one prompt (OpenAI's n): one number for the body's prompt, the
    # same in each of its choices. With a prefix cache they are siblings (spec/README.md,
    # "n > 1 siblings"): placed on the first's workers, each waiting for its transfer, so
    # the prompt is computed, sent and held once. None: a request of its own.
    sibling_group: int | None = None
    # Who the request is for, as a label of the prefix cache's figures (Snapshot.
    # prefix_tenants) and nothing else: the salt above decides what is shared. A server sets
    # it from its own configuration (api/serve/auth.py: one name per API key), never from
    # a client's word, so that the labels stay as few as the keys.
    tenant: str = DEFAULT_TENANT


@dataclass(frozen=True)
class TokenOut:
    request_id: int
    token_id: int
    text: str  # the text this token adds (stop strings already cut; may be "")
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Finished:
    request_id: int
    outcome: str  # one of OUTCOMES: the core's final client state
    finish_reason: str | None  # "stop" or "length" when outcome == "Ok", else None
    guard: str | None  # which runtime guard tripped (one of GUARDS), when one did
    prompt_tokens: int
    completion_tokens: int
    detail: str = ""  # one line for the operator (what the core refused, which guard)
    # Prompt tokens served from a prefix cache: with the prefill's cache, those whose KV the
    # prefill read from it instead of computing (OpenAI's cached_tokens); with decode's
    # alone, those decode read from its cache instead of receiving them.
    cached_tokens: int = 0


Event = TokenOut | Finished


class Refused(Exception):
    """submit refused the request before anything was allocated."""


class ContextTooLong(Refused):
    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int):
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.context_length = context_length
        super().__init__(f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                         f"exceeds the context length ({context_length})")


class Overloaded(Refused):
    def __init__(self, queued: int, retry_after_s: float):
        self.queued, self.retry_after_s = queued, retry_after_s
        super().__init__(f"{queued} requests already queued; retry in {retry_after_s:g} s")


class EngineStopped(Refused):
    pass


class Unsupported(Refused):
    """The request asks for what this engine cannot do yet (an HTTP 400 naming it)."""


@dataclass(frozen=True)
class PoolSnapshot:
    worker: str  # "prefill-0", "decode-0", ...
    pages: int
    free: int
    held: int
    tombstoned: int
    writes_in_flight: int
    # The pool's prefix cache (decode's, or the prefill's): pages filed under a key (read
    # or idle), and those nobody reads (counted in `free`: an allocation evicts them).
    cached: int = 0
    cached_idle: int = 0


@dataclass(frozen=True)
class RequestSnapshot:
    request_id: int
    outcome: str | None  # None while live
    timeline: tuple[tuple[float, str], ...]  # (seconds since engine start, protocol event)


@dataclass(frozen=True)
class Snapshot:
    pools: tuple[PoolSnapshot, ...]
    queued: int
    running: int
    recent: tuple[RequestSnapshot, ...]  # newest last, bounded
    queued_tokens: int = 0  # prompt tokens of the queued requests (admission bounds them)
    guard_trips: dict = field(default_factory=dict)  # guard -> count
    refusals: dict = field(default_factory=dict)  # core refusal reason -> count
    rejects: dict = field(default_factory=dict)  # reject reason (too long, capacity) -> count
    outcomes: dict = field(default_factory=dict)  # final outcome -> count
    transfers: int = 0  # page writes landed
    transfer_bytes: int = 0
    # Serving with worker processes (engine/process_engine.py): one dict per process, its
    # name, role, pid, liveness and pool occupancy; empty in process.
    workers: tuple = ()
    # Decode's prefix cache (engine/prefix.py), counters since start: the full prompt pages
    # of the requests decode reserved for (`reserved_prompt_pages`: what a cache can hit),
    # the pages it found cached (`hit_pages`), and the pages it evicted, under pool pressure
    # (`evicted_lru_pages`) or as no prompt can hit them (`evicted_unshareable_pages`).
    # Empty without a cache.
    prefix: dict = field(default_factory=dict)
    # The prefill's prefix cache, the same counters (`admitted_prompt_pages` where decode's
    # has reserved_prompt_pages; a hit is a page not computed) and `computed_tokens`, the
    # prompt tokens the prefill ran through the model. Empty without it.
    prefill_cache: dict = field(default_factory=dict)
    # The runtime guard trips (by guard) of requests that read shared pages: a hit at
    # decode's cache or at the prefill's. Empty without a cache.
    prefix_shared_guard_trips: dict = field(default_factory=dict)
    # Each tenant's figures (GenerationRequest.tenant -> TenantCache), for the tenants whose
    # prompts a cache looked up since start. Empty without a cache.
    prefix_tenants: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TenantCache:
    """One tenant's prefix-cache counters since start, decode's and the prefill's (as in
    Snapshot.prefix and prefill_cache), and its requests that read shared pages and
    tripped a guard. Frozen: the runtime replaces a tenant's, a published one never moves."""

    prompt_pages: int = 0  # full prompt pages decode looked up
    hit_pages: int = 0  # of those, found cached
    prefill_prompt_pages: int = 0  # full prompt pages the prefill looked up
    prefill_hit_pages: int = 0  # of those, found cached (not computed)
    shared_guard_trips: int = 0


class Engine(Protocol):
    model_name: str
    context_length: int  # the advertised context (the startup capacity check holds it)
    tokenizer: object  # engine.tokenizer.Tokenizer

    def start(self) -> None: ...

    def submit(self, request: GenerationRequest,
               on_event: Callable[[Event], None]) -> int:
        """The request's id; raises a Refused subclass before allocating anything."""

    def abort(self, request_id: int) -> None:
        """The client is gone: abort through the protocol (idempotent, any thread)."""

    def snapshot(self) -> Snapshot: ...

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop taking requests; let live ones finish for up to drain_s, abort the rest
        through the protocol, and return once every pool is whole again."""
