"""The runtime's loop: one iteration of the protocol-driven engine, and its data-path steps.

Theory of operation. `step()` runs, in this order: deliver the messages in flight
(engine/delivery.py), admit at every prefill worker, one chunked prefill step per prefill
worker (a completed prompt wants its pages sent; a request whose own compute failed is the
core's PrefillFail), the page writes the transport delivers (LandWrite, then the copy and
the tag), one decode step per decode worker over its continuous batch (a token per
request, streamed by engine/streaming.py; Finish with the observed tag verdict when a
request stops or fails its tag check), and the timers that are due. Each protocol move
goes through
`Runtime.take`; the steps here only observe the data path and report it.

`Loop` is a part of `engine.runtime.Runtime` (a mixin): it uses the runtime's workers,
transport, store, `live` requests, `take` and `_deliver` / `_admit`.
"""

from __future__ import annotations

import torch

from engine.delivery import SEND
from engine.sampling import sample
from engine.streaming import Live, next_token
from engine.transport import PageWrite
from engine.workers import PrefillFault, kv_rows
from spec import core


class Loop:
    """`step()` and what it runs, for `engine.runtime.Runtime`."""

    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        busy = self._deliver()
        busy |= self._admit()
        busy |= self._prefill_step()
        busy |= self._land()
        busy |= self._decode_step()
        busy |= self._timers()
        return busy

    def _prefill_step(self) -> bool:
        busy = False
        for worker in self.prefills:
            if worker.computing:
                busy = True
                self._prefill_on(worker)
        return busy

    def _prefill_on(self, worker) -> None:
        before = {s.request.request_id: s.prefilled_tokens for s in worker.computing}
        completed, faults = worker.step()
        self._count_computed(worker, before, completed)
        self._renew_progress(worker, before, completed)
        for fault in faults:
            self._prefill_failed(fault)
        for sequence, token, logits in completed:
            r = sequence.request.request_id
            live = self.live[r]
            live.first = (token, logits, sequence.generator)
            if self.config.keep_kv:
                self.prompt_kv[r] = kv_rows(worker.pool, sequence.pages,
                                            len(sequence.prompt_ids))
            live.wants.add(SEND)

    def _count_computed(self, worker, before: dict, completed: list) -> None:
        """The prompt tokens this step ran through the model (a failed chunk's are not)."""
        sequences = [s for s, _, _ in completed] + worker.computing
        self.counts["prefill"]["computed_tokens"] += sum(
            s.prefilled_tokens - before[s.request.request_id] for s in sequences
            if s.request.request_id in before)

    def _renew_progress(self, worker, before: dict, completed: list) -> None:
        """A prefill step renews the lease of every request whose chunk it computed and,
        when it computed anything, of every request queued at this worker (its queue
        moves); a step that computed nothing renews nothing."""
        advanced = [s.request.request_id for s, _, _ in completed]
        advanced += [s.request.request_id for s in worker.computing
                     if s.prefilled_tokens > before.get(s.request.request_id, 0)]
        if not advanced:
            return
        for r in advanced + list(worker.queue):
            self.renew(r)

    def _prefill_failed(self, fault: PrefillFault) -> None:
        """The request's own prefill compute failed (the worker took it out of its batch
        and zeroed its source pages): the core decides what follows (PrefillFail: the
        client's ErrPrefill, the Abort final word to decode, the source pages back). When
        it refuses (a cancel or a client abort got there first), the prefill stops on that
        message instead (PrefillAbort), as it would have."""
        r = fault.sequence.request.request_id
        self.live[r].detail = fault.detail
        self.take(r, core.PrefillFail(r))

    def _land(self) -> bool:
        writes = self.transport.ready()
        self._land_all(writes)
        return bool(writes)

    def land_only(self, predicate) -> int:
        """Tests and fuzzers: land exactly the in-flight writes matching `predicate` now,
        whatever the transport's own order (how the zoo's interleavings are built)."""
        writes = self.transport.ready_only(predicate)
        self._land_all(writes)
        return len(writes)

    def _land_all(self, writes: list[PageWrite]) -> None:
        """Each write is the core's LandWrite, in order; the accepted ones land as one
        batch (`Transport.land_many`: over torch.distributed their pages move back to back),
        a refused one is dropped, after the accepted writes before it have landed (a
        transport settles one peer's writes in their order). Every landing is its own: the
        decode worker is told each page's checksum and tag."""
        accepted: list[tuple] = []
        for write in writes:
            r = write.request
            out = self.take(r, core.LandWrite(r, write.decode_page)) if (
                r in self.store.rows) else None
            if out is None:
                self._land_batch(accepted)
                accepted = []
                self.transport.drop(write)
                continue
            accepted.append((write, out))
        self._land_batch(accepted)

    def _land_batch(self, accepted: list[tuple]) -> None:
        if not accepted:
            return
        moved = self.transport.land_many([write for write, _ in accepted])
        for (write, out), landed in zip(accepted, moved):
            if not landed:
                continue  # lost on the way (a transport fault): decode's data path never saw it
            (page, value), = out.decode
            self.decodes[write.decode].landed(write.request, page, write.checksum,
                                              value[core.TAG], value[core.TAG_IDENT])

    def _decode_step(self) -> bool:
        busy = False
        for worker in self.decodes:
            busy |= self._decode_on(worker)
        return busy

    def _decode_on(self, worker) -> bool:
        results = worker.step()
        for sequence, ok, logits in results:
            live = self.live[sequence.request.request_id]
            if not ok:
                live.tags_ok = False
                live.finish_reason = None
                self._keep_read_kv(live)
                self.take(live.request_id, core.Finish(live.request_id, False))
                continue
            token = sample(logits[None], [sequence.request.sampling], [sequence.generator])[0]
            self._next_token(live, token, logits)
        return bool(results)

    def _timers(self) -> bool:
        now = self.clock.read()
        due = [r for r, at in self.timers.items() if at <= now]
        for r in due:
            del self.timers[r]
            self.take(r, core.Timeout(r))
        return bool(due)


    # -- a request's tokens and its end ---------------------------------------------------

    def _next_token(self, live: Live, token: int, logits: torch.Tensor) -> None:
        """Append and stream a sampled token; end decoding when the request stops."""
        reason = next_token(live, token, logits, self.tokenizer)
        if reason is not None:
            self._end_decoding(live, reason)

    def _keep_read_kv(self, live: Live) -> None:
        if self.config.keep_kv:
            pool = self.decode_of(live.request_id).pool
            self.read_kv[live.request_id] = kv_rows(pool, live.sequence.pages,
                                                    len(live.request.prompt_ids))

    def leaked(self, r: int) -> bool:
        """The leak oracle (needs keep_kv): decode read prompt KV other than what the
        request's own prefill computed, compared bit for bit over the computed tokens."""
        own, read = self.prompt_kv[r], self.read_kv[r]
        return not torch.equal(read[:own.shape[0]], own)

    def _end_decoding(self, live: Live, reason: str) -> None:
        live.finish_reason = reason
        self._keep_read_kv(live)
        tags_ok = live.tags_ok and self.decode_of(live.request_id).tags_current(live.sequence)
        self.take(live.request_id, core.Finish(live.request_id, tags_ok))

