"""The simulated cluster: clients, a router, P prefill and D decode workers, links, faults.

Theory of operation
-------------------
Time, load and failure live here; protocol decisions do not. Every component acts by
*offering* an event to the protocol core (through the store, spec/store.py; the Folder
logs it): the core accepts it, and the change is committed, logged and checked by the
oracles, or refuses it with a reason (nothing changes; the refusal is counted by reason).
Components offer only what the core enables (`core.consumer` maps an arriving message to
the action that consumes it, `core.is_enabled` answers for a timer or a fault), so a
refusal is a real race. The path into the core and the carrying-out of its commands are
the one runtime's (spec/runtime.py, shared with the engine: `Simulation` is a
`ShellRuntime`); an accepted decision's commands (spec/commands.py) go, each by its type,
to the simulated side of its interfaces (spec/interfaces.py):

- Send: a message (bootstrap, final word, cancel, page table) crosses the link
  (sim/link.py) after its latency, with loss (retransmitted) and extra delay as faults; on
  delivery the receiving worker takes the action `core.consumer` names; client gone goes
  to the clients (sim/clients.py), which notify both workers;
- Queue: the request waits in its prefill worker's FIFO (sim/workers.py, `SimPrefill`); at
  its head the worker offers Reject, or Admit with pages from the store's allocator;
  Compute: the worker computes for prompt/throughput seconds, then posts one write per page
  (SendPage), and each Post is carried by its NIC (bounded in-flight writes,
  bandwidth-serialised) and lands later (LandWrite); the prefill offers SendDone when its
  NIC reports the request's last write;
- ArmTimer / CancelTimer: decode's transfer timer (sim/clock.py), a lease that the
  prefill's progress renews, with a backstop from the Admit (sim/lease.py);
  StartDecoding / StopDecoding: continuous batching (`SimDecode`), one step per batch, its
  time a function of batch size and context; the last token offers Finish;
- ReleaseWhenReady, and a message that arrives before its action is enabled (a cancel
  while writes are in flight): an *intent*, taken as soon as the core enables it;
- Answer: the client has its answer; FreePages: whoever waits for pages is woken.

Faults (each switchable and rate-controlled by the scenario): client aborts at any moment,
lost messages (retransmitted after retransmit_after_s), delayed messages, slow page writes,
transfer timeouts (a silent prefill, or a transfer past its backstop), prefill failures,
prefill and decode worker crashes with restart (each a core event: PrefillCrash,
DecodeCrash). Pool pressure comes from the workload against the pools.

Determinism: one random stream per purpose, seeded from the scenario's seed; SimPy breaks
time ties by scheduling order; so a seed gives a byte-identical log.
"""

from __future__ import annotations

import math
import random
import re
import sys
import time

import simpy

from spec.runtime import ShellRuntime, carrier
from spec import core
from spec.core import Refusal
from sim import crash as shell_crash, fault_hits as hits
from sim.fold import RUN_END, Folder, LogFile, encode, replay, write_header
from sim.scenario import Scenario, ScenarioError
from sim.clients import SimClients, sample_tokens  # noqa: F401  (bench/ imports it here)
from sim.clock import SimClock
from sim.compute import compute_model
from sim.link import SimLink
from sim.schedule import Scheduler
from sim.workers import SimDecode, SimPrefill
from sim.report import prefix_summary
from sim.workload import PromptMaker, TraceRequest, load_workload  # noqa: F401  (a type)
from spec.codec import encode as encode_event


class StopSimulation(Exception):
    """An oracle found a violation and the scenario asks to stop."""


class Simulation(ShellRuntime):
    def __init__(self, scenario: Scenario, *, log=None, progress: bool = False,
                 model=None, on_commit=None, data_path=None) -> None:
        self.sc = scenario
        self.env = simpy.Environment()
        self.folder = Folder(scenario, model)
        # Called as on_commit(event, change) after the core accepts a request's event and
        # the change is committed, before anyone reacts (the fuzzer watches reads here).
        self.on_commit = on_commit
        self.on_refusal = None  # called with each counted refusal (the fuzzer's audit)
        self.cluster = self.folder.cluster
        self.model = self.folder.model
        self.log = log
        if log is not None:
            write_header(log, scenario)
        # The one runtime's interfaces (spec/interfaces.py), simulated side.
        self.core_model, self.store = self.model, self.cluster
        self.event_log = LogFile(log, self.output_of) if log is not None else None
        self.progress = progress
        seed = scenario.seed
        self.rng = {k: random.Random(f"{seed}:{k}") for k in
                    ("arrivals", "lengths", "faults", "links", "crashes", "reactions",
                     "prompts")}
        c = scenario.cluster
        self.page_tokens = c.page_tokens
        self.compute = compute_model(scenario)  # sim/compute.py
        self.page_transfer_s = self.compute.page_write_s
        self.next_request = 0
        self.refusals: dict[str, int] = {}
        self.fault_hits = hits.FaultHits()  # how often each fault struck its target state
        self.violations_seen = 0
        # The workers (sim/workers.py), each with its own queue, epoch and NIC or batch.
        self.prefills = self.prefill_at = [SimPrefill(self, k) for k in range(c.prefill_workers)]
        self.decodes = self.decode_at = [SimDecode(self, k) for k in range(c.decode_workers)]
        self.nic_pending: dict[int, int] = {}   # request -> its writes still in flight
        self.send_page_events: dict[int, core.SendPage] = {}
        self.all_posted: set[int] = set()       # requests whose every page is posted
        # Per live request (dropped when it settles).
        self.output = {}
        self.decoding = {}  # request -> its sequence in a decode batch
        self.intents: dict[int, list[tuple[str, str]]] = {}
        self.clock = SimClock(self)
        self.timers, self.leases = self.clock.timers, self.clock.leases
        self.tables_received: set[int] = set()  # requests whose page table reached the prefill
        self.client = SimClients(self)
        self._start_runtime()
        # request -> simulated time before which nothing of it arrives (hold())
        self.held_until: dict[int, float] = {}
        self.round_robin = [0, 0]
        # n > 1 siblings (prefix.siblings): each live sibling -> the first of its group,
        # whose transfer it waits for at decode (SimDecode.held); the first is not in it.
        self.first_of: dict[int, int] = {}
        self.siblings = scenario.prefix.siblings
        self.finished = self.env.event()  # every request has settled
        # A trace-driven workload: the file's requests, at most sc.requests of them.
        self.trace = (load_workload(scenario.workload.trace_file)
                      if scenario.workload.arrival == "trace" else None)
        self.requests_total = (min(scenario.requests, len(self.trace.requests))
                               if self.trace is not None else scenario.requests)
        if self.trace is not None:
            _check_trace_prompts(scenario, self.trace, self.requests_total)
        # Prompts' tokens and salts (sim/workload.py), drawn whatever the cache: the core
        # sees them only when the model has a prefix cache.
        self.prompts = (PromptMaker(scenario.prefix, c.page_tokens, c.context_pages,
                                    self.rng["prompts"])
                        if scenario.prefix.shape != "none" else None)
        self.wall_start = time.perf_counter()
        self.next_progress = self.wall_start + 2.0
        # _checked has work when a violation is new, or at a multiple of these events (the
        # sweep's and the progress line's), so the step after every event asks one modulo.
        # The calls go straight onto SimPy's queue (sim/schedule.py), bound once.
        self.scheduler = Scheduler(self.env)
        self._at = self.scheduler.at
        self.link = SimLink(self)
        self.check_every_events = math.gcd(scenario.oracles.sweep_every_events,
                                           2048 if progress else 0) or 2**62
        self.data_path = data_path
        if scenario.hybrid.enabled:  # real workers take their indices' places (sim/hybrid.py)
            from sim.hybrid import attach
            attach(self, data_path)

    # -- offering events to the core ------------------------------------------------------

    def offer(self, action: str, r: int, _count_refusal: bool = True,
              **args) -> core.Change | None:
        """The Change the core made for this event, or None if it refused (falsy). `args`
        are the event's fields (by their names in spec/core.py) and, for Arrive, the
        shell's facts the log keeps beside it (placement p, d and output length out)."""
        if action == "Arrive":
            return self._arrive(r, args)
        if r not in self.cluster.rows:
            return None  # settled and forgotten: a late timer or message
        return self.take(self._event(action, r, args), _count_refusal)

    # `take(event, count_refusal=True)`: the one runtime's path (spec/runtime.py), for an
    # event already built (the per-page events, on the hot path: no keyword arguments to
    # pack and unpack); its request must still be live.
    take = ShellRuntime.take_event

    def output_of(self, r: int) -> int:
        return self.output[r]

    def commit(self, now: float, r: int, change: core.Change,
               event: core.Event) -> tuple[int, int]:
        """The Folder commits and folds the change into the metrics (an Arrive's facts
        first: its output length)."""
        folder = self.folder
        if type(event) is core.Arrive:
            folder.metrics.arrive(now, r, event.prompt_pages, self.output[r])
        folder.accept(now, r, change, event)
        return folder.last_placement

    def _event(self, action: str, r: int, args: dict) -> core.Event:
        """The core event of an offer. The simulator's data path is the abstract page
        contents, so an observed verdict is the one they imply (core's oracle)."""
        cls = core.EVENT_TYPES[action]
        info = core.INFO[cls]
        if info.observed is not None:  # the verdict of r's decode worker's data path
            d = self.cluster.placement[r][1]
            args = {info.argument: self.decodes[d].observed(info, self.model, self.cluster.view(r), r)}
        return cls(r, **args)

    def offer_if_enabled(self, action: str, r: int) -> core.Change | None:
        """Offer an action a fault or the NIC scheduled earlier, if the core still enables
        it: a fault aimed at a request that has moved on does not happen, and a NIC with no
        page left to post moves on. Neither is a refusal (nothing raced)."""
        return self.offer(action, r, _count_refusal=False)

    def refused(self, refusal: Refusal) -> None:
        """Count a refusal by its reason: each is a race the summary explains."""
        key = f"{refusal.event.action}: {re.sub(r'[0-9]+', 'N', refusal.reason)}"
        self.refusals[key] = self.refusals.get(key, 0) + 1
        if self.on_refusal is not None:
            self.on_refusal(refusal)

    @property
    def timer_callbacks_pending(self) -> int:
        """Of `pending`: the transfer timers' callbacks, live or superseded."""
        return self.clock.callbacks_pending

    def deliver(self, message: str, r: int, worker: str | None = None) -> bool:
        """A message of r arrived at its worker: take the action the core says consumes it
        (core.consumer); False if nothing can take it now."""
        if r not in self.cluster.rows:
            return False
        cls = core.consumer(self.model, self.cluster.view(r), r, message, worker)
        if cls is None:
            return False
        if cls is core.Reserve:
            return self.decodes[self.cluster.placement[r][1]].join(r)
        return bool(self.offer(cls.__name__, r))

    def _arrive(self, r: int, args: dict) -> core.Change | None:
        event = core.Arrive(r, args["prompt_pages"], tokens=args.get("tokens", ()),
                            salt=args.get("salt", 0))
        return self.take_arrival(event, args["p"], args["d"])

    def evict(self, d: int, page: int) -> bool:
        """Decode worker d's prefix cache forgets `page` (its LRU pick under pool
        pressure), if the core allows it: logged and checked like a crash, a worker's
        event with no request."""
        return self._evict(core.Evict(d, page))

    def prefill_evict(self, p: int, page: int) -> bool:
        """Prefill worker p's cache forgets `page` (PrefillEvict), the same way."""
        return self._evict(core.PrefillEvict(p, page))

    def _evict(self, event: core.Evict | core.PrefillEvict) -> bool:
        record = {"t": self.env.now, **encode_event(event)}
        out = self.folder.apply(record)
        if type(out) is Refusal:
            self.refused(out)
            return False
        if self.log is not None:
            self.log.write(encode(record) + "\n")
        if self.on_commit is not None:
            self.on_commit(event, out)
        self._checked()
        return True

    def checked(self) -> None:
        """The oracles after a commit: at once when a violation is new, and the sweep and
        the progress line every so many events."""
        if (self.cluster.violation_total != self.violations_seen
                or self.folder.events % self.check_every_events == 0):
            self._checked()

    def _checked(self) -> None:
        total = self.cluster.violation_total
        if total != self.violations_seen:
            self.violations_seen = total
            if self.sc.oracles.on_violation == "stop":
                raise StopSimulation(str(self.cluster.violations[-1]))
        sweep = self.sc.oracles.sweep_every_events
        if sweep and self.folder.events % sweep == 0:
            for violation in self.cluster.sweep():
                self.cluster._violate(violation.property, violation.detail)
        if self.progress and self.folder.events % 2048 == 0:
            self._show_progress()

    def run_wants(self) -> None:
        while self.dirty:
            r = self.dirty.pop()
            for wanted in tuple(self.intents.get(r, ())):
                if r not in self.cluster.rows:
                    break
                if self._take_intent(r, wanted):
                    still = self.intents.get(r)
                    if still and wanted in still:
                        still.remove(wanted)

    def _take_intent(self, r: int, wanted: tuple[str, str]) -> bool:
        """Carry out an intent if the core enables it now: a message goes to the action
        the core says consumes it; an action is offered and decided once (a refusal here
        is no race, only "not yet", and is not counted)."""
        worker, what = wanted
        if what not in core.CONSUMERS:
            return bool(self.offer_if_enabled(what, r))
        cls = core.consumer(self.model, self.cluster.view(r), r, what, worker)
        return cls is not None and bool(self.offer(cls.__name__, r))

    def want(self, r: int, worker: str, what: str) -> None:
        """Carry out `what` for r (a message its worker has received, or an action of that
        worker) as soon as the core enables it: after each change of r, it is asked again."""
        wanted = self.intents.setdefault(r, [])
        if (worker, what) not in wanted:
            wanted.append((worker, what))
        self.dirty.append(r)
        if self.depth == 0:
            # Not inside a decision (a notice delivered by a timer): if the core enables
            # it now, it is taken now, not at the next event someone else causes.
            self.run_wants()

    def later(self, delay_s: float, fn, *args) -> None:
        """Call fn(*args) after delay_s. These are the protocol's own timers and deliveries:
        when none is pending and every request has arrived, the cluster is at rest."""
        self._at(delay_s, fn, *args)

    @property
    def pending(self) -> int:
        """Calls scheduled and not yet made."""
        return self.scheduler.pending

    @property
    def at_rest(self) -> bool:
        return self.pending == 0 and self.next_request >= self.requests_total

    # -- reacting to what the core changed --------------------------------------------------

    def concurrent_order(self, todo: tuple) -> list:
        """The commands of one decision in the order the shell carries them out. Those of
        one worker for one request keep the core's order (a worker does one thing after
        another); different workers (or requests, after a crash) act concurrently, so
        their turns are ordered by the run's seed: no reaction always goes first."""
        if not todo:
            return todo
        first = todo[0]
        group = (first.request, carrier(first))
        for command in todo:
            if (command.request, carrier(command)) != group:
                break
        else:
            return todo  # one worker's commands (most decisions)
        groups: dict[tuple, list] = {}
        for command in todo:
            groups.setdefault((command.request, carrier(command)), []).append(command)
        turns = list(groups.values())
        if len(turns) == 2:  # the usual case, one draw instead of shuffle's
            if self.rng["reactions"].random() < 0.5:
                turns.reverse()
        else:
            self.rng["reactions"].shuffle(turns)
        return [command for turn in turns for command in turn]

    order = concurrent_order

    def moved(self, r: int, p: int) -> None:
        """r changed: its intents are asked again, and a request the store forgot (settled)
        leaves every table of the shell."""
        if r in self.intents:
            self.dirty.append(r)
        if self.siblings > 1:  # siblings may wait for r: their decode asks the core again
            for decode in self.decodes:
                if r in decode.held:
                    decode.first_moved(r)
        if r not in self.cluster.rows:
            self._settled(r, p)

    def _settled(self, r: int, p: int) -> None:
        """The store forgot r: it leaves every table of the shell."""
        self._drop(r, p)
        assert self.folder.metrics.settled <= self.requests_total, "a request settled twice"
        if self.folder.metrics.settled == self.requests_total and not self.finished.triggered:
            self.finished.succeed()

    def _drop(self, r: int, p: int) -> None:
        self.prefills[p].queue.forget(r)
        for table in (self.output, self.decoding, self.intents, self.nic_pending,
                      self.send_page_events, self.held_until, self.first_of):
            table.pop(r, None)
        self.all_posted.discard(r)
        self.tables_received.discard(r)
        self.clock.forget(r)

    # -- messages ---------------------------------------------------------------------------

    def hold(self, r: int, seconds: float) -> None:
        """Delay everything of request r on the wire (writes, messages) until `seconds` from
        now: a stalled queue pair or a congested path, chosen by the fuzzer."""
        self.held_until[r] = self.env.now + seconds

    def _held(self, r: int, fn, *args) -> bool:
        """Re-schedule fn(*args) if r is held; True if it was."""
        until = self.held_until.get(r)
        if until is None or until <= self.env.now:
            return False
        self.later(until - self.env.now, fn, *args)
        return True

    # -- prefill workers -----------------------------------------------------------------

    def _done_if_landed(self, r: int) -> None:
        """The prefill sends its final word once its NIC reports every write of r done."""
        if r in self.all_posted and not self.nic_pending.get(r):
            self.all_posted.discard(r)
            self.offer_if_enabled("SendDone", r)

    def _post(self, r: int) -> bool:
        """SendPage, if the core enables it: its Post command puts the write on the NIC."""
        event = self.send_page_events.get(r)
        if event is None:  # one event per request: the same for each of its pages
            event = self.send_page_events[r] = core.SendPage(r)
        return self.take(event, False) is not None  # if the core enables it

    def on_table(self, r: int, p: int) -> None:
        """Decode's page table reached the prefill: the request may be admitted now."""
        self.prefills[p].table_arrived(r)

    def on_cancel(self, r: int, p: int) -> None:
        if not self.deliver(core.CANCEL_MSG, r, "prefill"):
            # Writes in flight: the prefill stops, or finishes and answers, once they land.
            self.want(r, "prefill", core.CANCEL_MSG)

    @property
    def nic_in_flight(self) -> list[int]:
        """Each prefill worker's writes on the wire (tests look at it after a run)."""
        return [worker.nic_in_flight for worker in self.prefills]

    def crash_loop(self, kind: str, worker: int, rate_per_s: float):
        rng = self.rng["crashes"]
        while not (self.finished.triggered or self.at_rest):
            yield self.env.timeout(rng.expovariate(rate_per_s))
            if self.finished.triggered or self.at_rest:
                return  # crashes alone must not keep a run that has come to rest going
            self.crash(kind, worker)

    def crash(self, kind: str, worker: int) -> None:
        """A worker dies and restarts: PrefillCrash or DecodeCrash, if the core says the
        crash loses anything (a worker with nothing to lose just restarts)."""
        action, key = ("PrefillCrash", "p") if kind == "prefill" else ("DecodeCrash", "d")
        self.fault_hits.fired(action, hits.prefill_writes_in_flight(self.cluster, worker)
                              if kind == "prefill" else
                              hits.decode_writes_in_flight(self.cluster, worker))
        record = {"t": self.env.now, "a": action, key: worker}
        placements = dict(self.cluster.placement)
        # The requests that wait at a crashing prefill keep what its progress renewed so far.
        waiting = ([r for r, (p, _) in placements.items() if p == worker
                    and r in self.leases.requests and self.clock.waiting_at_prefill(r, p)]
                   if kind == "prefill" else [])
        self.depth += 1
        out = self.folder.apply(record)
        if type(out) is Refusal:
            pass  # the worker held nothing: it restarts empty and the protocol sees nothing
        else:
            if self.log is not None:
                self.log.write(encode(record) + "\n")
            self._checked()
            if kind == "prefill":
                self.leases.crashed(worker, self.env.now, waiting)
                self.prefills[worker].restart(self.sc.faults.prefill_restart_s)
            else:
                self.decodes[worker].restart(self.sc.faults.decode_restart_s)
            handlers = self._handlers  # the one runtime's table (spec/runtime.py)
            for command in self.concurrent_order(out.commands):
                handlers[type(command)](command, *placements[command.request])
            for r, _ in out.rows:
                self.moved(r, placements[r][0])
        self.depth -= 1
        self.run_wants()

    # -- decode workers ---------------------------------------------------------------------

    def on_bootstrap(self, r: int, d: int) -> None:
        self.deliver(core.BOOTSTRAP, r)

    def on_final_word(self, r: int, d: int) -> None:
        if not self.deliver(core.FINAL_WORD_MSG, r):
            # A Done whose writes have not all landed: decode takes it once they have, or
            # once it stops waiting (a timeout, its write timer) and only notes it.
            self.want(r, "decode", core.FINAL_WORD_MSG)

    def offer_decode_abort(self, r: int) -> None:
        """The client-gone notice reaches decode: DecodeAbort if decode still holds r."""
        row = self.cluster.rows.get(r)
        if row is not None and core.is_enabled(self.model, self.cluster.view(r), r,
                                               core.DecodeAbort):
            self.offer("DecodeAbort", r)

    def _fact(self, action: str, r: int) -> None:
        record = {"t": self.env.now, "a": action, "request": r}
        self.folder.apply(record)
        if self.log is not None:
            self.log.write(encode(record) + "\n")

    # -- clients and the router -----------------------------------------------------------

    def place(self) -> tuple[int, int]:
        c = self.sc.cluster
        if c.router == "round-robin":
            p, d = self.round_robin
            self.round_robin = [(p + 1) % c.prefill_workers, (d + 1) % c.decode_workers]
            return p, d
        now, prefills = self.env.now, self.prefills
        p = min(range(c.prefill_workers), key=lambda k: (
            prefills[k].is_down(now), len(prefills[k].queue) + prefills[k].busy))
        d = max(range(c.decode_workers), key=lambda k: (
            self.cluster.free_pages("decode", k) - len(self.decodes[k].waiting), -k))
        return p, d

    def new_request(self, prompt_pages: int | None = None,
                    traced: "TraceRequest | None" = None, tokens: tuple = (),
                    salt: int = 0, siblings: int = 1) -> simpy.Event | None:
        """The next client request, now; its prompt drawn from the workload, or
        `prompt_pages` long (the fuzzer's choice, with its tokens and salt on a prefix
        cache), or as a trace file's row says. With a prefix shape the workload's prompt
        length is the prompt's own part, after what it shares (sim/workload.py).
        `siblings` > 1 (prefix.siblings): the request is the first of that many siblings,
        the completions of one prompt, arriving together with its tokens, salt and
        placement, each with its own output length (a trace row's for every one); the
        request bound may cut the last group short. Returns the event of the group's
        answers (a closed-loop session waits for them all)."""
        if self.next_request >= self.requests_total:
            return None
        prompt, output = self.client.lengths(prompt_pages, traced)
        placement = self.place()
        pages = -(-prompt // self.page_tokens)
        if self.prompts is not None and not tokens:
            tokens, salt = self.prompts.next(pages)
            pages = len(tokens)
        first = self.next_request
        answers = [self._new(pages, output, placement, tokens, salt)]
        while len(answers) < siblings and self.next_request < self.requests_total:
            self.first_of[self.next_request] = first
            answers.append(self._new(pages, self.client.output_length(traced), placement,
                                     tokens, salt))
        return answers[0] if len(answers) == 1 else self.env.all_of(answers)

    def _new(self, pages: int, output: int, placement: tuple[int, int], tokens: tuple,
             salt: int) -> simpy.Event:
        """Request `next_request` arrives: its Arrive, with the shell's facts beside it."""
        r = self.next_request
        self.next_request += 1
        p, d = placement
        self.output[r] = output
        answered = self.client.waiter(r)
        content = dict(tokens=tokens, salt=salt) if self.model.prefix_cache else {}
        self.folder.last_placement = (p, d)
        if not self.offer("Arrive", r, prompt_pages=pages, p=p, d=d, out=output, **content):
            raise AssertionError(f"the core refused the arrival of request {r}")
        self.client.may_abort(r)
        return answered

    def _prefill_fail(self, r: int) -> None:
        if r in self.cluster.rows:
            hit = hits.decode_holds_pages(self.cluster, r)
            if self.offer_if_enabled("PrefillFail", r):
                self.fault_hits.fired("PrefillFail", hit)

    # -- running ----------------------------------------------------------------------------

    def run(self) -> None:
        self.client.start()
        f, c = self.sc.faults, self.sc.cluster
        if f.prefill_crash_rate_per_s:
            for p in range(c.prefill_workers):
                self.env.process(self.crash_loop("prefill", p, f.prefill_crash_rate_per_s))
        if f.decode_crash_rate_per_s:
            for d in range(c.decode_workers):
                self.env.process(self.crash_loop("decode", d, f.decode_crash_rate_per_s))
        horizon = self.env.timeout(self.sc.horizon_s)
        self.env.run(until=self.env.any_of([self.finished, horizon]))
        if self.progress:
            self._show_progress(final=True)

    def _show_progress(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now < self.next_progress:
            return
        self.next_progress = now + 2.0
        m = self.folder.metrics
        elapsed = max(now - self.wall_start, 1e-9)
        done = m.settled / self.requests_total
        bar = "#" * int(done * 30)
        eta = f", ~{elapsed * (1 - done) / done:,.0f} s left" if 0 < done < 1 else ""
        print(f"  sim [{bar:<30}] {done:6.1%}  {m.settled:,}/{self.requests_total:,} requests, "
              f"{self.env.now:,.1f} s simulated, {self.folder.events / elapsed:,.0f} "
              f"events/s{eta}", file=sys.stderr, flush=True)


def fault_free(sc: Scenario) -> bool:
    """No fault is switched on: every request whose prompt fits must get its Ok (the
    simulator's side of FittingRequestsSucceed), whatever guard a bug switch removed."""
    faults = sc.faults
    return all(getattr(faults, name) == 0 for name in type(faults).model_fields
               if name.endswith(("_probability", "_rate_per_s")))


def result_of(sc: Scenario, folder: Folder, refusals: dict, stopped: str | None,
              drained: bool, fault_hits: dict | None = None,
              crashed: dict | None = None) -> dict:
    """Everything a run reports, as JSON-able values; the same for a run and its replay
    (except refused offers and fault hits, which the log does not record). A run whose
    shell crashed (`crashed`, sim/crash.py) is not swept: it may have stopped halfway
    through carrying out a decision."""
    cluster = folder.cluster
    if crashed is None:
        for violation in cluster.sweep(at_rest=drained and stopped is None):
            cluster._violate(violation.property, violation.detail)
    if drained and stopped is None and fault_free(sc):
        failed = {name: n for name, n in folder.metrics.fitting_outcomes.items() if name != "Ok"}
        if failed:
            cluster._violate("FittingRequestsSucceed", "a fault-free run failed requests whose "
                             f"prompt fits: {failed}")
    return {
        "scenario": sc.name, "seed": sc.seed, "bugs": sorted(sc.bugs),
        "requests": sc.requests, "events": folder.events,
        "summary": folder.metrics.summary(),
        "violations": dict(sorted(cluster.violation_counts.items())),
        "first_violations": [v.as_dict() for v in cluster.violations[:10]],
        "refusals": dict(sorted(refusals.items())),
        "fault_hits": fault_hits or {},
        "stopped": stopped, "drained": drained, "crash": crashed,
        "unsettled_requests": len(cluster.rows),
        **({"prefix": prefix_summary(folder.metrics, sc)} if sc.prefix.shape != "none" else {}),
    }


def simulate(sc: Scenario, *, log_path: str | None = None, progress: bool = False,
             data_path=None) -> tuple[dict, Simulation]:
    """Run a scenario to the end (or the first violation, if it asks to stop); a hybrid
    scenario's real workers run on `data_path` (sim/hybrid.py)."""
    log = open(log_path, "w") if log_path else None
    try:
        sim = Simulation(sc, log=log, progress=progress, data_path=data_path)
        stopped = crashed = None
        try:
            sim.run()
        except StopSimulation as stop:
            stopped = str(stop)
        except KeyboardInterrupt:
            # Ctrl-C: the log keeps every event committed so far and ends with a record that
            # says the run was cut short, so it replays (to "no verdict"), never as complete.
            if log:
                log.write(encode({"t": sim.env.now, "a": RUN_END, "drained": False,
                                  "stopped": None, "crashed": None,
                                  "interrupted": True}) + "\n")
            raise
        except Exception as error:  # noqa: BLE001  the shell crashed: a finding (sim/crash.py)
            crashed = {**shell_crash.describe(error), "t": sim.env.now, "events": sim.folder.events}
        drained = crashed is None and (sim.finished.triggered or sim.at_rest)
        if log:
            log.write(encode({"t": sim.env.now, "a": RUN_END, "drained": drained,
                              "stopped": stopped, "crashed": crashed}) + "\n")
        result = result_of(sc, sim.folder, sim.refusals, stopped, drained,
                           sim.fault_hits.as_dict(), crashed)
        if data_path is not None:
            result["hybrid"] = data_path.summary()
        return result, sim
    finally:
        if log:
            log.close()


def replay_result(path: str) -> tuple[dict, Folder]:
    """The result of the run that wrote log `path`, rebuilt from the log alone."""
    folder, end = replay(path)
    result = result_of(folder.scenario, folder, {}, end.get("stopped"),
                       end.get("drained", False), crashed=end.get("crashed"))
    result["interrupted"] = bool(end.get("interrupted"))
    return result, folder


def _check_trace_prompts(scenario, trace, count: int) -> None:
    """A trace's prompts must fit the scenario's bound on a prompt (workload.prompt.
    max_tokens), which sizes the core's model (sim/fold.py prompt_pages_max): a longer one
    is a clear error naming it, not an arrival the core refuses mid-run."""
    bound = scenario.workload.prompt.max_tokens
    for k, request in enumerate(trace.requests[:count]):
        if request.prompt_tokens > bound:
            raise ScenarioError(
                f"{trace.path}: request {k + 1} has a prompt of {request.prompt_tokens} "
                f"tokens, more than workload.prompt.max_tokens ({bound}); raise it "
                f"(--set workload.prompt.max_tokens={max(r.prompt_tokens for r in trace.requests[:count])})")
