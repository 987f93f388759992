"""A prefill's new life that fails too (engine/processes.py): one that dies before it says
it is back (after its PrefillCrash line, before its `restarted`), and one that never starts
(it exits before it listens: the launcher's restart reports `life_failed`). Before, the
router waited on either for good: the restart was marked in progress, and the requests it
held waited with their decodes' pages. Each test runs a 1 x 2 deployment on 127.0.0.1 to
the end within bounds, stops every process, and validates the merged logs."""

from __future__ import annotations

import json

import pytest

from engine.processes import log_path
from tests.cli_cases import run as cli
from tests.test_processes import WAIT_S, assert_whole, deployment, merged_run, run_closed

FAULTS = {
    # the second life logs its PrefillCrash (its answers end what the first held) and dies
    # before it tells the router it is back
    "dies after its crash step": dict(die_after_step="prefill 0:PrefillCrash@2"),
    # the second life exits before it listens: its launcher cannot start it
    "never starts": dict(die_at_start="prefill 0@2"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_prefill_whose_second_life_fails_gets_a_third_that_serves(tmp_path, capsys, fault):
    """Prefill 0 of 1 x 2 dies after its first Admit (its first life), and its second life
    fails too (`fault`). The router restarts it a second time: the third life ends what
    the first held (ErrPrefill, its decodes time those requests out and free their pages),
    and serves the requests that arrive after it is back; every pool is whole and the logs
    validate."""
    hooks = {**FAULTS[fault]}
    hooks["die_after_step"] = ",".join(["prefill 0:Admit"] + (
        [hooks["die_after_step"]] if "die_after_step" in hooks else []))
    d = deployment(tmp_path, 1, 2, compute_s=0.05, arrive_every_s=0.3, **hooks)
    ran = run_closed(d, WAIT_S + 20.0)
    done, stopped, router = ran.done, ran.stopped, ran.launched.children["router"].seen
    restarts = [x["restart"] for x in router if x["ev"] == "restart"]
    failed = [x for x in router if x["ev"] == "life_failed"]
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, o in outcomes.items() if o == "ErrPrefill"}
    print(f"{fault}: restarts to {[x['epoch'] for x in restarts]}, life_failed {failed}, "
          f"ErrPrefill {sorted(lost)}, outcomes {done['outcomes']}")
    assert [x["epoch"] for x in restarts] == [2, 3]
    assert stopped["router"]["restarts"] == ["prefill 0", "prefill 0"]
    if fault == "never starts":
        assert [(x["epoch"], x["role"]) for x in failed] == [(2, "prefill")]
    steps = [x for x in map(json.loads, log_path(d, "prefill 0").read_text().splitlines()[1:])
             if x.get("a") != "LogEnd"]
    first_life = steps[:next(k for k, x in enumerate(steps) if x["a"] == "PrefillCrash")]
    placed_first = {r for r, _, _ in restarts[0]["placed"]}
    ended_first = {x["request"] for x in first_life if x["a"] in ("SendDone", "Reject",
                                                                   "PrefillAbort")}
    assert lost == placed_first - ended_first and lost
    assert all(o == "Ok" for r, o in outcomes.items() if r not in lost), outcomes
    served = {x["request"] for x in steps if x["a"] == "SendDone"} - ended_first
    assert served and served.isdisjoint(placed_first)  # the third life's
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
