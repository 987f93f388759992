"""Schemathesis against the live server's own OpenAPI schema, with every check it has:
generated requests (valid and not) to every operation; no answer may be a 5xx, every
answer must match the schema (status code documented, content type, headers, body), a
body the schema calls valid must be accepted and one it calls invalid refused, and an
undeclared method must be a 405 with Allow. Bounded: MAX_EXAMPLES per operation, a tiny
model, max_tokens kept small by the schema's own bounds being overridden per request."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from api.serve.app import create_app
from tests.api_cases import LiveServer, protocol_engine, tiny_chat_model, wait_settled  # noqa: F401

MAX_EXAMPLES = int(__import__("os").environ.get("KVPROOF_SCHEMA_EXAMPLES", "25"))
checks.load_all_checks()
CHECKS = checks.CHECKS.get_all()  # all of them, not a chosen few
TOKENS_MAX = 8  # generated max_tokens above this are clipped: a test bound, not the API's


@pytest.fixture(scope="module")
def live(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model)
    with LiveServer(create_app(engine)) as server:
        yield server, engine
    # After the run (a teardown, so that it follows every generated case whatever order
    # the runner picks): the requests were served, not all refused at the edge, and every
    # pool is whole again.
    assert len(engine.submitted) >= 10
    assert engine.snapshot().outcomes.get("Ok", 0) >= 10
    wait_settled(engine)


@pytest.fixture(scope="module")
def api_schema(live):
    server, _engine = live
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_5xx_and_every_answer_matches_the_schema(case, live):
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    if isinstance(case.body, dict) and not negative:  # clipped, a valid body stays valid
        field = "max_tokens" if "prompt" in case.body else "max_completion_tokens"
        case.body[field] = min(case.body.get(field) or TOKENS_MAX, TOKENS_MAX)
        case.body["n"] = min(case.body.get("n", 1), 2)
    response = case.call(base_url=live[0].url, timeout=30)
    # The one refusal of a schema-valid body that no schema can state: a prompt longer
    # than the context in tokens (256 messages, 16 prompts of generated text).
    too_long = response.status_code == 400 and response.json()["error"]["code"] == (
        "context_length_exceeded")
    case.validate_response(response, checks=CHECKS,
                           excluded_checks=[checks.positive_data_acceptance] if too_long else [],
                           transport_kwargs={"base_url": live[0].url, "timeout": 30})

