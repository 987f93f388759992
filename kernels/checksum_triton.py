"""Page checksum in Triton: the digest of kernels/checksum.py, bit for bit.

Theory of operation. A program digests one chunk of one page: up to MAX_ITERS blocks of
BLOCK 16-bit units. Per unit it does a load, a mask to [0, 65536), and two int32 adds,
the Fletcher running-sum trick that turns position weights into additions:
    acc[k]  += h            (after n blocks: sum over blocks of h[b, k])
    acc2[k] += acc[k]       (after n blocks: sum over blocks of (n - b) * h[b, k])
No multiply per unit, no int64 per unit: the int32 lanes cannot overflow because
acc2 <= n(n+1)/2 * 65535 < 2**31 for n <= MAX_ITERS = 128. Once per program, in int64:
with E the end of the chunk's last block and N the page's units, the unit at
j = start + b*BLOCK + k has weight N - j = (N - E) + (n - b)*BLOCK - k, so
    A_chunk = sum(acc)                                          mod p
    B_chunk = (N - E) * A_chunk + BLOCK * sum(acc2) - sum(k * acc[k])   mod p
and the page's (A, B) is the sum of its chunks' mod p (a few tiny torch ops), packed as
(B << 32) | A. Every step is integer arithmetic, so the reference and the kernel agree
exactly (tests/test_kernels_triton_pages.py).

Launch: BLOCK = 4096 units (8 KiB) with num_warps = 8 is 16 units (32 bytes, two 16-byte
loads) per thread per block; chunks of up to 128 blocks (1 MiB) give a 2 MiB page two
programs, so even a handful of pages spreads over the SMs. Untuned until a GPU run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checksum import MODULUS, pack_digest, page_units

BLOCK_UNITS = 4096
MAX_ITERS = 128  # the int32 overflow bound above
NUM_WARPS = 8


@triton.jit
def _digest_chunks(units_ptr, pages_ptr, partial_ptr, page_units, chunk_blocks,
                   MODULUS: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.program_id(0)
    chunk = tl.program_id(1)
    page = tl.load(pages_ptr + index).to(tl.int64)
    page_ptr = units_ptr + page * page_units
    start = chunk * chunk_blocks * BLOCK
    blocks = tl.minimum(chunk_blocks, tl.cdiv(page_units - start, BLOCK))
    k = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    acc2 = tl.zeros([BLOCK], tl.int32)
    for block in tl.range(0, blocks):
        position = start + block * BLOCK + k
        unit = tl.load(page_ptr + position, mask=position < page_units, other=0)
        acc += unit.to(tl.int32) & 0xFFFF
        acc2 += acc
    end = (start + blocks * BLOCK).to(tl.int64)
    sum_a = tl.sum(acc.to(tl.int64), axis=0) % MODULUS
    shift = (page_units - end + MODULUS) % MODULUS  # N - E, made non-negative mod p
    sum_b = (shift * sum_a) % MODULUS
    sum_b += (BLOCK * tl.sum(acc2.to(tl.int64), axis=0)) % MODULUS
    sum_b += MODULUS - tl.sum(k.to(tl.int64) * acc.to(tl.int64), axis=0) % MODULUS
    out = partial_ptr + (index * tl.num_programs(1) + chunk) * 2
    tl.store(out, sum_a)
    tl.store(out + 1, sum_b % MODULUS)


def page_checksum(kv, pages):
    """int64 [len(pages)], equal to kernels.checksum.page_checksum(kv, pages)."""
    units = page_units(kv)
    unit_count = units.shape[1]
    chunk_blocks = min(MAX_ITERS, triton.cdiv(unit_count, BLOCK_UNITS))
    chunks = triton.cdiv(unit_count, chunk_blocks * BLOCK_UNITS)
    partial = torch.empty((pages.shape[0], chunks, 2), dtype=torch.int64, device=kv.device)
    if pages.shape[0]:
        _digest_chunks[(pages.shape[0], chunks)](
            units, pages.contiguous(), partial, unit_count, chunk_blocks,
            MODULUS=MODULUS, BLOCK=BLOCK_UNITS, num_warps=NUM_WARPS)
    sums = partial.sum(dim=1) % MODULUS  # chunks * 2**31: no overflow
    return pack_digest(sums[:, 0], sums[:, 1])
