"""The properties of KVTransfer.tla as Python predicates, with the TLA+ names.

State invariants hold in every reachable state. Rest invariants hold in every state where
no fair action is enabled ("at rest"): only the environment (a new arrival, a client abort,
a prefill fault) could move the system on. Because every action makes progress that is never
undone (requests arrive once; messages and writes are consumed), the state graph has no
cycles; the checker verifies that, and then the rest invariants give the same verdict as the
liveness properties EveryRequestEnds and PagesComeBack under weak fairness of the protocol's
actions, at a fraction of the cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from spec.core import (
    ANNOUNCED, DW, FW_COUNT, IDENT, KV, LANDED, NO_IDENT, PTABLE, PW, READERS, SALT,
    PCACHED, P_READERS, source_ident,
    BOOT, CANCEL, CLIENT, CLOSING, DECODING, DST, D_WAITING, ERR_DECODE, ERR_PREFILL, ERR_TAG,
    ERR_TIMEOUT, ERR_TRANSFER, FW, GEN, GONE, IDLE, LEAKED, NONE, NO_MSG, OK, OWNER, PROMPT, PST, QUEUED, RELEASED, RUNNING, SENT, SRC,
    TABLE, TOMB, WAITING, State, bootstrap_resend_due, cancel_resend_due, loss_recovery_due,
)
from spec.model import Model

Predicate = Callable[[Model, State], bool]


@dataclass(frozen=True)
class Violation:
    """A property or an oracle that does not hold: the one violation type of every layer
    (the checker's counterexamples, the store's and the simulator's oracles, the fuzzer)."""

    property: str           # a name of this module, or an oracle's name
    detail: str = ""        # what was seen, in a sentence
    request: int = NONE     # the request it concerns, if one
    kind: str = "invariant"  # invariant, rest, deadlock, cycle (the checker) or oracle
    trace: list = field(default_factory=list, compare=False)  # the checker's (event, state) steps
    cycle_start: int = -1   # for a cycle: the index in trace where the loop begins

    @property
    def length(self) -> int:
        """Number of steps (events) in the counterexample."""
        return len(self.trace) - 1

    def as_dict(self) -> dict:
        return {"property": self.property, "detail": self.detail, "request": self.request}

    def __str__(self) -> str:
        return f"{self.property}: {self.detail}" if self.detail else self.property


def TypeOK(m: Model, s: State) -> bool:
    """Every variable holds a value of its type (the shape of the tuples is fixed by core)."""
    n = m.requests
    for row in s.requests:
        if not (0 <= row[PROMPT] <= m.max_prompt_pages and 0 <= row[SENT] <= m.max_prompt_pages
                and len(row[SRC]) <= m.prefill_pages and len(row[TABLE]) <= m.decode_pages
                and len(row[PTABLE]) <= m.decode_pages
                and 0 <= row[FW_COUNT] <= m.max_prompt_pages
                and 0 <= row[ANNOUNCED] <= m.max_prompt_pages and row[LANDED] >= 0
                and -1 <= row[PW] < m.prefill_workers and -1 <= row[DW] < m.decode_workers):
            return False
    for owner, gen, data, tag, *_ in s.decode_pool:
        if not (-1 <= owner < n and gen >= 0 and -1 <= data < n):
            return False
    for owner, data, readers, _ in s.prefill_pool:
        if not (-1 <= owner < n and -1 <= data < n and all(0 <= x < n for x in readers)):
            return False
    if any(not 0 <= row[PCACHED] <= m.max_prompt_pages for row in s.requests):
        return False
    return all(0 <= r < n and 0 <= src < m.prefill_pages * m.prefill_workers
               and 0 <= dst < m.decode_pages * m.decode_workers
               for r, src, dst, _ in s.writes)


def Isolation(m: Model, s: State) -> bool:
    """Whatever a decoding request read was its own data at the page's current generation."""
    return not any(row[LEAKED] for row in s.requests)


def OkIsClean(m: Model, s: State) -> bool:
    """A client gets success only if everything its request read was its own."""
    return not any(row[CLIENT] == OK and row[LEAKED] for row in s.requests)


def holds_decode_pages(row: tuple) -> bool:
    d = row[DST]
    return d == D_WAITING or d == DECODING or d == CLOSING


def ExclusiveOwner(m: Model, s: State) -> bool:
    """Every owned page is owned by exactly the request whose table holds it at that gen."""
    pool = s.decode_pool
    rows = s.requests
    for p, page in enumerate(pool):
        r = page[OWNER]
        if r == NONE:
            continue
        row = rows[r]
        if not holds_decode_pages(row) or (p, page[GEN]) not in row[TABLE]:
            return False
    for r, row in enumerate(rows):
        if holds_decode_pages(row):
            for p, gen in row[TABLE]:  # its own page, or a cached page it reads
                if (pool[p][OWNER] != r and r not in pool[p][READERS]) or pool[p][GEN] != gen:
                    return False
    for p, (r, _, _, _) in enumerate(s.prefill_pool):
        if r == NONE:
            continue
        # A stopped request keeps a source only while a write of it still reads the page.
        reading = any(w[0] == r and w[1] == p for w in s.writes)
        if (rows[r][PST] != RUNNING and not reading) or p not in rows[r][SRC]:
            return False
    return True


def NoWriteIntoForeign(m: Model, s: State) -> bool:
    """No in-flight write targets a page that changed owner or generation since it was posted."""
    pool = s.decode_pool
    for r, _, page, tag in s.writes:
        if pool[page][OWNER] != r or pool[page][GEN] != tag:
            return False
    return True


def SaltsApart(m: Model, s: State) -> bool:
    """A page is shared only within a salt: every reader of a page has the salt of the KV its
    memory holds (prefix caching; nothing is read shared without it)."""
    rows = s.requests
    for page in s.decode_pool:
        for r in page[READERS]:
            if page[KV] == NO_IDENT or page[KV][0] != rows[r][SALT]:
                return False
    for p, page in enumerate(s.prefill_pool):  # the prefill-side cache's too
        if page[P_READERS]:
            ident = source_ident(s, p)
            if ident == NO_IDENT or any(ident[0] != rows[r][SALT] for r in page[P_READERS]):
                return False
    return True


def ReadersAreLive(m: Model, s: State) -> bool:
    """A page's readers are exactly its live readers: the requests holding pages at its
    worker whose table has it and that do not own it. Never fewer (a release would free it
    under a reader), never more (a reference nobody drops pins the page for ever)."""
    pool = s.decode_pool
    live = {}
    for r, row in enumerate(s.requests):
        if holds_decode_pages(row):
            for p, _ in row[TABLE]:
                if pool[p][OWNER] != r:
                    live.setdefault(p, set()).add(r)
    if not all(set(page[READERS]) == live.get(p, set()) for p, page in enumerate(pool)):
        return False
    # The prefill side: a cached source's readers are the running requests that hit it
    # at Admit (the first PCACHED of their sources).
    live = {}
    for r, row in enumerate(s.requests):
        if row[PST] == RUNNING:
            for p in row[SRC][:row[PCACHED]]:
                live.setdefault(p, set()).add(r)
    return all(set(page[P_READERS]) == live.get(p, set())
               for p, page in enumerate(s.prefill_pool))


def SealedIsQuiet(m: Model, s: State) -> bool:
    """A page with readers is sealed, and a sealed page has no owner and no write on its way
    into it: nothing frees or evicts a page that is read or written."""
    pool = s.decode_pool
    for page in pool:
        if page[READERS] and page[IDENT] == NO_IDENT:
            return False
        if page[IDENT] != NO_IDENT and page[OWNER] != NONE:
            return False
    for owner, _, readers, ident in s.prefill_pool:  # and the prefill's cached sources
        if readers and ident == NO_IDENT or ident != NO_IDENT and owner != NONE:
            return False
    return all(pool[dst][IDENT] == NO_IDENT for _, _, dst, _ in s.writes)


def SourceHeld(m: Model, s: State) -> bool:
    """A source page that an in-flight write still reads belongs to that write's request,
    or (a prefill-side cache) is a cached page, still sealed, that the request reads."""
    pool = s.prefill_pool
    for r, src, _, _ in s.writes:
        owner, _, readers, ident = pool[src]
        if owner != r and not (r in readers and ident != NO_IDENT):
            return False
    return True


def RejectedIsError(m: Model, s: State) -> bool:
    """A prompt longer than a pool never decodes and never gets success."""
    limit = min(m.prefill_pages, m.decode_pages)
    for row in s.requests:
        if row[PROMPT] > limit and (row[CLIENT] == OK or row[DST] == DECODING):
            return False
    return True


def NoGuardTripWithoutFault(m: Model, s: State) -> bool:
    """With every guard in place and no data-corrupting fault (the spec has none), the count
    check, the checksums and the tag check never fire: they are backstops. Where the network
    may lose a write silently, the write timer fails the transfer on the count (ErrTransfer)."""
    if m.bugs:
        return True
    transfer_trips = "Write" not in m.losses
    return not any(row[CLIENT] == ERR_TAG or transfer_trips and row[CLIENT] == ERR_TRANSFER
                   for row in s.requests)


def NoResendWithoutLoss(m: Model, s: State) -> bool:
    """With every guard in place, a resend is due only where the network may lose what it
    sends again: the resends' timing assumption (the message and its answer off the wire)
    holds only after a loss. A decode that forgot a final word it heard would look like one
    (tests/test_fuzz.py's notice-forgets-final-word), and retransmission would hide it."""
    if m.bugs:
        return True
    bootstrap_lost = "Bootstrap" in m.losses
    cancel_lost = "Cancel" in m.losses or "FinalWord" in m.losses
    if bootstrap_lost and cancel_lost:
        return True
    for row in s.requests:
        if not bootstrap_lost and bootstrap_resend_due(row):
            return False
        if not cancel_lost and cancel_resend_due(row):
            return False
    return True


def NoLeakAtRest(m: Model, s: State) -> bool:
    """At rest every page of both pools is free and no write is in flight."""
    return (not s.writes
            and all(page[OWNER] == NONE for page in s.decode_pool)
            and all(page[0] == NONE for page in s.prefill_pool))


def request_ended(row: tuple) -> bool:
    """The request has ended on the client, prefill and decode, with nothing in flight (or
    never arrived). No event of an ended request that arrived is ever enabled again, which
    the fuzzer relies on to skip it (tests/test_fuzz.py checks that against the core)."""
    if row[CLIENT] == WAITING or row[PST] == QUEUED or row[PST] == RUNNING:
        return False
    return not (holds_decode_pages(row) or row[BOOT] or row[FW] != NO_MSG or row[CANCEL])


def NoStuckRequest(m: Model, s: State) -> bool:
    """At rest every request that arrived has ended on the client, prefill and decode."""
    return all(request_ended(row) for row in s.requests)


_FAULT_OUTCOMES = (GONE, ERR_PREFILL, ERR_DECODE, ERR_TIMEOUT)
# With timely timers (EarlyTimeouts = FALSE) a timeout is no fault's outcome.
_FAULT_OUTCOMES_TIMELY = (GONE, ERR_PREFILL, ERR_DECODE)


def FittingRequestsSucceed(m: Model, s: State) -> bool:
    """Checked where nothing but a transfer timer could move the protocol on ("quiet"):
    every request whose prompt fits that no fault ended (a client abort, a prefill failure
    or crash, a decode crash, a timeout) has its Ok. Something has to succeed: a protocol
    whose prefill never said Done leaves its requests waiting for their timers here. The
    excuse: a timer that is the designed recovery from a fault (decode learns of a prefill
    crash by timing out; the crashed request's pages may hold others back until then; a
    message the network lost is sent again by its resend timer, or, for a final word lost
    while decode waits, decode's timeout has it repeated)."""
    fits = min(m.advertised_context_pages, m.prefill_pages, m.decode_pages)
    faults = _FAULT_OUTCOMES if m.early_timeouts else _FAULT_OUTCOMES_TIMELY
    if "Write" in m.losses:  # a transfer the write timer failed: the lost write's outcome
        faults = faults + (ERR_TRANSFER,)
    for row in s.requests:  # a timer that recovers from a fault is the one excuse
        if row[CLIENT] in faults and row[DST] == D_WAITING:
            return True
    if any(loss_recovery_due(m, s, r) for r in range(len(s.requests))):
        return True
    for row in s.requests:
        client = row[CLIENT]
        if client != IDLE and client != OK and client not in faults \
                and row[PROMPT] <= fits:
            return False
    return True


STATE_INVARIANTS: dict[str, Predicate] = {
    "TypeOK": TypeOK,
    "Isolation": Isolation,
    "OkIsClean": OkIsClean,
    "ExclusiveOwner": ExclusiveOwner,
    "NoWriteIntoForeign": NoWriteIntoForeign,
    "SourceHeld": SourceHeld,
    "SaltsApart": SaltsApart,
    "ReadersAreLive": ReadersAreLive,
    "SealedIsQuiet": SealedIsQuiet,
    "RejectedIsError": RejectedIsError,
    "NoGuardTripWithoutFault": NoGuardTripWithoutFault,
    "NoResendWithoutLoss": NoResendWithoutLoss,
}
REST_INVARIANTS: dict[str, Predicate] = {
    "NoLeakAtRest": NoLeakAtRest,
    "NoStuckRequest": NoStuckRequest,
}
# Checked where no protocol step but a timer is enabled (a superset of the rest states).
QUIET_INVARIANTS: dict[str, Predicate] = {
    "FittingRequestsSucceed": FittingRequestsSucceed,
}
ALL_INVARIANTS = tuple(STATE_INVARIANTS) + tuple(REST_INVARIANTS) + tuple(QUIET_INVARIANTS)


# Step properties: predicates of a step from s to t ([][A]_vars in the spec). Each compares
# only what the step changed (rows and pools are shared between states when unchanged).
Step = Callable[[Model, State, State], bool]


def _changed_rows(s: State, t: State):
    if s.requests is t.requests:
        return ()
    return ((old, new) for old, new in zip(s.requests, t.requests) if old is not new)


def answer_changed(old: tuple, new: tuple) -> bool:
    return old[CLIENT] != new[CLIENT] and old[CLIENT] != IDLE and old[CLIENT] != WAITING


def closed_reopened(old: tuple, new: tuple) -> bool:
    return old[DST] in _CLOSED and (new[DST] == D_WAITING or new[DST] == DECODING)


def tombstone_revived(old: tuple, new: tuple) -> bool:
    return old[DST] == TOMB and new[DST] != TOMB


def AnswerNeverChanges(m: Model, s: State, t: State) -> bool:
    """Once a client has its answer (Ok, an error, or gone), it never changes."""
    return not any(answer_changed(old, new) for old, new in _changed_rows(s, t))


def ClosedNeverReopens(m: Model, s: State, t: State) -> bool:
    """A request decode has closed never waits for KV or decodes again."""
    return not any(closed_reopened(old, new) for old, new in _changed_rows(s, t))


def GenerationsNeverGoBack(m: Model, s: State, t: State) -> bool:
    """A page's generation never goes back: a tag once issued is never issued again."""
    if s.decode_pool is t.decode_pool:
        return True
    return all(b[GEN] >= a[GEN] for a, b in zip(s.decode_pool, t.decode_pool))


def TombstonesStay(m: Model, s: State, t: State) -> bool:
    """A tombstone is never revived."""
    return not any(tombstone_revived(old, new) for old, new in _changed_rows(s, t))


# The step properties about one request's row, for shells that check each commit.
ROW_STEP_PROPERTIES = {"AnswerNeverChanges": answer_changed,
                       "ClosedNeverReopens": closed_reopened,
                       "TombstonesStay": tombstone_revived}


def first_step_failure(s: State, t: State) -> str | None:
    """The first of STEP_PROPERTIES (in their order) the step from s to t breaks, or None:
    all four in one pass over what the step changed, for the checker's every edge."""
    if s.requests is not t.requests:
        for old, new in zip(s.requests, t.requests):
            if old is new:
                continue
            was = old[CLIENT]
            if was != new[CLIENT] and was != IDLE and was != WAITING:
                return "AnswerNeverChanges"
            was, now = old[DST], new[DST]
            if was != now and (was == CLOSING or was == RELEASED or was == TOMB):
                if now == D_WAITING or now == DECODING:
                    return "ClosedNeverReopens"
                if was == TOMB:
                    return "TombstonesStay"
    if s.decode_pool is not t.decode_pool:
        for a, b in zip(s.decode_pool, t.decode_pool):
            if b[GEN] < a[GEN]:
                return "GenerationsNeverGoBack"
    return None


_CLOSED = (CLOSING, RELEASED, TOMB)
STEP_PROPERTIES: dict[str, Step] = {
    "AnswerNeverChanges": AnswerNeverChanges,
    "ClosedNeverReopens": ClosedNeverReopens,
    "GenerationsNeverGoBack": GenerationsNeverGoBack,
    "TombstonesStay": TombstonesStay,
}
# The temporal properties of the spec, and the rest invariants that decide them here.
LIVENESS = {"EveryRequestEnds": "NoStuckRequest", "PagesComeBack": "NoLeakAtRest"}

# Every name a user can ask to check (`--property NAME`), in the order they are listed. The
# checker and the fuzzer both read this one list, so a listed name is never refused.
PROPERTY_NAMES = ALL_INVARIANTS + tuple(STEP_PROPERTIES) + tuple(LIVENESS)


def checked_by(names) -> tuple[str, ...]:
    """The invariants and step properties that check the named properties: each one itself,
    a liveness property the rest invariant that decides it (whoever explores a state graph
    also checks it for cycles). An unknown name is our caller's bug: it checks them first."""
    unknown = [n for n in names if n not in PROPERTY_NAMES]
    assert not unknown, f"not properties: {unknown}"
    return tuple(dict.fromkeys(LIVENESS.get(n, n) for n in names))
