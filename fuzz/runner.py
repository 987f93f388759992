"""Fuzz campaigns: run the machine under a budget, with a seed, and report what it found.

A campaign is one target, one set of bug switches, the properties to check, a profile and a
budget (a number of examples, or seconds). Budgets in seconds run in batches of examples,
batch k with seed `seed + k`, so that every failure names the one batch that reproduces it
(`--seed S --examples N`); a budget in examples is one batch. The Hypothesis example
database is off, so a campaign never depends on an earlier run, and Hypothesis's mining of
constants from imported modules is off, so a seed generates the same examples in any
process (fuzz/shims.py).

When an example fails, Hypothesis shrinks it (for at most `shrink_seconds`: Hypothesis has no
setting for that, see fuzz/shims.py) and raises the failure of the smallest example;
the runner then cuts the event sequence down with fuzz/replay.py's `minimize` and replays
the result once more, so that what is printed and saved is known to fail.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import HealthCheck, Phase, Verbosity, seed as hypothesis_seed, settings
from hypothesis.stateful import run_state_machine_as_test

from spec import core

from fuzz.machine import FuzzFailure, Recorder, make_machine
from fuzz.oracles import Checks
from fuzz.profiles import PROFILES, Profile
from fuzz.replay import Replayed, minimize
from fuzz.shims import same_draws_in_every_process, shrink_seconds_max
from fuzz.target import TARGETS, load_targets

load_targets()


@dataclass(frozen=True)
class Campaign:
    target: str = "core"
    bugs: frozenset[str] = frozenset()
    properties: tuple[str, ...] | None = None  # None: every property and oracle
    profile: Profile = PROFILES["default"]
    seed: int = 0
    examples: int | None = 200        # the budget in examples, or per batch with `seconds`
    seconds: float | None = None      # the budget in seconds (batches of `examples`)
    shrink_seconds: float = 20.0      # Hypothesis shrinking; 0: no shrinking
    minimize_seconds: float = 10.0    # cutting the shrunk sequence down
    prefix_cache: bool = False        # models with a decode-side prefix cache (issue 27)
    prefill_cache: bool = False       # ... and a prefill-side one (core and sim targets)

    def __post_init__(self) -> None:
        assert self.target in TARGETS, f"unknown target {self.target}"
        assert self.examples is None or self.examples >= 1
        assert self.seconds is None or self.seconds > 0
        assert self.examples is not None or self.seconds is not None
        assert self.prefix_cache or not self.prefill_cache, "a prefill cache needs prefix_cache"

    def describe(self) -> str:
        budget = (f"{self.seconds:g} s in batches of {self.examples} examples" if self.seconds
                  else f"{self.examples} examples")
        bugs = ", ".join(sorted(self.bugs)) or "none"
        props = ", ".join(self.properties) if self.properties else "all"
        cache = ("; prefix cache at decode and prefill" if self.prefill_cache else
                 "; prefix cache" if self.prefix_cache else "")
        return (f"target {self.target}, seed {self.seed}, {budget}, then "
                f"{self.shrink_budget()}; profile {self.profile.name}{cache}; bugs: {bugs}; "
                f"properties: {props}")

    def shrink_budget(self) -> str:
        """What a failure found may cost on top of the budget, as the headers print it."""
        if not self.shrink_seconds:
            return f"no shrinking (cutting a failure down at most {self.minimize_seconds:g} s)"
        return (f"shrinking a failure at most {self.shrink_seconds:g} s + cutting it down "
                f"at most {self.minimize_seconds:g} s")


@dataclass
class Outcome:
    campaign: Campaign
    examples: int = 0               # examples run, shrinking included
    steps: int = 0                  # events chosen by the rules
    drain_steps: int = 0            # events taken by the drain
    seconds: float = 0.0
    examples_to_catch: int = 0      # 0: nothing caught
    seconds_to_catch: float = 0.0
    minimize_seconds: float = 0.0   # cutting the shrunk failure down (not in `seconds`)
    batch_seed: int | None = None   # the seed of the batch that failed
    batch_examples: int = 0
    failure: FuzzFailure | None = None           # as Hypothesis shrank it
    minimal: list[core.Event] = field(default_factory=list)
    replayed: Replayed | None = None             # the minimal sequence's violation

    @property
    def caught(self) -> bool:
        return self.failure is not None

    @property
    def searched_examples(self) -> int:
        """The examples that looked for a failure: up to the first one caught, or all;
        the rest were Hypothesis shrinking it, and are not part of the --examples budget."""
        return self.examples_to_catch if self.caught else self.examples

    @property
    def searched_seconds(self) -> float:
        return self.seconds_to_catch if self.caught else self.seconds

    @property
    def shrunk_seconds(self) -> float:
        """Time spent on a failure once caught: Hypothesis shrinking it, then cutting it down."""
        return (self.seconds - self.seconds_to_catch + self.minimize_seconds
                if self.caught else 0.0)

    @property
    def examples_per_second(self) -> float:
        return self.examples / max(self.seconds, 1e-9)

    @property
    def steps_per_second(self) -> float:
        return (self.steps + self.drain_steps) / max(self.seconds, 1e-9)


@dataclass
class _AnnouncingRecorder(Recorder):
    """A Recorder that says when the first failure is found: shrinking it can take many
    seconds, and without a line a user cannot tell a shrinking run from a hung one."""

    announce: Callable[[str], None] | None = None
    shrink_seconds: float = 0.0

    def failed(self) -> None:
        first = not self.first_failure_example
        super().failed()
        if first and self.announce is not None:
            shrinking = (f"; shrinking it (at most {self.shrink_seconds:g} s) ..."
                         if self.shrink_seconds else "")
            self.announce(f"found a failure after {self.examples:,} "
                          f"example{'s' if self.examples != 1 else ''}{shrinking}")


def random_seed() -> int:
    """A fresh seed for a run that was given none (it is printed, so the run replays)."""
    return random.SystemRandom().randrange(2**31)


def run_campaign(c: Campaign, progress: Callable[[str], None] | None = None) -> Outcome:
    """Run the campaign; `progress` is told, one line at a time, when a failure is found
    and while it is being cut down."""
    recorder = _AnnouncingRecorder(clock=time.perf_counter, announce=progress,
                                   shrink_seconds=c.shrink_seconds)
    outcome = Outcome(c)
    start = time.perf_counter()
    batch = 0
    while True:
        batch_seed = c.seed + batch
        failure = _run_batch(c, batch_seed, recorder)
        if failure is not None:
            outcome.failure, outcome.batch_seed = failure, batch_seed
            outcome.batch_examples = c.examples
            break
        batch += 1
        if c.seconds is None or time.perf_counter() - start >= c.seconds:
            break
    outcome.seconds = time.perf_counter() - start
    outcome.examples, outcome.steps = recorder.examples, recorder.steps
    outcome.drain_steps = recorder.drain_steps
    if outcome.failure is not None:
        outcome.examples_to_catch = recorder.first_failure_example
        outcome.seconds_to_catch = recorder.first_failure_clock - start
        if progress is not None:
            progress(f"shrunk to {len(outcome.failure.trace)} events; cutting the sequence "
                     f"down (at most {c.minimize_seconds:g} s) ...")
        cut_start = time.perf_counter()
        _minimize(c, outcome)
        outcome.minimize_seconds = time.perf_counter() - cut_start
    return outcome


def _run_batch(c: Campaign, batch_seed: int, recorder: Recorder) -> FuzzFailure | None:
    checks = Checks.for_properties(c.properties)
    machine = make_machine(TARGETS[c.target], c.profile, c.bugs, checks, recorder,
                           c.prefix_cache, c.prefill_cache)
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if c.shrink_seconds else [])
    options = settings(max_examples=c.examples, database=None, deadline=None,
                       stateful_step_count=c.profile.steps_max, phases=phases,
                       suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                       verbosity=Verbosity.quiet, print_blob=False)
    try:
        with shrink_seconds_max(c.shrink_seconds), same_draws_in_every_process():
            run_state_machine_as_test(hypothesis_seed(batch_seed)(machine), settings=options)
    except FuzzFailure as failure:
        return failure
    return None


def _minimize(c: Campaign, outcome: Outcome) -> None:
    failure = outcome.failure
    checks = Checks.for_properties(c.properties)
    outcome.minimal, outcome.replayed = minimize(
        c.target, failure.setup.model, failure.trace, checks,
        failure.violations[0].property, c.minimize_seconds, failure.setup.seed)


def reproduce_command(c: Campaign, outcome: Outcome) -> str:
    """Every option that changes what the campaign draws or checks: the target, the batch's
    seed and size, the profile, the switches and the properties."""
    bugs = "".join(f" --bug {b}" for b in sorted(c.bugs))
    properties = "".join(f" --property {p}" for p in c.properties or ())
    seed = outcome.batch_seed if outcome.batch_seed is not None else c.seed
    examples = outcome.batch_examples or c.examples
    cache = (" --prefix-cache both" if c.prefill_cache else
             " --prefix-cache" if c.prefix_cache else "")
    return (f"kvproof fuzz --target {c.target} --seed {seed} --examples "
            f"{examples} --profile {c.profile.name}{cache}{bugs}{properties}")


def format_failure(c: Campaign, outcome: Outcome) -> str:
    """The failure as a person reads it: seed, setup, the minimal sequence, the violation."""
    failure, m = outcome.failure, outcome.failure.setup.model
    lines = [f"FAILED after {outcome.examples_to_catch} "
             f"example{'s' if outcome.examples_to_catch != 1 else ''} "
             f"({outcome.seconds_to_catch:.1f} s): {failure.violations[0]}",
             f"  seed {outcome.batch_seed}; reproduce: {reproduce_command(c, outcome)}",
             f"  example: {failure.setup.describe()}"]
    if failure.target_description:
        lines.append(f"  {failure.target_description}")
    lines += [
             f"  Hypothesis shrank it to {len(failure.trace)} events "
             f"({len(failure.drained)} by the drain); minimal interleaving, "
             f"{len(outcome.minimal)} events:"]
    lines += [f"    {k + 1:3}. {event.label(m)}" for k, event in enumerate(outcome.minimal)]
    if outcome.replayed.story:
        lines.append(f"  what the {c.target} did meanwhile (simulated time, protocol events):")
        lines += [f"    {line}" for line in outcome.replayed.story]
    lines += [f"  violated after event {outcome.replayed.steps}: {v}"
              for v in outcome.replayed.violations]
    return "\n".join(lines)
