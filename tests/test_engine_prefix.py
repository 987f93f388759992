"""Decode's prefix cache in the protocol-driven engine (engine/prefix.py, issue 28), over
tiny random Llama and Qwen2 models in fp32 on the CPU.

What is pinned: with the cache on, greedy generation gives the same tokens as with it off
and logits within LOGITS_ATOL, for waves of requests whose prompts share prefixes, while
the cache hits (exact hit, transfer and eviction counts) and after LRU evictions under pool
pressure; a hit page is read where the sharer's prefill wrote it; a partial last page and
output pages never match; the run's log (with its Evict records) replays through a fresh
store to the same pools; a drained engine holds only free and idle cached pages.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.eventlog import core_trace, read_log, replay, write_log  # noqa: E402
from engine.model import LlamaModel  # noqa: E402
from engine.prefix import DIGEST_MAX, Nonces, page_digest, page_tokens_of  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import Finished, GenerationRequest, TenantCache  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402
from engine_cases import LOGITS_ATOL, make_hf_model  # noqa: E402
from spec import core  # noqa: E402

PAGE = 4


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, folder)
    return LlamaModel(load_checkpoint(folder))


def ids(seed: int, length: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 211, (length,), generator=generator).tolist())


SYSTEM = ids(100, 13)  # three full pages and one token of a fourth
OTHER = ids(200, 12)   # another prefix: three full pages


class Recorder:
    """Every request's tokens, logits rows and end, from the runtime's own token path."""

    def __init__(self, rt: Runtime):
        self.tokens: dict[int, list] = {}
        self.logits: dict[int, list] = {}
        self.ends: dict[int, Finished] = {}
        inner = rt._next_token

        def next_token(live, token, logits):
            self.tokens.setdefault(live.request_id, []).append(token)
            self.logits.setdefault(live.request_id, []).append(logits.clone())
            inner(live, token, logits)
        rt._next_token = next_token

    def __call__(self, event):
        if isinstance(event, Finished):
            assert event.request_id not in self.ends
            self.ends[event.request_id] = event


def drain(rt: Runtime, steps_max: int = 3000) -> None:
    for _ in range(steps_max):
        if rt.idle:
            return
        rt.step()
    raise AssertionError(f"not idle after {steps_max} steps")


def step_until(rt: Runtime, condition, steps_max: int = 1000) -> None:
    for _ in range(steps_max):
        if condition():
            return
        rt.step()
    raise AssertionError("condition never held")


# Waves: each wave arrives once the previous wave's transfers are accepted (its prompt
# pages sealed), so later waves find them cached. Wave 2 shares SYSTEM with wave 1 while
# wave 1 still decodes; wave 3 brings OTHER, whose pages push idle SYSTEM pages out of a
# small pool; wave 4 comes back to SYSTEM after the evictions.
WAVES = [
    [SYSTEM + ids(1, 5)],
    [SYSTEM + ids(2, 7), SYSTEM[:8] + ids(3, 6), SYSTEM + ids(1, 5)],
    [OTHER + ids(4, 9), OTHER + ids(5, 3)],
    [SYSTEM + ids(6, 4), OTHER + ids(7, 2)],
]
MAX_TOKENS = 6


def serve_waves(model, prefix_cache: bool, decode_pages: int = 24, prefill_pages: int = 64,
                **overrides):
    rt = Runtime(model, RuntimeConfig(prefill_pages=prefill_pages, decode_pages=decode_pages,
                                      page_tokens=PAGE, context_tokens=64,
                                      prefill_chunk_tokens=8, transfer_timeout_s=1e9,
                                      lease_s=1e9, prefix_cache=prefix_cache, **overrides))
    recorder = Recorder(rt)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    for wave in WAVES:
        ids_of_wave = [rt.arrive(GenerationRequest(p, sampling), recorder) for p in wave]
        step_until(rt, lambda: all(r not in rt.store.rows
                                   or rt.store.rows[r][core.DST] != core.D_WAITING
                                   and rt.store.rows[r][core.DST] != core.D_NONE
                                   for r in ids_of_wave))
    drain(rt)
    return rt, recorder


def test_cached_prefixes_give_the_same_tokens_and_logits_as_no_cache_after_evictions(
        model, tmp_path, capsys):
    from api.cli import main

    off, expected = serve_waves(model, prefix_cache=False)
    on, got = serve_waves(model, prefix_cache=True, decode_pages=12)
    requests = sum(len(w) for w in WAVES)
    assert sorted(got.ends) == sorted(expected.ends) == list(range(requests))
    for r in range(requests):
        assert (got.ends[r].outcome, got.ends[r].finish_reason) == ("Ok", "length"), r
        assert got.tokens[r] == expected.tokens[r], r
        diff = max((a - b).abs().max().item() for a, b in zip(got.logits[r], expected.logits[r]))
        assert diff <= LOGITS_ATOL, (r, diff)
    # Wave 1 caches its 4 full pages (18 tokens; the fifth page is partial: a nonce).
    # Wave 2: 3 pages of SYSTEM (the fourth page differs), 2 for the prompt sharing SYSTEM's
    # first 8 tokens, all 4 for the repeated prompt. Wave 3: OTHER is new to both of its
    # requests (they reserve together, before either's pages are sealed). Wave 4: SYSTEM's
    # pages were evicted for OTHER's in the 12-page pool (LRU: released earlier), OTHER's
    # first 3 pages are still cached; with a pool of 64 nothing is evicted and both hit.
    assert [got.ends[r].cached_tokens for r in range(requests)] == [
        0, 12, 8, 16, 0, 0, 0, 12]
    pages = [-(-(len(p) + MAX_TOKENS - 1) // PAGE) for wave in WAVES for p in wave]
    assert off.transport.writes_landed == sum(pages) == 47
    assert on.transport.writes_landed == 47 - 12
    counts = on.counts["prefix"]
    assert (counts["hit_pages"], counts["reserved_prompt_pages"]) == (12, 31)
    assert counts["evicted_lru_pages"] > 0
    assert on.whole() and on.store.violation_total == 0, on.store.violations
    idle = len(on.store.decode_idle[0])  # a drained cache keeps its shareable pages
    decode = on.pool_snapshots()[1]
    assert idle > 0 and (decode.free, decode.held, decode.cached, decode.cached_idle) == (
        12, 0, idle, idle)
    roomy, unevicted = serve_waves(model, prefix_cache=True, decode_pages=64)
    assert [unevicted.ends[r].cached_tokens for r in range(requests)] == [
        0, 12, 8, 16, 0, 0, 12, 12]
    assert roomy.counts["prefix"]["evicted_lru_pages"] == 0
    assert all(unevicted.tokens[r] == expected.tokens[r] for r in range(requests))
    # The log, its Evict records too, replays through a fresh store to the same pools.
    path = tmp_path / "engine.log"
    write_log(path, on.log_header(), on.log)
    header, records = read_log(path)
    store = replay(header, records)
    assert store.decode_pools == on.store.decode_pools and store.violation_total == 0
    assert sum(record["a"] == "Evict" for record in records) == (
        counts["evicted_lru_pages"] + counts["evicted_unshareable_pages"])
    m, steps = core_trace(header, records)  # the spec's model, through core.apply
    assert m.prefix_cache and len(steps) == len(records) + 1
    # The log, checked against KVTransfer.tla's text (spec/tlaplus/runcheck.py), Evicts too.
    capsys.readouterr()
    assert main(["validate", str(path)]) == 0
    assert f"run OK: {len(records)} steps, each a step of KVTransfer.tla" in \
        capsys.readouterr().out
    # It can fail: the second request under another salt hits nothing, so its Reserve of
    # the 2 pages it lacked with its hit is not a step of the spec.
    lines = path.read_text().splitlines(keepends=True)
    arrive = [k for k, line in enumerate(lines) if '"a":"Arrive"' in line][1]
    lines[arrive] = lines[arrive].replace('"salt":', '"salt":1')  # another salt, digits before
    path.write_text("".join(lines))
    assert main(["validate", str(path)]) == 1
    assert "Reserve(r2" in capsys.readouterr().out


def test_a_hit_page_is_read_where_the_sharers_prefill_wrote_it(model):
    rt = Runtime(model, RuntimeConfig(prefill_pages=32, decode_pages=32, page_tokens=PAGE,
                                      context_tokens=64, prefill_chunk_tokens=8,
                                      transfer_timeout_s=1e9, lease_s=1e9, prefix_cache=True))
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    first = rt.arrive(GenerationRequest(SYSTEM + ids(1, 3), sampling), lambda e: None)
    step_until(rt, lambda: rt.store.rows[first][core.DST] == core.DECODING)
    second = rt.arrive(GenerationRequest(SYSTEM + ids(2, 3), sampling), lambda e: None)
    step_until(rt, lambda: rt.store.rows[second][core.DST] == core.DECODING)
    table1, table2 = rt.store.rows[first][core.TABLE], rt.store.rows[second][core.TABLE]
    assert table2[:3] == table1[:3]  # the same pages, at the generation they were sealed at
    assert set(p for p, _ in table2[3:]).isdisjoint(p for p, _ in table1)
    assert rt.live[second].sequence.pages[:3] == [p for p, _ in table1[:3]]
    pool = rt.store.decode_pools[0]
    assert all(pool[p][core.READERS] == (first, second) for p, _ in table1[:3])
    drain(rt)
    assert rt.whole() and rt.store.violation_total == 0


def test_only_pages_the_prompt_fills_get_digests_the_rest_never_match():
    nonces = Nonces()
    a = page_tokens_of(SYSTEM, 6, PAGE, nonces)
    b = page_tokens_of(SYSTEM, 6, PAGE, nonces)
    assert a[:3] == b[:3] == tuple(page_digest(SYSTEM[i * 4:i * 4 + 4]) for i in range(3))
    assert all(1 <= t <= DIGEST_MAX for t in a[:3])
    assert all(t > DIGEST_MAX for t in a[3:] + b[3:]) and set(a[3:]).isdisjoint(b[3:])
    assert page_digest((1, 2, 3, 4)) != page_digest((1, 2, 3, 5))


# The default model's logits are of order 10; a cached prefix's KV was computed in another
# prefill batch (other matmul shapes, other sums): 5.3e-5 seen here, so 1e-3 (any real error,
# a wrong page or position, moves logits by whole units).
DEFAULT_MODEL_LOGITS_ATOL = 1e-3


def chat(tokenizer, system: str, question: str) -> tuple[int, ...]:
    text = tokenizer.render_chat([{"role": "system", "content": system},
                                  {"role": "user", "content": question}])
    return tuple(tokenizer.backend.encode(text, add_special_tokens=False).ids)


@pytest.mark.slow
def test_the_default_model_gives_the_same_tokens_with_a_cached_system_prompt():
    """SmolLM2-135M-Instruct (fp32): chat prompts sharing a system prompt, greedy, with no
    cache, decode's, and decode's and the prefill's (which then computes 64 prompt tokens
    fewer). Skipped without the default model's package."""
    from engine.load import DefaultModelMissing, default_model_path, load_model

    try:
        loaded = load_model(default_model_path())
    except DefaultModelMissing:
        pytest.skip("the default model is not installed")
    system = ("You are a concise assistant for a railway company. Answer questions about "
              "timetables, tickets and stations in one or two sentences.")
    questions = [["When does the first train leave?"],
                 ["How much is a return ticket?", "Is there a lift at the station?"]]
    runs, computed = {}, {}
    for cache in (False, True, "prefill too"):
        rt = Runtime(loaded.model, RuntimeConfig(prefill_pages=64, decode_pages=64,
                                                 page_tokens=16, context_tokens=512,
                                                 transfer_timeout_s=1e9, lease_s=1e9,
                                                 prefix_cache=bool(cache),
                                                 prefill_cache=cache == "prefill too"),
                     loaded.tokenizer)
        recorder = Recorder(rt)
        sampling = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
        for wave in questions:
            ids_of_wave = [rt.arrive(GenerationRequest(chat(loaded.tokenizer, system, q),
                                                       sampling), recorder) for q in wave]
            step_until(rt, lambda: all(r not in rt.store.rows
                                       or rt.store.rows[r][core.DST] not in (core.D_NONE,
                                                                             core.D_WAITING)
                                       for r in ids_of_wave))
        drain(rt)
        runs[cache] = recorder
        computed[cache] = rt.counts["prefill"]["computed_tokens"]
    assert computed["prefill too"] == computed[False] - 2 * 32 == computed[True] - 64
    off = runs[False]
    for on in (runs[True], runs["prefill too"]):
        cached = [on.ends[r].cached_tokens for r in range(3)]
        assert cached == [0, 32, 32]  # the system prompt's 2 full pages (46-47 tokens)
        for r in range(3):
            assert on.tokens[r] == off.tokens[r], r
            diff = max((a - b).abs().max().item() for a, b in zip(on.logits[r], off.logits[r]))
            assert diff <= DEFAULT_MODEL_LOGITS_ATOL, (r, diff)


def test_an_abort_at_every_phase_of_a_hitting_request_keeps_the_cache_whole(model):
    """A request that hits SYSTEM's cached pages is aborted after 0..14 steps (bootstrap
    queued, reserved with its references, computing, writes in flight, decoding): its
    references go, the cached pages stay cached with no reader, every pool is whole, the
    store's oracles stay quiet, and a later request still hits them with the tokens and
    logits of a run without the cache."""
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    later = SYSTEM + ids(9, 6)
    off = Runtime(model, RuntimeConfig(prefill_pages=32, decode_pages=16, page_tokens=PAGE,
                                       context_tokens=64, prefill_chunk_tokens=4))
    expected = Recorder(off)
    off.arrive(GenerationRequest(later, sampling), expected)
    drain(off)
    seen = set()
    for paused in (False, True):
        for steps in range(15):
            rt = Runtime(model, RuntimeConfig(prefill_pages=32, decode_pages=16,
                                              page_tokens=PAGE, context_tokens=64,
                                              prefill_chunk_tokens=4, prefix_cache=True))
            recorder = Recorder(rt)
            first = rt.arrive(GenerationRequest(SYSTEM + ids(1, 3), sampling), recorder)
            drain(rt)
            cached = {p for p, _ in rt.store.decode_idle[0].items()}
            assert len(cached) == 4  # SYSTEM's 3 full pages and the first prompt's 4th
            rt.transport.paused = paused
            victim = rt.arrive(GenerationRequest(SYSTEM + ids(2, 5), sampling), recorder)
            for _ in range(steps):
                rt.step()
            if victim not in rt.store.rows:
                continue
            x = rt.store.rows[victim]
            seen.add((core.DECODE_NAMES[x[core.DST]], core.PREFILL_NAMES[x[core.PST]],
                      bool(rt.transport.writes_of(victim))))
            rt.abort(victim)
            rt.transport.paused = False
            drain(rt)
            assert rt.whole() and rt.store.violation_total == 0, rt.store.violations
            pool = rt.store.decode_pools[0]
            assert all(pool[p][core.IDENT] and not pool[p][core.READERS] for p in cached)
            third = rt.arrive(GenerationRequest(later, sampling), recorder)
            drain(rt)
            assert recorder.ends[third].cached_tokens == 3 * PAGE
            assert recorder.tokens[third] == expected.tokens[0]
            assert all((a - b).abs().max().item() <= LOGITS_ATOL
                       for a, b in zip(recorder.logits[third], expected.logits[0]))
            assert recorder.ends[first].outcome == "Ok"
    assert {("None", "Queued", False), ("Waiting", "Running", True),
            ("Decoding", "Done", False)} <= seen, seen


@pytest.mark.parametrize("fault, guard", [("flip", "checksum"), ("lost", "count")])
def test_a_wire_fault_in_a_hitting_requests_tail_names_its_guard(model, fault, guard):
    """The count check compares the pages sent with the pages reserved less the hit: a
    flipped bit in the tail is the checksum guard's, a lost write the count guard's; the
    failed transfer seals nothing, the cached pages keep no reader, every pool is whole.
    The victim read shared pages: its trip counts as a shared-page trip, for its tenant (a
    label only: it hits the default tenant's pages, as their salts are equal)."""
    rt = Runtime(model, RuntimeConfig(prefill_pages=32, decode_pages=16, page_tokens=PAGE,
                                      context_tokens=64, prefill_chunk_tokens=8,
                                      transfer_timeout_s=1e9, lease_s=1e9, prefix_cache=True))
    recorder = Recorder(rt)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    rt.arrive(GenerationRequest(SYSTEM + ids(1, 3), sampling), recorder)
    drain(rt)
    cached = set(rt.store.decode_idle[0])
    rt.transport.fault_injection = rt.transport.paused = True
    victim = rt.arrive(GenerationRequest(SYSTEM + ids(2, 5), sampling, tenant="victim"),
                       recorder)
    step_until(rt, lambda: len(rt.transport.writes_of(victim)) == 3)  # 6 pages less 3 hit
    rt.transport.inject(rt.transport.writes_of(victim)[0], fault)
    rt.transport.paused = False
    drain(rt)
    end = recorder.ends[victim]
    assert (end.outcome, end.guard, end.cached_tokens) == ("ErrTransfer", guard, 3 * PAGE)
    pool = rt.store.decode_pools[0]
    assert set(rt.store.decode_idle[0]) == cached  # nothing of the victim's was sealed
    assert all(not pool[p][core.READERS] for p in cached)
    assert rt.whole()
    # The abstract page contents know no wire fault: the store notes the bad verdict it
    # cannot explain, and nothing else.
    assert rt.store.violation_counts == {"TruthfulObservation": 1}
    assert rt.counts["guard_trips"] == rt.counts["prefix_shared_guard_trips"] == {guard: 1}
    assert rt.counts["prefix_tenants"] == {
        "default": TenantCache(prompt_pages=4),
        "victim": TenantCache(prompt_pages=4, hit_pages=3, shared_guard_trips=1)}


def test_a_wire_fault_in_a_request_that_hit_nothing_is_no_shared_page_trip(model):
    """The same flipped bit in a request that read no cached page: a guard trip, not a
    shared-page one."""
    rt = Runtime(model, RuntimeConfig(prefill_pages=32, decode_pages=16, page_tokens=PAGE,
                                      context_tokens=64, prefill_chunk_tokens=8,
                                      transfer_timeout_s=1e9, lease_s=1e9, prefix_cache=True))
    recorder = Recorder(rt)
    rt.transport.fault_injection = rt.transport.paused = True
    r = rt.arrive(GenerationRequest(SYSTEM + ids(1, 3), SamplingParams(max_tokens=4)),
                  recorder)
    step_until(rt, lambda: len(rt.transport.writes_of(r)) == 5)
    rt.transport.inject(rt.transport.writes_of(r)[0], "flip")
    rt.transport.paused = False
    drain(rt)
    assert (recorder.ends[r].outcome, recorder.ends[r].guard) == ("ErrTransfer", "checksum")
    assert rt.counts["guard_trips"] == {"checksum": 1}
    assert rt.counts["prefix_shared_guard_trips"] == {}
    assert rt.counts["prefix_tenants"] == {"default": TenantCache(prompt_pages=4)}


def test_two_by_two_workers_cache_per_decode_worker_and_the_run_validates(model, tmp_path,
                                                                          capsys):
    """2 prefill x 2 decode workers: each decode worker caches its own pages (the router
    places by load, not by cache: a prompt hits only what its decode worker holds), the
    tokens are those without the cache, and the log, Evicts of both workers too, replays
    and is a run of KVTransfer.tla."""
    from api.cli import main

    workers = dict(prefill_workers=2, decode_workers=2)
    _, expected = serve_waves(model, prefix_cache=False, **workers)
    on, got = serve_waves(model, prefix_cache=True, decode_pages=12, **workers)
    assert all(got.tokens[r] == expected.tokens[r] for r in expected.tokens)
    assert [got.ends[r].cached_tokens for r in sorted(got.ends)] == [
        0, 0, 8, 12, 0, 0, 12, 12]
    assert on.whole() and on.store.violation_total == 0
    path = tmp_path / "engine.log"
    write_log(path, on.log_header(), on.log)
    assert replay(*read_log(path)).decode_pools == on.store.decode_pools
    assert main(["validate", str(path)]) == 0
    assert "run OK" in capsys.readouterr().out


def test_a_cached_engine_run_validates_as_itf(model, tmp_path, capsys):
    """A small engine run with decode's cache (the second request hits the first's two full
    pages) written as an ITF trace of the spec's model (Tokens 2^62: each Arrive's prompt
    is read off the recorded state, never enumerated) is accepted by `kvproof validate`;
    a trace whose second Arrive claims a prompt other than its state's is refused."""
    import json

    from api.cli import main
    from spec.tlaplus.itf import write_itf

    rt = Runtime(model, RuntimeConfig(prefill_pages=3, decode_pages=4, page_tokens=PAGE,
                                      context_tokens=12, prefill_chunk_tokens=8,
                                      transfer_timeout_s=1e9, lease_s=1e9, prefix_cache=True))
    ends = Recorder(rt)
    for _ in range(2):
        rt.arrive(GenerationRequest(SYSTEM[:9], SamplingParams(max_tokens=2)), ends)
        drain(rt)
    assert [ends.ends[r].cached_tokens for r in range(2)] == [0, 8]
    m, steps = core_trace(rt.log_header(), rt.log)
    path = tmp_path / "cached.itf.json"
    write_itf(str(path), m, steps, "a cached engine run")
    capsys.readouterr()
    assert main(["validate", str(path)]) == 0
    assert f"trace OK: {len(rt.log)} steps" in capsys.readouterr().out
    trace = json.loads(path.read_text())
    second = [s for s in trace["states"] if s.get("#meta", {}).get("action") == "Arrive"][1]
    second["salt"]["#map"] = [[k, v + 1 if k == "r2" else v] for k, v in second["salt"]["#map"]]
    path.write_text(json.dumps(trace))
    assert main(["validate", str(path)]) == 1
    assert "illegal" in capsys.readouterr().out
