"""Who owns what: the protocol's variables split by role, the one table of that fact.

Every per-request variable of KVTransfer.tla (a field of a core row, by the same name in
spec/core.py's ROW_FIELDS), every pool and the send queue has an owner (`OWNERS`): the
router, the prefill or decode, the wire (a message in flight: its sender puts it there, its
receiver takes it off, `WIRE`), or ghost (history for the properties). A worker may read
its own variables, the messages addressed to it and the router's facts `GRANTS` names with
how they reach it. spec/tlaplus/locality.py proves from the spec's text and the core's
source that every action keeps to this; spec/parts.py splits the state by it and runs each
role's actions on its own part, so the same rule is enforced at run time. Both read it
here: locality needs the TLA+ parser, the split must not.

What crosses between roles besides the wire's variables is named too (`DELIVERIES`: a
write into a variable its writer does not own is a message to the owner), as is how the
router's granted facts travel (`GRANT_CARRIERS`).

Pure: standard library and spec/'s protocol modules only.
"""

from __future__ import annotations

from spec.core import BOOTSTRAP, CANCEL_MSG, FINAL_WORD_MSG  # before commands: it imports core
from spec.commands import PAGE_TABLE  # noqa: I001

QUEUE_ENTRY, ANSWER = "queue entry", "answer"
ROUTER, PREFILL, DECODE, WIRE_OWNER, GHOST = "router", "prefill", "decode", "wire", "ghost"

# Variable -> its owner. Per-request variables split a request's row by who knows each part.
OWNERS = {
    "client": ROUTER, "prompt": ROUTER, "pworker": ROUTER, "dworker": ROUTER,
    "tokens": ROUTER, "salt": ROUTER, "phit": PREFILL, "hit": DECODE, "readers": DECODE,
    "pcached": PREFILL, "preaders": PREFILL, "pident": PREFILL,
    "ident": DECODE, "kv": DECODE,
    "pst": PREFILL, "sent": PREFILL, "src": PREFILL, "ptable": PREFILL, "powner": PREFILL,
    "pdata": PREFILL, "writes": PREFILL,
    "dst": DECODE, "table": DECODE, "dfw": DECODE, "announced": DECODE, "landed": DECODE,
    "owner": DECODE, "gen": DECODE, "content": DECODE,
    "boot": WIRE_OWNER, "fwMsg": WIRE_OWNER, "fwCount": WIRE_OWNER, "cancel": WIRE_OWNER,
    "leaked": GHOST,
}
# A message variable -> (sender, receiver).
WIRE = {"boot": (ROUTER, DECODE), "fwMsg": (PREFILL, DECODE), "fwCount": (PREFILL, DECODE),
        "cancel": (DECODE, PREFILL)}
# (worker, variable it does not own) -> how the fact reaches that worker.
GRANTS = {
    (PREFILL, "prompt"): "the queue entry the router hands the prefill carries the prompt",
    (DECODE, "prompt"): "the bootstrap carries the prompt's length",
    (PREFILL, "tokens"): "the queue entry carries the prompt's tokens",
    (DECODE, "tokens"): "the bootstrap carries the prompt's tokens (decode looks them up)",
    (PREFILL, "salt"): "the queue entry carries the request's salt",
    (DECODE, "salt"): "the bootstrap carries the request's salt (decode keys its cache by it)",
    (PREFILL, "pworker"): "the queue entry reaches the prefill worker the router chose: a "
                          "worker knows which requests are its own",
    (DECODE, "dworker"): "the bootstrap reaches the decode worker the router chose",
    (PREFILL, "client"): "the serving edge's client-gone notice (PrefillAbort), and its "
                         "first-answer rule: an answer sent to a client who has one is "
                         "dropped by the edge (ClientError)",
    (DECODE, "client"): "the serving edge's client-gone notice (DecodeAbort), and its "
                        "first-answer rule (ClientError)",
}
# Operators (spec) and helpers (core) that state the environment's timing assumption under
# which a timer fires, not a guard its worker evaluates: a timer fires when time has passed,
# and what it may assume about the other side in that time is the synchrony assumption a
# lease rests on. Their reads are the environment's; the rule skips them, and the table says
# so. Every other read of a timer's guard is checked like any worker's.
ASSUMPTIONS = {
    "LeaseLapsed": "decode's lease lapses only after the prefill's silence (a working "
                   "prefill renews it within lease_s): the environment's assumption, decode "
                   "sees only its clock",
    "BootstrapUnanswered": "the router's resend timer outlasts a bootstrap's round trip: it "
                           "fires only once the bootstrap is off the wire unanswered (lost); "
                           "the router sees only its clock",
    "CancelUnanswered": "decode's resend timer outlasts a cancel's round trip: it fires only "
                        "once neither the cancel nor the final word answering it is on the "
                        "wire (one was lost); decode sees only its clock",
    "WritesGone": "decode's write timer outlasts any write's flight, and it revokes the "
                  "pages' registration before it releases (a later write lands nowhere): no "
                  "write of the request is on the wire by then; decode sees only its clock",
}
CORE_ASSUMPTIONS = {"lease_lapsed": "LeaseLapsed", "bootstrap_unanswered": "BootstrapUnanswered",
                    "cancel_unanswered": "CancelUnanswered", "writes_gone": "WritesGone"}

# Writes into a variable its writer neither owns nor receives: each reaches the variable's
# owner as a message of its own (a wire variable needs no entry: it is the message).
DELIVERIES = {
    (ROUTER, "pst"): QUEUE_ENTRY,        # Arrive hands the request to its prefill's queue
    (DECODE, "ptable"): PAGE_TABLE,      # Reserve publishes the page table to the prefill
    (DECODE, "phit"): PAGE_TABLE,        # ... with the hit length decode holds cached
    (PREFILL, "client"): ANSWER,         # the serving edge keeps a client's first answer
    (DECODE, "client"): ANSWER,
}
# A wire variable -> the message it is.
WIRE_MESSAGES = {"boot": BOOTSTRAP, "fwMsg": FINAL_WORD_MSG, "fwCount": FINAL_WORD_MSG,
                 "cancel": CANCEL_MSG}
# How the router's granted variables reach a worker: with the request's first message to it
# at Arrive, and later only the client-gone notice (GRANTS says why no more is needed).
GRANT_CARRIERS = {PREFILL: QUEUE_ENTRY, DECODE: BOOTSTRAP}


def may_read(worker: str, variable: str) -> bool:
    owner = OWNERS[variable]
    if owner == worker:
        return True
    if owner == WIRE_OWNER:
        return WIRE[variable][1] == worker
    return (worker, variable) in GRANTS


def why_not(worker: str, variable: str) -> str:
    owner = OWNERS[variable]
    if owner == GHOST:
        return f"{variable} is a ghost (history for the properties)"
    if owner == WIRE_OWNER:
        sender, receiver = WIRE[variable]
        return f"{variable} is a message {sender} -> {receiver}, not addressed to the {worker}"
    return f"{variable} is the {owner}'s"


# The core's view attributes -> the spec variables they stand for (a pool is its role's).
VIEW_PARTS = {"decode_pool": ("owner", "gen", "content", "readers", "ident", "kv"),
              "prefill_pool": ("powner", "pdata", "preaders", "pident"),
              "writes": ("writes",)}
