"""From the engine's thread to asyncio, and back for aborts.

The engine calls a request's `on_event` on its own thread (engine/service.py); `Choices`
merges the events of a request's choices (n > 1, several prompts) into one queue, tagged
with the choice's index. Events cross to the event loop through one `LoopInbox` per loop:
the engine thread appends to a list, and only the first event since the last hand-over
costs a `call_soon_threadsafe` (a write to the loop's wake-up pipe); the loop then moves
everything pending into the choices' queues in one callback. A decode step emits one token
per running request, so 32 streams cost one wake-up a step rather than 32.

Aborts. A client that goes away (queued, mid-prefill, mid-stream, while a non-streaming
answer is being gathered) must cost the engine exactly one `abort(request_id)` per choice
still live, and none for a choice already finished: `abort_unfinished` is idempotent and
every exit path of a handler (return, error, cancellation) runs it in a `finally`.
`until_disconnect` is how a handler that is not streaming notices the client left: the
ASGI server sends `http.disconnect` on the request's receive channel.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass, field

from engine.service import Event, Finished, GenerationRequest, TokenOut


@dataclass
class Choice:
    index: int
    request_id: int | None = None
    finished_in_engine: bool = False  # set on the engine's thread
    aborted: bool = False
    finished: Finished | None = None
    tokens: list[TokenOut] = field(default_factory=list)
    last_token_s: float | None = None


class LoopInbox:
    """Events from the engine's thread for the queues of one event loop, handed over in
    batches: one `call_soon_threadsafe` per batch, not per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: list = []  # (queue, item), in the engine's order
        self._scheduled = False
        self._lock = threading.Lock()

    def put(self, queue: asyncio.Queue, item) -> None:  # the engine's thread
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone, nobody is listening

    def _hand_over(self) -> None:  # the event loop's thread
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, item in pending:
            queue.put_nowait(item)


_INBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def inbox_of(loop: asyncio.AbstractEventLoop) -> LoopInbox:
    """The one LoopInbox of `loop` (made on first use, from the loop's own thread)."""
    inbox = _INBOXES.get(loop)
    if inbox is None:
        inbox = _INBOXES[loop] = LoopInbox(loop)
    return inbox


class Choices:
    """The engine requests behind one HTTP request, as one stream of (index, event)."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.inbox = inbox_of(loop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []
        self._lock = threading.Lock()
        self.received_s = time.perf_counter()

    def submit(self, request: GenerationRequest) -> Choice:
        """Submit one choice; a Refused from the engine propagates (nothing allocated)."""
        choice = Choice(index=len(self.choices))
        self.choices.append(choice)
        choice.request_id = self.engine.submit(request, lambda event: self._deliver(choice, event))
        return choice

    def _deliver(self, choice: Choice, event: Event) -> None:  # the engine's thread
        if isinstance(event, Finished):
            with self._lock:
                choice.finished_in_engine = True
        self.inbox.put(self.queue, (choice.index, event))

    async def next(self) -> tuple[Choice, Event]:
        index, event = await self.queue.get()
        choice = self.choices[index]
        if isinstance(event, Finished):
            choice.finished = event
        return choice, event

    def live(self) -> int:
        return sum(choice.finished is None for choice in self.choices)

    def abort_unfinished(self) -> int:
        """abort() once for every choice the engine has not finished; returns how many."""
        aborted = 0
        for choice in self.choices:
            with self._lock:
                skip = choice.finished_in_engine or choice.aborted or choice.request_id is None
                choice.aborted = choice.aborted or not skip
            if not skip:
                self.engine.abort(choice.request_id)
                aborted += 1
        return aborted


async def until_disconnect(request) -> None:
    """Returns when the client has gone (its request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request, awaitable):
    """The awaitable's result, or None (the awaitable cancelled) if the client left first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        return None
    finally:
        for task in (work, watcher):
            if not task.done():
                task.cancel()
