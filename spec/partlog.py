"""One event log per part of a split deployment, and their merge into one run.

Theory of operation
-------------------
In the deployment of issue 29 each process holds one part of the state (spec/parts.py) and
logs the events it takes, in the one codec (spec/codec.py); the environment (the network's
landings and losses, the crashes, a prefill's failure: what a fault injector or a failure
detector reports) logs its own. `kvproof validate` must check the deployment's run, and no
file holds it: the run is the merge of the logs, in an order consistent with what each
process could have known when it took each step.

Each record carries, beside the codec's fields, a stamp:
- "part": who took the step ("router", "prefill q", "decode d", "environment");
- "k": the part's own sequence number, 1, 2, ... (a step dropped leaves a gap);
- "c": a Lamport clock: one more than the largest clock the part has seen;
- "after": the steps, as [part, k], it follows besides the part's own previous one: the
  senders of the messages delivered to it since that step (a message carries its sender's
  stamp, and the receiver's clock moves past it), the environment steps that changed it,
  and what it stands on otherwise (below). These are the message ids of the merge.

What orders a step after another (`PartLogs`, which stamps the steps of a `Split`):
- a part's own steps, by k;
- a message: the receiver's next step comes after the sending step;
- a send after the receiver's earlier steps too: the spec's wire holds one message per
  request, and a send fills the receiver's slot at once (its inbox in the Split), so a
  receiver's step that emptied the slot before the send must stay before it in any merge
  (a final word repeated while the previous one is being taken is the case that needs it);
- an environment step after the last steps of every part it reads or changes, and every
  such part's next step after it;
- a timer that fires on its timing assumption (spec/roles.py ASSUMPTIONS) after the last
  steps of every part of that request: the assumption is about their state.
Every such edge holds in the order the Split took the steps, so that order is one the
merge may produce; two steps no edge orders touch disjoint state and commute.

The merge (`merge`) reads every record of every log, in any files and in any order of the
files, groups them by part, and checks before it orders anything: every part of the
deployment (the router, each prefill and decode worker, the environment) ends with a
`LogEnd` record saying how many steps it took; a part's steps run 1..n without a gap or a
repeat, its clock rises with them; every step it names in "after" exists and has a smaller
clock (a step stamped before the message that caused it is refused at its file and line);
and each step is logged by the part that takes it (an Arrive by the router, a Reserve by
the decode worker its request was placed on, a landing by the environment). The run is the
records sorted by (clock, part, k): a linear extension of the edges above. Its events are
then checked against the spec by spec/tlaplus/runcheck.py (`check_part_logs`), which names
the file and line of a step the spec refuses.

Pure like the core: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spec import codec, core
from spec.core import Refusal
from spec.model import Model
from spec.parts import Part, Split, role_of
from spec.roles import DECODE, PREFILL, ROUTER

FORMAT = "kvproof-part-log/1"
ENVIRONMENT = "environment"
LOG_END = "LogEnd"
STAMP_KEYS = ("part", "k", "c", "after")


class MergeError(ValueError):
    """Logs that do not make one run of a deployment (user input, reported clearly): the
    message names the file and line."""


def part_names(m: Model) -> tuple[str, ...]:
    """Every part of a deployment of `m`, as its records name it."""
    return ((ROUTER,) + tuple(f"{PREFILL} {q}" for q in range(m.prefill_workers))
            + tuple(f"{DECODE} {d}" for d in range(m.decode_workers)) + (ENVIRONMENT,))


def header(m: Model) -> dict:
    """The first line of every log of a deployment: the format and the spec's constants."""
    return {"format": FORMAT, "name": m.name, "constants": m.tla_constants()}


# -- page numbers: the core's flat pools and a worker's own --------------------------------

def flat_event(m: Model, event: core.Event, placement: dict) -> core.Event:
    """A shell's event (pages numbered within their worker's pool) with the core's flat page
    numbers (worker w's pages after every page of the workers before it). `placement`
    (request -> (prefill, decode)) learns each Arrive's."""
    return _moved(m, event, placement, 1)


def local_event(m: Model, event: core.Event, placement: dict) -> core.Event:
    """The inverse of `flat_event`: the core's page numbers as the worker's own."""
    return _moved(m, event, placement, -1)


def _moved(m: Model, event: core.Event, placement: dict, sign: int) -> core.Event:
    if type(event) is core.Arrive:
        placement[event.request] = (event.prefill_worker, event.decode_worker)
        return event
    p, d = placement.get(getattr(event, "request", None), (0, 0))
    if type(event) is core.Admit:
        return replace(event, pages=tuple(k + sign * p * m.prefill_pages for k in event.pages))
    if type(event) is core.Reserve:
        return replace(event, pages=tuple(k + sign * d * m.decode_pages for k in event.pages))
    if type(event) in (core.LandWrite, core.LoseWrite):
        return replace(event, page=event.page + sign * d * m.decode_pages)
    return event


# -- writing: a Split whose parts log ---------------------------------------------------------

def file_name(name: str) -> str:
    """The file a part's log is written to in a deployment's folder ("decode 1" ->
    decode-1.ndjson)."""
    return f"{name.replace(' ', '-')}.ndjson"


def log_end(name: str, steps: int) -> dict:
    """The record that closes a part's log: how many steps it took."""
    return {"a": LOG_END, "part": name, "steps": steps}


class PartClock:
    """One part's stamp (the module docstring): its step count k, its Lamport clock c, and
    the steps of other parts its next step follows ("after"). A PartLogs keeps one per
    part; a process of a deployment (engine/processes.py) keeps its own."""

    def __init__(self, name: str) -> None:
        self.name, self.k, self.c, self.heard = name, 0, 0, []

    def hear(self, part: str, k: int, c: int) -> None:
        """Step k of `part`, at clock c, is one this part's next step follows (it sent a
        message here, changed this part, or this part stands on it): the clock moves past
        it. A part that has taken no step (k 0) only moves the clock."""
        self.c = max(self.c, c)
        if k and [part, k] not in self.heard:
            self.heard.append([part, k])

    def stamp(self, record: dict) -> list:
        """Stamp `record` as this part's next step; its [part, k, c], which whoever it
        reaches hears."""
        self.k += 1
        self.c += 1
        record.update(part=self.name, k=self.k, c=self.c, after=self.heard)
        self.heard = []
        return self.last()

    def last(self) -> list:
        """[part, k, c] of the last step (k 0 before any)."""
        return [self.name, self.k, self.c]


class PartLogs:
    """A Split (spec/parts.py) whose every part, and the environment, logs the events it
    takes, stamped (the module's docstring says how). `take` takes an event in the core's
    flat page numbers; the records hold the workers' own, as a shell logs them."""

    def __init__(self, m: Model) -> None:
        self.model = m
        self.split = Split(m)
        self.names = part_names(m)
        self.clocks = {name: PartClock(name) for name in self.names}
        self.records: dict[str, list[dict]] = {name: [] for name in self.names}
        self.placement: dict[int, tuple[int, int]] = {}

    def take(self, event: core.Event):
        """The Split's outcome of `event`; an accepted one is logged by its taker."""
        split = self.split
        taker = split.taker(event)
        out = split.take(event)
        if type(out) is Refusal:
            return out
        if taker is None:
            self._log(ENVIRONMENT, event, self._environment_touched(event), split.reached)
        else:
            self._log(taker.name, event, self._stands_on(taker, event), split.reached)
        return out

    def _stands_on(self, taker: Part, event: core.Event) -> list[Part]:
        """The parts a part's step is ordered after besides its own past: those it sent to
        (the one-slot wire), and every part of the request if a timer's assumption was read."""
        parts = list(self.split.reached)
        if taker.read_assumption:
            parts += [part for part in self._request_parts(event) if part is not taker]
        return parts

    def _request_parts(self, event: core.Event) -> list[Part]:
        r = getattr(event, "request", None)
        if r is None:
            return []
        return [part for role in (ROUTER, PREFILL, DECODE)
                for part in (self.split.placed(r, role),) if part is not None]

    def _environment_touched(self, event: core.Event) -> list[Part]:
        """The parts an environment step reads or changes: those of its request, or for a
        decode crash the crashed worker and the parts of every request placed on it."""
        split = self.split
        if type(event) is core.DecodeCrash:
            crashed = split.decodes[event.worker]
            here = [r for r, row in split.router.rows.items() if row[core.DW] == event.worker]
            parts = [crashed] + [part for r in here for role in (ROUTER, PREFILL)
                                 for part in (split.placed(r, role),) if part is not None]
        else:
            parts = self._request_parts(event)
        return list(dict.fromkeys(parts + list(split.reached)))

    def _log(self, name: str, event: core.Event, stands_on: list[Part],
             receivers: list[Part]) -> None:
        clock, clocks = self.clocks[name], self.clocks
        for part in dict.fromkeys(stands_on):
            if part.name != name:
                clock.hear(*clocks[part.name].last())
        record = codec.encode(local_event(self.model, event, self.placement))
        stamp = clock.stamp(record)
        self.records[name].append(record)
        targets = receivers if name != ENVIRONMENT else stands_on
        for part in dict.fromkeys(targets):
            if part.name != name:
                clocks[part.name].hear(*stamp)

    def logs(self) -> dict[str, list[dict]]:
        """Each part's records, its LogEnd last."""
        return {name: records + [log_end(name, self.clocks[name].k)]
                for name, records in self.records.items()}


# -- reading: the merge ---------------------------------------------------------------------

@dataclass(frozen=True)
class Origin:
    source: str   # the file
    line: int

    def __str__(self) -> str:
        return f"{self.source} line {self.line}"


@dataclass
class Merged:
    """The run the logs make: its records in merged order, each with where it was read."""

    model: Model
    records: list[dict]
    origins: list[Origin]
    parts: dict[str, int]   # part -> its steps


def merge(m: Model, logs: list[tuple[str, list[tuple[int, dict]]]]) -> Merged:
    """The logs of one deployment of `m` (each a source with its (line, record) pairs, the
    header left out) as one run; a MergeError names the file and line of what breaks it."""
    names = part_names(m)
    steps: dict[str, dict[int, tuple[dict, Origin]]] = {name: {} for name in names}
    ends: dict[str, tuple[int, Origin]] = {}
    for source, records in logs:
        for line, record in records:
            where = Origin(source, line)
            name = record.get("part")
            if name not in steps:
                raise MergeError(f"{where}: part {name!r} is no part of this deployment "
                                 f"({', '.join(names)})")
            if record.get("a") == LOG_END:
                _end(where, name, record, ends)
                continue
            k = _stamp(where, record)
            if k in steps[name]:
                raise MergeError(f"{where}: {name}'s step {k} is logged twice (also at "
                                 f"{steps[name][k][1]})")
            steps[name][k] = (record, where)
    for name in names:
        _whole_part(name, steps[name], ends)
    for name in names:
        for k, (record, where) in steps[name].items():
            _causes(where, name, k, record, steps)
    order = sorted(((record["c"], names.index(name), k, record, where)
                    for name in names for k, (record, where) in steps[name].items()),
                   key=lambda x: x[:3])
    _takers(m, [(x[3], x[4]) for x in order])
    return Merged(m, [{key: v for key, v in x[3].items() if key not in STAMP_KEYS}
                      for x in order], [x[4] for x in order],
                  {name: len(steps[name]) for name in names})


def _end(where: Origin, name: str, record: dict, ends: dict) -> None:
    if name in ends:
        raise MergeError(f"{where}: a second end of {name}'s log (the first at "
                         f"{ends[name][1]})")
    count = record.get("steps")
    if type(count) is not int or count < 0:
        raise MergeError(f"{where}: {name}'s end names no step count: {record!r}")
    ends[name] = (count, where)


def _stamp(where: Origin, record: dict) -> int:
    for key in ("k", "c"):
        if type(record.get(key)) is not int or record[key] < 1:
            raise MergeError(f"{where}: the record has no stamp {key!r} (a positive "
                             f"integer): {record!r}")
    after = record.get("after")
    if not isinstance(after, list) or not all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
            and type(x[1]) is int for x in after):
        raise MergeError(f"{where}: 'after' must list [part, step] pairs: {record!r}")
    return record["k"]


def _whole_part(name: str, steps: dict, ends: dict) -> None:
    """A part's steps run 1..n, n as its end says, with a rising clock."""
    if name not in ends:
        raise MergeError(f"no log of this deployment ends {name}'s (a file or its last "
                         f"line missing?)")
    count, end = ends[name]
    previous = None
    for k in range(1, max([count, *steps]) + 1):
        if k not in steps:
            where = steps[k + 1][1] if k + 1 in steps else end
            raise MergeError(f"{where}: {name}'s step {k} is missing (its log ends after "
                             f"{count} steps, and step {k} is in no file)")
        record, where = steps[k]
        if k > count:
            raise MergeError(f"{where}: {name}'s step {k} comes after the end of its log "
                             f"at {end} ({count} steps)")
        if previous is not None and record["c"] <= previous:
            raise MergeError(f"{where}: {name}'s step {k} is stamped {record['c']}, not after "
                             f"its step {k - 1} (stamped {previous})")
        previous = record["c"]


def _causes(where: Origin, name: str, k: int, record: dict, steps: dict) -> None:
    for cause, j in record["after"]:
        found = steps.get(cause, {}).get(j)
        if found is None:
            raise MergeError(f"{where}: {name}'s step {k} follows step {j} of {cause}, "
                             "which no log holds")
        if found[0]["c"] >= record["c"]:
            raise MergeError(f"{where}: {name}'s step {k} ({record.get('a')}) is stamped "
                             f"{record['c']}, not after step {j} of {cause} "
                             f"({found[0].get('a')}, stamped {found[0]['c']}, {found[1]}) "
                             "whose message or change it follows: the step was moved "
                             "before its cause")


def _takers(m: Model, run: list[tuple[dict, Origin]]) -> None:
    """Each step is logged by the part that takes it: the role its action belongs to, at
    the worker the router placed its request on (or the crashed worker)."""
    placement: dict[int, tuple[int, int]] = {}
    for record, where in run:
        try:
            event = codec.decode(record)
        except codec.CodecError as error:
            raise MergeError(f"{where}: {error}") from None
        role = role_of(event)
        kind = type(event)
        if role is None:
            taker = ENVIRONMENT
        elif kind is core.PrefillCrash:
            taker = f"{PREFILL} {event.worker}"
        elif kind is core.Arrive:
            placement[event.request] = (event.prefill_worker, event.decode_worker)
            taker = ROUTER
        elif role == ROUTER:
            taker = ROUTER
        elif event.request not in placement:
            continue  # before its request arrived: the spec refuses it (runcheck)
        else:
            placed = placement[event.request]
            taker = f"{role} {placed[0] if role == PREFILL else placed[1]}"
        if record["part"] != taker:
            raise MergeError(f"{where}: {event.label()} is {taker}'s to take, but "
                             f"{record['part']} logged it")
