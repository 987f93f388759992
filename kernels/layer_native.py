"""A decoder layer's small steps, the decode tag check and the page checksum in C
(layer_native.c), for the CPU engine: the wrappers own the C functions' memory contract
(CPU tensors of one float dtype, shapes asserted, strides passed in elements, outputs
allocated here; pool rows and page ids are bounds-checked in C before anything is
written). Tested against the torch references (kernels/layer.py, attention.py,
checksum.py)."""

from __future__ import annotations

import ctypes

import torch

from kernels import native

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "kvproof_rms_norm": [_PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_int, ctypes.c_float,
                         ctypes.c_int],
    "kvproof_silu_mul": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_int],
    "kvproof_rotary_write_kv": [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR,
                                _I64, _PTR, _I64, _PTR, ctypes.c_int],
    "kvproof_tags_match": [_PTR, _I64, _PTR, _PTR, _I64],
    "kvproof_page_checksum": [_PTR, _I64, _I64, _PTR, _I64, _PTR],
}
_functions: dict = {}


def available() -> bool:
    return native.library("layer") is not None


def _function(name: str):
    if name not in _functions:
        function = getattr(native.library("layer"), name)
        function.argtypes, function.restype = _SIGNATURES[name], ctypes.c_int
        _functions[name] = function
    return _functions[name]


def rms_norm(hidden: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    """kernels/layer.rms_norm of a 2-d hidden, `dim` its feature axis; the result is
    contiguous in hidden's shape. The C loops take the engine's two layouts (features or
    tokens contiguous, x and y alike); anything else is made contiguous first."""
    assert hidden.dim() == 2 and hidden.device.type == "cpu" and hidden.dtype in DTYPE_CODES
    if hidden.stride(1) != 1:  # the result's layout: rows of axis 1, contiguous
        hidden = hidden.contiguous()
    normed = torch.empty(hidden.shape, dtype=hidden.dtype)
    feature_major = dim % 2 == 0  # axis 1 holds the tokens: h^T [features, tokens]
    features, tokens = hidden.shape if feature_major else hidden.shape[::-1]
    status = _function("kvproof_rms_norm")(
        hidden.data_ptr(), hidden.stride(0), normed.data_ptr(), normed.stride(0), tokens,
        features, int(feature_major), eps, DTYPE_CODES[hidden.dtype])
    assert status == 0, "the C norm refused its arguments (a wrapper bug)"
    return normed


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """kernels/layer.silu_mul of two 2-d views whose rows are contiguous (a gate_up
    projection's halves: chunks of its rows, or of its feature-major block); the result is
    contiguous."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.dtype == up.dtype
    assert gate.device.type == "cpu" and up.device.type == "cpu" and gate.dtype in DTYPE_CODES
    out = torch.empty(gate.shape, dtype=gate.dtype)
    if gate.is_contiguous() and up.is_contiguous():  # one run each: [features * tokens]
        runs, run_length, strides = 1, gate.numel(), (0, 0, 0)
    else:
        if gate.stride(1) != 1 or up.stride(1) != 1:  # no engine layout: rows made so
            gate, up = gate.contiguous(), up.contiguous()
        runs, run_length = gate.shape
        strides = (gate.stride(0), up.stride(0), out.stride(0))
    status = _function("kvproof_silu_mul")(
        gate.data_ptr(), strides[0], up.data_ptr(), strides[1], out.data_ptr(), strides[2],
        runs, run_length, DTYPE_CODES[gate.dtype])
    assert status == 0, "the C silu_mul refused its arguments (a wrapper bug)"
    return out


def rotary_write_kv(kv, layer: int, at, heads: torch.Tensor, q_heads: int,
                    cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """kernels/layer.rotary_write_kv in one C call."""
    tokens, num_heads, head_dim = heads.shape
    kv_heads = (num_heads - q_heads) // 2
    assert kv.dim() == 6 and kv.shape[3] == kv_heads and kv.shape[5] == head_dim
    assert heads.dtype == kv.dtype == cos.dtype == signed_sin.dtype
    assert heads.dtype in DTYPE_CODES and kv.device.type == heads.device.type == "cpu"
    assert kv.is_contiguous(), "the pool must be contiguous"
    assert at.target.data_ptr() == kv.data_ptr(), "KVSlots of another pool"
    assert cos.shape == signed_sin.shape == (tokens, head_dim)
    assert cos.stride() == signed_sin.stride() and cos.stride(1) == 1
    rows = at.rows[layer]
    assert rows.dtype == torch.int64 and rows.is_contiguous()
    assert rows.shape == (tokens * 2 * kv_heads,)
    status = _function("kvproof_rotary_write_kv")(
        heads.data_ptr(), *heads.stride(), tokens, q_heads, kv_heads, head_dim,
        cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0), kv.data_ptr(),
        kv.numel() // head_dim, rows.data_ptr(), DTYPE_CODES[heads.dtype])
    assert status == 0, "the C rotary/KV write refused its arguments (a wrapper bug)"


def tags_match(tags: torch.Tensor, ids: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether tags[ids] == expected everywhere (ids inside the pool)."""
    assert tags.dtype == ids.dtype == expected.dtype == torch.int64
    assert tags.is_contiguous() and ids.is_contiguous() and expected.is_contiguous()
    assert ids.shape == expected.shape and tags.device.type == "cpu"
    status = _function("kvproof_tags_match")(tags.data_ptr(), tags.shape[0], ids.data_ptr(),
                                            expected.data_ptr(), ids.numel())
    assert status >= 0, "a page id outside the pool (a plan bug)"
    return status == 1


def page_checksum(kv: torch.Tensor, pages) -> torch.Tensor:
    """kernels/checksum.page_checksum in one pass over each page's bytes."""
    assert kv.device.type == "cpu" and kv.is_contiguous(), "a contiguous CPU pool"
    index = torch.as_tensor(pages).to(torch.int64).contiguous()
    assert index.dim() == 1
    digests = torch.empty(index.shape[0], dtype=torch.int64)
    page_bytes = kv[0].numel() * kv.element_size() if kv.shape[0] else 0
    status = _function("kvproof_page_checksum")(
        kv.data_ptr(), kv.shape[0], page_bytes, index.data_ptr(), index.shape[0],
        digests.data_ptr())
    assert status == 0, "a page outside the pool, or a page of odd bytes (a caller bug)"
    return digests
