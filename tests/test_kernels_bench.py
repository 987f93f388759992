"""bench/kernels_bench.py stays runnable: its smallest shapes on the CPU, in a subprocess,
on the reference path and on the Triton path (interpreter) that a GPU run takes."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = ["library sdpa-cpu", "kvproof tags on", "tag check costs", "library copy",
        "kvproof page_checksum", "kvproof pack_pages", "kvproof unpack_pages",
        "library index_select", "library index_copy_"]


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_kernels_bench_tiny_run_prints_every_row(path):
    env = dict(os.environ, KVPROOF_KERNELS=path, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_bench.py"),
                             "--device", "cpu", "--tiny"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert f"kernels path '{path}'" in result.stdout
    for row in ROWS:
        assert row in result.stdout, row
