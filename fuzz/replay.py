"""Failing sequences: replay them, cut them down, and keep them in a file.

A failure is a model plus a list of concrete core events. Replaying it resets a target on the
model, takes the events one by one and runs the same checks after each; it reports the first
violation. Replay does not involve Hypothesis, so a saved failure replays on any machine and
any Hypothesis version, and stays a regression test after the bug is fixed.

`minimize` cuts a failing sequence down after Hypothesis has shrunk the example that produced
it. Hypothesis shrinks the choices it made; the drain's events and events of bystander
requests are not choices, and usually most of a trace. Deleting every event of one request,
then chunks of events (largest first, as in delta debugging), while the replay still
violates the same property gives the minimal interleaving that is printed and saved. It is
minimal in that no single event or listed chunk can go, not the shortest possible.

The file is an ITF trace (spec/tlaplus/itf.py): the protocol state after every event, and under
"#meta" the model and, in "fuzz", the target, seed, swarm setup, the events as data and the
violation. `--replay` reads the events, not the states.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from pathlib import Path

from spec import codec, core
from spec.tlaplus.itf import model_from_meta, trace_to_itf
from spec.model import Model, ModelError

from sim import crash as shell_crash

from fuzz import oracles
from fuzz.oracles import Checks
from fuzz.target import MOVE_TYPES, AtWorker, MidStep, TargetRefused, Violation, load_targets

FORMAT = "kvproof-fuzz/2"  # /2: events in spec/codec.py's records


class ReplayError(ValueError):
    """A replay file that cannot be read, or whose events the target refuses."""


@dataclass(frozen=True)
class Replayed:
    """The first violation of a replay: after how many events, and which checks failed."""

    steps: int
    violations: list[Violation]
    story: tuple[str, ...] = ()  # what the target did on its own (target.story())

    @property
    def property(self) -> str:
        return self.violations[0].property


def replay(target_name: str, m: Model, events: list[core.Event], checks: Checks,
           states: list | None = None, seed: int = 0) -> Replayed | None:
    """Take `events` on a fresh target reset with `seed` (the example's: it drives the
    simulator's timing); the first violation, or None if every check holds.
    Raises TargetRefused when the target refuses an event. With `states`, appends the
    protocol state after reset and after every event. The target lists its moves after
    every event, as the fuzzer has it do, so that a target that crashes listing them
    crashes on replay too."""
    target = load_targets()[target_name]()
    try:
        target.reset(m, seed=seed)
        if states is not None:
            states.append((None, target.protocol_state()))
        found = oracles.check(checks, m, target)
        target.enabled()
    except Exception as error:  # noqa: BLE001  the shell crashed: a finding (sim/crash.py)
        return Replayed(0, [shell_crash.as_violation(error)])
    if found:
        return Replayed(0, found)
    for k, event in enumerate(events):
        try:
            target.step(event)
            if states is not None:
                states.append((event, target.protocol_state()))
            found = oracles.check(checks, m, target)
            target.enabled()
        except TargetRefused:
            raise
        except Exception as error:  # noqa: BLE001
            return Replayed(k + 1, [shell_crash.as_violation(error)], tuple(target.story()))
        if found:
            return Replayed(k + 1, found, tuple(target.story()))
    return None


def minimize(target_name: str, m: Model, events: list[core.Event], checks: Checks,
             prop: str, seconds_max: float, seed: int = 0) -> tuple[list[core.Event], Replayed]:
    """A shorter sequence that still violates `prop`, from deleting chunks of events."""
    result = _fails(target_name, m, events, checks, prop, seed)
    assert result is not None, f"the sequence to minimize does not violate {prop}"
    current = events[:result.steps]
    deadline = time.perf_counter() + seconds_max
    # Bystander requests first: deleting one event of a request usually makes its later
    # events illegal, deleting all of them at once does not.
    for r in sorted({e.request for e in current if hasattr(e, "request")}, reverse=True):
        if time.perf_counter() >= deadline:
            break
        candidate = [e for e in current if getattr(e, "request", None) != r]
        found = _fails(target_name, m, candidate, checks, prop, seed)
        if found is not None:
            current = candidate[:found.steps]
    chunk = max(1, len(current) // 2)
    while chunk >= 1 and time.perf_counter() < deadline:
        start = 0
        while start < len(current) and time.perf_counter() < deadline:
            candidate = current[:start] + current[start + chunk:]
            found = _fails(target_name, m, candidate, checks, prop, seed)
            if found is not None:
                current = candidate[:found.steps]
            else:
                start += chunk
        chunk //= 2
    final = _fails(target_name, m, current, checks, prop, seed)
    assert final is not None, "minimizing lost the violation"
    return current, final


def _fails(target_name: str, m: Model, events: list[core.Event], checks: Checks,
           prop: str, seed: int) -> Replayed | None:
    try:
        found = replay(target_name, m, events, checks, seed=seed)
    except TargetRefused:
        return None  # the deletion made a later event illegal
    if found is None or prop not in {v.property for v in found.violations}:
        return None
    return found


def encode_event(event: core.Event) -> dict:
    """A move as a record: a protocol event in spec/codec.py's form; the fuzzer's own moves
    (Wait, Delay, a crash at a chosen worker, an abort inside a decode step) in the same
    form with their fields."""
    if type(event) is AtWorker:
        return {codec.ACTION_KEY: event.action, "worker": event.worker}
    if type(event) is MidStep:
        return {**codec.encode(core.Abort(event.request)), "at_permille": event.at_permille}
    if event.action in core.EVENT_TYPES:
        return codec.encode(event)
    out: dict = {codec.ACTION_KEY: event.action}
    for f in fields(event):
        out[f.name] = getattr(event, f.name)
    return out


def decode_event(data: dict) -> core.Event:
    if not isinstance(data, dict) or data.get(codec.ACTION_KEY) not in MOVE_TYPES:
        raise ReplayError(f"not an event of spec/core.py (nor Wait, Delay or WireFault): {data!r}")
    cls = MOVE_TYPES[data[codec.ACTION_KEY]]
    if cls in (core.PrefillCrash, core.DecodeCrash) and "worker" in data:
        if type(data["worker"]) is not int or data["worker"] < 0:
            raise ReplayError(f"event {data!r}: worker must be a non-negative integer")
        return AtWorker(cls(), data["worker"])
    if cls is core.Abort and "at_permille" in data:
        moment = data["at_permille"]
        if type(moment) is not int or not 1 <= moment <= 999 \
                or type(data.get("request")) is not int:
            raise ReplayError(f"event {data!r}: at_permille must be an integer in 1..999, "
                              "request an integer")
        return MidStep(data["request"], moment)
    if data[codec.ACTION_KEY] in core.EVENT_TYPES:
        try:
            return codec.decode(data)
        except codec.CodecError as error:
            raise ReplayError(str(error)) from None
    try:
        args = {f.name: data[f.name] for f in fields(cls)}
    except KeyError as error:
        raise ReplayError(f"event {data!r} lacks the field {error}") from None
    if not all(type(v) is int for v in args.values()):
        raise ReplayError(f"event {data!r}: fields must be integers")
    return cls(**args)


@dataclass(frozen=True)
class SavedFailure:
    target: str
    model: Model
    properties: tuple[str, ...] | None
    events: list[core.Event]
    violation: str
    steps: int
    seed: int | None
    target_seed: int = 0  # the example's seed, which the target was reset with


def write(path: str | Path, failure: SavedFailure, extra: dict) -> None:
    """The failure as an ITF trace with the fuzz data under #meta.fuzz."""
    states: list = []
    checks = Checks.for_properties(failure.properties)
    replay(failure.target, failure.model, failure.events, checks, states, failure.target_seed)
    itf = trace_to_itf(failure.model, states, f"kvproof fuzz: {failure.violation} after "
                       f"{failure.steps} events on the {failure.target} target")
    itf["#meta"]["fuzz"] = {
        "format": FORMAT, "target": failure.target, "seed": failure.seed,
        "properties": list(failure.properties) if failure.properties is not None else None,
        "target_seed": failure.target_seed,
        "events": [encode_event(e) for e in failure.events],
        "violation": failure.violation, "steps": failure.steps, **extra}
    Path(path).write_text(json.dumps(itf, indent=1) + "\n")


def load(path: str | Path) -> SavedFailure:
    try:
        data = json.loads(Path(path).read_text())
        meta = data["#meta"]
        fuzz, model = meta["fuzz"], model_from_meta(meta["model"])
    except (OSError, json.JSONDecodeError) as error:
        raise ReplayError(f"cannot read {path}: {error}") from None
    except UnicodeDecodeError as error:
        raise ReplayError(f"{path}: not a text file (byte {error.start} is not UTF-8)") from None
    except (KeyError, TypeError, ModelError) as error:
        missing = f"no {error}" if isinstance(error, KeyError) else str(error)
        raise ReplayError(f"{path} is not a kvproof fuzz failure ({missing})") from None
    if not isinstance(fuzz, dict) or fuzz.get("format") != FORMAT:
        raise ReplayError(f"{path}: unknown format {fuzz.get('format')!r}; expected {FORMAT}")
    if fuzz.get("target") not in load_targets():
        raise ReplayError(f"{path}: unknown target {fuzz.get('target')!r}; "
                          f"known: {', '.join(sorted(load_targets()))}")
    props = fuzz.get("properties")
    events = [decode_event(e) for e in fuzz.get("events", [])]
    return SavedFailure(fuzz["target"], model, tuple(props) if props is not None else None,
                        events, str(fuzz.get("violation")), int(fuzz.get("steps", -1)),
                        fuzz.get("seed"), int(fuzz.get("target_seed", 0)))


def failure_run(path: str | Path) -> "Run":
    """A saved failure of the core target as a run for spec/tlaplus/runcheck.py: its events
    (numbered as in #meta.fuzz.events), on the failure's own model. The other targets'
    events are the fuzzer's moves on a shell (a crash at a chosen worker, a wait, a wire
    fault), not protocol events alone: those replay with `kvproof fuzz --replay`."""
    from spec.tlaplus.runcheck import Run

    try:
        target = json.loads(Path(path).read_text())["#meta"]["fuzz"]["target"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        target = None  # load() says what is wrong
    if target is not None and target != "core":
        raise ReplayError(f"{path} is a saved fuzz failure of the {target} target, whose "
                          f"events are the fuzzer's moves on a shell: replay it with kvproof "
                          f"fuzz --replay {path}")
    failure = load(path)
    moves = [e.action for e in failure.events if type(e) not in core.EVENT_TYPES.values()]
    if moves:
        raise ReplayError(f"{path}: its events include the fuzzer's own moves ({moves[0]}): "
                          f"replay it with kvproof fuzz --replay {path}")
    records = [(k, codec.encode(e)) for k, e in enumerate(failure.events, start=1)]
    m = failure.model
    return Run(str(path), m, m, records, m.prefill_workers, m.decode_workers, unit="event",
               description=f"a saved fuzz failure ({failure.violation})")
