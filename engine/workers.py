"""The prefill and decode workers' data path: pools, model steps, checksums, tag checks.

A worker here owns tensors and runs the model; it decides nothing about the protocol.
Which pages a request gets, when its KV may be sent, when a tag is written and when pages
come back are the core's decisions, which engine/runtime.py takes through the store and
hands to these workers as commands. What a worker reports back is *observed*: the checksum
verdict over the pages that landed, the tag verdict of every read.

Tags. The core's page tag is the generation decode reserved the page at and, with a prefix
cache, the content identity its tokens and salt imply (core.tag_ident: the spec's TagIdent).
A write carries the generation it was addressed with; the page takes it when the write
lands, with the identity decode writes for the page's place in the writer's table
(core.written_ident). The pool stores `pack_tag(ident_owner(identity), generation)`: the
owner field is a 31-bit digest of the identity, TAG_OWNER for none (without a prefix
cache, and with NoIdentTag). The generation is unique per page over the page's life (the
core bumps it at every Reserve), and putting a request's id beside it would hide exactly
what the NoGenBump switch models (a reused page whose late write looks current). The
identity digest is what makes a page reached under a wrong key (NoSalt) fail its read;
two identities share a digest with probability 2**-31 per page read, the check's only
blind spot (the spec leaves hash collisions out, as it does for cache keys).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace
from hashlib import blake2b

import torch

import kernels
from engine.generate import Request, Sequence, decode_step, plan_chunks
from engine.model import LlamaModel
from engine.pool import KVPool, PoolConfig
from engine.sampling import sample

TAG_OWNER = 0  # see the module header: the tag is the core's generation

# What a prefill's model step may raise for the requests it computes (out of memory, a
# kernel or CUDA error: torch raises RuntimeError or a subclass). The request whose chunk
# raised fails with PrefillFail; anything else raised is a bug and ends the loop, and so
# do the RuntimeError subclasses that only code raises (NotImplementedError, RecursionError).
COMPUTE_FAULTS = (RuntimeError,)
CODE_BUGS = (NotImplementedError, RecursionError)


@dataclass(frozen=True)
class PrefillFault:
    """A request whose own prefill compute failed, and how (the client's error detail)."""

    sequence: Sequence
    detail: str


def _described(error: BaseException) -> str:
    return f"the prefill's model step raised {type(error).__name__}: {error}"


def ident_owner(ident: tuple) -> int:
    """The owner field of a page tag naming content identity `ident` (salt, tokens): a
    31-bit digest of it; TAG_OWNER for no identity."""
    if not ident:
        return TAG_OWNER
    salt, tokens = ident
    digest = blake2b(array("Q", (salt, *tokens)).tobytes(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % kernels.OWNER_LIMIT


def page_tag(generation: int, ident: tuple = ()) -> int:
    return kernels.pack_tag(ident_owner(ident), generation)


@dataclass
class PrefillWorker:
    """Computes prompts into source pages, chunk by chunk, and samples the first token."""

    model: LlamaModel
    pool_config: PoolConfig
    chunk_tokens: int
    name: str = "prefill-0"
    # With a prefill-side prefix cache: a page past the core's pool (its index), where the
    # one token a prompt cached whole recomputes writes its K/V (see `spare_cached`).
    scratch_page: int | None = None
    queue: list = field(default_factory=list)  # requests the core queued here, FIFO
    computing: list = field(default_factory=list)  # Sequences on source pages

    def __post_init__(self) -> None:
        self.pool = KVPool(self.pool_config)

    def start(self, request: Request, source_pages: tuple[int, ...],
              cached_pages: int = 0) -> Sequence:
        """Compute as much of the prompt as the admitted source pages hold: the whole
        prompt, unless the core admitted a one-page placeholder (FinishedNotRejected).
        The first `cached_pages` sources are pages the core found in the prefill's cache
        (the core's PCACHED): full pages of this prompt's prefix whose KV another request
        computed. Attention reads them; the prompt is computed from the first position
        after them, or from its last token when they hold all of it (its logits are the
        first token's)."""
        page_tokens = self.pool.page_tokens
        tokens = min(len(request.prompt_ids), len(source_pages) * page_tokens)
        assert cached_pages * page_tokens <= tokens, "a cached page is a full prompt page"
        assert not cached_pages or self.scratch_page is not None, "no prefill-side cache"
        held = Request(request.request_id, request.prompt_ids[:tokens], request.sampling)
        device = self.model.device
        sequence = Sequence(request=held, pages=list(source_pages),
                            page_tensor=torch.tensor(source_pages, dtype=torch.int32,
                                                     device=device),
                            tag_tensor=torch.empty(0, dtype=torch.int64),
                            generator=request.sampling.make_generator(device),
                            prefilled_tokens=min(cached_pages * page_tokens, tokens - 1),
                            cached_pages=cached_pages)
        self.computing.append(sequence)
        return sequence

    def spare_cached(self, plan: list) -> list:
        """The plan with no K/V written into a cached page: a chunk that recomputes a
        position inside one (only the last token of a prompt cached whole) writes it to the
        scratch page instead. Its attention reads the cached page's K/V for that position,
        which the same tokens computed; a page other requests read, or a write in flight
        reads out of, is never changed under them (its checksum was sealed once)."""
        page_tokens = self.pool.page_tokens
        out = []
        for sequence, chunk in plan:
            inside = sequence.cached_pages * page_tokens - chunk.start_position
            if inside > 0:
                slots = chunk.slots.clone()
                slots[:inside] = (self.scratch_page * page_tokens
                                  + torch.arange(inside, device=slots.device) % page_tokens)
                chunk = replace(chunk, slots=slots)
            out.append((sequence, chunk))
        return out

    def stop(self, request_id: int) -> None:
        self.computing = [s for s in self.computing if s.request.request_id != request_id]
        if request_id in self.queue:
            self.queue.remove(request_id)

    def step(self) -> tuple[list[tuple[Sequence, int, torch.Tensor]], list[PrefillFault]]:
        """One chunked prefill step: (sequence, first token, its logits) per completed
        prompt, whose source pages are sealed (checksummed) before anything sends them, and
        the sequences whose own compute failed (see `compute`), out of `computing` now."""
        if not self.computing:
            return [], []
        plan = self.spare_cached(plan_chunks(self.computing, self.chunk_tokens,
                                             self.model.device, self.pool.page_tokens))
        computed, faults = self.compute(plan)
        for fault in faults:
            self.computing.remove(fault.sequence)
            self.scrub(fault.sequence)
        completed = []
        for sequence, chunk, logits in computed:
            sequence.prefilled_tokens = chunk.start_position + len(chunk.token_ids)
            if sequence.prefilled_tokens < len(sequence.prompt_ids):
                continue
            self.computing.remove(sequence)
            self.pool.seal(sequence.pages[sequence.cached_pages:])  # cached: sealed once
            token = sample(logits[None], [sequence.request.sampling], [sequence.generator])[0]
            completed.append((sequence, token, logits))
        return completed, faults

    def compute(self, plan: list) -> tuple[list, list[PrefillFault]]:
        """The plan's chunks in one model step: ((sequence, chunk, logits) per chunk that
        computed cleanly, a PrefillFault per chunk that did not). A step that raises one of
        COMPUTE_FAULTS is retried chunk by chunk (at most once each), so that a fault that
        one request's chunk causes fails that request alone; a chunk whose logits or
        freshly written K/V hold a non-finite value fails its own request."""
        try:
            logits = self.model.prefill(self.pool, [chunk for _, chunk in plan])
        except COMPUTE_FAULTS as error:
            if isinstance(error, CODE_BUGS):
                raise
            if len(plan) == 1:
                return [], [PrefillFault(plan[0][0], _described(error))]
            computed, faults = [], []
            for one in plan:
                done, failed = self.compute([one])
                computed += done
                faults += failed
            return computed, faults
        finite = self.finite(plan, logits)
        computed = [(s, chunk, logits[i]) for i, (s, chunk) in enumerate(plan) if finite[i]]
        faults = [PrefillFault(s, "the prefill computed non-finite logits or K/V")
                  for i, (s, _) in enumerate(plan) if not finite[i]]
        return computed, faults

    def finite(self, plan: list, logits: torch.Tensor) -> list[bool]:
        """Per chunk: its last token's logits and the K/V it just wrote, every layer, are
        finite (one gather of the step's slots; a NaN in a layer that no logit reads, the
        last layer's K/V, is caught too)."""
        slots = torch.cat([chunk.slots for _, chunk in plan]).long()
        page_tokens = self.pool.page_tokens
        written = self.pool.kv[slots // page_tokens, :, :, :, slots % page_tokens]
        tokens_ok = torch.isfinite(written).flatten(1).all(dim=1)
        bounds = torch.tensor([len(chunk.token_ids) for _, chunk in plan]).cumsum(0)
        chunks_ok = torch.stack([part.all() for part in
                                 torch.tensor_split(tokens_ok, bounds[:-1].tolist())])
        return (chunks_ok & torch.isfinite(logits).all(dim=1)).tolist()

    def scrub(self, sequence: Sequence) -> None:
        """Zero a failed request's source pages before the core frees them: what its step
        wrote is garbage and may be non-finite, and a NaN that attention masks out still
        poisons it (0 x NaN), for whoever reuses the page and for decode's tail pages. The
        cached pages it read are not its own: they stay as they are."""
        self.pool.kv[sequence.page_tensor[sequence.cached_pages:].long()] = 0

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

    def landed(self, request: int, page: int, checksum: int, generation: int,
               ident: tuple = ()) -> None:
        """A write of `request` landed in `page`: the page's tag is the generation it was
        addressed with and the identity decode tags it with (the core's LandWrite)."""
        self.pool.set_tags([page], [page_tag(generation, ident)])
        self.received.setdefault(request, {})[page] = checksum

    def transfer_fault(self, request: int, announced: int) -> str:
        """Observed at Accept, "" when the transfer is sound: "count" when fewer or more
        pages landed for `request` than its Done announces (a write that never landed),
        "checksum" when a page that landed does not hold the bytes its sender checksummed
        (KVPool.verify over the landed pages: a bit flipped, a write torn)."""
        got = self.received.get(request, {})
        if len(got) != announced:
            return "count"
        if not got:
            return ""
        pages = sorted(got)
        return "" if bool(self.pool.verify(pages, [got[p] for p in pages]).all()) else "checksum"

    def start(self, request: Request, table: tuple, generator, idents: tuple = ()) -> Sequence:
        """A sequence on its reserved pages, expecting the tags the core reserved them at
        (generations, and the identities of `idents` where given: core.tag_idents); the
        runtime appends the first token (sampled by the prefill)."""
        pages = [page for page, _ in table]
        idents = idents or ((),) * len(table)
        device = self.model.device
        sequence = Sequence(request=request, pages=pages,
                            page_tensor=torch.tensor(pages, dtype=torch.int32, device=device),
                            tag_tensor=torch.tensor([page_tag(g, ident) for (_, g), ident
                                                     in zip(table, idents, strict=True)],
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

    def step(self, batch: list | None = None) -> list[tuple[Sequence, bool, torch.Tensor | None]]:
        """One decode step over up to max_batch running sequences (or `batch`, a batch
        taken from them before: a step on a thread of its own then reads nothing that
        changes under it): (sequence, tag check passed, logits row) each; a sequence that
        failed the check gets no logits."""
        batch = self.running[:self.max_batch] if batch is None else batch
        assert len(batch) <= self.max_batch, f"a batch of {len(batch)} > max_batch"
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
