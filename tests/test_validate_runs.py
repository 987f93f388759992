"""A run's own log validated against KVTransfer.tla (spec/tlaplus/runcheck.py): faulty
simulator runs, with messages and writes lost for good, crashes and aborts, are behaviours
of the spec; a log with one forged step is refused at that step's line, with its action
named; a core that drifted from the spec is caught by the logs of its own runs (the spec's
text judges, the core only rebuilds the states); bad files are one line and exit 2."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from spec import codec, core
from spec.model import Model
from spec.tlaplus.conformance import spec_for
from spec.tlaplus.runcheck import Run, RunError, check_run
from sim.run import simulate
from sim.scenario import load_scenario
from sim.trace import log_run
from tests.cli_cases import run as cli


def sim_log(path: Path, name: str, seed: int) -> Path:
    print(f"kvproof sim {name} --seed {seed} --log {path}")
    simulate(load_scenario(name).model_copy(update={"seed": seed}), log_path=str(path))
    return path


def actions(path: Path) -> Counter:
    return Counter(json.loads(line)["a"] for line in path.read_text().splitlines()[1:])


@pytest.fixture(scope="module")
def one_pair(tmp_path_factory) -> Path:
    """one-pair at its seed 15: 28 events, a whole transfer, a timeout and its cancel."""
    return sim_log(tmp_path_factory.mktemp("runs") / "one-pair.ndjson", "one-pair", 15)


# (seed, protocol steps, the faults in its log and the protocol's recoveries from losses):
# every loss kind, both resends, decode's write timer, both crashes and an abort over the
# three. (Seeds 1 and 5 once ended at their horizon: a decode crash's notice lost for good,
# and a Done dropped on arrival; tests/test_losses.py runs forty seeds of each scenario.)
LOSSY = [
    (1, 48, {"LoseFinalWord": 3, "LoseWrite": 1, "LoseCancel": 2, "ResendCancel": 1,
             "RevokeRelease": 1, "DecodeCrash": 2}),
    (2, 48, {"LoseBootstrap": 3, "LoseCancel": 1, "LoseFinalWord": 2, "ResendBootstrap": 3,
             "ResendCancel": 2, "Abort": 1, "DecodeCrash": 1, "PrefillCrash": 1}),
    (5, 43, {"LoseCancel": 3, "LoseWrite": 1, "ResendCancel": 1, "Abort": 1, "DecodeCrash": 1}),
]
FAULTS = ("Lose", "Resend", "Revoke", "PrefillCrash", "DecodeCrash", "Abort")


@pytest.mark.parametrize("seed, steps, faults", LOSSY, ids=[f"seed{s}" for s, _, _ in LOSSY])
def test_a_lossy_faulty_simulator_run_is_a_behaviour_of_the_spec(tmp_path, seed, steps, faults):
    log = sim_log(tmp_path / "lossy.ndjson", "lossy-pair", seed)
    assert {a: n for a, n in actions(log).items() if a.startswith(FAULTS)} == faults
    verdict = check_run(log_run(str(log)))
    assert verdict.ok, verdict.message
    assert verdict.steps == steps


def test_the_cli_validates_a_simulator_log(capsys, one_pair):
    code, out, _ = cli(capsys, "validate", str(one_pair))
    assert code == 0, out
    assert "run OK: 28 steps, each a step of KVTransfer.tla" in out


def _edit(line: int, **fields):
    def edit(lines: list[str]) -> None:
        record = json.loads(lines[line - 1])
        record.update(fields)
        lines[line - 1] = json.dumps(record) + "\n"
    return edit


def _insert(line: int, record: dict):
    def edit(lines: list[str]) -> None:
        lines.insert(line - 1, json.dumps(record) + "\n")
    return edit


def _delete(line: int):
    def edit(lines: list[str]) -> None:
        del lines[line - 1]
    return edit


# One forged record of the one-pair log each: (what, the edit, the line and action the
# verdict names, what it says). Lines are the log's (line 1 is the header).
FORGERIES = [
    ("page table changed: r2 reserves r1's page", _edit(11, pages=[0]), 11, "Reserve",
     "not enabled there with these arguments (the core refuses it too: decode page 1 is not "
     "free)"),
    ("Finish reports bad tags over clean pages", _edit(13, tags_ok=False), 13, "Finish",
     "differs from what KVTransfer.tla's Finish leads to: client[r1] is \"ErrTag\", the "
     "spec's \"Ok\""),
    ("Accept reports bad checksums over clean pages", _edit(8, checksums_ok=False), 8,
     "Accept", "differs from what KVTransfer.tla's Accept leads to: client"),
    ("a landing vanishes", _delete(6), 6, "SendDone", "SendDone is not enabled"),
    ("a write lands in another page", _edit(17, page=0), 17, "LandWrite",
     "no write of r2 into decode page 1 is in flight"),
    ("an arrival's prompt grows: its reservation no longer fits it", _edit(16, prompt_pages=3), 19,
     "Reserve", "Reserve is not enabled"),
    ("a prefill eviction where the prefill caches nothing (a worker's event, no request)",
     _insert(4, {"t": 0.0, "a": "PrefillEvict", "page": 0}), 4, "PrefillEvict",
     "PrefillEvict is not enabled there with these arguments (the core refuses it too: this "
     "model has no prefill-side cache)"),
]


@pytest.mark.parametrize("what, edit, line, action, says", FORGERIES,
                         ids=[f[0] for f in FORGERIES])
def test_a_forged_step_is_refused_at_its_line_with_its_action(tmp_path, capsys, one_pair,
                                                              what, edit, line, action, says):
    lines = one_pair.read_text().splitlines(keepends=True)
    edit(lines)
    forged = tmp_path / "forged.ndjson"
    forged.write_text("".join(lines))
    verdict = check_run(log_run(str(forged)))
    assert not verdict.ok and (verdict.line, verdict.action) == (line, action), verdict.message
    assert f"line {line}: step" in verdict.message and says in verdict.message
    code, out, _ = cli(capsys, "validate", str(forged))
    assert code == 1 and f"line {line}: step" in out


def _hand_run(*events: core.Event, bugs=frozenset()) -> Run:
    m = Model(requests=1, max_prompt_pages=1, context_pages=1, prefill_pages=1,
              decode_pages=1, bugs=bugs, name="hand")
    return Run("hand-made", m, m, [(k, codec.encode(e)) for k, e in enumerate(events, 1)],
               unit="event")


def test_an_accept_before_the_landings_is_refused_even_where_done_may_come_early():
    """EarlyDone lets the prefill's Done overtake its writes; decode's own count (Counted)
    still holds Accept back until they have landed."""
    start = (core.Arrive(0, 1), core.Reserve(0, (0,)), core.Admit(0, (0,)), core.SendPage(0),
             core.SendDone(0))
    honest = check_run(_hand_run(*start, core.LandWrite(0, 0), core.Accept(0, True),
                                 bugs={"EarlyDone"}))
    assert honest.ok and honest.steps == 7, honest.message
    forged = check_run(_hand_run(*start, core.Accept(0, True), core.LandWrite(0, 0),
                                 bugs={"EarlyDone"}))
    assert not forged.ok and (forged.line, forged.action) == (6, "Accept"), forged.message
    assert "the core refuses it too" in forged.message


def _mutant(monkeypatch, action: type, bug: str) -> None:
    """The core's action replaced by its copy with one guard off (the bug switch's)."""
    original = core.ACTIONS[action]
    monkeypatch.setitem(core.ACTIONS, action,
                        lambda m, *args: original(m.with_bugs(m.bugs | {bug}), *args))


@pytest.mark.parametrize("action, bug, line, says", [
    (core.Reserve, "NoGenBump", 3, ("differs from what KVTransfer.tla's Reserve leads to: "
                                    "table[r1] is <<[page |-> 1, gen |-> 0]>>, the spec's "
                                    "<<[page |-> 1, gen |-> 1]>>",
                                    "gen[d1] is <<0, 0, 0, 0>>, the spec's <<1, 0, 0, 0>>")),
    (core.Release, "EagerRelease", 21,
     ("Release is not enabled there with these arguments (the core that rebuilt the state "
      "took it)",)),
])
def test_a_mutant_cores_own_runs_are_refused(tmp_path, monkeypatch, action, bug, line, says):
    """The simulator runs on a broken core, and the same broken core rebuilds the states of
    its log: the spec's text still refuses the first step the mutation changed."""
    _mutant(monkeypatch, action, bug)
    log = sim_log(tmp_path / "mutant.ndjson", "one-pair", 15)
    verdict = check_run(log_run(str(log)))
    assert not verdict.ok and (verdict.line, verdict.action) == (line, action.__name__), \
        verdict.message
    assert all(part in verdict.message for part in says), verdict.message


def test_every_action_of_next_is_bound_by_a_log_record():
    spec = spec_for(Model(losses=frozenset({"Write", "Bootstrap"})))
    instances = spec.compiler().instances()
    assert {i.label for i in instances} == set(spec.labels) == set(core.ACTION_NAMES)
    assert {i.label: i.names for i in instances}["LandWrite"] == ("w",)


# Two prefill and two decode workers (lossy-cluster, its router least-loaded): (seed,
# protocol steps, the faults in its log, the placements). Over the three: every loss kind and its recovery,
# every placement, each kind of crash at each worker, client aborts.
CLUSTER = [
    (2, 62, {"LoseBootstrap": 3, "LoseCancel": 2, "LoseWrite": 1, "ResendBootstrap": 2,
             "ResendCancel": 2, "RevokeRelease": 1, "Abort": 2, "PrefillCrash": 2},
     {(0, 0), (0, 1), (1, 0), (1, 1)}),
    (8, 40, {"LoseBootstrap": 6, "ResendBootstrap": 2, "Abort": 2, "DecodeCrash": 1,
             "PrefillCrash": 3}, {(0, 0), (0, 1), (1, 0), (1, 1)}),
    (15, 58, {"LoseFinalWord": 2, "LoseCancel": 1, "LoseWrite": 1, "ResendCancel": 1,
              "RevokeRelease": 1, "DecodeCrash": 2}, {(0, 0), (0, 1), (1, 0)}),
]


def _crashed(log: Path) -> set[tuple[str, int]]:
    records = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    return {(x["a"], x.get("p", x.get("d"))) for x in records if x["a"].endswith("Crash")}


@pytest.mark.parametrize("seed, steps, faults, placements", CLUSTER,
                         ids=[f"seed{s}" for s, *_ in CLUSTER])
def test_a_two_by_two_faulty_simulator_run_is_a_behaviour_of_the_spec(tmp_path, seed, steps,
                                                                     faults, placements):
    log = sim_log(tmp_path / "cluster.ndjson", "lossy-cluster", seed)
    assert {a: n for a, n in actions(log).items() if a.startswith(FAULTS)} == faults
    records = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert {(x["p"], x["d"]) for x in records if x["a"] == "Arrive"} == placements
    verdict = check_run(log_run(str(log)))
    assert verdict.ok, verdict.message
    assert verdict.steps == steps


def test_a_crash_moved_to_the_other_worker_is_refused(tmp_path):
    """lossy-cluster at seed 15: decode worker d2 crashes with requests of its own; the same
    crash logged at d1 is another step, not the one the log's later events follow."""
    log = sim_log(tmp_path / "cluster.ndjson", "lossy-cluster", 15)
    assert ("DecodeCrash", 1) in _crashed(log)
    lines = log.read_text().splitlines(keepends=True)
    line = next(k for k, text in enumerate(lines, start=1)
                if '"DecodeCrash"' in text and '"d":1' in text)
    lines[line - 1] = lines[line - 1].replace('"d":1', '"d":0')
    forged = tmp_path / "forged.ndjson"
    forged.write_text("".join(lines))
    verdict = check_run(log_run(str(forged)))
    assert not verdict.ok, verdict.message
    assert verdict.line >= line and f"line {verdict.line}: step" in verdict.message


@pytest.mark.parametrize("edit, says", [
    (lambda lines: lines[:-1], "the log has no end record"),
    (lambda lines: lines[:5] + [lines[5][:15]] + lines[6:], "line 6: malformed record"),
    (lambda lines: lines[:3] + ['{"t": 0.03, "a": "Teleport", "request": 0}\n'] + lines[3:],
     "line 4: unknown action 'Teleport'"),
    (lambda lines: lines[:3] + ['{"t": 0.03, "a": "SendPage", "request": -4}\n'] + lines[3:],
     "line 4: request -4 is outside the run's 0..2"),
    (lambda lines: [lines[0], lines[1].replace('"d":0', '"d":5')] + lines[2:],
     "line 2: d=5 names no worker of the run's 1"),
    (lambda lines: ['{"format": "kvproof-sim-log/1"}\n'] + lines[1:],
     "not a kvproof simulator log (format 'kvproof-sim-log/1')"),
])
def test_a_bad_log_is_one_line_and_exit_2(tmp_path, capsys, one_pair, edit, says):
    bad = tmp_path / "bad.ndjson"
    bad.write_text("".join(edit(one_pair.read_text().splitlines(keepends=True))))
    code, out, err = cli(capsys, "validate", str(bad))
    assert code == 2, out + err
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert "Traceback" not in err


def test_a_saved_core_fuzz_failure_validates_as_a_legal_run_that_breaks_an_invariant(
        tmp_path, capsys):
    """`kvproof fuzz --target core --bug EagerRelease --seed 1` finds this one (pools of 20
    and 38 pages, far past enumerating Next's choices of pages): every step is the spec's,
    and the spec's own NoWriteIntoForeign is broken after the last."""
    from fuzz.replay import SavedFailure, write

    m = Model(requests=11, max_prompt_pages=40, context_pages=38, prefill_pages=20,
              decode_pages=38, crashes=True, decode_crashes=True, bugs={"EagerRelease"},
              name="fuzz")
    events = [core.Arrive(2, 14), core.Reserve(2, tuple(range(24, 38))),
              core.Admit(2, tuple(range(6, 20))), core.Timeout(2), core.Release(2),
              core.SendPage(2)]
    path = tmp_path / "kvproof-fuzz-core-seed1.itf.json"
    write(path, SavedFailure("core", m, None, events, "NoWriteIntoForeign: violated", 6, 1),
          {})
    code, out, _ = cli(capsys, "validate", str(path))
    assert code == 1, out
    assert ("event 6: step 6 (SendPage(r3)) is a legal step, but after it NoWriteIntoForeign "
            "is violated") in out
    # Without the bug, the spec refuses the early Release at its event.
    guarded = json.loads(path.read_text())
    guarded["#meta"]["model"]["Bugs"] = []
    path.write_text(json.dumps(guarded))
    code, out, _ = cli(capsys, "validate", str(path))
    assert code == 1 and "event 5: step 5 (Release(r3)) is not a step of the spec" in out, out


def test_the_incremental_keys_equal_the_conformance_keys_on_every_state(tmp_path):
    """runcheck converts only the rows a step changed; the conformance cache converts whole
    columns. Both must give the spec the same state, step after step."""
    from spec.store import Store
    from spec.tlaplus.conformance import _Keys
    from spec.tlaplus.runcheck import _RunKeys, _take, placed, spec_state

    run = log_run(str(sim_log(tmp_path / "cluster.ndjson", "lossy-cluster", 15)))
    whole, incremental = _Keys(run.model), _RunKeys(run.model)
    store = Store(run.shell_model, 2, 2)
    seen = 0
    for line, record in run.records:
        assert not _take(run, store, placed(run, line, record, codec.decode(record)))
        state = spec_state(store, run.model.requests)
        assert incremental(state) == whole(state), line
        seen += 1
    assert seen == 58


def test_a_prefill_eviction_without_a_prefill_cache_is_a_clear_error_in_every_fold(
        tmp_path, capsys, one_pair):
    """A PrefillEvict record (a worker's event, no request) in a simulator log and in an
    engine log whose model has no prefill-side cache: the simulator's replay and the
    engine's replay and trace name its line (before: AttributeError, each fold reading its
    request)."""
    from engine.eventlog import LogError, core_trace, replay

    lines = one_pair.read_text().splitlines(keepends=True)
    t = json.loads(lines[3])["t"]
    lines.insert(4, json.dumps({"t": t, "a": "PrefillEvict", "page": 0}) + "\n")
    forged = tmp_path / "forged.ndjson"
    forged.write_text("".join(lines))
    code, _, err = cli(capsys, "sim", "--replay", str(forged))
    assert code == 2 and "line 5" in err and "this model has no prefill-side cache" in err
    header = dict(context_pages=2, prefill_pages=2, decode_pages=2, bugs=[],
                  max_prompt_pages=2)
    records = [codec.encode(core.Arrive(0, 1)), codec.encode(core.PrefillEvict(0, 0))]
    for fold in (replay, core_trace):
        with pytest.raises(LogError, match="line 3: the core refuses PrefillEvict"):
            fold(header, records)
