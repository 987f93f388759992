"""From the engine's thread to asyncio, and back for aborts.

The engine calls a request's `on_event` on its own thread (engine/service.py); `Choices`
hands each event to the event loop with `call_soon_threadsafe` and merges the events of a
request's choices (n > 1, several prompts) into one queue, tagged with the choice's index.

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


class Choices:
    """The engine requests behind one HTTP request, as one stream of (index, event)."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
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
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice.index, event))
        except RuntimeError:
            pass  # the event loop is closed: the server is gone, nobody is listening

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
