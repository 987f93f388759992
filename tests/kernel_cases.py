"""Test cases for kernels/: small paged pools with shuffled pages, and plain oracles.

The oracles below are written the slow, obvious way (a Python loop over sequences and
pages, float64), independently of the vectorised references in kernels/, so that a test
comparing the two can fail."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import pack_tag

FOREIGN_OWNER = 99  # a request no case ever decodes


@dataclass
class DecodeCase:
    q: torch.Tensor
    kv: torch.Tensor
    layer: int
    block_table: torch.Tensor
    context_lens: torch.Tensor
    expected_tags: torch.Tensor
    tags: torch.Tensor
    scale: float

    def args(self):
        return (self.q, self.kv, self.layer, self.block_table, self.context_lens,
                self.expected_tags, self.tags, self.scale)


def make_decode_case(context_lens, *, q_heads=4, kv_heads=2, head_dim=64, page_tokens=4,
                     num_layers=2, layer=1, spare_pages=3, dtype=torch.float32, seed=0):
    """One sequence per entry of context_lens (owner b + 1, generation 7); its pages are
    drawn at random from a pool with spare_pages more pages than needed, which hold
    foreign data under a foreign tag; block-table rows are padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_tokens) for n in context_lens]
    max_pages = max(max(pages_per_seq), 1) + 1  # one -1 column at least
    num_pages = sum(pages_per_seq) + spare_pages
    kv = torch.randn(num_pages, num_layers, 2, kv_heads, page_tokens, head_dim, generator=gen)
    order = torch.randperm(num_pages, generator=gen).tolist()
    tags = torch.full((num_pages,), pack_tag(FOREIGN_OWNER, 3), dtype=torch.int64)
    block_table = torch.full((len(context_lens), max_pages), -1, dtype=torch.int32)
    expected = torch.full((len(context_lens), max_pages), -1, dtype=torch.int64)
    for b, count in enumerate(pages_per_seq):
        for i in range(count):
            page = order.pop()
            block_table[b, i] = page
            expected[b, i] = tags[page] = pack_tag(b + 1, 7)
    q = torch.randn(len(context_lens), q_heads, head_dim, generator=gen)
    return DecodeCase(q.to(dtype), kv.to(dtype), layer, block_table,
                      torch.tensor(context_lens, dtype=torch.int32), expected, tags,
                      head_dim ** -0.5)


def oracle_decode(case):
    """[batch, q_heads, dim] float64: per sequence, its pages concatenated in block-table
    order, softmax attention over the first context_lens[b] tokens; no tag check."""
    q_heads, kv_heads = case.q.shape[1], case.kv.shape[3]
    page_tokens = case.kv.shape[4]
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    for b, n in enumerate(case.context_lens.tolist()):
        if n == 0:
            continue  # no context: the output is defined as zeros
        pages = [int(p) for p in case.block_table[b, :-(-n // page_tokens)]]
        k = torch.cat([case.kv[p, case.layer, 0] for p in pages], dim=1)[:, :n].double()
        v = torch.cat([case.kv[p, case.layer, 1] for p in pages], dim=1)[:, :n].double()
        for h in range(q_heads):
            kvh = h // (q_heads // kv_heads)
            scores = (k[kvh] @ case.q[b, h].double()) * case.scale
            out[b, h] = torch.softmax(scores, dim=0) @ v[kvh]
    return out


def oracle_prefill(q, kv, layer, pages, start_pos, scale):
    """[new_tokens, q_heads, dim] float64: query t at position start_pos + t attends keys
    0 .. start_pos + t of the sequence's pages."""
    new_tokens, q_heads, _ = q.shape
    kv_heads = kv.shape[3]
    total = start_pos + new_tokens
    k = torch.cat([kv[p, layer, 0] for p in pages], dim=1)[:, :total].double()
    v = torch.cat([kv[p, layer, 1] for p in pages], dim=1)[:, :total].double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(new_tokens):
        for h in range(q_heads):
            kvh = h // (q_heads // kv_heads)
            seen = start_pos + t + 1
            scores = (k[kvh, :seen] @ q[t, h].double()) * scale
            out[t, h] = torch.softmax(scores, dim=0) @ v[kvh, :seen]
    return out


def oracle_digest(page_bytes: bytes) -> int:
    """The checksum of kernels/checksum.py in plain Python integers."""
    modulus = (1 << 31) - 1
    units = [int.from_bytes(page_bytes[i:i + 2], "little") for i in range(0, len(page_bytes), 2)]
    n = len(units)
    sum_a = sum(units) % modulus
    sum_b = sum((n - j) * h for j, h in enumerate(units)) % modulus
    return (sum_b << 32) | sum_a


def make_foreign(case, sequence, slot, seed=1):
    """Reallocate the page in (sequence, slot) to a foreign request: new data, new tag;
    the block table still expects the old tag. Returns the page id."""
    page = int(case.block_table[sequence, slot])
    gen = torch.Generator().manual_seed(seed)
    fresh = torch.randn(case.kv[page].shape, generator=gen) * 3.0
    case.kv[page] = fresh.to(case.kv.dtype)
    case.tags[page] = pack_tag(FOREIGN_OWNER, 8)
    return page



def interpreted_modules(*names):
    """kernels' Triton modules, in the interpreter (tests/conftest.py sets TRITON_INTERPRET
    before anything imports triton: triton's own library is decorated at import too)."""
    import importlib

    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tl.sum, InterpretedFunction), (
        "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")
    return [importlib.import_module(name) for name in names]
