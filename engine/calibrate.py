"""Measure the engine on this machine for the simulator's compute model (sim/compute.py).

Theory of operation. `kvproof sim calibrate` times the engine's own workers
(engine/workers.py) doing what the simulator models, each on a grid the caller chooses:

- prefill: one prompt of `prompt_tokens` alone on a `PrefillWorker` with chunks of
  `chunk_tokens`, every chunk step to the last (the first token sampled, the source pages
  sealed), as the runtime's prefill step runs it;
- decode: one `DecodeWorker.step()` over `batch_size` sequences of `context_tokens` tokens
  each (every page tag checked, as in serving), and the greedy sampling of each row that
  the runtime's loop does after it;
- page writes: `InProcessTransport` post, arrival and landing (pack and unpack of the page's
  bytes) of one page, per page over a run of pages.

The grid is measured `repeats` times over, one pass after another, each pass visiting every
cell once (the first pass runs each cell once more before timing it: first-use allocations
and oneDNN's kernel choice), and each cell keeps the median of its passes. On a machine
shared with other work a burst of load then lands on one pass of many cells, which the
median drops, rather than on every repeat of one cell. The pools hold
garbage K/V (free pages are never zeroed), which costs the same to compute over. Every
measurement is bounded: the whole run by `seconds_max` (checked before every cell), the
pools by `pool_bytes_max`.

This module returns plain data in the compute file's layout; api/ validates it into
sim.compute.CalibratedTables and writes it (engine/ never imports sim/).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

# torch and the engine's modules are imported where they are used: the CLI builds its
# parser (and `Grid`'s defaults) without loading torch.

POOL_BYTES_MAX = 2 << 30  # one calibration pool, at most: a grid that needs more is refused
TRANSPORT_PAGES = 32      # pages per page-write measurement
IN_PROCESS = "in-process"


class CalibrationError(RuntimeError):
    """A grid that cannot be measured here (too large, too slow): one line for the user."""


@dataclass(frozen=True)
class Grid:
    prompt_tokens: tuple[int, ...] = (16, 64, 256, 1024)
    chunk_tokens: tuple[int, ...] = (256, 512)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    context_tokens: tuple[int, ...] = (32, 128, 512)
    page_tokens: int = 16
    repeats: int = 3
    seconds_max: float = 600.0
    pool_bytes_max: int = POOL_BYTES_MAX

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "chunk_tokens", "batch_sizes", "context_tokens"):
            values = getattr(self, name)
            assert values and all(v >= 1 for v in values), f"{name}: positive values"
            object.__setattr__(self, name, tuple(sorted(set(values))))
        assert self.page_tokens >= 1 and self.repeats >= 1 and self.seconds_max > 0

    @property
    def cells(self) -> int:
        return (len(self.prompt_tokens) * len(self.chunk_tokens)
                + len(self.batch_sizes) * len(self.context_tokens) + 1)


def _seconds(run: Callable[[], None]) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def _pool(model, pages: int, page_tokens: int, limit_bytes: int, what: str):
    import torch

    from engine.pool import PoolConfig

    config = PoolConfig.for_model(model.config, pages, page_tokens, model.dtype, model.device)
    element = torch.empty((), dtype=model.dtype).element_size()
    size = (pages * config.num_layers * 2 * config.num_kv_heads * page_tokens
            * config.head_dim * element)
    if size > limit_bytes:
        raise CalibrationError(f"{what} needs a KV pool of {size / 2**20:,.0f} MiB, more than "
                               f"{limit_bytes / 2**20:,.0f} MiB: measure smaller grid points")
    return config


def _tokens(model, count: int, seed: int) -> tuple[int, ...]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return tuple(torch.randint(min(100, vocab - 1), vocab, (count,),
                               generator=generator).tolist())


def prefill_run(model, prompt_tokens: int, chunk_tokens: int, grid: Grid) -> Callable:
    """One prompt alone, chunk by chunk to its first token (module header): set up, and
    the run to time."""
    from engine.generate import Request
    from engine.sampling import SamplingParams
    from engine.workers import PrefillWorker

    pages = -(-prompt_tokens // grid.page_tokens)
    config = _pool(model, pages, grid.page_tokens, grid.pool_bytes_max,
                   f"a {prompt_tokens}-token prompt")
    worker = PrefillWorker(model, config, chunk_tokens, name="calibrate")
    request = Request(0, _tokens(model, prompt_tokens, prompt_tokens),
                      SamplingParams(max_tokens=1))

    def run() -> None:
        worker.start(request, tuple(range(pages)))
        for _ in range(-(-prompt_tokens // chunk_tokens)):
            completed, faults = worker.step()
            assert not faults, f"calibration prefill failed: {faults[0].detail}"
        assert completed and not worker.computing, "the prompt did not complete"

    return run


def decode_run(model, batch: int, context_tokens: int, grid: Grid) -> Callable:
    """One decode step of `batch` sequences of `context_tokens` tokens each, and the
    sampling of each row (module header): set up, and the run to time."""
    from engine.generate import Request
    from engine.sampling import SamplingParams, sample
    from engine.workers import DecodeWorker, page_tag

    per_sequence = -(-(context_tokens + 1) // grid.page_tokens)
    config = _pool(model, batch * per_sequence, grid.page_tokens, grid.pool_bytes_max,
                   f"a batch of {batch} x {context_tokens} tokens")
    worker = DecodeWorker(model, config, max_batch=batch, name="calibrate")
    pages_all = list(range(batch * per_sequence))
    worker.pool.set_tags(pages_all, [page_tag(1)] * len(pages_all))
    sampling = SamplingParams(max_tokens=1 << 20)
    for k in range(batch):
        pages = pages_all[k * per_sequence:(k + 1) * per_sequence]
        request = Request(k, _tokens(model, max(1, context_tokens - 1), k), sampling)
        sequence = worker.start(request, tuple((p, 1) for p in pages), None)
        sequence.output_ids.append(request.prompt_ids[-1])  # context_tokens in all

    def run() -> None:
        results = worker.step()
        assert all(ok for _, ok, _ in results), "calibration decode failed its tag check"
        for sequence, _, logits in results:
            sample(logits[None], [sequence.request.sampling], [sequence.generator])

    return run


def page_write_run(model, grid: Grid, page_bytes: list) -> Callable:
    """InProcessTransport's post -> ready -> land of TRANSPORT_PAGES pages: set up, and the
    run to time (it leaves the bytes of one page in `page_bytes`)."""
    from engine.pool import KVPool
    from engine.transport import InProcessTransport, PageWrite

    config = _pool(model, TRANSPORT_PAGES, grid.page_tokens, grid.pool_bytes_max,
                   "the page-write measurement")
    source, target = KVPool(config), KVPool(config)
    transport = InProcessTransport([source], [target])
    writes = [PageWrite(0, page, page, 1, 0) for page in range(TRANSPORT_PAGES)]

    def run() -> None:
        for write in writes:
            transport.post(write)
        page_bytes[:] = [sum(transport.land(write) for write in transport.ready())
                         // TRANSPORT_PAGES]

    return run


def machine(model, model_name: str) -> dict:
    import torch

    try:
        load = os.getloadavg()[0]
    except OSError:
        load = -1.0
    return {"model": model_name, "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count() or 0,
            "machine": platform.node(), "page_tokens": 0,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_start": round(load, 2)}


def calibrate(model, grid: Grid, model_name: str = "model",
              progress: Callable[[str], None] | None = None) -> dict:
    """Every cell of the grid, in the compute file's layout (sim/compute.py); progress gets
    one line per measurement. CalibrationError when the grid outgrows seconds_max."""
    import torch

    cells = [(("prefill", c, p), f"prefill {p:>6} tokens, chunks of {c}",
              lambda p=p, c=c: prefill_run(model, p, c, grid))
             for c in grid.chunk_tokens for p in grid.prompt_tokens]
    cells += [(("decode", b, n), f"decode step, batch {b:>3} x {n:>6} tokens",
               lambda b=b, n=n: decode_run(model, b, n, grid))
              for b in grid.batch_sizes for n in grid.context_tokens]
    page_bytes = [0]
    cells.append((("transport",), f"page write ({IN_PROCESS}, {grid.page_tokens} tokens, "
                  f"{TRANSPORT_PAGES} pages)", lambda: page_write_run(model, grid, page_bytes)))
    times: dict[tuple, list[float]] = {key: [] for key, _, _ in cells}
    total, started = len(cells) * grid.repeats, time.perf_counter()
    measured = machine(model, model_name)
    with torch.inference_mode():
        for repeat in range(grid.repeats):
            for index, (key, what, make) in enumerate(cells):
                done = repeat * len(cells) + index
                elapsed = time.perf_counter() - started
                if elapsed > grid.seconds_max:
                    raise CalibrationError(
                        f"the grid took longer than {grid.seconds_max:g} s ({done} of {total} "
                        f"measurements, stopped before {what}); measure fewer or smaller grid "
                        "points, fewer repeats, or raise the time bound")
                run = make()
                if repeat == 0:
                    run()  # warm-up: the shape's first-use costs
                times[key].append(_seconds(run))
                if progress is not None:
                    count = done + 1
                    bar = "#" * (20 * count // total)
                    progress(f"[{bar:<20}] {count:>4}/{total}  pass {repeat + 1}/{grid.repeats}"
                             f"  {what}: {times[key][-1] * 1e3:9.3f} ms "
                             f"({time.perf_counter() - started:5.1f} s)")
    median = {key: statistics.median(values) for key, values in times.items()}
    measured["page_tokens"] = grid.page_tokens
    measured["repeats"] = grid.repeats
    try:
        measured["load_average_end"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    measured["seconds_taken"] = round(time.perf_counter() - started, 1)
    return {"format": "kvproof-compute/1", "first_token": "prefill", "measured": measured,
            "prefill": {"chunk_tokens": list(grid.chunk_tokens),
                        "prompt_tokens": list(grid.prompt_tokens),
                        "seconds": [[median["prefill", c, p] for p in grid.prompt_tokens]
                                    for c in grid.chunk_tokens]},
            "decode": {"batch_size": list(grid.batch_sizes),
                       "context_tokens": list(grid.context_tokens),
                       "step_seconds": [[median["decode", b, n] for n in grid.context_tokens]
                                        for b in grid.batch_sizes]},
            "transport": {IN_PROCESS: {"page_tokens": grid.page_tokens,
                                       "page_bytes": page_bytes[0],
                                       "write_seconds": median["transport",]
                                       / TRANSPORT_PAGES}}}
