"""`kvproof check`, `kvproof validate` and `kvproof conformance`: the model-checking side.

Every failure path that is the user's doing (a model, switch or property that does not
exist, a file that cannot be read or written) raises UsageError, CfgError or ModelError
before any work starts; api/cli.py prints it as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from api.clikit import (ENGINE_LOG, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, EXIT_VIOLATION,
                        PART_LOG, ITF_TRACE, FUZZ_FAILURE, SIM_LOG, UsageError, plural, readable_file, sniff, writable_file,
                        wrong_kind)
from spec.check.cfgfile import CfgError, load, model_description, model_names
from spec.check.report import (describe_model, format_coverage, format_summary, format_trace,
                               symmetry_words)
from spec.model import BUG_SWITCHES, ModelError
from spec.properties import (ALL_INVARIANTS, LIVENESS, PROPERTY_NAMES, QUIET_INVARIANTS,
                             REST_INVARIANTS, STATE_INVARIANTS, STEP_PROPERTIES, checked_by)


# `kvproof check` without --model: the default model, then the models with crashes. The
# default model with both kinds of crash has 8,133,422 states (about 9 minutes here), so
# the crash models are checked as they are: crash (the default model's constants, prefill
# crashes) and decode-crash (two smaller pools, both workers crash). Then timely: the
# default model with timely timers (decode's lease), where no request that fits may be
# failed by a timer. One exit status.
HEADLINE_MODELS = ("default", "crash", "decode-crash", "timely")


@dataclass
class Plan:
    """What a check run will do, decided (and validated) before it starts."""
    cfg: object
    model: object
    invariants: tuple[str, ...]
    liveness: bool
    symmetry: bool


def _with_bug_flags(model, bugs: list[str]):
    """The model with the --bug switches added; an unknown switch is the user's error."""
    unknown = [b for b in bugs if b not in BUG_SWITCHES]
    if unknown:
        raise UsageError(f"unknown bug switch(es) {', '.join(unknown)}; see --list-bugs")
    return model.with_bugs(model.bugs | set(bugs)) if bugs else model


def _properties(cfg, requested: list[str]) -> tuple[tuple[str, ...], bool]:
    """The invariants to check and whether liveness is checked, from the cfg or the flags."""
    if requested:
        unknown_properties(requested)
        return checked_by(requested), any(n in LIVENESS for n in requested)
    known = set(ALL_INVARIANTS) | set(STEP_PROPERTIES)
    names = list(cfg.invariants)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CfgError(f"{cfg.path}: invariant(s) {', '.join(unknown)} are not known to the "
                       f"Python checker; known: {', '.join(sorted(known))}")
    for prop in cfg.properties:
        if prop in STEP_PROPERTIES:  # an action property: checked on every edge
            names.append(prop)
            continue
        if prop not in LIVENESS:
            raise CfgError(f"{cfg.path}: property {prop} is not known; known: "
                           f"{', '.join(sorted(LIVENESS) + sorted(STEP_PROPERTIES))}")
        if LIVENESS[prop] not in names:
            names.append(LIVENESS[prop])
    return tuple(names), any(prop in LIVENESS for prop in cfg.properties)


def unknown_properties(requested: list[str]) -> None:
    """Refuse a --property name that is not in --list-properties (one list for every
    subcommand: spec/properties.py's PROPERTY_NAMES)."""
    unknown = [n for n in requested if n not in PROPERTY_NAMES]
    if unknown:
        raise UsageError(f"unknown propert{'y' if len(unknown) == 1 else 'ies'} "
                         f"{', '.join(unknown)}; see --list-properties")


def tlc_lists(cfg, invariants: tuple[str, ...], liveness: bool):
    """What the cfg kvproof writes for TLC lists: the state invariants under INVARIANTS; the
    liveness and step (action) properties under PROPERTIES, as the shipped file has them."""
    properties = tuple(p for p in cfg.properties
                       if p in STEP_PROPERTIES and p in invariants or p in LIVENESS and liveness)
    return tuple(n for n in invariants if n not in STEP_PROPERTIES), properties


def _progress(distinct: int, generated: int, depth: int, seconds: float) -> None:
    print(f"Progress: {distinct:,} distinct states, {generated:,} generated, depth {depth}, "
          f"{distinct / max(seconds, 1e-9):,.0f} distinct states/s, {seconds:.0f} s",
          file=sys.stderr, flush=True)


# -- listings ----------------------------------------------------------------------------

def list_bugs() -> int:
    width = max(len(name) for name in BUG_SWITCHES)
    for name, (guard, what, seen) in BUG_SWITCHES.items():
        print(f"{name:<{width}}  {what} [guard: {guard}; {seen}]")
    return EXIT_OK


def list_models() -> int:
    """Each model's name, size and what it is for, one line each."""
    rows = []
    for name in model_names():
        _, m = load(name)
        size = f"{plural(m.requests, 'request')}, decode pool {plural(m.decode_pages, 'page')}"
        rows.append((name, size, model_description(name)))
    name_width = max(len(r[0]) for r in rows)
    size_width = max(len(r[1]) for r in rows)
    for name, size, what in rows:
        print(f"{name:<{name_width}}  {size:<{size_width}}  {what}")
    return EXIT_OK


def list_properties() -> int:
    for name in STATE_INVARIANTS:
        print(f"{name:<20} invariant, checked in every state")
    for name in REST_INVARIANTS:
        print(f"{name:<20} invariant, checked in every state where no fair action is enabled")
    for name in QUIET_INVARIANTS:
        print(f"{name:<20} invariant, checked where nothing but a timer could move on")
    for name in STEP_PROPERTIES:
        print(f"{name:<20} step (action) property, checked on every transition")
    for name, invariant in LIVENESS.items():
        print(f"{name:<20} liveness, decided by acyclicity and {invariant}")
    return EXIT_OK


# -- check -------------------------------------------------------------------------------

def _plan(args: argparse.Namespace) -> Plan:
    for flag, path in (("--itf", args.itf), ("--json", args.json),
                       ("--dump-dot", args.dump_dot)):
        if path:
            writable_file(path, flag)
    if args.simulate and (args.workers > 1 or args.tlc):
        raise UsageError("--simulate runs in one process and without TLC; drop --workers "
                         "and --tlc")
    if not args.simulate and args.seed is not None:
        raise UsageError("--seed is for --simulate (breadth-first checking draws nothing)")
    cfg, model = load(args.model)
    symmetry = args.symmetry or cfg.symmetry is not None
    if args.orbit_states and (args.simulate or not symmetry):
        raise UsageError("--orbit-states counts the states behind the orbits of an exhaustive "
                         "search with symmetry: add --symmetry, drop --simulate")
    model = _with_bug_flags(model, args.bug)
    invariants, liveness = _properties(cfg, args.property)
    return Plan(cfg, model, invariants, liveness, symmetry)


def reproduce_command(args: argparse.Namespace, seed: int | None = None) -> str:
    """The command that reruns this check with every option that changes its verdict."""
    words = ["kvproof", "check", "--model", args.model]
    for bug in args.bug:
        words += ["--bug", bug]
    for prop in args.property:
        words += ["--property", prop]
    if args.symmetry:
        words.append("--symmetry")
    if args.simulate:
        words += ["--simulate", "--depth", str(args.depth), "--traces", "1", "--seed", str(seed)]
    return shlex.join(words)


def cmd_check(args: argparse.Namespace) -> int:
    if args.list_bugs:
        return list_bugs()
    if args.list_models:
        return list_models()
    if args.list_properties:
        return list_properties()
    if args.model is None:
        if not (args.tlc or args.simulate or args.dump_dot):
            return _check_headline(args)
        args.model = "default"  # TLC, random walks and drawings are of one model
    try:
        plan = _plan(args)
        if args.dump_dot:
            _dump_dot(plan.model, args.dump_dot)
    except (CfgError, ModelError, UsageError) as error:
        print(f"kvproof check: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.tlc:
        return _check_with_tlc(plan.model, *tlc_lists(plan.cfg, plan.invariants,
                                                      plan.liveness))
    if args.simulate:
        return _simulate(args, plan)
    return _exhaust(args, plan)


def _dump_dot(model, path: str) -> None:
    from spec.check.dot import TooLargeToDraw, to_dot

    try:
        Path(path).write_text(to_dot(model))
    except TooLargeToDraw as error:
        raise UsageError(f"--dump-dot: {error}") from None
    print(f"State graph written to {path} (Graphviz DOT)")


def _checker(args: argparse.Namespace, plan: Plan):
    from spec.check.checker import Checker
    from spec.check.parallel import ParallelChecker

    options = dict(symmetry=plan.symmetry, invariants=plan.invariants, liveness=plan.liveness,
                   progress=None if args.quiet else _progress, max_states=args.max_states,
                   keep_going=args.keep_going, orbits=args.orbit_states)
    if args.workers > 1:
        return ParallelChecker(plan.model, workers=args.workers, **options)
    return Checker(plan.model, **options)


def _check_headline(args: argparse.Namespace) -> int:
    """The default model, then the crash models, in turn: every plan is validated first,
    each model reports as `--model NAME` would, and the exit status is the worst of them
    (2 before 1 before 0). --itf gets the first counterexample, --json every summary."""
    runs = []
    for name in HEADLINE_MODELS:
        one = argparse.Namespace(**{**vars(args), "model": name})
        try:
            runs.append((one, _plan(one)))
        except (CfgError, ModelError, UsageError) as error:
            print(f"kvproof check: {error}", file=sys.stderr)
            return EXIT_USAGE
    print(f"kvproof check: no --model given: checking {', '.join(HEADLINE_MODELS)} in turn "
          "(the default model, then the models where the prefill and decode crash); "
          "--model NAME checks one model.", flush=True)
    codes, summaries = [], []
    for one, plan in runs:
        print(f"\n=== {one.model} ===", flush=True)
        code = _exhaust(one, plan, summaries if args.json else None)
        if code not in (EXIT_OK, EXIT_VIOLATION):
            return code  # a usage error or an interrupt: no verdict
        if code == EXIT_VIOLATION:
            args.itf = None  # the first counterexample stays in the file
            for later, _ in runs:
                later.itf = None
        codes.append(code)
    if args.json:
        _write_json(args.json, {"command": "check", "models": list(HEADLINE_MODELS),
                                "ok": all(c == EXIT_OK for c in codes), "checks": summaries})
    verdicts = ", ".join(f"{name} {'holds' if code == EXIT_OK else 'FAILS'}"
                         for name, code in zip(HEADLINE_MODELS, codes))
    print(f"\nkvproof check: {verdicts}.")
    return max(codes)


def _exhaust(args: argparse.Namespace, plan: Plan, summaries: list | None = None) -> int:
    try:
        checker = _checker(args, plan)
    except ModelError as error:
        print(f"kvproof check: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(describe_model(plan.model))
    print(f"Checking {', '.join(plan.invariants)}"
          + (f"; liveness ({', '.join(p for p, i in LIVENESS.items() if i in plan.invariants)})"
             " by acyclicity + rest invariants"
             + (" (under finitely many losses: loss steps left out of the graph)"
                if plan.model.losses else "")
             if plan.liveness else "") + (f" with {symmetry_words(plan.model)}"
                                          if plan.symmetry else "")
          + (f"; {args.workers} workers" if args.workers > 1 else ""), flush=True)
    try:
        result = checker.run()
    except RuntimeError as error:
        print(f"kvproof check: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvproof check: interrupted; no verdict", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.violation is None and result.ok_unreachable:
        print(f"Error: no behaviour of model {plan.model.name} ends with a client answered Ok: "
              "every request fails or waits, so every property holds vacuously.")
        print(format_summary(result))
        _write_summary(args, plan, result, [], summaries)
        print(f"reproduce: {reproduce_command(args)}")
        print(f"Error: Ok is unreachable in model {plan.model.name}.")
        return EXIT_VIOLATION
    if result.violation is None:
        print("Model checking completed. No error has been found.")
        print(format_summary(result))
        if result.witness is not None:
            print(format_witness(plan.model, result.witness))
        if args.coverage:
            print(format_coverage(result))
        _write_summary(args, plan, result, [], summaries)
        return EXIT_OK
    violations = result.violations or [result.violation]
    for violation in violations:
        print(f"Error: {format_trace(plan.model, violation, full=args.full_trace)}")
    print(format_summary(result))
    _write_counterexample(args, plan.model, violations[0])
    _write_summary(args, plan, result, [(None, v) for v in violations], summaries)
    print(f"reproduce: {reproduce_command(args)}")
    for violation in violations:  # the verdict comes last, as TLC's does
        print(f"Error: {violation.property} is violated ({violation.kind}); "
              f"counterexample of {plural(violation.length, 'step')}.")
    return EXIT_VIOLATION


def _write_counterexample(args: argparse.Namespace, model, violation) -> None:
    from spec.tlaplus.itf import write_itf

    if not args.itf:
        return
    try:
        write_itf(args.itf, model, violation.trace,
                  f"counterexample to {violation.property} on {model.describe()}")
        print(f"Trace written to {args.itf} (ITF JSON); check it with "
              f"kvproof validate {shlex.quote(args.itf)}")
    except OSError as error:
        print(f"kvproof check: cannot write the trace: {error.strerror}", file=sys.stderr)


def format_witness(model, witness: list) -> str:
    """The shortest behaviour found that ends with a client answered Ok, on one line."""
    steps = " -> ".join(e.label(model) for e, _ in witness[1:])
    return (f"Witness: a client is answered Ok after {plural(len(witness) - 1, 'step')} "
            f"(a shortest such behaviour): {steps}")


def _write_json(path: str, summary: dict) -> None:
    try:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as error:
        print(f"kvproof check: cannot write {path}: {error.strerror}", file=sys.stderr)


def _write_summary(args: argparse.Namespace, plan: Plan, result, violations,
                   summaries: list | None = None) -> None:
    """The run as JSON for CI: counts, timing, and every violation with its trace labels;
    appended to `summaries` instead of written when several models are checked."""
    if not args.json:
        return
    summary = {
        "command": "check", "model": plan.model.name, "description": describe_model(plan.model),
        "bugs": sorted(plan.model.bugs), "properties": list(plan.invariants),
        "liveness": plan.liveness, "symmetry": plan.symmetry,
        "mode": "simulate" if args.simulate else "exhaustive",
        "ok": not violations,
        "violations": [{"property": v.property, "kind": v.kind, "steps": v.length,
                        "seed": seed,
                        "trace": [e.label(plan.model) if e else "Init" for e, _ in v.trace],
                        "reproduce": reproduce_command(args, seed)} for seed, v in violations],
    }
    if args.simulate:
        summary.update(traces=result.traces, steps=result.steps, seed=args.seed)
    else:
        summary.update(distinct_states=result.distinct_states,
                       states_generated=result.states_generated, depth=result.depth + 1,
                       left_on_queue=result.left_on_queue, workers=result.workers)
        if result.states_without_symmetry is not None:
            summary["states_without_symmetry"] = result.states_without_symmetry
        witness = getattr(result, "witness", None)
        summary["witness"] = ([e.label(plan.model) for e, _ in witness[1:]]
                              if witness is not None else None)
    summary["seconds"] = round(result.seconds, 3)
    if summaries is not None:
        summaries.append(summary)
    else:
        _write_json(args.json, summary)


def _simulate(args: argparse.Namespace, plan: Plan) -> int:
    from fuzz.runner import random_seed
    from spec.check.simulate import simulate

    if args.seed is None:
        args.seed = random_seed()
    print(describe_model(plan.model))
    print(f"Simulating {plural(args.traces, 'behaviour')} of at most "
          f"{plural(args.depth, 'step')} from seed {args.seed}; checking "
          f"{', '.join(plan.invariants)}", flush=True)
    result = simulate(plan.model, seed=args.seed, depth_max=args.depth, traces=args.traces,
                      invariants=plan.invariants, keep_going=args.keep_going)
    print(f"{plural(result.traces, 'behaviour')}, {plural(result.steps, 'step')} in "
          f"{result.seconds:.2f} s ({result.steps / max(result.seconds, 1e-9):,.0f} steps/s)")
    _write_summary(args, plan, result, result.violations)
    if result.ok:
        print(f"No violation in {plural(result.traces, 'behaviour')} (seed {args.seed}). "
              "Simulation covers a sample, not every state.")
        return EXIT_OK
    for seed, violation in result.violations:
        print(f"Error (behaviour seed {seed}): "
              f"{format_trace(plan.model, violation, full=args.full_trace, shortest=False)}")
        print(f"reproduce: {reproduce_command(args, seed)}")
    _write_counterexample(args, plan.model, result.violations[0][1])
    return EXIT_VIOLATION


def _check_with_tlc(model, invariants: tuple[str, ...], properties: tuple[str, ...]) -> int:
    from spec.tlaplus.tlc import find_tlc, run_tlc, static_errors

    found = find_tlc()
    if isinstance(found, str):
        print(f"kvproof check --tlc: {found}", file=sys.stderr)
        return EXIT_USAGE
    refused = static_errors()
    if refused:  # TLC would stop in SANY before checking anything: say where, without Java
        print("kvproof check --tlc: SANY would refuse spec/KVTransfer.tla:\n  "
              + "\n  ".join(refused), file=sys.stderr)
        return EXIT_USAGE
    print(f"{describe_model(model)}\nRunning TLC (1 worker) on the same model ...", flush=True)
    result = run_tlc(model, invariants, properties)  # exactly what kvproof would check
    print("TLC command: " + " ".join(result.command))
    print(f"TLC: {result.states_generated} states generated, {result.distinct_states} distinct "
          f"states found, depth {result.depth}, {result.seconds:.1f} s")
    if result.ok:
        print("TLC: Model checking completed. No error has been found.")
        return EXIT_OK
    print(result.output[-4000:])
    if result.refused:
        print(f"kvproof check --tlc: TLC checked nothing (exit {result.returncode}): "
              f"{result.violation or 'it refused the spec or the .cfg'}", file=sys.stderr)
        return EXIT_USAGE
    print(f"Error: TLC reports {result.violation or 'an error'}")
    return EXIT_VIOLATION


# -- conformance ---------------------------------------------------------------------------

def cmd_conformance(args: argparse.Namespace) -> int:
    from spec.tlaplus.conformance import check_conformance
    from spec.tlaplus.tlaeval import EvalError

    if args.list_bugs:
        return list_bugs()
    if args.list_models:
        return list_models()
    try:
        _, model = load(args.model)
        model = _with_bug_flags(model, args.bug)
    except (CfgError, ModelError, UsageError) as error:
        print(f"kvproof conformance: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.walks is None and args.seed is not None:
        print("kvproof conformance: --seed is for --walks (the whole graph draws nothing)",
              file=sys.stderr)
        return EXIT_USAGE
    if args.walks is not None and args.symmetry:
        print("kvproof conformance: --symmetry is for the whole graph (a walk visits states, "
              "not orbits)", file=sys.stderr)
        return EXIT_USAGE
    print(describe_model(model), flush=True)
    last = [0.0]

    def progress(states: int, seconds: float) -> None:
        if not args.quiet and seconds - last[0] >= 10:
            last[0] = seconds
            print(f"Progress: {states:,} states found, {states / seconds:,.0f} states/s, "
                  f"{seconds:.0f} s", file=sys.stderr, flush=True)

    try:
        if args.walks is None:
            result = check_conformance(model, progress=progress, symmetry=args.symmetry)
        else:
            result = _sampled_conformance(args, model, progress)
    except EvalError as error:
        print(f"kvproof conformance: the spec cannot be evaluated: {error}", file=sys.stderr)
        return EXIT_USAGE
    if result.ok:
        what = ("the same state graph" if args.walks is None
                else f"the same successors on every state of {args.walks:,} random walks")
        print(f"KVTransfer.tla and spec/core.py have {what}: {result.states:,} "
              f"states, {result.edges:,} labelled edges, {len(result.labels)} actions, "
              f"{result.seconds:.1f} s ({result.states / max(result.seconds, 1e-9):,.0f} "
              "states/s)")
        return EXIT_OK
    print(result.disagreement.report(model))
    return EXIT_VIOLATION


def _sampled_conformance(args: argparse.Namespace, model, progress):
    from fuzz.runner import random_seed
    from spec.tlaplus.conformance import sample_conformance

    if args.seed is None:
        args.seed = random_seed()
    print(f"{args.walks:,} random walks, seed {args.seed} (replay: kvproof conformance "
          f"--model {args.model} --walks {args.walks} --seed {args.seed}"
          + "".join(f" --bug {b}" for b in args.bug or ()) + ")", flush=True)
    return sample_conformance(model, walks=args.walks, seed=args.seed, progress=progress)


# -- validate ------------------------------------------------------------------------------

def _trace_and_model(args: argparse.Namespace):
    from spec.tlaplus.itf import model_from_meta
    from spec.tlaplus.validate import TraceError, load_trace

    readable_file(args.trace, args.trace)
    kind = sniff(args.trace)
    if kind not in (ITF_TRACE, FUZZ_FAILURE, None):  # None: load_trace says what is wrong
        raise wrong_kind(args.trace, kind, "an ITF trace")
    trace = load_trace(args.trace)
    meta = trace.get("#meta") if isinstance(trace.get("#meta"), dict) else {}
    if kind == FUZZ_FAILURE:
        # A sim-target failure's states are that target's (several workers, its own request
        # numbering), not a behaviour of the spec's single pair; a core-target failure is,
        # but on a fuzz-sized model (6-12 requests, pools of tens of pages) whose Reserve
        # choices no state-by-state search can enumerate. Its replay checks the same events.
        target = meta["fuzz"].get("target")
        raise UsageError(f"{args.trace} is a saved fuzz failure of the {target} target, too "
                         f"large to validate state by state: replay it with kvproof fuzz "
                         f"--replay {args.trace}")
    if args.model:
        _, model = load(args.model)
        _same_constants(args.trace, meta, model)
    elif isinstance(meta.get("model"), dict):
        try:
            model = model_from_meta(meta["model"])
        except (KeyError, TypeError) as error:
            raise TraceError(f"{args.trace}: its #meta.model is incomplete ({error}); "
                             "pass --model NAME|FILE") from None
    else:
        raise TraceError(f"{args.trace} does not say which model it belongs to; "
                         "pass --model NAME|FILE")
    return trace, _with_bug_flags(model, args.bug)


def _same_constants(path: str, meta: dict, model) -> None:
    """A trace that records its model is validated against that model's constants: another
    model's initial state differs, so every step would be reported as illegal (exit 1, a
    violation) when the mistake is the model named. Bug switches may differ: validating a
    buggy run against the guarded protocol is what the command is for."""
    from spec.tlaplus.itf import model_from_meta

    recorded = meta.get("model")
    if not isinstance(recorded, dict):
        return  # Apalache and other tools record no model: --model is the only word on it
    try:
        theirs = model_from_meta(recorded)
    except (KeyError, TypeError, ModelError):
        return
    ours = {k: v for k, v in model.tla_constants().items() if k != "Bugs"}
    if {k: v for k, v in theirs.tla_constants().items() if k != "Bugs"} != ours:
        raise UsageError(f"{path} is a behaviour of {theirs.describe()}; --model "
                         f"{model.name} has other constants: drop --model to use the recorded "
                         "one")


def _run_of(args: argparse.Namespace, kind: str | None):
    """A run's own log (simulator, engine, a core-target fuzz failure) read for
    spec/tlaplus/runcheck.py, or None for an ITF trace (validated state by state)."""
    from dataclasses import replace

    if kind == SIM_LOG:
        from sim.trace import log_run
    elif kind == ENGINE_LOG:
        from engine.eventlog import log_run
    elif kind == FUZZ_FAILURE:
        from fuzz.replay import failure_run as log_run
    else:
        return None
    if args.model:
        raise UsageError(f"{args.trace} is {kind}, which carries its own constants: drop "
                         "--model")
    run = log_run(args.trace)
    if args.bug:  # the spec with more bug switches than the run had: the run as it ran
        run = replace(run, model=_with_bug_flags(run.model, args.bug))
    return run


def _validate_run(run) -> int:
    from spec.tlaplus.runcheck import check_run

    verdict = check_run(run)
    print(f"{run.description}: {run.prefill_workers} x {run.decode_workers} workers, "
          f"{plural(len(run.records), 'protocol event')}")
    print(run.model.describe())
    print(verdict.message)
    for finding in verdict.observations[:5]:
        print(f"  the store's oracle: {finding}")
    return EXIT_OK if verdict.ok else EXIT_VIOLATION


def _part_logs(paths: list[str]) -> list[str] | None:
    """The part logs of one deployment that `kvproof validate` was given (several files, or
    a folder of them), or None for one file of another kind."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        found = sorted(str(p) for p in Path(paths[0]).glob("*.ndjson") if sniff(p) == PART_LOG)
        if found:
            return found
    for path in paths:
        readable_file(path, path)
    if len(paths) == 1 and sniff(paths[0]) != PART_LOG:
        return None
    for path in paths:
        if sniff(path) != PART_LOG:
            raise UsageError(f"{path} is not a part log: several files are validated as the "
                             "logs of one split deployment, each a part's")
    return paths


def _validate_part_logs(paths: list[str]) -> int:
    from sim.trace import read_part_logs
    from spec.partlog import merge
    from spec.tlaplus.runcheck import check_part_logs, merged_run

    model, logs = read_part_logs(paths)
    merged = merge(model, logs)
    verdict = check_part_logs(merged)
    run = merged_run(merged)
    print(f"{plural(len(paths), 'log')} of one deployment merged: "
          + ", ".join(f"{name} {plural(n, 'step')}" for name, n in merged.parts.items()))
    print(f"{run.prefill_workers} x {run.decode_workers} workers, "
          f"{plural(len(run.records), 'protocol event')}")
    print(model.describe())
    print(verdict.message)
    return EXIT_OK if verdict.ok else EXIT_VIOLATION


def cmd_validate(args: argparse.Namespace) -> int:
    from fuzz.replay import ReplayError
    from spec.partlog import MergeError
    from spec.tlaplus.runcheck import RunError
    from spec.tlaplus.validate import TraceError, validate
    from sim.fold import LogError as SimLogError
    from engine.eventlog import LogError as EngineLogError

    try:
        paths = _part_logs(args.trace)
        if paths is not None:
            return _validate_part_logs(paths)
    except MergeError as error:
        print(f"kvproof validate: the logs do not make one run: {error}")
        return EXIT_VIOLATION
    except (RunError, SimLogError, ModelError, UsageError) as error:
        print(f"kvproof validate: {error}", file=sys.stderr)
        return EXIT_USAGE
    args.trace = args.trace[0]
    try:
        readable_file(args.trace, args.trace)
        kind = sniff(args.trace)
        run = _run_of(args, kind)
        if run is not None:
            return _validate_run(run)
    except (RunError, ReplayError, SimLogError, EngineLogError, ModelError,
            UsageError) as error:
        print(f"kvproof validate: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        trace, model = _trace_and_model(args)
    except (TraceError, CfgError, ModelError, UsageError) as error:
        print(f"kvproof validate: {error}", file=sys.stderr)
        return EXIT_USAGE
    verdict = validate(model, trace, invariants=True)
    print(describe_model(model))
    print(verdict.message)
    return EXIT_OK if verdict.ok else EXIT_VIOLATION
