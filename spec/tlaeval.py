"""An evaluator for the TLA+ subset KVTransfer.tla uses, over the `tla` package's parse tree.

The spec is parsed once and every operator definition is compiled into Python closures:
expressions into `f(state, local) -> value`, actions into generators that extend a partial
assignment of primed variables (TLC's way of enumerating successors: conjuncts left to
right, `x' = e` binds or checks, `\\E`, disjunction, IF and CASE branch, UNCHANGED binds).
A construct outside the subset raises EvalError naming it and its line; nothing is guessed.

The subset: integers, strings, booleans, model values; sets (enumeration, `{x \\in S : P}`,
`{e : x \\in S}`, SUBSET, \\cup, \\cap, \\, \\subseteq, \\in, \\notin, .., Nat, Int, BOOLEAN,
Cardinality); functions, records and sequences as one kind of value (`[x \\in S |-> e]`,
`[S -> T]`, `[a |-> e]`, `<<...>>`, f[x], r.a, DOMAIN, EXCEPT with ![k] = e, Len, Seq(S)
membership); \\A, \\E, CHOOSE over bounded sets; IF, CASE (with OTHER), LET; =, #, <, >,
<=, >=, +, -; /\\, \\/, ~, =>; primes and UNCHANGED in actions; user operators with
arguments. Not supported: ENABLED, temporal operators, recursion, INSTANCE, higher-order
operators, strings as sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Callable, Iterator

import tla



class EvalError(ValueError):
    """A construct the evaluator does not support, or an evaluation error, with its line."""


class Fcn:
    """A TLA+ function: also a record, a tuple and a sequence (domain 1..n)."""

    __slots__ = ("d", "_hash")

    def __init__(self, d: dict) -> None:
        self.d = d
        self._hash = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fcn) and self.d == other.d

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self.d.items()))
        return self._hash

    def __repr__(self) -> str:
        return "(" + " @@ ".join(f"{k!r} :> {v!r}" for k, v in self.d.items()) + ")"


def seq(items) -> Fcn:
    return Fcn({i + 1: v for i, v in enumerate(items)})


class _Infinite:
    def __init__(self, name: str, test: Callable[[object], bool]) -> None:
        self.name, self.test = name, test

    def __contains__(self, x: object) -> bool:
        return self.test(x)


NAT = _Infinite("Nat", lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0)
INT = _Infinite("Int", lambda x: isinstance(x, int) and not isinstance(x, bool))


class _SeqSet:
    def __init__(self, base) -> None:
        self.base = base

    def __contains__(self, x: object) -> bool:
        return (isinstance(x, Fcn) and set(x.d) == set(range(1, len(x.d) + 1))
                and all(v in self.base for v in x.d.values()))


class _FunctionSet:
    """[S -> T]: enumerable when T is finite, always testable."""

    def __init__(self, domain, codomain) -> None:
        self.domain, self.codomain = domain, codomain

    def __contains__(self, f: object) -> bool:
        return (isinstance(f, Fcn) and set(f.d) == set(self.domain)
                and all(v in self.codomain for v in f.d.values()))

    def __iter__(self):
        keys = sorted(self.domain, key=_order)
        for values in product(*[sorted(self.codomain, key=_order)] * len(keys)):
            yield Fcn(dict(zip(keys, values)))


_MISSING = object()
_LITERALS = {"IntegralNumeral", "StringLiteral", "BooleanLiteral", "SetOfBooleans"}


def _order(x: object):
    return (type(x).__name__, repr(x))


def _line(node) -> str:
    start = getattr(node, "start", None)  # the parser counts lines from 0
    return f"line {start.line + 1}" if start is not None else "unknown line"


def _lookup(f, key, node):
    """f[key], and r.key for a record: both are function application in TLA+."""
    try:
        return f.d[key]
    except (AttributeError, KeyError):
        raise EvalError(f"{_line(node)}: {key!r} is not in the domain of {f!r}") from None


def _enumerable(s, node):
    if isinstance(s, (frozenset, _FunctionSet)):
        return s
    raise EvalError(f"{_line(node)}: cannot enumerate {getattr(s, 'name', s)!r}")


@dataclass
class Operator:
    name: str
    params: tuple[str, ...]
    body: object  # AST node
    compiled: Callable | None = None
    action: Callable | None = None


BINARY = {
    "=": lambda a, b: a == b, "#": lambda a, b: a != b, "/=": lambda a, b: a != b,
    "<": lambda a, b: a < b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
    "=<": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "+": lambda a, b: a + b,
    "-": lambda a, b: a - b, "\\in": lambda a, b: a in b, "\\notin": lambda a, b: a not in b,
    "\\cup": lambda a, b: a | b, "\\union": lambda a, b: a | b, "\\cap": lambda a, b: a & b,
    "\\": lambda a, b: a - b, "\\subseteq": lambda a, b: a <= b,
    "..": lambda a, b: frozenset(range(a, b + 1)),
}


class Spec:
    """A parsed and compiled TLA+ module with constants bound."""

    def __init__(self, text: str, constants: dict[str, object]) -> None:
        module = tla.parse(text)
        self.variables: list[str] = []
        self.constants = dict(constants)
        self.ops: dict[str, Operator] = {}
        for unit in module.units:
            kind = type(unit).__name__
            if kind == "Variables":
                self.variables += [self._name(n) for n in unit.names]
            elif kind == "Constants":
                for decl in unit.names:
                    name = self._name(decl)
                    if name not in self.constants:
                        raise EvalError(f"{_line(unit)}: constant {name} has no value")
            elif kind == "OperatorDefinition":
                if unit.function:
                    raise EvalError(f"{_line(unit)}: function definitions f[x] == ... are "
                                    "not supported")
                params = tuple(self._name(p) for p in (unit.arity or []))
                self.ops[unit.name] = Operator(unit.name, params, unit.definiens)
            elif kind in ("Axiom", "str"):  # ASSUME, separator lines
                continue
            else:
                raise EvalError(f"{_line(unit)}: module unit {kind} is not supported")
        self.globals = dict(self.constants)
        self._domain_cache: dict[int, list] = {}

    @staticmethod
    def _name(node) -> str:
        if isinstance(node, str):
            return node
        if hasattr(node, "operator") and isinstance(node.operator, str):
            return node.operator
        if hasattr(node, "name") and isinstance(node.name, str):
            return node.name
        raise EvalError(f"{_line(node)}: cannot read a name from {type(node).__name__}")

    # -- expressions ----------------------------------------------------------------------

    def expr(self, node) -> Callable:
        kind = type(node).__name__
        method = getattr(self, f"_e_{kind}", None)
        if method is None:
            raise EvalError(f"{_line(node)}: {kind} is not in the supported TLA+ subset")
        compiled = method(node)
        if kind not in _LITERALS and self._closed(node, frozenset()):
            return self._once(compiled)
        return compiled

    def _once(self, compiled: Callable) -> Callable:
        """A closed constant expression (no variable, no free local) is evaluated once."""
        cell: list = []

        def constant(st, lc):
            if not cell:
                cell.append(compiled(self.globals, {}))
            return cell[0]
        constant.is_constant = True
        return constant

    def _closed(self, node, bound: frozenset[str]) -> bool:
        """Whether node depends only on constants, constant operators and names it binds."""
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return all(self._closed(x, bound) for x in node)
        if not hasattr(node, "_fields"):
            return True  # a str, a number, None
        kind = type(node).__name__
        if kind == "OperatorApplication":
            name, args = node.operator, node.arguments
            if name in ("'", "UNCHANGED", "ENABLED") or name in self.variables:
                return False
            arg_ok = args is None or all(self._closed(a, bound) for a in args)
            if args is None:
                if name in bound or name in self.globals or name in ("Nat", "Int", "BOOLEAN"):
                    return True
                return name in self.ops and not self.ops[name].params and self._op_closed(name)
            if name in self.ops:
                return arg_ok and self._op_closed(name)
            return arg_ok
        names = self._bound_names(node)
        inner = bound | names
        return all(self._closed(getattr(node, f), inner) for f in node._fields
                   if f not in ("symbol", "start", "end"))

    def _bound_names(self, node) -> frozenset[str]:
        decls = getattr(node, "declarations", None) or getattr(node, "declaration", None)
        if decls is None:
            if type(node).__name__ == "Let":
                return frozenset(d.name for d in node.definitions)
            return frozenset()
        if not isinstance(decls, list):
            decls = [decls]
        out = set()
        for decl in decls:
            if type(decl).__name__ == "OperatorApplication":
                if decl.arguments is None:
                    out.add(decl.operator)
                elif decl.operator == "\\in":
                    out.add(self._name(decl.arguments[0]))
        return frozenset(out)

    def _op_closed(self, name: str) -> bool:
        memo = self.__dict__.setdefault("_op_closed_memo", {})
        if name not in memo:
            memo[name] = False  # a recursive reference is not closed
            op = self.ops[name]
            memo[name] = self._closed(op.body, frozenset(op.params))
        return memo[name]

    def _e_Parentheses(self, node):
        return self.expr(node.expression)

    def _e_IntegralNumeral(self, node):
        value = int(node.value)
        return lambda st, lc: value

    def _e_StringLiteral(self, node):
        value = node.value[1:-1]
        return lambda st, lc: value

    def _e_BooleanLiteral(self, node):
        value = node.value == "TRUE"
        return lambda st, lc: value

    def _e_SetOfBooleans(self, node):
        return lambda st, lc: frozenset({False, True})

    def _e_SetEnumeration(self, node):
        items = [self.expr(x) for x in node.items]
        return lambda st, lc: frozenset(f(st, lc) for f in items)

    def _e_Tuple(self, node):
        items = [self.expr(x) for x in node.items]
        return lambda st, lc: seq([f(st, lc) for f in items])

    def _e_Record(self, node):
        fields = [(self._name(k), self.expr(v)) for k, v in node.key_values]
        return lambda st, lc: Fcn({k: f(st, lc) for k, f in fields})

    def _e_Field(self, node):
        rec = self.expr(node.expression)
        name = self._name(node.name)

        return lambda st, lc: _lookup(rec(st, lc), name, node)

    def _e_FunctionApplication(self, node):
        fn = self.expr(node.function)
        args = [self.expr(a) for a in node.arguments]
        if len(args) != 1:
            raise EvalError(f"{_line(node)}: f[a, b] is not supported")
        arg = args[0]
        return lambda st, lc: _lookup(fn(st, lc), arg(st, lc), node)

    def _bounds(self, declarations) -> list[tuple[list[str], Callable, object]]:
        """`x, y \\in S, z \\in T` parses as [x, (y \\in S), (z \\in T)]."""
        if not isinstance(declarations, list):
            declarations = [declarations]
        out, pending = [], []
        for decl in declarations:
            if type(decl).__name__ == "OperatorApplication" and decl.operator == "\\in" \
                    and decl.arguments:
                names = pending + [self._name(decl.arguments[0])]
                out.append((names, self.expr(decl.arguments[1]), decl))
                pending = []
            elif type(decl).__name__ == "OperatorApplication" and decl.arguments is None:
                pending.append(decl.operator)
            else:
                raise EvalError(f"{_line(decl)}: only bounded declarations x \\in S are "
                                "supported")
        if pending:
            raise EvalError(f"{_line(declarations[0])}: unbounded {pending} not supported")
        return out

    def _bindings(self, bounds, st, lc) -> Iterator[dict]:
        """Every assignment of the bound names, in a fixed order."""
        if len(bounds) == 1 and len(bounds[0][0]) == 1:  # the common case: x \in S
            name = bounds[0][0][0]
            for value in self._sorted_domain(bounds[0], st, lc):
                inner = dict(lc)
                inner[name] = value
                yield inner
            return
        names, domains = [], []
        for bound in bounds:
            values = self._sorted_domain(bound, st, lc)
            for n in bound[0]:
                names.append(n)
                domains.append(values)
        for combo in product(*domains):
            yield {**lc, **dict(zip(names, combo))}

    def _sorted_domain(self, bound, st, lc) -> list:
        ns, dom, node = bound
        cached = self._domain_cache.get(id(node))
        if cached is not None:
            return cached
        values = sorted(_enumerable(dom(st, lc), node), key=_order)
        if getattr(dom, "is_constant", False):
            self._domain_cache[id(node)] = values
        return values

    def _e_Function(self, node):
        bounds = self._bounds(node.declaration)
        body = self.expr(node.value)
        if len(bounds) != 1 or len(bounds[0][0]) != 1:
            raise EvalError(f"{_line(node)}: only [x \\in S |-> e] functions are supported")
        name = bounds[0][0][0]
        dom = bounds[0][1]

        def function(st, lc):
            return Fcn({x: body(st, {**lc, name: x})
                        for x in sorted(_enumerable(dom(st, lc), node), key=_order)})
        return function

    def _e_SetOfFunctions(self, node):
        domain, codomain = self.expr(node.domain), self.expr(node.codomain)
        return lambda st, lc: _FunctionSet(domain(st, lc), codomain(st, lc))

    def _e_SetComprehension(self, node):
        body = self.expr(node.item)
        bounds = self._bounds(node.declarations)
        return lambda st, lc: frozenset(body(st, b) for b in self._bindings(bounds, st, lc))

    def _e_SetSlice(self, node):
        bounds = self._bounds(node.declaration)
        pred = self.expr(node.predicate)
        name = bounds[0][0][0]

        def subset(st, lc):
            dom = _enumerable(bounds[0][1](st, lc), node)
            return frozenset(x for x in dom if pred(st, {**lc, name: x}))
        return subset

    def _e_Quantification(self, node):
        bounds = self._bounds(node.declarations)
        body = self.expr(node.predicate)
        if node.quantifier in ("\\A", "\\forall"):
            return lambda st, lc: all(body(st, b) for b in self._bindings(bounds, st, lc))
        if node.quantifier in ("\\E", "\\exists"):
            return lambda st, lc: any(body(st, b) for b in self._bindings(bounds, st, lc))
        raise EvalError(f"{_line(node)}: quantifier {node.quantifier} is not supported")

    def _e_Choose(self, node):
        bounds = self._bounds(node.declaration)
        pred = self.expr(node.predicate)

        def choose(st, lc):
            for b in self._bindings(bounds, st, lc):
                if pred(st, b):
                    return b[bounds[0][0][0]]
            raise EvalError(f"{_line(node)}: CHOOSE found no value")
        return choose

    def _e_If(self, node):
        cond, then, else_ = self.expr(node.predicate), self.expr(node.then), self.expr(node.else_)
        return lambda st, lc: then(st, lc) if cond(st, lc) else else_(st, lc)

    def _e_Cases(self, node):
        arms = [(self.expr(a.predicate), self.expr(a.expression)) for a in node.cases]
        other = self.expr(node.other) if node.other is not None else None

        def case(st, lc):
            for cond, value in arms:
                if cond(st, lc):
                    return value(st, lc)
            if other is None:
                raise EvalError(f"{_line(node)}: no CASE arm applies")
            return other(st, lc)
        return case

    def _e_Let(self, node):
        local_ops = {}
        for definition in node.definitions:
            if type(definition).__name__ != "OperatorDefinition" or definition.arity:
                raise EvalError(f"{_line(definition)}: LET supports constant definitions only")
            local_ops[definition.name] = self.expr(definition.definiens)
        body = self.expr(node.expression)

        def let(st, lc):
            inner = dict(lc)
            for name, f in local_ops.items():
                inner[name] = f(st, inner)
            return body(st, inner)
        return let

    def _e_Except(self, node):
        base = self.expr(node.function)
        changes = []
        for change in node.changes:
            path = change.item
            if len(path) != 1 or len(path[0]) != 1:
                raise EvalError(f"{_line(change)}: only ![k] = e EXCEPT paths are supported")
            changes.append((self.expr(path[0][0]), self.expr(change.expression)))

        def except_(st, lc):
            f = base(st, lc)
            d = dict(f.d)
            for key, value in changes:
                k = key(st, lc)
                if k not in d:
                    raise EvalError(f"{_line(node)}: EXCEPT key {k!r} not in the domain")
                d[k] = value(st, {**lc, "@": d[k]})
            return Fcn(d)
        return except_

    def _e_VerticalList(self, node):
        items = [self.expr(i.expression) for i in node.arguments]
        if node.operator == "/\\":
            return lambda st, lc: all(f(st, lc) for f in items)
        return lambda st, lc: any(f(st, lc) for f in items)

    def _e_OperatorApplication(self, node):
        op, args = node.operator, node.arguments
        if args is None:
            return self._name_ref(node, op)
        compiled = [self.expr(a) for a in args]
        if op in BINARY and len(compiled) == 2:
            fn, (a, b) = BINARY[op], compiled
            return lambda st, lc: fn(a(st, lc), b(st, lc))
        if op == "/\\":
            return lambda st, lc: all(f(st, lc) for f in compiled)
        if op == "\\/":
            return lambda st, lc: any(f(st, lc) for f in compiled)
        if op == "=>":
            a, b = compiled
            return lambda st, lc: (not a(st, lc)) or b(st, lc)
        if op in ("~", "\\lnot", "\\neg"):
            (a,) = compiled
            return lambda st, lc: not a(st, lc)
        if op == "-" and len(compiled) == 1:
            (a,) = compiled
            return lambda st, lc: -a(st, lc)
        if op == "'":
            name = self._name(args[0])
            if name not in self.variables:
                raise EvalError(f"{_line(node)}: only variables can be primed")
            return lambda st, lc: self._primed(st, name, node)
        builtins = {"SUBSET": self._subset, "DOMAIN": lambda x: frozenset(x.d),
                    "Cardinality": len, "Len": lambda s: len(s.d), "Seq": _SeqSet}
        if op in builtins:
            (a,) = compiled
            fn = builtins[op]
            return lambda st, lc: fn(a(st, lc))
        if op in self.ops:
            return self._call(node, op, compiled)
        raise EvalError(f"{_line(node)}: operator {op} is not in the supported TLA+ subset")

    @staticmethod
    def _subset(s):
        items = sorted(s, key=_order)
        return frozenset(frozenset(x for x, keep in zip(items, mask) if keep)
                         for mask in product((False, True), repeat=len(items)))

    @staticmethod
    def _primed(st, name, node):
        primed = st.get("'")
        if primed is None or name not in primed:
            raise EvalError(f"{_line(node)}: {name}' is read before it is assigned")
        return primed[name]

    def _name_ref(self, node, name):
        if name in self.variables:
            return lambda st, lc: st[name]
        if name in self.globals:
            value = self.globals[name]
            return lambda st, lc: value
        if name in ("Nat", "Int"):
            value = NAT if name == "Nat" else INT
            return lambda st, lc: value
        if name == "BOOLEAN":
            return lambda st, lc: frozenset({False, True})
        if name in self.ops and not self.ops[name].params:
            return self._call(node, name, [])

        def local(st, lc):
            try:
                return lc[name]
            except KeyError:
                raise EvalError(f"{_line(node)}: unknown name {name}") from None
        return local

    def _call(self, node, name, args):
        op = self.ops[name]
        if len(args) != len(op.params):
            raise EvalError(f"{_line(node)}: {name} takes {len(op.params)} arguments")
        params = op.params

        if not params and not self._has_primes(op.body):
            memo_key = ("#memo", name)

            def call_memo(st, lc):
                """A state-level operator without arguments: once per state."""
                value = st.get(memo_key, _MISSING)
                if value is _MISSING:
                    if op.compiled is None:
                        op.compiled = self.expr(op.body)
                    value = st[memo_key] = op.compiled(st, {})
                return value
            return call_memo

        def call(st, lc):
            if op.compiled is None:
                op.compiled = self.expr(op.body)
            return op.compiled(st, dict(zip(params, [a(st, lc) for a in args])))
        return call

    # -- actions --------------------------------------------------------------------------
    # An action compiles to act(st, lc, primed, label) -> iterator of (primed, label).

    def action(self, node) -> Callable:
        kind = type(node).__name__
        if kind == "Parentheses":
            return self.action(node.expression)
        if kind == "VerticalList":
            return self._conj_or_disj(node.operator, [i.expression for i in node.arguments])
        if kind == "OperatorApplication" and node.arguments is not None:
            op = node.operator
            if op in ("/\\", "\\/"):
                return self._conj_or_disj(op, node.arguments)
            if op == "=" and self._is_primed(node.arguments[0]):
                return self._assign(node)
            if op == "=" and self._init_mode and self._is_variable(node.arguments[0]):
                return self._assign(node, primed_lhs=False)
            if op == "\\in" and self._is_primed(node.arguments[0]):
                return self._assign_in(node)
            if op == "UNCHANGED":
                return self._unchanged(node.arguments[0])
            if op in self.ops and self._has_primes(self.ops[op].body):
                return self._call_action(node, op, [self.expr(a) for a in node.arguments])
        if kind == "OperatorApplication" and node.arguments is None and node.operator in self.ops \
                and self._has_primes(self.ops[node.operator].body):
            return self._call_action(node, node.operator, [])
        if kind == "Quantification" and node.quantifier in ("\\E", "\\exists"):
            bounds = self._bounds(node.declarations)
            body = self.action(node.predicate)

            def exists(st, lc, primed, label):
                for b in self._bindings(bounds, st, lc):
                    yield from body(st, b, primed, label)
            return exists
        if kind == "If" and self._has_primes(node):
            cond, then, else_ = self.expr(node.predicate), self.action(node.then), \
                self.action(node.else_)

            def if_(st, lc, primed, label):
                branch = then if cond(self._with(st, primed), lc) else else_
                yield from branch(st, lc, primed, label)
            return if_
        if kind == "Cases" and self._has_primes(node):
            arms = [(self.expr(a.predicate), self.action(a.expression)) for a in node.cases]
            other = self.action(node.other) if node.other is not None else None

            def case(st, lc, primed, label):
                for cond, act in arms:
                    if cond(self._with(st, primed), lc):
                        yield from act(st, lc, primed, label)
                        return
                if other is not None:
                    yield from other(st, lc, primed, label)
            return case
        if kind == "Let" and self._has_primes(node.expression):
            defs = [(d.name, self.expr(d.definiens)) for d in node.definitions]
            body = self.action(node.expression)

            def let(st, lc, primed, label):
                inner = dict(lc)
                for name, f in defs:
                    inner[name] = f(self._with(st, primed), inner)
                yield from body(st, inner, primed, label)
            return let
        guard = self.expr(node)

        def check(st, lc, primed, label):
            if guard(self._with(st, primed), lc):
                yield primed, label
        check.guard_expr = guard
        return check

    @staticmethod
    def _with(st, primed):
        # Expressions evaluate synchronously, so every evaluation point can set the primed
        # values it sees in the shared state dict instead of copying the dict.
        st["'"] = primed
        return st

    def _conj_or_disj(self, op, nodes):
        parts = [self.action(n) for n in nodes]
        if op == "\\/":
            def disj(st, lc, primed, label):
                for part in parts:
                    yield from part(st, lc, primed, label)
            return disj

        # Conjuncts that are plain guards are evaluated as expressions, without a generator
        # each: most action calls fail at their first guard, and generators are costly.
        n = len(parts)
        exprs = [getattr(part, "guard_expr", None) for part in parts]

        def conj(st, lc, primed, label, i=0):
            while i < n and exprs[i] is not None:
                st["'"] = primed
                if not exprs[i](st, lc):
                    return
                i += 1
            if i == n:
                yield primed, label
                return
            for p, lab in parts[i](st, lc, primed, label):
                yield from conj(st, lc, p, lab, i + 1)
        lead = 0
        while lead < n and exprs[lead] is not None:
            lead += 1
        conj.leading_guards = exprs[:lead]
        return conj

    _init_mode = False

    def _is_variable(self, node) -> bool:
        return (type(node).__name__ == "OperatorApplication" and node.arguments is None
                and node.operator in self.variables)

    def _is_primed(self, node) -> bool:
        return type(node).__name__ == "OperatorApplication" and node.operator == "'"

    def _has_primes(self, node) -> bool:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            if type(node).__name__ == "OperatorApplication" and node.operator in ("'", "UNCHANGED"):
                return True
            if type(node).__name__ == "OperatorApplication" and node.operator in self.ops \
                    and node.operator != getattr(self, "_scanning", None):
                self._scanning = node.operator
                try:
                    if self._has_primes(self.ops[node.operator].body):
                        return True
                finally:
                    self._scanning = None
            return any(self._has_primes(getattr(node, f)) for f in node._fields)
        if isinstance(node, (list, tuple)):
            return any(self._has_primes(x) for x in node)
        return False

    def _assign(self, node, primed_lhs: bool = True):
        lhs = node.arguments[0]
        name = self._name(lhs.arguments[0] if primed_lhs else lhs)
        value = self.expr(node.arguments[1])

        def assign(st, lc, primed, label):
            v = value(self._with(st, primed), lc)
            if name in primed:
                if primed[name] == v:
                    yield primed, label
            else:
                yield {**primed, name: v}, label
        return assign

    def _assign_in(self, node):
        name = self._name(node.arguments[0].arguments[0])
        domain = self.expr(node.arguments[1])

        def assign_in(st, lc, primed, label):
            for v in sorted(_enumerable(domain(self._with(st, primed), lc), node), key=_order):
                if name not in primed:
                    yield {**primed, name: v}, label
                elif primed[name] == v:
                    yield primed, label
        return assign_in

    def _unchanged(self, node):
        if type(node).__name__ == "Tuple":
            names = [self._name(x) for x in node.items]
        else:
            names = [self._name(node)]
        expanded = []
        for name in names:
            if name in self.variables:
                expanded.append(name)
            elif name in self.ops and type(self.ops[name].body).__name__ == "Tuple":
                expanded += [self._name(x) for x in self.ops[name].body.items]
            else:
                raise EvalError(f"{_line(node)}: UNCHANGED {name}: not a variable or a tuple of "
                                "variables")

        def unchanged(st, lc, primed, label):
            for name in expanded:
                if name in primed and primed[name] != st[name]:
                    return
            yield {**primed, **{n: st[n] for n in expanded}}, label
        return unchanged

    def _call_action(self, node, name, args):
        op = self.ops[name]
        if len(args) != len(op.params):
            raise EvalError(f"{_line(node)}: {name} takes {len(op.params)} arguments")
        labelled = name in self.labels

        def call(st, lc, primed, label):
            """A plain function returning an iterator: an action whose leading guards fail
            returns () without creating a generator."""
            if op.action is None:
                op.action = self.action(op.body)
            st["'"] = primed
            inner = dict(zip(op.params, [a(st, lc) for a in args]))
            lead = getattr(op.action, "leading_guards", ())
            for guard in lead:
                st["'"] = primed
                if not guard(st, inner):
                    return ()
            if lead:
                return op.action(st, inner, primed, name if labelled else label, len(lead))
            return op.action(st, inner, primed, name if labelled else label)
        return call

    labels: frozenset[str] = frozenset()

    # -- the state graph ------------------------------------------------------------------

    def initial_states(self, init: str = "Init") -> list[dict]:
        """Init's states: in Init, `x = e` for an unassigned variable x assigns it."""
        self._init_mode = True
        try:
            act = self.action(self.ops[init].body)
        finally:
            self._init_mode = False
        out = []
        for primed, _ in act({}, {}, {}, None):
            out.append(self._complete({}, {v: primed[v] for v in primed}, "Init"))
        return out

    def _complete(self, st, assigned, label) -> dict:
        missing = [v for v in self.variables if v not in assigned]
        if missing:
            raise EvalError(f"{label} leaves {', '.join(missing)} unassigned")
        return {v: assigned[v] for v in self.variables}

    def successors(self, state: dict, next_: str = "Next") -> Iterator[tuple[str, dict]]:
        if not hasattr(self, "_next_action"):
            self._next_action = {}
        act = self._next_action.get(next_)
        if act is None:
            act = self._next_action[next_] = self.action(self.ops[next_].body)
        st = {**self.globals, **state}
        for primed, label in act(st, {}, {}, None):
            yield label, self._complete(state, primed, label or next_)

    def value(self, name: str, state: dict | None = None):
        """The value of a constant-level or state-level operator without arguments."""
        return self.expr(self.ops[name].body)({**self.globals, **(state or {})}, {})


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
