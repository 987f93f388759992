"""TLA+ parse tree -> Python source: the translation behind spec/tlaplus/tlaeval.py.

Expressions become Python expressions (`Code`: the text and the runtime names it mentions,
so that a subexpression mentioning none is folded to a constant on the spot). Actions
become statements, generated in continuation-passing style: each step of an action is given
"what comes after" as a function that emits it, so a branch emits the rest of the action
inside itself, a `\\E` emits it inside its loop, and the end of every path appends one
successor. Which variables a path has assigned is known while generating (the `primed` map,
variable -> the Code of its new value), so the generated code never looks it up.

Names in the generated code: v_x is variable x in the current state; pN_x, lN_x, aN_x and dN
are fresh names for a new value, a bound name, an operator parameter and a loop domain; KN
is a folded constant. Each generated line remembers the spec line it came from, so that an
error at run time is reported at the spec's line (`Compiler.translate`).
"""

from __future__ import annotations

import itertools
import linecache
from typing import Callable

from spec.tlaplus.tlaaction import ActionRules, Emitter
from spec.tlaplus.tlaexpr import LOOPING, RUNTIME_ERRORS, Code, ExpressionRules, Scope, line_of
from spec.tlaplus.tlavalues import RUNTIME, EvalError, sorted_values


class Compiler(ExpressionRules, ActionRules):
    """Translates a Spec's operators to Python functions, sharing one namespace."""

    def __init__(self, spec) -> None:
        self.spec, self.ops, self.variables = spec, spec.ops, spec.variables
        self.labels = spec.labels
        # Branch where TLC branches (on guards too), to count successors as TLC does.
        self.tlc_branching: bool = getattr(spec, "tlc_branching", False)
        self.tlc_entered: set[str] = set()
        self.namespace: dict = dict(RUNTIME)
        self.origins: dict[str, list[int]] = {}
        self.fresh_ids = itertools.count()
        self.memo_functions: dict[str, str | None] = {}
        self.inlining: list[str] = []
        self._primes: dict[str, bool] = {}
        self.em = Emitter()
        self.constants = {name: self.constant(value) for name, value in spec.constants.items()}

    def emitter(self) -> Emitter:
        return Emitter()

    def fresh(self, prefix: str, name: str = "") -> str:
        return f"{prefix}{next(self.fresh_ids)}_{name}" if name else \
            f"{prefix}{next(self.fresh_ids)}"

    # -- constants ------------------------------------------------------------------------

    def constant(self, value) -> Code:
        if type(value) in (bool, str) or (type(value) is int and value >= 0):
            return Code(repr(value), atomic=True)
        name = self.fresh("K")
        self.namespace[name] = value
        return Code(name, atomic=True)

    def fold(self, code: Code) -> Code:
        """A subexpression that mentions no runtime name is evaluated now, once. One that
        fails is left to fail at run time, where it is reached (if it is)."""
        if code.free or code.atomic:
            return code
        try:
            return self.constant(eval(code.text, self.namespace))
        except RUNTIME_ERRORS:
            return code

    def value_of(self, code: Code):
        return eval(code.text, self.namespace)

    @staticmethod
    def truth(code: Code):
        """True or False for a folded boolean constant, else None."""
        return {"True": True, "False": False}.get(code.text)

    def loop_domain(self, node, scope: Scope, primed) -> Code:
        """What a loop over the set `node` iterates: a constant tuple in a fixed order when
        the set is constant, a range for a..b, else the set checked to be enumerable."""
        if type(node).__name__ == "OperatorApplication" and node.operator == ".." \
                and node.arguments:
            a, b = (self.expr(x, scope, primed) for x in node.arguments)
            if not (a.free or b.free):
                return self.constant(tuple(range(self.value_of(a), self.value_of(b) + 1)))
            return Code(f"range({a.wrapped()}, {b.wrapped()} + 1)", a.free | b.free)
        if type(node).__name__ == "OperatorApplication" and node.operator == "DOMAIN" \
                and node.arguments and len(node.arguments) == 1:
            f = self.expr(node.arguments[0], scope, primed)
            if f.free:  # iterating a function iterates its domain; nothing is built
                return Code(f"domain_keys({f.text})", f.free)
        dom = self.expr(node, scope, primed)
        if dom.free and dom.atomic:  # the test inline: a call costs more than the loop
            return Code(f"({dom.text} if type({dom.text}) is frozenset else "
                        f"enumerable({dom.text}))", dom.free)
        if dom.free:
            return Code(f"enumerable({dom.text})", dom.free)
        try:
            return self.constant(tuple(sorted_values(self.value_of(dom))))
        except RUNTIME_ERRORS as error:
            raise EvalError(f"{line_of(node)}: {error}") from None

    # -- the operators' properties, through the operators they call ---------------------------

    def _scan(self, node, visit: Callable, memo: dict) -> bool:
        """Whether visit(n) holds for a node n of the tree, entering the bodies of the
        operators it calls (each once: memo holds their answers)."""
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            if visit(node):
                return True
            name = getattr(node, "operator", None)
            if type(node).__name__ == "OperatorApplication" and name in self.ops:
                if name not in memo:
                    memo[name] = False  # while scanning: a recursive use adds nothing
                    memo[name] = self._scan(self.ops[name].body, visit, memo)
                if memo[name]:
                    return True
            return any(self._scan(getattr(node, f), visit, memo) for f in node._fields
                       if f not in ("symbol", "start", "end"))
        if isinstance(node, list):
            return any(self._scan(x, visit, memo) for x in node)
        return False

    def has_primes(self, node) -> bool:
        return self._scan(node, lambda n: type(n).__name__ == "OperatorApplication"
                          and n.operator in ("'", "UNCHANGED"), self._primes)

    def mentions_variables(self, node) -> bool:
        return self._scan(node, lambda n: type(n).__name__ == "OperatorApplication"
                          and n.arguments is None and n.operator in self.variables, {})

    def loops(self, node) -> bool:
        """Whether evaluating node enumerates a set (then memoizing it pays)."""
        return self._scan(node, lambda n: type(n).__name__ in LOOPING or (
            type(n).__name__ == "OperatorApplication" and n.operator == "SUBSET"), {})

    def reads_unassigned(self, node, primed: dict) -> bool:
        """In Init: whether node mentions a variable that is not assigned yet."""
        unassigned = set(self.variables) - set(primed)
        return self._scan(node, lambda n: type(n).__name__ == "OperatorApplication"
                          and n.arguments is None and n.operator in unassigned, {})

    # -- generated functions ------------------------------------------------------------

    def define(self, em: Emitter, name: str) -> Callable:
        filename = f"<KVTransfer compiled {self.fresh('f')} {name}>"
        source = "\n".join(em.lines) + "\n"
        try:
            code = compile(source, filename, "exec")
        except (SyntaxError, RecursionError) as error:
            raise EvalError(f"the spec's {name} cannot be compiled to Python ({error})") \
                from None
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        self.origins[filename] = em.origins
        exec(code, self.namespace)
        return self.namespace[name]

    def translate(self, error: BaseException) -> EvalError:
        """A run-time error in generated code as an EvalError at the spec's line."""
        line, tb = 0, error.__traceback__
        while tb is not None:
            origins = self.origins.get(tb.tb_frame.f_code.co_filename)
            if origins is not None:
                line = origins[tb.tb_lineno - 1]
            tb = tb.tb_next
        if isinstance(error, EvalError):
            message = str(error)
        elif isinstance(error, KeyError):
            message = f"{error.args[0]!r} is not in the domain of the function applied there"
        elif isinstance(error, RecursionError):
            message = "recursion is not supported"
        else:
            message = f"a value of the wrong kind ({error})"
        if message.startswith("line ") or not line:
            return EvalError(message)
        return EvalError(f"line {line}: {message}")

    def guarded(self, fn: Callable) -> Callable:
        def run(state, *args):
            try:
                return fn(state, *args)
            except RUNTIME_ERRORS as error:
                raise self.translate(error) from error
        return run

    def value(self, name: str, state: dict | None):
        op = self.ops.get(name)
        if op is None or op.params:
            raise EvalError(f"{name} is not an operator without arguments")
        body = self.expr(op.body, Scope(), None)
        if body.free and state is None:
            raise EvalError(f"{name} depends on the state")
        em = Emitter()
        em.open("def value_(state):", op.line)
        self._unpack(em)
        em.emit(f"return {body.text}")
        fn = self.define(em, "value_")
        args = tuple(state[v] for v in self.variables) if state else (None,) * len(self.variables)
        return self.guarded(fn)(args)

    def state_function(self, name: str) -> Callable:
        """A state-level operator without arguments compiled once: state tuple -> value
        (`value` compiles it again on every call, which a check of every step cannot pay)."""
        op = self.ops.get(name)
        if op is None or op.params:
            raise EvalError(f"{name} is not an operator without arguments")
        body = self.expr(op.body, Scope(), None)
        em = Emitter()
        function = self.fresh("state", name)
        em.open(f"def {function}(state):", op.line)
        self._unpack(em)
        em.emit(f"return {body.text}")
        return self.guarded(self.define(em, function))

    def _unpack(self, em: Emitter) -> None:
        if self.variables:
            em.emit(", ".join(f"v_{v}" for v in self.variables) + ", = state")


__all__ = ["Compiler"]
