"""engine/channel.py with real processes on 127.0.0.1: order, the failure detector's bound
(a killed peer, a stopped one), the epoch rules across a restart, and frames a peer gets
wrong. The test process holds one channel (a decode, listening); each peer is a process of
tests/channel_cases.py, or a raw socket speaking the wire protocol where the test must
forge what a correct channel never sends. Every process is killed in a finally, every wait
is bounded.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.channel import (
    BEAT, HELLO, MSG, WIRE_VERSION, Channel, ChannelConfig, Delivered, FrameError, Message,
    Peer, PeerDown, PeerUp, encode_frame, message_from, message_record,
)
from spec import core
from spec.commands import PAGE_TABLE

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 0.05
SUSPECT_S = 0.4
SLACK_S = 1.0        # scheduling on 2 loaded cores: a detection may come this much late
WAIT_S = 10.0        # the longest any step waits for a process
PREFILL = Peer("prefill", 0)


def host(epoch: int = 1, on_down=None, body_problem=None, **bounds) -> Channel:
    config = ChannelConfig("decode", 0, epoch, heartbeat_s=HEARTBEAT_S,
                           suspect_after_s=SUSPECT_S, **bounds)
    channel = Channel(config, on_down=on_down, body_problem=body_problem)
    channel.listen()
    return channel


class Child:
    """A tests/channel_cases.py process and its reports."""

    def __init__(self, port: int, epoch: int = 1, echo: bool = False, rejoin: bool = True):
        setup = dict(role="prefill", worker=0, epoch=epoch, port=port, echo=echo, rejoin=rejoin,
                     heartbeat_s=HEARTBEAT_S, suspect_after_s=SUSPECT_S)
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "channel_cases.py"), json.dumps(setup)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.reports: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.reports.put(json.loads(line))

    def expect(self, ev: str, timeout_s: float = WAIT_S) -> dict:
        """The next report of kind `ev` (earlier reports of other kinds are skipped)."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                report = self.reports.get(timeout=remaining)
            except queue.Empty:
                break
            if report["ev"] == ev:
                return report
        raise AssertionError(f"no {ev!r} report from the peer process in {timeout_s} s")

    def tell(self, **command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a stopped process dies only awake
            self.process.kill()
        self.process.wait(timeout=WAIT_S)


@contextmanager
def running(*things):
    """Channels and child processes, each stopped at the end whatever happens."""
    try:
        yield
    finally:
        for thing in things:
            thing.stop() if isinstance(thing, Child) else thing.close()


def next_event(channel: Channel, kind: type, timeout_s: float = WAIT_S):
    """The channel's next event of type `kind`; other events on the way are returned too."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        event = channel.receive(remaining)
        if type(event) is kind:
            return event, seen
        if event is not None:
            seen.append(event)
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s (saw {seen})")


def wait_until(condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def messages(count: int) -> list[Message]:
    """Every kind of protocol message, with fields, in turn."""
    kinds = [Message(core.BOOTSTRAP, 0, {"prompt_pages": 3}),
             Message(PAGE_TABLE, 0, {"pages": (4, 1, 7), "tags": (9, 9, 10)}),
             Message(core.FINAL_WORD_MSG, 0, {"word": "Done", "count": 3}),
             Message(core.CANCEL_MSG, 0), Message(core.CLIENT_GONE, 0)]
    return [Message(kinds[k % 5].kind, k, kinds[k % 5].fields) for k in range(count)]


# -- order and both ends learning a break -----------------------------------------------

def test_messages_come_back_in_order_and_both_ends_learn_a_close():
    channel = host()
    child = Child(channel.port, echo=True)
    with running(child, channel):
        up, _ = next_event(channel, PeerUp)
        assert (up.peer, up.epoch) == (PREFILL, 1)
        assert channel.receive(2 * SUSPECT_S) is None      # quiet but alive: never down
        sent = messages(200)
        assert all(channel.send(PREFILL, m, 1) for m in sent)
        back = [next_event(channel, Delivered)[0] for _ in sent]
        assert [d.message for d in back] == sent           # content, kinds and fields
        assert [d.seq for d in back] == list(range(1, 201))  # FIFO on the connection
        assert channel.counts.delivered == 200
        channel.close()
        down = child.expect("down")                        # the other end learns it
        assert "the connection broke" in down["reason"]
        assert child.expect("connect_failed")              # nothing listens any more


# -- the failure detector ----------------------------------------------------------------

def test_a_killed_peer_is_declared_down_within_the_bound():
    called = []
    channel = host(on_down=called.append)
    child = Child(channel.port)
    with running(child, channel):
        next_event(channel, PeerUp)
        start = time.monotonic()
        os.kill(child.process.pid, signal.SIGKILL)
        down, _ = next_event(channel, PeerDown)
        assert time.monotonic() - start < SUSPECT_S + SLACK_S
        assert (down.peer, down.epoch) == (PREFILL, 1)
        assert "the connection broke" in down.reason       # the kernel closed its socket
        assert channel.send(PREFILL, Message(core.CANCEL_MSG, 1), 1) is False
        assert channel.counts.unsent == 1 and channel.counts.peers_down == 1
        wait_until(lambda: called)                          # it runs after the event is in
        assert called == [down]                             # the callback, once


def test_a_stopped_peer_is_declared_down_and_must_rejoin_in_a_new_epoch():
    """A partition: the peer's kernel still answers TCP, the peer says nothing. Declared
    down within suspect_after_s of its last heartbeat; woken, its old epoch is refused and
    it comes back as epoch 2."""
    channel = host()
    child = Child(channel.port)
    with running(child, channel):
        next_event(channel, PeerUp)
        start = time.monotonic()
        os.kill(child.process.pid, signal.SIGSTOP)
        down, _ = next_event(channel, PeerDown)
        silent_s = time.monotonic() - start
        assert SUSPECT_S / 2 < silent_s < SUSPECT_S + SLACK_S, silent_s  # silence, not a close
        assert "nothing heard for suspect_after_s" in down.reason
        os.kill(child.process.pid, signal.SIGCONT)
        assert child.expect("down")["epoch"] == 1           # it learns its connection broke
        refused = child.expect("refused")
        assert refused["epoch"] == 1 and "declared down here" in refused["reason"]
        up, _ = next_event(channel, PeerUp)
        assert (up.peer, up.epoch) == (PREFILL, 2)
        assert channel.counts.hellos_refused == 1 and channel.counts.peers_down == 1
        assert channel.send(PREFILL, Message(core.CANCEL_MSG, 5), 1) is False  # old epoch
        assert channel.send(PREFILL, Message(core.CANCEL_MSG, 5), 2) is True


def test_a_cut_peer_is_down_at_once_both_ends_learn_it_and_its_epoch_is_refused():
    """`cut` (a supervisor's fence, a fault injection's partition): the peer epoch is down
    here at once, with the reason given, the callback runs once; the peer learns it from
    the closed connection, its old epoch is refused, and it comes back as epoch 2."""
    called = []
    channel = host(on_down=called.append)
    child = Child(channel.port)
    with running(child, channel):
        next_event(channel, PeerUp)
        assert channel.cut(PREFILL, "fenced: a test") is True
        down, _ = next_event(channel, PeerDown, timeout_s=SLACK_S)
        assert (down.peer, down.epoch, down.reason) == (PREFILL, 1, "fenced: a test")
        assert called == [down] and channel.cut(PREFILL, "again") is False
        assert child.expect("down")["epoch"] == 1
        refused = child.expect("refused")
        assert refused["epoch"] == 1 and "fenced: a test" in refused["reason"]
        up, _ = next_event(channel, PeerUp)
        assert (up.peer, up.epoch) == (PREFILL, 2)


# -- the epoch rules -----------------------------------------------------------------------

@pytest.mark.parametrize("bugs", [frozenset(), frozenset({"NoEpochCheck"})])
def test_a_restarted_peer_is_new_and_its_old_epoch_messages_are_dropped(bugs):
    """Messages of epoch 1 still untaken when epoch 2 joins are never delivered; without
    the epoch check (the mutant) they are."""
    channel = host(bugs=bugs)
    old = Child(channel.port)
    new = None
    try:
        next_event(channel, PeerUp)
        old.tell(do="send", count=3, start=10)
        assert old.expect("sent")["count"] == 3
        wait_until(lambda: channel.inbox_messages() == 3)
        old.stop()                                          # SIGKILL
        new = Child(channel.port, epoch=2)
        new.expect("up")
        new.tell(do="send", count=1, start=20)
        delivered = []
        while not any(d.epoch == 2 for d in delivered):
            delivered.append(next_event(channel, Delivered)[0])
        old_delivered = [d.message.request for d in delivered if d.epoch == 1]
        if bugs:
            assert old_delivered == [10, 11, 12] and channel.counts.stale_dropped == 0
        else:
            assert old_delivered == [] and channel.counts.stale_dropped == 3
        assert channel.peers() == {PREFILL: 2}
    finally:
        old.stop()
        if new is not None:
            new.stop()
        channel.close()


class Forger:
    """A raw socket that speaks the wire protocol, to send what a channel never would."""

    def __init__(self, port: int, epoch: int = 1, worker: int = 1):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.identity = ["prefill", worker, epoch]
        self.seq = 0

    def hello(self) -> None:
        self.raw(encode_frame({"k": HELLO, "v": WIRE_VERSION, "from": self.identity}, 4096))
        self.sock.recv(4096)                                # the WELCOME

    def message(self, message: Message, to_epoch: int) -> None:
        self.seq += 1
        self.raw(encode_frame({"k": MSG, "from": self.identity, "to": to_epoch,
                               "seq": self.seq, "body": message_record(message)}, 4096))

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_peer(self) -> bool:
        """True once the other end closed the connection (within WAIT_S)."""
        try:
            while self.sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("bugs", [frozenset(), frozenset({"NoEpochCheck"})])
def test_a_message_meant_for_an_old_epoch_of_the_receiver_is_dropped(bugs):
    """The spec's NoEpochCheck: a restarted decode (epoch 2) gets a late bootstrap made for
    its epoch 1. Dropped and counted; the mutant takes it."""
    channel = host(epoch=2, bugs=bugs)
    forger = Forger(channel.port)
    with running(forger, channel):
        forger.hello()
        next_event(channel, PeerUp)
        forger.message(Message(core.BOOTSTRAP, 7, {"prompt_pages": 2}), to_epoch=1)
        forger.message(Message(core.BOOTSTRAP, 8, {"prompt_pages": 2}), to_epoch=2)
        got = next_event(channel, Delivered)[0]
        if bugs:
            assert got.message.request == 7 and channel.counts.misaddressed_dropped == 0
        else:
            assert got.message.request == 8 and channel.counts.misaddressed_dropped == 1


# -- frames a peer gets wrong --------------------------------------------------------------

def bad_frames(sender: list) -> dict:
    """What a peer of identity `sender` may get wrong after its handshake, and the reason
    its connection is dropped for it."""
    def message(seq: int, body: dict) -> bytes:
        return encode_frame({"k": MSG, "from": sender, "to": 1, "seq": seq, "body": body}, 4096)
    return {
        "oversized": ((1 << 20).to_bytes(4, "big") + b"x" * 64, "over frame_bytes_max"),
        "not JSON": (len(b"{nope").to_bytes(4, "big") + b"{nope", "not a JSON frame"),
        "bad fields": (message(1, {"m": core.FINAL_WORD_MSG, "request": 1, "word": "Done",
                                   "count": -1}), "final word.count must be an integer >= 0"),
        "out of order": (message(5, {"m": core.CANCEL_MSG, "request": 1}), "out of order"),
        "another sender": (encode_frame({"k": BEAT, "from": ["prefill", 99, 1]}, 4096),
                           f"on the connection of prefill {sender[1]}"),
    }


def test_bad_frames_drop_only_their_connection(caplog):
    channel = host(connect_timeout_s=0.5, frame_bytes_max=8192)
    child = Child(channel.port, echo=True)
    with running(child, channel), caplog.at_level(logging.WARNING, "engine.channel"):
        next_event(channel, PeerUp)
        before_hello = Forger(channel.port)
        before_hello.raw(b"GET / HTTP/1.1\r\n\r\n")        # read as a 1.2 GB frame
        assert before_hello.closed_by_peer()
        silent = Forger(channel.port)                       # connects, says nothing
        assert silent.closed_by_peer()
        for worker, name in enumerate(bad_frames(["prefill", 0, 1]), start=1):
            forger = Forger(channel.port, worker=worker)    # a peer of its own each
            forger.hello()
            next_event(channel, PeerUp)
            frame, reason = bad_frames(forger.identity)[name]
            forger.raw(frame)
            down, _ = next_event(channel, PeerDown)
            assert down.peer == Peer("prefill", worker) and reason in down.reason, (name, down)
            assert forger.closed_by_peer()
            forger.close()
        assert channel.counts.frames_refused == 2 + len(bad_frames(["prefill", 0, 1]))
        assert "over frame_bytes_max" in caplog.text and "out of order" in caplog.text
        assert channel.send(PREFILL, Message(core.CANCEL_MSG, 99), 1)  # still serving
        assert next_event(channel, Delivered)[0].message.request == 99


def test_a_peer_that_trickles_a_frame_is_dropped_within_the_bound():
    """Each byte comes well within suspect_after_s of the last, so only the frame's own
    bound (suspect_after_s from its first byte) ends it."""
    channel = host()
    try:
        forger = Forger(channel.port)
        forger.hello()
        next_event(channel, PeerUp)
        frame = encode_frame({"k": MSG, "from": forger.identity, "to": 1, "seq": 1,
                              "body": message_record(Message(core.CANCEL_MSG, 7))}, 4096)
        assert len(frame) * SUSPECT_S / 8 > SUSPECT_S + SLACK_S  # it outlasts the bound
        started, down = time.monotonic(), None
        for byte in frame[:-1]:
            try:
                forger.raw(bytes([byte]))
            except OSError:                                 # the channel has closed it
                pass
            event = channel.receive(SUSPECT_S / 8)          # the pause between bytes
            if type(event) is PeerDown or time.monotonic() - started > SUSPECT_S + SLACK_S:
                down = event
                break
        elapsed = time.monotonic() - started
        assert type(down) is PeerDown and "trickles" in down.reason, down
        assert SUSPECT_S <= elapsed < SUSPECT_S + SLACK_S, elapsed
        forger.close()
    finally:
        channel.close()


def test_an_inbox_left_full_declares_the_peer_down():
    channel = host(inbox_messages_max=2)
    child = Child(channel.port, rejoin=False)  # a rejoin in epoch 2 would make them stale
    with running(child, channel):
        next_event(channel, PeerUp)
        child.tell(do="send", count=5, start=0)
        time.sleep(SUSPECT_S + 0.2)                         # this process takes nothing
        events = [channel.receive(WAIT_S) for _ in range(3)]
        assert [type(e) for e in events] == [Delivered, Delivered, PeerDown]
        assert "inbox_messages_max (2)" in events[2].reason


# -- no process ----------------------------------------------------------------------------

def test_a_wake_ends_the_receive_waiting_now_or_the_next_one_with_no_event():
    channel = host()
    try:
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(channel.receive(WAIT_S)))
        started = time.monotonic()
        waiting.start()
        time.sleep(0.2)
        channel.wake()  # (from another thread: a model step's, engine/process_data.py)
        waiting.join(WAIT_S)
        assert got == [None] and time.monotonic() - started < WAIT_S / 2
        channel.wake()
        started = time.monotonic()
        assert channel.receive(WAIT_S) is None      # the next one, at once
        assert time.monotonic() - started < WAIT_S / 2
        started = time.monotonic()
        assert channel.receive(0.3) is None         # one wake, one receive
        assert time.monotonic() - started >= 0.3
    finally:
        channel.close()


def test_config_and_messages_are_checked():
    with pytest.raises(ValueError, match="three heartbeats"):
        ChannelConfig("decode", 0, 1, heartbeat_s=1.0, suspect_after_s=2.0)
    with pytest.raises(ValueError, match="role"):
        ChannelConfig("client", 0, 1)
    with pytest.raises(ValueError, match="epochs start at 1"):
        ChannelConfig("decode", 0, 0)
    with pytest.raises(ValueError, match="unknown channel bug"):
        ChannelConfig("decode", 0, 1, bugs=frozenset({"NoCountCheck"}))
    with pytest.raises(ValueError, match="unknown message"):
        Message("hello", 1)
    with pytest.raises(ValueError, match="final word.word must be one of"):
        Message(core.FINAL_WORD_MSG, 1, {"word": "Fine", "count": 1})
    with pytest.raises(ValueError, match="frame_bytes_max"):
        encode_frame({"k": MSG, "body": "x" * 300}, 256)
    with pytest.raises(FrameError, match="has the fields"):
        message_from({"m": core.CANCEL_MSG, "request": 1, "extra": 2})
    table = Message(PAGE_TABLE, 3, {"pages": (1, 2), "tags": (5, 5)})
    assert message_from(json.loads(json.dumps(message_record(table)))) == table
