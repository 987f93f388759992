"""The prefill and decode workers' data path: pools, model steps, checksums, tag checks.

A worker here owns tensors and runs the model; it decides nothing about the protocol.
Which pages a request gets, when its KV may be sent, when a tag is written and when pages
come back are the core's decisions, which engine/runtime.py takes through the store and
hands to these workers as commands. What a worker reports back is *observed*: the checksum
verdict over the pages that landed, the tag verdict of every read.

Tags. The core's page tag is the generation decode reserved the page at; a write carries
the tag it was addressed with and the page takes it when the write lands. The pool stores
`pack_tag(0, generation)`: the generation is already unique per page over the page's
life (the core bumps it at every Reserve), and putting the owner's id beside it would
hide exactly what the NoGenBump switch models (a reused page whose late write looks
current), so the engine's tag is the core's tag, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from engine.generate import Request, Sequence, decode_step, prefill_step
from engine.model import LlamaModel
from engine.pool import KVPool, PoolConfig
from engine.sampling import sample

TAG_OWNER = 0  # see the module header: the tag is the core's generation


def page_tag(generation: int) -> int:
    return kernels.pack_tag(TAG_OWNER, generation)


@dataclass
class PrefillWorker:
    """Computes prompts into source pages, chunk by chunk, and samples the first token."""

    model: LlamaModel
    pool_config: PoolConfig
    chunk_tokens: int
    name: str = "prefill-0"
    queue: list = field(default_factory=list)  # requests the core queued here, FIFO
    computing: list = field(default_factory=list)  # Sequences on source pages

    def __post_init__(self) -> None:
        self.pool = KVPool(self.pool_config)

    def start(self, request: Request, source_pages: tuple[int, ...]) -> Sequence:
        """Compute as much of the prompt as the admitted source pages hold: the whole
        prompt, unless the core admitted a one-page placeholder (FinishedNotRejected)."""
        tokens = min(len(request.prompt_ids), len(source_pages) * self.pool.page_tokens)
        held = Request(request.request_id, request.prompt_ids[:tokens], request.sampling)
        device = self.model.device
        sequence = Sequence(request=held, pages=list(source_pages),
                            page_tensor=torch.tensor(source_pages, dtype=torch.int32,
                                                     device=device),
                            tag_tensor=torch.empty(0, dtype=torch.int64),
                            generator=request.sampling.make_generator(device))
        self.computing.append(sequence)
        return sequence

    def stop(self, request_id: int) -> None:
        self.computing = [s for s in self.computing if s.request.request_id != request_id]
        if request_id in self.queue:
            self.queue.remove(request_id)

    def step(self) -> list[tuple[Sequence, int, torch.Tensor]]:
        """One chunked prefill step; (sequence, first token, its logits) per completed
        prompt, whose source pages are sealed (checksummed) before anything sends them."""
        if not self.computing:
            return []
        completed = prefill_step(self.model, self.pool, self.computing, self.chunk_tokens)
        out = []
        for sequence, logits in completed:
            self.computing.remove(sequence)
            self.pool.seal(sequence.pages)
            token = sample(logits[None], [sequence.request.sampling], [sequence.generator])[0]
            out.append((sequence, token, logits))
        return out

    def checksum(self, page: int) -> int:
        return int(self.pool.checksums[page].item())


@dataclass
class DecodeWorker:
    """Continuous batching over the decode pool; reports the tag verdict of every read."""

    model: LlamaModel
    pool_config: PoolConfig
    max_batch: int
    name: str = "decode-0"
    running: list = field(default_factory=list)  # Sequences, in the order they started
    received: dict = field(default_factory=dict)  # request -> {decode page: checksum sent}

    def __post_init__(self) -> None:
        self.pool = KVPool(self.pool_config)

    def landed(self, request: int, page: int, checksum: int, generation_tag: int) -> None:
        """A write of `request` landed in `page` with this tag (the core's LandWrite)."""
        self.pool.set_tags([page], [page_tag(generation_tag)])
        self.received.setdefault(request, {})[page] = checksum

    def checksums_ok(self, request: int) -> bool:
        """Observed: every page that landed for `request` holds the bytes its sender
        checksummed (KVPool.verify over the landed pages)."""
        got = self.received.get(request, {})
        if not got:
            return True
        pages = sorted(got)
        return bool(self.pool.verify(pages, [got[p] for p in pages]).all())

    def start(self, request: Request, table: tuple, generator) -> Sequence:
        """A sequence on its reserved pages, expecting the tags the core reserved them at;
        the runtime appends the first token (sampled by the prefill)."""
        pages = [page for page, _ in table]
        device = self.model.device
        sequence = Sequence(request=request, pages=pages,
                            page_tensor=torch.tensor(pages, dtype=torch.int32, device=device),
                            tag_tensor=torch.tensor([page_tag(g) for _, g in table],
                                                    dtype=torch.int64, device=device),
                            generator=generator, prefilled_tokens=len(request.prompt_ids))
        self.running.append(sequence)
        return sequence

    def stop(self, request_id: int) -> None:
        self.running = [s for s in self.running if s.request.request_id != request_id]
        self.received.pop(request_id, None)

    def tags_current(self, sequence: Sequence) -> bool:
        """Observed at Finish: every page of the table carries the tag decode reserved it
        with (the kernel checked the pages it read on every step; this reads the rest)."""
        return bool((self.pool.tags[sequence.page_tensor.long()] == sequence.tag_tensor).all())

    def step(self) -> list[tuple[Sequence, bool, torch.Tensor | None]]:
        """One decode step over up to max_batch running sequences: (sequence, tag check
        passed, logits row) each; a sequence that failed the check gets no logits."""
        batch = self.running[:self.max_batch]
        if not batch:
            return []
        logits, tag_ok = decode_step(self.model, self.pool, batch, check_tags=True)
        flags = tag_ok.tolist()
        return [(s, ok, logits[i] if ok else None) for i, (s, ok) in enumerate(zip(batch, flags))]

    def kv_of(self, sequence: Sequence, tokens: int) -> torch.Tensor:
        """The K/V decode reads for the first `tokens` positions of a sequence: [tokens,
        layers, 2, kv_heads, dim], for tests that compare it with the request's own KV."""
        return kv_rows(self.pool, sequence.pages, tokens)


def kv_rows(pool: KVPool, pages, tokens: int) -> torch.Tensor:
    """[tokens, layers, 2, kv_heads, dim]: positions 0..tokens-1 of a block table."""
    page_tokens = pool.page_tokens
    used = pages[:-(-tokens // page_tokens)]
    kv = pool.kv[torch.as_tensor(used, dtype=torch.long)]  # [p, L, 2, H, T, D]
    kv = kv.permute(0, 4, 1, 2, 3, 5).reshape(-1, *kv.shape[1:4], kv.shape[5])
    return kv[:tokens].clone()
