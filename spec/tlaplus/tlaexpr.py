"""Translation of TLA+ expressions to Python expressions (part of spec/tlaplus/tlacompile.py).

Each rule returns a `Code`: the Python text and the runtime names it mentions (variables,
bound names, parameters). `expr` folds every Code that mentions none: the constants of the
.cfg, the definitions built on them and any closed subexpression become values computed once.
User operators are inlined with their arguments substituted (TLA+'s own semantics), except
pure ones that loop, which become memoized Python functions (`memo_function`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spec.tlaplus.tlavalues import EvalError

# Python templates of the standard operators, each operand in parentheses where needed.
BINARY = {
    "=": "{} == {}", "#": "{} != {}", "/=": "{} != {}", "<": "{} < {}", ">": "{} > {}",
    "<=": "{} <= {}", "=<": "{} <= {}", "\\leq": "{} <= {}", ">=": "{} >= {}",
    "\\geq": "{} >= {}", "+": "{} + {}", "-": "{} - {}", "\\in": "{} in {}",
    "\\notin": "{} not in {}", "\\cup": "{} | {}", "\\union": "{} | {}", "\\cap": "{} & {}",
    "\\intersect": "{} & {}", "\\": "{} - {}", "\\subseteq": "{} <= {}", "=>": "not {} or {}",
    "..": "interval({}, {})",
}
UNARY = {"~": "not {}", "\\lnot": "not {}", "\\neg": "not {}", "-": "-{}", "DOMAIN": "domain({})",
         "SUBSET": "subsets({})", "Cardinality": "cardinality({})", "Len": "length({})",
         "Seq": "SeqSet({})"}
JUNCTIONS = ("/\\", "\\/", "\\land", "\\lor")
LOOPING = {"Quantification", "Choose", "SetComprehension", "SetSlice", "Function",
           "SetOfFunctions"}
MEMO_ENTRIES_MAX = 100_000  # per memoized operator; the memo is cleared when full
RUNTIME_ERRORS = (EvalError, KeyError, TypeError, AttributeError, IndexError,
                  ZeroDivisionError, RecursionError)


def line_of(node) -> str:
    start = getattr(node, "start", None)  # the parser counts lines from 0
    return f"line {start.line + 1}" if start is not None else "unknown line"


def name_of(node) -> str:
    if isinstance(node, str):
        return node
    if hasattr(node, "operator") and isinstance(node.operator, str):
        return node.operator
    if hasattr(node, "name") and isinstance(node.name, str):
        return node.name
    raise EvalError(f"{line_of(node)}: cannot read a name from {type(node).__name__}")


@dataclass(frozen=True)
class Code:
    """A Python expression: its text, the runtime names it mentions, and whether it is a
    single name or literal (then it needs no parentheses and no folding)."""

    text: str
    free: frozenset = frozenset()
    atomic: bool = False

    def wrapped(self) -> str:
        return self.text if self.atomic else f"({self.text})"


def local(name: str) -> Code:
    return Code(name, frozenset({name}), atomic=True)


def union(codes) -> frozenset:
    return frozenset().union(*(c.free for c in codes))


@dataclass(frozen=True)
class Scope:
    """The names an expression sees besides constants, variables and operators."""

    names: dict = field(default_factory=dict)  # TLA+ name -> Code
    init: bool = False  # in Init, unprimed variables are the ones being assigned

    def bind(self, more: dict) -> "Scope":
        return Scope({**self.names, **more}, self.init)


class ExpressionRules:
    """Mixed into Compiler: one method per kind of parse-tree node."""

    def expr(self, node, scope: Scope, primed: dict | None) -> Code:
        """primed: variable -> Code of its new value in an action, None outside actions."""
        if isinstance(node, str):  # the parser gives @ as a bare string
            return self.name(node, node, scope, primed)
        kind = type(node).__name__
        method = getattr(self, f"_e_{kind}", None)
        if method is None:
            raise EvalError(f"{line_of(node)}: {kind} is not in the supported TLA+ subset")
        return self.fold(method(node, scope, primed))

    def name(self, node, name: str, scope: Scope, primed) -> Code:
        if name in scope.names:
            return scope.names[name]
        if name in self.variables:
            if scope.init:
                return self.primed_ref(node, name, primed)
            return local(f"v_{name}")
        if name in self.constants:
            return self.constants[name]
        if name in ("Nat", "Int", "BOOLEAN"):
            return Code({"Nat": "NAT", "Int": "INT", "BOOLEAN": "BOOLEAN"}[name], atomic=True)
        if name in self.ops:
            return self.call(node, name, [], scope, primed)
        raise EvalError(f"{line_of(node)}: unknown name {name}")

    def primed_ref(self, node, var: str, primed) -> Code:
        if primed is None:
            raise EvalError(f"{line_of(node)}: {var}' outside an action")
        if var in primed:
            return primed[var]
        # Reached only on a path that reads x' before assigning it: an error there.
        return Code(f"unassigned({var!r})", frozenset({"'"}))

    def call(self, node, name: str, args: list, scope: Scope, primed) -> Code:
        op = self.ops[name]
        if len(args) != len(op.params):
            raise EvalError(f"{line_of(node)}: {name} takes {len(op.params)} arguments")
        if name in self.inlining:
            raise EvalError(f"{line_of(node)}: {name} is recursive; recursion is not supported")
        codes = [self.expr(a, scope, primed) for a in args]
        function = self.memo_function(name)
        if function is not None:
            return Code(f"{function}({', '.join(c.text for c in codes)})", union(codes))
        self.inlining.append(name)
        try:
            params = {p: Code(c.wrapped(), c.free, atomic=True) for p, c in zip(op.params, codes)}
            return self.expr(op.body, Scope(params, scope.init), primed)
        finally:
            self.inlining.pop()

    def memo_function(self, name: str) -> str | None:
        """A Python function memoized on its arguments, for an operator that mentions no
        variable and loops (Ascending's CHOOSE, Range's comprehension); None for the rest,
        which are inlined (cheaper than a call and a lookup)."""
        if name in self.memo_functions:
            return self.memo_functions[name]
        op = self.ops[name]
        self.memo_functions[name] = None
        if not op.params or self.has_primes(op.body) or not self.loops(op.body):
            return None
        params = {p: local(self.fresh("a", p)) for p in op.params}
        self.inlining.append(name)
        try:
            body = self.expr(op.body, Scope(params), None)
        finally:
            self.inlining.pop()
        args = [c.text for c in params.values()]
        if not body.free <= frozenset(args):
            return None  # it reads the state: inline it
        function, memo = self.fresh("fn", name), self.fresh("M", name)
        key = args[0] if len(args) == 1 else f"({', '.join(args)})"
        self.namespace[memo] = {}
        em = self.emitter()
        em.open(f"def {function}({', '.join(args)}):", op.line)
        em.emit(f"value = {memo}.get({key}, NOTHING)")
        opened = em.open("if value is NOTHING:")
        em.emit(f"if len({memo}) >= {MEMO_ENTRIES_MAX}: {memo}.clear()")
        em.emit(f"value = {memo}[{key}] = {body.text}")
        em.close(opened)
        em.emit("return value")
        self.define(em, function)
        self.memo_functions[name] = function
        return function

    def junction(self, op: str, codes: list[Code]) -> Code:
        """/\\ or \\/ with constants folded the way left-to-right evaluation allows: a
        neutral constant goes, an absorbing one ends the list (and decides it, if first)."""
        neutral = op in ("/\\", "\\land")
        kept = []
        for code in codes:
            value = self.truth(code)
            if value is neutral:
                continue
            kept.append(code)
            if value is not None:
                break
        if not kept:
            return Code(repr(neutral), atomic=True)
        if len(kept) == 1:
            return kept[0]
        joiner = " and " if neutral else " or "
        return Code(joiner.join(c.wrapped() for c in kept), union(kept))

    def _e_OperatorApplication(self, node, scope: Scope, primed) -> Code:
        op, args = node.operator, node.arguments
        if args is None:
            return self.name(node, op, scope, primed)
        if op == "'":
            var = name_of(args[0])
            if var not in self.variables:
                raise EvalError(f"{line_of(node)}: only variables can be primed")
            return self.primed_ref(node, var, primed)
        if op in self.ops:
            return self.call(node, op, args, scope, primed)
        template = BINARY.get(op) if len(args) == 2 else UNARY.get(op) if len(args) == 1 \
            else None
        if op not in JUNCTIONS and template is None:  # checked before the arguments are read
            raise EvalError(f"{line_of(node)}: operator {op} is not in the supported TLA+ "
                            "subset")
        codes = [self.expr(a, scope, primed) for a in args]
        if op in JUNCTIONS:
            return self.junction(op, codes)
        return Code(template.format(*(c.wrapped() for c in codes)), union(codes))

    def _e_Parentheses(self, node, scope, primed) -> Code:
        return self.expr(node.expression, scope, primed)

    def _e_IntegralNumeral(self, node, scope, primed) -> Code:
        return Code(str(int(node.value)), atomic=True)

    def _e_StringLiteral(self, node, scope, primed) -> Code:
        return Code(repr(node.value[1:-1]), atomic=True)

    def _e_BooleanLiteral(self, node, scope, primed) -> Code:
        return Code(repr(node.value == "TRUE"), atomic=True)

    def _e_SetOfBooleans(self, node, scope, primed) -> Code:
        return Code("BOOLEAN", atomic=True)

    def _e_SetEnumeration(self, node, scope, primed) -> Code:
        codes = [self.expr(x, scope, primed) for x in node.items]
        return Code(f"frozenset(({''.join(c.text + ', ' for c in codes)}))", union(codes))

    def _e_Tuple(self, node, scope, primed) -> Code:
        codes = [self.expr(x, scope, primed) for x in node.items]
        pairs = ", ".join(f"{i}: {c.text}" for i, c in enumerate(codes, 1))
        return Code(f"Fcn({{{pairs}}})", union(codes))

    def _e_Record(self, node, scope, primed) -> Code:
        fields = [(name_of(k), self.expr(v, scope, primed)) for k, v in node.key_values]
        pairs = ", ".join(f"{k!r}: {c.text}" for k, c in fields)
        return Code(f"Fcn({{{pairs}}})", union(c for _, c in fields))

    def _e_Field(self, node, scope, primed) -> Code:
        record = self.expr(node.expression, scope, primed)
        return Code(f"{record.wrapped()}[{name_of(node.name)!r}]", record.free)

    def _e_FunctionApplication(self, node, scope, primed) -> Code:
        if len(node.arguments) != 1:
            raise EvalError(f"{line_of(node)}: f[a, b] is not supported")
        f, x = self.expr(node.function, scope, primed), self.expr(node.arguments[0], scope, primed)
        return Code(f"{f.wrapped()}[{x.text}]", f.free | x.free)

    def bounds(self, declarations) -> list[tuple[str, object]]:
        """`x, y \\in S, z \\in T` parses as [x, (y \\in S), (z \\in T)]: [(x, S), (y, S),
        (z, T)], each set in the scope of the names before it (TLA+'s nesting)."""
        if not isinstance(declarations, list):
            declarations = [declarations]
        out, pending = [], []
        for decl in declarations:
            kind = type(decl).__name__
            if kind == "OperatorApplication" and decl.operator == "\\in" and decl.arguments \
                    and type(decl.arguments[0]).__name__ == "OperatorApplication":
                for n in pending + [name_of(decl.arguments[0])]:
                    out.append((n, decl.arguments[1]))
                pending = []
            elif kind == "OperatorApplication" and decl.arguments is None:
                pending.append(decl.operator)
            else:
                raise EvalError(f"{line_of(decl)}: only bounded declarations x \\in S are "
                                "supported")
        if pending:
            raise EvalError(f"{line_of(declarations[0])}: unbounded {pending} not supported")
        return out

    def comprehension(self, declarations, scope: Scope, primed):
        """The `for` clauses of a Python comprehension over the bounds, and the inner scope."""
        clauses, names, free = [], set(), set()
        for tla_name, domain_node in self.bounds(declarations):
            domain = self.loop_domain(domain_node, scope, primed)
            py = self.fresh("l", tla_name)
            scope = scope.bind({tla_name: local(py)})
            clauses.append(f"for {py} in {domain.text}")
            names.add(py)
            free |= domain.free
        return " ".join(clauses), scope, names, free

    def _e_Quantification(self, node, scope, primed) -> Code:
        if node.quantifier not in ("\\A", "\\forall", "\\E", "\\exists"):
            raise EvalError(f"{line_of(node)}: quantifier {node.quantifier} is not supported")
        clauses, inner, names, free = self.comprehension(node.declarations, scope, primed)
        body = self.expr(node.predicate, inner, primed)
        test = "all" if node.quantifier in ("\\A", "\\forall") else "any"
        return Code(f"{test}({body.wrapped()} {clauses})", frozenset((free | body.free) - names))

    def _e_Choose(self, node, scope, primed) -> Code:
        """The first value in the fixed order of sort_key: deterministic, like TLC's."""
        bounds = self.bounds(node.declaration)
        if len(bounds) != 1:
            raise EvalError(f"{line_of(node)}: CHOOSE binds one name")
        (tla_name, domain_node), = bounds
        domain = self.expr(domain_node, scope, primed)
        py = self.fresh("l", tla_name)
        body = self.expr(node.predicate, scope.bind({tla_name: local(py)}), primed)
        ordered = self.loop_domain(domain_node, scope, primed).text if not domain.free \
            else f"sorted_values({domain.text})"
        return Code(f"chosen(next(({py} for {py} in {ordered} if {body.wrapped()}), NOTHING))",
                    frozenset((domain.free | body.free) - {py}))

    def _e_SetComprehension(self, node, scope, primed) -> Code:
        clauses, inner, names, free = self.comprehension(node.declarations, scope, primed)
        item = self.expr(node.item, inner, primed)
        return Code(f"frozenset([{item.text} {clauses}])", frozenset((free | item.free) - names))

    def _one_name(self, node, declaration, scope, primed, form: str):
        """The comprehension of `{x \\in S : P}` or `[x \\in S |-> e]`: they bind one name."""
        clauses, inner, names, free = self.comprehension(declaration, scope, primed)
        if len(names) != 1:
            raise EvalError(f"{line_of(node)}: only {form} with one bound name is supported")
        return clauses, inner, next(iter(names)), free

    def _e_SetSlice(self, node, scope, primed) -> Code:
        clauses, inner, py, free = self._one_name(node, node.declaration, scope, primed,
                                                  "{x \\in S : P}")
        pred = self.expr(node.predicate, inner, primed)
        return Code(f"frozenset([{py} {clauses} if {pred.wrapped()}])",
                    frozenset((free | pred.free) - {py}))

    def _e_Function(self, node, scope, primed) -> Code:
        clauses, inner, py, free = self._one_name(node, node.declaration, scope, primed,
                                                  "[x \\in S |-> e]")
        value = self.expr(node.value, inner, primed)
        return Code(f"Fcn({{{py}: {value.text} {clauses}}})",
                    frozenset((free | value.free) - {py}))

    def _e_SetOfFunctions(self, node, scope, primed) -> Code:
        d, c = self.expr(node.domain, scope, primed), self.expr(node.codomain, scope, primed)
        return Code(f"FunctionSet({d.text}, {c.text})", d.free | c.free)

    def _e_If(self, node, scope, primed) -> Code:
        cond = self.expr(node.predicate, scope, primed)
        decided = self.truth(cond)
        if decided is not None:
            return self.expr(node.then if decided else node.else_, scope, primed)
        a, b = self.expr(node.then, scope, primed), self.expr(node.else_, scope, primed)
        return Code(f"{a.wrapped()} if {cond.wrapped()} else {b.wrapped()}",
                    cond.free | a.free | b.free)

    def _e_Cases(self, node, scope, primed) -> Code:
        """Arms tried in order, the first true one taken (TLC's choice too)."""
        rest = self.expr(node.other, scope, primed) if node.other is not None \
            else Code("no_case_applies()", frozenset({"'"}))
        for arm in reversed(node.cases):
            cond = self.expr(arm.predicate, scope, primed)
            decided = self.truth(cond)
            if decided is False:
                continue
            value = self.expr(arm.expression, scope, primed)
            if decided:
                rest = value
                continue
            rest = Code(f"{value.wrapped()} if {cond.wrapped()} else {rest.wrapped()}",
                        cond.free | value.free | rest.free)
        return rest

    def _e_Let(self, node, scope, primed) -> Code:
        binds = []
        for definition in node.definitions:
            if type(definition).__name__ != "OperatorDefinition" or definition.arity:
                raise EvalError(f"{line_of(definition)}: LET supports definitions without "
                                "arguments only")
            value = self.expr(definition.definiens, scope, primed)
            if value.atomic:
                scope = scope.bind({definition.name: value})
                continue
            py = self.fresh("l", definition.name)
            scope = scope.bind({definition.name: local(py)})
            binds.append((py, value))
        body = self.expr(node.expression, scope, primed)
        text, free = body.text, body.free
        for py, value in reversed(binds):
            text, free = f"(lambda {py}: {text})({value.text})", (free - {py}) | value.free
        return Code(text, free)

    def _e_Except(self, node, scope, primed) -> Code:
        f = self.expr(node.function, scope, primed)
        text, free = f.text, set(f.free)
        for change in node.changes:
            keys = []
            for step in change.item:
                if isinstance(step, str):
                    keys.append(Code(repr(step), atomic=True))
                elif isinstance(step, list) and len(step) == 1:
                    keys.append(self.expr(step[0], scope, primed))
                else:
                    raise EvalError(f"{line_of(change)}: EXCEPT ![a, b] is not supported")
            # ![a][b] = e is ![a] = [@ EXCEPT ![b] = e]: one except_at per step but the last,
            # each on the value the step before reached; @ is the value at the whole path.
            outer = [self.fresh("l", "at") for _ in keys[:-1]]
            at = self.fresh("l", "at")
            value = self.expr(change.expression, scope.bind({"@": local(at)}), primed)
            base = outer[-1] if outer else text
            if at in value.free:
                inner = f"except_at({base}, {keys[-1].text}, lambda {at}: {value.text})"
            else:
                inner = f"except_({base}, {keys[-1].text}, {value.text})"
            for k in range(len(outer) - 1, -1, -1):
                base = outer[k - 1] if k else text
                inner = f"except_at({base}, {keys[k].text}, lambda {outer[k]}: {inner})"
            text = inner
            for key in keys:
                free |= key.free
            free |= value.free - {at} - set(outer)
        return Code(text, frozenset(free))

    def _e_VerticalList(self, node, scope, primed) -> Code:
        return self.junction(node.operator, [self.expr(i.expression, scope, primed)
                                             for i in node.arguments])
