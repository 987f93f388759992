"""`kvproof serve`: the OpenAI-compatible server over the protocol-driven engine.

    kvproof serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--device cpu|cuda]
                  [--dtype float32|bfloat16|float16] [--threads N] [--drain-s S]
                  [--disaggregated --prefill-workers N --decode-workers M]
                  [--processes --prefill-workers N --decode-workers M
                   [--rendezvous HOST:PORT]]

Every option is checked before the model loads (10-25 s for the default model): the
values, the device and the model path (api/engine_options.py), the engine's config, and the
address, which is bound and listening before the load and handed to uvicorn as it is, so
that a port in use is one line at once and nothing can take the port in between (a
connection made during the load waits in the kernel's backlog and is answered once the
server is up).

The engine is what engine.serving's `build_engine(loaded_model, config)` returns (the
contract is engine/service.py): prefill and decode workers driven by the protocol core.
Its startup capacity check is its own, and a failure there is printed as one line with exit
status 2, like every other bad input. `--engine-factory MODULE:FUNCTION` names
another factory with the same signature (and the module's `EngineConfig`, if it has one).

`--disaggregated` is what the engine always is (prefill workers and decode workers, KV
moved between their pools by a transport); `--prefill-workers N --decode-workers M` sets
how many of each (default one of each), in this process, each with a pool of its own; the
router places every request on one prefill and one decode worker. Each worker's pool must
hold the advertised context (the startup capacity check).

`--processes` runs those workers as OS processes of their own on 127.0.0.1 (engine/
process_engine.py over engine/processes.py: one router process and N + M worker processes,
each loading the model, KV moved over gloo), every one stopped when the server stops;
each worker's own capacity check runs before the server takes traffic. Decoding across
processes is greedy (temperature, top_p, top_k, stop strings and logprobs are refused with
a 400) and ends at max_tokens or the end of sequence. With `--rendezvous HOST:PORT` no worker
is started here: the server hosts a rendezvous (engine/rendezvous.py), prints the
`kvproof worker` command for each rank, and waits for them to join, on this machine or
others; each checks its own rank, model file and pool.

Startup prints the URL and a curl line. SIGTERM (or Ctrl-C) stops taking requests, lets live
ones finish for up to --drain-s seconds, aborts the rest through the protocol
(engine.stop(drain_s)), then closes the server; exit status 0.
"""

from __future__ import annotations

import argparse
import gc
import dataclasses
import importlib
import os
import socket
import sys
import threading

from api import engine_options
from api.clikit import (EXIT_OK, EXIT_USAGE, UsageError, nice_increment, non_negative_float,
                        port_number, positive_float, positive_int)

DEFAULT_FACTORY = "engine.serving:build_engine"
PROCESSES_FACTORY = "engine.process_engine:build_engine"
EXAMPLES = [
    "kvproof serve                                   # the default model on 127.0.0.1:8000",
    "kvproof serve --model path/to/model.gguf --port 8080 --device cuda --dtype bfloat16",
    "kvproof serve --disaggregated --prefill-workers 2 --decode-workers 3",
    "kvproof serve --processes --prefill-workers 2 --decode-workers 2   # OS processes",
    "kvproof serve --processes --rendezvous 10.0.0.1:29500   # workers: kvproof worker ...",
    "kvproof serve --threads 1                       # one torch thread (a busy machine)",
    "kvproof serve --api-key-file keys.txt           # 401 for requests without a key",
    "kvproof serve --lease-s 60 --lower-context-to-fit   # a slow machine: what its timers allow",
]
EXIT_CODES = """exit status:
  0  stopped by SIGTERM or Ctrl-C (live requests drained, or aborted after --drain-s)
  2  bad input or an engine that cannot serve it (an option's value, an address that cannot
     be listened on, a model that cannot be used, a failed startup capacity or timing
     check): one line, before the model loads wherever it can be known then"""
# Connections the kernel holds for accept (uvicorn's own default; the kernel caps it at
# net.core.somaxconn). Python's default (128) drops a burst's SYNs beyond it, and each
# dropped client retries 1, 3, 7 s later: a 503 that should be immediate took seconds.
LISTEN_BACKLOG = 2048
# How long a thread holding the GIL keeps it before another may run (Python's default is
# 5 ms). The engine's loop thread holds it between torch calls; the event loop then waits
# a whole interval per hand-over, and a burst's answers queue behind those waits.
SWITCH_INTERVAL_S = 0.0005
# Options that go to the engine's config under their own names, when given.
TIMER_OPTIONS = ("lease_s", "transfer_timeout_s", "context_prefill_s", "lower_context_to_fit",
                 "max_queued", "max_queued_tokens", "queue_wait_s_max", "loop_nice")



def add_arguments(parser: argparse.ArgumentParser) -> None:
    engine_options.add_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000,
                        help="0 to 65535; 0 picks a free port (default 8000)")
    parser.add_argument("--drain-s", type=non_negative_float, default=10.0, metavar="S",
                        help="on SIGTERM, let live requests finish for up to S seconds "
                             "before aborting them (default 10)")
    parser.add_argument("--disaggregated", action="store_true",
                        help="separate prefill and decode workers, KV moved between their "
                             "pools (what the engine always is; one of each by default)")
    parser.add_argument("--processes", action="store_true",
                        help="run the prefill and decode workers (and the router) as OS "
                             "processes of their own on 127.0.0.1, KV moved over gloo; "
                             "greedy decoding only")
    parser.add_argument("--rendezvous", metavar="HOST:PORT",
                        help="with --processes: start no worker here; host a rendezvous at "
                             "HOST:PORT where workers started with `kvproof worker` (on this "
                             "machine or others) join; the commands to run are printed")
    parser.add_argument("--prefill-workers", type=positive_int, default=None, metavar="N",
                        help="prefill workers, each with its own KV pool (needs "
                             "--disaggregated or --processes; default 1)")
    parser.add_argument("--decode-workers", type=positive_int, default=None, metavar="M",
                        help="decode workers, each with its own KV pool (needs "
                             "--disaggregated; default 1)")
    timers = parser.add_argument_group(
        "timers and admission", "decode's transfer deadline is a lease that the prefill's "
        "progress renews (admitted, a chunk computed, a page posted); queueing counts "
        "against no timer, admission bounds it instead (503 with Retry-After at once). At "
        "startup the engine measures how long prefilling the advertised context takes here "
        "and refuses to start when its timers would not allow it")
    timers.add_argument("--lease-s", type=positive_float, default=None, metavar="S",
                        help="the longest silence decode tolerates from a request's prefill "
                             "(default 60)")
    timers.add_argument("--transfer-timeout-s", type=positive_float, default=None,
                        metavar="S", help="a request's transfer from its prefill's start, at "
                                          "most (default 600)")
    timers.add_argument("--context-prefill-s", type=positive_float, default=None,
                        metavar="S", help="how long prefilling the advertised context takes "
                                          "here, instead of measuring it at startup")
    timers.add_argument("--lower-context-to-fit", action="store_true",
                        help="advertise the longest context the pools and timers allow, "
                             "instead of refusing to start")
    timers.add_argument("--max-queued", type=positive_int, default=None, metavar="N",
                        help="requests waiting for a prefill, at most (default 256)")
    timers.add_argument("--max-queued-tokens", type=positive_int, default=None, metavar="N",
                        help="their prompt tokens, at most (default 65536)")
    timers.add_argument("--queue-wait-s-max", type=positive_float, default=None,
                        metavar="S", help="admit no more prompt tokens than the prefill "
                                          "computes in S seconds at the measured rate "
                                          "(default 30)")
    timers.add_argument("--loop-nice", type=nice_increment, default=None, metavar="N",
                        help="run the engine loop N nice steps below the server's event "
                             "loop, so that a burst's 503s are answered while it computes; "
                             "it counts against every process of the shell's session, so 0 "
                             "beside other busy work (0 to 19, default 10)")
    cache = parser.add_argument_group(
        "prefix cache", "the prefill and decode keep the KV pages of prompts they served; "
        "a later prompt that starts the same way, with the same salt (the API key's tenant "
        "and the request's cache_salt), is computed only past them and has only the rest "
        "sent (engine/prefix.py); usage.prompt_tokens_details.cached_tokens counts the "
        "prompt tokens not computed")
    cache.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="the prefix caches (prefill's and decode's) on or off (default: "
                            "the engine's, off in process; --processes has none yet)")
    cache.add_argument("--share-prefix-cache-across-keys", action="store_true",
                       help="the salt leaves the tenant out: requests of different API "
                            "keys with the same cache_salt (or none) share cached pages")
    keys = parser.add_argument_group(
        "API keys", "with keys, the OpenAI endpoints answer 401 unless the request carries "
        "'Authorization: Bearer KEY' with one of them; each key is a tenant of its own "
        "(api/serve/auth.py). /health, /metrics, the dashboard and /v1/kvproof/state stay open")
    keys.add_argument("--api-key", action="append", metavar="KEY",
                      help="a key the server takes (repeatable; a file keeps keys out of ps)")
    keys.add_argument("--api-key-file", action="append", metavar="FILE",
                      help="a file of keys, one per line, # comments (repeatable)")
    parser.add_argument("--engine-factory", default=DEFAULT_FACTORY, metavar="MODULE:FUNCTION",
                        help=f"the engine's build function (default: {DEFAULT_FACTORY})")


class Refusal(Exception):
    """Bad input or an engine that cannot serve this: one line, exit status 2."""


def run(args: argparse.Namespace) -> int:
    listener = None
    try:
        factory, config, threads = _check(args)
        listener = _listen(args.host, args.port)
        app, engine = _build(args, (factory, config, threads))
    except Refusal as error:
        if listener is not None:
            listener.close()
        print(f"kvproof serve: {error}", file=sys.stderr)
        return EXIT_USAGE
    _serve(app, engine, listener, args.drain_s, threads)
    return EXIT_OK


def _check(args: argparse.Namespace):
    """Everything that can be refused without the model: (build function, engine config,
    torch threads), torch's threads set."""
    if (args.prefill_workers or args.decode_workers) and not (args.disaggregated
                                                                or args.processes):
        raise Refusal("--prefill-workers and --decode-workers need --disaggregated or "
                      "--processes")
    if args.rendezvous and not args.processes:
        raise Refusal("--rendezvous needs --processes")
    if args.rendezvous:
        from engine.rendezvous import parse_address
        try:
            parse_address(args.rendezvous)
        except ValueError as error:
            raise Refusal(f"--rendezvous: {error}") from None
    if args.processes:
        if args.engine_factory != DEFAULT_FACTORY:
            raise Refusal("--processes and --engine-factory: give one of them")
        if args.device != "cpu" or args.dtype != "float32":
            # Each worker loads the model itself, on the CPU in float32 (engine/
            # process_data.py): another device or dtype would be silently ignored there.
            raise Refusal(f"--processes runs its workers on the CPU in float32 for now, "
                          f"not --device {args.device} --dtype {args.dtype}")
        args.engine_factory = PROCESSES_FACTORY
    try:
        threads = engine_options.prepare(args)
        from api.serve.auth import load_keys  # (here: it imports the engine, and torch)
        args.api_keys = load_keys(args.api_key, args.api_key_file)
    except UsageError as error:
        raise Refusal(str(error)) from None
    factory, config_type = _factory(args.engine_factory)
    return factory, _engine_config(config_type, args), threads


def _build(args: argparse.Namespace, checked=None):
    """(app, engine): the model loaded and the engine built, after _check (whose answer is
    `checked`; without it, _check first)."""
    from engine.config import ModelFileError
    from engine.load import load_model

    from api.serve.app import create_app

    factory, config, _threads = checked or _check(args)
    try:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    except (ModelFileError, AssertionError) as error:
        raise Refusal(str(error)) from None
    try:
        engine = factory(loaded, config)
    except NotImplementedError as error:
        raise Refusal(f"not supported yet by this engine: {error}") from None
    except Exception as error:  # the engine's startup checks (capacity): its own words
        raise Refusal(f"the engine refused to start: {error}") from None
    return create_app(engine, api_keys=getattr(args, "api_keys", None),
                      share_prefix_cache_across_keys=getattr(
                          args, "share_prefix_cache_across_keys", False)), engine


def _factory(spec: str):
    """(build function, its config type or None) from MODULE:FUNCTION."""
    try:
        found = _find(spec)
    except ImportError as error:
        raise Refusal(f"--engine-factory {spec}: {error}") from None
    if found is None:
        raise Refusal(f"--engine-factory {spec}: no such module or function")
    return found


def _find(spec: str):
    module_name, _, function = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            return None
        raise
    build = getattr(module, function or "build_engine", None)
    return None if build is None else (build, getattr(module, "EngineConfig", None))


def _print_worker_commands(args: argparse.Namespace) -> None:
    """What to run, on each worker's machine, for a deployment that meets at a rendezvous
    (the server waits for them, at most the engine's start bound)."""
    decodes, prefills = args.decode_workers or 1, args.prefill_workers or 1
    world = decodes + prefills
    print(f"waiting for {world} workers at {args.rendezvous}; on each worker's machine run "
          "(add --host ITS_ADDRESS off this machine):", flush=True)
    for rank in range(world):
        role = "decode" if rank < decodes else "prefill"
        print(f"  kvproof worker {role} --rendezvous {args.rendezvous} --rank {rank} "
              f"--world-size {world}", flush=True)


def _engine_config(config_type, args: argparse.Namespace):
    """The engine's config with the options it has. Without a config type (a factory whose
    module has no EngineConfig: bench/api_bench.py's null engine) the options go as a dict;
    an option the config has no field for is refused, never dropped."""
    wanted = {}
    if args.disaggregated or getattr(args, "processes", False):
        wanted = dict(disaggregated=True, prefill_workers=args.prefill_workers or 1,
                      decode_workers=args.decode_workers or 1)
    if getattr(args, "rendezvous", None):
        wanted["rendezvous"] = args.rendezvous
        _print_worker_commands(args)
    for option in TIMER_OPTIONS:
        value = getattr(args, option, None)
        if value is not None and value is not False:  # 0 is a value (--loop-nice 0)
            wanted[option] = value
    if getattr(args, "prefix_cache", None) is not None:  # on or off, as asked
        wanted["prefix_cache"] = args.prefix_cache
    if config_type is None:
        return wanted
    fields = {f.name for f in dataclasses.fields(config_type)} if dataclasses.is_dataclass(
        config_type) else set()
    missing = sorted(set(wanted) - fields)
    if missing:
        flags = sorted({"--disaggregated" if name not in TIMER_OPTIONS + ("prefix_cache",)
                        else "--" + name.replace("_", "-") for name in missing})
        raise Refusal(f"{', '.join(flags)}: not supported yet by this engine (its config "
                      f"has no {', '.join(missing)})")
    try:
        return config_type(**wanted)
    except NotImplementedError as error:
        raise Refusal(f"not supported yet by this engine: {error}") from None
    except (TypeError, ValueError, AssertionError) as error:
        raise Refusal(f"engine config: {error}") from None


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (IPv4 or IPv6, as the host resolves; ""
    is every interface)."""
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
    except (socket.gaierror, UnicodeError) as error:
        reason = error.strerror if isinstance(error, socket.gaierror) else str(error)
        raise Refusal(f"--host {host}: not an address of this machine or a name it can "
                      f"resolve ({reason})") from None
    try:
        return socket.create_server((host, port), family=family, reuse_port=False,
                                    backlog=LISTEN_BACKLOG)
    except OSError as error:  # its strerror also names the address: say it once
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise Refusal(f"cannot listen on {host}:{port}: {reason}") from None


def _serve(app, engine, listener: socket.socket, drain_s: float, threads: int) -> None:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, except that the first SIGTERM/SIGINT drains the engine before the
        server closes: new requests get 503 while live ones finish (or are aborted after
        drain_s), so no stream is cut by the server closing under it. A second signal
        stops at once (uvicorn's own handling)."""

        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                return super().handle_exit(sig, frame)
            self.draining = True
            print(f"kvproof serve: stopping (draining up to {drain_s:g} s)", flush=True)

            def drain() -> None:
                app.state.lifetime.stop(drain_s)
                self.should_exit = True

            threading.Thread(target=drain, name="drain", daemon=True).start()

    host, port = listener.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"kvproof serve: {engine.model_name} at {url} (context {engine.context_length} "
          f"tokens, {threads} torch thread{'s' if threads > 1 else ''}); dashboard {url}/ ; "
          f"metrics {url}/metrics", flush=True)
    timing = getattr(engine, "timing", None)
    if timing is not None:
        print(f"  context verified: {timing.describe()}; admission: up to "
              f"{engine.config.max_queued} requests and {engine.queued_tokens_max} prompt "
              f"tokens waiting (about {engine.config.queue_wait_s_max:g} s of prefill), "
              "beyond that 503 at once", flush=True)
    workers = getattr(engine, "workers_line", None)
    if workers is not None:
        print(f"  {workers()}", flush=True)
    # Worker processes decode greedily only, and OpenAI's default temperature is 1.
    greedy = ", \"temperature\": 0" if workers is not None else ""
    print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
          f"'{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
          f"\"max_tokens\": 32{greedy}}}'", flush=True)
    server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=drain_s + 5))
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # What the load and the engine's build made lives as long as the server: leave it out
    # of the collector's full passes. A full pass over those ~200,000 objects took ~80 ms,
    # and one could fall inside a burst whose refusals are due in under 50 ms.
    gc.freeze()
    server.run(sockets=[listener])
    print("kvproof serve: stopped", flush=True)
