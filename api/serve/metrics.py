"""/metrics: Prometheus text from two sources, one registry per app.

- The engine's state, read from `engine.snapshot()` at scrape time by a collector (so a
  scrape can never disagree with the snapshot taken with it): pool pages by worker and
  state, writes in flight, queue depth, running requests, KV transfers and bytes, rejects
  by reason, guard trips by guard, core refusals by reason, outcomes by outcome.
- The server's own timings, observed as tokens leave: time to first token, inter-token
  latency, and HTTP answers by endpoint and status.

Label values are the engine's own names (worker names, guard names from GUARDS, the core's
outcome and refusal wording), so a metric, a trace line and a dashboard row read alike.
The prefix caches' per-tenant figures are labelled by tenant (GenerationRequest.tenant):
a digest of an API key the operator gave (api/serve/auth.py), or "default" without keys,
so the series are as many as the keys; a request's cache_salt, which its client chooses,
is never a label.
An HTTP answer's endpoint is its route's template (`endpoint_label`), and every path no
route serves shares one label: the set of series is fixed by the app, not by its clients.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.service import GUARDS

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0, 30.0)


class SnapshotCollector:
    """Engine state as metrics, read at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        snapshot = self.engine.snapshot()
        pages = GaugeMetricFamily("kvproof_pool_pages", "KV pool pages by worker and state",
                                  labels=["worker", "state"])
        writes = GaugeMetricFamily("kvproof_pool_writes_in_flight",
                                   "page writes posted and not yet landed", labels=["worker"])
        for pool in snapshot.pools:
            for state in ("free", "held", "tombstoned"):
                pages.add_metric([pool.worker, state], getattr(pool, state))
            pages.add_metric([pool.worker, "total"], pool.pages)
            writes.add_metric([pool.worker], pool.writes_in_flight)
        yield pages
        yield writes
        yield GaugeMetricFamily("kvproof_queue_depth", "requests waiting for admission",
                                value=snapshot.queued)
        yield GaugeMetricFamily("kvproof_running_requests", "requests admitted and not ended",
                                value=snapshot.running)
        yield CounterMetricFamily("kvproof_kv_transfers", "KV page writes landed",
                                  value=snapshot.transfers)
        yield CounterMetricFamily("kvproof_kv_transfer_bytes", "KV bytes moved between workers",
                                  value=snapshot.transfer_bytes)
        yield _by_label("kvproof_rejects", "requests rejected, by reason", "reason",
                        snapshot.rejects)
        yield _by_label("kvproof_guard_trips", "runtime guard trips, by guard", "guard",
                        {guard: 0 for guard in GUARDS} | snapshot.guard_trips)
        yield _by_label("kvproof_refusals", "events the protocol core refused, by reason",
                        "reason", snapshot.refusals)
        yield _by_label("kvproof_outcomes", "requests ended, by final client state", "outcome",
                        snapshot.outcomes)
        if snapshot.prefix:
            yield from _prefix_cache(snapshot)
        if snapshot.prefill_cache:
            yield from _prefill_cache(snapshot)


def _prefix_cache(snapshot):
    """Decode's prefix cache: its pages by worker (cached: filed under a key, read or idle;
    idle: read by nobody, evictable), the prompt pages looked up and hit, the hit ratio,
    and evictions by reason (lru: under pool pressure; unshareable: a request's own pages,
    which no prompt can hit, at its release); the guard trips of requests that read shared
    pages (a hit at either cache), by guard; and per tenant the prompt pages looked up and
    hit and the shared-page guard trips."""
    yield from _cache(snapshot, "kvproof_prefix_cache", "decode", snapshot.prefix,
                      snapshot.prefix["reserved_prompt_pages"], "cached (not sent)")
    yield _by_label("kvproof_prefix_cache_shared_guard_trips", "runtime guard trips of "
                    "requests that read shared pages (a hit at decode or the prefill), by guard",
                    "guard", {guard: 0 for guard in GUARDS} | snapshot.prefix_shared_guard_trips)
    yield from _by_tenant(snapshot, DECODE_TENANT_FIGURES)


def _prefill_cache(snapshot):
    """The prefill's prefix cache, the same figures (a hit page is one not computed; an
    unshareable page is evicted at its request's SendDone), the prompt tokens the prefill
    computed, and per tenant the prompt pages looked up and hit."""
    counts = snapshot.prefill_cache
    yield from _cache(snapshot, "kvproof_prefill_cache", "prefill", counts,
                      counts["admitted_prompt_pages"], "cached (not computed)")
    yield CounterMetricFamily("kvproof_prefill_computed_tokens", "prompt tokens the prefill "
                              "ran through the model", value=counts["computed_tokens"])
    yield from _by_tenant(snapshot, PREFILL_TENANT_FIGURES)


# Each tenant's figures (engine/service.py TenantCache): (metric, field, documentation).
DECODE_TENANT_FIGURES = (
    ("kvproof_prefix_cache_tenant_prompt_pages", "prompt_pages",
     "full prompt pages decode looked up in its cache, by tenant"),
    ("kvproof_prefix_cache_tenant_hit_pages", "hit_pages",
     "prompt pages decode found cached (not sent), by tenant"),
    ("kvproof_prefix_cache_tenant_shared_guard_trips", "shared_guard_trips",
     "runtime guard trips of requests that read shared pages, by tenant"))
PREFILL_TENANT_FIGURES = (
    ("kvproof_prefill_cache_tenant_prompt_pages", "prefill_prompt_pages",
     "full prompt pages the prefill looked up in its cache, by tenant"),
    ("kvproof_prefill_cache_tenant_hit_pages", "prefill_hit_pages",
     "prompt pages the prefill found cached (not computed), by tenant"))


def _by_tenant(snapshot, figures):
    tenants = snapshot.prefix_tenants
    for name, figure, documentation in figures:
        yield _by_label(name, documentation, "tenant",
                        {tenant: getattr(counts, figure) for tenant, counts in tenants.items()})


def _cache(snapshot, name: str, side: str, counts: dict, looked_up: int, hit: str):
    pages = GaugeMetricFamily(f"{name}_pages", f"{side} pages in the prefix cache, by "
                              "worker and state", labels=["worker", "state"])
    for pool in snapshot.pools:
        if pool.worker.startswith(side):
            pages.add_metric([pool.worker, "cached"], pool.cached)
            pages.add_metric([pool.worker, "idle"], pool.cached_idle)
    yield pages
    yield CounterMetricFamily(f"{name}_prompt_pages", f"full prompt pages {side} looked up "
                              "in its cache", value=looked_up)
    yield CounterMetricFamily(f"{name}_hit_pages", f"prompt pages {side} found {hit}",
                              value=counts["hit_pages"])
    yield GaugeMetricFamily(f"{name}_hit_ratio", "hit pages over prompt pages looked up, "
                            "since start",
                            value=counts["hit_pages"] / looked_up if looked_up else 0.0)
    yield _by_label(f"{name}_evicted_pages", "cached pages evicted, by reason",
                    "reason", {"lru": counts["evicted_lru_pages"],
                               "unshareable": counts["evicted_unshareable_pages"]})


def _by_label(name: str, documentation: str, label: str, counts: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in sorted(counts.items()):
        family.add_metric([str(value)], count)
    return family


class ServerMetrics:
    """The registry of one app: the engine's collector and the server's own timings."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(SnapshotCollector(engine))
        self.time_to_first_token = Histogram(
            "kvproof_time_to_first_token_seconds", "from request received to first token sent",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.inter_token_latency = Histogram(
            "kvproof_inter_token_latency_seconds", "between consecutive tokens of a choice",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.responses = Counter("kvproof_http_responses", "answers by endpoint and status",
                                 ["endpoint", "status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


UNMATCHED_ENDPOINT = "unmatched"  # every path no route serves: one series, not one a path


def endpoint_label(scope, routes=()) -> str:
    """The route template that serves the request ("/v1/models/{model_id}"), never the raw
    path: a client must not be able to make a time series per URL it invents. The router
    puts the route in the scope; before routing (the body limit) `routes` are matched."""
    route = scope.get("route")
    if route is None:
        from starlette.routing import Match

        route = next((r for r in routes if r.matches(scope)[0] != Match.NONE), None)
    return getattr(route, "path_format", None) or getattr(route, "path", UNMATCHED_ENDPOINT)
