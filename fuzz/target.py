"""What the fuzzer drives: a target, behind one small interface.

A target is anything that runs the KV transfer protocol and can be told which protocol event
to take next: the pure core (fuzz/core_target.py), the simulator, later the engine. The
fuzzer never decides protocol questions itself. It asks the target which events are enabled,
picks one, and hands it back; after every step it checks the target's protocol state
against spec/properties.py and the target's *own* observations (page owners, what decode
read) against oracles that do not trust the core's bookkeeping (fuzz/oracles.py).

The vocabulary is spec/core.py's events. Three kinds of event need an argument the protocol
leaves open, and the fuzzer chooses it: the prompt length of an Arrive and the pages of an
Admit or Reserve. A target lists those as `Open` moves.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

from spec import core
from spec.model import Model
from spec.properties import Violation  # noqa: F401  (the one violation type; re-exported)

from fuzz import wire_faults


@dataclass(frozen=True, slots=True)
class Open:
    """An enabled action whose argument the fuzzer picks.

    Arrive: `options` are the prompt lengths allowed; `need` is 0.
    Admit / Reserve: `options` are the free pages in the order the pool freed them (least
    recently freed first, never-used pages first of all, ascending); pick `need` of them.
    Delay: `options` are the stalls allowed, in the target's time; `need` is 0.
    Abort (the simulator, a decoding request): `options` are moments in the last decode step
    of its answer, in thousandths of the way into it (0: now); `need` is 0.
    """

    action: str
    request: int
    need: int
    options: tuple[int, ...]

    def close(self, choice: int | tuple[int, ...]) -> core.Event:
        if self.action == "Arrive":
            return core.Arrive(self.request, choice)
        if self.action == "Delay":
            return Delay(self.request, choice)
        if self.action == "Abort":
            return core.Abort(self.request) if choice == 0 else MidStep(self.request, choice)
        cls = core.Admit if self.action == "Admit" else core.Reserve
        return cls(self.request, tuple(sorted(choice)))


def listed(event: core.Event, moves) -> bool:
    """Is `event` one of `moves` (a target's enabled moves of its action): the move itself,
    or an Open move of the same request whose options hold the argument the fuzzer chose
    (Arrive's prompt pages, Delay's stall, a MidStep's moment; a plain Abort is moment 0)?"""
    return any(event == move or (type(move) is Open and event.request == move.request
                                 and _argument(event) in move.options)
               for move in moves)


def _argument(event: core.Event) -> int:
    kind = type(event)
    if kind is core.Arrive:
        return event.prompt_pages
    if kind is Delay:
        return event.stall
    return event.at_permille if kind is MidStep else 0


@dataclass(frozen=True, slots=True)
class Wait(core.Event):
    """Time passes until the target takes its next protocol event on its own (an environment
    move, not a core action: the simulator's components act in simulated time)."""


@dataclass(frozen=True, slots=True)
class Delay(core.RequestEvent):
    """Everything of the request on the wire now (writes, messages) is held back for `stall`:
    a stalled queue pair, a congested path (a fault; not a core action). The stall is in the
    target's own time: milliseconds on the simulator, steps (events) on the core."""

    stall: int

    def label(self, m=None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        return f"Delay({name}, {self.stall})"


@dataclass(frozen=True, slots=True)
class MidStep(core.RequestEvent):
    """The client disconnects inside the last decode step of its answer, `at_permille`
    thousandths of the way from its start (from now, if it is under way already) to its
    end, rather than at the last protocol event (a fault; the
    simulator's). A real client goes away at any moment; one that goes away just before
    its answer's last token races the Finish that step commits against decode's notice
    that the client has gone. The core's event is Abort, so it is weighed as one."""

    at_permille: int  # 1..999

    @property
    def action(self) -> str:
        return "Abort"

    def label(self, m=None) -> str:
        name = m.request_names[self.request] if m else f"r{self.request + 1}"
        return f"Abort({name}, {self.at_permille / 10:g}% into its last decode step)"


@dataclass(frozen=True, slots=True)
class AtWorker(core.Event):
    """A worker fault on a target with several workers of a kind: the core's event (which
    names no worker, the spec having one of each) and the worker it hits."""

    event: core.Event  # core.PrefillCrash() or core.DecodeCrash()
    worker: int

    @property
    def action(self) -> str:
        return self.event.action

    def label(self, m=None) -> str:
        kind = "prefill" if type(self.event) is core.PrefillCrash else "decode"
        return f"{self.event.action}({kind} {self.worker + 1})"


Move = Union[core.Event, Open]
# Every move's type by name: the core's events and the environment's own moves.
MOVE_TYPES = {**core.EVENT_TYPES, "Wait": Wait, "Delay": Delay, **wire_faults.MOVE_TYPES}
# The environment's moves that are faults: never owed, never taken by the drain.
ENVIRONMENT_FAULTS = frozenset({"Delay", wire_faults.ACTION})


@dataclass(frozen=True, slots=True)
class PoolView:
    """One KV pool as the target's own bookkeeping sees it."""

    name: str
    owners: tuple[int, ...]            # per page: the owning request, -1 when free
    held: tuple[tuple[int, ...], ...]  # per request: the pages it believes it holds


@dataclass(frozen=True, slots=True)
class Observation:
    """What a target can say about itself without the core's verdicts (no LEAKED flag)."""

    pools: tuple[PoolView, ...]
    writes: tuple[tuple[int, int], ...]   # in flight: (request, decode page)
    outcomes: tuple[str, ...]             # per request: the client's state (core.CLIENT_NAMES)
    # Per request that finished decoding: the writer of each page decode read, recovered
    # from the canary the writer left in the page.
    reads: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    # Per request decoding now whose reads pass the tag check: the writer of each page, that
    # is what its next read returns. A real decode reads at every token between taking the
    # KV and answering, so any of those moments is a read.
    decoding: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    # With a prefix cache, pages are shared, so `reads` and `decoding` hold the content
    # identity of each page read rather than its writer, and this holds, per request, the
    # identity each of its pages must have: (its salt, its tokens up to the page), the
    # spec's TrueIdent, from what the client sent. Empty without a prefix cache: there a
    # request must read only what it wrote itself.
    expected: Mapping[int, tuple] = field(default_factory=dict)


def read_field(m) -> int:
    """What a read of a decode page returns to the oracle: the content identity of its KV
    with a prefix cache (a shared page was written by whoever first computed that prefix),
    else its writer's canary."""
    return core.KV if m is not None and m.prefix_cache else core.DATA


def owned_pages(row, decode_pool, r: int) -> tuple[int, ...]:
    """The pages of r's table that r holds as their owner: all of them, but those it reads
    from the prefix cache (shared, owned by nobody, r among their readers)."""
    return tuple(p for p, _ in row[core.TABLE] if r not in decode_pool[p][core.READERS])


def owned_sources(row, prefill_pool, r: int) -> tuple[int, ...]:
    """The source pages of r that r holds as their owner: all of them, but those it reads
    from the prefill's own cache (shared, owned by nobody, r among their readers)."""
    return tuple(p for p in row[core.SRC] if r not in prefill_pool[p][core.P_READERS])


def expected_reads(m, rows) -> dict[int, tuple]:
    """Per request that arrived with tokens, the identity of each of its pages
    (core.true_ident, the spec's definition: its salt and its tokens up to the page); empty
    without a prefix cache."""
    if m is None or not m.prefix_cache:
        return {}
    return {r: tuple(core.true_ident(row, i) for i in range(1, len(row[core.TOKENS]) + 1))
            for r, row in enumerate(rows) if row[core.TOKENS]}


def decoding_reads(rows, decode_pool, m) -> dict[int, tuple]:
    """Per request decoding now, what its next read returns page by page (read_field: the
    writer, or with a prefix cache the content identity), when every page's tag matches the
    generation decode reserved it at and the identity the request's own tokens and salt
    imply (core.row_tags_match, the spec's TagsMatch; else the read fails the request, as
    core.finish does, and returns nothing)."""
    found, read = {}, read_field(m)
    for r, row in enumerate(rows):
        if row[core.DST] == core.DECODING and core.row_tags_match(m, decode_pool, row):
            found[r] = tuple(decode_pool[p][read] for p, _ in row[core.TABLE])
    return found


class TargetRefused(AssertionError):
    """The target refused an event it had listed as enabled: a bug in the target or fuzzer."""


class Target(abc.ABC):
    """One system under test. Subclasses register themselves in TARGETS."""

    name = "abstract"
    # The actions (move names) the target can ever list: the swarm weighs only these.
    vocabulary: frozenset[str] = frozenset()
    # Actions it lists only on models whose prefill caches too (added to the vocabulary
    # there alone, so that every seed of the other models draws what it drew before).
    prefill_cache_vocabulary: frozenset[str] = frozenset()
    # Protocol events the core accepted, over every instance of the class (benchmarks).
    events_committed = 0
    # Whether `kvproof fuzz --zoo` runs it when no --target is named (the engine needs
    # torch and is two orders of magnitude slower per step: it is asked for by name).
    in_default_zoo = True

    @abc.abstractmethod
    def reset(self, model: Model, seed: int) -> None:
        """Start over on `model`; `seed` drives any randomness of the target's own."""

    @abc.abstractmethod
    def enabled(self) -> Mapping[str, Sequence[Move]]:
        """Every enabled move, by action name; actions with no enabled move are absent.
        Each action's moves are listed oldest first: in the order they became enabled."""

    @abc.abstractmethod
    def step(self, event: core.Event) -> None:
        """Take one enabled event; raise TargetRefused if the target does not allow it."""

    @abc.abstractmethod
    def protocol_state(self) -> core.State:
        """The protocol core's state (a shell's core state, for sim and engine)."""

    @abc.abstractmethod
    def observe(self) -> Observation:
        """The target's own view of pools, writes, outcomes and reads."""

    @abc.abstractmethod
    def trace(self) -> list[core.Event]:
        """Every event taken since reset, in order."""

    def check(self) -> list[Violation]:
        """Checks of the target's own beyond the shared oracles (runtime guards, say), named
        after the spec property or oracle they check."""
        return []

    def describe(self) -> str:
        """What the target drew from its seed, for failure reports ('' when nothing)."""
        return ""

    def story(self) -> list[str]:
        """What the target did on its own since reset, a line per event ([] when it only
        takes the fuzzer's events)."""
        return []

    def holding(self) -> bool:
        """Whether a Delay holds traffic on the wire now: a protocol step is then only
        postponed, not missing (the quiet check must not mistake it for a stall)."""
        return False

    def only_timers_pending(self) -> bool:
        """Whether everything the target would still do on its own (its `Wait`) is fire a
        transfer timer: then the protocol is quiet although Wait is listed (a target
        without Wait: never)."""
        return False

    def data_faulted(self) -> frozenset[int]:
        """The requests whose data a fault of the target's own damaged (fuzz/wire_faults.py:
        their guard errors are that fault's outcome, not a guard tripping without cause)."""
        return frozenset()

    def pair_model(self) -> Model:
        """The model of one prefill/decode worker pair, whose pools the core's decisions
        are made against (the campaign's model, unless the target splits its pools)."""
        return self.model


# Target name -> a factory. A target module registers itself with @register on import;
# load_targets imports the modules listed here (the simulator and the engine join the list).
TARGETS: dict[str, Callable[[], Target]] = {}
TARGET_MODULES = ("fuzz.core_target", "fuzz.sim_target", "fuzz.engine_target", "fuzz.hybrid")


def load_targets() -> dict[str, Callable[[], Target]]:
    for module in TARGET_MODULES:
        importlib.import_module(module)
    return TARGETS


def register(name: str) -> Callable[[type[Target]], type[Target]]:
    def add(cls: type[Target]) -> type[Target]:
        cls.name = name
        TARGETS[name] = cls
        return cls
    return add
