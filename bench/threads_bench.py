"""Decode and prefill speed of `kvproof generate` by torch thread count, on the machine as
it is and with busy processes beside it.

    python bench/threads_bench.py                     # threads 1 and 2, as is, then 1 busy
    python bench/threads_bench.py --threads 1 2 4 --busy 0 2 --repeats 5

Loads the default model once, then for each number of busy neighbours (processes that
spin on one core each, started here and stopped after) runs the same chat prompt with
each thread count in turn, --repeats times, the thread counts alternating so that a
change in the machine's load hits all alike. Prints per run the one-minute load average
and the decode and prefill tokens/s, then the medians, and what api/engine_options.py's
default would choose now. The figures of the README's "Threads" paragraph come from it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Write a short story about a cat."


def spin() -> None:
    while True:
        pass


def one_run(generator_parts, threads: int, max_tokens: int) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) of the prompt with `threads` torch threads."""
    import torch

    from engine.generate import Generator, GeneratorConfig, Request, pages_needed
    from engine.sampling import SamplingParams

    loaded, prompt = generator_parts
    torch.set_num_threads(threads)
    pages = pages_needed(len(prompt), max_tokens, GeneratorConfig().page_tokens)
    generator = Generator(loaded.model, GeneratorConfig(num_pages=pages), loaded.tokenizer)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    generator.run([Request(0, tuple(prompt), sampling)])
    stats = generator.stats
    return (stats.decode_tokens / max(stats.decode_s, 1e-9),
            stats.prefill_tokens / max(stats.prefill_s, 1e-9))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1],
                        help="numbers of spinning neighbour processes, one setting each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    from api.engine_options import default_threads, usable_cores
    from engine.load import load_model

    loaded = load_model(None)
    parts = (loaded, loaded.tokenizer.encode_chat(PROMPT))
    print(f"{loaded.path.name}, {os.cpu_count()} CPUs, {usable_cores()} usable cores; "
          f"prompt {len(parts[1])} tokens, {args.max_tokens} new", flush=True)
    for busy in args.busy:
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
        for spinner in spinners:
            spinner.start()
        try:
            rates = {threads: [] for threads in args.threads}
            for repeat in range(args.repeats):
                for threads in args.threads:
                    load = os.getloadavg()[0]
                    decode, prefill = one_run(parts, threads, args.max_tokens)
                    rates[threads].append(decode)
                    print(f"  busy {busy} threads {threads} load {load:6.2f}: decode "
                          f"{decode:6.1f} tok/s, prefill {prefill:6.0f} tok/s", flush=True)
            for threads, decodes in rates.items():
                print(f"busy {busy}: threads {threads} decode median "
                      f"{statistics.median(decodes):.1f} tok/s "
                      f"({min(decodes):.1f}..{max(decodes):.1f})", flush=True)
            print(f"busy {busy}: the default would choose {default_threads()} thread(s) now "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
        finally:
            for spinner in spinners:
                spinner.terminate()
                spinner.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
