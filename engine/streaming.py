"""Tokens out: what the protocol-driven runtime streams to a client, and what it holds back.

Theory of operation. Every token a decode step samples for a request is appended to its
`Sequence` the way the Generator does it (an end-of-sequence token is not output), then
streamed as a `TokenOut` — unless the text so far ends with something that may become a
stop string, or with half a character (U+FFFD while a multi-byte character is
incomplete). Such tokens wait in `Live.held`; the next token either completes the stop
string (the text is cut before it and the held tokens go out with no text of their own
beyond the cut) or shows that it cannot, and the held tokens go out together, the last
one carrying the text they add. So a client never sees text that a stop string later cuts.

Text is decoded incrementally (`IncrementalText`), not the whole output at every token
(quadratic in the completion's length): two offsets into the output ids, `prefix_offset`
and `read_offset`; each token decodes only the window from `prefix_offset` on and the
window's first part up to `read_offset`, and the text the window adds beyond that part is
new. The window starts a few tokens before the new ones because a token's text can depend
on the token before it (a leading space, a character whose bytes span two tokens). New
text is taken only when it does not end with U+FFFD (half a character); then both offsets
move on. The held-back decision is the same as decoding everything: the text so far ends
with half a character exactly when the window does.

`Live` is the runtime's side of one request: what the protocol state does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.generate import Sequence, held_back, stop_reason
from engine.service import GenerationRequest, TokenOut


INCOMPLETE = "\ufffd"  # what a decoder shows for bytes that are not a whole character


@dataclass
class IncrementalText:
    """The decoded text of a growing list of token ids, one decode of a short window per
    token. `text` is the text of ids[:read_offset], whole characters; `incomplete` says
    the ids after it end in half a character (their text is not taken yet)."""

    tokenizer: object  # engine.tokenizer.Tokenizer (decode)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    incomplete: bool = False

    def update(self, ids: list[int]) -> str:
        """The text of `ids` (the same list, grown since the last call) as far as it is
        whole characters."""
        prefix, window = self._window(ids)
        self.incomplete = window.endswith(INCOMPLETE)
        if len(window) > len(prefix) and not self.incomplete:
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text

    def final(self, ids: list[int]) -> str:
        """The whole text of `ids`, half a character at the end included (as U+FFFD)."""
        prefix, window = self._window(ids)
        return self.text + window[len(prefix):]

    def _window(self, ids: list[int]) -> tuple[str, str]:
        decode = self.tokenizer.decode
        prefix = decode(ids[self.prefix_offset:self.read_offset])
        window = decode(ids[self.prefix_offset:])
        if not window.startswith(prefix):  # a decoder that rewrites text it showed: the
            return self.text, decode(ids)  # whole text once (no tokenizer here does this)
        return prefix, window


@dataclass(eq=False)
class Live:
    """The shell's side of one request: what the protocol state does not hold."""

    request_id: int
    request: GenerationRequest
    on_event: Callable
    pages: int  # the core's prompt_pages (see engine/runtime.py's header)
    started_s: float
    wants: set = field(default_factory=set)
    first: tuple | None = None  # (token, logits row, generator) from the prefill
    sequence: Sequence | None = None  # at decode
    tags_ok: bool = True
    count_sent: int = 0
    outcome: str | None = None
    finish_reason: str | None = None
    guard: str | None = None
    detail: str = ""  # what the data path saw, for the client's error (a failed prefill)
    text: str = ""  # streamed so far
    decoded: IncrementalText | None = None  # the output's text (with a tokenizer)
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
    incomplete = live.decoded is not None and live.decoded.incomplete
    _flush_unless_held(live, text, incomplete, final)


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
    if live.decoded is None:
        live.decoded = IncrementalText(tokenizer)
    text = live.decoded.update(sequence.output_ids)
    return live.decoded.final(sequence.output_ids) if final else text


def flush(live: Live, text: str) -> None:
    """Send the held tokens; the last carries the text they add."""
    delta = ""
    if text.startswith(live.text):
        delta, live.text = text[len(live.text):], text
    held, live.held = live.held, []
    for index, (token, logprob, top) in enumerate(held):
        last = index == len(held) - 1
        live.on_event(TokenOut(live.request_id, token, delta if last else "", logprob, top))
