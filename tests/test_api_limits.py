"""Limits on what a client can send (api/serve/intake.py, api/serve/metrics.py), over a live
uvicorn on 127.0.0.1: a body over the size bound is refused with a 413 before it is read
(declared by Content-Length, or found while reading a chunked body); tokenizing runs off
the event loop, so /health answers while a slow prompt is being tokenized; /metrics labels
answers by route template, so invented paths make no time series."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from api.serve.app import create_app
from tests.api_cases import LiveServer, protocol_engine, tiny_chat_model  # noqa: F401
from tests.test_api_load import metric

BODY_BYTES_MAX = 1000
SLOW_MARKER = "slowly"  # a prompt holding this takes TOKENIZE_S to tokenize
TOKENIZE_S = 1.5


class SlowTokenizer:
    """The engine's tokenizer, except that encoding a text holding SLOW_MARKER first
    sleeps TOKENIZE_S (as a long prompt on a busy machine would take); `started` is set
    when such an encoding begins."""

    def __init__(self, inner):
        self.inner, self.started = inner, threading.Event()

    def encode(self, text: str):
        if SLOW_MARKER in text:
            self.started.set()
            time.sleep(TOKENIZE_S)
        return self.inner.encode(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def live(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model)
    engine.tokenizer = SlowTokenizer(engine.inner.tokenizer)
    with LiveServer(create_app(engine, request_body_bytes_max=BODY_BYTES_MAX)) as server:
        yield server, engine


def raw_request(port: int, head: str, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                 f"Content-Type: application/json\r\n{head}\r\n".encode() + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of one response (the server closes the connection after it);
    a server still waiting for the rest of the body makes recv time out, failing the test."""
    received = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_declared_length_over_the_limit_is_a_413_before_the_body_is_read(live):
    server, _engine = live
    started = time.monotonic()
    sock = raw_request(server.port, "Content-Length: 50000000\r\n", b'{"prompt": "')
    with sock:
        status, body = read_response(sock)
    assert time.monotonic() - started < 2.0  # 50 MB were never sent
    assert status == 413
    assert body["error"] == {"message": f"the request body is over this server's limit of "
                                        f"{BODY_BYTES_MAX} bytes",
                             "type": "invalid_request_error", "param": None,
                             "code": "request_too_large"}


def test_a_chunked_body_is_refused_once_it_passes_the_limit(live):
    server, _engine = live
    chunk = b"x" * 600
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sock = raw_request(server.port, "Transfer-Encoding: chunked\r\n", frame + frame)
    with sock:  # the last chunk (the terminator) is never sent
        status, body = read_response(sock)
    assert (status, body["error"]["code"]) == (413, "request_too_large")


def test_a_body_within_the_limit_is_served(live):
    server, _engine = live
    content = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
    content += b" " * (BODY_BYTES_MAX - len(content))  # exactly at the limit
    response = httpx.post(f"{server.url}/v1/completions", content=content, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


def test_health_answers_while_a_prompt_is_being_tokenized(live):
    """The slow prompt's tokenizing (TOKENIZE_S) runs on a tokenizing thread: /health,
    asked meanwhile, answers at once instead of after it."""
    server, engine = live
    engine.tokenizer.started.clear()
    answers = []
    slow = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{server.url}/v1/completions", json={"prompt": SLOW_MARKER, "max_tokens": 2},
        timeout=30)))
    slow.start()
    try:
        assert engine.tokenizer.started.wait(10), "the slow prompt was never tokenized"
        asked = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=10)
        health_s = time.monotonic() - asked
    finally:
        slow.join(30)
    assert health.status_code == 200
    assert health_s < TOKENIZE_S / 3, f"/health took {health_s:.2f} s"
    assert answers and answers[0].status_code == 200, answers


def test_metrics_label_answers_by_route_template_not_by_path(live):
    server, engine = live
    for path in ("/v1/models/nope", "/v1/models/nope2", "/v1/nothing/here", "/x"):
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 404
    assert httpx.get(f"{server.url}/v1/models/{engine.model_name}", timeout=10
                     ).status_code == 200
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "nope" not in text and "/v1/nothing" not in text and 'endpoint="/x"' not in text
    assert metric(text, "kvproof_http_responses_total", endpoint="/v1/models/{model_id}",
                  status="404") == 2
    assert metric(text, "kvproof_http_responses_total", endpoint="unmatched",
                  status="404") == 2


def test_tokenizing_is_bounded_and_refuses_one_more_with_a_503():
    """At most `waiting_max` requests tokenize or wait for a thread; the next is refused at
    once (503, Retry-After), the ones within the bound finish."""
    import asyncio

    from api.serve.errors import ApiError
    from api.serve.intake import Tokenizing

    release = threading.Event()

    async def scenario():
        tokenizing = Tokenizing(threads_max=1, waiting_max=2)
        try:
            held = [asyncio.ensure_future(tokenizing.run(release.wait, 10)) for _ in range(2)]
            await asyncio.sleep(0.05)
            with pytest.raises(ApiError) as refused:
                await tokenizing.run(len, "x")
            release.set()
            return refused.value, await asyncio.wait_for(asyncio.gather(*held), 10)
        finally:
            release.set()
            tokenizing.close()

    refused, held = asyncio.run(scenario())
    assert (refused.status, refused.code, refused.headers) == (503, "overloaded",
                                                               {"Retry-After": "1"})
    assert held == [True, True]


def test_a_full_engine_is_a_503_before_the_body_is_read(tiny_chat_model):  # noqa: F811
    """The admission gate: with the engine at its bound (one request queued of one, the
    engine not started so nothing leaves the queue) a generation request is refused with
    503 + Retry-After from its headers alone: the 50 MB its Content-Length declares are
    never sent. Other routes are not gated."""
    from engine.sampling import SamplingParams
    from engine.service import GenerationRequest

    engine = protocol_engine(tiny_chat_model, max_queued=1, context_prefill_s=0)
    engine.inner.submit(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=1)),
                        lambda event: None)
    with LiveServer(create_app(engine, start_engine=False)) as server:
        started = time.monotonic()
        sock = raw_request(server.port, "Content-Length: 50000000\r\n", b'{"prompt": "')
        with sock:
            status, body = read_response(sock)
        assert time.monotonic() - started < 2.0
        assert status == 503 and body["error"]["code"] == "overloaded"
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert engine.inner.snapshot().rejects == {"capacity": 1}


def test_the_gate_bounds_what_is_pending_on_a_cold_server():
    """On a server that has served nothing yet, the gate still counts what its pending
    requests will queue: each body's bytes at one token per byte (the bound for text),
    a body of unknown length as the whole context. Once requests are submitted it learns
    their tokens per byte; and past `pending_max` requests pending it refuses too. (The
    estimate before, a mean of submitted prompts, was zero when cold: a first burst of 400
    all passed the gate and was refused only after tokenizing, ~0.5 s late.)"""
    import asyncio

    from api.serve.intake import ADMITTED, AdmissionGate

    class Engine:
        context_length = 1000
        asked: list = []

        def full(self, pending, pending_tokens):
            self.asked.append((pending, pending_tokens))
            return 2.0 if pending_tokens >= 250 else None

    async def scenario():
        release = asyncio.Event()
        admitted_calls = []

        async def app(scope, receive, send):
            admitted_calls.append(scope[ADMITTED])
            await release.wait()

        gate = AdmissionGate(app, Engine(), pending_max=4)
        sent = []

        async def send(message):
            sent.append(message)

        def scope(length):
            headers = [] if length is None else [(b"content-length", str(length).encode())]
            return {"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": headers}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        tasks = [asyncio.create_task(gate(scope(100), receive, send)) for _ in range(4)]
        await asyncio.sleep(0.01)
        assert Engine.asked == [(0, 0), (1, 100), (2, 200), (3, 300)]
        assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [503]
        assert gate.pending == 3 and gate.pending_tokens == 300
        admitted_calls[0](25)  # submitted: 25 tokens for its 100 bytes
        assert gate.pending == 2 and gate.tokens_per_byte == pytest.approx(1 - 0.75 * 0.1)
        blind = asyncio.create_task(gate(scope(None), receive, send))
        await asyncio.sleep(0.01)
        assert gate.pending_tokens == 200 + 1000  # unknown length: the context
        sent.clear()
        gate.pending_max, asked = 3, len(Engine.asked)
        await gate(scope(10), receive, send)  # 3 pending: refused without asking the engine
        assert sent[0]["status"] == 503 and len(Engine.asked) == asked
        release.set()
        await asyncio.gather(*tasks, blind)
        assert gate.pending == 0 and gate.pending_tokens == 0

    asyncio.run(scenario())


def _gate_scenario(intake, monkeypatch, quiet_s: float, defer_s_max: float, refused_gaps_s):
    """An admitted request arrives, then refused ones with the gaps given; returns when its
    app started and when each refusal was sent, on the event loop's clock, from its
    arrival."""
    import asyncio

    monkeypatch.setattr(intake, "INTAKE_QUIET_S", quiet_s)
    monkeypatch.setattr(intake, "INTAKE_DEFER_S_MAX", defer_s_max)

    class Engine:
        context_length = 1000
        asked = 0

        def full(self, pending, pending_tokens):
            self.asked += 1
            return None if self.asked == 1 else 1.0  # the first in, every other refused

    async def scenario():
        loop = asyncio.get_running_loop()
        started, refused = [], []

        async def app(scope, receive, send):
            started.append(loop.time())

        async def send(message):
            if message["type"] == "http.response.start":
                assert message["status"] == 503
                refused.append(loop.time())

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"content-length", b"10")]}
        gate = intake.AdmissionGate(app, Engine(), pending_max=4)
        began = loop.time()
        first = asyncio.create_task(gate(dict(scope), receive, send))
        for gap_s in refused_gaps_s:
            await asyncio.sleep(gap_s)
            await gate(dict(scope), receive, send)
        await first
        assert gate.pending == 0
        return started[0] - began, [t - began for t in refused]

    return asyncio.run(scenario())


def test_a_burst_is_refused_before_admitted_work_starts(monkeypatch):
    """An admitted request's work (parsing, tokenizing, the prefill it starts) waits until
    the gate has seen no request for INTAKE_QUIET_S, so a burst's refusals go out first:
    on 2 cores the admitted requests' work slowed the event loop ~4x while the rest of a
    burst of 400 still arrived (503 p99 64-129 ms; bench/burst_bench.py). Before, the
    admitted request stepped back one turn of the loop and started before the refusals
    that arrived after it."""
    from api.serve import intake

    started_s, refused_s = _gate_scenario(intake, monkeypatch, quiet_s=0.1, defer_s_max=5.0,
                                          refused_gaps_s=[0.02] * 10)
    assert len(refused_s) == 10
    assert started_s > refused_s[-1]  # every refusal first
    assert started_s >= refused_s[-1] + 0.1 * 0.9  # then the quiet (timer slack allowed)


def test_waiting_for_a_quiet_intake_is_bounded(monkeypatch):
    """Requests that never stop arriving cannot hold an admitted request back for longer
    than INTAKE_DEFER_S_MAX: it starts while the refusals still come."""
    from api.serve import intake

    started_s, refused_s = _gate_scenario(intake, monkeypatch, quiet_s=0.5, defer_s_max=0.3,
                                          refused_gaps_s=[0.02] * 60)
    assert 0.3 * 0.9 <= started_s < refused_s[-1]
    assert started_s < 0.3 + 0.5  # the bound, with room for a loaded machine
