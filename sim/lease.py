"""Decode's transfer timer as a lease: it measures the prefill's silence, not its queue.

Theory of operation
-------------------
Decode arms a request's timer when it reserves pages (the core's ArmTimer). A stopwatch
from there would count the prefill's queue and compute as if they were a dead link, and
fail a healthy, fitting request behind a long queue. So the timer is a lease, with two
bounds (scenario `timeouts`):

- `lease_s`, the longest silence decode tolerates from the request's prefill. Every sign
  of progress of that prefill renews it: the request's own Admit, the start and end of its
  compute and every chunk of its prompt computed on the way (`compute.prefill_chunk_tokens`),
  each SendPage posted and LandWrite landed, its final word (SendDone, or a Reject, Abort
  or failure). While the request waits at its prefill — queued for admission, or computed
  and waiting for the NIC to start its writes — any progress of that worker renews it: the
  worker is alive and its queue moves. A crashed prefill renews nothing, so its requests
  time out `lease_s` after its last sign of life, and the cancel and the final word of the
  restarted prefill bring the pages back.
- `transfer_timeout_s`, the backstop: the longest a request's transfer may take once its
  prefill has admitted it (compute and writes), however busy the prefill looks. Queueing
  does not count: neither before the Admit nor, between its compute and its first write,
  for the NIC (the backstop stands still meanwhile, and is moved on by that wait).

Renewals are cheap: a renewal stores a time, and no SimPy event is scheduled for it. A
compute's chunks are not even stored: the last chunk boundary before now follows from when
the compute started. When the timer fires, the simulator asks `due(...)`; if progress came
meanwhile the timer is armed again for the remainder, so a request re-arms about once a
lease, not once per renewal. Renewals reach decode at once (a renewal is a small message;
the link's latency and faults are not applied to it).
"""

from __future__ import annotations

import math


class PrefillProgress:
    """What decode's leases know of one prefill worker: its last sign of life, and the
    compute it is running (request, start, end), whose chunks are signs of life too."""

    __slots__ = ("renewed_at", "computing")

    def __init__(self) -> None:
        self.renewed_at = -math.inf
        self.computing: tuple[int, float, float] | None = None


class Leases:
    """Every live request's lease: [last renewal, backstop start (its Admit, moved on by its
    wait for the NIC), NIC wait start or None], and each prefill worker's progress."""

    def __init__(self, lease_s: float, backstop_s: float, chunk_s: float, workers: int) -> None:
        assert lease_s > 0 and backstop_s > 0 and chunk_s > 0
        self.lease_s, self.backstop_s, self.chunk_s = lease_s, backstop_s, chunk_s
        self.requests: dict[int, list] = {}  # r -> [float, float, float | None]
        self.workers = [PrefillProgress() for _ in range(workers)]

    def renew(self, r: int, p: int, now: float, admitted: bool = False,
              posted: bool = False) -> None:
        """A sign of progress of r's prefill p, on r: `admitted` its Admit, `posted` a
        SendPage (the first ends r's wait for the NIC)."""
        lease = self.requests.get(r)
        if lease is None:
            lease = self.requests[r] = [now, math.inf, None]
        lease[0] = now
        if admitted:
            lease[1] = now
        elif posted and lease[2] is not None:
            lease[1] += now - lease[2]
            lease[2] = None
        self.workers[p].renewed_at = now

    def worker_progress(self, p: int, now: float) -> None:
        """A sign of life of prefill p that belongs to no one request."""
        self.workers[p].renewed_at = now

    def compute_started(self, r: int, p: int, now: float, compute_s: float) -> None:
        self.renew(r, p, now)
        self.workers[p].computing = (r, now, now + compute_s)

    def compute_ended(self, r: int, p: int, now: float) -> None:
        worker = self.workers[p]
        worker.computing = None
        worker.renewed_at = now
        lease = self.requests.get(r)
        if lease is not None:  # not if r settled meanwhile (a client abort)
            lease[0] = now
            lease[2] = now  # it waits for the NIC until its first write is posted

    def crashed(self, p: int, now: float, waiting: list[int]) -> None:
        """Prefill p died: what it did until now counts, nothing after does. Its requests
        in `waiting` (queued at it, or waiting for its NIC) keep their last renewal by its
        progress; the chunks of its compute done so far count for that request."""
        for r in waiting:
            self.requests[r][0] = self.last_renewed(r, p, now, True)
        worker = self.workers[p]
        if worker.computing is not None:
            r = worker.computing[0]
            last = self._chunk_done_at(worker.computing, now)
            worker.renewed_at = max(worker.renewed_at, last)
            if r in self.requests:
                self.requests[r][0] = max(self.requests[r][0], last)
            worker.computing = None

    def _chunk_done_at(self, computing: tuple[int, float, float], now: float) -> float:
        """When the last chunk of a running compute finished, by `now` (its start if none)."""
        _, start, end = computing
        if now >= end:
            return end
        return start + math.floor((now - start) / self.chunk_s) * self.chunk_s

    def last_renewed(self, r: int, p: int, now: float, waiting_at_worker: bool) -> float:
        """The last sign of progress of r's prefill that renews r's lease."""
        last = self.requests[r][0]
        worker = self.workers[p]
        computing = worker.computing
        if computing is not None and (waiting_at_worker or computing[0] == r):
            last = max(last, self._chunk_done_at(computing, now))
        if waiting_at_worker:
            last = max(last, worker.renewed_at)
        return last

    def due(self, r: int, p: int, now: float, waiting_at_worker: bool) -> float:
        """When r's lease runs out, as of now: `lease_s` after its last renewal, or
        `transfer_timeout_s` after its Admit, whichever comes first."""
        lease = self.requests[r]
        backstop = math.inf if lease[2] is not None else lease[1] + self.backstop_s
        return min(self.last_renewed(r, p, now, waiting_at_worker) + self.lease_s, backstop)

    def armed(self, r: int, now: float) -> None:
        """Decode armed r's timer (at Reserve): the lease runs from now."""
        lease = self.requests.get(r)
        if lease is None:
            self.requests[r] = [now, math.inf, None]
        else:  # the prefill admitted it before decode reserved (AdmitBeforeReserve)
            lease[0] = max(lease[0], now)

    def forget(self, r: int) -> None:
        self.requests.pop(r, None)
