"""Metrics of a run, folded from its event log alone (so a replay reproduces them exactly).

Besides the aggregates, the first REQUEST_ROWS_MAX requests keep a row each (arrival, prompt
pages, output tokens, time to first token, answer, leaked or not) for `--csv`; beyond that
bound a run of millions of requests would hold them all in memory, so rows stop and the
CSV says it is cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spec.core import CLIENT, CLIENT_NAMES, GONE, IDLE, OK, WAITING


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile by the nearest-rank method (exact, no interpolation)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


REQUEST_ROWS_MAX = 1_000_000
REQUEST_COLUMNS = ("request", "arrival_s", "prompt_pages", "output_tokens", "over_pool",
                   "ttft_s", "e2e_s", "tpot_s", "answer", "leaked")


def slo_attainment(values_s: list[float], target_s: float) -> float | None:
    """The fraction of values within the target; None when there are none."""
    if not values_s:
        return None
    return sum(1 for v in values_s if v <= target_s) / len(values_s)


@dataclass
class Metrics:
    page_bytes: int
    prefill_pages: int      # one worker's pool: a prompt longer than this cannot fit
    decode_pages_total: int
    arrived: int = 0
    settled: int = 0
    arrival_s: dict = field(default_factory=dict)
    first_token_s: dict = field(default_factory=dict)
    output_tokens: dict = field(default_factory=dict)
    over_pool: set = field(default_factory=set)   # live requests whose prompt exceeds the pool
    over_pool_arrived: int = 0
    ttft_s: list = field(default_factory=list)
    tpot_s: list = field(default_factory=list)
    e2e_s: list = field(default_factory=list)
    outcomes: dict = field(default_factory=dict)   # client answer name -> count
    over_pool_outcomes: dict = field(default_factory=dict)
    leaks: int = 0              # responses built on pages that were not the request's own
    leaks_over_pool: int = 0
    leaks_ok: int = 0
    pages_written: int = 0
    decode_pages_used: int = 0
    occupancy: list = field(default_factory=list)   # (t, decode pages used), on change
    occupancy_by_worker: dict = field(default_factory=dict)  # decode worker -> its (t, used)
    decode_workers: int = 1
    errors_over_time: list = field(default_factory=list)  # (t, answer name)
    ok_output_tokens: int = 0
    last_event_s: float = 0.0
    fits_pages: int = 0     # a prompt of at most this many pages fits every pool and context
    fitting: set = field(default_factory=set)   # live requests whose prompt fits
    fitting_outcomes: dict = field(default_factory=dict)  # their answers, name -> count
    leaks_over_time: list = field(default_factory=list)   # (t, request), as errors are
    request_rows: dict = field(default_factory=dict)      # request -> row, first ones only
    # Prefix caching (issue 27): at each Reserve, the prompt's pages and how many decode
    # held cached (its hit); at each Admit, the prompt's pages and how many the prefill
    # computes (core.pages_to_compute: all but those its own cache held, PCACHED); pages
    # each side's cache evicted. Zero hits without a cache.
    reserved_prompt_pages: int = 0
    hit_pages: int = 0
    full_hits: int = 0
    admitted_prompt_pages: int = 0
    computed_pages: int = 0
    evicted_pages: int = 0
    prefill_evicted_pages: int = 0

    def arrive(self, t: float, r: int, prompt_pages: int, output_tokens: int) -> None:
        self.arrived += 1
        self.arrival_s[r] = t
        self.output_tokens[r] = output_tokens
        if prompt_pages > self.prefill_pages:
            self.over_pool.add(r)
            self.over_pool_arrived += 1
        if prompt_pages <= self.fits_pages:
            self.fitting.add(r)
        if len(self.request_rows) < REQUEST_ROWS_MAX:
            self.request_rows[r] = {
                "request": r, "arrival_s": t, "prompt_pages": prompt_pages,
                "output_tokens": output_tokens, "over_pool": r in self.over_pool,
                "ttft_s": None, "e2e_s": None, "tpot_s": None, "answer": None, "leaked": False}

    def reserved(self, prompt_pages: int, hit_pages: int) -> None:
        self.reserved_prompt_pages += prompt_pages
        self.hit_pages += hit_pages
        self.full_hits += hit_pages == prompt_pages

    def admitted(self, prompt_pages: int, computed_pages: int) -> None:
        self.admitted_prompt_pages += prompt_pages
        self.computed_pages += computed_pages

    def first_token(self, t: float, r: int) -> None:
        self.first_token_s[r] = t
        self.ttft_s.append(t - self.arrival_s[r])
        self._row(r, ttft_s=t - self.arrival_s[r])

    def answered(self, t: float, r: int, old: tuple, new: tuple) -> None:
        """The client's state moved from waiting (or idle) to an answer."""
        if new[CLIENT] == old[CLIENT] or old[CLIENT] not in (IDLE, WAITING):
            return
        if new[CLIENT] in (WAITING, GONE):
            if new[CLIENT] == GONE:
                self._count(r, "Gone")
                self._row(r, answer="Gone")
            return
        name = CLIENT_NAMES[new[CLIENT]]
        self._count(r, name)
        self.e2e_s.append(t - self.arrival_s[r])
        self._row(r, answer=name, e2e_s=t - self.arrival_s[r])
        if new[CLIENT] == OK:
            self.ok_output_tokens += self.output_tokens[r]
            first = self.first_token_s.get(r)
            if first is not None and self.output_tokens[r] > 1:
                self.tpot_s.append((t - first) / (self.output_tokens[r] - 1))
                self._row(r, tpot_s=self.tpot_s[-1])
        else:
            self.errors_over_time.append((t, name))

    def _count(self, r: int, name: str) -> None:
        self.outcomes[name] = self.outcomes.get(name, 0) + 1
        if r in self.fitting:
            self.fitting_outcomes[name] = self.fitting_outcomes.get(name, 0) + 1
        if r in self.over_pool:
            self.over_pool_outcomes[name] = self.over_pool_outcomes.get(name, 0) + 1

    def _row(self, r: int, **values) -> None:
        row = self.request_rows.get(r)
        if row is not None:
            row.update(values)

    def leak(self, r: int, ok: bool) -> None:
        # The fold sets last_event_s before it observes the event that leaked.
        self.leaks_over_time.append((self.last_event_s, r))
        self._row(r, leaked=True)
        self.leaks += 1
        self.leaks_over_pool += r in self.over_pool
        self.leaks_ok += ok

    def decode_pages_changed(self, t: float, used: int, worker: int = 0,
                             worker_used: int | None = None) -> None:
        """Decode pages in use over all workers, and on the one worker whose pool changed."""
        if used != self.decode_pages_used:
            self.decode_pages_used = used
            self.occupancy.append((t, used))
        if worker_used is not None:
            series = self.occupancy_by_worker.setdefault(worker, [])
            if not series or series[-1][1] != worker_used:
                series.append((t, worker_used))

    def forget(self, r: int) -> None:
        self.settled += 1
        assert self.settled <= self.arrived, f"request {r} settled twice"
        self.arrival_s.pop(r, None)
        self.first_token_s.pop(r, None)
        self.output_tokens.pop(r, None)
        self.over_pool.discard(r)
        self.fitting.discard(r)

    def summary(self) -> dict:
        """Every figure of the run, as plain JSON-able values."""
        span = self.last_event_s or 1e-9
        return {
            "requests_arrived": self.arrived,
            "requests_settled": self.settled,
            "simulated_s": self.last_event_s,
            "ttft_s": _quantiles(self.ttft_s),
            "tpot_s": _quantiles(self.tpot_s),
            "e2e_s": _quantiles(self.e2e_s),
            "goodput_requests_per_s": self.outcomes.get("Ok", 0) / span,
            "goodput_tokens_per_s": self.ok_output_tokens / span,
            "outcomes": dict(sorted(self.outcomes.items())),
            "over_pool_requests": self.over_pool_arrived,
            "over_pool_outcomes": dict(sorted(self.over_pool_outcomes.items())),
            "fitting_outcomes": dict(sorted(self.fitting_outcomes.items())),
            "leaked_responses": self.leaks,
            "leaked_responses_over_pool": self.leaks_over_pool,
            "leaked_responses_returned_ok": self.leaks_ok,
            "decode_pool_utilisation": self._utilisation(span),
            "bytes_transferred": self.pages_written * self.page_bytes,
        }

    def _utilisation(self, span: float) -> dict:
        """Time-weighted mean and the peak of decode pages in use, as fractions of all."""
        area, last_t, last_used, peak = 0.0, 0.0, 0, 0
        for t, used in self.occupancy:
            area += (t - last_t) * last_used
            last_t, last_used = t, used
            peak = max(peak, used)
        area += (span - last_t) * last_used
        total = self.decode_pages_total
        return {"mean": area / span / total, "peak": peak / total}


def _quantiles(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "count": len(values)}
