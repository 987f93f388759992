"""The engine's prefix cache (issue 28): the same engine with caching off and on.

    python bench/prefix_bench.py                  # default model, fp32, 24 + 16 requests
    python bench/prefix_bench.py --tiny           # a tiny random Llama: seconds, for a check
    python bench/prefix_bench.py --requests 32 --concurrency 4 --seed 3 --threads 1

"Caching on" is both of the engine's prefix caches: decode's (RuntimeConfig.prefix_cache:
saves the transfer) and the prefill's (prefill_cache: saves the compute of the cached
prefix). Two workloads, each run with caching off and on against the same RuntimeConfig,
the runs
alternating repeat by repeat so that a neighbour's load on a shared machine hits both
alike (read the ratios, not the absolute figures):

- shared: every prompt is one system prompt (~90% of its tokens, whole pages) and a
  suffix of its own. `--concurrency` closed-loop clients: each sends its next request when
  its previous one has finished, so the first wave finds nothing cached and the later ones
  find the system prompt's pages sealed. Prints TTFT p50 / p99, the prompt tokens the
  prefill ran through the model (the engine's counter), the pages the transport moved, and
  the hit rates (the pages each cache found over the full prompt pages it looked up).
- distinct: the same shape with no shared prefix: nothing can hit, so on/off is the
  cache's cost (hashing pages, the core's lookups, sealing, evicting; target <= 3%);
  besides the medians, the on/off ratio of each back-to-back pair (`--distinct-repeats`).

TTFT is from `Runtime.arrive` to the request's first token out, in the loop's thread (the
bench steps the runtime itself: no server, no HTTP). Every run is bounded: `--requests`
requests and `--run-s-max` seconds; a run that overruns stops the bench (exit 1). The seed
(prompts) is printed; the same seed and options give the same prompts.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from engine.load import load_model  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import Finished, GenerationRequest, TokenOut  # noqa: E402

PAGE_TOKENS = 16
MODES = {"off": {}, "on": {"prefix_cache": True, "prefill_cache": True}}  # both sides


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random Llama instead of the default model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=24, help="shared workload")
    parser.add_argument("--distinct-requests", type=int, default=16, help="no sharing")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    parser.add_argument("--system-tokens", type=int, default=464, help="29 pages of 16")
    parser.add_argument("--suffix-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens a request")
    parser.add_argument("--repeats", type=int, default=2, help="shared: per mode")
    parser.add_argument("--distinct-repeats", type=int, default=4, help="distinct: per mode")
    parser.add_argument("--seed", type=int, default=0, help="the prompts'")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--run-s-max", type=float, default=600.0, help="one run's bound")
    args = parser.parse_args()
    for name in ("requests", "distinct_requests", "concurrency", "system_tokens",
                 "suffix_tokens", "max_tokens", "repeats", "distinct_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def tiny_model_path(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def prompts_of(args, vocab: int, shared: bool) -> list[tuple[int, ...]]:
    """Seeded prompts: system + suffix each (shared), or as long and all distinct."""
    generator = torch.Generator().manual_seed(args.seed)

    def draw(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(100, vocab, (length,), generator=generator).tolist())

    count = args.requests if shared else args.distinct_requests
    if not shared:
        return [draw(args.system_tokens + args.suffix_tokens) for _ in range(count)]
    system = draw(args.system_tokens)
    return [system + draw(args.suffix_tokens) for _ in range(count)]


@dataclass
class Run:
    ttft_s: list = field(default_factory=list)
    wall_s: float = 0.0
    computed_tokens: int = 0
    pages_moved: int = 0
    prompt_pages: int = 0  # full prompt pages decode's cache looked up
    decode_hit_pages: int = 0
    prefill_hit_pages: int = 0
    outputs: list = field(default_factory=list)


def runtime_config(args, prompt_tokens: int, mode: str) -> RuntimeConfig:
    pages = -(-(prompt_tokens + args.max_tokens) // PAGE_TOKENS)
    pool_pages = 2 * args.concurrency * pages  # room for the idle cache beside the live
    return RuntimeConfig(prefill_pages=pool_pages, decode_pages=pool_pages,
                         page_tokens=PAGE_TOKENS, context_tokens=pages * PAGE_TOKENS,
                         max_batch=args.concurrency, lease_s=1e9, transfer_timeout_s=1e9,
                         log_records_max=0, **MODES[mode])


def run(model, args, prompts: list, mode: str, label: str) -> Run:
    """Closed loop: `concurrency` clients, each sending its next prompt when its last ended."""
    gc.collect()  # the previous run's runtime and its pools (reference cycles) go first
    rt = Runtime(model, runtime_config(args, max(map(len, prompts)), mode))
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    out, sent, first, ended = Run(outputs=[None] * len(prompts)), {}, {}, {}
    tokens: dict[int, list] = {}

    def on_event(event) -> None:
        r = event.request_id
        if isinstance(event, TokenOut):
            first.setdefault(r, time.perf_counter())
            tokens.setdefault(r, []).append(event.token_id)
        elif isinstance(event, Finished):
            assert event.outcome == "Ok", event
            ended[r] = True

    queue = list(enumerate(prompts))

    def send() -> None:
        index, prompt = queue.pop(0)
        sent[rt.arrive(GenerationRequest(prompt, sampling), on_event, request_id=index)] = (
            time.perf_counter())

    started = time.perf_counter()
    for _ in range(min(args.concurrency, len(queue))):
        send()
    while len(ended) < len(prompts):
        if time.perf_counter() - started > args.run_s_max:
            raise SystemExit(f"{label}: over --run-s-max {args.run_s_max} s")
        busy = rt.step()
        finished = len(ended)
        while queue and len(sent) - finished < args.concurrency:
            send()
        if not busy and rt.idle and queue == []:
            break
    out.wall_s = time.perf_counter() - started
    out.ttft_s = [first[r] - sent[r] for r in sorted(sent)]
    out.outputs = [tokens[r] for r in sorted(sent)]
    out.computed_tokens = rt.counts["prefill"]["computed_tokens"]
    out.pages_moved = rt.transport.writes_landed
    prefix = rt.counts["prefix"]
    out.prompt_pages = sum(len(p) // PAGE_TOKENS for p in prompts)
    out.decode_hit_pages = prefix["hit_pages"]
    out.prefill_hit_pages = rt.counts["prefill"].get("hit_pages", 0)
    print(f"  {label}: {len(prompts)} requests in {out.wall_s:.2f} s", file=sys.stderr,
          flush=True)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def workload(model, args, vocab: int, shared: bool) -> dict[str, list[Run]]:
    prompts = prompts_of(args, vocab, shared)
    name = "shared" if shared else "distinct"
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    repeats = args.repeats if shared else args.distinct_repeats
    for repeat in range(repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
        for mode in order:
            runs[mode].append(run(model, args, prompts, mode,
                                  f"{name} {mode} repeat {repeat + 1}/{repeats}"))
    outputs = {mode: runs[mode][0].outputs for mode in MODES}
    same = outputs["off"] == outputs["on"]
    print(f"{name}: {len(prompts)} prompts of {len(prompts[0])} tokens, "
          f"concurrency {args.concurrency}, {args.max_tokens} output tokens each; "
          f"greedy outputs identical off/on: {same}")
    return runs


def median_of(runs: list[Run], pick) -> float:
    return statistics.median(pick(r) for r in runs)


def print_shared(runs: dict[str, list[Run]]) -> None:
    rows = [("TTFT p50 (s)", lambda r: percentile(r.ttft_s, 0.5), "{:.3f}", False),
            ("TTFT p99 (s)", lambda r: percentile(r.ttft_s, 0.99), "{:.3f}", False),
            ("wall (s)", lambda r: r.wall_s, "{:.2f}", False),
            ("prefill tokens computed", lambda r: r.computed_tokens, "{:.0f}", False),
            ("pages transferred", lambda r: r.pages_moved, "{:.0f}", False),
            ("decode hit rate", lambda r: r.decode_hit_pages / r.prompt_pages, "{:.3f}", True),
            ("prefill hit rate", lambda r: r.prefill_hit_pages / r.prompt_pages, "{:.3f}",
             True)]
    for label, pick, form, higher in rows:
        off, on = median_of(runs["off"], pick), median_of(runs["on"], pick)
        if higher or off == 0 or on == 0:
            ratio = ""
        else:
            ratio = f"  off/on {off / on:.2f}x"
        print(f"  {label:<26} off {form.format(off):>9}  on {form.format(on):>9}{ratio}")


def print_distinct(runs: dict[str, list[Run]]) -> None:
    """Medians, and the on/off ratio of each back-to-back pair of runs (a neighbour's load
    moves both runs of a pair alike more than it moves runs minutes apart)."""
    for label, pick in (("TTFT p50 (s)", lambda r: percentile(r.ttft_s, 0.5)),
                        ("wall (s)", lambda r: r.wall_s)):
        off, on = median_of(runs["off"], pick), median_of(runs["on"], pick)
        pairs = [pick(b) / pick(a) for a, b in zip(runs["off"], runs["on"])]
        print(f"  {label:<26} off {off:>9.3f}  on {on:>9.3f}  on/off {on / off:.3f}, "
              f"pairs median {statistics.median(pairs):.3f} ({min(pairs):.3f}-"
              f"{max(pairs):.3f}) (the cache's cost; target <= 1.03)")


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        path = tiny_model_path(Path(folder)) if args.tiny else None
        loaded = load_model(path, dtype=args.dtype)
    model = loaded.model
    vocab = model.config.vocab_size
    print(f"prefix_bench: seed {args.seed}, {'tiny random Llama' if args.tiny else 'default model'}"
          f" {args.dtype}, {torch.get_num_threads()} threads, page {PAGE_TOKENS} tokens, "
          f"{args.repeats} + {args.distinct_repeats} repeats alternating off/on; "
          f"caching on = {MODES['on']}")
    shared = workload(model, args, vocab, shared=True)
    print_shared(shared)
    distinct = workload(model, args, vocab, shared=False)
    print_distinct(distinct)
    return 0


if __name__ == "__main__":
    sys.exit(main())
