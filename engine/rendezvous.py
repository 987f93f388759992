"""Where a deployment's workers meet when they start on their own (`kvproof worker`, on this
machine or others): torch.distributed's TCPStore, hosted by the launcher.

Theory of operation
-------------------
`kvproof serve --processes --rendezvous HOST:PORT` (engine/processes.py `Launched` with a
`Deployment.rendezvous`) starts the router on its own machine and no worker: it hosts a
TCPStore at HOST:PORT and publishes the deployment (every field a worker process's setup
has, and a fingerprint of the model file). Each worker is started by whoever runs that
machine:

    kvproof worker decode  --rendezvous HOST:PORT --rank 0 --world-size 2
    kvproof worker prefill --rendezvous HOST:PORT --rank 1 --world-size 2

A worker joins the store, reads the deployment, checks that its world size and rank are
the deployment's (decode d is rank d, prefill q is rank D + q: the gloo world's ranks,
engine/process_data.py) and that its model file is the one the deployment names, runs the
startup capacity check itself (a worker whose pool is below the advertised context
refuses to join, naming itself and both numbers, and the launcher fails with that reason),
listens on its `--host`, and publishes its address. A prefill waits for every decode's
address and dials them; the launcher waits for every worker's address (or a refusal) and
then starts the router, which dials them all. On the real data path the gloo world meets
in the same store (under its own prefix) instead of the FileStore a one-machine deployment
uses.

Keys (all under "kvproof/"): "deployment" (JSON), "addr/NAME" (JSON: host, port, pid and
epoch of the worker NAME's current life), "refused/NAME" (the reason), "restart/NAME"
(JSON: a dead worker's next life, engine/processes.py `record_prefill_crash`, which a
`kvproof worker` started again for that rank picks up).

Every wait is bounded (`timeout_s`), and a refusal ends the launcher's wait at once.
"""

from __future__ import annotations

import datetime
import json
import time

KEY = "kvproof/"
POLL_S = 0.05


class RendezvousError(RuntimeError):
    """The rendezvous could not be reached or what it holds does not fit (user-facing)."""


class RendezvousRefused(RendezvousError):
    """A worker refused to join (its reason names it and both numbers)."""


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT as (host, port); a clear ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a rendezvous is HOST:PORT with a port in 1..65535, not {address!r}")
    return host, int(port)


class Rendezvous:
    """One deployment's TCPStore: hosted by the launcher (`host`), joined by a worker."""

    def __init__(self, address: str, hosting: bool, timeout_s: float) -> None:
        from torch.distributed import TCPStore

        host, port = parse_address(address)
        self.address, self.timeout_s = address, timeout_s
        try:
            self.store = TCPStore(host, port, is_master=hosting, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as error:
            what = "host" if hosting else "reach"
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise RendezvousError(f"cannot {what} the rendezvous at {address}: "
                                  f"{reason}") from None

    # -- values ---------------------------------------------------------------------------

    def put(self, key: str, value) -> None:
        self.store.set(KEY + key, json.dumps(value))

    def get(self, key: str):
        """The value at `key`, or None when there is none (no wait)."""
        if not self.store.check([KEY + key]):
            return None
        return json.loads(self.store.get(KEY + key))

    def wait(self, keys: list[str], refusals: list[str] = (), timeout_s: float | None = None,
             what: str = "") -> dict:
        """Every key's value, waiting at most `timeout_s`; a RendezvousError at once when a
        refusal key appears (its reason in the message), or when the time is up."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            for key in refusals:
                reason = self.get(key)
                if reason is not None:
                    raise RendezvousRefused(reason)
            if self.store.check([KEY + k for k in keys]):
                return {k: self.get(k) for k in keys}
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([KEY + k])]
                raise RendezvousError(f"{what or 'the rendezvous'}: nothing at {missing} "
                                      f"within {self.timeout_s if timeout_s is None else timeout_s} s "
                                      f"at {self.address}")
            time.sleep(POLL_S)

    def gloo_store(self):
        """The store the gloo world of the real data path meets in (its own prefix)."""
        from torch.distributed import PrefixStore

        return PrefixStore(KEY + "gloo/", self.store)


def model_fingerprint(path: str) -> dict:
    """What identifies a model file across machines without reading it whole: its size and
    a SHA-256 of its first and last MiB (a folder: of each file, in name order)."""
    import hashlib
    from pathlib import Path

    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    digest, size = hashlib.sha256(), 0
    for file in files:
        n = file.stat().st_size
        size += n
        with open(file, "rb") as f:
            digest.update(f.read(1 << 20))
            if n > 1 << 20:
                f.seek(max(n - (1 << 20), 1 << 20))
                digest.update(f.read(1 << 20))
    return {"bytes": size, "sha256_ends": digest.hexdigest()}
