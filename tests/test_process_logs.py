"""A dead (or paused) worker's log as its supervisor closes it (engine/processes.py
`cut_dead_log`, `close_dead_log`): a process that was only paused when it was fenced (a
SIGSTOP, a VM stall longer than the fence's lease) and wakes up still holds its log file
open; a step it writes then must not reach the log the supervisor closed."""

from __future__ import annotations

import json

import pytest

from engine.processes import PartLog, close_dead_log, cut_dead_log
from spec import codec, core
from spec.model import Model


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


@pytest.mark.parametrize("close", [cut_dead_log, close_dead_log], ids=["cut", "closed"])
def test_a_step_written_after_the_supervisor_cut_the_log_never_reaches_it(tmp_path, close):
    path = tmp_path / "decode-0.ndjson"
    zombie = PartLog(path, "decode 0", Model(name="default"))
    zombie.step(codec.encode(core.Release(0)))
    zombie.file.write('{"a": "Fin')  # a torn line: killed (or stopped) mid-write
    zombie.file.flush()
    steps, clock = close(path, "decode 0")
    assert (steps, clock) == (1, 1)
    zombie.step(codec.encode(core.Release(1)))  # it wakes and writes one more step
    records = _records(path)
    assert [x.get("request") for x in records if x["a"] == "Release"] == [0]
    assert [x["a"] for x in records][-1] == ("LogEnd" if close is close_dead_log else "Release")
    # A new life goes on with the cut log, numbered after it.
    if close is cut_dead_log:
        life = PartLog(path, "decode 0", Model(name="default"), resume=(steps, clock))
        life.step(codec.encode(core.Release(2)))
        assert [(x["request"], x["k"]) for x in _records(path)] == [(0, 1), (2, 2)]
