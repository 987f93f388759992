"""The bug zoo as data: which switches break what, which guards mask which switches.

Guards mask each other, so a bug of the zoo is an *entry*: the smallest set of switches that
reproduces the real failure, on a model, for the properties that failure violates. For each
switch alone the table says either which property it breaks, or which guard masks it and the
entry that shows the switch failing once that guard is gone too. The tests pin every number
here; `python -m spec.check.zoo --write` regenerates spec/models/*.cfg from this table, so
constants and switch sets are written once (tests check the files match).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from spec.model import BUG_SWITCHES, Model
from spec.check.cfgfile import cfg_for
from spec.properties import ALL_INVARIANTS, LIVENESS, STATE_INVARIANTS, STEP_PROPERTIES

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"

# The constants of the shipped models.
BASES: dict[str, dict[str, int]] = {
    # Two requests, an over-long prompt possible (3 pages > a 2-page prefill pool), pool
    # pressure on both sides: every switch either breaks something here or is masked.
    "default": dict(requests=2, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                    decode_pages=3),
    # One request: no pool pressure, so NoTimeout alone is harmless here, and what a missing
    # timeout *masks* becomes visible.
    "solo": dict(requests=1, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                 decode_pages=3),
    # One request with prompts longer than either pool: with the startup check off
    # (PoolBelowContext) both reject paths, prefill and decode, carry the load.
    "wide": dict(requests=1, max_prompt_pages=4, context_pages=4, prefill_pages=2,
                 decode_pages=3),
    # The default model with prefill crashes: the decode timeout and the restarted prefill's
    # answer to a cancel must bring every page back.
    "crash": dict(requests=2, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                  decode_pages=3, crashes=True),
    "solo-crash": dict(requests=1, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                       decode_pages=3, crashes=True),
    # Two requests, pools of 1 and 2 pages: small enough for the spec-vs-core conformance
    # check in CI, with and without every switch.
    "small": dict(requests=2, max_prompt_pages=2, context_pages=2, prefill_pages=1,
                  decode_pages=2, crashes=True),
    # Decode crashes: the restarted decode's epoch, tombstones and the prefill's cancel must
    # end every request and bring every page back; generations must never repeat.
    "solo-decode-crash": dict(requests=1, max_prompt_pages=3, context_pages=3,
                              prefill_pages=2, decode_pages=3, decode_crashes=True),
    "decode-crash": dict(requests=2, max_prompt_pages=2, context_pages=2, prefill_pages=1,
                         decode_pages=2, crashes=True, decode_crashes=True),
    # The default model with timely timers (EarlyTimeouts = FALSE): decode's lease lapses
    # only once the prefill has gone silent on the request, so no request that fits may be
    # failed by a timer (FittingRequestsSucceed without the timeout excuse).
    "timely": dict(requests=2, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                   decode_pages=3, early_timeouts=False),
    # The same with prefill crashes: the lease lapses after a crash, and the timeout with
    # its cancel is still the way back.
    "timely-crash": dict(requests=2, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                         decode_pages=3, crashes=True, early_timeouts=False),
    # solo-crash on a network that loses anything, messages and page writes: with
    # retransmission and decode's write timer every property holds, liveness under finitely
    # many losses (the spec's FiniteLosses).
    "lossy": dict(requests=1, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                  decode_pages=3, crashes=True,
                  losses=frozenset({"Bootstrap", "FinalWord", "Cancel", "Write"})),
    # The lossy network beside both kinds of crash: a decode crash's notice reaches the
    # prefill through its own failure detector (the broken connection), which the network
    # cannot lose; every property holds (NoFailureDetector shows what the detector keeps).
    "lossy-decode-crash": dict(requests=1, max_prompt_pages=3, context_pages=3,
                               prefill_pages=2, decode_pages=3, crashes=True,
                               decode_crashes=True,
                               losses=frozenset({"Bootstrap", "FinalWord", "Cancel", "Write"})),
    # Three requests for the benchmark and scheduled runs.
    "large": dict(requests=3, max_prompt_pages=2, context_pages=2, prefill_pages=1,
                  decode_pages=2),
    # Worker sets (issue 25): solo-crash's request and pools on two prefill workers, two
    # decode workers, or two of each, and either kind of worker may crash on its own. The
    # router may place the request on any of them; a crash of one worker leaves the other's
    # requests and pages alone. Small enough for conformance in CI.
    "workers-2x1": dict(requests=1, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                        decode_pages=3, crashes=True, decode_crashes=True, prefill_workers=2),
    "workers-1x2": dict(requests=1, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                        decode_pages=3, crashes=True, decode_crashes=True, decode_workers=2),
    "workers-2x2": dict(requests=1, max_prompt_pages=3, context_pages=3, prefill_pages=2,
                        decode_pages=3, crashes=True, decode_crashes=True, prefill_workers=2,
                        decode_workers=2),
    # Prefix caching (issue 27): two requests, each a prompt of one or two pages of one
    # token kind and one of two salts, so that a request may hit all, part or none of what
    # the other left cached, or share pages with a request of another tenant but for the
    # salt; decode pool of 2 pages so that allocation evicts.
    "prefix": dict(requests=2, max_prompt_pages=2, context_pages=2, prefill_pages=2,
                   decode_pages=2, prefix_cache=True, tokens=1, tenants=2),
    # Two token kinds and one salt: prompts that share page 1 and differ on page 2 (a
    # partial hit whose tail is another prompt's), and prompts that differ on page 1 and
    # agree on page 2 (no hit at all: the key of page 2 covers page 1).
    "prefix-chain": dict(requests=2, max_prompt_pages=2, context_pages=2, prefill_pages=2,
                         decode_pages=2, prefix_cache=True, tokens=2, tenants=1),
    # Its crash variant keeps one salt (the prefix model keeps tenants apart): with two it
    # had 719,161 orbits at depth 12 of 27 after 38 s and was stopped; with one it has
    # 1,094,048 orbits in all, checked in about a minute.
    "prefix-crash": dict(requests=2, max_prompt_pages=2, context_pages=2, prefill_pages=2,
                         decode_pages=2, prefix_cache=True, tokens=1, tenants=1, crashes=True,
                         decode_crashes=True),
    # The prefill caches too (PrefillCache): a request may hit at the prefill, at decode,
    # at both or at neither, and send from a cached source page another request computed.
    "prefix-prefill": dict(requests=2, max_prompt_pages=2, context_pages=2, prefill_pages=2,
                           decode_pages=2, prefix_cache=True, tokens=1, tenants=1,
                           prefill_cache=True),
    # Its crash variant: the prefill may crash, which wipes its cache index and every
    # reference (decode crashes, which wipe decode's, are prefix-crash's; both together
    # would cost about twice prefix-crash's 1,094,048 orbits).
    "prefix-prefill-crash": dict(requests=2, max_prompt_pages=2, context_pages=2,
                                 prefill_pages=2, decode_pages=2, prefix_cache=True, tokens=1,
                                 tenants=1, prefill_cache=True, crashes=True),
}
# Two requests on worker sets, one-page pools and prompts, both kinds of crash: where two
# requests share or split workers. Too large for conformance in CI and for TLC's table here
# (spec/README.md, "Worker sets"): the checker's figures are pinned by
# tests/test_worker_models.py behind KVPROOF_WORKER_MODELS=1, and no .cfg is written for
# them (every shipped .cfg joins conformance in CI).
TWO_REQUEST_WORKER_BASES: dict[str, dict[str, int]] = {
    f"workers2-{p}x{d}": dict(requests=2, max_prompt_pages=1, context_pages=1, prefill_pages=1,
                              decode_pages=1, crashes=True, decode_crashes=True,
                              prefill_workers=p, decode_workers=d)
    for p, d in ((1, 1), (2, 1), (1, 2), (2, 2))
}
# Three requests on the same pools: for bench/worker_models.py only (beyond exhaustive
# checking here: see spec/README.md, "Worker sets").
THREE_REQUEST_WORKER_BASES: dict[str, dict[str, int]] = {
    f"workers3-{p}x{d}": {**TWO_REQUEST_WORKER_BASES[f"workers2-{p}x{d}"], "requests": 3}
    for p, d in ((2, 1), (1, 2), (2, 2))
}
BASE_NOTES = {
    "default": "The default model: 2 requests, pools of 2 (prefill) and 3 (decode) pages, "
               "prompts of 1..3 pages.",
    "solo": "One request: no pool pressure. Used to show what the decode timeout masks.",
    "wide": "One request, prompts up to 4 pages, pools of 2 (prefill) and 3 (decode) pages.",
    "crash": "The default model, and the prefill may crash and restart empty at any moment.",
    "solo-crash": "One request, and the prefill may crash and restart empty at any moment.",
    "small": "Two requests, pools of 1 and 2 pages, crashes on: the conformance model for CI.",
    "solo-decode-crash": "One request, and the decode may crash and restart empty at any "
                         "moment.",
    "decode-crash": "Two requests, pools of 1 and 2 pages, both workers may crash and restart.",
    "large": "Three requests, pools of 1 and 2 pages: the larger model (bench/, scheduled runs).",
    "lossy": "One request, the prefill may crash, and the network may lose any bootstrap, "
             "final word, cancel or page write: retransmission and decode's write timer end "
             "every request, under finitely many losses.",
    "lossy-decode-crash": "The lossy model with decode crashes too: the prefill learns of a "
                          "decode crash from its own failure detector (the broken connection), "
                          "which the network cannot lose, and every request ends.",
    "timely": "The default model with timely timers: decode's lease lapses only once the "
              "prefill has gone silent on the request, so no request that fits may time out.",
    "timely-crash": "The timely model, and the prefill may crash and restart empty at any "
                    "moment: the lapsed lease and the cancel bring every page back.",
    "workers-2x1": "One request, two prefill workers and one decode worker, each worker "
                   "may crash alone: the router places the request on either prefill.",
    "workers-1x2": "One request, one prefill worker and two decode workers, each worker "
                   "may crash alone: the router places the request on either decode.",
    "workers-2x2": "One request, two prefill and two decode workers, each worker may crash "
                   "alone: every placement of the request is explored.",
    "prefix": "Prefix caching: two requests with prompts of 1..2 pages (one token kind) and "
              "one of two salts, pools of 2 pages: hits full, partial and none, sharing, "
              "release to the cache, eviction.",
    "prefix-chain": "Prefix caching with two token kinds and one salt: prompts that share "
                    "page 1 and differ on page 2, or differ on page 1 and agree on page 2.",
    "prefix-crash": "The prefix model with one salt, and either worker may crash and "
                    "restart: a decode restart loses its cache index and every reference, a "
                    "prefill restart a tail transfer.",
    "prefix-prefill": "Prefix caching at both workers: two requests with prompts of 1..2 "
                      "pages (one token kind, one salt), pools of 2 pages; the prefill "
                      "computes only the suffix it does not hold and sends from cached "
                      "sources, seals at SendDone, evicts what nobody reads or sends from.",
    "prefix-prefill-crash": "The prefix-prefill model, and the prefill may crash and restart: "
                            "its restart loses its cache index and every reference, and the "
                            "requests it ran.",
}


@dataclass(frozen=True)
class Entry:
    """A zoo entry: a switch set that exposes a bug, and what it must break."""

    name: str
    bugs: frozenset[str]
    property: str          # the property the shortest counterexample violates
    length: int            # its length in steps
    base: str = "default"
    invariants: tuple[str, ...] | None = None  # None: all of them
    story: str = ""

    def model(self) -> Model:
        return Model(bugs=self.bugs, name=self.name, **BASES[self.base])


ENTRIES: tuple[Entry, ...] = (
    Entry("incident", frozenset({"PoolBelowContext", "FinishedNotRejected", "NoCountCheck",
                                 "NoGenBump"}),
          "OkIsClean", 18, invariants=("OkIsClean", "Isolation"),
          story="The 2026 incident: a prompt longer than the prefill pool reaches the prefill "
                "(pool below the advertised context), is swapped for a one-page placeholder, "
                "decode accepts one page for three reserved and reads another request's stale "
                "pages; the client gets success. SGLang had no page tags: NoGenBump."),
    Entry("rejected-decodes", frozenset({"PoolBelowContext", "FinishedNotRejected",
                                         "NoCountCheck"}),
          "RejectedIsError", 7,
          story="SGLang #30233: a rejected over-long prompt still looks alive and decodes."),
    Entry("eager-release", frozenset({"EagerRelease"}), "NoWriteIntoForeign", 6,
          story="SGLang PR #35049: decode frees pages on timeout while a write is in flight."),
    Entry("late-write-looks-current", frozenset({"EagerRelease", "NoGenBump"}),
          "Isolation", 15, invariants=("Isolation", "OkIsClean"),
          story="A page reused without a tag bump: the previous owner's late write lands "
                "after the new owner accepted, and passes the tag check."),
    Entry("source-reuse", frozenset({"SourceReuse"}), "SourceHeld", 4,
          story="vLLM #52234: the prefill frees source pages while the NIC still reads them."),
    Entry("source-reuse-unverified", frozenset({"SourceReuse", "NoChecksum"}),
          "Isolation", 11, invariants=("Isolation", "OkIsClean"),
          story="Without checksums the reused source page's new data reaches decode."),
    Entry("no-timeout", frozenset({"NoTimeout", "AdmitBeforeReserve"}), "NoLeakAtRest", 4,
          invariants=("NoLeakAtRest", "NoStuckRequest"),
          story="vLLM #35943: decode waits for KV forever; with a prefill that takes its pages "
                "before decode reserves, two requests deadlock on the pools for good."),
    Entry("silent-prefill-abort", frozenset({"NoAbortNotice", "NoTimeout"}), "NoLeakAtRest", 3,
          base="solo",
          story="SGLang PR #28651: the prefill fails without telling decode, and decode has "
                "no timeout to fall back on."),
    Entry("lost-tombstone", frozenset({"NoTombstone", "NoTimeout"}), "NoLeakAtRest", 4,
          base="solo",
          story="The final word overtakes the bootstrap; decode forgets it and reserves "
                "pages nobody will ever transfer into."),
    Entry("dead-prefill", frozenset({"NoTimeout"}), "NoLeakAtRest", 3, base="solo-crash",
          story="vLLM #35943 as it happens in the field: the prefill dies mid-request, "
                "nobody tells decode, and without a timeout decode holds its pages forever."),
    Entry("stopwatch-timeout", frozenset({"StopwatchTimeout"}), "FittingRequestsSucceed", 6,
          base="timely",
          story="tokenspeed #1427, SGLang's bootstrap deadline and kvproof serve before the "
                "lease: decode's deadline runs from reservation, counts the prefill's queue "
                "and compute, and fails a healthy request that fits."),
    Entry("no-cancel", frozenset({"NoCancel"}), "NoLeakAtRest", 4, base="solo-crash",
          story="Decode times out without telling the prefill; the prefill crashes, and the "
                "restarted prefill, never asked, never sends the final word decode waits for."),
    Entry("early-done", frozenset({"EarlyDone", "NoLandedCount"}), "NoWriteIntoForeign", 7,
          base="solo",
          story="The prefill's Done overtakes its writes (a notification channel apart from "
                "the data path), and decode, which does not count the writes that landed, "
                "fails the transfer on its checksums and releases the pages a write is "
                "still on its way into."),
    Entry("revived-bootstrap", frozenset({"NoEpochCheck", "NoTimeout"}), "NoLeakAtRest", 5,
          base="solo-decode-crash", invariants=("NoLeakAtRest", "NoStuckRequest"),
          story="The prefill fails and its Abort overtakes the bootstrap (a tombstone); decode "
                "crashes, and the restarted decode, which does not check epochs, takes the "
                "old bootstrap as new and reserves pages for a request nobody will ever end."),
    # Prefix caching (issue 27).
    Entry("stale-hit-reads-unwritten", frozenset({"StaleHitLength", "NoGenBump", "NoIdentTag"}),
          "Isolation", 14, base="prefix", invariants=("Isolation", "OkIsClean"),
          story="SGLang PR #31881: decode counts a cached page it does not hold (a stale "
                "storage-hit length), tells the prefill, which skips it, and reads the page "
                "nobody wrote; with tags that name neither a fresh generation nor the "
                "content, its stale tag passes the check, and the request decodes from "
                "another prompt's KV."),
    Entry("no-refcount", frozenset({"NoRefCount"}), "ExclusiveOwner", 11, base="prefix",
          story="LMCache-Ascend #250: pages deduplicated by content key with no count of "
                "readers; the first reader's release frees a page the second still reads."),
    Entry("full-hit-no-notice", frozenset({"FullHitNoNotice"}), "NoStuckRequest", 13,
          base="prefix",
          story="vLLM PR #43509, PR #18632: on a full decode-side hit no word goes to the "
                "prefill, which holds the request (and in vLLM its source pages) until an "
                "expiry."),
    Entry("no-salt", frozenset({"NoSalt"}), "SaltsApart", 9, base="prefix",
          story="The cache key leaves out the salt: a request of another tenant with the "
                "same prefix hits the first tenant's pages (the identity in their tags, "
                "another tenant's, fails its read: cross-tenant-read takes that guard too)."),
    Entry("cross-tenant-read", frozenset({"NoSalt", "NoIdentTag"}), "Isolation", 13,
          base="prefix", invariants=("Isolation", "OkIsClean"),
          story="The cache key leaves out the salt and the page tags name the generation "
                "only: a request of another tenant with the same prefix hits the first "
                "tenant's pages, their tags pass, and it decodes from that tenant's KV."),
    Entry("evict-while-sending", frozenset({"EvictWhileSending"}), "SealedIsQuiet", 10,
          base="prefix-prefill",
          story="TRT-LLM #12542, vLLM #52360: the prefill's cache evicts a cached source "
                "page while a request that hit it still sends from it (the page leaves the "
                "cache under its reader). With a third request of another tenant and "
                "NoChecksum too, its allocation overwrites the page before the async send "
                "reads it, and decode decodes from that tenant's KV: Isolation, 17 steps "
                "(checked by hand on three requests; tests/test_prefix.py pins it step by "
                "step)."),
)
ENTRY_BY_NAME = {e.name: e for e in ENTRIES}

# What a reset generation lets through once the guards that mask it are off too: the
# incident across a decode restart, page tags on (OkIsClean, 15 steps, 273,030 states on
# decode-crash; each of the four switches is needed). Not a zoo entry: the fuzzer's core
# target does not find it in its CI budget (1,500 examples), and its minimality costs
# about a minute of checking; tests/test_zoo.py checks the violation.
REISSUED_TAG = Entry("reissued-tag", frozenset({"GenerationReset", "PoolBelowContext",
                                                "FinishedNotRejected", "NoCountCheck"}),
                     "OkIsClean", 15, base="decode-crash", invariants=("OkIsClean", "Isolation"),
                     story="The restarted decode issues generations from zero, so a page "
                           "another request wrote before the crash carries the tag a new "
                           "reservation is given, and the placeholder's unwritten page passes "
                           "the tag check.")

# Models that must hold although a switch is on: the guards behind it carry the load, and
# the tests check that the actions of those guards actually fire.
HOLDS: tuple[tuple[str, str, frozenset[str], tuple[str, ...], str], ...] = (
    ("reject-paths", "wide", frozenset({"PoolBelowContext"}), ("Reject", "DecodeReject"),
     "Without the startup check, prompts longer than the prefill pool and longer than the "
     "decode pool reach the workers; their reject paths end them with a clear error."),
)


# A network that loses things for good (issue 25): each kind of loss alone, on solo-crash
# (a restarted prefill answers only what it is asked), and the first property it breaks
# without the guard that recovers from it (NoRetransmit for a message, NoRevoke for a page
# write); with them every property holds, all four kinds together too (the lossy base).
# The fairness such a network allows: spec/README.md.
LOSS_BASE = "solo-crash"
LOSSES: tuple[tuple[str, str, int, str], ...] = (
    ("Bootstrap", "FittingRequestsSucceed", 2,
     "A lost bootstrap: decode never hears of the request, the prefill waits for its page "
     "table, and no timer runs on either side."),
    ("FinalWord", "NoLeakAtRest", 5,
     "A final word lost after decode gave up: the cancel it answered is spent, and nothing "
     "asks again (one lost while decode still waits is recovered: the lease lapses, the "
     "timeout cancels, the prefill repeats it)."),
    ("Cancel", "NoLeakAtRest", 5,
     "A lost cancel: the prefill crashes, and the restarted prefill, never asked, never "
     "sends the final word decode waits for (without prefill crashes a lost cancel is "
     "harmless: the prefill ends every request it runs with a final word of its own)."),
    ("Write", "FittingRequestsSucceed", 6,
     "A write lost with its poster told it completed: Done announces it, decode's count "
     "never gets there, and decode (rightly: a late write could still land) holds its pages."),
)


@dataclass(frozen=True)
class Alone:
    """What one switch does on its own on the default model."""

    switch: str
    breaks: str | None = None     # the property it breaks alone
    length: int = 0               # the counterexample length when it breaks alone
    masked_by: str = ""           # the guard(s) that mask it
    exposed_by: str = ""          # the entry that fails once those guards are gone too
    # For a masked switch: the entry's switch set minus this switch, which must pass (so the
    # failure needs this switch, not only the other removed guards).
    needs_switch: bool = True
    # The model it is checked on alone, where the default model cannot reach what it
    # breaks (a switch of a restart needs crashes) or costs more than the suite affords
    # (NoLandedCount: small has two requests and prefill crashes); also SWITCH_BASES.
    base: str = "default"


ALONE: tuple[Alone, ...] = (
    Alone("FinishedNotRejected", masked_by="startup pool check, then count check",
          exposed_by="rejected-decodes"),
    Alone("NoCountCheck", masked_by="startup pool check and reject-before-allocate",
          exposed_by="rejected-decodes"),
    Alone("PoolBelowContext", masked_by="reject-before-allocate, then count check",
          exposed_by="rejected-decodes"),
    Alone("EagerRelease", breaks="NoWriteIntoForeign", length=6),
    Alone("SourceReuse", breaks="SourceHeld", length=4),
    Alone("NoAbortNotice", masked_by="decode timeout with cancel",
          exposed_by="silent-prefill-abort"),
    Alone("NoTimeout", masked_by="the bootstrap queue (no prefill holds pages for a request "
                                 "decode has not reserved: the pools cannot deadlock)",
          exposed_by="dead-prefill"),
    Alone("NoGenBump", masked_by="deferred release (no late write to mistake for current), "
                                 "count check (no unwritten page to read)",
          exposed_by="late-write-looks-current"),
    Alone("NoChecksum", masked_by="source pages held until read",
          exposed_by="source-reuse-unverified"),
    Alone("NoTombstone", masked_by="decode timeout with cancel", exposed_by="lost-tombstone"),
    Alone("NoCancel", masked_by="the bootstrap queue (the prefill runs only requests decode "
                                "holds pages for, and each ends with a final word)",
          exposed_by="no-cancel"),
    Alone("AdmitBeforeReserve", breaks="FittingRequestsSucceed", length=4),
    Alone("StopwatchTimeout", masked_by="nothing to mask: the default model's timers may "
                                        "fire early already (EarlyTimeouts), which safety "
                                        "tolerates and FittingRequestsSucceed excuses",
          exposed_by="stopwatch-timeout"),
    # An early Done is safe behind decode's count, but a prefill crash then fails writes the
    # Done announced: the count never completes and decode holds the pages for good.
    Alone("EarlyDone", breaks="FittingRequestsSucceed", length=6, base="solo-crash",
          masked_by="for safety: decode's own count of landed writes (it verifies and "
                    "releases only once as many writes as the Done announced have landed)",
          exposed_by="early-done"),
    Alone("NoRetransmit", breaks="FittingRequestsSucceed", length=2, base="lossy",
          masked_by="a network that loses nothing: only a lost message is ever sent again "
                    "(the loss table in spec/README.md shows what each loss breaks without "
                    "it)"),
    Alone("NoRevoke", breaks="FittingRequestsSucceed", length=6, base="lossy",
          masked_by="a network that loses no page write silently: only there is decode's "
                    "write timer armed"),
    Alone("NoFailureDetector", breaks="NoStuckRequest", length=3,
          base="lossy-decode-crash",
          masked_by="a network that loses no cancel: the crash's notice, sent as a message, "
                    "then arrives"),
    Alone("NoLandedCount", masked_by="the final word only once the prefill's writes have "
                                     "completed (every write it announces has landed by then)",
          exposed_by="early-done", base="small"),
    # Each breaks the promise its guard keeps, a step property, at the crash step; what
    # that lets through is masked, and the entry named shows it.
    Alone("GenerationReset", breaks="GenerationsNeverGoBack", length=3,
          base="solo-decode-crash",
          masked_by="for the state invariants: count check, reject-before-allocate and the "
                    "startup pool check (no unwritten page to read), writes flushed at the "
                    "crash (no late write); with the first three off too the incident "
                    "happens across a restart (REISSUED_TAG)"),
    Alone("NoEpochCheck", breaks="TombstonesStay", length=4, base="solo-decode-crash",
          masked_by="for the state and rest invariants: decode timeout with cancel (the "
                    "revived reservation times out and is released)",
          exposed_by="revived-bootstrap"),
    # Prefix caching (issue 27), on the prefix model (without a prefix cache they change
    # nothing). A stale hit length leaves a reserved page unwritten: the tag check fails the
    # read (a fitting request fails, no leak); without tag bumps the page's stale tag
    # passes, and the request reads another prompt's KV.
    Alone("StaleHitLength", breaks="FittingRequestsSucceed", length=7, base="prefix",
          masked_by="for safety: page tags checked on every read (the page nobody wrote "
                    "carries an older generation and another identity)",
          exposed_by="stale-hit-reads-unwritten"),
    # The first reader's release frees the page under the second: its table holds a page
    # it neither owns nor reads. With two requests nobody reuses the page before the
    # second reader finishes, so no data leaks here.
    Alone("NoRefCount", breaks="ExclusiveOwner", length=11, base="prefix"),
    Alone("FullHitNoNotice", breaks="NoStuckRequest", length=13, base="prefix"),
    Alone("NoSalt", breaks="SaltsApart", length=9, base="prefix"),
    # A cached source a request still reads is evicted: the page is no longer sealed under
    # its reader. With two requests nobody reallocates it before the send completes (the
    # only other request sealed it and is done), so no data leaks here;
    # tests/test_prefix.py shows a third request's allocation carrying foreign KV to decode.
    Alone("EvictWhileSending", breaks="SealedIsQuiet", length=10, base="prefix-prefill"),
    # Tags that name the generation only (issue 28): nothing reaches a page under a wrong
    # key or reads one nobody wrote for it while the other guards hold.
    Alone("NoIdentTag", base="prefix",
          masked_by="the salt in every cache key and page generation tags (no page is "
                    "reached under another tenant's key, none read stale)",
          exposed_by="cross-tenant-read"),
)
assert {a.switch for a in ALONE} == set(BUG_SWITCHES)


# ---------------------------------------------------------------------------------------
# The .cfg files, generated from the table above.

ALL_CFG_INVARIANTS = tuple(ALL_INVARIANTS)


def cfg_text(base: str, bugs: frozenset[str], invariants: tuple[str, ...] | None,
             comment: str, losses: frozenset[str] = frozenset()) -> str:
    """A generated .cfg: the comment, then the model written as TLC reads it. With every
    invariant checked, the liveness properties are checked too."""
    model = Model(bugs=bugs, **{**BASES[base],
                                "losses": losses | BASES[base].get("losses", frozenset())})
    properties = tuple(LIVENESS) + tuple(STEP_PROPERTIES) if invariants is None else ()
    lines = [f"\\* {line}" for line in _wrap(comment)]
    lines.append("\\* Generated by `python -m spec.check.zoo --write` from spec/check/zoo.py; edit that, "
                 "not this.")
    return "\n".join(lines) + "\n" + cfg_for(model, invariants or ALL_CFG_INVARIANTS,
                                             properties)


def _wrap(text: str, width: int = 88) -> list[str]:
    words, lines, line = text.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


def _entry_file(entry: Entry) -> str:
    return "incident.cfg" if entry.name == "incident" else f"zoo-{entry.name}.cfg"


# The model each bug-X.cfg puts switch X on, where it is not the default model: a
# stopwatch deadline changes nothing where timers may fire early anyway.
SWITCH_BASES = {"StopwatchTimeout": "timely",
                **{a.switch: a.base for a in ALONE if a.base != "default"}}


def generated_cfgs() -> dict[str, str]:
    files = {f"{base}.cfg": cfg_text(base, frozenset(), None, BASE_NOTES[base]) for base in BASES}
    for switch, (guard, what, seen) in BUG_SWITCHES.items():
        base = SWITCH_BASES.get(switch, "default")
        on = "" if base == "default" else f" on the {base} model"
        files[f"bug-{switch}.cfg"] = cfg_text(
            base, frozenset({switch}), None,
            f"Bug switch {switch} alone{on} ({seen}): {what}. Removes the guard: {guard}.")
    for name, base, bugs, _, story in HOLDS:
        files[f"{name}.cfg"] = cfg_text(base, bugs, None, story)
    for entry in ENTRIES:
        files[_entry_file(entry)] = cfg_text(entry.base, entry.bugs, entry.invariants,
                                                  f"Zoo entry {entry.name}: {entry.story}")
    for kind, _, _, story in LOSSES:
        how = ("Nothing is sent again (nobody knows the write is lost)" if kind == "Write"
               else "Retransmission recovers it; without it (NoRetransmit)")
        files[f"loss-{kind}.cfg"] = cfg_text(LOSS_BASE, frozenset(), None,
                                             f"The network loses: {kind}. {how}: {story}",
                                             losses=frozenset({kind}))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write or verify spec/*.cfg from spec/check/zoo.py")
    parser.add_argument("--write", action="store_true", help="write the .cfg files")
    args = parser.parse_args(argv)
    stale = []
    for name, text in generated_cfgs().items():
        path = MODELS_DIR / name
        if args.write:
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(name)
    if stale:
        print(f"out of date: {', '.join(stale)} (run python -m spec.check.zoo --write)",
              file=sys.stderr)
        return 1
    print("spec/models/*.cfg " + ("written" if args.write else "up to date"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
