"""The prefill's prefix cache in the protocol-driven engine (issue 28): a request whose
prompt starts with full pages the prefill holds cached computes only the rest, its
attention reading the cached pages' KV. Tiny random Llama and Qwen2 models, fp32, CPU.

What is pinned: the same greedy tokens as without any cache, logits within LOGITS_ATOL
(1e-4), across waves of shared prefixes, chunked prefill (chunks of 8 and of 3, ending
mid-page) and LRU evictions in a small prefill pool; the exact prompt tokens each request
computes (the engine's counter); a prompt cached whole recomputes its last token only,
and never changes a byte of the cached pages; two salts never share a prefill page; a
hitting request's failed prefill leaves the cached pages it read as they were; the
prompt KV the leak oracle keeps is the request's own (against a run without the cache);
the run's log, PrefillEvicts too, replays and validates against KVTransfer.tla.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.eventlog import read_log, replay, write_log  # noqa: E402
from engine.model import LlamaModel  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import GenerationRequest  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402
from engine_cases import LOGITS_ATOL, FaultyPrefill, make_hf_model  # noqa: E402
from spec import core  # noqa: E402
from test_engine_prefix import (MAX_TOKENS, PAGE, SYSTEM, WAVES, Recorder, drain, ids,  # noqa: E402
                                serve_waves, step_until)


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, folder)
    return LlamaModel(load_checkpoint(folder))


def runtime(model, **overrides) -> Runtime:
    options = dict(prefill_pages=32, decode_pages=32, page_tokens=PAGE, context_tokens=64,
                   prefill_chunk_tokens=8, transfer_timeout_s=1e9, lease_s=1e9,
                   prefix_cache=True, prefill_cache=True)
    return Runtime(model, RuntimeConfig(**{**options, **overrides}))


def same_as(got: Recorder, expected: Recorder, r: int, r_expected: int | None = None) -> bool:
    r_expected = r if r_expected is None else r_expected
    return got.tokens[r] == expected.tokens[r_expected] and all(
        (a - b).abs().max().item() <= LOGITS_ATOL
        for a, b in zip(got.logits[r], expected.logits[r_expected]))


def test_cached_prefill_gives_the_same_tokens_and_logits_after_evictions(model, tmp_path,
                                                                         capsys):
    """The waves of test_engine_prefix.py (shared prefixes, chunks of 8 ending mid-page),
    the prefill's pool 10 pages (its LRU cache evicts), decode's 12."""
    from api.cli import main

    off, expected = serve_waves(model, prefix_cache=False)
    on, got = serve_waves(model, prefix_cache=True, decode_pages=12, prefill_pages=10,
                          prefill_cache=True)
    requests = sum(len(w) for w in WAVES)
    for r in range(requests):
        assert (got.ends[r].outcome, got.ends[r].finish_reason) == ("Ok", "length"), r
        assert same_as(got, expected, r), r
    prompt_tokens = [len(p) for wave in WAVES for p in wave]
    # cached_tokens are now the prefill's hits (OpenAI's: not recomputed). Wave 2: SYSTEM's
    # 3 full pages, 2 for the prompt sharing 8 tokens, all 4 of the repeated prompt (18
    # tokens: its partial fifth page is computed). Wave 3: the second OTHER prompt waits
    # for decode's pages, and is admitted after the first's SendDone sealed OTHER's 3
    # pages. Wave 4: the 6 LRU evictions took SYSTEM's third page (2 hit), OTHER's 3 hit.
    cached = [got.ends[r].cached_tokens for r in range(requests)]
    assert cached == [0, 12, 8, 16, 0, 12, 8, 12]
    counts = on.counts["prefill"]
    assert counts["computed_tokens"] == sum(prompt_tokens) - sum(cached) == 137 - 68
    assert off.counts["prefill"]["computed_tokens"] == sum(prompt_tokens)
    assert (counts["hit_pages"], counts["admitted_prompt_pages"]) == (17, 31)
    # 16 nonce-keyed pages (partial last pages, output pages) evicted at their SendDone.
    assert (counts["evicted_lru_pages"], counts["evicted_unshareable_pages"]) == (6, 16)
    assert on.whole() and on.store.violation_total == 0, on.store.violations
    path = tmp_path / "engine.log"
    write_log(path, on.log_header(), on.log)
    header, records = read_log(path)
    store = replay(header, records)
    assert store.prefill_pools == on.store.prefill_pools and store.violation_total == 0
    assert sum(record["a"] == "PrefillEvict" for record in records) == (
        counts["evicted_lru_pages"] + counts["evicted_unshareable_pages"])
    capsys.readouterr()
    assert main(["validate", str(path)]) == 0
    assert f"run OK: {len(records)} steps" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [1, 0], ids=["partial-last-page", "page-aligned"])
def test_a_second_request_with_the_same_prompt_computes_only_its_suffix(model, extra):
    """SYSTEM's 12 full-page tokens and `extra` more, twice, chunks of 3. The second
    computes the partial last page only; a prompt of whole pages, all cached, recomputes
    its last token (for the first token's logits) and writes its K/V to the scratch page:
    the cached pages' bytes and checksums do not change."""
    prompt = SYSTEM[:12 + extra]
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = runtime(model, prefix_cache=False, prefill_cache=False, prefill_chunk_tokens=3)
    expected = Recorder(plain)
    plain.arrive(GenerationRequest(prompt, sampling), expected)
    drain(plain)
    rt = runtime(model, prefill_chunk_tokens=3)
    got = Recorder(rt)
    first = rt.arrive(GenerationRequest(prompt, sampling), got)
    drain(rt)
    pool = rt.prefills[0].pool
    cached = [p for p, page in enumerate(rt.store.prefill_pools[0]) if page[core.P_IDENT]]
    assert len(cached) == 3
    before = pool.kv[cached].clone(), pool.checksums[cached].clone()
    assert rt.counts["prefill"]["computed_tokens"] == len(prompt)
    second = rt.arrive(GenerationRequest(prompt, sampling), got)
    drain(rt)
    assert rt.counts["prefill"]["computed_tokens"] == len(prompt) + max(extra, 1)
    assert got.ends[second].cached_tokens == 12
    assert torch.equal(pool.kv[cached], before[0]) and torch.equal(pool.checksums[cached],
                                                                   before[1])
    for r in (first, second):
        assert same_as(got, expected, r, 0), r
    assert rt.whole() and rt.store.violation_total == 0, rt.store.violations


def test_two_salts_never_share_prefill_pages(model):
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    rt = runtime(model)
    got = Recorder(rt)
    prompt = SYSTEM + ids(1, 4)  # 17 tokens: 4 full pages
    for salt in (1, 2, 1):
        rt.arrive(GenerationRequest(prompt, sampling, cache_salt=salt), got)
        drain(rt)
    assert [got.ends[r].cached_tokens for r in range(3)] == [0, 0, 16]
    assert rt.counts["prefill"]["computed_tokens"] == 17 + 17 + 1
    salts = {page[core.P_IDENT][0] for page in rt.store.prefill_pools[0] if page[core.P_IDENT]}
    assert salts == {1, 2}
    assert got.tokens[0] == got.tokens[1] == got.tokens[2]


def test_a_hitting_requests_failed_prefill_leaves_the_cached_pages_whole(model):
    """A request that hits SYSTEM's cached pages computes NaN K/V in its suffix (the
    FaultyPrefill of engine_cases.py): it ends ErrPrefill, its own pages are scrubbed, the
    cached pages it read keep their bytes, and the next request hitting them gets the
    tokens and logits of a run without any cache."""
    mark = 210
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    later = SYSTEM + ids(9, 6)
    plain = runtime(model, prefix_cache=False, prefill_cache=False)
    expected = Recorder(plain)
    plain.arrive(GenerationRequest(later, sampling), expected)
    drain(plain)
    rt = runtime(model, keep_kv=True)
    got = Recorder(rt)
    rt.arrive(GenerationRequest(SYSTEM + ids(1, 3), sampling), got)
    drain(rt)
    pool = rt.prefills[0].pool
    cached = [p for p, page in enumerate(rt.store.prefill_pools[0]) if page[core.P_IDENT]]
    before = pool.kv[cached].clone()
    rt.prefills[0].model = FaultyPrefill(model, mark, "nan_kv")
    victim = rt.arrive(GenerationRequest(SYSTEM + (mark,) + ids(2, 4), sampling), got)
    drain(rt)
    assert got.ends[victim].outcome == "ErrPrefill"
    assert torch.equal(pool.kv[cached], before) and bool(torch.isfinite(pool.kv).all())
    third = rt.arrive(GenerationRequest(later, sampling), got)
    drain(rt)
    assert got.ends[third].cached_tokens == 12 and same_as(got, expected, third, 0)
    # The leak oracle's evidence: the prompt KV it keeps for the hitting request is what
    # its prompt produces alone (a run without the cache), and decode read exactly that.
    own = plain_prompt_kv(model, later)
    assert (rt.prompt_kv[third] - own).abs().max().item() <= 1e-5
    assert not rt.leaked(third)
    assert rt.whole() and rt.store.violation_total == 0, rt.store.violations


def plain_prompt_kv(model, prompt) -> torch.Tensor:
    rt = runtime(model, prefix_cache=False, prefill_cache=False, keep_kv=True)
    r = rt.arrive(GenerationRequest(prompt, SamplingParams(max_tokens=1)), lambda e: None)
    drain(rt)
    return rt.prompt_kv[r]


def test_the_prefill_cache_needs_decodes():
    with pytest.raises(ValueError, match="prefill_cache needs prefix_cache"):
        RuntimeConfig(prefill_cache=True)


def test_an_abort_at_every_phase_of_a_prefill_hitting_request_keeps_the_cache_whole(model):
    """A request that hits SYSTEM's 3 pages in the prefill's cache is aborted after 0..9
    steps (queued, computing its suffix in chunks of 3, writes in flight, decoding): its
    references go, its own pages come back, the cached pages keep their bytes and no
    reader, every pool is whole, the store's oracles stay quiet, and a later request still
    computes only its suffix with the tokens of a run without any cache."""
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    later = SYSTEM + ids(9, 6)
    plain = runtime(model, prefix_cache=False, prefill_cache=False, prefill_chunk_tokens=3)
    expected = Recorder(plain)
    plain.arrive(GenerationRequest(later, sampling), expected)
    drain(plain)
    seen = set()
    for steps in range(10):
        rt = runtime(model, prefill_chunk_tokens=3)
        got = Recorder(rt)
        rt.arrive(GenerationRequest(SYSTEM + ids(1, 3), sampling), got)
        drain(rt)
        pool, pages = rt.prefills[0].pool, rt.store.prefill_pools[0]
        cached = [p for p, page in enumerate(pages) if page[core.P_IDENT]]
        assert len(cached) == 4  # SYSTEM's 3 full pages and the first prompt's 4th
        before = pool.kv[cached].clone()
        victim = rt.arrive(GenerationRequest(SYSTEM + ids(2, 8), sampling), got)
        for _ in range(steps):
            rt.step()
        if victim in rt.store.rows:
            x = rt.store.rows[victim]
            seen.add((core.PREFILL_NAMES[x[core.PST]], x[core.PCACHED]))
            rt.abort(victim)
        drain(rt)
        assert rt.whole() and rt.store.violation_total == 0, rt.store.violations
        assert all(pages[p][core.P_IDENT] and not pages[p][core.P_READERS] for p in cached)
        assert torch.equal(pool.kv[cached], before)
        computed = rt.counts["prefill"]["computed_tokens"]
        third = rt.arrive(GenerationRequest(later, sampling), got)
        drain(rt)
        assert rt.counts["prefill"]["computed_tokens"] - computed == len(later) - 12
        assert got.ends[third].cached_tokens == 12 and same_as(got, expected, third, 0)
    assert {("Queued", 0), ("Running", 3), ("Done", 3)} <= seen, seen


def _evicted_while_sending(model, bugs: frozenset):
    """r1 (tenant 1) computes a 9-token prompt: its 2 full pages stay cached at the prefill
    (a 3-page pool). Decode forgets its copies, so r2, the same prompt, hits both pages at
    the prefill and must send them; its writes are held on the wire. r3 (tenant 2, another
    prompt of 2 pages) then needs pages: with EvictWhileSending the cache evicts the two
    r2 still sends from and r3 computes its KV into them before r2's writes land."""
    rt = runtime(model, prefill_pages=3, decode_pages=16, bugs=bugs, keep_kv=True)
    got = Recorder(rt)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    prompt, other = ids(10, 9), ids(20, 5)
    rt.arrive(GenerationRequest(prompt, one, cache_salt=1), got)
    drain(rt)
    for page in rt.store.idle_cached(0):
        assert rt.evict(0, page)
    rt.transport.paused = True
    r2 = rt.arrive(GenerationRequest(prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                                     cache_salt=1), got)
    step_until(rt, lambda: sum(w.request == r2 for w in rt.transport.writes_of_all()) == 3)
    assert rt.store.rows[r2][core.PCACHED] == 2
    r3 = rt.arrive(GenerationRequest(other, one, cache_salt=2), got)
    for _ in range(60):  # r3 computes into r2's sources only with the bug
        rt.step()
    rt.transport.paused = False
    drain(rt)
    return rt, got, r2, r3


def test_evict_while_sending_in_the_engine_is_a_checksum_error_and_without_it_a_leak(model):
    """The entry `evict-while-sending` driven in the real engine: without the switch r3
    waits for the pages and every request is Ok; with it the checksum (the guard) fails
    r2's transfer (ErrTransfer) while r1 and r3 finish Ok; with NoChecksum too r2 decodes
    from r3's KV, another tenant's: the foreign bytes actually read."""
    rt, got, r2, r3 = _evicted_while_sending(model, frozenset())
    assert [got.ends[r].outcome for r in range(3)] == ["Ok"] * 3
    assert rt.store.violation_total == 0
    rt, got, r2, r3 = _evicted_while_sending(model, frozenset({"EvictWhileSending"}))
    assert [got.ends[r].outcome for r in (0, r2, r3)] == ["Ok", "ErrTransfer", "Ok"]
    rt, got, r2, r3 = _evicted_while_sending(model, frozenset({"EvictWhileSending",
                                                               "NoChecksum"}))
    assert [got.ends[r].outcome for r in (0, r2, r3)] == ["Ok", "Ok", "Ok"]
    read, theirs = rt.read_kv[r2], rt.prompt_kv[r3]
    own = rt.prompt_kv[0]  # r1's: the same prompt as r2's, computed alone
    assert not torch.allclose(read[:8], own[:8], atol=1e-4)  # not its own KV
    assert torch.allclose(read[:4], theirs[:4], atol=1e-5)  # r3's first page, tenant 2's
