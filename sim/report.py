"""What a run prints and writes: the summary table, JSON results, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from sim.metrics import Metrics


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def summary_table(result: dict) -> str:
    s = result["summary"]
    lines = [f"scenario {result['scenario']}  seed {result['seed']}  bugs: "
             f"{', '.join(result['bugs']) or 'none'}",
             f"requests {s['requests_arrived']:,} arrived, {s['requests_settled']:,} settled, "
             f"{s['simulated_s']:,.1f} s simulated, {result['events']:,} events",
             "",
             f"{'latency (ms)':<16}{'p50':>12}{'p90':>12}{'p99':>12}{'count':>10}"]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")):
        q = s[key]
        lines.append(f"{label:<16}{_ms(q['p50']):>12}{_ms(q['p90']):>12}{_ms(q['p99']):>12}"
                     f"{q['count']:>10,}")
    util = s["decode_pool_utilisation"]
    lines += ["",
              f"goodput          {s['goodput_requests_per_s']:,.2f} requests/s, "
              f"{s['goodput_tokens_per_s']:,.0f} output tokens/s",
              "answers          " + _counts(s["outcomes"]),
              f"over-pool        {s['over_pool_requests']:,} prompts longer than the prefill "
              f"pool: " + _counts(s["over_pool_outcomes"]),
              f"LEAKED RESPONSES {s['leaked_responses']:,} (over-pool {s['leaked_responses_over_pool']:,}, "
              f"returned as success {s['leaked_responses_returned_ok']:,})",
              f"decode pool      mean {util['mean']:.1%}, peak {util['peak']:.1%}",
              f"bytes moved      {s['bytes_transferred']:,}",
              "refused offers   " + _counts(result["refusals"]),
              "violations       " + (_counts(result["violations"]) or "none")]
    return "\n".join(lines)


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "none"


def write_json(path: str | Path, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def write_plots(directory: str | Path, metrics: Metrics, title: str) -> list[Path]:
    """TTFT CDF, decode pool occupancy over time and errors over time, as PNG files."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    ttft = sorted(metrics.ttft_s)
    if ttft:
        ax.plot(ttft, [(k + 1) / len(ttft) for k in range(len(ttft))])
    ax.set(xlabel="time to first token (s)", ylabel="fraction of requests",
           title=f"{title}: TTFT CDF")
    save(fig, "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    if metrics.occupancy:
        times, used = zip(*metrics.occupancy)
        ax.step(times, [u / metrics.decode_pages_total for u in used], where="post")
    ax.set(xlabel="simulated time (s)", ylabel="decode pages in use (fraction)",
           title=f"{title}: pool occupancy")
    save(fig, "pool_occupancy.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    by_kind: dict[str, list[float]] = {}
    for t, kind in metrics.errors_over_time:
        by_kind.setdefault(kind, []).append(t)
    for kind, times in sorted(by_kind.items()):
        ax.plot(times, range(1, len(times) + 1), label=kind, drawstyle="steps-post")
    if by_kind:
        ax.legend()
    ax.set(xlabel="simulated time (s)", ylabel="errors so far", title=f"{title}: errors")
    save(fig, "errors_over_time.png")
    return paths
