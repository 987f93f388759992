"""What a shell must carry out after the core's decision: named effects, not row diffs.

Every decision the core takes for a shell (`core.decide`) comes back as a Change — what the
protocol state becomes — and, with it, the commands that a shell carries out so that its
world follows: messages to send, the request to queue or compute, page writes to post,
timers to arm or cancel, a sequence to add to or take out of the decode batch, pages that
came back to their pool, the client's answer, a release to take once the protocol allows
it. A shell handles each command by its type and never compares rows to find out what
happened; the simulator, the engine and the server carry out the same commands.

Commands are derived here, in one place, from the Change and the rows it replaces, so no
action can forget one (an answer is sent whenever a client's state becomes final, whichever
action did it). The derivation order is the order a shell carries them out in: messages,
then the prefill's work, then the client, then decode's, then freed pages.

Who carries each command out (`carrier`: the router, a prefill, a decode, or the serving
edge the client talks to) is a table here too, and it is what lets one worker derive its own
commands from its own part of the state (`part_effects`, for spec/parts.py's processes): the
same row derivation, run on that worker's fields before and after and on the messages it
sent, keeping the commands it carries. The whole-row `effects` is the union of those, worker
by worker (tests/test_commands_parts.py), with one exception the process view exposes: a
final word repeated (AnswerCancel) while the same word is still on the wire. The spec's wire
holds one message per request, so the repeat is absorbed by the one in flight and
`effects`, which sees the slot unchanged, asks for no Send; the prefill cannot see the slot
(it is decode's inbox) and sends again. spec/README.md ("Commands per part") says what a
real transport must do with that duplicate.

Pure like the core: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Iterable

from spec.core import (
    BOOT, CANCEL, CLIENT, CLIENT_GONE, CLIENT_NAMES, CLOSING, DECODING, DST, D_WAITING, FW,
    GONE, IDLE, NONE, NO_MSG, PST, QUEUED, RUNNING, WAITING, BOOTSTRAP, CANCEL_MSG,
    FINAL_WORD_MSG, P_READERS, READERS, Change, View,
)

# The page table decode publishes on Reserve: a message to the prefill. The spec delivers it
# with Reserve (the prefill's copy, ptable); a shell that delays it delays Admit with it.
PAGE_TABLE = "page table"


@dataclass(frozen=True, slots=True)
class Command:
    request: int

    @property
    def name(self) -> str:
        return type(self).__name__


@dataclass(frozen=True, slots=True)
class Send(Command):
    """Put a message on the wire: bootstrap (router -> decode), final word (prefill ->
    decode), cancel (decode -> prefill), page table (decode -> prefill), client gone (the
    serving edge -> both workers)."""

    message: str


@dataclass(frozen=True, slots=True)
class Queue(Command):
    """The prefill queues the request for admission."""


@dataclass(frozen=True, slots=True)
class Compute(Command):
    """The prefill computes the prompt's KV into the source pages it was admitted with."""


@dataclass(frozen=True, slots=True)
class Post(Command):
    """The prefill's NIC carries out a page write; it lands later (LandWrite)."""

    write: tuple  # (request, source page, decode page, tag)


@dataclass(frozen=True, slots=True)
class ArmTimer(Command):
    """Decode starts the request's transfer timer (Timeout when it fires)."""


@dataclass(frozen=True, slots=True)
class CancelTimer(Command):
    """Decode stops waiting for KV: the transfer timer must not fire."""


@dataclass(frozen=True, slots=True)
class StartDecoding(Command):
    """Decode adds the request to its continuous batch."""


@dataclass(frozen=True, slots=True)
class StopDecoding(Command):
    """Decode takes the request out of its batch (it ended without Finish)."""


@dataclass(frozen=True, slots=True)
class ReleaseWhenReady(Command):
    """Decode releases the request's pages as soon as the core enables Release (the final
    word has arrived and as many of the request's writes have landed as it announced)."""


@dataclass(frozen=True, slots=True)
class Answer(Command):
    """The client's answer: a final client state (Ok or an error), exactly once."""

    outcome: str


@dataclass(frozen=True, slots=True)
class FreePages(Command):
    """Pages came back to a worker's pool: wake whoever waits for pages."""

    pool: str       # "prefill" or "decode"
    pages: tuple


# The fields whose change asks for a command (`_row_effects` reads no other): a row that
# changed none of them (a page posted or landed: most decisions) asks for none.
_MESSAGES_AND_STATES = itemgetter(BOOT, FW, CANCEL, PST, CLIENT, DST)
_FINAL = frozenset(range(len(CLIENT_NAMES))) - {IDLE, WAITING, GONE}


def effects(s: View, change: Change) -> tuple[Command, ...]:
    """The commands a Change decided in view `s` asks of the shells, in carrying-out order.
    Called on every decision a shell takes, so it appends into one list and looks only at
    the parts of the Change that are there (a landing write counts itself in its row and
    frees nothing: no command)."""
    decode = change.decode
    if len(decode) == 1 and not change.prefill:
        page, value = decode[0]  # one decode page changed (a write landed) ...
        if value[0] != NONE or s.decode_pool[page][0] == NONE:
            decode = ()          # ... and it was not freed: no pages came back
    out: list[Command] = []
    rows = s.requests
    for r, new in change.rows:
        old = rows[r]
        if new is not old and _MESSAGES_AND_STATES(new) != _MESSAGES_AND_STATES(old):
            _row_effects(out, r, old, new)
    for w in change.posted:
        out.append(Post(w[0], w))
    if decode or change.prefill:
        by = change.rows[0][0] if change.rows else (
            change.landed[0][0] if change.landed else NONE)
        if decode:
            _freed(out, by, "decode", s.decode_pool, decode)
        if change.prefill:
            _freed(out, by, "prefill", s.prefill_pool, change.prefill)
    return tuple(out)


def _row_effects(out: list, r: int, old: tuple, new: tuple) -> None:
    if new[BOOT] and not old[BOOT]:
        out.append(Send(r, BOOTSTRAP))
    if new[FW] != NO_MSG and new[FW] != old[FW]:
        out.append(Send(r, FINAL_WORD_MSG))
    if new[CANCEL] and not old[CANCEL]:
        out.append(Send(r, CANCEL_MSG))
    if new[PST] != old[PST]:
        if new[PST] == QUEUED:
            out.append(Queue(r))
        elif new[PST] == RUNNING:
            out.append(Compute(r))
    if new[CLIENT] != old[CLIENT]:
        if new[CLIENT] == GONE:
            out.append(Send(r, CLIENT_GONE))
        elif new[CLIENT] in _FINAL and old[CLIENT] in (IDLE, WAITING):
            out.append(Answer(r, CLIENT_NAMES[new[CLIENT]]))
    if new[DST] != old[DST]:
        _decode_effects(out, r, old[DST], new[DST])


def _decode_effects(out: list, r: int, old: int, new: int) -> None:
    if new == D_WAITING:
        out += (ArmTimer(r), Send(r, PAGE_TABLE))
    elif old == D_WAITING:
        out.append(CancelTimer(r))
    if new == DECODING:
        out.append(StartDecoding(r))
    elif old == DECODING:
        out.append(StopDecoding(r))
    if new == CLOSING:
        out.append(ReleaseWhenReady(r))


def _freed(out: list, r: int, pool_name: str, pool, changes: tuple) -> None:
    readers = READERS if pool_name == "decode" else P_READERS
    pages = [p for p, page in changes if page[0] == NONE
             and (pool[p][0] != NONE or _last_reader_left(pool[p], page, readers))]
    if pages:
        out.append(FreePages(r, pool_name, tuple(pages)))


def _last_reader_left(before: tuple, after: tuple, readers: int) -> bool:
    """A cached page's last reader released it (prefix caching, either pool): nobody owned
    it, and now nobody reads it either, so an allocation may evict it: whoever waits for
    pages of that pool must hear of it, as of a page freed."""
    return bool(before[readers]) and not after[readers]


# -- who carries a command out, and one worker's own commands -----------------------------

# A message is its sender's to send; the serving edge ("client": the router's process in a
# deployment) sends the client-gone notice and answers. Freed pages are the pool's owner's.
SENDERS = {BOOTSTRAP: "router", FINAL_WORD_MSG: "prefill", CANCEL_MSG: "decode",
           PAGE_TABLE: "decode", CLIENT_GONE: "client"}
CARRIERS = {Queue: "prefill", Compute: "prefill", Post: "prefill", ArmTimer: "decode",
            CancelTimer: "decode", StartDecoding: "decode", StopDecoding: "decode",
            ReleaseWhenReady: "decode", Answer: "client"}
# The row fields that are messages on the wire, by their sender: a sender does not hold its
# message's slot (it is the receiver's inbox), so for a command it had nothing there before.
SENT_FIELDS = {BOOT: "router", FW: "prefill", CANCEL: "decode"}


def carrier(command: Command) -> str:
    """The worker ("router", "prefill", "decode" or "client") that carries out `command`."""
    kind = type(command)
    if kind is Send:
        return SENDERS[command.message]
    if kind is FreePages:
        return command.pool
    return CARRIERS[kind]


def freed_by(change: Change) -> int:
    """The request a FreePages of `change` names (the first it changed; NONE if none)."""
    if change.rows:
        return change.rows[0][0]
    return change.landed[0][0] if change.landed else NONE


def part_effects(carriers: frozenset, rows: Iterable[tuple[int, tuple, tuple]],
                 pool_name: str = "", pool=(), pages: tuple = (), posted: tuple = (),
                 by: int = NONE) -> tuple[Command, ...]:
    """The commands a worker carrying out `carriers` (its carrier names) carries out for one
    step it took or saw, in carrying-out order, from its own part alone: `rows` are
    (request, old, new) of the fields it holds (every other field as in core.EMPTY_ROW on
    both sides), with each message it sent written into the new row and absent from the
    old; `pages` the changes of its own pool `pool` (named `pool_name`), `posted` its
    writes, `by` the request FreePages names (`freed_by` of the step's change). The same
    derivation as `effects`, kept to this worker's commands."""
    out: list[Command] = []
    for r, old, new in rows:
        if _MESSAGES_AND_STATES(new) != _MESSAGES_AND_STATES(old):
            _row_effects(out, r, old, new)
    for w in posted:
        out.append(Post(w[0], w))
    if pages:
        _freed(out, by, pool_name, pool, pages)
    return tuple(c for c in out if carrier(c) in carriers)
