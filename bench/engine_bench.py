"""The engine next to transformers, on the same model, prompts, dtype and device.

    python bench/engine_bench.py                      # default model, fp32 and bf16, CPU
    python bench/engine_bench.py --device cuda --dtype bfloat16
    python bench/engine_bench.py --quick              # fewer repeats, batch 64 left out
    python bench/engine_bench.py --device cuda --no-cuda-graphs   # eager decode on CUDA

Prints, per dtype: decode tokens/s at batch 1, 8 and 64; time to first token for a
128-token and a 2,048-token prompt; peak memory; the cost of the page-tag check and of
the page checksums as on/off ratios of decode time; and, once, the default model's load
time next to transformers loading the same GGUF. Each figure is the median over repeats,
and the two systems alternate repeat by repeat, so that a neighbour's load on a shared
machine hits both alike: read the ratios, not the absolute figures.

How each side is timed. Decode tokens/s: transformers' generate with N new tokens,
greedy, EOS ignored, timed from inside (a logits processor notes the clock at every
step's scores: the last note minus the first, over batch * (N - 1) tokens); the
engine's own decode-step time over the tokens those steps produced. TTFT: one request,
one new token, from the call to the token. Peak memory: each side runs its largest batch
once in a fresh child process of its own (a process that already ran the other figures
keeps freed memory and shows no rise), which loads the model, then samples its resident
memory every 5 ms through the run: the peak, and the peak's rise over the loaded model
(the engine's rise includes its whole preallocated 512-page KV pool, transformers' its
growing cache). On CUDA: torch's peak allocation, in-process.

CUDA graphs (engine/graphs.py): on by default with --device cuda, off elsewhere;
--cuda-graphs on a CPU runs the same padded static-buffer decode eagerly (its cost, not a
speed-up). Memory-bandwidth line, per decode batch: the bytes one decode step must read
(every weight the step multiplies by, the embedding rows of the batch, and the K and V of
every sequence's context at the run's mean context length, plus the K and V it writes)
over a bandwidth gives the step time no engine can beat, hence an ideal tok/s; the line
prints the engine's (and transformers') fraction of it. The bandwidth is the issue's
stated 4.2 TB/s for the H200 on CUDA, measured on a CPU (a 256 MiB copy, read + write
bytes over the median time), or --bandwidth-gbs; the line says which.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF progress bars

import torch  # noqa: E402

from engine.generate import Generator, GeneratorConfig, Request  # noqa: E402
from engine.load import default_model_path, load_model  # noqa: E402
from engine.model import DTYPES  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

PROMPT_TOKENS_DECODE = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                        help="repeatable (default: float32 and bfloat16)")
    parser.add_argument("--batch", type=int, action="append", help="default: 1, 8, 64")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--quick", action="store_true", help="2 repeats, no batch 64")
    parser.add_argument("--no-transformers", action="store_true", help="the engine alone")
    parser.add_argument("--decode-only", action="store_true",
                        help="decode rows only: no TTFT, peak memory or guard costs")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="decode through engine/graphs.py (default: on for CUDA)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="memory bandwidth for the ideal tok/s (default: 4200 on CUDA, "
                             "measured on a CPU)")
    parser.add_argument("--peak-child", choices=["engine", "transformers"],
                        help=argparse.SUPPRESS)  # internal: one side's peak memory, as JSON
    args = parser.parse_args()
    args.dtype = args.dtype or ["float32", "bfloat16"]
    if args.cuda_graphs is None:
        args.cuda_graphs = args.device.startswith("cuda")
    args.batch = args.batch or ([1, 8] if args.quick else [1, 8, 64])
    if args.quick:
        args.repeats = min(args.repeats, 2)
    return args


def median_s(samples: list[float]) -> float:
    return statistics.median(samples)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PeakMemory:
    """The largest rise in memory while the block runs (`peak_bytes`) and the largest
    resident set (`peak_total_bytes`): RSS sampled every 5 ms on the CPU, torch's peak
    allocation on CUDA. Meaningful in a fresh process only (see the module's docstring)."""

    def __init__(self, device: str):
        self.device, self.peak_bytes, self.peak_total_bytes = device, 0, 0

    def __enter__(self):
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        import psutil

        self._process = psutil.Process()
        self._base = self._process.memory_info().rss
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            rss = self._process.memory_info().rss
            self.peak_total_bytes = max(self.peak_total_bytes, rss)
            self.peak_bytes = max(self.peak_bytes, rss - self._base)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            self.peak_total_bytes = torch.cuda.max_memory_allocated()
            self.peak_bytes = self.peak_total_bytes - self._base
        else:
            self._running = False
            self._thread.join()


class EngineSide:
    name = "engine"
    POOL_PAGES = 512  # 64 requests of 64 + 32 tokens, or one 2,048-token prompt, at 16/page

    def __init__(self, loaded, device: str, cuda_graphs: bool = False):
        self.loaded, self.device, self.cuda_graphs = loaded, device, cuda_graphs
        self._generators = {}

    def generator(self, **options) -> Generator:
        """One generator (and pool) per set of options, reused: a pool is allocated once,
        as in a server, and pages are not zeroed between runs."""
        key = tuple(sorted(options.items()))
        if key not in self._generators:
            config = GeneratorConfig(num_pages=self.POOL_PAGES, max_batch=64,
                                     cuda_graphs=self.cuda_graphs, **options)
            started = time.perf_counter()
            generator = Generator(self.loaded.model, config, self.loaded.tokenizer)
            if generator.graphs is not None:
                graphs = generator.graphs
                print(f"  (decode graphs, options {dict(options)}: buckets {graphs.buckets}, "
                      f"tables {graphs.max_pages} pages, "
                      f"{'captured' if graphs.captured else 'eager, not captured'}, "
                      f"{time.perf_counter() - started:.2f} s)", flush=True)
            self._generators[key] = generator
        return self._generators[key]

    def decode_tokens_per_s(self, prompts, new_tokens: int, **options) -> float:
        generator = self.generator(**options)
        sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        generator.run([Request(i, tuple(p), sampling) for i, p in enumerate(prompts)])
        synchronize(self.device)
        return generator.stats.decode_tokens / generator.stats.decode_s

    def first_token_s(self, prompt) -> float:
        generator = self.generator()
        started = time.perf_counter()
        generator.run([Request(0, tuple(prompt), SamplingParams(max_tokens=1))])
        synchronize(self.device)
        return time.perf_counter() - started


class TransformersSide:
    name = "transformers"

    def __init__(self, model, device: str):
        self.model, self.device = model, device

    @torch.inference_mode()
    def _generate_s(self, prompts, new_tokens: int) -> float:
        input_ids = torch.tensor(prompts, device=self.device)
        started = time.perf_counter()
        self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=0)
        synchronize(self.device)
        return time.perf_counter() - started

    @torch.inference_mode()
    def decode_tokens_per_s(self, prompts, new_tokens: int) -> float:
        """Timed inside generate: a logits processor notes the clock at each step's
        scores, so the decode time is the last note minus the first (after the prefill
        step), over the batch * (new_tokens - 1) tokens in between. (Generate with N
        tokens minus generate with 1, as this bench did before, subtracts two noisy
        times: one slow prefill made it report 10,125 tok/s for bf16 batch 64 on a
        2-core CPU, 2.2x the memory-bandwidth limit.)"""
        from transformers import LogitsProcessor, LogitsProcessorList

        device = self.device

        class StepClock(LogitsProcessor):
            def __init__(self):
                self.notes: list[float] = []

            def __call__(self, input_ids, scores):
                if not self.notes or len(self.notes) == new_tokens - 1:
                    synchronize(device)  # the first and the last note only
                self.notes.append(time.perf_counter())
                return scores

        clock = StepClock()
        input_ids = torch.tensor(prompts, device=self.device)
        self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=0,
                            logits_processor=LogitsProcessorList([clock]))
        assert len(clock.notes) == new_tokens, "transformers did not take every step"
        return len(prompts) * (new_tokens - 1) / max(clock.notes[-1] - clock.notes[0], 1e-9)

    def first_token_s(self, prompt) -> float:
        return self._generate_s([prompt], 1)


def load_transformers(device: str):
    """(model in fp32, seconds) loading the default GGUF, tokenizer included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = default_model_path()
    started = time.perf_counter()
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    model = model.to(device).eval()
    return model, time.perf_counter() - started


def prompts_of(length: int, batch: int, vocab: int = 49152) -> list[list[int]]:
    """Deterministic prompts of ordinary tokens (ids 300.. avoid the special ones)."""
    generator = torch.Generator().manual_seed(length * 1000 + batch)
    return torch.randint(300, vocab, (batch, length), generator=generator).tolist()


def alternate(sides, measure, repeats: int) -> dict:
    """Median of `measure(side)` per side, the sides taking turns repeat by repeat."""
    samples = {side.name: [] for side in sides}
    for _ in range(repeats):
        for side in sides:
            samples[side.name].append(measure(side))
    return {name: median_s(values) for name, values in samples.items()}


def print_row(label: str, values: dict, unit: str, higher_is_better: bool) -> None:
    engine = values.get("engine")
    other = values.get("transformers")
    cells = "  ".join(f"{name} {value:10.2f} {unit}" for name, value in values.items())
    ratio = ""
    if engine and other:
        speedup = engine / other if higher_is_better else other / engine
        ratio = f"  engine/transformers {speedup:5.2f}x"
    print(f"  {label:<28} {cells}{ratio}", flush=True)


def bench_dtype(args, dtype: str, engine_loaded_fp32_path: Path, transformers_model) -> None:
    loaded = load_model(engine_loaded_fp32_path, device=args.device, dtype=dtype)
    engine = EngineSide(loaded, args.device, args.cuda_graphs)
    sides = [engine]
    if transformers_model is not None:
        sides.append(TransformersSide(transformers_model.to(DTYPES[dtype]), args.device))
    print(f"\n{dtype} on {args.device} ({torch.get_num_threads()} threads), "
          f"{args.new_tokens} new tokens per request, prompts of {PROMPT_TOKENS_DECODE} tokens, "
          f"CUDA graphs {'on' if args.cuda_graphs else 'off'}:")
    warm = prompts_of(PROMPT_TOKENS_DECODE, 2)
    for side in sides:
        side.decode_tokens_per_s(warm, 4)
    for batch in args.batch:
        prompts = prompts_of(PROMPT_TOKENS_DECODE, batch)
        repeats = args.repeats if batch < 64 else max(1, args.repeats - 1)
        rates = alternate(sides, lambda s: s.decode_tokens_per_s(prompts, args.new_tokens),
                          repeats)
        print_row(f"decode batch {batch}", rates, "tok/s", True)
        bandwidth_row(loaded.model, batch, args, rates)
    if args.decode_only:
        return
    for length in (128, 2048):
        prompt = prompts_of(length, 1)[0]
        ttft = alternate(sides, lambda s: s.first_token_s(prompt) * 1000, args.repeats)
        print_row(f"TTFT, {length}-token prompt", ttft, "ms", False)
    peak_memory_rows(args, dtype, [side.name for side in sides])
    guard_costs(args, engine)


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights one decode step reads: every projection once (the output
    projection included, tied or not; the layers' norm weights are folded into them),
    the final norm, and the embedding rows of the batch's tokens."""
    def size(tensor) -> int:
        return 0 if tensor is None else tensor.numel() * tensor.element_size()

    total = size(model.final_norm) + size(model.output.weight) + size(model.output.bias)
    for layer in model.layers:
        for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += size(projection.weight) + size(projection.bias)
    return total + batch * size(model.embed[0])


def kv_bytes_per_step(model, batch: int, context_tokens: float) -> float:
    """K and V bytes one decode step reads (the context of every sequence, every layer)
    and writes (one token per sequence)."""
    config = model.config
    token_bytes = (config.num_layers * 2 * config.num_kv_heads * config.head_dim
                   * torch.empty(0, dtype=model.dtype).element_size())
    return batch * (context_tokens + 1) * token_bytes


_BANDWIDTH = {}


def memory_bandwidth(args) -> tuple[float, str]:
    """(bytes/s, how it was found): --bandwidth-gbs, else 4.2 TB/s on CUDA (the issue's
    H200 figure), else measured once on this CPU."""
    if args.bandwidth_gbs:
        return args.bandwidth_gbs * 1e9, "given (--bandwidth-gbs)"
    if args.device.startswith("cuda"):
        return 4.2e12, "stated: 4.2 TB/s, the issue's H200 figure"
    if "cpu" not in _BANDWIDTH:
        source = torch.ones(2**28 // 4)  # 256 MiB of fp32
        target = torch.empty_like(source)
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            target.copy_(source)
            samples.append(time.perf_counter() - started)
        _BANDWIDTH["cpu"] = 2 * source.numel() * 4 / median_s(samples)
    return _BANDWIDTH["cpu"], "measured: a 256 MiB copy on this CPU, read + write"


def bandwidth_row(model, batch: int, args, rates: dict) -> None:
    """The ideal tok/s at the memory-bandwidth limit and each side's fraction of it."""
    context = PROMPT_TOKENS_DECODE + args.new_tokens / 2  # mean over the decode steps
    weights = weight_bytes_per_step(model, batch)
    kv = kv_bytes_per_step(model, batch, context)
    bandwidth, source = memory_bandwidth(args)
    ideal = batch * bandwidth / (weights + kv)
    fractions = "  ".join(f"{name} {rate / ideal * 100:5.1f}%" for name, rate in rates.items())
    print(f"    bandwidth limit: weights {weights / 2**20:.1f} MiB + KV {kv / 2**20:.2f} MiB "
          f"per step (mean context {context:.0f}) at {bandwidth / 1e9:.0f} GB/s ({source}) "
          f"-> ideal {ideal:,.0f} tok/s; {fractions} of it", flush=True)


def peak_memory_rows(args, dtype: str, side_names: list[str]) -> None:
    """One fresh child process per side (CPU); in-process on CUDA, where torch's own
    peak counter is exact."""
    batch = max(args.batch)
    totals, rises = {}, {}
    for name in side_names:
        command = [sys.executable, __file__, "--peak-child", name, "--dtype", dtype,
                   "--device", args.device, "--batch", str(batch),
                   "--new-tokens", str(args.new_tokens),
                   "--cuda-graphs" if args.cuda_graphs else "--no-cuda-graphs"]
        if args.threads:
            command += ["--threads", str(args.threads)]
        child = subprocess.run(command, capture_output=True, text=True)
        if child.returncode != 0:
            print(f"  peak memory, {name}: the child failed: "
                  f"{child.stderr.strip().splitlines()[-1:]}", flush=True)
            return
        figures = json.loads(child.stdout.strip().splitlines()[-1])
        totals[name] = figures["peak_total_bytes"] / 2**20
        rises[name] = figures["peak_rise_bytes"] / 2**20
    print_row(f"peak memory, batch {batch}", totals, "MiB", False)
    print_row("  rise over loaded model", rises, "MiB", False)


def peak_child(args) -> int:
    """Load one side, run its largest batch once under PeakMemory, print JSON."""
    dtype = args.dtype[0]
    batch = max(args.batch)
    with torch.inference_mode():
        if args.peak_child == "engine":
            side = EngineSide(load_model(default_model_path(), device=args.device, dtype=dtype),
                              args.device, args.cuda_graphs)
        else:
            model, _ = load_transformers(args.device)
            side = TransformersSide(model.to(DTYPES[dtype]), args.device)
        prompts = prompts_of(PROMPT_TOKENS_DECODE, batch)
        with PeakMemory(args.device) as memory:
            side.decode_tokens_per_s(prompts, args.new_tokens)
    print(json.dumps({"peak_total_bytes": memory.peak_total_bytes,
                      "peak_rise_bytes": memory.peak_bytes}))
    return 0


def guard_costs(args, engine: EngineSide) -> None:
    """Decode time with a guard on over decode time with it off: the median of the
    ratios of back-to-back pairs, the order flipping pair by pair (a neighbour's load
    that comes and goes hits both runs of a pair alike; a median of all "on" times over
    a median of all "off" times moved by +-3% from run to run at batch 1)."""
    for batch in (1, 8):
        prompts = prompts_of(PROMPT_TOKENS_DECODE, batch)
        for guard in ("check_tags", "checksums"):
            ratios = []
            for pair in range(max(args.repeats, 7)):
                seconds = {}
                for enabled in ((True, False) if pair % 2 == 0 else (False, True)):
                    rate = engine.decode_tokens_per_s(prompts, args.new_tokens,
                                                      **{guard: enabled})
                    seconds[enabled] = 1 / rate
                ratios.append(seconds[True] / seconds[False])
            ratio = median_s(ratios)
            print(f"  {guard} on/off, batch {batch:<3}        decode time ratio {ratio:6.3f} "
                  f"({(ratio - 1) * 100:+.1f}%; pairs {min(ratios):.3f}..{max(ratios):.3f})",
                  flush=True)


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak_child:
        return peak_child(args)
    path = default_model_path()
    started = time.perf_counter()
    load_model(path, device=args.device, dtype="float32")
    engine_load_s = time.perf_counter() - started
    print(f"default model: {path.name}")
    transformers_model = None
    if args.no_transformers:
        print(f"  load (weights + tokenizer)   engine {engine_load_s:6.2f} s")
    else:
        transformers_model, transformers_load_s = load_transformers(args.device)
        print(f"  load (weights + tokenizer)   engine {engine_load_s:6.2f} s  transformers "
              f"{transformers_load_s:6.2f} s  engine/transformers "
              f"{transformers_load_s / engine_load_s:5.2f}x faster")
    with torch.inference_mode():
        for dtype in args.dtype:
            bench_dtype(args, dtype, path, transformers_model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
