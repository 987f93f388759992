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

`core_reads` applies the same rule to spec/core.py's action functions, read from their
source: conformance cannot see which of two always-equal fields the core reads.

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

SPEC_PATH = Path(__file__).resolve().parent.parent / "KVTransfer.tla"
ROUTER, PREFILL, DECODE, WIRE_OWNER, GHOST = "router", "prefill", "decode", "wire", "ghost"

# Variable -> its owner. Per-request variables split a request's row by who knows each part.
OWNERS = {
    "client": ROUTER, "prompt": ROUTER, "pworker": ROUTER, "dworker": ROUTER,
    "pst": PREFILL, "sent": PREFILL, "src": PREFILL, "ptable": PREFILL, "powner": PREFILL,
    "pdata": PREFILL, "writes": PREFILL,
    "dst": DECODE, "table": DECODE, "dfw": DECODE, "announced": DECODE, "landed": DECODE,
    "owner": DECODE, "gen": DECODE, "content": DECODE,
    "boot": WIRE_OWNER, "fwMsg": WIRE_OWNER, "fwCount": WIRE_OWNER, "cancel": WIRE_OWNER,
    "leaked": GHOST,
}
# A message variable -> (sender, receiver).
WIRE = {"boot": (ROUTER, DECODE), "fwMsg": (PREFILL, DECODE), "fwCount": (PREFILL, DECODE),
        "cancel": (DECODE, PREFILL)}
# (worker, variable it does not own) -> how the fact reaches that worker.
GRANTS = {
    (PREFILL, "prompt"): "the queue entry the router hands the prefill carries the prompt",
    (DECODE, "prompt"): "the bootstrap carries the prompt's length",
    (PREFILL, "pworker"): "the queue entry reaches the prefill worker the router chose: a "
                          "worker knows which requests are its own",
    (DECODE, "dworker"): "the bootstrap reaches the decode worker the router chose",
    (PREFILL, "client"): "the serving edge's client-gone notice (PrefillAbort), and its "
                         "first-answer rule: an answer sent to a client who has one is "
                         "dropped by the edge (ClientError)",
    (DECODE, "client"): "the serving edge's client-gone notice (DecodeAbort), and its "
                        "first-answer rule (ClientError)",
}
# Operators (spec) and helpers (core) that state the environment's timing assumption under
# which a timer fires, not a guard its worker evaluates: a timer fires when time has passed,
# and what it may assume about the other side in that time is the synchrony assumption a
# lease rests on. Their reads are the environment's; the rule skips them, and the table says
# so. Every other read of a timer's guard is checked like any worker's.
ASSUMPTIONS = {
    "LeaseLapsed": "decode's lease lapses only after the prefill's silence (a working "
                   "prefill renews it within lease_s): the environment's assumption, decode "
                   "sees only its clock",
}
CORE_ASSUMPTIONS = {"lease_lapsed": "LeaseLapsed"}
# How each owner is described in the table.
MEANING = {
    "writes": "its send queue: writes posted whose completion has not come back",
    "ptable": "decode's page table as received (delivered with Reserve)",
}
CHECKED_KINDS = ("protocol", "timer")


def may_read(worker: str, variable: str) -> bool:
    owner = OWNERS[variable]
    if owner == worker:
        return True
    if owner == WIRE_OWNER:
        return WIRE[variable][1] == worker
    return (worker, variable) in GRANTS


def why_not(worker: str, variable: str) -> str:
    owner = OWNERS[variable]
    if owner == GHOST:
        return f"{variable} is a ghost (history for the properties)"
    if owner == WIRE_OWNER:
        sender, receiver = WIRE[variable]
        return f"{variable} is a message {sender} -> {receiver}, not addressed to the {worker}"
    return f"{variable} is the {owner}'s"


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
        self.assumed: set[str] = set()  # ASSUMPTIONS met by the last access()
        for unit in module.units or []:
            kind = type(unit).__name__
            if kind == "Variables":
                self.variables += [n.operator for n in unit.names]
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


@dataclass(frozen=True)
class Row:
    action: str
    worker: str
    kind: str
    access: Access
    violations: tuple[str, ...]

    @property
    def checked(self) -> bool:
        return self.kind in CHECKED_KINDS and self.worker in (ROUTER, PREFILL, DECODE)


def analyse(text: str | None = None) -> list[Row]:
    """One row per action of spec/core.py's ACTION_TABLE, from the spec's text."""
    walker = _Walker(tla.parse(text if text is not None else SPEC_PATH.read_text()))
    unknown = set(walker.variables) - set(OWNERS)
    assert not unknown, f"variables without an owner in OWNERS: {sorted(unknown)}"
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
            row = Row(name, info.worker, info.kind, access, bad)
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

    lines = ["| action | worker | guard reads | effect also reads | writes | rule |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        rule = ("**breaks it**" if row.violations else "holds") if row.checked else \
            f"not checked ({row.kind if row.worker != 'network' else 'network'})"
        a = row.access
        lines.append(f"| {row.action} | {row.worker} | {names(a.guard_reads)} | "
                     f"{names(a.reads - a.guard_reads)} | {names(a.writes)} | {rule} |")
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
    "PTABLE", "FW_COUNT", "ANNOUNCED", "LANDED", "LEAKED", "PW", "DW")}
assert sorted(ROW_CONSTANTS.values()) == sorted(core.ROW_FIELDS)
VIEW_PARTS = {"decode_pool": ("owner", "gen", "content"), "prefill_pool": ("powner", "pdata"),
              "writes": ("writes",)}


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
