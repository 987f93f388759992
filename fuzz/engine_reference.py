"""The engine target's independent reference, and the read-level oracle that judges every
decode step against it.

Theory of operation. What the engine computes goes through paged pools: chunked prefill
writes K/V at the slots `plan_chunks`/`slots_for` name, the transport copies pages, and
decode's kernel reads them back by block table. A bug anywhere on that path (a chunk at
the wrong offset, a context one token long or short, a page read before it was written,
a foreign write that passes the tag check) leaves the pools consistent with themselves,
so an oracle that reads its "expected" K/V back from a pool compares the bug with itself.
This module shares nothing with that path: `forward` recomputes a request's tokens alone,
unchunked, in contiguous tensors, with plain torch over the model's weight tensors (the
checkpoint's, not the engine's fused copies): causal attention over the whole sequence,
no pool, no block table, no kernels package.

What is judged is what the decode kernel was given and what it read, recorded at the
call (`DecodeRecorder` wraps the decode worker's model; nothing is read from the pools
afterwards): per sequence of the batch, the context length, the block table row, the
tags the row expects and the tags the pool held, the token fed and the K/V at every
position the kernel attended, and the logits. `judge` says what is wrong with one such
read, against the tokens the client holds (the prompt plus every token streamed to it so
far, which is what the request has) and the core's reservation:
- the context attended is exactly those tokens, and the token fed is the last of them;
- the block table is the core's reservation of pages, in order, with the tags the core
  reserved them at; the pool's tag on every page read equals it, and the page's current
  generation in the core is that generation (it was not reallocated since);
- the K/V at every position attended equals the reference's for this request's tokens
  within KV_TOLERANCE, and the logits equal the reference's within LOGITS_TOLERANCE.
The arithmetic differs (the engine folds the norms into fused projections, the kernels
reduce in another order), so the comparison is within a tolerance, fp32 on the CPU: the
largest differences seen on the tiny model (30 clean fuzz examples, seed 3) are 1.4e-6
for K/V and 8.6e-6 for logits, about 70 and 100 times below the tolerances; a foreign or
stale value differs by about 0.1 or more.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KV_TOLERANCE = 1e-4  # absolute, on K/V of magnitude ~1 (fp32, the tiny model)
LOGITS_TOLERANCE = 1e-3  # absolute, on logits of magnitude ~1-10


@contextmanager
def one_torch_thread():
    """Torch's intra-op threads set to one while the block runs, then back. The tiny
    model's and the reference's ops are far below what threads help with, and on a loaded
    machine (CI: two test processes on two cores) every parallel region waits for a thread
    that is not running: a 40 x 32 matmul took 40 ms with two threads there, 0.01 ms with
    one, and the reference's forward 466 ms against 1.3 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def forward(tensors: dict, config, tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(K/V [tokens, layers, 2, kv_heads, head_dim] after rotary, logits fp32 [tokens,
    vocab]) of `tokens` computed alone: a plain Llama forward over contiguous tensors."""
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    n = len(tokens)
    x = tensors["embed"].float()[torch.tensor(tokens, dtype=torch.long)]
    cos, sin = _rotary(config, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    kv = []
    for i in range(config.num_layers):
        def w(name: str) -> torch.Tensor:
            return tensors[f"layers.{i}.{name}"].float()
        h = _rms(x, w("attention_norm"), config.rms_norm_eps)
        q = (h @ w("q").T).view(n, heads, dim)
        k = (h @ w("k").T).view(n, kv_heads, dim)
        v = (h @ w("v").T).view(n, kv_heads, dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        kv.append(torch.stack([k, v], dim=1))  # [n, 2, kv_heads, dim]
        group = heads // kv_heads
        keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(dim)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        attended = torch.einsum("hqk,khd->qhd", weights, values).reshape(n, heads * dim)
        x = x + attended @ w("o").T
        h = _rms(x, w("mlp_norm"), config.rms_norm_eps)
        x = x + (F.silu(h @ w("gate").T) * (h @ w("up").T)) @ w("down").T
    x = _rms(x, tensors["final_norm"].float(), config.rms_norm_eps)
    output = tensors["embed" if config.tie_word_embeddings else "output"].float()
    return torch.stack(kv, dim=1), x @ output.T


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rotary(config, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, 1, head_dim] of the plain rotary embedding (no scaling: the tiny
    model has none)."""
    dim = config.head_dim
    frequencies = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.outer(torch.arange(n, dtype=torch.float32), frequencies)
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class DecodeRead:
    """One sequence's share of one decode call, as the kernel was given it and read it."""

    request: int
    step: int  # the request's decode steps before this one
    tokens_seen: int  # tokens streamed to its client when the step ran
    context: int  # context length the kernel attended
    token_fed: int
    table: tuple[int, ...]  # the block table row's pages (up to the pages attended)
    expected_tags: tuple[int, ...]
    pool_tags: tuple[int, ...]  # the pool's tags on those pages at the call
    kv: torch.Tensor  # [context, layers, 2, kv_heads, dim]: every position attended
    logits: torch.Tensor  # fp32 [vocab]
    reserved: tuple[tuple[int, int], ...]  # the core's table: (page, generation)
    generations_now: tuple[int, ...]  # the core's current generation of each table page
    # The content identity each table page's tag must name: the request's own, from its
    # tokens and salt (core.tag_idents; none without a prefix cache).
    idents: tuple[tuple, ...]


class DecodeRecorder:
    """Stands in for a decode worker's model: every `decode` call runs the real one, then
    hands `on_read` a DecodeRead per sequence of the batch (the worker's running list, in
    batch order, is what `decode_step` batched). Everything else is the real model's."""

    def __init__(self, worker, on_read) -> None:
        self._model, self._worker, self._on_read = worker.model, worker, on_read

    def __getattr__(self, name):
        return getattr(self._model, name)

    def decode(self, pool, batch, check_tags: bool = True, **options):
        logits, tag_ok = self._model.decode(pool, batch, check_tags=check_tags, **options)
        sequences = self._worker.running[:self._worker.max_batch]
        assert len(sequences) == batch.token_ids.shape[0], "the batch is the running list"
        page_tokens = pool.page_tokens
        for i, sequence in enumerate(sequences):
            context = int(batch.context_lengths[i])
            pages = -(-context // page_tokens)
            table = tuple(int(p) for p in batch.block_table[i, :pages])
            index = torch.tensor([max(p, 0) for p in table], dtype=torch.long)
            kv = pool.kv[index].permute(0, 4, 1, 2, 3, 5)  # [pages, tokens, L, 2, H, D]
            self._on_read(sequence.request.request_id, dict(
                context=context, token_fed=int(batch.token_ids[i]), table=table,
                expected_tags=tuple(int(t) for t in batch.expected_tags[i, :pages]),
                pool_tags=tuple(int(pool.tags[p]) if p >= 0 else -1 for p in table),
                kv=kv.reshape(-1, *kv.shape[2:])[:context].clone(),
                logits=logits[i].float().clone()))
        return logits, tag_ok


def judge(read: DecodeRead, tokens: tuple[int, ...], kv: torch.Tensor, logits: torch.Tensor,
          page_tag) -> str | None:
    """What is wrong with one decode read (None: nothing), given the request's tokens
    (prompt + what its client got), the reference K/V and logits of those tokens, and the
    engine's tag of a generation and a content identity, `page_tag(gen, ident)`."""
    if read.context != len(tokens):
        return (f"decode attended {read.context} positions, but the request has "
                f"{len(tokens)} tokens")
    if read.token_fed != tokens[-1]:
        return f"decode fed token {read.token_fed}, but the client's last token is {tokens[-1]}"
    reserved = read.reserved[:len(read.table)]
    if read.table != tuple(p for p, _ in reserved):
        return (f"decode read pages {_pages(read.table)}, but the core reserved "
                f"{_pages(p for p, _ in reserved)}")
    own = tuple(page_tag(g, ident) for (_, g), ident in zip(reserved, read.idents))
    if read.expected_tags != own:
        return ("decode expected tags other than the generations the core reserved the pages "
                "at and the request's own identities")
    for i, ((page, generation), tag) in enumerate(zip(reserved, read.pool_tags)):
        if tag != own[i]:
            return f"page {page + 1} held a tag other than its reservation's when decode read it"
        if read.generations_now[i] != generation:
            return (f"page {page + 1} was reallocated (generation "
                    f"{read.generations_now[i]}, reserved at {generation})")
    return judge_bytes(read.kv, read.logits, kv, logits)


def judge_bytes(read_kv: torch.Tensor, read_logits: torch.Tensor | None, kv: torch.Tensor,
                logits: torch.Tensor | None, position: int | None = None) -> str | None:
    """The K/V read against the reference's, position by position, and the logits computed
    (at `position`, by default the last one read) against the reference's."""
    n = read_kv.shape[0]
    if n:
        bad = ((read_kv - kv[:n]).abs().flatten(1).amax(dim=1) > KV_TOLERANCE).nonzero()
        if bad.numel():
            wrong = bad.flatten().tolist()
            return (f"the K/V decode read at position{'s' if len(wrong) > 1 else ''} "
                    f"{_positions(wrong)} is not this request's (reference: its tokens "
                    f"computed alone)")
    if read_logits is not None:
        error = float((read_logits - logits[n - 1 if position is None else position]).abs().max())
        if error > LOGITS_TOLERANCE:
            return f"the logits differ from the reference's by {error:.3g}"
    return None


def _pages(pages) -> str:
    return "[" + ", ".join(str(p + 1) for p in pages) + "]"


def _positions(positions: list[int]) -> str:
    shown = ", ".join(str(p) for p in positions[:6])
    return shown + (f" (and {len(positions) - 6} more)" if len(positions) > 6 else "")
