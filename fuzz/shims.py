"""The two places where kvproof reaches into Hypothesis's internals, and why.

Hypothesis has no setting for either. Both are context managers that restore what they
change, and both fall back to doing nothing if a Hypothesis release renames what they touch
(the fuzzer then still works; it only loses the guarantee named below).
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def shrink_seconds_max(seconds: float):
    """Bound shrinking in time. The engine reads the module constant MAX_SHRINKING_SECONDS
    (300 s) when shrinking starts; a CI budget needs far less."""
    try:
        from hypothesis.internal.conjecture import engine
        before = engine.MAX_SHRINKING_SECONDS
    except (ImportError, AttributeError):
        before = None
    if before is None or not seconds:
        yield
        return
    engine.MAX_SHRINKING_SECONDS = seconds
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = before


@contextmanager
def same_draws_in_every_process():
    """Hypothesis mixes integer literals of every local module the process has imported
    into its draws (providers._get_local_constants), so one seed generates different
    examples in the command line, under pytest, or after one more import: a printed seed
    would not replay. A campaign runs with that pool empty."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
        before = providers._get_local_constants
        cache = providers.CONSTANTS_CACHE.cache
    except (ImportError, AttributeError):
        yield
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty
    cache.clear()  # it may hold draws computed from the pool
    try:
        yield
    finally:
        providers._get_local_constants = before
        cache.clear()
