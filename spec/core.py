"""The KV transfer protocol as one pure state machine: the heart of kvproof.

Theory of operation
-------------------
A request goes router -> prefill -> decode. The router checks the prompt against the
advertised context and hands the request to a prefill worker (its state becomes Queued) and
sends a *bootstrap* to a decode worker. Decode reserves pages for the whole prompt, stamping
each page with a fresh generation (its ownership tag), and sends the page table to the
prefill (which keeps its copy, PTABLE). The prefill allocates source pages, computes the KV,
and posts one write per page into decode's pages (SendPage); each write lands later
(LandWrite), carrying the data of its source page *at landing time* and the tag it was
addressed with, and decode counts it (LANDED). When every write has completed, the prefill
sends its final word Done (with the count it posted, FW_COUNT) and frees its source pages. Decode accepts
only if the count equals what it reserved and the checksums match; it then decodes, reading
every page and comparing each page's tag with the generation it reserved (Finish).

Failure is part of the protocol: the prefill rejects a prompt its pool can never hold
(Reject), fails or is aborted (PrefillFail, PrefillAbort), decode rejects a prompt its pool
can never hold (DecodeReject), times out (Timeout), notices a client that went away
(DecodeAbort). Every ending on the decode side goes through Closing, and pages come back only
at Release, which waits for the prefill's final word (Done, Reject or Abort, each carrying the
count of writes the prefill posted) and for as many of the request's writes to have landed in
decode's pages, counted by decode itself: decode cannot see the writes on the network. Decode asks for that final word with a cancel; an
ended prefill answers a cancel by repeating its final word (AnswerCancel). Messages overtake
each other: a final word can reach decode before the bootstrap, so decode keeps a tombstone
and drops the late bootstrap (DropBootstrap).

With a prefix cache (the model's prefix_cache; the spec's PrefixCache) a prompt is a sequence
of abstract tokens with a salt (its tenant), and a page's content identity is (salt, the tokens
of that page and of every page before it). Decode seals the pages of an accepted transfer under
their identity (Accept), a later request with the same salt and prefix references them at
Reserve (its first HIT pages; the prefill, told PHIT, sends only the tail, into the right
pages), Release drops the reference and Evict forgets a sealed page nobody reads. With a
prefill-side cache too (prefill_cache; the spec's PrefillCache) the prefill keeps the pages it
computed under the same keys: Admit references the longest cached prefix (PCACHED pages) and
computes only the rest, its sources are the cached pages then the new ones, SendDone seals
what it computed, PrefillEvict forgets a page nobody reads and no write reads out of, and a
prefill crash wipes its cache.

Pages keep their last content when freed; nothing is zeroed. A fresh pool's pages carry an
invalid tag (-1) that no allocation ever issues.

This module is the single place where protocol decisions are made. It has no I/O, no clock,
no randomness and no torch: shells (checker, simulator, engine, server) hand it events and
act on its answers. Each action below has the name of a disjunct of Next in KVTransfer.tla,
and the same guards and effects; `apply` answers an event with the next state or a
`Refusal` naming the guard that failed.

Representation
--------------
States are plain nested tuples of small ints so that they hash, compare and copy fast and
hash the same in every process. A state is (requests, decode_pool, prefill_pool, writes):
- requests: one row per request (the fields named by the constants CLIENT..LEAKED below);
  rows mention pages but never other requests, which makes symmetry reduction cheap.
- decode_pool: per page (owner, gen, data, tag, readers, ident, kv, tag_ident); data/tag are
  the page's last content and tag_ident the content identity its tag names (the spec's
  content[d][p], a triple); readers (a sorted tuple of requests), ident (the cache key, () if
  not cached), kv (the content identity its memory holds) and tag_ident are prefix caching's
  (all empty without it).
- prefill_pool: per page (owner, data, readers, ident): readers and ident are the prefill-side
  cache's (empty without it).
- writes: the in-flight writes, sorted, each (request, source page, decode page, tag).
Requests and pages are 0-based here; the TLA+ view (spec/tlaplus/tlaview.py) maps them to the spec.

Workers. A model has P prefill and D decode workers (the spec's PrefillWorkers and
DecodeWorkers), each with a pool of prefill_pages (decode_pages) pages. The pools lie side by
side in one flat tuple: worker w's pages are w * pages .. (w + 1) * pages - 1, and every page
number in a row or a write is such a flat index. The router places each request on one
worker of each kind (the row's PW and DW); the request's actions read and write only the
pages of its own workers (`_pages_of`), so a shell's store can decide them on a view that
holds just that pair of pools (spec/store.py: its views' pools are one worker's, numbered
from 0). A one-prefill, one-decode model is exactly the state of the spec before workers.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass
from itertools import combinations, product
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Protocol, Sequence, Union

from spec.model import Model

NONE = -1  # no request / no data / invalid tag

# Client states (TLA+ strings in CLIENT_NAMES).
(IDLE, WAITING, OK, GONE, ERR_TOO_LONG, ERR_PREFILL, ERR_TRANSFER, ERR_TAG, ERR_TIMEOUT,
 ERR_DECODE) = range(10)
CLIENT_NAMES = ("Idle", "Waiting", "Ok", "Gone", "ErrTooLong", "ErrPrefill", "ErrTransfer",
                "ErrTag", "ErrTimeout", "ErrDecode")
# Prefill states.
P_NONE, QUEUED, RUNNING, P_DONE, REJECTED, ABORTED = range(6)
PREFILL_NAMES = ("None", "Queued", "Running", "Done", "Rejected", "Aborted")
# Decode states.
D_NONE, D_WAITING, DECODING, CLOSING, RELEASED, TOMB = range(6)
DECODE_NAMES = ("None", "Waiting", "Decoding", "Closing", "Released", "Tomb")
# The prefill's final word, as a message in flight to decode.
NO_MSG, MSG_DONE, MSG_REJECT, MSG_ABORT = range(4)
MESSAGE_NAMES = ("None", "Done", "Reject", "Abort")
FINAL_WORD = {P_DONE: MSG_DONE, REJECTED: MSG_REJECT, ABORTED: MSG_ABORT}

# Fields of a request row. A row mixes what different parties know: the router's (CLIENT,
# PROMPT), the prefill's (PST, SENT, SRC, PTABLE), decode's (DST, TABLE, DFW, ANNOUNCED,
# LANDED), the messages on the wire (BOOT, FW, FW_COUNT, CANCEL) and one ghost (LEAKED,
# history for the properties). Each action reads only its own worker's fields and the
# messages addressed to it: spec/tlaplus/locality.py says who owns what, and
# tests/test_locality.py checks every action of the spec against it.
# PW and DW are the router's placement: the prefill and the decode worker it chose at
# Arrive (NONE before, and for a prompt it refused), fixed for the request's life.
# TOKENS and SALT are the router's (the prompt's tokens, one per page, and its tenant), HIT
# decode's (the leading pages it holds cached for the request) and PHIT the prefill's copy
# of it: prefix caching's, () and 0 without it.
# PCACHED is the prefill's (how many leading pages of the prompt it found in its own cache at
# Admit: the prefill-side cache's, 0 without it).
(CLIENT, PROMPT, PST, SENT, SRC, DST, TABLE, BOOT, FW, DFW, CANCEL, PTABLE, FW_COUNT,
 ANNOUNCED, LANDED, LEAKED, PW, DW, TOKENS, SALT, HIT, PHIT, PCACHED) = range(23)
ROW_FIELDS = ("client", "prompt", "pst", "sent", "src", "dst", "table", "boot", "fwMsg",
              "dfw", "cancel", "ptable", "fwCount", "announced", "landed", "leaked",
              "pworker", "dworker", "tokens", "salt", "hit", "phit", "pcached")
EMPTY_ROW = (IDLE, 0, P_NONE, 0, (), D_NONE, (), 0, NO_MSG, 0, 0, (), 0, 0, 0, 0, NONE, NONE,
             (), 0, 0, 0, 0)

# Fields of a decode page. A content identity (IDENT, KV) is (salt, tokens of the page and
# of every page before it), or () for none.
OWNER, GEN, DATA, TAG, READERS, IDENT, KV, TAG_IDENT = range(8)
NO_IDENT = ()
FRESH_DECODE_PAGE = (NONE, 0, NONE, NONE, (), NO_IDENT, NO_IDENT, NO_IDENT)
# Fields of a prefill page: its owner, whose KV its memory holds, and the prefill-side
# cache's readers and key (the spec's powner, pdata, preaders, pident; (), () without it).
P_OWNER, P_DATA, P_READERS, P_IDENT = range(4)
FRESH_PREFILL_PAGE = (NONE, NONE, (), NO_IDENT)


class View(Protocol):
    """What an action reads: the request rows, the pools and the writes in flight. The
    checker's State is one, with every worker's pool; a shell's store (spec/store.py) hands
    out views of one worker pair of a whole cluster, whose rows are a dict of the live
    requests rather than a tuple of every request, and whose pools are that pair's."""

    requests: Any
    decode_pool: Sequence[tuple]
    prefill_pool: Sequence[tuple]
    writes: Sequence[tuple]

    def has_request(self, r: int) -> bool: ...

    def request_items(self) -> Iterable[tuple[int, tuple]]: ...

    def pages_of(self, worker: int, pages: int) -> range:
        """The indices in this view's pool of the pages of `worker`, whose pool has `pages`."""
        ...


class State(NamedTuple):
    requests: tuple
    decode_pool: tuple
    prefill_pool: tuple
    writes: tuple

    def has_request(self, r: int) -> bool:
        return 0 <= r < len(self.requests)

    def request_items(self) -> Iterable[tuple[int, tuple]]:
        return enumerate(self.requests)

    def pages_of(self, worker: int, pages: int) -> range:
        return range(worker * pages, (worker + 1) * pages)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The core's answer to an event the protocol does not allow in this state.

    A refusal is a peer's or client's bad input (reported, nothing changes), not a bug in
    the caller: a shell logs it and carries on.
    """

    event: "Event"
    reason: str

    def __str__(self) -> str:
        return f"{self.event} refused: {self.reason}"


class ProtocolMisuse(ValueError):
    """Our own misuse of the core (an event naming a request or page that does not exist)."""


def initial_state(m: Model) -> State:
    return State(
        requests=(EMPTY_ROW,) * m.requests,
        decode_pool=(FRESH_DECODE_PAGE,) * (m.decode_pages * m.decode_workers),
        prefill_pool=(FRESH_PREFILL_PAGE,) * (m.prefill_pages * m.prefill_workers),
        writes=(),
    )


def prefill_pages_of(m: Model, s: "View", row: tuple) -> range:
    """The pages of the request's prefill worker (its pool), as indices of the view's pool."""
    return s.pages_of(row[PW], m.prefill_pages)


def decode_pages_of(m: Model, s: "View", row: tuple) -> range:
    """The pages of the request's decode worker."""
    return s.pages_of(row[DW], m.decode_pages)


# ---------------------------------------------------------------------------------------
# Small helpers for building the next state.

def _row(row: tuple, *pairs: int | object) -> tuple:
    """A copy of `row` with (field, value) pairs replaced."""
    if len(pairs) == 2:  # one field (a page posted or landed: most steps)
        k = pairs[0]
        return row[:k] + (pairs[1],) + row[k + 1:]
    new = list(row)
    for k in range(0, len(pairs), 2):
        new[pairs[k]] = pairs[k + 1]
    return tuple(new)


class Change(NamedTuple):
    """What an action does: the rows, pages and writes it replaces. Actions return a Change
    rather than a new State so that two representations share them: the checker's immutable
    tuples (`commit`) and a simulator's mutable, much larger cluster (spec/store.py), which
    hands each action a *view* with the same four attributes as State."""

    rows: tuple = ()        # ((request, new row), ...)
    decode: tuple = ()      # ((decode page, (owner, gen, data, tag)), ...)
    prefill: tuple = ()     # ((prefill page, (owner, data)), ...)
    posted: tuple = ()      # writes posted, each (request, source page, decode page, tag)
    landed: tuple = ()      # writes that landed (and so left the set in flight)
    flushed: tuple = ()     # requests whose writes in flight are all dropped (a crash:
                            # the requests placed on the crashed worker)
    commands: tuple = ()    # what shells carry out (spec/commands.py); set by `decide` only


def commit(s: State, c: Change) -> State:
    """The State after Change `c`."""
    requests = s.requests
    if len(c.rows) == 1:
        r, row = c.rows[0]
        requests = requests[:r] + (row,) + requests[r + 1:]
    elif c.rows:
        new = list(requests)
        for r, row in c.rows:
            new[r] = row
        requests = tuple(new)
    return State(requests, _replace_pages(s.decode_pool, c.decode),
                 _replace_pages(s.prefill_pool, c.prefill), _next_writes(s.writes, c))


def _replace_pages(pool: tuple, changes: tuple) -> tuple:
    if not changes:
        return pool
    new = list(pool)
    for p, page in changes:
        new[p] = page
    return tuple(new)


def _next_writes(writes: tuple, c: Change) -> tuple:
    if c.flushed:
        writes = tuple(w for w in writes if w[0] not in c.flushed)
    if not (c.posted or c.landed):
        return writes
    new = [w for w in writes if w not in c.landed] if c.landed else list(writes)
    for w in c.posted:
        insort(new, w)
    return tuple(new)


def _one(r: int, row: tuple) -> Change:
    return Change(((r, row),))


def _writes_of(s: State, r: int) -> bool:
    for w in s.writes:
        if w[0] == r:
            return True
    return False


def _free_prefill_of(pool, r: int, pages: tuple) -> tuple:
    """The page changes that free the pages of `pages` that `r` still owns; data stays."""
    return tuple((p, _unowned(pool[p])) for p in pages if pool[p][0] == r)


def _unowned(page: tuple) -> tuple:
    """A prefill page owned by nobody; its memory and its cache fields stay."""
    return (NONE,) + page[1:]


def _free_unread_of(s: State, r: int, pages: tuple) -> tuple:
    """The same for the pages none of r's writes in flight still reads (the spec's
    FreeUnreadSources): all of them unless the final word went out early (EarlyDone)."""
    reading = {w[1] for w in s.writes if w[0] == r}
    pool = s.prefill_pool
    return tuple((p, _unowned(pool[p])) for p in pages if pool[p][0] == r and p not in reading)


def _counted(m: Model, row: tuple, writes: int) -> bool:
    """Decode's own count: as many of the request's writes have landed as `writes` (the
    spec's Counted; NoLandedCount is the decode that does not count)."""
    return "NoLandedCount" in m.bugs or row[LANDED] >= writes


def _cancel(m: Model) -> tuple:
    """The row change that sends decode's cancel to the prefill (none with NoCancel)."""
    return () if "NoCancel" in m.bugs else (CANCEL, 1)


def _client_error(row: tuple, error: int) -> int:
    """A waiting client gets `error`; a client that already has its answer keeps it."""
    return error if row[CLIENT] == WAITING else row[CLIENT]


# ---------------------------------------------------------------------------------------
# The actions. Each returns the Change it makes, or a str naming the guard that failed.
# Environment and faults: Arrive, Abort, PrefillFail, PrefillCrash. Everything else is the
# protocol's own (fair) action.

def arrive(m: Model, s: State, r: int, n: int, p: int = 0, d: int = 0, tokens: tuple = (),
           salt: int = 0) -> Change | str:
    """The router admits the prompt and places it on prefill worker p and decode worker d.
    Any worker has room: the startup check makes every worker's pools hold the advertised
    context (all pools are alike), so every worker can hold every prompt the router admits;
    whether its pages are free now is the worker's to know (the router cannot see them),
    and a worker without free pages keeps the request queued."""
    row = s.requests[r]
    if row[CLIENT] != IDLE:
        return "the request has already arrived"
    if not 1 <= n <= m.max_prompt_pages:
        return f"a prompt of {n} pages is outside 1..{m.max_prompt_pages}"
    bad = _prompt_content_error(m, n, tokens, salt)
    if bad:
        return bad
    if n > m.advertised_context_pages:  # placed nowhere
        return _one(r, _row(row, CLIENT, ERR_TOO_LONG, PROMPT, n, TOKENS, tokens, SALT, salt))
    return _one(r, _row(row, CLIENT, WAITING, PROMPT, n, PST, QUEUED, BOOT, 1, PW, p, DW, d,
                        TOKENS, tokens, SALT, salt))


def _prompt_content_error(m: Model, n: int, tokens: tuple, salt: int) -> str:
    """Why a prompt's tokens and salt are not ones the model's router may send, or ""."""
    if not m.prefix_cache:
        return "" if tokens == () and salt == 0 else "without a prefix cache a prompt has no tokens"
    if len(tokens) != n or not all(1 <= x <= m.tokens for x in tokens):
        return f"a prompt of {n} pages has {n} tokens from 1..{m.tokens}"
    return "" if 1 <= salt <= m.tenants else f"the salt must be in 1..{m.tenants}"


# Prefix caching (the spec's "Prefix caching" definitions). A page's content identity is
# (salt, the tokens of the page and of every page before it): the hash chain, unhashed.

def tokens_text(tokens: tuple) -> str:
    """A prompt's tokens as labels and messages write them: a checker's are digits, written
    together (112); a shell's are hashes, written apart (1 1 1048576), so that the text
    names one prompt."""
    return ("" if all(t < 10 for t in tokens) else " ").join(map(str, tokens))


def true_ident(row: tuple, i: int) -> tuple:
    """What page i (1-based) of the request holds (the spec's TrueIdent)."""
    return (row[SALT], row[TOKENS][:i])


def tag_ident(m: Model, row: tuple, i: int) -> tuple:
    """The content identity page i (1-based) of the request is tagged with, and a reader
    expects (the spec's TagIdent): its own, with a prefix cache; none without one, or with
    NoIdentTag (a tag that names the generation only)."""
    if not m.prefix_cache or "NoIdentTag" in m.bugs:
        return NO_IDENT
    return true_ident(row, i)


def tag_idents(m: Model, row: tuple) -> tuple:
    """The identity each page of the request's table is expected to be tagged with."""
    return tuple(tag_ident(m, row, i + 1) for i in range(len(row[TABLE])))


def written_ident(m: Model, row: tuple, page: int) -> tuple:
    """The identity decode tags `page` with when a write of the request lands in it (the
    spec's WrittenIdent): the request's own for the page's place in its table; none for a
    page no longer in it."""
    for i, (p, _) in enumerate(row[TABLE]):
        if p == page:
            return tag_ident(m, row, i + 1)
    return NO_IDENT


def cache_key(m: Model, row: tuple, i: int) -> tuple:
    """The key decode files page i under (the spec's CacheKey); NoSalt leaves the salt out."""
    return (0 if "NoSalt" in m.bugs else row[SALT], row[TOKENS][:i])


def hit_pages(m: Model, s: "View", row: tuple) -> tuple:
    """Decode's lookup (the spec's HitLen and HitPage): for each leading page of the prompt,
    as long as decode has one cached under its key, the lowest-numbered such page."""
    if not m.prefix_cache:
        return ()
    return _longest_cached(m, row, s.decode_pool, decode_pages_of(m, s, row), IDENT)


def _longest_cached(m: Model, row: tuple, pool, mine: range, ident: int) -> tuple:
    """For each leading page of the prompt, as long as one of `mine` is cached under its
    key (the pool's field `ident`), the lowest-numbered such page: both sides' lookup."""
    hits = []
    for i in range(1, row[PROMPT] + 1):
        key = cache_key(m, row, i)
        page = next((p for p in mine if pool[p][ident] == key), None)
        if page is None:
            break
        hits.append(page)
    return tuple(hits)


# n > 1 siblings (spec/README.md, "Siblings"): the completions of one prompt are requests
# with the same tokens and salt, so they share the prompt's pages through the cache like any
# two such requests, and every property covers them. What makes them share, rather than each
# transfer a copy of its own, is a shell's policy (like an eviction pick): every sibling is
# placed on the first's workers, and holds its Reserve while `sibling_waits`.

def sibling_waits(first: tuple) -> bool:
    """Whether a sibling of the request whose row is `first` holds its Reserve: while the
    first's transfer may still be accepted (its client waits and its decode has neither
    accepted nor ended it). Once the first decodes, its pages are sealed at decode (and, with
    a prefill-side cache, at the prefill since its SendDone), so a sibling's Reserve is a
    full decode-side hit and its Admit a full prefill-side hit: nothing is transferred or
    computed twice. Once the first ended any other way, each sibling goes on alone."""
    return first[CLIENT] == WAITING and (first[DST] == D_NONE or first[DST] == D_WAITING)


def told_hit(m: Model, row: tuple, k: int) -> int:
    """The hit length decode believes and tells the prefill (the spec's ToldHit):
    StaleHitLength counts one page more than decode holds."""
    if "StaleHitLength" in m.bugs and m.prefix_cache and k < row[PROMPT]:
        return k + 1
    return k


def to_send(row: tuple) -> int:
    """How many pages the prefill sends: those after the hit decode told it (ToSend)."""
    return max(len(row[SRC]) - row[PHIT], 0)


def pages_to_compute(m: Model, row: tuple) -> int:
    """How many prompt pages the prefill computes for the request: the prompt less the
    leading pages it found in its own cache at Admit (PCACHED; 0 without a prefill-side
    cache, or before Admit). What decode holds does not count: the prefill computes the
    suffix from the prefix's KV, which it must hold itself."""
    return row[PROMPT] - row[PCACHED]


# The prefill-side cache (the spec's PrefillCache): the same identities and keys as
# decode's, looked up at Admit, sealed at SendDone, evicted by PrefillEvict.

def prefill_hit_pages(m: Model, s: "View", row: tuple) -> tuple:
    """The prefill's lookup (the spec's PHitLen and PHitPage): for each leading page of the
    prompt, as long as the prefill has one cached under its key, the lowest-numbered such
    page. None for a placeholder (FinishedNotRejected: its page holds no prompt's KV)."""
    if not m.prefill_cache or row[PROMPT] > m.prefill_pages:
        return ()
    return _longest_cached(m, row, s.prefill_pool, prefill_pages_of(m, s, row), P_IDENT)


def sent_from(s: "View", page: int) -> bool:
    """A write in flight reads out of prefill page `page` (the spec's SentFrom)."""
    for w in s.writes:
        if w[1] == page:
            return True
    return False


def prefill_evictable(m: Model, s: "View", page: int) -> bool:
    """A cached prefill page the prefill may forget or allocate anew (the spec's
    PrefillEvictable): nobody reads it and no write in flight reads out of it.
    EvictWhileSending is the cache that ignores both."""
    if "EvictWhileSending" in m.bugs:
        return True
    return not s.prefill_pool[page][P_READERS] and not sent_from(s, page)


def prefill_free(m: Model, s: "View", page: int) -> bool:
    """Prefill page `page` may be allocated (the spec's FreePrefill): nobody owns it and,
    if it is cached, it is evictable (the allocation evicts it)."""
    owner, _, _, ident = s.prefill_pool[page]
    return owner == NONE and (ident == NO_IDENT or prefill_evictable(m, s, page))


WAITS_FOR_TABLE = "decode has not reserved yet: the prefill admits once it has the page table"


def admission_waits_for_table(m: Model) -> bool:
    """Whether the prefill admits a request only once decode's page table has reached it
    (the bootstrap queue; AdmitBeforeReserve is the bug that does not wait)."""
    return "AdmitBeforeReserve" not in m.bugs


def _admit_need(m: Model, row: tuple, s: "View | None" = None) -> int | str:
    """How many fresh source pages Admit takes: the prompt's (a placeholder's one), less
    the pages the prefill holds cached (with a prefill-side cache, given the view `s`)."""
    if row[PST] != QUEUED:
        return f"the prefill state is {PREFILL_NAMES[row[PST]]}, not Queued"
    if not row[PTABLE] and admission_waits_for_table(m):
        return WAITS_FOR_TABLE  # the bootstrap queue (KVTransfer.tla, Admit)
    need = row[PROMPT]
    if need > m.prefill_pages:
        if "FinishedNotRejected" not in m.bugs:
            return "the prompt is longer than the prefill pool: it must be rejected"
        need = 1  # the bug: a one-page placeholder stands in for the rejected prompt
    if m.prefill_cache and s is not None:
        need -= len(prefill_hit_pages(m, s, row))
    return need


def _check_pages(pool: tuple, mine: range, pages: tuple, need: int, which: str) -> str:
    """Why `pages` is not a valid allocation of `need` free pages of the worker's pool
    `mine`, or ""."""
    if len(pages) != need:
        return f"{need} {which} pages needed, {len(pages)} given"
    for k, p in enumerate(pages):
        if p not in mine:
            return f"{which} page {p + 1} does not exist in the request's {which} worker"
        if k and pages[k - 1] >= p:
            return f"{which} pages must be distinct and ascending"
        if pool[p][0] != NONE:
            return f"{which} page {p + 1} is not free"
    return ""


def admit(m: Model, s: State, r: int, pages: tuple) -> Change | str:
    """The prefill takes the request: it references the pages it holds cached for the
    prompt's first k pages (a prefill-side cache) and computes r's KV into `pages`, fresh,
    for the rest; its sources are the cached pages, then the new ones."""
    row = s.requests[r]
    need = _admit_need(m, row, s)
    if type(need) is str:
        return need
    pool = s.prefill_pool
    bad = _check_pages(pool, prefill_pages_of(m, s, row), pages, need, "prefill")
    if bad:
        return bad
    hits = prefill_hit_pages(m, s, row)
    for p in pages:
        if p in hits or not prefill_free(m, s, p):
            return f"prefill page {p + 1} is cached and in use: it is not free"
    referenced = _referenced(pool, r, hits, P_READERS)
    computed = tuple((p, (r, r, pool[p][P_READERS], NO_IDENT)) for p in pages)  # evicts
    return Change(((r, _row(row, PST, RUNNING, SRC, hits + pages, PCACHED, len(hits))),),
                  prefill=referenced + computed)


def reject(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if row[PST] != QUEUED:
        return f"the prefill state is {PREFILL_NAMES[row[PST]]}, not Queued"
    if row[PROMPT] <= m.prefill_pages:
        return "the prompt fits the prefill pool"
    if "FinishedNotRejected" in m.bugs:
        return "with FinishedNotRejected the prefill admits a placeholder instead"
    return _one(r, _row(row, PST, REJECTED, FW, MSG_REJECT, FW_COUNT, row[SENT],
                        CLIENT, _client_error(row, ERR_TOO_LONG)))


def send_page(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if row[PST] != RUNNING:
        return f"the prefill state is {PREFILL_NAMES[row[PST]]}, not Running"
    table = row[PTABLE]  # the prefill's copy, received from decode
    if not table:
        return "the prefill has not received decode's page table"
    i = row[SENT]
    src = row[SRC]
    if i >= to_send(row):
        return "every source page has been posted"
    k = row[PHIT] + i  # the pages decode holds cached are not sent: the tail, in place
    page, tag = table[k]
    freed = ()
    if k + 1 == len(src) and "SourceReuse" in m.bugs:
        # The bug: the sources are freed when the last write is posted, not when it lands.
        freed = _free_prefill_of(s.prefill_pool, r, src)
    return Change(((r, _row(row, SENT, i + 1)),), prefill=freed,
                  posted=((r, src[k], page, tag),))


def land_write(m: Model, s: State, r: int, page: int) -> Change | str:
    for w in s.writes:
        if w[0] == r and w[2] == page:
            break
    else:
        return (f"no write of this request into decode page {page + 1} is in flight (it "
                "landed already, or a crash flushed it while it was on the wire)")
    data = s.prefill_pool[w[1]][1]  # the NIC reads the source page now, not at post time
    owner, gen, _, _, readers, ident, kv, _ = s.decode_pool[page]
    if m.prefix_cache:
        kv = source_ident(s, w[1])
    row = s.requests[r]  # decode counts the write (its completion carries the request)
    tid = written_ident(m, row, page)  # decode tags the page with r's identity for it
    freed = ()
    if row[PST] != RUNNING and s.prefill_pool[w[1]][0] == r:
        # The completion frees a source the prefill kept only for this write (EarlyDone).
        freed = ((w[1], _unowned(s.prefill_pool[w[1]])),)
    return Change(((r, _row(row, LANDED, row[LANDED] + 1)),),
                  decode=((page, (owner, gen, data, w[3], readers, ident, kv, tid)),),
                  prefill=freed, landed=(w,))


def source_ident(s: State, source: int) -> tuple:
    """The content identity of the KV a prefill page holds (the spec's SourceIdent)."""
    x = s.prefill_pool[source][1]
    if x == NONE or source not in s.requests[x][SRC]:
        return NO_IDENT
    row = s.requests[x]
    return true_ident(row, row[SRC].index(source) + 1)


def send_done(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if row[PST] != RUNNING:
        return f"the prefill state is {PREFILL_NAMES[row[PST]]}, not Running"
    if row[SENT] != to_send(row):
        return f"{row[SENT]} of {to_send(row)} pages posted"
    if "EarlyDone" not in m.bugs and _writes_of(s, r):
        return "writes of this request are still in flight"
    if m.prefill_cache and row[PROMPT] <= m.prefill_pages:
        pages = _prefill_sealed(m, s, r, row) + _prefill_unreferenced(s, r, row)
    else:  # a placeholder's page (FinishedNotRejected) holds no prompt's KV: never sealed
        pages = _free_unread_of(s, r, row[SRC])
    return Change(((r, _row(row, PST, P_DONE, FW, MSG_DONE, FW_COUNT, row[SENT])),),
                  prefill=pages)


def _prefill_sealed(m: Model, s: State, r: int, row: tuple) -> tuple:
    """The pages r computed and still owns, sealed (the spec's PSeals): filed under their
    keys, owned by nobody. Each was written at Admit, and every write out of it has
    completed by SendDone, so no page is findable before its KV is whole."""
    pool = s.prefill_pool
    return tuple((p, (NONE, data, readers, cache_key(m, row, i + 1)))
                 for i, p in enumerate(row[SRC]) if i >= row[PCACHED] and pool[p][0] == r
                 for _, data, readers, _ in (pool[p],))


def _prefill_unreferenced(s: State, r: int, row: tuple) -> tuple:
    """The cached sources r hit, with r no longer among their readers (the spec's
    PDropReferences): they stay cached for the next request with their prefix."""
    pool = s.prefill_pool
    return tuple((p, (owner, data, tuple(x for x in readers if x != r), ident))
                 for p in row[SRC][:row[PCACHED]]
                 for owner, data, readers, ident in (pool[p],) if r in readers)


def _stop_prefill(m: Model, s: State, r: int, client: int) -> Change:
    row = s.requests[r]
    # A prefill that stops because of a cancel answers it; the bug drops only the notice a
    # prefill owes decode when it stops on its own or on a client abort.
    # (Fields an action leaves alone are not named: it does not read the message it is not
    # sending, which is on the wire. spec/tlaplus/locality.py checks what actions read.)
    silent = "NoAbortNotice" in m.bugs and not row[CANCEL]
    notice = () if silent else (FW, MSG_ABORT, FW_COUNT, row[SENT])
    # Its computed pages are freed (not sealed: only a prefill that ended well caches);
    # the cached pages it hit lose it as a reader.
    return Change(((r, _row(row, PST, ABORTED, CANCEL, 0, *notice, CLIENT, client)),),
                  prefill=_free_prefill_of(s.prefill_pool, r, row[SRC])
                  + _prefill_unreferenced(s, r, row))


def _prefill_can_stop(s: State, r: int) -> str:
    row = s.requests[r]
    if row[PST] != QUEUED and row[PST] != RUNNING:
        return f"the prefill state is {PREFILL_NAMES[row[PST]]}, not Queued or Running"
    if _writes_of(s, r):
        return "writes of this request are in flight; the prefill stops once they land"
    return ""


def prefill_abort(m: Model, s: State, r: int) -> Change | str:
    reason = _prefill_can_stop(s, r)
    if reason:
        return reason
    row = s.requests[r]
    if not row[CANCEL] and row[CLIENT] != GONE:
        return "neither a cancel nor a client abort asks the prefill to stop"
    return _stop_prefill(m, s, r, row[CLIENT])


def prefill_fail(m: Model, s: State, r: int) -> Change | str:
    reason = _prefill_can_stop(s, r)
    if reason:
        return reason
    if s.requests[r][CLIENT] != WAITING:
        return "the client is not waiting"
    return _stop_prefill(m, s, r, ERR_PREFILL)


def answer_cancel(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if not row[CANCEL]:
        return "no cancel is in flight"
    word = FINAL_WORD.get(row[PST])
    if word is None:
        return f"the prefill state is {PREFILL_NAMES[row[PST]]}: it has no final word yet"
    return _one(r, _row(row, CANCEL, 0, FW, word, FW_COUNT, row[SENT]))


def _reserve_need(m: Model, row: tuple, s: "View | None" = None) -> int | str:
    """How many fresh pages Reserve takes: the prompt's, less the pages decode holds cached
    (with a prefix cache, given the view `s` to look them up in)."""
    if not row[BOOT]:
        return "no bootstrap is in flight"
    if row[DST] != D_NONE:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not None"
    if row[PROMPT] > m.decode_pages:
        return "the prompt is longer than the decode pool: it must be rejected"
    if m.prefix_cache and s is not None:
        return row[PROMPT] - len(hit_pages(m, s, row))
    return row[PROMPT]


def reserve(m: Model, s: State, r: int, pages: tuple) -> Change | str:
    """Decode takes the bootstrap: it references the pages it holds cached for the prompt's
    first k pages (prefix cache) and reserves `pages`, fresh, for the rest, each with a
    fresh tag; it tells the prefill k with the table (a full hit too, but FullHitNoNotice)."""
    row = s.requests[r]
    need = _reserve_need(m, row, s)
    if type(need) is str:
        return need
    pool = s.decode_pool
    bad = _check_pages(pool, decode_pages_of(m, s, row), pages, need, "decode")
    if bad:
        return bad
    hits = hit_pages(m, s, row)
    for p in pages:
        if pool[p][READERS] or p in hits:
            return f"decode page {p + 1} is cached and read: it is not free"
    changes, table = _referenced(pool, r, hits, READERS), tuple((p, pool[p][GEN]) for p in hits)
    bump = 0 if "NoGenBump" in m.bugs else 1
    # A fresh page may be an idle cached one: reserving it evicts it (its key goes).
    changes += tuple((p, (r, gen + bump, data, tag, readers, NO_IDENT, kv, tid))
                     for p in pages for _, gen, data, tag, readers, _, kv, tid in (pool[p],))
    table += tuple((p, pool[p][GEN] + bump) for p in pages)
    told = told_hit(m, row, len(hits))
    if len(hits) == row[PROMPT] and "FullHitNoNotice" in m.bugs:  # the bug: no word to prefill
        new = _row(row, BOOT, 0, DST, DECODING, DFW, 1, TABLE, table, HIT, told)
    else:  # published: the prefill receives the same table and hit length (PTABLE, PHIT)
        new = _row(row, BOOT, 0, DST, D_WAITING, TABLE, table, PTABLE, table, HIT, told,
                   PHIT, told)
    return Change(((r, new),), decode=changes)


def _referenced(pool, r: int, hits: tuple, readers: int) -> tuple:
    """The cached pages `hits` with r among their readers (the pool's field `readers`:
    decode's READERS or the prefill's P_READERS; both sides' reference)."""
    return tuple((p, pool[p][:readers] + (tuple(sorted(pool[p][readers] + (r,))),)
                  + pool[p][readers + 1:]) for p in hits)


def decode_reject(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if not row[BOOT]:
        return "no bootstrap is in flight"
    if row[DST] != D_NONE:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not None"
    if row[PROMPT] <= m.decode_pages:
        return "the prompt fits the decode pool"
    return _one(r, _row(row, BOOT, 0, DST, CLOSING, *_cancel(m),
                        CLIENT, _client_error(row, ERR_TOO_LONG)))


def drop_bootstrap(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if not row[BOOT]:
        return "no bootstrap is in flight"
    if row[DST] != TOMB:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not Tomb"
    return _one(r, _row(row, BOOT, 0))


def checksums_match(m: Model, s: State, r: int) -> bool:
    """The data path's checksum verdict as the abstract page contents imply it (the spec's
    ChecksumsMatch): every page sent holds r's data; with a prefix cache (a prompt with
    tokens), the KV of r's own content identity, whoever computed it. The oracle for an
    observed verdict."""
    row = s.requests[r]
    pool = s.decode_pool
    table = row[TABLE]
    hit = row[HIT]  # the pages sent are those after the hit decode believes it holds
    for k in range(min(row[SENT], len(table) - hit)):  # a crash can empty the table
        page = pool[table[hit + k][0]]
        if row[TOKENS]:  # a prefix cache: the page may come from a source another computed
            if page[KV] != true_ident(row, hit + k + 1):
                return False
        elif page[DATA] != r:
            return False
    return True


def tags_match(m: Model, s: State, r: int) -> bool:
    """The tag check's verdict as the page contents imply it (the spec's TagsMatch): every
    page holds content written with the generation decode reserved it at and, with a prefix
    cache, tagged with the content identity r's own tokens and salt imply for it."""
    return row_tags_match(m, s.decode_pool, s.requests[r])


def row_tags_match(m: Model, pool: Sequence[tuple], row: tuple) -> bool:
    """tags_match for a request's row over its decode worker's pool."""
    for i, (page, gen) in enumerate(row[TABLE]):
        if pool[page][TAG] != gen or pool[page][TAG_IDENT] != tag_ident(m, row, i + 1):
            return False
    return True


def _transfer_fault(m: Model, row: tuple, checksums_ok: bool) -> bool:
    """Decode's checks on Done: the count, then the checksums the data path verified."""
    if "NoCountCheck" not in m.bugs and row[FW_COUNT] != len(row[TABLE]) - row[HIT]:
        return True
    return "NoChecksum" not in m.bugs and not checksums_ok


def _receive_final_word(m: Model, s: State, r: int, row: tuple) -> tuple:
    """What decode does with a final word that is not a Done it can accept. Where it keeps
    the final word it keeps the count of writes the word announces (Release waits for as
    many to land)."""
    d = row[DST]
    count = row[FW_COUNT]
    if d == D_NONE:
        if "NoTombstone" in m.bugs:
            return _row(row, FW, NO_MSG, FW_COUNT, 0)  # the bug: decode forgets r
        return _row(row, FW, NO_MSG, FW_COUNT, 0, DST, TOMB, DFW, 1, ANNOUNCED, count)
    if d == D_WAITING:
        return _row(row, FW, NO_MSG, FW_COUNT, 0, DST, CLOSING, DFW, 1, ANNOUNCED, count,
                    CLIENT, _client_error(row, word_answer(row[FW])))
    if d == CLOSING:
        return _row(row, FW, NO_MSG, FW_COUNT, 0, DFW, 1, ANNOUNCED, count)
    return _row(row, FW, NO_MSG, FW_COUNT, 0)  # Released, Tomb, Decoding: nothing left


def word_answer(word: int) -> int:
    """What decode answers a waiting client on a Reject or an Abort (the spec's
    WordAnswer): the prefill's own answer, ErrTooLong for a Reject (a prefill rejects only
    a prompt too long for its pool), so that the client's answer is the same whichever of
    the two reaches the serving edge first (they travel over two connections); ErrPrefill
    for an Abort."""
    return ERR_TOO_LONG if word == MSG_REJECT else ERR_PREFILL


def accept(m: Model, s: State, r: int, checksums_ok: bool) -> Change | str:
    row = s.requests[r]
    if row[FW] != MSG_DONE:
        return "no Done is in flight"
    if row[DST] == D_WAITING:
        count = row[FW_COUNT]
        if not _counted(m, row, count):  # verify only what has landed: wait for the rest
            return f"{row[LANDED]} of the {count} writes the Done announces have landed"
        if _transfer_fault(m, row, checksums_ok):
            row = _row(row, FW, NO_MSG, FW_COUNT, 0, DST, CLOSING, DFW, 1, ANNOUNCED, count,
                       CLIENT, _client_error(row, ERR_TRANSFER))
        else:  # good: with a prefix cache the pages it wrote are sealed
            row = _row(row, FW, NO_MSG, FW_COUNT, 0, DST, DECODING, DFW, 1, ANNOUNCED, count)
            return Change(((r, row),), decode=_sealed(m, s, r, row))
    else:
        row = _receive_final_word(m, s, r, row)
    return _one(r, row)


def _sealed(m: Model, s: State, r: int, row: tuple) -> tuple:
    """With a prefix cache, the pages an accepted transfer wrote, sealed (the spec's Seal):
    filed under their keys, owned by nobody, read by r."""
    if not m.prefix_cache:
        return ()
    pool = s.decode_pool
    return tuple((p, (NONE, gen, data, tag, (r,), cache_key(m, row, i + 1), kv, tid))
                 for i, (p, _) in enumerate(row[TABLE]) if i >= row[HIT]
                 for _, gen, data, tag, _, _, kv, tid in (pool[p],))


def notice(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if row[FW] != MSG_REJECT and row[FW] != MSG_ABORT:
        return "no Reject or Abort is in flight"
    return _one(r, _receive_final_word(m, s, r, row))


def finish(m: Model, s: State, r: int, tags_ok: bool) -> Change | str:
    row = s.requests[r]
    if row[DST] != DECODING:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not Decoding"
    if not tags_ok:  # the data path's tag check, on every read
        return _one(r, _row(row, DST, CLOSING, CLIENT, _client_error(row, ERR_TAG)))
    pool = s.decode_pool
    foreign = 0  # history for the properties: what the client really got
    for i, (page, _) in enumerate(row[TABLE]):
        if m.prefix_cache:  # content, not ownership: a shared page another request wrote
            if pool[page][KV] != true_ident(row, i + 1):
                foreign = 1
        elif pool[page][DATA] != r or pool[page][TAG] != pool[page][GEN]:
            foreign = 1
    return _one(r, _row(row, DST, CLOSING, CLIENT, _client_error(row, OK),
                        *((LEAKED, 1) if foreign else ())))


def abort(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if row[CLIENT] != WAITING:
        return f"the client is {CLIENT_NAMES[row[CLIENT]]}, not Waiting"
    return _one(r, _row(row, CLIENT, GONE))


def decode_abort(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if row[CLIENT] != GONE:
        return "the client has not gone"
    if row[DST] != D_WAITING and row[DST] != DECODING:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not Waiting or Decoding"
    # Holding the final word, decode has nothing to ask the prefill.
    return _one(r, _row(row, DST, CLOSING, *(() if row[DFW] else _cancel(m))))


def lease_lapsed(m: Model, s: State, r: int) -> bool:
    """The environment's synchrony assumption under which decode's lease lapses (the spec's
    LeaseLapsed): a working prefill renews it, so it lapses only once the prefill has gone
    silent on the request (it no longer works on it, and neither its final word nor a write
    of the request is on the way), unless timers may fire early (a shell's clock: its lease
    is what keeps them timely) or the deadline is a stopwatch (StopwatchTimeout). Not a guard
    decode evaluates: it only sees its clock (locality.py keeps this out of its reads)."""
    if m.early_timeouts or "StopwatchTimeout" in m.bugs:
        return True
    return prefill_silent(s, r)


def prefill_silent(s: State, r: int) -> bool:
    """The prefill no longer works on r, and neither its final word nor a write of r is on
    the way (the spec's PrefillSilent)."""
    row = s.requests[r]
    if row[PST] == QUEUED or row[PST] == RUNNING or row[FW] != NO_MSG:
        return False
    return not any(w[0] == r for w in s.writes)


def timeout(m: Model, s: State, r: int) -> Change | str:
    if "NoTimeout" in m.bugs:
        return "decode has no transfer timeout (NoTimeout)"
    row = s.requests[r]
    if row[DST] != D_WAITING:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not Waiting"
    if not lease_lapsed(m, s, r):
        return "the lease has not lapsed: the prefill is still at work on the request"
    return _one(r, _row(row, DST, CLOSING, *_cancel(m),
                        CLIENT, _client_error(row, ERR_TIMEOUT)))


def release(m: Model, s: State, r: int) -> Change | str:
    row = s.requests[r]
    if row[DST] != CLOSING:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not Closing"
    if "EagerRelease" not in m.bugs:
        if not row[DFW]:
            return "the prefill's final word has not arrived"
        if not _counted(m, row, row[ANNOUNCED]):
            return (f"{row[LANDED]} of the {row[ANNOUNCED]} writes the final word announced "
                    "have landed")
    return _released(m, s, r, row)


def _released(m: Model, s: State, r: int, row: tuple) -> Change:
    """`row` Released, and the pages of its table that r still owns free again (their
    generation and memory kept: pages are never zeroed). The cached pages it reads lose r
    as a reader and stay cached (the spec's DropReferences); NoRefCount frees them."""
    pool = s.decode_pool
    freed = []
    for page, _ in row[TABLE]:
        owner, gen, data, tag, readers, ident, kv, tid = pool[page]
        if owner == r:
            freed.append((page, (NONE, gen, data, tag, readers, ident, kv, tid)))
        elif r in readers:
            if "NoRefCount" in m.bugs:  # the bug: no count of readers, the page goes
                freed.append((page, (owner, gen, data, tag, (), NO_IDENT, kv, tid)))
            else:
                left = tuple(x for x in readers if x != r)
                freed.append((page, (owner, gen, data, tag, left, ident, kv, tid)))
    return Change(((r, _row(row, DST, RELEASED)),), decode=tuple(freed))




def prefill_crash(m: Model, s: State, p: int = 0) -> Change | str:
    """The prefill dies and restarts empty. Its queued and running requests are lost (their
    clients see an error), its pool is free again, and the writes it had posted are flushed
    with its queue pairs. It sends no notice: decode learns by timing out, and the restarted
    prefill answers the cancel with Abort. Cancels in flight reach the restarted prefill
    (decode re-sends outstanding cancels when the prefill reconnects). Only prefill worker
    p's requests, pages and writes are touched: the other workers carry on."""
    if not m.crashes:
        return "this model has no prefill crashes (Crashes = FALSE)"
    here = tuple(r for r, row in s.request_items() if row[PW] == p)
    # The restarted prefill has posted nothing for them (SENT 0): an Abort it sends later
    # announces no write, and the flushed writes never land.
    lost = tuple((r, _row(row, PST, ABORTED, SENT, 0, CLIENT, _client_error(row, ERR_PREFILL)))
                 for r in here for row in (s.requests[r],)
                 if row[PST] == QUEUED or row[PST] == RUNNING)
    # Writes of an early final word (EarlyDone) are lost too.
    if not lost and not any(w[0] in here for w in s.writes):
        return "no request is queued or running at the prefill: a crash loses nothing"
    pool = s.prefill_pool
    # Its cache index and every reference die with the process; the memory keeps its KV.
    freed = tuple((k, (NONE, pool[k][1], (), NO_IDENT)) for k in s.pages_of(p, m.prefill_pages)
                  if pool[k][0] != NONE or pool[k][P_READERS] or pool[k][P_IDENT])
    return Change(lost, prefill=freed, flushed=here)


def recovered_prefill_rows(rows: dict, events) -> dict:
    """What a restarted prefill knows of its previous lives, before it takes PrefillCrash:
    `rows` (request -> its row with the placement, prompt and client its router keeps, for
    every request placed there) with the prefill's state and count of posted writes as its
    own log says (`events`: every step its previous lives took, in order; a step is logged
    before anything it sends leaves the process, so the log holds every step its peers can
    have seen). Admit makes a request Running, each SendPage posts one write, SendDone,
    Reject and PrefillAbort end it with the final word each sends, and an earlier life's
    PrefillCrash ended what was still queued or running (as prefill_crash does). The new
    life's crash then ends what is still queued or running, and a cancel is answered with
    the final word of the state a request ended in (AnswerCancel)."""
    state = {r: [QUEUED, 0] for r in rows}
    for event in events:
        kind = type(event)
        if kind is PrefillCrash:
            for r, (st, _) in state.items():
                if st == QUEUED or st == RUNNING:
                    state[r] = [ABORTED, 0]
            continue
        here = state.get(event.request)
        if here is None:
            continue
        if kind is Admit:
            here[0] = RUNNING
        elif kind is SendPage:
            here[1] += 1
        elif kind is SendDone:
            here[0] = P_DONE
        elif kind is Reject:
            here[0] = REJECTED
        elif kind is PrefillAbort:
            here[0] = ABORTED
    return {r: _row(row, PST, state[r][0], SENT, state[r][1]) for r, row in rows.items()}


def decode_crash(m: Model, s: State, d: int = 0) -> Change | str:
    """The decode dies and restarts empty, in a new epoch. Every request it knew of, or had
    a bootstrap for in flight, is lost: its client sees an error and decode keeps it as a
    tombstone (the restarted decode drops every message of the old epoch, so a late
    bootstrap can never reserve again). Its pool is free again, but page generations
    survive the restart (they are issued from a counter that outlives the process), so no
    stale tag can look current. Writes in flight into the old memory registration fail and
    are flushed; the prefill learns from the broken connection (modelled as a cancel that no
    network loses: crash_notice) and stops or repeats its final word, which the restarted
    decode ignores. Each decode worker
    has epochs of its own: a crash of decode worker d touches only d's requests, pages and
    the writes into them."""
    if not m.decode_crashes:
        return "this model has no decode crashes (DecodeCrashes = FALSE)"
    revive = "NoEpochCheck" in m.bugs  # the bug: an old bootstrap looks new to the new life
    lost = []
    loses = False
    here = tuple(r for r, row in s.request_items() if row[DW] == d)
    for r in here:
        row = s.requests[r]
        dst = row[DST]
        if decode_knows(row):
            active = row[PST] == QUEUED or row[PST] == RUNNING
            revived = revive and row[BOOT]
            loses = loses or not revived or (dst == TOMB or active and not row[CANCEL]
                                             or row[CLIENT] == WAITING)
            forgotten = ((DST, D_NONE, DFW, 0, ANNOUNCED, 0) if revived
                         else (DST, TOMB, BOOT, 0))
            lost.append((r, _row(row, *forgotten, TABLE, (), PTABLE, (),
                                 CANCEL, 1 if active else row[CANCEL],
                                 CLIENT, _client_error(row, ERR_DECODE))))
    if not loses:
        return "decode knows of no request: a crash loses nothing"
    reset = "GenerationReset" in m.bugs  # the bug: the tag counter died with the process
    pool = s.decode_pool
    # The cache index and its readers die with the process; the memory keeps its KV.
    freed = tuple((k, (NONE, 0 if reset else gen, data, tag, (), NO_IDENT, kv, tid))
                  for k in s.pages_of(d, m.decode_pages)
                  for owner, gen, data, tag, readers, ident, kv, tid in (pool[k],)
                  if owner != NONE or (reset and gen) or readers or ident)
    held = _sources_of_failed_writes(s, here) if "EarlyDone" in m.bugs else ()
    return Change(tuple(lost), decode=freed, prefill=held, flushed=here)


def _sources_of_failed_writes(s: State, here: tuple) -> tuple:
    """The prefill frees the sources of a request it no longer runs as the failed
    completions of its flushed writes come back. There are such only with EarlyDone (a
    final word before the writes completed): elsewhere the spec's set is empty, and a
    shell's view is not read. In a shell's view the writes into one decode may come from
    other prefills: a page of this prefill's pool that r owns is r's own source (a request
    is admitted at one prefill); the sources at another prefill are that view's to free."""
    pool = s.prefill_pool
    freed = {}
    for r, p, _, _ in s.writes:
        if r not in here or p >= len(pool) or pool[p][0] != r or not s.has_request(r):
            continue
        pst = s.requests[r][PST]
        if pst != QUEUED and pst != RUNNING:
            freed[p] = _unowned(pool[p])
    return tuple(sorted(freed.items()))


def evict(m: Model, s: State, d: int, page: int) -> Change | str:
    """Decode forgets cached page `page` (0-based, of worker d's pool): any sealed page no
    request reads. Which one (least recently used, ...) is the implementation's policy; the
    spec allows every choice. The memory keeps its KV; the page is free for Reserve."""
    if not m.prefix_cache:
        return "this model has no prefix cache"
    p = s.pages_of(d, m.decode_pages)[page]
    owner, gen, data, tag, readers, ident, kv, tid = s.decode_pool[p]
    if ident == NO_IDENT:
        return f"decode page {page + 1} is not cached"
    if readers:
        return f"decode page {page + 1} has readers: it cannot be evicted"
    return Change(decode=((p, (owner, gen, data, tag, readers, NO_IDENT, kv, tid)),))


def prefill_evict(m: Model, s: State, q: int, page: int) -> Change | str:
    """The prefill forgets cached page `page` (0-based, of worker q's pool): any sealed page
    nobody reads and no write in flight reads out of (prefill_evictable; EvictWhileSending
    ignores both). Which one is the implementation's policy (LRU, ...); the spec allows
    every eligible choice. The memory keeps its KV."""
    if not m.prefill_cache:
        return "this model has no prefill-side cache"
    p = s.pages_of(q, m.prefill_pages)[page]
    owner, data, readers, ident = s.prefill_pool[p]
    if ident == NO_IDENT:
        return f"prefill page {page + 1} is not cached"
    if not prefill_evictable(m, s, p):
        return (f"prefill page {page + 1} is read by a request or by a write in flight: it "
                "cannot be evicted")
    return Change(prefill=((p, (owner, data, readers, NO_IDENT)),))


# A network that loses things for good (the model's losses; the spec's Losses). Faults: a
# message vanishes on the wire, a write vanishes and its poster is told it completed. A loss
# the poster is told of is no event: it posts again (a late delivery).

def lose_bootstrap(m: Model, s: State, r: int) -> Change | str:
    if "Bootstrap" not in m.losses:
        return "this network loses no bootstrap"
    row = s.requests[r]
    if not row[BOOT]:
        return "no bootstrap is in flight"
    return _one(r, _row(row, BOOT, 0))


def lose_final_word(m: Model, s: State, r: int) -> Change | str:
    if "FinalWord" not in m.losses:
        return "this network loses no final word"
    row = s.requests[r]
    if row[FW] == NO_MSG:
        return "no final word is in flight"
    return _one(r, _row(row, FW, NO_MSG, FW_COUNT, 0))


def decode_knows(row: tuple) -> bool:
    """Decode knows of the request (the spec's DecodeKnows): its bootstrap is on the way,
    or it holds pages for it. What a decode crash takes from it (a crash that takes
    nothing from any request is no step)."""
    return bool(row[BOOT]) or row[DST] == D_WAITING or row[DST] == DECODING \
        or row[DST] == CLOSING


def crash_notice(m: Model, row: tuple) -> bool:
    """The cancel in flight for r is a decode crash's notice (the spec's CrashNotice): the
    prefill's own failure detector (the broken connection, a lapsed heartbeat), which no
    network loses. Decode sends no cancel for a tombstone, so one in flight there is that
    notice. NoFailureDetector makes it a message like any other."""
    return row[DST] == TOMB and "NoFailureDetector" not in m.bugs


def lose_cancel(m: Model, s: State, r: int) -> Change | str:
    if "Cancel" not in m.losses:
        return "this network loses no cancel"
    row = s.requests[r]
    if not row[CANCEL]:
        return "no cancel is in flight"
    if crash_notice(m, row):
        return ("the prefill learns of decode's crash from its own failure detector: "
                "nothing on the wire to lose")
    return _one(r, _row(row, CANCEL, 0))


def lose_write(m: Model, s: State, r: int, page: int) -> Change | str:
    if "Write" not in m.losses:
        return "this network loses no write"
    for w in s.writes:
        if w[0] == r and w[2] == page:
            break
    else:
        return f"no write of this request into decode page {page + 1} is in flight"
    freed = ()
    pool = s.prefill_pool
    if s.requests[r][PST] != RUNNING and pool[w[1]][0] == r:
        freed = ((w[1], _unowned(pool[w[1]])),)  # its false completion frees the source
    return Change(prefill=freed, landed=(w,))


# Retransmission (the spec's ResendBootstrap, ResendCancel): what keeps liveness on a network
# that loses messages. Each is a timer resting on the environment's timing assumption that
# it outlasts a round trip (BootstrapUnanswered, CancelUnanswered, read as the spec reads
# them and kept out of the sender's reads by locality.py): it fires only once the message
# and its answer are off the wire, so without losses neither is ever enabled.

def bootstrap_unanswered(row: tuple) -> bool:
    return not row[BOOT] and row[DST] == D_NONE


def cancel_unanswered(row: tuple) -> bool:
    return not row[CANCEL] and row[FW] == NO_MSG


def bootstrap_resend_due(row: tuple) -> bool:
    """The router's resend timer would fire (the spec's BootstrapResendDue)."""
    return row[CLIENT] == WAITING and bootstrap_unanswered(row)


def cancel_resend_due(row: tuple) -> bool:
    """Decode's resend timer would fire (the spec's CancelResendDue)."""
    return row[DST] == CLOSING and not row[DFW] and cancel_unanswered(row)


def resend_bootstrap(m: Model, s: State, r: int) -> Change | str:
    if "NoRetransmit" in m.bugs:
        return "the router does not retransmit (NoRetransmit)"
    row = s.requests[r]
    if bootstrap_resend_due(row):
        return _one(r, _row(row, BOOT, 1))
    if row[CLIENT] != WAITING:
        return f"the client is {CLIENT_NAMES[row[CLIENT]]}, not Waiting"
    return "the bootstrap is on the wire or decode has answered it"


def resend_cancel(m: Model, s: State, r: int) -> Change | str:
    if "NoRetransmit" in m.bugs or "NoCancel" in m.bugs:
        return "decode does not retransmit a cancel (NoRetransmit or NoCancel)"
    row = s.requests[r]
    if cancel_resend_due(row):
        return _one(r, _row(row, CANCEL, 1))
    if row[DST] != CLOSING:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not Closing"
    if row[DFW]:
        return "decode holds the prefill's final word"
    return "the cancel or its answer is on the wire"


def writes_gone(s: State, r: int) -> bool:
    """No write of r is on the wire (the spec's WritesGone: the write timer's assumption)."""
    return not any(w[0] == r for w in s.writes)


def revoke_release(m: Model, s: State, r: int) -> Change | str:
    """Where the network may lose a write with its poster told it completed, decode's write
    timer: revoke the registration of r's pages (a late write lands nowhere), release them,
    and fail a transfer not yet accepted (the spec's RevokeRelease)."""
    if "Write" not in m.losses:
        return "this network loses no write silently: no write timer is armed"
    if "NoRevoke" in m.bugs:
        return "decode never revokes (NoRevoke)"
    row = s.requests[r]
    if row[DST] == D_WAITING:
        if row[FW] != MSG_DONE:
            return "no Done is in flight"
        if _counted(m, row, row[FW_COUNT]):
            return "every write the Done announces has landed: nothing to give up on"
        row = _row(row, FW, NO_MSG, FW_COUNT, 0, DFW, 1, ANNOUNCED, row[FW_COUNT],
                   CLIENT, _client_error(row, ERR_TRANSFER))
    elif row[DST] == CLOSING:
        if not row[DFW]:
            return "the prefill's final word has not arrived"
        if _counted(m, row, row[ANNOUNCED]):
            return "every write the final word announced has landed: Release frees the pages"
    else:
        return f"the decode state is {DECODE_NAMES[row[DST]]}, not Waiting or Closing"
    if not writes_gone(s, r):
        return "a write of this request is still on the wire"
    return _released(m, s, r, row)


def loss_recovery_due(m: Model, s: State, r: int) -> bool:
    """Something of r was lost and a timer is the designed recovery (the spec's
    LossRecoveryDue): a message's resend; decode's write timer for a write lost silently;
    or, for a final word lost while decode waits, decode's timeout (the prefill has gone
    silent on r: its cancel has the final word repeated)."""
    if not isinstance(resend_bootstrap(m, s, r), str) \
            or not isinstance(resend_cancel(m, s, r), str) \
            or not isinstance(revoke_release(m, s, r), str):
        return True
    return "FinalWord" in m.losses and s.requests[r][DST] == D_WAITING \
        and prefill_silent(s, r)


# ---------------------------------------------------------------------------------------
# Events: one type per TLA+ action, with the same name.

@dataclass(frozen=True, slots=True)
class Event:
    """An event the core is asked to take; its type name is the TLA+ action's name."""

    @property
    def action(self) -> str:
        return type(self).__name__

    def label(self, m: Model | None = None) -> str:
        return self.action

    def __str__(self) -> str:
        return self.label()


@dataclass(frozen=True, slots=True)
class RequestEvent(Event):
    request: int

    def label(self, m: Model | None = None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        return f"{self.action}({name})"


@dataclass(frozen=True, slots=True)
class WorkerEvent(Event):
    """An event of one worker as a whole (a crash), not of a request."""

    worker: int = 0  # 0-based, among the workers of its kind

    def label(self, m: Model | None = None) -> str:
        if m is None or m.one_pair:
            return self.action  # the labels of the models before worker sets
        names = (m.prefill_worker_names if self.action.startswith("Prefill")
                 else m.decode_worker_names)
        return f"{self.action}({names[self.worker]})"


@dataclass(frozen=True, slots=True)
class PrefillCrash(WorkerEvent):
    """A prefill worker dies and restarts empty (a fault)."""


@dataclass(frozen=True, slots=True)
class DecodeCrash(WorkerEvent):
    """A decode worker dies and restarts empty in a new epoch (a fault)."""


@dataclass(frozen=True, slots=True)
class Evict(WorkerEvent):
    """Decode forgets a cached page nobody reads (its cache's policy, not a fault)."""

    page: int = 0  # 0-based, in the decode worker's pool

    def label(self, m: Model | None = None) -> str:
        if m is None or m.one_pair:
            return f"Evict(page {self.page + 1})"
        return f"Evict({m.decode_worker_names[self.worker]}, page {self.page + 1})"


@dataclass(frozen=True, slots=True)
class PrefillEvict(WorkerEvent):
    """The prefill forgets a cached page of its own (its cache's policy, not a fault)."""

    page: int = 0  # 0-based, in the prefill worker's pool

    def label(self, m: Model | None = None) -> str:
        if m is None or m.one_pair:
            return f"PrefillEvict(page {self.page + 1})"
        return f"PrefillEvict({m.prefill_worker_names[self.worker]}, page {self.page + 1})"


@dataclass(frozen=True, slots=True)
class Arrive(RequestEvent):
    prompt_pages: int
    prefill_worker: int = 0  # the router's placement (ignored for a prompt it refuses)
    decode_worker: int = 0
    tokens: tuple = ()  # with a prefix cache: the prompt, one abstract token per page
    salt: int = 0       # with a prefix cache: the request's tenant

    def label(self, m: Model | None = None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        content = (f", tokens {tokens_text(self.tokens)}, salt {self.salt}"
                   if self.tokens else "")
        if m is None or m.one_pair:
            return f"Arrive({name}, {self.prompt_pages}{content})"
        return (f"Arrive({name}, {self.prompt_pages}, {m.prefill_worker_names[self.prefill_worker]}"
                f", {m.decode_worker_names[self.decode_worker]}{content})")


@dataclass(frozen=True, slots=True)
class Admit(RequestEvent):
    """Prefill allocates these source pages and computes the prompt's KV into them."""

    pages: tuple  # prefill pages, 0-based, ascending

    def label(self, m: Model | None = None) -> str:
        return _pages_label(self, m)


@dataclass(frozen=True, slots=True)
class Reserve(RequestEvent):
    """Decode takes the bootstrap and reserves these pages, each with a fresh tag."""

    pages: tuple  # decode pages, 0-based, ascending

    def label(self, m: Model | None = None) -> str:
        return _pages_label(self, m)


def _pages_label(event: RequestEvent, m: Model | None) -> str:
    name = m.request_names[event.request] if m else f"r{event.request + 1}"
    pages = "{" + ", ".join(str(p + 1) for p in event.pages) + "}"
    return f"{event.action}({name}, {pages})"


@dataclass(frozen=True, slots=True)
class LandWrite(RequestEvent):
    page: int  # the decode page the write lands in (0-based)

    def label(self, m: Model | None = None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        return f"LandWrite({name}, page {self.page + 1})"


@dataclass(frozen=True, slots=True)
class LoseWrite(RequestEvent):
    page: int  # the decode page the lost write was addressed to (0-based)

    def label(self, m: Model | None = None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        return f"LoseWrite({name}, page {self.page + 1})"


@dataclass(frozen=True, slots=True)
class Accept(RequestEvent):
    """Decode receives Done and checks the count and the checksums the data path verified."""

    checksums_ok: bool  # observed: every landed page's digest matched the sender's

    def label(self, m: Model | None = None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        return f"Accept({name}, checksums {'ok' if self.checksums_ok else 'bad'})"


@dataclass(frozen=True, slots=True)
class Finish(RequestEvent):
    """Decode's last step: it read every page, the data path checked every tag, and decode
    answers the client."""

    tags_ok: bool  # observed: every page read carried the tag decode reserved it with

    def label(self, m: Model | None = None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        return f"Finish({name}, tags {'ok' if self.tags_ok else 'bad'})"


def _simple(name: str, doc: str) -> type:
    cls = dataclass(frozen=True, slots=True)(type(name, (RequestEvent,), {"__doc__": doc}))
    cls.__module__ = __name__
    return cls


Reject = _simple("Reject", "Prefill rejects a prompt its pool can never hold.")
SendPage = _simple("SendPage", "Prefill posts the write of its next source page.")
SendDone = _simple("SendDone", "Prefill's writes have all landed: it sends Done and frees sources.")
PrefillAbort = _simple("PrefillAbort", "Prefill stops on a cancel or a client abort.")
PrefillFail = _simple("PrefillFail", "Prefill fails on its own (a fault).")
AnswerCancel = _simple("AnswerCancel", "An ended prefill repeats its final word on a cancel.")
DecodeReject = _simple("DecodeReject", "Decode rejects a prompt its pool can never hold.")
DropBootstrap = _simple("DropBootstrap", "Decode drops a bootstrap that arrives after a tombstone.")
Notice = _simple("Notice", "Decode receives a Reject or Abort.")
Abort = _simple("Abort", "The client disconnects (environment).")
DecodeAbort = _simple("DecodeAbort", "Decode notices the client has gone.")
Timeout = _simple("Timeout", "Decode gives up waiting for KV and cancels.")
Release = _simple("Release", "Decode frees the request's pages.")
LoseBootstrap = _simple("LoseBootstrap", "The network loses the bootstrap for good (a fault).")
LoseFinalWord = _simple("LoseFinalWord", "The network loses the final word for good (a fault).")
LoseCancel = _simple("LoseCancel", "The network loses the cancel for good (a fault).")
ResendBootstrap = _simple("ResendBootstrap", "The router re-sends a bootstrap decode has not "
                          "answered (a timer).")
ResendCancel = _simple("ResendCancel", "Decode re-sends a cancel the prefill has not answered "
                       "(a timer).")
RevokeRelease = _simple("RevokeRelease", "Decode's write timer: it revokes a request's pages "
                        "from the NIC and releases them (a timer, where writes can be lost "
                        "silently).")

# ---------------------------------------------------------------------------------------
# The action table: one row per TLA+ action, in the order the checker enumerates them.
# Every list of actions anywhere in kvproof (fair or not, faults, timers, what consumes a
# message, which worker takes it) is derived from this table.

# Messages and writes on the wire, by what consumes them. The page table decode publishes
# reaches the prefill with Reserve (PTABLE, the prefill's copy): no action consumes it.
BOOTSTRAP, FINAL_WORD_MSG, CANCEL_MSG, WRITE, CLIENT_GONE = (
    "bootstrap", "final word", "cancel", "write", "client gone")


@dataclass(frozen=True)
class ActionInfo:
    """Everything about an action except its guard and effect (which are its function)."""

    event: type
    worker: str         # who takes it: client, router, prefill, decode, network
    kind: str           # protocol (weakly fair in FairSpec), arrival, fault or timer
    consumes: tuple = ()        # the messages it takes off the wire, in dispatch order
    argument: str = ""          # the event's field besides the request, if any
    observed: Callable | None = None  # the oracle for the verdict the data path reports
    after_loss: bool = False    # a recovery from a loss: never enabled where nothing is lost
    prefix_cache: bool = False  # a prefix cache's: never enabled without one

    @property
    def fair(self) -> bool:
        return self.kind in ("protocol", "timer")


# The data path's verdicts as the page contents imply them, by their names in the spec
# (where Next passes them to Accept and Finish).
OBSERVATION_ORACLES = {"ChecksumsMatch": checksums_match, "TagsMatch": tags_match}

ACTION_TABLE: tuple[ActionInfo, ...] = (
    ActionInfo(Arrive, "router", "arrival", argument="prompt_pages"),
    ActionInfo(Admit, "prefill", "protocol", argument="pages"),
    ActionInfo(Reject, "prefill", "protocol"),
    ActionInfo(SendPage, "prefill", "protocol"),
    ActionInfo(LandWrite, "network", "protocol", (WRITE,), argument="page"),
    ActionInfo(SendDone, "prefill", "protocol"),
    ActionInfo(PrefillAbort, "prefill", "protocol", (CANCEL_MSG, CLIENT_GONE)),
    ActionInfo(PrefillFail, "prefill", "fault"),
    ActionInfo(AnswerCancel, "prefill", "protocol", (CANCEL_MSG,)),
    ActionInfo(Reserve, "decode", "protocol", (BOOTSTRAP,), argument="pages"),
    ActionInfo(DecodeReject, "decode", "protocol", (BOOTSTRAP,)),
    ActionInfo(DropBootstrap, "decode", "protocol", (BOOTSTRAP,)),
    ActionInfo(Accept, "decode", "protocol", (FINAL_WORD_MSG,), argument="checksums_ok",
               observed=checksums_match),
    ActionInfo(Notice, "decode", "protocol", (FINAL_WORD_MSG,)),
    ActionInfo(Finish, "decode", "protocol", argument="tags_ok", observed=tags_match),
    ActionInfo(Abort, "client", "fault"),
    ActionInfo(DecodeAbort, "decode", "protocol", (CLIENT_GONE,)),
    ActionInfo(Timeout, "decode", "timer"),
    ActionInfo(Release, "decode", "protocol"),
    ActionInfo(PrefillCrash, "prefill", "fault"),
    ActionInfo(DecodeCrash, "decode", "fault"),
    ActionInfo(LoseBootstrap, "network", "fault"),
    ActionInfo(LoseFinalWord, "network", "fault"),
    ActionInfo(LoseCancel, "network", "fault"),
    ActionInfo(LoseWrite, "network", "fault", argument="page"),
    ActionInfo(ResendBootstrap, "router", "timer", after_loss=True),
    ActionInfo(ResendCancel, "decode", "timer", after_loss=True),
    ActionInfo(RevokeRelease, "decode", "timer", after_loss=True),
    # The cache's policy: not fair (a cache need not evict), not a fault.
    ActionInfo(Evict, "decode", "policy", argument="page", prefix_cache=True),
    ActionInfo(PrefillEvict, "prefill", "policy", argument="page", prefix_cache=True),
)

# Action type -> its function. A dict rather than a table column so that a test can swap
# one action for a broken copy (monkeypatch.setitem) and see who notices.
ACTIONS: dict[type, Callable] = {
    Arrive: arrive, Admit: admit, Reject: reject, SendPage: send_page, LandWrite: land_write,
    SendDone: send_done, PrefillAbort: prefill_abort, PrefillFail: prefill_fail,
    AnswerCancel: answer_cancel, Reserve: reserve, DecodeReject: decode_reject,
    DropBootstrap: drop_bootstrap, Accept: accept, Notice: notice, Finish: finish, Abort: abort,
    DecodeAbort: decode_abort, Timeout: timeout, Release: release, PrefillCrash: prefill_crash,
    DecodeCrash: decode_crash, LoseBootstrap: lose_bootstrap, LoseFinalWord: lose_final_word,
    LoseCancel: lose_cancel, LoseWrite: lose_write, ResendBootstrap: resend_bootstrap,
    ResendCancel: resend_cancel, RevokeRelease: revoke_release, Evict: evict,
    PrefillEvict: prefill_evict,
}
assert tuple(ACTIONS) == tuple(info.event for info in ACTION_TABLE)
INFO = {info.event: info for info in ACTION_TABLE}
ACTION_NAMES = tuple(info.event.__name__ for info in ACTION_TABLE)
EVENT_TYPES = {info.event.__name__: info.event for info in ACTION_TABLE}
# Environment and fault actions; the rest are the protocol's own and are taken fairly.
UNFAIR_ACTIONS = frozenset(info.event.__name__ for info in ACTION_TABLE if not info.fair)
FAULT_ACTIONS = frozenset(info.event.__name__ for info in ACTION_TABLE if info.kind == "fault")
# The network's losses: faults a behaviour takes only finitely often (the spec's
# FiniteLosses), so the checker proves liveness on the graph without them.
LOSS_ACTIONS = frozenset(info.event.__name__ for info in ACTION_TABLE
                          if info.kind == "fault" and info.worker == "network")
TIMER_ACTIONS = frozenset(info.event.__name__ for info in ACTION_TABLE if info.kind == "timer")
# The recoveries from a loss (resends, decode's write timer): never enabled without Losses.
LOSS_RECOVERY_ACTIONS = frozenset(info.event.__name__ for info in ACTION_TABLE
                                  if info.after_loss)
# The prefix cache's own actions (Evict): never enabled without PrefixCache.
PREFIX_CACHE_ACTIONS = frozenset(info.event.__name__ for info in ACTION_TABLE
                                 if info.prefix_cache)
# The events that are signs of progress of a request's prefill and renew decode's transfer
# lease (LeaseLapsed in the spec; the shells' timers): the prefill's own actions on the
# request and its writes landing. A crash is a sign of nothing.
LEASE_RENEWALS = frozenset(info.event for info in ACTION_TABLE
                           if info.worker in ("prefill", "network")
                           and info.event is not PrefillCrash
                           and not (info.worker == "network" and info.kind == "fault"))
# The actions that take something of a request off the wire between the workers (the
# client-gone notice comes from the serving edge, not over that wire).
WIRE = (BOOTSTRAP, FINAL_WORD_MSG, CANCEL_MSG, WRITE)
DELIVERY_ACTIONS = frozenset(info.event.__name__ for info in ACTION_TABLE
                             if set(info.consumes) & set(WIRE))
# Message -> the actions that consume it, in the order `consumer` tries them.
CONSUMERS = {message: tuple(info.event for info in ACTION_TABLE if message in info.consumes)
             for message in (BOOTSTRAP, FINAL_WORD_MSG, CANCEL_MSG, WRITE, CLIENT_GONE)}
_WORKER_ACTIONS = (PrefillCrash, DecodeCrash, Evict, PrefillEvict)  # no request argument
# Per-request actions other than Arrive, the allocations and LandWrite (which are enumerated
# over their arguments), in table order; an observed action is enumerated with the verdict
# its oracle gives.
_SIMPLE_ACTIONS = tuple((info.event, ACTIONS[info.event]) for info in ACTION_TABLE
                        if info.event not in (Arrive, LandWrite, LoseWrite, Admit, Reserve,
                                              *_WORKER_ACTIONS))


# ---------------------------------------------------------------------------------------
# The public API for shells.

Result = Union[State, Refusal]


def decide(m: Model, s: State, event: Event) -> Change | Refusal:
    """The Change `event` makes in `s`, with the commands a shell carries out
    (spec/commands.py), or a Refusal naming why the protocol does not allow it. `s` is a
    core.View: a State, or a store's view of one worker pair."""
    out = change_for(m, s, event)
    return out if type(out) is Refusal else _with_commands(s, out)


def change_for(m: Model, s: State, event: Event) -> Change | Refusal:
    """The Change `event` makes in `s` without the shells' commands, or a Refusal. What a
    role's part of a split state decides on (spec/parts.py): commands are derived from whole
    rows, and a part holds only its own fields."""
    kind = type(event)
    fn = ACTIONS.get(kind)
    if fn is None:
        raise ProtocolMisuse(f"{event!r} is not a protocol event")
    if kind is Evict:
        if not (0 <= event.worker < m.decode_workers and 0 <= event.page < m.decode_pages):
            raise ProtocolMisuse(f"{event.label(m)} names no page of the decode workers")
        out = fn(m, s, event.worker, event.page)
        return Refusal(event, out) if type(out) is str else out
    if kind is PrefillEvict:
        if not (0 <= event.worker < m.prefill_workers and 0 <= event.page < m.prefill_pages):
            raise ProtocolMisuse(f"{event.label(m)} names no page of the prefill workers")
        out = fn(m, s, event.worker, event.page)
        return Refusal(event, out) if type(out) is str else out
    if kind is PrefillCrash or kind is DecodeCrash:
        workers = m.prefill_workers if kind is PrefillCrash else m.decode_workers
        if not 0 <= event.worker < workers:
            raise ProtocolMisuse(f"{event.action} names worker {event.worker}, of {workers}")
        out = fn(m, s, event.worker)
        return Refusal(event, out) if type(out) is str else out
    r = event.request
    if not s.has_request(r):
        raise ProtocolMisuse(f"request {r} does not exist ({len(s.requests)} requests)")
    argument = INFO[kind].argument
    if not argument:
        out = fn(m, s, r)
    elif kind is Accept:
        out = fn(m, s, r, bool(event.checksums_ok))
    elif kind is Finish:
        out = fn(m, s, r, bool(event.tags_ok))
    elif kind is LandWrite or kind is LoseWrite:
        if not 0 <= event.page < m.decode_pages * m.decode_workers:
            raise ProtocolMisuse(f"decode page {event.page} does not exist")
        out = fn(m, s, r, event.page)
    elif kind is Arrive:
        if not (0 <= event.prefill_worker < m.prefill_workers
                and 0 <= event.decode_worker < m.decode_workers):
            raise ProtocolMisuse(f"{event.label()} places the request on prefill "
                                 f"{event.prefill_worker}, decode {event.decode_worker}: of "
                                 f"{m.prefill_workers} x {m.decode_workers} workers")
        out = fn(m, s, r, event.prompt_pages, event.prefill_worker, event.decode_worker,
                 tuple(event.tokens), event.salt)
    else:
        if not isinstance(event.pages, tuple):
            raise ProtocolMisuse(f"{event.action}.pages must be a tuple of page numbers")
        out = fn(m, s, r, event.pages)
    return Refusal(event, out) if type(out) is str else out


_new_tuple = tuple.__new__  # a NamedTuple from a tuple of all its fields, no checks


def _with_commands(s: View, change: Change) -> Change:
    """The Change with the commands shells carry out (spec/commands.py derives them). On
    every shell decision: a change with no commands (a landing write) is returned as it is,
    and the others are built without namedtuple's keyword machinery."""
    commands = _commands.effects(s, change)
    if not commands:
        return change
    rows, decode, prefill, posted, landed, flushed, _ = change
    return _new_tuple(Change, (rows, decode, prefill, posted, landed, flushed, commands))


def apply(m: Model, s: State, event: Event) -> Result:
    """The state after `event`, or a Refusal naming why the protocol does not allow it."""
    out = decide(m, s, event)
    return out if type(out) is Refusal else commit(s, out)


# What a shell needs besides the verdict: how many pages an allocation must bring, which
# messages an event put in flight, and when nothing more can happen to a request.

def pages_to_admit(m: Model, row: tuple) -> int | str:
    """How many source pages the prefill must allocate to admit this request, or why not.
    From the row alone: a prefill-side cache's hits are not looked up (allocation_need
    does, on a view: what a shell with the prefill's cache asks instead)."""
    return _admit_need(m, row)


def pages_to_reserve(m: Model, row: tuple) -> int | str:
    """How many decode pages decode must reserve for this bootstrap, or why not."""
    return _reserve_need(m, row)




def message_in_flight(row: tuple) -> bool:
    """A message of this request is on its way: its bootstrap, a final word or a cancel."""
    return bool(row[BOOT] or row[FW] != NO_MSG or row[CANCEL])


def message_pending(row: tuple, message: str, worker: str | None = None) -> bool:
    """Whether `message` of this request may still be taken off the wire, so that a shell
    keeps it for `consumer` to name its action later: a bootstrap, a final word or a cancel
    while it is in flight (message_in_flight asks the three at once, on hot paths); a
    client-gone notice while its worker still has the request to let go of (the prefill:
    queued or running; decode: nothing reserved yet and the bootstrap on its way)."""
    if message == BOOTSTRAP:
        return bool(row[BOOT])
    if message == FINAL_WORD_MSG:
        return row[FW] != NO_MSG
    if message == CANCEL_MSG:
        return bool(row[CANCEL])
    if message == CLIENT_GONE and worker == "prefill":
        return row[PST] == QUEUED or row[PST] == RUNNING
    if message == CLIENT_GONE and worker == "decode":
        return row[DST] == D_NONE and bool(row[BOOT])
    raise ProtocolMisuse(f"no message {message!r} to {worker or 'a worker'} in the protocol")


def settled(row: tuple) -> bool:
    """Nothing can happen to this request any more, not even a fault: its client has its
    answer, prefill and decode are done with it, and no message of it is in flight. (Its
    writes are in flight only while the prefill runs.)"""
    return (row[CLIENT] != WAITING and row[CLIENT] != IDLE
            and row[PST] != QUEUED and row[PST] != RUNNING
            and row[DST] != D_WAITING and row[DST] != DECODING and row[DST] != CLOSING
            and not message_in_flight(row))


def enabled_for(m: Model, s: State, r: int) -> tuple[type, ...]:
    """The per-request actions whose guards hold for r now, in table order. An allocation
    counts as enabled when the protocol allows it, whether or not enough pages are free
    (the shell's allocator decides when); an observed action whatever the verdict (its
    guard never reads it); LandWrite when one of r's writes is in flight."""
    if not s.has_request(r):
        raise ProtocolMisuse(f"request {r} does not exist")
    return tuple(info.event for info in ACTION_TABLE
                 if info.event not in _WORKER_ACTIONS and is_enabled(m, s, r, info.event))


def is_enabled(m: Model, s: State, r: int, cls: type) -> bool:
    """Whether action `cls` of request r is enabled now, in the sense of enabled_for."""
    if cls is Admit or cls is Reserve:
        return type(allocation_need(m, s, cls, r)) is int
    if cls is LandWrite:
        return any(w[0] == r for w in s.writes)
    if cls is LoseWrite:
        return "Write" in m.losses and any(w[0] == r for w in s.writes)
    if cls is Arrive:
        return s.requests[r][CLIENT] == IDLE
    if INFO[cls].observed is not None:
        return type(ACTIONS[cls](m, s, r, True)) is not str
    return type(ACTIONS[cls](m, s, r)) is not str


def consumer(m: Model, s: State, r: int, message: str, worker: str | None = None) -> type | None:
    """The action that takes `message` of request r off the wire now: the one dispatch from
    an arriving message to its action (a bootstrap: Reserve, DecodeReject or DropBootstrap;
    a final word: Accept or Notice; a cancel: PrefillAbort or AnswerCancel; a client-gone
    notice: PrefillAbort or DecodeAbort, whichever worker it reached). None: nothing can
    take it yet (a cancel while the prefill's writes are in flight waits for them to land)
    or any more (the notice reached a worker that is done with r)."""
    for cls in CONSUMERS[message]:
        if (worker is None or INFO[cls].worker == worker) and is_enabled(m, s, r, cls):
            return cls
    return None


def allocation_need(m: Model, s: State, action: type, r: int) -> int | str:
    """How many free pages an Admit or Reserve of request r must name, or why none is
    enabled. `successors` enumerates every choice of pages, which only small pools afford;
    a shell with large pools asks this and lets its allocator (or a fuzzer) pick the pages."""
    if not s.has_request(r):
        raise ProtocolMisuse(f"request {r} does not exist")
    if action is Admit:
        return _admit_need(m, s.requests[r], s)
    if action is Reserve:
        return _reserve_need(m, s.requests[r], s)
    raise ProtocolMisuse(f"{action!r} is not an allocation (Admit or Reserve)")


def interned_events(cls: type, r: int):
    """The event of a per-request action for r, or for an observed action the pair of its
    events (verdict False, verdict True)."""
    if INFO[cls].observed is None:
        return cls(r)
    return cls(r, False), cls(r, True)


def step_with_oracle(m: Model, s: State, r: int, fn: Callable, observed, events):
    """(event, Change or refusal reason) of one per-request action when the data path is the
    abstract page contents: an observed action gets the verdict its oracle gives, which is
    computed only when the action is enabled (its guard never reads the verdict)."""
    if observed is None:
        return events, fn(m, s, r)
    out = fn(m, s, r, True)
    if type(out) is str or observed(m, s, r):
        return events[1], out
    return events[0], fn(m, s, r, False)


def observation_conflict(m: Model, s: State, event: Event) -> str:
    """Why an observation a shell reported contradicts the abstract page contents, or "".
    Shells whose data path is real (the engine) report what they measured; the contents are
    the oracle, and a contradiction is flagged: a "clean" over foreign data is a data-path
    guard that failed, a "bad" over clean data is corruption the model did not predict."""
    info = INFO.get(type(event))
    if info is None or info.observed is None:
        return ""
    reported = getattr(event, info.argument)
    expected = info.observed(m, s, event.request)
    if bool(reported) == expected:
        return ""
    return (f"{event.label()} reports {info.argument}={bool(reported)}, but the page contents "
            f"say {expected}")


class _EventCache:
    """Interned event objects, so that enumeration allocates no events."""

    def __init__(self, m: Model, arrivals: bool = True) -> None:
        self.placements = tuple((p, d) for p in range(m.prefill_workers)
                                for d in range(m.decode_workers))
        # Arrive(r, n) for a prompt the router refuses (placed nowhere), then one per placement;
        # with a prefix cache, each for every prompt of n tokens and every salt.
        self.arrive = [[(tuple(Arrive(r, n, 0, 0, t, salt) for t, salt in _contents(m, n)),
                         tuple(Arrive(r, n, p, d, t, salt) for p, d in self.placements
                               for t, salt in _contents(m, n)))
                        for n in range(m.max_prompt_pages + 1)] for r in range(m.requests)
                       ] if arrivals else []
        self.evict = tuple(Evict(d, p) for d in range(m.decode_workers)
                           for p in range(m.decode_pages))
        self.prefill_evict = tuple(PrefillEvict(q, p) for q in range(m.prefill_workers)
                                   for p in range(m.prefill_pages))
        pages = m.decode_pages * m.decode_workers
        self.land = [[LandWrite(r, p) for p in range(pages)] for r in range(m.requests)]
        self.lose = [[LoseWrite(r, p) for p in range(pages)] for r in range(m.requests)]
        self.crashes = (tuple(PrefillCrash(p) for p in range(m.prefill_workers)),
                        tuple(DecodeCrash(d) for d in range(m.decode_workers)))
        self.simple = [[(interned_events(cls, r), fn, INFO[cls].observed)
                        for cls, fn in _SIMPLE_ACTIONS] for r in range(m.requests)]
        self.admit: dict[tuple, Admit] = {}
        self.reserve: dict[tuple, Reserve] = {}


def _arrivals(r: int, n: int, contents, placements) -> tuple[tuple, tuple]:
    """Arrive(r, n) with each of these contents: refused (placed nowhere), then placed."""
    contents = tuple(contents)
    return (tuple(Arrive(r, n, 0, 0, t, salt) for t, salt in contents),
            tuple(Arrive(r, n, p, d, t, salt) for p, d in placements for t, salt in contents))


_CACHES_WITHOUT_ARRIVALS: dict[Model, "_EventCache"] = {}


def _cache_without_arrivals(m: Model) -> "_EventCache":
    """The event cache of a model with a prefix cache, its arrivals left to the caller."""
    cache = _CACHES_WITHOUT_ARRIVALS.get(m)
    if cache is None:
        cache = _CACHES_WITHOUT_ARRIVALS[m] = _EventCache(m, arrivals=False)
    return cache


def _contents(m: Model, n: int) -> tuple:
    """Every (tokens, salt) a prompt of n pages may carry (the spec's PromptsOf, SaltsOf)."""
    if not m.prefix_cache:
        return (((), 0),)
    return tuple((t, salt) for t in product(range(1, m.tokens + 1), repeat=n)
                 for salt in range(1, m.tenants + 1))


_CACHES: dict[Model, _EventCache] = {}


def _cache(m: Model) -> _EventCache:
    cache = _CACHES.get(m)
    if cache is None:
        cache = _CACHES[m] = _EventCache(m)
    return cache


def _allocations(m: Model, s: State, r: int, cache: _EventCache):
    """Every Admit and Reserve enabled for r: one per choice of free pages."""
    row = s.requests[r]
    need = _admit_need(m, row, s)
    if type(need) is int:
        hits = prefill_hit_pages(m, s, row)
        free = [p for p in prefill_pages_of(m, s, row)
                if p not in hits and prefill_free(m, s, p)]
        for pages in combinations(free, need):
            event = cache.admit.get((r, pages)) or cache.admit.setdefault((r, pages),
                                                                          Admit(r, pages))
            yield event, commit(s, admit(m, s, r, pages))
    need = _reserve_need(m, row, s)
    if type(need) is int:
        pool = s.decode_pool
        hits = hit_pages(m, s, row)
        free = [p for p in decode_pages_of(m, s, row)
                if pool[p][OWNER] == NONE and not pool[p][READERS] and p not in hits]
        for pages in combinations(free, need):
            event = cache.reserve.get((r, pages)) or cache.reserve.setdefault(
                (r, pages), Reserve(r, pages))
            yield event, commit(s, reserve(m, s, r, pages))


def successors(m: Model, s: State, contents=None) -> Iterator[tuple[Event, State]]:
    """Every enabled event with the state it leads to, in a fixed order. `contents(r, n)`,
    when given, names the (tokens, salt) an Arrive of r with n pages may carry, instead of
    every prompt over 1..Tokens with every salt (a shell's Tokens is too many to list: a
    trace validator passes what its recorded state shows)."""
    cache = _cache(m) if contents is None else _cache_without_arrivals(m)
    for r in range(m.requests):
        if s.requests[r][CLIENT] == IDLE:
            for n in range(1, m.max_prompt_pages + 1):
                if contents is None:
                    refused, placed = cache.arrive[r][n]
                else:
                    refused, placed = _arrivals(r, n, contents(r, n), cache.placements)
                for event in (refused if n > m.advertised_context_pages else placed):
                    yield event, commit(s, arrive(m, s, r, n, event.prefill_worker,
                                                  event.decode_worker, event.tokens, event.salt))
            continue
        yield from _allocations(m, s, r, cache)
        for events, fn, observed in cache.simple[r]:
            event, out = step_with_oracle(m, s, r, fn, observed, events)
            if type(out) is not str:
                yield event, commit(s, out)
    for w in s.writes:
        yield cache.land[w[0]][w[2]], commit(s, land_write(m, s, w[0], w[2]))
    if m.crashes:
        for event in cache.crashes[0]:
            out = prefill_crash(m, s, event.worker)
            if type(out) is not str:
                yield event, commit(s, out)
    if m.decode_crashes:
        for event in cache.crashes[1]:
            out = decode_crash(m, s, event.worker)
            if type(out) is not str:
                yield event, commit(s, out)
    if "Write" in m.losses:
        for w in s.writes:
            yield cache.lose[w[0]][w[2]], commit(s, lose_write(m, s, w[0], w[2]))
    if m.prefix_cache:
        for event in cache.evict:
            out = evict(m, s, event.worker, event.page)
            if type(out) is not str:
                yield event, commit(s, out)
    if m.prefill_cache:
        for event in cache.prefill_evict:
            out = prefill_evict(m, s, event.worker, event.page)
            if type(out) is not str:
                yield event, commit(s, out)








# Commands are derived from a Change in their own module, which reads this one's names (a
# module, not its function: spec.commands may be the one imported first).
import spec.commands as _commands  # noqa: E402
