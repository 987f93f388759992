"""What a run prints and writes: the summary table, JSON results, a per-request CSV, PNG
plots. Latencies are in milliseconds everywhere a person reads them (table and plots);
JSON keeps seconds, the unit in its key names."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sim.metrics import REQUEST_COLUMNS, REQUEST_ROWS_MAX, Metrics, slo_attainment


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word if count == 1 else word + 's'}"


def human_bytes(count: int) -> str:
    """Decimal units (what link bandwidths are quoted in), with the exact count after."""
    value, unit = float(count), "B"
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if value < 1000 or unit == "PB":
            break
        value /= 1000
    if unit == "B":
        return f"{count:,} bytes"
    return f"{value:,.2f} {unit} ({count:,} bytes)"


def slo_summary(metrics: Metrics, ttft_ms: float, tpot_ms: float) -> dict:
    """SLO attainment: the share of first tokens within the TTFT target and of successful
    requests whose mean time per output token is within the TPOT target."""
    return {"ttft_target_ms": ttft_ms, "tpot_target_ms": tpot_ms,
            "ttft_attained": slo_attainment(metrics.ttft_s, ttft_ms / 1000),
            "ttft_count": len(metrics.ttft_s),
            "tpot_attained": slo_attainment(metrics.tpot_s, tpot_ms / 1000),
            "tpot_count": len(metrics.tpot_s)}


def _slo_line(slo: dict) -> str:
    def part(name: str, key: str) -> str:
        share = slo[f"{key}_attained"]
        target = f"{name} <= {slo[f'{key}_target_ms']:,g} ms"
        if share is None:
            return f"{target}: no data"
        return f"{target}: {share:.1%} of {slo[f'{key}_count']:,}"
    return f"SLO attainment   {part('TTFT', 'ttft')}; {part('TPOT', 'tpot')}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def summary_table(result: dict) -> str:
    s = result["summary"]
    lines = [f"scenario {result['scenario']}  seed {result['seed']}  bugs: "
             f"{', '.join(result['bugs']) or 'none'}",
             f"requests {s['requests_arrived']:,} arrived, {s['requests_settled']:,} settled, "
             f"{s['simulated_s']:,.1f} s simulated, {_plural(result['events'], 'event')}",
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
              f"bytes moved      {human_bytes(s['bytes_transferred'])}",
              "refused offers   " + _counts(result["refusals"]),
              "violations       " + (_counts(result["violations"]) or "none")]
    for k, (kind, hit) in enumerate(sorted(result.get("fault_hits", {}).items())):
        lines.append(f"{'fault hits' if k == 0 else '':<17}{kind}: {hit['hits']:,} of "
                     f"{hit['fired']:,} fired {hit['target']}")
    if "prefix" in result:
        lines.append(prefix_line(result["prefix"]))
    if "slo" in result:
        after_latencies = next(k for k, line in enumerate(lines) if line.startswith("end-to-end"))
        lines.insert(after_latencies + 1, _slo_line(result["slo"]))
    return "\n".join(lines)


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "none"


def write_json(path: str | Path, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def write_csv(path: str | Path, metrics: Metrics) -> int:
    """One row per request (the first REQUEST_ROWS_MAX); the number of rows written."""
    rows = list(metrics.request_rows.values())
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    if len(rows) == REQUEST_ROWS_MAX:
        print(f"note: {path} holds the first {REQUEST_ROWS_MAX:,} requests only")
    return len(rows)


def plot_title(result: dict) -> str:
    """What a plot shows, enough to reproduce it: scenario, seed and switches."""
    import textwrap

    bugs = ", ".join(result["bugs"]) or "none"
    return "\n".join(textwrap.wrap(f"{result['scenario']}, seed {result['seed']}, bugs: {bugs}",
                                    70))


def write_plots(directory: str | Path, metrics: Metrics, result: dict) -> list[Path]:
    """TTFT CDF, decode pool occupancy over time, and errors and leaked responses over
    time, as PNG files; a plot with nothing to show says so on its face."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    title = plot_title(result)
    paths = []

    def save(fig, ax, name: str, what: str, empty: bool) -> None:
        ax.set_title(f"{what}\n{title}", fontsize=8)
        if empty:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                    fontsize=14, color="grey")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    ttft_ms = sorted(v * 1000 for v in metrics.ttft_s)
    if ttft_ms:
        ax.plot(ttft_ms, [(k + 1) / len(ttft_ms) for k in range(len(ttft_ms))])
    ax.set(xlabel="time to first token (ms)", ylabel="fraction of requests")
    save(fig, ax, "ttft_cdf.png", "TTFT CDF", not ttft_ms)

    fig, ax = plt.subplots(figsize=(6, 4))
    if metrics.occupancy:
        times, used = zip(*metrics.occupancy)
        ax.step(times, [u / metrics.decode_pages_total for u in used], where="post",
                label="all workers", color="black")
    per_worker = sorted(metrics.occupancy_by_worker.items())
    workers = metrics.decode_workers
    pool = metrics.decode_pages_total / workers  # one worker's pages
    for worker, series in per_worker if workers > 1 else ():
        times, used = zip(*series)
        ax.step(times, [u / pool for u in used], where="post", linewidth=0.8, alpha=0.7,
                label=f"decode {worker}")
    if workers > 1:
        ax.legend(fontsize=6, ncol=2)
    ax.set(xlabel="simulated time (s)", ylabel="decode pages in use (fraction of the pool)")
    save(fig, ax, "pool_occupancy.png", "decode pool occupancy", not metrics.occupancy)

    fig, ax = plt.subplots(figsize=(6, 4))
    by_kind: dict[str, list[float]] = {}
    for t, kind in metrics.errors_over_time:
        by_kind.setdefault(kind, []).append(t)
    for kind, times in sorted(by_kind.items()):
        ax.plot(times, range(1, len(times) + 1), label=f"error {kind}", drawstyle="steps-post")
    leaks = [t for t, _ in metrics.leaks_over_time]
    if leaks:
        # Leaked responses are answered as success: they are not errors, and they are what
        # a plot of this run must not hide.
        ax.plot(leaks, range(1, len(leaks) + 1), label="LEAKED response (answered Ok)",
                drawstyle="steps-post", color="red", linewidth=2)
    if by_kind or leaks:
        ax.legend(fontsize=8)
    ax.set(xlabel="simulated time (s)", ylabel="answers so far")
    save(fig, ax, "errors_over_time.png", "errors and leaked responses", not (by_kind or leaks))
    return paths


# -- prefix caching (issue 27) ---------------------------------------------------------------

def prefix_summary(metrics: Metrics, scenario) -> dict:
    """How much the prefix cache saved in one run. The hit rate is the decode-side hit: of
    the prompt pages decode reserved for, how many it held cached. Transfer pages saved are
    the hits (the prefill sends only the rest, core.to_send); compute pages saved are the
    admitted prompt pages the prefill did not compute (core.pages_to_compute: those its own
    cache held, none while only decode caches), and the prefill hit rate is their share of
    the admitted prompt pages."""
    m = metrics
    saved = m.admitted_prompt_pages - m.computed_pages
    return {"shape": scenario.prefix.shape, "cache": scenario.prefix.cache,
            "prefill_cache": scenario.prefix.prefill_cache,
            "tenants": scenario.prefix.tenants,
            "prompt_pages": m.reserved_prompt_pages, "hit_pages": m.hit_pages,
            "hit_rate": m.hit_pages / m.reserved_prompt_pages if m.reserved_prompt_pages else 0.0,
            "full_hits": m.full_hits, "pages_sent": m.pages_written,
            "transfer_pages_saved": m.hit_pages,
            "admitted_prompt_pages": m.admitted_prompt_pages, "pages_computed": m.computed_pages,
            "compute_pages_saved": saved,
            "prefill_hit_rate": saved / m.admitted_prompt_pages if m.admitted_prompt_pages
            else 0.0,
            "pages_evicted": m.evicted_pages, "prefill_pages_evicted": m.prefill_evicted_pages}


def prefix_line(p: dict) -> str:
    if not p["cache"]:
        return f"prefix cache     off ({p['shape']} prompts): every page sent and computed"
    line = (f"prefix cache     hit rate {p['hit_rate']:.1%} ({p['hit_pages']:,} of "
            f"{p['prompt_pages']:,} prompt pages, {p['full_hits']:,} full hits); "
            f"{p['pages_evicted']:,} pages evicted")
    if not p["prefill_cache"]:
        return line
    return (f"{line}\n{'':17}at the prefill: hit rate {p['prefill_hit_rate']:.1%} "
            f"({p['compute_pages_saved']:,} of {p['admitted_prompt_pages']:,} prompt pages "
            f"not computed); {p['prefill_pages_evicted']:,} pages evicted")


def compare_prefix_cache(on: dict, off: dict) -> dict:
    """The same workload (seed, arrivals, prompts) with the prefix cache on (decode's, and
    the prefill's where the scenario has it) and off: what the cache saved, in pages and
    in time to first token."""
    def ttft(result: dict) -> dict:
        q = result["summary"]["ttft_s"]
        return {"p50": q["p50"], "p99": q["p99"], "count": q["count"]}
    p_on, p_off = on["prefix"], off["prefix"]
    return {"scenario": on["scenario"], "seed": on["seed"], "shape": p_on["shape"],
            "hit_rate": p_on["hit_rate"], "hit_pages": p_on["hit_pages"],
            "prompt_pages": p_on["prompt_pages"], "full_hits": p_on["full_hits"],
            "prefill_cache": p_on["prefill_cache"], "prefill_hit_rate": p_on["prefill_hit_rate"],
            "prefill_pages_evicted": p_on["prefill_pages_evicted"],
            "pages_sent": {"on": p_on["pages_sent"], "off": p_off["pages_sent"]},
            "pages_computed": {"on": p_on["pages_computed"], "off": p_off["pages_computed"]},
            "transfer_pages_saved": p_off["pages_sent"] - p_on["pages_sent"],
            "compute_pages_saved": p_off["pages_computed"] - p_on["pages_computed"],
            "pages_evicted": p_on["pages_evicted"],
            "ttft_s": {"on": ttft(on), "off": ttft(off)},
            "answers": {"on": on["summary"]["outcomes"], "off": off["summary"]["outcomes"]}}


def prefix_comparison_table(c: dict) -> str:
    """The comparison, and where the TTFT gain comes from: pages not sent (decode's cache)
    and pages not computed (the prefill's own cache; zero while only decode caches)."""
    sent, computed, t_on, t_off = c["pages_sent"], c["pages_computed"], *c["ttft_s"].values()

    def saved(off: int, on: int) -> str:
        return f"saved {off - on:,} ({(off - on) / off:.1%})" if off else "saved 0"
    source = []
    if c["transfer_pages_saved"]:
        source.append(f"{c['transfer_pages_saved']:,} transfer pages not sent")
    if c["compute_pages_saved"]:
        source.append(f"{c['compute_pages_saved']:,} prompt pages not computed")
    if not c["compute_pages_saved"]:
        source.append("no compute saved: only decode caches, the prefill computes every "
                      "prompt page (core.pages_to_compute)")
    return "\n".join([
        f"prefix cache on vs off: scenario {c['scenario']} ({c['shape']}), seed {c['seed']}, "
        "same arrivals and prompts",
        f"{'':<18}{'on':>14}{'off':>14}",
        f"{'TTFT p50 (ms)':<18}{_ms(t_on['p50']):>14}{_ms(t_off['p50']):>14}",
        f"{'TTFT p99 (ms)':<18}{_ms(t_on['p99']):>14}{_ms(t_off['p99']):>14}",
        f"{'pages sent':<18}{sent['on']:>14,}{sent['off']:>14,}   {saved(sent['off'], sent['on'])}",
        f"{'pages computed':<18}{computed['on']:>14,}{computed['off']:>14,}   "
        f"{saved(computed['off'], computed['on'])}",
        f"hit rate          {c['hit_rate']:.1%} ({c['hit_pages']:,} of {c['prompt_pages']:,} "
        f"prompt pages hit at decode, {c['full_hits']:,} full hits, "
        f"{c['pages_evicted']:,} pages evicted)",
        *([f"prefill hit rate  {c['prefill_hit_rate']:.1%} ({c['compute_pages_saved']:,} "
           f"prompt pages held cached at the prefill, {c['prefill_pages_evicted']:,} pages "
           f"evicted there)"] if c["prefill_cache"] else []),
        "the TTFT gain comes from: " + "; ".join(source)])


def write_prefix_plot(directory: str | Path, on: Metrics, off: Metrics, c: dict) -> Path:
    """TTFT CDFs with the cache on and off, and the pages sent and computed in each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(10, 4))
    for metrics, label in ((on, "cache on"), (off, "cache off")):
        ttft_ms = sorted(v * 1000 for v in metrics.ttft_s)
        cdf.plot(ttft_ms, [(k + 1) / len(ttft_ms) for k in range(len(ttft_ms))], label=label)
    cdf.set(xlabel="time to first token (ms)", ylabel="fraction of requests")
    cdf.legend(fontsize=8)
    kinds = ("pages sent", "pages computed")
    values = {"cache on": (c["pages_sent"]["on"], c["pages_computed"]["on"]),
              "cache off": (c["pages_sent"]["off"], c["pages_computed"]["off"])}
    for k, (label, heights) in enumerate(values.items()):
        bars.bar([x + 0.4 * k for x in range(len(kinds))], heights, width=0.4, label=label)
    bars.set_xticks([x + 0.2 for x in range(len(kinds))], kinds)
    bars.set(ylabel="pages")
    bars.legend(fontsize=8)
    fig.suptitle(f"prefix cache on vs off: {c['scenario']} ({c['shape']}), seed {c['seed']}; "
                 f"hit rate {c['hit_rate']:.1%}", fontsize=9)
    fig.tight_layout()
    path = out / "prefix_cache.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
