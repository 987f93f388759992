"""A client that goes away costs the engine exactly one abort(request_id), whenever it
leaves: queued, mid-prefill, mid-stream, or while a whole answer is being gathered; a
request that finished costs none. Raw sockets make the moment of leaving exact.

The engine is the protocol-driven one (engine.serving), slowed by its `step_delay_s` test
hook so that a request is still queued, prefilling or streaming when its client leaves.
Sampling is greedy: the tiny model's greedy continuations used here run to max_tokens, so
a stream is as long as the test needs (an unseeded sampled stream sometimes drew the end
token at once, ended after two events, and left `read_until` waiting on an idle
keep-alive connection until uvicorn closed it: the old flake of test_leaving_mid_stream).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from api.serve.app import create_app
from tests.api_cases import (LiveServer, assert_pools_whole, protocol_engine,  # noqa: F401
                             tiny_chat_model, wait_until)

GREEDY = {"temperature": 0}
PAGE_TOKENS = 16
# The decode pool holds exactly one request of 1 + 300 tokens (19 pages): a second request
# waits, queued, for its Reserve. The advertised context is lowered to fit that pool.
DECODE_POOL_TOKENS = 19 * PAGE_TOKENS


def send_raw(port: int, path: str, body: dict) -> socket.socket:
    """An HTTP request sent on a fresh connection that the test closes when it likes."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes, count: int = 1) -> bytes:
    received = b""
    while received.count(marker) < count:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {received!r}"
        received += chunk
    return received


def timeline(engine, request_id: int) -> list[str]:
    """The request's protocol actions by name ("Reserve(r1, {1, 2})" -> "Reserve")."""
    for request in engine.snapshot().recent:
        if request.request_id == request_id:
            return [action.split("(", 1)[0] for _at, action in request.timeline]
    return []


def outcome(engine, request_id: int) -> str | None:
    return next((r.outcome for r in engine.snapshot().recent if r.request_id == request_id),
                None)


@pytest.fixture
def slow_server(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model, page_tokens=PAGE_TOKENS,
                             decode_pool_tokens=DECODE_POOL_TOKENS, lower_context_to_fit=True,
                             step_delay_s=0.02, prefill_chunk_tokens=4)
    with LiveServer(create_app(engine)) as server:
        yield server, engine
    assert_pools_whole(engine.snapshot())
    assert engine.inner.runtime.whole()


def gone_once(engine, *request_ids: int) -> None:
    """Each request ended Gone after exactly one abort, and the pool is whole again."""
    for request_id in request_ids:
        wait_until(lambda: outcome(engine, request_id) == "Gone", what="the abort")
    time.sleep(0.1)  # a second abort would come now, if any
    assert {r: engine.aborts[r] for r in request_ids} == {r: 1 for r in request_ids}
    wait_until(lambda: engine.snapshot().running == 0 and engine.snapshot().queued == 0)
    assert_pools_whole(engine.snapshot())


def test_leaving_while_queued(slow_server):
    server, engine = slow_server
    busy = send_raw(server.port, "/v1/completions", {"prompt": "a", "max_tokens": 300} | GREEDY)
    wait_until(lambda: len(engine.submitted) == 1 and engine.snapshot().running == 1)
    queued = send_raw(server.port, "/v1/completions", {"prompt": "b", "max_tokens": 4,
                                                        "stream": True} | GREEDY)
    wait_until(lambda: len(engine.submitted) == 2 and engine.snapshot().queued == 1)
    queued.close()
    wait_until(lambda: outcome(engine, engine.submitted[1]) == "Gone")
    busy.close()
    gone_once(engine, *engine.submitted)
    # Never reserved: the prefill drops it from its queue, decode drops its bootstrap.
    assert timeline(engine, engine.submitted[1]) == [
        "Arrive", "Abort", "PrefillAbort", "Notice", "DropBootstrap"]


def test_leaving_mid_prefill(slow_server):
    server, engine = slow_server
    sock = send_raw(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "p" * 200}], "max_tokens": 4,
        "stream": True} | GREEDY)
    wait_until(lambda: engine.submitted and "Admit" in timeline(engine, engine.submitted[0]))
    sock.close()  # 200 prompt tokens at 4 a step (and 20 ms a step): still prefilling
    gone_once(engine, engine.submitted[0])
    # Aborted before a page was sent: both workers hear it, decode releases at once.
    assert timeline(engine, engine.submitted[0]) == [
        "Arrive", "Reserve", "Admit", "Abort", "DecodeAbort", "PrefillAbort", "Notice",
        "Release"]


def test_leaving_mid_stream(slow_server):
    server, engine = slow_server
    sock = send_raw(server.port, "/v1/completions", {"prompt": "s", "max_tokens": 60,
                                                      "stream": True} | GREEDY)
    head = read_until(sock, b"data: ", count=3)
    assert head.startswith(b"HTTP/1.1 200")
    sock.close()
    gone_once(engine, engine.submitted[0])


def test_leaving_while_a_whole_answer_is_gathered(slow_server):
    server, engine = slow_server
    sock = send_raw(server.port, "/v1/completions", {"prompt": "w", "max_tokens": 60, "n": 2}
                    | GREEDY)
    wait_until(lambda: len(engine.submitted) == 2 and engine.snapshot().running >= 1)
    sock.close()
    gone_once(engine, *engine.submitted)


def test_a_finished_request_costs_no_abort(slow_server):
    server, engine = slow_server
    sock = send_raw(server.port, "/v1/completions", {"prompt": "f", "max_tokens": 3,
                                                      "stream": True} | GREEDY)
    read_until(sock, b"data: [DONE]")
    sock.close()
    wait_until(lambda: outcome(engine, engine.submitted[0]) == "Ok")
    time.sleep(0.1)
    assert engine.aborts == {}
