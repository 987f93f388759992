"""kvproof kernels: tag-checked paged attention, page checksums, page pack/unpack.

The one place that picks an implementation. Every public function takes the same
arguments on every path (the contract: kernels/README.md) and runs either
- the Triton kernel (`*_triton.py`), for CUDA tensors, or
- the torch reference (`attention.py`, `checksum.py`, `pack.py`), for everything else;
KVPROOF_KERNELS=triton|torch forces one (tests run the Triton kernels on the CPU that way,
with TRITON_INTERPRET=1). The variable is read on every call, so a test can set it late.
Triton modules are imported only when first chosen: the CPU engine never needs Triton.

kernels never imports the protocol (spec/, sim/, fuzz/, api/); engine/ imports kernels.
"""

from __future__ import annotations

import importlib
import os

from kernels import attention as _attention_ref
from kernels import checksum as _checksum_ref
from kernels import pack as _pack_ref
from kernels.tags import FRESH_TAG, pack_tag, unpack_tag

__all__ = ["FRESH_TAG", "pack_tag", "unpack_tag", "backend", "paged_decode_attention",
           "paged_prefill_attention", "write_kv", "page_checksum", "pack_pages",
           "unpack_pages", "decode_plan", "kv_slots", "write_kv_at"]

BACKEND_ENV = "KVPROOF_KERNELS"
_BACKENDS = ("triton", "torch")


def backend(tensor) -> str:
    """'triton' or 'torch': the path a call on `tensor` takes."""
    forced = os.environ.get(BACKEND_ENV, "")
    if forced:
        assert forced in _BACKENDS, f"{BACKEND_ENV}={forced!r}: expected one of {_BACKENDS}"
        return forced
    return "triton" if tensor.is_cuda else "torch"


def _triton(name: str):
    """kernels.<name>_triton, imported on first use (it needs triton installed)."""
    return importlib.import_module(f"kernels.{name}_triton")


def paged_decode_attention(q, kv, layer, block_table, context_lens, expected_tags, tags,
                           scale, *, check_tags=True, num_splits=None, plan=None):
    """(out [batch, q_heads, dim] in q.dtype, tag_ok bool [batch]); see attention.py.
    `plan` (decode_plan, once per step) only serves the torch path; Triton ignores it."""
    if backend(q) == "triton":
        return _triton("attention").paged_decode_attention(
            q, kv, layer, block_table, context_lens, expected_tags, tags, scale,
            check_tags=check_tags, num_splits=num_splits)
    return _attention_ref.paged_decode_attention(
        q, kv, layer, block_table, context_lens, expected_tags, tags, scale,
        check_tags=check_tags, num_splits=num_splits, plan=plan)


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


def page_checksum(kv, pages):
    """int64 [len(pages)] digests of the listed pages; see checksum.py."""
    module = _triton("checksum") if backend(kv) == "triton" else _checksum_ref
    return module.page_checksum(kv, pages)


def pack_pages(kv, pages):
    """The listed pages gathered into one contiguous [len(pages), page_elems] buffer."""
    module = _triton("pack") if backend(kv) == "triton" else _pack_ref
    return module.pack_pages(kv, pages)


def unpack_pages(buffer, kv, pages):
    """buffer's rows scattered into the listed pages of kv, in place."""
    module = _triton("pack") if backend(kv) == "triton" else _pack_ref
    module.unpack_pages(buffer, kv, pages)
