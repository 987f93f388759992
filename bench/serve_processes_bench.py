"""`kvproof serve` with and without `--processes` on the default model, one after the other,
each as its own command (`python -m api.cli serve ... --port 0`): seconds to the curl line,
the resident memory of the server and every process it started, the capital-of-France
answer's latency (whole, greedy, `--repeats` times), and `--streams` concurrent greedy
completions of `--max-tokens` tokens (tokens/s, TTFT p50 from the stream).

    python bench/serve_processes_bench.py [--repeats 5] [--streams 8] [--max-tokens 32]
                                          [--prefill-workers N --decode-workers M]

(the worker counts are the --processes server's; the in-process one runs 1 x 1)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
START_S_MAX = 300


def rss_kib(pids) -> int:
    total = 0
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    return total


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def one_server(extra: list[str], args) -> dict:
    began = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--port", "0",
                               "--threads", "1", *extra], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=os.environ | {"PYTHONUNBUFFERED": "1",
                                                "PYTHONPATH": str(ROOT)})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(x.rstrip("\n") for x in server.stdout),
                     daemon=True).start()
    try:
        while not any("curl " in x for x in lines):
            assert server.poll() is None and time.monotonic() - began < START_S_MAX, lines
            time.sleep(0.05)
        start_s = time.monotonic() - began
        url = lines[0].split(" at ", 1)[1].split(" ", 1)[0]
        pids = [server.pid, *children(server.pid)]
        latencies, answer = [], ""
        for _ in range(args.repeats):
            t = time.monotonic()
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "messages": QUESTION, "max_tokens": 12, "temperature": 0}).json()
            latencies.append(time.monotonic() - t)
            answer = reply["choices"][0]["message"]["content"]
        streams = concurrent_streams(url, args)
        memory = rss_kib(pids)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        return {"start_s": start_s, "rss_mib": memory / 1024, "processes": len(pids),
                "answer": answer, "answer_s_p50": statistics.median(latencies), **streams}
    finally:
        if server.poll() is None:
            server.kill()


def concurrent_streams(url: str, args) -> dict:
    def one(k: int):
        t, first, tokens = time.monotonic(), None, 0
        with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={
                "prompt": f"Story {k}: once upon a time", "max_tokens": args.max_tokens,
                "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif first is None:
                        first = time.monotonic() - t
        return first, tokens
    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
        results = list(pool.map(one, range(args.streams)))
    span = time.monotonic() - t
    tokens = sum(n for _, n in results)
    return {"tokens": tokens, "tokens_per_s": tokens / span,
            "ttft_s_p50": statistics.median(f for f, _ in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    args = parser.parse_args()
    shape = ["--prefill-workers", str(args.prefill_workers), "--decode-workers",
             str(args.decode_workers)]
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    for name, extra in (("in-process", []), ("--processes", ["--processes", *shape])):
        out = one_server(extra, args)
        print(f"{name:12} " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else
                                        f"{k} {v!r}" for k, v in out.items()), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
