"""Page-write bandwidth through engine/dist_transport.py against raw gloo send/recv of the
same bytes, between the same two processes on 127.0.0.1, in one run.

    python bench/transport_bench.py                       # 64 pages of 720 KiB, 7 repeats
    python bench/transport_bench.py --page-kib 64 --pages 256 --window 64
    python bench/transport_bench.py --repeats 3 --pages 16     # a quick look
    python bench/transport_bench.py --pages 256 --page-kib 180 --batch-max 16  # pipelined

Part 1 of issue 29's transport bench. Each repeat moves `--pages` pages from the prefill
process's KVPool into the decode process's, twice, in alternating order so a neighbour's
load hits both alike: RAW, every page isend / irecv at once (posted together, then waited:
gloo's best case, bytes in flight back to back), and TRANSPORT, the same pages posted as
page writes (`post`), seen by decode (`wait_ready`), landed one by one (`land`, which posts
the page's receive only then, so the prefill's gloo thread reads the source page at landing:
one round trip per page on top of the bytes) and their completions back at the prefill.
ARRIVAL is the same through a transport with `read_at="arrival"`: the decode posts each
page's receive when its header arrives, into a staging slot, and `land` copies it into the
pool (bytes move back to back, as in RAW, plus one copy per page).
BATCH is the transport as the engine's loop uses it since batches (engine/loop.py): the
prefill posts the pages with one `post_many` (one header message per run of `--batch-max`
writes, each page still its own send from the pool), the decode lands each `wait_ready()`
with one `land_many` (every page's receive posted before any wait: read at landing, one
round trip per batch), completions back per `--batch-max` landed; BATCH_ARRIVAL the same
with `read_at="arrival"`.
RAW_SERIAL is raw with decode's receives posted one at a time, each after the last completed:
the landing's round trip with no transport code, which splits the gap into what reading at
landing costs and what the transport's own bookkeeping costs. Each is timed on the decode
side, from a barrier to the last page in its pool. Prints the median GiB/s of each and the
ratio of medians to raw (target >= 0.8), and for the batched kinds also the median of the
per-repeat ratios (each repeat's batch against that repeat's raw, measured next to it: less
sensitive to a neighbour's load drifting over the run). The default page is the default model's
(SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, 16 tokens, fp32: 720 KiB).

Part 2, after part 1 in the same run (bench/serving_processes.py): serving through a router,
a prefill and a decode process (engine/processes.py on the real data path) against the
in-process engine, `--streams` streams (32) on the default model: tokens/s and TTFT p50/p99.
`--streams 0` skips it; `--serving-only` skips part 1.

    python bench/transport_bench.py --serving-only --streams 32 --max-tokens 32
The machine this was written on is shared: read the ratio, and rerun on a quiet machine.
Bounded: `--time-s-max` stops the repeats early (the medians are over those run), every
transport wait has a timeout, and the test harness kills both processes past its limit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

GIB = float(1 << 30)
KINDS = ("raw", "raw_serial", "transport", "arrival", "batch", "batch_arrival")


def pool(pages: int, page_kib: int):
    from engine.pool import KVPool, PoolConfig
    # one layer, K|V, one head, fp32: page_kib KiB of head_dim 64 rows
    tokens = page_kib * 1024 // (2 * 64 * 4)
    return KVPool(PoolConfig(num_pages=pages, page_tokens=tokens, num_layers=1,
                             num_kv_heads=1, head_dim=64))


def side(rank: int, port: int, args, results) -> None:
    try:
        run_side(rank, port, args, results)
    except BaseException as error:  # noqa: BLE001 -- reported, the parent prints it and fails
        results.put(("error", f"rank {rank}: {type(error).__name__}: {error}"))
    results.close()
    results.join_thread()
    os._exit(0)


def run_side(rank: int, port: int, args, results) -> None:
    import torch.distributed as dist

    from engine.dist_transport import DistTransport, DistTransportConfig
    from engine.transport import PageWrite
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    kv = pool(args.pages, args.page_kib)
    kv.kv.normal_()
    role = "prefill" if rank == 0 else "decode"
    transports = {}
    for kind, read_at in (("transport", "landing"), ("arrival", "arrival"),
                          ("batch", "landing"), ("batch_arrival", "arrival")):
        transports[kind] = DistTransport(kv, DistTransportConfig(
            role, 0, ((0, 1 - rank),), writes_in_flight_max=args.window,
            timeout_s=args.timeout_s, read_at=read_at, batch_max=args.batch_max),
            group=dist.new_group([0, 1], backend="gloo"))
    pages = range(args.pages)
    views = [kv.kv[p].reshape(-1).view(torch.uint8) for p in pages]
    started_run = time.monotonic()
    for repeat in range(args.repeats):
        order = KINDS if repeat % 2 == 0 else KINDS[::-1]
        for kind in order:
            dist.barrier()
            started = time.perf_counter()
            if kind == "raw":
                op = dist.isend if rank == 0 else dist.irecv
                works = [op(view, 1 - rank, tag=1000 + p) for p, view in zip(pages, views)]
                for work in works:
                    work.wait()
            elif kind == "raw_serial" and rank == 0:
                for work in [dist.isend(view, 1, tag=1000 + p) for p, view in zip(pages, views)]:
                    work.wait()
            elif kind == "raw_serial":
                for p, view in zip(pages, views):
                    dist.irecv(view, 0, tag=1000 + p).wait()
            elif rank == 0:
                transport = transports[kind]
                writes = [PageWrite(1, p, p, 1, 0, 0, 0) for p in pages]
                if kind.startswith("batch"):
                    transport.post_many(writes)
                for write in writes if not kind.startswith("batch") else ():
                    transport.post(write)
                done = 0
                while done < args.pages:
                    done += len(transport.wait_completed(args.timeout_s))
            else:
                transport = transports[kind]
                landed = 0
                while landed < args.pages:
                    ready = transport.wait_ready(args.timeout_s)
                    if kind.startswith("batch"):
                        transport.land_many(ready)
                        landed += len(ready)
                        continue
                    for write in ready:
                        transport.land(write)
                        landed += 1
            seconds = time.perf_counter() - started
            if rank == 1:
                results.put((kind, seconds))
        dist.barrier()
        stop = torch.tensor([time.monotonic() - started_run > args.time_s_max], dtype=torch.int64)
        dist.broadcast(stop, 1)
        if stop.item():
            break


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-kib", type=int, default=720)
    parser.add_argument("--window", type=int, default=64, help="writes_in_flight_max")
    parser.add_argument("--batch-max", type=int, default=64,
                        help="entries per control message (DistTransportConfig.batch_max)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--time-s-max", type=float, default=120.0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=32, help="part 2's streams (0: skip)")
    parser.add_argument("--max-tokens", type=int, default=32, help="part 2: outputs a stream")
    parser.add_argument("--model", default="", help="part 2's model (default: the default)")
    parser.add_argument("--threads", type=int, default=1,
                        help="part 2: the in-process engine's torch threads")
    parser.add_argument("--seed", type=int, default=0, help="part 2's prompts")
    parser.add_argument("--serving-only", action="store_true", help="skip part 1")
    args = parser.parse_args()
    if args.streams < 0 or args.max_tokens < 1 or args.threads < 1:
        parser.error("--streams must be >= 0, --max-tokens and --threads positive")
    code = 0 if args.serving_only else bandwidth(args, parser)
    if code == 0 and args.streams:
        code = part_two(args)
    return code


def part_two(args) -> int:
    from bench.serving_processes import serving
    from engine.load import default_model_path
    model = args.model or str(default_model_path())
    return serving(model, args.streams, args.max_tokens, args.seed, 16, args.threads,
                   max(args.timeout_s, 120.0))


def bandwidth(args, parser) -> int:
    if args.pages < 1 or args.page_kib < 1 or args.repeats < 1 or args.window < 1:
        parser.error("--pages, --page-kib, --repeats and --window must be positive")
    if args.page_kib * 1024 % (2 * 64 * 4):
        parser.error("--page-kib must be a multiple of 0.5 (pages are rows of 512 bytes)")
    moved_gib = args.pages * args.page_kib * 1024 / GIB
    print(f"{args.pages} pages of {args.page_kib} KiB ({moved_gib * 1024:.0f} MiB) per repeat, "
          f"window {args.window}, up to {args.repeats} repeats / {args.time_s_max:.0f} s",
          flush=True)
    # One torch thread per process: a page copy split over OpenMP threads on a shared machine
    # waits for a descheduled thread (measured: landings stalling 100+ ms at read_at=arrival).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=side, args=(rank, port, args, results))
                 for rank in (0, 1)]
    for process in processes:
        process.start()
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    deadline = time.monotonic() + args.time_s_max + 2 * args.timeout_s + 60
    failed = ""
    try:
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            try:
                kind, value = results.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "error":
                failed = value
                break
            seconds[kind].append(value)
            print(f"  {kind:10} repeat {len(seconds[kind])}: {moved_gib / value:6.2f} GiB/s",
                  flush=True)
    finally:
        for process in processes:
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
    if failed or not all(seconds.values()):
        print(f"failed: {failed or 'no figures came back'}")
        return 1
    raw = moved_gib / statistics.median(seconds["raw"])
    through = moved_gib / statistics.median(seconds["transport"])
    serial = moved_gib / statistics.median(seconds["raw_serial"])
    print(f"raw gloo send/recv: {raw:.2f} GiB/s (median of {len(seconds['raw'])})")
    print(f"raw, each receive posted after the last one completed (the landing's round trip, "
          f"no transport): {serial:.2f} GiB/s, ratio {serial / raw:.2f}")
    arrival = moved_gib / statistics.median(seconds["arrival"])
    print(f"through DistTransport, read at landing: {through:.2f} GiB/s "
          f"(median of {len(seconds['transport'])}), ratio to raw {through / raw:.2f}")
    print(f"through DistTransport, read at arrival: {arrival:.2f} GiB/s "
          f"(median of {len(seconds['arrival'])}), ratio to raw {arrival / raw:.2f}")
    batch = moved_gib / statistics.median(seconds["batch"])
    batch_arrival = moved_gib / statistics.median(seconds["batch_arrival"])
    print(f"through DistTransport, each ready() landed as one batch (land_many), read at "
          f"landing: {batch:.2f} GiB/s, ratio to raw {batch / raw:.2f}; read at arrival: "
          f"{batch_arrival:.2f} GiB/s, ratio {batch_arrival / raw:.2f}")
    paired = {kind: statistics.median(r / b for r, b in zip(seconds["raw"], seconds[kind]))
              for kind in ("batch", "batch_arrival")}
    print(f"batched, median of per-repeat ratios to raw: {paired['batch']:.2f} at landing, "
          f"{paired['batch_arrival']:.2f} at arrival")
    print(f"ratio transport / raw (target >= 0.80): {through / raw:.2f} at landing, "
          f"{arrival / raw:.2f} at arrival; batched {batch / raw:.2f} at landing, "
          f"{batch_arrival / raw:.2f} at arrival")
    return 0


if __name__ == "__main__":
    sys.exit(main())
