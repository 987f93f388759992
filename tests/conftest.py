"""Shared helpers for the tests, and how pytest-xdist shares them out."""

from __future__ import annotations

import os

import pytest

# Triton decides interpreter or compiler when a function is decorated, its own library
# (tl.sum, tl.cdiv) included, so the choice must be made before anything imports triton.
# No GPU here: the Triton kernel tests (tests/test_kernels_triton_*.py) run in the
# interpreter. Export TRITON_INTERPRET=0 to keep the compiler.
os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist runs one worker per core: a worker's torch with a thread per core as well
# oversubscribes the machine, and each parallel op then waits for a descheduled thread
# (tests/test_engine_workers.py + test_engine_stream.py, -n 2: 71 s with two threads, 48-56 s
# with one). Servers the tests start inherit it. Export OMP_NUM_THREADS to choose.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from spec.check.guardtable import run_check as checked  # noqa: F401  (cached model checks)


FIRST_FILES = ["tests/test_zoo.py", "tests/test_cli.py", "tests/test_checker.py"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: a unit of work of its own for pytest-xdist")
    config.addinivalue_line("markers", "slow: more than ~5 s here; the fast tier "
                            "(python -m pytest -q -m 'not slow') leaves it out, CI runs it")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests run in parallel (`--dist loadgroup`) grouped by file, so that a file's cached
    model checks are shared by its tests; a test marked `alone` is a group of its own. The
    per-model conformance checks are: minutes each, together they would keep one worker
    busy long after the other has finished."""
    for item in items:
        alone = item.get_closest_marker("alone") is not None
        item.add_marker(pytest.mark.xdist_group(item.nodeid if alone else item.location[0]))
    # The groups are handed out in collection order, and test_zoo.py, the largest by far
    # (the guard table checks every switch: about 8 minutes of one core), comes last
    # alphabetically: started last, it kept one worker busy minutes after the other had
    # finished. The largest groups go first.
    items.sort(key=lambda item: FIRST_FILES.index(item.location[0])
               if item.location[0] in FIRST_FILES else len(FIRST_FILES))
