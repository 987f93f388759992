"""Pools of worker processes that a Ctrl-C stops cleanly, bounded by the CPUs.

Used by every pool kvproof starts: `check --workers` (spec/check/parallel.py), the fuzz zoo
and the simulator's sweeps (`--jobs`, api/campaigns.py, fuzz/zoo.py).

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: to the parent and
to every worker. Left alone, each worker raises KeyboardInterrupt in the middle of its task
and prints a traceback (58,708 lines of them from `check --workers 100000`), and the parent,
waiting in shutdown() for tasks that may run for a minute, ignores the key. So a worker
ignores SIGINT from its first instruction (the signal is blocked while the pool forks, and
the worker sets SIG_IGN before unblocking it), and the parent alone decides: on any
exception, KeyboardInterrupt included, it terminates its workers, reaps them, and lets the
exception go on to the command, which prints one line.

Work is CPU-bound, so more processes than CPUs only add memory and switching: the bound is
the number of CPUs this process may run on (its affinity mask, not the machine's count).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator


def cpus_available() -> int:
    """The CPUs this process may run on: the most worker processes worth starting."""
    return len(os.sched_getaffinity(0))


def _start_quietly(initializer: Callable | None, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if initializer is not None:
        initializer(*initargs)


def _nothing() -> None:
    return None


@contextmanager
def process_pool(workers: int, initializer: Callable | None = None,
                 initargs: tuple = ()) -> Iterator[ProcessPoolExecutor]:
    """A ProcessPoolExecutor of `workers` processes that ignore SIGINT; on leaving the block
    by an exception its processes are terminated at once, otherwise it shuts down after its
    tasks (those not started are cancelled)."""
    assert 1 <= workers <= cpus_available(), f"{workers} workers on {cpus_available()} CPUs"
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(workers, initializer=_start_quietly,
                               initargs=(initializer, initargs))
    # With fork the pool starts every process at its first submit, in this thread: block
    # SIGINT across it so that no worker can see one before it ignores them.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool.submit(_nothing)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        yield pool
    except BaseException:
        for process in set(multiprocessing.active_children()) - before:
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True, cancel_futures=True)


def _run_quietly(target: Callable, args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    target(*args)


@contextmanager
def worker_processes(target: Callable, args_per_worker: list[tuple],
                     stop_s_max: float = 10.0) -> Iterator[list]:
    """One process per element of `args_per_worker`, each running target(*args) and
    ignoring SIGINT, for a caller that talks to its workers itself (the parallel checker:
    one pipe each way per worker, no manager thread in between). On leaving the block the
    processes are given `stop_s_max` to end (the caller has told them to), then
    terminated; on leaving it by an exception, terminated at once."""
    assert 1 <= len(args_per_worker) <= cpus_available()
    context = multiprocessing.get_context("fork")
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        processes = [context.Process(target=_run_quietly, args=(target, args), daemon=True)
                     for args in args_per_worker]
        for process in processes:
            process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        yield processes
    except BaseException:
        for process in processes:
            process.terminate()
        raise
    finally:
        for process in processes:
            process.join(stop_s_max)
            if process.is_alive():
                process.terminate()
                process.join()


def ordered_map(fn: Callable, items: list, workers: int) -> list:
    """[fn(item) for item in items] in `workers` processes, in order."""
    with process_pool(min(workers, len(items))) as pool:
        return list(pool.map(fn, items))
