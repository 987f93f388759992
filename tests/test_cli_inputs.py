"""Bad inputs a new user still tripped over (issue 30, the command-line side): each gets one
line on stderr that says what the input really is, and exit status 2; every name a
`--list-*` prints is accepted; a run interrupted with Ctrl-C says "no verdict" and keeps
what it saved.

Commands run in this process (main()), except where the process itself is the subject
(a SIGINT).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.cli import main
from tests.cli_cases import ctrl_c_reaches_it, run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Paths that are not what a subcommand reads: folders (one named like a model), an
    empty file, binary files, and a counterexample of a two-request model."""
    folder = tmp_path_factory.mktemp("inputs30")
    made = {"folder": folder / "folder", "cfg_folder": folder / "x.cfg",
            "empty": folder / "empty.json", "empty_cfg": folder / "empty.cfg",
            "empty_toml": folder / "empty.toml",
            "binary_json": folder / "binary.json", "binary": folder / "binary.ndjson",
            "cex": folder / "cex.itf.json", "two": folder / "two.cfg"}
    made["folder"].mkdir()
    made["cfg_folder"].mkdir()
    made["empty"].write_bytes(b"")
    made["empty_cfg"].write_bytes(b"")
    made["empty_toml"].write_bytes(b"\n")
    made["binary_json"].write_bytes(b'\xff\xfe{"states": []}\n')
    made["binary"].write_bytes(bytes(range(256)))
    solo = (ROOT / "spec" / "models" / "solo.cfg").read_text()
    made["two"].write_text(solo.replace("Crashes = FALSE", "Crashes = two", 1))
    assert main(["check", "--model", "bug-EagerRelease", "--quiet",
                 "--itf", str(made["cex"])]) == 1
    log = folder / "run.ndjson"
    assert main(["sim", "one-pair", "--requests", "5", "--quiet", "--log", str(log)]) == 0
    lines = log.read_text().splitlines(keepends=True)
    times = [json.loads(line)["t"] for line in lines[1:]]
    later = next(k for k, t in enumerate(times, start=1) if t > times[0])
    lines[1], lines[later] = lines[later], lines[1]  # line 2 now later than line 3
    made["backwards"] = folder / "backwards.ndjson"
    made["backwards"].write_text("".join(lines))
    return made


# (argv with {file} placeholders, what the one line must say)
BAD_INPUTS = [
    # not UTF-8: a UnicodeDecodeError traceback (exit 1) before
    (["validate", "{binary_json}"], "{binary_json}: not a text file (byte 0 is not UTF-8)"),
    (["fuzz", "--replay", "{binary_json}"], "not a text file (byte 0 is not UTF-8)"),
    # what a path really is: "no such file" for each of these before
    (["check", "--model", "{folder}"], "{folder}: is a folder"),
    (["check", "--model", "{cfg_folder}"], "{cfg_folder}: is a folder"),
    (["check", "--model", "{empty_cfg}"], "{empty_cfg}: is empty"),
    (["conformance", "--model", "{cfg_folder}"], "is a folder"),
    (["validate", "{folder}"], "{folder}: is a folder"),
    (["validate", "{cfg_folder}"], "is a folder"),
    (["validate", "{empty}"], "{empty}: is empty"),
    (["validate", "{cex}", "--model", "{cfg_folder}"], "is a folder"),
    (["sim", "--replay", "{folder}"], "--replay {folder}: is a folder"),
    (["sim", "{folder}"], "{folder}: is a folder"),  # and "no scenario" before
    (["sim", "{empty_toml}"], "{empty_toml}: is empty"),  # ran every default silently before
    (["sim", "--replay", "{empty}"], "is empty"),
    (["sim", "--replay", "{binary}"], "not a text file"),
    (["fuzz", "--replay", "{cfg_folder}"], "--replay {cfg_folder}: is a folder"),
    (["fuzz", "--replay", "{empty}"], "is empty"),
    # another model than the trace's: exit 1 ("state 0 is not the initial state") before
    (["validate", "{cex}", "--model", "solo"],
     "is a behaviour of model bug-EagerRelease: 2 requests"),
    # silently accepted before: the sweep won over --set / --seed; the fold went back in time
    (["sim", "one-pair", "--sweep", "cluster.decode_workers=1,2", "--set",
      "cluster.decode_workers=3"], "--sweep cluster.decode_workers and --set "
     "cluster.decode_workers=3 both set cluster.decode_workers"),
    (["sim", "one-pair", "--sweep", "seed=1,2", "--seed", "3"], "--seed both set seed"),
    (["sim", "--replay", "{backwards}"], "{backwards} line 3: time goes backwards"),
    # plain names, not Python reprs
    (["check", "--model", "{two}"], "Crashes must be TRUE or FALSE, got two"),
    (["fuzz", "--target", "nosuch"], "unknown target(s) nosuch; known: core, engine, hybrid, sim"),
    (["fuzz", "--bug", "nosuch"], "unknown bug switch(es) nosuch;"),
    (["check", "--property", "nosuch"], "unknown property nosuch; see --list-properties"),
    (["fuzz", "--property", "nosuch"], "unknown property nosuch; see --list-properties"),
    # the top level: "the following arguments are required: SUBCOMMAND" before
    (["--frobnicate"], "kvproof: unknown option --frobnicate"),
    (["--frobnicate", "check"], "kvproof: unknown option --frobnicate"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS,
                         ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(capsys, files, argv, message):
    values = {k: str(v) for k, v in files.items()}
    code, out, err = run(capsys, *[a.format(**values) for a in argv])
    assert code == 2, out + err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message.format(**values) in lines[0]
    assert "['" not in lines[0] and "Name(" not in lines[0], lines[0]


def test_the_top_level_still_takes_its_own_options_abbreviated(capsys):
    code, out, _ = run(capsys, "--vers")
    assert code == 0 and out.startswith("kvproof")


def _listed_properties(capsys, command: str) -> list[str]:
    code, out, _ = run(capsys, command, "--list-properties")
    assert code == 0
    return [line.split()[0] for line in out.splitlines()]


def test_every_listed_property_is_accepted_and_checked_by_check(capsys):
    names = _listed_properties(capsys, "check")
    assert len(names) == 21  # 18, and prefix caching's SaltsApart, ReadersAreLive, SealedIsQuiet
    for name in names:
        code, out, err = run(capsys, "check", "--model", "solo", "--quiet", "--property", name)
        assert code == 0, (name, err)
        checking = next(line for line in out.splitlines() if line.startswith("Checking"))
        assert name in checking, checking  # a liveness name is shown beside its invariant


def test_a_liveness_property_by_name_finds_its_violation(capsys):
    """EveryRequestEnds is decided by NoStuckRequest; without a timeout and without the
    abort notice a request waits forever."""
    code, out, _ = run(capsys, "check", "--model", "default", "--bug", "NoTimeout", "--bug",
                       "NoAbortNotice", "--quiet", "--property", "EveryRequestEnds")
    assert code == 1
    assert "Error: NoStuckRequest is violated (rest)" in out
    assert "--property EveryRequestEnds" in out  # in the reproduce command


def test_every_listed_property_is_accepted_and_checked_by_fuzz(capsys):
    names = _listed_properties(capsys, "fuzz")
    assert names == _listed_properties(capsys, "check")
    for name in names:
        code, out, err = run(capsys, "fuzz", "--seed", "1", "--examples", "1", "--quiet",
                             "--property", name)
        assert code == 0, (name, err)
        header = out.splitlines()[0]
        checked = header.split("properties: ")[1].split(", ")
        expected = {"EveryRequestEnds": "NoStuckRequest", "PagesComeBack": "NoLeakAtRest"}
        assert checked == [expected.get(name, name)], header


def test_a_model_path_reads_from_any_working_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "check", "--model", "spec/models/solo.cfg", "--quiet")
    assert code == 0, err
    assert out.startswith("model solo:")
    code, _, err = run(capsys, "check", "--model", "spec/models/nosuch.cfg")
    assert code == 2 and "spec/models/nosuch.cfg: no such file" in err


def test_fuzz_list_targets_describes_every_target(capsys):
    code, out, _ = run(capsys, "fuzz", "--list-targets")
    assert code == 0
    rows = {line.split()[0]: line.split(None, 1)[1:] for line in out.splitlines()}
    assert set(rows) == {"core", "engine", "hybrid", "sim"}
    assert all(description and description[0].strip() for description in rows.values()), out


def _interrupted(tmp_path: Path, argv: list[str], started) -> tuple[int, str, str]:
    """Run `kvproof ARGV` in a process, send it SIGINT (Ctrl-C) once `started(out)` says its
    run is under way, and return its exit status, stdout and stderr. Bounded: 60 s to start,
    60 s to stop; the process is killed if it does neither."""
    out_path = tmp_path / "stdout"
    with open(out_path, "w") as out, subprocess.Popen(
            [sys.executable, "-m", "api.cli", *argv], cwd=ROOT, stdout=out,
            stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it) as process:
        try:
            deadline = time.monotonic() + 60
            while not started(out_path.read_text()) and time.monotonic() < deadline:
                assert process.poll() is None, process.stderr.read()
                time.sleep(0.1)
            assert started(out_path.read_text()), "the run did not start within 60 s"
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    return process.returncode, out_path.read_text(), err


def test_ctrl_c_stops_sim_with_no_verdict_and_a_log_that_replays(capsys, tmp_path):
    log = tmp_path / "run.ndjson"

    def started(_: str) -> bool:
        return log.exists() and log.stat().st_size > 20_000  # the header and some events

    code, _, err = _interrupted(tmp_path, ["sim", "default", "--requests", "2000000",
                                           "--quiet", "--log", str(log)], started)
    assert code == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"kvproof sim: interrupted; no verdict; the events so far are in {log}, which says "
        f"the run was cut short: kvproof sim --replay {log}"]
    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line whole
    assert records[-1]["a"] == "RunEnd" and records[-1]["interrupted"] is True
    code, out, err = run(capsys, "sim", "--replay", str(log))
    assert code == 130, err
    assert "was interrupted after" in out and "events: no verdict" in out


def test_ctrl_c_stops_fuzz_with_no_verdict(tmp_path):
    code, out, err = _interrupted(tmp_path, ["fuzz", "--seconds", "60", "--seed", "1"],
                                  lambda out: out.startswith("kvproof fuzz: target core"))
    assert code == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "kvproof fuzz: interrupted; no verdict"


def test_a_zoo_counts_its_budget_apart_from_shrinking_and_a_miss_has_its_own_code(capsys):
    """--zoo --examples 30 took minutes (20 s of shrinking per catching cell, uncounted),
    the header said "per cell 30 examples" while the totals counted the shrinking examples
    too, and a missed entry exited 1, "a property is violated", though nothing was."""
    code, out, _ = run(capsys, "fuzz", "--zoo", "--target", "core", "--examples", "1",
                       "--seed", "1", "--quiet")
    lines = out.splitlines()
    assert lines[0].startswith("kvproof fuzz --zoo: targets core; seed 1; per cell 1 example "
                               "searching, then shrinking a failure at most 2 s + cutting it "
                               "down at most 2 s;")
    cells = [line for line in lines if line.split("  ")[0].strip() and "  " in line
             and not line.startswith(("entry", "core:", "kvproof"))]
    totals = next(line for line in lines if line.startswith("core: "))
    assert totals.startswith(f"core: {len(cells)} examples searched in ")  # 1 per cell
    caught = sum("caught after" in line for line in cells)
    assert f"; shrinking {caught} failure" in totals
    for line in cells:
        if "caught after" in line:
            assert float(line.split("(shrunk in ")[1].split(" s)")[0]) < 10, line
    assert code == 4, out
    assert "MISSED (not caught within the budget; nothing was violated): incident on core" in out
    assert "FAILED" not in out


def test_fuzz_help_documents_the_missed_exit_code(capsys):
    code, out, _ = run(capsys, "fuzz", "--help")
    assert code == 0
    codes = out[out.index("exit status:"):]
    assert "\n  4  (--zoo) a zoo entry was MISSED" in codes
    assert "\n  1  a property is violated" in codes and "\n  3  the shell crashed" in codes


def test_an_interrupt_a_library_swallows_is_delivered_again():
    """Ctrl-C that a library's broad except swallows is raised again (api/clikit.py
    interrupts_kept._rearm): the loop below swallows the first KeyboardInterrupt, as
    Hypothesis did in a CI fuzz run that then went on for its whole budget."""
    import _thread

    from api.clikit import interrupts_kept

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    kept, swallowed = interrupts_kept(), 0
    kept.REARM_S = 0.2
    try:
        with pytest.raises(KeyboardInterrupt):
            with kept:
                deadline, sent = time.monotonic() + 10, False
                while time.monotonic() < deadline:
                    try:
                        if not sent:
                            sent = True
                            _thread.interrupt_main()
                        time.sleep(0.01)
                    except KeyboardInterrupt:
                        if swallowed:
                            raise
                        swallowed += 1
    finally:
        signal.signal(signal.SIGINT, previous)
    assert swallowed == 1 and kept.seen and not kept.active
