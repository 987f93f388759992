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
as OpenAI's `{"error": {"message", "type", "param", "code"}}`. A body the edge cannot take
(`validation_error`, `not_json`, FastAPI's own HTTP errors) is one of those too, with the
field named as OpenAI's `param`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.service import (ContextTooLong, EngineStopped, Finished, OUTCOMES, Overloaded,
                            Refused, Unsupported)

from api.serve.schemas import NOT_SERVED


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
                     "a KV page's tag (its generation and content identity) did not match "
                     "the request"),
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
    Unsupported: Answer(400, "invalid_request_error", "unsupported_parameter", ""),
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


HTTP_ERROR_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}
# FastAPI's 400 comes from a body its JSON parser gave up on with something other than a
# syntax error: in practice, nesting deeper than Python's recursion limit.
HTTP_ERROR_MESSAGES = {400: "the body could not be parsed as JSON (nested too deeply?)"}


def framework_error(status: int, detail: str, headers: dict | None) -> ApiError:
    """Starlette's and FastAPI's own errors (no route, no such method, an unparsable body)
    as OpenAI errors. Their headers stay: a 405 must say what is Allowed (RFC 9110)."""
    return ApiError(status, HTTP_ERROR_MESSAGES.get(status, detail), "invalid_request_error",
                    HTTP_ERROR_CODES.get(status), headers=headers)


def not_json(content_type: str | None) -> ApiError | None:
    """A 415 for a body that failed validation and was not sent as JSON (no Content-Type,
    text/plain, a form: `curl -d` without `-H`). FastAPI parses a body as JSON only when
    it says it is JSON; this server follows it rather than guessing, because a browser
    sends text/plain (and forms) across sites without asking the server first (no CORS
    preflight), and a JSON-looking text/plain body would let any web page run generations
    on a local server. The answer says what to send, not "Input should be a valid
    dictionary" about a body that is one."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        return None
    return ApiError(415, f"the body must be JSON sent with Content-Type: application/json "
                    f"(got {media or 'no Content-Type'})", code="unsupported_media_type")


def validation_error(errors) -> ApiError:
    """A 400 naming the bad field (OpenAI's `param`), in place of FastAPI's 422. For a field
    of several accepted shapes (a prompt: text, texts, token ids...) pydantic reports every
    shape it tried; the error worth reading is the one of the shape that matched and broke
    a bound, not "Input should be a valid string" from the first shape tried."""
    first = errors[0] if errors else {"loc": (), "msg": "malformed request", "type": ""}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}",
                        code="invalid_json")
    fields = _fields(first)
    if not fields:
        return ApiError(400, f"the body must be a JSON object: {first.get('msg')}",
                        code="invalid_body")
    same_field = [error for error in errors if _fields(error)[:1] == fields[:1]]
    broken_bound = next((e for e in same_field if not e.get("type", "").endswith("_type")), None)
    chosen = broken_bound or first
    param = ".".join(_fields(chosen))
    if chosen.get("type") == "extra_forbidden":  # OpenAI's wording for a field it does not know
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    if fields[0] in NOT_SERVED:
        return ApiError(400, f"not supported by this server: {fields[0]} (only "
                        f"{NOT_SERVED[fields[0]]} is accepted)", param=fields[0],
                        code="unsupported_parameter")
    message = chosen.get("msg", "invalid value")
    if broken_bound is None and len(same_field) > 1:
        message = "the value has none of the accepted types"
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _fields(error) -> list[str]:
    """The error's location as field names and list indexes, without "body" and without
    the union members pydantic puts in it ('list[constrained-str]', 'str')."""
    return [str(part) for part in error.get("loc", ())
            if part != "body" and not _is_type_tag(str(part))]


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in part or part.startswith(
        ("function-", "constrained-"))
