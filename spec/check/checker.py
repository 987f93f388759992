"""Explicit-state model checking of the protocol core, breadth first.

Like TLC, the checker keeps a 64-bit fingerprint of every state it has seen (Python's hash of
the state's tuple of ints: the same in every process and run), a queue of states to expand,
and for each state the index of its parent and the event that reached it, so that the first
violation found is reported with a shortest trace from the initial state. With symmetry the
fingerprint is taken of the canonical representative (spec/check/symmetry.py).

Checked on every distinct state: the state invariants. Checked on every state where no fair
action is enabled ("at rest"): the rest invariants; such a state with no event enabled at
all is reported as a deadlock. Liveness: the checker records the state graph and proves it
acyclic (and that no action stutters); on an acyclic graph every behaviour under weak
fairness of the protocol's actions ends at rest, so the rest invariants decide
EveryRequestEnds and PagesComeBack. A cycle is reported as a lasso trace. The network's
losses (core.LOSS_ACTIONS) are left out of that graph: a lossy model's liveness is claimed
under the spec's FiniteLosses (from some point on the network loses nothing), and a
behaviour that takes finitely many loss steps ends in the loss-free graph, which is then
the one that must be acyclic. A retransmission that is lost and sent again for ever is a
cycle only through loss steps, and excluded by that assumption, not by the checker.

Reachability: a model in which no behaviour ends with a client answered Ok checks nothing
worth having (every property holds vacuously of a protocol that never succeeds). So the
checker keeps the first state it finds in which a client has Ok, and returns a shortest
behaviour to it, the *witness* (`CheckResult.witness`); `kvproof check` prints it, and fails
a model whose complete state graph has none.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

from spec import core
from spec.core import Event, State
from spec.model import Model, ModelError
from spec.properties import (QUIET_INVARIANTS, REST_INVARIANTS, STATE_INVARIANTS,
                             STEP_PROPERTIES, Violation, first_step_failure)
from spec.check.tlccount import WAYS as TLC_WAYS
from spec.check.symmetry import canonical, orbit_size



@dataclass
class CheckResult:
    model: Model
    symmetry: bool
    distinct_states: int = 0
    states_generated: int = 0
    # TLC's convention: initial states plus every successor TLC's enumeration of the spec
    # produces, duplicates included (spec/check/tlccount.py); `transitions` counts each
    # enabled event once (the figure kvproof reported as generated before, minus one).
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    violation: Violation | None = None   # the first found (a shortest one)
    # With keep_going: the first violation of every property violated, in the order found.
    violations: list[Violation] = field(default_factory=list)
    invariants: tuple[str, ...] = ()
    workers: int = 1
    liveness_checked: bool = False
    rest_states: int = 0
    edges: int = 0
    left_on_queue: int = 0
    # Per action: distinct states it discovered first, and transitions it generated.
    action_counts: dict[str, int] = field(default_factory=dict)
    action_transitions: dict[str, int] = field(default_factory=dict)
    # A shortest behaviour that ends with a client answered Ok, or None if none was found.
    witness: list | None = None
    # With symmetry and orbits=True: the states of the orbits the search expanded (the sum
    # of their sizes). When the search ends with nothing left on the queue, this is the
    # number of distinct states of the search without symmetry (spec/check/symmetry.py,
    # orbit_size), counted without running it.
    orbit_states: int | None = None

    @property
    def states_without_symmetry(self) -> int | None:
        """The orbit sum once it counts every state: the search ended with nothing queued."""
        return self.orbit_states if not self.left_on_queue else None

    @property
    def ok(self) -> bool:
        return self.violation is None

    @property
    def ok_unreachable(self) -> bool:
        """The whole graph was explored and no state has a client answered Ok."""
        return self.witness is None and self.left_on_queue == 0 and self.violation is None

    @property
    def collision_probability(self) -> float:
        """TLC's optimistic estimate for 64-bit fingerprints: n * generated / 2^64."""
        return self.distinct_states * self.states_generated / 2.0**64


Progress = Callable[[int, int, int, float], None]  # distinct, generated, depth, seconds


class _Graph:
    """Successor lists in breadth-first order: states are expanded in index order."""

    def __init__(self) -> None:
        self.offsets = array("q", [0])
        self.targets = array("q")

    def add(self, successor_indices: list[int]) -> None:
        self.targets.extend(successor_indices)
        self.offsets.append(len(self.targets))

    def add_many(self, successor_indices: list[int], counts) -> None:
        """Several states' successor lists at once: `counts` says how many are each's."""
        end = len(self.targets)
        self.targets.extend(successor_indices)
        self.offsets.extend(end + total for total in accumulate(counts))

    def find_cycle(self, n: int) -> list[int] | None:
        """A cycle as a list of state indices (first == last), or None. Iterative DFS."""
        WHITE, GREY, BLACK = 0, 1, 2
        colour = bytearray(n)
        offsets, targets = self.offsets, self.targets
        for root in range(n):
            if colour[root] != WHITE:
                continue
            stack = [(root, offsets[root])]
            colour[root] = GREY
            while stack:
                node, pos = stack[-1]
                if pos == offsets[node + 1]:
                    colour[node] = BLACK
                    stack.pop()
                    continue
                stack[-1] = (node, pos + 1)
                nxt = targets[pos]
                if colour[nxt] == GREY:
                    path = [x for x, _ in stack]
                    return path[path.index(nxt):] + [nxt]
                if colour[nxt] == WHITE:
                    colour[nxt] = GREY
                    stack.append((nxt, offsets[nxt]))
        return None


# Explicit-state checking grows about 100x per request (DESIGN.md): beyond this it is
# hopeless. Larger models are for the fuzzer and the simulator, so the limit lives here and
# not in Model.
REQUESTS_MAX = 6


def step_failures(m: Model, checks, s: State, t: State, keep_going: bool) -> list[str]:
    """The step properties of `checks` the edge from s to t breaks (the first only, unless
    every one is wanted); all of them at once take one fused pass (a sixth of the cost)."""
    if len(checks) == len(STEP_PROPERTIES) and not keep_going:
        failed = first_step_failure(s, t)
        return [failed] if failed else []
    failed = [name for name, predicate in checks if not predicate(m, s, t)]
    return failed if keep_going else failed[:1]


def answered_ok(s: State) -> bool:
    """A client of this state has its Ok (only Finish gives one)."""
    for row in s.requests:
        if row[core.CLIENT] == core.OK:
            return True
    return False


class Checker:
    def __init__(self, m: Model, *, symmetry: bool = False,
                 invariants: tuple[str, ...] | None = None, liveness: bool = True,
                 progress: Progress | None = None, progress_every_s: float = 2.0,
                 max_states: int | None = None, keep_going: bool = False,
                 orbits: bool = False) -> None:
        if m.requests > REQUESTS_MAX:
            raise ModelError(f"requests={m.requests}: explicit-state checking beyond "
                             f"{REQUESTS_MAX} is hopeless (kvproof fuzz takes larger models)")
        self.m = m
        self.symmetry = symmetry
        known = (tuple(STATE_INVARIANTS) + tuple(REST_INVARIANTS) + tuple(QUIET_INVARIANTS)
                 + tuple(STEP_PROPERTIES))
        names = invariants if invariants is not None else known
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown propert(y/ies) {unknown}; known: {list(known)}")
        self.invariant_names = tuple(names)
        self.state_checks = [(n, STATE_INVARIANTS[n]) for n in names if n in STATE_INVARIANTS]
        self.rest_checks = [(n, REST_INVARIANTS[n]) for n in names if n in REST_INVARIANTS]
        self.quiet_checks = [(n, QUIET_INVARIANTS[n]) for n in names if n in QUIET_INVARIANTS]
        # Step properties are checked on every edge, before symmetry maps the successor to
        # its representative (a step compares the same requests on both sides).
        self.step_checks = [(n, STEP_PROPERTIES[n]) for n in names if n in STEP_PROPERTIES]
        self.liveness = liveness
        self.progress = progress
        self.progress_every_s = progress_every_s
        self.max_states = max_states
        # TLC's -continue: record the first (shortest) violation of each property and go on
        # exploring, so that one run reports every property the model breaks.
        self.keep_going = keep_going
        if orbits and not symmetry:
            raise ValueError("orbits=True counts the states of a reduced search: it needs "
                             "symmetry=True")
        self.orbits = orbits

    def _failures(self, checks, s: State) -> list[str]:
        """The properties `s` violates: the first only, unless every one is wanted."""
        m = self.m
        failed = [name for name, predicate in checks if not predicate(m, s)]
        return failed if self.keep_going else failed[:1]

    def _step_failures(self, checks, s: State, t: State) -> list[str]:
        return step_failures(self.m, checks, s, t, self.keep_going)

    def _record(self, result: CheckResult, names: list[str], kind: str, index: int,
                parents: array, last_step: tuple | None = None) -> None:
        """Violations of `names` at the state with this index (or by the step `last_step`
        from it); with keep_going, each property is reported once (its first, shortest
        counterexample) and then no longer checked."""
        trace = self._trace(index, parents) + ([last_step] if last_step else [])
        for name in names:
            violation = Violation(name, kind=kind, trace=trace)
            result.violations.append(violation)
            if result.violation is None:
                result.violation = violation
        self.state_checks = [c for c in self.state_checks if c[0] not in names]
        self.rest_checks = [c for c in self.rest_checks if c[0] not in names]
        self.quiet_checks = [c for c in self.quiet_checks if c[0] not in names]
        self.step_checks = [c for c in self.step_checks if c[0] not in names]

    def _stop(self, result: CheckResult) -> bool:
        if self.keep_going:
            return not (self.state_checks or self.rest_checks or self.quiet_checks
                        or self.step_checks or self.liveness)
        return result.violation is not None

    def _key(self, s: State) -> int:
        return hash(canonical(s, self.m)) if self.symmetry else hash(s)

    def run(self) -> CheckResult:
        m = self.m
        result = CheckResult(m, self.symmetry, invariants=self.invariant_names)
        started = time.perf_counter()
        init = core.initial_state(m)
        if self.symmetry:
            init = canonical(init, m)
        index_of: dict[int, int] = {self._key(init): 0}
        parents = array("q", [-1])
        events: list[Event | None] = [None]
        depths = array("H", [0])
        graph = _Graph() if self.liveness else None
        self._index_of, self._events = index_of, events
        queue: deque[State] = deque([init])
        failed = self._failures(self.state_checks, init)
        if failed:
            self._record(result, failed, "invariant", 0, parents)
        generated = 1
        tlc_duplicates = 0
        expanded = 0
        witness: int | None = None  # the first state found with a client answered Ok
        next_report = started + self.progress_every_s
        successors = core.successors
        symmetry = self.symmetry
        action_counts: dict[str, int] = {}
        transitions: dict[str, int] = {}
        orbit_states = 0 if self.orbits else None
        while queue and not self._stop(result):
            s = queue.popleft()
            if orbit_states is not None:
                orbit_states += orbit_size(s, m)
            here = expanded
            expanded += 1
            fair_enabled = False
            step_enabled = False  # a protocol step other than a timer
            any_enabled = False
            child_indices: list[int] = []
            for event, nxt in successors(m, s):
                any_enabled = True
                generated += 1
                name = event.action
                transitions[name] = transitions.get(name, 0) + 1
                ways = TLC_WAYS.get(name)
                if ways is not None:  # TLC derives this successor that many times
                    tlc_duplicates += ways(m, s, event) - 1
                if not step_enabled and name not in core.UNFAIR_ACTIONS:
                    fair_enabled = True
                    step_enabled = name not in core.TIMER_ACTIONS
                if self.step_checks:
                    failed = self._step_failures(self.step_checks, s, nxt)
                    if failed:
                        self._record(result, failed, "step", here, parents, (event, nxt))
                        if self._stop(result):
                            break
                if symmetry:
                    nxt = canonical(nxt, m)
                k = hash(nxt)
                j = index_of.get(k)
                if j is None:
                    j = len(parents)
                    index_of[k] = j
                    parents.append(here)
                    events.append(event)
                    depths.append(depths[here] + 1)
                    queue.append(nxt)
                    action_counts[name] = action_counts.get(name, 0) + 1
                    if witness is None and name == "Finish" and answered_ok(nxt):
                        witness = j
                    failed = self._failures(self.state_checks, nxt)
                    if failed:
                        self._record(result, failed, "invariant", j, parents)
                        if self._stop(result):
                            break
                elif j == here:
                    raise AssertionError(f"{event.label(m)} leaves the state unchanged")
                if name not in core.LOSS_ACTIONS:  # finitely many losses: not in the graph
                    child_indices.append(j)
            if self._stop(result):
                break
            if graph is not None:
                graph.add(child_indices)
            if not step_enabled and self.quiet_checks:
                failed = self._failures(self.quiet_checks, s)
                if failed:
                    self._record(result, failed, "quiet", here, parents)
            if not fair_enabled:
                result.rest_states += 1
                failed = self._failures(self.rest_checks, s)
                if failed:
                    kind = "rest" if any_enabled else "deadlock"
                    self._record(result, failed, kind, here, parents)
            if self.progress is not None and time.perf_counter() >= next_report:
                self.progress(len(parents), generated + tlc_duplicates, depths[here],
                              time.perf_counter() - started)
                next_report = time.perf_counter() + self.progress_every_s
            if self.max_states is not None and len(parents) > self.max_states:
                raise RuntimeError(f"more than {self.max_states} distinct states; "
                                   "raise --max-states or check a smaller model")
        result.left_on_queue = len(queue)
        result.orbit_states = orbit_states
        result.distinct_states = len(parents)
        result.states_generated = generated + tlc_duplicates
        result.transitions = generated - 1
        result.depth = max(depths) if depths else 0
        result.action_counts = action_counts
        result.action_transitions = transitions
        if witness is not None:
            result.witness = self._trace(witness, parents)
        self._check_acyclic(result, graph, parents)
        result.seconds = time.perf_counter() - started
        return result

    def _check_acyclic(self, result: CheckResult, graph: _Graph | None, parents: array) -> None:
        """Liveness, once the graph is complete (with keep_going, after invariant
        violations too: a graph explored to the end is complete)."""
        complete = result.violation is None or (self.keep_going and result.left_on_queue == 0)
        if graph is None or not complete:
            return
        result.edges = len(graph.targets)
        cycle = graph.find_cycle(len(parents))
        result.liveness_checked = True
        if cycle is not None:
            stem = self._trace(cycle[0], parents)
            loop = self._replay_path(stem[-1][1], cycle)
            violation = Violation("Acyclicity", kind="cycle", trace=stem + loop,
                                  cycle_start=len(stem) - 1)
            result.violations.append(violation)
            result.violation = result.violation or violation

    # -- counterexamples ----------------------------------------------------------------

    def _trace(self, index: int, parents: array) -> list[tuple[Event | None, State]]:
        """A concrete trace from the initial state to the state with this index."""
        path = []
        while index != -1:
            path.append(index)
            index = parents[index]
        path.reverse()
        state = core.initial_state(self.m)
        trace: list[tuple[Event | None, State]] = [(None, state)]
        for j in path[1:]:
            event, state = self._step_to(state, j)
            trace.append((event, state))
        return trace

    def _step_to(self, state: State, j: int) -> tuple[Event, State]:
        """The event from `state` that reaches the state with index j (up to symmetry)."""
        wanted = self._events[j]
        candidates = [(event, nxt) for event, nxt in core.successors(self.m, state)
                      if self._index_of.get(self._key(nxt)) == j]
        if not candidates:
            raise AssertionError(f"no step reaches state {j}: the checker lost the trace")
        for event, nxt in candidates:
            if event.action == wanted.action:
                return event, nxt
        return candidates[0]

    def _replay_path(self, state: State, cycle: list[int]):
        steps = []
        for j in cycle[1:]:
            event, state = self._step_to(state, j)
            steps.append((event, state))
        return steps


def check(m: Model, **options) -> CheckResult:
    return Checker(m, **options).run()
