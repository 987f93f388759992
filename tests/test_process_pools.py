"""Every pool of processes (check --workers, sim --sweep --jobs, fuzz --zoo --jobs) is bounded
by the CPUs this process may run on, and stops cleanly on Ctrl-C (issue 23 item 4): one
line, exit 130, no traceback from a child, no child left behind.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group, children included,
so the tests start the command in a session of its own and signal that group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.cli_cases import ctrl_c_reaches_it, run

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S_MAX = 60.0  # a busy 2-core machine imports slowly; the wait ends as soon as it ran
STOP_S_MAX = 20.0
CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("argv", [
    ["check", "--model", "default", "--workers", "100000"],
    ["sim", "default", "--sweep", "workload.rate_per_s=5,10", "--jobs", "100000"],
    ["fuzz", "--zoo", "--examples", "1", "--jobs", "100000"],
])
def test_process_counts_above_the_cpus_are_refused_at_once(capsys, argv):
    started = time.perf_counter()
    code, out, err = run(capsys, *argv)
    flag = argv[-2]
    assert code == 2 and out == ""
    assert f"{flag}: at most {CPUS} " in err, err
    assert len(err.strip().splitlines()) == 1
    assert time.perf_counter() - started < 2.0


def _children_once_started(process: subprocess.Popen, count: int) -> list[psutil.Process]:
    """The command's child processes, once `count` of them run (bounded in time)."""
    deadline = time.monotonic() + STARTUP_S_MAX
    parent = psutil.Process(process.pid)
    while time.monotonic() < deadline and process.poll() is None:
        children = parent.children(recursive=True)
        if len(children) >= count:
            return children
        time.sleep(0.1)
    raise AssertionError(f"the command did not start {count} workers in {STARTUP_S_MAX} s")


def _interrupted(argv: list[str], tmp_path: Path, children: int) -> tuple[int, str, list]:
    """Run `kvproof ARGV` in its own process group, press Ctrl-C once its workers run; its
    exit status, its output and the workers it had."""
    out_path = tmp_path / "out.txt"
    with open(out_path, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "api.cli", *argv], cwd=ROOT,
                                   stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=ctrl_c_reaches_it)
    try:
        workers = _children_once_started(process, children)
        time.sleep(0.5)  # inside the work, not at its start
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=STOP_S_MAX)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return code, out_path.read_text(errors="replace"), workers


def _left_behind(workers: list[psutil.Process]) -> list[int]:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        alive = [w.pid for w in workers
                 if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.1)
    for w in workers:  # do not leave them to the next test either
        if w.is_running():
            w.kill()
    return alive


@pytest.mark.skipif(CPUS < 2, reason="needs 2 CPUs for 2 workers")
@pytest.mark.parametrize("argv, command", [
    (["check", "--model", "default", "--workers", "2"], "check"),
    (["sim", "default", "--sweep", "requests=200000,200001", "--jobs", "2",
      "--quiet"], "sim"),
    (["fuzz", "--zoo", "--seconds", "60", "--jobs", "2", "--quiet"], "fuzz"),
])
def test_ctrl_c_stops_a_pool_with_one_line_and_no_orphans(tmp_path, argv, command):
    code, output, workers = _interrupted(argv, tmp_path, children=2)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert code == 130, output[-3000:]
    assert output.rstrip().splitlines()[-1] == f"kvproof {command}: interrupted; no verdict"
    assert len(output.splitlines()) <= 12, output[-3000:]
    assert _left_behind(workers) == []
