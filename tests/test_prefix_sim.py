"""Prefix caching in the simulator and the fuzzer (issue 27): shared-prefix workloads, the
cache on against off in one run, LRU evictions that replay from the log, the content
oracle on reads across tenants, and the fuzzer's prefix moves."""

from __future__ import annotations

import pytest

from api.cli import main
from fuzz.oracles import leak_oracle
from fuzz.target import Observation
from sim.fold import replay
from sim.report import compare_prefix_cache
from sim.run import simulate
from sim.scenario import load_scenario
from spec.model import Model


def _with_cache(name: str, cache: bool, prefill_cache: bool | None = None, **options):
    """The scenario with its prefix cache on or off: decode's, and the prefill's as the
    scenario has it unless `prefill_cache` says otherwise (never without decode's)."""
    sc = load_scenario(name).with_options(**options)
    prefill = sc.prefix.prefill_cache if prefill_cache is None else prefill_cache
    return sc.with_options(prefix={**sc.prefix.model_dump(), "cache": cache,
                                   "prefill_cache": cache and prefill})


def test_a_shared_system_prompt_hits_and_the_prefill_cache_saves_compute_too():
    """The same 120 requests (seed, arrivals and prompts) with no cache, decode's alone and
    both sides': most prompt pages hit at decode and are not sent; with decode's cache
    alone every page is still computed (core.pages_to_compute), with the prefill's too the
    pages it holds are not, and the time to first token falls with them; no violation."""
    runs = {name: simulate(_with_cache("system-prompt", cache, prefill, requests=120))
            for name, cache, prefill in (("off", False, False), ("decode", True, False),
                                         ("both", True, True))}
    off, sim_off = runs["off"]
    for result, sim in runs.values():
        assert sim.folder.metrics.arrival_s == sim_off.folder.metrics.arrival_s
        assert ([row["prompt_pages"] for row in sim.folder.metrics.request_rows.values()]
                == [row["prompt_pages"] for row in sim_off.folder.metrics.request_rows.values()])
        assert result["violations"] == {} and result["summary"]["outcomes"] == {"Ok": 120}
    decode, both = (compare_prefix_cache(runs[name][0], off) for name in ("decode", "both"))
    for c in (decode, both):
        assert c["prompt_pages"] == 2287 and c["hit_pages"] == 1840  # 80.5%
        assert c["pages_sent"] == {"on": 447, "off": 2287}
        assert c["transfer_pages_saved"] == 1840
    assert decode["pages_computed"] == {"on": 2287, "off": 2287}
    assert decode["compute_pages_saved"] == 0 and not decode["prefill_cache"]
    assert both["pages_computed"] == {"on": 447, "off": 2287}
    assert both["compute_pages_saved"] == 1840 and both["prefill_hit_rate"] == 1840 / 2287
    p50 = {name: c["ttft_s"]["on"]["p50"] for name, c in (("decode", decode), ("both", both))}
    assert p50["both"] < p50["decode"] < decode["ttft_s"]["off"]["p50"]


def test_the_comparison_command_says_where_the_gain_comes_from(capsys, tmp_path):
    assert main(["sim", "system-prompt", "--compare-prefix-cache", "--requests", "60",
                 "--quiet", "--plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "prefix cache on vs off: scenario system-prompt (system-prompt), seed 1" in out
    assert "pages sent                   250         1,130   saved 880 (77.9%)" in out
    assert "pages computed               250         1,130   saved 880 (77.9%)" in out
    assert ("prefill hit rate  77.9% (880 prompt pages held cached at the prefill, 0 pages "
            "evicted there)") in out
    assert ("the TTFT gain comes from: 880 transfer pages not sent; 880 prompt pages not "
            "computed") in out
    assert (tmp_path / "prefix_cache.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["default", "--compare-prefix-cache"], "share nothing (prefix.shape is none)"),
    (["system-prompt", "--compare-prefix-cache", "--csv", "x.csv"], "takes no --csv"),
    (["system-prompt", "--set", "prefix.shape=none"], "prefix.cache needs prompts with tokens"),
    (["system-prompt", "--set", "prefix.cache=false"], "prefix.prefill_cache needs prefix.cache"),
])
def test_bad_prefix_options_are_usage_errors(capsys, args, message):
    assert main(["sim", *args]) == 2
    assert message in capsys.readouterr().err


def test_lru_evictions_are_logged_and_replay_to_the_same_run(tmp_path):
    """Multi-turn sessions outgrow the pools: decode and the prefill evict idle cached pages
    (Evict and PrefillEvict events the core decides), and the log replays to the same
    figures."""
    log = tmp_path / "run.ndjson"
    result, sim = simulate(_with_cache("multi-turn", True, requests=300), log_path=str(log))
    m = sim.folder.metrics
    assert result["violations"] == {} and m.evicted_pages > 0 and m.hit_pages > 0
    assert m.prefill_evicted_pages > 0 and m.computed_pages < m.admitted_prompt_pages
    text = log.read_text()
    assert '"a":"Evict"' in text and '"a":"PrefillEvict"' in text
    folder, end = replay(log)
    again = folder.metrics
    assert end["drained"]
    assert ((again.evicted_pages, again.prefill_evicted_pages, again.hit_pages,
             again.computed_pages, again.pages_written, again.ttft_s)
            == (m.evicted_pages, m.prefill_evicted_pages, m.hit_pages, m.computed_pages,
                m.pages_written, m.ttft_s))


def test_the_content_oracle_catches_reads_across_tenants_without_the_salt():
    """NoSalt with tags that name no identity (NoIdentTag): the second tenant hits the first
    tenant's system prompt pages (at decode, and at the prefill, whose keys leave the salt
    out too), and the store's leak oracle (content identity against core.true_ident, not
    the core's flag) counts each such answer as a leaked response. With the identity in
    the tags (NoSalt alone), the same reads fail their tag check: ErrTag, no leak (the
    switch still fails the second tenant's requests, which fit: FittingRequestsSucceed)."""
    sc = load_scenario("system-prompt").with_options(
        requests=60, bugs=("NoSalt", "NoIdentTag"), oracles={"on_violation": "count"})
    result, _ = simulate(sc)
    assert result["summary"]["leaked_responses_returned_ok"] == 29
    assert result["violations"] == {"Isolation": 29, "OkIsClean": 29}
    guarded, _ = simulate(sc.with_options(bugs=("NoSalt",)))
    assert guarded["summary"]["leaked_responses_returned_ok"] == 0
    assert guarded["summary"]["outcomes"] == {"ErrTag": 29, "Ok": 31}
    assert guarded["violations"] == {"FittingRequestsSucceed": 1}


def test_the_fuzz_leak_oracle_judges_content_with_a_prefix_cache():
    m = Model(requests=2, max_prompt_pages=2, context_pages=2, prefill_pages=2,
              decode_pages=2, prefix_cache=True, tokens=2, tenants=2)
    own = {0: ((1, (1,)), (1, (1, 2))), 1: ((2, (1,)),)}
    clean = Observation(pools=(), writes=(), outcomes=("Ok", "Ok"), expected=own,
                        reads={0: own[0], 1: own[1]})
    assert leak_oracle(m, clean) == []
    # r2 (salt 2) reads the page salt 1 wrote for the same token: another tenant's KV.
    foreign = Observation(pools=(), writes=(), outcomes=("Ok", "Ok"), expected=own,
                          reads={0: own[0], 1: ((1, (1,)),)})
    assert leak_oracle(m, foreign) == [
        "r2 got Ok, but decode read 1 pages of which 1 hold other KV (page 1 holds salt 1, "
        "tokens 1, not salt 2, tokens 1)"]


def test_fuzz_with_a_prefix_cache_prints_its_seed_and_replays(capsys, tmp_path):
    path = tmp_path / "nosalt.itf.json"
    assert main(["fuzz", "--prefix-cache", "--bug", "NoSalt", "--seed", "0", "--examples",
                 "200", "--itf", str(path), "--quiet", "--shrink-seconds", "1"]) == 1
    out = capsys.readouterr().out
    assert "profile default; prefix cache; bugs: NoSalt" in out
    assert ("reproduce: kvproof fuzz --target core --seed 0 --examples 200 --profile default "
            "--prefix-cache --bug NoSalt") in out
    assert main(["fuzz", "--replay", str(path)]) == 1
    assert "Reproduced: SaltsApart" in capsys.readouterr().out
    assert main(["fuzz", "--zoo", "--prefix-cache"]) == 2
    assert "drop --bug, --property, --prefix-cache and --itf" in capsys.readouterr().err


def test_fuzz_with_the_prefill_cache_too_catches_evict_while_sending_and_replays(capsys,
                                                                                 tmp_path):
    """--prefix-cache both: the core target's models cache at the prefill too (Admit hits,
    PrefillEvict); EvictWhileSending is caught, its reproduce line names the cache, and the
    saved failure replays."""
    path = tmp_path / "evict.itf.json"
    assert main(["fuzz", "--prefix-cache", "both", "--bug", "EvictWhileSending", "--seed",
                 "0", "--examples", "300", "--itf", str(path), "--quiet",
                 "--shrink-seconds", "1"]) == 1
    out = capsys.readouterr().out
    assert "prefix cache at decode and prefill; bugs: EvictWhileSending" in out
    assert ("reproduce: kvproof fuzz --target core --seed 0 --examples 300 --profile default "
            "--prefix-cache both --bug EvictWhileSending") in out
    assert "PrefillEvict" in out and "SealedIsQuiet" in out
    assert main(["fuzz", "--replay", str(path)]) == 1
    assert "Reproduced: SealedIsQuiet" in capsys.readouterr().out


def test_a_prefix_runs_log_and_its_itf_trace_validate_with_hashed_tokens(capsys, tmp_path):
    """The simulator's tokens are hashes (Tokens is 2^62): `kvproof validate` checks its
    log against the spec's text (1..Tokens tested, never built) and its ITF trace through
    the core (each Arrive's prompt read off the recorded state, never enumerated), and a
    trace whose Arrive claims another prompt than its state is refused. The prefill's
    pool is four pages, so its cache hits and evicts (PrefillEvict) on the way."""
    import json
    log, itf = tmp_path / "run.ndjson", tmp_path / "run.itf.json"
    small = ["--set", "cluster.prefill_workers=1", "--set", "cluster.decode_workers=1",
             "--set", "cluster.page_tokens=2048", "--set", "cluster.prefill_pool_tokens=8192",
             "--set", "cluster.decode_pool_tokens=16384", "--set", "cluster.context_tokens=8192"]
    assert main(["sim", "system-prompt", "--requests", "8", *small, "--log", str(log),
                 "--itf", str(itf), "--quiet"]) == 0
    assert "at the prefill: hit rate 16.0% (4 of 25 prompt pages not computed); 17 pages " \
        "evicted" in capsys.readouterr().out
    assert log.read_text().count('"a":"PrefillEvict"') == 17
    assert main(["validate", str(log)]) == 0
    assert "run OK" in capsys.readouterr().out
    assert main(["validate", str(itf)]) == 0
    out = capsys.readouterr().out
    assert "trace OK" in out and "4611686018427387904 token kinds" in out
    trace = json.loads(itf.read_text())
    arrived = next(s for s in trace["states"][1:] if s["#meta"]["action"] == "Arrive")
    assert " 1048576 " in arrived["#meta"]["label"] or "1048576," in arrived["#meta"]["label"]
    pairs = arrived["tokens"]["#map"]
    name, tokens = next((k, v) for k, v in pairs if v)
    arrived["tokens"]["#map"] = [[k, [*v[:-1], v[-1] + 1] if k == name else v]
                                 for k, v in pairs]
    forged = tmp_path / "forged.itf.json"
    forged.write_text(json.dumps(trace))
    assert main(["validate", str(forged)]) != 0
    assert "illegal" in capsys.readouterr().out
