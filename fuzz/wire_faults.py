"""Wire and device faults as fuzz moves on the engine target, and the oracle they answer to.

Theory of operation. The engine's transport (engine/transport.py) has a fault hook, off
unless a test or this module turns it on: `inject` marks one write on the wire with a fault
that strikes when it lands (a bit flipped, a torn write, a duplicate, a reordered landing,
a write that never lands; the transport's header says what each does to the bytes). Here
each becomes one move of the fuzzer's vocabulary, `WireFault(request, page, fault)`: the
target lists one per fault for every write on the wire that has none yet, and the swarm
weighs the action like any other fault (off, rare, or a storm).

What must follow. A fault that damaged a landing (the transport's `damaged`: the bytes
decode got are not the bytes sent, or none came) must end its request in a clear error
before decode reads a byte of it: decode's data path verifies the transfer at Accept (the
page checksums, and its own count of pages landed against the Done's count), so a damaged
request never decodes and never gets Ok. The oracle judges every committed change (a
decode that starts and fails its tag check within one engine step is still a decode that
started) and `check` reports one that starts decoding or answers Ok, under Isolation (it
would read content that is not its own), with the fault named. A duplicate or a
reordered landing damages nothing: the core refuses the second landing and order is not
a fault; those must end as if nothing happened, which every other check already judges.

The damaged request's own error is not a guard tripping without cause: `excused` hands
the properties that say so (NoGuardTripWithoutFault, FittingRequestsSucceed) a state in
which that request's ErrTransfer or ErrTag reads as a fault's outcome; every other request
is judged as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec import core
from spec.properties import Violation

ACTION = "WireFault"
# The transport's fault names, in engine/transport.py's WIRE_FAULTS order (the event
# carries the index, as replays take integer fields only); pinned by tests/test_wire_faults.py.
FAULT_NAMES = ("flip", "torn", "duplicate", "reorder", "lost")
LOST = FAULT_NAMES.index("lost")
# Switches under which a write can land after its page moved on (decode released the page
# with the write in flight). The core's page contents are the oracle, and its LandWrite
# says the write's bytes are in the page; a lost write's are not, so a lost *stale* write
# would leave the contents saying the next owner's page holds foreign data while its bytes
# and tag are its own (a false alarm). Without these switches no landing is stale, and a
# lost write is offered; with them it is not (fuzz/README.md, Limits).
STALE_WRITE_BUGS = frozenset({"EagerRelease"})


@dataclass(frozen=True, slots=True)
class WireFault(core.RequestEvent):
    """The request's write into decode page `page`, on the wire now, lands with a fault
    (an environment move, not a core action)."""

    page: int
    fault: int  # index into FAULT_NAMES

    def label(self, m=None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        return f"WireFault({name}, page {self.page + 1}, {FAULT_NAMES[self.fault]})"


MOVE_TYPES = {ACTION: WireFault}


class WireFaults:
    """The engine target's wire faults: its moves, their injection and their oracle."""

    def __init__(self, runtime) -> None:
        from engine.transport import WIRE_FAULTS

        assert WIRE_FAULTS == FAULT_NAMES, "fuzz/wire_faults.py FAULT_NAMES is stale"
        self.transport = runtime.transport
        self.transport.fault_injection = True
        self.offered = tuple(k for k in range(len(FAULT_NAMES))
                             if k != LOST or not STALE_WRITE_BUGS & runtime.config.bugs)
        self.findings: list[Violation] = []
        inner = runtime.on_commit  # judged at every commit: a decode may start and fail
        assert inner is not None   # its tag check within one engine step

        def on_commit(event, change) -> None:
            self._judge(change)
            inner(event, change)
        runtime.on_commit = on_commit

    def moves(self) -> dict[str, list]:
        transport = self.transport
        moves = [WireFault(w.request, w.decode_page, k)
                 for w in transport.writes_of_all() if transport.fault_of(w) is None
                 for k in self.offered]
        return {ACTION: moves} if moves else {}

    def inject(self, event: WireFault) -> None:
        write, = (w for w in self.transport.writes_of_all()
                  if w.request == event.request and w.decode_page == event.page)
        self.transport.inject(write, FAULT_NAMES[event.fault])

    def damaged(self) -> frozenset[int]:
        """The requests one of whose landings a fault damaged."""
        return frozenset(w.request for w in self.transport.damaged)

    def _judge(self, change: core.Change) -> None:
        """A committed change that starts decoding (or answers Ok) for a request over a
        page one of its writes landed damaged in is a finding."""
        for r, row in change.rows:
            decodes = row[core.DST] == core.DECODING or row[core.CLIENT] == core.OK
            if not decodes:
                continue
            for write, fault in self.transport.damaged.items():
                if write.request == r and any(p == write.decode_page
                                              for p, _ in row[core.TABLE]):
                    self.findings.append(Violation("Isolation", (
                        f"wire-fault oracle: r{r + 1} "
                        f"{'got Ok' if row[core.CLIENT] == core.OK else 'started decoding'} "
                        f"over decode page {write.decode_page + 1}, whose write landed "
                        f"{fault} (no check of the transfer stopped it)")))
                    return

    def check(self) -> list[Violation]:
        return list(self.findings)


_GUARD_ERRORS = (core.ERR_TRANSFER, core.ERR_TAG)


def excused(s: core.State, requests: frozenset[int]) -> core.State:
    """`s` with the guard errors of `requests` (damaged on the wire) read as a fault's
    outcome (ErrPrefill), for the properties that judge guard trips and failures."""
    if not requests:
        return s
    rows = list(s.requests)
    for r in requests:
        row = rows[r]
        if row[core.CLIENT] in _GUARD_ERRORS:
            rows[r] = row[:core.CLIENT] + (core.ERR_PREFILL,) + row[core.CLIENT + 1:]
    return s._replace(requests=tuple(rows))
