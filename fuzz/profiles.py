"""Fuzz profiles: the sizes each example's model is drawn from, and the steps per example.

Kept apart from fuzz/machine.py so that the command line can list profiles without importing
Hypothesis. The default profile is the CI one; `long` is for scheduled runs (select it with
`--profile long` or KVPROOF_FUZZ_PROFILE=long).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """Ranges the per-example model is drawn from, and the number of rule steps."""

    name: str = "default"
    requests: tuple[int, int] = (6, 12)
    prefill_pages: tuple[int, int] = (16, 32)
    decode_pages: tuple[int, int] = (16, 64)
    steps_max: int = 60          # rule steps per example, before the drain
    drain_steps_max: int = 5000  # a drain longer than this means a cycle: a bug

    def __post_init__(self) -> None:
        for label in ("requests", "prefill_pages", "decode_pages"):
            low, high = getattr(self, label)
            assert 1 <= low <= high, f"profile {self.name}: bad {label} range {low}..{high}"
        assert self.steps_max >= 1 and self.drain_steps_max >= 1


PROFILES = {
    "default": Profile(),
    # Bigger prefill pools and longer examples: slower per example, for scheduled runs.
    "long": Profile("long", requests=(6, 12), prefill_pages=(16, 48), decode_pages=(16, 64),
                    steps_max=120),
}


def default_profile_name() -> str:
    """The profile a run gets when none is named: KVPROOF_FUZZ_PROFILE, else "default"."""
    return os.environ.get("KVPROOF_FUZZ_PROFILE", "default")
