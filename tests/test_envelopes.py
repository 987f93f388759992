"""Envelopes between a deployment's processes (engine/processes.py ENVELOPES): each body is
checked against its kind before any handler sees it, and a bad one drops its sender's
connection as a bad frame does (issue 29: a peer's bad input is a clear error, never a
crash of the receiving process)."""

from __future__ import annotations

import pytest

from engine.channel import Delivered, Message, Peer, PeerDown, PeerUp, ENVELOPE
from engine.processes import (
    ENVELOPES, DecodeProcess, Deployment, PrefillProcess, RouterProcess, envelope_problem,
)
from spec.roles import DECODE, PREFILL, ROUTER
from tests.test_channel import Forger, host, next_event, running

M = Deployment(prompts=(2, 3)).model()   # two requests
ROUTER0, PREFILL0, DECODE0 = Peer(ROUTER, 0), Peer(PREFILL, 0), Peer(DECODE, 0)
STAMP = ["prefill 0", 3, 7]

# A good body of every kind, as the processes send them, with its sender and receiver.
GOOD = {
    "msg": (ROUTER0, DECODE0, {"t": "msg", "stamp": STAMP, "request": 1, "to": DECODE,
                               "fields": [[1, 3], [13, [1, 1, 2]]], "names": ["bootstrap"],
                               "placement": [0, 0], "payload": [[5, 6, 7], 4, [2]]}),
    "write": (PREFILL0, DECODE0, {"t": "write", "request": 0, "write": [0, 1, 2, 5],
                                  "data": [0, 1], "stamp": STAMP, "placement": [0, 0]}),
    "landed": (DECODE0, ROUTER0, {"t": "landed", "request": 0, "write": [0, 1, 2, 5],
                                  "poster": STAMP, "stamp": STAMP}),
    "completed": (ROUTER0, PREFILL0, {"t": "completed", "request": 0, "write": [0, 1, 2, 5],
                                      "stamp": STAMP}),
    "down": (PREFILL0, ROUTER0, {"t": "down", "decode": 0, "stamp": STAMP}),
    "up": (PREFILL0, ROUTER0, {"t": "up", "decode": 0}),
    "crash": (ROUTER0, PREFILL0, {"t": "crash", "decode": 0, "requests": [0, 1],
                                  "stamp": STAMP}),
    "token": (DECODE0, ROUTER0, {"t": "token", "request": 1, "token": None, "last": True}),
    "pdown": (DECODE0, ROUTER0, {"t": "pdown", "prefill": 0, "stamp": STAMP, "heard": [1, 4]}),
    "restarted": (PREFILL0, ROUTER0, {"t": "restarted", "lost": [1], "stamp": STAMP}),
    "prefill_back": (ROUTER0, DECODE0, {"t": "prefill_back", "prefill": 0, "lost": [0, 1],
                                        "stamp": STAMP}),
    "leaving": (DECODE0, ROUTER0, {"t": "leaving", "holds": [1]}),
    "farewell": (ROUTER0, PREFILL0, {"t": "farewell"}),
    "bye": (ROUTER0, DECODE0, {"t": "bye"}),
    "left": (PREFILL0, ROUTER0, {"t": "left", "finished": [0, 1]}),
    "dial": (ROUTER0, PREFILL0, {"t": "dial", "decode": 0, "epoch": 2, "host": "127.0.0.1",
                                 "port": 41000}),
}


def test_every_kind_has_a_good_example_and_a_handler_where_it_goes():
    assert set(GOOD) == set(ENVELOPES)
    classes = {ROUTER: RouterProcess, PREFILL: PrefillProcess, DECODE: DecodeProcess}
    for kind, (_, receiver, _) in GOOD.items():
        assert callable(getattr(classes[receiver.role], f"on_{kind}", None)), kind


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_a_good_body_passes(kind):
    sender, receiver, body = GOOD[kind]
    assert envelope_problem(M, receiver, sender, body) == ""


def _bad(kind, **changes):
    sender, receiver, body = GOOD[kind]
    body = {k: v for k, v in {**body, **changes}.items() if v is not DROP}
    return sender, receiver, body


DROP = object()

BAD = [  # (sender, receiver, body), what the problem must say
    ((ROUTER0, DECODE0, ["t", "msg"]), "unknown envelope"),
    ((ROUTER0, DECODE0, {"t": "gossip"}), "unknown envelope 'gossip'"),
    ((ROUTER0, DECODE0, {"request": 0}), "unknown envelope"),
    (_bad("write", stamp=DROP), "a write has the fields"),
    (_bad("write", extra=1), "a write has the fields"),
    (_bad("token", request=2), "token.request must be a request"),     # M has two
    (_bad("token", request=-1), "token.request must be a request"),
    (_bad("token", request=True), "token.request must be a request"),
    (_bad("token", last="yes"), "token.last must be a bool"),
    (_bad("token", token=1.5), "token.token must be a token"),
    (_bad("landed", write=[0, 1, 2]), "landed.write must be a write"),
    (_bad("landed", write=[1, 1, 2, 5]), "a write of request 1, not 0"),
    (_bad("completed", stamp=["router 0", -1, 2]), "completed.stamp must be a stamp"),
    (_bad("crash", requests=[0, 7]), "crash.requests must be a requests"),
    (_bad("msg", to="nobody"), "msg.to must be a role"),
    (_bad("msg", to=PREFILL), "a part's message to prefill came to decode 0"),
    (_bad("msg", fields=[[99, 1]]), "msg.fields must be a pairs"),
    (_bad("msg", fields=[["client", 1]]), "msg.fields must be a pairs"),
    (_bad("msg", payload=[[1, "a"], 4]), "msg.payload must be a payload"),
    (_bad("msg", placement=[0]), "msg.placement must be a placement"),
    (_bad("write", data="bytes"), "write.data must be a data"),
    (_bad("restarted", lost=[0, 2]), "restarted.lost must be a requests"),
    (_bad("prefill_back", prefill=-1), "prefill_back.prefill must be a count"),
    (_bad("farewell", holds=[1]), "a farewell has the fields"),
]


@pytest.mark.parametrize("case, says", BAD, ids=[says for _, says in BAD])
def test_a_bad_body_is_named(case, says):
    sender, receiver, body = case
    problem = envelope_problem(M, receiver, sender, body)
    assert says in problem, problem


def test_an_envelope_in_the_wrong_direction_is_refused():
    # a decode cannot tell a prefill its write completed: that is the router's (the sequencer)
    _, _, body = GOOD["completed"]
    problem = envelope_problem(M, PREFILL0, DECODE0, body)
    assert "a completed goes from router to prefill, not decode 0 to prefill 0" in problem


def test_a_bad_envelope_drops_its_senders_connection_and_a_good_one_is_delivered():
    """On a decode's channel with the processes' check: the forger (a prefill) sends a good
    write, then one into a page beyond the pool it names; the first is delivered, the second
    declares the forger down with the reason, counted as a refused frame."""
    checked = []

    def body_problem(peer, body):
        checked.append(body["t"] if isinstance(body, dict) else body)
        return envelope_problem(M, DECODE0, peer, body)
    channel = host(body_problem=body_problem)
    forger = Forger(channel.port)
    with running(forger, channel):
        forger.hello()
        up, _ = next_event(channel, PeerUp)
        _, _, good = GOOD["write"]
        forger.message(Message(ENVELOPE, 0, {"body": good}), 1)
        delivered, _ = next_event(channel, Delivered)
        assert delivered.message.fields["body"] == good
        forger.message(Message(ENVELOPE, 0, {"body": {**good, "request": 5}}), 1)
        down, _ = next_event(channel, PeerDown)
        assert down.peer == up.peer and "envelope: write.request must be a request" in down.reason
        assert channel.counts.frames_refused == 1 and checked == ["write", "write"]
        assert forger.closed_by_peer()
