"""The small steps of a decoder layer, torch reference: RMSNorm without its weight,
SiLU(gate) * up, and rotary + the KV write. The engine's path on CUDA, and the definition
the C versions (layer_native.c) are tested against; both round where transformers
rounds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import write_kv_at


def rms_norm(hidden: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    """hidden * rsqrt(mean(hidden^2 over dim) + eps), in fp32, rounded once to hidden's
    dtype: transformers' LlamaRMSNorm before its weight. Four plain torch calls (five
    with the cast); F.rms_norm makes eight inside on a CPU."""
    norms = torch.linalg.vector_norm(hidden, dim=dim, keepdim=True, dtype=torch.float32)
    scale = torch.rsqrt(torch.addcmul(norms.new_tensor(eps), norms, norms,
                                      value=1.0 / hidden.shape[dim]))
    normed = hidden * scale  # fp32
    return normed if normed.dtype == hidden.dtype else normed.to(hidden.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, rounded after each as torch rounds F.silu(gate).mul_(up)."""
    return F.silu(gate).mul_(up)


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotary embedding on the two halves of each head (its last axis), written back into
    x (a view of the qkv projection): (a, b) -> (a cos - b sin, b cos + a sin), with cos
    laid out as [.., cos_i | cos_i] and signed_sin as [.., -sin_i | sin_i], so that it is
    x * cos + roll(x, half) * signed_sin: three torch calls."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (b, a)
    torch.addcmul(x * cos, swapped, signed_sin, out=x)


def rotary_write_kv(kv, layer: int, at, heads: torch.Tensor, q_heads: int,
                    cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """One layer's rotary embedding and KV write: heads [tokens, q_heads + 2 kv_heads,
    dim] (a view of the qkv projection: queries, keys, values) gets its query and key
    heads rotated in place (cos, signed_sin [tokens, dim], rotate_in_place's layout), then
    its keys and values are stored at the KVSlots `at` (attention.write_kv_at)."""
    kv_heads = (heads.shape[1] - q_heads) // 2
    rotate_in_place(heads[:, :q_heads + kv_heads], cos[:, None], signed_sin[:, None])
    write_kv_at(kv, layer, at, heads[:, q_heads:].unflatten(1, (2, kv_heads)))
