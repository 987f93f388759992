"""kvproof kernels: tag-checked paged attention, page checksums, page pack/unpack.

The one place that picks an implementation. Every public function takes the same
arguments on every path (the contract: kernels/README.md) and runs one of
- the Triton kernel (`*_triton.py`), for CUDA tensors;
- the C kernel (`*_native.c`, built at first use by native.py), for CPU tensors where the
  machine's C compiler built it: a layer's norm, SiLU * up, rotary + KV write, and the
  decode tag check (the CPU engine's per-layer small steps), and the page checksum;
- the torch reference (`attention.py`, `layer.py`, `checksum.py`, `pack.py`) otherwise,
  and for every function that has no kernel on the chosen path.
KVPROOF_KERNELS=triton|native|torch forces one (tests run the Triton kernels on the CPU
that way, with TRITON_INTERPRET=1; =native fails loudly where the C kernels do not
build). The variable is read on every call, so a test can set it late. Triton modules
are imported only when first chosen: the CPU engine never needs Triton. Where the C
kernels do not build, the CPU takes the torch references with one warning, naming why.

kernels never imports the protocol (spec/, sim/, fuzz/, api/); engine/ imports kernels.
"""

from __future__ import annotations

import importlib
import os
import warnings

from kernels import attention as _attention_ref
from kernels import checksum as _checksum_ref
from kernels import layer as _layer_ref
from kernels import layer_native as _layer_native
from kernels import native as _native
from kernels import pack as _pack_ref
from kernels.tags import FRESH_TAG, OWNER_LIMIT, pack_tag, unpack_tag

__all__ = ["FRESH_TAG", "OWNER_LIMIT", "pack_tag", "unpack_tag", "backend",
           "paged_decode_attention", "paged_prefill_attention", "write_kv", "page_checksum",
           "pack_pages", "unpack_pages", "decode_plan", "kv_slots", "write_kv_at", "rms_norm", "silu_mul",
           "rotary_write_kv"]

BACKEND_ENV = "KVPROOF_KERNELS"
# The C kernels run on one thread; torch's elementwise calls use them all. Measured on 2
# cores: C wins by its fewer calls up to a few ten thousand elements (a decode batch: 8
# tokens x 1536 for SiLU * up), torch's two threads from about 100k (64 prefill tokens,
# 2-3x at 512). Above this many elements a call takes the torch reference.
NATIVE_ELEMENTS_MAX = 1 << 16
_BACKENDS = ("triton", "native", "torch")
_warned_no_native = []


def backend(tensor) -> str:
    """'triton', 'native' or 'torch': the path a call on `tensor` takes."""
    forced = os.environ.get(BACKEND_ENV, "")
    if forced:
        assert forced in _BACKENDS, f"{BACKEND_ENV}={forced!r}: expected one of {_BACKENDS}"
        if forced == "native" and not _layer_native.available():
            raise RuntimeError(f"{BACKEND_ENV}=native, but the C kernels did not build: "
                               f"{_native.why_not('layer')}")
        return forced
    if tensor.is_cuda:
        return "triton"
    if _layer_native.available():
        return "native"
    if not _warned_no_native:
        _warned_no_native.append(True)
        warnings.warn(f"kvproof: the C kernels did not build ({_native.why_not('layer')}); "
                      "the CPU engine takes the torch references (same results, slower)",
                      RuntimeWarning, stacklevel=2)
    return "torch"


def _triton(name: str):
    """kernels.<name>_triton, imported on first use (it needs triton installed)."""
    return importlib.import_module(f"kernels.{name}_triton")


def paged_decode_attention(q, kv, layer, block_table, context_lens, expected_tags, tags,
                           scale, *, check_tags=True, num_splits=None, plan=None):
    """(out [batch, q_heads, dim] in q.dtype, tag_ok bool [batch]); see attention.py.
    `plan` (decode_plan, once per step) only serves the torch path; Triton ignores it."""
    path = backend(q)
    if path == "triton":
        return _triton("attention").paged_decode_attention(
            q, kv, layer, block_table, context_lens, expected_tags, tags, scale,
            check_tags=check_tags, num_splits=num_splits)
    return _attention_ref.paged_decode_attention(
        q, kv, layer, block_table, context_lens, expected_tags, tags, scale,
        check_tags=check_tags, num_splits=num_splits, plan=plan,
        tags_match=_layer_native.tags_match if path == "native" else _attention_ref.tags_equal)


def decode_plan(kv, block_table, context_lens, expected_tags):
    """What every layer of one decode step shares on the torch path (attention.DecodePlan);
    None where the Triton kernel runs (it needs none)."""
    if backend(kv) == "triton":
        return None
    return _attention_ref.decode_plan(kv, block_table, context_lens, expected_tags)


def paged_prefill_attention(q, kv, layer, block_table_row, start_pos, scale):
    """Causal attention of new tokens over one sequence's pages; see attention.py."""
    module = _triton("attention") if backend(q) == "triton" else _attention_ref
    return module.paged_prefill_attention(q, kv, layer, block_table_row, start_pos, scale)


def write_kv(kv, layer, slots, k, v):
    """Store k, v [tokens, kv_heads, dim] at slots (page * page_tokens + offset). One
    torch index_copy_ on every device (attention.write_kv says why)."""
    _attention_ref.write_kv(kv, layer, slots, k, v)


def kv_slots(kv, slots):
    """Where each slot's K and V rows lie in every layer (attention.KVSlots), for
    write_kv_at; once per step."""
    return _attention_ref.kv_slots(kv, slots)


def write_kv_at(kv, layer, at, keys_values):
    """Store keys_values [tokens, K|V, kv_heads, dim] at kv_slots' rows: what a model
    step does in every layer, K and V in one index_copy_, on every device."""
    _attention_ref.write_kv_at(kv, layer, at, keys_values)


def rms_norm(hidden, eps: float, dim: int):
    """hidden / sqrt(mean(hidden^2 over dim) + eps) in fp32, rounded once to hidden's
    dtype (no weight); see layer.py."""
    if (backend(hidden) == "native" and hidden.dim() == 2
            and hidden.numel() <= NATIVE_ELEMENTS_MAX):
        return _layer_native.rms_norm(hidden, eps, dim)
    return _layer_ref.rms_norm(hidden, eps, dim)


def silu_mul(gate, up):
    """silu(gate) * up, rounded as F.silu(gate).mul_(up); see layer.py."""
    if backend(gate) == "native" and gate.dim() == 2 and gate.numel() <= NATIVE_ELEMENTS_MAX:
        return _layer_native.silu_mul(gate, up)
    return _layer_ref.silu_mul(gate, up)


def rotary_write_kv(kv, layer, at, heads, q_heads, cos, signed_sin):
    """Rotate the query and key heads of heads [tokens, q + 2 kv heads, dim] in place and
    store its keys and values at kv_slots' rows; see layer.py."""
    if backend(kv) == "native" and heads.numel() <= NATIVE_ELEMENTS_MAX:
        _layer_native.rotary_write_kv(kv, layer, at, heads, q_heads, cos, signed_sin)
    else:
        _layer_ref.rotary_write_kv(kv, layer, at, heads, q_heads, cos, signed_sin)


def page_checksum(kv, pages):
    """int64 [len(pages)] digests of the listed pages; see checksum.py. (On a CPU the C
    digest serves calls of every size: one pass over the bytes, where the reference
    makes three and two copies.)"""
    path = backend(kv)
    if path == "native":
        return _layer_native.page_checksum(kv, pages)
    module = _triton("checksum") if path == "triton" else _checksum_ref
    return module.page_checksum(kv, pages)


def pack_pages(kv, pages):
    """The listed pages gathered into one contiguous [len(pages), page_elems] buffer."""
    module = _triton("pack") if backend(kv) == "triton" else _pack_ref
    return module.pack_pages(kv, pages)


def unpack_pages(buffer, kv, pages):
    """buffer's rows scattered into the listed pages of kv, in place."""
    module = _triton("pack") if backend(kv) == "triton" else _pack_ref
    module.unpack_pages(buffer, kv, pages)
