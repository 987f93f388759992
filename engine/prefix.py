"""The engine's decode-side prefix cache (issue 28): what the shell hands the core.

Theory of operation. The core decides every step of the cache (spec/core.py and
spec/README.md, "Prefix caching"): Reserve looks the prompt's pages up by key, references
the pages decode holds cached and reserves fresh pages only for the rest; the prefill sends
only the tail, into the table entries after the hit; Accept seals the pages a good
transfer wrote; Release drops the request's references; Evict forgets a cached page
nobody reads. The shell supplies what only it knows, and nothing else:

- a prompt's abstract tokens, one per page of the core's request (`page_tokens_of`). A
  page the prompt fills gets a 61-bit BLAKE2b digest of that page's token ids; the core
  chains them (a page's key is the salt and the tokens of that page and of every page
  before it), so two requests of one salt share a page exactly when their token ids agree
  up to the end of that page, which is when its KV is the same (attention is causal, and
  a page's positions are fixed by its index). The partial last page and the output pages
  are written by decode with the request's own generated tokens: they get tokens from a
  per-runtime counter above every digest (`Nonces`), which no other request's page ever
  has, so they never match;
- a request's salt (engine/service.py `GenerationRequest.cache_salt`; the server derives
  it from the tenant and the request's cache_salt, api/serve/generation.py);
- which idle cached page to evict under pool pressure: the least recently released first,
  never one the reserving request is about to hit (spec/store.py `lru_victims`, the
  simulator's pick too); the core decides each
  Evict (a page with readers is refused). A page keyed by a nonce can never be hit, so the
  shell evicts it as soon as its request releases it (engine/delivery.py).

Hash collisions (2^-61 per pair of distinct pages) are out of scope, as in the spec.
"""

from __future__ import annotations

import hashlib
from array import array

from spec.model import SHELL_TOKENS, Model

DIGEST_MAX = 1 << 61   # a filled page's token is in 1..DIGEST_MAX
TOKENS_MAX = SHELL_TOKENS  # the core's Tokens for a shell: nonces above DIGEST_MAX
SALT_MAX = 1 << 62     # the core's Tenants: a request's salt is in 1..SALT_MAX
DEFAULT_SALT = 1       # one tenant, no cache_salt


class Nonces:
    """Tokens no prompt page ever hashes to, one per call, from DIGEST_MAX + 1 up."""

    def __init__(self) -> None:
        self.next = DIGEST_MAX + 1

    def take(self, count: int) -> tuple[int, ...]:
        start, self.next = self.next, self.next + count
        assert self.next <= TOKENS_MAX + 1, "nonces exhausted"
        return tuple(range(start, start + count))


def page_digest(token_ids) -> int:
    """A filled page's abstract token: its token ids' digest, in 1..DIGEST_MAX."""
    data = array("q", token_ids).tobytes()
    value = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return 1 + value % DIGEST_MAX


def page_tokens_of(prompt_ids, pages: int, page_tokens: int, nonces: Nonces) -> tuple:
    """The core's tokens of a request of `pages` pages: a digest per page the prompt
    fills, a nonce for every other (the partial last page, the output pages)."""
    full = min(len(prompt_ids) // page_tokens, pages)
    digests = tuple(page_digest(prompt_ids[i * page_tokens:(i + 1) * page_tokens])
                    for i in range(full))
    return digests + nonces.take(pages - full)


def salt_of(*parts: str) -> int:
    """A salt in 1..SALT_MAX from its parts (tenant, cache_salt), stable across processes."""
    data = "\x00".join(parts).encode()
    value = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return 1 + value % SALT_MAX


def with_caches(shell: Model, prefix_cache: bool, prefill_cache: bool) -> Model:
    """The engine's Model with decode's prefix cache and the prefill's, as switched (the
    runtime's config, or a log's header)."""
    return shell.with_prefix_cache(SALT_MAX, prefill_cache) if prefix_cache else shell

