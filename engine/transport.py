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
four methods.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from engine.pool import KVPool


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

    def ready(self) -> list[PageWrite]:
        """The writes that have reached decode since the last call, in landing order."""

    def land(self, write: PageWrite) -> int:
        """Copy the write's bytes into its decode page now; returns bytes moved."""

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
    _wire: list = field(default_factory=list)
    _arrived: list = field(default_factory=list)  # returned by ready(), not yet landed/dropped

    def __post_init__(self) -> None:
        assert self.lands_per_step >= 1
        self._rng = random.Random(self.seed) if self.seed is not None else None
        self.bytes_landed = 0
        self.writes_landed = 0

    def post(self, write: PageWrite) -> None:
        self._wire.append(write)

    def ready(self) -> list[PageWrite]:
        if self.paused or not self._wire:
            return []
        if self._rng is not None:
            self._rng.shuffle(self._wire)
        movable = [w for w in self._wire if not self.hold(w)]
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
        buffer = self.sources[write.prefill].pack([write.source_page])  # its bytes *now*
        self.targets[write.decode].unpack(buffer, [write.decode_page])
        moved = buffer.numel() * buffer.element_size()
        self.bytes_landed += moved
        self.writes_landed += 1
        return moved

    def drop(self, write: PageWrite) -> None:
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
        return [w for w in self._wire + self._arrived if w.request == request]

    def writes_of_all(self) -> list[PageWrite]:
        return self._wire + self._arrived


def page_checksum(pool: KVPool, page: int) -> int:
    """The checksum of one page's current bytes (what the sender sends with a write)."""
    pool.seal([page])
    return int(pool.checksums[page].item())

