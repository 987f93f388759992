"""The constants of a KVTransfer model and the bug switches.

A model is the set of CONSTANTS of spec/KVTransfer.tla: how many requests, how large each
pool is, what the router advertises, and which bug switches are on. The same values are
read from a TLC .cfg file (spec/check/cfgfile.py), so a model is written once and used by both
TLC and the Python checker.

Each bug switch turns off one guard of the protocol (or breaks it the way a real system
did). The switch names are the strings of the TLA+ constant `Bugs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Switch name -> (the guard it removes, one line on what goes wrong, where it was seen).
BUG_SWITCHES: dict[str, tuple[str, str, str]] = {
    "FinishedNotRejected": (
        "reject-before-allocate",
        "an over-long prompt is swapped for a one-page placeholder and stays alive",
        "SGLang #30233, PR #34208",
    ),
    "NoCountCheck": (
        "transferred count equals reserved count",
        "decode accepts 'transfer done' without comparing sent and reserved page counts",
        "the 2026 incident",
    ),
    "EagerRelease": (
        "deferred release",
        "decode frees pages on abort/timeout while writes are in flight",
        "SGLang PR #35049",
    ),
    "SourceReuse": (
        "source pages held until read",
        "prefill frees its source pages when the last write is posted, not completed",
        "vLLM #52234",
    ),
    "NoAbortNotice": (
        "abort notice prefill -> decode",
        "prefill aborts without telling decode; decode waits for its timeout",
        "SGLang PR #28651",
    ),
    "NoTimeout": (
        "decode timeout with cancel",
        "decode waits for KV forever; its pages leak",
        "vLLM #35943",
    ),
    "PoolBelowContext": (
        "startup pool check",
        "a KV pool smaller than the advertised context goes unnoticed at startup",
        "the 2026 incident",
    ),
    "NoGenBump": (
        "page generation tags checked on every read",
        "a page is reused without bumping its ownership tag, so stale data looks current",
        "the tag guard's own failure mode",
    ),
    "NoChecksum": (
        "transfer checksums",
        "decode accepts landed pages without verifying them against the sender's checksums",
        "kvproof guard removal",
    ),
    "NoTombstone": (
        "tombstones",
        "decode forgets a request whose final word overtook its bootstrap, then reserves for it",
        "kvproof guard removal",
    ),
    "NoCancel": (
        "cancel notice decode -> prefill",
        "decode gives up on a request without telling the prefill",
        "kvproof guard removal",
    ),
    "AdmitBeforeReserve": (
        "prefill admits only once decode has reserved (the bootstrap queue)",
        "prefill takes its pages before decode reserves; under pool pressure the pools "
        "deadlock until timeouts fail requests that fit",
        "pool-pressure hangs of the same family: SGLang #30033, #6857",
    ),
    "StopwatchTimeout": (
        "transfer deadline as a lease renewed by the prefill's progress",
        "decode's transfer deadline runs from reservation, so it counts the prefill's queue "
        "and compute and fails healthy requests that fit",
        "tokenspeed #1427, SGLang's bootstrap deadline, kvproof serve before the lease",
    ),
    "EarlyDone": (
        "the final word only once the prefill's writes have completed",
        "prefill sends Done as soon as its last write is posted, before the writes land "
        "(a notification channel apart from the data path)",
        "kvproof guard removal",
    ),
    "NoLandedCount": (
        "decode's own count of landed writes",
        "decode accepts and releases on the final word alone, without counting the writes "
        "that landed in its pages",
        "kvproof guard removal",
    ),
    "GenerationReset": (
        "generations that outlive a decode restart",
        "a restarted decode issues page generations from zero again, so a stale page's tag "
        "can equal a new reservation's",
        "kvproof guard removal (a tag counter kept in process memory)",
    ),
    "NoEpochCheck": (
        "the epoch check on messages after a decode restart",
        "a restarted decode takes a bootstrap of its old life as new and reserves for a "
        "request that life already ended",
        "kvproof guard removal",
    ),
    "NoRetransmit": (
        "retransmission of an unanswered bootstrap and cancel",
        "a bootstrap or a cancel lost on the wire is never sent again, so decode never "
        "reserves, or never hears the final word, and the request and its pages hang",
        "kvproof guard removal (a lossy network's requests hang for ever)",
    ),
    "NoRevoke": (
        "decode's write timer: revoke the pages' registration, then release",
        "a page write lost with its poster told it completed leaves decode's count short for "
        "ever, and decode holds the request's pages (rightly, without a revocation: the "
        "write could still land)",
        "kvproof guard removal (unreliable RDMA transports: a lost write completes as sent)",
    ),
    "NoFailureDetector": (
        "the prefill's own detection of a decode crash (the broken connection, a heartbeat)",
        "the prefill learns of a decode crash only from a message, which a lossy network may "
        "lose: the restarted decode keeps a tombstone and asks nothing, so the prefill holds "
        "the request and its pages for ever",
        "kvproof guard removal (a prefill that waits on a dead decode with no heartbeat)",
    ),
    # Prefix caching (issue 27): switches of models with prefix_cache only; without it they
    # change nothing.
    "StaleHitLength": (
        "the hit length decode tells the prefill is the one it holds",
        "decode counts one more cached page than it holds, reserves a fresh page for it that "
        "nobody writes, and the prefill skips it: decode reads a page nobody wrote",
        "SGLang PR #31881 (a stale storage-hit length)",
    ),
    "NoRefCount": (
        "a reference count per shared page (its readers)",
        "pages are deduplicated by content key with no count of readers, so the first "
        "reader's release frees pages a second reader still relies on",
        "LMCache-Ascend #250",
    ),
    "FullHitNoNotice": (
        "the page table and final word flow on a full decode-side hit too",
        "on a full hit decode decodes at once and tells the prefill nothing: the prefill "
        "waits for a page table that never comes, holding the request until its expiry",
        "vLLM PR #43509, PR #18632",
    ),
    "NoSalt": (
        "the salt (tenant) in every page's content identity",
        "the cache key leaves the salt out, so two tenants with the same prefix share pages",
        "issue 27 (the cross-tenant sharing public trackers report)",
    ),
    "EvictWhileSending": (
        "a cached prefill page is evicted or reused only once no request reads it and no "
        "write in flight reads out of it",
        "the prefill's cache evicts or reallocates a cached source page an async send still "
        "reads, so the write carries another prompt's KV (or none) to decode",
        "TRT-LLM #12542, vLLM #52360",
    ),
    "NoIdentTag": (
        "the content identity in every page's tag, checked on every read",
        "a page's tag names its generation only, not what it holds, so a page reached under "
        "a wrong cache key (NoSalt, a hash collision) reads as current",
        "issue 28 (kvproof guard removal: the tag before content identity)",
    ),
}

ALL_BUGS = frozenset(BUG_SWITCHES)

# What a network may lose for good (the spec's Losses, a subset of LossKinds) -> what is lost.
# A loss its poster is told of is no kind here: the poster posts again, a late delivery.
LOSS_KINDS: dict[str, str] = {
    "Bootstrap": "a bootstrap vanishes on its way to decode",
    "FinalWord": "a final word (Done, Reject, Abort) vanishes on its way to decode",
    "Cancel": "a cancel vanishes on its way to the prefill",
    "Write": "a page write vanishes, and its poster is told it completed (an unreliable "
             "transport; a post that failed silently)",
}

# Model field -> the CONSTANT of KVTransfer.tla that holds it: the one map that every reader
# and writer of constants uses (the .cfg files, ITF trace metadata, the spec evaluator).
# Requests (the model values) and Bugs (a set of strings) are the two others.
TLA_CONSTANTS = {"max_prompt_pages": "MaxPromptPages", "context_pages": "ContextPages",
                 "prefill_pages": "PrefillPages", "decode_pages": "DecodePages",
                 "crashes": "Crashes", "decode_crashes": "DecodeCrashes",
                 "early_timeouts": "EarlyTimeouts", "prefix_cache": "PrefixCache",
                 "tokens": "Tokens", "tenants": "Tenants", "prefill_cache": "PrefillCache"}


class ModelError(ValueError):
    """A model's constants are malformed (a user's input error, reported clearly)."""


def _positive(label: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelError(f"{label} must be an integer >= 1, got {value!r}")


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _at_prefill(m) -> str:
    return ", at the prefill too" if m.prefill_cache else ""


@dataclass(frozen=True)
class ProtocolConfig:
    """What a deployment is configured with, and all its guards read besides the state: the
    pools' sizes in pages, the context it is set to advertise, and the bug switches (none in
    production). A shell (simulator, engine, server) builds one from its deployment; the
    checker's Model adds the bounds of what it explores."""

    context_pages: int
    prefill_pages: int
    decode_pages: int
    bugs: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        unknown = set(self.bugs) - ALL_BUGS
        if unknown:
            raise ModelError(f"unknown bug switch(es) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(sorted(ALL_BUGS))}")
        for label in ("context_pages", "prefill_pages", "decode_pages"):
            _positive(label, getattr(self, label))
        object.__setattr__(self, "bugs", frozenset(self.bugs))

    @property
    def advertised_context_pages(self) -> int:
        """What the router admits. The startup check clamps it to the smallest pool."""
        if "PoolBelowContext" in self.bugs:
            return self.context_pages
        return min(self.context_pages, self.prefill_pages, self.decode_pages)


# The Tokens of a shell's prefix cache (Model.with_prefix_cache): its page tokens are 61-bit
# digests and counters above them (engine/prefix.py), or small shared tokens and counters
# (sim/workload.py), all within 1..SHELL_TOKENS.
SHELL_TOKENS = 1 << 62


@dataclass(frozen=True)
class Model:
    """The CONSTANTS of KVTransfer.tla. Validated at construction.

    Two kinds of constant: the protocol's configuration (`protocol`: pools, context, bug
    switches) and the checker's bounds (how many requests, the longest prompt, which worker
    crashes the model explores, names). A shell that runs the protocol for real builds its
    Model with `Model.for_shell`: its bounds are not a choice of what to explore but what
    reality allows (any prompt the context admits, crashes always possible)."""

    requests: int = 2
    max_prompt_pages: int = 3
    context_pages: int = 3
    prefill_pages: int = 2
    decode_pages: int = 3
    bugs: frozenset[str] = field(default_factory=frozenset)
    crashes: bool = False  # whether the prefill worker may crash and restart
    decode_crashes: bool = False  # whether the decode worker may crash and restart
    # Whether a decode timer may fire while the prefill is still at work on the request
    # (the spec's EarlyTimeouts): True keeps safety checked under any timing; False checks
    # that timely timers (a lease) never fail a request that fits.
    early_timeouts: bool = True
    # What the network may lose for good (LOSS_KINDS; the spec's Losses): none but in the
    # lossy models.
    losses: frozenset[str] = field(default_factory=frozenset)
    name: str = "custom"
    request_names: tuple[str, ...] = ()
    # How many prefill and decode workers (the spec's PrefillWorkers and DecodeWorkers, sets
    # of model values named p1.. and d1..), each with a pool of prefill_pages and
    # decode_pages pages. The router places every admitted request on one of each.
    prefill_workers: int = 1
    decode_workers: int = 1
    # Prefix caching (the spec's PrefixCache, Tokens, Tenants): decode caches sealed pages by
    # content identity and shares them between requests of one salt. A prompt is a sequence
    # of abstract tokens from 1..tokens, one per page; a request's salt is from 1..tenants.
    prefix_cache: bool = False
    tokens: int = 1
    tenants: int = 1
    # The prefill caches the pages it computed too (the spec's PrefillCache; needs
    # prefix_cache): it computes only the suffix it does not hold, and sends from the
    # cached pages.
    prefill_cache: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "protocol", ProtocolConfig(
            self.context_pages, self.prefill_pages, self.decode_pages, frozenset(self.bugs)))
        for label in ("requests", "max_prompt_pages", "prefill_workers", "decode_workers",
                      "tokens", "tenants"):
            _positive(label, getattr(self, label))
        if self.request_names and len(self.request_names) != self.requests:
            raise ModelError("request_names must name every request")
        for label, value in (("crashes", self.crashes), ("decode_crashes", self.decode_crashes),
                             ("early_timeouts", self.early_timeouts),
                             ("prefix_cache", self.prefix_cache),
                             ("prefill_cache", self.prefill_cache)):
            if not isinstance(value, bool):
                raise ModelError(f"{label} must be TRUE or FALSE, got {value!r}")
        if self.prefill_cache and not self.prefix_cache:
            raise ModelError("prefill_cache (PrefillCache) needs prefix_cache (PrefixCache)")
        object.__setattr__(self, "bugs", frozenset(self.bugs))
        unknown = set(self.losses) - set(LOSS_KINDS)
        if unknown:
            raise ModelError(f"unknown loss kind(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(LOSS_KINDS)}")
        object.__setattr__(self, "losses", frozenset(self.losses))
        if not self.request_names:
            names = tuple(f"r{i + 1}" for i in range(self.requests))
            object.__setattr__(self, "request_names", names)

    protocol: ProtocolConfig = field(init=False, repr=False, compare=False)

    @classmethod
    def for_shell(cls, protocol: ProtocolConfig, max_prompt_pages: int, name: str = "shell",
                  crashes: bool = True, decode_crashes: bool = True,
                  prefill_workers: int = 1, decode_workers: int = 1) -> "Model":
        """The Model a shell hands the core: its deployment's configuration; the longest
        prompt it will ever pass on; crashes possible unless the shell never injects them
        (the simulator switches them off with its crash rates). One request in name only:
        a shell's store keeps any number of live requests."""
        return cls(requests=1, max_prompt_pages=max_prompt_pages,
                   context_pages=protocol.context_pages, prefill_pages=protocol.prefill_pages,
                   decode_pages=protocol.decode_pages, bugs=protocol.bugs, crashes=crashes,
                   decode_crashes=decode_crashes, name=name,
                   prefill_workers=prefill_workers, decode_workers=decode_workers)

    def with_prefix_cache(self, tenants: int, prefill_cache: bool = False) -> "Model":
        """This model with decode's prefix cache (and with `prefill_cache`, the prefill's
        too), as a shell runs it: a shell's page tokens are hashes (engine/prefix.py) or
        counters (sim/workload.py), so its Tokens is SHELL_TOKENS; `tenants` salts."""
        return replace(self, prefix_cache=True, tokens=SHELL_TOKENS, tenants=tenants,
                       prefill_cache=prefill_cache)

    @property
    def advertised_context_pages(self) -> int:
        return self.protocol.advertised_context_pages

    @property
    def prefill_worker_names(self) -> tuple[str, ...]:
        return tuple(f"p{i + 1}" for i in range(self.prefill_workers))

    @property
    def decode_worker_names(self) -> tuple[str, ...]:
        return tuple(f"d{i + 1}" for i in range(self.decode_workers))

    @property
    def one_pair(self) -> bool:
        """One prefill and one decode worker: the models whose counts were pinned before
        the spec knew worker sets (their labels name no worker)."""
        return self.prefill_workers == 1 and self.decode_workers == 1

    def tla_constants(self) -> dict[str, object]:
        """The model as the spec's CONSTANTS (request names for Requests, sorted Bugs)."""
        out: dict[str, object] = {"Requests": list(self.request_names),
                                  "PrefillWorkers": list(self.prefill_worker_names),
                                  "DecodeWorkers": list(self.decode_worker_names)}
        out.update({constant: getattr(self, field) for field, constant in TLA_CONSTANTS.items()})
        out["Losses"] = sorted(self.losses)
        out["Bugs"] = sorted(self.bugs)
        return out

    @classmethod
    def from_tla_constants(cls, constants: dict, name: str = "custom") -> "Model":
        """The inverse of tla_constants; a missing constant is a ModelError naming it.
        DecodeCrashes, EarlyTimeouts, Losses, PrefillWorkers and DecodeWorkers may be absent
        (files written before decode crashes, timely timers, lossy networks and worker sets
        existed: FALSE, TRUE, {}, {p1} and {d1}, what those files meant)."""
        optional = {"DecodeCrashes", "EarlyTimeouts", "PrefixCache", "Tokens", "Tenants",
                    "PrefillCache"}
        try:
            names = tuple(str(n) for n in constants["Requests"])
            fields = {field: constants[constant] for field, constant in TLA_CONSTANTS.items()
                      if constant not in optional}
            bugs = frozenset(constants["Bugs"])
        except KeyError as error:
            raise ModelError(f"constant {error.args[0]} is missing") from None
        except TypeError as error:
            raise ModelError(f"malformed constants: {error}") from None
        workers = {}
        for field_name, constant, letter in (("prefill_workers", "PrefillWorkers", "p"),
                                             ("decode_workers", "DecodeWorkers", "d")):
            given = tuple(str(w) for w in constants.get(constant, (f"{letter}1",)))
            expected = tuple(f"{letter}{i + 1}" for i in range(len(given)))
            if sorted(given) != sorted(expected):
                raise ModelError(f"{constant} must be the model values {{"
                                 f"{', '.join(expected)}}}, got {{{', '.join(given)}}}")
            workers[field_name] = len(given)
        return cls(requests=len(names), request_names=names, bugs=bugs, name=name, **workers,
                   decode_crashes=constants.get("DecodeCrashes", False),
                   early_timeouts=constants.get("EarlyTimeouts", True),
                   prefix_cache=constants.get("PrefixCache", False),
                   prefill_cache=constants.get("PrefillCache", False),
                   tokens=constants.get("Tokens", 1), tenants=constants.get("Tenants", 1),
                   losses=frozenset(constants.get("Losses", ())), **fields)

    def with_bugs(self, bugs: frozenset[str] | set[str], name: str | None = None) -> "Model":
        return replace(self, bugs=frozenset(bugs), name=name or self.name)

    def describe(self) -> str:
        bugs = ", ".join(sorted(self.bugs)) or "none"
        return (
            f"model {self.name}: {self.requests} request{'s' if self.requests != 1 else ''}, "
            f"prompts 1..{self.max_prompt_pages} pages, "
            f"context {self.context_pages} (advertised {self.advertised_context_pages}), "
            f"prefill pool {self.prefill_pages}, decode pool {self.decode_pages} pages"
            f"{'' if self.one_pair else f' per worker, {self.prefill_workers} prefill x {self.decode_workers} decode workers'}"
            f"{', prefill crashes' if self.crashes else ''}"
            f"{', decode crashes' if self.decode_crashes else ''}"
            f"{'' if self.early_timeouts else ', timely timers'}"
            f"{', the network loses ' + ', '.join(sorted(self.losses)) if self.losses else ''}"
            f"{f', prefix cache ({self.tokens} token kind{_s(self.tokens)}, {self.tenants} salt{_s(self.tenants)}{_at_prefill(self)})' if self.prefix_cache else ''}"
            f"; bugs: {bugs}"
        )
