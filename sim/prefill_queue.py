"""One prefill worker's admission queue: the bootstrap queue, without scanning it.

The prefill admits queued requests in the order they were queued, but a request becomes
admissible only once decode's page table has reached the worker (the bootstrap queue:
core.admission_waits_for_table); a request the core says must be rejected can be rejected
at once. The simulator used to scan the whole FIFO on every kick, skipping requests whose
table had not arrived, and to remove entries with `deque.remove`: quadratic in the queue's
length, and under load the queue is long.

Here the queue is split by what a kick can act on: `ready`, a heap of (queue position,
request) for requests a kick may admit or reject now, and `waiting`, request -> queue
position, for those whose table has not arrived. A kick takes the ready request with the
lowest position, which is exactly the first admissible request of the old scan; a request
that left the Queued state meanwhile (aborted, crashed) is dropped when it comes up.
"""

from __future__ import annotations

from heapq import heappop, heappush


class PrefillQueue:
    __slots__ = ("ready", "waiting", "next_position")

    def __init__(self) -> None:
        self.ready: list[tuple[int, int]] = []   # heap of (queue position, request)
        self.waiting: dict[int, int] = {}        # request -> queue position
        self.next_position = 0

    def __len__(self) -> int:
        """Requests queued here and not yet taken or dropped (the router's load figure)."""
        return len(self.ready) + len(self.waiting)

    def add(self, r: int, ready: bool) -> None:
        """Queue r at the tail: ready now (a kick may admit or reject it), or once its
        page table arrives (`table_arrived`)."""
        position = self.next_position
        self.next_position += 1
        if ready:
            heappush(self.ready, (position, r))
        else:
            self.waiting[r] = position

    def table_arrived(self, r: int) -> None:
        """Decode's page table for r reached this worker: r keeps its place in the queue."""
        position = self.waiting.pop(r, None)
        if position is not None:
            heappush(self.ready, (position, r))

    def first(self) -> int | None:
        """The ready request with the lowest queue position, left in the queue."""
        return self.ready[0][1] if self.ready else None

    def take(self) -> tuple[int, int]:
        """Remove and return the first ready entry (position, request)."""
        return heappop(self.ready)

    def put_back(self, entries: list[tuple[int, int]]) -> None:
        """Entries taken out to look past them, back at their positions."""
        for entry in entries:
            heappush(self.ready, entry)

    def forget(self, r: int) -> None:
        """r settled: drop it if it still waits for its table (ready entries go lazily)."""
        self.waiting.pop(r, None)
