"""Tiny models for the server tests: a random Llama (tests/engine_cases.py's shape) with a
character-level tokenizer of its own, so that text goes in and text comes out.

The tokenizer maps each printable ASCII character (and newline) to one token and fuses
tokens back into text, so every token decodes to exactly one character and a completion's
text is as long as its token count. Its chat template wraps each message in <role> tags.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from tests.engine_cases import TINY

SPECIAL = ("<unk>", "<s>", "</s>")
CHARACTERS = tuple(string.printable[:95]) + ("\n",)  # digits, letters, punctuation, space
VOCAB = SPECIAL + CHARACTERS
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_tiny_chat_model(folder: Path, seed: int = 0, max_position_embeddings: int = 512) -> Path:
    """A random tiny Llama with a character tokenizer, saved into `folder`."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    shape = dict(TINY, vocab_size=len(VOCAB), max_position_embeddings=max_position_embeddings)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**shape, rope_theta=10000.0, bos_token_id=1,
                                 eos_token_id=2)).eval().save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        dict(eos_token="</s>", bos_token="<s>", add_bos_token=False,
             chat_template=CHAT_TEMPLATE)))
    return folder


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """The tiny chat model, loaded once per test session (engines share its weights)."""
    from engine.load import load_model

    return load_model(make_tiny_chat_model(tmp_path_factory.mktemp("tinychat")))


def protocol_engine(loaded, **config):
    """The protocol-driven engine (engine.serving.build_engine) over `loaded`, counted. Its
    loop runs at the tests' own priority (loop_nice 0) unless a test asks: the default +10
    counts against the other test workers too, which then starve it (a release trailed its
    answer by seconds in CI)."""
    from engine.serving import EngineConfig, build_engine

    return CountingEngine(build_engine(loaded, EngineConfig(**{"loop_nice": 0} | config)))


class LiveServer:
    """The app on uvicorn in a thread, on a free port of 127.0.0.1; `with` starts and stops
    it (bounded: a server that does not come up in `start_s` fails the test)."""

    def __init__(self, app, start_s: float = 20.0):
        import socket

        import uvicorn

        self.app = app
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.start_s = start_s
        self.thread = None

    def __enter__(self) -> LiveServer:
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.listener]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.start_s
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            assert self.thread.is_alive(), "the server thread died"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


class CountingEngine:
    """An Engine that counts the calls the server makes (abort per request id) and passes
    everything to the engine it wraps."""

    def __init__(self, inner):
        import collections

        self.inner = inner
        self.aborts = collections.Counter()
        self.submitted: list[int] = []
        self.model_name, self.context_length = inner.model_name, inner.context_length
        self.tokenizer = inner.tokenizer

    def start(self) -> None:
        self.inner.start()

    def submit(self, request, on_event) -> int:
        request_id = self.inner.submit(request, on_event)
        self.submitted.append(request_id)
        return request_id

    def abort(self, request_id: int) -> None:
        self.aborts[request_id] += 1
        self.inner.abort(request_id)

    def snapshot(self):
        return self.inner.snapshot()

    def full(self, pending: int = 0, pending_tokens: int = 0) -> float | None:
        return self.inner.full(pending, pending_tokens)

    def stop(self, drain_s: float = 0.0) -> None:
        self.inner.stop(drain_s)


def assert_pools_whole(snapshot) -> None:
    for pool in snapshot.pools:
        assert (pool.free, pool.held, pool.writes_in_flight) == (pool.pages, 0, 0), pool
    assert (snapshot.queued, snapshot.running) == (0, 0)


def pools_whole(snapshot) -> bool:
    return (snapshot.queued, snapshot.running) == (0, 0) and all(
        (pool.free, pool.held, pool.writes_in_flight) == (pool.pages, 0, 0)
        for pool in snapshot.pools)


def wait_settled(engine, timeout_s: float = 30.0):
    """The engine's snapshot once nothing is queued or running and every pool is whole (a
    request can still hold pages after its answer: release waits for its writes and the
    prefill's final word); times out, failing the test, if that never happens."""
    wait_until(lambda: pools_whole(engine.snapshot()), timeout_s, "every pool whole")
    return engine.snapshot()


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition",
               last_seen=None) -> None:
    """Poll `predicate` until it holds; past `timeout_s` the test fails, naming `what` and,
    when `last_seen` is given, what it returns (the state the predicate last refused)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + (
            f"; last seen: {last_seen()}" if last_seen else "")
        time.sleep(0.01)
