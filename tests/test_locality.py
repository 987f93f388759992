"""Every action of the spec reads only what its worker can know (spec/tlaplus/locality.py).

The rule is computed from KVTransfer.tla's parse tree, so it can fail: the spec as it was
before issue 11's locality change (tests/data/KVTransfer-before-locality.tla, a copy of that
text) is flagged at exactly the four guards that read another worker's state.
"""

from __future__ import annotations

import re
from pathlib import Path

from collections import deque

import pytest

from spec import core
from spec.check.zoo import BASES
from spec.model import ALL_BUGS, Model
from spec.tlaplus import locality
from spec.tlaplus.conformance import SPEC_PATH
from spec.tlaplus.tlaview import VARIABLES

BEFORE = Path(__file__).resolve().parent / "data" / "KVTransfer-before-locality.tla"


def test_the_spec_as_it_is_breaks_no_locality():
    assert locality.violations() == []


def test_the_old_guards_are_flagged():
    """Release read the set of writes in flight (the prefill's send queue); Admit and
    SendPage read decode's page table; Accept compared the prefill's own count of posted
    writes with the table. Nothing else was flagged."""
    flagged = {tuple(re.match(r"(\w+) \(\w+\) reads (\w+)", v).groups())
               for v in locality.violations(BEFORE.read_text())}
    assert flagged == {("Release", "writes"), ("Admit", "table"), ("SendPage", "table"),
                       ("Accept", "sent")}


def test_a_guard_that_reads_a_ghost_is_flagged():
    text = SPEC_PATH.read_text()
    old = "    /\\ dst' = [dst EXCEPT ![r] = \"Released\"]"
    assert text.count(old) == 1
    mutant = text.replace(old, "    /\\ r \\notin leaked\n" + old)
    assert locality.violations(mutant) == [
        "Release (decode) reads leaked: leaked is a ghost (history for the properties)"]


def test_a_message_read_by_its_sender_is_flagged():
    """A wire variable is readable only by its receiver: decode peeking at whether its own
    cancel is still in flight would be reading the network."""
    text = SPEC_PATH.read_text()
    old = "Timeout(r) ==\n    /\\ \"NoTimeout\" \\notin Bugs\n"
    assert text.count(old) == 1
    mutant = text.replace(old, old + "    /\\ ~cancel[r]\n")
    assert locality.violations(mutant) == [
        "Timeout (decode) reads cancel: cancel is a message decode -> prefill, not addressed "
        "to the decode"]


def test_the_release_guard_reads_decode_state_only():
    release = {row.action: row for row in locality.analyse()}["Release"]
    assert release.access.guard_reads == {"dst", "dfw", "landed", "announced"}
    assert release.access.writes == {"dst", "owner"}


def test_every_variable_has_one_owner_and_the_spec_says_the_same():
    assert set(locality.OWNERS) == set(VARIABLES)
    assert set(locality.WIRE) == {v for v, o in locality.OWNERS.items() if o == "wire"}
    declared = SPEC_PATH.read_text().split("VARIABLES\n", 1)[1].split("\n\n", 1)[0]
    said = dict(re.findall(r"^\s+(\w+),?\s*\\\* (\w+)", declared, re.M))
    assert said == locality.OWNERS


def test_every_checked_action_is_a_workers_protocol_step():
    rows = {row.action: row for row in locality.analyse()}
    assert set(rows) == set(core.ACTION_NAMES)
    unchecked = {name for name, row in rows.items() if not row.checked}
    assert unchecked == {"Arrive", "Abort", "PrefillFail", "PrefillCrash", "DecodeCrash",
                         "LandWrite", "LoseBootstrap", "LoseFinalWord", "LoseCancel",
                         "LoseWrite"}


def test_the_readme_tables_are_generated_from_the_spec():
    assert locality.readme_section() == locality.render()


@pytest.mark.parametrize("base, bugs", [
    ("solo-crash", frozenset()), ("solo-decode-crash", frozenset()),
    ("small", ALL_BUGS - {"EagerRelease", "EarlyDone", "NoLandedCount"})])
def test_the_new_release_guard_agrees_with_the_old_one_wherever_decode_closes(base, bugs):
    """Decode's count (as many landed writes as the final word announced) holds exactly
    where the old guard (no write into r's pages in flight) held: the change moved what
    the guard reads, not when Release may fire. Every reachable state, crashes included;
    the rest of the switches on too, but EagerRelease, which drops the guard, and EarlyDone
    and NoLandedCount, where the two differ by design (tests below)."""
    m = Model(bugs=bugs, **BASES[base])
    init = core.initial_state(m)
    seen, queue, compared = {init}, deque([init]), 0
    while queue:
        s = queue.popleft()
        for r, row in enumerate(s.requests):
            if row[core.DST] == core.CLOSING and row[core.DFW]:
                old = all(s.decode_pool[w[2]][core.OWNER] != r for w in s.writes)
                assert old == (row[core.LANDED] >= row[core.ANNOUNCED]), (s, r)
                compared += 1
        for _, t in core.successors(m, s):
            if t not in seen:
                seen.add(t)
                queue.append(t)
    assert compared > 200


def test_the_cores_actions_break_no_locality_either():
    """Conformance cannot tell the prefill's copy of the page table from decode's own (they
    are equal in every reachable state), so the core's source is read too."""
    assert locality.core_violations() == []


def test_a_core_that_reads_the_other_workers_fields_is_flagged():
    source = locality.CORE_PATH.read_text()
    old_send = "table = row[PTABLE]  # the prefill's copy, received from decode"
    old_accept = 'if "NoCountCheck" not in m.bugs and row[FW_COUNT] != len(row[TABLE]):'
    old_release = "        if not _counted(m, row, row[ANNOUNCED]):\n"
    for old in (old_send, old_accept, old_release):
        assert source.count(old) == 1
    mutant = (source.replace(old_send, "table = row[TABLE]")
              .replace(old_accept, 'if "NoCountCheck" not in m.bugs and row[SENT] != '
                                   'len(row[TABLE]):')
              .replace(old_release, "        if _writes_of(s, r):\n"))
    assert locality.core_violations(mutant) == [
        "SendPage (prefill) reads table: table is the decode's",
        "Accept (decode) reads sent: sent is the prefill's",
        "Release (decode) reads writes: writes is the prefill's"]


# -- does decode's count matter? -----------------------------------------------------------
# In the protocol the count never decides anything (the final word follows the completion of
# every write: test above). It is the backstop for a prefill that sends its final word while
# writes are still on the wire (EarlyDone); NoLandedCount is the decode that does not count.
# Only the two together break anything (the zoo entry early-done).

@pytest.mark.parametrize("bugs, breaks", [
    ({"EarlyDone"}, None), ({"NoLandedCount"}, None),
    ({"EarlyDone", "NoLandedCount"}, ("NoWriteIntoForeign", 7)),
], ids=["early-done", "release-without-count", "both"])
def test_decodes_count_of_landed_writes_is_what_stops_an_early_final_word(bugs, breaks):
    from spec.check.checker import check

    result = check(Model(bugs=bugs, **BASES["solo"]), invariants=(
        "NoWriteIntoForeign", "Isolation", "OkIsClean", "SourceHeld"), liveness=False)
    found = result.violation and (result.violation.property, result.violation.length)
    assert found == breaks


def test_an_early_final_word_alone_keeps_every_property_without_crashes():
    """Behind decode's count an early Done is harmless where no write is lost: decode
    verifies only what has landed (else the early Done fails its own transfer on the
    checksums, FittingRequestsSucceed), and the prefill keeps the sources its writes still
    read (else the early Done is SourceReuse, SourceHeld)."""
    from spec.check.checker import check

    result = check(Model(bugs={"EarlyDone"}, **BASES["solo"]))
    assert result.ok, result.violation
    assert result.distinct_states == 1143


def test_without_an_early_final_word_the_count_changes_no_state_graph():
    """With NoLandedCount alone the state graph is the correct protocol's: the count never
    decides where the final word follows the writes. EarlyDone is what makes it matter."""
    from spec.check.checker import check

    def states(bugs):
        return check(Model(bugs=bugs, **BASES["solo"]), invariants=(),
                     liveness=False).distinct_states
    assert states(set()) == states({"NoLandedCount"}) == 963
    assert states({"EarlyDone"}) == 1143


def test_a_timer_rests_on_its_timing_assumption_and_nothing_else_may():
    """Timeout's LeaseLapsed reads the prefill's state: that is the environment's synchrony
    assumption (a working prefill renews decode's lease), not decode's read. Inlined into
    Timeout it is flagged as decode reading the prefill's state; used by a protocol action
    it is flagged as an assumption only a timer may rest on."""
    text = SPEC_PATH.read_text()
    assert "    /\\ LeaseLapsed(r)\n" in text
    inlined = text.replace("    /\\ LeaseLapsed(r)\n", "    /\\ PrefillSilent(r)\n")
    assert locality.violations(inlined) == [
        "Timeout (decode) reads pst: pst is the prefill's",
        "Timeout (decode) reads writes: writes is the prefill's"]
    old = "    /\\ dst' = [dst EXCEPT ![r] = \"Released\"]"
    misused = text.replace(old, "    /\\ LeaseLapsed(r)\n" + old)
    assert locality.violations(misused) == [
        "Release (decode) uses the timing assumption LeaseLapsed, which only a timer may "
        "rest on"]
    assert "lease_lapsed" in locality.CORE_ASSUMPTIONS
    assert "pst" not in locality.core_reads()["Timeout"]
