"""The simulator's client side (spec/interfaces.py Client): the workload's clients.

The workload generator: arrivals (Poisson, bursty, closed-loop sessions, or a trace file's
rows), each request's prompt and output lengths, and client aborts as a fault; every
request enters through `Simulation.new_request` (the router places it, the runtime takes
its Arrive). A closed-loop session waits for each answer before its think time and next
request (`waiter`); an open-loop client does not wait. When a client goes away, the serving edge
tells both workers after notice_delay_s, in an order the run's seed chooses (SimPy runs
equal times in scheduling order, so the shuffle decides which notice lands first).
"""

from __future__ import annotations

import math
import random

from spec import core
from sim import fault_hits as hits
from sim.scenario import Lengths


def sample_tokens(rng: random.Random, lengths: Lengths) -> int:
    kind = lengths.distribution
    if kind == "fixed":
        value = lengths.median_tokens
    elif kind == "uniform":
        value = rng.uniform(lengths.min_tokens, lengths.max_tokens)
    elif kind == "lognormal":
        value = lengths.median_tokens * math.exp(lengths.sigma * rng.gauss(0.0, 1.0))
    else:  # pareto with the given median
        value = lengths.median_tokens / 2 ** (1 / lengths.alpha) * rng.paretovariate(lengths.alpha)
    return min(lengths.max_tokens, max(lengths.min_tokens, int(round(value))))


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

    # -- the workload -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the workload's arrival processes."""
        sim = self.sim
        if sim.trace is not None:
            sim.env.process(self.replay_trace())
        elif sim.sc.workload.arrival == "closed":
            for _ in range(min(sim.sc.workload.sessions, sim.requests_total)):
                sim.env.process(self.session())
        else:
            sim.env.process(self.open_loop())

    def lengths(self, prompt_pages: int | None, traced) -> tuple[int, int]:
        """A request's prompt and output tokens: drawn from the workload, or the prompt
        `prompt_pages` long (the fuzzer's choice), or as a trace file's row says."""
        sim = self.sim
        lengths = sim.rng["lengths"]
        prompt = sample_tokens(lengths, sim.sc.workload.prompt)
        if prompt_pages is not None:
            prompt = prompt_pages * sim.page_tokens
        output = sample_tokens(lengths, sim.sc.workload.output)
        if traced is not None:
            prompt, output = traced.prompt_tokens, max(1, traced.output_tokens)
        return prompt, output

    def output_length(self, traced) -> int:
        """A sibling's output tokens (its prompt is its first's): drawn from the workload,
        or as the trace file's row says."""
        output = sample_tokens(self.sim.rng["lengths"], self.sim.sc.workload.output)
        return max(1, traced.output_tokens) if traced is not None else output

    def may_abort(self, r: int) -> None:
        """The client-abort fault: r's client goes away at a random moment, maybe."""
        sim = self.sim
        f, rng = sim.sc.faults, sim.rng["faults"]
        if f.client_abort_probability and rng.random() < f.client_abort_probability:
            sim.later(rng.uniform(0, f.client_abort_within_s), self._abort, r)

    def _abort(self, r: int) -> None:
        sim = self.sim
        if r in sim.cluster.rows:
            hit = hits.in_transfer(sim.cluster, r)
            if sim.offer_if_enabled("Abort", r):
                sim.fault_hits.fired("ClientAbort", hit)

    def replay_trace(self):
        """Arrivals, prompts and outputs as the workload's trace file has them."""
        sim = self.sim
        for delay_s, request in sim.trace.arrivals():
            if sim.next_request >= sim.requests_total:
                return
            yield sim.env.timeout(delay_s)
            sim.new_request(traced=request, siblings=sim.siblings)

    def open_loop(self):
        sim = self.sim
        w, rng = sim.sc.workload, sim.rng["arrivals"]
        burst = w.burst_size if w.arrival == "bursty" else 1
        while sim.next_request < sim.requests_total:
            yield sim.env.timeout(rng.expovariate(w.rate_per_s / burst))
            for _ in range(burst):
                sim.new_request(siblings=sim.siblings)

    def session(self):
        sim = self.sim
        w, rng = sim.sc.workload, sim.rng["arrivals"]
        while True:
            answered = sim.new_request(siblings=sim.siblings)
            if answered is None:
                return
            yield answered
            if w.think_time_s:
                yield sim.env.timeout(rng.expovariate(1.0 / w.think_time_s))
