"""The TLA+ view of a core state: the values of KVTransfer.tla's variables.

This is the explicit mapping between the Python representation and the spec. Requests are
the model values of the constant `Requests` (named as in the model), pages are 1-based,
strings are the spec's strings. Traces (ITF JSON), counterexample printing and conformance
checking all go through this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.core import (
    ANNOUNCED, BOOT, CANCEL, CLIENT, CLIENT_NAMES, DECODE_NAMES, DFW, DST, FW, FW_COUNT,
    LANDED, LEAKED, MESSAGE_NAMES, NONE, PREFILL_NAMES, PROMPT, PST, PTABLE, SENT, SRC, TABLE,
    State,
)
from spec.model import Model
from spec.tlaplus.tlavalues import ModelValue

VARIABLES = ("client", "prompt", "pst", "sent", "src", "dst", "table", "boot", "fwMsg", "dfw",
             "cancel", "ptable", "fwCount", "announced", "landed", "leaked", "owner", "gen",
             "content", "powner", "pdata", "writes")


NO_REQ = ModelValue("NoReq")


@dataclass(frozen=True, order=True)
class Record:
    """A TLA+ record, kept hashable so that it can sit in a set."""

    fields: tuple[tuple[str, object], ...]

    def __repr__(self) -> str:
        return "[" + ", ".join(f"{k} |-> {v!r}" for k, v in self.fields) + "]"


def _per_request(field: int, fn) -> tuple:
    """A variable [Requests -> X]: reads one field of every row."""
    def source(s: State) -> tuple:
        return tuple(row[field] for row in s.requests)

    def convert(m: Model, values: tuple) -> dict:
        return {ModelValue(name): fn(v) for name, v in zip(m.request_names, values)}
    return source, convert


def _req(m: Model, x: int) -> ModelValue:
    return ModelValue(m.request_names[x]) if x != NONE else NO_REQ


def _page_table(entries: tuple) -> tuple:
    return tuple(Record((("page", p + 1), ("gen", g))) for p, g in entries)


def _decode_pool(s: State) -> tuple:
    return s.decode_pool


def _prefill_pool(s: State) -> tuple:
    return s.prefill_pool


def _writes(s: State) -> tuple:
    return s.writes


# Per variable: (the part of the core state it reads, how that part maps to the variable's
# value). The part is hashable, so a caller converting many states can cache by it.
MAPPING = {
    "client": _per_request(CLIENT, lambda v: CLIENT_NAMES[v]),
    "prompt": _per_request(PROMPT, lambda v: v),
    "pst": _per_request(PST, lambda v: PREFILL_NAMES[v]),
    "sent": _per_request(SENT, lambda v: v),
    "src": _per_request(SRC, lambda v: tuple(p + 1 for p in v)),
    "dst": _per_request(DST, lambda v: DECODE_NAMES[v]),
    "table": _per_request(TABLE, lambda v: _page_table(v)),
    "boot": _per_request(BOOT, bool),
    "fwMsg": _per_request(FW, lambda v: MESSAGE_NAMES[v]),
    "dfw": _per_request(DFW, bool),
    "cancel": _per_request(CANCEL, bool),
    "ptable": _per_request(PTABLE, lambda v: _page_table(v)),
    "fwCount": _per_request(FW_COUNT, lambda v: v),
    "announced": _per_request(ANNOUNCED, lambda v: v),
    "landed": _per_request(LANDED, lambda v: v),
    "leaked": (lambda s: tuple(row[LEAKED] for row in s.requests),
               lambda m, flags: frozenset(ModelValue(n) for n, f in zip(m.request_names, flags)
                                          if f)),
    "owner": (_decode_pool, lambda m, pool: {p + 1: _req(m, page[0])
                                             for p, page in enumerate(pool)}),
    "gen": (_decode_pool, lambda m, pool: {p + 1: page[1] for p, page in enumerate(pool)}),
    "content": (_decode_pool, lambda m, pool: {p + 1: (_req(m, page[2]), page[3])
                                               for p, page in enumerate(pool)}),
    "powner": (_prefill_pool, lambda m, pool: {p + 1: _req(m, page[0])
                                               for p, page in enumerate(pool)}),
    "pdata": (_prefill_pool, lambda m, pool: {p + 1: _req(m, page[1])
                                              for p, page in enumerate(pool)}),
    "writes": (_writes, lambda m, writes: frozenset(
        Record((("req", _req(m, r)), ("src", src + 1), ("dst", dst + 1), ("gen", g)))
        for r, src, dst, g in writes)),
}
assert tuple(MAPPING) == VARIABLES


def to_tla(m: Model, s: State) -> dict[str, object]:
    return {var: convert(m, source(s)) for var, (source, convert) in MAPPING.items()}


def format_value(v: object) -> str:
    """A value in TLA+ syntax."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (int, ModelValue)):
        return repr(v)
    if isinstance(v, Record):
        return "[" + ", ".join(f"{k} |-> {format_value(x)}" for k, x in v.fields) + "]"
    if isinstance(v, tuple):
        return "<<" + ", ".join(format_value(x) for x in v) + ">>"
    if isinstance(v, frozenset):
        return "{" + ", ".join(sorted(format_value(x) for x in v)) + "}"
    if isinstance(v, dict):
        return "(" + " @@ ".join(f"{format_value(k)} :> {format_value(x)}"
                                 for k, x in v.items()) + ")"
    raise TypeError(f"no TLA+ form for {v!r}")


def changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """Readable lines for what changed, per variable and per function argument."""
    lines = []
    for var in VARIABLES:
        old, new = before[var], after[var]
        if old == new:
            continue
        if isinstance(old, dict):
            for key in new:
                if old[key] != new[key]:
                    lines.append(f"{var}[{format_value(key)}]: {format_value(old[key])} -> "
                                 f"{format_value(new[key])}")
        else:
            lines.append(f"{var}: {format_value(old)} -> {format_value(new)}")
    return lines
