"""A simulator log as an ITF trace of KVTransfer.tla, for `kvproof validate`.

The spec has one prefill and one decode worker, so a cluster of exactly that shape maps onto
it with nothing renamed: request k of the run is the spec's k-th request, pages keep their
numbers. Each logged core event becomes one step (shell facts such as FirstToken are not
protocol steps and are skipped). The states are rebuilt by the core from the events alone,
and `kvproof validate` then checks every step, label and state against the spec.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from spec import core
from spec.core import Refusal
from spec.tlaplus.runcheck import Run
from spec.tlaplus.itf import trace_to_itf
from spec.model import Model, ModelError
from spec.partlog import FORMAT as PART_LOG_FORMAT, PartLogs, file_name, header
from sim.fold import FIRST_TOKEN, RUN_END, LogError, event_of, model_for, read_log


def log_to_itf(path: str) -> tuple[Model, dict]:
    scenario, records = read_log(path)
    c = scenario.cluster
    if c.prefill_workers != 1 or c.decode_workers != 1:
        raise LogError(f"{path}: only a run with one prefill and one decode worker maps onto the "
                       f"spec's state (this one has {c.prefill_workers} and {c.decode_workers})")
    m = Model(**{**_constants(model_for(scenario)), "requests": scenario.requests})
    state = core.initial_state(m)
    steps: list[tuple[core.Event | None, core.State]] = [(None, state)]
    for k, record in enumerate(records, start=2):
        if record["a"] in (FIRST_TOKEN, "RunEnd"):
            continue
        event = event_of(record)
        out = core.apply(m, state, event)
        if type(out) is Refusal:
            raise LogError(f"{path} line {k}: the core refuses {out}")
        state = out
        steps.append((event, state))
    return m, trace_to_itf(m, steps, description=f"simulator run of {scenario.name}, "
                                                  f"seed {scenario.seed}")


def _constants(m: Model) -> dict:
    return {"max_prompt_pages": m.max_prompt_pages, "context_pages": m.context_pages,
            "prefill_pages": m.prefill_pages, "decode_pages": m.decode_pages,
            "bugs": m.bugs, "crashes": m.crashes, "name": m.name,
            "prefix_cache": m.prefix_cache, "tokens": m.tokens, "tenants": m.tenants,
            "prefill_cache": m.prefill_cache}


def log_run(path: str) -> Run:
    """A simulator log as a run for spec/tlaplus/runcheck.py: its protocol events with their
    lines, the spec's constants with one request per request of the run and the run's
    worker sets."""
    scenario, records = read_log(path)
    if not records or records[-1].get("a") != RUN_END:
        raise LogError(f"{path}: the log has no end record: the run that wrote it did not "
                       "finish, or the file was cut (at a line boundary)")
    events = [(k, record) for k, record in enumerate(records[:-1], start=2)
              if record.get("a") != FIRST_TOKEN]
    shell = model_for(scenario)
    c = scenario.cluster
    requests = max(scenario.requests, _requests(events))  # one model for every seed
    spec = replace(shell, requests=requests, name=scenario.name, request_names=(),
                   prefill_workers=c.prefill_workers, decode_workers=c.decode_workers)
    return Run(str(path), spec, shell, events, c.prefill_workers, c.decode_workers,
               f"simulator run of {scenario.name}, seed {scenario.seed}")


def _requests(events: list[tuple[int, dict]]) -> int:
    """One spec request per request id of the run (ids are 0, 1, ... in arrival order)."""
    ids = [record["request"] for _, record in events if type(record.get("request")) is int]
    return max(1, 1 + max(ids, default=0))


# -- the per-part logs of a split deployment (spec/partlog.py) ------------------------------

def write_part_logs(logs: PartLogs, directory: str | Path) -> list[Path]:
    """Each part's log as its own file in `directory` (one per process of a deployment),
    the deployment's header first."""
    head = header(logs.model)
    paths = []
    for name, records in logs.logs().items():
        path = Path(directory) / file_name(name)
        path.write_text("".join(json.dumps(x) + "\n" for x in [head, *records]))
        paths.append(path)
    return paths


def read_part_logs(paths: list[str | Path]) -> tuple[Model, list]:
    """The deployment's model and each file's (line, record) pairs, for spec/partlog.merge.
    Every file must be a part log of the same constants."""
    model, logs, first = None, [], None
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise LogError(f"cannot read {path}: {error}") from None
        try:
            head = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError as error:
            raise LogError(f"{path} line 1: malformed header ({error.msg})") from None
        if not isinstance(head, dict) or head.get("format") != PART_LOG_FORMAT:
            raise LogError(f"{path}: not a kvproof part log (its first line names no format "
                           f"{PART_LOG_FORMAT!r})")
        if model is None:
            try:
                model = Model.from_tla_constants(head.get("constants") or {},
                                                 str(head.get("name", "deployment")))
            except ModelError as error:
                raise LogError(f"{path} line 1: {error}") from None
            first = (path, head.get("constants"))
        elif head.get("constants") != first[1]:
            raise LogError(f"{path}: its constants differ from {first[0]}'s: the logs of "
                           "one deployment share them")
        records = []
        for k, line in enumerate(lines[1:], start=2):
            try:
                records.append((k, json.loads(line)))
            except json.JSONDecodeError as error:
                raise LogError(f"{path} line {k}: malformed record ({error.msg}): the log is "
                               "cut or damaged there") from None
        logs.append((str(path), records))
    if model is None:
        raise LogError("no part log given")
    return model, logs
