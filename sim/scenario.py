"""Scenarios: what cluster, what load, what faults — one TOML file each, validated here.

pydantic sits at this edge only (STYLE 6): a scenario file is user input, so every field is
typed, bounded and named with its unit, unknown keys are errors, and a bad file is reported
with the field's path. Inside the simulator the validated Scenario is frozen.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      model_validator)

from sim.compute import CalibratedTables, ComputeFileError, read_compute_file
from sim.compute import explain as _explain
from spec.model import ALL_BUGS

SCENARIO_DIR = Path(__file__).parent / "scenarios"


class ScenarioError(ValueError):
    """A scenario file or option that cannot be used (the user's input, reported clearly)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Lengths(_Strict):
    """A token-length distribution, clipped to [min_tokens, max_tokens]."""

    distribution: Literal["fixed", "uniform", "lognormal", "pareto"] = "lognormal"
    median_tokens: float = Field(1024, gt=0)
    sigma: float = Field(1.0, ge=0, le=5)        # lognormal spread
    alpha: float = Field(1.5, gt=0.1, le=10)     # pareto tail index (heavier when smaller)
    min_tokens: int = Field(1, ge=1)
    max_tokens: int = Field(131072, ge=1, le=1 << 24)

    @model_validator(mode="after")
    def _ordered(self) -> "Lengths":
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self


class Cluster(_Strict):
    prefill_workers: int = Field(2, ge=1, le=1024)
    decode_workers: int = Field(2, ge=1, le=1024)
    page_tokens: int = Field(256, ge=1, le=1 << 20)
    prefill_pool_tokens: int = Field(262144, ge=1)
    decode_pool_tokens: int = Field(524288, ge=1)
    context_tokens: int = Field(131072, ge=1)    # what the router advertises
    router: Literal["round-robin", "least-loaded"] = "round-robin"
    decode_batch_max: int = Field(64, ge=1, le=4096)

    @property
    def prefill_pages(self) -> int:
        return self.prefill_pool_tokens // self.page_tokens

    @property
    def decode_pages(self) -> int:
        return self.decode_pool_tokens // self.page_tokens

    @property
    def context_pages(self) -> int:
        return math.ceil(self.context_tokens / self.page_tokens)

    @model_validator(mode="after")
    def _pools_hold_a_page(self) -> "Cluster":
        if self.prefill_pages < 1 or self.decode_pages < 1:
            raise ValueError("each KV pool must hold at least one page (pool_tokens >= page_tokens)")
        if self.prefill_pages > 1 << 20 or self.decode_pages > 1 << 20:
            raise ValueError("more than 2^20 pages per pool: use larger pages")
        return self


class Workload(_Strict):
    # trace: arrivals, prompt and output lengths read from trace_file (sim/workload.py)
    arrival: Literal["poisson", "bursty", "closed", "trace"] = "poisson"
    trace_file: str | None = None
    rate_per_s: float = Field(10.0, gt=0, le=1e6)     # poisson and bursty: mean arrival rate
    burst_size: int = Field(8, ge=1, le=10000)        # bursty: requests per burst
    sessions: int = Field(8, ge=1, le=100000)         # closed loop: concurrent sessions
    think_time_s: float = Field(0.5, ge=0, le=3600)   # closed loop: pause between requests
    prompt: Lengths = Lengths()
    output: Lengths = Lengths(median_tokens=128, sigma=0.8, max_tokens=8192)

    @model_validator(mode="after")
    def _trace_has_a_file(self) -> "Workload":
        if (self.arrival == "trace") != (self.trace_file is not None):
            raise ValueError("workload.trace_file is given exactly when workload.arrival is "
                             "'trace'")
        return self


class Prefix(_Strict):
    """Shared prefixes in the prompts and decode's prefix cache (issue 27; spec/README.md,
    Prefix caching). A prompt is a sequence of abstract page tokens with a salt (its
    tenant): `shape` says how prompts share pages (sim/workload.py, PromptMaker), and the
    workload's prompt lengths are then the length of each prompt's own part (its question,
    its new turn). `cache` turns decode's cache on; off, the same prompts arrive at the
    same moments and every page is sent (what --compare-prefix-cache compares).
    `prefill_cache` (with `cache`) turns the prefill's own cache on too (the spec's
    PrefillCache): a prefill that holds a prompt's prefix computes only the rest. It is
    off unless a scenario says so, so that a log or scenario file written before it
    existed still runs as it ran; the shipped prefix scenarios turn it on."""
    shape: Literal["none", "system-prompt", "sessions", "document"] = "none"
    cache: bool = False
    prefill_cache: bool = False
    tenants: int = Field(2, ge=1, le=1_000_000)       # salts; requests draw one uniformly
    shared_tokens: int = Field(4096, ge=1)            # the system prompt, or each document
    documents: int = Field(4, ge=1, le=1_000_000)     # document: how many, drawn uniformly
    sessions: int = Field(16, ge=1, le=1_000_000)     # sessions: conversations, drawn uniformly

    @model_validator(mode="after")
    def _cache_needs_prompts(self) -> "Prefix":
        if self.cache and self.shape == "none":
            raise ValueError("prefix.cache needs prompts with tokens: set prefix.shape "
                             "(system-prompt, sessions or document)")
        if self.prefill_cache and not self.cache:
            raise ValueError("prefix.prefill_cache needs prefix.cache (the prefill caches "
                             "what decode's cache keys: set both)")
        return self


class Compute(_Strict):
    prefill_tokens_per_s: float = Field(20000.0, gt=0)
    # A prompt is computed in one stretch of prompt/throughput seconds; each chunk of this
    # many tokens computed on the way renews decode's transfer lease (sim/lease.py).
    prefill_chunk_tokens: int = Field(8192, ge=1)
    decode_step_base_s: float = Field(0.010, ge=0)
    decode_step_per_request_s: float = Field(0.0002, ge=0)
    decode_step_per_context_token_s: float = Field(1e-8, ge=0)
    # A compute model file (`kvproof sim calibrate --out FILE`): its measured tables replace
    # the coefficients above (sim/compute.py). A relative path is read from the scenario
    # file's folder (the working folder for --set). Loading copies the tables into `tables`
    # and makes `model` absolute, so a run's log holds them and replays without the file.
    model: str | None = None
    tables: CalibratedTables | None = None
    # A transport the compute model measured ("in-process"): its page-write time replaces
    # the link's bandwidth model. None: the link's bandwidth and kv_bytes_per_token.
    transport: str | None = None
    # Every worker takes turns on one thread, as in the in-process engine (sim/compute.py).
    serial_workers: bool = False

    @model_validator(mode="before")
    @classmethod
    def _read_model_file(cls, data, info: ValidationInfo):
        if not isinstance(data, dict) or not data.get("model"):
            return data
        tables = data.get("tables")
        source = tables.get("source") if isinstance(tables, dict) else getattr(
            tables, "source", None)
        path = Path(data["model"]).expanduser()
        if not path.is_absolute():
            base = (info.context or {}).get("base_dir")
            path = (Path(base) if base else Path.cwd()) / path
        if tables is not None and source == str(path.resolve()):
            return data  # loaded already (a dumped scenario validated again)
        try:
            loaded = read_compute_file(path)
        except ComputeFileError as error:
            raise ValueError(str(error)) from None
        return {**data, "model": loaded.source, "tables": loaded}

    @model_validator(mode="after")
    def _transport_measured(self) -> "Compute":
        if self.transport is None:
            return self
        if self.tables is None:
            raise ValueError(f"transport {self.transport!r} names a measured page write: "
                             "give compute.model (a file kvproof sim calibrate wrote)")
        if self.transport not in self.tables.transport:
            raise ValueError(f"transport {self.transport!r} was not measured in "
                             f"{self.model}; it has: "
                             f"{', '.join(self.tables.transport) or 'none'}")
        return self


class Link(_Strict):
    message_latency_s: float = Field(0.0005, ge=0)
    write_latency_s: float = Field(0.00002, ge=0)
    bandwidth_bytes_per_s: float = Field(25e9, gt=0)
    kv_bytes_per_token: int = Field(40960, ge=1)
    writes_in_flight_max: int = Field(8, ge=1, le=4096)  # per prefill NIC


class Timeouts(_Strict):
    """Decode's transfer timer is a lease (sim/lease.py): it times a request out when its
    prefill has been silent for `lease_s`, or when its transfer has taken
    `transfer_timeout_s` since the prefill admitted it; queueing (for admission, or for the
    NIC after the compute) counts towards neither while the prefill makes progress."""

    lease_s: float = Field(1.0, gt=0)             # the longest silence of the request's prefill
    transfer_timeout_s: float = Field(5.0, gt=0)  # the backstop: Admit to the final word
    notice_delay_s: float = Field(0.002, ge=0)  # how soon a worker notices a client is gone
    # A bootstrap or cancel lost for good is sent again this long after (the spec's
    # ResendBootstrap, ResendCancel), if it is still unanswered then.
    resend_after_s: float = Field(0.5, gt=0)
    # Decode's write timer where writes are lost silently (the spec's RevokeRelease): it
    # revokes a request's pages and releases them once the count can no longer complete.
    write_timeout_s: float = Field(0.5, gt=0)


class Faults(_Strict):
    """Every fault class, each off at 0 and rate-controlled."""

    client_abort_probability: float = Field(0.0, ge=0, le=1)   # per request
    client_abort_within_s: float = Field(2.0, gt=0)            # uniform after arrival
    message_loss_probability: float = Field(0.0, ge=0, lt=1)   # per delivery attempt
    retransmit_after_s: float = Field(0.2, gt=0)
    # A bootstrap, final word or cancel lost on this many retransmissions in a row too is
    # lost for good: the spec's LoseBootstrap, LoseFinalWord, LoseCancel (the page table is
    # part of Reserve in the spec, so it is retransmitted until it arrives).
    message_retransmits_max: int = Field(1000, ge=0, le=1_000_000)
    message_delay_probability: float = Field(0.0, ge=0, le=1)
    message_delay_mean_s: float = Field(0.05, ge=0)            # exponential extra delay
    slow_link_probability: float = Field(0.0, ge=0, le=1)      # per page write
    slow_link_factor: float = Field(20.0, ge=1, le=1e6)
    # A page write lost and its completion reported all the same (an unreliable transport,
    # a post that failed silently): the spec's LoseWrite. A post that fails and says so is
    # posted again after retransmit_after_s: a late landing, no event of its own.
    write_loss_probability: float = Field(0.0, ge=0, le=1)       # per page write
    write_post_fail_probability: float = Field(0.0, ge=0, lt=1)  # per attempt to post
    prefill_fail_probability: float = Field(0.0, ge=0, le=1)   # per admitted request
    prefill_crash_rate_per_s: float = Field(0.0, ge=0)         # per prefill worker
    prefill_restart_s: float = Field(0.5, ge=0)
    decode_crash_rate_per_s: float = Field(0.0, ge=0)          # per decode worker
    decode_restart_s: float = Field(0.5, ge=0)


class Oracles(_Strict):
    on_violation: Literal["stop", "count"] = "stop"
    sweep_every_events: int = Field(0, ge=0)   # full-cluster invariant sweep; 0: only at the end


class Hybrid(_Strict):
    """Workers whose KV pools, compute and page writes are the engine's (sim/hybrid.py): a
    tiny random-weight model, pages of `page_tokens` tokens mapped 1:1 onto the scenario's
    pages. `timing`: "modelled" (the scenario's compute model; a seed replays exactly and
    the log is the fully simulated run's) or "measured" (the engine's wall time)."""

    real_prefill: tuple[int, ...] = ()   # prefill worker indices
    real_decode: tuple[int, ...] = ()    # decode worker indices
    page_tokens: int = Field(4, ge=2, le=64)
    timing: Literal["modelled", "measured"] = "modelled"
    model: Literal["tiny"] = "tiny"

    @property
    def enabled(self) -> bool:
        return bool(self.real_prefill or self.real_decode)


class Scenario(_Strict):
    name: str = "custom"
    description: str = ""
    seed: int = Field(1, ge=0, lt=1 << 63)
    requests: int = Field(1000, ge=1, le=10_000_000)
    horizon_s: float = Field(86400.0, gt=0)     # simulated-time bound on a run
    bugs: tuple[str, ...] = ()
    cluster: Cluster = Cluster()
    workload: Workload = Workload()
    compute: Compute = Compute()
    link: Link = Link()
    timeouts: Timeouts = Timeouts()
    faults: Faults = Faults()
    oracles: Oracles = Oracles()
    hybrid: Hybrid = Hybrid()
    prefix: Prefix = Prefix()

    @model_validator(mode="after")
    def _real_workers_exist(self) -> "Scenario":
        h, c = self.hybrid, self.cluster
        for name, workers, count in (("real_prefill", h.real_prefill, c.prefill_workers),
                                     ("real_decode", h.real_decode, c.decode_workers)):
            bad = sorted(k for k in workers if not 0 <= k < count)
            if bad or len(set(workers)) != len(workers):
                raise ValueError(f"hybrid.{name}: worker indices must be distinct and in "
                                 f"0..{count - 1} (got {list(workers)})")
        return self

    @model_validator(mode="after")
    def _known_bugs(self) -> "Scenario":
        unknown = sorted(set(self.bugs) - ALL_BUGS)
        if unknown:
            raise ValueError(f"unknown bug switch(es) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(ALL_BUGS))}")
        return self

    def with_options(self, **changes) -> "Scenario":
        """A copy with top-level fields replaced, validated again."""
        try:
            return Scenario.model_validate({**self.model_dump(), **changes})
        except ValidationError as error:
            raise ScenarioError(_explain(error)) from None


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a TOML file by path."""
    path = Path(name_or_path)
    if path.is_dir():
        raise ScenarioError(f"{name_or_path}: is a folder, not a scenario (TOML) file")
    if not path.suffix:
        path = SCENARIO_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ScenarioError(f"no scenario {name_or_path!r}: not a file, and not one of "
                            f"{', '.join(scenario_names())}")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ScenarioError(f"{path}: not valid TOML: {error}") from None
    if not path.read_text().strip():
        # every field has a default, so an empty file would run as a scenario nobody wrote
        raise ScenarioError(f"{path}: is empty: it sets no field, so it would silently run "
                            "every default")
    return scenario_from_dict(data, where=str(path), base_dir=path.parent)


def scenario_from_dict(data: dict, where: str = "scenario",
                       base_dir: str | Path | None = None) -> Scenario:
    """A scenario from its data; `base_dir` is where relative file names are read from
    (compute.model; None: the working folder)."""
    try:
        return Scenario.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as error:
        raise ScenarioError(f"{where}: {_explain(error)}") from None


