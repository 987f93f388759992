"""Traces in ITF JSON, the Apalache/Quint trace format.

One trace format for every run: each state carries the spec's variables and, in "#meta",
the action that produced it ("action", the TLA+ action name) and its label with arguments.
"""

from __future__ import annotations

import json
from typing import Iterable

from spec.core import Event, State
from spec.model import Model
from spec.tlaview import VARIABLES, ModelValue, Record, to_tla


def encode(v: object) -> object:
    if isinstance(v, bool) or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v if abs(v) < 2**53 else {"#bigint": str(v)}
    if isinstance(v, ModelValue):
        return v.name
    if isinstance(v, Record):
        return {k: encode(x) for k, x in v.fields}
    if isinstance(v, tuple):
        return [encode(x) for x in v]  # a TLA+ sequence
    if isinstance(v, frozenset):
        return {"#set": sorted((encode(x) for x in v), key=json.dumps)}
    if isinstance(v, dict):
        return {"#map": [[encode(k), encode(x)] for k, x in v.items()]}
    raise TypeError(f"no ITF form for {v!r}")


def content_pair(v: object) -> object:
    """content[p] is a pair <<who, tag>>: ITF writes tuples with #tup, sequences as lists."""
    return {"#tup": [encode(x) for x in v]}


def trace_to_itf(m: Model, steps: Iterable[tuple[Event | None, State]],
                 description: str = "") -> dict:
    states = []
    for index, (event, state) in enumerate(steps):
        view = to_tla(m, state)
        item: dict[str, object] = {
            "#meta": {"index": index,
                      "action": event.action if event else "Init",
                      "label": event.label(m) if event else "Init"}}
        for var in VARIABLES:
            if var == "content":
                item[var] = {"#map": [[k, content_pair(x)] for k, x in view[var].items()]}
            else:
                item[var] = encode(view[var])
        states.append(item)
    return {
        "#meta": {"format": "ITF", "source": "spec/KVTransfer.tla",
                  "description": description or m.describe()},
        "vars": list(VARIABLES),
        "states": states,
    }


def write_itf(path: str, m: Model, steps: Iterable[tuple[Event | None, State]],
              description: str = "") -> None:
    with open(path, "w") as f:
        json.dump(trace_to_itf(m, steps, description), f, indent=1)
        f.write("\n")
