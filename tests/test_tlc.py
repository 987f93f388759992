"""TLC on the same models: the missing-tool path here, the real run where TLC exists."""

from __future__ import annotations

import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from api.check_command import _properties, tlc_lists
from api.cli import main
from spec.check.checker import Checker
from spec.model import Model
from spec.properties import ALL_INVARIANTS
from spec.check.cfgfile import cfg_for, load, model_names, parse_cfg
from spec.tlaplus.tlc import find_tlc, parse_tlc_output, run_tlc
from spec.check.zoo import BASES

TLC_SAYS_OK = """TLC2 Version 2.19 of 08 August 2024
Computing initial states...
Finished computing initial states: 1 distinct state generated.
Model checking completed. No error has been found.
  Estimates of the probability that TLC did not check all reachable states
1,644 states generated, 987 distinct states found, 0 states left on queue.
The depth of the complete state graph search is 14.
"""
TLC_SAYS_VIOLATED = """Error: Invariant SourceHeld is violated.
Error: The behavior up to this point is:
State 1: <Initial predicate>
118 states generated, 95 distinct states found, 20 states left on queue.
The depth of the complete state graph search is 5.
"""


def test_tlc_output_is_parsed_into_the_same_summary():
    ok = parse_tlc_output(TLC_SAYS_OK, 1.0)
    assert ok.ok and (ok.distinct_states, ok.states_generated, ok.depth) == (987, 1644, 14)
    bad = parse_tlc_output(TLC_SAYS_VIOLATED, 1.0)
    assert not bad.ok and bad.violation == "Invariant SourceHeld"
    assert parse_tlc_output("Error: Deadlock reached.\n", 0).violation == "Deadlock"
    step = parse_tlc_output("Error: Action property TombstonesStay is violated.\n", 0)
    assert step.violation == "Action property TombstonesStay"


def test_the_cfg_written_for_tlc_carries_every_constant():
    text = cfg_for(Model(bugs={"NoTimeout"}, **BASES["solo-crash"]), ("TypeOK",),
                   ("EveryRequestEnds",))
    for line in ("Requests = {r1}", "NoReq = NoReq", "MaxPromptPages = 3", "Crashes = TRUE",
                 'Bugs = {"NoTimeout"}', "SPECIFICATION FairSpec", "CHECK_DEADLOCK FALSE",
                 "PROPERTIES"):
        assert line in text


def test_without_tlc_the_cli_says_exactly_what_is_missing(monkeypatch, capsys):
    monkeypatch.delenv("TLA2TOOLS_JAR", raising=False)
    assert main(["check", "--tlc", "--model", "solo"]) == 2
    assert "TLA2TOOLS_JAR is not set" in capsys.readouterr().err
    monkeypatch.setenv("TLA2TOOLS_JAR", "/nonexistent/tla2tools.jar")
    assert main(["check", "--tlc", "--model", "solo"]) == 2
    assert "is not a file" in capsys.readouterr().err


TLC = find_tlc()


@pytest.mark.skipif(isinstance(TLC, str), reason=str(TLC))
def test_tlc_agrees_with_the_python_checker_on_the_solo_models():
    for base in ("solo", "solo-crash"):
        model = Model(**BASES[base])
        result = run_tlc(model, ALL_INVARIANTS, ("EveryRequestEnds", "PagesComeBack"))
        assert result.ok, result.output[-3000:]
        assert result.distinct_states == {"solo": 963, "solo-crash": 1252}[base]
        # kvproof counts generated states as TLC does (spec/check/tlccount.py).
        assert result.states_generated == {"solo": 1581, "solo-crash": 2047}[base]


# -- everything up to TLC itself, with a fake tla2tools.jar ------------------------------
# No TLC jar is reachable here; a stand-in class tlc2.TLC, compiled in the test, records the
# command line and the .cfg it was given, and answers with TLC's output for the case.

FAKE_TLC = """package tlc2;
import java.nio.file.*;
import java.util.*;
public class TLC {
    public static void main(String[] args) throws Exception {
        List<String> log = new ArrayList<>(Arrays.asList(args));
        for (int i = 0; i + 1 < args.length; i++) {
            if (args[i].equals("-config")) {
                log.add("--- config ---");
                log.add(Files.readString(Path.of(args[i + 1])));
            }
        }
        Files.write(Path.of(System.getenv("FAKE_TLC_LOG")), log);
        System.out.print(Files.readString(Path.of(System.getenv("FAKE_TLC_OUTPUT"))));
        System.exit(Integer.parseInt(System.getenv("FAKE_TLC_EXIT")));
    }
}
"""
SANY_REFUSES = """Semantic errors:

*** Errors: 1

line 102, col 1 to line 103, col 80 of module KVTransfer
Operator SortSeq already defined or declared
"""


@pytest.fixture(scope="module")
def fake_jar(tmp_path_factory):
    javac = shutil.which("javac")
    if javac is None or shutil.which("java") is None:
        pytest.skip("no JDK here to build the stand-in jar")
    root = tmp_path_factory.mktemp("fake-tlc")
    (root / "tlc2").mkdir()
    (root / "tlc2" / "TLC.java").write_text(FAKE_TLC)
    subprocess.run([javac, "-d", str(root / "classes"), str(root / "tlc2" / "TLC.java")],
                   check=True, capture_output=True)
    jar = root / "tla2tools.jar"
    with zipfile.ZipFile(jar, "w") as archive:  # a jar on -cp needs no manifest
        archive.write(root / "classes" / "tlc2" / "TLC.class", "tlc2/TLC.class")
    return jar


def run_fake(monkeypatch, tmp_path, jar, model: str, output: str, exit_code: int = 0):
    log, answer = tmp_path / "tlc.log", tmp_path / "answer.txt"
    answer.write_text(output)
    monkeypatch.setenv("TLA2TOOLS_JAR", str(jar))
    monkeypatch.setenv("FAKE_TLC_LOG", str(log))
    monkeypatch.setenv("FAKE_TLC_OUTPUT", str(answer))
    monkeypatch.setenv("FAKE_TLC_EXIT", str(exit_code))
    code = main(["check", "--tlc", "--model", model])
    args, _, config = log.read_text().partition("--- config ---\n")
    return code, args.split("\n"), config


def test_kvproof_launches_tlc_on_the_spec_with_the_models_own_cfg(monkeypatch, tmp_path,
                                                                   fake_jar, capsys):
    code, args, config = run_fake(monkeypatch, tmp_path, fake_jar, "solo", TLC_SAYS_OK)
    assert code == 0
    assert args[:2] == ["-workers", "1"] and "-config" in args
    assert ["-lncheck", "final"] == args[args.index("-lncheck"):args.index("-lncheck") + 2]
    spec = Path(args[args.index("-config") + 2 + 2])
    assert spec.name == "KVTransfer.tla" and spec.is_file()
    shipped = load("solo")[0]
    given = parse_cfg(config)
    assert (given.constants, given.invariants, given.properties, given.specification,
            given.check_deadlock) == (shipped.constants, shipped.invariants,
                                      shipped.properties, shipped.specification, False)
    assert "TLC command: " in capsys.readouterr().out


def test_a_violation_reported_by_tlc_exits_1(monkeypatch, tmp_path, fake_jar, capsys):
    code, args, _ = run_fake(monkeypatch, tmp_path, fake_jar, "zoo-source-reuse-unverified",
                             TLC_SAYS_VIOLATED, exit_code=12)
    assert code == 1 and "-lncheck" not in args  # this entry checks invariants only
    assert "Error: TLC reports Invariant SourceHeld" in capsys.readouterr().out


def test_a_spec_sany_refuses_is_bad_input_not_a_violation(monkeypatch, tmp_path, fake_jar,
                                                          capsys):
    code, _, _ = run_fake(monkeypatch, tmp_path, fake_jar, "solo", SANY_REFUSES, 150)
    assert code == 2
    assert "SANY refused the spec: line 102" in capsys.readouterr().err


def test_kvproof_stops_before_java_when_sany_would_refuse(monkeypatch, capsys):
    monkeypatch.setattr("spec.tlaplus.tlc.static_errors",
                        lambda: ["line 102: Operator SortSeq already defined or declared"])
    monkeypatch.setenv("TLA2TOOLS_JAR", __file__)  # found, never launched
    assert main(["check", "--tlc", "--model", "solo"]) == 2
    assert "line 102: Operator SortSeq" in capsys.readouterr().err


@pytest.mark.parametrize("name", model_names())
def test_tlc_is_given_every_shipped_cfg_as_it_is(name):
    """What `kvproof check --tlc` writes for TLC has the file's constants, invariants and
    properties, so TLC checks each shipped model exactly as the file says."""
    cfg, model = load(name)
    invariants, liveness = _properties(cfg, [])
    given = parse_cfg(cfg_for(model, *tlc_lists(cfg, invariants, liveness)))
    assert (given.constants, given.invariants, given.properties, given.specification) == (
        cfg.constants, cfg.invariants, cfg.properties, cfg.specification)


# -- the figures spec/README.md says TLC must print ----------------------------------------

README = Path(__file__).resolve().parents[1] / "spec" / "README.md"
# model -> (distinct states, TLC's depth) where every property holds, or the violated
# invariant and the counterexample's steps. kvproof's counts (TLC's depth counts the initial
# state); TLC's were seen to be equal for default before the bootstrap queue (870,620,
# depth 27); today's have not been seen from TLC.
TLC_FIGURES = {
    "bug-AdmitBeforeReserve": ('FittingRequestsSucceed', 4),
    "bug-EagerRelease": ('NoWriteIntoForeign', 6),
    "bug-FinishedNotRejected": (772008, 27),
    "bug-NoAbortNotice": (399664, 27),
    "bug-NoCancel": (177564, 25),
    "bug-NoChecksum": (772008, 27),
    "bug-NoCountCheck": (772008, 27),
    "bug-NoGenBump": (758190, 27),
    "bug-NoTimeout": (290130, 27),
    "bug-NoTombstone": (788968, 27),
    "bug-PoolBelowContext": (857953, 27),
    "bug-SourceReuse": ('SourceHeld', 4),
    "bug-StopwatchTimeout": ('FittingRequestsSucceed', 6),
    "crash": (1267726, 27),
    "decode-crash": (322726, 23),
    "default": (772008, 27),
    "incident": ('OkIsClean', 18),
    "large": None,
    "reject-paths": (1078, 14),
    "small": (66384, 23),
    "solo": (963, 14),
    "solo-crash": (1252, 14),
    "solo-decode-crash": (2095, 14),
    "timely": (290130, 27),
    "timely-crash": (533392, 27),
    "wide": (964, 14),
    "zoo-dead-prefill": ('NoLeakAtRest', 3),
    "zoo-eager-release": ('NoWriteIntoForeign', 6),
    "zoo-late-write-looks-current": ('Isolation', 15),
    "zoo-lost-tombstone": ('NoLeakAtRest', 4),
    "zoo-no-cancel": ('NoLeakAtRest', 4),
    "zoo-no-timeout": ('NoLeakAtRest', 4),
    "zoo-rejected-decodes": ('RejectedIsError', 7),
    "zoo-silent-prefill-abort": ('NoLeakAtRest', 3),
    "zoo-source-reuse": ('SourceHeld', 4),
    "zoo-source-reuse-unverified": ('Isolation', 11),
    "zoo-stopwatch-timeout": ('FittingRequestsSucceed', 6),
    # issue 25: an early final word, a decode restart
    "bug-EarlyDone": ('FittingRequestsSucceed', 6),
    "bug-GenerationReset": ('GenerationsNeverGoBack', 3),
    "bug-NoEpochCheck": ('TombstonesStay', 4),
    "bug-NoLandedCount": (66384, 23),
    "bug-NoRetransmit": ('FittingRequestsSucceed', 2),
    "bug-NoRevoke": ('FittingRequestsSucceed', 6),
    "bug-NoFailureDetector": ('NoStuckRequest', 3),
    "zoo-early-done": ('NoWriteIntoForeign', 7),
    "zoo-revived-bootstrap": ('NoLeakAtRest', 5),
    # issue 25: a network that loses things for good
    "loss-Bootstrap": (1264, 14),
    "loss-Cancel": (1432, 14),
    "loss-FinalWord": (1492, 14),
    "loss-Write": (2011, 14),
    "lossy": (2635, 14),
    "lossy-decode-crash": (4380, 14),
    # issue 25: worker sets (one request; each worker may crash alone)
    "workers-1x2": (5284, 14),
    "workers-2x1": (5284, 14),
    "workers-2x2": (10566, 14),
    # issue 27: prefix caching, decode side
    "prefix": (841757, 27),
    "prefix-chain": (1267305, 27),
    "prefix-crash": (2187923, 27),
    "bug-StaleHitLength": ('FittingRequestsSucceed', 7),
    "bug-NoRefCount": ('ExclusiveOwner', 11),
    "bug-FullHitNoNotice": ('NoStuckRequest', 13),
    "bug-NoSalt": ('SaltsApart', 9),
    "zoo-stale-hit-reads-unwritten": ('Isolation', 14),
    "zoo-no-refcount": ('ExclusiveOwner', 11),
    "zoo-full-hit-no-notice": ('NoStuckRequest', 13),
    "zoo-no-salt": ('SaltsApart', 9),
    # issue 27: prefix caching at the prefill too
    "prefix-prefill": (423721, 30),
    "prefix-prefill-crash": (561817, 30),
    "bug-EvictWhileSending": ('SealedIsQuiet', 10),
    "zoo-evict-while-sending": ('SealedIsQuiet', 10),
    # issue 28: the content identity in the page tag
    "bug-NoIdentTag": (841757, 27),
    "zoo-cross-tenant-read": ('Isolation', 13),
}


def readme_table() -> dict[str, object]:
    block = README.read_text().split("<!-- tlc-figures:begin -->")[1].split(
        "<!-- tlc-figures:end -->")[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        name, verdict, distinct, depth = [c.strip() for c in line.strip("|").split("|")]
        broken = re.match(r"(?:Invariant|Action property) (\w+) is violated \((\d+) steps\)",
                          verdict)
        rows[name] = ((broken.group(1), int(broken.group(2))) if broken else
                      (int(distinct.replace(",", "")), int(depth)) if distinct else None)
    return rows


def test_the_readme_table_of_tlc_figures_is_pinned_and_covers_every_model():
    assert readme_table() == TLC_FIGURES
    assert set(TLC_FIGURES) == set(model_names())


@pytest.mark.parametrize("name", [n for n, f in TLC_FIGURES.items() if f is not None and (
    isinstance(f[0], str) and n not in ("incident", "zoo-late-write-looks-current",
                                        "zoo-rejected-decodes", "zoo-source-reuse-unverified")
    or isinstance(f[0], int) and f[0] < 5000)])
def test_the_small_models_figures_are_what_kvproof_finds(name):
    cfg, model = load(name)
    invariants, liveness = _properties(cfg, [])
    result = Checker(model, invariants=invariants, liveness=liveness).run()
    if result.violation is None:
        assert (result.distinct_states, result.depth + 1) == TLC_FIGURES[name]
    else:
        assert (result.violation.property, result.violation.length) == TLC_FIGURES[name]
