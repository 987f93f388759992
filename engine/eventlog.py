"""The engine's event log, and its replay through the core.

A log is ndjson: a header line (format, the deployment's protocol configuration: pool and
context sizes in pages, bug switches, how many prefill and decode workers), then one record
per event the core accepted, in spec/codec.py's format (the simulator's and the fuzzer's
records, with the engine's time "t" beside them, and an Arrive's placement "p" and "d"),
then an end record. `replay` folds the records through a fresh
spec.store.Store: every event must be accepted again and the store's oracles must stay
quiet, which shows the engine changed no protocol state behind the core's back.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from engine.prefix import with_caches
from spec import codec, core
from spec.core import Refusal
from spec.model import Model, ProtocolConfig
from spec.store import Store
from spec.tlaplus.runcheck import Run

LOG_FORMAT = "kvproof-engine-log/1"
RUN_END = "RunEnd"


class LogError(ValueError):
    """A log that is not a run of this protocol (user input, reported clearly)."""


def write_log(path: str | Path, header: dict, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for line in (header, *records, {"a": RUN_END, "events": len(records)}):
            out.write(json.dumps(line, separators=(",", ":")) + "\n")


def read_log(path: str | Path) -> tuple[dict, list[dict]]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines:
        raise LogError(f"{path} is empty")
    header = json.loads(lines[0])
    if header.get("format") != LOG_FORMAT:
        raise LogError(f"{path}: not a kvproof engine log (format {header.get('format')!r})")
    records = [json.loads(line) for line in lines[1:]]
    if not records or records[-1].get("a") != RUN_END:
        raise LogError(f"{path}: no end record: the run did not finish writing its log")
    return header, records[:-1]


def model_of(header: dict) -> Model:
    protocol = ProtocolConfig(header["context_pages"], header["prefill_pages"],
                              header["decode_pages"], frozenset(header["bugs"]))
    shell = Model.for_shell(protocol, header["max_prompt_pages"], name="engine-replay",
                            crashes=False, decode_crashes=False)
    return with_caches(shell, bool(header.get("prefix_cache")),
                       bool(header.get("prefill_cache")))


def replay(header: dict, records: list[dict]) -> Store:
    """The store after folding every record through the core; LogError on a refusal."""
    workers = header.get("prefill_workers", 1), header.get("decode_workers", 1)
    store = Store(model_of(header), *workers)
    for k, record in enumerate(records, start=2):
        try:
            event = codec.decode(record)
        except codec.CodecError as error:
            raise LogError(f"line {k}: {error}") from None
        if isinstance(event, core.WorkerEvent):  # the decode cache's pick, decided by the core
            out = store.take_worker_event(event)
            if type(out) is Refusal:
                raise LogError(f"line {k}: the core refuses {out}: not a run of the protocol")
            continue
        r = event.request
        if type(event) is core.Arrive:
            p, d = record.get("p", 0), record.get("d", 0)
            if not (0 <= p < workers[0] and 0 <= d < workers[1]):
                raise LogError(f"line {k}: placement ({p}, {d}) names a worker the header "
                               f"does not have ({workers[0]} prefill, {workers[1]} decode)")
            store.arrive(r, p, d)
        out = store.take(r, event)
        if type(out) is Refusal:
            raise LogError(f"line {k}: the core refuses {out}: not a run of the protocol")
        if core.settled(store.rows[r]):
            store.forget(r)
    return store


def core_trace(header: dict, records: list[dict]) -> tuple[Model, list]:
    """The run as a behaviour of the spec's finite model: (Model with one request per
    request of the log, [(event or None, core State), ...]) by core.apply from the initial
    state, for ITF output and validation (`kvproof validate`, the TLA+ evaluator). The
    engine numbers requests 0, 1, ... in arrival order, which are the model's requests.
    The spec has one prefill and one decode worker: a log of more is refused."""
    if header.get("prefill_workers", 1) != 1 or header.get("decode_workers", 1) != 1:
        raise LogError("the spec's model has one prefill and one decode worker; this run had "
                       f"{header.get('prefill_workers')} and {header.get('decode_workers')} "
                       "(replay it through the store instead)")
    events = []
    for k, record in enumerate(records, start=2):
        try:
            events.append(codec.decode(record))
        except codec.CodecError as error:
            raise LogError(f"line {k}: {error}") from None
    requests = 1 + max((e.request for e in events if not isinstance(e, core.WorkerEvent)),
                       default=0)
    m = Model(requests=requests, max_prompt_pages=header["max_prompt_pages"],
              context_pages=header["context_pages"], prefill_pages=header["prefill_pages"],
              decode_pages=header["decode_pages"], bugs=frozenset(header["bugs"]),
              name="engine-run")
    m = with_caches(m, bool(header.get("prefix_cache")), bool(header.get("prefill_cache")))
    state = core.initial_state(m)
    steps: list = [(None, state)]
    for k, event in enumerate(events, start=2):
        out = core.apply(m, state, event)
        if type(out) is Refusal:
            raise LogError(f"line {k}: the core refuses {out}: not a run of the protocol")
        state = out
        steps.append((event, state))
    return m, steps


def log_run(path: str | Path) -> Run:
    """An engine log as a run for spec/tlaplus/runcheck.py (`kvproof validate`): its events
    with their lines, the spec's constants with one request per request of the run (the
    engine numbers them 0, 1, ... in arrival order)."""
    try:
        header, records = read_log(path)
        shell = model_of(header)
        workers = int(header.get("prefill_workers", 1)), int(header.get("decode_workers", 1))
    except (OSError, UnicodeDecodeError) as error:
        raise LogError(f"cannot read {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise LogError(f"{path} line {error.lineno}: not a JSON record ({error.msg})") from None
    except (KeyError, TypeError, ValueError) as error:
        raise LogError(f"{path} line 1: malformed header ({error})") from None
    ids = [x["request"] for x in records if type(x.get("request")) is int]
    requests = max(1, 1 + max(ids, default=0))
    return Run(str(path), replace(shell, requests=requests, request_names=(),
                                  name="engine-run", prefill_workers=workers[0],
                                  decode_workers=workers[1]),
               shell, list(enumerate(records, start=2)), *workers,
               f"engine run, {workers[0]} x {workers[1]} workers")
