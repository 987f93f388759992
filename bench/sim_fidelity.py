"""The simulator against the engine it models: one workload, run twice, latencies compared.

    python bench/sim_fidelity.py                          # default model, 1x1, 40 requests
    python bench/sim_fidelity.py --requests 120 --rate 3 --workers 2x2 --seed 7
    python bench/sim_fidelity.py --compute compute.toml   # a calibration made before

What it does, in order:
1. draws one request list from the seed: Poisson arrivals at --rate, prompt lengths uniform
   in --prompt-tokens (whole pages), output lengths uniform in --output-tokens;
2. calibrates the engine on this machine (engine/calibrate.py, the grid covering the
   workload; or reads --compute);
3. runs the list on the real engine: the in-process protocol engine (engine/runtime.py)
   with P prefill and D decode workers, stepped on this thread in real time, every request
   submitted at its arrival time, greedy, ignore_eos, max_tokens = its output length;
4. runs the same list in the simulator (a trace workload: same arrivals, prompt and output
   lengths), with the calibrated compute model, the in-process transport's page-write
   time and `serial_workers` (the engine's workers take turns on one thread);
5. prints TTFT and inter-token latency p50/p90/p99 from each side and the relative error
   (sim - engine) / engine; then where the engine's loop time went, its own decode and
   prefill steps against the calibrated table at the same shapes (the machine's drift
   between calibration and run), and, for diagnosis only, the simulator once more with its
   tables scaled by those median ratios: what error is left is the model's, not the
   machine's (that second table uses the engine run, so it is no prediction).

Inter-token latency: the engine's is every gap between two streamed tokens of a request;
the simulator's is every decode step's duration, once per sequence in the step (a
sequence that joined a step under way waited for it too: the simulator's figure leaves
that wait out). TTFT runs from the request's scheduled arrival on both sides (the engine's
includes the loop's lateness in taking it).

Timings are noisy on a shared machine: the load average is printed at the start and end;
rerun on a quiet machine with the command printed at the end. Bounded: --seconds-max for
the engine run (default 300), the calibration's own bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TQDM_DISABLE", "1")

PAGE_TOKENS = 16
CHUNK_TOKENS = 512
POOL_PAGES = 512
MAX_BATCH = 64


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


def workers_of(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PxD, e.g. 2x2, got {text!r}") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"each count must be at least 1, got {text!r}")
    return p, d


def requests_of(args, rate: float) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) per request: the lengths and the arrivals'
    pattern from the seed alone, the pattern scaled to `rate` arrivals per second."""
    rng = random.Random(args.seed)
    at, out = 0.0, []
    low, high = (-(-t // PAGE_TOKENS) for t in args.prompt_tokens)
    for _ in range(args.requests):
        out.append((at, rng.randint(low, high) * PAGE_TOKENS, rng.randint(*args.output_tokens)))
        at += rng.expovariate(1.0) / rate
    return out


def rate_for_load(args, compute_path: Path) -> float:
    """Arrivals per second that offer `args.load` of one worker pair's capacity, by the
    calibrated tables: a mean request prefilled alone, then decoded alone."""
    from sim.compute import CalibratedCompute, read_compute_file
    from sim.scenario import Compute, Link

    model = CalibratedCompute(read_compute_file(compute_path),
                              Compute(prefill_chunk_tokens=CHUNK_TOKENS), Link(), PAGE_TOKENS)
    prompt = sum(args.prompt_tokens) / 2
    output = sum(args.output_tokens) / 2
    service_s = (model.prefill_s(prompt)
                 + (output - 1) * model.decode_step_s(1, prompt + output / 2))
    return args.load * min(args.workers) / service_s


def percentiles(values: list[float]) -> dict:
    from sim.metrics import percentile

    return {q: percentile(values, q) for q in (50, 90, 99)}


# -- the engine ---------------------------------------------------------------------------------

def run_engine(model, requests, workers, seconds_max: float):
    """Each request submitted at its arrival (real time); TTFT and token gaps from the
    streamed tokens' times."""
    import torch

    from engine.runtime import Runtime, RuntimeConfig
    from engine.sampling import SamplingParams
    from engine.service import Finished, GenerationRequest, TokenOut

    runtime = Runtime(model, RuntimeConfig(
        prefill_pages=POOL_PAGES, decode_pages=POOL_PAGES, page_tokens=PAGE_TOKENS,
        context_tokens=POOL_PAGES * PAGE_TOKENS, max_batch=MAX_BATCH,
        prefill_chunk_tokens=CHUNK_TOKENS, prefill_workers=workers[0],
        decode_workers=workers[1], log_records_max=0))
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [tuple(torch.randint(min(100, vocab - 1), vocab, (p,), generator=generator).tolist())
               for _, p, _ in requests]
    token_times: dict[int, list[float]] = {}
    outcomes: dict[int, str] = {}

    def on_event(event):
        if isinstance(event, TokenOut):
            token_times.setdefault(event.request_id, []).append(time.perf_counter())
        elif isinstance(event, Finished):
            outcomes[event.request_id] = event.outcome

    # Where the loop's time goes: each worker's model steps, timed in place.
    spent = {"decode": [], "prefill": [], "loop": 0.0}
    for worker in runtime.decodes:
        worker.step = timed_decode(worker, worker.step, spent["decode"])
    for worker in runtime.prefills:
        worker.step = timed_prefill(worker, worker.step, spent["prefill"])
    start = time.perf_counter()
    deadline = start + seconds_max
    scheduled = {}
    i = 0
    with torch.inference_mode():
        while (i < len(requests) or not runtime.idle) and time.perf_counter() < deadline:
            now = time.perf_counter() - start
            while i < len(requests) and requests[i][0] <= now:
                sampling = SamplingParams(max_tokens=requests[i][2], ignore_eos=True)
                r = runtime.arrive(GenerationRequest(prompts[i], sampling), on_event,
                                   request_id=i)
                scheduled[r] = start + requests[i][0]
                i += 1
            began = time.perf_counter()
            busy = runtime.step()
            spent["loop"] += time.perf_counter() - began
            if not busy and i < len(requests):
                time.sleep(max(0.0, min(0.005, requests[i][0] - (time.perf_counter() - start))))
    if i < len(requests) or not runtime.idle:
        raise SystemExit(f"the engine run passed --seconds-max {seconds_max:g} with "
                         f"{len(requests) - len(outcomes)} requests unfinished")
    bad = {r: o for r, o in outcomes.items() if o != "Ok"}
    assert not bad, f"engine requests did not succeed: {bad}"
    ttft = [token_times[r][0] - scheduled[r] for r in sorted(scheduled)]
    itl = [b - a for r in sorted(scheduled) for a, b in zip(token_times[r], token_times[r][1:])]
    assert all(len(token_times[r]) == requests[r][2] for r in scheduled), "token counts differ"
    return ttft, itl, time.perf_counter() - start, spent


def timed_decode(worker, step, out: list):
    """A decode worker's step, recording (batch, sum of contexts, seconds) of each."""
    def timed():
        batch = worker.running[:worker.max_batch]
        context = sum(s.num_tokens for s in batch)
        began = time.perf_counter()
        result = step()
        if batch:
            out.append((len(batch), context, time.perf_counter() - began))
        return result
    return timed


def timed_prefill(worker, step, out: list):
    """A prefill worker's step, recording (tokens it computes, seconds) of each."""
    def timed():
        tokens = min(worker.chunk_tokens, sum(len(s.prompt_ids) - s.prefilled_tokens
                                              for s in worker.computing))
        began = time.perf_counter()
        result = step()
        if tokens:
            out.append((tokens, time.perf_counter() - began))
        return result
    return timed


def rescaled(compute_path: Path, spent: dict, folder: Path) -> Path:
    """The compute file with its prefill and decode tables scaled by the engine run's own
    median step ratios (run / table): the machine's drift between the calibration and the
    run taken out. Diagnosis only (it uses the run it is compared with)."""
    import statistics

    from sim.compute import CalibratedCompute, read_compute_file, write_compute_file
    from sim.scenario import Compute, Link

    tables = read_compute_file(compute_path)
    model = CalibratedCompute(tables, Compute(prefill_chunk_tokens=CHUNK_TOKENS), Link(),
                              PAGE_TOKENS)
    decode = statistics.median(s / model.decode_step_s(b, c) for b, c, s in spent["decode"])
    prefill = statistics.median(s / model.prefill_s(t) for t, s in spent["prefill"])
    data = tables.model_dump()
    data["prefill"]["seconds"] = [[x * prefill for x in row] for row in tables.prefill.seconds]
    data["decode"]["step_seconds"] = [[x * decode for x in row]
                                      for row in tables.decode.step_seconds]
    path = folder / "compute-rescaled.toml"
    write_compute_file(path, type(tables).model_validate(data))
    return path


def explain_engine(spent: dict, compute_path: Path) -> None:
    """The engine's loop time by part, and its decode steps against the calibrated table
    (the same shapes): drift of the machine between calibration and run shows here."""
    import statistics

    from sim.compute import CalibratedCompute, read_compute_file
    from sim.scenario import Compute, Link

    tables = read_compute_file(compute_path)
    model = CalibratedCompute(tables, Compute(prefill_chunk_tokens=CHUNK_TOKENS), Link(),
                              PAGE_TOKENS)
    decode_s = sum(s for _, _, s in spent["decode"])
    prefill_s = sum(s for _, s in spent["prefill"])
    loop_s = spent["loop"] or 1e-9
    print(f"engine loop {loop_s:.2f} s busy: decode steps {decode_s / loop_s:.0%}, prefill "
          f"steps {prefill_s / loop_s:.0%}, the rest (core events, delivery, transport, "
          f"streaming, timers) {(loop_s - decode_s - prefill_s) / loop_s:.0%}")
    for what, ratios in (
            ("decode steps", [s / model.decode_step_s(b, c) for b, c, s in spent["decode"]]),
            ("prefill steps", [s / model.prefill_s(t) for t, s in spent["prefill"]])):
        ratios.sort()
        if ratios:
            print(f"engine {what} in the run / the calibrated table at the same shape: median "
                  f"{statistics.median(ratios):.3f} (p10 {ratios[len(ratios) // 10]:.3f}, p90 "
                  f"{ratios[len(ratios) * 9 // 10]:.3f}, {len(ratios)} steps)")
    print(f"largest engine decode batch {max((b for b, _, _ in spent['decode']), default=0)}, "
          f"largest prefill step {max((t for t, _ in spent['prefill']), default=0)} tokens "
          "(several prompts in one step: the simulator prefills one at a time)")


# -- the simulator ------------------------------------------------------------------------------

def run_sim(requests, workers, compute_path: Path, folder: Path, seed: int):
    from sim.run import Simulation
    from sim.scenario import scenario_from_dict

    trace = folder / "requests.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": a, "prompt_tokens": p,
                                         "output_tokens": o}) + "\n" for a, p, o in requests))
    pool_tokens = POOL_PAGES * PAGE_TOKENS
    scenario = scenario_from_dict({
        "name": "sim-fidelity", "seed": seed, "requests": len(requests),
        "cluster": {"prefill_workers": workers[0], "decode_workers": workers[1],
                    "page_tokens": PAGE_TOKENS, "prefill_pool_tokens": pool_tokens,
                    "decode_pool_tokens": pool_tokens, "context_tokens": pool_tokens,
                    "router": "least-loaded", "decode_batch_max": MAX_BATCH},
        "workload": {"arrival": "trace", "trace_file": str(trace),
                     "prompt": {"max_tokens": pool_tokens}},
        "compute": {"model": str(compute_path), "transport": "in-process",
                    "serial_workers": True, "prefill_chunk_tokens": CHUNK_TOKENS},
        "link": {"message_latency_s": 0.0, "write_latency_s": 0.0},
        "timeouts": {"lease_s": 60.0, "transfer_timeout_s": 600.0},
    }, where="the fidelity scenario")
    sim = Simulation(scenario)
    steps: list[tuple[float, int]] = []
    delay = sim.compute.decode_delay_s

    def recorded(now, batch, context_tokens):
        seconds = delay(now, batch, context_tokens)
        steps.append((seconds, batch))
        return seconds
    sim.compute.decode_delay_s = recorded
    sim.run()
    metrics = sim.folder.metrics
    answers = metrics.summary()["outcomes"]
    assert answers == {"Ok": len(requests)}, f"simulated requests did not all succeed: {answers}"
    itl = [seconds for seconds, batch in steps for _ in range(batch)]
    return list(metrics.ttft_s), itl


# -- calibration --------------------------------------------------------------------------------

def calibrate_for(model, model_name: str, requests, path: Path, repeats: int,
                  batch_max: int) -> None:
    from engine.calibrate import Grid, calibrate
    from sim.compute import CalibratedTables, write_compute_file

    longest_prompt = max(p for _, p, _ in requests)
    longest_context = max(p + o for _, p, o in requests)
    prompts = sorted({16, 64} | {t for t in (128, 256, 512, 1024, 2048) if t < longest_prompt}
                     | {longest_prompt})
    contexts = sorted({16} | {t for t in (64, 256, 1024, 4096) if t < longest_context}
                      | {longest_context})
    batches = sorted({1, 2} | {b for b in (4, 8, 16, 32, 64) if b < batch_max} | {batch_max})
    grid = Grid(prompt_tokens=tuple(prompts), chunk_tokens=(CHUNK_TOKENS,),
                batch_sizes=tuple(batches), context_tokens=tuple(contexts),
                page_tokens=PAGE_TOKENS, repeats=repeats)
    print(f"calibrating: {grid.cells} cells x {repeats} repeats", flush=True)
    data = calibrate(model, grid, model_name, progress=lambda line: print("  " + line,
                                                                          flush=True))
    write_compute_file(path, CalibratedTables.model_validate(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: "
                        "the default model)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: api/engine_options.py's rule)")
    parser.add_argument("--workers", type=workers_of, default=(1, 1), metavar="PxD")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rate", type=float, default=None,
                        help="arrivals per second (default: from --load)")
    parser.add_argument("--load", type=float, default=0.4,
                        help="offered load, a fraction of what the calibrated tables say "
                             "one worker pair serves (default 0.4); --rate overrides it")
    parser.add_argument("--prompt-tokens", type=span, default=(32, 96), metavar="MIN,MAX")
    parser.add_argument("--output-tokens", type=span, default=(4, 12), metavar="MIN,MAX")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--compute", default=None, metavar="FILE",
                        help="a compute model file to use instead of calibrating here")
    parser.add_argument("--repeats", type=int, default=3, help="calibration repeats per cell")
    parser.add_argument("--batch-max", type=int, default=8,
                        help="calibration: the largest decode batch measured (default 8; "
                             "larger batches are extrapolated)")
    parser.add_argument("--seconds-max", type=float, default=600.0,
                        help="bound on the engine run (default 600)")
    args = parser.parse_args()
    assert args.requests >= 1 and (args.rate or 1) > 0 and args.load > 0 and args.repeats >= 1

    from api.engine_options import set_threads
    from engine.load import load_model

    print(f"seed {args.seed}; load average at start: {load_average()}", flush=True)
    threads = set_threads(args.threads)
    loaded = load_model(args.model)
    print(f"model {loaded.path.name}, {loaded.model.dtype}, torch threads {threads}; "
          f"workers {args.workers[0]}x{args.workers[1]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvproof-fidelity-") as tmp:
        folder = Path(tmp)
        compute = Path(args.compute) if args.compute else folder / "compute.toml"
        if not args.compute:
            calibrate_for(loaded.model, loaded.path.name, requests_of(args, 1.0), compute,
                          args.repeats, args.batch_max)
        rate = args.rate or rate_for_load(args, compute)
        requests = requests_of(args, rate)
        print(f"{len(requests)} requests at {rate:.3g}/s"
              + ("" if args.rate else f" (offered load {args.load:g} by the calibration)")
              + f" over {requests[-1][0]:.1f} s, prompts {args.prompt_tokens[0]}.."
              f"{args.prompt_tokens[1]}, outputs {args.output_tokens[0]}.."
              f"{args.output_tokens[1]} tokens", flush=True)
        print("engine run ...", flush=True)
        engine_ttft, engine_itl, wall_s, spent = run_engine(loaded.model, requests,
                                                            args.workers, args.seconds_max)
        print(f"engine run: {wall_s:.1f} s wall; simulating ...", flush=True)
        sim_ttft, sim_itl = run_sim(requests, args.workers, compute, folder, args.seed)
        print_table(engine_ttft, engine_itl, sim_ttft, sim_itl)
        explain_engine(spent, compute)
        if spent["decode"] and spent["prefill"]:
            again_ttft, again_itl = run_sim(requests, args.workers,
                                            rescaled(compute, spent, folder), folder, args.seed)
            print("\ndiagnosis only: the simulator again, its tables scaled by the engine run's "
                  "median step ratios above\n(the machine's drift between calibration and run "
                  "taken out; what is left is the model's error):")
            print_table(engine_ttft, engine_itl, again_ttft, again_itl)
    print(f"load average at end: {load_average()}")
    words = [f"python bench/sim_fidelity.py --seed {args.seed} --requests {args.requests} "
             + (f"--rate {args.rate:g}" if args.rate else f"--load {args.load:g}")
             + f" --workers {args.workers[0]}x{args.workers[1]} "
             f"--prompt-tokens {args.prompt_tokens[0]},{args.prompt_tokens[1]} "
             f"--output-tokens {args.output_tokens[0]},{args.output_tokens[1]}"]
    if args.model:
        words.append(f"--model {args.model}")
    if args.threads:
        words.append(f"--threads {args.threads}")
    print("rerun (on a quiet machine): " + " ".join(words))


def print_table(engine_ttft, engine_itl, sim_ttft, sim_itl) -> None:
    print(f"\n{'latency (ms)':<14}{'':>4}{'engine':>10}{'sim':>10}{'error':>9}   samples "
          "engine/sim")
    for name, real, model in (("TTFT", engine_ttft, sim_ttft), ("inter-token", engine_itl,
                                                                 sim_itl)):
        e, s = percentiles(real), percentiles(model)
        for q in (50, 90, 99):
            error = (s[q] - e[q]) / e[q] if e[q] else float("nan")
            print(f"{name if q == 50 else '':<14}p{q:<3}{e[q] * 1e3:10.1f}{s[q] * 1e3:10.1f}"
                  f"{error:+9.1%}" + (f"   {len(real)}/{len(model)}" if q == 50 else ""))


if __name__ == "__main__":
    main()
