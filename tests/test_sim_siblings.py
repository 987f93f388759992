"""n > 1 siblings in the simulator (issue 27; spec/README.md, "n > 1 siblings"): the n
completions of one prompt arrive together on one pair of workers; with the cache on, each
sibling's bootstrap is set aside at decode while core.sibling_waits on its first, so the
prompt is computed and transferred once per group. Judged from the run's own log (each
Reserve's and Admit's fresh pages, each LandWrite), not from the report under test."""

from __future__ import annotations

import json

import pytest

from api.cli import main
from sim.run import Simulation, replay_result, simulate
from sim.scenario import ScenarioError, load_scenario

SMALL = {"cluster": {"prefill_workers": 1, "decode_workers": 1, "page_tokens": 256,
                     "prefill_pool_tokens": 65536, "decode_pool_tokens": 131072,
                     "context_tokens": 32768}}


def _siblings(n: int, requests: int, **prefix):
    sc = load_scenario("system-prompt")
    return sc.with_options(requests=requests, prefix={**sc.prefix.model_dump(),
                                                      "siblings": n, **prefix})


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)][1:]  # past the header


def _by_request(records: list[dict], action: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for record in records:
        if record["a"] == action:
            out.setdefault(record["request"], []).append(record)
    return out


def test_a_groups_prompt_is_computed_and_transferred_once(tmp_path):
    """Seed 1, 40 requests in 10 groups of 4: every sibling but the first reserves and is
    admitted with no fresh page (a full hit on each side) and is sent no page; every answer
    is Ok, the leak oracle is clean, and the log replays to the
    same report, whose figures per group are the pinned ones (the groups' firsts hit the
    system prompt their tenant's earlier groups sealed)."""
    log = tmp_path / "run.ndjson"
    result, sim = simulate(_siblings(4, 40), log_path=str(log))
    assert result["violations"] == {} and result["summary"]["outcomes"] == {"Ok": 40}
    assert sim.folder.metrics.leaks == 0
    records = _records(log)
    reserves, admits = _by_request(records, "Reserve"), _by_request(records, "Admit")
    landed = _by_request(records, "LandWrite")
    arrivals = [r for r in records if r["a"] == "Arrive"]
    for group in range(10):
        first, *siblings = range(4 * group, 4 * group + 4)
        prompt = {(tuple(a["tokens"]), a["salt"], a["p"], a["d"]) for a in arrivals
                  if a["request"] in (first, *siblings)}
        assert len(prompt) == 1  # one prompt, one salt, one placement
        assert len(landed.get(first, [])) == len(reserves[first][0]["pages"])
        for r in siblings:
            assert reserves[r][0]["pages"] == [] and admits[r][0]["pages"] == []
            assert r not in landed
            # at the moment decode accepts the first's transfer
            assert reserves[r][0]["t"] == next(a["t"] for a in records
                                               if a["a"] == "Accept" and a["request"] == first)
    p = result["prefix"]
    assert (p["siblings"], p["groups"], p["full_hits"]) == (4, 10, 30)
    assert (p["pages_sent"], p["pages_computed"], p["prompt_pages"]) == (105, 89, 740)
    assert p["pages_sent_per_group"] == 10.5 and p["pages_computed_per_group"] == 8.9
    again, _ = replay_result(str(log))
    assert again["prefix"] == p and again["summary"] == result["summary"]


def test_a_siblings_run_validates_against_the_spec(capsys, tmp_path):
    """Two groups of 4 on one pair whose pages are 2,048 tokens and whose prefill pool is
    four pages (small enough to validate in seconds): decode hits every page of each
    sibling, the prefill evicts (PrefillEvict) on the way, and the log is a behaviour of
    KVTransfer.tla."""
    log = tmp_path / "run.ndjson"
    small = ["--set", "cluster.prefill_workers=1", "--set", "cluster.decode_workers=1",
             "--set", "cluster.page_tokens=2048", "--set", "cluster.prefill_pool_tokens=8192",
             "--set", "cluster.decode_pool_tokens=16384", "--set", "cluster.context_tokens=8192"]
    assert main(["sim", "parallel-sampling", "--requests", "8", *small, "--log", str(log),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "answers          Ok 8" in out and "6 full hits" in out
    assert "2 groups of 4 siblings: 3.0 pages sent and 6.0 computed per group" in out
    assert main(["validate", str(log)]) == 0
    assert "run OK" in capsys.readouterr().out


def test_the_comparison_shows_what_siblings_save(capsys):
    """Off, each of the four siblings computes and is sent its own copy of the prompt."""
    assert main(["sim", "parallel-sampling", "--compare-prefix-cache", "--requests", "40",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "sent per group               8.9          74.0   10 groups of 4 siblings" in out
    assert "computed per group           8.9          74.0" in out


def _drive(sc, act) -> tuple[Simulation, list[tuple[int, float, int]]]:
    """One group of the scenario's siblings arrives at 0; `act(sim)` then meddles; the run
    goes to rest. With it, each Reserve the core accepted: (request, time, fresh pages)."""
    reserves = []

    def watch(event, change):
        if type(event).__name__ == "Reserve":
            reserves.append((event.request, sim.env.now, len(event.pages)))
    sim = Simulation(sc, on_commit=watch)
    sim.new_request(siblings=sc.prefix.siblings)
    act(sim)
    sim.env.run(until=sim.env.any_of([sim.finished, sim.env.timeout(60)]))
    assert sim.finished.triggered and sim.cluster.violation_total == 0
    return sim, reserves


def test_a_sibling_whose_first_is_gone_goes_on_alone():
    """The first's client leaves while its prompt computes: nothing was sealed, so the
    sibling stops waiting at once and reserves every page fresh; it is answered Ok."""
    sc = _siblings(2, 2).with_options(**SMALL)
    sim, watch = _drive(sc, lambda sim: sim.later(0.05, sim.client._abort, 0))
    assert sim.folder.metrics.outcomes == {"Gone": 1, "Ok": 1}
    (first, t0, fresh0), (sibling, t1, fresh1) = watch
    assert (first, sibling) == (0, 1) and fresh1 == fresh0 == 19
    assert 0.05 <= t1 < 0.06  # at the abort (and its notice), not at the wait's bound


def test_a_sibling_waits_at_most_sibling_wait_max_s():
    """The sibling gives up waiting at its bound, 0.1 s, while its first's transfer still
    runs (decode accepts it at 0.27 s): nothing is sealed yet, so it reserves every page
    fresh, and both are answered Ok."""
    sc = _siblings(2, 2, sibling_wait_max_s=0.1).with_options(**SMALL)
    sim, watch = _drive(sc, lambda sim: None)
    assert sim.folder.metrics.outcomes == {"Ok": 2}
    (_, _, fresh0), (sibling, t1, fresh1) = watch
    assert sibling == 1 and 0.1 <= t1 < 0.11
    assert fresh1 == fresh0 == 19


def test_a_held_sibling_does_not_hold_up_its_first_behind_it():
    """The first's messages are held on the wire, so its bootstrap reaches decode after
    its sibling's: the sibling is set aside, the first reserves behind it, and the
    sibling's Reserve is still a full hit."""
    sc = _siblings(2, 2).with_options(**SMALL)
    sim, watch = _drive(sc, lambda sim: sim.hold(0, 0.2))
    assert sim.folder.metrics.outcomes == {"Ok": 2}
    assert [(r, fresh) for r, _, fresh in watch] == [(0, 19), (1, 0)]
    assert watch[0][1] >= 0.2


def test_one_sibling_replays_the_scenario_as_before():
    """siblings = 1 is the scenario as it was: test_prefix_sim pins its figures; here the
    default is 1 and the report says so."""
    result, _ = simulate(load_scenario("system-prompt").with_options(requests=20))
    assert result["prefix"]["siblings"] == 1 and result["prefix"]["groups"] == 20


@pytest.mark.parametrize("setting, message", [
    ("prefix.siblings=0", "prefix.siblings: Input should be greater than or equal to 1"),
    ("prefix.siblings=129", "prefix.siblings: Input should be less than or equal to 128"),
    ("prefix.sibling_wait_max_s=0", "prefix.sibling_wait_max_s: Input should be greater"),
])
def test_bad_sibling_options_are_scenario_errors(setting, message):
    key, value = setting.split("=")
    sc = load_scenario("system-prompt")
    with pytest.raises(ScenarioError, match=message):
        sc.with_options(prefix={**sc.prefix.model_dump(), key.split(".")[1]: value})


def test_siblings_need_prompts_with_tokens():
    with pytest.raises(ScenarioError, match="prefix.siblings needs prompts with tokens"):
        load_scenario("default").with_options(prefix={"siblings": 2})
