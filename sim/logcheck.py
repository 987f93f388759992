"""Checks on a simulator log before it is replayed: a log the run did not finish writing
must not replay as a clean run.

sim/fold.py's replay trusts its input's framing: a log cut at a line boundary has no end
record and replays as a run that simply had fewer events ("violations none" while requests
never settled), and a line cut mid-way is reported by the JSON parser with the position
inside that line ("line 1 column 20") rather than the log's line; and a record whose time
is before the one above it would fold as if the clock had gone back. All are found here, by
reading the log once, line by line, before the fold does.
"""

from __future__ import annotations

import json
from pathlib import Path

from sim.fold import LOG_FORMAT, RUN_END, LogError


def check_log(path: str | Path) -> int:
    """The number of records in a complete log; LogError naming the line otherwise."""
    last, count, now = None, 0, None
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                last = _record(path, number, line)
                if number == 1 and last.get("format") != LOG_FORMAT:
                    raise LogError(f"{path}: not a kvproof simulator log (format "
                                   f"{last.get('format')!r})")
                if number > 1:
                    now = _time(path, number, last, now)
                count = number - 1
    except OSError as error:
        raise LogError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise LogError(f"{path}: not a text file (byte {error.start} of a line is not "
                       "UTF-8)") from None
    if last is None:
        raise LogError(f"{path} is empty")
    if last.get("a") != RUN_END:
        raise LogError(f"{path} has no end record after its {count:,} events: the run did "
                       "not finish writing it (cut or still running), so a replay would "
                       "report a partial run as complete")
    return count


def _time(path, number: int, record: dict, before: float | None) -> float:
    """A record's simulated time: a number, never below the record before it (one run's
    clock only moves forward; a log that goes back was spliced or edited)."""
    t = record.get("t")
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        raise LogError(f"{path} line {number:,}: the record has no time (\"t\") of its own")
    if before is not None and t < before:
        raise LogError(f"{path} line {number:,}: time goes backwards ({t:.9g} s after "
                       f"{before:.9g} s on the line before): the log is not one run's (spliced "
                       "or edited)")
    return t


def _record(path, number: int, line: str) -> dict:
    if not line.endswith("\n"):
        raise LogError(f"{path} line {number:,}: the line is cut off (no newline at the end "
                       "of the file): the run did not finish writing the log")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise LogError(f"{path} line {number:,}: not a JSON record ({error.msg} at column "
                       f"{error.colno})") from None
    if not isinstance(record, dict):
        raise LogError(f"{path} line {number:,}: not a JSON object")
    return record
