"""Breadth-first checking with the expansion spread over worker processes (`--workers N`).

The expensive part of checking is expanding a state: enumerating its successors, taking
their canonical form, fingerprinting them and evaluating the invariants. That is done by N
processes of a pool (spec/check/pool.py); the coordinator (this process) keeps what must be
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

The coordinator is the part that does not scale, so it touches no state. Two workers used
to be slower than one (119 s against 47 s on the default model) because the coordinator
unpickled every state a worker sent, kept it in its queue, pickled it again for the worker
that would expand it, and took the results a tuple per state: about as much work, in one
process, as the serial checker's whole search. Now a worker sends the states it found as
one pickled list; the coordinator keeps that list as bytes, with the positions in it of
the states that were new to the search, and hands the bytes out again with the task that
expands them. Results come back flat (arrays of fingerprints and action numbers, and
violations sparsely), and a task that breaks no property still checked is taken in one
pass; only a task with a violation is taken state by state, to stop exactly where the
serial checker stops. The coordinator talks to each worker over its own pair of pipes,
large enough to hold the tasks queued for it, so that a worker never waits for the
coordinator to be scheduled, and it shares what waits among the workers. It also tells each
worker the fingerprints the others found, so that few states are sent twice. On the small
model the coordinator now spends 0.3 s of CPU where the serial checker spends 2.0 s, and
the workers 2.6 s between them; with both cores free the check takes 1.5 s instead of 2.1
(bench/check_bench.py).
"""

from __future__ import annotations

import fcntl
import pickle
import time
from multiprocessing import Pipe
from multiprocessing.connection import wait
from array import array
from dataclasses import dataclass, field
from collections import Counter, deque

from spec import core
from spec.check.checker import CheckResult, Checker, _Graph, answered_ok, step_failures
from spec.check.pool import worker_processes
from spec.check.symmetry import canonical, orbit_size
from spec.check.tlccount import WAYS as TLC_WAYS
from spec.properties import (QUIET_INVARIANTS, REST_INVARIANTS, STATE_INVARIANTS,
                             STEP_PROPERTIES)

# States per task: big enough that pickling a task costs little next to expanding it,
# small enough that a level of a few thousand states still keeps every worker busy.
CHUNK_STATES = 1024
# The pieces in which a worker pickles the states it found: the unit a task can take.
SEGMENT_STATES = 128
# Tasks handed out and not yet read back, per worker: enough that a worker finds its next
# task in its pipe while the coordinator waits for an older result (results are read
# oldest first), few enough to bound the memory in flight. There is no barrier between BFS
# levels: a chunk goes out as soon as the queue holds one.
TASKS_IN_FLIGHT_PER_WORKER = 8
# The most fingerprints a worker remembers having sent (or been told of) before it forgets
# them all: without a bound each worker's set grows to every state of the search (88 bytes
# an orbit: 2.2 GB each at 26 M orbits of workers3-2x2, as much as half the coordinator's
# table). Forgetting only makes a worker send again a state the coordinator already has,
# which it drops (`_take_task`): the counts are unchanged.
SEEN_MAX = 4_000_000

_worker: dict = {}


def _start_worker(m, symmetry: bool, keep_going: bool, state_names: tuple,
                  rest_names: tuple, quiet_names: tuple = (), step_names: tuple = (),
                  orbits: bool = False) -> None:
    _worker.update(m=m, symmetry=symmetry, keep_going=keep_going, seen=set(), orbits=orbits,
                   state_checks=[(n, STATE_INVARIANTS[n]) for n in state_names],
                   rest_checks=[(n, REST_INVARIANTS[n]) for n in rest_names],
                   quiet_checks=[(n, QUIET_INVARIANTS[n]) for n in quiet_names],
                   step_checks=[(n, STEP_PROPERTIES[n]) for n in step_names])


def _failures(checks, m, s) -> tuple[str, ...]:
    return tuple(name for name, predicate in checks if not predicate(m, s))


@dataclass
class _Task:
    """One task's expansion, flat: a few arrays, not a tuple per state, because pickling
    and unpickling is most of what parallel checking costs. States are in task order,
    successors in the serial checker's order within each state, positions count the
    successors of the whole task."""
    successors: array = field(default_factory=lambda: array("I"))  # per state: how many
    keys: array = field(default_factory=lambda: array("q"))         # per successor
    actions: bytearray = field(default_factory=bytearray)           # index in ACTION_NAMES
    enabled: bytearray = field(default_factory=bytearray)  # per state: FAIR | ANY
    duplicates: array = field(default_factory=lambda: array("I"))   # per state, for TLC
    # The successors this worker had not sent before, in order: their positions, and the
    # list of them pickled in pieces of SEGMENT_STATES (`sent`); the positions (among
    # these) of those where a client has its Ok.
    new: array = field(default_factory=lambda: array("I"))
    new_from: array = field(default_factory=lambda: array("I"))  # the state, in the task
    ok: array = field(default_factory=lambda: array("I"))
    sent: list = field(default_factory=list)
    # Violations, sparse: state invariants by index in `new`, step properties by position,
    # rest and quiet invariants by state; `broken` is every name among them.
    failed: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    rest: dict = field(default_factory=dict)
    quiet: dict = field(default_factory=dict)
    broken: set = field(default_factory=set)
    orbit_states: int = 0  # with orbits: the sizes of the expanded states' orbits, summed


FAIR, ANY = 1, 2
_ACTION_INDEX = {name: i for i, name in enumerate(core.ACTION_NAMES)}


def _expand(segments: list) -> _Task:
    """The expansion of the states of `segments` (each a pickled list of states and the
    positions in it to expand)."""
    task, sent = _Task(), []
    for blob, positions in segments:
        states = pickle.loads(blob)
        for s in map(states.__getitem__, positions):
            _expand_one(s, task, sent)
    task.sent = [pickle.dumps(sent[k:k + SEGMENT_STATES], pickle.HIGHEST_PROTOCOL)
                 for k in range(0, len(sent), SEGMENT_STATES)]
    return task


def _without_losses(children: list[int], task: _Task, names) -> tuple[list[int], list[int]]:
    """The batch's successor lists for the liveness graph: loss steps left out, as the
    serial checker leaves them out (a lossy model's liveness assumes finitely many)."""
    if not any(names[a] in core.LOSS_ACTIONS for a in set(task.actions)):
        return children, task.successors
    kept, counts, position = [], [], 0
    for successors in task.successors:
        before = len(kept)
        for k in range(position, position + successors):
            if names[task.actions[k]] not in core.LOSS_ACTIONS:
                kept.append(children[k])
        counts.append(len(kept) - before)
        position += successors
    return kept, counts


def _expand_one(s, task: _Task, sent: list) -> None:
    m, symmetry, seen = _worker["m"], _worker["symmetry"], _worker["seen"]
    state_checks, step_checks = _worker["state_checks"], _worker["step_checks"]
    keep_going = _worker["keep_going"]
    if _worker["orbits"]:
        task.orbit_states += orbit_size(s, m)
    keys, actions, here = task.keys, task.actions, len(task.successors)
    first = len(keys)
    fair_enabled = step_enabled = any_enabled = False
    duplicates = 0
    for event, nxt in core.successors(m, s):
        any_enabled = True
        action = event.action
        ways = TLC_WAYS.get(action)
        if ways is not None:
            duplicates += ways(m, s, event) - 1
        if not step_enabled and action not in core.UNFAIR_ACTIONS:
            fair_enabled = True
            step_enabled = action not in core.TIMER_ACTIONS
        if step_checks:
            broken = step_failures(m, step_checks, s, nxt, keep_going)
            if broken:
                task.steps[len(keys)] = tuple(broken)
                task.broken.update(broken)
        if symmetry:
            nxt = canonical(nxt, m)
        key = hash(nxt)
        if key not in seen:
            seen.add(key)
            if action == "Finish" and answered_ok(nxt):
                task.ok.append(len(task.new))
            failed = _failures(state_checks, m, nxt)
            if failed:
                task.failed[len(task.new)] = failed
                task.broken.update(failed)
            task.new.append(len(keys))
            task.new_from.append(here)
            sent.append(nxt)
        keys.append(key)
        actions.append(_ACTION_INDEX[action])
    task.successors.append(len(keys) - first)
    task.enabled.append(FAIR * fair_enabled | ANY * any_enabled)
    task.duplicates.append(duplicates)
    for kind, checks, applies in (("rest", "rest_checks", not fair_enabled),
                                  ("quiet", "quiet_checks", not step_enabled)):
        failed = _failures(_worker[checks], m, s) if applies else ()
        if failed:
            getattr(task, kind)[here] = failed
            task.broken.update(failed)


def _work(tasks, results, start: tuple, others: list) -> None:
    """A worker: expand each task read from `tasks`, answer on `results`; b"" stops it.
    It closes the ends of the pipes it inherited and does not use (`others`), so that its
    exit, or the coordinator's, is an end of file on the other side rather than a wait
    that never ends."""
    for end in others:
        end.close()
    _start_worker(*start)
    try:
        while True:
            data = tasks.recv_bytes()
            if not data:
                return
            hinted = int.from_bytes(data[:8], "little") * 8 + 8
            known = array("q")
            known.frombytes(data[8:hinted])
            seen = _worker["seen"]
            if len(seen) + len(known) > SEEN_MAX:
                seen.clear()
            seen.update(known)
            results.send_bytes(pickle.dumps(_expand(pickle.loads(data[hinted:])),
                                            pickle.HIGHEST_PROTOCOL))
    except (EOFError, BrokenPipeError):
        return  # the coordinator is gone: nobody to answer


# Linux's F_SETPIPE_SZ: a pipe that holds a worker's queued tasks (~100 kB each), so that
# a worker reads its next task without waiting for the coordinator to be scheduled. At
# most /proc/sys/fs/pipe-max-size (1 MiB by default).
PIPE_BYTES = 1 << 20
_SETPIPE_SZ, _GETPIPE_SZ = 1031, 1032


class _Channel:
    """A worker's two pipes: tasks in, results out."""

    def __init__(self) -> None:
        self.tasks_in, self.tasks_out = Pipe(duplex=False)
        self.results_in, self.results_out = Pipe(duplex=False)
        for end in (self.tasks_out, self.results_out):
            try:
                fcntl.fcntl(end.fileno(), _SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # a smaller pipe only means more waiting
        self.capacity = fcntl.fcntl(self.tasks_out.fileno(), _GETPIPE_SZ)
        self.unread: deque = deque()  # (ticket, bytes) of the tasks without a result yet
        # Fingerprints of states another worker found since this one's last task: with
        # them a worker does not send a state the search has (28% of those sent before).
        self.hints = array("q")

    def ends(self) -> tuple:
        return self.tasks_in, self.tasks_out, self.results_in, self.results_out

    def room_for(self, size: int) -> bool:
        """Whether a task of `size` bytes can be sent without blocking: the pipe holds at
        least the tasks not answered yet, and an idle worker reads whatever it is sent."""
        return not self.unread or sum(s for _, s in self.unread) + size <= self.capacity


class _Workers:
    """The coordinator's end of the workers: tasks numbered in the order they are handed
    out; results taken in that order, read from every worker as they come so that no
    worker waits to write one. The coordinator never blocks on a write (room_for), so a
    worker blocked writing a result is always read in the end."""

    def __init__(self, channels: list[_Channel], processes: list) -> None:
        self.channels, self.processes = channels, processes
        self.ready: deque = deque()     # (ticket, bytes) waiting for room in a pipe
        self.done: dict = {}            # ticket -> result bytes, read ahead of their turn
        self.next_ticket = self.next_result = 0
        self.taken_from: _Channel | None = None
        self.in_flight = 0

    def submit(self, segments: list) -> None:
        self.ready.append((self.next_ticket, pickle.dumps(segments, pickle.HIGHEST_PROTOCOL)))
        self.next_ticket += 1
        self.in_flight += 1
        self._send()

    def _send(self) -> None:
        while self.ready:
            ticket, data = self.ready[0]
            channel = min(self.channels, key=lambda c: len(c.unread))
            if not channel.room_for(len(data) + 8 * len(channel.hints) + 8):
                return
            self.ready.popleft()
            hints, channel.hints = channel.hints, array("q")
            data = len(hints).to_bytes(8, "little") + hints.tobytes() + data
            try:
                channel.tasks_out.send_bytes(data)
            except BrokenPipeError:
                self._lost(channel)
            channel.unread.append((ticket, len(data)))

    def oldest(self) -> _Task:
        """The result of the oldest task not taken yet."""
        while self.next_result not in self.done:
            ends = {c.results_in: c for c in self.channels if c.unread}
            for end in wait(list(ends)):
                channel = ends[end]
                try:
                    self.done[channel.unread.popleft()[0]] = channel, end.recv_bytes()
                except EOFError:
                    self._lost(channel)
            self._send()
        self.in_flight -= 1
        self.next_result += 1
        self.taken_from, data = self.done.pop(self.next_result - 1)
        return pickle.loads(data)

    def hint(self, keys: array) -> None:
        """The fingerprints of the states the task just taken added to the search, for
        the workers that did not find them."""
        for channel in self.channels:
            if channel is not self.taken_from:
                channel.hints.extend(keys)

    def _lost(self, channel: _Channel) -> None:
        process = self.processes[self.channels.index(channel)]
        process.join(1.0)
        raise RuntimeError(f"a checker worker process ended in the middle of the search "
                           f"(exit status {process.exitcode}; killed for memory?): no verdict")

    def stop(self) -> None:
        """Tell every worker to end (each is waiting for a task: none is in flight)."""
        for channel in self.channels:
            channel.tasks_out.send_bytes(b"")


def _per_state(task: _Task):
    """The task's results state by state, as ParallelChecker._take takes them."""
    position, k = 0, 0
    new, ok = task.new, set(task.ok)
    for here, count in enumerate(task.successors):
        end = position + count
        news = []
        while k < len(new) and new[k] < end:
            news.append((new[k] - position, task.failed.get(k, ()), k in ok))
            k += 1
        steps = [(p - position, names) for p, names in task.steps.items()
                 if position <= p < end]
        yield (bool(task.enabled[here] & FAIR), bool(task.enabled[here] & ANY),
               task.keys[position:end],
               [core.ACTION_NAMES[a] for a in task.actions[position:end]], news,
               task.rest.get(here, ()), task.quiet.get(here, ()), steps,
               task.duplicates[here])
        position = end


class ParallelChecker(Checker):
    """The serial Checker's search, its expansion done by `workers` processes."""

    def __init__(self, m, *, workers: int, **options) -> None:
        super().__init__(m, **options)
        assert workers >= 2, "one worker is the serial Checker"
        self.workers = workers

    def run(self) -> CheckResult:
        names = tuple(tuple(n for n, _ in checks) for checks in (
            self.state_checks, self.rest_checks, self.quiet_checks, self.step_checks))
        channels = [_Channel() for _ in range(self.workers)]
        start = (self.m, self.symmetry, self.keep_going, *names, self.orbits)
        ends = [end for c in channels for end in c.ends()]
        own = [(c.tasks_in, c.results_out) for c in channels]
        with worker_processes(_work, [(*mine, start, [e for e in ends if e not in mine])
                                      for mine in own]) as processes:
            for channel in channels:  # a worker's end: its exit is then seen here (EOF)
                channel.tasks_in.close()
                channel.results_out.close()
            workers = _Workers(channels, processes)
            try:
                return self._search(workers)
            finally:
                if workers.in_flight:  # after a violation: work nobody will read
                    for process in processes:
                        process.terminate()
                else:
                    workers.stop()

    def _results(self, workers: "_Workers", search: "_Search"):
        """The expansion of every queued state, in queue order, as the queue grows, one
        task's results at a time: a task of CHUNK_STATES is handed out when that many
        wait, and a smaller share of what waits while fewer than two tasks per worker are
        in flight (a narrow level, the end of the search)."""
        limit = TASKS_IN_FLIGHT_PER_WORKER * self.workers
        while search.waiting or workers.in_flight:
            while search.waiting and workers.in_flight < limit and (
                    search.waiting >= CHUNK_STATES or workers.in_flight < 2 * self.workers):
                # Share what waits among the workers rather than give it to one: in the
                # middle of the search a task finds about as many new states as it
                # expands, so one task's worth is often all there is.
                share = max(SEGMENT_STATES, search.waiting // self.workers)
                workers.submit(search.chunk(min(CHUNK_STATES, share)))
            yield workers.oldest()

    def _search(self, workers: "_Workers") -> CheckResult:
        m = self.m
        result = CheckResult(m, self.symmetry, invariants=self.invariant_names,
                             workers=self.workers)
        started = time.perf_counter()
        init = canonical(core.initial_state(m), m) if self.symmetry else core.initial_state(m)
        search = _Search(init, self._key(init), self.liveness)
        self._index_of, self._events = search.index_of, search.events
        failed = self._failures(self.state_checks, init)
        if failed:
            self._record(result, failed, "invariant", 0, search.parents)
        next_report = started + self.progress_every_s
        orbit_states = 0 if self.orbits else None
        for task in ([] if self._stop(result) else self._results(workers, search)):
            if orbit_states is not None:
                orbit_states += task.orbit_states
            search.open_segment(task.sent)
            if task.broken & self._checked():
                for expanded in _per_state(task):
                    self._take(search, expanded, result)
                    if self._stop(result):
                        break
            else:
                self._take_task(search, task, result)
            search.close_segment()
            workers.hint(search.added)
            search.added = array("q")
            if self._stop(result):
                break
            if self.progress is not None and time.perf_counter() >= next_report:
                self.progress(len(search.parents), search.generated + search.tlc_duplicates,
                              search.depths[search.here], time.perf_counter() - started)
                next_report = time.perf_counter() + self.progress_every_s
            if self.max_states is not None and len(search.parents) > self.max_states:
                raise RuntimeError(f"more than {self.max_states} distinct states; "
                                   "raise --max-states or check a smaller model")
        result.left_on_queue = search.queued
        result.orbit_states = orbit_states
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

    def _checked(self) -> set[str]:
        return {name for checks in (self.state_checks, self.rest_checks, self.quiet_checks,
                                    self.step_checks) for name, _ in checks}

    def _take_task(self, search: "_Search", task: _Task, result: CheckResult) -> None:
        """A task that breaks no property still checked, all at once: what _take does
        state by state (and the same numbering), in fewer steps of Python."""
        first, names, index_of = search.here + 1, core.ACTION_NAMES, search.index_of
        ok = set(task.ok) if search.witness is None else ()
        for k, position in enumerate(task.new):
            key = task.keys[position]
            if key in index_of:
                continue  # another worker sent it first
            name = names[task.actions[position]]
            j = search.add(key, first + task.new_from[k],
                           _ACTIONS.setdefault(name, _Action(name)), k, name)
            if k in ok and search.witness is None:
                search.witness = j
        count = len(task.successors)
        search.here += count
        search.queued -= count
        search.generated += len(task.keys)
        search.tlc_duplicates += sum(task.duplicates)
        for action, times in Counter(task.actions).items():
            name = names[action]
            search.transitions[name] = search.transitions.get(name, 0) + times
        result.rest_states += task.enabled.count(0) + task.enabled.count(ANY)
        children = list(map(index_of.__getitem__, task.keys))
        position = 0
        for here, successors in enumerate(task.successors, first):
            if here in children[position:position + successors]:
                raise AssertionError(f"an action leaves state {here} unchanged")
            position += successors
        if search.graph is not None:
            search.graph.add_many(*_without_losses(children, task, names))

    def _take(self, search: "_Search", expanded: tuple, result: CheckResult) -> None:
        """One expanded state's successors, in the serial checker's order and with its
        bookkeeping; stops where the serial checker would stop."""
        fair_enabled, any_enabled, keys, actions, new, rest, quiet, steps, duplicates = expanded
        search.here += 1
        search.queued -= 1
        search.tlc_duplicates += duplicates
        here = search.here
        sent = {position: (search.offered + k, failed, ok)
                for k, (position, failed, ok) in enumerate(new)}
        search.offered += len(new)
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
                item, failed, ok = sent[position]
                j = search.add(key, here, _ACTIONS.setdefault(name, _Action(name)), item, name)
                if search.witness is None and ok:
                    search.witness = j
                failed = [f for f in failed if f in dict(self.state_checks)]
                if failed:
                    self._record(result, failed if self.keep_going else failed[:1],
                                 "invariant", j, search.parents)
                    if self._stop(result):
                        return
            elif j == here:
                raise AssertionError(f"{name} leaves the state unchanged")
            if name not in core.LOSS_ACTIONS:  # finitely many losses: see checker.py
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
        # The states to expand, in queue order, never unpickled here: segments of a pickled
        # list of states (up to SEGMENT_STATES of the successors a task's worker had not
        # sent before) and the positions in it of the states that were new to the search.
        # A worker unpickles the segments of its task (the module's header says why).
        self.segments: deque = deque([(pickle.dumps([init], pickle.HIGHEST_PROTOCOL), [0])])
        self.waiting = 1     # states in `segments`
        self.added = array("q")  # fingerprints of the states the open task added
        self.offered = 0     # states of the open task's lists taken so far
        self._open: list = []
        self.graph = _Graph() if liveness else None
        self.queued = 1      # states in `segments` or in chunks not yet read back
        self.generated, self.here = 1, -1
        self.tlc_duplicates = 0  # TLC counts these successors again (spec/check/tlccount.py)
        self.counts: dict[str, int] = {}
        self.transitions: dict[str, int] = {}
        self.witness: int | None = None  # the first state found with a client answered Ok

    def open_segment(self, sent: list) -> None:
        """The pickled successors of the task whose results are taken next."""
        self._open, self.offered = [(blob, []) for blob in sent], 0

    def close_segment(self) -> None:
        for segment in self._open:
            if segment[1]:
                self.segments.append(segment)
                self.waiting += len(segment[1])
        self._open = []

    def chunk(self, states_max: int) -> list:
        """The next task: whole segments, up to `states_max` states or a little more (a
        segment is not cut: each cut would unpickle its list twice)."""
        segments, states = [], 0
        while self.segments and states < states_max:
            segments.append(self.segments.popleft())
            states += len(segments[-1][1])
        self.waiting -= states
        return segments

    def add(self, key: int, parent: int, event, item: int, action: str) -> int:
        """A state seen for the first time, at position `item` of the open segment's
        list; its index."""
        j = len(self.parents)
        self.index_of[key] = j
        self.added.append(key)
        self.parents.append(parent)
        self.events.append(event)
        self.depths.append(self.depths[parent] + 1)
        self._open[item // SEGMENT_STATES][1].append(item % SEGMENT_STATES)
        self.queued += 1
        self.counts[action] = self.counts.get(action, 0) + 1
        return j
