"""A single-process generator: chunked prefill and continuous batching over one paged pool.

Theory of operation. A request becomes a `Sequence` when it is admitted, and it is
admitted only when every page it can ever need (prompt + max_tokens) is free: it reserves
them all at once, the way a decode worker reserves pages before the prefill sends any.
A request that could never fit the pool is rejected before anything is allocated. Each
reserved page gets a fresh ownership tag (the sequence's request id and the page's own
generation, bumped at every allocation), written into the pool's tag tensor; every decode
step hands the kernel each sequence's block table with the tags it expects, and a
sequence whose pages fail the check ends with finish_reason "tag_mismatch" instead of
producing text from someone else's data.

The loop alternates two kinds of step, kept as separate functions so that the protocol-
driven workers can call them on their own:
- `prefill_step`: up to `prefill_chunk_tokens` prompt tokens, taken from the sequences
  still prefilling in admission order (a long prompt is split over several steps, so
  decode steps keep coming); a sequence whose prompt completes samples its first token,
  and its prompt pages are sealed (checksummed), as a prefill worker does before sending.
- `decode_step`: one token for every running sequence, in one batch. A page that fills
  up is sealed at the end of the step.
Finished sequences give their pages back at once; they are not zeroed (tags guard them).

GPUs: with `GeneratorConfig(cuda_graphs=True)` the pool gets one more page, a scratch page
never allocated, and `decode_step` hands batches that fit to `engine.graphs.DecodeGraphs`:
padded to a bucket, replayed from a CUDA graph on CUDA, run eagerly on the same static
buffers elsewhere (what the CPU tests check).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

import kernels
from engine.graphs import DecodeGraphs
from engine.model import DecodeBatch, LlamaModel, PrefillChunk
from engine.pool import FreeList, KVPool, PoolConfig
from engine.sampling import SamplingParams, sample
from engine.tokenizer import IncrementalText

FINISH_REASONS = ("stop", "length", "tag_mismatch", "rejected")


@dataclass(frozen=True)
class GeneratorConfig:
    num_pages: int = 1024
    page_tokens: int = 16
    max_batch: int = 64
    prefill_chunk_tokens: int = 512
    check_tags: bool = True
    checksums: bool = True
    shuffle_pages_seed: int | None = None  # None: pages handed out in order
    keep_logits: bool = False  # tests: keep every sampled position's logits
    cuda_graphs: bool = False  # decode through engine/graphs.py (captured on CUDA only)
    graph_max_pages: int = 128  # block table width of the graphs; wider batches run eagerly

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_tokens", "max_batch", "prefill_chunk_tokens",
                     "graph_max_pages"):
            assert getattr(self, name) > 0, f"{name} must be positive"


@dataclass(frozen=True)
class Request:
    request_id: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        assert 0 <= self.request_id < 1 << 31, "request ids are tag owners: [0, 2**31)"
        assert len(self.prompt_ids) >= 1, "a prompt needs at least one token"


@dataclass(frozen=True)
class Completion:
    request_id: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str | None
    finish_reason: str
    first_token_s: float | None  # from the start of the run
    logits: tuple = ()  # fp32 [vocab] per output token, with GeneratorConfig.keep_logits


@dataclass(eq=False)  # identity: a sequence is one running request, never equal to another
class Sequence:
    request: Request
    pages: list[int]
    page_tensor: torch.Tensor  # int32 [pages], the block table row
    tag_tensor: torch.Tensor  # int64 [pages], the tags the row expects
    generator: torch.Generator | None
    prefilled_tokens: int = 0
    # Leading pages the prefill read from its prefix cache: shared, never written (the
    # prefill-side cache, engine/workers.py `PrefillWorker.start`).
    cached_pages: int = 0
    output_ids: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    first_token_s: float | None = None
    decoded: IncrementalText | None = None  # the output's text so far (stop strings, streams)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)


def pages_needed(prompt_tokens: int, max_tokens: int, page_tokens: int) -> int:
    """Pages for every token whose KV is ever stored: the prompt and all outputs but the
    last (the last sampled token is never fed back)."""
    return -(-(prompt_tokens + max_tokens - 1) // page_tokens)


def slots_for(sequence: Sequence, positions: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """int64 slot (page * page_tokens + offset) of each position of the sequence."""
    pages = sequence.page_tensor.long()[positions // page_tokens]
    return pages * page_tokens + positions % page_tokens


def prefill_step(model: LlamaModel, pool: KVPool, sequences: list[Sequence],
                 token_budget: int) -> list[tuple[Sequence, torch.Tensor]]:
    """Run the next prompt chunk of each sequence, in order, until `token_budget` tokens;
    returns (sequence, last-token logits) for the sequences whose prompt is now complete."""
    plan = plan_chunks(sequences, token_budget, model.device, pool.page_tokens)
    logits = model.prefill(pool, [chunk for _, chunk in plan])
    for sequence, chunk in plan:
        sequence.prefilled_tokens = chunk.start_position + len(chunk.token_ids)
    return [(sequence, logits[i]) for i, (sequence, _) in enumerate(plan)
            if sequence.prefilled_tokens == len(sequence.prompt_ids)]


def plan_chunks(sequences: list[Sequence], token_budget: int, device,
                page_tokens: int) -> list[tuple[Sequence, PrefillChunk]]:
    """The next prompt chunk of each sequence, in order, until `token_budget` tokens. Nothing
    changes until the caller advances `prefilled_tokens` (so a failed step can be retried)."""
    plan = []
    for sequence in sequences:
        if token_budget == 0:
            break
        start = sequence.prefilled_tokens
        take = min(token_budget, len(sequence.prompt_ids) - start)
        token_budget -= take
        positions = torch.arange(start, start + take, device=device)
        plan.append((sequence, PrefillChunk(
            token_ids=torch.tensor(sequence.prompt_ids[start:start + take], device=device),
            start_position=start, slots=slots_for(sequence, positions, page_tokens),
            block_table_row=sequence.page_tensor)))
    return plan


def decode_step(model: LlamaModel, pool: KVPool, sequences: list[Sequence],
                check_tags: bool = True, graphs: DecodeGraphs | None = None):
    """One token for each sequence: (logits [batch, vocab], tag_ok bool [batch]); through
    `graphs` (padded, static buffers, replayed on CUDA) when the batch fits them."""
    pages_read = -(-max(sequence.num_tokens for sequence in sequences) // pool.page_tokens)
    if graphs is not None and graphs.fits(len(sequences), pages_read):
        assert graphs.check_tags == check_tags, "the graphs were made for the other check"
        return graphs.decode(decode_batch(model, pool, sequences, graphs.max_pages))
    batch = decode_batch(model, pool, sequences, pages_read)
    return model.decode(pool, batch, check_tags=check_tags)


def decode_batch(model: LlamaModel, pool: KVPool, sequences: list[Sequence],
                 table_pages: int) -> DecodeBatch:
    """The decode inputs of these sequences, block tables `table_pages` wide (at least
    the pages any of them reads)."""
    page_tokens = pool.page_tokens
    positions = [sequence.num_tokens - 1 for sequence in sequences]
    assert -(-(max(positions) + 1) // page_tokens) <= table_pages
    device = model.device
    slots = [s.pages[p // page_tokens] * page_tokens + p % page_tokens
             for s, p in zip(sequences, positions)]
    return DecodeBatch(
        token_ids=torch.tensor([s.output_ids[-1] for s in sequences], device=device),
        positions=torch.tensor(positions, device=device),
        slots=torch.tensor(slots, device=device),
        block_table=_padded_rows([s.page_tensor for s in sequences], table_pages, -1),
        context_lengths=torch.tensor(positions, dtype=torch.int32, device=device) + 1,
        expected_tags=_padded_rows([s.tag_tensor for s in sequences], table_pages,
                                   kernels.FRESH_TAG))


def _padded_rows(rows: list[torch.Tensor], width: int, fill: int) -> torch.Tensor:
    """[len(rows), width]: each row's first `width` entries, padded with `fill` (one pad
    of all rows, then a cut: two torch calls whatever the batch)."""
    if len(rows) == 1 and rows[0].shape[0] >= width:
        return rows[0][None, :width]
    table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill)
    if table.shape[1] < width:
        table = torch.nn.functional.pad(table, (0, width - table.shape[1]), value=fill)
    return table[:, :width]


def stop_reason(tokenizer, sequence: Sequence, token: int) -> str | None:
    """"stop", "length" or None for `token` about to be appended to `sequence` (shared by
    the Generator and the protocol-driven decode worker, so both stop alike)."""
    sampling = sequence.request.sampling
    eos = tokenizer.eos_token_ids if tokenizer else ()
    if token in eos and not sampling.ignore_eos:
        return "stop"
    if sampling.stop and tokenizer and _hits_stop(tokenizer, sequence, token):
        return "stop"
    if len(sequence.output_ids) + 1 >= sampling.max_tokens:
        return "length"
    return None


def _hits_stop(tokenizer, sequence: Sequence, token: int) -> bool:
    """True when the text with `token` contains a stop string; the text is kept cut
    just before it (the stop string itself is not part of the completion). The text is
    decoded incrementally, and only what `token` can have completed is searched: a stop
    string inside the whole characters decoded before would have ended the sequence."""
    decoded = incremental_text(sequence, tokenizer)
    before = len(decoded.update(sequence.output_ids))
    text = decoded.peek(sequence.output_ids, token)
    return _cut(sequence, token, text, [text.find(stop, max(0, before - len(stop) + 1))
                                        for stop in sequence.request.sampling.stop])


def hits_stop_whole_text(tokenizer, sequence: Sequence, token: int) -> bool:
    """`_hits_stop` by its definition: the whole output decoded and searched at every token
    (quadratic in its length); the reference tests and bench/stream_text_bench.py hold the
    incremental one against."""
    text = tokenizer.decode(sequence.output_ids + [token])
    return _cut(sequence, token, text, [text.find(stop)
                                        for stop in sequence.request.sampling.stop])


def _cut(sequence: Sequence, token: int, text: str, found: list[int]) -> bool:
    """With a stop string found (an index >= 0), the token ends the sequence and its text
    is cut before the earliest one."""
    cuts = [cut for cut in found if cut >= 0]
    if not cuts:
        return False
    sequence.output_ids.append(token)
    sequence.text = text[:min(cuts)]
    return True


def incremental_text(sequence: Sequence, tokenizer) -> IncrementalText:
    """The sequence's output text, decoded incrementally (made at its first use)."""
    if sequence.decoded is None:
        sequence.decoded = IncrementalText(tokenizer)
    return sequence.decoded


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string (not
    to be streamed yet: the next token may complete it)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


@dataclass
class RunStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    total_s: float = 0.0


class Generator:
    """Runs batches of requests to completion on one model and one pool."""

    def __init__(self, model: LlamaModel, config: GeneratorConfig = GeneratorConfig(),
                 tokenizer=None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        # With graphs, page num_pages is the scratch page padding rows write: in the pool,
        # never in the free list.
        pool_pages = config.num_pages + (1 if config.cuda_graphs else 0)
        self.pool = KVPool(PoolConfig.for_model(model.config, pool_pages,
                                                config.page_tokens, model.dtype, model.device))
        self.free_pages = FreeList(config.num_pages, config.shuffle_pages_seed)
        self.graphs = None
        if config.cuda_graphs:
            self.graphs = DecodeGraphs(
                model, self.pool, scratch_page=config.num_pages, max_batch=config.max_batch,
                max_pages=min(config.graph_max_pages, config.num_pages),
                check_tags=config.check_tags, capture=self.pool.kv.is_cuda)
        self._page_generation = [0] * config.num_pages
        self.stats = RunStats()

    def run(self, requests: list[Request]) -> list[Completion]:
        """Completions in the order of `requests`."""
        self.stats = RunStats()
        started = time.perf_counter()
        waiting, prefilling, running = deque(requests), [], []
        done: dict[int, Sequence] = {}
        while waiting or prefilling or running:
            self._admit(waiting, prefilling, running, done)
            if prefilling:
                self._prefill(prefilling, running, done, started)
            if running:
                self._decode(running, done)
        self.stats.total_s = time.perf_counter() - started
        return [self._completion(done[r.request_id]) for r in requests]

    def _admit(self, waiting: deque, prefilling: list, running: list, done: dict) -> None:
        """Admit requests in order while their pages are free and the batch has room; a
        request larger than the whole pool is rejected before anything is allocated."""
        page_tokens = self.config.page_tokens
        while waiting and len(prefilling) + len(running) < self.config.max_batch:
            request = waiting[0]
            needed = pages_needed(len(request.prompt_ids), request.sampling.max_tokens,
                                  page_tokens)
            if needed > self.config.num_pages:
                waiting.popleft()
                done[request.request_id] = self._rejected(request)
                continue
            pages = self.free_pages.take(needed)
            if pages is None:
                return
            waiting.popleft()
            prefilling.append(self.start_sequence(request, pages))

    def start_sequence(self, request: Request, pages: list[int]) -> Sequence:
        """A sequence on these (just allocated) pages: each page's generation is bumped
        and its new tag written to the pool before anything reads or writes it."""
        tags = []
        for page in pages:
            self._page_generation[page] += 1
            tags.append(kernels.pack_tag(request.request_id, self._page_generation[page]))
        self.pool.set_tags(pages, tags)
        device = self.model.device
        return Sequence(request=request, pages=pages,
                        page_tensor=torch.tensor(pages, dtype=torch.int32, device=device),
                        tag_tensor=torch.tensor(tags, dtype=torch.int64, device=device),
                        generator=request.sampling.make_generator(device))

    def _rejected(self, request: Request) -> Sequence:
        sequence = Sequence(request=request, pages=[], page_tensor=torch.empty(0),
                            tag_tensor=torch.empty(0), generator=None)
        sequence.finish_reason = "rejected"
        return sequence

    def _prefill(self, prefilling: list, running: list, done: dict, started: float) -> None:
        begun = time.perf_counter()
        before = sum(s.prefilled_tokens for s in prefilling)
        completed = prefill_step(self.model, self.pool, prefilling,
                                 self.config.prefill_chunk_tokens)
        self.stats.prefill_tokens += sum(s.prefilled_tokens for s in prefilling) - before
        for sequence, logits in completed:
            prefilling.remove(sequence)
            if self.config.checksums:
                self.pool.seal(sequence.pages[:self._pages_holding(len(sequence.prompt_ids))])
            sequence.first_token_s = time.perf_counter() - started
            self._append_tokens([sequence], logits[None], running, done)
        self.stats.prefill_s += time.perf_counter() - begun

    def _pages_holding(self, tokens: int) -> int:
        return -(-tokens // self.config.page_tokens)

    def _decode(self, running: list, done: dict) -> None:
        begun = time.perf_counter()
        batch = list(running)
        logits, tag_ok = decode_step(self.model, self.pool, batch, self.config.check_tags,
                                     self.graphs)
        if self.config.checksums:
            filled = [s.pages[(s.num_tokens - 1) // self.config.page_tokens] for s in batch
                      if s.num_tokens % self.config.page_tokens == 0]
            if filled:
                self.pool.seal(filled)
        passed_flags = tag_ok.tolist()
        failed = [s for s, ok in zip(batch, passed_flags) if not ok]
        for sequence in failed:
            self._finish(sequence, "tag_mismatch", running, done)
        passed = [i for i, ok in enumerate(passed_flags) if ok]
        if passed:
            self._append_tokens([batch[i] for i in passed], logits[passed] if failed else logits,
                                running, done)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(batch)
        self.stats.decode_s += time.perf_counter() - begun

    def _append_tokens(self, sequences: list, logits: torch.Tensor, running: list,
                       done: dict) -> None:
        """Sample one token per sequence and end those that stop."""
        tokens = sample(logits, [s.request.sampling for s in sequences],
                        [s.generator for s in sequences])
        for row, (sequence, token) in enumerate(zip(sequences, tokens)):
            if self.config.keep_logits:
                sequence.logits.append(logits[row].clone())
            reason = self._stop_reason(sequence, token)
            if reason is None or reason == "length":
                sequence.output_ids.append(token)
            if reason is None:
                if sequence not in running:
                    running.append(sequence)
            else:
                self._finish(sequence, reason, running, done)

    def _stop_reason(self, sequence: Sequence, token: int) -> str | None:
        return stop_reason(self.tokenizer, sequence, token)

    def _finish(self, sequence: Sequence, reason: str, running: list, done: dict) -> None:
        assert reason in FINISH_REASONS
        sequence.finish_reason = reason
        if sequence in running:
            running.remove(sequence)
        self.free_pages.give_back(sequence.pages)  # not zeroed: tags guard the content
        done[sequence.request.request_id] = sequence

    def _completion(self, sequence: Sequence) -> Completion:
        text = sequence.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(sequence.output_ids)
        return Completion(request_id=sequence.request.request_id,
                          prompt_ids=sequence.prompt_ids, output_ids=tuple(sequence.output_ids),
                          text=text, finish_reason=sequence.finish_reason,
                          first_token_s=sequence.first_token_s, logits=tuple(sequence.logits))
