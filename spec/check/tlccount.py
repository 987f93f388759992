"""TLC's "states generated", counted from the core's successors.

TLC counts the initial states plus every successor its next-state enumeration produces from
every state it explores, duplicates included. That enumeration branches on each \\/ and \\E
it meets in an action while variables are still unassigned, guards without primes too, and
carries on with the rest of the action once per branch that holds; IF and CASE take one
branch. So where such a guard holds in k ways, TLC generates the same successor k times,
and the core, which yields each event once, counts it once. The guards of KVTransfer.tla
that can hold in more than one way:

    PrefillAbort(r)  cancel[r] \\/ client[r] = "Gone"
    Admit(r, S)      ptable[r] # <<>> \\/ "AdmitBeforeReserve" \\in Bugs, then
                     prompt[r] <= PrefillPages \\/ "FinishedNotRejected" \\in Bugs
    Release(r)       \\/ "EagerRelease" \\in Bugs  \\/ dfw[r] /\\ Counted(r, announced[r])
    Arrive(r,n,q,d)  \\E q \\in PrefillWorkers : \\E d \\in DecodeWorkers in Next, where a
                     prompt the router refuses is placed nowhere: the same successor
                     once per placement
    PrefillCrash(q)  \\E r \\in Requests : pworker[r] = q /\\ PrefillLoses(r)
    DecodeCrash(d)   \\E r \\in Requests : dworker[r] = d /\\ Loses(r), which is DecodeKnows(r), that is
                     boot[r] \\/ HoldsPages(r), or for a bootstrap NoEpochCheck revives a
                     disjunction of three (see Loses)

WAYS gives, per action, the number of ways its guard holds in a state where the event is
enabled. On default.cfg as it was before the bootstrap queue (Admit waits for the page
table), the core had 2,357,446 transitions (kvproof reported them plus the initial state,
2,357,447, as generated); TLC reported 2,385,281: the 27,834 extra were PrefillAbort steps
with both a cancel and a client abort. That TLC run is the one real TLC figure we have. tests/test_tlc_count.py
derives the same figures from the spec's text (the evaluator, compiled to branch as TLC
does), so a new guard of this shape in the spec that is missing here fails a test instead
of skewing the count.
"""

from __future__ import annotations

from typing import Callable

from spec import core
from spec.core import Event, State
from spec.model import Model

_HOLDS_PAGES = (core.D_WAITING, core.DECODING, core.CLOSING)


def _prefill_abort(m: Model, s: State, event) -> int:
    row = s.requests[event.request]
    return bool(row[core.CANCEL]) + (row[core.CLIENT] == core.GONE)


def _admit(m: Model, s: State, event) -> int:
    """Two disjunctive guards, one after the other: the ways multiply."""
    row = s.requests[event.request]
    table = bool(row[core.PTABLE]) + ("AdmitBeforeReserve" in m.bugs)
    return table * ((row[core.PROMPT] <= m.prefill_pages) + ("FinishedNotRejected" in m.bugs))


def _release(m: Model, s: State, event) -> int:
    row = s.requests[event.request]
    counted = "NoLandedCount" in m.bugs or row[core.LANDED] >= row[core.ANNOUNCED]
    settled = row[core.DFW] and counted
    return ("EagerRelease" in m.bugs) + bool(settled)


def _arrive(m: Model, s: State, event) -> int:
    """A refused prompt is placed nowhere: every placement gives the same successor."""
    if event.prompt_pages > m.advertised_context_pages:
        return m.prefill_workers * m.decode_workers
    return 1


def _prefill_crash(m: Model, s: State, event) -> int:
    """PrefillLoses(r) of the worker's requests: active, or else a write of r in flight (an
    early final word)."""
    writing = {w[0] for w in s.writes}
    return sum(row[core.PW] == event.worker
               and (row[core.PST] in (core.QUEUED, core.RUNNING) or r in writing)
               for r, row in enumerate(s.requests))


def _decode_crash(m: Model, s: State, event) -> int:
    return sum(_decode_crash_ways(m, row) for row in s.requests if row[core.DW] == event.worker)


def _decode_crash_ways(m: Model, row: tuple) -> int:
    """Loses(r): a revived bootstrap (NoEpochCheck) loses its tombstone, the prefill's
    connection or the client's wait; any other request what decode knew of it."""
    if "NoEpochCheck" in m.bugs and row[core.BOOT]:
        active = row[core.PST] in (core.QUEUED, core.RUNNING)
        return ((row[core.DST] == core.TOMB) + (active and not row[core.CANCEL])
                + (row[core.CLIENT] == core.WAITING))
    return bool(row[core.BOOT]) + (row[core.DST] in _HOLDS_PAGES)


WAYS: dict[str, Callable[[Model, State, Event], int]] = {
    "Arrive": _arrive, "PrefillAbort": _prefill_abort, "Admit": _admit, "Release": _release,
    "PrefillCrash": _prefill_crash, "DecodeCrash": _decode_crash,
}
