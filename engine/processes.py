"""The protocol in worker processes: one router and P prefill + D decode OS processes on
127.0.0.1, each holding exactly one spec/parts.py `Part`, with a modelled data path, or the
real one (engine/process_data.py: a model and a KV pool per worker process, page writes
over DistTransport) when the deployment names a model.

Theory of operation
-------------------
Each process (`Process`) holds one part and one engine/channel.py `Channel`, and runs one
loop: take what the channel delivers (a part's message, a modelled page write, a landing,
a crash's record, a PeerDown), hand it to its part, then let its part decide whatever its
own actions now allow (`settle`), log every step it takes to its own part log (the format
of spec/partlog.py, one JSON line flushed before anything the step sends leaves the
process, so a killed process leaves every step whose effects anyone saw) and send what
each step sends. Protocol decisions are the core's, through `Part.take`; what a process
observes of the environment's actions is applied by its part (`Part.land`,
`Part.completed`, `Part.decode_crashed`).

What runs where:
- the router: the workload (Arrive, placing each request on a prefill and a live decode
  from a seeded generator), the serving edge (its part keeps each client's first answer),
  and the environment's log: every environment step is sequenced and logged here, once
  (spec/partlog.py wants one "environment" part with steps 1..n);
- prefill q: Admit when its pool has room and decode's page table has come, then after
  `compute_s` (the modelled prefill) SendPage for each page; each Post is a page write
  sent over the channel to decode; SendDone once every write completed;
- decode d: Reserve when its pool has room, Accept (checksums observed OK), Finish at once
  (tags observed OK: the modelled decode), Release when the core allows it.

The real data path keeps this shape: the channel still carries each write's announcement
(its stamp and contents in the spec's terms) while the bytes go over DistTransport, and
decode lands a write when it has both (engine/process_data.py says the rest).

The modelled data path, as spec/parts.py `Split._environment` decomposes LandWrite: the
prefill's write (request, source page, decode page, tag, and the source page's contents)
goes to decode, which lands it (its share: the landing counted, the page's contents and
tag) and tells the router; the router logs LandWrite as the environment's step, after the
posting and landing steps, and tells the prefill its write completed (its share). So the
prefill's next step (SendDone) is stamped after the landing, as the spec orders them.

A decode crash (SIGKILL): each surviving process learns it from its own failure detector
(PeerDown). A prefill stops taking steps for the requests placed on the dead decode and
reports its last step to the router. The router fences a decode it declares down, or hears
declared down by a prefill while it still sees it (a partition of one link, not a crash):
it cuts it off and has it killed by its launcher (`RouterProcess.fence`,
`Launched.fence`; a worker that joined at a rendezvous fences itself when it loses its
router), so that a partition takes the crash's path and nothing the decode does later
counts. Once the decode is fenced and the router has its own PeerDown and every live
prefill's report, it closes the dead decode's log (as a supervisor would: a torn last line
cut, a LogEnd with the steps it holds), logs DecodeCrash after every step of the dead
decode, of itself and of each prefill's report, answers the dead decode's waiting clients
ErrDecode, and sends each prefill the crash's record, on which the prefill applies the
crash notice (core.crash_notice) and goes on (AnswerCancel or PrefillAbort, their final
word to a dead peer unsent). The spec's DecodeCrash is one atomic step seen by decode, the
router and every prefill at once; this barrier is what makes the merged logs one run:
without it a prefill's SendPage taken after the router's record but before its own
detector fired would follow DecodeCrash in the merge, where the spec refuses it (the
crash dropped its page table).

A prefill crash (SIGKILL): the spec's PrefillCrash is the prefill's own step, taken by its
next life. Each decode's detector fires; it lands nothing more of the dead epoch and
reports to the router after its last landing; once the router has fenced the prefill (as
a decode above), and has its own PeerDown and every live decode's report, it cuts the dead
log's torn line and asks its launcher for a restart in the next epoch
(`record_prefill_crash`, `Launched.restart`). The new life rebuilds what its log says
(core.recovered_prefill_rows), takes PrefillCrash (its answers end what was queued or
running), and tells the router it is back, which tells each decode:
decode times out what the crash ended and sends the new life what it held for the dead one
(its cancels), which the new life answers. On the real data path the new life has no data
path (the gloo world cannot take a rank back) and the router places nothing there.

Logged, not sent: a step is logged before anything it sends leaves the process, so a
process killed between the two leaves steps whose messages nobody got. Each step's line
holds the answers it sends the edge and the final words it sends decode; the router gives a
waiting client the answer a dead worker's log holds (`RouterProcess.recover_answers`), and
a prefill's next life sends again the last final word of each request that no decode heard
(`PrefillProcess.recover`; each decode reports what it heard with its `pdown`).

Each barrier waits only for the reports of the lives that were connected to the dead one
(`RouterProcess.links`): with two faults at once, a decode's new life never saw a prefill
that died before it started, nor a prefill's new life a decode that died before it.

Timers are off but that one: no lease, no other timeouts, no resends (none is needed
without losses; a lost message is only what a crash loses, and the crash ends those
requests or the dead worker's log gives it again, above).

Pure orchestration: no protocol decision is made here.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.channel import (
    ENVELOPE, Channel, ChannelConfig, ChannelError, Delivered, Message, Peer, PeerDown, PeerUp,
)
from spec import codec, core
from spec.core import NONE, Refusal
from spec.model import Model
from spec.partlog import (ENVIRONMENT, LOG_END, PartClock, file_name, header, local_event,
                          log_end)
from spec.parts import Message as PartMessage, Part, Taken
from spec.roles import DECODE, GHOST, PREFILL, ROUTER

POLL_S = 0.01
QUIET_S = 0.3          # stop: a process finishes once its inbox stayed empty this long
# Channel events handled per loop turn, at most: every one waiting, so that a turn's data-path
# work (a prefill chunk, a decode step: ~0.1-1 s on the default model) is not paid once per
# message (one event a turn held 32 streams' announcements behind as many decode steps).
EVENTS_PER_TURN_MAX = 1024
FINAL_CLIENT = frozenset(range(len(core.CLIENT_NAMES))) - {core.IDLE, core.WAITING}


@dataclass(frozen=True)
class Deployment:
    """One deployment's shape, workload and bounds (all in the names' units)."""

    prompts: tuple            # prompt pages of request 0, 1, ...
    prefill_workers: int = 1
    decode_workers: int = 1
    prefill_pages: int = 4
    decode_pages: int = 4
    context_pages: int = 3
    max_prompt_pages: int = 3
    compute_s: float = 0.0    # the modelled prefill's compute time per request; on the
    #                           real data path a hold after the compute (tests widen windows)
    send_done_after_s: float = 0.0  # a hold between a prefill's last post and its SendDone
    #                                 (tests widen the window in which its writes are out)
    arrive_every_s: float = 0.005
    arrive_after_s: tuple = ()  # the wait before request r + 1 arrives, when given
    seed: int = 0
    heartbeat_s: float = 0.25
    suspect_after_s: float = 2.0
    settle_s_max: float = 5.0  # stop: the longest a process takes to finish its work
    log_dir: str = ""
    # The real data path (engine/process_data.py), when model_dir names an HF folder:
    # requests[r] = (prompt token ids, max_tokens), prompts[r] its pages (`with_model`).
    model_dir: str = ""
    requests: tuple = ()
    page_tokens: int = 4
    prefill_chunk_tokens: int = 8
    max_batch: int = 8
    transport_timeout_s: float = 10.0  # every wait on a live peer's page or completion
    join_timeout_s: float = 60.0       # the gloo world: every worker process joins within
    keep_kv: bool = False  # the leak oracle's evidence: decode saves the prompt KV it read
    bugs: tuple = ()       # the zoo's switches (spec/model.py), in every part and log
    # Serving (engine/process_engine.py): no workload; the router takes each request from
    # its stdin ("arrive", "abort") and reports its tokens and answer on stdout. The spec's
    # request numbers are fixed at start (every part's rows), so a deployment serves at
    # most `serving_requests_max` requests in its life.
    serving_requests_max: int = 0
    context_tokens: int = 0    # the advertised context: a worker whose pool is below it
    #                            refuses to join (the startup capacity check)
    pool_report_s: float = 0.5  # a worker reports its pool's occupancy this often, at most
    restarts_max: int = 3      # lives a dead prefill is restarted into, at most, per worker
    drain_s: float = 10.0      # SIGTERM: a worker finishes what it holds within this
    # HOST:PORT: the workers start on their own (`kvproof worker`, engine/rendezvous.py) and
    # meet the launcher there; "": the launcher starts them on this machine.
    rendezvous: str = ""
    # A worker that joined at a rendezvous fences itself (stops writing its log and exits)
    # once its detector declares the router down, within suspect_after_s of the router's last
    # byte; its router waits that and this margin (the worker's scheduling) before it counts
    # the worker's log as closed (`fence_wait_s`).
    fence_margin_s: float = 1.0
    # Fault injection, for tests only: "PART:ACTION" or "PART:ACTION@EPOCH" (e.g. "decode
    # 1:Finish", "prefill 0:PrefillCrash@2"; several, comma-separated): that life of the
    # part (epoch 1 unless named) kills itself (SIGKILL) right after it logs its first
    # ACTION step, before the step sends anything: the window between a step's log line
    # and its messages.
    die_after_step: str = ""
    hang_after_step: str = ""  # the same, but its loop hangs for good (its threads run on)
    die_at_start: str = ""     # "PART@EPOCH": that life exits before it listens

    def fence_wait_s(self) -> float:
        return self.suspect_after_s + self.fence_margin_s

    def __post_init__(self) -> None:
        if self.serving_requests_max < 0 or self.context_tokens < 0:
            raise ValueError("serving_requests_max and context_tokens must not be negative")
        if not (self.prompts or self.serving_requests_max) or not all(
                1 <= n <= self.max_prompt_pages for n in self.prompts):
            raise ValueError(f"prompts must be 1..{self.max_prompt_pages} pages each")
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("a deployment needs a prefill and a decode worker")
        object.__setattr__(self, "prompts", tuple(self.prompts))
        object.__setattr__(self, "bugs", tuple(sorted(self.bugs)))
        object.__setattr__(self, "arrive_after_s", tuple(self.arrive_after_s))
        if any(not 0 <= s for s in self.arrive_after_s):
            raise ValueError("arrive_after_s must be waits of 0 s or more")
        object.__setattr__(self, "requests", tuple((tuple(ids), int(n))
                                                   for ids, n in self.requests))
        if (self.model_dir and not self.serving_requests_max
                and len(self.requests) != len(self.prompts)):
            raise ValueError("a deployment with a model needs requests (prompt ids, "
                             "max_tokens), one per prompt: build it with Deployment.with_model")

    @classmethod
    def with_model(cls, model_dir: str, requests, page_tokens: int = 4, **options):
        """A deployment on the real data path: each request (prompt token ids, max_tokens)
        takes the pages of its prompt and every output but the last, as in-process."""
        from engine.generate import pages_needed  # torch: only for the real data path
        requests = tuple((tuple(ids), int(n)) for ids, n in requests)
        if not requests or not all(ids and n >= 1 for ids, n in requests):
            raise ValueError("requests must each have a prompt token and max_tokens >= 1")
        prompts = tuple(pages_needed(len(ids), n, page_tokens) for ids, n in requests)
        options.setdefault("max_prompt_pages", max(prompts))
        options.setdefault("context_pages", max(prompts))
        return cls(prompts=prompts, model_dir=str(model_dir), requests=requests,
                   page_tokens=page_tokens, **options)

    def next_life(self) -> "Deployment":
        """What a restarted worker runs: on the real data path no data path at all (the gloo
        world cannot take a rank back); the modelled path as it was."""
        return replace(self, model_dir="", requests=()) if self.model_dir else self

    def model(self) -> Model:
        """The spec's constants every log of the deployment is written with."""
        return Model(requests=self.serving_requests_max or len(self.prompts),
                     max_prompt_pages=self.max_prompt_pages, context_pages=self.context_pages,
                     prefill_pages=self.prefill_pages,
                     decode_pages=self.decode_pages, crashes=True, decode_crashes=True,
                     name="processes",
                     bugs=frozenset(self.bugs),
                     prefill_workers=self.prefill_workers,
                     decode_workers=self.decode_workers)


def log_path(deployment: Deployment, name: str) -> Path:
    return Path(deployment.log_dir) / file_name(name)


# -- one part's log ---------------------------------------------------------------------------

class Fenced(Exception):
    """This worker was fenced: it writes no step more (its log is its supervisor's now)."""


class PartLog:
    """One part's log: the header, then each step stamped by its spec/partlog.py PartClock
    and flushed at once, LogEnd when the process stops. `fence()` (any thread) ends the
    writing for good: a step begun after it raises Fenced, one being written completes
    first (the lock), so once fence() returns the file holds every step it will."""

    def __init__(self, path: Path, name: str, m: Model, resume: tuple | None = None) -> None:
        """`resume` (steps, clock): a restarted process goes on with its previous life's
        log (cut by its supervisor, `cut_dead_log`), its steps numbered after that
        life's."""
        self.name, self.clock = name, PartClock(name)
        if resume is None:
            self.file = open(path, "w")
            self.file.write(json.dumps(header(m)) + "\n")
            self.file.flush()
        else:
            self.file = open(path, "a")
            self.clock.k, self.clock.c = resume
        self.lock = threading.Lock()
        self.fenced = False

    def fence(self) -> None:
        with self.lock:
            self.fenced = True

    def heard_from(self, stamp) -> None:
        """A message stamped by another part's step: the next step follows it."""
        self.clock.hear(*stamp)

    def step(self, record: dict) -> list:
        with self.lock:
            if self.fenced:
                raise Fenced(f"{self.name}: fenced, no step is logged")
            stamp = self.clock.stamp(record)
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()  # before anything the step sends leaves: a kill loses no step
        return stamp

    def stamp(self) -> list:
        return self.clock.last()

    def end(self) -> None:
        with self.lock:
            if self.fenced:
                raise Fenced(f"{self.name}: fenced, its supervisor closes its log")
            self.file.write(json.dumps(log_end(self.name, self.clock.k)) + "\n")
            self.file.close()


def close_dead_log(path: Path, name: str) -> tuple[int, int]:
    """A killed process's log closed by its supervisor: a torn last line cut, LogEnd with
    the steps the file holds. Returns (steps, the last step's clock)."""
    steps, clock = cut_dead_log(path, name)
    with open(path, "a") as file:
        file.write(json.dumps(log_end(name, steps)) + "\n")
    return steps, clock


def cut_dead_log(path: Path, name: str) -> tuple[int, int]:
    """A killed process's log, its torn last line cut (a restarted process goes on with
    it). Returns (steps, the last step's clock). The cut log is a new file put in the old
    one's place (os.replace), not the old file rewritten: a process that is not dead but
    paused (a SIGSTOP, a VM stall past the fence's lease) still holds the old file open,
    and whatever it writes when it wakes goes to that file, which no name reaches any
    more, instead of into the log its supervisor closed (where, rewritten in place, it
    would have landed at the old offset, past the cut). So a late step never counts, on
    the filesystem the supervisor reads the log on."""
    text = path.read_text()
    whole = text[:text.rfind("\n") + 1]
    cut = path.with_name(path.name + ".cut")
    cut.write_text(whole)
    os.replace(cut, path)
    steps = _steps_of(whole, name)
    return len(steps), steps[-1]["c"] if steps else 0


def _steps_of(text: str, name: str) -> list[dict]:
    records = [json.loads(line) for line in text.splitlines()[1:]]
    return [x for x in records if x.get("part") == name and x.get("a") != LOG_END]


def logged_steps(path: Path, name: str) -> list[dict]:
    """The steps a part's log holds, its whole lines only (a killed writer may have left a
    torn last line, which its supervisor cuts)."""
    text = path.read_text()
    return _steps_of(text[:text.rfind("\n") + 1], name)


def _is_word(message: PartMessage) -> bool:
    """A prefill's final word to decode (Done, Reject or Abort)."""
    return any(k == core.FW for k, _ in message.fields)


def _tuples(value):
    """JSON's lists back as the core's tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# -- envelopes ---------------------------------------------------------------------------------
# Every envelope a process sends: its sender's and receiver's roles (None: any), its fields
# and the kind of each value, and the fields it may carry besides. The receiving process
# checks each body against this table on its channel's reader thread (`envelope_problem`): a
# body that is not what its kind says is a bad frame, so its connection is dropped and its
# peer declared down, as engine/channel.py does for a bad message. A handler never sees it.

ENVELOPES = {
    "msg": (None, None, {"stamp": "stamp", "request": "request", "to": "role",
                         "fields": "pairs", "names": "names", "placement": "placement"},
            {"payload": "payload", "first": "count"}),
    "write": (PREFILL, DECODE, {"request": "request", "write": "write", "data": "data",
                                "stamp": "stamp", "placement": "placement"}, {}),
    "landed": (DECODE, ROUTER, {"request": "request", "write": "write", "poster": "stamp",
                                "stamp": "stamp"}, {}),
    "completed": (ROUTER, PREFILL, {"request": "request", "write": "write", "stamp": "stamp"},
                  {}),
    "down": (PREFILL, ROUTER, {"decode": "count", "stamp": "stamp"}, {"epoch": "count"}),
    "up": (PREFILL, ROUTER, {"decode": "count"}, {"epoch": "count"}),
    "crash": (ROUTER, PREFILL, {"decode": "count", "requests": "requests", "stamp": "stamp"},
              {"epoch": "count"}),
    "token": (DECODE, ROUTER, {"request": "request", "token": "token", "last": "bool"}, {}),
    "pdown": (DECODE, ROUTER, {"prefill": "count", "stamp": "stamp", "heard": "counts"}, {}),
    "leaving": (None, ROUTER, {"holds": "requests"}, {}),
    "farewell": (ROUTER, None, {}, {}),
    "bye": (ROUTER, None, {}, {}),
    "left": (None, ROUTER, {"finished": "requests"}, {}),
    "restarted": (PREFILL, ROUTER, {"lost": "requests", "stamp": "stamp"}, {}),
    "prefill_back": (ROUTER, DECODE, {"prefill": "count", "lost": "requests", "stamp": "stamp"},
                     {}),
    "dial": (ROUTER, PREFILL, {"decode": "count", "epoch": "count", "host": "host",
                               "port": "count"}, {}),
}


def envelope_problem(m: Model, receiver: Peer, sender: Peer, body) -> str:
    """What is wrong with an envelope `sender` sent `receiver` ("" when nothing is): its kind,
    its fields, the kind and range of each value (a request of this deployment, a write of
    that request), and for a part's message, that it is meant for the receiver's role."""
    if not isinstance(body, dict) or body.get("t") not in ENVELOPES:
        kind = body.get("t") if isinstance(body, dict) else body
        return f"unknown envelope {_short(kind)} (the kinds are {sorted(ENVELOPES)})"
    kind = body["t"]
    source, target, need, may = ENVELOPES[kind]
    if source not in (None, sender.role) or target not in (None, receiver.role):
        return f"a {kind} goes from {source or 'any'} to {target}, not {sender} to {receiver}"
    fields = set(body) - {"t"}
    if not set(need) <= fields <= set(need) | set(may):
        return (f"a {kind} has the fields {sorted(need)} (and may have {sorted(may)}), got "
                f"{sorted(fields)}")
    for name in sorted(fields):
        problem = _envelope_value_problem(m, (need | may)[name], body[name])
        if problem:
            return f"{kind}.{name} {problem}"
    if "write" in body and body["write"][0] != body["request"]:
        return f"{kind}.write is a write of request {body['write'][0]}, not {body['request']}"
    if kind == "msg" and body["to"] != receiver.role:
        return f"a part's message to {body['to']} came to {receiver}"
    return ""


def _envelope_value_problem(m: Model, value_kind: str, value) -> str:
    def count(x) -> bool:
        return type(x) is int and x >= 0

    def ints(x, n=None) -> bool:
        return (isinstance(x, list) and (n is None or len(x) == n)
                and all(type(v) is int for v in x))
    ok = {
        "count": lambda: count(value),
        "request": lambda: count(value) and value < m.requests,
        "counts": lambda: isinstance(value, list) and all(count(v) for v in value),
        "requests": lambda: isinstance(value, list) and all(
            count(r) and r < m.requests for r in value),
        "bool": lambda: type(value) is bool,
        "token": lambda: value is None or count(value),
        "role": lambda: value in (ROUTER, PREFILL, DECODE),
        "stamp": lambda: (isinstance(value, list) and len(value) == 3
                          and isinstance(value[0], str) and count(value[1])
                          and count(value[2])),
        "placement": lambda: ints(value, 2) and all(v >= NONE for v in value),
        "write": lambda: ints(value, 4) and count(value[0]) and value[0] < m.requests
        and all(v >= NONE for v in value),
        "names": lambda: isinstance(value, list) and all(isinstance(v, str) for v in value),
        "pairs": lambda: isinstance(value, list) and all(  # (row field index, its value)
            isinstance(v, list) and len(v) == 2 and type(v[0]) is int
            and 0 <= v[0] < len(core.ROW_FIELDS) for v in value),
        "payload": lambda: isinstance(value, list) and 2 <= len(value) <= 3
        and ints(value[0]) and count(value[1]) and (len(value) == 2 or ints(value[2])),
        "data": lambda: type(value) is int or ints(value),
        "host": lambda: isinstance(value, str) and 0 < len(value) <= 255,
    }[value_kind]()
    return "" if ok else f"must be a {value_kind.replace('_', ' ')}, got {_short(value)}"


def _short(value, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# -- one process ------------------------------------------------------------------------------

class Process:
    """One worker process: its part, its channel, its log, its loop."""

    ROLE = ""

    def __init__(self, deployment: Deployment, worker: int = 0,
                 restart: dict | None = None) -> None:
        role = self.ROLE
        self.deployment, self.model = deployment, deployment.model()
        self.part = Part(self.model, role, worker)
        # A restarted process (a prefill's: RouterProcess.record_prefill_crash) runs in a
        # new epoch and goes on with its previous life's log.
        self.restart = restart
        self.channel = Channel(ChannelConfig(role, worker, restart["epoch"] if restart else 1,
                                             heartbeat_s=deployment.heartbeat_s,
                                             suspect_after_s=deployment.suspect_after_s),
                               on_down=self.on_channel_down,
                               body_problem=self.envelope_problem)
        # When its loop last turned (None: not turning yet, or no more): the channel beats
        # only while the loop turns (`loop_alive`).
        self.loop_at: float | None = None
        self.channel.alive = self.loop_alive
        self.log = PartLog(log_path(deployment, self.part.name), self.part.name, self.model,
                           (restart["steps"], restart["clock"]) if restart else None)
        self.placement: dict[int, tuple[int, int]] = {}  # request -> (prefill, decode)
        # A prefill: decodes its detector declared down -> that life's epoch (their requests
        # frozen until that life's crash record), and the newest life of each whose crash
        # record came (a late verdict on it freezes nothing).
        self.dead_decodes: dict[int, int] = {}
        self.crash_recorded: dict[int, int] = {}
        self.ready_at: dict[int, float] = {}  # a prefill: when a request's compute is done
        self.payload: dict[int, object] = {}  # a worker: request -> its Payload (real path)
        self.data = None                      # its real data path (engine/process_data.py)
        self.first: dict[int, int] = {}       # decode: request -> first token (final word)
        self.unsent = 0
        self.cpu_from_s = 0.0  # its CPU seconds (every thread) when its loop began
        self.reported = False
        self.stopped = False
        # SIGTERM (`drain`): the bound, what it held when asked, and the router's word that
        # nothing more will be placed here.
        self.drain_until: float | None = None
        self.drain_holds: set[int] = set()
        self.farewell = False
        self.router_gone = False  # a worker that joined at a rendezvous: its router left
        self.router_ended = False  # ... after its "bye" (it ended its log: no fence)
        self.self_fenced = threading.Event()  # ... or without it: it fenced itself

    def loop_alive(self) -> bool:
        """Whether this process's loop turned within suspect_after_s, or is held by one of
        the data path's bounded waits (a model step, a transport wait: each raises past its
        own bound), or is not watched (before it starts, after it ends). A loop that hangs
        otherwise (a deadlock, a call that never returns) while the channel's threads run
        on stops the heartbeats, and its peers declare it down within suspect_after_s
        more: 2 x suspect_after_s in all."""
        return (self.loop_at is None
                or time.monotonic() - self.loop_at < self.deployment.suspect_after_s
                or self.data is not None and self.data.waiting())

    def on_channel_down(self, event: PeerDown) -> None:
        """The detector's verdict, on the channel's thread, before the loop takes it: a
        worker that joined at a rendezvous and loses its router without the router's bye
        (a partition, the router's fence, a dead router) fences itself at once: no step is
        logged from now on and the loop exits (`main`). The router counts on it: it treats
        the worker's log as closed `fence_wait_s` after it cut it off. A worker this
        machine's launcher started is fenced by the launcher instead (it kills it)."""
        if (event.peer.role == ROUTER and self.role != ROUTER and self.deployment.rendezvous
                and not self.router_ended):
            self.log.fence()
            self.self_fenced.set()

    def on_bye(self, peer: Peer, body: dict) -> None:
        """The router ended its log and is going: this worker ends with it (drains once
        the router's connection closes; `router_ended` was noted as the bye was read)."""

    # -- SIGTERM: a worker asked to stop drains what it holds ----------------------------

    def holds(self) -> set[int]:
        """The requests this worker has not finished with (what a drain waits for)."""
        return set()

    def drain(self) -> str:
        """One turn of a drain (SIGTERM): tell the router once (it places nothing here
        from then on, and says so: `farewell`, after every placement it sent here), then
        go on working until nothing is held and the farewell has come ("clean": the log
        ends, the router is told, the process exits), or the bound `drain_s` passes
        ("cut": the process exits as a crash does, and the crash's path ends what it
        held, ErrPrefill or ErrDecode). "" while it drains."""
        now = time.monotonic()
        if self.drain_until is None:
            self.drain_until = now + self.deployment.drain_s
            self.drain_holds = self.holds()
            self.send(Peer(ROUTER, 0), {"t": "leaving", "holds": sorted(self.drain_holds)})
            report(ev="draining", holds=sorted(self.drain_holds),
                   drain_s=self.deployment.drain_s)
        held = self.holds()
        self.drain_holds |= held
        done = not held and (self.farewell or self.router_gone)
        if not done and now < self.drain_until:
            return ""
        finished = sorted(self.drain_holds - held)
        report(ev="drained", finished=finished, left=sorted(held))
        if not done:
            return "cut"
        self.end()
        self.send(Peer(ROUTER, 0), {"t": "left", "finished": finished})
        return "clean"

    def end(self) -> None:
        """Its work done: its log ended, its "stopped" report; it handles nothing more."""
        self.log.end()
        report(ev="stopped", steps=self.log.clock.k, unsent=self.unsent,
               cpu_s=round(cpu_s() - self.cpu_from_s, 3), **self.finish())
        self.stopped = True

    def on_farewell(self, peer: Peer, body: dict) -> None:
        self.farewell = True

    def join_data_path(self) -> None:
        """The real data path's transport (after listening: the world waits for all)."""
        if self.data is not None:
            self.data.join()

    def work(self) -> bool:
        """The data path's own progress this turn (a model step's results, landings), its
        next model step begun: whether its part may have something new to act on. The
        modelled data path has none."""
        return False

    def busy(self) -> bool:
        """Whether the data path has work waiting (the loop then does not idle)."""
        return self.data is not None and self.data.busy()

    def computing(self) -> bool:
        """Whether its model step is running (busy, but the loop waits for messages: the
        step's end wakes it)."""
        return self.data is not None and self.data.stepper.in_flight

    def settle_due(self, since: float) -> bool:
        """Whether its part may have an action enabled that neither a message nor the data
        path's progress enabled since `since` (a settle then): a hold that ran out. The
        modelled data path's, and the router's, are timers: every turn."""
        return self.data is None

    @property
    def role(self) -> str:
        return self.part.role

    # -- messages ------------------------------------------------------------------------

    def send(self, peer: Peer, body: dict) -> bool:
        epoch = self.channel.epoch_of(peer)
        if self.self_fenced.is_set():
            return False  # fenced: nothing it does from now on may count
        if epoch is None or not self.channel.send(peer, Message(ENVELOPE, body.get(
                "request", 0), {"body": body}), epoch):
            self.unsent += 1   # to a peer that is down: lost with it, as the spec says
            return False
        return True

    def send_part_message(self, message: PartMessage, stamp: list) -> None:
        if message.to == GHOST:
            return  # history for the properties: the validator recomputes it
        q, d = self.placement[message.request]
        worker = {ROUTER: 0, PREFILL: q, DECODE: d}[message.to]
        self.send(Peer(message.to, worker), {
            "t": "msg", "stamp": stamp, "request": message.request, "to": message.to,
            "fields": [list(f) for f in message.fields], "names": list(message.names),
            "placement": [q, d], **self.riders(message)})

    def life_hook(self, what: str):
        """Whether a fault hook (comma-separated "WHAT" for epoch 1 and "WHAT@EPOCH") names
        `what` in this life (tests only)."""
        mine = {f"{what}@{self.channel.config.epoch}"} | (
            {what} if self.channel.config.epoch == 1 else set())
        return lambda hooks: bool(mine & set(hooks.split(",")))

    def answer_riders(self, answers: list) -> dict:
        """What a step's log line carries beside the answers it sends the edge, for the
        edge to give a client if this process dies before they leave (none here)."""
        return {}

    def riders(self, message: PartMessage) -> dict:
        """What the data path adds to a part's message (none on the modelled path)."""
        return {}

    def on_peer_down(self, peer: Peer, epoch: int) -> None:
        """Another process's epoch is down (what each role does: its override)."""

    def on_peer_up(self, peer: Peer, epoch: int) -> None:
        """A process connected here (a restarted prefill, to the router: its override)."""

    def envelope_problem(self, peer: Peer, body) -> str:
        """The channel's check of an envelope's body, before this process takes it: the
        table's, and that a write lands in this decode's own pool."""
        problem = envelope_problem(self.model, self.channel.config.identity, peer, body)
        if not problem and body["t"] == "write" and not self.part.owns_page(body["write"][2]):
            return f"write {body['write']} is into page {body['write'][2]}, not one of {self.part.name}'s"
        if not problem and body["t"] == "bye":
            # Noted here, on the reader's thread as the bye is read, not when the loop takes
            # it: the verdict on the router that follows on the same connection (its close)
            # is given on this thread too, and must know it was a bye (on_channel_down).
            self.router_ended = True
        return problem

    def on_envelope(self, peer: Peer, body: dict) -> None:
        getattr(self, f"on_{body['t']}")(peer, body)

    def on_msg(self, peer: Peer, body: dict) -> None:
        self.log.heard_from(body["stamp"])
        r = body["request"]
        self.placement[r] = tuple(body["placement"])
        if "payload" in body:
            from engine.process_data import Payload
            self.payload[r] = Payload(*body["payload"])
        if "first" in body:
            self.first[r] = body["first"]
        message = PartMessage(r, body["to"], tuple((k, _tuples(v)) for k, v in body["fields"]),
                              tuple(body["names"]))
        self.carry(self.part.receive(message), self.log.stamp())

    # -- steps ---------------------------------------------------------------------------

    def step(self, event: core.Event) -> bool:
        """One of this part's own actions, if the core allows it: logged, then sent."""
        out = self.part.take(event)
        if type(out) is Refusal:
            return False
        assert type(out) is Taken
        worker = self.part.worker
        r = getattr(event, "request", None)  # (none for a worker's event: its crash)
        local = local_event(self.model, event, {r: (worker, worker)}
                            if self.role != ROUTER and r is not None else {})
        record = codec.encode(local)
        answers = [[m.request, [list(f) for f in m.fields], list(m.names)]
                   for m in out.messages if m.to == ROUTER]
        if answers:  # what the edge must hear even if this process dies before it sends
            record["answers"] = answers
            record.update(self.answer_riders(answers))
        words = [[m.request, [list(f) for f in m.fields], list(m.names), self.riders(m)]
                 for m in out.messages if m.to == DECODE and _is_word(m)]
        if words:  # ... and what decode must hear (a prefill's next life sends it again)
            record["words"] = words
        if self.role == DECODE and r is not None:  # what a crash now would take from it
            record["knows"] = core.decode_knows(self.part.rows[r])
        stamp = self.log.step(record)
        here = self.life_hook(f"{self.part.name}:{event.action}")
        if here(self.deployment.die_after_step):  # fault injection (tests): logged, unsent
            os.kill(os.getpid(), signal.SIGKILL)
        if here(self.deployment.hang_after_step):  # ... or its loop hangs for good
            threading.Event().wait()
        for message in out.messages:
            self.send_part_message(message, stamp)
        self.carry(out.commands, stamp)
        return True

    def carry(self, commands: tuple, stamp: list) -> None:
        for command in commands:
            handler = getattr(self, f"do_{command.name}", None)
            if handler is not None:  # the others need nothing of a modelled worker
                handler(command, stamp)

    def free_pages(self, need: int) -> tuple | None:
        free = [self.part.base + i for i, page in enumerate(self.part.pool) if page[0] == NONE]
        return tuple(free[:need]) if len(free) >= need else None

    def candidates(self, r: int) -> tuple:
        """What this process offers its part for r (the router's part takes no protocol
        action of its own: it has none to offer)."""
        return self.part.offers(r, self.free_pages)

    def settle_rows(self) -> list[int]:
        return sorted(self.part.rows)

    def command(self, command: dict) -> None:
        """A command from stdin other than stop and exit: "dial" (a restarted process's
        port, from the launcher), or serving's (the router's)."""
        if command.get("do") == "dial":
            peer = Peer(command["role"], command["worker"]) if "role" in command else None
            self.dial(command["port"], command.get("host", "127.0.0.1"), peer,
                      command.get("epoch"))
            return
        raise ValueError(f"{self.part.name}: no command {command.get('do')!r}")

    def dial(self, port: int, host: str = "127.0.0.1", peer: Peer | None = None,
             epoch: int | None = None) -> bool:
        """Connect to a peer this process was told to dial (`peer` and its `epoch`, when
        the launcher named them); whether it connected. A peer that cannot be reached (it
        died since it was named, or a partition) is reported and skipped, never fatal:
        `on_dial_failed` says what the role makes of it."""
        try:
            self.channel.connect(port, host)
            return True
        except ChannelError as error:
            self.dial_failed(peer, epoch, str(error), port=port, host=host)
            return False

    def dial_failed(self, peer: Peer | None, epoch: int | None, why: str, **where) -> None:
        report(ev="dial_failed", peer=str(peer) if peer else None, epoch=epoch, reason=why,
               **where)
        if peer is not None and epoch is not None:
            self.on_dial_failed(peer, epoch, why)

    def on_dial_failed(self, peer: Peer, epoch: int, why: str) -> None:
        """A named peer's life could not be reached (its role's override)."""

    def pool_report(self) -> dict:
        """Its pool's occupancy, as /v1/kvproof/state shows it (a worker's)."""
        free = sum(page[0] == NONE for page in self.part.pool)
        return {"pages": len(self.part.pool), "free": free, "held": len(self.part.pool) - free,
                "writes_in_flight": len(self.part.sending),
                "requests_known": len(self.part.rows)}  # every one heard of, settled too

    def settle(self) -> None:
        """Take every action the part's state now allows, until none is left."""
        progress = True
        while progress:
            progress = False
            for r in self.settle_rows():
                for event in self.candidates(r):
                    if self.step(event):
                        progress = True
                        break


@dataclass(frozen=True)
class Fence:
    """A worker's life the router cut off and waits on: its epoch, and for one that joined
    at a rendezvous (it fences itself) when its own fence is done at the latest (monotonic
    s; None: its launcher kills that epoch and answers)."""

    epoch: int
    deadline_s: float | None
    reason: str = ""


class RouterProcess(Process):
    """The router, the serving edge, and the environment's log."""

    ROLE = ROUTER

    def __init__(self, deployment: Deployment, worker: int = 0) -> None:
        super().__init__(deployment)
        self.environment = PartLog(log_path(deployment, ENVIRONMENT), ENVIRONMENT, self.model)
        self.random = random.Random(deployment.seed)
        self.arrived = 0
        self.next_arrival_s = 0.0
        self.refused: dict[int, str] = {}        # request -> why it never arrived
        self.dead: set[int] = set()              # decodes declared down here
        self.tokens: dict[int, list] = {}        # request -> the tokens streamed so far
        self.token_counts: dict[int, int] = {}   # request -> tokens (None too) heard here
        self.arrived_at: dict[int, float] = {}   # request -> its Arrive (monotonic s)
        self.token_at: dict[int, list] = {}      # request -> when each token came here
        self.crash_reports: dict[int, dict] = {}  # decode -> {prefill: its last step}
        # Which prefill lives are connected to which decode life, as far as the router
        # knows: decode -> prefills. Every prefill dialled every decode before the router
        # started; a decode's new life is linked to a prefill once that prefill says so
        # ("up", naming the decode's epoch), a dead prefill to nothing. A barrier waits only
        # for the reports of lives linked to the dead one: a life that never reached it
        # cannot see it die (two faults at once: engine/README.md).
        self.links: dict[int, set[int]] = {
            d: set(range(deployment.prefill_workers)) for d in range(deployment.decode_workers)}
        self.prefill_waits: dict[int, set[int]] = {}  # dead prefill -> decodes it waits on
        # A restarted decode's new life: the router's own connection to it is up; it is
        # placed on once every live prefill is linked to it.
        self.new_life_up: set[int] = set()
        self.crashes_logged: list[int] = []
        self.payloads: dict[int, list] = {}      # serving: request -> its payload
        self.live: set[int] = set()              # serving: arrived, not answered yet
        # Prefill crashes (`record_prefill_crash`): prefills down here and not back yet,
        # each live decode's report for each, each prefill's epoch, those being restarted,
        # and, on the real data path, those restarted without one (no request goes there).
        self.dead_prefills: set[int] = set()
        self.prefill_reports: dict[int, dict] = {}
        self.prefill_heard: dict[int, set] = {}  # prefill -> its steps decodes heard (k)
        self.tombed: set[int] = set()  # requests a logged DecodeCrash took (tombstones)
        self.epochs: dict[str, int] = {}          # a restarted process -> its epoch
        self.restarting: set[int] = set()
        self.retired: set[int] = set()
        self.restarts: list[str] = []             # the processes restarted, in order
        self.last_lives: set[str] = set()         # prefills given a last life (no request)
        self.crashing: set[int] = set()           # decodes whose crash is being recorded
        self.leaving: set[str] = set()            # workers draining (SIGTERM): none placed
        self.gone: set[str] = set()               # workers that drained and left cleanly
        # Fences (`fence`): a worker's life cut off here, until it can write no more (its
        # launcher killed that epoch, or, one that joined at a rendezvous, the bound of its
        # own fence passed), then fenced until a new life of it is up.
        self.fencing: dict[str, Fence] = {}
        self.fenced: dict[str, Fence] = {}
        self.given_up: dict[str, str] = {}        # decodes dead for good -> why

    # -- serving: requests from stdin, tokens and answers on stdout ----------------------

    def command(self, command: dict) -> None:
        if command["do"] == "fenced":  # the launcher killed that life (Launched.fence)
            self.on_fenced(Peer(command["role"], command["worker"]), command["epoch"])
        elif command["do"] == "life_failed":  # its launcher could not start that life
            self.life_failed(Peer(command["role"], command["worker"]), command["epoch"],
                             command["reason"])
        elif command["do"] == "partition":  # fault injection, for tests only: the link
            # to one worker cut here, as a partition between the two would
            self.channel.cut(Peer(command["role"], command["worker"]),
                             "fault injection: a partition between the router and it")
        elif command["do"] == "dial":
            self.dial_life(command)
        elif not self.deployment.serving_requests_max:
            super().command(command)
        elif command["do"] == "arrive":
            self.arrive(command)
        elif command["do"] == "abort":
            self.abort(command["request"])
        else:
            super().command(command)

    def dial_life(self, command: dict) -> None:
        """Dial a worker's new life (the launcher's word, with its address). A decode that
        joined at a rendezvous is dialled by the prefills too, which take no command on
        stdin: the router passes its address on to each prefill connected here."""
        super().command(command)
        if command.get("role") != DECODE or not self.deployment.rendezvous:
            return
        d = command["worker"]
        if self.channel.epoch_of(Peer(DECODE, d)) != command["epoch"]:
            return  # (not reached: fenced as a new life the router cannot reach)
        for q in self.up_prefills():
            self.send(Peer(PREFILL, q), {"t": "dial", "decode": d, "epoch": command["epoch"],
                                         "host": command.get("host", "127.0.0.1"),
                                         "port": command["port"]})

    def arrive(self, command: dict) -> None:
        """A request from the serving edge: placed on a prefill and a live decode (seeded),
        then Arrive, as the workload's arrivals are."""
        r = command["request"]
        live = self.live_decodes()
        prefills = self.live_prefills()
        if r in self.arrived_at or not 0 <= r < self.deployment.serving_requests_max or not live:
            report(ev="answer", request=r, outcome="ErrDecode",
                   detail=(self.no_decode_for_good() or "no live decode worker") if not live
                   else "a request number this deployment cannot take")
            return
        if not prefills:
            report(ev="answer", request=r, outcome="ErrPrefill",
                   detail="no live prefill worker")
            return
        q = self.random.choice(prefills)
        self.placement[r] = (q, self.random.choice(live))
        self.payloads[r] = command["payload"]
        self.arrived_at[r] = time.monotonic()
        self.live.add(r)
        assert self.step(core.Arrive(r, command["pages"], *self.placement[r]))

    def abort(self, r: int) -> None:
        """The client went away: the core's Abort (refused, and nothing changes, once the
        request has its answer)."""
        if r in self.live:
            self.step(core.Abort(r))

    def answers(self) -> None:
        """Each request whose client state turned final: its answer on stdout, once."""
        for r in sorted(self.live):
            client = self.part.rows[r][core.CLIENT]
            if client in FINAL_CLIENT:
                self.live.discard(r)
                self.payloads.pop(r, None)
                report(ev="answer", request=r, outcome=core.CLIENT_NAMES[client])

    def settle_rows(self) -> list[int]:
        """Serving: only live requests (its rows hold every request number of the
        deployment's life)."""
        if self.deployment.serving_requests_max:
            return sorted(self.live)
        return super().settle_rows()

    def tick(self) -> None:
        """Every arrival of the workload that is due: all at once when they come 0 s apart,
        as serving takes every request waiting on stdin in one turn (one a turn spread 32
        arrivals over 0.3 s of polls, and the prefill computed the first prompt alone)."""
        self.fences_due()
        if self.deployment.serving_requests_max:
            return  # arrivals come from stdin
        while self.arrive_due():
            pass

    def arrive_due(self) -> bool:
        """The workload's next arrival, if it is due; whether it arrived (or was refused:
        no decode is live and none can come back, `no_decode_for_good`)."""
        now = time.monotonic()
        prefills = self.live_prefills()
        live = self.live_decodes()
        why = self.no_decode_for_good()
        if self.arrived < len(self.deployment.prompts) and now >= self.next_arrival_s and why:
            self.refused[self.arrived] = why  # (no Arrive: the spec never hears of it)
            report(ev="arrival_refused", request=self.arrived, reason=why)
            self.arrived += 1
            return True
        if self.arrived < len(self.deployment.prompts) and now >= self.next_arrival_s \
                and prefills and live:  # (while none is up, arrivals wait for a restart)
            r = self.arrived
            q = self.random.choice(prefills)
            d = self.random.choice(live)
            self.placement[r] = (q, d)
            self.arrived += 1
            self.next_arrival_s = now + self.deployment.arrive_every_s
            if r < len(self.deployment.arrive_after_s):
                self.next_arrival_s = now + self.deployment.arrive_after_s[r]
            self.arrived_at[r] = now
            assert self.step(core.Arrive(r, self.deployment.prompts[r], q, d))
            return True
        return False

    def riders(self, message: PartMessage) -> dict:
        """The request's payload, with each message to a worker (the first one is what
        counts: a worker hears of a request with its first message)."""
        if self.deployment.serving_requests_max:  # answered: its workers have it already
            payload = self.payloads.get(message.request)
            return {"payload": payload} if payload is not None else {}
        requests = self.deployment.requests
        return {"payload": list(requests[message.request])} if requests else {}

    def on_token(self, peer: Peer, body: dict) -> None:
        """A token streamed by the request's decode (None: a tag check failed)."""
        r = body["request"]
        self.token_counts[r] = self.token_counts.get(r, 0) + 1
        if self.deployment.serving_requests_max:
            report(ev="token", request=r, token=body["token"])
            return
        if body["token"] is not None:
            self.tokens.setdefault(r, []).append(body["token"])
            self.token_at.setdefault(r, []).append(time.monotonic())

    def span_s(self) -> float:
        """From the first Arrive to the last token streamed here."""
        last = [at[-1] for at in self.token_at.values()]
        return round(max(last) - min(self.arrived_at.values()), 6) if last else 0.0

    def timings(self) -> list:
        """Per request: seconds from its Arrive to its first token and to its last."""
        return [[round(at[0] - self.arrived_at[r], 6), round(at[-1] - self.arrived_at[r], 6)]
                if (at := self.token_at.get(r)) else None
                for r in range(len(self.deployment.prompts))]

    def done(self) -> bool:
        if self.deployment.serving_requests_max:
            return False
        return self.arrived == len(self.deployment.prompts) and all(
            row[core.CLIENT] in FINAL_CLIENT for r, row in self.part.rows.items()
            if r not in self.refused)

    def outcomes(self) -> list[str]:
        return [core.CLIENT_NAMES[self.part.rows[r][core.CLIENT]]
                for r in range(len(self.deployment.prompts))]

    def environment_step(self, event: core.Event, causes: list) -> list:
        for stamp in causes:
            self.environment.heard_from(stamp)
        r = getattr(event, "request", None)
        placement = {r: self.placement[r]} if r is not None else {}
        return self.environment.step(codec.encode(local_event(self.model, event, placement)))

    def on_landed(self, peer: Peer, body: dict) -> None:
        """Decode landed a write: the environment's LandWrite, after the write's posting and
        its landing; then the prefill's completion."""
        write = _tuples(body["write"])
        stamp = self.environment_step(core.LandWrite(write[0], write[2]),
                                      [body["poster"], body["stamp"]])
        self.send(Peer(PREFILL, self.placement[write[0]][0]),
                  {"t": "completed", "request": write[0], "write": list(write), "stamp": stamp})

    def on_peer_down(self, peer: Peer, epoch: int) -> None:
        if str(peer) in self.gone or epoch != self.epochs.get(str(peer), 1):
            return  # it drained and left (SIGTERM): no crash; or an earlier life, dealt with
        if peer.role == DECODE:
            self.dead.add(peer.worker)
            self.crash_reports.setdefault(peer.worker, {})
            self.fence(peer, "its router declared it down")
        elif peer.role == PREFILL:
            q = peer.worker
            self.dead_prefills.add(q)
            self.restarting.discard(q)  # (a new life that died before it said it is back)
            self.prefill_reports.setdefault(q, {})
            # Its barrier waits for the decode lives it was linked to; its next life is
            # linked to none until it says so.
            self.prefill_waits[q] = {d for d, linked in self.links.items() if q in linked}
            for linked in self.links.values():
                linked.discard(q)
            self.fence(peer, "its router declared it down")
            self.barriers_again()

    def barriers_again(self) -> None:
        """A prefill died or came back: a decode's crash waits for one report fewer, and a
        decode's new life for one link fewer or more."""
        for d in sorted(self.crash_reports):
            if d in self.dead and d not in self.crashing:
                self.record_crash(d)
        for d in sorted(self.crashing):
            self.back_up(d)

    def fence(self, peer: Peer, why: str) -> None:
        """Make sure a worker declared down here can do nothing more that counts, before its
        log is touched and its crash is recorded: cut it off here (its connection closed, its
        epoch refused from then on) and have it stopped, by its launcher (`fence` report:
        Launched.fence kills it and answers "fenced"), or, a worker that joined at a
        rendezvous, by itself (it fences itself once it loses its router:
        Process.on_channel_down) within `fence_wait_s`. A dead worker is fenced at no cost;
        a live one (partitioned from the router or from a peer, hung, stopped) is made
        dead, so that a partition follows the crash's path (`on_fenced`). The fence names
        the life it fences (its epoch): a kill meant for one life never reaches the next."""
        name = str(peer)
        if name in self.fencing or name in self.fenced:
            return
        external = bool(self.deployment.rendezvous)
        fence = self.fencing[name] = Fence(self.epochs.get(name, 1), time.monotonic()
                                           + self.deployment.fence_wait_s() if external else None,
                                           why)
        self.channel.cut(peer, f"fenced: {why}")
        report(ev="fence", role=peer.role, worker=peer.worker, epoch=fence.epoch, reason=why,
               at_s=time.time())

    def fences_due(self) -> None:
        """The fences of workers that joined at a rendezvous whose bound has passed."""
        now = time.monotonic()
        for name, fence in sorted(self.fencing.items()):
            if fence.deadline_s is not None and now >= fence.deadline_s:
                role, _, worker = name.partition(" ")
                self.on_fenced(Peer(role, int(worker)), fence.epoch)

    def on_fenced(self, peer: Peer, epoch: int) -> None:
        """That life of the worker writes nothing more: its crash's path goes on."""
        name = str(peer)
        if name not in self.fencing or self.fencing[name].epoch != epoch or self.stopped:
            return  # (not being fenced, another life's, or the router ended its logs)
        self.fenced[name] = self.fencing.pop(name)
        report(ev="fenced", role=peer.role, worker=peer.worker, epoch=epoch, at_s=time.time())
        if peer.role == DECODE and peer.worker in self.crashing:
            self.new_life_failed(peer.worker)
        elif peer.role == DECODE:
            self.record_crash(peer.worker)
        else:
            self.record_prefill_crash(peer.worker)

    def life_failed(self, peer: Peer, epoch: int, why: str) -> None:
        """A new life its launcher could not start (it exited, or never listened, within
        the bound): fenced as one that died at once, so that the crash's path goes on (a
        decode's: `new_life_failed`; a prefill's: another restart, or its last life)."""
        if epoch != self.epochs.get(str(peer), 1) or self.stopped:
            return  # (another life's word)
        report(ev="life_failed", role=peer.role, worker=peer.worker, epoch=epoch, reason=why)
        if peer.role == PREFILL:
            self.restarting.discard(peer.worker)
        self.fence(peer, f"its new life did not start: {why}")

    def on_restarted(self, peer: Peer, body: dict) -> None:
        """A prefill's new life took its crash, whose answers came before this (one
        connection, in order): each live decode hears of it now, and requests may go
        there again (on the modelled data path; a real one restarts without its data path,
        `record_prefill_crash`), each Arrive after the crash (its clock follows the crash's:
        a request placed there before the crash step would be one the crash ended)."""
        self.log.heard_from(body["stamp"])
        self.restarting.discard(peer.worker)
        self.fenced.pop(str(peer), None)
        self.dead_prefills.discard(peer.worker)
        self.prefill_reports.pop(peer.worker, None)
        self.prefill_waits.pop(peer.worker, None)
        for d in range(self.deployment.decode_workers):
            if d not in self.dead:
                self.send(Peer(DECODE, d), {"t": "prefill_back", "prefill": peer.worker,
                                            "lost": body["lost"], "stamp": body["stamp"]})
        self.barriers_again()

    def on_leaving(self, peer: Peer, body: dict) -> None:
        """A worker drains (SIGTERM): nothing more is placed there, and it hears so after
        every placement sent there (one connection, in order)."""
        self.leaving.add(str(peer))
        if peer.role == PREFILL:
            self.retired.add(peer.worker)  # (a new life after a cut drain takes no request)
        self.send(peer, {"t": "farewell"})

    def on_left(self, peer: Peer, body: dict) -> None:
        """It finished what it held and ended its log: its going is no crash."""
        self.gone.add(str(peer))

    def no_decode_for_good(self) -> str:
        """Why no decode can take a request again ("" while one is live or may come back:
        a restart): each one given up or leaving."""
        names = [f"{DECODE} {d}" for d in range(self.deployment.decode_workers)]
        if not all(n in self.given_up or n in self.leaving for n in names):
            return ""
        return "no live decode worker: " + "; ".join(
            self.given_up.get(n, f"{n} left (drained)") for n in names)

    def live_decodes(self) -> list[int]:
        return [d for d in range(self.deployment.decode_workers)
                if d not in self.dead and f"{DECODE} {d}" not in self.leaving]

    def on_peer_up(self, peer: Peer, epoch: int) -> None:
        """A decode's new life connected here (`back_up` says when it is placed on)."""
        if peer.role == DECODE and peer.worker in self.crashing:
            self.new_life_up.add(peer.worker)
            self.back_up(peer.worker)

    def on_up(self, peer: Peer, body: dict) -> None:
        """A prefill is connected to a decode's life: linked, if that is the decode's
        current life (a late word about an earlier one links nothing)."""
        d = body["decode"]
        if body.get("epoch", self.epochs.get(f"{DECODE} {d}", 1)) \
                == self.epochs.get(f"{DECODE} {d}", 1):
            self.links[d].add(peer.worker)
        self.back_up(d)

    def back_up(self, d: int) -> None:
        """A decode's new life is up once it is connected here and linked to every live
        prefill: requests may go there again (every Arrive the router takes from now on
        follows the crash it logged). Not before: its page table to a prefill that has not
        dialled it yet would be lost (nothing is sent again: requests would hang)."""
        if (d not in self.crashing or d not in self.new_life_up
                or not set(self.live_prefills()) <= self.links[d]):
            return
        self.crashing.discard(d)
        self.new_life_up.discard(d)
        self.fenced.pop(f"{DECODE} {d}", None)
        self.dead.discard(d)
        self.crash_reports.pop(d, None)

    def live_prefills(self) -> list[int]:
        return [q for q in range(self.deployment.prefill_workers)
                if q not in self.dead_prefills and q not in self.retired]

    def on_pdown(self, peer: Peer, body: dict) -> None:
        """A decode's detector declared a prefill down: every landing of its writes that
        decode took came before this report (one connection, in order)."""
        self.prefill_reports.setdefault(body["prefill"], {})[peer.worker] = body["stamp"]
        self.prefill_heard.setdefault(body["prefill"], set()).update(body["heard"])
        self.record_prefill_crash(body["prefill"])

    def record_prefill_crash(self, q: int) -> None:
        """Prefill q died. Once the router and every live decode have seen it (so every
        LandWrite of q's writes is logged here), its supervisor restarts it in a new
        epoch: this reports "restart" to the launcher (`Launched`) with what the new life
        needs: its epoch, the steps its crash follows, and each request placed on q (its
        decode and prompt); the launcher fences the old process (a partitioned one may
        still run) before it cuts the old life's log. The new life
        rebuilds what its log says (core.recovered_prefill_rows) and takes PrefillCrash(q)
        itself (spec/parts.py: a prefill's own action), which answers the lost clients
        ErrPrefill; decode then times out what it waits for there, and the new life
        answers the cancels (PrefillProcess). On the real data path the new life has no
        data path (the gloo world cannot take a rank back) and no request goes there."""
        reports = self.prefill_reports[q]
        live = {d for d in self.prefill_waits.get(q, ())  # (one that left sees nothing)
                if d not in self.dead and f"{DECODE} {d}" not in self.gone}
        if (q not in self.dead_prefills or f"{PREFILL} {q}" not in self.fenced
                or not live <= set(reports) or q in self.restarting):
            return
        name = f"{PREFILL} {q}"
        last = not self.may_restart(PREFILL, q)
        if last and name in self.last_lives:
            # Its last life died too: it stays dead, its log closed here. What that life
            # had not ended yet waits (a gap: no life is left to take PrefillCrash).
            self.retired.add(q)
            close_dead_log(log_path(self.deployment, name), name)
            self.recover_answers(name, logged_steps(log_path(self.deployment, name), name))
            return
        if last:
            # A prefill that died in every life it was given gets one more that takes no
            # request: only a next life's PrefillCrash ends what the dead one held (the
            # clients' ErrPrefill, the decodes' pages through the answers to their cancels).
            self.last_lives.add(name)
        self.restarting.add(q)
        self.fenced.pop(name, None)  # (a new life: fenced anew if it fails before it is back)
        if self.deployment.model_dir or last:
            self.retired.add(q)
        placed = [[r, d, self.part.rows[r][core.PROMPT]]
                  for r, (p, d) in sorted(self.placement.items()) if p == q]
        self.recover_answers(name, logged_steps(log_path(self.deployment, name), name))
        self.ask_restart(PREFILL, q, {
            "placed": placed, "heard": sorted(self.prefill_heard.pop(q, set())),
            "after": [self.log.stamp(), self.environment.clock.last(), *reports.values()]})

    def may_restart(self, role: str, worker: int) -> bool:
        """Whether a dead worker gets another life: not past `restarts_max`, and a decode
        only on the modelled data path (a decode with no data path could serve nothing;
        a prefill's new life without one still ends what its old one held)."""
        name = f"{role} {worker}"
        if role == DECODE and (self.deployment.model_dir or name in self.leaving):
            return False
        if self.restarts.count(name) >= self.deployment.restarts_max:
            last = self.fenced.get(name)
            why = (f"{name} died in each of its {self.restarts.count(name) + 1} lives "
                   f"(restarts_max {self.deployment.restarts_max}); its last life, epoch "
                   f"{self.epochs.get(name, 1)}, was fenced: {last.reason if last else '?'}")
            if role == DECODE:
                self.given_up[name] = why  # (it stays dead: placed on no more)
            report(ev="gave_up", role=role, worker=worker, restarts=self.restarts.count(name),
                   reason=why)
            return False
        return True

    def ask_restart(self, role: str, worker: int, restart: dict) -> None:
        """The launcher starts the worker's next life (`Launched.restart`): its epoch and
        what the new life needs."""
        name = f"{role} {worker}"
        self.restarts.append(name)
        epoch = self.epochs[name] = self.epochs.get(name, 1) + 1
        report(ev="restart", role=role, worker=worker, restart={"epoch": epoch, **restart})

    def on_down(self, peer: Peer, body: dict) -> None:
        """A prefill's detector declared a decode down; it stopped its requests there. If
        the router's own detector still sees that decode (a partition between the two, not
        a crash: the prefill waits for a crash record), the router makes it a crash: it
        fences the decode (so that only a crash's record can end what the prefill froze).
        Not a decode that drains (SIGTERM): its going closes the link too, its `left` may
        come after this report, and a partitioned one ends by its drain's bound."""
        d = body["decode"]
        current = self.epochs.get(f"{DECODE} {d}", 1)
        if body.get("epoch", current) != current:
            return  # (about a life whose crash is recorded: its new life is another peer)
        if d in self.crashing:  # its new life, not placed on yet, which q cannot reach
            self.fence(Peer(DECODE, d), f"{peer} could not reach its new life")
            return
        self.crash_reports.setdefault(d, {})[peer.worker] = body["stamp"]
        if d not in self.dead and f"{DECODE} {d}" not in self.leaving:
            self.dead.add(d)
            self.fence(Peer(DECODE, d), f"{peer} lost its connection to it")
        self.record_crash(d)

    def record_crash(self, d: int) -> None:
        """DecodeCrash(d), once the router and every live prefill have seen it (the module's
        docstring says why)."""
        reports = self.crash_reports[d]
        live = self.links[d] - set(self.down_prefills())  # (linked to the dead life)
        if (d not in self.dead or f"{DECODE} {d}" not in self.fenced
                or not live <= set(reports) or d in self.crashing):
            return
        self.crashing.add(d)
        self.links[d] = set()  # (its new life is linked to none yet)
        self.new_life_up.discard(d)
        self.crashes_logged.append(d)
        for waits in self.prefill_waits.values():
            waits.discard(d)  # (its next life never saw a prefill that died before it)
        name = f"{DECODE} {d}"
        restart = self.may_restart(DECODE, d)
        # A decode that gets a new life goes on with its log (the launcher cuts its torn
        # line after the fence); one that does not has it closed here.
        steps, clock = (cut_dead_log if restart else close_dead_log)(
            log_path(self.deployment, name), name)
        dead = logged_steps(log_path(self.deployment, name), name)
        self.recover_answers(name, dead)
        after, lost = self.log.stamp(), self.known_at(d, dead)
        if lost:
            # (a crash that takes nothing from any request is no step of the spec: nothing
            # is logged)
            causes = [[name, steps, clock], self.log.stamp(), *reports.values()]
            after = self.environment_step(core.DecodeCrash(d), causes)
            self.log.heard_from(after)
            self.part.decode_crashed(lost)
            self.tombed.update(lost)
        self.send_crash_record(d, [r for r, (_, dd) in self.placement.items() if dd == d]
                               if lost else [], after)
        if restart:  # its new life's steps follow the crash
            self.fenced.pop(name, None)  # (a new life: fenced anew if it fails)
            self.ask_restart(DECODE, d, {"after": [after]})
        for q in sorted(self.dead_prefills):  # a prefill's barrier waits for one fewer
            self.record_prefill_crash(q)

    def known_at(self, d: int, steps: list[dict]) -> list[int]:
        """The requests placed on decode d that it knew of when it died (the spec's
        KnownAt, what DecodeCrash(d) takes): each one whose last step in its log says so
        (`"knows"`, decode's own verdict after the step, core.decode_knows), or that has no
        step there (its bootstrap is on the way), except those an earlier crash of d
        ended. Not "its client still waits": a client may have its answer (from the wire,
        or from the log: `recover_answers`) while decode still holds the request's pages,
        which the crash frees and a new life may then reserve. `steps`: its log's."""
        last = {x["request"]: x.get("knows", True) for x in steps if "request" in x}
        return sorted(r for r, row in self.part.rows.items()  # (a refused prompt: nowhere)
                      if row[core.DW] == d and r not in self.tombed and last.get(r, True))

    def recover_answers(self, name: str, steps: list[dict]) -> None:
        """The answers a dead worker's log holds that never reached here. A process logs
        a step before anything the step sends leaves it, so one killed between the two
        leaves a step whose answer its client never heard while the merged run says the
        client has it (a decode's Finish: Ok in the run, ErrDecode from the crash's path
        here). Each step's line names the answers it sends (`Process.step`); the edge
        gives each one whose client still waits now, with the tokens the line carries that
        never came (a decode's, on the real data path), as if its message had come: the
        first answer stands, as for any message. `steps`: its log's."""
        for x in steps:
            for r, fields, names in x.get("answers", ()):
                row = self.part.rows.get(r)
                if row is None or row[core.CLIENT] != core.WAITING:
                    continue
                self.log.heard_from([x["part"], x["k"], x["c"]])
                for token in x.get("tokens", {}).get(str(r), [])[self.token_counts.get(r, 0):]:
                    self.on_token(None, {"request": r, "token": token})
                message = PartMessage(r, ROUTER, tuple((k, _tuples(v)) for k, v in fields),
                                      tuple(names))
                self.carry(self.part.receive(message), self.log.stamp())
                report(ev="recovered_answer", request=r, part=name, step=x["a"],
                       outcome=core.CLIENT_NAMES[self.part.rows[r][core.CLIENT]])

    def on_dial_failed(self, peer: Peer, epoch: int, why: str) -> None:
        """The router could not reach a worker's new life: a decode's is fenced as one a
        prefill cannot reach, a prefill's as one that did not start (`life_failed`)."""
        if peer.role == DECODE and peer.worker in self.crashing \
                and epoch == self.epochs.get(str(peer), 1):
            self.fence(peer, f"its router could not reach its new life: {why}")
        elif peer.role == PREFILL and peer.worker in self.restarting:
            self.life_failed(peer, epoch, f"its router could not reach it: {why}")

    def new_life_failed(self, d: int) -> None:
        """Decode d's new life was fenced before it was placed on (it died, or a prefill
        could not reach it: a partition that outlasted the restart): it holds no request,
        so no crash step is logged and no barrier is waited for. It gets another life, or,
        after `restarts_max`, is given up (its log closed here, placed on no more); the
        prefills hear an empty crash record, which ends any freeze of it there."""
        name = f"{DECODE} {d}"
        self.new_life_up.discard(d)
        self.links[d] = set()
        restart = self.may_restart(DECODE, d)
        (cut_dead_log if restart else close_dead_log)(log_path(self.deployment, name), name)
        self.send_crash_record(d, [], self.log.stamp())
        if restart:
            self.fenced.pop(name, None)
            self.ask_restart(DECODE, d, {"after": [self.log.stamp()]})

    def down_prefills(self) -> list[int]:
        up = self.channel.peers()
        return [q for q in range(self.deployment.prefill_workers)
                if Peer(PREFILL, q) not in up]

    def up_prefills(self) -> list[int]:
        down = set(self.down_prefills())
        return [q for q in range(self.deployment.prefill_workers) if q not in down]

    def send_crash_record(self, d: int, requests: list[int], stamp: list) -> None:
        """DecodeCrash(d) as every prefill up here sees it (`on_crash`): the spec's step is
        every prefill's at once, so one not waited for (a new life whose link the router had
        not heard of) may have seen the decode die and frozen its requests, and the record
        ends that freeze, also when nothing was lost. It names the life it ends (its epoch)
        and the requests placed on d (a prefill sends nothing more for one to d's next life)."""
        epoch = self.epochs.get(f"{DECODE} {d}", 1)
        for q in self.up_prefills():
            self.send(Peer(PREFILL, q), {"t": "crash", "decode": d, "requests": requests,
                                         "stamp": stamp, "epoch": epoch})

    def end(self) -> None:
        """Its log ended, then each worker hears its bye: one that joined at a rendezvous
        ends with it (drains) rather than fence itself. A decode that joined at a
        rendezvous whose next life its operator never started (or that never reached the
        router) has its log closed here, as a supervisor closes a dead one's."""
        super().end()
        for peer in sorted(self.channel.peers()):
            self.send(peer, {"t": "bye"})
        for d in sorted(self.crashing - self.new_life_up) if self.deployment.rendezvous else ():
            name = f"{DECODE} {d}"
            if name not in self.given_up:  # (one given up had its log closed then)
                close_dead_log(log_path(self.deployment, name), name)
                report(ev="never_rejoined", role=DECODE, worker=d,
                       epoch=self.epochs.get(name, 1))

    def finish(self) -> dict:
        self.environment.end()
        return {"outcomes": self.outcomes(), "crashes": self.crashes_logged,
                "restarts": self.restarts, "environment_steps": self.environment.clock.k}


class PrefillProcess(Process):
    ROLE = PREFILL

    def __init__(self, deployment: Deployment, worker: int = 0,
                 restart: dict | None = None) -> None:
        super().__init__(deployment, worker, restart)
        if deployment.model_dir:
            from engine.process_data import PrefillData
            self.data = PrefillData(deployment, worker, self.channel.wake)
        self.posted_at: dict[int, float] = {}  # request -> when its last write was posted
        self.partitioned: set[int] = set()  # decodes behind a lasting partition (a hook)
        self.recovering = restart is not None
        self.unheard_words: list = []  # a new life: (step, word) to send again (`recover`)
        self.ended_before: set[int] = set()  # ... and what an earlier life's crash ended
        if restart is not None:
            self.recover(restart)

    def holds(self) -> set[int]:
        """Requests queued or running here, and those with a write out."""
        rows = self.part.rows
        return {r for r in self.placement if rows[r][core.PST] in (core.QUEUED, core.RUNNING)
                } | {w[0] for w in self.part.sending}

    def recover(self, restart: dict) -> None:
        """A new life: what it knows of its previous ones is the router's placement and
        prompt of each request placed here and its own log (core.recovered_prefill_rows);
        its crash step follows the steps the router names (every LandWrite of its writes,
        each decode's last step before it saw the death)."""
        q = self.part.worker
        rows = {}
        for r, d, pages in restart["placed"]:
            self.placement[r] = (q, d)
            rows[r] = core._row(self.part.blank, core.PROMPT, pages, core.PW, q, core.DW, d,
                                core.CLIENT, core.WAITING)
        steps = logged_steps(log_path(self.deployment, self.part.name), self.part.name)
        self.part.rows.update(core.recovered_prefill_rows(rows, map(codec.decode, steps)))
        for stamp in restart["after"]:
            self.log.heard_from(stamp)
        # The last final word of each request, unless a decode heard it: a life killed
        # between a step's log line and its messages never sent it, and the spec's word
        # is on the wire until decode takes it (PrefillCrash leaves it there).
        last = {word[0]: (x, word) for x in steps for word in x.get("words", ())}
        heard = set(restart.get("heard", ()))
        # What an earlier new life's PrefillCrash ended (its answers), which it may have died
        # before announcing: decode times those out too (a Timeout of one it has no longer
        # waiting is refused).
        self.ended_before = {a[0] for x in steps if x["a"] == "PrefillCrash"
                             for a in x.get("answers", ())}
        self.unheard_words = [(x, word) for x, word in last.values()
                              if x["k"] not in heard and word[0] in self.placement]

    def settle(self) -> None:
        """A new life takes its PrefillCrash first, once the router is connected (it dialled
        the decodes before it listened: each one it could reach is connected already; one
        that died meanwhile is not waited for): the crash's answers go to the router, and
        then its notice that it is back, which the router passes on to each decode (so
        every lost client has its answer here before a decode can time the request out)."""
        if self.recovering:
            if self.channel.epoch_of(Peer(ROUTER, 0)) is None:
                return
            self.recovering = False
            lost = sorted({r for r in self.placement if self.part.rows[r][core.PST]
                           in (core.QUEUED, core.RUNNING)} | self.ended_before)
            self.step(core.PrefillCrash(self.part.worker))  # refused when it lost nothing
            self.send(Peer(ROUTER, 0), {"t": "restarted", "lost": lost,
                                        "stamp": self.log.stamp()})
            for x, (r, fields, names, riders) in self.unheard_words:
                q, d = self.placement[r]
                self.send(Peer(DECODE, d), {
                    "t": "msg", "stamp": [x["part"], x["k"], x["c"]], "request": r,
                    "to": DECODE, "fields": fields, "names": names, "placement": [q, d],
                    **riders})
                report(ev="word_again", request=r, step=x["a"], k=x["k"])
        super().settle()

    def work(self) -> bool:
        """A chunked prefill step: a request whose prompt is computed may send its pages."""
        if self.data is None:
            return False
        self.data.poll()
        computed = self.data.step()
        for r in computed:
            self.ready_at[r] = time.monotonic() + self.deployment.compute_s
        return bool(computed)

    def settle_due(self, since: float) -> bool:
        """On the real data path, when a hold ran out since: the one after a compute
        (compute_s), or before a SendDone (send_done_after_s)."""
        now, hold = time.monotonic(), self.deployment.send_done_after_s
        ends = [*self.ready_at.values(), *(at + hold for at in self.posted_at.values())]
        return super().settle_due(since) or any(since < end <= now for end in ends)

    def riders(self, message: PartMessage) -> dict:
        """The first token, sampled here, with the final word to decode."""
        first = self.data.first.get(message.request) if self.data is not None else None
        if message.to == DECODE and core.FINAL_WORD_MSG in message.names and first is not None:
            return {"first": first}
        return {}

    def candidates(self, r: int) -> tuple:
        """Its part's offers, but nothing for a request on a decode its detector declared
        down (frozen until the crash's record comes: the module's docstring), and no
        SendPage before the modelled compute is done."""
        if self.placement[r][1] in self.dead_decodes:
            return ()
        now = time.monotonic()
        ready = now >= self.ready_at.get(r, float("inf"))
        held = now < self.posted_at.get(r, 0.0) + self.deployment.send_done_after_s
        return tuple(e for e in super().candidates(r) if (ready or type(e) is not core.SendPage)
                     and not (held and type(e) is core.SendDone))

    def do_Compute(self, command, stamp) -> None:
        r = command.request
        if self.data is None:
            self.ready_at[r] = time.monotonic() + self.deployment.compute_s
        else:
            self.data.compute(r, self.payload[r], self.part.rows[r][core.SRC])

    def do_FreePages(self, command, stamp) -> None:
        if self.data is not None:
            self.data.stop(command.request)

    def do_Post(self, command, stamp) -> None:
        """The write: on the real data path posted over DistTransport (its bytes read when
        decode lands it), and announced to decode over the channel with the step's stamp
        and the source page's contents in the spec's terms (decode's share of LandWrite);
        on the modelled path the announcement is the write."""
        r, source, _, _ = command.write
        self.posted_at[r] = time.monotonic()
        if self.data is not None:
            self.data.post(command.write, self.placement[r][1])
        data = self.part.pool[source - self.part.base][1]
        self.send(Peer(DECODE, self.placement[r][1]), {
            "t": "write", "request": r, "write": list(command.write), "data": data,
            "stamp": stamp, "placement": list(self.placement[r])})

    def command(self, command: dict) -> None:
        """Fault injection, for tests only: {"do": "partition", "decode": d} cuts this
        prefill's connection to decode d's current epoch, as a one-link partition would (the
        decode learns it from the closed connection, this prefill from its own verdict).
        This prefill never dials a decode on its own and its channel refuses that epoch
        from then on, so the link stays cut; a new life of the decode is a new peer. With
        "lasting": true the partition outlasts the decode's restarts: no later life of it
        is reached when the launcher says to dial it (`dial`)."""
        if command.get("do") == "partition":
            self.channel.cut(Peer(DECODE, command["decode"]),
                             "fault injection: a partition between this prefill and it")
            if command.get("lasting"):  # every later life of that decode is out of reach
                self.partitioned.add(command["decode"])
            return
        super().command(command)

    def dial(self, port: int, host: str = "127.0.0.1", peer: Peer | None = None,
             epoch: int | None = None) -> bool:
        """A decode behind a lasting partition (the fault-injection hook) is not reached."""
        if peer is not None and peer.role == DECODE and peer.worker in self.partitioned:
            self.dial_failed(peer, epoch, "fault injection: a lasting partition between "
                             "this prefill and it", port=port, host=host)
            return False
        return super().dial(port, host, peer, epoch)

    def on_dial_failed(self, peer: Peer, epoch: int, why: str) -> None:
        """A decode's life this prefill was told to dial cannot be reached: the router hears
        it as that life down (it fences it: RouterProcess.on_down)."""
        if peer.role == DECODE:
            self.send(Peer(ROUTER, 0), {"t": "down", "decode": peer.worker, "epoch": epoch,
                                        "stamp": self.log.stamp()})

    def on_completed(self, peer: Peer, body: dict) -> None:
        self.log.heard_from(body["stamp"])
        self.part.completed(_tuples(body["write"]))

    def on_dial(self, peer: Peer, body: dict) -> None:
        """The router's word to dial a decode's new life (one that joined at a rendezvous:
        RouterProcess.dial_life)."""
        self.dial(body["port"], body["host"], Peer(DECODE, body["decode"]), body["epoch"])

    def on_peer_up(self, peer: Peer, epoch: int) -> None:
        """A decode connected (this prefill dialled it), or the router did: the router hears
        of every link to a decode's life (`up`, with its epoch), once it is connected here
        (a new life of this prefill dials the decodes first). A restarted decode's new life
        is placed on only once every live prefill is linked to it (RouterProcess.back_up),
        and a barrier waits only for linked lives (RouterProcess.links)."""
        if peer.role == ROUTER:
            for decode, decode_epoch in sorted(self.channel.peers().items()):
                if decode.role == DECODE:
                    self.send(peer, {"t": "up", "decode": decode.worker, "epoch": decode_epoch})
        elif peer.role == DECODE and self.channel.epoch_of(Peer(ROUTER, 0)) is not None:
            self.send(Peer(ROUTER, 0), {"t": "up", "decode": peer.worker, "epoch": epoch})

    def on_peer_down(self, peer: Peer, epoch: int) -> None:
        if peer.role == DECODE:
            if epoch > self.crash_recorded.get(peer.worker, 0):  # (not a life already ended)
                self.dead_decodes[peer.worker] = max(epoch, self.dead_decodes.get(peer.worker, 0))
            self.send(Peer(ROUTER, 0), {"t": "down", "decode": peer.worker, "epoch": epoch,
                                        "stamp": self.log.stamp()})

    def on_crash(self, peer: Peer, body: dict) -> None:
        self.log.heard_from(body["stamp"])
        self.part.decode_crashed(body["requests"])
        d, epoch = body["decode"], body.get("epoch", self.dead_decodes.get(body["decode"], 0))
        self.crash_recorded[d] = max(epoch, self.crash_recorded.get(d, 0))
        if self.dead_decodes.get(d, 0) <= epoch:
            self.dead_decodes.pop(d, None)   # its requests may act on the notice
        for r in body["requests"]:
            self.placement[r] = (self.placement.get(r, (self.part.worker, 0))[0], NONE)

    def finish(self) -> dict:
        out = {"pages_held": sum(page[0] != NONE for page in self.part.pool),
               "sending": len(self.part.sending)}
        if self.data is not None:
            out["writes_lost"] = self.data.writes_lost
        return out


class DecodeProcess(Process):
    ROLE = DECODE

    def __init__(self, deployment: Deployment, worker: int = 0,
                 restart: dict | None = None) -> None:
        super().__init__(deployment, worker, restart)
        for stamp in (restart or {}).get("after", ()):
            self.log.heard_from(stamp)  # a new life: its steps follow its crash
        self.announced: dict[tuple, dict] = {}  # real path: write -> its announcement
        if deployment.model_dir:
            from engine.process_data import DecodeData
            self.data = DecodeData(deployment, worker, self.channel.wake)
        # A prefill's crash: what this decode sends it while it is down waits for its next
        # life (the spec's messages to a restarted prefill stay in flight), and the
        # requests its crash ended are timed out here once that life says so.
        self.held: dict[int, list] = {}
        self.lost: set[int] = set()
        self.streamed: dict[int, list] = {}  # real path: request -> the tokens it streamed
        # The steps of other parts whose messages reached this decode ([part, k]), in any
        # of its lives (a new life reads its earlier ones' from its log): a prefill's new
        # life sends again only a final word no life of this decode heard.
        self.heard: set[tuple] = set()
        if restart is not None:
            self.heard = {tuple(a) for x in logged_steps(log_path(deployment, self.part.name),
                                                         self.part.name)
                          for a in x.get("after", ())}

    def on_msg(self, peer: Peer, body: dict) -> None:
        self.heard.add(tuple(body["stamp"][:2]))
        super().on_msg(peer, body)

    def answer_riders(self, answers: list) -> dict:
        """On the real data path, the tokens each answered request streamed: the edge has
        them from the log if this process dies before they all leave."""
        tokens = {str(r): self.streamed[r] for r, _, _ in answers if r in self.streamed}
        return {"tokens": tokens} if tokens else {}

    def holds(self) -> set[int]:
        """Requests whose bootstrap came, until decode released them (or tombstoned)."""
        rows = self.part.rows
        return {r for r in self.placement
                if rows[r][core.DST] in (core.D_WAITING, core.DECODING, core.CLOSING)
                or rows[r][core.BOOT] and rows[r][core.DST] == core.D_NONE}

    def send(self, peer: Peer, body: dict) -> bool:
        if peer.role == PREFILL and peer.worker in self.held:
            self.held[peer.worker].append(body)
            return False
        return super().send(peer, body)

    def on_peer_down(self, peer: Peer, epoch: int) -> None:
        """A prefill is down: this decode lands none of its writes from now on (nothing of
        a dead epoch is taken), and tells the router after every landing it took."""
        if peer.role == PREFILL:
            self.held.setdefault(peer.worker, [])
            name = f"{PREFILL} {peer.worker}"
            self.send(Peer(ROUTER, 0), {"t": "pdown", "prefill": peer.worker,
                                        "stamp": self.log.stamp(),
                                        "heard": sorted(k for p, k in self.heard if p == name)})

    def on_prefill_back(self, peer: Peer, body: dict) -> None:
        """A prefill's new life took its crash (the router passes its notice on): the
        requests it ended (`lost`) are timed out here (the spec's decode learns of a
        prefill crash by its timer), and what was held for it goes now, after its crash."""
        self.log.heard_from(body["stamp"])
        self.lost.update(body["lost"])
        for held in self.held.pop(body["prefill"], []):
            super().send(Peer(PREFILL, body["prefill"]), held)

    def on_write(self, peer: Peer, body: dict) -> None:
        """A write's announcement. Modelled: it is the landing. Real: the landing comes when
        the transport has the write too (`work`)."""
        write = _tuples(body["write"])
        self.placement[write[0]] = tuple(body["placement"])
        if self.data is None:
            self.landed(write, body)
        else:
            self.announced[write] = body

    def landed(self, write: tuple, body: dict) -> None:
        """Decode's share of LandWrite, then the router sequences the environment's step."""
        self.part.land(write, body["data"])
        self.send(Peer(ROUTER, 0), {"t": "landed", "request": write[0], "write": list(write),
                                    "poster": body["stamp"], "stamp": self.log.stamp()})

    def work(self) -> bool:
        """Land what the transport and the announcements both have; the decode step that
        finished streams its tokens, and the next one begins."""
        if self.data is None:
            return False
        landed = self.data.land(self.announced)
        for write in landed:
            self.landed(write, self.announced.pop(write))
        stepped = self.data.step()
        for r, token, ended in stepped:
            self.stream(r, token, ended)
        # (a token is no news to the part: a sequence's end is, its Finish now possible)
        return bool(landed) or any(ended for _, _, ended in stepped)

    def stream(self, r: int, token: int | None, last: bool) -> None:
        """A token to the serving edge as it is made (before the answer: one connection,
        in order)."""
        self.streamed.setdefault(r, []).append(token)
        self.send(Peer(ROUTER, 0), {"t": "token", "request": r, "token": token, "last": last})

    def candidates(self, r: int) -> tuple:
        """Real path: Accept with the checksums' verdict over what landed, Finish once
        decoding ended, with the tags' verdict (both observed by DecodeData)."""
        offers = super().candidates(r)
        if r in self.lost:
            offers += (core.Timeout(r),)
        if self.data is None:
            return offers
        out = []
        for event in offers:
            if type(event) is core.Accept:
                announced = self.part.rows[r][core.FW_COUNT]
                out.append(core.Accept(r, self.data.transfer_ok(r, announced)))
            elif type(event) is core.Finish:
                if r in self.data.done:
                    out.append(core.Finish(r, self.data.done[r]))
            else:
                out.append(event)
        return tuple(out)

    def do_StartDecoding(self, command, stamp) -> None:
        r = command.request
        if self.data is not None:
            ended = self.data.start(r, self.payload[r], self.part.rows[r][core.TABLE],
                                    self.first[r])
            self.stream(r, self.first[r], ended)

    def do_StopDecoding(self, command, stamp) -> None:
        if self.data is not None:
            self.data.stop(command.request)

    def do_FreePages(self, command, stamp) -> None:
        if self.data is not None:
            self.data.stop(command.request)
            self.data.done.pop(command.request, None)
            self.streamed.pop(command.request, None)

    def finish(self) -> dict:
        out = {"pages_held": sum(page[0] != NONE for page in self.part.pool)}
        if self.data is not None:
            out["bytes_landed"] = self.data.bytes_landed
        return out


KINDS = {ROUTER: RouterProcess, PREFILL: PrefillProcess, DECODE: DecodeProcess}


# -- the process's main loop -----------------------------------------------------------------

def report(**fields) -> None:
    """One report, a JSON object a line on stdout, written whole in one call: print writes
    the text and its newline apart, which an unbuffered stdout (PYTHONUNBUFFERED) turns into
    two writes, and another writer on the same pipe (a worker's stderr, merged by whoever
    started it) could land between them."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def cpu_s() -> float:
    """This process's CPU seconds so far, user and system, every thread."""
    times = os.times()
    return times.user + times.system


def stdin_commands() -> queue.Queue:
    """stdin's commands (a JSON object a line), read on a thread; an "exit" when stdin
    closes (whoever started the process has gone)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(json.loads(line))
        lines.put({"do": "exit"})
    threading.Thread(target=read, daemon=True).start()
    return lines


def _pump(process: Process, timeout_s: float) -> bool:
    """One channel event handled; whether there was one. A stopped process has ended its
    log and handles nothing more (its peers closing as they exit is no crash)."""
    event = process.channel.receive(timeout_s)
    if process.stopped:
        return event is not None
    if type(event) is Delivered:
        process.on_envelope(event.peer, event.message.fields["body"])
    elif type(event) is PeerDown:
        report(ev="peer_down", peer=str(event.peer), reason=event.reason, at_s=time.time())
        if event.peer.role == ROUTER and process.router_ended:
            process.router_gone = True
        process.on_peer_down(event.peer, event.epoch)
    elif type(event) is PeerUp:
        process.on_peer_up(event.peer, event.epoch)
    return event is not None


def capacity_refusal(deployment: Deployment, role: str, worker: int) -> str | None:
    """The startup capacity check, a worker's own: its pool must hold the advertised
    context (unless the zoo's PoolBelowContext switch is on); why not, naming it."""
    if role == ROUTER or not deployment.context_tokens or "PoolBelowContext" in deployment.bugs:
        return None
    pages = deployment.prefill_pages if role == PREFILL else deployment.decode_pages
    pool_tokens = pages * deployment.page_tokens
    if pool_tokens >= deployment.context_tokens:
        return None
    return (f"{role}-{worker}'s KV pool holds {pool_tokens} tokens, less than the advertised "
            f"context of {deployment.context_tokens} tokens; it refuses to join")


def _commands(todo: queue.Queue, process: Process) -> str | None:
    """Every command waiting on stdin: serving's to the process, the last stop or exit
    returned."""
    last = None
    while True:
        try:
            command = todo.get_nowait()
        except queue.Empty:
            return last
        if command["do"] in ("stop", "exit"):
            last = "exit" if "exit" in (last, command["do"]) else "stop"
        else:
            process.command(command)


def main(setup: dict, on_listening=None, stdin: bool = True) -> int:
    """One process of a deployment: `python -m engine.processes SETUP.json` (the
    Deployment's fields, its role and worker, and the ports it dials). Reports JSON lines on stdout
    ("listening", the router's "done", "stopped"); takes {"do": "stop"} (finish the work
    at hand, end the log, report) and {"do": "exit"} on stdin; exits when stdin closes."""
    role, worker, ports = setup.pop("role"), setup.pop("worker"), setup.pop("ports")
    restart = setup.pop("restart", None)  # a restarted process's (Launched.restart)
    host = setup.pop("host", "127.0.0.1")  # where it listens (`kvproof worker --host`)
    # Its launcher stops it (stdin's "stop" and "exit", or stdin closing) or kills it; a
    # Ctrl-C in the launcher's terminal reaches the whole process group, and the launcher
    # (kvproof serve --processes) then drains before it stops its processes. A SIGTERM sent
    # to a worker alone (an operator scaling down) drains that worker (Process.drain).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    drain_asked = threading.Event()
    if role != ROUTER:
        signal.signal(signal.SIGTERM, lambda *_: drain_asked.set())
    deployment = Deployment(**setup)
    refusal = capacity_refusal(deployment, role, worker)
    if refusal is not None:
        report(ev="refused", reason=refusal)
        return 1
    process = (KINDS[role](deployment, worker, restart) if restart
               else KINDS[role](deployment, worker))
    if process.life_hook(process.part.name)(deployment.die_at_start):
        os._exit(3)  # fault injection (tests): this life dies before it listens
    # A worker started on its own (`kvproof worker`) takes no command on stdin: it ends with
    # its router, or drains on SIGTERM.
    todo = stdin_commands() if stdin else queue.Queue()
    for port in ports:  # prefills dial the decodes; the router dials every worker
        if isinstance(port, list):  # [host, port]: a worker that joined at a rendezvous
            process.dial(port[1], port[0])
        else:
            process.dial(port)
    port = process.channel.listen(host)
    if on_listening is not None:
        on_listening(port)
    report(ev="listening", port=port)
    if process.data is not None:
        process.join_data_path()
        report(ev="joined")
    process.cpu_from_s = cpu_s()  # (the model's loading and the joins not counted)
    try:
        drained = _loop(process, todo, drain_asked)
    except Fenced:
        drained = "fenced"
    if drained == "fenced":  # it writes nothing more: its supervisor closes its log
        report(ev="fenced", reason="lost its router without the router's bye")
    process.channel.close()
    if process.data is not None:
        process.data.close()
    return {"cut": 1, "fenced": 3}.get(drained, 0)


def _loop(process: Process, todo: queue.Queue, drain_asked: threading.Event) -> str:
    """The process's loop, until it exits: "cut" (a drain ran out), "fenced", or "". Its
    channel beats while it turns (`Process.loop_alive`)."""
    try:
        return _turns(process, todo, drain_asked)
    finally:
        process.loop_at = None  # (ended: no more watched, whatever the channel does now)


def _turns(process: Process, todo: queue.Queue, drain_asked: threading.Event) -> str:
    deployment, role = process.deployment, process.role
    stopping, last_busy, settled_at = None, time.monotonic(), 0.0
    pool, pool_at = None, 0.0
    drained = ""
    while True:
        process.loop_at = time.monotonic()
        if process.self_fenced.is_set():
            return "fenced"
        command = _commands(todo, process)
        if command == "exit":
            break
        if command == "stop" and stopping is None:
            stopping = time.monotonic()
        pumped = _pump(process, 0.0 if process.busy() else POLL_S)
        if pumped:
            last_busy = time.monotonic()
            for _ in range(EVENTS_PER_TURN_MAX - 1):
                if not _pump(process, 0.0):
                    break
        if stopping is None and role == ROUTER:
            process.tick()
        if not process.stopped:
            if pumped:  # what the messages allow goes out before the data path's work
                settled_at = time.monotonic()
                process.settle()
            progressed = process.work()
            if progressed or process.computing():
                last_busy = time.monotonic()
            # (not on every poll while a step runs: a settle offers every row its actions)
            if progressed or process.settle_due(settled_at):
                settled_at = time.monotonic()
                process.settle()
        if role == ROUTER and deployment.serving_requests_max and not process.stopped:
            process.answers()
        if role != ROUTER and time.monotonic() - pool_at >= deployment.pool_report_s:
            pool_at = time.monotonic()
            if process.pool_report() != pool:
                pool = process.pool_report()
                report(ev="pool", at_s=time.time(), **pool)
        if process.router_gone and role != ROUTER:
            drain_asked.set()  # a worker that joined at a rendezvous ends with its router
        if drain_asked.is_set() and stopping is None and not process.stopped:
            drained = process.drain()
            if drained:
                break  # drained and left, or the bound passed (a crash's path ends the rest)
        if role == ROUTER and not process.reported and process.done():
            process.reported = True
            report(ev="done", outcomes=process.outcomes(), refused=process.refused,
                   placement=[process.placement.get(r) for r in range(len(deployment.prompts))],
                   tokens=[process.tokens.get(r) for r in range(len(deployment.prompts))],
                   timings=process.timings(), span_s=process.span_s())
        now = time.monotonic()
        if stopping is not None and not process.stopped and (
                now - last_busy > QUIET_S or now - stopping > deployment.settle_s_max):
            process.end()
    return drained


# -- the launcher: every process of a deployment, started and stopped -------------------------

class WorkerRefused(RuntimeError):
    """A worker refused to join (the startup capacity check); its reason names it."""


class Child:
    """One process of the deployment and its reports."""

    def __init__(self, name: str, setup: dict, stderr_path: Path, on_report=None) -> None:
        root = Path(__file__).resolve().parents[1]
        self.name = name
        self.epoch = setup["restart"]["epoch"] if "restart" in setup else 1  # its life
        # Serving: each report goes to on_report first; one it takes (returns True) is
        # neither kept nor queued, so a long-lived process's reports do not pile up.
        self.on_report = on_report
        self.stderr = open(stderr_path, "w")
        # The setup goes by file: a workload's prompts outgrow one argument (128 KiB).
        setup_path = stderr_path.with_suffix(".setup.json")
        setup_path.write_text(json.dumps(setup))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.processes", str(setup_path)], cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)}, text=True, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr)
        self.reports: queue.Queue = queue.Queue()
        self.seen: list[dict] = []   # every report, in order (expect() skips some)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            got = json.loads(line)
            if self.on_report is not None and self.on_report(self.name, got):
                continue
            self.seen.append(got)
            self.reports.put(got)

    def expect(self, ev: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                got = self.reports.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                if not self.reader.is_alive() and self.reports.empty():
                    raise ProcessLookupError(  # it exited: waiting on would change nothing
                        f"{self.name}: exited with code {self.process.wait()} before "
                        f"{ev!r} (its stderr: {self.stderr.name})") from None
                continue
            if got["ev"] == ev:
                return got
            if got["ev"] == "refused":
                raise WorkerRefused(f"{self.name}: {got['reason']}")
        raise TimeoutError(f"{self.name}: no {ev!r} within {timeout_s} s (exit code "
                           f"{self.process.poll()})")

    def tell(self, do: str, **fields) -> None:
        try:
            self.process.stdin.write(json.dumps({"do": do, **fields}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it is dead already: the caller learns from its exit code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.stderr.close()


@dataclass
class Launched:
    """A running deployment: start() every process, wait for the router's "done", stop()
    them (each ends its log), kill() one, close() whatever is left (always call it)."""

    deployment: Deployment
    children: dict = field(default_factory=dict)
    on_report: object = None   # serving: every child's reports go here first (Child)
    ports: dict = field(default_factory=dict)     # name -> the port its channel listens on
    previous: list = field(default_factory=list)  # children a restart replaced
    closed: bool = False
    lock: object = field(default_factory=threading.Lock)  # a restart against close()
    # Workers that joined at the deployment's rendezvous (`kvproof worker`): name -> the
    # address each published (host, port, pid, epoch); they are not this launcher's children.
    external: dict = field(default_factory=dict)
    rendezvous: object = None

    def _spawn(self, role: str, worker: int, ports: list, timeout_s: float,
               restart: dict | None = None) -> int:
        name = role if role == ROUTER else f"{role} {worker}"
        deployment = self.deployment if restart is None else self.deployment.next_life()
        setup = {**asdict(deployment), "role": role, "worker": worker, "ports": ports}
        stderr = log_path(self.deployment, name).with_suffix(".stderr")
        if restart is not None:
            setup["restart"] = restart
            stderr = stderr.with_suffix(f".{restart['epoch']}.stderr")
        child = Child(name, setup, stderr,
                      self._router_report if role == ROUTER else self.on_report)
        if name in self.children:
            self.previous.append(self.children[name])
        self.children[name] = child
        self.ports[name] = child.expect("listening", timeout_s)["port"]
        return self.ports[name]

    def worker_names(self) -> list[str]:
        d = self.deployment
        return ([f"{DECODE} {k}" for k in range(d.decode_workers)]
                + [f"{PREFILL} {k}" for k in range(d.prefill_workers)])

    def _start_external(self, timeout_s: float) -> None:
        """Host the rendezvous, publish the deployment, wait for every worker to join
        (`kvproof worker`; a refusal ends the wait with its reason), then start the router,
        which dials them (engine/rendezvous.py)."""
        from engine.rendezvous import Rendezvous, RendezvousRefused, model_fingerprint

        d = self.deployment
        self.rendezvous = Rendezvous(d.rendezvous, hosting=True, timeout_s=d.join_timeout_s)
        self.rendezvous.put("deployment", {
            "setup": asdict(d),
            "model": model_fingerprint(d.model_dir) if d.model_dir else None})
        names = self.worker_names()
        try:
            got = self.rendezvous.wait([f"addr/{n}" for n in names],
                                       [f"refused/{n}" for n in names], what="the workers")
        except RendezvousRefused as refusal:
            raise WorkerRefused(str(refusal)) from None
        self.external = {n: got[f"addr/{n}"] for n in names}
        self._spawn(ROUTER, 0, [[a["host"], a["port"]] for a in self.external.values()],
                    timeout_s)

    def _router_report(self, name: str, got: dict) -> bool:
        """The router's reports: a "restart" is this supervisor's to carry out (on a
        thread of its own: the reader goes on), and is kept like any other."""
        if got.get("ev") == "restart":
            threading.Thread(target=self.restart, args=(got,), daemon=True).start()
        elif got.get("ev") == "fence":
            threading.Thread(target=self.fence, args=(got,), daemon=True).start()
        return self.on_report is not None and self.on_report(name, got)

    def fence(self, got: dict) -> None:
        """The router cut a worker's life off (RouterProcess.fence): kill that life (the
        epoch the fence names: a fence answered late never kills a newer life), so that
        nothing it would do later can count, and tell the router once it is dead (the kill
        waits for its exit); only then does the router touch its log. A worker that joined
        at a rendezvous is not this launcher's: it fences itself, and the router waits."""
        name = f"{got['role']} {got['worker']}"
        if name in self.external:
            return
        with self.lock:
            if self.closed:
                return
            for child in self.lives(name, got["epoch"]):
                child.kill()
        self.children[ROUTER].tell("fenced", role=got["role"], worker=got["worker"],
                                   epoch=got["epoch"])

    def lives(self, name: str, epoch: int) -> list[Child]:
        """The process this launcher started for that worker's life (none: it never
        started, or not here)."""
        return [child for child in [*self.previous, self.children.get(name)]
                if child is not None and child.name == name and child.epoch == epoch]

    def restart(self, got: dict, timeout_s: float = 10.0) -> None:
        """Start a dead worker's next life (RouterProcess.record_prefill_crash says what
        it needs), dialling every live decode, and tell the router its port. The old
        process is killed first (fenced: one declared down for silence, a partition or a
        SIGSTOP, may still be there and would write on in its log), then its log's torn
        line is cut, and the new life goes on with it."""
        role, worker = got["role"], got["worker"]
        name = f"{role} {worker}"
        if name in self.external:
            self._restart_external(name, got["restart"])
            return
        with self.lock:  # (a deployment being closed starts no new life)
            if self.closed:
                return
            self.children[name].kill()
            steps, clock = cut_dead_log(log_path(self.deployment, name), name)
            live = {n: child for n, child in sorted(self.children.items())
                    if child.process.poll() is None}
            # Prefills dial decodes; the router dials every worker.
            decodes = [self.ports[n] for n in live if n.startswith(DECODE)] \
                if role == PREFILL else []
            try:
                port = self._spawn(role, worker, decodes, timeout_s,
                                   {**got["restart"], "steps": steps, "clock": clock})
            except (ProcessLookupError, TimeoutError) as error:
                self.children[ROUTER].tell("life_failed", role=role, worker=worker,
                                           epoch=got["restart"]["epoch"], reason=str(error))
                return
        for n, child in live.items():
            if n == ROUTER or (role == DECODE and n.startswith(PREFILL)):
                child.tell("dial", port=port, role=role, worker=worker,
                           epoch=got["restart"]["epoch"])

    def start(self, timeout_s: float = 10.0) -> None:
        d = self.deployment
        if d.rendezvous:
            self._start_external(timeout_s)
            return
        if d.model_dir:
            from engine.process_data import rendezvous_path
            Path(rendezvous_path(d)).unlink(missing_ok=True)
        decodes = [self._spawn(DECODE, k, [], timeout_s) for k in range(d.decode_workers)]
        prefills = [self._spawn(PREFILL, k, decodes, timeout_s)
                    for k in range(d.prefill_workers)]
        if d.model_dir:  # the real data path: every transport up before the first request
            for child in list(self.children.values()):
                child.expect("joined", d.join_timeout_s)
        self._spawn(ROUTER, 0, prefills + decodes, timeout_s)

    def wait_done(self, timeout_s: float) -> dict:
        """The router's "done": every client's answer and every request's placement."""
        return self.children[ROUTER].expect("done", timeout_s)

    def kill(self, name: str) -> None:
        self.children[name].kill()

    def stop(self, timeout_s: float = 10.0) -> dict[str, dict]:
        """Every live process finishes, ends its log and reports; then each exits. Returns
        the reports and each process's exit code."""
        live = {name: c for name, c in self.children.items() if c.process.poll() is None}
        for child in live.values():
            child.tell("stop")
        reports = {name: child.expect("stopped", timeout_s) for name, child in live.items()}
        for child in live.values():
            child.tell("exit")
        for name, child in live.items():
            reports[name]["exit_code"] = child.process.wait(timeout=timeout_s)
        return reports

    def _restart_external(self, name: str, restart: dict) -> None:
        """A worker that joined at the rendezvous died: its next life is its machine's to
        start (`kvproof worker` again for its rank, which finds this record and goes on
        with its log); once its address in the new epoch is there, the router dials it
        and, for a decode, passes it on to every prefill (RouterProcess.dial_life)."""
        self.rendezvous.put(f"restart/{name}", restart)
        print(f"kvproof: {name} died; start `kvproof worker` again for its rank to have "
              f"it rejoin in epoch {restart['epoch']}", file=sys.stderr, flush=True)
        while not self.closed:
            address = self.rendezvous.get(f"addr/{name}")
            if address is not None and address["epoch"] == restart["epoch"]:
                break
            time.sleep(0.05)
        else:
            return
        self.external[name] = address
        role, _, worker = name.partition(" ")
        self.children[ROUTER].tell("dial", port=address["port"], host=address["host"],
                                   role=role, worker=int(worker), epoch=restart["epoch"])

    def close(self) -> None:
        with self.lock:
            self.closed = True
            children = [*self.previous, *self.children.values()]
        for child in children:
            child.kill()


if __name__ == "__main__":
    code = main(json.loads(Path(sys.argv[1]).read_text()))
    sys.stdout.flush()
    # Not sys.exit: tearing a gloo world down waits on peers that may have exited first.
    os._exit(code)
