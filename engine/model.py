"""A Llama-family decoder whose attention reads and writes a paged KV pool.

Theory of operation. Each layer is
    x += o( attention( rope(q(norm(x))), rope(k(norm(x))), v(norm(x)) ) )
    x += down( silu(gate(norm(x))) * up(norm(x)) )
with RMSNorm, rotary position embeddings on the two halves of every head, grouped-query
attention (several query heads share one KV head) and, for Qwen2, a bias on q, k and v.
The K and V of every token go into the pool (engine/pool.py) at the slot its sequence's
block table names, and attention reads them back from there through the kernels package
(`write_kv_at`, `paged_prefill_attention`, `paged_decode_attention`): the model never holds
a KV cache of its own, which is what lets pages move between workers and lets the decode
kernel check every page's ownership tag on every read.

Two entry points, the two kinds of step a serving engine takes:
- `prefill(pool, chunks)`: one chunk of prompt tokens for each of several sequences.
  Projections and MLPs run on all chunks' tokens at once; attention runs per sequence
  over its pages (prefix from earlier chunks + this chunk).
- `decode(pool, batch)`: one new token for each sequence of a batch, attention over its
  pages with the tag check; returns the logits and which sequences passed the check.

Speed on a CPU is mostly host overhead per operation at small batch, so the weights are
fused once at load (q|k|v into one matrix, gate|up into one) and rope rotates q and k in
one go; each layer is about fifteen torch calls plus the attention kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from engine.config import ModelConfig
from engine.weights import Checkpoint

FEW_ROWS = 64  # bf16/fp16 CPU steps up to this many tokens run feature-major
# fp32 on a CPU: MKL's packed GEMM, with the weight packed for this many rows, runs the
# 2..PACKED_ROWS-row products of decode batches 1.2-1.5x faster than mm (576 x 3072,
# weights streamed from memory: 464 vs 698 us at 8 rows); at 1 row and above 32 rows it
# is slower, so those keep mm on the transposed copy.
PACKED_ROWS = 16
# ... but only for weights that stream from memory: a small matrix that stays in cache runs
# 2-3x slower packed (64 x 96 at 4 rows: 6.2 vs 2.0 us), so by default a model packs only
# when its fp32 weights are at least this large.
PACK_MIN_BYTES = 64 * 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens start_position.. of one sequence, whose KV goes to `slots`
    (page * page_tokens + offset, one per token) and whose block table row names every
    page holding positions 0..start_position + len(token_ids) - 1."""
    token_ids: torch.Tensor  # int64 [tokens]
    start_position: int
    slots: torch.Tensor  # int64 [tokens]
    block_table_row: torch.Tensor  # int32 [pages]


@dataclass(frozen=True)
class DecodeBatch:
    """One new token per sequence. context_lengths count the new token (its KV is written
    before attention reads the pages)."""
    token_ids: torch.Tensor  # int64 [batch]
    positions: torch.Tensor  # int64 [batch]
    slots: torch.Tensor  # int64 [batch]
    block_table: torch.Tensor  # int32 [batch, pages]; -1 past a sequence's pages
    context_lengths: torch.Tensor  # int32 [batch]
    expected_tags: torch.Tensor  # int64 [batch, pages]


@dataclass(frozen=True)
class Projection:
    """x @ W^T (+ bias), or residual + x @ W^T in one call (the residual adds of a layer
    ride on the matmul as addmm's input, a torch call less each).

    In fp32 the weight is kept transposed, [in, out] contiguous, and applied with mm: for
    a few rows (decode batches) oneDNN's fp32 path runs x @ W^T 2-2.5x slower than
    x @ W_t on this CPU (measured: 8 x 576 by 576 x 3072, 754 us vs 326 us). On a CPU
    with MKL it also keeps the weight in MKL's packed form, which serves 2..PACKED_ROWS
    rows (see PACKED_ROWS). Other dtypes keep torch's [out, in] layout: a single row
    (decode at batch 1) goes through matrix-vector products, which read [out, in] rows
    contiguously and are faster in bf16 than oneDNN's one-row matmul; on a CPU, steps of
    2..FEW_ROWS rows never come here but to `columns` (W @ x^T, feature-major: the model
    keeps those steps' hidden state transposed, LlamaModel._forward_columns)."""
    weight: torch.Tensor  # [out, in], or [in, out] when transposed
    bias: torch.Tensor | None
    transposed: bool
    packed: torch.Tensor | None = None  # fp32 on a CPU: MKL's packed form (PACKED_ROWS)
    # the [out, in] view MKL's op is handed with the packed form (it reads the packed
    # one): made once, a .t() call per projection per step less (9 us each in a step)
    packed_origin: torch.Tensor | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None,
           pack: bool = False) -> Projection:
        if weight.dtype == torch.float32:
            packed = None
            if pack and weight.device.type == "cpu" and can_pack():
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(),
                                                                  PACKED_ROWS)
            transposed = weight.t().contiguous()
            return cls(transposed, bias, True, packed,
                       transposed.t() if packed is not None else None)
        return cls(weight.contiguous(), bias, False)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None and 2 <= rows <= PACKED_ROWS:
            # The weight argument is what MKL's op falls back to for another row count;
            # the count passed is always x's, so it reads the packed form.
            out = torch.ops.mkl._mkl_linear(x, self.packed, self.packed_origin, None, rows)
            base = residual if residual is not None else self.bias
            return out if base is None else out.add_(base)
        if self.transposed:
            base = residual if residual is not None else self.bias
            if base is None:
                return torch.mm(x, self.weight)
            assert residual is None or self.bias is None, "a residual, or a bias, not both"
            return torch.addmm(base, x, self.weight)
        if x.shape[0] == 1:
            base = residual[0] if residual is not None else self.bias
            if base is None:
                return torch.mv(self.weight, x[0])[None]
            assert residual is None or self.bias is None, "a residual, or a bias, not both"
            return torch.addmv(base, self.weight, x[0])[None]
        if residual is None:
            return F.linear(x, self.weight, self.bias)
        assert self.bias is None, "a residual, or a bias, not both"
        return torch.addmm(residual, x, self.weight.t())

    def columns(self, x_t: torch.Tensor, residual_t: torch.Tensor | None = None) -> torch.Tensor:
        """W @ x^T (+ bias, or + residual^T) for x^T [in, tokens]: [out, tokens], the
        feature-major form of __call__ (LlamaModel._forward_columns: bf16/fp16 only, whose
        weights keep [out, in])."""
        assert not self.transposed, "feature-major steps take [out, in] weights"
        if residual_t is not None:
            assert self.bias is None, "a residual, or a bias, not both"
            return torch.addmm(residual_t, self.weight, x_t)
        if self.bias is not None:
            return torch.addmm(self.bias[:, None], self.weight, x_t)
        return torch.mm(self.weight, x_t)


@dataclass(frozen=True)
class Layer:
    """One decoder layer. Its two RMSNorm weights are folded into the projections that
    read the normalised state, qkv and gate_up (W[:, j] * g[j], in fp32 before the cast
    to the model's dtype: one rounding, as W alone has), so its norms are the
    normalisation alone, a torch call less each, 60 a step on the default model."""
    qkv: Projection  # out: (q_heads + 2 kv_heads) * head_dim
    o: Projection
    gate_up: Projection  # out: 2 * intermediate
    down: Projection


def can_pack() -> bool:
    """Whether this torch has MKL's packed GEMM (a CPU build with MKL)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class LlamaModel:
    """`pack_weights` (fp32 on a CPU): keep a second copy of every projection's weight in
    MKL's packed form for decode batches of 2..PACKED_ROWS rows (Projection); it costs the
    weights' size again in memory, for 30-40% more fp32 decode tokens/s at batch 8 on the
    default model. None (the default): when the fp32 weights reach PACK_MIN_BYTES."""

    def __init__(self, checkpoint: Checkpoint, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, pack_weights: bool | None = None):
        self.config = config = checkpoint.config
        self.device, self.dtype = torch.device(device), dtype
        tensors = checkpoint.tensors
        if pack_weights is None:
            pack_weights = 4 * sum(t.numel() for t in tensors.values()) >= PACK_MIN_BYTES

        def put(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=self.device, dtype=dtype).contiguous()

        self.embed = put(tensors["embed"])
        self.output = Projection.of(
            self.embed if config.tie_word_embeddings else put(tensors["output"]), None,
            pack_weights)
        if config.tie_word_embeddings and self.output.transposed:
            # fp32 keeps the tied table transposed for the output matmul: the lookup reads
            # rows of that copy's transpose (strided, a few rows a step) instead of
            # keeping a third copy of a 49k x 576 table
            self.embed = self.output.weight.t()
        self.final_norm = put(tensors["final_norm"])
        self.layers = [self._layer(tensors, i, put, pack_weights)
                       for i in range(config.num_layers)]
        # the final norm's weight stays apart (the output matrix may be the embedding);
        # feature-major steps (_forward_columns) scale h^T by it as a [hidden, 1] column
        self._final_norm_column = self.final_norm[:, None]
        self.attention_scale = 1.0 / math.sqrt(config.head_dim)
        self._rope = RotaryTable(config, tensors.get("rope_frequency_divisors"), self.device,
                                 dtype)

    @staticmethod
    def _layer(tensors: dict, i: int, put, pack: bool) -> Layer:
        def get(name: str) -> torch.Tensor:
            return tensors[f"layers.{i}.{name}"]

        def normed_input(names: list[str], norm: str) -> torch.Tensor:
            """The fused projection of `names`, its input columns scaled by the norm's
            weight (Layer)."""
            fused = torch.cat([get(name).float() for name in names])
            return put(fused * get(norm).float())

        bias = None
        if f"layers.{i}.q_bias" in tensors:
            bias = put(torch.cat([get("q_bias"), get("k_bias"), get("v_bias")]))
        qkv = normed_input(["q", "k", "v"], "attention_norm")
        return Layer(qkv=Projection.of(qkv, bias, pack),
                     o=Projection.of(put(get("o")), None, pack),
                     gate_up=Projection.of(normed_input(["gate", "up"], "mlp_norm"),
                                           None, pack),
                     down=Projection.of(put(get("down")), None, pack))

    @torch.inference_mode()
    def prefill(self, pool, chunks: list[PrefillChunk], all_logits: bool = False) -> torch.Tensor:
        """Logits (fp32) of each chunk's last token [chunks, vocab], or of every token
        [tokens, vocab] when all_logits (tests compare every position)."""
        token_ids = torch.cat([chunk.token_ids for chunk in chunks])
        positions = torch.cat([chunk.start_position + torch.arange(
            len(chunk.token_ids), device=self.device) for chunk in chunks])
        slots = torch.cat([chunk.slots for chunk in chunks])
        bounds = [0]
        for chunk in chunks:
            bounds.append(bounds[-1] + len(chunk.token_ids))

        def attend(layer: int, queries: torch.Tensor) -> torch.Tensor:
            return torch.cat([kernels.paged_prefill_attention(
                queries[start:end], pool.kv, layer, chunk.block_table_row,
                chunk.start_position, self.attention_scale)
                for chunk, start, end in zip(chunks, bounds, bounds[1:])])

        hidden = self._forward(pool, token_ids, positions, slots, attend)
        if not all_logits:
            hidden = hidden[torch.tensor(bounds[1:], device=self.device) - 1]
        return self._logits(hidden)

    @torch.inference_mode()
    def decode(self, pool, batch: DecodeBatch, check_tags: bool = True,
               positions_reserved: bool = False):
        """(logits fp32 [batch, vocab], tag_ok bool [batch]). A sequence whose pages fail
        the tag check in any layer has tag_ok False; its logits are meaningless (the
        kernel zeroed its attention) and the caller must fail it.

        positions_reserved: the caller promises every position is below a length it
        passed to `reserve_positions`, so the rotary table is indexed without asking the
        device for the largest position (a host sync, which a CUDA graph cannot hold;
        engine/graphs.py)."""
        tag_ok_by_layer = []
        plan = kernels.decode_plan(pool.kv, batch.block_table, batch.context_lengths,
                                   batch.expected_tags)

        def attend(layer: int, queries: torch.Tensor) -> torch.Tensor:
            out, tag_ok = kernels.paged_decode_attention(
                queries, pool.kv, layer, batch.block_table, batch.context_lengths,
                batch.expected_tags, pool.tags, self.attention_scale, check_tags=check_tags,
                plan=plan)
            tag_ok_by_layer.append(tag_ok)
            return out

        hidden = self._forward(pool, batch.token_ids, batch.positions, batch.slots, attend,
                               positions_reserved)
        return self._logits(hidden), torch.stack(tag_ok_by_layer).all(dim=0)

    def reserve_positions(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow the rotary table to at least `length` positions now; returns the (cos,
        signed sin) tables decode(positions_reserved=True) indexes from here on, until a
        longer prompt grows the table again (a captured graph keeps these alive)."""
        self._rope.reserve(length)
        return self._rope.cos, self._rope.sin

    def columns(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens runs feature-major (_forward_columns): bf16
        and fp16 on a CPU, 2 to FEW_ROWS tokens (decode batches, short prefill chunks).
        One token keeps the row path's matrix-vector products (batch-1 decode: 30 vs 36
        ms a step for the default model in bf16)."""
        return (self.device.type == "cpu" and self.dtype != torch.float32
                and 2 <= tokens <= FEW_ROWS)

    def _forward(self, pool, token_ids, positions, slots, attend,
                 positions_reserved: bool = False) -> torch.Tensor:
        """Final hidden states [tokens, hidden]; `attend(layer, q)` does the attention."""
        if self.columns(token_ids.shape[0]):
            return self._forward_columns(pool, token_ids, positions, slots, attend,
                                         positions_reserved)
        config = self.config
        q_heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        cos, signed_sin = self._rope.at(positions, positions_reserved)  # [tokens, head_dim]
        write_at = kernels.kv_slots(pool.kv, slots)
        hidden = F.embedding(token_ids, self.embed)
        tokens = hidden.shape[0]
        for index, layer in enumerate(self.layers):
            normed = self._row_norm(hidden)
            qkv = layer.qkv(normed).view(tokens, q_heads + 2 * kv_heads, head_dim)
            kernels.rotary_write_kv(pool.kv, index, write_at, qkv, q_heads, cos, signed_sin)
            attended = attend(index, qkv[:, :q_heads]).reshape(tokens, q_heads * head_dim)
            hidden = layer.o(attended, residual=hidden)
            normed = self._row_norm(hidden)
            gate, up = layer.gate_up(normed).chunk(2, dim=-1)
            hidden = layer.down(kernels.silu_mul(gate, up), residual=hidden)
        return self._row_norm(hidden, self.final_norm)

    def _forward_columns(self, pool, token_ids, positions, slots, attend,
                         positions_reserved: bool) -> torch.Tensor:
        """_forward with the hidden state kept feature-major, h^T [hidden, tokens]: what
        oneDNN's bf16 matmul wants for a few rows is W @ x^T (30% less matmul time than
        x @ W^T at 8 rows on this CPU), and in this layout its [out, tokens] result is
        what the next call takes, where the row layout paid a transposing copy after
        every projection. Every torch call here is paid 30 times a step in caches that
        the weights just streamed through (an add costs 10 us there, 2 us in a loop), so
        the layout saves calls too: a norm is four plain calls (_norm) where F.rms_norm
        runs eight inside; rotary, the KV write and the attention take views.
        Returns the final hidden states as rows [tokens, hidden] (a transposed view)."""
        config = self.config
        q_heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        cos, signed_sin = self._rope.at(positions, positions_reserved)  # [tokens, head_dim]
        write_at = kernels.kv_slots(pool.kv, slots)
        hidden_t = F.embedding(token_ids, self.embed).t().contiguous()
        tokens = hidden_t.shape[1]
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv.columns(self._norm(hidden_t))
            heads = qkv.view(q_heads + 2 * kv_heads, head_dim, tokens).permute(2, 0, 1)
            kernels.rotary_write_kv(pool.kv, index, write_at, heads, q_heads, cos, signed_sin)
            attended = attend(index, heads[:, :q_heads].contiguous())
            hidden_t = layer.o.columns(attended.reshape(tokens, q_heads * head_dim).t(),
                                       residual_t=hidden_t)
            gate, up = layer.gate_up.columns(self._norm(hidden_t)).chunk(2, dim=0)
            hidden_t = layer.down.columns(kernels.silu_mul(gate, up), residual_t=hidden_t)
        return self._norm(hidden_t, self._final_norm_column).t()

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
              dim: int = 0) -> torch.Tensor:
        """RMSNorm over the features of h^T [hidden, tokens] (dim 0, weight a [hidden, 1]
        column) or of h [tokens, hidden] (dim -1), rounded as transformers rounds it:
        h * rsqrt(mean(h^2) + eps) in fp32, cast to the model's dtype, times the weight
        (None inside a layer: Layer says why): kernels.rms_norm, one C call on a CPU,
        where F.rms_norm makes eight torch calls inside."""
        normed = kernels.rms_norm(hidden, self.config.rms_norm_eps, dim)
        return normed if weight is None else normed.mul_(weight)

    def _row_norm(self, hidden: torch.Tensor, weight: torch.Tensor | None = None):
        """RMSNorm of rows: _norm on a CPU, torch's fused kernel elsewhere."""
        if self.device.type == "cpu":
            return self._norm(hidden, weight, dim=-1)
        return F.rms_norm(hidden, (self.config.hidden_size,), weight, self.config.rms_norm_eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.columns(hidden.shape[0]):
            # W @ h^T, transposed into fp32 rows by the copy that casts it anyway
            logits_t = self.output.columns(hidden.t())
            return torch.empty(logits_t.shape[::-1], dtype=torch.float32,
                               device=self.device).copy_(logits_t.t())
        return self.output(hidden).float()


class RotaryTable:
    """cos and sin of position * frequency for every position up to the largest seen,
    grown by doubling. Computed in fp32 (as transformers does) and stored in the model's
    dtype; frequencies follow the config's rope scaling (engine/config.py)."""

    def __init__(self, config: ModelConfig, divisors, device, dtype):
        self.inverse_frequencies = inverse_frequencies(config, divisors).to(device)
        self.device, self.dtype = device, dtype
        self.cos = self.sin = torch.empty(0, config.head_dim, device=device, dtype=dtype)

    def at(self, positions: torch.Tensor, reserved: bool = False):
        """(cos, signed sin) [tokens, head_dim] for these positions (kernels'
        rotary_write_kv).
        Unless `reserved` (the caller made sure, with `reserve`, that the table covers
        them), the largest position is read back to grow the table if needed."""
        if not reserved:
            self.reserve(int(positions.max()) + 1)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def reserve(self, length: int) -> None:
        """At least `length` positions in the table."""
        if length > self.cos.shape[0]:
            self._grow(max(length, 2 * self.cos.shape[0], 256))

    def _grow(self, length: int) -> None:
        angles = torch.outer(torch.arange(length, device=self.device, dtype=torch.float32),
                             self.inverse_frequencies)
        sin = angles.sin()
        self.cos = torch.cat((angles, angles), dim=-1).cos().to(self.dtype)
        self.sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)


def inverse_frequencies(config: ModelConfig, divisors=None) -> torch.Tensor:
    """fp32 [head_dim / 2]: theta^(-2i/d), then the config's scaling, then GGUF's
    per-frequency divisors (its form of Llama 3 scaling) if the file has them."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    frequencies = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling.kind == "linear":
        frequencies = frequencies / scaling.factor
    elif scaling.kind == "llama3":
        frequencies = _llama3_frequencies(frequencies, scaling)
    if divisors is not None:
        frequencies = frequencies / divisors.float()
    return frequencies


def _llama3_frequencies(frequencies: torch.Tensor, scaling) -> torch.Tensor:
    """Llama 3.1's rule: long wavelengths (beyond the original context / low factor) are
    slowed by `factor`, short ones (below original / high factor) kept, and the band
    between blends the two linearly in (original context / wavelength)."""
    original = scaling.original_max_position_embeddings
    wavelengths = 2 * math.pi / frequencies
    slowed = frequencies / scaling.factor
    blend = (original / wavelengths - scaling.low_frequency_factor) / (
        scaling.high_frequency_factor - scaling.low_frequency_factor)
    blended = (1 - blend) * slowed + blend * frequencies
    long_wave = wavelengths > original / scaling.low_frequency_factor
    short_wave = wavelengths < original / scaling.high_frequency_factor
    return torch.where(long_wave, slowed, torch.where(short_wave, frequencies, blended))
