"""`kvproof sim`: run a scenario, sweep one of its fields, or replay a run's log.

Everything a run will need is checked before it starts (the scenario and its overrides, the
output paths, whether the cluster can be written as an ITF trace), so a mistake costs no
simulated time. A run that finds a violation prints the command that reproduces it, with
every option that changed the run.

Exit status: 0 when every oracle held, 1 when a violation or a leaked response was found,
2 on bad input (an unknown scenario or field, a malformed file, a log that is not a run),
3 when the simulator itself crashed (sim/crash.py): the exception, its innermost frame, the
seed, the reproduce command and a log of the events up to the crash are reported.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tomllib

from api.clikit import (EXIT_CRASH, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, EXIT_VIOLATION,
                        FUZZ_FAILURE, ITF_TRACE, UsageError, add_subcommand, plural,
                        positive_float, positive_int, process_count, readable_file, sniff,
                        writable_file, writable_folder, wrong_kind)
from sim.fold import LogError
from sim.scenario import ScenarioError, load_scenario, scenario_from_dict, scenario_names

# Defaults of the SLO targets reported in the summary (DistServe's chatbot SLOs are of this
# order): time to first token, and mean time per output token after it.
SLO_TTFT_MS_DEFAULT = 2000.0
SLO_TPOT_MS_DEFAULT = 100.0
EXAMPLES = [
    "kvproof sim incident-2026 --bug FinishedNotRejected --bug NoCountCheck",
    "kvproof sim default --seed 7 --set cluster.decode_workers=8 --json out.json",
    "kvproof sim incident-2026 --bug FinishedNotRejected --bug NoCountCheck --hybrid",
    "kvproof sim default --sweep workload.rate_per_s=5,10,20,40 --jobs 2 --plot plots/",
    "kvproof sim one-pair --log run.ndjson --itf run.itf.json && kvproof validate run.itf.json",
    "kvproof sim --replay run.ndjson --csv requests.csv",
]
EXTRA = ("aliases (kept for one release): --list = --list-scenarios\n"
         "--replay LOG re-runs a recorded run from its log alone (as kvproof fuzz --replay FILE "
         "does for a saved failure)\nand reports its verdict; it takes no option that would "
         "change the run.\nkvproof sim calibrate --out compute.toml measures the engine here "
         "for a scenario's [compute] model\n(see kvproof sim calibrate --help).")


def add_parser(commands) -> None:
    sim = add_subcommand(
        commands, "sim", "simulate a cluster running the protocol core under load and faults",
        "Run a SimPy cluster of prefill and decode workers, every protocol step decided by "
        "the protocol core, under a scenario's load and faults; check the invariants as it "
        "runs and count leaked responses. Scenarios are TOML files; any field can be "
        "overridden with --set, and one can be swept with --sweep.", EXAMPLES, EXTRA,
        crash=True)
    sim.add_argument("scenario", nargs="?", help="a scenario name (see --list-scenarios) or a "
                     "TOML file")
    sim.add_argument("--seed", type=int, help="override the scenario's seed")
    sim.add_argument("--requests", type=positive_int, help="override the number of requests")
    sim.add_argument("--bug", action="append", default=[], metavar="NAME",
                     help="add a bug switch to the scenario's (repeatable; see --list-bugs)")
    sim.add_argument("--guards-on", action="store_true",
                     help="clear the scenario's own bug switches first")
    sim.add_argument("--on-violation", choices=("stop", "count"),
                     help="stop at the first violation or count them all")
    sim.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                     help="override any scenario field, e.g. cluster.decode_workers=8 or "
                          "faults.client_abort_probability=0.1 (repeatable; VALUE in TOML)")
    sim.add_argument("--sweep", metavar="FIELD=V1,V2,...",
                     help="run once per value of one field and print a table (and a plot "
                          "with --plot)")
    sim.add_argument("--jobs", type=process_count, default=1, metavar="N",
                     help="with --sweep: run the points in N processes, at most the CPUs (same "
                          "results as one)")
    sim.add_argument("--ray", metavar="ADDRESS",
                     help="with --sweep: run the points on a Ray cluster (ADDRESS: local, "
                          "auto, HOST:PORT); needs the ray package")
    sim.add_argument("--slo-ttft-ms", type=positive_float, default=SLO_TTFT_MS_DEFAULT,
                     metavar="MS",
                     help=f"TTFT target for SLO attainment (default {SLO_TTFT_MS_DEFAULT:g})")
    sim.add_argument("--slo-tpot-ms", type=positive_float, default=SLO_TPOT_MS_DEFAULT,
                     metavar="MS",
                     help=f"time-per-output-token target (default {SLO_TPOT_MS_DEFAULT:g})")
    sim.add_argument("--log", metavar="FILE", help="write the event log (ndjson) to FILE")
    sim.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    sim.add_argument("--csv", metavar="FILE", help="write one row per request as CSV to FILE")
    sim.add_argument("--plot", metavar="DIR", help="write PNG plots to DIR")
    sim.add_argument("--itf", metavar="FILE", help="also write the run as an ITF trace of the "
                     "spec, for `kvproof validate` (one prefill and one decode worker only)")
    sim.add_argument("--replay", metavar="LOG", help="rebuild a run's state and metrics from "
                     "its log alone")
    sim.add_argument("--list-scenarios", "--list", dest="list_scenarios", action="store_true",
                     help="list the shipped scenarios (--list is the old spelling)")
    sim.add_argument("--list-bugs", action="store_true", help="list the bug switches")
    sim.add_argument("--hybrid", action="store_true",
                     help="make every worker real: the engine's KV pools, compute and page "
                          "writes on a tiny model (the scenario's [hybrid] section names "
                          "workers one by one; sim/README.md)")
    sim.add_argument("--compare-prefix-cache", action="store_true",
                     help="run the scenario twice, its prefix cache (decode's, and the "
                          "prefill's where prefix.prefill_cache is set) on and off (same "
                          "seed, arrivals and prompts), and report the hit rate, pages saved "
                          "and TTFT of each (a scenario whose prompts share prefixes: "
                          "system-prompt, multi-turn, shared-document)")
    sim.add_argument("--quiet", action="store_true", help="no progress lines")
    sim.set_defaults(func=cmd_sim)


# -- the scenario and its overrides --------------------------------------------------------

def _toml_value(text: str):
    """A --set value as TOML reads it (8, 0.5, true, "x", [1, 2]); a bare word as text."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _assign(data: dict, field: str, text: str) -> None:
    """Set a dotted field of a scenario's data, refusing a path the scenario does not have
    (pydantic would report it as an extra key; this says which part of the path is wrong)."""
    from sim.scenario import Scenario

    parts = field.split(".")
    node, model = data, Scenario
    for depth, part in enumerate(parts):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            where = ".".join(parts[:depth]) or "a scenario"
            raise UsageError(f"--set {field}: {where} has no field {part!r}; fields: "
                             f"{', '.join(fields)}")
        if depth == len(parts) - 1:
            node[part] = _toml_value(text)
            return
        model = fields[part].annotation
        node = node.setdefault(part, {})


def _parse_assignment(text: str, flag: str) -> tuple[str, str]:
    field, equals, value = text.partition("=")
    if not equals or not field:
        raise UsageError(f"{flag} {text!r}: expected FIELD=VALUE")
    return field.strip(), value.strip()


def scenario_data(args: argparse.Namespace) -> dict:
    """The scenario's data with every command-line override applied, not yet validated."""
    from spec.model import BUG_SWITCHES

    unknown = [b for b in args.bug if b not in BUG_SWITCHES]
    if unknown:
        raise UsageError(f"unknown bug switch(es) {', '.join(unknown)}; see --list-bugs")
    base = load_scenario(args.scenario)
    data = base.model_dump(mode="json")
    if args.seed is not None:
        data["seed"] = args.seed
    if args.requests is not None:
        data["requests"] = args.requests
    if args.bug or args.guards_on:
        kept = () if args.guards_on else tuple(base.bugs)
        data["bugs"] = list(dict.fromkeys(kept + tuple(args.bug)))
    if args.on_violation:
        data["oracles"]["on_violation"] = args.on_violation
    for assignment in args.set:
        _assign(data, *_parse_assignment(assignment, "--set"))
    if getattr(args, "hybrid", False):
        cluster = {**base.cluster.model_dump(mode="json"), **data.get("cluster", {})}
        data.setdefault("hybrid", {}).update(
            real_prefill=list(range(cluster["prefill_workers"])),
            real_decode=list(range(cluster["decode_workers"])))
    return data


def build_scenario(args: argparse.Namespace, data: dict | None = None):
    return scenario_from_dict(data or scenario_data(args), where="the scenario with its options")


# -- checks before a run ---------------------------------------------------------------------

RUN_CHANGING = ("seed", "requests", "bug", "guards_on", "on_violation", "set", "sweep", "ray",
                "hybrid")


def _preflight(args: argparse.Namespace) -> None:
    for flag, path in (("--log", args.log), ("--json", args.json), ("--csv", args.csv),
                       ("--itf", args.itf)):
        if path:
            writable_file(path, flag)
    if args.plot:
        writable_folder(args.plot, "--plot")
    if args.replay:
        _preflight_replay(args)
    elif not args.scenario:
        raise UsageError("name a scenario (see --list-scenarios) or give --replay LOG")
    if (args.jobs > 1 or args.ray) and not args.sweep:
        raise UsageError("--jobs and --ray spread the points of --sweep; one run is one "
                         "process")
    if args.ray:
        from api.campaigns import require_ray
        require_ray()
    if args.sweep and (args.log or args.itf or args.csv):
        raise UsageError("--sweep runs many times; --log, --itf and --csv take one run")
    if args.itf and not (args.log or args.replay):
        raise UsageError("--itf converts the run's log: give --log FILE too")
    if args.hybrid and args.sweep:
        raise UsageError("--hybrid runs one scenario on the engine; --sweep is for simulated "
                         "runs")
    if args.compare_prefix_cache:
        clash = [flag for flag, given in (("--replay", args.replay), ("--sweep", args.sweep),
                                          ("--hybrid", args.hybrid), ("--log", args.log),
                                          ("--itf", args.itf), ("--csv", args.csv)) if given]
        if clash:
            raise UsageError("--compare-prefix-cache runs the scenario twice and compares the "
                             f"runs; it takes no {', '.join(clash)} (one run's options)")


def _preflight_replay(args: argparse.Namespace) -> None:
    from sim.logcheck import check_log

    changing = [f"--{name.replace('_', '-')}" for name in RUN_CHANGING
                if getattr(args, name) not in (None, False, [])]
    if args.scenario or changing:
        drop = ", ".join(changing) or "the scenario"
        raise UsageError("--replay rebuilds the run its log records; it takes no scenario and "
                         f"no option that changes a run (drop {drop})")
    readable_file(args.replay, f"--replay {args.replay}")
    kind = sniff(args.replay)
    if kind in (ITF_TRACE, FUZZ_FAILURE):
        raise wrong_kind(args.replay, kind, "a simulator log")
    check_log(args.replay)


def _check_itf_shape(args: argparse.Namespace, scenario) -> None:
    """The spec has one prefill and one decode worker; say so before the run, not after."""
    c = scenario.cluster
    if args.itf and (c.prefill_workers != 1 or c.decode_workers != 1):
        raise UsageError(f"--itf: only a run with one prefill and one decode worker maps onto "
                         f"the spec (this scenario has {c.prefill_workers} and "
                         f"{c.decode_workers}; try one-pair, or --set cluster.prefill_workers=1 "
                         "--set cluster.decode_workers=1)")


# -- the command ------------------------------------------------------------------------------

def cmd_sim(args: argparse.Namespace) -> int:
    if args.list_scenarios:
        return _list_scenarios()
    if args.list_bugs:
        from api.check_command import list_bugs
        return list_bugs()
    try:
        _preflight(args)
        if args.sweep:
            from api.sweep import run_sweep
            return run_sweep(args)
        if args.compare_prefix_cache:
            return _compare_prefix_cache(args)
        result, metrics = _replay(args) if args.replay else _run(args)
    except (ScenarioError, LogError, UsageError) as error:
        print(f"kvproof sim: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        kept = (f"; the events so far are in {args.log}, which says the run was cut short: "
                f"kvproof sim --replay {shlex.quote(args.log)}" if args.log else "")
        print(f"kvproof sim: interrupted; no verdict{kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    _report(args, result, metrics)
    return _verdict(args, result)


def _list_scenarios() -> int:
    """Each scenario with its whole description, wrapped (a first line would cut a sentence)."""
    import textwrap

    width = max(len(name) for name in scenario_names()) + 2
    for name in scenario_names():
        text = " ".join(load_scenario(name).description.split())
        lines = textwrap.wrap(text, 96 - width) or [""]
        print(f"{name:<{width}}{lines[0]}")
        for line in lines[1:]:
            print(" " * width + line)
    return EXIT_OK


def _run(args: argparse.Namespace):
    from sim.run import simulate

    scenario = build_scenario(args)
    _check_itf_shape(args, scenario)
    print(f"kvproof sim: scenario {scenario.name}, seed {scenario.seed}, "
          f"{plural(scenario.requests, 'request')}, bugs: {', '.join(scenario.bugs) or 'none'}",
          flush=True)
    if scenario.hybrid.enabled:
        from fuzz.hybrid import simulate_hybrid
        h = scenario.hybrid
        print(f"kvproof sim: hybrid: real prefill {list(h.real_prefill)}, real decode "
              f"{list(h.real_decode)}, tiny model, {h.page_tokens}-token pages (one per "
              f"scenario page), {h.timing} timing", flush=True)
        result, sim = simulate_hybrid(scenario, log_path=args.log, progress=not args.quiet)
    else:
        result, sim = simulate(scenario, log_path=args.log, progress=not args.quiet)
    if result["crash"] is not None:
        _keep_crash_log(args, scenario, result)
    elif args.itf:
        _write_itf(args.log, args.itf)
    return result, sim.folder.metrics


def _compare_prefix_cache(args: argparse.Namespace) -> int:
    """The scenario with its prefix cache on (decode's, and the prefill's where the
    scenario turns it on), then off, from the same seed (the prompts' tokens come from
    their own random stream, so both runs see the same arrivals and prompts); the
    cache-on run's report, then the comparison (and its plot)."""
    from sim.report import compare_prefix_cache, prefix_comparison_table, write_prefix_plot
    from sim.run import simulate

    scenario = build_scenario(args)
    if scenario.prefix.shape == "none":
        raise UsageError(f"--compare-prefix-cache: the prompts of scenario {scenario.name} "
                         "share nothing (prefix.shape is none); try system-prompt, multi-turn "
                         "or shared-document, or --set prefix.shape=system-prompt")
    runs = {}
    for cache in (True, False):
        variant = scenario.with_options(prefix={
            **scenario.prefix.model_dump(), "cache": cache,
            "prefill_cache": cache and scenario.prefix.prefill_cache})
        print(f"kvproof sim: scenario {scenario.name}, seed {scenario.seed}, "
              f"{plural(scenario.requests, 'request')}, prefix cache {'on' if cache else 'off'}",
              flush=True)
        runs[cache] = simulate(variant, progress=not args.quiet)
    (on, sim_on), (off, sim_off) = runs[True], runs[False]
    for result in (on, off):
        if result["crash"] is not None:
            return _verdict(args, result)
    _report(args, on, sim_on.folder.metrics)
    comparison = compare_prefix_cache(on, off)
    print("")
    print(prefix_comparison_table(comparison))
    on["prefix_comparison"] = comparison
    try:
        if args.json:
            from sim.report import write_json
            write_json(args.json, on)
        if args.plot:
            path = write_prefix_plot(args.plot, sim_on.folder.metrics,
                                     sim_off.folder.metrics, comparison)
            print(f"wrote {path}")
    except OSError as error:
        print(f"kvproof sim: cannot write the results: {error.strerror}: {error.filename}",
              file=sys.stderr)
    return max(_verdict(args, on), _verdict(args, off))


def crash_log_path(scenario) -> str:
    return f"kvproof-sim-{scenario.name}-seed{scenario.seed}-crash.ndjson"


def _keep_crash_log(args: argparse.Namespace, scenario, result: dict) -> None:
    """The events up to a crash, in a log: the run's own (--log), or, when it kept none, a
    second run of the same seed with a log, which also shows whether the crash reproduces."""
    from sim.run import simulate

    crash = result["crash"]
    if args.log:
        crash["log"], crash["reproduced"] = args.log, None
        return
    path = crash_log_path(scenario)
    try:
        again, _ = simulate(scenario, log_path=path)
    except OSError as error:
        print(f"kvproof sim: cannot write the crash log {path}: {error}", file=sys.stderr)
        crash["log"], crash["reproduced"] = None, None
        return
    crash["log"] = path
    crash["reproduced"] = again["crash"] is not None and all(
        again["crash"][key] == crash[key] for key in ("type", "message", "frame", "events"))


def _replay(args: argparse.Namespace):
    from sim.run import replay_result

    result, folder = replay_result(args.replay)
    print(f"replayed {args.replay}: {plural(result['events'], 'event')}")
    _check_itf_shape(args, folder.scenario)
    if args.itf:
        _write_itf(args.replay, args.itf)
    return result, folder.metrics


def _report(args: argparse.Namespace, result: dict, metrics) -> None:
    from sim.report import slo_summary, summary_table, write_csv, write_json, write_plots

    result["slo"] = slo_summary(metrics, args.slo_ttft_ms, args.slo_tpot_ms)
    print(summary_table(result))
    if result.get("hybrid"):
        _report_hybrid(result["hybrid"])
    try:
        if args.json:
            write_json(args.json, result)
        if args.csv:
            rows = write_csv(args.csv, metrics)
            print(f"wrote {args.csv} ({plural(rows, 'request')})")
        if args.plot:
            for path in write_plots(args.plot, metrics, result):
                print(f"wrote {path}")
    except OSError as error:
        # Checked before the run; this is a disk that filled up or a folder removed since.
        print(f"kvproof sim: cannot write the results: {error.strerror}: {error.filename}",
              file=sys.stderr)


def _report_hybrid(h: dict) -> None:
    """What the real workers saw (fuzz/hybrid.py), under the summary."""
    print(f"real KV reads    {h['reads']:,} on the real decode workers, {h['reads_judged']:,} "
          f"judged against the reference, {h['reads_foreign']:,} of bytes not the request's "
          f"own ({h['requests_read_foreign']:,} requests)")
    print(f"real verdicts    leaked (Ok on foreign KV bytes) {h['leaks_real']:,}, by the page "
          f"contents {h['leaks_abstract']:,}; stopped by the tag guard {h['stopped_by_tag_guard']:,}"
          f"; disagreements {h['disagreements']:,}")
    print(f"real work        {h['prompts_computed']:,} prompts computed ({h['compute_s']:.2f} s), "
          f"decode steps {h['decode_step_s']:.2f} s, {h['bytes_copied']:,} bytes copied")
    for example in h["examples"]:
        print(f"  {example}")


def _write_itf(log: str, path: str) -> None:
    import json

    from sim.trace import log_to_itf
    _, itf = log_to_itf(log)
    with open(path, "w") as f:
        json.dump(itf, f, indent=1)
    print(f"wrote {path} ({plural(len(itf['states']) - 1, 'step')}): check it with "
          f"kvproof validate {shlex.quote(path)}")


def reproduce_command(args: argparse.Namespace, seed: int) -> str:
    """The command that reruns this run: the scenario and every option that changed it,
    with the seed made explicit, and a log to replay it from."""
    words = ["kvproof", "sim", args.scenario, "--seed", str(seed)]
    if args.requests is not None:
        words += ["--requests", str(args.requests)]
    if args.guards_on:
        words.append("--guards-on")
    for bug in args.bug:
        words += ["--bug", bug]
    if args.on_violation:
        words += ["--on-violation", args.on_violation]
    for assignment in args.set:
        words += ["--set", assignment]
    if getattr(args, "hybrid", False):
        words.append("--hybrid")
    words += ["--log", args.log or "trace.ndjson"]
    return shlex.join(words)


def _stopped_text(result: dict) -> str:
    first = result["first_violations"][0] if result["first_violations"] else None
    if not first:
        return str(result["stopped"])
    return f"{first['property']}: {first['detail']}"


def _crash_verdict(args: argparse.Namespace, result: dict) -> int:
    """A crashed shell: the exception, where, and how to get it back (exit 3)."""
    from sim.crash import one_line

    crash = result["crash"]
    print(f"SHELL CRASHED after {plural(crash['events'], 'event')}, at {crash['t']:.6f} s "
          f"simulated: {one_line(crash)}")
    if crash["line"]:
        print(f"  {crash['frame']}: {crash['line']}")
    if not args.replay:
        print(f"reproduce with seed={result['seed']}: {reproduce_command(args, result['seed'])}")
    if crash.get("log"):
        again = {True: " (a second run of the seed crashed the same way)",
                 False: " (a second run of the seed did NOT crash the same way)"}
        print(f"the events up to the crash: {crash['log']}"
              f"{again.get(crash.get('reproduced'), '')}; replay them: kvproof sim --replay "
              f"{shlex.quote(crash['log'])}")
    return EXIT_CRASH


def _verdict(args: argparse.Namespace, result: dict) -> int:
    if result.get("crash"):
        return _crash_verdict(args, result)
    real = result.get("hybrid") or {}
    bad = (result["violations"] or result["summary"]["leaked_responses"]
           or real.get("leaks_real") or real.get("disagreements"))
    if result.get("interrupted") and not bad:
        print(f"the run that wrote {args.replay} was interrupted after "
              f"{plural(result['events'], 'event')}: no verdict (nothing violated so far)")
        return EXIT_INTERRUPTED
    if result["stopped"]:
        print(f"STOPPED at the first violation: {_stopped_text(result)}")
    if bad and not args.replay:
        print(f"reproduce with seed={result['seed']}: {reproduce_command(args, result['seed'])}")
        if args.log:
            print(f"replay the log: kvproof sim --replay {shlex.quote(args.log)}")
    return EXIT_VIOLATION if bad else EXIT_OK
