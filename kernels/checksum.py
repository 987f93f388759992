"""Page checksum, torch reference: a Fletcher-style digest over 16-bit units, mod 2**31-1.

Definition (the Triton kernel in checksum_triton.py and the C one in layer_native.c
compute the same bits). Read a page's
bytes (all layers, K and V) as N little-endian 16-bit units h_0 .. h_{N-1}, each in
[0, 65536). With p = 2**31 - 1 (prime):

    A = sum(h_j)            mod p
    B = sum((N - j) * h_j)  mod p        (weights N .. 1: every position its own weight)
    digest = (B << 32) | A               (a non-negative int64)

Why 16-bit units: every unit is its own residue mod p (65536 < p), which is what makes the
guarantees below exact; a 32-bit word is not (2**32 > p, so w and w + p would collide).
Why mod a prime: the 2x2 system in the proof below is invertible for any two positions.

What it detects, always (N < p, so the weights are distinct and non-zero mod p):
- any change confined to at most two 16-bit units: a change d != 0 at one unit moves A by
  d (|d| < p); changes d1, d2 at units i, j leave both sums unchanged only if d1 + d2 = 0
  and (j - i) * d1 = 0 mod p, impossible for 0 < |j - i| < p. So: any single fp16/bf16
  element or fp32 word changed, any swap of two different fp16/bf16 elements, any error
  inside one aligned 4-byte word;
- a swap of two fp32 words a, b at word distance k moves B by 2k * ((a_lo + a_hi) -
  (b_lo + b_hi)): detected unless the two words' 16-bit halves have the same sum.
What it can miss: a pattern over three or more units whose first two moments cancel
(e.g. +1, -2, +1 on three consecutive units). For corruption that looks random, (A, B) is
close to uniform, so a miss has probability about 1/p**2 = 2**-62. It is not a MAC: anyone
can forge a page with a chosen digest; it guards against faults, not adversaries.
"""

from __future__ import annotations

import torch

MODULUS = (1 << 31) - 1
_ROW_UNITS = 4096  # the reference lays a page out as rows of this many units


def page_units(kv):
    """The pool as int16 [num_pages, units_per_page], bytes unchanged (a view)."""
    assert kv.is_contiguous(), "the pool must be contiguous (pages are byte spans)"
    rows = kv.view(kv.shape[0], -1)
    assert rows.shape[1] * rows.element_size() % 2 == 0
    units = rows.view(torch.int16)
    assert units.shape[1] < MODULUS, "a page of 2**31 units or more breaks the guarantees"
    return units


def page_checksum(kv, pages):
    """int64 [len(pages)]: the digest of each listed page.

    With the page as rows of R = _ROW_UNITS units, unit j = r*R + c, row sums S_r and
    column sums T_c: sum_j j*h_j = R * sum_r r*S_r + sum_c c*T_c, so B = N*A - that,
    mod p: two reductions over the data instead of a weight tensor the size of the page.
    Bounds: S_r < 2**28 and T_c < 2**31 (int32 sums, fast), r*S_r < 2**43, c*T_c < 2**43."""
    units = page_units(kv)[pages.long()]
    count, unit_count = units.shape
    rows = max(1, -(-unit_count // _ROW_UNITS))
    assert rows < 2**15, "column sums are int32: pages up to 2**27 units (256 MiB)"
    table = units.view(torch.uint16).to(torch.int32)  # [0, 65536), one pass
    if rows * _ROW_UNITS != unit_count:
        table = torch.nn.functional.pad(table, (0, rows * _ROW_UNITS - unit_count))
    table = table.view(count, rows, _ROW_UNITS)
    row_sums = table.sum(dim=2, dtype=torch.int32).long()  # < 2**28: [pages, rows]
    column_sums = table.sum(dim=1, dtype=torch.int32).long()  # < 2**31: [pages, R]
    row_index = torch.arange(rows, dtype=torch.int64, device=units.device)
    column_index = torch.arange(_ROW_UNITS, dtype=torch.int64, device=units.device)
    sum_a = row_sums.sum(dim=1) % MODULUS
    by_row = ((row_sums * row_index) % MODULUS).sum(dim=1) % MODULUS
    by_column = ((column_sums * column_index) % MODULUS).sum(dim=1) % MODULUS
    position_sum = (_ROW_UNITS * by_row + by_column) % MODULUS  # sum j*h_j mod p
    sum_b = ((unit_count % MODULUS) * sum_a - position_sum) % MODULUS  # torch %: floor
    return pack_digest(sum_a, sum_b)


def pack_digest(sum_a, sum_b):
    """(B << 32) | A, with both sums already reduced mod p."""
    return (sum_b << 32) | sum_a
