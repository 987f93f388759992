"""SimPy's event queue, fed directly: the one place that knows SimPy's internals.

The simulator schedules a few dozen callbacks per request (a landing write, a delivered
message, a decode step, a timer), each "call fn(*args) after delay". SimPy's way is a
Timeout event per call: a Python-level constructor that checks the delay, sets five
attributes and calls `Environment.schedule`. What `Environment.step` needs of an event is
less: it pops `(time, priority, id, event)` off `env._queue`, swaps `event.callbacks` for
None, calls each callback with the event, and then reads `event._ok` (a failed event with
no `_defused` crashes the run). A `Call` is exactly that and nothing more, and `at` pushes
it the way `Environment.schedule` does — the same time, the same NORMAL priority, the next
id from the environment's own counter — so calls and SimPy's own events (processes, the
run's `until`) interleave exactly as they would with Timeouts: same order, same ties, a
byte-identical log (tests/test_sim_schedule.py compares the two orders).

Written against SimPy 4.1 (`Environment._queue`, `_eid`, `_now`; `events.NORMAL`). If a
SimPy release changes them, this file is what breaks, and the test says so.
"""

from __future__ import annotations

from heapq import heappush

from simpy.events import NORMAL


class Call:
    """A scheduled fn(*args): the least an object needs to be an event to `Environment.step`."""

    __slots__ = ("callbacks", "fn", "args")
    _ok = True  # never fails

    def __init__(self, callbacks: tuple, fn, args: tuple) -> None:
        self.callbacks = callbacks
        self.fn, self.args = fn, args


class Scheduler:
    """`at(delay_s, fn, *args)`: fn(*args) after delay_s simulated seconds on `env`; and
    `pending`, the calls scheduled and not yet made (the simulation is at rest when none
    is left and every request has arrived)."""

    __slots__ = ("env", "queue", "ids", "callbacks", "pending")

    def __init__(self, env) -> None:
        self.env = env
        self.queue, self.ids = env._queue, env._eid
        # One tuple shared by every call: step() only reads it (a Timeout's is a new list).
        self.callbacks = (self._run,)
        self.pending = 0

    def at(self, delay_s: float, fn, *args) -> None:
        if delay_s < 0:
            raise ValueError(f"negative delay {delay_s}")  # as SimPy's Timeout says
        self.pending += 1
        heappush(self.queue, (self.env._now + delay_s, NORMAL, next(self.ids),
                              Call(self.callbacks, fn, args)))

    def _run(self, call: Call) -> None:
        """The callback of every Call: step() hands it the call."""
        self.pending -= 1
        assert self.pending >= 0, "a call was made that was never scheduled"
        call.fn(*call.args)
