"""A run's own event log checked against KVTransfer.tla, step by step.

Theory of operation
-------------------
Every shell logs the events its core accepted, in the one codec (spec/codec.py): the
simulator's ndjson log, the engine's event log, the fuzzer's saved failures. A log holds
events, not states, so the states are rebuilt: the events are folded through a fresh
spec.store.Store (the store every shell keeps its protocol state in), and after each one
the store is mapped onto the spec's variables (`spec_state` here, then spec/tlaplus/tlaview.py
through the conformance key cache). That is the only use of the core: it reconstructs.

The judgement comes from the spec's text. KVTransfer.tla's Next is compiled once
(spec/tlaplus/tlaaction.py `instances`): each action where it occurs in Next, with the names
Next binds around it (`\\E r \\in Requests`, `\\E S \\in SUBSET DPages`, `\\E w \\in writes`)
as arguments. A log record names its action (the TLA+ action's name, STYLE 3) and carries
the fields that bind those names (BINDINGS, the log's side of CCF's Traceccfraft mapping);
the spec's action is evaluated with them on the state before the step, and the step is
legal when the state the log's events lead to is one of its results. So a forged record
(a page table changed, a Finish that reports clean tags over a stale page, an Accept before
the writes landed) is refused at its line with its action named, whether or not the core
that rebuilt the state would have taken it, and a core that had drifted from the spec
would be caught by the logs of its own runs. Observed verdicts are not bound from the log:
Next passes the spec's own (ChecksumsMatch, TagsMatch), so a log that reports a verdict the
page contents contradict reaches a state the spec's step does not.

After every step the spec's state invariants are evaluated from its text too (TypeOK at
the last state only, see Checker.broken): a run whose steps are legal but which breaks one
(a buggy deployment) is reported with the invariant and the step after which it fails.

Shape. A run of P prefill and D decode workers is checked against the spec with
PrefillWorkers = {p1..pP} and DecodeWorkers = {d1..dD}: `spec_state` lays the store's
worker pools side by side (the core's flat pools, which tlaview maps per worker), and the
workers Next binds (an Arrive's placement, a crash's worker) come from the records' p and
d. A run of one pair is the spec's one-pair special case.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from spec import codec, core
from spec.core import Refusal, State
from spec.model import Model
from spec.partlog import Merged
from spec.properties import STATE_INVARIANTS
from spec.store import Store
from spec.tlaplus.conformance import _Keys, from_view, spec_for
from spec.tlaplus.tlaeval import EvalError, Fcn, ModelValue
from spec.tlaplus.tlaview import VARIABLES


class RunError(ValueError):
    """A log that cannot be read as a run of the protocol (user input, reported clearly)."""


@dataclass
class Run:
    """A shell's log, read: what the spec needs to check it."""

    source: str                  # the file, for messages
    model: Model                 # the spec's constants: one request per request of the run
    shell_model: Model           # the core's model as the shell ran it (spec/store.py)
    records: list[tuple[int, dict]]  # (line of the file, protocol event record)
    prefill_workers: int = 1
    decode_workers: int = 1
    description: str = ""
    unit: str = "line"           # what a record's number counts: a file's lines, or events


@dataclass
class RunVerdict:
    ok: bool
    steps: int                   # protocol steps checked
    message: str
    line: int = 0                # the file's line of the first bad step
    action: str = ""             # its action
    violated: str | None = None  # an invariant a legal run breaks
    observations: list[str] = field(default_factory=list)  # the store's oracle findings

    def __str__(self) -> str:
        return self.message


def _write(m: Model, event: core.Event, state: tuple) -> object:
    """The write in flight in the spec's state that a LandWrite or LoseWrite record names
    (by request and decode page: a request has one write per page of its table)."""
    r, page = ModelValue(m.request_names[event.request]), event.page + 1
    for w in state[VARIABLES.index("writes")]:
        if w["req"] == r and w["dst"] == page:
            return w
    return (f"no write of {m.request_names[event.request]} into decode page {page} is in "
            "flight in the spec's state")


def _prefill_worker(m: Model, e: core.Event, s: tuple) -> object:
    worker = e.prefill_worker if type(e) is core.Arrive else e.worker
    return ModelValue(m.prefill_worker_names[worker])


def _decode_worker(m: Model, e: core.Event, s: tuple) -> object:
    worker = e.decode_worker if type(e) is core.Arrive else e.worker
    return ModelValue(m.decode_worker_names[worker])


# The names KVTransfer.tla's Next binds, and how a log record's event binds each: a value, or
# a sentence saying why there is none (the step is then not one of the spec's).
BINDINGS: dict[str, Callable[[Model, core.Event, tuple], object]] = {
    "r": lambda m, e, s: ModelValue(m.request_names[e.request]),
    "n": lambda m, e, s: e.prompt_pages,
    "S": lambda m, e, s: frozenset(p + 1 for p in e.pages),
    "w": _write,
    "q": _prefill_worker,  # an Arrive's placement, a prefill crash's worker
    "d": _decode_worker,
    # Prefix caching: an Arrive's tokens and salt (<<>> and 0 without a prefix cache),
    # an Evict's page.
    "t": lambda m, e, s: from_view(tuple(e.tokens)),
    "s": lambda m, e, s: e.salt,
    "p": lambda m, e, s: e.page + 1,
}


def spec_state(store: Store, requests: int) -> State:
    """The store as one core State of the spec's shape: requests 0..requests-1, each row as
    the store has it (or empty before its arrival; rows are never forgotten here), every
    worker's pool side by side (the core's flat pools), every write in flight. Rows and
    writes keep the store's page numbers, which are the worker's own: tlaview maps a page
    number to its worker's pool modulo the pool's size, so they map as flat ones do."""
    rows = tuple(store.rows.get(r, core.EMPTY_ROW) for r in range(requests))
    return State(rows, tuple(page for pool in store.decode_pools for page in pool),
                 tuple(page for pool in store.prefill_pools for page in pool),
                 tuple(sorted(w for writes in store.writes_into for w in writes)))


def placed(run: Run, line: int, record: dict, event: core.Event) -> core.Event:
    """The event with the workers its record names beside it (a shell logs an Arrive's
    placement as p and d, a crash's worker as p or d), each checked against the run's."""
    if type(event) is core.Arrive:
        event = replace(event, prefill_worker=record.get("p", event.prefill_worker),
                        decode_worker=record.get("d", event.decode_worker))
        _worker(run, line, "p", event.prefill_worker, run.prefill_workers)
        _worker(run, line, "d", event.decode_worker, run.decode_workers)
    elif type(event) is core.PrefillCrash:
        event = replace(event, worker=record.get("p", event.worker))
        _worker(run, line, "p", event.worker, run.prefill_workers)
    elif type(event) is core.DecodeCrash:
        event = replace(event, worker=record.get("d", event.worker))
        _worker(run, line, "d", event.worker, run.decode_workers)
    return event


def _take(run: Run, store: Store, event: core.Event) -> str:
    """Rebuild: fold one event into the store; "" or why the core would not take it."""
    try:
        if isinstance(event, core.WorkerEvent):  # a crash, an eviction
            out = store.take_worker_event(event)
        elif type(event) is core.Arrive:
            r = event.request
            if r in store.rows:
                return "the request has already arrived"
            store.arrive(r, event.prefill_worker, event.decode_worker)
            out = store.take(r, event)
            if type(out) is Refusal:
                store.withdraw(r)
        elif event.request not in store.rows:
            return "the request has not arrived"
        else:
            out = store.take(event.request, event)
    except core.ProtocolMisuse as error:
        return str(error)
    return out.reason if type(out) is Refusal else ""


def _worker(run: Run, line: int, key: str, worker: object, workers: int) -> None:
    if type(worker) is not int or not 0 <= worker < workers:
        raise RunError(f"{run.source} {run.unit} {line}: {key}={worker!r} names no worker "
                       f"of the run's {workers}")


def _tla(v: object) -> str:
    """An evaluator value in TLA+ syntax, for messages: records, sequences, sets."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, dict):
        keys = list(v)
        if keys == list(range(1, len(keys) + 1)) and keys:
            return "<<" + ", ".join(_tla(x) for x in v.values()) + ">>"
        if keys and all(isinstance(k, str) for k in keys):
            return "[" + ", ".join(f"{k} |-> {_tla(x)}" for k, x in v.items()) + "]"
        return "(" + " @@ ".join(f"{_tla(k)} :> {_tla(x)}" for k, x in v.items()) + ")"
    if isinstance(v, frozenset):
        return "{" + ", ".join(sorted(_tla(x) for x in v)) + "}"
    return repr(v)


def _differences(spec, before: tuple, after: tuple, allowed: list[tuple]) -> str:
    """What the log's state differs in from the spec's nearest result, per variable and key."""
    best = min(allowed, key=lambda s: sum(a != b for a, b in zip(s, after)))
    parts = []
    for var, want, got in zip(VARIABLES, best, after):
        if want == got:
            continue
        if isinstance(want, dict) and isinstance(got, dict) and want.keys() == got.keys():
            keys = [k for k in want if want[k] != got[k]]
            parts += [f"{var}[{_tla(k)}] is {_tla(got[k])}, the spec's {_tla(want[k])}"
                      for k in keys[:3]]
        else:
            parts.append(f"{var} is {_tla(got)}, the spec's {_tla(want)}")
    return "; ".join(parts[:4])


class _RunKeys(_Keys):
    """The conformance key cache for one run's states, taken in order. Consecutive states
    differ in a row or two, so a per-request variable's value is the previous one with those
    requests' entries replaced: a step costs what it changed, not the run's request count
    (_Keys converts every changed column whole)."""

    def __init__(self, m: Model) -> None:
        super().__init__(m)
        self.names = [ModelValue(n) for n in m.request_names]
        self.alone: dict[int, Model] = {}  # r -> a one-request model naming r alone
        self.last_rows: tuple | None = None
        self.last: list = []

    def _rows(self, rows: tuple) -> tuple:
        last_rows = self.last_rows
        if last_rows is None or len(rows) != len(last_rows):
            out = list(super()._rows(rows))
        else:
            changed = [r for r, (a, b) in enumerate(zip(rows, last_rows)) if a is not b]
            out = list(self.last)
            for f, (convert, _) in enumerate(self.columns):
                moved = [r for r in changed if rows[r][f] != last_rows[r][f]]
                if not moved:
                    continue
                if not isinstance(out[f], dict):  # a set of requests (leaked): whole
                    out[f] = from_view(convert(self.m, tuple(row[f] for row in rows)))
                    continue
                value = Fcn(out[f])  # a fresh copy, changed before anyone hashes it
                for r in moved:
                    value[self.names[r]] = from_view(
                        convert(self._alone(r), (rows[r][f],))[self.names[r]])
                out[f] = value
        self.last_rows, self.last = rows, out
        return tuple(out)

    def _alone(self, r: int) -> Model:
        m = self.alone.get(r)
        if m is None:
            m = self.alone[r] = replace(self.m, requests=1,
                                        request_names=(self.m.request_names[r],))
        return m


class Checker:
    """KVTransfer.tla compiled for one run's constants: its actions as Next binds them, its
    state invariants, and the map from core states to its variables."""

    def __init__(self, m: Model) -> None:
        self.m = m
        self.spec = spec_for(m)
        assert tuple(self.spec.variables) == VARIABLES
        compiler = self.spec.compiler()
        self.instances: dict[str, list] = {}
        for instance in compiler.instances():
            unknown = set(instance.names) - set(BINDINGS)
            if unknown:
                raise RunError(f"KVTransfer.tla's {instance.label} binds {sorted(unknown)}, "
                               "which no log field binds (spec/tlaplus/runcheck.py BINDINGS)")
            self.instances.setdefault(instance.label, []).append(instance)
        self.invariants = {name: compiler.state_function(name) for name in STATE_INVARIANTS
                           if name in self.spec.ops}
        self.keys = _RunKeys(m)
        init = self.spec.initial_states()
        self.initial = tuple(init[0][v] for v in VARIABLES) if len(init) == 1 else None

    def results(self, event: core.Event, before: tuple) -> list[tuple] | str:
        """The states the spec's action of this event leads to from `before`, or why the
        log's event binds no instance of it."""
        instances = self.instances.get(event.action)
        if not instances:
            return f"KVTransfer.tla's Next has no action {event.action}"
        out: list[tuple] = []
        for instance in instances:
            values = [BINDINGS[name](self.m, event, before) for name in instance.names]
            reason = next((v for v in values if isinstance(v, str)), None)
            if reason is not None:
                return reason
            out += [s for _, s in instance.step(before, *values)]
        return out

    def broken(self, state: tuple, last: bool = False) -> str | None:
        """The first state invariant `state` violates. TypeOK only at the last state: every
        state before it is a result of one of the spec's own steps, so only an ill-typed spec
        could break it there, and it costs more than all the others together."""
        for name, holds in self.invariants.items():
            if (last or name != "TypeOK") and not holds(state):
                return name
        return None


_CHECKERS: dict[Model, Checker] = {}
CHECKERS_KEPT = 8  # compiled specs kept (about 1.5 s to compile each, a few MB)


def checker_for(m: Model) -> Checker:
    """The compiled spec for these constants, kept: runs of one scenario share it."""
    checker = _CHECKERS.get(m)
    if checker is None:
        if len(_CHECKERS) >= CHECKERS_KEPT:
            _CHECKERS.pop(next(iter(_CHECKERS)))
        checker = _CHECKERS[m] = Checker(m)
    return checker


def check_run(run: Run) -> RunVerdict:
    """Whether every step of the run is a step of KVTransfer.tla with the action its record
    names, and no state of it violates a state invariant."""
    m = run.model
    if (m.prefill_workers, m.decode_workers) != (run.prefill_workers, run.decode_workers):
        raise RunError(f"{run.source}: a run of {run.prefill_workers} x {run.decode_workers} "
                       f"workers checked against a model of {m.prefill_workers} x "
                       f"{m.decode_workers}")
    store = Store(run.shell_model, run.prefill_workers, run.decode_workers)
    empty = spec_state(store, m.requests)
    try:
        checker = checker_for(m)
    except EvalError as error:
        raise RunError(f"KVTransfer.tla cannot be evaluated for {run.source}: {error}") from None
    state = checker.keys(empty)
    if state != checker.initial:
        return RunVerdict(False, 0, f"{run.source}: the empty store is not the spec's Init")
    steps = 0
    for line, record in run.records:
        steps += 1
        try:
            event = codec.decode(record)
        except codec.CodecError as error:
            raise RunError(f"{run.source} {run.unit} {line}: {error}") from None
        event = placed(run, line, record, event)
        request = getattr(event, "request", 0)
        if not 0 <= request < m.requests:
            raise RunError(f"{run.source} {run.unit} {line}: request {request} is outside the "
                           f"run's 0..{m.requests - 1}")
        what = event.label(m)
        where = f"{run.source} {run.unit} {line}: step {steps} ({what})"
        try:
            allowed = checker.results(event, state)
        except EvalError as error:
            return RunVerdict(False, steps, f"{where}: the spec cannot be evaluated there: "
                              f"{error}", line, event.action)
        refused = _take(run, store, event)
        if isinstance(allowed, str) or not allowed:
            why = allowed if isinstance(allowed, str) else \
                f"KVTransfer.tla's {event.action} is not enabled there with these arguments"
            core_says = f" (the core refuses it too: {refused})" if refused else \
                " (the core that rebuilt the state took it)"
            return RunVerdict(False, steps, f"{where} is not a step of the spec: {why}"
                              f"{core_says}", line, event.action)
        if refused:
            return RunVerdict(False, steps, f"{where}: KVTransfer.tla allows it, but the core "
                              f"refuses it ({refused}): spec and core disagree here", line,
                              event.action)
        after = checker.keys(spec_state(store, m.requests))
        if after not in allowed:
            return RunVerdict(False, steps, f"{where} is not a step of the spec: the log's "
                              f"state differs from what KVTransfer.tla's {event.action} "
                              f"leads to: {_differences(checker, state, after, allowed)}",
                              line, event.action)
        state = after
        broken = checker.broken(state, last=steps == len(run.records))
        if broken:
            return RunVerdict(False, steps, f"{where} is a legal step, but after it {broken} "
                              "is violated", line, event.action, violated=broken)
    found = [f"{v.property}: {v.detail}" for v in store.violations]
    return RunVerdict(True, steps, f"run OK: {steps} steps, each a step of KVTransfer.tla "
                      f"with the action its record names, no state invariant violated",
                      observations=found)


def merged_run(merged: Merged, description: str = "") -> Run:
    """The merged logs of a split deployment (spec/partlog.py) as a run: its events
    numbered in merged order, the spec's constants those the logs were written with."""
    m = merged.model
    return Run("the merged run", m, m, list(enumerate(merged.records, start=1)),
               m.prefill_workers, m.decode_workers,
               description or f"the merged logs of {', '.join(merged.parts)}", unit="event")


def check_part_logs(merged: Merged) -> RunVerdict:
    """check_run on the merged run, its first bad step named by the file and line of the
    log that holds it (and its place in the merged run)."""
    run = merged_run(merged)
    prefix = f"{run.source} {run.unit} "

    def where(line: int) -> str:
        return f"{merged.origins[line - 1]} (merged event {line})"
    try:
        verdict = check_run(run)
    except RunError as error:
        text = str(error)
        if text.startswith(prefix):
            line = int(text[len(prefix):].split(":", 1)[0])
            text = where(line) + text[len(prefix) + len(str(line)):]
        raise RunError(text) from None
    if verdict.line:
        verdict.message = verdict.message.replace(f"{prefix}{verdict.line}:",
                                                  f"{where(verdict.line)}:", 1)
    return verdict
