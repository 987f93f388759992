"""Breadth-first checking with the expansion spread over worker processes (`--workers N`).

The expensive part of checking is expanding a state: enumerating its successors, taking
their canonical form, fingerprinting them and evaluating the invariants. That is done by N
processes of a concurrent.futures pool; the coordinator (this process) keeps what must be
one: the fingerprint table, the parent pointers, the queue and the liveness graph.

The queue is cut into chunks in index order and the results are taken back in the same
order (Executor.map keeps it), so the coordinator numbers new states exactly as the serial
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
from collections import deque
from concurrent.futures import ProcessPoolExecutor

from spec import core
from spec.check.checker import CheckResult, Checker, _Graph
from spec.check.symmetry import canonical
from spec.properties import REST_INVARIANTS, STATE_INVARIANTS

# States per task: big enough that pickling a task costs little next to expanding it,
# small enough that a level of a few thousand states still keeps every worker busy.
CHUNK_STATES = 1024

_worker: dict = {}


def _start_worker(m, symmetry: bool, state_names: tuple, rest_names: tuple) -> None:
    _worker.update(m=m, symmetry=symmetry, seen=set(),
                   state_checks=[(n, STATE_INVARIANTS[n]) for n in state_names],
                   rest_checks=[(n, REST_INVARIANTS[n]) for n in rest_names])


def _failures(checks, m, s) -> tuple[str, ...]:
    return tuple(name for name, predicate in checks if not predicate(m, s))


def _expand(states: list) -> list:
    """Per state: whether a fair action is enabled and whether any is; its successors'
    fingerprints and action names; the successors this worker has not sent before, as
    (position, event, state, invariants it violates); and the rest invariants the state
    violates when no fair action is enabled. Fingerprints go as an array and events only
    with new states, because pickling is most of what parallel checking costs here."""
    m, symmetry, seen = _worker["m"], _worker["symmetry"], _worker["seen"]
    state_checks, rest_checks = _worker["state_checks"], _worker["rest_checks"]
    out = []
    for s in states:
        fair_enabled = any_enabled = False
        keys, actions, new = array("q"), [], []
        for event, nxt in core.successors(m, s):
            any_enabled = True
            action = event.action
            if not fair_enabled and action not in core.UNFAIR_ACTIONS:
                fair_enabled = True
            if symmetry:
                nxt = canonical(nxt)
            key = hash(nxt)
            if key not in seen:
                seen.add(key)
                new.append((len(keys), event, nxt, _failures(state_checks, m, nxt)))
            keys.append(key)
            actions.append(action)
        rest = () if fair_enabled else _failures(rest_checks, m, s)
        out.append((fair_enabled, any_enabled, keys, actions, new, rest))
    return out


class ParallelChecker(Checker):
    """The serial Checker's search, its expansion done by `workers` processes."""

    def __init__(self, m, *, workers: int, **options) -> None:
        super().__init__(m, **options)
        assert workers >= 2, "one worker is the serial Checker"
        self.workers = workers

    def run(self) -> CheckResult:
        names = tuple(n for n, _ in self.state_checks), tuple(n for n, _ in self.rest_checks)
        with ProcessPoolExecutor(self.workers, initializer=_start_worker,
                                 initargs=(self.m, self.symmetry, *names)) as pool:
            return self._search(pool)

    def _chunks(self, queue: deque):
        """Chunks of the queue's states in order; the queue grows while they are read."""
        while queue:
            take = min(CHUNK_STATES, len(queue))
            yield [queue.popleft() for _ in range(take)]

    def _search(self, pool) -> CheckResult:
        m = self.m
        result = CheckResult(m, self.symmetry, invariants=self.invariant_names,
                             workers=self.workers)
        started = time.perf_counter()
        init = canonical(core.initial_state(m)) if self.symmetry else core.initial_state(m)
        index_of: dict[int, int] = {self._key(init): 0}
        parents, depths = array("q", [-1]), array("H", [0])
        events: list = [None]
        self._index_of, self._events = index_of, events
        graph = _Graph() if self.liveness else None
        failed = self._failures(self.state_checks, init)
        if failed:
            self._record(result, failed, "invariant", 0, parents)
        states: deque = deque([init])
        queued = 1        # states in `states` or in chunks not yet read back
        generated, here = 1, -1
        counts: dict[str, int] = {}
        transitions: dict[str, int] = {}
        next_report = started + self.progress_every_s
        while states and not self._stop(result):
            # One wave: the chunks of what is queued now; new states queue for the next.
            wave = list(self._chunks(states))
            for chunk_result in pool.map(_expand, wave):
                for fair_enabled, any_enabled, keys, actions, new, rest in chunk_result:
                    here += 1
                    queued -= 1
                    child_indices: list[int] = []
                    sent = {position: (event, state, failed)
                            for position, event, state, failed in new}
                    for position, key in enumerate(keys):
                        generated += 1
                        name = actions[position]
                        transitions[name] = transitions.get(name, 0) + 1
                        j = index_of.get(key)
                        if j is None:
                            event, state, failed = sent[position]
                            j = len(parents)
                            index_of[key] = j
                            parents.append(here)
                            events.append(event)
                            depths.append(depths[here] + 1)
                            states.append(state)
                            queued += 1
                            counts[name] = counts.get(name, 0) + 1
                            failed = [f for f in failed if f in dict(self.state_checks)]
                            if failed:
                                self._record(result, failed if self.keep_going else failed[:1],
                                             "invariant", j, parents)
                                if self._stop(result):
                                    break
                        elif j == here:
                            raise AssertionError(f"{name} leaves the state unchanged")
                        child_indices.append(j)
                    if self._stop(result):
                        break
                    if graph is not None:
                        graph.add(child_indices)
                    if not fair_enabled:
                        result.rest_states += 1
                        failed = [f for f in rest if f in dict(self.rest_checks)]
                        if failed:
                            self._record(result, failed if self.keep_going else failed[:1],
                                         "rest" if any_enabled else "deadlock", here, parents)
                    if self.progress is not None and time.perf_counter() >= next_report:
                        self.progress(len(parents), generated, depths[here],
                                      time.perf_counter() - started)
                        next_report = time.perf_counter() + self.progress_every_s
                    if self.max_states is not None and len(parents) > self.max_states:
                        raise RuntimeError(f"more than {self.max_states} distinct states; "
                                           "raise --max-states or check a smaller model")
                    if self._stop(result):
                        break
                if self._stop(result):
                    break
        result.left_on_queue = queued
        result.distinct_states = len(parents)
        result.states_generated = generated
        result.depth = max(depths) if depths else 0
        result.action_counts, result.action_transitions = counts, transitions
        self._check_acyclic(result, graph, parents)
        result.seconds = time.perf_counter() - started
        return result
