"""Answers that a worker process logged and never sent (engine/processes.py,
`RouterProcess.recover_answers`). A process logs each step before anything the step sends
leaves it, so one killed between the two leaves a step whose answer its client never
heard, while the merged run says the client has it: a decode that logged Finish and died
before its answer left would have had its client answered ErrDecode by the crash's path
while `kvproof validate` accepted a run that says Ok. The router reads the dead worker's
log when it closes it and gives each such client the answer the step sent. Each test
kills a worker exactly in that window (`Deployment.die_after_step`), runs the deployment
to the end on 127.0.0.1 within bounds, stops every process and validates the merged logs.
"""

from __future__ import annotations

import json

from engine.processes import log_path
from tests.cli_cases import run as cli
from tests.test_processes import (WAIT_S, _reports, assert_new_life_served,
                                  assert_one_decode_crash_validates, assert_whole, deployment,
                                  merged_run, run_closed)


def _steps(path) -> list[dict]:
    return [x for x in map(json.loads, path.read_text().splitlines()[1:])
            if x.get("a") != "LogEnd"]


def test_a_decode_killed_after_logging_finish_gets_its_client_the_finish_answer(
        tmp_path, capsys):
    """Decode 1 of a 2 x 2 deployment logs its first Finish and is killed before the answer
    leaves. Its client gets Ok (the answer the step sent, from the log), not ErrDecode;
    the requests it still held end ErrDecode, every other one Ok; its new life serves the
    later requests; the merged run validates, and in it every client of the dead decode
    got Ok exactly when its log holds the Finish."""
    d = deployment(tmp_path, 2, 2, compute_s=0.2, arrive_every_s=0.02,
                   arrive_after_s=(0.02,) * 12 + (0.4,) * 7,
                   die_after_step="decode 1:Finish")
    ran = run_closed(d)
    done, stopped, router_seen = ran.done, ran.stopped, ran.launched.children["router"].seen
    victim = "decode 1"
    first_life = _steps(log_path(d, victim))
    died_after = next(x for x in first_life if x["a"] == "Finish")
    r = died_after["request"]
    recovered = [x for x in router_seen if x["ev"] == "recovered_answer"]
    placement = [tuple(x) for x in done["placement"]]
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {k for k, o in outcomes.items() if o == "ErrDecode"}
    print(f"decode 1 died after Finish({r}); recovered {recovered}; ErrDecode {sorted(lost)}")
    assert died_after["answers"] == [[r, [[0, 2]], ["answer"]]]  # (CLIENT, Ok)
    assert [(x["request"], x["step"], x["outcome"]) for x in recovered] == [(r, "Finish", "Ok")]
    assert outcomes[r] == "Ok"
    assert lost and all(placement[k][1] == 1 for k in lost)
    assert all(o == "Ok" for k, o in outcomes.items() if k not in lost)
    finished = {x["request"] for x in _steps(log_path(d, victim)) if x["a"] == "Finish"}
    assert {k for k, (_, dd) in enumerate(placement) if dd == 1} - lost <= finished
    assert lost.isdisjoint(finished)
    assert_one_decode_crash_validates(tmp_path, lost, stopped, capsys, restarted=True)
    assert_new_life_served(d, victim, lost, outcomes)


def test_a_prefill_killed_after_logging_its_done_has_its_new_life_send_it_again(
        tmp_path, capsys):
    """The one prefill of a 1 x 2 deployment logs its first SendDone and is killed before
    the Done leaves. The spec's Done is on the wire until decode takes it (PrefillCrash
    leaves it there), but no process holds it: decode would wait for it for ever, its
    pages held. The new life sends it again (the last final word of each request that no
    decode reported hearing), decode accepts it and the request finishes Ok; what the
    crash ended ends ErrPrefill, everything else Ok, every pool whole, the logs validate."""
    d = deployment(tmp_path, 1, 2, compute_s=0.05, arrive_every_s=0.02,
                   die_after_step="prefill 0:SendDone")
    ran = run_closed(d)
    done, stopped = ran.done, ran.stopped
    steps = _steps(log_path(d, "prefill 0"))
    crash = next(k for k, x in enumerate(steps) if x["a"] == "PrefillCrash")
    first_life = steps[:crash]
    r = first_life[-1]["request"]
    again = _reports(ran.launched, "prefill 0", "word_again")
    outcomes = dict(enumerate(done["outcomes"]))
    print(f"prefill 0 died after SendDone({r}); sent again {again}; outcomes {outcomes}")
    assert first_life[-1]["a"] == "SendDone"
    assert [(x["request"], x["step"]) for x in again] == [(r, "SendDone")]
    assert outcomes[r] == "Ok"
    ended = {x["request"] for x in first_life if x["a"] in ("SendDone", "Reject",
                                                             "PrefillAbort")}
    lost = {k for k, o in outcomes.items() if o == "ErrPrefill"}
    assert lost.isdisjoint(ended)
    assert all(o == "Ok" for k, o in outcomes.items() if k not in lost)
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    assert [x["a"] for x in merged.records].count("PrefillCrash") == 1
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err


def test_a_decode_killed_after_its_finish_line_holding_nothing_else_is_still_a_crash(
        tmp_path, capsys):
    """1 x 1, requests 0.3 s apart (each computes 0.05 s): decode 0 logs its first Finish,
    holding no other request, and is killed before the answer leaves. Its client gets Ok
    from the log, so no client waits on the dead decode, but decode still held that
    request's pages (Closing, not released): the crash takes them, so DecodeCrash is
    logged (the router asks decode's own log what it knew, `known_at`, not its clients),
    and the new life, which reserves those pages again, serves the later requests; the
    merged run validates. Before, no crash step was logged and the run held pages that
    the new life reused."""
    d = deployment(tmp_path, 1, 1, compute_s=0.05, arrive_every_s=0.3,
                   die_after_step="decode 0:Finish")
    ran = run_closed(d, WAIT_S + 10.0)
    done, stopped = ran.done, ran.stopped
    recovered = _reports(ran.launched, "router", "recovered_answer")
    first_life = _steps(log_path(d, "decode 0"))
    r = next(x for x in first_life if x["a"] == "Finish")["request"]
    outcomes = dict(enumerate(done["outcomes"]))
    print(f"decode 0 died after Finish({r}); outcomes {done['outcomes']}")
    assert [(x["request"], x["outcome"]) for x in recovered] == [(r, "Ok")]
    assert stopped["router"]["crashes"] == [0] and stopped["router"]["restarts"] == ["decode 0"]
    assert all(o in ("Ok", "ErrDecode") for o in outcomes.values())
    assert outcomes[r] == "Ok" and list(outcomes.values()).count("Ok") >= len(outcomes) - 2
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    crash = next(k for k, x in enumerate(merged.records) if x["a"] == "DecodeCrash")
    assert any(x["a"] == "Reserve" for x in merged.records[crash + 1:])  # the new life's
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
