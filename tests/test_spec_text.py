"""KVTransfer.tla and its .cfg files agree with the Python core, by name and by shape.

Spec and code are checked to be the same machine state by state elsewhere (the conformance
check); here the cheap structural facts: the spec parses, names match, every action says
what happens to every variable, and the .cfg files are the ones spec/check/zoo.py generates.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tla

from spec.check.cfgfile import load, model_names, parse_cfg
from spec.core import ACTION_NAMES, OBSERVATION_ORACLES, UNFAIR_ACTIONS
from spec.model import BUG_SWITCHES
from spec.properties import ALL_INVARIANTS, LIVENESS
from spec.tlaplus.tlaview import VARIABLES
from spec.check.zoo import MODELS_DIR, generated_cfgs

SPEC = (Path(__file__).resolve().parents[1] / "spec" / "KVTransfer.tla").read_text()


def definitions() -> dict[str, str]:
    pattern = re.compile(r"^(\w+)(\([^)]*\))?\s*==(.*?)(?=^\w+(?:\([^)]*\))?\s*==|^-{4,}|^={4,})",
                         re.S | re.M)
    text = re.sub(r"\(\*.*?\*\)", "", SPEC, flags=re.S)
    text = re.sub(r"\\\*.*", "", text)
    return {m.group(1): m.group(3) for m in pattern.finditer(text)}


def test_spec_parses_as_tla():
    module = tla.parse(SPEC)
    assert module is not None


def test_variables_match_the_python_view():
    declared = re.search(r"^VARIABLES\n(.*?)\n\n", SPEC, re.S | re.M).group(1)
    names = re.findall(r"^\s+(\w+),?", declared, re.M)
    assert tuple(names) == VARIABLES


def test_every_core_action_is_a_spec_action_and_vice_versa():
    defs = definitions()
    for name in ACTION_NAMES:
        assert name in defs, f"{name} is not defined in KVTransfer.tla"
    next_text = defs["Next"] + defs["FairNext"] + defs["ProtocolStep"]
    worker_actions = {"PrefillCrash", "DecodeCrash"} & set(re.findall(r"\b(\w+)\b", next_text))
    used = set(re.findall(r"\b([A-Z]\w+)\(", next_text)) | worker_actions
    # PromptsOf is the set of prompts an arrival may carry (prefix caching), not an action.
    assert used - {"SUBSET", "ProtocolStep", "PromptsOf"} - set(OBSERVATION_ORACLES) \
        == set(ACTION_NAMES)


def test_fairness_split_matches():
    defs = definitions()
    fair = set(re.findall(r"\b([A-Z]\w+)\(", defs["FairNext"] + defs["ProtocolStep"]))
    fair -= set(OBSERVATION_ORACLES) | {"ProtocolStep"}
    assert fair == set(ACTION_NAMES) - UNFAIR_ACTIONS - {"LandWrite"}
    assert "LandWrite" in definitions()["Progress"]


@pytest.mark.parametrize("action", ACTION_NAMES)
def test_every_action_primes_or_keeps_every_variable(action):
    defs = definitions()

    def touched(name: str) -> set[str]:
        body = defs[name]
        out = set(re.findall(r"(\w+)'", body))
        for group in re.findall(r"UNCHANGED\s*(<<[^>]*>>|\w+)", body):
            out |= set(re.findall(r"\w+", group))
        for helper in ("StopPrefill", "ReceiveFinalWord", "DropReferences", "Seal"):
            if helper != name and re.search(rf"\b{helper}\(", body):
                out |= touched(helper)
        return out

    assert touched(action) == set(VARIABLES)


def test_bug_names_match():
    names = set(re.findall(r'"(\w+)"', definitions()["BugNames"]))
    assert names == set(BUG_SWITCHES)


def test_invariants_and_properties_are_defined_in_the_spec():
    defs = definitions()
    for name in ALL_INVARIANTS:
        assert name in defs
    for name in LIVENESS:
        assert name in defs


def test_cfg_files_are_generated_from_the_zoo_table():
    on_disk = {p.name: p.read_text() for p in MODELS_DIR.glob("*.cfg")}
    assert on_disk == generated_cfgs()


@pytest.mark.parametrize("name", model_names())
def test_every_cfg_loads_and_names_only_known_properties(name):
    cfg, model = load(name)
    defs = definitions()
    assert cfg.specification in defs and not cfg.check_deadlock
    for invariant in cfg.invariants + cfg.properties:
        assert invariant in defs
    assert model.requests >= 1


def test_cfg_parser_reads_tlc_syntax():
    cfg = parse_cfg('(* a comment *)\nCONSTANT A = 3 \\* trailing\n B = {"x", y}\n'
                    "INVARIANT Inv1 Inv2\nPROPERTY P\nSYMMETRY Sym\nCHECK_DEADLOCK FALSE\n")
    assert cfg.constants["A"] == 3
    assert cfg.invariants == ["Inv1", "Inv2"] and cfg.properties == ["P"]
    assert cfg.symmetry == "Sym" and cfg.check_deadlock is False
