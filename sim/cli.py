"""`kvproof sim`: run a scenario, or replay a run's log.

Exit status: 0 when every oracle held, 1 when a violation or a leaked response was found,
2 on bad input (an unknown scenario, a malformed file, a log that is not a run).
"""

from __future__ import annotations

import argparse
import sys

from sim.fold import LogError
from sim.scenario import ScenarioError, load_scenario, scenario_names


def add_parser(commands) -> None:
    sim = commands.add_parser("sim", help="simulate a cluster running the protocol core under "
                              "load and faults")
    sim.add_argument("scenario", nargs="?", help="a scenario name (see --list) or a TOML file")
    sim.add_argument("--seed", type=int, help="override the scenario's seed")
    sim.add_argument("--requests", type=int, help="override the number of requests")
    sim.add_argument("--bug", action="append", default=[], metavar="NAME",
                     help="add a bug switch to the scenario's (repeatable)")
    sim.add_argument("--guards-on", action="store_true",
                     help="clear the scenario's own bug switches first")
    sim.add_argument("--on-violation", choices=("stop", "count"),
                     help="stop at the first violation or count them all")
    sim.add_argument("--log", metavar="FILE", help="write the event log (ndjson) to FILE")
    sim.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    sim.add_argument("--plot", metavar="DIR", help="write PNG plots to DIR")
    sim.add_argument("--itf", metavar="FILE", help="also write the run as an ITF trace of the "
                     "spec, for `kvproof validate` (one prefill and one decode worker only)")
    sim.add_argument("--replay", metavar="LOG", help="rebuild a run's state and metrics from "
                     "its log alone")
    sim.add_argument("--list", action="store_true", help="list the shipped scenarios")
    sim.add_argument("--quiet", action="store_true", help="no progress lines")
    sim.set_defaults(func=cmd_sim)


def _scenario(args: argparse.Namespace):
    sc = load_scenario(args.scenario)
    changes: dict = {}
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.requests is not None:
        changes["requests"] = args.requests
    if args.bug or args.guards_on:
        base = () if args.guards_on else sc.bugs
        changes["bugs"] = tuple(dict.fromkeys(base + tuple(args.bug)))
    if args.on_violation:
        changes["oracles"] = {**sc.oracles.model_dump(), "on_violation": args.on_violation}
    return sc.with_options(**changes) if changes else sc


def cmd_sim(args: argparse.Namespace) -> int:
    from sim.report import summary_table, write_json, write_plots
    from sim.run import replay_result, simulate

    if args.list:
        for name in scenario_names():
            print(f"{name:<24}{load_scenario(name).description.splitlines()[0]}")
        return 0
    try:
        if args.replay:
            if args.scenario:
                raise ScenarioError("--replay takes the log alone, not a scenario")
            result, folder = replay_result(args.replay)
            metrics = folder.metrics
            print(f"replayed {args.replay}: {result['events']:,} events")
        else:
            if not args.scenario:
                raise ScenarioError("name a scenario (see --list) or give --replay LOG")
            sc = _scenario(args)
            print(f"kvproof sim: scenario {sc.name}, seed {sc.seed}, {sc.requests:,} requests, "
                  f"bugs: {', '.join(sc.bugs) or 'none'}", flush=True)
            if args.itf and not args.log:
                raise ScenarioError("--itf converts the run's log: give --log FILE too")
            result, sim = simulate(sc, log_path=args.log, progress=not args.quiet)
            metrics = sim.folder.metrics
            if args.itf:
                _write_itf(args.log, args.itf)
    except (ScenarioError, LogError) as error:
        print(f"kvproof sim: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"kvproof sim: {error}", file=sys.stderr)
        return 2
    print(summary_table(result))
    if args.json:
        write_json(args.json, result)
    if args.plot:
        for path in write_plots(args.plot, metrics, result["scenario"]):
            print(f"wrote {path}")
    return _verdict(args, result)


def _write_itf(log: str, path: str) -> None:
    import json

    from sim.trace import log_to_itf
    _, itf = log_to_itf(log)
    with open(path, "w") as f:
        json.dump(itf, f, indent=1)
    print(f"wrote {path} ({len(itf['states']) - 1} steps): check it with kvproof validate {path}")


def _verdict(args: argparse.Namespace, result: dict) -> int:
    bad = result["violations"] or result["summary"]["leaked_responses"]
    if result["stopped"]:
        print(f"STOPPED at the first violation: {result['stopped']}")
    if bad and not args.replay:
        replay = (f"kvproof sim --replay {args.log}" if args.log else
                  f"kvproof sim {args.scenario} --seed {result['seed']} --log trace.ndjson")
        print(f"reproduce with seed={result['seed']}: {replay}")
    return 1 if bad else 0
