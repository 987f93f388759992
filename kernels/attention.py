"""Paged attention, torch reference: decode (one query token per sequence, tag-checked)
and prefill (many query tokens of one sequence, causal).

Theory of operation. The pool is page-major, kv[page, layer, K|V, kv_head, token, dim]
(kernels/README.md). A sequence's context is the concatenation of the pages its block-table
row names, the last one possibly partial. The reference gathers those pages into one
contiguous [kv_heads, tokens, dim] K and V per sequence, masks tokens past the context
length, and runs softmax attention in fp32, the plain way. It is the definition the Triton
kernels (attention_triton.py) are tested against, and the path the engine takes on the CPU.

The tag check: a page slot i of sequence b is *read* when it holds context (i * page_tokens
< context_lens[b]). Every read page's tag must equal expected_tags[b, i]; a sequence with
any mismatch gets tag_ok False and an all-zero output, so nothing derived from a foreign
page leaves the kernel. A page id outside the pool (-1 included) in a read slot is never
dereferenced: its tokens are left out, and with the check on it is reported as a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class DecodePlan:
    """What every layer of one decode step shares, computed once per step on the torch
    path: the same block table, context lengths and expected tags go to all layers, and
    on a CPU each torch call saved per layer is saved num_layers times.
    - gather_rows [layers, batch * 2 * kv_heads * pages]: for each layer, the rows of
      kv.view(-1, page_tokens * dim) holding each sequence's K|V tiles, in the order
      [batch, K|V, kv_head, page] (one index_select then gives per-head K and V);
    - stale_rows: int64, the rows of the gathered [batch, K|V, kv_head, tokens, dim]
      copy (viewed as [-1, dim]) that hold tokens no sequence may read (past its
      context, or on a page outside the pool): pages are never zeroed, so they hold
      whatever an earlier owner left, inf and NaN included, and a masked score does not
      keep a NaN out of torch's fused attention (NaN + -inf is NaN, 0 * inf is NaN).
      They are zeroed in the copy before attention (one index_fill_: 13 us a layer at
      batch 8, where a broadcast masked_fill_ took 90); None when there are none;
    - attn_mask: the additive mask [batch, 1, 1, tokens] in kv's dtype, 0 where a token
      is read and -inf where it is stale (0 everywhere for a sequence with no context:
      it attends over zeroed tokens, so its output is zeros), or None when nothing is
      stale (a single sequence whose pages all exist: keys cut to its context);
    - read_ids, read_expected: the page of every read slot (inside the context, a valid
      id) and the tag expected there, flattened: the tag check per layer is one gather and
      one comparison; ids_ok [batch] is False where a read slot names no page of the pool."""
    page_ids: torch.Tensor  # int64 [batch, pages], clamped into the pool
    id_valid: torch.Tensor  # bool [batch, pages]
    gather_rows: torch.Tensor
    stale_rows: torch.Tensor | None
    attn_mask: torch.Tensor | None
    context_tokens: int  # keys kept per sequence: the longest context
    read_ids: torch.Tensor
    read_expected: torch.Tensor
    ids_ok: torch.Tensor
    all_ids_ok: bool
    all_passed: torch.Tensor  # bool [batch], all True: the verdict when every check passed
    tiles: torch.Tensor  # kv.view(-1, page_tokens * dim), what gather_rows index, made once


def decode_plan(kv, block_table, context_lens, expected_tags) -> DecodePlan:
    """The per-step part of paged_decode_attention (see DecodePlan)."""
    num_pages, num_layers, _, num_kv_heads, page_tokens, _ = kv.shape
    batch, pages = block_table.shape
    page_ids, id_valid = clamp_page_ids(block_table, num_pages)
    tiles_per_page = 2 * num_kv_heads  # K|V x kv_head tiles of one page in one layer
    within = torch.arange(tiles_per_page, device=kv.device).view(1, 2, num_kv_heads, 1)
    assert kv.is_contiguous(), "the pool must be contiguous (rows of one tile each)"
    layer_0 = (page_ids[:, None, None, :] * (num_layers * tiles_per_page) + within).reshape(-1)
    layers = torch.arange(num_layers, device=kv.device)[:, None] * tiles_per_page
    gather_rows = layer_0[None, :] + layers
    slot_read = page_slots_read(context_lens, page_tokens, pages)
    ids_ok = ~(slot_read & ~id_valid).any(dim=1)
    read = slot_read & id_valid
    lengths = context_lens.tolist()
    all_ids_ok = bool(ids_ok.all())
    if batch == 1 and all_ids_ok and lengths[0] > 0:
        stale_rows, attn_mask, context_tokens = None, None, lengths[0]
    else:
        # keys past the longest context are read by no sequence: attention leaves them
        # out (keys cut there), and only the stale tokens before it need zeroing
        context_tokens = max(max(lengths), 1)
        token_read = _token_mask(context_lens, id_valid, page_tokens)
        stale = ~token_read
        stale[:, context_tokens:] = False
        stale = stale[:, None, None, :].expand(batch, 2, num_kv_heads, -1)
        stale_rows = stale.reshape(-1).nonzero().view(-1)
        if stale_rows.numel() == 0:
            stale_rows = None
        # additive, not bool: torch's fused attention turns a bool mask into this one
        # with two calls in every layer
        token_read = token_read[:, :context_tokens]
        attn_mask = torch.zeros(token_read.shape, dtype=kv.dtype, device=kv.device)
        attn_mask.masked_fill_(~token_read & token_read.any(dim=1, keepdim=True), _NEG_INF)
        attn_mask = attn_mask[:, None, None, :]
    return DecodePlan(page_ids, id_valid, gather_rows, stale_rows, attn_mask, context_tokens,
                      page_ids[read], expected_tags[read], ids_ok, all_ids_ok,
                      torch.ones(batch, dtype=torch.bool, device=kv.device),
                      kv.view(-1, page_tokens * kv.shape[5]))


def tags_equal(tags, ids, expected) -> bool:
    """Whether tags[ids] == expected everywhere (ids inside the pool): the decode step's
    common-case tag check (layer_native.tags_match is the same in one C call)."""
    return torch.equal(tags.index_select(0, ids), expected)


def paged_decode_attention(q, kv, layer, block_table, context_lens, expected_tags, tags,
                           scale, *, check_tags=True, num_splits=None, plan=None,
                           tags_match=tags_equal):
    """See kernels/README.md, "Decode attention"; num_splits changes nothing here (it
    only schedules the Triton kernel) but is validated the same way. The CPU engine's
    path: the same result as paged_decode_attention_plain in a few torch calls per layer
    (one gather straight into [batch, K|V, kv_heads, tokens, dim], torch's fused
    attention, a tag check of one gather and one comparison), given the step's `plan`
    (decode_plan; made here when the caller has none). tags_match(tags, ids, expected) is
    the common case's check (kernels/__init__ passes the C one where it runs: a call a
    layer where torch makes two)."""
    check_decode_args(q, kv, layer, block_table, context_lens, expected_tags, tags, num_splits)
    if plan is None:
        plan = decode_plan(kv, block_table, context_lens, expected_tags)
    batch, pages = block_table.shape
    _, _, _, num_kv_heads, page_tokens, head_dim = kv.shape
    # each torch call below is paid num_layers times a step, in caches the weights just
    # went through: no call that the common case does not need (a slice that keeps every
    # token, a cast to the dtype the tensor has)
    assert plan.tiles.data_ptr() == kv.data_ptr(), "a plan made for another pool"
    tiles = plan.tiles.index_select(0, plan.gather_rows[layer])
    if plan.stale_rows is not None:  # no earlier owner's inf or NaN gets in
        tiles.view(-1, head_dim).index_fill_(0, plan.stale_rows, 0)
    keys, values = tiles.view(batch, 2, num_kv_heads, pages * page_tokens, head_dim).unbind(1)
    if plan.context_tokens < pages * page_tokens:
        keys, values = keys[:, :, :plan.context_tokens], values[:, :, :plan.context_tokens]
    attn_mask = plan.attn_mask
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if attn_mask is not None and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    # the query heads of one KV head as that head's query rows: plain attention over the
    # shared keys, without torch's GQA path (which expands K and V to every query head:
    # 48 vs 30 us a layer at batch 8 in fp32)
    num_q_heads = q.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim), keys, values,
        attn_mask=attn_mask, scale=scale).view(batch, num_q_heads, head_dim)
    if not check_tags:
        return out, plan.all_passed
    if plan.all_ids_ok and tags_match(tags, plan.read_ids, plan.read_expected):
        return out, plan.all_passed  # every page read carries the tag its table expects
    slot_read = page_slots_read(context_lens, page_tokens, pages)
    tag_matches = (tags[plan.page_ids] == expected_tags) & plan.id_valid
    tag_ok = (slot_read <= tag_matches).all(dim=1)  # every read slot's tag matches
    # where, not a multiply: NaN or inf in a foreign page must not survive as NaN.
    return torch.where(tag_ok[:, None, None], out, 0.0), tag_ok


def paged_decode_attention_plain(q, kv, layer, block_table, context_lens, expected_tags,
                                 tags, scale, *, check_tags=True, num_splits=None):
    """The definition, written the plain way (einsum softmax in fp32); the fast path above
    is tested against it."""
    check_decode_args(q, kv, layer, block_table, context_lens, expected_tags, tags, num_splits)
    page_tokens = kv.shape[4]
    slot_read = page_slots_read(context_lens, page_tokens, block_table.shape[1])
    page_ids, id_valid = clamp_page_ids(block_table, kv.shape[0])
    tag_ok = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    if check_tags:
        tag_matches = id_valid & (tags[page_ids] == expected_tags)
        tag_ok = ~(slot_read & ~tag_matches).any(dim=1)
    keys, values = gather_pages(kv, layer, page_ids)  # [batch, kv_heads, tokens, dim]
    token_valid = _token_mask(context_lens, id_valid, page_tokens)  # [batch, tokens]
    # a token that is not read is not used either: a masked score keeps no inf or NaN of
    # an earlier owner out of the weighted sum (0 * inf is NaN)
    keys = keys.masked_fill(~token_valid[:, None, :, None], 0)
    values = values.masked_fill(~token_valid[:, None, :, None], 0)
    out = _attend(q.float()[:, :, None, :], keys, values, token_valid[:, None, :], scale)
    out = out[:, :, 0, :]
    if check_tags:
        out = out * tag_ok[:, None, None]
    return out.to(q.dtype), tag_ok


def _prefill_pages(q, kv, block_table_row, start_pos):
    """New tokens, context tokens and the page ids a prefill chunk reads, checked."""
    new_tokens, num_q_heads, head_dim = q.shape
    page_tokens = kv.shape[4]
    context_tokens = start_pos + new_tokens
    pages_read = -(-context_tokens // page_tokens)
    assert block_table_row.dim() == 1 and pages_read <= block_table_row.shape[0]
    assert num_q_heads % kv.shape[3] == 0 and head_dim == kv.shape[5]
    page_ids = block_table_row[:pages_read].long()
    assert bool(((page_ids >= 0) & (page_ids < kv.shape[0])).all()), "page id outside the pool"
    return new_tokens, context_tokens, page_ids


def paged_prefill_attention(q, kv, layer, block_table_row, start_pos, scale):
    """Causal attention of q [new_tokens, q_heads, dim] at positions start_pos.. over the
    sequence's pages, which already hold the prefix and the new tokens. Torch's fused
    attention (it never builds the [new_tokens, context] score matrix on the CPU)."""
    new_tokens, context_tokens, page_ids = _prefill_pages(q, kv, block_table_row, start_pos)
    keys, values = gather_pages_by_head(kv, layer, page_ids[None])
    keys, values = keys[:, :, :context_tokens], values[:, :, :context_tokens]
    query_pos = start_pos + torch.arange(new_tokens, device=q.device)
    causal = torch.arange(context_tokens, device=q.device)[None, :] <= query_pos[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 0, 2)[None], keys.to(q.dtype), values.to(q.dtype), attn_mask=causal,
        scale=scale, enable_gqa=True)
    return out[0].permute(1, 0, 2)


def paged_prefill_attention_plain(q, kv, layer, block_table_row, start_pos, scale):
    """The definition, the plain way; the fast path above is tested against it."""
    new_tokens, context_tokens, page_ids = _prefill_pages(q, kv, block_table_row, start_pos)
    keys, values = gather_pages(kv, layer, page_ids[None])
    keys, values = keys[0, :, :context_tokens], values[0, :, :context_tokens]
    query_pos = start_pos + torch.arange(new_tokens, device=q.device)
    key_pos = torch.arange(context_tokens, device=q.device)
    causal = key_pos[None, :] <= query_pos[:, None]  # [new_tokens, context_tokens]
    queries = q.float().permute(1, 0, 2)[None]  # [1, q_heads, new_tokens, dim]
    out = _attend(queries, keys[None], values[None], causal[None], scale)
    return out[0].permute(1, 0, 2).to(q.dtype)


def write_kv(kv, layer, slots, k, v):
    """kv[slot's page, layer, K|V, :, slot's offset, :] = k, v for every slot (one
    index_copy_, on any device: a decode step writes one token per sequence, far too little
    for a kernel of its own to matter)."""
    assert slots.dim() == 1 and k.shape == v.shape and k.shape[0] == slots.shape[0]
    write_kv_at(kv, layer, kv_slots(kv, slots), torch.stack((k, v), dim=1))


@dataclass(frozen=True)
class KVSlots:
    """Where one step's tokens go, computed once per step (kv_slots): rows[layer] lists,
    in [token, K|V, head] order, the rows of kv.view(-1, head_dim) that the tokens' K and
    V vectors occupy in that layer."""
    rows: torch.Tensor  # int64 [layers, tokens * 2 * kv_heads]
    target: torch.Tensor  # kv.view(-1, head_dim), made once


def kv_slots(kv, slots):
    """KVSlots of slots (page * page_tokens + offset) [tokens] in this pool."""
    _, num_layers, _, num_kv_heads, page_tokens, _ = kv.shape
    assert kv.is_contiguous(), "the pool must be contiguous (rows of one head_dim each)"
    slots = slots.long()
    pages, offsets = slots // page_tokens, slots % page_tokens
    tiles = torch.arange(2 * num_kv_heads, device=kv.device).view(1, 2, num_kv_heads)
    page_tiles = pages[:, None, None] * (num_layers * 2 * num_kv_heads) + tiles
    layer_0 = (page_tiles * page_tokens + offsets[:, None, None]).view(-1)
    layers = torch.arange(num_layers, device=kv.device)[:, None] * (2 * num_kv_heads
                                                                    * page_tokens)
    return KVSlots(layer_0[None, :] + layers, kv.view(-1, kv.shape[5]))


def write_kv_at(kv, layer, at, keys_values):
    """kv[page, layer, K|V, :, offset, :] = keys_values [tokens, K|V, kv_heads, dim] at the
    KVSlots `at`: one index_copy_ of K and V together into the pool's rows."""
    num_kv_heads, head_dim = kv.shape[3], kv.shape[5]
    assert keys_values.shape == (at.rows.shape[1] // (2 * num_kv_heads), 2, num_kv_heads,
                                 head_dim), "keys_values must be [tokens, K|V, kv_heads, dim]"
    if keys_values.dtype != kv.dtype:
        keys_values = keys_values.to(kv.dtype)
    assert at.target.data_ptr() == kv.data_ptr(), "KVSlots of another pool"
    at.target.index_copy_(0, at.rows[layer], keys_values.reshape(-1, head_dim))


def check_decode_args(q, kv, layer, block_table, context_lens, expected_tags, tags, num_splits):
    """The contract's shapes and dtypes, asserted on both paths (cheap: no device sync)."""
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_layers, two, num_kv_heads, _, kv_head_dim = kv.shape
    assert two == 2 and head_dim == kv_head_dim and 0 <= layer < num_layers
    assert num_q_heads % num_kv_heads == 0, "GQA needs q heads to be a multiple of kv heads"
    assert block_table.dtype == torch.int32 and block_table.shape[0] == batch
    assert context_lens.dtype == torch.int32 and context_lens.shape == (batch,)
    assert expected_tags.dtype == torch.int64 and expected_tags.shape == block_table.shape
    assert tags.dtype == torch.int64 and tags.shape == (num_pages,)
    assert num_splits is None or num_splits >= 1


def page_slots_read(context_lens, page_tokens, max_pages):
    """bool [batch, max_pages]: slot i holds context, so decode reads (and checks) it."""
    slot = torch.arange(max_pages, device=context_lens.device)
    return slot[None, :] * page_tokens < context_lens[:, None]


def clamp_page_ids(block_table, num_pages):
    """(ids safe to index with, whether each id names a page of the pool)."""
    valid = (block_table >= 0) & (block_table < num_pages)
    return torch.where(valid, block_table, 0).long(), valid


def gather_pages(kv, layer, page_ids):
    """K and V of the pages page_ids [batch, pages] as [batch, kv_heads, pages*page_tokens,
    dim] in fp32, pages in block-table order."""
    batch, pages = page_ids.shape
    _, _, _, num_kv_heads, page_tokens, head_dim = kv.shape
    tiles = kv[page_ids, layer].float()  # [batch, pages, K|V, kv_heads, page_tokens, dim]
    tiles = tiles.permute(2, 0, 3, 1, 4, 5).reshape(2, batch, num_kv_heads, -1, head_dim)
    return tiles[0], tiles[1]


def gather_pages_by_head(kv, layer, page_ids):
    """K and V of the pages page_ids [batch, pages] as two [batch, kv_heads,
    pages*page_tokens, dim] views of ONE gather in kv's dtype: indexing page, K|V and head
    together puts the batch, K|V and head axes first and leaves each page's contiguous
    [page_tokens, dim] tile last, so no permute copy follows."""
    batch, pages = page_ids.shape
    _, _, _, num_kv_heads, page_tokens, head_dim = kv.shape
    key_or_value = torch.arange(2, device=kv.device)[None, :, None, None]
    heads = torch.arange(num_kv_heads, device=kv.device)[None, None, :, None]
    tiles = kv[page_ids[:, None, None, :], layer, key_or_value, heads]
    tiles = tiles.view(batch, 2, num_kv_heads, pages * page_tokens, head_dim)
    return tiles[:, 0], tiles[:, 1]


def _token_mask(context_lens, id_valid, page_tokens):
    """bool [batch, tokens]: inside the context and on a page that exists."""
    tokens = id_valid.shape[1] * page_tokens
    position = torch.arange(tokens, device=context_lens.device)
    on_valid_page = id_valid.repeat_interleave(page_tokens, dim=1)
    return (position[None, :] < context_lens[:, None]) & on_valid_page


def _attend(queries, keys, values, token_valid, scale):
    """Softmax attention in fp32 with GQA. queries [b, q_heads, m, d]; keys, values
    [b, kv_heads, n, d]; token_valid broadcastable to [b, m, n]. A row with no valid
    token gets zeros (not NaN)."""
    batch, num_q_heads, rows, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads
    grouped = queries.reshape(batch, num_kv_heads, group * rows, head_dim)
    scores = torch.einsum("bhmd,bhnd->bhmn", grouped, keys) * scale
    scores = scores.reshape(batch, num_kv_heads, group, rows, -1)
    scores = scores.masked_fill(~token_valid[:, None, None], _NEG_INF)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / total.clamp_min(torch.finfo(torch.float32).tiny)
    weights = weights.reshape(batch, num_kv_heads, group * rows, -1)
    out = torch.einsum("bhmn,bhnd->bhmd", weights, values)
    return out.reshape(batch, num_q_heads, rows, head_dim)
