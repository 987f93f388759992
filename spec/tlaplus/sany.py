"""What SANY, the TLA+ front end that TLC runs first, would refuse, found without Java.

TLC stops before checking anything when SANY's semantic analysis fails, and no TLC jar is
reachable here, so the mistakes SANY refuses are caught from the `tla` parse tree instead:

- a definition, CONSTANT or VARIABLE whose name an EXTENDed standard module already
  defines ("Operator X already defined or declared": KVTransfer.tla once defined SortSeq,
  which the module TLC defines with two arguments, and SANY refused the whole spec);
- a name defined or declared twice, also a bound name or parameter that reuses a name in
  scope (TLA+ allows no shadowing);
- an operator applied to the wrong number of arguments, user-defined or standard;
- an identifier that names nothing in scope ("Unknown operator"), including a module-level
  definition used before the line that defines it (TLA+ reads top to bottom; only
  RECURSIVE declarations and function definitions f[x] == ... may refer to themselves).

Only the standard modules are known (their exported operators below, facts from the public
TLA+ sources); a module EXTENDed from a sibling .tla file is read the same way. LOCAL
INSTANCE imports of a standard module are not exported, so EXTENDS TLC alone does not make
`..` or Len available: SANY refuses that too. Not checked: levels (a prime inside ENABLED's
argument is fine, a primed constant is not), INSTANCE substitutions, proofs.

    python -m spec.tlaplus.sany spec/KVTransfer.tla     # errors and exit 1, or "no errors"
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import tla

# Operators of TLA+ itself: always in scope, their syntax fixes their arity.
BUILTINS = frozenset({
    "=", "#", "/=", "/\\", "\\/", "\\land", "\\lor", "~", "\\lnot", "\\neg", "=>", "<=>",
    "\\equiv", "\\in", "\\notin", "\\cup", "\\union", "\\cap", "\\intersect", "\\",
    "\\subseteq", "SUBSET", "UNION", "DOMAIN", "'", "UNCHANGED", "ENABLED", "[]", "<>", "~>",
    "-+->", "\\cdot", "TRUE", "FALSE", "BOOLEAN", "STRING", "\\X", "\\times",
})

# Spellings of one operator: SANY treats them as the same name.
SYNONYMS = {"<=": "\\leq", "=<": "\\leq", ">=": "\\geq", "\\circ": "\\o", "\\oplus": "(+)",
            "\\ominus": "(-)"}


@dataclass(frozen=True)
class Op:
    """An operator's arity and, for each parameter, the arity of the operator it takes
    (0: an ordinary value)."""

    arity: int
    param_arities: tuple[int, ...] = ()

    def takes_operator(self, i: int) -> int:
        return self.param_arities[i] if i < len(self.param_arities) else 0


def _ops(**arities: int) -> dict[str, Op]:
    return {name: Op(n) for name, n in arities.items()}


NATURALS = {"Nat": Op(0), **{o: Op(2) for o in (
    "+", "-", "*", "^", "<", ">", "\\leq", "\\geq", "%", "\\div", "..")}}
# name -> (modules it EXTENDS, what it defines). Integers adds unary minus, which SANY
# calls -. and the parser shows as - with one argument: MINUS_ARITIES covers both.
STANDARD_MODULES: dict[str, tuple[tuple[str, ...], dict[str, Op]]] = {
    "Naturals": ((), NATURALS),
    "Integers": (("Naturals",), {"Int": Op(0), "-.": Op(1)}),
    "Reals": (("Integers",), {"Real": Op(0), "Infinity": Op(0), "/": Op(2)}),
    # Sequences, FiniteSets, TLC and Bags import with LOCAL INSTANCE: nothing of it exported.
    "Sequences": ((), {**_ops(Seq=1, Len=1, Append=2, Head=1, Tail=1, SubSeq=3),
                       "\\o": Op(2), "SelectSeq": Op(2, (0, 1))}),
    "FiniteSets": ((), _ops(IsFiniteSet=1, Cardinality=1)),
    "TLC": ((), {**_ops(Print=2, PrintT=1, Assert=2, JavaTime=0, TLCGet=1, TLCSet=2,
                        Permutations=1, RandomElement=1, Any=0, ToString=1, TLCEval=1),
                 ":>": Op(2), "@@": Op(2), "SortSeq": Op(2, (0, 2))}),
    "Bags": ((), {**_ops(IsABag=1, BagToSet=1, SetToBag=1, BagIn=2, EmptyBag=0,
                         BagUnion=1, SubBag=1, BagCardinality=1, CopiesIn=2),
                  "(+)": Op(2), "(-)": Op(2), "\\sqsubseteq": Op(2),
                  "BagOfAll": Op(2, (1, 0))}),
}


@dataclass(frozen=True)
class SanyError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class Symbol:
    name: str
    op: Op
    where: str  # "line N" or "the standard module M"


def standard_exports(module: str) -> dict[str, Op]:
    extends, defines = STANDARD_MODULES[module]
    exported: dict[str, Op] = {}
    for parent in extends:
        exported.update(standard_exports(parent))
    exported.update(defines)
    return exported


def line_of(node, default: int = 0) -> int:
    start = getattr(node, "start", None)  # the parser counts lines from 0
    return start.line + 1 if start is not None else default


def canonical(name: str) -> str:
    return SYNONYMS.get(name, name)


def _declared(node) -> tuple[str, Op]:
    """A CONSTANT, RECURSIVE or parameter declaration: F, F(_, _) or _ ** _."""
    args = node.arguments or []
    params = tuple(len(a.arguments or []) if hasattr(a, "arguments") else 0 for a in args)
    return canonical(node.operator), Op(len(args), params if any(params) else ())


@dataclass
class Scope:
    """Names bound inside a definition (parameters, quantified names, LET definitions),
    innermost last."""

    names: dict[str, Op] = field(default_factory=dict)

    def bind(self, more: dict[str, Op]) -> "Scope":
        return Scope({**self.names, **more})


class Checker:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.errors: list[SanyError] = []
        self.symbols: dict[str, Symbol] = {}      # what is defined so far, in order
        self.defined_later: dict[str, int] = {}   # module-level names -> their line

    def error(self, line: int, message: str) -> None:
        self.errors.append(SanyError(line, message))

    # -- the module ------------------------------------------------------------------

    def check_module(self, module) -> list[SanyError]:
        for extendee in module.extendees or []:
            self.extend(extendee.operator, line_of(extendee))
        self.defined_later = self._module_level_names(module.units or [])
        for unit in module.units or []:
            self.check_unit(unit)
        return sorted(self.errors, key=lambda e: e.line)

    def extend(self, name: str, line: int) -> None:
        if name in STANDARD_MODULES:
            for op_name, op in standard_exports(name).items():
                self.symbols.setdefault(op_name, Symbol(op_name, op,
                                                        f"the standard module {name}"))
            return
        sibling = self.path.parent / f"{name}.tla" if self.path else None
        if sibling is None or not sibling.is_file():
            self.error(line, f"Cannot find source file for module {name}")
            return
        inner = Checker(sibling)
        for e in inner.check_module(tla.parse(sibling.read_text())):
            self.error(line, f"in module {name}: {e}")
        for op_name, symbol in inner.symbols.items():
            self.symbols.setdefault(op_name, symbol)

    def _module_level_names(self, units) -> dict[str, int]:
        names: dict[str, int] = {}
        for unit in units:
            for name, _, line in self._declarations(unit):
                names.setdefault(name, line)
        return names

    def _declarations(self, unit) -> list[tuple[str, Op, int]]:
        """The names a module unit defines or declares, with their arity and line."""
        kind = type(unit).__name__
        if kind in ("Constants", "Variables", "RecursiveOperators"):
            return [(*_declared(n), line_of(n, line_of(unit))) for n in unit.names]
        if kind == "OperatorDefinition":
            params = [_declared(p)[1].arity if hasattr(p, "arguments") else 0
                      for p in (unit.arity or [])]
            op = Op(0 if unit.function else len(params),
                    tuple(params) if any(params) else ())
            return [(canonical(unit.name), op, line_of(unit))]
        return []

    def check_unit(self, unit) -> None:
        kind = type(unit).__name__
        if kind == "OperatorDefinition":
            return self.check_definition(unit)
        if kind == "Axiom":
            return self.expr(unit.expression, Scope(), line_of(unit))
        for name, op, line in self._declarations(unit):
            recursive = kind == "RecursiveOperators"
            self.declare(name, op, line, allow_recursive=recursive)

    def declare(self, name: str, op: Op, line: int, allow_recursive: bool = False) -> bool:
        """Adds a module-level name; False (and an error) when SANY would refuse it."""
        known = self.symbols.get(name)
        if known is not None and known.where.startswith("the standard module"):
            self.error(line, f"Operator {name} already defined or declared "
                             f"(in {known.where}, which this module EXTENDS)")
            return False
        if known is not None and not (allow_recursive or known.where.startswith("RECURSIVE")):
            self.error(line, f"Multiply-defined symbol '{name}': this definition or "
                             f"declaration conflicts with the one at {known.where}")
            return False
        where = f"RECURSIVE line {line}" if allow_recursive else f"line {line}"
        self.symbols[name] = Symbol(name, op, where)
        return True

    def check_definition(self, unit, scope: Scope | None = None) -> dict[str, Op]:
        """Checks one definition: at module level (no scope) it is declared once its body
        is checked, so a body that uses its own name is refused; in a LET the caller binds
        the name returned."""
        ((name, op, line),) = self._declarations(unit)
        outer = scope or Scope()
        inner = outer.bind(self.bind_params(unit.arity or [], outer, line))
        if unit.function:  # f[x \in S] == e: f may be used in e
            inner = inner.bind({name: op})
        if type(unit.definiens).__name__ != "Instance":  # I == INSTANCE M: not read
            self.expr(unit.definiens, inner, line)
        if scope is None:
            self.declare(name, op, line)
        return {name: op}

    def bind_params(self, params, scope: Scope, line: int) -> dict[str, Op]:
        bound = {}
        for p in params:
            if not hasattr(p, "operator"):
                continue
            name, op = _declared(p)
            self.check_fresh(name, scope, line_of(p, line))
            bound[name] = op
        return bound

    def check_fresh(self, name: str, scope: Scope, line: int) -> None:
        """A bound name may not reuse a name already in scope: TLA+ has no shadowing."""
        if name in scope.names or name in self.symbols:
            where = ("an enclosing scope" if name in scope.names
                     else self.symbols[name].where)
            self.error(line, f"Multiply-defined symbol '{name}': this definition or "
                             f"declaration conflicts with the one at {where}")

    # -- expressions -----------------------------------------------------------------

    def expr(self, node, scope: Scope, line: int) -> None:
        if node is None or isinstance(node, (str, int, bool)):
            return
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):  # nodes are
            for item in node:                                                  # namedtuples
                self.expr(item, scope, line)
            return
        line = line_of(node, line)
        rule = getattr(self, f"expr_{type(node).__name__}", None)
        if rule is not None:
            return rule(node, scope, line)
        for name in getattr(node, "_fields", ()):  # anything else: its parts
            if name not in ("symbol", "start", "end"):
                self.expr(getattr(node, name), scope, line)

    def expr_OperatorApplication(self, node, scope: Scope, line: int) -> None:
        name = canonical(node.operator)
        args = [a for a in (node.arguments or []) if not isinstance(a, str)]
        if name in BUILTINS:
            return self.expr(args, scope, line)
        op = self.resolve(name, len(args), scope, line)
        if op is not None and op.arity != len(args):
            self.error(line, f"The operator {name} requires {op.arity} argument"
                             f"{'' if op.arity == 1 else 's'}; it is given {len(args)}")
        for i, arg in enumerate(args):
            wants = op.takes_operator(i) if op is not None else 0
            if wants and self._operator_argument(arg, wants, scope, line):
                continue
            self.expr(arg, scope, line)

    def _operator_argument(self, arg, wants: int, scope: Scope, line: int) -> bool:
        """An operator passed by name to a parameter that takes an operator: F, not F()."""
        if type(arg).__name__ != "OperatorApplication" or arg.arguments:
            return False
        name = canonical(arg.operator)
        if name in BUILTINS:
            return True
        op = self.resolve(name, wants, scope, line)
        if op is not None and op.arity != wants:
            self.error(line, f"The operator {name} takes {op.arity} arguments; "
                             f"an operator of {wants} is expected here")
        return True

    def resolve(self, name: str, nargs: int, scope: Scope, line: int) -> Op | None:
        if name == "-" and nargs == 1:
            name = "-."
        if name in scope.names:
            return scope.names[name]
        if name in self.symbols:
            return self.symbols[name].op
        shown = "-" if name == "-." else name
        later = self.defined_later.get(name)
        if later is not None and later > line:
            self.error(line, f"Unknown operator: `{shown}' (it is defined at line {later}, "
                             "after this use: TLA+ needs a definition before its use)")
        elif name == "-.":
            self.error(line, "Unknown operator: `-' with one argument (unary minus is "
                             "defined in Integers, which this module does not EXTEND)")
        else:
            self.error(line, f"Unknown operator: `{shown}'")
        return None

    def bind_declarations(self, declarations, scope: Scope, line: int) -> Scope:
        """`x \\in S`, `x, y \\in S`, `<<a, b>> \\in S` or bare `x`: each set is checked
        in the scope so far, then its names are bound."""
        if not isinstance(declarations, list):
            declarations = [declarations]
        for decl in declarations:
            kind = type(decl).__name__
            if kind == "OperatorApplication" and decl.operator == "\\in" and decl.arguments:
                target, domain = decl.arguments
                self.expr(domain, scope, line)
                scope = self._bind_names(target, scope, line_of(decl, line))
            else:
                scope = self._bind_names(decl, scope, line_of(decl, line))
        return scope

    def _bind_names(self, target, scope: Scope, line: int) -> Scope:
        names = target.items if type(target).__name__ == "Tuple" else [target]
        for n in names:
            self.check_fresh(n.operator, scope, line)
            scope = scope.bind({n.operator: Op(0)})
        return scope

    def expr_Quantification(self, node, scope, line):
        self.expr(node.predicate, self.bind_declarations(node.declarations, scope, line), line)

    expr_TemporalQuantification = expr_Quantification

    def expr_Choose(self, node, scope, line):
        self.expr(node.predicate, self.bind_declarations(node.declaration, scope, line), line)

    expr_SetSlice = expr_Choose

    def expr_SetComprehension(self, node, scope, line):
        self.expr(node.item, self.bind_declarations(node.declarations, scope, line), line)

    def expr_Function(self, node, scope, line):
        self.expr(node.value, self.bind_declarations(node.declaration, scope, line), line)

    def expr_Lambda(self, node, scope, line):
        self.expr(node.expression, scope.bind(self.bind_params(node.parameters, scope, line)),
                  line)

    def expr_Let(self, node, scope, line):
        for definition in node.definitions:
            if type(definition).__name__ != "OperatorDefinition":
                self.expr(definition, scope, line)
                continue
            name = canonical(definition.name)
            self.check_fresh(name, scope, line_of(definition, line))
            scope = scope.bind(self.check_definition(definition, scope))
        self.expr(node.expression, scope, line)

    def expr_Except(self, node, scope, line):
        self.expr(node.function, scope, line)
        for change in node.changes:
            for step in change.item:
                if isinstance(step, list):  # ![k], not !.field
                    self.expr(step, scope, line)
            self.expr(change.expression, scope, line)  # @ is a string here

    def expr_Record(self, node, scope, line):
        for _, value in node.key_values:
            self.expr(value, scope, line)

    def expr_SetOfRecords(self, node, scope, line):
        for key_bound in node.key_bounds:
            self.expr(key_bound.bound, scope, line)

    def expr_Field(self, node, scope, line):
        self.expr(node.expression, scope, line)


def check_text(text: str, path: Path | None = None) -> list[SanyError]:
    """The errors SANY would report for this module's text, by line."""
    return Checker(path).check_module(tla.parse(text))


def check_file(path: str | Path) -> list[SanyError]:
    path = Path(path)
    return check_text(path.read_text(), path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m spec.tlaplus.sany FILE.tla", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        errors = check_file(path)
    except OSError as error:
        print(f"cannot read {path}: {error}", file=sys.stderr)
        return 2
    for e in errors:
        print(f"{path}:{e.line}: {e.message}")
    if errors:
        print(f"{len(errors)} error{'s' if len(errors) > 1 else ''}: SANY would refuse "
              f"{path.name}, and TLC would stop before checking anything")
        return 1
    print(f"{path}: no errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
