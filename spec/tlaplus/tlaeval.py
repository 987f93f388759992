"""An evaluator for the TLA+ subset KVTransfer.tla uses: the spec's text compiled to Python.

Theory of operation
-------------------
The spec is parsed with the `tla` package; nothing is written by hand per action. Init, Next
and any operator asked for are translated from the parse tree into Python source, which is
compiled with `compile()` and run (spec/tlaplus/tlacompile.py does the translation, spec/tlaplus/tlavalues.py
holds the values and the few helpers the generated code calls). A state is a tuple of the
variables' values in declaration order; the generated `Next` takes one and returns the list
of its successors, each labelled with the disjunct of Next (the action) that produced it.

Actions are translated the way TLC enumerates successors: conjuncts left to right; `x' = e`
assigns x' when it is not yet assigned and compares otherwise; `x' \\in S` enumerates; `\\E`
becomes a loop, a disjunction or an IF/CASE with primes becomes branches, and each branch
carries on with the conjuncts after it (so code after a branch is generated once per branch);
UNCHANGED assigns or compares; action operators are inlined with their arguments
substituted, and entering an operator that is a disjunct of Next sets the edge's label.
Because assignment is decided while generating, the generated code never looks up which
variables are assigned.

What makes it fast (Next in 14 us a state of the default model, 16x less than the closure
interpreter it replaced; the default model in about 30 s, explore() below):
- constants folded: every subexpression that mentions no variable and no bound name (the
  .cfg constants included) is evaluated once, while compiling; an IF, CASE or bug switch on
  a constant keeps only the branch taken;
- guards first: a conjunct that assigns nothing is a plain `if`, and the leading guards of
  the body of an `\\E x \\in S` that do not mention x are tested once, before the loop (most
  actions are disabled in most states, and this is where they stop);
- pure operators (mentioning no variable) that loop (CHOOSE, quantifiers, comprehensions)
  are Python functions memoized on their arguments; Ascending's CHOOSE runs
  once per set, not once per state; other operators are inlined;
- values are Python's: ints, strs, bools, frozensets, interned model values, and functions
  as a dict subclass, so f[x] is one subscript and equality is dict equality.
Definitions are evaluated where they are used, not memoized per state: with the guards
first, the state-level ones (FreeDecode, ...) are reached only in the few states where an
action is nearly enabled.

The subset: integers, strings, booleans, model values; sets (enumeration, `{x \\in S : P}`,
`{e : x \\in S}`, SUBSET, \\cup, \\cap, \\, \\subseteq, \\in, \\notin, .., Nat, Int, BOOLEAN,
Cardinality); functions, records and sequences as one kind of value (`[x \\in S |-> e]`,
`[S -> T]`, `[a |-> e]`, `<<...>>`, f[x], r.a, DOMAIN, EXCEPT with ![k] = e or !.a = e and
@, Len, Seq(S) membership); \\A, \\E, CHOOSE over bounded sets; IF, CASE (with OTHER), LET
(definitions without arguments); =, #, <, >, <=, >=, +, -; /\\, \\/, ~, =>; primes, `x' \\in S`
and UNCHANGED in actions; user operators with arguments. Not supported, and reported as an
EvalError naming the construct and its line: ENABLED, temporal operators, recursion,
INSTANCE, higher-order operators, function definitions f[x] == e, tuple-patterned bounds,
LET definitions with arguments, EXCEPT paths longer than one step. An evaluation error
(f[x] outside the domain, CHOOSE with nothing to choose, no CASE arm) is an EvalError with the
line of the conjunct it happened in. Values are not type-checked beyond what Python does (1 =
TRUE holds, {1} - {2} is a set): the evaluator assumes a spec TLC accepts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import tla

from spec.tlaplus.tlacompile import Compiler
from spec.tlaplus.tlaexpr import line_of, name_of
from spec.tlaplus.tlavalues import (  # noqa: F401  (re-exported: the values of evaluated specs)
    EvalError, Fcn, ModelValue, seq,
)


@dataclass
class Operator:
    name: str
    params: tuple[str, ...]
    body: object  # AST node
    line: int


class Spec:
    """A parsed TLA+ module with constants bound; its operators compile on first use."""

    def __init__(self, text: str, constants: dict[str, object],
                 tlc_branching: bool = False) -> None:
        """tlc_branching: Next branches on guards that are disjunctions or \\E, as TLC's
        enumeration does, so its successor lists hold TLC's duplicates (slower)."""
        module = tla.parse(text)
        self.tlc_branching = tlc_branching
        self.variables: list[str] = []
        self.constants = dict(constants)
        self.ops: dict[str, Operator] = {}
        self.labels: frozenset[str] = frozenset()
        for unit in module.units:
            kind = type(unit).__name__
            if kind == "Variables":
                self.variables += [name_of(n) for n in unit.names]
            elif kind == "Constants":
                for decl in unit.names:
                    if name_of(decl) not in self.constants:
                        raise EvalError(f"{line_of(unit)}: constant {name_of(decl)} has no "
                                        "value")
            elif kind == "OperatorDefinition":
                if unit.function:
                    raise EvalError(f"{line_of(unit)}: function definitions f[x] == ... are "
                                    "not supported")
                params = tuple(name_of(p) for p in (unit.arity or []))
                line = unit.start.line + 1 if unit.start else 0
                self.ops[unit.name] = Operator(unit.name, params, unit.definiens, line)
            elif kind in ("Axiom", "str"):  # ASSUME, separator lines
                continue
            else:
                raise EvalError(f"{line_of(unit)}: module unit {kind} is not supported")
        self._compiler = None
        self._next: dict[str, Callable] = {}

    def compiler(self) -> Compiler:
        if self._compiler is None or self._compiler.labels != self.labels:
            self._compiler = Compiler(self)
            self._next = {}
        return self._compiler

    def next_function(self, next_: str = "Next") -> Callable[[tuple], list[tuple[str, tuple]]]:
        """Next compiled: state tuple (variables in declaration order) -> [(label, state)]."""
        if next_ not in self._next or self._compiler.labels != self.labels:
            compiler = self.compiler()
            self._next[next_] = compiler.guarded(compiler.action_function(next_))
        return self._next[next_]

    def initial_states(self, init: str = "Init") -> list[dict]:
        """Init's states: in Init, `x = e` for an unassigned variable x assigns it."""
        compiler = self.compiler()
        states = compiler.guarded(compiler.action_function(init, init_mode=True))(())
        return [dict(zip(self.variables, s)) for _, s in states]

    def successors(self, state: dict, next_: str = "Next"):
        """Next from a state given as a dict; yields (label, successor as a dict)."""
        step = self.next_function(next_)
        for label, s in step(tuple(state[v] for v in self.variables)):
            yield label, dict(zip(self.variables, s))

    def value(self, name: str, state: dict | None = None):
        """The value of a constant-level or state-level operator without arguments."""
        return self.compiler().value(name, state)


@dataclass
class Exploration:
    states: int = 0
    edges: int = 0  # distinct labelled edges (label, from, to)
    # Initial states plus every successor Next listed, duplicates included: TLC's "states
    # generated" when the Spec was made with tlc_branching=True.
    generated: int = 0
    labels: set[str] = field(default_factory=set)
    seconds: float = 0.0


class WalkMeter:
    """For a breadth-first walk: a progress report every 5,000 states, the bound on states."""

    def __init__(self, progress: Callable[[int, float], None] | None,
                 max_states: int | None) -> None:
        self.progress, self.max_states = progress, max_states
        self.started, self.next_report = time.perf_counter(), 5000

    def count(self, states: int) -> None:
        if self.progress and states >= self.next_report:
            self.progress(states, self.seconds())
            self.next_report += 5000
        if self.max_states is not None and states > self.max_states:
            raise RuntimeError(f"more than {self.max_states} states")

    def seconds(self) -> float:
        return time.perf_counter() - self.started


def explore(spec: Spec, max_states: int | None = None,
            progress: Callable[[int, float], None] | None = None) -> Exploration:
    """The spec's reachable graph, breadth first, from its text alone (no core involved):
    the distinct states TLC would count, and the labelled edges between them."""
    meter = WalkMeter(progress, max_states)
    step = spec.next_function()
    inits = [tuple(s[v] for v in spec.variables) for s in spec.initial_states()]
    seen, queue, result = set(inits), deque(inits), Exploration(generated=len(inits))
    while queue:
        listed = step(queue.popleft())
        result.generated += len(listed)
        edges = set(listed)
        result.edges += len(edges)
        for label, successor in edges:
            result.labels.add(label)
            if successor not in seen:
                seen.add(successor)
                queue.append(successor)
        meter.count(len(seen))
    result.states, result.seconds = len(seen), meter.seconds()
    return result


def action_labels(spec: Spec, next_: str = "Next") -> frozenset[str]:
    """The operators at the leaves of Next's disjunction: the labels of its edges."""
    found: set[str] = set()

    def walk(node, seen: frozenset[str]) -> None:
        kind = type(node).__name__
        if kind == "Parentheses":
            walk(node.expression, seen)
        elif kind == "VerticalList" and node.operator == "\\/":
            for item in node.arguments:
                walk(item.expression, seen)
        elif kind == "OperatorApplication" and node.operator == "\\/":
            for arg in node.arguments:
                walk(arg, seen)
        elif kind == "Quantification":
            walk(node.predicate, seen)
        elif kind == "OperatorApplication" and node.operator in spec.ops \
                and node.operator not in seen:
            body = spec.ops[node.operator].body
            inner = type(body).__name__
            is_disjunction = (inner == "VerticalList" and body.operator == "\\/") or (
                inner == "OperatorApplication" and body.operator == "\\/") or inner == "Quantification"
            if is_disjunction:
                walk(body, seen | {node.operator})
            else:
                found.add(node.operator)
    walk(spec.ops[next_].body, frozenset())
    return frozenset(found)
