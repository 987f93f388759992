"""Stop strings on the protocol engine's stream: a client never sees text that a stop string
later cuts, and text held back while it might start a stop string is sent once it cannot."""

from __future__ import annotations

import queue

import pytest

pytest.importorskip("torch")

from engine.generate import SamplingParams, held_back  # noqa: E402
from engine.serving import EngineConfig, build_engine  # noqa: E402
from engine.service import Finished, GenerationRequest, TokenOut  # noqa: E402
from tests.api_cases import tiny_chat_model  # noqa: E402,F401


@pytest.fixture(scope="module")
def engine(tiny_chat_model):  # noqa: F811
    engine = build_engine(tiny_chat_model, EngineConfig(context_length=256, page_tokens=8))
    engine.start()
    yield engine
    engine.stop()


def stream(engine, prompt: str, stop: tuple[str, ...] = (), max_tokens: int = 24):
    """Every event of one greedy request, in order (bounded wait)."""
    events: queue.Queue = queue.Queue()
    ids = tuple(engine.tokenizer.encode(prompt))
    engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                        stop=stop)), events.put)
    out = []
    while not out or not isinstance(out[-1], Finished):
        out.append(events.get(timeout=60))
    return out


def texts(events) -> list[str]:
    return [e.text for e in events if isinstance(e, TokenOut)]


def test_held_back_counts_a_possible_stop_start():
    assert held_back("abc\n", ("\n\n",)) == 1
    assert held_back("abc", ("\n\n",)) == 0
    assert held_back("xSTO", ("STOP", "TO")) == 3
    assert held_back("", ("ab",)) == 0


def test_the_stream_never_shows_what_the_stop_string_cuts(engine):
    free = "".join(texts(stream(engine, "abc")))
    assert len(free) >= 8
    stop = free[4:6]
    cut = free[:free.index(stop)]
    events = stream(engine, "abc", stop=(stop,))
    streamed = ""
    for piece in texts(events):
        streamed += piece
        assert cut.startswith(streamed), (streamed, cut)
    assert streamed == cut
    finished = events[-1]
    assert finished.outcome == "Ok" and finished.finish_reason == "stop"
    assert finished.completion_tokens == len(texts(events))


def test_held_text_is_sent_when_the_stop_string_never_completes(engine):
    free_events = stream(engine, "abc")
    free = "".join(texts(free_events))
    never = free[2] + "\x01"  # starts like the text but can never be generated
    events = stream(engine, "abc", stop=(never,))
    assert "".join(texts(events)) == free
    assert len(texts(events)) == len(texts(free_events))
    assert events[-1].finish_reason == free_events[-1].finish_reason
