"""The simulator's compute model: how long a prefill and a decode step take.

Theory of operation. A simulated worker never computes; it asks this module how long the
computation would take and advances simulated time by that much (sim/workers.py). Two
models answer the same three questions — `prefill_s(prompt_tokens)`, `decode_step_s(batch,
context_tokens)` and `page_write_s` — and the scenario's `[compute]` table picks one:

- `LinearCompute`, the default: a prompt takes prompt/`prefill_tokens_per_s` seconds, a
  decode step `decode_step_base_s` + `decode_step_per_request_s` x batch +
  `decode_step_per_context_token_s` x (sum of the batch's contexts); a page write is the
  link's bandwidth and the model's bytes per token (sim/scenario.py `Link`).
- `CalibratedCompute`, when the scenario names a compute model file (`[compute] model =
  "compute.toml"`, written by `kvproof sim calibrate` from measurements of the engine on a
  machine): tables measured on a grid, read by piecewise-linear interpolation.

The interpolation rule, one for every table (`interpolate`): inside the measured grid,
linear between the two neighbouring grid points on each axis (bilinear over two axes);
below the smallest grid point, the value at it (a shorter prompt or smaller batch is not
assumed cheaper than the cheapest one measured: per-step overhead dominates there); above
the largest, the last segment's line extended, with its slope taken as at least zero (so
measurement noise never makes a longer prompt or a bigger batch cheaper). The prefill's
chunk axis never extrapolates: a chunk size outside the grid reads the nearest measured one.

Decode steps are tabulated by batch size and *per-sequence* context (every sequence of a
measured batch had the same context); the simulator's batch knows the sum of its contexts,
so the table is read at the mean context, sum / batch.

The engine samples a request's first token at the end of its prefill and streams it when
decoding starts; the default model has decode's first step emit it. A calibrated model
carries which one it measured (`first_token`: "prefill" or "decode-step").

`serial_workers` (a scenario field, off by default) models the in-process engine
(engine/runtime.py), where every prefill and decode worker takes turns on one thread: a
computation starts only when the one before it, on any worker, has ended, and a message
between workers is taken only once the computations under way have ended (the loop
delivers between steps: sim/link.py). Off, each worker computes in parallel with the
others (one accelerator each) and messages take the link's latency alone.
"""

from __future__ import annotations

import math
import tomllib
from bisect import bisect_right
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

COMPUTE_FORMAT = "kvproof-compute/1"
GRID_POINTS_MAX = 64  # per axis: a calibration grid is small; more is a mistake


class ComputeFileError(ValueError):
    """A compute model file that cannot be used (the user's input, reported clearly)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _increasing(name: str, values: tuple, at_least: int) -> None:
    if len(values) < at_least:
        raise ValueError(f"{name} needs at least {at_least} grid point(s), got {len(values)}")
    if len(values) > GRID_POINTS_MAX:
        raise ValueError(f"{name} has {len(values)} grid points, more than {GRID_POINTS_MAX}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {list(values)}")


def _table(name: str, rows: tuple, shape: tuple[int, int]) -> None:
    if len(rows) != shape[0] or any(len(row) != shape[1] for row in rows):
        raise ValueError(f"{name} must be {shape[0]} rows of {shape[1]} (one per grid point), "
                         f"got {[len(row) for row in rows]}")
    for row in rows:
        for value in row:
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} holds {value!r}: seconds must be finite and >= 0")


class PrefillTable(_Strict):
    """Seconds to prefill a whole prompt alone on one worker: seconds[c][p] for
    chunk_tokens[c] and prompt_tokens[p]."""

    chunk_tokens: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    @model_validator(mode="after")
    def _shape(self) -> "PrefillTable":
        _increasing("prefill.chunk_tokens", self.chunk_tokens, 1)
        _increasing("prefill.prompt_tokens", self.prompt_tokens, 2)
        if self.chunk_tokens[0] < 1 or self.prompt_tokens[0] < 1:
            raise ValueError("prefill grid points must be at least 1 token")
        _table("prefill.seconds", self.seconds, (len(self.chunk_tokens), len(self.prompt_tokens)))
        return self


class DecodeTable(_Strict):
    """Seconds of one decode step: step_seconds[b][c] for batch_size[b] sequences of
    context_tokens[c] tokens each."""

    batch_size: tuple[int, ...]
    context_tokens: tuple[int, ...]
    step_seconds: tuple[tuple[float, ...], ...]

    @model_validator(mode="after")
    def _shape(self) -> "DecodeTable":
        _increasing("decode.batch_size", self.batch_size, 2)
        _increasing("decode.context_tokens", self.context_tokens, 2)
        if self.batch_size[0] < 1 or self.context_tokens[0] < 1:
            raise ValueError("decode grid points must be at least 1")
        _table("decode.step_seconds", self.step_seconds,
               (len(self.batch_size), len(self.context_tokens)))
        return self


class TransportTiming(_Strict):
    """One transport's page write: `write_seconds` for a page of `page_tokens` tokens
    (`page_bytes` bytes) from post to landed, the copy included."""

    page_tokens: int = Field(ge=1)
    page_bytes: int = Field(ge=1)
    write_seconds: float = Field(ge=0, allow_inf_nan=False)


class CalibratedTables(_Strict):
    """A compute model file's content (what `kvproof sim calibrate` writes)."""

    format: Literal["kvproof-compute/1"]
    source: str = ""   # where it was read from (filled when a scenario loads it)
    measured: dict = {}  # the machine, model, dtype, threads, date, load: for the reader
    first_token: Literal["prefill", "decode-step"] = "prefill"
    prefill: PrefillTable
    decode: DecodeTable
    transport: dict[str, TransportTiming] = {}


def read_compute_file(path: str | Path) -> CalibratedTables:
    """A compute model file, validated; ComputeFileError naming the file otherwise."""
    path = Path(path)
    if path.is_dir():
        raise ComputeFileError(f"compute model {path}: is a folder, not a file")
    if not path.is_file():
        raise ComputeFileError(f"compute model {path}: no such file (write one with "
                               f"kvproof sim calibrate --out {path})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ComputeFileError(f"compute model {path}: not valid TOML: {error}") from None
    if data.get("format") != COMPUTE_FORMAT:
        raise ComputeFileError(f"compute model {path}: format is {data.get('format')!r}, not "
                               f"{COMPUTE_FORMAT!r} (is it a file kvproof sim calibrate wrote?)")
    data["source"] = str(path.resolve())
    try:
        return CalibratedTables.model_validate(data)
    except ValidationError as error:
        raise ComputeFileError(f"compute model {path}: {explain(error)}") from None


def explain(error: ValidationError) -> str:
    """pydantic's errors as a user reads them: the field's path, then the message without
    pydantic's own prefix ("Value error, "); a check on the whole model names no field
    (sim/scenario.py's errors too)."""
    parts = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        field = ".".join(str(x) for x in item["loc"])
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, int) or math.isfinite(value) else "nan"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    return f'"{text}"'


def compute_file_text(tables: CalibratedTables) -> str:
    """The TOML text of a compute model file (tomllib reads, nothing in the stdlib writes)."""
    lines = ["# A compute model for the simulator, measured by kvproof sim calibrate.",
             "# Name it in a scenario: [compute] model = \"<this file>\" (sim/README.md).",
             f"format = {_toml_value(tables.format)}",
             f"first_token = {_toml_value(tables.first_token)}", "", "[measured]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in tables.measured.items()]
    prefill, decode = tables.prefill, tables.decode
    lines += ["", "# seconds[c][p]: the whole prompt of prompt_tokens[p], chunks of "
              "chunk_tokens[c], alone", "[prefill]",
              f"chunk_tokens = {_toml_value(prefill.chunk_tokens)}",
              f"prompt_tokens = {_toml_value(prefill.prompt_tokens)}", "seconds = ["]
    lines += [f"  {_toml_value(row)}," for row in prefill.seconds]
    lines += ["]", "", "# step_seconds[b][c]: one step of batch_size[b] sequences of "
              "context_tokens[c] tokens each", "[decode]",
              f"batch_size = {_toml_value(decode.batch_size)}",
              f"context_tokens = {_toml_value(decode.context_tokens)}", "step_seconds = ["]
    lines += [f"  {_toml_value(row)}," for row in decode.step_seconds]
    lines.append("]")
    for name, timing in tables.transport.items():
        lines += ["", f'[transport."{name}"]']
        lines += [f"{key} = {_toml_value(value)}" for key, value in timing.model_dump().items()]
    return "\n".join(lines) + "\n"


def write_compute_file(path: str | Path, tables: CalibratedTables) -> None:
    text = compute_file_text(tables)
    Path(path).write_text(text, encoding="utf-8")


# -- interpolation -----------------------------------------------------------------------------

def interpolate(xs: tuple, ys, x: float, extend: bool = True) -> float:
    """ys at x on the grid xs (module header): linear inside, the first value below, the
    last segment extended above (slope at least 0), or the last value when not `extend`."""
    if x <= xs[0]:
        return ys[0]
    last = len(xs) - 1
    if x >= xs[last]:
        if not extend or last == 0:
            return ys[last]
        slope = max(0.0, (ys[last] - ys[last - 1]) / (xs[last] - xs[last - 1]))
        return ys[last] + slope * (x - xs[last])
    i = bisect_right(xs, x) - 1
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


def interpolate2(xs: tuple, ys: tuple, table: tuple, x: float, y: float,
                 extend_x: bool = True) -> float:
    """table[i][j] at (xs[i], ys[j]): `interpolate` along y in every row, then along x."""
    column = [interpolate(ys, row, y) for row in table]
    return interpolate(xs, column, x, extend_x)


# -- the models ------------------------------------------------------------------------------

class _Delays:
    """What a worker asks: how long from `now` until its computation has ended (its own
    duration, after the computations ahead of it when the workers share one loop)."""

    loop: "SerialLoop | None" = None

    def prefill_delay_s(self, now: float, prompt_tokens: int) -> float:
        duration = self.prefill_s(prompt_tokens)
        return duration if self.loop is None else self.loop.occupy(now, duration)

    def decode_delay_s(self, now: float, batch: int, context_tokens: int) -> float:
        duration = self.decode_step_s(batch, context_tokens)
        return duration if self.loop is None else self.loop.occupy(now, duration)


class LinearCompute(_Delays):
    """The scenario's own coefficients (module header)."""

    first_token_at_prefill = False

    def __init__(self, compute, link, page_tokens: int) -> None:
        self.tokens_per_s = compute.prefill_tokens_per_s
        self.base_s = compute.decode_step_base_s
        self.per_request_s = compute.decode_step_per_request_s
        self.per_context_s = compute.decode_step_per_context_token_s
        self.page_write_s = page_tokens * link.kv_bytes_per_token / link.bandwidth_bytes_per_s
        self.prefill_chunk_s = compute.prefill_chunk_tokens / self.tokens_per_s

    def prefill_s(self, prompt_tokens: int) -> float:
        return prompt_tokens / self.tokens_per_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.base_s + self.per_request_s * batch + self.per_context_s * context_tokens

    def decode_delay_s(self, now: float, batch: int, context_tokens: int) -> float:
        # _Delays' rule with the step inlined: once per simulated decode step (a hot path)
        duration = self.base_s + self.per_request_s * batch + self.per_context_s * context_tokens
        return duration if self.loop is None else self.loop.occupy(now, duration)


class CalibratedCompute(_Delays):
    """Tables measured by `kvproof sim calibrate` (module header for the rules)."""

    def __init__(self, tables: CalibratedTables, compute, link, page_tokens: int) -> None:
        self.tables = tables
        self.first_token_at_prefill = tables.first_token == "prefill"
        self.chunk = compute.prefill_chunk_tokens
        if compute.transport is None:
            self.page_write_s = (page_tokens * link.kv_bytes_per_token
                                 / link.bandwidth_bytes_per_s)
        else:  # measured per page of its own size: scaled to the scenario's pages
            timing = tables.transport[compute.transport]
            self.page_write_s = timing.write_seconds * page_tokens / timing.page_tokens
        self.prefill_chunk_s = max(self.prefill_s(self.chunk), 1e-9)  # the lease's chunk

    def prefill_s(self, prompt_tokens: int) -> float:
        p = self.tables.prefill
        return interpolate2(p.chunk_tokens, p.prompt_tokens, p.seconds, self.chunk,
                            prompt_tokens, extend_x=False)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        d = self.tables.decode
        return interpolate2(d.batch_size, d.context_tokens, d.step_seconds, batch,
                            context_tokens / batch)


class SerialLoop:
    """`serial_workers`: every computation on any worker waits for the one before it to end
    (the in-process engine's one thread). `occupy` returns how long from `now` until a
    computation of `duration_s` asked for now has ended."""

    __slots__ = ("free_at_s",)

    def __init__(self) -> None:
        self.free_at_s = 0.0

    def wait_s(self, now: float) -> float:
        """How long a message sent now waits to be taken: the engine's loop delivers
        messages between its workers' steps, so after the computations already under way."""
        return self.free_at_s - now if self.free_at_s > now else 0.0

    def occupy(self, now: float, duration_s: float) -> float:
        start = self.free_at_s if self.free_at_s > now else now
        self.free_at_s = start + duration_s
        return self.free_at_s - now


def compute_model(scenario):
    """The compute model a scenario names (module header)."""
    c, link, page_tokens = scenario.compute, scenario.link, scenario.cluster.page_tokens
    if c.tables is None:
        model = LinearCompute(c, link, page_tokens)
    else:
        model = CalibratedCompute(c.tables, c, link, page_tokens)
    model.loop = SerialLoop() if c.serial_workers else None
    return model
