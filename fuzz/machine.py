"""The rule-based state machine: the core's actions as one vocabulary, over any target.

Theory of operation
-------------------
Each example first draws a *setup*: a model at sizes the model checker cannot reach (the
ranges are a `Profile`), and a swarm. Swarm testing makes examples differ in kind, not only
in order: per example, every action of the vocabulary gets a weight (faults and timers off,
normal or in a storm; the protocol's own actions normal or rare; arrivals normal or rare),
and the example draws an allocator for the pages of Admit and Reserve (lowest free page,
least or most recently freed, random: real allocators do each, and which pages come back
when decides what stale content a reader meets), a delivery order (any in-flight move,
the oldest, or the newest first), delivery delays and a drain policy.

The vocabulary is the core's actions plus three moves of the environment's own: Wait (time
passes on a target whose components take the protocol's actions themselves, the simulator),
Delay (a request's traffic held back on the wire) and WireFault (one page write damaged,
duplicated or reordered on the wire: the engine's, fuzz/wire_faults.py). A target names the part of the
vocabulary it can ever list, and only that part is weighed.

Then Hypothesis runs the one rule, `step`: it draws an action among those with an enabled
move, as likely as its weight, then one of that action's moves (by the delivery order) and,
for an open move, its argument (the prompt length; the pages, from the allocator). The
precondition of every action is the target's list of enabled moves, so the fuzzer only
ever takes events the protocol allows. One Hypothesis rule per action would read better,
but Hypothesis's own rule-level swarm then marks about a third of the examples invalid
(with state-dependent preconditions the only valid rules are often switched off), so the
vocabulary is a table here and the swarm is explicit, printed with every failure.

At the end of each example the drain lets the requests that have not arrived yet arrive and
runs the protocol's own (fair) actions, with no more aborts or faults, until no request can
move: the fuzzer's liveness check, and a run of every request through the protocol under
the example's scheduling. A timer fires in the drain only when nothing else can move, since
timeouts stand for the passage of time. The rest invariants are checked at rest, as after
every other step.

Every step is followed by the checks of fuzz/oracles.py. A violation raises `FuzzFailure`
carrying the setup and every event taken; Hypothesis shrinks the example and re-raises the
failure of the smallest one it found.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from spec import core
from spec.model import Model

from sim import crash as shell_crash

from fuzz import oracles, wire_faults
from fuzz.oracles import Checks
from fuzz.profiles import Profile
from fuzz.target import ENVIRONMENT_FAULTS, Open, Target, Violation

# The core's actions, and the environment's own moves: Wait (time passing on a target whose
# components act on their own), Delay (a request's traffic held back on the wire) and
# WireFault (a page write hit on the wire, fuzz/wire_faults.py).
VOCABULARY = core.ACTION_NAMES + ("Wait", "Delay", wire_faults.ACTION)
TIMERS = core.TIMER_ACTIONS
POLICIES = ("lowest", "fifo", "lifo", "random")
# Which of an action's enabled moves (oldest first) a rule takes: any of them, the oldest (in
# order delivery) or the newest (everything in flight overtakes what came before: late writes,
# late final words).
ORDERS = ("any", "oldest", "newest")
# Delivery delays: none, or one move in four held back for up to this many steps after it
# becomes enabled (a slow link, a stalled worker: one message late, not all of them).
LATENCIES = (0, 30, 150)
# How the drain schedules: by the swarm's weights, or "in order": always the first enabled
# action of the core's action table, oldest move first (prefill work before decode work,
# a run-to-completion scheduler).
DRAINS = ("random", "in order")


# Swarm weights: how often an enabled action is picked, drawn per example. Each kind of
# action has levels (name -> weight) and a draw: the names a uniform draw picks from, so a
# name listed twice is twice as likely; the first is where shrinking goes, the ordinary.
# - Faults and timers (client aborts, prefill failures, timeouts, held traffic): "normal" is
#   rare, as faults are in a real system (at the protocol's rate they would end nearly every
#   request before it completes), or "off" for the whole example, or a "storm".
# - Worker crashes: the same levels, but off in most examples. A crash is enabled whenever
#   the worker holds any request, so even at "normal" it happens in most long examples,
#   and it ends every request the worker holds: the multi-fault interleavings (a late write
#   after a reuse, the incident) need examples where no worker dies.
# - The protocol's own actions: never off (one missing step of the pipeline would stall every
#   request behind it) but sometimes "rare": that is how delayed and reordered delivery arise.
# - Finish stands for a whole decode, token after token, the longest step of a request, with
#   writes, messages and faults going on around it: its "normal" is slow.
# - Arrivals: never off (an example without them tests nothing); "rare" is a light load.
LEVELS = {
    "fault": ({"normal": 1, "off": 0, "storm": 8}, ("normal", "off", "normal", "off", "storm")),
    "crash": ({"normal": 1, "off": 0, "storm": 8}, ("off", "normal", "off", "off", "storm")),
    "protocol": ({"normal": 8, "rare": 1}, ("normal", "normal", "rare")),
    "decode": ({"normal": 1, "quick": 8}, ("normal", "quick")),
    "arrival": ({"normal": 8, "rare": 1}, ("normal", "rare")),
    # A prefix cache's evictions (its policy, only on models with one): rare, so that pages
    # stay cached long enough to be hit, or off, or as often as the protocol's own steps
    # (every cached page goes soon after its last reader leaves: pool pressure).
    "evict": ({"rare": 1, "off": 0, "normal": 8}, ("rare", "off", "rare", "normal")),
}
FAULTS = core.FAULT_ACTIONS | TIMERS | ENVIRONMENT_FAULTS
WORKER_CRASHES = frozenset(cls.__name__ for cls in core._WORKER_ACTIONS)
# The drain's actions: the protocol's own, and the arrivals still to come (so that every
# example runs all its requests through the protocol; each arrives once, so it ends).
# Evictions are the cache's policy, not owed: the drain leaves cached pages for the requests
# still to come (an allocation evicts what it needs).
DRAINED = (frozenset(VOCABULARY) - core.FAULT_ACTIONS - ENVIRONMENT_FAULTS
           - core.PREFIX_CACHE_ACTIONS)

# A prefix-cache model's prompt alphabet: two token kinds and two salts (tenants). Each
# prompt is `b` pages of token 1 then token 2 to its end (`arrival`), so prompts share
# prefixes often: a prompt of all 1s is a system prompt every same-tenant prompt that
# starts with 1s hits (a full hit when it is no longer than one cached), and two prompts
# whose 1s end at the same page share everything up to the shorter's end. Two salts are
# the fewest that can be kept apart (spec/README.md, Prefix caching).
PREFIX_MODEL = dict(prefix_cache=True, tokens=2, tenants=2)


def arrival(move: Open, n: int, model: Model, pick: Callable[[int], int]) -> core.Event:
    """The Arrive of `move` with a prompt of n pages. With a prefix cache it also carries
    the prompt's tokens and salt, chosen by `pick(k)` (a choice below k), after the length:
    a model without one asks `pick` nothing more, so its examples draw what they drew."""
    if not model.prefix_cache:
        return move.close(n)
    ones = min(pick(n + 2), n)  # n + 2: a prompt of all 1s (the shared one) twice as likely
    salt = 1 + pick(model.tenants)
    return core.Arrive(move.request, n, tokens=(1,) * ones + (2,) * (n - ones), salt=salt)


def kind(action: str) -> str:
    if action == "Arrive":
        return "arrival"
    if action == "Finish":
        return "decode"
    if action in core.PREFIX_CACHE_ACTIONS:
        return "evict"
    if action in WORKER_CRASHES:
        return "crash"
    return "fault" if action in FAULTS else "protocol"


@dataclass(frozen=True)
class Setup:
    """What one example drew before its first step: the model and the swarm."""

    model: Model
    weights: tuple[tuple[str, str], ...]  # (action, level) for every swarmed action
    policy: str
    prompt_pages_max: int  # this example's longest prompt: short chats, or long documents too
    order: str = "any"
    latency_steps_max: int = 0  # 0: every enabled move can be taken at once
    drain: str = "random"
    # Seeds what the fuzzer decides without Hypothesis: the drain's choices, the delays.
    seed: int = 0

    def weight_table(self) -> dict[str, int]:
        """Every action's weight; 0 for those the target did not declare (never drawn)."""
        table = dict.fromkeys(VOCABULARY, 0)
        table.update((a, LEVELS[kind(a)][0][level]) for a, level in self.weights)
        return table

    def describe(self) -> str:
        unusual = ", ".join(f"{a} {level}" for a, level in self.weights if level != "normal")
        return (f"{self.model.describe()}; prompts up to {self.prompt_pages_max} pages; "
                f"allocation {self.policy}; delivery {self.order}; latency up to "
                f"{self.latency_steps_max} steps; drain {self.drain}; "
                f"swarm: {unusual or 'all normal'}")


def draw_setup(data, profile: Profile, bugs: frozenset[str],
               vocabulary: frozenset[str] = frozenset(VOCABULARY),
               prefix_cache: bool = False, prefill_cache: bool = False) -> Setup:
    requests = data.draw(st.integers(*profile.requests), label="requests")
    prefill = data.draw(st.integers(*profile.prefill_pages), label="prefill pages")
    decode = data.draw(st.integers(*profile.decode_pages), label="decode pages")
    # A context above the smaller pool lets over-long prompts reach the workers when the
    # startup check is off; prompts above the context exercise the router's reject.
    context = data.draw(st.integers(min(prefill, decode), max(prefill, decode) + 4),
                        label="context pages")
    model = Model(requests=requests, max_prompt_pages=context + 2, context_pages=context,
                  prefill_pages=prefill, decode_pages=decode, bugs=bugs, crashes=True,
                  decode_crashes=True, name="fuzz",
                  **(PREFIX_MODEL if prefix_cache else {}),
                  **({"prefill_cache": True} if prefill_cache else {}))
    # Actions the target can never list get no weight (and no draw); nor do the recoveries
    # from a loss, since these models lose nothing, nor a prefix cache's actions where the
    # model has none (so every seed draws what it drew before those actions existed).
    weights = tuple((a, data.draw(st.sampled_from(_levels(a, model)), label=a))
                    for a in VOCABULARY if a in vocabulary
                    and (model.losses or a not in core.LOSS_RECOVERY_ACTIONS)
                    and (model.prefix_cache or a not in core.PREFIX_CACHE_ACTIONS))
    policy = data.draw(st.sampled_from(POLICIES), label="allocation")
    prompt_pages_max = data.draw(st.integers(1, model.max_prompt_pages), label="prompt cap")
    order = data.draw(st.sampled_from(ORDERS), label="delivery")
    latency = data.draw(st.sampled_from(LATENCIES), label="latency")
    drain = data.draw(st.sampled_from(DRAINS), label="drain")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    return Setup(model, weights, policy, prompt_pages_max, order, latency, drain, seed)


def _levels(action: str, model: Model) -> tuple[str, ...]:
    """The levels an action's weight is drawn from. With a prefix cache arrivals are mostly
    rare: a hit needs a request that arrives after an earlier one with its prefix was
    accepted (its pages sealed), and requests that all arrive at once reserve before any."""
    if model.prefix_cache and action == "Arrive":
        return PREFIX_ARRIVALS
    return LEVELS[kind(action)][1]


PREFIX_ARRIVALS = ("rare", "rare", "normal")


def allocate(move: Open, policy: str, rng: random.Random | None) -> tuple[int, ...]:
    """The pages an allocator with `policy` takes for `move` (options: free-list order)."""
    need, free = move.need, move.options
    if policy == "lowest":
        return tuple(sorted(free)[:need])
    if policy == "fifo":
        return free[:need]
    if policy == "lifo":
        return free[len(free) - need:]
    assert policy == "random" and rng is not None
    return tuple(rng.sample(free, need))


@dataclass
class Recorder:
    """Counts shared by every example of a campaign (shrinking runs included)."""

    examples: int = 0
    steps: int = 0         # events the rules chose
    drain_steps: int = 0   # events the drain took
    first_failure_example: int = 0     # 0: none yet
    first_failure_clock: float = 0.0
    clock: Callable[[], float] = field(default=lambda: 0.0)

    def failed(self) -> None:
        if not self.first_failure_example:
            self.first_failure_example = self.examples
            self.first_failure_clock = self.clock()


class FuzzFailure(AssertionError):
    """A check failed: the setup, every event taken, and which of them the drain took."""

    def __init__(self, setup: Setup, trace: list[core.Event], drained: frozenset[int],
                 violations: list[Violation], target_description: str = "") -> None:
        self.setup = setup
        self.target_description = target_description
        self.trace = trace
        self.drained = drained
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations))


class FuzzMachine(RuleBasedStateMachine):
    """Base of the generated machines; `make_machine` fills in the class attributes."""

    target_factory: Callable[[], Target]
    profile: Profile
    bugs: frozenset[str]
    checks: Checks
    recorder: Recorder
    prefix_cache: bool = False
    prefill_cache: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.target = self.target_factory()
        self.setup: Setup | None = None
        self.failed = False
        self.drained: set[int] = set()  # indices in the trace of the events the drain took
        self.ready_at: dict[object, int] = {}  # move -> the step its delivery delay ends
        self.recorder.examples += 1

    @initialize(data=st.data())
    def configure(self, data) -> None:
        vocabulary = self.target.vocabulary | (self.target.prefill_cache_vocabulary
                                               if self.prefill_cache else frozenset())
        self.setup = draw_setup(data, self.profile, self.bugs, vocabulary,
                                self.prefix_cache, self.prefill_cache)
        self.weight = self.setup.weight_table()
        self._guarded(self.target.reset, self.setup.model, seed=self.setup.seed)
        self._check()

    @rule(choice=st.integers(0, 2**64 - 1))
    def step(self, choice: int) -> None:
        """Take one enabled event, the action picked by this example's swarm weights."""
        weight = self.weight
        enabled = self._ready_moves()
        offered = [(a, weight[a]) for a in enabled if weight[a]]
        if not offered:  # only delayed moves are left: time jumps to them
            enabled = self._enabled()
            offered = [(a, weight[a]) for a in enabled if weight[a]]
        if not offered:
            self._drain()  # only switched-off actions (or nothing) could move the system on
            return
        digits = Digits(choice)
        action = _weighted(digits, offered)
        moves = enabled[action]
        move = self._pick(moves, lambda: digits.below(len(moves)))
        if isinstance(move, Open):
            move = self._close(move, digits)
        self._guarded(self.target.step, move, move=move)
        self.recorder.steps += 1
        self._check()

    def _ready_moves(self) -> dict[str, list]:
        """The enabled moves whose delivery delay has passed (every one, without latency)."""
        enabled = self._enabled()
        if not self.setup.latency_steps_max:
            return enabled
        now, ready_at, ready = len(self.target.trace()), self.ready_at, {}
        for action, moves in enabled.items():
            if action == "Wait":  # time itself is never held back
                ready[action] = moves
                continue
            kept = []
            for move in moves:
                key = (move.action, move.request) if type(move) is Open else move
                when = ready_at.get(key)
                if when is None:
                    when = ready_at[key] = now + self._delay(key, now)
                if when <= now:
                    kept.append(move)
            if kept:
                ready[action] = kept
        return ready

    def _delay(self, key: object, now: int) -> int:
        """A move's delay in steps, drawn once when it becomes enabled: one move in four is
        held back. A hash rather than a Hypothesis draw, so that moves which are never
        taken cost no choices; the same in every process, so that seeds replay."""
        h = zlib.crc32(f"{self.setup.seed}:{key!r}:{now}".encode())
        return 0 if h % 4 else 1 + (h >> 8) % self.setup.latency_steps_max

    def _pick(self, moves: list, index: Callable[[], int]):
        """One move of an action, by this example's delivery order (moves: oldest first)."""
        if len(moves) == 1 or self.setup.order == "oldest":
            return moves[0]
        if self.setup.order == "newest":
            return moves[-1]
        return moves[index()]

    def _close(self, move: Open, digits: "Digits") -> core.Event:
        if move.action not in ("Arrive", "Admit", "Reserve"):  # Delay's stall, Abort's moment
            return move.close(move.options[digits.below(len(move.options))])
        if move.action == "Arrive":
            allowed = [n for n in move.options if n <= self.setup.prompt_pages_max]
            n = (allowed or move.options)[digits.below(len(allowed) or 1)]
            return arrival(move, n, self.setup.model, digits.below)
        rng = random.Random(digits.value) if self.setup.policy == "random" else None
        return move.close(allocate(move, self.setup.policy, rng))

    def teardown(self) -> None:
        if self.setup is not None and not self.failed:
            self._drain()

    def _drain(self) -> None:
        """Run every request to its end, faults off: arrivals still due and the protocol's
        fair actions, timers only when nothing else can move, until rest."""
        target, weight = self.target, self.weight
        # Seeded from the setup and the position, so that Hypothesis's replays agree.
        rng = random.Random(self.setup.seed * 1_000_003 + len(target.trace()))
        for _ in range(self.profile.drain_steps_max):
            if self._guarded(oracles.at_rest, target) and "Arrive" not in self._enabled():
                return
            # What is delayed waits, unless only delayed moves are left: then time jumps.
            enabled = self._ready_moves()
            if not any(a in DRAINED for a in enabled):
                enabled = self._enabled()
            # A fair action is owed by the protocol: "off" keeps a timer out of the rules,
            # not out of the drain.
            fair = [(a, weight[a] or 1) for a in enabled if a in DRAINED]
            preferred = [(a, w) for a, w in fair if a not in TIMERS] or fair
            if self.setup.drain == "in order":
                move = enabled[preferred[0][0]][0]
            else:
                action = rng.choices([a for a, _ in preferred], [w for _, w in preferred])[0]
                moves = enabled[action]
                move = self._pick(moves, lambda: rng.randrange(len(moves)))
            if isinstance(move, Open):
                move = (arrival(move, rng.randint(1, self.setup.prompt_pages_max),
                                self.setup.model, rng.randrange)
                        if move.action == "Arrive" else
                        move.close(allocate(move, self.setup.policy, rng)))
            self._guarded(target.step, move, move=move)
            self.drained.add(len(target.trace()) - 1)
            self.recorder.drain_steps += 1
            self._check()
        raise AssertionError(f"the drain did not reach rest in {self.profile.drain_steps_max} "
                             "steps: the protocol has a cycle")

    def _guarded(self, fn: Callable, *args, move: core.Event | None = None, **kwargs):
        """Call into the target; an exception it raises is a crashed shell, a finding
        (sim/crash.py): a FuzzFailure whose violation is the crash, with every event up to
        and including the one being taken, so that it is shrunk, saved and replayed like
        any other failure."""
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001
            self._crashed(error, move)

    def _enabled(self) -> dict[str, list]:
        """The target's moves now (a target that raises listing them has crashed too)."""
        return self._guarded(self.target.enabled)

    def _crashed(self, error: Exception, move: core.Event | None) -> None:
        trace = self.target.trace()
        if move is not None and not (trace and trace[-1] is move):
            trace.append(move)  # a target that records an event only once it is taken
        self.failed = True
        self.recorder.failed()
        raise FuzzFailure(self.setup, trace, frozenset(self.drained),
                          [shell_crash.as_violation(error)], self.target.describe()) from error

    def _check(self) -> None:
        try:
            violations = oracles.check(self.checks, self.setup.model, self.target)
        except Exception as error:  # noqa: BLE001  an oracle reading a broken target
            self._crashed(error, None)
        if violations:
            self.failed = True
            self.recorder.failed()
            raise FuzzFailure(self.setup, self.target.trace(), frozenset(self.drained),
                              violations, self.target.describe())


class Digits:
    """Successive choices read off one drawn integer, by division. One Hypothesis draw per
    step instead of three or four: each draw costs more than a step of the core. Shrinking
    the integer toward 0 shrinks every choice toward the first option."""

    def __init__(self, value: int) -> None:
        self.value = value

    def below(self, n: int) -> int:
        self.value, digit = divmod(self.value, n)
        return digit


def _weighted(digits: Digits, offered: list[tuple[str, int]]) -> str:
    """One of the offered actions, each as likely as its weight."""
    if len(offered) == 1:
        return offered[0][0]
    ticket = digits.below(sum(w for _, w in offered))
    for action, w in offered:
        if ticket < w:
            return action
        ticket -= w
    raise AssertionError("unreachable: the ticket is below the total weight")


def make_machine(target_factory: Callable[[], Target], profile: Profile,
                 bugs: frozenset[str], checks: Checks, recorder: Recorder,
                 prefix_cache: bool = False, prefill_cache: bool = False) -> type:
    """A machine class for one campaign: the vocabulary's rules over one target (with
    prefix_cache, on models with a prefix cache; with prefill_cache, at the prefill too)."""
    namespace = dict(target_factory=staticmethod(target_factory), profile=profile,
                     bugs=frozenset(bugs), checks=checks, recorder=recorder,
                     prefix_cache=prefix_cache, prefill_cache=prefill_cache)
    return type(f"Fuzz_{getattr(target_factory, 'name', 'target')}", (FuzzMachine,), namespace)
