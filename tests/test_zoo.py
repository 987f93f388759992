"""The bug zoo and the guard table: every number of spec/check/zoo.py, pinned."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # every test here model-checks the default model

from spec.check.zoo import ALONE, ENTRIES, ENTRY_BY_NAME, REISSUED_TAG
from tests.conftest import checked


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_every_zoo_entry_fails_with_its_property_and_pinned_length(entry):
    result = checked(entry.base, entry.bugs, entry.invariants, symmetry=False)
    v = result.violation
    assert v is not None, f"{entry.name} must fail"
    assert (v.property, v.length) == (entry.property, entry.length)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if len(e.bugs) > 1],
                         ids=[e.name for e in ENTRIES if len(e.bugs) > 1])
def test_every_zoo_entry_is_minimal(entry):
    """Drop any one switch and the same properties hold: each switch is needed."""
    for switch in sorted(entry.bugs):
        result = checked(entry.base, entry.bugs - {switch}, entry.invariants)
        assert result.ok, f"{entry.name} without {switch} fails {result.violation.property}"


@pytest.mark.parametrize("alone", ALONE, ids=[a.switch for a in ALONE])
def test_each_switch_alone_breaks_its_property_or_is_masked(alone):
    result = checked(alone.base, frozenset({alone.switch}), symmetry=alone.breaks is None)
    if alone.breaks:
        assert result.violation is not None
        assert (result.violation.property, result.violation.length) == (alone.breaks,
                                                                        alone.length)
    else:
        assert result.ok, f"{alone.switch} alone must be masked by {alone.masked_by}"
    if alone.exposed_by:
        entry = ENTRY_BY_NAME[alone.exposed_by]
        assert alone.switch in entry.bugs
        exposed = checked(entry.base, entry.bugs, entry.invariants)
        assert exposed.violation is not None and exposed.violation.property == entry.property


def test_a_reset_generation_lets_the_incident_through_a_decode_restart():
    """GenerationReset breaks its step property alone; with the guards that mask it off too
    (count check, reject-before-allocate, startup pool check) a stale page's tag equals the
    one the restarted decode issues, and the client gets another request's data with Ok.
    Minimality was checked by hand (spec/check/zoo.py, REISSUED_TAG)."""
    entry = REISSUED_TAG
    result = checked(entry.base, entry.bugs, entry.invariants, symmetry=False)
    assert result.violation is not None
    assert (result.violation.property, result.violation.length) == (entry.property,
                                                                    entry.length)


def test_guard_removals_are_each_shown_to_matter():
    """Every switch is broken alone or exposed by an entry: no switch is left unexplained."""
    explained = {a.switch for a in ALONE if a.breaks} | {
        s for e in ENTRIES for s in e.bugs}
    assert explained == {a.switch for a in ALONE}


def test_guard_table_in_the_readme_is_what_the_checker_finds():
    from spec.check.guardtable import readme_section, render
    assert readme_section() == render(checked), "run python -m spec.check.guardtable --write"
