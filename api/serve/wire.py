"""OpenAI's wire format for the two generation endpoints, whole and streamed.

`CompletionWire` and `ChatWire` say how a choice's tokens become JSON: the whole response
(`response`), a streamed chunk (`chunk`), and logprobs in each endpoint's own shape
(completions: parallel lists; chat: a list of token objects). Everything else about
serving a request is shared (api/serve/generation.py).
"""

from __future__ import annotations

import json
import time
import uuid

from engine.service import TokenOut


def sse(payload) -> str:
    """One server-sent event: `data: <json>` or `data: [DONE]`."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class _Wire:
    object_whole = object_chunk = id_prefix = ""

    def __init__(self, model: str, tokenizer, logprobs: int | None):
        self.model, self.tokenizer, self.logprobs = model, tokenizer, logprobs
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def head(self, whole: bool) -> dict:
        return {"id": self.id, "object": self.object_whole if whole else self.object_chunk,
                "created": self.created, "model": self.model}


class CompletionWire(_Wire):
    object_whole = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def response(self, choices, usage_: dict) -> dict:
        return self.head(True) | {"choices": [
            {"index": c.index, "text": "".join(t.text for t in c.tokens),
             "finish_reason": c.finished.finish_reason,
             "logprobs": self._logprobs(c.tokens, 0)} for c in choices], "usage": usage_}

    def chunk(self, index: int, tokens: list[TokenOut], finish_reason, offset: int,
              first: bool) -> dict:
        del first  # completions have no role delta
        return self.head(False) | {"choices": [
            {"index": index, "text": "".join(t.text for t in tokens),
             "finish_reason": finish_reason, "logprobs": self._logprobs(tokens, offset)}]}

    def _logprobs(self, tokens: list[TokenOut], offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        text_offset, at = [], offset
        for token in tokens:
            text_offset.append(at)
            at += len(token.text)
        return {"tokens": [self.token_text(t.token_id) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{self.token_text(i): p for i, p in t.top_logprobs}
                                 for t in tokens] if self.logprobs else None,
                "text_offset": text_offset}


class ChatWire(_Wire):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def response(self, choices, usage_: dict) -> dict:
        return self.head(True) | {"choices": [
            {"index": c.index, "message": {"role": "assistant",
                                           "content": "".join(t.text for t in c.tokens)},
             "finish_reason": c.finished.finish_reason,
             "logprobs": self._logprobs(c.tokens)} for c in choices], "usage": usage_}

    def chunk(self, index: int, tokens: list[TokenOut], finish_reason, offset: int,
              first: bool) -> dict:
        del offset
        delta = {"role": "assistant", "content": ""} if first else {}
        text = "".join(t.text for t in tokens)
        if tokens or text:
            delta["content"] = delta.get("content", "") + text
        return self.head(False) | {"choices": [
            {"index": index, "delta": delta, "finish_reason": finish_reason,
             "logprobs": self._logprobs(tokens) if tokens else None}]}

    def _logprobs(self, tokens: list[TokenOut]) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": [self._token(t.token_id, t.logprob)
                            | {"top_logprobs": [self._token(i, p) for i, p in t.top_logprobs]}
                            for t in tokens]}

    def _token(self, token_id: int, logprob: float | None) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
