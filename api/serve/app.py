"""The FastAPI app: OpenAI-compatible endpoints over any engine.service.Engine.

    POST /v1/completions        text or token-id prompts; n, stop, seed, logprobs, stream
    POST /v1/chat/completions   messages through the model's chat template; the same options
    GET  /v1/models             the one model served
    GET  /v1/models/{model_id}  that model (404 for any other id)
    GET  /health                200 while serving, 503 once stopping
    GET  /metrics               Prometheus text (api/serve/metrics.py)
    GET  /v1/kvproof/state      engine.snapshot() as JSON, for the dashboard
    GET  /                      the dashboard (static HTML + JS, polls the state)

The app owns the engine's lifetime: the lifespan starts it, and `EngineLifetime.stop`
(SIGTERM in `kvproof serve`, or the lifespan's end) stops it once. Errors of every kind
leave as OpenAI error bodies (api/serve/errors.py); FastAPI's 422 for a malformed body is
replaced by a 400 naming the field. A body passes api/serve/intake.py before it is parsed
(a size bound: 413), and prompts are tokenized there, off the event loop.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.serve import generation
from api.serve.auth import TENANT_SCOPE, ApiKeys, RequireApiKey
from api.serve.errors import ApiError, framework_error, not_json, validation_error
from api.serve.intake import (ADMITTED, REQUEST_BODY_BYTES_MAX, AdmissionGate, BodyLimit,
                              Tokenizing)
from api.serve.metrics import ServerMetrics, endpoint_label
from api.serve.schemas import (CHAT_MAX_TOKENS_DEFAULT, COMPLETION_MAX_TOKENS_DEFAULT,
                               ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                               CompletionResponse, ErrorResponse, Health, ModelCard, ModelList,
                               MAX_TOKENS_MAX, TOKEN_ID_MARKER)
from api.serve.wire import ChatWire, CompletionWire

DASHBOARD = Path(__file__).with_name("dashboard.html")
INITIAL_STATE = '<script id="initial-state" type="application/json">null</script>'
MODEL_ALIASES = ("default",)  # besides the engine's own model name
ERROR_RESPONSES = {status: {"model": ErrorResponse}
                   for status in (400, 401, 404, 413, 415, 500, 503, 504)}
# A stream's events as Schemathesis and OpenAPI 3.2 read them: each event an object whose
# `data` is one JSON chunk (chat.completion.chunk / text_completion / an error) or [DONE].
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
GENERATION_RESPONSES = ERROR_RESPONSES | {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}}}


class EngineLifetime:
    """Starts the engine once and stops it once, whoever asks first."""

    def __init__(self, engine):
        self.engine = engine
        self.stopping = False
        self._lock = threading.Lock()
        self.started_s = time.time()

    def start(self) -> None:
        self.engine.start()

    def stop(self, drain_s: float = 0.0) -> None:
        with self._lock:
            if self.stopping:
                return
            self.stopping = True
        self.engine.stop(drain_s)


def create_app(engine, *, drain_s: float = 0.0, start_engine: bool = True,
               request_body_bytes_max: int = REQUEST_BODY_BYTES_MAX,
               api_keys: ApiKeys | None = None,
               share_prefix_cache_across_keys: bool = False) -> FastAPI:
    lifetime = EngineLifetime(engine)
    metrics = ServerMetrics(engine)
    tokenizing = Tokenizing()

    @asynccontextmanager
    async def lifespan(_app):
        if start_engine:
            lifetime.start()
        yield
        lifetime.stop(drain_s)
        tokenizing.close()

    app = FastAPI(title="kvproof", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible serving over the kvproof engine")
    app.state.engine, app.state.lifetime, app.state.metrics = engine, lifetime, metrics
    _add_error_handlers(app, metrics)
    _add_generation_routes(app, engine, metrics, tokenizing, share_prefix_cache_across_keys)
    _add_info_routes(app, engine, lifetime, metrics)
    app.add_middleware(BodyLimit, body_bytes_max=request_body_bytes_max, on_refused=lambda scope:
                       metrics.responses.labels(endpoint_label(scope, app.routes), "413").inc())
    # Outermost: a request the engine cannot admit is answered before its body is read.
    # Its paths are routes' own templates (GENERATION_PATHS): no route matching per refusal.
    app.add_middleware(AdmissionGate, engine=engine, pending_max=tokenizing.waiting_max,
                       on_refused=lambda scope:
                       metrics.responses.labels(scope["path"], "503").inc())
    if api_keys is not None:  # outside the gate: a request without a key learns nothing more
        app.add_middleware(RequireApiKey, keys=api_keys, on_refused=lambda scope:
                           metrics.responses.labels(endpoint_label(scope, app.routes),
                                                    "401").inc())
    app.openapi = lambda: _openapi_without_422(app, engine)
    return app


def _openapi_without_422(app: FastAPI, engine) -> dict:
    """FastAPI documents a 422 for every body it validates; this server answers those with
    a 400 (documented on each operation), so the 422 entries would be false. The bounds
    that depend on the model (the largest token id, max_tokens below the context) are
    written in, so that a body the schema calls valid is one this server can take."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        _write_model_bounds(schema, _vocabulary(engine) - 1, engine.context_length - 1)
        app.openapi_schema = schema
    return app.openapi_schema


def _write_model_bounds(node, token_id_max: int, max_tokens_max: int) -> None:
    if isinstance(node, list):
        for item in node:
            _write_model_bounds(item, token_id_max, max_tokens_max)
        return
    if not isinstance(node, dict):
        return
    if node.pop(TOKEN_ID_MARKER, False):
        node["maximum"] = token_id_max
    if node.get("maximum") == MAX_TOKENS_MAX:
        node["maximum"] = max_tokens_max
    for value in node.values():
        _write_model_bounds(value, token_id_max, max_tokens_max)


def _vocabulary(engine) -> int:
    return engine.tokenizer.backend.get_vocab_size()


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def answer(request: Request, error: ApiError) -> JSONResponse:
        metrics.responses.labels(endpoint_label(request.scope), str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return answer(request, error)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, error: RequestValidationError):
        return answer(request, not_json(request.headers.get("content-type"))
                      or validation_error(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return answer(request, framework_error(error.status_code, str(error.detail),
                                               error.headers))


def _model_name(engine, requested: str | None) -> str:
    if requested not in (None, engine.model_name, *MODEL_ALIASES):
        raise ApiError(404, f"the model {requested!r} is not served here (this server "
                       f"serves {engine.model_name!r})", code="model_not_found", param="model")
    return engine.model_name


def _add_generation_routes(app: FastAPI, engine, metrics: ServerMetrics,
                           tokenizing: Tokenizing, across_keys: bool = False) -> None:
    def salt(request: Request, body) -> int:
        return generation.salt_for(request.scope.get(TENANT_SCOPE), body.cache_salt,
                                   across_keys)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        received_s = time.perf_counter()
        model = _model_name(engine, body.model)
        _check_token_limits(engine, body)
        prompts = await tokenizing.run(_prompts_ids, engine, body.prompts())
        plan = generation.Plan(
            prompts=prompts, n=body.n, logprobs=body.logprobs, stream=body.stream,
            include_usage=body.include_usage(), prompt_param="prompt",
            cache_salt=salt(request, body),
            tenant=generation.tenant_for(request.scope.get(TENANT_SCOPE)),
            sampling=generation.sampling_for(
                len(prompts), body.n, max_tokens=body.max_tokens or COMPLETION_MAX_TOKENS_DEFAULT,
                temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                stop=body.stop_strings()))
        wire = CompletionWire(model, engine.tokenizer, body.logprobs)
        return await _serve(request, engine, plan, wire, metrics, received_s)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        received_s = time.perf_counter()
        model = _model_name(engine, body.model)
        _check_token_limits(engine, body)
        prompt = await tokenizing.run(_chat_ids, engine, body)
        max_tokens = body.token_limit() or max(
            1, min(CHAT_MAX_TOKENS_DEFAULT, engine.context_length - len(prompt)))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        plan = generation.Plan(
            prompts=(prompt,), n=body.n, logprobs=logprobs, stream=body.stream,
            include_usage=body.include_usage(), prompt_param="messages",
            cache_salt=salt(request, body),
            tenant=generation.tenant_for(request.scope.get(TENANT_SCOPE)),
            sampling=generation.sampling_for(
                1, body.n, max_tokens=max_tokens, temperature=body.temperature,
                top_p=body.top_p, seed=body.seed, stop=body.stop_strings()))
        wire = ChatWire(model, engine.tokenizer, logprobs)
        return await _serve(request, engine, plan, wire, metrics, received_s)


def _check_token_limits(engine, body) -> None:
    """max_tokens (and max_completion_tokens) below the context, as the published schema
    says, whichever of the two is used: a prompt is at least one token."""
    limit = engine.context_length - 1
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, name, None)
        if value is not None and value > limit:
            raise ApiError(400, f"{name}: at most {limit} (the context is "
                           f"{engine.context_length} tokens, a prompt at least 1)", param=name,
                           code="context_length_exceeded")


async def _serve(request: Request, engine, plan, wire, metrics, received_s: float):
    path = endpoint_label(request.scope)
    admitted = request.scope.get(ADMITTED, lambda queued_tokens=None: None)
    try:
        choices = generation.submit_all(engine, plan)
    except BaseException:
        admitted()  # the gate counts it no more
        raise
    admitted(plan.prompt_tokens() * plan.n)  # and learns what such a body queues
    timings = generation.Timings(metrics, received_s)
    if not plan.stream:
        body = await generation.answer_whole(request, choices, plan, wire, timings)
        if body is None:
            raise generation.client_closed()
        metrics.responses.labels(path, "200").inc()
        return JSONResponse(body)
    first = await generation.first_event(request, choices)
    if first is None:
        raise generation.client_closed()
    metrics.responses.labels(path, "200").inc()
    return AbortingStream(choices, generation.stream(choices, plan, wire, timings, first),
                          media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class AbortingStream(StreamingResponse):
    """A stream that aborts its unfinished choices however the response ends: the body
    generator's own `finally` does not run when a client leaves before the first chunk
    is pulled (an unstarted generator is dropped, not closed)."""

    def __init__(self, choices, content, **kwargs):
        super().__init__(content, **kwargs)
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.choices.abort_unfinished()


def _encode(param: str, encode, text: str) -> list[int]:
    """Token ids of a client's text; text the tokenizer cannot read (a lone surrogate) is
    the client's error, not ours."""
    try:
        return list(encode(text))
    except Exception as error:  # tokenizers raises bare exceptions on unencodable text
        raise ApiError(400, f"{param}: the text cannot be tokenized ({error})", param=param,
                       code="invalid_value") from None


def _prompts_ids(engine, prompts) -> tuple[tuple[int, ...], ...]:
    """Every prompt's token ids (on a tokenizing thread)."""
    return tuple(_prompt_ids(engine, prompt) for prompt in prompts)


def _prompt_ids(engine, prompt) -> tuple[int, ...]:
    if isinstance(prompt, str):
        ids = _encode("prompt", engine.tokenizer.encode, prompt)
    else:
        vocabulary = _vocabulary(engine)
        bad = [token for token in prompt if not 0 <= token < vocabulary]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary "
                           f"(0..{vocabulary - 1})", param="prompt", code="invalid_value")
        ids = list(prompt)
    if not ids:
        raise ApiError(400, "prompt: no tokens (the prompt is empty)", param="prompt",
                       code="invalid_value")
    return tuple(ids)


def _chat_ids(engine, body: ChatCompletionRequest) -> tuple[int, ...]:
    """The chat's token ids through the model's template (on a tokenizing thread)."""
    from engine.config import ModelFileError

    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = engine.tokenizer.render_chat(messages)
    except ModelFileError as error:  # no template, or the template refused the messages
        raise ApiError(400, f"messages: {error}", param="messages",
                       code="invalid_value") from None
    ids = _encode("messages", lambda t: engine.tokenizer.backend.encode(
        t, add_special_tokens=False).ids, text)
    if not ids:
        raise ApiError(400, "messages: no tokens", param="messages", code="invalid_value")
    return tuple(ids)


def _add_info_routes(app: FastAPI, engine, lifetime: EngineLifetime,
                     metrics: ServerMetrics) -> None:
    def card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": int(lifetime.started_s),
                "owned_by": "kvproof", "context_length": engine.context_length}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses={404: {"model": ErrorResponse}})
    async def model(model_id: str):
        _model_name(engine, model_id)  # a 404 for any other id
        return card()

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        snapshot = engine.snapshot()
        body = {"status": "stopping" if lifetime.stopping else "ok", "model": engine.model_name,
                "queued": snapshot.queued, "running": snapshot.running}
        return JSONResponse(body, status_code=503 if lifetime.stopping else 200)

    @app.get("/metrics", response_class=Response)
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/kvproof/state")
    async def state():
        return state_json(engine, lifetime, metrics)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard():
        return HTMLResponse(dashboard_html(state_json(engine, lifetime, metrics)))


def state_json(engine, lifetime: EngineLifetime, metrics: ServerMetrics) -> dict:
    """engine.snapshot() as JSON, with what the dashboard shows beside it: each recent
    request's name as the protocol's trace labels write it (spec/core.py RequestEvent.label
    without a model: r1 is request 0), and the server's own counts (answers by status, the
    time to first token's sum and count) that it charts."""
    snapshot = dataclasses.asdict(engine.snapshot())
    for request in snapshot["recent"]:
        request["name"] = f"r{request['request_id'] + 1}"
    return {"model": engine.model_name, "context_length": engine.context_length,
            "uptime_s": round(time.time() - lifetime.started_s, 3),
            "stopping": lifetime.stopping, "http": _http_counts(metrics)} | snapshot


def _http_counts(metrics: ServerMetrics) -> dict:
    responses: dict[str, int] = {}
    for family in metrics.responses.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                status = sample.labels["status"]
                responses[status] = responses.get(status, 0) + int(sample.value)
    ttft = {sample.name.rsplit("_", 1)[1]: sample.value
            for family in metrics.time_to_first_token.collect() for sample in family.samples
            if sample.name.endswith(("_sum", "_count"))}
    return {"responses": responses, "time_to_first_token_s_sum": ttft["sum"],
            "time_to_first_token_count": int(ttft["count"])}


def dashboard_html(state: dict) -> str:
    """The page with the state it draws first embedded, so that its first paint shows the
    server rather than "loading…" (`<` escaped: the JSON cannot end the script element)."""
    page = DASHBOARD.read_text()
    assert page.count(INITIAL_STATE) == 1, "the dashboard's initial-state element"
    return page.replace(INITIAL_STATE, INITIAL_STATE.replace(
        "null", json.dumps(state).replace("<", "\\u003c")))
