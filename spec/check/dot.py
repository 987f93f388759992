"""The state graph of a small model as Graphviz DOT (`kvproof check --dump-dot FILE`).

Nodes are states numbered in breadth-first order (0 is the initial state). A whole state is
too much to read on a picture, so a node shows its number and its clients' states, with the
whole state in the tooltip; edges carry the event's label. States that violate a state
invariant are drawn red. Drawing is for small models only: beyond DOT_STATES_MAX states the
picture says nothing, and the function refuses rather than write a file no viewer can lay
out.
"""

from __future__ import annotations

from collections import deque

from spec import core
from spec.model import Model
from spec.properties import STATE_INVARIANTS
from spec.tlaplus.tlaview import format_value, to_tla

DOT_STATES_MAX = 2000


class TooLargeToDraw(ValueError):
    """The model's state graph has more states than a picture can show."""


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def state_graph(m: Model) -> tuple[list, list[tuple[int, str, int]]]:
    """The states in breadth-first order and the labelled edges between their indices."""
    init = core.initial_state(m)
    index = {init: 0}
    states, edges = [init], []
    queue = deque([init])
    while queue:
        s = queue.popleft()
        for event, nxt in core.successors(m, s):
            if nxt not in index:
                if len(states) >= DOT_STATES_MAX:
                    raise TooLargeToDraw(f"the state graph has more than {DOT_STATES_MAX:,} "
                                         "states, too many to draw; try --model solo")
                index[nxt] = len(states)
                states.append(nxt)
                queue.append(nxt)
            edges.append((index[s], event.label(m), index[nxt]))
    return states, edges


def to_dot(m: Model) -> str:
    states, edges = state_graph(m)
    lines = [f"digraph {_quote(m.name)} {{", "  node [shape=box, fontsize=10];",
             "  edge [fontsize=8];"]
    for k, s in enumerate(states):
        view = to_tla(m, s)
        broken = [n for n, p in STATE_INVARIANTS.items() if not p(m, s)]
        colour = ', color=red, fontcolor=red' if broken else ""
        label = f"{k}\nclient {format_value(view['client'])}"
        if broken:
            label += "\nviolates " + ", ".join(broken)
        tooltip = "\n".join(f"{v} = {format_value(x)}" for v, x in view.items())
        lines.append(f"  s{k} [label={_quote(label)}, tooltip={_quote(tooltip)}{colour}];")
    for source, label, target in edges:
        lines.append(f"  s{source} -> s{target} [label={_quote(label)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
