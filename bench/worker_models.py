"""States, time and memory of the worker models (issue 25 item 5).

For each model: distinct states (or orbits with --symmetry), seconds and the peak resident
memory of a fresh process, with one checker process and with the parallel checker
(--workers 2), with and without symmetry over requests and workers. Each figure is one run
in a subprocess of its own (so that memory is that run's), the safety invariants only (the
exhaustive search; liveness adds its own graph pass). Timing is noisy on a shared machine:
compare rows of one run, not runs of different days.

    python bench/worker_models.py                       # every model, every variant
    python bench/worker_models.py --models workers2-2x1 --timeout-s 600
    python bench/worker_models.py --models workers3-2x2 --symmetry yes --workers 1 2
    python bench/worker_models.py --models workers3-2x1 --symmetry yes --workers 2 --orbit-states

With --orbit-states a reduced run also prints the number of states the run without symmetry
would visit: the sum of the sizes of the orbits it visited (spec/check/symmetry.py,
orbit_size), exact once the search ends, for models whose unreduced search is out of reach.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's spec/, not an installed one

CHILD = """
import json, resource, sys, time
from spec.check.zoo import BASES, TWO_REQUEST_WORKER_BASES, THREE_REQUEST_WORKER_BASES
from spec.model import Model
from spec.properties import STATE_INVARIANTS
name, symmetry, workers = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
orbits = sys.argv[4] == "1"
constants = {**BASES, **TWO_REQUEST_WORKER_BASES, **THREE_REQUEST_WORKER_BASES}[name]
m = Model(name=name, **constants)
def progress(distinct, generated, depth, seconds):
    print(json.dumps(dict(states=distinct, depth=depth, seconds=seconds)), file=sys.stderr,
          flush=True)
options = dict(symmetry=symmetry, invariants=tuple(STATE_INVARIANTS), liveness=False,
               progress=progress, progress_every_s=10.0, orbits=orbits)
start = time.perf_counter()
if workers == 1:
    from spec.check.checker import Checker
    result = Checker(m, **options).run()
else:
    from spec.check.parallel import ParallelChecker
    result = ParallelChecker(m, workers=workers, **options).run()
seconds = time.perf_counter() - start
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
          resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps(dict(states=result.distinct_states, seconds=seconds, rss_mib=rss / 1024,
                      ok=result.violation is None,
                      orbit_states=result.states_without_symmetry)))
"""


def measure(name: str, symmetry: bool, workers: int, timeout_s: float,
            orbits: bool = False) -> dict:
    """One run in a fresh process. Its progress lines (every 10 s) are shown as they come,
    so a long run is seen to move; past `timeout_s` it is stopped and the last one is how
    far it got."""
    label = f"{name} symmetry={'yes' if symmetry else 'no'} workers={workers}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, name, str(int(symmetry)),
                              str(workers), str(int(orbits and symmetry))], cwd=ROOT,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def show() -> None:
        for line in child.stderr:
            lines.append(line.rstrip("\n"))
            if line.startswith("{"):
                print(f"  {label}: {line.strip()}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=show, daemon=True)
    reader.start()
    try:
        child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        reader.join(5)
        last = next((json.loads(x) for x in reversed(lines) if x.startswith("{")), {})
        return {"timeout": timeout_s, "reached": last}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    reader.join(5)
    stdout = child.stdout.read()
    if child.returncode:
        return {"error": lines[-1] if lines else "failed"}
    return json.loads(stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from spec.check.zoo import THREE_REQUEST_WORKER_BASES, TWO_REQUEST_WORKER_BASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=[
        "workers-2x1", "workers-1x2", "workers-2x2", *TWO_REQUEST_WORKER_BASES,
        *THREE_REQUEST_WORKER_BASES])
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="per run; a run past it is reported as such")
    parser.add_argument("--workers", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--symmetry", choices=("both", "yes", "no"), default="both",
                        help="which variants to run: with symmetry, without, or both")
    parser.add_argument("--orbit-states", action="store_true",
                        help="with symmetry, also count the states of the search without it "
                             "(the sum of the sizes of the orbits visited: exact, without "
                             "running that search; costs some of the reduced run's time)")
    args = parser.parse_args(argv)
    symmetries = {"both": (False, True), "yes": (True,), "no": (False,)}[args.symmetry]
    print("| model | symmetry | workers | states (orbits) | seconds | peak RSS MiB | verdict |"
          + (" states without symmetry (sum of orbit sizes) |" if args.orbit_states else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.orbit_states else ""))
    for name in args.models:
        for symmetry in symmetries:
            for workers in args.workers:
                got = measure(name, symmetry, workers, args.timeout_s, args.orbit_states)
                if "states" in got:
                    cells = (f"{got['states']:,}", f"{got['seconds']:.1f}",
                             f"{got['rss_mib']:.0f}",
                             "every invariant holds" if got["ok"] else "violated")
                    if args.orbit_states:
                        cells += (f"{got['orbit_states']:,}" if got.get("orbit_states")
                                  is not None else "",)
                else:
                    reached = got.get("reached") or {}
                    cells = (f"past {got['timeout']:.0f} s" + (
                        f" ({reached['states']:,} at depth {reached['depth']} after "
                        f"{reached['seconds']:.0f} s)" if reached else "")
                             if "timeout" in got else got["error"], "", "", "") + (
                                 ("",) if args.orbit_states else ())
                print(f"| {name} | {'yes' if symmetry else 'no'} | {workers} | "
                      + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
