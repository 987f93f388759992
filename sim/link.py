"""The simulator's transport for messages (spec/interfaces.py Transport): a modelled link.

Theory of operation. A message (bootstrap, final word, cancel, page table) is delivered
after the link's latency, with loss (each loss costs a retransmission, retransmit_after_s;
a bootstrap, final word or cancel lost on message_retransmits_max retransmissions as well is
lost for good, the spec's Lose* action, and the protocol sends it again after
timeouts.resend_after_s, the spec's ResendBootstrap or ResendCancel; a decode crash's notice
is the prefill's failure detector and is never lost for good) and extra delay as faults,
each drawn from the run's "links" stream; a request the fuzzer
holds (`Simulation.hold`) waits until its stall ends, and a worker that is restarting
gets its messages once it is back (the sender re-sends). On delivery the receiving
worker takes the action the core names for the message (Simulation.deliver). Page writes
do not pass here: the prefill worker's NIC (sim/workers.py) times them with the link's
bandwidth, write latency and slow-link faults.
"""

from __future__ import annotations

from spec import commands, core
from sim import fault_hits as hits

# The messages the spec's network may lose for good (Losses), and the spec's action for it.
LOSS = {core.BOOTSTRAP: "LoseBootstrap", core.FINAL_WORD_MSG: "LoseFinalWord",
        core.CANCEL_MSG: "LoseCancel"}
# The protocol's resend of each (the spec's ResendBootstrap, ResendCancel): decode asks again
# for a final word lost on its way with the cancel that AnswerCancel repeats it on.
RESEND = {core.BOOTSTRAP: "ResendBootstrap", core.FINAL_WORD_MSG: "ResendCancel",
          core.CANCEL_MSG: "ResendCancel"}


class SimLink:
    def __init__(self, sim) -> None:
        self.sim = sim
        self.handlers = {core.BOOTSTRAP: sim.on_bootstrap, core.FINAL_WORD_MSG: sim.on_final_word,
                         core.CANCEL_MSG: sim.on_cancel, commands.PAGE_TABLE: sim.on_table}

    def send(self, r: int, message: str, p: int, d: int) -> None:
        """Decode's messages go to the prefill p, the others to decode d."""
        to_prefill = message in (core.CANCEL_MSG, commands.PAGE_TABLE)
        handler = self.handlers[message]
        if to_prefill:
            self.carry(handler, r, p, to_prefill=p, message=message)
        else:
            self.carry(handler, r, d, message=message)

    def carry(self, handler, r: int, worker: int, to_prefill: int = -1,
              message: str = "") -> None:
        """Deliver a message after latency, loss (retransmitted) and delay faults."""
        sim = self.sim
        f, rng = sim.sc.faults, sim.rng["links"]
        delay = sim.sc.link.message_latency_s
        lost = 0
        while f.message_loss_probability and rng.random() < f.message_loss_probability:
            lost += 1
            sim.fault_hits.fired("MessageLoss", hits.stressful_message(message))
            if lost > f.message_retransmits_max and message in LOSS and not self._notice(r):
                sim.fault_hits.fired("MessageLostForGood", hits.stressful_message(message))
                sim.later(delay, self._lose, r, message)
                return
            delay += f.retransmit_after_s
        if f.message_delay_probability and rng.random() < f.message_delay_probability:
            delay += rng.expovariate(1.0 / f.message_delay_mean_s) if f.message_delay_mean_s else 0
            sim.fault_hits.fired("MessageDelay", hits.stressful_message(message))
        loop = sim.compute.loop  # serial_workers: taken between steps (sim/compute.py)
        if loop is not None:
            delay += loop.wait_s(sim.env.now + delay)
        sim.later(delay, self._deliver, handler, r, worker, to_prefill)

    def _notice(self, r: int) -> bool:
        """A decode crash's cancel is the prefill's failure detector, not a message: it is
        late on a bad link but never lost for good (the core's crash_notice)."""
        row = self.sim.cluster.rows.get(r)
        return row is not None and core.crash_notice(self.sim.model, row)

    def _lose(self, r: int, message: str) -> None:
        """The last attempt is lost too: the message is gone, if the core still has it in
        flight (a copy that an earlier one already delivered is nothing to lose). The
        protocol's recovery follows: after timeouts.resend_after_s the router re-sends a
        bootstrap decode has not answered, and decode a cancel the prefill has not answered
        (which has a lost final word repeated); the core takes each only if it is still
        unanswered then (a final word lost while decode waits is the lease's to recover)."""
        if self.sim.offer_if_enabled(LOSS[message], r) is not None:
            self.sim.later(self.sim.sc.timeouts.resend_after_s, self._resend, r, message)

    def _resend(self, r: int, message: str) -> None:
        self.sim.offer_if_enabled(RESEND[message], r)

    def _deliver(self, handler, r: int, worker: int, to_prefill: int) -> None:
        sim = self.sim
        if sim.held_until and sim._held(r, self._deliver, handler, r, worker, to_prefill):
            return
        back = (sim.prefills[to_prefill].down_until if to_prefill >= 0
                else sim.decodes[worker].down_until)
        now = sim.env.now
        if back and back > now:  # 0.0: the worker never went down
            sim.later(back - now, self._deliver, handler, r, worker, to_prefill)
            return
        if r in sim.cluster.rows:
            handler(r, worker)
