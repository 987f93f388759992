"""Delivery: the messages between the runtime's workers, each taken when the core allows.

Theory of operation. A message in flight between the prefill and decode workers
(bootstrap, page table, final word, cancel, client gone) and the runtime's own pending
moves (post the computed pages, send Done, release) are a request's "wants". Every loop
iteration `_deliver` offers each want, in request order, to `_try`: it asks the core
which action consumes that message now (`core.consumer`, or the named action's guard),
and takes it through `Runtime.take`, with what the action needs (free pages for a
Reserve, the observed checksum verdict for an Accept). A want that the core cannot
consume yet stays; one that can never be consumed any more is dropped (`core.message_pending`).
The prefill's admission queue (`_admit`) is the same idea for Admit and Reject.

`Delivery` is a part of `engine.runtime.Runtime` (a mixin): it uses the runtime's store,
core model, workers, `live` requests and `take`, and decides nothing itself.
"""

from __future__ import annotations

from dataclasses import replace

from engine.service import TenantCache
from engine.streaming import Live
from spec import core

# The runtime's own wants besides messages: post the computed pages, send Done, release.
GONE_PREFILL, GONE_DECODE = "client gone@prefill", "client gone@decode"
SEND, DONE, RELEASE = "send pages", "done", "release"


class Delivery:
    """Wants and admission, for `engine.runtime.Runtime`."""

    def _deliver(self) -> bool:
        busy = False
        for r in sorted(self.live):
            live = self.live.get(r)
            if live is None or not live.wants:
                continue
            for what in sorted(live.wants):
                if r not in self.store.rows:
                    break
                busy |= self._try(live, what)
        return busy

    def _try(self, live: Live, what: str) -> bool:
        """Take the action that consumes a message now, if the core enables one."""
        r, m, view = live.request_id, self.core_model, self._view(live.request_id)
        row = self._row(r)
        if what == RELEASE:
            d = self.store.placement[r][1]  # (a settled request is forgotten at once)
            done = core.is_enabled(m, view, r, core.Release) and self.take(r, core.Release(r))
            if done and m.prefix_cache:
                self._evict_unshareable(live, row, d)
            return self._settle(live, what, done or row[core.DST] != core.CLOSING)
        if what == SEND:
            return self._send_pages(live, view)
        if what == DONE:
            done = core.is_enabled(m, view, r, core.SendDone) and self.take(r, core.SendDone(r))
            if done:
                live.count_sent = row[core.SENT]
                if m.prefill_cache:
                    self._prefill_evict_unshareable(live, row)
            return self._settle(live, what, done or row[core.PST] != core.RUNNING)
        message, worker = {GONE_PREFILL: (core.CLIENT_GONE, "prefill"),
                           GONE_DECODE: (core.CLIENT_GONE, "decode")}.get(what, (what, None))
        action = core.consumer(m, view, r, message, worker)
        if action is None:
            return self._settle(live, what, not core.message_pending(row, message, worker))
        if action is core.Reserve:
            if self.sibling_waits(r):
                return False  # a sibling: its first's transfer is under way (a policy)
            d, need = self.store.placement[r][1], core.allocation_need(m, view, action, r)
            pages = self.store.allocate("decode", d, need)
            if pages is None and m.prefix_cache and self.evict_for(r, d, need):
                pages = self.store.allocate("decode", d, need)
            if pages is None:
                return False  # decode waits for pages; the bootstrap stays queued
            event = core.Reserve(r, pages)
        elif action is core.Accept:
            live.transfer_fault = self.decode_of(r).transfer_fault(r, row[core.FW_COUNT])
            event = core.Accept(r, not live.transfer_fault)
        else:
            event = action(r)
        taken = self.take(r, event) is not None
        if taken and action is core.Reserve and m.prefix_cache:
            self._count_hit(live)
        return self._settle(live, what, taken)

    def _count_hit(self, live: Live) -> None:
        """What decode's Reserve found cached for the request (the core's HIT)."""
        live.hit_pages = self._row(live.request_id)[core.HIT]
        prefix = self.counts["prefix"]
        prefix["reserved_prompt_pages"] += live.full_pages
        prefix["hit_pages"] += live.hit_pages
        self._count_tenant(live, prompt_pages=live.full_pages, hit_pages=live.hit_pages)

    def _evict_unshareable(self, live: Live, row: tuple, d: int) -> None:
        """After r's Release: the cached pages keyed by r's nonces (its partial last page,
        its output pages: engine/prefix.py) can never be hit; the shell evicts them at
        once instead of letting them push shareable pages out of the cache."""
        pool = self.store.decode_pools[d]
        for page, _ in row[core.TABLE][live.full_pages:]:
            if pool[page][core.IDENT] and not pool[page][core.READERS]:
                self.evict(d, page, "unshareable")

    def _prefill_evict_unshareable(self, live: Live, row: tuple) -> None:
        """After r's SendDone: the prefill's cached pages keyed by r's nonces (its partial
        last page, its output pages) can never be hit; evicted at once, as decode's."""
        p = self.store.placement[live.request_id][0]
        pool = self.store.prefill_pools[p]
        for page in row[core.SRC][live.full_pages:]:
            if pool[page][core.P_IDENT] and not pool[page][core.P_READERS]:
                self.prefill_evict(p, page, "unshareable")

    def _send_pages(self, live: Live, view) -> bool:
        """Post one write per computed source page, as long as the core allows SendPage
        (it waits for decode's page table when the prefill admitted before it came:
        AdmitBeforeReserve); then wait to send Done."""
        r, m = live.request_id, self.core_model
        posted = False
        while core.is_enabled(m, view, r, core.SendPage):
            posted |= self.take(r, core.SendPage(r)) is not None
        row = self.store.rows.get(r)
        if row is None or row[core.PST] != core.RUNNING:
            live.wants.discard(SEND)
        elif row[core.SENT] == core.to_send(row):  # with a prefix cache: the tail only
            live.wants.discard(SEND)
            live.wants.add(DONE)
        return posted

    def _settle(self, live: Live, what: str, finished: bool) -> bool:
        if finished:
            live.wants.discard(what)
        return bool(finished)

    def _admit(self) -> bool:
        busy = False
        for k, worker in enumerate(self.prefills):
            busy |= self._admit_at(k, worker)
        return busy

    def _admit_at(self, k: int, worker) -> bool:
        """A prefill worker's admission queue, in order: Reject what the core says must be
        rejected, admit what has its page table and fits; a request waiting for its table
        does not block those behind it, one waiting for pages does."""
        busy = False
        m = self.core_model
        for r in list(worker.queue):
            if r not in self.store.rows or self._row(r)[core.PST] != core.QUEUED:
                worker.queue.remove(r)
                continue
            view = self._view(r)
            if core.is_enabled(m, view, r, core.Reject):
                worker.queue.remove(r)
                busy |= self.take(r, core.Reject(r)) is not None
                continue
            need = core.allocation_need(m, view, core.Admit, r)
            if type(need) is str:
                continue
            if len(worker.computing) >= self.config.max_batch:
                break
            pages = self.store.allocate("prefill", k, need)
            if pages is None and m.prefill_cache and self.prefill_evict_for(r, k, need):
                pages = self.store.allocate("prefill", k, need)
            if pages is None:
                break
            worker.queue.remove(r)
            admitted = self.take(r, core.Admit(r, pages)) is not None
            if admitted and m.prefill_cache:
                self._count_prefill_hit(self.live[r])
            busy |= admitted
        return busy

    def _count_prefill_hit(self, live: Live) -> None:
        """What the prefill's Admit found in its own cache for the request (PCACHED)."""
        live.prefill_hit_pages = self._row(live.request_id)[core.PCACHED]
        counts = self.counts["prefill"]
        counts["admitted_prompt_pages"] += live.full_pages
        counts["hit_pages"] += live.prefill_hit_pages
        self._count_tenant(live, prefill_prompt_pages=live.full_pages,
                           prefill_hit_pages=live.prefill_hit_pages)

    def _count_tenant(self, live: Live, **added: int) -> None:
        """Adds to the request's tenant's figures (TenantCache: a frozen one is replaced,
        so a published snapshot never sees it move)."""
        tenants = self.counts["prefix_tenants"]
        old = tenants.get(live.request.tenant, TenantCache())
        tenants[live.request.tenant] = replace(
            old, **{figure: getattr(old, figure) + count for figure, count in added.items()})

