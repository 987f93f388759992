"""What a world must provide to the one runtime (spec/runtime.py): small interfaces, each
with a simulated implementation (sim/) and a real one (engine/).

The runtime calls these and nothing else of a world. Every method is called with the
request's placement already known (p: its prefill worker, d: its decode worker), inside the
runtime's carrying-out of one decision; a method never changes protocol state itself: what
it starts reports back later as an event through `take_event`.

    interface        simulated (sim/)                       real (engine/)
    Clock            SimClock: SimPy's time, leases as       WallClock: the wall (or a test's)
                     SimPy timeouts (sim/clock.py)           clock, leases polled (engine/adapters.py)
    PrefillWorker    SimPrefill: modelled compute on         EnginePrefill: the model's chunked
                     abstract pages, a modelled NIC          prefill on a real pool
                     (sim/workers.py)                        (engine/adapters.py, engine/workers.py)
    DecodeWorker     SimDecode: modelled continuous          EngineDecode: the model's batched
                     batching (sim/workers.py)               decode on a real pool
    Transport        SimLink: latency, loss, delay,          InProcessMessages: messages as the
                     restarts (sim/link.py); page writes     requests' wants, page writes through
                     timed by the prefill's NIC              engine/transport.py
    Client           SimClients: a workload's sessions       ServingClients: the serving edge's
                     (sim/clients.py)                        callbacks (HTTP, a test)

The runtime holds them as `clock`, `prefill_at[p]`, `decode_at[d]`, `link` and `client`. A
new worker kind implements PrefillWorker or DecodeWorker and is put in `prefill_at` /
`decode_at` at its index; a new transport implements Transport (messages) as `link`, and
is what the prefill worker's `post` hands page writes to. Nothing in spec/runtime.py changes.
A hybrid run does exactly that: sim/hybrid.py's RealPrefill / RealDecode (simulated workers
with the engine's data path, fuzz/hybrid.py) take the places of the scenario's real ones.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    """What time it is, and decode's transfer timers (leases) on that time."""

    def now(self) -> float:
        """Seconds since the run started: the time every logged event carries."""

    def arm(self, r: int) -> None:
        """ArmTimer: r's transfer lease starts (it lapses as a Timeout event)."""

    def cancel(self, r: int) -> None:
        """CancelTimer: r's lease must not fire any more."""

    def renew(self, r: int, kind: type, p: int) -> None:
        """A sign of progress of r's prefill p (an event of core.LEASE_RENEWALS, `kind`):
        r's lease runs from now again (an Admit starts the backstop too)."""


class PrefillWorker(Protocol):
    """One prefill worker: its admission queue, its compute and its NIC."""

    def queue_request(self, r: int) -> None:
        """Queue: r waits for admission (the worker offers Admit or Reject later)."""

    def compute(self, r: int) -> None:
        """Compute: compute r's prompt into the source pages it was admitted with; when it
        is done, the worker posts r's pages (SendPage)."""

    def post(self, write: tuple, d: int) -> None:
        """Post: put one page write (request, source page, decode page, tag) for decode
        worker d on the transport; it lands later (LandWrite)."""

    def pages_freed(self, r: int) -> None:
        """FreePages: some of this worker's source pages came back (r's)."""


class DecodeWorker(Protocol):
    """One decode worker: its reservations and its continuous batch."""

    def start_decoding(self, r: int) -> None:
        """StartDecoding: r joins the batch (its last token ends in Finish)."""

    def stop_decoding(self, r: int) -> None:
        """StopDecoding: r leaves the batch without a Finish."""

    def pages_freed(self, r: int) -> None:
        """FreePages: some of this worker's pages came back: waiting bootstraps may
        reserve."""


class Transport(Protocol):
    """The messages between the router, the prefill and the decode workers."""

    def send(self, r: int, message: str, p: int, d: int) -> None:
        """Send: deliver `message` of r (bootstrap, final word, cancel, page table) to its
        worker, which then takes the action the core names for it (core.consumer)."""


class Client(Protocol):
    """The client side: who made the requests and waits for their answers."""

    def answer(self, r: int, outcome: str) -> None:
        """Answer: r's client has its final answer (Ok or an error), exactly once."""

    def gone(self, r: int, p: int, d: int) -> None:
        """Send(client gone): r's client went away; the serving edge tells both workers."""
