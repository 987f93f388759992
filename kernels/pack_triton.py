"""Page pack/unpack in Triton: one kernel copies listed rows of one [rows, units] view to
listed rows of another; pack gathers (source rows listed), unpack scatters (destination
rows listed).

Theory of operation. A page is a contiguous row of the pool, so a copy is a plain
streaming loop; the bytes move as int32 words (every page size in the contract is a
multiple of 4 bytes), which Triton turns into 16-byte vector loads and stores when the
row stride is a multiple of 16 bytes, as it is for every realistic page. Grid: (listed
page, chunk of the page), chunks of up to CHUNK_WORDS, so a few large pages still spread
over the SMs. Row offsets are int64 (a pool is larger than 2**31 words). BLOCK = 2048
words with num_warps = 8 is 8 words (two 16-byte accesses) per thread per step.
Untuned until a GPU run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pack import page_rows

BLOCK_WORDS = 2048
CHUNK_WORDS = 1 << 16  # 256 KiB per program
NUM_WARPS = 8


@triton.jit
def _copy_rows(src_ptr, dst_ptr, rows_ptr, row_words, chunk_words,
               GATHER: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.program_id(0)
    chunk = tl.program_id(1)
    listed = tl.load(rows_ptr + index).to(tl.int64)
    if GATHER:
        src_row, dst_row = listed, index.to(tl.int64)
    else:
        src_row, dst_row = index.to(tl.int64), listed
    src = src_ptr + src_row * row_words
    dst = dst_ptr + dst_row * row_words
    start = chunk * chunk_words
    stop = tl.minimum(start + chunk_words, row_words)
    for offset in tl.range(start, stop, BLOCK):
        word = offset + tl.arange(0, BLOCK)
        tl.store(dst + word, tl.load(src + word, mask=word < stop), mask=word < stop)


def _words(rows):
    """rows [n, elems] as int32 words (a view)."""
    assert rows.shape[1] * rows.element_size() % 4 == 0, "page bytes must be a multiple of 4"
    return rows.view(torch.int32)


def _launch(src_rows, dst_rows, listed, gather):
    words = _words(src_rows).shape[1]
    chunks = triton.cdiv(words, CHUNK_WORDS)
    if listed.shape[0]:
        _copy_rows[(listed.shape[0], chunks)](
            _words(src_rows), _words(dst_rows), listed.contiguous(), words,
            min(words, CHUNK_WORDS), GATHER=gather, BLOCK=BLOCK_WORDS, num_warps=NUM_WARPS)


def pack_pages(kv, pages):
    """buffer [len(pages), page_elems] in kv.dtype, rows in the order of pages."""
    rows = page_rows(kv)
    buffer = torch.empty((pages.shape[0], rows.shape[1]), dtype=kv.dtype, device=kv.device)
    _launch(rows, buffer, pages, gather=True)
    return buffer


def unpack_pages(buffer, kv, pages):
    """kv's page pages[i] := buffer[i], in place; destination pages must be distinct
    (not checked here: that would cost a device sync)."""
    rows = page_rows(kv)
    assert buffer.dtype == kv.dtype and buffer.shape == (pages.shape[0], rows.shape[1])
    assert buffer.is_contiguous()
    _launch(buffer, rows, pages, gather=False)
