"""Fault hits: how often each fault struck the protocol state it is meant to stress.

A fault that fires while nothing is at stake tests nothing: a prefill crash with no write
on the wire exercises no flush, an abort of a request that has not started its transfer
exercises no deferred release. So each kind of fault names its *target*: a predicate over
the protocol state (the store, read only) at the moment the fault fires. The simulator
counts, per kind, how often the fault fired and how often it hit its target; a fault
scenario whose fault never hits its target is a scenario that needs retuning, not a pass.

Counted live, when the fault fires (like refused offers, a replay of the log does not
rebuild them: message loss and slow writes are not protocol events and are not logged).
"""

from __future__ import annotations

from spec.core import CANCEL_MSG, D_WAITING, DST, FINAL_WORD_MSG, PST, RUNNING, SENT, TABLE
from spec.store import Store

# Fault kind -> its target state, in words (the predicates are below, one per kind).
TARGETS = {
    "ClientAbort": "during the transfer (pages posted, decode still waiting for KV)",
    "PrefillFail": "while decode holds pages reserved for the request",
    "PrefillCrash": "with writes of the crashed prefill in flight",
    "DecodeCrash": "mid-transfer (writes into the crashed decode in flight)",
    "Timeout": "with writes of the request in flight",
    "MessageLoss": "on a final word or a cancel",
    "MessageDelay": "on a final word or a cancel",
    "SlowLink": "on a write that then lands after its request's transfer timeout",
    "MessageLostForGood": "on a final word or a cancel",
    "WriteLoss": "on a write whose request decode still waits for",
    "WritePostFail": "on a write whose request decode still waits for",
}
# The scenario's fault fields and the kind of fault each switches on.
SCENARIO_FAULTS = {
    "client_abort_probability": "ClientAbort", "prefill_fail_probability": "PrefillFail",
    "prefill_crash_rate_per_s": "PrefillCrash", "decode_crash_rate_per_s": "DecodeCrash",
    "message_loss_probability": "MessageLoss", "message_delay_probability": "MessageDelay",
    "slow_link_probability": "SlowLink", "write_loss_probability": "WriteLoss",
    "write_post_fail_probability": "WritePostFail",
}


def faults_switched_on(faults) -> list[str]:
    """The fault kinds a scenario's [faults] table switches on, in TARGETS order."""
    on = {kind for name, kind in SCENARIO_FAULTS.items() if getattr(faults, name)}
    return [kind for kind in TARGETS if kind in on]


def writes_of_request(store: Store, r: int) -> bool:
    d = store.placement[r][1]
    return any(w[0] == r for w in store.writes_into[d])


def in_transfer(store: Store, r: int) -> bool:
    row = store.rows[r]
    return row[PST] == RUNNING and row[SENT] > 0 and row[DST] == D_WAITING


def decode_holds_pages(store: Store, r: int) -> bool:
    return bool(store.rows[r][TABLE])


def prefill_writes_in_flight(store: Store, p: int) -> bool:
    placement = store.placement
    return any(placement[w[0]][0] == p for writes in store.writes_into for w in writes)


def decode_writes_in_flight(store: Store, d: int) -> bool:
    return bool(store.writes_into[d])


def decode_waits(store: Store, r: int) -> bool:
    return r in store.rows and store.rows[r][DST] == D_WAITING


def stressful_message(message: str) -> bool:
    return message in (FINAL_WORD_MSG, CANCEL_MSG)


class FaultHits:
    """Per fault kind: [fired, hit its target]."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}

    def fired(self, kind: str, hit: bool) -> None:
        assert kind in TARGETS, f"unknown fault kind {kind}"
        count = self.counts.setdefault(kind, [0, 0])
        count[0] += 1
        count[1] += bool(hit)

    def as_dict(self) -> dict:
        """{kind: {"target": words, "fired": n, "hits": m}} for the kinds that fired."""
        return {kind: {"target": TARGETS[kind], "fired": fired, "hits": hits}
                for kind, (fired, hits) in sorted(self.counts.items())}
