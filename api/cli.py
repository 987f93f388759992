"""The kvproof command line.

    kvproof check [--model NAME|FILE] [--bug NAME ...] [--symmetry] [--trace-out FILE]
    kvproof check --list-bugs | --list-models
    kvproof validate TRACE [--model NAME|FILE] [--bug NAME ...]
    kvproof conformance [--model NAME|FILE] [--bug NAME ...] [--symmetry]
    kvproof fuzz [--target NAME] [--seed N] [--examples N | --seconds S] [--bug NAME ...]
    kvproof fuzz --zoo | --replay FILE
    kvproof generate [--model PATH] [--device cpu|cuda] [--dtype D] [--chat] PROMPT...

Exit status: 0 when every property holds, 1 when one is violated (the message names it),
2 for bad input (an unknown model, switch or property, an unreadable .cfg).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sim.cli import add_parser as add_sim_parser
from spec.check.cfgfile import CfgError, load, model_names
from spec.check.checker import Checker
from spec.tlaplus.itf import write_itf
from spec.model import BUG_SWITCHES, ModelError
from spec.properties import ALL_INVARIANTS, LIVENESS, STEP_PROPERTIES
from spec.check.report import format_coverage, format_summary, format_trace

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE = 0, 1, 2


def _with_bug_flags(model, bugs: list[str]):
    """The model with the --bug switches added; an unknown switch is the user's error."""
    unknown = [b for b in bugs if b not in BUG_SWITCHES]
    if unknown:
        raise CfgError(f"unknown bug switch(es) {unknown}; see kvproof check --list-bugs")
    return model.with_bugs(model.bugs | set(bugs)) if bugs else model


def _progress(distinct: int, generated: int, depth: int, seconds: float) -> None:
    print(f"Progress: {distinct:,} distinct states, {generated:,} generated, depth {depth}, "
          f"{distinct / max(seconds, 1e-9):,.0f} distinct states/s, {seconds:.0f} s",
          file=sys.stderr, flush=True)


def _properties(cfg, requested: list[str]) -> tuple[tuple[str, ...], bool]:
    """The invariants to check and whether liveness is checked, from the cfg or the flags."""
    known = set(ALL_INVARIANTS) | set(STEP_PROPERTIES)
    if requested:
        unknown = [n for n in requested if n not in known]
        if unknown:
            raise CfgError(f"unknown invariant(s) {unknown}; known: {sorted(known)}")
        return tuple(requested), False
    names = list(cfg.invariants)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CfgError(f"{cfg.path}: invariant(s) {unknown} are not known to the Python "
                       f"checker; known: {sorted(known)}")
    for prop in cfg.properties:
        if prop in STEP_PROPERTIES:  # an action property: checked on every edge
            names.append(prop)
            continue
        if prop not in LIVENESS:
            raise CfgError(f"{cfg.path}: property {prop} is not known; known: "
                           f"{sorted(LIVENESS) + sorted(STEP_PROPERTIES)}")
        if LIVENESS[prop] not in names:
            names.append(LIVENESS[prop])
    return tuple(names), any(prop in LIVENESS for prop in cfg.properties)


def tlc_lists(cfg, invariants: tuple[str, ...], liveness: bool):
    """What the cfg kvproof writes for TLC lists: the state invariants under INVARIANTS; the
    liveness and step (action) properties under PROPERTIES, as the shipped file has them."""
    properties = tuple(p for p in cfg.properties
                       if p in STEP_PROPERTIES and p in invariants or p in LIVENESS and liveness)
    return tuple(n for n in invariants if n not in STEP_PROPERTIES), properties


def cmd_check(args: argparse.Namespace) -> int:
    if args.list_bugs:
        width = max(len(name) for name in BUG_SWITCHES)
        for name, (guard, what, seen) in BUG_SWITCHES.items():
            print(f"{name:<{width}}  {what} [guard: {guard}; {seen}]")
        return EXIT_OK
    if args.list_models:
        print("\n".join(model_names()))
        return EXIT_OK
    try:
        if args.trace_out and not Path(args.trace_out).resolve().parent.is_dir():
            raise CfgError(f"--trace-out {args.trace_out}: its directory does not exist")
        cfg, model = load(args.model)
        model = _with_bug_flags(model, args.bug)
        invariants, liveness = _properties(cfg, args.invariant)
        symmetry = args.symmetry or cfg.symmetry is not None
        if not args.tlc:
            checker = Checker(model, symmetry=symmetry, invariants=invariants,
                              liveness=liveness, progress=_progress, max_states=args.max_states)
    except (CfgError, ModelError) as error:
        print(f"kvproof check: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.tlc:
        return _check_with_tlc(model, *tlc_lists(cfg, invariants, liveness))
    print(model.describe())
    print(f"Checking {', '.join(invariants)}"
          + (f"; liveness ({', '.join(LIVENESS)}) by acyclicity + rest invariants"
             if liveness else "") + (" with symmetry over requests" if symmetry else ""))
    try:
        result = checker.run()
    except RuntimeError as error:
        print(f"kvproof check: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvproof check: interrupted; no verdict", file=sys.stderr)
        return 130
    if result.violation is None:
        print("Model checking completed. No error has been found.")
        print(format_summary(result))
        if args.coverage:
            print(format_coverage(result))
        return EXIT_OK
    violation = result.violation
    print(f"Error: {format_trace(model, violation)}")
    print(format_summary(result))
    if args.trace_out:
        try:
            write_itf(args.trace_out, model, violation.trace,
                      f"counterexample to {violation.property} on {model.describe()}")
            print(f"Trace written to {args.trace_out} (ITF JSON)")
        except OSError as error:
            print(f"kvproof check: cannot write the trace: {error}", file=sys.stderr)
    print(f"Error: {violation.property} is violated ({violation.kind}); "
          f"counterexample of {violation.length} steps.")
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
    print(f"{model.describe()}\nRunning TLC (1 worker) on the same model ...", flush=True)
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


def cmd_conformance(args: argparse.Namespace) -> int:
    from spec.tlaplus.conformance import check_conformance
    from spec.tlaplus.tlaeval import EvalError

    try:
        _, model = load(args.model)
        model = _with_bug_flags(model, args.bug)
    except (CfgError, ModelError) as error:
        print(f"kvproof conformance: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(model.describe())

    last = [0.0]

    def progress(states: int, seconds: float) -> None:
        if seconds - last[0] >= 10:
            last[0] = seconds
            print(f"Progress: {states:,} states found, {states / seconds:,.0f} states/s, "
                  f"{seconds:.0f} s", file=sys.stderr, flush=True)

    try:
        result = check_conformance(model, progress=progress, symmetry=args.symmetry)
    except EvalError as error:
        print(f"kvproof conformance: the spec cannot be evaluated: {error}", file=sys.stderr)
        return EXIT_USAGE
    if result.ok:
        print(f"KVTransfer.tla and spec/core.py have the same state graph: {result.states:,} "
              f"states, {result.edges:,} labelled edges, {len(result.labels)} actions, "
              f"{result.seconds:.1f} s ({result.states / max(result.seconds, 1e-9):,.0f} "
              "states/s)")
        return EXIT_OK
    print(result.disagreement.report(model))
    return EXIT_VIOLATION


def cmd_validate(args: argparse.Namespace) -> int:
    from spec.tlaplus.itf import model_from_meta
    from spec.tlaplus.validate import TraceError, load_trace, validate

    try:
        trace = load_trace(args.trace)
        meta = trace.get("#meta", {}).get("model")
        if args.model:
            _, model = load(args.model)
        elif meta:
            model = model_from_meta(meta)
        else:
            raise TraceError(f"{args.trace} does not say which model it belongs to; "
                             "pass --model NAME|FILE")
        model = _with_bug_flags(model, args.bug)
    except (TraceError, CfgError, ModelError, KeyError, TypeError) as error:
        print(f"kvproof validate: {error}", file=sys.stderr)
        return EXIT_USAGE
    verdict = validate(model, trace)
    print(f"{model.describe()}")
    print(verdict.message)
    return EXIT_OK if verdict.ok else EXIT_VIOLATION


def cmd_fuzz(args: argparse.Namespace) -> int:
    from fuzz.cli import run

    return run(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvproof", description="Safe KV-cache transfer for "
                                     "disaggregated LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="model-check the KV transfer protocol")
    check.add_argument("--model", default="default",
                       help="a model name (see --list-models) or a path to a .cfg file")
    check.add_argument("--bug", action="append", default=[], metavar="NAME",
                       help="turn on a bug switch (repeatable; see --list-bugs)")
    check.add_argument("--invariant", action="append", default=[], metavar="NAME",
                       help="check only these invariants (repeatable; default: the model's)")
    check.add_argument("--symmetry", action="store_true", help="reduce by symmetry over requests")
    check.add_argument("--trace-out", metavar="FILE", help="write a counterexample as ITF JSON")
    check.add_argument("--max-states", type=int, default=None, metavar="N",
                       help="stop with an error beyond N distinct states")
    check.add_argument("--tlc", action="store_true",
                       help="run TLC (java + TLA2TOOLS_JAR) on the same model instead")
    check.add_argument("--coverage", action="store_true",
                       help="print how often each action fired (flags actions never enabled)")
    check.add_argument("--list-bugs", action="store_true", help="list the bug switches")
    check.add_argument("--list-models", action="store_true", help="list the shipped models")
    check.set_defaults(func=cmd_check)
    validate = commands.add_parser("validate", help="check that an ITF trace is a behaviour "
                                   "of the protocol")
    validate.add_argument("trace", help="an ITF JSON trace file")
    validate.add_argument("--model", default=None,
                          help="the model (default: the one recorded in the trace)")
    validate.add_argument("--bug", action="append", default=[], metavar="NAME",
                          help="turn on a bug switch (repeatable)")
    validate.set_defaults(func=cmd_validate)
    conformance = commands.add_parser("conformance", help="show that KVTransfer.tla and the "
                                      "Python core have the same state graph")
    conformance.add_argument("--model", default="solo",
                             help="a model name or .cfg file (default: solo)")
    conformance.add_argument("--bug", action="append", default=[], metavar="NAME",
                             help="turn on a bug switch (repeatable)")
    conformance.add_argument("--symmetry", action="store_true",
                             help="compare one state per orbit under renaming of requests")
    conformance.set_defaults(func=cmd_conformance)
    add_sim_parser(commands)
    from fuzz.cli import add_arguments as add_fuzz_arguments

    fuzz = commands.add_parser("fuzz", help="fuzz the protocol with Hypothesis (rule-based "
                               "state machines over the core, later the simulator)")
    add_fuzz_arguments(fuzz)
    fuzz.set_defaults(func=cmd_fuzz)
    from engine.cli import add_arguments as add_generate_arguments

    generate = commands.add_parser("generate", help="complete prompts with the torch engine "
                                   "(default model: SmolLM2-135M-Instruct)")
    add_generate_arguments(generate)
    generate.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
