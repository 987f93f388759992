"""One mapping from what the engine says to what the client gets: a table, not branches.

`OUTCOME_ANSWERS` maps every final client state of the protocol core
(engine.service.OUTCOMES, the core's CLIENT_NAMES) to one HTTP status and one OpenAI error
(type, code). Only "Ok" is a success; everything else is an error, so a response built on
anything the protocol did not finish cleanly can never reach a client as a 200. When a
runtime guard tripped (Finished.guard), the error names it: code `guard_<name>` and the
guard in the message, whatever the outcome.

`REFUSAL_ANSWERS` does the same for submit's refusals, which happen before anything is
allocated (ContextTooLong, Overloaded, EngineStopped).

An `ApiError` is the one exception the handlers raise to answer with an error; it renders
as OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.service import (ContextTooLong, EngineStopped, Finished, OUTCOMES, Overloaded,
                            Refused)


@dataclass(frozen=True)
class Answer:
    status: int
    type: str  # OpenAI error type
    code: str | None
    message: str  # what the client reads (the engine's detail is appended)


OUTCOME_ANSWERS: dict[str, Answer] = {
    "Ok": Answer(200, "", None, ""),
    "Gone": Answer(503, "server_error", "request_aborted",
                   "the request was aborted before it finished"),
    "ErrTooLong": Answer(400, "invalid_request_error", "context_length_exceeded",
                         "the prompt does not fit the context of every worker"),
    "ErrPrefill": Answer(500, "server_error", "prefill_failed",
                         "the prefill worker failed the request"),
    "ErrTransfer": Answer(500, "server_error", "kv_transfer_failed",
                          "the KV cache transfer failed its checks"),
    "ErrTag": Answer(500, "server_error", "kv_tag_mismatch",
                     "a KV page's ownership tag did not match the request"),
    "ErrTimeout": Answer(504, "server_error", "kv_transfer_timeout",
                         "the KV cache did not arrive in time"),
    "ErrDecode": Answer(500, "server_error", "decode_failed",
                        "the decode worker failed the request"),
}
assert tuple(OUTCOME_ANSWERS) == OUTCOMES, "one answer for every outcome, in the contract's order"
assert [o for o, a in OUTCOME_ANSWERS.items() if a.status == 200] == ["Ok"]

# A Gone the server did not ask for. The core has one abort (the client's: its CLIENT_GONE),
# and the engine's drain uses it for whatever is still live when the server stops, so the
# engine's detail says "the client went away". The edge knows better: it sends an abort only
# for a client that left, and that client reads nothing; a Gone that reaches a client who is
# still there was the server stopping.
SERVER_STOPPING = "the server is stopping: it aborted the request before it finished"

REFUSAL_ANSWERS: dict[type, Answer] = {
    ContextTooLong: Answer(400, "invalid_request_error", "context_length_exceeded", ""),
    Overloaded: Answer(503, "server_error", "overloaded", ""),
    EngineStopped: Answer(503, "server_error", "engine_stopped", "the server is stopping"),
}


class ApiError(Exception):
    """An error answer: status, OpenAI error body, extra headers."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def outcome_error(finished: Finished, aborted_here: bool = True) -> ApiError | None:
    """None for a success, else the error the client gets for this Finished.
    `aborted_here`: the edge sent this request's abort (its client left); a Gone it did
    not send is the server stopping (SERVER_STOPPING)."""
    answer = OUTCOME_ANSWERS[finished.outcome]
    if answer.status == 200 and finished.guard is None:
        return None
    if finished.outcome == "Gone" and finished.guard is None and not aborted_here:
        return ApiError(answer.status, f"{SERVER_STOPPING} [outcome Gone]", answer.type,
                        answer.code)
    code, message = answer.code, answer.message or "the request did not finish cleanly"
    if finished.guard is not None:
        code = f"guard_{finished.guard}"
        message = f"runtime guard '{finished.guard}' tripped: {message}"
    status = answer.status if answer.status != 200 else 500  # a guard trip is never a success
    detail = f" ({finished.detail})" if finished.detail else ""
    return ApiError(status, f"{message}{detail} [outcome {finished.outcome}]",
                    answer.type or "server_error", code)


def refusal_error(refusal: Refused, param: str | None = None) -> ApiError:
    """The error for a refusal raised by submit (nothing was allocated)."""
    answer = REFUSAL_ANSWERS.get(type(refusal), REFUSAL_ANSWERS[EngineStopped])
    headers = {}
    if isinstance(refusal, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(refusal.retry_after_s)))
    message = str(refusal) or answer.message
    return ApiError(answer.status, message, answer.type, answer.code,
                    param if answer.status == 400 else None, headers)
