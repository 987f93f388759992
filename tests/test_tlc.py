"""TLC on the same models: the missing-tool path here, the real run where TLC exists."""

from __future__ import annotations

import pytest

from api.cli import main
from spec.model import Model
from spec.properties import ALL_INVARIANTS
from spec.check.cfgfile import cfg_for
from spec.tlaplus.tlc import find_tlc, parse_tlc_output, run_tlc
from spec.check.zoo import BASES

TLC_SAYS_OK = """TLC2 Version 2.19 of 08 August 2024
Computing initial states...
Finished computing initial states: 1 distinct state generated.
Model checking completed. No error has been found.
  Estimates of the probability that TLC did not check all reachable states
1,617 states generated, 987 distinct states found, 0 states left on queue.
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
    assert ok.ok and (ok.distinct_states, ok.states_generated, ok.depth) == (987, 1617, 14)
    bad = parse_tlc_output(TLC_SAYS_VIOLATED, 1.0)
    assert not bad.ok and bad.violation == "Invariant SourceHeld"
    assert parse_tlc_output("Error: Deadlock reached.\n", 0).violation == "Deadlock"


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
        assert result.distinct_states == {"solo": 987, "solo-crash": 1384}[base]
