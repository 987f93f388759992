"""One codec for protocol events: the same record in every log kvproof writes.

A record is a flat JSON object: "a" is the action's name (the TLA+ action's, STYLE 3), and
the event's fields follow under their own names (request, prompt_pages, pages, page,
checksums_ok, tags_ok). The simulator's log, the fuzzer's saved failures and the engine's
log all write events with `encode` and read them with `decode`, so a record written by any
shell replays through the core in any other. A shell adds its own keys beside these (the
simulator's time "t" and placement, a crashed worker's index); `decode` ignores them.

A record that names no action, an unknown action, or lacks or mistypes a field is a
CodecError naming what is wrong: logs are user input, and a bad one is reported, never
half-read.
"""

from __future__ import annotations

from dataclasses import MISSING, fields

from spec import core

ACTION_KEY = "a"
_TYPES = {"request": int, "prompt_pages": int, "page": int, "pages": tuple,
          "checksums_ok": bool, "tags_ok": bool, "prefill_worker": int, "decode_worker": int,
          "worker": int, "tokens": tuple, "salt": int}


class CodecError(ValueError):
    """A record that is not an event of the protocol (user input, reported clearly)."""


def encode(event: core.Event) -> dict:
    """The event as a record: its action's name and its fields."""
    record: dict = {ACTION_KEY: event.action}
    for f in fields(event):
        value = getattr(event, f.name)
        if f.default is not MISSING and value == f.default:
            continue  # worker 0, left out: one pair's logs read as they did before workers
        record[f.name] = list(value) if isinstance(value, tuple) else value
    return record


def decode(record: dict) -> core.Event:
    """The event a record stands for; raises CodecError naming what is wrong."""
    if not isinstance(record, dict):
        raise CodecError(f"not an event record: {record!r}")
    cls = core.EVENT_TYPES.get(record.get(ACTION_KEY))
    if cls is None:
        raise CodecError(f"unknown action {record.get(ACTION_KEY)!r} in {record!r}")
    args = {}
    for f in fields(cls):
        if f.name not in record:
            if f.default is not MISSING:
                continue  # a worker field: a log of one worker pair may leave it out
            raise CodecError(f"{cls.__name__} record lacks the field {f.name!r}: {record!r}")
        args[f.name] = _field(cls, f.name, record[f.name])
    return cls(**args)


def _field(cls: type, name: str, value):
    want = _TYPES.get(name)
    if want is tuple:
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise CodecError(f"{cls.__name__}.{name} must be a list of integers (page "
                             f"numbers, tokens), got {value!r}")
        return tuple(value)
    if want is bool:
        if type(value) is not bool:
            raise CodecError(f"{cls.__name__}.{name} must be true or false, got {value!r}")
        return value
    if not _is_int(value):
        raise CodecError(f"{cls.__name__}.{name} must be an integer, got {value!r}")
    return value


def _is_int(value) -> bool:
    return type(value) is int
