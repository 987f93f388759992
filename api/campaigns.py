"""Independent runs — fuzz zoo cells, simulator sweep points — over local processes
(`--jobs N`, spec/check/pool.py) or an existing Ray cluster (`--ray ADDRESS`).

Each run is a pure function of its input (a campaign or a scenario with its seed), so where
it runs changes nothing: results come back in input order and equal a serial run. No
scheduling is done here; the process pool or Ray does it.

Ray is optional (not a dependency): `--ray` without it installed is a one-line error. For a
local instance pass `--ray local`; for a running cluster its address (`auto`, `HOST:6379`,
`ray://HOST:10001`). On a local instance the workers import this source tree (its path goes
in their PYTHONPATH); on a remote cluster kvproof must be installed on the nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from api.clikit import UsageError
from spec.check.pool import ordered_map

SOURCE_ROOT = str(Path(__file__).resolve().parents[1])


def parallel_map(fn: Callable, items: list, jobs: int = 1,
                 ray_address: str | None = None) -> list:
    """[fn(item) for item in items], in order, wherever the runs go."""
    if ray_address:
        return _ray_map(fn, items, ray_address)
    if jobs > 1 and len(items) > 1:
        return ordered_map(fn, items, jobs)
    return [fn(item) for item in items]


def require_ray() -> None:
    """Say before any work starts that --ray cannot run here."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UsageError("--ray needs the ray package, which is not installed "
                         "(pip install ray); --jobs N runs on local processes")


def _ray_map(fn: Callable, items: list, address: str) -> list:
    require_ray()
    import ray

    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": SOURCE_ROOT}})
    except (ConnectionError, ValueError, RuntimeError) as error:
        raise UsageError(f"--ray {address}: cannot start or reach a Ray cluster "
                         f"({str(error).splitlines()[0]})") from None
    try:
        task = ray.remote(fn)
        return ray.get([task.remote(item) for item in items])
    finally:
        ray.shutdown()
