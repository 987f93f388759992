"""API keys (api/serve/auth.py): 401 in OpenAI's words without a known key, nothing of a
refused request reaching the engine, the operator's endpoints open, keys from files, and
`cache_salt` served (what it shares with a prefix cache: tests/test_api_prefix.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from api.clikit import UsageError
from api.serve.app import create_app
from api.serve.auth import ApiKeys, bearer_key, load_keys, tenant_of
from tests.api_cases import (CountingEngine, LiveServer, protocol_engine,  # noqa: F401
                             tiny_chat_model)

KEYS = ["sk-alpha-1", "sk-beta-2"]


@pytest.fixture(scope="module")
def served(tiny_chat_model):  # noqa: F811
    engine = CountingEngine(protocol_engine(tiny_chat_model))
    with LiveServer(create_app(engine, api_keys=ApiKeys.of(KEYS))) as server:
        yield server, engine


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_a_known_key_is_served_through_openais_client_with_a_cache_salt(served):
    server, engine = served
    for key in KEYS:
        reply = _client(server, key).completions.create(
            model="default", prompt="The cat", max_tokens=3, temperature=0,
            extra_body={"cache_salt": "team-a"})
        assert reply.usage.completion_tokens == 3
    assert [m.id for m in _client(server, KEYS[0]).models.list().data] == [engine.model_name]


@pytest.mark.parametrize("headers, message", [
    ({}, "no API key given"),
    ({"Authorization": "Bearer sk-wrong"}, "not one this server takes"),
    ({"Authorization": "Basic c2stYWxwaGEtMQ=="}, "not one this server takes"),
    ({"Authorization": "Bearer"}, "not one this server takes"),
    ({"Authorization": "Bearer sk-alpha-1x"}, "not one this server takes"),
])
def test_without_a_known_key_every_openai_route_is_a_401_and_nothing_reaches_the_engine(
        served, headers, message):
    server, engine = served
    submitted = len(engine.submitted)
    for method, path, body in [("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
                               ("POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "x"}]}),
                               ("GET", "/v1/models", None), ("GET", "/v1/models/default", None)]:
        reply = httpx.request(method, server.url + path, json=body, headers=headers, timeout=10)
        assert reply.status_code == 401, (path, reply.text)
        error = reply.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert message in error["message"]
        assert "sk-" not in error["message"]  # a key is never echoed
        assert reply.headers["www-authenticate"].startswith("Bearer")
    assert len(engine.submitted) == submitted


def test_openais_client_raises_its_authentication_error(served):
    server, _engine = served
    with pytest.raises(openai.AuthenticationError) as raised:
        _client(server, "sk-nobody").chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"


def test_the_operators_endpoints_stay_open_and_count_the_401s(served):
    server, _engine = served
    httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    for path in ("/health", "/v1/kvproof/state", "/"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200, path
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert any('"401"' in line and "/v1/completions" in line and not line.endswith(" 0.0")
               for line in metrics.splitlines() if not line.startswith("#"))


def test_keys_come_from_flags_and_files_and_bad_ones_are_named(tmp_path):
    assert load_keys(None, None) is None
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# the team's keys\nsk-file-1\n\n  sk-file-2  \n")
    keys = load_keys(["sk-flag"], [str(keys_file)])
    for key in ("sk-flag", "sk-file-1", "sk-file-2"):
        assert keys.tenant(key) == tenant_of(key)
    assert keys.tenant("sk-file-3") is None
    assert len({tenant_of(k) for k in ("sk-flag", "sk-file-1", "sk-file-2")}) == 3
    assert "sk-" not in tenant_of("sk-flag")
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    (tmp_path / "spaced.txt").write_text("sk-ok\nsk bad\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe")
    for keys_arg, files, message in [
        ([""], None, "--api-key: an API key cannot be empty"),
        (["a\tb"], None, "cannot hold spaces or control characters"),
        (["k" * 513], None, "at most 512 characters, this one has 513"),
        (None, [str(tmp_path / "none.txt")], "none.txt: no such file"),
        (None, [str(tmp_path)], "is a folder"),
        (["sk-x"], [str(tmp_path / "empty.txt")], "empty.txt: no key in the file"),
        (None, [str(tmp_path / "spaced.txt")], "spaced.txt, line 2: an API key cannot hold"),
        (None, [str(tmp_path / "binary.txt")], "not a text file"),
    ]:
        with pytest.raises(UsageError, match=message.replace("(", r"\(")):
            load_keys(keys_arg, files)


@pytest.mark.parametrize("header, key", [
    (None, None), (b"Bearer sk-1", "sk-1"), (b"bearer  sk-1 ", "sk-1"), (b"Basic xyz", ""),
    (b"Bearer", ""),
])
def test_the_bearer_key_is_read_from_the_authorization_header(header, key):
    headers = [] if header is None else [(b"authorization", header)]
    assert bearer_key({"headers": headers}) == key


def test_serves_key_flags_reach_the_app_and_a_bad_key_file_is_one_line(tmp_path, capsys,
                                                                         tiny_chat_model):  # noqa: F811
    import argparse

    from fastapi.testclient import TestClient

    from api.cli import main
    from api.serve.command import _build, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("sk-from-file\n")
    app, engine = _build(parser.parse_args(["--model", str(tiny_chat_model.path),
                                            "--api-key", "sk-flag",
                                            "--api-key-file", str(keys_file)]))
    with TestClient(app) as client:
        body = {"prompt": "x", "max_tokens": 1}
        assert client.post("/v1/completions", json=body).status_code == 401
        for key in ("sk-flag", "sk-from-file"):
            reply = client.post("/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200, reply.text
    engine.stop()
    assert main(["serve", "--api-key-file", str(tmp_path / "nope.txt")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"kvproof serve: --api-key-file {tmp_path / 'nope.txt'}: no such file"]
