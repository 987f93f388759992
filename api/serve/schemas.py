"""The HTTP edge's types: OpenAI-compatible requests and responses as pydantic models.

Pydantic lives here and nowhere further in: a request is validated into these models, then
turned into engine.service.GenerationRequest (plain frozen dataclasses) by api/serve/app.py.
Every bound the engine asserts (temperature >= 0, 0 <= top_p <= 1, max_tokens >= 1,
non-empty stop strings) is a field constraint here, so a client's bad value is a 400 naming
the field, never an assertion inside the engine (STYLE 11: the client's error, not ours).
The constraints are the published OpenAPI schema too: a body the schema calls valid is
refused only for what no schema can say (a prompt longer than the context in tokens, text
the tokenizer cannot read, a full queue).

Types are strict: `"stream": "yes"` or `"max_tokens": "3"` is a 400 naming the field, not a
guess. A field this server does not know is a 400 too, worded as OpenAI words it
("Unrecognized request argument supplied: X"): ignoring it would be a success for a request
that asked for something else.

Fields OpenAI defines that this server does not serve (`NOT_SERVED`: echo, best_of > 1,
suffix, penalties, logit_bias, tools, a non-text response_format) are accepted only at
their neutral value, which changes nothing; anything else is a 400 "not supported by this
server: <field>" with the field as `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

N_MAX = 8  # choices per prompt (a request has at most PROMPTS_MAX x N_MAX choices)
STOP_MAX = 4
LOGPROBS_MAX = 5  # completions: top alternatives per token
TOP_LOGPROBS_MAX = 20  # chat
PROMPTS_MAX = 16
CACHE_SALT_LENGTH_MAX = 256
# Beyond any context: the app writes the context's own bound over it in the published
# schema and checks that bound (api/serve/app.py), the engine checks prompt + max_tokens.
MAX_TOKENS_MAX = 1 << 20
COMPLETION_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS_DEFAULT = 256  # OpenAI has none; ours keeps a page reservation bounded

# field -> the neutral values accepted, as the client reads them (one table: the schema's
# descriptions and the 400's wording both come from it).
NOT_SERVED = {
    "presence_penalty": "0", "frequency_penalty": "0", "logit_bias": "null or {}",
    "echo": "false", "best_of": "null or 1", "suffix": "null or \"\"",
    "tools": "null or []", "tool_choice": "null or \"none\"",
    "response_format": 'null or {"type": "text"}',
}


def _not_served(default, field: str, **constraints):
    return Field(default, description=f"not supported by this server: only "
                 f"{NOT_SERVED[field]} is accepted", **constraints)


def _integral(value):
    """JSON Schema counts 3.0 as an integer, so this server does too (and only that: "3",
    3.5 and true stay refused by the strict type)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds):  # noqa: N802 - a type
    """An integer field type with its bounds (before the validator, or the published schema
    loses them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Text = Annotated[str, Field(min_length=1)]
Stop = Text | Annotated[list[Text], Field(max_length=STOP_MAX)] | None


class _Strict(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What both endpoints share."""

    model: str | None = None
    n: Int(ge=1, le=N_MAX) = 1
    stop: Stop = None
    seed: Int() | None = Field(None, description="any integer (folded into 64 bits)")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0, description="0 keeps only the most likely token")
    max_tokens: Int(ge=1, le=MAX_TOKENS_MAX) | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(
        None, min_length=1, max_length=CACHE_SALT_LENGTH_MAX,
        description="requests share cached KV only when their prefix and salt both match "
        "(vLLM's and TensorRT-LLM's name); the salt is also the tenant's (the API key's) "
        "unless the server shares its cache across keys; an empty salt is refused")
    presence_penalty: float = _not_served(0.0, "presence_penalty", ge=0.0, le=0.0)
    frequency_penalty: float = _not_served(0.0, "frequency_penalty", ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = _not_served(None, "logit_bias", max_length=0)

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# The largest token id depends on the model: the app writes it into its published schema
# (api/serve/app.py) where this marker stands.
TOKEN_ID_MARKER = "x-kvproof-token-id"
TokenIds = Annotated[list[Int(ge=0, json_schema_extra={TOKEN_ID_MARKER: True})],
                     Field(min_length=1)]
Prompt = (Text | Annotated[list[Text], Field(min_length=1, max_length=PROMPTS_MAX)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1, max_length=PROMPTS_MAX)])


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(..., description="text, texts, token ids, or lists of token ids")
    logprobs: Int(ge=0, le=LOGPROBS_MAX) | None = None
    echo: bool = _not_served(False, "echo", json_schema_extra={"const": False})
    best_of: Int(ge=1, le=1) | None = _not_served(None, "best_of")
    suffix: str | None = _not_served(None, "suffix", max_length=0)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:  # a bool, not Literal[False]: that takes 0
        if value:
            raise ValueError("echo is not served")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        if all(isinstance(item, int) for item in value):
            return [list(value)]
        return list(value)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    # top_logprobs needs logprobs: true (the validator below), said in the schema too.
    model_config = ConfigDict(json_schema_extra={
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    max_completion_tokens: Int(ge=1, le=MAX_TOKENS_MAX) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=TOP_LOGPROBS_MAX) | None = None
    tools: list[Any] | None = _not_served(None, "tools", max_length=0)
    tool_choice: Literal["none"] | None = _not_served(None, "tool_choice")
    response_format: ResponseFormat | None = _not_served(None, "response_format")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses -------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV decode read from its "
                               "prefix cache instead of having it sent (0 without a cache)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvproof"
    context_length: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Health(BaseModel):
    status: Literal["ok", "stopping"]
    model: str
    queued: int
    running: int
