"""KV page writes between processes over torch.distributed: the `Transport` of engine/transport.py
with the prefill's pool in one process and the decode's in another.

Theory of operation. engine/transport.py's rules hold unchanged: a write reads its source
page when it lands, as an RDMA NIC does; the checksum the prefill computed at post time
travels with the write; the transport never decides: the decode runtime hands each ready
write to the core (LandWrite), and only an accepted one is landed, a refused one dropped.
What is new is that `post` runs in the prefill process and `ready` / `land` / `drop` in the
decode process, so each side holds a `DistTransport` for its own role, and the prefill
learns that its write completed from a completion message (`completed()`).

How a write reads its source at landing, for real. gloo's TCP pairs are rendezvous-based:
an `isend` moves no byte until the receiver has posted the matching `irecv`; then gloo's
own I/O thread in the *sender's* process reads the send buffer and writes it to the
socket (measured here: a 4 MiB isend, its buffer overwritten 0.5 s later, a recv posted
1 s later: the receiver gets the overwritten bytes). So:
  post (prefill)   isend of a fixed-size header, and isend of the page straight from the
                   pool (`pool.kv[source_page]`, one contiguous span: no staging copy).
                   Neither moves page bytes yet: the decode has pre-posted receives for
                   headers only.
  ready (decode)   the headers that have arrived (polled by their trailer), in order.
  land (decode)    posts the irecv for that write's page straight into
                   `pool.kv[decode_page]` and waits for it (bounded): only now does gloo
                   on the prefill side read the source page. A source page overwritten
                   between post and landing lands its new bytes, and the checksum sent at
                   post no longer matches them: SourceReuse is as real here as in-process.
                   Then a completion (LANDED, bytes) goes back to the prefill.
  drop (decode)    the payload must still be taken off the wire (gloo cannot cancel a
                   posted send), so it is received into a scratch page, never the decode
                   page; a completion (DROPPED, 0 bytes) goes back.
`read_at="arrival"` (decode's choice) trades that for bandwidth: the decode posts each
page's receive as soon as its header arrives, into a staging slot (one per window place:
writes_in_flight_max x page_bytes per prefill peer), and `land` copies it into the pool
(taking newer headers first, so their pages move meanwhile); `drop` just frees the slot.
The source page is then read at arrival, and SourceReuse's window shrinks to post ->
arrival: an overwrite after the bytes left (`wait_read` on the prefill says when) lands
nothing of it, and the checksum still matches. Reading at landing is the default, since it
is what an RDMA WRITE that the NIC executes late would do.
The price of reading at landing is one round trip per landing (the recv-ready notice to the
prefill, its gloo thread waking, then the bytes): bench/transport_bench.py measures it
against raw send/recv, and on 2 loaded cores it costs most of the bandwidth (engine/
README.md, "Across processes").

Batches take that price once per batch instead of once per page, and keep reading at
landing. `post_many` sends one header message for a run of up to `batch_max` writes (one
entry per write: its request, pages, tag and checksum) and each page as its own isend from
the pool, as `post` does: still no staging copy, so still nothing read before the landing
(one contiguous send of the batch would need a gather at post time, which reads the source
pages then: SourceReuse would stop biting). `land_many` posts the receive of every page of
the batch into its decode page before it waits on any, so the prefill's gloo thread streams
them back to back as it does for raw send/recv, and reports the landed writes in
completion messages of up to `batch_max` entries as soon as that many are in (the window
frees as the batch lands, so batches pipeline within it). Each write stays its own landing:
its own entry, its own checksum checked by the caller, its own completion; a refused write
of a batch is `drop`ped on its own after the accepted ones before it have landed. `post` /
`land` are batches of one. engine/loop.py lands each `ready()`'s accepted writes with one
`land_many`.

Framing. Every control message is one int64 tensor of `batch_max` entries of HEADER_FIELDS
(kind, seq, request, source page, decode page, tag, checksum, prefill worker, decode worker,
bytes, trailer), zero-padded after its last entry (kind 0 ends them), then the message's own
trailer, so a receiver pre-posts its receives with a known size (`batch_max` is agreed at
the handshake; HELLO itself is one entry, no padding). Page payloads are
`page_bytes` (both sides' pools must agree: checked at the handshake, HELLO, before any
write). Tags: HELLO_TAG, HEADER_TAG (prefill -> decode, writes and CLOSE), COMPLETION_TAG
(decode -> prefill, LANDED / DROPPED and CLOSE), and PAYLOAD_TAG_BASE + slot, where slot =
seq mod `writes_in_flight_max`: a slot's tag is reused only after its previous write's
completion came back, so a payload receive can never match the wrong write.

Bounds. A prefill has at most `writes_in_flight_max` writes in flight per decode peer
(posted, completion not yet received); `post` beyond that waits up to `timeout_s` for a
completion, then raises TransportTimeout; `post_many` posts runs that fit the free window
and waits the same way before the next run (what it posted stays posted). Every wait has
`timeout_s`. The decode keeps `writes_in_flight_max + 1` header receives posted per prefill
peer (every message carries at least one write in flight, or is the CLOSE), and the prefill
as many completion receives.

Ordering and loss. gloo over TCP delivers in order per pair and tag, and loses nothing while
both processes live. Writes of one prefill reach one decode in posting order; `land` and
`drop` must take a peer's ready writes in that order (asserted: NCCL, which ignores tags,
matches sends and receives by order alone, and this keeps one code path for both).
Completions come back in landing order. Between different peers there is no order.
A peer that dies (or stops answering) is not reported by gloo on what is already posted:
a posted receive simply never fills (measured: a wait on a receive whose peer had exited ran
to its 2 s timeout). So each side sees silence, and a bound turns silence into an error:
  - `wait_ready(timeout_s)` / `wait_completed(timeout_s)` poll and raise TransportTimeout
    naming the peer and the writes in flight; the pair stays usable (nothing was waited on
    inside gloo), and the caller's lease (issue 29 item 4) decides whether the peer is lost.
  - The next operation posted on the pair (a landing's receive, a post, a completion) fails
    at once when the dead peer's sockets were closed (a killed or exited process: the kernel
    closes them; gloo says "Connection closed by peer", or "Connection reset by peer" when
    the dead process left bytes unread in its socket, so the kernel reset it): PeerLost. A hung or partitioned
    peer closes nothing, and only the bounds speak.
  - `land` / `drop` wait inside gloo for the page (the sender's gloo thread answers at once
    while it lives); past `timeout_s` gloo closes the pair and this raises PeerLost: the
    decode page's bytes are then undefined (it may hold part of the write; the loop has not
    tagged it), and every later call on that pair fails with PeerLost too. `land_many`
    does the same for a whole batch: every write of the lost peer not yet reported landed
    fails (PeerLost's `writes`; `landed` has each write's bytes, 0 for a failed one), and
    the other peers' writes of the batch land first.
  - A `post` to a dead decode: its isends stay pending; the prefill sees no completion, and
    `wait_completed` / a full window's `post` raise TransportTimeout within `timeout_s`.
Polling. torch's gloo send/recv works answer `is_completed()` False until `wait()` was
called (measured: False with the bytes already in the buffer), and a wait that times out
closes the pair, so a control message's arrival is read from its buffer (`_arrived`: the
trailer field, last in byte order), and only then is its work waited on (at once).
An orderly `close()` sends CLOSE; the peer's next `ready()` / `completed()` marks it closed,
and a post to a closed peer is a TransportError.

NCCL. Written so that CUDA pools take the same path: payloads go over `group` (NCCL, device
tensors: the pool's pages, scratch and staging are on the pool's device), headers and
completions over `control_group` (gloo: CPU int64 tensors, polled); the constructor refuses
any other pairing (`_check_backends`). NCCL ignores tags (hence the in-order rule above).
Unverified, since no GPU ran this code: that an NCCL send reads its source only once the
receive is posted (what makes "read at landing" hold there: its kernel streams the buffer
through the channel as the receiver drains it, but the send kernel itself is queued on the
stream at post time and holds the stream's later NCCL work behind it), and how NCCL's
`wait(timeout)` behaves on a dead peer.

What NIXL and Mooncake's transfer engine would call (from their public docs; a sketch, not
tried). The read-at-landing design is a one-sided READ issued by decode:
  method      NIXL (Python agent API / C++)                     Mooncake transfer engine
  setup       nixl_agent(...), register_memory(pool.kv),         registerLocalMemory(pool.kv),
              get_agent_metadata / add_remote_agent              openSegment(prefill's name)
  post        send_notif(decode agent, header) (genNotif):       a notify message with the
              the source page's descriptor and the header        header (TransferNotify)
  ready       get_new_notifs() (getNotifs)                        the notify messages received
  land        initialize_xfer("READ", decode page descs,         allocateBatchID, submitTransfer
              prefill page descs, prefill agent) + transfer(),   ([TransferRequest READ]),
              check_xfer_state(handle) until "DONE" (createXfer- getTransferStatus until
              Req / postXferReq / getXferStatus), release_xfer_  COMPLETED, freeBatchID
              handle; then send_notif(prefill, LANDED)
  drop        no bytes to drain (one-sided): send_notif(DROPPED) the side channel (DROPPED)
  in_flight   the headers and handles this side holds             the same
  post_many / land_many: the same calls over lists (one notification with every header; one
  NIXL transfer over the batch's descriptor lists; one Mooncake submitTransfer of the batch's
  READ requests under one batch id).
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.pool import KVPool
from engine.transport import PageWrite

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
LANDING, ARRIVAL = "landing", "arrival"
READ_AT = (LANDING, ARRIVAL)

WRITE, CLOSE, LANDED, DROPPED, HELLO = 1, 2, 3, 4, 5
KINDS = {WRITE: "write", CLOSE: "close", LANDED: "landed", DROPPED: "dropped", HELLO: "hello"}
# kind, seq, request, source, decode page, tag, checksum, prefill, decode, bytes, trailer
HEADER_FIELDS = 11
TRAILER = 0x4B565452  # the last field of every control message: its arrival (see _arrived)
HELLO_TAG, HEADER_TAG, COMPLETION_TAG, PAYLOAD_TAG_BASE = 1, 2, 3, 16
MAGIC, VERSION = 0x6B7670, 2  # "kvp"; 2: control messages carry batches of entries
POLL_S = 0.0005  # the sleep between polls of a bounded wait, once it has lasted POLL_FAST_S
# Its first POLL_FAST_S poll every POLL_FAST_SLEEP_S: a header or a completion usually comes
# within a millisecond, and found half a POLL_S late it cost a 45 MiB batch about 5% of its
# bandwidth (bench/transport_bench.py); a longer wait costs no more CPU than before.
POLL_FAST_S, POLL_FAST_SLEEP_S = 0.002, 0.00005


class TransportError(RuntimeError):
    """A peer's failure or a bad word from it (the peer's fault, not ours)."""


class PeerLost(TransportError):
    """A wait inside gloo ran past its bound: gloo has closed the pair. From `land_many`:
    `writes`, those of the batch that failed, and `landed`, the bytes each write of the
    batch moved (0 for a failed one)."""

    writes: tuple = ()
    landed: tuple = ()


class TransportTimeout(TransportError):
    """A bounded poll saw nothing from the peer in time; the pair is still open."""


class TransportConfigError(ValueError):
    """A DistTransport configured wrongly, or two peers that do not agree."""


@dataclass(frozen=True)
class DistTransportConfig:
    role: str  # PREFILL or DECODE: which half of the Transport this process runs
    worker: int  # this process's worker index within its role (PageWrite.prefill / .decode)
    peers: tuple  # ((worker index, rank), ...): the other role's workers this one talks to
    writes_in_flight_max: int = 64  # per peer pair: posted and not completed
    timeout_s: float = 10.0  # every wait once both sides are up
    handshake_timeout_s: float = 60.0  # the HELLO: the peer may still be starting
    read_at: str = LANDING  # decode: when the source page is read (LANDING or ARRIVAL)
    batch_max: int = 64  # entries per control message: a post_many's headers, a batch's
    #                      completions (both peers must agree: checked at the handshake)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TransportConfigError(f"role must be one of {ROLES}, not {self.role!r}")
        if not isinstance(self.worker, int) or self.worker < 0:
            raise TransportConfigError(f"worker must be an index >= 0, not {self.worker!r}")
        if not self.peers:
            raise TransportConfigError("peers is empty: a transport needs a peer to talk to")
        workers = [w for w, _ in self.peers]
        ranks = [r for _, r in self.peers]
        if len(set(workers)) != len(workers) or len(set(ranks)) != len(ranks):
            raise TransportConfigError(f"peers name a worker or a rank twice: {self.peers}")
        if not 1 <= self.writes_in_flight_max <= 4096:
            raise TransportConfigError("writes_in_flight_max must be in 1..4096, not "
                                       f"{self.writes_in_flight_max}")
        if not 1 <= self.batch_max <= 4096:
            raise TransportConfigError(f"batch_max must be in 1..4096, not {self.batch_max}")
        if self.read_at not in READ_AT:
            raise TransportConfigError(f"read_at must be one of {READ_AT}, not {self.read_at!r}")
        for name in ("timeout_s", "handshake_timeout_s"):
            if not getattr(self, name) > 0:
                raise TransportConfigError(f"{name} must be positive, not {getattr(self, name)}")

    @property
    def peer_role(self) -> str:
        return DECODE if self.role == PREFILL else PREFILL


@dataclass(frozen=True)
class Completion:
    """The decode's word on one posted write: landed (with its bytes) or dropped."""

    write: PageWrite
    landed: bool
    bytes_moved: int


def fields_of(kind: int, seq: int, write: PageWrite | None = None, moved: int = 0) -> list[int]:
    """One entry of a control message: a write's header, a completion, a CLOSE."""
    w = write or PageWrite(0, 0, 0, 0, 0)
    return [kind, seq, w.request, w.source_page, w.decode_page, w.tag, w.checksum,
            w.prefill, w.decode, moved, TRAILER]


def header(kind: int, seq: int, write: PageWrite | None = None, moved: int = 0) -> torch.Tensor:
    return torch.tensor(fields_of(kind, seq, write, moved), dtype=torch.int64)


def message(entries: list[list[int]], batch_max: int) -> torch.Tensor:
    """A control message: up to batch_max entries, zero-padded (kind 0 ends the entries),
    then the message's own trailer, its last field (what `_arrived` reads)."""
    assert 1 <= len(entries) <= batch_max, f"{len(entries)} entries, at most {batch_max}"
    flat = [value for entry in entries for value in entry]
    return torch.tensor(flat + [0] * ((batch_max - len(entries)) * HEADER_FIELDS) + [TRAILER],
                        dtype=torch.int64)


def entries_of(values: list[int]) -> list[list[int]]:
    """A received control message's entries (those before the first kind 0)."""
    out = []
    for start in range(0, len(values) - 1, HEADER_FIELDS):
        if values[start] == 0:
            break
        out.append(values[start:start + HEADER_FIELDS])
    return out


def write_of(fields: list[int]) -> PageWrite:
    return PageWrite(*fields[2:9])


def hello_fields(config: DistTransportConfig, pool: KVPool) -> list[int]:
    pc = pool.config
    return [MAGIC, VERSION, ROLES.index(config.role), config.worker, pc.page_bytes,
            pc.num_pages, config.writes_in_flight_max, config.batch_max, 0, 0, TRAILER]


def check_hello(mine: list[int], theirs: list[int], expected_worker: int, rank: int) -> None:
    """Two peers agree on the framing before any write; a mismatch names both numbers."""
    who = f"rank {rank}"
    if theirs[0] != MAGIC or theirs[1] != VERSION:
        raise TransportConfigError(f"{who} is not a kvproof transport of version {VERSION} "
                                   f"(magic {theirs[0]:#x}, version {theirs[1]})")
    if theirs[2] == mine[2]:
        raise TransportConfigError(f"{who} has the same role ({ROLES[mine[2]]}) as this one")
    if theirs[3] != expected_worker:
        raise TransportConfigError(f"{who} is {ROLES[theirs[2]]}-{theirs[3]}, but peers names "
                                   f"it {ROLES[theirs[2]]}-{expected_worker}")
    if theirs[4] != mine[4]:
        raise TransportConfigError(f"{who}'s pages hold {theirs[4]} bytes, this pool's "
                                   f"{mine[4]}: the two pools' layouts differ")
    if theirs[6] != mine[6]:
        raise TransportConfigError(f"{who} allows {theirs[6]} writes in flight, this one "
                                   f"{mine[6]}: both must use the same writes_in_flight_max")
    if theirs[7] != mine[7]:
        raise TransportConfigError(f"{who} batches {theirs[7]} entries per control message, "
                                   f"this one {mine[7]}: both must use the same batch_max")


def _page(pool: KVPool, page: int) -> torch.Tensor:
    """One page's bytes, a view into the pool (page-major layout: one contiguous span)."""
    return pool.kv[page].reshape(-1).view(torch.uint8)


class _Peer:
    """One pair: the other role's worker at `rank`, and what is in flight with it."""

    def __init__(self, worker: int, rank: int) -> None:
        self.worker, self.rank = worker, rank
        self.posted_recvs: deque = deque()  # (work, tensor): headers or completions awaited
        self.sends: dict[int, tuple] = {}  # prefill: seq -> (works, tensors) of its write
        self.control_sends: deque = deque()  # decode: completions; both: CLOSE (work, tensor)
        self.in_flight: dict[int, PageWrite] = {}  # prefill: seq -> write, no completion yet
        self.arrived: deque = deque()  # decode: (seq, write) ready, not landed or dropped
        self.prefetched: dict[int, object] = {}  # decode, ARRIVAL: seq -> its page's receive
        self.staging = None  # decode, ARRIVAL: [writes_in_flight_max, page_bytes], by slot
        self.next_seq = 0  # prefill: the next write's seq; decode: the next header's
        self.closed = False
        self.lost = ""  # why the pair is unusable, once gloo closed it

    def name(self, role: str) -> str:
        return f"{role}-{self.worker} (rank {self.rank})"


class DistTransport:
    """One process's half of the page transport (see the module header)."""

    def __init__(self, pool: KVPool, config: DistTransportConfig, group=None,
                 control_group=None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise TransportConfigError("torch.distributed is not initialized: call "
                                       "init_process_group before building a DistTransport")
        self.pool, self.config = pool, config
        self.group, self.control = group, control_group if control_group is not None else group
        _check_backends(dist.get_backend(self.group), dist.get_backend(self.control),
                        pool.kv.device.type)
        own = dist.get_rank()
        world = dist.get_world_size()
        for worker, rank in config.peers:
            if not 0 <= rank < world or rank == own:
                raise TransportConfigError(f"peer {config.peer_role}-{worker} has rank {rank}: "
                                           f"not another rank of this world (0..{world - 1}, "
                                           f"this one is {own})")
        self.peers = {worker: _Peer(worker, rank) for worker, rank in config.peers}
        # A bounded wait is in progress (each raises past timeout_s): whoever watches the
        # calling thread for a hang counts it as working (engine/processes.py loop_alive).
        self.waits = 0
        self.scratch = torch.empty(pool.config.page_bytes, dtype=torch.uint8,
                                   device=pool.kv.device)
        if config.role == DECODE and config.read_at == ARRIVAL:
            for peer in self.peers.values():
                peer.staging = torch.empty((config.writes_in_flight_max, pool.config.page_bytes),
                                           dtype=torch.uint8, device=pool.kv.device)
        self.bytes_landed = self.writes_landed = self.writes_dropped = 0
        self._completed: list[Completion] = []
        self._unreturned: list[PageWrite] = []  # decode: taken off the wire, not yet ready()d
        self._handshake()
        for peer in self.peers.values():
            self._post_control_recvs(peer)

    # -- setup ---------------------------------------------------------------------------

    def _handshake(self) -> None:
        mine = hello_fields(self.config, self.pool)
        for peer in self.peers.values():
            theirs = torch.zeros(HEADER_FIELDS, dtype=torch.int64)
            out = torch.tensor(mine, dtype=torch.int64)
            sent = self._op(dist.isend, out, peer, group=self.control, tag=HELLO_TAG)
            got = self._op(dist.irecv, theirs, peer, group=self.control, tag=HELLO_TAG)
            self._poll_until(lambda: _arrived(theirs), peer, "its handshake",
                             self.config.handshake_timeout_s)
            self._wait(got, peer, "the handshake")
            self._wait(sent, peer, "the handshake")
            check_hello(mine, theirs.tolist(), peer.worker, peer.rank)

    def _post_control_recvs(self, peer: _Peer) -> None:
        """Decode: a header receive per possible write plus one for CLOSE; prefill: a
        completion receive per possible write plus one for CLOSE."""
        tag = HEADER_TAG if self.config.role == DECODE else COMPLETION_TAG
        while len(peer.posted_recvs) < self.config.writes_in_flight_max + 1:
            buffer = torch.zeros(self.config.batch_max * HEADER_FIELDS + 1, dtype=torch.int64)
            work = self._op(dist.irecv, buffer, peer, group=self.control, tag=tag)
            peer.posted_recvs.append((work, buffer))

    # -- bounded waits -------------------------------------------------------------------

    def _poll_until(self, done, peer: _Peer, what: str, timeout_s: float | None = None) -> None:
        if peer.lost:
            raise PeerLost(peer.lost)
        limit_s = self.config.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        deadline = started + limit_s
        self.waits += 1
        try:
            while not done():
                now = time.monotonic()
                if now > deadline:
                    raise TransportTimeout(
                        f"no word from {peer.name(self.config.peer_role)} for {what} within "
                        f"{limit_s} s ({self._in_flight_of(peer)} writes in flight with it)")
                time.sleep(POLL_FAST_SLEEP_S if now - started < POLL_FAST_S else POLL_S)
        finally:
            self.waits -= 1

    def _op(self, op, tensor: torch.Tensor, peer: _Peer, group, tag: int):
        """Post one isend / irecv; gloo refusing it (the pair is closed: "Connection closed
        by peer") is PeerLost, said once for the pair."""
        if peer.lost:
            raise PeerLost(peer.lost)
        try:
            return op(tensor, peer.rank, group=group, tag=tag)
        except RuntimeError as error:
            peer.lost = (f"{peer.name(self.config.peer_role)} is gone: gloo refused to post "
                         f"to it ({error})"[:600])
            raise PeerLost(peer.lost) from None

    def _wait(self, work, peer: _Peer, what: str) -> None:
        if peer.lost:
            raise PeerLost(peer.lost)
        self.waits += 1
        try:
            work.wait(datetime.timedelta(seconds=self.config.timeout_s))
        except RuntimeError as error:
            peer.lost = (f"{peer.name(self.config.peer_role)} did not complete {what} within "
                         f"{self.config.timeout_s} s; gloo closed the pair ({error})"[:600])
            raise PeerLost(peer.lost) from None
        finally:
            self.waits -= 1

    def _send_control(self, peer: _Peer, entries: list[list[int]], tag: int) -> None:
        """Headers, completions or a CLOSE, as messages of up to batch_max entries. The peer
        keeps a receive posted for every message it can get (each carries at least one write
        in flight, or the CLOSE), so a send older than the window has long gone out: waiting
        on it costs nothing while the peer lives (and is the bound that says it died)."""
        for start in range(0, len(entries), self.config.batch_max):
            self._send_message(peer, entries[start:start + self.config.batch_max], tag)

    def _send_message(self, peer: _Peer, entries: list[list[int]], tag: int) -> None:
        head = message(entries, self.config.batch_max)
        work = self._op(dist.isend, head, peer, group=self.control, tag=tag)
        peer.control_sends.append((work, head))
        while len(peer.control_sends) > self.config.writes_in_flight_max:
            self._wait(peer.control_sends.popleft()[0], peer, "taking a completion")

    def _in_flight_of(self, peer: _Peer) -> int:
        return len(peer.in_flight) if self.config.role == PREFILL else len(peer.arrived)

    def _role(self, role: str, method: str) -> None:
        assert self.config.role == role, f"{method} is the {role}'s half of the transport"

    # -- the prefill's half --------------------------------------------------------------

    def post(self, write: PageWrite, timeout_s: float | None = None) -> None:
        """Put a write on the wire: its header, and its page as a send the decode's landing
        will match (no page byte is read before that). A full window waits up to timeout_s
        (default: the config's) for a completion."""
        self.post_many([write], timeout_s)

    def post_many(self, writes: list[PageWrite], timeout_s: float | None = None) -> None:
        """Post several writes as batches: per decode peer, one header message for each run
        of up to batch_max writes (one control message, not one per write; each entry
        names its own request, pages, tag and checksum), and each page as its own send
        straight from the pool, as `post` does (no staging copy, nothing read before the
        landing). A run never outgrows the free window: a full window waits up to
        timeout_s for a completion, then TransportTimeout (the runs posted so far stay
        posted). Writes to one peer keep their order."""
        self._role(PREFILL, "post_many")
        by_peer: dict[int, list[PageWrite]] = {}
        for write in writes:
            assert write.prefill == self.config.worker, f"{write} is not this prefill's write"
            assert 0 <= write.source_page < self.pool.config.num_pages, f"{write}: no such page"
            assert write.decode in self.peers, f"{write}: decode-{write.decode} is not a peer"
            by_peer.setdefault(write.decode, []).append(write)
        window = self.config.writes_in_flight_max
        for decode, run in by_peer.items():
            peer = self.peers[decode]
            while run:
                if peer.closed:
                    raise TransportError(f"{peer.name(DECODE)} has closed the transport")
                if len(peer.in_flight) >= window:
                    self._poll_until(lambda: self._take_completions(peer) or
                                     len(peer.in_flight) < window,
                                     peer, f"a completion to free one of its {window} write "
                                     f"slots", timeout_s)
                room = min(window - len(peer.in_flight), self.config.batch_max)
                batch, run = run[:room], run[room:]
                seqs = range(peer.next_seq, peer.next_seq + len(batch))
                self._send_message(peer, [fields_of(WRITE, seq, write)
                                          for seq, write in zip(seqs, batch)], HEADER_TAG)
                peer.next_seq += len(batch)
                for seq, write in zip(seqs, batch):
                    page = _page(self.pool, write.source_page)
                    work = self._op(dist.isend, page, peer, self.group,
                                    PAYLOAD_TAG_BASE + seq % window)
                    peer.sends[seq] = ({"page": work}, page)
                    peer.in_flight[seq] = write

    def wait_read(self, write: PageWrite) -> None:
        """Wait (bounded) until the write's source page has been read: its send is done, so
        the page may change without changing what lands. With LANDING that is its landing;
        with ARRIVAL, soon after its header arrived."""
        self._role(PREFILL, "wait_read")
        peer = self.peers[write.decode]
        seq = next(s for s, w in peer.in_flight.items() if w == write)
        works = peer.sends[seq][0]
        if "page" in works:  # a gloo work waited on twice waits for a second completion
            self._wait(works.pop("page"), peer, f"the send of {write}")

    def completed(self) -> list[Completion]:
        """The completions that came back since the last call (per peer in landing order)."""
        self._role(PREFILL, "completed")
        for peer in self.peers.values():
            self._take_completions(peer)
        out, self._completed = self._completed, []
        return out

    def wait_completed(self, timeout_s: float) -> list[Completion]:
        """Completions, waiting up to timeout_s for at least one while writes are in flight."""
        self._role(PREFILL, "wait_completed")
        busy = [p for p in self.peers.values() if p.in_flight]
        if busy and not self._completed:
            self._poll_until(lambda: any([self._take_completions(p) for p in busy]), busy[0],
                             "a completion", timeout_s)
        return self.completed()

    def _take_completions(self, peer: _Peer) -> bool:
        took = False
        while (entries := self._next_control(peer, "a completion")) is not None:
            for fields in entries:
                if fields[0] == CLOSE:
                    peer.closed = True
                    continue
                self._completion(peer, fields)
                took = True
        return took

    def _next_control(self, peer: _Peer, what: str) -> list[list[int]] | None:
        """The entries of the oldest posted control receive once it has arrived (its receive
        posted again), else None."""
        if peer.lost or not peer.posted_recvs or not _arrived(peer.posted_recvs[0][1]):
            return None
        work, buffer = peer.posted_recvs.popleft()
        self._wait(work, peer, what)  # arrived: returns at once, and settles the work
        self._post_control_recvs(peer)
        return entries_of(buffer.tolist())

    def _completion(self, peer: _Peer, fields: list[int]) -> None:
        kind, seq, moved = fields[0], fields[1], fields[9]
        write = peer.in_flight.pop(seq, None)
        if kind not in (LANDED, DROPPED) or write is None or write_of(fields) != write:
            raise TransportError(f"{peer.name(DECODE)} sent a {KINDS.get(kind, kind)} "
                                 f"completion for seq {seq}, which names no write in flight "
                                 f"with it: {fields}")
        works, *_ = peer.sends.pop(seq)
        for work in works.values():  # decode has the bytes: the sends are done, at once
            self._wait(work, peer, f"the sends of {write}")
        self._completed.append(Completion(write, kind == LANDED, moved))

    # -- the decode's half ---------------------------------------------------------------

    def ready(self) -> list[PageWrite]:
        """The writes whose headers arrived since the last call, per peer in posting order."""
        self._role(DECODE, "ready")
        for peer in self.peers.values():
            self._take_headers(peer)
        out, self._unreturned = self._unreturned, []
        return out

    def wait_ready(self, timeout_s: float) -> list[PageWrite]:
        """Ready writes, waiting up to timeout_s for at least one."""
        self._role(DECODE, "wait_ready")
        out: list[PageWrite] = []

        def some() -> bool:
            out.extend(self.ready())
            return bool(out)
        self._poll_until(some, next(iter(self.peers.values())), "a write", timeout_s)
        return out

    def _take_headers(self, peer: _Peer) -> list[PageWrite]:
        out = []
        while (entries := self._next_control(peer, "a header")) is not None:
            for fields in entries:
                if fields[0] == CLOSE:
                    peer.closed = True
                    continue
                write = self._checked_write(peer, fields)
                peer.arrived.append((fields[1], write))
                if peer.staging is not None:  # ARRIVAL: the page moves now, into its slot
                    slot = fields[1] % self.config.writes_in_flight_max
                    peer.prefetched[fields[1]] = self._op(dist.irecv, peer.staging[slot], peer,
                                                          self.group, PAYLOAD_TAG_BASE + slot)
                peer.next_seq += 1
                out.append(write)
        self._unreturned.extend(out)
        return out

    def _checked_write(self, peer: _Peer, fields: list[int]) -> PageWrite:
        write = write_of(fields)
        problem = ""
        if fields[0] != WRITE:
            problem = f"a {KINDS.get(fields[0], fields[0])} message on the header channel"
        elif peer.closed:
            problem = "a write after its CLOSE"
        elif fields[1] != peer.next_seq:
            problem = f"seq {fields[1]} where {peer.next_seq} was next"
        elif write.prefill != peer.worker or write.decode != self.config.worker:
            problem = (f"a write from prefill-{write.prefill} to decode-{write.decode} on the "
                       f"pair prefill-{peer.worker} -> decode-{self.config.worker}")
        elif not 0 <= write.decode_page < self.pool.config.num_pages:
            problem = f"decode page {write.decode_page} of a {self.pool.config.num_pages}-page pool"
        if problem:
            raise TransportError(f"{peer.name(PREFILL)} sent {problem}: {fields}")
        return write

    def _oldest(self, write: PageWrite, method: str) -> tuple[_Peer, int]:
        self._role(DECODE, method)
        peer = self.peers.get(write.prefill)
        assert peer is not None and peer.arrived, f"{method}({write}): not a ready write"
        seq, oldest = peer.arrived[0]
        assert oldest == write, (f"{method}({write}): a peer's ready writes are landed or "
                                 f"dropped in their order, and {oldest} is next")
        return peer, seq

    def land(self, write: PageWrite) -> int:
        """Receive the write's page into its decode page now (LANDING: the prefill's gloo
        thread reads the source page at this moment; ARRIVAL: it was read when the header
        arrived, and lands from staging); returns bytes moved."""
        peer, seq = self._oldest(write, "land")
        target = _page(self.pool, write.decode_page)
        if peer.staging is None:
            self._receive_payload(peer, seq, target, "the page of " + str(write))
        else:  # first take what has arrived since, so its pages move while this one lands
            self._take_headers(peer)
            self._wait(peer.prefetched.pop(seq), peer, "the page of " + str(write))
            target.copy_(peer.staging[seq % self.config.writes_in_flight_max])
        self._complete(peer, seq, write, LANDED, target.numel())
        self.bytes_landed += target.numel()
        self.writes_landed += 1
        return target.numel()

    def land_many(self, writes: list[PageWrite]) -> list[int]:
        """Land several ready writes as one batch; returns the bytes moved by each. Every
        page's receive of the batch is posted before any is waited on, so the pages move
        back to back and the batch costs one round trip, not one per page (LANDING: the
        prefill's gloo thread reads each source page now, as `land` does; ARRIVAL: they
        were read at arrival and land from staging). Each landing stays its own: its page,
        its tag and the checksum it was posted with are checked by the caller per page, and
        each write's own completion entry goes back (in messages of up to batch_max
        entries, sent as soon as that many have landed). Each peer's writes in the batch
        must be its next ready ones, in order (what `ready()` returned, or a prefix of it);
        a batch that names one decode page twice lands in runs that do not, in order.
        A peer lost mid-batch (PeerLost while posting or waiting) fails every write of its
        own in the batch not yet reported landed (their decode pages' bytes are undefined,
        as for `land`; they stay ready, and landing them again is PeerLost again): the
        other peers' writes are landed and completed first, then PeerLost is raised with
        `.writes`, the failed writes, and `.landed`, the bytes moved by each write of the
        batch (0 for the failed)."""
        self._role(DECODE, "land_many")
        moved: dict[int, int] = {}  # index in `writes` -> bytes
        failed: list[PageWrite] = []
        lost = ""
        start = 0
        while start < len(writes):
            end, pages = start, set()
            while end < len(writes) and writes[end].decode_page not in pages:
                pages.add(writes[end].decode_page)
                end += 1
            why = self._land_run(writes, start, end, moved, failed)
            lost = lost or why
            start = end
        if failed:
            error = PeerLost(lost)
            error.writes = tuple(failed)
            error.landed = tuple(moved.get(i, 0) for i in range(len(writes)))
            raise error
        return [moved[i] for i in range(len(writes))]

    def _land_run(self, writes: list[PageWrite], start: int, end: int, moved: dict,
                  failed: list) -> str:
        """Land writes[start:end] (no decode page twice): post every receive, then wait."""
        by_peer: dict[int, list[int]] = {}
        why = ""
        for index in range(start, end):
            write = writes[index]
            peer = self.peers.get(write.prefill)
            assert peer is not None, f"land_many({write}): prefill-{write.prefill} is no peer"
            if peer.lost:  # lost before this run (earlier in this batch, or before it)
                failed.append(write)
                why = why or peer.lost
                continue
            by_peer.setdefault(write.prefill, []).append(index)
        plans = []
        for worker, indexes in by_peer.items():
            peer = self.peers[worker]
            assert len(indexes) <= len(peer.arrived), (
                f"land_many: {[writes[i] for i in indexes]} are not all ready writes")
            for place, index in enumerate(indexes):
                assert peer.arrived[place][1] == writes[index], (
                    f"land_many({writes[index]}): a peer's ready writes are landed or dropped "
                    f"in their order, and {peer.arrived[place][1]} is next")
            plans.append((peer, indexes, [peer.arrived[p][0] for p in range(len(indexes))]))
        posted = []  # (peer, indexes, seqs, works, error)
        for peer, indexes, seqs in plans:
            works, error = [], ""
            try:
                if peer.staging is None:
                    for index, seq in zip(indexes, seqs):
                        works.append(self._op(
                            dist.irecv, _page(self.pool, writes[index].decode_page), peer,
                            self.group, PAYLOAD_TAG_BASE + seq % self.config.writes_in_flight_max))
                else:  # what arrived since moves while this batch lands
                    self._take_headers(peer)
            except PeerLost as lost:
                error = str(lost)
            posted.append((peer, indexes, seqs, works, error))
        for peer, indexes, seqs, works, error in posted:
            done = 0  # this peer's writes landed and reported, a prefix of `indexes`
            try:
                if error:
                    raise PeerLost(error)
                for place, (index, seq) in enumerate(zip(indexes, seqs)):
                    write = writes[index]
                    if peer.staging is None:
                        self._wait(works[place], peer, "the page of " + str(write))
                    else:
                        self._wait(peer.prefetched.pop(seq), peer, "the page of " + str(write))
                        _page(self.pool, write.decode_page).copy_(
                            peer.staging[seq % self.config.writes_in_flight_max])
                    if place + 1 - done == self.config.batch_max or place + 1 == len(indexes):
                        chunk, done = slice(done, place + 1), place + 1
                        self._landed(peer, writes, indexes[chunk], seqs[chunk], moved)
            except PeerLost as lost:  # the writes not reported stay ready, as with `land`
                why = why or str(lost)
                failed.extend(writes[i] for i in indexes[done:])
        return why

    def _landed(self, peer: _Peer, writes: list[PageWrite], indexes: list[int],
                seqs: list[int], moved: dict) -> None:
        """Writes of a batch that have landed, reported as one completion message as soon
        as batch_max of them are in (their window slots come free, so the prefill posts
        more while the rest of the batch lands: batches pipeline within the window). Their
        bytes are in the pool: they count as landed even if the completion cannot be sent
        (the pair is then lost, and the prefill hears silence)."""
        page_bytes = self.pool.config.page_bytes
        for index in indexes:
            peer.arrived.popleft()
            moved[index] = page_bytes
        self.bytes_landed += page_bytes * len(indexes)
        self.writes_landed += len(indexes)
        self._send_control(peer, [fields_of(LANDED, seq, writes[index], page_bytes)
                                  for index, seq in zip(indexes, seqs)], COMPLETION_TAG)

    def drop(self, write: PageWrite) -> None:
        """Take a refused write off the wire into scratch: the decode page is not touched."""
        peer, seq = self._oldest(write, "drop")
        if peer.staging is None:
            self._receive_payload(peer, seq, self.scratch, "the dropped page of " + str(write))
        else:
            self._wait(peer.prefetched.pop(seq), peer, "the dropped page of " + str(write))
        self._complete(peer, seq, write, DROPPED, 0)
        self.writes_dropped += 1

    def _receive_payload(self, peer: _Peer, seq: int, into: torch.Tensor, what: str) -> None:
        slot = seq % self.config.writes_in_flight_max
        work = self._op(dist.irecv, into, peer, self.group, PAYLOAD_TAG_BASE + slot)
        self._wait(work, peer, what)

    def _complete(self, peer: _Peer, seq: int, write: PageWrite, kind: int, moved: int) -> None:
        peer.arrived.popleft()
        self._send_control(peer, [fields_of(kind, seq, write, moved)], COMPLETION_TAG)

    # -- both ----------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Prefill: writes posted whose completion has not come back. Decode: writes ready
        and not landed or dropped (a write still on the wire is not known here yet)."""
        return sum(self._in_flight_of(peer) for peer in self.peers.values())

    def close(self) -> None:
        """Tell every live peer this side is done (CLOSE), and wait (bounded) until our
        control messages have gone out. Writes still in flight are the caller's to settle
        first: their sends stay pending until the peer lands or drops them."""
        tag = HEADER_TAG if self.config.role == PREFILL else COMPLETION_TAG
        for peer in self.peers.values():
            if not peer.lost:
                self._send_control(peer, [fields_of(CLOSE, peer.next_seq)], tag)
        for peer in self.peers.values():
            while peer.control_sends and not peer.lost:
                self._wait(peer.control_sends.popleft()[0], peer, "our CLOSE")


def _arrived(buffer: torch.Tensor) -> bool:
    """Whether a posted control receive has been filled. torch's gloo send/recv works say
    is_completed() only after wait() (measured: False with the bytes already there), and a
    wait that times out closes the pair, so arrival is read from the buffer itself: it was
    zeroed when posted, gloo's TCP pair reads a message into it in byte order, and the
    trailer is its last field."""
    return int(buffer[-1]) == TRAILER


def _check_backends(payload: str, control: str, device: str) -> None:
    """Headers are CPU tensors polled by their trailer: gloo. Pages go where the pool is:
    gloo for a CPU pool, NCCL for a CUDA one."""
    if control != "gloo":
        raise TransportConfigError(f"control_group's backend is {control}: headers and "
                                   "completions need a gloo group (dist.new_group(..., "
                                   "backend='gloo'))")
    expected = {"cpu": "gloo", "cuda": "nccl"}.get(device)
    if payload != expected:
        raise TransportConfigError(f"a {device} pool's pages cannot go over {payload}"
                                   + (f": use {expected}" if expected else ""))
