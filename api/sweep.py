"""`kvproof sim SCENARIO --sweep FIELD=V1,V2,...`: one run per value of one field.

Points are independent runs of fully built scenarios (the seed included), so with `--jobs N`
(a process pool) or `--ray ADDRESS` (api/campaigns.py) they give exactly the results of one
process.
Every point is validated before the first one runs.
"""

from __future__ import annotations

import argparse
import copy
import sys
from api.campaigns import parallel_map
from api.clikit import EXIT_CRASH, EXIT_OK, EXIT_VIOLATION, UsageError
from sim.scenario import Scenario

COLUMNS = ("value", "settled", "ok", "errors", "leaked", "violations", "TTFT p50 ms",
           "TTFT p99 ms", "goodput req/s", "TTFT SLO")


def run_point(point: tuple[dict, float, float]) -> dict:
    """One run (anywhere): its result, with SLO attainment. `point` is the scenario's data
    and the two SLO targets in milliseconds."""
    data, slo_ttft_ms, slo_tpot_ms = point
    from sim.report import slo_summary
    from sim.run import simulate

    result, sim = simulate(Scenario.model_validate(data))
    result["slo"] = slo_summary(sim.folder.metrics, slo_ttft_ms, slo_tpot_ms)
    return result


def _points(args: argparse.Namespace) -> tuple[str, list[tuple[str, dict]]]:
    from api.sim_command import _assign, _parse_assignment, build_scenario, scenario_data

    field, values = _parse_assignment(args.sweep, "--sweep")
    _refuse_a_second_value(args, field)
    texts = [v.strip() for v in values.split(",") if v.strip()]
    if len(texts) < 2:
        raise UsageError(f"--sweep {args.sweep}: give at least two values, comma-separated")
    base = scenario_data(args)
    points = []
    for text in texts:
        data = copy.deepcopy(base)
        _assign(data, field, text)
        points.append((text, build_scenario(args, data).model_dump(mode="json")))
    return field, points


# The options that set a scenario field themselves, with the field each one sets.
FIELD_FLAGS = {"--seed": ("seed", "seed"), "--requests": ("requests", "requests"),
               "--bug": ("bug", "bugs"), "--guards-on": ("guards_on", "bugs"),
               "--on-violation": ("on_violation", "oracles.on_violation")}


def _refuse_a_second_value(args: argparse.Namespace, field: str) -> None:
    """A swept field given a value too (by --set, or an option that sets it) would leave it
    to the order of the overrides which one wins: refuse it, naming both."""
    from api.sim_command import _parse_assignment

    def overlaps(other: str) -> bool:
        return other == field or other.startswith(field + ".") or field.startswith(other + ".")

    for assignment in args.set:
        other = _parse_assignment(assignment, "--set")[0]
        if overlaps(other):
            raise UsageError(f"--sweep {field} and --set {assignment} both set {other}: "
                             "which value holds would be ambiguous; drop one")
    for flag, (name, other) in FIELD_FLAGS.items():
        if getattr(args, name) not in (None, False, []) and overlaps(other):
            raise UsageError(f"--sweep {field} and {flag} both set {other}: which value "
                             "holds would be ambiguous; drop one")


def _row(value: str, result: dict) -> tuple:
    s = result["summary"]
    outcomes = s["outcomes"]
    errors = sum(n for name, n in outcomes.items() if name not in ("Ok", "Gone"))
    ttft = s["ttft_s"]

    def ms(x):
        return "-" if x is None else f"{x * 1000:,.1f}"
    slo = result["slo"]["ttft_attained"]
    return (value, f"{s['requests_settled']:,}", f"{outcomes.get('Ok', 0):,}", f"{errors:,}",
            f"{s['leaked_responses']:,}", f"{sum(result['violations'].values()):,}",
            ms(ttft["p50"]), ms(ttft["p99"]), f"{s['goodput_requests_per_s']:,.2f}",
            "-" if slo is None else f"{slo:.1%}")


def format_table(field: str, rows: list[tuple]) -> str:
    header = (field,) + COLUMNS[1:]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = ["  ".join(f"{x:>{w}}" for x, w in zip(line, widths)) for line in [header, *rows]]
    return "\n".join(lines)


def _plot(directory: str, field: str, values: list[str], results: list[dict], title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    Path(directory).mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    p99 = [(r["summary"]["ttft_s"]["p99"] or 0) * 1000 for r in results]
    ax.plot(values, p99, marker="o", label="TTFT p99 (ms)")
    ax.set(xlabel=field, ylabel="TTFT p99 (ms)")
    other = ax.twinx()
    other.plot(values, [r["summary"]["leaked_responses"] for r in results], marker="x",
               color="red", label="leaked responses")
    other.set_ylabel("leaked responses")
    ax.set_title(f"sweep of {field}\n{title}", fontsize=9)
    fig.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(directory) / "sweep.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_sweep(args: argparse.Namespace) -> int:
    from api.sim_command import reproduce_command

    field, points = _points(args)
    first = points[0][1]
    print(f"kvproof sim: sweep of {field} over {', '.join(v for v, _ in points)}; scenario "
          f"{first['name']}, seed {first['seed']}"
          + (f"; Ray at {args.ray}" if args.ray else
             f"; {args.jobs} processes" if args.jobs > 1 else ""), flush=True)
    results = parallel_map(run_point, [(d, args.slo_ttft_ms, args.slo_tpot_ms)
                                       for _, d in points], args.jobs, args.ray)
    print(format_table(field, [_row(v, r) for (v, _), r in zip(points, results)]))
    if args.plot:
        bugs = "+".join(first["bugs"]) or "no bugs"
        title = f"{first['name']}, seed {first['seed']}, {bugs}"
        print(f"wrote {_plot(args.plot, field, [v for v, _ in points], results, title)}")
    bad = [(v, r) for (v, _), r in zip(points, results)
           if r["violations"] or r["summary"]["leaked_responses"]]
    for value, result in bad:
        point = copy.copy(args)
        point.set = [*args.set, f"{field}={value}"]
        print(f"{field}={value}: reproduce with seed={result['seed']}: "
              f"{reproduce_command(point, result['seed'])}")
    crashed = [(v, r) for (v, _), r in zip(points, results) if r.get("crash")]
    for value, result in crashed:
        from sim.crash import one_line

        point = copy.copy(args)
        point.set = [*args.set, f"{field}={value}"]
        print(f"{field}={value}: SHELL CRASHED: {one_line(result['crash'])}; reproduce with "
              f"seed={result['seed']}: {reproduce_command(point, result['seed'])}")
    sys.stdout.flush()
    return EXIT_CRASH if crashed else EXIT_VIOLATION if bad else EXIT_OK
