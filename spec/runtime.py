"""The one runtime: events to the core, the log, and the core's commands carried out.

Theory of operation
-------------------
The simulator (sim/run.py) and the engine (engine/runtime.py) are the same shell in
DESIGN.md's sense, in two worlds. What happens in a world — a request arrives, a
message reaches its worker, a prompt is computed, a write lands, a decode step reads its
pages, a timer lapses, a client goes away — becomes a core event, and `take_event` is the
one path by which any of it reaches the protocol:

1. the core decides on the view of the request's own workers (`core.decide`); a refusal
   changes nothing and is counted by the shell (`refused`);
2. the shell commits the change to its store (`commit`: the simulator's Folder also folds
   it into its metrics), which runs the store's oracles;
3. the event is logged (`event_log.record`, with the one codec, spec/codec.py);
4. an event of core.LEASE_RENEWALS renews the request's lease (`clock.renew`);
5. whoever watches commits (a fuzzer) sees the event and its change (`on_commit`);
6. the shell's own oracles run (`checked`);
7. the decision's commands (spec/commands.py) are carried out through the one handler
   table below, each by its type, at the request's placement, in the order the shell
   chooses for commands of different workers (`order`: concurrent workers);
8. the shell's bookkeeping of a request that moved or settled (`moved`), and, once the
   outermost decision is done, the wants that may have become enabled (`run_wants`).

What differs between a simulated and a real run is behind the interfaces of
spec/interfaces.py (clock, prefill and decode workers, transport, client), each with a
simulated and a real implementation; a hybrid run mixes them. A shell class inherits
`ShellRuntime`, sets the attributes listed in the class docstring and implements the
hooks at the end of this class.

Pure of any world: this module imports only the protocol (spec/).
"""

from __future__ import annotations

from dataclasses import replace

from spec import core  # before spec.commands, which spec.core imports at its end
from spec import commands as cmd
from spec.core import Refusal

# Module globals on the hot path (every event takes them).
_LEASE_RENEWALS = core.LEASE_RENEWALS


class ShellRuntime:
    """The one path into the core and the one table of command handlers.

    A shell sets, before it takes any event: `core_model` (spec.model.Model), `store` (the
    spec/store.py store its decisions are taken on: `view`, `arrive`, `withdraw`), `clock`
    (interfaces.Clock), `prefill_at` / `decode_at` (lists of interfaces.PrefillWorker /
    DecodeWorker, by worker index), `link` (interfaces.Transport), `client`
    (interfaces.Client), `event_log` (an object with `record(now, event, p, d)`, or None) and
    `on_commit` (None, or called as on_commit(event, change) after each commit)."""

    def _start_runtime(self) -> None:
        self.depth = 0           # decisions being carried out (a command may take events)
        self.dirty: list[int] = []  # requests whose wants to ask again at depth 0
        self._handlers = {
            cmd.Send: self._carry_send, cmd.Queue: self._carry_queue,
            cmd.Compute: self._carry_compute, cmd.Post: self._carry_post,
            cmd.ArmTimer: self._carry_arm_timer, cmd.CancelTimer: self._carry_cancel_timer,
            cmd.StartDecoding: self._carry_start_decoding,
            cmd.StopDecoding: self._carry_stop_decoding,
            cmd.ReleaseWhenReady: self._carry_release_when_ready,
            cmd.Answer: self._carry_answer, cmd.FreePages: self._carry_pages_freed,
        }

    # -- the one path into the core ---------------------------------------------------------

    def take_event(self, event: core.Event, count_refusal: bool = True) -> core.Change | None:
        """The core decides; an accepted event is committed, logged and its commands carried
        out (the module docstring's steps). None if the core refused it: counted unless
        `count_refusal` is False (an offer of something the core may not enable yet is no
        race)."""
        r = event.request
        out = self.store.decide(r, event)  # the store's model knows its workers
        if type(out) is Refusal:
            if count_refusal:
                self.refused(out)
            return None
        self.depth += 1
        now = self.clock.now()
        p, d = self.commit(now, r, out, event)
        if self.event_log is not None:
            self.event_log.record(now, event, p, d)
        kind = type(event)
        if kind in _LEASE_RENEWALS:
            self.clock.renew(r, kind, p)
        if self.on_commit is not None:
            self.on_commit(event, out)
        self.checked()
        todo = out.commands
        if todo:  # (a landing write carries out nothing)
            if len(todo) == 1:
                command = todo[0]
                self._handlers[type(command)](command, p, d)
            else:
                self.carry_out(todo, p, d)
        self.moved(r, p)
        self.depth -= 1
        assert self.depth >= 0, "a decision was carried out twice"
        if self.depth == 0 and self.dirty:
            self.run_wants()
        return out

    def take_arrival(self, event: core.Arrive, p: int, d: int) -> core.Change | None:
        """A request arrives, placed on prefill p and decode d by the router: the store
        learns the placement, then the Arrive is taken like any event; a refused arrival
        leaves no trace in the store."""
        r = event.request
        self.store.arrive(r, p, d)
        out = self.take_event(replace(event, prefill_worker=p, decode_worker=d))
        if out is None:
            self.store.withdraw(r)
        return out

    def carry_out(self, todo: tuple, p: int, d: int) -> None:
        """The commands of one decision, at prefill p and decode d (the placement)."""
        if len(todo) > 1:
            todo = self.order(todo)
        handlers = self._handlers
        for command in todo:
            handlers[type(command)](command, p, d)

    # -- the handler table: each command to the interface that carries it out --------------

    def _carry_send(self, c: cmd.Send, p: int, d: int) -> None:
        if c.message == core.CLIENT_GONE:
            self.client.gone(c.request, p, d)
        else:
            self.link.send(c.request, c.message, p, d)

    def _carry_queue(self, c: cmd.Queue, p: int, d: int) -> None:
        self.prefill_at[p].queue_request(c.request)

    def _carry_compute(self, c: cmd.Compute, p: int, d: int) -> None:
        self.prefill_at[p].compute(c.request)

    def _carry_post(self, c: cmd.Post, p: int, d: int) -> None:
        self.prefill_at[p].post(c.write, d)

    def _carry_arm_timer(self, c: cmd.ArmTimer, p: int, d: int) -> None:
        self.clock.arm(c.request)

    def _carry_cancel_timer(self, c: cmd.CancelTimer, p: int, d: int) -> None:
        self.clock.cancel(c.request)

    def _carry_start_decoding(self, c: cmd.StartDecoding, p: int, d: int) -> None:
        self.decode_at[d].start_decoding(c.request)

    def _carry_stop_decoding(self, c: cmd.StopDecoding, p: int, d: int) -> None:
        self.decode_at[d].stop_decoding(c.request)

    def _carry_release_when_ready(self, c: cmd.ReleaseWhenReady, p: int, d: int) -> None:
        self.want(c.request, "decode", "Release")

    def _carry_answer(self, c: cmd.Answer, p: int, d: int) -> None:
        self.client.answer(c.request, c.outcome)

    def _carry_pages_freed(self, c: cmd.FreePages, p: int, d: int) -> None:
        if c.pool == "decode":
            self.decode_at[d].pages_freed(c.request)
        else:
            self.prefill_at[p].pages_freed(c.request)

    # -- hooks a shell implements -----------------------------------------------------------

    def refused(self, refusal: Refusal) -> None:
        """Count a refusal (a real race, or a bad input)."""
        raise NotImplementedError

    def commit(self, now: float, r: int, change: core.Change,
               event: core.Event) -> tuple[int, int]:
        """Commit a decided change of r to the store; r's placement (p, d), read before the
        commit (a settled request leaves the store with it)."""
        raise NotImplementedError

    def checked(self) -> None:
        """The shell's own oracles after a commit (nothing by default)."""

    def order(self, todo: tuple) -> tuple | list:
        """The order in which a decision's commands are carried out (the core's by default;
        the simulator shuffles those of different workers by the run's seed)."""
        return todo

    def moved(self, r: int, p: int) -> None:
        """r changed: the shell's bookkeeping (its wants, a settled request forgotten)."""

    def want(self, r: int, worker: str, what: str) -> None:
        """Carry out `what` (a message r's worker has, or an action of that worker) as soon
        as the core enables it."""
        raise NotImplementedError

    def run_wants(self) -> None:
        """Offer the wants of the requests in `dirty` (called at depth 0)."""
        self.dirty.clear()


# Who carries out a command: the worker whose turn it is (spec/commands.py's table, with
# which each worker of a split state derives its own). Commands of different carriers in one
# decision run concurrently in a distributed deployment (the simulator's `order`).
carrier = cmd.carrier
