"""The server as OpenAI's own client sees it, over a live uvicorn on 127.0.0.1: chat,
completions, streaming with usage, n, stop, seed, logprobs, and the over-long prompt."""

from __future__ import annotations

import httpx
import openai
import pytest

from api.serve.app import create_app
from tests.api_cases import LiveServer, protocol_engine, tiny_chat_model, wait_settled  # noqa: F401


@pytest.fixture(scope="module")
def served(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model)
    with LiveServer(create_app(engine)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        yield server, engine, client


def test_models_and_health(served):
    server, engine, client = served
    models = client.models.list().data
    assert [m.id for m in models] == [engine.model_name]
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["model"] == engine.model_name


def test_chat_completion(served):
    _server, engine, client = served
    reply = client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "Hello"}],
        max_tokens=7, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert reply.usage.prompt_tokens == len("<user>Hello\n<assistant>")  # one token a character
    assert reply.usage.completion_tokens == len(choice.message.content) <= 7
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_text_completion_with_logprobs_is_greedy_and_consistent(served):
    _server, _engine, client = served
    reply = client.completions.create(model="default", prompt="The cat", max_tokens=6,
                                      temperature=0, logprobs=2)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 6
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == list(range(6))
    for chosen, token, top in zip(logprobs.token_logprobs, logprobs.tokens, logprobs.top_logprobs):
        assert len(top) == 2 and chosen <= 0
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy: the top token
        assert top[token] == pytest.approx(chosen, abs=1e-5)


def test_streaming_chat_gives_the_same_text_and_usage_at_the_end(served):
    _server, _engine, client = served
    arguments = dict(model="default", messages=[{"role": "user", "content": "Tell me"}],
                     max_tokens=9, temperature=0)
    whole = client.chat.completions.create(**arguments)
    chunks = list(client.chat.completions.create(
        **arguments, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_with_n_and_a_seed_reproduces(served):
    _server, _engine, client = served
    arguments = dict(model="default", prompt="Once", max_tokens=8, temperature=1.0, top_p=0.9,
                     n=3, seed=1234)
    first = client.completions.create(**arguments)
    again = client.completions.create(**arguments)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # seed + i per choice
    texts = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(**arguments, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in first.choices]


def test_stop_strings_are_cut_and_finish_with_stop(served):
    _server, _engine, client = served
    free = client.completions.create(model="default", prompt="abc", max_tokens=12,
                                     temperature=0).choices[0].text
    stop = free[3:5]  # two characters the greedy text certainly contains
    cut = free[:free.index(stop)]
    for stream in (False, True):
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="default", prompt="abc", max_tokens=12, temperature=0, stop=[stop],
                stream=True) if c.choices)
        else:
            reply = client.completions.create(model="default", prompt="abc", max_tokens=12,
                                              temperature=0, stop=stop)
            assert reply.choices[0].finish_reason == "stop"
            text = reply.choices[0].text
        assert text == cut


def test_an_over_long_prompt_gets_context_length_exceeded(served):
    _server, engine, client = served
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="default", max_completion_tokens=4,
                                       messages=[{"role": "user", "content": "x" * 600}])
    assert raised.value.status_code == 400
    assert raised.value.code == "context_length_exceeded"
    assert raised.value.param == "messages"
    assert wait_settled(engine).rejects["too long"] == 1


def test_models_retrieve_returns_the_model_and_a_404_for_any_other(served):
    _server, engine, client = served
    model = client.models.retrieve(engine.model_name)
    assert (model.id, model.object, model.owned_by) == (engine.model_name, "model", "kvproof")
    assert client.models.retrieve("default").id == engine.model_name
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-9")
    assert (raised.value.code, raised.value.param, raised.value.type) == (
        "model_not_found", "model", "invalid_request_error")


def test_the_clients_errors_name_the_parameter(served):
    """OpenAI's conventions as the client reads them (error.code, error.param): a feature
    not served, an argument not known, a value of the wrong type."""
    _server, _engine, client = served
    chat = dict(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    cases = [
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
         "tools", "unsupported_parameter", "not supported by this server: tools"),
        (dict(presence_penalty=0.5), "presence_penalty", "unsupported_parameter",
         "not supported by this server: presence_penalty"),
        (dict(extra_body={"temprature": 0}), "temprature", "unknown_parameter",
         "Unrecognized request argument supplied: temprature"),
        (dict(extra_body={"stream": "yes"}), "stream", "invalid_value",
         "stream: Input should be a valid boolean"),
    ]
    for arguments, param, code, message in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(**chat | arguments)
        assert (raised.value.param, raised.value.code) == (param, code)
        assert raised.value.body["message"].startswith(message)
    reply = client.chat.completions.create(**chat, presence_penalty=0, frequency_penalty=0,
                                           logit_bias={}, top_p=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
