"""What a request passes before it reaches the engine: a size bound on its body, checked
before anything parses it, then tokenizing on a bounded pool of threads.

`BodyLimit` is ASGI middleware in front of the whole app. A request whose Content-Length
is over `request_body_bytes_max` is refused with a 413 before one byte of its body is
read; a body without a length (chunked) is read up to the bound and refused the moment it
passes it. Only then does the app see the body, replayed from memory, so that no parser,
validator or tokenizer ever spends time on a body it would refuse for its size (a 10 MB
prompt used to take 43 s to refuse, and blocked the event loop meanwhile).

Once the body is replayed, the client's receive channel is passed through as it is: that
is how a handler notices `http.disconnect` (api/serve/bridge.py).

The bound fits every request the server can serve with room to spare: a prompt that fills
an 8,192-token context is at most ~800 KB of JSON (16-character tokens, every character
escaped), and 16 prompts of 8,192 token ids are ~1 MB.

`Tokenizing` runs the chat template and the tokenizer off the event loop (a long prompt
took the loop for 14 s, and /health with it), on TOKENIZE_THREADS_MAX threads, with at
most TOKENIZE_WAITING_MAX requests tokenizing or waiting: one more is a 503.
"""

from __future__ import annotations

import asyncio
import json
import math

from api.serve.errors import ApiError

REQUEST_BODY_BYTES_MAX = 4 * 1024 * 1024


class BodyTooLarge(Exception):
    """The body is over the bound (the client's error: a 413)."""


class BodyLimit:
    """Refuses bodies over `body_bytes_max` with a 413 (an OpenAI error body); `on_refused`
    is told the scope of each refused request (for the metrics)."""

    def __init__(self, app, body_bytes_max: int, on_refused=None):
        assert body_bytes_max >= 0, body_bytes_max
        self.app, self.body_bytes_max, self.on_refused = app, body_bytes_max, on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            body = await self._read(scope, receive)
        except BodyTooLarge:
            return await self._refuse(scope, send)
        if body is None:
            return None  # the client left while sending its body: nobody to answer
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _read(self, scope, receive) -> bytes | None:
        declared = _content_length(scope)
        if declared is not None and declared > self.body_bytes_max:
            raise BodyTooLarge
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.body_bytes_max:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope, send) -> None:
        if self.on_refused is not None:
            self.on_refused(scope)
        error = ApiError(413, f"the request body is over this server's limit of "
                         f"{self.body_bytes_max} bytes", code="request_too_large")
        body = json.dumps(error.body()).encode()
        # The rest of the body is never read: the connection cannot carry another request.
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
ADMITTED = "kvproof.admitted"  # the scope key of the gate's callback (see AdmissionGate)


OVERLOADED_BODY = json.dumps(ApiError(
    503, "the server is at its admission bound (queued requests or prompt tokens waiting); "
    "retry later", "server_error", "overloaded").body()).encode()  # the same for every refusal


TOKENS_PER_BYTE_WEIGHT = 0.1  # of each submit in the gate's running tokens-per-byte ratio
# Admitted requests start their work (parsing, tokenizing, prefill) only once the intake has
# been quiet this long, so that a burst's refusals are answered first; a lone request pays
# INTAKE_QUIET_S once. Measured with bench/burst_bench.py (400 at once, cold server, 2
# cores): stepping back one turn of the event loop instead, the admitted requests' parsing,
# tokenizing and the prefill they started slowed the loop ~4x while the rest of the burst
# still arrived: 503 p99 64-129 ms in 4 runs before this and the gc.freeze() in
# api/serve/command.py, 23-36 ms in 6 runs with both.
INTAKE_QUIET_S = 0.003
INTAKE_DEFER_S_MAX = 0.1  # what waiting for quiet may add to an admitted request, at most


class AdmissionGate:
    """Admission, answered before anything is read or parsed: a generation request that
    the engine could not admit now gets its 503 (Retry-After) at once, instead of after its
    body was read, validated and tokenized (in a burst those took seconds, and a 503
    refused only at submit came that late). It counts the requests past the gate and not
    yet submitted (`pending`, at most `pending_max`: the tokenizing pool's bound) and an
    estimate of the prompt tokens they will queue: the body's size times a ratio of
    tokens queued per body byte, learned from the requests submitted, that starts at one
    (a prompt's text has at most one token per byte) and never exceeds the context per
    request; a body of unknown length counts as the context. The app calls
    scope[ADMITTED](tokens) once it has submitted one (with the prompt tokens it queued)
    or given up on it, and the engine's `full(pending, pending_tokens)` says whether one
    more fits. Submit still decides: the gate only answers early what submit would
    refuse. (A mean of recent prompt lengths, the estimate before, was zero on a cold
    server: its first burst of 400 got past the gate and was refused after tokenizing,
    each 503 ~0.5 s late.)"""

    def __init__(self, app, engine, pending_max: int, on_refused=None):
        assert pending_max >= 1, pending_max
        self.app, self.engine, self.on_refused = app, engine, on_refused
        self.pending_max = pending_max
        self.pending = 0
        self.pending_tokens = 0
        self.tokens_per_byte = 1.0
        self.last_arrival_s = -math.inf  # on the event loop's clock
        self.quiet = None  # the future admitted requests wait on, set when intake is quiet
        self.watcher = None

    async def __call__(self, scope, receive, send) -> None:
        full = getattr(self.engine, "full", None)
        if scope["type"] != "http" or scope.get("method") != "POST" or full is None \
                or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        self.last_arrival_s = asyncio.get_running_loop().time()
        context = self.engine.context_length
        declared = _content_length(scope)
        estimate = context if declared is None \
            else min(context, math.ceil(declared * self.tokens_per_byte))
        retry_after_s = TOKENIZE_RETRY_AFTER_S if self.pending >= self.pending_max \
            else full(self.pending, self.pending_tokens)
        if retry_after_s is not None:
            return await self._refuse(scope, send, retry_after_s)
        self.pending += 1
        self.pending_tokens += estimate
        counted = True

        def admitted(queued_tokens: int | None = None) -> None:
            nonlocal counted
            if not counted:
                return
            counted = False
            self.pending -= 1
            self.pending_tokens -= estimate
            assert self.pending >= 0 and self.pending_tokens >= 0, \
                (self.pending, self.pending_tokens)
            if queued_tokens is not None and declared:
                self.tokens_per_byte += (queued_tokens / declared - self.tokens_per_byte) \
                    * TOKENS_PER_BYTE_WEIGHT

        scope[ADMITTED] = admitted
        try:
            await self.intake_quiet()
            return await self.app(scope, receive, send)
        finally:
            admitted()

    async def intake_quiet(self) -> None:
        """Returns once no generation request has reached the gate for INTAKE_QUIET_S,
        or INTAKE_DEFER_S_MAX after the first request that is waiting now began to wait.
        One watcher per wave of waiting requests, not a timer per request (fifty of them
        waking and re-arming through a burst would take the loop from its refusals)."""
        if self.quiet is None or self.quiet.done():
            loop = asyncio.get_running_loop()
            self.quiet = loop.create_future()
            # Held, so that the loop's weak reference is not the watcher's only one.
            self.watcher = loop.create_task(
                self._watch(self.quiet, loop.time() + INTAKE_DEFER_S_MAX))
        await asyncio.shield(self.quiet)  # a cancelled request leaves the others waiting

    async def _watch(self, quiet, give_up_s: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now_s, quiet_s = loop.time(), self.last_arrival_s + INTAKE_QUIET_S
            if now_s >= min(quiet_s, give_up_s):
                quiet.set_result(None)
                return
            await asyncio.sleep(min(quiet_s, give_up_s) - now_s)

    async def _refuse(self, scope, send, retry_after_s: float) -> None:
        if self.on_refused is not None:
            self.on_refused(scope)
        body = OVERLOADED_BODY
        retry = str(max(1, math.ceil(retry_after_s))).encode()  # as errors.py answers it
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", retry), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's HTTP parser refuses it before us
    return None


TOKENIZE_THREADS_MAX = 2  # tokenizing is CPU work beside the engine's: two threads at most
TOKENIZE_WAITING_MAX = 64  # requests tokenizing or waiting for a thread; beyond: a 503
TOKENIZE_RETRY_AFTER_S = 1.0  # what such a 503 says


class Tokenizing:
    """Tokenizing (chat template + encode) on a bounded pool of threads, off the event
    loop: a long prompt costs its own request time, never /health's or another stream's.
    At most `waiting_max` requests tokenize or wait for a thread; one more is refused
    with a 503 and Retry-After, like a full admission queue."""

    def __init__(self, threads_max: int = TOKENIZE_THREADS_MAX,
                 waiting_max: int = TOKENIZE_WAITING_MAX):
        from concurrent.futures import ThreadPoolExecutor

        assert threads_max >= 1 and waiting_max >= threads_max, (threads_max, waiting_max)
        self.pool = ThreadPoolExecutor(threads_max, thread_name_prefix="kvproof-tokenize")
        self.waiting_max, self.waiting = waiting_max, 0

    async def run(self, tokenize, *args):
        """tokenize(*args) on a pool thread; what it raises (an ApiError) propagates."""
        if self.waiting >= self.waiting_max:
            raise ApiError(503, f"{self.waiting} requests are being tokenized (the limit)",
                           "server_error", "overloaded",
                           headers={"Retry-After": str(math.ceil(TOKENIZE_RETRY_AFTER_S))})
        self.waiting += 1  # only the event loop's thread counts: no lock needed
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, tokenize, *args)
        finally:
            self.waiting -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
