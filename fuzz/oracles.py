"""What is checked after every fuzz step, on every target.

Three layers, each blind to the others' mistakes:

- spec/properties.py, on the target's protocol state: the state invariants after every step,
  the rest invariants whenever no fair action is enabled (the same rule as the checker);
- page conservation, on the target's own bookkeeping: every page of every pool is either
  free or held by exactly one request whose own page list names it, so free + held ==
  total; and every write in flight goes into a page its request owns;
- the leak oracle, on canaries: a writer leaves its identity in every page it writes (the
  core's page `data` is the writer's request id), so whatever decode read can be traced to
  who wrote it. With a prefix cache pages are shared, so the oracle judges content instead:
  each page read must hold the identity the request's own tokens and salt imply (the
  spec's TrueIdent, computed from what the client sent, not from the cache's keys). A
  request whose client got Ok must have read only its own pages, and so must a request
  that is decoding for a waiting client, at every moment its reads would pass the tag
  check (a real decode reads at every token; a read the tag check refuses ends the
  request with a clear error instead). This does not look at the core's LEAKED flag: if
  the core's own accounting of a leak were wrong, this would still see the leak.

A zoo entry may restrict the properties it is about (the incident is about OkIsClean and
Isolation, not about the liveness damage its switches also do); an oracle is checked when a
property of its family is.
"""

from __future__ import annotations

import weakref

from dataclasses import dataclass
from typing import Callable, Iterable

from spec import core
from spec.model import Model
from spec.properties import (ALL_INVARIANTS, QUIET_INVARIANTS, REST_INVARIANTS,
                             STATE_INVARIANTS, STEP_PROPERTIES)

from fuzz.target import ENVIRONMENT_FAULTS, Observation, Target, Violation
from fuzz.wire_faults import excused

LEAK_ORACLE = "LeakOracle"
PAGE_CONSERVATION = "PageConservation"
# The spec properties whose concern each oracle shares.
ORACLE_FAMILY = {
    PAGE_CONSERVATION: ("ExclusiveOwner", "NoWriteIntoForeign", "SourceHeld"),
    LEAK_ORACLE: ("Isolation", "OkIsClean"),
}
# The environment's actions: not owed by the protocol.
FAIR_EXEMPT = core.UNFAIR_ACTIONS | ENVIRONMENT_FAULTS


def _name(m: Model, r: int) -> str:
    return m.request_names[r] if r >= 0 else "nobody"


def page_conservation(m: Model, obs: Observation) -> list[str]:
    problems = []
    for pool in obs.pools:
        holder: dict[int, int] = {}
        for r, pages in enumerate(pool.held):
            for p in pages:
                if p in holder:
                    problems.append(f"{pool.name} page {p + 1} is held by both "
                                    f"{_name(m, holder[p])} and {_name(m, r)}")
                holder[p] = r
                if pool.owners[p] != r:
                    problems.append(f"{_name(m, r)} holds {pool.name} page {p + 1}, which the "
                                    f"pool gives to {_name(m, pool.owners[p])}")
        free = sum(1 for owner in pool.owners if owner == core.NONE)
        if free + len(holder) != len(pool.owners):
            problems.append(f"{pool.name} pool: {free} free + {len(holder)} held != "
                            f"{len(pool.owners)} pages")
    decode = next(pool for pool in obs.pools if pool.name == "decode")
    for r, p in obs.writes:
        if decode.owners[p] != r:
            problems.append(f"a write of {_name(m, r)} is in flight into decode page {p + 1}, "
                            f"owned by {_name(m, decode.owners[p])}")
    return problems


def leak_oracle(m: Model, obs: Observation) -> list[str]:
    problems = []
    for r, outcome in enumerate(obs.outcomes):
        own = obs.expected.get(r)
        if outcome == "Ok":
            reads = obs.reads.get(r)
            if reads is None:
                problems.append(f"{_name(m, r)} got Ok, but decode never read its pages")
            elif _wrong(r, reads, own):
                problems.append(f"{_name(m, r)} got Ok, but decode read {len(reads)} pages of "
                                f"which {_wrong(r, reads, own, m)}")
        elif outcome == "Waiting" and _wrong(r, obs.decoding.get(r, ()), own):
            reads = obs.decoding[r]
            problems.append(f"{_name(m, r)} is decoding, and its next read passes the tag "
                            f"check on {len(reads)} pages of which {_wrong(r, reads, own, m)}")
    return problems


def _wrong(r: int, reads: tuple, own: tuple | None, m: Model | None = None):
    """_foreign, or with a prefix cache (`own`: the identity each page must hold) how many
    pages hold another prompt's or tenant's KV (with m, as words; else a count)."""
    if own is None:
        return _foreign(r, reads, m)
    bad = [(i, got) for i, got in enumerate(reads) if i >= len(own) or got != own[i]]
    if m is None:
        return len(bad)
    shown = "; ".join(f"page {i + 1} holds {_ident(got)}, not {_ident(own[i])}"
                      if i < len(own) else f"page {i + 1} is beyond the prompt"
                      for i, got in bad[:3])
    return f"{len(bad)} hold other KV ({shown})"


def _ident(ident: tuple) -> str:
    if not ident:
        return "nothing ever written"
    salt, tokens = ident
    return f"salt {salt}, tokens {core.tokens_text(tokens)}"


def _foreign(r: int, writers: tuple[int, ...], m: Model | None = None):
    """How many of `writers` are not r and who they are (with m, as words; else a count)."""
    count = sum(1 for w in writers if w != r)
    if m is None:
        return count
    names = ", ".join(_name(m, w) for w in sorted({w for w in writers if w != r}))
    return f"{count} were written by {names}"


ORACLES: dict[str, Callable[[Model, Observation], list[str]]] = {
    PAGE_CONSERVATION: page_conservation,
    LEAK_ORACLE: leak_oracle,
}


@dataclass(frozen=True)
class Checks:
    """The properties and oracles one campaign checks."""

    state: tuple[tuple[str, Callable], ...]
    rest: tuple[tuple[str, Callable], ...]
    oracles: tuple[tuple[str, Callable], ...]
    step: tuple[tuple[str, Callable], ...] = ()  # step properties, from one check to the next
    quiet: tuple[tuple[str, Callable], ...] = ()  # where nothing but a timer is enabled

    @classmethod
    def for_properties(cls, names: Iterable[str] | None = None) -> "Checks":
        """All checks, or those of the named spec properties and their oracles."""
        known = set(ALL_INVARIANTS) | set(STEP_PROPERTIES)
        chosen = set(names) if names is not None else known
        unknown = chosen - known
        if unknown:
            raise ValueError(f"unknown propert(y/ies) {sorted(unknown)}")
        return cls(
            state=tuple((n, p) for n, p in STATE_INVARIANTS.items() if n in chosen),
            rest=tuple((n, p) for n, p in REST_INVARIANTS.items() if n in chosen),
            oracles=tuple((n, fn) for n, fn in ORACLES.items()
                          if chosen.intersection(ORACLE_FAMILY[n])),
            step=tuple((n, p) for n, p in STEP_PROPERTIES.items() if n in chosen),
            quiet=tuple((n, p) for n, p in QUIET_INVARIANTS.items() if n in chosen))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.state + self.rest + self.oracles + self.step
                     + self.quiet)


def at_rest(target: Target) -> bool:
    """No fair action is enabled: only the environment could move the system on."""
    return at_rest_in(target.enabled())


def at_rest_in(moves_by_action) -> bool:
    return not any(action not in FAIR_EXEMPT for action in moves_by_action)


def quiet(target: Target) -> bool:
    """Nothing but a transfer timer (or the environment) could move the protocol on, and
    no traffic is held back on the wire. A target whose own components act in time (the
    simulator's Wait) is quiet when all it still has scheduled is its transfer timers."""
    return not target.holding() and all(
        action in FAIR_EXEMPT or action in core.TIMER_ACTIONS
        or (action == "Wait" and target.only_timers_pending())
        for action in target.enabled())


# Per target, the protocol state at the last check and how many moves it had taken: the
# step properties compare two consecutive moves' states (a reset target starts afresh).
_last_checked: "weakref.WeakKeyDictionary[Target, tuple[int, object]]" = weakref.WeakKeyDictionary()


def check(checks: Checks, m: Model, target: Target) -> list[Violation]:
    """Every violated check in the target's current state (empty when all hold)."""
    s = target.protocol_state()
    judged = excused(s, target.data_faulted())  # a wire fault's own errors are no guard bug
    found = [Violation(n, "violated") for n, p in checks.state if not p(m, judged)]
    before = _last_checked.get(target)
    if checks.step and before is not None and before[0] == len(target.trace()) - 1:
        found += [Violation(n, "violated by the last step") for n, p in checks.step
                  if not p(m, before[1], s)]
    _last_checked[target] = (len(target.trace()), s)
    if checks.rest and at_rest(target):
        found += [Violation(n, "violated at rest") for n, p in checks.rest if not p(m, s)]
    if checks.quiet and quiet(target):
        pair = target.pair_model()  # whether a prompt fits is a worker pair's question
        found += [Violation(n, "violated where only a timer could move the protocol on")
                  for n, p in checks.quiet if not p(pair, judged)]
    if checks.oracles:
        obs = target.observe()
        for name, oracle in checks.oracles:
            found += [Violation(name, problem) for problem in oracle(m, obs)]
    # A target's own checks count for the properties this campaign checks (a zoo entry
    # about OkIsClean is not caught by the liveness damage its switches also do).
    return found + [v for v in target.check() if v.property in checks.names]
