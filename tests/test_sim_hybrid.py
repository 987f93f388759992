"""Hybrid runs (sim/hybrid.py, fuzz/hybrid.py): real workers in a simulated cluster.

incident-2026 with its two faults shows a real foreign KV read caught by the read-level
oracle; with the page tags on, the engine's tag guard stops every such read; with every
guard on nothing foreign is read. Each run gives exactly the fully simulated run's verdicts
and event log (modelled timing). The runs are bounded: one decode worker (so the pool is
warm after a few dozen requests: the first over-pool prompts that read stale pages are
requests 40 and 43) and outputs of at most 32 tokens."""

from __future__ import annotations

import pytest

from api.cli import main
from sim.run import Simulation, simulate
from sim.scenario import ScenarioError, load_scenario, scenario_from_dict

from fuzz import hybrid as hybrid_module
from fuzz.hybrid import AGREEMENT, EngineDataPath, HybridTarget, all_real, simulate_hybrid
from fuzz.oracles import Checks, check
from fuzz.replay import decode_event
from spec.model import Model

INCIDENT_FAULTS = ("FinishedNotRejected", "NoCountCheck")
REQUESTS = 45


def _incident(bugs: tuple[str, ...], requests: int = REQUESTS, **hybrid):
    data = load_scenario("incident-2026").model_dump(mode="json")
    data.update(bugs=list(bugs), requests=requests)
    data["cluster"]["decode_workers"] = 1
    data["workload"]["output"]["max_tokens"] = 32
    return all_real(scenario_from_dict(data), **hybrid)


def _both(scenario, tmp_path):
    """(hybrid result, simulated result), each run with a log; the logs' events equal."""
    real, _ = simulate_hybrid(scenario, log_path=str(tmp_path / "hybrid.ndjson"))
    simulated, _ = simulate(scenario.with_options(hybrid={}),
                            log_path=str(tmp_path / "sim.ndjson"))
    events = [(tmp_path / name).read_text().splitlines()[1:]
              for name in ("hybrid.ndjson", "sim.ndjson")]
    assert events[0] == events[1], "the hybrid run's events differ from the simulated run's"
    return real, simulated


def _real(result: dict) -> dict:
    counts = dict(result.pop("hybrid"))
    counts.pop("examples")
    return {k: counts[k] for k in ("reads", "reads_judged", "reads_foreign",
                                   "requests_read_foreign", "leaks_real", "leaks_abstract",
                                   "stopped_by_tag_guard", "disagreements")}


def test_the_incident_in_hybrid_mode_shows_a_real_foreign_read_caught_by_the_leak_oracle(
        tmp_path):
    real, simulated = _both(_incident(("PoolBelowContext", "NoGenBump") + INCIDENT_FAULTS),
                            tmp_path)
    examples = real["hybrid"]["examples"]
    assert _real(real) == dict(reads=135, reads_judged=135, reads_foreign=6,
                               requests_read_foreign=2, leaks_real=2, leaks_abstract=2,
                               stopped_by_tag_guard=0, disagreements=0)
    assert real == simulated  # the same verdicts, every figure
    assert simulated["summary"]["leaked_responses"] == 2
    assert simulated["violations"] == {"Isolation": 2, "OkIsClean": 2, "RejectedIsError": 2}
    assert examples[0].startswith("LEAK (answered Ok): real decode step 1 of request 40: the "
                                  "K/V decode read at positions 4, 5, 6")


def test_with_the_tags_on_the_engine_guard_stops_every_foreign_read(tmp_path):
    real, simulated = _both(_incident(("PoolBelowContext",) + INCIDENT_FAULTS), tmp_path)
    assert _real(real) == dict(reads=131, reads_judged=131, reads_foreign=2,
                               requests_read_foreign=2, leaks_real=0, leaks_abstract=0,
                               stopped_by_tag_guard=2, disagreements=0)
    assert real == simulated
    assert simulated["summary"]["outcomes"] == {"ErrTag": 2, "Ok": 43}


def test_with_the_guards_on_nothing_foreign_is_read(tmp_path):
    real, simulated = _both(_incident(INCIDENT_FAULTS), tmp_path)
    assert _real(real) == dict(reads=129, reads_judged=129, reads_foreign=0,
                               requests_read_foreign=0, leaks_real=0, leaks_abstract=0,
                               stopped_by_tag_guard=0, disagreements=0)
    assert real == simulated
    assert simulated["summary"]["outcomes"] == {"ErrTooLong": 2, "Ok": 43}
    assert simulated["violations"] == {}


def test_a_data_path_that_loses_the_bytes_is_caught_where_the_page_contents_see_nothing(
        monkeypatch):
    """The mutant: the landing sets the tag but copies no byte. The abstract oracle is blind
    to it; the real one sees every Ok answer read bytes that are not its own."""
    def tag_only(self, write):
        r, _, page, tag = write
        worker = self.decodes.get(self.sim.cluster.placement[r][1])
        if worker is not None:
            worker.landed(r, page, self.sums.pop((r, page), None), tag)
    monkeypatch.setattr(EngineDataPath, "_landed", tag_only)
    monkeypatch.setattr(EngineDataPath, "verdict",
                        lambda self, d, r, info, abstract: abstract)  # no checksum either
    result, _ = simulate_hybrid(_incident(INCIDENT_FAULTS, requests=6))
    assert result["summary"]["leaked_responses"] == 0
    assert result["hybrid"]["disagreements"] == 6
    assert result["violations"] == {AGREEMENT: 6}


def test_mixed_pairs_under_every_fault_replay_the_simulated_run(tmp_path):
    """faults-all with prefill 0 and decode 1 real: real-real, real-simulated and
    simulated-real pairs, crashes, losses and aborts; the same events as simulated."""
    data = load_scenario("faults-all").model_dump(mode="json")
    data["requests"] = 40
    data["hybrid"].update(real_prefill=[0], real_decode=[1])
    real, simulated = _both(scenario_from_dict(data), tmp_path)
    assert _real(real) == dict(reads=48, reads_judged=30, reads_foreign=0,
                               requests_read_foreign=0, leaks_real=0, leaks_abstract=0,
                               stopped_by_tag_guard=0, disagreements=0)
    assert real == simulated


def test_measured_timing_runs_on_the_engine_clock():
    result, _ = simulate_hybrid(_incident(INCIDENT_FAULTS, requests=8, timing="measured"))
    assert result["drained"] and result["violations"] == {}
    h = result["hybrid"]
    assert h["timing"] == "measured" and h["prompts_computed"] == 8
    assert h["leaks_real"] == h["disagreements"] == 0


def test_kvproof_sim_hybrid_reports_the_real_verdicts_and_how_to_reproduce(capsys):
    code = main(["sim", "incident-2026", "--bug", "FinishedNotRejected", "--bug",
                 "NoCountCheck", "--requests", str(REQUESTS), "--hybrid", "--quiet",
                 "--set", "cluster.decode_workers=1", "--set",
                 "workload.output.max_tokens=32"])
    out = capsys.readouterr().out
    assert code == 1
    assert ("hybrid: real prefill [0, 1, 2, 3], real decode [0], tiny model, 4-token pages"
            in out)
    assert ("real verdicts    leaked (Ok on foreign KV bytes) 2, by the page contents 2; "
            "stopped by the tag guard 0; disagreements 0") in out
    assert "--hybrid --log trace.ndjson" in out


def test_bad_hybrid_settings_are_clear_errors():
    data = load_scenario("one-pair").model_dump(mode="json")
    data["hybrid"]["real_decode"] = [1]
    with pytest.raises(ScenarioError, match=r"hybrid.real_decode: worker indices must be "
                                            r"distinct and in 0..0 \(got \[1\]\)"):
        scenario_from_dict(data)
    data["hybrid"]["real_decode"] = [0]
    with pytest.raises(ScenarioError, match="marks workers as real"):
        Simulation(scenario_from_dict(data))
    data["hybrid"]["page_tokens"] = 64
    data["workload"]["prompt"]["max_tokens"] = 1 << 20
    with pytest.raises(ScenarioError, match="past the tiny model's 4096 positions"):
        EngineDataPath(scenario_from_dict(data))


# The incident as the simulator target found it (seed 1, after 379 examples; shrunk): the
# hybrid target replays it on a real data path, where the read-level oracle sees the real
# foreign read one step after the abstract one sees the decode start.
INCIDENT_MODEL = Model(requests=12, max_prompt_pages=35, context_pages=33, prefill_pages=32,
                       decode_pages=46, bugs=frozenset({"PoolBelowContext", "NoGenBump"}
                                                       | set(INCIDENT_FAULTS)),
                       crashes=True, decode_crashes=True, name="fuzz")
INCIDENT_SEED = 25546148
INCIDENT_MOVES = ([{"a": "Arrive", "request": 0, "prompt_pages": 18}, {"a": "Wait"}]
                  + [{"a": "Arrive", "request": r, "prompt_pages": p}
                     for r, p in ((1, 7), (2, 9), (3, 1))]
                  + [{"a": "Abort", "request": 1, "at_permille": 990}, {"a": "Wait"},
                     {"a": "Wait"}, {"a": "Arrive", "request": 4, "prompt_pages": 17}]
                  + [{"a": "Wait"}] * 6)


def test_the_hybrid_fuzz_target_sees_the_incident_on_real_bytes():
    target = HybridTarget()
    target.reset(INCIDENT_MODEL, seed=INCIDENT_SEED)
    checks = Checks.for_properties(("OkIsClean", "Isolation"))
    real = []
    for move in map(decode_event, INCIDENT_MOVES):
        target.step(move)
        real = [v for v in check(checks, INCIDENT_MODEL, target)
                if v.detail.startswith("engine read oracle")]
        if real:
            break
    assert len(target.trace()) == 15
    assert real[0].property == "LeakOracle"
    assert real[0].detail.startswith("engine read oracle: request 4 computed token 2 from a "
                                     "read that passed the tag check: real decode step 1")
    assert target.describe().startswith("hybrid (every worker real, tiny model): simulator:")


def test_kvproof_fuzz_target_hybrid_prints_its_seed_and_finds_nothing_on_clean_code(capsys):
    code = main(["fuzz", "--target", "hybrid", "--seed", "3", "--examples", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "target hybrid, seed 3" in out


def test_hybrid_module_keeps_the_engine_out_of_import():
    """`kvproof fuzz` loads every target module: the hybrid one imports no torch at
    import time (it does when a data path is built)."""
    assert "torch" not in vars(hybrid_module)
