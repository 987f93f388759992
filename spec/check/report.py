"""Readable counterexamples and TLC-like summaries."""

from __future__ import annotations

from spec.check.checker import CheckResult
from spec.properties import Violation
from spec.model import _at_prefill, Model
from spec.tlaplus.tlaview import changes, format_value, to_tla, VARIABLES

KIND_TEXT = {
    "invariant": "Invariant {p} is violated.",
    "rest": "Invariant {p} is violated at rest (no fair action is enabled).",
    "step": "Action property {p} is violated by the last step.",
    "quiet": "Invariant {p} is violated where only a timer could move the protocol on.",
    "deadlock": "Deadlock reached: {p} is violated and no action is enabled.",
    "cycle": "Liveness: the state graph has a cycle, so fairness alone does not end requests.",
}


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def describe_model(m: Model) -> str:
    """Model.describe() in words that agree with their numbers ("1 request", "1 page")."""
    def pages(n: int) -> str:
        return f"{n} page" if n == 1 else f"{n} pages"

    bugs = ", ".join(sorted(m.bugs)) or "none"
    requests = "1 request" if m.requests == 1 else f"{m.requests} requests"
    prompts = "prompts of 1 page" if m.max_prompt_pages == 1 else (
        f"prompts 1..{m.max_prompt_pages} pages")
    return (f"model {m.name}: {requests}, {prompts}, context {pages(m.context_pages)} "
            f"(advertised {m.advertised_context_pages}), prefill pool "
            f"{pages(m.prefill_pages)}, decode pool {pages(m.decode_pages)}"
            f"{', prefill crashes' if m.crashes else ''}"
            f"{', decode crashes' if m.decode_crashes else ''}"
            f"{'' if m.early_timeouts else ', timely timers'}"
            f"{f', prefix cache ({m.tokens} token kind{_s(m.tokens)}, {m.tenants} salt{_s(m.tenants)}{_at_prefill(m)})' if m.prefix_cache else ''}"
            f"; bugs: {bugs}")


def format_trace(m: Model, violation: Violation, full: bool = False, shortest: bool = True) -> str:
    """A counterexample as TLC prints it: the initial state in full, then per step the
    variables that changed (or, with full, every variable: easier to read at one step,
    harder to follow along)."""
    which = "The shortest behaviour" if shortest else "A behaviour"
    lines = [KIND_TEXT[violation.kind].format(p=violation.property),
             f"{which} violating it has {violation.length} "
             f"{'step' if violation.length == 1 else 'steps'}:"]
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
            if full:
                lines += [f"  /\\ {var} = {format_value(view[var])}" for var in VARIABLES]
            else:
                lines += [f"  {line}" for line in changes(previous, view)]
        previous = view
    return "\n".join(lines)


def format_summary(result: CheckResult) -> str:
    m = result.model
    workers = f" with {result.workers} workers" if result.workers > 1 else ""
    rate = result.distinct_states / max(result.seconds, 1e-9)
    lines = [
        describe_model(m),
        f"{result.states_generated} states generated, {result.distinct_states} distinct states "
        f"found, {result.left_on_queue} states left on queue.",
        # TLC counts the initial state in the depth; result.depth counts steps.
        f"The depth of the complete state graph search is {result.depth + 1}.",
        f"Checked in {result.seconds:.2f} s ({rate:,.0f} distinct states/s){workers}"
        f"{' with ' + symmetry_words(m) if result.symmetry else ''}.",
        f"The optimistic probability of a fingerprint collision is "
        f"{result.collision_probability:.1E}.",
    ]
    unreduced = result.states_without_symmetry
    if unreduced is not None:
        lines.append(f"Without symmetry the search would find {unreduced} distinct states "
                     "(the sizes of the orbits found, summed).")
    return "\n".join(lines)


def symmetry_words(m: Model) -> str:
    return ("symmetry over requests" if m.one_pair
            else "symmetry over requests and over the workers of each kind")


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
