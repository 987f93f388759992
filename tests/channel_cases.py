"""The peer process of tests/test_channel.py: one engine/channel.py Channel that dials the
test's channel and does what the test tells it on stdin, reporting on stdout.

Run as `python tests/channel_cases.py '<json config>'` with the repository root on
PYTHONPATH. The config names the identity, epoch, bounds and the port to dial. Commands
(one JSON object a line on stdin): {"do": "send", "count": n, "start": r} sends n cancels
for requests r, r+1, ... to the peer; {"do": "exit"}. Reports (one JSON object a line on
stdout): "up", "msg" (each message received, echoed back when "echo" is set), "sent",
"down", "refused", "connect_failed". When its peer is declared down it redials in the same
epoch (unless "rejoin" is false: then it exits); refused, it restarts in the next epoch (a
new Channel: a restarted process is empty), which is the runtime's rule for a refused
epoch. It exits when stdin closes.
"""

from __future__ import annotations

import json
import queue
import sys
from dataclasses import replace

from engine.channel import (
    Channel, ChannelConfig, ChannelError, Delivered, Message, PeerDown, PeerRefused, PeerUp,
)
from engine.processes import report, stdin_commands
from spec import core

POLL_S = 0.02




def joined(config: ChannelConfig, port: int) -> Channel | None:
    """A channel connected to the test's, rejoining in a new epoch when refused."""
    channel = Channel(config)
    try:
        channel.connect(port)
        return channel
    except PeerRefused as error:
        report(ev="refused", epoch=config.epoch, reason=str(error))
        channel.close()
        return joined(replace(config, epoch=config.epoch + 1), port)
    except ChannelError as error:
        report(ev="connect_failed", reason=str(error))
        channel.close()
        return None


def on_event(channel: Channel, event, setup: dict) -> Channel | None:
    if type(event) is PeerUp:
        report(ev="up", epoch=channel.config.epoch, peer_epoch=event.epoch)
    elif type(event) is Delivered:
        m = event.message
        report(ev="msg", kind=m.kind, request=m.request, seq=event.seq)
        if setup.get("echo"):
            channel.send(event.peer, m, event.epoch)
    elif type(event) is PeerDown:
        report(ev="down", epoch=event.epoch, reason=event.reason)
        channel.close()
        return joined(channel.config, setup["port"]) if setup.get("rejoin", True) else None
    return channel


def send(channel: Channel, count: int, start: int) -> None:
    for peer, epoch in channel.peers().items():  # the one peer this process dialed
        sent = sum(channel.send(peer, Message(core.CANCEL_MSG, start + k), epoch)
                   for k in range(count))
        report(ev="sent", count=sent)


def main() -> None:
    setup = json.loads(sys.argv[1])
    config = ChannelConfig(setup["role"], setup["worker"], setup["epoch"],
                           heartbeat_s=setup["heartbeat_s"],
                           suspect_after_s=setup["suspect_after_s"])
    todo = stdin_commands()
    channel = joined(config, setup["port"])
    while channel is not None:
        try:
            command = todo.get_nowait()
        except queue.Empty:
            command = None
        if command is not None and command["do"] == "exit":
            break
        if command is not None and command["do"] == "send":
            send(channel, command["count"], command["start"])
        event = channel.receive(POLL_S)
        if event is not None:
            channel = on_event(channel, event, setup)
    if channel is not None:
        channel.close()


if __name__ == "__main__":
    main()
