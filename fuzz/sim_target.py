"""The simulator as a fuzz target: real simulated timing, with faults at chosen moments.

On the core target the fuzzer picks every protocol event. Here it does not: the simulator's
components take the protocol's own actions, as they would in a deployment, with their
queues, allocator, NIC (bounded writes in flight, serialised bandwidth), message latency,
loss and retransmission, restart delays, continuous batching and transfer timers. What the
rules drive is the environment:

- `Arrive`: a client sends a request now, with the prompt length the fuzzer picks;
- `Abort`, `PrefillFail`: a client disconnects, a prefill fails on a request, now; or the
  client disconnects late in the last decode step of its answer (`MidStep`: a Wait never
  stops inside a decode, whose steps commit nothing until the Finish);
- `PrefillCrash`, `DecodeCrash`: a worker dies now and restarts after its restart delay;
- `Timeout`: a request's transfer timer fires now, early (as if the timeout were this
  short); the simulator's own timer still fires at its time and the core refuses it then;
- `Delay`: everything of a request on the wire (writes, messages) is held back for a stall
  the fuzzer picks, in milliseconds: delayed and reordered delivery, at a chosen moment, by
  a chosen amount;
- `Evict`, `PrefillEvict`: with a prefix cache, decode's (with the prefill's cache too, a
  prefill's) cache forgets a page it may evict now, besides the simulator's own LRU
  evictions under pool pressure;
- `Wait`: simulated time passes until the simulator has committed at least one protocol
  event. Faults and arrivals land between any two protocol events, so the fuzzer chooses
  the moment of each one, which is what a fault-rate knob of a scenario cannot do.

Each fault is enabled exactly when the core accepts it in the current state (Wait: when the
simulator has anything scheduled; Delay: when the request has something on the wire).
Delivery is also delayed and reordered by the simulator's own link faults, whose rates this
target draws per example from its seed (printed with every failure, as `describe()`).

The cluster is one or two prefill workers (the example's prefill pool split between them,
each with its own NIC) and one decode worker with the example's decode pool. The protocol
state is the core's State for the example's model, the prefill pools side by side, so every
property of spec/properties.py reads it unchanged; the simulator's own oracles, which know
each worker's pool, report through `check`. Settled rows are kept (the cluster forgets them
in long runs). Observations are the simulator's own bookkeeping: a page is free when the
allocator's free stack has it, a request holds what its row names, and a request's reads
are taken from the pages' canaries when the simulator commits its Finish.

The target is quiet (fuzz/oracles.py) when all the simulator has scheduled is transfer
timers. And it audits the simulator's own counters against the core's state after every
move (`_audit`; fuzz/README.md lists what, and when a refused landing has raced).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from spec import core
from spec.core import CLIENT_NAMES, DATA, OWNER, PST, RUNNING, SRC, TABLE
from spec.model import Model
from spec.properties import holds_decode_pages
from sim.decode_batch import JOINED, WANTED
from sim.run import Simulation
from sim.scenario import Scenario

from fuzz.target import (AtWorker, Delay, MidStep, Observation, Open, PoolView, Target,
                         TargetRefused, Violation, Wait, decoding_reads, expected_reads, listed,
                         owned_pages, owned_sources, read_field, register)

PAGE_TOKENS = 16
# SimPy steps one Wait may take before it must have committed a protocol event: the
# simulator only schedules work that ends in one (a decode step, a delivery, a landing).
SIM_STEPS_PER_WAIT_MAX = 100_000
_REQUEST_FAULTS = (core.Abort, core.PrefillFail, core.Timeout)
# The stalls a Delay may choose, in milliseconds: from a fraction of one page's transfer to
# longer than most decodes (a late write must land while the page's next owner decodes).
STALLS_MS = (1, 2, 5, 10, 20, 50, 200)
# Where a client's Abort may land: now (0, the plain Abort), or in the last decode step of
# its answer, this many thousandths of the way into it: halfway, or so late that decode's
# notice that the client has gone (notice_delay_s, about a step) arrives after the step's
# Finish. A Wait passes over the steps of a decode (they commit no protocol event until
# the Finish), so "now" is never late in the answer's last step.
MID_STEP_PERMILLE = (0, 500, 900, 990)

# The simulator's timing and link faults, drawn per example from the target's seed: each
# a list of choices, the first the plain one. Transfers take about a millisecond a page, so
# timeouts and delays are of the same order as a transfer.
TIMING = {
    # Two prefill workers send over two NICs, whose writes into one decode pool land in
    # any order; one NIC completes its writes in the order it posted them.
    "prefill_workers": (2, 1),
    "router": ("round-robin", "least-loaded"),
    "message_delay_probability": (0.0, 0.3, 0.8),
    "message_delay_mean_s": (0.001, 0.02),
    "message_loss_probability": (0.0, 0.2),
    "slow_link_probability": (0.0, 0.2),
    "writes_in_flight_max": (4, 1, 16),
    "transfer_timeout_s": (1.0, 0.02, 0.005),
    "decode_batch_max": (8, 1),
    "output_tokens_max": (4, 32),
    "restart_s": (0.01, 0.0, 0.1),
}


def scenario_for(model: Model, seed: int) -> tuple[Scenario, Model, dict]:
    """The simulator's scenario for one example, and the core's model for one worker pair:
    the model's prefill pool split between the prefill workers, its decode pool on one
    decode worker; no random faults of the simulator's own (the rules inject them);
    timing drawn from seed."""
    rng = random.Random(f"kvproof-fuzz-sim:{seed}")
    t = {name: rng.choice(choices) for name, choices in TIMING.items()}
    workers = min(t["prefill_workers"], model.prefill_pages)
    t["prefill_workers"] = workers
    pair = replace(model, prefill_pages=model.prefill_pages // workers)
    tokens = PAGE_TOKENS
    scenario = Scenario(
        name="fuzz", seed=seed, requests=model.requests, bugs=tuple(sorted(model.bugs)),
        cluster=dict(prefill_workers=workers, decode_workers=1, page_tokens=tokens,
                     prefill_pool_tokens=pair.prefill_pages * tokens, router=t["router"],
                     decode_pool_tokens=model.decode_pages * tokens,
                     context_tokens=model.context_pages * tokens,
                     decode_batch_max=t["decode_batch_max"]),
        workload=dict(prompt=dict(distribution="uniform", min_tokens=1,
                                  max_tokens=model.max_prompt_pages * tokens),
                      output=dict(distribution="uniform", min_tokens=1,
                                  max_tokens=t["output_tokens_max"])),
        compute=dict(prefill_tokens_per_s=tokens * 2000.0, decode_step_base_s=0.001),
        # 655 KB a page at 1 GB/s: about 0.66 ms a page.
        link=dict(message_latency_s=0.0005, bandwidth_bytes_per_s=1e9,
                  writes_in_flight_max=t["writes_in_flight_max"]),
        # The lease as tight as the backstop: a timer fires no earlier than the stopwatch
        # from Reserve did, and timeouts still race the transfer (sim/lease.py).
        timeouts=dict(lease_s=t["transfer_timeout_s"], transfer_timeout_s=t["transfer_timeout_s"],
                      notice_delay_s=0.001),
        faults=dict(message_delay_probability=t["message_delay_probability"],
                    message_delay_mean_s=t["message_delay_mean_s"],
                    message_loss_probability=t["message_loss_probability"],
                    retransmit_after_s=0.005,
                    slow_link_probability=t["slow_link_probability"], slow_link_factor=50.0,
                    prefill_restart_s=t["restart_s"], decode_restart_s=t["restart_s"]),
        oracles=dict(on_violation="count"))
    return scenario, pair, t


@register("sim")
class SimTarget(Target):
    # Evict: with a prefix cache, the fuzzer may make decode forget any idle cached page
    # now (the simulator's own LRU evicts under pool pressure besides).
    vocabulary = frozenset({"Arrive", "Abort", "PrefillFail", "Timeout", "PrefillCrash",
                            "DecodeCrash", "Wait", "Delay", "Evict"})
    # PrefillEvict: with the prefill's cache too, the fuzzer may make a prefill forget any
    # cached page its cache may evict now (Store.prefill_evictable: the core says which;
    # EvictWhileSending's cache picks pages still read or sent from).
    prefill_cache_vocabulary = frozenset({"PrefillEvict"})

    def reset(self, model: Model, seed: int) -> None:
        self.model = model
        self.scenario, pair, self.timing = self.scenario_for(model, seed)
        self.sim = self.simulation(self.scenario, pair)
        self.sim.on_refusal = self._refused
        self.cluster = self.sim.cluster
        self.workers = self.timing["prefill_workers"]
        self.prefill_pages = pair.prefill_pages  # per worker
        self._pair = pair
        self.cluster.settled_rows = {}
        self._trace: list[core.Event] = []
        self._story: list[str] = []    # what the simulator did, with simulated times
        self._committed_events: list[core.Event] = []  # every event the core accepted
        self._reads: dict[int, tuple[int, ...]] = {}
        self._prefill_of: dict[int, int] = {}  # request -> its prefill worker
        self._prompts = tuple(range(1, model.max_prompt_pages + 1))
        self._moves: dict | None = None
        self._state: core.State | None = None
        # The audit of the simulator's own bookkeeping (`check`): writes a decode crash
        # flushed while they were on a NIC, whose landing the core refuses (raced), and per
        # prefill worker how many such writes its NIC may still carry; refusals nothing
        # raced.
        self._flushed: Counter = Counter()  # (prefill worker, request, decode page) -> how many
        self._flushed_on_nic = [0] * self.workers
        self._unraced: list[str] = []

    def scenario_for(self, model: Model, seed: int) -> tuple[Scenario, Model, dict]:
        """The example's scenario (the hybrid target, fuzz/hybrid.py, makes workers real)."""
        return scenario_for(model, seed)

    def simulation(self, scenario: Scenario, pair: Model) -> Simulation:
        return Simulation(scenario, model=pair, on_commit=self._committed)

    def pair_model(self) -> Model:
        return self._pair

    def holding(self) -> bool:
        now = self.sim.env.now
        return any(until > now for until in self.sim.held_until.values())

    def describe(self) -> str:
        return "simulator: " + ", ".join(f"{k} {v}" for k, v in self.timing.items())

    # -- moves ----------------------------------------------------------------------------

    def enabled(self) -> dict[str, list]:
        """The environment's moves. An action's moves are listed by request, that is in
        arrival order, which is the order most of them became enabled in."""
        if self._moves is None:
            self._moves = self._list_moves()
        return self._moves

    def _list_moves(self) -> dict[str, list]:
        sim, m = self.sim, self.model
        moves: dict[str, list] = {}
        if sim.next_request < m.requests:
            moves["Arrive"] = [Open("Arrive", sim.next_request, 0, self._prompts)]
        on_wire = {w[0] for w in self.cluster.writes_into[0]}
        for r in sorted(self.cluster.rows):
            for cls in _REQUEST_FAULTS:
                event = cls(r)
                if type(self.cluster.decide(r, event)) is not core.Refusal:
                    if cls is core.Abort:
                        event = Open("Abort", r, 0, MID_STEP_PERMILLE)
                    moves.setdefault(cls.__name__, []).append(event)
            row = self.cluster.rows[r]
            if (r in on_wire or core.message_in_flight(row)) \
                    and sim.held_until.get(r, 0.0) <= sim.env.now:
                moves.setdefault("Delay", []).append(Open("Delay", r, 0, STALLS_MS))
        for p in range(self.workers):
            if type(self.cluster.decide_crash("prefill", p)) is not core.Refusal:
                moves.setdefault("PrefillCrash", []).append(AtWorker(core.PrefillCrash(), p))
        if type(self.cluster.decide_crash("decode", 0)) is not core.Refusal:
            moves["DecodeCrash"] = [AtWorker(core.DecodeCrash(), 0)]
        if m.prefix_cache and self.cluster.idle_cached(0):
            moves["Evict"] = [core.Evict(0, p) for p in self.cluster.idle_cached(0)]
        if m.prefill_cache:  # named in the model's one prefill pool, the workers' side by side
            pp = self.prefill_pages
            evictions = [core.PrefillEvict(0, page + q * pp) for q in range(self.workers)
                         for page in self.cluster.prefill_evictable(q)]
            if evictions:
                moves["PrefillEvict"] = evictions
        if sim.env.peek() != float("inf"):
            moves["Wait"] = [Wait()]
        return moves

    def _in_last_step(self, r: int) -> bool:
        """Whether r's answer ends with the decode step under way (r joined the batch at
        step JOINED and needs WANTED steps)."""
        sequence, batch = self.sim.decoding.get(r), self.sim.decodes[0].batch
        return (sequence is not None and sequence[JOINED] is not None and batch.stepping
                and batch.steps + 1 == sequence[JOINED] + max(1, sequence[WANTED]))

    def _abort_in_last_step(self, event: MidStep) -> None:
        """Time passes until r's last decode step is under way, then `at_permille`
        thousandths of the way from then (or from now, if it is under way already) to the
        step's end the client disconnects. If r's client had its answer first (r never
        decoded, or stopped), the abort does not happen; if the simulator runs out of work
        first, the client disconnects then."""
        sim, r = self.sim, event.request
        for _ in range(SIM_STEPS_PER_WAIT_MAX):
            if self._in_last_step(r) or self._answered(r) or sim.env.peek() == float("inf"):
                break
            sim.env.step()
        else:
            raise AssertionError(f"the simulator ran {SIM_STEPS_PER_WAIT_MAX} steps before "
                                 f"{event.label(self.model)}'s last decode step")
        if self._in_last_step(r):
            now, ends = sim.env.now, sim.decodes[0].batch.step_ends_s
            self._run_until(now + (ends - now) * event.at_permille / 1000)
        sim.offer_if_enabled("Abort", r)  # if its client still waits

    def _answered(self, r: int) -> bool:
        row = self.cluster.rows.get(r)
        return row is None or row[core.CLIENT] != core.WAITING

    def step(self, event: core.Event) -> None:
        moves = self.enabled().get(event.action, ())
        if not listed(event, moves):
            raise TargetRefused(f"{event} is not enabled in the simulator now")
        self._trace.append(event)
        self._moves = self._state = None
        sim, cls = self.sim, type(event)
        self._story.append(f"{'':12}fuzzer: {event.label(self.model)}")
        if cls is Wait:
            self._wait()
        elif cls is core.Arrive:
            sim.new_request(prompt_pages=event.prompt_pages, tokens=event.tokens,
                            salt=event.salt)
        elif cls is core.Evict:
            if not sim.evict(event.worker, event.page):
                raise TargetRefused(f"the core refused {event.label(self.model)}, listed")
            sim.decodes[event.worker].kick_waiting()  # a page came free
        elif cls is core.PrefillEvict:
            q, page = divmod(event.page, self.prefill_pages)
            if not sim.prefill_evict(q, page):
                raise TargetRefused(f"the core refused {event.label(self.model)}, listed")
            sim.prefills[q].kick()  # a page may have come free
        elif cls is Delay:
            sim.hold(event.request, event.stall / 1000)
        elif cls is MidStep:
            self._abort_in_last_step(event)
        elif cls is AtWorker:
            kind = "prefill" if type(event.event) is core.PrefillCrash else "decode"
            self._committed_events.append(event.event)  # listed: the core accepts it
            SimTarget.events_committed += 1
            self._note(event.label(self.model))
            self._crash(kind, event.worker)
        else:
            sim.offer(event.action, event.request)

    def _run_until(self, at: float) -> None:
        """Simulated time passes until `at`: everything scheduled before then happens."""
        env = self.sim.env
        for _ in range(SIM_STEPS_PER_WAIT_MAX):
            if env.peek() >= at:
                if at > env.now:
                    env.run(until=at)  # SimPy's stop comes before anything due at `at`
                return
            env.step()
        raise AssertionError(f"the simulator ran {SIM_STEPS_PER_WAIT_MAX} steps in "
                             f"{(at - env.now) * 1000:g} ms: a component is spinning")

    def _crash(self, kind: str, worker: int) -> None:
        """A worker crash, and what it flushed: a decode crash leaves the writes it flushed
        on their NICs (the core refuses their landing: raced); a prefill's restarted NIC
        carries nothing, whatever an earlier decode crash left on it."""
        before = Counter(self._writes_by_worker())
        self.sim.crash(kind, worker)
        flushed = before - Counter(self._writes_by_worker())
        if kind == "prefill":
            self._flushed_on_nic[worker] = 0
            for key in [key for key in self._flushed if key[0] == worker]:
                del self._flushed[key]
            return
        self._flushed += flushed
        for (p, _, _), n in flushed.items():
            self._flushed_on_nic[p] += n

    def _writes_by_worker(self) -> list[tuple[int, int, int]]:
        """The core's writes in flight, as (prefill worker, request, decode page)."""
        return [(self._placed(w[0]), w[0], w[2]) for w in self.cluster.writes_into[0]]

    def _refused(self, refusal: core.Refusal) -> None:
        """A refusal the simulator counted. A landing is refused because it raced exactly
        when a decode crash flushed that write from the core while it was on the NIC; any
        other refused landing means the simulator landed a write the core never had in
        flight (twice, or one it never posted): a finding."""
        event = refusal.event
        if type(event) is not core.LandWrite:
            return
        key = (self._placed(event.request), event.request, event.page)
        if self._flushed[key]:
            self._flushed[key] -= 1
            self._flushed_on_nic[key[0]] -= 1
            return
        self._unraced.append(f"at {self.sim.env.now * 1000:.3f} ms the core refused "
                             f"{event.label(self.model)}, which no crash raced: "
                             f"{refusal.reason}")

    def _wait(self) -> None:
        sim, events = self.sim, self.sim.folder.events
        for _ in range(SIM_STEPS_PER_WAIT_MAX):
            if sim.folder.events != events or sim.env.peek() == float("inf"):
                return
            sim.env.step()
        raise AssertionError(f"the simulator ran {SIM_STEPS_PER_WAIT_MAX} steps without a "
                             "protocol event: a component is spinning")

    def _committed(self, event: core.Event, change: core.Change) -> None:
        if type(event) is core.PrefillEvict:  # a page of the model's one prefill pool
            event = core.PrefillEvict(0, event.page + event.worker * self.prefill_pages)
        elif type(event) is core.Arrive:
            self._prefill_of[event.request] = event.prefill_worker  # the router's placement
        SimTarget.events_committed += 1
        self._committed_events.append(event)
        self._note(event.label(self.model))
        if type(event) is core.Finish:
            r = event.request
            row, pool = self.cluster.rows[r], self.cluster.decode_pools[0]
            read = read_field(self.model)
            self._reads[r] = tuple(pool[page][read] for page, _ in row[TABLE])

    def _note(self, what: str) -> None:
        self._story.append(f"{self.sim.env.now * 1000:9.3f} ms  {what}")

    # -- what the fuzzer checks -------------------------------------------------------------

    def _rows(self) -> tuple:
        rows, settled = self.cluster.rows, self.cluster.settled_rows
        return tuple(rows.get(r) or settled.get(r) or core.EMPTY_ROW
                     for r in range(self.model.requests))

    def _placed(self, r: int) -> int:
        """The prefill worker of request r: where it was placed, kept after it settled (a
        settled request holds no prefill page, but with the prefill's cache its sources
        still say what the pages it computed hold, the spec's SourceIdent)."""
        return self._prefill_of.get(r, 0)

    def _flat_rows(self) -> tuple:
        """Rows with source pages numbered across the prefill workers' pools, side by side:
        the model's one prefill pool, split between the workers (so every placed row is on
        the model's one prefill worker, PW 0)."""
        pp, rows = self.prefill_pages, self._rows()
        return tuple(_on_worker_zero(row) if not row[SRC] else
                     _on_worker_zero(row[:SRC] + (tuple(x + self._placed(r) * pp
                                                        for x in row[SRC]),) + row[SRC + 1:])
                     for r, row in enumerate(rows))

    def protocol_state(self) -> core.State:
        """Built once per step: the checks read it, and observe() its rows."""
        if self._state is None:
            c, pp = self.cluster, self.prefill_pages
            prefill = tuple(page for pool in c.prefill_pools for page in pool)
            writes = tuple(sorted((r, s + self._placed(r) * pp, t, tag)
                                  for r, s, t, tag in c.writes_into[0]))
            self._state = core.State(self._flat_rows(), tuple(c.decode_pools[0]), prefill,
                                     writes)
        return self._state

    def observe(self) -> Observation:
        c, rows, pp = self.cluster, self.protocol_state().requests, self.prefill_pages
        decode_free = set(c.decode_free[0])
        prefill_free = {x + p * pp for p, free in enumerate(c.prefill_free) for x in free}
        prefill_pool = tuple(page for pool in c.prefill_pools for page in pool)
        decode = PoolView(
            "decode", tuple(core.NONE if p in decode_free else page[OWNER]
                            for p, page in enumerate(c.decode_pools[0])),
            tuple(owned_pages(row, c.decode_pools[0], r) if holds_decode_pages(row) else ()
                  for r, row in enumerate(rows)))
        prefill = PoolView(
            "prefill", tuple(core.NONE if p in prefill_free else page[0]
                             for p, page in enumerate(prefill_pool)),
            tuple(owned_sources(row, prefill_pool, r) if row[PST] == RUNNING else ()
                  for r, row in enumerate(rows)))
        return Observation(
            pools=(prefill, decode), writes=tuple((w[0], w[2]) for w in c.writes_into[0]),
            outcomes=tuple(CLIENT_NAMES[row[core.CLIENT]] for row in rows),
            reads=dict(self._reads),
            decoding=decoding_reads(rows, c.decode_pools[0], self.model),
            expected=expected_reads(self.model, rows))

    def check(self) -> list[Violation]:
        """The simulator's own runtime oracles (spec/store.py), which watch every commit;
        first the audit of the simulator's own bookkeeping, whose failure is a crashed
        shell (an AssertionError: the fuzzer reports it as ShellCrash, whatever properties
        the campaign checks)."""
        self._audit()
        return [Violation(v.property, f"simulator oracle: {v.detail}") for v in self.cluster.violations]

    def only_timers_pending(self) -> bool:
        """Every callback the simulator still has scheduled is a transfer timer (live, or
        superseded and about to do nothing): only a timer could move the protocol on."""
        return self.sim.pending == self.sim.timer_callbacks_pending

    def _audit(self) -> None:
        """The simulator's counters against the core's state, each bound asserted
        (TIGER_STYLE: a counter is paired with its assertion)."""
        sim = self.sim
        assert not self._unraced, "; ".join(self._unraced)
        assert 0 <= sim.timer_callbacks_pending <= sim.pending, (
            f"{sim.timer_callbacks_pending} transfer timers pending of {sim.pending} callbacks")
        writes = self._writes_by_worker()
        core_writes = Counter(p for p, _, _ in writes)
        for r, n in Counter(r for _, r, _ in writes).items():
            assert sim.nic_pending.get(r, 0) >= n, (
                f"the NIC counts {sim.nic_pending.get(r, 0)} writes of request {r + 1} "
                f"pending; the core has {n} in flight")
        limit = self.scenario.link.writes_in_flight_max
        for p in range(self.workers):
            in_flight = sim.prefills[p].nic_in_flight
            on_nic = in_flight + len(sim.prefills[p].nic_posted)
            assert 0 <= in_flight <= limit, (
                f"prefill {p + 1}'s NIC has {in_flight} writes in flight (at most {limit})")
            assert core_writes[p] <= on_nic <= core_writes[p] + self._flushed_on_nic[p], (
                f"prefill {p + 1}'s NIC carries {on_nic} writes; the core has "
                f"{core_writes[p]} of its requests in flight, and a decode crash flushed "
                f"{self._flushed_on_nic[p]} more since the worker last restarted")
        batch, rows = sim.decodes[0].batch, self.cluster.rows
        assert 0 <= batch.size <= self.scenario.cluster.decode_batch_max, (
            f"the decode batch holds {batch.size} sequences")
        decoding = {r for r, row in rows.items() if row[core.DST] == core.DECODING}
        assert set(sim.decoding) == decoding, (
            f"the decode batch runs requests {sorted(sim.decoding)}; the core has "
            f"{sorted(decoding)} decoding")

    def trace(self) -> list[core.Event]:
        return list(self._trace)

    def story(self) -> list[str]:
        return list(self._story)

    def committed(self) -> list[core.Event]:
        """Every protocol event the core accepted since reset, in order (crashes as the
        core's worker-less events): with one prefill worker, a run of the core."""
        return list(self._committed_events)


def _on_worker_zero(row: tuple) -> tuple:
    if row[core.PW] in (core.NONE, 0):
        return row
    return row[:core.PW] + (0,) + row[core.PW + 1:]
