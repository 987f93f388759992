"""Shared by the CUDA test files (tests/test_*_cuda.py). Under pytest they skip without a
CUDA device, or with TRITON_INTERPRET=1 (tests/conftest.py's default: the kernels would
run interpreted, not compiled); bench/device_check.sh exports TRITON_INTERPRET=0 and
KVPROOF_REQUIRE_CUDA=1 (no skips). A GPU machine may lack pytest, so each file also runs
with plain python: every test_* function of the module in turn (none takes a fixture), a
PASS or FAIL line each."""

from __future__ import annotations

import os
import time
import traceback

import torch


def cuda_skip_reason() -> str | None:
    """Why the CUDA tests cannot run here, or None. KVPROOF_REQUIRE_CUDA=1 (the device
    script's) turns every skip into a run, so a GPU run that cannot run them fails
    instead of reporting skips as a pass."""
    if os.environ.get("KVPROOF_REQUIRE_CUDA") == "1":
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "TRITON_INTERPRET=1: export TRITON_INTERPRET=0 to compile the kernels"
    return None


def skip_marks() -> list:
    """A CUDA test module's `pytestmark`: skip for cuda_skip_reason() under pytest; no
    marks where pytest is not installed (the module then runs as a script)."""
    try:
        import pytest
    except ImportError:
        return []
    reason = cuda_skip_reason()
    return [pytest.mark.skipif(reason is not None, reason=str(reason))]


def run_as_script(namespace: dict) -> int:
    """Run every test_* function in `namespace`; exit status 1 if any failed."""
    reason = cuda_skip_reason()
    if reason:
        print(f"SKIP all: {reason}")
        return 1
    failed = 0
    for name, function in list(namespace.items()):
        if not (name.startswith("test_") and callable(function)):
            continue
        started = time.perf_counter()
        try:
            function()
            print(f"PASS {name} ({time.perf_counter() - started:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001 -- a script runner reports every failure and goes on
            failed += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0
