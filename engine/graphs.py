"""Decode steps replayed from CUDA graphs: static input buffers, batches padded to buckets.

Theory of operation. At batch 1 a decode step of a small model is a few hundred tiny
kernel launches, and the host's time to issue them, not the GPU's time to run them, sets
the token rate. A CUDA graph records the launches of one `LlamaModel.decode` once and
replays them with one call. A graph replays fixed addresses and fixed shapes, so:
- every input lives in a static buffer per batch bucket (1, 2, 4, ... up to the
  generator's max_batch, rounded up to a power of two); a step copies its `DecodeBatch`
  into the rows of the smallest bucket that holds it and resets the rows after it to
  padding;
- block tables (and expected tags) are `max_pages` wide: a batch whose sequences read
  more pages than that runs the ordinary eager decode instead (`fits`);
- nothing inside the recorded region may ask the device for a value (no `.item()`, no
  `torch.equal`, no shape that depends on data): the rotary table is grown before
  capture (`LlamaModel.reserve_positions`) and the Triton decode kernel, which CUDA
  tensors take, compares tags on the device and returns them as a tensor. The
  per-sequence verdict is read only after the replay, from the graph's output.
- **Padding rows touch no real page.** Each padding row decodes token 0 at position 0
  into slot 0 of a scratch page that the pool's owner never allocates, reads only that
  page (context 1), and expects FRESH_TAG there (no allocation issues it, and the
  scratch page keeps it). Every op of the step is row-wise (matmuls, norms, the KV write
  at the row's own slot, attention over the row's own table), so a padding row cannot
  change a real row's output; its own output is sliced off before anything reads it.

`capture=False` runs the very same buffers and padding eagerly, without a graph: what a
CPU can check of this path (tests/test_engine_graphs.py). Only `capture=True` needs CUDA.

Outputs are cloned out of the graph's memory before they are returned: the next replay
(of any bucket: they share one memory pool) overwrites them.
"""

from __future__ import annotations

from dataclasses import fields

import torch

import kernels
from engine.model import DecodeBatch, LlamaModel

BUCKET_LIMIT = 1024  # the largest bucket this module will make (max_batch rounded up)
WARMUP_STEPS = 2  # eager runs per bucket before capture: Triton compiles, cuBLAS picks


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= max_batch."""
    assert 1 <= max_batch <= BUCKET_LIMIT, f"max_batch {max_batch} outside [1, {BUCKET_LIMIT}]"
    buckets = [1]
    while buckets[-1] < max_batch:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


class DecodeGraphs:
    """Static decode buffers per bucket over one model and one pool; with `capture`, one
    CUDA graph per bucket, recorded at construction."""

    def __init__(self, model: LlamaModel, pool, scratch_page: int, max_batch: int,
                 max_pages: int, check_tags: bool = True, capture: bool = False):
        num_pages = pool.kv.shape[0]
        assert 0 <= scratch_page < num_pages, f"scratch page {scratch_page} not in the pool"
        assert max_pages >= 1
        assert not capture or pool.kv.is_cuda, "capture needs a CUDA pool"
        self.model, self.pool, self.scratch_page = model, pool, scratch_page
        self.max_pages, self.check_tags = max_pages, check_tags
        self.buckets = buckets_for(max_batch)
        self.positions_limit = max_pages * pool.page_tokens
        # Held, not just made: a graph reads these tables by address.
        self._rope_tables = model.reserve_positions(self.positions_limit)
        self._padding = {b: self._padding_batch(b) for b in self.buckets}
        self._static = {b: self._padding_batch(b) for b in self.buckets}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[int, object] = {}
        if capture:
            self._capture()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def fits(self, batch_size: int, pages_read: int) -> bool:
        """Whether a batch of this size, reading this many pages per row at most, can run
        here (else the caller runs the eager decode)."""
        return 1 <= batch_size <= self.buckets[-1] and pages_read <= self.max_pages

    def bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _padding_batch(self, bucket: int) -> DecodeBatch:
        """`bucket` padding rows: token 0 at position 0, written to slot 0 of the scratch
        page and read from there alone (see the module's docstring)."""
        device = self.pool.kv.device
        table = torch.full((bucket, self.max_pages), -1, dtype=torch.int32, device=device)
        table[:, 0] = self.scratch_page
        expected = torch.full((bucket, self.max_pages), kernels.FRESH_TAG, dtype=torch.int64,
                              device=device)

        def column(value: int, dtype=torch.int64) -> torch.Tensor:
            return torch.full((bucket,), value, dtype=dtype, device=device)

        return DecodeBatch(token_ids=column(0), positions=column(0),
                           slots=column(self.scratch_page * self.pool.page_tokens),
                           block_table=table, context_lengths=column(1, torch.int32),
                           expected_tags=expected)

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits fp32 [batch, vocab], tag_ok bool [batch]) of a batch whose block table
        is `max_pages` wide, through the smallest bucket that holds it."""
        size = batch.token_ids.shape[0]
        assert 1 <= size <= self.buckets[-1], f"batch {size} larger than the largest bucket"
        assert batch.block_table.shape == (size, self.max_pages), "tables must be max_pages wide"
        bucket = self.bucket(size)
        self._fill(bucket, batch)
        if bucket in self._graphs:
            self._graphs[bucket].replay()
            logits, tag_ok = self._outputs[bucket]
        else:
            logits, tag_ok = self._run(bucket)
        return logits[:size].clone(), tag_ok[:size].clone()

    def _fill(self, bucket: int, batch: DecodeBatch) -> None:
        """The batch into the bucket's first rows, padding into the rest: device copies
        only, so filling never waits for the GPU."""
        size = batch.token_ids.shape[0]
        static, padding = self._static[bucket], self._padding[bucket]
        for field in fields(DecodeBatch):
            target = getattr(static, field.name)
            target[:size].copy_(getattr(batch, field.name))
            if size < bucket:
                target[size:].copy_(getattr(padding, field.name)[size:])

    def _run(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the bucket's static buffers: what a graph records."""
        return self.model.decode(self.pool, self._static[bucket], check_tags=self.check_tags,
                                 positions_reserved=True)

    def _capture(self) -> None:
        """Warm every bucket up on a side stream (the static buffers hold padding, so the
        warm-up writes the scratch page only), then record one graph per bucket, largest
        first, all in one memory pool."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            for bucket in reversed(self.buckets):
                for _ in range(WARMUP_STEPS):
                    self._run(bucket)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        memory_pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=memory_pool):
                self._outputs[bucket] = self._run(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
