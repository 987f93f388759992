"""Translation of TLA+ actions to Python statements (part of spec/tlaplus/tlacompile.py).

An action is flattened into its conjuncts (through parentheses, nested conjunctions and the
action operators it calls, which are inlined) and generated left to right in continuation-
passing style: `step(item, primed, label, k)` emits one conjunct and calls k(primed, label)
to emit whatever follows, inside the block the conjunct opened. Conjuncts that assign
nothing are guards: consecutive guards become one `if`. The end of a path appends
(label, successor) to the list the generated function returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from spec.tlaplus.tlaexpr import Code, Scope, line_of, local, name_of
from spec.tlaplus.tlavalues import EvalError


@dataclass(frozen=True)
class Instance:
    """One action of Next where it occurs there: its label, the names Next binds around it
    (the arguments of `step`, in order) and the step: (state, *values) -> [(label, state)]."""

    label: str
    names: tuple[str, ...]
    step: Callable


@dataclass(frozen=True)
class Item:
    """One conjunct of a flattened action, with its scope and the label of the innermost
    labelled action it comes from (None: the label of whatever came before stays)."""

    node: object
    scope: Scope
    label: str | None


def lineno(node) -> int:
    start = getattr(node, "start", None)  # the parser counts lines from 0
    return start.line + 1 if start is not None else 0


class Emitter:
    """Python source lines, each with the spec line it came from."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.origins: list[int] = []
        self.depth = 0
        self.line = 0  # the spec line of what is being emitted

    def emit(self, text: str, line: int = 0) -> None:
        if line:
            self.line = line
        self.lines.append("    " * self.depth + text)
        self.origins.append(self.line)

    def open(self, header: str, line: int = 0) -> int:
        self.emit(header, line)
        self.depth += 1
        return len(self.lines)

    def close(self, opened: int) -> None:
        if len(self.lines) == opened:
            self.emit("pass")
        self.depth -= 1


Continuation = Callable[[dict, "str | None"], None]


class ActionRules:
    """Mixed into Compiler: actions as generated statements."""

    def action_function(self, name: str, init_mode: bool = False) -> Callable:
        """The operator `name` as a function: state tuple -> [(label, successor tuple)]."""
        op = self.ops.get(name)
        if op is None:
            raise EvalError(f"the spec has no operator {name}")
        em = self.em = Emitter()
        function = self.fresh("action", name)
        em.open(f"def {function}(state):", op.line)
        em.emit("successors = []")
        em.emit("add = successors.append")
        if not init_mode:
            self._unpack(em)
        label = name if name in self.labels else None
        try:
            self.items(self.flatten(op.body, Scope(init=init_mode), label, {}), {}, None,
                       self.finisher(name))
        except RecursionError:
            raise EvalError(f"{name}: recursion is not supported") from None
        em.emit("return successors")
        return self.define(em, function)

    def instances(self, next_: str = "Next") -> list["Instance"]:
        """Each action of `next_` as it occurs there, with the names bound around it made
        arguments: for `\\E r \\in Requests : ... Accept(r, ChecksumsMatch(r))`, a function
        (state, r) -> [(label, successor)] that checks r \\in Requests and takes Accept with
        the arguments Next gives it. A trace validator binds the names from a log record
        (CCF's Traceccfraft does the same by hand) instead of enumerating every choice Next
        has, which a shell's pools of many pages make impossible (SUBSET DPages)."""
        found: list[Instance] = []
        self._instances(self.ops[next_].body, Scope(), (), found)
        return found

    def _instances(self, node, scope: Scope, bound: tuple, found: list) -> None:
        kind = type(node).__name__
        if kind == "Parentheses":
            return self._instances(node.expression, scope, bound, found)
        if kind == "VerticalList" and node.operator == "\\/":
            for item in node.arguments:
                self._instances(item.expression, scope, bound, found)
            return
        if kind == "OperatorApplication" and node.operator in ("\\/", "\\lor"):
            for arg in node.arguments:
                self._instances(arg, scope, bound, found)
            return
        if kind == "Quantification" and node.quantifier in ("\\E", "\\exists"):
            for tla_name, domain in self.bounds(node.declarations):
                py = self.fresh("b", tla_name)
                bound += ((tla_name, py, self._membership(py, domain, scope), lineno(node)),)
                scope = scope.bind({tla_name: local(py)})
            return self._instances(node.predicate, scope, bound, found)
        if kind == "OperatorApplication" and node.operator in self.ops:
            if node.operator in self.labels:
                found.append(self._instance(node, scope, bound))
                return
            op, args = self.ops[node.operator], node.arguments or []
            codes = [self.expr(a, scope, None) for a in args]
            params = {p: Code(c.wrapped(), c.free, atomic=True) for p, c in zip(op.params, codes)}
            return self._instances(op.body, Scope(params), bound, found)
        raise EvalError(f"{line_of(node)}: {kind} in Next is not an action the trace "
                        "validator can name")

    def _membership(self, py: str, domain, scope: Scope) -> Code:
        """`py \\in domain` without building the domain where it is a powerset."""
        if type(domain).__name__ == "OperatorApplication" and domain.operator == "SUBSET":
            base = self.expr(domain.arguments[0], scope, None)
            return Code(f"type({py}) is frozenset and {py} <= {base.wrapped()}",
                        base.free | {py})
        dom = self.expr(domain, scope, None)
        return Code(f"{py} in {dom.wrapped()}", dom.free | {py})

    def _instance(self, node, scope: Scope, bound: tuple) -> "Instance":
        label = node.operator
        em = self.em = Emitter()
        function = self.fresh("instance", label)
        em.open(f"def {function}(state, {''.join(py + ', ' for _, py, _, _ in bound)}):",
                lineno(node))
        em.emit("successors = []")
        em.emit("add = successors.append")
        self._unpack(em)
        guards = [(member, line) for _, _, member, line in bound]
        self.guard(guards, lambda: self.items(self.flatten(node, scope, label, {}), {}, label,
                                              self.finisher(label)))
        em.emit("return successors")
        return Instance(label, tuple(name for name, _, _, _ in bound),
                        self.guarded(self.define(em, function)))

    def finisher(self, name: str) -> Continuation:
        def finish(primed: dict, label: str | None) -> None:
            label = label or name
            missing = [v for v in self.variables if v not in primed]
            if missing:
                message = f"{label} leaves {', '.join(missing)} unassigned"
                self.em.emit(f"raise EvalError({message!r})")
                return
            values = "".join(primed[v].text + ", " for v in self.variables)
            self.em.emit(f"add(({label!r}, ({values})))")
        return finish

    def flatten(self, node, scope: Scope, label: str | None, primed: dict) -> list[Item]:
        """The conjuncts of node, through parentheses, nested conjunctions and calls of
        action operators (inlined, their arguments substituted for their parameters)."""
        kind = type(node).__name__
        if kind == "Parentheses":
            return self.flatten(node.expression, scope, label, primed)
        parts = None
        if kind == "VerticalList" and node.operator == "/\\":
            parts = [i.expression for i in node.arguments]
        elif kind == "OperatorApplication" and node.operator in ("/\\", "\\land") \
                and node.arguments:
            parts = node.arguments
        if parts is not None:
            return [item for part in parts for item in self.flatten(part, scope, label, primed)]
        if kind == "OperatorApplication" and node.operator in self.ops \
                and node.operator not in scope.names \
                and (scope.init or self.has_primes(self.ops[node.operator].body)
                     or (self.tlc_branching and self.branches_in_tlc(node))):
            return self._inline_action(node, scope, label, primed)
        return [Item(node, scope, label)]

    def _inline_action(self, node, scope: Scope, label, primed) -> list[Item]:
        name, args = node.operator, node.arguments or []
        op = self.ops[name]
        if len(args) != len(op.params):
            raise EvalError(f"{line_of(node)}: {name} takes {len(op.params)} arguments")
        if name in self.inlining:
            raise EvalError(f"{line_of(node)}: {name} is recursive; recursion is not supported")
        if any(self.has_primes(a) for a in args):
            raise EvalError(f"{line_of(node)}: primed arguments of {name} are not supported")
        codes = [self.expr(a, scope, primed) for a in args]
        params = {p: Code(c.wrapped(), c.free, atomic=True) for p, c in zip(op.params, codes)}
        self.inlining.append(name)
        try:
            return self.flatten(op.body, Scope(params, scope.init),
                                name if name in self.labels else label, primed)
        finally:
            self.inlining.pop()

    def items(self, items: list[Item], primed: dict, label, k: Continuation) -> None:
        if not items:
            return k(primed, label)
        n = 0
        while n < len(items) and self.is_guard(items[n], primed):
            n += 1
        if n:
            codes = [(self.expr(i.node, i.scope, primed), lineno(i.node)) for i in items[:n]]
            after = next((i.label for i in reversed(items[:n]) if i.label), label)
            return self.guard(codes, lambda: self.items(items[n:], primed, after, k))
        first = items[0]
        self.step(first, primed, first.label or label,
                  lambda p, lab: self.items(items[1:], p, lab, k))

    def is_guard(self, item: Item, primed: dict) -> bool:
        if self.has_primes(item.node):
            return False
        if self.tlc_branching and len(primed) < len(self.variables) \
                and self.branches_in_tlc(item.node):
            return False  # a branch point, as in TLC, although it assigns nothing
        return not (item.scope.init and self.reads_unassigned(item.node, primed))

    def branches_in_tlc(self, node) -> bool:
        """Whether TLC's successor enumeration branches on this conjunct: a \\/ or \\E, also
        inside a conjunction, IF, CASE, LET or the body of an operator it applies (TLC enters
        those; it evaluates a zero-argument operator without variables once, as a value).
        Such a conjunct generates the rest of the action once per branch that holds, so
        TLC counts a successor as often as its guard holds (spec/check/tlccount.py)."""
        kind = type(node).__name__
        if kind == "Parentheses":
            return self.branches_in_tlc(node.expression)
        if kind == "Quantification":
            return node.quantifier in ("\\E", "\\exists")
        if kind == "VerticalList":
            return node.operator == "\\/" or any(self.branches_in_tlc(i.expression)
                                                 for i in node.arguments)
        if kind == "If":
            return self.branches_in_tlc(node.then) or self.branches_in_tlc(node.else_)
        if kind == "Cases":
            return any(self.branches_in_tlc(a.expression) for a in node.cases) or (
                node.other is not None and self.branches_in_tlc(node.other))
        if kind == "Let":
            return self.branches_in_tlc(node.expression)
        if kind != "OperatorApplication":
            return False
        if node.operator in ("\\/", "\\lor"):
            return True
        if node.operator in ("/\\", "\\land"):
            return any(self.branches_in_tlc(a) for a in node.arguments or [])
        op = self.ops.get(node.operator)
        if op is None or node.operator in self.inlining or node.operator in self.tlc_entered:
            return False
        if not op.params and not self.mentions_variables(op.body):
            return False
        self.tlc_entered.add(node.operator)
        try:
            return self.branches_in_tlc(op.body)
        finally:
            self.tlc_entered.discard(node.operator)

    def guard(self, codes: list[tuple[Code, int]], then: Callable[[], None]) -> None:
        """`if g1 and g2 ...:` around what `then` emits; one line per conjunct, so that an
        error is reported at its own spec line. A constant FALSE first makes the path dead."""
        kept = []
        for code, line in codes:
            decided = self.truth(code)
            if decided is True:
                continue
            if decided is False and not kept:
                return
            kept.append((code, line))
            if decided is False:
                break
        if not kept:
            return then()
        em = self.em
        if len(kept) == 1:
            opened = em.open(f"if {kept[0][0].text}:", kept[0][1])
        else:
            em.emit("if (", kept[0][1])
            for i, (code, line) in enumerate(kept):
                em.emit(f"    {code.wrapped()}{' and' if i < len(kept) - 1 else ''}", line)
            opened = em.open("):")
        then()
        em.close(opened)

    def step(self, item: Item, primed: dict, label, k: Continuation) -> None:
        node, kind = item.node, type(item.node).__name__
        if kind == "OperatorApplication" and node.arguments:
            op, args = node.operator, node.arguments
            if op in ("=", "\\in"):
                var = self._target(args[0], item.scope)
                if var is not None:
                    return self.assign(op, var, args[1], item, primed, label, k)
            if op == "UNCHANGED":
                return self.unchanged(item, primed, label, k)
            if op in ("\\/", "\\lor"):
                return self.branches(args, item, primed, label, k)
        if kind == "VerticalList" and node.operator == "\\/":
            return self.branches([i.expression for i in node.arguments], item, primed, label, k)
        if kind == "Quantification" and node.quantifier in ("\\E", "\\exists"):
            return self.exists(item, primed, label, k)
        rule = {"If": self.if_then_else, "Cases": self.case, "Let": self.let}.get(kind)
        if rule is not None:
            return rule(item, primed, label, k)
        # Any other conjunct is a condition on the new state so far, e.g. x' > 0.
        code = self.expr(node, item.scope, primed)
        self.guard([(code, lineno(node))], lambda: k(primed, label))

    def _target(self, lhs, scope: Scope) -> str | None:
        """The variable an `x' = e` or `x' \\in S` (in Init: `x = e`, `x \\in S`) is about."""
        if type(lhs).__name__ != "OperatorApplication":
            return None
        if lhs.operator == "'" and lhs.arguments:
            var = name_of(lhs.arguments[0])
            return var if var in self.variables else None
        if scope.init and lhs.arguments is None and lhs.operator in self.variables \
                and lhs.operator not in scope.names:
            return lhs.operator
        return None

    def assign(self, op, var, rhs, item: Item, primed: dict, label, k: Continuation) -> None:
        """Assigns var when the path has not yet assigned it; compares otherwise."""
        line = lineno(item.node)
        if var in primed:
            value = self.expr(rhs, item.scope, primed)
            test = Code(f"{primed[var].wrapped()} {'==' if op == '=' else 'in'} "
                        f"{value.wrapped()}", primed[var].free | value.free)
            return self.guard([(self.fold(test), line)], lambda: k(primed, label))
        if op == "=":
            py = self._except_in_place(var, rhs, item.scope, primed, line)
            if py is not None:
                return k({**primed, var: local(py)}, label)
            value = self.expr(rhs, item.scope, primed)
            if not value.atomic:
                py = self.fresh("p", var)
                self.em.emit(f"{py} = {value.text}", line)
                value = local(py)
            return k({**primed, var: value}, label)
        domain = self.loop_domain(rhs, item.scope, primed)
        py = self.fresh("p", var)
        opened = self.em.open(f"for {py} in {domain.text}:", line)
        k({**primed, var: local(py)}, label)
        self.em.close(opened)

    def _except_in_place(self, var: str, rhs, scope: Scope, primed: dict, line: int):
        """`x' = [f EXCEPT ![k] = e]`, the commonest assignment, as statements: copy f, set
        k (a new key would grow the copy: k outside DOMAIN f, an error). Saves a call per
        assignment; returns the name assigned, or None when the form does not apply."""
        while type(rhs).__name__ in ("Parentheses", "If"):
            if type(rhs).__name__ == "Parentheses":
                rhs = rhs.expression
                continue
            decided = self.truth(self.expr(rhs.predicate, scope, primed))
            if decided is None:
                return None
            rhs = rhs.then if decided else rhs.else_  # a constant IF: a bug switch
        if type(rhs).__name__ != "Except" or len(rhs.changes) != 1:
            return None
        (change,) = rhs.changes
        if len(change.item) != 1 or not isinstance(change.item[0], list) \
                or len(change.item[0]) != 1:
            return None
        f = self.expr(rhs.function, scope, primed)
        at = self.fresh("l", "at")
        key = self.expr(change.item[0][0], scope, primed)
        value = self.expr(change.expression, scope.bind({"@": local(at)}), primed)
        if not f.atomic or at in value.free:
            return None
        py = self.fresh("p", var)
        self.em.emit(f"{py} = Fcn({f.text}) if type({f.text}) is Fcn else except_outside("
                     f"{f.text}, {key.text})", line)
        self.em.emit(f"{py}[{key.text}] = {value.text}")
        self.em.emit(f"if len({py}) != len({f.text}): except_outside({f.text}, {key.text})")
        return py

    def unchanged(self, item: Item, primed: dict, label, k: Continuation) -> None:
        if item.scope.init:
            raise EvalError(f"{line_of(item.node)}: UNCHANGED in an initial predicate")
        new, tests = dict(primed), []
        for var in self._unchanged_names(item.node.arguments[0]):
            if var in new:
                tests.append((Code(f"{new[var].wrapped()} == v_{var}",
                                   new[var].free | {f"v_{var}"}), lineno(item.node)))
            else:
                new[var] = local(f"v_{var}")
        self.guard(tests, lambda: k(new, label))

    def _unchanged_names(self, node) -> list[str]:
        if type(node).__name__ == "Tuple":
            return [v for x in node.items for v in self._unchanged_names(x)]
        name = name_of(node)
        if type(node).__name__ == "OperatorApplication" and node.arguments is None:
            if name in self.variables:
                return [name]
            if name in self.ops and not self.ops[name].params:
                return self._unchanged_names(self.ops[name].body)
        raise EvalError(f"{line_of(node)}: UNCHANGED {name}: not a variable or a tuple of "
                        "variables")

    def branches(self, disjuncts: list, item: Item, primed: dict, label, k) -> None:
        """Each disjunct is a path of its own, followed by everything after the disjunction."""
        for disjunct in disjuncts:
            self.items(self.flatten(disjunct, item.scope, item.label, primed), primed, label, k)

    def exists(self, item: Item, primed: dict, label, k: Continuation) -> None:
        """`\\E x \\in S : body` as a loop. The body's leading guards that do not mention x
        are tested once, before the loop: most actions stop there, without enumerating S."""
        node, scope, line = item.node, item.scope, lineno(item.node)
        loops, names = [], set()
        for tla_name, domain_node in self.bounds(node.declarations):
            domain = self.loop_domain(domain_node, scope, primed)
            py = self.fresh("l", tla_name)
            loops.append((py, domain))
            scope = scope.bind({tla_name: local(py)})
            names.add(py)
        body = self.flatten(node.predicate, scope, item.label, primed)
        hoisted = []
        for inner in body:
            if not self.is_guard(inner, primed):
                break
            code = self.expr(inner.node, inner.scope, primed)
            if code.free & names:
                break
            hoisted.append((code, lineno(inner.node), inner.label))
        rest = body[len(hoisted):]
        after = next((lab for _, _, lab in reversed(hoisted) if lab), label)

        def loop(i: int) -> None:
            if i == len(loops):
                return self.items(rest, primed, after, k)
            py, domain = loops[i]
            opened = self.em.open(f"for {py} in {domain.text}:", line)
            loop(i + 1)
            self.em.close(opened)

        guards = [(code, at) for code, at, _ in hoisted]
        first = loops[0][1]
        if not first.free:
            if not self.value_of(first):
                return  # a constant empty set: no successor, nothing evaluated
        else:
            # The set is evaluated before the guards and an empty one skips them, as in TLC.
            domain = self.fresh("d")
            self.em.emit(f"{domain} = {first.text}", line)
            loops[0] = (loops[0][0], local(domain))
            guards.insert(0, (local(domain), line))
        self.guard(guards, lambda: loop(0))

    def if_then_else(self, item: Item, primed: dict, label, k: Continuation) -> None:
        node, scope = item.node, item.scope
        cond = self.expr(node.predicate, scope, primed)

        def branch(body) -> None:
            self.items(self.flatten(body, scope, item.label, primed), primed, label, k)
        decided = self.truth(cond)
        if decided is not None:
            return branch(node.then if decided else node.else_)
        opened = self.em.open(f"if {cond.text}:", lineno(node))
        branch(node.then)
        self.em.close(opened)
        opened = self.em.open("else:", lineno(node))
        branch(node.else_)
        self.em.close(opened)

    def case(self, item: Item, primed: dict, label, k: Continuation) -> None:
        """The first arm whose condition holds; none and no OTHER is an error, as in TLC.
        An arm whose condition is constant TRUE ends the chain (it is the OTHER)."""
        node, scope, em = item.node, item.scope, self.em

        def branch(body) -> None:
            if body is None:
                return em.emit("no_case_applies()", lineno(node))
            self.items(self.flatten(body, scope, item.label, primed), primed, label, k)
        default, first = node.other, True
        for arm in node.cases:
            cond = self.expr(arm.predicate, scope, primed)
            decided = self.truth(cond)
            if decided is False:
                continue
            if decided is True:
                default = arm.expression
                break
            opened = em.open(f"{'if' if first else 'elif'} {cond.text}:", lineno(arm))
            branch(arm.expression)
            em.close(opened)
            first = False
        if first:
            return branch(default)
        opened = em.open("else:")
        branch(default)
        em.close(opened)

    def let(self, item: Item, primed: dict, label, k: Continuation) -> None:
        """LET definitions in an action are evaluated once, where the LET is."""
        scope = item.scope
        for definition in item.node.definitions:
            if type(definition).__name__ != "OperatorDefinition" or definition.arity:
                raise EvalError(f"{line_of(definition)}: LET supports definitions without "
                                "arguments only")
            value = self.expr(definition.definiens, scope, primed)
            if not value.atomic:
                py = self.fresh("l", definition.name)
                self.em.emit(f"{py} = {value.text}", lineno(definition))
                value = local(py)
            scope = scope.bind({definition.name: value})
        self.items(self.flatten(item.node.expression, scope, item.label, primed), primed,
                   label, k)
