"""The simulator's client side (shell/interfaces.py Client): the workload's clients.

A closed-loop session waits for each answer before its think time and next request
(`waiter`); an open-loop client does not wait. When a client goes away, the serving edge
tells both workers after notice_delay_s, in an order the run's seed chooses (SimPy runs
equal times in scheduling order, so the shuffle decides which notice lands first).
"""

from __future__ import annotations

from spec import core


class SimClients:
    def __init__(self, sim) -> None:
        self.sim = sim
        self.waiters = {}  # request -> the SimPy event its session waits on

    def waiter(self, r: int):
        answered = self.waiters[r] = self.sim.env.event()
        return answered

    def answer(self, r: int, outcome: str) -> None:
        self.answered(r)

    def gone(self, r: int, p: int, d: int) -> None:
        sim = self.sim
        notice_s = sim.sc.timeouts.notice_delay_s
        notices = [(sim.want, r, "prefill", core.CLIENT_GONE), (sim.offer_decode_abort, r)]
        sim.rng["reactions"].shuffle(notices)
        for notice in notices:
            sim.later(notice_s, *notice)
        self.answered(r)  # a closed-loop session moves on either way

    def answered(self, r: int) -> None:
        waiter = self.waiters.pop(r, None)
        if waiter is not None:
            waiter.succeed()
