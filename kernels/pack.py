"""Page pack/unpack, torch reference: gather pages into one contiguous transfer buffer,
and scatter such a buffer into destination pages.

A page is one contiguous span of the pool (kv.view(num_pages, -1) has a row per page), so
packing is a row gather and unpacking a row scatter. The buffer has kv's dtype and a row
per listed page, in list order; the bytes travel unchanged, so a page's checksum before
pack equals its checksum after unpack.
"""

from __future__ import annotations

import torch


def page_rows(kv):
    """The pool as [num_pages, page_elems], a view."""
    assert kv.is_contiguous(), "the pool must be contiguous (pages are byte spans)"
    return kv.view(kv.shape[0], -1)


def pack_pages(kv, pages):
    """buffer [len(pages), page_elems] in kv.dtype, rows in the order of pages."""
    return page_rows(kv).index_select(0, pages.long())


def unpack_pages(buffer, kv, pages):
    """kv's page pages[i] := buffer[i], in place. Destination pages must be distinct (two
    rows landing on one page would race); the reference checks it, the kernel trusts it."""
    rows = page_rows(kv)
    assert buffer.dtype == kv.dtype and buffer.shape == (pages.shape[0], rows.shape[1])
    assert torch.unique(pages).numel() == pages.numel(), "destination pages repeat"
    rows.index_copy_(0, pages.long(), buffer)
