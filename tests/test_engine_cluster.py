"""The protocol-driven engine with several prefill and decode workers in one process: the
router places every request on one pair, the store decides every event on that pair's
view, and a write only ever moves bytes from the request's own prefill pool into its own
decode pool.

What is pinned, on a tiny random Llama in fp32 (the helpers are test_engine_workers.py's):
the engine's tokens equal the single-process Generator's on 2 x 3 workers with every
worker used; every write lands in its request's pair; the log (with each Arrive's
placement) replays through a fresh store to the same pools; the spec's one-pair model
refuses such a log by name; an abort at every phase brings every pool back; the incident
entry is caught by the count check on its pair while requests on both pairs finish with
the Generator's tokens; the threaded engine and its snapshot name every worker's pool.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.eventlog import (LogError, core_trace, log_run, read_log, replay,  # noqa: E402
                             write_log)
from spec.tlaplus.runcheck import check_run  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import Finished, GenerationRequest  # noqa: E402
from engine.serving import CapacityError, EngineConfig, build_engine  # noqa: E402
from engine_cases import FaultyPrefill  # noqa: E402
from test_engine_workers import (MARK, PAGE, Client, assert_whole, loaded,  # noqa: E402
                                 mixed_requests, model, prompt, reference, run, runtime,
                                 step_until,
                                 unmarked, victim_prompt)

assert model  # the module-scoped fixture, shared with test_engine_workers.py


def landings(rt) -> list[tuple[int, int, int]]:
    """Record (request, prefill worker, decode worker) of every write as it lands."""
    seen: list[tuple[int, int, int]] = []
    land = rt.transport.land

    def recording(write):
        seen.append((write.request, write.prefill, write.decode))
        return land(write)

    rt.transport.land = recording
    return seen


def test_two_by_three_workers_give_the_generators_tokens_and_use_every_worker(model, tmp_path):
    requests = mixed_requests()
    expected = reference(model, requests)
    rt = runtime(model, prefill_workers=2, decode_workers=3, max_batch=3, prefill_pages=24,
                 decode_pages=20, transport_seed=3, lands_per_step=2)
    seen = landings(rt)
    client = Client()
    for prompt_ids, sampling in requests:
        rt.arrive(GenerationRequest(prompt_ids, sampling), client)
    placed = dict(rt.store.placement)
    run(rt)
    for r, completion in enumerate(expected):
        assert client.tokens(r) == list(completion.output_ids), r
        assert client.finished(r).outcome == "Ok"
    assert_whole(rt)
    assert {p for p, _ in placed.values()} == {0, 1}
    assert {d for _, d in placed.values()} == {0, 1, 2}
    # Every write went from the request's own prefill pool into its own decode pool, and
    # each decode pool took exactly the pages of the requests placed on it.
    assert seen and all((p, d) == placed[r] for r, p, d in seen)
    pages = Counter()
    for r, (prompt_ids, sampling) in enumerate(requests):
        pages[placed[r][1]] += -(-(len(prompt_ids) + sampling.max_tokens - 1) // PAGE)
    assert Counter(d for _, _, d in seen) == pages
    assert [s.worker for s in rt.pool_snapshots()] == [
        "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    path = tmp_path / "cluster.log"
    write_log(path, rt.log_header(), rt.log)
    header, records = read_log(path)
    assert (header["prefill_workers"], header["decode_workers"]) == (2, 3)
    assert {(x["p"], x["d"]) for x in records if x["a"] == "Arrive"} == set(placed.values())
    store = replay(header, records)
    assert store.rows == {} and store.violation_total == 0
    assert store.decode_pools == rt.store.decode_pools
    assert store.prefill_pools == rt.store.prefill_pools
    with pytest.raises(LogError, match="one prefill and one decode worker"):
        core_trace(header, records)
    # The log is a behaviour of the spec's worker sets (spec/tlaplus/runcheck.py).
    verdict = check_run(log_run(path))
    assert verdict.ok and verdict.steps == len(records), verdict.message
    # A placement the header has no worker for is bad input, named.
    arrive = next(k for k, x in enumerate(records) if x["a"] == "Arrive")
    records[arrive] = {**records[arrive], "d": 3}
    with pytest.raises(LogError, match=r"placement \(\d, 3\) names a worker"):
        replay(header, records)


def test_the_router_spreads_requests_and_a_busy_decode_pool_gets_no_more(model):
    rt = runtime(model, prefill_workers=2, decode_workers=2, decode_pages=8)
    rt.transport.paused = True  # nothing finishes: the reservations stay
    client = Client()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = rt.arrive(GenerationRequest(prompt(1, 20), params), client)  # 6 pages
    second = rt.arrive(GenerationRequest(prompt(2, 4), params), client)  # 2 pages
    assert rt.store.placement[first] == (0, 0)
    # The first request's reservation is still to come; decode-0 counts its 6 pages anyway.
    assert rt.store.placement[second] == (1, 1)
    for _ in range(5):
        rt.step()
    third = rt.arrive(GenerationRequest(prompt(3, 4), params), client)
    assert rt.store.placement[third][1] == 1  # decode-1's live requests need 2 pages, decode-0's 6
    assert [s.held for s in rt.pool_snapshots()[2:]] == [6, 2]  # both reserved by now
    rt.transport.paused = False
    run(rt)
    assert all(client.finished(r).outcome == "Ok" for r in (first, second, third))
    assert_whole(rt)
    # One request after another (each done before the next comes): ties go round in turn.
    serial = []
    for k in range(4):
        r = rt.arrive(GenerationRequest(prompt(4 + k, 4), params), client)
        serial.append(rt.store.placement[r])
        run(rt)
        assert client.finished(r).outcome == "Ok"
    assert serial == [(1, 1), (0, 0), (1, 1), (0, 0)]


def test_an_abort_at_every_phase_on_two_pairs_returns_every_page(model):
    for steps in range(0, 10):
        rt = runtime(model, prefill_workers=2, decode_workers=2, prefill_chunk_tokens=4)
        client = Client()
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        victims = [rt.arrive(GenerationRequest(prompt(s, 10), params), client) for s in (3, 4)]
        others = [rt.arrive(GenerationRequest(prompt(s, 7), params), client) for s in (5, 6)]
        assert {rt.store.placement[r] for r in victims} == {(0, 0), (1, 1)}
        for _ in range(steps):
            rt.step()
        for r in victims:
            rt.abort(r)
        run(rt)
        assert_whole(rt)
        for r in others:
            assert client.finished(r).outcome == "Ok" and len(client.tokens(r)) == 5


def test_the_incident_on_one_pair_fails_only_that_request(model):
    """The incident's switches on a 2 x 2 deployment: the over-long prompt (14 pages,
    prefill pools of 12) is admitted as a one-page placeholder on its pair; the count check
    fails it there, and requests on both pairs finish with the Generator's tokens."""
    rt = runtime(model, prefill_workers=2, decode_workers=2, prefill_pages=12,
                 decode_pages=20, context_tokens=64,
                 bugs={"PoolBelowContext", "FinishedNotRejected"})
    client = Client()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for seed, length in enumerate([30, 30, 14]):
        rt.arrive(GenerationRequest(prompt(10 + seed, length), params), client)
    run(rt)
    long = rt.arrive(GenerationRequest(prompt(20, 52), params), client)
    others = {rt.arrive(GenerationRequest(prompt(s, 10), params), client): s for s in (21, 22)}
    assert len({rt.store.placement[r][1] for r in [long, *others]}) == 2  # both decode workers
    run(rt)
    end = client.finished(long)
    assert (end.outcome, end.guard, end.completion_tokens) == ("ErrTransfer", "count", 0)
    for r, seed in others.items():
        expected = reference(model, [(prompt(seed, 10), params)])
        assert client.finished(r).outcome == "Ok"
        assert client.tokens(r) == list(expected[0].output_ids)
    assert_whole(rt)


def test_a_prefill_worker_whose_step_fails_fails_its_own_request_alone(model):
    """Out of memory in prefill-0's step for one request's chunk: the core's PrefillFail
    ends that request (ErrPrefill) on its pair; the requests on both pairs, prefill-0's
    other one included, finish with the Generator's tokens, and every pool comes back."""
    rt = runtime(model, prefill_workers=2, decode_workers=2, max_batch=3)
    faulty = rt.prefills[0].model = FaultyPrefill(model, MARK, "raise")
    client = Client()
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    victim = rt.arrive(GenerationRequest(victim_prompt(), greedy), client)
    others = [unmarked(70 + k, 6 + k) for k in range(3)]
    ids = [rt.arrive(GenerationRequest(ids, greedy), client) for ids in others]
    assert rt.store.placement[victim][0] == 0 and {rt.store.placement[r][0] for r in ids} == {0, 1}
    run(rt)
    end = client.finished(victim)
    assert (end.outcome, client.tokens(victim)) == ("ErrPrefill", [])
    assert faulty.failed_batches  # the injected fault really fired
    expected = reference(model, [(ids_, greedy) for ids_ in others])
    for r, completion in zip(ids, expected):
        assert client.finished(r).outcome == "Ok"
        assert client.tokens(r) == list(completion.output_ids)
    assert_whole(rt)
    assert [x["a"] for x in rt.log if x["request"] == victim].count("PrefillFail") == 1


def test_the_threaded_engine_serves_on_every_worker_and_checks_every_pool(model):
    config = EngineConfig(loop_nice=0, context_length=64, page_tokens=PAGE, prefill_pool_tokens=128,
                          decode_pool_tokens=96, prefill_workers=2, decode_workers=2)
    engine = build_engine(loaded(model), config)
    client, ended = Client(), threading.Semaphore(0)

    def on_event(event):
        client(event)
        if isinstance(event, Finished):
            ended.release()
    engine.start()
    try:
        ids = [engine.submit(GenerationRequest(prompt(s, 9), SamplingParams(
            max_tokens=3, ignore_eos=True)), on_event) for s in range(6)]
        assert all(ended.acquire(timeout=30) for _ in ids)
        assert all(client.finished(r).outcome == "Ok" for r in ids)
    finally:
        engine.stop()
    assert engine.error is None
    snapshot = engine.snapshot()
    assert [p.worker for p in snapshot.pools] == ["prefill-0", "prefill-1", "decode-0",
                                                  "decode-1"]
    assert all(p.free == p.pages and p.writes_in_flight == 0 for p in snapshot.pools)
    assert engine.runtime.whole()
    with pytest.raises(CapacityError, match="decode-0's KV pool holds 32 tokens"):
        build_engine(loaded(model), EngineConfig(loop_nice=0, context_length=64, page_tokens=PAGE,
                                          decode_pool_tokens=32, decode_workers=3))


def test_worker_counts_must_be_positive():
    with pytest.raises(ValueError, match="decode_workers must be positive"):
        EngineConfig(loop_nice=0, decode_workers=0)


def test_a_two_by_two_engine_run_is_a_behaviour_of_the_spec(model, tmp_path, capsys):
    """An engine run on 2 x 2 workers, every worker used, one request aborted while its
    writes are in flight: its own event log validates against KVTransfer.tla's worker sets
    (spec/tlaplus/runcheck.py), and the same log with one request placed on the other decode
    worker is refused at the first step that worker's pool cannot take."""
    from api.cli import main

    rt = runtime(model, prefill_workers=2, decode_workers=2, prefill_pages=6, decode_pages=8,
                 context_tokens=24)
    rt.transport.paused = True
    client = Client()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    ids = [rt.arrive(GenerationRequest(prompt(60 + k, 3 + 5 * k), params), client)
           for k in range(4)]
    gone = ids[1]
    step_until(rt, lambda: len(rt.transport.writes_of(gone)) >= 1)
    rt.abort(gone)
    rt.transport.paused = False
    run(rt)
    assert_whole(rt)
    path = tmp_path / "two-by-two.log"
    write_log(path, rt.log_header(), rt.log)
    header, records = read_log(path)
    assert {(x["p"], x["d"]) for x in records if x["a"] == "Arrive"} == {(0, 0), (1, 1)}
    verdict = check_run(log_run(path))
    assert verdict.ok and verdict.steps == len(rt.log), verdict.message
    assert main(["validate", str(path)]) == 0
    assert "2 x 2 workers" in capsys.readouterr().out
    # Request r2 placed on d1 instead of d2 (a legal Arrive): its reservation then names
    # pages of d1 that r1 holds.
    lines = path.read_text().splitlines(keepends=True)
    arrive = next(k for k, x in enumerate(records) if x["a"] == "Arrive" and x["request"] == 1)
    reserve = next(k for k, x in enumerate(records) if x["a"] == "Reserve" and x["request"] == 1)
    lines[arrive + 1] = lines[arrive + 1].replace('"d":1', '"d":0')
    path.write_text("".join(lines))
    verdict = check_run(log_run(path))
    assert not verdict.ok and (verdict.line, verdict.action) == (reserve + 2, "Reserve")
    assert "Reserve is not enabled there with these arguments" in verdict.message
