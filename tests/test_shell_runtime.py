"""The one runtime (spec/runtime.py) in a world of recording fakes: every command of the
core's answer reaches the interface spec/interfaces.py names for it, at the request's
placement, and nothing else of a world is touched. A new worker kind or transport is
exactly such an object."""

from __future__ import annotations

from spec.runtime import ShellRuntime
from spec import commands as cmd
from spec import core
from spec.model import Model, ProtocolConfig
from spec.store import Store


class Recorder:
    """Any interface: each call is recorded as (who, method, args)."""

    def __init__(self, who: str, calls: list) -> None:
        self.who, self.calls = who, calls

    def __getattr__(self, method):
        return lambda *args: self.calls.append((self.who, method, args))


class FakeWorld(ShellRuntime):
    def __init__(self) -> None:
        self.calls: list = []
        self.core_model = Model.for_shell(ProtocolConfig(4, 8, 8, frozenset()), 4,
                                          crashes=False, decode_crashes=False)
        self.store = Store(self.core_model, 2, 2)
        self.clock = Recorder("clock", self.calls)
        self.clock.now = lambda: 0.0
        self.prefill_at = [Recorder(f"prefill-{k}", self.calls) for k in range(2)]
        self.decode_at = [Recorder(f"decode-{k}", self.calls) for k in range(2)]
        self.link = Recorder("link", self.calls)
        self.client = Recorder("client", self.calls)
        self.event_log = Recorder("log", self.calls)
        self.on_commit = None
        self.refusals: list = []
        self._start_runtime()

    def refused(self, refusal) -> None:
        self.refusals.append(refusal.reason)

    def commit(self, now, r, change, event):
        self.store.check_observation(r, event)
        self.store.commit(r, change)
        return self.store.placement[r]

    def want(self, r, worker, what) -> None:
        self.calls.append(("wants", worker, (r, what)))


def test_each_command_goes_to_its_interface_at_the_request_s_placement():
    world = FakeWorld()

    def took(event) -> list:
        world.calls.clear()
        assert world.take_event(event) is not None
        assert world.calls[0] == ("log", "record", (0.0, event) + world.store.placement[0])
        return world.calls[1:]

    world.take_arrival(core.Arrive(0, 2), 1, 0)  # prefill 1, decode 0
    assert world.calls[1:] == [("link", "send", (0, core.BOOTSTRAP, 1, 0)),
                               ("prefill-1", "queue_request", (0,))]
    assert took(core.Reserve(0, world.store.allocate("decode", 0, 2))) == [
        ("clock", "arm", (0,)), ("link", "send", (0, cmd.PAGE_TABLE, 1, 0))]
    assert took(core.Admit(0, world.store.allocate("prefill", 1, 2))) == [
        ("clock", "renew", (0, core.Admit, 1)), ("prefill-1", "compute", (0,))]
    assert took(core.Abort(0)) == [("client", "gone", (0, 1, 0))]


def test_a_refusal_changes_nothing_and_is_counted():
    world = FakeWorld()
    world.take_arrival(core.Arrive(0, 2), 0, 0)
    world.calls.clear()
    assert world.take_event(core.Finish(0, True)) is None
    assert world.calls == [] and len(world.refusals) == 1
    assert world.take_event(core.Finish(0, True), count_refusal=False) is None
    assert len(world.refusals) == 1


def test_a_refused_arrival_leaves_no_placement():
    world = FakeWorld()
    assert world.take_arrival(core.Arrive(0, 9), 0, 1) is None  # longer than the context
    assert 0 not in world.store.placement and world.refusals
