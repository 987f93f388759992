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
    old = "Release(r) ==\n    /\\ dst[r] = \"Closing\"\n"
    assert text.count(old) == 1
    mutant = text.replace(old, old + "    /\\ r \\notin leaked\n")
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
    # With a prefix cache the release also drops the request's references (readers) and,
    # with NoRefCount, the cache entries (ident): decode's own pool.
    assert release.access.writes == {"dst", "owner", "readers", "ident"}


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
    old_accept = ('if "NoCountCheck" not in m.bugs and row[FW_COUNT] != len(row[TABLE]) - '
                  'row[HIT]:')
    old_release = "        if not _counted(m, row, row[ANNOUNCED]):\n"
    for old in (old_send, old_accept, old_release):
        assert source.count(old) == 1
    mutant = (source.replace(old_send, "table = row[TABLE]")
              .replace(old_accept, 'if "NoCountCheck" not in m.bugs and row[SENT] != '
                                   'len(row[TABLE]) - row[HIT]:')
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


# -- per worker (issue 25): each worker's own pool, each request's own row -----------------

def test_every_pool_a_checked_action_indexes_is_its_own_workers():
    """The actions that touch a pool index it by their request's worker and nothing else;
    the others touch no pool (Finish reads the pages only for the ghost's history)."""
    rows = {row.action: row for row in locality.analyse() if row.checked}
    pools = {name: row.pools_at for name, row in rows.items() if row.pools_at}
    assert pools == {"Admit": ("pworker[r]",), "SendPage": ("pworker[r]",),
                     "SendDone": ("pworker[r]",), "PrefillAbort": ("pworker[r]",),
                     "Reserve": ("dworker[r]",), "Release": ("dworker[r]",),
                     "RevokeRelease": ("dworker[r]",),
                     # Sealing the pages of an accepted transfer (prefix cache).
                     "Accept": ("dworker[r]",),
                     # A worker's own action names its worker by its parameter.
                     "Evict": ("d",), "PrefillEvict": ("q",)}


def _mutant(old: str, new: str) -> str:
    text = SPEC_PATH.read_text()
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_a_decode_guard_that_reads_another_decode_workers_pool_is_flagged():
    """Reserve waiting until the other decode worker has room too reads owner[e] for an e
    that is not dworker[r]: flagged at Reserve and owner, and nowhere else (the owner rule
    alone passes it: owner is decode's)."""
    guard = "    /\\ S \\subseteq FreeDecode(dworker[r])\n"
    mutant = _mutant(guard, guard + "    /\\ FreeDecode(CHOOSE e \\in DecodeWorkers : "
                                     "e # dworker[r]) # {}\n")
    assert locality.violations(mutant) == [
        "Reserve (decode) reads owner[CHOOSE e \\in DecodeWorkers : e # dworker[r]]: not its "
        "own decode worker's pool owner[dworker[r]]",
        "Reserve (decode) reads readers[CHOOSE e \\in DecodeWorkers : e # dworker[r]]: not its "
        "own decode worker's pool readers[dworker[r]]"]


def test_a_prefill_that_writes_another_prefill_workers_pool_is_flagged():
    old = "    /\\ powner' = [powner EXCEPT ![pworker[r]] = [p \\in PPages |-> IF p \\in S"
    mutant = _mutant(old, old.replace("![pworker[r]]",
                                      "![CHOOSE e \\in PrefillWorkers : e # pworker[r]]"))
    assert locality.violations(mutant) == [
        "Admit (prefill) writes powner[CHOOSE e \\in PrefillWorkers : e # pworker[r]]: not "
        "its own prefill worker's pool powner[pworker[r]]"]


@pytest.mark.parametrize("old, new, expected", [
    ("       \\/ dfw[r] /\\ Counted(r, announced[r])\n",
     "       \\/ dfw[r] /\\ Counted(r, announced[r])"
     " /\\ \\A e \\in DecodeWorkers : owner[e][1] # r\n",
     "Release (decode) reads owner[<e>]: not its own decode worker's pool owner[dworker[r]]"),
    ("Timeout(r) ==\n    /\\ \"NoTimeout\" \\notin Bugs\n",
     "Timeout(r) ==\n    /\\ \"NoTimeout\" \\notin Bugs\n"
     "    /\\ \\A x \\in Requests : dst[x] # \"Decoding\"\n",
     "Timeout (decode) reads dst[<x>]: another request's row, not its own dst[r]"),
    ("PrefillCanStop(r) == pst[r] \\in {\"Queued\", \"Running\"} /\\ WritesOf(r) = {}",
     "PrefillCanStop(r) == pst[r] \\in {\"Queued\", \"Running\"} /\\ writes = {}",
     "PrefillAbort (prefill) reads writes unfiltered: every prefill worker's send queue, "
     "not only its own (filter by w.req = r or pworker[w.req] = pworker[r])"),
    ("    /\\ pst' = [pst EXCEPT ![r] = \"Running\"]\n",
     "    /\\ pst' = [pst EXCEPT ![r] = \"Running\"]\n"
     "    /\\ dworker' = [dworker EXCEPT ![r] = NoWorker]\n",
     "Admit (prefill) writes dworker: a request's worker is the router's choice, fixed at "
     "Arrive, and the rule names the worker by it"),
], ids=["every-decode-workers-pool", "another-requests-row", "unfiltered-send-queue",
        "re-placed-request"])
def test_each_way_out_of_a_workers_own_state_is_flagged(old, new, expected):
    assert locality.violations(_mutant(old, new)) == [expected]


def _reachable(m: Model) -> set:
    init = core.initial_state(m)
    seen, queue = {init}, deque([init])
    while queue:
        for _, t in core.successors(m, queue.popleft()):
            if t not in seen:
                seen.add(t)
                queue.append(t)
    return seen


def test_the_cores_actions_touch_only_their_own_workers_pages():
    """Every checked action in every reachable state of workers-2x2 (10,566 states): the
    pages it reads, changes or posts a write to lie in its request's workers' ranges."""
    m = Model(name="workers-2x2", **BASES["workers-2x2"])
    states = _reachable(m)
    assert len(states) == 10566
    assert locality.core_pool_violations(m, states) == []


def test_a_core_that_scans_every_workers_pool_is_flagged(monkeypatch):
    """A Release that looks for the request's pages in the whole pool instead of its table
    frees the same pages (conformance cannot tell), but reads every decode worker's pool."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(core._released))  # Release's freeing
    old = "    for page, _ in row[TABLE]:\n"
    assert source.count(old) == 1
    namespace = dict(vars(core))
    exec(source.replace(old, "    for page in range(len(pool)):\n"), namespace)
    monkeypatch.setattr(core, "_released", namespace["_released"])
    m = Model(name="workers-2x2", **BASES["workers-2x2"])
    assert locality.core_pool_violations(m, _reachable(m)) == [
        "Release (decode) reads or changes pages of another decode worker"]
