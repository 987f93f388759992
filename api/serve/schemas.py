"""The HTTP edge's types: OpenAI-compatible requests and responses as pydantic models.

Pydantic lives here and nowhere further in: a request is validated into these models, then
turned into engine.service.GenerationRequest (plain frozen dataclasses) by api/serve/app.py.
Every bound the engine asserts (temperature >= 0, 0 < top_p <= 1, max_tokens >= 1,
non-empty stop strings) is a field constraint here, so a client's bad value is a 400 naming
the field, never an assertion inside the engine (STYLE 11: the client's error, not ours).

Fields OpenAI defines that this server does not serve (echo, best_of > 1, suffix, penalties,
logit_bias, tools, a non-text response_format) are accepted only at their neutral value:
anything else is a 400 naming the field, because ignoring them would be a success for
something not served.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

N_MAX = 8  # choices per prompt
CHOICES_MAX = 16  # prompts x n in one request
STOP_MAX = 4
LOGPROBS_MAX = 5  # completions: top alternatives per token
TOP_LOGPROBS_MAX = 20  # chat
PROMPTS_MAX = 16
MAX_TOKENS_MAX = 1 << 20  # beyond any context; the engine's own check says the real limit
COMPLETION_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS_DEFAULT = 256  # OpenAI has none; ours keeps a page reservation bounded
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

Stop = str | list[str] | None


class _Strict(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What both endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=N_MAX)
    stop: Stop = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not served: 0 only")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not served: 0 only")
    logit_bias: dict[str, float] | None = Field(None, max_length=0,
                                                description="not served: empty only")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: Stop) -> Stop:
        strings = [value] if isinstance(value, str) else list(value or [])
        if len(strings) > STOP_MAX:
            raise ValueError(f"at most {STOP_MAX} stop strings")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(..., description="text, texts, token ids, or lists of token ids")
    logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX)
    echo: bool = Field(False, description="not served: false only")
    best_of: int | None = Field(None, ge=1, le=1, description="not served: 1 only")
    suffix: str | None = Field(None, max_length=0, description="not served")

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: Prompt, info: ValidationInfo) -> Prompt:
        if isinstance(value, list):
            if not value:
                raise ValueError("the prompt list is empty")
            if any(isinstance(item, list) and not item for item in value):
                raise ValueError("a token-id prompt is empty")
        prompts = len(value) if isinstance(value, list) and not isinstance(value[0], int) else 1
        if prompts > PROMPTS_MAX:
            raise ValueError(f"at most {PROMPTS_MAX} prompts in one request")
        if prompts * info.data.get("n", 1) > CHOICES_MAX:
            raise ValueError(f"prompts x n is at most {CHOICES_MAX}")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
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
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
    tools: list[Any] | None = Field(None, max_length=0, description="not served")
    response_format: ResponseFormat | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
