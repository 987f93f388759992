"""Breadth-first checking with the expansion spread over worker processes (`--workers N`).

The expensive part of checking is expanding a state: enumerating its successors, taking
their canonical form, fingerprinting them and evaluating the invariants. That is done by N
processes of a concurrent.futures pool; the coordinator (this process) keeps what must be
one: the fingerprint table, the parent pointers, the queue and the liveness graph.

The queue is cut into chunks in index order and the results are taken back in the same
order (oldest future first), so the coordinator numbers new states exactly as the serial
checker does: the counts, the depth, the state graph and every counterexample (not only its
length) are the serial checker's. The coordinator stops at the same successor the serial
checker would stop at; work the pool did beyond it is thrown away.

To ship fewer states back, each worker remembers the fingerprints it has already returned
a state for and sends only the fingerprint the next time: the coordinator has that state's
index by then, because a worker runs its chunks in the order they were handed out and the
coordinator reads results in that order too.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from collections import deque

from spec import core
from spec.check.checker import CheckResult, Checker, _Graph, answered_ok
from spec.check.pool import process_pool
from spec.check.symmetry import canonical
from spec.check.tlccount import WAYS as TLC_WAYS
from spec.properties import (QUIET_INVARIANTS, REST_INVARIANTS, STATE_INVARIANTS,
                             STEP_PROPERTIES)

# States per task: big enough that pickling a task costs little next to expanding it,
# small enough that a level of a few thousand states still keeps every worker busy.
CHUNK_STATES = 1024
# Tasks handed out and not yet read back, per worker: enough that a worker never waits for
# the coordinator, few enough to bound the memory in flight. There is no barrier between
# BFS levels: a chunk goes out as soon as the queue holds one.
TASKS_IN_FLIGHT_PER_WORKER = 3

_worker: dict = {}


def _start_worker(m, symmetry: bool, state_names: tuple, rest_names: tuple,
                  quiet_names: tuple = (), step_names: tuple = ()) -> None:
    _worker.update(m=m, symmetry=symmetry, seen=set(),
                   state_checks=[(n, STATE_INVARIANTS[n]) for n in state_names],
                   rest_checks=[(n, REST_INVARIANTS[n]) for n in rest_names],
                   quiet_checks=[(n, QUIET_INVARIANTS[n]) for n in quiet_names],
                   step_checks=[(n, STEP_PROPERTIES[n]) for n in step_names])


def _failures(checks, m, s) -> tuple[str, ...]:
    return tuple(name for name, predicate in checks if not predicate(m, s))


def _expand(states: list) -> list:
    """Per state: whether a fair action is enabled and whether any is; its successors'
    fingerprints and action names; the successors this worker has not sent before, as
    (position, state, invariants it violates); and the rest invariants the state
    violates when no fair action is enabled. Fingerprints go as an array and events only
    with new states, because pickling is most of what parallel checking costs here."""
    m, symmetry, seen = _worker["m"], _worker["symmetry"], _worker["seen"]
    state_checks, rest_checks = _worker["state_checks"], _worker["rest_checks"]
    quiet_checks, step_checks = _worker["quiet_checks"], _worker["step_checks"]
    out = []
    for s in states:
        fair_enabled = step_enabled = any_enabled = False
        keys, actions, new, steps, duplicates = array("q"), [], [], [], 0
        for event, nxt in core.successors(m, s):
            any_enabled = True
            action = event.action
            ways = TLC_WAYS.get(action)
            if ways is not None:
                duplicates += ways(m, s, event) - 1
            if not step_enabled and action not in core.UNFAIR_ACTIONS:
                fair_enabled = True
                step_enabled = action not in core.TIMER_ACTIONS
            broken = tuple(name for name, predicate in step_checks if not predicate(m, s, nxt))
            if broken:
                steps.append((len(keys), broken))
            if symmetry:
                nxt = canonical(nxt)
            key = hash(nxt)
            if key not in seen:
                seen.add(key)
                new.append((len(keys), nxt, _failures(state_checks, m, nxt)))
            keys.append(key)
            actions.append(action)
        rest = () if fair_enabled else _failures(rest_checks, m, s)
        quiet = () if step_enabled else _failures(quiet_checks, m, s)
        out.append((fair_enabled, any_enabled, keys, actions, new, rest, quiet, steps,
                    duplicates))
    return out


class ParallelChecker(Checker):
    """The serial Checker's search, its expansion done by `workers` processes."""

    def __init__(self, m, *, workers: int, **options) -> None:
        super().__init__(m, **options)
        assert workers >= 2, "one worker is the serial Checker"
        self.workers = workers

    def run(self) -> CheckResult:
        names = tuple(tuple(n for n, _ in checks) for checks in (
            self.state_checks, self.rest_checks, self.quiet_checks, self.step_checks))
        # After a violation, chunks beyond it are still queued: the pool drops them.
        with process_pool(self.workers, _start_worker,
                          (self.m, self.symmetry, *names)) as pool:
            return self._search(pool)

    def _results(self, pool, queue: deque):
        """The expansion of every queued state, in queue order, as the queue grows: a
        chunk is handed out when CHUNK_STATES states wait, or whatever waits when nothing
        else is in flight (the end of the search, or a narrow level)."""
        in_flight: deque = deque()
        limit = TASKS_IN_FLIGHT_PER_WORKER * self.workers
        while queue or in_flight:
            while queue and len(in_flight) < limit and (
                    len(queue) >= CHUNK_STATES or not in_flight):
                take = min(CHUNK_STATES, len(queue))
                in_flight.append(pool.submit(_expand, [queue.popleft() for _ in range(take)]))
            yield from in_flight.popleft().result()

    def _search(self, pool) -> CheckResult:
        m = self.m
        result = CheckResult(m, self.symmetry, invariants=self.invariant_names,
                             workers=self.workers)
        started = time.perf_counter()
        init = canonical(core.initial_state(m)) if self.symmetry else core.initial_state(m)
        search = _Search(init, self._key(init), self.liveness)
        self._index_of, self._events = search.index_of, search.events
        failed = self._failures(self.state_checks, init)
        if failed:
            self._record(result, failed, "invariant", 0, search.parents)
        next_report = started + self.progress_every_s
        if not self._stop(result):
            for expanded in self._results(pool, search.states):
                self._take(search, expanded, result)
                if self.progress is not None and time.perf_counter() >= next_report:
                    self.progress(len(search.parents), search.generated + search.tlc_duplicates,
                                  search.depths[search.here], time.perf_counter() - started)
                    next_report = time.perf_counter() + self.progress_every_s
                if self.max_states is not None and len(search.parents) > self.max_states:
                    raise RuntimeError(f"more than {self.max_states} distinct states; "
                                       "raise --max-states or check a smaller model")
                if self._stop(result):
                    break
        result.left_on_queue = search.queued
        result.distinct_states = len(search.parents)
        result.states_generated = search.generated + search.tlc_duplicates
        result.transitions = search.generated - 1
        result.depth = max(search.depths)
        result.action_counts, result.action_transitions = search.counts, search.transitions
        if search.witness is not None:
            result.witness = self._trace(search.witness, search.parents)
        self._check_acyclic(result, search.graph, search.parents)
        result.seconds = time.perf_counter() - started
        return result

    def _take(self, search: "_Search", expanded: tuple, result: CheckResult) -> None:
        """One expanded state's successors, in the serial checker's order and with its
        bookkeeping; stops where the serial checker would stop."""
        fair_enabled, any_enabled, keys, actions, new, rest, quiet, steps, duplicates = expanded
        search.here += 1
        search.queued -= 1
        search.tlc_duplicates += duplicates
        here = search.here
        sent = {position: (state, failed) for position, state, failed in new}
        broken_steps = dict(steps)
        children: list[int] = []
        for position, key in enumerate(keys):
            name = actions[position]
            search.generated += 1
            failed = [f for f in broken_steps.get(position, ()) if f in dict(self.step_checks)]
            if failed:
                failed = failed if self.keep_going else failed[:1]
                self._record(result, failed, "step", here, search.parents,
                             self._breaking_step(here, search.parents, failed[0]))
                if self._stop(result):
                    return
            search.transitions[name] = search.transitions.get(name, 0) + 1
            j = search.index_of.get(key)
            if j is None:
                state, failed = sent[position]
                j = search.add(key, here, _ACTIONS.setdefault(name, _Action(name)), state, name)
                if search.witness is None and name == "Finish" and answered_ok(state):
                    search.witness = j
                failed = [f for f in failed if f in dict(self.state_checks)]
                if failed:
                    self._record(result, failed if self.keep_going else failed[:1],
                                 "invariant", j, search.parents)
                    if self._stop(result):
                        return
            elif j == here:
                raise AssertionError(f"{name} leaves the state unchanged")
            children.append(j)
        if search.graph is not None:
            search.graph.add(children)
        failed = [f for f in quiet if f in dict(self.quiet_checks)]
        if failed:
            self._record(result, failed if self.keep_going else failed[:1], "quiet", here,
                         search.parents)
        if not fair_enabled:
            result.rest_states += 1
            failed = [f for f in rest if f in dict(self.rest_checks)]
            if failed:
                self._record(result, failed if self.keep_going else failed[:1],
                             "rest" if any_enabled else "deadlock", here, search.parents)


    def _breaking_step(self, here: int, parents, name: str) -> tuple:
        """The step from the state with this index that breaks step property `name`: the
        workers send names, not events, so it is found again (only on a violation)."""
        state = self._trace(here, parents)[-1][1]
        for event, nxt in core.successors(self.m, state):
            if not STEP_PROPERTIES[name](self.m, state, nxt):
                return event, nxt
        raise AssertionError(f"no step from state {here} breaks {name}: the trace is lost")


@dataclass(frozen=True)
class _Action:
    """What a counterexample's reconstruction needs of the event that first reached a
    state: its action's name (Checker._step_to). Workers send the name, not the event:
    pickling ~10^6 events was a tenth of the parallel run's cost."""
    action: str


_ACTIONS: dict[str, _Action] = {}


class _Search:
    """The coordinator's side of the search: what the serial checker keeps in locals."""

    def __init__(self, init, key: int, liveness: bool) -> None:
        self.index_of: dict[int, int] = {key: 0}
        self.parents, self.depths = array("q", [-1]), array("H", [0])
        self.events: list = [None]
        self.states: deque = deque([init])
        self.graph = _Graph() if liveness else None
        self.queued = 1      # states in `states` or in chunks not yet read back
        self.generated, self.here = 1, -1
        self.tlc_duplicates = 0  # TLC counts these successors again (spec/check/tlccount.py)
        self.counts: dict[str, int] = {}
        self.transitions: dict[str, int] = {}
        self.witness: int | None = None  # the first state found with a client answered Ok

    def add(self, key: int, parent: int, event, state, action: str) -> int:
        """A state seen for the first time; its index."""
        j = len(self.parents)
        self.index_of[key] = j
        self.parents.append(parent)
        self.events.append(event)
        self.depths.append(self.depths[parent] + 1)
        self.states.append(state)
        self.queued += 1
        self.counts[action] = self.counts.get(action, 0) + 1
        return j
