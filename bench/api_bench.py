"""The HTTP server next to the engine called directly, on the same workload.

    python bench/api_bench.py                 # default model, 32 streams x 64 tokens, 3 repeats
    python bench/api_bench.py --quick         # 32 streams x 16 tokens, 1 repeat
    python bench/api_bench.py --streams 8 --max-tokens 32 --model path/to/model.gguf

Prints, for each side, generated tokens per second and time to first token (p50, p99) at
N concurrent streams, the medians over repeats, and the HTTP/direct ratios. The sides
alternate repeat by repeat, so a neighbour's load on a shared machine hits both alike:
read the ratios, not the absolute figures.

How each side is timed. Direct: every request tokenized (the chat template) and submitted
in one loop to an engine in this process; TTFT from the start of that loop to the
request's first TokenOut, tokens/s over the wall time from the start of the loop to the
last Finished. HTTP: `kvproof serve` in a subprocess (its own engine, the same model), N
streaming chat/completions clients over httpx in this process, all sent at once; TTFT from
sending the request to the first content chunk, tokens from each stream's final usage
chunk, over the wall time of the whole batch. Both TTFTs count from the moment the batch
was released, and both include tokenizing it (the server tokenizes what it receives). Greedy decoding, the same prompts: both sides
generate the same tokens.

The engine is the protocol-driven one (engine.serving.build_engine) on both sides, with
the same EngineConfig.

A third line, "HTTP, null engine", serves the same streams over an engine that computes
nothing (`NullEngine`: each loop turn hands every live request its next token at once), so
its tokens/s is the ceiling of the serving stack itself (event-loop handoff, JSON, SSE,
uvicorn, and the client reading it): its inverse is what HTTP costs a token, and that cost
times the direct tokens/s is the share of the time a real engine loses to HTTP. On a busy
shared machine that figure is steadier than the difference of two noisy throughputs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TQDM_DISABLE", "1")

PROMPTS = ("Tell me about the sea.", "Write a short poem about autumn.",
           "What is the capital of France?", "Explain how a bicycle works.")
SERVER_START_S_MAX = 120
NULL_TOKENS_FACTOR = 8  # the null engine's streams are this much longer: it is that fast
RUN_S_MAX = 600


def workload(streams: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(streams)]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def run_direct(engine, prompts: list[str], max_tokens: int) -> dict:
    from engine.sampling import SamplingParams
    from engine.service import Finished, GenerationRequest

    tokenizer = engine.tokenizer
    done = threading.Event()
    first_s: dict[int, float] = {}
    tokens = {"count": 0, "finished": 0}
    lock = threading.Lock()
    started = time.perf_counter()

    def on_event(index: int, event) -> None:
        with lock:
            if isinstance(event, Finished):
                assert event.outcome == "Ok", event
                tokens["finished"] += 1
                if tokens["finished"] == len(prompts):
                    done.set()
            else:
                tokens["count"] += 1
                first_s.setdefault(index, time.perf_counter() - started)

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for index, prompt in enumerate(prompts):
        ids = tuple(tokenizer.backend.encode(tokenizer.render_chat(
            [{"role": "user", "content": prompt}]), add_special_tokens=False).ids)
        engine.submit(GenerationRequest(ids, sampling),
                      lambda event, index=index: on_event(index, event))
    assert done.wait(RUN_S_MAX), "the direct run did not finish"
    wall_s = time.perf_counter() - started
    return {"tokens": tokens["count"], "wall_s": wall_s, "ttft_s": list(first_s.values())}


async def _stream(client, url: str, prompt: str, max_tokens: int) -> tuple[float | None, int]:
    import json

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, completion_tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    return first, completion_tokens


class HttpClients:
    """One event loop and one connection pool for every HTTP run, kept warm between runs."""

    def __init__(self, streams: int):
        import httpx

        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(timeout=RUN_S_MAX,
                                        limits=httpx.Limits(max_connections=streams))

    def run(self, url: str, prompts: list[str], max_tokens: int) -> list:
        async def batch():
            return await asyncio.gather(*(_stream(self.client, url, p, max_tokens)
                                          for p in prompts))

        return self.loop.run_until_complete(batch())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


def run_http(clients: HttpClients, url: str, prompts: list[str], max_tokens: int) -> dict:
    started = time.perf_counter()
    results = clients.run(url, prompts, max_tokens)
    wall_s = time.perf_counter() - started
    return {"tokens": sum(n for _f, n in results), "wall_s": wall_s,
            "ttft_s": [f for f, _n in results if f is not None]}


class NullEngine:
    """engine.service.Engine computing nothing: each loop turn gives every live request one
    token (the same token), and a request ends Ok after max_tokens of them."""

    def __init__(self, loaded):
        from engine.service import Snapshot

        self.model_name, self.tokenizer = loaded.path.stem, loaded.tokenizer
        self.context_length = loaded.model.config.max_position_embeddings
        self.token_id = loaded.tokenizer.encode("a")[-1]
        self.text = loaded.tokenizer.decode([self.token_id])
        self._snapshot = Snapshot(pools=(), queued=0, running=0, recent=())
        self._lock, self._wake = threading.Lock(), threading.Event()
        self._inbox, self._aborts, self._live = [], set(), {}
        self._next_id, self._quit = 0, False
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request, on_event) -> int:
        with self._lock:
            r, self._next_id = self._next_id, self._next_id + 1
            self._inbox.append((r, request, on_event))
        self._wake.set()
        return r

    def abort(self, request_id: int) -> None:
        with self._lock:
            self._aborts.add(request_id)
        self._wake.set()

    def snapshot(self):
        return self._snapshot

    def stop(self, drain_s: float = 0.0) -> None:
        self._quit = True
        self._wake.set()
        self._thread.join(10)

    def _loop(self) -> None:
        from engine.service import Finished, TokenOut

        while not self._quit:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            for r, request, on_event in inbox:
                self._live[r] = [request, on_event, 0]
            for r in aborts & self._live.keys():
                request, on_event, count = self._live.pop(r)
                on_event(Finished(r, "Gone", None, None, len(request.prompt_ids), count))
            for r, entry in list(self._live.items()):
                request, on_event, count = entry
                entry[2] = count = count + 1
                on_event(TokenOut(r, self.token_id, self.text))
                if count == request.sampling.max_tokens:
                    del self._live[r]
                    on_event(Finished(r, "Ok", "length", None, len(request.prompt_ids), count))
            if not self._live:
                self._wake.wait(0.05)
                self._wake.clear()


def build_null_engine(loaded, config=None) -> NullEngine:
    """For `kvproof serve --engine-factory bench.api_bench:build_null_engine`."""
    return NullEngine(loaded)


class Server:
    """`kvproof serve` in a subprocess on a free port."""

    def __init__(self, model: str | None, device: str, dtype: str, factory: str | None = None):
        command = [sys.executable, "-m", "api.cli", "serve", "--port", "0", "--device", device,
                   "--dtype", dtype, "--drain-s", "0"]
        if factory:
            command += ["--engine-factory", factory]
        if model:
            command += ["--model", model]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        env=os.environ | {"PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + SERVER_START_S_MAX
        self.url = None
        for line in self.process.stdout:
            if " at http://" in line:
                self.url = line.split(" at ", 1)[1].split(" ", 1)[0]
                break
            assert time.monotonic() < deadline, "kvproof serve did not start"
        assert self.url, "kvproof serve exited: " + (self.process.stdout.read() or "")
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def engine_timings(recent, count: int) -> dict:
    """From the newest `count` requests' protocol timelines: how spread out their arrivals
    were, and the engine's own TTFT p50 (Accept, when decode starts with the prefill's first
    token, after the batch's first Arrive): the engine's share of TTFT, without the client
    and the HTTP path."""
    timelines = [request["timeline"] if isinstance(request, dict) else request.timeline
                 for request in list(recent)[-count:]]
    arrivals = [timeline[0][0] for timeline in timelines]
    accepts = [next(at for at, action in timeline if action.startswith("Accept"))
               - min(arrivals) for timeline in timelines]
    return {"arrival_spread_s": max(arrivals) - min(arrivals),
            "engine_ttft_s": statistics.median(accepts)}


def summary(runs: list[dict]) -> dict:
    return {"arrival_spread_s": statistics.median(r.get("arrival_spread_s", 0) for r in runs),
            "engine_ttft_s": statistics.median(r.get("engine_ttft_s", 0) for r in runs),
            "tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
            "ttft_p50_s": statistics.median(percentile(r["ttft_s"], 0.5) for r in runs),
            "ttft_p99_s": statistics.median(percentile(r["ttft_s"], 0.99) for r in runs),
            "tokens": runs[0]["tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="16 tokens a stream, 1 repeat")
    args = parser.parse_args()
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)

    import httpx

    from engine.load import load_model
    from engine.serving import EngineConfig, build_engine

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = build_engine(loaded, EngineConfig())
    engine.start()
    server = Server(args.model, args.device, args.dtype)
    null_server = Server(args.model, args.device, args.dtype,
                         factory="bench.api_bench:build_null_engine")
    prompts = workload(args.streams)
    print(f"{loaded.path.name} on {args.device} ({args.dtype}); {args.streams} concurrent "
          f"streams x {max_tokens} tokens (greedy), {repeats} repeat(s), sides alternating")
    direct, http, null = [], [], []
    null_tokens = max_tokens * NULL_TOKENS_FACTOR
    clients = HttpClients(args.streams)
    try:
        run_http(clients, server.url, prompts, 2)  # warm both sides: first-call costs out, and
        run_direct(engine, prompts, 2)     # the client's connection pool filled
        run_http(clients, null_server.url, prompts, 2)
        for _ in range(repeats):
            direct.append(run_direct(engine, prompts, max_tokens))
            direct[-1] |= engine_timings(engine.snapshot().recent, len(prompts))
            http.append(run_http(clients, server.url, prompts, max_tokens))
            state = httpx.get(f"{server.url}/v1/kvproof/state", timeout=60).json()
            http[-1] |= engine_timings(state["recent"], len(prompts))
            null.append(run_http(clients, null_server.url, prompts, null_tokens))
    finally:
        clients.close()
        server.close()
        null_server.close()
        engine.stop(0)
    d, h, z = summary(direct), summary(http), summary(null)
    print(f"{'':18}{'tokens/s':>12}{'TTFT p50':>12}{'TTFT p99':>12}{'tokens':>9}"
          f"{'arrivals over':>15}{'engine TTFT p50':>17}")
    for name, s in (("direct", d), ("HTTP", h), ("HTTP, null engine", z)):
        spread = (f"{s['arrival_spread_s'] * 1000:>13.0f}ms{s['engine_ttft_s'] * 1000:>15.0f}ms"
                  if name != "HTTP, null engine" else "")
        print(f"{name:18}{s['tokens_per_s']:>12,.1f}{s['ttft_p50_s'] * 1000:>10.0f}ms"
              f"{s['ttft_p99_s'] * 1000:>10.0f}ms{s['tokens']:>9}{spread}")
    print(f"HTTP/direct: tokens/s x{h['tokens_per_s'] / d['tokens_per_s']:.3f}, TTFT p50 "
          f"x{h['ttft_p50_s'] / d['ttft_p50_s']:.2f}, TTFT p99 x{h['ttft_p99_s'] / d['ttft_p99_s']:.2f}"
          f" (each the median over {repeats} repeat(s))")
    pairs = sorted((hr["tokens"] / hr["wall_s"]) / (dr["tokens"] / dr["wall_s"])
                   for dr, hr in zip(direct, http))
    print(f"HTTP/direct tokens/s, repeat by repeat: {', '.join(f'{r:.3f}' for r in pairs)} "
          f"(median {statistics.median(pairs):.3f})")
    cost_us = 1e6 / z["tokens_per_s"]
    print(f"HTTP costs {cost_us:.0f} us a token (the null engine's ceiling); at the direct "
          f"{d['tokens_per_s']:,.1f} tokens/s that is {d['tokens_per_s'] * cost_us / 1e4:.2f}% "
          f"of the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
