"""The bug zoo against the fuzzer: which target catches which entry, and how fast.

Rows are spec/check/zoo.py's entries (the smallest switch sets that expose each bug, with the
properties the entry is about), then every switch that breaks a property alone and is not
already an entry, then the guarded rows (GUARDED_ROWS: a bug with the protocol-state
properties that would flag it off, so that only the data path's own guards stand between
it and a leak; each must end clean, and names the guard that masks it), then "none": no
switch at all, which must end its budget with zero
violations (a false alarm there is a fuzzer or oracle bug, or a protocol bug). Columns are
the registered targets. Every cell is a campaign with the same seed and budget, stopped at
the first violation.

Cells are independent runs, so `jobs > 1` runs them in a process pool (spec/check/pool.py):
each cell's campaign is the same, seed and budget included, so an example budget gives the
same matrix as one process (a budget in seconds depends on speed either way).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable

from spec.check.pool import ordered_map
from spec.check.zoo import ALONE, BASES, ENTRIES

from fuzz.runner import Campaign, Outcome, run_campaign
from sim.crash import SHELL_CRASH


@dataclass(frozen=True)
class Row:
    name: str
    bugs: frozenset[str]
    properties: tuple[str, ...] | None
    checker_property: str | None  # what the model checker's counterexample violates
    masked_by: str = ""  # a guarded row: the guards that must stop the bug (it ends clean)
    # Whether its fuzz models have a prefix cache: as the checker's base model has (the
    # prefix switches change nothing without one).
    prefix_cache: bool = False
    prefill_cache: bool = False  # ... and at the prefill too (the checker's PrefillCache)

    @property
    def must_fail(self) -> bool:
        return bool(self.bugs) and not self.masked_by


# A stale write reaching the data path: EagerRelease frees a request's decode pages while
# its writes are in flight, and with the protocol-state properties that flag the in-flight
# write at once (NoWriteIntoForeign, the conservation oracle) left out, the write lands in
# the next owner's page. Only the data path's guards stand in the way: the write re-tags
# the page with the old generation, so the new owner's read fails its tag check (or, landed
# before the new owner's Accept, its checksum). late-write-looks-current is the same bug
# with the tag made useless (NoGenBump), and is caught.
GUARDED_ROWS = (
    Row("eager-release-guarded", frozenset({"EagerRelease"}), ("Isolation", "OkIsClean"),
        None, masked_by="the page tags and checksums"),
)


# Rows a target cannot reach, with the reason (the matrix prints them as out of reach, and
# the zoo test asks nothing of them on that target).
OUT_OF_REACH: dict[tuple[str, str], str] = {
    ("AdmitBeforeReserve alone", "sim"):
        "the simulator's transfer timers always run, so its fuzz target is never quiet: the "
        "pool deadlock ends in timeouts, which no check there can tell from an injected one "
        "(kvproof sim's fault-free oracle and the core target catch it)",
}
# Cells not run at all, with the reason (the matrix prints them): a row whose switch changes
# nothing on that target would only repeat the none row's examples.
NOT_RUN: dict[tuple[str, str], str] = {
    ("stopwatch-timeout", "core"):
        "the core target injects timeouts whenever decode waits (its model lets timers fire "
        "early, to reach the races early timeouts cause), so a stopwatch deadline is one of "
        "its own moves and the switch changes nothing; the checker's timely model catches it",
    ("stopwatch-timeout", "sim"):
        "the simulator's deadline is its own lease (sim/run.py), not the core's guard, and "
        "its fuzz target injects early timeouts: the switch changes nothing there; the "
        "checker's timely model catches it",
    **{(row, "sim"): "the simulator's prefill offers SendDone only once its NIC reports "
       "every write of the request done (sim/run.py), so an early Done never happens there; "
       "the checker (solo, solo-crash) and the core target catch it"
       for row in ("early-done", "EarlyDone alone")},
    **{(row, target): "the fuzz targets' networks lose nothing for good (their models have "
       "no Losses), so nothing is ever sent again or given up on and the switch changes "
       "nothing; the checker's lossy model (spec/README.md, the loss table) and the "
       "simulator's lossy scenarios catch it"
       for row in ("NoRetransmit alone", "NoRevoke alone", "NoFailureDetector alone")
       for target in ("core", "sim")},
    **{(row, "hybrid"): "the hybrid target's real workers (sim/hybrid.py, fuzz/hybrid.py "
       "EngineDataPath) keep no prefix cache: the simulator's hits and evictions are not "
       "carried out on real pages; the engine target runs the data-path prefix rows, the "
       "core and sim targets every one"
       for row in ("stale-hit-reads-unwritten", "StaleHitLength alone", "no-refcount",
                   "full-hit-no-notice", "no-salt", "cross-tenant-read", "none (prefix cache)",
                   "evict-while-sending", "none (prefill cache)")},
    ("full-hit-no-notice", "engine"):
        "FullHitNoNotice starts decoding on a full decode-side hit without a word to the "
        "prefill, and the engine's decode starts from the prefill's first token "
        "(engine/adapters.py EngineDecode.start_decoding), so the engine cannot carry the "
        "bug out (its shell crashes, at seed 0 after 40 examples); it is a control-path "
        "bug (NoStuckRequest), which the core and sim targets catch",
}


# The engine target runs a real model step for every Wait (about 4 examples a second here,
# against hundreds on the core target): it spends its budget on the entries whose bug is in
# the data path (pages, tags, counts, checksums: what only real tensors add over the core
# and simulator targets, which run every entry on the same core) and on the clean rows.
# Of the prefix rows: a stale hit that reads a page nobody wrote for it, a cached source
# evicted while a transfer still reads it, and both clean rows (shared pages judged by
# their bytes). The others are the cache's control path, and cost CI time for nothing real
# tensors add: NoSalt's two tenants compute the same bytes from the same tokens (SaltsApart
# is a property of the core's state, and so is cross-tenant-read's Isolation: the tenant
# read KV of the same tokens under another salt; the identity tags that refuse it on real
# pages are tests/test_api_prefix.py's), NoRefCount's ExclusiveOwner and StaleHitLength
# alone's tag-check failure are the core's state too (on the engine at seed 0 they are
# caught after 11, 33 and 3 examples: `--zoo` runs them if added here).
ENGINE_ROWS = frozenset({"incident", "eager-release", "late-write-looks-current",
                         "source-reuse-unverified", "eager-release-guarded", "none",
                         "stale-hit-reads-unwritten", "evict-while-sending",
                         "none (prefix cache)", "none (prefill cache)"})


def runs_on(row: Row, target: str) -> bool:
    if (row.name, target) in NOT_RUN:
        return False
    if row in GUARDED_ROWS:  # about real bytes: the core and simulator only model the guards
        return target == "engine"
    return target != "engine" or row.name in ENGINE_ROWS


def _prefix_base(base: str) -> bool:
    return bool(BASES[base].get("prefix_cache"))


def _prefill_base(base: str) -> bool:
    return bool(BASES[base].get("prefill_cache"))


def zoo_rows() -> list[Row]:
    rows = [Row(e.name, e.bugs, e.invariants, e.property, prefix_cache=_prefix_base(e.base),
                prefill_cache=_prefill_base(e.base)) for e in ENTRIES]
    known = {row.bugs for row in rows}
    for alone in ALONE:
        if alone.breaks and frozenset({alone.switch}) not in known:
            rows.append(Row(f"{alone.switch} alone", frozenset({alone.switch}), None,
                            alone.breaks, prefix_cache=_prefix_base(alone.base),
                            prefill_cache=_prefill_base(alone.base)))
    rows.extend(GUARDED_ROWS)
    # The clean row on prefix-cache models: hits, full hits, evictions and two tenants,
    # with every property and oracle checked, must end clean too.
    rows.append(Row("none (prefix cache)", frozenset(), None, None, prefix_cache=True))
    rows.append(Row("none (prefill cache)", frozenset(), None, None, prefix_cache=True,
                    prefill_cache=True))
    rows.append(Row("none", frozenset(), None, None))
    return rows


@dataclass(frozen=True)
class Cell:
    row: Row
    target: str
    outcome: Outcome

    @property
    def crashed(self) -> bool:
        """The target itself raised (sim/crash.py): a finding about the shell, never a
        catch, whatever the row expects."""
        return self.outcome.caught and self.outcome.replayed.property == SHELL_CRASH

    @property
    def missed(self) -> bool:
        """An entry the fuzzer must catch went uncaught in its budget: a finding about the
        fuzzer's reach, not a violation (nothing was violated)."""
        return (not self.outcome.caught and self.row.must_fail
                and (self.row.name, self.target) not in OUT_OF_REACH)

    @property
    def ok(self) -> bool:
        """Caught when it must be; clean when it must be; anything, out of the target's
        reach (OUT_OF_REACH); never a crashed target."""
        if self.crashed:
            return False
        if (self.row.name, self.target) in OUT_OF_REACH:
            return True
        return self.outcome.caught == self.row.must_fail


def _campaigns(targets: list[str], base: Campaign, rows: list[Row]):
    for row in rows:
        for target in (t for t in targets if runs_on(row, t)):
            yield row, Campaign(target=target, bugs=row.bugs, properties=row.properties,
                                profile=base.profile, seed=base.seed, examples=base.examples,
                                seconds=base.seconds, shrink_seconds=base.shrink_seconds,
                                minimize_seconds=base.minimize_seconds,
                                prefix_cache=row.prefix_cache,
                                prefill_cache=row.prefill_cache)


def run_portable(campaign: Campaign) -> Outcome:
    """run_campaign for a pool process: the failure comes back as plain data, because the
    exception Hypothesis raised (FuzzFailure) cannot be rebuilt from its pickle."""
    outcome = run_campaign(campaign)
    if outcome.failure is not None:
        outcome = replace(outcome, failure=SimpleNamespace(**outcome.failure.__dict__))
    return outcome


def run_zoo(targets: list[str], base: Campaign, rows: list[Row] | None = None,
            progress: Callable[[Cell], None] | None = None, jobs: int = 1,
            mapper: Callable | None = None) -> list[Cell]:
    """Every cell, in row then target order, whatever runs them: this process, `jobs`
    processes, or `mapper(run_portable, campaigns)` (api/campaigns.py: processes or Ray)."""
    planned = list(_campaigns(targets, base, rows or zoo_rows()))
    if mapper is None and jobs > 1:
        def mapper(fn, items):
            return ordered_map(fn, items, jobs)
    if mapper is not None:
        outcomes = mapper(run_portable, [c for _, c in planned])
        return [_told(Cell(row, c.target, o), progress)
                for (row, c), o in zip(planned, outcomes)]
    return [_told(Cell(row, c.target, run_campaign(c)), progress) for row, c in planned]


def _told(cell: Cell, progress: Callable[[Cell], None] | None) -> Cell:
    if progress:
        progress(cell)
    return cell


def format_cell(cell: Cell) -> str:
    o = cell.outcome
    if cell.crashed:
        return (f"CRASHED after {o.examples_to_catch} example"
                f"{'s' if o.examples_to_catch != 1 else ''}: {o.replayed.violations[0].detail}")
    if not o.caught and (cell.row.name, cell.target) in OUT_OF_REACH:
        return f"out of reach ({o.examples} examples; fuzz/zoo.py OUT_OF_REACH says why)"
    if not o.caught:
        verdict = ("MISSED" if cell.row.must_fail else
                   f"stopped by {cell.row.masked_by}" if cell.row.masked_by else "clean")
        return (f"{verdict}: 0 violations in {o.examples} example{'s' if o.examples != 1 else ''}"
                f" ({o.seconds:.1f} s)")
    found = o.replayed.property
    same = "" if found == cell.row.checker_property else f" (checker: {cell.row.checker_property})"
    verdict = ("caught" if cell.row.must_fail else
               f"NOT STOPPED by {cell.row.masked_by}" if cell.row.masked_by else "FALSE ALARM")
    return (f"{verdict} after {o.examples_to_catch} example"
            f"{'s' if o.examples_to_catch != 1 else ''}, {o.seconds_to_catch:.1f} s; "
            f"{found}{same} in {len(o.minimal)} events (shrunk in {o.shrunk_seconds:.1f} s)")


def format_matrix(cells: list[Cell]) -> str:
    """The matrix with every column as wide as its widest cell."""
    targets = sorted({c.target for c in cells})
    rows = list(dict.fromkeys(c.row for c in cells))
    text = {(c.row, c.target): format_cell(c) for c in cells}
    name_width = max(len("entry"), *(len(r.name) for r in rows))
    widths = {t: max(len(t), *(len(text.get((r, t), "-")) for r in rows)) for t in targets}
    lines = [(f"{'entry':<{name_width}}  " + "  |  ".join(f"{t:<{widths[t]}}" for t in targets)
              ).rstrip()]
    for row in rows:
        lines.append(f"{row.name:<{name_width}}  " + "  |  ".join(
            f"{text.get((row, t), '-'):<{widths[t]}}" for t in targets).rstrip())
    if "engine" in targets and any(not runs_on(r, "engine") for r in rows):
        lines.append("engine: the data-path entries and none only (fuzz/zoo.py ENGINE_ROWS "
                     "says why; '-' is not run)")
    for (name, target), why in NOT_RUN.items():
        if target in targets:
            lines.append(f"{name} on {target}: not run: {why}")
    for target in targets:
        lines.append(format_totals(target, [c.outcome for c in cells if c.target == target]))
    return "\n".join(lines)


def format_totals(target: str, outcomes: list[Outcome]) -> str:
    """One target's totals, counted as the budget is: the examples that searched (each
    cell's up to its first failure, which is what --examples bounds), then the shrinking
    of the failures found, apart (its examples and its time are bounded by the shrink
    budget, not by --examples)."""
    searched = sum(o.searched_examples for o in outcomes)
    search_s = sum(o.searched_seconds for o in outcomes)
    shrunk = sum(o.examples - o.searched_examples for o in outcomes)
    shrink_s = sum(o.shrunk_seconds for o in outcomes)
    caught = sum(o.caught for o in outcomes)
    steps = sum(o.steps + o.drain_steps for o in outcomes)
    return (f"{target}: {searched:,} examples searched in {search_s:.1f} s "
            f"({searched / max(search_s, 1e-9):.1f}/s); shrinking {caught} failure"
            f"{'s' if caught != 1 else ''}: {shrunk:,} examples more in {shrink_s:.1f} s; "
            f"{steps:,} steps in all")
