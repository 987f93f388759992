"""The protocol-driven engine: prefill and decode workers whose every protocol step the core
decides (engine/runtime.py), over a tiny random Llama in fp32 on the CPU.

What is pinned: the engine's tokens equal the single-process Generator's; an abort at every
phase brings every page back with no write in flight; refusals before allocation; the
startup capacity check; the event log replays through the core; and for the bug zoo's
data-path entries, the real engine is driven into the bad interleaving: with the runtime
guard on, only the victim request fails, with the guard named, while a concurrent request
finishes correctly; with the guard off too, decode really reads another request's KV bytes
(compared bit for bit with the KV of the request's own prompt).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.eventlog import LogError, read_log, replay, write_log  # noqa: E402
from engine.generate import Generator, GeneratorConfig, Request  # noqa: E402
from engine.load import LoadedModel  # noqa: E402
from engine.model import LlamaModel  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import (ContextTooLong, Finished, GenerationRequest, Overloaded,  # noqa: E402
                            TokenOut)
from engine.serving import CapacityError, EngineConfig, build_engine  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402
from engine.workers import kv_rows  # noqa: E402
from engine_cases import FaultyPrefill, make_hf_model  # noqa: E402
from spec import core  # noqa: E402

PAGE = 4  # tokens per page: small, so prompts span several pages


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama-gqa", folder)
    return LlamaModel(load_checkpoint(folder))


def prompt(seed: int, length: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 211, (length,), generator=generator).tolist())


class Client:
    """Collects every request's events; checks each request ends exactly once."""

    def __init__(self):
        self.events: dict[int, list] = {}
        self.lock = threading.Lock()

    def __call__(self, event):
        with self.lock:
            events = self.events.setdefault(event.request_id, [])
            assert not any(isinstance(e, Finished) for e in events), "an event after Finished"
            events.append(event)

    def tokens(self, r: int) -> list[int]:
        return [e.token_id for e in self.events.get(r, []) if isinstance(e, TokenOut)]

    def finished(self, r: int) -> Finished | None:
        ends = [e for e in self.events.get(r, []) if isinstance(e, Finished)]
        return ends[0] if ends else None


def runtime(model, **overrides) -> Runtime:
    settings = dict(prefill_pages=64, decode_pages=64, page_tokens=PAGE, context_tokens=128,
                    prefill_chunk_tokens=8, transfer_timeout_s=1e9, lease_s=1e9, keep_kv=True)
    settings.update(overrides)
    return Runtime(model, RuntimeConfig(**settings))


def run(rt: Runtime, steps_max: int = 2000) -> None:
    for _ in range(steps_max):
        if rt.idle:
            return
        rt.step()
    raise AssertionError(f"not idle after {steps_max} steps: {rt.store.rows}")


def step_until(rt: Runtime, condition, steps_max: int = 500) -> None:
    for _ in range(steps_max):
        if condition():
            return
        rt.step()
    raise AssertionError("condition never held")


def reference(model, requests: list[tuple[tuple[int, ...], SamplingParams]]):
    generator = Generator(model, GeneratorConfig(num_pages=128, page_tokens=PAGE))
    return generator.run([Request(i, p, s) for i, (p, s) in enumerate(requests)])


def own_kv(model, prompt_ids: tuple[int, ...]) -> torch.Tensor:
    """The KV of a prompt computed alone: [tokens, layers, 2, kv_heads, dim]."""
    generator = Generator(model, GeneratorConfig(num_pages=64, page_tokens=PAGE))
    generator.run([Request(0, prompt_ids, SamplingParams(max_tokens=1))])
    pages = list(range(-(-len(prompt_ids) // PAGE)))  # in-order pages of a fresh pool
    return kv_rows(generator.pool, pages, len(prompt_ids))


def assert_whole(rt: Runtime) -> None:
    assert rt.whole(), [p for p in rt.pool_snapshots()]
    assert rt.transport.in_flight == 0
    assert rt.store.violation_total == 0, rt.store.violations


def row(rt: Runtime, r: int) -> tuple:
    return rt.store.rows[r]


# -- the same tokens as the Generator -------------------------------------------------------

MIXED = [(1, 6), (3, 9), (9, 4), (14, 12), (22, 7), (5, 1), (30, 10), (17, 5)]


def mixed_requests():
    out = []
    for seed, (length, max_tokens) in enumerate(MIXED):
        sampled = seed % 3 == 1
        out.append((prompt(seed, length), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.8 if sampled else 0.0,
            top_k=20 if sampled else 0, seed=seed)))
    return out


@pytest.mark.parametrize("transport_seed,lands_per_step", [(None, 1 << 30), (7, 2)])
def test_outputs_equal_the_generators_token_for_token(model, transport_seed, lands_per_step,
                                                      tmp_path):
    requests = mixed_requests()
    expected = reference(model, requests)
    rt = runtime(model, transport_seed=transport_seed, lands_per_step=lands_per_step,
                 max_batch=5)
    client = Client()
    for prompt_ids, sampling in requests:
        rt.arrive(GenerationRequest(prompt_ids, sampling), client)
    run(rt)
    for r, completion in enumerate(expected):
        assert client.tokens(r) == list(completion.output_ids), r
        end = client.finished(r)
        assert (end.outcome, end.finish_reason, end.guard) == ("Ok", "length", None)
        assert end.completion_tokens == len(completion.output_ids)
    assert_whole(rt)
    # Every page a request reserved was written by the prefill and read back: the bytes
    # moved are one page per reserved page.
    pages = sum(-(-(len(p) + s.max_tokens - 1) // PAGE) for p, s in requests)
    assert rt.transport.writes_landed == pages
    assert rt.transport.bytes_landed == pages * rt.decode.pool.config.page_bytes
    # The log replays through a fresh core to the same pools, with the oracles quiet.
    path = tmp_path / "engine.log"
    write_log(path, rt.log_header(), rt.log)
    header, records = read_log(path)
    store = replay(header, records)
    assert store.rows == {} and store.violation_total == 0
    assert store.decode_pools == rt.store.decode_pools
    assert store.prefill_pools == rt.store.prefill_pools
    actions = [record["a"] for record in records]
    assert actions.count("SendPage") == actions.count("LandWrite") == pages
    assert actions.count("Finish") == actions.count("Release") == len(requests)


def test_a_log_with_a_missing_landing_does_not_replay(model, tmp_path):
    rt = runtime(model)
    rt.arrive(GenerationRequest(prompt(1, 6), SamplingParams(max_tokens=3)), Client())
    run(rt)
    records = list(rt.log)
    records.remove(next(r for r in records if r["a"] == "LandWrite"))
    with pytest.raises(LogError, match="refuses SendDone"):
        replay(rt.log_header(), records)


# -- aborts at every phase --------------------------------------------------------------

def phase(rt: Runtime, r: int) -> str:
    """Where request r is, in the words of the protocol state and the transport."""
    x = row(rt, r)
    if x[core.DST] == core.DECODING:
        return "decoding"
    if x[core.PST] == core.P_DONE:
        return "done, not accepted"
    if x[core.PST] == core.RUNNING:
        in_flight = rt.transport.writes_of(r)
        if in_flight:
            return "writes in flight"
        return "computing" if x[core.SENT] == 0 else "posting"
    if x[core.PST] == core.QUEUED:
        return "queued, reserved" if x[core.TABLE] else "queued"
    return f"other ({core.PREFILL_NAMES[x[core.PST]]}, {core.DECODE_NAMES[x[core.DST]]})"


def test_an_abort_at_every_phase_returns_every_page_and_leaves_no_write_in_flight(model):
    seen = set()
    for paused in (False, True):
        for steps in range(0, 12):
            rt = runtime(model, prefill_chunk_tokens=4)
            rt.transport.paused = paused
            client = Client()
            victim = rt.arrive(GenerationRequest(prompt(3, 10), SamplingParams(
                max_tokens=6, ignore_eos=True)), client)
            other = rt.arrive(GenerationRequest(prompt(4, 7), SamplingParams(
                max_tokens=5, ignore_eos=True)), client)
            for _ in range(steps):
                rt.step()
            if victim not in rt.store.rows:
                continue
            answered = client.finished(victim)
            seen.add(phase(rt, victim) if answered is None else "answered, closing")
            rt.abort(victim)  # after the answer: the core refuses it, nothing changes
            assert client.finished(victim).outcome == (answered.outcome if answered else "Gone")
            for _ in range(30):
                rt.step()
            rt.transport.paused = False
            run(rt)
            assert_whole(rt)
            assert client.finished(other).outcome == "Ok"
            assert len(client.tokens(other)) == 5
    assert {"queued", "computing", "writes in flight", "decoding"} <= seen, seen


def test_a_transfer_timeout_ends_the_request_and_release_waits_for_the_writes(model):
    now = [0.0]
    rt = Runtime(model, RuntimeConfig(prefill_pages=16, decode_pages=16, page_tokens=PAGE,
                                      context_tokens=64, transfer_timeout_s=5.0),
                 clock=lambda: now[0])
    rt.transport.paused = True
    client = Client()
    r = rt.arrive(GenerationRequest(prompt(5, 9), SamplingParams(max_tokens=4)), client)
    step_until(rt, lambda: rt.transport.in_flight == 3)
    now[0] = 6.0
    rt.step()
    assert client.finished(r).outcome == "ErrTimeout"
    for _ in range(10):
        rt.step()
    # Decode closed the request but holds its pages: three writes still target them.
    assert row(rt, r)[core.DST] == core.CLOSING
    assert rt.pool_snapshots()[1].held == 3
    rt.transport.paused = False
    run(rt)
    assert_whole(rt)
    actions = [record["a"] for record in rt.log]
    assert actions.index("Timeout") < actions.index("PrefillAbort") < actions.index("Release")


@pytest.mark.parametrize("prefill_pages,decode_pages,first", [
    (4, 32, ["Arrive", "Reserve", "Reject"]),
    (32, 4, ["Arrive", "DecodeReject", "PrefillAbort"]),
])
def test_a_prompt_longer_than_a_pool_is_rejected_by_that_worker(model, prefill_pages,
                                                                decode_pages, first):
    # Without the startup check the advertised context exceeds a pool, so that worker's
    # own reject path must end the request before it allocates anything.
    rt = runtime(model, prefill_pages=prefill_pages, decode_pages=decode_pages,
                 context_tokens=64, bugs={"PoolBelowContext"})
    client = Client()
    r = rt.arrive(GenerationRequest(prompt(6, 20), SamplingParams(max_tokens=4)), client)
    run(rt)
    assert client.finished(r).outcome == "ErrTooLong"
    assert [record["a"] for record in rt.log][:3] == first
    assert "Admit" not in [record["a"] for record in rt.log]
    assert_whole(rt)


# -- the service's refusals and the startup check -----------------------------------------

def loaded(model) -> LoadedModel:
    return LoadedModel(model, None, Path("tiny.gguf"), 0.0)


def test_startup_refuses_a_pool_below_the_advertised_context_naming_node_and_numbers(model):
    with pytest.raises(CapacityError, match="prefill-0's KV pool holds 256 tokens, less than "
                                            "the advertised context of 512 tokens"):
        build_engine(loaded(model), EngineConfig(loop_nice=0, context_length=512, page_tokens=PAGE,
                                                 prefill_pool_tokens=256,
                                                 decode_pool_tokens=1024))
    with pytest.raises(CapacityError, match="decode-0's KV pool holds 128 tokens"):
        build_engine(loaded(model), EngineConfig(loop_nice=0, context_length=512, page_tokens=PAGE,
                                                 prefill_pool_tokens=1024,
                                                 decode_pool_tokens=128))
    engine = build_engine(loaded(model), EngineConfig(loop_nice=0, 
        context_length=512, lower_context_to_fit=True, page_tokens=PAGE,
        prefill_pool_tokens=256, decode_pool_tokens=128))
    assert engine.context_length == 128
    assert engine.runtime.core_model.advertised_context_pages == 32


def test_context_too_long_and_overloaded_are_refused_before_anything_is_allocated(model):
    engine = build_engine(loaded(model), EngineConfig(loop_nice=0, 
        context_length=64, page_tokens=PAGE, prefill_pool_tokens=64, decode_pool_tokens=64,
        max_queued=2))
    client = Client()
    with pytest.raises(ContextTooLong, match=r"prompt \(60 tokens\) plus max_tokens \(5\)"):
        engine.submit(GenerationRequest(prompt(1, 60), SamplingParams(max_tokens=5)), client)
    engine.submit(GenerationRequest(prompt(1, 5), SamplingParams(max_tokens=3)), client)
    engine.submit(GenerationRequest(prompt(2, 5), SamplingParams(max_tokens=3)), client)
    with pytest.raises(Overloaded) as refused:
        engine.submit(GenerationRequest(prompt(3, 5), SamplingParams(max_tokens=3)), client)
    assert refused.value.queued == 2
    assert engine.snapshot().queued == 2
    assert engine.runtime.store.rows == {}  # nothing reached the core yet


def test_the_threaded_engine_serves_aborts_and_stops_with_every_pool_whole(model):
    engine = build_engine(loaded(model), EngineConfig(loop_nice=0, 
        context_length=64, page_tokens=PAGE, prefill_pool_tokens=128, decode_pool_tokens=128))
    client = Client()
    done = threading.Event()

    def on_event(event):
        client(event)
        if isinstance(event, Finished) and event.request_id == 0:
            done.set()
    engine.start()
    first = engine.submit(GenerationRequest(prompt(1, 9), SamplingParams(
        max_tokens=6, ignore_eos=True), logprobs=2), on_event)
    gone = engine.submit(GenerationRequest(prompt(2, 9), SamplingParams(
        max_tokens=40, ignore_eos=True)), client)
    engine.abort(gone)
    assert done.wait(30)
    engine.stop(drain_s=5.0)
    assert engine.error is None
    assert client.finished(first).outcome == "Ok"
    assert client.finished(gone).outcome == "Gone"
    token = client.events[first][0]
    assert token.logprob is not None and len(token.top_logprobs) == 2
    assert token.top_logprobs[0][1] >= token.logprob - 1e-6
    snapshot = engine.snapshot()
    assert all(p.free == p.pages and p.writes_in_flight == 0 for p in snapshot.pools)
    assert snapshot.outcomes == {"Ok": 1, "Gone": 1}
    assert engine.runtime.whole()


# -- the bug zoo's data-path entries, on the real engine ---------------------------------

INCIDENT_BASE = {"PoolBelowContext", "FinishedNotRejected"}


def incident(model, bugs: set) -> tuple[Runtime, Client, int, int, torch.Tensor]:
    """Three requests fill every decode page with their KV and finish; then an over-long
    prompt (14 pages, prefill pool 12) arrives with a concurrent one. Returns the runtime,
    the client, the over-long request, the concurrent one, and the decode pool's bytes
    just before the over-long request reserved its pages."""
    rt = runtime(model, prefill_pages=12, decode_pages=20, context_tokens=64,
                 bugs=INCIDENT_BASE | bugs)
    client = Client()
    for seed, (length, max_tokens) in enumerate([(30, 3), (30, 3), (14, 3)]):
        rt.arrive(GenerationRequest(prompt(10 + seed, length), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True)), client)
    run(rt)
    assert all(client.finished(r).outcome == "Ok" for r in range(3))
    before = rt.decode.pool.kv.clone()
    long = rt.arrive(GenerationRequest(prompt(20, 52), SamplingParams(
        max_tokens=4, ignore_eos=True)), client)
    other = rt.arrive(GenerationRequest(prompt(21, 10), SamplingParams(
        max_tokens=4, ignore_eos=True)), client)
    return rt, client, long, other, before


def finish_and_check_other(model, rt: Runtime, client: Client, other: int) -> None:
    expected = reference(model, [(prompt(21, 10), SamplingParams(max_tokens=4,
                                                                 ignore_eos=True))])
    run(rt)
    assert client.finished(other).outcome == "Ok"
    assert client.tokens(other) == list(expected[0].output_ids)
    assert rt.whole() and rt.transport.in_flight == 0


def test_incident_the_count_check_fails_the_placeholder_request(model):
    rt, client, long, other, _ = incident(model, set())
    finish_and_check_other(model, rt, client, other)
    end = client.finished(long)
    assert (end.outcome, end.guard, end.completion_tokens) == ("ErrTransfer", "count", 0)
    assert rt.store.violation_total == 0


def test_incident_without_the_count_check_the_tag_check_fails_it(model):
    rt, client, long, other, _ = incident(model, {"NoCountCheck"})
    finish_and_check_other(model, rt, client, other)
    end = client.finished(long)
    assert (end.outcome, end.guard) == ("ErrTag", "tag")
    # The store's oracle sees the zoo's rejected-decodes entry: the over-long request got
    # as far as decoding; the tag check is what kept it from an answer.
    assert {v.property for v in rt.store.violations} == {"RejectedIsError"}


def test_incident_with_both_guards_off_decode_reads_other_requests_kv(model):
    rt, client, long, other, before = incident(model, {"NoCountCheck", "NoGenBump"})
    step_until(rt, lambda: client.finished(long) is not None)
    end = client.finished(long)
    assert (end.outcome, end.guard) == ("Ok", None)  # HTTP 200, as in the incident
    table = [page for page, _ in row(rt, long)[core.TABLE]]
    read, placeholder = rt.read_kv[long], rt.prompt_kv[long]
    # The prefill computed one page (the placeholder), and decode read exactly that...
    assert placeholder.shape[0] == PAGE and torch.equal(read[:PAGE], placeholder)
    assert rt.leaked(long) is False  # ...so the oracle over computed tokens sees no leak;
    # positions 4..51 were never written for this request: decode read them as they were
    # before it reserved them, the three earlier requests' KV, bit for bit...
    assert torch.equal(read[PAGE:], _rows_of(before, table, 52)[PAGE:])
    # ...and nothing like the KV of its own prompt.
    assert not torch.allclose(read[PAGE:], own_kv(model, prompt(20, 52))[PAGE:], atol=1e-2)
    finish_and_check_other(model, rt, client, other)
    # The core's own oracle agrees: the request got success over foreign pages.
    assert {v.property for v in rt.store.violations} >= {"Isolation", "OkIsClean"}
    assert "TruthfulObservation" not in {v.property for v in rt.store.violations}


def _rows_of(kv: torch.Tensor, pages: list[int], tokens: int) -> torch.Tensor:
    used = kv[torch.as_tensor(pages[:-(-tokens // PAGE)], dtype=torch.long)]
    used = used.permute(0, 4, 1, 2, 3, 5).reshape(-1, *used.shape[1:4], used.shape[5])
    return used[:tokens]


def late_write(model, bugs: set):
    """EagerRelease: request x is aborted while its three writes are in flight; decode
    frees its pages at once and y reserves them; y's writes land, y is accepted and
    decodes, and only then do x's late writes land in y's pages. z runs alongside."""
    rt = runtime(model, prefill_pages=16, decode_pages=16, context_tokens=64,
                 bugs={"EagerRelease"} | bugs)
    rt.transport.paused = True
    client = Client()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    x = rt.arrive(GenerationRequest(prompt(30, 9), params), client)
    step_until(rt, lambda: len(rt.transport.writes_of(x)) == 3)
    x_pages = [page for page, _ in row(rt, x)[core.TABLE]]
    rt.abort(x)
    step_until(rt, lambda: row(rt, x)[core.DST] == core.RELEASED)
    assert len(rt.transport.writes_of(x)) == 3  # released with three writes in flight
    y = rt.arrive(GenerationRequest(prompt(31, 9), params), client)
    z = rt.arrive(GenerationRequest(prompt(32, 6), params), client)
    step_until(rt, lambda: y in rt.store.rows and bool(row(rt, y)[core.TABLE]))
    y_pages = [page for page, _ in row(rt, y)[core.TABLE]]
    assert y_pages == x_pages  # the freed pages, reused at once
    rt.land_only(lambda w: w.request != x)
    step_until(rt, lambda: rt.land_only(lambda w: w.request != x) >= 0
               and row(rt, y)[core.DST] == core.DECODING)
    rt.land_only(lambda w: w.request == x)  # the late writes, into y's pages
    rt.transport.paused = False
    return rt, client, x, y, z, y_pages


def test_eager_release_a_late_write_fails_the_tag_check_of_the_new_owner(model):
    rt, client, x, y, z, _ = late_write(model, set())
    finish_and_check(model, rt, client, z, prompt(32, 6))
    assert (client.finished(y).outcome, client.finished(y).guard) == ("ErrTag", "tag")
    assert {v.property for v in rt.store.violations} == {"NoWriteIntoForeign"}


def test_late_write_looks_current_without_gen_bump_decode_reads_the_old_owners_kv(model):
    rt, client, x, y, z, pages = late_write(model, {"NoGenBump"})
    run(rt)
    assert client.finished(y).outcome == "Ok"
    assert rt.leaked(y)
    assert torch.equal(rt.read_kv[y], rt.prompt_kv[x])  # x's KV, bit for bit
    finish_and_check(model, rt, client, z, prompt(32, 6))
    assert {"Isolation", "OkIsClean"} <= {v.property for v in rt.store.violations}
    assert "TruthfulObservation" not in {v.property for v in rt.store.violations}


def finish_and_check(model, rt, client, r, prompt_ids):
    expected = reference(model, [(prompt_ids, SamplingParams(max_tokens=4, ignore_eos=True))])
    run(rt)
    assert client.finished(r).outcome == "Ok"
    assert client.tokens(r) == list(expected[0].output_ids)
    assert rt.whole() and rt.transport.in_flight == 0


def source_reuse(model, bugs: set):
    """SourceReuse: x's source pages are freed when its last write is posted; y is admitted
    onto them and computes its prompt there before x's writes land, so they carry y's KV."""
    rt = runtime(model, prefill_pages=3, decode_pages=16, context_tokens=12,
                 bugs={"SourceReuse"} | bugs)
    rt.transport.paused = True
    client = Client()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    x = rt.arrive(GenerationRequest(prompt(40, 8), params), client)
    step_until(rt, lambda: len(rt.transport.writes_of(x)) == 3)
    x_sources = row(rt, x)[core.SRC]
    y = rt.arrive(GenerationRequest(prompt(41, 8), params), client)
    step_until(rt, lambda: y in rt.store.rows and row(rt, y)[core.SENT] == 3)
    assert row(rt, y)[core.SRC] == x_sources  # y computed into x's source pages
    rt.land_only(lambda w: w.request == x)  # x's writes read y's KV now
    rt.transport.paused = False
    return rt, client, x, y


def test_source_reuse_the_checksum_fails_the_transfer(model):
    rt, client, x, y = source_reuse(model, set())
    finish_and_check(model, rt, client, y, prompt(41, 8))
    assert (client.finished(x).outcome, client.finished(x).guard) == ("ErrTransfer", "checksum")
    # SourceHeld: the write read a freed page; PageConservation: x's row still claims
    # the source pages that y now owns (the store's two views of the pool disagree).
    assert {v.property for v in rt.store.violations} == {"SourceHeld", "PageConservation"}


def test_source_reuse_unverified_decode_reads_the_other_requests_kv(model):
    rt, client, x, y = source_reuse(model, {"NoChecksum"})
    finish_and_check(model, rt, client, y, prompt(41, 8))
    assert client.finished(x).outcome == "Ok"
    assert rt.leaked(x)
    assert torch.equal(rt.read_kv[x], rt.prompt_kv[y])  # y's KV, bit for bit
    assert not rt.leaked(y)
    assert {"Isolation", "OkIsClean"} <= {v.property for v in rt.store.violations}
    assert "TruthfulObservation" not in {v.property for v in rt.store.violations}


# -- the engine as a fuzz target ----------------------------------------------------------

@pytest.mark.parametrize("entry,examples_max", [("source-reuse-unverified", 20),
                                                ("eager-release", 20), (None, 15)])
def test_the_engine_fuzz_target_catches_data_path_entries_and_raises_no_false_alarm(
        entry, examples_max):
    from fuzz.runner import Campaign, run_campaign
    from spec.check.zoo import ENTRY_BY_NAME

    bugs = ENTRY_BY_NAME[entry].bugs if entry else frozenset()
    properties = ENTRY_BY_NAME[entry].invariants if entry else None
    outcome = run_campaign(Campaign(target="engine", bugs=bugs, properties=properties, seed=1,
                                    examples=examples_max, shrink_seconds=0,
                                    minimize_seconds=1.0))
    assert outcome.caught == bool(entry), outcome


# -- the engine's run as a behaviour of the spec ---------------------------------------------

def test_an_engine_run_is_a_behaviour_of_the_tla_spec_and_validates_as_itf(model, tmp_path,
                                                                          capsys):
    """A small engine run (2 requests, one aborted while its writes are in flight; pools of
    3 and 4 pages) as a trace of the spec's finite model: every state the core reaches from
    the engine's events is a successor, under the TLA+ evaluator's Next of KVTransfer.tla's
    text, of the one before; and `kvproof validate` accepts it as ITF."""
    from api.cli import main
    from engine.eventlog import core_trace
    from spec.tlaplus.conformance import _Keys, _key, spec_for
    from spec.tlaplus.itf import write_itf

    rt = runtime(model, prefill_pages=3, decode_pages=4, context_tokens=12)
    rt.transport.paused = True
    client = Client()
    kept = rt.arrive(GenerationRequest(prompt(50, 5), SamplingParams(max_tokens=3)), client)
    gone = rt.arrive(GenerationRequest(prompt(51, 2), SamplingParams(max_tokens=3)), client)
    step_until(rt, lambda: len(rt.transport.writes_of(gone)) == 1)
    rt.abort(gone)
    rt.transport.paused = False
    run(rt)
    assert client.finished(kept).outcome == "Ok" and client.finished(gone).outcome == "Gone"
    m, steps = core_trace(rt.log_header(), rt.log)
    assert len(steps) == len(rt.log) + 1
    spec, keys = spec_for(m), _Keys(m)

    def first_illegal(steps) -> int | None:
        current = [s for s in spec.initial_states() if _key(s) == keys(steps[0][1])]
        assert len(current) == 1
        for index, (event, state) in enumerate(steps[1:], start=1):
            want = keys(state)
            current = [t for _, t in spec.successors(current[0]) if _key(t) == want][:1]
            if not current:
                return index
        return None
    assert first_illegal(steps) is None
    # The check can fail: a trace that skips one state (two steps at once) is not a
    # behaviour of the spec.
    assert first_illegal(steps[:5] + steps[6:]) == 5
    path = tmp_path / "engine-run.itf.json"
    write_itf(str(path), m, steps, "an engine run")
    assert main(["validate", str(path)]) == 0
    assert f"trace OK: {len(rt.log)} steps" in capsys.readouterr().out
    # The engine's own event log, checked against the spec's text (spec/tlaplus/runcheck.py).
    log = tmp_path / "engine-run.log"
    write_log(log, rt.log_header(), rt.log)
    assert main(["validate", str(log)]) == 0
    assert f"run OK: {len(rt.log)} steps, each a step of KVTransfer.tla" in \
        capsys.readouterr().out
    lines = log.read_text().splitlines(keepends=True)
    finish = next(k for k, line in enumerate(lines, start=1) if '"a":"Finish"' in line)
    lines[finish - 1] = lines[finish - 1].replace('"tags_ok":true', '"tags_ok":false')
    log.write_text("".join(lines))
    assert main(["validate", str(log)]) == 1
    assert f"engine-run.log line {finish}: step {finish - 1} (Finish(r" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dying_loop_fails_every_live_request_instead_of_leaving_it_hanging(model):
    engine = build_engine(loaded(model), EngineConfig(loop_nice=0, 
        context_length=64, page_tokens=PAGE, prefill_pool_tokens=128, decode_pool_tokens=128))
    client = Client()
    with pytest.raises(ValueError, match="token ids in"):
        engine.submit(GenerationRequest((5, 999), SamplingParams(max_tokens=3)), client)

    def broken_step():
        raise RuntimeError("a bug in a step")
    engine.runtime.step = broken_step
    r = engine.submit(GenerationRequest(prompt(1, 5), SamplingParams(max_tokens=3)), client)
    engine.start()
    engine._thread.join(10)
    assert isinstance(engine.error, RuntimeError)
    end = client.finished(r)
    assert end.outcome == "ErrDecode" and "a bug in a step" in end.detail


# -- a prefill that fails on its own: PrefillFail, decided by the core ----------------------

MARK = 210  # a token id only the victim's prompt holds (FaultyPrefill fails its chunks)


def unmarked(seed: int, length: int) -> tuple[int, ...]:
    return tuple(token if token != MARK else 0 for token in prompt(seed, length))


def victim_prompt() -> tuple[int, ...]:
    """14 tokens, the mark at position 10: the first chunk (8 tokens) computes cleanly, the
    second fails, batched with the next request's first chunk."""
    ids = list(unmarked(60, 14))
    ids[10] = MARK
    return tuple(ids)


@pytest.mark.parametrize("mode", FaultyPrefill.MODES)
def test_a_failing_prefill_step_fails_its_request_alone_through_the_core(model, mode,
                                                                          tmp_path):
    """One request's prefill step raises out of memory (batched with another request's
    chunk: the step is retried chunk by chunk) or computes NaN logits or NaN K/V in a layer
    no logit reads. The core takes PrefillFail: the client gets ErrPrefill; a request
    decoding, one computing beside it, one queued behind it, and one arriving later onto
    its freed (scrubbed) source pages all finish with the Generator's tokens; every page
    comes back and the log replays through a fresh core."""
    rt = runtime(model, max_batch=3)
    faulty = FaultyPrefill(model, MARK, mode)
    rt.prefill.model = faulty
    client = Client()
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8, top_k=20, seed=3)
    others = {"decoding": (unmarked(61, 5), SamplingParams(max_tokens=12, ignore_eos=True)),
              "computing": (unmarked(62, 12), greedy), "sampled": (unmarked(63, 9), sampled),
              "queued": (unmarked(64, 6), greedy), "later": (unmarked(65, 7), greedy)}
    ids = {"decoding": rt.arrive(GenerationRequest(*others["decoding"]), client)}
    step_until(rt, lambda: row(rt, ids["decoding"])[core.DST] == core.DECODING)
    victim = rt.arrive(GenerationRequest(victim_prompt(), greedy), client)
    for name in ("computing", "sampled", "queued"):
        ids[name] = rt.arrive(GenerationRequest(*others[name]), client)
    rt.step()
    assert phase(rt, victim) == "computing" and phase(rt, ids["queued"]) == "queued, reserved"
    step_until(rt, lambda: client.finished(victim) is not None)
    assert phase(rt, ids["decoding"]) == "decoding"
    # The worker zeroed the victim's source pages: no NaN stays in a pool for a masked-out
    # slot of the page's next owner to read (0 x NaN is NaN).
    assert bool(torch.isfinite(rt.prefill.pool.kv).all())
    run(rt)
    ids["later"] = rt.arrive(GenerationRequest(*others["later"]), client)
    run(rt)

    end = client.finished(victim)
    assert (end.outcome, end.guard, end.completion_tokens) == ("ErrPrefill", None, 0)
    assert client.tokens(victim) == []
    expected_detail = ("OutOfMemoryError: CUDA out of memory" if mode == "raise"
                       else "non-finite logits or K/V")
    assert expected_detail in end.detail
    assert faulty.failed_batches == ([2, 1] if mode == "raise" else [2])
    expected = reference(model, list(others.values()))
    for (name, r), completion in zip(ids.items(), expected):
        assert client.finished(r).outcome == "Ok", name
        assert client.tokens(r) == list(completion.output_ids), name
    assert_whole(rt)
    assert bool(torch.isfinite(rt.decode.pool.kv).all())
    assert rt.counts["outcomes"] == {"ErrPrefill": 1, "Ok": 5}
    victim_actions = [record["a"] for record in rt.log if record["request"] == victim]
    assert victim_actions == ["Arrive", "Reserve", "Admit", "PrefillFail", "Notice", "Release"]
    path = tmp_path / "engine.log"
    write_log(path, rt.log_header(), rt.log)
    store = replay(*read_log(path))
    assert store.rows == {} and store.violation_total == 0
    assert store.decode_pools == rt.store.decode_pools
    assert store.prefill_pools == rt.store.prefill_pools


def test_a_prefill_fail_after_a_client_abort_is_refused_and_the_prefill_stops_on_the_abort(
        model):
    rt = runtime(model)
    rt.prefill.model = FaultyPrefill(model, MARK, "raise")
    client = Client()
    victim = rt.arrive(GenerationRequest(victim_prompt(), SamplingParams(max_tokens=4)), client)
    step_until(rt, lambda: phase(rt, victim) == "computing")
    rt.abort(victim)  # the client-gone message is in flight when the step fails
    original = rt._deliver
    rt._deliver = lambda: False  # hold messages for one step: the fault comes first
    rt.step()
    rt._deliver = original
    assert rt.counts["refusals"] == {"the client is not waiting": 1}
    run(rt)
    assert client.finished(victim).outcome == "Gone"
    assert_whole(rt)
    actions = [record["a"] for record in rt.log]
    assert "PrefillFail" not in actions and "PrefillAbort" in actions


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("bug", [ValueError, NotImplementedError])
def test_a_bug_in_the_prefill_step_still_ends_the_loop(model, bug):
    """Only what a model step raises for its requests (COMPUTE_FAULTS) is a request's
    failure; a bug (a ValueError inside the step, or a NotImplementedError, which is a
    RuntimeError that only code raises) ends the loop as before: every live request
    ErrDecode, the error kept."""
    engine = build_engine(loaded(model), EngineConfig(loop_nice=0, 
        context_length=64, page_tokens=PAGE, prefill_pool_tokens=128, decode_pool_tokens=128))
    client = Client()

    class Buggy(FaultyPrefill):
        def prefill(self, pool, chunks, all_logits=False):
            raise bug("a bug in the prefill step")
    engine.runtime.prefill.model = Buggy(model, MARK, "raise")
    r = engine.submit(GenerationRequest(prompt(1, 5), SamplingParams(max_tokens=3)), client)
    engine.start()
    engine._thread.join(10)
    assert type(engine.error) is bug
    end = client.finished(r)
    assert end.outcome == "ErrDecode" and "a bug in the prefill step" in end.detail
