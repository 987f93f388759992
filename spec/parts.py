"""The protocol state split by role: each worker holds only its part and learns the rest.

Theory of operation
-------------------
spec/tlaplus/locality.py proves, from the spec's text and the core's source, that every
action of a worker reads only its own variables, the messages addressed to it and the few
router facts spec/roles.py grants it. This module is that proof put to work: the state of a
cluster is held as one `Part` per role instance (the router; prefill worker q; decode worker
d), each holding only what spec/roles.py lets its role read, and each role's actions are
decided by the core (`core.change_for`) on a view of its own part alone.

What a part holds (`HELD`):
- its own row fields (`OWNERS`): the router's client, prompt and placement; the prefill's
  state, count, sources and its copy of the page table; decode's state, table, final word
  kept, and its counts of announced and landed writes;
- its inbox (the `WIRE` variables addressed to it): decode's bootstrap and final word with
  its count, the prefill's cancel. A wire variable is one slot per request in the spec, so
  the receiver's inbox slot is exactly the message in flight: the sender's write fills it,
  the receiver's action empties it, a loss empties it;
- copies of the router's facts its role is granted (`GRANTS`): the prompt and its own
  placement, which come with the request's first message (the queue entry, the bootstrap),
  and the client's state, which the serving edge tells it twice only: Waiting with that
  first message, Gone with the client-gone notice. A copy never learns another worker's
  answer: the edge keeps a client's first answer and drops the rest (`_answer`), which is
  why no guard needs more;
- its pool (a prefill's source pages, a decode's pages) and, for a prefill, its send queue.

Every other field of a row in a part's view is a sentinel that raises `LocalityBreach` the
moment an action compares, tests, counts or iterates it, and so is every page of another
worker's pool and, for anyone but a prefill, the send queue: a core action that reads what
its worker cannot know fails loudly, naming the action and the field. That is the run-time
twin of locality.py's static rule. Copying a sentinel is not a read (the core builds a new
row by slicing the old), but a sentinel that ends up in a field the part writes is.

What a decision writes is split by who holds each field (`Part.take` -> `Taken`): the
part's own fields and inbox, its pages and send queue change in place; a wire variable it
sends is a message to the receiver's inbox; a write into another role's variable is a
delivery named in spec/roles.py's DELIVERIES (the queue entry, the page table, an answer to
the client); the router's changes to a granted fact go to the workers granted it; the
ghost goes to the environment's record. Anything else is a LocalityBreach.

The timing assumptions (spec/roles.py ASSUMPTIONS: LeaseLapsed, BootstrapUnanswered,
CancelUnanswered, WritesGone) are the one place a part's view answers a read of another
role's state: a timer fires when its clock says so, and what the spec's helper states
about the other side in that time is the environment's synchrony assumption. The static
rule skips calls to these helpers; so does the sentinel, which answers from the
environment's state (the `Split`'s reassembly) while such a helper is on the call stack,
and raises when no environment is given. A process of issue 29 has its clock there.

Who takes which action (`taker`):
- the router: Arrive, ResendBootstrap, and Abort (the client goes away at the serving
  edge, which tells both workers);
- prefill worker q: its protocol actions on the requests placed on it, and PrefillCrash(q):
  a restart touches only q's own requests, pool and send queue, and the answers it owes go
  to the edge like any other (so it is checked like a protocol action);
- decode worker d: its protocol actions and timers on the requests placed on it;
- the environment (the `Split` itself, on the reassembled whole state, its Change written
  into every part that holds a field it touches): the network's physics and losses
  (LandWrite reads a prefill's source page and lands in a decode's memory; a loss empties an
  inbox or a send queue), DecodeCrash (a decode restarts, and every prefill with a
  connection to it sees the connection break: the cancel, the page table dropped, the
  writes into it failed) and PrefillFail (a fault, and its guard asks whether the client is
  still waiting, which the edge knows and the prefill's copy does not: the spec lets a
  prefill fail only while its client waits). Faults and the network are not checked by
  locality.py either.
- The ghost `leaked` is written by decode's Finish from its own pool and kept by the Split
  (no part reads it). Observed verdicts (Accept's checksums, Finish's tags) arrive in the
  event, as the data path measured them; the oracle that judges them is the environment's
  (core.observation_conflict on the reassembled state).

Commands (what each worker carries out; spec/commands.py). A part derives its worker's
commands from its own part alone (`commands.part_effects`: the one row derivation, run on
the fields it holds before and after, with each message it sent written in, and kept to
the commands `commands.carrier` gives its worker; the router's process is the serving edge
too): its own decision's come back in `Taken.commands`, and a message asks its receiver
for some (`receive`: a queue entry makes the prefill Queue, an answer makes the edge
Answer). tests/test_commands_parts.py shows, on every reachable edge of workers-2x2 and
lossy, that the parts' commands are the whole-row `effects`, each from the part of the
worker that carries it out, in its order, except one: a final word repeated by
AnswerCancel while the same word is still on the wire. The spec's one-slot wire absorbs it
(the Split reports it in `absorbed`), and `effects` asks for no Send; the prefill cannot
see decode's inbox, and sends (792 such edges of workers-2x2's 16,933, 138 of lossy's 6,046).

What each process observes of the environment's actions (`Split._environment`: the
change's rows as the part holds them, its pool and send queue, and the messages of its
role the action put on the wire; the commands follow from those like any others):
- LandWrite: decode d counts the landing (`landed`, the page's contents and tag); the
  prefill sees its write complete (it leaves the send queue; with EarlyDone its source
  page is freed: FreePages). No other command.
- LoseWrite: the prefill's false completion (the same as a landing, to it); decode sees
  nothing.
- LoseBootstrap, LoseFinalWord, LoseCancel: nobody observes a loss; the receiver's inbox
  slot is empty again (in a deployment the message simply never arrives).
- DecodeCrash(d): decode d restarts: its requests become tombstones, its pool free
  (CancelTimer or StopDecoding, FreePages); every prefill with a request on d sees its
  connection to d break: the page table dropped and, for a request it still runs, the
  crash's notice in its inbox (core.crash_notice). The Send(cancel) that notice is in the
  shells' commands is credited to the crashed decode, its carrier; in a deployment no
  process sends it (the transport reports the broken connection to the prefill). The edge
  answers the client ErrDecode (Answer).
- PrefillFail: the prefill fails the request: its final word to decode (Send), its pages
  (FreePages); the edge answers ErrPrefill unless it has answered already.

`Split` holds the router, P prefill and D decode parts, routes each event to its taker,
delivers the messages a decision sends (addressed by role and request: the network knows
the placement the router chose) and reassembles the whole core State (`whole`), which
tests/test_parts.py compares with the core's own after every step. After each step it
says which parts carry out which commands (`carried`), which parts the step reached
besides its taker (`reached`: what spec/partlog.py orders the logs by) and which messages
changed nothing at their receiver (`absorbed`).

Pure like the core: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import sys
from bisect import insort
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Callable, Iterable

from spec import core
from spec.commands import SENT_FIELDS, Command, freed_by, part_effects
from spec.core import (CLIENT, CLIENT_GONE, DW, EMPTY_ROW, GONE, NONE, PW, ROW_FIELDS, Change,
                       Refusal, State)
from spec.model import Model
from spec.roles import (CORE_ASSUMPTIONS, DECODE, DELIVERIES, GHOST, GRANT_CARRIERS, GRANTS,
                        OWNERS, PREFILL, ROUTER, WIRE, WIRE_MESSAGES, may_read, why_not)

ROLES = (ROUTER, PREFILL, DECODE)
# Role -> the row fields its part holds (own, inbox, granted copies), and those it holds as
# the one authority on them (own and inbox: what the whole state is reassembled from).
HELD = {role: frozenset(k for k, name in enumerate(ROW_FIELDS) if may_read(role, name))
        for role in ROLES}
AUTHORITY = {role: frozenset(k for k in HELD[role] if (role, ROW_FIELDS[k]) not in GRANTS)
             for role in ROLES}
GHOST_FIELDS = frozenset(k for k, name in enumerate(ROW_FIELDS) if OWNERS[name] == GHOST)
# Role -> the carriers (spec/commands.py `carrier`) whose commands its worker carries out:
# the router's process is the serving edge too.
CARRIES = {ROUTER: frozenset({"router", "client"}), PREFILL: frozenset({PREFILL}),
           DECODE: frozenset({DECODE})}
# The actions the environment takes (see the module's docstring for why each).
ENVIRONMENT = frozenset({info.event for info in core.ACTION_TABLE if info.worker == "network"}
                        | {core.PrefillFail, core.DecodeCrash})
_ASSUMPTION_CODE = frozenset(getattr(core, name).__code__ for name in CORE_ASSUMPTIONS)


def role_of(event: core.Event) -> str | None:
    """The role whose part takes `event`; None for the environment's."""
    kind = type(event)
    if kind in ENVIRONMENT:
        return None
    worker = core.INFO[kind].worker
    return ROUTER if worker == "client" else worker


class LocalityBreach(AssertionError):
    """A core action read or wrote what its worker cannot know: a bug in the protocol (the
    spec, the core and spec/roles.py must be fixed together), never a peer's bad input."""


def _in_assumption() -> bool:
    """Whether a timing assumption's helper of the core is on the call stack: the reads the
    static rule skips (locality.CORE_ASSUMPTIONS) are the environment's, not the worker's."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _ASSUMPTION_CODE:
            return True
        frame = frame.f_back
    return False


class _Foreign:
    """A value a part does not hold: any use of it (compare, test, count, iterate, hash,
    index with it) is a read of another role's state, and raises."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def _read(self, *_):
        raise LocalityBreach(f"reads {self.what}")

    def __repr__(self) -> str:
        return f"<not held: {self.what}>"


for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__",
              "__len__", "__iter__", "__hash__", "__index__", "__int__", "__add__", "__radd__",
              "__sub__", "__rsub__", "__getitem__", "__contains__"):
    setattr(_Foreign, _name, _Foreign._read)

# One sentinel per (role, field) and per kind of page, made once.
_FOREIGN_FIELD = {role: tuple(None if k in HELD[role] else
                              _Foreign(f"{name}: {why_not(role, name)}")
                              for k, name in enumerate(ROW_FIELDS)) for role in ROLES}


class _Row(tuple):
    """A row of a part's view: held fields as they are, sentinels elsewhere. A sentinel read
    by index raises at once, unless a timing assumption reads it (then the environment's
    value answers)."""

    def __getitem__(self, index):
        value = tuple.__getitem__(self, index)
        if type(value) is _Foreign:
            return self.view.assumed(value, lambda s: s.requests[self.request][index])
        return value


class _Rows(Mapping):
    """A view's rows by request, each made a `_Row` the first time a decision reads it: a
    decision reads a few rows, and a part may hold thousands (the router holds every request
    number of a deployment's life), so a view of all of them at every offer made a driver's
    settle cost grow with the square of the rows. Iterated in request order."""

    def __init__(self, view: "_View", rows: dict) -> None:
        self._view, self._rows, self._made = view, rows, {}

    def __getitem__(self, r: int) -> "_Row":
        row = self._made.get(r)
        if row is None:
            row = self._made[r] = _Row(self._rows[r])
            row.view, row.request = self._view, r
        return row

    def __contains__(self, r) -> bool:
        return r in self._rows

    def __iter__(self):
        return iter(sorted(self._rows))

    def __len__(self) -> int:
        return len(self._rows)


class _Pool(tuple):
    """A whole flat pool of the core, of which the part holds `own` (a range); every other
    page is another worker's."""

    def __getitem__(self, index):
        value = tuple.__getitem__(self, index)
        if type(value) is _Foreign:
            raise LocalityBreach(f"reads page {index % len(self)}: {value.what}")
        return value


class _ForeignWrites:
    """The send queue, seen by a part that is not a prefill: any read raises, unless a
    timing assumption reads it (WritesGone, PrefillSilent)."""

    def __init__(self, view: "_View") -> None:
        self.view = view

    def _truth(self) -> tuple:
        return self.view.assumed(_Foreign("writes: the prefills' send queues"),
                                 lambda s: s.writes)

    def __iter__(self):
        return iter(self._truth())

    def __len__(self) -> int:
        return len(self._truth())

    def __bool__(self) -> bool:
        return bool(self._truth())


class _View:
    """A core.View of one part: its rows (by request), the whole flat pools of which it
    holds its own worker's pages, and its send queue."""

    def __init__(self, part: "Part", environment: Callable[[], State] | None) -> None:
        self.environment = environment
        self.read_assumption = False  # a timing assumption answered from the environment
        self.requests = _Rows(self, part.rows)  # in request order, as the whole has them
        m = part.model
        self.prefill_pool = part.pool_view(PREFILL, m.prefill_pages, m.prefill_workers)
        self.decode_pool = part.pool_view(DECODE, m.decode_pages, m.decode_workers)
        self.writes = tuple(part.sending) if part.role == PREFILL else _ForeignWrites(self)

    def assumed(self, sentinel: _Foreign, read: Callable[[State], object]):
        if self.environment is None or not _in_assumption():
            sentinel._read()
        self.read_assumption = True
        return read(self.environment())

    def has_request(self, r: int) -> bool:
        return r in self.requests

    def request_items(self) -> Iterable[tuple[int, tuple]]:
        return self.requests.items()

    def pages_of(self, worker: int, pages: int) -> range:
        return range(worker * pages, (worker + 1) * pages)


@dataclass(frozen=True)
class Message:
    """Fields of request `request` that a decision sends to the part of role `to` (the
    network finds the worker from the request's placement), with the messages' names."""

    request: int
    to: str
    fields: tuple   # ((field index, value), ...)
    names: tuple    # e.g. ("bootstrap",), ("final word",), ("answer",)


@dataclass(frozen=True)
class Taken:
    """A part's decision: its own update (a core Change of its own fields, pages and send
    queue), the messages it sends and the commands its worker carries out."""

    event: core.Event
    own: Change
    messages: tuple
    commands: tuple = ()


class Part:
    """One role instance's share of the protocol state."""

    def __init__(self, m: Model, role: str, worker: int = 0) -> None:
        self.model, self.role, self.worker = m, role, worker
        self.blank = tuple(EMPTY_ROW[k] if k in HELD[role] else _FOREIGN_FIELD[role][k]
                           for k in range(len(ROW_FIELDS)))
        # The router knows every request from its arrival on; a worker from its first message.
        self.rows: dict[int, tuple] = ({r: self.blank for r in range(m.requests)}
                                       if role == ROUTER else {})
        fresh = {PREFILL: core.FRESH_PREFILL_PAGE, DECODE: core.FRESH_DECODE_PAGE}
        pages = {PREFILL: m.prefill_pages, DECODE: m.decode_pages}
        self.pool = [fresh[role]] * pages[role] if role in pages else []
        self.base = worker * len(self.pool)   # its first page in the core's flat pool
        self.sending: list[tuple] = []        # a prefill's send queue
        self.read_assumption = False          # its last decision rested on a timing assumption
        self._foreign_page = _Foreign(f"a page of another worker's pool, not "
                                      f"{self.name}'s own")

    @property
    def name(self) -> str:
        return self.role if self.role == ROUTER else f"{self.role} {self.worker}"

    def pool_view(self, kind: str, pages: int, workers: int) -> _Pool:
        if kind != self.role:
            return _Pool((self._foreign_page,) * (pages * workers))
        return _Pool((self._foreign_page,) * self.base + tuple(self.pool)
                     + (self._foreign_page,) * (pages * workers - self.base - pages))

    def owns_page(self, page: int) -> bool:
        return self.base <= page < self.base + len(self.pool)

    # -- deciding -----------------------------------------------------------------------

    def offers(self, r: int, pages_for: Callable[[int], tuple | None],
               verdict: bool = True) -> tuple[core.Event, ...]:
        """The events of its role's protocol actions for request r, in the core's table
        order (core.ACTION_TABLE): what a process offers its part whenever something may
        have changed; the core refuses those it does not enable. An allocation names the
        pages `pages_for(need)` picks once the core says how many it needs (none: not
        offered now); an observed action carries `verdict`, the data path's."""
        out = []
        for info in core.ACTION_TABLE:
            if info.worker != self.role or info.kind != "protocol":
                continue
            if info.argument == "pages":
                need = core.allocation_need(self.model, _View(self, None), info.event, r)
                pages = pages_for(need) if type(need) is int else None
                if pages is not None:
                    out.append(info.event(r, pages))
            elif info.observed is not None:
                out.append(info.event(r, verdict))
            else:
                out.append(info.event(r))
        return tuple(out)

    def take(self, event: core.Event,
             environment: Callable[[], State] | None = None) -> Taken | Refusal:
        """Decide one of this part's own actions on its own part, through the core; its
        update is applied here, the messages are returned for the network to deliver.
        `environment` answers only the timing assumptions (see the module's docstring)."""
        where = f"{event.action} ({self.name})"
        view = _View(self, environment)
        try:
            out = core.change_for(self.model, view, event)
        except LocalityBreach as breach:
            raise LocalityBreach(f"{where} {breach}") from None
        self.read_assumption = view.read_assumption
        if type(out) is Refusal:
            return out
        own, messages = self._split(where, out)
        before = {r: self.rows[r] for r, _ in own.rows}
        pool = self.pool_before()
        self.apply(own)
        sent: dict[int, dict] = {}
        for message in messages:
            for k, value in message.fields:
                if SENT_FIELDS.get(k) == self.role:
                    sent.setdefault(message.request, {})[k] = value
        rows = [(r, self.seen(before[r]), self.seen(row, sent.get(r))) for r, row in own.rows]
        return Taken(event, own, messages, self.commands(rows, pool, out, freed_by(out)))

    # -- its commands ---------------------------------------------------------------------

    def seen(self, row: tuple, sent: dict | None = None) -> tuple:
        """A row as this worker's command derivation reads it: the fields it holds, the
        messages it sent (`sent`: field -> value), and every other field as in EMPTY_ROW."""
        held = HELD[self.role]
        out = [row[k] if k in held else EMPTY_ROW[k] for k in range(len(ROW_FIELDS))]
        for k, value in (sent or {}).items():
            out[k] = value
        return tuple(out)

    def pool_before(self) -> dict:
        """Its own pages by their index in the core's flat pool (what FreePages compares)."""
        return {self.base + i: page for i, page in enumerate(self.pool)}

    def commands(self, rows: list, pool: dict, change: Change, by: int) -> tuple[Command, ...]:
        """The commands this worker carries out for a step that changed `rows` (request,
        old, new as `seen`), its pool (as it was: `pool`) by `change`'s pages, and posted
        `change`'s writes if it is the prefill that posts them."""
        pages = tuple(c for c in (change.prefill if self.role == PREFILL else change.decode)
                      if c[0] in pool) if self.role != ROUTER else ()
        posted = tuple(w for w in change.posted if w[1] in pool) \
            if self.role == PREFILL else ()
        return part_effects(CARRIES[self.role], rows, self.role, pool, pages, posted, by)

    def _split(self, where: str, change: Change) -> tuple[Change, tuple]:
        rows, messages = [], []
        for r, new in change.rows:
            own, sent = self._split_row(where, r, self.rows[r], new)
            rows.append((r, own))
            messages += sent
        self._check_pages(where, change)
        return change._replace(rows=tuple(rows), commands=()), tuple(messages)

    def _split_row(self, where: str, r: int, old: tuple, new: tuple) -> tuple[tuple, list]:
        """The row's own update, and one message per receiver of what it sends."""
        own, out = list(old), {}
        for k, value in enumerate(new):
            if value is old[k]:
                continue
            name = ROW_FIELDS[k]
            if type(value) is _Foreign:
                raise LocalityBreach(f"{where} copies into {name} {value.what}")
            if k in AUTHORITY[self.role]:
                if value != old[k]:
                    own[k] = value
                    self._grant(r, k, value, new, out)
            elif k not in HELD[self.role] or value != old[k]:
                to, message = self._route(where, name)
                out.setdefault(to, {})[k] = value
                out[to].setdefault("names", set()).add(message)
        return tuple(own), [Message(r, to, tuple((k, v) for k, v in sent.items()
                                                 if k != "names"), tuple(sorted(sent["names"])))
                            for to, sent in out.items()]

    def _route(self, where: str, name: str) -> tuple[str, str]:
        """Where a write into a field this part does not hold authority over goes."""
        if OWNERS[name] == GHOST:
            return GHOST, "history"
        if name in WIRE and WIRE[name][0] == self.role:
            return WIRE[name][1], WIRE_MESSAGES[name]
        if (self.role, name) in DELIVERIES:
            return OWNERS[name], DELIVERIES[(self.role, name)]
        raise LocalityBreach(f"{where} writes {name}: {why_not(self.role, name)}, and no "
                             "message carries it there")

    def _grant(self, r: int, k: int, value, row: tuple, out: dict) -> None:
        """The router's change of a fact granted to a worker goes to the worker it placed
        the request on: with the request's first message, and the client-gone notice."""
        for worker in (PREFILL, DECODE):
            placed = row[PW if worker == PREFILL else DW]
            if (worker, ROW_FIELDS[k]) in GRANTS and placed != NONE:
                out.setdefault(worker, {})[k] = value
                carrier = CLIENT_GONE if k == CLIENT and value == GONE else GRANT_CARRIERS[worker]
                out[worker].setdefault("names", set()).add(carrier)

    def _check_pages(self, where: str, change: Change) -> None:
        kinds = ((PREFILL, change.prefill), (DECODE, change.decode))
        for kind, pages in kinds:
            for page, value in pages:
                if kind != self.role or not self.owns_page(page):
                    raise LocalityBreach(f"{where} changes {kind} page {page}: not its own")
                if any(type(v) is _Foreign for v in value):
                    raise LocalityBreach(f"{where} copies into page {page} what it does "
                                         "not hold")
        if (change.posted or change.landed or change.flushed) and self.role != PREFILL:
            raise LocalityBreach(f"{where} changes the prefills' send queues")
        for w in change.posted:
            if not self.owns_page(w[1]):
                raise LocalityBreach(f"{where} posts a write from another worker's page")

    # -- changing ------------------------------------------------------------------------

    def apply(self, own: Change) -> None:
        """This part's own update (its decision's, or the environment's share)."""
        for r, row in own.rows:
            self.rows[r] = row
        pages = own.prefill if self.role == PREFILL else own.decode
        for page, value in pages:
            self.pool[page - self.base] = value
        if own.flushed:
            self.sending = [w for w in self.sending if w[0] not in own.flushed]
        for w in own.landed:
            self.sending.remove(w)
        for w in own.posted:
            insort(self.sending, w)

    def receive(self, message: Message) -> tuple[Command, ...]:
        """A message into this part's inbox or its copy of a fact (a worker hears of a
        request with its first message). The router keeps a client's first answer. The
        commands the message asks of this worker (the prefill queues a queue entry, the
        edge answers its client) come back."""
        old = row = self.rows.get(message.request, self.blank)
        for k, value in message.fields:
            if k == CLIENT and self.role == ROUTER:
                value = core._client_error(row, value)  # the edge's first-answer rule
            row = core._row(row, k, value)
        self.rows[message.request] = row
        return part_effects(CARRIES[self.role],
                            ((message.request, self.seen(old), self.seen(row)),))

    # -- the environment's actions as one process observes them (issue 29's processes) ----
    # A deployment has no whole state to decide LandWrite or DecodeCrash on: each process
    # applies its own share, the share `Split._environment` writes into its part, from what
    # its data path or its failure detector reports. The environment's step itself is
    # logged once, by whoever sequences it (engine/processes.py: the router's process).

    def land(self, write: tuple, data) -> None:
        """Decode's share of LandWrite: the write counted, the page's contents and tag (the
        source page's `data`, read by the sender's NIC)."""
        assert self.role == DECODE and self.owns_page(write[2]), f"{self.name} lands {write}"
        r, _, page, tag = write
        row = self.rows[r]
        self.rows[r] = core._row(row, core.LANDED, row[core.LANDED] + 1)
        owner, gen, _, _, readers, ident, kv, _ = self.pool[page - self.base]
        self.pool[page - self.base] = (owner, gen, data, tag, readers, ident, kv,
                                       core.written_ident(self.model, row, page))

    def completed(self, write: tuple) -> None:
        """The prefill's share of LandWrite: its write completed (with EarlyDone a landing
        may free a source page too, which this share does not model)."""
        assert self.role == PREFILL and "EarlyDone" not in self.model.bugs
        self.sending.remove(write)

    def decode_crashed(self, requests: Iterable[int]) -> None:
        """The router's or a prefill's share of DecodeCrash(d), for `requests`, those placed
        on d: the router answers a waiting client ErrDecode (the first answer stands); the
        prefill sees its connection break: the crash's notice (core.crash_notice) for a
        request it still runs, its copy of the page table dropped, its writes into d
        failed. A request a prefill has finished with keeps its table: the spec drops it
        only for a request decode still held, which the prefill cannot tell apart."""
        assert self.role in (ROUTER, PREFILL), f"{self.name} observes no decode crash"
        for r in requests:
            row = self.rows.get(r)
            if row is None:
                continue
            if self.role == ROUTER:
                self.rows[r] = core._row(row, CLIENT, core._client_error(row, core.ERR_DECODE))
            elif row[core.PST] in (core.QUEUED, core.RUNNING):
                self.rows[r] = core._row(row, core.PTABLE, (), core.CANCEL, 1)
        here = frozenset(requests)
        self.sending = [w for w in self.sending if w[0] not in here]

    def install(self, r: int, k: int, value) -> None:
        """The environment writes field k of r (a crash, the network)."""
        self.rows[r] = core._row(self.rows.get(r, self.blank), k, value)

    def copy(self) -> "Part":
        twin = object.__new__(Part)
        twin.__dict__.update(self.__dict__)
        twin.rows, twin.pool, twin.sending = dict(self.rows), list(self.pool), list(self.sending)
        return twin

    def snapshot(self) -> tuple:
        """Everything this part knows, comparable (its sentinels left out)."""
        rows = tuple(sorted((r, tuple(v for k, v in enumerate(row) if k in HELD[self.role]))
                            for r, row in self.rows.items()))
        return rows, tuple(self.pool), tuple(self.sending)


class Split:
    """The router, P prefill and D decode parts of one model, and the network between."""

    def __init__(self, m: Model) -> None:
        self.model = m
        self.router = Part(m, ROUTER)
        self.prefills = [Part(m, PREFILL, q) for q in range(m.prefill_workers)]
        self.decodes = [Part(m, DECODE, d) for d in range(m.decode_workers)]
        self.ghost: dict[int, dict[int, object]] = {}   # request -> ghost fields
        # What the last step did besides its state change (see `take`).
        self.carried: list[tuple[Part, tuple]] = []
        self.reached: list[Part] = []
        self.absorbed: list[Message] = []

    def parts(self) -> list[Part]:
        return [self.router, *self.prefills, *self.decodes]

    def placed(self, r: int, role: str) -> Part | None:
        """The part of `role` the router placed request r on (None: on none yet)."""
        if role == ROUTER:
            return self.router
        row = self.router.rows[r]
        worker = row[PW] if role == PREFILL else row[DW]
        if worker == NONE:
            return None
        return (self.prefills if role == PREFILL else self.decodes)[worker]

    def taker(self, event: core.Event) -> Part | str | None:
        """The part that takes `event`; None for the environment; a sentence when the
        request is placed on no worker of the role (nothing there can take it)."""
        role = role_of(event)
        if role is None:
            return None
        if type(event) is core.PrefillCrash:
            return self.prefills[event.worker]
        if type(event) in (core.Evict, core.PrefillEvict):  # prefix caching: not split by
            # role yet (issue 27)
            if self.model.prefix_cache:
                raise core.ProtocolMisuse("the split state has no prefix cache yet")
            return "this model has no prefix cache"
        if not 0 <= event.request < self.model.requests:
            raise core.ProtocolMisuse(f"request {event.request} does not exist")
        return self.placed(event.request, role) or (
            f"request {event.request} is placed on no {role} worker")

    def take(self, event: core.Event) -> Taken | Change | Refusal:
        """Decide `event` where it belongs and deliver what it sends. After it, `carried`
        holds (part, commands) for each part with commands to carry out, in the order they
        arose, `reached` the parts it delivered to or changed besides the taker (for the
        environment: every part it changed), and `absorbed` the messages that changed
        nothing at their receiver (a word repeated while the same is on the wire)."""
        self.carried, self.reached, self.absorbed = [], [], []
        taker = self.taker(event)
        if type(taker) is str:
            return Refusal(event, taker)
        if taker is None:
            return self._environment(event)
        out = taker.take(event, self.whole)
        if type(out) is Taken:
            self._carry(taker, out.commands)
            for message in out.messages:
                self._deliver(message)
        return out

    def _carry(self, part: Part, commands: tuple) -> None:
        if commands:
            self.carried.append((part, commands))

    def _deliver(self, message: Message) -> None:
        if message.to == GHOST:
            self.ghost.setdefault(message.request, {}).update(message.fields)
            return
        part = self.placed(message.request, message.to)
        assert part is not None, f"{message} to a request placed on no {message.to} worker"
        before = part.rows.get(message.request)
        self._carry(part, part.receive(message))
        if part.rows[message.request] == before:
            self.absorbed.append(message)
        if part not in self.reached:
            self.reached.append(part)

    def _environment(self, event: core.Event) -> Change | Refusal:
        """The environment's action, decided on the whole state and written into every
        part that holds what it changes; each part derives the commands its worker carries
        out for what it observes of it (the module docstring says what that is)."""
        whole = self.whole()
        out = core.change_for(self.model, whole, event)
        if type(out) is Refusal:
            return out
        parts = self.parts()
        before = [({r: part.rows.get(r, part.blank) for r, _ in out.rows}, part.pool_before(),
                   tuple(part.sending)) for part in parts]
        for r, row in out.rows:
            old = whole.requests[r]
            for k, value in enumerate(row):
                if value != old[k]:
                    self._install(r, k, value)
        for part in self.prefills:
            part.apply(Change(prefill=tuple(c for c in out.prefill if part.owns_page(c[0])),
                              landed=tuple(w for w in out.landed if part.owns_page(w[1])),
                              flushed=out.flushed))
        for part in self.decodes:
            part.apply(Change(decode=tuple(c for c in out.decode if part.owns_page(c[0]))))
        for part, (rows, pool, sending) in zip(parts, before):
            seen = self._observed(part, whole, out, rows)
            self._carry(part, part.commands(seen, pool, out, freed_by(out)))
            if seen or part.pool_before() != pool or tuple(part.sending) != sending:
                self.reached.append(part)
        return out

    def _observed(self, part: Part, whole: State, change: Change, before: dict) -> list:
        """The rows of an environment step as `part` observes it: the fields it holds as
        they changed (a crash's tombstones, a landing counted, a notice in its inbox), and
        the messages its role sends that the step put on the wire (the final word of a
        failed prefill; a decode crash's notice, credited to the crashed decode)."""
        rows = []
        for r, new in change.rows:
            if part is not self.placed(r, part.role):
                continue
            old = whole.requests[r]
            sent_old = {k: old[k] for k, role in SENT_FIELDS.items()
                        if role == part.role and new[k] != old[k] and new[k] != EMPTY_ROW[k]}
            sent_new = {k: new[k] for k in sent_old}
            if part.rows.get(r, part.blank) == before[r] and not sent_old:
                continue
            rows.append((r, part.seen(before[r], sent_old),
                         part.seen(part.rows[r], sent_new)))
        return rows

    def _install(self, r: int, k: int, value) -> None:
        if k in GHOST_FIELDS:
            self.ghost.setdefault(r, {})[k] = value
            return
        role = next(role for role in ROLES if k in AUTHORITY[role])
        part = self.placed(r, role)
        assert part is not None, f"{ROW_FIELDS[k]} of request {r}, placed on no {role}"
        part.install(r, k, value)

    # -- the whole, reassembled ---------------------------------------------------------

    def whole(self) -> State:
        """The core State the parts together hold: each field from the part with authority
        on it, each pool from its workers side by side, every send queue's writes."""
        rows = []
        for r in range(self.model.requests):
            row = list(EMPTY_ROW)
            for role in ROLES:
                part = self.placed(r, role)
                held = part.rows.get(r) if part is not None else None
                if held is not None:
                    for k in AUTHORITY[role]:
                        row[k] = held[k]
            for k, value in self.ghost.get(r, {}).items():
                row[k] = value
            rows.append(tuple(row))
        return State(tuple(rows),
                     tuple(page for part in self.decodes for page in part.pool),
                     tuple(page for part in self.prefills for page in part.pool),
                     tuple(sorted(w for part in self.prefills for w in part.sending)))

    def copy(self) -> "Split":
        twin = object.__new__(Split)
        twin.model, twin.router = self.model, self.router.copy()
        twin.prefills = [part.copy() for part in self.prefills]
        twin.decodes = [part.copy() for part in self.decodes]
        twin.ghost = {r: dict(fields) for r, fields in self.ghost.items()}
        twin.carried, twin.reached, twin.absorbed = [], [], []
        return twin

    def snapshot(self) -> tuple:
        return (tuple(part.snapshot() for part in self.parts()),
                tuple(sorted((r, tuple(sorted(f.items()))) for r, f in self.ghost.items())))


def replay(m: Model, events: Iterable[core.Event]) -> tuple[Split, list]:
    """Every event through a fresh Split, in order: the split and each event's outcome
    (a part's Taken, the environment's Change, or a Refusal)."""
    split = Split(m)
    return split, [split.take(event) for event in events]
