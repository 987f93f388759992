"""What the tests of the split state share (test_commands_parts, test_part_logs)."""

from __future__ import annotations

from spec.check.zoo import BASES
from spec.model import LOSS_KINDS, Model

# Two requests over 2 x 2 workers, both kinds of crash, every kind of loss: the random
# sequences' model (too large to exhaust in a test).
TWO_REQUESTS_LOSSY_2X2 = Model(name="workers-2x2-two", **{
    **BASES["workers-2x2"], "requests": 2, "losses": frozenset(LOSS_KINDS)})
