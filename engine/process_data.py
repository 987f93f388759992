"""The real data path of the worker processes (engine/processes.py): a model, a KV pool and a
DistTransport in each prefill and decode process, in place of the modelled one.

Theory of operation
-------------------
A worker process keeps deciding nothing: its part (spec/parts.py, through the core) says
when to compute, which pages to send where, when to decode and when to release; these
classes only carry out those commands on tensors and report what they observe.

- Each process loads the model from the same folder (`Deployment.model_dir`, an HF folder
  written once by whoever starts the deployment), so every process holds identical
  weights, and runs engine/workers.py's PrefillWorker or DecodeWorker on its own KVPool:
  the very data path the in-process engine runs (chunked prefill, checksums sealed at the
  end of a prompt, decode attention that checks every page's tag).
- The page writes go over engine/dist_transport.py (gloo on 127.0.0.1): one world of the
  P + D worker processes (decode d is rank d, prefill q is rank D + q; the router moves no
  KV and is not in it), joined through a FileStore in the deployment's log folder (no port
  to pick, so no race for one). The source page is read when decode lands the write, as an
  RDMA NIC would read it.
- Pages are named two ways: the core's flat page numbers (worker w's pages are w * pages ..
  w * pages + pages - 1, spec/parts.py `Part.base`) and each pool's own indexes; the
  conversion is here and nowhere else.
- The request's payload (its prompt's token ids and max_tokens) comes with its first
  message from the router; the first token, which the prefill samples at the end of the
  prompt, travels with the prefill's final word (engine/processes.py), as a disaggregated
  server sends it with its transfer's status.

The model step runs on a thread of its own (`Stepper`): a prefill chunk takes ~1 s on the
default model on a CPU, a decode step ~0.1-0.2 s, and a loop that computed in line took no
message meanwhile, so a completion that came during a chunk held the request's SendDone
(and its decode's Accept, and its first token) until the chunk ended (measured: 14 of 32
requests' SendDone 2.4 s late, their decode meanwhile stepping one request at a time). The
loop thread keeps everything else: the part, the channel, the transport, sampling, and
every change to the worker's sequences. What it must not do while a step is in flight is
change what that step reads or writes: a sequence started then is started after it; a
sequence stopped then (its pages freed) waits for the step if it is in it, so a page the
core frees is never written by a step still running (a new owner's landing could land
under it); landings meanwhile write pages only requests that are not decoding hold.

Decoding is greedy (the payload has no other sampling parameters yet: the serving edge
refuses them, engine/process_engine.py) and ends at max_tokens or at one of the payload's
end-of-sequence token ids (none in the tests' fixed workloads: exactly max_tokens). Stop
strings need the text, and the worker has no tokenizer: not served across processes yet.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from engine.dist_transport import (DECODE, PREFILL, DistTransport, DistTransportConfig,
                                   TransportError)
from engine.generate import Generator, GeneratorConfig, Request
from engine.model import LlamaModel
from engine.pool import PoolConfig
from engine.sampling import SamplingParams, sample
from engine.transport import PageWrite
from engine.weights import load_checkpoint
from engine.workers import DecodeWorker, PrefillWorker, kv_rows


STEP_S_MAX = 600.0  # a model step that takes longer is a hung process: the wait raises


class Stepper:
    """A worker's model step on a thread of its own, one at a time: `begin` hands it a step,
    the loop goes on with its messages, `take` gives the step's result once it is done
    (`on_done`, called on the step's thread, wakes the loop's receive), `wait` blocks until
    it is. An exception the step raised is raised by `take`, in the loop's thread."""

    def __init__(self, name: str, on_done: Callable[[], None]) -> None:
        self.on_done = on_done
        self.in_flight = False
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self._results: queue.Queue = queue.Queue(maxsize=1)
        self._held: tuple | None = None  # a result `wait` took, for the next `take`
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(1)  # (a thread's own setting: the process's one thread)
        while (job := self._jobs.get()) is not None:
            try:
                result = (job(), None)
            except BaseException as error:  # noqa: BLE001 -- raised again by take()
                result = (None, error)
            self._results.put(result)
            self.on_done()

    def begin(self, step: Callable[[], object]) -> None:
        assert not self.in_flight, "a step is in flight already"
        self.in_flight = True
        self._jobs.put(step)

    def finished(self) -> bool:
        return self._held is not None or (self.in_flight and not self._results.empty())

    def wait(self) -> None:
        """Until the step in flight (if any) is done; its result waits for `take`."""
        if self.in_flight and self._held is None:
            try:
                self._held = self._results.get(timeout=STEP_S_MAX)
            except queue.Empty:
                raise TimeoutError(f"a model step ran past STEP_S_MAX ({STEP_S_MAX} s)") from None

    def take(self) -> tuple[bool, object]:
        """(True, the step's result) once the step in flight is done, else (False, None)."""
        if not self.in_flight:
            return False, None
        if self._held is None:
            try:
                self._held = self._results.get_nowait()
            except queue.Empty:
                return False, None
        (result, error), self._held, self.in_flight = self._held, None, False
        if error is not None:
            raise error
        return True, result

    def close(self) -> None:
        try:
            self._jobs.put_nowait(None)
        except queue.Full:  # (a step begun and not yet picked up: the thread is a daemon)
            pass


@dataclass(frozen=True)
class Payload:
    """What a worker needs of a request besides the protocol: its prompt, its length and
    the token ids that end it early (the tokenizer's end of sequence; none: max_tokens)."""

    prompt_ids: tuple
    max_tokens: int
    eos_ids: tuple = ()

    def request(self, r: int) -> Request:
        return Request(r, tuple(self.prompt_ids),
                       SamplingParams(max_tokens=self.max_tokens, ignore_eos=True))


def rank_of(deployment, role: str, worker: int) -> int:
    return worker if role == DECODE else deployment.decode_workers + worker


def rendezvous_path(deployment) -> str:
    """The FileStore the worker processes meet at. The launcher removes a stale one before
    it starts them: a store left by an earlier deployment in the same folder (processes
    leave with os._exit, so nobody deletes it) would hold its keys."""
    return os.path.join(os.path.abspath(deployment.log_dir), "gloo.rendezvous")


def join_world(deployment, role: str, worker: int) -> None:
    """Join the gloo world of the worker processes (blocks until every one has joined, at
    most join_timeout_s)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1 unless set otherwise
    where = {"init_method": f"file://{rendezvous_path(deployment)}"}
    if deployment.rendezvous:  # workers that joined at a rendezvous meet in its store
        from engine.rendezvous import Rendezvous
        where = {"store": Rendezvous(deployment.rendezvous, hosting=False,
                                     timeout_s=deployment.join_timeout_s).gloo_store()}
    dist.init_process_group(
        "gloo", rank=rank_of(deployment, role, worker),
        world_size=deployment.prefill_workers + deployment.decode_workers,
        timeout=datetime.timedelta(seconds=deployment.join_timeout_s), **where)


def warm_up(model: LlamaModel) -> None:
    """One short request through the model in a scratch pool of its own: the first calls'
    one-off costs (kernel selection, the rotary table) are paid before any traffic."""
    scratch = Generator(model, GeneratorConfig(num_pages=4, page_tokens=4))
    scratch.run([Request(0, tuple(range(1, 9)), SamplingParams(max_tokens=2))])


def _worker_parts(deployment, role: str) -> tuple[LlamaModel, PoolConfig]:
    torch.set_num_threads(1)  # P + D + 1 processes share the machine's cores
    model = LlamaModel(load_checkpoint(deployment.model_dir))
    warm_up(model)
    pages = deployment.prefill_pages if role == PREFILL else deployment.decode_pages
    return model, PoolConfig.for_model(model.config, pages, deployment.page_tokens,
                                       model.dtype, model.device)


class _Data:
    """What both roles share: the pool's place in the core's flat pool, the transport."""

    ROLE = ""

    def __init__(self, deployment, worker: int, on_step_done: Callable[[], None]) -> None:
        self.deployment, self.worker_index = deployment, worker
        self.pages = (deployment.prefill_pages if self.ROLE == PREFILL
                      else deployment.decode_pages)
        self.base = worker * self.pages
        self.transport: DistTransport | None = None
        self.stepper = Stepper(f"{self.ROLE}-{worker} model step", on_step_done)
        self.in_step: set[int] = set()   # the requests the step in flight computes
        self.left_step: set[int] = set()  # of those, the ones stopped while it ran

    def local(self, page: int) -> int:
        assert self.base <= page < self.base + self.pages, f"page {page} is not this pool's"
        return page - self.base

    def join(self, pool) -> None:
        d = self.deployment
        join_world(d, self.ROLE, self.worker_index)
        other, count = (DECODE, d.decode_workers) if self.ROLE == PREFILL else (
            PREFILL, d.prefill_workers)
        peers = tuple((k, rank_of(d, other, k)) for k in range(count))
        self.transport = DistTransport(pool, DistTransportConfig(
            self.ROLE, self.worker_index, peers, timeout_s=d.transport_timeout_s,
            handshake_timeout_s=d.join_timeout_s))

    def waiting(self) -> bool:
        """Whether the loop may be held by a bounded wait of the data path now: a model step
        runs (`Stepper.wait` waits for it, STEP_S_MAX at most) or a transport wait is in
        progress (timeout_s at most). Each raises past its bound."""
        return self.stepper.in_flight or bool(self.transport and self.transport.waits)

    def begin_step(self, requests: set[int], step: Callable[[], object]) -> None:
        self.in_step, self.left_step = requests, set()
        self.stepper.begin(step)

    def may_stop(self, r: int) -> bool:
        """Before the worker stops r (its pages are being freed): a step in flight that
        computes r is waited for, so that it writes none of them after this (and reports
        nothing of r). Whether no step is running now (none in flight, or r's is done)."""
        if not self.stepper.in_flight:
            return True
        if r not in self.in_step:
            return False  # (the step in flight reads none of r's pages)
        self.stepper.wait()
        self.left_step.add(r)
        return True

    def close(self) -> None:
        """CLOSE to every peer; one that died refuses it, and this process is leaving."""
        self.stepper.close()
        if self.transport is not None:
            try:
                self.transport.close()
            except TransportError:
                pass


class PrefillData(_Data):
    """A prefill process's data path: PrefillWorker on its pool, posts over DistTransport."""

    ROLE = PREFILL

    def __init__(self, deployment, worker: int, on_step_done: Callable[[], None]) -> None:
        super().__init__(deployment, worker, on_step_done)
        model, pool = _worker_parts(deployment, PREFILL)
        self.worker = PrefillWorker(model, pool, deployment.prefill_chunk_tokens,
                                    name=f"prefill-{worker}")
        self.starting: list[tuple] = []  # (request, local source pages): after the step
        self.first: dict[int, int] = {}  # request -> the first token, sampled here
        self.writes_lost = 0  # posts a dead decode refused (its crash's record fails them)

    def join(self) -> None:
        super().join(self.worker.pool)

    def compute(self, r: int, payload: Payload, sources: tuple) -> None:
        """Compute (the core's command) into the admitted source pages, from the next
        chunked step on."""
        self.starting.append((payload.request(r), tuple(self.local(p) for p in sources)))

    def busy(self) -> bool:
        """Whether the loop has the data path's work to take up now (not a step running)."""
        return self.stepper.finished() or (not self.stepper.in_flight and bool(
            self.worker.computing or self.starting))

    def step(self) -> list[int]:
        """The chunked prefill step that finished, if one did: the requests whose prompt it
        computed (their pages sealed, their first token kept); then the next step begins
        on its own thread, with the prompts started meanwhile."""
        finished, out = self.stepper.take()
        done = []
        if finished:
            completed, faults = out
            assert not faults, f"prefill compute failed: {[f.detail for f in faults]}"
            for sequence, token, _ in completed:
                r = sequence.request.request_id
                if r not in self.left_step:
                    self.first[r] = token
                    done.append(r)
        if not self.stepper.in_flight:
            for request, sources in self.starting:
                self.worker.start(request, sources)
            self.starting.clear()
            if self.worker.computing:
                self.begin_step({s.request.request_id for s in self.worker.computing},
                                self.worker.step)
        return done

    def post(self, write: tuple, decode: int) -> None:
        """The core's Post: the write (flat page numbers) with the source's checksum now."""
        r, source, page, tag = write
        local = self.local(source)
        try:
            self.transport.post(PageWrite(r, local, page - decode * self.deployment.decode_pages,
                                          tag, self.worker.checksum(local), self.worker_index,
                                          decode))
        except TransportError:
            # A decode that died before this process's detector said so: the write is lost
            # with it, as the spec's DecodeCrash flushes it; the crash's record ends the
            # request here (engine/processes.py), so nothing waits for this write.
            self.writes_lost += 1

    def poll(self) -> None:
        """Completions free the transport's window; the protocol's completion is the
        router's LandWrite (engine/processes.py), not this."""
        self.transport.completed()

    def stop(self, r: int) -> None:
        self.starting = [(request, sources) for request, sources in self.starting
                         if request.request_id != r]
        if self.may_stop(r):  # (else r is not computing: the step running took them all)
            self.worker.stop(r)


class DecodeData(_Data):
    """A decode process's data path: lands writes into its pool, decodes greedily."""

    ROLE = DECODE

    def __init__(self, deployment, worker: int, on_step_done: Callable[[], None]) -> None:
        super().__init__(deployment, worker, on_step_done)
        model, pool = _worker_parts(deployment, DECODE)
        self.worker = DecodeWorker(model, pool, deployment.max_batch, name=f"decode-{worker}")
        self.arrived: list[PageWrite] = []   # ready, not landed yet, in arrival order
        self.done: dict[int, bool] = {}      # request -> tags verdict, decoding ended
        self.eos: dict[int, frozenset] = {}  # request -> the token ids that end it
        self.bytes_landed = 0

    def join(self) -> None:
        super().join(self.worker.pool)

    def flat(self, write: PageWrite) -> tuple:
        """The core's write tuple (flat page numbers) of a transport write."""
        return (write.request, write.prefill * self.deployment.prefill_pages + write.source_page,
                self.base + write.decode_page, write.tag)

    def land(self, announced) -> list[tuple]:
        """Land the ready writes whose posting the prefill has announced (`announced`: the
        flat write tuples it has told about; the landing needs its poster's stamp), in
        arrival order; returns the flat tuples landed."""
        self.arrived += self.transport.ready()
        batch, waiting = [], set()   # waiting: prefills with a write not yet announced
        for write in self.arrived:
            if write.prefill in waiting or self.flat(write) not in announced:
                waiting.add(write.prefill)  # a peer's writes land in their order
                continue
            batch.append(write)
        if not batch:
            return []
        self.arrived = [write for write in self.arrived if write.prefill in waiting
                        and write not in batch]
        moved = self.transport.land_many(batch)
        for write, count in zip(batch, moved):
            assert count > 0, f"{write} moved no byte"
            self.bytes_landed += count
            self.worker.landed(write.request, write.decode_page, write.checksum, write.tag)
        return [self.flat(write) for write in batch]

    def transfer_ok(self, r: int, announced: int) -> bool:
        """Accept's observed verdict: the count and every landed page's checksum."""
        return self.worker.transfer_fault(r, announced) == ""

    def start(self, r: int, payload: Payload, table: tuple, first: int) -> bool:
        """StartDecoding (the core's command): the sequence on its reserved pages, the
        prefill's first token its first output, in the batch from the next decode step on;
        whether that token already ends it."""
        local = tuple((self.local(page), gen) for page, gen in table)
        if payload.eos_ids:
            self.eos[r] = frozenset(payload.eos_ids)
        sequence = self.worker.start(payload.request(r), local, None)
        sequence.output_ids.append(first)
        return self._maybe_done(sequence)

    def busy(self) -> bool:
        """Whether the loop has the data path's work to take up now (not a step running)."""
        return self.stepper.finished() or (not self.stepper.in_flight
                                           and bool(self.worker.running))

    def step(self) -> list[tuple[int, int | None, bool]]:
        """The decode step that finished, if one did: (request, its new token or None after
        a failed tag check, whether it ended now: its tags verdict is then in `done`) per
        sequence it stepped; then the next step begins on its own thread, over a batch
        taken now (sequences start and end between steps, in this thread)."""
        finished, stepped = self.stepper.take()
        out = []
        for sequence, ok, logits in stepped if finished else ():
            if sequence.request.request_id in self.left_step:
                continue  # stopped while the step ran: nothing more of it is reported
            token = None
            if ok:
                token, = sample(logits[None], [sequence.request.sampling], [None])
                sequence.output_ids.append(token)
            out.append((sequence.request.request_id, token, self._maybe_done(sequence, ok)))
        batch = self.worker.running[:self.worker.max_batch]
        if batch and not self.stepper.in_flight:
            self.begin_step({s.request.request_id for s in batch},
                            lambda: self.worker.step(batch))
        return out

    def _maybe_done(self, sequence, ok: bool = True) -> bool:
        """A sequence ends at max_tokens, at an end-of-sequence token (which the serving edge
        does not output) or on a failed tag check; it leaves the batch at once (its next
        position has no reserved page), and Finish (the core's) follows."""
        r = sequence.request.request_id
        eos = sequence.output_ids[-1] in self.eos.get(r, ()) if sequence.output_ids else False
        if ok and not eos and len(sequence.output_ids) < sequence.request.sampling.max_tokens:
            return False
        self.eos.pop(r, None)
        self.done[r] = ok and self.worker.tags_current(sequence)
        if self.deployment.keep_kv:
            self.keep_read_kv(sequence)
        self.worker.running.remove(sequence)
        return True

    def stop(self, r: int) -> None:
        self.may_stop(r)  # (a step running reads its own batch, not `running`)
        self.worker.stop(r)
        self.eos.pop(r, None)

    def keep_read_kv(self, sequence) -> None:
        """The leak oracle's evidence (tests): the prompt KV this decode read for the
        request, [tokens, layers, 2, kv_heads, dim], saved beside the logs, for an oracle
        that computes the request's own KV by a path sharing nothing with this one but the
        model."""
        read = kv_rows(self.worker.pool, sequence.pages, len(sequence.prompt_ids))
        torch.save(read, read_kv_path(self.deployment, sequence.request.request_id))


def read_kv_path(deployment, r: int) -> str:
    return os.path.join(deployment.log_dir, f"read-kv-{r}.pt")
