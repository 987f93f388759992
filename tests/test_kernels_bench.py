"""bench/kernels_bench.py stays runnable: its smallest shapes on the CPU, in a subprocess."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernels_bench_tiny_run_prints_every_row():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_bench.py"),
                             "--device", "cpu", "--tiny"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    for row in ["library sdpa-cpu", "kvproof tags on", "tag check costs",
                "library copy", "kvproof page_checksum", "kvproof pack_pages",
                "kvproof unpack_pages", "library index_select", "library index_copy_"]:
        assert row in result.stdout, row
