"""Protocol messages between processes, and the failure detector (issue 29's side channel).

Theory of operation
-------------------
Page writes cross processes through engine/dist_transport.py. Everything else the protocol
says between its workers — the bootstrap (router -> decode), the page table (decode ->
prefill), the final word with its count (prefill -> decode), the cancel (decode ->
prefill), the serving edge's client-gone notice — goes through this channel, together with
the failure detector the spec relies on for a decode crash's notice (spec/KVTransfer.tla
`CrashNotice`; the bug switch NoFailureDetector is the protocol without it).

One `Channel` per process. It may listen on 127.0.0.1 (port from the OS) and dial other
channels; each connection is one TCP socket between two *peer epochs*: a worker's identity
(role, worker index) and the epoch of the process that runs it (a restarted process takes a
larger epoch, as the spec's restarted decode does). A connection starts with a handshake
(HELLO from the dialer, WELCOME or REFUSED from the listener); after it every frame carries
its sender's identity and epoch, checked against the connection's.

Framing: a 4-byte big-endian length, then that many bytes of one JSON object (the records
of spec/codec.py are flat JSON objects too; a protocol message here is not an event, so the
codec's event records do not fit it, but the message names are the spec's own: core.BOOTSTRAP,
commands.PAGE_TABLE, core.FINAL_WORD_MSG, core.CANCEL_MSG, core.CLIENT_GONE). A frame over
`frame_bytes_max`, bytes that are not a JSON object, a frame of the wrong kind or sender, or a
message whose fields are wrong is the peer's error (FrameError): that connection is dropped
with the reason logged, counted, and the peer declared down; the channel goes on serving the
others. Our own misuse (an unknown message, a message too large to send) raises ValueError.

Ordering and loss. TCP gives FIFO per connection (each message frame carries a sequence
number, checked: a gap is a FrameError), and loses nothing while the connection lives.
A connection that breaks — the peer closed it, died (the kernel closes its sockets), or a
send or a read failed — loses what was in flight, and both ends learn it: each end's reader
sees the break, or its heartbeat bound lapses. There is no other loss: nothing is dropped
silently except what the epoch rules below drop, and those are counted. Between different
connections (different peers) there is no order.

Failure detector. Every `heartbeat_s` the channel sends a heartbeat on every connection;
each connection's reader waits at most `suspect_after_s` for its next byte. A peer is
declared down when nothing arrived within `suspect_after_s` (a partition, or a hung or
stopped process: it stops answering without closing), when its connection broke, when a
send to it blocked `suspect_after_s` or failed, or when the process's inbox stayed full for
`suspect_after_s`. Declaring down closes the connection (so the peer learns too), and is
reported exactly once per peer epoch: a `PeerDown` event in the inbox (after every message
that connection delivered) and the `on_down` callback. The runtime turns it into the
protocol's crash notice.

Epoch rules (the spec's rules for crashes, NoEpochCheck):
  - A peer epoch declared down is dead here for good: a HELLO in that epoch is REFUSED, and
    the refused process must rejoin in a new epoch (for the protocol: restart empty, as a
    crash does). So a SIGSTOPped process that wakes after it was declared down is not taken
    back: its connection was closed, and its redial in the old epoch is refused.
  - A HELLO of an epoch older than the one known for that peer is refused (a late process).
  - A HELLO of a newer epoch is a new peer: the old epoch's connection, if still open, is
    declared down (superseded), and messages of the old epoch not yet taken from the inbox
    are dropped and counted (`stale_dropped`): nothing of an old epoch is accepted once a
    newer one is known.
  - Every message names the receiver's epoch it was meant for (`to_epoch`, stamped by the
    sender's runtime when it made the message): a message meant for a previous incarnation
    of the receiver is dropped by the sender when that epoch is no longer up, and by the
    receiver if it arrives anyway (`misaddressed_dropped`): the spec's NoEpochCheck is a
    restarted decode that takes a late bootstrap of its old epoch as new.
  The bug switch NoEpochCheck (`ChannelConfig(bugs=...)`, for tests) disables the message
  checks on the receiving side, so the tests show they are what drops those messages.

Threads: one accepting connections, one reader per connection, one ticker (heartbeats);
`send` runs on the caller's thread, under the connection's send lock. Every wait has a
bound: `connect_timeout_s` for a handshake, `suspect_after_s` for reads, sends and a full
inbox, the caller's timeout for `receive`.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from spec import core
from spec.commands import PAGE_TABLE
from spec.roles import DECODE, PREFILL, ROUTER

log = logging.getLogger(__name__)

WIRE_VERSION = 1
HOST = "127.0.0.1"
LENGTH = struct.Struct(">I")
ROLES = (ROUTER, PREFILL, DECODE)
BUGS = frozenset({"NoEpochCheck"})
HELLO, WELCOME, REFUSED, BEAT, MSG = "hello", "welcome", "refused", "beat", "msg"
FINAL_WORDS = core.MESSAGE_NAMES[1:]  # Done, Reject, Abort: the final word a prefill sends
ENVELOPE = "envelope"

# The protocol's messages, by the spec's name for each, and their fields besides `request`.
# A kind of value: "count" (an int >= 0), "word" (a final word's name), "pages" (a list of
# ints >= 0, tags included: a page table's tags and its pages are parallel lists).
MESSAGE_FIELDS = {
    core.BOOTSTRAP: {"prompt_pages": "count"},
    PAGE_TABLE: {"pages": "pages", "tags": "pages"},
    core.FINAL_WORD_MSG: {"word": "word", "count": "count"},
    core.CANCEL_MSG: {},
    core.CLIENT_GONE: {},
    # engine/processes.py's envelope: a part's message (spec/parts.py Message) with the
    # sender's log stamp, a modelled page write and its landing and completion, a crash's
    # record. Its body is one JSON object, checked by the receiving process's
    # `body_problem` (engine/processes.py `envelope_problem`) on the reader's thread: a bad
    # body is a bad frame like any other.
    ENVELOPE: {"body": "object"},
}


class ChannelError(Exception):
    """The channel could not do what was asked (a handshake that failed or was refused)."""


class PeerRefused(ChannelError):
    """The other channel refused our handshake; the reason says why (an epoch it declared
    down: this process must rejoin in a new epoch)."""


class FrameError(ChannelError):
    """A peer sent a frame we cannot take (its error, not ours): its connection is dropped."""


class _PeerClosed(ConnectionError):
    """The peer closed the connection (end of stream)."""


class _InboxFull(Exception):
    """This process did not take its messages for suspect_after_s."""


@dataclass(frozen=True, order=True)
class Peer:
    """A worker's identity: its role and its index among the workers of that role."""

    role: str
    worker: int

    def __str__(self) -> str:
        return f"{self.role} {self.worker}"


@dataclass(frozen=True)
class Message:
    """One protocol message of one request: its spec name (`kind`) and its fields."""

    kind: str
    request: int
    fields: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        problem = message_problem(self.kind, {"request": self.request, **self.fields})
        if problem:
            raise ValueError(f"not a protocol message: {problem}")


@dataclass(frozen=True)
class Delivered:
    """A message from `peer` in `epoch`; `seq` is its place on its connection (1, 2, ...)."""

    peer: Peer
    epoch: int
    message: Message
    seq: int


@dataclass(frozen=True)
class PeerUp:
    """A peer epoch's connection is established: messages to it may be sent."""

    peer: Peer
    epoch: int


@dataclass(frozen=True)
class PeerDown:
    """A peer epoch is declared down (once): what was in flight to or from it is lost."""

    peer: Peer
    epoch: int
    reason: str


@dataclass
class ChannelCounts:
    """What the channel dropped or refused, and why; none of it is silent."""

    delivered: int = 0
    stale_dropped: int = 0         # from a peer epoch older than the one known
    misaddressed_dropped: int = 0  # meant for an epoch of this process that is not this one
    unsent: int = 0                # send() to a peer epoch that is not up: not sent
    frames_refused: int = 0        # garbage, oversized or out of order: connection dropped
    hellos_refused: int = 0        # a handshake refused by the epoch rules or a limit
    peers_down: int = 0


@dataclass(frozen=True)
class ChannelConfig:
    """This process's identity and epoch, and the channel's bounds (all in the names' units)."""

    role: str
    worker: int
    epoch: int
    heartbeat_s: float = 0.25
    suspect_after_s: float = 2.0
    connect_timeout_s: float = 2.0
    frame_bytes_max: int = 64 * 1024
    inbox_messages_max: int = 4096
    connections_max: int = 64
    bugs: frozenset = frozenset()

    def __post_init__(self) -> None:
        """A bad bound is a clear ValueError (they will come from flags), never an assert
        that `python -O` would drop."""
        problems = [
            (self.role not in ROLES, f"role must be one of {ROLES}, not {self.role!r}"),
            (type(self.worker) is not int or self.worker < 0,
             f"worker must be an index >= 0, not {self.worker!r}"),
            (type(self.epoch) is not int or self.epoch < 1,
             f"epochs start at 1, not {self.epoch!r}"),
            (not self.heartbeat_s > 0, f"heartbeat_s must be > 0, not {self.heartbeat_s!r}"),
            (not self.suspect_after_s >= 3 * self.heartbeat_s,
             "suspect_after_s must cover at least three heartbeats, so that one late "
             "heartbeat never declares a live peer down"),
            (not self.connect_timeout_s > 0,
             f"connect_timeout_s must be > 0, not {self.connect_timeout_s!r}"),
            (self.frame_bytes_max < 256,
             f"frame_bytes_max must be >= 256, not {self.frame_bytes_max!r}"),
            (self.inbox_messages_max < 1 or self.connections_max < 1,
             "inbox_messages_max and connections_max must be >= 1"),
            (not self.bugs <= BUGS, f"unknown channel bug switches {set(self.bugs) - BUGS}"),
        ]
        for bad, why in problems:
            if bad:
                raise ValueError(why)

    @property
    def identity(self) -> Peer:
        return Peer(self.role, self.worker)


# ---------------------------------------------------------------------------------------
# Messages and frames: pure functions, used by both ends (and by the tests' forger).

def message_problem(kind, record: dict) -> str:
    """What is wrong with a message of `kind` with these fields ("" when nothing is)."""
    if kind not in MESSAGE_FIELDS:
        return f"unknown message {kind!r} (the protocol's are {sorted(MESSAGE_FIELDS)})"
    want = {"request": "count", **MESSAGE_FIELDS[kind]}
    if set(record) != set(want):
        return f"a {kind} has the fields {sorted(want)}, got {sorted(record)}"
    for name, value_kind in want.items():
        problem = _value_problem(value_kind, record[name])
        if problem:
            return f"{kind}.{name} {problem}"
    return ""


def _value_problem(value_kind: str, value) -> str:
    if value_kind == "count":
        return "" if _is_count(value) else f"must be an integer >= 0, got {value!r}"
    if value_kind == "object":
        return "" if isinstance(value, dict) else f"must be a JSON object, got {_short(value)}"
    if value_kind == "word":
        return "" if value in FINAL_WORDS else f"must be one of {FINAL_WORDS}, got {value!r}"
    ok = isinstance(value, (list, tuple)) and all(_is_count(v) for v in value)
    return "" if ok else f"must be a list of integers >= 0, got {value!r}"


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def message_record(message: Message) -> dict:
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in message.fields.items()}
    return {"m": message.kind, "request": message.request, **fields}


def message_from(record) -> Message:
    """The message a received record stands for; FrameError naming what is wrong."""
    if not isinstance(record, dict) or "m" not in record:
        raise FrameError(f"not a message record: {_short(record)}")
    body = {k: v for k, v in record.items() if k != "m"}
    problem = message_problem(record["m"], body)
    if problem:
        raise FrameError(problem)
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in body.items()
              if k != "request"}
    return Message(record["m"], body["request"], fields)


def encode_frame(record: dict, frame_bytes_max: int) -> bytes:
    """One frame: length, then the record as compact JSON. A record over the limit is our
    own error (a message the peer would refuse): ValueError before anything is sent."""
    body = json.dumps(record, separators=(",", ":")).encode("utf-8")
    if len(body) > frame_bytes_max:
        raise ValueError(f"a {record.get('k')} frame of {len(body)} bytes is over "
                         f"frame_bytes_max ({frame_bytes_max})")
    return LENGTH.pack(len(body)) + body


def parse_record(body: bytes) -> dict:
    """A frame's body as a record; FrameError when it is not one JSON object of a kind."""
    try:
        record = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FrameError(f"not a JSON frame ({error}): {_short(body)}") from None
    if not isinstance(record, dict) or record.get("k") not in (HELLO, WELCOME, REFUSED,
                                                               BEAT, MSG):
        raise FrameError(f"not a channel frame: {_short(record)}")
    return record


def identity_of(record: dict) -> tuple[Peer, int]:
    """The sender (identity, epoch) a frame names; FrameError when it names none."""
    sender = record.get("from")
    ok = (isinstance(sender, list) and len(sender) == 3 and sender[0] in ROLES
          and _is_count(sender[1]) and _is_count(sender[2]) and sender[2] >= 1)
    if not ok:
        raise FrameError(f"a {record.get('k')} frame without a valid sender "
                         f"[role, worker, epoch]: {_short(sender)}")
    return Peer(sender[0], sender[1]), sender[2]


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class _FrameReader:
    """Frames off one socket; the length is checked before the body is read, and a frame
    must be whole within `frame_s_max` of its first byte (the socket's timeout bounds only
    the silence between bytes: a peer trickling one byte at a time would never time out)."""

    def __init__(self, sock: socket.socket, frame_bytes_max: int, frame_s_max: float):
        self.sock, self.limit, self.buffer = sock, frame_bytes_max, bytearray()
        self.frame_s_max = frame_s_max
        self.started: float | None = None  # when the frame being read began to arrive

    def next_record(self) -> dict:
        self.started = time.monotonic() if self.buffer else None
        (size,) = LENGTH.unpack(self._take(LENGTH.size))
        if size > self.limit:
            raise FrameError(f"a frame of {size} bytes is over frame_bytes_max ({self.limit})")
        return parse_record(self._take(size))

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buffer)))
            if not chunk:
                raise _PeerClosed("the peer closed the connection")
            self.started = self.started or time.monotonic()
            self.buffer += chunk
            if len(self.buffer) < n and time.monotonic() - self.started > self.frame_s_max:
                raise FrameError(f"a frame not whole {self.frame_s_max} s after its first "
                                 "byte: the peer trickles it")
        out = bytes(self.buffer[:n])
        del self.buffer[:n]
        return out


class _Link:
    """One connection to one peer epoch, after its handshake."""

    def __init__(self, sock: socket.socket, reader: _FrameReader, peer: Peer, epoch: int):
        self.sock, self.reader, self.peer, self.epoch = sock, reader, peer, epoch
        self.send_lock = threading.Lock()
        self.seq_out = 0
        self.seq_in = 0
        self.down = False


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already broken: closing it is all that is left
    sock.close()


# ---------------------------------------------------------------------------------------
# The channel.

Event = Delivered | PeerUp | PeerDown


def _always() -> bool:
    return True


class Channel:
    """One process's end of the protocol's message channel, and its failure detector.

    `listen()` takes a port from the OS on 127.0.0.1; `connect(port)` dials a listening
    channel. `send(peer, message, to_epoch)` sends, `receive(timeout_s)` returns the next
    event (Delivered, PeerUp, PeerDown) or None. `on_down`, if given, is called once per
    peer epoch declared down, on the channel's thread that declared it (it must not block).
    `body_problem(peer, body)`, if given, says what is wrong with an envelope's body ("" when
    nothing is), on the reader's thread; a problem drops the connection as a bad frame does.
    `alive()`, settable, says whether the process this channel speaks for is working: the
    heartbeats go out only while it says so, so a process whose own loop hangs while this
    channel's threads run on falls silent and its peers declare it down, as they would a
    dead one (the detector watches the connection; this ties the connection to the loop).
    """

    def __init__(self, config: ChannelConfig, on_down=None, body_problem=None):
        self.config = config
        self.counts = ChannelCounts()
        self._on_down = on_down
        self._body_problem = body_problem
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)
        self._inbox: deque = deque()
        self._inbox_messages = 0
        self._woken = False  # `wake`: the next receive returns at once
        self._links: dict[Peer, _Link] = {}
        self._known_epoch: dict[Peer, int] = {}   # the newest epoch seen of each peer
        self._down_reason: dict[Peer, str] = {}   # set when that newest epoch is down
        self._pending = 0                          # connections in their handshake
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self.port: int | None = None
        self.alive = _always
        self._ticker = self._start(self._tick_loop, "ticker")

    def __repr__(self) -> str:
        return f"Channel({self.config.identity}, epoch {self.config.epoch})"

    # -- public ---------------------------------------------------------------------------

    def listen(self, host: str = HOST) -> int:
        """Listen on `host` (127.0.0.1 unless a worker on another machine is told its
        address: `kvproof worker --host`), on a port the OS picks; returns it."""
        assert self._listener is None, "listen() once per channel"
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._start(self._accept_loop, "accept")
        return self.port

    def connect(self, port: int, host: str = HOST) -> tuple[Peer, int]:
        """Dial a listening channel; returns its (identity, epoch). PeerRefused when it
        refuses this epoch, ChannelError when no handshake completed within
        connect_timeout_s."""
        try:
            sock = socket.create_connection((host, port), timeout=self.config.connect_timeout_s)
        except OSError as error:
            raise ChannelError(f"{self}: cannot connect to {host}:{port}: {error}") from None
        reader = _FrameReader(sock, self.config.frame_bytes_max, self.config.suspect_after_s)
        try:
            sock.sendall(encode_frame(self._stamped(HELLO, v=WIRE_VERSION),
                                      self.config.frame_bytes_max))
            record = reader.next_record()
        except (OSError, FrameError) as error:
            _close_socket(sock)
            raise ChannelError(f"{self}: no handshake with {host}:{port} within "
                               f"connect_timeout_s ({self.config.connect_timeout_s}): "
                               f"{error}") from None
        peer, epoch = self._welcomed(sock, record, f"{host}:{port}")
        self._register(sock, reader, peer, epoch)
        return peer, epoch

    def send(self, peer: Peer, message: Message, to_epoch: int) -> bool:
        """Send `message` to `peer`'s epoch `to_epoch` (the epoch the runtime made it for).
        False when that epoch is not up: nothing is sent (counted as unsent), and a
        PeerDown for it is, or will be, in the inbox. Sending to a peer this channel never
        heard of is our own error (ValueError)."""
        with self._lock:
            if peer not in self._known_epoch:
                raise ValueError(f"{self}: {peer} never connected: no epoch to send to")
            link = self._links.get(peer)
            if link is None or link.down or link.epoch != to_epoch:
                self.counts.unsent += 1
                return False
        return self._send_message(link, message)

    def receive(self, timeout_s: float) -> Event | None:
        """The next event, waiting at most `timeout_s`; None when none came. A message of a
        peer epoch older than the newest known is dropped here and counted."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while True:
                while self._inbox:
                    event = self._take_one()
                    if event is not None:
                        return event
                if self._woken:
                    self._woken = False
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._ready.wait(remaining)

    def wake(self) -> None:
        """The receive waiting now, or the next one, returns at once (None when no event
        came): the process has work of its own to take up, e.g. its model step, run on a
        thread of its own (engine/process_data.py), has finished. Any thread may call it."""
        with self._ready:
            self._woken = True
            self._ready.notify_all()

    def inbox_messages(self) -> int:
        """Messages received and not yet taken (stale ones included until taken)."""
        with self._lock:
            return self._inbox_messages

    def peers(self) -> dict[Peer, int]:
        """Every peer that is up now, with its epoch."""
        with self._lock:
            return {peer: link.epoch for peer, link in self._links.items()}

    def epoch_of(self, peer: Peer) -> int | None:
        """The epoch of `peer` that is up now, or None."""
        with self._lock:
            link = self._links.get(peer)
            return None if link is None else link.epoch

    def cut(self, peer: Peer, reason: str) -> bool:
        """Declare `peer`'s epoch that is up now down here, as the detector would: its
        connection closed (the peer learns it), PeerDown in the inbox, and the epoch refused
        from then on. A supervisor's fence, and a fault injection's partition. Whether one
        was up."""
        with self._lock:
            link = self._links.get(peer)
        if link is None:
            return False
        self._declare_down(link, reason)
        return True

    def close(self) -> None:
        """Stop: every connection is closed (the peers learn it), threads end."""
        self._stop.set()
        if self._listener is not None:
            _close_socket(self._listener)
        with self._lock:
            links = list(self._links.values())
        for link in links:
            self._declare_down(link, "this channel closed")
        self._ticker.join(timeout=self.config.suspect_after_s)

    # -- handshake ------------------------------------------------------------------------

    def _stamped(self, kind: str, **fields) -> dict:
        c = self.config
        return {"k": kind, "from": [c.role, c.worker, c.epoch], **fields}

    def _welcomed(self, sock: socket.socket, record: dict, where: str) -> tuple[Peer, int]:
        """The listener's answer to our HELLO, checked; the socket is closed on failure."""
        try:
            if record["k"] == REFUSED:
                raise PeerRefused(f"{self}: {where} refused the handshake: "
                                  f"{record.get('reason')}")
            if record["k"] != WELCOME:
                raise FrameError(f"expected the handshake's answer, got a {record['k']}")
            peer, epoch = identity_of(record)
            with self._lock:
                problem = self._admission_problem(peer, epoch)
            if problem:
                raise PeerRefused(f"{self}: refusing {where}: {problem}")
        except ChannelError:
            _close_socket(sock)
            raise
        return peer, epoch

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            with self._lock:
                crowded = self._pending >= self.config.connections_max
                self._pending += 0 if crowded else 1
            if crowded:
                log.warning("%s: refusing a connection: connections_max (%d) handshakes "
                            "pending", self, self.config.connections_max)
                _close_socket(sock)
                continue
            self._start(lambda s=sock: self._serve_incoming(s), "handshake")

    def _serve_incoming(self, sock: socket.socket) -> None:
        """A dialer's handshake, then its connection's reader (on this thread)."""
        try:
            admitted = self._handshake(sock)
        finally:
            with self._lock:
                self._pending -= 1
        if admitted is not None:
            self._serve(admitted)

    def _handshake(self, sock: socket.socket) -> _Link | None:
        sock.settimeout(self.config.connect_timeout_s)
        reader = _FrameReader(sock, self.config.frame_bytes_max, self.config.suspect_after_s)
        try:
            record = reader.next_record()
            if record["k"] != HELLO or record.get("v") != WIRE_VERSION:
                raise FrameError(f"expected a HELLO of wire version {WIRE_VERSION}, got "
                                 f"{_short(record)}")
            peer, epoch = identity_of(record)
        except (FrameError, OSError) as error:
            self._count_refused_frame(f"a connection before its handshake: {error}")
            _close_socket(sock)
            return None
        with self._lock:
            problem = self._admission_problem(peer, epoch)
            if problem:
                self.counts.hellos_refused += 1
        if problem:
            return self._refuse(sock, peer, epoch, problem)
        try:
            sock.sendall(encode_frame(self._stamped(WELCOME), self.config.frame_bytes_max))
        except OSError:
            _close_socket(sock)
            return None
        try:
            return self._register(sock, reader, peer, epoch, serve=False)
        except PeerRefused:
            return None  # another connection of the same peer won the race

    def _refuse(self, sock: socket.socket, peer: Peer, epoch: int, problem: str) -> None:
        log.warning("%s: refusing %s epoch %d: %s", self, peer, epoch, problem)
        try:
            sock.sendall(encode_frame({"k": REFUSED, "reason": problem[:1000]},
                                      self.config.frame_bytes_max))
        except OSError:
            pass  # the dialer learns from the closed connection instead
        _close_socket(sock)

    def _admission_problem(self, peer: Peer, epoch: int) -> str:
        """Why this peer epoch may not connect now ("" when it may). The epoch rules."""
        if peer == self.config.identity:
            return f"{peer} is this channel's own identity"
        known = self._known_epoch.get(peer)
        if known is not None and epoch < known:
            return (f"{peer} epoch {epoch} is older than epoch {known}, known here: "
                    "nothing of an old epoch is accepted")
        if known == epoch and peer in self._down_reason:
            return (f"{peer} epoch {epoch} was declared down here "
                    f"({self._down_reason[peer]}); it must rejoin in a new epoch")
        current = self._links.get(peer)
        if current is not None and current.epoch == epoch:
            return f"{peer} epoch {epoch} is connected already"
        if current is None and len(self._links) >= self.config.connections_max:
            return f"connections_max ({self.config.connections_max}) peers are connected"
        return ""

    def _register(self, sock, reader, peer: Peer, epoch: int, serve: bool = True):
        """Take the connection as `peer`'s epoch `epoch`: an older epoch's connection is
        superseded (declared down), and PeerUp goes into the inbox."""
        sock.settimeout(self.config.suspect_after_s)
        link = _Link(sock, reader, peer, epoch)
        with self._lock:
            problem = self._admission_problem(peer, epoch)  # again: another may have won
            if self._stop.is_set():
                problem = "this channel is closed"
            old = self._links.get(peer)
            if not problem:
                self._known_epoch[peer] = epoch
                self._down_reason.pop(peer, None)
                self._links[peer] = link
                self._push(PeerUp(peer, epoch))
        if problem:
            _close_socket(sock)
            raise PeerRefused(f"{self}: {problem}")
        if old is not None:
            self._declare_down(old, f"superseded: {peer} rejoined in epoch {epoch}")
        if serve:
            self._start(lambda: self._serve(link), f"reader {peer}")
        return link

    # -- reading --------------------------------------------------------------------------

    def _serve(self, link: _Link) -> None:
        """Read the connection's frames until it breaks; then declare its peer down."""
        try:
            while not link.down:
                self._dispatch(link, link.reader.next_record())
            return
        except TimeoutError:
            reason = (f"nothing heard for suspect_after_s ({self.config.suspect_after_s} s): "
                      "partitioned, hung or stopped")
        except FrameError as error:
            reason = self._count_refused_frame(f"{link.peer} epoch {link.epoch}: {error}")
        except _InboxFull as error:
            reason = str(error)
        except OSError as error:  # _PeerClosed is a ConnectionError, an OSError
            reason = f"the connection broke: {error}"
        self._declare_down(link, reason)

    def _dispatch(self, link: _Link, record: dict) -> None:
        if identity_of(record) != (link.peer, link.epoch):
            raise FrameError(f"a frame from {_short(record.get('from'))} on the connection "
                             f"of {link.peer} epoch {link.epoch}")
        if record["k"] == BEAT:
            return
        if record["k"] != MSG:
            raise FrameError(f"a {record['k']} frame after the handshake")
        if record.get("seq") != link.seq_in + 1:
            raise FrameError(f"message {_short(record.get('seq'))} after {link.seq_in}: "
                             "out of order on one connection")
        link.seq_in += 1
        message = message_from(record.get("body"))
        if message.kind == ENVELOPE and self._body_problem is not None:
            problem = self._body_problem(link.peer, message.fields["body"])
            if problem:
                raise FrameError(f"envelope: {problem}")
        if self._misaddressed(record.get("to")):
            return
        self._deliver(link, Delivered(link.peer, link.epoch, message, link.seq_in))

    def _misaddressed(self, to_epoch) -> bool:
        """A message meant for another epoch of this process: dropped and counted."""
        if to_epoch == self.config.epoch or "NoEpochCheck" in self.config.bugs:
            return False
        with self._lock:
            self.counts.misaddressed_dropped += 1
        log.info("%s: dropped a message for epoch %r", self, to_epoch)
        return True

    def _deliver(self, link: _Link, event: Delivered) -> None:
        """Into the inbox, waiting for room at most suspect_after_s. A message read after
        another thread declared its connection down is dropped (counted stale): PeerDown
        comes after every message its connection delivered."""
        deadline = time.monotonic() + self.config.suspect_after_s
        with self._ready:
            while self._inbox_messages >= self.config.inbox_messages_max:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _InboxFull(
                        f"this process left inbox_messages_max ({self.config.inbox_messages_max})"
                        f" messages untaken for suspect_after_s ({self.config.suspect_after_s} s)")
                self._ready.wait(remaining)
            if link.down:
                self.counts.stale_dropped += 1
                return
            self._inbox_messages += 1
            self._push(event)

    def _push(self, event: Event) -> None:
        with self._ready:
            self._inbox.append(event)
            self._ready.notify_all()

    def _take_one(self) -> Event | None:
        """The inbox's first event, or None when it was a stale message (dropped)."""
        event = self._inbox.popleft()
        if type(event) is not Delivered:
            return event
        self._inbox_messages -= 1
        self._ready.notify_all()  # room for a reader waiting in _deliver
        stale = self._known_epoch[event.peer] > event.epoch
        if stale and "NoEpochCheck" not in self.config.bugs:
            self.counts.stale_dropped += 1
            return None
        self.counts.delivered += 1
        return event

    def _count_refused_frame(self, reason: str) -> str:
        with self._lock:
            self.counts.frames_refused += 1
        log.warning("%s: dropping a connection: %s", self, reason)
        return f"bad frame: {reason}"

    # -- sending and the failure detector --------------------------------------------------

    def _send_message(self, link: _Link, message: Message) -> bool:
        with link.send_lock:
            record = self._stamped(MSG, to=link.epoch, seq=link.seq_out + 1,
                                   body=message_record(message))
            frame = encode_frame(record, self.config.frame_bytes_max)
            if not self._send_frame(link, frame):
                return False
            link.seq_out += 1
        return True

    def _send_frame(self, link: _Link, frame: bytes) -> bool:
        """sendall under the socket's timeout (suspect_after_s); a failure declares the
        peer down (the caller holds link.send_lock)."""
        try:
            link.sock.sendall(frame)
            return True
        except OSError as error:
            what = "blocked for suspect_after_s" if isinstance(error, TimeoutError) else "failed"
            self._declare_down(link, f"a send {what}: {error}")
            return False

    def _tick_loop(self) -> None:
        beat = encode_frame(self._stamped(BEAT), self.config.frame_bytes_max)
        while not self._stop.wait(self.config.heartbeat_s):
            if not self.alive():
                continue  # its process's loop hangs: silence, which the peers detect
            with self._lock:
                links = list(self._links.values())
            for link in links:
                with link.send_lock:
                    self._send_frame(link, beat)

    def _declare_down(self, link: _Link, reason: str) -> None:
        """The peer epoch is down: reported once, its connection closed."""
        with self._lock:
            if link.down:
                return
            link.down = True
            if self._links.get(link.peer) is link:
                del self._links[link.peer]
            if self._known_epoch.get(link.peer) == link.epoch:
                self._down_reason[link.peer] = reason
            self.counts.peers_down += 1
            event = PeerDown(link.peer, link.epoch, reason)
            self._push(event)
        log.warning("%s: %s epoch %d is down: %s", self, link.peer, link.epoch, reason)
        _close_socket(link.sock)
        if self._on_down is not None:
            self._on_down(event)

    def _start(self, target, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=f"{self!r} {name}", daemon=True)
        thread.start()
        return thread
