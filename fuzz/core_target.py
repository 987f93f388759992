"""The protocol core as a fuzz target: spec/core.py alone, at any size.

`core.successors` enumerates every choice of free pages for an allocation, which is what
makes the model checker exhaustive and what limits it to a few pages. Here the core is asked
how many pages an allocation needs (`core.allocation_need`) and the fuzzer picks which, so a
step costs the same at 64 pages as at 3. Every other event is enabled exactly when the core's
action function accepts it; a next state computed while listing moves is kept, so taking
that event costs a dictionary lookup.

This module is an adapter: it knows how the core lays out its state (which rows hold pages,
where writes are) so as to report observations, but it decides nothing about the protocol.
Its shortcuts rest on facts of the core, and tests/test_fuzz.py checks the listing against
core.successors under every zoo switch set: an idle request can only arrive, an ended one
(spec.properties.request_ended) has nothing enabled, and an action of a request reads only
that request's row, the pools and the writes.
"""

from __future__ import annotations

from dataclasses import fields

from spec import core
from spec.core import (
    CLIENT, CLIENT_NAMES, CLOSING, DATA, DECODING, DST, D_WAITING, NONE, OWNER, PST, RUNNING, SRC,
    TABLE,
)
from spec.model import Model
from spec.properties import request_ended

from fuzz.target import (Delay, Move, Observation, Open, PoolView, Target, TargetRefused,
                         read_field, decoding_reads, expected_reads, owned_pages,
                         owned_sources, register)


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


# The per-request events the core enumerates without a choice of argument (an observed
# verdict comes from the oracle), and the events with no argument at all, read off the
# core's action table so that a new action joins the vocabulary without an edit here.
_SIMPLE_CLASSES = tuple(cls for cls, _ in core._SIMPLE_ACTIONS)
# A worker's own events (its crash) have the worker as their one argument: listed once per
# worker of its kind. (Reading "no fields" here lost every crash once they gained a worker.)
# Evict (a cached page, prefix caching) has a page too: it is listed per cached page apart
# (`_evictions`), and only on a model with a prefix cache.
_GLOBAL_CLASSES = tuple(cls for cls in core.ACTIONS
                        if issubclass(cls, core.WorkerEvent) and not core.INFO[cls].prefix_cache)
assert {f for cls in _GLOBAL_CLASSES for f in _field_names(cls)} == {"worker"}, _GLOBAL_CLASSES
_NAMES = core.ACTION_NAMES  # moves are listed in the core's action order
_ALLOCATIONS = (core.Admit, core.Reserve)
_HOLDS_DECODE_PAGES = (D_WAITING, DECODING, CLOSING)
# The actions that take something of a request off the wire: a Delay holds them back.
_DELIVERIES = core.DELIVERY_ACTIONS
# The stalls a Delay may choose, in steps of this target (an event each).
STALLS_STEPS = (2, 5, 10, 20, 50)


@register("core")
class CoreTarget(Target):
    vocabulary = frozenset(core.ACTION_NAMES) | {"Delay"}

    def reset(self, model: Model, seed: int) -> None:
        # The core has no randomness of its own: the seed is unused.
        self.model = model
        self.state = core.initial_state(model)
        self._trace: list[core.Event] = []
        self._moves: dict[str, list[Move]] | None = None
        self._next: dict[core.Event, core.State] = {}
        self._observation: Observation | None = None
        self._reads: dict[int, tuple[int, ...]] = {}
        # Step at which each page was last freed (0: never used), for the free-list order.
        self._freed_at = ([0] * model.prefill_pages, [0] * model.decode_pages)
        self._prompts = tuple(range(1, model.max_prompt_pages + 1))
        self._since: dict[object, int] = {}  # move -> step at which it became enabled
        self._memo: list = [None] * model.requests  # per request: its last listing
        self._arrive = core.ACTIONS[core.Arrive]
        # Whether a request may arrive is asked with a one-page prompt (the fuzzer picks the
        # real one): with a prefix cache it has a token and a salt.
        self._probe = ((1,), 1) if model.prefix_cache else ((), 0)
        # The action functions are looked up at reset, not at import, so that a test can
        # swap one of core.ACTIONS for a broken copy and see whether the fuzzer notices.
        self._simple = tuple((cls.__name__, core.ACTIONS[cls], core.INFO[cls].observed)
                             for cls in _SIMPLE_CLASSES)
        self._global = tuple(
            (cls.__name__, core.ACTIONS[cls], cls(worker=k)) for cls in _GLOBAL_CLASSES
            for k in range(model.prefill_workers if cls is core.PrefillCrash
                           else model.decode_workers))
        self._events = [tuple(core.interned_events(cls, r) for cls in _SIMPLE_CLASSES)
                        for r in range(model.requests)]
        self._held: dict[int, int] = {}  # request -> the step its Delay ends at

    def enabled(self) -> dict[str, list[Move]]:
        if self._moves is None:
            self._moves = self._list_moves()
        return self._moves

    def _list_moves(self) -> dict[str, list[Move]]:
        m, s = self.model, self.state
        moves: dict[str, list[Move]] = {name: [] for name in _NAMES}
        self._next.clear()
        free: list = [None, None]  # per pool, computed when an allocation first needs it
        for r in range(m.requests):
            for name, move in self._request_moves(r, free):
                moves[name].append(move)
        # A write can land exactly when it is in flight (core.land_write's only guard); its
        # next state is computed when it is taken, since most listed writes are not.
        land = moves["LandWrite"]
        for w in s.writes:
            land.append(core.LandWrite(w[0], w[2]))
        for name, fn, event in self._global:
            out = fn(m, s, event.worker)
            if type(out) is not str:
                self._next[event] = core.commit(s, out)
                moves[name].append(event)
        if m.prefix_cache:
            moves["Evict"] = self._evictions()
        if m.prefill_cache:
            moves["PrefillEvict"] = self._evictions(core.PrefillEvict)
        self._hold(moves)
        return self._oldest_first({name: listed for name, listed in moves.items() if listed})

    def _evictions(self, cls: type = core.Evict) -> list[core.Event]:
        """An Evict (or PrefillEvict) for every page of decode's (or the prefill's) pool the
        core lets it forget now (core.evict, core.prefill_evict decide: a cached page nobody
        reads, and at the prefill no write reads out of). Pages that are not cached are not
        asked about: the core refuses every one of them."""
        m, s, evict, listed = self.model, self.state, core.ACTIONS[cls], []
        pool, ident = ((s.decode_pool, core.IDENT) if cls is core.Evict
                       else (s.prefill_pool, core.P_IDENT))
        for p, page in enumerate(pool):
            if page[ident] == core.NO_IDENT:
                continue
            out = evict(m, s, 0, p)
            if type(out) is not str:
                event = cls(0, p)
                self._next[event] = core.commit(s, out)
                listed.append(event)
        return listed

    def _hold(self, moves: dict[str, list[Move]]) -> None:
        """Take the deliveries of held requests off the list, and list a Delay for every
        request with something on the wire that is not held. When only held deliveries could
        move the protocol on, nothing is held: time jumps to the end of the stalls."""
        now, s = len(self._trace), self.state
        held = {r for r, until in self._held.items() if until > now}
        if held:
            kept = {name: [mv for mv in listed if mv.request not in held]
                    if name in _DELIVERIES else listed for name, listed in moves.items()}
            if any(listed for name, listed in kept.items()
                   if name not in core.UNFAIR_ACTIONS):
                moves.update(kept)
            else:
                self._held.clear()
                held = set()
        on_wire = {w[0] for w in s.writes}
        moves["Delay"] = [Open("Delay", r, 0, STALLS_STEPS) for r, row in enumerate(s.requests)
                          if r not in held and (r in on_wire or core.message_in_flight(row))]

    def _request_moves(self, r: int, free: list) -> list[tuple[str, Move]]:
        """Request r's enabled moves. An action of r reads r's row, the pools and the writes,
        never another request's row (core.py's representation), so when none of those has
        changed since the last listing, neither has the answer: most events change one row
        and leave the pools alone, and this skips asking the core again for the others."""
        m, s = self.model, self.state
        row = s.requests[r]
        if type(self._arrive(m, s, r, 1, 0, 0, *self._probe)) is not str:
            return [("Arrive", Open("Arrive", r, 0, self._prompts))]
        if request_ended(row):
            return []  # nothing of an ended request is enabled (its writes are listed apart)
        memo = self._memo[r]
        if (memo is not None and memo[0] is row and memo[1] is s.prefill_pool
                and memo[2] is s.decode_pool and memo[3] is s.writes):
            return memo[4]
        listed: list[tuple[str, Move]] = []
        for which, cls in enumerate(_ALLOCATIONS):
            need = core.allocation_need(m, s, cls, r)
            if type(need) is int:
                if free[which] is None:
                    free[which] = self._free_pages(which)
                options = free[which]
                if which == 1 and m.prefix_cache:  # not the pages r is about to hit
                    hits = core.hit_pages(m, s, row)
                    options = tuple(p for p in options if p not in hits) if hits else options
                elif which == 0 and m.prefill_cache:  # nor at the prefill
                    hits = core.prefill_hit_pages(m, s, row)
                    options = tuple(p for p in options if p not in hits) if hits else options
                if len(options) >= need:
                    listed.append((cls.__name__, Open(cls.__name__, r, need, options)))
        for k, (name, fn, observed) in enumerate(self._simple):
            event, out = core.step_with_oracle(m, s, r, fn, observed, self._events[r][k])
            if type(out) is not str:
                self._next[event] = core.commit(s, out)
                listed.append((name, event))
        self._memo[r] = (row, s.prefill_pool, s.decode_pool, s.writes, listed)
        return listed

    def _oldest_first(self, moves: dict[str, list[Move]]) -> dict[str, list[Move]]:
        """Each action's moves in the order they became enabled (the Target contract), so
        that a fuzzer can deliver in order, newest first, or in any order."""
        now, since, still = len(self._trace), self._since, {}
        for listed in moves.values():
            for move in listed:
                key = (move.action, move.request) if type(move) is Open else move
                still[key] = since.get(key, now)
            if len(listed) > 1:
                listed.sort(key=lambda move: still[(move.action, move.request)
                                                  if type(move) is Open else move])
        self._since = still
        return moves

    def _free_pages(self, which: int) -> tuple[int, ...]:
        """Free pages of the prefill (0) or decode (1) pool, least recently freed first
        (the order of _ALLOCATIONS)."""
        pool = self.state.prefill_pool if which == 0 else self.state.decode_pool
        freed_at = self._freed_at[which]
        free = [p for p, page in enumerate(pool) if page[0] == NONE]
        if which == 1 and self.model.prefix_cache:  # a page read from the cache is not free
            free = [p for p in free if not pool[p][core.READERS]]
        elif which == 0 and self.model.prefill_cache:  # nor a cached source read or sent from
            free = [p for p in free if core.prefill_free(self.model, self.state, p)]
        free.sort(key=freed_at.__getitem__)  # stable: ascending among equals
        return tuple(free)

    def holding(self) -> bool:
        now = len(self._trace)
        return any(until > now for until in self._held.values())

    def step(self, event: core.Event) -> None:
        if type(event) is Delay:  # the fuzzer's scheduling: no protocol state changes
            self._held[event.request] = len(self._trace) + 1 + event.stall
            self._trace.append(event)
            self._moves = None
            return
        out = self._next.get(event) if self._moves is not None else None
        if out is None:
            out = core.apply(self.model, self.state, event)
            if isinstance(out, core.Refusal):
                raise TargetRefused(str(out))
        before = self.state
        self.state = out
        self._trace.append(event)
        CoreTarget.events_committed += 1
        self._moves = None
        self._observation = None
        self._note_frees(before, out)
        if isinstance(event, core.Finish) and before.requests[event.request][DST] == DECODING:
            pool, read = before.decode_pool, read_field(self.model)
            self._reads[event.request] = tuple(
                pool[p][read] for p, _ in before.requests[event.request][TABLE])

    def _note_frees(self, before: core.State, after: core.State) -> None:
        step = len(self._trace)
        pairs = ((before.prefill_pool, after.prefill_pool, self._freed_at[0]),
                 (before.decode_pool, after.decode_pool, self._freed_at[1]))
        for old, new, freed_at in pairs:
            if old is new:
                continue
            for p, page in enumerate(new):
                if page[0] == NONE and old[p][0] != NONE:
                    freed_at[p] = step

    def protocol_state(self) -> core.State:
        return self.state

    def observe(self) -> Observation:
        if self._observation is None:
            self._observation = self._build_observation()
        return self._observation

    def _build_observation(self) -> Observation:
        s = self.state
        rows = s.requests
        decode = PoolView(
            "decode", tuple(page[OWNER] for page in s.decode_pool),
            tuple(owned_pages(row, s.decode_pool, r) if row[DST] in _HOLDS_DECODE_PAGES else ()
                  for r, row in enumerate(rows)))
        prefill = PoolView(
            "prefill", tuple(page[0] for page in s.prefill_pool),
            tuple(owned_sources(row, s.prefill_pool, r) if row[PST] == RUNNING else ()
                  for r, row in enumerate(rows)))
        return Observation(
            pools=(prefill, decode),
            writes=tuple((w[0], w[2]) for w in s.writes),
            outcomes=tuple(CLIENT_NAMES[row[CLIENT]] for row in rows),
            reads=dict(self._reads), decoding=decoding_reads(rows, s.decode_pool, self.model),
            expected=expected_reads(self.model, rows))

    def trace(self) -> list[core.Event]:
        return list(self._trace)
