"""Paged attention in Triton: tag-checked decode (with split-K) and causal prefill.

Theory of operation (decode). One program per (sequence, kv head, split). It loads the
GROUP query heads that share its kv head as one [BLOCK_G, dim] tile, so every K/V byte
read serves all of them (GQA), and walks its share of the sequence's pages, PAGES_PER_ITER
pages (BLOCK_N tokens) per iteration:
  1. page ids for the iteration's tokens from the block table (one cache line per page);
  2. K tile [BLOCK_N, dim] -> scores = q . K^T (tl.dot, fp32 accumulate), masked past the
     context length (the partial last page) and on ids outside the pool (never loaded);
  3. with CHECK_TAGS, each page's tag and the tag the block table expects; a page that
     differs (or an id outside the pool) is recorded as a mismatch and its tokens' scores
     are masked to -inf. The K/V loads do not wait for this compare (it would put a
     dependent memory round trip in the loop); a sequence with a mismatch has its output
     replaced by zeros at the end (tl.where, so even a NaN from foreign bytes cannot
     leak), and each program serves one sequence, so no other sequence sees the bytes;
  4. online softmax in fp32, base 2 (scale * log2(e) folded into the scores): running max
     m, running sum l, accumulator acc rescaled by 2^(m_old - m_new);
  5. V tile [BLOCK_N, dim]; acc += p . V.
With one split the program normalises and stores the output, or zeros when the sequence
had a mismatch. With several (flash-decoding), split s takes pages [s*per, (s+1)*per) of
its own sequence (per = ceil(pages / splits), so a split may be empty), stores acc / l and
log2-sum-exp m + log2(l) in fp32, and a second kernel (_combine_splits) merges the splits
with weights 2^(lse_s - max lse) and zeros sequences with a mismatch. The mismatch flag is
one int32 per sequence, set (never cleared) by any program that saw a bad page; tag_ok is
its negation.

The tag check costs, per iteration, loads of BLOCK_N block-table entries, tags and
expected tags that fall on PAGES_PER_ITER cache lines each, against 2 * BLOCK_N * dim
elements of K and V: for 16-token pages and dim 128 in bf16, 48 bytes next to 8 KiB.

Prefill: one program per (block of BLOCK_M new tokens, q head), the same page walk over
the keys up to the last position the block can see, causal mask, no tag check (the
contract's prefill reads pages the prefill worker itself allocated and wrote this step;
tags are checked where pages cross a trust boundary: decode).

Launch choices (untuned until a GPU run; bench/kernels_bench.py measures them):
- BLOCK_G >= 16 because tl.dot needs M >= 16 on tensor cores; the padding rows cost
  arithmetic, not bandwidth, and decode is bandwidth-bound.
- BLOCK_N = 32 tokens for dim 128 (K and V tiles of 8 KiB each in bf16) and 64 for dim 64:
  big enough for 16-byte vector loads across all lanes and two tiles in flight per stage.
- num_warps = 4: one [16, BLOCK_N] x [BLOCK_N, dim] product per step is small; more warps
  would only split it further. num_stages = 3: the page-id loads make the K/V addresses
  data-dependent, so deeper software pipelining is what hides the gather latency.
- Split count: enough (sequence, kv head, split) programs for ~4 waves over the GPU's
  SMs, at least MIN_PAGES_PER_SPLIT pages per split, at most MAX_SPLITS.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.attention import check_decode_args

LOG2_E = 1.4426950408889634
MIN_PAGES_PER_SPLIT = 8
MAX_SPLITS = 64
WAVES_WANTED = 4
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _token_pages(block_table_row_ptr, first_slot, slot_end, num_pages,
                 PAGE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr):
    """For BLOCK_N tokens starting at page slot first_slot: (slot, page id, whether the id
    is in the pool and the slot below slot_end, token offset within its page)."""
    n = tl.arange(0, BLOCK_N)
    slot = first_slot + n // PAGE_TOKENS
    in_range = slot < slot_end
    page = tl.load(block_table_row_ptr + slot, mask=in_range, other=-1)
    id_ok = in_range & (page >= 0) & (page < num_pages)
    return slot, tl.where(id_ok, page, 0).to(tl.int64), id_ok, n % PAGE_TOKENS


@triton.jit
def _load_tile(head_base_ptr, page, token, mask, stride_page, stride_token,
               HEAD_DIM: tl.constexpr):
    """[BLOCK_N, HEAD_DIM] rows of one kv head (K or V of one layer), zeros where masked."""
    d = tl.arange(0, HEAD_DIM)
    offsets = page[:, None] * stride_page + token[:, None] * stride_token + d[None, :]
    return tl.load(head_base_ptr + offsets, mask=mask[:, None], other=0.0)


@triton.jit
def _online_softmax_step(q, k, v, token_ok, m_i, l_i, acc, scale_log2,
                         DOT_PRECISION: tl.constexpr):
    """One block of keys folded into (m, l, acc); scores in base 2, fp32."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    scores = tl.where(token_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, kv_ptr, block_table_ptr, context_lens_ptr, expected_ptr, tags_ptr,
                   out_ptr, split_out_ptr, split_lse_ptr, mismatch_ptr,
                   layer, scale_log2, num_pages, num_splits,
                   stride_q_seq, stride_q_head, stride_page, stride_layer, stride_kv,
                   stride_head, stride_token, stride_table, stride_out_seq, stride_out_head,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_TOKENS: tl.constexpr, PAGES_PER_ITER: tl.constexpr,
                   CHECK_TAGS: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_N: tl.constexpr = PAGES_PER_ITER * PAGE_TOKENS
    context = tl.load(context_lens_ptr + seq)
    seq_pages = tl.cdiv(context, PAGE_TOKENS)
    pages_per_split = tl.cdiv(seq_pages, num_splits)
    slot_begin = split * pages_per_split
    slot_end = tl.minimum(slot_begin + pages_per_split, seq_pages)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    q_head = kv_head * GROUP + g
    q_offsets = seq * stride_q_seq + q_head[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=(g < GROUP)[:, None], other=0.0)

    table_row = block_table_ptr + seq.to(tl.int64) * stride_table
    expected_row = expected_ptr + seq.to(tl.int64) * stride_table
    head_base = kv_ptr + layer * stride_layer + kv_head * stride_head
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: an all-masked block stays NaN-free
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    mismatch = tl.zeros([BLOCK_N], tl.int32)
    for first_slot in tl.range(slot_begin, slot_end, PAGES_PER_ITER):
        slot, page, id_ok, token = _token_pages(table_row, first_slot, slot_end, num_pages,
                                                PAGE_TOKENS, BLOCK_N)
        token_ok = id_ok & (slot * PAGE_TOKENS + token < context)
        # K/V addresses depend on the block table only, never on the tag compare, so the
        # check adds no memory round trip to the loop's critical path.
        k = _load_tile(head_base, page, token, token_ok, stride_page, stride_token, HEAD_DIM)
        v = _load_tile(head_base + stride_kv, page, token, token_ok, stride_page, stride_token,
                       HEAD_DIM)
        if CHECK_TAGS:
            in_range = slot < slot_end
            tag = tl.load(tags_ptr + page, mask=id_ok, other=-1)
            expected = tl.load(expected_row + slot, mask=in_range, other=-1)
            bad = in_range & ((~id_ok) | (tag != expected))
            mismatch = tl.maximum(mismatch, bad.to(tl.int32))
            token_ok = token_ok & (~bad)  # a foreign token gets weight 0
        m_i, l_i, acc = _online_softmax_step(q, k, v, token_ok, m_i, l_i, acc, scale_log2,
                                             DOT_PRECISION)
    saw_mismatch = tl.max(mismatch, axis=0) > 0
    tl.store(mismatch_ptr + seq, 1, mask=saw_mismatch)
    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]  # l == 0: no key seen, acc is 0
    row_ok = g < GROUP
    if SPLIT:
        row = (seq * (GROUP * tl.num_programs(1)) + q_head) * num_splits + split
        tl.store(split_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1.0e-30)), float("-inf"))
        tl.store(split_lse_ptr + row, lse, mask=row_ok)
    else:
        if CHECK_TAGS:
            out = tl.where(saw_mismatch, 0.0, out)
        out_offsets = seq * stride_out_seq + q_head[:, None] * stride_out_head + d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_splits(split_out_ptr, split_lse_ptr, mismatch_ptr, out_ptr, num_splits,
                    stride_out_seq, stride_out_head,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, CHECK_TAGS: tl.constexpr):
    """out[seq, head] = sum_s 2^(lse_s - max) * out_s / sum_s 2^(lse_s - max), or zeros."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    row = (seq * tl.num_programs(1) + head) * num_splits + s
    lse = tl.load(split_lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # 0 for empty splits
    parts = tl.load(split_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                    mask=(s < num_splits)[:, None], other=0.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.maximum(tl.sum(weight, axis=0), 1.0e-30)
    if CHECK_TAGS:
        out = tl.where(tl.load(mismatch_ptr + seq) != 0, 0.0, out)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + d,
             out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q, kv, layer, block_table, context_lens, expected_tags, tags,
                           scale, *, check_tags=True, num_splits=None):
    """The contract's decode attention (see kernels/attention.py for the semantics)."""
    check_decode_args(q, kv, layer, block_table, context_lens, expected_tags, tags, num_splits)
    _check_layout(q, kv)
    batch, num_q_heads, head_dim = q.shape
    num_pages, _, _, num_kv_heads, page_tokens, _ = kv.shape
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_table.shape[1], q.device)
    block_table, expected_tags = block_table.contiguous(), expected_tags.contiguous()
    out = torch.empty_like(q)
    mismatch = torch.zeros(batch, dtype=torch.int32, device=q.device)
    split = num_splits > 1
    split_shape = (batch, num_q_heads, num_splits) if split else (1,)
    split_lse = torch.empty(split_shape, dtype=torch.float32, device=q.device)
    split_out = torch.empty(split_shape + ((head_dim,) if split else ()),
                            dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, kv, block_table, context_lens, expected_tags, tags, out, split_out, split_lse,
        mismatch, layer, scale * LOG2_E, num_pages, num_splits,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        kv.stride(4), block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_TOKENS=page_tokens, PAGES_PER_ITER=pages_per_iteration(page_tokens, head_dim),
        CHECK_TAGS=check_tags, SPLIT=split, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if split:
        _combine_splits[(batch, num_q_heads)](
            split_out, split_lse, mismatch, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
            CHECK_TAGS=check_tags, num_warps=NUM_WARPS)
    if not check_tags:
        return out, torch.ones(batch, dtype=torch.bool, device=q.device)
    return out, mismatch == 0


@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, table_row_ptr, out_ptr, layer, scale_log2, num_pages,
                    start_pos, new_tokens, stride_q_token, stride_q_head, stride_page,
                    stride_layer, stride_kv, stride_head, stride_token,
                    stride_out_token, stride_out_head,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PAGE_TOKENS: tl.constexpr, PAGES_PER_ITER: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    q_head = tl.program_id(1)
    BLOCK_N: tl.constexpr = PAGES_PER_ITER * PAGE_TOKENS
    t = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    row_ok = t < new_tokens
    q = tl.load(q_ptr + t[:, None] * stride_q_token + q_head * stride_q_head + d[None, :],
                mask=row_ok[:, None], other=0.0)
    query_pos = start_pos + t
    keys_seen = tl.minimum(start_pos + (block + 1) * BLOCK_M, start_pos + new_tokens)
    slot_end = tl.cdiv(keys_seen, PAGE_TOKENS)
    head_base = kv_ptr + layer * stride_layer + (q_head // GROUP) * stride_head
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for first_slot in tl.range(0, slot_end, PAGES_PER_ITER):
        slot, page, id_ok, token = _token_pages(table_row_ptr, first_slot, slot_end, num_pages,
                                                PAGE_TOKENS, BLOCK_N)
        key_pos = slot * PAGE_TOKENS + token
        token_ok = id_ok & (key_pos < keys_seen)
        k = _load_tile(head_base, page, token, token_ok, stride_page, stride_token, HEAD_DIM)
        v = _load_tile(head_base + stride_kv, page, token, token_ok, stride_page, stride_token,
                       HEAD_DIM)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = token_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
    tl.store(out_ptr + t[:, None] * stride_out_token + q_head * stride_out_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(q, kv, layer, block_table_row, start_pos, scale):
    """The contract's prefill attention (see kernels/attention.py for the semantics)."""
    _check_layout(q, kv)
    new_tokens, num_q_heads, head_dim = q.shape
    num_pages, _, _, num_kv_heads, page_tokens, _ = kv.shape
    assert num_q_heads % num_kv_heads == 0 and block_table_row.dim() == 1
    assert -(-(start_pos + new_tokens) // page_tokens) <= block_table_row.shape[0]
    out = torch.empty_like(q)
    block_m = 16 if new_tokens <= 16 else 64
    grid = (triton.cdiv(new_tokens, block_m), num_q_heads)
    _prefill_kernel[grid](
        q, kv, block_table_row.contiguous(), out, layer, scale * LOG2_E, num_pages, start_pos,
        new_tokens, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        kv.stride(3), kv.stride(4), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, BLOCK_M=block_m, HEAD_DIM=head_dim,
        PAGE_TOKENS=page_tokens, PAGES_PER_ITER=pages_per_iteration(page_tokens, head_dim),
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def pages_per_iteration(page_tokens, head_dim):
    """Pages per loop step: BLOCK_N = pages * page_tokens tokens, aiming at 32 tokens for
    dim 128 and 64 for dim 64 (see the module header), at least one page."""
    tokens_wanted = 32 if head_dim >= 128 else 64
    return max(1, tokens_wanted // page_tokens)


def choose_num_splits(batch, num_kv_heads, max_pages, device):
    """Splits so that (sequence, kv head, split) programs fill ~WAVES_WANTED waves."""
    programs_wanted = WAVES_WANTED * _multiprocessor_count(device)
    programs = batch * num_kv_heads
    if programs >= programs_wanted:
        return 1
    splits = math.ceil(programs_wanted / programs)
    return max(1, min(splits, max_pages // MIN_PAGES_PER_SPLIT, MAX_SPLITS))


def _multiprocessor_count(device):
    if device.type != "cuda":
        return 1  # the interpreter: no waves to fill
    return _cuda_multiprocessors(device.index if device.index is not None
                                 else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_multiprocessors(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def _dot_precision(dtype):
    """fp32 pools keep fp32 products (the reference's); 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_layout(q, kv):
    assert q.dtype == kv.dtype, "q and the pool must share a dtype"
    assert kv.is_contiguous() and q.stride(-1) == 1
    head_dim, page_tokens = kv.shape[5], kv.shape[4]
    assert head_dim in (64, 128, 256), "head dims are powers of two (tile shapes)"
    assert page_tokens & (page_tokens - 1) == 0, "page_tokens must be a power of two"
    assert kv[0].numel() < 2**31, "a page's elements are indexed in int32"
