"""The kvproof command line, as a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from api.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_default_model_holds_every_property_and_pins_exact_counts(capsys):
    """The README's main job: `kvproof check` checks the default model (no symmetry), then
    the models with crashes, with one exit status."""
    code, out, err = run_cli(capsys)
    assert code == 0, out + err
    assert "checking default, crash, decode-crash, timely in turn" in out
    assert out.count("No error has been found") == 4
    # TLC reports the same three figures for default.cfg (2,385,281 generated counts TLC's
    # duplicates: spec/check/tlccount.py).
    default, crash, decode_crash, timely = out.split("=== ")[1:]
    assert "2109163 states generated, 772008 distinct states found, 0 states left on queue" \
        in default
    assert "depth of the complete state graph search is 27" in default
    assert "1267726 distinct states found" in crash
    assert "322726 distinct states found" in decode_crash
    assert "290130 distinct states found" in timely
    assert "liveness (EveryRequestEnds, PagesComeBack)" in out
    assert out.count("Witness: a client is answered Ok after 8 steps") == 4
    assert out.rstrip().endswith(
        "kvproof check: default holds, crash holds, decode-crash holds, timely holds.")
    assert "Progress:" in err


def test_without_model_a_bug_fails_the_headline_check_with_one_status(capsys, tmp_path):
    """--bug applies to each model in turn; the first counterexample is the one written."""
    cex = tmp_path / "cex.itf.json"
    code, out, _ = run_cli(capsys, "--bug", "SourceReuse", "--itf", str(cex), "--quiet")
    assert code == 1
    assert out.count("Error: SourceHeld is violated (invariant); counterexample of 4 steps.") == 4
    assert out.rstrip().endswith("default FAILS, crash FAILS, decode-crash FAILS, timely FAILS.")
    assert json.loads(cex.read_text())["#meta"]["description"].startswith(
        "counterexample to SourceHeld on model default:")


def test_a_model_where_no_client_is_ever_answered_ok_fails(capsys, monkeypatch):
    """Reachability: a mutant whose Finish always reports a tag mismatch never answers Ok.
    Checking only TypeOK, nothing else notices; the witness check does, and names the
    model."""
    from spec import core

    def finish_never_ok(m, s, r, tags_ok):
        return core.finish(m, s, r, False)

    monkeypatch.setattr(core, "_SIMPLE_ACTIONS", tuple(
        (cls, finish_never_ok if cls is core.Finish else fn) for cls, fn in core._SIMPLE_ACTIONS))
    monkeypatch.setattr(core, "_CACHES", {})
    code, out, _ = run_cli(capsys, "--model", "solo", "--property", "TypeOK")
    assert code == 1
    assert "Error: no behaviour of model solo ends with a client answered Ok" in out
    assert out.rstrip().endswith("Error: Ok is unreachable in model solo.")
    monkeypatch.undo()
    code, out, _ = run_cli(capsys, "--model", "solo", "--property", "TypeOK")
    assert code == 0 and "Witness: a client is answered Ok after 8 steps" in out


@pytest.mark.slow
def test_incident_prints_the_leak_trace_and_writes_itf(capsys, tmp_path):
    trace = tmp_path / "incident.itf.json"
    code, out, _ = run_cli(capsys, "--model", "incident", "--trace-out", str(trace))
    assert code == 1
    assert "Invariant OkIsClean is violated." in out
    assert "has 18 steps" in out
    assert 'client[r2]: "Waiting" -> "Ok"' in out or 'client[r1]: "Waiting" -> "Ok"' in out
    assert re.search(r"leaked: \{\} -> \{r[12]\}", out)
    assert out.rstrip().endswith("counterexample of 18 steps.")
    itf = json.loads(trace.read_text())
    assert len(itf["states"]) == 19
    assert itf["states"][0]["#meta"]["action"] == "Init"
    assert itf["states"][-1]["#meta"]["action"] == "Finish"
    assert itf["vars"][0] == "client" and "writes" in itf["vars"]
    assert itf["states"][-1]["leaked"]["#set"] in (["r1"], ["r2"])


def test_bug_flags_add_switches_to_a_model(capsys):
    code, out, _ = run_cli(capsys, "--model", "solo", "--bug", "NoAbortNotice",
                           "--bug", "NoTimeout")
    assert code == 1
    assert "Error: NoLeakAtRest is violated (deadlock); counterexample of 3 steps." in out


def test_list_bugs_names_every_switch(capsys):
    code, out, _ = run_cli(capsys, "--list-bugs")
    assert code == 0
    assert len(out.strip().splitlines()) == 26  # 20, prefix caching's five (issue 27), NoIdentTag
    assert out.startswith("FinishedNotRejected")


@pytest.mark.parametrize("args, message", [
    (("--model", "nope"), "no model 'nope'"),
    (("--model", "solo", "--bug", "Bogus"), "unknown bug switch"),
    (("--model", "solo", "--invariant", "Bogus"), "unknown property Bogus"),
])
def test_bad_input_is_a_clear_error_with_exit_2(capsys, args, message):
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert message in err


@pytest.mark.parametrize("text, message", [
    ("CONSTANTS\n  Requests = {r1}\n  NoReq = NoReq\n  MaxPromptPages = [1]\n", "bad.cfg:4"),
    ("CONSTANTS\n  Requests = {r1}\n  NoReq = NoReq\n  Bugs = {}\n",
     "MaxPromptPages is not set"),
])
def test_unreadable_or_incomplete_cfg_is_a_clear_error(capsys, tmp_path, text, message):
    bad = tmp_path / "bad.cfg"
    bad.write_text(text)
    code, _, err = run_cli(capsys, "--model", str(bad))
    assert code == 2
    assert message in err


def test_installed_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "api.cli", "check", "--model", "solo"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "963 distinct states found" in out.stdout


def test_the_parser_and_validate_do_not_import_torch():
    """`kvproof check`, `validate`, `sim` need no torch: building the parser imports none
    (serve's key file reader, which imports the engine, is imported when serve runs)."""
    import subprocess
    import sys
    code = ("import sys, api.cli; api.cli.build_parser(); "
            "from spec.tlaplus import runcheck; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(__import__('pathlib').Path(__file__).resolve().parents[1]))
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_orbit_states_report_the_states_without_symmetry(capsys, tmp_path):
    """`--symmetry --orbit-states` on a worker model: the orbits found, and the states the
    search without symmetry finds (10,566: the workers-2x2 row of spec/README's table),
    printed and in the JSON summary; without symmetry the flag is a usage error."""
    summary = tmp_path / "summary.json"
    code, out, err = run_cli(capsys, "--model", "workers-2x2", "--symmetry", "--orbit-states",
                             "--json", str(summary), "--quiet")
    assert code == 0, out + err
    assert "2643 distinct states found" in out
    assert "symmetry over requests and over the workers of each kind" in out
    assert "Without symmetry the search would find 10566 distinct states" in out
    assert json.loads(summary.read_text())["states_without_symmetry"] == 10566
    code, out, err = run_cli(capsys, "--model", "workers-2x2", "--orbit-states")
    assert code == 2 and "add --symmetry" in err
