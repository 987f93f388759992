"""Readable counterexamples and TLC-like summaries."""

from __future__ import annotations

from spec.check.checker import CheckResult
from spec.properties import Violation
from spec.model import Model
from spec.tlaplus.tlaview import changes, format_value, to_tla, VARIABLES

KIND_TEXT = {
    "invariant": "Invariant {p} is violated.",
    "rest": "Invariant {p} is violated at rest (no fair action is enabled).",
    "step": "Action property {p} is violated by the last step.",
    "quiet": "Invariant {p} is violated where only a timer could move the protocol on.",
    "deadlock": "Deadlock reached: {p} is violated and no action is enabled.",
    "cycle": "Liveness: the state graph has a cycle, so fairness alone does not end requests.",
}


def format_trace(m: Model, violation: Violation) -> str:
    lines = [KIND_TEXT[violation.kind].format(p=violation.property),
             f"The shortest behaviour violating it has {violation.length} steps:"]
    previous = None
    for index, (event, state) in enumerate(violation.trace):
        view = to_tla(m, state)
        if previous is None:
            lines.append("State 1: <Initial predicate>")
            for var in VARIABLES:
                lines.append(f"  /\\ {var} = {format_value(view[var])}")
        else:
            loop = " (the loop starts here)" if index == violation.cycle_start else ""
            lines.append(f"State {index + 1}: <{event.label(m)}>{loop}")
            for line in changes(previous, view):
                lines.append(f"  {line}")
        previous = view
    return "\n".join(lines)


def format_summary(result: CheckResult) -> str:
    m = result.model
    lines = [
        m.describe(),
        f"{result.states_generated} states generated, {result.distinct_states} distinct states "
        f"found, {result.left_on_queue} states left on queue.",
        # TLC counts the initial state in the depth; result.depth counts steps.
        f"The depth of the complete state graph search is {result.depth + 1}.",
        f"Checked in {result.seconds:.2f} s ({result.distinct_states / max(result.seconds, 1e-9):,.0f}"
        f" distinct states/s){' with symmetry over requests' if result.symmetry else ''}.",
        f"The optimistic probability of a fingerprint collision is "
        f"{result.collision_probability:.1E}.",
    ]
    return "\n".join(lines)


def format_coverage(result: CheckResult) -> str:
    """TLC-style action coverage; an action that never fires is flagged, since a guard that
    can never be exercised proves nothing."""
    from spec.core import ACTION_NAMES

    lines = ["Action coverage (distinct states found first by the action / transitions):"]
    for name in ACTION_NAMES:
        found = result.action_counts.get(name, 0)
        fired = result.action_transitions.get(name, 0)
        flag = "   <-- never enabled" if fired == 0 else ""
        lines.append(f"  {name:<14} {found:>10,} / {fired:>10,}{flag}")
    return "\n".join(lines)
