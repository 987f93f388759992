"""The paged KV pool of one worker: page tensor, ownership tags, page checksums.

Layout (kernels/README.md, "Layout"): kv[page, layer, K|V, kv_head, token, head_dim], page
major, so one page (every layer, K and V) is one contiguous span of bytes: a transfer
writes a page with one copy, a checksum reads one span, pack/unpack gathers rows. Every
page has an int64 ownership tag, (owner request << 32) | generation, on the same device:
the decode kernel compares it with the tag the block table expects on every read.

What the pool does not do: decide. Which page goes to whom, when a tag changes and when a
page comes back are the protocol core's decisions (spec/core.py), carried out by the
worker through `set_tags`; `FreeList` is a plain helper for single-process use. Pages are
never zeroed on free (that is what the tags are for), and a fresh pool holds FRESH_TAG,
which no allocation issues.

Checksums are computed where pages are written (`seal`: after prefill wrote a page, or
when decode filled one) and kept per page on the device, so a transfer can send them with
the pages and the receiver can `verify` what landed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

import kernels


@dataclass(frozen=True)
class PoolConfig:
    num_pages: int
    page_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_tokens", "num_layers", "num_kv_heads", "head_dim"):
            assert getattr(self, name) > 0, f"{name} must be positive"

    @property
    def page_bytes(self) -> int:
        elements = self.num_layers * 2 * self.num_kv_heads * self.page_tokens * self.head_dim
        return elements * torch.empty(0, dtype=self.dtype).element_size()

    @classmethod
    def for_model(cls, model_config, num_pages: int, page_tokens: int, dtype, device):
        return cls(num_pages=num_pages, page_tokens=page_tokens,
                   num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                   head_dim=model_config.head_dim, dtype=dtype, device=str(device))


class KVPool:
    def __init__(self, config: PoolConfig):
        self.config = config
        shape = (config.num_pages, config.num_layers, 2, config.num_kv_heads,
                 config.page_tokens, config.head_dim)
        # Zeroed once, at creation, and never again: freed pages keep their content. The
        # one zeroing matters on the CPU path, whose attention multiplies masked-out
        # tokens of a sequence's own partial last page by a weight of 0, and 0 * NaN is
        # NaN: uninitialized memory could hold NaN bit patterns, stale K/V never does.
        self.kv = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self.tags = torch.full((config.num_pages,), kernels.FRESH_TAG, dtype=torch.int64,
                               device=config.device)
        self.checksums = torch.zeros(config.num_pages, dtype=torch.int64, device=config.device)

    @property
    def page_tokens(self) -> int:
        return self.config.page_tokens

    def _index(self, pages) -> torch.Tensor:
        return torch.as_tensor(pages, dtype=torch.int64, device=self.kv.device)

    def set_tags(self, pages, tags) -> None:
        """Store the ownership tags of these pages (carrying out the core's decision)."""
        self.tags[self._index(pages)] = torch.as_tensor(tags, dtype=torch.int64,
                                                        device=self.kv.device)

    def seal(self, pages) -> None:
        """Compute and keep the checksums of pages just written."""
        index = self._index(pages)
        self.checksums[index] = kernels.page_checksum(self.kv, index)

    def verify(self, pages, expected_checksums) -> torch.Tensor:
        """bool per page: its bytes' checksum equals the one the writer sent."""
        index = self._index(pages)
        expected = torch.as_tensor(expected_checksums, dtype=torch.int64, device=self.kv.device)
        return kernels.page_checksum(self.kv, index) == expected

    def pack(self, pages) -> torch.Tensor:
        """The pages' bytes as one contiguous [pages, page_elements] buffer."""
        return kernels.pack_pages(self.kv, self._index(pages))

    def unpack(self, buffer: torch.Tensor, pages) -> None:
        kernels.unpack_pages(buffer, self.kv, self._index(pages))


class FreeList:
    """Free page ids, handed out in order (or shuffled, with a seed, so that tests see
    sequences scattered across the pool). A helper, not a policy: it asserts against
    double frees and foreign ids and nothing else."""

    def __init__(self, num_pages: int, shuffle_seed: int | None = None):
        self.num_pages = num_pages
        self._free = list(range(num_pages))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self._free)
        self._is_free = [True] * num_pages

    def __len__(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """`count` pages, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        taken, self._free = self._free[:count], self._free[count:]
        for page in taken:
            self._is_free[page] = False
        return taken

    def give_back(self, pages: list[int]) -> None:
        for page in pages:
            assert 0 <= page < self.num_pages, f"page {page} is not in this pool"
            assert not self._is_free[page], f"page {page} freed twice"
            self._is_free[page] = True
        self._free.extend(pages)
