"""Hybrid runs: some workers of a simulated cluster are real.

Theory of operation
-------------------
A scenario's `[hybrid]` section names workers by index (`real_prefill`, `real_decode`;
`kvproof sim --hybrid` makes every worker real). Each named worker takes its index's place
in the one runtime's `prefill_at` / `decode_at` (spec/interfaces.py) as a `RealPrefill` or
`RealDecode`: the simulated worker (sim/workers.py: its queue, NIC, batch and epoch, so
the router, the link, the faults and the clock treat it as any other) whose data path is
the engine's, through a *data path* object the caller gives (`DataPath` below; the
engine's is fuzz/hybrid.py, because sim/ imports no engine code):

- a real prefill computes the admitted source pages of every prompt with the engine's
  model into its own real KV pool (`compute`), and every write it posts carries the source
  page's checksum (`posted`);
- when the core accepts a LandWrite into a real decode worker, the data path copies the
  page's bytes out of the real prefill's pool *as they are at that moment* (a write reads
  its source when it lands, as a NIC does) and sets the page's tag (`landed`); from a
  simulated prefill only the tag lands (there are no bytes to copy);
- a real decode runs the engine's batched decode step, with the tag check in the kernel,
  over the real sequences of each simulated step (`step`), and the verdicts the core's
  Accept and Finish carry are the data path's own: the checksums of the pages that landed
  and every tag check (`verdict`), not the abstract contents' (the store's
  TruthfulObservation oracle compares the two on every such event).

Pages map 1:1: a scenario page is one real page of `hybrid.page_tokens` tokens (4 by
default) on the tiny model, so pool sizes, page counts and the allocator's choices are
the scenario's own; a request of P prompt pages gets a real prompt of (P - 1) x
page_tokens + 1 tokens, which leaves room in its last reserved page for page_tokens - 1
real decode steps (each reads every page of its table). The simulated batch goes on for
the request's modelled output length; the real sequence stops computing when its pages are
full (it has read every page by then).

Time. `timing = "modelled"` (the default, and what tests use): simulated time advances by
the scenario's compute model for real workers too, so a seed replays exactly and the event
log is byte-identical to the fully simulated run's (apart from the header's [hybrid]);
the real work is done at the moment the modelled work starts. `timing = "measured"`:
a real prefill's compute and a real decode step advance simulated time by the wall time
the engine took (a step in which no real sequence had room keeps the modelled time); a
measured run does not replay exactly.

The leak oracle on real workers is the engine fuzz target's read-level oracle
(fuzz/engine_reference.py), which shares no paging code with the engine: every read of a
real decode is judged against a plain-torch forward of the request's own tokens.
"""

from __future__ import annotations

from typing import Protocol

from spec.core import SRC
from sim.decode_batch import JOINED
from sim.workers import SimDecode, SimPrefill


class DataPath(Protocol):
    """What a hybrid run's real workers do with real tensors (fuzz/hybrid.py)."""

    measured: bool  # timing = "measured"

    def bind(self, sim) -> None:
        """The simulation whose store (rows, placement, pools) it reads."""

    def committed(self, event, change) -> None:
        """Every event the core accepted (arrivals, landings, answers), after its commit."""

    def compute(self, p: int, r: int, source_pages: tuple) -> float:
        """Compute r's prompt into real prefill p's source pages; the wall seconds taken."""

    def posted(self, p: int, write: tuple) -> None:
        """Real prefill p posted a write (request, source page, decode page, tag)."""

    def start(self, d: int, r: int) -> None:
        """r starts decoding on real decode d (its table is the store's row)."""

    def step(self, d: int, joined) -> float | None:
        """One real decode step of d's sequences whose request `joined(r)` the simulated
        batch; the wall seconds, None if none of them had room."""

    def verdict(self, d: int, r: int, info, abstract: bool) -> bool:
        """The data path's verdict for r's observed action (spec.core.INFO[...])."""

    def summary(self) -> dict:
        """What the real workers saw: reads judged, foreign reads, leaks, guard stops."""


class RealPrefill(SimPrefill):
    """A simulated prefill worker whose compute and source pages are real."""

    __slots__ = ("data",)

    def __init__(self, sim, index: int, data: DataPath) -> None:
        super().__init__(sim, index)
        self.data = data

    def compute_seconds(self, r: int, pages: int) -> float:
        source = self.sim.cluster.rows[r][SRC]
        measured_s = self.data.compute(self.index, r, source)
        return measured_s if self.data.measured else super().compute_seconds(r, pages)

    def post(self, write: tuple, d: int) -> None:
        self.data.posted(self.index, write)
        super().post(write, d)


class RealDecode(SimDecode):
    """A simulated decode worker whose pool, decode steps and verdicts are real."""

    __slots__ = ("data",)

    def __init__(self, sim, index: int, data: DataPath) -> None:
        super().__init__(sim, index)
        self.data = data

    def start_decoding(self, r: int) -> None:
        self.data.start(self.index, r)
        super().start_decoding(r)

    def step_seconds(self, batch) -> float:
        """The real step of the requests in the simulated batch (they joined it), run now."""
        decoding = self.sim.decoding

        def joined(r: int) -> bool:
            sequence = decoding.get(r)
            return sequence is not None and sequence[JOINED] is not None
        measured_s = self.data.step(self.index, joined)
        if self.data.measured and measured_s is not None:
            return measured_s
        return super().step_seconds(batch)

    def observed(self, info, m, view, r: int) -> bool:
        return self.data.verdict(self.index, r, info, info.observed(m, view, r))


def attach(sim, data: DataPath | None) -> None:
    """Put the scenario's real workers in their indices' places, and let the data path see
    every commit (before any other watcher, a fuzzer's)."""
    if data is None:
        from sim.scenario import ScenarioError
        raise ScenarioError("this scenario marks workers as real ([hybrid]): it runs through "
                            "`kvproof sim` or fuzz/hybrid.py, which bring the engine")
    h = sim.sc.hybrid
    data.bind(sim)
    for k in h.real_prefill:
        sim.prefills[k] = RealPrefill(sim, k, data)
    for k in h.real_decode:
        sim.decodes[k] = RealDecode(sim, k, data)
    watcher = sim.on_commit

    def committed(event, change) -> None:
        data.committed(event, change)
        if watcher is not None:
            watcher(event, change)
    sim.on_commit = committed

