"""The TLA+ view of a core state: the values of KVTransfer.tla's variables.

This is the explicit mapping between the Python representation and the spec. Requests are
the model values of the constant `Requests` (named as in the model), workers those of
`PrefillWorkers` and `DecodeWorkers` (p1.., d1..), pages are 1-based, strings are the spec's
strings. The core keeps every worker's pool in one flat tuple, worker w's pages at
w * pages .. (w + 1) * pages - 1 (spec/core.py); the spec has a pool per worker, owner[d][p],
and a page number in a row or a write is one of its request's worker's pages: the flat index
modulo the pool's size, plus 1. Traces (ITF JSON), counterexample printing and conformance
checking all go through this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.core import (
    ANNOUNCED, BOOT, CANCEL, CLIENT, CLIENT_NAMES, DECODE_NAMES, DFW, DST, DW, FW, FW_COUNT, HIT,
    LANDED, LEAKED, MESSAGE_NAMES, NONE, PCACHED, PHIT, PREFILL_NAMES, PROMPT, PST, PTABLE, PW, SALT,
    SENT, SRC, TABLE, TOKENS, State,
)
from spec.model import Model
from spec.tlaplus.tlavalues import ModelValue

VARIABLES = ("client", "prompt", "pst", "sent", "src", "dst", "table", "boot", "fwMsg", "dfw",
             "cancel", "ptable", "fwCount", "announced", "landed", "leaked", "pworker", "dworker",
             "tokens", "salt", "hit", "phit", "pcached", "owner", "gen", "content", "readers",
             "ident", "kv", "powner", "pdata", "preaders", "pident", "writes")


NO_REQ = ModelValue("NoReq")
NO_WORKER = ModelValue("NoWorker")


@dataclass(frozen=True, order=True)
class Record:
    """A TLA+ record, kept hashable so that it can sit in a set."""

    fields: tuple[tuple[str, object], ...]

    def __repr__(self) -> str:
        return "[" + ", ".join(f"{k} |-> {v!r}" for k, v in self.fields) + "]"


def _per_request(field: int, fn, with_model: bool = False) -> tuple:
    """A variable [Requests -> X]: reads one field of every row (fn(m, v) with_model)."""
    def source(s: State) -> tuple:
        return tuple(row[field] for row in s.requests)

    def convert(m: Model, values: tuple) -> dict:
        if with_model:
            return {ModelValue(name): fn(m, v) for name, v in zip(m.request_names, values)}
        return {ModelValue(name): fn(v) for name, v in zip(m.request_names, values)}
    return source, convert


def _worker(names: str):
    def convert(m: Model, w: int) -> ModelValue:
        return NO_WORKER if w == NONE else ModelValue(getattr(m, names)[w])
    return convert


def _per_worker(pages: str, names: str, fn):
    """A pool variable [Workers -> [Pages -> X]] from the core's flat pool."""
    def convert(m: Model, pool: tuple) -> dict:
        size = getattr(m, pages)
        return {ModelValue(name): {p + 1: fn(m, pool[w * size + p]) for p in range(size)}
                for w, name in enumerate(getattr(m, names))}
    return convert


def _req(m: Model, x: int) -> ModelValue:
    return ModelValue(m.request_names[x]) if x != NONE else NO_REQ


def _page_table(m: Model, entries: tuple) -> tuple:
    size = m.decode_pages
    return tuple(Record((("page", p % size + 1), ("gen", g))) for p, g in entries)


def _ident(m: Model, ident: tuple) -> tuple:
    """A content identity (salt, tokens) as <<salt, <<tokens>>>>; none is <<>>."""
    return ident and (ident[0], tuple(ident[1]))


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
    "src": _per_request(SRC, lambda m, v: tuple(p % m.prefill_pages + 1 for p in v), True),
    "dst": _per_request(DST, lambda v: DECODE_NAMES[v]),
    "table": _per_request(TABLE, _page_table, True),
    "boot": _per_request(BOOT, bool),
    "fwMsg": _per_request(FW, lambda v: MESSAGE_NAMES[v]),
    "dfw": _per_request(DFW, bool),
    "cancel": _per_request(CANCEL, bool),
    "ptable": _per_request(PTABLE, _page_table, True),
    "fwCount": _per_request(FW_COUNT, lambda v: v),
    "announced": _per_request(ANNOUNCED, lambda v: v),
    "landed": _per_request(LANDED, lambda v: v),
    "leaked": (lambda s: tuple(row[LEAKED] for row in s.requests),
               lambda m, flags: frozenset(ModelValue(n) for n, f in zip(m.request_names, flags)
                                          if f)),
    "pworker": _per_request(PW, _worker("prefill_worker_names"), True),
    "dworker": _per_request(DW, _worker("decode_worker_names"), True),
    "tokens": _per_request(TOKENS, tuple),
    "salt": _per_request(SALT, lambda v: v),
    "hit": _per_request(HIT, lambda v: v),
    "phit": _per_request(PHIT, lambda v: v),
    "pcached": _per_request(PCACHED, lambda v: v),
    "owner": (_decode_pool, _per_worker("decode_pages", "decode_worker_names",
                                        lambda m, page: _req(m, page[0]))),
    "gen": (_decode_pool, _per_worker("decode_pages", "decode_worker_names",
                                      lambda m, page: page[1])),
    "content": (_decode_pool, _per_worker("decode_pages", "decode_worker_names",
                                          lambda m, page: (_req(m, page[2]), page[3],
                                                           _ident(m, page[7])))),
    "readers": (_decode_pool, _per_worker("decode_pages", "decode_worker_names",
                                          lambda m, page: frozenset(_req(m, x) for x in page[4]))),
    "ident": (_decode_pool, _per_worker("decode_pages", "decode_worker_names",
                                        lambda m, page: _ident(m, page[5]))),
    "kv": (_decode_pool, _per_worker("decode_pages", "decode_worker_names",
                                     lambda m, page: _ident(m, page[6]))),
    "powner": (_prefill_pool, _per_worker("prefill_pages", "prefill_worker_names",
                                          lambda m, page: _req(m, page[0]))),
    "pdata": (_prefill_pool, _per_worker("prefill_pages", "prefill_worker_names",
                                         lambda m, page: _req(m, page[1]))),
    "preaders": (_prefill_pool, _per_worker("prefill_pages", "prefill_worker_names",
                                            lambda m, page: frozenset(_req(m, x)
                                                                      for x in page[2]))),
    "pident": (_prefill_pool, _per_worker("prefill_pages", "prefill_worker_names",
                                          lambda m, page: _ident(m, page[3]))),
    "writes": (_writes, lambda m, writes: frozenset(
        Record((("req", _req(m, r)), ("src", src % m.prefill_pages + 1),
                ("dst", dst % m.decode_pages + 1), ("gen", g)))
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
