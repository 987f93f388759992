"""Tokens out: what the protocol-driven runtime streams to a client, and what it holds back.

Theory of operation. Every token a decode step samples for a request is appended to its
`Sequence` the way the Generator does it (an end-of-sequence token is not output), then
streamed as a `TokenOut` — unless the text so far ends with something that may become a
stop string, or with half a character (U+FFFD while a multi-byte character is
incomplete). Such tokens wait in `Live.held`; the next token either completes the stop
string (the text is cut before it and the held tokens go out with no text of their own
beyond the cut) or shows that it cannot, and the held tokens go out together, the last
one carrying the text they add. So a client never sees text that a stop string later cuts.

The text is decoded incrementally (engine/tokenizer.py's `IncrementalText`, kept on the
`Sequence` and shared with the stop-string check), not the whole output at every token,
which is quadratic in the completion's length; whether the text ends with half a character
is the same question either way. `emit_whole_text` is the rule by its definition, the
reference the incremental one is tested and benched against.

`Live` is the runtime's side of one request: what the protocol state does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.generate import Sequence, held_back, incremental_text, stop_reason
from engine.tokenizer import INCOMPLETE
from engine.service import GenerationRequest, TokenOut


@dataclass(eq=False)
class Live:
    """The shell's side of one request: what the protocol state does not hold."""

    request_id: int
    request: GenerationRequest
    on_event: Callable
    pages: int  # the core's prompt_pages (see engine/runtime.py's header)
    started_s: float
    full_pages: int = 0  # with a prefix cache: the pages the prompt fills (shareable)
    hit_pages: int = 0  # with a prefix cache: the pages decode read from its cache
    prefill_hit_pages: int = 0  # with the prefill's cache: the pages it did not compute
    wants: set = field(default_factory=set)
    first: tuple | None = None  # (token, logits row, generator) from the prefill
    sequence: Sequence | None = None  # at decode
    tags_ok: bool = True
    count_sent: int = 0
    transfer_fault: str = ""  # decode's data-path verdict at Accept ("", count, checksum)
    outcome: str | None = None
    finish_reason: str | None = None
    guard: str | None = None
    detail: str = ""  # what the data path saw, for the client's error (a failed prefill)
    text: str = ""  # streamed so far
    held: list = field(default_factory=list)  # tokens not streamed yet (see emit)
    completion_tokens: int = 0
    timeline: list = field(default_factory=list)


def next_token(live: Live, token: int, logits: torch.Tensor, tokenizer) -> str | None:
    """Append a sampled token as the Generator does (an end-of-sequence token is not
    output) and stream it; the request's stop reason, or None while it goes on."""
    sequence = live.sequence
    before = len(sequence.output_ids)
    reason = stop_reason(tokenizer, sequence, token)
    if reason is None or reason == "length":
        sequence.output_ids.append(token)
    if len(sequence.output_ids) > before:
        emit(live, token, logits, reason is not None, tokenizer)
    elif reason is not None and live.held:
        flush(live, text_of(live, tokenizer))
    return reason


def emit(live: Live, token: int, logits: torch.Tensor, final: bool, tokenizer) -> None:
    """Stream `token`, or hold it back while the text ends with what may become a stop
    string (or half a character): a client never sees text a stop string later cuts."""
    _hold(live, token, logits)
    text = text_of(live, tokenizer, final)
    decoded = live.sequence.decoded
    _flush_unless_held(live, text, decoded is not None and decoded.incomplete, final)


def emit_whole_text(live: Live, token: int, logits: torch.Tensor, final: bool,
                    tokenizer) -> None:
    """`emit` by its definition: the whole output decoded at every token (quadratic in its
    length). The reference that tests/test_engine_stream.py and bench/stream_text_bench.py
    hold the incremental `emit` against."""
    _hold(live, token, logits)
    sequence = live.sequence
    text = sequence.text
    if text is None:
        text = tokenizer.decode(sequence.output_ids) if tokenizer else ""
    _flush_unless_held(live, text, text.endswith(INCOMPLETE), final)


def _hold(live: Live, token: int, logits: torch.Tensor) -> None:
    live.completion_tokens += 1
    logprob, top = None, ()
    k = live.request.logprobs
    if k is not None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        logprob = float(logprobs[token])
        if k:
            values, ids = logprobs.topk(k)
            top = tuple(zip(ids.tolist(), values.tolist()))
    live.held.append((token, logprob, top))


def _flush_unless_held(live: Live, text: str, incomplete: bool, final: bool) -> None:
    if not final and (incomplete or held_back(text, live.request.sampling.stop)):
        return
    flush(live, text)


def text_of(live: Live, tokenizer, final: bool = True) -> str:
    """The output's text so far (whole characters unless `final`), incrementally."""
    sequence = live.sequence
    if sequence.text is not None:  # cut before a stop string
        return sequence.text
    if tokenizer is None:
        return ""
    decoded = incremental_text(sequence, tokenizer)
    text = decoded.update(sequence.output_ids)
    return decoded.whole if final else text


def flush(live: Live, text: str) -> None:
    """Send the held tokens; the last carries the text they add."""
    delta = ""
    if text.startswith(live.text):
        delta, live.text = text[len(live.text):], text
    held, live.held = live.held, []
    for index, (token, logprob, top) in enumerate(held):
        last = index == len(held) - 1
        live.on_event(TokenOut(live.request_id, token, delta if last else "", logprob, top))
