"""The simulator's workers: one object per prefill worker and per decode worker.

Theory of operation. A worker holds what only it knows — its queue, whether it computes,
its epoch (bumped when it crashes, so that what the dead worker started never completes),
when it is back from a restart, its NIC (writes in flight, writes waiting for a slot, when
the link is free again) — and does what a command of the core asks of it (spec/runtime.py
routes each command to the worker of the request's placement): the prefill queues,
computes and posts page writes; the decode reserves for waiting bootstraps, batches and
steps. Every protocol move goes back through the simulation's `offer`/`take`: a worker
never changes protocol state itself.

Time is modelled by the scenario's compute model (sim/compute.py: prompt/throughput
seconds and a decode step linear in batch size and context, or tables calibrated on the
engine), a page write serialised by the link's bandwidth (or the calibrated transport's
page-write time). Counters that
can drift (NIC slots, a busy flag) are asserted where they change (TIGER_STYLE: pair
assertions): an increment checks the bound, a decrement checks it does not go below zero.
"""

from __future__ import annotations

from collections import deque

from spec import core
from spec.core import PST, QUEUED, SRC
from sim import fault_hits as hits
from sim.decode_batch import DecodeBatch
from sim.fold import FIRST_TOKEN
from sim.prefill_queue import PrefillQueue


class SimPrefill:
    """Prefill worker `index`: its admission queue, its compute and its NIC."""

    __slots__ = ("sim", "index", "queue", "busy", "epoch", "down_until", "nic_in_flight",
                 "nic_free_at", "nic_waiting", "nic_posted", "writes_in_flight_max",
                 "slow_link_probability", "write_latency_s")

    def __init__(self, sim, index: int) -> None:
        self.sim, self.index = sim, index
        self.queue = PrefillQueue()
        self.busy = False            # computing a prompt (one at a time)
        self.epoch = 0               # bumped by a crash: the old epoch's work never completes
        self.down_until = 0.0        # restarting until then (0.0: never went down)
        self.nic_in_flight = 0       # writes on the wire, at most writes_in_flight_max
        self.nic_free_at = 0.0       # when the link has sent what it was given
        self.nic_waiting = deque()   # computed requests whose pages are still to post
        self.nic_posted = deque()    # posted writes waiting for a NIC slot
        self.writes_in_flight_max = sim.sc.link.writes_in_flight_max
        # The link's figures, read once (every write asks).
        self.slow_link_probability = sim.sc.faults.slow_link_probability
        self.write_latency_s = sim.sc.link.write_latency_s

    def is_down(self, now: float) -> bool:
        return bool(self.down_until) and self.down_until > now

    # -- commands of the core ---------------------------------------------------------------

    def queue_request(self, r: int) -> None:
        """Queue: r waits for admission; ready at once if nothing holds it back."""
        sim = self.sim
        ready = (r in sim.tables_received or not core.admission_waits_for_table(sim.model)
                 or core.is_enabled(sim.model, sim.cluster.view(r), r, core.Reject))
        self.queue.add(r, ready)
        self.kick()

    def compute(self, r: int) -> None:
        """Compute: the prompt's KV, for prompt/throughput seconds (prefill fail may strike
        within them)."""
        sim = self.sim
        row = sim.cluster.rows[r]
        # With a prefix cache the core says how much of the prompt is computed (the
        # prefill's own cache skips what it holds); else every page it admitted.
        pages = core.pages_to_compute(sim.model, row) if sim.model.prefix_cache else len(row[SRC])
        self.busy = True
        compute_s = self.compute_seconds(r, pages)
        f = sim.sc.faults
        if f.prefill_fail_probability and sim.rng["faults"].random() < f.prefill_fail_probability:
            sim.later(sim.rng["faults"].uniform(0, compute_s), sim._prefill_fail, r)
        sim.leases.compute_started(r, self.index, sim.env.now, compute_s)
        sim.later(compute_s, self._computed, r, self.epoch)

    def compute_seconds(self, r: int, pages: int) -> float:
        """How long r's prompt of `pages` pages computes (a real worker, sim/hybrid.py,
        computes it here): the scenario's compute model (sim/compute.py) says."""
        sim = self.sim
        return sim.compute.prefill_delay_s(sim.env.now, pages * sim.page_tokens)

    def post(self, write: tuple, d: int) -> None:
        """Post: the NIC takes a posted write. A SendPage may post any number of writes
        (one Post command each): they queue at the NIC in posting order and start while it
        has a slot (writes_in_flight_max), so the bound holds however many one decision
        posts."""
        r = write[0]
        pending = self.sim.nic_pending
        pending[r] = pending.get(r, 0) + 1
        posted = self.nic_posted
        if not posted and self.nic_in_flight < self.writes_in_flight_max:
            self._start_write(write)  # a free slot and no one ahead: now
        else:
            posted.append(write)
            self._start_writes()

    def pages_freed(self, r: int) -> None:
        self.kick()

    # -- admission and compute --------------------------------------------------------------

    def kick(self) -> None:
        """Admit the first queued request whose page table has arrived (the bootstrap
        queue: the prefill computes only once decode has reserved), or reject one the core
        says must be rejected; one request at a time. Only ready requests are looked at
        (sim/prefill_queue.py)."""
        sim = self.sim
        down_until = self.down_until
        if self.busy or (down_until and down_until > sim.env.now):
            return
        queue, cluster = self.queue, sim.cluster
        passed = []  # ready, yet the core names no page count to admit with: look past them
        try:
            while (r := queue.first()) is not None:
                row = cluster.rows.get(r)
                if row is None or row[PST] != QUEUED:
                    queue.take()  # aborted, crashed or settled meanwhile
                    continue
                if core.is_enabled(sim.model, cluster.view(r), r, core.Reject):
                    queue.take()
                    sim.offer("Reject", r)
                    continue
                need = self._need(r, row)
                if type(need) is str:
                    passed.append(queue.take())
                    continue
                pages = cluster.allocate("prefill", self.index, need)
                if pages is None and sim.model.prefill_cache and self._evict_for(r, row, need):
                    pages = cluster.allocate("prefill", self.index, need)
                if pages is None:
                    return  # pool pressure: wait until pages come back
                queue.take()
                # Busy before the offer: the Admit's own reaction kicks this worker again
                # (its pool changed), and must not admit the next request alongside.
                self.busy = True
                if sim.offer("Admit", r, pages=pages):
                    return  # its Compute command started the computation
                self.busy = False
        finally:
            queue.put_back(passed)

    def _need(self, r: int, row: tuple) -> int | str:
        """Fresh source pages r's Admit takes: with the prefill's own cache, fewer by the
        prefix it holds cached (the core looks it up; the Admit names only the fresh
        pages, and the core adds the cached ones to r's sources)."""
        sim = self.sim
        if not sim.model.prefill_cache:
            return core.pages_to_admit(sim.model, row)
        return core.allocation_need(sim.model, sim.cluster.view(r), core.Admit, r)

    def _evict_for(self, r: int, row: tuple, need: int) -> bool:
        """Pool pressure with the prefill's own cache: evict the least recently used
        cached pages (Store.prefill_lru_victims), not those r is about to hit, until `need`
        pages are free; the core decides each PrefillEvict. False (nothing evicted) if the
        cache cannot make up the difference: r waits for pages as without a cache."""
        sim, cluster = self.sim, self.sim.cluster
        hits = core.prefill_hit_pages(sim.model, cluster.view(r), row)
        victims = cluster.prefill_lru_victims(self.index, hits, need)
        return victims is not None and all([sim.prefill_evict(self.index, page)
                                            for page in victims])

    def _computed(self, r: int, epoch: int) -> None:
        if epoch != self.epoch:
            return  # the worker crashed meanwhile
        assert self.busy, f"prefill {self.index} finished computing {r} while not busy"
        self.busy = False
        sim = self.sim
        sim.leases.compute_ended(r, self.index, sim.env.now)
        if r in sim.cluster.rows:
            self.nic_waiting.append(r)
            self.kick_nic()
        self.kick()

    def table_arrived(self, r: int) -> None:
        """Decode's page table reached this prefill: r may be admitted now."""
        self.sim.tables_received.add(r)
        self.queue.table_arrived(r)
        self.kick()

    def restart(self, restart_s: float) -> None:
        """A crash: a new epoch with empty queue pairs; back after restart_s."""
        self.epoch += 1
        self.busy = False
        self.nic_in_flight = 0
        self.nic_waiting.clear()
        self.nic_posted.clear()
        sim = self.sim
        self.down_until = sim.env.now + restart_s
        sim.later(restart_s, self.kick)

    # -- the NIC ----------------------------------------------------------------------------

    def kick_nic(self) -> None:
        """Post writes while the NIC has room, requests in FIFO order."""
        waiting, sim = self.nic_waiting, self.sim
        limit = self.writes_in_flight_max
        rows = sim.cluster.rows
        # Room counts the writes already posted and still waiting for a slot.
        while waiting and self.nic_in_flight + len(self.nic_posted) < limit:
            r = waiting[0]
            if r not in rows or not sim._post(r):
                waiting.popleft()
                sim.all_posted.add(r)
                sim._done_if_landed(r)

    def _start_writes(self) -> None:
        posted, limit = self.nic_posted, self.writes_in_flight_max
        while posted and self.nic_in_flight < limit:
            self._start_write(posted.popleft())

    def _start_write(self, w: tuple) -> None:
        """A write on the wire: bandwidth-serialised, slow-link faults; it lands after its
        transfer and the link's write latency."""
        sim = self.sim
        r = w[0]
        transfer_s = sim.page_transfer_s
        f = sim.sc.faults
        slow = self.slow_link_probability
        slowed = slow and sim.rng["links"].random() < slow
        if slowed:
            transfer_s *= f.slow_link_factor
        now = sim.env.now
        free_at = self.nic_free_at
        start = now if now > free_at else free_at
        self.nic_free_at = start + transfer_s
        self.nic_in_flight += 1
        assert self.nic_in_flight <= self.writes_in_flight_max, (
            f"prefill {self.index}: {self.nic_in_flight} writes in flight")
        landing = start + transfer_s + self.write_latency_s - now
        if slowed:  # a hit: the write lands after the lease, as it stands, runs out
            sim.fault_hits.fired("SlowLink", r in sim.timers
                                 and now + landing > sim.clock.lease_due(r))
        while f.write_post_fail_probability and \
                sim.rng["links"].random() < f.write_post_fail_probability:
            landing += f.retransmit_after_s  # the NIC learns, and posts it again: late
            sim.fault_hits.fired("WritePostFail", hits.decode_waits(sim.cluster, r))
        lost = bool(f.write_loss_probability) and \
            sim.rng["links"].random() < f.write_loss_probability
        if lost:
            sim.fault_hits.fired("WriteLoss", hits.decode_waits(sim.cluster, r))
        sim.later(landing, self._land, r, w[2], self.epoch, lost)

    def _land(self, r: int, page: int, epoch: int, lost: bool = False) -> None:
        """The write's completion: it landed (LandWrite) or, lost, it did not (LoseWrite,
        reported as complete all the same); the NIC's slot is free either way."""
        if epoch != self.epoch:
            return  # flushed with the crashed worker's queue pairs
        sim = self.sim
        if sim.held_until and sim._held(r, self._land, r, page, epoch, lost):
            return  # a held write keeps its NIC slot
        self.nic_in_flight -= 1
        assert self.nic_in_flight >= 0, f"prefill {self.index}: a write landed twice"
        # A request can settle with writes still on the wire: a decode crash flushes them
        # (the target's queue pairs are gone) and tombstones the request. The NIC slot is
        # busy until the write completes all the same; the core refuses its landing.
        pending = sim.nic_pending
        left = pending.pop(r, 0) - 1
        live = r in sim.cluster.rows
        if left > 0:
            pending[r] = left
        else:
            # Below zero only for a settled request (its count left with it).
            assert left == 0 or not live, f"request {r}: more writes landed than posted"
        if live:
            taken = sim.take(core.LoseWrite(r, page) if lost else core.LandWrite(r, page))
            if lost and taken:
                sim.later(sim.sc.timeouts.write_timeout_s, self._revoke, r, REVOKE_TRIES_MAX)
        sim._done_if_landed(r)
        if self.nic_posted:
            self._start_writes()
        self.kick_nic()


    def _revoke(self, r: int, tries_left: int) -> None:
        """Decode's write timer (the spec's RevokeRelease): nobody knows a write lost this
        way is lost, so decode gives up on the request's short count, revokes its pages and
        releases them, once the core allows it (the final word is in and no write of the
        request is on the wire). A real decode arms it on a final word that announces more
        writes than landed; the simulator arms it at the loss and tries again every
        write_timeout_s while the request lives (at most REVOKE_TRIES_MAX times)."""
        sim = self.sim
        if r not in sim.cluster.rows or sim.offer_if_enabled("RevokeRelease", r) is not None:
            return
        if tries_left > 1:
            sim.later(sim.sc.timeouts.write_timeout_s, self._revoke, r, tries_left - 1)


REVOKE_TRIES_MAX = 100  # write timer firings per lost write before the shell stops trying


class SimDecode:
    """Decode worker `index`: its FIFO of bootstraps waiting for pages, the siblings it
    holds back, and its batch.

    n > 1 siblings (prefix.siblings, with a prefix cache): a sibling's bootstrap at the
    head of the FIFO is set aside (`held`, under its first) while `core.sibling_waits` on
    its first's row, so that once decode accepts the first's transfer its Reserve is a
    full hit. A held sibling takes no page and is out of the FIFO, so whoever waits
    behind it (its first included) is not held up; it comes back to the FIFO's head when
    its first moves and the core says it waits no more (the first accepted, ended or
    forgotten), or at the latest `prefix.sibling_wait_max_s` after it was first held."""

    __slots__ = ("sim", "index", "waiting", "down_until", "batch", "held", "held_until_s")

    def __init__(self, sim, index: int) -> None:
        self.sim, self.index = sim, index
        self.waiting = deque()     # bootstraps the core wants reserved, waiting for pages
        self.down_until = 0.0      # restarting until then (0.0: never went down)
        self.batch = DecodeBatch()
        self.held: dict[int, list[int]] = {}    # first -> its siblings held, in FIFO order
        self.held_until_s: dict[int, float] = {}  # held sibling -> when it goes on alone

    def is_down(self, now: float) -> bool:
        return bool(self.down_until) and self.down_until > now

    # -- commands of the core ---------------------------------------------------------------

    def start_decoding(self, r: int) -> None:
        sim = self.sim
        prompt = sim.cluster.rows[r][core.PROMPT]
        steps = sim.output[r]
        if sim.compute.first_token_at_prefill:
            # The engine's way (sim/compute.py): the prefill sampled the first token, out
            # now; the batch's steps make the rest (one at least: a one-token output costs
            # one step here where the engine's would finish at once).
            sim._fact(FIRST_TOKEN, r)
            steps = max(1, steps - 1)
        sequence = sim.decoding[r] = DecodeBatch.sequence(r, steps, prompt * sim.page_tokens)
        self.batch.add(sequence)
        self.kick()

    def stop_decoding(self, r: int) -> None:
        sequence = self.sim.decoding.pop(r, None)
        if sequence is not None:
            self.batch.stop(sequence)

    def pages_freed(self, r: int) -> None:
        self.kick_waiting()

    # -- reservation ------------------------------------------------------------------------

    def join(self, r: int) -> bool:
        """A bootstrap the core wants reserved joins the FIFO of reservations, which are
        taken while pages are free."""
        waiting = self.waiting
        waiting.append(r)
        if len(waiting) == 1:
            self.kick_waiting()
        return True

    def kick_waiting(self) -> None:
        """Reserve for waiting bootstraps in FIFO order while pages are free."""
        waiting, sim = self.waiting, self.sim
        cluster = sim.cluster
        while waiting:
            r = waiting[0]
            row = cluster.rows.get(r)
            if row is not None and r in sim.first_of and self._hold(r):
                waiting.popleft()
                continue
            need = self._need(r, row) if row else "settled"
            if type(need) is str:
                self._leave()  # a decode crash tombstoned it while it waited
                if row is not None:
                    sim.deliver(core.BOOTSTRAP, r)
                continue
            pages = cluster.allocate("decode", self.index, need)
            if pages is None and sim.model.prefix_cache and self._evict_for(r, row, need):
                pages = cluster.allocate("decode", self.index, need)
            if pages is None:
                return
            self._leave()
            sim.offer("Reserve", r, pages=pages)

    def _leave(self) -> None:
        """The head of the FIFO leaves it for good: a sibling's wait ends with it (a
        sibling whose wait ran out and then waits for pages is not held again)."""
        self.held_until_s.pop(self.waiting.popleft(), None)

    def _need(self, r: int, row: tuple) -> int | str:
        """Fresh pages r's Reserve takes: with a prefix cache, fewer by what decode holds
        cached for its prompt (the core looks it up)."""
        sim = self.sim
        if not sim.model.prefix_cache:
            return core.pages_to_reserve(sim.model, row)
        return core.allocation_need(sim.model, sim.cluster.view(r), core.Reserve, r)

    def _hold(self, r: int) -> bool:
        """Whether sibling r is set aside now (the class's header): the core says it waits
        for its first (core.sibling_waits; a first forgotten is waited for no more), there
        is a cache to share through, and its wait has not run out."""
        sim = self.sim
        first = sim.first_of[r]
        row = sim.cluster.rows.get(first)
        if row is None or not sim.model.prefix_cache or not core.sibling_waits(row):
            return False
        now = sim.env.now
        until = self.held_until_s.setdefault(r, now + sim.sc.prefix.sibling_wait_max_s)
        if until <= now:
            return False
        if first not in self.held:  # the bound: back to the FIFO then, at the latest
            sim.later(until - now, self.release, first)
        self.held.setdefault(first, []).append(r)
        return True

    def first_moved(self, first: int) -> None:
        """A first with siblings held here moved: they go back if they wait no more."""
        row = self.sim.cluster.rows.get(first)
        if row is None or not core.sibling_waits(row):
            self.release(first)

    def release(self, first: int) -> None:
        """The siblings held for `first` go back to the head of the FIFO, in their order;
        those that must still wait are set aside again by kick_waiting."""
        siblings = self.held.pop(first, None)
        if siblings:
            self.waiting.extendleft(reversed(siblings))
            self.kick_waiting()

    def _evict_for(self, r: int, row: tuple, need: int) -> bool:
        """Pool pressure with a prefix cache: evict the least recently released cached
        pages nobody reads (LRU), but not those r is about to hit, until `need` pages are
        free; the core decides each Evict. False (nothing evicted) if the idle cache
        cannot make up the difference: r waits for pages as without a cache."""
        sim, cluster = self.sim, self.sim.cluster
        hits = core.hit_pages(sim.model, cluster.view(r), row)
        victims = cluster.lru_victims(self.index, hits, need)
        return victims is not None and all([sim.evict(self.index, page) for page in victims])

    def restart(self, restart_s: float) -> None:
        """The restarted decode's queues are empty; messages reach it once it is back."""
        sim = self.sim
        self.down_until = sim.env.now + restart_s
        self.waiting.clear()
        self.held.clear()
        self.held_until_s.clear()
        sim.later(restart_s, self.kick_waiting)

    # -- continuous batching ----------------------------------------------------------------

    def kick(self) -> None:
        """Start the next continuous-batching step, if idle (sim/decode_batch.py)."""
        batch = self.batch
        if batch.stepping:
            return
        sim = self.sim
        batch.fill(sim.sc.cluster.decode_batch_max)
        if not batch.size:
            return
        step_s = self.step_seconds(batch)
        batch.stepping = True
        batch.step_ends_s = sim.env.now + step_s
        sim.later(step_s, self._stepped)

    def step_seconds(self, batch: DecodeBatch) -> float:
        """How long the step starting now takes (a real worker, sim/hybrid.py, runs it):
        the scenario's compute model says."""
        sim = self.sim
        return sim.compute.decode_delay_s(sim.env.now, batch.size, batch.context_tokens)

    def observed(self, info, m, view, r: int) -> bool:
        """The data path's verdict for r's observed action (Accept's checksums, Finish's
        tags): modelled pages give the one their abstract contents imply (core's oracle)."""
        return info.observed(m, view, r)

    def _stepped(self) -> None:
        batch, sim = self.batch, self.sim
        assert batch.stepping, f"decode {self.index}: a step ended that never started"
        batch.stepping = False
        first, done = batch.step()
        if sim.compute.first_token_at_prefill:
            first = []  # emitted when decoding started
        if not done:  # most steps: only the sequences that joined emit their first token
            for sequence in first:
                if sequence[0] >= 0:
                    sim._fact(FIRST_TOKEN, sequence[0])
        else:
            for sequence, first_token, finished in batch.in_order(first, done):
                r = sequence[0]
                if r < 0:
                    continue  # decode closed it meanwhile (the client went away)
                if first_token:
                    sim._fact(FIRST_TOKEN, r)
                if finished:
                    sim.decoding.pop(r, None)
                    sim.offer("Finish", r)
        self.kick()
