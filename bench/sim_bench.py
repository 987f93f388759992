"""Simulated requests per wall-second: the kvproof simulator next to a bare SimPy pipeline.

The cluster: 16 prefill and 16 decode workers, Poisson arrivals, lognormal prompt and output
lengths, 100,000 requests by default. The kvproof run hands every protocol event to the core
and runs every oracle after every event (page conservation and the invariants on what the
event touched, a full-cluster sweep at the end); no log file is written. The baseline is a
bare SimPy pipeline of the same shape, measured in the same run: the same arrivals, lengths,
router, prefill FIFO and compute time, decode page reservation (a counter) with FIFO waiting,
bootstrap/table/done messages with the same latency, the transfer-timeout timer, per-page writes through a
bandwidth-serialised NIC with the same in-flight bound, and the same continuous batching,
but no protocol core, no oracles and no bookkeeping of pages. The ratio says what the
protocol and its checks cost; the issue's target is at least 25%.

With `--baseline DIR` (a checkout of an older commit, e.g. `git worktree add /tmp/base
<commit>`), each repeat also runs that checkout's simulator on the same scenario, in a
subprocess, interleaved with the others, so that both commits are measured in one run on
one machine; the figures say how the two compare, and that both simulated the same run
(the same number of core events).

    python bench/sim_bench.py [--requests N] [--repeat K] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import simpy

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)

from sim.run import sample_tokens, simulate  # noqa: E402
from sim.scenario import Scenario, scenario_from_dict  # noqa: E402


def bench_scenario(requests: int) -> Scenario:
    return scenario_from_dict({
        "name": "bench-16x16", "seed": 1, "requests": requests,
        "cluster": {"prefill_workers": 16, "decode_workers": 16, "page_tokens": 256,
                    "prefill_pool_tokens": 262144, "decode_pool_tokens": 524288,
                    "context_tokens": 131072},
        "workload": {"rate_per_s": 120.0,
                     "prompt": {"median_tokens": 2048, "sigma": 1.0, "max_tokens": 131072},
                     "output": {"median_tokens": 128, "sigma": 0.8, "max_tokens": 2048}},
        # Decode's timer must cover the prefill of the longest admissible prompt (131,072
        # tokens at 20,000 tokens/s = 6.6 s), as in the default scenario: with the 5 s
        # default, fitting requests timed out and FittingRequestsSucceed (rightly) failed.
        "timeouts": {"transfer_timeout_s": 30.0}})


class BarePipeline:
    """The simulator's shape without the protocol: see the module docstring."""

    def __init__(self, sc: Scenario) -> None:
        self.sc, self.env = sc, simpy.Environment()
        c = sc.cluster
        self.rng_arrivals = random.Random(f"{sc.seed}:arrivals")
        self.rng_lengths = random.Random(f"{sc.seed}:lengths")
        self.page_s = c.page_tokens * sc.link.kv_bytes_per_token / sc.link.bandwidth_bytes_per_s
        self.queue = [deque() for _ in range(c.prefill_workers)]
        self.busy = [False] * c.prefill_workers
        self.nic_free_at = [0.0] * c.prefill_workers
        self.nic_in_flight = [0] * c.prefill_workers
        self.nic_waiting = [deque() for _ in range(c.prefill_workers)]
        self.free = [c.decode_pages] * c.decode_workers
        self.waiting = [deque() for _ in range(c.decode_workers)]
        self.batch = [[] for _ in range(c.decode_workers)]
        self.ready = [deque() for _ in range(c.decode_workers)]
        self.stepping = [False] * c.decode_workers
        self.done = 0
        self.next = 0
        self.rr = 0

    def later(self, delay: float, fn, *args) -> None:
        event = self.env.timeout(delay)
        event.callbacks.append(lambda _: fn(*args))

    def arrive(self) -> None:
        sc, c = self.sc, self.sc.cluster
        prompt = sample_tokens(self.rng_lengths, sc.workload.prompt)
        output = sample_tokens(self.rng_lengths, sc.workload.output)
        pages = -(-prompt // c.page_tokens)
        p = d = self.rr
        self.rr = (self.rr + 1) % c.prefill_workers
        req = {"pages": pages, "out": output, "p": p, "d": d, "gen": 0, "sent": 0,
               "landed": 0, "table": False, "computed": False}
        self.queue[p].append(req)
        self.kick_prefill(p)
        self.later(sc.link.message_latency_s, self.bootstrap, req)

    def bootstrap(self, req) -> None:
        self.waiting[req["d"]].append(req)
        self.kick_reserve(req["d"])

    def kick_reserve(self, d: int) -> None:
        waiting = self.waiting[d]
        while waiting and self.free[d] >= waiting[0]["pages"]:
            req = waiting.popleft()
            self.free[d] -= req["pages"]
            self.later(self.sc.link.message_latency_s, self.table, req)
            self.later(self.sc.timeouts.transfer_timeout_s, self.timeout, req)

    def timeout(self, req) -> None:
        req["timed_out"] = req["landed"] < req["pages"]  # the same timer, never acted on here

    def kick_prefill(self, p: int) -> None:
        if self.busy[p] or not self.queue[p]:
            return
        req = self.queue[p].popleft()
        self.busy[p] = True
        compute = req["pages"] * self.sc.cluster.page_tokens / self.sc.compute.prefill_tokens_per_s
        self.later(compute, self.computed, p, req)

    def computed(self, p: int, req) -> None:
        self.busy[p] = False
        req["computed"] = True
        if req["table"]:
            self.nic_waiting[p].append(req)
            self.kick_nic(p)
        self.kick_prefill(p)

    def table(self, req) -> None:
        req["table"] = True
        if req["computed"]:
            self.nic_waiting[req["p"]].append(req)
            self.kick_nic(req["p"])

    def kick_nic(self, p: int) -> None:
        waiting, limit = self.nic_waiting[p], self.sc.link.writes_in_flight_max
        while waiting and self.nic_in_flight[p] < limit:
            req = waiting[0]
            if req["sent"] == req["pages"]:
                waiting.popleft()
                continue
            req["sent"] += 1
            start = max(self.env.now, self.nic_free_at[p])
            self.nic_free_at[p] = start + self.page_s
            self.nic_in_flight[p] += 1
            self.later(start + self.page_s + self.sc.link.write_latency_s - self.env.now,
                       self.land, p, req)

    def land(self, p: int, req) -> None:
        self.nic_in_flight[p] -= 1
        req["landed"] += 1
        if req["landed"] == req["pages"]:
            self.later(self.sc.link.message_latency_s, self.accept, req)
        self.kick_nic(p)

    def accept(self, req) -> None:
        self.ready[req["d"]].append(req)
        self.kick_decode(req["d"])

    def kick_decode(self, d: int) -> None:
        if self.stepping[d]:
            return
        batch, ready, c = self.batch[d], self.ready[d], self.sc.compute
        while ready and len(batch) < self.sc.cluster.decode_batch_max:
            batch.append(ready.popleft())
        if not batch:
            return
        context = sum(req["pages"] * self.sc.cluster.page_tokens + req["gen"] for req in batch)
        step = (c.decode_step_base_s + c.decode_step_per_request_s * len(batch)
                + c.decode_step_per_context_token_s * context)
        self.stepping[d] = True
        self.later(step, self.stepped, d)

    def stepped(self, d: int) -> None:
        self.stepping[d] = False
        keep = []
        for req in self.batch[d]:
            req["gen"] += 1
            if req["gen"] >= req["out"]:
                self.free[d] += req["pages"]
                self.done += 1
            else:
                keep.append(req)
        self.batch[d] = keep
        self.kick_reserve(d)
        self.kick_decode(d)

    def arrivals(self):
        rate = self.sc.workload.rate_per_s
        while self.next < self.sc.requests:
            yield self.env.timeout(self.rng_arrivals.expovariate(rate))
            self.next += 1
            self.arrive()

    def run(self) -> int:
        self.env.process(self.arrivals())
        self.env.run()
        return self.done


def measure(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# Run in the baseline checkout: its own simulator on the scenario given as JSON.
_BASELINE_RUN = """
import json, sys, time
sys.path.insert(0, '.')
from sim.run import simulate
from sim.scenario import scenario_from_dict
sc = scenario_from_dict(json.loads(sys.argv[1]))
start = time.perf_counter()
result = simulate(sc, progress=True)[0]  # as the in-process run (its stderr is dropped)
print(json.dumps({"seconds": time.perf_counter() - start, "events": result["events"],
                  "violations": result["violations"]}))
"""


def measure_baseline(directory: str, sc: Scenario, timeout_s: float) -> dict:
    """The baseline checkout's simulator on `sc`: seconds, core events, violations."""
    done = subprocess.run([sys.executable, "-c", _BASELINE_RUN, sc.model_dump_json()],
                          cwd=directory, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise SystemExit(f"the baseline in {directory} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; medians printed")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also run the simulator of this checkout (an older commit)")
    parser.add_argument("--baseline-timeout-s", type=float, default=3600.0)
    args = parser.parse_args()
    if args.baseline and not (Path(args.baseline) / "sim" / "run.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a kvproof checkout (no sim/run.py)")
    sc = bench_scenario(args.requests)
    print(f"cluster 16 prefill x 16 decode, {args.requests:,} requests, seed {sc.seed}; "
          f"{args.repeat} run(s) of each", flush=True)
    bare, core, base, here = [], [], [], []
    for k in range(args.repeat):
        pipeline = BarePipeline(sc)
        bare.append(measure(pipeline.run))
        assert pipeline.done == args.requests, "the bare pipeline lost requests"
        print(f"  bare SimPy pipeline   run {k + 1}: {bare[-1]:7.2f} s", flush=True)
        outcome = {}
        core.append(measure(lambda: outcome.update(result=simulate(sc, progress=True)[0])))
        result = outcome["result"]
        print(f"  kvproof sim (oracles) run {k + 1}: {core[-1]:7.2f} s, "
              f"{result['events']:,} core events, violations: {result['violations'] or 'none'}",
              flush=True)
        if args.baseline:
            # Both checkouts in a fresh subprocess each, one after the other: the in-process
            # run above shares its process with the bare pipeline's garbage.
            for name, directory, times in (("baseline sim", args.baseline, base),
                                           ("this sim (subprocess)", ROOT, here)):
                run = measure_baseline(directory, sc, args.baseline_timeout_s)
                times.append(run["seconds"])
                same = "the same run" if run["events"] == result["events"] else (
                    f"A DIFFERENT RUN ({run['events']:,} core events)")
                print(f"  {name:21s} run {k + 1}: {times[-1]:7.2f} s, {same}, "
                      f"violations: {run['violations'] or 'none'}", flush=True)
    bare_rate = args.requests / statistics.median(bare)
    core_rate = args.requests / statistics.median(core)
    print(f"bare SimPy pipeline : {bare_rate:10,.0f} simulated requests/s (median)")
    print(f"kvproof simulator   : {core_rate:10,.0f} simulated requests/s (median), all oracles on")
    print(f"ratio               : {core_rate / bare_rate:10.1%} of the bare pipeline "
          f"(issue 26 aims at >= 40%)")
    if base:
        base_rate = args.requests / statistics.median(base)
        here_rate = args.requests / statistics.median(here)
        print(f"baseline simulator  : {base_rate:10,.0f} simulated requests/s (median of "
              f"subprocess runs), {base_rate / bare_rate:.1%} of the bare pipeline "
              f"({args.baseline})")
        print(f"this simulator      : {here_rate:10,.0f} simulated requests/s (median of "
              f"subprocess runs), {here_rate / bare_rate:.1%} of the bare pipeline")
        print(f"this checkout       : {here_rate / base_rate:10.2f}x the baseline's rate "
              "(subprocess runs of both)")
    if result["violations"]:
        print(f"the benchmark's run is not healthy (violations: {result['violations']}): "
              "its figures measure a broken run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
