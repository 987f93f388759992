"""Trace-driven workloads: requests read from a file instead of drawn from distributions.

A trace is what LLM-serving simulators (Vidur, the Splitwise simulator, DistServe) replay:
one request per row, with its arrival time and its prompt and output lengths in tokens.
Two layouts are read:

- CSV with a header. The Azure LLM inference trace's columns (TIMESTAMP, ContextTokens,
  GeneratedTokens; TIMESTAMP a date and time) are recognised as they are, and so are
  arrival_s, prompt_tokens, output_tokens (arrival_s in seconds from the start).
- JSON Lines, one object per line, with the same keys.

Arrival times become seconds from the first request; they must not go backwards. Every
error names the file and line. `sim/workloads/azure-format-sample.csv` is a small sample
in the Azure layout (synthetic values, the public column names).

A scenario with `arrival = "trace"` and a `trace_file` (sim/scenario.py) takes its
requests from here instead of the Poisson/bursty/closed generators (sim/run.py).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sim.scenario import ScenarioError

TRACE_REQUESTS_MAX = 10_000_000  # the scenario's own bound on requests
COLUMNS = {
    "arrival": ("arrival_s", "TIMESTAMP", "timestamp", "arrival_time"),
    "prompt": ("prompt_tokens", "ContextTokens", "input_tokens", "context_tokens"),
    "output": ("output_tokens", "GeneratedTokens", "generated_tokens"),
}


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceWorkload:
    path: str
    requests: tuple[TraceRequest, ...]

    def arrivals(self):
        """(delay in seconds since the previous arrival, request), in order."""
        previous = 0.0
        for request in self.requests:
            yield request.arrival_s - previous, request
            previous = request.arrival_s


def _pick(row: dict, what: str, where: str) -> str:
    for name in COLUMNS[what]:
        if name in row and row[name] not in (None, ""):
            return str(row[name])
    raise ScenarioError(f"{where}: no {what} column (one of {', '.join(COLUMNS[what])})")


def _seconds(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        # Azure writes seven fractional digits; datetime takes six.
        head, _, fraction = text.partition(".")
        return datetime.fromisoformat(f"{head}.{(fraction + '000000')[:6]}" if fraction
                                      else head).timestamp()
    except ValueError:
        raise ScenarioError(f"{where}: arrival {text!r} is neither seconds nor a date and "
                            "time") from None


def _tokens(text: str, what: str, where: str) -> int:
    try:
        value = int(float(text))
    except ValueError:
        raise ScenarioError(f"{where}: {what} tokens {text!r} is not a number") from None
    if value < 1:
        raise ScenarioError(f"{where}: {what} tokens must be at least 1, got {value}")
    return value


def _rows(path: Path):
    """(line number, row as a dict) of a CSV or JSON Lines file."""
    with path.open(encoding="utf-8", newline="") as f:
        if path.suffix in (".jsonl", ".ndjson"):
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        yield number, json.loads(line)
                    except json.JSONDecodeError as error:
                        raise ScenarioError(f"{path}:{number}: not JSON ({error.msg})") from None
        else:
            for number, row in enumerate(csv.DictReader(f), start=2):
                yield number, row


def load_workload(path: str | Path) -> TraceWorkload:
    path = Path(path)
    if not path.is_file():
        raise ScenarioError(f"{path}: no such file")
    requests: list[TraceRequest] = []
    start = previous = None
    try:
        for number, row in _rows(path):
            where = f"{path}:{number}"
            if not isinstance(row, dict):
                raise ScenarioError(f"{where}: expected an object")
            at = _seconds(_pick(row, "arrival", where), where)
            start = at if start is None else start
            if previous is not None and at < previous:
                raise ScenarioError(f"{where}: arrival goes back in time")
            previous = at
            requests.append(TraceRequest(at - start,
                                         _tokens(_pick(row, "prompt", where), "prompt", where),
                                         _tokens(_pick(row, "output", where), "output", where)))
            if len(requests) > TRACE_REQUESTS_MAX:
                raise ScenarioError(f"{path}: more than {TRACE_REQUESTS_MAX:,} requests")
    except UnicodeDecodeError as error:
        raise ScenarioError(f"{path}: not a text file (byte {error.start})") from None
    if not requests:
        raise ScenarioError(f"{path}: no requests")
    return TraceWorkload(str(path), tuple(requests))


# ---------------------------------------------------------------------------------------
# Prompts with shared prefixes (issue 27): the tokens and salt of each prompt.
#
# A prompt is one abstract token per page (spec/core.py, Prefix caching): a page's content
# identity is its salt and the tokens up to it, so two prompts share the KV of their first
# k pages exactly when they have the same salt and the same first k tokens. Shared parts
# use small tokens (the system prompt is token 1 on every page, document j is token j + 1),
# and every page of a prompt's own part (a question, a new turn) gets a fresh token from a
# counter, so no two requests share it by chance.

FRESH_TOKENS_FROM = 1 << 20  # below: shared parts' tokens; from here: a prompt's own pages


class PromptMaker:
    """Draws each request's tokens and salt for a scenario's prefix shape, from its own
    random stream (so the arrivals and lengths are the same with the cache on or off):

    - system-prompt: a fleet-wide system prompt of `shared_tokens`, then the request's own
      part; the tenant (salt) is drawn per request, so each tenant caches its own copy;
    - document: one of `documents` shared documents of `shared_tokens` each, then a
      question (the request's own part);
    - sessions: one of `sessions` conversations, each with its tenant; a turn's prompt is
      the session's previous prompt plus the new part (the previous answer and the next
      message), so every turn extends the last; a session whose next prompt would exceed
      the context starts over with the system prompt.
    """

    def __init__(self, prefix, page_tokens: int, context_pages: int, rng) -> None:
        self.prefix, self.rng = prefix, rng
        self.shared_pages = -(-prefix.shared_tokens // page_tokens)
        self.context_pages = context_pages
        self.fresh = FRESH_TOKENS_FROM
        self.history: dict[int, tuple] = {}  # session -> its last prompt's tokens

    def next(self, own_pages: int) -> tuple[tuple[int, ...], int]:
        """(tokens, salt) of the next request, whose own part is `own_pages` pages."""
        shape, rng = self.prefix.shape, self.rng
        if shape == "sessions":
            session = rng.randrange(self.prefix.sessions)
            salt = 1 + session % self.prefix.tenants
            before = self.history.get(session) or (1,) * self.shared_pages
            if len(before) + own_pages > self.context_pages:
                before = (1,) * self.shared_pages
            tokens = before + self._own(own_pages)
            self.history[session] = tokens
            return tokens, salt
        salt = 1 + rng.randrange(self.prefix.tenants)
        shared = 1 if shape == "system-prompt" else 2 + rng.randrange(self.prefix.documents)
        return (shared,) * self.shared_pages + self._own(own_pages), salt

    def _own(self, pages: int) -> tuple[int, ...]:
        start, self.fresh = self.fresh, self.fresh + pages
        return tuple(range(start, start + pages))
