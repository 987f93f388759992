"""The worker processes' model step on a thread of its own (engine/process_data.py `Stepper`):
the loop takes its result when it is done, starts nothing under it, and a request stopped
while its step runs waits for that step and is reported no more.

Driven in this process, without the transport or a protocol: the tiny random Llama (model
seed 0), a step held on an Event so that "while it runs" is a fact, not a race. Every wait
is bounded.
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.process_data import DecodeData, Payload, PrefillData, Stepper  # noqa: E402
from engine.processes import Deployment  # noqa: E402
from engine_cases import make_hf_model  # noqa: E402

WAIT_S = 30.0
PROMPT = (5, 17, 3, 11, 2)  # 5 tokens: 2 pages of 4 with 4 outputs
OUTPUTS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama-gqa", folder, seed=0)
    return folder


def deployment(model_dir, tmp_path) -> Deployment:
    return Deployment.with_model(str(model_dir), [(PROMPT, OUTPUTS)] * 3, page_tokens=4,
                                 prefill_pages=16, decode_pages=16, log_dir=str(tmp_path))


class Gate:
    """Wraps a worker's step: each call waits until `open` (bounded), counted."""

    def __init__(self, step) -> None:
        self.step, self.opened, self.calls = step, threading.Event(), 0

    def __call__(self, *args):
        self.calls += 1
        assert self.opened.wait(WAIT_S), "the test never opened the gate"
        return self.step(*args)


def in_thread(call) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_a_step_runs_on_its_thread_and_its_result_or_error_comes_back_once():
    done = threading.Event()
    wakes = []
    stepper = Stepper("test step", lambda: (wakes.append(1), done.set()))
    gate = threading.Event()
    stepper.begin(lambda: (gate.wait(WAIT_S), 42)[1])
    assert stepper.take() == (False, None) and not stepper.finished()
    assert stepper.in_flight and wakes == []
    gate.set()
    assert done.wait(WAIT_S)
    assert stepper.finished() and wakes == [1]
    assert stepper.take() == (True, 42)
    assert stepper.take() == (False, None) and not stepper.in_flight
    done.clear()
    stepper.begin(lambda: 1 / 0)
    assert done.wait(WAIT_S) and wakes == [1, 1]
    with pytest.raises(ZeroDivisionError):
        stepper.take()
    assert not stepper.in_flight  # (the loop may begin another)
    stepper.close()


def test_decode_stops_a_request_of_the_running_step_only_after_it_and_reports_nothing_of_it(
        model_dir, tmp_path):
    steps_done = threading.Semaphore(0)
    data = DecodeData(deployment(model_dir, tmp_path), 0, steps_done.release)
    gate = data.worker.step = Gate(data.worker.step)
    payload = Payload(PROMPT, OUTPUTS)
    for r, pages in ((0, (0, 1)), (1, (2, 3)), (2, (4, 5))):
        for page in pages:  # the tags a landing would leave
            data.worker.landed(r, page, 0, 1)
    assert data.start(0, payload, ((0, 1), (1, 1)), 7) is False
    assert data.start(1, payload, ((2, 1), (3, 1)), 7) is False
    assert data.step() == []          # nothing finished; a step over 0 and 1 began
    assert data.in_step == {0, 1}
    assert data.start(2, payload, ((4, 1), (5, 1)), 7) is False  # after the running step
    stop_2 = in_thread(lambda: data.stop(2))
    stop_2.join(WAIT_S)
    assert not stop_2.is_alive()      # not in the running step: no wait
    stop_0 = in_thread(lambda: data.stop(0))
    stop_0.join(0.5)
    assert stop_0.is_alive()          # its pages are read by the running step: it waits
    gate.opened.set()
    stop_0.join(WAIT_S)
    assert not stop_0.is_alive() and steps_done.acquire(timeout=WAIT_S)
    out = data.step()                 # the step's result; the next step begins over 1
    assert [(r, ended) for r, _, ended in out] == [(1, False)]
    assert [s.request.request_id for s in data.worker.running] == [1]
    assert data.in_step == {1}
    assert steps_done.acquire(timeout=WAIT_S)
    assert [(r, ended) for r, _, ended in data.step()] == [(1, False)]
    assert gate.calls == 2
    data.close()


def test_prefill_starts_a_prompt_after_the_running_step_and_drops_a_stopped_one(
        model_dir, tmp_path):
    steps_done = threading.Semaphore(0)
    data = PrefillData(deployment(model_dir, tmp_path), 0, steps_done.release)
    gate = data.worker.step = Gate(data.worker.step)
    payload = Payload(PROMPT, OUTPUTS)
    data.compute(0, payload, (0, 1))
    assert data.step() == [] and data.in_step == {0}
    data.compute(1, payload, (2, 3))  # after the running step
    data.compute(2, payload, (4, 5))
    assert [s.request.request_id for s in data.worker.computing] == [0]
    data.stop(2)                      # never started: nothing waits
    gate.opened.set()
    assert steps_done.acquire(timeout=WAIT_S)
    assert data.step() == [0]         # 0's prompt computed; a step over 1 began
    assert data.in_step == {1} and 0 in data.first
    stop_1 = in_thread(lambda: data.stop(1))
    stop_1.join(WAIT_S)               # (its step may still run: the stop waits for it)
    assert not stop_1.is_alive()
    assert data.step() == []          # 1 was stopped: its computed prompt is not reported
    assert data.worker.computing == [] and not data.stepper.in_flight
    assert sorted(data.first) == [0] and gate.calls == 2
    data.close()
