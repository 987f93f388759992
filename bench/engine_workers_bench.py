"""The protocol-driven engine (engine/runtime.py) next to the single-process Generator.

    python bench/engine_workers_bench.py                  # default model, batch 8, 32 tokens
    python bench/engine_workers_bench.py --batch 1 --batch 8 --new-tokens 64
    python bench/engine_workers_bench.py --workers 2x2 --workers 1x4   # more workers too

Same model, prompts, dtype and greedy decoding on both; the two alternate repeat by repeat
so a neighbour's load hits both alike (read the ratio, not the absolute figures). Prints,
per batch: wall-clock tokens/s (all output tokens over the whole run, prefill included),
the median per-step decode time of each, whether both produced the same tokens, and the
protocol engine's events per request and KV bytes moved. Each `--workers PxD` adds the
protocol engine with P prefill and D decode workers (one process, one loop: the batch is
split over the decode workers, so on a CPU this shows what the split costs, not a gain).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from engine.generate import Generator, GeneratorConfig, Request  # noqa: E402
from engine.load import load_model  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import GenerationRequest, TokenOut  # noqa: E402

PROMPT_TOKENS = 64
PAGE_TOKENS = 16


def prompts(batch: int, vocab: int) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(100, vocab, (PROMPT_TOKENS + 3 * i,),
                                generator=generator).tolist()) for i in range(batch)]


def run_generator(model, batch_prompts, params):
    generator = Generator(model, GeneratorConfig(num_pages=512, page_tokens=PAGE_TOKENS))
    started = time.perf_counter()
    done = generator.run([Request(i, p, params) for i, p in enumerate(batch_prompts)])
    return time.perf_counter() - started, [list(c.output_ids) for c in done]


def run_runtime(model, batch_prompts, params, workers=(1, 1)):
    runtime = Runtime(model, RuntimeConfig(prefill_pages=512, decode_pages=512,
                                           page_tokens=PAGE_TOKENS, context_tokens=4096,
                                           prefill_workers=workers[0],
                                           decode_workers=workers[1]))
    outputs: dict[int, list] = {}

    def on_event(event):
        if isinstance(event, TokenOut):
            outputs.setdefault(event.request_id, []).append(event.token_id)
    started = time.perf_counter()
    for p in batch_prompts:
        runtime.arrive(GenerationRequest(p, params), on_event)
    while not runtime.idle:
        runtime.step()
    elapsed = time.perf_counter() - started
    return elapsed, [outputs[r] for r in range(len(batch_prompts))], runtime


def workers_of(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PxD, e.g. 2x2, got {text!r}") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"each count must be at least 1, got {text!r}")
    return p, d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=workers_of, action="append", default=[],
                        metavar="PxD", help="also run P prefill and D decode workers")
    args = parser.parse_args()
    loaded = load_model(args.model)
    model = loaded.model
    print(f"model {loaded.path.name}, {model.dtype}, torch threads {torch.get_num_threads()}")
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    for batch in args.batch or [8]:
        batch_prompts = prompts(batch, model.config.vocab_size)
        tokens = batch * args.new_tokens
        times = {"generator": [], "protocol": [], **{w: [] for w in args.workers}}
        same = True
        for _ in range(args.repeats):
            elapsed, reference = run_generator(model, batch_prompts, params)
            times["generator"].append(elapsed)
            elapsed, outputs, runtime = run_runtime(model, batch_prompts, params)
            times["protocol"].append(elapsed)
            same &= outputs == reference
            for workers in args.workers:
                elapsed, outputs, _ = run_runtime(model, batch_prompts, params, workers)
                times[workers].append(elapsed)
                same &= outputs == reference
        g, p = (statistics.median(times[k]) for k in ("generator", "protocol"))
        print(f"batch {batch}, {args.new_tokens} new tokens, prompts {PROMPT_TOKENS}.."
              f"{PROMPT_TOKENS + 3 * (batch - 1)} tokens, median of {args.repeats}:")
        print(f"  Generator        {tokens / g:8.1f} tokens/s  ({g:.2f} s)")
        print(f"  protocol engine  {tokens / p:8.1f} tokens/s  ({p:.2f} s)  "
              f"ratio {g / p:.2f}")
        for workers in args.workers:
            w = statistics.median(times[workers])
            print(f"  {workers[0]}x{workers[1]} workers    {tokens / w:8.1f} tokens/s  "
                  f"({w:.2f} s)  ratio {g / w:.2f}")
        print(f"  same tokens: {same}; protocol events {len(runtime.log)} "
              f"({len(runtime.log) / batch:.0f} per request), "
              f"{runtime.transport.writes_landed} page writes, "
              f"{runtime.transport.bytes_landed / 2**20:.1f} MiB moved")


if __name__ == "__main__":
    main()
