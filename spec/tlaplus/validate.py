"""Trace validation: is a recorded run a behaviour of the protocol?

A trace is ITF JSON (spec/tlaplus/itf.py): a list of states, each with the values of some or all of
KVTransfer.tla's variables and, in "#meta", the action that produced it — or no action at
all, as Apalache writes its traces: an unlabelled step may be any action whose result
matches the recorded state. A trace may observe
only some variables (a simulator or engine sees what it sees); validation then searches for
a behaviour of the protocol consistent with every observation: it keeps the set of core
states that match the trace so far and advances it by the steps whose action carries the
recorded name (and label, when one is recorded) and whose result matches the next recorded
state. The first step with no such successor is illegal, and the report says what the
closest candidate differs in. Along the way the state invariants are evaluated: a step
after which every state consistent with the trace violates one is reported with the
invariant's name (the step is legal, the behaviour is bad), and at the last state, when no
fair action is enabled there, so are the rest invariants.

The steps are taken by the protocol core; the conformance check (spec/tlaplus/conformance.py) shows
on the shipped models that the core's steps are exactly KVTransfer.tla's, which is what
makes "legal for the core" mean "legal for the spec".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spec import core
from spec.core import State
from spec.properties import REST_INVARIANTS, STATE_INVARIANTS
from spec.tlaplus.itf import state_to_itf
from spec.model import Model
from spec.tlaplus.tlaview import VARIABLES

FRONTIER_MAX = 200_000  # a bound on the states consistent with a partial observation


class TraceError(ValueError):
    """A trace file that cannot be read as an ITF trace of this spec."""


@dataclass
class Verdict:
    ok: bool
    steps: int
    message: str
    bad_step: int = -1  # index of the first illegal state in the trace
    violated: str | None = None  # an invariant the trace breaks (its steps being legal)

    def __str__(self) -> str:
        return self.message


def normalize(value: object) -> object:
    """ITF values with sets and maps in a canonical order, so that equal values compare equal."""
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, dict):
        if "#set" in value:
            return {"#set": sorted((normalize(v) for v in value["#set"]), key=json.dumps)}
        if "#map" in value:
            pairs = [[normalize(k), normalize(v)] for k, v in value["#map"]]
            return {"#map": sorted(pairs, key=lambda kv: json.dumps(kv[0]))}
        if "#bigint" in value:
            return int(value["#bigint"])
        return {k: normalize(v) for k, v in sorted(value.items())}
    return value


def load_trace(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise TraceError(f"cannot read {path}: {error}") from error
    except UnicodeDecodeError as error:
        raise TraceError(f"{path}: not a text file (byte {error.start} is not UTF-8)") from None
    states = data.get("states") if isinstance(data, dict) else None
    if not isinstance(states, list) or not states:
        raise TraceError(f"{path}: not an ITF trace (no 'states' list)")
    for i, state in enumerate(states):
        if not isinstance(state, dict):
            raise TraceError(f"{path}: state {i} is not an object")
        unknown = set(state) - set(VARIABLES) - {"#meta"}
        if unknown:
            raise TraceError(f"{path}: state {i} has variables the spec does not have: "
                             f"{sorted(unknown)}")
        action = state.get("#meta", {}).get("action") if isinstance(
            state.get("#meta"), dict) else None
        if i and action is not None and not isinstance(action, str):
            raise TraceError(f"{path}: state {i}: #meta.action must be an action name")
    return data


def _observed(recorded: dict) -> dict[str, object]:
    return {k: normalize(v) for k, v in recorded.items() if k != "#meta"}


def _differences(m: Model, s: State, observed: dict[str, object]) -> list[str]:
    actual = state_to_itf(m, s)
    return [name for name, value in observed.items() if normalize(actual[name]) != value]


def _matches(m: Model, s: State, observed: dict[str, object]) -> bool:
    return not _differences(m, s, observed)


def _broken_everywhere(m: Model, states: set[State], table: dict) -> str | None:
    """An invariant that every state in `states` violates (certainly broken), or None."""
    for name, predicate in table.items():
        if all(not predicate(m, s) for s in states):
            return name
    return None


def _at_rest(m: Model, s: State) -> bool:
    """No fair action is enabled (an arrival is not fair: none is listed)."""
    return all(event.action in core.UNFAIR_ACTIONS
               for event, _ in core.successors(m, s, _NO_ARRIVALS))


def _NO_ARRIVALS(r: int, n: int) -> tuple:
    return ()


def _recorded_contents(m: Model, observed: dict):
    """With a prefix cache, the (tokens, salt) an Arrive of r may carry: what the recorded
    state shows for r (a prompt is not guessed from 1..Tokens: a shell's Tokens is 2^62);
    None (every prompt) without a prefix cache or without both variables recorded."""
    if not m.prefix_cache or "tokens" not in observed or "salt" not in observed:
        return None
    tokens, salts = _by_request(observed["tokens"]), _by_request(observed["salt"])

    def contents(r: int, n: int) -> tuple:
        name = m.request_names[r]
        t, salt = tokens.get(name), salts.get(name)
        if not isinstance(t, list) or len(t) != n or not isinstance(salt, int):
            return ()
        return ((tuple(t), salt),)
    return contents


def _by_request(value) -> dict:
    """An ITF function of requests (normalized: {"#map": [[name, value], ...]}) as a dict."""
    if not isinstance(value, dict) or not isinstance(value.get("#map"), list):
        return {}
    return {pair[0]: pair[1] for pair in value["#map"]
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)}


def _step(m: Model, frontier: set[State], index: int, recorded: dict):
    """The states consistent with the trace after step `index`, or the Verdict that
    the step is illegal."""
    meta = recorded.get("#meta") if isinstance(recorded.get("#meta"), dict) else {}
    action, label = meta.get("action"), meta.get("label")
    observed = _observed(recorded)
    successors: set[State] = set()
    closest: tuple[int, str, list[str]] | None = None
    contents = _recorded_contents(m, observed)
    for s in frontier:
        for event, nxt in core.successors(m, s, contents):
            if action and (event.action != action or (label and event.label(m) != label)):
                continue
            diff = _differences(m, nxt, observed)
            if not diff:
                successors.add(nxt)
            elif closest is None or len(diff) < closest[0]:
                closest = (len(diff), event.label(m), diff)
    what = label or action or "an unlabelled step"
    if not successors:
        if closest is None:
            why = f"{what} is not enabled in any state consistent with the trace so far"
        else:
            why = (f"{closest[1]} is enabled, but its result differs from the recorded "
                   f"state in {', '.join(closest[2])}")
        return Verdict(False, index, f"step {index} ({what}) is illegal: {why}",
                       bad_step=index)
    if len(successors) > FRONTIER_MAX:
        return Verdict(False, index, f"step {index}: more than {FRONTIER_MAX} states are "
                       "consistent with the observations; record more variables",
                       bad_step=index)
    return successors


def validate(m: Model, trace: dict, invariants: bool = False) -> Verdict:
    """Whether the trace is a behaviour of the protocol; with `invariants`, also whether
    it keeps them (a counterexample is a legal trace that does not)."""
    states = trace["states"]
    first = _observed(states[0])
    frontier = {core.initial_state(m)}
    if not _matches(m, core.initial_state(m), first):
        diff = _differences(m, core.initial_state(m), first)
        return Verdict(False, 0, f"state 0 is not the initial state: {', '.join(diff)} differ",
                       bad_step=0)
    for index in range(1, len(states)):
        stepped = _step(m, frontier, index, states[index])
        if isinstance(stepped, Verdict):
            return stepped
        frontier = stepped
        broken = _broken_everywhere(m, frontier, STATE_INVARIANTS) if invariants else None
        if broken:
            meta = states[index].get("#meta") or {}
            what = meta.get("label") or meta.get("action") or "an unlabelled step"
            return Verdict(False, index, f"step {index} ({what}) is legal, but after it "
                           f"{broken} is violated", bad_step=index, violated=broken)
    if invariants and all(_at_rest(m, s) for s in frontier):
        broken = _broken_everywhere(m, frontier, REST_INVARIANTS)
        if broken:
            return Verdict(False, len(states) - 1, f"the trace ends at rest (no fair action "
                           f"is enabled) and {broken} is violated there",
                           bad_step=len(states) - 1, violated=broken)
    return Verdict(True, len(states) - 1,
                   f"trace OK: {len(states) - 1} steps, each a legal step of the protocol, "
                   f"no invariant violated ({len(frontier)} state(s) consistent with the "
                   "last observation)")
