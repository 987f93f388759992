"""The TLA+ view of a core state: the values of KVTransfer.tla's variables.

This is the explicit mapping between the Python representation and the spec. Requests are
the model values of the constant `Requests` (named as in the model), pages are 1-based,
strings are the spec's strings. Traces (ITF JSON), counterexample printing and conformance
checking all go through this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.core import (
    BOOT, CANCEL, CLIENT, CLIENT_NAMES, DECODE_NAMES, DFW, DST, FW, LEAKED, MESSAGE_NAMES,
    NONE, PREFILL_NAMES, PROMPT, PST, SENT, SRC, TABLE, State,
)
from spec.model import Model

VARIABLES = ("client", "prompt", "pst", "sent", "src", "dst", "table", "boot", "fwMsg", "dfw",
             "cancel", "leaked", "owner", "gen", "content", "powner", "pdata", "writes")


@dataclass(frozen=True, order=True)
class ModelValue:
    """A TLC model value (an element of Requests, or NoReq)."""

    name: str

    def __repr__(self) -> str:
        return self.name


NO_REQ = ModelValue("NoReq")


@dataclass(frozen=True, order=True)
class Record:
    """A TLA+ record, kept hashable so that it can sit in a set."""

    fields: tuple[tuple[str, object], ...]

    def __repr__(self) -> str:
        return "[" + ", ".join(f"{k} |-> {v!r}" for k, v in self.fields) + "]"


def to_tla(m: Model, s: State) -> dict[str, object]:
    names = [ModelValue(n) for n in m.request_names]

    def req(x: int) -> ModelValue:
        return names[x] if x != NONE else NO_REQ

    rows = s.requests

    def per_request(fn) -> dict:
        return {names[r]: fn(row) for r, row in enumerate(rows)}

    return {
        "client": per_request(lambda row: CLIENT_NAMES[row[CLIENT]]),
        "prompt": per_request(lambda row: row[PROMPT]),
        "pst": per_request(lambda row: PREFILL_NAMES[row[PST]]),
        "sent": per_request(lambda row: row[SENT]),
        "src": per_request(lambda row: tuple(p + 1 for p in row[SRC])),
        "dst": per_request(lambda row: DECODE_NAMES[row[DST]]),
        "table": per_request(lambda row: tuple(
            Record((("page", p + 1), ("gen", g))) for p, g in row[TABLE])),
        "boot": per_request(lambda row: bool(row[BOOT])),
        "fwMsg": per_request(lambda row: MESSAGE_NAMES[row[FW]]),
        "dfw": per_request(lambda row: bool(row[DFW])),
        "cancel": per_request(lambda row: bool(row[CANCEL])),
        "leaked": frozenset(names[r] for r, row in enumerate(rows) if row[LEAKED]),
        "owner": {p + 1: req(page[0]) for p, page in enumerate(s.decode_pool)},
        "gen": {p + 1: page[1] for p, page in enumerate(s.decode_pool)},
        "content": {p + 1: (req(page[2]), page[3]) for p, page in enumerate(s.decode_pool)},
        "powner": {p + 1: req(page[0]) for p, page in enumerate(s.prefill_pool)},
        "pdata": {p + 1: req(page[1]) for p, page in enumerate(s.prefill_pool)},
        "writes": frozenset(
            Record((("req", req(r)), ("src", src + 1), ("dst", dst + 1), ("gen", g)))
            for r, src, dst, g in s.writes),
    }


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
