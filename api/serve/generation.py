"""Serving one generation request: submit its choices, gather or stream their tokens, and
answer with exactly what the engine finished — or an error.

Theory of operation. A validated request becomes a `Plan` (prompt token ids, one
SamplingParams per choice); every choice is submitted before anything is answered, and a
refusal of any (raised by submit before allocating) aborts those already submitted and
answers with the refusal's error. Then:
- whole answers wait for every choice's Finished; one error outcome makes the whole answer
  that error (the other choices are aborted): a partial success is never a 200.
- streams wait for the first event before sending headers, so a request that fails before
  its first token (a guard trip in prefill, a transfer timeout) still gets its real HTTP
  status. After the first token the status is sent; a later error outcome is sent as an
  OpenAI error event and the stream ends without `[DONE]` and without a finish_reason, so
  no client reads it as a success.
Every exit (answer, error, client gone, cancellation) runs `Choices.abort_unfinished` in a
`finally`: one abort per choice still live, none for one already finished.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

from engine.sampling import SamplingParams
from engine.prefix import DEFAULT_SALT, salt_of
from engine.service import DEFAULT_TENANT, Finished, GenerationRequest, Refused, TokenOut

from api.serve.bridge import Choices, unless_disconnected
from api.serve.errors import ApiError, outcome_error, refusal_error
from api.serve.wire import sse, usage

INT64_MAX = (1 << 63) - 1
# Below this a temperature is greedy: dividing logits by 1e-300 overflows them to inf and
# the engine's sampler has no distribution left to draw from (engine/sampling.py raises).
GREEDY_BELOW_TEMPERATURE = 1e-5
# A top_p of 5e-324 is 0 in fp32 and the sampler then masks every token (the same raise);
# any top_p this small keeps only the most likely token, so it is raised to this floor.
TOP_P_FLOOR = 1e-6
CLIENT_CLOSED_STATUS = 499  # nginx's: nobody reads it, the access log does


_SIBLING_GROUPS = itertools.count(1)  # a number per prompt with n > 1 choices


@dataclass(frozen=True)
class Plan:
    prompts: tuple[tuple[int, ...], ...]
    n: int
    sampling: tuple[SamplingParams, ...]  # one per choice: prompt-major, then n
    logprobs: int | None
    stream: bool
    include_usage: bool
    prompt_param: str  # the request field the prompt came from ("prompt" / "messages")
    cache_salt: int = DEFAULT_SALT  # the prefix cache's salt (`salt_for`)
    tenant: str = DEFAULT_TENANT  # the API key's (`tenant_for`): a metric label only

    def requests(self) -> list[GenerationRequest]:
        """One engine request per choice; with n > 1 the choices of one prompt are
        siblings (GenerationRequest.sibling_group), which share its pages when the engine
        caches prefixes."""
        groups = [next(_SIBLING_GROUPS) if self.n > 1 else None for _ in self.prompts]
        return [GenerationRequest(self.prompts[index // self.n], sampling, self.logprobs,
                                  self.cache_salt, groups[index // self.n], self.tenant)
                for index, sampling in enumerate(self.sampling)]

    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    def usage(self, choices) -> dict:
        """usage of the finished choices: cached_tokens counts each prompt once (its
        choice that read the most from decode's cache), so it never exceeds prompt_tokens."""
        completion_tokens = sum(c.finished.completion_tokens for c in choices)
        cached = [0] * len(self.prompts)
        for c in choices:
            prompt = c.index // self.n
            cached[prompt] = max(cached[prompt], c.finished.cached_tokens)
        return usage(self.prompt_tokens(), completion_tokens,
                     min(sum(cached), self.prompt_tokens()))


def salt_for(tenant: str | None, cache_salt: str | None, across_keys: bool) -> int:
    """A request's prefix-cache salt: its tenant's (the API key's; one default tenant
    without keys) and its cache_salt, or the cache_salt alone when the server shares its
    cache across keys (--share-prefix-cache-across-keys). Requests share cached pages only
    when their salts are equal (engine/prefix.py)."""
    return salt_of("" if across_keys else tenant or "", cache_salt or "")


def tenant_for(tenant: str | None) -> str:
    """A request's tenant label (GenerationRequest.tenant): its API key's name (auth.py
    `tenant_of`), or the one default tenant without keys; never its cache_salt, which the
    client chooses: the labels are as many as the server's keys."""
    return tenant or DEFAULT_TENANT


def sampling_for(n_prompts: int, n: int, *, max_tokens: int, temperature: float, top_p: float,
                 seed: int | None, stop: tuple[str, ...]) -> tuple[SamplingParams, ...]:
    """One SamplingParams per choice. Choices of one request differ by their seed (seed + i,
    folded into int64: any integer is a seed); without a seed each choice draws a fresh
    one, as OpenAI's sampling is unseeded."""
    def seed_of(index: int) -> int:
        if seed is None:
            return random.randrange(INT64_MAX)
        return (seed + index + (1 << 63)) % (1 << 64) - (1 << 63)

    if temperature < GREEDY_BELOW_TEMPERATURE:
        temperature = 0.0
    top_p = max(top_p, TOP_P_FLOOR)
    return tuple(SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=seed_of(index), stop=stop)
                 for index in range(n_prompts * n))


def submit_all(engine, plan: Plan) -> Choices:
    """Every choice submitted, or an ApiError with nothing left allocated."""
    choices = Choices(engine, asyncio.get_running_loop())
    try:
        for request in plan.requests():
            choices.submit(request)
    except Refused as refusal:
        choices.abort_unfinished()
        raise refusal_error(refusal, plan.prompt_param) from None
    return choices


class Timings:
    """TTFT and inter-token latency of one HTTP request, into the server's histograms."""

    def __init__(self, metrics, received_s: float):
        self.metrics, self.received_s, self.first = metrics, received_s, True

    def token(self, choice) -> None:
        now = time.perf_counter()
        if self.first:
            self.metrics.time_to_first_token.observe(now - self.received_s)
            self.first = False
        if choice.last_token_s is not None:
            self.metrics.inter_token_latency.observe(now - choice.last_token_s)
        choice.last_token_s = now


async def _gather(choices: Choices, timings: Timings) -> bool:
    """True once every choice has finished; an error outcome raises at once."""
    while choices.live():
        choice, event = await choices.next()
        if isinstance(event, TokenOut):
            choice.tokens.append(event)
            timings.token(choice)
        else:
            error = outcome_error(event, choice.aborted)
            if error is not None:
                raise error
    return True


async def answer_whole(request, choices: Choices, plan: Plan, wire, timings: Timings) -> dict:
    """The whole response body; ApiError for an error outcome; None if the client left."""
    try:
        gathered = await unless_disconnected(request, _gather(choices, timings))
        if gathered is None:
            return None
        return wire.response(choices.choices, plan.usage(choices.choices))
    finally:
        choices.abort_unfinished()


async def first_event(request, choices: Choices):
    """The first (choice, event), before any header is sent; None if the client left.
    An error outcome here becomes the HTTP status itself."""
    try:
        first = await unless_disconnected(request, choices.next())
    except BaseException:
        choices.abort_unfinished()
        raise
    if first is None:
        choices.abort_unfinished()
        return None
    choice, event = first
    if isinstance(event, Finished):
        error = outcome_error(event, choice.aborted)
        if error is not None:
            choices.abort_unfinished()
            raise error
    return first


async def stream(choices: Choices, plan: Plan, wire, timings: Timings, first):
    """The SSE body. Runs `abort_unfinished` however it ends (a client that leaves cancels
    this generator at its current await)."""
    started = set()
    offsets = {c.index: 0 for c in choices.choices}
    pending = [first]
    try:
        while pending or choices.live():
            choice, event = pending.pop() if pending else await choices.next()
            is_first = choice.index not in started
            started.add(choice.index)
            if isinstance(event, TokenOut):
                choice.tokens.append(event)
                timings.token(choice)
                if not event.text and plan.logprobs is None and not is_first:
                    continue
                chunk = wire.chunk(choice.index, [event], None, offsets[choice.index], is_first)
                offsets[choice.index] += len(event.text)
            else:
                error = outcome_error(event, choice.aborted)
                if error is not None:
                    yield sse(error.body())
                    return
                chunk = wire.chunk(choice.index, [], event.finish_reason,
                                   offsets[choice.index], is_first)
            yield sse(chunk | ({"usage": None} if plan.include_usage else {}))
        if plan.include_usage:
            yield sse(wire.head(False) | {"choices": [], "usage": plan.usage(choices.choices)})
        yield sse("[DONE]")
    finally:
        choices.abort_unfinished()


def client_closed() -> ApiError:
    return ApiError(CLIENT_CLOSED_STATUS, "the client closed the connection", "client_closed")
