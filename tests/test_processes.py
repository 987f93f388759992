"""The protocol across real processes (engine/processes.py): a router and P prefill + D
decode OS processes on 127.0.0.1, each holding one part, a modelled data path, one log
per process. Each test runs a bounded workload to the end, stops every process (each ends
its log and exits 0), and hands the folder of logs to `kvproof validate`, which merges
them and checks the run against the spec. Every process is killed in a finally, every
wait is bounded.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.channel import Peer
from engine.processes import Deployment, Launched, RouterProcess, WorkerRefused, log_path
from sim.trace import read_part_logs
from spec import codec, core
from spec.partlog import merge
from spec.tlaplus.runcheck import check_part_logs
from tests.cli_cases import run as cli

SEED = 7
REQUESTS = 20
WAIT_S = 20.0     # the longest any step waits for the processes
SLACK_S = 1.0     # scheduling on 2 loaded cores: a detection may come this much late
# A live process starved of the CPU this long would be declared down: far above what a
# loaded CI runner does, and a SIGKILL is detected at once anyway (its connections break).
SUSPECT_S = 3.0


def workload(seed: int = SEED) -> tuple:
    """20 prompts of 1-3 pages; with pools of 4 pages per worker, requests wait for room."""
    print(f"workload seed={seed}")
    rng = random.Random(seed)
    return tuple(rng.randint(1, 3) for _ in range(REQUESTS))


def deployment(tmp_path: Path, prefills: int, decodes: int, **options) -> Deployment:
    print(f"deployment {prefills} x {decodes}, router seed={SEED}, logs in {tmp_path}")
    return Deployment(prompts=workload(), prefill_workers=prefills, decode_workers=decodes,
                      prefill_pages=4, decode_pages=4, seed=SEED, log_dir=str(tmp_path),
                      heartbeat_s=0.25, suspect_after_s=SUSPECT_S, **options)


@dataclass
class Ran:
    """A deployment run to the end: its launcher (closed: its children's reports stay),
    the router's "done" and every live process's "stopped" report."""

    launched: Launched
    done: dict
    stopped: dict


def run_closed(d: Deployment, wait_s: float = WAIT_S) -> Ran:
    """Start `d`, wait at most `wait_s` for the router's done, stop every process and close
    the deployment whatever happens."""
    launched = Launched(d)
    try:
        launched.start()
        done = launched.wait_done(wait_s)
        return Ran(launched, done, launched.stop(timeout_s=WAIT_S))
    finally:
        launched.close()


def run_to_the_end(d: Deployment) -> tuple[dict, dict]:
    """The router's "done" report and every process's "stopped" report."""
    ran = run_closed(d)
    return ran.done, ran.stopped


def merged_run(folder: Path):
    m, logs = read_part_logs(sorted(folder.glob("*.ndjson")))
    merged = merge(m, logs)
    verdict = check_part_logs(merged)
    assert verdict.ok, verdict.message
    return merged, verdict


def until(ready, what: str, timeout_s: float = WAIT_S, poll_s: float = 0.002) -> None:
    """Wait until `ready()` holds, at most `timeout_s` (an AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"{what} never came within {timeout_s} s"
        time.sleep(poll_s)


def assert_validates(folder: Path, capsys):
    """The folder's logs merge into one run that the checker and `kvproof validate` accept;
    the merged run and its verdict."""
    merged, verdict = merged_run(folder)
    code, out, err = cli(capsys, "validate", str(folder))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
    return merged, verdict


def assert_whole(stopped: dict) -> None:
    """Every process exited 0; every surviving pool is free; no write is left in flight."""
    for name, report in stopped.items():
        assert report["exit_code"] == 0, (name, report)
        assert report.get("pages_held", 0) == 0, (name, report)
        assert report.get("sending", 0) == 0, (name, report)


def assert_new_life_served(d: Deployment, victim: str, lost: set, outcomes: dict) -> None:
    """The dead decode's new life released requests after the crash step (in its log, gone
    on with), none the crash lost, each answered Ok."""
    crash = next(x["c"] for x in map(json.loads, log_path(d, "environment").read_text()
                                      .splitlines()[1:]) if x["a"] == "DecodeCrash")
    again = {x["request"] for x in map(json.loads, log_path(d, victim).read_text()
                                       .splitlines()[1:])
             if x["a"] == "Release" and x["c"] > crash}
    assert again and again.isdisjoint(lost) and all(outcomes[r] == "Ok" for r in again)


def assert_one_decode_crash_validates(folder: Path, lost: set[int], stopped: dict, capsys,
                                      restarted: bool = False):
    """After decode 1 of a 2 x 2 deployment was killed: the survivors (and its new life,
    when `restarted`: on the modelled data path) whole, the router's one crash record, and
    the logs (the dead decode's closed by the router, or gone on with by its new life)
    merging into one run with one DecodeCrash, no SendPage of a lost request after it (the
    crash dropped its page table; a prefill whose writes were all posted before may still
    say Done to the dead peer, as the spec allows), that `kvproof validate` accepts. The
    merged run and its verdict."""
    assert set(stopped) == {"router", "prefill 0", "prefill 1", "decode 0"} | (
        {"decode 1"} if restarted else set())
    assert stopped["router"]["restarts"] == (["decode 1"] if restarted else [])
    assert_whole(stopped)
    assert stopped["router"]["crashes"] == [1]
    merged, verdict = merged_run(folder)
    assert verdict.steps == sum(merged.parts.values())
    crashes = [x for x in merged.records if x["a"] == "DecodeCrash"]
    assert len(crashes) == 1 and codec.decode(crashes[0]) == core.DecodeCrash(1)
    after = merged.records[merged.records.index(crashes[0]) + 1:]
    assert not [x for x in after if x.get("request") in lost and x["a"] == "SendPage"]
    code, out, err = cli(capsys, "validate", str(folder))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
    return merged, verdict


@dataclass
class Faulted:
    """A deployment run to the end with one fault sent to one of its processes."""

    launched: Launched   # closed: its children's reports (`seen`) and exit codes stay
    done: dict           # the router's "done"
    stopped: dict        # every live process's "stopped" report, with its exit code
    at_s: float          # when the signal was sent (time.time(), as the reports' at_s)


def run_with_fault(d: Deployment, victim: str, ready, waits_for: str,
                   sent: int = signal.SIGKILL, start_s: float = 10.0,
                   wait_s: float = WAIT_S, ready_s: float = WAIT_S) -> Faulted:
    """Start `d`, wait at most `ready_s` until `ready()` holds (`waits_for` says what it
    waits for), send `sent` to `victim`, wait for the router's done, stop every live
    process (each ends its log) and close the deployment whatever happens."""
    launched = Launched(d)
    try:
        launched.start(timeout_s=start_s)
        deadline = time.monotonic() + ready_s
        while not ready():
            assert time.monotonic() < deadline, f"{victim}: {waits_for} never came"
            time.sleep(0.002)
        at_s = time.time()
        launched.children[victim].process.send_signal(sent)
        done = launched.wait_done(wait_s)
        return Faulted(launched, done, launched.stop(timeout_s=wait_s), at_s)
    finally:
        launched.close()


def expected_steps(prompts, placement, prefills: int, decodes: int) -> dict:
    """Fault-free, per part: Arrive; Admit, SendPage per page, SendDone; Reserve, Accept,
    Finish, Release; LandWrite per page."""
    out = {"router": len(prompts), "environment": sum(prompts)}
    for q in range(prefills):
        out[f"prefill {q}"] = sum(2 + n for n, (p, _) in zip(prompts, placement) if p == q)
    for k in range(decodes):
        out[f"decode {k}"] = 4 * sum(1 for _, d in placement if d == k)
    return out


def test_one_router_one_prefill_one_decode(tmp_path, capsys):
    d = deployment(tmp_path, 1, 1)
    started = time.monotonic()
    done, stopped = run_to_the_end(d)
    print(f"ran in {time.monotonic() - started:.2f} s")
    assert done["outcomes"] == ["Ok"] * REQUESTS
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    assert sum(d.prompts) == 33
    assert merged.parts == {"router": 20, "prefill 0": 73, "decode 0": 80, "environment": 33}
    assert verdict.steps == 206
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0, out + err
    assert "run OK: 206 steps" in out


def test_two_prefills_two_decodes(tmp_path):
    d = deployment(tmp_path, 2, 2)
    done, stopped = run_to_the_end(d)
    placement = [tuple(x) for x in done["placement"]]
    assert done["outcomes"] == ["Ok"] * REQUESTS
    assert {p for p, _ in placement} == {0, 1} and {k for _, k in placement} == {0, 1}
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    assert merged.parts == expected_steps(d.prompts, placement, 2, 2)
    assert verdict.steps == 206


def _decode_log(path: Path) -> Counter:
    """(action, request) of every whole record of a decode's log, counted."""
    records = [json.loads(line) for line in path.read_text().splitlines()[1:]
               if line.endswith("}")]
    return Counter((x["a"], x.get("request")) for x in records)


def _reserved_unfinished(path: Path) -> list[int]:
    """Requests the decode's log shows reserved and not yet accepted."""
    actions = _decode_log(path)
    return [r for a, r in actions if a == "Reserve" and ("Accept", r) not in actions]


@pytest.mark.parametrize("sent, later_s", [(signal.SIGKILL, 0.4), (signal.SIGSTOP, 0.8)],
                         ids=["killed", "partitioned"])
def test_a_killed_decode_ends_its_requests_and_the_rest_finish(tmp_path, capsys, sent,
                                                               later_s):
    """Decode 1 is killed (or stopped: a partition, found by the heartbeats' bound) while it
    holds two reserved requests (workload seed 7 places requests 5 and 10 there, one page
    each, 0.1 s apart; each computes 0.4 s). On the modelled data path its supervisor fences
    it and restarts it in a new epoch, and the last requests (`later_s` apart, after the
    first twelve 0.02 s apart) find it back."""
    d = deployment(tmp_path, 2, 2, compute_s=0.4, arrive_every_s=0.02,
                   arrive_after_s=(0.02,) * 12 + (later_s,) * 7)
    victim = "decode 1"
    run = run_with_fault(d, victim, lambda: len(_reserved_unfinished(log_path(d, victim))) >= 2,
                         "two reserved requests", sent)
    done, stopped, killed_at = run.done, run.stopped, run.at_s
    detected = {name: [x for x in run.launched.children[name].seen
                       if x["ev"] == "peer_down" and x["peer"] == victim]
                for name in ("router", "prefill 0", "prefill 1")}
    # Every survivor learnt it from its own failure detector, within the bound.
    for name, downs in detected.items():
        assert len(downs) == 1, (name, downs)
        late_s = downs[0]["at_s"] - killed_at
        print(f"{name} declared {victim} down after {late_s:.3f} s: {downs[0]['reason']}")
        assert late_s < d.suspect_after_s + SLACK_S
    # The requests the dead decode held end ErrDecode; every other one finishes.
    placement = [tuple(x) for x in done["placement"]]
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, outcome in outcomes.items() if outcome == "ErrDecode"}
    print(f"ErrDecode: {sorted(lost)}; on {victim}: "
          f"{sorted(r for r, (_, k) in enumerate(placement) if k == 1)}")
    assert len(lost) >= 2 and all(placement[r][1] == 1 for r in lost)
    assert all(outcome == "Ok" for r, outcome in outcomes.items() if r not in lost)
    # A client of the dead decode got Ok exactly when its log holds the Finish.
    finished = _decode_log(log_path(d, victim))
    assert {r for r, (_, k) in enumerate(placement) if k == 1 and ("Finish", r) in finished} \
        == {r for r, (_, k) in enumerate(placement) if k == 1} - lost
    # The dead decode's log, gone on with by its new life, merges with the others into one
    # run; the new life served requests placed there after it was back.
    merged, verdict = assert_one_decode_crash_validates(tmp_path, lost, stopped, capsys,
                                                        restarted=True)
    assert_new_life_served(d, victim, lost, outcomes)
    print(f"seed={SEED}: ErrDecode {sorted(lost)}, merged run of {verdict.steps} steps, "
          f"detected after {[round(x[0]['at_s'] - killed_at, 3) for x in detected.values()]} s")


def _prefill_steps(path: Path) -> list[dict]:
    return [x for x in map(json.loads, path.read_text().splitlines()[1:])
            if x.get("part", "").startswith("prefill") and x["a"] != "LogEnd"]


# Where prefill 0 is killed: a request it admitted and still computes (the modelled compute
# holds its SendPage), or one whose writes are out (a hold before its SendDone); or where it
# is partitioned (SIGSTOP: it stops answering without closing anything).
KILL_POINTS = {"computing": ("Admit", dict(compute_s=0.4), signal.SIGKILL),
               "sending": ("SendPage", dict(compute_s=0.05, send_done_after_s=0.4),
                           signal.SIGKILL),
               # (arrivals spread over more than the detection bound: some come after)
               "partitioned": ("Admit", dict(compute_s=0.4, arrive_every_s=0.25),
                               signal.SIGSTOP)}


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_a_killed_prefill_restarts_ends_what_it_held_and_serves_again(tmp_path, capsys, point):
    """The one prefill of a 1 x 2 deployment is killed (or stopped: a partition, found by
    the heartbeats' bound) at a chosen protocol point. The router (its supervisor) has it
    fenced and restarted in a new epoch once every decode has reported the death; the new
    life rebuilds what its log says and takes PrefillCrash, whose answers end exactly the
    requests its log shows queued or running (ErrPrefill); decode times them out and
    releases their pages once the new life answers its cancels; every other request
    finishes, later ones on the new life; the logs merge into one run that `kvproof
    validate` accepts."""
    last, options, sent = KILL_POINTS[point]
    d = deployment(tmp_path, 1, 2, **{"arrive_every_s": 0.02, **options})
    victim = "prefill 0"

    def ready() -> bool:
        steps = _prefill_steps(log_path(d, victim))
        return bool(steps) and steps[-1]["a"] == last
    run = run_with_fault(d, victim, ready, f"a {last} as its last step", sent)
    done, stopped = run.done, run.stopped
    seen = run.launched.children["router"].seen
    restarts = [x for x in seen if x["ev"] == "restart"]
    detected = [x["at_s"] - run.at_s for x in seen
                if x["ev"] == "peer_down" and x["peer"] == victim]
    assert len(detected) == 1 and detected[0] < d.suspect_after_s + SLACK_S, detected
    assert stopped["router"]["restarts"] == ["prefill 0"] and len(restarts) == 1
    assert restarts[0]["restart"]["epoch"] == 2
    assert_whole(stopped)  # the new life and both decodes hold no page
    steps = _prefill_steps(log_path(d, victim))
    crash = next(k for k, x in enumerate(steps) if x["a"] == "PrefillCrash")
    first_life, second_life = steps[:crash], steps[crash + 1:]
    ended = {x["request"] for x in first_life if x["a"] in ("SendDone", "Reject",
                                                             "PrefillAbort")}
    placed_before = {r for r, _, _ in restarts[0]["restart"]["placed"]}
    lost = placed_before - ended
    outcomes = dict(enumerate(done["outcomes"]))
    print(f"{point}: {sent.name} after {first_life[-1]['a']}({first_life[-1]['request']}), "
          f"detected in {detected[0]:.3f} s; "
          f"lost {sorted(lost)}; outcomes {done['outcomes']}")
    assert first_life[-1]["a"] == last and first_life[-1]["request"] in lost
    assert {r for r, o in outcomes.items() if o == "ErrPrefill"} == lost
    assert all(o == "Ok" for r, o in outcomes.items() if r not in lost)
    # The new life served requests that arrived after it was back.
    served = {x["request"] for x in second_life if x["a"] == "SendDone"}
    assert served and served.isdisjoint(lost) and served.isdisjoint(placed_before)
    merged, verdict = merged_run(tmp_path)
    assert [x["a"] for x in merged.records].count("PrefillCrash") == 1
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err


def _admitted(path: Path) -> bool:
    return any(x["a"] == "Admit" for x in _prefill_steps(path))


def _reports(launched: Launched, name: str, ev: str) -> list[dict]:
    return [x for child in [*launched.previous, launched.children[name]]
            if child.name == name for x in child.seen if x["ev"] == ev]


def test_a_decode_asked_to_stop_drains_what_it_holds_and_leaves(tmp_path, capsys):
    """SIGTERM to decode 1 of a 1 x 2 deployment while it holds reserved requests: it tells
    the router, which places nothing more there; it finishes everything it held (and what
    was placed there before the router's farewell), ends its log and exits 0; its going is
    no crash (no DecodeCrash, no restart); every request is Ok and the logs validate."""
    d = deployment(tmp_path, 1, 2, compute_s=0.4, arrive_every_s=0.02,
                   arrive_after_s=(0.02,) * 12 + (0.3,) * 7)
    victim = "decode 1"
    run = run_with_fault(d, victim, lambda: bool(_reserved_unfinished(log_path(d, victim))),
                         "a reserved request", signal.SIGTERM)
    done, stopped = run.done, run.stopped
    draining = _reports(run.launched, victim, "draining")
    drained = _reports(run.launched, victim, "drained")
    exit_code = run.launched.children[victim].process.wait(timeout=WAIT_S)
    assert len(draining) == len(drained) == 1 and draining[0]["holds"], (draining, drained)
    assert drained[0]["left"] == [] and set(draining[0]["holds"]) <= set(drained[0]["finished"])
    on_victim = {r for r, (_, k) in enumerate(done["placement"]) if k == 1}
    assert on_victim == set(drained[0]["finished"])  # nothing placed there it did not finish
    assert exit_code == 0 and victim not in stopped
    assert done["outcomes"] == ["Ok"] * REQUESTS
    assert stopped["router"]["crashes"] == [] and stopped["router"]["restarts"] == []
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    assert "DecodeCrash" not in [x["a"] for x in merged.records]
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err


def test_a_prefill_whose_drain_runs_out_fails_the_rest_as_a_crash_does(tmp_path, capsys):
    """SIGTERM to prefill 0 of a 2 x 1 deployment whose compute (1 s) outlasts its drain
    bound (0.3 s): it reports what it finished and what it leaves, and exits; the crash's
    path ends exactly what it left (ErrPrefill) through a new life that takes no request;
    every other request is Ok on prefill 1; the logs validate."""
    d = deployment(tmp_path, 2, 1, compute_s=1.0, arrive_every_s=0.02, drain_s=0.3)
    victim = "prefill 0"
    run = run_with_fault(d, victim, lambda: _admitted(log_path(d, victim)), "an Admit",
                         signal.SIGTERM)
    done, stopped = run.done, run.stopped
    drained = _reports(run.launched, victim, "drained")
    assert len(drained) == 1 and drained[0]["left"], drained
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, o in outcomes.items() if o == "ErrPrefill"}
    on_victim = {r for r, (q, _) in enumerate(done["placement"]) if q == 0}
    assert set(drained[0]["left"]) <= lost <= on_victim - set(drained[0]["finished"])
    assert all(o == "Ok" for r, o in outcomes.items() if r not in lost)
    assert stopped["router"]["restarts"] == ["prefill 0"]
    steps = _prefill_steps(log_path(d, victim))
    crash = next(k for k, x in enumerate(steps) if x["a"] == "PrefillCrash")
    assert not [x for x in steps[crash + 1:] if x["a"] == "Admit"]  # its new life: no work
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err


# -- workers that start on their own and meet at a rendezvous (`kvproof worker`) ---------------

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(role: str, rank: int, world: int, rendezvous: str, log_dir: Path,
            *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "api.cli", "worker", role, "--rendezvous", rendezvous,
         "--rank", str(rank), "--world-size", str(world), "--log-dir", str(log_dir),
         "--join-timeout-s", str(WAIT_S), *more],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_workers_started_on_their_own_join_at_the_rendezvous_and_leave_with_the_router(
        tmp_path, capsys):
    """1 x 2 with every worker started by `kvproof worker` (as on other machines, here on
    127.0.0.1): the launcher hosts the rendezvous and starts only the router once all have
    joined; the run ends Ok; when the router stops, each worker ends its log and exits 0;
    the logs validate."""
    rendezvous = f"127.0.0.1:{_free_port()}"
    d = deployment(tmp_path, 1, 2, rendezvous=rendezvous, join_timeout_s=WAIT_S)
    workers = [_worker("decode", 0, 3, rendezvous, tmp_path),
               _worker("decode", 1, 3, rendezvous, tmp_path),
               _worker("prefill", 2, 3, rendezvous, tmp_path)]
    launched = Launched(d)
    try:
        launched.start(timeout_s=WAIT_S)
        assert set(launched.external) == {"decode 0", "decode 1", "prefill 0"}
        assert set(launched.children) == {"router"}
        done = launched.wait_done(WAIT_S)
        launched.stop()
        codes = [w.wait(timeout=WAIT_S) for w in workers]
    finally:
        launched.close()
        for w in workers:
            w.kill()
    outputs = [w.stdout.read() for w in workers]
    assert done["outcomes"] == ["Ok"] * REQUESTS
    assert codes == [0, 0, 0], outputs
    for out in outputs:
        stopped = [json.loads(line) for line in out.splitlines() if '"stopped"' in line]
        assert len(stopped) == 1 and stopped[0].get("pages_held", 0) == 0, out
    merged, verdict = merged_run(tmp_path)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err


def test_a_worker_that_does_not_fit_refuses_to_join_and_a_wrong_rank_is_bad_input(tmp_path):
    rendezvous = f"127.0.0.1:{_free_port()}"
    d = deployment(tmp_path, 1, 1, rendezvous=rendezvous, join_timeout_s=WAIT_S,
                   context_tokens=64, page_tokens=4)  # pools of 4 pages: 16 tokens
    workers = [_worker("decode", 0, 2, rendezvous, tmp_path),
               _worker("decode", 1, 2, rendezvous, tmp_path)]
    launched = Launched(d)
    try:
        with pytest.raises(WorkerRefused, match="decode-0's KV pool holds 16 tokens, less "
                                                "than the advertised context of 64"):
            launched.start(timeout_s=WAIT_S)
        outs = [w.communicate(timeout=WAIT_S)[0] for w in workers]
    finally:
        launched.close()
        for w in workers:
            w.kill()
    assert workers[0].returncode == 1 and "refuses to join" in outs[0]
    assert workers[1].returncode == 2 and "rank 1 is a prefill worker's" in outs[1], outs[1]


def test_a_worker_started_on_its_own_rejoins_when_started_again_after_it_died(tmp_path,
                                                                             capsys):
    """1 x 1 at a rendezvous: the prefill worker is SIGKILLed while it computes; the
    launcher publishes its next life's record, and `kvproof worker` started again for its
    rank picks it up, goes on with its log in epoch 2 and ends what the dead life held
    (ErrPrefill); the router dials it and the later requests are served there."""
    rendezvous = f"127.0.0.1:{_free_port()}"
    d = deployment(tmp_path, 1, 1, rendezvous=rendezvous, join_timeout_s=WAIT_S,
                   compute_s=0.4, arrive_after_s=(0.02,) * 4 + (0.3,) * 15)
    decode = _worker("decode", 0, 2, rendezvous, tmp_path)
    prefill = _worker("prefill", 1, 2, rendezvous, tmp_path)
    again = None
    launched = Launched(d)
    try:
        launched.start(timeout_s=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not _admitted(log_path(d, "prefill 0")):
            assert time.monotonic() < deadline, "prefill 0 never admitted"
            time.sleep(0.005)
        prefill.kill()
        while launched.rendezvous.get("restart/prefill 0") is None:
            assert time.monotonic() < deadline, "no restart record"
            time.sleep(0.01)
        again = _worker("prefill", 1, 2, rendezvous, tmp_path)
        done = launched.wait_done(WAIT_S)
        launched.stop()
        codes = [w.wait(timeout=WAIT_S) for w in (decode, again)]
    finally:
        launched.close()
        for w in (decode, prefill, again):
            if w is not None:
                w.kill()
    assert codes == [0, 0]
    assert launched.external["prefill 0"]["epoch"] == 2
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, o in outcomes.items() if o == "ErrPrefill"}
    assert lost and all(o == "Ok" for r, o in outcomes.items() if r not in lost)
    steps = _prefill_steps(log_path(d, "prefill 0"))
    crash = next(k for k, x in enumerate(steps) if x["a"] == "PrefillCrash")
    assert [x for x in steps[crash + 1:] if x["a"] == "SendDone"]  # served again
    merged, verdict = merged_run(tmp_path)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err


def _prefill_of(d: Deployment, r: int) -> int:
    """The prefill the router's log places request r on."""
    records = [json.loads(line) for line in log_path(d, "router").read_text().splitlines()[1:]
               if line.endswith("}")]
    return next(x.get("prefill_worker", 0) for x in records  # (0: not written)
                if x["a"] == "Arrive" and x["request"] == r)


def test_a_partition_between_a_prefill_and_a_decode_fences_the_decode(tmp_path, capsys):
    """A one-link partition (a fault-injection hook: prefill q cuts its connection to decode
    1 and never takes that epoch back) while decode 1 holds two reserved requests, one of
    them q's. Both ends of the link see it break; the router still sees decode 1 alive, so
    it fences it: cuts it off, has its launcher kill it (its first life exits by SIGKILL),
    and only then closes its log and records the crash (the barrier: its own verdict and
    each live prefill's report). Every request decode 1 held ends ErrDecode, every other is
    Ok, decode 1's new life (epoch 2) serves the later requests, every survivor's pool is
    free with nothing in flight, and the merged logs validate with one DecodeCrash."""
    d = deployment(tmp_path, 2, 2, compute_s=0.4, arrive_every_s=0.02,
                   arrive_after_s=(0.02,) * 12 + (0.8,) * 7)
    victim = "decode 1"
    launched = Launched(d)
    try:
        launched.start()
        deadline = time.monotonic() + WAIT_S
        while len(held := _reserved_unfinished(log_path(d, victim))) < 2:
            assert time.monotonic() < deadline, "decode 1 never held two reserved requests"
            time.sleep(0.002)
        q = _prefill_of(d, held[0])
        cut_at_s = time.time()
        launched.children[f"prefill {q}"].tell("partition", decode=1)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop(timeout_s=WAIT_S)
    finally:
        launched.close()
    router = launched.children["router"].seen
    fences = [x for x in router if x["ev"] == "fence"]
    fenced = [x for x in router if x["ev"] == "fenced"]
    assert [(x["role"], x["worker"]) for x in fences] == [("decode", 1)], fences
    assert fences[0]["reason"] == f"prefill {q} lost its connection to it"
    assert len(fenced) == 1 and fenced[0]["at_s"] >= fences[0]["at_s"]
    first_life = next(c for c in launched.previous if c.name == victim)
    assert first_life.process.returncode == -signal.SIGKILL  # fenced: killed, not crashed
    figures = (f"prefill {q} cut decode 1: fenced after {fences[0]['at_s'] - cut_at_s:.3f} s, "
               f"dead after {fenced[0]['at_s'] - cut_at_s:.3f} s")
    assert fenced[0]["at_s"] - cut_at_s < SLACK_S  # no detector's bound: the link broke
    placement = [tuple(x) for x in done["placement"]]
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, outcome in outcomes.items() if outcome == "ErrDecode"}
    figures += f"; held {held} (prefill {q}'s {held[0]}); ErrDecode {sorted(lost)}"
    assert set(held) <= lost and all(placement[r][1] == 1 for r in lost)
    assert all(outcome == "Ok" for r, outcome in outcomes.items() if r not in lost)
    merged, verdict = assert_one_decode_crash_validates(tmp_path, lost, stopped, capsys,
                                                        restarted=True)
    restarts = [x for x in router if x["ev"] == "restart"]
    assert [x["restart"]["epoch"] for x in restarts] == [2]
    assert_new_life_served(d, victim, lost, outcomes)
    print(f"seed={SEED}: {figures}; merged run of {verdict.steps} steps")


def test_a_prefill_that_dies_in_every_life_gets_a_last_one_that_ends_what_it_held(tmp_path,
                                                                                 capsys):
    """Prefill 0 of a 2 x 1 deployment with restarts_max 1 is killed after an Admit in its
    first life and again in its second: the router gives up serving there (`gave_up`) but
    still starts a last life (epoch 3) that takes no request, whose PrefillCrash ends what
    the second life held (ErrPrefill), and whose answers to decode's cancels free decode's
    pages; every other request is Ok (on prefill 1 or an earlier life); pools free; two
    PrefillCrash in the merged run, which validates."""
    d = deployment(tmp_path, 2, 1, compute_s=0.4, arrive_every_s=0.25, restarts_max=1)
    victim = "prefill 0"
    path = log_path(d, victim)

    def admitted_in_life(life: int) -> bool:
        steps = _prefill_steps(path)
        crashes = [k for k, x in enumerate(steps) if x["a"] == "PrefillCrash"]
        if len(crashes) < life - 1:
            return False
        since = crashes[life - 2] + 1 if life > 1 else 0
        return any(x["a"] == "Admit" for x in steps[since:])
    launched = Launched(d)
    try:
        launched.start()
        for life in (1, 2):
            deadline = time.monotonic() + WAIT_S
            while not admitted_in_life(life):
                assert time.monotonic() < deadline, f"no Admit in life {life}"
                time.sleep(0.002)
            launched.children[victim].kill()
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop(timeout_s=WAIT_S)
    finally:
        launched.close()
    seen = launched.children["router"].seen
    assert [x["restart"]["epoch"] for x in seen if x["ev"] == "restart"] == [2, 3]
    assert [x["worker"] for x in seen if x["ev"] == "gave_up"] == [0]
    assert stopped["router"]["restarts"] == ["prefill 0", "prefill 0"]
    steps = _prefill_steps(path)
    crashes = [k for k, x in enumerate(steps) if x["a"] == "PrefillCrash"]
    assert len(crashes) == 2
    second_life, last_life = steps[crashes[0] + 1:crashes[1]], steps[crashes[1] + 1:]
    assert not [x for x in last_life if x["a"] == "Admit"]  # it takes no request
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, o in outcomes.items() if o == "ErrPrefill"}
    admitted = {x["request"] for x in second_life if x["a"] == "Admit"}
    ended = {x["request"] for x in second_life if x["a"] in ("SendDone", "Reject",
                                                              "PrefillAbort")}
    assert admitted - ended and admitted - ended <= lost
    assert all(o == "Ok" for r, o in outcomes.items() if r not in lost)
    assert_whole(stopped)  # decode 0 and prefill 1 free, the last life holds nothing
    merged, verdict = merged_run(tmp_path)
    assert [x["a"] for x in merged.records].count("PrefillCrash") == 2
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
    print(f"seed={SEED}: ErrPrefill {sorted(lost)} (second life left "
          f"{sorted(admitted - ended)}), merged run of {verdict.steps} steps")


def test_a_worker_started_on_its_own_cut_off_from_its_router_fences_itself(tmp_path,
                                                                          capsys):
    """1 x 2 at a rendezvous; a partition between the router and decode 1 (a fault-injection
    hook: the router cuts its link) while decode 1 holds a reserved request. Decode 1 is
    not the launcher's to kill: it fences itself on losing its router without the router's
    bye (no step logged from then on, exit 3), and the router waits `fence_wait_s` before
    it closes decode 1's log and records the crash; its requests end ErrDecode, the rest
    are Ok on decode 0, the other workers end with the router (exit 0, pools free), and
    the logs validate."""
    rendezvous = f"127.0.0.1:{_free_port()}"
    d = deployment(tmp_path, 1, 2, rendezvous=rendezvous, join_timeout_s=WAIT_S,
                   compute_s=0.4, arrive_every_s=0.02)
    workers = [_worker("decode", 0, 3, rendezvous, tmp_path),
               _worker("decode", 1, 3, rendezvous, tmp_path),
               _worker("prefill", 2, 3, rendezvous, tmp_path)]
    victim = "decode 1"
    launched = Launched(d)
    try:
        launched.start(timeout_s=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not _reserved_unfinished(log_path(d, victim)):
            assert time.monotonic() < deadline, "decode 1 never held a reserved request"
            time.sleep(0.002)
        cut_at = time.monotonic()
        launched.children["router"].tell("partition", role="decode", worker=1)
        fenced_code = workers[1].wait(timeout=WAIT_S)
        fenced_after_s = time.monotonic() - cut_at
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop(timeout_s=WAIT_S)
        codes = [workers[0].wait(timeout=WAIT_S), workers[2].wait(timeout=WAIT_S)]
    finally:
        launched.close()
        for w in workers:
            w.kill()
    outputs = [w.stdout.read() for w in workers]
    assert fenced_code == 3 and '"ev": "fenced"' in outputs[1], outputs[1]
    assert fenced_after_s < SLACK_S  # the router's close reached it at once
    assert codes == [0, 0], outputs
    router = launched.children["router"].seen
    fence = next(x for x in router if x["ev"] == "fence")
    fenced = next(x for x in router if x["ev"] == "fenced")
    assert (fence["role"], fence["worker"]) == ("decode", 1)
    assert fenced["at_s"] - fence["at_s"] >= d.fence_wait_s()  # the worker's own bound
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, o in outcomes.items() if o == "ErrDecode"}
    placement = [tuple(x) for x in done["placement"]]
    assert lost and all(placement[r][1] == 1 for r in lost)
    assert all(o == "Ok" for r, o in outcomes.items() if r not in lost)
    for out in (outputs[0], outputs[2]):
        stopped_line = [json.loads(x) for x in out.splitlines() if '"stopped"' in x]
        assert len(stopped_line) == 1 and stopped_line[0].get("pages_held", 0) == 0, out
        assert stopped_line[0].get("sending", 0) == 0, out
    assert stopped["router"]["crashes"] == [1]
    merged, verdict = merged_run(tmp_path)
    assert [x["a"] for x in merged.records].count("DecodeCrash") == 1
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
    print(f"decode 1 fenced itself {fenced_after_s:.3f} s after the cut; the router waited "
          f"{fenced['at_s'] - fence['at_s']:.3f} s; ErrDecode {sorted(lost)}; "
          f"{verdict.steps} steps")


def test_the_only_decode_killed_and_restarted_arrivals_wait_for_its_new_life(tmp_path,
                                                                            capsys):
    """1 x 1: the one decode is killed while it holds a reserved request; while it is down
    no decode is live, so the arrivals wait (the router drew from an empty list before and
    died), its requests end ErrDecode, the later ones are Ok on its new life, the logs
    validate."""
    d = deployment(tmp_path, 1, 1, compute_s=0.4, arrive_every_s=0.1)
    victim = "decode 0"
    run = run_with_fault(d, victim, lambda: bool(_reserved_unfinished(log_path(d, victim))),
                         "a reserved request")
    outcomes = dict(enumerate(run.done["outcomes"]))
    lost = {r for r, o in outcomes.items() if o == "ErrDecode"}
    assert lost and all(o == "Ok" for r, o in outcomes.items() if r not in lost)
    assert run.stopped["router"]["restarts"] == [victim]
    assert_whole(run.stopped)
    merged, verdict = merged_run(tmp_path)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
    print(f"seed={SEED}: ErrDecode {sorted(lost)}, merged run of {verdict.steps} steps")


class _Life:
    """A stand-in for one life the launcher started (a Child): a real process to kill, its
    worker's name and its epoch; what the launcher tells it is kept."""

    def __init__(self, name: str, epoch: int) -> None:
        self.name, self.epoch, self.told = name, epoch, []
        self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def tell(self, do: str, **fields) -> None:
        self.told.append({"do": do, **fields})


def test_a_fence_kills_the_life_it_names_and_never_the_next(tmp_path):
    """The launcher's fence names an epoch: a fence of decode 1's first life answered after
    its second life started kills nothing of the second (the first is killed if it still
    runs) and is answered with that epoch; a fence of the second life kills it."""
    launched = Launched(Deployment(prompts=(1,), decode_workers=2, log_dir=str(tmp_path)))
    first, second, router = _Life("decode 1", 1), _Life("decode 1", 2), _Life("router", 1)
    launched.previous.append(first)
    launched.children.update({"decode 1": second, "router": router})
    try:
        launched.fence({"role": "decode", "worker": 1, "epoch": 1})
        assert first.process.poll() == -signal.SIGKILL and second.process.poll() is None
        assert router.told == [{"do": "fenced", "role": "decode", "worker": 1, "epoch": 1}]
        launched.fence({"role": "decode", "worker": 1, "epoch": 2})
        assert second.process.poll() == -signal.SIGKILL
        assert router.told[1]["epoch"] == 2
    finally:
        for life in (first, second, router):
            life.kill()


def test_the_router_takes_a_fence_s_answer_only_for_the_life_it_fenced(tmp_path, capsys):
    """The router fences decode 1's second life (epoch 2): a "fenced" answer naming epoch 1
    (a late answer about the life before) leaves that fence waiting; the answer naming
    epoch 2 ends it, and the crash's path goes on (a crash that lost nothing: no step, a
    restart into epoch 3)."""
    d = Deployment(prompts=(1,), decode_workers=2, log_dir=str(tmp_path))
    log_path(d, "decode 1").write_text(json.dumps({"header": True}) + "\n")
    router = RouterProcess(d)
    try:
        router.epochs["decode 1"] = 2
        router.on_peer_down(Peer("decode", 1), 2)
        assert router.fencing["decode 1"].epoch == 2
        router.command({"do": "fenced", "role": "decode", "worker": 1, "epoch": 1})
        assert "decode 1" in router.fencing and "decode 1" not in router.fenced
        router.command({"do": "fenced", "role": "decode", "worker": 1, "epoch": 2})
        assert "decode 1" not in router.fencing and router.restarts == ["decode 1"]
        reports = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [(x["ev"], x.get("epoch")) for x in reports] == [
            ("fence", 2), ("fenced", 2), ("restart", None)]
        assert reports[-1]["restart"]["epoch"] == 3
    finally:
        router.channel.close()


# -- two faults at once ----------------------------------------------------------------------

def _lives(path: Path) -> list[list[dict]]:
    """A prefill's steps, one list per life (a life ends at the next one's PrefillCrash)."""
    lives = [[]]
    for step in _prefill_steps(path):
        if step["a"] == "PrefillCrash":
            lives.append([])
        lives[-1].append(step)
    return lives


def _router_said(launched: Launched, ev: str, role: str, worker: int) -> bool:
    return any(x["ev"] == ev and x.get("role") == role and x.get("worker") == worker
               for x in list(launched.children["router"].seen))


# Which worker dies first, and when the second is sent its signal: once the router asked for
# the first one's restart (decode 1's crash recorded, its new life starting: prefill 0 dies
# before it could dial that life), or once the router fenced the first one (prefill 0's
# barrier waits for the decodes' reports: decode 1 dies while it waits).
OVERLAPS = {"decode-then-prefill": ("decode 1", "restart", "prefill 0", signal.SIGKILL),
            "decode-then-stopped-prefill": ("decode 1", "restart", "prefill 0",
                                            signal.SIGSTOP),
            "prefill-then-decode": ("prefill 0", "fence", "decode 1", signal.SIGKILL)}


@pytest.mark.parametrize("overlap", sorted(OVERLAPS))
def test_a_prefill_and_a_decode_that_die_together_both_restart_and_serve(tmp_path, capsys,
                                                                        overlap):
    """2 x 2: decode 1 is killed while it holds two reserved requests, or prefill 0 after an
    Admit whose compute it holds while decode 1 holds a reserved request; the other is killed (or stopped: found by the heartbeats'
    bound, then fenced) while the first one's crash is being handled, so the two restarts
    overlap. Neither barrier waits for a life that never saw the dead one: every request
    ends (ErrDecode only on decode 1, ErrPrefill only on prefill 0, every other Ok), every
    process that is left holds no page and no write, both workers' new lives serve later
    requests, and the logs merge into one run with one DecodeCrash and one PrefillCrash
    that `kvproof validate` accepts."""
    first, when, second, sent = OVERLAPS[overlap]
    d = deployment(tmp_path, 2, 2, compute_s=0.4, arrive_every_s=0.02,
                   arrive_after_s=(0.02,) * 12 + (0.8,) * 7)
    launched = Launched(d)
    try:
        launched.start()
        def ready() -> bool:
            held = len(_reserved_unfinished(log_path(d, "decode 1")))
            if first == "decode 1":
                return held >= 2
            steps = _prefill_steps(log_path(d, first))
            return held >= 1 and bool(steps) and steps[-1]["a"] == "Admit"
        until(ready, "decode 1 holding reserved requests" + (
            "" if first == "decode 1" else " and an Admit as prefill 0's last step"))
        launched.kill(first)
        role, _, worker = first.partition(" ")
        until(lambda: _router_said(launched, when, role, int(worker)),
              f"the router's {when} of {first}")
        launched.children[second].process.send_signal(sent)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop(timeout_s=WAIT_S)
    finally:
        launched.close()
        router = launched.children["router"].seen
        print(f"{overlap}: {first} killed, {second} sent {sent.name} at the router's {when}; "
              f"the router's reports: {[x for x in router if x['ev'] not in ('done', 'stopped')]}")
    placement = [tuple(x) for x in done["placement"]]
    outcomes = dict(enumerate(done["outcomes"]))
    print(f"outcomes {done['outcomes']}; placement {placement}")
    assert all(o in ("Ok", "ErrDecode", "ErrPrefill") for o in outcomes.values())
    assert all(placement[r][1] == 1 for r, o in outcomes.items() if o == "ErrDecode")
    assert all(placement[r][0] == 0 for r, o in outcomes.items() if o == "ErrPrefill")
    assert sorted(stopped["router"]["restarts"]) == ["decode 1", "prefill 0"]
    assert stopped["router"]["crashes"] == [1]
    assert set(stopped) == {"router", "prefill 0", "prefill 1", "decode 0", "decode 1"}
    assert_whole(stopped)  # both new lives too
    # Both new lives served requests placed there after they were back.
    lost = {r for r, o in outcomes.items() if o != "Ok"}
    assert_new_life_served(d, "decode 1", lost, outcomes)
    lives = _lives(log_path(d, "prefill 0"))
    assert len(lives) == 2
    served = {x["request"] for x in lives[1] if x["a"] == "SendDone"}
    assert served and all(outcomes[r] == "Ok" for r in served)
    merged, verdict = assert_validates(tmp_path, capsys)
    actions = [x["a"] for x in merged.records]
    assert actions.count("DecodeCrash") == 1 and actions.count("PrefillCrash") == 1
    print(f"seed={SEED}: ErrDecode {sorted(r for r in lost if outcomes[r] == 'ErrDecode')}, "
          f"ErrPrefill {sorted(r for r in lost if outcomes[r] == 'ErrPrefill')}; merged run "
          f"of {verdict.steps} steps")


@pytest.mark.parametrize("decodes", [2, 1], ids=["other-decode-serves", "only-decode"])
def test_a_partition_that_outlasts_the_restarts_fences_each_life_then_gives_up(tmp_path,
                                                                               capsys,
                                                                               decodes):
    """A lasting partition between prefill 0 and the last decode (the hook's "lasting": no
    later life of it is reached either), cut while that decode holds a reserved request,
    restarts_max 2 (once it released a request). Its first life is fenced (prefill 0 lost its link) and its crash
    recorded (ErrDecode for what it held); each new life is fenced in turn (prefill 0 cannot
    reach it), placed on never, so no crash step; after the second restart it is given up
    with the reason, its log closed. With another decode every later request is Ok there;
    with none, each later arrival is refused with that reason (it never arrives). Every
    life of it was killed, every other process exits 0 with its pool free, and the logs
    validate with one DecodeCrash."""
    victim = f"decode {decodes - 1}"
    d = deployment(tmp_path, 1, decodes, compute_s=0.4, restarts_max=2, arrive_every_s=0.02,
                   arrive_after_s=(0.02,) * 12 + (0.3,) * 7)
    launched = Launched(d)
    try:
        launched.start()
        until(lambda: _reserved_unfinished(log_path(d, victim)) and any(
            a == "Release" for a, _ in _decode_log(log_path(d, victim))),
            f"a released and a reserved request on {victim}")
        held = set(_reserved_unfinished(log_path(d, victim)))
        launched.children["prefill 0"].tell("partition", decode=decodes - 1, lasting=True)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop(timeout_s=WAIT_S)
    finally:
        launched.close()
    router = launched.children["router"].seen
    fences = [(x["epoch"], x["reason"]) for x in router if x["ev"] == "fence"]
    gave_up = [x for x in router if x["ev"] == "gave_up"]
    print(f"held {sorted(held)}; fences {fences}; gave up: {gave_up}")
    assert fences == [(1, "prefill 0 lost its connection to it"),
                      (2, "prefill 0 could not reach its new life"),
                      (3, "prefill 0 could not reach its new life")]
    assert [x["restart"]["epoch"] for x in router if x["ev"] == "restart"] == [2, 3]
    assert len(gave_up) == 1 and gave_up[0]["reason"] == (
        f"{victim} died in each of its 3 lives (restarts_max 2); its last life, epoch 3, "
        "was fenced: prefill 0 could not reach its new life")
    lives = [c for c in [*launched.previous, launched.children[victim]] if c.name == victim]
    assert [(c.epoch, c.process.returncode) for c in lives] == [
        (1, -signal.SIGKILL), (2, -signal.SIGKILL), (3, -signal.SIGKILL)]
    outcomes = dict(enumerate(done["outcomes"]))
    refused = {int(r): why for r, why in done["refused"].items()}
    lost = {r for r, o in outcomes.items() if o == "ErrDecode"}
    on_victim = {r for r, x in enumerate(done["placement"]) if x and x[1] == decodes - 1}
    assert lost and lost <= on_victim
    # A client of the partitioned decode got Ok exactly when its log holds the Finish: cut
    # off but alive until the kill, it may log a Finish whose answer the router no longer
    # takes over the link, and the router gives that answer from the log it closes
    # (`recover_answers`).
    finished = _decode_log(log_path(d, victim))
    assert {r for r in on_victim if ("Finish", r) in finished} == on_victim - lost
    if decodes == 2:
        assert not refused
    else:
        assert refused and set(refused.values()) == {
            f"no live decode worker: {gave_up[0]['reason']}"}
        assert all(outcomes[r] == "Idle" and done["placement"][r] is None for r in refused)
    assert all(o == "Ok" for r, o in outcomes.items() if r not in lost | set(refused))
    assert set(stopped) == {"router", "prefill 0"} | ({"decode 0"} if decodes == 2 else set())
    assert_whole(stopped)
    merged, verdict = assert_validates(tmp_path, capsys)
    assert [x["a"] for x in merged.records].count("DecodeCrash") == 1
    print(f"seed={SEED}: ErrDecode {sorted(lost)}, refused {sorted(refused)}, merged run of "
          f"{verdict.steps} steps")


def test_a_decode_started_on_its_own_rejoins_in_a_new_epoch_when_started_again(tmp_path,
                                                                              capsys):
    """1 x 2 at a rendezvous: decode 1 is SIGKILLed while it holds a reserved request. Not
    the launcher's to kill or start: the router waits `fence_wait_s`, records the crash
    (ErrDecode for what it held) and publishes its next life's record; `kvproof worker
    decode` started again for rank 1 picks it up and goes on with its log in epoch 2; the
    router dials it and passes its address on to the prefill (which takes no command on
    stdin), and once the prefill is linked to it the later requests are served there; every
    worker exits 0 with the router, pools free, and the logs validate."""
    rendezvous = f"127.0.0.1:{_free_port()}"
    d = deployment(tmp_path, 1, 2, rendezvous=rendezvous, join_timeout_s=WAIT_S,
                   compute_s=0.4, arrive_after_s=(0.02,) * 6 + (0.5,) * 13)
    workers = {"decode 0": _worker("decode", 0, 3, rendezvous, tmp_path),
               "decode 1": _worker("decode", 1, 3, rendezvous, tmp_path),
               "prefill 0": _worker("prefill", 2, 3, rendezvous, tmp_path)}
    first_life = workers["decode 1"]
    launched = Launched(d)
    try:
        launched.start(timeout_s=WAIT_S)
        until(lambda: _reserved_unfinished(log_path(d, "decode 1")),
              "a reserved request on decode 1")
        first_life.kill()
        until(lambda: launched.rendezvous.get("restart/decode 1") is not None,
              "decode 1's restart record", poll_s=0.01)
        workers["decode 1"] = _worker("decode", 1, 3, rendezvous, tmp_path)
        done = launched.wait_done(WAIT_S)
        launched.stop()
        codes = {name: w.wait(timeout=WAIT_S) for name, w in workers.items()}
    finally:
        launched.close()
        for w in [first_life, *workers.values()]:
            w.kill()
    outputs = {name: w.stdout.read() for name, w in workers.items()}
    assert codes == {"decode 0": 0, "decode 1": 0, "prefill 0": 0}, outputs
    assert launched.external["decode 1"]["epoch"] == 2
    router = launched.children["router"].seen
    assert [x["restart"]["epoch"] for x in router if x["ev"] == "restart"] == [2]
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, o in outcomes.items() if o == "ErrDecode"}
    assert lost and all(done["placement"][r][1] == 1 for r in lost)
    assert all(o == "Ok" for r, o in outcomes.items() if r not in lost)
    assert_new_life_served(d, "decode 1", lost, outcomes)
    for out in outputs.values():
        stopped = [json.loads(x) for x in out.splitlines() if '"stopped"' in x]
        assert len(stopped) == 1 and stopped[0].get("pages_held", 0) == 0, out
        assert stopped[0].get("sending", 0) == 0, out
    merged, verdict = assert_validates(tmp_path, capsys)
    assert [x["a"] for x in merged.records].count("DecodeCrash") == 1
    print(f"seed={SEED}: ErrDecode {sorted(lost)}, merged run of {verdict.steps} steps")
