"""Part 2 of bench/transport_bench.py: serving through worker processes (engine/processes.py on
the real data path, engine/process_data.py) against the in-process engine (engine/runtime.py),
the same streams on the same model, in one run.

Both get the same workload at once: `streams` greedy requests of seeded random prompts
(16-64 tokens) and `max_tokens` outputs each, end of sequence ignored, so both generate
exactly the same number of tokens. In-process: one Runtime (1 prefill, 1 decode worker)
stepped in this process with `threads` torch threads. Across processes: a router, one
prefill and one decode process (one torch thread each: the processes' total is 2), page
writes over gloo on 127.0.0.1; timed by the router from each Arrive to each token streamed
to it. Printed: output tokens/s over the span from the first arrival to the last token,
time to first token p50 / p99 (nearest rank), the CPU seconds each side used (every thread;
each process from its loop's start to its stop), and the ratio of tokens/s (target >= 0.8).
The CPU seconds say what the ratio can be where the cores are shared: the processes' two
compute threads get more than the in-process engine's one only while a core is free.
The processes' tokens are checked equal to the in-process engine's before any figure is
printed. Model loading, one warm-up request through each model (engine/process_data.py `warm_up`,
in each worker process and for the in-process engine alike) and the processes' start (the
gloo world joined) are not timed.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

PROMPT_TOKENS = (16, 64)  # each prompt's length, drawn in this range
VOCAB_USED = 1000          # prompt token ids are drawn below this (every model has them)


def workload(streams: int, max_tokens: int, seed: int) -> list[tuple[tuple, int]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(streams):
        n = int(torch.randint(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, (1,),
                              generator=generator))
        out.append((tuple(torch.randint(0, VOCAB_USED, (n,), generator=generator).tolist()),
                    max_tokens))
    return out


def nearest_rank(values: list[float], percent: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * percent // 100) - 1)]


def in_process(model_path: str, work: list, page_tokens: int, pages: int,
               threads: int) -> dict:
    from engine.model import LlamaModel
    from engine.process_data import warm_up
    from engine.runtime import Runtime, RuntimeConfig
    from engine.sampling import SamplingParams
    from engine.service import GenerationRequest, TokenOut
    from engine.weights import load_checkpoint

    torch.set_num_threads(threads)
    model = LlamaModel(load_checkpoint(model_path))
    warm_up(model)  # as each worker process does before it joins
    rt = Runtime(model, RuntimeConfig(prefill_pages=pages, decode_pages=pages,
                                      page_tokens=page_tokens, max_batch=len(work),
                                      context_tokens=pages * page_tokens))
    tokens: dict[int, list] = {r: [] for r in range(len(work))}
    times: dict[int, list] = {r: [] for r in range(len(work))}

    def on_event(event) -> None:
        if isinstance(event, TokenOut):
            tokens[event.request_id].append(event.token_id)
            times[event.request_id].append(time.monotonic())

    started, cpu_from_s = time.monotonic(), time.process_time()
    for ids, max_tokens in work:
        rt.arrive(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens,
                                                        ignore_eos=True)), on_event)
    steps_max = 100 * sum(n for _, n in work)
    for _ in range(steps_max):
        if rt.idle:
            break
        rt.step()
    assert rt.idle, f"the in-process engine was not idle after {steps_max} steps"
    return {"tokens": [tokens[r] for r in range(len(work))],
            "cpu_s": {"in-process": time.process_time() - cpu_from_s},
            "ttft_s": [times[r][0] - started for r in range(len(work))],
            "span_s": max(at[-1] for at in times.values()) - started}


def across_processes(model_path: str, work: list, page_tokens: int, pages: int,
                     timeout_s: float) -> dict:
    from engine.processes import Deployment, Launched

    with tempfile.TemporaryDirectory(prefix="kvproof-serving-") as folder:
        deployment = Deployment.with_model(
            model_path, work, page_tokens=page_tokens, prefill_pages=pages,
            decode_pages=pages, max_batch=len(work), prefill_chunk_tokens=512,
            arrive_every_s=0.0, log_dir=folder, suspect_after_s=10.0, heartbeat_s=0.5,
            transport_timeout_s=timeout_s, join_timeout_s=timeout_s)
        launched = Launched(deployment)
        try:
            launched.start(timeout_s=timeout_s)
            done = launched.wait_done(timeout_s)
            stopped = launched.stop(timeout_s=timeout_s)
        finally:
            launched.close()
    assert done["outcomes"] == ["Ok"] * len(work), done["outcomes"]
    return {"tokens": done["tokens"], "ttft_s": [t[0] for t in done["timings"]],
            "cpu_s": {name: report["cpu_s"] for name, report in sorted(stopped.items())},
            "span_s": done["span_s"]}


def figures(name: str, run: dict) -> float:
    generated = sum(len(t) for t in run["tokens"])
    rate = generated / run["span_s"]
    ttft = [1000 * t for t in run["ttft_s"]]
    cpu = ", ".join(f"{who} {s:.1f}" for who, s in run["cpu_s"].items())
    print(f"{name:>16}: {generated} tokens in {run['span_s']:.2f} s, {rate:7.1f} tokens/s; "
          f"TTFT p50 {nearest_rank(ttft, 50):7.0f} ms, p99 {nearest_rank(ttft, 99):7.0f} ms; "
          f"CPU s {sum(run['cpu_s'].values()):.1f} ({cpu})", flush=True)
    return rate


def serving(model_path: str, streams: int, max_tokens: int, seed: int, page_tokens: int,
            threads: int, timeout_s: float) -> int:
    work = workload(streams, max_tokens, seed)
    pages = streams * -(-(PROMPT_TOKENS[1] + max_tokens - 1) // page_tokens)
    print(f"serving: {streams} streams of {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} prompt tokens "
          f"and {max_tokens} outputs (seed={seed}), {model_path}, pages of {page_tokens} "
          f"tokens, {pages} per pool; in-process with {threads} torch threads, processes "
          "with 1 each", flush=True)
    local = in_process(model_path, work, page_tokens, pages, threads)
    remote = across_processes(model_path, work, page_tokens, pages, timeout_s)
    if remote["tokens"] != local["tokens"]:
        wrong = [r for r in range(streams) if remote["tokens"][r] != local["tokens"][r]]
        print(f"failed: the processes' tokens differ from the in-process engine's for {wrong}")
        return 1
    rate_local = figures("in-process", local)
    rate_remote = figures("1 x 1 processes", remote)
    print(f"tokens/s, processes / in-process (target >= 0.80): "
          f"{rate_remote / rate_local:.2f}; median TTFT ratio "
          f"{statistics.median(remote['ttft_s']) / statistics.median(local['ttft_s']):.2f}")
    return 0
