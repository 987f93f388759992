"""The Engine contract (engine/service.py) served by worker processes: `kvproof serve
--processes --prefill-workers N --decode-workers M`.

Theory of operation
-------------------
`build_engine(loaded_model, EngineConfig)` starts one deployment of engine/processes.py on
127.0.0.1: N prefill and M decode OS processes, each loading the model from the same file
(engine/process_data.py: its own KV pool, page writes over gloo), and the router as an OS
process of its own, with its part, its log and the environment's log, exactly as in the
tests' deployments. The router stays a process of its own rather than a thread of this one
because its loop, its channel and its logs are the ones the multi-process tests validate;
this module is a shell around it and decides nothing:

- `submit` checks what the serving edge can check without the protocol (the prompt plus
  max_tokens fit the advertised context; sampling that the workers cannot honour yet is
  refused, `Unsupported`, an HTTP 400; at most `max_queued` requests live) and writes an
  "arrive" line to the router's stdin (the request number, its prompt pages, its payload);
  the router places it and takes the core's Arrive.
- The router reports each token the decode streams and each client's final state on
  stdout ("token", "answer"); a reader thread turns them into the contract's `TokenOut` and
  `Finished`, in order (one thread, one pipe). The text is decoded here, where the
  tokenizer is; an end-of-sequence token ends the request at the decode (the payload names
  the ids) and is not output, as in-process.
- `abort` writes "abort": the router takes the core's Abort (the client's CLIENT_GONE).
- Workers report their pool's occupancy when it changes ("pool", at most every
  `pool_report_s`); `snapshot` lists every process with its pid, role, pool and liveness
  (alive: the OS process runs and the router has not declared its epoch down).
- The router's exit (not a stop's) ends every live request ErrDecode, naming it, and the
  engine takes no request after (a router that died took its part, the clients' state,
  with it; the contract has no outcome of its own for that).
- `stop(drain_s)`: no new request; live ones run for up to drain_s; the rest are aborted
  through the router and answered within `abort_s_max`; then every process is told to
  stop (each ends its log) and whatever is left is killed.

The startup capacity check is each worker's own (engine/processes.py `capacity_refusal`):
a worker whose pool is below the advertised context refuses to join, naming itself and
both numbers, and the deployment is closed before any traffic.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import dataclass, field

from engine.generate import pages_needed
from engine.processes import Deployment, Launched, WorkerRefused
from engine.serving import Shape, advertised_context
from engine.service import (ContextTooLong, EngineStopped, Finished, Overloaded, PoolSnapshot,
                            Snapshot, TokenOut, Unsupported)
from engine.tokenizer import IncrementalText

@dataclass(frozen=True)
class EngineConfig(Shape):
    """The shape (engine/serving.py), and what a deployment of processes adds: its life's
    request numbers, its start and stop bounds, its logs. The pools are each worker's: the
    router lowers the context to them when asked (`advertised_context`), and a worker whose
    pool is below it refuses to join itself (engine/processes.py capacity_refusal), as a
    worker on another machine must."""

    requests_max: int = 10_000      # requests in one deployment's life (the spec's numbers)
    start_timeout_s: float = 300.0  # each process up (the model loaded) within this
    abort_s_max: float = 10.0       # stop: aborted requests answered within this
    stop_timeout_s: float = 30.0    # stop: every process ends its log and exits within this
    log_dir: str = ""               # the deployment's logs ("": a fresh temporary folder)

    POSITIVE = Shape.POSITIVE + ("requests_max", "start_timeout_s", "abort_s_max",
                                 "stop_timeout_s")


def deployment_for(model_path, config: EngineConfig, context: int) -> Deployment:
    pt = config.page_tokens
    log_dir = config.log_dir or tempfile.mkdtemp(prefix="kvproof-serve-")
    os.makedirs(log_dir, exist_ok=True)
    context_pages = -(-context // pt)
    return Deployment(
        prompts=(), serving_requests_max=config.requests_max, context_tokens=context,
        prefill_workers=config.prefill_workers, decode_workers=config.decode_workers,
        prefill_pages=config.prefill_pages, decode_pages=config.decode_pages,
        context_pages=context_pages,
        max_prompt_pages=context_pages, page_tokens=pt,
        prefill_chunk_tokens=config.prefill_chunk_tokens, max_batch=config.max_batch,
        model_dir=str(model_path), join_timeout_s=config.start_timeout_s,
        log_dir=log_dir,
        bugs=tuple(sorted(config.bugs)))


def build_engine(loaded_model, config: EngineConfig | dict | None = None) -> "ProcessEngine":
    """The engine over worker processes for a loaded model (engine.load.LoadedModel: its
    file is what every worker loads; the tokenizer stays here). Started here: a worker
    that refuses to join (the capacity check) is a RuntimeError naming it."""
    if config is None:
        config = EngineConfig()
    elif isinstance(config, dict):
        config = EngineConfig(**config)
    model_context = loaded_model.model.config.max_position_embeddings
    context = advertised_context(config, model_context)
    engine = ProcessEngine(config, deployment_for(loaded_model.path, config, context),
                           loaded_model.tokenizer, model_name=loaded_model.path.stem)
    engine.launch()
    return engine


@dataclass(eq=False)
class _Live:
    """The serving edge's side of one request."""

    request_id: int
    prompt_tokens: int
    on_event: object
    eos_ids: frozenset
    decoded: IncrementalText | None
    output_ids: list = field(default_factory=list)
    text: str = ""
    ended_by_eos: bool = False


class ProcessEngine:
    """engine/service.py's Engine over a deployment of worker processes."""

    def __init__(self, config: EngineConfig, deployment: Deployment, tokenizer,
                 model_name: str = "model") -> None:
        self.config, self.deployment = config, deployment
        self.tokenizer, self.model_name = tokenizer, model_name
        self.context_length = deployment.context_tokens
        self.launched = Launched(deployment, on_report=self._on_report)
        self._lock = threading.Lock()     # the live table and the router's stdin
        self._live: dict[int, _Live] = {}
        self._next_id = 0
        self._stopping = False
        self._pools: dict[str, dict] = {}  # process name -> its last pool report
        self._down: set[str] = set()       # processes the router declared down
        self._epochs: dict[str, int] = {}  # a restarted process -> its epoch (its life)
        self._outcomes: dict[str, int] = {}

    # -- start and stop -------------------------------------------------------------------

    def launch(self) -> None:
        """Every process up (the model loaded, the gloo world joined) or none."""
        try:
            self.launched.start(timeout_s=self.config.start_timeout_s)
        except WorkerRefused as refusal:
            self.launched.close()
            raise RuntimeError(str(refusal)) from None
        except BaseException:
            self.launched.close()
            raise
        threading.Thread(target=self._watch_router, name="kvproof-router-watch",
                         daemon=True).start()

    def _watch_router(self) -> None:
        """The router's exit: nothing can answer the live requests any more (their state
        was its part's), so each gets ErrDecode naming it, and no request is taken after.
        A stop empties the live table first, so a stop's exit answers nobody."""
        router = self.launched.children["router"]
        code = router.process.wait()
        router.reader.join(timeout=5)   # its last reports (answers) first
        with self._lock:
            self._stopping = True
            left, self._live = self._live, {}
        for live in left.values():
            live.on_event(Finished(live.request_id, "ErrDecode", None, None,
                                   live.prompt_tokens, len(live.output_ids),
                                   f"the router process exited (status {code})"))

    def start(self) -> None:
        """Nothing: build_engine started the processes (their start is the capacity check)."""

    def stop(self, drain_s: float = 0.0) -> None:
        with self._lock:
            self._stopping = True
        self._wait_idle(drain_s)
        with self._lock:
            live = sorted(self._live)
        for r in live:
            self.abort(r)
        self._wait_idle(self.config.abort_s_max)
        with self._lock:
            left, self._live = self._live, {}
        for live in left.values():  # unanswered within the bound: the server is stopping
            live.on_event(Finished(live.request_id, "Gone", None, None, live.prompt_tokens,
                                   len(live.output_ids), "the server stopped before it ended"))
        try:
            self.launched.stop(timeout_s=self.config.stop_timeout_s)
        except (TimeoutError, ProcessLookupError):
            pass  # close() below kills what did not stop
        finally:
            self.launched.close()

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._live:
                    return
            time.sleep(0.01)

    def workers_line(self) -> str:
        """One line for the operator: every process started, with its pid."""
        pids = ", ".join(f"{name} pid {child.process.pid}"
                         for name, child in self.launched.children.items())
        return f"processes: {pids}; logs in {self.deployment.log_dir}"

    # -- requests -------------------------------------------------------------------------

    def submit(self, request, on_event) -> int:
        refusal = unsupported(request)
        if refusal:
            raise Unsupported(refusal)
        sampling, prompt = request.sampling, len(request.prompt_ids)
        if prompt + sampling.max_tokens > self.context_length:
            raise ContextTooLong(prompt, sampling.max_tokens, self.context_length)
        eos = () if sampling.ignore_eos or self.tokenizer is None else tuple(
            sorted(self.tokenizer.eos_token_ids))
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is stopping")
            if len(self._live) >= self.config.max_queued:
                raise Overloaded(len(self._live), 1.0)
            if self._next_id >= self.config.requests_max:
                raise EngineStopped(f"this deployment has served its {self.config.requests_max}"
                                    " requests (restart it)")
            r, self._next_id = self._next_id, self._next_id + 1
            decoded = IncrementalText(self.tokenizer) if self.tokenizer is not None else None
            self._live[r] = _Live(r, prompt, on_event, frozenset(eos), decoded)
            self._tell_router({"do": "arrive", "request": r, "pages": pages_needed(
                prompt, sampling.max_tokens, self.deployment.page_tokens), "payload": [
                list(request.prompt_ids), sampling.max_tokens, list(eos)]})
        return r

    def abort(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._live:
                self._tell_router({"do": "abort", "request": request_id})

    def _tell_router(self, command: dict) -> None:
        """One line to the router's stdin (the caller holds the lock: lines never mix)."""
        import json
        child = self.launched.children["router"]
        try:
            child.process.stdin.write(json.dumps(command) + "\n")
            child.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the router is gone: stop() answers what is live

    # -- the processes' reports (their reader threads) ------------------------------------

    def _on_report(self, name: str, report: dict) -> bool:
        """Serving's reports, taken here; the launcher's own ("listening", "stopped", ...)
        go on to it."""
        kind = report["ev"]
        if kind == "pool":
            self._pools[name] = report
        elif kind == "peer_down" and name == "router":
            role, _, worker = report["peer"].partition(" ")
            self._down.add(f"{role} {worker}".strip())
        elif kind == "restart":  # its next life is starting (Launched.restart)
            restarted = f"{report['role']} {report['worker']}"
            self._epochs[restarted] = report["restart"]["epoch"]
            self._down.discard(restarted)
        elif kind == "token":
            self._token(report["request"], report["token"])
        elif kind == "answer":
            self._answer(report["request"], report["outcome"], report.get("detail", ""))
        else:
            return False
        return kind != "peer_down"

    def _token(self, r: int, token: int | None) -> None:
        live = self._live.get(r)
        if live is None or token is None:  # None: a failed tag check; the answer says so
            return
        if token in live.eos_ids:
            live.ended_by_eos = True  # the decode ended it here; not output
            return
        live.output_ids.append(token)
        text = live.decoded.update(live.output_ids) if live.decoded is not None else ""
        delta, live.text = text[len(live.text):], text
        live.on_event(TokenOut(r, token, delta))

    def _answer(self, r: int, outcome: str, detail: str) -> None:
        with self._lock:
            live = self._live.pop(r, None)
            self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
        if live is None:
            return
        reason = None
        if outcome == "Ok":
            reason = "stop" if live.ended_by_eos else "length"
        live.on_event(Finished(r, outcome, reason, None, live.prompt_tokens,
                               len(live.output_ids), detail))

    # -- the state ------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._lock:
            live, outcomes = len(self._live), dict(self._outcomes)
        pools, workers = [], []
        for name, child in self.launched.children.items():
            role = name.split(" ")[0]
            alive = child.process.poll() is None and name not in self._down
            pool = self._pools.get(name, {})
            workers.append({"name": name.replace(" ", "-"), "role": role,
                            "pid": child.process.pid, "alive": alive,
                            "epoch": self._epochs.get(name, 1),
                            "exit_code": child.process.poll(), **{
                                k: pool.get(k) for k in ("pages", "free", "held",
                                                         "writes_in_flight", "requests_known")}})
            if role != "router":
                pages = pool.get("pages", 0)
                pools.append(PoolSnapshot(name.replace(" ", "-"), pages, pool.get("free", pages),
                                          pool.get("held", 0), 0, pool.get("writes_in_flight", 0)))
        pools.sort(key=lambda p: (p.worker.split("-")[0] != "prefill", p.worker))
        return Snapshot(pools=tuple(pools), queued=0, running=live, recent=(),
                        outcomes=outcomes, workers=tuple(workers))


def unsupported(request) -> str:
    """Why the worker processes cannot serve this request yet ("" when they can): their
    decode is greedy, samples no logprobs, and has no tokenizer for stop strings."""
    sampling = request.sampling
    asked = []
    if sampling.temperature != 0:
        asked.append(f"temperature {sampling.temperature:g}")
    if sampling.top_p != 1:
        asked.append(f"top_p {sampling.top_p:g}")
    if sampling.top_k != 0:
        asked.append(f"top_k {sampling.top_k}")
    if sampling.stop:
        asked.append("stop strings")
    if request.logprobs is not None:
        asked.append("logprobs")
    if not asked:
        return ""
    return (f"{', '.join(asked)}: not served by worker processes yet (their decoding is "
            "greedy, ends at max_tokens or end of sequence); send temperature 0 or serve "
            "without --processes")
