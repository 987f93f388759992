"""The simulator's clock (spec/interfaces.py Clock): SimPy's time, and decode's transfer
timers as leases on it.

Theory of operation. A lease is a stored time, not an event per renewal (sim/lease.py
knows each request's last sign of life from its prefill): ArmTimer schedules one SimPy
timeout at the lease's due time, and when it fires the lease is asked again — renewed
meanwhile, the timer waits for the remainder; run out, decode offers Timeout. An Admit
starts the backstop (transfer_timeout_s), which may come before the armed timer. A timer's
token is its deadline in a list, so a new timer is a new list and a cancelled or re-armed
one knows it is stale (`is`).
"""

from __future__ import annotations

from spec import core
from spec.core import PST, QUEUED, Admit, SendPage
from sim import fault_hits as hits
from sim.lease import Leases

# Simulated seconds within which a lease counts as run out when its timer fires (float
# rounding must not re-arm a timer for a remainder the clock cannot represent).
LEASE_SLACK_S = 1e-9


class SimClock:
    def __init__(self, sim) -> None:
        self.sim, self.env = sim, sim.env
        sc = sim.sc
        t = sc.timeouts
        self.backstop_s = t.transfer_timeout_s
        self.leases = Leases(t.lease_s, t.transfer_timeout_s,
                             sim.compute.prefill_chunk_s,
                             sc.cluster.prefill_workers)
        self.timers: dict[int, list] = {}  # request -> its armed transfer timer's token
        self.callbacks_pending = 0  # of the simulation's `pending`: timers, live or superseded

    def now(self) -> float:
        return self.env.now

    def arm(self, r: int) -> None:
        self.leases.armed(r, self.env.now)
        self.schedule(r, self.lease_due(r))

    def cancel(self, r: int) -> None:
        self.timers.pop(r, None)

    def renew(self, r: int, kind: type, p: int) -> None:
        """A sign of progress of r's prefill p: its lease is renewed (a stored time, no
        event); an Admit starts the backstop, which may come before the armed timer."""
        now = self.env.now
        admitted = kind is Admit
        self.leases.renew(r, p, now, admitted, kind is SendPage)
        if admitted:
            token = self.timers.get(r)
            backstop = now + self.backstop_s
            if token is not None and token[0] > backstop:
                self.schedule(r, backstop)

    def schedule(self, r: int, at: float) -> None:
        """r's timer fires at `at`; a deadline already past (the backstop of a request the
        prefill admitted before decode reserved, AdmitBeforeReserve) fires now."""
        token = self.timers[r] = [at]
        self.callbacks_pending += 1
        self.sim.later(max(at - self.env.now, 0.0), self._fired, r, token)

    def lease_due(self, r: int) -> float:
        """When r's transfer lease runs out, as decode knows it now (sim/lease.py). r waits
        at its prefill while queued for admission or for the NIC to start its writes."""
        p = self.sim.cluster.placement[r][0]
        return self.leases.due(r, p, self.env.now, self.waiting_at_prefill(r, p))

    def waiting_at_prefill(self, r: int, p: int) -> bool:
        sim = self.sim
        return sim.cluster.rows[r][PST] == QUEUED or r in sim.prefills[p].nic_waiting

    def _fired(self, r: int, token: list) -> None:
        self.callbacks_pending -= 1
        assert 0 <= self.callbacks_pending <= self.sim.pending, (
            self.callbacks_pending, self.sim.pending)
        if self.timers.get(r) is not token:
            return  # cancelled, or armed again since
        due = self.lease_due(r)
        if due > self.env.now + LEASE_SLACK_S:
            self.schedule(r, due)  # renewed meanwhile: wait for the remainder
            return
        del self.timers[r]
        sim = self.sim
        hit = hits.writes_of_request(sim.cluster, r)
        if sim.offer("Timeout", r):
            sim.fault_hits.fired("Timeout", hit)

    def forget(self, r: int) -> None:
        self.timers.pop(r, None)
        self.leases.forget(r)
