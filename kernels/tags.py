"""Page ownership tags: one int64 per page, `(owner_request << 32) | generation`.

The block table says which (request, generation) it expects for every page; the attention
kernel compares that with the tag stored beside the page and refuses to attend over a page
whose tag differs (the page was reallocated, or a late write landed). A fresh pool holds
FRESH_TAG everywhere, which no allocation ever issues: owners are below 2**31, so a packed
tag is never negative.
"""

from __future__ import annotations

FRESH_TAG = -1
OWNER_LIMIT = 1 << 31  # exclusive; keeps every packed tag non-negative (FRESH_TAG is -1)
GENERATION_LIMIT = 1 << 32  # exclusive; the low 32 bits


def pack_tag(owner: int, generation: int) -> int:
    """The int64 tag of a page owned by request `owner` at `generation`."""
    assert 0 <= owner < OWNER_LIMIT, f"owner {owner} outside [0, 2**31)"
    assert 0 <= generation < GENERATION_LIMIT, f"generation {generation} outside [0, 2**32)"
    return (owner << 32) | generation


def unpack_tag(tag: int) -> tuple[int, int]:
    """(owner, generation) of a tag made by pack_tag; FRESH_TAG has no owner."""
    assert tag != FRESH_TAG, "FRESH_TAG belongs to no request"
    assert 0 <= tag < OWNER_LIMIT << 32, f"tag {tag} was not made by pack_tag"
    return tag >> 32, tag & (GENERATION_LIMIT - 1)
