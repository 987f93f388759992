"""spec/tlaplus/sany.py: what SANY would refuse, caught without Java.

The spec once redefined SortSeq, which the standard module TLC defines with two arguments;
SANY refused it and TLC never started (exit 150). Each rule has a small module here that
it alone catches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spec.tlaplus.sany import check_file, check_text, main

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec" / "KVTransfer.tla"
# KVTransfer.tla as of commit cf7870e, the text SANY refused.
OLD_SPEC = Path(__file__).resolve().parent / "data" / "KVTransfer-cf7870e.tla"
OLD_SORTSEQ = ("SortSeq(S) == CHOOSE q \\in [1..Cardinality(S) -> S] :\n"
               "                \\A i, j \\in 1..Cardinality(S) : i < j => q[i] < q[j]\n")


def module(body: str, extends: str = "Integers") -> str:
    return f"---- MODULE M ----\nEXTENDS {extends}\n{body}\n====\n"


def messages(text: str) -> list[tuple[int, str]]:
    return [(e.line, e.message) for e in check_text(text)]


def test_the_shipped_spec_is_clean():
    assert check_file(SPEC) == []


def test_the_old_spec_fails_on_the_sortseq_clash_and_both_calls():
    errors = messages(OLD_SPEC.read_text())
    assert errors == [
        (102, "Operator SortSeq already defined or declared (in the standard module TLC, "
              "which this module EXTENDS)"),
        (185, "The operator SortSeq requires 2 arguments; it is given 1"),
        (318, "The operator SortSeq requires 2 arguments; it is given 1"),
    ]


def test_the_old_definition_put_back_into_todays_spec_is_caught_at_its_lines():
    """The same mistake in the spec as it is now (lines move as the spec grows)."""
    text = SPEC.read_text()
    text = text.replace("Ascending(S) ==", OLD_SORTSEQ + "Ascending(S) ==")
    text = text.replace("= Ascending(S)]", "= SortSeq(S)]").replace("== Ascending(S)\n",
                                                                      "== SortSeq(S)\n")
    text = text.replace("\\o Ascending(S)]", "\\o SortSeq(S)]")  # Admit: hits, then S
    lines = text.splitlines()
    defined = next(i for i, l in enumerate(lines, 1) if l.startswith("SortSeq(S) =="))
    calls = [i for i, l in enumerate(lines, 1) if re.search(r"([=\[]|\\o) ?SortSeq\(S\)", l)
             and not l.startswith("SortSeq")]
    assert len(calls) == 2
    assert [line for line, _ in messages(text)] == [defined, *calls]


def test_the_command_line_exits_1_with_errors_and_0_without(capsys):
    assert main([str(OLD_SPEC)]) == 1
    out = capsys.readouterr().out
    assert f"{OLD_SPEC}:102: Operator SortSeq already defined or declared" in out
    assert main([str(SPEC)]) == 0
    assert capsys.readouterr().out.strip().endswith("no errors")


@pytest.mark.parametrize("name,extends", [("Len", "Sequences"), ("Cardinality", "FiniteSets"),
                                          ("Nat", "Naturals"), ("Int", "Integers"),
                                          ("Permutations", "TLC"), ("Real", "Reals")])
def test_a_name_a_standard_module_defines_is_refused(name, extends):
    assert messages(module(f"{name} == 1", extends)) == [
        (3, f"Operator {name} already defined or declared (in the standard module "
            f"{extends}, which this module EXTENDS)")]


def test_a_constant_or_variable_named_like_a_standard_operator_is_refused():
    errors = messages(module("CONSTANT Head\nVARIABLE Tail", "Sequences"))
    assert [line for line, _ in errors] == [3, 4]
    assert all("already defined or declared" in m for _, m in errors)


def test_local_imports_of_a_standard_module_are_not_exported():
    """TLC uses LOCAL INSTANCE Naturals: EXTENDS TLC alone defines neither .. nor Len."""
    assert messages(module("Len == 1\nA == 1..2", "TLC")) == [(4, "Unknown operator: `..'")]


def test_a_name_defined_twice_is_refused():
    assert messages(module("A == 1\nB == 2\nA == 3")) == [
        (5, "Multiply-defined symbol 'A': this definition or declaration conflicts with "
            "the one at line 3")]


def test_a_bound_name_may_not_shadow_a_definition():
    errors = messages(module("x == 1\nA == \\E x \\in {1} : x = 1"))
    assert [(line, m.split(":")[0]) for line, m in errors] == [
        (4, "Multiply-defined symbol 'x'")]


@pytest.mark.parametrize("body,line,message", [
    ("F(a, b) == a + b\nA == F(1)", 4, "The operator F requires 2 arguments; it is given 1"),
    ("c == 1\nA == c(2)", 4, "The operator c requires 0 arguments; it is given 1"),
    ("A == Cardinality({1}, {2})", 3,
     "The operator Cardinality requires 1 argument; it is given 2"),
])
def test_an_operator_applied_to_the_wrong_number_of_arguments_is_refused(body, line, message):
    assert messages(module(body, "Integers, FiniteSets")) == [(line, message)]


def test_an_operator_passed_to_a_higher_order_parameter_is_not_an_arity_error():
    text = module("Lt(a, b) == a < b\nA == SortSeq(<<2, 1>>, Lt)\n"
                  "Ap(Op(_), x) == Op(x)\nNeg(x) == -x\nB == Ap(Neg, 1)", "Integers, TLC")
    assert messages(text) == []


def test_an_unknown_identifier_is_refused():
    assert messages(module("A == B + 1")) == [(3, "Unknown operator: `B'")]


def test_bound_names_are_in_scope_only_inside_their_binder():
    text = module("A == \\E x \\in {1} : x = 1\nB == x\n"
                  "C == {y \\in {1} : y > 0} \\cup {z + 1 : z \\in {1}}\n"
                  "D == [i \\in {1} |-> i] /\\ (CHOOSE c \\in {1} : c = 1)\n"
                  "E(p) == LET q == p IN q\nF[n \\in Nat] == IF n = 0 THEN 0 ELSE F[n - 1]")
    assert messages(text) == [(4, "Unknown operator: `x'")]


def test_a_definition_used_before_its_line_is_refused():
    assert messages(module("A == B\nB == 1")) == [
        (3, "Unknown operator: `B' (it is defined at line 4, after this use: TLA+ needs a "
            "definition before its use)")]


def test_an_operator_may_not_use_itself_without_recursive():
    assert [line for line, _ in messages(module("F(n) == F(n)"))] == [3]
    assert messages(module("RECURSIVE F(_)\nF(n) == IF n = 0 THEN 0 ELSE F(n - 1)")) == []


def test_unary_minus_needs_integers():
    assert messages(module("A == -1", "Naturals")) == [
        (3, "Unknown operator: `-' with one argument (unary minus is defined in Integers, "
            "which this module does not EXTEND)")]
    assert messages(module("A == -1 + (2 - 1)")) == []


def test_a_module_extended_from_a_sibling_file_is_read(tmp_path):
    (tmp_path / "Base.tla").write_text("---- MODULE Base ----\nEXTENDS Naturals\nTwo == 2\n====\n")
    main_file = tmp_path / "Main.tla"
    main_file.write_text("---- MODULE Main ----\nEXTENDS Base\nA == Two + 1\nB == Three\n====\n")
    assert [(e.line, e.message) for e in check_file(main_file)] == [
        (4, "Unknown operator: `Three'")]
    main_file.write_text("---- MODULE Main ----\nEXTENDS Nowhere\n====\n")
    assert [e.message for e in check_file(main_file)] == [
        "Cannot find source file for module Nowhere"]
