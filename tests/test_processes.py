"""The protocol across real processes (engine/processes.py): a router and P prefill + D
decode OS processes on 127.0.0.1, each holding one part, a modelled data path, one log
per process. Each test runs a bounded workload to the end, stops every process (each ends
its log and exits 0), and hands the folder of logs to `kvproof validate`, which merges
them and checks the run against the spec. Every process is killed in a finally, every
wait is bounded.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from engine.processes import Deployment, Launched, log_path
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


def run_to_the_end(d: Deployment) -> tuple[dict, dict]:
    """The router's "done" report and every process's "stopped" report."""
    launched = Launched(d)
    try:
        launched.start()
        done = launched.wait_done(WAIT_S)
        return done, launched.stop()
    finally:
        launched.close()


def merged_run(folder: Path):
    m, logs = read_part_logs(sorted(folder.glob("*.ndjson")))
    merged = merge(m, logs)
    verdict = check_part_logs(merged)
    assert verdict.ok, verdict.message
    return merged, verdict


def assert_whole(stopped: dict) -> None:
    """Every process exited 0; every surviving pool is free; no write is left in flight."""
    for name, report in stopped.items():
        assert report["exit_code"] == 0, (name, report)
        assert report.get("pages_held", 0) == 0, (name, report)
        assert report.get("sending", 0) == 0, (name, report)


def assert_one_decode_crash_validates(folder: Path, lost: set[int], stopped: dict, capsys,
                                      restarted: bool = False):
    """After decode 1 of a 2 x 2 deployment was killed: the survivors (and its new life,
    when `restarted`: on the modelled data path) whole, the router's one crash record, and
    the logs (the dead decode's closed by the router, or gone on with by its new life)
    merging into one run with one DecodeCrash, no SendPage or SendDone of a lost request
    after it, that `kvproof validate` accepts. The merged run and its verdict."""
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
    assert not [x for x in after if x.get("request") in lost and x["a"] in ("SendPage",
                                                                            "SendDone")]
    code, out, err = cli(capsys, "validate", str(folder))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
    return merged, verdict


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


def test_a_killed_decode_ends_its_requests_and_the_rest_finish(tmp_path, capsys):
    """Decode 1 is killed while it holds two reserved requests (workload seed 7 places
    requests 5 and 10 there, one page each, 0.1 s apart; each computes 0.4 s). On the
    modelled data path its supervisor restarts it in a new epoch, and the last requests
    (0.4 s apart, after the first twelve 0.02 s apart) find it back."""
    d = deployment(tmp_path, 2, 2, compute_s=0.4, arrive_every_s=0.02,
                   arrive_after_s=(0.02,) * 12 + (0.4,) * 7)
    victim = "decode 1"
    launched = Launched(d)
    try:
        launched.start()
        deadline = time.monotonic() + WAIT_S
        while len(_reserved_unfinished(log_path(d, victim))) < 2:
            assert time.monotonic() < deadline, f"{victim} never reserved"
            time.sleep(0.005)
        killed_at = time.time()
        launched.kill(victim)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop()
        detected = {name: [x for x in launched.children[name].seen
                           if x["ev"] == "peer_down" and x["peer"] == victim]
                    for name in ("router", "prefill 0", "prefill 1")}
    finally:
        launched.close()
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
    crash = next(x["c"] for x in map(json.loads, log_path(d, "environment").read_text()
                                      .splitlines()[1:]) if x["a"] == "DecodeCrash")
    again = {x["request"] for x in map(json.loads, log_path(d, victim).read_text()
                                       .splitlines()[1:])
             if x["a"] == "Release" and x["c"] > crash}
    assert again and again.isdisjoint(lost) and all(outcomes[r] == "Ok" for r in again)
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
    launched = Launched(d)
    try:
        launched.start()
        deadline = time.monotonic() + WAIT_S
        while True:
            steps = _prefill_steps(log_path(d, victim))
            if steps and steps[-1]["a"] == last:
                break
            assert time.monotonic() < deadline, f"{victim} never took a {last}"
            time.sleep(0.002)
        killed_at = time.time()
        launched.children[victim].process.send_signal(sent)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop()
        seen = launched.children["router"].seen
        restarts = [x for x in seen if x["ev"] == "restart"]
        detected = [x["at_s"] - killed_at for x in seen
                    if x["ev"] == "peer_down" and x["peer"] == victim]
    finally:
        launched.close()
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
    launched = Launched(d)
    try:
        launched.start()
        deadline = time.monotonic() + WAIT_S
        while not _reserved_unfinished(log_path(d, victim)):
            assert time.monotonic() < deadline, f"{victim} never reserved"
            time.sleep(0.005)
        launched.children[victim].process.send_signal(signal.SIGTERM)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop()
        draining = _reports(launched, victim, "draining")
        drained = _reports(launched, victim, "drained")
        exit_code = launched.children[victim].process.wait(timeout=WAIT_S)
    finally:
        launched.close()
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
    launched = Launched(d)
    try:
        launched.start()
        deadline = time.monotonic() + WAIT_S
        while not [x for x in _prefill_steps(log_path(d, victim)) if x["a"] == "Admit"]:
            assert time.monotonic() < deadline, f"{victim} never admitted"
            time.sleep(0.005)
        launched.children[victim].process.send_signal(signal.SIGTERM)
        done = launched.wait_done(WAIT_S)
        stopped = launched.stop()
        drained = _reports(launched, victim, "drained")
    finally:
        launched.close()
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
