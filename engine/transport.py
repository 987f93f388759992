"""KV transport: page writes from a prefill pool into a decode pool, landing asynchronously.

Theory of operation. The prefill posts one write per page (the core's SendPage decides it
and names source page, decode page and tag); the transport keeps it *in flight* and lands
it on a later loop iteration. A write reads its source page when it lands, not when it is
posted, as an RDMA NIC does: that is what makes freeing source pages early (SourceReuse) a
real bug here and not a modelling artefact. The checksum the prefill computed over the
source page when it posted travels with the write, so decode can verify what landed.

The transport never decides anything: `ready()` says which writes have reached the far
side; the runtime hands each to the core (LandWrite), and only when the core accepts does
`land` copy the bytes. A write the core refuses (flushed by a crash) is dropped.

`InProcessTransport` moves pages between the KVPools of one process (every prefill
worker's and every decode worker's; a write names its pair) with real tensor copies
(pack -> unpack). Ordering: by default writes land in posting order, at most
`lands_per_step` per step; with `seed` the order among in-flight writes is shuffled
(reproducibly); `paused` holds every write on the wire, which tests use to build the
interleavings of the bug zoo. A torch.distributed or NIXL transport implements the same
methods; `post_many` / `land_many` are the batch forms of `post` / `land` (here a loop; over
torch.distributed they are what moves pages at the link's rate: engine/README.md, "Across
processes").

Wire and device faults (tests and fuzzers; off unless `fault_injection`): `inject` marks
one write on the wire with a fault that strikes when it lands. FLIP: one bit of the page
flips after the copy (a bit error the link's CRC missed, a DRAM flip). TORN: only the
first half of the page's bytes is copied, the rest keeps what the decode page held (a
write cut short). DUPLICATE: the write lands, then arrives again later (a retransmission
after a lost ack). REORDER: it lands after every write on the wire when it was marked.
LOST: the sender's completion comes (the protocol's LandWrite is taken) but no byte and no
completion reaches decode (a DMA that never happened): `land` returns 0 and decode's data
path never hears of it. Each must end in a clear error for its request (the checksum, or
decode's count of pages landed against the Done's count) or in nothing at all (a
duplicate the core refuses, a reordered landing); never in a token computed from the
damage. `damaged` lists the landings whose bytes decode did not get as sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.pool import KVPool

FLIP, TORN, DUPLICATE, REORDER, LOST = "flip", "torn", "duplicate", "reorder", "lost"
WIRE_FAULTS = (FLIP, TORN, DUPLICATE, REORDER, LOST)


@dataclass(frozen=True)
class PageWrite:
    """One posted page write: the core's write tuple plus what the data path carries."""

    request: int
    source_page: int
    decode_page: int
    tag: int  # the generation decode reserved the page at (the core's write tag)
    checksum: int  # the source page's checksum at post time
    prefill: int = 0  # the prefill worker whose pool holds source_page
    decode: int = 0  # the decode worker whose pool holds decode_page


class Transport(Protocol):
    def post(self, write: PageWrite) -> None: ...

    def post_many(self, writes: list[PageWrite]) -> None:
        """Post several writes as one batch (engine/dist_transport.py: one header message
        per run of them, each write still its own entry); the same as posting each."""

    def ready(self) -> list[PageWrite]:
        """The writes that have reached decode since the last call, in landing order."""

    def land(self, write: PageWrite) -> int:
        """Copy the write's bytes into its decode page now; returns bytes moved."""

    def land_many(self, writes: list[PageWrite]) -> list[int]:
        """Land several ready writes as one batch; the bytes moved by each, as `land`
        returns them one by one (the writes land in their order; each is its own landing,
        checked on its own; engine/dist_transport.py moves their pages back to back)."""

    def drop(self, write: PageWrite) -> None:
        """Forget a write the core refused to land (a crash flushed it)."""

    @property
    def in_flight(self) -> int: ...


@dataclass
class InProcessTransport:
    sources: list[KVPool]  # the prefill workers' pools, by worker index
    targets: list[KVPool]  # the decode workers' pools, by worker index
    lands_per_step: int = 1 << 30  # writes that reach decode per `ready()` call, at most
    seed: int | None = None  # None: posting order; else a reproducible shuffle
    paused: bool = False  # tests: hold every write on the wire
    fault_injection: bool = False  # tests and fuzzers: allow `inject` (see the header)
    _wire: list = field(default_factory=list)
    _arrived: list = field(default_factory=list)  # returned by ready(), not yet landed/dropped

    def __post_init__(self) -> None:
        assert self.lands_per_step >= 1
        self._rng = random.Random(self.seed) if self.seed is not None else None
        self.bytes_landed = 0
        self.writes_landed = 0
        self._faults: dict[PageWrite, str] = {}  # on the wire: the fault it lands with
        self._behind: dict[PageWrite, frozenset] = {}  # REORDER: lands after these
        self.damaged: dict[PageWrite, str] = {}  # landed, bytes not as sent: the fault
        self._echoes: set[PageWrite] = set()  # DUPLICATE's second arrival, on the wire

    def inject(self, write: PageWrite, fault: str) -> None:
        """Mark a write on the wire with a fault that strikes when it lands."""
        assert self.fault_injection, "fault injection is off for this transport"
        assert fault in WIRE_FAULTS, f"unknown wire fault {fault!r}"
        assert write in self._wire and write not in self._faults, "one fault per write on the wire"
        self._faults[write] = fault
        if fault == REORDER:  # never behind a write that is itself behind others: no cycle
            self._behind[write] = frozenset(w for w in self._wire
                                            if w != write and w not in self._behind)

    def fault_of(self, write: PageWrite) -> str | None:
        return self._faults.get(write)

    def _reordered(self, write: PageWrite) -> bool:
        after = self._behind.get(write)
        return bool(after) and any(w in after for w in self._wire)

    def post(self, write: PageWrite) -> None:
        self._wire.append(write)

    def post_many(self, writes: list[PageWrite]) -> None:
        for write in writes:
            self.post(write)

    def ready(self) -> list[PageWrite]:
        if self.paused or not self._wire:
            return []
        if self._rng is not None:
            self._rng.shuffle(self._wire)
        movable = [w for w in self._wire if not self.hold(w) and not self._reordered(w)]
        out = movable[:self.lands_per_step]
        self._wire = [w for w in self._wire if w not in out]
        self._arrived.extend(out)
        return out

    @staticmethod
    def hold(write: PageWrite) -> bool:
        """Whether a write stays on the wire for now (a fuzzer's Delay replaces this)."""
        return False

    def ready_only(self, predicate) -> list[PageWrite]:
        """Tests: let exactly the in-flight writes matching `predicate` arrive, paused or not."""
        out = [w for w in self._wire if predicate(w)]
        self._wire = [w for w in self._wire if not predicate(w)]
        self._arrived.extend(out)
        return out

    def land(self, write: PageWrite) -> int:
        self._arrived.remove(write)
        fault = self._faults.pop(write, None)
        self._behind.pop(write, None)
        if fault == LOST:
            self.damaged[write] = fault
            return 0
        buffer = self.sources[write.prefill].pack([write.source_page])  # its bytes *now*
        target = self.targets[write.decode]
        if fault == TORN:
            torn = target.pack([write.decode_page])
            half = buffer.shape[1] // 2
            torn[:, :half] = buffer[:, :half]
            if not torch.equal(torn, buffer):
                self.damaged[write] = fault
            buffer = torn
        target.unpack(buffer, [write.decode_page])
        if fault == FLIP:
            flip_bit(target, write.decode_page)
            self.damaged[write] = fault
        elif fault == DUPLICATE:  # it arrives once more, later: no write the core posted
            self._wire.append(write)
            self._echoes.add(write)
        moved = buffer.numel() * buffer.element_size()
        self.bytes_landed += moved
        self.writes_landed += 1
        return moved

    def land_many(self, writes: list[PageWrite]) -> list[int]:
        """One copy per write, in order, each with its own fault if one was injected."""
        return [self.land(write) for write in writes]

    def drop(self, write: PageWrite) -> None:
        self._echoes.discard(write)
        self._faults.pop(write, None)
        self._behind.pop(write, None)
        if write in self._arrived:
            self._arrived.remove(write)
        elif write in self._wire:
            self._wire.remove(write)

    @property
    def in_flight(self) -> int:
        return len(self._wire) + len(self._arrived)

    def in_flight_at(self, pool: str, worker: int) -> int:
        """Writes in flight out of prefill worker `worker`'s pool or into decode's."""
        return sum(1 for w in self._wire + self._arrived
                   if (w.prefill if pool == "prefill" else w.decode) == worker)

    def writes_of(self, request: int) -> list[PageWrite]:
        return [w for w in self.writes_of_all() if w.request == request]

    def writes_of_all(self) -> list[PageWrite]:
        """The writes posted and not landed (a duplicate's second arrival is none of them:
        `in_flight` counts it, and the core refuses it when it lands)."""
        return [w for w in self._wire + self._arrived if w not in self._echoes]


def page_checksum(pool: KVPool, page: int) -> int:
    """The checksum of one page's current bytes (what the sender sends with a write)."""
    pool.seal([page])
    return int(pool.checksums[page].item())



def flip_bit(pool: KVPool, page: int) -> None:
    """Flip the sign bit of the page's first element (its first 16-bit unit for fp16/bf16,
    the second for fp32: little-endian): a finite value, and a change attention reads."""
    units = pool.kv[page].reshape(-1).view(torch.int16)
    unit = pool.kv.element_size() // 2 - 1
    units[unit] ^= torch.tensor(-32768, dtype=torch.int16, device=units.device)
