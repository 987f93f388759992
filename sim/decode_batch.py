"""One decode worker's continuous batch, stepped without visiting every sequence.

Continuous batching: sequences wait for a place (at most decode_batch_max in the batch),
join at the start of a step, and every step adds one token to every sequence in the batch.
A step's time depends on the batch's size and on the sum of its contexts (prompt plus the
tokens generated so far).

Because every step adds one token to everyone, a sequence's tokens are the steps since it
joined, and the step it finishes in is known when it joins. So the batch keeps its size,
the sum of its contexts (grown by the size at each step), and a heap of sequences by the
step they finish in; a step touches only the sequences that emit their first token in it
(those that joined just before) or finish in it, not all of them (the simulator used to
increment every sequence on every step).

A sequence is a list [request, tokens wanted, prompt context, step it joined (None while
waiting or once it left), join order]; the request becomes -1 when decode stops it early
(StopDecoding), and the batch forgets it lazily.
"""

from __future__ import annotations

from collections import deque
from heapq import heappop, heappush

REQUEST, WANTED, PROMPT_CONTEXT, JOINED, ORDER = range(5)


class DecodeBatch:
    __slots__ = ("waiting", "finishing", "new", "size", "context_tokens", "steps",
                 "stepping", "joins", "step_ends_s")

    def __init__(self) -> None:
        self.waiting: deque = deque()   # sequences waiting for a place, in order
        self.finishing: list = []       # heap of (finishing step, join order, sequence)
        self.new: list = []             # joined for the step under way: first token next
        self.size = 0                   # sequences in the batch
        self.context_tokens = 0         # the sum of their contexts
        self.steps = 0                  # steps completed
        self.stepping = False
        self.joins = 0
        self.step_ends_s = 0.0          # when the step under way ends (set by its scheduler)

    @staticmethod
    def sequence(r: int, wanted: int, prompt_tokens: int) -> list:
        return [r, wanted, prompt_tokens, None, -1]

    def add(self, sequence: list) -> None:
        self.waiting.append(sequence)

    def fill(self, batch_max: int) -> None:
        """Waiting sequences join while there is room (stopped ones are dropped)."""
        waiting = self.waiting
        while waiting and self.size < batch_max:
            sequence = waiting.popleft()
            if sequence[REQUEST] < 0:
                continue
            sequence[JOINED], sequence[ORDER] = self.steps, self.joins
            self.joins += 1
            heappush(self.finishing, (self.steps + max(1, sequence[WANTED]), sequence[ORDER],
                                      sequence))
            self.new.append(sequence)
            self.size += 1
            self.context_tokens += sequence[PROMPT_CONTEXT]

    def stop(self, sequence: list) -> None:
        """Decode stops a sequence early: it leaves the batch now (its context with it)."""
        sequence[REQUEST] = -1
        if sequence[JOINED] is not None:
            self._leave(sequence)

    def _leave(self, sequence: list) -> None:
        self.size -= 1
        self.context_tokens -= sequence[PROMPT_CONTEXT] + self.steps - sequence[JOINED]
        sequence[JOINED] = None
        assert self.size >= 0 and self.context_tokens >= 0, "a sequence left the batch twice"

    def step(self) -> tuple[list, list]:
        """A step ended: every sequence has one more token. Returns the sequences that emit
        their first token now and those that finished now (they have left the batch), each
        in batch order (join order); `in_order` interleaves them."""
        self.steps += 1
        self.context_tokens += self.size
        first, self.new = self.new, []
        done = []
        heap = self.finishing
        while heap and heap[0][0] <= self.steps:
            sequence = heappop(heap)[2]
            if sequence[REQUEST] >= 0 and sequence[JOINED] is not None:
                self._leave(sequence)
                done.append(sequence)
        return first, done

    @staticmethod
    def in_order(first: list, done: list) -> list[tuple[list, bool, bool]]:
        """(sequence, first token now, finished now) in batch order, as one pass over the
        batch would meet them."""
        finished = {id(s) for s in done}
        started = {id(s) for s in first}
        merged = sorted({id(s): s for s in first + done}.values(), key=lambda s: s[ORDER])
        return [(s, id(s) in started, id(s) in finished) for s in merged]
