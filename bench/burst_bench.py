"""A burst of concurrent requests, and a prompt at the verified context, against `kvproof serve`.

    python bench/burst_bench.py                    # default model: 400 at once, max_tokens 1
    python bench/burst_bench.py --burst 100 --long-only
    python bench/burst_bench.py --burst-only
    python bench/burst_bench.py --model path/to/model.gguf --serve-arg=--lease-s=60

Starts `kvproof serve` (a subprocess, 127.0.0.1, a free port) and prints the context it
verified at startup (the banner's "context verified" line). Then:

1. The long prompt: one chat request whose prompt fills the verified context (less the
   template and max_tokens 3), sent while --streams other requests stream; it must succeed,
   however long its prefill takes (decode's deadline is a lease the prefill renews).
2. The burst: --burst chat requests (max_tokens 1) sent at once. Admission answers each at
   once with 503 + Retry-After or admits it, and an admitted request is never failed for
   having waited: the target is no 504 at all, and the 503s answered in < 50 ms.

Prints counts by status and p50/p99 latency of the 503s and the 200s, measured from sending
each request to its whole answer. Every wait is bounded (RUN_S_MAX) and the server is
stopped with SIGTERM at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_START_S_MAX = 300
RUN_S_MAX = 900
STREAMS_START_S = 5.0
CONNECTIONS_SETTLE_S = 1.0  # for the server to accept the burst's connections before it
SO_TIMESTAMPNS = 35  # Linux's option number (the socket module does not name it)


class Server:
    """`kvproof serve` in a subprocess on a free port; its banner lines are kept."""

    def __init__(self, extra: list[str]):
        command = [sys.executable, "-m", "api.cli", "serve", "--port", "0", "--drain-s", "0",
                   *extra]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        env=os.environ | {"PYTHONUNBUFFERED": "1"})
        self.url, self.banner = None, []
        deadline = time.monotonic() + SERVER_START_S_MAX
        for line in self.process.stdout:
            self.banner.append(line.rstrip())
            if " at http://" in line:
                self.url = line.split(" at ", 1)[1].split(" ", 1)[0]
            if self.url and line.startswith("  curl"):
                break
            if time.monotonic() > deadline:
                break
        if not self.url:
            self.close()
            raise SystemExit("kvproof serve did not start:\n" + "\n".join(self.banner))
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


async def one(client, url: str, content: str, max_tokens: int) -> tuple[int, float, str]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}
    import httpx

    sent = time.perf_counter()
    try:
        response = await client.post(f"{url}/v1/chat/completions", json=body)
    except httpx.HTTPError as error:  # counted, never fatal: a dropped connection is a finding
        return 0, time.perf_counter() - sent, type(error).__name__
    code = ""
    if response.status_code != 200:
        code = response.json().get("error", {}).get("code") or ""
    return response.status_code, time.perf_counter() - sent, code


def context_of(url: str) -> int:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["context_length"]


def long_prompt(model: str | None, context: int, max_tokens: int) -> str:
    """Words whose chat prompt, with the model's own tokenizer and template, leaves exactly
    max_tokens + 8 tokens of the context free (the 8 for a template that differs)."""
    from engine.load import load_tokenizer

    tokenizer = load_tokenizer(model)
    words = context
    for _ in range(20):
        text = " ".join(["apple"] * words)
        tokens = len(tokenizer.encode_chat(text))
        room = context - max_tokens - 8 - tokens
        if 0 <= room < 16:
            return text
        words += room if room < 0 else room // 2
    return text


async def long_part(url: str, args) -> None:
    """The prompt at the verified context, sent while --streams others are decoding."""
    import httpx

    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=RUN_S_MAX, limits=limits) as client:
        context = context_of(url)
        text = long_prompt(args.model, context, 3)
        print(f"long prompt: {len(text.split())} words at a verified context of {context} "
              f"tokens, beside {args.streams} streams of 32 tokens", flush=True)
        began = time.perf_counter()
        others = [asyncio.create_task(one(client, url, "Tell me about the sea.", 32))
                  for _ in range(args.streams)]
        await asyncio.sleep(STREAMS_START_S)  # the others are decoding when it arrives
        status, seconds, code = await one(client, url, text, 3)
        others = await asyncio.gather(*others)
        print(f"  long prompt: {status} {code} in {seconds:.1f} s; the others: "
              f"{dict(Counter(s for s, _, _ in others))} (all done in "
              f"{time.perf_counter() - began:.1f} s)", flush=True)


async def run(url: str, args) -> None:
    if not args.burst_only:
        await long_part(url, args)
        if args.long_only:
            return
    print(f"burst: {args.burst} chat requests at once, max_tokens 1, over connections "
          "opened beforehand", flush=True)
    began = time.perf_counter()
    burst = raw_burst(url, args.burst)
    wall = time.perf_counter() - began
    by_status = Counter(s for s, _, _ in burst)
    print(f"  {args.burst} answered in {wall:.1f} s: by status "
          f"{dict(sorted(by_status.items()))}, codes "
          f"{dict(Counter(c for s, _, c in burst if s != 200))}", flush=True)
    for status in sorted(by_status):
        latencies = [t for s, t, _ in burst if s == status]
        print(f"  {status}: p50 {percentile(latencies, 0.5) * 1000:.0f} ms, p99 "
              f"{percentile(latencies, 0.99) * 1000:.0f} ms (n={len(latencies)})",
              flush=True)
    print(f"  504s: {by_status.get(504, 0)} (target 0); 503 p99 "
          f"{percentile([t for s, t, _ in burst if s == 503], 0.99) * 1000:.0f} ms "
          "(target < 50 ms)", flush=True)


def raw_burst(url: str, count: int) -> list[tuple[int, float, str]]:
    """`count` chat requests written at once on connections opened beforehand (and given
    CONNECTIONS_SETTLE_S to be accepted: a client's pool holds its connections before its
    burst), answers read as they come (one selector, no HTTP client). Each latency is from
    the moment its request was written to the kernel's receive timestamp (SO_TIMESTAMPNS)
    of the last packet of its answer, so it measures the server, not this client's one
    thread writing 400 requests and then reading 400 answers on the same two cores: read
    from the clock after recv instead, an answer sent at 30 ms was seen at 70 ms when this
    process was late to read it (every latency then equal, p50 = p99)."""
    import json
    import selectors
    import socket
    import struct

    host, port = url.split("://", 1)[1].split(":")
    sockets = [socket.create_connection((host, int(port)), timeout=RUN_S_MAX)
               for _ in range(count)]
    for sock in sockets:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    time.sleep(CONNECTIONS_SETTLE_S)
    requests = []
    for i in range(count):
        body = json.dumps({"messages": [{"role": "user", "content": f"Say a number: {i}"}],
                           "max_tokens": 1, "temperature": 0}).encode()
        requests.append(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                        b"Content-Type: application/json\r\nConnection: close\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    selector = selectors.DefaultSelector()
    sent_ns, received, landed_ns = {}, {}, {}
    for index, (sock, request) in enumerate(zip(sockets, requests)):
        sock.sendall(request)
        sent_ns[index] = time.time_ns()  # the kernel's timestamps are on the same clock
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, index)
        received[index] = b""
    done: dict[int, float] = {}
    deadline = time.monotonic() + RUN_S_MAX
    while len(done) < count and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1.0):
            index = key.data
            chunk, ancillary, _, _ = key.fileobj.recvmsg(65536, socket.CMSG_SPACE(16))
            if chunk:
                received[index] += chunk
                for level, kind, data in ancillary:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                        seconds, nanoseconds = struct.unpack("qq", data[:16])
                        landed_ns[index] = seconds * 1_000_000_000 + nanoseconds
                landed_ns.setdefault(index, time.time_ns())  # no timestamp: when read
                continue
            done[index] = (landed_ns.get(index, time.time_ns()) - sent_ns[index]) / 1e9
            selector.unregister(key.fileobj)
            key.fileobj.close()
    out = []
    for index in range(count):
        head, _, body = received[index].partition(b"\r\n\r\n")
        status = int(head.split()[1]) if head else 0
        code = ""
        if status not in (0, 200):
            try:
                code = json.loads(body).get("error", {}).get("code") or ""
            except ValueError:
                code = "?"
        out.append((status, done.get(index, float("nan")), code))
    for sock in sockets:
        sock.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--burst", type=int, default=400)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-only", action="store_true")
    parser.add_argument("--burst-only", action="store_true")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="an extra `kvproof serve` argument (repeatable)")
    args = parser.parse_args()
    if not 1 <= args.burst <= 2000 or not 0 <= args.streams <= 64:
        parser.error("--burst is 1..2000 and --streams 0..64")
    extra = (["--model", args.model] if args.model else []) + args.serve_arg
    server = Server(extra)
    try:
        for line in server.banner:
            if line.startswith(("kvproof serve:", "  context verified")):
                print(line, flush=True)
        asyncio.run(asyncio.wait_for(run(server.url, args), RUN_S_MAX))
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
