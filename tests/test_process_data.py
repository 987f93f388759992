"""The real data path across processes (engine/process_data.py): a router and P prefill + D
decode OS processes on 127.0.0.1, each worker with the tiny random Llama loaded from one
folder, its own KV pool, and the page writes moved by DistTransport over gloo.

The judge is a greedy decoder written here that shares nothing with the code under test
but the model: each request alone, its pages in order in a pool of its own, the whole
prompt in one prefill call, one decode call a token; no engine/workers.py, no
engine/generate.py helpers, no transport, no protocol. The in-process engine
(engine/runtime.py) must give the same tokens too (it shares engine/workers.py with the
processes, so it is a second witness, not the judge). Every process is killed in a
finally, every wait is bounded, seeds are printed.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kernels  # noqa: E402
from engine.model import DecodeBatch, LlamaModel, PrefillChunk  # noqa: E402
from engine.processes import Deployment, Launched  # noqa: E402
from engine.runtime import Runtime, RuntimeConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.service import GenerationRequest, TokenOut  # noqa: E402
from engine.weights import load_checkpoint  # noqa: E402
from engine_cases import make_hf_model  # noqa: E402
from sim.trace import read_part_logs  # noqa: E402
from spec.partlog import merge  # noqa: E402
from spec.tlaplus.runcheck import check_part_logs  # noqa: E402
from test_processes import (_admitted, _decode_log, _reserved_unfinished,  # noqa: E402
                            assert_one_decode_crash_validates, assert_whole, expected_steps,
                            merged_run, run_with_fault)
from engine.processes import log_path  # noqa: E402
from tests.cli_cases import run as cli  # noqa: E402

MODEL_SEED = 0
PROMPT_SEED = 11
PAGE_TOKENS = 4
# (prompt tokens, max_tokens): mixed lengths, one request of a single token, prompts that
# end mid-page and on a page boundary.
SHAPES = [(1, 6), (3, 9), (9, 4), (14, 12), (22, 7), (5, 1), (30, 10), (16, 5)]
WAIT_S = 120.0  # the longest the test waits for the processes (5 processes on 2 cores)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    print(f"model seed={MODEL_SEED} (llama-gqa), in {folder}")
    make_hf_model("llama-gqa", folder, seed=MODEL_SEED)
    return folder


def requests() -> list[tuple[tuple[int, ...], int]]:
    print(f"prompt seed={PROMPT_SEED}")
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return [(tuple(torch.randint(0, 211, (n,), generator=generator).tolist()), max_tokens)
            for n, max_tokens in SHAPES]


@torch.inference_mode()
def greedy_alone(model: LlamaModel, prompt_ids: tuple, max_tokens: int) -> list[int]:
    """The judge: one request in a pool of its own, pages 0, 1, ... in order."""
    config = model.config
    tokens = len(prompt_ids) + max_tokens
    pages = -(-tokens // PAGE_TOKENS)
    pool = SimpleNamespace(
        kv=torch.zeros(pages, config.num_layers, 2, config.num_kv_heads, PAGE_TOKENS,
                       config.head_dim),
        tags=torch.zeros(pages, dtype=torch.int64))
    row = torch.arange(pages, dtype=torch.int32)
    n = len(prompt_ids)
    logits = model.prefill(pool, [PrefillChunk(torch.tensor(prompt_ids), 0, torch.arange(n),
                                               row)])
    out = [int(logits[0].argmax())]
    while len(out) < max_tokens:
        position = n + len(out) - 1
        batch = DecodeBatch(token_ids=torch.tensor([out[-1]]),
                            positions=torch.tensor([position]),
                            slots=torch.tensor([position]), block_table=row[None],
                            context_lengths=torch.tensor([position + 1], dtype=torch.int32),
                            expected_tags=torch.full((1, pages), kernels.FRESH_TAG))
        logits, _ = model.decode(pool, batch, check_tags=False)
        out.append(int(logits[0].argmax()))
    return out


def in_process(model: LlamaModel, work: list) -> list[list[int]]:
    """The in-process engine's tokens for the same requests (1 x 1, one process)."""
    rt = Runtime(model, RuntimeConfig(prefill_pages=64, decode_pages=64,
                                      page_tokens=PAGE_TOKENS, context_tokens=256,
                                      prefill_chunk_tokens=8, lease_s=1e9,
                                      transfer_timeout_s=1e9))
    seen: dict[int, list] = {}
    for prompt_ids, max_tokens in work:
        rt.arrive(GenerationRequest(prompt_ids, SamplingParams(max_tokens=max_tokens,
                                                               ignore_eos=True)),
                  lambda e: seen.setdefault(e.request_id, []).append(e))
    for _ in range(2000):
        if rt.idle:
            break
        rt.step()
    return [[e.token_id for e in seen[r] if isinstance(e, TokenOut)] for r in range(len(work))]


@pytest.fixture(scope="module")
def expected(model_dir):
    model = LlamaModel(load_checkpoint(model_dir))
    work = requests()
    judged = [greedy_alone(model, ids, n) for ids, n in work]
    assert in_process(model, work) == judged
    assert [len(t) for t in judged] == [n for _, n in SHAPES]
    return judged


def run_to_the_end(d: Deployment) -> tuple[dict, dict, float]:
    launched = Launched(d)
    started = time.monotonic()
    try:
        launched.start(timeout_s=WAIT_S)
        done = launched.wait_done(WAIT_S)
        return done, launched.stop(timeout_s=WAIT_S), time.monotonic() - started
    finally:
        launched.close()


def deployment(model_dir, tmp_path, prefills: int, decodes: int, seed: int = 7,
               **options) -> Deployment:
    print(f"deployment {prefills} x {decodes}, router seed={seed}, logs in {tmp_path}, "
          f"{options}")
    return Deployment.with_model(
        str(model_dir), requests(), page_tokens=PAGE_TOKENS, prefill_workers=prefills,
        decode_workers=decodes, prefill_pages=16, decode_pages=16, seed=seed,
        log_dir=str(tmp_path), suspect_after_s=10.0, heartbeat_s=0.5, **options)


# Pages per request: its prompt and every output but the last, 4 tokens a page.
PAGES = [2, 3, 3, 7, 7, 2, 10, 5]
PAGE_BYTES = 2 * 2 * 2 * PAGE_TOKENS * 16 * 4  # layers, K|V, kv heads, tokens, dim, fp32


def check_run(d: Deployment, done: dict, stopped: dict, tmp_path, expected) -> None:
    assert d.prompts == tuple(PAGES)
    assert done["outcomes"] == ["Ok"] * len(SHAPES)
    assert done["tokens"] == expected
    assert_whole(stopped)
    landed = sum(report.get("bytes_landed", 0) for report in stopped.values())
    assert landed == sum(PAGES) * PAGE_BYTES == 39 * 2048
    placement = [tuple(x) for x in done["placement"]]
    merged, verdict = merged_run(tmp_path)
    assert merged.parts == expected_steps(d.prompts, placement, d.prefill_workers,
                                          d.decode_workers)
    assert verdict.steps == 8 + (2 * 8 + 39) + 4 * 8 + 39 == 134


def test_one_prefill_one_decode_process_give_the_judges_tokens(model_dir, tmp_path,
                                                               expected, capsys):
    d = deployment(model_dir, tmp_path, 1, 1)
    done, stopped, took_s = run_to_the_end(d)
    print(f"1 x 1 ran in {took_s:.1f} s")
    check_run(d, done, stopped, tmp_path, expected)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and "run OK: 134 steps" in out, out + err


def test_two_prefill_two_decode_processes_give_the_judges_tokens(model_dir, tmp_path,
                                                                 expected):
    d = deployment(model_dir, tmp_path, 2, 2)
    done, stopped, took_s = run_to_the_end(d)
    print(f"2 x 2 ran in {took_s:.1f} s")
    placement = [tuple(x) for x in done["placement"]]
    assert {p for p, _ in placement} == {0, 1} and {k for _, k in placement} == {0, 1}
    check_run(d, done, stopped, tmp_path, expected)


def test_a_killed_decode_process_ends_its_requests_and_the_rest_give_the_judges_tokens(
        model_dir, tmp_path, expected, capsys):
    """2 x 2 on the real data path; decode 1 is SIGKILLed once it holds two reserved
    requests whose pages have not come (router seed 2 places requests 1 and 2 there first,
    0.02 s apart; each prefill holds its pages 0.4 s after the compute, so the kill finds
    them reserved and unwritten)."""
    d = deployment(model_dir, tmp_path, 2, 2, seed=2, compute_s=0.4, arrive_every_s=0.02)
    victim = "decode 1"
    run = run_with_fault(d, victim, lambda: len(_reserved_unfinished(log_path(d, victim))) >= 2,
                         "two reserved requests", start_s=WAIT_S, ready_s=30.0)
    done, stopped = run.done, run.stopped
    placement = [tuple(x) for x in done["placement"]]
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, outcome in outcomes.items() if outcome == "ErrDecode"}
    on_victim = {r for r, (_, k) in enumerate(placement) if k == 1}
    print(f"ErrDecode: {sorted(lost)}; on {victim}: {sorted(on_victim)}")
    assert {1, 2} <= lost <= on_victim
    # Every other request is Ok with the judge's tokens; a client of the dead decode got
    # Ok exactly when its log holds the Finish.
    for r, outcome in outcomes.items():
        if r not in lost:
            assert outcome == "Ok" and done["tokens"][r] == expected[r], r
    finished = _decode_log(log_path(d, victim))
    assert {r for r in on_victim if ("Finish", r) in finished} == on_victim - lost
    assert_one_decode_crash_validates(tmp_path, lost, stopped, capsys)


def _actions(path) -> list[tuple]:
    """(action, request) of every whole record of a part log, in order."""
    import json
    return [(x["a"], x.get("request")) for x in
            (json.loads(line) for line in path.read_text().splitlines()[1:]
             if line.endswith("}"))]


def test_a_decode_killed_with_page_writes_in_flight_loses_only_its_requests(
        model_dir, tmp_path, expected, capsys):
    """Mid-transfer: decode 1 is stopped (SIGSTOP) once it holds requests 1 and 2 reserved
    (router seed 2), so prefill 0's page writes for them are posted and none can land;
    once every page of both is posted, decode 1 is SIGKILLed. The writes in flight die
    with it: both requests end ErrDecode, no LandWrite of theirs is logged, prefill 0 ends
    with nothing in flight, and everything else finishes with the judge's tokens."""
    import signal
    d = deployment(model_dir, tmp_path, 2, 2, seed=2, compute_s=0.4, arrive_every_s=0.02)
    victim, lost_expected = "decode 1", {1, 2}
    launched = Launched(d)
    try:
        launched.start(timeout_s=WAIT_S)
        deadline = time.monotonic() + 30.0
        while set(_reserved_unfinished(log_path(d, victim))) != lost_expected:
            assert time.monotonic() < deadline, f"{victim} never held requests 1 and 2"
            time.sleep(0.005)
        launched.children[victim].process.send_signal(signal.SIGSTOP)
        prefill_log = log_path(d, "prefill 0")
        deadline = time.monotonic() + 60.0  # its own bound: the first wait may take long
        while sum(1 for a, r in _actions(prefill_log)
                  if a == "SendPage" and r in lost_expected) < PAGES[1] + PAGES[2]:
            assert time.monotonic() < deadline, "prefill 0 never posted the pages"
            time.sleep(0.005)
        launched.kill(victim)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop(timeout_s=WAIT_S)
    finally:
        launched.close()
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, outcome in outcomes.items() if outcome == "ErrDecode"}
    # Requests placed on decode 1 while it was stopped (the router cannot tell a stopped
    # process from a slow one before the kill) are lost with it too, and only those.
    on_victim = {r for r, (_, k) in enumerate(done["placement"]) if k == 1}
    print(f"ErrDecode: {sorted(lost)}; on {victim}: {sorted(on_victim)}")
    assert lost_expected <= lost == on_victim, outcomes
    for r, outcome in outcomes.items():
        if r not in lost:
            assert outcome == "Ok" and done["tokens"][r] == expected[r], r
    assert_whole(stopped)
    assert stopped["prefill 0"]["writes_lost"] == 0  # every post went out before the kill
    merged, verdict = merged_run(tmp_path)
    actions = [(x["a"], x.get("request")) for x in merged.records]
    assert not [r for a, r in actions if a == "LandWrite" and r in lost]
    # Three pages each; the two requests' pages may interleave (both computed in one turn).
    assert sorted(r for a, r in actions if a == "SendPage" and r in lost) == [1] * 3 + [2] * 3
    assert sorted(r for a, r in actions if a == "Reserve" and r in lost) == [1, 2]
    assert actions.count(("DecodeCrash", None)) == 1
    # Their writes never completed, so prefill 0 could say Done only once the crash had
    # flushed them (the spec allows it then: the final word to a dead peer, unsent).
    crash = actions.index(("DecodeCrash", None))
    assert [i > crash for i, (a, r) in enumerate(actions)
            if a == "SendDone" and r in lost_expected] == [True, True]
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err


# -- the incident across processes: the bug switches still bite ------------------------------

INCIDENT_BASE = ("PoolBelowContext",)  # the startup check off: a prefill pool of 12 pages
#                                        below a 14-page context joins the deployment
LONG = 3  # the over-long request: 52 tokens + 4 outputs = 14 pages, the prefill pool 12


def incident_requests() -> list[tuple[tuple, int]]:
    """Three requests that fill all 20 decode pages with their KV (8 + 8 + 4 pages, at
    once) and finish; 1 s later the over-long prompt, and a request beside it."""
    print(f"incident prompt seed={PROMPT_SEED}")
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return [(tuple(torch.randint(0, 211, (n,), generator=generator).tolist()), max_tokens)
            for n, max_tokens in [(30, 3), (30, 3), (14, 3), (52, 4), (10, 4)]]


@torch.inference_mode()
def own_kv(model: LlamaModel, prompt_ids: tuple) -> torch.Tensor:
    """The judge's KV of a prompt computed alone, [tokens, layers, 2, kv_heads, dim]: the
    whole prompt in one prefill call into a pool of its own, pages in order."""
    config = model.config
    pages = -(-len(prompt_ids) // PAGE_TOKENS)
    pool = SimpleNamespace(
        kv=torch.zeros(pages, config.num_layers, 2, config.num_kv_heads, PAGE_TOKENS,
                       config.head_dim),
        tags=torch.zeros(pages, dtype=torch.int64))
    model.prefill(pool, [PrefillChunk(torch.tensor(prompt_ids), 0,
                                      torch.arange(len(prompt_ids)),
                                      torch.arange(pages, dtype=torch.int32))])
    kv = pool.kv.permute(0, 4, 1, 2, 3, 5)  # [pages, tokens, layers, 2, heads, dim]
    return kv.reshape(-1, *kv.shape[2:])[:len(prompt_ids)]


def incident(model_dir, tmp_path, bugs: tuple) -> tuple[dict, Deployment]:
    print(f"incident: 1 x 1, bugs={sorted(INCIDENT_BASE + bugs)}, logs in {tmp_path}")
    d = Deployment.with_model(
        str(model_dir), incident_requests(), page_tokens=PAGE_TOKENS, prefill_pages=12,
        decode_pages=20, seed=7, log_dir=str(tmp_path), suspect_after_s=10.0,
        heartbeat_s=0.5, arrive_after_s=(0.0, 0.0, 1.0, 0.0), keep_kv=True,
        bugs=INCIDENT_BASE + bugs)
    assert d.prompts == (8, 8, 4, 14, 4)
    done, stopped, _ = run_to_the_end(d)
    assert_whole(stopped)
    return done, d


def spec_verdict(folder):
    """The merged logs checked against the spec with the deployment's switches."""
    m, logs = read_part_logs(sorted(folder.glob("*.ndjson")))
    return check_part_logs(merge(m, logs))


@pytest.mark.parametrize("bugs,outcome", [
    ((), "ErrTooLong"),                                        # the prefill rejects it
    (("FinishedNotRejected", "NoCountCheck"), "ErrTag"),       # the tag check catches it
    (("FinishedNotRejected", "NoCountCheck", "NoGenBump"), "Ok"),  # HTTP 200 over foreign KV
])
def test_the_incident_across_processes(model_dir, tmp_path, expected, bugs, outcome):
    from engine.process_data import read_kv_path
    done, d = incident(model_dir, tmp_path, bugs)
    got = done["outcomes"][3]
    # The rejected prompt's client is answered twice, by the prefill's Reject and by
    # decode's notice of it, over two connections, and the router keeps whichever comes
    # first: both say ErrTooLong (the spec's WordAnswer), so the answer is the same in
    # either order.
    assert done["outcomes"][:3] + done["outcomes"][4:] == ["Ok"] * 4
    assert got == outcome, done["outcomes"]
    # The merged run is a behaviour of the spec with these switches; with them on, the
    # spec's own property names the step where it went wrong: decode accepting the
    # transfer of a request the guards would have rejected.
    verdict = spec_verdict(tmp_path)
    if not bugs:
        assert verdict.ok, verdict.message
    else:
        assert (verdict.ok, verdict.action, verdict.violated) == (
            False, "Accept", "RejectedIsError"), verdict.message
        assert "is a legal step" in verdict.message and f"Accept(r{LONG + 1}," in verdict.message
    model = LlamaModel(load_checkpoint(model_dir))
    work = incident_requests()
    for r in (0, 1, 2, 4):  # every other request: the judge's tokens
        assert done["tokens"][r] == greedy_alone(model, *work[r]), r
    path = Path(read_kv_path(d, LONG))
    if outcome == "ErrTooLong":
        assert not path.exists()  # it never decoded
        return
    read, own = torch.load(path), own_kv(model, work[LONG][0])
    assert read.shape == own.shape == (52, 2, 2, 2, 16)
    # The placeholder's one page is its own KV (the prefill computed 4 of 52 tokens)...
    assert torch.allclose(read[:PAGE_TOKENS], own[:PAGE_TOKENS], atol=1e-4)
    # ...and every later position was never written for it: decode read other requests'
    # KV there, nothing like its own...
    for position in range(PAGE_TOKENS, 52):
        assert not torch.allclose(read[position], own[position], atol=1e-2), position
    # ...but exactly what the three earlier requests' prompts and outputs left in those
    # pages (each row one of theirs; the judge recomputes theirs alone).
    theirs = torch.cat([own_kv(model, work[r][0] + tuple(done["tokens"][r][:-1]))
                        for r in range(3)])
    for position in range(PAGE_TOKENS, 52):
        closest = (theirs - read[position]).abs().flatten(1).max(dim=1).values.min()
        assert closest < 1e-4, (position, float(closest))


def test_a_second_deployment_in_the_same_folder_starts(model_dir, tmp_path):
    """The gloo FileStore a deployment leaves behind (its processes leave with os._exit)
    would hold the next one's rendezvous: the launcher removes it first."""
    d = Deployment.with_model(str(model_dir), [((1, 2, 3), 2)], log_dir=str(tmp_path),
                              page_tokens=PAGE_TOKENS, join_timeout_s=15.0)
    for _ in range(2):
        done, stopped, _ = run_to_the_end(d)
        assert done["outcomes"] == ["Ok"] and len(done["tokens"][0]) == 2
        assert_whole(stopped)


def test_a_killed_prefill_process_ends_what_it_held_and_the_rest_give_the_judges_tokens(
        model_dir, tmp_path, expected, capsys):
    """2 x 2 on the real data path; prefill 0 is SIGKILLed while it holds a computed
    request's pages (each prefill holds them 0.4 s after the compute). Its supervisor
    restarts it without its data path (the gloo world cannot take a rank back): the new
    life takes PrefillCrash, which ends exactly what its log shows queued or running
    (ErrPrefill), answers decode's cancels so decode frees their pages, and takes no new
    request; every other request gives the judge's tokens on prefill 1."""
    d = deployment(model_dir, tmp_path, 2, 2, seed=2, compute_s=0.4, arrive_every_s=0.02)
    victim = "prefill 0"
    run = run_with_fault(d, victim, lambda: _admitted(log_path(d, victim)), "an Admit",
                         start_s=WAIT_S, ready_s=60.0)
    done, stopped = run.done, run.stopped
    actions = _actions(log_path(d, victim))
    crash = actions.index(("PrefillCrash", None))
    ended = {r for a, r in actions[:crash] if a in ("SendDone", "Reject", "PrefillAbort")}
    first_life = {r for a, r in actions[:crash] if r is not None}
    assert first_life - ended, "the kill found nothing running"
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, outcome in outcomes.items() if outcome == "ErrPrefill"}
    on_victim = {r for r, (q, _) in enumerate(done["placement"]) if q == 0}
    print(f"ErrPrefill: {sorted(lost)}; on {victim}: {sorted(on_victim)}")
    assert first_life - ended <= lost <= on_victim - ended
    assert not [r for a, r in actions[crash + 1:] if a == "Admit"]  # no data path: no work
    for r, outcome in outcomes.items():
        if r not in lost:
            assert outcome == "Ok" and done["tokens"][r] == expected[r], r
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err


def test_workers_started_on_their_own_meet_in_the_rendezvous_store_and_give_the_judges_tokens(
        model_dir, tmp_path, expected, capsys):
    """1 x 1 on the real data path with both workers started by `kvproof worker`: their gloo
    world meets in the rendezvous's TCPStore (no shared folder), and every request gives
    the judge's tokens; a worker given another model file is refused as bad input."""
    from test_processes import _free_port, _worker

    rendezvous = f"127.0.0.1:{_free_port()}"
    d = deployment(model_dir, tmp_path, 1, 1, rendezvous=rendezvous)
    other = tmp_path / "other-model"
    make_hf_model("llama-gqa", other, seed=MODEL_SEED + 1)
    impostor = _worker("prefill", 1, 2, rendezvous, tmp_path / "impostor", "--model",
                       str(other))
    workers = [_worker("decode", 0, 2, rendezvous, tmp_path),
               _worker("prefill", 1, 2, rendezvous, tmp_path)]
    launched = Launched(d)
    try:
        launched.start(timeout_s=WAIT_S)
        done = launched.wait_done(WAIT_S)
        launched.stop(timeout_s=WAIT_S)
        codes = [w.wait(timeout=WAIT_S) for w in workers]
        refused = impostor.communicate(timeout=WAIT_S)[0]
    finally:
        launched.close()
        for w in [*workers, impostor]:
            w.kill()
    assert done["outcomes"] == ["Ok"] * len(SHAPES) and done["tokens"] == expected
    assert codes == [0, 0]
    assert impostor.returncode == 2 and "is not the deployment's model file" in refused
    merged, verdict = merged_run(tmp_path)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and "run OK: 134 steps" in out, out + err


def test_a_decode_killed_after_its_finish_line_answers_ok_with_the_judges_tokens(
        model_dir, tmp_path, expected, capsys):
    """2 x 2 on the real data path; decode 1 is killed right after it logs its first Finish,
    before the answer leaves (`die_after_step`). The router gives that client the answer
    the dead decode's log holds, Ok, with the judge's tokens (those that never came are in
    the Finish's line); what decode 1 still held ends ErrDecode, everything else is Ok with
    the judge's tokens, and the merged run validates."""
    d = deployment(model_dir, tmp_path, 2, 2, seed=2, die_after_step="decode 1:Finish")
    launched = Launched(d)
    try:
        launched.start(timeout_s=WAIT_S)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop(timeout_s=WAIT_S)
        recovered = [x for x in launched.children["router"].seen
                     if x["ev"] == "recovered_answer"]
    finally:
        launched.close()
    import json
    finish = next(x for x in map(json.loads, log_path(d, "decode 1").read_text()
                                 .splitlines()[1:]) if x.get("a") == "Finish")
    r = finish["request"]
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {k for k, o in outcomes.items() if o == "ErrDecode"}
    print(f"decode 1 died after Finish({r}); recovered {recovered}; ErrDecode {sorted(lost)}")
    assert finish["tokens"] == {str(r): expected[r]}  # every token it streamed, in its line
    assert [(x["request"], x["outcome"]) for x in recovered] == [(r, "Ok")]
    assert r not in lost and all(dd == 1 for k in lost for _, dd in [done["placement"][k]])
    for k, outcome in outcomes.items():
        if k not in lost:
            assert outcome == "Ok" and done["tokens"][k] == expected[k], k
    assert_one_decode_crash_validates(tmp_path, lost, stopped, capsys)
