"""`kvproof worker prefill|decode --rendezvous HOST:PORT --rank K --world-size W`: one worker
process of a deployment whose router runs elsewhere (`kvproof serve --processes
--rendezvous HOST:PORT`), on this machine or another (engine/rendezvous.py says how they
meet).

The worker reads the deployment at the rendezvous, checks its rank and world size against
it (decode d is rank d, prefill q is rank D + q), its model file against the deployment's
fingerprint, and its pool against the advertised context (refusing to join, naming itself
and both numbers, which the launcher reports), then listens on --host and serves until its
router goes away (it then finishes what it holds and ends its log) or it is sent SIGTERM
(it drains: engine/processes.py `Process.drain`). Started again for the same rank after it
died, it finds its next life's record at the rendezvous and goes on with its log in the
next epoch (a prefill's next life ends what its previous one held; it takes no new request
on the real data path).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from api.clikit import EXIT_OK, UsageError, add_subcommand, positive_float, writable_folder

EXAMPLES = [
    "kvproof serve --processes --rendezvous 10.0.0.1:29500   # on 10.0.0.1: router and API",
    "kvproof worker decode --rendezvous 10.0.0.1:29500 --rank 0 --world-size 2 --host 10.0.0.2",
    "kvproof worker prefill --rendezvous 10.0.0.1:29500 --rank 1 --world-size 2 --host 10.0.0.3",
]
EXIT_CODES = """exit status:
  0  the worker served and stopped cleanly (its router left, or SIGTERM and a whole drain)
  1  it refused to join (its pool is below the advertised context; the reason names both)
     or its drain's bound passed with requests left (the crash's path ends them)
  2  bad input (a bad address, a rank or role that is not the deployment's, another model
     file, an unreachable rendezvous)"""


def add_parser(commands) -> None:
    worker = add_subcommand(
        commands, "worker", "run one prefill or decode worker that joins a deployment",
        "Run one worker process of a deployment whose router and API run elsewhere "
        "(kvproof serve --processes --rendezvous HOST:PORT): it meets them at the "
        "rendezvous (torch.distributed's TCPStore), checks its rank, model and pool, and "
        "serves until its router leaves or it is sent SIGTERM (then it drains).",
        EXAMPLES, exit_codes=EXIT_CODES)
    worker.add_argument("role", choices=("prefill", "decode"))
    worker.add_argument("--rendezvous", required=True, metavar="HOST:PORT",
                        help="where the deployment's launcher hosts its rendezvous")
    worker.add_argument("--rank", required=True, type=int, metavar="K",
                        help="this worker's rank: decode d is d, prefill q is D + q")
    worker.add_argument("--world-size", required=True, type=int, metavar="W",
                        help="the deployment's workers, P + D")
    worker.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                        help="the address this worker listens on, which its peers dial "
                        "(default 127.0.0.1: this machine only)")
    worker.add_argument("--model", metavar="PATH", help="this machine's copy of the "
                        "deployment's model file (default: the path the deployment names)")
    worker.add_argument("--log-dir", metavar="DIR",
                        help="where this worker writes its log (default: the deployment's "
                        "folder if it is here, else a new temporary one)")
    worker.add_argument("--join-timeout-s", type=positive_float, default=300.0, metavar="S",
                        help="the longest it waits at the rendezvous (default 300)")
    worker.set_defaults(func=run)


def run(args) -> int:
    from engine.processes import DECODE, PREFILL, capacity_refusal, cut_dead_log, log_path, main
    from engine.processes import Deployment
    from engine.rendezvous import (Rendezvous, RendezvousError, model_fingerprint,
                                   parse_address)

    try:
        parse_address(args.rendezvous)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.log_dir:
        writable_folder(args.log_dir, "--log-dir")
    try:
        rendezvous = Rendezvous(args.rendezvous, hosting=False, timeout_s=args.join_timeout_s)
        published = rendezvous.wait(["deployment"], what="the deployment")["deployment"]
    except RendezvousError as error:
        raise UsageError(str(error)) from None
    setup = dict(published["setup"])
    d = Deployment(**setup)
    world = d.prefill_workers + d.decode_workers
    if args.world_size != world:
        raise UsageError(f"--world-size {args.world_size}: the deployment at "
                         f"{args.rendezvous} has {world} workers ({d.prefill_workers} prefill "
                         f"+ {d.decode_workers} decode)")
    role = args.role
    if not 0 <= args.rank < world:
        raise UsageError(f"--rank {args.rank}: ranks are 0..{world - 1}")
    expected = DECODE if args.rank < d.decode_workers else PREFILL
    if role != expected:
        raise UsageError(f"rank {args.rank} is a {expected} worker's in this deployment "
                         f"(decode d is rank d, prefill q is rank {d.decode_workers} + q)")
    worker = args.rank if role == DECODE else args.rank - d.decode_workers
    name = f"{role} {worker}"
    if d.model_dir:
        model = args.model or d.model_dir
        if not Path(model).exists():
            raise UsageError(f"no model at {model}: give this machine's copy with --model")
        if model_fingerprint(model) != published["model"]:
            raise UsageError(f"{model} is not the deployment's model file (size and "
                             "digest differ): every worker must load the same weights")
        setup["model_dir"] = str(model)
    log_dir = args.log_dir or (d.log_dir if os.path.isdir(d.log_dir) else
                               tempfile.mkdtemp(prefix="kvproof-worker-"))
    setup["log_dir"] = str(log_dir)
    print(f"kvproof worker: {name}, logs in {log_dir}", flush=True)
    refusal = capacity_refusal(d, role, worker)
    if refusal is not None:
        rendezvous.put(f"refused/{name}", refusal)
        print(f"kvproof worker: {refusal}", flush=True)
        return 1
    restart = rendezvous.get(f"restart/{name}")
    current = rendezvous.get(f"addr/{name}")
    epoch = 1
    if restart is not None and (current is None or current["epoch"] < restart["epoch"]):
        # Its next life: it goes on with its log (here, where its previous life wrote it).
        steps, clock = cut_dead_log(log_path(Deployment(**setup), name), name)
        restart = {**restart, "steps": steps, "clock": clock}
        epoch = restart["epoch"]
        setup = asdict(Deployment(**setup).next_life())
    else:
        restart = None
    ports = []
    if role == PREFILL:  # a prefill dials every decode
        names = [f"{DECODE} {k}" for k in range(d.decode_workers)]
        try:
            got = rendezvous.wait([f"addr/{n}" for n in names], what="the decode workers")
        except RendezvousError as error:
            raise UsageError(str(error)) from None
        ports = [[a["host"], a["port"]] for a in got.values()]

    def listening(port: int) -> None:
        rendezvous.put(f"addr/{name}", {"host": args.host, "port": port, "pid": os.getpid(),
                                        "epoch": epoch})
    code = main({**setup, "role": role, "worker": worker, "ports": ports, "host": args.host,
                 **({"restart": restart} if restart else {})}, on_listening=listening,
                stdin=False)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal exit: tearing a gloo world down waits on peers that may have left first.
    os._exit(code if code else EXIT_OK)
