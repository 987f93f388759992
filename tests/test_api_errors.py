"""The server's errors: the one outcome -> HTTP table, exhaustively; submit's refusals; a
malformed body named field by field (400, not FastAPI's 422); guard trips and refusals
end to end through the app (in-process, over the protocol-driven engine). The guard trips
are real: the bug zoo's switches (EngineConfig.bugs) turn a guard's partner off and the
engine's own guard catches what follows; nothing here fakes a failure."""

from __future__ import annotations

import itertools

import pytest
from fastapi.testclient import TestClient

from api.serve.app import create_app
from api.serve.errors import OUTCOME_ANSWERS, outcome_error, refusal_error
from engine.sampling import SamplingParams
from engine.service import (GUARDS, OUTCOMES, ContextTooLong, EngineStopped, Finished,
                            GenerationRequest, Overloaded)
from tests.api_cases import (assert_pools_whole, protocol_engine, tiny_chat_model,  # noqa: F401
                             wait_settled, wait_until)

EXPECTED = {  # outcome: (status, code) with no guard
    "Ok": (200, None), "Gone": (503, "request_aborted"),
    "ErrTooLong": (400, "context_length_exceeded"), "ErrPrefill": (500, "prefill_failed"),
    "ErrTransfer": (500, "kv_transfer_failed"), "ErrTag": (500, "kv_tag_mismatch"),
    "ErrTimeout": (504, "kv_transfer_timeout"), "ErrDecode": (500, "decode_failed"),
}


def finished(outcome: str, guard: str | None = None) -> Finished:
    return Finished(7, outcome, "stop" if outcome == "Ok" else None, guard, 3, 2,
                    detail="seen in the test")


def test_the_table_has_one_answer_per_outcome_in_the_contracts_order():
    assert tuple(OUTCOME_ANSWERS) == OUTCOMES
    assert {o: (a.status, a.code) for o, a in OUTCOME_ANSWERS.items()} == EXPECTED


@pytest.mark.parametrize("outcome,guard", list(itertools.product(OUTCOMES, (None,) + GUARDS)))
def test_every_outcome_and_guard_maps_to_one_answer(outcome, guard):
    error = outcome_error(finished(outcome, guard))
    if outcome == "Ok" and guard is None:
        assert error is None
        return
    assert error is not None and error.status >= 400  # never a success
    body = error.body()["error"]
    assert f"outcome {outcome}" in body["message"]
    if guard is None:
        assert (error.status, error.code) == EXPECTED[outcome]
    else:
        assert error.code == f"guard_{guard}"
        assert f"runtime guard '{guard}' tripped" in body["message"]
        assert error.status == (500 if outcome == "Ok" else EXPECTED[outcome][0])


def test_refusals_map_to_400_and_503_with_retry_after():
    too_long = refusal_error(ContextTooLong(600, 16, 512), "messages")
    assert (too_long.status, too_long.code, too_long.param) == (400, "context_length_exceeded",
                                                                "messages")
    assert "600 tokens" in too_long.message and "512" in too_long.message
    overloaded = refusal_error(Overloaded(64, 2.5))
    assert (overloaded.status, overloaded.code, overloaded.headers) == (
        503, "overloaded", {"Retry-After": "3"})
    stopped = refusal_error(EngineStopped("stopping"))
    assert (stopped.status, stopped.code) == (503, "engine_stopped")


@pytest.fixture(scope="module")
def client(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model)
    with TestClient(create_app(engine)) as test_client:
        test_client.engine = engine
        yield test_client


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
MALFORMED = [  # (endpoint, body, the field the 400 must name)
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 99}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, "stop.1"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 9}, "logprobs"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt.0"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt.1"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10_000]}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 512}, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 2, "max_tokens": 600},
     "max_tokens"),
    # Strict types: nothing is coerced (these were served as True and 3).
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2.5}, "n"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/chat/completions", CHAT | {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", CHAT | {"stream_options": {"include_usage": "often"}},
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", CHAT | {"cache_salt": "s" * 257}, "cache_salt"),
    ("/v1/chat/completions", CHAT | {"cache_salt": 7}, "cache_salt"),
]


@pytest.mark.parametrize("endpoint,body,field", MALFORMED)
def test_a_malformed_body_is_a_400_naming_the_field(client, endpoint, body, field):
    response = client.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", field)
    assert error["message"].startswith(field)


NOT_SERVED = [  # (endpoint, body): a field OpenAI defines at a value this server does not serve
    ("/v1/completions", {"prompt": "x", "echo": True}),
    ("/v1/completions", {"prompt": "x", "best_of": 2}),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -1}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}),
    ("/v1/chat/completions", CHAT | {"tool_choice": "auto"}),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}),
]


@pytest.mark.parametrize("endpoint,body", NOT_SERVED)
def test_an_unsupported_feature_is_named_as_such(client, endpoint, body):
    """Not validator wording ("List should have at most 0 items after validation"): the
    feature, named, with the value that is accepted."""
    field = next(key for key in body if key not in ("prompt", "messages", "max_tokens"))
    response = client.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", field, "unsupported_parameter")
    assert error["message"].startswith(f"not supported by this server: {field} (only ")


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "presence_penalty": 0,
                         "frequency_penalty": 0.0, "logit_bias": {}, "echo": False,
                         "best_of": 1, "suffix": "", "user": "u1"}),
    ("/v1/chat/completions", CHAT | {"tools": [], "tool_choice": "none", "logit_bias": None,
                                     "response_format": {"type": "text"}}),
])
def test_the_neutral_values_of_unsupported_features_are_served(client, endpoint, body):
    assert client.post(endpoint, json=body).status_code == 200


@pytest.mark.parametrize("endpoint,body,field", [
    ("/v1/completions", {"prompt": "x", "temprature": 0}, "temprature"),
    ("/v1/chat/completions", CHAT | {"max_token": 3}, "max_token"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": 1}]},
     "messages.0.colour"),
])
def test_an_unknown_field_is_refused_in_openais_words(client, endpoint, body, field):
    """OpenAI answers an argument it does not know with a 400 "Unrecognized request
    argument supplied: X"; ignoring it (as before) served a request that asked for
    something else (a typo like `temprature` sampled at temperature 1)."""
    response = client.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error == {"message": f"Unrecognized request argument supplied: {field}",
                     "type": "invalid_request_error", "param": field,
                     "code": "unknown_parameter"}


def test_top_p_zero_is_served_as_the_smallest_nucleus(client):
    """top_p=0 (OpenAI accepts it) keeps only the most likely token: greedy."""
    body = {"prompt": "The cat", "max_tokens": 6, "seed": 3}
    greedy = client.post("/v1/completions", json=body | {"temperature": 0})
    nucleus = client.post("/v1/completions", json=body | {"temperature": 1.5, "top_p": 0})
    assert (greedy.status_code, nucleus.status_code) == (200, 200), nucleus.text
    assert nucleus.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_bodies_that_are_not_json_objects_are_400s(client):
    for content in (b"{bad", b"[1, 2]", b""):
        response = client.post("/v1/completions", content=content,
                               headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (content, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    no_type = client.post("/v1/completions", content=b'{"prompt": "x"}')
    assert (no_type.status_code, no_type.json()["error"]["message"]) == (
        415, "the body must be JSON sent with Content-Type: application/json "
             "(got no Content-Type)")


def test_a_json_body_sent_as_another_media_type_is_a_415(client):
    """FastAPI parses a body as JSON only when its Content-Type says so, and so does this
    server (a browser sends text/plain and forms across sites without a CORS preflight);
    the answer says what to send instead of "Input should be a valid dictionary"."""
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        response = client.post("/v1/completions", content=b'{"prompt": "x"}',
                               headers={"Content-Type": f"{media}; charset=utf-8"})
        assert response.status_code == 415, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error",
                                                  "unsupported_media_type")
        assert error["message"] == ("the body must be JSON sent with Content-Type: "
                                    f"application/json (got {media})")


def test_deeply_nested_json_is_a_400_with_a_code(client):
    response = client.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    assert error["message"] == "the body could not be parsed as JSON (nested too deeply?)"


def test_an_undeclared_method_is_a_405_with_allow(client):
    """RFC 9110: a 405 lists the methods the resource takes (the handler used to drop it)."""
    for method, path, allowed in (("TRACE", "/v1/completions", "POST"),
                                  ("GET", "/v1/chat/completions", "POST"),
                                  ("DELETE", "/health", "GET")):
        response = client.request(method, path)
        assert response.status_code == 405
        assert response.headers["Allow"] == allowed
        assert response.json()["error"]["code"] == "method_not_allowed"


def test_unknown_routes_methods_and_models_are_openai_errors(client):
    assert client.get("/v1/nothing").json()["error"]["code"] == "not_found"
    assert client.get("/v1/completions").status_code == 405
    response = client.post("/v1/chat/completions", json=CHAT | {"model": "gpt-9"})
    assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")
    assert client.post("/v1/chat/completions", json=CHAT | {"model": "default"}).status_code == 200


def test_an_over_long_prompt_is_a_400_before_anything_is_allocated(client):
    # An earlier test's request may still hold pages after its answer (release waits for
    # the prefill's final word): start from whole pools, so any page held after is ours.
    wait_settled(client.engine)
    submitted_before = len(client.engine.submitted)
    response = client.post("/v1/completions", json={"prompt": "x" * 600, "max_tokens": 4})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert response.json()["error"]["param"] == "prompt"
    assert len(client.engine.submitted) == submitted_before  # refused inside submit
    assert client.engine.snapshot().rejects["too long"] >= 1
    assert_pools_whole(client.engine.snapshot())


SMALL = dict(context_length=64, page_tokens=4, prefill_pool_tokens=64, decode_pool_tokens=64)
# (name, engine config, completions body, status, code): each a real failure of the engine.
FAILURES = [
    # The prefill pool (32 tokens) is below the context (PoolBelowContext): the prefill
    # worker rejects the 44-token request, the core answers ErrTooLong.
    ("rejected by the prefill", SMALL | dict(prefill_pool_tokens=32, bugs={"PoolBelowContext"}),
     {"prompt": "x" * 40, "max_tokens": 4}, 400, "context_length_exceeded"),
    # ... and with FinishedNotRejected the placeholder is sent (one page of eleven): the
    # count guard fails the transfer (the 2026 incident's first line of defence).
    ("count", SMALL | dict(prefill_pool_tokens=32,
                           bugs={"PoolBelowContext", "FinishedNotRejected"}),
     {"prompt": "x" * 40, "max_tokens": 4}, 500, "guard_count"),
    # SourceReuse: the first prompt's source pages are freed when its writes are posted,
    # the second prompt is computed into them before the writes read them: the checksum
    # guard fails the first one's transfer (the whole answer is that error).
    ("checksum", dict(context_length=12, page_tokens=4, prefill_pool_tokens=12,
                      decode_pool_tokens=64, bugs={"SourceReuse"}),
     {"prompt": ["abcdefgh", "ijklmnop"], "max_tokens": 4}, 500, "guard_checksum"),
    # The transfer timeout (50 ms from the prefill's Admit) is shorter than the prefill (11
    # chunks of 4 tokens, 20 ms a step): decode gives up waiting for the KV. (The startup
    # timing check, which refuses such timers, is skipped: context_prefill_s=0.)
    ("timeout", SMALL | dict(transfer_timeout_s=0.05, step_delay_s=0.02, prefill_chunk_tokens=4,
                             context_prefill_s=0),
     {"prompt": "x" * 40, "max_tokens": 4}, 504, "kv_transfer_timeout"),
]


@pytest.mark.parametrize("name,config,body,status,code", FAILURES, ids=[f[0] for f in FAILURES])
def test_a_failure_before_the_first_token_is_its_own_http_status(tiny_chat_model, name,  # noqa: F811
                                                                   config, body, status, code):
    engine = protocol_engine(tiny_chat_model, **config)
    with TestClient(create_app(engine)) as client:
        for stream in (False, True):
            response = client.post("/v1/completions", json=body | {"stream": stream,
                                                                   "temperature": 0})
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["code"] == code
            if code.startswith("guard_"):
                assert f"runtime guard '{name}' tripped" in error["message"]
        snapshot = wait_settled(engine)
    guard = code[len("guard_"):] if code.startswith("guard_") else None
    assert snapshot.guard_trips == ({guard: 2} if guard else {})
    assert_pools_whole(snapshot)
    assert engine.inner.runtime.whole()


def test_a_guard_trip_after_the_first_token_ends_the_stream_with_an_error_event(
        tiny_chat_model):  # noqa: F811
    """The incident with the count check off too (NoCountCheck): decode accepts the one
    page sent, the prefill's first token goes out, and the first decode step's tag check
    fails the request. A whole answer is a 500; a stream, already a 200, ends with an
    error event, no finish_reason and no [DONE]."""
    import json

    engine = protocol_engine(tiny_chat_model, **SMALL | dict(
        prefill_pool_tokens=32, bugs={"PoolBelowContext", "FinishedNotRejected",
                                      "NoCountCheck"}))
    body = {"prompt": "x" * 40, "max_tokens": 4, "temperature": 0}
    with TestClient(create_app(engine)) as client:
        whole = client.post("/v1/completions", json=body)
        assert (whole.status_code, whole.json()["error"]["code"]) == (500, "guard_tag")
        response = client.post("/v1/completions", json=body | {"stream": True})
        snapshot = wait_settled(engine)
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events and len(events) == 2  # the first token, then the error
    assert json.loads(events[-1])["error"]["code"] == "guard_tag"
    first = json.loads(events[0])["choices"][0]
    assert first["finish_reason"] is None and len(first["text"]) == 1
    assert snapshot.guard_trips == {"tag": 2} and snapshot.outcomes == {"ErrTag": 2}
    assert_pools_whole(snapshot)


def test_overloaded_is_a_503_with_retry_after(tiny_chat_model):  # noqa: F811
    """The admission queue (max_queued=1) is full: one request waits in the inbox of an
    engine not started yet, so nothing drains it while the server answers."""
    engine = protocol_engine(tiny_chat_model, max_queued=1, retry_after_s=2.0)
    waiting = GenerationRequest((5, 6, 7), SamplingParams(max_tokens=2))
    events = []
    with TestClient(create_app(engine, start_engine=False)) as overloaded:
        engine.submit(waiting, events.append)
        response = overloaded.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "2"
        assert response.json()["error"]["code"] == "overloaded"
        assert engine.snapshot().rejects == {"capacity": 1}
        assert len(engine.submitted) == 1
        engine.start()
        wait_until(lambda: events and isinstance(events[-1], Finished), what="the waiting one")
    assert events[-1].outcome == "Ok"
    assert_pools_whole(engine.snapshot())


def test_n_choices_partly_refused_abort_the_ones_submitted(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model, max_queued=1)
    with TestClient(create_app(engine, start_engine=False)) as client_:
        response = client_.post("/v1/chat/completions", json=CHAT | {"n": 3})
        assert response.status_code == 503
        assert len(engine.submitted) == 1 and dict(engine.aborts) == {engine.submitted[0]: 1}
        engine.start()
        wait_until(lambda: engine.snapshot().outcomes == {"Gone": 1})
        wait_settled(engine)


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"top_p": 5e-324}, {"seed": 1 << 70},
                                     {"temperature": 2.0, "top_p": 1e-30}])
def test_extreme_sampling_values_found_by_schemathesis_are_served(client, extreme):
    """engine/sampling.py raises on these (logits / 1e-300 overflow; top_p 5e-324 is 0 in
    fp32): the edge serves them as greedy / top-token-only instead of a 500. A seed past
    int64 is a JSON integer like any other: folded into 64 bits, not refused."""
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3} | extreme)
    assert response.status_code == 200, response.text
    assert client.engine.inner.error is None


def test_the_openapi_schema_documents_400_not_422(client):
    schema = client.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "503"} <= set(responses)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_aborted_by_a_stopping_server_is_a_503_or_an_error_event(
        tiny_chat_model, stream):  # noqa: F811
    """Gone, end to end: the server stops with no drain time while a request decodes; the
    engine aborts it through the protocol and the client is told, never sent a success."""
    import json
    import threading

    engine = protocol_engine(tiny_chat_model, step_delay_s=0.02)
    app = create_app(engine)

    def stop_once_running() -> None:
        def accepted() -> bool:  # decode has the KV: the first token is out
            recent = engine.snapshot().recent
            return bool(recent) and any(action.startswith("Accept")
                                        for _at, action in recent[-1].timeline)
        wait_until(accepted, what="the request to decode")
        app.state.lifetime.stop(drain_s=0)

    with TestClient(app) as client:
        stopper = threading.Thread(target=stop_once_running)
        stopper.start()
        response = client.post("/v1/completions", json={
            "prompt": "stop", "max_tokens": 300, "temperature": 0, "stream": stream})
        stopper.join(30)
    snapshot = engine.snapshot()
    assert snapshot.outcomes == {"Gone": 1}
    assert_pools_whole(snapshot)
    if not stream:
        assert response.status_code == 503
        error = response.json()["error"]
    else:
        assert response.status_code == 200
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        error = json.loads(events[-1])["error"]
    # The server stopped it, and says so: not "client gone ... (the client went away)".
    assert (error["type"], error["code"]) == ("server_error", "request_aborted")
    assert error["message"] == ("the server is stopping: it aborted the request before it "
                                "finished [outcome Gone]")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_loop_is_a_500_decode_failed_not_a_hang(tiny_chat_model):  # noqa: F811
    """ErrDecode, end to end: the engine's loop dies (a bug in a step, put there by the
    test); every live request is failed with the error, and the client gets a 500."""
    engine = protocol_engine(tiny_chat_model)
    runtime = engine.inner.runtime
    idle_step = runtime.step

    def broken_step():
        if runtime.live:
            raise RuntimeError("a bug in a step")
        return idle_step()
    runtime.step = broken_step
    with TestClient(create_app(engine)) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "decode_failed" and "a bug in a step" in error["message"]
        late = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert (late.status_code, late.json()["error"]["code"]) == (503, "engine_stopped")
    assert isinstance(engine.inner.error, RuntimeError)


def test_a_failing_prefill_is_a_500_prefill_failed_and_the_others_are_served(
        tiny_chat_model):  # noqa: F811
    """ErrPrefill, end to end: the prefill's model step runs out of memory for every chunk
    holding '#' (tests/engine_cases.py's FaultyPrefill; the engine isolates the request by
    retrying its batch chunk by chunk), and the core's PrefillFail answers that request
    alone. A whole answer and a stream that fails before its first token are a 500
    prefill_failed; a stream whose other choice already sent tokens ends with the error
    event (no [DONE]); the requests next to it get 200; /metrics counts the outcome."""
    import json

    from tests.api_cases import VOCAB
    from tests.engine_cases import FaultyPrefill
    from tests.test_api_load import metric

    engine = protocol_engine(tiny_chat_model, **SMALL | dict(prefill_chunk_tokens=4))
    runtime = engine.inner.runtime
    faulty = FaultyPrefill(runtime.model, VOCAB.index("#"), "raise")
    runtime.prefill.model = faulty
    failing = {"prompt": "ab#", "max_tokens": 4, "temperature": 0}
    fine = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
    with TestClient(create_app(engine)) as client:
        for stream in (False, True):
            response = client.post("/v1/completions", json=failing | {"stream": stream})
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "server_error", "prefill_failed", None)
            assert "OutOfMemoryError: CUDA out of memory" in error["message"]
            assert "[outcome ErrPrefill]" in error["message"]
            assert client.post("/v1/completions", json=fine | {"stream": stream}
                               ).status_code == 200
        # Two choices: "ab" streams its first token while the 31-token prompt is still
        # computing, four tokens a step; the chunk holding its '#' (the last, 8 steps on)
        # fails. Whether "ab" has ended by then (the random model may pick its end token
        # early; the server may hand the choices to the loop a step apart) decides only
        # its own outcome: Ok, or Gone when the error ends the stream.
        response = client.post("/v1/completions", json={
            "prompt": ["ab", "x" * 30 + "#"], "max_tokens": 8, "temperature": 0,
            "stream": True})
        assert response.status_code == 200
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events and len(events) >= 2
        assert json.loads(events[0])["choices"][0]["index"] == 0
        assert json.loads(events[-1])["error"]["code"] == "prefill_failed"
        snapshot = wait_settled(engine)
        text = client.get("/metrics").text
    assert snapshot.outcomes in ({"ErrPrefill": 3, "Ok": 2, "Gone": 1},
                                 {"ErrPrefill": 3, "Ok": 3})
    assert metric(text, "kvproof_outcomes_total", outcome="ErrPrefill") == 3
    assert metric(text, "kvproof_http_responses_total", endpoint="/v1/completions",
                  status="500") == 2
    assert metric(text, "kvproof_http_responses_total", endpoint="/v1/completions",
                  status="200") == 3
    assert snapshot.guard_trips == {}
    assert len(faulty.failed_batches) >= 3
    assert_pools_whole(snapshot)
    assert runtime.whole() and engine.inner.error is None
