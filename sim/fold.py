"""The event log and the fold over it: state and metrics are a function of the log alone.

A log is ndjson: a header line (format, seed, the whole scenario), then one line per event
the core accepted, in order: {"t": simulated seconds, "a": action, "request": r, ...} (spec/codec.py). The
action names are the TLA+ actions' (STYLE 3); the arguments are those of the core's event
(Arrive also records where the router placed the request and its output length). One shell
fact is logged besides the core's events: FirstToken, when decode emits a request's first
token, which the metrics need and the protocol does not see.

`Folder.apply` is the only path by which a record changes anything, in a live run as in a
replay: the live simulator builds a record, the Folder hands its event to the core, and
only an accepted event is written to the log. So a replay of a log (`replay`) rebuilds the
final state and every metric exactly, and a record the core refuses on replay means the log
is not a run of this protocol.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from spec import codec, core
from spec.core import CLIENT, HIT, OK, PROMPT, PST, RUNNING, Change, Refusal
from spec.model import Model, ProtocolConfig
from spec.store import Store
from sim.metrics import Metrics
from sim.scenario import Scenario, ScenarioError, scenario_from_dict

LOG_FORMAT = "kvproof-sim-log/2"  # /2: events in spec/codec.py's records
FIRST_TOKEN = "FirstToken"
RUN_END = "RunEnd"  # the last line: whether the run drained, or why it stopped

# The events that report an observed verdict (core.INFO's `observed`).
_OBSERVING = frozenset(cls for cls, info in core.INFO.items() if info.observed is not None)


class LogError(ValueError):
    """A log file that is not a run of this protocol (user input, reported clearly)."""


def model_for(scenario: Scenario) -> Model:
    """The core's Model for the scenario's deployment (any worker pair has the same)."""
    c = scenario.cluster
    protocol = ProtocolConfig(context_pages=c.context_pages, prefill_pages=c.prefill_pages,
                              decode_pages=c.decode_pages, bugs=frozenset(scenario.bugs))
    shell = Model.for_shell(protocol, prompt_pages_max(scenario), name=scenario.name,
                            crashes=scenario.faults.prefill_crash_rate_per_s > 0,
                            decode_crashes=scenario.faults.decode_crash_rate_per_s > 0)
    shell = replace(shell, losses=losses_of(scenario.faults))
    prefix = scenario.prefix
    return (shell.with_prefix_cache(prefix.tenants, prefill_cache=prefix.prefill_cache)
            if prefix.cache else shell)


def prompt_pages_max(scenario: Scenario) -> int:
    """The longest prompt the scenario's clients send: the workload's longest, and with a
    prefix shape that as a prompt's own part after the shared one (sim/workload.py; a
    session grows up to the context, then starts over)."""
    c, prefix = scenario.cluster, scenario.prefix
    own = -(-scenario.workload.prompt.max_tokens // c.page_tokens)
    if prefix.shape == "none":
        return own
    longest = own + -(-prefix.shared_tokens // c.page_tokens)
    return max(longest, c.context_pages) if prefix.shape == "sessions" else longest


def losses_of(faults) -> frozenset[str]:
    """What the scenario's network may lose for good (the spec's Losses): any lossy link's
    messages (after its retransmissions), and page writes where they are lost silently."""
    kinds = {"Bootstrap", "FinalWord", "Cancel"} if faults.message_loss_probability else set()
    return frozenset(kinds | ({"Write"} if faults.write_loss_probability else set()))


def event_of(record: dict) -> core.Event:
    """The core event a log record stands for (spec/codec.py, the one event codec)."""
    try:
        return codec.decode(record)
    except codec.CodecError as error:
        raise LogError(str(error)) from None


@dataclass
class Folder:
    """Cluster state and metrics, advanced one log record at a time."""

    scenario: Scenario
    model: Model | None = None  # None: the scenario's own (model_for); the fuzzer sets its own

    def __post_init__(self) -> None:
        sc = self.scenario
        self.model = self.model or model_for(sc)
        self.cluster = Store(self.model, sc.cluster.prefill_workers, sc.cluster.decode_workers)
        page_bytes = sc.cluster.page_tokens * sc.link.kv_bytes_per_token
        m = self.model
        self.metrics = Metrics(page_bytes, m.prefill_pages,
                               m.decode_pages * sc.cluster.decode_workers,
                               fits_pages=min(m.advertised_context_pages, m.prefill_pages,
                                              m.decode_pages),
                               decode_workers=sc.cluster.decode_workers)
        self.events = 0
        # The last accepted event's effect, for the live simulator to react to.
        self.last_placement = (0, 0)

    def apply(self, record: dict) -> Change | Refusal | None:
        """Take one record; None for a shell fact, else the core's answer."""
        t, action = record["t"], record["a"]
        m = self.metrics
        m.last_event_s = t
        if action == FIRST_TOKEN:
            m.first_token(t, record["request"])
            return None
        if action == "PrefillCrash":
            return self._crash(t, self.cluster.crash_prefill, record["p"])
        if action == "DecodeCrash":
            return self._crash(t, self.cluster.crash_decode, record["d"])
        event = event_of(record)
        if isinstance(event, core.WorkerEvent):  # an eviction (the crashes are above)
            return self.evict(t, event)
        if action == "Arrive":
            return self.arrive(t, event, record["p"], record["d"], record["out"])
        r = event.request
        out = self.cluster.decide(r, event)
        if type(out) is Refusal:
            return out
        self.accept(t, r, out, event)
        return out

    def arrive(self, t: float, event: core.Arrive, p: int, d: int,
               output_tokens: int) -> Change | Refusal:
        """An Arrive and the shell's facts beside it (placement, output length): a record's
        or, in a live run, the event itself (no record to encode and decode again)."""
        r = event.request
        self.metrics.last_event_s = t
        self.cluster.arrive(r, p, d)
        event = replace(event, prefill_worker=p, decode_worker=d)  # the router's placement
        out = self.cluster.decide(r, event)
        if type(out) is Refusal:
            self.cluster.withdraw(r)
            return out
        self.metrics.arrive(t, r, event.prompt_pages, output_tokens)
        self.accept(t, r, out, event)
        return out

    def evict(self, t: float, event: core.Evict | core.PrefillEvict) -> Change | Refusal:
        """Either side's cache forgets a page (a record's, or a live worker's LRU pick)."""
        out = self.cluster.take_worker_event(event)
        if type(out) is not Refusal:
            self.events += 1
            if type(event) is core.Evict:
                self.metrics.evicted_pages += 1
            else:
                self.metrics.prefill_evicted_pages += 1
        return out

    def accept(self, t: float, r: int, change: Change, event: core.Event) -> None:
        """Commit a change the core decided for request r, and fold it into the metrics:
        the one path by which a live run and a replay change anything."""
        cluster = self.cluster
        if type(event) in _OBSERVING:  # most events observe nothing
            cluster.check_observation(r, event)
        old = cluster.rows[r]
        self.last_placement = cluster.placement[r]
        cluster.commit(r, change)
        m = self.metrics
        m.last_event_s = t
        self.events += 1
        # What the change means for the metrics (one function with the commit: every event).
        new = cluster.rows[r]
        if change.landed:
            m.pages_written += len(change.landed)
        kind = type(event)
        if kind is core.Reserve:
            m.reserved(new[PROMPT], new[HIT])
        elif kind is core.Admit:
            m.admitted(new[PROMPT], core.pages_to_compute(self.model, new))
        if cluster.moved_decode:  # an owner changed (a landing write changes no count)
            d = self.last_placement[1]
            m.decode_pages_changed(t, cluster.decode_pages_used, d, cluster.decode_used(d))
        if new is old:
            return
        if new[CLIENT] != old[CLIENT]:
            if new[CLIENT] == OK and cluster.leak_check(r):
                m.leak(r, ok=True)
            m.answered(t, r, old, new)
        if new[PST] != RUNNING and core.settled(new):  # (running: never settled)
            cluster.forget(r)
            m.forget(r)

    def _crash(self, t: float, crash, worker: int) -> Change | Refusal:
        olds = {r: row for r, row in self.cluster.rows.items()}
        out = crash(worker)
        if type(out) is not Refusal:
            self.events += 1
            if out.decode:  # only a decode crash frees decode pages: `worker` is decode's
                self.metrics.decode_pages_changed(t, self.cluster.decode_pages_used, worker,
                                                  self.cluster.decode_used(worker))
            for r, row in out.rows:
                self.metrics.answered(t, r, olds[r], row)
                if core.settled(row):
                    self.cluster.forget(r)
                    self.metrics.forget(r)
        return out


def write_header(out, scenario: Scenario) -> None:
    dump = scenario.model_dump(mode="json")
    if not scenario.hybrid.enabled:
        del dump["hybrid"]  # a fully simulated run's header as before hybrid runs existed
    if scenario.prefix.shape == "none":
        del dump["prefix"]  # and before prompts had tokens
    header = {"format": LOG_FORMAT, "seed": scenario.seed, "scenario": dump}
    out.write(json.dumps(header, sort_keys=True, separators=(",", ":")) + "\n")


def encode(record: dict) -> str:
    return json.dumps(record, separators=(",", ":"))


class LogFile:
    """A live run's event log (the one runtime's `event_log`, spec/runtime.py): one record
    per committed event, an Arrive with the shell's facts beside it (placement p, d and
    output length out, looked up with `output_of(r)`), which `Folder.apply` reads back."""

    def __init__(self, out, output_of) -> None:
        self.out, self.output_of = out, output_of

    def record(self, now: float, event: core.Event, p: int, d: int) -> None:
        record = {"t": now, **codec.encode(event)}
        if type(event) is core.Arrive:
            record.update(p=p, d=d, out=self.output_of(event.request))
        self.out.write(encode(record) + "\n")


def read_log(path: str | Path):
    """The scenario and the records of a log file."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise LogError(f"cannot read {path}: {error}") from None
    if not lines:
        raise LogError(f"{path} is empty")
    try:
        header = json.loads(lines[0])
        if header.get("format") != LOG_FORMAT:
            raise LogError(f"{path}: not a kvproof simulator log (format {header.get('format')!r})")
        scenario = scenario_from_dict(header["scenario"], where=f"{path} header")
    except (json.JSONDecodeError, KeyError, AttributeError) as error:
        raise LogError(f"{path} line 1: malformed header: {error}") from None
    except ScenarioError as error:
        raise LogError(str(error)) from None
    records = []
    for k, line in enumerate(lines[1:], start=2):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise LogError(f"{path} line {k}: malformed record ({error.msg}): the log is cut "
                           "or damaged there") from None
    return scenario, records


def replay(path: str | Path) -> tuple[Folder, dict]:
    """Rebuild the final state and the metrics of a run from its log alone; also the run's
    end record (empty if the run did not finish writing its log)."""
    scenario, records = read_log(path)
    folder = Folder(scenario)
    if not records or records[-1].get("a") != RUN_END:
        raise LogError(f"{path}: the log has no end record: the run that wrote it did not "
                       "finish, or the file was cut (at a line boundary)")
    end = records.pop()
    for k, record in enumerate(records, start=2):
        try:
            out = folder.apply(record)
        except (KeyError, TypeError, ValueError, core.ProtocolMisuse) as error:
            raise LogError(f"{path} line {k}: malformed record {record}: {error}") from None
        if type(out) is Refusal:
            raise LogError(f"{path} line {k}: the core refuses {out}: this log is not a run "
                           f"of the protocol")
    return folder, end
