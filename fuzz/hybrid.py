"""The engine's data path for a hybrid run's real workers (sim/hybrid.py), the read-level
leak oracle on their KV bytes, and the hybrid fuzz target.

Theory of operation. sim/ imports no engine code, so the engine's side of a hybrid run
lives here, beside the engine target whose pieces it reuses: the tiny random-weight model
(fuzz/engine_target.py `tiny_model`), the engine's own prefill and decode workers
(engine/workers.py: real KV pools, chunked prefill, checksums, the decode kernel's tag
check), and the independent reference (fuzz/engine_reference.py: `DecodeRecorder` on each
real decode worker's model, `judge` and `judge_bytes` against a plain-torch forward of the
request's own tokens, which shares no paging code with the engine).

`EngineDataPath` implements sim/hybrid.py's DataPath. Every read of a real decode worker
is recorded at the kernel call and judged at once. Reads of requests whose prefill was
real are judged byte for byte (their pages hold real KV); a request computed by a
simulated prefill has no real bytes, so its reads are not judged (the abstract leak oracle
covers it). When the core accepts a Finish of a request judged so:
- answered Ok after a read whose bytes were not its own: a *real leak*;
- answered ErrTag after such a read: the engine's tag guard stopped it;
and in either case the real verdict must agree with the abstract oracle's
(spec/store.py `leak_check`, on the page contents): a disagreement is the violation
`RealKVAgreement` (a real data-path bug the model does not see, or a model the data path
does not follow).

`HybridTarget` ("hybrid") is the simulator target (fuzz/sim_target.py: faults at chosen
simulated moments, the same moves, audits and checks) on a cluster whose workers are all
real: the faults strike a real data path, and the real leak oracle reports as LeakOracle.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

from spec import core
from spec.core import CLIENT, DATA, GEN, OK, TABLE
from spec.model import Model
from sim.run import simulate
from sim.scenario import Scenario, ScenarioError

from fuzz.oracles import LEAK_ORACLE
from fuzz.sim_target import SimTarget, scenario_for
from fuzz.target import Violation, register

AGREEMENT = "RealKVAgreement"
EXAMPLES_KEPT = 5  # details of real leaks and disagreements kept in the summary
_ERR_TAG = core.CLIENT_NAMES.index("ErrTag")


class EngineDataPath:
    """sim/hybrid.py's DataPath on the engine's workers and the tiny model."""

    def __init__(self, scenario: Scenario) -> None:
        from engine.pool import PoolConfig
        from engine.workers import DecodeWorker, PrefillWorker
        from fuzz.engine_reference import DecodeRecorder
        from fuzz.engine_target import _TENSORS, tiny_model

        h, c = scenario.hybrid, scenario.cluster
        self.measured = h.timing == "measured"
        self.page_tokens = pt = h.page_tokens
        self.seed = scenario.seed
        model = tiny_model()
        self.tensors, self.config = _TENSORS
        prompt_pages = -(-scenario.workload.prompt.max_tokens // c.page_tokens)
        if prompt_pages * pt > self.config.max_position_embeddings:
            raise ScenarioError(
                f"hybrid: prompts of up to {prompt_pages} pages are {prompt_pages * pt} real "
                f"tokens at hybrid.page_tokens = {pt}, past the tiny model's "
                f"{self.config.max_position_embeddings} positions: lower hybrid.page_tokens")
        pool = PoolConfig.for_model(model.config, 1, pt, model.dtype, model.device)
        # The scenario's chunk in pages, but at least 64 tokens: a chunk of one 4-token page
        # would cost a model step per page (chunking renews leases, which stay modelled).
        chunk_tokens = max(64, scenario.compute.prefill_chunk_tokens // c.page_tokens * pt)
        self.prefills = {k: PrefillWorker(model, replace(pool, num_pages=c.prefill_pages),
                                          chunk_tokens, name=f"prefill-{k}")
                         for k in h.real_prefill}
        self.decodes = {k: DecodeWorker(model, replace(pool, num_pages=c.decode_pages),
                                        c.decode_batch_max, name=f"decode-{k}")
                        for k in h.real_decode}
        for k, worker in self.decodes.items():
            worker.model = DecodeRecorder(worker, self._recorder(k))
        self.sim = None
        self.prompts: dict[int, tuple[int, ...]] = {}   # request -> its real prompt
        self.first: dict[int, int] = {}      # request -> the real prefill's first token
        self.sums: dict[tuple[int, int], int] = {}  # (request, decode page) -> checksum sent
        self.running: dict[int, dict] = {k: {} for k in self.decodes}  # d -> r -> Sequence
        self.steps: dict[int, int] = {}      # request -> real reads so far
        self.tag_stopped: set[int] = set()   # the kernel's tag check failed a read
        self.foreign: dict[int, str] = {}    # request -> its first read of bytes not its own
        self.counts = {"reads": 0, "reads_judged": 0, "reads_foreign": 0,
                       "requests_read_foreign": 0, "leaks_real": 0, "leaks_abstract": 0,
                       "stopped_by_tag_guard": 0, "disagreements": 0,
                       "bytes_copied": 0, "prompts_computed": 0, "compute_s": 0.0,
                       "decode_step_s": 0.0}
        self.examples: list[str] = []
        # A token computed from a read of foreign bytes that passed the tag check: what the
        # hybrid fuzz target reports (as the engine target does for a streamed token).
        self.tokens_from_foreign: list[str] = []

    def bind(self, sim) -> None:
        self.sim = sim

    # -- the DataPath interface (sim/hybrid.py) --------------------------------------------

    def committed(self, event, change) -> None:
        kind, r = type(event), event.request
        if kind is core.Arrive:
            rng = random.Random(f"{self.seed}:hybrid-prompt:{r}")
            tokens = (event.prompt_pages - 1) * self.page_tokens + 1
            self.prompts[r] = tuple(rng.randrange(self.config.vocab_size)
                                    for _ in range(tokens))
        elif kind is core.LandWrite:
            for write in change.landed:
                self._landed(write)
        elif kind is core.Finish:
            self._finished(r, dict(change.rows).get(r))
        if r not in self.sim.cluster.rows:
            self._forget(r)

    def compute(self, p: int, r: int, source_pages: tuple) -> float:
        from engine.generate import Request
        from engine.sampling import SamplingParams
        from fuzz.engine_reference import one_torch_thread

        worker = self.prefills[p]
        started = time.perf_counter()
        with one_torch_thread():
            sequence = worker.start(Request(r, self.prompts[r], SamplingParams(max_tokens=1)),
                                    source_pages)
            for _ in range(len(self.prompts[r]) + 1):  # a chunk a step, at least a token
                completed, faults = worker.step()
                assert not faults, f"the tiny model's prefill failed: {faults}"
                done = [token for s, token, _ in completed if s is sequence]
                if done:
                    self.first[r] = done[0]
                    break
            else:
                raise AssertionError(f"request {r}'s prompt never finished computing")
        spent_s = time.perf_counter() - started
        self.counts["prompts_computed"] += 1
        self.counts["compute_s"] += spent_s
        return spent_s

    def posted(self, p: int, write: tuple) -> None:
        r, source, page, _ = write
        self.sums[(r, page)] = self.prefills[p].checksum(source)

    def start(self, d: int, r: int) -> None:
        from engine.generate import Request
        from engine.sampling import SamplingParams

        worker = self.decodes[d]
        store = self.sim.cluster
        row = store.rows[r]
        sequence = worker.start(Request(r, self.prompts[r], SamplingParams(max_tokens=1 << 20)),
                                row[TABLE], None, core.tag_idents(store.model, row))
        worker.running.remove(sequence)  # the simulated batch says who steps (`step`)
        sequence.output_ids.append(self.first.get(r, 0))  # 0: a simulated prefill's
        self.running[d][r] = sequence

    def step(self, d: int, joined) -> float | None:
        from fuzz.engine_reference import one_torch_thread

        worker, pt = self.decodes[d], self.page_tokens
        batch = [s for r, s in self.running[d].items() if joined(r)
                 and r not in self.tag_stopped and s.num_tokens <= len(s.pages) * pt]
        if not batch:
            return None
        started = time.perf_counter()
        worker.running = batch
        with one_torch_thread():
            results = worker.step()
        worker.running = []
        for sequence, ok, logits in results:
            if ok:
                sequence.output_ids.append(int(logits.argmax()))
                r = sequence.request.request_id
                if r in self.foreign and len(self.tokens_from_foreign) < EXAMPLES_KEPT:
                    self.tokens_from_foreign.append(
                        f"request {r} computed token {len(sequence.output_ids)} from a read "
                        f"that passed the tag check: {self.foreign[r]}")
            else:  # the kernel's tag check: no token is computed from this read
                self.tag_stopped.add(sequence.request.request_id)
        spent_s = time.perf_counter() - started
        self.counts["decode_step_s"] += spent_s
        return spent_s

    def verdict(self, d: int, r: int, info, abstract: bool) -> bool:
        worker = self.decodes[d]
        if info.event is core.Finish:
            sequence = self.running[d].get(r)
            if sequence is None:
                return abstract  # never started on this worker (nothing real was read)
            return r not in self.tag_stopped and worker.tags_current(sequence)
        if info.event is core.Accept and r in self.first:
            got = {page: s for page, s in worker.received.get(r, {}).items() if s is not None}
            if not got:
                return True
            pages = sorted(got)
            return bool(worker.pool.verify(pages, [got[p] for p in pages]).all())
        return abstract  # a simulated prefill's pages carry no real checksum

    def summary(self) -> dict:
        h = self.sim.sc.hybrid
        return {"real_prefill": list(h.real_prefill), "real_decode": list(h.real_decode),
                "timing": h.timing, "page_tokens": self.page_tokens, **self.counts,
                "compute_s": round(self.counts["compute_s"], 3),
                "decode_step_s": round(self.counts["decode_step_s"], 3),
                "examples": list(self.examples)}

    # -- the real data path and its oracle -------------------------------------------------

    def _landed(self, write: tuple) -> None:
        """The core accepted a landing: into a real decode, the source page's bytes as they
        are now (from a real prefill) and the page's tag (the write's generation, the
        identity decode tags the page with)."""
        r, source, page, tag = write
        p, d = self.sim.cluster.placement[r]
        worker = self.decodes.get(d)
        checksum = self.sums.pop((r, page), None)
        if worker is None:
            return  # a simulated decode: its pages are the abstract contents
        if p in self.prefills:
            buffer = self.prefills[p].pool.pack([source])
            worker.pool.unpack(buffer, [page])
            self.counts["bytes_copied"] += buffer.numel() * buffer.element_size()
        worker.landed(r, page, checksum, tag,
                      self.sim.cluster.decode_pools[d][page][core.TAG_IDENT])

    def _recorder(self, d: int):
        def on_read(r: int, fields: dict) -> None:
            self._read(d, r, fields)
        return on_read

    def _read(self, d: int, r: int, fields: dict) -> None:
        """A real decode read, recorded at the kernel call (DecodeRecorder), judged now."""
        from engine.workers import page_tag
        from fuzz.engine_reference import DecodeRead, forward, judge, judge_bytes

        store = self.sim.cluster
        sequence = self.running[d][r]
        reserved = tuple(store.rows[r][TABLE])
        pool = store.decode_pools[d]
        read = DecodeRead(request=r, step=self.steps.get(r, 0),
                          tokens_seen=len(sequence.output_ids), reserved=reserved,
                          generations_now=tuple(pool[page][GEN] for page, _ in reserved),
                          idents=core.tag_idents(store.model, store.rows[r]), **fields)
        self.steps[r] = read.step + 1
        self.counts["reads"] += 1
        if r not in self.first:
            return  # computed by a simulated prefill: no real bytes to judge
        tokens = self.prompts[r] + tuple(sequence.output_ids)
        kv, logits = forward(self.tensors, self.config, tokens)
        self.counts["reads_judged"] += 1
        foreign = judge_bytes(read.kv, None, kv, None)
        if foreign is not None:
            foreign += self._writers(read, kv, pool)
        wrong = foreign or judge(read, tokens, kv, logits, page_tag)
        if wrong is not None and r not in self.foreign:
            self.counts["requests_read_foreign"] += foreign is not None
            self.foreign[r] = f"real decode step {read.step + 1} of request {r}: {wrong}"
        self.counts["reads_foreign"] += foreign is not None

    def _writers(self, read, kv, pool) -> str:
        """Who the page contents say wrote the pages whose real bytes are not r's (the
        store's abstract DATA; -1: never written)."""
        from fuzz.engine_reference import judge_bytes

        pt, writers = self.page_tokens, set()
        for i, page in enumerate(read.table):
            rows = slice(i * pt, min((i + 1) * pt, read.context))
            if judge_bytes(read.kv[rows], None, kv[rows], None) is not None:
                writers.add(pool[page][DATA])
        named = ", ".join("never written" if w == core.NONE else f"request {w}"
                          for w in sorted(writers))
        return f"; those pages hold what the page contents say {named} wrote"

    def _finished(self, r: int, row) -> None:
        """r's Finish was committed: the real verdict on its reads, against the abstract."""
        p, d = self.sim.cluster.placement[r]
        if row is None or d not in self.decodes or r not in self.first:
            return
        real = r in self.foreign
        store = self.sim.cluster
        if row[CLIENT] == OK:
            abstract = store.leak_check(r)
            self.counts["leaks_real"] += real
            self.counts["leaks_abstract"] += abstract
            if real:
                self._example(f"LEAK (answered Ok): {self.foreign[r]}")
            if real != abstract:
                self.counts["disagreements"] += 1
                detail = (f"request {r} answered Ok: the real KV bytes say "
                          f"{'foreign' if real else 'its own'}, the page contents say "
                          f"{'foreign' if abstract else 'its own'}")
                self._example(detail)
                store._violate(AGREEMENT, detail, r)
        elif row[CLIENT] == _ERR_TAG and real:
            self.counts["stopped_by_tag_guard"] += 1
            self._example(f"stopped by the tag guard (ErrTag): {self.foreign[r]}")

    def _example(self, text: str) -> None:
        if len(self.examples) < EXAMPLES_KEPT:
            self.examples.append(text)

    def _forget(self, r: int) -> None:
        """A settled request leaves every table (a long run keeps only live requests)."""
        for table in (self.prompts, self.first, self.steps, self.foreign):
            table.pop(r, None)
        self.tag_stopped.discard(r)
        for running in self.running.values():
            running.pop(r, None)
        for worker in self.decodes.values():
            worker.received.pop(r, None)


def all_real(scenario: Scenario, **hybrid) -> Scenario:
    """The scenario with every worker real (`kvproof sim --hybrid`), other [hybrid]
    fields as given."""
    c = scenario.cluster
    data = scenario.model_dump(mode="json")
    data["hybrid"] = {**data["hybrid"], "real_prefill": list(range(c.prefill_workers)),
                      "real_decode": list(range(c.decode_workers)), **hybrid}
    return Scenario.model_validate(data)


def simulate_hybrid(scenario: Scenario, **options) -> tuple[dict, object]:
    """sim.run.simulate with the engine's data path for the scenario's real workers."""
    return simulate(scenario, data_path=EngineDataPath(scenario), **options)


@register("hybrid")
class HybridTarget(SimTarget):
    """The simulator with every worker real: faults at simulated moments on a real data path.

    fuzz/sim_target.py's moves, timing and audits; the engine's data path (EngineDataPath)
    and its read-level leak oracle."""

    in_default_zoo = False

    def scenario_for(self, model: Model, seed: int) -> tuple[Scenario, Model, dict]:
        scenario, pair, timing = scenario_for(model, seed)
        return all_real(scenario), pair, timing

    def simulation(self, scenario: Scenario, pair: Model):
        from sim.run import Simulation

        self.data = EngineDataPath(scenario)
        return Simulation(scenario, model=pair, on_commit=self._committed,
                          data_path=self.data)

    def describe(self) -> str:
        return "hybrid (every worker real, tiny model): " + super().describe()

    def check(self) -> list[Violation]:
        found = super().check()
        return found + [Violation(LEAK_ORACLE, f"engine read oracle: {text}")
                        for text in self.data.tokens_from_foreign]
