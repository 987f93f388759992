"""Stop strings on the protocol engine's stream: a client never sees text that a stop string
later cuts, and text held back while it might start a stop string is sent once it cannot."""

from __future__ import annotations

import os
import queue
import random
import sys

import pytest

torch = pytest.importorskip("torch")

from engine import generate, streaming  # noqa: E402
from engine.generate import Request, SamplingParams, Sequence, held_back  # noqa: E402
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


# -- incremental text: the same stream as decoding the whole output at every token ----------

STREAM_SEED = int(os.environ.get("KVPROOF_STREAM_SEED", random.randrange(1 << 32)))
SEQUENCES = 300  # random sequences per tokenizer
PIECES = ("a", "b", " ", "\n", "é", "ï", "Ü", "ñ", "中", "文", "日本語", "😀", "🎉", "👍🏽",
          "naïve", " the", "ab", "ST", "OP")


def byte_tokenizer():
    """A byte-level BPE over the 256 single-byte tokens plus merges that cut multi-byte
    characters at different places (C3 A9 whole, E4 B8|AD, F0 9F 98|80), and an end token
    that decodes to nothing: characters split across tokens every way."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    from engine.tokenizer import Tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    by_byte = dict(zip(sorted(alphabet, key=_byte_of), range(256)))
    vocab = {token: index for index, token in enumerate(sorted(by_byte, key=by_byte.get))}
    merges = []
    for text in ("é", "中", "😀", " the"):
        symbols = [_byte_token(b) for b in text.encode()]
        parts = [symbols[:2]] if len(symbols) <= 3 else [symbols[:2], [symbols[0] + symbols[1],
                                                                       symbols[2]]]
        for left, right in parts:
            merges.append((left, right))
            vocab.setdefault(left + right, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("</s>", special=True, normalized=False)])
    return Tokenizer(backend, frozenset(), None, False, None)


def _byte_token(value: int) -> str:
    from tokenizers.pre_tokenizers import ByteLevel
    return {_byte_of(c): c for c in ByteLevel.alphabet()}[value]


def _byte_of(character: str) -> int:
    """The byte a GPT-2 byte-level character stands for."""
    code = ord(character)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def default_tokenizer():
    from engine.load import DEFAULT_MODEL_INSTALL, DefaultModelMissing, load_tokenizer

    try:
        return load_tokenizer()
    except DefaultModelMissing:
        pytest.skip(f"the default model is not installed: {DEFAULT_MODEL_INSTALL}")


def streamed(tokenizer, ids: list[int], stops: tuple[str, ...] = ()):
    """(token, text) of every TokenOut when `ids` are sampled in turn (max_tokens = their
    count), and the finish reason."""
    events = []
    sampling = SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stops)
    live = streaming.Live(0, GenerationRequest((1,), sampling), events.append, 1, 0.0)
    live.sequence = Sequence(Request(0, (1,), sampling), [], torch.empty(0), torch.empty(0),
                             None)
    reason = None
    for token in ids:
        reason = streaming.next_token(live, token, None, tokenizer)
        if reason is not None:
            break
    return [(e.token_id, e.text) for e in events], reason


def random_ids(tokenizer, rng: random.Random) -> list[int]:
    """Either random text (multi-byte characters, split however the tokenizer splits them)
    or random token ids, including ones that are half a character or an end token."""
    if rng.random() < 0.5:
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 30)))
        ids = tokenizer.encode(text)
    else:
        vocab = tokenizer.backend.get_vocab_size()
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    cut = rng.randrange(len(ids) + 1)  # end anywhere, half a character included
    return ids[:max(cut, 1)]


def check_random_streams(tokenizer, label: str) -> None:
    print(f"incremental text ({label}) seed={STREAM_SEED} "
          f"(replay: KVPROOF_STREAM_SEED={STREAM_SEED})")
    rng = random.Random(STREAM_SEED)
    for index in range(SEQUENCES):
        ids = random_ids(tokenizer, rng)
        whole = tokenizer.decode(ids)
        stops = ()
        if rng.random() < 0.3 and len(whole) >= 2:
            start = rng.randrange(len(whole) - 1)
            stops = (whole[start:start + rng.randrange(1, 4)],)
        events, reason = streamed(tokenizer, ids, stops)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(streaming, "emit", streaming.emit_whole_text)
            patch.setattr(generate, "_hits_stop", generate.hits_stop_whole_text)
            expected, expected_reason = streamed(tokenizer, ids, stops)
        context = f"sequence {index}, ids {ids}, stops {stops}, seed {STREAM_SEED}"
        assert (events, reason) == (expected, expected_reason), context
        if not stops:
            assert "".join(text for _, text in events) == whole, context
            assert [token for token, _ in events] == ids, context


def test_incremental_text_streams_what_decoding_everything_streams_byte_tokens():
    check_random_streams(byte_tokenizer(), "byte-level BPE")


def test_incremental_text_streams_what_decoding_everything_streams_default_tokenizer():
    check_random_streams(default_tokenizer(), "the default model's tokenizer")


def test_a_character_split_over_two_tokens_goes_out_whole_with_its_last_token():
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("a😀b")
    assert len(ids) == 4  # a, F0 9F 98 (merged), 80, b
    events, _ = streamed(tokenizer, ids)
    assert events == [(ids[0], "a"), (ids[1], ""), (ids[2], "😀"), (ids[3], "b")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_engine_loop_runs_below_the_server_in_priority(engine):
    """A burst's 503s are answered by the event loop while the engine computes: the loop
    thread (and the torch threads it starts) must yield the CPU to it."""
    import threading

    from engine.serving import ENGINE_NICE_INCREMENT

    loop = next(t for t in threading.enumerate() if t.name == "kvproof-engine")
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, loop.native_id) == min(19, here
                                                                  + ENGINE_NICE_INCREMENT)


def test_the_chat_template_is_compiled_once_and_still_refuses_clearly(engine):
    """Compiling the template per request cost ~3.5 ms of GIL-holding Python each, which a
    burst's 503s waited behind; a template that raises is still a ModelFileError."""
    from engine import tokenizer
    from engine.config import ModelFileError

    chat = [{"role": "user", "content": "hi"}]
    engine.tokenizer.render_chat(chat)
    before = tokenizer._compiled.cache_info()
    assert engine.tokenizer.render_chat(chat) == engine.tokenizer.render_chat(chat)
    after = tokenizer._compiled.cache_info()
    assert (after.misses, after.hits) == (before.misses, before.hits + 2)
    with pytest.raises(ModelFileError, match="the chat template failed: no system turns"):
        tokenizer._render_template("{{ raise_exception('no system turns') }}", chat, True,
                                   "", "")
    with pytest.raises(ModelFileError, match="the chat template failed"):
        tokenizer._render_template("{% for %}", chat, True, "", "")
