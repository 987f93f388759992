"""Spec ≡ code: the Python core and KVTransfer.tla have the same state graph.

The spec is evaluated from its text (spec/tlaplus/tlaeval.py); the core runs as it always does; the
mapping between them is spec/tlaplus/tlaview.py. Starting from the initial state, every state the
core reaches is mapped to the spec's variables, and the spec's Next is evaluated on it. The
two must agree exactly: the same successor states with the same action labels. By induction
from equal initial states, the reachable graphs are then equal, state for state and edge for
edge. On the first disagreement the report gives the shortest path to the state, and what
each side allows there that the other does not.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from spec import core
from spec.core import Event, State
from spec.model import Model
from spec.check.symmetry import canonical
from spec.tlaplus.tlaeval import EvalError, Fcn, Spec, WalkMeter, action_labels, seq
from spec.tlaplus.tlaview import MAPPING, VARIABLES, ModelValue, Record, format_value, to_tla

SPEC_PATH = Path(__file__).resolve().parent.parent / "KVTransfer.tla"


def from_view(v: object) -> object:
    """A tlaview value as an evaluator value."""
    if isinstance(v, dict):
        return Fcn({from_view(k): from_view(x) for k, x in v.items()})
    if isinstance(v, Record):
        return Fcn((k, from_view(x)) for k, x in v.fields)
    if isinstance(v, tuple):
        return seq([from_view(x) for x in v])
    if isinstance(v, frozenset):
        return frozenset(from_view(x) for x in v)
    return v


def spec_for(m: Model, text: str | None = None, tlc_branching: bool = False) -> Spec:
    constants = {**m.tla_constants(), "NoReq": ModelValue("NoReq"),
                 "NoWorker": ModelValue("NoWorker"),
                 "Requests": frozenset(ModelValue(n) for n in m.request_names),
                 "PrefillWorkers": frozenset(ModelValue(n) for n in m.prefill_worker_names),
                 "DecodeWorkers": frozenset(ModelValue(n) for n in m.decode_worker_names),
                 "Bugs": frozenset(m.bugs), "Losses": frozenset(m.losses)}
    spec = Spec(text if text is not None else SPEC_PATH.read_text(), constants,
                tlc_branching=tlc_branching)
    spec.labels = action_labels(spec)
    return spec


def _key(spec_state: dict) -> tuple:
    return tuple(spec_state[v] for v in VARIABLES)


class _Keys:
    """Spec values of core states, cached per part of the state: per column of the request
    rows (the spec's first variables are the fields of a row, in order), and per pool and
    set of writes for the others, grouped by the part they read, in the order of the
    State's fields (checked here). States share most of their parts, so almost every
    conversion is a dictionary hit, and equal values are one object (compared by identity).
    The rows as a whole are not a cache key: most states have rows of their own."""

    def __init__(self, m: Model) -> None:
        self.m = m
        assert VARIABLES[:len(core.ROW_FIELDS)] == core.ROW_FIELDS
        self.columns = [(MAPPING[v][1], {}) for v in core.ROW_FIELDS]
        groups: dict[Callable, list[Callable]] = {}
        for var in VARIABLES[len(core.ROW_FIELDS):]:
            source, convert = MAPPING[var]
            assert source not in groups or list(groups)[-1] is source, \
                "variables that read one part of the state must be adjacent"
            groups.setdefault(source, []).append(convert)
        probe = core.initial_state(m)
        assert [source(probe) for source in groups] == list(probe[1:]), \
            "the grouped variables must read the State's parts in order"
        self.parts = [(self._pool(c), {}) for c in groups.values()]

    def __call__(self, s: State) -> tuple:
        out: tuple = self._rows(s[0])
        for part, (convert, cache) in zip(s[1:], self.parts):
            values = cache.get(part)
            if values is None:
                values = cache[part] = convert(part)
            out += values
        return out

    def _rows(self, rows: tuple) -> tuple:
        out = []
        for column, (convert, cache) in zip(zip(*rows), self.columns):
            value = cache.get(column)
            if value is None:
                value = cache[column] = from_view(convert(self.m, column))
            out.append(value)
        return tuple(out)

    def _pool(self, converts: list[Callable]) -> Callable[[tuple], tuple]:
        return lambda part: tuple(from_view(c(self.m, part)) for c in converts)


def _same_edges(spec_edges: list, core_edges: list) -> bool:
    """Set equality of a state's two short successor lists, by == and without hashing: a
    successor's hash would call into Python for each of its 18 values, while == is C-level
    and mostly an identity test (unchanged values are the same objects on both sides)."""
    for edge in spec_edges:
        if edge not in core_edges:
            return False
    for edge in core_edges:
        if edge not in spec_edges:
            return False
    return True


def _distinct(edges: list) -> int:
    return sum(1 for i, edge in enumerate(edges) if edge not in edges[:i])


@dataclass
class Disagreement:
    path: list[tuple[Event | None, State]]
    only_core: list[tuple[str, tuple]]
    only_spec: list[tuple[str, tuple]]
    spec_error: str = ""  # the spec could not be evaluated in the last state

    def report(self, m: Model) -> str:
        lines = [f"spec and core disagree after {len(self.path) - 1} steps:"]
        if self.spec_error:
            lines[0] = (f"the spec cannot be evaluated after {len(self.path) - 1} steps "
                        f"({self.spec_error}); the core can:")
        for event, _ in self.path[1:]:
            lines.append(f"  {event.label(m)}")
        state = to_tla(m, self.path[-1][1])
        lines.append("in the state")
        lines += [f"  /\\ {v} = {format_value(state[v])}" for v in VARIABLES]
        for side, edges in (("the core allows, the spec does not", self.only_core),
                            ("the spec allows, the core does not", self.only_spec)):
            if edges:
                lines.append(f"{side}:")
                for label, key in edges[:5]:
                    changed = [f"{v}' = {key[i]!r}" for i, v in enumerate(VARIABLES)
                               if key[i] != from_view(state[v])]
                    lines.append(f"  {label}: " + ", ".join(changed))
        return "\n".join(lines)


@dataclass
class Conformance:
    model: Model
    states: int = 0
    edges: int = 0
    seconds: float = 0.0
    disagreement: Disagreement | None = None
    labels: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.disagreement is None


def check_conformance(m: Model, spec: Spec | None = None, max_states: int | None = None,
                      progress: Callable[[int, float], None] | None = None,
                      symmetry: bool = False) -> Conformance:
    """With symmetry, states are compared at one representative per orbit under renaming of
    requests. Sound because both relations are symmetric: the core's is tested to be
    (tests/test_checker.py), and the spec never tells requests apart (they are model values
    it only compares for equality: TLC's condition for SYMMETRY)."""
    spec = spec or spec_for(m)
    result = Conformance(m)
    meter = WalkMeter(progress, max_states)
    init = core.initial_state(m)
    view_key = _Keys(m)
    core_init = view_key(init)
    result.disagreement = _initial_disagreement(spec, init, core_init)
    if result.disagreement is not None:
        return result
    spec_next = spec.next_function()
    # Every state visited or queued -> [parent, event, its spec key once computed]: the key
    # of a state seen before is reused when the state comes up again as a successor.
    seen: dict[State, list] = {init: [None, None, core_init]}
    queue = deque([init])
    while queue:
        s = queue.popleft()
        core_next = _compare(m, s, seen, spec_next, view_key, result, lambda: _path(seen, s))
        if core_next is None:
            break
        for event, n, k, known in core_next:
            if known is not None:
                continue
            if symmetry:
                c = canonical(n, m)
                if c is not n:
                    n, k = c, None  # its key is computed if it is new, when it is visited
            if n not in seen:
                seen[n] = [s, event, k]
                queue.append(n)
        meter.count(len(seen))
    result.states, result.seconds = len(seen), meter.seconds()
    return result


def sample_conformance(m: Model, walks: int, seed: int, depth_max: int = 200,
                       spec: Spec | None = None,
                       progress: Callable[[int, float], None] | None = None) -> Conformance:
    """Conformance along `walks` random walks instead of over the whole graph: from the
    initial state, compare the two sides' successors, step to one of the core's successors
    at random, and go on until a state without successors (or `depth_max` steps). Every state
    on a walk is compared exactly as check_conformance compares it; what is given up is the
    states no walk reaches. For the models whose whole graph costs minutes (CI samples them;
    tests/test_conformance.py says which). Deterministic for a seed: the core lists its
    successors in the same order in every process."""
    spec = spec or spec_for(m)
    result = Conformance(m)
    started = time.perf_counter()
    view_key = _Keys(m)
    init = core.initial_state(m)
    result.disagreement = _initial_disagreement(spec, init, view_key(init))
    if result.disagreement is not None:
        return result
    spec_next = spec.next_function()
    seen: dict[State, list] = {init: [None, None, view_key(init)]}
    compared: dict[State, list] = {}  # a state's core successors, once it was compared
    rng = random.Random(seed)
    for _ in range(walks):
        path: list[tuple[Event | None, State]] = [(None, init)]
        for _ in range(depth_max):
            s = path[-1][1]
            core_next = compared.get(s)
            if core_next is None:  # walks share their first steps: each state compared once
                core_next = _compare(m, s, seen, spec_next, view_key, result,
                                     lambda: list(path))
                if core_next is None:
                    break
                compared[s] = core_next
                for _event, n, k, known in core_next:
                    if known is None:
                        seen[n] = [None, None, k]
            if not core_next:
                break
            event, n, _, _ = core_next[rng.randrange(len(core_next))]
            path.append((event, n))
        if result.disagreement is not None:
            break
        if progress is not None:
            progress(len(seen), time.perf_counter() - started)
    result.states, result.seconds = len(seen), time.perf_counter() - started
    return result


def _initial_disagreement(spec: Spec, init: State, core_init: tuple) -> Disagreement | None:
    spec_inits = {_key(s) for s in spec.initial_states()}
    if spec_inits != {core_init}:
        return Disagreement([(None, init)], [("Init", core_init)],
                            [("Init", k) for k in spec_inits - {core_init}])
    if tuple(spec.variables) != VARIABLES:
        raise EvalError(f"the spec's variables {spec.variables} are not tlaview's {VARIABLES}")
    return None


def _compare(m: Model, s: State, seen: dict, spec_next: Callable, view_key: _Keys,
             result: Conformance, path: Callable[[], list]) -> list[tuple] | None:
    """Compare the spec's and the core's successors of `s` (in `seen`), counting its edges
    and labels into `result`: the core's successors, or None with `result.disagreement` set
    (`path()` gives the steps to `s` for the report)."""
    entry = seen[s]
    if entry[2] is None:
        entry[2] = view_key(s)
    try:
        spec_edges = spec_next(entry[2])
    except EvalError as error:
        result.disagreement = Disagreement(path(), [], [], spec_error=str(error))
        return None
    core_next = _core_successors(m, s, seen, view_key)
    core_edges = [(e.action, k) for e, _, k, _ in core_next]
    if not _same_edges(spec_edges, core_edges):
        result.disagreement = Disagreement(
            path(), sorted({e for e in core_edges if e not in spec_edges}, key=repr),
            sorted({e for e in spec_edges if e not in core_edges}, key=repr))
        return None
    result.edges += _distinct(core_edges)
    result.labels.update(e.action for e, _, _, _ in core_next)
    return core_next


def _core_successors(m: Model, s: State, seen: dict, view_key: _Keys) -> list[tuple]:
    """(event, successor, its spec key, its entry in seen or None) for each core successor."""
    out = []
    for event, n in core.successors(m, s):
        known = seen.get(n)
        key = known[2] if known is not None and known[2] is not None else view_key(n)
        out.append((event, n, key, known))
    return out


def _path(seen, s) -> list[tuple[Event | None, State]]:
    out = []
    while s is not None:
        parent, event, _ = seen[s]
        out.append((event, s))
        s = parent
    out.reverse()
    return out


def main(argv: list[str] | None = None) -> int:
    """Conformance on several models: `python -m spec.tlaplus.conformance [--all] [MODEL ...]`.

    `--all` compares every .cfg of spec/models, as CI does: up to symmetry where a model has
    more than one request (`--no-symmetry` walks the full graphs; the two-request models take
    about a minute each then). Prints one line per model, exits non-zero on a disagreement.
    """
    import argparse
    import sys

    from spec.check.cfgfile import load, model_names

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["solo"])
    parser.add_argument("--all", action="store_true", help="every .cfg in spec/models")
    parser.add_argument("--no-symmetry", action="store_true", help="full graphs")
    args = parser.parse_args(argv)
    names = model_names() if args.all else args.models
    failed = 0
    for name in names:
        _, model = load(name)
        symmetry = model.requests > 1 and not args.no_symmetry
        result = check_conformance(model, symmetry=symmetry, progress=lambda n, s: print(
            f"  {name}: {n:,} states, {s:.0f} s", file=sys.stderr, flush=True)
            if n % 100000 == 0 else None)
        if result.ok:
            print(f"{name}: conforms, {result.states:,} {'orbits' if symmetry else 'states'}, "
                  f"{result.edges:,} edges, {result.seconds:.1f} s", flush=True)
        else:
            failed += 1
            print(f"{name}: DISAGREES\n{result.disagreement.report(model)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
