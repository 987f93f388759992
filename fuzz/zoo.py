"""The bug zoo against the fuzzer: which target catches which entry, and how fast.

Rows are spec/check/zoo.py's entries (the smallest switch sets that expose each bug, with the
properties the entry is about), then every switch that breaks a property alone and is not
already an entry, then "none": no switch at all, which must end its budget with zero
violations (a false alarm there is a fuzzer or oracle bug, or a protocol bug). Columns are
the registered targets. Every cell is a campaign with the same seed and budget, stopped at
the first violation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from spec.check.zoo import ALONE, ENTRIES

from fuzz.runner import Campaign, Outcome, run_campaign


@dataclass(frozen=True)
class Row:
    name: str
    bugs: frozenset[str]
    properties: tuple[str, ...] | None
    checker_property: str | None  # what the model checker's counterexample violates

    @property
    def must_fail(self) -> bool:
        return bool(self.bugs)


def zoo_rows() -> list[Row]:
    rows = [Row(e.name, e.bugs, e.invariants, e.property) for e in ENTRIES]
    known = {row.bugs for row in rows}
    for alone in ALONE:
        if alone.breaks and frozenset({alone.switch}) not in known:
            rows.append(Row(f"{alone.switch} alone", frozenset({alone.switch}), None,
                            alone.breaks))
    rows.append(Row("none", frozenset(), None, None))
    return rows


@dataclass(frozen=True)
class Cell:
    row: Row
    target: str
    outcome: Outcome

    @property
    def ok(self) -> bool:
        """Caught when it must be; clean when it must be."""
        return self.outcome.caught == self.row.must_fail


def run_zoo(targets: list[str], base: Campaign, rows: list[Row] | None = None,
            progress: Callable[[Cell], None] | None = None) -> list[Cell]:
    cells = []
    for row in rows or zoo_rows():
        for target in targets:
            campaign = Campaign(target=target, bugs=row.bugs, properties=row.properties,
                                profile=base.profile, seed=base.seed, examples=base.examples,
                                seconds=base.seconds, shrink_seconds=base.shrink_seconds,
                                minimize_seconds=base.minimize_seconds)
            cell = Cell(row, target, run_campaign(campaign))
            cells.append(cell)
            if progress:
                progress(cell)
    return cells


def format_cell(cell: Cell) -> str:
    o = cell.outcome
    if not o.caught:
        verdict = "clean" if not cell.row.must_fail else "MISSED"
        return f"{verdict}: 0 violations in {o.examples} examples ({o.seconds:.1f} s)"
    found = o.replayed.property
    same = "" if found == cell.row.checker_property else f" (checker: {cell.row.checker_property})"
    verdict = "caught" if cell.row.must_fail else "FALSE ALARM"
    return (f"{verdict} after {o.examples_to_catch} examples, {o.seconds_to_catch:.1f} s; "
            f"{found}{same} in {len(o.minimal)} events")


def format_matrix(cells: list[Cell]) -> str:
    targets = sorted({c.target for c in cells})
    width = max(len(c.row.name) for c in cells)
    lines = [f"{'entry':<{width}}  " + "  |  ".join(targets)]
    for row in dict.fromkeys(c.row for c in cells):
        by_target = {c.target: c for c in cells if c.row == row}
        lines.append(f"{row.name:<{width}}  " + "  |  ".join(
            format_cell(by_target[t]) if t in by_target else "-" for t in targets))
    for target in targets:
        mine = [c.outcome for c in cells if c.target == target]
        examples = sum(o.examples for o in mine)
        seconds = sum(o.seconds for o in mine)
        steps = sum(o.steps + o.drain_steps for o in mine)
        lines.append(f"{target}: {examples} examples, {steps} steps in {seconds:.1f} s: "
                     f"{examples / max(seconds, 1e-9):.1f} examples/s, "
                     f"{steps / max(seconds, 1e-9):,.0f} steps/s")
    return "\n".join(lines)
