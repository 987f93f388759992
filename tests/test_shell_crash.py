"""A shell that crashes is a finding (sim/crash.py): exit 3, not a traceback with the
violation code; the seed, the reproduce command, the events up to the crash, the exception
and its innermost frame. The crashes are injected; the CLI is driven in-process."""

from __future__ import annotations

import json

import pytest

from api.cli import main
from api.clikit import EXIT_CRASH
from fuzz.replay import load
from sim.run import simulate
from sim.workers import SimPrefill
from sim.scenario import load_scenario
from spec import core
from spec.core import PST, RUNNING, SENT, SRC, TABLE, Change, _row


def _crash_landings_after(monkeypatch, events: int) -> None:
    """Make the simulator's write landing raise once `events` protocol events happened."""
    land = SimPrefill._land

    def broken(self, r, page, epoch, *lost):
        if self.sim.folder.events > events:
            raise ZeroDivisionError("injected")
        return land(self, r, page, epoch, *lost)

    monkeypatch.setattr(SimPrefill, "_land", broken)


def test_a_crashed_simulator_exits_3_with_seed_frame_and_a_log(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _crash_landings_after(monkeypatch, 200)
    code = main(["sim", "faults-all", "--requests", "50", "--quiet"])
    out = capsys.readouterr().out
    assert code == EXIT_CRASH == 3
    assert "SHELL CRASHED after 201 events" in out
    assert "ZeroDivisionError: injected (innermost frame tests/test_shell_crash.py:" in out
    assert "in broken" in out
    assert "reproduce with seed=7: kvproof sim faults-all --seed 7 --requests 50" in out
    # No --log was given: a second run of the seed wrote one, and crashed the same way.
    log = tmp_path / "kvproof-sim-faults-all-seed7-crash.ndjson"
    assert f"the events up to the crash: {log.name} (a second run of the seed crashed the " \
           "same way)" in out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[-1]["a"] == "RunEnd" and records[-1]["crashed"]["type"] == "ZeroDivisionError"
    events = [r for r in records[1:-1] if r["a"] != "FirstToken"]  # less the shell's facts
    assert len(events) == 201  # every event the core accepted up to the crash
    # The log replays through the core, and the replay reports the crash it records.
    assert main(["sim", "--replay", str(log)]) == EXIT_CRASH
    assert "SHELL CRASHED after 201 events" in capsys.readouterr().out


def test_a_crash_is_not_a_violation_and_the_run_is_not_swept(monkeypatch):
    _crash_landings_after(monkeypatch, 50)
    result, _ = simulate(load_scenario("one-pair").with_options(requests=20))
    # The first landing after event 50 is event 113 (106 when decode's timer was a
    # stopwatch from Reserve: more requests timed out while queued, sim/lease.py).
    assert result["crash"]["type"] == "ZeroDivisionError" and result["crash"]["events"] == 113
    assert result["violations"] == {} and result["drained"] is False


def test_help_names_the_crash_exit_status(capsys):
    for command in ("sim", "fuzz"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "3  the shell crashed" in capsys.readouterr().out


def test_a_crashed_sim_target_is_shrunk_saved_and_replayed(tmp_path, monkeypatch, capsys):
    _crash_landings_after(monkeypatch, 30)
    path = tmp_path / "crash.itf.json"
    code = main(["fuzz", "--target", "sim", "--seed", "1", "--examples", "20", "--quiet",
                 "--shrink-seconds", "1", "--out", str(path)])
    out = capsys.readouterr().out
    assert code == EXIT_CRASH
    assert "SHELL CRASHED: the sim target raised an exception" in out
    assert "ShellCrash: ZeroDivisionError: injected (innermost frame" in out
    assert "seed 1; reproduce: kvproof fuzz --target sim --seed 1" in out
    saved = load(path)
    assert saved.violation.startswith("ShellCrash: ZeroDivisionError") and saved.events
    assert main(["fuzz", "--replay", str(path)]) == EXIT_CRASH
    assert "Reproduced: ShellCrash" in capsys.readouterr().out
    monkeypatch.undo()  # the bug fixed: the saved sequence is a regression test that passes
    assert main(["fuzz", "--replay", str(path)]) == 0


def test_a_crash_inside_the_core_target_is_a_crash_too(tmp_path, monkeypatch, capsys):
    def release(m, s, r):
        raise KeyError("injected")

    monkeypatch.setitem(core.ACTIONS, core.Release, release)
    path = tmp_path / "core.itf.json"
    code = main(["fuzz", "--seed", "3", "--examples", "30", "--quiet", "--shrink-seconds", "0",
                 "--out", str(path)])
    out = capsys.readouterr().out
    assert code == EXIT_CRASH, out
    assert "ShellCrash: KeyError: 'injected' (innermost frame tests/test_shell_crash.py:" in out


def _send_every_page(m, s, r):
    """SendPage posting every remaining page at once: a transport that batches writes."""
    row = s.requests[r]
    if row[PST] != RUNNING or not row[TABLE]:
        return "not sending"
    sent, src = row[SENT], row[SRC]
    if sent >= len(src):
        return "every source page has been posted"
    posted = tuple((r, src[k], row[TABLE][k][0], row[TABLE][k][1])
                   for k in range(sent, len(src)))
    return Change(((r, _row(row, SENT, len(src))),), posted=posted)


def test_the_simulator_takes_any_number_of_writes_per_send_page(monkeypatch, tmp_path):
    monkeypatch.setitem(core.ACTIONS, core.SendPage, _send_every_page)
    log = tmp_path / "batched.ndjson"
    sc = load_scenario("default").with_options(requests=60)
    result, sim = simulate(sc, log_path=str(log))
    assert result["crash"] is None and result["violations"] == {}
    assert result["drained"] and result["unsettled_requests"] == 0
    actions = [json.loads(line).get("a") for line in log.read_text().splitlines()[1:]]
    assert actions.count("LandWrite") > 2 * actions.count("SendPage")  # several per post
    assert set(result["summary"]["outcomes"]) <= {"Ok", "ErrTooLong"}
    assert sim.nic_in_flight == [0] * sc.cluster.prefill_workers


def test_a_crashed_zoo_cell_is_never_a_catch_and_exits_3(monkeypatch, capsys):
    from fuzz.runner import Campaign
    from fuzz.zoo import format_cell, run_zoo, zoo_rows

    def release(m, s, r):
        raise KeyError("injected")

    monkeypatch.setitem(core.ACTIONS, core.Release, release)
    row = next(r for r in zoo_rows() if r.must_fail)
    cell, = run_zoo(["core"], Campaign(target="core", seed=3, examples=30, shrink_seconds=0),
                    rows=[row])
    assert cell.crashed and not cell.ok
    assert format_cell(cell).startswith("CRASHED after")
    code = main(["fuzz", "--zoo", "--target", "core", "--seed", "3", "--examples", "10",
                 "--quiet"])
    out = capsys.readouterr().out
    assert code == EXIT_CRASH, out
    assert "CRASHED" in out
