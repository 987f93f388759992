"""Traces in ITF JSON, the Apalache/Quint trace format.

One trace format for every run: each state carries the spec's variables and, in "#meta",
the action that produced it ("action", the TLA+ action name) and its label with arguments.
"""

from __future__ import annotations

import json
from typing import Iterable

from spec.core import Event, State
from spec.model import Model
from spec.tlaplus.tlaview import VARIABLES, ModelValue, Record, to_tla


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
    """content[p] is a triple <<who, generation, identity>>: ITF writes tuples with #tup,
    sequences as lists."""
    return {"#tup": [encode(x) for x in v]}


def state_to_itf(m: Model, state: State) -> dict[str, object]:
    """The ITF values of every variable of the spec in this state."""
    view = to_tla(m, state)
    out: dict[str, object] = {}
    for var in VARIABLES:
        if var == "content":  # content[d][p]
            out[var] = {"#map": [[encode(d), {"#map": [[k, content_pair(x)]
                                                       for k, x in pool.items()]}]
                                 for d, pool in view[var].items()]}
        else:
            out[var] = encode(view[var])
    return out


def model_meta(m: Model) -> dict[str, object]:
    """The model's constants, so that a trace says which model it is a behaviour of."""
    return {**m.tla_constants(), "name": m.name}


def model_from_meta(meta: dict[str, object]) -> Model:
    return Model.from_tla_constants(meta, name=str(meta.get("name", "trace")))


def trace_to_itf(m: Model, steps: Iterable[tuple[Event | None, State]],
                 description: str = "") -> dict:
    states = []
    for index, (event, state) in enumerate(steps):
        item: dict[str, object] = {
            "#meta": {"index": index,
                      "action": event.action if event else "Init",
                      "label": event.label(m) if event else "Init"}}
        item.update(state_to_itf(m, state))
        states.append(item)
    return {
        "#meta": {"format": "ITF", "source": "spec/KVTransfer.tla",
                  "description": description or m.describe(), "model": model_meta(m)},
        "vars": list(VARIABLES),
        "states": states,
    }


def write_itf(path: str, m: Model, steps: Iterable[tuple[Event | None, State]],
              description: str = "") -> None:
    with open(path, "w") as f:
        json.dump(trace_to_itf(m, steps, description), f, indent=1)
        f.write("\n")
