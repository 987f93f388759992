"""Locality: every action reads only what its worker can know, checked from the spec's text.

A guard that reads another worker's state cannot be implemented: a real decode cannot see
which writes are on the network, and a real prefill knows decode's page table only from the
message that carried it. The spec can say such things without noticing, because every
variable is global in TLA+. So each variable of KVTransfer.tla has an owner here (`OWNERS`):

- a worker (router, prefill, decode): its own memory, read and written by its actions;
- the wire (`WIRE`): a message in flight from one party to another, which only the receiver
  reads (the sender puts it on the wire, the receiver takes it off);
- ghost: history that exists only for the properties (`leaked`); no action may read it to
  decide anything, though Finish records it.

Some facts reach a worker by a message the spec does not model as a variable of its own;
each is a `GRANTS` entry with its reason (the prompt length travels with the queue entry and
the bootstrap; the client-gone notice and the serving edge's first-answer rule travel with
`client`). Everything else a worker's action reads must be its own or addressed to it.

`access` walks the parse tree of an action (the `tla` package), expanding the operators it
uses, and collects the variables it reads and writes. A primed variable is written; `x' = e`
reads what e reads, except that a bare `x` in e (the `[x EXCEPT ...]` base, `THEN x`) is the
unchanged rest of x, not a read; the right side of a ghost's assignment is not read by the
worker (it is history, computed by the model). UNCHANGED reads nothing. Reads in conjuncts
that write nothing are the guard's; the rest feed the effect; the rule applies to both.

Per worker. With worker sets (the constants PrefillWorkers and DecodeWorkers) the owner
rule is not enough: powner is the prefill's, but prefill worker q may read only its own
slice of it. Every checked action is parameterised by its request r (its first parameter),
and names its worker by the request's placement: pworker[r] for a prefill action,
dworker[r] for a decode action (a worker knows its own requests: the queue entry or the
bootstrap reached it). That name is stable because only the router writes pworker and
dworker (Arrive), which the rule also checks. `_Indices` walks the action again, operator
arguments substituted for their parameters (FreePrefill(pworker[r]) indexes powner by
pworker[r]), and renders every subscript as text. The rule, for reads and writes alike:
- a per-worker pool variable of the action's own role (`WORKER_INDEXED`: powner, pdata;
  owner, gen, content) is indexed only by the action's own worker, pworker[r] or
  dworker[r]; reading one whole (`[x EXCEPT ...]` as a value other than x's own update,
  or x passed bare) is reading every worker's pool;
- a per-request variable is indexed only by r: a worker's knowledge of the request is that
  request's row (a decode worker's tombstones are dst[r] = "Tomb" of its own requests; the
  spec has no epoch variable, a decode restart's epoch is those tombstones). Another
  request's row may be another worker's; no checked action needs one today, and one that
  did would widen this rule with a reason, as GRANTS does for roles;
- the send queue `writes` (one set of records; a write is its request's prefill worker's)
  is read only through a filter that confines it to the action's own request or worker: a
  bound `w \\in writes` with a conjunct `w.req = r` or `pworker[w.req] = pworker[r]`; then
  w.req may index per-request variables (it is r, or a request on the same worker).
Assumptions (LeaseLapsed) are skipped here as above; the ghost's right side is not read.
An older text without worker sets (tests/data) gets the owner rule only.

`core_reads` applies the owner rule to spec/core.py's action functions, read from their
source: conformance cannot see which of two always-equal fields the core reads. The core's
pools are flat tuples, worker w's pages the range `pages_of(w, pages)`, so its per-worker
rule cannot be read off a subscript: `core_pool_violations` runs every checked action on
every reachable state of a worker model with pools that record each index read, and
demands that every page read or changed lies in the request's own worker's range (the
send queue, a flat tuple filtered by request, is not checked there: every action that
reads it keeps only its own request's writes, `w[0] == r`, which the static check of the
spec states for the spec's text).

Who takes each action comes from spec/core.py's ACTION_TABLE. The rule is checked for the
protocol's own actions and timers taken by a worker; not for arrivals and faults (the
environment: a crash reads and clears whatever it destroys) nor for the network (LandWrite is
the physics of a write, which reads the source page and lands in decode's memory).

    python -m spec.tlaplus.locality            # the tables, and exit 1 if an action breaks it
    python -m spec.tlaplus.locality --write    # and write them into spec/README.md
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import tla

from spec import core
from spec.roles import (ASSUMPTIONS, CORE_ASSUMPTIONS, DECODE, GHOST, GRANTS, OWNERS,  # noqa: F401
                        PREFILL, ROUTER, VIEW_PARTS, WIRE, WIRE_OWNER, may_read, why_not)

SPEC_PATH = Path(__file__).resolve().parent.parent / "KVTransfer.tla"
# How each owner is described in the table.
MEANING = {
    "writes": "its send queue: writes posted whose completion has not come back",
    "ptable": "decode's page table as received (delivered with Reserve)",
}
# A cache's policy (Evict) is its worker's own decision too: checked like the protocol's.
CHECKED_KINDS = ("protocol", "timer", "policy")


@dataclass
class Access:
    guard_reads: set = field(default_factory=set)
    reads: set = field(default_factory=set)     # guard and effect
    writes: set = field(default_factory=set)


class _Walker:
    """Reads and writes of an expression, operators expanded (each once per path)."""

    def __init__(self, module) -> None:
        self.defs = {}
        self.variables: list[str] = []
        self.constants: list[str] = []
        self.assumed: set[str] = set()  # ASSUMPTIONS met by the last access()
        for unit in module.units or []:
            kind = type(unit).__name__
            if kind == "Variables":
                self.variables += [n.operator for n in unit.names]
            elif kind == "Constants":
                self.constants += [n.operator for n in unit.names]
            elif kind == "OperatorDefinition":
                self.defs[unit.name] = unit

    def access(self, name: str) -> Access:
        body = self.defs[name].definiens
        self.assumed = set()
        out = Access()
        items = ([i.expression for i in body.arguments]
                 if type(body).__name__ == "VerticalList" and body.operator == "/\\" else [body])
        for item in items:
            reads, writes = set(), set()
            self.visit(item, reads, writes, None, (name,))
            out.reads |= reads
            out.writes |= writes
            if not writes and not self._keeps(item, (name,)):
                out.guard_reads |= reads
        return out

    def _keeps(self, node, stack) -> bool:
        """Whether the conjunct says UNCHANGED anywhere (then it is an effect)."""
        found = []
        self.visit(node, set(), set(), None, stack, unchanged=found)
        return bool(found)

    def visit(self, node, reads, writes, keep, stack, unchanged=None) -> None:
        if node is None or isinstance(node, (str, int, bool)):
            return
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            for item in node:
                self.visit(item, reads, writes, keep, stack, unchanged)
            return
        kind = type(node).__name__
        go = lambda n, k=keep: self.visit(n, reads, writes, k, stack, unchanged)  # noqa: E731
        if kind == "OperatorApplication":
            op, args = node.operator, [a for a in (node.arguments or [])
                                         if not isinstance(a, str)]
            if op == "UNCHANGED":
                if unchanged is not None:
                    unchanged.append(node)
                return
            if op == "'":
                writes.add(args[0].operator)
                return
            if op == "=" and type(args[0]).__name__ == "OperatorApplication" \
                    and args[0].operator == "'":
                target = args[0].arguments[0].operator
                writes.add(target)
                if OWNERS.get(target) != GHOST:
                    go(args[1], target)
                return
            if op in self.variables and not args:
                if op != keep:
                    reads.add(op)
                return
            go(args)
            if op in ASSUMPTIONS:
                self.assumed.add(op)
                return  # the environment's timing assumption: not the worker's read
            if op in self.defs and op not in stack:
                self.visit(self.defs[op].definiens, reads, writes, keep, stack + (op,),
                           unchanged)
            return
        if kind == "FunctionApplication":
            fn = node.function
            if type(fn).__name__ == "OperatorApplication" and fn.operator in self.variables:
                reads.add(fn.operator)  # x[i] reads x, even on the right of x' = ...
            else:
                go(fn)
            go(node.arguments)
            return
        if kind == "Except":
            fn = node.function
            if not (type(fn).__name__ == "OperatorApplication" and fn.operator == keep):
                go(fn)
            for change in node.changes:
                go([step for step in change.item if isinstance(step, list)])
                go(change.expression)
            return
        if kind == "Let":
            for definition in node.definitions:
                go(getattr(definition, "definiens", definition))
            go(node.expression)
            return
        for name in getattr(node, "_fields", ()):
            if name not in ("symbol", "start", "end"):
                go(getattr(node, name))


# -- per worker: which worker's pool, which request's row -------------------------------
# With worker sets the owner rule above is not enough: a prefill action reading powner is
# reading its own role's variable, whichever worker's slice it reads. So the variables are
# also sorted by what indexes them, and every subscript a checked action uses is checked.
WORKER_INDEXED = {"powner": PREFILL, "pdata": PREFILL, "preaders": PREFILL, "pident": PREFILL,
                  "owner": DECODE, "gen": DECODE, "content": DECODE, "readers": DECODE,
                  "ident": DECODE, "kv": DECODE}
SEND_QUEUE = "writes"   # the prefill's, one set of records: a write is its request's worker's
UNINDEXED = {"leaked"}  # the ghost, a set
PLACEMENT = {PREFILL: "pworker", DECODE: "dworker"}  # how a request names its worker
WORKER_CONSTANTS = ("PrefillWorkers", "DecodeWorkers")


@dataclass(frozen=True)
class Use:
    variable: str
    subscript: str | None  # None: the whole variable
    written: bool


class _Indices:
    """The subscripts an action indexes variables by, operator arguments substituted.

    A subscript is rendered as text: a name (an action parameter, or `<x>` for a variable
    bound inside the action), `f[e]` and `e.field`; anything else as its source text. A
    bound write `w \\in writes` whose filter confines it to the action's own request or
    worker (a conjunct `w.req = r` or `pworker[w.req] = pworker[r]`, or `pworker[w.req] = q`
    in an action of worker q as a whole) renders as `<own w>`.
    """

    def __init__(self, walker: "_Walker", text: str) -> None:
        self.defs, self.variables = walker.defs, set(walker.variables)
        self.lines = text.splitlines()

    def uses(self, name: str) -> tuple[str, list[Use]]:
        definition = self.defs[name]
        params = [a.operator for a in definition.arity or []]
        assert params, f"{name} takes no request: the rule names a worker by its request"
        self.request = params[0]
        out: list[Use] = []
        self.visit(definition.definiens, {p: p for p in params}, (name,), None, out)
        return self.request, out

    def source(self, node) -> str:
        start, end = node.start, node.end
        if start.line != end.line:
            return "<expr>"
        return self.lines[start.line][start.column:end.column]

    def render(self, node, env) -> str:
        kind = type(node).__name__
        if kind == "OperatorApplication" and not node.arguments:
            return env.get(node.operator, node.operator)
        if kind == "FunctionApplication" and type(node.function).__name__ == \
                "OperatorApplication" and not node.function.arguments:
            inside = ",".join(self.render(a, env) for a in node.arguments)
            return f"{self.render(node.function, env)}[{inside}]"
        if kind == "Field":
            return f"{self.render(node.expression, env)}.{node.name}"
        return self.source(node)

    def confines(self, predicate, bound: str, env) -> bool:
        """Whether a conjunct of the filter ties the bound write to the action's own request
        or its own prefill worker."""
        conjuncts, todo = [], [predicate]
        while todo:
            node = todo.pop()
            kind = type(node).__name__
            if kind == "VerticalList" and node.operator == "/\\":
                todo += [item.expression for item in node.arguments]
            elif kind == "OperatorApplication" and node.operator == "/\\":
                todo += node.arguments
            else:
                conjuncts.append(node)
        inner = {**env, bound: f"<{bound}>"}
        # A worker's own action (PrefillEvict(q, p)) names its worker by its parameter.
        own = ({f"<{bound}>.req", self.request},
               {f"pworker[<{bound}>.req]", f"pworker[{self.request}]"},
               {f"pworker[<{bound}>.req]", self.request})
        for node in conjuncts:
            if type(node).__name__ == "OperatorApplication" and node.operator == "=":
                sides = {self.render(a, inner) for a in node.arguments}
                if sides in own:
                    return True
        return False

    def visit(self, node, env, stack, keep, out) -> None:
        if node is None or isinstance(node, (str, int, bool)):
            return
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            for item in node:
                self.visit(item, env, stack, keep, out)
            return
        kind = type(node).__name__
        go = lambda n, e=env, k=keep: self.visit(n, e, stack, k, out)  # noqa: E731
        if kind == "OperatorApplication":
            op, args = node.operator, [a for a in (node.arguments or [])
                                         if not isinstance(a, str)]
            if op in ("UNCHANGED", "'"):
                return
            if op == "=" and type(args[0]).__name__ == "OperatorApplication" \
                    and args[0].operator == "'":
                target = args[0].arguments[0].operator
                if OWNERS.get(target) != GHOST:
                    go(args[1], env, target)
                return
            if op in self.variables and not args:
                if op != keep:
                    out.append(Use(op, None, False))
                return
            go(args)
            if op in ASSUMPTIONS:
                return
            if op in self.defs and op not in stack:
                definition = self.defs[op]
                inner = {a.operator: self.render(v, env)
                         for a, v in zip(definition.arity or [], args)}
                self.visit(definition.definiens, inner, stack + (op,), keep, out)
            return
        if kind == "FunctionApplication":
            fn = node.function
            if type(fn).__name__ == "OperatorApplication" and fn.operator in self.variables:
                out.append(Use(fn.operator, self.render(node.arguments[0], env), False))
            else:
                go(fn)
            go(node.arguments)
            return
        if kind == "Except":
            fn = node.function
            if type(fn).__name__ == "OperatorApplication" and fn.operator in self.variables:
                for change in node.changes:
                    out.append(Use(fn.operator, self.render(change.item[0][0], env),
                                   fn.operator == keep))
                if fn.operator != keep:
                    out.append(Use(fn.operator, None, False))  # the rest of it, as a value
            else:
                go(fn)
            for change in node.changes:
                go([step for step in change.item if isinstance(step, list)])
                go(change.expression)
            return
        if kind in ("Quantification", "SetSlice", "SetComprehension", "Function"):
            declarations = getattr(node, "declarations", None) or node.declaration
            if not isinstance(declarations, list):
                declarations = [declarations]
            inner = dict(env)
            predicate = getattr(node, "predicate", None)
            for declaration in declarations:
                bound, domain = declaration.arguments[0], declaration.arguments[1]
                name = bound.operator
                if type(domain).__name__ == "OperatorApplication" and \
                        domain.operator == SEND_QUEUE and predicate is not None and \
                        self.confines(predicate, name, env):
                    inner[name] = f"<own {name}>"
                else:
                    go(domain)
                    inner[name] = f"<{name}>"
            for part in ("predicate", "item", "value"):
                self.visit(getattr(node, part, None), inner, stack, keep, out)
            return
        if kind == "Let":
            for definition in node.definitions:
                go(getattr(definition, "definiens", definition))
            go(node.expression)
            return
        for name in getattr(node, "_fields", ()):
            if name not in ("symbol", "start", "end"):
                go(getattr(node, name))


def index_violations(name: str, worker: str, request: str, uses: list[Use],
                     by_worker: bool = False) -> list[str]:
    """The per-worker rule for one checked action (see the module's docstring). An action of
    a worker as a whole (`by_worker`: Evict(d, p)) names its worker by its first parameter,
    and has no request's row to read."""
    out = []
    for use in uses:
        var, sub = use.variable, use.subscript
        verb = "writes" if use.written else "reads"
        if var in PLACEMENT.values() and use.written:
            out.append(f"{name} ({worker}) writes {var}: a request's worker is the router's "
                       "choice, fixed at Arrive, and the rule names the worker by it")
        elif var in WORKER_INDEXED:
            if WORKER_INDEXED[var] != worker:
                continue  # another role's: the owner rule's to flag
            own = request if by_worker else f"{PLACEMENT[worker]}[{request}]"
            if sub is None:
                out.append(f"{name} ({worker}) reads {var} whole: every {worker} worker's "
                           f"pool, not only its own {var}[{own}]")
            elif sub != own:
                out.append(f"{name} ({worker}) {verb} {var}[{sub}]: not its own {worker} "
                           f"worker's pool {var}[{own}]")
        elif var == SEND_QUEUE:
            if worker == PREFILL and sub is None:
                out.append(f"{name} ({worker}) reads {var} unfiltered: every prefill worker's "
                           f"send queue, not only its own (filter by w.req = {request} or "
                           f"pworker[w.req] = pworker[{request}])")
        elif var not in UNINDEXED and (use.written or may_read(worker, var)):
            if sub is None:
                out.append(f"{name} ({worker}) reads {var} whole: every request's row, not "
                           f"only its own {var}[{request}]")
            elif sub != request and not (sub.startswith("<own ") and sub.endswith(">.req")):
                out.append(f"{name} ({worker}) {verb} {var}[{sub}]: another request's row, "
                           f"not its own {var}[{request}]")
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Row:
    action: str
    worker: str
    kind: str
    access: Access
    violations: tuple[str, ...]
    pools_at: tuple[str, ...] = ()  # the subscripts its own role's pools are indexed by

    @property
    def checked(self) -> bool:
        return self.kind in CHECKED_KINDS and self.worker in (ROUTER, PREFILL, DECODE)


def analyse(text: str | None = None) -> list[Row]:
    """One row per action of spec/core.py's ACTION_TABLE, from the spec's text."""
    text = text if text is not None else SPEC_PATH.read_text()
    walker = _Walker(tla.parse(text))
    unknown = set(walker.variables) - set(OWNERS)
    assert not unknown, f"variables without an owner in OWNERS: {sorted(unknown)}"
    # The per-worker rule applies to a text with worker sets (older texts, in tests/data,
    # have one pool per role, indexed by page).
    indices = _Indices(walker, text) if set(WORKER_CONSTANTS) <= set(walker.constants) \
        else None
    rows = []
    for info in core.ACTION_TABLE:
        name = info.event.__name__
        if text is not None and name not in walker.defs:
            continue  # an older text of the spec, from before this action (tests/data)
        access = walker.access(name)
        row = Row(name, info.worker, info.kind, access, ())
        if row.checked:
            bad = tuple(f"{name} ({info.worker}) reads {v}: {why_not(info.worker, v)}"
                        for v in sorted(access.reads) if not may_read(info.worker, v))
            bad += tuple(f"{name} ({info.worker}) uses the timing assumption {a}, which only "
                         "a timer may rest on" for a in sorted(walker.assumed)
                         if info.kind != "timer")
            pools_at: tuple[str, ...] = ()
            if indices is not None:
                request, uses = indices.uses(name)
                bad += tuple(index_violations(name, info.worker, request, uses,
                                              issubclass(info.event, core.WorkerEvent)))
                pools_at = tuple(sorted({u.subscript or "(whole)" for u in uses
                                         if WORKER_INDEXED.get(u.variable) == info.worker}))
            row = Row(name, info.worker, info.kind, access, bad, pools_at)
        rows.append(row)
    return rows


def violations(text: str | None = None) -> list[str]:
    return [v for row in analyse(text) for v in row.violations]


def owners_table() -> str:
    lines = ["| variable | owner | read by |", "|---|---|---|"]
    for var, owner in OWNERS.items():
        readers = [w for w in (ROUTER, PREFILL, DECODE) if w != owner and may_read(w, var)]
        shown = f"wire, {WIRE[var][0]} -> {WIRE[var][1]}" if owner == WIRE_OWNER else owner
        if var in MEANING:
            shown += f" ({MEANING[var]})"
        extra = ", ".join(f"{w} (granted)" for w in readers if (w, var) in GRANTS)
        lines.append(f"| `{var}` | {shown} | {extra or '-'} |")
    return "\n".join(lines)


def actions_table(rows: list[Row]) -> str:
    def names(vs: set) -> str:
        return ", ".join(f"`{v}`" for v in sorted(vs)) or "-"

    lines = ["| action | worker | guard reads | effect also reads | writes | its pool at | rule |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        rule = ("**breaks it**" if row.violations else "holds") if row.checked else \
            f"not checked ({row.kind if row.worker != 'network' else 'network'})"
        a = row.access
        pools = ", ".join(f"`{p}`" for p in row.pools_at) or "-"
        lines.append(f"| {row.action} | {row.worker} | {names(a.guard_reads)} | "
                     f"{names(a.reads - a.guard_reads)} | {names(a.writes)} | {pools} | "
                     f"{rule} |")
    return "\n".join(lines)


# -- the same rule on the core's source ---------------------------------------------------
# The spec and the core have the same state graph (conformance), but that cannot tell a core
# that reads decode's TABLE from one that reads the prefill's PTABLE: the two are equal in
# every reachable state. So the core's actions are read too, from their source (Python's
# ast): a row field read is a subscript by the field's constant (row[PTABLE]), a pool read is
# the view's attribute (s.decode_pool), and the core's own helpers are followed.

CORE_PATH = SPEC_PATH.parent / "core.py"
ROW_CONSTANTS = {name: core.ROW_FIELDS[getattr(core, name)] for name in (
    "CLIENT", "PROMPT", "PST", "SENT", "SRC", "DST", "TABLE", "BOOT", "FW", "DFW", "CANCEL",
    "PTABLE", "FW_COUNT", "ANNOUNCED", "LANDED", "LEAKED", "PW", "DW", "TOKENS", "SALT", "HIT",
    "PHIT", "PCACHED")}
assert sorted(ROW_CONSTANTS.values()) == sorted(core.ROW_FIELDS)


def core_reads(source: str | None = None) -> dict[str, set]:
    """Action name -> the spec variables its core function reads (helpers followed)."""
    import ast

    tree = ast.parse(source if source is not None else CORE_PATH.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def reads(name: str, seen: tuple) -> set:
        out: set = set()
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name) \
                    and node.slice.id in ROW_CONSTANTS:
                out.add(ROW_CONSTANTS[node.slice.id])
            elif isinstance(node, ast.Attribute) and node.attr in VIEW_PARTS:
                out.update(VIEW_PARTS[node.attr])
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in functions and node.func.id not in seen \
                    and node.func.id not in CORE_ASSUMPTIONS:
                out |= reads(node.func.id, seen + (node.func.id,))
        return out

    return {info.event.__name__: reads(core.ACTIONS[info.event].__name__,
                                       (core.ACTIONS[info.event].__name__,))
            for info in core.ACTION_TABLE}


def core_violations(source: str | None = None) -> list[str]:
    found = core_reads(source)
    out = []
    for info in core.ACTION_TABLE:
        if info.kind not in CHECKED_KINDS or info.worker not in (ROUTER, PREFILL, DECODE):
            continue
        name = info.event.__name__
        out += [f"{name} ({info.worker}) reads {v}: {why_not(info.worker, v)}"
                for v in sorted(found[name]) if not may_read(info.worker, v)]
    return out


class _RecordingPool(tuple):
    """A pool that notes the index of every page read from it."""

    def __new__(cls, pages: tuple, seen: set):
        pool = super().__new__(cls, pages)
        pool.seen = seen
        return pool

    def __getitem__(self, index):
        if isinstance(index, slice):
            self.seen.update(range(len(self))[index])
        else:
            self.seen.add(index % len(self))
        return super().__getitem__(index)

    def __iter__(self):
        self.seen.update(range(len(self)))
        return super().__iter__()


def core_pool_violations(m, states) -> list[str]:
    """The per-worker rule on the core, run rather than read: each checked action enabled
    in each of `states`, taken on pools that record what it reads; every page it reads or
    changes, and every write it posts, must lie in its request's own workers' ranges, and
    it may change no other request's row. One line per action and kind of breach."""
    out: dict[str, None] = {}
    for s in states:
        for event, _ in core.successors(m, s):
            info = core.INFO[type(event)]
            if info.kind not in CHECKED_KINDS or info.worker not in (PREFILL, DECODE):
                continue
            if isinstance(event, core.WorkerEvent):  # an eviction: its own worker's pages only
                seen = set()
                if info.worker == DECODE:
                    view = core.State(s.requests, _RecordingPool(s.decode_pool, seen),
                                      s.prefill_pool, s.writes)
                else:
                    view = core.State(s.requests, s.decode_pool,
                                      _RecordingPool(s.prefill_pool, seen), s.writes)
                change = core.ACTIONS[type(event)](m, view, event.worker, event.page)
                pages = m.decode_pages if info.worker == DECODE else m.prefill_pages
                own = set(s.pages_of(event.worker, pages))
                touched = change.decode if info.worker == DECODE else change.prefill
                other = change.prefill if info.worker == DECODE else change.decode
                if not (seen | {p for p, _ in touched}) <= own or change.rows or other:
                    out[f"{event.action} ({info.worker}) reads or changes what is not its "
                        "worker's pool"] = None
                continue
            r, name = event.request, event.action
            seen = {PREFILL: set(), DECODE: set()}
            view = core.State(s.requests, _RecordingPool(s.decode_pool, seen[DECODE]),
                              _RecordingPool(s.prefill_pool, seen[PREFILL]), s.writes)
            args = (getattr(event, info.argument),) if info.argument else ()
            change = core.ACTIONS[type(event)](m, view, r, *args)
            assert type(change) is not str, (event, change)
            row = s.requests[r]
            own = {PREFILL: core.prefill_pages_of(m, s, row),
                   DECODE: core.decode_pages_of(m, s, row)}
            for kind, pages in ((PREFILL, seen[PREFILL] | {p for p, _ in change.prefill}),
                                (DECODE, seen[DECODE] | {p for p, _ in change.decode})):
                if kind == info.worker and not pages <= set(own[kind]):
                    out[f"{name} ({info.worker}) reads or changes pages of another "
                        f"{kind} worker"] = None
                elif kind != info.worker and pages:
                    out[f"{name} ({info.worker}) reads or changes {kind} pages"] = None
            for _, src, dst, _ in change.posted:
                if src not in own[PREFILL] or dst not in own[DECODE]:
                    out[f"{name} ({info.worker}) posts a write outside its request's "
                        "workers' pools"] = None
            if any(q != r for q, _ in change.rows):
                out[f"{name} ({info.worker}) changes another request's row"] = None
    return list(out)


README = SPEC_PATH.parent / "README.md"
BEGIN, END = "<!-- locality:begin -->", "<!-- locality:end -->"


def assumptions_table() -> str:
    lines = ["| assumption (not read by the worker) | why |", "|---|---|"]
    lines += [f"| `{name}` | {why} |" for name, why in ASSUMPTIONS.items()]
    return "\n".join(lines)


def render(text: str | None = None) -> str:
    return (owners_table() + "\n\n" + actions_table(analyse(text)) + "\n\n"
            + assumptions_table())


def readme_section() -> str:
    readme = README.read_text()
    return readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)].strip()


def main(argv: list[str] | None = None) -> int:
    """The tables (of the spec, or of the .tla file named), `--write` into spec/README.md;
    exit 1 when an action reads what its worker cannot know."""
    args = sys.argv[1:] if argv is None else argv
    write = "--write" in args
    paths = [a for a in args if a != "--write"]
    text = Path(paths[0]).read_text() if paths else None
    table = render(text)
    print(table)
    if write:
        readme = README.read_text()
        start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
        README.write_text(readme[:start] + "\n" + table + "\n" + readme[end:])
    bad = violations(text)
    for v in bad:
        print(v)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
