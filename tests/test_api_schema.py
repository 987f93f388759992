"""Schemathesis against the live server's own OpenAPI schema: generated requests (valid and
not) to every operation; no answer may be a 5xx, and every answer must match the schema
(status code documented, content type, body). Bounded: MAX_EXAMPLES per operation, a tiny
model, max_tokens kept small by the schema's own bounds being overridden per request."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from api.serve.app import create_app
from tests.api_cases import LiveServer, protocol_engine, tiny_chat_model, wait_settled  # noqa: F401

MAX_EXAMPLES = int(__import__("os").environ.get("KVPROOF_SCHEMA_EXAMPLES", "25"))
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]
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
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int) and case.body[field] > TOKENS_MAX:
                case.body[field] = TOKENS_MAX
    case.call_and_validate(base_url=live[0].url, checks=CHECKS, timeout=30)

