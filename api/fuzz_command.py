"""`kvproof fuzz`: the command line of the fuzzer (api/cli.py hands the subcommand here).

    kvproof fuzz [--target NAME ...] [--seed N] [--examples N | --seconds S] [--bug NAME ...]
                 [--property NAME ...] [--profile NAME] [--prefix-cache] [--itf FILE]
                 [--jobs N]
    kvproof fuzz --zoo [--target NAME ...] [--seed N] [--examples N | --seconds S] [--jobs N]
    kvproof fuzz --replay FILE

Exit status: 0 when nothing is violated (for --zoo: every entry caught and no false alarm),
1 when something is (for --replay: the saved violation reproduces), 2 for bad input, 3 when
the target itself crashed (sim/crash.py): an exception, reported with its innermost frame,
the seed, the reproduce command and the saved events, and replayed like a violation; 4
when a --zoo entry that must be caught was missed within the budget (nothing violated).
Every run prints its seed; a run given no seed draws one.
"""

from __future__ import annotations

import argparse
import sys

from api.clikit import (FUZZ_FAILURE, UsageError, plural, positive_int, process_count,
                        readable_file, sniff, writable_file, wrong_kind)
from spec.model import BUG_SWITCHES
from spec.properties import checked_by

from fuzz.profiles import PROFILES, default_profile_name
from fuzz.target import TARGET_MODULES, load_targets

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE = 0, 1, 2
from api.clikit import EXIT_CRASH, EXIT_MISSED  # noqa: E402
from sim.crash import SHELL_CRASH  # noqa: E402
EXAMPLES_DEFAULT = 200
ZOO_EXAMPLES_DEFAULT = 1000
# Time for Hypothesis to shrink one failure, and then to cut it down further (fuzz/replay.py
# minimize). A zoo cell only needs to show the catch (a sequence a person reads comes from a
# single campaign), and a zoo has a dozen catching cells per target: 20 s each made a
# 30-example zoo take minutes.
SHRINK_SECONDS_DEFAULT, MINIMIZE_SECONDS_DEFAULT = 20.0, 10.0
ZOO_SHRINK_SECONDS_DEFAULT, ZOO_MINIMIZE_SECONDS_DEFAULT = 2.0, 2.0
# A time budget runs batches this big, seeds seed, seed+1, ...; it is checked between them.
SECONDS_BATCH_EXAMPLES = 50


EXAMPLES = [
    "kvproof fuzz --seed 1                          # the core, 200 examples",
    "kvproof fuzz --target sim --bug EagerRelease --seconds 60",
    "kvproof fuzz --zoo --examples 300 --jobs 2     # every zoo entry on core and sim",
    "kvproof fuzz --zoo --target engine --seed 1 --examples 400   # data-path entries, engine",
    "kvproof fuzz --replay kvproof-fuzz-core-seed1.itf.json",
]
EXTRA = ("aliases (kept for one release): --out = --itf\n"
         "--replay FILE re-runs what a file kvproof wrote records and reports whether its "
         "verdict reproduces,\nas kvproof sim --replay LOG does for a simulator log.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(m.rsplit(".", 1)[-1].removesuffix("_target") for m in TARGET_MODULES)
    parser.add_argument("--target", action="append", default=[], metavar="NAME",
                        help=f"the system to fuzz: {names} (repeatable; default: core, or "
                             "core and sim with --zoo; engine only by name)")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="the seed (default: a fresh one, printed)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--examples", type=int, default=None, metavar="N",
                        help=f"examples to run (default {EXAMPLES_DEFAULT}; "
                             f"{ZOO_EXAMPLES_DEFAULT} per cell with --zoo)")
    budget.add_argument("--seconds", type=float, default=None, metavar="S",
                        help="run for S seconds instead (seeded batches of "
                             f"{SECONDS_BATCH_EXAMPLES} examples)")
    parser.add_argument("--bug", action="append", default=[], metavar="NAME",
                        help="turn on a bug switch (repeatable; see kvproof check --list-bugs)")
    parser.add_argument("--property", action="append", default=[], metavar="NAME",
                        help="check only these properties (repeatable; default: all, "
                             "with the page-conservation and leak oracles)")
    parser.add_argument("--profile", default=None, choices=sorted(PROFILES),
                        help="model sizes and steps per example (default: "
                             "$KVPROOF_FUZZ_PROFILE or 'default')")
    parser.add_argument("--prefix-cache", nargs="?", const="decode", default=None,
                        choices=("decode", "both"),
                        help="models with a prefix cache: prompts carry tokens and a salt "
                             "(two of each), decode hits and evicts (issue 27); 'both': the "
                             "prefill caches, hits and evicts too (the core, sim and engine "
                             "targets)")
    parser.add_argument("--shrink-seconds", type=float, default=None, metavar="S",
                        help="time Hypothesis may spend shrinking a failure (0: none; "
                             f"default {SHRINK_SECONDS_DEFAULT:g}, {ZOO_SHRINK_SECONDS_DEFAULT:g}"
                             " per cell with --zoo); not part of the --examples budget, "
                             "reported apart")
    parser.add_argument("--itf", "--out", dest="out", default=None, metavar="FILE",
                        help="where to save a failure, an ITF trace with the events (default: "
                             "kvproof-fuzz-<target>-seed<N>.itf.json; --out is the old "
                             "spelling)")
    parser.add_argument("--zoo", action="store_true",
                        help="run every bug-zoo entry on every target and print the matrix")
    parser.add_argument("--runs", type=positive_int, default=1, metavar="K",
                        help="K independent campaigns, seeds N, N+1, ..., N+K-1 (with "
                             "--examples; spread them with --jobs or --ray)")
    parser.add_argument("--jobs", type=process_count, default=1, metavar="N",
                        help="run zoo cells or --runs campaigns in N processes, at most the "
                             "CPUs (the same results as one)")
    parser.add_argument("--ray", metavar="ADDRESS", default=None,
                        help="run zoo cells or --runs campaigns on a Ray cluster (ADDRESS: "
                             "local, auto, HOST:PORT); needs the ray package")
    parser.add_argument("--replay", metavar="FILE", default=None,
                        help="re-run a saved failure and report whether it reproduces")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--list-bugs", action="store_true", help="list the bug switches")
    parser.add_argument("--list-targets", action="store_true", help="list the fuzz targets")
    parser.add_argument("--list-properties", action="store_true",
                        help="list the properties that can be checked")


def _listing(args: argparse.Namespace) -> int | None:
    from api.check_command import list_bugs, list_properties

    if args.list_bugs:
        return list_bugs()
    if args.list_properties:
        return list_properties()
    if args.list_targets:
        for name, cls in sorted(load_targets().items()):
            # A target's own docstring, or else its module's, whose first line says what it is
            doc = cls.__doc__ or sys.modules[cls.__module__].__doc__ or ""
            print(f"{name:<8}{(doc.strip().splitlines() or [''])[0]}")
        return EXIT_OK
    return None


def run(args: argparse.Namespace) -> int:
    listed = _listing(args)
    if listed is not None:
        return listed
    try:
        if args.replay:
            return _replay(args)
        base = _campaign(args)
        targets = _targets(args)
    except UsageError as error:
        print(f"kvproof fuzz: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.zoo:
        return _zoo(targets, base, args)
    worst = EXIT_OK
    for target in targets:
        worst = max(worst, _fuzz(args, base, target))
    return worst


def _campaign(args: argparse.Namespace):
    from api.check_command import unknown_properties
    from fuzz.runner import Campaign, random_seed

    unknown = [b for b in args.bug if b not in BUG_SWITCHES]
    if unknown:
        raise UsageError(f"unknown bug switch(es) {', '.join(unknown)}; see --list-bugs")
    unknown_properties(args.property)
    if (args.jobs > 1 or args.ray) and not (args.zoo or args.runs > 1):
        raise UsageError("--jobs and --ray spread the cells of --zoo or the campaigns of "
                         "--runs K; a single campaign runs in one process")
    if args.runs > 1 and (args.seconds or args.zoo):
        raise UsageError("--runs takes an --examples budget and no --zoo (a --seconds budget "
                         "already runs seeds N, N+1, ... one after another)")
    if args.ray:
        from api.campaigns import require_ray
        require_ray()
    if args.zoo and (args.bug or args.property or args.out or args.prefix_cache):
        raise UsageError("--zoo sets the switches, properties and model of each entry itself "
                         "and saves nothing; drop --bug, --property, --prefix-cache and --itf")
    if args.out:
        writable_file(args.out, "--itf")
    if args.examples is not None and args.examples < 1:
        raise UsageError(f"--examples must be at least 1, got {args.examples}")
    if args.seconds is not None and not args.seconds > 0:
        raise UsageError(f"--seconds must be positive, got {args.seconds}")
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed must be a non-negative integer, got {args.seed}")
    if args.shrink_seconds is not None and not args.shrink_seconds >= 0:
        raise UsageError(f"--shrink-seconds must be >= 0, got {args.shrink_seconds:g}")
    shrink_s = (args.shrink_seconds if args.shrink_seconds is not None else
                ZOO_SHRINK_SECONDS_DEFAULT if args.zoo else SHRINK_SECONDS_DEFAULT)
    minimize_s = ZOO_MINIMIZE_SECONDS_DEFAULT if args.zoo else MINIMIZE_SECONDS_DEFAULT
    profile = args.profile or default_profile_name()
    if profile not in PROFILES:
        raise UsageError(f"unknown profile {profile!r} (from KVPROOF_FUZZ_PROFILE); "
                         f"known: {', '.join(sorted(PROFILES))}")
    examples = args.examples or (SECONDS_BATCH_EXAMPLES if args.seconds else
                                 ZOO_EXAMPLES_DEFAULT if args.zoo else EXAMPLES_DEFAULT)
    return Campaign(bugs=frozenset(args.bug), properties=checked_by(args.property) or None,
                    profile=PROFILES[profile],
                    seed=args.seed if args.seed is not None else random_seed(),
                    examples=examples, seconds=args.seconds,
                    shrink_seconds=shrink_s, minimize_seconds=minimize_s,
                    prefix_cache=bool(args.prefix_cache),
                    prefill_cache=args.prefix_cache == "both")


def _targets(args: argparse.Namespace) -> list[str]:
    known = load_targets()
    unknown = [t for t in args.target if t not in known]
    if unknown:
        raise UsageError(f"unknown target(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    if args.prefix_cache == "both" and any(t not in ("core", "sim", "engine")
                                           for t in args.target):
        raise UsageError("--prefix-cache both runs on the core, sim and engine targets "
                         "only: the hybrid target's real workers keep no prefix cache")
    if args.target:
        return list(dict.fromkeys(args.target))
    if args.zoo:
        return sorted(name for name, cls in known.items() if cls.in_default_zoo)
    return ["core"]


def _fuzz(args: argparse.Namespace, base, target: str) -> int:
    from dataclasses import replace

    from fuzz.runner import run_campaign

    campaign = replace(base, target=target)
    if args.runs > 1:
        return _fuzz_runs(args, campaign)
    print(f"kvproof fuzz: {campaign.describe()}", flush=True)
    outcome = run_campaign(campaign, progress=None if args.quiet else _progress)
    searched = outcome.searched_examples
    print(f"{plural(searched, 'example')} in {outcome.searched_seconds:.1f} s "
          f"({searched / max(outcome.searched_seconds, 1e-9):.1f} examples/s)"
          + (f", then {plural(outcome.examples - searched, 'example')} shrinking the "
             f"failure, {outcome.shrunk_seconds:.1f} s" if outcome.caught else "")
          + f"; {plural(outcome.steps + outcome.drain_steps, 'step')} in all "
          f"({outcome.steps:,} by the rules, {outcome.drain_steps:,} by the drain), "
          f"{outcome.steps_per_second:,.0f} steps/s")
    if not outcome.caught:
        print(f"No violation (seed {campaign.seed}).")
        return EXIT_OK
    return _report_failure(args, campaign, outcome)


def _report_failure(args: argparse.Namespace, campaign, outcome) -> int:
    from fuzz.runner import format_failure

    crashed = outcome.replayed.property == SHELL_CRASH
    if crashed:
        print(f"SHELL CRASHED: the {campaign.target} target raised an exception (a bug of the "
              "shell, not a protocol violation); it is reported, shrunk and saved as one")
    print(format_failure(campaign, outcome))
    path = args.out or f"kvproof-fuzz-{campaign.target}-seed{outcome.batch_seed}.itf.json"
    try:
        _save(path, campaign, outcome)
    except OSError as error:
        print(f"kvproof fuzz: cannot save the failure to {path}: {error}", file=sys.stderr)
        return EXIT_CRASH if crashed else EXIT_VIOLATION
    print(f"Minimal failing sequence written to {path}; replay: kvproof fuzz --replay {path}")
    return EXIT_CRASH if crashed else EXIT_VIOLATION


def _fuzz_runs(args: argparse.Namespace, campaign) -> int:
    """K campaigns with consecutive seeds, as independent runs (processes or Ray); one line
    each, then the first failure in full."""
    from dataclasses import replace
    from functools import partial

    from api.campaigns import parallel_map
    from fuzz.runner import reproduce_command
    from fuzz.zoo import run_portable

    campaigns = [replace(campaign, seed=campaign.seed + k) for k in range(args.runs)]
    where = (f"Ray at {args.ray}" if args.ray else
             plural(args.jobs, "process", "processes"))
    print(f"kvproof fuzz: {args.runs} runs, seeds {campaign.seed}..{campaigns[-1].seed}, on "
          f"{where}; each: {campaign.describe()}", flush=True)
    outcomes = partial(parallel_map, jobs=args.jobs, ray_address=args.ray)(
        run_portable, campaigns)
    for run, outcome in zip(campaigns, outcomes):
        if outcome.caught:
            print(f"seed {run.seed}: FAILED after {plural(outcome.examples_to_catch, 'example')}"
                  f": {outcome.failure.violations[0]}; reproduce: "
                  f"{reproduce_command(run, outcome)}")
        else:
            print(f"seed {run.seed}: no violation in {plural(outcome.examples, 'example')}")
    failed = [(run, o) for run, o in zip(campaigns, outcomes) if o.caught]
    if not failed:
        return EXIT_OK
    return _report_failure(args, *failed[0])


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def _save(path: str, campaign, outcome) -> None:
    from fuzz import replay

    failure = outcome.failure
    saved = replay.SavedFailure(
        campaign.target, failure.setup.model, campaign.properties, outcome.minimal,
        str(outcome.replayed.violations[0]), outcome.replayed.steps, outcome.batch_seed,
        failure.setup.seed)
    replay.write(path, saved, {"examples": outcome.batch_examples,
                               "profile": campaign.profile.name,
                               "setup": failure.setup.describe()})


def _zoo(targets: list[str], base, args: argparse.Namespace) -> int:
    from functools import partial

    from api.campaigns import parallel_map
    from fuzz.zoo import format_cell, format_matrix, run_zoo

    jobs, quiet = args.jobs, args.quiet

    budget = f"{base.seconds:g} s" if base.seconds else plural(base.examples, "example")
    print(f"kvproof fuzz --zoo: targets {', '.join(targets)}; seed {base.seed}; per cell "
          f"{budget} searching, then {base.shrink_budget()}; profile {base.profile.name}"
          + (f"; Ray at {args.ray}" if args.ray else f"; {jobs} processes" if jobs > 1 else ""),
          flush=True)
    mapper = partial(parallel_map, jobs=jobs, ray_address=args.ray)
    try:
        cells = run_zoo(targets, base, mapper=mapper, progress=None if quiet else lambda cell:
                        print(f"  {cell.row.name} on {cell.target}: {format_cell(cell)}",
                              flush=True))
    except UsageError as error:
        print(f"kvproof fuzz: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(format_matrix(cells))
    bad = [c for c in cells if not c.ok]
    if bad:
        wrong = [c for c in bad if not c.missed]  # a crash or a false alarm
        if wrong:
            print("FAILED: " + "; ".join(f"{c.row.name} on {c.target}: {format_cell(c)}"
                                         for c in wrong))
        missed = [c for c in bad if c.missed]
        if missed:
            print("MISSED (not caught within the budget; nothing was violated): "
                  + "; ".join(f"{c.row.name} on {c.target}" for c in missed)
                  + ". A larger --examples or --seconds, or another --seed, may catch them.")
        if any(c.crashed for c in bad):
            return EXIT_CRASH
        return EXIT_VIOLATION if wrong else EXIT_MISSED
    print("Every zoo entry caught on every target; no false alarm.")
    return EXIT_OK


def _replay(args: argparse.Namespace) -> int:
    from fuzz import replay
    from fuzz.oracles import Checks
    from fuzz.target import TargetRefused

    given = [flag for flag, value in (("--zoo", args.zoo), ("--bug", args.bug),
                                      ("--property", args.property), ("--seed", args.seed),
                                      ("--target", args.target),
                                      ("--prefix-cache", args.prefix_cache))
             if value not in (False, [], None)]
    if given:
        raise UsageError("--replay takes the target, model, switches and properties from the "
                         f"file; it combines with no other option (drop {', '.join(given)})")
    readable_file(args.replay, f"--replay {args.replay}")
    kind = sniff(args.replay)
    if kind is not None and kind != FUZZ_FAILURE:
        raise wrong_kind(args.replay, kind, "a saved fuzz failure")
    try:
        saved = replay.load(args.replay)
    except replay.ReplayError as error:
        raise UsageError(str(error)) from None
    print(f"Replaying {len(saved.events)} events on the {saved.target} target: "
          f"{saved.model.describe()}")
    print(f"recorded: {saved.violation} after event {saved.steps}")
    try:
        found = replay.replay(saved.target, saved.model, saved.events,
                              Checks.for_properties(saved.properties), seed=saved.target_seed)
    except TargetRefused as error:
        raise UsageError(f"the {saved.target} target refuses the recorded sequence: {error} "
                         "(the protocol changed since the file was written?)") from None
    if found is None:
        print(f"No violation: every check holds after all {len(saved.events)} events.")
        return EXIT_OK
    same = str(found.violations[0]) == saved.violation and found.steps == saved.steps
    print(f"{'Reproduced' if same else 'A different violation'}: {found.violations[0]} "
          f"after event {found.steps}")
    return EXIT_CRASH if found.property == SHELL_CRASH else EXIT_VIOLATION
