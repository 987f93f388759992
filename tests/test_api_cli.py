"""`kvproof serve`: the URL and a working curl line at startup, SIGTERM drains a live stream
and exits 0, and every refusal is one line with exit status 2."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from api.cli import main
from tests.api_cases import make_tiny_chat_model, tiny_chat_model, wait_until  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
START_S_MAX = 60


def lines_of(process: subprocess.Popen) -> list[str]:
    """stdout lines, collected by a thread so that reading never blocks the test."""
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_serve_prints_a_url_and_curl_line_and_sigterm_drains_a_live_stream(tiny_chat_model):  # noqa: F811
    process = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--model", str(tiny_chat_model.path),
         "--port", "0", "--drain-s", "20"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        lines = lines_of(process)
        wait_until(lambda: any("curl " in line for line in lines), START_S_MAX, "the curl line")
        url = lines[0].split(" at ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://127.0.0.1:")
        curl = shlex.split(next(line for line in lines if "curl " in line).strip())
        assert curl[:2] == ["curl", f"{url}/v1/chat/completions"]
        reply = httpx.post(curl[1], json=json.loads(curl[curl.index("-d") + 1]), timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
                "prompt": "drain me", "max_tokens": 200, "stream": True,
                "temperature": 0}) as stream:
            events = stream.iter_lines()
            assert next(events).startswith("data: ")  # the request is live
            process.send_signal(signal.SIGTERM)
            rest = [line for line in events if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # drained: it finished, it was not cut
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
        assert process.wait(timeout=30) == 0
        assert "kvproof serve: stopped" in lines[-1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def run_cli(capsys, *arguments: str) -> tuple[int, str]:
    code = main(["serve", *arguments])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def test_disaggregated_worker_counts_build_that_many_pools_and_bad_counts_exit_2(
        capsys, tiny_chat_model):  # noqa: F811
    from api.serve.command import _build, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for prefill, decode in ((None, None), (1, 1), (2, 3), (3, 1)):
        counts = [] if prefill is None else ["--prefill-workers", str(prefill),
                                             "--decode-workers", str(decode)]
        _app, engine = _build(parser.parse_args([
            "--model", str(tiny_chat_model.path), "--disaggregated", *counts]))
        prefill, decode = prefill or 1, decode or 1
        assert (engine.config.disaggregated, engine.config.prefill_workers,
                engine.config.decode_workers) == (True, prefill, decode)
        assert [pool.worker for pool in engine.snapshot().pools] == (
            [f"prefill-{k}" for k in range(prefill)] + [f"decode-{k}" for k in range(decode)])
    for count in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as stopped:  # argparse's usage error
            main(["serve", "--disaggregated", "--decode-workers", count])
        assert stopped.value.code == 2
        assert "argument --decode-workers:" in capsys.readouterr().err


def test_the_engine_loops_priority_is_a_flag_from_0_to_19(capsys, tiny_chat_model):  # noqa: F811
    """--loop-nice reaches the engine's config (0 too: it turns the lowering off); out of
    range or not a number is argparse's usage error, naming the flag."""
    from api.serve.command import _build, add_arguments
    from engine.serving import ENGINE_NICE_INCREMENT

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for given, expected in ((None, ENGINE_NICE_INCREMENT), ("0", 0), ("19", 19)):
        flag = [] if given is None else ["--loop-nice", given]
        _app, engine = _build(parser.parse_args(["--model", str(tiny_chat_model.path), *flag]))
        assert engine.config.loop_nice == expected
        engine.stop()
    for bad in ("20", "-1", "ten"):
        with pytest.raises(SystemExit) as stopped:
            main(["serve", "--loop-nice", bad])
        assert stopped.value.code == 2
        assert "argument --loop-nice:" in capsys.readouterr().err


def test_worker_counts_need_disaggregated(capsys):
    code, output = run_cli(capsys, "--prefill-workers", "2")
    assert code == 2
    assert output == ("kvproof serve: --prefill-workers and --decode-workers need "
                      "--disaggregated or --processes\n")


def test_processes_refuse_what_their_workers_would_ignore(capsys):
    code, output = run_cli(capsys, "--processes", "--dtype", "bfloat16")
    assert code == 2
    assert output == ("kvproof serve: --processes runs its workers on the CPU in float32 "
                      "for now, not --device cpu --dtype bfloat16\n")
    code, output = run_cli(capsys, "--processes", "--engine-factory", "engine.serving")
    assert (code, output) == (2, "kvproof serve: --processes and --engine-factory: give one "
                                 "of them\n")


def test_a_failed_capacity_check_is_printed_and_exits_2(capsys, tmp_path):
    """A model whose context (32768 tokens) is larger than the default KV pools (16384
    tokens): the engine's startup check refuses it, naming the node and both numbers."""
    model = make_tiny_chat_model(tmp_path / "long", max_position_embeddings=32768)
    capsys.readouterr()  # transformers' progress bar while saving it
    code, output = run_cli(capsys, "--model", str(model))
    assert code == 2
    assert output == ("kvproof serve: the engine refused to start: prefill-0's KV pool holds "
                      "16384 tokens, less than the advertised context of 32768 tokens; "
                      "enlarge the pool or set lower_context_to_fit to advertise what it "
                      "holds\n")


def test_a_failed_timing_check_is_printed_and_exits_2(capsys, tiny_chat_model):  # noqa: F811
    """--lease-s reaches the engine, whose startup timing check refuses a lease no prefill
    chunk can fit in (one line, naming the flag); --context-prefill-s is taken as told."""
    code, output = run_cli(capsys, "--model", str(tiny_chat_model.path), "--lease-s", "1e-9")
    assert code == 2 and output.count("\n") == 1, output
    assert output.startswith("kvproof serve: the engine refused to start: a prefill step at "
                             "the end of the context takes ")
    assert "longer than the lease of 1e-09 s (--lease-s)" in output
    code, output = run_cli(capsys, "--model", str(tiny_chat_model.path),
                           "--context-prefill-s", "1000", "--transfer-timeout-s", "100",
                           "--lease-s", "1000000")
    assert code == 2 and "prefilling " in output and "(--transfer-timeout-s)" in output


def test_a_missing_model_or_factory_exits_2(capsys, tmp_path):
    code, output = run_cli(capsys, "--model", str(tmp_path / "nothing"))
    assert code == 2 and output.startswith("kvproof serve: ") and output.count("\n") == 1
    code, output = run_cli(capsys, "--engine-factory", "tests.no_such_module:build")
    assert code == 2 and "no such module or function" in output


def test_once_stopping_new_requests_get_503_and_health_says_stopping(tiny_chat_model):  # noqa: F811
    from fastapi.testclient import TestClient

    from api.serve.app import create_app
    from tests.api_cases import protocol_engine

    engine = protocol_engine(tiny_chat_model)
    app = create_app(engine)
    with TestClient(app) as client:
        app.state.lifetime.stop(drain_s=1.0)
        response = client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert (response.status_code, response.json()["error"]["code"]) == (503, "engine_stopped")
        health = client.get("/health")
        assert (health.status_code, health.json()["status"]) == (503, "stopping")


def test_api_never_imports_the_tests():
    """Test helpers stay in tests/: nothing in api/ imports them."""
    from tests.test_architecture import imports_of, sources

    bad = [f"{path.name} imports {name}" for path in sources("api") for name in imports_of(path)
           if name.split(".")[0] == "tests"]
    assert bad == []
